/*
 * kv_threads.c - the process-wide thread count (kv_threads.h), the cgroup
 * CPU quota that caps its default (kv_threads_int.h), and the CPU's vendor
 * (kv__cpu_vendor, kv_lib.h).
 *
 * Where the quota comes from (read once, on the first default kv_threads()):
 *
 *   ROOT = $KV_CGROUP_ROOT, else /sys/fs/cgroup
 *   SELF = $KV_CGROUP_SELF, else /proc/self/cgroup (the process's cgroups)
 *
 *   v2   P = SELF's "0::P" line          ROOT/P/cpu.max, then each ancestor
 *                                        directory up to ROOT/cpu.max
 *   v1   P = SELF's line whose           ROOT/M/P/cpu.cfs_{quota,period}_us
 *        controllers hold "cpu"          and each ancestor up to ROOT/M,
 *                                        for M = cpu and cpu,cpuacct
 *
 * The quota is the smallest positive CPU count among every file found (a
 * parent's quota limits its children, as Go's runtime reads it); a missing
 * file, directory or line only drops out (a container sees its own cgroup
 * at ROOT: the walk still reaches it). No file with a quota: no cap.
 * The environment variables are the test seam (tests/unit/test_threads.c).
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kv_lib.h"
#include "kv_threads.h"
#include "kv_threads_int.h"

static _Atomic int kv__threads_set; /* 0: the default */
/* The quota's CPUs: -1 not read yet, 0 none, else >= 1. */
static _Atomic int kv__quota_cpus = -1;

kv_status kv_set_threads(int n)
{
    if (n < 0)
        return kv__error(KV_ERR_INVALID_ARG,
                         "kv_set_threads: %d < 0 (0 means every core, capped by the CPU quota)", n);
    atomic_store_explicit(&kv__threads_set, n, memory_order_relaxed);
    return kv__ok();
}

int kv_threads(void)
{
    const int n = atomic_load_explicit(&kv__threads_set, memory_order_relaxed);
    if (n > 0)
        return n;
    /* The cores this process may run on (its affinity mask), as OpenMP's
     * omp_get_num_procs counts them ... */
    int cpus = 1;
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0) {
        cpus = CPU_COUNT(&set);
    } else {
        const long c = sysconf(_SC_NPROCESSORS_ONLN);
        cpus = c > 0 && c < INT_MAX ? (int)c : 1;
    }
    /* ... and no more than the CPU time the cgroup quota grants: 16 threads
     * on 2 CPUs' worth of time stall in every barrier. */
    const int q = kv__threads_cpu_quota();
    return q > 0 && q < cpus ? q : cpus;
}

/* ---- the parsers: hostile bytes, [text, text + len) only ---------------- */

static bool is_hsp(char c)
{
    return c == ' ' || c == '\t';
}

/* A run of decimal digits from *i as a value <= UINT64_MAX; advances *i.
 * False (nothing changed) when there is no digit or the value overflows. */
static bool parse_u64(const char *t, size_t len, size_t *i, uint64_t *out)
{
    size_t j = *i;
    uint64_t v = 0;
    while (j < len && t[j] >= '0' && t[j] <= '9') {
        if (__builtin_mul_overflow(v, 10u, &v) ||
            __builtin_add_overflow(v, (uint64_t)(t[j] - '0'), &v))
            return false;
        j++;
    }
    if (j == *i)
        return false;
    *i = j;
    *out = v;
    return true;
}

/* [i, len) holds only whitespace (' ', '\t', '\n'). */
static bool only_ws(const char *t, size_t len, size_t i)
{
    for (; i < len; i++)
        if (!is_hsp(t[i]) && t[i] != '\n')
            return false;
    return true;
}

/* ceil(quota / period) saturated at INT_MAX; 0 for a zero quota or period. */
static int quota_cpus(uint64_t quota, uint64_t period)
{
    if (quota == 0 || period == 0)
        return 0;
    const uint64_t c = quota / period + (quota % period != 0);
    return c > (uint64_t)INT_MAX ? INT_MAX : (int)c;
}

int kv__cpu_quota_parse(const char *text, size_t len)
{
    if (!text)
        return 0;
    size_t i = 0;
    uint64_t quota = 0, period = 0;
    const bool max = len >= 3 && memcmp(text, "max", 3) == 0;
    if (max)
        i = 3;
    else if (!parse_u64(text, len, &i, &quota))
        return 0;
    size_t j = i;
    while (j < len && is_hsp(text[j]))
        j++;
    if (j == i || !parse_u64(text, len, &j, &period) || !only_ws(text, len, j))
        return 0;
    return max ? 0 : quota_cpus(quota, period);
}

int kv__cpu_quota_parse_v1(const char *quota, size_t quota_len, const char *period,
                           size_t period_len)
{
    if (!quota || !period)
        return 0;
    const bool neg = quota_len > 0 && quota[0] == '-'; /* -1: no quota */
    size_t i = neg ? 1 : 0, j = 0;
    uint64_t q = 0, p = 0;
    if (!parse_u64(quota, quota_len, &i, &q) || !only_ws(quota, quota_len, i) ||
        !parse_u64(period, period_len, &j, &p) || !only_ws(period, period_len, j))
        return 0;
    return neg ? 0 : quota_cpus(q, p);
}

/* The comma-separated controller list [c, c + n) holds "cpu". */
static bool has_cpu(const char *c, size_t n)
{
    size_t s = 0;
    while (s <= n) {
        size_t e = s;
        while (e < n && c[e] != ',')
            e++;
        if (e - s == 3 && memcmp(c + s, "cpu", 3) == 0)
            return true;
        s = e + 1;
    }
    return false;
}

/* An absolute cgroup path [p, p + n) into out without the root's '/'. */
static bool copy_path(const char *p, size_t n, char *out, size_t cap)
{
    if (n == 0 || p[0] != '/' || memchr(p, '\0', n))
        return false;
    if (n == 1) /* the root cgroup: "" (already written) */
        return cap > 0;
    for (size_t s = 0; s < n;) { /* p[s] == '/' */
        size_t e = s + 1;
        while (e < n && p[e] != '/')
            e++;
        const size_t c = e - s - 1;
        if (c == 0 || (c == 1 && p[s + 1] == '.') || (c == 2 && p[s + 1] == '.' && p[s + 2] == '.'))
            return false;
        s = e;
    }
    if (n >= cap)
        return false;
    memcpy(out, p, n);
    out[n] = '\0';
    return true;
}

bool kv__cgroup_path_parse(const char *text, size_t len, bool v1, char *out, size_t cap)
{
    if (out && cap > 0)
        out[0] = '\0';
    if (!text || !out)
        return false;
    for (size_t at = 0; at < len;) {
        const char *nl = memchr(text + at, '\n', len - at);
        const size_t end = nl ? (size_t)(nl - text) : len;
        const char *c1 = memchr(text + at, ':', end - at);
        const char *c2 = c1 ? memchr(c1 + 1, ':', (size_t)(text + end - (c1 + 1))) : NULL;
        if (c2) {
            const size_t id_n = (size_t)(c1 - (text + at)), ctl_n = (size_t)(c2 - (c1 + 1));
            const bool match =
                v1 ? has_cpu(c1 + 1, ctl_n) : id_n == 1 && text[at] == '0' && ctl_n == 0;
            if (match)
                return copy_path(c2 + 1, (size_t)(text + end - (c2 + 1)), out, cap);
        }
        at = end + 1;
    }
    return false;
}

/* ---- reading the files ----------------------------------------------- */

/* A regular file of at most cap bytes, whole; -1 when it cannot be opened
 * or read, is not a regular file (a FIFO would block) or is longer. */
static long read_small(const char *path, char *buf, size_t cap)
{
    const int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0)
        return -1;
    struct stat st;
    long n = 0;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        n = -1;
        goto close_fd;
    }
    for (;;) {
        char extra;
        const size_t room = (size_t)n < cap ? cap - (size_t)n : 0;
        const ssize_t r = room ? read(fd, buf + n, room) : read(fd, &extra, 1);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 || (room == 0 && r > 0)) {
            n = -1; /* an error, or more than cap bytes */
            break;
        }
        if (r == 0)
            break;
        n += (long)r;
    }
close_fd:
    close(fd);
    return n;
}

/* The quota's CPUs in directory dir (0: none, or no readable file). */
static int dir_quota(const char *dir, bool v1)
{
    char f[4096 + 32], a[128], b[128];
    if (snprintf(f, sizeof(f), "%s/%s", dir, v1 ? "cpu.cfs_quota_us" : "cpu.max") >= (int)sizeof(f))
        return 0;
    const long na = read_small(f, a, sizeof(a));
    if (na < 0)
        return 0;
    if (!v1)
        return kv__cpu_quota_parse(a, (size_t)na);
    if (snprintf(f, sizeof(f), "%s/cpu.cfs_period_us", dir) >= (int)sizeof(f))
        return 0;
    const long nb = read_small(f, b, sizeof(b));
    return nb < 0 ? 0 : kv__cpu_quota_parse_v1(a, (size_t)na, b, (size_t)nb);
}

/* The smallest quota in base + path and each ancestor up to base. */
static int walk_quota(const char *base, const char *path, bool v1)
{
    char dir[4096];
    const size_t base_n = strlen(base);
    int n = snprintf(dir, sizeof(dir), "%s%s", base, path);
    if (n < 0 || (size_t)n >= sizeof(dir)) { /* too deep: base alone */
        if (base_n >= sizeof(dir))
            return 0;
        memcpy(dir, base, base_n + 1);
        n = (int)base_n;
    }
    int best = 0;
    for (size_t len = (size_t)n;;) {
        dir[len] = '\0';
        const int c = dir_quota(dir, v1);
        if (c > 0 && (best == 0 || c < best))
            best = c;
        if (len <= base_n)
            break;
        size_t k = len; /* drop the last component and its '/' */
        while (k > base_n && dir[k - 1] != '/')
            k--;
        len = k > base_n ? k - 1 : base_n;
    }
    return best;
}

static int min_quota(int a, int b)
{
    return a > 0 && (b == 0 || a < b) ? a : b;
}

static int quota_read(void)
{
    const char *root = getenv("KV_CGROUP_ROOT");
    const char *self = getenv("KV_CGROUP_SELF");
    if (!root || !root[0])
        root = "/sys/fs/cgroup";
    if (!self || !self[0])
        self = "/proc/self/cgroup";
    char text[8192], p2[2048] = "", p1[2048] = "";
    const long n = read_small(self, text, sizeof(text));
    if (n > 0) {
        kv__cgroup_path_parse(text, (size_t)n, false, p2, sizeof(p2));
        kv__cgroup_path_parse(text, (size_t)n, true, p1, sizeof(p1));
    }
    int q = walk_quota(root, p2, false);
    static const char *const v1_mounts[] = {"cpu", "cpu,cpuacct"};
    for (size_t i = 0; i < sizeof(v1_mounts) / sizeof(v1_mounts[0]); i++) {
        char base[2048 + 32];
        if (snprintf(base, sizeof(base), "%s/%s", root, v1_mounts[i]) < (int)sizeof(base))
            q = min_quota(walk_quota(base, p1, true), q);
    }
    return q;
}

int kv__threads_cpu_quota(void)
{
    int q = atomic_load_explicit(&kv__quota_cpus, memory_order_acquire);
    if (q < 0) { /* two first callers may both read: the same answer */
        q = quota_read();
        atomic_store_explicit(&kv__quota_cpus, q, memory_order_release);
    }
    return q;
}

void kv__threads_cpu_quota_reset(void)
{
    atomic_store_explicit(&kv__quota_cpus, -1, memory_order_release);
}

enum kv__cpu_vendor kv__cpu_vendor(void)
{
#if defined(__x86_64__) || defined(__i386__)
    static _Atomic int cached; /* 0: not asked yet */
    int v = atomic_load_explicit(&cached, memory_order_relaxed);
    if (v == 0) {
        __builtin_cpu_init();
        v = __builtin_cpu_is("intel") ? KV__CPU_INTEL
            : __builtin_cpu_is("amd") ? KV__CPU_AMD
                                      : KV__CPU_OTHER;
        atomic_store_explicit(&cached, v, memory_order_relaxed);
    }
    return (enum kv__cpu_vendor)v;
#else
    return KV__CPU_OTHER;
#endif
}
