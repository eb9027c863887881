/*
 * kv_grid_hd.h - what a CUDA kernel body sees of its launch, on the GPU and
 * in the CPU grid emulator (kv_grid.c): one source for both.
 *
 * Every CUDA kernel of the library is a per-thread body, a KV_HD function
 * taking `const struct kv_grid_ctx *` first, plus a thin __global__ wrapper
 * that fills the context from the built-ins and calls the body. The tests
 * run the same body over every (block, thread) of a launch on the CPU
 * (kv__grid_run), so the code a GPU runs is tested on every CI run.
 *
 *   body reads            on the GPU               in the emulator
 *   c->block, c->thread   blockIdx.x, threadIdx.x  the (block, thread) it runs
 *   c->block_dim, grid    blockDim.x, gridDim.x    the launch's
 *   c->shared             extern __shared__        shared_bytes per block,
 *                                                  garbage-filled, guarded
 *   kv_grid_sync          __syncthreads()          every thread of the block
 *                                                  meets there (fibers), at
 *                                                  the same call (file:line)
 *   kv_grid_syncwarp      __syncwarp()             the 32 lanes meet
 *   kv_grid_warp_sum      xor-butterfly of         the same butterfly over
 *                         __shfl_xor_sync          the emulated lanes, in the
 *                                                  same order (same floats)
 *   kv_grid_warp_max      the same butterfly with  the same, with fmaxf
 *                         fmaxf
 *   kv_grid_shfl_xor      __shfl_xor_sync, full    every lane gets the value
 *                         mask, width 32           of lane ^ mask; a mask
 *                                                  outside 1..31 is a fault
 *   kv_grid_move          one V load + store       memcpy, refused (a fault)
 *                         (16/8/4/2/1 bytes)       unless both aligned to V
 *   kv_grid_expf          __expf                   expf
 *   kv_grid_error_record  atomicAdd, atomicMax     __atomic add, CAS loop;
 *                         (64-bit)                 refused (a fault) unless
 *                                                  both 8-byte aligned
 *
 * The emulator is at least as strict as the GPU: it refuses a launch CUDA
 * refuses (block size 0 or > 1024, grid size 0 or > 2^31 - 1, dynamic
 * shared memory > 48 KiB without opt-in, which no kernel here takes: no
 * launcher sets cudaFuncAttributeMaxDynamicSharedMemorySize, and the
 * launchers cap their shared memory at KV__SHARED_MAX, 48 KiB), and it
 * reports as a fault what is undefined on the GPU: a barrier some threads
 * of the block skip (or reach after others exited), threads of a block at
 * different barriers (the CUDA guide: __syncthreads in conditional code
 * only where the condition is the same across the block), a warp operation
 * not all 32 lanes reach together (partial warps included), a misaligned
 * vector access, a misaligned 64-bit atomic, a write past the end of or
 * before the block's dynamic shared memory (a guard of 256 bytes each
 * side, checked after the block), and a barrier in a kernel launched as
 * barrier-free. A launch without dynamic shared memory gets c->shared NULL,
 * as the wrappers pass it (any access faults: a crash, SIGSEGV).
 *
 * Not modeled (a kernel can pass here and fail on a GPU):
 *   - launches: only 1-D (x), every kernel here (the limits on y and z,
 *     65535 blocks and 1024 / 64 threads, cannot be reached); registers and
 *     __launch_bounds__ ("too many resources requested for launch"), static
 *     __shared__ (none here: all shared memory is the dynamic kind);
 *   - shared memory: reads of never-written bytes are not refused, they
 *     read 0xFF bytes (a NaN as float, -1 as an integer: a result shows
 *     it); reads outside the block's memory are not refused (its guard
 *     bytes, or host memory); writes beyond the 256-byte guards are not
 *     seen (under AddressSanitizer, host memory errors are);
 *   - races: threads run in a fixed order (thread 0 first), so a missing
 *     barrier shows only where the fixed order reads a not-yet-written
 *     (0xFF) value; global-memory races between threads or blocks are not
 *     seen;
 *   - plain typed loads and stores of a body (not kv_grid_move): their
 *     alignment is checked only by UndefinedBehaviorSanitizer builds
 *     (SANITIZE=undefined, -fsanitize=alignment);
 *   - warp operations from different calls (sites) in the same warp: legal
 *     on sm_70 and later (the targets here: sm_80, sm_90), so matched;
 *     __syncwarp and shuffles with a partial mask do not exist here.
 */
#ifndef KV_GRID_HD_H
#define KV_GRID_HD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kv_status.h"
#include "kv_view_hd.h"

#if !defined(__CUDA_ARCH__)
#include <math.h>
#endif

#define KV_GRID_MAX_BLOCK 1024u               /* threads per block */
#define KV_GRID_MAX_GRID 2147483647u          /* blocks, x */
#define KV_GRID_MAX_SHARED ((size_t)48 << 10) /* dynamic shared bytes, no opt-in */
#define KV_GRID_WARP 32u

/* One thread's view of its launch (1-D). emu: the emulator's state, NULL on
 * the GPU. */
struct kv_grid_ctx {
    uint32_t block, thread;       /* blockIdx.x, threadIdx.x */
    uint32_t block_dim, grid_dim; /* blockDim.x, gridDim.x */
    void *shared;                 /* the block's dynamic shared memory */
    void *emu;
};

#if !defined(__CUDA_ARCH__)
#ifdef __cplusplus
extern "C" {
#endif
/* The emulator's side of the synchronizing operations (kv_grid.c). */
void kv__grid_sync(const struct kv_grid_ctx *c, const char *site);
void kv__grid_syncwarp(const struct kv_grid_ctx *c);
float kv__grid_warp_sum(const struct kv_grid_ctx *c, float x);
float kv__grid_shfl_xor(const struct kv_grid_ctx *c, float x, int mask);
float kv__grid_warp_max(const struct kv_grid_ctx *c, float x);
void kv__grid_fault(const struct kv_grid_ctx *c, const char *what, uint64_t a, uint64_t b);
/* A fault of the thread the emulator runs on this host thread (for the
 * operations that take no context: the atomics); nothing outside a launch. */
void kv__grid_fault_here(const char *what, uint64_t a, uint64_t b);

/* A 1-D launch: grid blocks of block threads, shared_bytes of dynamic
 * shared memory per block; barriers: whether the body synchronizes
 * (kv_grid_sync, kv_grid_syncwarp, kv_grid_warp_sum, kv_grid_warp_max): its threads then run
 * as fibers that meet at each barrier, else one after another. */
struct kv_grid_launch {
    uint64_t grid, block;
    size_t shared_bytes;
    bool barriers;
};

/* Run body(ctx, arg) for every (block, thread) of the launch on the CPU,
 * block after block. KV_ERR_INVALID_ARG for a launch CUDA refuses (naming
 * the value and the limit), KV_ERR_DEVICE for the first fault of the body
 * (which one, block, thread and the values; the launch stops there), else
 * KV_OK. fn names the caller in messages. Thread-safe: the state is per
 * call (and per host thread), so launches on different threads are
 * independent. */
kv_status kv__grid_run(const char *fn, const struct kv_grid_launch *l,
                       void (*body)(const struct kv_grid_ctx *c, const void *arg), const void *arg);
#ifdef __cplusplus
}
#endif
#endif

/* __syncthreads(): every thread of the block, none skipping it, all at the
 * same barrier. In the emulator (host code) a macro, so that each call
 * names its site (file:line): threads meeting at different barriers (one
 * branch's and the other's, a loop's and the one after it) are a fault. */
#if defined(__CUDA_ARCH__)
KV_HD void kv_grid_sync(const struct kv_grid_ctx *c)
{
    (void)c;
    __syncthreads();
}
#else
#define KV__GRID_STR2(x) #x
#define KV__GRID_STR(x) KV__GRID_STR2(x)
#define kv_grid_sync(c) kv__grid_sync((c), __FILE__ ":" KV__GRID_STR(__LINE__))
#endif

/* __syncwarp(): all 32 lanes of the warp. */
KV_HD void kv_grid_syncwarp(const struct kv_grid_ctx *c)
{
#if defined(__CUDA_ARCH__)
    (void)c;
    __syncwarp();
#else
    kv__grid_syncwarp(c);
#endif
}

/* The sum of x over the 32 lanes of the warp, in every lane: the butterfly
 * x += shfl_xor(x, o), o = 16, 8, 4, 2, 1 (the emulator adds in the same
 * order, so it gets the GPU's floats). */
KV_HD float kv_grid_warp_sum(const struct kv_grid_ctx *c, float x)
{
#if defined(__CUDA_ARCH__)
    (void)c;
    for (int o = 16; o > 0; o >>= 1)
        x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
#else
    return kv__grid_warp_sum(c, x);
#endif
}

/* __shfl_xor_sync(0xffffffff, x, mask): x of lane (lane ^ mask), all 32
 * lanes taking part (mask 1..31; the emulator refuses others). */
KV_HD float kv_grid_shfl_xor(const struct kv_grid_ctx *c, float x, int mask)
{
#if defined(__CUDA_ARCH__)
    (void)c;
    return __shfl_xor_sync(0xffffffffu, x, mask);
#else
    return kv__grid_shfl_xor(c, x, mask);
#endif
}

/* The maximum of x over the 32 lanes of the warp, in every lane: the
 * butterfly x = fmaxf(x, shfl_xor(x, o)), o = 16, 8, 4, 2, 1 (exact: the
 * emulator's result is the GPU's). The rules of kv_grid_warp_sum: all 32
 * lanes, none diverging. */
KV_HD float kv_grid_warp_max(const struct kv_grid_ctx *c, float x)
{
#if defined(__CUDA_ARCH__)
    (void)c;
    for (int o = 16; o > 0; o >>= 1)
        x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
#else
    return kv__grid_warp_max(c, x);
#endif
}

/* One aligned vector move of `bytes` (16, 8, 4, 2 or 1) from src to dst. */
KV_HD void kv_grid_move(const struct kv_grid_ctx *c, void *dst, const void *src, int bytes)
{
#if defined(__CUDA_ARCH__)
    (void)c;
    switch (bytes) {
    case 16:
        *(uint4 *)dst = *(const uint4 *)src;
        break;
    case 8:
        *(uint2 *)dst = *(const uint2 *)src;
        break;
    case 4:
        *(uint32_t *)dst = *(const uint32_t *)src;
        break;
    case 2:
        *(uint16_t *)dst = *(const uint16_t *)src;
        break;
    default:
        *(uint8_t *)dst = *(const uint8_t *)src;
        break;
    }
#else
    if ((((uintptr_t)dst | (uintptr_t)src) & (uintptr_t)(bytes - 1)) != 0) {
        kv__grid_fault(
            c, "misaligned vector access (address, bytes)",
            (uint64_t)(((uintptr_t)dst & (uintptr_t)(bytes - 1)) ? (uintptr_t)dst : (uintptr_t)src),
            (uint64_t)bytes);
        return;
    }
    memcpy(dst, src, (size_t)bytes);
#endif
}

/* __expf on the GPU (fast, approximate), expf in the emulator. */
KV_HD float kv_grid_expf(float x)
{
#if defined(__CUDA_ARCH__)
    return __expf(x);
#else
    return expf(x);
#endif
}

/* A device error record (struct kv_attn_cuda_errors, kv_plan_cuda_errors):
 * count the invalid index (array, index), and keep the first (lowest array,
 * then index) as *first_key = ~(array << 56 | index), so that 0 means none
 * and atomicMax keeps the first. */
KV_HD void kv_grid_error_record(uint64_t *count, uint64_t *first_key, int array, int64_t index)
{
    const uint64_t key = ~(((uint64_t)array << 56) | (uint64_t)index);
#if defined(__CUDA_ARCH__)
    atomicAdd((unsigned long long *)count, 1ull);
    atomicMax((unsigned long long *)first_key, (unsigned long long)key);
#else
    /* atomicAdd / atomicMax on 64 bits: the address naturally aligned (8),
     * else a misaligned-address fault on the GPU */
    if ((((uintptr_t)count | (uintptr_t)first_key) & 7u) != 0) {
        kv__grid_fault_here(
            "misaligned 64-bit atomic (address, bytes)",
            (uint64_t)(((uintptr_t)count & 7u) ? (uintptr_t)count : (uintptr_t)first_key), 8);
        return;
    }
    __atomic_fetch_add(count, 1, __ATOMIC_RELAXED);
    uint64_t cur = __atomic_load_n(first_key, __ATOMIC_RELAXED);
    while (key > cur && !__atomic_compare_exchange_n(first_key, &cur, key, false, __ATOMIC_RELAXED,
                                                     __ATOMIC_RELAXED)) {
    }
#endif
}

/* The index of a non-zero first_key, and its array in *array. */
KV_HD int64_t kv_grid_error_first(uint64_t first_key, int *array)
{
    const uint64_t k = ~first_key;
    *array = (int)(k >> 56);
    return (int64_t)(k & ((1ull << 56) - 1));
}

#endif /* KV_GRID_HD_H */
