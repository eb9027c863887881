/*
 * kv_offload_cuda_int.h - the CUDA boundary of the offload tier
 * (module-private): the CUDA runtime's table of the device seam
 * (kv_offload_dev_int.h). `#if KV_HAVE_CUDA` appears here and nowhere else
 * in connector/offload/. Without CUDA there is no table: a device cache is
 * refused (KV_ERR_UNSUPPORTED) unless a test installed its double.
 */
#ifndef KV_OFFLOAD_CUDA_INT_H
#define KV_OFFLOAD_CUDA_INT_H

#include "kv_offload_dev_int.h"

#if KV_HAVE_CUDA

/* The CUDA runtime's table (kv_offload_dev_cuda.c; static storage). */
const struct kv__offdev_ops *kv__offdev_cuda(void);

#else /* !KV_HAVE_CUDA */

static inline const struct kv__offdev_ops *kv__offdev_cuda(void)
{
    return NULL;
}

#endif /* KV_HAVE_CUDA */

#endif /* KV_OFFLOAD_CUDA_INT_H */
