/*
 * kv_threads.h - how many CPU threads the library's parallel work uses: the
 * CPU kernels (attention/), transfer plans, pack/unpack and the offload
 * tier's copies (connector/). One process-wide setting, read at each call.
 *
 * Thread-safe: both calls may be made from any thread at any time; a call
 * already running keeps the count it started with.
 */
#ifndef KV_THREADS_H
#define KV_THREADS_H

#include "kv_status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Use n >= 1 threads, or 0 for every core this process may run on (the
 * default). KV_ERR_INVALID_ARG for n < 0 (named). */
KV_API KV_NODISCARD kv_status kv_set_threads(int n);

/* The thread count the next parallel call will use (>= 1). */
KV_API int kv_threads(void);

#ifdef __cplusplus
}
#endif

#endif /* KV_THREADS_H */
