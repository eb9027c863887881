/*
 * kv_arena.h - one aligned memory arena per cache.
 *
 * An arena is a single allocation that holds every KV byte of one cache (the
 * layout in kvcache/kv_layout decides where each block lives inside it). Its
 * kind says where the bytes are:
 *
 *   KV_MEM_HOST    host memory through kv_mem (jemalloc; libc under
 *                  sanitizers), 2 MiB aligned when large, transparent huge
 *                  pages requested with madvise(MADV_HUGEPAGE) where the
 *                  kernel offers them (never an error when it does not)
 *   KV_MEM_PINNED  page-locked host memory (cudaMallocHost): needs a CUDA
 *                  build and a device
 *   KV_MEM_DEVICE  CUDA device memory (cudaMalloc) on config.device
 *
 * Without CUDA, or on a host without a usable GPU, the pinned and device
 * kinds fail with KV_ERR_UNSUPPORTED and a message that says why ("this build
 * has no CUDA support", or cudaGetDeviceCount's error string). The host kind
 * always works.
 *
 * kv_arena_regions() reports the arena as (ptr, bytes, kind) regions so a
 * transport (RDMA memory registration, cudaHostRegister) can register them
 * once at startup.
 *
 * Thread safety: an arena is immutable after create; the getters may be
 * called from any thread. create/destroy are one thread per handle.
 */
#ifndef KV_ARENA_H
#define KV_ARENA_H

#include <stdbool.h>
#include <stddef.h>
#include <string.h>

#include "kv_status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The arena handle (opaque). */
typedef struct kv_arena kv_arena;

/* Where an arena's memory lives. */
enum kv_mem_kind {
    KV_MEM_HOST = 0,   /* host memory (kv_mem) */
    KV_MEM_PINNED = 1, /* page-locked host memory (cudaMallocHost) */
    KV_MEM_DEVICE = 2, /* CUDA device memory (cudaMalloc) */
};

/* "host", "pinned", "device"; "unknown" for anything else. */
KV_API const char *kv_mem_kind_name(enum kv_mem_kind kind);

/* A contiguous byte range a transport can register. For KV_MEM_DEVICE, ptr is
 * a device pointer (not dereferenceable on the host). */
struct kv_mem_region {
    void *ptr;
    size_t bytes;
    enum kv_mem_kind kind;
    int device; /* CUDA device for KV_MEM_DEVICE; -1 otherwise */
};

/* Arena flags. */
#define KV_ARENA_ZERO 0x1u /* zero-fill the arena at create (touches every page) */

/* Input of kv_arena_create(); KV_ARENA_CONFIG_INIT gives the defaults. */
struct kv_arena_config {
    size_t struct_size; /* sizeof this struct: set by its _init() or _INIT */
    enum kv_mem_kind kind;
    size_t size_bytes;  /* > 0; host arenas round up to the alignment */
    size_t align_bytes; /* a power of two the base must be aligned to, or 0. It only
                           raises the default floor: 2 MiB for host arenas >= 2 MiB
                           (huge pages stay possible), 64 bytes below; 256 for
                           pinned/device (larger ones met by over-allocating) */
    int device;         /* CUDA device for KV_MEM_DEVICE (ignored otherwise) */
    unsigned flags;     /* KV_ARENA_* */
};

/* A config with defaults: host kind, the given size, default alignment
 * (a C compound literal: cfg = KV_ARENA_CONFIG_INIT(bytes)). */
#define KV_ARENA_CONFIG_INIT(bytes)                                                                \
    ((struct kv_arena_config){.struct_size = sizeof(struct kv_arena_config),                       \
                              .kind = KV_MEM_HOST,                                                 \
                              .size_bytes = (bytes)})

/* Zero *cfg, set its struct_size and size_bytes (C and C++). */
static inline void kv_arena_config_init(struct kv_arena_config *cfg, size_t bytes)
{
    memset(cfg, 0, sizeof(*cfg));
    cfg->struct_size = sizeof(*cfg);
    cfg->size_bytes = bytes;
}

/*
 * Create an arena. *out is set only on success; destroy with
 * kv_arena_destroy(). cfg is borrowed for the call. Every field, and the
 * size to allocate derived from them, is checked before anything is
 * allocated.
 *
 * Returns KV_OK; KV_ERR_NULL (cfg or out NULL); KV_ERR_INVALID_ARG (unknown
 * kind, size 0, alignment not a power of two or below sizeof(void *), bad
 * flags, CUDA device index out of range); KV_ERR_OVERFLOW (size rounded up
 * to the alignment overflows); KV_ERR_NO_MEMORY (also for a host arena larger
 * than the machine's physical memory, refused before anything is mapped:
 * overcommit would grant it and the OOM killer end it); KV_ERR_UNSUPPORTED
 * (pinned/device without CUDA or a GPU, zero-fill of device memory);
 * KV_ERR_DEVICE (any other CUDA runtime error; the message carries it).
 * A device arena is allocated on cfg->device; the calling thread's current
 * CUDA device is left as it was.
 */
KV_API KV_NODISCARD kv_status kv_arena_create(const struct kv_arena_config *cfg, kv_arena **out);

/* Drop the creator's reference: the last reference frees the arena's
 * memory and the handle (references: kv_arena_retain, and a transport's
 * kv_xport_mem_reg_arena until its deregistration). NULL is a no-op. An
 * arena of a kv_cache (kv_cache_arena) is refused: nothing is freed,
 * kv_last_error() says so (KV_ERR_BAD_STATE); kv_cache_destroy frees it.
 * Memory registered by pointer (kv_xport_mem_reg) must be deregistered
 * first. */
KV_API void kv_arena_destroy(kv_arena *arena);

/* Take a reference on arena (dropped by kv_arena_release); returns arena.
 * NULL is a no-op. Thread-safe. */
KV_API kv_arena *kv_arena_retain(kv_arena *arena);

/* Drop a reference taken by kv_arena_retain (the last one frees, as
 * kv_arena_destroy). NULL is a no-op. Thread-safe. */
KV_API void kv_arena_release(kv_arena *arena);

/* First byte of the arena (a device pointer for KV_MEM_DEVICE). */
KV_API void *kv_arena_base(const kv_arena *arena);

/* Usable bytes: >= cfg.size_bytes (host arenas are rounded up to the
 * alignment so huge pages cover the whole range). */
KV_API size_t kv_arena_size(const kv_arena *arena);

/* Alignment of kv_arena_base() in bytes. */
KV_API size_t kv_arena_align(const kv_arena *arena);

/* The kind the arena was created with. */
KV_API enum kv_mem_kind kv_arena_kind(const kv_arena *arena);

/* True when madvise(MADV_HUGEPAGE) was accepted for a host arena (the kernel
 * may still back it with small pages; this only says the hint was taken). */
KV_API bool kv_arena_huge_pages(const kv_arena *arena);

/*
 * The arena's regions, for one-time registration with a transport: writes up
 * to cap regions to out and the number of regions in *n (today always 1).
 * Call with out NULL and cap 0 to ask for the count.
 *
 * Returns KV_OK; KV_ERR_NULL (arena or n NULL, or out NULL with cap > 0);
 * KV_ERR_INVALID_ARG (cap smaller than the count; *n still set. out not
 * aligned for struct kv_mem_region with cap > 0; *n not set).
 */
KV_API KV_NODISCARD kv_status kv_arena_regions(const kv_arena *arena, struct kv_mem_region *out,
                                               size_t cap, size_t *n);

#ifdef __cplusplus
}
#endif

#endif /* KV_ARENA_H */
