/*
 * kv_attn_cpu.c - the CPU executors of the attention kernels and their public
 * entry points. Each entry runs the kernel's validator (kv_attn_check.c), then
 * the job, in parallel with OpenMP (kv_threads()).
 *
 *   write / read   runs (consecutive slots of one block <-> consecutive
 *                  tokens) x layers, split over threads. A run moves
 *                  [n][H][D]: with equal dtypes and no scales through the
 *                  shared copy plan (kv_view_hd.h: dims both sides step
 *                  over contiguously are merged, so a canonical NHD run is
 *                  one memcpy of n*H*D elements and an HND one H memcpys of
 *                  n*D); otherwise row by row through f32 (kv_convert_hd.h).
 *                  The next runs' cache lines are prefetched (decode steps
 *                  scatter single tokens over the pool).
 *   copy           whole blocks as the layout's byte runs (kv_layout_block_runs)
 *   decode         (sequence, group of KV heads) tasks over threads (a group
 *                  of several heads where a token's head rows are adjacent,
 *                  NHD, so its whole row is read at once); per head the
 *                  g = Hq/H queries sharing it, chunks of 32 tokens: scores,
 *                  one rescale of the online softmax per chunk, then V.
 *                  Cache rows are read in place, converted in registers, the
 *                  scales folded into the score and the weight.
 */
#include <inttypes.h>
#include <math.h>
#include <omp.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#define KV__HAVE_SSE2_NT 1
#else
#define KV__HAVE_SSE2_NT 0
#endif

#include "kv_attn_int.h"
#include "kv_convert_hd.h"
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
    return bytes < KV__PAR_MIN_BYTES ? 1 : kv_threads();
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

/* Moves of at least this many bytes in one call store with non-temporal
 * (streaming) stores where both the row and its destination are 16-byte
 * aligned: the destination (a pool of GiBs, or a large output) is not read
 * back before it leaves the cache anyway, and streaming saves the read for
 * ownership of every destination line, the difference between a plain store
 * loop and memcpy's own large-copy path. Smaller calls (a decode step of a
 * few sequences) keep their lines in cache for the attention that follows. */
#define KV__NT_MIN_BYTES ((int64_t)8 << 20)

static int64_t kv__nt_min = KV__NT_MIN_BYTES;
static bool kv__portable;

void kv__attn_test_tune(int64_t nt_min_bytes, bool portable)
{
    kv__nt_min = nt_min_bytes < 0 ? KV__NT_MIN_BYTES : nt_min_bytes;
    kv__portable = portable;
}

/* Copy n bytes with streaming stores (dst and n multiples of 16). */
static KV__INLINE void copy_stream(char *d, const char *s, size_t n)
{
#if KV__HAVE_SSE2_NT
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        const __m128i a = _mm_loadu_si128((const __m128i *)(const void *)(s + i));
        const __m128i b = _mm_loadu_si128((const __m128i *)(const void *)(s + i + 16));
        const __m128i c = _mm_loadu_si128((const __m128i *)(const void *)(s + i + 32));
        const __m128i e = _mm_loadu_si128((const __m128i *)(const void *)(s + i + 48));
        _mm_stream_si128((__m128i *)(void *)(d + i), a);
        _mm_stream_si128((__m128i *)(void *)(d + i + 16), b);
        _mm_stream_si128((__m128i *)(void *)(d + i + 32), c);
        _mm_stream_si128((__m128i *)(void *)(d + i + 48), e);
    }
    for (; i < n; i += 16)
        _mm_stream_si128((__m128i *)(void *)(d + i),
                         _mm_loadu_si128((const __m128i *)(const void *)(s + i)));
#else
    memcpy(d, s, n);
#endif
}

/* Make this thread's streaming stores visible before the kernel returns. */
static KV__INLINE void stream_fence(void)
{
#if KV__HAVE_SSE2_NT
    _mm_sfence();
#endif
}

static void run_plan(const struct kv_copy_plan *pl, char *dst, const char *src, bool nt)
{
    const int64_t es = pl->elem_bytes, n = pl->row_elems;
    if (kv_copy_plan_rows_contiguous(pl)) {
        const size_t rb = (size_t)(n * es);
        nt = nt && KV__HAVE_SSE2_NT && rb % 16 == 0;
        if (pl->ndim <= 1) {
            char *d = dst + pl->dst_offset_bytes;
            if (nt && (uintptr_t)d % 16 == 0)
                copy_stream(d, src + pl->src_offset_bytes, rb);
            else
                memcpy(d, src + pl->src_offset_bytes, rb);
            return;
        }
        if (pl->ndim <= 3) { /* [rows0][rows1] of contiguous rows: no index division */
            const int64_t n0 = pl->ndim == 3 ? pl->shape[0] : 1;
            const int64_t n1 = pl->shape[pl->ndim - 2];
            const int64_t ss0 = pl->ndim == 3 ? pl->src_strides_bytes[0] : 0;
            const int64_t ds0 = pl->ndim == 3 ? pl->dst_strides_bytes[0] : 0;
            const int64_t ss1 = pl->src_strides_bytes[pl->ndim - 2];
            const int64_t ds1 = pl->dst_strides_bytes[pl->ndim - 2];
            for (int64_t a = 0; a < n0; a++) {
                const char *sp = src + pl->src_offset_bytes + a * ss0;
                char *dp = dst + pl->dst_offset_bytes + a * ds0;
                if (nt && ((uintptr_t)dp % 16 | (uintptr_t)ds1 % 16) == 0) {
                    for (int64_t b = 0; b < n1; b++)
                        copy_stream(dp + b * ds1, sp + b * ss1, rb);
                } else {
                    for (int64_t b = 0; b < n1; b++)
                        memcpy(dp + b * ds1, sp + b * ss1, rb);
                }
            }
            return;
        }
        for (int64_t r = 0; r < pl->rows; r++) {
            int64_t so, d;
            kv_copy_plan_row(pl, r, &so, &d);
            if (nt && (uintptr_t)(dst + d) % 16 == 0)
                copy_stream(dst + d, src + so, rb);
            else
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

/* The tokens of one side of a call that does not move every side as bytes:
 * its bytes when raw (no scales, the tensor's dtype the cache's: the other
 * side converts), otherwise element by element through f32,
 * dst = from_f32(kv_apply_scale(to_f32(src), scale[h], quantize)) (scale per
 * head, or scale[0] for every head; 1 without scales). */
static void convert_tokens(const struct kv__side *dst, const struct kv__side *src, int64_t n,
                           int64_t H, int64_t D, const float *scale, bool per_head, bool quantize,
                           bool raw)
{
    const int64_t des = (int64_t)kv_dtype_size(dst->dt), ses = (int64_t)kv_dtype_size(src->dt);
    const bool rows = dst->dim == des && src->dim == ses;
    for (int64_t t = 0; t < n; t++)
        for (int64_t h = 0; h < H; h++) {
            const float sc = scale[per_head ? h : 0];
            char *d = dst->p + t * dst->tok + h * dst->head;
            const char *s = src->p + t * src->tok + h * src->head;
            if (raw && rows) {
                memcpy(d, s, (size_t)(D * des));
            } else if (raw) {
                for (int64_t i = 0; i < D; i++)
                    copy_elem(d + i * dst->dim, s + i * src->dim, des);
            } else if (rows) {
                kv_convert_row(dst->dt, d, src->dt, s, D, sc, quantize);
            } else {
                for (int64_t i = 0; i < D; i++)
                    kv_from_f32(dst->dt,
                                kv_apply_scale(kv_to_f32(src->dt, s + i * src->dim), sc, quantize),
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
    bool raw[2];                /* K, V: no scales and the cache's dtype (its bytes) */
    bool nt;                    /* a large move: streaming stores (KV__NT_MIN_BYTES) */
    struct kv_copy_plan *plans; /* [max_run + 1] when max_run <= KV__PLAN_CACHE */
    float kscale[KV__MAX_SCALES], vscale[KV__MAX_SCALES]; /* 1 without scales */
};

static void side_cache(const struct kv__attn_job *j, uint32_t layer, int kv, int64_t slot,
                       struct kv__side *s)
{
    const struct kv_layout *lo = &j->cache.layout;
    s->p = (char *)j->cache.base + kv_layout_slot_offset_bytes(lo, layer, kv, slot);
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
                run_plan(&c->plans[r->n], dst->p, src->p, c->nt);
            } else {
                struct kv_copy_plan pl;
                plan_for(&pl, dst, src, r->n, H, D);
                run_plan(&pl, dst->p, src->p, c->nt);
            }
        } else {
            convert_tokens(dst, src, r->n, H, D, kv ? c->vscale : c->kscale, j->n_scales > 1,
                           c->to_cache, c->raw[kv]);
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
                        kv_layout_slot_offset_bytes(lo, j->layer0 + lrel, kv, r->slot);
        for (int64_t h = 0; h < lo->num_heads && h < 16; h++)
            for (int64_t b = 0; b < row && b < 256; b += 64)
                KV__PREFETCH_W(p + h * lo->stride_head_bytes + b);
    }
}

static kv_status exec_move(const struct kv__attn_job *j, bool to_cache)
{
    if (j->scale_layer_stride && j->n_layers > 1) { /* scales per layer: a layer at a time */
        for (uint32_t l = 0; l < j->n_layers; l++) {
            struct kv__attn_job one;
            kv__attn_job_layer(j, l, &one);
            const kv_status st = exec_move(&one, to_cache);
            if (st != KV_OK)
                return st;
        }
        return KV_OK;
    }
    struct kv__move_ctx c;
    const struct kv_layout *lo = &j->cache.layout;
    const int64_t H = lo->num_heads, D = lo->head_dim;
    c.j = j;
    c.to_cache = to_cache;
    c.plans = NULL;
    c.raw[0] = j->n_scales == 0 && j->k.dtype == lo->dtype;
    c.raw[1] = j->n_scales == 0 && j->v.dtype == lo->dtype;
    c.bytes = (!j->has_k || c.raw[0]) && (!j->has_v || c.raw[1]);
    const int64_t n_sc = j->n_scales > 1 ? (int64_t)j->n_scales : 1;
    for (int64_t h = 0; h < n_sc; h++) {
        c.kscale[h] = j->k_scale ? j->k_scale[h] : 1.0f;
        c.vscale[h] = j->v_scale ? j->v_scale[h] : 1.0f;
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
    c.nt = bytes >= kv__nt_min;
#pragma omp parallel num_threads(nt)
    {
#pragma omp for schedule(static) nowait
        for (int64_t it = 0; it < items; it++) {
            const int64_t ri = it / j->n_layers;
            const uint32_t lrel = (uint32_t)(it % j->n_layers);
            if (to_cache && !c.nt && it + 2 < items)
                prefetch_run(&c, &j->runs[(it + 2) / j->n_layers],
                             (uint32_t)((it + 2) % j->n_layers));
            move_run(&c, &j->runs[ri], lrel);
        }
        if (c.nt)
            stream_fence();
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

/* ---- the AVX2/FMA chunk (x86-64, chosen at run time) ------------------------------
 * The same computation as KV__DEFINE_CHUNK for f32, f16 and bf16 caches and
 * D a multiple of 8, written for 8-lane registers: the scores of up to four
 * queries sharing a KV head come from one load and conversion of each K
 * row; the V accumulation keeps four queries' accumulators of one 8-wide
 * slice in registers across the chunk's tokens, so each V slice is loaded
 * and converted once. The online softmax is the portable one. */
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#define KV__HAVE_AVX2 1
#define KV__AVX2 __attribute__((target("avx2,fma,f16c")))

KV__AVX2 static inline __m256 ld8_f32(const void *p)
{
    return _mm256_loadu_ps((const float *)p);
}
KV__AVX2 static inline __m256 ld8_f16(const void *p)
{
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
KV__AVX2 static inline __m256 ld8_bf16(const void *p)
{
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
KV__AVX2 static inline float hsum8(__m256 v)
{
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

/* e^x for x <= 0 (a score minus the running max), 8 lanes: x = k ln2 + r,
 * |r| <= ln2 / 2, e^r by a degree-6 polynomial (relative error below 2e-7,
 * a few float ulps), times 2^k through the exponent bits; x < -87 gives 0
 * (as expf underflows there). */
KV__AVX2 static inline __m256 exp8_nonpos(__m256 x)
{
    const __m256 lo = _mm256_set1_ps(-87.0f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(k, _mm256_set1_ps(1.428606765330187045e-06f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* softmax bookkeeping of one chunk (scores sc[qi][t] in place -> weights
 * times vmul; acc rescaled), shared by the AVX2 chunks */
KV__AVX2 static void chunk_softmax(int n, int g, int64_t D, float vmul, float *m, float *l,
                                   float *acc, float *sc)
{
    for (int qi = 0; qi < g; qi++) {
        float *sq = sc + qi * KV__CHUNK, mx = m[qi];
        for (int t = 0; t < n; t++)
            mx = sq[t] > mx ? sq[t] : mx;
        const float corr = m[qi] == -INFINITY ? 0.0f : expf(m[qi] - mx);
        float sum = 0.0f;
        int t = 0;
        if (n == KV__CHUNK) {
            const __m256 mx8 = _mm256_set1_ps(mx), vm8 = _mm256_set1_ps(vmul);
            __m256 s8 = _mm256_setzero_ps();
            for (; t < KV__CHUNK; t += 8) {
                const __m256 e8 = exp8_nonpos(_mm256_sub_ps(_mm256_loadu_ps(sq + t), mx8));
                s8 = _mm256_add_ps(s8, e8);
                _mm256_storeu_ps(sq + t, _mm256_mul_ps(e8, vm8));
            }
            sum = hsum8(s8);
        }
        for (; t < n; t++) {
            sq[t] = expf(sq[t] - mx);
            sum += sq[t];
            sq[t] *= vmul;
        }
        l[qi] = l[qi] * corr + sum;
        m[qi] = mx;
        if (corr != 1.0f) {
            float *a = acc + (int64_t)qi * D;
            const __m256 c8 = _mm256_set1_ps(corr);
            for (int64_t d = 0; d < D; d += 8)
                _mm256_storeu_ps(a + d, _mm256_mul_ps(_mm256_loadu_ps(a + d), c8));
        }
    }
}

#define KV__DEFINE_CHUNK_AVX2(NAME, LD8, ES)                                                       \
    KV__AVX2 static void NAME(const struct kv__dec_tok *tok, int n, int g, int64_t D,              \
                              const float *q, float kmul, float vmul, float *m, float *l,          \
                              float *acc, float *sc)                                               \
    {                                                                                              \
        for (int t = 0; t < n; t++) {                                                              \
            const char *kp = (const char *)tok[t].k;                                               \
            int q0 = 0;                                                                            \
            for (; q0 + 4 <= g; q0 += 4) {                                                         \
                const float *qa = q + (int64_t)q0 * D;                                             \
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                        \
                for (int64_t d = 0; d < D; d += 8) {                                               \
                    const __m256 k8 = LD8(kp + d * (ES));                                          \
                    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qa + d), k8, a0);                         \
                    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qa + D + d), k8, a1);                     \
                    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(qa + 2 * D + d), k8, a2);                 \
                    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(qa + 3 * D + d), k8, a3);                 \
                }                                                                                  \
                sc[(q0 + 0) * KV__CHUNK + t] = hsum8(a0) * kmul;                                   \
                sc[(q0 + 1) * KV__CHUNK + t] = hsum8(a1) * kmul;                                   \
                sc[(q0 + 2) * KV__CHUNK + t] = hsum8(a2) * kmul;                                   \
                sc[(q0 + 3) * KV__CHUNK + t] = hsum8(a3) * kmul;                                   \
            }                                                                                      \
            for (; q0 < g; q0++) {                                                                 \
                const float *qa = q + (int64_t)q0 * D;                                             \
                __m256 a0 = _mm256_setzero_ps();                                                   \
                for (int64_t d = 0; d < D; d += 8)                                                 \
                    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qa + d), LD8(kp + d * (ES)), a0);         \
                sc[q0 * KV__CHUNK + t] = hsum8(a0) * kmul;                                         \
            }                                                                                      \
        }                                                                                          \
        chunk_softmax(n, g, D, vmul, m, l, acc, sc);                                               \
        int q0 = 0;                                                                                \
        for (; q0 + 4 <= g; q0 += 4) {                                                             \
            float *ac = acc + (int64_t)q0 * D;                                                     \
            const float *w0 = sc + q0 * KV__CHUNK;                                                 \
            for (int64_t d = 0; d < D; d += 8) {                                                   \
                __m256 a0 = _mm256_loadu_ps(ac + d), a1 = _mm256_loadu_ps(ac + D + d);             \
                __m256 a2 = _mm256_loadu_ps(ac + 2 * D + d), a3 = _mm256_loadu_ps(ac + 3 * D + d); \
                for (int t = 0; t < n; t++) {                                                      \
                    const __m256 v8 = LD8((const char *)tok[t].v + d * (ES));                      \
                    a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(w0 + t), v8, a0);                     \
                    a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(w0 + KV__CHUNK + t), v8, a1);         \
                    a2 = _mm256_fmadd_ps(_mm256_broadcast_ss(w0 + 2 * KV__CHUNK + t), v8, a2);     \
                    a3 = _mm256_fmadd_ps(_mm256_broadcast_ss(w0 + 3 * KV__CHUNK + t), v8, a3);     \
                }                                                                                  \
                _mm256_storeu_ps(ac + d, a0);                                                      \
                _mm256_storeu_ps(ac + D + d, a1);                                                  \
                _mm256_storeu_ps(ac + 2 * D + d, a2);                                              \
                _mm256_storeu_ps(ac + 3 * D + d, a3);                                              \
            }                                                                                      \
        }                                                                                          \
        for (; q0 < g; q0++) {                                                                     \
            float *ac = acc + (int64_t)q0 * D;                                                     \
            const float *w0 = sc + q0 * KV__CHUNK;                                                 \
            for (int64_t d = 0; d < D; d += 8) {                                                   \
                __m256 a0 = _mm256_loadu_ps(ac + d);                                               \
                for (int t = 0; t < n; t++)                                                        \
                    a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(w0 + t),                              \
                                         LD8((const char *)tok[t].v + d * (ES)), a0);              \
                _mm256_storeu_ps(ac + d, a0);                                                      \
            }                                                                                      \
        }                                                                                          \
    }

KV__DEFINE_CHUNK_AVX2(chunk_avx2_f32, ld8_f32, 4)
KV__DEFINE_CHUNK_AVX2(chunk_avx2_f16, ld8_f16, 2)
KV__DEFINE_CHUNK_AVX2(chunk_avx2_bf16, ld8_bf16, 2)

static bool cpu_has_avx2(void)
{
    static int has = -1; /* benign race: every thread computes the same value */
    if (has < 0) {
        __builtin_cpu_init();
        /* F16C from CPUID leaf 1 (ECX bit 29): clang before 15 has no "f16c"
         * feature string for __builtin_cpu_supports */
        unsigned a, b, c, d;
        const bool f16c = __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29));
        has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
    }
    return has == 1;
}
#else
#define KV__HAVE_AVX2 0
#endif

bool kv__attn_decode_simd(kv_dtype dt, int64_t D)
{
#if KV__HAVE_AVX2
    return !kv__portable && D % 8 == 0 && (dt == KV_F32 || dt == KV_F16 || dt == KV_BF16) &&
           cpu_has_avx2();
#else
    (void)dt, (void)D;
    return false;
#endif
}

static kv__chunk_fn chunk_for(kv_dtype dt, int64_t D)
{
#if KV__HAVE_AVX2
    if (kv__attn_decode_simd(dt, D))
        return dt == KV_F32 ? chunk_avx2_f32 : dt == KV_F16 ? chunk_avx2_f16 : chunk_avx2_bf16;
#endif
    (void)D;
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

/* Most KV heads a decode task groups (docs/kernels.md). */
#define KV__HEAD_GROUP_MAX 16

/* One chunk of n tokens for each of the hb heads h0.. of a task: tok holds
 * head h0's rows; head h0 + hi's are hi head strides further. */
static void decode_group(const struct kv__attn_job *j, kv__chunk_fn chunk,
                         const struct kv__dec_tok *tok, struct kv__dec_tok *th, int n, int64_t hb,
                         int64_t h0, int g, const float *q, float *m, float *l, float *acc,
                         float *sc)
{
    const int64_t D = j->cache.layout.head_dim, hs = j->cache.layout.stride_head_bytes;
    for (int64_t hi = 0; hi < hb; hi++) {
        const int64_t h = h0 + hi;
        const float ks = j->k_scale ? j->k_scale[j->n_scales == 1 ? 0 : h] : 1.0f;
        const float vs = j->v_scale ? j->v_scale[j->n_scales == 1 ? 0 : h] : 1.0f;
        const struct kv__dec_tok *use = tok;
        if (hi > 0) {
            for (int t = 0; t < n; t++) {
                th[t].k = (const char *)tok[t].k + hi * hs;
                th[t].v = (const char *)tok[t].v + hi * hs;
            }
            use = th;
        }
        chunk(use, n, g, D, q + hi * g * D, ks, vs, m + hi * g, l + hi * g, acc + hi * g * D, sc);
    }
}

static kv_status exec_decode(const struct kv__attn_job *j)
{
    const struct kv_layout *lo = &j->cache.layout;
    const int64_t H = lo->num_heads, D = lo->head_dim, S = j->n_seqs;
    const int g = (int)(j->q_heads / (uint32_t)H);
    const int64_t pt = j->page_tokens, rowb = D * lo->elem_bytes;
    const kv__chunk_fn chunk = chunk_for(lo->dtype, D);
    int64_t total_tokens = 0;
    for (int64_t s = 0; s < S; s++)
        total_tokens += j->seq_tokens[s];
    const int nt = threads_for(total_tokens * H * D * lo->elem_bytes * 2);
    /* A task is a sequence and a group of hb KV heads. Where a token's head
     * rows are adjacent (NHD), the group is as many heads as still leave 4
     * tasks a thread, so a token's whole row (H x D elements) is read at
     * once instead of D elements every token stride; otherwise (HND: a
     * head's rows of a block are adjacent already) one head. */
    int64_t hb = 1;
    if (lo->stride_head_bytes == rowb)
        for (hb = H < KV__HEAD_GROUP_MAX ? H : KV__HEAD_GROUP_MAX; hb > 1; hb--)
            if (H % hb == 0 && S * (H / hb) >= 4 * (int64_t)nt)
                break;
    const int64_t tasks = S * (H / hb), ghd = (int64_t)g * D;
    /* per thread: q [hb][g][D], acc [hb][g][D], m [hb][g], l [hb][g],
     * scores [g][CHUNK] */
    const size_t per = (size_t)(2 * hb * ghd + 2 * hb * g + g * KV__CHUNK) * sizeof(float);
    float *scratch = kv__mem_alloc_aligned(64, per * (size_t)nt + 64);
    if (!scratch)
        return kv__error(KV_ERR_NO_MEMORY, "kv_attn_decode: %zu bytes of scratch", per * nt);
#pragma omp parallel num_threads(nt)
    {
        float *q = scratch + (size_t)omp_get_thread_num() * (per / sizeof(float));
        float *acc = q + hb * ghd, *m = acc + hb * ghd, *l = m + hb * g, *sc = l + hb * g;
        struct kv__dec_tok tok[2][KV__CHUNK]; /* the chunk computed, the next one fetched */
        struct kv__dec_tok th[KV__CHUNK];     /* the chunk's rows of one head of the group */
#pragma omp for schedule(dynamic, 4)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t s = task / (H / hb), h0 = task % (H / hb) * hb;
            for (int64_t hi = 0; hi < hb; hi++)
                for (int qi = 0; qi < g; qi++) {
                    const char *qp =
                        j->q.base + s * j->q.token_stride + ((h0 + hi) * g + qi) * j->q.head_stride;
                    float *qq = q + hi * ghd + (int64_t)qi * D;
                    for (int64_t d = 0; d < D; d++)
                        qq[d] = kv_to_f32(j->q.dtype, qp + d * j->q.dim_stride) * j->softmax_scale;
                    m[hi * g + qi] = -INFINITY;
                    l[hi * g + qi] = 0.0f;
                }
            memset(acc, 0, (size_t)(hb * ghd) * sizeof(float));
            /* tokens in chunks of KV__CHUNK: chunk c+1's rows (every head of
             * the group) are gathered and prefetched before chunk c is
             * computed, head after head */
            int n = 0, cur = 0, ready = 0;
            int64_t left = j->seq_tokens[s];
            for (int64_t pj = j->page_start[s]; pj < j->page_start[s + 1] && left > 0; pj++) {
                const int64_t in_page = left < pt ? left : pt;
                for (int64_t i = 0; i < in_page; i++) {
                    const int64_t slot = kv_attn_page_slot(j->page_ids[pj], pt, i);
                    const char *kb = (const char *)j->cache.base +
                                     kv_layout_slot_offset_bytes(lo, j->layer0, 0, slot) +
                                     h0 * lo->stride_head_bytes;
                    struct kv__dec_tok *tt = &tok[cur ^ 1][n];
                    tt->k = kb;
                    tt->v = kb + lo->stride_kv_bytes;
                    for (int64_t b = 0; b < hb * rowb; b += 64) { /* hb > 1: rows adjacent */
                        __builtin_prefetch(kb + b, 0, 3);
                        __builtin_prefetch(kb + lo->stride_kv_bytes + b, 0, 3);
                    }
                    if (++n == KV__CHUNK) {
                        if (ready)
                            decode_group(j, chunk, tok[cur], th, ready, hb, h0, g, q, m, l, acc,
                                         sc);
                        cur ^= 1;
                        ready = n;
                        n = 0;
                    }
                }
                left -= in_page;
            }
            if (ready)
                decode_group(j, chunk, tok[cur], th, ready, hb, h0, g, q, m, l, acc, sc);
            if (n)
                decode_group(j, chunk, tok[cur ^ 1], th, n, hb, h0, g, q, m, l, acc, sc);
            for (int64_t hi = 0; hi < hb; hi++)
                for (int qi = 0; qi < g; qi++) {
                    char *op = j->out.base + s * j->out.token_stride +
                               ((h0 + hi) * g + qi) * j->out.head_stride;
                    const float lq = l[hi * g + qi];
                    const float inv = lq > 0.0f ? 1.0f / lq : 0.0f; /* no tokens: zeros */
                    const float *aq = acc + hi * ghd + (int64_t)qi * D;
                    for (int64_t d = 0; d < D; d++)
                        kv_from_f32(j->out.dtype, aq[d] * inv, op + d * j->out.dim_stride);
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
