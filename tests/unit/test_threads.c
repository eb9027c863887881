/*
 * test_threads.c - kvcache/kv_threads.h's default thread count and the cgroup
 * CPU quota that caps it (kv_threads_int.h): the cpu.max and v1 parsers on
 * well-formed, truncated, huge, negative, zero and garbage texts (each in a
 * malloc of its exact length, no NUL: ASan sees a read past it), the
 * /proc/self/cgroup path parser, and kv_threads() on fake cgroup trees in a
 * mkdtemp directory (KV_CGROUP_ROOT, KV_CGROUP_SELF): a parent's smaller
 * quota wins, missing levels drop out, v1 trees, no quota, the value read
 * once, hostile files ignored, kv_set_threads overriding it all.
 * Expectations come from the test's own ceil (128-bit) and its own count of
 * the affinity mask; every test leaves the environment and the cache as it
 * found them (teardown).
 */
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <sched.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "kv_lib.h" /* kv__cpu_vendor */
#include "kv_status.h"
#include "kv_threads.h"
#include "kv_threads_int.h"

__extension__ typedef unsigned __int128 u128;

/* The test's ceil(q / p), in 128 bits: 0 without a quota, saturated at
 * INT_MAX. */
static int ref_cpus(uint64_t q, uint64_t p)
{
    if (q == 0 || p == 0)
        return 0;
    const u128 c = ((u128)q + p - 1) / p;
    return c > INT_MAX ? INT_MAX : (int)c;
}

/* text's first len bytes in a malloc of exactly len (len SIZE_MAX: strlen). */
static char *exact(const char *text, size_t len)
{
    char *p = malloc(len ? len : 1);
    assert_non_null(p);
    memcpy(p, text, len);
    return p;
}

static int parse_v2(const char *text, size_t len)
{
    char *p = exact(text, len);
    const int r = kv__cpu_quota_parse(p, len);
    free(p);
    return r;
}

static int parse_v1(const char *q, const char *p)
{
    char *a = exact(q, strlen(q)), *b = exact(p, strlen(p));
    const int r = kv__cpu_quota_parse_v1(a, strlen(q), b, strlen(p));
    free(a);
    free(b);
    return r;
}

#define L SIZE_MAX /* the whole string */

static void test_threads_quota_parse_v2(void **state)
{
    (void)state;
    static const struct {
        const char *text;
        size_t len;
        uint64_t q, p; /* the quota it states (0: none, or not a cpu.max) */
    } c[] = {
        {"max 100000", L, 0, 0},
        {"max 100000\n", L, 0, 0},
        {"150000 100000\n", L, 150000, 100000},
        {"50000 100000", L, 50000, 100000},
        {"1 100000", L, 1, 100000},
        {"100000 100000", L, 100000, 100000},
        {"100001 100000\n", L, 100001, 100000},
        {"6400000 100000\n", L, 6400000, 100000},
        {"200000\t100000 \n\n", L, 200000, 100000},
        {"200000  100000", L, 200000, 100000},
        {"000200000 00100000", L, 200000, 100000},
        /* huge: saturated, or past UINT64_MAX (not a number: no quota) */
        {"18446744073709551615 1", L, UINT64_MAX, 1},
        {"18446744073709551615 18446744073709551615", L, UINT64_MAX, UINT64_MAX},
        {"4000000000000 1000", L, 4000000000000ull, 1000},
        {"18446744073709551616 100000", L, 0, 0},
        {"200000 18446744073709551616", L, 0, 0},
        {"99999999999999999999999999 100000", L, 0, 0},
        /* zero, negative, signs */
        {"200000 0", L, 0, 0},
        {"0 100000", L, 0, 0},
        {"-1 100000", L, 0, 0},
        {"200000 -100000", L, 0, 0},
        {"+200000 100000", L, 0, 0},
        /* missing or extra fields, garbage */
        {"200000", L, 0, 0},
        {"200000 ", L, 0, 0},
        {"200000\n", L, 0, 0},
        {"", L, 0, 0},
        {"max", L, 0, 0},
        {"max100000", L, 0, 0},
        {"maximum 100000", L, 0, 0},
        {"garbage", L, 0, 0},
        {"200000 100000x", L, 0, 0},
        {"200000 100000 5", L, 0, 0},
        {"200000\n100000", L, 0, 0},
        {" 200000 100000", L, 0, 0},
        {"2e5 100000", L, 0, 0},
        {"200000 100000\r\n", L, 0, 0},
        {"200000\0 100000", 14, 0, 0},
        {"200000 100000\0", 14, 0, 0},
        /* truncated by len: only the bytes before it count */
        {"150000 100000", 0, 0, 0},
        {"150000 100000", 3, 0, 0},
        {"150000 100000", 7, 0, 0},
        {"150000 100000", 8, 150000, 1},
        {"150000 100000", 12, 150000, 10000},
        {"max 100000", 2, 0, 0},
    };
    for (size_t i = 0; i < sizeof(c) / sizeof(c[0]); i++) {
        const size_t len = c[i].len == L ? strlen(c[i].text) : c[i].len;
        const int got = parse_v2(c[i].text, len), want = ref_cpus(c[i].q, c[i].p);
        if (got != want)
            fail_msg("cpu.max \"%.*s\" (%zu bytes): %d CPUs, want %d", (int)len, c[i].text, len,
                     got, want);
    }
    assert_int_equal(kv__cpu_quota_parse(NULL, 10), 0);
}

static void test_threads_quota_parse_v1(void **state)
{
    (void)state;
    static const struct {
        const char *quota, *period;
        uint64_t q, p;
    } c[] = {
        {"-1\n", "100000\n", 0, 0},
        {"-1", "100000", 0, 0},
        {"200000\n", "100000\n", 200000, 100000},
        {"50000", "100000", 50000, 100000},
        {"1", "100000", 1, 100000},
        {"250000", "100000 \n", 250000, 100000},
        {"18446744073709551615", "1", UINT64_MAX, 1},
        {"18446744073709551616", "1", 0, 0},
        {"-5", "100000", 0, 0},
        {"-", "100000", 0, 0},
        {"--1", "100000", 0, 0},
        {"200000", "0", 0, 0},
        {"0", "100000", 0, 0},
        {"", "100000", 0, 0},
        {"200000", "", 0, 0},
        {"1x", "100000", 0, 0},
        {"200000", "-100000", 0, 0},
        {"200000 100000", "100000", 0, 0},
        {"max", "100000", 0, 0},
    };
    for (size_t i = 0; i < sizeof(c) / sizeof(c[0]); i++) {
        const int got = parse_v1(c[i].quota, c[i].period), want = ref_cpus(c[i].q, c[i].p);
        if (got != want)
            fail_msg("cfs_quota_us \"%s\", cfs_period_us \"%s\": %d CPUs, want %d", c[i].quota,
                     c[i].period, got, want);
    }
    assert_int_equal(kv__cpu_quota_parse_v1(NULL, 0, "1", 1), 0);
    assert_int_equal(kv__cpu_quota_parse_v1("1", 1, NULL, 0), 0);
}

static void test_threads_cgroup_path_parse(void **state)
{
    (void)state;
    static const struct {
        const char *text;
        size_t len;
        bool v1;
        const char *want; /* NULL: refused */
    } c[] = {
        {"12:cpu,cpuacct:/docker/abc\n0::/kubepods/pod1\n", L, false, "/kubepods/pod1"},
        {"12:cpu,cpuacct:/docker/abc\n0::/kubepods/pod1\n", L, true, "/docker/abc"},
        {"2:cpuacct,cpu:/x/y\n", L, true, "/x/y"},
        {"9:name=systemd:/\n2:cpuacct:/\n1:cpu:/\n0::/\n", L, true, ""},
        {"9:name=systemd:/\n2:cpuacct:/\n1:cpu:/\n0::/\n", L, false, ""},
        {"0::/a/b", L, false, "/a/b"},
        {"0::/a:b\n", L, false, "/a:b"},
        {"0::/abcdef", 5, false, "/a"},
        {"2:cpuacct:/x\n3:cpuset:/y\n", L, true, NULL},
        {"4:cpu.x,cpux:/x\n", L, true, NULL},
        {"10::/x\n", L, false, NULL},
        {"0:cpu:/x\n", L, false, NULL},
        {"0::/../x\n", L, false, NULL},
        {"0::/a/..\n", L, false, NULL},
        {"0::/a/./b\n", L, false, NULL},
        {"0::/a//b\n", L, false, NULL},
        {"0::/a/\n", L, false, NULL},
        {"0::relative\n", L, false, NULL},
        {"0::\n", L, false, NULL},
        {"0::/a\0b\n", 8, false, NULL},
        {"no colons here\n", L, false, NULL},
        {"0:/x\n", L, false, NULL},
        {"", L, false, NULL},
        {"\n\n\n", L, true, NULL},
        {"0::/..\n0::/ok\n", L, false, NULL}, /* the first 0:: line decides */
        {"0::/a/...\n", L, false, "/a/..."},
    };
    for (size_t i = 0; i < sizeof(c) / sizeof(c[0]); i++) {
        const size_t len = c[i].len == L ? strlen(c[i].text) : c[i].len;
        char *p = exact(c[i].text, len), out[64];
        memset(out, 'z', sizeof(out));
        const bool ok = kv__cgroup_path_parse(p, len, c[i].v1, out, sizeof(out));
        free(p);
        if (ok != (c[i].want != NULL) || (ok && strcmp(out, c[i].want) != 0) ||
            (!ok && out[0] != '\0'))
            fail_msg("case %zu (%s): %s \"%s\", want %s", i, c[i].v1 ? "v1" : "v2",
                     ok ? "ok" : "refused", ok ? out : "", c[i].want ? c[i].want : "refused");
    }
    /* a path that does not fit: refused, out "" */
    char small[5];
    assert_false(kv__cgroup_path_parse("0::/abcd\n", 9, false, small, sizeof(small)));
    assert_string_equal(small, "");
    assert_true(kv__cgroup_path_parse("0::/abc\n", 8, false, small, sizeof(small)));
    assert_string_equal(small, "/abc");
    assert_false(kv__cgroup_path_parse("0::/\n", 5, false, small, 0));
    assert_false(kv__cgroup_path_parse(NULL, 5, false, small, sizeof(small)));
}

/* ---- fake cgroup trees ------------------------------------------------- */

struct tree {
    char dir[64];  /* the mkdtemp directory */
    char root[96]; /* dir/sys: KV_CGROUP_ROOT */
    char self[96]; /* dir/self: KV_CGROUP_SELF */
};

static int rm_one(const char *p, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st;
    (void)flag;
    (void)ftw;
    return remove(p);
}

static void put(const struct tree *t, const char *rel, const char *text)
{
    char p[512];
    snprintf(p, sizeof(p), "%s/%s", t->root, rel);
    for (char *s = p + strlen(t->root) + 1; (s = strchr(s, '/')) != NULL; s++) {
        *s = '\0';
        assert_true(mkdir(p, 0700) == 0 || errno == EEXIST);
        *s = '/';
    }
    FILE *f = fopen(p, "w");
    assert_non_null(f);
    assert_true(fputs(text, f) >= 0);
    assert_int_equal(fclose(f), 0);
}

static void set_self(const struct tree *t, const char *text)
{
    FILE *f = fopen(t->self, "w");
    assert_non_null(f);
    assert_true(fputs(text, f) >= 0);
    assert_int_equal(fclose(f), 0);
    kv__threads_cpu_quota_reset();
}

static int setup_tree(void **state)
{
    struct tree *t = calloc(1, sizeof(*t));
    if (!t)
        return -1;
    snprintf(t->dir, sizeof(t->dir), "/tmp/kv_threads_XXXXXX");
    if (!mkdtemp(t->dir)) {
        free(t);
        return -1;
    }
    snprintf(t->root, sizeof(t->root), "%s/sys", t->dir);
    snprintf(t->self, sizeof(t->self), "%s/self", t->dir);
    if (mkdir(t->root, 0700) != 0 || setenv("KV_CGROUP_ROOT", t->root, 1) != 0 ||
        setenv("KV_CGROUP_SELF", t->self, 1) != 0)
        return -1;
    kv__threads_cpu_quota_reset();
    *state = t;
    return 0;
}

static int teardown_tree(void **state)
{
    struct tree *t = *state;
    unsetenv("KV_CGROUP_ROOT");
    unsetenv("KV_CGROUP_SELF");
    kv__threads_cpu_quota_reset();
    const kv_status st = kv_set_threads(0);
    const int rc = nftw(t->dir, rm_one, 16, FTW_DEPTH | FTW_PHYS);
    free(t);
    return st == KV_OK && rc == 0 ? 0 : -1;
}

/* The cores the affinity mask allows, counted here. */
static int affinity_cpus(void)
{
    cpu_set_t set;
    assert_int_equal(sched_getaffinity(0, sizeof(set), &set), 0);
    int n = 0;
    for (int i = 0; i < CPU_SETSIZE; i++)
        n += CPU_ISSET(i, &set) ? 1 : 0;
    assert_true(n >= 1);
    return n;
}

static int min_cpus(int quota)
{
    const int a = affinity_cpus();
    return quota > 0 && quota < a ? quota : a;
}

static void test_threads_v2_parent_quota_wins(void **state)
{
    const struct tree *t = *state;
    put(t, "cpu.max", "max 100000\n");
    put(t, "kubepods/cpu.max", "300000 100000\n");
    put(t, "kubepods/pod/cpu.max", "max 100000\n");
    put(t, "kubepods/pod/ctr/cpu.max", "400000 100000\n");
    set_self(t, "0::/kubepods/pod/ctr\n");
    assert_int_equal(kv__threads_cpu_quota(), ref_cpus(300000, 100000));
    assert_int_equal(kv_threads(), min_cpus(ref_cpus(300000, 100000)));

    /* a leaf below the parent's: the leaf's */
    put(t, "kubepods/pod/ctr/cpu.max", "150000 100000\n");
    kv__threads_cpu_quota_reset();
    assert_int_equal(kv__threads_cpu_quota(), ref_cpus(150000, 100000));

    /* half a CPU at the parent: one thread, whatever the cores */
    put(t, "kubepods/cpu.max", "50000 100000\n");
    kv__threads_cpu_quota_reset();
    assert_int_equal(kv__threads_cpu_quota(), 1);
    assert_int_equal(kv_threads(), 1);

    /* the root's own cpu.max (a container's namespace) counts too */
    put(t, "kubepods/cpu.max", "max 100000\n");
    put(t, "kubepods/pod/ctr/cpu.max", "max 100000\n");
    put(t, "cpu.max", "250000 100000\n");
    kv__threads_cpu_quota_reset();
    assert_int_equal(kv__threads_cpu_quota(), ref_cpus(250000, 100000));
}

static void test_threads_v2_missing_levels_drop_out(void **state)
{
    const struct tree *t = *state;
    put(t, "kubepods/cpu.max", "300000 100000\n");
    set_self(t, "0::/kubepods/gone/ctr\n");
    assert_int_equal(kv__threads_cpu_quota(), ref_cpus(300000, 100000));

    /* the container's own cgroup at the root, its host path unknown */
    put(t, "cpu.max", "120000 100000\n");
    set_self(t, "0::/docker/0123abcd\n");
    assert_int_equal(kv__threads_cpu_quota(), ref_cpus(120000, 100000));
}

static void test_threads_no_quota_every_core(void **state)
{
    const struct tree *t = *state;
    /* no self file, no cgroup files */
    assert_int_equal(kv__threads_cpu_quota(), 0);
    assert_int_equal(kv_threads(), affinity_cpus());

    put(t, "cpu.max", "max 100000\n");
    put(t, "a/cpu.max", "max 100000\n");
    put(t, "cpu/cpu.cfs_quota_us", "-1\n");
    put(t, "cpu/cpu.cfs_period_us", "100000\n");
    set_self(t, "1:cpu:/\n0::/a\n");
    assert_int_equal(kv__threads_cpu_quota(), 0);
    assert_int_equal(kv_threads(), affinity_cpus());

    /* more CPUs of quota than cores: the cores */
    put(t, "a/cpu.max", "100000000 100000\n");
    kv__threads_cpu_quota_reset();
    assert_int_equal(kv__threads_cpu_quota(), 1000);
    assert_int_equal(kv_threads(), min_cpus(1000));
}

static void test_threads_v1_trees(void **state)
{
    const struct tree *t = *state;
    put(t, "cpu/cpu.cfs_quota_us", "-1\n");
    put(t, "cpu/cpu.cfs_period_us", "100000\n");
    put(t, "cpu/docker/abc/cpu.cfs_quota_us", "150000\n");
    put(t, "cpu/docker/abc/cpu.cfs_period_us", "100000\n");
    set_self(t, "4:cpu,cpuacct:/docker/abc\n3:memory:/docker/abc\n0::/\n");
    assert_int_equal(kv__threads_cpu_quota(), ref_cpus(150000, 100000));

    /* the combined mount's name; a period file missing at one level */
    put(t, "cpu,cpuacct/docker/cpu.cfs_quota_us", "50000\n");
    put(t, "cpu,cpuacct/docker/cpu.cfs_period_us", "100000\n");
    put(t, "cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "10000\n");
    kv__threads_cpu_quota_reset();
    assert_int_equal(kv__threads_cpu_quota(), 1);
    assert_int_equal(kv_threads(), 1);
}

static void test_threads_quota_read_once(void **state)
{
    const struct tree *t = *state;
    put(t, "cpu.max", "300000 100000\n");
    set_self(t, "0::/\n");
    assert_int_equal(kv__threads_cpu_quota(), 3);
    put(t, "cpu.max", "100000 100000\n");
    assert_int_equal(kv__threads_cpu_quota(), 3); /* cached */
    assert_int_equal(kv_threads(), min_cpus(3));
    kv__threads_cpu_quota_reset();
    assert_int_equal(kv__threads_cpu_quota(), 1);
}

static void test_threads_hostile_files_ignored(void **state)
{
    const struct tree *t = *state;
    char p[256];
    /* a FIFO would block a plain open: skipped, the parent's counts */
    snprintf(p, sizeof(p), "%s/a", t->root);
    assert_int_equal(mkdir(p, 0700), 0);
    snprintf(p, sizeof(p), "%s/a/cpu.max", t->root);
    assert_int_equal(mkfifo(p, 0600), 0);
    put(t, "cpu.max", "200000 100000\n");
    set_self(t, "0::/a\n");
    assert_int_equal(kv__threads_cpu_quota(), 2);

    /* a directory, a file longer than any cpu.max, garbage: none limits */
    put(t, "b/cpu.max/x", "1 1\n");
    char big[300];
    memset(big, ' ', sizeof(big));
    memcpy(big, "1 100000", 8);
    big[sizeof(big) - 1] = '\0';
    put(t, "b/c/cpu.max", big);
    put(t, "b/c/d/cpu.max", "\xff\xfe 1 1 1\n");
    put(t, "cpu.max", "max 100000\n");
    set_self(t, "0::/b/c/d\n");
    assert_int_equal(kv__threads_cpu_quota(), 0);

    /* an unusable self file: the roots alone */
    put(t, "cpu.max", "200000 100000\n");
    set_self(t, "0::/../../etc\n");
    assert_int_equal(kv__threads_cpu_quota(), 2);
}

static void test_threads_set_overrides(void **state)
{
    const struct tree *t = *state;
    put(t, "cpu.max", "50000 100000\n");
    set_self(t, "0::/\n");
    assert_int_equal(kv_threads(), 1);
    assert_int_equal(kv_set_threads(5), KV_OK);
    assert_int_equal(kv_threads(), 5);
    assert_int_equal(kv_set_threads(-3), KV_ERR_INVALID_ARG);
    assert_non_null(strstr(kv_last_error(), "-3"));
    assert_int_equal(kv_threads(), 5); /* a refused call changes nothing */
    assert_int_equal(kv_set_threads(0), KV_OK);
    assert_int_equal(kv_threads(), 1);
}

/* kv__cpu_vendor against /proc/cpuinfo's vendor_id (the kernel's cpuid
 * read): GenuineIntel is KV__CPU_INTEL, AuthenticAMD KV__CPU_AMD, anything
 * else (or no x86) KV__CPU_OTHER; asked twice, the same answer. */
static void test_cpu_vendor_matches_cpuinfo(void **state)
{
    (void)state;
    enum kv__cpu_vendor want = KV__CPU_OTHER;
#if defined(__x86_64__) || defined(__i386__)
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f)
        skip();
    char line[256];
    while (fgets(line, sizeof(line), f))
        if (strncmp(line, "vendor_id", 9) == 0) {
            if (strstr(line, "GenuineIntel"))
                want = KV__CPU_INTEL;
            else if (strstr(line, "AuthenticAMD"))
                want = KV__CPU_AMD;
            break;
        }
    fclose(f);
#endif
    assert_int_equal(kv__cpu_vendor(), want);
    assert_int_equal(kv__cpu_vendor(), want);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cpu_vendor_matches_cpuinfo),
        cmocka_unit_test(test_threads_quota_parse_v2),
        cmocka_unit_test(test_threads_quota_parse_v1),
        cmocka_unit_test(test_threads_cgroup_path_parse),
        cmocka_unit_test_setup_teardown(test_threads_v2_parent_quota_wins, setup_tree,
                                        teardown_tree),
        cmocka_unit_test_setup_teardown(test_threads_v2_missing_levels_drop_out, setup_tree,
                                        teardown_tree),
        cmocka_unit_test_setup_teardown(test_threads_no_quota_every_core, setup_tree,
                                        teardown_tree),
        cmocka_unit_test_setup_teardown(test_threads_v1_trees, setup_tree, teardown_tree),
        cmocka_unit_test_setup_teardown(test_threads_quota_read_once, setup_tree, teardown_tree),
        cmocka_unit_test_setup_teardown(test_threads_hostile_files_ignored, setup_tree,
                                        teardown_tree),
        cmocka_unit_test_setup_teardown(test_threads_set_overrides, setup_tree, teardown_tree),
    };
    return cmocka_run_group_tests_name("threads", tests, NULL, NULL);
}
