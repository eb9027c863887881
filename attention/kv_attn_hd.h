/*
 * kv_attn_hd.h - the addressing the attention kernels share, CPU and CUDA
 * (__host__ __device__ under nvcc, static inline in C; KV_HD from
 * kv_view_hd.h). The CPU executors and the CUDA kernels compute every
 * cache address with these functions, and the CPU tests check them against
 * an address computed from the layout's config alone.
 *
 *   slot s of the cache            block s / N, token s % N
 *   kernel page p (ratio r)        slots p * (N/r) .. p * (N/r) + N/r - 1
 *   element (l, kv, s, h, d)       kv_layout_slot_offset_bytes(l, kv, s)
 *                                  + h * stride_head_bytes + d * elem_bytes
 */
#ifndef KV_ATTN_HD_H
#define KV_ATTN_HD_H

#include <stdint.h>

#include "kv_layout.h"
#include "kv_layout_hd.h"
#include "kv_view_hd.h"

/* The slot holding token i (< page_tokens) of kernel page `page`, pages of
 * page_tokens = N / r tokens: page * page_tokens + i (slots do not depend on
 * r, docs/page-table.md). */
KV_HD int64_t kv_attn_page_slot(int64_t page, int64_t page_tokens, int64_t i)
{
    return page * page_tokens + i;
}

#endif /* KV_ATTN_HD_H */
