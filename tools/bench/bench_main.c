/*
 * bench_main.c - the kvbench driver: argument parsing, the suite registry,
 * timing helpers and the JSON-lines output described in docs/bench-method.md.
 *
 *   kvbench [--bench SUBSTR] [--case SUBSTR] [--quick] [--list] [--out FILE]
 *
 * Suites run in registration order (link order, then order in each file).
 * Every result is one JSON object on stdout, also appended to --out
 * (default bench/results.jsonl; its directory is created as needed).
 */
#include <sched.h>
#include <ctype.h>
#include <errno.h>
#include <getopt.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"
#include "kv_mem.h"
#include "kv_status.h"
#include "kv_threads_int.h"

#define KVB_MAX_SUITES 128
#define KVB_DEFAULT_OUT "bench/results.jsonl"

static struct {
    const char *area;
    kvb_suite_fn fn;
} kvb__suites[KVB_MAX_SUITES];
static int kvb__nsuites;

static const char *kvb__case_filter;  /* substring of case names, or NULL */
static const char *kvb__bench_filter; /* substring of bench names, or NULL */
static int kvb__quick_flag;
static int kvb__list_mode;  /* --list: print "bench case" for each selected case, run nothing */
static int kvb__matched;    /* cases selected so far */
static FILE *kvb__out;      /* results file, or NULL when it could not be opened */
static int kvb__mismatches; /* wrong results seen (kvb_mismatch) */
static int kvb__failures;   /* cases that could not run (kvb_failed) */
static char kvb__cpu[128];  /* kvb_cpu_model */

void kvb_register(const char *area, kvb_suite_fn fn)
{
    if (kvb__nsuites >= KVB_MAX_SUITES) {
        fprintf(stderr, "kvbench: more than %d suites registered (raise KVB_MAX_SUITES)\n",
                KVB_MAX_SUITES);
        exit(2);
    }
    kvb__suites[kvb__nsuites].area = area;
    kvb__suites[kvb__nsuites].fn = fn;
    kvb__nsuites++;
}

int kvb_selected(const char *bench, const char *case_name)
{
    if (kvb__bench_filter && !strstr(bench, kvb__bench_filter))
        return 0;
    if (kvb__case_filter && !strstr(case_name, kvb__case_filter))
        return 0;
    kvb__matched++;
    if (kvb__list_mode) {
        printf("%s %s\n", bench, case_name);
        return 0;
    }
    return 1;
}

int kvb_quick(void)
{
    return kvb__quick_flag;
}

long kvb_env_long(const char *name, long dflt, long lo, long hi)
{
    const char *e = getenv(name);
    if (!e || !e[0])
        return dflt;
    errno = 0;
    char *end = NULL;
    const long v = isdigit((unsigned char)e[0]) ? strtol(e, &end, 10) : -1;
    if (!end || *end || errno || v < lo || v > hi) {
        fprintf(stderr, "kvbench: %s='%s' is not a decimal integer in [%ld, %ld]\n", name, e, lo,
                hi);
        exit(2);
    }
    return v;
}

int kvb_runs(void)
{
    return (int)kvb_env_long("KVB_RUNS", kvb__quick_flag ? 3 : 9, 1, 1000);
}

double kvb_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int kvb__cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double kvb_median(const double *v, int n)
{
    double tmp[256];
    double *c = tmp;
    double m;

    if (n <= 0)
        return 0.0;
    if (n > (int)(sizeof(tmp) / sizeof(tmp[0]))) {
        c = kv__mem_alloc((size_t)n * sizeof(double));
        if (!c) {
            fprintf(stderr, "kvbench: out of memory in kvb_median\n");
            exit(2);
        }
    }
    memcpy(c, v, (size_t)n * sizeof(double));
    qsort(c, (size_t)n, sizeof(double), kvb__cmp_double);
    m = n % 2 ? c[n / 2] : 0.5 * (c[n / 2 - 1] + c[n / 2]);
    if (c != tmp)
        kv__mem_free(c);
    return m;
}

/* splitmix64: fast, and every call with a new seed gives new data. */
static uint64_t kvb__splitmix(uint64_t *x)
{
    uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

void kvb_fill_random(void *p, size_t bytes, uint64_t seed)
{
    static uint64_t calls;
    uint64_t x = seed ^ (0xD1B54A32D192ED03ull * ++calls);
    unsigned char *b = p;
    size_t i = 0;

    for (; i + 8 <= bytes; i += 8) {
        /* Non-zero bytes: OR a 1 into each so no page is ever all zero. */
        uint64_t v = kvb__splitmix(&x) | 0x0101010101010101ull;
        memcpy(b + i, &v, 8);
    }
    for (; i < bytes; i++)
        b[i] = (unsigned char)(kvb__splitmix(&x) | 1);
}

void *kvb_alloc(size_t bytes)
{
    void *p = kv__mem_alloc_aligned(4096, bytes ? bytes : 1);
    if (!p) {
        fprintf(stderr, "kvbench: cannot allocate %zu bytes\n", bytes);
        exit(2);
    }
    return p;
}

void kvb_free(void *p)
{
    kv__mem_free(p);
}

void kvb_progress(const char *bench, const char *case_name)
{
    if (isatty(STDERR_FILENO))
        fprintf(stderr, "\r\033[K[kvbench] %s %s ...", bench, case_name);
}

static void kvb__progress_done(void)
{
    if (isatty(STDERR_FILENO))
        fprintf(stderr, "\r\033[K");
}

/* JSON string body: the names we print are plain ASCII, but escape anyway. */
static void kvb__json_str(char *buf, size_t cap, const char *s)
{
    size_t n = 0;
    for (; *s && n + 7 < cap; s++) {
        unsigned char ch = (unsigned char)*s;
        if (ch == '"' || ch == '\\') {
            buf[n++] = '\\';
            buf[n++] = (char)ch;
        } else if (ch < 0x20) {
            n += (size_t)snprintf(buf + n, cap - n, "\\u%04x", ch);
        } else {
            buf[n++] = (char)ch;
        }
    }
    buf[n] = '\0';
}

const char *kvb_cpu_model(void)
{
    if (kvb__cpu[0])
        return kvb__cpu;
    FILE *f = fopen("/proc/cpuinfo", "r");
    char line[512];
    while (f && fgets(line, sizeof(line), f)) {
        if (strncmp(line, "model name", 10) == 0) {
            const char *c = strchr(line, ':');
            if (c) {
                c++;
                while (*c == ' ' || *c == '\t')
                    c++;
                snprintf(kvb__cpu, sizeof(kvb__cpu), "%s", c);
                kvb__cpu[strcspn(kvb__cpu, "\n")] = '\0';
                break;
            }
        }
    }
    if (f)
        fclose(f);
    if (!kvb__cpu[0])
        snprintf(kvb__cpu, sizeof(kvb__cpu), "unknown");
    return kvb__cpu;
}

/* What the kernels' dispatch sees and how much CPU the process may use,
 * printed with every result line ("host"): the vector ISA levels the
 * kernels choose from (a sandbox may hide some), the CPUs this process may
 * run on, and the cgroup CPU quota in CPUs ("none": no quota found). A
 * result far below what the same CPU model did elsewhere reads with it. */
static const char *kvb__host(void)
{
    static char h[160];
    if (h[0])
        return h;
    char isa[64] = "";
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512bw"))
        strcat(isa, "avx512bw+");
    if (__builtin_cpu_supports("avx512f"))
        strcat(isa, "avx512f+");
    if (__builtin_cpu_supports("avx2"))
        strcat(isa, "avx2+");
    if (__builtin_cpu_supports("fma"))
        strcat(isa, "fma+");
    if (__builtin_cpu_supports("f16c"))
        strcat(isa, "f16c+");
#endif
    if (isa[0])
        isa[strlen(isa) - 1] = '\0';
    else
        snprintf(isa, sizeof(isa), "none");
    int cpus = 0;
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0)
        cpus = CPU_COUNT(&set);
    /* the library's own reading (v2 or v1, the process's cgroup and its
     * parents: kv_threads_int.h), which also caps kv_threads() */
    const int q = kv__threads_cpu_quota();
    char quota[48] = "none";
    if (q > 0)
        snprintf(quota, sizeof(quota), "%d cpus", q);
    snprintf(h, sizeof(h), "isa %s, %d cpus, quota %s", isa, cpus, quota);
    return h;
}

static void kvb__emit_line(const char *fmt, ...) KV_PRINTF(1, 2);

static void kvb__emit_line(const char *fmt, ...)
{
    char line[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    char cpu[160], host[200];
    kvb__json_str(cpu, sizeof(cpu), kvb_cpu_model());
    kvb__json_str(host, sizeof(host), kvb__host());
    kvb__progress_done();
    printf("%s,\"cpu\":\"%s\",\"host\":\"%s\"%s}\n", line, cpu, host,
           kvb__quick_flag ? ",\"quick\":true" : "");
    fflush(stdout);
    if (kvb__out) {
        fprintf(kvb__out, "%s,\"cpu\":\"%s\",\"host\":\"%s\"%s}\n", line, cpu, host,
                kvb__quick_flag ? ",\"quick\":true" : "");
        fflush(kvb__out);
    }
}

/* One error for a case: "kvbench: <label> in <bench> <case>: <msg>" on stderr and
 * a JSON line whose "error" is "<kind>: <msg>". */
static void kvb__case_error(const char *bench, const char *case_name, const char *label,
                            const char *kind, const char *fmt, va_list ap) KV_PRINTF(5, 0);

static void kvb__case_error(const char *bench, const char *case_name, const char *label,
                            const char *kind, const char *fmt, va_list ap)
{
    char msg[512], b[128], c[256], m[600];
    vsnprintf(msg, sizeof(msg), fmt, ap);
    kvb__progress_done();
    fprintf(stderr, "kvbench: %s in %s %s: %s\n", label, bench, case_name, msg);
    kvb__json_str(b, sizeof(b), bench);
    kvb__json_str(c, sizeof(c), case_name);
    kvb__json_str(m, sizeof(m), msg);
    kvb__emit_line("{\"bench\":\"%s\",\"case\":\"%s\",\"error\":\"%s: %s\"", b, c, kind, m);
}

void kvb_mismatch(const char *bench, const char *case_name, const char *fmt, ...)
{
    va_list ap;
    kvb__mismatches++;
    va_start(ap, fmt);
    kvb__case_error(bench, case_name, "WRONG RESULT", "wrong result", fmt, ap);
    va_end(ap);
}

void kvb_failed(const char *bench, const char *case_name, const char *fmt, ...)
{
    va_list ap;
    kvb__failures++;
    va_start(ap, fmt);
    kvb__case_error(bench, case_name, "FAILED", "failed", fmt, ap);
    va_end(ap);
}

void kvb_emit_gbps(const char *bench, const char *case_name, uint64_t bytes, double cand_s,
                   const char *baseline, double base_s, int runs)
{
    char b[128], c[256], bl[64];
    const double g = cand_s > 0 ? (double)bytes / cand_s / 1e9 : 0.0;
    const double bg = base_s > 0 ? (double)bytes / base_s / 1e9 : 0.0;
    kvb__json_str(b, sizeof(b), bench);
    kvb__json_str(c, sizeof(c), case_name);
    kvb__json_str(bl, sizeof(bl), baseline);
    kvb__emit_line("{\"bench\":\"%s\",\"case\":\"%s\",\"bytes\":%llu,\"gbps\":%.3f,"
                   "\"baseline\":\"%s\",\"baseline_gbps\":%.3f,\"ratio\":%.3f,\"runs\":%d",
                   b, c, (unsigned long long)bytes, g, bl, bg, bg > 0 ? g / bg : 0.0, runs);
}

void kvb_emit_ops(const char *bench, const char *case_name, uint64_t ops, double cand_s,
                  const char *baseline, double base_s, int runs)
{
    char b[128], c[256], bl[64];
    const double r = cand_s > 0 ? (double)ops / cand_s : 0.0;
    const double br = base_s > 0 ? (double)ops / base_s : 0.0;
    kvb__json_str(b, sizeof(b), bench);
    kvb__json_str(c, sizeof(c), case_name);
    kvb__json_str(bl, sizeof(bl), baseline);
    kvb__emit_line("{\"bench\":\"%s\",\"case\":\"%s\",\"ops\":%llu,\"ops_per_s\":%.6g,"
                   "\"baseline\":\"%s\",\"baseline_ops_per_s\":%.6g,\"ratio\":%.4g,\"runs\":%d",
                   b, c, (unsigned long long)ops, r, bl, br, br > 0 ? r / br : 0.0, runs);
}

void kvb_emit_us(const char *bench, const char *case_name, double cand_us, const char *baseline,
                 double base_us, int runs)
{
    char b[128], c[256], bl[64];
    kvb__json_str(b, sizeof(b), bench);
    kvb__json_str(c, sizeof(c), case_name);
    kvb__json_str(bl, sizeof(bl), baseline);
    kvb__emit_line("{\"bench\":\"%s\",\"case\":\"%s\",\"us\":%.6g,\"baseline\":\"%s\","
                   "\"baseline_us\":%.6g,\"ratio\":%.4g,\"higher_is_better\":true,"
                   "\"ratio_is\":\"baseline_us/us\",\"runs\":%d",
                   b, c, cand_us, bl, base_us, cand_us > 0 ? base_us / cand_us : 0.0, runs);
}

void kvb_shuffle_ids(uint32_t *ids, uint32_t n, uint32_t B, uint64_t seed)
{
    uint32_t *all = malloc((size_t)B * sizeof(*all));
    if (!all)
        exit(2);
    for (uint32_t i = 0; i < B; i++)
        all[i] = i;
    for (uint32_t i = 0; i < n; i++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        const uint32_t j = i + (uint32_t)((seed >> 33) % (B - i));
        const uint32_t t = all[i];
        all[i] = all[j];
        all[j] = t;
        ids[i] = all[i];
    }
    free(all);
}

void kvb_sink(uint64_t v)
{
    static volatile uint64_t sink;
    sink ^= v;
}

/* mkdir -p of the directory part of path. */
static void kvb__mkdir_parent(const char *path)
{
    char dir[4096];
    size_t n = strlen(path);
    if (n >= sizeof(dir))
        return;
    memcpy(dir, path, n + 1);
    char *slash = strrchr(dir, '/');
    if (!slash || slash == dir)
        return;
    *slash = '\0';
    for (char *p = dir + 1; *p; p++) {
        if (*p == '/') {
            *p = '\0';
            mkdir(dir, 0777);
            *p = '/';
        }
    }
    mkdir(dir, 0777);
}

static void kvb__usage(FILE *f)
{
    fprintf(f,
            "usage: kvbench [--bench SUBSTR] [--case SUBSTR] [--quick] [--list] [--out FILE]\n"
            "  --bench SUBSTR  run only benches whose name contains SUBSTR (view.materialize)\n"
            "  --case SUBSTR   run only cases whose name contains SUBSTR\n"
            "  --quick         small sizes, 3 runs (also KVB_QUICK=1); lines get \"quick\":true\n"
            "  --list          print 'bench case' for every selected case and exit\n"
            "  --out FILE      append JSON lines to FILE (default " KVB_DEFAULT_OUT ")\n"
            "env: KVB_RUNS=n overrides the number of interleaved runs\n");
}

enum { KVB_OPT_CASE = 256, KVB_OPT_BENCH, KVB_OPT_OUT, KVB_OPT_QUICK, KVB_OPT_LIST };

static const struct option kvb__opts[] = {
    {"case", required_argument, NULL, KVB_OPT_CASE},
    {"bench", required_argument, NULL, KVB_OPT_BENCH},
    {"out", required_argument, NULL, KVB_OPT_OUT},
    {"quick", no_argument, NULL, KVB_OPT_QUICK},
    {"list", no_argument, NULL, KVB_OPT_LIST},
    {"help", no_argument, NULL, 'h'},
    {NULL, 0, NULL, 0},
};

/* Whether word spells out the option getopt_long took it for: "--NAME" or
 * "--NAME=VALUE" (getopt_long alone also takes a unique prefix, "--qu"), or
 * exactly "-h" (lo NULL; not "-hx", a cluster). */
static int kvb__spelled_out(const char *word, const struct option *lo)
{
    size_t n;

    if (!lo || !lo->name)
        return !strcmp(word, "-h");
    n = strlen(lo->name);
    return !strncmp(word, "--", 2) && !strncmp(word + 2, lo->name, n) &&
           (word[2 + n] == '\0' || word[2 + n] == '=');
}

int main(int argc, char **argv)
{
    const char *out_path = KVB_DEFAULT_OUT;
    const char *q = getenv("KVB_QUICK");

    kvb__quick_flag = q && q[0] && strcmp(q, "0") != 0;
    opterr = 0; /* the messages below name the word as given */
    optind = 1;
    for (;;) {
        const char *word = optind < argc ? argv[optind] : NULL; /* the word read next */
        int idx = -1;
        /* "+": stop at the first word that is not an option; ":": a missing value returns ':' */
        int c = getopt_long(argc, argv, "+:h", kvb__opts, &idx);

        if (c == -1 && !word)
            break;
        if (c == ':') { /* the last word, an option without its value: optopt says which */
            for (idx = 0; kvb__opts[idx].name && kvb__opts[idx].val != optopt; idx++)
                ;
        }
        /* c == -1 here: a word that is not an option, or "--" */
        if (c == -1 || c == '?' || !kvb__spelled_out(word, idx >= 0 ? &kvb__opts[idx] : NULL)) {
            fprintf(stderr, "kvbench: unknown argument '%s'\n", word);
            kvb__usage(stderr);
            return 2;
        }
        switch (c) {
        case ':':
            fprintf(stderr, "kvbench: %s needs a value\n", word);
            kvb__usage(stderr);
            return 2;
        case KVB_OPT_CASE:
            kvb__case_filter = optarg;
            break;
        case KVB_OPT_BENCH:
            kvb__bench_filter = optarg;
            break;
        case KVB_OPT_OUT:
            out_path = optarg;
            break;
        case KVB_OPT_QUICK:
            kvb__quick_flag = 1;
            break;
        case KVB_OPT_LIST:
            kvb__list_mode = 1;
            break;
        default: /* 'h' */
            kvb__usage(stdout);
            return 0;
        }
    }
    /* every KVB_* number checked before the first case, not mid-run */
    (void)kvb_runs();
    (void)kvb_env_long("KVB_THREADS", 0, 1, 4096);
    (void)kvb_env_long("KVB_SETTLE_MS", 10, 0, 60000);
    (void)kvb_env_long("KVB_GATHER_BELOW", 0, 0, UINT32_MAX);
    if (!kvb__list_mode && out_path[0]) {
        kvb__mkdir_parent(out_path);
        kvb__out = fopen(out_path, "a");
        if (!kvb__out)
            fprintf(stderr, "kvbench: cannot open %s for append (%s); stdout only\n", out_path,
                    strerror(errno));
    }
    for (int i = 0; i < kvb__nsuites; i++)
        kvb__suites[i].fn();
    kvb__progress_done();
    if (kvb__out)
        fclose(kvb__out);
    if (kvb__mismatches || kvb__failures) {
        fprintf(stderr,
                "kvbench: %d case(s) computed a wrong result, %d case(s) failed to run (see "
                "above)\n",
                kvb__mismatches, kvb__failures);
        return 3;
    }
    if (kvb__matched == 0) {
        fprintf(stderr, "kvbench: no case matched (--bench %s --case %s); try --list\n",
                kvb__bench_filter ? kvb__bench_filter : "*",
                kvb__case_filter ? kvb__case_filter : "*");
        return 1;
    }
    return 0;
}
