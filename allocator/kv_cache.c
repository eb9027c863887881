/* kv_cache.c - the cache object: layout + arena + pool + page table. */
#include <inttypes.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "allocator_int.h"
#include "kv_cache.h"
#include "kv_mem.h"
#include "kv_lib.h"

struct kv_cache {
    atomic_uint refs; /* the creator's + one per kv_cache_retain (exported tensors) */
    struct kv_layout layout;
    uint32_t head_offset;
    kv_arena *arena;
    kv_block_pool *pool;
    kv_page_table *pt;
};

/* Every field of cfg, and every size derived from it, before anything is
 * allocated: a config that cannot be built is refused naming its field,
 * never answered KV_ERR_NO_MEMORY by an arena mapped first. The parts check
 * again what they are given (their own callers are not all this one). */
static kv_status cache_config_check(const struct kv_cache_config *cfg, struct kv_layout *lo)
{
    kv_status st = kv_layout_init(&cfg->layout, lo);
    if (st != KV_OK)
        return kv__error_wrap(st, "kv_cache_create: layout");
    if (lo->num_blocks < 2 || lo->num_blocks > (int64_t)KV_BLOCK_POOL_MAX_BLOCKS)
        return kv__error(KV_ERR_INVALID_ARG,
                         "kv_cache_create: num_blocks %" PRId64 " outside 2..%" PRIu32
                         " (block 0 is the reserved null block)",
                         lo->num_blocks, KV_BLOCK_POOL_MAX_BLOCKS);
    if (lo->block_tokens > UINT32_MAX)
        return kv__error(KV_ERR_INVALID_ARG,
                         "kv_cache_create: block_tokens %" PRId64 " exceeds %" PRIu32
                         " (the page table's token counts are uint32)",
                         lo->block_tokens, UINT32_MAX);
    if ((uint64_t)cfg->head_offset + (uint64_t)lo->num_heads > UINT32_MAX)
        return kv__error(KV_ERR_INVALID_ARG,
                         "kv_cache_create: head_offset %" PRIu32 " + %" PRId64
                         " heads exceeds 2^32 - 1",
                         cfg->head_offset, lo->num_heads);
    if ((uint64_t)lo->total_bytes > SIZE_MAX)
        return kv__error(KV_ERR_OVERFLOW, "kv_cache_create: total_bytes %" PRId64 " exceeds size_t",
                         lo->total_bytes);
    if (cfg->mem_kind != KV_MEM_HOST && cfg->mem_kind != KV_MEM_PINNED &&
        cfg->mem_kind != KV_MEM_DEVICE)
        return kv__error(KV_ERR_INVALID_ARG,
                         "kv_cache_create: unknown mem_kind %d (host %d, pinned %d, device %d)",
                         (int)cfg->mem_kind, KV_MEM_HOST, KV_MEM_PINNED, KV_MEM_DEVICE);
    if (cfg->zero_fill && cfg->mem_kind == KV_MEM_DEVICE)
        return kv__error(KV_ERR_UNSUPPORTED,
                         "kv_cache_create: zero_fill is not supported for device memory "
                         "(clear it with cudaMemsetAsync on the engine's stream)");
    if (cfg->max_seqs == 0 || cfg->max_seqs > KV_PAGE_TABLE_MAX_SEQS)
        return kv__error(KV_ERR_INVALID_ARG,
                         "kv_cache_create: max_seqs %" PRIu32
                         " outside 1..KV_PAGE_TABLE_MAX_SEQS (%u live sequences)",
                         cfg->max_seqs, KV_PAGE_TABLE_MAX_SEQS);
    if (cfg->max_blocks_per_seq > KV_PAGE_TABLE_MAX_BLOCKS_PER_SEQ)
        return kv__error(KV_ERR_INVALID_ARG,
                         "kv_cache_create: max_blocks_per_seq %" PRIu32
                         " exceeds KV_PAGE_TABLE_MAX_BLOCKS_PER_SEQ (%u)",
                         cfg->max_blocks_per_seq, KV_PAGE_TABLE_MAX_BLOCKS_PER_SEQ);
    const uint32_t r = cfg->page_ratio ? cfg->page_ratio : 1;
    if ((uint64_t)lo->block_tokens % r != 0)
        return kv__error(KV_ERR_INVALID_ARG,
                         "kv_cache_create: block_tokens %" PRId64
                         " is not divisible by page_ratio %" PRIu32,
                         lo->block_tokens, r);
    return KV_OK;
}

kv_status kv_cache_create(const struct kv_cache_config *cfg, kv_cache **out)
{
    struct kv_arena_config acfg;
    struct kv_block_pool_config pcfg;
    struct kv_page_table_config tcfg;
    struct kv_layout lo;
    kv_cache *c;
    kv_status st;

    if (!cfg || !out)
        return kv__error(KV_ERR_NULL, "kv_cache_create: cfg=%p out=%p", (const void *)cfg,
                         (void *)out);
    st =
        kv__check_struct_size("kv_cache_create", "kv_cache_config", cfg->struct_size, sizeof(*cfg));
    if (st != KV_OK)
        return st;
    st = cache_config_check(cfg, &lo);
    if (st != KV_OK)
        return st;

    c = kv__mem_calloc(1, sizeof(*c));
    if (!c)
        return kv__error(KV_ERR_NO_MEMORY, "kv_cache_create: %zu bytes", sizeof(*c));
    c->layout = lo;
    c->head_offset = cfg->head_offset;

    /* The arena first, reserved but untouched: a cache that cannot fit is
     * refused before any other part is built (a host arena larger than the
     * machine is refused by kv_arena_create without mapping it); it is zeroed
     * (zero_fill) only once everything else has succeeded. */
    kv_arena_config_init(&acfg, (size_t)c->layout.total_bytes);
    acfg.kind = cfg->mem_kind;
    acfg.device = cfg->device;
    /* the layout's block alignment only ever raises the arena's default
     * (which keeps huge pages possible); below a pointer it is implied */
    if (c->layout.align_bytes >= (int64_t)sizeof(void *))
        acfg.align_bytes = (size_t)c->layout.align_bytes;
    st = kv_arena_create(&acfg, &c->arena);
    if (st != KV_OK)
        goto undo_alloc;

    kv_block_pool_config_init(&pcfg);
    pcfg.num_blocks = (uint32_t)c->layout.num_blocks;
    pcfg.on_event = cfg->on_event;
    pcfg.event_user = cfg->event_user;
    st = kv_block_pool_create(&pcfg, &c->pool);
    if (st != KV_OK)
        goto undo_arena;

    kv_page_table_config_init(&tcfg);
    tcfg.block_tokens = (uint32_t)c->layout.block_tokens;
    tcfg.page_ratio = cfg->page_ratio;
    tcfg.max_seqs = cfg->max_seqs;
    tcfg.max_blocks_per_seq =
        cfg->max_blocks_per_seq ? cfg->max_blocks_per_seq : (uint32_t)(c->layout.num_blocks - 1);
    tcfg.enable_prefix_caching = cfg->enable_prefix_caching;
    st = kv_block_pool_ops(c->pool, &tcfg.ops);
    if (st != KV_OK)
        goto undo_pool;
    st = kv_page_table_create(&tcfg, &c->pt);
    if (st != KV_OK)
        goto undo_pool;
    /* the parts handed out (kv_cache_arena, _pool, _page_table) are the
     * cache's: their own destroys refuse them */
    kv__arena_set_owned(c->arena);
    kv__block_pool_set_owned(c->pool);
    kv__page_table_set_owned(c->pt);

    /* only now, with everything else built, touch the arena's pages */
    if (cfg->zero_fill)
        memset(kv_arena_base(c->arena), 0, kv_arena_size(c->arena));
    atomic_init(&c->refs, 1);
    *out = c;
    return kv__ok();

undo_pool:
    kv_block_pool_destroy(c->pool);
undo_arena:
    kv_arena_destroy(c->arena);
undo_alloc:
    kv__mem_free(c);
    return st;
}

kv_cache *kv_cache_retain(kv_cache *c)
{
    if (c)
        atomic_fetch_add_explicit(&c->refs, 1, memory_order_relaxed);
    return c;
}

void kv_cache_destroy(kv_cache *c)
{
    if (!c)
        return;
    /* the last reference frees: everything the others did happens before */
    if (atomic_fetch_sub_explicit(&c->refs, 1, memory_order_acq_rel) != 1)
        return;
    kv__page_table_free(c->pt);
    kv__block_pool_free(c->pool);
    kv__arena_free(c->arena); /* a transport's kv_xport_mem_reg_arena may hold it longer */
    kv__mem_free(c);
}

uint32_t kv_cache_head_offset(const kv_cache *c)
{
    return c ? c->head_offset : 0;
}

const struct kv_layout *kv_cache_layout(const kv_cache *c)
{
    return c ? &c->layout : NULL;
}

kv_arena *kv_cache_arena(kv_cache *c)
{
    return c ? c->arena : NULL;
}

kv_block_pool *kv_cache_pool(kv_cache *c)
{
    return c ? c->pool : NULL;
}

kv_page_table *kv_cache_page_table(kv_cache *c)
{
    return c ? c->pt : NULL;
}

kv_status kv_cache_kv_view(const kv_cache *c, uint32_t layer, int kv, struct kv_view *out)
{
    if (!c)
        return kv__error(KV_ERR_NULL, "kv_cache_kv_view: cache is NULL");
    return kv_layout_kv_view(&c->layout, kv_arena_base(c->arena), kv_arena_size(c->arena), layer,
                             kv, out);
}

kv_status kv_cache_regions(const kv_cache *c, struct kv_mem_region *out, size_t cap, size_t *n)
{
    if (!c)
        return kv__error(KV_ERR_NULL, "kv_cache_regions: cache is NULL");
    return kv_arena_regions(c->arena, out, cap, n);
}

static void kv__cache_release(void *owner)
{
    kv_cache_destroy(owner);
}

kv_status kv_cache_to_dlpack(kv_cache *c, const struct kv_view *v, DLManagedTensor **out)
{
    if (!c || !v || !out)
        return kv__error(KV_ERR_NULL, "kv_cache_to_dlpack: %s is NULL",
                         !c   ? "cache"
                         : !v ? "v"
                              : "out");
    kv_status st = kv_view_check(v);
    if (st != KV_OK)
        return kv__error_wrap(st, "kv_cache_to_dlpack");
    int64_t lo = 0, hi = 0;
    kv_view_extent_bytes(v, &lo, &hi);
    const uintptr_t a0 = (uintptr_t)kv_arena_base(c->arena), a1 = a0 + kv_arena_size(c->arena);
    const uintptr_t b = (uintptr_t)v->base;
    /* in terms that cannot wrap (a view just below address 2^64 wrapped
     * past the end check before): every byte it reaches; an empty view (no
     * bytes, exported at its base) its base */
    const bool empty = hi <= lo;
    if (lo < 0 || (empty ? b < a0 || b > a1
                         : (uint64_t)hi > UINTPTR_MAX - b || b + (uintptr_t)lo < a0 ||
                               b + (uintptr_t)hi > a1))
        return kv__error(KV_ERR_OUT_OF_BOUNDS,
                         "kv_cache_to_dlpack: the view (base %p, bytes [%" PRId64 ", %" PRId64
                         ") of it) reaches outside the cache's arena [%p, %p)",
                         (void *)b, lo, hi, (void *)a0, (void *)a1);
    struct kv_mem_region r;
    size_t n = 0;
    if ((st = kv_arena_regions(c->arena, &r, 1, &n)) != KV_OK)
        return kv__error_wrap(st, "kv_cache_to_dlpack");
    DLDevice dev = {kDLCPU, 0};
    if (r.kind == KV_MEM_PINNED)
        dev.device_type = kDLCUDAHost;
    else if (r.kind == KV_MEM_DEVICE)
        dev = (DLDevice){kDLCUDA, r.device};
    kv_cache_retain(c);
    st = kv_view_to_dlpack(v, dev, kv__cache_release, c, out);
    if (st != KV_OK) {
        kv_cache_destroy(c); /* the reference just taken */
        return kv__error_wrap(st, "kv_cache_to_dlpack");
    }
    return kv__ok();
}
