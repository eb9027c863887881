/*
 * bench_proc.c - the child process and pool check of the two-process
 * transport benchmarks (bench_proc.h).
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <xxhash.h>

#include "bench.h"
#include "bench_proc.h"

pid_t kvb_spawn_self(const char *var, const char *args, int *ctl)
{
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv))
        return -1;
    fflush(NULL);
    char env[160];
    snprintf(env, sizeof(env), "%s=%d,%s", var, sv[1], args);
    const pid_t pid = fork();
    if (pid == 0) {
        close(sv[0]);
        putenv(env);
        execl("/proc/self/exe", "kvbench", (char *)NULL);
        _exit(127);
    }
    close(sv[1]);
    *ctl = sv[0];
    return pid;
}

void kvb_reap(pid_t pid, bool failed, const char *bench, const char *case_name)
{
    int wst = 0;
    if (failed)
        kill(pid, SIGKILL);
    waitpid(pid, &wst, 0);
    if (!failed && (!WIFEXITED(wst) || WEXITSTATUS(wst) != 0))
        kvb_failed(bench, case_name, "decode process exit status %d", WEXITSTATUS(wst));
}

bool kvb_pool_hash_ok(const kv_plan *plan, const struct kv_layout *slo, void *sbase,
                      const uint32_t *sid, uint32_t ns, const struct kv_layout *dlo, void *dbase,
                      const uint32_t *did, uint32_t nd, uint64_t T, uint64_t got)
{
    kv_plan *own = NULL;
    memset(dbase, 0, (size_t)dlo->total_bytes);
    const struct kv_paged_cache sc = {
        .layout = *slo, .base = sbase, .storage_bytes = (size_t)slo->total_bytes};
    const struct kv_paged_cache dc = {
        .layout = *dlo, .base = dbase, .storage_bytes = (size_t)dlo->total_bytes};
    if (!plan) {
        if (kv_plan_create(slo, dlo, NULL, &own) != KV_OK)
            return false;
        plan = own;
    }
    const bool ok = kv_plan_copy(plan, sc, sid, ns, dc, did, nd, T) == KV_OK &&
                    XXH3_64bits(dbase, (size_t)dlo->total_bytes) == got;
    kv_plan_destroy(own);
    return ok;
}
