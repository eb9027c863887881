/*
 * kv_cuda_lib.h - the CUDA runtime services every module's CUDA code shares
 * (library-internal; included only by *.cu and *_cuda.c files, which are
 * compiled only in CUDA builds, so this header needs no #if).
 *
 * The CUDA template every kernel follows (docs/design.md, "Backends"):
 *
 *   public entry (C)        validates with the one validator the CPU path
 *                           uses, builds the geometry with the one addressing
 *                           header (kv_view_hd.h), then calls
 *   <module>_cuda_int.h     the module's boundary: with CUDA, declarations of
 *                           the launchers; without, inline stubs returning
 *                           KV_ERR_UNSUPPORTED ("this build has no CUDA")
 *   <file>.cu               launchers: kv__cuda_ready() first, then the
 *                           launch on the caller's stream, then
 *                           kv__cuda_status() on cudaGetLastError(); never an
 *                           explicit synchronize. Launchers that upload host
 *                           index arrays (attention, the plan's narrow
 *                           copies) copy from pageable memory, which CUDA may
 *                           stage by synchronizing with the stream and which
 *                           graph capture cannot replay (docs/design.md)
 *
 * Status mapping of a CUDA error (kv__cuda_status):
 *   cudaErrorNoDevice, cudaErrorInsufficientDriver    KV_ERR_UNSUPPORTED
 *   cudaErrorMemoryAllocation                         KV_ERR_NO_MEMORY
 *   anything else (a failed launch, a bad stream...)  KV_ERR_DEVICE
 * each with the CUDA error's name and string in the message.
 */
#ifndef KV_CUDA_LIB_H
#define KV_CUDA_LIB_H

#include <cuda_runtime_api.h>

#include "kv_lib.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The kv_status for CUDA error e (KV_OK for cudaSuccess), with the message
 * "<what>: <cudaErrorName> (<string>)". Clears the runtime's sticky-free
 * last error so later calls start clean. */
kv_status kv__cuda_status(cudaError_t e, const char *what);

/* KV_OK when a CUDA device can be used; KV_ERR_UNSUPPORTED naming the
 * runtime's reason otherwise (no driver, no GPU). *count (may be NULL)
 * receives the number of devices. fn prefixes the message. */
kv_status kv__cuda_ready(const char *fn, int *count);

#ifdef __cplusplus
}
#endif

#endif /* KV_CUDA_LIB_H */
