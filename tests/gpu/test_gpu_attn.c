/*
 * test_gpu_attn.c - runs only where a GPU exists (scripts/gpu-check.sh): the
 * attention kernels' CUDA backend on the cases of tests/unit/test_attn.c.
 *
 * Every case starts a device pool and a host pool from the same random bytes
 * and runs the same call through the CPU kernel (itself checked element by
 * element against a plain reference in tests/unit/test_attn.c) and the CUDA
 * kernel: write (int64 and int32 slots) and copy_blocks (whole, a layer and
 * a plane, and into a second cache) must leave the two pools identical byte for
 * byte (the whole pool: no stray writes), read must fill identical output
 * buffers (guard bytes included), and decode must be within 1e-5 relative of
 * a float64 reference computed here from the layout's strides. The scale
 * rules (x / scale, scale 1.0 still converting, raw bytes only without
 * scales) on inputs that tell the variants apart, writes and reads.
 *
 * Then the GPU benchmark lines (JSON, docs/benchmarks.md): write_prefill,
 * write_decode and read against a device-to-device cudaMemcpy of the same
 * bytes, and decode attention against reading its K/V once at cudaMemcpy
 * speed (every decode body: auto, general, pipelined, split-KV, and a
 * small batch of long sequences); medians of 9, interleaved.
 * `test_gpu_attn decode` runs the decode cases and the bench alone;
 * `test_gpu_attn prefill` the prefill cases.
 *
 * Without a GPU it prints "no GPU: skipped" and passes, unless
 * KV_EXPECT_GPU=1 (gpu-check.sh), where a missing GPU fails.
 */
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_test.h"
#include <kvcache/kv.h>
#include "kv_convert_hd.h" /* scalar conversions: not installed */

/* Library-internal test hooks (attention/kv_attn_grid_int.h): the decode
 * body (0 auto, 1 general, 2 vector, 3 pipelined vector, 4 split-KV; a
 * vector-family body where the rows allow none runs the general one) and
 * split-KV's chunks per sequence (0: its plan). */
extern int kv__cdec_body;
extern int kv__cdec_chunks;
/* Library-internal (attention/kv_attn_dev.c): kv_attn_decode_ex_cuda_dev
 * with a caller workspace for split-KV and the longest sequence's tokens
 * as a hint (-1 none); capture-safe. */
kv_status kv__attn_decode_ex_cuda_dev_ws(struct kv_paged_cache cache, uint32_t layer,
                                         const struct kv_view *q,
                                         const struct kv_attn_dev_pages *pages, float softmax_scale,
                                         const struct kv_attn_dev_scales *scales,
                                         const struct kv_view *out, const struct kv_attn_opts *opts,
                                         void *ws, size_t ws_bytes, int64_t max_tokens,
                                         struct kv_attn_cuda_errors *errors, kv_cuda_stream stream);
enum { B_AUTO, B_GENERAL, B_VEC, B_PIPE, B_SPLIT };
static const char *const body_names[] = {"auto", "general", "vector", "pipelined", "split"};

/* The bodies every decode case runs: (body, chunks) */
static const int dec_bodies[][2] = {
    {B_AUTO, 0}, {B_GENERAL, 0}, {B_PIPE, 0}, {B_SPLIT, 3}, {B_SPLIT, 0}};

static int64_t range(uint64_t *s, int64_t lo, int64_t hi)
{
    return lo + (int64_t)(gpu_rnd(s) % (uint64_t)(hi - lo + 1));
}

static void fill(unsigned char *p, size_t n, uint64_t seed)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (unsigned char)gpu_rnd(&seed);
}

/* A host pool and a device pool holding the same bytes. */
struct pools {
    struct kv_layout_config cfg;
    struct kv_paged_cache host, dev;
    unsigned char *h, *back;
    size_t bytes;
};

static void pools_init(struct pools *p, const struct kv_layout_config *cfg, uint64_t seed)
{
    memset(p, 0, sizeof(*p));
    p->cfg = *cfg;
    CHECK(kv_layout_init(cfg, &p->host.layout) == KV_OK);
    p->bytes = (size_t)p->host.layout.total_bytes;
    p->h = malloc(p->bytes);
    p->back = malloc(p->bytes);
    CHECK(p->h && p->back);
    fill(p->h, p->bytes, seed);
    p->host.base = p->h;
    p->host.storage_bytes = p->bytes;
    p->dev = p->host;
    p->dev.mem = KV_MEM_DEVICE;
    CHECK(cudaMalloc(&p->dev.base, p->bytes) == cudaSuccess);
    CHECK(cudaMemcpy(p->dev.base, p->h, p->bytes, cudaMemcpyHostToDevice) == cudaSuccess);
}

static void pools_same(struct pools *p, const char *what)
{
    gpu_pool_same(p->dev.base, p->back, p->h, p->bytes, what, "the CPU kernel");
}

static void pools_free(struct pools *p)
{
    cudaFree(p->dev.base);
    free(p->h);
    free(p->back);
}

/* A tensor [L?][T][H][D] in host and device buffers of identical bytes:
 * mode 0 contiguous, 1 K and V slices of one fused [T][3][H][D] buffer
 * (outer strides), 2 head dim of stride 2 (generic). */
struct tens {
    unsigned char *h, *d;
    size_t bytes;
    struct kv_view hk, hv, dk, dv;
};

static void tens_init(struct tens *t, int mode, kv_dtype dt, int64_t L, int64_t T, int64_t H,
                      int64_t D, uint64_t seed)
{
    const int64_t es = (int64_t)kv_dtype_size(dt), lead = L ? L : 1;
    const int nd = L ? 4 : 3;
    int64_t shape[4] = {L, T, H, D}, st[4], elems, voff;
    if (mode == 0) {
        st[3] = 1, st[2] = D, st[1] = H * D, st[0] = T * H * D;
        elems = 2 * lead * T * H * D, voff = lead * T * H * D;
    } else if (mode == 1) {
        st[3] = 1, st[2] = D, st[1] = 3 * H * D, st[0] = T * 3 * H * D;
        elems = lead * T * 3 * H * D, voff = H * D;
    } else {
        st[3] = 2, st[2] = 2 * D, st[1] = 2 * H * D, st[0] = T * 2 * H * D;
        elems = 2 * lead * T * 2 * H * D, voff = lead * T * 2 * H * D;
    }
    memset(t, 0, sizeof(*t));
    t->bytes = (size_t)(elems ? elems : 1) * (size_t)es;
    t->h = malloc(t->bytes);
    CHECK(t->h);
    for (int64_t i = 0; i < elems; i++) /* finite values of every magnitude */
        kv_from_f32(dt, (float)range(&seed, -30000, 30000) / 1000.0f, t->h + i * es);
    CHECK(cudaMalloc((void **)&t->d, t->bytes) == cudaSuccess);
    CHECK(cudaMemcpy(t->d, t->h, t->bytes, cudaMemcpyHostToDevice) == cudaSuccess);
    int64_t n1 = elems ? elems : 1;
    for (int side = 0; side < 2; side++) {
        struct kv_view flat;
        unsigned char *b = side ? t->d : t->h;
        CHECK(kv_view_init(b, t->bytes, dt, 1, &n1, &flat) == KV_OK);
        CHECK(kv_view_as_strided(&flat, nd, L ? shape : shape + 1, L ? st : st + 1, 0,
                                 side ? &t->dk : &t->hk) == KV_OK);
        CHECK(kv_view_as_strided(&flat, nd, L ? shape : shape + 1, L ? st : st + 1, voff,
                                 side ? &t->dv : &t->hv) == KV_OK);
    }
}

static void tens_same(struct tens *t, const char *what)
{
    unsigned char *b = malloc(t->bytes);
    CHECK(b);
    CHECK(cudaDeviceSynchronize() == cudaSuccess);
    CHECK(cudaMemcpy(b, t->d, t->bytes, cudaMemcpyDeviceToHost) == cudaSuccess);
    if (memcmp(b, t->h, t->bytes) != 0) {
        size_t i = 0;
        while (b[i] == t->h[i])
            i++;
        fprintf(stderr, "FAIL %s: device output byte %zu is 0x%02x, the CPU kernel's 0x%02x\n",
                what, i, b[i], t->h[i]);
        exit(1);
    }
    free(b);
}

static void tens_free(struct tens *t)
{
    free(t->h);
    cudaFree(t->d);
}

/* S sequences on distinct random pages of the upper half of the page space
 * (block ids far from 0), last pages partial, as CSR (csr) or a block table. */
struct seqs {
    uint32_t S;
    int64_t pt, total, lens[4];
    int32_t indptr[5], indices[4 * 160], last[4], table[4 * 160];
    struct kv_pages pages;
    int64_t *slots;
};

static void seqs_init(struct seqs *q, const struct kv_layout *lo, uint32_t r, bool csr,
                      int64_t max_len, uint64_t *rng)
{
    const int64_t P = lo->num_blocks * r;
    uint8_t *used = calloc((size_t)P, 1);
    CHECK(used);
    memset(q, 0, sizeof(*q));
    q->S = 3;
    q->pt = lo->block_tokens / r;
    int32_t k = 0;
    for (uint32_t s = 0; s < q->S; s++) {
        int64_t n = range(rng, 1, max_len);
        if (n % q->pt == 0 && q->pt > 1)
            n--;
        const int64_t np = (n + q->pt - 1) / q->pt;
        CHECK(np <= 160);
        q->indptr[s] = k;
        for (int64_t j = 0; j < np; j++) {
            int64_t pg;
            do
                pg = range(rng, P / 2, P - 1);
            while (used[pg]);
            used[pg] = 1;
            q->indices[k] = (int32_t)pg;
            q->table[s * 160 + j] = (int32_t)pg;
            k++;
        }
        q->last[s] = (int32_t)(n - (np - 1) * q->pt);
        q->lens[s] = n;
        q->total += n;
    }
    q->indptr[q->S] = k;
    q->slots = malloc((size_t)q->total * sizeof(int64_t));
    CHECK(q->slots);
    int64_t t = 0;
    for (uint32_t s = 0; s < q->S; s++)
        for (int64_t i = 0; i < q->lens[s]; i++)
            q->slots[t++] = (int64_t)q->table[s * 160 + i / q->pt] * q->pt + i % q->pt;
    q->pages.n_seqs = q->S;
    q->pages.page_ratio = r;
    if (csr) {
        q->pages.format = KV_PAGES_CSR;
        q->pages.indptr = q->indptr;
        q->pages.indices = q->indices;
        q->pages.last_page_len = q->last;
    } else {
        q->pages.format = KV_PAGES_BLOCK_TABLE;
        q->pages.block_table = q->table;
        q->pages.block_table_cols = 160;
        q->pages.seq_lens = q->lens;
    }
    free(used);
}

static const kv_dtype dtypes[5] = {KV_F32, KV_F16, KV_BF16, KV_FP8_E4M3, KV_FP8_E5M2};

/* write -> read -> copy_blocks on one layout, CPU against CUDA. */
static void round_trip(int i)
{
    static const int64_t Ns[4] = {1, 8, 16, 32}, Ds[4] = {64, 80, 128, 256};
    uint64_t rng = 5000 + (uint64_t)i;
    const int lay = i % 16;
    struct kv_layout_config cfg = KV_LAYOUT_CONFIG_INIT;
    cfg.num_layers = 2;
    cfg.order = (lay & 1) ? KV_ORDER_HND : KV_ORDER_NHD;
    cfg.arrange = (lay & 2) ? KV_ARRANGE_BLOCK_MAJOR : KV_ARRANGE_LAYER_MAJOR;
    cfg.block_pad_elems = (lay & 4) ? 24 : 0;
    cfg.kv_packed = (lay & 8) != 0;
    cfg.block_tokens = Ns[(i / 16) % 4];
    cfg.head_dim = Ds[(i + i / 16) % 4];
    cfg.num_heads = 2 + i % 3;
    cfg.dtype = dtypes[i % 5];
    const kv_dtype sdt = dtypes[(i / 5) % 5];
    const int mode = i % 3, out_mode = (i + 1) % 3;
    const bool all = i % 4 == 1, csr = (i / 2) % 2 == 0;
    const uint32_t r = cfg.block_tokens % 2 == 0 && i % 2 ? 2 : 1;
    const int64_t max_len = 3 * cfg.block_tokens + 5 > 60 ? 3 * cfg.block_tokens + 5 : 60;
    const int64_t pt = cfg.block_tokens / r;
    cfg.num_blocks = 2 * (3 * ((max_len + pt - 1) / pt) / r + 8) + 2;
    struct pools p;
    pools_init(&p, &cfg, rng);
    struct seqs q;
    seqs_init(&q, &p.host.layout, r, csr, max_len, &rng);
    const int64_t L = all ? cfg.num_layers : 0, H = cfg.num_heads, D = cfg.head_dim;
    const int32_t layer = all ? KV_ATTN_ALL_LAYERS : (int32_t)range(&rng, 0, 1);
    float ks[4] = {0.25f, 0.5f, 0.75f, 1.0f}, vs[4] = {1.5f, 0.75f, 0.5f, 0.375f};
    struct kv_scales sc = {ks, vs, i % 7 == 3 ? (uint32_t)H : 1, 0};
    const struct kv_scales *scp = (i % 7 == 3 || i % 5 >= 3) ? &sc : NULL;
    char what[160];
    snprintf(what, sizeof(what), "case %d (N %lld D %lld H %lld %s->%s mode %d)", i,
             (long long)cfg.block_tokens, (long long)D, (long long)H, kv_dtype_name(sdt),
             kv_dtype_name(cfg.dtype), mode);

    struct tens src;
    tens_init(&src, mode, sdt, L, q.total, H, D, rng * 3);
    CHECK(kv_attn_write(p.host, layer, &src.hk, &src.hv, q.slots, q.total, scp) == KV_OK);
    CHECK(kv_attn_write_cuda(p.dev, layer, &src.dk, &src.dv, q.slots, q.total, scp, NULL) == KV_OK);
    pools_same(&p, what);

    struct tens out;
    tens_init(&out, out_mode, sdt, L, q.total, H, D, rng * 5);
    CHECK(kv_attn_read(p.host, layer, &q.pages, &out.hk, &out.hv, scp) == KV_OK);
    CHECK(kv_attn_read_cuda(p.dev, layer, &q.pages, &out.dk, &out.dv, scp, NULL) == KV_OK);
    tens_same(&out, what);

    /* copies from the sequences' blocks into unused low blocks */
    struct kv_block_copy cp[8];
    uint32_t n = 0;
    for (uint32_t j = 0; j < 8 && j < (uint32_t)q.indptr[q.S]; j++) {
        const uint32_t b = (uint32_t)q.indices[j] / r;
        bool dup = false;
        for (uint32_t m = 0; m < n; m++)
            dup |= cp[m].src == b;
        if (!dup)
            cp[n++] = (struct kv_block_copy){b, 1 + n, 0};
    }
    CHECK(kv_attn_copy_blocks(p.host, cp, n) == KV_OK);
    CHECK(kv_attn_copy_blocks_cuda(p.dev, cp, n, NULL) == KV_OK);
    pools_same(&p, what);

    /* the same copies with a layer and a plane, within the pool */
    struct kv_copy_blocks_opts o = KV_COPY_BLOCKS_OPTS_INIT;
    o.layer0 = (uint32_t)(i % 2), o.n_layers = 1, o.planes = (uint32_t)(1 + i % 3);
    for (uint32_t j = 0; j < n; j++)
        cp[j].dst = n + 1 + j; /* low blocks the first copies left alone */
    CHECK(kv_attn_copy_blocks_ex(p.host, p.host, cp, n, &o) == KV_OK);
    CHECK(kv_attn_copy_blocks_ex_cuda(p.dev, p.dev, cp, n, &o, NULL) == KV_OK);
    pools_same(&p, what);

    /* swap out into a cache of another block count and arrangement */
    struct kv_layout_config cfg2 = cfg;
    cfg2.num_blocks = n + 3;
    cfg2.arrange =
        cfg.arrange == KV_ARRANGE_BLOCK_MAJOR ? KV_ARRANGE_LAYER_MAJOR : KV_ARRANGE_BLOCK_MAJOR;
    struct pools p2;
    pools_init(&p2, &cfg2, rng * 11);
    for (uint32_t j = 0; j < n; j++)
        cp[j].dst = n + 2 - j;
    o.layer0 = 0, o.n_layers = 0, o.planes = (uint32_t)(i % 4);
    CHECK(kv_attn_copy_blocks_ex(p2.host, p.host, cp, n, &o) == KV_OK);
    CHECK(kv_attn_copy_blocks_ex_cuda(p2.dev, p.dev, cp, n, &o, NULL) == KV_OK);
    pools_same(&p2, what);
    pools_same(&p, what);
    pools_free(&p2);

    /* int32 slots: the pool int64 slots give */
    int32_t *s32 = malloc((size_t)(q.total ? q.total : 1) * sizeof(int32_t));
    CHECK(s32 != NULL);
    for (int64_t t = 0; t < q.total; t++)
        s32[t] = (int32_t)q.slots[t];
    struct tens src2;
    tens_init(&src2, mode, sdt, L, q.total, H, D, rng * 7);
    CHECK(kv_attn_write_i32(p.host, layer, &src2.hk, &src2.hv, s32, q.total, scp) == KV_OK);
    CHECK(kv_attn_write_i32_cuda(p.dev, layer, &src2.dk, &src2.dv, s32, q.total, scp, NULL) ==
          KV_OK);
    pools_same(&p, what);
    tens_free(&src2);
    free(s32);

    tens_free(&out);
    tens_free(&src);
    free(q.slots);
    pools_free(&p);
}

/* Decode attention against a float64 reference from the cache contents. */
static void decode_case(int i)
{
    static const int64_t Ns[4] = {1, 8, 16, 32}, Ds[4] = {64, 80, 128, 256};
    uint64_t rng = 9000 + (uint64_t)i;
    const int lay = i % 16;
    struct kv_layout_config cfg = KV_LAYOUT_CONFIG_INIT;
    cfg.num_layers = 2;
    cfg.order = (lay & 1) ? KV_ORDER_HND : KV_ORDER_NHD;
    cfg.arrange = (lay & 2) ? KV_ARRANGE_BLOCK_MAJOR : KV_ARRANGE_LAYER_MAJOR;
    cfg.block_pad_elems = (lay & 4) ? 8 : 0;
    cfg.kv_packed = (lay & 8) != 0;
    cfg.block_tokens = Ns[(i / 16) % 4] < 8 ? 8 : Ns[(i / 16) % 4];
    cfg.head_dim = Ds[i % 4];
    cfg.num_heads = 2;
    cfg.dtype = dtypes[i % 5];
    const int64_t g = 1 + i % 4, H = 2, Hq = H * g, D = cfg.head_dim;
    const uint32_t r = i % 2 ? 2 : 1;
    const int64_t pt = cfg.block_tokens / r, lens[3] = {1, 1 + range(&rng, 0, 2000), 257};
    int64_t pages_total = 0;
    for (int s = 0; s < 3; s++)
        pages_total += (lens[s] + pt - 1) / pt;
    cfg.num_blocks = 2 * (pages_total / r + 2) + 4;
    struct pools p;
    pools_init(&p, &cfg, rng);
    /* the pool holds finite values: rewrite it from f32 values in [-1, 1] */
    const int64_t es = (int64_t)p.host.layout.elem_bytes;
    for (int64_t e = 0; e < (int64_t)p.bytes / es; e++)
        kv_from_f32(cfg.dtype, (float)range(&rng, -1000, 1000) / 1000.0f, p.h + e * es);
    CHECK(cudaMemcpy(p.dev.base, p.h, p.bytes, cudaMemcpyHostToDevice) == cudaSuccess);
    const int64_t P = cfg.num_blocks * r;
    int32_t *indices = malloc((size_t)pages_total * sizeof(int32_t)), indptr[4], last[3];
    uint8_t *used = calloc((size_t)P, 1);
    CHECK(indices && used);
    int32_t k = 0;
    for (int s = 0; s < 3; s++) {
        const int64_t np = (lens[s] + pt - 1) / pt;
        indptr[s] = k;
        for (int64_t j = 0; j < np; j++) {
            int64_t pg;
            do
                pg = range(&rng, P / 2, P - 1);
            while (used[pg]);
            used[pg] = 1;
            indices[k++] = (int32_t)pg;
        }
        last[s] = (int32_t)(lens[s] - (np - 1) * pt);
    }
    indptr[3] = k;
    struct kv_pages pg = {.format = KV_PAGES_CSR,
                          .n_seqs = 3,
                          .page_ratio = r,
                          .indptr = indptr,
                          .indices = indices,
                          .last_page_len = last};
    /* q f32 [3][Hq][D], out f32 [3][Hq][D] */
    const size_t qb = (size_t)(3 * Hq * D) * sizeof(float);
    float *hq = malloc(qb), *hout = malloc(qb);
    void *dq, *dout;
    CHECK(hq && hout);
    for (int64_t e = 0; e < 3 * Hq * D; e++)
        hq[e] = (float)range(&rng, -1000, 1000) / 1000.0f;
    CHECK(cudaMalloc(&dq, qb) == cudaSuccess && cudaMalloc(&dout, qb) == cudaSuccess);
    CHECK(cudaMemcpy(dq, hq, qb, cudaMemcpyHostToDevice) == cudaSuccess);
    int64_t sh[3] = {3, Hq, D};
    struct kv_view vq, vout;
    CHECK(kv_view_init(dq, qb, KV_F32, 3, sh, &vq) == KV_OK);
    CHECK(kv_view_init(dout, qb, KV_F32, 3, sh, &vout) == KV_OK);
    const float scale = 1.0f / sqrtf((float)D);
    const uint32_t layer = 1;
    /* options on two cases in three: a window of 37 tokens (shorter than
     * one sequence, longer than another), or a soft cap of 4 with lse */
    struct kv_attn_opts o = KV_ATTN_OPTS_INIT;
    float *hlse = NULL, *dlse = NULL;
    const size_t lb = (size_t)(3 * Hq) * sizeof(float);
    if (i % 3 == 1)
        o.window_left = 36;
    if (i % 3 == 2) {
        o.logit_soft_cap = 4.0f;
        hlse = malloc(lb);
        CHECK(hlse && cudaMalloc((void **)&dlse, lb) == cudaSuccess);
        o.lse = dlse;
    }
    /* every body: auto (the vector body where the layout allows it),
     * general, pipelined, split-KV in 3 chunks (lens 257 and up to 2001:
     * not a divisor) and by its plan */
    for (size_t bi = 0; bi < sizeof(dec_bodies) / sizeof(dec_bodies[0]); bi++) {
        const char *bname = body_names[dec_bodies[bi][0]];
        kv__cdec_body = dec_bodies[bi][0];
        kv__cdec_chunks = dec_bodies[bi][1];
        CHECK(kv_attn_decode_ex_cuda(p.dev, layer, &vq, &pg, scale, NULL, &vout, &o, NULL) ==
              KV_OK);
        kv__cdec_body = B_AUTO;
        kv__cdec_chunks = 0;
        CHECK(cudaDeviceSynchronize() == cudaSuccess);
        CHECK(cudaMemcpy(hout, dout, qb, cudaMemcpyDeviceToHost) == cudaSuccess);
        if (dlse)
            CHECK(cudaMemcpy(hlse, dlse, lb, cudaMemcpyDeviceToHost) == cudaSuccess);
        /* the float64 reference, addresses from the layout's strides */
        const struct kv_layout *lo = &p.host.layout;
        double *w = malloc((size_t)2100 * sizeof(double));
        CHECK(w);
        for (int s = 0; s < 3; s++)
            for (int64_t qi = 0; qi < Hq; qi++) {
                const int64_t h = qi / g;
                double mx = -INFINITY, sum = 0.0;
                const int64_t t0 = o.window_left >= 0 && lens[s] - 1 - o.window_left > 0
                                       ? lens[s] - 1 - o.window_left
                                       : 0;
                for (int64_t t = t0; t < lens[s]; t++) {
                    const int64_t page = indices[indptr[s] + t / pt], slot = page * pt + t % pt;
                    const int64_t b = slot / cfg.block_tokens, n = slot % cfg.block_tokens;
                    const unsigned char *kr =
                        p.h + layer * lo->stride_layer_bytes + b * lo->stride_block_bytes +
                        n * lo->stride_token_bytes + h * lo->stride_head_bytes;
                    double dot = 0.0;
                    for (int64_t d = 0; d < D; d++)
                        dot +=
                            (double)hq[(s * Hq + qi) * D + d] * kv_to_f32(cfg.dtype, kr + d * es);
                    w[t] = dot * scale;
                    if (o.logit_soft_cap > 0.0f)
                        w[t] = o.logit_soft_cap * tanh(w[t] / o.logit_soft_cap);
                    mx = w[t] > mx ? w[t] : mx;
                }
                for (int64_t t = t0; t < lens[s]; t++)
                    sum += (w[t] = exp(w[t] - mx));
                if (hlse) {
                    const double want = mx + log(sum), got = hlse[s * Hq + qi];
                    if (fabs(got - want) > 1e-5 * (fabs(want) > 1 ? fabs(want) : 1)) {
                        fprintf(stderr,
                                "FAIL decode case %d (body %s) lse s%d q%lld: %.9g vs %.9g\n", i,
                                bname, s, (long long)qi, got, want);
                        exit(1);
                    }
                }
                for (int64_t d = 0; d < D; d++) {
                    double a = 0.0;
                    for (int64_t t = t0; t < lens[s]; t++) {
                        const int64_t page = indices[indptr[s] + t / pt], slot = page * pt + t % pt;
                        const int64_t b = slot / cfg.block_tokens, n = slot % cfg.block_tokens;
                        const unsigned char *vr = p.h + layer * lo->stride_layer_bytes +
                                                  lo->stride_kv_bytes + b * lo->stride_block_bytes +
                                                  n * lo->stride_token_bytes +
                                                  h * lo->stride_head_bytes;
                        a += w[t] * kv_to_f32(cfg.dtype, vr + d * es);
                    }
                    const double want = a / sum, got = hout[(s * Hq + qi) * D + d];
                    const double tol = 1e-5 * (fabs(want) > 1e-2 ? fabs(want) : 1e-2);
                    if (fabs(got - want) > tol) {
                        fprintf(stderr,
                                "FAIL decode case %d (body %s) s%d q%lld d%lld (len %lld): %.9g "
                                "vs %.9g\n",
                                i, bname, s, (long long)qi, (long long)d, (long long)lens[s], got,
                                want);
                        exit(1);
                    }
                }
            }
        free(w);
    }
    free(hlse);
    cudaFree(dlse);
    free(hq);
    free(hout);
    cudaFree(dq);
    cudaFree(dout);
    free(indices);
    free(used);
    pools_free(&p);
}

/* MLA decode on the device (kv_attn_decode_mla_cuda) against the CPU
 * kernel on the same pool and q (itself checked against float64 in
 * tests/unit/test_attn_mla.c): a K-only pool of one KV head, D 576 / dv 512
 * and a small D, Hq 1, 16, 128 and 5, bf16 and fp8 e4m3 with a per-tensor
 * scale, padded, both arrangements, pages far from 0. prefill: MLA prefill
 * (kv_attn_prefill_mla_cuda vs kv_attn_prefill_mla), q_len 1, 7 and 33 over
 * the three sequences, odd cases with a window, a soft cap and lse. */
static void mla_case(int i, bool prefill)
{
    static const int64_t Hqs[4] = {1, 16, 128, 5};
    const int64_t D = i % 4 == 3 ? 64 : 576, dv = D == 576 ? 512 : 48, Hq = Hqs[i % 4];
    const kv_dtype dt = (i & 4) ? KV_FP8_E4M3 : KV_BF16;
    uint64_t rng = 7700 + (uint64_t)i;
    struct kv_layout_config cfg = KV_LAYOUT_CONFIG_INIT;
    cfg.num_layers = 2;
    cfg.num_blocks = 200;
    cfg.block_tokens = 64;
    cfg.num_heads = 1;
    cfg.head_dim = D;
    cfg.dtype = dt;
    cfg.k_only = true;
    cfg.arrange = (i & 1) ? KV_ARRANGE_BLOCK_MAJOR : KV_ARRANGE_LAYER_MAJOR;
    cfg.block_pad_elems = 64;
    struct pools p;
    pools_init(&p, &cfg, rng);
    const int64_t es = (int64_t)p.host.layout.elem_bytes;
    for (int64_t e = 0; e < (int64_t)p.bytes / es; e++)
        kv_from_f32(dt, (float)range(&rng, -1000, 1000) / 1000.0f, p.h + e * es);
    CHECK(cudaMemcpy(p.dev.base, p.h, p.bytes, cudaMemcpyHostToDevice) == cudaSuccess);
    const int64_t lens[3] = {1, 300, 1000};
    int32_t indices[32], indptr[4], last[3], k = 0;
    uint8_t used[200] = {0};
    for (int s = 0; s < 3; s++) {
        const int64_t np = (lens[s] + 63) / 64;
        indptr[s] = k;
        for (int64_t j = 0; j < np; j++) {
            int64_t pg;
            do
                pg = range(&rng, 100, 199);
            while (used[pg]);
            used[pg] = 1;
            indices[k++] = (int32_t)pg;
        }
        last[s] = (int32_t)(lens[s] - (np - 1) * 64);
    }
    indptr[3] = k;
    const struct kv_pages pg = {.format = KV_PAGES_CSR,
                                .n_seqs = 3,
                                .page_ratio = 1,
                                .indptr = indptr,
                                .indices = indices,
                                .last_page_len = last};
    const int32_t qo[4] = {0, 1, 8, 41};
    const int64_t T = prefill ? qo[3] : 3;
    const size_t qb = (size_t)(T * Hq * D) * sizeof(float),
                 ob = (size_t)(T * Hq * dv) * sizeof(float), lb = (size_t)(T * Hq) * sizeof(float);
    float *hq = malloc(qb), *hc = malloc(ob), *hg = malloc(ob), *lc = malloc(lb), *lg = malloc(lb);
    void *dq, *dout, *dlse;
    CHECK(hq && hc && hg && lc && lg);
    for (int64_t e = 0; e < T * Hq * D; e++)
        hq[e] = (float)range(&rng, -1000, 1000) / 1000.0f;
    CHECK(cudaMalloc(&dq, qb) == cudaSuccess && cudaMalloc(&dout, ob) == cudaSuccess &&
          cudaMalloc(&dlse, lb) == cudaSuccess);
    CHECK(cudaMemcpy(dq, hq, qb, cudaMemcpyHostToDevice) == cudaSuccess);
    int64_t qs[3] = {T, Hq, D}, os[3] = {T, Hq, dv};
    struct kv_view vq, vc, dvq, dvo;
    CHECK(kv_view_init(hq, qb, KV_F32, 3, qs, &vq) == KV_OK);
    CHECK(kv_view_init(hc, ob, KV_F32, 3, os, &vc) == KV_OK);
    CHECK(kv_view_init(dq, qb, KV_F32, 3, qs, &dvq) == KV_OK);
    CHECK(kv_view_init(dout, ob, KV_F32, 3, os, &dvo) == KV_OK);
    const float scale = 1.0f / sqrtf((float)D), ks[1] = {0.5f};
    const struct kv_scales sc = {ks, NULL, 1, 0};
    const struct kv_scales *scp = dt == KV_FP8_E4M3 ? &sc : NULL;
    struct kv_attn_opts oc = KV_ATTN_OPTS_INIT, og = KV_ATTN_OPTS_INIT;
    if (i & 1) { /* a window, a soft cap, lse */
        oc.window_left = og.window_left = 20;
        oc.logit_soft_cap = og.logit_soft_cap = 8.0f;
        oc.lse = lc;
        og.lse = dlse;
    }
    if (prefill) {
        CHECK(kv_attn_prefill_mla(p.host, 1, &vq, qo, &pg, dv, scale, scp, &vc, &oc) == KV_OK);
        CHECK(kv_attn_prefill_mla_cuda(p.dev, 1, &dvq, qo, &pg, dv, scale, scp, &dvo, &og,
                                       NULL) == KV_OK);
    } else {
        CHECK(kv_attn_decode_mla(p.host, 1, &vq, &pg, dv, scale, scp, &vc) == KV_OK);
        CHECK(kv_attn_decode_mla_cuda(p.dev, 1, &dvq, &pg, dv, scale, scp, &dvo, NULL) == KV_OK);
    }
    CHECK(cudaDeviceSynchronize() == cudaSuccess);
    CHECK(cudaMemcpy(hg, dout, ob, cudaMemcpyDeviceToHost) == cudaSuccess);
    if (prefill && (i & 1)) {
        CHECK(cudaMemcpy(lg, dlse, lb, cudaMemcpyDeviceToHost) == cudaSuccess);
        for (int64_t e = 0; e < T * Hq; e++)
            if (!(fabs((double)lg[e] - lc[e]) <= 1e-4 * (1.0 + fabs((double)lc[e])))) {
                fprintf(stderr, "FAIL mla prefill case %d lse %lld: %.9g vs CPU %.9g\n", i,
                        (long long)e, (double)lg[e], (double)lc[e]);
                exit(1);
            }
    }
    for (int64_t e = 0; e < T * Hq * dv; e++) {
        const double c = hc[e], g = hg[e], tol = 2e-4 * (fabs(c) > 1e-2 ? fabs(c) : 1e-2);
        if (!(fabs(g - c) <= tol)) {
            fprintf(stderr,
                    "FAIL mla %s case %d (D %lld Hq %lld %s) element %lld: %.9g vs CPU %.9g\n",
                    prefill ? "prefill" : "decode", i, (long long)D, (long long)Hq,
                    kv_dtype_name(dt), (long long)e, g, c);
            exit(1);
        }
    }
    free(hq);
    free(hc);
    free(hg);
    free(lc);
    free(lg);
    cudaFree(dq);
    cudaFree(dout);
    cudaFree(dlse);
    pools_free(&p);
}

/* Multi-token attention on the device (kv_attn_prefill_cuda), and decode
 * with options (kv_attn_decode_ex_cuda: a window, a soft cap, lse), against
 * the CPU kernel on the same pool and q (itself checked against float64 in
 * tests/unit/test_attn_opts.c; the CUDA body against float64 on the grid
 * emulator in tests/unit/test_grid_prefill.c): every layout kind and dtype
 * (fp8 with per-head scales), D 64 / 80 / 128 / 256, g 1 to 5, q_len 0, 1,
 * a chunk and a whole sequence, pages far from 0. out and lse have a padded
 * row pitch and a row before and after the call's rows, all set to a
 * sentinel on both sides: every element must match within 2e-4 (the
 * sentinels exactly). */
static void prefill_case(int i)
{
    static const int64_t Ds[4] = {64, 80, 128, 256};
    static const int32_t wins[4] = {-1, 0, 37, 700};
    uint64_t rng = 9900 + (uint64_t)i;
    const int lay = i % 16;
    const bool decode = i % 10 == 3 || i % 10 == 6; /* fp8 e4m3 and f16 */
    struct kv_layout_config cfg = KV_LAYOUT_CONFIG_INIT;
    cfg.num_layers = 2;
    cfg.order = (lay & 1) ? KV_ORDER_HND : KV_ORDER_NHD;
    cfg.arrange = (lay & 2) ? KV_ARRANGE_BLOCK_MAJOR : KV_ARRANGE_LAYER_MAJOR;
    cfg.block_pad_elems = (lay & 4) ? 8 : 0;
    cfg.kv_packed = (lay & 8) != 0;
    cfg.block_tokens = i % 3 ? 16 : 8;
    cfg.head_dim = Ds[i % 4];
    cfg.num_heads = i % 2 ? 2 : 4;
    cfg.dtype = dtypes[i % 5];
    const int64_t g = 1 + (i / 5) % 5, H = cfg.num_heads, Hq = H * g, D = cfg.head_dim;
    const uint32_t r = i % 7 == 3 ? 2 : 1, S = 4;
    const int64_t pt = cfg.block_tokens / r;
    int64_t lens[4] = {1, 1 + range(&rng, 0, 1500), 257, 40}, ql[4];
    ql[0] = 1, ql[1] = range(&rng, 1, lens[1]), ql[2] = lens[2], ql[3] = i % 2 ? 0 : 17;
    if (decode)
        ql[0] = ql[1] = ql[2] = ql[3] = 1;
    int64_t pages_total = 0;
    for (uint32_t s = 0; s < S; s++)
        pages_total += (lens[s] + pt - 1) / pt;
    cfg.num_blocks = 2 * (pages_total / r + 2) + 4;
    struct pools p;
    pools_init(&p, &cfg, rng);
    const int64_t es = (int64_t)p.host.layout.elem_bytes;
    for (int64_t e = 0; e < (int64_t)p.bytes / es; e++)
        kv_from_f32(cfg.dtype, (float)range(&rng, -1000, 1000) / 1000.0f, p.h + e * es);
    CHECK(cudaMemcpy(p.dev.base, p.h, p.bytes, cudaMemcpyHostToDevice) == cudaSuccess);
    const int64_t P = cfg.num_blocks * r;
    int32_t *indices = malloc((size_t)pages_total * sizeof(int32_t)), indptr[5], last[4], qo[5];
    uint8_t *used = calloc((size_t)P, 1);
    CHECK(indices && used);
    int32_t k = 0;
    qo[0] = 0;
    for (uint32_t s = 0; s < S; s++) {
        const int64_t np = (lens[s] + pt - 1) / pt;
        indptr[s] = k;
        for (int64_t j = 0; j < np; j++) {
            int64_t pgi;
            do
                pgi = range(&rng, P / 2, P - 1);
            while (used[pgi]);
            used[pgi] = 1;
            indices[k++] = (int32_t)pgi;
        }
        last[s] = (int32_t)(lens[s] - (np - 1) * pt);
        qo[s + 1] = qo[s] + (int32_t)ql[s];
    }
    indptr[S] = k;
    struct kv_pages pg = {.format = KV_PAGES_CSR,
                          .n_seqs = S,
                          .page_ratio = r,
                          .indptr = indptr,
                          .indices = indices,
                          .last_page_len = last};
    /* q f32 [T][Hq][D]; out f32 rows 1..T of [T + 2][Hq][D + 4]; lse [T + 2][Hq + 3] */
    const int64_t T = qo[S], orow = D + 4, lrow = Hq + 3;
    const size_t qb = (size_t)(T * Hq * D) * sizeof(float),
                 ob = (size_t)((T + 2) * Hq * orow) * sizeof(float),
                 lb = (size_t)((T + 2) * lrow) * sizeof(float);
    float *hq = malloc(qb), *hc = malloc(ob), *hg = malloc(ob), *lc = malloc(lb), *lg = malloc(lb);
    void *dq, *dout, *dlse;
    CHECK(hq && hc && hg && lc && lg);
    for (int64_t e = 0; e < T * Hq * D; e++)
        hq[e] = (float)range(&rng, -2000, 2000) / 1000.0f;
    for (size_t e = 0; e < ob / 4; e++)
        hc[e] = 7.25f;
    for (size_t e = 0; e < lb / 4; e++)
        lc[e] = -3.5f;
    CHECK(cudaMalloc(&dq, qb) == cudaSuccess && cudaMalloc(&dout, ob) == cudaSuccess &&
          cudaMalloc(&dlse, lb) == cudaSuccess);
    CHECK(cudaMemcpy(dq, hq, qb, cudaMemcpyHostToDevice) == cudaSuccess);
    CHECK(cudaMemcpy(dout, hc, ob, cudaMemcpyHostToDevice) == cudaSuccess);
    CHECK(cudaMemcpy(dlse, lc, lb, cudaMemcpyHostToDevice) == cudaSuccess);
    int64_t qs[3] = {T, Hq, D}, os[3] = {T, Hq, D}, ost[3] = {Hq * orow, orow, 1};
    int64_t n_o = (T + 2) * Hq * orow;
    struct kv_view vq, vc, dvq, dvo, flat;
    CHECK(kv_view_init(hq, qb, KV_F32, 3, qs, &vq) == KV_OK);
    CHECK(kv_view_init(dq, qb, KV_F32, 3, qs, &dvq) == KV_OK);
    CHECK(kv_view_init(hc, ob, KV_F32, 1, &n_o, &flat) == KV_OK);
    CHECK(kv_view_as_strided(&flat, 3, os, ost, Hq * orow, &vc) == KV_OK);
    CHECK(kv_view_init(dout, ob, KV_F32, 1, &n_o, &flat) == KV_OK);
    CHECK(kv_view_as_strided(&flat, 3, os, ost, Hq * orow, &dvo) == KV_OK);
    float ks[4], vs[4];
    for (int h = 0; h < 4; h++)
        ks[h] = 0.5f + 0.25f * (float)h, vs[h] = 1.5f - 0.125f * (float)h;
    const struct kv_scales sc = {ks, vs, (uint32_t)H, 0};
    const struct kv_scales *scp = es == 1 ? &sc : NULL;
    struct kv_attn_opts oc = KV_ATTN_OPTS_INIT, og;
    oc.window_left = wins[(i / 2) % 4];
    oc.logit_soft_cap = i % 3 == 1 ? 2.5f : 0.0f;
    if (i % 4 != 2) {
        oc.lse = lc + lrow;
        oc.lse_stride = lrow;
    }
    og = oc;
    if (oc.lse)
        og.lse = (float *)dlse + lrow;
    const float scale = 1.0f / sqrtf((float)D);
    if (decode) {
        CHECK(kv_attn_decode_ex(p.host, 1, &vq, &pg, scale, scp, &vc, &oc) == KV_OK);
        CHECK(kv_attn_decode_ex_cuda(p.dev, 1, &dvq, &pg, scale, scp, &dvo, &og, NULL) == KV_OK);
    } else {
        CHECK(kv_attn_prefill(p.host, 1, &vq, qo, &pg, scale, scp, &vc, &oc) == KV_OK);
        CHECK(kv_attn_prefill_cuda(p.dev, 1, &dvq, qo, &pg, scale, scp, &dvo, &og, NULL) == KV_OK);
    }
    CHECK(cudaDeviceSynchronize() == cudaSuccess);
    CHECK(cudaMemcpy(hg, dout, ob, cudaMemcpyDeviceToHost) == cudaSuccess);
    CHECK(cudaMemcpy(lg, dlse, lb, cudaMemcpyDeviceToHost) == cudaSuccess);
    for (int side = 0; side < 2; side++) {
        const float *c = side ? lc : hc, *gv = side ? lg : hg;
        const size_t n = (side ? lb : ob) / 4;
        for (size_t e = 0; e < n; e++) {
            const double cv = c[e], gd = gv[e], tol = 2e-4 * (fabs(cv) > 1e-2 ? fabs(cv) : 1e-2);
            if (!(cv == gd || fabs(gd - cv) <= tol)) {
                fprintf(stderr,
                        "FAIL prefill case %d (%s D %lld H %lld g %lld %s, window %d cap %g) %s "
                        "element %zu: %.9g vs CPU %.9g\n",
                        i, decode ? "decode_ex" : "prefill", (long long)D, (long long)H,
                        (long long)g, kv_dtype_name(cfg.dtype), oc.window_left,
                        (double)oc.logit_soft_cap, side ? "lse" : "out", e, gd, cv);
                exit(1);
            }
        }
    }
    pools_same(&p, "prefill: the pool");
    free(hq), free(hc), free(hg), free(lc), free(lg), free(indices), free(used);
    cudaFree(dq), cudaFree(dout), cudaFree(dlse);
    pools_free(&p);
}

/* Bad input is refused by the shared validator before any launch. */
static void refusals(void)
{
    struct kv_layout_config cfg = KV_LAYOUT_CONFIG_INIT;
    cfg.num_layers = 2, cfg.num_blocks = 64, cfg.block_tokens = 8, cfg.num_heads = 2;
    cfg.head_dim = 16, cfg.dtype = KV_BF16;
    struct pools p;
    pools_init(&p, &cfg, 11);
    struct tens src;
    tens_init(&src, 0, KV_BF16, 0, 4, 2, 16, 3);
    int64_t bad[4] = {8, 9, 64 * 8, 1}, dup[4] = {8, 9, 10, 9};
    CHECK(kv_attn_write_cuda(p.dev, 0, &src.dk, &src.dv, bad, 4, NULL, NULL) ==
          KV_ERR_OUT_OF_BOUNDS);
    CHECK(kv_attn_write_cuda(p.dev, 0, &src.dk, &src.dv, dup, 4, NULL, NULL) == KV_ERR_OVERLAP);
    struct kv_block_copy cp[2] = {{3, 5, 0}, {5, 7, 0}};
    CHECK(kv_attn_copy_blocks_cuda(p.dev, cp, 2, NULL) == KV_ERR_OVERLAP);
    pools_same(&p, "refusals");
    tens_free(&src);
    pools_free(&p);
}

/* ---- the scale and conversion rules ------------------------------------------------- */

enum { SR_T = 6, SR_H = 2, SR_D = 8, SR_E = SR_T * SR_H * SR_D };

/* A [SR_T][SR_H][SR_D] view of dt over buf (2 * SR_E elements): contiguous,
 * or with a head dim of stride 2. */
static struct kv_view sr_view(void *buf, kv_dtype dt, bool strided)
{
    struct kv_view flat, v;
    int64_t n = 2 * SR_E;
    const int64_t s = strided ? 2 : 1;
    int64_t sh[3] = {SR_T, SR_H, SR_D}, st[3] = {SR_H * SR_D * s, SR_D * s, s};
    CHECK(kv_view_init(buf, (size_t)n * kv_dtype_size(dt), dt, 1, &n, &flat) == KV_OK);
    CHECK(kv_view_as_strided(&flat, 3, sh, st, 0, &v) == KV_OK);
    return v;
}

/* The same values in a host buffer and a device buffer. */
struct sr_buf {
    unsigned char h[2 * SR_E * 4];
    void *d;
};

static void sr_upload(struct sr_buf *b)
{
    CHECK(cudaMalloc(&b->d, sizeof(b->h)) == cudaSuccess);
    CHECK(cudaMemcpy(b->d, b->h, sizeof(b->h), cudaMemcpyHostToDevice) == cudaSuccess);
}

/* CPU against CUDA on inputs that tell the variants apart (the CPU side is
 * checked against exact expectations in tests/unit/test_attn.c): x / scale
 * with scales whose reciprocal is inexact; with scale 1.0, e5m2 inf and NaNs
 * and out-of-range f32 still converted; without scales, a tensor of the
 * cache's dtype moved as bytes next to one converted. Writes, then reads. */
static void scale_rules(void)
{
    static const int64_t slots[SR_T] = {20, 21, 22, 23, 8, 9};
    static const int32_t indptr[2] = {0, 2}, indices[2] = {5, 2}, last[1] = {2};
    static const uint8_t codes[8] = {0x7C, 0xFC, 0x7D, 0x7E, 0xFD, 0x7B, 0x83, 0x80};
    static const float ks[SR_H] = {3.0f, 0.3f}, vs[SR_H] = {7.0f, 1.1f}, one[1] = {1.0f};
    const struct kv_scales sc = {ks, vs, SR_H, 0}, sc1 = {one, one, 1, 0};
    struct kv_pages pg;
    memset(&pg, 0, sizeof(pg));
    pg.format = KV_PAGES_CSR, pg.n_seqs = 1, pg.page_ratio = 1;
    pg.indptr = indptr, pg.indices = indices, pg.last_page_len = last;
    static struct sr_buf f32, e5m2, out[2];
    uint64_t rng = 3;
    for (int64_t i = 0; i < 2 * SR_E; i++) {
        const float x = i % 8 == 0   ? INFINITY
                        : i % 8 == 1 ? -1e6f
                                     : (float)range(&rng, -(1 << 24), 1 << 24) / 4096.0f;
        memcpy(f32.h + i * 4, &x, 4);
        e5m2.h[i] = codes[i % 8];
    }
    sr_upload(&f32);
    sr_upload(&e5m2);
    sr_upload(&out[0]);
    sr_upload(&out[1]);
    const struct {
        kv_dtype cache, kdt, vdt;
        const struct kv_scales *sc;
        const char *what;
    } cases[4] = {
        {KV_F32, KV_F32, KV_F32, &sc, "f32, x / scale"},
        {KV_FP8_E5M2, KV_FP8_E5M2, KV_F32, &sc1, "e5m2 and f32 into e5m2, scale 1.0"},
        {KV_FP8_E5M2, KV_FP8_E5M2, KV_FP8_E5M2, NULL, "e5m2 into e5m2, no scales"},
        {KV_FP8_E5M2, KV_F32, KV_FP8_E5M2, NULL, "f32 and e5m2 into e5m2, no scales"},
    };
    for (int strided = 0; strided < 2; strided++)
        for (int c = 0; c < 4; c++) {
            char what[128];
            snprintf(what, sizeof(what), "scale rules: %s%s", cases[c].what,
                     strided ? " (strided)" : "");
            struct kv_layout_config cfg = KV_LAYOUT_CONFIG_INIT;
            cfg.num_layers = 1, cfg.num_blocks = 8, cfg.block_tokens = 4, cfg.num_heads = SR_H;
            cfg.head_dim = SR_D, cfg.dtype = cases[c].cache;
            struct pools p;
            pools_init(&p, &cfg, 21 + (uint64_t)c);
            struct sr_buf *kb = cases[c].kdt == KV_F32 ? &f32 : &e5m2,
                          *vb = cases[c].vdt == KV_F32 ? &f32 : &e5m2;
            struct kv_view hk = sr_view(kb->h, cases[c].kdt, strided),
                           hv = sr_view(vb->h, cases[c].vdt, strided),
                           dk = sr_view(kb->d, cases[c].kdt, strided),
                           dv = sr_view(vb->d, cases[c].vdt, strided);
            CHECK(kv_attn_write(p.host, 0, &hk, &hv, slots, SR_T, cases[c].sc) == KV_OK);
            CHECK(kv_attn_write_cuda(p.dev, 0, &dk, &dv, slots, SR_T, cases[c].sc, NULL) == KV_OK);
            pools_same(&p, what);
            for (int kv = 0; kv < 2; kv++) {
                memset(out[kv].h, 0x11, sizeof(out[kv].h));
                CHECK(cudaMemcpy(out[kv].d, out[kv].h, sizeof(out[kv].h), cudaMemcpyHostToDevice) ==
                      cudaSuccess);
            }
            hk = sr_view(out[0].h, cases[c].kdt, strided);
            hv = sr_view(out[1].h, cases[c].vdt, strided);
            dk = sr_view(out[0].d, cases[c].kdt, strided);
            dv = sr_view(out[1].d, cases[c].vdt, strided);
            CHECK(kv_attn_read(p.host, 0, &pg, &hk, &hv, cases[c].sc) == KV_OK);
            CHECK(kv_attn_read_cuda(p.dev, 0, &pg, &dk, &dv, cases[c].sc, NULL) == KV_OK);
            for (int kv = 0; kv < 2; kv++) {
                static unsigned char back[2 * SR_E * 4];
                CHECK(cudaDeviceSynchronize() == cudaSuccess);
                CHECK(cudaMemcpy(back, out[kv].d, sizeof(back), cudaMemcpyDeviceToHost) ==
                      cudaSuccess);
                for (size_t i = 0; i < sizeof(back); i++)
                    if (back[i] != out[kv].h[i]) {
                        fprintf(stderr, "FAIL %s: read %c byte %zu is 0x%02x, the CPU's 0x%02x\n",
                                what, kv ? 'V' : 'K', i, back[i], out[kv].h[i]);
                        exit(1);
                    }
            }
            pools_free(&p);
        }
    for (int b = 0; b < 2; b++)
        cudaFree(out[b].d);
    cudaFree(f32.d);
    cudaFree(e5m2.d);
}

/* ---- benchmarks ------------------------------------------------------------------------ */

static int cmp_f(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

typedef kv_status (*bench_fn)(void *ctx);

/* Median ms of 9 runs of fn and of a d2d cudaMemcpy of `bytes`, interleaved. */
static void time_pair(bench_fn fn, void *ctx, void *a, void *b, size_t bytes, float *t_fn,
                      float *t_mc)
{
    cudaEvent_t e0, e1;
    float tk[9], tm[9];
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    for (int r = -1; r < 9; r++) {
        cudaEventRecord(e0, 0);
        CHECK(fn(ctx) == KV_OK);
        cudaEventRecord(e1, 0);
        cudaEventSynchronize(e1);
        if (r >= 0)
            cudaEventElapsedTime(&tk[r], e0, e1);
        cudaEventRecord(e0, 0);
        CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, 0) == cudaSuccess);
        cudaEventRecord(e1, 0);
        cudaEventSynchronize(e1);
        if (r >= 0)
            cudaEventElapsedTime(&tm[r], e0, e1);
    }
    qsort(tk, 9, sizeof(float), cmp_f);
    qsort(tm, 9, sizeof(float), cmp_f);
    *t_fn = tk[4];
    *t_mc = tm[4];
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
}

struct bctx {
    struct kv_paged_cache c;
    struct kv_view k, v, q, out;
    int64_t *slots, n_slots;
    struct kv_pages pages;
    /* the device-index entries: the same slots and pages in device memory */
    int64_t *dslots;
    struct kv_attn_dev_pages dpages;
    struct kv_attn_cuda_errors *err;
    /* split-KV's workspace for b_decode_dev_ws, and the longest sequence */
    void *ws;
    size_t ws_bytes;
    int64_t max_tokens;
};

static kv_status b_write_dev(void *x)
{
    struct bctx *b = x;
    return kv_attn_write_cuda_dev(b->c, 0, &b->k, &b->v, b->dslots, b->n_slots, NULL, b->err, NULL);
}

static kv_status b_decode_dev(void *x)
{
    struct bctx *b = x;
    return kv_attn_decode_cuda_dev(b->c, 0, &b->q, &b->dpages, 0.088f, NULL, &b->out, b->err, NULL);
}

static kv_status b_decode_dev_ws(void *x)
{
    struct bctx *b = x;
    return kv__attn_decode_ex_cuda_dev_ws(b->c, 0, &b->q, &b->dpages, 0.088f, NULL, &b->out, NULL,
                                          b->ws, b->ws_bytes, b->max_tokens, b->err, NULL);
}

/* A device-index benchmark's result: nothing recorded as invalid. */
static void check_no_device_errors(struct bctx *b, const char *what)
{
    struct kv_attn_cuda_error_info info;
    CHECK(kv_attn_cuda_errors_get(b->err, &info, NULL) == KV_OK);
    if (info.count != 0)
        fprintf(stderr, "%s: %llu invalid indices recorded (first: array %d index %lld)\n", what,
                (unsigned long long)info.count, (int)info.array, (long long)info.index);
    CHECK(info.count == 0);
}

static void print_bench(const char *name, const char *on, const char *shape, size_t bytes, float tk,
                        float tm)
{
    printf("{\"bench\":\"%s\",\"case\":\"%s/bf16/N16/H8/D128/%s\",\"bytes\":%zu,"
           "\"gbps\":%.2f,\"baseline\":\"cudaMemcpy_d2d\",\"baseline_gbps\":%.2f,"
           "\"ratio\":%.3f,\"runs\":9}\n",
           name, on, shape, bytes, bytes / (tk * 1e6), bytes / (tm * 1e6), tm / tk);
}

static kv_status b_write(void *x)
{
    struct bctx *b = x;
    return kv_attn_write_cuda(b->c, 0, &b->k, &b->v, b->slots, b->n_slots, NULL, NULL);
}

static kv_status b_read(void *x)
{
    struct bctx *b = x;
    return kv_attn_read_cuda(b->c, 0, &b->pages, &b->k, &b->v, NULL, NULL);
}

static kv_status b_decode(void *x)
{
    struct bctx *b = x;
    return kv_attn_decode_cuda(b->c, 0, &b->q, &b->pages, 0.088f, NULL, &b->out, NULL);
}

static void bench_decode_fn(struct bctx *b, bench_fn fn, void *big, size_t kv_bytes,
                            const char *name, const char *on, const char *shape, int64_t tokens,
                            int body);

/* One decode bench line: body `body` (kv__cdec_body) over b's pages, q
 * and out, against a D2D cudaMemcpy of the kv_bytes it reads (K and V
 * once), timed interleaved in the same run. */
static void bench_decode(struct bctx *b, void *big, size_t kv_bytes, const char *name,
                         const char *on, const char *shape, int64_t tokens, int body)
{
    bench_decode_fn(b, b_decode, big, kv_bytes, name, on, shape, tokens, body);
}

/* bench_decode with the call fn (b_decode_dev_ws: the device-index mode
 * with a workspace). */
static void bench_decode_fn(struct bctx *b, bench_fn fn, void *big, size_t kv_bytes,
                            const char *name, const char *on, const char *shape, int64_t tokens,
                            int body)
{
    float tk, tm;
    kv__cdec_body = body;
    time_pair(fn, b, b->c.base, big, kv_bytes, &tk, &tm);
    kv__cdec_body = B_AUTO;
    printf("{\"bench\":\"%s\",\"case\":\"%s/bf16/N16/Hq32/H8/D128/%s\",\"body\":\"%s\","
           "\"bytes\":%zu,\"tokens_per_s\":%.3g,\"gbps\":%.1f,\"baseline\":"
           "\"cudaMemcpy_d2d_of_kv\",\"baseline_gbps\":%.1f,\"ratio\":%.3f,\"runs\":9}\n",
           name, on, shape, body_names[body], kv_bytes, (double)tokens / (tk * 1e-3),
           kv_bytes / (tk * 1e6), kv_bytes / (tm * 1e6), tm / tk);
}

static void bench(kv_order order)
{
    /* bf16, N 16, H 8, D 128, one layer of 32768 blocks (2 GiB of K and V) */
    const int64_t N = 16, H = 8, D = 128, B = 32768;
    struct kv_layout_config cfg = KV_LAYOUT_CONFIG_INIT;
    cfg.num_layers = 1, cfg.num_blocks = B, cfg.block_tokens = N, cfg.num_heads = H;
    cfg.head_dim = D, cfg.dtype = KV_BF16, cfg.order = order;
    struct bctx b;
    memset(&b, 0, sizeof(b));
    CHECK(kv_layout_init(&cfg, &b.c.layout) == KV_OK);
    b.c.storage_bytes = (size_t)b.c.layout.total_bytes;
    b.c.mem = KV_MEM_DEVICE;
    CHECK(cudaMalloc(&b.c.base, b.c.storage_bytes) == cudaSuccess);
    CHECK(cudaMemset(b.c.base, 0, b.c.storage_bytes) == cudaSuccess);
    const int64_t T = 256 * 512; /* the read case; prefill writes the same tokens */
    const size_t tb = (size_t)T * H * D * 2;
    void *kd, *vd, *scratch;
    CHECK(cudaMalloc(&kd, tb) == cudaSuccess && cudaMalloc(&vd, tb) == cudaSuccess);
    CHECK(cudaMalloc(&scratch, 2 * tb) == cudaSuccess);
    int64_t sh[3] = {T, H, D};
    CHECK(kv_view_init(kd, tb, KV_BF16, 3, sh, &b.k) == KV_OK);
    CHECK(kv_view_init(vd, tb, KV_BF16, 3, sh, &b.v) == KV_OK);
    /* 256 sequences of 512 tokens on scattered whole blocks */
    const int64_t per = 512 / N, S = 256;
    int32_t *perm = malloc((size_t)B * sizeof(int32_t)), *indptr = malloc((S + 1) * 4);
    int32_t *last = malloc(S * 4);
    b.slots = malloc((size_t)T * sizeof(int64_t));
    CHECK(perm && indptr && last && b.slots);
    uint64_t rng = 1;
    for (int64_t i = 0; i < B; i++)
        perm[i] = (int32_t)i;
    for (int64_t i = B - 1; i > 0; i--) {
        const int64_t j = range(&rng, 0, i);
        const int32_t t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    for (int64_t s = 0; s < S; s++) {
        indptr[s] = (int32_t)(s * per);
        last[s] = (int32_t)N;
        for (int64_t t = 0; t < 512; t++)
            b.slots[s * 512 + t] = (int64_t)perm[s * per + t / N] * N + t % N;
    }
    indptr[S] = (int32_t)(S * per);
    b.n_slots = T;
    b.pages = (struct kv_pages){.format = KV_PAGES_CSR,
                                .n_seqs = (uint32_t)S,
                                .page_ratio = 1,
                                .indptr = indptr,
                                .indices = perm,
                                .last_page_len = last};
    const char *on = order == KV_ORDER_NHD ? "nhd" : "hnd";
    float tk, tm;
    /* the baseline moves the same 2 x tb bytes (K and V), from the 2 GiB pool
     * (kd alone holds only tb) */
    time_pair(b_write, &b, b.c.base, scratch, 2 * tb, &tk, &tm);
    printf("{\"bench\":\"gpu.kernel.write_prefill\",\"case\":\"%s/bf16/N16/H8/D128/T%lld\","
           "\"bytes\":%zu,\"gbps\":%.1f,\"baseline\":\"cudaMemcpy_d2d\",\"baseline_gbps\":%.1f,"
           "\"ratio\":%.3f,\"runs\":9}\n",
           on, (long long)T, 2 * tb, 2 * tb / (tk * 1e6), 2 * tb / (tm * 1e6), tm / tk);
    /* the same write with the slots in device memory: no host work per call */
    CHECK(kv_attn_cuda_errors_create(&b.err) == KV_OK);
    CHECK(cudaMalloc((void **)&b.dslots, (size_t)T * sizeof(int64_t)) == cudaSuccess);
    CHECK(cudaMemcpy(b.dslots, b.slots, (size_t)T * sizeof(int64_t), cudaMemcpyHostToDevice) ==
          cudaSuccess);
    time_pair(b_write_dev, &b, b.c.base, scratch, 2 * tb, &tk, &tm);
    check_no_device_errors(&b, "write_prefill_dev");
    print_bench("gpu.kernel.write_prefill_dev", on, "T131072", 2 * tb, tk, tm);
    time_pair(b_read, &b, b.c.base, scratch, 2 * tb, &tk, &tm);
    printf("{\"bench\":\"gpu.kernel.read\",\"case\":\"%s/bf16/N16/H8/D128/256x512\","
           "\"bytes\":%zu,\"gbps\":%.1f,\"baseline\":\"cudaMemcpy_d2d\",\"baseline_gbps\":%.1f,"
           "\"ratio\":%.3f,\"runs\":9}\n",
           on, 2 * tb, 2 * tb / (tk * 1e6), 2 * tb / (tm * 1e6), tm / tk);
    /* decode: one token for each of 4096 sequences, scattered */
    const int64_t Td = 4096;
    for (int64_t s = 0; s < Td; s++)
        b.slots[s] = (int64_t)perm[(s * 7) % B] * N + s % N;
    int64_t shd[3] = {Td, H, D};
    CHECK(kv_view_init(kd, tb, KV_BF16, 3, shd, &b.k) == KV_OK);
    CHECK(kv_view_init(vd, tb, KV_BF16, 3, shd, &b.v) == KV_OK);
    b.n_slots = Td;
    const size_t db = (size_t)Td * H * D * 2 * 2;
    time_pair(b_write, &b, b.c.base, scratch, db, &tk, &tm);
    printf("{\"bench\":\"gpu.kernel.write_decode\",\"case\":\"%s/bf16/N16/H8/D128/4096x1\","
           "\"bytes\":%zu,\"gbps\":%.2f,\"baseline\":\"cudaMemcpy_d2d\",\"baseline_gbps\":%.2f,"
           "\"ratio\":%.3f,\"runs\":9}\n",
           on, db, db / (tk * 1e6), db / (tm * 1e6), tm / tk);
    CHECK(cudaMemcpy(b.dslots, b.slots, (size_t)Td * sizeof(int64_t), cudaMemcpyHostToDevice) ==
          cudaSuccess);
    time_pair(b_write_dev, &b, b.c.base, scratch, db, &tk, &tm);
    check_no_device_errors(&b, "write_decode_dev");
    print_bench("gpu.kernel.write_decode_dev", on, "4096x1", db, tk, tm);
    /* decode attention: Hq 32, 256 sequences x 2048 tokens (every block once) */
    const int64_t Sd = 256, Ld = 2048, pd = Ld / N;
    for (int64_t s = 0; s <= Sd; s++)
        indptr[s] = (int32_t)(s * pd);
    b.pages.n_seqs = (uint32_t)Sd;
    void *qd, *od;
    const size_t qb = (size_t)Sd * 32 * D * 2;
    CHECK(cudaMalloc(&qd, qb) == cudaSuccess && cudaMalloc(&od, qb) == cudaSuccess);
    CHECK(cudaMemset(qd, 0, qb) == cudaSuccess);
    int64_t shq[3] = {Sd, 32, D};
    CHECK(kv_view_init(qd, qb, KV_BF16, 3, shq, &b.q) == KV_OK);
    CHECK(kv_view_init(od, qb, KV_BF16, 3, shq, &b.out) == KV_OK);
    const size_t kvb = (size_t)Sd * Ld * H * D * 2 * 2; /* K and V read once */
    void *big;
    CHECK(cudaMalloc(&big, kvb) == cudaSuccess);
    /* every body on the same decode, each against the same D2D memcpy of
     * the K/V bytes timed in the same run: auto (today: the vector body),
     * the general body (the vector body's baseline: one warp per token,
     * lanes over the head dim, shared-memory sums), the pipelined vector
     * body and split-KV (its plan: 2 x SMs blocks, chunks of <= 2048
     * tokens; here 1 chunk a sequence) */
    bench_decode(&b, big, kvb, "gpu.kernel.decode_attn", on, "256x2048", Sd * Ld, B_AUTO);
    bench_decode(&b, big, kvb, "gpu.kernel.decode_attn_general", on, "256x2048", Sd * Ld,
                 B_GENERAL);
    bench_decode(&b, big, kvb, "gpu.kernel.decode_attn_pipe", on, "256x2048", Sd * Ld, B_PIPE);
    bench_decode(&b, big, kvb, "gpu.kernel.decode_attn_split", on, "256x2048", Sd * Ld, B_SPLIT);
    /* a small batch of long sequences: 8 x 16384 tokens on the same pool
     * (8 x 8 x 8 = 512 vector blocks: under 4 a SM on an H200; split-KV's
     * plan: 8 chunks of 2048 tokens) */
    {
        const int64_t Sl = 8, Ll = 16384, pl = Ll / N;
        for (int64_t s = 0; s <= Sl; s++)
            indptr[s] = (int32_t)(s * pl);
        b.pages.n_seqs = (uint32_t)Sl;
        int64_t shl[3] = {Sl, 32, D};
        const size_t qbl = (size_t)Sl * 32 * D * 2;
        CHECK(kv_view_init(qd, qbl, KV_BF16, 3, shl, &b.q) == KV_OK);
        CHECK(kv_view_init(od, qbl, KV_BF16, 3, shl, &b.out) == KV_OK);
        const size_t kvl = (size_t)Sl * Ll * H * D * 2 * 2;
        bench_decode(&b, big, kvl, "gpu.kernel.decode_attn_long", on, "8x16384", Sl * Ll, B_AUTO);
        bench_decode(&b, big, kvl, "gpu.kernel.decode_attn_long_pipe", on, "8x16384", Sl * Ll,
                     B_PIPE);
        bench_decode(&b, big, kvl, "gpu.kernel.decode_attn_long_split", on, "8x16384", Sl * Ll,
                     B_SPLIT);
        for (int64_t s = 0; s <= Sd; s++)
            indptr[s] = (int32_t)(s * pd);
        b.pages.n_seqs = (uint32_t)Sd;
        CHECK(kv_view_init(qd, qb, KV_BF16, 3, shq, &b.q) == KV_OK);
        CHECK(kv_view_init(od, qb, KV_BF16, 3, shq, &b.out) == KV_OK);
    }
    /* the same decode with the pages in device memory; its output equals
     * the host-index decode's (one kernel body, one launch shape) */
    int32_t *d_indptr, *d_indices, *d_last;
    CHECK(cudaMalloc((void **)&d_indptr, (Sd + 1) * 4) == cudaSuccess);
    CHECK(cudaMalloc((void **)&d_indices, (size_t)B * 4) == cudaSuccess);
    CHECK(cudaMalloc((void **)&d_last, Sd * 4) == cudaSuccess);
    CHECK(cudaMemcpy(d_indptr, indptr, (Sd + 1) * 4, cudaMemcpyHostToDevice) == cudaSuccess);
    CHECK(cudaMemcpy(d_indices, perm, (size_t)B * 4, cudaMemcpyHostToDevice) == cudaSuccess);
    CHECK(cudaMemcpy(d_last, last, Sd * 4, cudaMemcpyHostToDevice) == cudaSuccess);
    b.dpages = (struct kv_attn_dev_pages){.n_seqs = (uint32_t)Sd,
                                          .page_ratio = 1,
                                          .indptr = d_indptr,
                                          .indices = d_indices,
                                          .n_pages = (uint32_t)B,
                                          .last_page_len = d_last};
    CHECK(cudaMemset(qd, 0x3c, qb) == cudaSuccess); /* bf16 0x3c3c: a non-trivial softmax */
    unsigned char *o_host = malloc(qb), *o_dev = malloc(qb);
    CHECK(o_host && o_dev);
    CHECK(b_decode(&b) == KV_OK && cudaDeviceSynchronize() == cudaSuccess);
    CHECK(cudaMemcpy(o_host, od, qb, cudaMemcpyDeviceToHost) == cudaSuccess);
    CHECK(cudaMemset(od, 0, qb) == cudaSuccess);
    time_pair(b_decode_dev, &b, b.c.base, big, kvb, &tk, &tm);
    check_no_device_errors(&b, "decode_attn_dev");
    CHECK(cudaMemcpy(o_dev, od, qb, cudaMemcpyDeviceToHost) == cudaSuccess);
    CHECK(memcmp(o_host, o_dev, qb) == 0);
    printf(
        "{\"bench\":\"gpu.kernel.decode_attn_dev\",\"case\":\"%s/bf16/N16/Hq32/H8/D128/256x2048\","
        "\"bytes\":%zu,\"tokens_per_s\":%.3g,\"gbps\":%.1f,\"baseline\":\"cudaMemcpy_d2d_of_kv\","
        "\"baseline_gbps\":%.1f,\"ratio\":%.3f,\"runs\":9}\n",
        on, kvb, (double)(Sd * Ld) / (tk * 1e-3), kvb / (tk * 1e6), kvb / (tm * 1e6), tm / tk);
    /* split-KV in the capture-safe mode: a caller workspace (64 chunks:
     * the most the plan takes) and the longest sequence as a hint, as
     * vLLM's max_seq_len; the same plan as the host-index split-KV, so the
     * same bytes; then the small batch of long sequences (8 chunks) */
    b.ws_bytes = (size_t)Sd * 32 * 64 * (size_t)(D + 2) * sizeof(float);
    CHECK(cudaMalloc(&b.ws, b.ws_bytes) == cudaSuccess);
    for (int lng = 0; lng < 2; lng++) {
        const int64_t S2 = lng ? 8 : Sd, L2 = lng ? 16384 : Ld, p2 = L2 / N;
        const size_t q2 = (size_t)S2 * 32 * D * 2, kv2 = (size_t)S2 * L2 * H * D * 2 * 2;
        for (int64_t s = 0; s <= S2; s++)
            indptr[s] = (int32_t)(s * p2);
        CHECK(cudaMemcpy(d_indptr, indptr, (size_t)(S2 + 1) * 4, cudaMemcpyHostToDevice) ==
              cudaSuccess);
        b.pages.n_seqs = b.dpages.n_seqs = (uint32_t)S2;
        b.max_tokens = L2;
        int64_t sh2[3] = {S2, 32, D};
        CHECK(kv_view_init(qd, q2, KV_BF16, 3, sh2, &b.q) == KV_OK);
        CHECK(kv_view_init(od, q2, KV_BF16, 3, sh2, &b.out) == KV_OK);
        kv__cdec_body = B_SPLIT;
        CHECK(b_decode(&b) == KV_OK && cudaDeviceSynchronize() == cudaSuccess);
        CHECK(cudaMemcpy(o_host, od, q2, cudaMemcpyDeviceToHost) == cudaSuccess);
        CHECK(cudaMemset(od, 0, q2) == cudaSuccess);
        kv__cdec_body = B_AUTO;
        bench_decode_fn(&b, b_decode_dev_ws, big, kv2,
                        lng ? "gpu.kernel.decode_attn_long_dev_split"
                            : "gpu.kernel.decode_attn_dev_split",
                        on, lng ? "8x16384" : "256x2048", S2 * L2, B_SPLIT);
        check_no_device_errors(&b, "decode_attn_dev_split");
        CHECK(cudaMemcpy(o_dev, od, q2, cudaMemcpyDeviceToHost) == cudaSuccess);
        CHECK(memcmp(o_host, o_dev, q2) == 0);
    }
    cudaFree(b.ws);
    free(o_host);
    free(o_dev);
    cudaFree(d_indptr);
    cudaFree(d_indices);
    cudaFree(d_last);
    cudaFree(b.dslots);
    kv_attn_cuda_errors_destroy(b.err);
    cudaFree(big);
    cudaFree(qd);
    cudaFree(od);
    cudaFree(kd);
    cudaFree(vd);
    cudaFree(scratch);
    cudaFree(b.c.base);
    free(perm);
    free(indptr);
    free(last);
    free(b.slots);
}

/* The multi-token kernel's speed on one shape (informational, `prefill`
 * mode): S sequences of n tokens, a whole causal prefill each (q_len = n),
 * H 8 KV heads x g 4, D 128, bf16 cache and q / out; the median of 5 runs,
 * with the causal half of the score and value flops (4 n^2 / 2 x D x Hq per
 * sequence) as the work. */
static void prefill_speed(void)
{
    const int64_t S = 4, n = 2048, H = 8, g = 4, Hq = H * g, D = 128, T = S * n;
    struct kv_layout_config cfg = KV_LAYOUT_CONFIG_INIT;
    cfg.num_layers = 1, cfg.block_tokens = 16, cfg.num_heads = H, cfg.head_dim = D;
    cfg.dtype = KV_BF16, cfg.num_blocks = T / 16 + 8;
    struct kv_layout lo;
    CHECK(kv_layout_init(&cfg, &lo) == KV_OK);
    struct kv_paged_cache c = {lo, NULL, (size_t)lo.total_bytes, KV_MEM_DEVICE};
    CHECK(cudaMalloc(&c.base, c.storage_bytes) == cudaSuccess);
    CHECK(cudaMemset(c.base, 0x3c, c.storage_bytes) == cudaSuccess); /* bf16 ~0.0115 */
    int32_t *indices = malloc((size_t)(T / 16) * sizeof(int32_t)), indptr[5], last[4], qo[5];
    CHECK(indices);
    for (int64_t i = 0; i < T / 16; i++)
        indices[i] = (int32_t)(i + 8);
    for (int s = 0; s <= 4; s++)
        indptr[s] = (int32_t)(s * n / 16), qo[s] = (int32_t)(s * n);
    for (int s = 0; s < 4; s++)
        last[s] = 16;
    const struct kv_pages pg = {.format = KV_PAGES_CSR,
                                .n_seqs = (uint32_t)S,
                                .page_ratio = 1,
                                .indptr = indptr,
                                .indices = indices,
                                .last_page_len = last};
    const size_t qb = (size_t)(T * Hq * D) * 2;
    void *dq, *dout;
    CHECK(cudaMalloc(&dq, qb) == cudaSuccess && cudaMalloc(&dout, qb) == cudaSuccess);
    CHECK(cudaMemset(dq, 0x3c, qb) == cudaSuccess);
    int64_t sh[3] = {T, Hq, D};
    struct kv_view vq, vo;
    CHECK(kv_view_init(dq, qb, KV_BF16, 3, sh, &vq) == KV_OK);
    CHECK(kv_view_init(dout, qb, KV_BF16, 3, sh, &vo) == KV_OK);
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0) == cudaSuccess && cudaEventCreate(&e1) == cudaSuccess);
    float ms[5];
    for (int r = 0; r < 6; r++) {
        CHECK(cudaEventRecord(e0, 0) == cudaSuccess);
        CHECK(kv_attn_prefill_cuda(c, 0, &vq, qo, &pg, 0.088f, NULL, &vo, NULL, NULL) == KV_OK);
        CHECK(cudaEventRecord(e1, 0) == cudaSuccess);
        CHECK(cudaEventSynchronize(e1) == cudaSuccess);
        if (r > 0)
            CHECK(cudaEventElapsedTime(&ms[r - 1], e0, e1) == cudaSuccess);
    }
    qsort(ms, 5, sizeof(float), cmp_f);
    const double flops = (double)S * 4.0 * (double)n * (double)n / 2.0 * (double)D * (double)Hq;
    printf("{\"bench\":\"gpu.kernel.prefill_attn\",\"case\":\"causal/bf16/S4/n2048/H8/g4/D128\","
           "\"ms\":%.3f,\"tflops\":%.2f}\n",
           (double)ms[2], flops / (ms[2] * 1e-3) / 1e12);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cudaFree(dq), cudaFree(dout), cudaFree(c.base);
    free(indices);
}

int main(int argc, char **argv)
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
    if (argc > 1 && strcmp(argv[1], "prefill") == 0) { /* these cases alone */
        for (int i = 0; i < 40; i++)
            prefill_case(i);
        printf("test_gpu_attn prefill: 40 prefill / decode_ex cases: ok\n");
        prefill_speed();
        return 0;
    }
    if (argc > 1 && strcmp(argv[1], "decode") == 0) { /* the decode A/B alone */
        for (int i = 0; i < 40; i++)
            decode_case(i);
        printf("test_gpu_attn decode: 40 decode cases on every body: ok\n");
        bench(KV_ORDER_NHD);
        bench(KV_ORDER_HND);
        return 0;
    }
    struct kv_attn_stats s0, s1;
    kv_attn_stats_reset();
    kv_attn_stats_get(&s0);
    for (int i = 0; i < 100; i++)
        round_trip(i);
    for (int i = 0; i < 40; i++)
        decode_case(i);
    for (int i = 0; i < 8; i++) {
        mla_case(i, false);
        mla_case(i, true);
    }
    for (int i = 0; i < 40; i++)
        prefill_case(i);
    refusals();
    scale_rules();
    kv_attn_stats_get(&s1);
    for (int k = KV_ATTN_WRITE; k <= KV_ATTN_READ; k++)
        for (int p = 0; p < KV_ATTN_PATH_COUNT; p++)
            CHECK(s1.cuda[k][p] > s0.cuda[k][p]); /* every path ran on the device */
    printf("test_gpu_attn: 100 round trips, 40 decode cases, 8 MLA decode and 8 MLA prefill "
           "cases, 40 prefill / decode_ex cases, refusals, scale rules: ok\n");
    bench(KV_ORDER_NHD);
    bench(KV_ORDER_HND);
    return 0;
}
