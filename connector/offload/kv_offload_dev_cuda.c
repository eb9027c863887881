/*
 * kv_offload_dev_cuda.c - the CUDA runtime's table of the offload tier's
 * device seam (kv_offload_dev_int.h); CUDA builds only. Each entry first
 * sets the calling thread (the tier's worker: every seam call is made
 * there) to
 *   - the cache's device (cudaSetDevice: the worker serves caches of any
 *     device), then
 *   - the thread-local stream capture mode
 *     (cudaThreadExchangeStreamCaptureMode). In the default global mode, a
 *     thread may not make "potentially unsafe" calls while any other
 *     thread captures a CUDA graph in global mode (PyTorch's default), and
 *     such a call fails and invalidates that capture: a watchdog thread's
 *     cudaEventQuery did exactly that to PyTorch's captures, fixed the same
 *     way (pytorch/pytorch#104555, #148594). The worker synchronizes its
 *     own event, and the plan copy's narrow path allocates stream-ordered
 *     and uploads from pageable memory; none of it touches a capturing
 *     stream, so the engine's captures are no concern of this thread
 *     (tests/gpu/test_gpu_offload.c stores and loads during one). The mode
 *     is set after the device, so no context is made on another device.
 */
#include <cuda_runtime_api.h>

#include "kv_cuda_lib.h"
#include "kv_offload_cuda_int.h"

static kv_status on_device(int device, const char *what)
{
    kv_status st = kv__cuda_status(cudaSetDevice(device), what);
    enum cudaStreamCaptureMode mode = cudaStreamCaptureModeThreadLocal;
    if (st == KV_OK)
        st = kv__cuda_status(cudaThreadExchangeStreamCaptureMode(&mode),
                             "offload: cudaThreadExchangeStreamCaptureMode");
    return st;
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

static kv_status cu_stream_sync(int device, void *stream)
{
    kv_status st = on_device(device, "offload: cudaSetDevice");
    return st == KV_OK ? kv__cuda_status(cudaStreamSynchronize((cudaStream_t)stream),
                                         "offload: cudaStreamSynchronize")
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
    .stream_sync = cu_stream_sync,
    .copy = cu_copy,
};

const struct kv__offdev_ops *kv__offdev_cuda(void)
{
    return &cuda_ops;
}
