/*
 * kv_dlpack.h - strided views as DLPack tensors and back, zero-copy (the
 * header of Debian's libdlpack-dev, DLPack 0.6: DLManagedTensor).
 *
 * Export: a kv_view on a device becomes a DLManagedTensor whose data is the
 * address of the view's first element (byte_offset 0), and shape and
 * strides (in elements) its own, so torch.from_dlpack / numpy.from_dlpack
 * see exactly the elements the view does, without a copy. byte_offset is
 * left 0 on purpose: it is what PyTorch, CuPy and NumPy produce, and
 * PyTorch (1.13 at least) ignores it on import - an offset carried there
 * would silently alias the start of the storage instead. The tensor owns
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
 * success): dl_tensor.data = the address of the view's first element
 * (base + offset * elem bytes), byte_offset = 0, ndim, shape and strides as
 * the view's (strides always given, never NULL),
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

/*
 * For bindings without a C compiler (the Python package, ctypes): the
 * destructor of a PyCapsule named "dltensor" that holds a DLManagedTensor
 * from this library. A consumer that takes the tensor renames the capsule
 * "used_dltensor" and becomes its owner; otherwise the capsule still owns
 * it and this destructor runs its deleter. It is C, so it runs without
 * Python frames (a pending exception is left alone). The binding passes the
 * interpreter's PyCapsule_IsValid and PyCapsule_GetPointer once, with
 * kv_dlpack_capsule_api; until then the destructor does nothing.
 */
typedef int (*kv_py_capsule_is_valid_fn)(void *capsule, const char *name);
typedef void *(*kv_py_capsule_get_pointer_fn)(void *capsule, const char *name);
KV_API void kv_dlpack_capsule_api(kv_py_capsule_is_valid_fn is_valid,
                                  kv_py_capsule_get_pointer_fn get_pointer);
KV_API void kv_dlpack_capsule_destructor(void *capsule);

#ifdef __cplusplus
}
#endif

#endif /* KV_DLPACK_H */
