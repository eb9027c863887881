/*
 * kv_lib.h - what the core lends to the library's other modules
 * (library-internal: used by kvcache/, allocator/, attention/ and connector/,
 * never installed, never included by a user).
 *
 * The library has three tiers of headers (docs/design.md, "Walls"):
 *
 *   public            kv_<name>.h of each module, installed under
 *                     include/kvcache/ and reached as <kvcache/kv_...h>
 *   library-internal  this header, kv_mem.h (host memory), kv_cuda_lib.h
 *                     (CUDA status mapping), kv_wire.h (little-endian
 *                     fields, the overflow-safe range check) and
 *                     kv_stream.h (streaming stores): the core's services
 *                     for every module; not installed
 *   module-private    <module>/<name>_int.h: one module's cross-file declarations;
 *                     no other module includes them
 *
 * scripts/check-walls.py enforces the tiers and the module order in CI.
 */
#ifndef KV_LIB_H
#define KV_LIB_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "kv_status.h"
#include "kv_view.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Record detail for the calling thread and return s (so callers can write
 * `return kv__error(KV_ERR_BAD_DIM, "...", ...)`). */
kv_status kv__error(kv_status s, const char *fmt, ...) KV_PRINTF(2, 3);

/* Like kv__error, but keeps the detail already recorded by the call that
 * failed underneath (another module, an ops table): the new message is
 * fmt, then ": ", then the previous detail (or "(no detail)" when the callee
 * recorded none). This is how error detail survives a module boundary:
 *
 *     st = ops.alloc(ctx, n, ids);
 *     if (st != KV_OK)
 *         return kv__error_wrap(st, "seq_append: seq %u needs %u blocks", seq, n);
 *
 * Call kv__error_clear() before the callee when it may not record detail
 * itself (a user's ops table), so stale text is never wrapped. */
kv_status kv__error_wrap(kv_status s, const char *fmt, ...) KV_PRINTF(2, 3);

/* Clear this thread's last error; returns KV_OK. */
kv_status kv__ok(void);

/* Forget this thread's last error without a return value (before calling a
 * callee that may not record detail of its own). */
void kv__error_clear(void);

/* While muted (a counter: calls nest), kv__error() and kv__error_wrap() only
 * return their status and leave the thread's last error alone. Predicates
 * that run a validator (kv_view_is_contiguous, kv_view_describe) mute it, so
 * a bool answer never changes kv_last_error(). */
void kv__error_mute(void);
void kv__error_unmute(void);

/* The ABI check each create/init runs on its config before reading any
 * other field: got (cfg->struct_size) must equal want (the sizeof this
 * library was built with). type is the struct tag ("kv_layout_config"); the
 * message names both sizes, or the initializer to use when got is 0. */
kv_status kv__check_struct_size(const char *fn, const char *type, size_t got, size_t want);

/* Count one copy of `bytes` made for `reason` (atomic; kv_copy_stats_get):
 * every copy any module of the library makes is counted here. */
void kv__copy_count(kv_copy_reason reason, uint64_t bytes);

/* A device pointer the kernels load through as `align`-byte words: KV_OK,
 * or KV_ERR_INVALID_ARG naming fn, the pointer's name and value (a GPU would
 * fault, cudaErrorMisalignedAddress: sticky, the context is lost). The one
 * check of the attention and plan device entries (kv_status.c). */
kv_status kv__check_dev_aligned(const char *fn, const char *name, const void *p, size_t align);

/* The same for a caller's host array read as `align`-byte elements (a
 * misaligned one is undefined behaviour in C, and a different pointer from
 * Python's buffers or a peer's offsets): KV_OK, or KV_ERR_INVALID_ARG naming
 * fn, the array's name and address. NULL passes (the callers check it). */
kv_status kv__check_aligned(const char *fn, const char *name, const void *p, size_t align);

/* Overflow-checked 64-bit helpers: return false on overflow. */
static inline bool kv__mul_i64(int64_t a, int64_t b, int64_t *out)
{
    return !__builtin_mul_overflow(a, b, out);
}
static inline bool kv__add_i64(int64_t a, int64_t b, int64_t *out)
{
    return !__builtin_add_overflow(a, b, out);
}

/* Timeouts and deadlines, on the monotonic clock (CLOCK_MONOTONIC: the
 * clock of every condition variable the library waits on with a timeout),
 * in nanoseconds (kv_clock.c):
 *
 *     const struct timespec ts = kv__deadline_ts(timeout_ms);
 *     while (!done)
 *         if (pthread_cond_timedwait(&cv, &mu, &ts) == ETIMEDOUT)
 *             break;
 */
uint64_t kv__now_ns(void);
/* kv__now_ns() + timeout_ms milliseconds. */
uint64_t kv__deadline_ns(uint32_t timeout_ms);
/* A kv__now_ns() time as the absolute timespec pthread_cond_timedwait takes. */
struct timespec kv__ns_to_ts(uint64_t ns);
/* kv__ns_to_ts(kv__deadline_ns(timeout_ms)). */
struct timespec kv__deadline_ts(uint32_t timeout_ms);

/* The CPU's vendor, asked once (x86: cpuid through __builtin_cpu_is, with
 * __builtin_cpu_init first, as this may run before libgcc's constructor in
 * a shared library; KV__CPU_OTHER elsewhere) and cached with relaxed
 * atomics (racing first calls store the same value). Only for tunings
 * measured on one vendor (kv_threads.c). */
enum kv__cpu_vendor { KV__CPU_OTHER = 1, KV__CPU_INTEL, KV__CPU_AMD };
enum kv__cpu_vendor kv__cpu_vendor(void);

/* Format an int64 list as "[a,b,c]" into buf (always NUL-terminated; a list
 * that does not fit ends in "...]"). */
const char *kv__fmt_list(char *buf, size_t cap, const int64_t *v, int n);

#ifdef __cplusplus
}
#endif

/* XXH3-64 (seed 0) for bulk checksums (pack, offload, the transport's
 * frames): libxxhash's, through its x86 dispatcher (XXH3_64bits_dispatch:
 * SSE2, AVX2 or AVX-512, whichever the CPU has; 3x the SSE2 code of the
 * x86-64 baseline with AVX2), the plain calls elsewhere; the values are
 * identical. The streaming form hashes a buffer written piece by piece
 * (kv__pack_copy_hash, the TCP receiver). */
struct kv__xxh3_state {
    unsigned char b[640] __attribute__((aligned(64))); /* an XXH3_state_t */
};
uint64_t kv__xxh3_64(const void *p, size_t n);
void kv__xxh3_reset(struct kv__xxh3_state *s);
void kv__xxh3_update(struct kv__xxh3_state *s, const void *p, size_t n);
uint64_t kv__xxh3_digest(const struct kv__xxh3_state *s);

/* A page table that is a kv_cache's part (allocator/kv_cache.c): marked
 * owned, so kv_page_table_destroy refuses it (KV_ERR_BAD_STATE in
 * kv_last_error, nothing freed); the cache frees it with
 * kv__page_table_free. */
typedef struct kv_page_table kv_page_table;
void kv__page_table_set_owned(kv_page_table *pt);
void kv__page_table_free(kv_page_table *pt);

#endif /* KV_LIB_H */
