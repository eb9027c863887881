/*
 * test_gpu_devidx.c - the device-index entries of issue 21 point 1 on a GPU,
 * each against the host-index CUDA entry of the same call (which
 * test_gpu_attn checks against the CPU kernels), byte for byte over the
 * whole destination (pool or output buffer):
 *   - kv_attn_write_cuda_dev, every layer at once, with scales in device
 *     memory (a row per layer) and by value (shared), one invalid slot
 *     skipped and recorded;
 *   - kv_attn_read_cuda_dev, CSR and block-table pages, out_indptr, scales;
 *   - kv_attn_decode_cuda_dev with block-table pages and CSR, scales in
 *     device memory and by value;
 *   - kv_attn_copy_blocks_ex_cuda_dev between two device caches of one
 *     block format (a layer range, the V plane), one pair with src = B
 *     skipped and recorded;
 *   - kv_plan_copy_cuda_dev (a layer range, one head, block lists in
 *     device memory) against kv_plan_copy_cuda, one invalid destination id
 *     skipped and recorded;
 *   - capture: read, decode, copy_ex and the plan copy captured in one
 *     graph and replayed
 *     after the device scales were rewritten in place (the replay reads the
 *     new values: the uncaptured calls with the new scales give the same
 *     bytes).
 * Needs a GPU: says so and exits 0 without one (scripts/gpu-check.sh).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_test.h"
#include <kvcache/kv.h>

#define L 3
#define B 256
#define N 16
#define H 2
#define G 2
#define D 64
#define T 40 /* tokens written */
#define S 3  /* sequences read and decoded */

static void *dev_alloc(size_t n)
{
    void *p = NULL;
    CHECK(cudaMalloc(&p, n) == cudaSuccess);
    return p;
}

static void *dev_copy(const void *h, size_t n)
{
    void *p = dev_alloc(n);
    CHECK(cudaMemcpy(p, h, n, cudaMemcpyHostToDevice) == cudaSuccess);
    return p;
}

/* A device buffer of n random bytes and a second one with the same bytes. */
static void dev_twins(size_t n, uint64_t seed, void **a, void **b)
{
    unsigned char *h = malloc(n);
    CHECK(h);
    for (size_t i = 0; i < n; i++)
        h[i] = (unsigned char)gpu_rnd(&seed);
    *a = dev_copy(h, n);
    *b = dev_copy(h, n);
    free(h);
}

/* Two device buffers must hold the same n bytes. */
static void same(const void *a, const void *b, size_t n, const char *what)
{
    unsigned char *ha = malloc(n), *hb = malloc(n);
    CHECK(ha && hb);
    CHECK(cudaDeviceSynchronize() == cudaSuccess);
    CHECK(cudaMemcpy(ha, a, n, cudaMemcpyDeviceToHost) == cudaSuccess);
    CHECK(cudaMemcpy(hb, b, n, cudaMemcpyDeviceToHost) == cudaSuccess);
    if (memcmp(ha, hb, n) != 0) {
        size_t i = 0;
        while (ha[i] == hb[i])
            i++;
        fprintf(stderr, "FAIL %s: byte %zu (of %zu) is 0x%02x vs the host-index entry's 0x%02x\n",
                what, i, n, ha[i], hb[i]);
        exit(1);
    }
    free(ha), free(hb);
}

/* A cache over device memory: f16, HND, padded, nb blocks; pool bytes are
 * f16 values of magnitude < 1 (no inf or NaN). */
static struct kv_paged_cache cache_make(int64_t nb, uint64_t seed)
{
    struct kv_layout_config cfg = KV_LAYOUT_CONFIG_INIT;
    cfg.num_layers = L, cfg.num_blocks = nb, cfg.block_tokens = N, cfg.num_heads = H;
    cfg.head_dim = D, cfg.dtype = KV_F16, cfg.order = KV_ORDER_HND, cfg.block_pad_elems = 8;
    struct kv_paged_cache c;
    memset(&c, 0, sizeof(c));
    CHECK(kv_layout_init(&cfg, &c.layout) == KV_OK);
    c.storage_bytes = (size_t)c.layout.total_bytes;
    uint16_t *h = malloc(c.storage_bytes);
    CHECK(h);
    for (size_t i = 0; i < c.storage_bytes / 2; i++)
        h[i] = (uint16_t)(gpu_rnd(&seed) & 0xBBFF);
    c.base = dev_copy(h, c.storage_bytes);
    c.mem = KV_MEM_DEVICE;
    free(h);
    return c;
}

static struct kv_paged_cache cache_twin(const struct kv_paged_cache *c)
{
    struct kv_paged_cache t = *c;
    t.base = dev_alloc(c->storage_bytes);
    CHECK(cudaMemcpy(t.base, c->base, c->storage_bytes, cudaMemcpyDeviceToDevice) == cudaSuccess);
    return t;
}

/* A contiguous f32 view [lead?][rows][heads][D] over device memory. */
static struct kv_view fview(void *base, int64_t lead, int64_t rows, int64_t heads)
{
    struct kv_view v;
    int64_t shape[4] = {lead, rows, heads, D};
    const int nd = lead ? 4 : 3;
    const int64_t elems = (lead ? lead : 1) * rows * heads * D;
    CHECK(kv_view_init(base, (size_t)elems * 4, KV_F32, nd, lead ? shape : shape + 1, &v) == KV_OK);
    return v;
}

static void record_is(struct kv_attn_cuda_errors *e, uint64_t count, int array, int64_t index,
                      int64_t value, const char *what)
{
    struct kv_attn_cuda_error_info info;
    CHECK(kv_attn_cuda_errors_get(e, &info, NULL) == KV_OK);
    if (info.count != count ||
        (count && ((int)info.array != array || info.index != index || info.value != value))) {
        fprintf(stderr,
                "FAIL %s: record count %llu array %d index %lld value %lld, expected %llu %d "
                "%lld %lld\n",
                what, (unsigned long long)info.count, (int)info.array, (long long)info.index,
                (long long)info.value, (unsigned long long)count, array, (long long)index,
                (long long)value);
        exit(1);
    }
    CHECK(kv_attn_cuda_errors_reset(e, NULL) == KV_OK);
}

/* Pages of S sequences (lens 20, 0, 37; page ids from 100 up, a stride of
 * 7 so they are scattered) as CSR and as a block table of 4 columns. */
static const int32_t lens[S] = {20, 0, 37};
static int32_t indptr[S + 1], indices[8], last[S], table[S * 4], outptr[S + 1];

static void pages_make(void)
{
    int32_t k = 0, id = 100;
    outptr[0] = 0;
    for (int s = 0; s < S; s++) {
        const int32_t np = (lens[s] + N - 1) / N;
        indptr[s] = k;
        for (int c = 0; c < 4; c++)
            table[s * 4 + c] = c < np ? id + 7 * c : -1;
        for (int c = 0; c < np; c++)
            indices[k++] = id + 7 * c;
        id += 40;
        last[s] = np ? lens[s] - (np - 1) * N : 0;
        outptr[s + 1] = outptr[s] + lens[s];
    }
    indptr[S] = k;
}

int main(void)
{
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
        printf("test_gpu_devidx: no CUDA device, skipped\n");
        return 0;
    }
    uint64_t seed = 7;
    struct kv_attn_cuda_errors *err = NULL;
    CHECK(kv_attn_cuda_errors_create(&err) == KV_OK);
    float ks[L * H], vs[L * H];
    for (int i = 0; i < L * H; i++)
        ks[i] = 0.25f + 0.125f * (float)i, vs[i] = 2.0f - 0.25f * (float)i;
    float *dks = dev_copy(ks, sizeof(ks)), *dvs = dev_copy(vs, sizeof(vs));

    /* ---- write: every layer, scales per layer in device memory / shared by value */
    struct kv_paged_cache c = cache_make(B, 1), h = cache_twin(&c);
    float *kt = malloc((size_t)L * T * H * D * 4), *vt = malloc((size_t)L * T * H * D * 4);
    CHECK(kt && vt);
    for (int i = 0; i < L * T * H * D; i++)
        kt[i] = gpu_frand(&seed), vt[i] = gpu_frand(&seed);
    float *dk = dev_copy(kt, (size_t)L * T * H * D * 4),
          *dv = dev_copy(vt, (size_t)L * T * H * D * 4);
    const struct kv_view k = fview(dk, L, T, H), v = fview(dv, L, T, H);
    int64_t slots[T], hslots[T];
    for (int t = 0; t < T; t++)
        slots[t] = t % 9 == 4 ? -1 : (int64_t)(100 + (t * 37) % 150) * N + t % N;
    slots[7] = (int64_t)B * N + 5; /* invalid: skipped, recorded */
    for (int t = 0; t < T; t++)
        hslots[t] = t == 7 ? -1 : slots[t];
    int64_t *dslots = dev_copy(slots, sizeof(slots));
    const struct kv_scales hsc_l = {ks, vs, H, L}, hsc_0 = {ks, vs, H, 0};
    const struct kv_attn_dev_scales dsc_l = {dks, dvs, H, L, 1}, vsc_0 = {ks, vs, H, 0, 0};
    CHECK(kv_attn_write_cuda(h, KV_ATTN_ALL_LAYERS, &k, &v, hslots, T, &hsc_l, NULL) == KV_OK);
    CHECK(kv_attn_write_cuda_dev(c, KV_ATTN_ALL_LAYERS, &k, &v, dslots, T, &dsc_l, err, NULL) ==
          KV_OK);
    same(c.base, h.base, c.storage_bytes, "write_dev, device scales per layer");
    record_is(err, 1, KV_ATTN_DEV_SLOTS, 7, (int64_t)B * N + 5, "write_dev");
    struct kv_view k1 = fview(dk, 0, T, H), v1 = fview(dv, 0, T, H);
    CHECK(kv_attn_write_cuda(h, 2, &k1, &v1, hslots, T, &hsc_0, NULL) == KV_OK);
    CHECK(kv_attn_write_cuda_dev(c, 2, &k1, &v1, dslots, T, &vsc_0, err, NULL) == KV_OK);
    same(c.base, h.base, c.storage_bytes, "write_dev, scales by value");
    record_is(err, 1, KV_ATTN_DEV_SLOTS, 7, (int64_t)B * N + 5, "write_dev by value");

    /* ---- read: CSR and block table, every layer, out_indptr */
    pages_make();
    const int64_t Tr = outptr[S];
    int32_t *d_indptr = dev_copy(indptr, sizeof(indptr)),
            *d_indices = dev_copy(indices, sizeof(indices));
    int32_t *d_last = dev_copy(last, sizeof(last)), *d_table = dev_copy(table, sizeof(table));
    int32_t *d_lens = dev_copy(lens, sizeof(lens)), *d_out = dev_copy(outptr, sizeof(outptr));
    struct kv_attn_dev_pages csr = {.n_seqs = S,
                                    .page_ratio = 1,
                                    .indptr = d_indptr,
                                    .indices = d_indices,
                                    .n_pages = indptr[S],
                                    .last_page_len = d_last};
    struct kv_attn_dev_pages tab = {.n_seqs = S,
                                    .page_ratio = 1,
                                    .format = KV_PAGES_BLOCK_TABLE,
                                    .block_table = d_table,
                                    .block_table_cols = 4,
                                    .seq_lens = d_lens};
    struct kv_pages hp;
    memset(&hp, 0, sizeof(hp));
    hp.format = KV_PAGES_CSR, hp.n_seqs = S, hp.page_ratio = 1;
    hp.indptr = indptr, hp.indices = indices, hp.last_page_len = last;
    const size_t rb = (size_t)L * Tr * H * D * 4;
    void *ro_a, *ro_b, *rv_a, *rv_b;
    dev_twins(rb, 11, &ro_a, &ro_b);
    dev_twins(rb, 12, &rv_a, &rv_b);
    struct kv_view rka = fview(ro_a, L, Tr, H), rkb = fview(ro_b, L, Tr, H);
    struct kv_view rva = fview(rv_a, L, Tr, H), rvb = fview(rv_b, L, Tr, H);
    CHECK(kv_attn_read_cuda(c, KV_ATTN_ALL_LAYERS, &hp, &rkb, &rvb, &hsc_l, NULL) == KV_OK);
    CHECK(kv_attn_read_cuda_dev(c, KV_ATTN_ALL_LAYERS, &csr, d_out, &rka, &rva, &dsc_l, err,
                                NULL) == KV_OK);
    same(ro_a, ro_b, rb, "read_dev CSR, K");
    same(rv_a, rv_b, rb, "read_dev CSR, V");
    CHECK(cudaMemset(ro_a, 0x5a, rb) == cudaSuccess && cudaMemset(rv_a, 0x5a, rb) == cudaSuccess);
    CHECK(kv_attn_read_cuda_dev(c, KV_ATTN_ALL_LAYERS, &tab, d_out, &rka, &rva, &dsc_l, err,
                                NULL) == KV_OK);
    same(ro_a, ro_b, rb, "read_dev block table, K");
    same(rv_a, rv_b, rb, "read_dev block table, V");
    record_is(err, 0, 0, 0, 0, "read_dev");

    /* ---- decode: layer 1, CSR host-index vs device CSR / block table */
    const size_t qb = (size_t)S * H * G * D * 4;
    float *qh = malloc(qb);
    CHECK(qh);
    for (size_t i = 0; i < qb / 4; i++)
        qh[i] = gpu_frand(&seed);
    void *dq = dev_copy(qh, qb), *o_a, *o_b;
    dev_twins(qb, 13, &o_a, &o_b);
    struct kv_view q = fview(dq, 0, S, H * G), oa = fview(o_a, 0, S, H * G),
                   ob = fview(o_b, 0, S, H * G);
    const float sm = 1.0f / sqrtf((float)D);
    CHECK(kv_attn_decode_cuda(c, 1, &q, &hp, sm, &hsc_l, &ob, NULL) == KV_OK);
    CHECK(kv_attn_decode_cuda_dev(c, 1, &q, &tab, sm, &dsc_l, &oa, err, NULL) == KV_OK);
    same(o_a, o_b, qb, "decode_dev block table, device scales");
    CHECK(cudaMemset(o_a, 0x5a, qb) == cudaSuccess);
    const struct kv_attn_dev_scales vsc_l = {ks, vs, H, L, 0};
    CHECK(kv_attn_decode_cuda_dev(c, 1, &q, &csr, sm, &vsc_l, &oa, err, NULL) == KV_OK);
    same(o_a, o_b, qb, "decode_dev CSR, scales by value");
    record_is(err, 0, 0, 0, 0, "decode_dev");

    /* ---- copy_ex: into a device cache of 128 blocks, layers 1..2, V */
    struct kv_paged_cache d = cache_make(128, 3), dh = cache_twin(&d);
    const struct kv_block_copy pairs[4] = {{200, 100, 0}, {110, 127, 0}, {B, 5, 0}, {140, 9, 0}};
    const struct kv_block_copy hpairs[3] = {{200, 100, 0}, {110, 127, 0}, {140, 9, 0}};
    struct kv_block_copy *d_pairs = dev_copy(pairs, sizeof(pairs));
    struct kv_copy_blocks_opts o = KV_COPY_BLOCKS_OPTS_INIT;
    o.layer0 = 1, o.n_layers = 2, o.planes = KV_ATTN_PLANE_V;
    CHECK(kv_attn_copy_blocks_ex_cuda(dh, c, hpairs, 3, &o, NULL) == KV_OK);
    CHECK(kv_attn_copy_blocks_ex_cuda_dev(d, c, d_pairs, 4, &o, err, NULL) == KV_OK);
    same(d.base, dh.base, d.storage_bytes, "copy_blocks_ex_dev");
    record_is(err, 1, KV_ATTN_DEV_COPIES, 4, B, "copy_blocks_ex_dev");

    /* ---- the plan copy with device block lists: c -> d2 (a 2-layer range,
     * one head), against kv_plan_copy_cuda; one invalid destination id */
    struct kv_paged_cache d2 = cache_make(128, 4), d2h = cache_twin(&d2), d3 = cache_twin(&d2);
    struct kv_plan_config pcfg = KV_PLAN_CONFIG_INIT;
    pcfg.src_head0 = 1, pcfg.dst_head0 = 0, pcfg.n_heads = 1;
    pcfg.src_layer0 = 1, pcfg.dst_layer0 = 0, pcfg.n_layers = 2;
    kv_plan *plan = NULL;
    kv_plan_dev *pd = NULL;
    CHECK(kv_plan_create(&c.layout, &d2.layout, &pcfg, &plan) == KV_OK);
    CHECK(kv_plan_dev_create(plan, &pd) == KV_OK);
    const uint32_t psrc[3] = {200, 17, 255}, pbad[3] = {5, 128, 64};
    uint32_t *d_psrc = dev_copy(psrc, sizeof(psrc)), *d_pbad = dev_copy(pbad, sizeof(pbad));
    struct kv_plan_cuda_errors *perr = dev_alloc(sizeof(*perr)), prec;
    CHECK(cudaMemset(perr, 0, sizeof(*perr)) == cudaSuccess);
    /* the host-index twin: the request's valid blocks (block 1 skipped) */
    const uint32_t hsrc[2] = {200, 255}, hdst[2] = {5, 64};
    CHECK(kv_plan_copy_cuda(plan, c, hsrc, 1, d2h, hdst, 1, N, NULL) == KV_OK);
    CHECK(kv_plan_copy_cuda(plan, c, hsrc + 1, 1, d2h, hdst + 1, 1, N, NULL) == KV_OK);
    CHECK(kv_plan_copy_cuda_dev(pd, c, d_psrc, 3, d2, d_pbad, 3, 3 * N, perr, NULL) == KV_OK);
    same(d2.base, d2h.base, d2.storage_bytes, "plan_copy_cuda_dev");
    /* the same through a device plan whose plan was destroyed first (it
     * keeps a copy: handles are freed in any order) */
    {
        kv_plan *tmp = NULL;
        kv_plan_dev *pd2 = NULL;
        CHECK(kv_plan_create(&c.layout, &d2.layout, &pcfg, &tmp) == KV_OK);
        CHECK(kv_plan_dev_create(tmp, &pd2) == KV_OK);
        kv_plan_destroy(tmp);
        CHECK(kv_plan_copy_cuda_dev(pd2, c, d_psrc, 3, d3, d_pbad, 3, 3 * N, NULL, NULL) == KV_OK);
        CHECK(cudaDeviceSynchronize() == cudaSuccess);
        kv_plan_dev_destroy(pd2);
        same(d3.base, d2h.base, d3.storage_bytes, "plan_copy_cuda_dev, plan destroyed first");
    }
    CHECK(cudaMemcpy(&prec, perr, sizeof(prec), cudaMemcpyDeviceToHost) == cudaSuccess);
    CHECK(prec.count == 1 && prec.first_key == ~(((uint64_t)1 << 56) | 1) &&
          prec.value_key == prec.first_key && prec.first_value == 128);
    CHECK(cudaMemset(perr, 0, sizeof(*perr)) == cudaSuccess);

    /* ---- capture: read + decode + copy_ex + plan copy, replayed with new
     * device scales */
    cudaStream_t st;
    CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking) == cudaSuccess);
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal) == cudaSuccess);
    CHECK(kv_attn_read_cuda_dev(c, KV_ATTN_ALL_LAYERS, &tab, d_out, &rka, &rva, &dsc_l, err,
                                (kv_cuda_stream)st) == KV_OK);
    CHECK(kv_attn_decode_cuda_dev(c, 1, &q, &tab, sm, &dsc_l, &oa, err, (kv_cuda_stream)st) ==
          KV_OK);
    CHECK(kv_attn_copy_blocks_ex_cuda_dev(d, c, d_pairs, 4, &o, err, (kv_cuda_stream)st) == KV_OK);
    CHECK(kv_plan_copy_cuda_dev(pd, c, d_psrc, 3, d2, d_pbad, 3, 3 * N, perr, (kv_cuda_stream)st) ==
          KV_OK);
    CHECK(cudaStreamEndCapture(st, &graph) == cudaSuccess);
    CHECK(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
    for (int i = 0; i < L * H; i++)
        ks[i] *= 2.0f, vs[i] *= 0.5f;
    CHECK(cudaMemcpy(dks, ks, sizeof(ks), cudaMemcpyHostToDevice) == cudaSuccess);
    CHECK(cudaMemcpy(dvs, vs, sizeof(vs), cudaMemcpyHostToDevice) == cudaSuccess);
    CHECK(cudaGraphLaunch(exec, st) == cudaSuccess);
    CHECK(cudaStreamSynchronize(st) == cudaSuccess);
    CHECK(kv_attn_read_cuda(c, KV_ATTN_ALL_LAYERS, &hp, &rkb, &rvb, &hsc_l, NULL) == KV_OK);
    CHECK(kv_attn_decode_cuda(c, 1, &q, &hp, sm, &hsc_l, &ob, NULL) == KV_OK);
    same(ro_a, ro_b, rb, "graph replay read, new scales, K");
    same(rv_a, rv_b, rb, "graph replay read, new scales, V");
    same(o_a, o_b, qb, "graph replay decode, new scales");
    same(d.base, dh.base, d.storage_bytes, "graph replay copy_ex");
    same(d2.base, d2h.base, d2.storage_bytes, "graph replay plan copy");
    CHECK(cudaMemcpy(&prec, perr, sizeof(prec), cudaMemcpyDeviceToHost) == cudaSuccess);
    CHECK(prec.count == 1 && prec.first_value == 128);
    record_is(err, 1, KV_ATTN_DEV_COPIES, 4, B, "graph replay");

    CHECK(cudaGraphExecDestroy(exec) == cudaSuccess);
    CHECK(cudaGraphDestroy(graph) == cudaSuccess);
    CHECK(cudaStreamDestroy(st) == cudaSuccess);
    kv_attn_cuda_errors_destroy(err);
    kv_plan_dev_destroy(pd);
    kv_plan_destroy(plan);
    void *bufs[] = {dks,       dvs,    c.base,  h.base, dk,     dv,      dslots,  d_indptr,
                    d_indices, d_last, d_table, d_lens, d_out,  ro_a,    ro_b,    rv_a,
                    rv_b,      dq,     o_a,     o_b,    d.base, dh.base, d_pairs, d2.base,
                    d2h.base,  d_psrc, d_pbad,  perr,   d3.base};
    for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++)
        CHECK(cudaFree(bufs[i]) == cudaSuccess);
    free(kt), free(vt), free(qh);
    printf("test_gpu_devidx: OK\n");
    return 0;
}
