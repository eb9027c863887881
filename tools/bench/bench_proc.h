/*
 * bench_proc.h - what the two-process transport benchmarks share
 * (bench_transport.c, bench_shm.c): the decode side started as a child
 * process of this program, reaped at the end, and its pool checked by hash
 * against kv_plan_copy of the same request.
 */
#ifndef KVB_BENCH_PROC_H
#define KVB_BENCH_PROC_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "kv_plan.h"

/* This program started again as a child (fork + exec: a forked child of a
 * process that ran OpenMP cannot use OpenMP; libgomp's pool does not
 * survive fork) with the environment variable var set to "<fd>,<args>",
 * fd its end of a socketpair(AF_UNIX, SOCK_STREAM) whose other end goes to
 * *ctl. The child's pid; -1 when the socketpair failed (nothing started). */
pid_t kvb_spawn_self(const char *var, const char *args, int *ctl);

/* Wait for the child pid, SIGKILLed first when failed; when not failed, an
 * exit status other than 0 fails the case (kvb_failed naming it). */
void kvb_reap(pid_t pid, bool failed, const char *bench, const char *case_name);

/* Whether got is the XXH3-64 of the destination pool (dlo, dbase) after a
 * kv_plan_copy of the request (plan; NULL: one made here) from the source
 * pool (slo, sbase) into the zeroed destination. */
bool kvb_pool_hash_ok(const kv_plan *plan, const struct kv_layout *slo, void *sbase,
                      const uint32_t *sid, uint32_t ns, const struct kv_layout *dlo, void *dbase,
                      const uint32_t *did, uint32_t nd, uint64_t T, uint64_t got);

#endif /* KVB_BENCH_PROC_H */
