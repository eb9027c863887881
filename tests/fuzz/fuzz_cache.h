/*
 * fuzz_cache.h - the caches the kernel fuzz targets (fuzz_attn_args,
 * fuzz_grid_devidx) run over: a template of dims, order, arrangement,
 * packing and padding; its layout made and checked against the template;
 * its storage an exact-size allocation (ASan sees a byte past the pool);
 * and every element's offset computed from the template alone (ref_off),
 * never from the library's strides. Include after fuzz_check.h.
 */
#ifndef KV_FUZZ_CACHE_H
#define KV_FUZZ_CACHE_H

#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "kv_layout.h"
#include "kv_paged.h"

#define NOCOV __attribute__((no_sanitize("coverage"), noinline))

struct tmpl {
    int64_t L, B, N, H, D;
    kv_order order;
    kv_arrange arrange;
    bool packed;
    int64_t pad_elems, extra_elems; /* block_pad_elems, or block_stride_bytes past natural */
};

struct cc {
    bool built;
    struct tmpl t;
    kv_dtype dt;
    int64_t es, bstride; /* element bytes; elements between blocks (from the template) */
    struct kv_paged_cache pc;
    unsigned char *gold; /* what the storage holds between calls */
    unsigned char *ref;  /* a reference the target builds (NULL where unused) */
    size_t bytes;
};

/* Element offset of (l, kv, b, n, h, d) from the template alone. */
NOCOV static int64_t ref_off(const struct cc *c, int64_t l, int kv, int64_t b, int64_t n, int64_t h,
                             int64_t d)
{
    const struct tmpl *t = &c->t;
    const int64_t P = t->packed ? 1 : 2, plane = t->packed ? 0 : kv;
    const int64_t drow = t->packed ? 2 * t->D : t->D, dd = t->packed ? d + kv * t->D : d;
    const int64_t unit = t->arrange == KV_ARRANGE_LAYER_MAJOR ? (l * P + plane) * t->B + b
                                                              : (b * t->L + l) * P + plane;
    const int64_t in =
        t->order == KV_ORDER_NHD ? (n * t->H + h) * drow + dd : (h * t->N + n) * drow + dd;
    return unit * c->bstride + in;
}

/* c's layout from template t and dtype dt, checked against the template,
 * and its storage (exact size, of memory kind mem; contents for the caller
 * to fill). */
static void cache_make(struct cc *c, const struct tmpl *t, kv_dtype dt, enum kv_mem_kind mem)
{
    struct kv_layout_config cfg = KV_LAYOUT_CONFIG_INIT;
    c->t = *t;
    c->dt = dt;
    c->es = (int64_t)kv_dtype_size(dt);
    cfg.num_layers = t->L, cfg.num_blocks = t->B, cfg.block_tokens = t->N;
    cfg.num_heads = t->H, cfg.head_dim = t->D, cfg.dtype = dt;
    cfg.order = t->order, cfg.arrange = t->arrange, cfg.kv_packed = t->packed;
    const int64_t natural = t->N * t->H * t->D * (t->packed ? 2 : 1);
    cfg.block_pad_elems = t->pad_elems;
    if (t->extra_elems)
        cfg.block_stride_bytes = (natural + t->extra_elems) * c->es;
    c->bstride = natural + t->pad_elems + t->extra_elems;
    memset(&c->pc, 0, sizeof(c->pc));
    CHECK(kv_layout_init(&cfg, &c->pc.layout) == KV_OK);
    CHECK(c->pc.layout.total_elems == t->L * (t->packed ? 1 : 2) * t->B * c->bstride);
    c->bytes = (size_t)c->pc.layout.total_bytes;
    c->pc.base = xmalloc(c->bytes); /* exact: ASan sees a byte past the pool */
    c->pc.storage_bytes = c->bytes;
    c->pc.mem = mem;
}

#endif /* KV_FUZZ_CACHE_H */
