/*
 * kvdemo - a disaggregated prefill -> decode run on loopback (make demo).
 *
 *   kvdemo [--requests N] [--seed S] [--transport tcp|rdma] [--local]
 *   kvdemo decode --port P [--port-fd FD] [--report-fd FD] [options]
 *   kvdemo prefill --port P [--report-fd FD] [options]
 *
 * With no role, kvdemo starts two processes (fork + exec of itself): a
 * decode process listening on 127.0.0.1 (port 0; it tells the parent its
 * port through a pipe) and a prefill process that connects to it. Both
 * derive the same batch of requests from the seed (random lengths 1..2048,
 * every third one sharing a prefix of PREFIX_BLOCKS blocks).
 *
 *   prefill (own layout: N 16, NHD, layer-major)    decode (4 layouts, one per request group)
 *                                                   churn each pool (ids spread up to B - 1)
 *                                          <--place-- alloc blocks; placement: request, tokens,
 *                                                     layout config, block ids, (once) blob
 *   decode's layout from its config (the library's codec: fingerprint checked)
 *   write K/V through kv_attn_write (generator)
 *   (first prefix request) offload store, scramble
 *   the pool, load back, compare bit for bit
 *   kv_xport_write_plan into decode's blocks ===data + done===> read back through the page
 *   wait DONE, free                                 table, every byte against the generator;
 *                                                   decode attention vs a plain reference; free
 *
 * --local runs both sides in one process, the transfer as kv_plan_copy of
 * the same plans: the self-check of everything but the transport.
 *
 * The parent prints the final table (from both children's reports). Exit
 * status: 0 when every check passed; 1 when a check failed (the first one is
 * named) or the library refused a call; 2 for a usage error.
 */
#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <kvcache/kv.h>
#include "kv_convert_hd.h" /* scalar conversions: not installed */

#define EXIT_FAILED 1
#define EXIT_USAGE 2

/* ---- the model and the batch ------------------------------------------------ */

#define L_LAYERS 4
#define H_KV 8
#define H_Q 16 /* query heads: GQA, 2 per KV head */
#define D_HEAD 128
#define DTYPE KV_BF16
#define ELEM 2
#define TOKEN_BYTES ((uint64_t)L_LAYERS * 2 * H_KV * D_HEAD * ELEM) /* 16 KiB */
#define MAX_TOKENS 2048
#define MAX_REQUESTS 256
#define PF_N 16 /* prefill page size */
#define PF_BLOCKS 384
#define PREFIX_BLOCKS 3
#define PREFIX_TOKENS (PREFIX_BLOCKS * PF_N)
#define N_GROUPS 4
#define WINDOW 4 /* placements decode keeps in flight */
#define WAIT_MS 30000
#define XPORT_TOKEN UINT64_C(0x6b7664656d6f2121)

/* Tags of the notifications. */
enum { TAG_PLACE = 1, TAG_DONE = 2, TAG_FAILED = 3, TAG_END = 4 };

struct request {
    uint32_t id;
    uint32_t n_tokens;
    bool prefix; /* its first PREFIX_TOKENS tokens are the shared prefix */
};

static uint64_t mix64(uint64_t x)
{
    x ^= x >> 33;
    x *= UINT64_C(0xff51afd7ed558ccd);
    x ^= x >> 33;
    x *= UINT64_C(0xc4ceb9fe1a85ec53);
    x ^= x >> 33;
    return x;
}

static uint64_t rng_next(uint64_t *s)
{
    *s += UINT64_C(0x9e3779b97f4a7c15);
    return mix64(*s);
}

/* The batch both sides derive from the seed. */
static void make_requests(uint64_t seed, uint32_t n, struct request *out)
{
    uint64_t s = seed;
    for (uint32_t r = 0; r < n; r++) {
        out[r].id = r;
        out[r].prefix = r % 3 == 0;
        uint32_t len = 1 + (uint32_t)(rng_next(&s) % MAX_TOKENS);
        if (out[r].prefix && len <= PREFIX_TOKENS)
            len += PREFIX_TOKENS;
        out[r].n_tokens = len;
    }
}

/* Which stream token t of request r belongs to: the shared prefix (0) or
 * the request's own (r + 1). Values and token ids depend on the stream and
 * the position only, so a shared prefix has the same K/V in every request. */
static uint32_t stream_of(const struct request *r, uint32_t t)
{
    return r->prefix && t < PREFIX_TOKENS ? 0 : r->id + 1;
}

static int32_t token_id(const struct request *r, uint32_t t)
{
    const uint32_t s = stream_of(r, t);
    return (int32_t)(mix64(((uint64_t)s << 32) | t) & 0x7fffffff);
}

/* The generator: one bf16 value per (stream, layer, position, head, dim,
 * k|v|q), an integer / 64 in [-2, 2) (exact in bf16). kv 2 is the query. */
static float gen_value(uint64_t seed, uint32_t stream, uint32_t layer, uint32_t pos, uint32_t head,
                       uint32_t d, uint32_t kv)
{
    const uint64_t key = ((uint64_t)stream << 32) | ((uint64_t)layer << 27) | ((uint64_t)kv << 25) |
                         ((uint64_t)pos << 11) | ((uint64_t)head << 7) | d;
    const int8_t b = (int8_t)(mix64(key ^ (seed * UINT64_C(0x2545f4914f6cdd1d))) & 0xff);
    return (float)b / 64.0f;
}

/* K and V of tokens [t0, t0 + T) of r as [L][T][H][D] bf16. */
static void gen_kv(uint64_t seed, const struct request *r, uint32_t t0, uint32_t T, uint16_t *k,
                   uint16_t *v)
{
    size_t i = 0;
    for (uint32_t l = 0; l < L_LAYERS; l++)
        for (uint32_t t = t0; t < t0 + T; t++) {
            const uint32_t s = stream_of(r, t);
            for (uint32_t h = 0; h < H_KV; h++)
                for (uint32_t d = 0; d < D_HEAD; d++, i++) {
                    k[i] = kv_f32_to_bf16(gen_value(seed, s, l, t, h, d, 0));
                    v[i] = kv_f32_to_bf16(gen_value(seed, s, l, t, h, d, 1));
                }
        }
}

/* ---- stages, checks, errors --------------------------------------------------- */

enum stage { ST_WRITE, ST_STORE, ST_LOAD, ST_XFER, ST_VERIFY, ST_ATTN, ST_COUNT };
static const char *const stage_name[ST_COUNT] = {
    "write kernel (prefill)", "offload store", "offload load",
    "transfer (plan)",        "decode verify", "decode attention",
};

struct report {
    uint64_t bytes[ST_COUNT];
    uint64_t ns[ST_COUNT];
    uint64_t calls[ST_COUNT];
    uint64_t checks, passed;
    uint64_t requests, requests_ok, tokens, xfer_bytes;
    double attn_max_err;
    uint32_t id_min, id_max;                      /* decode block ids handed to prefill */
    uint64_t xg_bytes[N_GROUPS], xg_ns[N_GROUPS]; /* the transfer by decode layout */
    char first_fail[512];
};

static struct report g_rep;
static bool g_tty;
static const char *g_role = "kvdemo";

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void stage_add(enum stage s, uint64_t bytes, uint64_t t0)
{
    g_rep.bytes[s] += bytes;
    g_rep.ns[s] += now_ns() - t0;
    g_rep.calls[s]++;
}

static void xfer_add(uint32_t g, uint32_t n_tokens, uint64_t t0)
{
    g_rep.xg_bytes[g] += (uint64_t)n_tokens * TOKEN_BYTES;
    g_rep.xg_ns[g] += now_ns() - t0;
    stage_add(ST_XFER, (uint64_t)n_tokens * TOKEN_BYTES, t0);
}

/* Count a check; a failing one is named (the first is kept). */
__attribute__((format(printf, 2, 3))) static bool check(bool ok, const char *fmt, ...)
{
    g_rep.checks++;
    if (ok) {
        g_rep.passed++;
        return true;
    }
    char msg[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    fprintf(stderr, "%s%s: CHECK FAILED: %s\n", g_tty ? "\n" : "", g_role, msg);
    if (!g_rep.first_fail[0])
        snprintf(g_rep.first_fail, sizeof(g_rep.first_fail), "%s: %s", g_role, msg);
    return false;
}

/* A library call that must succeed: its status and words, then false. */
static bool ok_call(kv_status st, const char *what)
{
    if (st == KV_OK)
        return true;
    fprintf(stderr, "%s: %s: %s: %s\n", g_role, what, kv_status_name(st), kv_last_error());
    if (!g_rep.first_fail[0])
        snprintf(g_rep.first_fail, sizeof(g_rep.first_fail), "%s: %s refused: %s: %s", g_role, what,
                 kv_status_name(st), kv_last_error());
    return false;
}

static bool fail_msg(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static bool fail_msg(const char *fmt, ...)
{
    char msg[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    fprintf(stderr, "%s: %s\n", g_role, msg);
    if (!g_rep.first_fail[0])
        snprintf(g_rep.first_fail, sizeof(g_rep.first_fail), "%s: %s", g_role, msg);
    return false;
}

/* ---- a cache with its page table ----------------------------------------------- */

struct side {
    kv_cache *c;
    kv_page_table *pt;
    kv_block_pool *pool;
    struct kv_paged_cache pc;
    const struct kv_layout *lo;
    char desc[160];
};

static bool side_make(struct side *s, const struct kv_layout_config *lc, bool prefix)
{
    memset(s, 0, sizeof(*s));
    struct kv_cache_config cfg;
    kv_cache_config_init(&cfg);
    cfg.layout = *lc;
    cfg.max_seqs = 16;
    cfg.enable_prefix_caching = prefix;
    if (!ok_call(kv_cache_create(&cfg, &s->c), "kv_cache_create"))
        return false;
    s->pt = kv_cache_page_table(s->c);
    s->pool = kv_cache_pool(s->c);
    s->lo = kv_cache_layout(s->c);
    if (!ok_call(kv_cache_paged(s->c, &s->pc), "kv_cache_paged"))
        return false;
    snprintf(s->desc, sizeof(s->desc), "N=%" PRId64 " %s %s%s", lc->block_tokens,
             kv_order_name(lc->order), kv_arrange_name(lc->arrange),
             lc->block_pad_elems || lc->block_stride_bytes ? " padded" : "");
    return true;
}

static void side_free(struct side *s)
{
    kv_cache_destroy(s->c);
    memset(s, 0, sizeof(*s));
}

static uint32_t ceil_div(uint64_t a, uint64_t b)
{
    return (uint32_t)((a + b - 1) / b);
}

/* Every byte of block b's data (its runs) into out / from in. */
static void block_bytes(const struct side *s, uint32_t b, unsigned char *out, const void *in,
                        int fill)
{
    struct kv_byte_runs br;
    if (kv_layout_block_runs(s->lo, b, &br) != KV_OK)
        return;
    unsigned char *base = s->pc.base;
    for (int64_t i = 0; i < br.run_count; i++) {
        unsigned char *p = base + br.first_offset_bytes + i * br.run_stride_bytes;
        if (out)
            memcpy(out + i * br.run_bytes, p, (size_t)br.run_bytes);
        else if (in)
            memcpy(p, (const unsigned char *)in + i * br.run_bytes, (size_t)br.run_bytes);
        else
            memset(p, fill, (size_t)br.run_bytes);
    }
}

static uint64_t block_data_bytes(const struct side *s)
{
    return (uint64_t)(s->lo->num_layers * s->lo->kv_planes * s->lo->block_bytes);
}

/* The CSR pages of one sequence (arrays sized by the caller). */
static bool seq_pages(const struct side *s, uint32_t seq, int32_t *indptr, int32_t *indices,
                      uint64_t indices_len, int32_t *last, struct kv_pages *pages)
{
    const struct kv_flashinfer_export fx = {indptr, 2, indices, indices_len, last, 1};
    if (!ok_call(kv_page_table_export_flashinfer(s->pt, &seq, 1, &fx, NULL),
                 "kv_page_table_export_flashinfer"))
        return false;
    memset(pages, 0, sizeof(*pages));
    pages->format = KV_PAGES_CSR;
    pages->n_seqs = 1;
    pages->page_ratio = 1;
    pages->indptr = indptr;
    pages->indices = indices;
    pages->last_page_len = last;
    return true;
}

static bool kv_views(uint16_t *k, uint16_t *v, uint32_t T, struct kv_view *kv_, struct kv_view *vv)
{
    const int64_t shape[4] = {L_LAYERS, T, H_KV, D_HEAD};
    const size_t bytes = (size_t)L_LAYERS * T * H_KV * D_HEAD * ELEM;
    return ok_call(kv_view_init(k, bytes, DTYPE, 4, shape, kv_), "kv_view_init (K)") &&
           ok_call(kv_view_init(v, bytes, DTYPE, 4, shape, vv), "kv_view_init (V)");
}

/* ---- prefill --------------------------------------------------------------------- */

struct prefill {
    uint64_t seed;
    struct side s;
    kv_offload *off;
    uint64_t prefix_hash[PREFIX_BLOCKS];
    bool prefix_stored;
    uint16_t *k, *v; /* [L][MAX_TOKENS][H][D] */
    int64_t *slots;
    int32_t *tokens;
};

static bool prefill_init(struct prefill *p, uint64_t seed)
{
    memset(p, 0, sizeof(*p));
    p->seed = seed;
    struct kv_layout_config lc;
    kv_layout_config_init(&lc);
    lc.num_layers = L_LAYERS;
    lc.num_blocks = PF_BLOCKS;
    lc.block_tokens = PF_N;
    lc.num_heads = H_KV;
    lc.head_dim = D_HEAD;
    lc.dtype = DTYPE;
    if (!side_make(&p->s, &lc, true))
        return false;
    struct kv_offload_config oc;
    kv_offload_config_init(&oc);
    oc.capacity_bytes = 16u << 20;
    oc.mem = KV_OFFLOAD_MEM_HOST;
    if (!ok_call(kv_offload_create(&oc, &p->off), "kv_offload_create"))
        return false;
    const size_t elems = (size_t)L_LAYERS * MAX_TOKENS * H_KV * D_HEAD;
    p->k = malloc(elems * ELEM);
    p->v = malloc(elems * ELEM);
    p->slots = malloc(MAX_TOKENS * sizeof(*p->slots));
    p->tokens = malloc(MAX_TOKENS * sizeof(*p->tokens));
    if (!p->k || !p->v || !p->slots || !p->tokens)
        return fail_msg("out of memory");
    return true;
}

static void prefill_fini(struct prefill *p)
{
    kv_offload_destroy(p->off);
    side_free(&p->s);
    free(p->k);
    free(p->v);
    free(p->slots);
    free(p->tokens);
}

static bool offload_wait(kv_offload_op *op, kv_offload_state *st)
{
    if (!ok_call(kv_offload_wait(op, WAIT_MS, st), "kv_offload_wait"))
        return false;
    return true;
}

/* A later prefix request: the prefix blocks the pool lost come back from the
 * tier, so the page table's prefix match finds all of them. */
static bool prefill_prefix_fetch(struct prefill *p)
{
    uint32_t held[PREFIX_BLOCKS], n_found = 0;
    if (!ok_call(kv_block_pool_lookup(p->s.pool, p->prefix_hash, PREFIX_BLOCKS, held, &n_found),
                 "kv_block_pool_lookup"))
        return false;
    bool ok = true;
    if (n_found < PREFIX_BLOCKS) {
        const uint32_t n = PREFIX_BLOCKS - n_found;
        kv_offload_op *op = NULL;
        const uint64_t t0 = now_ns();
        ok = ok_call(kv_offload_load(p->off, p->s.c, p->prefix_hash + n_found, n, &op),
                     "kv_offload_load");
        kv_offload_state st = KV_OFFLOAD_PENDING;
        if (ok && (ok = offload_wait(op, &st))) {
            stage_add(ST_LOAD, n * block_data_bytes(&p->s), t0);
            const struct kv_offload_result *res;
            uint32_t nr = 0;
            ok = ok_call(kv_offload_results(op, &res, &nr), "kv_offload_results");
            for (uint32_t i = 0; ok && i < nr; i++) {
                check(res[i].status == KV_OK, "offload load of prefix block %u: %s", n_found + i,
                      kv_status_name(res[i].status));
                if (res[i].status == KV_OK)
                    ok = ok_call(kv_block_pool_release(p->s.pool, &res[i].block, 1),
                                 "kv_block_pool_release");
            }
            check(st == KV_OFFLOAD_DONE, "offload load ended %s", kv_offload_state_name(st));
        }
        if (op && kv_offload_op_free(op) != KV_OK)
            ok = fail_msg("kv_offload_op_free refused a terminal op");
    }
    /* the found blocks stay held until the sequence has taken its own refs */
    if (n_found && !ok_call(kv_block_pool_release(p->s.pool, held, n_found), "release"))
        return false;
    return ok;
}

/* Write request r into a new sequence of the prefill cache: *seq, blocks. */
static bool prefill_request(struct prefill *p, const struct request *r, uint32_t *seq)
{
    for (uint32_t t = 0; t < r->n_tokens; t++)
        p->tokens[t] = token_id(r, t);
    if (r->prefix && p->prefix_stored && !prefill_prefix_fetch(p))
        return false;
    uint64_t cached = 0;
    if (!ok_call(
            kv_page_table_seq_create_from_prefix(p->s.pt, p->tokens, r->n_tokens, seq, &cached),
            "kv_page_table_seq_create_from_prefix"))
        return false;
    if (r->prefix && p->prefix_stored)
        check(cached == PREFIX_TOKENS,
              "request %u: prefix reuse found %" PRIu64 " of %d tokens (pool + offload tier)",
              r->id, cached, PREFIX_TOKENS);
    const uint32_t T = r->n_tokens - (uint32_t)cached;
    if (!ok_call(kv_page_table_seq_append(p->s.pt, *seq, p->tokens + cached, T),
                 "kv_page_table_seq_append"))
        return false;
    const struct kv_token_range range = {cached, T};
    const struct kv_vllm_export vx = {.slot_mapping = p->slots, .slot_mapping_len = T};
    if (!ok_call(kv_page_table_export_vllm(p->s.pt, seq, 1, &range, &vx),
                 "kv_page_table_export_vllm"))
        return false;
    gen_kv(p->seed, r, (uint32_t)cached, T, p->k, p->v);
    struct kv_view kv_, vv;
    if (!kv_views(p->k, p->v, T, &kv_, &vv))
        return false;
    const uint64_t t0 = now_ns();
    if (!ok_call(kv_attn_write(p->s.pc, KV_ATTN_ALL_LAYERS, &kv_, &vv, p->slots, T, NULL),
                 "kv_attn_write"))
        return false;
    stage_add(ST_WRITE, (uint64_t)T * TOKEN_BYTES, t0);
    return true;
}

/* The first prefix request, once written: store its prefix blocks in the
 * tier (they carry the hashes the page table committed). */
static bool prefill_offload_store(struct prefill *p, uint32_t seq, unsigned char *snap)
{
    const uint32_t *blocks;
    uint32_t nb = 0;
    if (!ok_call(kv_page_table_seq_blocks(p->s.pt, seq, &blocks, &nb), "kv_page_table_seq_blocks"))
        return false;
    if (nb < PREFIX_BLOCKS)
        return fail_msg("prefix request holds %u blocks, fewer than the prefix", nb);
    const uint64_t bb = block_data_bytes(&p->s);
    for (uint32_t i = 0; i < PREFIX_BLOCKS; i++) {
        if (!ok_call(kv_block_pool_block_hash(p->s.pool, blocks[i], &p->prefix_hash[i]),
                     "kv_block_pool_block_hash (prefix block)"))
            return false;
        block_bytes(&p->s, blocks[i], snap + i * bb, NULL, 0);
    }
    kv_offload_op *op = NULL;
    const uint64_t t0 = now_ns();
    if (!ok_call(kv_offload_store(p->off, p->s.c, blocks, PREFIX_BLOCKS, &op), "kv_offload_store"))
        return false;
    kv_offload_state st = KV_OFFLOAD_PENDING;
    bool ok = offload_wait(op, &st);
    if (ok) {
        stage_add(ST_STORE, PREFIX_BLOCKS * bb, t0);
        check(st == KV_OFFLOAD_DONE, "offload store of the prefix ended %s",
              kv_offload_state_name(st));
    }
    if (kv_offload_op_free(op) != KV_OK)
        ok = fail_msg("kv_offload_op_free refused a terminal op");
    p->prefix_stored = ok && st == KV_OFFLOAD_DONE;
    return ok;
}

/* After the first prefix request is freed: take every free and cached block
 * of the pool (evicting the prefix's hashes), scramble them, give them back,
 * load the prefix from the tier and compare it with the snapshot. */
static bool prefill_offload_roundtrip(struct prefill *p, const uint32_t *old_ids,
                                      const unsigned char *snap)
{
    struct kv_block_pool_stats ps;
    kv_block_pool_stats_get(p->s.pool, &ps);
    const uint32_t n = ps.free_blocks + ps.cached_blocks;
    uint32_t *ids = malloc((size_t)n * sizeof(*ids));
    const uint64_t bb = block_data_bytes(&p->s);
    unsigned char *tmp = malloc(bb);
    if (!ids || !tmp) {
        free(ids);
        free(tmp);
        return fail_msg("out of memory");
    }
    bool ok = ok_call(kv_block_pool_alloc(p->s.pool, n, ids), "kv_block_pool_alloc (scramble)");
    for (uint32_t i = 0; ok && i < n; i++)
        block_bytes(&p->s, ids[i], NULL, NULL, 0xa5);
    for (uint32_t i = 0; ok && i < PREFIX_BLOCKS; i++) {
        block_bytes(&p->s, old_ids[i], tmp, NULL, 0);
        check(memcmp(tmp, snap + i * bb, bb) != 0, "scramble left prefix block %u intact",
              old_ids[i]);
    }
    uint32_t held[PREFIX_BLOCKS], found = 0;
    if (ok)
        ok = ok_call(kv_block_pool_release(p->s.pool, ids, n), "kv_block_pool_release");
    if (ok)
        ok = ok_call(kv_block_pool_lookup(p->s.pool, p->prefix_hash, PREFIX_BLOCKS, held, &found),
                     "kv_block_pool_lookup");
    if (ok) {
        check(found == 0, "the pool still holds %u prefix blocks after the scramble", found);
        if (found)
            ok = ok_call(kv_block_pool_release(p->s.pool, held, found), "release");
    }
    kv_offload_op *op = NULL;
    kv_offload_state st = KV_OFFLOAD_PENDING;
    const uint64_t t0 = now_ns();
    if (ok)
        ok = ok_call(kv_offload_load(p->off, p->s.c, p->prefix_hash, PREFIX_BLOCKS, &op),
                     "kv_offload_load");
    if (ok && (ok = offload_wait(op, &st))) {
        stage_add(ST_LOAD, PREFIX_BLOCKS * bb, t0);
        const struct kv_offload_result *res;
        uint32_t nr = 0;
        ok = ok_call(kv_offload_results(op, &res, &nr), "kv_offload_results");
        for (uint32_t i = 0; ok && i < nr; i++) {
            if (!check(res[i].status == KV_OK, "offload load of prefix block %u: %s", i,
                       kv_status_name(res[i].status)))
                continue;
            block_bytes(&p->s, res[i].block, tmp, NULL, 0);
            check(memcmp(tmp, snap + i * bb, bb) == 0,
                  "prefix block %u (hash %016" PRIx64 ") loaded into block %u is not "
                  "bit-identical to what was stored",
                  i, p->prefix_hash[i], res[i].block);
            ok = ok_call(kv_block_pool_release(p->s.pool, &res[i].block, 1), "release");
        }
        check(st == KV_OFFLOAD_DONE, "offload load ended %s", kv_offload_state_name(st));
    }
    if (op && kv_offload_op_free(op) != KV_OK)
        ok = fail_msg("kv_offload_op_free refused a terminal op");
    free(ids);
    free(tmp);
    return ok;
}

/* ---- decode ------------------------------------------------------------------------ */

/* The decode layouts, one per request group: page size, order, arrangement
 * and padding all differ from prefill's (N 16, NHD, layer-major, unpadded). */
static void group_layout(uint32_t g, struct kv_layout_config *lc)
{
    static const struct {
        int64_t n;
        kv_order order;
        kv_arrange arrange;
        int64_t pad_elems, stride_extra_bytes;
    } v[N_GROUPS] = {
        {32, KV_ORDER_NHD, KV_ARRANGE_LAYER_MAJOR, 0, 0},
        {16, KV_ORDER_HND, KV_ARRANGE_BLOCK_MAJOR, 0, 0},
        {8, KV_ORDER_NHD, KV_ARRANGE_BLOCK_MAJOR, 64, 0},
        {64, KV_ORDER_HND, KV_ARRANGE_LAYER_MAJOR, 0, 4096},
    };
    kv_layout_config_init(lc);
    lc->num_layers = L_LAYERS;
    lc->block_tokens = v[g].n;
    lc->num_blocks = 3 * MAX_TOKENS / v[g].n + 1; /* half held by "other sequences" */
    lc->num_heads = H_KV;
    lc->head_dim = D_HEAD;
    lc->dtype = DTYPE;
    lc->order = v[g].order;
    lc->arrange = v[g].arrange;
    lc->block_pad_elems = v[g].pad_elems;
    if (v[g].stride_extra_bytes)
        lc->block_stride_bytes = v[g].n * H_KV * D_HEAD * ELEM + v[g].stride_extra_bytes;
}

struct decode_group {
    struct side s;
    uint32_t *ballast; /* blocks held for the whole run, filled with a pattern */
    uint32_t n_ballast;
};

struct inflight {
    bool live;
    uint32_t req, seq;
};

struct decode {
    uint64_t seed;
    struct decode_group g[N_GROUPS];
    struct inflight fl[MAX_REQUESTS];
    uint16_t *k, *v, *ek, *ev; /* [L][MAX_TOKENS][H][D] */
    int32_t *indices;
    uint32_t verified;
    bool fault; /* --fault: corrupt one request after its transfer */
    uint32_t fault_req;
};

static unsigned char ballast_fill(uint32_t b)
{
    return (unsigned char)(0x11 + b * 7);
}

/* Churn: take every block, give back half of them (the odd positions) in a
 * shuffled order, keep the other half held and patterned. Requests then get
 * ids spread over [1, B), many of them high. */
static bool decode_group_init(struct decode_group *dg, uint32_t g, uint64_t seed)
{
    memset(dg, 0, sizeof(*dg));
    struct kv_layout_config lc;
    group_layout(g, &lc);
    if (!side_make(&dg->s, &lc, false))
        return false;
    const uint32_t n = (uint32_t)lc.num_blocks - 1;
    uint32_t *ids = malloc((size_t)n * sizeof(*ids));
    dg->ballast = malloc((size_t)n * sizeof(*ids));
    if (!ids || !dg->ballast) {
        free(ids);
        return fail_msg("out of memory");
    }
    if (!ok_call(kv_block_pool_alloc(dg->s.pool, n, ids), "kv_block_pool_alloc (churn)")) {
        free(ids);
        return false;
    }
    uint64_t s = seed ^ (0x51ed + g);
    for (uint32_t i = n - 1; i > 0; i--) {
        const uint32_t j = (uint32_t)(rng_next(&s) % (i + 1));
        const uint32_t t = ids[i];
        ids[i] = ids[j];
        ids[j] = t;
    }
    uint32_t n_free = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (i % 2) {
            ids[n_free++] = ids[i];
        } else {
            dg->ballast[dg->n_ballast++] = ids[i];
            block_bytes(&dg->s, ids[i], NULL, NULL, ballast_fill(ids[i]));
        }
    }
    const bool ok = ok_call(kv_block_pool_release(dg->s.pool, ids, n_free), "release (churn)");
    free(ids);
    return ok;
}

/* The blocks other sequences hold were never written by a transfer. */
static void decode_group_check(struct decode_group *dg, uint32_t g)
{
    const uint64_t bb = block_data_bytes(&dg->s);
    unsigned char *tmp = malloc(bb);
    if (!tmp) {
        fail_msg("out of memory");
        return;
    }
    uint32_t bad = 0, first = 0;
    for (uint32_t i = 0; i < dg->n_ballast; i++) {
        block_bytes(&dg->s, dg->ballast[i], tmp, NULL, 0);
        const unsigned char f = ballast_fill(dg->ballast[i]);
        for (uint64_t j = 0; j < bb; j++)
            if (tmp[j] != f) {
                if (!bad++)
                    first = dg->ballast[i];
                break;
            }
    }
    check(bad == 0, "group %u (%s): %u blocks held by other sequences were overwritten (first: %u)",
          g, dg->s.desc, bad, first);
    free(tmp);
}

static bool decode_init(struct decode *d, uint64_t seed)
{
    memset(d, 0, sizeof(*d));
    d->seed = seed;
    for (uint32_t g = 0; g < N_GROUPS; g++)
        if (!decode_group_init(&d->g[g], g, seed))
            return false;
    const size_t elems = (size_t)L_LAYERS * MAX_TOKENS * H_KV * D_HEAD;
    d->k = malloc(elems * ELEM);
    d->v = malloc(elems * ELEM);
    d->ek = malloc(elems * ELEM);
    d->ev = malloc(elems * ELEM);
    d->indices = malloc((MAX_TOKENS + 1) * sizeof(*d->indices));
    if (!d->k || !d->v || !d->ek || !d->ev || !d->indices)
        return fail_msg("out of memory");
    return true;
}

static void decode_fini(struct decode *d)
{
    for (uint32_t g = 0; g < N_GROUPS; g++) {
        side_free(&d->g[g].s);
        free(d->g[g].ballast);
    }
    free(d->k);
    free(d->v);
    free(d->ek);
    free(d->ev);
    free(d->indices);
}

/* What decode tells prefill about one request. */
struct placement {
    uint32_t req, group;
    uint64_t n_tokens;
    struct kv_layout_config lc; /* the config of decode's layout (kv_layout_config_from) */
    uint32_t n_blocks;
    const uint32_t *blocks;
    uint32_t blob_len;
    const unsigned char *blob;
};

/* Allocate request r's blocks in its group's cache. */
static bool decode_place(struct decode *d, const struct request *r, struct placement *pl)
{
    const uint32_t g = r->id % N_GROUPS;
    struct decode_group *dg = &d->g[g];
    struct inflight *f = &d->fl[r->id];
    if (!ok_call(kv_page_table_seq_create(dg->s.pt, &f->seq), "kv_page_table_seq_create"))
        return false;
    if (!ok_call(kv_page_table_seq_append(dg->s.pt, f->seq, NULL, r->n_tokens),
                 "kv_page_table_seq_append")) {
        if (kv_page_table_seq_free(dg->s.pt, f->seq) != KV_OK)
            fail_msg("kv_page_table_seq_free: %s", kv_last_error());
        return false;
    }
    f->live = true;
    f->req = r->id;
    const uint32_t *ids;
    uint32_t nb = 0;
    if (kv_page_table_seq_blocks(dg->s.pt, f->seq, &ids, &nb) == KV_OK)
        for (uint32_t i = 0; i < nb; i++) {
            if (!g_rep.id_min || ids[i] < g_rep.id_min)
                g_rep.id_min = ids[i];
            if (ids[i] > g_rep.id_max)
                g_rep.id_max = ids[i];
        }
    memset(pl, 0, sizeof(*pl));
    pl->req = r->id;
    pl->group = g;
    pl->n_tokens = r->n_tokens;
    return ok_call(kv_layout_config_from(dg->s.lo, &pl->lc), "kv_layout_config_from") &&
           ok_call(kv_page_table_seq_blocks(dg->s.pt, f->seq, &pl->blocks, &pl->n_blocks),
                   "kv_page_table_seq_blocks");
}

static void decode_release(struct decode *d, uint32_t req)
{
    struct inflight *f = &d->fl[req];
    if (!f->live)
        return;
    (void)ok_call(kv_page_table_seq_free(d->g[req % N_GROUPS].s.pt, f->seq),
                  "kv_page_table_seq_free");
    f->live = false;
}

/* Read request r back through the page table, compare every byte with the
 * generator, run decode attention per layer against a plain reference. */
static bool decode_check(struct decode *d, const struct request *r)
{
    struct decode_group *dg = &d->g[r->id % N_GROUPS];
    const uint32_t T = r->n_tokens;
    int32_t indptr[2], last[1];
    struct kv_pages pages;
    if (!seq_pages(&dg->s, d->fl[r->id].seq, indptr, d->indices, MAX_TOKENS + 1, last, &pages))
        return false;
    struct kv_view kv_, vv;
    if (!kv_views(d->k, d->v, T, &kv_, &vv))
        return false;
    gen_kv(d->seed, r, 0, T, d->ek, d->ev); /* the expectation: not timed */
    if (d->fault && r->id == d->fault_req) {
        /* --fault: one bit of one transferred block flipped after the transfer */
        unsigned char *p = (unsigned char *)dg->s.pc.base;
        struct kv_byte_runs br;
        if (kv_layout_block_runs(dg->s.lo, (uint32_t)d->indices[0], &br) == KV_OK)
            p[br.first_offset_bytes + 2 * D_HEAD + 1] ^= 0x10;
        printf("  decode: --fault: flipped a bit of request %u's block %d\n", r->id, d->indices[0]);
    }
    uint64_t t0 = now_ns();
    if (!ok_call(kv_attn_read(dg->s.pc, KV_ATTN_ALL_LAYERS, &pages, &kv_, &vv, NULL),
                 "kv_attn_read"))
        return false;
    const size_t n = (size_t)L_LAYERS * T * H_KV * D_HEAD;
    size_t bad = n;
    int plane = 0;
    for (size_t i = 0; i < n && bad == n; i++) {
        if (d->k[i] != d->ek[i])
            bad = i;
        else if (d->v[i] != d->ev[i])
            bad = i, plane = 1;
    }
    stage_add(ST_VERIFY, (uint64_t)T * TOKEN_BYTES, t0);
    if (!check(bad == n,
               "request %u (%u tokens, decode %s): %s of layer %zu token %zu head %zu dim %zu "
               "is 0x%04x, the generator says 0x%04x",
               r->id, T, dg->s.desc, plane ? "V" : "K", bad / ((size_t)T * H_KV * D_HEAD),
               bad / (H_KV * D_HEAD) % T, bad / D_HEAD % H_KV, bad % D_HEAD,
               bad < n ? (plane ? d->v[bad] : d->k[bad]) : 0,
               bad < n ? (plane ? d->ev[bad] : d->ek[bad]) : 0))
        return true; /* counted; attention over wrong data says nothing more */

    /* one query per request and layer: q [1][Hq][D] f32, out [1][Hq][D] f32 */
    float q[H_Q * D_HEAD], out[H_Q * D_HEAD];
    static double score[MAX_TOKENS];
    const float scale = 1.0f / sqrtf((float)D_HEAD);
    const int64_t qshape[3] = {1, H_Q, D_HEAD};
    struct kv_view qv, ov;
    if (!ok_call(kv_view_init(q, sizeof(q), KV_F32, 3, qshape, &qv), "kv_view_init (q)") ||
        !ok_call(kv_view_init(out, sizeof(out), KV_F32, 3, qshape, &ov), "kv_view_init (out)"))
        return false;
    double max_err = 0;
    for (uint32_t l = 0; l < L_LAYERS; l++) {
        for (uint32_t h = 0; h < H_Q; h++)
            for (uint32_t e = 0; e < D_HEAD; e++)
                q[h * D_HEAD + e] = gen_value(d->seed, 0x10000 + r->id, l, 0, h, e, 2);
        t0 = now_ns();
        if (!ok_call(kv_attn_decode(dg->s.pc, l, &qv, &pages, scale, NULL, &ov), "kv_attn_decode"))
            return false;
        stage_add(ST_ATTN, (uint64_t)T * TOKEN_BYTES / L_LAYERS, t0);
        const uint16_t *K = d->ek + (size_t)l * T * H_KV * D_HEAD;
        const uint16_t *V = d->ev + (size_t)l * T * H_KV * D_HEAD;
        for (uint32_t h = 0; h < H_Q; h++) {
            const uint32_t kh = h / (H_Q / H_KV);
            double m = -INFINITY, sum = 0;
            for (uint32_t t = 0; t < T; t++) {
                double s = 0;
                const uint16_t *kr = K + ((size_t)t * H_KV + kh) * D_HEAD;
                for (uint32_t e = 0; e < D_HEAD; e++)
                    s += (double)q[h * D_HEAD + e] * kv_bf16_to_f32(kr[e]);
                score[t] = s * scale;
                if (score[t] > m)
                    m = score[t];
            }
            for (uint32_t t = 0; t < T; t++)
                sum += score[t] = exp(score[t] - m);
            for (uint32_t e = 0; e < D_HEAD; e++) {
                double acc = 0;
                for (uint32_t t = 0; t < T; t++)
                    acc += score[t] * kv_bf16_to_f32(V[((size_t)t * H_KV + kh) * D_HEAD + e]);
                const double ref = acc / sum, err = fabs(out[h * D_HEAD + e] - ref);
                if (err > max_err)
                    max_err = err;
                if (err > 1e-3 * (1 + fabs(ref))) {
                    check(false,
                          "request %u (decode %s): attention layer %u head %u dim %u = %.6f, "
                          "reference %.6f",
                          r->id, dg->s.desc, l, h, e, out[h * D_HEAD + e], ref);
                    return true;
                }
            }
        }
    }
    if (max_err > g_rep.attn_max_err)
        g_rep.attn_max_err = max_err;
    check(true, "attention");
    d->verified++;
    return true;
}

static void progress(uint32_t done, uint32_t total, uint64_t t_start)
{
    const double s = (double)(now_ns() - t_start) / 1e9;
    if (g_tty) {
        printf("\r  decode: %u/%u requests verified  %.1f s", done, total, s);
        if (done == total)
            printf("\n");
        fflush(stdout);
    } else if (done % 4 == 0 || done == total) {
        printf("  decode: %u/%u requests verified (%.1f s)\n", done, total, s);
        fflush(stdout);
    }
}

/* ---- the placement message ---------------------------------------------------------- */

#define PLACE_MAGIC UINT32_C(0x4c50564b) /* "KVPL" */
#define PLACE_VERSION 2u                 /* 2: the layout as kv_layout_config_encode's bytes */
#define PLACE_FIXED 36u

/* The demo's own fields, little-endian through <endian.h>; the layout goes
 * through the library's codec. */
static void le32_put(unsigned char *p, uint32_t v)
{
    v = htole32(v);
    memcpy(p, &v, 4);
}

static void le64_put(unsigned char *p, uint64_t v)
{
    v = htole64(v);
    memcpy(p, &v, 8);
}

static uint32_t le32_get(const unsigned char *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return le32toh(v);
}

static uint64_t le64_get(const unsigned char *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return le64toh(v);
}

/* The placement as bytes:
 *
 *    0  u32 magic "KVPL"          24  u32 n_blocks
 *    4  u32 version (2)           28  u32 blob bytes
 *    8  u32 request               32  u32 layout bytes (KV_LAYOUT_CONFIG_WIRE_BYTES)
 *   12  u32 group                 36  decode's layout config (kv_layout_config_encode:
 *   16  u64 n_tokens                  versioned, checksummed, its fingerprint inside)
 *   36 + layout bytes             u32[n_blocks] block ids, then the blob
 *
 * *len = 0 when it does not fit in cap; false when the library refuses the
 * config (named). */
static bool place_encode(const struct placement *pl, unsigned char *buf, size_t cap, size_t *len)
{
    *len = 0;
    unsigned char lc[KV_LAYOUT_CONFIG_WIRE_BYTES];
    size_t lc_len = 0;
    if (!ok_call(kv_layout_config_encode(&pl->lc, lc, sizeof(lc), &lc_len),
                 "kv_layout_config_encode"))
        return false;
    const size_t need = PLACE_FIXED + lc_len + 4u * (size_t)pl->n_blocks + pl->blob_len;
    if (need > cap)
        return true;
    le32_put(buf + 0, PLACE_MAGIC);
    le32_put(buf + 4, PLACE_VERSION);
    le32_put(buf + 8, pl->req);
    le32_put(buf + 12, pl->group);
    le64_put(buf + 16, pl->n_tokens);
    le32_put(buf + 24, pl->n_blocks);
    le32_put(buf + 28, pl->blob_len);
    le32_put(buf + 32, (uint32_t)lc_len);
    memcpy(buf + PLACE_FIXED, lc, lc_len);
    unsigned char *ids = buf + PLACE_FIXED + lc_len;
    for (uint32_t i = 0; i < pl->n_blocks; i++)
        le32_put(ids + 4 * (size_t)i, pl->blocks[i]);
    if (pl->blob_len)
        memcpy(ids + 4 * (size_t)pl->n_blocks, pl->blob, pl->blob_len);
    *len = need;
    return true;
}

/* Parse a placement (bad input: false with the reason; blocks and blob
 * point into buf). The layout config is checked by the library's decoder:
 * length, version, checksum, every field, kv_layout_init's validation and
 * the sender's fingerprint against the layout it builds here. */
static bool place_decode(const unsigned char *buf, size_t len, struct placement *pl,
                         uint32_t *blocks, char *why, size_t why_cap)
{
    if (len < PLACE_FIXED || le32_get(buf) != PLACE_MAGIC || le32_get(buf + 4) != PLACE_VERSION) {
        snprintf(why, why_cap, "not a version %u placement (%zu bytes)", PLACE_VERSION, len);
        return false;
    }
    memset(pl, 0, sizeof(*pl));
    pl->req = le32_get(buf + 8);
    pl->group = le32_get(buf + 12);
    pl->n_tokens = le64_get(buf + 16);
    pl->n_blocks = le32_get(buf + 24);
    pl->blob_len = le32_get(buf + 28);
    const uint32_t lc_len = le32_get(buf + 32);
    if (pl->n_blocks > KV_XPORT_NOTIFY_MAX / 4 || pl->blob_len > KV_XPORT_BLOB_MAX ||
        (uint64_t)PLACE_FIXED + lc_len + 4ull * pl->n_blocks + pl->blob_len != len) {
        snprintf(why, why_cap,
                 "placement of %zu bytes says a %u-byte layout, %u blocks and a %u-byte blob", len,
                 lc_len, pl->n_blocks, pl->blob_len);
        return false;
    }
    const kv_status st = kv_layout_config_decode(buf + PLACE_FIXED, lc_len, &pl->lc);
    if (st != KV_OK) {
        snprintf(why, why_cap, "its layout config: %s: %s", kv_status_name(st), kv_last_error());
        return false;
    }
    const unsigned char *ids = buf + PLACE_FIXED + lc_len;
    for (uint32_t i = 0; i < pl->n_blocks; i++)
        blocks[i] = le32_get(ids + 4 * (size_t)i);
    pl->blocks = blocks;
    pl->blob = pl->blob_len ? ids + 4 * (size_t)pl->n_blocks : NULL;
    return true;
}

/* Prefill's side of a placement: decode's layout rebuilt from the config
 * the message carried (kv_layout_config_decode has already matched its
 * fingerprint against the one decode recorded), the request agreeing with
 * prefill's own batch. *lo out. */
static bool place_accept(const struct placement *pl, const struct request *reqs, uint32_t n_req,
                         struct kv_layout *lo)
{
    if (!check(pl->req < n_req && pl->group < N_GROUPS && pl->n_tokens == reqs[pl->req].n_tokens,
               "placement for request %u (group %u, %" PRIu64 " tokens) does not match the batch",
               pl->req, pl->group, pl->n_tokens))
        return false;
    const kv_status st = kv_layout_init(&pl->lc, lo);
    if (!check(st == KV_OK, "request %u: decode's layout config is refused: %s: %s", pl->req,
               kv_status_name(st), kv_last_error()))
        return false;
    return check(pl->n_blocks == ceil_div(pl->n_tokens, (uint64_t)lo->block_tokens),
                 "request %u: %u blocks for %" PRIu64 " tokens of %" PRId64, pl->req, pl->n_blocks,
                 pl->n_tokens, lo->block_tokens);
}

/* ---- --local: both sides here, the transfer by kv_plan_copy ------------------------- */

static int run_local(uint64_t seed, bool fault, const struct request *reqs, uint32_t n_req)
{
    struct prefill *p = calloc(1, sizeof(*p));
    struct decode *d = calloc(1, sizeof(*d));
    kv_plan *plans[N_GROUPS] = {0};
    unsigned char *snap = malloc(PREFIX_BLOCKS * 256u << 10);
    bool ok = p && d && snap;
    if (!ok)
        fail_msg("out of memory");
    ok = ok && prefill_init(p, seed) && decode_init(d, seed);
    if (ok) {
        d->fault = fault;
        d->fault_req = n_req / 2;
    }
    const uint64_t t_start = now_ns();
    for (uint32_t i = 0; ok && i < n_req; i++) {
        const struct request *r = &reqs[i];
        struct placement dpl, pl;
        struct kv_layout lo;
        uint32_t seq = 0, blocks[KV_XPORT_NOTIFY_MAX / 4];
        unsigned char buf[KV_XPORT_NOTIFY_MAX];
        size_t len = 0;
        char why[160];
        ok = decode_place(d, r, &dpl);
        /* the placement goes through its message format here too */
        ok = ok && place_encode(&dpl, buf, sizeof(buf), &len);
        if (ok && (len == 0 || !place_decode(buf, len, &pl, blocks, why, sizeof(why))))
            ok = fail_msg("request %u: the placement does not survive its encoding", r->id);
        if (ok && !place_accept(&pl, reqs, n_req, &lo)) {
            decode_release(d, r->id);
            continue;
        }
        ok = ok && prefill_request(p, r, &seq);
        if (!ok)
            break;
        const bool first_prefix = r->prefix && !p->prefix_stored;
        if (first_prefix)
            ok = prefill_offload_store(p, seq, snap);
        const uint32_t g = pl.group;
        if (ok && !plans[g])
            ok = ok_call(kv_plan_create(p->s.lo, &lo, NULL, &plans[g]), "kv_plan_create");
        const uint32_t *src;
        uint32_t n_src = 0;
        ok = ok && ok_call(kv_page_table_seq_blocks(p->s.pt, seq, &src, &n_src), "seq_blocks");
        uint32_t old_prefix[PREFIX_BLOCKS];
        if (ok && first_prefix)
            memcpy(old_prefix, src, sizeof(old_prefix));
        const uint64_t t0 = now_ns();
        ok = ok && ok_call(kv_plan_copy(plans[g], p->s.pc, src, n_src, d->g[g].s.pc, pl.blocks,
                                        pl.n_blocks, r->n_tokens),
                           "kv_plan_copy");
        if (ok)
            xfer_add(g, r->n_tokens, t0);
        ok = ok && ok_call(kv_page_table_seq_free(p->s.pt, seq), "kv_page_table_seq_free");
        if (ok && first_prefix && p->prefix_stored)
            ok = prefill_offload_roundtrip(p, old_prefix, snap);
        const uint64_t before = g_rep.checks - g_rep.passed;
        ok = ok && decode_check(d, r);
        g_rep.requests++;
        g_rep.tokens += r->n_tokens;
        if (ok && g_rep.checks - g_rep.passed == before)
            g_rep.requests_ok++;
        decode_release(d, r->id);
        progress(i + 1, n_req, t_start);
    }
    for (uint32_t g = 0; ok && g < N_GROUPS; g++)
        decode_group_check(&d->g[g], g);
    for (uint32_t g = 0; g < N_GROUPS; g++)
        kv_plan_destroy(plans[g]);
    if (p)
        prefill_fini(p);
    if (d)
        decode_fini(d);
    free(p);
    free(d);
    free(snap);
    return ok ? 0 : EXIT_FAILED;
}

/* ---- the transport ------------------------------------------------------------------- */

struct opts {
    uint32_t requests;
    uint64_t seed;
    kv_xport_kind kind;
    bool local, fault;
    int port;
    int port_fd, report_fd;
};

static const char *xstate_name(kv_xport_state st)
{
    switch (st) {
    case KV_XPORT_PENDING:
        return "PENDING";
    case KV_XPORT_DONE:
        return "DONE";
    case KV_XPORT_FAILED:
        return "FAILED";
    case KV_XPORT_TIMED_OUT:
        return "TIMED_OUT";
    case KV_XPORT_CANCELLED:
        return "CANCELLED";
    }
    return "unknown";
}

/* The next notification, waiting at most WAIT_MS, in short slices so that
 * a peer that went away ends the wait at once. */
static kv_status poll_msg(kv_xport *x, kv_xport_peer *peer, struct kv_xport_msg *msg)
{
    for (uint32_t waited = 0;; waited += 200) {
        const kv_status st = kv_xport_notify_poll(x, 200, msg);
        if (st != KV_ERR_TIMEOUT)
            return st;
        kv_xport_peer_state ps = KV_XPORT_READY;
        kv_status why = KV_OK;
        if (kv_xport_peer_state_get(peer, &ps, &why) == KV_OK && ps == KV_XPORT_CLOSED) {
            fail_msg("the peer closed the connection (%s)", kv_status_name(why));
            return KV_ERR_IO;
        }
        if (waited >= WAIT_MS) {
            fail_msg("no notification from the peer within %d ms", WAIT_MS);
            return KV_ERR_TIMEOUT;
        }
    }
}

/* Post a notification with no data (a placement, a failure, the end). */
static bool send_msg(kv_xport_peer *peer, uint64_t tag, const void *msg, uint32_t len)
{
    const struct kv_xport_notify nt = {tag, msg, len};
    kv_xport_xfer *x = NULL;
    if (!ok_call(kv_xport_write(peer, NULL, 0, &nt, &x), "kv_xport_write (notification)"))
        return false;
    kv_xport_state st = KV_XPORT_PENDING;
    bool ok = ok_call(kv_xport_xfer_wait(x, WAIT_MS, &st), "kv_xport_xfer_wait (notification)");
    if (ok && st != KV_XPORT_DONE)
        ok = fail_msg("a notification (tag %" PRIu64 ") ended %s", tag, xstate_name(st));
    if (kv_xport_xfer_free(x) != KV_OK)
        ok = fail_msg("kv_xport_xfer_free refused a terminal transfer");
    return ok;
}

static bool xport_new(const struct opts *o, bool listen, kv_xport **x)
{
    struct kv_xport_config cfg = KV_XPORT_CONFIG_INIT;
    cfg.kind = o->kind;
    cfg.listen_host = listen ? "127.0.0.1" : NULL;
    cfg.listen_port = listen ? (uint16_t)o->port : 0;
    cfg.token = XPORT_TOKEN;
    cfg.timeout_ms = WAIT_MS;
    const kv_status st = kv_xport_create(&cfg, x);
    if (st == KV_ERR_UNSUPPORTED)
        return fail_msg("the %s transport is not available here: %s", kv_xport_kind_name(o->kind),
                        kv_last_error());
    return ok_call(st, "kv_xport_create");
}

/* Register a cache's arena (one region). */
static bool xport_reg(kv_xport *x, const struct side *s, kv_xport_mem **mem)
{
    struct kv_mem_region rg[4];
    size_t n = 0;
    if (!ok_call(kv_cache_regions(s->c, rg, 4, &n), "kv_cache_regions"))
        return false;
    if (n != 1 || rg[0].ptr != s->pc.base)
        return fail_msg("the cache arena is %zu regions, not one at its base", n);
    return ok_call(kv_xport_mem_reg(x, rg[0].ptr, rg[0].bytes, rg[0].kind, mem),
                   "kv_xport_mem_reg");
}

static int run_decode(const struct opts *o, const struct request *reqs)
{
    g_role = "decode";
    struct decode *d = calloc(1, sizeof(*d));
    kv_xport *x = NULL;
    kv_xport_peer *peer = NULL;
    kv_xport_mem *mem[N_GROUPS] = {0};
    bool exposed[N_GROUPS] = {0};
    unsigned char blob[N_GROUPS][KV_XPORT_BLOB_MAX];
    size_t blob_len[N_GROUPS] = {0};
    struct kv_xport_msg *msg = malloc(sizeof(*msg));
    bool ok = d && msg;
    if (!ok)
        fail_msg("out of memory");
    ok = ok && decode_init(d, o->seed) && xport_new(o, true, &x);
    if (ok) {
        d->fault = o->fault;
        d->fault_req = o->requests / 2;
    }
    if (o->port_fd >= 0) {
        char line[32];
        const int n = snprintf(line, sizeof(line), "%u\n", ok ? kv_xport_port(x) : 0u);
        if (write(o->port_fd, line, (size_t)n) != n)
            ok = fail_msg("cannot tell the parent the port: %s", strerror(errno));
        close(o->port_fd);
    } else if (ok) {
        printf("decode: listening on 127.0.0.1:%u\n", kv_xport_port(x));
        fflush(stdout);
    }
    for (uint32_t g = 0; ok && g < N_GROUPS; g++)
        ok = xport_reg(x, &d->g[g].s, &mem[g]);
    ok = ok && ok_call(kv_xport_accept(x, WAIT_MS, &peer), "kv_xport_accept");
    uint32_t next = 0, inflight = 0, done = 0;
    const uint64_t t_start = now_ns();
    while (ok && done < o->requests) {
        while (ok && inflight < WINDOW && next < o->requests) {
            const struct request *r = &reqs[next++];
            struct placement pl;
            if (!(ok = decode_place(d, r, &pl)))
                break;
            const uint32_t g = pl.group;
            if (!exposed[g]) {
                ok = ok_call(
                    kv_xport_mem_expose(peer, mem[g], blob[g], sizeof(blob[g]), &blob_len[g]),
                    "kv_xport_mem_expose");
                exposed[g] = ok;
                pl.blob = blob[g];
                pl.blob_len = (uint32_t)blob_len[g];
            }
            unsigned char buf[KV_XPORT_NOTIFY_MAX];
            size_t len = 0;
            ok = ok && place_encode(&pl, buf, sizeof(buf), &len);
            if (ok && len == 0)
                ok = fail_msg("request %u: the placement does not fit in a notification", r->id);
            ok = ok && send_msg(peer, TAG_PLACE, buf, (uint32_t)len);
            inflight++;
        }
        if (!ok)
            break;
        const kv_status st = poll_msg(x, peer, msg);
        if (st == KV_ERR_TIMEOUT || st == KV_ERR_IO) {
            ok = fail_msg("waiting for prefill with %u requests in flight", inflight);
            break;
        }
        if (!(ok = ok_call(st, "kv_xport_notify_poll")))
            break;
        uint32_t req = msg->len >= 4 ? le32_get(msg->data) : UINT32_MAX;
        if ((msg->tag != TAG_DONE && msg->tag != TAG_FAILED) || msg->len != 4 ||
            req >= o->requests || !d->fl[req].live) {
            ok = fail_msg("unexpected notification: tag %" PRIu64 ", %u bytes", msg->tag, msg->len);
            break;
        }
        g_rep.requests++;
        g_rep.tokens += reqs[req].n_tokens;
        g_rep.xfer_bytes += (uint64_t)reqs[req].n_tokens * TOKEN_BYTES;
        if (check(msg->tag == TAG_DONE, "request %u: prefill says its transfer did not end DONE",
                  req)) {
            const uint64_t before = g_rep.checks - g_rep.passed;
            ok = decode_check(d, &reqs[req]);
            if (ok && g_rep.checks - g_rep.passed == before)
                g_rep.requests_ok++;
        }
        decode_release(d, req);
        inflight--;
        progress(++done, o->requests, t_start);
    }
    if (peer && ok)
        ok = send_msg(peer, TAG_END, NULL, 0);
    for (uint32_t g = 0; ok && g < N_GROUPS; g++)
        decode_group_check(&d->g[g], g);
    for (uint32_t i = 0; d && i < o->requests; i++)
        decode_release(d, i);
    /* Closing the peer ends its exposures (prefill may have closed first:
     * then they are gone already); then the regions deregister. */
    if (peer)
        kv_xport_peer_close(peer);
    peer = NULL;
    for (uint32_t g = 0; g < N_GROUPS; g++)
        if (mem[g] && kv_xport_mem_dereg(mem[g]) != KV_OK)
            ok = fail_msg("kv_xport_mem_dereg: %s", kv_last_error());
    if (kv_xport_destroy(x) != KV_OK)
        ok = fail_msg("kv_xport_destroy: %s", kv_last_error());
    if (d)
        decode_fini(d);
    free(d);
    free(msg);
    return ok ? 0 : EXIT_FAILED;
}

/* Connect and wait for the handshake. */
static bool prefill_connect(kv_xport *x, uint16_t port, kv_xport_peer **peer)
{
    if (!ok_call(kv_xport_connect(x, "127.0.0.1", port, peer), "kv_xport_connect"))
        return false;
    const uint64_t t0 = now_ns();
    for (;;) {
        kv_xport_peer_state ps = KV_XPORT_CONNECTING;
        kv_status why = KV_OK;
        if (!ok_call(kv_xport_peer_state_get(*peer, &ps, &why), "kv_xport_peer_state_get"))
            return false;
        if (ps == KV_XPORT_READY)
            return true;
        if (ps == KV_XPORT_CLOSED)
            return fail_msg("the connection to decode closed: %s: %s", kv_status_name(why),
                            kv_last_error());
        if (now_ns() - t0 > (uint64_t)WAIT_MS * 1000000u)
            return fail_msg("no handshake with decode within %d ms", WAIT_MS);
        usleep(1000);
    }
}

/* One placement: write the request, post the plan's runs into decode's
 * blocks with the completion notification, wait, free. */
static bool prefill_serve(struct prefill *p, const struct opts *o, const struct request *reqs,
                          kv_xport_peer *peer, kv_xport_mem *mem, kv_xport_rmem **rmem,
                          kv_plan **plans, const struct kv_xport_msg *msg, unsigned char *snap)
{
    struct placement pl;
    uint32_t blocks[KV_XPORT_NOTIFY_MAX / 4];
    char why[160];
    if (!place_decode(msg->data, msg->len, &pl, blocks, why, sizeof(why)))
        return fail_msg("bad placement from decode: %s", why);
    struct kv_layout lo;
    unsigned char req_le[4];
    le32_put(req_le, pl.req);
    if (!place_accept(&pl, reqs, o->requests, &lo))
        return pl.req < o->requests ? send_msg(peer, TAG_FAILED, req_le, 4) : false;
    const uint32_t g = pl.group;
    if (pl.blob_len && !rmem[g] &&
        !ok_call(kv_xport_rmem_import(peer, pl.blob, pl.blob_len, &rmem[g]),
                 "kv_xport_rmem_import"))
        return false;
    if (!rmem[g])
        return fail_msg("request %u: no exposure of group %u's arena yet", pl.req, g);
    if (!plans[g] && !ok_call(kv_plan_create(p->s.lo, &lo, NULL, &plans[g]), "kv_plan_create"))
        return false;
    const struct request *r = &reqs[pl.req];
    uint32_t seq = 0;
    if (!prefill_request(p, r, &seq))
        return false;
    const bool first_prefix = r->prefix && !p->prefix_stored;
    if (first_prefix && !prefill_offload_store(p, seq, snap))
        return false;
    const uint32_t *src;
    uint32_t n_src = 0;
    if (!ok_call(kv_page_table_seq_blocks(p->s.pt, seq, &src, &n_src), "seq_blocks"))
        return false;
    uint32_t old_prefix[PREFIX_BLOCKS];
    if (first_prefix)
        memcpy(old_prefix, src, sizeof(old_prefix));
    const struct kv_xport_notify nt = {TAG_DONE, req_le, 4};
    kv_xport_xfer *x = NULL;
    kv_xport_state st = KV_XPORT_FAILED;
    const uint64_t t0 = now_ns();
    const kv_status pst = kv_xport_write_plan(peer, plans[g], mem, 0, src, n_src, rmem[g], 0,
                                              pl.blocks, pl.n_blocks, r->n_tokens, &nt, &x);
    bool ok = true;
    if (pst == KV_OK) {
        kv_status wst = kv_xport_xfer_wait(x, WAIT_MS, &st);
        if (wst == KV_ERR_TIMEOUT && kv_xport_xfer_cancel(x) == KV_OK)
            wst = kv_xport_xfer_wait(x, WAIT_MS, &st);
        if (wst != KV_OK) /* not terminal: its memory (our blocks) is not ours to free */
            return ok_call(wst, "kv_xport_xfer_wait (after a cancel)");
        xfer_add(g, r->n_tokens, t0);
        if (kv_xport_xfer_free(x) != KV_OK)
            ok = fail_msg("kv_xport_xfer_free refused a terminal transfer");
    }
    g_rep.requests++;
    g_rep.tokens += r->n_tokens;
    if (pst != KV_OK)
        check(false, "request %u: kv_xport_write_plan refused: %s: %s", r->id, kv_status_name(pst),
              kv_last_error());
    else if (check(st == KV_XPORT_DONE, "request %u: the transfer ended %s", r->id,
                   xstate_name(st)))
        g_rep.requests_ok++;
    if (!ok_call(kv_page_table_seq_free(p->s.pt, seq), "kv_page_table_seq_free"))
        return false;
    if (ok && st != KV_XPORT_DONE)
        ok = send_msg(peer, TAG_FAILED, req_le, 4);
    if (ok && first_prefix && p->prefix_stored)
        ok = prefill_offload_roundtrip(p, old_prefix, snap);
    return ok;
}

static int run_prefill(const struct opts *o, const struct request *reqs)
{
    g_role = "prefill";
    struct prefill *p = calloc(1, sizeof(*p));
    kv_xport *x = NULL;
    kv_xport_peer *peer = NULL;
    kv_xport_mem *mem = NULL;
    kv_xport_rmem *rmem[N_GROUPS] = {0};
    kv_plan *plans[N_GROUPS] = {0};
    struct kv_xport_msg *msg = malloc(sizeof(*msg));
    unsigned char *snap = malloc(PREFIX_BLOCKS * 256u << 10);
    bool ok = p && msg && snap;
    if (!ok)
        fail_msg("out of memory");
    ok = ok && prefill_init(p, o->seed) && xport_new(o, false, &x) && xport_reg(x, &p->s, &mem) &&
         prefill_connect(x, (uint16_t)o->port, &peer);
    while (ok) {
        const kv_status st = poll_msg(x, peer, msg);
        if (st == KV_ERR_TIMEOUT || st == KV_ERR_IO) {
            ok = fail_msg("waiting for a placement from decode");
            break;
        }
        if (!(ok = ok_call(st, "kv_xport_notify_poll")))
            break;
        if (msg->tag == TAG_END)
            break;
        if (msg->tag != TAG_PLACE) {
            ok = fail_msg("unexpected notification: tag %" PRIu64, msg->tag);
            break;
        }
        ok = prefill_serve(p, o, reqs, peer, mem, rmem, plans, msg, snap);
    }
    for (uint32_t g = 0; g < N_GROUPS; g++) {
        if (kv_xport_rmem_free(rmem[g]) != KV_OK)
            ok = fail_msg("kv_xport_rmem_free: %s", kv_last_error());
        kv_plan_destroy(plans[g]);
    }
    if (peer)
        kv_xport_peer_close(peer);
    if (mem && kv_xport_mem_dereg(mem) != KV_OK)
        ok = fail_msg("kv_xport_mem_dereg: %s", kv_last_error());
    if (kv_xport_destroy(x) != KV_OK)
        ok = fail_msg("kv_xport_destroy: %s", kv_last_error());
    if (p)
        prefill_fini(p);
    free(p);
    free(msg);
    free(snap);
    return ok ? 0 : EXIT_FAILED;
}

/* Check up front that the transport can be created at all (RDMA without a
 * device fails here, cleanly, before any process starts). */
static bool xport_probe(const struct opts *o)
{
    kv_xport *x = NULL;
    if (!xport_new(o, false, &x))
        return false;
    return ok_call(kv_xport_destroy(x), "kv_xport_destroy");
}

/* ---- reports and the table ------------------------------------------------------------- */

static void report_write(int fd, const struct report *r)
{
    FILE *f = fdopen(fd, "w");
    if (!f)
        return;
    for (int s = 0; s < ST_COUNT; s++)
        fprintf(f, "stage %d %" PRIu64 " %" PRIu64 " %" PRIu64 "\n", s, r->bytes[s], r->ns[s],
                r->calls[s]);
    fprintf(f, "checks %" PRIu64 " %" PRIu64 "\n", r->checks, r->passed);
    fprintf(f, "requests %" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64 "\n", r->requests,
            r->requests_ok, r->tokens, r->xfer_bytes);
    fprintf(f, "attn %.9g\n", r->attn_max_err);
    fprintf(f, "ids %u %u\n", r->id_min, r->id_max);
    for (int g = 0; g < N_GROUPS; g++)
        fprintf(f, "xgroup %d %" PRIu64 " %" PRIu64 "\n", g, r->xg_bytes[g], r->xg_ns[g]);
    if (r->first_fail[0])
        fprintf(f, "fail %s\n", r->first_fail);
    fclose(f);
}

/* Merge a child's report into *r; false when it was cut short. */
static bool report_read(int fd, struct report *r, bool take_requests)
{
    FILE *f = fdopen(fd, "r");
    if (!f)
        return false;
    char line[600];
    bool seen = false;
    while (fgets(line, sizeof(line), f)) {
        int s;
        uint64_t a, b, c, e;
        double x;
        if (sscanf(line, "stage %d %" SCNu64 " %" SCNu64 " %" SCNu64, &s, &a, &b, &c) == 4 &&
            s >= 0 && s < ST_COUNT) {
            r->bytes[s] += a;
            r->ns[s] += b;
            r->calls[s] += c;
        } else if (sscanf(line, "checks %" SCNu64 " %" SCNu64, &a, &b) == 2) {
            r->checks += a;
            r->passed += b;
            seen = true;
        } else if (sscanf(line, "requests %" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64, &a, &b, &c,
                          &e) == 4) {
            if (take_requests) { /* decode's: a request is ok once it is verified there */
                r->requests = a;
                r->requests_ok = b;
                r->tokens = c;
                r->xfer_bytes = e;
            }
        } else if (sscanf(line, "xgroup %d %" SCNu64 " %" SCNu64, &s, &a, &b) == 3 && s >= 0 &&
                   s < N_GROUPS) {
            r->xg_bytes[s] += a;
            r->xg_ns[s] += b;
        } else if (sscanf(line, "ids %" SCNu64 " %" SCNu64, &a, &b) == 2) {
            if (a && (!r->id_min || a < r->id_min))
                r->id_min = (uint32_t)a;
            if (b > r->id_max)
                r->id_max = (uint32_t)b;
        } else if (sscanf(line, "attn %lf", &x) == 1) {
            if (x > r->attn_max_err)
                r->attn_max_err = x;
        } else if (!strncmp(line, "fail ", 5) && !r->first_fail[0]) {
            line[strcspn(line, "\n")] = 0;
            const size_t n = strlen(line + 5);
            const size_t m = n < sizeof(r->first_fail) - 1 ? n : sizeof(r->first_fail) - 1;
            memcpy(r->first_fail, line + 5, m);
            r->first_fail[m] = 0;
        }
    }
    fclose(f);
    return seen;
}

static void print_table(const struct report *r, const char *how, double wall_s)
{
    printf("\nkvdemo: %s; model L=%d H=%d (query %d) D=%d %s; prefill N=%d NHD layer-major; "
           "decode groups: ",
           how, L_LAYERS, H_KV, H_Q, D_HEAD, kv_dtype_name(DTYPE), PF_N);
    for (uint32_t g = 0; g < N_GROUPS; g++) {
        struct kv_layout_config lc;
        group_layout(g, &lc);
        printf("%sN=%" PRId64 " %s %s%s", g ? ", " : "", lc.block_tokens, kv_order_name(lc.order),
               kv_arrange_name(lc.arrange),
               lc.block_pad_elems || lc.block_stride_bytes ? " padded" : "");
    }
    printf("\n\n");
    printf("  requests        %" PRIu64 " (%" PRIu64 " ok)\n", r->requests, r->requests_ok);
    printf("  tokens          %" PRIu64 "\n", r->tokens);
    printf("  bytes moved     %.1f MiB (prefill -> decode)\n", (double)r->xfer_bytes / 1048576.0);
    printf("  decode block ids %u .. %u (pools of %" PRId64 "..%" PRId64 " blocks, churned)\n",
           r->id_min, r->id_max, (int64_t)3 * MAX_TOKENS / 64 + 1, (int64_t)3 * MAX_TOKENS / 8 + 1);
    printf("  wall time       %.2f s\n\n", wall_s);
    printf("  %-24s %10s %8s %10s %9s\n", "stage", "MiB", "calls", "ms", "GB/s");
    for (int s = 0; s < ST_COUNT; s++) {
        const double ms = (double)r->ns[s] / 1e6;
        printf("  %-24s %10.1f %8" PRIu64 " %10.1f %9.2f\n", stage_name[s],
               (double)r->bytes[s] / 1048576.0, r->calls[s], ms,
               r->ns[s] ? (double)r->bytes[s] / (double)r->ns[s] : 0.0);
        for (uint32_t g = 0; s == ST_XFER && g < N_GROUPS; g++) {
            struct kv_layout_config lc;
            group_layout(g, &lc);
            char name[64];
            snprintf(name, sizeof(name), "  to N=%" PRId64 " %s %s%s", lc.block_tokens,
                     kv_order_name(lc.order), lc.arrange ? "blk" : "lyr",
                     lc.block_pad_elems || lc.block_stride_bytes ? " pad" : "");
            printf("  %-24s %10.1f %8s %10.1f %9.2f\n", name, (double)r->xg_bytes[g] / 1048576.0,
                   "", (double)r->xg_ns[g] / 1e6,
                   r->xg_ns[g] ? (double)r->xg_bytes[g] / (double)r->xg_ns[g] : 0.0);
        }
    }
    printf("\n  attention max |err| vs reference  %.3g (tolerance 1e-3 x (1 + |ref|))\n",
           r->attn_max_err);
    printf("  checks passed   %" PRIu64 " / %" PRIu64 "\n", r->passed, r->checks);
    if (r->first_fail[0])
        printf("  FAILED: %s\n", r->first_fail);
}

/* ---- options and main ---------------------------------------------------------------- */

static void usage(FILE *f)
{
    fprintf(f,
            "usage: kvdemo [--requests N] [--seed S] [--transport tcp|rdma] [--local]\n"
            "       kvdemo decode --port P [--port-fd FD] [--report-fd FD] [options]\n"
            "       kvdemo prefill --port P [--report-fd FD] [options]\n"
            "\n"
            "A disaggregated prefill -> decode run on loopback: %d-layer model, %d KV heads,\n"
            "head dim %d, bf16; requests of 1..%d tokens, every third sharing a prefix.\n"
            "  --requests N     requests in the batch (1..%d; default 24)\n"
            "  --seed S         the batch and the generated K/V (default 1)\n"
            "  --transport K    tcp (default) or rdma (needs an RDMA device)\n"
            "  --local          one process: the transfer as kv_plan_copy (no transport)\n"
            "  --fault          flip one bit of one request in decode after its transfer\n"
            "                   (the run must then fail, naming that check)\n"
            "  --port P         decode: listen on 127.0.0.1:P (0: any); prefill: connect to it\n"
            "Both roles must get the same --requests and --seed.\n"
            "Exit status: 0 every check passed; 1 a check failed or a call was refused;\n"
            "2 usage error.\n",
            L_LAYERS, H_KV, D_HEAD, MAX_TOKENS, MAX_REQUESTS);
}

static bool parse_u64(const char *s, uint64_t lo, uint64_t hi, uint64_t *out)
{
    if (!s || !*s || *s == '-' || *s == '+')
        return false;
    errno = 0;
    char *end = NULL;
    const unsigned long long v = strtoull(s, &end, 0);
    if (errno || *end || v < lo || v > hi)
        return false;
    *out = v;
    return true;
}

static int parse_opts(int argc, char **argv, int first, struct opts *o)
{
    for (int i = first; i < argc; i++) {
        const char *a = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
        uint64_t v = 0;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            exit(0);
        } else if (!strcmp(a, "--local")) {
            o->local = true;
            continue;
        } else if (!strcmp(a, "--fault")) {
            o->fault = true;
            continue;
        } else if (!strcmp(a, "--requests")) {
            if (!parse_u64(val, 1, MAX_REQUESTS, &v))
                goto bad;
            o->requests = (uint32_t)v;
        } else if (!strcmp(a, "--seed")) {
            if (!parse_u64(val, 0, UINT64_MAX, &v))
                goto bad;
            o->seed = v;
        } else if (!strcmp(a, "--transport")) {
            if (val && !strcmp(val, "tcp"))
                o->kind = KV_XPORT_TCP;
            else if (val && !strcmp(val, "rdma"))
                o->kind = KV_XPORT_RDMA;
            else
                goto bad;
        } else if (!strcmp(a, "--port")) {
            if (!parse_u64(val, 0, 65535, &v))
                goto bad;
            o->port = (int)v;
        } else if (!strcmp(a, "--port-fd") || !strcmp(a, "--report-fd")) {
            if (!parse_u64(val, 3, INT_MAX, &v) || fcntl((int)v, F_GETFD) < 0)
                goto bad;
            *(a[2] == 'p' && a[3] == 'o' ? &o->port_fd : &o->report_fd) = (int)v;
        } else {
            fprintf(stderr, "kvdemo: unknown option '%s' (kvdemo --help)\n", a);
            return EXIT_USAGE;
        }
        i++;
        continue;
    bad:
        fprintf(stderr, "kvdemo: %s needs %s, got '%s' (kvdemo --help)\n", a,
                !strcmp(a, "--transport")  ? "tcp or rdma"
                : !strcmp(a, "--requests") ? "1..256"
                : !strcmp(a, "--port")     ? "a port 0..65535"
                : !strcmp(a, "--seed")     ? "an unsigned integer"
                                           : "an open file descriptor",
                val ? val : "(nothing)");
        return EXIT_USAGE;
    }
    return 0;
}

/* Start `kvdemo ROLE --port P ...` with the report on a pipe; *rd its
 * read end. */
static pid_t spawn(const char *self, const char *role, const struct opts *o, int port, int extra_fd,
                   int *rd)
{
    int pr[2];
    if (pipe(pr) != 0)
        return -1;
    fflush(NULL);
    const pid_t pid = fork();
    if (pid < 0) {
        close(pr[0]);
        close(pr[1]);
        return -1;
    }
    if (pid == 0) {
        close(pr[0]);
        char req[16], seed[24], portb[8], rfd[12], pfd[12];
        snprintf(req, sizeof(req), "%u", o->requests);
        snprintf(seed, sizeof(seed), "%" PRIu64, o->seed);
        snprintf(portb, sizeof(portb), "%d", port);
        snprintf(rfd, sizeof(rfd), "%d", pr[1]);
        snprintf(pfd, sizeof(pfd), "%d", extra_fd);
        char *args[16];
        int n = 0;
        args[n++] = (char *)self;
        args[n++] = (char *)role;
        args[n++] = "--port";
        args[n++] = portb;
        args[n++] = "--requests";
        args[n++] = req;
        args[n++] = "--seed";
        args[n++] = seed;
        args[n++] = "--transport";
        args[n++] = (char *)kv_xport_kind_name(o->kind);
        args[n++] = "--report-fd";
        args[n++] = rfd;
        if (extra_fd >= 0) {
            args[n++] = "--port-fd";
            args[n++] = pfd;
        }
        if (o->fault)
            args[n++] = "--fault";
        args[n] = NULL;
        execv("/proc/self/exe", args);
        fprintf(stderr, "kvdemo: exec of %s %s failed: %s\n", self, role, strerror(errno));
        _exit(127);
    }
    close(pr[1]);
    *rd = pr[0];
    return pid;
}

static int wait_child(pid_t pid, const char *role)
{
    int ws = 0;
    while (waitpid(pid, &ws, 0) < 0 && errno == EINTR)
        ;
    if (WIFEXITED(ws))
        return WEXITSTATUS(ws);
    fprintf(stderr, "kvdemo: the %s process died (signal %d)\n", role,
            WIFSIGNALED(ws) ? WTERMSIG(ws) : 0);
    return EXIT_FAILED;
}

static int run_parent(const char *self, const struct opts *o)
{
    if (!xport_probe(o)) {
        fprintf(stderr,
                "kvdemo: cannot run over %s (see above); `kvdemo --local` runs the same "
                "plans in one process\n",
                kv_xport_kind_name(o->kind));
        return EXIT_FAILED;
    }
    int pp[2];
    if (pipe(pp) != 0) {
        perror("kvdemo: pipe");
        return EXIT_FAILED;
    }
    int drd = -1, prd = -1;
    const pid_t dpid = spawn(self, "decode", o, 0, pp[1], &drd);
    close(pp[1]);
    if (dpid < 0) {
        perror("kvdemo: starting decode");
        close(pp[0]);
        return EXIT_FAILED;
    }
    char line[32] = {0};
    ssize_t got = 0, n;
    while (got < (ssize_t)sizeof(line) - 1 &&
           (n = read(pp[0], line + got, sizeof(line) - 1 - (size_t)got)) > 0)
        got += n;
    close(pp[0]);
    uint64_t port = 0;
    line[strcspn(line, "\n")] = 0;
    pid_t ppid = -1;
    if (parse_u64(line, 1, 65535, &port)) {
        printf("kvdemo: decode listens on 127.0.0.1:%" PRIu64 ", starting prefill\n", port);
        ppid = spawn(self, "prefill", o, (int)port, -1, &prd);
        if (ppid < 0)
            perror("kvdemo: starting prefill");
    } else {
        fprintf(stderr, "kvdemo: decode did not report a port\n");
    }
    const uint64_t t0 = now_ns();
    struct report rep;
    memset(&rep, 0, sizeof(rep));
    const bool dseen = report_read(drd, &rep, true);
    const bool pseen = prd >= 0 && report_read(prd, &rep, false);
    int rc = wait_child(dpid, "decode");
    if (ppid >= 0 && wait_child(ppid, "prefill") != 0 && rc == 0)
        rc = EXIT_FAILED;
    print_table(&rep, "prefill and decode processes over tcp loopback",
                (double)(now_ns() - t0) / 1e9);
    if (!dseen || !pseen) {
        printf("  FAILED: the %s process ended without its report\n",
               !dseen ? "decode" : "prefill");
        return EXIT_FAILED;
    }
    if (rc == 0 && (rep.passed != rep.checks || rep.requests_ok != rep.requests))
        rc = EXIT_FAILED;
    return rc;
}

int main(int argc, char **argv)
{
    g_tty = isatty(STDOUT_FILENO);
    struct opts o = {24, 1, KV_XPORT_TCP, false, false, -1, -1, -1};
    const char *role = argc > 1 && argv[1][0] != '-' ? argv[1] : NULL;
    if (role && strcmp(role, "decode") && strcmp(role, "prefill")) {
        fprintf(stderr, "kvdemo: unknown role '%s': decode or prefill (kvdemo --help)\n", role);
        return EXIT_USAGE;
    }
    const int prc = parse_opts(argc, argv, role ? 2 : 1, &o);
    if (prc)
        return prc;
    if (role && (o.port < 0 || o.local)) {
        fprintf(stderr, "kvdemo %s: needs --port (and no --local)\n", role);
        return EXIT_USAGE;
    }
    if (!role && (o.port >= 0 || o.port_fd >= 0 || o.report_fd >= 0)) {
        fprintf(stderr, "kvdemo: --port, --port-fd and --report-fd are for the roles\n");
        return EXIT_USAGE;
    }
    if (!strcmp(role ? role : "", "prefill") && o.port == 0) {
        fprintf(stderr, "kvdemo prefill: --port must be decode's port (1..65535)\n");
        return EXIT_USAGE;
    }
    if (o.report_fd >= 0)
        g_tty = false;
    if (o.local && o.kind != KV_XPORT_TCP) {
        fprintf(stderr, "kvdemo: --local uses no transport; drop --transport\n");
        return EXIT_USAGE;
    }
    struct request reqs[MAX_REQUESTS];
    make_requests(o.seed, o.requests, reqs);
    if (!role && !o.local)
        return run_parent(argv[0], &o);
    int rc;
    const uint64_t t0 = now_ns();
    if (o.local) {
        printf("kvdemo: %u requests, seed %" PRIu64 ", one process (kv_plan_copy)\n", o.requests,
               o.seed);
        rc = run_local(o.seed, o.fault, reqs, o.requests);
    } else {
        /* two processes share the machine: each kernel gets half the cores */
        const long cores = sysconf(_SC_NPROCESSORS_ONLN);
        if (!ok_call(kv_set_threads(cores > 1 ? (int)(cores / 2) : 1), "kv_set_threads"))
            return EXIT_FAILED;
        rc = !strcmp(role, "decode") ? run_decode(&o, reqs) : run_prefill(&o, reqs);
    }
    if (o.report_fd >= 0) {
        report_write(o.report_fd, &g_rep);
    } else {
        print_table(&g_rep, o.local ? "one process, transfers by kv_plan_copy" : role,
                    (double)(now_ns() - t0) / 1e9);
        if (rc == 0 && (g_rep.passed != g_rep.checks || g_rep.requests_ok != g_rep.requests))
            rc = EXIT_FAILED;
    }
    return rc;
}
