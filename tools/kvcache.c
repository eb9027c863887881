/*
 * kvcache - command-line front end.
 *
 *   kvcache view --dtype bf16 --shape 2,3,4 --op "transpose 0 2" --op "slice 1 0 3 2"
 *   kvcache cache --seqs 37,70,37
 *   kvcache version
 *
 * `view` prints the describe line of the start view and after each op, and
 * the status and detail of a refused op. Ops use the conformance-vector
 * syntax (tests/data/README.vectors.md) plus `as_strided SHAPE STRIDES
 * OFFSET` and `window D SIZE`. `cache` builds a model's KV cache, runs a few
 * prompts and a fork through its page table and prints the kernel exports.
 *
 * Every option value and op argument is parsed strictly (whole string, range
 * checked) before anything runs. Exit status, the same for every command:
 *   0  success
 *   1  the library refused an operation (the message says which and why)
 *   2  usage error: unknown option, missing/repeated option, bad value or op
 */
#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <kvcache/kv.h>

#define EXIT_REFUSED 1
#define EXIT_USAGE 2

/* Limits of this tool; the library checks its own (dims, bounds, sizes). */
#define MAX_OPS 64                        /* --op options per command line */
#define MAX_OP_ARGS 4                     /* slice D START STOP STEP */
#define VIEW_MAX_ELEMS (INT64_C(1) << 26) /* view: elements of --shape; of a copy an op makes */
#define PRINT_MAX_ELEMS 4096              /* view --print */
#define MAX_SEQS 8                        /* cache --seqs entries */
#define MAX_SEQ_TOKENS 4096               /* cache --seqs length */
#define ERR_CAP 512                       /* one error message */

/* ---- view ops: names, arguments, usage ---------------------------------- */

enum op_kind {
    OP_PERMUTE,
    OP_TRANSPOSE,
    OP_SLICE,
    OP_NARROW,
    OP_SELECT,
    OP_UNSQUEEZE,
    OP_SQUEEZE,
    OP_EXPAND,
    OP_DIAGONAL,
    OP_FLATTEN,
    OP_VIEW,
    OP_RESHAPE,
    OP_CONTIGUOUS,
    OP_AS_STRIDED,
    OP_WINDOW,
};

/* Argument types, one letter per argument in op_spec.types:
 *   d  a dim (must fit int; the library checks it against ndim)
 *   i  an int64 (start, stop, step, index, offset, size)
 *   p  a list of dims (permute)
 *   l  a list of int64 (shapes, strides)
 * A list is 1..KV_MAX_DIMS comma-separated integers, or `scalar` for none. */
struct op_spec {
    const char *name;
    enum op_kind kind;
    const char *types;
    const char *arg[MAX_OP_ARGS]; /* argument names, as in the usage */
};

static const struct op_spec op_specs[] = {
    {"permute", OP_PERMUTE, "p", {"PERM"}},
    {"transpose", OP_TRANSPOSE, "dd", {"A", "B"}},
    {"slice", OP_SLICE, "diii", {"D", "START", "STOP", "STEP"}},
    {"narrow", OP_NARROW, "dii", {"D", "START", "LEN"}},
    {"select", OP_SELECT, "di", {"D", "I"}},
    {"unsqueeze", OP_UNSQUEEZE, "d", {"D"}},
    {"squeeze", OP_SQUEEZE, "d", {"D"}},
    {"expand", OP_EXPAND, "l", {"SHAPE"}},
    {"diagonal", OP_DIAGONAL, "idd", {"OFF", "A", "B"}},
    {"flatten", OP_FLATTEN, "dd", {"A", "B"}},
    {"view", OP_VIEW, "l", {"SHAPE"}},
    {"reshape", OP_RESHAPE, "l", {"SHAPE"}},
    {"contiguous", OP_CONTIGUOUS, "", {NULL}},
    {"as_strided", OP_AS_STRIDED, "lli", {"SHAPE", "STRIDES", "OFFSET"}},
    {"window", OP_WINDOW, "di", {"D", "SIZE"}},
};
#define NUM_OPS ((int)(sizeof(op_specs) / sizeof(op_specs[0])))

/* "transpose A B" */
static void op_usage(const struct op_spec *spec, char *buf, size_t cap)
{
    size_t used = (size_t)snprintf(buf, cap, "%s", spec->name);
    for (int k = 0; spec->types[k] && used < cap; k++)
        used += (size_t)snprintf(buf + used, cap - used, " %s", spec->arg[k]);
}

/* ---- usage ---------------------------------------------------------------- */

static void usage_view(FILE *f)
{
    char u[64];

    fprintf(f,
            "kvcache view --shape SHAPE [--dtype DT] [--op \"OP ARGS\"]... [--print]\n"
            "  A C-contiguous view of SHAPE over zeroed storage, then each --op in order;\n"
            "  prints the view after each op, or the status and reason of a refused op.\n"
            "  --shape SHAPE   sizes, comma-separated (at most %d), e.g. 4,2,8; `scalar` or\n"
            "                  an empty string (--shape \"\") for a 0-d view. At most %" PRId64
            " (2^26)\n"
            "                  elements in all, zero sizes skipped (a limit of this tool).\n"
            "  --dtype DT      f32 (default) f16 bf16 fp8_e4m3 fp8_e5m2 i8 i32 i64 u8 f64\n"
            "  --op \"OP ARGS\"  one op, its arguments separated by spaces; repeatable, at most "
            "%d\n"
            "  --print         the storage index of each element of the final view (the first "
            "%d)\n"
            "  Options other than --op may be given once.\n"
            "  ops (A, B, D: dims, negative counts from the end; PERM, SHAPE, STRIDES:\n"
            "  1..%d comma-separated integers, or `scalar` for none; others: integers):\n",
            KV_MAX_DIMS, VIEW_MAX_ELEMS, MAX_OPS, PRINT_MAX_ELEMS, KV_MAX_DIMS);
    for (int i = 0; i < NUM_OPS; i++) {
        op_usage(&op_specs[i], u, sizeof(u));
        if (i % 2 == 0 && i + 1 < NUM_OPS)
            fprintf(f, "    %-36s", u);
        else
            fprintf(f, i % 2 ? "%s\n" : "    %s\n", u);
    }
    fprintf(f, "  reshape, flatten and contiguous copy (into a buffer of at most 2^26 elements)\n"
               "  only when no view exists, and say so.\n");
}

static void usage_cache(FILE *f)
{
    fprintf(f,
            "kvcache cache [--layers L] [--blocks B] [--block-tokens N] [--heads H]\n"
            "              [--head-dim D] [--dtype DT] [--order nhd|hnd] [--arrange layer|block]\n"
            "              [--pad ELEMS] [--page-ratio R] [--seqs LEN,LEN,..]\n"
            "  A model's KV cache, a few prompts, a fork with copy-on-write, and the block\n"
            "  table / slot mapping / CSR a kernel takes. Each option may be given once.\n"
            "  --layers L         layers, >= 1 (default 4)\n"
            "  --blocks B         blocks, 2..%u, the pool's KV_BLOCK_POOL_MAX_BLOCKS (default\n"
            "                     1024; block 0 is reserved)\n"
            "  --block-tokens N   tokens per block, >= 1 (default 16)\n"
            "  --heads H          KV heads, >= 1 (default 8)\n"
            "  --head-dim D       elements per head, >= 1 (default 128)\n"
            "  --dtype DT         element type (default bf16)\n"
            "  --order nhd|hnd    order inside a block (default nhd)\n"
            "  --arrange layer|block  layer-major or block-major (default layer)\n"
            "  --pad ELEMS        elements after each block, >= 0 (default 0)\n"
            "  --page-ratio R     kernel pages per block, >= 1, must divide N (default 1)\n"
            "  --seqs LEN,..      1..%d prompt lengths, each 0..%d (default 37,70,5). Each\n"
            "                     prompt has its own token ids, except the third, which uses\n"
            "                     the first one's (so it reuses the first one's cached blocks)\n"
            "  The layout must also fit in int64 bytes and in memory: a cache that cannot be\n"
            "  allocated is refused at once, before anything is touched.\n",
            KV_BLOCK_POOL_MAX_BLOCKS, MAX_SEQS, MAX_SEQ_TOKENS);
}

static void usage(FILE *f)
{
    fprintf(f, "usage: kvcache view ...   strided views, op by op\n"
               "       kvcache cache ...  a KV cache, its page table and kernel exports\n"
               "       kvcache version\n"
               "       kvcache [view|cache] --help\n\n");
    usage_view(f);
    fprintf(f, "\n");
    usage_cache(f);
    fprintf(f, "\nexit status: 0 success, 1 an operation was refused (the message says why),\n"
               "2 usage error (unknown, missing or repeated option, bad value or op)\n");
}

/* Print "kvcache CMD: MESSAGE" and a pointer to the help; returns EXIT_USAGE. */
KV_PRINTF(2, 3) static int usage_error(const char *cmd, const char *fmt, ...)
{
    va_list ap;

    fprintf(stderr, "kvcache %s: ", cmd);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\n(kvcache %s --help lists the options)\n", cmd);
    return EXIT_USAGE;
}

/* ---- strict parsing --------------------------------------------------------- */

static void range_text(int64_t lo, int64_t hi, char *buf, size_t cap)
{
    if (lo == INT64_MIN && hi == INT64_MAX)
        snprintf(buf, cap, "%" PRId64 "..%" PRId64 " (int64)", lo, hi);
    else if (lo == INT_MIN && hi == INT_MAX)
        snprintf(buf, cap, "%d..%d (int)", INT_MIN, INT_MAX);
    else if (hi == INT64_MAX)
        snprintf(buf, cap, ">= %" PRId64, lo);
    else
        snprintf(buf, cap, "%" PRId64 "..%" PRId64, lo, hi);
}

/* s[0..len) for quoting in a message: as is up to 60 characters, else its
 * first 40, "...", and its length, so a long argument never pushes the
 * reason out of a fixed-size message. */
#define ABBREV_CAP 80
static const char *abbrev(char *buf, const char *s, size_t len)
{
    if (len <= 60)
        snprintf(buf, ABBREV_CAP, "%.*s", (int)len, s);
    else
        snprintf(buf, ABBREV_CAP, "%.40s... (%zu chars)", s, len);
    return buf;
}

/* Parse s[0..len) as one whole base-10 integer in lo..hi into *out. s[len]
 * must not be a digit (it is a separator or the end). On failure writes
 * "WHAT 'TEXT' is not an integer|not a number in range (allowed: ...)" to err. */
static int parse_int(const char *s, size_t len, const char *what, int64_t lo, int64_t hi,
                     int64_t *out, char *err, size_t cap)
{
    char range[64], q[ABBREV_CAP];
    long long v = 0;
    bool whole = false; /* strtoll consumed exactly s[0..len) */

    range_text(lo, hi, range, sizeof(range));
    errno = 0;
    if (len && !isspace((unsigned char)s[0])) { /* strtoll would skip spaces */
        char *end;
        v = strtoll(s, &end, 10);
        whole = end == s + len;
    }
    if (!whole) {
        snprintf(err, cap, "%s '%s' is not an integer (allowed: %s)", what, abbrev(q, s, len),
                 range);
        return -1;
    }
    if (errno == ERANGE || v < lo || v > hi) {
        snprintf(err, cap, "%s '%s' is not a number in range (allowed: %s)", what,
                 abbrev(q, s, len), range);
        return -1;
    }
    *out = v;
    return 0;
}

/* Parse s[0..len) = "A,B,.." (1..KV_MAX_DIMS integers in lo..hi) into out[],
 * *n. With allow_none, `scalar` or an empty string is the empty list. */
static int parse_list(const char *s, size_t len, const char *what, bool allow_none, int64_t lo,
                      int64_t hi, int64_t *out, int *n, char *err, size_t cap)
{
    const char *p = s, *stop = s + len;
    char q1[ABBREV_CAP], q2[ABBREV_CAP];

    *n = 0;
    if (allow_none && (len == 0 || (len == 6 && !strncmp(s, "scalar", 6))))
        return 0;
    if (len == 0) {
        snprintf(err, cap, "%s is empty (expected 1..%d comma-separated integers)", what,
                 KV_MAX_DIMS);
        return -1;
    }
    for (;;) {
        const char *q = memchr(p, ',', (size_t)(stop - p));
        char entry[256];

        if (!q)
            q = stop;
        if (*n == KV_MAX_DIMS) {
            snprintf(err, cap, "%s '%s' has more than %d entries (entry %d is '%s')", what,
                     abbrev(q1, s, len), KV_MAX_DIMS, *n + 1, abbrev(q2, p, (size_t)(q - p)));
            return -1;
        }
        if (q == p) {
            snprintf(err, cap, "%s '%s': entry %d is empty (expected an integer)", what,
                     abbrev(q1, s, len), *n + 1);
            return -1;
        }
        snprintf(entry, sizeof(entry), "%s '%s': entry %d", what, abbrev(q1, s, len), *n + 1);
        if (parse_int(p, (size_t)(q - p), entry, lo, hi, &out[*n], err, cap))
            return -1;
        (*n)++;
        if (q == stop)
            return 0;
        p = q + 1;
    }
}

/* The value of option argv[*i] (advancing *i), or NULL after saying it is
 * missing: at the end of the line, or when the next word is an option. */
static const char *option_value(const char *cmd, int argc, char **argv, int *i)
{
    const char *opt = argv[*i];

    if (*i + 1 >= argc) {
        usage_error(cmd, "%s needs a value", opt);
        return NULL;
    }
    if (!strncmp(argv[*i + 1], "--", 2)) {
        usage_error(cmd, "%s needs a value (got the option '%s')", opt, argv[*i + 1]);
        return NULL;
    }
    return argv[++*i];
}

/* ---- kvcache view ------------------------------------------------------------- */

/* One --op, parsed. */
struct op {
    const struct op_spec *spec;
    const char *text;             /* the --op value as given */
    int64_t arg[MAX_OP_ARGS];     /* integer arguments, by position */
    int64_t list[2][KV_MAX_DIMS]; /* list arguments, in order */
    int nlist[2];                 /* entries of each list */
};

static int op_parse(const char *text, struct op *op, char *err, size_t cap)
{
    const char *tok[MAX_OP_ARGS + 1];
    size_t tlen[MAX_OP_ARGS + 1];
    int ntok = 0, nargs, nl = 0;
    const struct op_spec *spec = NULL;
    char u[64];

    for (const char *p = text; *p;) {
        const char *q;
        while (isspace((unsigned char)*p))
            p++;
        if (!*p)
            break;
        for (q = p; *q && !isspace((unsigned char)*q); q++)
            ;
        if (ntok < MAX_OP_ARGS + 1) {
            tok[ntok] = p;
            tlen[ntok] = (size_t)(q - p);
        }
        ntok++;
        p = q;
    }
    if (ntok == 0) {
        snprintf(err, cap, "empty op (expected OP ARGS, e.g. \"transpose 0 1\")");
        return -1;
    }
    for (int i = 0; i < NUM_OPS && !spec; i++)
        if (strlen(op_specs[i].name) == tlen[0] && !strncmp(op_specs[i].name, tok[0], tlen[0]))
            spec = &op_specs[i];
    if (!spec) {
        char q[ABBREV_CAP];
        size_t used =
            (size_t)snprintf(err, cap, "unknown op '%s' (known:", abbrev(q, tok[0], tlen[0]));
        for (int i = 0; i < NUM_OPS && used < cap; i++)
            used += (size_t)snprintf(err + used, cap - used, " %s", op_specs[i].name);
        if (used < cap)
            snprintf(err + used, cap - used, ")");
        return -1;
    }
    op_usage(spec, u, sizeof(u));
    nargs = (int)strlen(spec->types);
    if (ntok - 1 != nargs) {
        if (nargs == 0)
            snprintf(err, cap, "%s takes no arguments, got %d", spec->name, ntok - 1);
        else
            snprintf(err, cap, "%s takes %d argument%s (%s), got %d", spec->name, nargs,
                     nargs == 1 ? "" : "s", u + strlen(spec->name) + 1, ntok - 1);
        return -1;
    }
    memset(op, 0, sizeof(*op));
    op->spec = spec;
    op->text = text;
    for (int k = 0; k < nargs; k++) {
        const char *s = tok[k + 1];
        size_t len = tlen[k + 1];
        char what[64];
        int rc;

        snprintf(what, sizeof(what), "%s %s", spec->name, spec->arg[k]);
        switch (spec->types[k]) {
        case 'd':
            rc = parse_int(s, len, what, INT_MIN, INT_MAX, &op->arg[k], err, cap);
            break;
        case 'i':
            rc = parse_int(s, len, what, INT64_MIN, INT64_MAX, &op->arg[k], err, cap);
            break;
        case 'p':
            rc = parse_list(s, len, what, true, INT_MIN, INT_MAX, op->list[nl], &op->nlist[nl], err,
                            cap);
            nl++;
            break;
        default: /* 'l' */
            rc = parse_list(s, len, what, true, INT64_MIN, INT64_MAX, op->list[nl], &op->nlist[nl],
                            err, cap);
            nl++;
            break;
        }
        if (rc) {
            size_t used = strlen(err);
            snprintf(err + used, cap - used, "; usage: %s", u);
            return -1;
        }
    }
    if (spec->kind == OP_AS_STRIDED && op->nlist[0] != op->nlist[1]) {
        snprintf(err, cap,
                 "as_strided SHAPE has %d entries but STRIDES has %d (one per dim); "
                 "usage: %s",
                 op->nlist[0], op->nlist[1], u);
        return -1;
    }
    return 0;
}

/* Copy buffers handed to reshape/flatten/contiguous, freed at exit. */
struct session {
    void *bufs[MAX_OPS];
    int nbufs;
};

/* A buffer for a copy of v, or NULL when v is above this tool's copy limit. */
static void *session_copy_buf(struct session *s, const struct kv_view *v)
{
    int64_t numel = kv_view_numel(v);
    void *p;

    if (numel > VIEW_MAX_ELEMS || s->nbufs == MAX_OPS)
        return NULL;
    p = malloc(numel ? (size_t)numel * kv_view_elem_bytes(v) : 1);
    if (p)
        s->bufs[s->nbufs++] = p;
    return p;
}

/* Apply op to *v. On a refusal, why says what was refused and why. */
static kv_status op_apply(struct session *s, const struct op *op, struct kv_view *v, bool *copied,
                          char *why, size_t cap)
{
    const int64_t *x = op->arg, *l0 = op->list[0], *l1 = op->list[1];
    int n0 = op->nlist[0];
    size_t need = (size_t)kv_view_numel(v) * kv_view_elem_bytes(v);
    bool may_copy = op->spec->kind == OP_FLATTEN || op->spec->kind == OP_RESHAPE ||
                    op->spec->kind == OP_CONTIGUOUS;
    void *dst = NULL; /* copy buffer; NULL above this tool's copy limit */
    kv_status st;

    *copied = false;
    if (may_copy) {
        dst = session_copy_buf(s, v);
        if (!dst && kv_view_numel(v) <= VIEW_MAX_ELEMS) {
            snprintf(why, cap, "%s: no memory for a %zu-byte copy buffer", op->spec->name, need);
            return KV_ERR_NO_MEMORY;
        }
    }
    switch (op->spec->kind) {
    case OP_PERMUTE: {
        int perm[KV_MAX_DIMS];
        if (n0 != v->ndim) {
            snprintf(why, cap, "permute PERM has %d entr%s, the view has %d dims", n0,
                     n0 == 1 ? "y" : "ies", v->ndim);
            return KV_ERR_INVALID_ARG;
        }
        for (int i = 0; i < n0; i++)
            perm[i] = (int)l0[i]; /* fits: parsed as int */
        st = kv_view_permute(v, perm, n0, v);
        break;
    }
    case OP_TRANSPOSE:
        st = kv_view_transpose(v, (int)x[0], (int)x[1], v);
        break;
    case OP_SLICE:
        st = kv_view_slice(v, (int)x[0], x[1], x[2], x[3], v);
        break;
    case OP_NARROW:
        st = kv_view_narrow(v, (int)x[0], x[1], x[2], v);
        break;
    case OP_SELECT:
        st = kv_view_select(v, (int)x[0], x[1], v);
        break;
    case OP_UNSQUEEZE:
        st = kv_view_unsqueeze(v, (int)x[0], v);
        break;
    case OP_SQUEEZE:
        st = kv_view_squeeze(v, (int)x[0], v);
        break;
    case OP_EXPAND:
        st = kv_view_expand(v, n0, l0, v);
        break;
    case OP_DIAGONAL:
        st = kv_view_diagonal(v, x[0], (int)x[1], (int)x[2], v);
        break;
    case OP_FLATTEN:
        st = kv_view_flatten(v, (int)x[0], (int)x[1], dst, need, v, copied);
        break;
    case OP_VIEW:
        st = kv_view_view(v, n0, l0, v);
        break;
    case OP_RESHAPE:
        st = kv_view_reshape(v, n0, l0, dst, need, v, copied);
        break;
    case OP_CONTIGUOUS:
        st = kv_view_contiguous(v, dst, need, v, copied);
        break;
    case OP_AS_STRIDED:
        st = kv_view_as_strided(v, n0, l0, l1, x[2], v);
        break;
    case OP_WINDOW:
        st = kv_view_sliding_window(v, (int)x[0], x[1], v);
        break;
    default:
        st = KV_ERR_INTERNAL;
        break;
    }
    if (st == KV_ERR_NEEDS_COPY && may_copy && !dst)
        snprintf(why, cap,
                 "%s needs a copy of %" PRId64 " elements, more than this tool copies (%" PRId64
                 ")",
                 op->spec->name, kv_view_numel(v), VIEW_MAX_ELEMS);
    else if (st != KV_OK)
        snprintf(why, cap, "%s", *kv_last_error() ? kv_last_error() : kv_strerror(st));
    return st;
}

static void print_indices(const struct kv_view *v)
{
    int64_t idx[KV_MAX_DIMS] = {0}, n = kv_view_numel(v);

    printf("  storage index of each element:");
    for (int64_t i = 0; i < n && i < PRINT_MAX_ELEMS; i++) {
        int64_t off = 0;
        if (kv_view_offset_of(v, idx, &off) != KV_OK) {
            printf(" (%s)", kv_last_error());
            break;
        }
        printf(" %" PRId64, off);
        for (int k = v->ndim - 1; k >= 0; k--) {
            if (++idx[k] < v->shape[k])
                break;
            idx[k] = 0;
        }
    }
    printf(n > PRINT_MAX_ELEMS ? " ...\n" : "\n");
}

/* --shape: sizes >= 0 whose product, zeros skipped, is at most VIEW_MAX_ELEMS
 * (skipping zeros keeps the strides of an empty view small too). */
static int parse_shape(const char *s, int64_t *shape, int *ndim, int64_t *numel)
{
    char err[ERR_CAP];
    int64_t prod = 1; /* of the nonzero sizes */
    bool zero = false, wraps = false;

    if (parse_list(s, strlen(s), "--shape", true, 0, INT64_MAX, shape, ndim, err, sizeof(err)))
        return usage_error("view", "%s", err);
    for (int i = 0; i < *ndim; i++) {
        if (shape[i] == 0)
            zero = true;
        else if (!wraps && shape[i] > INT64_MAX / prod)
            wraps = true;
        else if (!wraps)
            prod *= shape[i];
    }
    if (wraps || prod > VIEW_MAX_ELEMS) {
        char count[64];
        if (wraps)
            snprintf(count, sizeof(count), "more than 2^63 elements");
        else
            snprintf(count, sizeof(count), "%" PRId64 " elements", prod);
        return usage_error("view",
                           "--shape '%s' %s %s, more than this tool's limit of %" PRId64 " (2^26)",
                           s, zero ? "has nonzero sizes making" : "has", count, VIEW_MAX_ELEMS);
    }
    *numel = zero ? 0 : prod;
    return 0;
}

static int cmd_view(int argc, char **argv)
{
    static struct op ops[MAX_OPS];
    const char *shape_s = NULL, *dtype_s = NULL;
    int nops = 0, print = 0, ndim = 0, rc = 0;
    int64_t shape[KV_MAX_DIMS], numel = 0;
    struct session s = {.nbufs = 0};
    struct kv_view v;
    kv_dtype dt = KV_F32;
    char line[1024], err[ERR_CAP];
    void *storage;
    kv_status st;

    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage_view(stdout);
            return 0;
        } else if (!strcmp(a, "--shape") || !strcmp(a, "--dtype")) {
            const char **slot = !strcmp(a, "--shape") ? &shape_s : &dtype_s;
            const char *val = option_value("view", argc, argv, &i);
            if (!val)
                return EXIT_USAGE;
            if (*slot)
                return usage_error("view", "%s given twice ('%s', then '%s')", a, *slot, val);
            *slot = val;
        } else if (!strcmp(a, "--op")) {
            const char *text = option_value("view", argc, argv, &i);
            if (!text)
                return EXIT_USAGE;
            if (nops == MAX_OPS)
                return usage_error("view", "too many --op (at most %d)", MAX_OPS);
            if (op_parse(text, &ops[nops], err, sizeof(err))) {
                char q[ABBREV_CAP];
                return usage_error("view", "--op '%s': %s", abbrev(q, text, strlen(text)), err);
            }
            nops++;
        } else if (!strcmp(a, "--print")) {
            if (print)
                return usage_error("view", "--print given twice");
            print = 1;
        } else {
            fprintf(stderr, "kvcache view: unknown option '%s'\nusage: ", a);
            usage_view(stderr);
            return EXIT_USAGE;
        }
    }
    if (!shape_s)
        return usage_error("view", "--shape is required (`--shape scalar` for a 0-d view)");
    if (dtype_s && kv_dtype_parse(dtype_s, &dt) != KV_OK)
        return usage_error("view", "--dtype: %s", kv_last_error());
    if (parse_shape(shape_s, shape, &ndim, &numel))
        return EXIT_USAGE;

    storage = calloc((size_t)(numel ? numel : 1), kv_dtype_size(dt));
    if (!storage) {
        fprintf(stderr, "kvcache view: out of memory for %" PRId64 " elements\n", numel);
        return EXIT_REFUSED;
    }
    st = kv_view_init(storage, (size_t)numel * kv_dtype_size(dt), dt, ndim, shape, &v);
    if (st != KV_OK) {
        fprintf(stderr, "kvcache view: --shape '%s' refused: %s: %s\n", shape_s, kv_status_name(st),
                kv_last_error());
        free(storage);
        return EXIT_REFUSED;
    }
    kv_view_describe(&v, line, sizeof(line));
    printf("start            %s\n", line);
    for (int i = 0; i < nops; i++) {
        bool copied = false;
        st = op_apply(&s, &ops[i], &v, &copied, err, sizeof(err));
        if (st != KV_OK) {
            printf("%-16s refused: %s: %s\n", ops[i].text, kv_status_name(st), err);
            rc = EXIT_REFUSED;
            break;
        }
        kv_view_describe(&v, line, sizeof(line));
        printf("%-16s %s%s\n", ops[i].text, line, copied ? "  [copied]" : "");
    }
    if (print && rc == 0)
        print_indices(&v);
    {
        struct kv_copy_stats cs;
        uint64_t calls = 0, bytes = 0;
        kv_copy_stats_get(&cs);
        for (int r = 0; r < KV_COPY_REASON_COUNT; r++)
            calls += cs.calls[r], bytes += cs.bytes[r];
        printf("copies made: %" PRIu64 " (%" PRIu64 " bytes)\n", calls, bytes);
    }
    for (int i = 0; i < s.nbufs; i++)
        free(s.bufs[i]);
    free(storage);
    return rc;
}

/* ---- kvcache cache: a model's cache, a few sequences, the kernel exports ---- */

static void print_i32_row(const char *label, const int32_t *v, uint64_t n)
{
    printf("  %-14s [", label);
    for (uint64_t i = 0; i < n; i++)
        printf(i ? ",%d" : "%d", v[i]);
    printf("]\n");
}

static int cache_fail(const char *what, kv_status st)
{
    fprintf(stderr, "kvcache cache: %s refused: %s: %s\n", what, kv_status_name(st),
            kv_last_error());
    return EXIT_REFUSED;
}

enum cache_opt_kind { CO_INT, CO_SEQS, CO_DTYPE, CO_ORDER, CO_ARRANGE };

struct cache_opt {
    const char *name;
    enum cache_opt_kind kind;
    int64_t lo, hi; /* CO_INT: allowed values */
    int64_t *dst;   /* CO_INT: where the value goes */
    bool seen;
};

/* Parse the options into cfg and lens[*nseqs]; 0 or EXIT_USAGE (said why). */
static int cache_parse(int argc, char **argv, struct kv_cache_config *cfg, int64_t *lens,
                       int *nseqs)
{
    int64_t page_ratio = 1;
    struct cache_opt opts[] = {
        {"--layers", CO_INT, 1, INT64_MAX, &cfg->layout.num_layers, false},
        {"--blocks", CO_INT, 2, KV_BLOCK_POOL_MAX_BLOCKS, &cfg->layout.num_blocks, false},
        {"--block-tokens", CO_INT, 1, INT64_MAX, &cfg->layout.block_tokens, false},
        {"--heads", CO_INT, 1, INT64_MAX, &cfg->layout.num_heads, false},
        {"--head-dim", CO_INT, 1, INT64_MAX, &cfg->layout.head_dim, false},
        {"--pad", CO_INT, 0, INT64_MAX, &cfg->layout.block_pad_elems, false},
        {"--page-ratio", CO_INT, 1, UINT32_MAX, &page_ratio, false},
        {"--seqs", CO_SEQS, 0, 0, NULL, false},
        {"--dtype", CO_DTYPE, 0, 0, NULL, false},
        {"--order", CO_ORDER, 0, 0, NULL, false},
        {"--arrange", CO_ARRANGE, 0, 0, NULL, false},
    };
    const int nopts = (int)(sizeof(opts) / sizeof(opts[0]));
    char err[ERR_CAP];

    for (int i = 0; i < argc; i++) {
        struct cache_opt *o = NULL;
        const char *v;

        for (int k = 0; k < nopts && !o; k++)
            if (!strcmp(argv[i], opts[k].name))
                o = &opts[k];
        if (!o) {
            fprintf(stderr, "kvcache cache: unknown option '%s'\nusage: ", argv[i]);
            usage_cache(stderr);
            return EXIT_USAGE;
        }
        if (o->seen)
            return usage_error("cache", "%s given twice", o->name);
        o->seen = true;
        if (!(v = option_value("cache", argc, argv, &i)))
            return EXIT_USAGE;
        switch (o->kind) {
        case CO_INT:
            if (parse_int(v, strlen(v), o->name, o->lo, o->hi, o->dst, err, sizeof(err)))
                return usage_error("cache", "%s", err);
            break;
        case CO_SEQS:
            if (parse_list(v, strlen(v), "--seqs", false, 0, MAX_SEQ_TOKENS, lens, nseqs, err,
                           sizeof(err)))
                return usage_error("cache", "%s", err);
            break;
        case CO_DTYPE:
            if (kv_dtype_parse(v, &cfg->layout.dtype) != KV_OK)
                return usage_error("cache", "--dtype: %s", kv_last_error());
            break;
        case CO_ORDER:
            if (strcmp(v, "nhd") && strcmp(v, "hnd"))
                return usage_error("cache", "--order '%s' is not nhd or hnd", v);
            cfg->layout.order = !strcmp(v, "hnd") ? KV_ORDER_HND : KV_ORDER_NHD;
            break;
        case CO_ARRANGE:
            if (strcmp(v, "layer") && strcmp(v, "block"))
                return usage_error("cache", "--arrange '%s' is not layer or block", v);
            cfg->layout.arrange =
                !strcmp(v, "block") ? KV_ARRANGE_BLOCK_MAJOR : KV_ARRANGE_LAYER_MAJOR;
            break;
        }
    }
    cfg->page_ratio = (uint32_t)page_ratio; /* 1..UINT32_MAX, checked above */
    return 0;
}

/* Token i of prompt `family`: distinct families never share a block. */
static int32_t prompt_token(int family, uint64_t i)
{
    return (int32_t)(100000 * (family + 1) + (int64_t)i);
}

static int cmd_cache(int argc, char **argv)
{
    struct kv_cache_config cfg;
    int64_t lens[MAX_SEQS] = {37, 70, 5};
    int nseqs = 3, rc = 0;
    kv_cache *c = NULL;
    kv_page_table *pt;
    uint32_t ids[MAX_SEQS + 1]; /* the prompts, then the fork */
    int32_t *toks = NULL, *bt = NULL, *indices = NULL;
    const uint32_t cols = MAX_SEQ_TOKENS + 1; /* pages per row: at most one per token */
    char line[1024];
    kv_status st;

    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            usage_cache(stdout);
            return 0;
        }
    }
    kv_cache_config_init(&cfg);
    cfg.layout = (struct kv_layout_config){.struct_size = sizeof(struct kv_layout_config),
                                           .num_layers = 4,
                                           .num_blocks = 1024,
                                           .block_tokens = 16,
                                           .num_heads = 8,
                                           .head_dim = 128,
                                           .dtype = KV_BF16};
    cfg.max_seqs = 64;
    cfg.enable_prefix_caching = true;
    if (cache_parse(argc, argv, &cfg, lens, &nseqs))
        return EXIT_USAGE;

    toks = malloc(MAX_SEQ_TOKENS * sizeof(*toks));
    bt = malloc((size_t)(MAX_SEQS + 1) * cols * sizeof(*bt));
    indices = malloc((size_t)(MAX_SEQS + 1) * cols * sizeof(*indices));
    if (!toks || !bt || !indices) {
        fprintf(stderr, "kvcache cache: out of memory\n");
        rc = EXIT_REFUSED;
        goto free_bufs;
    }
    st = kv_cache_create(&cfg, &c);
    if (st != KV_OK) {
        rc = cache_fail("create", st);
        goto free_bufs;
    }
    pt = kv_cache_page_table(c);
    kv_layout_describe(kv_cache_layout(c), line, sizeof(line));
    printf("layout   %s\n", line);
    {
        const struct kv_layout *lo = kv_cache_layout(c);
        uint32_t layer = lo->num_layers > 1 ? 1 : 0;
        uint32_t blk = (uint32_t)(lo->num_blocks > 1000 ? 1000 : lo->num_blocks - 1);
        struct kv_byte_runs r;
        for (int kv = 0; kv < 2; kv++) {
            struct kv_view v;
            st = kv_cache_kv_view(c, layer, kv, &v);
            if (st != KV_OK) {
                rc = cache_fail("kv view", st);
                goto destroy_cache;
            }
            kv_view_describe(&v, line, sizeof(line));
            printf("layer %u %s  %s\n", layer, kv ? "V" : "K", line);
        }
        st = kv_layout_block_runs(lo, blk, &r);
        if (st != KV_OK) {
            rc = cache_fail("block runs", st);
            goto destroy_cache;
        }
        printf("block %u across layers: %" PRId64 " run(s) of %" PRId64 " bytes, stride %" PRId64
               " bytes, first at byte %" PRId64 "\n",
               blk, r.run_count, r.run_bytes, r.run_stride_bytes, r.first_offset_bytes);
    }

    /* Prompts: each its own token ids, except the third, which uses the
     * first one's, so only it can reuse cached blocks (the first's full ones). */
    for (int i = 0; i < nseqs; i++) {
        uint64_t cached = 0, n = (uint64_t)lens[i];
        for (uint64_t t = 0; t < n; t++)
            toks[t] = prompt_token(i == 2 ? 0 : i, t);
        st = kv_page_table_seq_create_from_prefix(pt, toks, n, &ids[i], &cached);
        if (st == KV_OK)
            st = kv_page_table_seq_append(pt, ids[i], toks + cached, n - cached);
        if (st != KV_OK) {
            rc = cache_fail("prompt", st);
            goto destroy_cache;
        }
        printf("seq %u: %" PRIu64 " tokens%s (%" PRIu64 " reused from the prefix cache)\n", ids[i],
               n, i == 2 ? ", the first one's prompt" : "", cached);
    }
    {
        uint32_t child, ncp = 0;
        int32_t t = 7;
        struct kv_block_copy cp[4];
        st = kv_page_table_seq_fork(pt, ids[0], &child);
        if (st == KV_OK)
            st = kv_page_table_seq_append(pt, child, &t, 1);
        if (st == KV_OK)
            st = kv_page_table_take_copies(pt, cp, 4, &ncp);
        /* the copies run before this step's K/V writes (all at once); then
         * they release the blocks they held */
        struct kv_paged_cache pc;
        if (st == KV_OK)
            st = kv_cache_paged(c, &pc);
        if (st == KV_OK)
            st = kv_attn_copy_blocks(pc, cp, ncp);
        if (st == KV_OK)
            st = kv_page_table_copies_done(pt);
        if (st != KV_OK) {
            rc = cache_fail("fork", st);
            goto destroy_cache;
        }
        printf("fork of seq %u -> seq %u, one token appended: %u copy-on-write cop%s", ids[0],
               child, ncp, ncp == 1 ? "y" : "ies");
        for (uint32_t i = 0; i < ncp; i++)
            printf(" (block %u -> %u, %u tokens)", cp[i].src, cp[i].dst, cp[i].tokens);
        printf("\n");
        ids[nseqs++] = child;
    }
    {
        int32_t indptr[MAX_SEQS + 2], last[MAX_SEQS + 1];
        int64_t slots[MAX_SEQS + 1];
        struct kv_token_range ranges[MAX_SEQS + 1];
        struct kv_vllm_export ve = {0};
        struct kv_flashinfer_export fe = {.indptr = indptr,
                                          .indptr_len = (uint64_t)nseqs + 1,
                                          .indices = indices,
                                          .indices_len = (uint64_t)nseqs * cols,
                                          .last_page_len = last,
                                          .last_page_len_len = (uint64_t)nseqs};
        uint64_t nnz = 0;
        for (int i = 0; i < nseqs; i++) {
            uint64_t len = 0;
            if ((st = kv_page_table_seq_len(pt, ids[i], &len)) != KV_OK)
                break;
            ranges[i].start = len ? len - 1 : 0; /* the newest token of each: a decode step */
            ranges[i].count = len ? 1 : 0;
        }
        if (st != KV_OK) {
            rc = cache_fail("seq_len", st);
            goto destroy_cache;
        }
        ve.block_table = bt;
        ve.block_table_cols = cols;
        ve.block_table_len = (uint64_t)nseqs * cols;
        ve.slot_mapping = slots;
        ve.slot_mapping_len = (uint64_t)nseqs;
        st = kv_page_table_export_vllm(pt, ids, (uint32_t)nseqs, ranges, &ve);
        if (st == KV_OK)
            st = kv_page_table_export_flashinfer(pt, ids, (uint32_t)nseqs, &fe, &nnz);
        if (st != KV_OK) {
            rc = cache_fail("export", st);
            goto destroy_cache;
        }
        printf("vLLM export (decode step):\n");
        for (int i = 0; i < nseqs; i++) {
            char label[32];
            uint64_t pages = (uint64_t)(indptr[i + 1] - indptr[i]);
            snprintf(label, sizeof(label), "block_table[%d]", i);
            print_i32_row(label, bt + (size_t)i * cols, pages);
        }
        printf("  slot_mapping   [");
        for (int i = 0; i < nseqs; i++)
            printf(i ? ",%" PRId64 : "%" PRId64, slots[i]);
        printf("]\nFlashInfer export (%" PRIu64 " pages):\n", nnz);
        print_i32_row("indptr", indptr, (uint64_t)nseqs + 1);
        print_i32_row("indices", indices, nnz);
        print_i32_row("last_page_len", last, (uint64_t)nseqs);
    }

destroy_cache : {
    struct kv_block_pool_stats ps;
    kv_block_pool_stats_get(kv_cache_pool(c), &ps);
    printf("pool: capacity %u, used %u, cached %u, free %u, prefix hits %" PRIu64
           ", misses %" PRIu64 ", high-water %u\n",
           ps.capacity, ps.used_blocks, ps.cached_blocks, ps.free_blocks, ps.hits, ps.misses,
           ps.used_high_water);
}
    kv_cache_destroy(c);
free_bufs:
    free(indices);
    free(bt);
    free(toks);
    return rc;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return EXIT_USAGE;
    }
    if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(argv[1], "view"))
        return cmd_view(argc - 2, argv + 2);
    if (!strcmp(argv[1], "cache"))
        return cmd_cache(argc - 2, argv + 2);
    if (!strcmp(argv[1], "version")) {
        if (argc > 2 && (!strcmp(argv[2], "--help") || !strcmp(argv[2], "-h"))) {
            printf("usage: kvcache version   the library version and host memory backend\n");
            return 0;
        }
        if (argc > 2)
            return usage_error("version", "takes no arguments, got '%s'", argv[2]);
        printf("%s\n", kv_build_info());
        return 0;
    }
    fprintf(stderr, "kvcache: unknown command '%s'\n", argv[1]);
    usage(stderr);
    return EXIT_USAGE;
}
