/*
 * test_view.c - strided views: the PyTorch conformance vectors and the edge
 * cases / bad input of every op.
 *
 * The reference for element values is the view formula itself, walked here
 * element by element (independent of the library's copy engine).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <kvcache/kv.h>

#include "kv_mem.h"
#include "kvtest.h"

/* ---- reference walk ------------------------------------------------------ */

/* Sum and index-weighted sum of an i64 view's elements in logical C order. */
static void ref_sums(const struct kv_view *v, int64_t *sum, int64_t *wsum)
{
    int64_t idx[KV_MAX_DIMS] = {0};
    int64_t n = kv_view_numel(v), lin;
    const int64_t *base = v->base;
    *sum = 0;
    *wsum = 0;
    for (lin = 0; lin < n; lin++) {
        int64_t off = v->offset, val;
        for (int k = 0; k < v->ndim; k++)
            off += idx[k] * v->strides[k];
        val = base[off];
        *sum += val;
        *wsum += lin * val;
        for (int k = v->ndim - 1; k >= 0; k--) {
            if (++idx[k] < v->shape[k])
                break;
            idx[k] = 0;
        }
    }
}

/* ---- conformance replay --------------------------------------------------- */

struct replay {
    void *bufs[64]; /* storages made by copies, freed at the end of a line */
    int nbufs;
};

/* Longest list a vector line may carry: more entries than a view has dims,
 * so a too-long list reaches the library (which must refuse it) intact. */
#define LIST_MAX (2 * KV_MAX_DIMS)

static int parse_list(const char *s, int64_t *out)
{
    int n = 0;
    while (*s == ' ')
        s++;
    if (!(*s == '-' || (*s >= '0' && *s <= '9')))
        return 0;
    for (;;) {
        char *end;
        out[n++] = strtoll(s, &end, 10);
        s = end;
        if (*s != ',')
            break;
        if (n == LIST_MAX)
            fail_msg("a list of more than %d entries", LIST_MAX);
        s++;
    }
    return n;
}

static int parse_copy_flag(const char *s)
{
    const char *c = strstr(s, "copy=");
    return c ? atoi(c + 5) : -1;
}

/* Apply one op; returns the status, sets *copied (-1 when the op never copies). */
static kv_status apply_op(struct replay *r, const char *op, struct kv_view *v, int *copied)
{
    char name[32];
    int64_t a[LIST_MAX];
    const char *args;
    int n, consumed = 0;
    bool cp = false;
    kv_status st;
    size_t need = (size_t)kv_view_numel(v) * 8;
    void *dst;

    *copied = -1;
    if (sscanf(op, " %31s%n", name, &consumed) != 1)
        return KV_ERR_INVALID_ARG;
    args = op + consumed;
    if (!strcmp(name, "permute")) {
        int perm[LIST_MAX];
        n = parse_list(args, a);
        for (int i = 0; i < n; i++)
            perm[i] = (int)a[i];
        return kv_view_permute(v, perm, n, v);
    }
    if (!strcmp(name, "transpose") || !strcmp(name, "unsqueeze") || !strcmp(name, "squeeze") ||
        !strcmp(name, "select") || !strcmp(name, "narrow") || !strcmp(name, "slice") ||
        !strcmp(name, "diagonal")) {
        long long x[4] = {0};
        int k = sscanf(args, "%lld %lld %lld %lld", &x[0], &x[1], &x[2], &x[3]);
        if (!strcmp(name, "transpose") && k == 2)
            return kv_view_transpose(v, (int)x[0], (int)x[1], v);
        if (!strcmp(name, "unsqueeze") && k == 1)
            return kv_view_unsqueeze(v, (int)x[0], v);
        if (!strcmp(name, "squeeze") && k == 1)
            return kv_view_squeeze(v, (int)x[0], v);
        if (!strcmp(name, "select") && k == 2)
            return kv_view_select(v, (int)x[0], x[1], v);
        if (!strcmp(name, "narrow") && k == 3)
            return kv_view_narrow(v, (int)x[0], x[1], x[2], v);
        if (!strcmp(name, "slice") && k == 4)
            return kv_view_slice(v, (int)x[0], x[1], x[2], x[3], v);
        if (!strcmp(name, "diagonal") && k == 3)
            return kv_view_diagonal(v, x[0], (int)x[1], (int)x[2], v);
        fail_msg("bad arguments for %s: '%s'", name, args);
    }
    if (!strcmp(name, "expand")) {
        n = parse_list(args, a);
        return kv_view_expand(v, n, a, v);
    }
    if (!strcmp(name, "view")) {
        n = parse_list(args, a);
        return kv_view_view(v, n, a, v);
    }
    assert_true(r->nbufs < 64);
    dst = kv__mem_alloc(need ? need : 8);
    assert_non_null(dst);
    r->bufs[r->nbufs++] = dst;
    if (!strcmp(name, "reshape")) {
        n = parse_list(args, a);
        st = kv_view_reshape(v, n, a, dst, need, v, &cp);
    } else if (!strcmp(name, "flatten")) {
        int x0, x1;
        assert_int_equal(sscanf(args, "%d %d", &x0, &x1), 2);
        st = kv_view_flatten(v, x0, x1, dst, need, v, &cp);
    } else if (!strcmp(name, "contiguous")) {
        st = kv_view_contiguous(v, dst, need, v, &cp);
    } else {
        fail_msg("unknown op '%s'", name);
        return KV_ERR_INVALID_ARG;
    }
    *copied = cp;
    return st;
}

static int check_expect(const struct kv_view *v, const char *exp, char *why, size_t cap)
{
    int64_t shape[LIST_MAX], strides[LIST_MAX], sum, wsum, esum, ewsum, eoff;
    int nshape, nstrides, econtig;
    const char *p;
    int64_t numel = kv_view_numel(v);

    p = strstr(exp, "shape=");
    nshape = parse_list(p + 6, shape);
    p = strstr(exp, "strides=");
    nstrides = parse_list(p + 8, strides);
    eoff = strtoll(strstr(exp, "offset=") + 7, NULL, 10);
    econtig = atoi(strstr(exp, "contiguous=") + 11);
    esum = strtoll(strstr(exp, "sum=") + 4, NULL, 10);
    ewsum = strtoll(strstr(exp, "wsum=") + 5, NULL, 10);

    if (nshape != v->ndim || nstrides != v->ndim)
        return snprintf(why, cap, "ndim %d, expected %d", v->ndim, nshape), 0;
    for (int i = 0; i < nshape; i++) {
        if (shape[i] != v->shape[i])
            return snprintf(why, cap, "shape[%d]=%lld expected %lld", i, (long long)v->shape[i],
                            (long long)shape[i]),
                   0;
        if (shape[i] != 1 && strides[i] != v->strides[i])
            return snprintf(why, cap, "strides[%d]=%lld expected %lld", i, (long long)v->strides[i],
                            (long long)strides[i]),
                   0;
    }
    if (numel > 0 && eoff != v->offset)
        return snprintf(why, cap, "offset=%lld expected %lld", (long long)v->offset,
                        (long long)eoff),
               0;
    if ((int)kv_view_is_contiguous(v) != econtig)
        return snprintf(why, cap, "contiguous=%d expected %d", kv_view_is_contiguous(v), econtig),
               0;
    ref_sums(v, &sum, &wsum);
    if (sum != esum || wsum != ewsum)
        return snprintf(why, cap, "sum=%lld wsum=%lld expected %lld %lld", (long long)sum,
                        (long long)wsum, (long long)esum, (long long)ewsum),
               0;
    /* The library's materialize must agree with the reference walk. */
    if (numel > 0) {
        int64_t *buf = kv__mem_alloc((size_t)numel * 8), msum = 0, mwsum = 0;
        kv_status st;
        assert_non_null(buf);
        st = kv_view_materialize(v, buf, (size_t)numel * 8);
        for (int64_t i = 0; st == KV_OK && i < numel; i++) {
            msum += buf[i];
            mwsum += i * buf[i];
        }
        kv__mem_free(buf);
        if (st != KV_OK || msum != esum || mwsum != ewsum)
            return snprintf(why, cap, "materialize: %s sum=%lld wsum=%lld", kv_status_name(st),
                            (long long)msum, (long long)mwsum),
                   0;
    }
    return 1;
}

/* Replay one line; returns 1 when it matches. */
static int replay_line(char *line, char *why, size_t cap)
{
    struct replay r = {.nbufs = 0};
    struct kv_view v;
    int64_t shape[LIST_MAX], numel = 1;
    char *save = NULL, *tok;
    int ndim, ok = 0;
    int64_t *storage;

    tok = strtok_r(line, "|", &save);
    assert_non_null(tok);
    assert_int_equal(strncmp(tok, "start ", 6), 0);
    ndim = parse_list(tok + 6, shape);
    for (int i = 0; i < ndim; i++)
        numel *= shape[i];
    storage = kv__mem_alloc((size_t)(numel ? numel : 1) * 8);
    assert_non_null(storage);
    for (int64_t i = 0; i < numel; i++)
        storage[i] = i;
    assert_int_equal(kv_view_init(storage, (size_t)numel * 8, KV_I64, ndim, shape, &v), KV_OK);

    while ((tok = strtok_r(NULL, "|", &save)) != NULL) {
        char *next;
        int copied, want_copy;
        kv_status st;
        while (*tok == ' ')
            tok++;
        if (!strncmp(tok, "expect", 6)) {
            ok = check_expect(&v, tok, why, cap);
            break;
        }
        next = save;
        while (next && *next == ' ')
            next++;
        struct kv_view before = v;
        st = apply_op(&r, tok, &v, &copied);
        if (next && !strncmp(next, "error", 5)) {
            if (st == KV_OK)
                snprintf(why, cap, "op '%s' succeeded but PyTorch refused it", tok);
            else if (kv_last_error()[0] == '\0')
                snprintf(why, cap, "op '%s' failed without a message", tok);
            else if (kvt_view_diff(&before, &v)[0] != '\0')
                snprintf(why, cap, "op '%s' was refused but changed its output", tok);
            else
                ok = 1;
            break;
        }
        if (st != KV_OK) {
            snprintf(why, cap, "op '%s' failed: %s: %s", tok, kv_status_name(st), kv_last_error());
            break;
        }
        want_copy = parse_copy_flag(tok);
        if (want_copy >= 0 && copied != want_copy) {
            snprintf(why, cap, "op '%s' copied=%d expected %d", tok, copied, want_copy);
            break;
        }
    }
    for (int i = 0; i < r.nbufs; i++)
        kv__mem_free(r.bufs[i]);
    kv__mem_free(storage);
    return ok;
}

/* Replay every line of tests/data/<file>; want_lines guards against a
 * truncated copy of the data. */
static void replay_file(const char *file, int want_lines)
{
    char line[4096], copy[4096], why[512];
    int lines = 0, failed = 0, errors = 0;
    FILE *f = fopen(kvt_data_path(file), "r");
    if (!f)
        fail_msg("cannot open %s", kvt_data_path(file));
    while (fgets(line, sizeof(line), f)) {
        line[strcspn(line, "\n")] = '\0';
        if (line[0] == '#' || line[0] == '\0')
            continue;
        lines++;
        if (strstr(line, "| error"))
            errors++;
        strcpy(copy, line);
        why[0] = '\0';
        if (!replay_line(copy, why, sizeof(why))) {
            if (failed < 15)
                print_message("MISMATCH %s\n    -> %s\n", line, why);
            failed++;
        }
    }
    fclose(f);
    print_message("%s: %d lines (%d expected errors), %d mismatches\n", file, lines, errors,
                  failed);
    assert_int_equal(lines, want_lines);
    assert_int_equal(failed, 0);
}

static void test_view_conformance_vectors(void **state)
{
    (void)state;
    replay_file("strided_views.txt", 3000);
}

/* Negative dims and indices PyTorch accepts, and arguments it refuses: each
 * refusal must be an error with a message, and leave the output untouched. */
static void test_view_conformance_edge_vectors(void **state)
{
    (void)state;
    replay_file("strided_views_edges.txt", 1000);
}

/* ---- edge cases and bad input -------------------------------------------- */

static int64_t g_buf[4096];

static void make(struct kv_view *v, int ndim, const int64_t *shape)
{
    assert_int_equal(kv_view_init(g_buf, sizeof(g_buf), KV_I64, ndim, shape, v), KV_OK);
}

#define assert_msg_has(s) assert_non_null(strstr(kv_last_error(), (s)))

/* A NULL base with storage_bytes > 0 is refused even when the shape is
 * empty (the geometry check alone let [0] through), as kv_view_from_strided
 * refuses it. */
static void test_view_init_null_base_with_storage(void **state)
{
    struct kv_view v, before;
    int64_t empty[2] = {0, 4};
    (void)state;
    memset(&v, 0x5a, sizeof(v));
    before = v;
    assert_int_equal(kv_view_init(NULL, 100, KV_F32, 2, empty, &v), KV_ERR_NULL);
    assert_msg_has("base is NULL with storage_bytes 100");
    assert_string_equal(kvt_view_diff(&v, &before), "");
    assert_int_equal(kv_view_from_strided(NULL, 100, KV_F32, 2, empty, empty, 0, &v), KV_ERR_NULL);
    /* no storage at all: an empty view over nothing is fine */
    assert_int_equal(kv_view_init(NULL, 0, KV_F32, 2, empty, &v), KV_OK);
    assert_int_equal(kv_view_numel(&v), 0);
}

static void test_view_init_bad_input(void **state)
{
    struct kv_view v, before;
    int64_t shape9[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1}, neg[2] = {3, -2}, big[2] = {100, 100};
    (void)state;
    memset(&v, 0x5a, sizeof(v));
    before = v;
    assert_int_equal(kv_view_init(g_buf, sizeof(g_buf), KV_F32, 9, shape9, &v), KV_ERR_BAD_DIM);
    assert_msg_has("9");
    assert_int_equal(kv_view_init(g_buf, sizeof(g_buf), KV_F32, 2, neg, &v), KV_ERR_BAD_SHAPE);
    assert_msg_has("-2");
    assert_int_equal(kv_view_init(g_buf, 1000, KV_F32, 2, big, &v), KV_ERR_OUT_OF_BOUNDS);
    assert_msg_has("1000");
    assert_int_equal(kv_view_init(NULL, 0, KV_F32, 2, big, &v), KV_ERR_NULL);
    {
        int64_t wide[4] = {0, 99999999999, 99999999999, 99999999999}; /* empty, yet */
        assert_int_equal(kv_view_init(g_buf, 0, KV_F32, 4, wide, &v), KV_ERR_OVERFLOW);
        assert_msg_has("overflow");
    }
    assert_int_equal(kv_view_init(g_buf, sizeof(g_buf), KV_F32, 2, big, NULL), KV_ERR_NULL);
    assert_int_equal(kv_view_init(g_buf, sizeof(g_buf), (kv_dtype)99, 2, big, &v),
                     KV_ERR_INVALID_ARG);
    assert_string_equal(kvt_view_diff(&v, &before), ""); /* failures leave out unchanged */
    /* A 0-d view is one element; numel of an empty shape dim is 0. */
    assert_int_equal(kv_view_init(g_buf, 8, KV_I64, 0, NULL, &v), KV_OK);
    assert_int_equal(kv_view_numel(&v), 1);
    assert_string_equal(kv_last_error(), "");
}

static void test_view_permute_bad_input(void **state)
{
    struct kv_view v, w;
    int64_t shape[3] = {2, 3, 4};
    int dup[3] = {0, 2, 0}, range[3] = {0, 1, 3}, neg[3] = {-1, 0, 1};
    (void)state;
    make(&v, 3, shape);
    w = v;
    assert_int_equal(kv_view_permute(&v, dup, 3, &w), KV_ERR_INVALID_ARG);
    assert_msg_has("dim 0 appears twice");
    assert_int_equal(kv_view_permute(&v, range, 3, &w), KV_ERR_BAD_DIM);
    assert_msg_has("3");
    assert_string_equal(kvt_view_diff(&v, &w), "");
    /* a permutation of the wrong length is refused, whichever way it errs */
    assert_int_equal(kv_view_permute(&v, neg, 2, &w), KV_ERR_BAD_DIM);
    assert_msg_has("2 entries for a 3-d view");
    assert_int_equal(kv_view_permute(&v, (const int[]){0, 1, 2, 3}, 4, &w), KV_ERR_BAD_DIM);
    assert_msg_has("4 entries for a 3-d view");
    assert_int_equal(kv_view_permute(&v, neg, 0, &w), KV_ERR_BAD_DIM);
    assert_string_equal(kvt_view_diff(&v, &w), "");
    assert_int_equal(kv_view_permute(&v, neg, 3, &w), KV_OK);
    assert_int_equal(w.shape[0], 4);
    assert_int_equal(w.strides[0], 1);
    assert_int_equal(w.shape[2], 3);
    assert_int_equal(kv_view_permute(NULL, neg, 3, &w), KV_ERR_NULL);
    assert_int_equal(kv_view_permute(&v, NULL, 3, &w), KV_ERR_NULL);
}

static void test_view_slice_steps_and_clamping(void **state)
{
    struct kv_view v, w;
    int64_t shape[2] = {10, 4};
    (void)state;
    make(&v, 2, shape);
    assert_int_equal(kv_view_slice(&v, 0, 1, 8, 3, &w), KV_OK); /* rows 1,4,7 */
    assert_int_equal(w.shape[0], 3);
    assert_int_equal(w.strides[0], 12);
    assert_int_equal(w.offset, 4);
    assert_int_equal(kv_view_slice(&v, 0, -3, 100, 1, &w), KV_OK); /* rows 7..9 */
    assert_int_equal(w.shape[0], 3);
    assert_int_equal(w.offset, 28);
    assert_int_equal(kv_view_slice(&v, 0, 6, 2, 1, &w), KV_OK); /* empty */
    assert_int_equal(w.shape[0], 0);
    assert_int_equal(kv_view_slice(&v, 1, 0, 4, 0, &w), KV_ERR_INVALID_ARG);
    assert_msg_has("step 0");
    assert_int_equal(kv_view_slice(&v, 1, 0, 4, -1, &w), KV_ERR_INVALID_ARG);
    assert_msg_has("-1");
    assert_int_equal(kv_view_slice(&v, 2, 0, 4, 1, &w), KV_ERR_BAD_DIM);
    assert_msg_has("dim 2");
}

static void test_view_narrow_select_bounds(void **state)
{
    struct kv_view v, w;
    int64_t shape[2] = {5, 6};
    (void)state;
    make(&v, 2, shape);
    assert_int_equal(kv_view_narrow(&v, 1, 4, 3, &w), KV_ERR_OUT_OF_BOUNDS);
    assert_msg_has("size 6");
    assert_int_equal(kv_view_narrow(&v, 1, -2, 2, &w), KV_OK);
    assert_int_equal(w.offset, 4);
    assert_int_equal(kv_view_narrow(&v, 0, 0, -1, &w), KV_ERR_OUT_OF_BOUNDS);
    assert_int_equal(kv_view_select(&v, 0, 5, &w), KV_ERR_OUT_OF_BOUNDS);
    assert_msg_has("index 5");
    assert_int_equal(kv_view_select(&v, 0, -1, &w), KV_OK);
    assert_int_equal(w.ndim, 1);
    assert_int_equal(w.offset, 24);
    assert_int_equal(kv_view_select(&v, -3, 0, &w), KV_ERR_BAD_DIM);
}

static void test_view_unsqueeze_squeeze(void **state)
{
    struct kv_view v, w;
    int64_t shape[2] = {3, 4}, s8[8] = {1, 1, 1, 1, 1, 1, 1, 1};
    (void)state;
    make(&v, 2, shape);
    assert_int_equal(kv_view_unsqueeze(&v, -1, &w), KV_OK);
    assert_int_equal(w.ndim, 3);
    assert_int_equal(w.shape[2], 1);
    assert_int_equal(kv_view_squeeze(&w, 2, &w), KV_OK);
    assert_int_equal(w.ndim, 2);
    assert_int_equal(kv_view_squeeze(&w, 0, &w), KV_OK); /* size 3: unchanged */
    assert_int_equal(w.ndim, 2);
    assert_int_equal(kv_view_unsqueeze(&v, 3, &w), KV_ERR_BAD_DIM);
    make(&v, 8, s8);
    assert_int_equal(kv_view_unsqueeze(&v, 0, &w), KV_ERR_BAD_DIM);
    assert_msg_has("max 8");
}

static void test_view_expand_rules(void **state)
{
    struct kv_view v, w;
    int64_t shape[2] = {3, 1}, ok[3] = {2, 3, 5}, bad[2] = {4, 5}, keep[2] = {-1, 7},
            lead_neg[3] = {-1, 3, 1};
    (void)state;
    make(&v, 2, shape);
    assert_int_equal(kv_view_expand(&v, 3, ok, &w), KV_OK);
    assert_int_equal(w.strides[0], 0);
    assert_int_equal(w.strides[1], 1);
    assert_int_equal(w.strides[2], 0);
    assert_int_equal(kv_view_numel(&w), 30);
    assert_int_equal(kv_view_expand(&v, 2, bad, &w), KV_ERR_BAD_SHAPE);
    assert_msg_has("size 3");
    assert_msg_has("4");
    assert_int_equal(kv_view_expand(&v, 2, keep, &w), KV_OK);
    assert_int_equal(w.shape[0], 3);
    assert_int_equal(w.shape[1], 7);
    assert_int_equal(kv_view_expand(&v, 3, lead_neg, &w), KV_ERR_BAD_SHAPE);
    assert_int_equal(kv_view_expand(&v, 1, ok, &w), KV_ERR_BAD_DIM);
}

static void test_view_diagonal_offsets(void **state)
{
    struct kv_view v, w;
    int64_t shape[2] = {3, 4}, sum, wsum;
    (void)state;
    for (int i = 0; i < 12; i++)
        g_buf[i] = i;
    make(&v, 2, shape);
    assert_int_equal(kv_view_diagonal(&v, 1, 0, 1, &w), KV_OK); /* 1, 6, 11 */
    assert_int_equal(w.shape[0], 3);
    assert_int_equal(w.strides[0], 5);
    ref_sums(&w, &sum, &wsum);
    assert_int_equal(sum, 18);
    assert_int_equal(kv_view_diagonal(&v, -2, 0, 1, &w), KV_OK); /* 8 */
    assert_int_equal(w.shape[0], 1);
    assert_int_equal(w.offset, 8);
    assert_int_equal(kv_view_diagonal(&v, 9, 0, 1, &w), KV_OK);
    assert_int_equal(w.shape[0], 0);
    assert_int_equal(kv_view_diagonal(&v, 0, 1, 1, &w), KV_ERR_INVALID_ARG);
    assert_msg_has("dim 1");
}

static void test_view_view_refusal_names_dims(void **state)
{
    struct kv_view v, w;
    int64_t shape[3] = {2, 3, 4}, flat[1] = {24}, split[4] = {2, 3, 2, 2}, two[2] = {-1, -1},
            bad[2] = {5, 5};
    (void)state;
    make(&v, 3, shape);
    assert_int_equal(kv_view_transpose(&v, 1, 2, &w), KV_OK);
    assert_int_equal(kv_view_view(&w, 1, flat, &w), KV_ERR_NEEDS_COPY);
    assert_msg_has("dims 1 and 2 cannot be merged");
    assert_int_equal(kv_view_transpose(&v, 1, 2, &w), KV_OK);
    assert_int_equal(kv_view_view(&w, 4, split, &w),
                     KV_ERR_NEEDS_COPY); /* splits dim of stride 1 */
    assert_int_equal(kv_view_view(&v, 2, two, &w), KV_ERR_BAD_SHAPE);
    assert_msg_has("only one dimension");
    assert_int_equal(kv_view_view(&v, 2, bad, &w), KV_ERR_BAD_SHAPE);
    assert_msg_has("24");
    assert_int_equal(kv_view_view(&v, 4, split, &w), KV_OK);
    assert_int_equal(w.strides[1], 4);
    assert_int_equal(w.strides[3], 1);
}

static void test_view_as_strided_bounds(void **state)
{
    struct kv_view v, w;
    int64_t shape[1] = {16}, s2[2] = {4, 4}, st2[2] = {4, 1}, neg[2] = {-4, 1};
    char buf[64];
    (void)state;
    assert_int_equal(kv_view_init(buf, 64, KV_F32, 1, shape, &v), KV_OK);
    assert_int_equal(kv_view_as_strided(&v, 2, s2, st2, 0, &w), KV_OK);
    assert_int_equal(kv_view_as_strided(&v, 2, s2, st2, 1, &w), KV_ERR_OUT_OF_BOUNDS);
    assert_msg_has("element 16");
    assert_msg_has("byte 67");
    assert_msg_has("64 bytes");
    assert_int_equal(kv_view_as_strided(&v, 2, s2, neg, 12, &w), KV_ERR_INVALID_ARG);
    assert_msg_has("-4");
    assert_int_equal(kv_view_as_strided(&v, 2, s2, st2, -1, &w), KV_ERR_OUT_OF_BOUNDS);
}

static void test_view_sliding_window(void **state)
{
    struct kv_view v, w;
    int64_t shape[1] = {6};
    (void)state;
    for (int i = 0; i < 6; i++)
        g_buf[i] = 10 * i;
    make(&v, 1, shape);
    assert_int_equal(kv_view_sliding_window(&v, 0, 3, &w), KV_OK);
    assert_int_equal(w.ndim, 2);
    assert_int_equal(w.shape[0], 4);
    assert_int_equal(w.shape[1], 3);
    for (int64_t i = 0; i < 4; i++)
        for (int64_t j = 0; j < 3; j++) {
            int64_t idx[2] = {i, j};
            assert_int_equal(*(int64_t *)kv_view_ptr(&w, idx), 10 * (i + j));
        }
    assert_int_equal(kv_view_sliding_window(&v, 0, 7, &w), KV_ERR_BAD_SHAPE);
    assert_msg_has("window 7");
}

static void test_view_contiguity_rules(void **state)
{
    struct kv_view v;
    int64_t shape[3] = {2, 1, 3}, strides[3] = {3, 99, 1}, zero[2] = {0, 5}, zs[2] = {7, 9};
    (void)state;
    make(&v, 3, shape);
    assert_true(kv_view_is_contiguous(&v));
    assert_int_equal(kv_view_as_strided(&v, 3, shape, strides, 0, &v), KV_OK);
    assert_true(kv_view_is_contiguous(&v)); /* size-1 dims' strides are ignored */
    assert_false(kv_view_is_f_contiguous(&v));
    assert_int_equal(kv_view_as_strided(&v, 2, zero, zs, 0, &v), KV_OK);
    assert_true(kv_view_is_contiguous(&v)); /* numel 0 is contiguous */
    assert_true(kv_view_is_f_contiguous(&v));
}

static void test_view_reshape_copy_reported_and_counted(void **state)
{
    struct kv_view v, w;
    int64_t shape[2] = {3, 4}, flat[1] = {12}, got[12];
    struct kv_copy_stats s;
    bool copied = false;
    (void)state;
    for (int i = 0; i < 12; i++)
        g_buf[i] = i;
    make(&v, 2, shape);
    assert_int_equal(kv_view_transpose(&v, 0, 1, &v), KV_OK);
    assert_int_equal(kv_view_reshape(&v, 1, flat, NULL, 0, &w, &copied), KV_ERR_NEEDS_COPY);
    kv_copy_stats_reset();
    assert_int_equal(kv_view_reshape(&v, 1, flat, got, sizeof(got), &w, &copied), KV_OK);
    assert_true(copied);
    kv_copy_stats_get(&s);
    assert_int_equal(s.calls[KV_COPY_RESHAPE], 1);
    assert_int_equal(s.bytes[KV_COPY_RESHAPE], 96);
    for (int i = 0; i < 12; i++)
        assert_int_equal(got[i], (i % 3) * 4 + i / 3);
    assert_int_equal(kv_view_reshape(&v, 1, flat, got, 95, &w, &copied), KV_ERR_OUT_OF_BOUNDS);
    assert_msg_has("96");
    /* contiguous of a contiguous view: no copy, same view */
    make(&v, 2, shape);
    assert_int_equal(kv_view_contiguous(&v, NULL, 0, &w, &copied), KV_OK);
    assert_false(copied);
    assert_string_equal(kvt_view_diff(&v, &w), "");
    kv_copy_stats_get(&s);
    assert_int_equal(s.calls[KV_COPY_CONTIGUOUS], 0);
}

static void test_view_large_offsets_are_64bit(void **state)
{
    struct kv_view v, w;
    /* 2^33 bf16 elements: described, never touched. */
    int64_t shape[3] = {1 << 20, 1 << 5, 1 << 8}, idx[3] = {(1 << 20) - 1, 31, 255}, off;
    (void)state;
    assert_int_equal(kv_view_init((void *)0x1000, (size_t)1 << 34, KV_BF16, 3, shape, &v), KV_OK);
    assert_int_equal(kv_view_offset_of(&v, idx, &off), KV_OK);
    assert_true(off == ((int64_t)1 << 33) - 1);
    assert_int_equal(kv_view_transpose(&v, 0, 2, &w), KV_OK);
    assert_int_equal(w.strides[2], (int64_t)1 << 13);
    assert_int_equal(kv_view_init((void *)0x1000, ((size_t)1 << 34) - 1, KV_BF16, 3, shape, &v),
                     KV_ERR_OUT_OF_BOUNDS);
}

static void test_view_describe_line(void **state)
{
    struct kv_view v;
    int64_t shape[3] = {2, 3, 4};
    char line[512];
    (void)state;
    assert_int_equal(kv_view_init(g_buf, sizeof(g_buf), KV_BF16, 3, shape, &v), KV_OK);
    assert_int_equal(kv_view_transpose(&v, 0, 1, &v), KV_OK);
    assert_true(kv_view_describe(&v, line, sizeof(line)) > 0);
    assert_non_null(strstr(line, "shape=[3,2,4]"));
    assert_non_null(strstr(line, "strides=[4,12,1] elems"));
    assert_non_null(strstr(line, "[8,24,2] bytes"));
    assert_non_null(strstr(line, "dtype=bf16"));
    assert_non_null(strstr(line, "contiguous=no"));
    assert_null(strchr(line, '\n'));
}

/* Hand-built views are untrusted: a bad ndim, a misaligned base or strides
 * whose products overflow are refused, never indexed or wrapped. */
/* Geometry whose products leave int64: every op says so with
 * KV_ERR_OVERFLOW (never wrapped strides, never a UBSan abort) and leaves the
 * output untouched; predicates and describe never multiply the fields of a
 * view the validator rejects. */
static void test_view_overflow_edges(void **state)
{
    struct kv_view e, w, before;
    char line[512];
    int64_t zero = 0, big[4] = {0, (int64_t)1 << 22, (int64_t)1 << 22, (int64_t)1 << 22};
    (void)state;
    /* [0] viewed as [0, 2^22, 2^22, 2^22]: C strides 2^66 */
    assert_int_equal(kv_view_init(g_buf, sizeof(g_buf), KV_F32, 1, &zero, &e), KV_OK);
    memset(&w, 0x5A, sizeof(w));
    before = w;
    assert_int_equal(kv_view_view(&e, 4, big, &w), KV_ERR_OVERFLOW);
    assert_msg_has("overflow int64");
    assert_string_equal(kvt_view_diff(&w, &before), "");
    assert_int_equal(kv_view_reshape(&e, 4, big, NULL, 0, &w, NULL), KV_ERR_OVERFLOW);
    assert_string_equal(kvt_view_diff(&w, &before), "");
    /* the same shape with strides that do fit is fine */
    int64_t fits[4] = {0, (int64_t)1 << 20, (int64_t)1 << 20, (int64_t)1 << 20};
    assert_int_equal(kv_view_view(&e, 4, fits, &w), KV_OK);
    assert_int_equal(w.strides[0], (int64_t)1 << 60);
    assert_int_equal(w.strides[1], (int64_t)1 << 40);
    /* flatten of [0, 2^40, 2^40] (strides 1): merged size 2^80 */
    int64_t sh3[3] = {0, (int64_t)1 << 40, (int64_t)1 << 40}, st3[3] = {1, 1, 1};
    assert_int_equal(kv_view_as_strided(&e, 3, sh3, st3, 0, &e), KV_OK);
    w = before;
    assert_int_equal(kv_view_flatten(&e, 1, 2, NULL, 0, &w, NULL), KV_ERR_OVERFLOW);
    assert_msg_has("merging dims 1..2");
    assert_string_equal(kvt_view_diff(&w, &before), "");
    /* a view of an empty shape keeps any other sizes: [2^62, 0, 2^62] */
    int64_t wide[3] = {(int64_t)1 << 62, 0, (int64_t)1 << 62};
    assert_int_equal(kv_view_init(g_buf, sizeof(g_buf), KV_F32, 1, &zero, &e), KV_OK);
    assert_int_equal(kv_view_view(&e, 3, wide, &w), KV_OK);
    assert_int_equal(kv_view_numel(&w), 0);
    assert_int_equal(kv_view_view(&w, 3, wide, &w), KV_OK); /* and views as itself */
    /* the validator's own bound: last element INT64_MAX (as_strided of
     * [2, 1] with stride INT64_MAX - 1 from offset 1) */
    int64_t two1[2] = {2, 1}, far[2] = {INT64_MAX - 1, 1};
    assert_int_equal(kv_view_init(g_buf, sizeof(g_buf), KV_U8, 1, &zero, &e), KV_OK);
    w = before;
    assert_int_equal(kv_view_as_strided(&e, 2, two1, far, 1, &w), KV_ERR_OVERFLOW);
    assert_string_equal(kvt_view_diff(&w, &before), "");
    /* sliding window 0 over a dim of INT64_MAX (an empty view) */
    int64_t huge_empty[2] = {INT64_MAX, 0}, one1[2] = {1, 1};
    assert_int_equal(kv_view_as_strided(&e, 2, huge_empty, one1, 0, &e), KV_OK);
    assert_int_equal(kv_view_sliding_window(&e, 0, 0, &w), KV_ERR_OVERFLOW);
    assert_string_equal(kvt_view_diff(&w, &before), "");
    /* slice with step 2^63-1 on a size-3 dim: size 1, stride 2^63-1, a valid
     * view whose byte stride does not fit int64 (describe says so) */
    struct kv_view v;
    int64_t shape[2] = {2, 3};
    assert_int_equal(kv_view_init(g_buf, sizeof(g_buf), KV_F32, 2, shape, &v), KV_OK);
    assert_int_equal(kv_view_slice(&v, 1, 0, 3, INT64_MAX, &v), KV_OK);
    assert_int_equal(v.shape[1], 1);
    assert_int_equal(v.strides[1], INT64_MAX);
    assert_int_equal(kv_view_check(&v), KV_OK);
    assert_true(kv_view_describe(&v, line, sizeof(line)) > 0);
    assert_non_null(strstr(line, "strides=[3,9223372036854775807] elems ([12,(>int64)] bytes)"));
    assert_false(kv_view_is_contiguous(&v)); /* dim 0 steps 3 elements, as in PyTorch */
    /* the same step on dim 0 (stride 3): 3 x (2^63-1) is past int64, but the
     * result has one element, so the step is never taken: the view, with
     * dim 0's stride as it was, at row 1 for start 1 */
    struct kv_view r;
    assert_int_equal(kv_view_init(g_buf, sizeof(g_buf), KV_F32, 2, shape, &r), KV_OK);
    assert_int_equal(kv_view_slice(&r, 0, 1, 2, INT64_MAX, &r), KV_OK);
    assert_int_equal(r.shape[0], 1);
    assert_int_equal(r.strides[0], 3);
    assert_int_equal(r.offset, 3);
    assert_int_equal(kv_view_check(&r), KV_OK);
    assert_int_equal(kv_view_slice(&r, 0, 1, 1, INT64_MAX, &r), KV_OK); /* empty */
    assert_int_equal(r.shape[0], 0);
    /* a hand-built view the validator rejects: predicates say false and leave
     * the last error alone; describe prints why */
    struct kv_view bad = v;
    bad.strides[0] = INT64_MAX; /* reaches past any storage */
    assert_int_equal(kv_view_init(g_buf, sizeof(g_buf), KV_F32, 1, &zero, &e), KV_OK);
    assert_string_equal(kv_last_error(), "");
    assert_false(kv_view_is_contiguous(&bad));
    assert_false(kv_view_is_f_contiguous(&bad));
    int64_t lo = 1, hi = 1;
    kv_view_extent_bytes(&bad, &lo, &hi);
    (void)kv_view_may_share(&bad, &v);
    assert_string_equal(kv_last_error(), "");
    assert_true(kv_view_describe(&bad, line, sizeof(line)) > 0);
    assert_non_null(strstr(line, "(invalid view: kv_view_describe: "));
    assert_non_null(strstr(line, "int64"));
}

static void test_view_hand_built_views_refused(void **state)
{
    struct kv_view v, w, before;
    int64_t shape[2] = {1, 1}, huge[2] = {(int64_t)1 << 62, (int64_t)1 << 62}, one = 1;
    (void)state;
    make(&v, 2, shape);
    v.ndim = 64;
    before = v;
    assert_int_equal(kv_view_select(&v, 40, 0, &w), KV_ERR_BAD_DIM);
    assert_msg_has("ndim 64");
    assert_int_equal(kv_view_transpose(&v, 0, 1, &v), KV_ERR_BAD_DIM);
    assert_string_equal(kvt_view_diff(&v, &before), "");
    {
        char line[128];
        int64_t idx[64] = {0}, off = 0;
        assert_false(kv_view_is_contiguous(&v));
        assert_false(kv_view_is_f_contiguous(&v));
        assert_int_equal(kv_view_offset_of(&v, idx, &off), KV_ERR_BAD_DIM);
        assert_null(kv_view_ptr(&v, idx));
        kv_view_describe(&v, line, sizeof(line));
        assert_non_null(strstr(line, "invalid view: kv_view_describe: ndim 64"));
    }
    make(&v, 2, shape);
    v.shape[1] = -6;
    assert_int_equal(kv_view_numel(&v), 0);
    assert_false(kv_view_is_contiguous(&v));
    v.shape[1] = 1;
    v.dtype = (kv_dtype)77;
    assert_false(kv_view_is_contiguous(&v));
    assert_int_equal(kv_view_numel(&v), 0);
    make(&v, 2, shape);
    v.offset = -3;
    assert_int_equal(kv_view_narrow(&v, 0, 0, 1, &w), KV_ERR_OUT_OF_BOUNDS);
    /* [1,1] with strides 2^62: valid (one element), but narrowing both dims
     * to empty would push the offset past int64 */
    make(&v, 2, shape);
    assert_int_equal(kv_view_as_strided(&v, 2, shape, huge, 0, &v), KV_OK);
    assert_int_equal(kv_view_narrow(&v, 0, 1, 0, &w), KV_OK);
    assert_int_equal(kv_view_narrow(&w, 1, 1, 0, &w), KV_ERR_OVERFLOW);
    assert_msg_has("overflows int64");
    assert_int_equal(kv_view_diagonal(&v, 0, 0, 1, &w), KV_ERR_OVERFLOW); /* 2^62 + 2^62 */
    make(&v, 2, shape);
    assert_int_equal(kv_view_diagonal(&v, INT64_MIN, 0, 1, &w), KV_OK); /* empty, no negation */
    assert_int_equal(w.shape[0], 0);
    /* a misaligned base for 8-byte elements */
    assert_int_equal(kv_view_init((char *)g_buf + 4, 64, KV_I64, 1, &one, &v), KV_ERR_INVALID_ARG);
    assert_msg_has("not aligned");
}

/* ---- kv_view_from_strided ------------------------------------------------ */

/* Fields, one by one (never struct memory). */
static void assert_same_view(const struct kv_view *a, const struct kv_view *b)
{
    assert_int_equal(a->dtype, b->dtype);
    assert_int_equal(a->ndim, b->ndim);
    for (int k = 0; k < a->ndim; k++) {
        assert_int_equal(a->shape[k], b->shape[k]);
        assert_int_equal(a->strides[k], b->strides[k]);
    }
    assert_int_equal(a->offset, b->offset);
    assert_ptr_equal(a->base, b->base);
    assert_int_equal(a->storage_bytes, b->storage_bytes);
}

/* The reference extent: walk every index and keep the highest byte reached
 * (one past it; 0 when there is no element). Independent of the library's
 * closed form. */
static int64_t ref_extent_bytes(int ndim, const int64_t *shape, const int64_t *strides,
                                int64_t offset_bytes, int64_t es)
{
    int64_t idx[KV_MAX_DIMS] = {0}, hi = 0;
    for (int k = 0; k < ndim; k++)
        if (shape[k] == 0)
            return 0;
    for (;;) {
        int64_t off = offset_bytes;
        for (int k = 0; k < ndim; k++)
            off += idx[k] * strides[k] * es;
        if (off + es > hi)
            hi = off + es;
        int k = ndim - 1;
        for (; k >= 0; k--) {
            if (++idx[k] < shape[k])
                break;
            idx[k] = 0;
        }
        if (k < 0)
            return hi;
    }
}

/* Torch-like views, each built two ways: from (base, shape, strides, byte
 * offset) and by the view ops over a contiguous tensor (what torch would
 * report for x.t(), x[1:, 1::2], x.expand(...)); the fields must agree, and
 * the computed storage (storage_bytes 0) must be the reference extent. */
static void test_view_from_strided_torch_cases(void **state)
{
    (void)state;
    float buf[64];
    struct kv_view x, w, v;
    int64_t s34[2] = {3, 4}, s46[2] = {4, 6}, s15[2] = {1, 5};

    /* x.t() of a [3][4] f32 */
    assert_int_equal(kv_view_init(buf, 48, KV_F32, 2, s34, &x), KV_OK);
    assert_int_equal(kv_view_transpose(&x, 0, 1, &w), KV_OK);
    int64_t t_shape[2] = {4, 3}, t_str[2] = {1, 4};
    assert_int_equal(kv_view_from_strided(buf, 48, KV_F32, 2, t_shape, t_str, 0, &v), KV_OK);
    assert_same_view(&v, &w);
    assert_int_equal(kv_view_from_strided(buf, 0, KV_F32, 2, t_shape, t_str, 0, &v), KV_OK);
    assert_int_equal(v.storage_bytes, 48);
    assert_int_equal(ref_extent_bytes(2, t_shape, t_str, 0, 4), 48);

    /* x[1:, 1::2] of a [4][6] f32: offset 7 elements = 28 bytes */
    assert_int_equal(kv_view_init(buf, 96, KV_F32, 2, s46, &x), KV_OK);
    assert_int_equal(kv_view_slice(&x, 0, 1, 4, 1, &w), KV_OK);
    assert_int_equal(kv_view_slice(&w, 1, 1, 6, 2, &w), KV_OK);
    int64_t sl_shape[2] = {3, 3}, sl_str[2] = {6, 2};
    assert_int_equal(kv_view_from_strided(buf, 96, KV_F32, 2, sl_shape, sl_str, 28, &v), KV_OK);
    assert_same_view(&v, &w);
    assert_int_equal(v.offset, 7);
    /* the last element is [2][2] = 7 + 12 + 4 = element 23: bytes 92..95 */
    assert_int_equal(kv_view_from_strided(buf, 0, KV_F32, 2, sl_shape, sl_str, 28, &v), KV_OK);
    assert_int_equal(v.storage_bytes, 96);
    assert_int_equal(ref_extent_bytes(2, sl_shape, sl_str, 28, 4), 96);
    /* x[:3, ::2] stops short of the storage's end: element 16, extent 68 */
    int64_t sl2_str[2] = {6, 2};
    assert_int_equal(kv_view_from_strided(buf, 0, KV_F32, 2, sl_shape, sl2_str, 0, &v), KV_OK);
    assert_int_equal(v.storage_bytes, 68);
    assert_int_equal(ref_extent_bytes(2, sl_shape, sl2_str, 0, 4), 68);

    /* a [1][5] row expanded to [3][5]: stride 0 */
    assert_int_equal(kv_view_init(buf, 20, KV_F32, 2, s15, &x), KV_OK);
    int64_t e_shape[2] = {3, 5}, e_str[2] = {0, 1};
    assert_int_equal(kv_view_expand(&x, 2, e_shape, &w), KV_OK);
    assert_int_equal(kv_view_from_strided(buf, 20, KV_F32, 2, e_shape, e_str, 0, &v), KV_OK);
    assert_same_view(&v, &w);
    assert_int_equal(kv_view_from_strided(buf, 0, KV_F32, 2, e_shape, e_str, 0, &v), KV_OK);
    assert_int_equal(v.storage_bytes, 20);

    /* zero-size dims reach nothing, whatever the strides and offset */
    int64_t z_shape[3] = {2, 0, 7}, z_str[3] = {INT64_MAX, INT64_MAX, 1};
    assert_int_equal(kv_view_from_strided(buf, 0, KV_F32, 3, z_shape, z_str, 4000, &v), KV_OK);
    assert_int_equal(v.storage_bytes, 0);
    assert_int_equal(v.offset, 1000);
    assert_int_equal(kv_view_numel(&v), 0);
    assert_int_equal(kv_view_check(&v), KV_OK);
    assert_int_equal(kv_view_from_strided(NULL, 0, KV_F32, 3, z_shape, z_str, 0, &v), KV_OK);
    /* size-1 dims take any stride: they are never stepped */
    int64_t o_shape[2] = {1, 4}, o_str[2] = {999999, 1};
    assert_int_equal(kv_view_from_strided(buf, 0, KV_F32, 2, o_shape, o_str, 8, &v), KV_OK);
    assert_int_equal(v.storage_bytes, 24);
    /* 0-d: one element at the offset */
    assert_int_equal(kv_view_from_strided(buf, 0, KV_F64, 0, NULL, NULL, 16, &v), KV_OK);
    assert_int_equal(v.storage_bytes, 24);
    assert_int_equal(kv_view_numel(&v), 1);
    /* the view is usable: element [1][2] of the slice above is buf[7 + 6 + 4] */
    for (int i = 0; i < 24; i++)
        buf[i] = (float)i;
    assert_int_equal(kv_view_from_strided(buf, 96, KV_F32, 2, sl_shape, sl_str, 28, &v), KV_OK);
    int64_t idx[2] = {1, 2};
    assert_ptr_equal(kv_view_ptr(&v, idx), &buf[17]);
}

/* Random shapes, strides (0 included) and offsets in 0..8 dims: the
 * computed storage is the walked extent; a storage of exactly that size is
 * accepted, one byte less refused naming both; the fields are the inputs. */
static void test_view_from_strided_random_extents(void **state)
{
    (void)state;
    static int64_t storage[1 << 16];
    uint64_t rng = 2024;
    const kv_dtype dts[4] = {KV_U8, KV_F16, KV_F32, KV_I64};
    int checked = 0;
    for (int iter = 0; iter < 3000; iter++) {
        int64_t shape[KV_MAX_DIMS], strides[KV_MAX_DIMS], numel = 1;
        const int ndim = (int)kvt_range(&rng, 0, KV_MAX_DIMS);
        for (int k = 0; k < ndim; k++) {
            shape[k] = kvt_range(&rng, 0, 10) == 0 ? 0 : kvt_range(&rng, 1, ndim > 4 ? 2 : 4);
            strides[k] = kvt_range(&rng, 0, 6) == 0 ? 0 : kvt_range(&rng, 1, 40);
            numel *= shape[k];
        }
        const kv_dtype dt = dts[kvt_range(&rng, 0, 3)];
        const int64_t es = (int64_t)kv_dtype_size(dt);
        const int64_t off = kvt_range(&rng, 0, 50) * es;
        const int64_t want = ref_extent_bytes(ndim, shape, strides, off, es);
        struct kv_view v;
        kv_status st = kv_view_from_strided(storage, 0, dt, ndim, shape, strides, off, &v);
        if (st != KV_OK)
            fail_msg("iter %d: %s", iter, kv_last_error());
        assert_int_equal(v.storage_bytes, (size_t)want);
        assert_int_equal(v.dtype, dt);
        assert_int_equal(v.ndim, ndim);
        for (int k = 0; k < ndim; k++) {
            assert_int_equal(v.shape[k], shape[k]);
            assert_int_equal(v.strides[k], strides[k]);
        }
        assert_int_equal(v.offset * es, off);
        assert_int_equal(kv_view_numel(&v), numel);
        int64_t lo, hi;
        kv_view_extent_bytes(&v, &lo, &hi);
        assert_int_equal(hi, want);
        if (want == 0)
            continue;
        assert_int_equal(
            kv_view_from_strided(storage, (size_t)want, dt, ndim, shape, strides, off, &v), KV_OK);
        struct kv_view keep = v;
        if (want == 1) /* storage_bytes 0 would mean "computed" */
            continue;
        st = kv_view_from_strided(storage, (size_t)want - 1, dt, ndim, shape, strides, off, &v);
        assert_int_equal(st, KV_ERR_OUT_OF_BOUNDS);
        char needle[96];
        snprintf(needle, sizeof(needle),
                 "reach byte %lld (extent %lld bytes) but storage_bytes is %lld",
                 (long long)want - 1, (long long)want, (long long)want - 1);
        if (!strstr(kv_last_error(), needle))
            fail_msg("\"%s\" lacks \"%s\"", kv_last_error(), needle);
        assert_same_view(&v, &keep); /* unchanged on failure */
        checked++;
    }
    assert_true(checked > 1000);
}

/* The PyTorch vectors again: every line that ends in a view of the original
 * arange storage (no copy on the way) gives torch's own (shape, strides,
 * storage_offset); the view built from them must read torch's checksums,
 * and fit the storage torch had. */
static void test_view_from_strided_torch_vectors(void **state)
{
    (void)state;
    char line[4096];
    int used = 0;
    FILE *f = fopen(kvt_data_path("strided_views.txt"), "r");
    if (!f)
        fail_msg("cannot open %s", kvt_data_path("strided_views.txt"));
    while (fgets(line, sizeof(line), f)) {
        line[strcspn(line, "\n")] = '\0';
        if (line[0] == '#' || strstr(line, "copy=1") || !strstr(line, "expect "))
            continue;
        int64_t start[LIST_MAX], shape[LIST_MAX], strides[LIST_MAX], numel = 1;
        const int n0 = parse_list(line + 6, start);
        for (int k = 0; k < n0; k++)
            numel *= start[k];
        const char *exp = strstr(line, "expect ");
        const int ndim = parse_list(strstr(exp, "shape=") + 6, shape);
        assert_int_equal(parse_list(strstr(exp, "strides=") + 8, strides), ndim);
        const int64_t off = strtoll(strstr(exp, "offset=") + 7, NULL, 10);
        const int64_t esum = strtoll(strstr(exp, "sum=") + 4, NULL, 10);
        const int64_t ewsum = strtoll(strstr(exp, "wsum=") + 5, NULL, 10);
        int64_t *storage = kv__mem_alloc((size_t)(numel ? numel : 1) * 8);
        assert_non_null(storage);
        for (int64_t i = 0; i < numel; i++)
            storage[i] = i;
        struct kv_view v;
        if (kv_view_from_strided(storage, 0, KV_I64, ndim, shape, strides, off * 8, &v) != KV_OK)
            fail_msg("%s: %s", line, kv_last_error());
        assert_int_equal(v.storage_bytes,
                         (size_t)ref_extent_bytes(ndim, shape, strides, off * 8, 8));
        assert_true(v.storage_bytes <= (size_t)numel * 8);
        int64_t sum, wsum;
        ref_sums(&v, &sum, &wsum);
        if (sum != esum || wsum != ewsum)
            fail_msg("%s: sum %lld wsum %lld", line, (long long)sum, (long long)wsum);
        if (kv_view_from_strided(storage, (size_t)numel * 8, KV_I64, ndim, shape, strides, off * 8,
                                 &v) != KV_OK)
            fail_msg("%s: %s", line, kv_last_error());
        kv__mem_free(storage);
        used++;
    }
    fclose(f);
    print_message("strided_views.txt: %d views rebuilt from (shape, strides, offset)\n", used);
    assert_true(used > 1500);
}

/* Every refusal names its values and leaves *out as it was. */
static void test_view_from_strided_bad_input(void **state)
{
    (void)state;
    float buf[64];
    struct kv_view v, keep;
    int64_t shape[2] = {4, 4}, strides[2] = {4, 1}, neg[2] = {4, -1};
    assert_int_equal(kv_view_from_strided(buf, 64, KV_F32, 2, shape, strides, 0, &v), KV_OK);
    keep = v;

    assert_int_equal(kv_view_from_strided(buf, 64, KV_F32, 2, shape, neg, 0, &v),
                     KV_ERR_INVALID_ARG);
    assert_msg_has("negative stride -1 at dim 1 of [4,-1]");
    assert_same_view(&v, &keep);
    assert_int_equal(kv_view_from_strided(buf, 64, KV_F32, 2, shape, strides, 6, &v),
                     KV_ERR_INVALID_ARG);
    assert_msg_has("offset_bytes 6 is not a multiple of the 4-byte element size of f32");
    assert_same_view(&v, &keep);
    assert_int_equal(kv_view_from_strided(buf, 64, KV_F32, 2, shape, strides, -4, &v),
                     KV_ERR_OUT_OF_BOUNDS);
    assert_msg_has("negative offset_bytes -4");
    /* one float too far: element 16, bytes 64..67 */
    assert_int_equal(kv_view_from_strided(buf, 64, KV_F32, 2, shape, strides, 4, &v),
                     KV_ERR_OUT_OF_BOUNDS);
    assert_msg_has("shape [4,4] strides [4,1] from offset_bytes 4 reach byte 67 (extent 68 bytes) "
                   "but storage_bytes is 64");
    assert_same_view(&v, &keep);
    int64_t s9[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1}, t9[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
    assert_int_equal(kv_view_from_strided(buf, 64, KV_F32, 9, s9, t9, 0, &v), KV_ERR_BAD_DIM);
    assert_msg_has("ndim 9 outside 0..8");
    assert_int_equal(kv_view_from_strided(buf, 64, KV_F32, -1, s9, t9, 0, &v), KV_ERR_BAD_DIM);
    int64_t negs[2] = {4, -2};
    assert_int_equal(kv_view_from_strided(buf, 64, KV_F32, 2, negs, strides, 0, &v),
                     KV_ERR_BAD_SHAPE);
    assert_msg_has("negative size -2 at dim 1");
    /* the extent past int64: 3 x 2^62 elements of 4 bytes */
    int64_t big_shape[1] = {4}, big_str[1] = {INT64_C(1) << 62};
    assert_int_equal(kv_view_from_strided(buf, 0, KV_F32, 1, big_shape, big_str, 0, &v),
                     KV_ERR_OVERFLOW);
    assert_msg_has("reach past int64 bytes");
    int64_t big_str2[1] = {INT64_C(1) << 60}; /* elements fit, bytes do not */
    assert_int_equal(kv_view_from_strided(buf, 0, KV_F32, 1, big_shape, big_str2, 0, &v),
                     KV_ERR_OVERFLOW);
    int64_t huge[3] = {INT64_C(1) << 30, INT64_C(1) << 30, INT64_C(1) << 30}, one3[3] = {0, 0, 0};
    assert_int_equal(kv_view_from_strided(buf, 0, KV_F32, 3, huge, one3, 0, &v), KV_ERR_OVERFLOW);
    assert_msg_has("element count");
    assert_same_view(&v, &keep);
    /* NULLs, the base, the dtype */
    assert_int_equal(kv_view_from_strided(buf, 64, KV_F32, 2, shape, strides, 0, NULL),
                     KV_ERR_NULL);
    assert_int_equal(kv_view_from_strided(buf, 64, KV_F32, 2, NULL, strides, 0, &v), KV_ERR_NULL);
    assert_int_equal(kv_view_from_strided(buf, 64, KV_F32, 2, shape, NULL, 0, &v), KV_ERR_NULL);
    assert_int_equal(kv_view_from_strided(NULL, 64, KV_F32, 2, shape, strides, 0, &v), KV_ERR_NULL);
    assert_msg_has("base is NULL with storage_bytes 64");
    assert_int_equal(kv_view_from_strided(NULL, 0, KV_F32, 2, shape, strides, 0, &v), KV_ERR_NULL);
    assert_int_equal(
        kv_view_from_strided((char *)buf + 2, 60, KV_F32, 1, big_shape, strides + 1, 0, &v),
        KV_ERR_INVALID_ARG);
    assert_msg_has("not aligned");
    assert_int_equal(kv_view_from_strided(buf, 64, (kv_dtype)999, 2, shape, strides, 0, &v),
                     KV_ERR_INVALID_ARG);
    assert_msg_has("unknown dtype 999");
    assert_same_view(&v, &keep);
}

static void test_view_status_names(void **state)
{
    (void)state;
    assert_string_equal(kv_status_name(KV_ERR_NEEDS_COPY), "KV_ERR_NEEDS_COPY");
    assert_string_equal(kv_status_name(KV_OK), "KV_OK");
    assert_string_equal(kv_status_name((kv_status)12345), "KV_UNKNOWN_STATUS");
    assert_string_equal(kv_strerror(KV_ERR_NO_BLOCKS), "not enough free blocks");
    assert_int_equal(kv_dtype_size(KV_BF16), 2);
    assert_int_equal(kv_dtype_size(KV_FP8_E5M2), 1);
    assert_int_equal(kv_dtype_size(KV_I64), 8);
}

/* fuzz_view (2026-12-05): an empty view with INT64_MAX strides on its
 * non-empty dims; kv_view_offset_of summed idx * stride before refusing the
 * size-0 dim's index (signed overflow, UBSan). Refused, *out untouched. */
static void test_view_offset_of_empty_view_huge_strides(void **state)
{
    (void)state;
    static char storage[16];
    const int64_t shape[3] = {2, 2, 0}, strides[3] = {INT64_MAX, INT64_MAX, 1};
    const int64_t idx[3] = {1, 1, 0};
    struct kv_view v;
    assert_int_equal(
        kv_view_from_strided(storage, sizeof(storage), KV_U8, 3, shape, strides, 0, &v), KV_OK);
    int64_t off = -7;
    assert_int_equal(kv_view_offset_of(&v, idx, &off), KV_ERR_OUT_OF_BOUNDS);
    assert_int_equal(off, -7);
    assert_non_null(strstr(kv_last_error(), "dim 2 of size 0"));
    assert_null(kv_view_ptr(&v, idx));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_view_conformance_vectors),
        cmocka_unit_test(test_view_conformance_edge_vectors),
        cmocka_unit_test(test_view_init_bad_input),
        cmocka_unit_test(test_view_init_null_base_with_storage),
        cmocka_unit_test(test_view_permute_bad_input),
        cmocka_unit_test(test_view_slice_steps_and_clamping),
        cmocka_unit_test(test_view_narrow_select_bounds),
        cmocka_unit_test(test_view_unsqueeze_squeeze),
        cmocka_unit_test(test_view_expand_rules),
        cmocka_unit_test(test_view_diagonal_offsets),
        cmocka_unit_test(test_view_view_refusal_names_dims),
        cmocka_unit_test(test_view_as_strided_bounds),
        cmocka_unit_test(test_view_sliding_window),
        cmocka_unit_test(test_view_contiguity_rules),
        cmocka_unit_test(test_view_reshape_copy_reported_and_counted),
        cmocka_unit_test(test_view_large_offsets_are_64bit),
        cmocka_unit_test(test_view_describe_line),
        cmocka_unit_test(test_view_overflow_edges),
        cmocka_unit_test(test_view_hand_built_views_refused),
        cmocka_unit_test(test_view_status_names),
        cmocka_unit_test(test_view_from_strided_torch_cases),
        cmocka_unit_test(test_view_from_strided_random_extents),
        cmocka_unit_test(test_view_from_strided_torch_vectors),
        cmocka_unit_test(test_view_from_strided_bad_input),
        cmocka_unit_test(test_view_offset_of_empty_view_huge_strides),
    };
    return cmocka_run_group_tests_name("view", tests, NULL, NULL);
}
