/*
 * kv_attn_cpu.c - the CPU executors of the attention kernels and their public
 * entry points. Each entry runs the kernel's validator (kv_attn_check.c), then
 * the job, in parallel with OpenMP (kv_attn_threads()).
 *
 *   write / read   runs (consecutive slots of one block <-> consecutive
 *                  tokens) x layers, split over threads. A run moves
 *                  [n][H][D]: with equal dtypes and no scales through the
 *                  shared copy plan (kv_view_index.h: dims both sides step
 *                  over contiguously are merged, so a canonical NHD run is
 *                  one memcpy of n*H*D elements and an HND one H memcpys of
 *                  n*D); otherwise row by row through f32 (kv_convert.h).
 *                  The next runs' cache lines are prefetched (decode steps
 *                  scatter single tokens over the pool).
 *   copy           whole blocks as the layout's byte runs (kv_layout_block_runs)
 *   decode         (sequence, KV head) pairs over threads; per pair the g = Hq/H
 *                  queries sharing the head, chunks of 32 tokens: scores,
 *                  one rescale of the online softmax per chunk, then V.
 *                  Cache rows are read in place, converted in registers, the
 *                  scales folded into the score and the weight.
 */
#include <inttypes.h>
#include <math.h>
#include <omp.h>
#include <string.h>

#include "kv_attn_int.h"
#include "kv_convert.h"
#include "kv_mem.h"

#if defined(__GNUC__)
#define KV__INLINE inline __attribute__((always_inline))
#define KV__PREFETCH_W(p) __builtin_prefetch((p), 1, 3)
#else
#define KV__INLINE inline
#define KV__PREFETCH_W(p) ((void)(p))
#endif

/* Work below this many bytes runs on the calling thread (a fork/join costs
 * more than it saves). */
#define KV__PAR_MIN_BYTES ((int64_t)256 << 10)

static int threads_for(int64_t bytes)
{
    return bytes < KV__PAR_MIN_BYTES ? 1 : kv_attn_threads();
}

/* ---- moving [n][H][D] between a tensor and the cache --------------------------- */

/* One side of a move: the address of element [0][0][0] of the run and byte
 * strides over (token, head, d). */
struct kv__side {
    char *p;
    int64_t tok, head, dim;
    kv_dtype dt;
};

/* The shared plan of an equal-dtype move of n tokens (offsets 0). */
static void plan_for(struct kv_copy_plan *pl, const struct kv__side *dst,
                     const struct kv__side *src, int64_t n, int64_t H, int64_t D)
{
    const int64_t es = (int64_t)kv_dtype_size(src->dt);
    struct kv_view_geom sg = {3, {n, H, D}, {src->tok / es, src->head / es, src->dim / es}, 0};
    struct kv_view_geom dg = {3, {n, H, D}, {dst->tok / es, dst->head / es, dst->dim / es}, 0};
    for (int i = 3; i < 8; i++)
        sg.shape[i] = dg.shape[i] = 1, sg.strides[i] = dg.strides[i] = 0;
    if (!kv_copy_plan_build(pl, &sg, &dg, (int32_t)es))
        pl->rows = 0;
}

static KV__INLINE void copy_elem(char *d, const char *s, int64_t es)
{
    switch (es) {
    case 1:
        *d = *s;
        break;
    case 2:
        memcpy(d, s, 2);
        break;
    case 4:
        memcpy(d, s, 4);
        break;
    default:
        memcpy(d, s, 8);
        break;
    }
}

static void run_plan(const struct kv_copy_plan *pl, char *dst, const char *src)
{
    const int64_t es = pl->elem_bytes, n = pl->row_elems;
    if (kv_copy_plan_rows_contiguous(pl)) {
        const size_t rb = (size_t)(n * es);
        if (pl->ndim <= 1) {
            memcpy(dst + pl->dst_offset_bytes, src + pl->src_offset_bytes, rb);
            return;
        }
        for (int64_t r = 0; r < pl->rows; r++) {
            int64_t so, d;
            kv_copy_plan_row(pl, r, &so, &d);
            memcpy(dst + d, src + so, rb);
        }
        return;
    }
    const int64_t ss = kv_copy_plan_src_step(pl), ds = kv_copy_plan_dst_step(pl);
    for (int64_t r = 0; r < pl->rows; r++) {
        int64_t so, d;
        kv_copy_plan_row(pl, r, &so, &d);
        for (int64_t i = 0; i < n; i++)
            copy_elem(dst + d + i * ds, src + so + i * ss, es);
    }
}

/* Element by element through f32: dst = from_f32(to_f32(src) * mul[h]) (mul
 * per head, or mul[0] for every head). */
static void convert_tokens(const struct kv__side *dst, const struct kv__side *src, int64_t n,
                           int64_t H, int64_t D, const float *mul, bool per_head)
{
    const int64_t des = (int64_t)kv_dtype_size(dst->dt), ses = (int64_t)kv_dtype_size(src->dt);
    for (int64_t t = 0; t < n; t++)
        for (int64_t h = 0; h < H; h++) {
            const float m = mul[per_head ? h : 0];
            char *d = dst->p + t * dst->tok + h * dst->head;
            const char *s = src->p + t * src->tok + h * src->head;
            if (dst->dim == des && src->dim == ses) {
                kv_convert_row(dst->dt, d, src->dt, s, D, m);
            } else {
                for (int64_t i = 0; i < D; i++)
                    kv_from_f32(dst->dt, kv_to_f32(src->dt, s + i * src->dim) * m,
                                d + i * dst->dim);
            }
        }
}

/* Plans of equal-dtype moves by run length (lengths up to KV__PLAN_CACHE are
 * built once per call; longer runs build theirs). */
#define KV__PLAN_CACHE 4096
/* Per-head scales of at most this many heads (kv_attn_check refuses more). */
#define KV__MAX_SCALES 1024

struct kv__move_ctx {
    const struct kv__attn_job *j;
    bool to_cache;
    bool bytes;                 /* equal dtypes, no scales: copy bytes */
    struct kv_copy_plan *plans; /* [max_run + 1] when max_run <= KV__PLAN_CACHE */
    float kmul[KV__MAX_SCALES], vmul[KV__MAX_SCALES]; /* 1/scale (write) or scale (read) */
};

static void side_cache(const struct kv__attn_job *j, uint32_t layer, int kv, int64_t slot,
                       struct kv__side *s)
{
    const struct kv_layout *lo = &j->cache.layout;
    s->p = (char *)j->cache.base + kv_attn_slot_offset_bytes(lo, layer, kv, slot);
    s->tok = lo->stride_token_bytes;
    s->head = lo->stride_head_bytes;
    s->dim = lo->stride_dim_bytes;
    s->dt = lo->dtype;
}

static void side_tensor(const struct kv__attn_tensor *t, uint32_t layer_rel, int64_t token,
                        struct kv__side *s)
{
    s->p = t->base + (int64_t)layer_rel * t->layer_stride + token * t->token_stride;
    s->tok = t->token_stride;
    s->head = t->head_stride;
    s->dim = t->dim_stride;
    s->dt = t->dtype;
}

static void move_run(const struct kv__move_ctx *c, const struct kv__attn_run *r, uint32_t lrel)
{
    const struct kv__attn_job *j = c->j;
    const int64_t H = j->cache.layout.num_heads, D = j->cache.layout.head_dim;
    for (int kv = 0; kv < 2; kv++) {
        if (!(kv ? j->has_v : j->has_k))
            continue;
        struct kv__side cs, ts, *dst, *src;
        side_cache(j, j->layer0 + lrel, kv, r->slot, &cs);
        side_tensor(kv ? &j->v : &j->k, lrel, r->token, &ts);
        dst = c->to_cache ? &cs : &ts;
        src = c->to_cache ? &ts : &cs;
        if (c->bytes && dst->dt == src->dt) {
            if (c->plans) {
                run_plan(&c->plans[r->n], dst->p, src->p);
            } else {
                struct kv_copy_plan pl;
                plan_for(&pl, dst, src, r->n, H, D);
                run_plan(&pl, dst->p, src->p);
            }
        } else {
            convert_tokens(dst, src, r->n, H, D, kv ? c->vmul : c->kmul, j->n_scales > 1);
        }
    }
}

/* Prefetch for writing the first lines of run r's cache rows (a decode step
 * writes one token per sequence, scattered over the pool). */
static void prefetch_run(const struct kv__move_ctx *c, const struct kv__attn_run *r, uint32_t lrel)
{
    const struct kv__attn_job *j = c->j;
    const struct kv_layout *lo = &j->cache.layout;
    const int64_t row = lo->head_dim * lo->elem_bytes;
    for (int kv = 0; kv < 2; kv++) {
        const char *p = (const char *)j->cache.base +
                        kv_attn_slot_offset_bytes(lo, j->layer0 + lrel, kv, r->slot);
        for (int64_t h = 0; h < lo->num_heads && h < 16; h++)
            for (int64_t b = 0; b < row && b < 256; b += 64)
                KV__PREFETCH_W(p + h * lo->stride_head_bytes + b);
    }
}

static kv_status exec_move(const struct kv__attn_job *j, bool to_cache)
{
    struct kv__move_ctx c;
    const struct kv_layout *lo = &j->cache.layout;
    const int64_t H = lo->num_heads, D = lo->head_dim;
    c.j = j;
    c.to_cache = to_cache;
    c.plans = NULL;
    c.bytes = j->n_scales == 0 && (!j->has_k || j->k.dtype == lo->dtype) &&
              (!j->has_v || j->v.dtype == lo->dtype);
    const int64_t n_mul = j->n_scales > 1 ? (int64_t)j->n_scales : 1;
    for (int64_t h = 0; h < n_mul; h++) {
        const float ks = j->k_scale ? j->k_scale[h] : 1.0f;
        const float vs = j->v_scale ? j->v_scale[h] : 1.0f;
        c.kmul[h] = to_cache ? 1.0f / ks : ks;
        c.vmul[h] = to_cache ? 1.0f / vs : vs;
    }
    if (c.bytes && j->max_run > 0 && j->max_run <= KV__PLAN_CACHE) {
        c.plans = kv__mem_alloc((size_t)(j->max_run + 1) * sizeof(*c.plans));
        if (c.plans) {
            /* both sides' strides are the same for every run: one plan per
             * length, the sides of the first run standing for all */
            const struct kv__attn_tensor *t = j->has_k ? &j->k : &j->v;
            struct kv__side cs, ts;
            side_cache(j, j->layer0, j->has_k ? 0 : 1, 0, &cs);
            side_tensor(t, 0, 0, &ts);
            if (j->has_k && j->has_v &&
                (j->k.token_stride != j->v.token_stride || j->k.head_stride != j->v.head_stride ||
                 j->k.dim_stride != j->v.dim_stride)) {
                kv__mem_free(c.plans); /* K and V strided differently: plan per run */
                c.plans = NULL;
            } else {
                for (int64_t n = 1; n <= j->max_run; n++)
                    plan_for(&c.plans[n], to_cache ? &cs : &ts, to_cache ? &ts : &cs, n, H, D);
            }
        }
    }
    const int64_t items = j->n_runs * (int64_t)j->n_layers;
    const int64_t bytes =
        items ? items * (j->max_run ? j->max_run : 1) * H * D * lo->elem_bytes * 2 : 0;
    const int nt = threads_for(bytes);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t it = 0; it < items; it++) {
        const int64_t ri = it / j->n_layers;
        const uint32_t lrel = (uint32_t)(it % j->n_layers);
        if (to_cache && it + 2 < items)
            prefetch_run(&c, &j->runs[(it + 2) / j->n_layers], (uint32_t)((it + 2) % j->n_layers));
        move_run(&c, &j->runs[ri], lrel);
    }
    kv__mem_free(c.plans);
    return KV_OK;
}

/* ---- copy blocks -------------------------------------------------------------- */

static void exec_copy(const struct kv__attn_job *j)
{
    const struct kv_layout *lo = &j->cache.layout;
    char *base = j->cache.base;
    struct kv_byte_runs probe;
    if (j->n_copies == 0 || kv_layout_block_runs(lo, 0, &probe) != KV_OK)
        return;
    const int64_t per = probe.run_count; /* the same for every block */
    const int64_t items = (int64_t)j->n_copies * per;
    const int nt = threads_for(items * probe.run_bytes);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t it = 0; it < items; it++) {
        const struct kv_block_copy *cp = &j->copies[it / per];
        const int64_t r = it % per;
        struct kv_byte_runs rs, rd;
        /* ids were validated: block_runs cannot fail */
        kv_status a = kv_layout_block_runs(lo, cp->src, &rs);
        kv_status b = kv_layout_block_runs(lo, cp->dst, &rd);
        if (a == KV_OK && b == KV_OK)
            memcpy(base + rd.first_offset_bytes + r * rd.run_stride_bytes,
                   base + rs.first_offset_bytes + r * rs.run_stride_bytes, (size_t)rs.run_bytes);
    }
}

/* ---- decode attention ------------------------------------------------------------ */

#define KV__CHUNK 32

/* Per-dtype row loads, inlined into the dot product and the V accumulation
 * (switches hoisted out of the inner loops by instantiating each). */
#define KV__LOAD_F32(p, i) (((const float *)(p))[i])
#define KV__LOAD_F16(p, i) kv_f16_to_f32(((const uint16_t *)(p))[i])
#define KV__LOAD_BF16(p, i) kv_bf16_to_f32(((const uint16_t *)(p))[i])
#define KV__LOAD_E4M3(p, i) kv_e4m3_to_f32(((const uint8_t *)(p))[i])
#define KV__LOAD_E5M2(p, i) kv_e5m2_to_f32(((const uint8_t *)(p))[i])

struct kv__dec_tok {
    const void *k, *v; /* rows of the KV head: D elements each */
};

#define KV__DEFINE_CHUNK(NAME, LOAD)                                                               \
    static void NAME(const struct kv__dec_tok *tok, int n, int g, int64_t D, const float *q,       \
                     float kmul, float vmul, float *m, float *l, float *acc, float *sc)            \
    {                                                                                              \
        for (int t = 0; t < n; t++) {                                                              \
            const void *kp = tok[t].k;                                                             \
            for (int qi = 0; qi < g; qi++) {                                                       \
                const float *qq = q + (int64_t)qi * D;                                             \
                float s = 0.0f;                                                                    \
                _Pragma("omp simd reduction(+ : s)") for (int64_t d = 0; d < D; d++) s +=          \
                    qq[d] * LOAD(kp, d);                                                           \
                sc[qi * KV__CHUNK + t] = s * kmul;                                                 \
            }                                                                                      \
        }                                                                                          \
        for (int qi = 0; qi < g; qi++) {                                                           \
            float *sq = sc + qi * KV__CHUNK, mx = m[qi];                                           \
            for (int t = 0; t < n; t++)                                                            \
                mx = sq[t] > mx ? sq[t] : mx;                                                      \
            const float corr = m[qi] == -INFINITY ? 0.0f : expf(m[qi] - mx);                       \
            float sum = 0.0f;                                                                      \
            for (int t = 0; t < n; t++) {                                                          \
                sq[t] = expf(sq[t] - mx);                                                          \
                sum += sq[t];                                                                      \
            }                                                                                      \
            l[qi] = l[qi] * corr + sum;                                                            \
            m[qi] = mx;                                                                            \
            float *a = acc + (int64_t)qi * D;                                                      \
            if (corr != 1.0f) {                                                                    \
                _Pragma("omp simd") for (int64_t d = 0; d < D; d++) a[d] *= corr;                  \
            }                                                                                      \
        }                                                                                          \
        for (int t = 0; t < n; t++) {                                                              \
            const void *vp = tok[t].v;                                                             \
            for (int qi = 0; qi < g; qi++) {                                                       \
                const float w = sc[qi * KV__CHUNK + t] * vmul;                                     \
                float *a = acc + (int64_t)qi * D;                                                  \
                _Pragma("omp simd") for (int64_t d = 0; d < D; d++) a[d] += w * LOAD(vp, d);       \
            }                                                                                      \
        }                                                                                          \
    }

KV__DEFINE_CHUNK(chunk_f32, KV__LOAD_F32)
KV__DEFINE_CHUNK(chunk_f16, KV__LOAD_F16)
KV__DEFINE_CHUNK(chunk_bf16, KV__LOAD_BF16)
KV__DEFINE_CHUNK(chunk_e4m3, KV__LOAD_E4M3)
KV__DEFINE_CHUNK(chunk_e5m2, KV__LOAD_E5M2)

typedef void (*kv__chunk_fn)(const struct kv__dec_tok *, int, int, int64_t, const float *, float,
                             float, float *, float *, float *, float *);

static kv__chunk_fn chunk_for(kv_dtype dt)
{
    switch (dt) {
    case KV_F16:
        return chunk_f16;
    case KV_BF16:
        return chunk_bf16;
    case KV_FP8_E4M3:
        return chunk_e4m3;
    case KV_FP8_E5M2:
        return chunk_e5m2;
    default:
        return chunk_f32;
    }
}

static kv_status exec_decode(const struct kv__attn_job *j)
{
    const struct kv_layout *lo = &j->cache.layout;
    const int64_t H = lo->num_heads, D = lo->head_dim, S = j->n_seqs;
    const int g = (int)(j->q_heads / (uint32_t)H);
    const int64_t pt = j->page_tokens, pairs = S * H;
    const kv__chunk_fn chunk = chunk_for(lo->dtype);
    int64_t total_tokens = 0;
    for (int64_t s = 0; s < S; s++)
        total_tokens += j->seq_tokens[s];
    const int nt = threads_for(total_tokens * H * D * lo->elem_bytes * 2);
    /* per thread: q [g][D], acc [g][D], scores [g][CHUNK], m [g], l [g] */
    const size_t per = (size_t)(2 * g * D + g * KV__CHUNK + 2 * g) * sizeof(float);
    float *scratch = kv__mem_alloc_aligned(64, per * (size_t)nt + 64);
    if (!scratch)
        return kv__error(KV_ERR_NO_MEMORY, "kv_attn_decode: %zu bytes of scratch", per * nt);
#pragma omp parallel num_threads(nt)
    {
        float *q = scratch + (size_t)omp_get_thread_num() * (per / sizeof(float));
        float *acc = q + g * D, *sc = acc + g * D, *m = sc + g * KV__CHUNK, *l = m + g;
        struct kv__dec_tok tok[KV__CHUNK];
#pragma omp for schedule(dynamic, 4)
        for (int64_t pair = 0; pair < pairs; pair++) {
            const int64_t s = pair / H, h = pair % H;
            const float ks = j->k_scale ? j->k_scale[j->n_scales == 1 ? 0 : h] : 1.0f;
            const float vs = j->v_scale ? j->v_scale[j->n_scales == 1 ? 0 : h] : 1.0f;
            for (int qi = 0; qi < g; qi++) {
                const char *qp =
                    j->q.base + s * j->q.token_stride + (h * g + qi) * j->q.head_stride;
                for (int64_t d = 0; d < D; d++)
                    q[qi * D + d] =
                        kv_to_f32(j->q.dtype, qp + d * j->q.dim_stride) * j->softmax_scale;
                m[qi] = -INFINITY;
                l[qi] = 0.0f;
            }
            memset(acc, 0, (size_t)g * (size_t)D * sizeof(float));
            int n = 0;
            int64_t left = j->seq_tokens[s];
            for (int64_t pj = j->page_start[s]; pj < j->page_start[s + 1] && left > 0; pj++) {
                const int64_t in_page = left < pt ? left : pt;
                for (int64_t i = 0; i < in_page; i++) {
                    const int64_t slot = kv_attn_page_slot(j->page_ids[pj], pt, i);
                    const char *kb = (const char *)j->cache.base +
                                     kv_attn_slot_offset_bytes(lo, j->layer0, 0, slot) +
                                     h * lo->stride_head_bytes;
                    tok[n].k = kb;
                    tok[n].v = kb + lo->stride_kv_bytes;
                    if (++n == KV__CHUNK) {
                        chunk(tok, n, g, D, q, ks, vs, m, l, acc, sc);
                        n = 0;
                    }
                }
                left -= in_page;
            }
            if (n)
                chunk(tok, n, g, D, q, ks, vs, m, l, acc, sc);
            for (int qi = 0; qi < g; qi++) {
                char *op =
                    j->out.base + s * j->out.token_stride + (h * g + qi) * j->out.head_stride;
                const float inv = l[qi] > 0.0f ? 1.0f / l[qi] : 0.0f; /* no tokens: zeros */
                for (int64_t d = 0; d < D; d++)
                    kv_from_f32(j->out.dtype, acc[qi * D + d] * inv, op + d * j->out.dim_stride);
            }
        }
    }
    kv__mem_free(scratch);
    return KV_OK;
}

/* ---- public entry points ------------------------------------------------------- */

kv_status kv_attn_write(struct kv_paged_cache cache, int32_t layer, const struct kv_view *k,
                        const struct kv_view *v, const int64_t *slots, int64_t n_slots,
                        const struct kv_scales *scales)
{
    struct kv__attn_job j;
    kv_status st =
        kv__attn_write_check("kv_attn_write", &cache, layer, k, v, slots, n_slots, scales, &j);
    if (st != KV_OK)
        return st;
    st = exec_move(&j, true);
    if (st == KV_OK)
        kv__attn_count(&j, false);
    kv__attn_job_free(&j);
    return st == KV_OK ? kv__ok() : st;
}

kv_status kv_attn_read(struct kv_paged_cache cache, int32_t layer, const struct kv_pages *pages,
                       const struct kv_view *k_out, const struct kv_view *v_out,
                       const struct kv_scales *scales)
{
    struct kv__attn_job j;
    kv_status st =
        kv__attn_read_check("kv_attn_read", &cache, layer, pages, k_out, v_out, scales, &j);
    if (st != KV_OK)
        return st;
    st = exec_move(&j, false);
    if (st == KV_OK)
        kv__attn_count(&j, false);
    kv__attn_job_free(&j);
    return st == KV_OK ? kv__ok() : st;
}

kv_status kv_attn_copy_blocks(struct kv_paged_cache cache, const struct kv_block_copy *copies,
                              uint32_t n_copies)
{
    struct kv__attn_job j;
    kv_status st = kv__attn_copy_check("kv_attn_copy_blocks", &cache, copies, n_copies, &j);
    if (st != KV_OK)
        return st;
    exec_copy(&j);
    kv__attn_count(&j, false);
    kv__copy_count(KV_COPY_BLOCK_COPY, (uint64_t)n_copies * (uint64_t)cache.layout.kv_planes *
                                           (uint64_t)cache.layout.num_layers *
                                           (uint64_t)cache.layout.block_bytes);
    kv__attn_job_free(&j);
    return kv__ok();
}

kv_status kv_attn_decode(struct kv_paged_cache cache, uint32_t layer, const struct kv_view *q,
                         const struct kv_pages *pages, float softmax_scale,
                         const struct kv_scales *scales, const struct kv_view *out)
{
    struct kv__attn_job j;
    kv_status st = kv__attn_decode_check("kv_attn_decode", &cache, layer, q, pages, softmax_scale,
                                         scales, out, &j);
    if (st != KV_OK)
        return st;
    st = exec_decode(&j);
    if (st == KV_OK)
        kv__attn_count(&j, false);
    kv__attn_job_free(&j);
    return st == KV_OK ? kv__ok() : st;
}
