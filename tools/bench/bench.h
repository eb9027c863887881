/*
 * bench.h - the kvbench harness (see docs/bench-method.md, docs/benchmarks.md).
 *
 * Each tools/bench/bench_<area>.c registers its suites with KVB_REGISTER;
 * bench_main.c runs them. A suite measures a candidate and its baseline in
 * the same process, interleaved (A B A B ...), after a warm-up, and reports
 * medians through kvb_emit_*(), which prints one JSON line to stdout and
 * appends it to bench/results.jsonl.
 */
#ifndef KVB_BENCH_H
#define KVB_BENCH_H

#include <stddef.h>
#include <stdint.h>

typedef void (*kvb_suite_fn)(void);

void kvb_register(const char *area, kvb_suite_fn fn);
#define KVB_REGISTER(area, fn)                                                                     \
    __attribute__((constructor)) static void kvb__reg_##fn(void)                                   \
    {                                                                                              \
        kvb_register(area, fn);                                                                    \
    }

/* True when `case_name` of `bench` should run (--case / --bench filters). */
int kvb_selected(const char *bench, const char *case_name);

/* Quick mode (--quick or KVB_QUICK=1): smaller sizes and fewer runs, used by
 * smoke tests; results are still printed but marked "quick":true. */
int kvb_quick(void);

/* Number of interleaved runs per case (default 9, quick 3; KVB_RUNS). */
int kvb_runs(void);

/* The environment's integer `name` in [lo, hi] (decimal digits only), or
 * dflt when unset or empty; any other value exits 2 naming it (kvbench
 * checks every KVB_* number before its first case). */
long kvb_env_long(const char *name, long dflt, long lo, long hi);

/* Monotonic clock in seconds. */
double kvb_now(void);

/* Median of n doubles (sorts a copy). */
double kvb_median(const double *v, int n);

/* Fill with fresh non-zero pseudo-random bytes (seeded per call). */
void kvb_fill_random(void *p, size_t bytes, uint64_t seed);

/* Large (>= 256 MiB unless quick) aligned buffer from kv_mem; exits on OOM. */
void *kvb_alloc(size_t bytes);
void kvb_free(void *p);

/* Progress on stderr when it is a terminal. */
void kvb_progress(const char *bench, const char *case_name);

/* Throughput result: bytes moved per run, candidate and baseline medians. */
void kvb_emit_gbps(const char *bench, const char *case_name, uint64_t bytes, double cand_s,
                   const char *baseline, double base_s, int runs);

/* Rate result in operations per second (ops per run). */
void kvb_emit_ops(const char *bench, const char *case_name, uint64_t ops, double cand_s,
                  const char *baseline, double base_s, int runs);

/* ids[0..n): n distinct block ids of [0, B) in a seeded random order (a
 * request's blocks spread over the pool, far from 0). */
void kvb_shuffle_ids(uint32_t *ids, uint32_t n, uint32_t B, uint64_t seed);

/* Latency result: microseconds per op; ratio = baseline_us / us (speedup). */
void kvb_emit_us(const char *bench, const char *case_name, double cand_us, const char *baseline,
                 double base_us, int runs);

/* A benchmark whose result is wrong fails: print what differed (one line on
 * stderr, and a {"bench":..,"case":..,"error":..} JSON line) and make kvbench
 * exit with status 3 after the remaining suites. */
void kvb_mismatch(const char *bench, const char *case_name, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* A case that could not run (a library call failed, out of memory, setup
 * refused) fails like a wrong result: one line on stderr, a
 * {"bench":..,"case":..,"error":"failed: .."} JSON line, and exit status 3
 * after the remaining suites. */
void kvb_failed(const char *bench, const char *case_name, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* The CPU model ("model name" of /proc/cpuinfo, or the machine name), also
 * printed in every result line as "cpu". */
const char *kvb_cpu_model(void);

/* Keep the compiler from deleting a computed value. */
void kvb_sink(uint64_t v);

/* KVB_THREADS (as the kernel suite reads it): set the library's thread
 * count (exit 2 if refused); returns kv_threads() (default every core,
 * capped by the cgroup CPU quota). */
int kvb_threads(void);

/* The memcpy baseline given the candidate's t threads: n bytes in t
 * contiguous parts of whole pages, one memcpy per thread. */
void kvb_memcpy_threads(char *d, const char *s, size_t n, int t);
/* Before timing a baseline right after a candidate that ran OpenMP
 * regions: wait (untimed) until the candidate's idle OpenMP threads have
 * stopped spinning (libgomp spins about 300,000 rounds, a few ms, before
 * it sleeps), so they do not take the baseline's cores. KVB_SETTLE_MS
 * (default 10; 0: off). */
void kvb_settle(void);

#endif /* KVB_BENCH_H */
