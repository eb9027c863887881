/*
 * kv_attn_kernels_hd.h - the attention module's CUDA kernel bodies and
 * their launch parameters, one source for the GPU and the CPU grid
 * emulator (kvcache/kv_grid_hd.h).
 *
 * kv_attn_cuda.cu wraps each body in a __global__ function that fills a
 * struct kv_grid_ctx from the built-ins; kv_attn_grid.c runs the same body
 * over every (block, thread) of the same launch on the CPU, for the tests
 * (tests/unit/test_grid.c). The launch parameters (the structs below, the
 * vector width, the grid, the shared memory) are built by the host
 * functions at the end of this file, called by both launchers.
 *
 *   move    one CUDA block per (run, layer) item (grid-stride); its threads
 *           walk the run's [n][H][D] elements: as vbytes-wide vectors when
 *           the dtypes agree without scales (kv__move_bytes_body), through
 *           f32 otherwise (kv__move_convert_body)
 *   copy    one CUDA block per (block pair, byte run), vector copies
 *   copy_ex one per (pair, layer, storage block) or, one plane of packed
 *           K|V, per half head row
 *   decode  one CUDA block per (sequence, KV head); each warp takes every
 *           warps-th token, lanes split the head dim, an online softmax per
 *           warp and query head in shared memory, merged at the end
 *
 * Header tier *_hd.h (module-private in practice: attention/ and its tests).
 */
#ifndef KV_ATTN_KERNELS_HD_H
#define KV_ATTN_KERNELS_HD_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kv_attn_int.h"
#include "kv_convert_hd.h"
#include "kv_grid_hd.h"
#include "kv_layout_hd.h"

#define KV__ATTN_THREADS 256
#define KV__ATTN_MAX_GRID (1 << 20)
#define KV__DEC_WARPS 4
#define KV__SHARED_MAX (48 << 10)

/* ---- move (write and read) ----------------------------------------------------- */

struct kv__cside {
    char *base;
    int64_t layer, tok, head, dim; /* bytes */
    kv_dtype dt;
};

struct kv__cmove {
    struct kv_layout lo;
    char *cache;
    struct kv__cside t[2];
    int has[2];
    int raw[2]; /* K, V: no scales and the cache's dtype (moved as bytes) */
    uint32_t layer0, n_layers;
    int64_t n_items;
    int to_cache;
    int per_head;
    int64_t n_mul;
    /* device-index mode (kv_attn_write_cuda_dev): slot_map [n_items /
     * n_layers] read here, each checked against slot_limit = B x N; NULL:
     * the runs array of the host-index mode */
    const int64_t *slot_map;
    int64_t slot_limit;
    struct kv_attn_cuda_errors *err;
};

/* Record an invalid index in e (NULL: not recorded): count, and the first
 * (lowest array, then index) as first_key = ~(array << 56 | index), so that
 * 0 means none and atomicMax keeps the first. */
KV_HD void kv__dev_error(struct kv_attn_cuda_errors *e, int array, int64_t index)
{
    if (!e)
        return;
    const uint64_t key = ~(((uint64_t)array << 56) | (uint64_t)index);
#if defined(__CUDA_ARCH__)
    atomicAdd((unsigned long long *)&e->count, 1ull);
    atomicMax((unsigned long long *)&e->first_key, (unsigned long long)key);
#else
    __atomic_fetch_add(&e->count, 1, __ATOMIC_RELAXED);
    uint64_t cur = __atomic_load_n(&e->first_key, __ATOMIC_RELAXED);
    while (key > cur && !__atomic_compare_exchange_n(&e->first_key, &cur, key, false,
                                                     __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
#endif
}

/* After a launch (one thread, the same stream): the value at the first
 * index, when this launch changed the first (an earlier launch's first
 * keeps its value). slots: the launch's slot array. */
KV_HD void kv__dev_error_finish(struct kv_attn_cuda_errors *e, const int64_t *slots,
                                const int32_t *indptr, const int32_t *last_len,
                                const int32_t *indices, const struct kv_block_copy *pairs)
{
    if (!e || e->first_key == 0 || e->first_key == e->value_key)
        return;
    const uint64_t k = ~e->first_key;
    const int64_t index = (int64_t)(k & ((1ull << 56) - 1));
    const int array = (int)(k >> 56);
    if (array == KV_ATTN_DEV_SLOTS && slots)
        e->first_value = slots[index];
    else if (array == KV_ATTN_DEV_INDPTR && indptr)
        e->first_value = indptr[index];
    else if (array == KV_ATTN_DEV_LAST_LEN && last_len)
        e->first_value = last_len[index];
    else if (array == KV_ATTN_DEV_PAGES && indices)
        e->first_value = indices[index];
    else if (array == KV_ATTN_DEV_COPIES && pairs)
        e->first_value = (int64_t)(index % 2 ? pairs[index / 2].dst : pairs[index / 2].src);
    else
        return; /* not this launch's array: the value comes with a later launch */
    e->value_key = e->first_key;
}

/* Item item's run: runs[item / n_layers] (host indices), or one token at
 * slot_map[item / n_layers], false (skip) for -1 or an invalid slot
 * (recorded once, by thread 0 of the item of layer 0). */
KV_HD bool kv__move_run(const struct kv_grid_ctx *c, const struct kv__cmove *m,
                        const struct kv__attn_run *runs, int64_t item, struct kv__attn_run *r)
{
    const int64_t t = item / m->n_layers;
    if (!m->slot_map) {
        *r = runs[t];
        return true;
    }
    const int64_t s = m->slot_map[t];
    if (s == -1)
        return false;
    if (s < -1 || s >= m->slot_limit) {
        if (c->thread == 0 && item % m->n_layers == 0)
            kv__dev_error(m->err, KV_ATTN_DEV_SLOTS, t);
        return false;
    }
    r->token = t;
    r->slot = s;
    r->n = 1;
    return true;
}

/* The dtypes agree without scales: bytes in vectors of vbytes. */
KV_HD void kv__move_bytes_body(const struct kv_grid_ctx *c, const struct kv__cmove *m,
                               const struct kv__attn_run *runs, int vbytes)
{
    const int64_t H = m->lo.num_heads, row_vecs = m->lo.head_dim * m->lo.elem_bytes / vbytes;
    for (int64_t item = c->block; item < m->n_items; item += c->grid_dim) {
        struct kv__attn_run r;
        if (!kv__move_run(c, m, runs, item, &r))
            continue;
        const uint32_t lrel = (uint32_t)(item % m->n_layers);
        const int64_t total = r.n * H * row_vecs;
        for (int kv = 0; kv < 2; kv++) {
            if (!m->has[kv])
                continue;
            const struct kv__cside t = m->t[kv];
            char *c0 = m->cache + kv_layout_slot_offset_bytes(&m->lo, m->layer0 + lrel, kv, r.slot);
            char *t0 = t.base + (int64_t)lrel * t.layer + r.token * t.tok;
            /* the tensor's head dim is contiguous here unless V is one element */
            const int64_t tstep = t.dim == m->lo.elem_bytes ? (int64_t)vbytes : t.dim;
            for (int64_t i = c->thread; i < total; i += c->block_dim) {
                const int64_t row = i / row_vecs, vi = i - row * row_vecs;
                const int64_t tk = row / H, h = row - tk * H;
                char *cp = c0 + tk * m->lo.stride_token_bytes + h * m->lo.stride_head_bytes +
                           vi * (int64_t)vbytes;
                char *x = t0 + tk * t.tok + h * t.head + vi * tstep;
                if (m->to_cache)
                    kv_grid_move(c, cp, x, vbytes);
                else
                    kv_grid_move(c, x, cp, vbytes);
            }
        }
    }
}

/* Through f32: scale [2][n_mul] (NULL: 1), x / scale on the way in, x * scale out. */
KV_HD void kv__move_convert_body(const struct kv_grid_ctx *c, const struct kv__cmove *m,
                                 const struct kv__attn_run *runs, const float *scale)
{
    const int64_t H = m->lo.num_heads, D = m->lo.head_dim, es = m->lo.elem_bytes;
    for (int64_t item = c->block; item < m->n_items; item += c->grid_dim) {
        struct kv__attn_run r;
        if (!kv__move_run(c, m, runs, item, &r))
            continue;
        const uint32_t lrel = (uint32_t)(item % m->n_layers);
        const int64_t total = r.n * H * D;
        for (int kv = 0; kv < 2; kv++) {
            if (!m->has[kv])
                continue;
            const struct kv__cside t = m->t[kv];
            char *c0 = m->cache + kv_layout_slot_offset_bytes(&m->lo, m->layer0 + lrel, kv, r.slot);
            char *t0 = t.base + (int64_t)lrel * t.layer + r.token * t.tok;
            for (int64_t i = c->thread; i < total; i += c->block_dim) {
                const int64_t row = i / D, d = i - row * D;
                const int64_t tk = row / H, h = row - tk * H;
                const float f = scale ? scale[kv * m->n_mul + (m->per_head ? h : 0)] : 1.0f;
                char *cp =
                    c0 + tk * m->lo.stride_token_bytes + h * m->lo.stride_head_bytes + d * es;
                char *x = t0 + tk * t.tok + h * t.head + d * t.dim;
                if (m->raw[kv])
                    memcpy(m->to_cache ? cp : x, m->to_cache ? x : cp, (size_t)es);
                else if (m->to_cache)
                    kv_from_f32(m->lo.dtype, kv_apply_scale(kv_to_f32(t.dt, x), f, true), cp);
                else
                    kv_from_f32(t.dt, kv_apply_scale(kv_to_f32(m->lo.dtype, cp), f, false), x);
            }
        }
    }
}

/* ---- copy blocks ---------------------------------------------------------------- */

/* Item i of n_items: copy c = i / run_count, run r = i % run_count, from
 * base + offs[2c] + r * run_stride to base + offs[2c + 1] + r * run_stride. */
struct kv__ccopy {
    char *base;
    const int64_t *offs; /* [n][2]: src, dst */
    int64_t n_items, run_count, run_stride, run_bytes;
    /* device-index mode (kv_attn_copy_blocks_cuda_dev): pairs [n] read and
     * checked here (ids < n_blocks; offsets id x stride_block), offs unused */
    const struct kv_block_copy *pairs;
    int64_t n_blocks, stride_block;
    struct kv_attn_cuda_errors *err;
};

KV_HD void kv__copy_body(const struct kv_grid_ctx *c, const struct kv__ccopy *p, int vbytes)
{
    const int64_t vecs = p->run_bytes / vbytes;
    for (int64_t item = c->block; item < p->n_items; item += c->grid_dim) {
        const int64_t cp = item / p->run_count, r = item - cp * p->run_count;
        int64_t so, dof;
        if (p->pairs) {
            const struct kv_block_copy pr = p->pairs[cp];
            if ((int64_t)pr.src >= p->n_blocks || (int64_t)pr.dst >= p->n_blocks) {
                if (c->thread == 0 && r == 0)
                    kv__dev_error(p->err, KV_ATTN_DEV_COPIES,
                                  2 * cp + ((int64_t)pr.src >= p->n_blocks ? 0 : 1));
                continue;
            }
            so = (int64_t)pr.src * p->stride_block;
            dof = (int64_t)pr.dst * p->stride_block;
        } else {
            so = p->offs[2 * cp];
            dof = p->offs[2 * cp + 1];
        }
        const char *src = p->base + so + r * p->run_stride;
        char *dst = p->base + dof + r * p->run_stride;
        for (int64_t i = c->thread; i < vecs; i += c->block_dim)
            kv_grid_move(c, dst + i * vbytes, src + i * vbytes, vbytes);
    }
}

/* A copy of layers and planes, within one cache or between two (the same
 * block format): unit u moves rows of row_bytes from src + offs[2 u] to dst
 * + offs[2 u + 1], a whole storage block (rows 1) or, for one plane of a
 * packed K|V block, its N x H half rows (row r: token r / H, head r % H,
 * the same in-block offset on both sides). */
struct kv__ccopy_ex {
    char *dst;
    const char *src;
    const int64_t *offs; /* [units][2] */
    int64_t n_items, rows, H, tok, head, row_bytes;
};

KV_HD void kv__copy_ex_body(const struct kv_grid_ctx *c, const struct kv__ccopy_ex *p, int vbytes)
{
    const int64_t vecs = p->row_bytes / vbytes;
    for (int64_t item = c->block; item < p->n_items; item += c->grid_dim) {
        const int64_t u = item / p->rows, r = item - u * p->rows;
        const int64_t in = p->rows == 1 ? 0 : (r / p->H) * p->tok + (r % p->H) * p->head;
        const char *sp = p->src + p->offs[2 * u] + in;
        char *dp = p->dst + p->offs[2 * u + 1] + in;
        for (int64_t i = c->thread; i < vecs; i += c->block_dim)
            kv_grid_move(c, dp + i * vbytes, sp + i * vbytes, vbytes);
    }
}

/* ---- decode attention -------------------------------------------------------------- */

struct kv__cdec {
    struct kv_layout lo;
    const char *cache;
    uint32_t layer;
    struct kv__cside q, out;
    int64_t g, pt;
    float softmax_scale;
    const int32_t *page_ids;
    const int64_t *page_start, *seq_tokens;
    const float *scales; /* [2][n_mul]; NULL: 1 (the device-index mode) */
    int64_t n_mul;
    int warps;
    /* device-index mode (kv_attn_decode_cuda_dev): CSR arrays read and
     * checked here (d_indptr NULL: the host mode's page_ids/page_start/
     * seq_tokens); n_ids = B x r */
    const int32_t *d_indptr, *d_indices, *d_last;
    int64_t d_n_pages, n_ids;
    struct kv_attn_cuda_errors *err;
};

/* Sequence s's token count and pages; in the device mode a sequence with a
 * bad indptr or last_page_len has none (output 0), recorded once (head 0,
 * thread 0). */
KV_HD void kv__dec_seq(const struct kv_grid_ctx *c, const struct kv__cdec *p, int64_t s, int64_t h,
                       int64_t *n_tok, const int32_t **pages)
{
    if (!p->d_indptr) {
        *n_tok = p->seq_tokens[s];
        *pages = p->page_ids + p->page_start[s];
        return;
    }
    const int64_t a = p->d_indptr[s], b = p->d_indptr[s + 1], ll = p->d_last[s];
    const bool rec = h == 0 && c->thread == 0;
    *n_tok = 0;
    *pages = p->d_indices;
    if (a < 0 || a > p->d_n_pages) {
        if (rec)
            kv__dev_error(p->err, KV_ATTN_DEV_INDPTR, s);
        return;
    }
    if (b < a || b > p->d_n_pages) {
        if (rec)
            kv__dev_error(p->err, KV_ATTN_DEV_INDPTR, s + 1);
        return;
    }
    const int64_t np = b - a;
    if (np == 0 ? ll != 0 : (ll < 1 || ll > p->pt)) {
        if (rec)
            kv__dev_error(p->err, KV_ATTN_DEV_LAST_LEN, s);
        return;
    }
    *n_tok = np ? (np - 1) * p->pt + ll : 0;
    *pages = p->d_indices + a;
}

/* Shared memory: q [g][D], acc [warps][g][D], m then l [warps][2][g]
 * (floats). Synchronizes: launch with 32 * warps threads. */
KV_HD void kv__decode_body(const struct kv_grid_ctx *c, const struct kv__cdec *p)
{
    float *sh = (float *)c->shared;
    const int64_t H = p->lo.num_heads, D = p->lo.head_dim, g = p->g, es = p->lo.elem_bytes;
    const int64_t s = c->block / H, h = c->block - s * H;
    const int warp = (int)(c->thread / 32), lane = (int)(c->thread % 32);
    float *q = sh;                      /* [g][D] */
    float *acc = q + g * D;             /* [warps][g][D] */
    float *ml = acc + p->warps * g * D; /* [warps][2][g]: m then l */
    for (int64_t i = c->thread; i < g * D; i += c->block_dim) {
        const int64_t qi = i / D, d = i - qi * D;
        q[i] =
            kv_to_f32(p->q.dt, p->q.base + s * p->q.tok + (h * g + qi) * p->q.head + d * p->q.dim) *
            p->softmax_scale;
    }
    for (int64_t i = c->thread; i < p->warps * g * D; i += c->block_dim)
        acc[i] = 0.0f;
    for (int64_t i = c->thread; i < p->warps * g; i += c->block_dim) {
        const int64_t w = i / g, qi = i - w * g;
        ml[w * 2 * g + qi] = -INFINITY;
        ml[w * 2 * g + g + qi] = 0.0f;
    }
    kv_grid_sync(c);
    const float ks = p->scales ? p->scales[p->n_mul > 1 ? h : 0] : 1.0f,
                vs = p->scales ? p->scales[p->n_mul + (p->n_mul > 1 ? h : 0)] : 1.0f;
    int64_t n_tok;
    const int32_t *pages;
    kv__dec_seq(c, p, s, h, &n_tok, &pages);
    float *wacc = acc + warp * g * D, *wm = ml + warp * 2 * g, *wl = wm + g;
    for (int64_t t = warp; t < n_tok; t += p->warps) {
        const int32_t pid = pages[t / p->pt];
        if (p->d_indptr && (pid < 0 || pid >= p->n_ids)) {
            /* the whole warp skips (t and pid are the warp's): recorded
             * once, at the page's first token */
            if (h == 0 && lane == 0 && t % p->pt == 0)
                kv__dev_error(p->err, KV_ATTN_DEV_PAGES, (pages - p->d_indices) + t / p->pt);
            continue;
        }
        const int64_t slot = kv_attn_page_slot(pid, p->pt, t % p->pt);
        const char *kb = p->cache + kv_layout_slot_offset_bytes(&p->lo, p->layer, 0, slot) +
                         h * p->lo.stride_head_bytes;
        const char *vb = kb + p->lo.stride_kv_bytes;
        for (int64_t qi = 0; qi < g; qi++) {
            float part = 0.0f;
            for (int64_t d = lane; d < D; d += 32)
                part += q[qi * D + d] * kv_to_f32(p->lo.dtype, kb + d * es);
            const float sc = kv_grid_warp_sum(c, part) * ks;
            const float m0 = wm[qi], l0 = wl[qi];
            const float m1 = fmaxf(m0, sc);
            const float corr = m0 == -INFINITY ? 0.0f : kv_grid_expf(m0 - m1);
            const float w = kv_grid_expf(sc - m1);
            for (int64_t d = lane; d < D; d += 32)
                wacc[qi * D + d] =
                    wacc[qi * D + d] * corr + w * vs * kv_to_f32(p->lo.dtype, vb + d * es);
            kv_grid_syncwarp(c);
            if (lane == 0) {
                wm[qi] = m1;
                wl[qi] = l0 * corr + w;
            }
            kv_grid_syncwarp(c);
        }
    }
    kv_grid_sync(c);
    for (int64_t i = c->thread; i < g * D; i += c->block_dim) {
        const int64_t qi = i / D, d = i - qi * D;
        float M = -INFINITY;
        for (int w = 0; w < p->warps; w++)
            M = fmaxf(M, ml[w * 2 * g + qi]);
        float L = 0.0f, A = 0.0f;
        for (int w = 0; w < p->warps; w++) {
            const float mw = ml[w * 2 * g + qi];
            if (mw == -INFINITY)
                continue;
            const float f = kv_grid_expf(mw - M);
            L += ml[w * 2 * g + g + qi] * f;
            A += acc[(w * g + qi) * D + d] * f;
        }
        kv_from_f32(p->out.dt, L > 0.0f ? A / L : 0.0f,
                    p->out.base + s * p->out.tok + (h * g + qi) * p->out.head + d * p->out.dim);
    }
}

/* ---- MLA decode (kv_attn_decode_mla) ------------------------------------------------
 * One CUDA block per (sequence, group of hg query heads): a tile of tt
 * latent rows is converted to f32 (times the K scale) into shared memory
 * once, then serves every head of the group: the scores (all D dims, a warp
 * per (head, token) pair, lanes split D), the online softmax (a thread per
 * head), the values (the first dv dims; threads split heads x dims). */
struct kv__cmla {
    struct kv_layout lo;
    const char *cache;
    uint32_t layer;
    struct kv__cside q, out;
    int64_t hq, hg, tt, dv, pt;
    float softmax_scale, k_scale;
    const int32_t *page_ids;
    const int64_t *page_start, *seq_tokens;
};

/* Shared memory (floats): q [hg][D], kt [tt][D], acc [hg][dv], sc [hg][tt],
 * m, l, corr [hg]. Synchronizes. */
KV_HD void kv__decode_mla_body(const struct kv_grid_ctx *c, const struct kv__cmla *p)
{
    float *sh = (float *)c->shared;
    const int64_t D = p->lo.head_dim, dv = p->dv, hg = p->hg, tt = p->tt, es = p->lo.elem_bytes;
    const int64_t groups = (p->hq + hg - 1) / hg;
    const int64_t s = c->block / groups, h0 = (c->block - s * groups) * hg;
    const int64_t nh = p->hq - h0 < hg ? p->hq - h0 : hg;
    const int warps = (int)(c->block_dim / 32), warp = (int)(c->thread / 32),
              lane = (int)(c->thread % 32);
    float *q = sh, *kt = q + hg * D, *acc = kt + tt * D, *sc = acc + hg * dv;
    float *m = sc + hg * tt, *l = m + hg, *corr = l + hg;
    for (int64_t i = c->thread; i < nh * D; i += c->block_dim) {
        const int64_t hh = i / D, d = i - hh * D;
        q[i] = kv_to_f32(p->q.dt, p->q.base + s * p->q.tok + (h0 + hh) * p->q.head + d * p->q.dim) *
               p->softmax_scale;
    }
    for (int64_t i = c->thread; i < nh * dv; i += c->block_dim)
        acc[i] = 0.0f;
    if (c->thread < nh) {
        m[c->thread] = -INFINITY;
        l[c->thread] = 0.0f;
    }
    const int64_t n_tok = p->seq_tokens[s];
    const int32_t *pages = p->page_ids + p->page_start[s];
    for (int64_t t0 = 0; t0 < n_tok; t0 += tt) {
        const int64_t nt = n_tok - t0 < tt ? n_tok - t0 : tt;
        kv_grid_sync(c); /* the previous tile's values are done with kt and sc */
        for (int64_t i = c->thread; i < nt * D; i += c->block_dim) {
            const int64_t r = i / D, d = i - r * D, t = t0 + r;
            const int64_t slot = kv_attn_page_slot(pages[t / p->pt], p->pt, t % p->pt);
            const char *row = p->cache + kv_layout_slot_offset_bytes(&p->lo, p->layer, 0, slot);
            kt[i] = kv_to_f32(p->lo.dtype, row + d * es) * p->k_scale;
        }
        kv_grid_sync(c);
        for (int64_t pair = warp; pair < nh * nt; pair += warps) {
            const int64_t hh = pair / nt, r = pair - hh * nt;
            float part = 0.0f;
            for (int64_t d = lane; d < D; d += 32)
                part += q[hh * D + d] * kt[r * D + d];
            const float x = kv_grid_warp_sum(c, part);
            if (lane == 0)
                sc[hh * tt + r] = x;
        }
        kv_grid_sync(c);
        if (c->thread < nh) {
            const int64_t hh = c->thread;
            float mx = m[hh];
            for (int64_t r = 0; r < nt; r++)
                mx = fmaxf(mx, sc[hh * tt + r]);
            const float cr = m[hh] == -INFINITY ? 0.0f : kv_grid_expf(m[hh] - mx);
            float sum = 0.0f;
            for (int64_t r = 0; r < nt; r++) {
                const float w = kv_grid_expf(sc[hh * tt + r] - mx);
                sc[hh * tt + r] = w;
                sum += w;
            }
            l[hh] = l[hh] * cr + sum;
            m[hh] = mx;
            corr[hh] = cr;
        }
        kv_grid_sync(c);
        for (int64_t i = c->thread; i < nh * dv; i += c->block_dim) {
            const int64_t hh = i / dv, d = i - hh * dv;
            float a = acc[i] * corr[hh];
            for (int64_t r = 0; r < nt; r++)
                a += sc[hh * tt + r] * kt[r * D + d];
            acc[i] = a;
        }
    }
    kv_grid_sync(c);
    for (int64_t i = c->thread; i < nh * dv; i += c->block_dim) {
        const int64_t hh = i / dv, d = i - hh * dv;
        kv_from_f32(p->out.dt, l[hh] > 0.0f ? acc[i] / l[hh] : 0.0f,
                    p->out.base + s * p->out.tok + (h0 + hh) * p->out.head + d * p->out.dim);
    }
}

/* ---- launch parameters (host code, shared by the two launchers) ------------------- */

static inline int kv__attn_grid_of(int64_t items)
{
    return (int)(items < KV__ATTN_MAX_GRID ? (items > 0 ? items : 1) : KV__ATTN_MAX_GRID);
}

/* The move of job j; returns whether it moves bytes (kv__move_bytes_body)
 * rather than converting. */
static inline bool kv__cmove_build(const struct kv__attn_job *j, bool to_cache, struct kv__cmove *m)
{
    memset(m, 0, sizeof(*m));
    m->lo = j->cache.layout;
    m->cache = (char *)j->cache.base;
    m->layer0 = j->layer0;
    m->n_layers = j->n_layers;
    m->n_items = j->n_runs * (int64_t)j->n_layers;
    m->to_cache = to_cache;
    for (int kv = 0; kv < 2; kv++) {
        const struct kv__attn_tensor *t = kv ? &j->v : &j->k;
        m->has[kv] = kv ? j->has_v : j->has_k;
        m->t[kv].base = t->base;
        m->t[kv].layer = t->layer_stride;
        m->t[kv].tok = t->token_stride;
        m->t[kv].head = t->head_stride;
        m->t[kv].dim = t->dim_stride;
        m->t[kv].dt = t->dtype;
    }
    for (int kv = 0; kv < 2; kv++)
        m->raw[kv] = j->n_scales == 0 && m->t[kv].dt == m->lo.dtype;
    m->n_mul = j->n_scales > 1 ? j->n_scales : 1;
    m->per_head = j->n_scales > 1;
    return (!m->has[0] || m->raw[0]) && (!m->has[1] || m->raw[1]);
}

/* The move of a device-index write (kv_attn_write_cuda_dev): job j from
 * kv__attn_write_dev_check (no runs), one item per (token, layer) reading
 * slots [n_slots] (device memory) in the body. Returns what kv__cmove_build
 * returns. */
static inline bool kv__cmove_build_dev(const struct kv__attn_job *j, const int64_t *slots,
                                       int64_t n_slots, struct kv_attn_cuda_errors *err,
                                       struct kv__cmove *m)
{
    const bool bytes = kv__cmove_build(j, true, m);
    m->n_items = n_slots * (int64_t)j->n_layers;
    m->slot_map = slots;
    m->slot_limit = m->lo.num_blocks * m->lo.block_tokens;
    m->err = err;
    return bytes;
}

/* The scales of a converting move: scale [2][n_mul] (1 without). */
static inline void kv__cmove_scales(const struct kv__attn_job *j, const struct kv__cmove *m,
                                    float *scale)
{
    for (int64_t h = 0; h < m->n_mul; h++) {
        scale[h] = j->k_scale ? j->k_scale[h] : 1.0f;
        scale[m->n_mul + h] = j->v_scale ? j->v_scale[h] : 1.0f;
    }
}

/* The widest vector every address of a bytes move is aligned to. */
static inline int kv__cmove_width(const struct kv__cmove *m)
{
    const struct kv_layout *lo = &m->lo;
    uint64_t bits = (uint64_t)(lo->head_dim * lo->elem_bytes) | (uint64_t)(uintptr_t)m->cache |
                    (uint64_t)lo->stride_layer_bytes | (uint64_t)lo->stride_kv_bytes |
                    (uint64_t)lo->stride_block_bytes | (uint64_t)lo->stride_token_bytes |
                    (uint64_t)lo->stride_head_bytes;
    for (int kv = 0; kv < 2; kv++) {
        if (!m->has[kv])
            continue;
        const struct kv__cside *t = &m->t[kv];
        if (t->dim != lo->elem_bytes)
            return (int)lo->elem_bytes; /* strided head dim: element by element */
        bits |= (uint64_t)(uintptr_t)t->base | (uint64_t)t->layer | (uint64_t)t->tok |
                (uint64_t)t->head;
    }
    for (int w = 16; w > (int)lo->elem_bytes; w /= 2)
        if ((bits & (uint64_t)(w - 1)) == 0)
            return w;
    return (int)lo->elem_bytes;
}

/* Decode of job j: the parameters (index arrays and scales left NULL for
 * the launcher to point at its copies), the shared memory per block and
 * the block size; KV_ERR_UNSUPPORTED when even one warp's shared memory
 * exceeds KV__SHARED_MAX. */
static inline kv_status kv__cdec_build(const struct kv__attn_job *j, const char *fn,
                                       struct kv__cdec *p, size_t *shmem)
{
    memset(p, 0, sizeof(*p));
    p->lo = j->cache.layout;
    p->cache = (const char *)j->cache.base;
    p->layer = j->layer0;
    p->q.base = j->q.base;
    p->q.tok = j->q.token_stride;
    p->q.head = j->q.head_stride;
    p->q.dim = j->q.dim_stride;
    p->q.dt = j->q.dtype;
    p->out.base = j->out.base;
    p->out.tok = j->out.token_stride;
    p->out.head = j->out.head_stride;
    p->out.dim = j->out.dim_stride;
    p->out.dt = j->out.dtype;
    p->g = j->q_heads / p->lo.num_heads;
    p->pt = j->page_tokens;
    p->softmax_scale = j->softmax_scale;
    p->n_mul = j->n_scales > 1 ? j->n_scales : 1;
    /* shared memory: q [g][D] + acc [warps][g][D] + m, l [warps][g] */
    const int64_t gd = p->g * p->lo.head_dim;
    p->warps = KV__DEC_WARPS;
    while (p->warps > 1 && (gd + p->warps * (gd + 2 * p->g)) * 4 > KV__SHARED_MAX)
        p->warps--;
    *shmem = (size_t)(gd + p->warps * (gd + 2 * p->g)) * sizeof(float);
    if (*shmem > KV__SHARED_MAX)
        return kv__error(KV_ERR_UNSUPPORTED,
                         "%s: %lld query heads per KV head x D %lld need %zu bytes of shared "
                         "memory (at most %d)",
                         fn, (long long)p->g, (long long)p->lo.head_dim, *shmem, KV__SHARED_MAX);
    return KV_OK;
}

/* The MLA decode of job j (kv__attn_decode_mla_check): *p (the host page
 * arrays; a CUDA launcher replaces them with device copies), the group of
 * query heads and the tile of rows that fit in shared memory, *blocks and
 * *shmem of the launch (32 x KV__DEC_WARPS threads). */
static inline kv_status kv__cmla_build(const struct kv__attn_job *j, const char *fn,
                                       struct kv__cmla *p, int64_t *blocks, size_t *shmem)
{
    memset(p, 0, sizeof(*p));
    p->lo = j->cache.layout;
    p->cache = (const char *)j->cache.base;
    p->layer = j->layer0;
    p->q.base = j->q.base;
    p->q.tok = j->q.token_stride;
    p->q.head = j->q.head_stride;
    p->q.dim = j->q.dim_stride;
    p->q.dt = j->q.dtype;
    p->out.base = j->out.base;
    p->out.tok = j->out.token_stride;
    p->out.head = j->out.head_stride;
    p->out.dim = j->out.dim_stride;
    p->out.dt = j->out.dtype;
    p->hq = j->q_heads;
    p->dv = j->mla_dv;
    p->pt = j->page_tokens;
    p->softmax_scale = j->softmax_scale;
    p->k_scale = j->k_scale ? j->k_scale[0] : 1.0f;
    p->page_ids = j->page_ids;
    p->page_start = j->page_start;
    p->seq_tokens = j->seq_tokens;
    const int64_t D = p->lo.head_dim, dv = p->dv;
    /* floats: hg (D + dv + tt + 3) + tt D; up to 8 heads, tiles of 8 rows
     * (fewer where D is large) */
    p->tt = 8;
    p->hg = p->hq < 8 ? p->hq : 8;
    while ((p->hg * (D + dv + p->tt + 3) + p->tt * D) * 4 > KV__SHARED_MAX && p->hg > 1)
        p->hg--;
    while ((p->hg * (D + dv + p->tt + 3) + p->tt * D) * 4 > KV__SHARED_MAX && p->tt > 1)
        p->tt--;
    *shmem = (size_t)(p->hg * (D + dv + p->tt + 3) + p->tt * D) * sizeof(float);
    if (*shmem > KV__SHARED_MAX)
        return kv__error(KV_ERR_UNSUPPORTED,
                         "%s: D %lld and dv %lld need %zu bytes of shared memory (at most %d)", fn,
                         (long long)D, (long long)dv, *shmem, KV__SHARED_MAX);
    *blocks = (int64_t)j->n_seqs * ((p->hq + p->hg - 1) / p->hg);
    if (*blocks > INT32_MAX)
        return kv__error(KV_ERR_UNSUPPORTED, "%s: %lld (sequence, head group) blocks", fn,
                         (long long)*blocks);
    return KV_OK;
}

/* The device-index part of a decode (kv_attn_decode_cuda_dev) after
 * kv__cdec_build: the CSR arrays and the record; no scales (NULL: 1). */
static inline void kv__cdec_build_dev(const struct kv__attn_job *j,
                                      const struct kv_attn_dev_pages *pg,
                                      struct kv_attn_cuda_errors *err, struct kv__cdec *p)
{
    p->d_indptr = pg->indptr;
    p->d_indices = pg->indices;
    p->d_last = pg->last_page_len;
    p->d_n_pages = pg->n_pages;
    p->n_ids = p->lo.num_blocks * (int64_t)j->page_ratio;
    p->err = err;
}

/* The decode scales [2][n_mul] (1 without). */
static inline void kv__cdec_scales(const struct kv__attn_job *j, const struct kv__cdec *p,
                                   float *scales)
{
    for (int64_t h = 0; h < p->n_mul; h++) {
        scales[h] = j->k_scale ? j->k_scale[h] : 1.0f;
        scales[p->n_mul + h] = j->v_scale ? j->v_scale[h] : 1.0f;
    }
}

/* The copy of job j (kv_attn_copy_blocks: whole blocks of one cache):
 * offs [n_copies][2] (caller's, filled), *p, and the vector width (16, 8,
 * 4 or 1 bytes: what every offset, the run length and stride allow). */
static inline kv_status kv__ccopy_build(const struct kv__attn_job *j, int64_t *offs,
                                        struct kv__ccopy *p, int *vbytes)
{
    const struct kv_layout *lo = &j->cache.layout;
    struct kv_byte_runs rs = {0, 0, 0, 0}, rd;
    uint64_t bits = (uint64_t)(uintptr_t)j->cache.base;
    for (uint32_t i = 0; i < j->n_copies; i++) {
        /* ids were validated: block_runs cannot fail */
        if (kv_layout_block_runs(lo, j->copies[i].src, &rs) != KV_OK ||
            kv_layout_block_runs(lo, j->copies[i].dst, &rd) != KV_OK)
            return kv__error(KV_ERR_INTERNAL, "%s: block runs of copy %u", j->fn, i);
        offs[2 * i] = rs.first_offset_bytes;
        offs[2 * i + 1] = rd.first_offset_bytes;
        bits |= (uint64_t)rs.first_offset_bytes | (uint64_t)rd.first_offset_bytes;
    }
    bits |= (uint64_t)rs.run_bytes | (uint64_t)rs.run_stride_bytes;
    memset(p, 0, sizeof(*p)); /* host indices: no pairs, no record */
    p->base = (char *)j->cache.base;
    p->offs = offs;
    p->n_items = (int64_t)j->n_copies * rs.run_count;
    p->run_count = rs.run_count;
    p->run_stride = rs.run_stride_bytes;
    p->run_bytes = rs.run_bytes;
    *vbytes = (bits & 15) == 0 ? 16 : (bits & 7) == 0 ? 8 : (bits & 3) == 0 ? 4 : 1;
    return KV_OK;
}

/* The copy of a device-index copy_blocks (kv_attn_copy_blocks_cuda_dev):
 * job j from kv__attn_copy_check with no copies; the pairs [n] are read by
 * the body. Block b's runs start at b x stride_block_bytes
 * (kv_layout_block_runs), so the vector width follows from the layout. */
static inline kv_status kv__ccopy_build_dev(const struct kv__attn_job *j,
                                            const struct kv_block_copy *pairs, uint32_t n,
                                            struct kv_attn_cuda_errors *err, struct kv__ccopy *p,
                                            int *vbytes)
{
    const struct kv_layout *lo = &j->cache.layout;
    struct kv_byte_runs rs;
    if (kv_layout_block_runs(lo, 0, &rs) != KV_OK)
        return kv__error(KV_ERR_INTERNAL, "%s: block runs of block 0", j->fn);
    memset(p, 0, sizeof(*p));
    p->base = (char *)j->cache.base;
    p->n_items = (int64_t)n * rs.run_count;
    p->run_count = rs.run_count;
    p->run_stride = rs.run_stride_bytes;
    p->run_bytes = rs.run_bytes;
    p->pairs = pairs;
    p->n_blocks = lo->num_blocks;
    p->stride_block = lo->stride_block_bytes;
    p->err = err;
    const uint64_t bits = (uint64_t)(uintptr_t)j->cache.base | (uint64_t)lo->stride_block_bytes |
                          (uint64_t)rs.run_bytes | (uint64_t)rs.run_stride_bytes;
    *vbytes = (bits & 15) == 0 ? 16 : (bits & 7) == 0 ? 8 : (bits & 3) == 0 ? 4 : 1;
    return KV_OK;
}

/* Units of a copy_ex job: n_copies x n_layers x (2 planes, or 1). */
static inline int64_t kv__ccopy_ex_units(const struct kv__attn_job *j)
{
    const struct kv_layout *dl = &j->cache.layout;
    const int64_t units = dl->kv_packed ? 1 : (j->planes == KV_ATTN_PLANES_KV ? 2 : 1);
    return (int64_t)j->n_copies * j->n_layers * units;
}

/* The copy_ex of job j: offs [kv__ccopy_ex_units][2] (caller's, filled), *p
 * and the vector width (16, 8, 4, 2 or 1 bytes). */
static inline void kv__ccopy_ex_build(const struct kv__attn_job *j, int64_t *offs,
                                      struct kv__ccopy_ex *p, int *vbytes)
{
    const struct kv_layout *dl = &j->cache.layout, *sl = &j->src.layout;
    const bool halves = dl->kv_packed && j->planes != KV_ATTN_PLANES_KV;
    const int64_t units = dl->kv_packed ? 1 : (j->planes == KV_ATTN_PLANES_KV ? 2 : 1);
    const int kv0 = j->planes == KV_ATTN_PLANE_V ? 1 : 0;
    const int64_t per_copy = (int64_t)j->n_layers * units, n_units = kv__ccopy_ex_units(j);
    uint64_t bits = (uint64_t)(uintptr_t)j->cache.base | (uint64_t)(uintptr_t)j->src.base;
    for (int64_t u = 0; u < n_units; u++) {
        const struct kv_block_copy *cp = &j->copies[u / per_copy];
        const int64_t r = u % per_copy;
        const uint32_t l = j->layer0 + (uint32_t)(r / units);
        const int kv = halves ? kv0 : (dl->kv_packed ? 0 : kv0 + (int)(r % units));
        offs[2 * u] = kv_layout_slot_offset_bytes(sl, l, kv, (int64_t)cp->src * sl->block_tokens);
        offs[2 * u + 1] =
            kv_layout_slot_offset_bytes(dl, l, kv, (int64_t)cp->dst * dl->block_tokens);
        bits |= (uint64_t)offs[2 * u] | (uint64_t)offs[2 * u + 1];
    }
    p->rows = halves ? dl->block_tokens * dl->num_heads : 1;
    p->row_bytes = halves ? dl->head_dim * dl->elem_bytes : dl->block_bytes;
    p->H = dl->num_heads;
    p->tok = dl->stride_token_bytes;
    p->head = dl->stride_head_bytes;
    p->dst = (char *)j->cache.base;
    p->src = (const char *)j->src.base;
    p->offs = offs;
    p->n_items = n_units * p->rows;
    bits |= (uint64_t)p->row_bytes;
    if (halves)
        bits |= (uint64_t)p->tok | (uint64_t)p->head;
    *vbytes = (bits & 15) == 0  ? 16
              : (bits & 7) == 0 ? 8
              : (bits & 3) == 0 ? 4
              : (bits & 1) == 0 ? 2
                                : 1;
}

#endif /* KV_ATTN_KERNELS_HD_H */
