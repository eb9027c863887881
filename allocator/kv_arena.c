/* kv_arena.c - one aligned arena per cache: host (kv_mem + THP), pinned and
 * device memory (through the CUDA boundary, kv_arena_cuda_int.h). */
#include <errno.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <stdatomic.h>

#include "allocator_int.h"
#include "kv_arena.h"
#include "kv_arena_cuda_int.h"
#include "kv_mem.h"
#include "kv_lib.h"

#define KV__ARENA_HUGE_BYTES ((size_t)2 << 20) /* x86-64 / arm64 transparent huge page */
#define KV__ARENA_SMALL_ALIGN ((size_t)64)     /* a cache line */

struct kv_arena {
    enum kv_mem_kind kind;
    void *base; /* [size_bytes], aligned to align_bytes */
    void *raw;  /* what was allocated (== base for host; base - slack for CUDA) */
    size_t size_bytes;
    size_t align_bytes;
    int device; /* -1 unless KV_MEM_DEVICE */
    bool huge_pages;
    atomic_uint refs; /* the creator's (or owner's) + kv_arena_retain's */
    bool owned;       /* a kv_cache's part: kv_arena_destroy refuses it */
};

const char *kv_mem_kind_name(enum kv_mem_kind kind)
{
    switch (kind) {
    case KV_MEM_HOST:
        return "host";
    case KV_MEM_PINNED:
        return "pinned";
    case KV_MEM_DEVICE:
        return "device";
    }
    return "unknown";
}

/* Ask for transparent huge pages; false (and no error) where the kernel has
 * none (EINVAL without CONFIG_TRANSPARENT_HUGEPAGE) or madvise is absent. */
static bool arena_advise_huge(void *base, size_t bytes)
{
#if defined(MADV_HUGEPAGE)
    if (((uintptr_t)base % KV__ARENA_HUGE_BYTES) != 0 || bytes < KV__ARENA_HUGE_BYTES)
        return false;
    return madvise(base, bytes, MADV_HUGEPAGE) == 0;
#else
    (void)base;
    (void)bytes;
    return false;
#endif
}

/* Bytes of physical memory (0 when the system cannot say). */
static uint64_t arena_phys_bytes(void)
{
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    return pages > 0 && page > 0 ? (uint64_t)pages * (uint64_t)page : 0;
}

/* What an arena of cfg takes: the alignment and the bytes to allocate
 * (host: size rounded up to the alignment; pinned/device: size plus the
 * slack that meets an alignment above CUDA's 256 bytes). Checked before
 * anything is allocated. */
struct arena_geometry {
    size_t align;
    size_t alloc_bytes;
};

static kv_status arena_geometry(const struct kv_arena_config *cfg, struct arena_geometry *g)
{
    if (cfg->kind == KV_MEM_HOST) {
        /* The default alignment (2 MiB for arenas of 2 MiB and more, so the
         * whole range can be backed by transparent huge pages) is a floor: a
         * caller's align_bytes only ever raises it. */
        size_t align =
            cfg->size_bytes >= KV__ARENA_HUGE_BYTES ? KV__ARENA_HUGE_BYTES : KV__ARENA_SMALL_ALIGN;
        const uint64_t phys = arena_phys_bytes();
        if (cfg->align_bytes > align)
            align = cfg->align_bytes;
        if (cfg->size_bytes > SIZE_MAX - (align - 1))
            return kv__error(KV_ERR_OVERFLOW,
                             "kv_arena: size_bytes %zu rounded up to align_bytes %zu overflows "
                             "size_t",
                             cfg->size_bytes, align);
        /* Virtual memory may be granted far past what exists (overcommit): a
         * KV arena is meant to be filled, so one larger than the machine is
         * refused now rather than OOM-killed later. */
        /* what is mapped: the size rounded up to align (64 bytes at 2^40
         * alignment map 2^40 bytes) */
        const size_t alloc = (cfg->size_bytes + align - 1) & ~(align - 1);
        if (phys && alloc > phys)
            return kv__error(KV_ERR_NO_MEMORY,
                             "kv_arena: a host arena of %zu bytes (size_bytes %zu rounded up to "
                             "align_bytes %zu) exceeds this machine's %llu bytes of physical "
                             "memory",
                             alloc, cfg->size_bytes, align, (unsigned long long)phys);
        g->align = align;
        g->alloc_bytes = alloc;
        return KV_OK;
    }
    /* CUDA allocations are at least 256-byte aligned; a larger alignment is
     * met by over-allocating align - 256 bytes and rounding the base up */
    const size_t cuda_align = 256;
    const size_t align = cfg->align_bytes > cuda_align ? cfg->align_bytes : cuda_align;
    const size_t extra = align - cuda_align;
    if (cfg->size_bytes > SIZE_MAX - extra)
        return kv__error(KV_ERR_OVERFLOW,
                         "kv_arena: size_bytes %zu + alignment slack %zu overflows size_t",
                         cfg->size_bytes, extra);
    g->align = align;
    g->alloc_bytes = cfg->size_bytes + extra;
    return KV_OK;
}

static kv_status arena_alloc_host(kv_arena *a, const struct arena_geometry *g)
{
    const size_t align = g->align, rounded = g->alloc_bytes;
    a->base = a->raw = kv__mem_alloc_aligned(align, rounded);
    if (!a->base)
        return kv__error(KV_ERR_NO_MEMORY,
                         "kv_arena: host allocation of %zu bytes aligned to %zu failed (%s)",
                         rounded, align, kv__mem_backend());
    a->size_bytes = rounded;
    a->align_bytes = align;
    a->huge_pages = arena_advise_huge(a->base, rounded);
    return KV_OK;
}

/* The test double's pinned and device memory (allocator_int.h); NULL: CUDA. */
static _Atomic(const struct kv__arena_cuda_mem *) arena_cuda_mem;

void kv__arena_set_cuda_mem(const struct kv__arena_cuda_mem *m)
{
    atomic_store(&arena_cuda_mem, m);
}

/* Pinned or device memory (raw keeps the pointer to free; the base is
 * rounded up to the alignment inside the slack). */
static kv_status arena_alloc_cuda(kv_arena *a, const struct kv_arena_config *cfg,
                                  const struct arena_geometry *g)
{
    const size_t align = g->align;
    kv_status s;
    const struct kv__arena_cuda_mem *m = atomic_load(&arena_cuda_mem);
    if (cfg->kind == KV_MEM_PINNED)
        s = m ? m->host_alloc(g->alloc_bytes, &a->raw)
              : kv__cuda_host_alloc(g->alloc_bytes, &a->raw);
    else
        s = m ? m->device_alloc(cfg->device, g->alloc_bytes, &a->raw)
              : kv__cuda_device_alloc(cfg->device, g->alloc_bytes, &a->raw);
    if (s != KV_OK)
        return s;
    a->base = (void *)(((uintptr_t)a->raw + (align - 1)) & ~(uintptr_t)(align - 1));
    a->size_bytes = cfg->size_bytes;
    a->align_bytes = align;
    return KV_OK;
}

kv_status kv_arena_create(const struct kv_arena_config *cfg, kv_arena **out)
{
    kv_arena *a;
    kv_status s;

    if (!cfg || !out)
        return kv__error(KV_ERR_NULL, "kv_arena_create: %s is NULL", !cfg ? "cfg" : "out");
    s = kv__check_struct_size("kv_arena_create", "kv_arena_config", cfg->struct_size, sizeof(*cfg));
    if (s != KV_OK)
        return s;
    if (cfg->kind != KV_MEM_HOST && cfg->kind != KV_MEM_PINNED && cfg->kind != KV_MEM_DEVICE)
        return kv__error(KV_ERR_INVALID_ARG,
                         "kv_arena_create: unknown kind %d (host %d, pinned %d, device %d)",
                         (int)cfg->kind, KV_MEM_HOST, KV_MEM_PINNED, KV_MEM_DEVICE);
    if (cfg->size_bytes == 0)
        return kv__error(KV_ERR_INVALID_ARG, "kv_arena_create: size_bytes is 0 (kind %s)",
                         kv_mem_kind_name(cfg->kind));
    if (cfg->align_bytes != 0 &&
        (cfg->align_bytes < sizeof(void *) || (cfg->align_bytes & (cfg->align_bytes - 1))))
        return kv__error(KV_ERR_INVALID_ARG,
                         "kv_arena_create: align_bytes %zu is not a power of two >= %zu",
                         cfg->align_bytes, sizeof(void *));
    if (cfg->flags & ~KV_ARENA_ZERO)
        return kv__error(KV_ERR_INVALID_ARG, "kv_arena_create: unknown flags 0x%x",
                         cfg->flags & ~KV_ARENA_ZERO);
    if (cfg->kind == KV_MEM_DEVICE && (cfg->flags & KV_ARENA_ZERO))
        /* A device memset needs a stream; the layout owner zeroes with a
         * kernel. Refuse rather than pretend. */
        return kv__error(KV_ERR_UNSUPPORTED,
                         "kv_arena_create: KV_ARENA_ZERO is not supported for device memory");
    struct arena_geometry g = {0, 0};
    s = arena_geometry(cfg, &g);
    if (s != KV_OK)
        return s;

    a = kv__mem_calloc(1, sizeof(*a));
    if (!a)
        return kv__error(KV_ERR_NO_MEMORY, "kv_arena_create: handle allocation failed");
    a->kind = cfg->kind;
    a->device = -1;
    atomic_init(&a->refs, 1);

    switch (cfg->kind) {
    case KV_MEM_HOST:
        s = arena_alloc_host(a, &g);
        if (s != KV_OK)
            goto free_handle;
        if (cfg->flags & KV_ARENA_ZERO)
            memset(a->base, 0, a->size_bytes);
        break;
    case KV_MEM_PINNED:
        s = arena_alloc_cuda(a, cfg, &g);
        if (s != KV_OK)
            goto free_handle;
        if (cfg->flags & KV_ARENA_ZERO)
            memset(a->base, 0, a->size_bytes);
        break;
    case KV_MEM_DEVICE:
        s = arena_alloc_cuda(a, cfg, &g);
        if (s != KV_OK)
            goto free_handle;
        a->device = cfg->device;
        break;
    }
    *out = a;
    return kv__ok();

free_handle:
    kv__mem_free(a);
    return s;
}

static void arena_free(kv_arena *arena)
{
    const struct kv__arena_cuda_mem *m = atomic_load(&arena_cuda_mem);
    switch (arena->kind) {
    case KV_MEM_HOST:
        kv__mem_free(arena->base);
        break;
    case KV_MEM_PINNED:
        if (m)
            m->host_free(arena->raw);
        else
            kv__cuda_host_free(arena->raw);
        break;
    case KV_MEM_DEVICE:
        if (m)
            m->device_free(arena->device, arena->raw);
        else
            kv__cuda_device_free(arena->device, arena->raw);
        break;
    }
    kv__mem_free(arena);
}

/* Drop one reference; the last frees (everything the others did happens
 * before). */
static void arena_unref(kv_arena *arena)
{
    if (atomic_fetch_sub_explicit(&arena->refs, 1, memory_order_acq_rel) == 1)
        arena_free(arena);
}

void kv_arena_destroy(kv_arena *arena)
{
    if (!arena)
        return;
    if (arena->owned) {
        (void)kv__error(KV_ERR_BAD_STATE, "kv_arena_destroy: the arena of a kv_cache "
                                          "(kv_cache_arena): kv_cache_destroy frees it; "
                                          "nothing freed");
        return;
    }
    arena_unref(arena);
}

kv_arena *kv_arena_retain(kv_arena *arena)
{
    if (arena)
        atomic_fetch_add_explicit(&arena->refs, 1, memory_order_relaxed);
    return arena;
}

void kv_arena_release(kv_arena *arena)
{
    if (arena)
        arena_unref(arena);
}

void kv__arena_set_owned(kv_arena *arena)
{
    arena->owned = true;
}

void kv__arena_free(kv_arena *arena)
{
    if (arena)
        arena_unref(arena);
}

void *kv_arena_base(const kv_arena *arena)
{
    return arena ? arena->base : NULL;
}

size_t kv_arena_size(const kv_arena *arena)
{
    return arena ? arena->size_bytes : 0;
}

size_t kv_arena_align(const kv_arena *arena)
{
    return arena ? arena->align_bytes : 0;
}

enum kv_mem_kind kv_arena_kind(const kv_arena *arena)
{
    return arena ? arena->kind : KV_MEM_HOST;
}

bool kv_arena_huge_pages(const kv_arena *arena)
{
    return arena && arena->huge_pages;
}

kv_status kv_arena_regions(const kv_arena *arena, struct kv_mem_region *out, size_t cap, size_t *n)
{
    const size_t count = 1;
    if (!arena || !n)
        return kv__error(KV_ERR_NULL, "kv_arena_regions: %s is NULL", !arena ? "arena" : "n");
    if (!out && cap > 0)
        return kv__error(KV_ERR_NULL, "kv_arena_regions: out is NULL with cap %zu", cap);
    if (cap > 0) { /* written as words: misaligned is undefined behaviour */
        const kv_status st =
            kv__check_aligned("kv_arena_regions", "out", out, _Alignof(struct kv_mem_region));
        if (st != KV_OK)
            return st;
    }
    *n = count;
    if (!out)
        return kv__ok();
    if (cap < count)
        return kv__error(KV_ERR_INVALID_ARG, "kv_arena_regions: cap %zu < %zu regions", cap, count);
    out[0] = (struct kv_mem_region){
        .ptr = arena->base,
        .bytes = arena->size_bytes,
        .kind = arena->kind,
        .device = arena->device,
    };
    return kv__ok();
}
