/*
 * kv_plan.h - transfer plans: how the blocks of one paged layout become the
 * blocks of another, computed once as a table of byte runs, then executed
 * per request with nothing but two lists of block ids (docs/connector.md).
 *
 * A plan relates a source layout and a destination layout with the same
 * head dim and dtype. They may differ in everything else: NHD/HND,
 * layer-/block-major, padding, packed K|V, block count, page size (N), the
 * heads - a head range [src_head0, src_head0 + n_heads) of the source lands
 * on [dst_head0, dst_head0 + n_heads) of the destination (a receiver with
 * another tensor-parallel size) - and the layers: a layer range
 * [src_layer0, src_layer0 + n_layers) of the source lands on
 * [dst_layer0, dst_layer0 + n_layers) of the destination (pipeline stage k
 * of a prefill writing its layers into a decoder's matching ones, or one
 * layer per transfer); layers outside the range are neither read nor
 * written. Element bytes are never converted. K-only (MLA latent) layouts
 * move to K-only layouts only: one plane, any of the above (a decode rank
 * of any tensor-parallel size receives the whole latent: H is 1).
 *
 * The unit of a plan is a window of lcm(Ns, Nd) tokens: lcm/Ns source blocks
 * and lcm/Nd destination blocks. For each (source block, destination block)
 * of a window the plan holds the byte runs between them, relative to the two
 * blocks' starts (every layout is affine in the block id), coalesced where
 * both sides are contiguous, and grouped into 2-D copies (width x height at
 * two pitches) where consecutive runs step by constant strides: one block
 * of a layer-major cache converted to the same layout is a single 2-D copy
 * of 2L rows. Addresses come from kvcache/kv_layout_hd.h, the code the
 * kernels use.
 *
 * Thread safety: a plan is immutable after kv_plan_create; any number of
 * threads may execute it at once (on disjoint destination blocks).
 */
#ifndef KV_PLAN_H
#define KV_PLAN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kv_paged.h"
#include "kv_threads.h"
#include "kv_layout.h"
#include "kv_status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Options of kv_plan_create. Start from KV_PLAN_CONFIG_INIT (or
 * kv_plan_config_init): all zero is every head and every layer. Zero
 * n_heads means every head (both layouts then need the same H and both head
 * offsets must be 0); zero n_layers means every layer (the same for L).
 * With n_layers > 0 the layouts may have different L: a pipeline stage's
 * cache of 4 layers moves into layers [dst_layer0, dst_layer0 + 4) of a
 * decoder's cache of 32. */
struct kv_plan_config {
    size_t struct_size; /* sizeof this struct: set by _INIT / _init() */
    int64_t src_head0;  /* first source head moved */
    int64_t dst_head0;  /* where it lands in the destination */
    int64_t n_heads;    /* heads moved; 0 = all (H of both) */
    int64_t src_layer0; /* first source layer moved */
    int64_t dst_layer0; /* where it lands in the destination */
    int64_t n_layers;   /* layers moved; 0 = all (L of both) */
};

#define KV_PLAN_CONFIG_INIT                                                                        \
    {                                                                                              \
        .struct_size = sizeof(struct kv_plan_config)                                               \
    }

static inline void kv_plan_config_init(struct kv_plan_config *cfg)
{
    memset(cfg, 0, sizeof(*cfg));
    cfg->struct_size = sizeof(*cfg);
}

typedef struct kv_plan kv_plan;

/* Build the plan from src to dst (both complete layouts from
 * kv_layout_init). cfg may be NULL (every head, every layer).
 * KV_ERR_NULL         src, dst or out NULL.
 * KV_ERR_INVALID_ARG  a layout kv_layout_init would not compute, a config of
 *                     another struct_size (a caller built against other
 *                     headers), dtypes or element sizes that differ, one
 *                     layout K-only (k_only) and the other not.
 * KV_ERR_BAD_SHAPE    head dims that differ; a head or layer range outside
 *                     either layout (a negative offset or count included);
 *                     n_heads 0 with different head counts or a non-zero
 *                     head offset; n_layers 0 with different layer counts
 *                     or a non-zero layer offset; a window (lcm of the page
 *                     sizes) over 65,536 tokens.
 * KV_ERR_OVERFLOW     more rows (layers x planes x window tokens x heads),
 *                     or window bytes, than 64 bits hold.
 * KV_ERR_NO_MEMORY.
 * Each message names the values. *out is NULL on any error (out itself
 * NULL aside). */
KV_API KV_NODISCARD kv_status kv_plan_create(const struct kv_layout *src,
                                             const struct kv_layout *dst,
                                             const struct kv_plan_config *cfg, kv_plan **out);
KV_API void kv_plan_destroy(kv_plan *plan);

/* What a plan moves. Rows, runs, copies and bytes count the moved heads
 * and layers only: rows = n_layers x planes x window_tokens x n_heads
 * (planes 2, or 1 between K-only layouts). */
struct kv_plan_stats {
    int64_t window_tokens;     /* lcm(Ns, Nd) */
    int64_t window_src_blocks; /* window_tokens / Ns */
    int64_t window_dst_blocks; /* window_tokens / Nd */
    int64_t rows;              /* contiguous head rows (D elements) per window, before coalescing */
    int64_t runs;              /* contiguous byte runs per window after coalescing */
    int64_t copies;            /* 2-D copies per window (runs grouped by constant pitches) */
    int64_t window_bytes;      /* bytes moved per full window */
};

KV_API KV_NODISCARD kv_status kv_plan_stats_get(const kv_plan *plan, struct kv_plan_stats *out);

/* Execute the plan on the CPU for one request of n_tokens tokens (OpenMP
 * across copies): token t of the request is in src_blocks[t / Ns] and goes
 * to dst_blocks[t / Nd], so n_src must be ceil(n_tokens / Ns) and n_dst
 * ceil(n_tokens / Nd). Blocks move whole (within the plan's heads and
 * layers): tokens past n_tokens inside the last blocks are copied as they
 * are; destination tokens that no source block covers, and the layers and
 * heads outside the plan's ranges, stay untouched.
 * Both caches are checked as the kernels check theirs (kv_paged_check,
 * CPU-addressable memory) and must carry the plan's layouts (fingerprints).
 * KV_ERR_NULL, KV_ERR_INVALID_ARG (a layout or memory kind, a layout other
 * than the plan's, a list of blocks not 4-byte aligned: its ids are read as
 * words), KV_ERR_BAD_SHAPE (list lengths), KV_ERR_OUT_OF_BOUNDS (a
 * block id >= B), KV_ERR_OVERLAP (a destination block listed twice; the
 * same storage on both sides with a block in both lists; storages that
 * partly overlap) - all before anything is written. */
KV_API KV_NODISCARD kv_status kv_plan_copy(const kv_plan *plan, struct kv_paged_cache src,
                                           const uint32_t *src_blocks, uint32_t n_src,
                                           struct kv_paged_cache dst, const uint32_t *dst_blocks,
                                           uint32_t n_dst, uint64_t n_tokens);

/* Execute the plan with CUDA for one request, asynchronously on stream
 * (NULL: the default stream; the copy is done when the stream's work up to
 * here is). No explicit synchronize, but when there are narrow copies their
 * table and block addresses are uploaded from pageable host memory on every
 * call, which CUDA may stage by synchronizing with the stream, and which
 * keeps the call out of CUDA graph capture (kv_plan_copy_cuda_dev below
 * takes device-resident block lists). The same request as kv_plan_copy, with the same checks and
 * statuses before anything is issued, except that the caches must be
 * CUDA-addressable (KV_MEM_DEVICE or KV_MEM_PINNED; KV_ERR_INVALID_ARG for
 * host memory). The block id lists are host memory, read before the call
 * returns. Copies of at least 4 KiB per row go to the copy engines as
 * cudaMemcpy2DAsync; all narrower ones are done by one kernel launch
 * (docs/connector.md, "CUDA executor").
 * KV_ERR_UNSUPPORTED  a build without CUDA, or no usable device (also for a
 *                     request of 0 tokens).
 * KV_ERR_NO_MEMORY    host memory for the schedule, device memory for the
 *                     kernel's copy table and block addresses.
 * KV_ERR_DEVICE       a CUDA call or the launch failed (the CUDA error in
 *                     the message); copies issued before it may have run. */
KV_API KV_NODISCARD kv_status kv_plan_copy_cuda(const kv_plan *plan, struct kv_paged_cache src,
                                                const uint32_t *src_blocks, uint32_t n_src,
                                                struct kv_paged_cache dst,
                                                const uint32_t *dst_blocks, uint32_t n_dst,
                                                uint64_t n_tokens, kv_cuda_stream stream);

/* ---- CUDA with device-resident block lists --------------------------------------
 * The engine's calling convention (docs/connector.md, "CUDA executor"): the
 * plan's copy table is put in device memory once (kv_plan_dev_create), and
 * each request passes its block id lists in device memory. A call checks
 * scalars only (the caches against the plan, the list lengths), launches
 * one kernel over every (window, copy) item, wide copies included (no
 * cudaMemcpy2DAsync, no host allocation, no host copy, no host loop over
 * blocks, no synchronization: safe inside cudaStreamBeginCapture), and the
 * kernel checks every block id against its cache: an id >= B skips the
 * copies that use it (nothing is read or written out of bounds for it) and
 * is recorded in `errors`. */
typedef struct kv_plan_dev kv_plan_dev;

/* The device-side error record of kv_plan_copy_cuda_dev (device memory the
 * caller allocates and zeroes, e.g. cudaMemsetAsync; NULL: not recorded).
 * count: invalid ids met since zeroed (once per list entry). first_key:
 * ~(side << 56 | index) of the first (lowest side, src 0 then dst 1, then
 * index), 0 for none; first_value: the id found there, valid when
 * value_key == first_key. The layout of struct kv_attn_cuda_errors. */
struct kv_plan_cuda_errors {
    uint64_t count;
    uint64_t first_key;
    uint64_t value_key;
    int64_t first_value;
};

/* Put plan's copy table in device memory (cudaMalloc + cudaMemcpy: outside
 * the hot path), keeping a copy of the plan: the plan may be destroyed
 * first. KV_ERR_NULL; KV_ERR_UNSUPPORTED
 * without CUDA or a usable device; KV_ERR_NO_MEMORY; KV_ERR_DEVICE. */
KV_API KV_NODISCARD kv_status kv_plan_dev_create(const kv_plan *plan, kv_plan_dev **out);
/* Free it (cudaFree). NULL: a no-op. */
KV_API void kv_plan_dev_destroy(kv_plan_dev *pd);

/* kv_plan_copy_cuda with src_blocks_dev [n_src] and dst_blocks_dev [n_dst]
 * in device memory (uint32), the plan's table from kv_plan_dev_create. The
 * checks of kv_plan_copy_cuda that read no id, before anything is issued:
 * KV_ERR_NULL (pd, or a list NULL with its n > 0), KV_ERR_INVALID_ARG (a
 * cache, its memory kind, a layout other than the plan's, a list not 4-byte
 * or errors not 8-byte aligned: the kernel's loads and atomics would fault
 * with cudaErrorMisalignedAddress, which loses the context), KV_ERR_BAD_SHAPE
 * (list lengths), KV_ERR_OVERLAP (storages that overlap without being one
 * cache). Not detected on the device: a destination id listed twice, or
 * (one cache) an id on both sides (the host mode refuses these; the result
 * is then undefined). KV_ERR_UNSUPPORTED (no CUDA or device), KV_ERR_DEVICE
 * (a failed launch). */
KV_API KV_NODISCARD kv_status kv_plan_copy_cuda_dev(
    const kv_plan_dev *pd, struct kv_paged_cache src, const uint32_t *src_blocks_dev,
    uint32_t n_src, struct kv_paged_cache dst, const uint32_t *dst_blocks_dev, uint32_t n_dst,
    uint64_t n_tokens, struct kv_plan_cuda_errors *errors, kv_cuda_stream stream);

#ifdef __cplusplus
}
#endif

#endif /* KV_PLAN_H */
