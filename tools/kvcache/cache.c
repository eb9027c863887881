/*
 * cache.c - kvcache cache: a model's KV cache, a few prompts and a fork with
 * copy-on-write through its page table, then the block table / slot mapping
 * (vLLM) and the CSR (FlashInfer) a kernel takes, and the pool's counters.
 *
 *   kvcache cache --seqs 37,70,37
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

#define MAX_SEQS 8          /* cache --seqs entries */
#define MAX_SEQ_TOKENS 4096 /* cache --seqs length */

void usage_cache(FILE *f)
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

#define CACHE_OPT0 256 /* getopt_long's val of the first option */

struct cache_opt {
    const char *name; /* "--layers" */
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
    /* getopt_long's table: opts[k] ("--layers" -> "layers") is val CACHE_OPT0 + k.
     * No --help: cmd_cache has looked for it first. */
    struct option longopts[sizeof(opts) / sizeof(opts[0]) + 1];
    struct cli_opts p = {.cmd = "cache", .longopts = longopts, .usage = usage_cache};
    char err[ERR_CAP];
    int c;

    for (int k = 0; k < nopts; k++)
        longopts[k] = (struct option){opts[k].name + 2, required_argument, NULL, CACHE_OPT0 + k};
    longopts[nopts] = (struct option){NULL, 0, NULL, 0};
    optind = 1; /* argv[0] is "cache" */
    /* every option's val is CACHE_OPT0 + k; CLI_END and CLI_BAD are below */
    while ((c = cli_next(&p, argc, argv)) >= CACHE_OPT0) {
        struct cache_opt *o = &opts[c - CACHE_OPT0];
        const char *v;

        if (o->seen)
            return usage_error("cache", "%s given twice", o->name);
        o->seen = true;
        if (!(v = cli_value(&p)))
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
    if (c == CLI_BAD)
        return EXIT_USAGE;
    cfg->page_ratio = (uint32_t)page_ratio; /* 1..UINT32_MAX, checked above */
    return 0;
}

/* Token i of prompt `family`: distinct families never share a block. */
static int32_t prompt_token(int family, uint64_t i)
{
    return (int32_t)(100000 * (family + 1) + (int64_t)i);
}

int cmd_cache(int argc, char **argv)
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

    /* --help anywhere, even after a bad option or as a value, prints the usage */
    for (int i = 1; i < argc; i++) {
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
