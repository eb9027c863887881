/* kv_paged.c - a paged cache as its executors see it (kv_paged.h). */
#include <inttypes.h>

#include "kv_lib.h"
#include "kv_paged.h"

kv_status kv_cache_paged(const kv_cache *c, struct kv_paged_cache *out)
{
    if (!c || !out)
        return kv__error(KV_ERR_NULL, "kv_cache_paged: %s is NULL", !c ? "cache" : "out");
    /* the cache's parts are owned by it and do not change after create */
    kv_arena *a = kv_cache_arena((kv_cache *)c);
    out->layout = *kv_cache_layout(c);
    out->base = kv_arena_base(a);
    out->storage_bytes = kv_arena_size(a);
    out->mem = kv_arena_kind(a);
    return kv__ok();
}

static bool dtype_handled(kv_dtype dt)
{
    return dt == KV_F32 || dt == KV_F16 || dt == KV_BF16 || dt == KV_FP8_E4M3 || dt == KV_FP8_E5M2;
}

kv_status kv_paged_check(const struct kv_paged_cache *c, bool cuda)
{
    static const char fn[] = "kv_paged_check";
    if (!c)
        return kv__error(KV_ERR_NULL, "%s: cache is NULL", fn);
    if (!c->base)
        return kv__error(KV_ERR_NULL, "%s: cache base is NULL", fn);
    if (c->mem != KV_MEM_HOST && c->mem != KV_MEM_PINNED && c->mem != KV_MEM_DEVICE)
        return kv__error(KV_ERR_INVALID_ARG, "%s: cache memory kind %d is not a kv_mem_kind", fn,
                         (int)c->mem);
    if (c->mem == (cuda ? KV_MEM_HOST : KV_MEM_DEVICE))
        return kv__error(KV_ERR_INVALID_ARG,
                         "%s: the cache is %s memory, which the %s code cannot address (%s)", fn,
                         kv_mem_kind_name(c->mem), cuda ? "CUDA" : "CPU",
                         cuda ? "it takes device or pinned storage"
                              : "device storage takes the *_cuda calls");
    /* The executors trust the layout's strides: exactly what kv_layout_init
     * computes for its own fields (kv_layout_config_from rebuilds it). */
    struct kv_layout_config cfg;
    if (kv_layout_config_from(&c->layout, &cfg) != KV_OK)
        return kv__error_wrap(KV_ERR_INVALID_ARG, "%s: the cache layout", fn);
    if (!dtype_handled(c->layout.dtype))
        return kv__error(KV_ERR_INVALID_ARG,
                         "%s: cache dtype %s is not one the executors handle (f32, f16, bf16, "
                         "fp8_e4m3, fp8_e5m2)",
                         fn, kv_dtype_name(c->layout.dtype));
    if ((uint64_t)c->storage_bytes < (uint64_t)c->layout.total_bytes)
        return kv__error(KV_ERR_OUT_OF_BOUNDS,
                         "%s: cache storage of %zu bytes is smaller than its layout (%" PRId64
                         " bytes)",
                         fn, c->storage_bytes, c->layout.total_bytes);
    /* Every overlap check downstream takes [base, base + storage_bytes): it
     * must be an address range, not one wrapping past the top. */
    if ((uint64_t)c->storage_bytes > (uint64_t)(UINTPTR_MAX - (uintptr_t)c->base))
        return kv__error(KV_ERR_OUT_OF_BOUNDS,
                         "%s: cache storage of %zu bytes at %p wraps the address space", fn,
                         c->storage_bytes, c->base);
    if ((uintptr_t)c->base % (uintptr_t)c->layout.elem_bytes != 0)
        return kv__error(KV_ERR_INVALID_ARG,
                         "%s: cache base %p is not aligned to its %" PRId64 "-byte elements", fn,
                         c->base, c->layout.elem_bytes);
    return kv__ok();
}
