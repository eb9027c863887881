/*
 * test_gpu_arena.c - runs only where a GPU exists (scripts/gpu-check.sh):
 * pinned and device arenas are really allocated, written and read back,
 * zero-fill of a pinned arena is checked byte by byte, regions are reported,
 * and creating a device arena leaves the caller's current device alone.
 */
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_test.h"
#include <kvcache/kv.h>

int main(void)
{
    const size_t bytes = (size_t)64 << 20;
    struct kv_arena_config cfg = {.struct_size = sizeof(struct kv_arena_config),
                                  .kind = KV_MEM_PINNED,
                                  .size_bytes = bytes,
                                  .flags = KV_ARENA_ZERO};
    struct kv_mem_region r;
    size_t n = 0;
    kv_arena *a = NULL;
    int devs = 0, before = -1, after = -1;
    unsigned char *host = malloc(bytes);

    if (cudaGetDeviceCount(&devs) != cudaSuccess || devs == 0) {
        printf("no GPU: skipped\n");
        return 77;
    }
    /* pinned, zero-filled: every byte 0, then writable from the host */
    CHECK(kv_arena_create(&cfg, &a) == KV_OK);
    CHECK(kv_arena_size(a) >= bytes);
    for (size_t i = 0; i < bytes; i++)
        CHECK(((unsigned char *)kv_arena_base(a))[i] == 0);
    memset(kv_arena_base(a), 0x3C, bytes);
    CHECK(kv_arena_regions(a, &r, 1, &n) == KV_OK && n == 1 && r.kind == KV_MEM_PINNED);
    CHECK(r.ptr == kv_arena_base(a) && r.bytes >= bytes);
    kv_arena_destroy(a);

    /* device: written with cudaMemset, read back through cudaMemcpy */
    cfg.kind = KV_MEM_DEVICE;
    cfg.flags = 0;
    cfg.device = devs - 1;
    cudaGetDevice(&before);
    CHECK(kv_arena_create(&cfg, &a) == KV_OK);
    cudaGetDevice(&after);
    CHECK(before == after); /* the caller's current device is unchanged */
    CHECK(cudaMemset(kv_arena_base(a), 0xA5, bytes) == cudaSuccess);
    CHECK(cudaMemcpy(host, kv_arena_base(a), bytes, cudaMemcpyDeviceToHost) == cudaSuccess);
    for (size_t i = 0; i < bytes; i++)
        CHECK(host[i] == 0xA5);
    CHECK(kv_arena_regions(a, &r, 1, &n) == KV_OK && r.kind == KV_MEM_DEVICE &&
          r.device == devs - 1);
    kv_arena_destroy(a);
    cudaGetDevice(&after);
    CHECK(before == after);

    /* zero-fill of device memory is refused, not silently skipped */
    cfg.flags = KV_ARENA_ZERO;
    CHECK(kv_arena_create(&cfg, &a) == KV_ERR_UNSUPPORTED);
    free(host);
    printf("gpu arena: pinned (zeroed, %zu bytes) and device arenas OK\n", bytes);
    return 0;
}
