/*
 * kv_arena_cuda_int.h - the CUDA boundary of the allocator module (private).
 *
 * The only place in allocator/ where KV_HAVE_CUDA is tested. With CUDA the
 * calls are implemented in kv_arena_cuda.c (the only file that includes
 * <cuda_runtime_api.h>); without it they are inline stubs returning
 * KV_ERR_UNSUPPORTED with a message that says so.
 *
 * Every call returns a kv_status and, on failure, records detail with
 * kv__error(): the CUDA function, the cudaError_t name and string, the size
 * and the device involved. A build with CUDA on a host without a GPU (or
 * without a driver) fails at run time with KV_ERR_UNSUPPORTED and the
 * cudaGetDeviceCount() error string; nothing is allocated.
 */
#ifndef KV_ARENA_CUDA_INT_H
#define KV_ARENA_CUDA_INT_H

#include <stddef.h>

#include "kv_lib.h"

#if KV_HAVE_CUDA

/* Number of usable CUDA devices in *count (>= 1) or KV_ERR_UNSUPPORTED. */
kv_status kv__cuda_device_count(int *count);

/* bytes of page-locked host memory (cudaMallocHost) in *out. */
kv_status kv__cuda_host_alloc(size_t bytes, void **out);
void kv__cuda_host_free(void *p);

/* bytes of device memory on `device` (cudaSetDevice + cudaMalloc) in *out. */
kv_status kv__cuda_device_alloc(int device, size_t bytes, void **out);
void kv__cuda_device_free(int device, void *p);

#else /* !KV_HAVE_CUDA */

static inline kv_status kv__cuda_device_count(int *count)
{
    *count = 0;
    return kv__error(KV_ERR_UNSUPPORTED, "CUDA: this build has no CUDA support (KV_HAVE_CUDA=0)");
}

static inline kv_status kv__cuda_host_alloc(size_t bytes, void **out)
{
    (void)out;
    return kv__error(KV_ERR_UNSUPPORTED,
                     "pinned host memory (%zu bytes): this build has no CUDA support "
                     "(KV_HAVE_CUDA=0)",
                     bytes);
}

static inline void kv__cuda_host_free(void *p)
{
    (void)p;
}

static inline kv_status kv__cuda_device_alloc(int device, size_t bytes, void **out)
{
    (void)out;
    return kv__error(KV_ERR_UNSUPPORTED,
                     "device memory (%zu bytes on device %d): this build has no CUDA support "
                     "(KV_HAVE_CUDA=0)",
                     bytes, device);
}

static inline void kv__cuda_device_free(int device, void *p)
{
    (void)device;
    (void)p;
}

#endif /* KV_HAVE_CUDA */

#endif /* KV_ARENA_CUDA_INT_H */
