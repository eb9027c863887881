/*
 * test_gpu_view.c - runs only where a GPU exists (scripts/gpu-check.sh):
 * kv_view_copy_cuda of transposed, sliced and padded views into a strided
 * destination inside a larger device pool, checked element by element (and
 * for stray writes over the whole pool) against a host reference.
 */
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_test.h"
#include <kvcache/kv.h>

static int64_t off_of(const struct kv_view *v, int64_t lin)
{
    int64_t off = v->offset;
    for (int k = v->ndim - 1; k >= 0; k--) {
        off += (lin % v->shape[k]) * v->strides[k];
        lin /= v->shape[k];
    }
    return off;
}

/* GPU benchmark (docs/bench-method.md): the NHD -> HND page permute of 256 MiB bf16 by
 * kv_view_copy_cuda against a device-to-device cudaMemcpy of the same bytes,
 * interleaved, medians of 9. One JSON line on stdout. */
static int cmp_f(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

static void bench_permute(void)
{
    int64_t blocks = 8192, shape[4] = {blocks, 16, 8, 128}, pshape[4] = {blocks, 8, 16, 128};
    int perm[4] = {0, 2, 1, 3};
    size_t bytes = (size_t)blocks * 16 * 8 * 128 * 2;
    void *a, *b;
    struct kv_view s, d;
    cudaEvent_t e0, e1;
    float tk[9], tm[9];

    CHECK(cudaMalloc(&a, bytes) == cudaSuccess);
    CHECK(cudaMalloc(&b, bytes) == cudaSuccess);
    CHECK(cudaMemset(a, 0x5A, bytes) == cudaSuccess);
    CHECK(kv_view_init(a, bytes, KV_BF16, 4, shape, &s) == KV_OK);
    CHECK(kv_view_permute(&s, perm, 4, &s) == KV_OK);
    CHECK(kv_view_init(b, bytes, KV_BF16, 4, pshape, &d) == KV_OK);
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    for (int r = -1; r < 9; r++) { /* r = -1: warm-up */
        cudaEventRecord(e0, 0);
        CHECK(kv_view_copy_cuda(&s, &d, NULL) == KV_OK);
        cudaEventRecord(e1, 0);
        cudaEventSynchronize(e1);
        if (r >= 0)
            cudaEventElapsedTime(&tk[r], e0, e1);
        cudaEventRecord(e0, 0);
        CHECK(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice) == cudaSuccess);
        cudaEventRecord(e1, 0);
        cudaEventSynchronize(e1);
        if (r >= 0)
            cudaEventElapsedTime(&tm[r], e0, e1);
    }
    qsort(tk, 9, sizeof(float), cmp_f);
    qsort(tm, 9, sizeof(float), cmp_f);
    printf("{\"bench\":\"gpu.view_copy\",\"case\":\"permute/nhd->hnd/bf16/N16/H8/D128\","
           "\"bytes\":%zu,\"gbps\":%.1f,\"baseline\":\"cudaMemcpy_d2d\","
           "\"baseline_gbps\":%.1f,\"ratio\":%.3f,\"runs\":9}\n",
           bytes, bytes / (tk[4] * 1e6), bytes / (tm[4] * 1e6), tm[4] / tk[4]);
    cudaFree(a);
    cudaFree(b);
}

int main(void)
{
    const int64_t pool_elems = 1 << 22;
    uint16_t *h_src = malloc(pool_elems * 2), *h_dst = malloc(pool_elems * 2);
    void *d_src, *d_dst;
    struct kv_view s, d;
    int64_t shape[4] = {64, 16, 8, 128}, pshape[4] = {64, 8, 16, 128}, n;
    int perm[4] = {0, 2, 1, 3};
    int devs = 0;

    if (cudaGetDeviceCount(&devs) != cudaSuccess || devs == 0) {
        printf("no GPU: skipped\n");
        return 77;
    }
    CHECK(cudaMalloc(&d_src, pool_elems * 2) == cudaSuccess);
    CHECK(cudaMalloc(&d_dst, pool_elems * 2) == cudaSuccess);
    for (int64_t i = 0; i < pool_elems; i++)
        h_src[i] = (uint16_t)(i * 2654435761u >> 7);
    CHECK(cudaMemcpy(d_src, h_src, pool_elems * 2, cudaMemcpyHostToDevice) == cudaSuccess);
    CHECK(cudaMemset(d_dst, 0xAB, pool_elems * 2) == cudaSuccess);
    /* src: NHD blocks viewed as HND (permute), starting at an offset */
    CHECK(kv_view_init(d_src, pool_elems * 2, KV_BF16, 4, shape, &s) == KV_OK);
    CHECK(kv_view_as_strided(&s, 4, shape, s.strides, 12345, &s) == KV_OK);
    CHECK(kv_view_permute(&s, perm, 4, &s) == KV_OK);
    /* dst: padded blocks (block stride 20000 elems) far from 0 */
    {
        int64_t dstr[4] = {20000, 16 * 128, 128, 1};
        CHECK(kv_view_init(d_dst, pool_elems * 2, KV_BF16, 1, &pool_elems, &d) == KV_OK);
        CHECK(kv_view_as_strided(&d, 4, pshape, dstr, 2000000, &d) == KV_OK);
    }
    CHECK(kv_view_copy_cuda(&s, &d, NULL) == KV_OK);
    CHECK(cudaDeviceSynchronize() == cudaSuccess);
    CHECK(cudaMemcpy(h_dst, d_dst, pool_elems * 2, cudaMemcpyDeviceToHost) == cudaSuccess);
    n = kv_view_numel(&s);
    {
        char *touched = calloc(pool_elems, 1);
        for (int64_t i = 0; i < n; i++) {
            int64_t od = off_of(&d, i);
            CHECK(h_dst[od] == h_src[off_of(&s, i)]);
            touched[od] = 1;
        }
        for (int64_t i = 0; i < pool_elems; i++)
            CHECK(touched[i] || h_dst[i] == 0xABAB);
        free(touched);
    }
    printf("gpu view copy: %lld elements OK, no stray writes\n", (long long)n);
    bench_permute();
    cudaFree(d_src);
    cudaFree(d_dst);
    free(h_src);
    free(h_dst);
    return 0;
}
