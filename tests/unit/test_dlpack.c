/*
 * test_dlpack.c - kvcache/kv_dlpack.h and kv_cache_to_dlpack.
 *   - export: every dtype's (code, bits, lanes), data / byte_offset / shape /
 *     strides exact for permuted, sliced, strided and expanded views; every
 *     element's address through the DLPack fields equals kv_view_ptr's;
 *   - the deleter frees the metadata and calls release once;
 *   - import: a round trip gives back the same elements; NULL strides mean
 *     row-major; each refusal (device, lanes, dtype, ndim, shape, stride,
 *     byte_offset, alignment, NULL data) names its field, leaves *out alone;
 *   - kv_cache_to_dlpack: the device from the arena, a view outside the
 *     arena refused, and lifetime: a tensor that outlives kv_cache_destroy
 *     keeps the arena valid (written and read through the tensor) until
 *     its deleter runs (ASan in CI sees a use after free or a leak).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <kvcache/kv.h>

#include "kvtest.h"

static int released;
static void *released_owner;

static void count_release(void *owner)
{
    released++;
    released_owner = owner;
}

/* The address of index idx through a DLTensor's fields alone. */
static const char *dl_addr(const DLTensor *t, const int64_t *idx)
{
    int64_t off = 0;
    for (int i = 0; i < t->ndim; i++)
        off += idx[i] * t->strides[i];
    return (const char *)t->data + t->byte_offset + off * (t->dtype.bits / 8);
}

/* Every element of v reached through t sits where kv_view_ptr says. */
static void check_same_elements(const struct kv_view *v, const DLTensor *t)
{
    assert_int_equal(t->ndim, v->ndim);
    int64_t n = kv_view_numel(v), idx[KV_MAX_DIMS] = {0};
    for (int64_t e = 0; e < n; e++) {
        assert_ptr_equal(dl_addr(t, idx), kv_view_ptr(v, idx));
        for (int d = v->ndim - 1; d >= 0; d--) {
            if (++idx[d] < v->shape[d])
                break;
            idx[d] = 0;
        }
    }
}

static void test_dlpack_export(void **state)
{
    (void)state;
    static const struct {
        kv_dtype dt;
        uint8_t code, bits;
    } types[] = {{KV_F32, kDLFloat, 32}, {KV_F16, kDLFloat, 16}, {KV_BF16, kDLBfloat, 16},
                 {KV_F64, kDLFloat, 64}, {KV_I8, kDLInt, 8},     {KV_I32, kDLInt, 32},
                 {KV_I64, kDLInt, 64},   {KV_U8, kDLUInt, 8}};
    _Alignas(64) static unsigned char buf[1 << 16];
    for (size_t k = 0; k < sizeof(types) / sizeof(types[0]); k++) {
        struct kv_view v, w;
        const int64_t shape[4] = {3, 4, 5, 6};
        assert_int_equal(kv_view_init(buf, sizeof(buf) / 2, types[k].dt, 4, shape, &v), KV_OK);
        /* permuted, narrowed, strided: offset and strides non-trivial */
        const int perm[4] = {2, 0, 3, 1};
        assert_int_equal(kv_view_permute(&v, perm, 4, &w), KV_OK);
        assert_int_equal(kv_view_narrow(&w, 0, 1, 3, &w), KV_OK);
        assert_int_equal(kv_view_slice(&w, 2, 1, 6, 2, &w), KV_OK);
        DLManagedTensor *mt = NULL;
        released = 0;
        assert_int_equal(kv_view_to_dlpack(&w, (DLDevice){kDLCPU, 0}, count_release, &buf[7], &mt),
                         KV_OK);
        const DLTensor *t = &mt->dl_tensor;
        /* the first element's address, byte_offset 0 (PyTorch ignores it) */
        assert_ptr_equal(t->data, buf + (size_t)w.offset * kv_dtype_size(types[k].dt));
        assert_int_equal(t->byte_offset, 0);
        assert_true(w.offset > 0);
        assert_int_equal(t->dtype.code, types[k].code);
        assert_int_equal(t->dtype.bits, types[k].bits);
        assert_int_equal(t->dtype.lanes, 1);
        assert_int_equal(t->device.device_type, kDLCPU);
        for (int i = 0; i < 4; i++) {
            assert_int_equal(t->shape[i], w.shape[i]);
            assert_int_equal(t->strides[i], w.strides[i]);
        }
        check_same_elements(&w, t);
        /* back: the same elements, the storage the view reaches */
        struct kv_view x;
        DLDevice dev = {kDLOpenCL, 9};
        assert_int_equal(kv_view_from_dlpack(mt, &x, &dev), KV_OK);
        assert_int_equal(dev.device_type, kDLCPU);
        assert_int_equal(x.dtype, types[k].dt);
        assert_int_equal(x.offset, 0);
        check_same_elements(&x, t);
        int64_t lo, hi;
        kv_view_extent_bytes(&w, &lo, &hi);
        assert_int_equal((int64_t)x.storage_bytes,
                         hi - w.offset * (int64_t)kv_dtype_size(types[k].dt));
        mt->deleter(mt);
        assert_int_equal(released, 1);
        assert_ptr_equal(released_owner, &buf[7]);
    }
    /* an expanded (stride 0) view and a 0-d view; no release callback */
    struct kv_view v, e;
    const int64_t s1[1] = {4}, s3[3] = {2, 4, 3};
    assert_int_equal(kv_view_init(buf, 64, KV_F32, 1, s1, &v), KV_OK);
    assert_int_equal(kv_view_unsqueeze(&v, 1, &e), KV_OK);
    assert_int_equal(kv_view_expand(&e, 3, (const int64_t[]){2, 4, 3}, &e), KV_OK);
    (void)s3;
    DLManagedTensor *mt;
    assert_int_equal(kv_view_to_dlpack(&e, (DLDevice){kDLCUDA, 3}, NULL, NULL, &mt), KV_OK);
    assert_int_equal(mt->dl_tensor.strides[0], 0);
    assert_int_equal(mt->dl_tensor.device.device_id, 3);
    check_same_elements(&e, &mt->dl_tensor);
    mt->deleter(mt);
    struct kv_view z;
    assert_int_equal(kv_view_select(&v, 0, 2, &z), KV_OK);
    assert_int_equal(kv_view_to_dlpack(&z, (DLDevice){kDLCUDAHost, 0}, NULL, NULL, &mt), KV_OK);
    assert_int_equal(mt->dl_tensor.ndim, 0);
    assert_ptr_equal(mt->dl_tensor.data, buf + 8);
    assert_int_equal(mt->dl_tensor.byte_offset, 0);
    mt->deleter(mt);

    /* refusals: nothing allocated, release never called */
    released = 0;
    mt = (DLManagedTensor *)0x1;
    assert_int_equal(kv_view_to_dlpack(NULL, (DLDevice){kDLCPU, 0}, count_release, NULL, &mt),
                     KV_ERR_NULL);
    assert_int_equal(kv_view_to_dlpack(&v, (DLDevice){kDLCPU, 0}, count_release, NULL, NULL),
                     KV_ERR_NULL);
    assert_int_equal(kv_view_to_dlpack(&v, (DLDevice){kDLOpenCL, 0}, count_release, NULL, &mt),
                     KV_ERR_INVALID_ARG);
    assert_non_null(strstr(kv_last_error(), "kDLOpenCL"));
    assert_int_equal(kv_view_to_dlpack(&v, (DLDevice){kDLCPU, -1}, count_release, NULL, &mt),
                     KV_ERR_INVALID_ARG);
    struct kv_view f8;
    assert_int_equal(kv_view_init(buf, 64, KV_FP8_E4M3, 1, s1, &f8), KV_OK);
    assert_int_equal(kv_view_to_dlpack(&f8, (DLDevice){kDLCPU, 0}, count_release, NULL, &mt),
                     KV_ERR_UNSUPPORTED);
    assert_non_null(strstr(kv_last_error(), "fp8_e4m3"));
    struct kv_view bad = v;
    bad.strides[0] = -1;
    assert_int_equal(kv_view_to_dlpack(&bad, (DLDevice){kDLCPU, 0}, count_release, NULL, &mt),
                     KV_ERR_INVALID_ARG);
    bad = v;
    bad.shape[0] = 100; /* past its storage */
    assert_int_equal(kv_view_to_dlpack(&bad, (DLDevice){kDLCPU, 0}, count_release, NULL, &mt),
                     KV_ERR_OUT_OF_BOUNDS);
    assert_ptr_equal(mt, (DLManagedTensor *)0x1);
    assert_int_equal(released, 0);
}

/* A hand-made tensor over buf, as PyTorch or NumPy would hand one over. */
struct fake {
    DLManagedTensor mt;
    int64_t shape[3], strides[3];
};

static void fake_init(struct fake *f, void *data)
{
    memset(f, 0, sizeof(*f));
    f->shape[0] = 2, f->shape[1] = 3, f->shape[2] = 4;
    f->strides[0] = 12, f->strides[1] = 4, f->strides[2] = 1;
    f->mt.dl_tensor = (DLTensor){.data = data,
                                 .device = {kDLCPU, 0},
                                 .ndim = 3,
                                 .dtype = {kDLFloat, 32, 1},
                                 .shape = f->shape,
                                 .strides = f->strides,
                                 .byte_offset = 16};
}

static void test_dlpack_import(void **state)
{
    (void)state;
    _Alignas(64) static float buf[256];
    struct fake f;
    fake_init(&f, buf);
    struct kv_view v;
    assert_int_equal(kv_view_from_dlpack(&f.mt, &v, NULL), KV_OK);
    assert_int_equal(v.offset, 4);
    assert_int_equal(v.storage_bytes, (4 + 23 + 1) * 4);
    assert_ptr_equal(kv_view_ptr(&v, (const int64_t[]){1, 2, 3}), &buf[4 + 12 + 8 + 3]);
    /* NULL strides: compact row-major */
    f.mt.dl_tensor.strides = NULL;
    assert_int_equal(kv_view_from_dlpack(&f.mt, &v, NULL), KV_OK);
    assert_int_equal(v.strides[0], 12);
    assert_int_equal(v.strides[1], 4);
    assert_int_equal(v.strides[2], 1);
    /* every dtype kvcache has */
    const struct {
        uint8_t code, bits;
        kv_dtype dt;
    } ok[] = {{kDLFloat, 16, KV_F16}, {kDLBfloat, 16, KV_BF16}, {kDLFloat, 64, KV_F64},
              {kDLInt, 8, KV_I8},     {kDLInt, 64, KV_I64},     {kDLUInt, 8, KV_U8}};
    for (size_t i = 0; i < sizeof(ok) / sizeof(ok[0]); i++) {
        fake_init(&f, buf);
        f.mt.dl_tensor.dtype = (DLDataType){ok[i].code, ok[i].bits, 1};
        assert_int_equal(kv_view_from_dlpack(&f.mt, &v, NULL), KV_OK);
        assert_int_equal(v.dtype, ok[i].dt);
    }

    /* refusals, each naming its field; *out untouched */
    struct {
        const char *what;
        kv_status want;
        const char *words;
    } cases[] = {
        {"device", KV_ERR_UNSUPPORTED, "kDLROCM"},
        {"lanes", KV_ERR_UNSUPPORTED, "lanes 4"},
        {"complex", KV_ERR_UNSUPPORTED, "code 5 bits 64"},
        {"i16", KV_ERR_UNSUPPORTED, "code 0 bits 16"},
        {"ndim", KV_ERR_BAD_DIM, "ndim 9"},
        {"shape", KV_ERR_BAD_SHAPE, "size -3 at dim 1"},
        {"stride", KV_ERR_INVALID_ARG, "stride -1 at dim 2"},
        {"byte_offset", KV_ERR_INVALID_ARG, "offset_bytes 6"},
        {"align", KV_ERR_INVALID_ARG, "not aligned"},
        {"null data", KV_ERR_NULL, "base is NULL"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        fake_init(&f, buf);
        DLTensor *t = &f.mt.dl_tensor;
        switch (i) {
        case 0:
            t->device.device_type = kDLROCM;
            break;
        case 1:
            t->dtype.lanes = 4;
            break;
        case 2:
            t->dtype = (DLDataType){kDLComplex, 64, 1};
            break;
        case 3:
            t->dtype = (DLDataType){kDLInt, 16, 1};
            break;
        case 4:
            t->ndim = 9;
            break;
        case 5:
            f.shape[1] = -3;
            break;
        case 6:
            f.strides[2] = -1;
            break;
        case 7:
            t->byte_offset = 6;
            break;
        case 8:
            t->data = (char *)buf + 2;
            break;
        case 9:
            t->data = NULL;
            break;
        }
        struct kv_view keep = {.ndim = 7};
        DLDevice dev = {kDLOpenCL, 5};
        assert_int_equal(kv_view_from_dlpack(&f.mt, &keep, &dev), cases[i].want);
        if (!strstr(kv_last_error(), cases[i].words))
            fail_msg("%s: \"%s\" does not name \"%s\"", cases[i].what, kv_last_error(),
                     cases[i].words);
        assert_int_equal(keep.ndim, 7);
        assert_int_equal(dev.device_type, kDLOpenCL);
    }
    assert_int_equal(kv_view_from_dlpack(NULL, &v, NULL), KV_ERR_NULL);
    assert_int_equal(kv_view_from_dlpack(&f.mt, NULL, NULL), KV_ERR_NULL);
    /* an empty tensor may have NULL data */
    fake_init(&f, NULL);
    f.shape[0] = 0;
    f.mt.dl_tensor.byte_offset = 0;
    assert_int_equal(kv_view_from_dlpack(&f.mt, &v, NULL), KV_OK);
    assert_int_equal(kv_view_numel(&v), 0);
    /* NULL strides of an empty tensor: the size of dim 0 is in no stride,
     * [4, 2^61, 0] has strides [2^61, 1, 1] (refused as an overflow of
     * 4 * 2^61 once, found by tests/fuzz/fuzz_dlpack.c) */
    fake_init(&f, NULL);
    f.shape[0] = 4, f.shape[1] = (int64_t)1 << 61, f.shape[2] = 0;
    f.mt.dl_tensor.strides = NULL;
    f.mt.dl_tensor.byte_offset = 0;
    assert_int_equal(kv_view_from_dlpack(&f.mt, &v, NULL), KV_OK);
    assert_int_equal(kv_view_numel(&v), 0);
    assert_true(v.strides[0] == (int64_t)1 << 61 && v.strides[1] == 1 && v.strides[2] == 1);
    /* ... but a stride past int64 is refused, naming the shape */
    f.shape[0] = 0, f.shape[1] = (int64_t)1 << 62, f.shape[2] = 4;
    struct kv_view keep = {.ndim = 7};
    assert_int_equal(kv_view_from_dlpack(&f.mt, &keep, NULL), KV_ERR_OVERFLOW);
    assert_non_null(strstr(kv_last_error(), "4611686018427387904"));
    assert_int_equal(keep.ndim, 7);
    /* a data pointer whose elements wrap past the top of the address space
     * (found by fuzz_dlpack; a view of it made pointers that overflowed) */
    fake_init(&f, NULL);
    f.shape[0] = 1, f.shape[1] = 1, f.shape[2] = 1;
    f.mt.dl_tensor.data = (void *)(uintptr_t)0xfffffffffffff000ull;
    f.mt.dl_tensor.strides = NULL;
    f.mt.dl_tensor.byte_offset = 0x2000;
    assert_int_equal(kv_view_from_dlpack(&f.mt, &keep, NULL), KV_ERR_OVERFLOW);
    assert_non_null(strstr(kv_last_error(), "wraps past the top of the address space"));
    assert_int_equal(keep.ndim, 7);
}

static void test_dlpack_cache(void **state)
{
    (void)state;
    struct kv_cache_config cfg;
    kv_cache_config_init(&cfg);
    cfg.layout.num_layers = 2;
    cfg.layout.num_blocks = 40;
    cfg.layout.block_tokens = 16;
    cfg.layout.num_heads = 4;
    cfg.layout.head_dim = 32;
    cfg.layout.dtype = KV_BF16;
    cfg.layout.order = KV_ORDER_HND;
    cfg.layout.block_pad_elems = 24;
    cfg.max_seqs = 2;
    kv_cache *c;
    assert_int_equal(kv_cache_create(&cfg, &c), KV_OK);
    struct kv_view k1;
    assert_int_equal(kv_cache_kv_view(c, 1, 1, &k1), KV_OK); /* layer 1's V */
    struct kv_view blk;
    assert_int_equal(kv_view_select(&k1, 0, 33, &blk), KV_OK); /* one block far from 0 */
    DLManagedTensor *whole, *one;
    assert_int_equal(kv_cache_to_dlpack(c, &k1, &whole), KV_OK);
    assert_int_equal(kv_cache_to_dlpack(c, &blk, &one), KV_OK);
    assert_int_equal(whole->dl_tensor.device.device_type, kDLCPU);
    check_same_elements(&k1, &whole->dl_tensor);
    check_same_elements(&blk, &one->dl_tensor);
    /* outside the arena: refused, no reference kept */
    struct kv_view out = blk;
    out.base = (char *)blk.base - 4096;
    out.storage_bytes = 4096;
    out.offset = 0;
    out.ndim = 1;
    out.shape[0] = 8;
    out.strides[0] = 1;
    DLManagedTensor *mt = NULL;
    assert_int_equal(kv_cache_to_dlpack(c, &out, &mt), KV_ERR_OUT_OF_BOUNDS);
    assert_null(mt);
    assert_int_equal(kv_cache_to_dlpack(NULL, &blk, &mt), KV_ERR_NULL);
    /* a view just below address 2^64: its end wrapped past the arena's end
     * check (was exported, holding a reference); no view op takes it now,
     * and the export refuses one built by hand */
    struct kv_view wrap;
    const int64_t wshape[1] = {0x2000};
    assert_int_equal(
        kv_view_init((void *)(uintptr_t)0xfffffffffffff000ull, 0x2000, KV_U8, 1, wshape, &wrap),
        KV_ERR_OVERFLOW);
    wrap = out;
    wrap.base = (void *)(uintptr_t)0xfffffffffffff000ull;
    wrap.dtype = KV_U8;
    wrap.storage_bytes = 0x2000;
    wrap.shape[0] = 0x2000;
    assert_int_equal(kv_cache_to_dlpack(c, &wrap, &mt), KV_ERR_OVERFLOW);
    assert_null(mt);
    /* an empty view with an offset no element bounds: exported at its base
     * (its offset times the element size overflowed), a base outside the
     * arena refused */
    struct kv_view empty = blk;
    empty.shape[0] = 0;
    empty.offset = INT64_MAX / 2;
    assert_int_equal(kv_cache_to_dlpack(c, &empty, &mt), KV_OK);
    assert_ptr_equal(mt->dl_tensor.data, empty.base);
    assert_int_equal(mt->dl_tensor.shape[0], 0);
    mt->deleter(mt);
    mt = NULL;
    empty.base = (char *)blk.base - 4096;
    assert_int_equal(kv_cache_to_dlpack(c, &empty, &mt), KV_ERR_OUT_OF_BOUNDS);
    assert_null(mt);

    /* the engine lets go; the tensors keep the arena alive */
    kv_cache_destroy(c);
    const DLTensor *t = &one->dl_tensor;
    int64_t idx[3] = {0};
    uint64_t st = 5;
    for (idx[0] = 0; idx[0] < t->shape[0]; idx[0]++)
        for (idx[1] = 0; idx[1] < t->shape[1]; idx[1]++)
            for (idx[2] = 0; idx[2] < t->shape[2]; idx[2]++)
                *(uint16_t *)dl_addr(t, idx) = (uint16_t)kvt_rand(&st);
    one->deleter(one);
    /* the block written through one tensor is read back through the other */
    st = 5;
    const DLTensor *w = &whole->dl_tensor;
    int64_t wi[4] = {33, 0, 0, 0};
    for (wi[1] = 0; wi[1] < w->shape[1]; wi[1]++)
        for (wi[2] = 0; wi[2] < w->shape[2]; wi[2]++)
            for (wi[3] = 0; wi[3] < w->shape[3]; wi[3]++)
                assert_int_equal(*(const uint16_t *)dl_addr(w, wi), (uint16_t)kvt_rand(&st));
    whole->deleter(whole); /* the last reference: the cache is freed here */

    /* retain / destroy pair on a fresh cache */
    assert_int_equal(kv_cache_create(&cfg, &c), KV_OK);
    assert_ptr_equal(kv_cache_retain(c), c);
    kv_cache_destroy(c);
    assert_non_null(kv_cache_layout(c)); /* still alive: one reference left */
    kv_cache_destroy(c);
    assert_null(kv_cache_retain(NULL));
}

/* The C capsule destructor of kv_dlpack.h, with stand-ins for Python's
 * PyCapsule_IsValid / PyCapsule_GetPointer. */
static int fake_valid;
static void *fake_ptr;
static int fake_is_valid(void *capsule, const char *name)
{
    return capsule != NULL && strcmp(name, "dltensor") == 0 && fake_valid;
}
static void *fake_get(void *capsule, const char *name)
{
    (void)capsule, (void)name;
    return fake_ptr;
}

static void test_dlpack_capsule_destructor(void **state)
{
    (void)state;
    _Alignas(64) static float buf[16];
    struct kv_view v;
    const int64_t s1[1] = {16};
    assert_int_equal(kv_view_init(buf, sizeof(buf), KV_F32, 1, s1, &v), KV_OK);
    DLManagedTensor *mt;
    assert_int_equal(kv_view_to_dlpack(&v, (DLDevice){kDLCPU, 0}, count_release, buf, &mt), KV_OK);
    released = 0;
    kv_dlpack_capsule_destructor((void *)0x10); /* no API given yet: nothing */
    kv_dlpack_capsule_api(fake_is_valid, fake_get);
    fake_ptr = mt;
    fake_valid = 0; /* consumed ("used_dltensor"): the new owner frees it */
    kv_dlpack_capsule_destructor((void *)0x10);
    assert_int_equal(released, 0);
    fake_valid = 1; /* never consumed: the capsule runs the deleter */
    kv_dlpack_capsule_destructor((void *)0x10);
    assert_int_equal(released, 1);
    kv_dlpack_capsule_destructor(NULL);
    kv_dlpack_capsule_api(NULL, NULL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dlpack_export),
        cmocka_unit_test(test_dlpack_import),
        cmocka_unit_test(test_dlpack_cache),
        cmocka_unit_test(test_dlpack_capsule_destructor),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
