/*
 * kv_attn_cpu.c - the CPU executors of write, read and copy-blocks and their
 * public entry points (decode: kv_attn_cpu_decode.c). Each entry runs the
 * kernel's validator (kv_attn_check.c), then the job, in parallel with
 * OpenMP (kv_threads()).
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
 *   copy           whole blocks as the layout's byte runs (kv_layout_block_runs);
 *                  a layer range, one plane or two caches per storage block
 *                  (packed K|V with one plane: per half head row)
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
#include "kv_stream.h"

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

int kv__attn_threads_for(int64_t bytes)
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
bool kv__attn_portable;

void kv__attn_test_tune(int64_t nt_min_bytes, bool portable)
{
    kv__nt_min = nt_min_bytes < 0 ? KV__NT_MIN_BYTES : nt_min_bytes;
    kv__attn_portable = portable;
}

/* Copy n bytes with streaming stores (dst and n multiples of 16). */
static KV__INLINE void copy_stream(char *d, const char *s, size_t n)
{
#if KV__HAVE_SSE2_NT
    size_t i = 0;
    for (; i + 64 <= n; i += 64)
        kv__stream64(d + i, s + i);
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
    kv__stream_fence();
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
    const int nt = kv__attn_threads_for(bytes);
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
    const int nt = kv__attn_threads_for(items * probe.run_bytes);
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

/* A copy of layers and planes, within one cache or between two of one block
 * format: one item per (copy, layer, storage block moved). Whole storage
 * blocks move as one memcpy each (their in-block bytes are the same on both
 * sides); one plane of a packed K|V block moves as N x H half rows. */
static void exec_copy_ex(const struct kv__attn_job *j)
{
    const struct kv_layout *dl = &j->cache.layout, *sl = &j->src.layout;
    char *dbase = j->cache.base;
    const char *sbase = j->src.base;
    const bool halves = dl->kv_packed && j->planes != KV_ATTN_PLANES_KV;
    /* storage blocks per (copy, layer): unpacked, one per plane moved */
    const int64_t units = dl->kv_packed ? 1 : (j->planes == KV_ATTN_PLANES_KV ? 2 : 1);
    const int kv0 = j->planes == KV_ATTN_PLANE_V ? 1 : 0;
    const int64_t per_copy = (int64_t)j->n_layers * units;
    const int64_t items = (int64_t)j->n_copies * per_copy;
    const int64_t N = dl->block_tokens, H = dl->num_heads;
    const size_t half = (size_t)(dl->head_dim * dl->elem_bytes);
    const int nt = kv__attn_threads_for((int64_t)kv__attn_copy_bytes(j));
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t it = 0; it < items; it++) {
        const struct kv_block_copy *cp = &j->copies[it / per_copy];
        const int64_t r = it % per_copy;
        const uint32_t l = j->layer0 + (uint32_t)(r / units);
        /* unpacked: the plane of this unit; packed halves: the half's offset
         * in each head row (stride_kv is D there); packed whole: 0 */
        const int kv = halves ? kv0 : (dl->kv_packed ? 0 : kv0 + (int)(r % units));
        const int64_t so = kv_layout_slot_offset_bytes(sl, l, kv, (int64_t)cp->src * N);
        const int64_t dof = kv_layout_slot_offset_bytes(dl, l, kv, (int64_t)cp->dst * N);
        if (!halves) {
            memcpy(dbase + dof, sbase + so, (size_t)dl->block_bytes);
            continue;
        }
        for (int64_t n = 0; n < N; n++)
            for (int64_t h = 0; h < H; h++) {
                const int64_t in = n * dl->stride_token_bytes + h * dl->stride_head_bytes;
                memcpy(dbase + dof + in, sbase + so + in, half);
            }
    }
}

/* ---- public entry points ------------------------------------------------------- */

/* kv_attn_write and kv_attn_write_i32: one validator, one executor; only
 * the slots' index width differs. */
static kv_status write_slots(const char *fn, struct kv_paged_cache cache, int32_t layer,
                             const struct kv_view *k, const struct kv_view *v,
                             struct kv__attn_slots sl, int64_t n_slots,
                             const struct kv_scales *scales)
{
    struct kv__attn_job j;
    kv_status st = kv__attn_write_check(fn, &cache, layer, k, v, sl, n_slots, scales, &j);
    if (st != KV_OK)
        return st;
    st = exec_move(&j, true);
    if (st == KV_OK)
        kv__attn_count(&j, false);
    kv__attn_job_free(&j);
    return st == KV_OK ? kv__ok() : st;
}

kv_status kv_attn_write(struct kv_paged_cache cache, int32_t layer, const struct kv_view *k,
                        const struct kv_view *v, const int64_t *slots, int64_t n_slots,
                        const struct kv_scales *scales)
{
    return write_slots("kv_attn_write", cache, layer, k, v, (struct kv__attn_slots){slots, false},
                       n_slots, scales);
}

kv_status kv_attn_write_i32(struct kv_paged_cache cache, int32_t layer, const struct kv_view *k,
                            const struct kv_view *v, const int32_t *slots, int64_t n_slots,
                            const struct kv_scales *scales)
{
    return write_slots("kv_attn_write_i32", cache, layer, k, v,
                       (struct kv__attn_slots){slots, true}, n_slots, scales);
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
    kv_status st =
        kv__attn_copy_check("kv_attn_copy_blocks", &cache, NULL, copies, n_copies, NULL, &j);
    if (st != KV_OK)
        return st;
    exec_copy(&j);
    kv__attn_count(&j, false);
    kv__copy_count(KV_COPY_BLOCK_COPY, kv__attn_copy_bytes(&j));
    kv__attn_job_free(&j);
    return kv__ok();
}

kv_status kv_attn_copy_blocks_ex(struct kv_paged_cache dst, struct kv_paged_cache src,
                                 const struct kv_block_copy *copies, uint32_t n_copies,
                                 const struct kv_copy_blocks_opts *opts)
{
    struct kv__attn_job j;
    kv_status st =
        kv__attn_copy_check("kv_attn_copy_blocks_ex", &dst, &src, copies, n_copies, opts, &j);
    if (st != KV_OK)
        return st;
    if (kv__attn_copy_is_whole(&j))
        exec_copy(&j); /* the layout's byte runs, as kv_attn_copy_blocks */
    else
        exec_copy_ex(&j);
    kv__attn_count(&j, false);
    kv__copy_count(KV_COPY_BLOCK_COPY, kv__attn_copy_bytes(&j));
    kv__attn_job_free(&j);
    return kv__ok();
}
