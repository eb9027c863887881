/*
 * bench_threads.c - the thread count a suite runs with (KVB_THREADS) and the
 * memcpy baseline given the same threads, shared by the pack and offload
 * suites.
 */
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench.h"
#include "kv_threads.h"

/* KVB_THREADS (as the kernel suite reads it): the library's thread count
 * for this suite; default kv_threads() (every core, capped by the cgroup CPU
 * quota). */
int kvb_threads(void)
{
    const long te = kvb_env_long("KVB_THREADS", 0, 1, 4096);
    if (te > 0 && kv_set_threads((int)te) != KV_OK) {
        fprintf(stderr, "kvbench: KVB_THREADS=%ld: %s\n", te, kv_last_error());
        exit(2);
    }
    return kv_threads();
}

struct kvb__mc {
    char *d;
    const char *s;
    size_t n;
};

static void *kvb__mc_run(void *a)
{
    struct kvb__mc *m = a;
    memcpy(m->d, m->s, m->n);
    return NULL;
}

/* The memcpy baseline given the candidate's threads: n bytes in t
 * contiguous parts of whole pages, one memcpy per thread (t 1: one plain
 * memcpy). */
void kvb_memcpy_threads(char *d, const char *s, size_t n, int t)
{
    enum { MAXT = 64 };
    t = t < MAXT ? t : MAXT;
    if (t <= 1 || n < ((size_t)1 << 20)) {
        memcpy(d, s, n);
        return;
    }
    struct kvb__mc m[MAXT] = {{NULL, NULL, 0}};
    pthread_t th[MAXT];
    bool started[MAXT] = {false};
    const size_t part = (n / (size_t)t + 4095) & ~(size_t)4095;
    for (int i = 0; i < t; i++) {
        const size_t at = part * (size_t)i < n ? part * (size_t)i : n;
        m[i] = (struct kvb__mc){d + at, s + at, n - at < part ? n - at : part};
    }
    for (int i = 1; i < t; i++)
        started[i] = pthread_create(&th[i], NULL, kvb__mc_run, &m[i]) == 0;
    kvb__mc_run(&m[0]);
    for (int i = 1; i < t; i++)
        if (started[i])
            pthread_join(th[i], NULL);
        else
            kvb__mc_run(&m[i]); /* no thread: the same bytes, here */
}

void kvb_settle(void)
{
    static long ms = -1;
    if (ms < 0) {
        ms = kvb_env_long("KVB_SETTLE_MS", 10, 0, 60000);
    }
    if (ms == 0)
        return;
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0)
        ;
}
