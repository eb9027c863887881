/*
 * kvt_oom.h - the allocation-failure driver of the out-of-memory tests
 * (test_oom, test_xport_rdma_oom): a call run with its k-th allocation on
 * this thread failed (kv__mem_fail_after), k = 0, 1, ... until it makes no
 * allocation that fails; each failure must answer KV_ERR_NO_MEMORY (or the
 * case's other documented status) with a message, leave the observable
 * state value for value as it was, and its outputs untouched.
 */
#ifndef KVT_OOM_H
#define KVT_OOM_H

#include <stddef.h>
#include <stdint.h>

#include <kvcache/kv.h>
#include "kv_mem.h"

#define SNAP_MAX 4096

/* What is observable of a scenario, as a list of values (compared one by
 * one: never struct bytes). */
struct snap {
    uint64_t v[SNAP_MAX];
    size_t n;
};

static void snap_put(struct snap *s, uint64_t x)
{
    assert_true(s->n < SNAP_MAX);
    s->v[s->n++] = x;
}

static void snap_bytes(struct snap *s, const void *p, size_t n)
{
    const unsigned char *b = p;
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 1099511628211ull;
    snap_put(s, h);
}

struct oom_case {
    const char *name;
    void *ctx;
    kv_status (*call)(void *ctx);
    void (*snap)(void *ctx, struct snap *s); /* observable state (may be NULL) */
    void (*ok)(void *ctx);                   /* check the result, undo it */
    void (*failed)(void *ctx);               /* outputs untouched (may be NULL) */
    kv_status other;                         /* another documented failure status, or KV_OK */
};

static struct snap g_before, g_after;

/* Runs the case; returns the number of failures injected. */
static uint64_t oom_run(const struct oom_case *c)
{
    uint64_t injected = 0, absorbed = 0, calls = 0;
    if (c->snap) {
        g_before.n = 0;
        c->snap(c->ctx, &g_before);
    }
    for (int64_t k = 0;; k++) {
        assert_true(k < (int64_t)100000);
        const uint64_t f0 = kv__mem_failed();
        kv__mem_fail_after(k);
        const kv_status st = c->call(c->ctx);
        kv__mem_fail_after(-1);
        const uint64_t nf = kv__mem_failed() - f0;
        injected += nf;
        calls++;
        if (st == KV_OK) {
            c->ok(c->ctx);
            if (nf == 0)
                break;
            /* a fallback absorbed the failure: go on, from the state undone */
            absorbed++;
            if (c->snap) {
                g_before.n = 0;
                c->snap(c->ctx, &g_before);
            }
            continue;
        }
        if (nf == 0 || (st != KV_ERR_NO_MEMORY && st != c->other))
            fail_msg("%s: k=%lld: status %s (%s), %llu failures injected", c->name, (long long)k,
                     kv_status_name(st), kv_last_error(), (unsigned long long)nf);
        const char *msg = kv_last_error();
        if (!msg || !msg[0])
            fail_msg("%s: k=%lld: %s without a message", c->name, (long long)k, kv_status_name(st));
        if (c->snap) {
            g_after.n = 0;
            c->snap(c->ctx, &g_after);
            if (g_after.n != g_before.n)
                fail_msg("%s: k=%lld: state has %zu values, was %zu (%s)", c->name, (long long)k,
                         g_after.n, g_before.n, msg);
            for (size_t i = 0; i < g_after.n; i++)
                if (g_after.v[i] != g_before.v[i])
                    fail_msg("%s: k=%lld: state value %zu is %llu, was %llu (%s)", c->name,
                             (long long)k, i, (unsigned long long)g_after.v[i],
                             (unsigned long long)g_before.v[i], msg);
        }
        if (c->failed)
            c->failed(c->ctx);
    }
    print_message("  %-28s %3llu calls, %3llu injected failures, %llu absorbed\n", c->name,
                  (unsigned long long)calls, (unsigned long long)injected,
                  (unsigned long long)absorbed);
    return injected;
}

/* An output's "not written" marker. */
static void *const SENTINEL = (void *)(uintptr_t)0x5e17;

#endif /* KVT_OOM_H */
