/*
 * kvt_side.h - one side of a transfer in a test: a layout over host memory
 * filled with random bytes, block ids spread over the pool, and the
 * reference of a move between two sides computed from the CONFIGS alone
 * (kvt_ref_offset_elems), never from the library's strides or plans.
 * Include after <cmocka.h>.
 */
#ifndef KVT_SIDE_H
#define KVT_SIDE_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <kvcache/kv.h>

#include "kvtest.h"

struct kvt_side {
    struct kv_layout_config cfg;
    struct kv_layout lo;
    unsigned char *mem;
    struct kv_paged_cache pc;
};

/* bits: 1 HND, 2 block-major, 4 padded (24 elements), 8 packed K|V, 32 K
 * only (k_only, an MLA latent cache; not with 8). */
static inline void kvt_side_make(struct kvt_side *s, int64_t L, int64_t B, int64_t N, int64_t H,
                                 int64_t D, kv_dtype dt, int bits, uint64_t seed)
{
    kv_layout_config_init(&s->cfg);
    s->cfg.num_layers = L;
    s->cfg.num_blocks = B;
    s->cfg.block_tokens = N;
    s->cfg.num_heads = H;
    s->cfg.head_dim = D;
    s->cfg.dtype = dt;
    s->cfg.order = (bits & 1) ? KV_ORDER_HND : KV_ORDER_NHD;
    s->cfg.arrange = (bits & 2) ? KV_ARRANGE_BLOCK_MAJOR : KV_ARRANGE_LAYER_MAJOR;
    s->cfg.block_pad_elems = (bits & 4) ? 24 : 0;
    s->cfg.kv_packed = (bits & 8) != 0;
    s->cfg.k_only = (bits & 32) != 0;
    assert_int_equal(kv_layout_init(&s->cfg, &s->lo), KV_OK);
    s->mem = aligned_alloc(64, ((size_t)s->lo.total_bytes + 63) / 64 * 64);
    assert_non_null(s->mem);
    kvt_fill(s->mem, (size_t)s->lo.total_bytes, seed);
    s->pc = (struct kv_paged_cache){s->lo, s->mem, (size_t)s->lo.total_bytes, KV_MEM_HOST};
}

static inline void kvt_side_free(struct kvt_side *s)
{
    free(s->mem);
    s->mem = NULL;
}

/* n distinct ids of [0, B), shuffled (far from 0 as often as not). */
static inline void kvt_pick_ids(uint64_t *rng, int64_t B, uint32_t n, uint32_t *ids)
{
    uint32_t *all = malloc((size_t)B * sizeof(*all));
    assert_non_null(all);
    for (int64_t i = 0; i < B; i++)
        all[i] = (uint32_t)i;
    for (uint32_t i = 0; i < n; i++) {
        const int64_t j = kvt_range(rng, i, B - 1);
        const uint32_t t = all[i];
        all[i] = all[j];
        all[j] = t;
        ids[i] = all[i];
    }
    free(all);
}

/* Apply to ref (a copy of d's storage) the move of a request of whole
 * blocks: every token both block lists cover, layers [sl0, sl0 + nl) of s
 * onto [dl0, dl0 + nl) of d, K and V, heads [sh0, sh0 + nh) of s onto
 * [dh0, ...) of d, D elements per head row. */
static inline void kvt_ref_move_layers(const struct kvt_side *s, const uint32_t *sid, uint32_t ns,
                                       const struct kvt_side *d, const uint32_t *did, uint32_t nd,
                                       int64_t sl0, int64_t dl0, int64_t nl, int64_t sh0,
                                       int64_t dh0, int64_t nh, unsigned char *ref)
{
    const uint64_t Ns = (uint64_t)s->cfg.block_tokens, Nd = (uint64_t)d->cfg.block_tokens;
    const int64_t es = s->lo.elem_bytes, D = s->cfg.head_dim;
    const uint64_t covered =
        (uint64_t)ns * Ns < (uint64_t)nd * Nd ? (uint64_t)ns * Ns : (uint64_t)nd * Nd;
    for (uint64_t t = 0; t < covered; t++)
        for (int64_t l = 0; l < nl; l++)
            for (int kv = 0; kv < (s->cfg.k_only ? 1 : 2); kv++)
                for (int64_t h = 0; h < nh; h++) {
                    const int64_t so = kvt_ref_offset_elems(&s->cfg, sl0 + l, kv, sid[t / Ns],
                                                            (int64_t)(t % Ns), sh0 + h, 0);
                    const int64_t dof = kvt_ref_offset_elems(&d->cfg, dl0 + l, kv, did[t / Nd],
                                                             (int64_t)(t % Nd), dh0 + h, 0);
                    memcpy(ref + dof * es, s->mem + so * es, (size_t)(D * es));
                }
}

/* kvt_ref_move_layers over every layer (both sides have the same L). */
static inline void kvt_ref_move(const struct kvt_side *s, const uint32_t *sid, uint32_t ns,
                                const struct kvt_side *d, const uint32_t *did, uint32_t nd,
                                int64_t sh0, int64_t dh0, int64_t nh, unsigned char *ref)
{
    kvt_ref_move_layers(s, sid, ns, d, did, nd, 0, 0, s->cfg.num_layers, sh0, dh0, nh, ref);
}

/* Bytes of d's listed blocks in layers outside [dl0, dl0 + nl) that differ
 * between mem and before (both d's whole storage): the layers a layer-range
 * move must leave byte-identical, checked by config-only offsets, row by
 * row (every head, K and V, every token of the blocks). */
static inline int64_t kvt_other_layers_changed(const struct kvt_side *d, const uint32_t *did,
                                               uint32_t nd, int64_t dl0, int64_t nl,
                                               const unsigned char *mem,
                                               const unsigned char *before)
{
    const int64_t es = d->lo.elem_bytes, D = d->cfg.head_dim, row = D * es;
    int64_t changed = 0;
    for (uint32_t b = 0; b < nd; b++)
        for (int64_t l = 0; l < d->cfg.num_layers; l++) {
            if (l >= dl0 && l < dl0 + nl)
                continue;
            for (int kv = 0; kv < (d->cfg.k_only ? 1 : 2); kv++)
                for (int64_t n = 0; n < d->cfg.block_tokens; n++)
                    for (int64_t h = 0; h < d->cfg.num_heads; h++) {
                        const int64_t o =
                            kvt_ref_offset_elems(&d->cfg, l, kv, did[b], n, h, 0) * es;
                        changed += memcmp(mem + o, before + o, (size_t)row) != 0;
                    }
        }
    return changed;
}

/* Index of the first byte where a and b differ, -1 if none. */
static inline int64_t kvt_first_diff(const unsigned char *a, const unsigned char *b, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        if (a[i] != b[i])
            return i;
    return -1;
}

#endif /* KVT_SIDE_H */
