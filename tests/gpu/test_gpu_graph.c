/*
 * test_gpu_graph.c - one decode step captured in a CUDA graph (issue 21
 * point 2): for every layer, the write of the new tokens' K and V through
 * kv_attn_write_cuda_dev and decode attention through
 * kv_attn_decode_cuda_dev, with the slot mapping, last_page_len and the
 * error record in device memory. The graph is captured once
 * (cudaStreamBeginCapture in global mode: an allocation, a sync or a
 * pageable copy inside would fail the capture), then replayed for two steps
 * with new slot mappings, K, V and q written in place; the pool and the
 * outputs must equal the same two steps run uncaptured, byte for byte, the
 * pool must equal the CPU kernels' (kv_attn_write) and the outputs the CPU
 * decode within 1e-4. Step 2 has one invalid slot (B x N): skipped, and the
 * record read back says so.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gpu_test.h"
#include <kvcache/kv.h>

#define L 4
#define B 256
#define N 16
#define H 2
#define G 2
#define D 64
#define S 3
#define T 4 /* new tokens: one per sequence and one padding / invalid */

/* The step's inputs: device buffers the graph reads, written in place. */
struct step_dev {
    float *k, *v; /* [L][T][H][D] */
    float *q;     /* [L][S][H*G][D] */
    float *out;   /* [L][S][H*G][D] */
    int64_t *slots;
    int32_t *indptr, *indices, *last;
    struct kv_attn_cuda_errors *err;
};

struct step_host {
    float k[L * T * H * D], v[L * T * H * D], q[L * S * H * G * D];
    int64_t slots[T];
    int32_t last[S];
};

static const int32_t g_indptr[S + 1] = {0, 2, 4, 6};
static const int32_t g_indices[2 * S] = {200, 131, 97, 250, 180, 143};

static void make_step(struct step_host *h, const int32_t *lens, int64_t extra_slot, uint64_t seed)
{
    for (int i = 0; i < L * T * H * D; i++)
        h->k[i] = gpu_frand(&seed), h->v[i] = gpu_frand(&seed);
    for (int i = 0; i < L * S * H * G * D; i++)
        h->q[i] = gpu_frand(&seed);
    for (int s = 0; s < S; s++) {
        const int32_t t = lens[s] - 1; /* the new token's position */
        h->slots[s] = (int64_t)g_indices[g_indptr[s] + t / N] * N + t % N;
        h->last[s] = (lens[s] - 1) % N + 1;
    }
    h->slots[S] = extra_slot;
}

static void views(float *base, int64_t rows, int64_t heads, struct kv_view *out /* [L] */)
{
    for (int l = 0; l < L; l++) {
        int64_t shape[3] = {rows, heads, D};
        CHECK(kv_view_init(base + (size_t)l * rows * heads * D,
                           (size_t)(rows * heads * D) * sizeof(float), KV_F32, 3, shape,
                           &out[l]) == KV_OK);
    }
}

/* One decode step on `stream`: reset the record, then write + decode per layer. */
static void step(struct kv_paged_cache c, const struct step_dev *d, cudaStream_t stream)
{
    struct kv_view k[L], v[L], q[L], o[L];
    views(d->k, T, H, k);
    views(d->v, T, H, v);
    views(d->q, S, H * G, q);
    views(d->out, S, H * G, o);
    const struct kv_attn_dev_pages pg = {.n_seqs = S,
                                         .page_ratio = 1,
                                         .indptr = d->indptr,
                                         .indices = d->indices,
                                         .n_pages = 2 * S,
                                         .last_page_len = d->last};
    CHECK(kv_attn_cuda_errors_reset(d->err, (kv_cuda_stream)stream) == KV_OK);
    for (int l = 0; l < L; l++) {
        CHECK(kv_attn_write_cuda_dev(c, l, &k[l], &v[l], d->slots, T, NULL, d->err,
                                     (kv_cuda_stream)stream) == KV_OK);
        CHECK(kv_attn_decode_cuda_dev(c, (uint32_t)l, &q[l], &pg, 1.0f / sqrtf((float)D), NULL,
                                      &o[l], d->err, (kv_cuda_stream)stream) == KV_OK);
    }
}

static void upload(const struct step_dev *d, const struct step_host *h, cudaStream_t s)
{
    /* outside the graph, ordered on the stream before the replay */
    CHECK(cudaMemcpyAsync(d->k, h->k, sizeof(h->k), cudaMemcpyHostToDevice, s) == cudaSuccess);
    CHECK(cudaMemcpyAsync(d->v, h->v, sizeof(h->v), cudaMemcpyHostToDevice, s) == cudaSuccess);
    CHECK(cudaMemcpyAsync(d->q, h->q, sizeof(h->q), cudaMemcpyHostToDevice, s) == cudaSuccess);
    CHECK(cudaMemcpyAsync(d->slots, h->slots, sizeof(h->slots), cudaMemcpyHostToDevice, s) ==
          cudaSuccess);
    CHECK(cudaMemcpyAsync(d->last, h->last, sizeof(h->last), cudaMemcpyHostToDevice, s) ==
          cudaSuccess);
    CHECK(cudaStreamSynchronize(s) == cudaSuccess); /* h is pageable */
}

/* The CPU reference of one step on the host pool: kv_attn_write (the
 * invalid slot as -1: the device skips it) and kv_attn_decode. */
static int cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

/* The host time of issuing one decode step, uncaptured (2 L launches and
 * their record finishes) against one cudaGraphLaunch of the captured step
 * (issue 21: "per-call host overhead of a captured decode step: one graph
 * launch"): 200 steps each way, the median of 5 rounds, each round's
 * issue loop timed on the host alone (the stream synchronized before and
 * after, outside the timed part). Also the steps' device time (events). */
static void host_overhead(struct kv_paged_cache c, const struct step_dev *d, cudaGraphExec_t exec,
                          cudaStream_t s, size_t n_nodes)
{
    enum { STEPS = 200, ROUNDS = 5 };
    double hu[ROUNDS], hg[ROUNDS], du[ROUNDS], dg[ROUNDS];
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0) == cudaSuccess && cudaEventCreate(&e1) == cudaSuccess);
    for (int r = 0; r < ROUNDS; r++) {
        for (int way = 0; way < 2; way++) {
            CHECK(cudaStreamSynchronize(s) == cudaSuccess);
            CHECK(cudaEventRecord(e0, s) == cudaSuccess);
            const double t0 = now_us();
            for (int i = 0; i < STEPS; i++) {
                if (way)
                    CHECK(cudaGraphLaunch(exec, s) == cudaSuccess);
                else
                    step(c, d, s);
            }
            const double t1 = now_us();
            CHECK(cudaEventRecord(e1, s) == cudaSuccess);
            CHECK(cudaEventSynchronize(e1) == cudaSuccess);
            float ms = 0.0f;
            CHECK(cudaEventElapsedTime(&ms, e0, e1) == cudaSuccess);
            (way ? hg : hu)[r] = (t1 - t0) / STEPS;
            (way ? dg : du)[r] = (double)ms * 1e3 / STEPS;
        }
    }
    qsort(hu, ROUNDS, sizeof(double), cmp_double);
    qsort(hg, ROUNDS, sizeof(double), cmp_double);
    qsort(du, ROUNDS, sizeof(double), cmp_double);
    qsort(dg, ROUNDS, sizeof(double), cmp_double);
    printf("{\"bench\":\"gpu.graph.decode_step\",\"case\":\"L%d/S%d/Hq%d/D%d/%zu_nodes\","
           "\"host_us_graph\":%.2f,\"host_us_uncaptured\":%.2f,\"host_ratio\":%.2f,"
           "\"device_us_graph\":%.2f,\"device_us_uncaptured\":%.2f,\"runs\":%d}\n",
           L, S, H * G, D, n_nodes, hg[ROUNDS / 2], hu[ROUNDS / 2], hu[ROUNDS / 2] / hg[ROUNDS / 2],
           dg[ROUNDS / 2], du[ROUNDS / 2], ROUNDS);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
}

static void cpu_step(struct kv_paged_cache c, const struct step_host *h, float *out)
{
    int64_t slots[T];
    for (int t = 0; t < T; t++)
        slots[t] = h->slots[t] >= (int64_t)B * N || h->slots[t] < -1 ? -1 : h->slots[t];
    struct kv_view k[L], v[L], q[L], o[L];
    views((float *)h->k, T, H, k);
    views((float *)h->v, T, H, v);
    views((float *)h->q, S, H * G, q);
    views(out, S, H * G, o);
    struct kv_pages pg;
    memset(&pg, 0, sizeof(pg));
    pg.format = KV_PAGES_CSR;
    pg.n_seqs = S;
    pg.page_ratio = 1;
    pg.indptr = g_indptr;
    pg.indices = g_indices;
    pg.last_page_len = h->last;
    for (int l = 0; l < L; l++) {
        CHECK(kv_attn_write(c, l, &k[l], &v[l], slots, T, NULL) == KV_OK);
        CHECK(kv_attn_decode(c, (uint32_t)l, &q[l], &pg, 1.0f / sqrtf((float)D), NULL, &o[l]) ==
              KV_OK);
    }
}

int main(void)
{
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
        printf("test_gpu_graph: no CUDA device, skipped\n");
        return 0;
    }
    struct kv_layout_config cfg = KV_LAYOUT_CONFIG_INIT;
    cfg.num_layers = L, cfg.num_blocks = B, cfg.block_tokens = N, cfg.num_heads = H;
    cfg.head_dim = D, cfg.dtype = KV_F32, cfg.block_pad_elems = 4;
    struct kv_paged_cache host, dev;
    memset(&host, 0, sizeof(host));
    CHECK(kv_layout_init(&cfg, &host.layout) == KV_OK);
    const size_t bytes = (size_t)host.layout.total_bytes;
    float *p0 = malloc(bytes), *ph = malloc(bytes);
    unsigned char *back = malloc(bytes), *pu = malloc(bytes);
    CHECK(p0 && ph && back && pu);
    uint64_t seed = 42;
    for (size_t i = 0; i < bytes / 4; i++)
        p0[i] = gpu_frand(&seed);
    memcpy(ph, p0, bytes);
    host.base = ph;
    host.storage_bytes = bytes;
    dev = host;
    dev.mem = KV_MEM_DEVICE;
    CHECK(cudaMalloc(&dev.base, bytes) == cudaSuccess);

    struct step_dev d;
    CHECK(cudaMalloc((void **)&d.k, sizeof(((struct step_host *)0)->k)) == cudaSuccess);
    CHECK(cudaMalloc((void **)&d.v, sizeof(((struct step_host *)0)->v)) == cudaSuccess);
    CHECK(cudaMalloc((void **)&d.q, sizeof(((struct step_host *)0)->q)) == cudaSuccess);
    CHECK(cudaMalloc((void **)&d.out, sizeof(((struct step_host *)0)->q)) == cudaSuccess);
    CHECK(cudaMalloc((void **)&d.slots, T * sizeof(int64_t)) == cudaSuccess);
    CHECK(cudaMalloc((void **)&d.indptr, sizeof(g_indptr)) == cudaSuccess);
    CHECK(cudaMalloc((void **)&d.indices, sizeof(g_indices)) == cudaSuccess);
    CHECK(cudaMalloc((void **)&d.last, S * sizeof(int32_t)) == cudaSuccess);
    CHECK(kv_attn_cuda_errors_create(&d.err) == KV_OK);
    CHECK(cudaMemcpy(d.indptr, g_indptr, sizeof(g_indptr), cudaMemcpyHostToDevice) == cudaSuccess);
    CHECK(cudaMemcpy(d.indices, g_indices, sizeof(g_indices), cudaMemcpyHostToDevice) ==
          cudaSuccess);

    static struct step_host h1, h2;
    const int32_t lens1[S] = {5, 17, 30}, lens2[S] = {6, 18, 31};
    make_step(&h1, lens1, -1, 1);
    make_step(&h2, lens2, (int64_t)B * N, 2); /* one invalid slot */
    const size_t ob = sizeof(h1.q);
    float *ou1 = malloc(ob), *ou2 = malloc(ob), *og1 = malloc(ob), *og2 = malloc(ob),
          *oc1 = malloc(ob), *oc2 = malloc(ob);
    CHECK(ou1 && ou2 && og1 && og2 && oc1 && oc2);
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
    struct kv_attn_cuda_error_info info;

    /* uncaptured: two steps */
    CHECK(cudaMemcpy(dev.base, p0, bytes, cudaMemcpyHostToDevice) == cudaSuccess);
    upload(&d, &h1, s);
    step(dev, &d, s);
    CHECK(kv_attn_cuda_errors_get(d.err, &info, (kv_cuda_stream)s) == KV_OK);
    CHECK(info.count == 0);
    CHECK(cudaMemcpy(ou1, d.out, ob, cudaMemcpyDeviceToHost) == cudaSuccess);
    upload(&d, &h2, s);
    step(dev, &d, s);
    CHECK(kv_attn_cuda_errors_get(d.err, &info, (kv_cuda_stream)s) == KV_OK);
    /* one invalid slot, recorded once by each of the step's L writes */
    if (!(info.count == L && info.array == KV_ATTN_DEV_SLOTS && info.index == S))
        fprintf(stderr, "error record: count %llu array %d index %lld value %lld\n",
                (unsigned long long)info.count, (int)info.array, (long long)info.index,
                (long long)info.value);
    CHECK(info.count == L && info.array == KV_ATTN_DEV_SLOTS && info.index == S &&
          info.value == (int64_t)B * N);
    CHECK(cudaMemcpy(ou2, d.out, ob, cudaMemcpyDeviceToHost) == cudaSuccess);
    CHECK(cudaMemcpy(pu, dev.base, bytes, cudaMemcpyDeviceToHost) == cudaSuccess);

    /* the CPU reference of the same two steps */
    cpu_step(host, &h1, oc1);
    cpu_step(host, &h2, oc2);
    if (memcmp(pu, ph, bytes) != 0) {
        size_t i = 0;
        while (pu[i] == ((unsigned char *)ph)[i])
            i++;
        fprintf(stderr, "FAIL uncaptured pool byte %zu differs from kv_attn_write's\n", i);
        return 1;
    }
    for (size_t i = 0; i < ob / 4; i++)
        if (!(fabsf(ou1[i] - oc1[i]) <= 1e-4f && fabsf(ou2[i] - oc2[i]) <= 1e-4f)) {
            fprintf(stderr, "FAIL out[%zu]: %g %g vs CPU %g %g\n", i, ou1[i], ou2[i], oc1[i],
                    oc2[i]);
            return 1;
        }
    CHECK(memcmp(ou1, ou2, ob) != 0);

    /* captured once, replayed twice with the inputs written in place */
    CHECK(cudaMemcpy(dev.base, p0, bytes, cudaMemcpyHostToDevice) == cudaSuccess);
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal) == cudaSuccess);
    step(dev, &d, s);
    CHECK(cudaStreamEndCapture(s, &graph) == cudaSuccess);
    CHECK(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
    size_t n_nodes = 0;
    CHECK(cudaGraphGetNodes(graph, NULL, &n_nodes) == cudaSuccess);
    printf("test_gpu_graph: one decode step of %d layers = %zu graph nodes\n", L, n_nodes);
    upload(&d, &h1, s);
    CHECK(cudaGraphLaunch(exec, s) == cudaSuccess);
    CHECK(kv_attn_cuda_errors_get(d.err, &info, (kv_cuda_stream)s) == KV_OK);
    CHECK(info.count == 0);
    CHECK(cudaMemcpy(og1, d.out, ob, cudaMemcpyDeviceToHost) == cudaSuccess);
    upload(&d, &h2, s);
    CHECK(cudaGraphLaunch(exec, s) == cudaSuccess);
    CHECK(kv_attn_cuda_errors_get(d.err, &info, (kv_cuda_stream)s) == KV_OK);
    /* one invalid slot, recorded once by each of the step's L writes */
    if (!(info.count == L && info.array == KV_ATTN_DEV_SLOTS && info.index == S))
        fprintf(stderr, "error record: count %llu array %d index %lld value %lld\n",
                (unsigned long long)info.count, (int)info.array, (long long)info.index,
                (long long)info.value);
    CHECK(info.count == L && info.array == KV_ATTN_DEV_SLOTS && info.index == S &&
          info.value == (int64_t)B * N);
    CHECK(cudaMemcpy(og2, d.out, ob, cudaMemcpyDeviceToHost) == cudaSuccess);
    gpu_pool_same(dev.base, back, pu, bytes, "graph replay", "uncaptured");
    CHECK(memcmp(og1, ou1, ob) == 0);
    CHECK(memcmp(og2, ou2, ob) == 0);
    host_overhead(dev, &d, exec, s, n_nodes);

    CHECK(cudaGraphExecDestroy(exec) == cudaSuccess);
    CHECK(cudaGraphDestroy(graph) == cudaSuccess);
    kv_attn_cuda_errors_destroy(d.err);
    cudaFree(d.k), cudaFree(d.v), cudaFree(d.q), cudaFree(d.out), cudaFree(d.slots);
    cudaFree(d.indptr), cudaFree(d.indices), cudaFree(d.last), cudaFree(dev.base);
    cudaStreamDestroy(s);
    free(p0), free(ph), free(back), free(pu);
    free(ou1), free(ou2), free(og1), free(og2), free(oc1), free(oc2);
    printf("test_gpu_graph: OK\n");
    return 0;
}
