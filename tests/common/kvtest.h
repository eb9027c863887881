/*
 * kvtest.h - small helpers shared by the cmocka suites.
 */
#ifndef KVTEST_H
#define KVTEST_H

#include <stdbool.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <kvcache/kv.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#endif

#ifndef KV_TEST_DATA_DIR
#define KV_TEST_DATA_DIR "tests/data"
#endif

/* Fail unless the library's last error message contains needle (a macro:
 * cmocka's fail_msg is in scope where it is used). */
#define kvt_assert_msg_has(needle)                                                                 \
    do {                                                                                           \
        if (!strstr(kv_last_error(), (needle)))                                                    \
            fail_msg("last error '%s' lacks '%s'", kv_last_error(), (needle));                     \
    } while (0)

/* Deterministic PRNG (splitmix64) so a failing case can be replayed. */
static inline uint64_t kvt_rand(uint64_t *state)
{
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* n random bytes from seed into p, eight per kvt_rand. */
static inline void kvt_fill(void *p, size_t n, uint64_t seed)
{
    unsigned char *b = p;
    uint64_t s = seed;
    for (size_t i = 0; i < n; i += 8) {
        const uint64_t v = kvt_rand(&s);
        memcpy(b + i, &v, n - i < 8 ? n - i : 8);
    }
}

/* The n uint32 values of src copied one byte into buf (which holds at least
 * 1 + 4 n bytes and is uint32-aligned): an array misaligned for its
 * elements, for the refusal tests. */
static inline const uint32_t *kvt_misaligned_u32(char *buf, const uint32_t *src, size_t n)
{
    memcpy(buf + 1, src, n * sizeof(*src));
    return (const uint32_t *)(void *)(buf + 1);
}

/* Whether every page of [p, p + n) is mapped now (mincore refuses an
 * unmapped page with ENOMEM). An unmapped-range refusal test that sees its
 * call succeed asks this: another thread (a progress thread, the
 * sanitizer's allocator) may have mapped the freed range again, which is a
 * reason to retry, not a pass. */
static inline bool kvt_range_mapped(const void *p, size_t n)
{
    const uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE);
    unsigned char vec;
    for (uintptr_t a = (uintptr_t)p & ~(pg - 1); a < (uintptr_t)p + n; a += pg)
        if (mincore((void *)a, pg, &vec) != 0)
            return false;
    return true;
}

/* Uniform in [lo, hi]. */
static inline int64_t kvt_range(uint64_t *state, int64_t lo, int64_t hi)
{
    return lo + (int64_t)(kvt_rand(state) % (uint64_t)(hi - lo + 1));
}

/* Element offset of (layer l, kv, block b, token n, head h, d) computed from
 * the CONFIG alone, the way docs/kv-layout.md describes it, never from the
 * strides kv_layout_init derived: tests check cache data through it, so a
 * wrong stride in the library cannot agree with itself.
 *   storage block   layer-major (l * planes + plane) * B + b
 *                   block-major (b * L + l) * planes + plane
 *   in the block    NHD (n * H + h) * row + d, HND (h * N + n) * row + d,
 *                   row = D (2D packed, V at +D), plane = packed ? 0 : kv
 *   block stride    block_stride_bytes / elem, or N * H * row + pad */
int64_t kvt_ref_offset_elems(const struct kv_layout_config *c, int64_t l, int64_t kv, int64_t b,
                             int64_t n, int64_t h, int64_t d);

/* Whether this CPU has AVX2, FMA and F16C (CPUID leaf 1, ECX bit 29): the
 * kernels' AVX2 paths, checked independently of the library. */
static inline bool kvt_cpu_has_avx2(void)
{
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    unsigned a, b, c, d;
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29));
#else
    return false;
#endif
}

/* Whether this CPU runs VDPBF16PS (AVX512_BF16 with AVX-512F/BW/VL): the
 * kernels' bf16 dot-product scores, checked independently of the library. */
static inline bool kvt_cpu_has_bf16dot(void)
{
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
#else
    return false;
#endif
}

/* Whether this CPU has AVX512_VBMI (with AVX512_BF16: the decode's fp8 rows
 * converted to bf16 by byte-table lookups). */
static inline bool kvt_cpu_has_vbmi(void)
{
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vbmi");
#else
    return false;
#endif
}

/* Path of a file under tests/data (env KV_TEST_DATA_DIR overrides). */
const char *kvt_data_path(const char *name);

/* Field-by-field comparison of the library's structs: "" when a and b hold
 * the same values, else the first field that differs with both values
 * ("shape[2]: 3 vs 4 (0x3 vs 0x4)"), in a per-thread buffer that the next
 * call overwrites. Use as assert_string_equal(kvt_view_diff(&a, &b), "").
 * Never memcmp a struct: its padding bytes are indeterminate (a struct
 * assignment or an initializer need not copy or clear them), so such a test
 * passes or fails with the compiler, its flags and the stack's history.
 * scripts/check-test-compares.py refuses it in tests/. */
const char *kvt_view_diff(const struct kv_view *a, const struct kv_view *b);
const char *kvt_layout_diff(const struct kv_layout *a, const struct kv_layout *b);
const char *kvt_layout_config_diff(const struct kv_layout_config *a,
                                   const struct kv_layout_config *b);
const char *kvt_arena_config_diff(const struct kv_arena_config *a, const struct kv_arena_config *b);
const char *kvt_block_pool_stats_diff(const struct kv_block_pool_stats *a,
                                      const struct kv_block_pool_stats *b);
const char *kvt_offload_stats_diff(const struct kv_offload_stats *a,
                                   const struct kv_offload_stats *b);

#endif /* KVTEST_H */
