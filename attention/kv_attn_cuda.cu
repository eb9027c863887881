/*
 * kv_attn_cuda.cu - the attention kernels on the GPU.
 *
 * Each launcher receives a job validated on the host by the CPU kernels'
 * validator (kv_attn_check.c), uploads its host index arrays (runs, pages,
 * copy offsets, scales) with stream-ordered allocations (cudaMemcpyAsync
 * from pageable host memory: CUDA may synchronize with the stream to stage
 * it, and graph capture could not replay it; docs/design.md), launches on
 * the caller's stream, frees on the stream, and maps any CUDA error through
 * kv__cuda_status (KV_ERR_DEVICE for a failed launch). Every cache address is
 * computed with kv_attn_hd.h and every conversion with kv_convert_hd.h: the
 * code the CPU kernels and tests run.
 *
 *   move    one CUDA block per (run, layer); its threads walk the run's
 *           [n][H][D] elements: as 16/8/4/2/1-byte vectors when the dtypes
 *           agree without scales (the widest every address allows), through
 *           f32 otherwise
 *   copy    one CUDA block per (block pair, byte run), vector copies; a
 *           layer range, one plane or two caches: one per (pair, layer,
 *           storage block) or, one plane of packed K|V, per half head row
 *   decode  one CUDA block per (sequence, KV head); each warp takes every
 *           KV__DEC_WARPS-th token, lanes split the head dim, an online
 *           softmax per warp and query head in shared memory, merged at
 *           the end
 */
#include <cuda_runtime.h>
#include <math.h>

#include "kv_attn_cuda_int.h"
#include "kv_convert_hd.h"
#include "kv_cuda_lib.h"
#include "kv_mem.h"

#include <string.h>

#define KV__THREADS 256
#define KV__MAX_GRID (1 << 20)
#define KV__DEC_WARPS 4
#define KV__SHARED_MAX (48 << 10)

/* ---- device memory for a launch's index arrays ------------------------------ */

static kv_status upload(void **dev, const void *host, size_t bytes, cudaStream_t s,
                        const char *what)
{
    *dev = NULL;
    if (bytes == 0)
        return KV_OK;
    kv_status st = kv__cuda_status(cudaMallocAsync(dev, bytes, s), what);
    if (st != KV_OK)
        return st;
    st = kv__cuda_status(cudaMemcpyAsync(*dev, host, bytes, cudaMemcpyHostToDevice, s), what);
    if (st != KV_OK) {
        (void)cudaFreeAsync(*dev, s);
        *dev = NULL;
    }
    return st;
}

static void release(void *dev, cudaStream_t s)
{
    if (dev)
        (void)cudaFreeAsync(dev, s);
}

static int grid_of(int64_t items)
{
    return (int)(items < KV__MAX_GRID ? (items > 0 ? items : 1) : KV__MAX_GRID);
}

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
};

template <typename V>
__global__ void kv__move_bytes_kernel(struct kv__cmove m, const struct kv__attn_run *runs)
{
    const int64_t H = m.lo.num_heads,
                  row_vecs = m.lo.head_dim * m.lo.elem_bytes / (int64_t)sizeof(V);
    for (int64_t item = blockIdx.x; item < m.n_items; item += gridDim.x) {
        const struct kv__attn_run r = runs[item / m.n_layers];
        const uint32_t lrel = (uint32_t)(item % m.n_layers);
        const int64_t total = r.n * H * row_vecs;
        for (int kv = 0; kv < 2; kv++) {
            if (!m.has[kv])
                continue;
            const struct kv__cside t = m.t[kv];
            char *c0 = m.cache + kv_layout_slot_offset_bytes(&m.lo, m.layer0 + lrel, kv, r.slot);
            char *t0 = t.base + (int64_t)lrel * t.layer + r.token * t.tok;
            /* the tensor's head dim is contiguous here unless V is one element */
            const int64_t tstep = t.dim == m.lo.elem_bytes ? (int64_t)sizeof(V) : t.dim;
            for (int64_t i = threadIdx.x; i < total; i += blockDim.x) {
                const int64_t row = i / row_vecs, vi = i - row * row_vecs;
                const int64_t tk = row / H, h = row - tk * H;
                V *c = (V *)(c0 + tk * m.lo.stride_token_bytes + h * m.lo.stride_head_bytes +
                             vi * (int64_t)sizeof(V));
                V *x = (V *)(t0 + tk * t.tok + h * t.head + vi * tstep);
                if (m.to_cache)
                    *c = *x;
                else
                    *x = *c;
            }
        }
    }
}

__global__ void kv__move_convert_kernel(struct kv__cmove m, const struct kv__attn_run *runs,
                                        const float *scale /* [2][n_mul] */)
{
    const int64_t H = m.lo.num_heads, D = m.lo.head_dim, es = m.lo.elem_bytes;
    for (int64_t item = blockIdx.x; item < m.n_items; item += gridDim.x) {
        const struct kv__attn_run r = runs[item / m.n_layers];
        const uint32_t lrel = (uint32_t)(item % m.n_layers);
        const int64_t total = r.n * H * D;
        for (int kv = 0; kv < 2; kv++) {
            if (!m.has[kv])
                continue;
            const struct kv__cside t = m.t[kv];
            char *c0 = m.cache + kv_layout_slot_offset_bytes(&m.lo, m.layer0 + lrel, kv, r.slot);
            char *t0 = t.base + (int64_t)lrel * t.layer + r.token * t.tok;
            for (int64_t i = threadIdx.x; i < total; i += blockDim.x) {
                const int64_t row = i / D, d = i - row * D;
                const int64_t tk = row / H, h = row - tk * H;
                const float f = scale[kv * m.n_mul + (m.per_head ? h : 0)];
                char *c = c0 + tk * m.lo.stride_token_bytes + h * m.lo.stride_head_bytes + d * es;
                char *x = t0 + tk * t.tok + h * t.head + d * t.dim;
                if (m.raw[kv])
                    memcpy(m.to_cache ? c : x, m.to_cache ? x : c, (size_t)es);
                else if (m.to_cache)
                    kv_from_f32(m.lo.dtype, kv_apply_scale(kv_to_f32(t.dt, x), f, true), c);
                else
                    kv_from_f32(t.dt, kv_apply_scale(kv_to_f32(m.lo.dtype, c), f, false), x);
            }
        }
    }
}

/* The widest vector every address of a bytes move is aligned to. */
static int move_width(const struct kv__cmove *m)
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

extern "C" kv_status kv__cuda_attn_move(const struct kv__attn_job *j, bool to_cache,
                                        kv_cuda_stream stream)
{
    cudaStream_t s = (cudaStream_t)stream;
    const char *fn = j->fn;
    kv_status st = kv__cuda_ready(fn, NULL);
    if (st != KV_OK || j->n_runs == 0)
        return st;
    struct kv__cmove m;
    memset(&m, 0, sizeof(m));
    m.lo = j->cache.layout;
    m.cache = (char *)j->cache.base;
    m.layer0 = j->layer0;
    m.n_layers = j->n_layers;
    m.n_items = j->n_runs * (int64_t)j->n_layers;
    m.to_cache = to_cache;
    for (int kv = 0; kv < 2; kv++) {
        const struct kv__attn_tensor *t = kv ? &j->v : &j->k;
        m.has[kv] = kv ? j->has_v : j->has_k;
        m.t[kv] = (struct kv__cside){t->base,        t->layer_stride, t->token_stride,
                                     t->head_stride, t->dim_stride,   t->dtype};
    }
    for (int kv = 0; kv < 2; kv++)
        m.raw[kv] = j->n_scales == 0 && m.t[kv].dt == m.lo.dtype;
    const bool bytes = (!m.has[0] || m.raw[0]) && (!m.has[1] || m.raw[1]);
    void *d_runs = NULL, *d_scale = NULL;
    st = upload(&d_runs, j->runs, (size_t)j->n_runs * sizeof(*j->runs), s, fn);
    if (st != KV_OK)
        return st;
    const struct kv__attn_run *runs = (const struct kv__attn_run *)d_runs;
    const int grid = grid_of(m.n_items);
    if (bytes) {
        switch (move_width(&m)) {
        case 16:
            kv__move_bytes_kernel<uint4><<<grid, KV__THREADS, 0, s>>>(m, runs);
            break;
        case 8:
            kv__move_bytes_kernel<uint2><<<grid, KV__THREADS, 0, s>>>(m, runs);
            break;
        case 4:
            kv__move_bytes_kernel<uint32_t><<<grid, KV__THREADS, 0, s>>>(m, runs);
            break;
        case 2:
            kv__move_bytes_kernel<uint16_t><<<grid, KV__THREADS, 0, s>>>(m, runs);
            break;
        default:
            kv__move_bytes_kernel<uint8_t><<<grid, KV__THREADS, 0, s>>>(m, runs);
            break;
        }
    } else {
        /* the scales themselves (1 without): x / scale on the way in, x *
         * scale on the way out (kv_apply_scale, as on the CPU) */
        m.n_mul = j->n_scales > 1 ? j->n_scales : 1;
        m.per_head = j->n_scales > 1;
        float scale[2 * 1024];
        for (int64_t h = 0; h < m.n_mul; h++) {
            scale[h] = j->k_scale ? j->k_scale[h] : 1.0f;
            scale[m.n_mul + h] = j->v_scale ? j->v_scale[h] : 1.0f;
        }
        st = upload(&d_scale, scale, (size_t)(2 * m.n_mul) * sizeof(float), s, fn);
        if (st != KV_OK) {
            release(d_runs, s);
            return st;
        }
        kv__move_convert_kernel<<<grid, KV__THREADS, 0, s>>>(m, runs, (const float *)d_scale);
    }
    st = kv__cuda_status(cudaGetLastError(), fn);
    release(d_scale, s);
    release(d_runs, s);
    return st;
}

/* ---- copy blocks ---------------------------------------------------------------- */

template <typename V>
__global__ void kv__copy_kernel(char *base, const int64_t *offs /* [n][2]: src, dst */,
                                int64_t n_items, int64_t run_count, int64_t run_stride,
                                int64_t run_bytes)
{
    const int64_t vecs = run_bytes / (int64_t)sizeof(V);
    for (int64_t item = blockIdx.x; item < n_items; item += gridDim.x) {
        const int64_t c = item / run_count, r = item - c * run_count;
        const V *src = (const V *)(base + offs[2 * c] + r * run_stride);
        V *dst = (V *)(base + offs[2 * c + 1] + r * run_stride);
        for (int64_t i = threadIdx.x; i < vecs; i += blockDim.x)
            dst[i] = src[i];
    }
}

extern "C" kv_status kv__cuda_attn_copy(const struct kv__attn_job *j, kv_cuda_stream stream)
{
    const char *fn = j->fn;
    cudaStream_t s = (cudaStream_t)stream;
    const struct kv_layout *lo = &j->cache.layout;
    kv_status st = kv__cuda_ready(fn, NULL);
    if (st != KV_OK || j->n_copies == 0)
        return st;
    int64_t *offs = (int64_t *)kv__mem_alloc((size_t)j->n_copies * 2 * sizeof(int64_t));
    if (!offs)
        return kv__error(KV_ERR_NO_MEMORY, "%s: %u copies", fn, j->n_copies);
    struct kv_byte_runs rs = {0, 0, 0, 0}, rd;
    uint64_t bits = (uint64_t)(uintptr_t)j->cache.base;
    for (uint32_t i = 0; i < j->n_copies; i++) {
        /* ids were validated: block_runs cannot fail */
        if (kv_layout_block_runs(lo, j->copies[i].src, &rs) != KV_OK ||
            kv_layout_block_runs(lo, j->copies[i].dst, &rd) != KV_OK) {
            kv__mem_free(offs);
            return kv__error(KV_ERR_INTERNAL, "%s: block runs of copy %u", fn, i);
        }
        offs[2 * i] = rs.first_offset_bytes;
        offs[2 * i + 1] = rd.first_offset_bytes;
        bits |= (uint64_t)rs.first_offset_bytes | (uint64_t)rd.first_offset_bytes;
    }
    bits |= (uint64_t)rs.run_bytes | (uint64_t)rs.run_stride_bytes;
    void *d_offs = NULL;
    st = upload(&d_offs, offs, (size_t)j->n_copies * 2 * sizeof(int64_t), s, fn);
    kv__mem_free(offs);
    if (st != KV_OK)
        return st;
    const int64_t items = (int64_t)j->n_copies * rs.run_count;
    const int grid = grid_of(items);
    char *base = (char *)j->cache.base;
    const int64_t *o = (const int64_t *)d_offs;
    if ((bits & 15) == 0)
        kv__copy_kernel<uint4><<<grid, KV__THREADS, 0, s>>>(base, o, items, rs.run_count,
                                                            rs.run_stride_bytes, rs.run_bytes);
    else if ((bits & 7) == 0)
        kv__copy_kernel<uint2><<<grid, KV__THREADS, 0, s>>>(base, o, items, rs.run_count,
                                                            rs.run_stride_bytes, rs.run_bytes);
    else if ((bits & 3) == 0)
        kv__copy_kernel<uint32_t><<<grid, KV__THREADS, 0, s>>>(base, o, items, rs.run_count,
                                                               rs.run_stride_bytes, rs.run_bytes);
    else
        kv__copy_kernel<uint8_t><<<grid, KV__THREADS, 0, s>>>(base, o, items, rs.run_count,
                                                              rs.run_stride_bytes, rs.run_bytes);
    st = kv__cuda_status(cudaGetLastError(), fn);
    release(d_offs, s);
    return st;
}

/* A copy of layers and planes, within one cache or between two (the same
 * block format): item i moves rows of row_bytes from src + offs[2 i] to dst
 * + offs[2 i + 1], a whole storage block (rows 1) or, for one plane of a
 * packed K|V block, its N x H half rows (row r: token r / H, head r % H,
 * the same in-block offset on both sides). */
template <typename V>
__global__ void kv__copy_ex_kernel(char *dst, const char *src, const int64_t *offs, int64_t n_items,
                                   int64_t rows, int64_t H, int64_t tok, int64_t head,
                                   int64_t row_bytes)
{
    const int64_t vecs = row_bytes / (int64_t)sizeof(V);
    for (int64_t item = blockIdx.x; item < n_items; item += gridDim.x) {
        const int64_t u = item / rows, r = item - u * rows;
        const int64_t in = rows == 1 ? 0 : (r / H) * tok + (r % H) * head;
        const V *sp = (const V *)(src + offs[2 * u] + in);
        V *dp = (V *)(dst + offs[2 * u + 1] + in);
        for (int64_t i = threadIdx.x; i < vecs; i += blockDim.x)
            dp[i] = sp[i];
    }
}

extern "C" kv_status kv__cuda_attn_copy_ex(const struct kv__attn_job *j, kv_cuda_stream stream)
{
    const char *fn = j->fn;
    cudaStream_t s = (cudaStream_t)stream;
    const struct kv_layout *dl = &j->cache.layout, *sl = &j->src.layout;
    kv_status st = kv__cuda_ready(fn, NULL);
    if (st != KV_OK || j->n_copies == 0)
        return st;
    const bool halves = dl->kv_packed && j->planes != KV_ATTN_PLANES_KV;
    const int64_t units = dl->kv_packed ? 1 : (j->planes == KV_ATTN_PLANES_KV ? 2 : 1);
    const int kv0 = j->planes == KV_ATTN_PLANE_V ? 1 : 0;
    const int64_t per_copy = (int64_t)j->n_layers * units, n_units = j->n_copies * per_copy;
    int64_t *offs = (int64_t *)kv__mem_alloc((size_t)n_units * 2 * sizeof(int64_t));
    if (!offs)
        return kv__error(KV_ERR_NO_MEMORY, "%s: %u copies", fn, j->n_copies);
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
    const int64_t rows = halves ? dl->block_tokens * dl->num_heads : 1;
    const int64_t row_bytes = halves ? dl->head_dim * dl->elem_bytes : dl->block_bytes;
    const int64_t H = dl->num_heads, tok = dl->stride_token_bytes, head = dl->stride_head_bytes;
    bits |= (uint64_t)row_bytes;
    if (halves)
        bits |= (uint64_t)tok | (uint64_t)head;
    void *d_offs = NULL;
    st = upload(&d_offs, offs, (size_t)n_units * 2 * sizeof(int64_t), s, fn);
    kv__mem_free(offs);
    if (st != KV_OK)
        return st;
    const int64_t items = n_units * rows;
    const int grid = grid_of(items);
    char *dst = (char *)j->cache.base;
    const char *src = (const char *)j->src.base;
    const int64_t *o = (const int64_t *)d_offs;
    if ((bits & 15) == 0)
        kv__copy_ex_kernel<uint4>
            <<<grid, KV__THREADS, 0, s>>>(dst, src, o, items, rows, H, tok, head, row_bytes);
    else if ((bits & 7) == 0)
        kv__copy_ex_kernel<uint2>
            <<<grid, KV__THREADS, 0, s>>>(dst, src, o, items, rows, H, tok, head, row_bytes);
    else if ((bits & 3) == 0)
        kv__copy_ex_kernel<uint32_t>
            <<<grid, KV__THREADS, 0, s>>>(dst, src, o, items, rows, H, tok, head, row_bytes);
    else if ((bits & 1) == 0)
        kv__copy_ex_kernel<uint16_t>
            <<<grid, KV__THREADS, 0, s>>>(dst, src, o, items, rows, H, tok, head, row_bytes);
    else
        kv__copy_ex_kernel<uint8_t>
            <<<grid, KV__THREADS, 0, s>>>(dst, src, o, items, rows, H, tok, head, row_bytes);
    st = kv__cuda_status(cudaGetLastError(), fn);
    release(d_offs, s);
    return st;
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
    const float *scales; /* [2][n_mul] */
    int64_t n_mul;
    int warps;
};

__device__ __forceinline__ float kv__warp_sum(float x)
{
    for (int o = 16; o > 0; o >>= 1)
        x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

__global__ void kv__decode_kernel(struct kv__cdec p)
{
    extern __shared__ float sh[];
    const int64_t H = p.lo.num_heads, D = p.lo.head_dim, g = p.g, es = p.lo.elem_bytes;
    const int64_t s = blockIdx.x / H, h = blockIdx.x - s * H;
    const int warp = (int)(threadIdx.x / 32), lane = (int)(threadIdx.x % 32);
    float *q = sh;                     /* [g][D] */
    float *acc = q + g * D;            /* [warps][g][D] */
    float *ml = acc + p.warps * g * D; /* [warps][2][g]: m then l */
    for (int64_t i = threadIdx.x; i < g * D; i += blockDim.x) {
        const int64_t qi = i / D, d = i - qi * D;
        q[i] = kv_to_f32(p.q.dt, p.q.base + s * p.q.tok + (h * g + qi) * p.q.head + d * p.q.dim) *
               p.softmax_scale;
    }
    for (int64_t i = threadIdx.x; i < p.warps * g * D; i += blockDim.x)
        acc[i] = 0.0f;
    for (int64_t i = threadIdx.x; i < p.warps * g; i += blockDim.x) {
        const int64_t w = i / g, qi = i - w * g;
        ml[w * 2 * g + qi] = -INFINITY;
        ml[w * 2 * g + g + qi] = 0.0f;
    }
    __syncthreads();
    const float ks = p.scales[p.n_mul > 1 ? h : 0], vs = p.scales[p.n_mul + (p.n_mul > 1 ? h : 0)];
    const int64_t n_tok = p.seq_tokens[s];
    const int32_t *pages = p.page_ids + p.page_start[s];
    float *wacc = acc + warp * g * D, *wm = ml + warp * 2 * g, *wl = wm + g;
    for (int64_t t = warp; t < n_tok; t += p.warps) {
        const int64_t slot = kv_attn_page_slot(pages[t / p.pt], p.pt, t % p.pt);
        const char *kb = p.cache + kv_layout_slot_offset_bytes(&p.lo, p.layer, 0, slot) +
                         h * p.lo.stride_head_bytes;
        const char *vb = kb + p.lo.stride_kv_bytes;
        for (int64_t qi = 0; qi < g; qi++) {
            float part = 0.0f;
            for (int64_t d = lane; d < D; d += 32)
                part += q[qi * D + d] * kv_to_f32(p.lo.dtype, kb + d * es);
            const float sc = kv__warp_sum(part) * ks;
            const float m0 = wm[qi], l0 = wl[qi];
            const float m1 = fmaxf(m0, sc);
            const float corr = m0 == -INFINITY ? 0.0f : __expf(m0 - m1);
            const float w = __expf(sc - m1);
            for (int64_t d = lane; d < D; d += 32)
                wacc[qi * D + d] =
                    wacc[qi * D + d] * corr + w * vs * kv_to_f32(p.lo.dtype, vb + d * es);
            __syncwarp();
            if (lane == 0) {
                wm[qi] = m1;
                wl[qi] = l0 * corr + w;
            }
            __syncwarp();
        }
    }
    __syncthreads();
    for (int64_t i = threadIdx.x; i < g * D; i += blockDim.x) {
        const int64_t qi = i / D, d = i - qi * D;
        float M = -INFINITY;
        for (int w = 0; w < p.warps; w++)
            M = fmaxf(M, ml[w * 2 * g + qi]);
        float L = 0.0f, A = 0.0f;
        for (int w = 0; w < p.warps; w++) {
            const float mw = ml[w * 2 * g + qi];
            if (mw == -INFINITY)
                continue;
            const float f = __expf(mw - M);
            L += ml[w * 2 * g + g + qi] * f;
            A += acc[(w * g + qi) * D + d] * f;
        }
        kv_from_f32(p.out.dt, L > 0.0f ? A / L : 0.0f,
                    p.out.base + s * p.out.tok + (h * g + qi) * p.out.head + d * p.out.dim);
    }
}

extern "C" kv_status kv__cuda_attn_decode(const struct kv__attn_job *j, kv_cuda_stream stream)
{
    static const char fn[] = "kv_attn_decode_cuda";
    cudaStream_t s = (cudaStream_t)stream;
    kv_status st = kv__cuda_ready(fn, NULL);
    if (st != KV_OK || j->n_seqs == 0)
        return st;
    struct kv__cdec p;
    memset(&p, 0, sizeof(p));
    p.lo = j->cache.layout;
    p.cache = (const char *)j->cache.base;
    p.layer = j->layer0;
    p.q = (struct kv__cside){j->q.base,       0,         j->q.token_stride, j->q.head_stride,
                             j->q.dim_stride, j->q.dtype};
    p.out = (struct kv__cside){
        j->out.base, 0, j->out.token_stride, j->out.head_stride, j->out.dim_stride, j->out.dtype};
    p.g = j->q_heads / p.lo.num_heads;
    p.pt = j->page_tokens;
    p.softmax_scale = j->softmax_scale;
    p.n_mul = j->n_scales > 1 ? j->n_scales : 1;
    /* shared memory: q [g][D] + acc [warps][g][D] + m, l [warps][g] */
    const int64_t gd = p.g * p.lo.head_dim;
    p.warps = KV__DEC_WARPS;
    while (p.warps > 1 && (gd + p.warps * (gd + 2 * p.g)) * 4 > KV__SHARED_MAX)
        p.warps--;
    const size_t shmem = (size_t)(gd + p.warps * (gd + 2 * p.g)) * sizeof(float);
    if (shmem > KV__SHARED_MAX)
        return kv__error(KV_ERR_UNSUPPORTED,
                         "%s: %lld query heads per KV head x D %lld need %zu bytes of shared "
                         "memory (at most %d)",
                         fn, (long long)p.g, (long long)p.lo.head_dim, shmem, KV__SHARED_MAX);
    float scales[2 * 1024];
    for (int64_t h = 0; h < p.n_mul; h++) {
        scales[h] = j->k_scale ? j->k_scale[h] : 1.0f;
        scales[p.n_mul + h] = j->v_scale ? j->v_scale[h] : 1.0f;
    }
    void *d_pages = NULL, *d_start = NULL, *d_tok = NULL, *d_scales = NULL;
    const int64_t n_pages = j->page_start[j->n_seqs];
    if ((st = upload(&d_pages, j->page_ids, (size_t)n_pages * sizeof(int32_t), s, fn)) != KV_OK ||
        (st = upload(&d_start, j->page_start, ((size_t)j->n_seqs + 1) * sizeof(int64_t), s, fn)) !=
            KV_OK ||
        (st = upload(&d_tok, j->seq_tokens, (size_t)j->n_seqs * sizeof(int64_t), s, fn)) != KV_OK ||
        (st = upload(&d_scales, scales, (size_t)(2 * p.n_mul) * sizeof(float), s, fn)) != KV_OK)
        goto out;
    p.page_ids = (const int32_t *)d_pages;
    p.page_start = (const int64_t *)d_start;
    p.seq_tokens = (const int64_t *)d_tok;
    p.scales = (const float *)d_scales;
    {
        const int64_t blocks = (int64_t)j->n_seqs * p.lo.num_heads;
        if (blocks > INT32_MAX) {
            st = kv__error(KV_ERR_UNSUPPORTED, "%s: %lld (sequence, head) pairs", fn,
                           (long long)blocks);
            goto out;
        }
        kv__decode_kernel<<<(unsigned)blocks, 32 * p.warps, shmem, s>>>(p);
        st = kv__cuda_status(cudaGetLastError(), fn);
    }
out:
    release(d_scales, s);
    release(d_tok, s);
    release(d_start, s);
    release(d_pages, s);
    return st;
}
