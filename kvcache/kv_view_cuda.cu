/*
 * kv_view_cuda.cu - strided view copy on the GPU.
 *
 * The host has validated the copy (kv__view_copy_check, the CPU path's
 * validator) and reduced it to a plan (kv_copy_plan_build, kv_view_hd.h,
 * the CPU engine's reduction). One kernel runs the plan row by row: a row's
 * outer dims are decoded once (kv_copy_plan_row, one division per outer
 * dim), then a group of threads walks the row with fixed strides:
 *
 *   contiguous rows   16/8/4/2/1-byte vectors (kv_copy_plan_vector_bytes:
 *                     the widest that keeps every access aligned), so a
 *                     row of bf16 heads moves as uint4 loads and stores
 *   any other rows    element by element at the row's byte steps
 *
 * Threads per row: the next power of two of the row's vector count, at most
 * a block (256), so short rows still fill warps (several rows per block).
 */
#include <cuda_runtime.h>

#include "kv_cuda_lib.h"
#include "kv_view_cuda_int.h"

#define KV__CUDA_THREADS 256
#define KV__CUDA_MAX_BLOCKS (1 << 20)

template <typename V>
__global__ void kv__copy_rows_kernel(const char *src, char *dst, struct kv_copy_plan p, int64_t n,
                                     int64_t src_step, int64_t dst_step, int tpr_log2)
{
    const int64_t tpr = (int64_t)1 << tpr_log2;       /* threads per row */
    const int64_t rpb = KV__CUDA_THREADS >> tpr_log2; /* rows per block */
    const int64_t lane = threadIdx.x & (tpr - 1);
    for (int64_t r = (int64_t)blockIdx.x * rpb + (threadIdx.x >> tpr_log2); r < p.rows;
         r += (int64_t)gridDim.x * rpb) {
        int64_t so, d;
        kv_copy_plan_row(&p, r, &so, &d);
        const char *s = src + so;
        char *t = dst + d;
        for (int64_t i = lane; i < n; i += tpr)
            *(V *)(t + i * dst_step) = *(const V *)(s + i * src_step);
    }
}

template <typename V>
static void kv__launch(const struct kv_copy_plan *p, const void *src, void *dst, int64_t n,
                       int64_t src_step, int64_t dst_step, cudaStream_t stream)
{
    int tpr_log2 = 0;
    while (tpr_log2 < 8 && ((int64_t)1 << tpr_log2) < n)
        tpr_log2++;
    const int64_t rpb = KV__CUDA_THREADS >> tpr_log2;
    int64_t blocks = (p->rows + rpb - 1) / rpb;
    if (blocks > KV__CUDA_MAX_BLOCKS)
        blocks = KV__CUDA_MAX_BLOCKS;
    kv__copy_rows_kernel<V><<<(unsigned)blocks, KV__CUDA_THREADS, 0, stream>>>(
        (const char *)src, (char *)dst, *p, n, src_step, dst_step, tpr_log2);
}

extern "C" kv_status kv__cuda_view_copy(const struct kv_copy_plan *p, const void *src_base,
                                        void *dst_base, kv_cuda_stream stream, int *path_out)
{
    cudaStream_t s = (cudaStream_t)stream;
    kv_status st = kv__cuda_ready("kv_view_copy_cuda", NULL);
    if (st != KV_OK)
        return st;

    const int32_t w =
        kv_copy_plan_vector_bytes(p, (uint64_t)(uintptr_t)src_base, (uint64_t)(uintptr_t)dst_base);
    const int64_t row_bytes = p->row_elems * p->elem_bytes;
    int path;
    switch (w) {
    case 16:
        kv__launch<uint4>(p, src_base, dst_base, row_bytes / 16, 16, 16, s);
        path = KV__CUDA_COPY_VEC16;
        break;
    case 8:
        kv__launch<uint2>(p, src_base, dst_base, row_bytes / 8, 8, 8, s);
        path = KV__CUDA_COPY_VEC8;
        break;
    case 4:
        kv__launch<uint32_t>(p, src_base, dst_base, row_bytes / 4, 4, 4, s);
        path = KV__CUDA_COPY_VEC4;
        break;
    case 2:
        kv__launch<uint16_t>(p, src_base, dst_base, row_bytes / 2, 2, 2, s);
        path = KV__CUDA_COPY_VEC2;
        break;
    case 1:
        kv__launch<uint8_t>(p, src_base, dst_base, row_bytes, 1, 1, s);
        path = KV__CUDA_COPY_VEC1;
        break;
    default: {
        const int64_t ss = kv_copy_plan_src_step(p), ds = kv_copy_plan_dst_step(p);
        switch (p->elem_bytes) {
        case 1:
            kv__launch<uint8_t>(p, src_base, dst_base, p->row_elems, ss, ds, s);
            break;
        case 2:
            kv__launch<uint16_t>(p, src_base, dst_base, p->row_elems, ss, ds, s);
            break;
        case 4:
            kv__launch<uint32_t>(p, src_base, dst_base, p->row_elems, ss, ds, s);
            break;
        default:
            kv__launch<uint64_t>(p, src_base, dst_base, p->row_elems, ss, ds, s);
            break;
        }
        path = KV__CUDA_COPY_STRIDED;
        break;
    }
    }
    st = kv__cuda_status(cudaGetLastError(), "kv_view_copy_cuda: kernel launch");
    if (st != KV_OK)
        return st;
    if (path_out)
        *path_out = path;
    return KV_OK;
}
