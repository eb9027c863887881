/*
 * kv_dlpack.h - strided views as DLPack tensors and back, zero-copy (the
 * header of Debian's libdlpack-dev, DLPack 0.6: DLManagedTensor).
 *
 * Export: a kv_view on a device becomes a DLManagedTensor whose data is the
 * view's storage base, byte_offset its offset in bytes, and shape and
 * strides (in elements) its own, so torch.from_dlpack / numpy.from_dlpack
 * see exactly the elements the view does, without a copy. The tensor owns
 * only its metadata; the memory belongs to whoever exported it, which
 * passes a release callback that the tensor's deleter calls (allocator/
 * kv_cache.h's kv_cache_to_dlpack holds a reference on the cache that way).
 *
 * Import: a DLManagedTensor (borrowed) becomes a kv_view over its memory,
 * every field checked first.
 *
 * dtypes: f32, f16, bf16, f64 (kDLFloat / kDLBfloat), i8, i32, i64 (kDLInt),
 * u8 (kDLUInt), lanes 1. DLPack 0.6 has no fp8 type: fp8 views are refused
 * on export (export a u8 view of the same bytes instead).
 * Devices: kDLCPU, kDLCUDAHost (pinned host memory), kDLCUDA.
 *
 * Thread safety: pure functions of their arguments; a tensor's deleter may
 * run on any thread.
 */
#ifndef KV_DLPACK_H
#define KV_DLPACK_H

#include <dlpack/dlpack.h>

#include "kv_status.h"
#include "kv_view.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Called by an exported tensor's deleter, once, with the owner given at
 * export (may be NULL: nothing is called). */
typedef void (*kv_dlpack_release_fn)(void *owner);

/*
 * Export view v on device dev as a new DLManagedTensor (*out, set only on
 * success): dl_tensor.data = v->base, byte_offset = v->offset * elem bytes,
 * ndim, shape and strides as the view's (strides always given, never NULL),
 * dtype from v->dtype with lanes 1, device dev. The deleter frees the
 * metadata and then calls release(owner).
 * KV_ERR_NULL (v or out); the refusals of kv_view_check (a view that breaks
 * its invariants); KV_ERR_INVALID_ARG (a device type other than kDLCPU,
 * kDLCUDAHost, kDLCUDA, or a negative device id); KV_ERR_UNSUPPORTED (fp8:
 * DLPack 0.6 has no such type); KV_ERR_NO_MEMORY. On failure release is not
 * called.
 */
KV_API KV_NODISCARD kv_status kv_view_to_dlpack(const struct kv_view *v, DLDevice dev,
                                                kv_dlpack_release_fn release, void *owner,
                                                DLManagedTensor **out);

/*
 * The view of tensor t (*out) and its device (*dev, may be NULL). t is
 * borrowed: it must outlive the view (call its deleter when done with
 * both). base = dl_tensor.data, offset = byte_offset / elem bytes,
 * storage_bytes = what the view reaches (byte_offset + its last element);
 * strides NULL means compact row-major.
 * KV_ERR_NULL (t or out; data NULL with elements to address);
 * KV_ERR_UNSUPPORTED (a device type other than kDLCPU / kDLCUDAHost /
 * kDLCUDA; lanes != 1; a (code, bits) pair kvcache has no dtype for);
 * KV_ERR_BAD_DIM (ndim outside 0..8); KV_ERR_BAD_SHAPE (a negative size);
 * KV_ERR_INVALID_ARG (a negative stride: kvcache views have none; a
 * byte_offset that is not a multiple of the element size; data not aligned
 * to the element size); KV_ERR_OVERFLOW. Each message names the field and
 * its value. *out and *dev are untouched on failure.
 */
KV_API KV_NODISCARD kv_status kv_view_from_dlpack(const DLManagedTensor *t, struct kv_view *out,
                                                  DLDevice *dev);

#ifdef __cplusplus
}
#endif

#endif /* KV_DLPACK_H */
