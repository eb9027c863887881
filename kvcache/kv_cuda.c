/* kv_cuda.c - the CUDA runtime services of kv_cuda_lib.h (CUDA builds only:
 * the Makefile compiles *_cuda.c files only with CUDA). */
#include <stdio.h>

#include "kv_cuda_lib.h"

kv_status kv__cuda_status(cudaError_t e, const char *what)
{
    kv_status st;

    if (e == cudaSuccess)
        return KV_OK;
    (void)cudaGetLastError(); /* reset the runtime's last error */
    switch (e) {
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
        st = KV_ERR_UNSUPPORTED;
        break;
    case cudaErrorMemoryAllocation:
        st = KV_ERR_NO_MEMORY;
        break;
    default:
        st = KV_ERR_DEVICE;
        break;
    }
    return kv__error(st, "%s: %s (%s)", what, cudaGetErrorName(e), cudaGetErrorString(e));
}

kv_status kv__cuda_ready(const char *fn, int *count)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);

    if (count)
        *count = 0;
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return kv__error(KV_ERR_UNSUPPORTED,
                         "%s: no usable CUDA device: cudaGetDeviceCount: %s (%s)", fn,
                         cudaGetErrorName(e), cudaGetErrorString(e));
    }
    if (n <= 0)
        return kv__error(KV_ERR_UNSUPPORTED,
                         "%s: no usable CUDA device: cudaGetDeviceCount found 0", fn);
    if (count)
        *count = n;
    return KV_OK;
}
