/*
 * kvcache_int.h - private cross-file helpers of the kvcache/ core module.
 * Not installed. Other modules may include it (everything may use kvcache).
 */
#ifndef KVCACHE_INT_H
#define KVCACHE_INT_H

#include <stdbool.h>
#include <stdint.h>

#include "kv_status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Record detail for the calling thread and return s (so callers can write
 * `return kv__error(KV_ERR_BAD_DIM, "...", ...)`). */
kv_status kv__error(kv_status s, const char *fmt, ...) KV_PRINTF(2, 3);

/* Clear this thread's last error; returns KV_OK. */
kv_status kv__ok(void);

/* Overflow-checked 64-bit helpers: return false on overflow. */
static inline bool kv__mul_i64(int64_t a, int64_t b, int64_t *out)
{
    return !__builtin_mul_overflow(a, b, out);
}
static inline bool kv__add_i64(int64_t a, int64_t b, int64_t *out)
{
    return !__builtin_add_overflow(a, b, out);
}

/* Format an int64 list as "[a,b,c]" into buf (always NUL-terminated). */
const char *kv__fmt_list(char *buf, size_t cap, const int64_t *v, int n);

#ifdef __cplusplus
}
#endif

#endif /* KVCACHE_INT_H */
