/*
 * kv_attn_cpu_mla_prefill.c - MLA prefill on the CPU (kv_attn_prefill_mla,
 * kv_attn.h): q_len >= 0 queries per sequence over a K-only latent cache of
 * one KV head, with a causal mask. Query i of sequence s sits at position
 * p = len - q_len + i and sees the tokens lo(p) .. p (lo(p) = 0, or
 * max(0, p - window_left) with a window):
 *
 *     out[row][h] = sum_{t = lo(p)..p} softmax_t(x(q[row][h] . K[t][0..D))) K[t][0..dv)
 *
 * x: the scale, then the soft cap. Work: tasks of (sequence, tile of up
 * to qt query tokens, group of hg query heads), qt * hg <= KV__MLA_GROUP
 * rows, over OpenMP threads (dynamic: later tiles see more tokens). A task
 * walks the tokens its tile sees (lo of its first query .. its last query)
 * in chunks of KV__MLA_CHUNK aligned to multiples of KV__MLA_CHUNK: each
 * latent row is read from the cache and converted to f32 once, then serves
 * every (query token, query head) of the task that sees it, through the
 * decode's chunk code (kv_attn_mla_int.h) restricted to the tokens that
 * query sees. hg is a multiple of 4 or Hq, as the decode's groups are, so
 * a query with q_len 1 and no options sums in the decode's order: the same
 * bits as kv_attn_decode_mla.
 */
#include <inttypes.h>
#include <math.h>
#include <omp.h>
#include <string.h>

#include "kv_attn_int.h"
#include "kv_attn_mla_int.h"
#include "kv_convert_hd.h"
#include "kv_mem.h"

/* A tile: query tokens i0 .. i0 + n - 1 of sequence s. */
struct mla_tile {
    uint32_t s;
    int32_t n;
    int64_t i0;
};

/* lo(p): the first token a query at position p sees. */
static inline int64_t first_seen(int64_t p, int32_t window_left)
{
    return window_left < 0 || p <= window_left ? 0 : p - window_left;
}

static int64_t count_tiles(const struct kv__attn_job *j, int64_t qt)
{
    int64_t n = 0;
    for (uint32_t s = 0; s < j->n_seqs; s++)
        n += (j->q_start[s + 1] - j->q_start[s] + qt - 1) / qt;
    return n;
}

static kv_status exec_prefill_mla(const struct kv__attn_job *j)
{
    const struct kv_layout *lo = &j->cache.layout;
    const int64_t D = lo->head_dim, dv = j->mla_dv, hq = j->q_heads, pt = j->page_tokens;
    const uint32_t S = j->n_seqs;
    const bool simd = kv__mla_simd(D, dv), bdot = kv__mla_bdot_ok(j, simd);
    float lut[256];
    const float ks = kv__mla_prepare(j, simd, lut);
    int64_t work = 0, max_ql = 0;
    for (uint32_t s = 0; s < S; s++) {
        const int64_t ql = j->q_start[s + 1] - j->q_start[s];
        work += ql * j->seq_tokens[s];
        max_ql = ql > max_ql ? ql : max_ql;
    }
    if (max_ql == 0)
        return KV_OK; /* no query rows: nothing to write */
    /* work: the flops of every head over every token each query sees (at
     * most), counted as bytes */
    const int nt = kv__attn_threads_for(work * hq * (D + dv) * 2);
    /* the largest tiles that still leave two tasks a thread: query tokens
     * first, then heads (a multiple of 4 where it can be) */
    int64_t hg = hq < KV__MLA_GROUP ? hq : KV__MLA_GROUP;
    int64_t qt = KV__MLA_GROUP / hg < max_ql ? KV__MLA_GROUP / hg : max_ql;
    for (;;) {
        const int64_t tasks = count_tiles(j, qt) * ((hq + hg - 1) / hg);
        if (tasks >= 2 * (int64_t)nt)
            break;
        if (qt > 1)
            qt = (qt + 1) / 2;
        else if (hg > 4)
            hg = (hg / 2 + 3) / 4 * 4;
        else
            break;
    }
    const int64_t ng = (hq + hg - 1) / hg, n_tiles = count_tiles(j, qt), tasks = n_tiles * ng;
    struct mla_tile *tiles = kv__mem_alloc((size_t)n_tiles * sizeof(*tiles));
    if (!tiles)
        return kv__error(KV_ERR_NO_MEMORY, "%s: %" PRId64 " query tiles", j->fn, n_tiles);
    for (int64_t s = 0, k = 0; s < S; s++) {
        const int64_t ql = j->q_start[s + 1] - j->q_start[s];
        for (int64_t i0 = 0; i0 < ql; i0 += qt)
            tiles[k++] = (struct mla_tile){(uint32_t)s, (int32_t)(ql - i0 < qt ? ql - i0 : qt), i0};
    }
    const int64_t R = qt * hg; /* rows a task, at most */
    /* per thread: q [R][D], acc [R][dv], m, l [R], sc [hg][CHUNK], kf [CHUNK][D]; with
     * bdot also qb [R][D] and kbuf [CHUNK][D] bf16 */
    const size_t per =
        ((size_t)(R * D + R * dv + 2 * R + hg * KV__MLA_CHUNK + KV__MLA_CHUNK * D) * sizeof(float) +
         (bdot ? (size_t)(R * D + KV__MLA_CHUNK * D) * sizeof(uint16_t) : 0) + 63) /
        64 * 64;
    float *scratch = kv__mem_alloc_aligned(64, per * (size_t)nt);
    if (!scratch) {
        kv__mem_free(tiles);
        return kv__error(KV_ERR_NO_MEMORY, "%s: %zu bytes of scratch", j->fn, per * (size_t)nt);
    }
#pragma omp parallel num_threads(nt)
    {
        float *q = (float *)(void *)((char *)scratch + (size_t)omp_get_thread_num() * per);
        float *acc = q + R * D, *m = acc + R * dv, *l = m + R, *sc = l + R;
        float *kf = sc + hg * KV__MLA_CHUNK;
        uint16_t *qb = (uint16_t *)(void *)(kf + KV__MLA_CHUNK * D), *kbuf = qb + R * D;
        const char *rows[KV__MLA_CHUNK];
        const uint16_t *kb[KV__MLA_CHUNK];
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            const struct mla_tile tl = tiles[task / ng];
            const int64_t s = tl.s, h0 = task % ng * hg;
            const int nh = (int)(hq - h0 < hg ? hq - h0 : hg);
            const int64_t len = j->seq_tokens[s], ql = j->q_start[s + 1] - j->q_start[s];
            const int64_t row0 = j->q_start[s] + tl.i0, p0 = len - ql + tl.i0; /* first query */
            /* rows of the task: r = i * nh + h (query token i of the tile, head h0 + h) */
            for (int64_t i = 0; i < tl.n; i++)
                for (int h = 0; h < nh; h++) {
                    const char *qp =
                        j->q.base + (row0 + i) * j->q.token_stride + (h0 + h) * j->q.head_stride;
                    float *qq = q + (i * nh + h) * D;
                    if (bdot) /* q's bf16 as it is: the scale goes into kmul */
                        for (int64_t d = 0; d < D; d++)
                            memcpy(qb + (i * nh + h) * D + d, qp + d * j->q.dim_stride, 2);
                    else
                        for (int64_t d = 0; d < D; d++)
                            qq[d] =
                                kv_to_f32(j->q.dtype, qp + d * j->q.dim_stride) * j->softmax_scale;
                    m[i * nh + h] = -INFINITY;
                    l[i * nh + h] = 0.0f;
                }
            memset(acc, 0, (size_t)(tl.n * nh * dv) * sizeof(float));
            const int32_t *pages = j->page_ids + j->page_start[s];
            const int64_t t_lo = first_seen(p0, j->window_left), t_hi = p0 + tl.n;
            for (int64_t t0 = t_lo / KV__MLA_CHUNK * KV__MLA_CHUNK; t0 < t_hi;
                 t0 += KV__MLA_CHUNK) {
                const int n = (int)(t_hi - t0 < KV__MLA_CHUNK ? t_hi - t0 : KV__MLA_CHUNK);
                const int c0 = (int)(t_lo > t0 ? t_lo - t0 : 0); /* rows before: no query sees */
                for (int t = c0; t < n; t++) {
                    const int64_t tok = t0 + t;
                    const int64_t slot = kv_attn_page_slot(pages[tok / pt], pt, tok % pt);
                    rows[t] = (const char *)j->cache.base +
                              kv_layout_slot_offset_bytes(lo, j->layer0, 0, slot);
                }
                kv__mla_rows(lo, simd, rows + c0, n - c0, kf + c0 * D, lut);
                if (bdot)
                    kv__mla_rows_bf16(lo, rows + c0, n - c0, kf + c0 * D, kbuf + c0 * D, kb + c0);
                for (int64_t i = 0; i < tl.n; i++) { /* the tokens t0 + a .. t0 + b - 1 */
                    const int64_t p = p0 + i, f = first_seen(p, j->window_left);
                    const int a = (int)(f > t0 ? f - t0 : 0);
                    const int b = (int)(p + 1 - t0 < n ? p + 1 - t0 : n);
                    if (b <= a)
                        continue;
                    const int64_t r = i * nh;
                    const struct kv__mla_bdot bd = {qb + r * D, kb + a, j->softmax_scale * ks};
                    kv__mla_chunk(simd, kf + a * D, b - a, nh, D, dv, q + r * D, ks,
                                  bdot ? &bd : NULL, j->soft_cap, m + r, l + r, acc + r * dv,
                                  sc + a);
                }
            }
            for (int64_t i = 0; i < tl.n; i++)
                for (int h = 0; h < nh; h++) {
                    const int64_t r = i * nh + h;
                    char *op = j->out.base + (row0 + i) * j->out.token_stride +
                               (h0 + h) * j->out.head_stride;
                    const float inv = l[r] != 0.0f ? ks / l[r] : 0.0f;
                    const float *ar = acc + r * dv;
                    for (int64_t d = 0; d < dv; d++)
                        kv_from_f32(j->out.dtype, ar[d] * inv, op + d * j->out.dim_stride);
                    if (j->lse)
                        j->lse[(row0 + i) * j->lse_stride + h0 + h] =
                            l[r] != 0.0f ? m[r] + logf(l[r]) : -INFINITY;
                }
        }
    }
    kv__mem_free(scratch);
    kv__mem_free(tiles);
    return KV_OK;
}

kv_status kv_attn_prefill_mla(struct kv_paged_cache cache, uint32_t layer, const struct kv_view *q,
                              const int32_t *qo_indptr, const struct kv_pages *pages, int64_t dv,
                              float softmax_scale, const struct kv_scales *scales,
                              const struct kv_view *out, const struct kv_attn_opts *opts)
{
    struct kv__attn_job j;
    kv_status st = kv__attn_prefill_mla_check("kv_attn_prefill_mla", &cache, layer, q, qo_indptr,
                                              pages, dv, softmax_scale, scales, out, opts, &j);
    if (st != KV_OK)
        return st;
    st = exec_prefill_mla(&j);
    if (st == KV_OK)
        kv__attn_count(&j, false);
    kv__attn_job_free(&j);
    return st == KV_OK ? kv__ok() : st;
}
