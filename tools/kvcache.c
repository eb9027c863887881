/*
 * kvcache - command-line front end.
 *
 *   kvcache view --dtype bf16 --shape 2,3,4 --op "transpose 0 2" --op "slice 1 0 3 2"
 *
 * prints the describe line of the start view and after each op, and the
 * error (status and detail) for a refused op. Ops use the conformance-vector
 * syntax (tests/data/README.vectors.md) plus `as_strided shape strides offset`
 * and `window dim size`.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv.h"

#define MAX_OPS 64
#define MAX_BUFS 64

static void usage(FILE *f)
{
    fprintf(f, "usage: kvcache view --shape S0,S1,.. [--dtype DT] [--op \"OP ARGS\"]... [--print]\n"
               "       kvcache cache [--layers L] [--blocks B] [--block-tokens N] [--heads H]\n"
               "                     [--head-dim D] [--dtype DT] [--order nhd|hnd]\n"
               "                     [--arrange layer|block] [--pad ELEMS] [--page-ratio R]\n"
               "                     [--seqs LEN,LEN,..]\n"
               "       kvcache version\n"
               "\n"
               "view ops (dims may be negative; lists are comma-separated):\n"
               "  permute P0,P1,..      transpose A B          slice D START STOP STEP\n"
               "  narrow D START LEN    select D I             unsqueeze D | squeeze D\n"
               "  expand S0,S1,..       diagonal OFF A B       flatten A B\n"
               "  view S0,..            reshape S0,..          contiguous\n"
               "  as_strided S0,.. T0,.. OFFSET                window D SIZE\n"
               "--print lists the storage index of every element of the final view.\n"
               "dtypes: f32 f16 bf16 fp8_e4m3 fp8_e5m2 i8 i32 i64 u8 f64\n");
}

static int parse_list(const char *s, int64_t *out, int *n)
{
    *n = 0;
    while (*s == ' ')
        s++;
    if (*s == '\0')
        return 0;
    for (;;) {
        char *end;
        errno = 0;
        long long v = strtoll(s, &end, 10);
        if (end == s || errno)
            return -1;
        if (*n == KV_MAX_DIMS + 1)
            return -1;
        out[(*n)++] = v;
        s = end;
        if (*s != ',')
            break;
        s++;
    }
    while (*s == ' ')
        s++;
    return *s == '\0' ? 0 : -1;
}

struct session {
    void *bufs[MAX_BUFS];
    int nbufs;
};

static void *session_buf(struct session *s, size_t bytes)
{
    void *p;
    if (s->nbufs == MAX_BUFS)
        return NULL;
    p = kv_mem_alloc(bytes ? bytes : 1);
    if (p)
        s->bufs[s->nbufs++] = p;
    return p;
}

/* Apply "name args" to *v. Returns a status; prints nothing. */
static kv_status apply(struct session *s, const char *op, struct kv_view *v, bool *copied)
{
    char name[32], rest[512] = "", a1[256] = "", a2[256] = "";
    int64_t l1[KV_MAX_DIMS + 1], l2[KV_MAX_DIMS + 1];
    long long x[4];
    int n1 = 0, n2 = 0, k;
    size_t need = (size_t)kv_view_numel(v) * kv_view_elem_bytes(v);

    *copied = false;
    if (sscanf(op, " %31s %511[^\n]", name, rest) < 1)
        return KV_ERR_INVALID_ARG;
    k = sscanf(rest, "%lld %lld %lld %lld", &x[0], &x[1], &x[2], &x[3]);
    if (!strcmp(name, "transpose") && k == 2)
        return kv_view_transpose(v, (int)x[0], (int)x[1], v);
    if (!strcmp(name, "slice") && k == 4)
        return kv_view_slice(v, (int)x[0], x[1], x[2], x[3], v);
    if (!strcmp(name, "narrow") && k == 3)
        return kv_view_narrow(v, (int)x[0], x[1], x[2], v);
    if (!strcmp(name, "select") && k == 2)
        return kv_view_select(v, (int)x[0], x[1], v);
    if (!strcmp(name, "unsqueeze") && k == 1)
        return kv_view_unsqueeze(v, (int)x[0], v);
    if (!strcmp(name, "squeeze") && k == 1)
        return kv_view_squeeze(v, (int)x[0], v);
    if (!strcmp(name, "diagonal") && k == 3)
        return kv_view_diagonal(v, x[0], (int)x[1], (int)x[2], v);
    if (!strcmp(name, "window") && k == 2)
        return kv_view_sliding_window(v, (int)x[0], x[1], v);
    if (!strcmp(name, "flatten") && k == 2)
        return kv_view_flatten(v, (int)x[0], (int)x[1], session_buf(s, need), need, v, copied);
    if (!strcmp(name, "contiguous"))
        return kv_view_contiguous(v, session_buf(s, need), need, v, copied);
    if (!strcmp(name, "as_strided")) {
        long long off = 0;
        if (sscanf(rest, "%255s %255s %lld", a1, a2, &off) != 3 || parse_list(a1, l1, &n1) ||
            parse_list(a2, l2, &n2) || n1 != n2 || n1 > KV_MAX_DIMS) {
            fprintf(stderr, "as_strided takes SHAPE STRIDES OFFSET with equal-length lists\n");
            return KV_ERR_INVALID_ARG;
        }
        return kv_view_as_strided(v, n1, l1, l2, off, v);
    }
    if (parse_list(rest, l1, &n1) || n1 > KV_MAX_DIMS) {
        fprintf(stderr, "bad list '%s' for %s (at most %d comma-separated integers)\n", rest, name,
                KV_MAX_DIMS);
        return KV_ERR_INVALID_ARG;
    }
    if (!strcmp(name, "permute")) {
        int perm[KV_MAX_DIMS];
        if (n1 != v->ndim) {
            fprintf(stderr, "permute needs %d entries, got %d\n", v->ndim, n1);
            return KV_ERR_INVALID_ARG;
        }
        for (int i = 0; i < n1; i++)
            perm[i] = (int)l1[i];
        return kv_view_permute(v, perm, v);
    }
    if (!strcmp(name, "expand"))
        return kv_view_expand(v, n1, l1, v);
    if (!strcmp(name, "view"))
        return kv_view_view(v, n1, l1, v);
    if (!strcmp(name, "reshape"))
        return kv_view_reshape(v, n1, l1, session_buf(s, need), need, v, copied);
    fprintf(stderr, "unknown op or wrong arguments: '%s' (see kvcache --help)\n", op);
    return KV_ERR_INVALID_ARG;
}

static void print_indices(const struct kv_view *v)
{
    int64_t idx[KV_MAX_DIMS] = {0}, n = kv_view_numel(v);
    printf("  storage index of each element:");
    for (int64_t i = 0; i < n && i < 4096; i++) {
        int64_t off;
        kv_view_offset_of(v, idx, &off);
        printf(" %" PRId64, off);
        for (int k = v->ndim - 1; k >= 0; k--) {
            if (++idx[k] < v->shape[k])
                break;
            idx[k] = 0;
        }
    }
    printf(n > 4096 ? " ...\n" : "\n");
}

static int cmd_view(int argc, char **argv)
{
    const char *ops[MAX_OPS], *shape_s = NULL, *dtype_s = "f32";
    int nops = 0, print = 0, ndim, rc = 0;
    int64_t shape[KV_MAX_DIMS + 1], numel = 1;
    struct session s = {.nbufs = 0};
    struct kv_view v;
    kv_dtype dt;
    char line[1024];
    void *storage;
    kv_status st;

    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "--shape") && i + 1 < argc)
            shape_s = argv[++i];
        else if (!strcmp(argv[i], "--dtype") && i + 1 < argc)
            dtype_s = argv[++i];
        else if (!strcmp(argv[i], "--op") && i + 1 < argc && nops < MAX_OPS)
            ops[nops++] = argv[++i];
        else if (!strcmp(argv[i], "--print"))
            print = 1;
        else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            usage(stdout);
            return 0;
        } else {
            fprintf(stderr, "kvcache view: unexpected argument '%s'\n", argv[i]);
            usage(stderr);
            return 2;
        }
    }
    if (!shape_s) {
        fprintf(stderr, "kvcache view: --shape is required\n");
        return 2;
    }
    if (kv_dtype_parse(dtype_s, &dt) != KV_OK) {
        fprintf(stderr, "kvcache view: %s\n", kv_last_error());
        return 2;
    }
    if (parse_list(shape_s, shape, &ndim) || ndim > KV_MAX_DIMS) {
        fprintf(stderr, "kvcache view: bad --shape '%s' (up to %d comma-separated sizes)\n",
                shape_s, KV_MAX_DIMS);
        return 2;
    }
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0 || shape[i] > (1 << 24) || (numel *= shape[i]) > (1 << 26)) {
            fprintf(stderr,
                    "kvcache view: --shape '%s' must be non-negative and at most 2^26 "
                    "elements in all for this tool\n",
                    shape_s);
            return 2;
        }
    }
    storage = kv_mem_calloc((size_t)(numel ? numel : 1), kv_dtype_size(dt));
    if (!storage) {
        fprintf(stderr, "kvcache view: out of memory\n");
        return 1;
    }
    st = kv_view_init(&v, storage, (size_t)numel * kv_dtype_size(dt), dt, ndim, shape);
    if (st != KV_OK) {
        fprintf(stderr, "kvcache view: %s: %s\n", kv_status_name(st), kv_last_error());
        kv_mem_free(storage);
        return 2;
    }
    kv_view_describe(&v, line, sizeof(line));
    printf("start            %s\n", line);
    for (int i = 0; i < nops; i++) {
        bool copied = false;
        st = apply(&s, ops[i], &v, &copied);
        if (st != KV_OK) {
            printf("%-16s refused: %s: %s\n", ops[i], kv_status_name(st), kv_last_error());
            rc = 1;
            break;
        }
        kv_view_describe(&v, line, sizeof(line));
        printf("%-16s %s%s\n", ops[i], line, copied ? "  [copied]" : "");
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
        kv_mem_free(s.bufs[i]);
    kv_mem_free(storage);
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
    fprintf(stderr, "kvcache cache: %s: %s: %s\n", what, kv_status_name(st), kv_last_error());
    return 1;
}

static int cmd_cache(int argc, char **argv)
{
    struct kv_cache_config cfg;
    const char *seqs_s = "37,70,5";
    int64_t lens[16];
    int nseqs = 0, rc = 0;
    kv_cache *c = NULL;
    kv_page_table *pt;
    uint32_t ids[17];
    char line[1024];
    kv_status st;

    memset(&cfg, 0, sizeof(cfg));
    cfg.layout = (struct kv_layout_config){.num_layers = 4,
                                           .num_blocks = 1024,
                                           .block_tokens = 16,
                                           .num_heads = 8,
                                           .head_dim = 128,
                                           .dtype = KV_BF16};
    cfg.max_seqs = 64;
    cfg.enable_prefix_caching = true;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) {
            fprintf(stderr, "kvcache cache: %s needs a value\n", a);
            return 2;
        }
        i++;
        if (!strcmp(a, "--layers"))
            cfg.layout.num_layers = atoll(v);
        else if (!strcmp(a, "--blocks"))
            cfg.layout.num_blocks = atoll(v);
        else if (!strcmp(a, "--block-tokens"))
            cfg.layout.block_tokens = atoll(v);
        else if (!strcmp(a, "--heads"))
            cfg.layout.num_heads = atoll(v);
        else if (!strcmp(a, "--head-dim"))
            cfg.layout.head_dim = atoll(v);
        else if (!strcmp(a, "--pad"))
            cfg.layout.block_pad_elems = atoll(v);
        else if (!strcmp(a, "--page-ratio"))
            cfg.page_ratio = (uint32_t)atoi(v);
        else if (!strcmp(a, "--seqs"))
            seqs_s = v;
        else if (!strcmp(a, "--order") && (!strcmp(v, "nhd") || !strcmp(v, "hnd")))
            cfg.layout.order = !strcmp(v, "hnd") ? KV_ORDER_HND : KV_ORDER_NHD;
        else if (!strcmp(a, "--arrange") && (!strcmp(v, "layer") || !strcmp(v, "block")))
            cfg.layout.arrange =
                !strcmp(v, "block") ? KV_ARRANGE_BLOCK_MAJOR : KV_ARRANGE_LAYER_MAJOR;
        else if (!strcmp(a, "--dtype")) {
            if (kv_dtype_parse(v, &cfg.layout.dtype) != KV_OK)
                return cache_fail("--dtype", KV_ERR_INVALID_ARG);
        } else {
            fprintf(stderr, "kvcache cache: unexpected argument '%s %s'\n", a, v);
            usage(stderr);
            return 2;
        }
    }
    if (parse_list(seqs_s, lens, &nseqs) || nseqs < 1 || nseqs > 8) {
        fprintf(stderr, "kvcache cache: --seqs takes 1..8 comma-separated lengths\n");
        return 2;
    }
    for (int i = 0; i < nseqs; i++) {
        if (lens[i] < 0 || lens[i] > 4096) {
            fprintf(stderr, "kvcache cache: --seqs length %lld is outside 0..4096\n",
                    (long long)lens[i]);
            return 2;
        }
    }
    st = kv_cache_create(&cfg, &c);
    if (st != KV_OK)
        return cache_fail("create", st);
    pt = kv_cache_page_table(c);
    kv_layout_describe(kv_cache_layout(c), line, sizeof(line));
    printf("layout   %s\n", line);
    {
        const struct kv_layout *lo = kv_cache_layout(c);
        uint32_t layer = lo->num_layers > 1 ? 1 : 0;
        uint32_t blk = (uint32_t)(lo->num_blocks > 1000 ? 1000 : lo->num_blocks - 1);
        struct kv_byte_runs r;
        for (int kv = 0; kv < 2 && rc == 0; kv++) {
            struct kv_view v;
            st = kv_cache_kv_view(c, layer, kv, &v);
            if (st != KV_OK) {
                rc = cache_fail("kv view", st);
                break;
            }
            kv_view_describe(&v, line, sizeof(line));
            printf("layer %u %s  %s\n", layer, kv ? "V" : "K", line);
        }
        st = rc ? KV_OK : kv_layout_block_runs(lo, blk, &r);
        if (st != KV_OK)
            rc = cache_fail("block runs", st);
        else if (rc == 0)
            printf("block %u across layers: %" PRId64 " run(s) of %" PRId64
                   " bytes, stride %" PRId64 " bytes, first at byte %" PRId64 "\n",
                   blk, r.run_count, r.run_bytes, r.run_stride_bytes, r.first_offset_bytes);
    }

    /* Sequences with token ids; the third one repeats the first one's prompt. */
    for (int i = 0; i < nseqs && rc == 0; i++) {
        int32_t toks[4096];
        uint64_t cached = 0, n = (uint64_t)lens[i];
        for (uint64_t t = 0; t < n; t++)
            toks[t] = (int32_t)(100 + t);
        st = kv_page_table_seq_create_from_prefix(pt, toks, n, &ids[i], &cached);
        if (st == KV_OK)
            st = kv_page_table_seq_append(pt, ids[i], toks + cached, n - cached);
        if (st != KV_OK)
            rc = cache_fail("append", st);
        else
            printf("seq %u: %" PRIu64 " tokens (%" PRIu64 " reused from the prefix cache)\n",
                   ids[i], n, cached);
    }
    if (rc == 0) {
        uint32_t child;
        int32_t t = 7;
        struct kv_block_copy cp[4];
        uint32_t ncp = 0;
        st = kv_page_table_seq_fork(pt, ids[0], &child);
        if (st == KV_OK)
            st = kv_page_table_seq_append(pt, child, &t, 1);
        if (st == KV_OK)
            st = kv_page_table_take_copies(pt, cp, 4, &ncp);
        if (st != KV_OK) {
            rc = cache_fail("fork", st);
            kv_cache_destroy(c);
            return rc;
        }
        printf("fork of seq %u -> seq %u, one token appended: %u copy-on-write cop%s", ids[0],
               child, ncp, ncp == 1 ? "y" : "ies");
        for (uint32_t i = 0; i < ncp; i++)
            printf(" (block %u -> %u, %u tokens)", cp[i].src, cp[i].dst, cp[i].tokens);
        printf("\n");
        ids[nseqs++] = child;
    }
    if (rc == 0) {
        int32_t bt[9 * 512], indptr[10], indices[9 * 512], last[9];
        int64_t slots[9];
        struct kv_token_range ranges[9];
        struct kv_vllm_export ve = {0};
        struct kv_flashinfer_export fe = {indptr, 10, indices, 9 * 512, last, 9};
        uint64_t nnz = 0, maxlen = 0;
        for (int i = 0; i < nseqs; i++) {
            uint64_t len;
            kv_page_table_seq_len(pt, ids[i], &len);
            ranges[i].start = len ? len - 1 : 0; /* the newest token of each: a decode step */
            ranges[i].count = len ? 1 : 0;
            maxlen = len > maxlen ? len : maxlen;
        }
        ve.block_table = bt;
        ve.block_table_cols = 512;
        ve.block_table_len = (uint64_t)nseqs * 512;
        ve.slot_mapping = slots;
        ve.slot_mapping_len = (uint64_t)nseqs;
        st = kv_page_table_export_vllm(pt, ids, (uint32_t)nseqs, ranges, &ve);
        if (st == KV_OK)
            st = kv_page_table_export_flashinfer(pt, ids, (uint32_t)nseqs, &fe, &nnz);
        if (st != KV_OK) {
            rc = cache_fail("export", st);
            kv_cache_destroy(c);
            return rc;
        }
        printf("vLLM export (decode step):\n");
        for (int i = 0; i < nseqs; i++) {
            char label[32];
            uint64_t pages = (uint64_t)(indptr[i + 1] - indptr[i]);
            snprintf(label, sizeof(label), "block_table[%d]", i);
            print_i32_row(label, bt + (size_t)i * 512, pages);
        }
        printf("  slot_mapping   [");
        for (int i = 0; i < nseqs; i++)
            printf(i ? ",%" PRId64 : "%" PRId64, slots[i]);
        printf("]\nFlashInfer export (%" PRIu64 " pages):\n", nnz);
        print_i32_row("indptr", indptr, (uint64_t)nseqs + 1);
        print_i32_row("indices", indices, nnz);
        print_i32_row("last_page_len", last, (uint64_t)nseqs);
    }
    {
        struct kv_block_pool_stats ps;
        kv_block_pool_get_stats(kv_cache_pool(c), &ps);
        printf("pool: capacity %u, used %u, cached %u, free %u, prefix hits %" PRIu64
               ", misses %" PRIu64 ", high-water %u\n",
               ps.capacity, ps.used_blocks, ps.cached_blocks, ps.free_blocks, ps.hits, ps.misses,
               ps.used_high_water);
    }
    kv_cache_destroy(c);
    return rc;
}

int main(int argc, char **argv)
{
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    if (!strcmp(argv[1], "view"))
        return cmd_view(argc - 2, argv + 2);
    if (!strcmp(argv[1], "cache"))
        return cmd_cache(argc - 2, argv + 2);
    if (!strcmp(argv[1], "version")) {
        printf("kvcache %s (host memory: %s)\n", kv_version(), kv_mem_backend());
        return 0;
    }
    fprintf(stderr, "kvcache: unknown command '%s'\n", argv[1]);
    usage(stderr);
    return 2;
}
