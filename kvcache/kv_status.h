/*
 * kv_status.h - status codes and error detail for every kvcache call.
 *
 * Every fallible call returns a kv_status (KV_OK == 0). The list lives in one
 * X-macro so the enum, kv_status_name() and kv_strerror() can never drift.
 * Detail for the last failure on the calling thread (which argument, which
 * value, which limit) is read with kv_last_error().
 */
#ifndef KV_STATUS_H
#define KV_STATUS_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* KV_API marks the exported API (everything else is hidden in the .so). */
/* KV_NODISCARD marks every call returning a kv_status: ignoring one is a
 * compile warning (an error with -Werror), since a failed call changes
 * nothing and its output is not written. */
#if defined(__GNUC__)
#define KV_API __attribute__((visibility("default")))
#define KV_NODISCARD __attribute__((warn_unused_result))
#define KV_PRINTF(f, a) __attribute__((format(printf, f, a)))
#else
#define KV_API
#define KV_NODISCARD
#define KV_PRINTF(f, a)
#endif

/* A CUDA stream: the same type as cudaStream_t (a caller passes one as is),
 * declared here so that callers and headers need no CUDA header; NULL is the
 * legacy default stream. */
typedef struct CUstream_st *kv_cuda_stream;

/* X(name, value, message) */
#define KV_STATUS_MAP(X)                                                                           \
    X(KV_OK, 0, "success")                                                                         \
    X(KV_ERR_INVALID_ARG, -1, "invalid argument")                                                  \
    X(KV_ERR_NULL, -2, "null pointer argument")                                                    \
    X(KV_ERR_BAD_DIM, -3, "dimension out of range")                                                \
    X(KV_ERR_BAD_SHAPE, -4, "invalid or incompatible shape")                                       \
    X(KV_ERR_OUT_OF_BOUNDS, -5, "index or view outside its storage")                               \
    X(KV_ERR_NEEDS_COPY, -6, "not expressible as a view without a copy")                           \
    X(KV_ERR_OVERLAP, -7, "memory regions overlap")                                                \
    X(KV_ERR_OVERFLOW, -8, "64-bit arithmetic overflow")                                           \
    X(KV_ERR_NO_MEMORY, -9, "out of memory")                                                       \
    X(KV_ERR_NO_BLOCKS, -10, "not enough free blocks")                                             \
    X(KV_ERR_NOT_FOUND, -11, "not found")                                                          \
    X(KV_ERR_BAD_STATE, -12, "operation not valid in the current state")                           \
    X(KV_ERR_UNSUPPORTED, -13, "not supported in this build or on this host")                      \
    X(KV_ERR_TOO_COSTLY, -14, "answer exceeds the allowed work bound")                             \
    X(KV_ERR_MISMATCH, -15, "layout or peer mismatch")                                             \
    X(KV_ERR_IO, -16, "I/O or system call failed")                                                 \
    X(KV_ERR_TIMEOUT, -17, "timed out")                                                            \
    X(KV_ERR_CANCELLED, -18, "cancelled")                                                          \
    X(KV_ERR_CORRUPT, -19, "data failed verification")                                             \
    X(KV_ERR_INTERNAL, -20, "internal error")                                                      \
    X(KV_ERR_CAPACITY, -21, "a configured capacity limit is reached")                              \
    X(KV_ERR_DEVICE, -22, "device (CUDA) runtime error")

/* Status of every fallible call: KV_OK (0) or a negative KV_ERR_* code. */
typedef enum kv_status {
#define KV__STATUS_ENUM(name, value, msg) name = value,
    KV_STATUS_MAP(KV__STATUS_ENUM)
#undef KV__STATUS_ENUM
} kv_status;

/* "KV_ERR_BAD_DIM" for KV_ERR_BAD_DIM; "KV_UNKNOWN_STATUS" otherwise. */
KV_API const char *kv_status_name(kv_status s);

/* A one-line human message for s ("dimension out of range"). */
KV_API const char *kv_strerror(kv_status s);

/*
 * Detail of the last failed call made by this thread: names the argument and
 * the values involved ("permute: dim 3 appears twice in [3,0,3]"). Empty
 * string if the last call on this thread succeeded or none failed yet.
 * The pointer stays valid until the next kvcache call on this thread.
 */
KV_API const char *kv_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* KV_STATUS_H */
