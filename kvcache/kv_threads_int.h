/*
 * kv_threads_int.h - the cgroup CPU quota behind kv_threads()'s default
 * (kv_threads.c). Module-private: the parsers are here for the unit test
 * (tests/unit/test_threads.c) and the fuzz target (tests/fuzz/fuzz_cpu_quota.c).
 *
 * The files are bytes from outside the library (a container runtime, a bind
 * mount, a test's fake tree): the parsers read exactly [text, text + len)
 * (no NUL needed), never fail and never overflow. Anything they do not
 * recognise means "no quota" (0), so a strange file never limits the threads.
 *
 * Grammar (what the kernel writes, plus any trailing whitespace):
 *
 *   cgroup v2 cpu.max          QUOTA HSP+ PERIOD WS*     QUOTA = "max" | DIGITS
 *   cgroup v1 cpu.cfs_quota_us ["-"] DIGITS WS*          (-1: no quota)
 *   cgroup v1 cpu.cfs_period_us DIGITS WS*
 *
 *   DIGITS = [0-9]+ with a value <= UINT64_MAX, HSP = ' ' | '\t',
 *   WS = ' ' | '\t' | '\n'
 *
 * CPUs = ceil(QUOTA / PERIOD), saturated at INT_MAX; 0 when QUOTA is "max",
 * negative or 0, or PERIOD is 0 (the kernel refuses both zeros).
 */
#ifndef KV_THREADS_INT_H
#define KV_THREADS_INT_H

#include <stdbool.h>
#include <stddef.h>

/* cgroup v2 cpu.max contents -> CPUs of quota (>= 1), or 0 for none. */
int kv__cpu_quota_parse(const char *text, size_t len);

/* cgroup v1 cpu.cfs_quota_us and cpu.cfs_period_us contents -> CPUs of
 * quota (>= 1), or 0 for none. */
int kv__cpu_quota_parse_v1(const char *quota, size_t quota_len, const char *period,
                           size_t period_len);

/*
 * The process's cgroup path from /proc/self/cgroup contents (lines
 * "ID:CONTROLLERS:PATH"): v1 false takes the cgroup v2 line ("0::PATH"), v1
 * true the first line whose comma-separated CONTROLLERS holds "cpu". Writes
 * PATH into out (cap bytes, NUL-terminated), the root cgroup "/" as "" (so
 * ROOT followed by PATH names its directory). False (out[0] = '\0' when
 * cap > 0) when there is no such line, or that line's PATH does not start
 * with '/', has an empty, "." or ".." component or a NUL byte, or does not
 * fit.
 */
bool kv__cgroup_path_parse(const char *text, size_t len, bool v1, char *out, size_t cap);

/* The quota's CPUs as kv_threads() uses them (0: none found), read on the
 * first call: the minimum over the process's cgroup and its ancestors, v2
 * and v1 (kv_threads.c says where). */
int kv__threads_cpu_quota(void);

/* Forget the cached quota so the next call reads the files again (tests,
 * after pointing KV_CGROUP_ROOT / KV_CGROUP_SELF at a fake tree). */
void kv__threads_cpu_quota_reset(void);

#endif /* KV_THREADS_INT_H */
