/* kvtest.c - helpers shared by the cmocka suites. */
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvtest.h"

const char *kvt_data_path(const char *name)
{
    static char buf[4096];
    const char *dir = getenv("KV_TEST_DATA_DIR");
    snprintf(buf, sizeof(buf), "%s/%s", dir && *dir ? dir : KV_TEST_DATA_DIR, name);
    return buf;
}

int64_t kvt_ref_offset_elems(const struct kv_layout_config *c, int64_t l, int64_t kv, int64_t b,
                             int64_t n, int64_t h, int64_t d)
{
    const int64_t es = (int64_t)kv_dtype_size(c->dtype);
    const int64_t planes = c->kv_packed || c->k_only ? 1 : 2, plane = c->kv_packed ? 0 : kv;
    const int64_t row = c->kv_packed ? 2 * c->head_dim : c->head_dim;
    const int64_t natural = c->block_tokens * c->num_heads * row;
    const int64_t bstride =
        c->block_stride_bytes ? c->block_stride_bytes / es : natural + c->block_pad_elems;
    const int64_t in =
        (c->order == KV_ORDER_NHD ? n * c->num_heads + h : h * c->block_tokens + n) * row +
        (c->kv_packed ? kv * c->head_dim : 0) + d;
    const int64_t unit = c->arrange == KV_ARRANGE_LAYER_MAJOR
                             ? (l * planes + plane) * c->num_blocks + b
                             : (b * c->num_layers + l) * planes + plane;
    return unit * bstride + in;
}

/* ---- field-by-field struct comparison ------------------------------------ */

/* One field of a and of b, widened to 64 bits; idx >= 0 names an array
 * element. */
struct kvt_field {
    const char *name;
    int idx;
    uint64_t a, b;
};

static struct kvt_field kvt_f(const char *name, uint64_t a, uint64_t b)
{
    return (struct kvt_field){name, -1, a, b};
}

/* A bool by its byte: the "out untouched" tests poison structs with bytes
 * like 0x5A, which must not be read as a bool (UBSan: invalid _Bool). */
static uint64_t kvt_byte(const void *p)
{
    unsigned char c;
    memcpy(&c, p, 1);
    return c;
}

#define KVT_F(f) kvt_f(#f, (uint64_t)(a->f), (uint64_t)(b->f))
#define KVT_FP(f) kvt_f(#f, (uint64_t)(uintptr_t)(a->f), (uint64_t)(uintptr_t)(b->f))
#define KVT_FB(f) kvt_f(#f, kvt_byte(&a->f), kvt_byte(&b->f))

static _Thread_local char kvt_why[192];

static const char *kvt_first_diff(const char *what, const struct kvt_field *f, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (f[i].a == f[i].b)
            continue;
        char name[64];
        if (f[i].idx >= 0)
            snprintf(name, sizeof(name), "%s[%d]", f[i].name, f[i].idx);
        else
            snprintf(name, sizeof(name), "%s", f[i].name);
        snprintf(kvt_why, sizeof(kvt_why),
                 "%s.%s: %" PRId64 " vs %" PRId64 " (0x%" PRIx64 " vs 0x%" PRIx64 ")", what, name,
                 (int64_t)f[i].a, (int64_t)f[i].b, f[i].a, f[i].b);
        return kvt_why;
    }
    return "";
}

/* Each size assertion fails when a field is added to the struct: compare it
 * here too. */
_Static_assert(sizeof(struct kv_view) ==
                   2 * sizeof(int) + (2 * KV_MAX_DIMS + 1) * 8 + sizeof(void *) + sizeof(size_t),
               "struct kv_view changed: update kvt_view_diff");

const char *kvt_view_diff(const struct kv_view *a, const struct kv_view *b)
{
    struct kvt_field f[4 + 2 * KV_MAX_DIMS + 1] = {KVT_F(dtype), KVT_F(ndim), KVT_F(offset),
                                                   KVT_FP(base), KVT_F(storage_bytes)};
    size_t n = 5;
    for (int d = 0; d < KV_MAX_DIMS; d++) {
        f[n++] = (struct kvt_field){"shape", d, (uint64_t)a->shape[d], (uint64_t)b->shape[d]};
        f[n++] = (struct kvt_field){"strides", d, (uint64_t)a->strides[d], (uint64_t)b->strides[d]};
    }
    return kvt_first_diff("kv_view", f, n);
}

_Static_assert(sizeof(struct kv_layout) == 248, "struct kv_layout changed: update kvt_layout_diff");

const char *kvt_layout_diff(const struct kv_layout *a, const struct kv_layout *b)
{
    const struct kvt_field f[] = {KVT_F(num_layers),
                                  KVT_F(num_blocks),
                                  KVT_F(block_tokens),
                                  KVT_F(num_heads),
                                  KVT_F(head_dim),
                                  KVT_F(dtype),
                                  KVT_F(order),
                                  KVT_F(arrange),
                                  KVT_FB(kv_packed),
                                  KVT_F(elem_bytes),
                                  KVT_F(align_bytes),
                                  KVT_F(kv_planes),
                                  KVT_F(block_elems),
                                  KVT_F(block_bytes),
                                  KVT_F(block_stride_elems),
                                  KVT_F(block_stride_bytes),
                                  KVT_F(stride_layer_elems),
                                  KVT_F(stride_kv_elems),
                                  KVT_F(stride_block_elems),
                                  KVT_F(stride_token_elems),
                                  KVT_F(stride_head_elems),
                                  KVT_F(stride_dim_elems),
                                  KVT_F(stride_layer_bytes),
                                  KVT_F(stride_kv_bytes),
                                  KVT_F(stride_block_bytes),
                                  KVT_F(stride_token_bytes),
                                  KVT_F(stride_head_bytes),
                                  KVT_F(stride_dim_bytes),
                                  KVT_F(total_elems),
                                  KVT_F(total_bytes),
                                  KVT_F(fingerprint),
                                  KVT_F(block_format_fingerprint),
                                  KVT_FB(k_only)};
    return kvt_first_diff("kv_layout", f, sizeof(f) / sizeof(f[0]));
}

_Static_assert(sizeof(struct kv_layout_config) == 96,
               "struct kv_layout_config changed: update kvt_layout_config_diff");

const char *kvt_layout_config_diff(const struct kv_layout_config *a,
                                   const struct kv_layout_config *b)
{
    const struct kvt_field f[] = {
        KVT_F(struct_size), KVT_F(num_layers), KVT_F(num_blocks),      KVT_F(block_tokens),
        KVT_F(num_heads),   KVT_F(head_dim),   KVT_F(dtype),           KVT_F(order),
        KVT_F(arrange),     KVT_FB(kv_packed), KVT_F(block_pad_elems), KVT_F(block_stride_bytes),
        KVT_F(align_bytes), KVT_FB(k_only)};
    return kvt_first_diff("kv_layout_config", f, sizeof(f) / sizeof(f[0]));
}

_Static_assert(sizeof(struct kv_arena_config) == 40,
               "struct kv_arena_config changed: update kvt_arena_config_diff");

const char *kvt_arena_config_diff(const struct kv_arena_config *a, const struct kv_arena_config *b)
{
    const struct kvt_field f[] = {KVT_F(struct_size), KVT_F(kind),   KVT_F(size_bytes),
                                  KVT_F(align_bytes), KVT_F(device), KVT_F(flags)};
    return kvt_first_diff("kv_arena_config", f, sizeof(f) / sizeof(f[0]));
}

_Static_assert(sizeof(struct kv_block_pool_stats) == 56,
               "struct kv_block_pool_stats changed: update kvt_block_pool_stats_diff");

const char *kvt_block_pool_stats_diff(const struct kv_block_pool_stats *a,
                                      const struct kv_block_pool_stats *b)
{
    const struct kvt_field f[] = {
        KVT_F(capacity),        KVT_F(free_blocks),   KVT_F(used_blocks), KVT_F(cached_blocks),
        KVT_F(used_high_water), KVT_F(hashed_blocks), KVT_F(hits),        KVT_F(misses),
        KVT_F(evictions),       KVT_F(stored)};
    return kvt_first_diff("kv_block_pool_stats", f, sizeof(f) / sizeof(f[0]));
}

_Static_assert(sizeof(struct kv_offload_stats) == 15 * 8,
               "struct kv_offload_stats changed: update kvt_offload_stats_diff");

const char *kvt_offload_stats_diff(const struct kv_offload_stats *a,
                                   const struct kv_offload_stats *b)
{
    const struct kvt_field f[] = {KVT_F(entries),
                                  KVT_F(bytes),
                                  KVT_F(capacity_bytes),
                                  KVT_F(region_bytes),
                                  KVT_F(staging_bytes),
                                  KVT_F(stores),
                                  KVT_F(store_touches),
                                  KVT_F(loads),
                                  KVT_F(hits),
                                  KVT_F(misses),
                                  KVT_F(evictions),
                                  KVT_F(evicted),
                                  KVT_F(checksum_failures),
                                  KVT_F(failed_ops),
                                  KVT_F(cancelled_ops)};
    return kvt_first_diff("kv_offload_stats", f, sizeof(f) / sizeof(f[0]));
}
