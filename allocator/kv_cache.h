/*
 * kv_cache.h - the one object an engine holds: a model's KV cache.
 *
 * It ties together, for one model config:
 *
 *     kv_layout      where every K/V element of every layer and block lives
 *     kv_arena       the memory holding all of it (host, pinned or device)
 *     kv_block_pool  block ids, ref counts, LRU, prefix cache
 *     kv_page_table  sequences -> blocks, exports for kernels
 *
 *   engine --- kv_cache_create(cfg) ---> kv_cache
 *                                          |-- layout (by value)
 *                                          |-- arena  (total_bytes of the layout)
 *                                          |-- pool   (num_blocks ids, 0 = null block)
 *                                          `-- page table (blocks from the pool)
 *
 * The object lives in allocator/ (not kvcache/) because it owns an arena and
 * a pool: kvcache/ never depends on allocator/ (docs/design.md, module arrows).
 *
 * Sequence work goes through kv_cache_page_table(); the pool and the arena
 * are exposed for stats, events and transport registration.
 * Thread safety: the page table is one-thread (the engine's scheduler); the
 * pool is thread-safe; layout queries are pure.
 */
#ifndef KV_CACHE_H
#define KV_CACHE_H

#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "kv_arena.h"
#include "kv_block_pool.h"
#include "kv_dlpack.h"
#include "kv_layout.h"
#include "kv_page_table.h"
#include "kv_status.h"
#include "kv_view.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The cache handle (opaque). */
typedef struct kv_cache kv_cache;

/* Input of kv_cache_create(). Start from kv_cache_config_init() (or
 * KV_CACHE_CONFIG_INIT), then set the layout dims, dtype and max_seqs: zero
 * means the default for every other field. Both this struct_size and
 * layout.struct_size are checked.
 *
 * Blocks: layout.num_blocks = B counts the null block. Block 0 is reserved
 * (KV_BLOCK_NULL: never handed out, its bytes never written through a page
 * table), so B - 1 blocks are usable: (B - 1) * N tokens across all
 * sequences, pool capacity B - 1. For room for n blocks, set B = n + 1. */
struct kv_cache_config {
    size_t struct_size;             /* sizeof this struct: set by its _init() or _INIT */
    struct kv_layout_config layout; /* L, B (incl. the null block 0: B - 1 usable), N, H, D,
                                       dtype, order, arrangement, padding */
    enum kv_mem_kind mem_kind;      /* KV_MEM_HOST (default), KV_MEM_PINNED, KV_MEM_DEVICE */
    int device;                     /* CUDA device for KV_MEM_DEVICE */
    uint32_t max_seqs;              /* live sequences at once (>= 1) */
    uint32_t max_blocks_per_seq;    /* 0 = num_blocks - 1 */
    uint32_t page_ratio;            /* kernel pages per block (0 = 1) */
    bool enable_prefix_caching;     /* reuse full blocks by chained hash (page table + pool) */
    bool zero_fill;                 /* zero the arena at create (host and pinned memory;
                                       KV_ERR_UNSUPPORTED with KV_MEM_DEVICE) */
    kv_block_event_fn on_event;     /* pool stored/removed events (may be NULL) */
    void *event_user;               /* passed back to on_event; borrowed for the cache's life,
                                       which offload ops extend past the engine's
                                       kv_cache_destroy (a load they run commits its blocks,
                                       firing STORED): keep it valid until they are terminal
                                       (kv_offload_wait) or their tier is destroyed */
    uint32_t head_offset;           /* the model's first KV head this cache holds (tensor
                                       parallel rank r of H heads each: r * H; 0 otherwise):
                                       half of what the offload tier keys a block by, so the
                                       ranks of one group share a tier. head_offset + H must
                                       fit in 32 bits. */
};

/* C initializer: struct kv_cache_config cfg = KV_CACHE_CONFIG_INIT; */
#define KV_CACHE_CONFIG_INIT                                                                       \
    {                                                                                              \
        .struct_size = sizeof(struct kv_cache_config), .layout = KV_LAYOUT_CONFIG_INIT             \
    }

/* Zero *cfg and set its and its layout's struct_size (C and C++). */
static inline void kv_cache_config_init(struct kv_cache_config *cfg)
{
    memset(cfg, 0, sizeof(*cfg));
    cfg->struct_size = sizeof(*cfg);
    kv_layout_config_init(&cfg->layout);
}

/* Build layout, arena, pool and page table. *out set only on success; on
 * failure everything built so far is undone. The whole config - the layout,
 * num_blocks (2..KV_BLOCK_POOL_MAX_BLOCKS, the null block 0 included: B - 1
 * usable), block_tokens (<= 2^32 - 1),
 * mem_kind, zero_fill (not with device memory), max_seqs
 * (1..KV_PAGE_TABLE_MAX_SEQS), max_blocks_per_seq, page_ratio (divides
 * block_tokens) - and every size derived from it is checked before anything
 * is allocated, so a config that can never be built is refused naming its
 * field, not answered KV_ERR_NO_MEMORY by an arena mapped first. Statuses:
 * those of kv_layout_init (wrapped), KV_ERR_INVALID_ARG / KV_ERR_OVERFLOW /
 * KV_ERR_UNSUPPORTED for the fields above; kv_arena_create's
 * (KV_ERR_UNSUPPORTED for pinned/device memory without CUDA, KV_ERR_NO_MEMORY
 * for an arena larger than the machine); KV_ERR_NULL; KV_ERR_NO_MEMORY. */
KV_API KV_NODISCARD kv_status kv_cache_create(const struct kv_cache_config *cfg, kv_cache **out);

/* Drop a reference: the creator's, or one taken by kv_cache_retain. The
 * last one frees everything (sequences still live release their blocks
 * first). So a tensor exported with kv_cache_to_dlpack keeps the cache -
 * its memory and its parts - valid after the engine's kv_cache_destroy,
 * until the tensor's deleter runs. NULL is a no-op. Thread-safe against
 * other references; once the engine has called it, only the holders of
 * other references may touch the cache (through their tensors). */
KV_API void kv_cache_destroy(kv_cache *c);

/* Take a reference on c (dropped by kv_cache_destroy); returns c. NULL is a
 * no-op. Thread-safe. */
KV_API kv_cache *kv_cache_retain(kv_cache *c);

/*
 * Export view v - any view inside the cache's arena: a layer's K or V
 * (kv_cache_kv_view), one block, a head slice - as a DLPack tensor
 * (kvcache/kv_dlpack.h: zero-copy, shape, strides, dtype and byte offset
 * exact) on the arena's device: kDLCPU for host memory, kDLCUDAHost for
 * pinned, kDLCUDA and its device for device memory. The tensor holds a
 * reference on c until its deleter runs.
 * KV_ERR_NULL; kv_view_check's refusals; KV_ERR_OUT_OF_BOUNDS (v reaches
 * bytes outside the arena, both ranges named); kv_view_to_dlpack's
 * (KV_ERR_UNSUPPORTED for fp8). No reference is kept on failure.
 */
KV_API KV_NODISCARD kv_status kv_cache_to_dlpack(kv_cache *c, const struct kv_view *v,
                                                 DLManagedTensor **out);

/* The parts, owned by the cache (valid until kv_cache_destroy; NULL for a
 * NULL cache): use the page table for sequences, the pool for stats and
 * events, the arena for transport registration (kv_xport_mem_reg_cache).
 * Their own destroys refuse them (nothing freed; kv_last_error() names
 * the cache): kv_cache_destroy frees them. */
KV_API const struct kv_layout *kv_cache_layout(const kv_cache *c);

/* The config's head_offset (0 for NULL). */
KV_API uint32_t kv_cache_head_offset(const kv_cache *c);
KV_API kv_arena *kv_cache_arena(kv_cache *c);
KV_API kv_block_pool *kv_cache_pool(kv_cache *c);
KV_API kv_page_table *kv_cache_page_table(kv_cache *c);

/* The K (kv = 0) or V (kv = 1) tensor of one layer over the arena:
 * kv_layout_kv_view() with the arena's base and size. */
KV_API KV_NODISCARD kv_status kv_cache_kv_view(const kv_cache *c, uint32_t layer, int kv,
                                               struct kv_view *out);

/* The arena's regions, for a transport to register once (kv_arena_regions). */
KV_API KV_NODISCARD kv_status kv_cache_regions(const kv_cache *c, struct kv_mem_region *out,
                                               size_t cap, size_t *n);

#ifdef __cplusplus
}
#endif

#endif /* KV_CACHE_H */
