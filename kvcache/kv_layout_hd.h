/*
 * kv_layout_hd.h - the cache layout's slot addressing, shared by every
 * executor that addresses a paged cache, CPU and CUDA (__host__ __device__
 * under nvcc, static inline in C; KV_HD from kv_view_hd.h): the kernels
 * (attention/kv_attn_hd.h builds on it) and the transfer plans
 * (connector/). Header tier *_hd.h: shared by .c and .cu, never installed.
 *
 *   slot s of the cache            block s / N, token s % N
 *   element (l, kv, s, h, d)       kv_layout_slot_offset_bytes(l, kv, s)
 *                                  + h * stride_head_bytes + d * elem_bytes
 */
#ifndef KV_LAYOUT_HD_H
#define KV_LAYOUT_HD_H

#include <stdint.h>

#include "kv_layout.h"
#include "kv_view_hd.h"

/* Byte offset (from the cache base) of (layer, kv, head 0, d 0) of slot, for
 * 0 <= slot < B * N: one 64-bit dot product. The block index divides in 32
 * bits where slot and N fit (a 64-bit division is a long instruction
 * sequence on a GPU, where kernels call this per token; same result). */
KV_HD int64_t kv_layout_slot_offset_bytes(const struct kv_layout *lo, uint32_t layer, int kv,
                                          int64_t slot)
{
    const int64_t N = lo->block_tokens;
    const int64_t b = ((uint64_t)slot | (uint64_t)N) <= UINT32_MAX
                          ? (int64_t)((uint32_t)slot / (uint32_t)N)
                          : slot / N;
    const int64_t t = slot - b * N;
    return (int64_t)layer * lo->stride_layer_bytes + (int64_t)kv * lo->stride_kv_bytes +
           b * lo->stride_block_bytes + t * lo->stride_token_bytes;
}

#endif /* KV_LAYOUT_HD_H */
