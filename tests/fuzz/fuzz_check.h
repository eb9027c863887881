/*
 * fuzz_check.h - what every libFuzzer target shares: the input reader
 * (rd_u8: the next byte, 0 past the end), a splitmix64 step (mix64), and
 * the oracle plumbing: a trace
 * of the input being run (trace(), printf-style, appended; cleared by
 * trace_reset() at the start of each input), printed with the first failed
 * CHECK, which aborts (libFuzzer then saves the input). Define FUZZ_NAME
 * (the target's name) and FUZZ_TRACE_LABEL (what the trace holds: "chain",
 * "input", "call") before including.
 */
#ifndef KV_FUZZ_CHECK_H
#define KV_FUZZ_CHECK_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "kv_status.h"

struct rd {
    const uint8_t *p;
    size_t n, i;
};

static inline uint8_t rd_u8(struct rd *r)
{
    return r->i < r->n ? r->p[r->i++] : 0;
}

static inline uint64_t mix64(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static char g_trace[4096];
static size_t g_trace_len;

static void trace(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void trace(const char *fmt, ...)
{
    va_list ap;
    if (g_trace_len >= sizeof(g_trace) - 1)
        return;
    va_start(ap, fmt);
    int n = vsnprintf(g_trace + g_trace_len, sizeof(g_trace) - g_trace_len, fmt, ap);
    va_end(ap);
    if (n > 0)
        g_trace_len += (size_t)n;
    if (g_trace_len > sizeof(g_trace) - 1)
        g_trace_len = sizeof(g_trace) - 1;
}

static inline void trace_reset(void)
{
    g_trace_len = 0;
    g_trace[0] = '\0';
}

static void fail(const char *file, int line, const char *cond)
{
    fprintf(stderr,
            FUZZ_NAME ": check failed at %s:%d: %s\n  last_error: %s\n  " FUZZ_TRACE_LABEL ":%s\n",
            file, line, cond, kv_last_error(), g_trace);
    abort();
}

/* Not a control-flow macro: it aborts the process on failure. */
#define CHECK(c) ((c) ? (void)0 : fail(__FILE__, __LINE__, #c))

/* malloc that never returns NULL (a failure is a CHECK); n 0 is one byte. */
static inline void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    CHECK(p != NULL);
    return p;
}

#endif /* KV_FUZZ_CHECK_H */
