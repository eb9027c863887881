/* gpu_test.h - what the GPU test programs share: the abort-on-failure
 * check, a seeded generator, the whole-pool comparison. */
#ifndef GPU_TEST_H
#define GPU_TEST_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>

#include <kvcache/kv.h>

#define CHECK(c)                                                                                   \
    do {                                                                                           \
        if (!(c)) {                                                                                \
            fprintf(stderr, "FAIL %s:%d: %s (%s)\n", __FILE__, __LINE__, #c, kv_last_error());     \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

/* splitmix64: the next value of the sequence seeded by *s */
static inline uint64_t gpu_rnd(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* A float in [-1, 1] in steps of 0.001. */
static inline float gpu_frand(uint64_t *s)
{
    return (float)((double)(gpu_rnd(s) % 2001) / 1000.0 - 1.0);
}

/* After the device is idle: copy the n bytes at dev (device or pinned) into
 * back and compare the whole pool with want, the CPU reference; on the first
 * differing byte print it ("what", "ref" name the case and the reference)
 * and exit 1. */
static inline void gpu_pool_same(const void *dev, unsigned char *back, const unsigned char *want,
                                 size_t n, const char *what, const char *ref)
{
    CHECK(cudaDeviceSynchronize() == cudaSuccess);
    CHECK(cudaMemcpy(back, dev, n, cudaMemcpyDefault) == cudaSuccess);
    if (memcmp(back, want, n) != 0) {
        size_t i = 0;
        while (back[i] == want[i])
            i++;
        fprintf(stderr, "FAIL %s: pool byte %zu (of %zu) is 0x%02x, %s's 0x%02x\n", what, i, n,
                back[i], ref, want[i]);
        exit(1);
    }
}

#endif /* GPU_TEST_H */
