/*
 * kv_xport_gpu_cuda.c - which GPU a device pointer is on, as a PCI address
 * (kv_xport_cuda_int.h); CUDA builds only. Two runtime calls, no context
 * made on another device than the pointer's: cudaPointerGetAttributes
 * needs none, cudaDeviceGetPCIBusId takes the ordinal.
 */
#include <cuda_runtime_api.h>

#include "kv_xport_cuda_int.h"

int kv__xport_cuda_busid(const void *ptr, char *busid, size_t cap)
{
    if (cap)
        busid[0] = '\0';
    if (!ptr || cap < 13 || cap > (size_t)1 << 20) /* "0000:00:00.0" */
        return -1;
    struct cudaPointerAttributes a;
    if (cudaPointerGetAttributes(&a, ptr) != cudaSuccess) {
        (void)cudaGetLastError(); /* not sticky: cleared for the caller's next check */
        return -1;
    }
    if (a.type != cudaMemoryTypeDevice) /* managed memory migrates: no one GPU */
        return -1;
    if (a.device < 0 || cudaDeviceGetPCIBusId(busid, (int)cap, a.device) != cudaSuccess) {
        (void)cudaGetLastError();
        busid[0] = '\0';
        return -1;
    }
    return 0;
}
