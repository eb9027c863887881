/*
 * kv_xport_cuda_int.h - the CUDA boundary of the transport (module-private):
 * the one thing the transport asks CUDA, which GPU a device pointer lives
 * on, as its PCI address, for the RDMA backend's choice of the rail
 * nearest that GPU (docs/connector.md, "Where a region lives"). `#if
 * KV_HAVE_CUDA` appears here and nowhere else in connector/transport/.
 * Without CUDA the answer is "not known", which sends the choice back to
 * the NUMA node / round robin; it is never an error.
 */
#ifndef KV_XPORT_CUDA_INT_H
#define KV_XPORT_CUDA_INT_H

#include <stddef.h>

#if KV_HAVE_CUDA

/* The PCI bus id of the GPU owning device pointer ptr, as CUDA writes it
 * (cudaPointerGetAttributes -> device ordinal -> cudaDeviceGetPCIBusId:
 * "00000000:03:00.0"), into busid[cap]: 0; -1 when not known (no driver
 * or device, not a device pointer, an error: CUDA's error state is
 * cleared). Thread-safe (CUDA's runtime calls are). */
int kv__xport_cuda_busid(const void *ptr, char *busid, size_t cap);

#else /* !KV_HAVE_CUDA */

static inline int kv__xport_cuda_busid(const void *ptr, char *busid, size_t cap)
{
    (void)ptr;
    if (cap)
        busid[0] = '\0';
    return -1;
}

#endif /* KV_HAVE_CUDA */

#endif /* KV_XPORT_CUDA_INT_H */
