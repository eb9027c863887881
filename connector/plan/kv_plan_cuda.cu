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
 * The narrow kernel is a thin __global__ wrapper of kv__plan_narrow_body
 * (kv_plan_kernels_hd.h), which the CPU grid emulator runs in the tests
 * (kv_plan_grid.c).
 *
 * No explicit synchronize; but the narrow upload is a cudaMemcpyAsync from
 * pageable host memory, which CUDA may stage by synchronizing with the
 * stream, and which a CUDA graph could not replay (the schedule is freed
 * when the call returns). Every CUDA error through kv__cuda_status.
 */
#include <cuda_runtime.h>

#include "kv_cuda_lib.h"
#include "kv_plan_cuda_int.h"
#include "kv_plan_kernels_hd.h"

/* cudaMemcpy2DAsync refuses pitches above cudaDevAttrMaxPitch (2^31 - 1 on
 * every current GPU); a larger pitch goes row by row. */
#define KV__PLAN_MAX_PITCH ((int64_t)INT32_MAX)

template <int W> __global__ void kv__plan_narrow_kernel(struct kv__plan_narrow n)
{
    const struct kv_grid_ctx c = {blockIdx.x, threadIdx.x, blockDim.x, gridDim.x, NULL, NULL};
    kv__plan_narrow_body(&c, &n, W);
}

template <int W> __global__ void kv__plan_dev_kernel(struct kv__plan_dev p)
{
    const struct kv_grid_ctx c = {blockIdx.x, threadIdx.x, blockDim.x, gridDim.x, NULL, NULL};
    kv__plan_dev_body(&c, &p, W);
}

__global__ void kv__plan_dev_finish_kernel(struct kv_plan_cuda_errors *e, const uint32_t *sid,
                                           const uint32_t *did, uint32_t n_src, uint32_t n_dst)
{
    kv__plan_dev_finish(e, sid, did, n_src, n_dst);
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
        const int grid = kv__plan_narrow_grid(n.n_items);
        switch (kv__plan_narrow_width(sc->narrow_align)) {
        case 16:
            kv__plan_narrow_kernel<16><<<grid, KV__PLAN_THREADS, 0, s>>>(n);
            break;
        case 8:
            kv__plan_narrow_kernel<8><<<grid, KV__PLAN_THREADS, 0, s>>>(n);
            break;
        case 4:
            kv__plan_narrow_kernel<4><<<grid, KV__PLAN_THREADS, 0, s>>>(n);
            break;
        default:
            kv__plan_narrow_kernel<1><<<grid, KV__PLAN_THREADS, 0, s>>>(n);
            break;
        }
        st = kv__cuda_status(cudaGetLastError(), fn);
    }
    (void)cudaFreeAsync(dev, s);
    return st;
}

/* ---- device-resident block lists ------------------------------------------------ */

extern "C" kv_status kv__cuda_plan_dev_upload(struct kv_plan_dev *pd)
{
    static const char fn[] = "kv_plan_dev_create";
    kv_status st = kv__cuda_ready(fn, NULL);
    if (st != KV_OK)
        return st;
    const size_t bytes = (size_t)pd->plan->n_copies * sizeof(struct kv__plan_copy);
    void *p = NULL;
    if ((st = kv__cuda_status(cudaMalloc(&p, bytes), fn)) != KV_OK)
        return st;
    if ((st = kv__cuda_status(cudaMemcpy(p, pd->plan->copies, bytes, cudaMemcpyHostToDevice),
                              fn)) != KV_OK) {
        (void)cudaFree(p);
        return st;
    }
    pd->copies = (struct kv__plan_copy *)p;
    return KV_OK;
}

extern "C" void kv__cuda_plan_dev_free(struct kv_plan_dev *pd)
{
    (void)cudaFree(pd->copies);
    pd->copies = NULL;
}

/* No allocation, no copy, no synchronization: capture-safe. */
extern "C" kv_status kv__cuda_plan_copy_dev(const struct kv__plan_dev *p, int vbytes,
                                            kv_cuda_stream stream)
{
    static const char fn[] = "kv_plan_copy_cuda_dev";
    cudaStream_t s = (cudaStream_t)stream;
    kv_status st = kv__cuda_ready(fn, NULL);
    const int64_t all = p->n_items + (int64_t)p->n_src + p->n_dst;
    if (st != KV_OK || all == 0)
        return st;
    const int grid = kv__plan_narrow_grid(all);
    switch (vbytes) {
    case 16:
        kv__plan_dev_kernel<16><<<grid, KV__PLAN_THREADS, 0, s>>>(*p);
        break;
    case 8:
        kv__plan_dev_kernel<8><<<grid, KV__PLAN_THREADS, 0, s>>>(*p);
        break;
    case 4:
        kv__plan_dev_kernel<4><<<grid, KV__PLAN_THREADS, 0, s>>>(*p);
        break;
    default:
        kv__plan_dev_kernel<1><<<grid, KV__PLAN_THREADS, 0, s>>>(*p);
        break;
    }
    if (p->err)
        kv__plan_dev_finish_kernel<<<1, 1, 0, s>>>(p->err, p->sid, p->did, p->n_src, p->n_dst);
    return kv__cuda_status(cudaGetLastError(), fn);
}
