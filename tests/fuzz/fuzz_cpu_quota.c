/*
 * fuzz_cpu_quota.c - libFuzzer target for the cgroup CPU quota parsers behind
 * kv_threads()'s default (kvcache/kv_threads_int.h): files a container
 * runtime, a bind mount or anyone who can write the cgroup tree controls.
 *
 * Input: byte 0 picks the mode, the rest is
 *
 *   mode 0   a cgroup v2 cpu.max text           kv__cpu_quota_parse
 *   mode 1   byte 1 splits the rest into a      kv__cpu_quota_parse_v1
 *            cfs_quota_us and a cfs_period_us text
 *   mode 2   byte 1 is the output capacity,     kv__cgroup_path_parse, v2
 *            the rest a /proc/self/cgroup text
 *   mode 3   the same                           kv__cgroup_path_parse, v1
 *
 * Every text lives in a malloc of its exact length (no NUL: ASan sees any
 * read past it), the output in a malloc of exactly the capacity given. The
 * answers are checked against reference parsers written here from the
 * grammar in kv_threads_int.h (on a NUL-terminated copy, with strspn and
 * strtoull, and a 128-bit ceil), not from the library's code:
 *
 *   quota    the library's CPU count equals the reference's (>= 0);
 *   path     accepted exactly when the reference accepts, the same path,
 *            NUL-terminated inside the capacity; refused: out[0] == '\0'.
 * Any violation aborts.
 */
#include <errno.h>
#include <limits.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_threads_int.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

__extension__ typedef unsigned __int128 u128;

static void die(const char *what, size_t size)
{
    fprintf(stderr, "fuzz_cpu_quota: %s (%zu input bytes)\n", what, size);
    abort();
}

static char *exact(const uint8_t *p, size_t n)
{
    char *b = malloc(n ? n : 1);
    if (!b)
        abort();
    if (n)
        memcpy(b, p, n);
    return b;
}

/* A NUL-terminated copy with the trailing ' ', '\t', '\n' removed; NULL
 * when the bytes hold a NUL (never part of a valid text). */
static char *ref_text(const char *p, size_t n)
{
    if (memchr(p, '\0', n))
        return NULL;
    char *s = malloc(n + 1);
    if (!s)
        abort();
    memcpy(s, p, n);
    while (n > 0 && strchr(" \t\n", s[n - 1]))
        n--;
    s[n] = '\0';
    return s;
}

/* s is one or more digits whose value fits 64 bits. */
static bool ref_number(const char *s, uint64_t *v)
{
    if (!s[0] || strspn(s, "0123456789") != strlen(s))
        return false;
    errno = 0;
    const unsigned long long x = strtoull(s, NULL, 10);
    if (errno == ERANGE)
        return false;
    *v = x;
    return true;
}

static int ref_ceil(uint64_t q, uint64_t p)
{
    if (q == 0 || p == 0)
        return 0;
    const u128 c = ((u128)q + p - 1) / p;
    return c > INT_MAX ? INT_MAX : (int)c;
}

static int ref_v2(const char *p, size_t n)
{
    char *s = ref_text(p, n);
    if (!s)
        return 0;
    int r = 0;
    const size_t k = strcspn(s, " \t"); /* the end of the quota field */
    if (s[k]) {
        char *period = s + k + strspn(s + k, " \t");
        s[k] = '\0';
        uint64_t q = 0, per = 0;
        const bool max = strcmp(s, "max") == 0;
        if ((max || ref_number(s, &q)) && ref_number(period, &per))
            r = max ? 0 : ref_ceil(q, per);
    }
    free(s);
    return r;
}

static int ref_v1(const char *qp, size_t qn, const char *pp, size_t pn)
{
    char *q = ref_text(qp, qn), *p = ref_text(pp, pn);
    int r = 0;
    uint64_t qv = 0, pv = 0;
    if (q && p) {
        const bool neg = q[0] == '-';
        if (ref_number(q + neg, &qv) && ref_number(p, &pv))
            r = neg ? 0 : ref_ceil(qv, pv);
    }
    free(q);
    free(p);
    return r;
}

/* The reference /proc/self/cgroup reader: the line's fields by position
 * (want: the path, "" for the root; NULL: refused). */
static bool ref_path(const char *t, size_t n, bool v1, size_t cap, char *want)
{
    size_t s = 0;
    while (s < n) {
        size_t e = s;
        while (e < n && t[e] != '\n')
            e++;
        size_t c1 = s, c2;
        while (c1 < e && t[c1] != ':')
            c1++;
        for (c2 = c1 + 1; c2 < e && t[c2] != ':'; c2++)
            ;
        bool match = false;
        if (c1 < e && c2 < e) {
            if (!v1) {
                match = c1 == s + 1 && t[s] == '0' && c2 == c1 + 1;
            } else {
                for (size_t a = c1 + 1; a < c2 && !match;) {
                    size_t b = a;
                    while (b < c2 && t[b] != ',')
                        b++;
                    match = b - a == 3 && t[a] == 'c' && t[a + 1] == 'p' && t[a + 2] == 'u';
                    a = b + 1;
                }
            }
        }
        if (match) {
            const char *p = t + c2 + 1;
            const size_t pn = e - (c2 + 1);
            if (pn == 0 || p[0] != '/' || memchr(p, '\0', pn))
                return false;
            if (pn == 1) {
                want[0] = '\0';
                return cap >= 1;
            }
            if (pn + 1 > cap)
                return false;
            /* every component between slashes: non-empty, not . or .. */
            memcpy(want, p, pn);
            want[pn] = '\0';
            char *copy = strdup(want + 1), *save = NULL;
            if (!copy)
                abort();
            bool ok = want[pn - 1] != '/' && !strstr(want, "//");
            for (char *c = strtok_r(copy, "/", &save); c && ok; c = strtok_r(NULL, "/", &save))
                ok = strcmp(c, ".") != 0 && strcmp(c, "..") != 0;
            free(copy);
            return ok;
        }
        s = e + 1;
    }
    return false;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    const unsigned mode = data[0] % 4;
    const uint8_t *d = data + 1;
    size_t n = size - 1;
    if (mode == 0) {
        char *t = exact(d, n);
        const int got = kv__cpu_quota_parse(t, n);
        if (got < 0 || got != ref_v2(t, n))
            die("cpu.max: the CPU count differs from the reference's", size);
        free(t);
        return 0;
    }
    if (n < 1)
        return 0;
    const size_t arg = d[0];
    d++;
    n--;
    if (mode == 1) {
        const size_t k = arg % (n + 1);
        char *q = exact(d, k), *p = exact(d + k, n - k);
        const int got = kv__cpu_quota_parse_v1(q, k, p, n - k);
        if (got < 0 || got != ref_v1(q, k, p, n - k))
            die("cfs_quota_us/cfs_period_us: the CPU count differs from the reference's", size);
        free(q);
        free(p);
        return 0;
    }
    const bool v1 = mode == 3;
    char *t = exact(d, n), *out = malloc(arg ? arg : 1), want[257];
    if (!out)
        abort();
    memset(out, 'z', arg ? arg : 1);
    const bool ok = kv__cgroup_path_parse(t, n, v1, out, arg);
    const bool ref = ref_path(t, n, v1, arg, want);
    if (ok != ref)
        die(ok ? "cgroup path accepted, the reference refuses it"
               : "cgroup path refused, the reference accepts it",
            size);
    if (ok && (!memchr(out, '\0', arg) || strcmp(out, want) != 0))
        die("cgroup path differs from the reference's", size);
    if (!ok && (arg ? out[0] != '\0' : out[0] != 'z'))
        die("refused cgroup path: out not \"\" (or written with no capacity)", size);
    free(t);
    free(out);
    return 0;
}
