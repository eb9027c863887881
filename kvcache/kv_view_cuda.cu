/*
 * kv_view_cuda.cu - strided view copy on the GPU.
 *
 * One thread per element in a grid-stride loop; both sides addressed through
 * kv_geom_offset_of_linear (kv_view_index.h), the same function the CPU
 * tests check. Element sizes 1, 2, 4, 8 are copied as integers of that size.
 */
#include <cuda_runtime.h>

#include "kv_view_cuda_int.h"

template <typename T>
__global__ void kv_view_copy_kernel(T *dst, struct kv_view_geom dg, const T *src,
                                    struct kv_view_geom sg, int64_t numel)
{
    int64_t stride = (int64_t)blockDim.x * gridDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < numel; i += stride)
        dst[kv_geom_offset_of_linear(&dg, i)] = src[kv_geom_offset_of_linear(&sg, i)];
}

template <typename T>
static cudaError_t kv_launch(void *dst, struct kv_view_geom dg, const void *src,
                             struct kv_view_geom sg, int64_t numel, cudaStream_t stream)
{
    int threads = 256;
    int64_t want = (numel + threads - 1) / threads;
    int blocks = (int)(want < 65535 * 8 ? want : 65535 * 8);
    kv_view_copy_kernel<T><<<blocks, threads, 0, stream>>>((T *)dst, dg, (const T *)src, sg, numel);
    return cudaGetLastError();
}

extern "C" kv_status kv__cuda_view_copy(void *dst_base, struct kv_view_geom dst,
                                        const void *src_base, struct kv_view_geom src,
                                        int64_t numel, int elem_bytes, void *stream)
{
    cudaStream_t s = (cudaStream_t)stream;
    cudaError_t err;

    if (numel == 0)
        return KV_OK;
    switch (elem_bytes) {
    case 1:
        err = kv_launch<uint8_t>(dst_base, dst, src_base, src, numel, s);
        break;
    case 2:
        err = kv_launch<uint16_t>(dst_base, dst, src_base, src, numel, s);
        break;
    case 4:
        err = kv_launch<uint32_t>(dst_base, dst, src_base, src, numel, s);
        break;
    case 8:
        err = kv_launch<uint64_t>(dst_base, dst, src_base, src, numel, s);
        break;
    default:
        return kv__error(KV_ERR_INVALID_ARG, "kv_view_copy_cuda: element size %d", elem_bytes);
    }
    if (err != cudaSuccess)
        return kv__error(KV_ERR_UNSUPPORTED, "kv_view_copy_cuda: launch failed: %s (%s)",
                         cudaGetErrorName(err), cudaGetErrorString(err));
    return KV_OK;
}
