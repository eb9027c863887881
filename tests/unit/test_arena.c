/*
 * test_arena.c - allocator/kv_arena: host arenas (alignment, rounding, zero
 * fill, regions), bad configs, and the pinned/device kinds, which on a host
 * without a usable GPU must fail with KV_ERR_UNSUPPORTED and say why.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include <kvcache/kv.h>

#include "kv_mem.h"
#include "kv_arena.h"

#define MIB ((size_t)1 << 20)

/* Whether this kernel offers transparent huge pages at all, read from sysfs
 * independently of the library: madvise(MADV_HUGEPAGE) is accepted exactly
 * when the THP control file exists (CONFIG_TRANSPARENT_HUGEPAGE). */
static bool kernel_has_thp(void)
{
    FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
    if (!f)
        return false;
    fclose(f);
    return true;
}

/* Whether a GPU is expected: set by the runner (scripts/gpu-check.sh sets
 * KV_EXPECT_GPU=1), never inferred from the call under test. */
static bool gpu_expected(void)
{
    const char *e = getenv("KV_EXPECT_GPU");
    return e && e[0] == '1';
}

static void test_arena_host_small_alignment(void **state)
{
    (void)state;
    struct kv_arena_config cfg = KV_ARENA_CONFIG_INIT(1000);
    kv_arena *a = NULL;
    assert_int_equal(kv_arena_create(&cfg, &a), KV_OK);
    assert_non_null(a);
    assert_int_equal(kv_arena_kind(a), KV_MEM_HOST);
    assert_int_equal(kv_arena_align(a), 64);
    assert_int_equal((uintptr_t)kv_arena_base(a) % 64, 0);
    assert_true(kv_arena_size(a) >= 1000);
    assert_int_equal(kv_arena_size(a) % 64, 0);
    assert_false(kv_arena_huge_pages(a)); /* below one huge page: no hint */
    /* Every byte is ours. */
    memset(kv_arena_base(a), 0x5a, kv_arena_size(a));
    assert_int_equal(((unsigned char *)kv_arena_base(a))[kv_arena_size(a) - 1], 0x5a);
    kv_arena_destroy(a);
}

static void test_arena_host_large_is_huge_page_aligned(void **state)
{
    (void)state;
    struct kv_arena_config cfg = KV_ARENA_CONFIG_INIT(4 * MIB + 1);
    kv_arena *a = NULL;
    assert_int_equal(kv_arena_create(&cfg, &a), KV_OK);
    assert_int_equal(kv_arena_align(a), 2 * MIB);
    assert_int_equal((uintptr_t)kv_arena_base(a) % (2 * MIB), 0);
    /* Rounded up to whole huge pages. */
    assert_int_equal(kv_arena_size(a), 6 * MIB);
    /* The hint is taken exactly where the kernel has THP (decided above from
     * sysfs, not from the arena's answer). */
    printf("# huge page hint accepted: %d (%s)\n", (int)kv_arena_huge_pages(a), kv__mem_backend());
    assert_int_equal(kv_arena_huge_pages(a), kernel_has_thp());
    memset(kv_arena_base(a), 1, kv_arena_size(a));
    kv_arena_destroy(a);
}

static void test_arena_host_explicit_alignment(void **state)
{
    (void)state;
    struct kv_arena_config cfg = KV_ARENA_CONFIG_INIT(10000);
    kv_arena *a = NULL;
    cfg.align_bytes = 4096;
    assert_int_equal(kv_arena_create(&cfg, &a), KV_OK);
    assert_int_equal(kv_arena_align(a), 4096);
    assert_int_equal((uintptr_t)kv_arena_base(a) % 4096, 0);
    assert_int_equal(kv_arena_size(a), 12288);
    kv_arena_destroy(a);
}

/* A small align_bytes never lowers the default: a large arena keeps its
 * 2 MiB alignment (and its huge pages); a larger one raises it. */
static void test_arena_alignment_only_raises(void **state)
{
    (void)state;
    struct kv_arena_config cfg = KV_ARENA_CONFIG_INIT(4 * MIB);
    kv_arena *a = NULL;
    cfg.align_bytes = 128;
    assert_int_equal(kv_arena_create(&cfg, &a), KV_OK);
    assert_int_equal(kv_arena_align(a), 2 * MIB);
    assert_int_equal((uintptr_t)kv_arena_base(a) % (2 * MIB), 0);
    assert_int_equal(kv_arena_huge_pages(a), kernel_has_thp());
    kv_arena_destroy(a);
    cfg.align_bytes = 4 * MIB;
    assert_int_equal(kv_arena_create(&cfg, &a), KV_OK);
    assert_int_equal(kv_arena_align(a), 4 * MIB);
    assert_int_equal((uintptr_t)kv_arena_base(a) % (4 * MIB), 0);
    kv_arena_destroy(a);
}

/* A host arena larger than physical memory is refused at once, naming both
 * sizes (overcommit would have granted it). */
static void test_arena_larger_than_memory_is_refused(void **state)
{
    (void)state;
    const uint64_t phys = (uint64_t)sysconf(_SC_PHYS_PAGES) * (uint64_t)sysconf(_SC_PAGESIZE);
    struct kv_arena_config cfg = KV_ARENA_CONFIG_INIT((size_t)phys + 2 * MIB);
    kv_arena *a = NULL;
    char want[64];
    assert_int_equal(kv_arena_create(&cfg, &a), KV_ERR_NO_MEMORY);
    assert_null(a);
    snprintf(want, sizeof(want), "%llu bytes of physical memory", (unsigned long long)phys);
    assert_non_null(strstr(kv_last_error(), want));
    /* 64 bytes at an alignment past the machine map the alignment (was
     * checked before rounding: a 2^40-byte arena granted) */
    size_t big = 1;
    while (big <= phys)
        big <<= 1;
    cfg.size_bytes = 64;
    cfg.align_bytes = big;
    assert_int_equal(kv_arena_create(&cfg, &a), KV_ERR_NO_MEMORY);
    assert_null(a);
    snprintf(want, sizeof(want), "size_bytes 64 rounded up to align_bytes %zu", big);
    assert_non_null(strstr(kv_last_error(), want));
}

static void test_arena_zero_flag_zeroes(void **state)
{
    (void)state;
    struct kv_arena_config cfg = KV_ARENA_CONFIG_INIT(3 * MIB);
    kv_arena *a = NULL;
    cfg.flags = KV_ARENA_ZERO;
    assert_int_equal(kv_arena_create(&cfg, &a), KV_OK);
    const unsigned char *p = kv_arena_base(a);
    size_t nonzero = 0;
    for (size_t i = 0; i < kv_arena_size(a); i++)
        nonzero += p[i] != 0;
    assert_int_equal(nonzero, 0);
    kv_arena_destroy(a);
}

static void test_arena_regions_report_the_arena(void **state)
{
    (void)state;
    struct kv_arena_config cfg = KV_ARENA_CONFIG_INIT(2 * MIB);
    struct kv_mem_region r[2];
    size_t n = 99;
    kv_arena *a = NULL;
    assert_int_equal(kv_arena_create(&cfg, &a), KV_OK);

    /* Count query. */
    assert_int_equal(kv_arena_regions(a, NULL, 0, &n), KV_OK);
    assert_int_equal(n, 1);
    /* Too small a buffer: error, count still reported. */
    n = 0;
    assert_int_equal(kv_arena_regions(a, r, 0, &n), KV_ERR_INVALID_ARG);
    assert_int_equal(n, 1);
    assert_non_null(strstr(kv_last_error(), "cap 0"));
    /* NULL out with a capacity. */
    assert_int_equal(kv_arena_regions(a, NULL, 2, &n), KV_ERR_NULL);
    assert_int_equal(kv_arena_regions(a, r, 2, NULL), KV_ERR_NULL);

    memset(r, 0, sizeof(r));
    assert_int_equal(kv_arena_regions(a, r, 2, &n), KV_OK);
    assert_int_equal(n, 1);
    assert_ptr_equal(r[0].ptr, kv_arena_base(a));
    assert_int_equal(r[0].bytes, kv_arena_size(a));
    assert_int_equal(r[0].kind, KV_MEM_HOST);
    assert_int_equal(r[0].device, -1);
    assert_null(r[1].ptr); /* nothing written past the count */
    kv_arena_destroy(a);
}

/* References: the creator's destroy and the retained ones drop in any
 * order; the last frees (under ASan, a write after an early free is
 * reported, and a missed free is a leak). */
static void test_arena_references_in_any_order(void **state)
{
    (void)state;
    for (int order = 0; order < 2; order++) {
        kv_arena *a = NULL;
        assert_int_equal(kv_arena_create(&KV_ARENA_CONFIG_INIT(1u << 16), &a), KV_OK);
        unsigned char *p = kv_arena_base(a);
        assert_ptr_equal(kv_arena_retain(a), a);
        assert_ptr_equal(kv_arena_retain(a), a);
        if (order == 0) {
            kv_arena_destroy(a);
            kv_arena_release(a);
        } else {
            kv_arena_release(a);
            kv_arena_release(a);
        }
        memset(p, 0x33, 1u << 16); /* one reference left: still mapped */
        assert_int_equal(p[(1u << 16) - 1], 0x33);
        assert_int_equal(kv_arena_size(a), 1u << 16);
        if (order == 0)
            kv_arena_release(a);
        else
            kv_arena_destroy(a);
    }
    assert_null(kv_arena_retain(NULL));
    kv_arena_release(NULL);
}

static void test_arena_zero_size_is_refused(void **state)
{
    (void)state;
    struct kv_arena_config cfg = KV_ARENA_CONFIG_INIT(0);
    kv_arena *a = (kv_arena *)&cfg; /* sentinel: must stay untouched */
    assert_int_equal(kv_arena_create(&cfg, &a), KV_ERR_INVALID_ARG);
    assert_ptr_equal(a, (kv_arena *)&cfg);
    assert_non_null(strstr(kv_last_error(), "size_bytes is 0"));
}

static void test_arena_bad_kind_is_refused(void **state)
{
    (void)state;
    struct kv_arena_config cfg = KV_ARENA_CONFIG_INIT(4096);
    kv_arena *a = NULL;
    cfg.kind = (enum kv_mem_kind)7;
    assert_int_equal(kv_arena_create(&cfg, &a), KV_ERR_INVALID_ARG);
    assert_null(a);
    assert_non_null(strstr(kv_last_error(), "unknown kind 7"));
    assert_string_equal(kv_mem_kind_name((enum kv_mem_kind)7), "unknown");
    assert_string_equal(kv_mem_kind_name(KV_MEM_PINNED), "pinned");
}

static void test_arena_bad_alignment_and_flags_are_refused(void **state)
{
    (void)state;
    struct kv_arena_config cfg = KV_ARENA_CONFIG_INIT(4096);
    kv_arena *a = NULL;
    cfg.align_bytes = 96;
    assert_int_equal(kv_arena_create(&cfg, &a), KV_ERR_INVALID_ARG);
    assert_non_null(strstr(kv_last_error(), "align_bytes 96"));
    cfg.align_bytes = 4;
    assert_int_equal(kv_arena_create(&cfg, &a), KV_ERR_INVALID_ARG);
    cfg.align_bytes = 0;
    cfg.flags = 0x80;
    assert_int_equal(kv_arena_create(&cfg, &a), KV_ERR_INVALID_ARG);
    assert_non_null(strstr(kv_last_error(), "0x80"));
    assert_null(a);
}

static void test_arena_size_overflow_is_refused(void **state)
{
    (void)state;
    struct kv_arena_config cfg = KV_ARENA_CONFIG_INIT(SIZE_MAX - 10);
    kv_arena *a = NULL;
    assert_int_equal(kv_arena_create(&cfg, &a), KV_ERR_OVERFLOW);
    assert_null(a);
}

static void test_arena_null_args(void **state)
{
    (void)state;
    struct kv_arena_config cfg = KV_ARENA_CONFIG_INIT(64);
    kv_arena *a = NULL;
    assert_int_equal(kv_arena_create(NULL, &a), KV_ERR_NULL);
    assert_int_equal(kv_arena_create(&cfg, NULL), KV_ERR_NULL);
    kv_arena_destroy(NULL); /* no-op */
    assert_null(kv_arena_base(NULL));
    assert_int_equal(kv_arena_size(NULL), 0);
}

/* Pinned/device: a real allocation where the runner says a GPU exists
 * (KV_EXPECT_GPU=1, scripts/gpu-check.sh); otherwise KV_ERR_UNSUPPORTED with
 * the reason this build gives: no CUDA compiled in, or no usable device. */
static void check_cuda_kind(enum kv_mem_kind kind)
{
    struct kv_arena_config cfg = KV_ARENA_CONFIG_INIT(3 * MIB);
    kv_arena *a = NULL;
    kv_status s;
    cfg.kind = kind;
    s = kv_arena_create(&cfg, &a);
    if (gpu_expected()) {
        assert_int_equal(s, KV_OK);
        struct kv_mem_region r;
        size_t n;
        printf("# %s arena allocated: a GPU is present\n", kv_mem_kind_name(kind));
        assert_int_equal(kv_arena_regions(a, &r, 1, &n), KV_OK);
        assert_int_equal(r.kind, kind);
        assert_int_equal(r.bytes, 3 * MIB);
        assert_int_equal(r.device, kind == KV_MEM_DEVICE ? 0 : -1);
        assert_int_equal((uintptr_t)r.ptr % 256, 0);
        kv_arena_destroy(a);
        /* A larger alignment is honoured too. */
        cfg.align_bytes = (size_t)1 << 16;
        assert_int_equal(kv_arena_create(&cfg, &a), KV_OK);
        assert_int_equal((uintptr_t)kv_arena_base(a) % cfg.align_bytes, 0);
        assert_int_equal(kv_arena_size(a), 3 * MIB);
        kv_arena_destroy(a);
        return;
    }
    assert_int_equal(s, KV_ERR_UNSUPPORTED);
    assert_null(a);
    printf("# %s: %s\n", kv_mem_kind_name(kind), kv_last_error());
    /* The message says why: no CUDA in the build, or the runtime's error. */
    assert_non_null(strstr(kv_last_error(), KV_HAVE_CUDA ? "no usable CUDA device"
                                                         : "this build has no CUDA support"));
    assert_non_null(strstr(kv_last_error(), "3145728 bytes"));
}

static void test_arena_pinned_without_gpu_is_unsupported(void **state)
{
    (void)state;
    check_cuda_kind(KV_MEM_PINNED);
}

static void test_arena_device_without_gpu_is_unsupported(void **state)
{
    (void)state;
    check_cuda_kind(KV_MEM_DEVICE);
}

static void test_arena_device_zero_flag_is_unsupported(void **state)
{
    (void)state;
    struct kv_arena_config cfg = KV_ARENA_CONFIG_INIT(4096);
    kv_arena *a = NULL;
    cfg.kind = KV_MEM_DEVICE;
    cfg.flags = KV_ARENA_ZERO;
    assert_int_equal(kv_arena_create(&cfg, &a), KV_ERR_UNSUPPORTED);
    assert_non_null(strstr(kv_last_error(), "KV_ARENA_ZERO"));
    assert_null(a);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_arena_host_small_alignment),
        cmocka_unit_test(test_arena_host_large_is_huge_page_aligned),
        cmocka_unit_test(test_arena_host_explicit_alignment),
        cmocka_unit_test(test_arena_alignment_only_raises),
        cmocka_unit_test(test_arena_larger_than_memory_is_refused),
        cmocka_unit_test(test_arena_zero_flag_zeroes),
        cmocka_unit_test(test_arena_regions_report_the_arena),
        cmocka_unit_test(test_arena_references_in_any_order),
        cmocka_unit_test(test_arena_zero_size_is_refused),
        cmocka_unit_test(test_arena_bad_kind_is_refused),
        cmocka_unit_test(test_arena_bad_alignment_and_flags_are_refused),
        cmocka_unit_test(test_arena_size_overflow_is_refused),
        cmocka_unit_test(test_arena_null_args),
        cmocka_unit_test(test_arena_pinned_without_gpu_is_unsupported),
        cmocka_unit_test(test_arena_device_without_gpu_is_unsupported),
        cmocka_unit_test(test_arena_device_zero_flag_is_unsupported),
    };
    return cmocka_run_group_tests_name("arena", tests, NULL, NULL);
}
