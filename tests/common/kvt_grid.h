/*
 * kvt_grid.h - the fixtures of the emulated-grid tests (test_grid.c,
 * test_grid_devidx.c): a cache pool between two guard areas with its
 * reference, addressed from the layout CONFIG alone (kvt_ref_offset_elems),
 * and [L?][T][H][D] tensors with padded rows or a strided head dim in
 * garbage-filled buffers. Include after <cmocka.h>; needs kv_mem.h and
 * kv_convert_hd.h on the include path (library-internal, as the tests are).
 */
#ifndef KVT_GRID_H
#define KVT_GRID_H

#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include <kvcache/kv.h>

#include "kv_convert_hd.h"
#include "kv_mem.h"
#include "kvtest.h"

/* Bytes of guard before and after a pool (compared with the pool). */
#define KVT_GUARD 256

/* The first differing byte of got and want, named. */
static inline void kvt_check_bytes(const unsigned char *got, const unsigned char *want, size_t n,
                                   const char *what)
{
    if (memcmp(got, want, n) == 0)
        return;
    size_t i = 0;
    while (got[i] == want[i])
        i++;
    fail_msg("%s: byte %zu is 0x%02x, expected 0x%02x (%zu bytes in all)", what, i, got[i], want[i],
             n);
}

/* A pool (pinned host memory: what the CUDA entries accept and the CPU can
 * read) of layout cfg at pool = mem + KVT_GUARD, random bytes everywhere;
 * its reference at ref = refmem + KVT_GUARD, guards included. */
struct kvt_gfix {
    struct kv_layout_config cfg;
    struct kv_paged_cache c;
    unsigned char *mem, *pool, *refmem, *ref;
    size_t bytes;
    int64_t es;
};

static inline void kvt_gfix_init(struct kvt_gfix *f, const struct kv_layout_config *cfg,
                                 uint64_t seed)
{
    memset(f, 0, sizeof(*f));
    f->cfg = *cfg;
    assert_int_equal(kv_layout_init(cfg, &f->c.layout), KV_OK);
    f->bytes = (size_t)f->c.layout.total_bytes;
    f->es = f->c.layout.elem_bytes;
    f->mem = kv__mem_alloc_aligned(64, f->bytes + 2 * KVT_GUARD);
    f->refmem = kv__mem_alloc_aligned(64, f->bytes + 2 * KVT_GUARD);
    assert_true(f->mem && f->refmem);
    kvt_fill(f->mem, f->bytes + 2 * KVT_GUARD, seed);
    memcpy(f->refmem, f->mem, f->bytes + 2 * KVT_GUARD);
    f->pool = f->mem + KVT_GUARD;
    f->ref = f->refmem + KVT_GUARD;
    f->c.base = f->pool;
    f->c.storage_bytes = f->bytes;
    f->c.mem = KV_MEM_PINNED;
}

static inline void kvt_gfix_free(struct kvt_gfix *f)
{
    kv__mem_free(f->mem);
    kv__mem_free(f->refmem);
}

/* Element (l, kv, slot, h, d) of a pool starting at base (f->pool or f->ref). */
static inline unsigned char *kvt_gat(const struct kvt_gfix *f, unsigned char *base, int64_t l,
                                     int kv, int64_t slot, int64_t h, int64_t d)
{
    const int64_t N = f->cfg.block_tokens;
    return base + kvt_ref_offset_elems(&f->cfg, l, kv, slot / N, slot % N, h, d) * f->es;
}

/* The pool and both guards against the reference. */
static inline void kvt_gfix_check(const struct kvt_gfix *f, const char *what)
{
    kvt_check_bytes(f->mem, f->refmem, f->bytes + 2 * KVT_GUARD, what);
}

/* A tensor [L?][T][H][D] of dtype dt (L 0: [T][H][D]): rows padded by 8
 * elements, or a head dim of stride 2 (strided), in a garbage-filled
 * 64-byte aligned buffer displaced by `shift` bytes (breaks vector
 * alignment); values in [-30, 30]. */
struct kvt_tens {
    unsigned char *mem, *buf;
    size_t bytes;
    struct kv_view v;
};

static inline void kvt_tens_make(struct kvt_tens *t, kv_dtype dt, int64_t L, int64_t T, int64_t H,
                                 int64_t D, bool strided, int64_t shift, uint64_t seed)
{
    const int64_t es = (int64_t)kv_dtype_size(dt), row = strided ? 2 * D : D + 8;
    const int64_t lead = L ? L : 1, elems = lead * T * H * row;
    t->bytes = (size_t)(elems * es);
    t->mem = kv__mem_alloc_aligned(64, t->bytes + 64);
    assert_non_null(t->mem);
    t->buf = t->mem + shift;
    uint64_t r = seed;
    kvt_fill(t->mem, t->bytes + 64, seed + 1);
    for (int64_t i = 0; i < elems; i++)
        kv_from_f32(dt, (float)kvt_range(&r, -30000, 30000) / 1000.0f, t->buf + i * es);
    int64_t shape[4] = {L, T, H, D}, st[4] = {T * H * row, H * row, row, strided ? 2 : 1};
    struct kv_view flat;
    int64_t n1 = elems;
    assert_int_equal(kv_view_init(t->buf, t->bytes, dt, 1, &n1, &flat), KV_OK);
    assert_int_equal(
        kv_view_as_strided(&flat, L ? 4 : 3, L ? shape : shape + 1, L ? st : st + 1, 0, &t->v),
        KV_OK);
}

/* Element (l, tk, h, d) of t, through its view (l ignored for [T][H][D]). */
static inline unsigned char *kvt_tens_at(const struct kvt_tens *t, int64_t l, int64_t tk, int64_t h,
                                         int64_t d)
{
    const struct kv_view *v = &t->v;
    const int o = v->ndim - 3;
    int64_t e = v->offset + tk * v->strides[o] + h * v->strides[o + 1] + d * v->strides[o + 2];
    if (o)
        e += l * v->strides[0];
    return (unsigned char *)v->base + e * (int64_t)kv_dtype_size(v->dtype);
}

#endif /* KVT_GRID_H */
