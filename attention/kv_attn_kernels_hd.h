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
 *   decode  the vector body (kv__decode_vec_body, rows of at most 32
 *           aligned vectors): one block per (sequence, KV head, group of
 *           up to 4 query heads), lane groups of one row each, online
 *           softmax in registers, shuffles; its software-pipelined form
 *           (kv__decode_pipe_body); split-KV (kv__decode_split_body: the
 *           vector body over chunks of a sequence into a workspace, then
 *           kv__decode_merge_body); otherwise the general body
 *           (kv__decode_body): one block per (sequence, KV head), each
 *           warp takes every warps-th token, lanes split the head dim, an
 *           online softmax per warp and query head in shared memory.
 *           kv__cdec_build picks (auto: vector or general); the test hook
 *           kv__cdec_body forces one
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
    /* device-index mode scales (kv__cmove_scales_dev): plane kv's scale of
     * layer layer0 + lrel, head (or 0) i, at [kv][lrel * sc_lstride + i] of
     * sv (sv_on: by value, copied at the call) or of sc[kv] (device memory);
     * neither: the scale argument of the host-index mode */
    const float *sc[2];
    int64_t sc_lstride;
    int sv_on;
    float sv[2][KV_ATTN_DEV_SCALES_MAX];
    /* device-index read (kv_attn_read_cuda_dev; rd_on): CSR (rd_indptr,
     * rd_last, rd_n_pages) or block-table (rd_lens, rd_cols) pages with
     * their entries in rd_indices, sequence s's tokens to rows rd_out[s] ..
     * rd_out[s + 1] - 1 of T = rd_T; item e x n_layers + lrel: page entry e
     * (e < rd_entries), else the check of sequence e - rd_entries */
    const int32_t *rd_indptr, *rd_indices, *rd_last, *rd_lens, *rd_out;
    int64_t rd_n_pages, rd_cols, rd_entries, rd_T, rd_pt, rd_ids;
    int64_t rd_seqs;
    int rd_on;
};

/* Plane kv's scale for head (or 0) i of layer layer0 + lrel: see sc, sv. */
KV_HD float kv__move_scale(const struct kv__cmove *m, const float *scale, int kv, int64_t i,
                           uint32_t lrel)
{
    const int64_t at = (int64_t)lrel * m->sc_lstride + i;
    if (m->sv_on)
        return m->sv[kv][at];
    if (m->sc[kv])
        return m->sc[kv][at];
    return scale ? scale[kv * m->n_mul + i] : 1.0f;
}

/* Record an invalid index in e (NULL: not recorded): kv_grid_error_record. */
KV_HD void kv__dev_error(struct kv_attn_cuda_errors *e, int array, int64_t index)
{
    if (e)
        kv_grid_error_record(&e->count, &e->first_key, array, index);
}

/* Whether copy pair pr (pair cp) has src < s_blocks and dst < d_blocks;
 * if not, with rec, record the first id out of range (KV_ATTN_DEV_COPIES,
 * index 2 cp + 0 for src, 1 for dst). */
KV_HD bool kv__dev_pair_ok(struct kv_attn_cuda_errors *e, bool rec, struct kv_block_copy pr,
                           int64_t cp, int64_t s_blocks, int64_t d_blocks)
{
    const bool bad_src = (int64_t)pr.src >= s_blocks;
    if (!bad_src && (int64_t)pr.dst < d_blocks)
        return true;
    if (rec)
        kv__dev_error(e, KV_ATTN_DEV_COPIES, 2 * cp + (bad_src ? 0 : 1));
    return false;
}

/* A device-index launch's index arrays with their lengths (NULL: not
 * this launch's), what its record's finish may read. */
struct kv__dev_arrays {
    const int64_t *slots;              /* [n_slots] */
    const int32_t *indptr;             /* [n_seqs + 1] */
    const int32_t *last_len;           /* [n_seqs] */
    const int32_t *indices;            /* [n_indices]: CSR indices or the block table */
    const struct kv_block_copy *pairs; /* [n_pairs] */
    const int32_t *seq_lens;           /* [n_seqs] */
    const int32_t *out_indptr;         /* [n_seqs + 1] */
    int64_t n_slots, n_seqs, n_indices, n_pairs;
};

/* After a launch (one thread, the same stream): the value at the first
 * index, when this launch changed the first (an earlier launch's first
 * keeps its value). A first this launch's arrays do not hold (another
 * array, or an index past this launch's length: a launch whose own finish
 * has not run, on another stream sharing the record) is left without a
 * value, never read out of bounds. */
KV_HD void kv__dev_error_finish_in(struct kv_attn_cuda_errors *e, const struct kv__dev_arrays *a)
{
    if (!e || e->first_key == 0 || e->first_key == e->value_key)
        return;
    int array;
    const int64_t index = kv_grid_error_first(e->first_key, &array);
    if (array == KV_ATTN_DEV_SLOTS && a->slots && index < a->n_slots)
        e->first_value = a->slots[index];
    else if (array == KV_ATTN_DEV_INDPTR && a->indptr && index <= a->n_seqs)
        e->first_value = a->indptr[index];
    else if (array == KV_ATTN_DEV_LAST_LEN && a->last_len && index < a->n_seqs)
        e->first_value = a->last_len[index];
    else if (array == KV_ATTN_DEV_PAGES && a->indices && index < a->n_indices)
        e->first_value = a->indices[index];
    else if (array == KV_ATTN_DEV_COPIES && a->pairs && index / 2 < a->n_pairs)
        e->first_value = (int64_t)(index % 2 ? a->pairs[index / 2].dst : a->pairs[index / 2].src);
    else if (array == KV_ATTN_DEV_SEQ_LENS && a->seq_lens && index < a->n_seqs)
        e->first_value = a->seq_lens[index];
    else if (array == KV_ATTN_DEV_OUT_INDPTR && a->out_indptr && index <= a->n_seqs)
        e->first_value = a->out_indptr[index];
    else
        return; /* not this launch's: the value comes with a later launch, or never */
    e->value_key = e->first_key;
}

/* The arrays of device pages pg of a launch over n_seqs sequences (the
 * form's: CSR or block table; n_seqs x block_table_cols table entries) and
 * out_indptr (a read's; NULL otherwise), for kv__dev_error_finish_in. */
static inline struct kv__dev_arrays kv__dev_pages_arrays(const struct kv_attn_dev_pages *pg,
                                                         int64_t n_seqs, const int32_t *out_indptr)
{
    struct kv__dev_arrays a;
    memset(&a, 0, sizeof(a));
    a.n_seqs = n_seqs;
    a.out_indptr = out_indptr;
    if (pg->format == KV_PAGES_BLOCK_TABLE) {
        a.indices = pg->block_table;
        a.n_indices = n_seqs * (int64_t)pg->block_table_cols;
        a.seq_lens = pg->seq_lens;
    } else {
        a.indptr = pg->indptr;
        a.last_len = pg->last_page_len;
        a.indices = pg->indices;
        a.n_indices = pg->n_pages;
    }
    return a;
}

/* Sequence s of device-resident pages (CSR: indptr, last, n_pages; block
 * table: lens non-NULL, cols), pt tokens a page: true with its tokens and
 * the position of its first page entry (in the CSR indices or the table),
 * or false with the array and index to record (the sequence is skipped). */
KV_HD bool kv__dev_seq(const int32_t *indptr, const int32_t *last, int64_t n_pages,
                       const int32_t *lens, int64_t cols, int64_t pt, int64_t s, int64_t *n_tok,
                       int64_t *first, int *arr, int64_t *idx)
{
    *n_tok = 0;
    *first = 0;
    if (lens) {
        const int64_t len = lens[s];
        if (len < 0 || len > cols * pt) {
            *arr = KV_ATTN_DEV_SEQ_LENS, *idx = s;
            return false;
        }
        *n_tok = len;
        *first = s * cols;
        return true;
    }
    const int64_t a = indptr[s], b = indptr[s + 1], ll = last[s];
    if (a < 0 || a > n_pages) {
        *arr = KV_ATTN_DEV_INDPTR, *idx = s;
        return false;
    }
    if (b < a || b > n_pages) {
        *arr = KV_ATTN_DEV_INDPTR, *idx = s + 1;
        return false;
    }
    const int64_t np = b - a;
    if (np == 0 ? ll != 0 : (ll < 1 || ll > pt)) {
        *arr = KV_ATTN_DEV_LAST_LEN, *idx = s;
        return false;
    }
    *n_tok = np ? (np - 1) * pt + ll : 0;
    *first = a;
    return true;
}

/* Sequence s of a device-index read: kv__dev_seq, then its output rows
 * rd_out[s] .. rd_out[s + 1] - 1, inside [0, T) and as many as its tokens. */
KV_HD bool kv__rd_seq(const struct kv__cmove *m, int64_t s, int64_t *n_tok, int64_t *first,
                      int64_t *row0, int *arr, int64_t *idx)
{
    if (!kv__dev_seq(m->rd_indptr, m->rd_last, m->rd_n_pages, m->rd_lens, m->rd_cols, m->rd_pt, s,
                     n_tok, first, arr, idx))
        return false;
    const int64_t o0 = m->rd_out[s], o1 = m->rd_out[s + 1];
    *arr = KV_ATTN_DEV_OUT_INDPTR;
    if (o0 < 0 || o0 > m->rd_T) {
        *idx = s;
        return false;
    }
    if (o1 < o0 || o1 > m->rd_T || o1 - o0 != *n_tok) {
        *idx = s + 1;
        return false;
    }
    *row0 = o0;
    return true;
}

/* The run of a device-index read's item: page entry e's tokens (one page:
 * consecutive slots of one block) to their output rows; false for a check
 * item (which records its sequence's error, thread 0 of layer 0), an entry
 * of a skipped sequence, padding past a sequence's length, or an invalid
 * page id (recorded once). CSR entry e belongs to the last sequence whose
 * indptr is <= e (a binary search: with a decreasing indptr, recorded as
 * an error, entries near the decrease may be left unread). */
KV_HD bool kv__move_run_read(const struct kv_grid_ctx *c, const struct kv__cmove *m, int64_t item,
                             struct kv__attn_run *r)
{
    const int64_t e = item / m->n_layers;
    const bool rec = c->thread == 0 && item % m->n_layers == 0;
    int64_t n_tok, first, row0 = 0, idx;
    int arr;
    if (e >= m->rd_entries) {
        if (rec && !kv__rd_seq(m, e - m->rd_entries, &n_tok, &first, &row0, &arr, &idx))
            kv__dev_error(m->err, arr, idx);
        return false;
    }
    int64_t s;
    if (m->rd_lens) {
        s = e / m->rd_cols;
    } else {
        if (m->rd_seqs == 0 || m->rd_indptr[0] > e)
            return false;
        int64_t lo = 0, hi = m->rd_seqs;
        while (hi - lo > 1) {
            const int64_t mid = lo + (hi - lo) / 2;
            if (m->rd_indptr[mid] <= e)
                lo = mid;
            else
                hi = mid;
        }
        s = lo;
    }
    if (!kv__rd_seq(m, s, &n_tok, &first, &row0, &arr, &idx))
        return false; /* recorded by the sequence's check item */
    const int64_t i = e - first;
    if (i < 0 || i * m->rd_pt >= n_tok)
        return false; /* not one of the sequence's pages */
    const int64_t pid = m->rd_indices[e];
    if (pid < 0 || pid >= m->rd_ids) {
        if (rec)
            kv__dev_error(m->err, KV_ATTN_DEV_PAGES, e);
        return false;
    }
    const int64_t left = n_tok - i * m->rd_pt;
    r->token = row0 + i * m->rd_pt;
    r->slot = pid * m->rd_pt;
    r->n = left < m->rd_pt ? left : m->rd_pt;
    return true;
}

/* Item item's run: runs[item / n_layers] (host indices), or one token at
 * slot_map[item / n_layers], false (skip) for -1 or an invalid slot
 * (recorded once, by thread 0 of the item of layer 0). */
KV_HD bool kv__move_run(const struct kv_grid_ctx *c, const struct kv__cmove *m,
                        const struct kv__attn_run *runs, int64_t item, struct kv__attn_run *r)
{
    if (m->rd_on)
        return kv__move_run_read(c, m, item, r);
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

/* a / b for a >= 0, b > 0: in 32 bits where both fit (a 64-bit division
 * is a long instruction sequence on the GPU; these run per vector moved). */
KV_HD int64_t kv__div(int64_t a, int64_t b)
{
    if (((uint64_t)a | (uint64_t)b) <= UINT32_MAX)
        return (int64_t)((uint32_t)a / (uint32_t)b);
    return a / b;
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
                const int64_t row = kv__div(i, row_vecs), vi = i - row * row_vecs;
                const int64_t tk = kv__div(row, H), h = row - tk * H;
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
                const int64_t row = kv__div(i, D), d = i - row * D;
                const int64_t tk = kv__div(row, H), h = row - tk * H;
                const float f = kv__move_scale(m, scale, kv, m->per_head ? h : 0, lrel);
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
            if (!kv__dev_pair_ok(p->err, c->thread == 0 && r == 0, pr, cp, p->n_blocks,
                                 p->n_blocks))
                continue;
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
    /* device-index mode (kv_attn_copy_blocks_ex_cuda_dev): pairs [n] read
     * and checked here (src id < slo's B, dst id < dlo's B), unit u's
     * offsets computed as kv__ccopy_ex_build computes them; offs unused */
    const struct kv_block_copy *pairs;
    struct kv_layout dlo, slo;
    int64_t per_copy, units; /* units per copy: n_layers x units */
    uint32_t layer0;
    int kv0, halves;
    struct kv_attn_cuda_errors *err;
};

/* Unit u's source and destination offsets; false (skip) for a pair with an
 * id past its cache, recorded once (thread 0 of the pair's first item). */
KV_HD bool kv__copy_ex_unit(const struct kv_grid_ctx *c, const struct kv__ccopy_ex *p, int64_t u,
                            int64_t row, int64_t *so, int64_t *dof)
{
    if (!p->pairs) {
        *so = p->offs[2 * u];
        *dof = p->offs[2 * u + 1];
        return true;
    }
    const int64_t cp = u / p->per_copy, r = u - cp * p->per_copy;
    const struct kv_block_copy pr = p->pairs[cp];
    if (!kv__dev_pair_ok(p->err, c->thread == 0 && r == 0 && row == 0, pr, cp, p->slo.num_blocks,
                         p->dlo.num_blocks))
        return false;
    const uint32_t l = p->layer0 + (uint32_t)(r / p->units);
    const int kv = p->halves ? p->kv0 : (p->dlo.kv_packed ? 0 : p->kv0 + (int)(r % p->units));
    *so = kv_layout_slot_offset_bytes(&p->slo, l, kv, (int64_t)pr.src * p->slo.block_tokens);
    *dof = kv_layout_slot_offset_bytes(&p->dlo, l, kv, (int64_t)pr.dst * p->dlo.block_tokens);
    return true;
}

KV_HD void kv__copy_ex_body(const struct kv_grid_ctx *c, const struct kv__ccopy_ex *p, int vbytes)
{
    const int64_t vecs = p->row_bytes / vbytes;
    for (int64_t item = c->block; item < p->n_items; item += c->grid_dim) {
        const int64_t u = item / p->rows, r = item - u * p->rows;
        int64_t so, dof;
        if (!kv__copy_ex_unit(c, p, u, r, &so, &dof))
            continue;
        const int64_t in = p->rows == 1 ? 0 : (r / p->H) * p->tok + (r % p->H) * p->head;
        const char *sp = p->src + so + in;
        char *dp = p->dst + dof + in;
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
    /* device-index block table (d_lens non-NULL): sequence s's pages at
     * d_indices + s x d_cols (d_indices is the table), seq_lens d_lens */
    const int32_t *d_lens;
    int64_t d_cols;
    int dev; /* the device-index mode (either form) */
    /* device-index scales of the layer, head (or 0) i: sv[kv][i] (sv_on,
     * by value) or sc[kv][i] (device memory); neither: scales above */
    const float *sc[2];
    int sv_on;
    float sv[2][KV_ATTN_DEV_SCALES_MAX];
    /* options (kv_attn_decode_ex_cuda): window_left -1 = off, cap 0 = off,
     * lse NULL = none ([S][lse_stride], query heads at stride 1) */
    int32_t window_left;
    float cap;
    float *lse;
    int64_t lse_stride;
    /* the body (KV__CDEC_GENERAL, _VEC, _PIPE or _SPLIT; kv__cdec_build).
     * The vector bodies: a row of D elements in nv vectors of vb bytes (ne
     * elements), one per lane of a group of lpr lanes (the power of two >=
     * nv); hg query heads per block, n_hg blocks per (sequence, KV head) */
    int body, lpr, nv, vb, ne, hg;
    int64_t n_hg;
    /* split-KV (body KV__CDEC_SPLIT): n_split chunks per (sequence, KV
     * head, head group) of at least split_min tokens (kv__dec_chunk); ws
     * the workspace [n_seqs][Hq][n_split][D + 2] floats (kv__cdec_ws_bytes),
     * n_seqs for the merge */
    int64_t n_split, split_min, n_seqs;
    float *ws;
};

KV_HD float kv__dec_scale(const struct kv__cdec *p, int kv, int64_t i)
{
    if (p->sv_on)
        return p->sv[kv][i];
    if (p->sc[kv])
        return p->sc[kv][i];
    return p->scales ? p->scales[kv * p->n_mul + i] : 1.0f;
}

/* Sequence s's token count and pages; in the device mode a sequence with a
 * bad indptr or last_page_len has none (output 0), recorded once (head 0,
 * thread 0). */
KV_HD void kv__dec_seq(const struct kv_grid_ctx *c, const struct kv__cdec *p, int64_t s, bool rec,
                       int64_t *n_tok, const int32_t **pages)
{
    if (!p->dev) {
        *n_tok = p->seq_tokens[s];
        *pages = p->page_ids + p->page_start[s];
        return;
    }
    int64_t first, idx;
    int arr;
    if (!kv__dev_seq(p->d_indptr, p->d_last, p->d_n_pages, p->d_lens, p->d_cols, p->pt, s, n_tok,
                     &first, &arr, &idx)) {
        if (rec && c->thread == 0)
            kv__dev_error(p->err, arr, idx);
        *n_tok = 0;
        *pages = p->d_indices;
        return;
    }
    *pages = p->d_indices + first;
}

/* The first token a decode query sees (its position is n_tok - 1): 0, or
 * the window's start. */
KV_HD int64_t kv__dec_first(const struct kv__cdec *p, int64_t n_tok)
{
    if (p->window_left < 0 || n_tok - 1 - p->window_left <= 0)
        return 0;
    return n_tok - 1 - p->window_left;
}

/* Whether token t (ti its place in its page) is the first token of its page
 * a decode visits: the page's first, or the first visible token `first`
 * (the window's start, mid-page). A bad page is recorded there, once per
 * (sequence, page). */
KV_HD bool kv__dec_page_first(int64_t first, int64_t t, int64_t ti)
{
    return ti == 0 || t == first;
}

/* A logit after the soft cap (the CPU kernel's formula: c * tanh(x / c)
 * as c * tanhf(x * (1 / c))). */
KV_HD float kv__dec_logit(const struct kv__cdec *p, float x)
{
    if (p->cap > 0.0f)
        return p->cap * tanhf(x * (1.0f / p->cap));
    return x;
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
    const float ks = kv__dec_scale(p, 0, p->n_mul > 1 ? h : 0),
                vs = kv__dec_scale(p, 1, p->n_mul > 1 ? h : 0);
    int64_t n_tok;
    const int32_t *pages;
    kv__dec_seq(c, p, s, h == 0, &n_tok, &pages);
    float *wacc = acc + warp * g * D, *wm = ml + warp * 2 * g, *wl = wm + g;
    const int64_t first = kv__dec_first(p, n_tok);
    for (int64_t t = first + warp; t < n_tok; t += p->warps) {
        const int32_t pid = pages[t / p->pt];
        if (p->dev && (pid < 0 || pid >= p->n_ids)) {
            /* the whole warp skips (t and pid are the warp's): recorded
             * once, at the first token of the page visited */
            if (h == 0 && lane == 0 && kv__dec_page_first(first, t, t % p->pt))
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
            const float sc = kv__dec_logit(p, kv_grid_warp_sum(c, part) * ks);
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
        kv_from_f32(p->out.dt, L != 0.0f ? A / L : 0.0f,
                    p->out.base + s * p->out.tok + (h * g + qi) * p->out.head + d * p->out.dim);
        if (p->lse && d == 0)
            p->lse[s * p->lse_stride + h * g + qi] = L != 0.0f ? M + logf(L) : -INFINITY;
    }
}

/* ---- decode attention, the vector body ---------------------------------------------
 * The decode where a head row is 16 (or 8, 4, 2) byte aligned vectors that
 * fit one warp (kv__cdec_vec decides): one CUDA block of warps warps per
 * (sequence, KV head, group of up to KV__DECV_G query heads). A row's nv
 * vectors go to the first nv lanes of a group of lpr lanes, one vector
 * each (ne elements, at most KV__DECV_E); a warp thus holds 32 / lpr rows
 * at once, each group KV__DECV_U consecutive tokens per step, K and V of
 * all of them loaded before any arithmetic. Each lane group keeps its own
 * online softmax (m, l and its slice of acc per query head) in registers:
 * no barrier in the token loop. The groups merge at the end: in the warp
 * by shuffles, across warps in shared memory ([warps][KV__DECV_G][D] acc,
 * then [warps][KV__DECV_G][2] m, l). Launch with 32 * warps threads. */
#define KV__DECV_G 4
#define KV__DECV_E 8
#define KV__DECV_U 2
#define KV__DECP_U 4 /* the pipelined body's tokens a lane group a step */

#define KV__ALIGN16 __attribute__((aligned(16)))
struct KV__ALIGN16 kv__vec16 {
    uint32_t w[4];
};

/* Full unrolling of the vector body's fixed-size loops on the GPU, so its
 * small arrays live in registers (indices known at compile time), not in
 * local memory. */
#if defined(__CUDA_ARCH__)
#define KV__UNROLL _Pragma("unroll")
#else
#define KV__UNROLL
#endif

/* The ne elements of vector v (dtype dt) as f32, in f[0 .. ne). */
KV_HD void kv__vec_f32(kv_dtype dt, const struct kv__vec16 *v, int ne, float *f)
{
    switch (dt) {
    case KV_F32:
        KV__UNROLL for (int e = 0; e < KV__DECV_E; e++) if (e < ne) f[e] =
            kv__f32_from_bits(v->w[e & 3]);
        break;
    case KV_BF16:
        KV__UNROLL for (int e = 0; e < KV__DECV_E; e++) if (e < ne) f[e] =
            kv_bf16_to_f32((uint16_t)(v->w[e >> 1] >> ((e & 1) * 16)));
        break;
    case KV_F16:
        KV__UNROLL for (int e = 0; e < KV__DECV_E; e++) if (e < ne) f[e] =
            kv_f16_to_f32((uint16_t)(v->w[e >> 1] >> ((e & 1) * 16)));
        break;
    case KV_FP8_E4M3:
        KV__UNROLL for (int e = 0; e < KV__DECV_E; e++) if (e < ne) f[e] =
            kv_e4m3_to_f32((uint8_t)(v->w[(e >> 2) & 3] >> ((e & 3) * 8)));
        break;
    default:
        KV__UNROLL for (int e = 0; e < KV__DECV_E; e++) if (e < ne) f[e] =
            kv_e5m2_to_f32((uint8_t)(v->w[(e >> 2) & 3] >> ((e & 3) * 8)));
        break;
    }
}

/* Merge (mo, lo) into (m, l), the online softmax of both: the factors of
 * the old (fa) and the other (fb) accumulators in *fa, *fb. */
KV_HD void kv__dec_merge(float *m, float *l, float mo, float lo, float *fa, float *fb)
{
    const float M = *m > mo ? *m : mo;
    *fa = *m == -INFINITY ? 0.0f : kv_grid_expf(*m - M);
    *fb = mo == -INFINITY ? 0.0f : kv_grid_expf(mo - M);
    *l = *l * *fa + lo * *fb;
    *m = M;
}

/* One block's state in the vector bodies: its sequence s, KV head h and
 * query heads q0 .. q0 + hg - 1, the lane's place in its group (a row's
 * vector sub of a group of lpr lanes; grp of gpw groups a warp), the
 * sequence's tokens and visible start, and in registers the query slice
 * and the online softmax of each query head (m, l and the lane's acc). */
struct kv__decv {
    int64_t s, h, q0, d0, head_off, n_tok, first;
    const int32_t *pages;
    int hg, warp, lpr, sub, grp, gpw, ne;
    bool act; /* the lane holds a vector of each row */
    float ks, vs;
    float q[KV__DECV_G][KV__DECV_E], acc[KV__DECV_G][KV__DECV_E], m[KV__DECV_G], l[KV__DECV_G];
};

/* Block blk's state (blk over (sequence, KV head, head group)); rec: this
 * block may record its sequence's device-mode error (once per sequence:
 * head 0, head group 0, and for split-KV chunk 0). */
KV_HD void kv__decv_begin(const struct kv_grid_ctx *c, const struct kv__cdec *p, int64_t blk,
                          bool rec, struct kv__decv *b)
{
    const int64_t H = p->lo.num_heads, g = p->g;
    const int64_t per_s = H * p->n_hg;
    b->s = blk / per_s;
    const int64_t r = blk - b->s * per_s;
    b->h = r / p->n_hg;
    b->q0 = (r - b->h * p->n_hg) * p->hg;
    b->hg = (int)(g - b->q0 < p->hg ? g - b->q0 : p->hg);
    const int lane = (int)(c->thread % 32);
    b->warp = (int)(c->thread / 32);
    b->lpr = p->lpr;
    b->sub = lane % b->lpr;
    b->grp = lane / b->lpr;
    b->gpw = 32 / b->lpr;
    b->ne = p->ne;
    b->act = b->sub < p->nv;
    b->d0 = (int64_t)b->sub * b->ne;
    const int64_t s = b->s, h = b->h, q0 = b->q0;
    KV__UNROLL for (int qi = 0; qi < KV__DECV_G; qi++)
    {
        b->m[qi] = -INFINITY;
        b->l[qi] = 0.0f;
        KV__UNROLL for (int e = 0; e < KV__DECV_E; e++)
        {
            b->acc[qi][e] = 0.0f;
            b->q[qi][e] = 0.0f;
            if (qi < b->hg && b->act && e < b->ne)
                b->q[qi][e] =
                    kv_to_f32(p->q.dt, p->q.base + s * p->q.tok + (h * g + q0 + qi) * p->q.head +
                                           (b->d0 + e) * p->q.dim) *
                    p->softmax_scale;
        }
    }
    b->ks = kv__dec_scale(p, 0, p->n_mul > 1 ? h : 0);
    b->vs = kv__dec_scale(p, 1, p->n_mul > 1 ? h : 0);
    kv__dec_seq(c, p, s, rec && h == 0 && q0 == 0, &b->n_tok, &b->pages);
    b->first = kv__dec_first(p, b->n_tok);
    b->head_off = b->h * p->lo.stride_head_bytes + b->d0 * p->lo.elem_bytes;
}

/* One step of a lane group: nu (KV__DECV_U or KV__DECP_U, a constant where
 * inlined) tokens whose K and V vectors are kb[u], vb[u] (ok[u]: the token
 * is in range and its page valid) into the online softmax. Every lane of
 * the warp calls it (the shuffles). */
KV_HD void kv__decv_step(const struct kv_grid_ctx *c, const struct kv__cdec *p, struct kv__decv *b,
                         const struct kv__vec16 *kb, const struct kv__vec16 *vb, const bool *ok,
                         int nu)
{
    const int lpr = b->lpr, ne = b->ne, hg = b->hg;
    float sc[KV__DECP_U][KV__DECV_G];
    float vf[KV__DECP_U][KV__DECV_E];
    KV__UNROLL for (int u = 0; u < KV__DECP_U; u++)
    {
        if (u >= nu)
            break;
        float kf[KV__DECV_E];
        KV__UNROLL for (int e = 0; e < KV__DECV_E; e++) kf[e] = vf[u][e] = 0.0f;
        if (ok[u] && b->act) {
            kv__vec_f32(p->lo.dtype, &kb[u], ne, kf);
            kv__vec_f32(p->lo.dtype, &vb[u], ne, vf[u]);
        }
        KV__UNROLL for (int qi = 0; qi < KV__DECV_G; qi++)
        {
            sc[u][qi] = -INFINITY;
            if (qi < hg) { /* hg is the block's: the shuffles stay converged */
                float part = 0.0f;
                KV__UNROLL for (int e = 0; e < KV__DECV_E; e++) part += b->q[qi][e] * kf[e];
                for (int o = lpr / 2; o > 0; o >>= 1)
                    part += kv_grid_shfl_xor(c, part, o);
                if (ok[u])
                    sc[u][qi] = kv__dec_logit(p, part * b->ks);
            }
        }
    }
    KV__UNROLL for (int qi = 0; qi < KV__DECV_G; qi++)
    {
        float mx = b->m[qi];
        KV__UNROLL for (int u = 0; u < KV__DECP_U; u++) if (u < nu) mx =
            sc[u][qi] > mx ? sc[u][qi] : mx;
        if (qi < hg && mx != -INFINITY) { /* else nothing visible yet */
            const float corr = b->m[qi] == -INFINITY ? 0.0f : kv_grid_expf(b->m[qi] - mx);
            float w[KV__DECP_U];
            b->l[qi] *= corr;
            KV__UNROLL for (int u = 0; u < KV__DECP_U; u++)
            {
                if (u >= nu)
                    break;
                w[u] = ok[u] ? kv_grid_expf(sc[u][qi] - mx) : 0.0f;
                b->l[qi] += w[u];
                w[u] *= b->vs;
            }
            b->m[qi] = mx;
            /* vf is 0 where a token or the lane has nothing */
            KV__UNROLL for (int e = 0; e < KV__DECV_E; e++)
            {
                float a = b->acc[qi][e] * corr;
                KV__UNROLL for (int u = 0; u < KV__DECP_U; u++) if (u < nu) a += w[u] * vf[u][e];
                b->acc[qi][e] = a;
            }
        }
    }
}

/* Tokens [t0, t1) of the block's sequence into its online softmax: each
 * lane group takes KV__DECV_U consecutive tokens a step, K and V of all of
 * them loaded before any arithmetic. */
KV_HD void kv__decv_loop(const struct kv_grid_ctx *c, const struct kv__cdec *p, struct kv__decv *b,
                         int64_t t0, int64_t t1)
{
    for (int64_t base = t0 + (int64_t)b->warp * b->gpw * KV__DECV_U; base < t1;
         base += (int64_t)p->warps * b->gpw * KV__DECV_U) {
        /* base is the warp's: every lane runs the same steps (shuffles) */
        struct kv__vec16 kb[KV__DECV_U], vb[KV__DECV_U];
        bool ok[KV__DECV_U];
        KV__UNROLL for (int u = 0; u < KV__DECV_U; u++)
        {
            const int64_t t = base + b->grp * KV__DECV_U + u;
            ok[u] = t < t1;
            if (ok[u]) {
                const int64_t pi = kv__div(t, p->pt), ti = t - pi * p->pt;
                const int32_t pid = b->pages[pi];
                if (p->dev && (pid < 0 || pid >= p->n_ids)) {
                    /* recorded once: at the first token of the page
                     * visited (of any chunk), head 0 */
                    if (b->h == 0 && b->q0 == 0 && b->sub == 0 &&
                        kv__dec_page_first(b->first, t, ti))
                        kv__dev_error(p->err, KV_ATTN_DEV_PAGES, (b->pages - p->d_indices) + pi);
                    ok[u] = false;
                } else if (b->act) {
                    const char *kp = p->cache +
                                     kv_layout_slot_offset_bytes(
                                         &p->lo, p->layer, 0, kv_attn_page_slot(pid, p->pt, ti)) +
                                     b->head_off;
                    kv_grid_move(c, &kb[u], kp, p->vb);
                    kv_grid_move(c, &vb[u], kp + p->lo.stride_kv_bytes, p->vb);
                }
            }
        }
        kv__decv_step(c, p, b, kb, vb, ok, KV__DECV_U);
    }
}

/* The K rows (plus the block's head offset) of tokens t .. t +
 * KV__DECP_U - 1 of the pipelined body: rows[u], NULL for a token at or
 * past t1 or on an invalid page (device mode: recorded at the first token
 * of the page visited, head 0). */
KV_HD void kv__decp_rows(const struct kv__cdec *p, const struct kv__decv *b, int64_t t, int64_t t1,
                         const char **rows)
{
    KV__UNROLL for (int u = 0; u < KV__DECP_U; u++)
    {
        const int64_t tu = t + u;
        rows[u] = NULL;
        if (tu < t1) {
            const int64_t pi = kv__div(tu, p->pt), ti = tu - pi * p->pt;
            const int32_t pid = b->pages[pi];
            if (p->dev && (pid < 0 || pid >= p->n_ids)) {
                if (b->h == 0 && b->q0 == 0 && b->sub == 0 && kv__dec_page_first(b->first, tu, ti))
                    kv__dev_error(p->err, KV_ATTN_DEV_PAGES, (b->pages - p->d_indices) + pi);
            } else {
                rows[u] = p->cache +
                          kv_layout_slot_offset_bytes(&p->lo, p->layer, 0,
                                                      kv_attn_page_slot(pid, p->pt, ti)) +
                          b->head_off;
            }
        }
    }
}

/* The K and V vectors of rows[u] into kb[u], vb[u] (zero where none);
 * ok[u]: the row exists. */
KV_HD void kv__decp_load(const struct kv_grid_ctx *c, const struct kv__cdec *p,
                         const struct kv__decv *b, const char *const *rows, struct kv__vec16 *kb,
                         struct kv__vec16 *vb, bool *ok)
{
    KV__UNROLL for (int u = 0; u < KV__DECP_U; u++)
    {
        ok[u] = rows[u] != NULL;
        if (ok[u] && b->act) {
            kv_grid_move(c, &kb[u], rows[u], p->vb);
            kv_grid_move(c, &vb[u], rows[u] + p->lo.stride_kv_bytes, p->vb);
        } else {
            KV__UNROLL for (int w = 0; w < 4; w++) kb[u].w[w] = vb[u].w[w] = 0;
        }
    }
}

/* Tokens [t0, t1) as kv__decv_loop, software-pipelined, KV__DECP_U tokens
 * a lane group a step: each step loads the next step's K and V rows before
 * its own arithmetic and looks up the page entries of the step after that,
 * so neither a page lookup nor a row load waits on the arithmetic (base is
 * the warp's: every lane runs the same steps, and their shuffles). */
KV_HD void kv__decp_loop(const struct kv_grid_ctx *c, const struct kv__cdec *p, struct kv__decv *b,
                         int64_t t0, int64_t t1)
{
    const int64_t step = (int64_t)p->warps * b->gpw * KV__DECP_U,
                  base0 = t0 + (int64_t)b->warp * b->gpw * KV__DECP_U,
                  t_off = (int64_t)b->grp * KV__DECP_U;
    const char *rows[KV__DECP_U];
    struct kv__vec16 kb[KV__DECP_U], vb[KV__DECP_U];
    bool ok[KV__DECP_U];
    kv__decp_rows(p, b, base0 + t_off, t1, rows);
    kv__decp_load(c, p, b, rows, kb, vb, ok);
    kv__decp_rows(p, b, base0 + step + t_off, t1, rows);
    for (int64_t base = base0; base < t1; base += step) {
        struct kv__vec16 kn[KV__DECP_U], vn[KV__DECP_U];
        bool okn[KV__DECP_U];
        kv__decp_load(c, p, b, rows, kn, vn, okn);
        kv__decp_rows(p, b, base + 2 * step + t_off, t1, rows);
        kv__decv_step(c, p, b, kb, vb, ok, KV__DECP_U);
        KV__UNROLL for (int u = 0; u < KV__DECP_U; u++)
        {
            kb[u] = kn[u];
            vb[u] = vn[u];
            ok[u] = okn[u];
        }
    }
}

/* The block's lane groups and warps merged; then out and lse (split
 * false) or, for split-KV, the block's partial state of chunk `chunk`: per
 * query head qh, ws[((s x Hq + qh) x n_split + chunk) x (D + 2) + d] = acc
 * (not divided by l), then m and l. Synchronizes. */
KV_HD void kv__decv_end(const struct kv_grid_ctx *c, const struct kv__cdec *p, struct kv__decv *b,
                        bool split, int64_t chunk)
{
    const int64_t D = p->lo.head_dim, g = p->g;
    const int hg = b->hg, ne = b->ne, warp = b->warp;
    /* the warp's groups into its group 0 (lane ^ o, o = lpr .. 16) */
    for (int o = b->lpr; o < 32; o <<= 1) {
        KV__UNROLL for (int qi = 0; qi < KV__DECV_G; qi++)
        {
            if (qi < hg) {
                const float mo = kv_grid_shfl_xor(c, b->m[qi], o),
                            lo = kv_grid_shfl_xor(c, b->l[qi], o);
                float fa, fb;
                kv__dec_merge(&b->m[qi], &b->l[qi], mo, lo, &fa, &fb);
                KV__UNROLL for (int e = 0; e < KV__DECV_E; e++)
                {
                    if (e < ne) {
                        const float ao = kv_grid_shfl_xor(c, b->acc[qi][e], o);
                        b->acc[qi][e] = b->acc[qi][e] * fa + ao * fb;
                    }
                }
            }
        }
    }
    float *sacc = (float *)c->shared;              /* [warps][G][D] */
    float *sml = sacc + p->warps * KV__DECV_G * D; /* [warps][G][2] */
    if (b->grp == 0) {
        KV__UNROLL for (int qi = 0; qi < KV__DECV_G; qi++)
        {
            if (qi < hg) {
                if (b->act)
                    KV__UNROLL for (int e = 0; e < KV__DECV_E; e++) if (e < ne)
                        sacc[(warp * KV__DECV_G + qi) * D + b->d0 + e] = b->acc[qi][e];
                if (b->sub == 0) {
                    sml[(warp * KV__DECV_G + qi) * 2] = b->m[qi];
                    sml[(warp * KV__DECV_G + qi) * 2 + 1] = b->l[qi];
                }
            }
        }
    }
    kv_grid_sync(c);
    for (int64_t i = c->thread; i < hg * D; i += c->block_dim) {
        const int64_t qi = i / D, d = i - qi * D;
        float M = -INFINITY, L = 0.0f, A = 0.0f;
        for (int w = 0; w < p->warps; w++) {
            const float *ml = sml + (w * KV__DECV_G + qi) * 2;
            float fa, fb;
            kv__dec_merge(&M, &L, ml[0], ml[1], &fa, &fb);
            A = A * fa + sacc[(w * KV__DECV_G + qi) * D + d] * fb;
        }
        const int64_t qh = b->h * g + b->q0 + qi;
        if (split) {
            float *e = p->ws + ((b->s * p->lo.num_heads * g + qh) * p->n_split + chunk) * (D + 2);
            e[d] = A;
            if (d == 0) {
                e[D] = M;
                e[D + 1] = L;
            }
            continue;
        }
        kv_from_f32(p->out.dt, L != 0.0f ? A / L : 0.0f,
                    p->out.base + b->s * p->out.tok + qh * p->out.head + d * p->out.dim);
        if (p->lse && d == 0)
            p->lse[b->s * p->lse_stride + qh] = L != 0.0f ? M + logf(L) : -INFINITY;
    }
}

/* The vector body: one block per (sequence, KV head, head group), every
 * visible token, KV__DECV_U tokens a lane group a step. */
KV_HD void kv__decode_vec_body(const struct kv_grid_ctx *c, const struct kv__cdec *p)
{
    struct kv__decv b;
    kv__decv_begin(c, p, c->block, true, &b);
    kv__decv_loop(c, p, &b, b.first, b.n_tok);
    kv__decv_end(c, p, &b, false, 0);
}

/* The pipelined vector body: the vector body's blocks, kv__decp_loop. */
KV_HD void kv__decode_pipe_body(const struct kv_grid_ctx *c, const struct kv__cdec *p)
{
    struct kv__decv b;
    kv__decv_begin(c, p, c->block, true, &b);
    kv__decp_loop(c, p, &b, b.first, b.n_tok);
    kv__decv_end(c, p, &b, false, 0);
}

/* Chunk k's tokens [*t0, *t1) of a sequence whose visible tokens are
 * [first, n_tok), in n_split chunks of ceil(visible / n_split) tokens, at
 * least split_min (the last chunks may then be short or empty). */
KV_HD void kv__dec_chunk(const struct kv__cdec *p, int64_t first, int64_t n_tok, int64_t k,
                         int64_t *t0, int64_t *t1)
{
    int64_t len = (n_tok - first + p->n_split - 1) / p->n_split;
    if (len < p->split_min)
        len = p->split_min;
    const int64_t a = first + k * len, e = a + len;
    *t0 = a < n_tok ? a : n_tok;
    *t1 = e < n_tok ? e : n_tok;
}

/* Split-KV, the first kernel: one block per (sequence, KV head, head
 * group, chunk: n_split a sequence, the innermost), the vector body over
 * the chunk's tokens, its partial state into the workspace p->ws
 * (kv__decv_end); kv__decode_merge_body combines the chunks. */
KV_HD void kv__decode_split_body(const struct kv_grid_ctx *c, const struct kv__cdec *p)
{
    const int64_t k = c->block % p->n_split;
    struct kv__decv b;
    kv__decv_begin(c, p, c->block / p->n_split, k == 0, &b);
    int64_t t0, t1;
    kv__dec_chunk(p, b.first, b.n_tok, k, &t0, &t1);
    kv__decv_loop(c, p, &b, t0, t1);
    kv__decv_end(c, p, &b, true, k);
}

#define KV__DECM_THREADS 128

/* Split-KV, the merge: one block of KV__DECM_THREADS per (sequence, query
 * head) row (grid stride over n_seqs x Hq rows), threads over D; the
 * chunks' (acc, m, l) merged as one online softmax, then out = A / L and
 * lse = M + ln L from the merged state (an empty chunk has m -inf, l 0:
 * left out). */
KV_HD void kv__decode_merge_body(const struct kv_grid_ctx *c, const struct kv__cdec *p)
{
    const int64_t D = p->lo.head_dim, Hq = p->lo.num_heads * p->g, rows = p->n_seqs * Hq;
    const int64_t es = D + 2;
    for (int64_t row = c->block; row < rows; row += c->grid_dim) {
        const int64_t s = row / Hq, qh = row - s * Hq;
        const float *w = p->ws + row * p->n_split * es;
        float M = -INFINITY;
        for (int64_t k = 0; k < p->n_split; k++)
            M = fmaxf(M, w[k * es + D]);
        for (int64_t d = c->thread; d < D; d += c->block_dim) {
            float L = 0.0f, A = 0.0f;
            for (int64_t k = 0; k < p->n_split; k++) {
                const float mk = w[k * es + D];
                if (mk == -INFINITY)
                    continue;
                const float f = kv_grid_expf(mk - M);
                L += w[k * es + D + 1] * f;
                A += w[k * es + d] * f;
            }
            kv_from_f32(p->out.dt, L != 0.0f ? A / L : 0.0f,
                        p->out.base + s * p->out.tok + qh * p->out.head + d * p->out.dim);
            if (p->lse && d == 0)
                p->lse[s * p->lse_stride + qh] = L != 0.0f ? M + logf(L) : -INFINITY;
        }
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
    /* device-index mode (kv_attn_decode_mla_cuda_dev; dev 1): the pages as
     * in struct kv__cdec (CSR or block table), checked here; ksc: the K
     * scale in device memory (NULL: k_scale) */
    int dev;
    const int32_t *d_indptr, *d_indices, *d_last, *d_lens;
    int64_t d_n_pages, d_cols, n_ids;
    struct kv_attn_cuda_errors *err;
    const float *ksc;
};

/* Shared memory (floats): q [hg][D], kt [tt][D], acc [hg][dv], sc [hg][tt],
 * m, l, corr [hg], okr [tt] (1: the tile row's page is valid). Synchronizes. */
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
    float *m = sc + hg * tt, *l = m + hg, *corr = l + hg, *okr = corr + hg;
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
    int64_t n_tok;
    const int32_t *pages;
    if (p->dev) {
        /* a sequence with a bad indptr, last_page_len or seq_lens has no
         * tokens (output 0), recorded once (head group 0, thread 0) */
        int64_t first, idx;
        int arr;
        if (!kv__dev_seq(p->d_indptr, p->d_last, p->d_n_pages, p->d_lens, p->d_cols, p->pt, s,
                         &n_tok, &first, &arr, &idx)) {
            if (h0 == 0 && c->thread == 0)
                kv__dev_error(p->err, arr, idx);
            n_tok = 0;
        }
        pages = p->d_indices + first;
    } else {
        n_tok = p->seq_tokens[s];
        pages = p->page_ids + p->page_start[s];
    }
    const float kscale = p->ksc ? *p->ksc : p->k_scale;
    for (int64_t t0 = 0; t0 < n_tok; t0 += tt) {
        const int64_t nt = n_tok - t0 < tt ? n_tok - t0 : tt;
        kv_grid_sync(c); /* the previous tile's values are done with kt and sc */
        for (int64_t i = c->thread; i < nt * D; i += c->block_dim) {
            const int64_t r = i / D, d = i - r * D, t = t0 + r;
            const int32_t pid = pages[t / p->pt];
            if (p->dev && (pid < 0 || pid >= p->n_ids)) {
                /* the row is left out of the softmax; recorded once, at the
                 * page's first token (head group 0) */
                if (h0 == 0 && d == 0 && t % p->pt == 0)
                    kv__dev_error(p->err, KV_ATTN_DEV_PAGES, (pages - p->d_indices) + t / p->pt);
                kt[i] = 0.0f;
                if (d == 0)
                    okr[r] = 0.0f;
                continue;
            }
            if (d == 0)
                okr[r] = 1.0f;
            const int64_t slot = kv_attn_page_slot(pid, p->pt, t % p->pt);
            const char *row = p->cache + kv_layout_slot_offset_bytes(&p->lo, p->layer, 0, slot);
            kt[i] = kv_to_f32(p->lo.dtype, row + d * es) * kscale;
        }
        kv_grid_sync(c);
        for (int64_t pair = warp; pair < nh * nt; pair += warps) {
            const int64_t hh = pair / nt, r = pair - hh * nt;
            float part = 0.0f;
            for (int64_t d = lane; d < D; d += 32)
                part += q[hh * D + d] * kt[r * D + d];
            const float x = kv_grid_warp_sum(c, part);
            if (lane == 0)
                sc[hh * tt + r] = okr[r] != 0.0f ? x : -INFINITY;
        }
        kv_grid_sync(c);
        if (c->thread < nh) {
            const int64_t hh = c->thread;
            float mx = m[hh];
            for (int64_t r = 0; r < nt; r++)
                mx = fmaxf(mx, sc[hh * tt + r]);
            if (mx == -INFINITY) { /* nothing valid yet: weights 0, acc kept */
                for (int64_t r = 0; r < nt; r++)
                    sc[hh * tt + r] = 0.0f;
                corr[hh] = 1.0f;
            } else {
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
        kv_from_f32(p->out.dt, l[hh] != 0.0f ? acc[i] / l[hh] : 0.0f,
                    p->out.base + s * p->out.tok + (h0 + hh) * p->out.head + d * p->out.dim);
    }
}

/* ---- launch parameters (host code, shared by the two launchers) ------------------- */

/* The threads of a move's blocks: the power of two from 32 up to
 * KV__ATTN_THREADS that covers an item's vectors (elements when
 * converting: vbytes 0), so a one-token item (a device-index write) does
 * not leave most of a block idle. max_run: the host-index runs' longest. */
static inline int kv__cmove_threads(const struct kv__cmove *m, int vbytes, int64_t max_run)
{
    const int64_t n = m->slot_map ? 1 : m->rd_on ? m->rd_pt : max_run;
    const int64_t per_row = vbytes ? m->lo.head_dim * m->lo.elem_bytes / vbytes : m->lo.head_dim;
    const int64_t need = n * m->lo.num_heads * per_row;
    int t = 32;
    while (t < KV__ATTN_THREADS && t < need)
        t *= 2;
    return t;
}

static inline int kv__attn_grid_of(int64_t items)
{
    return (int)(items < KV__ATTN_MAX_GRID ? (items > 0 ? items : 1) : KV__ATTN_MAX_GRID);
}

/* The move of job j; returns whether it moves bytes (kv__move_bytes_body)
 * rather than converting. */
/* A kernel's side of a resolved tensor: its base, byte strides and dtype. */
static inline struct kv__cside kv__cside_of(const struct kv__attn_tensor *t)
{
    const struct kv__cside s = {t->base,        t->layer_stride, t->token_stride,
                                t->head_stride, t->dim_stride,   t->dtype};
    return s;
}

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
        m->has[kv] = kv ? j->has_v : j->has_k;
        m->t[kv] = kv__cside_of(kv ? &j->v : &j->k);
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

/* The move of a device-index read (kv_attn_read_cuda_dev): job j from
 * kv__attn_read_dev_check (no runs; T its outputs' tokens), the pages and
 * out_indptr [n_seqs + 1] read by the body: one item per (page entry,
 * layer), then one per (sequence, layer) for its checks. Returns what
 * kv__cmove_build returns. */
static inline bool kv__cmove_build_read_dev(const struct kv__attn_job *j,
                                            const struct kv_attn_dev_pages *pg,
                                            const int32_t *out_indptr,
                                            struct kv_attn_cuda_errors *err, struct kv__cmove *m)
{
    const bool bytes = kv__cmove_build(j, false, m);
    m->rd_on = 1;
    if (pg->format == KV_PAGES_BLOCK_TABLE) {
        m->rd_indices = pg->block_table;
        m->rd_lens = pg->seq_lens;
        m->rd_cols = pg->block_table_cols;
        m->rd_entries = (int64_t)pg->n_seqs * pg->block_table_cols;
    } else {
        m->rd_indptr = pg->indptr;
        m->rd_indices = pg->indices;
        m->rd_last = pg->last_page_len;
        m->rd_n_pages = pg->n_pages;
        m->rd_entries = pg->n_pages;
    }
    m->rd_out = out_indptr;
    m->rd_seqs = pg->n_seqs;
    m->rd_T = j->has_k ? j->k.n_tokens : j->v.n_tokens;
    m->rd_pt = j->page_tokens;
    m->rd_ids = m->lo.num_blocks * (int64_t)j->page_ratio;
    m->n_items = (m->rd_entries + (int64_t)pg->n_seqs) * (int64_t)j->n_layers;
    m->err = err;
    return bytes;
}

/* The scales of a device-index move (after kv__cmove_build_dev), from job
 * j's k_scale / v_scale (layer layer0's row; scale_layer_stride between
 * rows; n_scales 0: none): host arrays copied by value (by_value; at most
 * KV_ATTN_DEV_SCALES_MAX per plane, checked by the caller) or device
 * pointers the body reads. One launch whatever the layers. */
static inline void kv__cmove_scales_dev(const struct kv__attn_job *j, bool by_value,
                                        struct kv__cmove *m)
{
    if (!j->n_scales)
        return;
    m->sc_lstride = j->scale_layer_stride;
    if (!by_value) {
        m->sc[0] = j->k_scale;
        m->sc[1] = j->v_scale;
        return;
    }
    const int64_t n = (j->scale_layer_stride ? (int64_t)j->n_layers : 1) * j->n_scales;
    for (int64_t i = 0; i < n && i < KV_ATTN_DEV_SCALES_MAX; i++) {
        m->sv[0][i] = j->k_scale[i];
        m->sv[1][i] = j->v_scale ? j->v_scale[i] : 1.0f; /* NULL: a K-only cache */
    }
    m->sv_on = 1;
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
/* The decode bodies. Test hook (library-internal) kv__cdec_body: 0
 * (KV__CDEC_AUTO) what kv__cdec_build picks (the vector body where the
 * rows allow it, else the general one), or one forced, so the tests and
 * the GPU bench run every body on the same cases: a vector-family body
 * (_VEC, _PIPE, _SPLIT) where the rows do not allow one runs the general
 * body, and split-KV where the launcher has no workspace (the public
 * device-index entry) the vector body. kv__cdec_chunks: split-KV's chunks
 * per sequence when > 0, with no minimum chunk length (else
 * kv__cdec_split_plan). */
enum { KV__CDEC_AUTO, KV__CDEC_GENERAL, KV__CDEC_VEC, KV__CDEC_PIPE, KV__CDEC_SPLIT };
extern int kv__cdec_body;
extern int kv__cdec_chunks;

/* Whether decode p takes the vector body; sets its lpr, nv, vb, ne, hg,
 * n_hg and warps (4). A head row must be contiguous and split into at most
 * 32 vectors of vb bytes (16, else 8, 4, 2: what every stride of the layout
 * and the base allow; at most 8 elements, so fp8 rows take 8-byte vectors),
 * each vector's offset a multiple of vb. */
static inline bool kv__cdec_vec(struct kv__cdec *p)
{
    const struct kv_layout *lo = &p->lo;
    const int64_t es = lo->elem_bytes, row = lo->head_dim * es;
    if (lo->stride_dim_bytes != es)
        return false;
    const uint64_t bits = (uint64_t)(uintptr_t)p->cache | (uint64_t)lo->stride_layer_bytes |
                          (uint64_t)lo->stride_kv_bytes | (uint64_t)lo->stride_block_bytes |
                          (uint64_t)lo->block_stride_bytes | (uint64_t)lo->stride_token_bytes |
                          (uint64_t)lo->stride_head_bytes | (uint64_t)row;
    int vb = (int)(KV__DECV_E * es < 16 ? KV__DECV_E * es : 16);
    while (vb > (int)es && (bits & (uint64_t)(vb - 1)) != 0)
        vb /= 2;
    if ((bits & (uint64_t)(vb - 1)) != 0 || row % vb != 0 || row / vb > 32)
        return false;
    p->vb = vb;
    p->nv = (int)(row / vb);
    p->ne = (int)(vb / es);
    p->lpr = 1;
    while (p->lpr < p->nv)
        p->lpr *= 2;
    p->hg = p->g < KV__DECV_G ? (int)p->g : KV__DECV_G;
    p->n_hg = (p->g + p->hg - 1) / p->hg;
    p->warps = KV__DEC_WARPS;
    return true;
}

/* The blocks of decode p over n_seqs sequences (split-KV: its first
 * kernel's). */
static inline int64_t kv__cdec_blocks(const struct kv__cdec *p, int64_t n_seqs)
{
    if (p->body == KV__CDEC_GENERAL)
        return n_seqs * p->lo.num_heads;
    return n_seqs * p->lo.num_heads * p->n_hg * (p->body == KV__CDEC_SPLIT ? p->n_split : 1);
}

/* The chunks of a split-KV decode p (body KV__CDEC_SPLIT) over n_seqs
 * sequences of at most max_tokens tokens (-1: unknown, the device-index
 * mode) on a GPU of sms multiprocessors: enough chunks that the blocks
 * number at least 2 x sms, and chunks of at most 2048 tokens, but none
 * shorter than 256 tokens (a sequence splits into ceil(len / chunk)); at
 * most 64. kv__cdec_chunks > 0 forces that many, with no minimum length. */
static inline void kv__cdec_split_plan(struct kv__cdec *p, int64_t n_seqs, int64_t max_tokens,
                                       int sms)
{
    p->n_seqs = n_seqs;
    if (kv__cdec_chunks > 0) {
        p->n_split = kv__cdec_chunks;
        p->split_min = 1;
        return;
    }
    const int64_t base = n_seqs * p->lo.num_heads * p->n_hg;
    int64_t n = (2 * (int64_t)sms + base - 1) / base;
    if (max_tokens >= 0) {
        const int64_t by_len = (max_tokens + 2047) / 2048, most = (max_tokens + 255) / 256;
        n = n > by_len ? n : by_len;
        n = n < most ? n : most;
    }
    p->n_split = n < 1 ? 1 : n > 64 ? 64 : n;
    p->split_min = 256;
}

/* The workspace bytes of a split-KV decode p (after kv__cdec_split_plan). */
static inline size_t kv__cdec_ws_bytes(const struct kv__cdec *p)
{
    return (size_t)p->n_seqs * (size_t)(p->lo.num_heads * p->g) * (size_t)p->n_split *
           (size_t)(p->lo.head_dim + 2) * sizeof(float);
}

static inline kv_status kv__cdec_build(const struct kv__attn_job *j, const char *fn,
                                       struct kv__cdec *p, size_t *shmem)
{
    memset(p, 0, sizeof(*p));
    p->lo = j->cache.layout;
    p->cache = (const char *)j->cache.base;
    p->layer = j->layer0;
    p->q = kv__cside_of(&j->q);
    p->out = kv__cside_of(&j->out);
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
    p->window_left = j->window_left;
    p->cap = j->soft_cap;
    p->lse = j->lse;
    p->lse_stride = j->lse_stride ? j->lse_stride : (int64_t)j->q_heads;
    p->body = KV__CDEC_GENERAL;
    if (kv__cdec_body != KV__CDEC_GENERAL && kv__cdec_vec(p)) {
        p->body = kv__cdec_body > KV__CDEC_VEC && kv__cdec_body <= KV__CDEC_SPLIT ? kv__cdec_body
                                                                                  : KV__CDEC_VEC;
        *shmem = (size_t)p->warps * KV__DECV_G * (size_t)(p->lo.head_dim + 2) * sizeof(float);
        return KV_OK;
    }
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
    p->q = kv__cside_of(&j->q);
    p->out = kv__cside_of(&j->out);
    p->hq = j->q_heads;
    p->dv = j->mla_dv;
    p->pt = j->page_tokens;
    p->softmax_scale = j->softmax_scale;
    p->k_scale = j->k_scale ? j->k_scale[0] : 1.0f;
    p->page_ids = j->page_ids;
    p->page_start = j->page_start;
    p->seq_tokens = j->seq_tokens;
    const int64_t D = p->lo.head_dim, dv = p->dv;
    /* floats: hg (D + dv + tt + 3) + tt (D + 1); up to 8 heads, tiles of 8
     * rows (fewer where D is large) */
    p->tt = 8;
    p->hg = p->hq < 8 ? p->hq : 8;
    while ((p->hg * (D + dv + p->tt + 3) + p->tt * (D + 1)) * 4 > KV__SHARED_MAX && p->hg > 1)
        p->hg--;
    while ((p->hg * (D + dv + p->tt + 3) + p->tt * (D + 1)) * 4 > KV__SHARED_MAX && p->tt > 1)
        p->tt--;
    *shmem = (size_t)(p->hg * (D + dv + p->tt + 3) + p->tt * (D + 1)) * sizeof(float);
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

/* The device-index part of an MLA decode (kv_attn_decode_mla_cuda_dev)
 * after kv__cmla_build: the pages and the record; ksc: the K scale in
 * device memory (NULL: the job's, by value). */
static inline void kv__cmla_build_dev(const struct kv__attn_job *j,
                                      const struct kv_attn_dev_pages *pg,
                                      struct kv_attn_cuda_errors *err, const float *ksc,
                                      struct kv__cmla *p)
{
    p->dev = 1;
    if (pg->format == KV_PAGES_BLOCK_TABLE) {
        p->d_indices = pg->block_table;
        p->d_lens = pg->seq_lens;
        p->d_cols = pg->block_table_cols;
    } else {
        p->d_indptr = pg->indptr;
        p->d_indices = pg->indices;
        p->d_last = pg->last_page_len;
        p->d_n_pages = pg->n_pages;
    }
    p->n_ids = p->lo.num_blocks * (int64_t)j->page_ratio;
    p->err = err;
    p->ksc = ksc;
    p->page_ids = NULL;
    p->page_start = p->seq_tokens = NULL;
}

/* The device-index part of a decode (kv_attn_decode_cuda_dev) after
 * kv__cdec_build: the CSR arrays and the record; no scales (NULL: 1). */
static inline void kv__cdec_build_dev(const struct kv__attn_job *j,
                                      const struct kv_attn_dev_pages *pg,
                                      struct kv_attn_cuda_errors *err, struct kv__cdec *p)
{
    p->dev = 1;
    if (pg->format == KV_PAGES_BLOCK_TABLE) {
        p->d_indices = pg->block_table;
        p->d_lens = pg->seq_lens;
        p->d_cols = pg->block_table_cols;
    } else {
        p->d_indptr = pg->indptr;
        p->d_indices = pg->indices;
        p->d_last = pg->last_page_len;
        p->d_n_pages = pg->n_pages;
    }
    p->n_ids = p->lo.num_blocks * (int64_t)j->page_ratio;
    p->err = err;
    p->scales = NULL; /* the host mode's upload: never in this mode */
}

/* The scales of a device-index decode (after kv__cdec_build_dev), from
 * job j's k_scale / v_scale (the layer's row, n_scales values; 0: none):
 * copied by value (by_value) or device pointers the body reads. */
static inline void kv__cdec_scales_dev(const struct kv__attn_job *j, bool by_value,
                                       struct kv__cdec *p)
{
    if (!j->n_scales)
        return;
    if (!by_value) {
        p->sc[0] = j->k_scale;
        p->sc[1] = j->v_scale;
        return;
    }
    for (uint32_t i = 0; i < j->n_scales && i < KV_ATTN_DEV_SCALES_MAX; i++) {
        p->sv[0][i] = j->k_scale[i];
        p->sv[1][i] = j->v_scale[i];
    }
    p->sv_on = 1;
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

/* A copy_ex unit's rows (the whole block, or with halves one plane's
 * N x H half rows of a packed block), the strides of those rows and the
 * two sides' bases, from job j. */
static inline void kv__ccopy_ex_rows(const struct kv__attn_job *j, bool halves,
                                     struct kv__ccopy_ex *p)
{
    const struct kv_layout *dl = &j->cache.layout;
    p->rows = halves ? dl->block_tokens * dl->num_heads : 1;
    p->row_bytes = halves ? dl->head_dim * dl->elem_bytes : dl->block_bytes;
    p->H = dl->num_heads;
    p->tok = dl->stride_token_bytes;
    p->head = dl->stride_head_bytes;
    p->dst = (char *)j->cache.base;
    p->src = (const char *)j->src.base;
}

/* The widest vector every address and offset ORed in bits, the row bytes
 * and (halves) the row strides allow. */
static inline int kv__ccopy_ex_width(const struct kv__ccopy_ex *p, bool halves, uint64_t bits)
{
    bits |= (uint64_t)p->row_bytes;
    if (halves)
        bits |= (uint64_t)p->tok | (uint64_t)p->head;
    return (bits & 15) == 0  ? 16
           : (bits & 7) == 0 ? 8
           : (bits & 3) == 0 ? 4
           : (bits & 1) == 0 ? 2
                             : 1;
}

/* The copy_ex of job j: offs [kv__ccopy_ex_units][2] (caller's, filled), *p
 * and the vector width (16, 8, 4, 2 or 1 bytes). */
static inline void kv__ccopy_ex_build(const struct kv__attn_job *j, int64_t *offs,
                                      struct kv__ccopy_ex *p, int *vbytes)
{
    const struct kv_layout *dl = &j->cache.layout, *sl = &j->src.layout;
    const bool halves = dl->kv_packed && j->planes != KV_ATTN_PLANES_KV;
    const int64_t units = dl->kv_packed ? 1 : (j->planes == KV_ATTN_PLANES_KV ? 2 : 1);
    memset(p, 0, sizeof(*p)); /* host offsets: no pairs, no record */
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
    kv__ccopy_ex_rows(j, halves, p);
    p->offs = offs;
    p->n_items = n_units * p->rows;
    *vbytes = kv__ccopy_ex_width(p, halves, bits);
}

/* The copy_ex of a device-index call (kv_attn_copy_blocks_ex_cuda_dev): job
 * j from kv__attn_copy_check with no copies (its layers, planes, caches),
 * the pairs [n] read by the body. The vector width allows every offset
 * any pair can give (the layouts' layer, K/V and block strides). */
static inline void kv__ccopy_ex_build_dev(const struct kv__attn_job *j,
                                          const struct kv_block_copy *pairs, uint32_t n,
                                          struct kv_attn_cuda_errors *err, struct kv__ccopy_ex *p,
                                          int *vbytes)
{
    const struct kv_layout *dl = &j->cache.layout, *sl = &j->src.layout;
    const bool halves = dl->kv_packed && j->planes != KV_ATTN_PLANES_KV;
    memset(p, 0, sizeof(*p));
    p->units = dl->kv_packed ? 1 : (j->planes == KV_ATTN_PLANES_KV ? 2 : 1);
    p->per_copy = (int64_t)j->n_layers * p->units;
    p->kv0 = j->planes == KV_ATTN_PLANE_V ? 1 : 0;
    p->halves = halves;
    p->layer0 = j->layer0;
    p->dlo = *dl;
    p->slo = *sl;
    p->pairs = pairs;
    p->err = err;
    kv__ccopy_ex_rows(j, halves, p);
    p->n_items = (int64_t)n * p->per_copy * p->rows;
    uint64_t bits = (uint64_t)(uintptr_t)j->cache.base | (uint64_t)(uintptr_t)j->src.base;
    for (int side = 0; side < 2; side++) {
        const struct kv_layout *lo = side ? sl : dl;
        bits |= (uint64_t)lo->stride_layer_bytes | (uint64_t)lo->stride_kv_bytes |
                (uint64_t)lo->stride_block_bytes;
    }
    *vbytes = kv__ccopy_ex_width(p, halves, bits);
}

#endif /* KV_ATTN_KERNELS_HD_H */
