/*
 * test_gpu_view.c - runs only where a GPU exists (scripts/gpu-check.sh):
 * kv_view_copy_cuda of transposed, sliced and padded views into a strided
 * destination inside a larger device pool, checked element by element (and
 * for stray writes over the whole pool) against a host reference.
 */
#include <cuda_runtime_api.h>
#include <stddef.h>
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

/* One device copy of a pool region: src and dst are views over two device
 * pools of pool_bytes; the whole dst pool is compared with a host reference
 * (copied elements where the view formula says, 0xAB everywhere else), and
 * the path counter `want` must have moved. */
static void run_case(const char *name, const struct kv_view *hs, const struct kv_view *hd,
                     void *d_src, void *d_dst, size_t pool_bytes, const unsigned char *h_src,
                     size_t want_path)
{
    struct kv_view s = *hs, d = *hd;
    struct kv_view_cuda_stats a, b;
    unsigned char *h_dst = malloc(pool_bytes), *ref = malloc(pool_bytes);
    const size_t e = kv_view_elem_bytes(&s);
    int64_t n = kv_view_numel(&s);

    CHECK(h_dst && ref);
    s.base = d_src;
    d.base = d_dst;
    CHECK(cudaMemset(d_dst, 0xAB, pool_bytes) == cudaSuccess);
    kv_view_cuda_stats_get(&a);
    CHECK(kv_view_copy_cuda(&s, &d, NULL) == KV_OK);
    CHECK(cudaDeviceSynchronize() == cudaSuccess);
    kv_view_cuda_stats_get(&b);
    CHECK(((const uint64_t *)&b)[want_path] == ((const uint64_t *)&a)[want_path] + 1);
    CHECK(cudaMemcpy(h_dst, d_dst, pool_bytes, cudaMemcpyDeviceToHost) == cudaSuccess);
    memset(ref, 0xAB, pool_bytes);
    for (int64_t i = 0; i < n; i++)
        memcpy(ref + off_of(&d, i) * (int64_t)e, h_src + off_of(&s, i) * (int64_t)e, e);
    CHECK(memcmp(ref, h_dst, pool_bytes) == 0);
    printf("gpu view copy %-28s %9lld elements OK, whole pool checked\n", name, (long long)n);
    free(h_dst);
    free(ref);
}

#define PATH(f) (offsetof(struct kv_view_cuda_stats, f) / sizeof(uint64_t))

int main(void)
{
    const size_t pool_bytes = (size_t)8 << 20;
    unsigned char *h_src = malloc(pool_bytes);
    void *d_src, *d_dst;
    struct kv_view s, d, t;
    int devs = 0;

    if (cudaGetDeviceCount(&devs) != cudaSuccess || devs == 0) {
        printf("no GPU: skipped\n");
        return 77;
    }
    CHECK(h_src != NULL);
    CHECK(cudaMalloc(&d_src, pool_bytes) == cudaSuccess);
    CHECK(cudaMalloc(&d_dst, pool_bytes) == cudaSuccess);
    for (size_t i = 0; i < pool_bytes; i++)
        h_src[i] = (unsigned char)((i * 2654435761u) >> 13);
    CHECK(cudaMemcpy(d_src, h_src, pool_bytes, cudaMemcpyHostToDevice) == cudaSuccess);

    { /* NHD blocks viewed as HND, into padded HND blocks far from 0: rows of
       * D = 128 bf16, 16-byte aligned on both sides */
        int64_t shape[4] = {64, 16, 8, 128}, pshape[4] = {64, 8, 16, 128};
        int64_t dstr[4] = {20000, 16 * 128, 128, 1};
        int perm[4] = {0, 2, 1, 3};
        CHECK(kv_view_init(h_src, pool_bytes, KV_BF16, 4, shape, &s) == KV_OK);
        CHECK(kv_view_as_strided(&s, 4, shape, s.strides, 4096, &s) == KV_OK);
        CHECK(kv_view_permute(&s, perm, 4, &s) == KV_OK);
        CHECK(kv_view_init(h_src, pool_bytes, KV_BF16, 4, pshape, &d) == KV_OK);
        CHECK(kv_view_as_strided(&d, 4, pshape, dstr, 1 << 20, &d) == KV_OK);
        run_case("nhd->hnd bf16 (vec16)", &s, &d, d_src, d_dst, pool_bytes, h_src, PATH(vec16));
        /* the same at an odd element offset: 2-byte vectors */
        CHECK(kv_view_init(h_src, pool_bytes, KV_BF16, 4, shape, &s) == KV_OK);
        CHECK(kv_view_as_strided(&s, 4, shape, s.strides, 12345, &s) == KV_OK);
        CHECK(kv_view_permute(&s, perm, 4, &s) == KV_OK);
        run_case("nhd->hnd bf16 odd (vec2)", &s, &d, d_src, d_dst, pool_bytes, h_src, PATH(vec2));
    }
    { /* f32 heads of D = 2 (8-byte rows) gathered with a token step */
        int64_t shape[3] = {4096, 8, 2};
        CHECK(kv_view_init(h_src, pool_bytes, KV_F32, 3, shape, &t) == KV_OK);
        CHECK(kv_view_slice(&t, 0, 1, 4096, 2, &s) == KV_OK);
        int64_t dshape[3] = {2048, 8, 2}, dstr[3] = {8 * 2 + 6, 2, 1};
        CHECK(kv_view_init(h_src, pool_bytes, KV_F32, 3, dshape, &d) == KV_OK);
        CHECK(kv_view_as_strided(&d, 3, dshape, dstr, 10, &d) == KV_OK);
        run_case("f32 token step (vec8)", &s, &d, d_src, d_dst, pool_bytes, h_src, PATH(vec8));
    }
    { /* a 2-D transpose: rows are not contiguous on the src side */
        int64_t shape[2] = {1000, 1500};
        CHECK(kv_view_init(h_src, pool_bytes, KV_F32, 2, shape, &t) == KV_OK);
        CHECK(kv_view_transpose(&t, 0, 1, &s) == KV_OK);
        int64_t dshape[2] = {1500, 1000};
        CHECK(kv_view_init(h_src, pool_bytes, KV_F32, 2, dshape, &d) == KV_OK);
        run_case("f32 transpose (strided)", &s, &d, d_src, d_dst, pool_bytes, h_src, PATH(strided));
    }
    { /* u8 with odd rows: 1-byte vectors */
        int64_t shape[2] = {3001, 7};
        CHECK(kv_view_init(h_src, pool_bytes, KV_U8, 2, shape, &s) == KV_OK);
        int64_t dstr[2] = {9, 1};
        CHECK(kv_view_as_strided(&s, 2, shape, dstr, 3, &d) == KV_OK);
        run_case("u8 odd rows (vec1)", &s, &d, d_src, d_dst, pool_bytes, h_src, PATH(vec1));
    }
    bench_permute();
    cudaFree(d_src);
    cudaFree(d_dst);
    free(h_src);
    return 0;
}
