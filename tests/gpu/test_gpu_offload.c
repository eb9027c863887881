/*
 * test_gpu_offload.c - runs only where a GPU exists (scripts/gpu-check.sh):
 * the offload tier with device caches (KV_MEM_DEVICE) on the CUDA runtime,
 * the hardware twin of tests/unit/test_offload_dev.c (which runs the same
 * paths over the CUDA double). For four padded layouts (NHD/HND x layer-/
 * block-major): blocks of a device cache stored into a pinned tier (D2H on
 * the tier's stream), loaded back into another device cache (H2D), and the WHOLE destination
 * pool compared with a reference built from the layout's strides on the
 * host; the source pool unchanged; a corrupted entry refused before its
 * H2D (its block released, the pool otherwise as expected); the engine's
 * cache destroyed with a store of it posted.
 *
 * Without a GPU it prints "no GPU: skipped" and passes, unless
 * KV_EXPECT_GPU=1 (gpu-check.sh), where a missing GPU fails.
 */
#include <cuda_runtime_api.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_test.h"
#include "kv_offload_int.h" /* kv__offload_test_corrupt */
#include <kvcache/kv.h>

#define WAIT_MS 60000

static uint64_t rnd(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

struct dcache {
    kv_cache *c;
    kv_block_pool *pool;
    struct kv_paged_cache pc;
    unsigned char *h, *back; /* the host image of the pool, a read-back buffer */
    size_t bytes;
};

/* bits: 1 HND, 2 block-major; always padded. */
static void dcache_make(struct dcache *d, int bits, uint64_t seed)
{
    struct kv_cache_config cfg = KV_CACHE_CONFIG_INIT;
    cfg.layout.num_layers = 4;
    cfg.layout.num_blocks = 400;
    cfg.layout.block_tokens = 16;
    cfg.layout.num_heads = 4;
    cfg.layout.head_dim = 64;
    cfg.layout.dtype = KV_BF16;
    cfg.layout.order = (bits & 1) ? KV_ORDER_HND : KV_ORDER_NHD;
    cfg.layout.arrange = (bits & 2) ? KV_ARRANGE_BLOCK_MAJOR : KV_ARRANGE_LAYER_MAJOR;
    cfg.layout.block_pad_elems = 24;
    cfg.max_seqs = 4;
    cfg.enable_prefix_caching = true;
    cfg.mem_kind = KV_MEM_DEVICE;
    CHECK(kv_cache_create(&cfg, &d->c) == KV_OK);
    d->pool = kv_cache_pool(d->c);
    CHECK(kv_cache_paged(d->c, &d->pc) == KV_OK);
    d->bytes = (size_t)d->pc.layout.total_bytes;
    d->h = malloc(d->bytes);
    d->back = malloc(d->bytes);
    CHECK(d->h && d->back);
    for (size_t i = 0; i < d->bytes; i++)
        d->h[i] = (unsigned char)rnd(&seed);
    CHECK(cudaMemcpy(d->pc.base, d->h, d->bytes, cudaMemcpyHostToDevice) == cudaSuccess);
    /* spread the ids the pool hands out: take many, give back every other */
    enum { TAKE = 300 };
    uint32_t ids[TAKE];
    CHECK(kv_block_pool_alloc(d->pool, TAKE, ids) == KV_OK);
    for (int i = 0; i < TAKE; i += 2)
        CHECK(kv_block_pool_release(d->pool, &ids[i], 1) == KV_OK);
}

static void dcache_free(struct dcache *d)
{
    kv_cache_destroy(d->c);
    free(d->h);
    free(d->back);
}

/* The reference: every element row of block sb of src's image into block
 * db of dst's (same layout; padding untouched). */
static void ref_copy(const struct dcache *s, uint32_t sb, struct dcache *d, uint32_t db)
{
    const struct kv_layout *lo = &s->pc.layout;
    const int64_t row = lo->head_dim * lo->elem_bytes;
    for (int64_t l = 0; l < lo->num_layers; l++)
        for (int64_t k = 0; k < 2; k++)
            for (int64_t n = 0; n < lo->block_tokens; n++)
                for (int64_t hd = 0; hd < lo->num_heads; hd++) {
                    const int64_t r = l * lo->stride_layer_bytes + k * lo->stride_kv_bytes +
                                      n * lo->stride_token_bytes + hd * lo->stride_head_bytes;
                    memcpy(d->h + db * lo->stride_block_bytes + r,
                           s->h + sb * lo->stride_block_bytes + r, (size_t)row);
                }
}

static kv_offload_state wait_op(kv_offload_op *op)
{
    kv_offload_state st = KV_OFFLOAD_PENDING;
    CHECK(kv_offload_wait(op, WAIT_MS, &st) == KV_OK);
    return st;
}

static void one_layout(int bits)
{
    struct kv_offload_config oc = KV_OFFLOAD_CONFIG_INIT;
    oc.capacity_bytes = (size_t)64 << 20;
    kv_offload *off = NULL;
    CHECK(kv_offload_create(&oc, &off) == KV_OK);
    CHECK(kv_offload_mem_kind(off) == KV_MEM_PINNED);
    struct dcache s, d;
    dcache_make(&s, bits, 100 + (uint64_t)bits);
    dcache_make(&d, bits, 200 + (uint64_t)bits);
    enum { NB = 24 };
    uint64_t h[NB];
    uint32_t ids[NB];
    CHECK(kv_block_pool_alloc(s.pool, NB, ids) == KV_OK);
    for (int i = 0; i < NB; i++) {
        h[i] = rnd(&(uint64_t){(uint64_t)(bits * 1000 + i)});
        bool stored = false;
        CHECK(kv_block_pool_commit_hash(s.pool, ids[i], h[i], &stored) == KV_OK && stored);
    }
    kv_offload_op *op = NULL;
    CHECK(kv_offload_store(off, s.c, ids, NB, &op) == KV_OK);
    CHECK(wait_op(op) == KV_OFFLOAD_DONE);
    CHECK(kv_offload_op_free(op) == KV_OK);
    gpu_pool_same(s.pc.base, s.back, s.h, s.bytes, "store", "the source before the store");

    /* load: the whole destination pool against the reference */
    CHECK(kv_offload_load(off, d.c, h, NB, &op) == KV_OK);
    CHECK(wait_op(op) == KV_OFFLOAD_DONE);
    const struct kv_offload_result *res;
    uint32_t nr;
    CHECK(kv_offload_results(op, &res, &nr) == KV_OK && nr == NB);
    for (int i = 0; i < NB; i++) {
        CHECK(res[i].status == KV_OK && res[i].committed);
        ref_copy(&s, ids[i], &d, res[i].block);
    }
    gpu_pool_same(d.pc.base, d.back, d.h, d.bytes, "load", "the reference");
    for (int i = 0; i < NB; i++) {
        uint32_t b = res[i].block;
        CHECK(kv_block_pool_release(d.pool, &b, 1) == KV_OK);
    }
    CHECK(kv_offload_op_free(op) == KV_OK);

    /* a corrupted entry: refused before its H2D, the rest loaded */
    CHECK(kv__offload_test_corrupt(off, s.c, h[5], 1234) == KV_OK);
    CHECK(kv_offload_load(off, d.c, h, 8, &op) == KV_OK);
    CHECK(wait_op(op) == KV_OFFLOAD_FAILED);
    CHECK(kv_offload_results(op, &res, &nr) == KV_OK && nr == 8);
    for (int i = 0; i < 8; i++) {
        if (i == 5) {
            CHECK(res[i].status == KV_ERR_CORRUPT && res[i].block == KV_BLOCK_NULL);
            continue;
        }
        CHECK(res[i].status == KV_OK);
        ref_copy(&s, ids[i], &d, res[i].block);
    }
    gpu_pool_same(d.pc.base, d.back, d.h, d.bytes, "corrupt load", "the reference");
    CHECK(kv_offload_op_free(op) == KV_OK);

    /* the engine destroys its cache with a store of it posted */
    CHECK(kv_offload_store(off, s.c, ids, NB, &op) == KV_OK);
    CHECK(kv_block_pool_release(s.pool, ids, NB) == KV_OK);
    kv_cache_destroy(s.c);
    s.c = NULL;
    CHECK(wait_op(op) == KV_OFFLOAD_DONE);
    CHECK(kv_offload_op_free(op) == KV_OK);
    kv_offload_destroy(off);
    dcache_free(&s);
    dcache_free(&d);
}

int main(void)
{
    int devs = 0;
    if (cudaGetDeviceCount(&devs) != cudaSuccess || devs == 0) {
        const char *e = getenv("KV_EXPECT_GPU");
        if (e && strcmp(e, "1") == 0) {
            fprintf(stderr, "FAIL: KV_EXPECT_GPU=1 but no CUDA device is usable\n");
            return 1;
        }
        printf("no GPU: skipped\n");
        return 0;
    }
    for (int bits = 0; bits < 4; bits++)
        one_layout(bits);
    printf("test_gpu_offload: 4 layouts, device -> pinned tier -> device, whole pools: ok\n");
    return 0;
}
