/*
 * kv_threads.h - how many CPU threads the library's parallel work uses: the
 * CPU kernels (attention/), transfer plans, pack/unpack and the offload
 * tier's copies (connector/). One process-wide setting, read at each call.
 *
 * The default (0) is every core this process may run on (its affinity
 * mask), capped by its cgroup CPU quota: ceil(quota / period) CPUs, the
 * smallest along the process's cgroup and its ancestors (cgroup v2 cpu.max,
 * or v1 cpu.cfs_quota_us / cpu.cfs_period_us), as Go, the JVM and .NET cap
 * their default parallelism. A container given 2 CPUs of time on a 64-core
 * host runs 2 threads, not 64 that stall in every barrier. The quota is
 * read from /sys/fs/cgroup and /proc/self/cgroup once, at the first call
 * that needs it (a later change is not seen); a file missing or not
 * understood means no cap. KV_CGROUP_ROOT and KV_CGROUP_SELF, when set
 * before that call, name other places for the two (tests).
 *
 * Thread-safe: both calls may be made from any thread at any time; a call
 * already running keeps the count it started with.
 */
#ifndef KV_THREADS_H
#define KV_THREADS_H

#include "kv_status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Use n >= 1 threads (whatever the cores or the quota), or 0 for every
 * core this process may run on, capped by its cgroup CPU quota (the
 * default). KV_ERR_INVALID_ARG for n < 0 (named). */
KV_API KV_NODISCARD kv_status kv_set_threads(int n);

/* The thread count the next parallel call will use (>= 1): the n of
 * kv_set_threads, else min(cores in the affinity mask, quota CPUs when the
 * cgroup sets a quota). */
KV_API int kv_threads(void);

#ifdef __cplusplus
}
#endif

#endif /* KV_THREADS_H */
