/*
 * test_gpu_plan.c - runs only where a GPU exists (scripts/gpu-check.sh):
 * kv_plan_copy_cuda against kv_plan_copy (itself checked element by element
 * in tests/unit/test_plan.c) over every pair of layouts (NHD/HND x layer-/
 * block-major x padded x packed), page sizes 8/16/32, head slices, layer
 * ranges between caches of different layer counts, dtypes
 * with odd head dims (the kernel's 16-, 4- and 1-byte paths), partial last
 * windows and block ids spread over the pools. Source and destination pools
 * start from the same random bytes on the host and the device; after the
 * copy the WHOLE destination pool must be identical (no stray writes) and
 * the source unchanged. Also: pinned host memory on one side, one device
 * cache on both sides (compaction), a non-default stream, and refusals that
 * leave the device pool unchanged.
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
#include <kvcache/kv.h>

/* One side: a layout, its bytes on the host (h, the CPU executor's), and the
 * same bytes on the device (or in pinned memory). */
struct side {
    struct kv_layout lo;
    struct kv_paged_cache host, dev;
    unsigned char *h, *back;
    size_t bytes;
    int pinned;
};

/* bits: 1 HND, 2 block-major, 4 padded, 8 packed K|V. */
static void side_init(struct side *s, int64_t L, int64_t B, int64_t N, int64_t H, int64_t D,
                      kv_dtype dt, int bits, int pinned, uint64_t seed)
{
    struct kv_layout_config c = KV_LAYOUT_CONFIG_INIT;
    memset(s, 0, sizeof(*s));
    c.num_layers = L;
    c.num_blocks = B;
    c.block_tokens = N;
    c.num_heads = H;
    c.head_dim = D;
    c.dtype = dt;
    c.order = (bits & 1) ? KV_ORDER_HND : KV_ORDER_NHD;
    c.arrange = (bits & 2) ? KV_ARRANGE_BLOCK_MAJOR : KV_ARRANGE_LAYER_MAJOR;
    c.block_pad_elems = (bits & 4) ? 24 : 0;
    c.kv_packed = (bits & 8) != 0;
    CHECK(kv_layout_init(&c, &s->lo) == KV_OK);
    s->bytes = (size_t)s->lo.total_bytes;
    s->h = malloc(s->bytes);
    s->back = malloc(s->bytes);
    CHECK(s->h && s->back);
    for (size_t i = 0; i < s->bytes; i += 8) {
        const uint64_t x = gpu_rnd(&seed);
        memcpy(s->h + i, &x, s->bytes - i < 8 ? s->bytes - i : 8);
    }
    s->host = (struct kv_paged_cache){s->lo, s->h, s->bytes, KV_MEM_HOST};
    s->dev = s->host;
    s->pinned = pinned;
    s->dev.mem = pinned ? KV_MEM_PINNED : KV_MEM_DEVICE;
    if (pinned)
        CHECK(cudaMallocHost(&s->dev.base, s->bytes) == cudaSuccess);
    else
        CHECK(cudaMalloc(&s->dev.base, s->bytes) == cudaSuccess);
    CHECK(cudaMemcpy(s->dev.base, s->h, s->bytes, cudaMemcpyDefault) == cudaSuccess);
}

static void side_same(struct side *s, const char *what)
{
    gpu_pool_same(s->dev.base, s->back, s->h, s->bytes, what, "kv_plan_copy");
}

static void side_free(struct side *s)
{
    if (s->pinned)
        cudaFreeHost(s->dev.base);
    else
        cudaFree(s->dev.base);
    free(s->h);
    free(s->back);
}

/* n distinct ids of [0, B), shuffled. */
static void pick(uint64_t *r, int64_t B, uint32_t n, uint32_t *ids)
{
    uint32_t *all = malloc((size_t)B * sizeof(*all));
    CHECK(all != NULL);
    for (int64_t i = 0; i < B; i++)
        all[i] = (uint32_t)i;
    for (uint32_t i = 0; i < n; i++) {
        const uint32_t j = i + (uint32_t)(gpu_rnd(r) % (uint64_t)(B - i)), t = all[i];
        all[i] = all[j];
        all[j] = t;
        ids[i] = all[i];
    }
    free(all);
}

/* Layers of a case: source and destination L, the layer range (nl 0: all). */
struct layers {
    int64_t Ls, Ld, sl0, dl0, nl;
};
static const struct layers ALL3 = {3, 3, 0, 0, 0};

static void one_case_layers(int64_t Bs, int64_t Bd, int sb, int db, int64_t Ns, int64_t Nd,
                            int64_t Hs, int64_t Hd, int64_t sh0, int64_t dh0, int64_t nh, int64_t D,
                            kv_dtype dt, uint64_t T, int pinned, cudaStream_t stream, uint64_t seed,
                            struct layers ly)
{
    struct side s, d;
    char what[200];
    side_init(&s, ly.Ls, Bs, Ns, Hs, D, dt, sb, pinned == 1, seed);
    side_init(&d, ly.Ld, Bd, Nd, Hd, D, dt, db, pinned == 2, seed + 1);
    struct kv_plan_config pc = KV_PLAN_CONFIG_INIT;
    pc.src_head0 = sh0;
    pc.dst_head0 = dh0;
    pc.n_heads = nh;
    pc.src_layer0 = ly.sl0;
    pc.dst_layer0 = ly.dl0;
    pc.n_layers = ly.nl;
    kv_plan *plan = NULL;
    CHECK(kv_plan_create(&s.lo, &d.lo, &pc, &plan) == KV_OK);
    const uint32_t ns = (uint32_t)((T + (uint64_t)Ns - 1) / (uint64_t)Ns);
    const uint32_t nd = (uint32_t)((T + (uint64_t)Nd - 1) / (uint64_t)Nd);
    uint32_t sid[180], did[180];
    uint64_t r = seed * 3 + 1;
    CHECK(ns <= 180 && nd <= 180);
    pick(&r, s.lo.num_blocks, ns, sid);
    pick(&r, d.lo.num_blocks, nd, did);
    CHECK(kv_plan_copy(plan, s.host, sid, ns, d.host, did, nd, T) == KV_OK);
    CHECK(kv_plan_copy_cuda(plan, s.dev, sid, ns, d.dev, did, nd, T, (kv_cuda_stream)stream) ==
          KV_OK);
    snprintf(what, sizeof(what),
             "bits %d->%d N %lld->%lld heads %lld+%lld->%lld layers %lld+%lld of %lld -> %lld "
             "of %lld D %lld %s T %llu",
             sb, db, (long long)Ns, (long long)Nd, (long long)sh0, (long long)nh, (long long)dh0,
             (long long)ly.sl0, (long long)ly.nl, (long long)ly.Ls, (long long)ly.dl0,
             (long long)ly.Ld, (long long)D, kv_dtype_name(dt), (unsigned long long)T);
    side_same(&d, what);
    side_same(&s, what); /* the source unchanged */
    kv_plan_destroy(plan);
    side_free(&s);
    side_free(&d);
}

static void one_case(int64_t Bs, int64_t Bd, int sb, int db, int64_t Ns, int64_t Nd, int64_t Hs,
                     int64_t Hd, int64_t sh0, int64_t dh0, int64_t nh, int64_t D, kv_dtype dt,
                     uint64_t T, int pinned, cudaStream_t stream, uint64_t seed)
{
    one_case_layers(Bs, Bd, sb, db, Ns, Nd, Hs, Hd, sh0, dh0, nh, D, dt, T, pinned, stream, seed,
                    ALL3);
}

/* One device cache on both sides (compaction), and refusals that leave the
 * device pool unchanged. */
static void same_cache_and_refusals(void)
{
    struct side s;
    side_init(&s, 3, 64, 16, 4, 64, KV_BF16, 0, 0, 77);
    kv_plan *p = NULL;
    CHECK(kv_plan_create(&s.lo, &s.lo, NULL, &p) == KV_OK);
    uint32_t a[3] = {3, 40, 9}, b[3] = {10, 11, 63}, dup[3] = {10, 11, 10}, far[3] = {1, 64, 2};
    CHECK(kv_plan_copy_cuda(p, s.dev, a, 3, s.dev, dup, 3, 48, NULL) == KV_ERR_OVERLAP);
    CHECK(kv_plan_copy_cuda(p, s.dev, a, 3, s.dev, far, 3, 48, NULL) == KV_ERR_OUT_OF_BOUNDS);
    CHECK(kv_plan_copy_cuda(p, s.dev, a, 3, s.dev, a, 3, 48, NULL) == KV_ERR_OVERLAP);
    CHECK(kv_plan_copy_cuda(p, s.host, a, 3, s.dev, b, 3, 48, NULL) == KV_ERR_INVALID_ARG);
    side_same(&s, "refusals");
    CHECK(kv_plan_copy(p, s.host, a, 3, s.host, b, 3, 40) == KV_OK);
    CHECK(kv_plan_copy_cuda(p, s.dev, a, 3, s.dev, b, 3, 40, NULL) == KV_OK);
    side_same(&s, "one cache on both sides");
    CHECK(kv_plan_copy_cuda(p, s.dev, a, 0, s.dev, b, 0, 0, NULL) == KV_OK); /* no work */
    kv_plan_destroy(p);
    side_free(&s);
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
    static const int64_t Ns[3] = {8, 16, 32};
    uint64_t seed = 1;
    int n = 0;
    cudaStream_t st;
    CHECK(cudaStreamCreate(&st) == cudaSuccess);
    /* every layout pair; H 8 x D 128 bf16: a layer's block is 16-64 KiB
     * (wide copies where both sides keep it whole) or 256-byte head rows
     * (narrow: the kernel) */
    for (int sb = 0; sb < 16; sb++)
        for (int db = 0; db < 16; db++, n++) {
            const int64_t a = Ns[(sb + db) % 3], b = Ns[(sb * 3 + db) % 3];
            const uint64_t T = 1 + gpu_rnd(&seed) % 300;
            one_case(64, 48, sb, db, a, b, 8, 8, 0, 0, 0, 128, KV_BF16, T, 0, n % 2 ? st : NULL,
                     seed++);
        }
    /* head slices, 4- and 1-byte vector paths (D 10 f16: 20-byte rows;
     * D 13 fp8: 13-byte rows), partial last windows */
    for (int i = 0; i < 16; i++, n += 3) {
        one_case(200, 180, i, 15 - i, 16, i % 2 ? 32 : 8, 4, 2, 2, 0, 2, 64, KV_BF16, 16 * 9 + 5, 0,
                 NULL, seed++);
        one_case(200, 180, 15 - i, i, 16, 16, 2, 4, 0, 2, 2, 10, KV_F16, 77, 0, st, seed++);
        one_case(200, 180, i, i, 8, 16, 6, 5, 1, 2, 3, 13, KV_FP8_E4M3, 100, 0, NULL, seed++);
    }
    /* wide copies and the kernel in one request (D 1024: HND head runs of
     * 16-64 KiB beside 2 KiB head rows) */
    for (int i = 0; i < 3; i++, n++) {
        static const int pairs[3][3] = {{3, 2, 32}, {3, 10, 16}, {3, 11, 32}};
        one_case(16, 12, pairs[i][0], pairs[i][1], pairs[i][2], pairs[i][2], 8, 8, 0, 0, 0, 1024,
                 KV_BF16, (uint64_t)pairs[i][2] * 5 + 7, 0, i % 2 ? st : NULL, seed++);
    }
    /* layer ranges between different layer counts (a pipeline stage's 2
     * layers into a decoder of 5, one layer), every layout pair of a few */
    for (int sb = 0; sb < 16; sb += 3)
        for (int db = 0; db < 16; db += 2, n++) {
            const int64_t Ls = 1 + (int64_t)(gpu_rnd(&seed) % 4),
                          Ld = 1 + (int64_t)(gpu_rnd(&seed) % 5);
            const int64_t nl = 1 + (int64_t)(gpu_rnd(&seed) % (uint64_t)(Ls < Ld ? Ls : Ld));
            const struct layers ly = {Ls, Ld, (int64_t)(gpu_rnd(&seed) % (uint64_t)(Ls - nl + 1)),
                                      (int64_t)(gpu_rnd(&seed) % (uint64_t)(Ld - nl + 1)), nl};
            one_case_layers(64, 48, sb, db, Ns[(sb + db) % 3], Ns[(2 * sb + db) % 3], 8, 8, 0, 0, 0,
                            128, KV_BF16, 1 + gpu_rnd(&seed) % 200, 0, n % 2 ? st : NULL, seed++,
                            ly);
        }
    /* pinned host memory on either side */
    for (int i = 0; i < 8; i++, n++)
        one_case(64, 48, i, 15 - i, 16, 32, 8, 8, 0, 0, 0, 128, KV_BF16, 200, 1 + i % 2, NULL,
                 seed++);
    same_cache_and_refusals();
    CHECK(cudaStreamDestroy(st) == cudaSuccess);
    printf("test_gpu_plan: %d layout cases against kv_plan_copy (whole pools), one-cache copy, "
           "refusals: ok\n",
           n);
    return 0;
}
