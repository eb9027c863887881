/*
 * kv_offload_dev_cuda.c - the CUDA runtime's table of the offload tier's
 * device seam (kv_offload_dev_int.h); CUDA builds only. Each entry first
 * sets the calling thread (the tier's worker: every seam call is made
 * there) to
 *   - the cache's device (cudaSetDevice: the worker serves caches of any
 *     device), and
 *   - the relaxed stream capture mode (cudaThreadExchangeStreamCaptureMode):
 *     in the default global mode, an engine thread capturing a CUDA graph
 *     with cudaStreamCaptureModeGlobal (PyTorch's default) prohibits
 *     "potentially unsafe" calls on every other thread, and such a call
 *     invalidates that capture. The worker's calls never touch a capturing
 *     stream (its own stream, its own event, pinned and device memory), and
 *     the plan copy's narrow path uploads its tables from pageable memory
 *     and allocates stream-ordered: relaxed, they neither fail nor break
 *     the engine's graph (tests/gpu/test_gpu_offload.c captures one).
 */
#include <cuda_runtime_api.h>

#include "kv_cuda_lib.h"
#include "kv_offload_cuda_int.h"

static kv_status on_device(int device, const char *what)
{
    enum cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    kv_status st = kv__cuda_status(cudaThreadExchangeStreamCaptureMode(&mode),
                                   "offload: cudaThreadExchangeStreamCaptureMode");
    return st == KV_OK ? kv__cuda_status(cudaSetDevice(device), what) : st;
}

static kv_status cu_stream_create(int device, void **stream)
{
    kv_status st = on_device(device, "offload: cudaSetDevice");
    cudaStream_t s = NULL;
    if (st == KV_OK)
        st = kv__cuda_status(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking),
                             "offload: cudaStreamCreateWithFlags");
    if (st == KV_OK)
        *stream = s;
    return st;
}

static kv_status cu_stream_destroy(int device, void *stream)
{
    kv_status st = on_device(device, "offload: cudaSetDevice");
    return st == KV_OK ? kv__cuda_status(cudaStreamDestroy((cudaStream_t)stream),
                                         "offload: cudaStreamDestroy")
                       : st;
}

static kv_status cu_event_create(int device, void **event)
{
    kv_status st = on_device(device, "offload: cudaSetDevice");
    cudaEvent_t e = NULL;
    if (st == KV_OK)
        st = kv__cuda_status(
            cudaEventCreateWithFlags(&e, cudaEventDisableTiming | cudaEventBlockingSync),
            "offload: cudaEventCreateWithFlags");
    if (st == KV_OK)
        *event = e;
    return st;
}

static kv_status cu_event_destroy(int device, void *event)
{
    kv_status st = on_device(device, "offload: cudaSetDevice");
    return st == KV_OK
               ? kv__cuda_status(cudaEventDestroy((cudaEvent_t)event), "offload: cudaEventDestroy")
               : st;
}

static kv_status cu_event_record(int device, void *event, void *stream)
{
    kv_status st = on_device(device, "offload: cudaSetDevice");
    return st == KV_OK ? kv__cuda_status(cudaEventRecord((cudaEvent_t)event, (cudaStream_t)stream),
                                         "offload: cudaEventRecord")
                       : st;
}

static kv_status cu_event_sync(int device, void *event)
{
    kv_status st = on_device(device, "offload: cudaSetDevice");
    return st == KV_OK ? kv__cuda_status(cudaEventSynchronize((cudaEvent_t)event),
                                         "offload: cudaEventSynchronize")
                       : st;
}

static kv_status cu_copy(int device, const kv_plan *plan, const struct kv_paged_cache *src,
                         uint32_t src_block, const struct kv_paged_cache *dst, uint32_t dst_block,
                         uint64_t n_tokens, void *stream)
{
    kv_status st = on_device(device, "offload: cudaSetDevice");
    if (st != KV_OK)
        return st;
    return kv_plan_copy_cuda(plan, *src, &src_block, 1, *dst, &dst_block, 1, n_tokens,
                             (kv_cuda_stream)stream);
}

static const struct kv__offdev_ops cuda_ops = {
    .version = KV__OFFDEV_VERSION,
    .name = "cuda",
    .stream_create = cu_stream_create,
    .stream_destroy = cu_stream_destroy,
    .event_create = cu_event_create,
    .event_destroy = cu_event_destroy,
    .event_record = cu_event_record,
    .event_sync = cu_event_sync,
    .copy = cu_copy,
};

const struct kv__offdev_ops *kv__offdev_cuda(void)
{
    return &cuda_ops;
}
