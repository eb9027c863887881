/* kv_dlpack.c - strided views as DLPack tensors and back (kv_dlpack.h). */
#include <inttypes.h>
#include <stdint.h>
#include <string.h>

#include "kv_dlpack.h"
#include "kv_lib.h"
#include "kv_mem.h"

/* One allocation per exported tensor: the managed tensor, its shape and
 * strides, and the owner to release. */
struct kv__dlpack_export {
    DLManagedTensor mt;
    int64_t shape[KV_MAX_DIMS];
    int64_t strides[KV_MAX_DIMS];
    kv_dlpack_release_fn release;
    void *owner;
};

/* kvcache dtype <-> DLPack (code, bits); lanes are always 1. */
static const struct {
    kv_dtype dt;
    uint8_t code, bits;
} kv__dl_types[] = {
    {KV_F32, kDLFloat, 32}, {KV_F16, kDLFloat, 16}, {KV_BF16, kDLBfloat, 16},
    {KV_F64, kDLFloat, 64}, {KV_I8, kDLInt, 8},     {KV_I32, kDLInt, 32},
    {KV_I64, kDLInt, 64},   {KV_U8, kDLUInt, 8},
};
#define KV__DL_NTYPES (sizeof(kv__dl_types) / sizeof(kv__dl_types[0]))

static bool device_ok(DLDeviceType t)
{
    return t == kDLCPU || t == kDLCUDAHost || t == kDLCUDA;
}

static const char *device_name(DLDeviceType t)
{
    switch (t) {
    case kDLCPU:
        return "kDLCPU";
    case kDLCUDA:
        return "kDLCUDA";
    case kDLCUDAHost:
        return "kDLCUDAHost";
    case kDLCUDAManaged:
        return "kDLCUDAManaged";
    case kDLROCM:
        return "kDLROCM";
    case kDLOpenCL:
        return "kDLOpenCL";
    default:
        return "another device type";
    }
}

static void kv__dlpack_deleter(DLManagedTensor *self)
{
    if (!self)
        return;
    struct kv__dlpack_export *e = self->manager_ctx;
    kv_dlpack_release_fn release = e->release;
    void *owner = e->owner;
    kv__mem_free(e);
    if (release)
        release(owner);
}

kv_status kv_view_to_dlpack(const struct kv_view *v, DLDevice dev, kv_dlpack_release_fn release,
                            void *owner, DLManagedTensor **out)
{
    if (!v || !out)
        return kv__error(KV_ERR_NULL, "kv_view_to_dlpack: %s is NULL", !v ? "v" : "out");
    kv_status st = kv_view_check(v);
    if (st != KV_OK)
        return kv__error_wrap(st, "kv_view_to_dlpack");
    if (!device_ok(dev.device_type) || dev.device_id < 0)
        return kv__error(KV_ERR_INVALID_ARG,
                         "kv_view_to_dlpack: device (%s = %d, id %d): kvcache exports to kDLCPU, "
                         "kDLCUDAHost and kDLCUDA with an id >= 0",
                         device_name(dev.device_type), (int)dev.device_type, dev.device_id);
    size_t k = 0;
    while (k < KV__DL_NTYPES && kv__dl_types[k].dt != v->dtype)
        k++;
    if (k == KV__DL_NTYPES)
        return kv__error(KV_ERR_UNSUPPORTED,
                         "kv_view_to_dlpack: dtype %s has no DLPack 0.6 type (export a u8 view "
                         "of the same bytes)",
                         kv_dtype_name(v->dtype));
    struct kv__dlpack_export *e = kv__mem_calloc(1, sizeof(*e));
    if (!e)
        return kv__error(KV_ERR_NO_MEMORY, "kv_view_to_dlpack: %zu bytes", sizeof(*e));
    for (int i = 0; i < v->ndim; i++) {
        e->shape[i] = v->shape[i];
        e->strides[i] = v->strides[i];
    }
    e->release = release;
    e->owner = owner;
    DLTensor *t = &e->mt.dl_tensor;
    /* data at the first element, byte_offset 0: what PyTorch, CuPy and
     * NumPy export themselves. PyTorch up to at least 1.13 ignores
     * byte_offset on import, so an offset carried there would alias the
     * wrong memory without a word. */
    /* an empty view addresses nothing: exported at its base (its offset,
     * which no element checks bound, could overflow the multiply) */
    int64_t numel = 1;
    for (int i = 0; i < v->ndim; i++)
        numel = v->shape[i] == 0 ? 0 : numel;
    t->data = !v->base     ? NULL
              : numel == 0 ? v->base
                           : (char *)v->base + v->offset * (int64_t)kv_dtype_size(v->dtype);
    t->device = dev;
    t->ndim = v->ndim;
    t->dtype = (DLDataType){kv__dl_types[k].code, kv__dl_types[k].bits, 1};
    t->shape = e->shape;
    t->strides = e->strides;
    t->byte_offset = 0;
    e->mt.manager_ctx = e;
    e->mt.deleter = kv__dlpack_deleter;
    *out = &e->mt;
    return kv__ok();
}

kv_status kv_view_from_dlpack(const DLManagedTensor *mt, struct kv_view *out, DLDevice *dev)
{
    static const char fn[] = "kv_view_from_dlpack";
    if (!mt || !out)
        return kv__error(KV_ERR_NULL, "%s: %s is NULL", fn, !mt ? "t" : "out");
    const DLTensor *t = &mt->dl_tensor;
    if (!device_ok(t->device.device_type))
        return kv__error(KV_ERR_UNSUPPORTED,
                         "%s: device type %s (%d): kvcache takes kDLCPU, kDLCUDAHost and kDLCUDA",
                         fn, device_name(t->device.device_type), (int)t->device.device_type);
    if (t->dtype.lanes != 1)
        return kv__error(KV_ERR_UNSUPPORTED, "%s: dtype lanes %u: kvcache takes lanes 1", fn,
                         (unsigned)t->dtype.lanes);
    size_t k = 0;
    while (k < KV__DL_NTYPES &&
           (kv__dl_types[k].code != t->dtype.code || kv__dl_types[k].bits != t->dtype.bits))
        k++;
    if (k == KV__DL_NTYPES)
        return kv__error(KV_ERR_UNSUPPORTED,
                         "%s: dtype code %u bits %u: no kvcache dtype (f32 f16 bf16 f64 i8 i32 "
                         "i64 u8)",
                         fn, (unsigned)t->dtype.code, (unsigned)t->dtype.bits);
    const kv_dtype dt = kv__dl_types[k].dt;
    if (t->ndim < 0 || t->ndim > KV_MAX_DIMS)
        return kv__error(KV_ERR_BAD_DIM, "%s: ndim %d outside 0..%d", fn, t->ndim, KV_MAX_DIMS);
    if (t->ndim > 0 && !t->shape)
        return kv__error(KV_ERR_NULL, "%s: shape is NULL with ndim %d", fn, t->ndim);
    /* Strides as given, or compact row-major; the rest (negative sizes or
     * strides, the offset's alignment, the extent, the base) is
     * kv_view_from_strided's, the one geometry check of a view made from
     * outside memory. */
    int64_t strides[KV_MAX_DIMS];
    if (t->strides) {
        for (int i = 0; i < t->ndim; i++)
            strides[i] = t->strides[i];
    } else {
        /* the size of dim 0 is in no stride: [4, 2^61, 0] is an empty
         * tensor with strides [2^61, 1, 1] */
        int64_t s = 1;
        for (int i = t->ndim - 1; i >= 0; i--) {
            strides[i] = s;
            if (i > 0 && t->shape[i] > 1 && !kv__mul_i64(s, t->shape[i], &s)) {
                char b[160];
                return kv__error(KV_ERR_OVERFLOW,
                                 "%s: compact strides of shape %s overflow int64 (the stride of "
                                 "dim %d)",
                                 fn, kv__fmt_list(b, sizeof(b), t->shape, t->ndim), i - 1);
            }
        }
    }
    if (t->byte_offset > (uint64_t)INT64_MAX)
        return kv__error(KV_ERR_OVERFLOW, "%s: byte_offset %" PRIu64 " overflows", fn,
                         t->byte_offset);
    struct kv_view v;
    kv_status st = kv_view_from_strided(t->data, 0, dt, t->ndim, t->shape, strides,
                                        (int64_t)t->byte_offset, &v);
    if (st != KV_OK)
        return kv__error_wrap(st, "%s", fn);
    *out = v;
    if (dev)
        *dev = t->device;
    return kv__ok();
}

static kv_py_capsule_is_valid_fn kv__capsule_is_valid;
static kv_py_capsule_get_pointer_fn kv__capsule_get_pointer;

void kv_dlpack_capsule_api(kv_py_capsule_is_valid_fn is_valid,
                           kv_py_capsule_get_pointer_fn get_pointer)
{
    __atomic_store_n(&kv__capsule_get_pointer, get_pointer, __ATOMIC_RELEASE);
    __atomic_store_n(&kv__capsule_is_valid, is_valid, __ATOMIC_RELEASE);
}

void kv_dlpack_capsule_destructor(void *capsule)
{
    kv_py_capsule_is_valid_fn is_valid = __atomic_load_n(&kv__capsule_is_valid, __ATOMIC_ACQUIRE);
    kv_py_capsule_get_pointer_fn get = __atomic_load_n(&kv__capsule_get_pointer, __ATOMIC_ACQUIRE);
    if (!capsule || !is_valid || !get || !is_valid(capsule, "dltensor"))
        return; /* consumed ("used_dltensor"): its new owner frees it */
    DLManagedTensor *mt = get(capsule, "dltensor");
    if (mt && mt->deleter)
        mt->deleter(mt);
}
