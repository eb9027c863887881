/* kv_arena_cuda.c - pinned host and device memory for arenas through the CUDA
 * runtime. Built only with CUDA (Makefile: *_cuda.c); declared in
 * kv_arena_cuda_int.h. Errors map to statuses through kv__cuda_status
 * (kvcache/kv_cuda_lib.h), the mapping every CUDA call of the library uses. */
#include <cuda_runtime_api.h>

#include <stdio.h>

#include "kv_arena_cuda_int.h"
#include "kv_cuda_lib.h"

kv_status kv__cuda_device_count(int *count)
{
    return kv__cuda_ready("CUDA", count);
}

kv_status kv__cuda_host_alloc(size_t bytes, void **out)
{
    char what[96];
    void *p = NULL;
    snprintf(what, sizeof(what), "pinned host memory (%zu bytes)", bytes);
    kv_status s = kv__cuda_ready(what, NULL);
    if (s != KV_OK)
        return s;
    snprintf(what, sizeof(what), "cudaMallocHost(%zu bytes)", bytes);
    s = kv__cuda_status(cudaMallocHost(&p, bytes), what);
    if (s != KV_OK)
        return s;
    *out = p;
    return KV_OK;
}

void kv__cuda_host_free(void *p)
{
    if (p)
        (void)cudaFreeHost(p);
}

kv_status kv__cuda_device_alloc(int device, size_t bytes, void **out)
{
    char what[96];
    int n = 0, prev = 0;
    void *p = NULL;
    snprintf(what, sizeof(what), "device memory (%zu bytes on device %d)", bytes, device);
    kv_status s = kv__cuda_ready(what, &n);
    if (s != KV_OK)
        return s;
    if (device < 0 || device >= n)
        return kv__error(KV_ERR_INVALID_ARG, "device memory: device %d out of range [0, %d)",
                         device, n);
    /* cudaMalloc allocates on the current device: switch to `device` for the
     * call and restore the caller's current device afterwards, so creating a
     * cache never moves the calling thread to another GPU. */
    cudaError_t e = cudaGetDevice(&prev);
    if (e == cudaSuccess)
        e = cudaSetDevice(device);
    if (e == cudaSuccess) {
        e = cudaMalloc(&p, bytes);
        (void)cudaSetDevice(prev);
    }
    snprintf(what, sizeof(what), "cudaMalloc(%zu bytes) on device %d", bytes, device);
    s = kv__cuda_status(e, what);
    if (s != KV_OK)
        return s;
    *out = p;
    return KV_OK;
}

void kv__cuda_device_free(int device, void *p)
{
    int prev = 0;
    if (!p)
        return;
    if (cudaGetDevice(&prev) != cudaSuccess)
        prev = device;
    (void)cudaSetDevice(device);
    (void)cudaFree(p);
    (void)cudaSetDevice(prev); /* leave the caller on its own device */
}
