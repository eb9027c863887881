/*
 * view.c - kvcache view: a C-contiguous view of --shape over zeroed storage,
 * then each --op in order. Prints the describe line of the start view and
 * after each op, and the status and detail of a refused op. Ops use the
 * conformance-vector syntax (tests/data/README.vectors.md) plus `as_strided
 * SHAPE STRIDES OFFSET` and `window D SIZE`.
 *
 *   kvcache view --dtype bf16 --shape 2,3,4 --op "transpose 0 2" --op "slice 1 0 3 2"
 */
#include <ctype.h>
#include <inttypes.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

/* Limits of this tool; the library checks its own (dims, bounds, sizes). */
#define MAX_OPS 64                        /* --op options per command line */
#define MAX_OP_ARGS 4                     /* slice D START STOP STEP */
#define VIEW_MAX_ELEMS (INT64_C(1) << 26) /* view: elements of --shape; of a copy an op makes */
#define PRINT_MAX_ELEMS 4096              /* view --print */

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

void usage_view(FILE *f)
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

enum { VIEW_SHAPE = 256, VIEW_DTYPE, VIEW_OP, VIEW_PRINT };

static const struct option view_opts[] = {
    {"shape", required_argument, NULL, VIEW_SHAPE},
    {"dtype", required_argument, NULL, VIEW_DTYPE},
    {"op", required_argument, NULL, VIEW_OP},
    {"print", no_argument, NULL, VIEW_PRINT},
    {"help", no_argument, NULL, 'h'},
    {NULL, 0, NULL, 0},
};

int cmd_view(int argc, char **argv)
{
    static struct op ops[MAX_OPS];
    const char *shape_s = NULL, *dtype_s = NULL;
    struct cli_opts o = {.cmd = "view", .longopts = view_opts, .usage = usage_view};
    int nops = 0, print = 0, ndim = 0, rc = 0, c;
    int64_t shape[KV_MAX_DIMS], numel = 0;
    struct session s = {.nbufs = 0};
    struct kv_view v;
    kv_dtype dt = KV_F32;
    char line[1024], err[ERR_CAP];
    void *storage;
    kv_status st;

    optind = 1; /* argv[0] is "view" */
    while ((c = cli_next(&o, argc, argv)) > 0) {
        switch (c) {
        case 'h':
            usage_view(stdout);
            return 0;
        case VIEW_SHAPE:
        case VIEW_DTYPE: {
            const char **slot = c == VIEW_SHAPE ? &shape_s : &dtype_s;
            const char *val = cli_value(&o);
            if (!val)
                return EXIT_USAGE;
            if (*slot)
                return usage_error("view", "%s given twice ('%s', then '%s')", o.name, *slot, val);
            *slot = val;
            break;
        }
        case VIEW_OP: {
            const char *text = cli_value(&o);
            if (!text)
                return EXIT_USAGE;
            if (nops == MAX_OPS)
                return usage_error("view", "too many --op (at most %d)", MAX_OPS);
            if (op_parse(text, &ops[nops], err, sizeof(err))) {
                char q[ABBREV_CAP];
                return usage_error("view", "--op '%s': %s", abbrev(q, text, strlen(text)), err);
            }
            nops++;
            break;
        }
        default: /* VIEW_PRINT */
            if (print)
                return usage_error("view", "--print given twice");
            print = 1;
            break;
        }
    }
    if (c == CLI_BAD)
        return EXIT_USAGE;
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
