/* kv_arena_cuda.c - pinned host and device memory for arenas through the CUDA
 * runtime. Built only with CUDA (Makefile: *_cuda.c); declared in kv_arena_cuda_int.h. */
#include <cuda_runtime_api.h>

#include <stdio.h>

#include "kv_arena_cuda_int.h"

/* Copy of this thread's last error, so a message can quote it (kv__error
 * writes into the buffer kv_last_error() points to). */
static const char *why(char *buf, size_t cap)
{
    snprintf(buf, cap, "%s", kv_last_error());
    return buf;
}

/* KV_ERR_UNSUPPORTED when no device can be used (no driver, no GPU), with the
 * runtime's own words; KV_OK and *count >= 1 otherwise. */
kv_status kv__cuda_device_count(int *count)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    *count = 0;
    if (e != cudaSuccess) {
        /* Reset the runtime's last error so later calls start clean. */
        (void)cudaGetLastError();
        return kv__error(KV_ERR_UNSUPPORTED, "CUDA: cudaGetDeviceCount failed: %s (%s, %d)",
                         cudaGetErrorString(e), cudaGetErrorName(e), (int)e);
    }
    if (n <= 0)
        return kv__error(KV_ERR_UNSUPPORTED, "CUDA: cudaGetDeviceCount found no device (0)");
    *count = n;
    return KV_OK;
}

kv_status kv__cuda_host_alloc(size_t bytes, void **out)
{
    int n;
    void *p = NULL;
    char buf[256];
    cudaError_t e;
    kv_status s = kv__cuda_device_count(&n);
    if (s != KV_OK)
        return kv__error(s, "pinned host memory (%zu bytes) needs a CUDA device: %s", bytes,
                         why(buf, sizeof(buf)));
    e = cudaMallocHost(&p, bytes);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return kv__error(e == cudaErrorMemoryAllocation ? KV_ERR_NO_MEMORY : KV_ERR_INTERNAL,
                         "cudaMallocHost(%zu bytes) failed: %s (%s)", bytes, cudaGetErrorString(e),
                         cudaGetErrorName(e));
    }
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
    int n, prev = 0;
    void *p = NULL;
    char buf[256];
    cudaError_t e;
    kv_status s = kv__cuda_device_count(&n);
    if (s != KV_OK)
        return kv__error(s, "device memory (%zu bytes on device %d) needs a CUDA device: %s", bytes,
                         device, why(buf, sizeof(buf)));
    if (device < 0 || device >= n)
        return kv__error(KV_ERR_INVALID_ARG, "device memory: device %d out of range [0, %d)",
                         device, n);
    /* cudaMalloc allocates on the current device: switch to `device` for the
     * call and restore the caller's current device afterwards, so creating a
     * cache never moves the calling thread to another GPU. */
    e = cudaGetDevice(&prev);
    if (e == cudaSuccess)
        e = cudaSetDevice(device);
    if (e == cudaSuccess) {
        e = cudaMalloc(&p, bytes);
        (void)cudaSetDevice(prev);
    }
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return kv__error(e == cudaErrorMemoryAllocation ? KV_ERR_NO_MEMORY : KV_ERR_INTERNAL,
                         "cudaMalloc(%zu bytes) on device %d failed: %s (%s)", bytes, device,
                         cudaGetErrorString(e), cudaGetErrorName(e));
    }
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
