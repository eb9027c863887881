/*
 * kv_offload_dev_int.h - the offload tier's device seam (module-private):
 * every CUDA call the tier makes for a KV_MEM_DEVICE cache goes through one
 * ops table, so a CPU test can put a strict CUDA double underneath (as the
 * RDMA transport's kv_verbs_int.h does for verbs). Two tables exist:
 *
 *   kv__offdev_cuda()   the CUDA runtime (kv_offload_dev_cuda.c, CUDA builds;
 *                       NULL otherwise: kv_offload_cuda_int.h)
 *   kvt_softcuda_ops()  a CUDA double for tests (tests/softcuda): its device
 *                       and pinned memory are host memory it tracks, its
 *                       streams run their work on threads
 *
 * The tier (kv_offload_worker.c) uses them so:
 *
 *   stream_create(device)         one non-blocking stream per device, the
 *                                 tier's own (never an engine's stream; it
 *                                 does not wait on the legacy default stream)
 *   copy(...) x blocks of a chunk  the plan copy, cache block <-> entry in the
 *                                 pinned region, asynchronous on that stream
 *   event_record + event_sync     the worker waits on its own event, nothing
 *                                 else: no device synchronize
 *   stream_sync                   only when that record or wait failed: the
 *                                 copies may still run, so the worker waits
 *                                 for its own stream before their memory is
 *                                 freed or reused (kv_offload_worker.c)
 *
 *   stream/event_destroy          by the worker as it exits
 *
 * Every entry returns a kv_status with the CUDA error in the message
 * (kv_cuda_lib.h's mapping); handles are opaque pointers (cudaStream_t,
 * cudaEvent_t). Every entry sets the calling thread's CUDA device
 * (cudaSetDevice) and leaves it set, so the tier calls them on its worker
 * thread alone, never on an engine's (whose current device is its own).
 */
#ifndef KV_OFFLOAD_DEV_INT_H
#define KV_OFFLOAD_DEV_INT_H

#include <stdbool.h>
#include <stdint.h>

#include "kv_paged.h"
#include "kv_plan.h"

/* Bumped whenever an entry is added, removed or changes meaning. */
#define KV__OFFDEV_VERSION 2

struct kv__offdev_ops {
    uint32_t version; /* KV__OFFDEV_VERSION */
    const char *name; /* "cuda", "softcuda" */
    /* cudaSetDevice + cudaStreamCreateWithFlags(cudaStreamNonBlocking) */
    kv_status (*stream_create)(int device, void **stream);
    /* cudaStreamDestroy: the caller has waited for every event on it */
    kv_status (*stream_destroy)(int device, void *stream);
    /* cudaEventCreateWithFlags(cudaEventDisableTiming | cudaEventBlockingSync) */
    kv_status (*event_create)(int device, void **event);
    kv_status (*event_destroy)(int device, void *event);
    /* cudaEventRecord(event, stream) */
    kv_status (*event_record)(int device, void *event, void *stream);
    /* cudaEventSynchronize: the calling thread sleeps until the work
     * recorded before event is done (never a stream or device sync) */
    kv_status (*event_sync)(int device, void *event);
    /* cudaStreamSynchronize of the tier's own stream: the fallback when
     * event_record or event_sync failed (never an engine's stream) */
    kv_status (*stream_sync)(int device, void *stream);
    /* kv_plan_copy_cuda of one block, src_block of src -> dst_block of dst
     * (n_tokens: plan's page size), asynchronous on stream */
    kv_status (*copy)(int device, const kv_plan *plan, const struct kv_paged_cache *src,
                      uint32_t src_block, const struct kv_paged_cache *dst, uint32_t dst_block,
                      uint64_t n_tokens, void *stream);
};

/* Install ops as the table new tiers use (tests); NULL restores the CUDA
 * one. A tier keeps the table it was created with. */
void kv__offdev_set(const struct kv__offdev_ops *ops);

/* The table a tier created now uses: the installed one, else
 * kv__offdev_cuda() (NULL without CUDA). */
const struct kv__offdev_ops *kv__offdev_get(void);

#endif /* KV_OFFLOAD_DEV_INT_H */
