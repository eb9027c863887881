/*
 * kv_plan_int.h - the inside of a transfer plan, shared by the connector's
 * executors (CPU copy, pack/unpack, the offload tier, the CUDA executor).
 * Module-private: not installed.
 */
#ifndef KV_PLAN_INT_H
#define KV_PLAN_INT_H

#include <stdbool.h>
#include <stdint.h>

#include "kv_plan.h"
#include "kv_view_hd.h" /* KV_HD */

/* One 2-D copy between block ks (of the window's source blocks) and kd:
 * height rows of width bytes, src_rel / dst_rel from the blocks' starts. */
struct kv__plan_copy {
    int64_t ks, kd;
    int64_t src_rel, dst_rel;
    int64_t width;
    int64_t height;
    int64_t src_pitch, dst_pitch;
};

/* cfg: the config resolved against src and dst (kv__plan_resolve):
 * n_heads > 0 and n_layers > 0, both ranges inside both layouts.
 * wire_layer0: the layer of the packed cache that src's layer 0 stands for.
 * 0 except for a plan from kv_unpack_plan_create of a layer range, whose
 * src is the wire layout of layers [wire_layer0, wire_layer0 + src L) of
 * the cache that was packed (kv_unpack checks it against the buffer). */
struct kv_plan {
    struct kv_layout src, dst;
    struct kv_plan_config cfg;
    int64_t wire_layer0;
    struct kv_plan_stats stats;
    int64_t n_copies;
    struct kv__plan_copy *copies;
};

/* The validation of kv_plan_create, alone: the two layouts as the kernels
 * check them, dtype and head dim equal, cfg's struct_size (cfg NULL: every
 * head, every layer), the head and layer ranges inside both layouts. On
 * success *out is cfg with n_heads and n_layers resolved (never 0). The
 * refusals and statuses of kv_plan_create, its messages prefixed fn. */
kv_status kv__plan_resolve(const char *fn, const struct kv_layout *src, const struct kv_layout *dst,
                           const struct kv_plan_config *cfg, struct kv_plan_config *out);

/* Blocks a request of n_tokens needs on one side of a plan. */
static inline uint64_t kv__plan_blocks(const struct kv_layout *lo, uint64_t n_tokens)
{
    const uint64_t N = (uint64_t)lo->block_tokens;
    return n_tokens / N + (n_tokens % N != 0);
}

/* Work items of a request: every copy of every window it touches,
 * item w = (window w / n_copies, copy w % n_copies). */
static inline int64_t kv__plan_items(const kv_plan *plan, uint64_t n_tokens)
{
    const uint64_t W = (uint64_t)plan->stats.window_tokens;
    return (int64_t)((n_tokens + W - 1) / W) * plan->n_copies;
}

/* Item w of a request of n_src / n_dst blocks over a table of n_copies
 * copies per window (window_src_blocks / window_dst_blocks blocks per
 * window): its copy, and in *si / *di the indices into the request's block
 * lists of the copy's two blocks. NULL when one of them is past the
 * request's last block (the partial last window): that copy is skipped.
 * The one mapping every executor uses, on the host and in the CUDA kernel
 * (KV_HD). */
KV_HD const struct kv__plan_copy *kv__plan_item_at(const struct kv__plan_copy *copies,
                                                   int64_t n_copies, int64_t window_src_blocks,
                                                   int64_t window_dst_blocks, int64_t w,
                                                   uint32_t n_src, uint32_t n_dst, int64_t *si,
                                                   int64_t *di)
{
    const int64_t win = w / n_copies;
    const struct kv__plan_copy *cp = &copies[w - win * n_copies];
    *si = win * window_src_blocks + cp->ks;
    *di = win * window_dst_blocks + cp->kd;
    return *si < (int64_t)n_src && *di < (int64_t)n_dst ? cp : NULL;
}

/* kv__plan_item_at over all of a plan's copies. */
static inline const struct kv__plan_copy *kv__plan_item(const kv_plan *plan, int64_t w,
                                                        uint32_t n_src, uint32_t n_dst, int64_t *si,
                                                        int64_t *di)
{
    return kv__plan_item_at(plan->copies, plan->n_copies, plan->stats.window_src_blocks,
                            plan->stats.window_dst_blocks, w, n_src, n_dst, si, di);
}

/* Start of block id of a cache with layout lo (64-bit product). */
static inline char *kv__plan_block_addr(const struct kv_paged_cache *c, const struct kv_layout *lo,
                                        uint32_t id)
{
    return (char *)c->base + (int64_t)id * lo->stride_block_bytes;
}

/* The request checks of kv_plan_copy, shared by every executor that moves
 * between two caches (CPU and CUDA): each cache against the plan's layout
 * (cuda: device-addressable memory allowed), the list lengths, block ids in
 * range, no destination block twice, no block on both sides of one cache,
 * no partial overlap. fn names the caller in messages. */
kv_status kv__plan_check_request(const char *fn, const kv_plan *plan,
                                 const struct kv_paged_cache *src, const uint32_t *src_blocks,
                                 uint32_t n_src, const struct kv_paged_cache *dst,
                                 const uint32_t *dst_blocks, uint32_t n_dst, uint64_t n_tokens,
                                 bool cuda);

/* kv__plan_check_request's checks that read no block id, for device-resident
 * lists (kv_plan_copy_cuda_dev): both caches (CUDA-addressable), the list
 * lengths, a list non-NULL when its n > 0, storages overlapping without
 * being one cache. */
kv_status kv__plan_check_request_dev(const char *fn, const kv_plan *plan,
                                     const struct kv_paged_cache *src, const uint32_t *src_blocks,
                                     uint32_t n_src, const struct kv_paged_cache *dst,
                                     const uint32_t *dst_blocks, uint32_t n_dst, uint64_t n_tokens);

/* The validity test the kernels apply to a cache's layout, on a bare layout
 * (no storage needed): kv_paged_check's refusals, prefixed "fn: what". */
kv_status kv__plan_check_layout(const char *fn, const char *what, const struct kv_layout *lo);

/* Block ids of one side in range: KV_ERR_NULL (ids NULL with n > 0),
 * KV_ERR_OUT_OF_BOUNDS naming the first id >= num_blocks. */
kv_status kv__plan_check_ids(const char *fn, const char *side, const uint32_t *ids, uint32_t n,
                             int64_t num_blocks);

/* KV_ERR_OVERLAP when a destination id repeats, or (sids non-NULL: both
 * sides are one cache) a source id is also a destination id. */
kv_status kv__plan_check_unique(const char *fn, const uint32_t *dids, uint32_t nd,
                                const uint32_t *sids, uint32_t ns);

/* True when plan moves one block to one block (a window of 1 + 1) and
 * writes the destination block front to back without gaps, total bytes in
 * all: a compact image (the pack payload, an offload entry). */
bool kv__plan_is_sequential(const kv_plan *plan, int64_t total);

/* (Executing a sequential plan with its checksum, and with streaming
 * stores: kv__pack_copy_hash, kv__pack_exec in connector/pack/kv_pack_int.h.) */

#endif /* KV_PLAN_INT_H */
