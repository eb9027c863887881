/*
 * kv_plan_cuda.cu - the plan executor on the GPU (kv_plan_cuda_int.h).
 *
 * The launcher receives a schedule built on the host from a validated
 * request (kv_plan_gpu.c): the wide copies at absolute addresses, the
 * narrow ones as a table the kernel walks with kv__plan_narrow_frag (the
 * item mapping the CPU executor uses, kv__plan_item_at). Nothing here
 * computes an address of a cache from a layout.
 *
 *   wide    one cudaMemcpy2DAsync per 2-D copy (cudaMemcpyDefault); a copy
 *           of one row, or with a pitch above what cudaMemcpy2D takes
 *           (a layer-major pool's layer stride can pass 2 GiB), as
 *           cudaMemcpyAsync per row
 *   narrow  the plan's narrow copies and the request's block starts
 *           uploaded with stream-ordered allocation, one launch: one CUDA
 *           block per (window, copy) item (grid-stride), made absolute by
 *           kv__plan_narrow_frag, its threads over the item's rows x
 *           vectors, 16-byte vectors when every address, width and pitch
 *           allows, else 8, 4 or 1
 *
 * No explicit synchronize; but the narrow upload is a cudaMemcpyAsync from
 * pageable host memory, which CUDA may stage by synchronizing with the
 * stream, and which a CUDA graph could not replay (the schedule is freed
 * when the call returns). Every CUDA error through kv__cuda_status.
 */
#include <cuda_runtime.h>

#include "kv_cuda_lib.h"
#include "kv_plan_cuda_int.h"

#define KV__PLAN_THREADS 256
#define KV__PLAN_MAX_GRID (1 << 20)
/* cudaMemcpy2DAsync refuses pitches above cudaDevAttrMaxPitch (2^31 - 1 on
 * every current GPU); a larger pitch goes row by row. */
#define KV__PLAN_MAX_PITCH ((int64_t)INT32_MAX)

template <typename V> __global__ void kv__plan_narrow_kernel(struct kv__plan_narrow n)
{
    for (int64_t w = blockIdx.x; w < n.n_items; w += gridDim.x) {
        struct kv__plan_frag f;
        if (!kv__plan_narrow_frag(&n, w, &f))
            continue; /* past the request's last block on one side */
        const int64_t vecs = f.width / (int64_t)sizeof(V), total = vecs * f.height;
        for (int64_t k = threadIdx.x; k < total; k += blockDim.x) {
            const int64_t y = k / vecs, x = k - y * vecs;
            const V *s = (const V *)(f.src + y * f.src_pitch) + x;
            V *d = (V *)(f.dst + y * f.dst_pitch) + x;
            *d = *s;
        }
    }
}

static kv_status copy_wide(const struct kv__plan_frag *f, cudaStream_t s, const char *fn)
{
    if (f->height > 1 && f->src_pitch <= KV__PLAN_MAX_PITCH && f->dst_pitch <= KV__PLAN_MAX_PITCH)
        return kv__cuda_status(cudaMemcpy2DAsync(f->dst, (size_t)f->dst_pitch, f->src,
                                                 (size_t)f->src_pitch, (size_t)f->width,
                                                 (size_t)f->height, cudaMemcpyDefault, s),
                               fn);
    for (int64_t y = 0; y < f->height; y++) {
        kv_status st =
            kv__cuda_status(cudaMemcpyAsync(f->dst + y * f->dst_pitch, f->src + y * f->src_pitch,
                                            (size_t)f->width, cudaMemcpyDefault, s),
                            fn);
        if (st != KV_OK)
            return st;
    }
    return KV_OK;
}

extern "C" kv_status kv__cuda_plan_copy(const struct kv__plan_sched *sc, kv_cuda_stream stream)
{
    static const char fn[] = "kv_plan_copy_cuda";
    cudaStream_t s = (cudaStream_t)stream;
    kv_status st = kv__cuda_ready(fn, NULL);
    if (st != KV_OK)
        return st;
    for (int64_t i = 0; i < sc->n_wide; i++)
        if ((st = copy_wide(&sc->wide[i], s, fn)) != KV_OK)
            return st;
    const struct kv__plan_narrow *hn = &sc->narrow;
    if (hn->n_items == 0)
        return KV_OK;
    /* one upload: [copies][source block starts][destination block starts] */
    const size_t cb = (size_t)hn->n_copies * sizeof(*hn->copies);
    const size_t sb = (size_t)hn->n_src * sizeof(char *), db = (size_t)hn->n_dst * sizeof(char *);
    char *dev = NULL;
    st = kv__cuda_status(cudaMallocAsync((void **)&dev, cb + sb + db, s), fn);
    if (st != KV_OK)
        return st;
    /* from pageable memory: staged before each call returns, so the host
     * schedule may be freed right after */
    if ((st = kv__cuda_status(cudaMemcpyAsync(dev, hn->copies, cb, cudaMemcpyHostToDevice, s),
                              fn)) == KV_OK &&
        (st = kv__cuda_status(cudaMemcpyAsync(dev + cb, hn->src_blk, sb, cudaMemcpyHostToDevice, s),
                              fn)) == KV_OK &&
        (st = kv__cuda_status(
             cudaMemcpyAsync(dev + cb + sb, hn->dst_blk, db, cudaMemcpyHostToDevice, s), fn)) ==
            KV_OK) {
        struct kv__plan_narrow n = *hn;
        n.copies = (const struct kv__plan_copy *)dev;
        n.src_blk = (const char *const *)(dev + cb);
        n.dst_blk = (char *const *)(dev + cb + sb);
        const int grid = (int)(n.n_items < KV__PLAN_MAX_GRID ? n.n_items : KV__PLAN_MAX_GRID);
        const uint64_t a = sc->narrow_align;
        if ((a & 15) == 0)
            kv__plan_narrow_kernel<uint4><<<grid, KV__PLAN_THREADS, 0, s>>>(n);
        else if ((a & 7) == 0)
            kv__plan_narrow_kernel<uint2><<<grid, KV__PLAN_THREADS, 0, s>>>(n);
        else if ((a & 3) == 0)
            kv__plan_narrow_kernel<uint32_t><<<grid, KV__PLAN_THREADS, 0, s>>>(n);
        else
            kv__plan_narrow_kernel<uint8_t><<<grid, KV__PLAN_THREADS, 0, s>>>(n);
        st = kv__cuda_status(cudaGetLastError(), fn);
    }
    (void)cudaFreeAsync(dev, s);
    return st;
}
