/*
 * kv_paged.h - a paged cache as the code that addresses it sees it: a
 * complete layout and the memory it describes, with the kind of that memory
 * stated, never guessed from the pointer. The kernels (attention/) and the
 * executors of transfer plans, pack/unpack and the offload tier
 * (connector/) all take it, by value, and check it the same way.
 *
 *   struct kv_paged_cache pc;
 *   kv_cache_paged(cache, &pc);      the kv_cache's arena, or build one by
 *                                    hand over memory the engine owns
 *   kv_paged_check(&pc, cuda);       what every executor checks first
 *
 * Thread-safe: both calls only read their arguments.
 */
#ifndef KV_PAGED_H
#define KV_PAGED_H

#include <stdbool.h>
#include <stddef.h>

#include "kv_arena.h"
#include "kv_cache.h"
#include "kv_layout.h"
#include "kv_status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The paged storage an executor reads and writes: a complete layout (as
 * kv_layout_init computed it) and the memory it describes. The CPU code
 * takes KV_MEM_HOST or KV_MEM_PINNED storage, the CUDA code KV_MEM_DEVICE
 * or KV_MEM_PINNED (mapped into the device's address space); any other
 * pairing is refused with KV_ERR_INVALID_ARG before anything is touched. */
struct kv_paged_cache {
    struct kv_layout layout;
    void *base;           /* the arena: element (l, kv, b, n, h, d) at a layout offset */
    size_t storage_bytes; /* >= layout.total_bytes; base + storage_bytes within the address space */
    enum kv_mem_kind mem; /* where base points (0: KV_MEM_HOST) */
};

/* The paged cache of a kv_cache: its layout, arena base, size and kind.
 * KV_ERR_NULL for a NULL cache or out. */
KV_API KV_NODISCARD kv_status kv_cache_paged(const kv_cache *c, struct kv_paged_cache *out);

/* The checks every executor makes of its cache: the layout is exactly what
 * kv_layout_init computes for its fields (a hand-built or corrupted one is
 * refused naming the first field that differs), its dtype one the
 * executors handle (f32, f16, bf16, fp8_e4m3, fp8_e5m2), the storage
 * non-NULL, element-aligned and at least layout.total_bytes, and the memory
 * kind one the CPU (cuda false) or CUDA (cuda true) code can address.
 * KV_OK, or KV_ERR_NULL / KV_ERR_INVALID_ARG / KV_ERR_OUT_OF_BOUNDS naming
 * the field or value. */
KV_API KV_NODISCARD kv_status kv_paged_check(const struct kv_paged_cache *cache, bool cuda);

#ifdef __cplusplus
}
#endif

#endif /* KV_PAGED_H */
