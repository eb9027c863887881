/*
 * kvt_cache.h - a kv_cache in a test, with block contents written and
 * checked through the reference addressing of kvtest.h (the CONFIG alone,
 * never the library's strides), and the pool scrambled so the blocks it
 * hands out are far from 0. Include after <cmocka.h>.
 */
#ifndef KVT_CACHE_H
#define KVT_CACHE_H

#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <kvcache/kv.h>

#include "kvtest.h"

struct kvt_cache {
    struct kv_cache_config cfg;
    kv_cache *c;
    kv_block_pool *pool;
    struct kv_paged_cache pc;
    unsigned char *base;
    size_t bytes;
};

/* bits as kvt_side_make: 1 HND, 2 block-major, 4 padded (24 elements), 8
 * packed K|V, 32 K only (MLA); 16: tensor-parallel rank 1 (head_offset H: its blocks' bytes
 * differ from rank 0's for the same seed). The arena is filled with random
 * bytes from seed. */
static inline void kvt_cache_make(struct kvt_cache *t, int64_t L, int64_t B, int64_t N, int64_t H,
                                  int64_t D, kv_dtype dt, int bits, uint64_t seed)
{
    memset(t, 0, sizeof(*t));
    kv_cache_config_init(&t->cfg);
    struct kv_layout_config *lc = &t->cfg.layout;
    lc->num_layers = L;
    lc->num_blocks = B;
    lc->block_tokens = N;
    lc->num_heads = H;
    lc->head_dim = D;
    lc->dtype = dt;
    lc->order = (bits & 1) ? KV_ORDER_HND : KV_ORDER_NHD;
    lc->arrange = (bits & 2) ? KV_ARRANGE_BLOCK_MAJOR : KV_ARRANGE_LAYER_MAJOR;
    lc->block_pad_elems = (bits & 4) ? 24 : 0;
    lc->kv_packed = (bits & 8) != 0;
    lc->k_only = (bits & 32) != 0;
    t->cfg.head_offset = (bits & 16) ? (uint32_t)H : 0;
    t->cfg.max_seqs = 4;
    t->cfg.enable_prefix_caching = true;
    assert_int_equal(kv_cache_create(&t->cfg, &t->c), KV_OK);
    t->pool = kv_cache_pool(t->c);
    assert_int_equal(kv_cache_paged(t->c, &t->pc), KV_OK);
    t->base = t->pc.base;
    t->bytes = (size_t)t->pc.layout.total_bytes;
    kvt_fill(t->base, t->bytes, seed);
}

static inline void kvt_cache_free(struct kvt_cache *t)
{
    kv_cache_destroy(t->c);
    t->c = NULL;
}

/* Write (check false) or compare with (check true) block b's elements
 * (every layer, K and V, token, head) in mem (an image of the arena) and
 * the stream seeded by seed; padding is neither written nor compared.
 * Returns whether every byte compared equal (true when writing). */
static inline bool kvt_block_pass(const struct kvt_cache *t, unsigned char *mem, uint32_t b,
                                  uint64_t seed, bool check)
{
    const struct kv_layout_config *c = &t->cfg.layout;
    const int64_t es = t->pc.layout.elem_bytes, row = c->head_dim * es;
    uint64_t st = seed ^ 0x6b76626c6f636bull ^ ((uint64_t)t->cfg.head_offset << 40);
    for (int64_t l = 0; l < c->num_layers; l++)
        for (int kv = 0; kv < (c->k_only ? 1 : 2); kv++)
            for (int64_t n = 0; n < c->block_tokens; n++)
                for (int64_t h = 0; h < c->num_heads; h++) {
                    unsigned char *p = mem + kvt_ref_offset_elems(c, l, kv, b, n, h, 0) * es;
                    for (int64_t i = 0; i < row; i++) {
                        const unsigned char x = (unsigned char)kvt_rand(&st);
                        if (!check)
                            p[i] = x;
                        else if (p[i] != x)
                            return false;
                    }
                }
    return true;
}

/* Write block b's elements into mem from the stream seeded by seed. */
static inline void kvt_block_write(const struct kvt_cache *t, unsigned char *mem, uint32_t b,
                                   uint64_t seed)
{
    (void)kvt_block_pass(t, mem, b, seed, false);
}

/* Does block b of mem hold what kvt_block_write(seed) wrote? */
static inline bool kvt_block_holds(const struct kvt_cache *t, const unsigned char *mem, uint32_t b,
                                   uint64_t seed)
{
    return kvt_block_pass(t, (unsigned char *)mem, b, seed, true);
}

/* Take every free block and give them back in a random order, so the pool
 * hands out ids spread over [1, B) from now on. Cached blocks are evicted. */
static inline void kvt_pool_scramble(struct kvt_cache *t, uint64_t *rng)
{
    struct kv_block_pool_stats ps;
    kv_block_pool_stats_get(t->pool, &ps);
    const uint32_t n = ps.free_blocks + ps.cached_blocks;
    if (n == 0)
        return;
    uint32_t *ids = malloc(n * sizeof(*ids));
    assert_non_null(ids);
    assert_int_equal(kv_block_pool_alloc(t->pool, n, ids), KV_OK);
    for (uint32_t i = n - 1; i > 0; i--) {
        const uint32_t j = (uint32_t)kvt_range(rng, 0, i);
        const uint32_t x = ids[i];
        ids[i] = ids[j];
        ids[j] = x;
    }
    assert_int_equal(kv_block_pool_release(t->pool, ids, n), KV_OK);
    free(ids);
}

/* Sum of the ref counts of blocks [1, B). */
static inline uint64_t kvt_pool_refs(const struct kvt_cache *t)
{
    uint64_t s = 0;
    for (int64_t b = 1; b < t->cfg.layout.num_blocks; b++)
        s += kv_block_pool_ref_count(t->pool, (uint32_t)b);
    return s;
}

#endif /* KVT_CACHE_H */
