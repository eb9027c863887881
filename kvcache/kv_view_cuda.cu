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
 * The body and the launch parameters are in kv_view_kernels_hd.h (the CPU
 * grid emulator runs the same body in the tests, kv_view_grid.c); the
 * kernel below is its thin __global__ wrapper.
 */
#include <cuda_runtime.h>

#include "kv_cuda_lib.h"
#include "kv_view_cuda_int.h"
#include "kv_view_kernels_hd.h"

template <int W> __global__ void kv__copy_rows_kernel(struct kv__view_rows a)
{
    const struct kv_grid_ctx c = {blockIdx.x, threadIdx.x, blockDim.x, gridDim.x, NULL, NULL};
    kv__view_rows_body(&c, &a, W);
}

extern "C" kv_status kv__cuda_view_copy(const struct kv_copy_plan *p, const void *src_base,
                                        void *dst_base, kv_cuda_stream stream, int *path_out)
{
    cudaStream_t s = (cudaStream_t)stream;
    kv_status st = kv__cuda_ready("kv_view_copy_cuda", NULL);
    if (st != KV_OK)
        return st;

    struct kv__view_rows a;
    int64_t blocks = 0;
    int path = 0;
    kv__view_rows_build(p, src_base, dst_base, &a, &blocks, &path);
    const unsigned g = (unsigned)blocks;
    switch (a.vbytes) {
    case 16:
        kv__copy_rows_kernel<16><<<g, KV__VIEW_THREADS, 0, s>>>(a);
        break;
    case 8:
        kv__copy_rows_kernel<8><<<g, KV__VIEW_THREADS, 0, s>>>(a);
        break;
    case 4:
        kv__copy_rows_kernel<4><<<g, KV__VIEW_THREADS, 0, s>>>(a);
        break;
    case 2:
        kv__copy_rows_kernel<2><<<g, KV__VIEW_THREADS, 0, s>>>(a);
        break;
    default:
        kv__copy_rows_kernel<1><<<g, KV__VIEW_THREADS, 0, s>>>(a);
        break;
    }
    st = kv__cuda_status(cudaGetLastError(), "kv_view_copy_cuda: kernel launch");
    if (st != KV_OK)
        return st;
    if (path_out)
        *path_out = path;
    return KV_OK;
}
