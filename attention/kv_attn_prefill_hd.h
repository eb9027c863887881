/*
 * kv_attn_prefill_hd.h - the CUDA body of the multi-token paged attention
 * (kv_attn_prefill_cuda; it takes a one-row-per-sequence decode job too,
 * though kv_attn_decode_ex_cuda runs the decode kernel, options included),
 * and its launch parameters: one source
 * for the GPU (kv_attn_cuda.cu, a thin __global__ wrapper) and the CPU grid
 * emulator (kv_attn_grid.c, tests/unit/test_grid_prefill.c).
 *
 * The computation is docs/kernels.md's "Attention options and the
 * multi-token kernel": query i of sequence s (q_len queries over len
 * tokens) sits at p = len - q_len + i and sees tokens lo(p) <= t <= p,
 * lo(p) = W < 0 ? 0 : max(0, p - W); scores scale * q.k * kscale, capped
 * c tanh(x / c) with a soft cap c > 0; out = softmax-weighted V x vscale;
 * lse = m + ln(sum) (natural log, -inf with no token visible).
 *
 * Work: the rows of sequence s and KV head h are its q_len x g (query,
 * query head) pairs, query-major (row r: query r / g, head h g + r % g).
 * One CUDA block of KV__PF_WARPS warps per (tile of `rows` rows, KV head):
 * block b is head b % H of tile b / H, tiles numbered over the sequences by
 * tile_start (sequence s has tiles tile_start[s] .. tile_start[s+1] - 1).
 * The block walks only the tokens its queries see (from the first row's lo
 * to the last row's position) in tiles of tk tokens:
 *
 *   load     K and V rows of the tile into shared memory as f32 (times
 *            their scales), each row read in vbytes vectors (the widest
 *            every cache address allows, kv__cpre_width; the element size
 *            otherwise) and converted: every K/V row loaded serves all the
 *            block's rows (the g query heads of each query, and its queries)
 *   scores   a warp per row, a lane per token: the dot product over D (q
 *            in shared memory, K rows at an odd stride: no bank conflict),
 *            the mask and the cap, then the online softmax with a warp max
 *            and a warp sum; each lane keeps the row's m and l in registers
 *            (the warp's rows: at most KV__PF_ROWS_WARP)
 *   values   the block's threads over the rows x D accumulators (shared
 *            memory): acc = acc x corr + sum_t w_t v_t
 *
 * then each warp writes its rows' out = acc / l and lse. A decode job
 * (q_start NULL) is q_len 1 at row s: a sequence of 0 tokens gets out 0
 * and lse -inf.
 *
 * MLA (kv_attn_prefill_mla_cuda: a K-only layout, H 1, job->mla_dv = dv):
 * the values are the first dv dims of the K rows, so only K is loaded, vt
 * is kt (row stride dp), and acc and out have dv dims; the K scale is in
 * kt, so in the scores and the values alike.
 *
 * Shared memory (floats): q [rows][D], kt [tk][dp], vt [tk][D] (MLA: none),
 * sc [rows][tk], corr [rows], acc [rows][dv]; dp = D | 1, dv = D but for
 * MLA. rows (<= 32) and tk (<= 32): what fits in KV__SHARED_MAX and costs
 * least (kv__cpre_tile_v).
 *
 * Header tier *_hd.h (module-private in practice: attention/ and its tests).
 */
#ifndef KV_ATTN_PREFILL_HD_H
#define KV_ATTN_PREFILL_HD_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kv_attn_kernels_hd.h"

#define KV__PF_WARPS 4
#define KV__PF_ROWS_WARP 8                            /* rows a warp keeps m, l of */
#define KV__PF_ROWS (KV__PF_WARPS * KV__PF_ROWS_WARP) /* rows a block, at most */
#define KV__PF_TOKENS 32                              /* tokens a tile (<= 32: a lane each) */

struct kv__cpre {
    struct kv_layout lo;
    const char *cache;
    uint32_t layer;
    struct kv__cside q, out;       /* [T][Hq][D] (decode: [S][Hq][D]) */
    int64_t g, pt, n_seqs;         /* query heads a KV head, tokens a page */
    int64_t rows, tk, dp;          /* rows a block, tokens a tile, kt's row stride */
    int64_t dv;                    /* value (out) dims: D; MLA: the job's dv */
    int mla;                       /* 1: values = the K rows' first dv dims, no V plane */
    float softmax_scale, soft_cap; /* soft_cap 0: off */
    int32_t window_left;           /* -1: off */
    float *lse;                    /* [rows of q][lse_stride]; NULL: none */
    int64_t lse_stride;
    const int32_t *page_ids;   /* [page_start[n_seqs]] */
    const int64_t *page_start; /* [n_seqs + 1] */
    const int64_t *seq_tokens; /* [n_seqs] */
    const int64_t *q_start;    /* [n_seqs + 1]; NULL: row s, one query */
    const int64_t *tile_start; /* [n_seqs + 1] */
    const float *scales;       /* [2][n_mul]; NULL: 1 */
    int64_t n_mul;
};

/* A register buffer for one vector move (kv_grid_move's alignment). */
struct kv__pf_vec {
    unsigned char b[16];
} __attribute__((aligned(16)));

/* The first token position p sees: lo(p). */
KV_HD int64_t kv__pf_lo(int64_t p, int32_t window_left)
{
    if (window_left < 0 || p - window_left < 0)
        return 0;
    return p - window_left;
}

/* Shared memory: see the top of the file. Synchronizes: launch with 32 x
 * KV__PF_WARPS threads, vbytes the width kv__cpre_width chose. */
KV_HD void kv__prefill_body(const struct kv_grid_ctx *c, const struct kv__cpre *p, int vbytes)
{
    float *sh = (float *)c->shared;
    const int64_t H = p->lo.num_heads, D = p->lo.head_dim, g = p->g, R = p->rows, TK = p->tk;
    const int64_t dp = p->dp, es = p->lo.elem_bytes, Dv = p->dv, planes = p->mla ? 1 : 2;
    const int64_t h = c->block % H, tile = c->block / H;
    const int warps = (int)(c->block_dim / 32), warp = (int)(c->thread / 32),
              lane = (int)(c->thread % 32);
    /* the tile's sequence: the last s with tile_start[s] <= tile */
    int64_t s = 0, hi = p->n_seqs;
    while (hi - s > 1) {
        const int64_t mid = s + (hi - s) / 2;
        if (p->tile_start[mid] <= tile)
            s = mid;
        else
            hi = mid;
    }
    const int64_t n_tok = p->seq_tokens[s];
    const int64_t q0 = p->q_start ? p->q_start[s] : s;
    const int64_t q_len = p->q_start ? p->q_start[s + 1] - q0 : 1;
    const int64_t r0 = (tile - p->tile_start[s]) * R;
    const int64_t nr = q_len * g - r0 < R ? q_len * g - r0 : R; /* this block's rows */
    const int64_t pos0 = n_tok - q_len;                         /* query 0's position */
    const int64_t t_lo = kv__pf_lo(pos0 + r0 / g, p->window_left);
    const int64_t t_hi = pos0 + (r0 + nr - 1) / g;
    const int32_t *pages = p->page_ids + p->page_start[s];
    float *q = sh;                                   /* [R][D] */
    float *kt = q + R * D;                           /* [TK][dp] */
    float *vt = p->mla ? kt : kt + TK * dp;          /* [TK][vst] */
    const int64_t vst = p->mla ? dp : D;             /* vt's row stride */
    float *sc = p->mla ? vt + TK * dp : vt + TK * D; /* [R][TK] */
    float *corr = sc + R * TK;                       /* [R] */
    float *acc = corr + R;                           /* [R][Dv] */
    for (int64_t i = c->thread; i < nr * D; i += c->block_dim) {
        const int64_t rr = i / D, d = i - rr * D;
        const int64_t qi = (r0 + rr) / g, qh = h * g + (r0 + rr) % g;
        q[i] =
            kv_to_f32(p->q.dt, p->q.base + (q0 + qi) * p->q.tok + qh * p->q.head + d * p->q.dim) *
            p->softmax_scale;
    }
    for (int64_t i = c->thread; i < nr * Dv; i += c->block_dim)
        acc[i] = 0.0f;
    const int64_t hs = p->n_mul > 1 ? h : 0;
    const float ks = p->scales ? p->scales[hs] : 1.0f,
                vs = p->scales ? p->scales[p->n_mul + hs] : 1.0f;
    float m[KV__PF_ROWS_WARP], l[KV__PF_ROWS_WARP];
    for (int k = 0; k < KV__PF_ROWS_WARP; k++) {
        m[k] = -INFINITY;
        l[k] = 0.0f;
    }
    const int64_t cpr = D * es / vbytes, epv = vbytes / es; /* vectors a row, elements a vector */
    for (int64_t t0 = t_lo; t0 <= t_hi; t0 += TK) {
        const int64_t nt = t_hi - t0 + 1 < TK ? t_hi - t0 + 1 : TK;
        kv_grid_sync(c); /* q and acc set; the previous tile's kt, vt, sc read */
        for (int64_t i = c->thread; i < planes * nt * cpr; i += c->block_dim) {
            const int kv = i >= nt * cpr;
            const int64_t j = i - (kv ? nt * cpr : 0), r = j / cpr, ch = j - r * cpr, t = t0 + r;
            const int64_t slot = kv_attn_page_slot(pages[t / p->pt], p->pt, t % p->pt);
            const char *src = p->cache + kv_layout_slot_offset_bytes(&p->lo, p->layer, kv, slot) +
                              h * p->lo.stride_head_bytes + ch * vbytes;
            struct kv__pf_vec v;
            kv_grid_move(c, v.b, src, vbytes);
            float *dst = (kv ? vt + r * D : kt + r * dp) + ch * epv;
            const float f = kv ? vs : ks;
            for (int64_t e = 0; e < epv; e++)
                dst[e] = kv_to_f32(p->lo.dtype, v.b + e * es) * f;
        }
        kv_grid_sync(c);
        for (int k = 0; k < KV__PF_ROWS_WARP; k++) {
            const int64_t rr = warp + (int64_t)k * warps;
            if (rr >= nr)
                break; /* the whole warp: rr is the warp's */
            const int64_t pos = pos0 + (r0 + rr) / g, t = t0 + lane;
            float x = -INFINITY;
            if (lane < nt && t >= kv__pf_lo(pos, p->window_left) && t <= pos) {
                float dot = 0.0f;
                for (int64_t d = 0; d < D; d++)
                    dot += q[rr * D + d] * kt[lane * dp + d];
                x = p->soft_cap > 0.0f ? p->soft_cap * tanhf(dot / p->soft_cap) : dot;
            }
            const float m1 = fmaxf(m[k], kv_grid_warp_max(c, x));
            const float w = x == -INFINITY ? 0.0f : kv_grid_expf(x - m1);
            const float sum = kv_grid_warp_sum(c, w);
            const float cr = m[k] == -INFINITY ? 0.0f : kv_grid_expf(m[k] - m1);
            l[k] = l[k] * cr + sum;
            m[k] = m1;
            if (lane < TK)
                sc[rr * TK + lane] = w;
            if (lane == 0)
                corr[rr] = cr;
        }
        kv_grid_sync(c);
        for (int64_t i = c->thread; i < nr * Dv; i += c->block_dim) {
            const int64_t rr = i / Dv, d = i - rr * Dv;
            float a = acc[i] * corr[rr];
            for (int64_t r = 0; r < nt; r++)
                a += sc[rr * TK + r] * vt[r * vst + d];
            acc[i] = a;
        }
    }
    kv_grid_sync(c);
    for (int k = 0; k < KV__PF_ROWS_WARP; k++) {
        const int64_t rr = warp + (int64_t)k * warps;
        if (rr >= nr)
            break;
        const int64_t row = q0 + (r0 + rr) / g, qh = h * g + (r0 + rr) % g;
        for (int64_t d = lane; d < Dv; d += 32)
            kv_from_f32(p->out.dt, l[k] != 0.0f ? acc[rr * Dv + d] / l[k] : 0.0f,
                        p->out.base + row * p->out.tok + qh * p->out.head + d * p->out.dim);
        if (p->lse && lane == 0)
            p->lse[row * p->lse_stride + qh] = m[k] == -INFINITY ? -INFINITY : m[k] + logf(l[k]);
    }
}

/* ---- launch parameters (host code, shared by the two launchers) ------------------- */

/* The widest vector (16, 8, 4, 2 bytes, or the element) every K/V row
 * address of layout lo at base allows: each term of the address (base,
 * layer, K/V, block, token and head strides) and the row's bytes a
 * multiple of it. */
static inline int kv__cpre_width(const struct kv_layout *lo, const void *base)
{
    const uint64_t bits = (uint64_t)(uintptr_t)base | (uint64_t)lo->stride_layer_bytes |
                          (uint64_t)lo->stride_kv_bytes | (uint64_t)lo->stride_block_bytes |
                          (uint64_t)lo->stride_token_bytes | (uint64_t)lo->stride_head_bytes |
                          (uint64_t)(lo->head_dim * lo->elem_bytes);
    for (int w = 16; w > (int)lo->elem_bytes; w /= 2)
        if ((bits & (uint64_t)(w - 1)) == 0)
            return w;
    return (int)lo->elem_bytes;
}

/* Shared bytes of a block of R rows and TK tokens at head dim D, value
 * dims Dv (mla: no V tile). */
static inline size_t kv__cpre_shared_v(int64_t R, int64_t TK, int64_t D, int64_t Dv, int mla)
{
    return (size_t)(R * D + R * Dv + TK * ((D | 1) + (mla ? 0 : D)) + R * TK + R) * sizeof(float);
}

/* kv__cpre_shared_v of a K/V job (Dv = D). */
static inline size_t kv__cpre_shared(int64_t R, int64_t TK, int64_t D)
{
    return kv__cpre_shared_v(R, TK, D, D, 0);
}

/* The rows a block and tokens a tile for head dim D and at most max_rows
 * rows a (sequence, KV head) (rows 0: none fits in KV__SHARED_MAX): of the
 * pairs that fit, the least time per (row, token) pair as the body spends
 * it, per unit of D: scores 3 ceil(R / 4) / (R TK) (a warp's rows one
 * after another, a lane per token: a tile of fewer than 32 tokens idles
 * lanes), loads 6 / (32 R) (each K/V row loaded serves R rows); the values
 * cost the same for every pair. The most rows on a tie. */
static inline void kv__cpre_tile_v(int64_t D, int64_t Dv, int mla, int64_t max_rows, int64_t *rows,
                                   int64_t *tk)
{
    double best = 0.0;
    *rows = 0, *tk = 0;
    for (int64_t R = max_rows < KV__PF_ROWS ? max_rows : KV__PF_ROWS; R >= 1; R = R > 1 ? R / 2 : 0)
        for (int64_t TK = KV__PF_TOKENS; TK >= 1; TK /= 2) {
            if (kv__cpre_shared_v(R, TK, D, Dv, mla) > KV__SHARED_MAX)
                continue;
            const double cost =
                3.0 * (double)((R + 3) / 4) / (double)(R * TK) + 6.0 / (32.0 * (double)R);
            if (!*rows || cost < best)
                best = cost, *rows = R, *tk = TK;
        }
}

/* kv__cpre_tile_v of a K/V job (Dv = D). */
static inline void kv__cpre_tile(int64_t D, int64_t max_rows, int64_t *rows, int64_t *tk)
{
    kv__cpre_tile_v(D, D, 0, max_rows, rows, tk);
}

/* Job j (kv__attn_decode_check: a prefill, or a decode with options;
 * kv__attn_prefill_mla_check: an MLA prefill, mla_dv > 0) as
 * *p (the host arrays; a CUDA launcher replaces them with device copies),
 * tile_start [n_seqs + 1] filled (the caller's), and the launch: *blocks (0: no row, nothing to
 * launch), *shmem, *vbytes. Rows and tile tokens: kv__cpre_tile. KV_ERR_UNSUPPORTED where one row
 * and one token exceed KV__SHARED_MAX or the blocks exceed the grid. */
static inline kv_status kv__cpre_build(const struct kv__attn_job *j, const char *fn,
                                       struct kv__cpre *p, int64_t *tile_start, int64_t *blocks,
                                       size_t *shmem, int *vbytes)
{
    memset(p, 0, sizeof(*p));
    p->lo = j->cache.layout;
    p->cache = (const char *)j->cache.base;
    p->layer = j->layer0;
    p->q = kv__cside_of(&j->q);
    p->out = kv__cside_of(&j->out);
    p->g = j->q_heads / p->lo.num_heads;
    p->pt = j->page_tokens;
    p->n_seqs = j->n_seqs;
    p->softmax_scale = j->softmax_scale;
    p->soft_cap = j->soft_cap;
    p->window_left = j->window_left;
    p->lse = j->lse;
    p->lse_stride = j->lse_stride;
    p->page_ids = j->page_ids;
    p->page_start = j->page_start;
    p->seq_tokens = j->seq_tokens;
    p->q_start = j->q_start;
    p->tile_start = tile_start;
    p->n_mul = j->n_scales > 1 ? j->n_scales : 1;
    const int64_t D = p->lo.head_dim;
    p->mla = j->mla_dv > 0;
    p->dv = p->mla ? j->mla_dv : D;
    int64_t max_rows = 0;
    for (uint32_t s = 0; s < j->n_seqs; s++) {
        const int64_t n = (j->q_start ? j->q_start[s + 1] - j->q_start[s] : 1) * p->g;
        max_rows = n > max_rows ? n : max_rows;
    }
    kv__cpre_tile_v(D, p->dv, p->mla, max_rows, &p->rows, &p->tk);
    *blocks = 0;
    if (max_rows == 0)
        return KV_OK;
    if (!p->rows)
        return kv__error(KV_ERR_UNSUPPORTED,
                         "%s: head dim %lld needs %zu bytes of shared memory for one query row "
                         "(at most %d)",
                         fn, (long long)D, kv__cpre_shared_v(1, 1, D, p->dv, p->mla),
                         KV__SHARED_MAX);
    p->dp = D | 1;
    tile_start[0] = 0;
    for (uint32_t s = 0; s < j->n_seqs; s++) {
        const int64_t n = (j->q_start ? j->q_start[s + 1] - j->q_start[s] : 1) * p->g;
        tile_start[s + 1] = tile_start[s] + (n + p->rows - 1) / p->rows;
    }
    *blocks = tile_start[j->n_seqs] * p->lo.num_heads;
    if (*blocks > INT32_MAX)
        return kv__error(KV_ERR_UNSUPPORTED, "%s: %lld (tile, KV head) blocks (at most %d)", fn,
                         (long long)*blocks, INT32_MAX);
    *shmem = kv__cpre_shared_v(p->rows, p->tk, D, p->dv, p->mla);
    *vbytes = kv__cpre_width(&p->lo, j->cache.base);
    return KV_OK;
}

/* The scales [2][n_mul] of job j (1 without). */
static inline void kv__cpre_scales(const struct kv__attn_job *j, const struct kv__cpre *p,
                                   float *scales)
{
    for (int64_t h = 0; h < p->n_mul; h++) {
        scales[h] = j->k_scale ? j->k_scale[h] : 1.0f;
        scales[p->n_mul + h] = j->v_scale ? j->v_scale[h] : 1.0f;
    }
}

#endif /* KV_ATTN_PREFILL_HD_H */
