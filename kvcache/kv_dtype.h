/*
 * kv_dtype.h - element types of KV tensors and their sizes.
 */
#ifndef KV_DTYPE_H
#define KV_DTYPE_H

#include <stddef.h>

#include "kv_status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* X(enum, name, bytes) */
#define KV_DTYPE_MAP(X)                                                                            \
    X(KV_F32, "f32", 4)                                                                            \
    X(KV_F16, "f16", 2)                                                                            \
    X(KV_BF16, "bf16", 2)                                                                          \
    X(KV_FP8_E4M3, "fp8_e4m3", 1)                                                                  \
    X(KV_FP8_E5M2, "fp8_e5m2", 1)                                                                  \
    X(KV_I8, "i8", 1)                                                                              \
    X(KV_I32, "i32", 4)                                                                            \
    X(KV_I64, "i64", 8)                                                                            \
    X(KV_U8, "u8", 1)                                                                              \
    X(KV_F64, "f64", 8)

/* Element types (KV_DTYPE_MAP). */
typedef enum kv_dtype {
#define KV__DTYPE_ENUM(e, name, bytes) e,
    KV_DTYPE_MAP(KV__DTYPE_ENUM)
#undef KV__DTYPE_ENUM
        KV_DTYPE_COUNT
} kv_dtype;

/* Bytes per element; 0 for an unknown dtype. */
KV_API size_t kv_dtype_size(kv_dtype dt);

/* "bf16" for KV_BF16; "?" for an unknown dtype. */
KV_API const char *kv_dtype_name(kv_dtype dt);

/* Parse "bf16", "f32", ... (also "float32", "float16", "bfloat16", "fp8",
 * "e4m3", "e5m2", "int8", "int32", "int64", "uint8", "float64").
 * Returns KV_ERR_INVALID_ARG naming the string when unknown. */
KV_API KV_NODISCARD kv_status kv_dtype_parse(const char *name, kv_dtype *out);

#ifdef __cplusplus
}
#endif

#endif /* KV_DTYPE_H */
