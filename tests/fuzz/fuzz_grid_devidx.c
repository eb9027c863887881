/*
 * fuzz_grid_devidx.c - libFuzzer target for the index arrays an engine hands
 * the device-index CUDA entries in device memory (kv_attn_*_cuda_dev,
 * kv_plan_copy_cuda_dev), run as their kernel bodies over the CPU grid
 * emulator (kv__grid_attn_*_dev, kv__grid_plan_copy_dev; host memory stands
 * for device memory, as tests/unit/test_grid_devidx.c runs them): the
 * bodies bounds-check every index themselves, skip an invalid one and count
 * it in the error record, naming the first (lowest array, then index).
 *
 * Input: byte 0 the body ((b & 7) % 6: write (int64 slot mapping), read
 * (pages + out_indptr), decode (pages), copy blocks, copy_ex, plan copy with
 * device block lists); byte 1 one of 8 cache shapes (NHD / HND, layer- /
 * block-major, padded, K|V packed, 2 to 8 tokens a block); byte 2 the cache
 * dtype (f32 / f16) and, for the decode, the body (general, auto, pipelined
 * vector, split-KV in chunks); the rest decodes into the arrays. A byte
 * below 0xE0 is a valid choice; from 0xE0 a hostile value: a slot below
 * -1, at B x N, INT64_MIN / MAX; page ids negative, at B, INT32_MIN / MAX;
 * indptr negative, past n_pages, decreasing; last_page_len 0, past N,
 * negative; seq_lens negative or past cols x N; out_indptr out of [0, T],
 * decreasing or not the tokens apart; block ids at B, past B, UINT32_MAX.
 *
 * After each launch, from the same arrays by the rules of kv_attn.h /
 * kv_plan.h (computed here, not by the library):
 *   record:  count = the invalid items the body skips (a slot, a sequence
 *            (its first bad field), a page entry a valid sequence uses (a
 *            decode: within its window), a copy pair (its src, else its
 *            dst), a plan list entry); first = the lowest (array, index);
 *            its value = the array's value there;
 *   write / read / copy / copy_ex / plan: the WHOLE destination (cache or
 *            k_out / v_out buffers) equals a reference scatter from the
 *            layout config (bytes moved exactly), untouched bytes
 *            identical; the source unchanged;
 *   decode:  every output row of a valid sequence within 1e-5 (relative,
 *            floor 0.1) of a float64 softmax over its valid pages' tokens,
 *            rows of a skipped sequence 0, the rows' padding untouched;
 *   the host-index validator (the debug mode, kv__attn_*_check /
 *            kv__plan_check_request) given the same arrays in host form
 *            refuses exactly when the body recorded an error (where both
 *            read the arrays by the same rules: CSR indptr from 0 ending at
 *            n_pages, canonical out_indptr, no window).
 * A read whose CSR indptr decreases (documented: entries near the decrease
 * may be left unread) relaxes to: each valid row is the reference or
 * untouched, the page-error count at most the reference's. Every array and
 * buffer is a malloc of its exact size (ASan sees a read past it). One
 * thread; the reference code runs without coverage instrumentation.
 */
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_attn_grid_int.h"
#include "kv_attn_kernels_hd.h"
#include "kv_convert_hd.h"
#include "kv_plan_grid_int.h"

#define FUZZ_NAME "fuzz_grid_devidx"
#define FUZZ_TRACE_LABEL "call"
#include "fuzz_check.h"
#include "fuzz_cache.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv);

#define MAX_SEQS 4
#define MAX_NP 4   /* pages per sequence */
#define MAX_COLS 4 /* block-table columns */
#define MAX_WTOK 12
#define MAX_PAIRS 8
#define N_TMPL 8

/* ---- input reader, trace, checks --------------------------------------------------- */

static void fill_garbage(void *p, size_t n, uint64_t seed)
{
    unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        b[i] = (unsigned char)mix64(&seed);
}

/* ---- caches ------------------------------------------------------------------------- */

static const struct tmpl k_tmpl[N_TMPL] = {
    {2, 24, 4, 2, 8, KV_ORDER_NHD, KV_ARRANGE_LAYER_MAJOR, false, 0, 0},
    {2, 20, 4, 2, 8, KV_ORDER_NHD, KV_ARRANGE_BLOCK_MAJOR, false, 3, 0},
    {2, 28, 4, 2, 8, KV_ORDER_HND, KV_ARRANGE_LAYER_MAJOR, false, 4, 0},
    {2, 17, 4, 2, 8, KV_ORDER_HND, KV_ARRANGE_BLOCK_MAJOR, false, 0, 0},
    {2, 12, 4, 2, 8, KV_ORDER_NHD, KV_ARRANGE_BLOCK_MAJOR, true, 0, 0},
    {2, 30, 2, 2, 8, KV_ORDER_NHD, KV_ARRANGE_LAYER_MAJOR, false, 5, 0},
    {2, 14, 8, 2, 8, KV_ORDER_HND, KV_ARRANGE_LAYER_MAJOR, false, 0, 0},
    {1, 10, 8, 1, 32, KV_ORDER_HND, KV_ARRANGE_LAYER_MAJOR, false, 4, 0},
};
static const kv_dtype k_dt[2] = {KV_F32, KV_F16};

static struct cc g_cc[N_TMPL][2];

static struct cc *get_cache(int ti, int di)
{
    struct cc *c = &g_cc[ti][di];
    if (c->built)
        return c;
    const struct tmpl *t = &k_tmpl[ti];
    cache_make(c, t, k_dt[di], KV_MEM_PINNED); /* pinned: what the CUDA entries take */
    uint64_t s = 0xC0FFEEu + (uint64_t)ti * 2 + (uint64_t)di;
    /* values in [-1, 1] (a decode's float64 reference), padding garbage */
    fill_garbage(c->pc.base, c->bytes, s);
    for (int64_t l = 0; l < t->L; l++)
        for (int kv = 0; kv < 2; kv++)
            for (int64_t b = 0; b < t->B; b++)
                for (int64_t n = 0; n < t->N; n++)
                    for (int64_t h = 0; h < t->H; h++)
                        for (int64_t d = 0; d < t->D; d++) {
                            const float x = (float)((int64_t)(mix64(&s) % 2001) - 1000) / 1000.0f;
                            kv_from_f32(c->dt, x,
                                        (unsigned char *)c->pc.base +
                                            ref_off(c, l, kv, b, n, h, d) * c->es);
                        }
    c->gold = xmalloc(c->bytes);
    c->ref = xmalloc(c->bytes);
    memcpy(c->gold, c->pc.base, c->bytes);
    c->built = true;
    return c;
}

/* After a call: the cache against its reference (then back to gold). */
static void cache_check(struct cc *c, const unsigned char *want, const char *what)
{
    if (memcmp(c->pc.base, want, c->bytes) != 0) {
        size_t i = 0;
        const unsigned char *g = c->pc.base;
        while (g[i] == want[i])
            i++;
        trace(" [%s: byte %zu of %zu is 0x%02x, expected 0x%02x]", what, i, c->bytes, g[i],
              want[i]);
        CHECK(!"cache equals its reference");
    }
    memcpy(c->pc.base, c->gold, c->bytes);
}

NOCOV static void copy_elem(const struct cc *d, unsigned char *dbase, int64_t dl, int kv,
                            int64_t db, int64_t dn, const struct cc *s, const unsigned char *sbase,
                            int64_t sl, int64_t sb, int64_t sn, int64_t h)
{
    memcpy(dbase + ref_off(d, dl, kv, db, dn, h, 0) * d->es,
           sbase + ref_off(s, sl, kv, sb, sn, h, 0) * s->es, (size_t)(d->t.D * d->es));
}

/* ---- the record ------------------------------------------------------------------ */

struct want {
    uint64_t count;
    int array;
    int64_t index, value;
};

static void want_add(struct want *w, int array, int64_t index, int64_t value)
{
    if (w->count == 0 || array < w->array || (array == w->array && index < w->index))
        w->array = array, w->index = index, w->value = value;
    w->count++;
}

/* count_max >= w->count: a count in [w->count, count_max] (the first must
 * still be w's). */
static void check_rec(uint64_t count, uint64_t first_key, uint64_t value_key, int64_t value,
                      const struct want *w, uint64_t count_min)
{
    trace(" rec{count=%llu", (unsigned long long)count);
    if (first_key) {
        const uint64_t k = ~first_key;
        trace(" first=(%d,%lld)=%lld", (int)(k >> 56), (long long)(k & ((1ull << 56) - 1)),
              (long long)value);
    }
    trace("} want{count=%llu first=(%d,%lld)=%lld}", (unsigned long long)w->count, w->array,
          (long long)w->index, (long long)w->value);
    CHECK(count >= count_min && count <= w->count);
    if (w->count == 0) {
        CHECK(first_key == 0);
        CHECK(count == 0);
        return;
    }
    if (count == 0)
        return; /* only where count_min is 0 */
    const uint64_t key = ~(((uint64_t)w->array << 56) | (uint64_t)w->index);
    CHECK(first_key == key);
    CHECK(value_key == key);
    CHECK(value == w->value);
}

static void check_attn_rec(const struct kv_attn_cuda_errors *e, const struct want *w)
{
    check_rec(e->count, e->first_key, e->value_key, e->first_value, w, w->count);
}

/* ---- hostile values ------------------------------------------------------------- */

/* A page id of a pool of n_ids pages. */
static int32_t rd_pid(struct rd *r, int64_t n_ids)
{
    const uint8_t b = rd_u8(r);
    if (b < 0xE0)
        return (int32_t)((b & 1) ? n_ids - 1 - (b >> 1) % n_ids : (b >> 1) % n_ids);
    const int32_t v[8] = {-1,        (int32_t)n_ids,        INT32_MAX,
                          INT32_MIN, (int32_t)n_ids + 1000, -(int32_t)n_ids,
                          -2,        (int32_t)n_ids + 1};
    return v[b & 7];
}

/* A block id of a pool of B blocks (ok: valid ids only; hostile ones past B). */
static uint32_t rd_bid(struct rd *r, int64_t B, bool *bad)
{
    const uint8_t b = rd_u8(r);
    *bad = b >= 0xE0;
    if (b < 0xE0)
        return (uint32_t)(b % B);
    const uint32_t v[8] = {(uint32_t)B,        (uint32_t)B + 1, UINT32_MAX,  0x80000000u,
                           (uint32_t)B + 1000, 0x7FFFFFFFu,     (uint32_t)B, UINT32_MAX - 1};
    return v[b & 7];
}

/* ---- device pages ------------------------------------------------------------- */

struct pgs {
    struct kv_attn_dev_pages dp;
    int32_t *indptr, *indices, *last, *table, *lens;
    int64_t n_indices;
    uint32_t S;
    bool canonical; /* CSR indptr from 0, ending at n_pages (the host reads it alike) */
    bool decreasing;
};

static void free_pages(struct pgs *P)
{
    free(P->indptr), free(P->indices), free(P->last), free(P->table), free(P->lens);
}

static void rd_pages(struct rd *r, const struct cc *c, struct pgs *P)
{
    const int64_t N = c->t.N, B = c->t.B;
    const uint8_t fb = rd_u8(r), sb = rd_u8(r);
    memset(P, 0, sizeof(*P));
    P->S = sb % (MAX_SEQS + 1);
    P->dp.n_seqs = P->S;
    P->dp.page_ratio = 1;
    P->canonical = true;
    if (!(fb & 1)) {
        P->dp.format = (fb & 2) ? KV_PAGES_CSR : (enum kv_pages_format)0;
        int32_t pos = 0, ids[MAX_SEQS * MAX_NP];
        P->indptr = xmalloc(((size_t)P->S + 1) * sizeof(int32_t));
        P->last = xmalloc((size_t)P->S * sizeof(int32_t));
        for (uint32_t s = 0; s < P->S; s++) {
            const int32_t np = (int32_t)(rd_u8(r) % (MAX_NP + 1));
            for (int32_t j = 0; j < np; j++)
                ids[pos + j] = rd_pid(r, B);
            P->indptr[s] = pos;
            pos += np;
            const uint8_t lb = rd_u8(r);
            if (lb < 0xF0) {
                P->last[s] = np ? (int32_t)(N - lb % N) : 0;
            } else {
                const int32_t v[8] = {0, (int32_t)N + 1, -1, INT32_MAX, INT32_MIN, 1, 1, 1};
                P->last[s] = v[lb & 7];
            }
        }
        P->indptr[P->S] = pos;
        P->n_indices = pos;
        P->indices = xmalloc((size_t)pos * sizeof(int32_t));
        if (pos)
            memcpy(P->indices, ids, (size_t)pos * sizeof(int32_t));
        const uint8_t mb = rd_u8(r), kb = rd_u8(r);
        const uint32_t k = kb % (P->S + 1);
        if (mb >= 0xF0) {
            const int32_t v[8] = {-1, pos + 1, INT32_MAX, INT32_MIN, 1, pos, 0, 2};
            if (mb >= 0xF8 && k > 0)
                P->indptr[k] = P->indptr[k - 1] - 1 - (mb & 1);
            else
                P->indptr[k] = v[mb & 7];
        }
        /* n_pages: the indices' length, or shorter (ids past it unread) */
        P->dp.n_pages = (kb & 0xC0) == 0xC0 && pos ? pos - 1 : pos;
        P->dp.indptr = P->indptr, P->dp.indices = P->indices, P->dp.last_page_len = P->last;
        P->canonical = P->S == 0 || (P->indptr[0] == 0 && P->indptr[P->S] == P->dp.n_pages);
        for (uint32_t s = 0; s < P->S; s++)
            if (P->indptr[s + 1] < P->indptr[s])
                P->decreasing = true;
        trace(" csr{S=%u n_pages=%lld indptr=[", P->S, (long long)P->dp.n_pages);
        for (uint32_t s = 0; s <= P->S; s++)
            trace(s ? ",%d" : "%d", P->indptr[s]);
        trace("] indices=[");
        for (int64_t j = 0; j < P->n_indices; j++)
            trace(j ? ",%d" : "%d", P->indices[j]);
        trace("] last=[");
        for (uint32_t s = 0; s < P->S; s++)
            trace(s ? ",%d" : "%d", P->last[s]);
        trace("]}");
    } else {
        const uint8_t cb = rd_u8(r);
        const uint32_t cols = 1 + cb % MAX_COLS;
        P->dp.format = KV_PAGES_BLOCK_TABLE;
        P->dp.block_table_cols = cols;
        P->n_indices = (int64_t)P->S * cols;
        P->table = xmalloc((size_t)P->n_indices * sizeof(int32_t));
        P->lens = xmalloc((size_t)P->S * sizeof(int32_t));
        const int32_t lmax = (int32_t)(cols * N);
        for (uint32_t s = 0; s < P->S; s++) {
            const uint8_t lb = rd_u8(r);
            if (lb < 0xF0) {
                P->lens[s] = lmax - lb % (lmax + 1);
            } else {
                const int32_t v[8] = {-1, INT32_MIN, INT32_MAX, lmax + 1, 1 << 30, -lmax, 0, 0};
                P->lens[s] = v[lb & 7];
            }
            for (uint32_t j = 0; j < cols; j++)
                P->table[s * cols + j] = rd_pid(r, B);
        }
        P->dp.block_table = P->table, P->dp.seq_lens = P->lens;
        trace(" bt{S=%u cols=%u lens=[", P->S, cols);
        for (uint32_t s = 0; s < P->S; s++)
            trace(s ? ",%d" : "%d", P->lens[s]);
        trace("] table=[");
        for (int64_t j = 0; j < P->n_indices; j++)
            trace(j ? ",%d" : "%d", P->table[j]);
        trace("]}");
    }
}

/* Sequence s by the documented rules: true with its tokens and its first
 * page entry, or false with the (array, index) to record. */
NOCOV static bool seq_rule(const struct pgs *P, int64_t pt, uint32_t s, int64_t *n_tok,
                           int64_t *first, int *arr, int64_t *idx)
{
    *n_tok = 0, *first = 0;
    if (P->dp.format == KV_PAGES_BLOCK_TABLE) {
        const int64_t len = P->lens[s];
        if (len < 0 || len > (int64_t)P->dp.block_table_cols * pt) {
            *arr = KV_ATTN_DEV_SEQ_LENS, *idx = s;
            return false;
        }
        *n_tok = len, *first = (int64_t)s * P->dp.block_table_cols;
        return true;
    }
    const int64_t a = P->indptr[s], b = P->indptr[s + 1], ll = P->last[s], np = P->dp.n_pages;
    if (a < 0 || a > np) {
        *arr = KV_ATTN_DEV_INDPTR, *idx = s;
        return false;
    }
    if (b < a || b > np) {
        *arr = KV_ATTN_DEV_INDPTR, *idx = s + 1;
        return false;
    }
    if (b == a ? ll != 0 : (ll < 1 || ll > pt)) {
        *arr = KV_ATTN_DEV_LAST_LEN, *idx = s;
        return false;
    }
    *n_tok = b > a ? (b - a - 1) * pt + ll : 0, *first = a;
    return true;
}

static int64_t seq_value(const struct pgs *P, int arr, int64_t idx)
{
    return arr == KV_ATTN_DEV_SEQ_LENS ? P->lens[idx]
           : arr == KV_ATTN_DEV_INDPTR ? P->indptr[idx]
                                       : P->last[idx];
}

static const int32_t *page_arr(const struct pgs *P)
{
    return P->dp.format == KV_PAGES_BLOCK_TABLE ? P->table : P->indices;
}

/* The host form of P (for the host-index validators). */
struct hpages {
    struct kv_pages kp;
    int64_t lens[MAX_SEQS + 1];
};

static void host_pages(const struct pgs *P, struct hpages *h)
{
    memset(h, 0, sizeof(*h));
    h->kp.n_seqs = P->S, h->kp.page_ratio = 1;
    if (P->dp.format == KV_PAGES_BLOCK_TABLE) {
        for (uint32_t s = 0; s < P->S; s++)
            h->lens[s] = P->lens[s];
        h->kp.format = KV_PAGES_BLOCK_TABLE, h->kp.block_table = P->table;
        h->kp.block_table_cols = P->dp.block_table_cols, h->kp.seq_lens = h->lens;
    } else {
        h->kp.format = KV_PAGES_CSR, h->kp.indptr = P->indptr, h->kp.indices = P->indices;
        h->kp.last_page_len = P->last;
    }
}

/* ---- write ------------------------------------------------------------------------ */

static void op_write(struct rd *r, struct cc *c)
{
    const struct tmpl *t = &c->t;
    const uint8_t lb = rd_u8(r);
    const bool all = lb & 1;
    const int32_t layer = all ? KV_ATTN_ALL_LAYERS : (int32_t)((lb >> 1) % t->L);
    const int64_t T = rd_u8(r) % (MAX_WTOK + 1), n_slots = T - (T && (lb & 0x80) ? 1 : 0);
    const int64_t limit = t->B * t->N, nl = all ? t->L : 1;
    int64_t *slots = xmalloc((size_t)n_slots * sizeof(int64_t));
    bool used[2048] = {false};
    CHECK(limit <= 2048);
    trace(" write{layer=%d T=%lld slots=[", layer, (long long)T);
    for (int64_t i = 0; i < n_slots; i++) {
        const uint8_t b = rd_u8(r), b2 = rd_u8(r);
        if (b < 0xE0) {
            int64_t s = ((int64_t)b * 256 + b2) % limit;
            if (used[s])
                s = -1; /* a slot given twice lands either token: not fuzzed */
            else
                used[s] = true;
            slots[i] = s;
        } else {
            const int64_t v[8] = {-1,        -2,        limit,  limit + 1,
                                  INT64_MAX, INT64_MIN, -limit, (int64_t)1 << 40};
            slots[i] = v[b & 7];
        }
        trace(i ? ",%lld" : "%lld", (long long)slots[i]);
    }
    trace("]}");
    /* k, v: [T][H][D] or [L][T][H][D], the cache's dtype */
    const int64_t sh[4] = {t->L, T, t->H, t->D};
    const size_t tb = (size_t)(nl * T * t->H * t->D * c->es);
    unsigned char *kb = xmalloc(tb), *vb = xmalloc(tb);
    fill_garbage(kb, tb, lb * 7u + 1), fill_garbage(vb, tb, lb * 7u + 2);
    struct kv_view k, v;
    CHECK(kv_view_init(kb, tb, c->dt, all ? 4 : 3, all ? sh : sh + 1, &k) == KV_OK);
    CHECK(kv_view_init(vb, tb, c->dt, all ? 4 : 3, all ? sh : sh + 1, &v) == KV_OK);
    /* reference */
    struct want w = {0, 0, 0, 0};
    memcpy(c->ref, c->gold, c->bytes);
    for (int64_t i = 0; i < n_slots; i++) {
        if (slots[i] == -1)
            continue;
        if (slots[i] < -1 || slots[i] >= limit) {
            want_add(&w, KV_ATTN_DEV_SLOTS, i, slots[i]);
            continue;
        }
        for (int64_t lr = 0; lr < nl; lr++)
            for (int kv = 0; kv < 2; kv++)
                for (int64_t h = 0; h < t->H; h++)
                    memcpy(c->ref + ref_off(c, all ? lr : layer, kv, slots[i] / t->N,
                                            slots[i] % t->N, h, 0) *
                                        c->es,
                           (kv ? vb : kb) + (((lr * T + i) * t->H + h) * t->D) * c->es,
                           (size_t)(t->D * c->es));
    }
    struct kv_attn_cuda_errors rec;
    memset(&rec, 0, sizeof(rec));
    struct kv__attn_job j;
    kv_status st = kv__attn_write_dev_check("kv_attn_write_cuda_dev", &c->pc, layer, &k, &v, slots,
                                            n_slots, NULL, &j);
    CHECK(st == KV_OK);
    st = kv__grid_attn_write_dev(&j, slots, n_slots, false, &rec);
    kv__attn_job_free(&j);
    CHECK(st == KV_OK);
    check_attn_rec(&rec, &w);
    cache_check(c, c->ref, "cache after the write");
    /* the host-index validator refuses exactly these slots */
    st = kv__attn_write_check("kv_attn_write_cuda", &c->pc, layer, &k, &v,
                              (struct kv__attn_slots){slots, false}, n_slots, NULL, &j);
    trace(" host=%s", kv_status_name(st));
    CHECK((st == KV_OK) == (w.count == 0));
    if (st == KV_OK)
        kv__attn_job_free(&j);
    free(slots), free(kb), free(vb);
}

/* ---- read ------------------------------------------------------------------------- */

static void op_read(struct rd *r, struct cc *c)
{
    const struct tmpl *t = &c->t;
    const uint8_t lb = rd_u8(r);
    const bool all = lb & 1;
    const int32_t layer = all ? KV_ATTN_ALL_LAYERS : (int32_t)((lb >> 1) % t->L);
    const int64_t nl = all ? t->L : 1, pt = t->N;
    struct pgs P;
    rd_pages(r, c, &P);
    /* out_indptr: the tokens' cumulative sums (bad sequences 0), or hostile */
    int32_t *oi = xmalloc(((size_t)P.S + 1) * sizeof(int32_t));
    int64_t tok[MAX_SEQS], first[MAX_SEQS], idx[MAX_SEQS];
    int arr[MAX_SEQS];
    bool ok[MAX_SEQS];
    oi[0] = 0;
    for (uint32_t s = 0; s < P.S; s++) {
        ok[s] = seq_rule(&P, pt, s, &tok[s], &first[s], &arr[s], &idx[s]);
        oi[s + 1] = oi[s] + (int32_t)tok[s];
    }
    int64_t T = oi[P.S];
    const uint8_t ob = rd_u8(r), kb = rd_u8(r);
    bool out_canon = true;
    if (ob >= 0xE0) {
        const uint32_t k = kb % (P.S + 1);
        const int32_t v[8] = {-1, oi[k] + 1, INT32_MAX, INT32_MIN, (int32_t)T + 1, 0, 0, 0};
        if ((ob & 7) >= 5 && k > 0)
            oi[k] = oi[k - 1] - 1;
        else
            oi[k] = v[ob & 7];
        out_canon = false;
    }
    if (ob >= 0xD0 && ob < 0xE0)
        T += 1 + ob % 3, out_canon = false; /* spare rows */
    trace(" read{layer=%d T=%lld out=[", layer, (long long)T);
    for (uint32_t s = 0; s <= P.S; s++)
        trace(s ? ",%d" : "%d", oi[s]);
    trace("]}");
    const int64_t sh[4] = {t->L, T, t->H, t->D};
    const size_t tb = (size_t)(nl * T * t->H * t->D * c->es);
    unsigned char *ko = xmalloc(tb), *vo = xmalloc(tb), *kw = xmalloc(tb), *vw = xmalloc(tb);
    fill_garbage(ko, tb, 11 + lb), fill_garbage(vo, tb, 12 + lb);
    memcpy(kw, ko, tb), memcpy(vw, vo, tb);
    struct kv_view k, v;
    CHECK(kv_view_init(ko, tb, c->dt, all ? 4 : 3, all ? sh : sh + 1, &k) == KV_OK);
    CHECK(kv_view_init(vo, tb, c->dt, all ? 4 : 3, all ? sh : sh + 1, &v) == KV_OK);
    /* reference */
    struct want w = {0, 0, 0, 0};
    uint64_t seq_errs = 0;
    const int32_t *pa = page_arr(&P);
    for (uint32_t s = 0; s < P.S; s++) {
        if (!ok[s]) {
            want_add(&w, arr[s], idx[s], seq_value(&P, arr[s], idx[s]));
            seq_errs++;
            continue;
        }
        const int64_t o0 = oi[s], o1 = oi[s + 1];
        if (o0 < 0 || o0 > T) {
            want_add(&w, KV_ATTN_DEV_OUT_INDPTR, s, o0);
            seq_errs++;
            continue;
        }
        if (o1 < o0 || o1 > T || o1 - o0 != tok[s]) {
            want_add(&w, KV_ATTN_DEV_OUT_INDPTR, s + 1, o1);
            seq_errs++;
            continue;
        }
        for (int64_t i = 0; i * pt < tok[s]; i++) {
            const int64_t e = first[s] + i, pid = pa[e];
            if (pid < 0 || pid >= t->B) {
                want_add(&w, KV_ATTN_DEV_PAGES, e, pid);
                continue;
            }
            for (int64_t n = 0; n < pt && i * pt + n < tok[s]; n++)
                for (int64_t lr = 0; lr < nl; lr++)
                    for (int kv = 0; kv < 2; kv++)
                        for (int64_t h = 0; h < t->H; h++)
                            memcpy((kv ? vw : kw) +
                                       (((lr * T + o0 + i * pt + n) * t->H + h) * t->D) * c->es,
                                   c->gold + ref_off(c, all ? lr : layer, kv, pid, n, h, 0) * c->es,
                                   (size_t)(t->D * c->es));
        }
    }
    struct kv_attn_cuda_errors rec;
    memset(&rec, 0, sizeof(rec));
    struct kv__attn_job j;
    kv_status st = kv__attn_read_dev_check("kv_attn_read_cuda_dev", &c->pc, layer, &P.dp, oi, &k,
                                           &v, NULL, &j);
    CHECK(st == KV_OK);
    st = kv__grid_attn_read_dev(&j, &P.dp, oi, false, &rec);
    kv__attn_job_free(&j);
    CHECK(st == KV_OK);
    if (!P.decreasing) {
        check_attn_rec(&rec, &w);
        CHECK(memcmp(ko, kw, tb) == 0);
        CHECK(memcmp(vo, vw, tb) == 0);
    } else { /* documented: entries near a decrease may be left unread */
        check_rec(rec.count, rec.first_key, rec.value_key, rec.first_value, &w, seq_errs);
        unsigned char *g0 = xmalloc(tb);
        for (int kv = 0; kv < 2; kv++) {
            fill_garbage(g0, tb, (kv ? 12u : 11u) + lb);
            const unsigned char *got = kv ? vo : ko, *want = kv ? vw : kw;
            const size_t row = (size_t)(t->D * c->es);
            for (size_t o = 0; o < tb; o += row)
                CHECK(memcmp(got + o, want + o, row) == 0 || memcmp(got + o, g0 + o, row) == 0);
        }
        free(g0);
    }
    cache_check(c, c->gold, "cache after the read");
    /* the host validator, where it reads the same sequences the same way */
    if (P.canonical && out_canon) {
        struct hpages hp;
        host_pages(&P, &hp);
        st = kv__attn_read_check("kv_attn_read_cuda", &c->pc, layer, &hp.kp, &k, &v, NULL, &j);
        trace(" host=%s", kv_status_name(st));
        CHECK((st == KV_OK) == (w.count == 0));
        if (st == KV_OK)
            kv__attn_job_free(&j);
    }
    free(oi), free(ko), free(vo), free(kw), free(vw);
    free_pages(&P);
}

/* ---- decode ----------------------------------------------------------------------- */

static const float k_ks[4] = {0.25f, 1.75f, 3.0f, 0.5f}, k_vs[4] = {1.5f, 0.375f, 0.75f, 2.5f};

NOCOV static void dec_ref(const struct cc *c, uint32_t layer, const float *qr, int64_t h,
                          const int64_t *sl, int64_t n, double smscale, double ks, double vs,
                          double *ref)
{
    const struct tmpl *t = &c->t;
    double sc[MAX_NP * 8 + 8], mx = -INFINITY, sum = 0;
    for (int64_t i = 0; i < n; i++) {
        double dot = 0;
        for (int64_t d = 0; d < t->D; d++)
            dot += (double)qr[d] *
                   (double)kv_to_f32(
                       c->dt,
                       c->gold + ref_off(c, layer, 0, sl[i] / t->N, sl[i] % t->N, h, d) * c->es);
        sc[i] = dot * smscale * ks;
        mx = sc[i] > mx ? sc[i] : mx;
    }
    for (int64_t i = 0; i < n; i++)
        sum += (sc[i] = exp(sc[i] - mx));
    for (int64_t d = 0; d < t->D; d++) {
        double a = 0;
        for (int64_t i = 0; i < n; i++)
            a += sc[i] / sum * vs *
                 (double)kv_to_f32(
                     c->dt,
                     c->gold + ref_off(c, layer, 1, sl[i] / t->N, sl[i] % t->N, h, d) * c->es);
        ref[d] = a;
    }
}

static void op_decode(struct rd *r, struct cc *c, uint8_t body)
{
    const struct tmpl *t = &c->t;
    if (t->packed)
        return; /* the decode reads a K and a V plane */
    const uint8_t lb = rd_u8(r);
    const uint32_t layer = (uint32_t)(lb % t->L);
    const int64_t G = 1 + (lb >> 1) % 2, Hq = t->H * G, D = t->D, pt = t->N, row = D + 4;
    const int sc = (lb >> 2) % 3;
    const int32_t windows[8] = {-1, -1, -1, -1, 0, 1, 3, 6};
    const int32_t wl = windows[(lb >> 4) & 7];
    static const int bodies[5][2] = {{KV__CDEC_AUTO, 0},
                                     {KV__CDEC_GENERAL, 0},
                                     {KV__CDEC_PIPE, 0},
                                     {KV__CDEC_SPLIT, 2},
                                     {KV__CDEC_SPLIT, 0}};
    kv__cdec_body = bodies[body % 5][0];
    kv__cdec_chunks = bodies[body % 5][1];
    struct pgs P;
    rd_pages(r, c, &P);
    const uint32_t S = P.S;
    trace(" decode{layer=%u G=%lld sc=%d window=%d body=%d}", layer, (long long)G, sc, wl,
          body % 5);
    const size_t nq = (size_t)(S * Hq * D), no = (size_t)(S * Hq * row);
    float *qb = xmalloc(nq * 4), *ob = xmalloc(no * 4), *o0 = xmalloc(no * 4);
    uint64_t rs = lb + 77u;
    for (size_t i = 0; i < nq; i++)
        qb[i] = (float)((int64_t)(mix64(&rs) % 2001) - 1000) / 1000.0f;
    fill_garbage(ob, no * 4, rs);
    memcpy(o0, ob, no * 4);
    struct kv_view q, out, flat;
    int64_t shq[3] = {S, Hq, D}, sh[3] = {S, Hq, D}, st3[3] = {Hq * row, row, 1}, nn = (int64_t)no;
    CHECK(kv_view_init(qb, nq * 4, KV_F32, 3, shq, &q) == KV_OK);
    CHECK(kv_view_init(ob, no * 4, KV_F32, 1, &nn, &flat) == KV_OK);
    CHECK(kv_view_as_strided(&flat, 3, sh, st3, 0, &out) == KV_OK);
    const float smscale = 1.0f / sqrtf((float)D);
    /* scales: per KV head, a row per layer (device) or shared (by value) */
    const uint32_t rows = sc == 2 ? (uint32_t)t->L : 0;
    const struct kv_attn_dev_scales dsc = {k_ks, k_vs, (uint32_t)t->H, rows, sc == 2};
    const struct kv_scales hsc = {k_ks, k_vs, (uint32_t)t->H, rows};
    struct kv_attn_opts o = KV_ATTN_OPTS_INIT;
    o.window_left = wl;
    struct kv_attn_cuda_errors rec;
    memset(&rec, 0, sizeof(rec));
    struct kv__attn_job j;
    kv_status st =
        kv__attn_decode_dev_check("kv_attn_decode_ex_cuda_dev", &c->pc, layer, &q, &P.dp, smscale,
                                  sc ? &dsc : NULL, &out, wl >= 0 ? &o : NULL, &j);
    CHECK(st == KV_OK);
    st = kv__grid_attn_decode_dev(&j, &P.dp, sc == 1, &rec);
    kv__attn_job_free(&j);
    trace(" st=%s", kv_status_name(st));
    CHECK(st == KV_OK);
    /* reference and record */
    struct want w = {0, 0, 0, 0};
    const int32_t *pa = page_arr(&P);
    for (uint32_t s = 0; s < S; s++) {
        int64_t n_tok, first, idx, sl[MAX_COLS * 8 + 8], n = 0;
        int arr;
        const bool ok = seq_rule(&P, pt, s, &n_tok, &first, &arr, &idx);
        if (!ok)
            want_add(&w, arr, idx, seq_value(&P, arr, idx));
        const int64_t t0 = wl >= 0 && n_tok - 1 - wl > 0 ? n_tok - 1 - wl : 0;
        for (int64_t i = t0 / pt; ok && i * pt < n_tok; i++) {
            const int64_t e = first + i, pid = pa[e];
            if (pid < 0 || pid >= t->B) {
                want_add(&w, KV_ATTN_DEV_PAGES, e, pid);
                continue;
            }
            for (int64_t x = i * pt; x < (i + 1) * pt && x < n_tok; x++)
                if (x >= t0)
                    sl[n++] = pid * pt + x % pt;
        }
        for (int64_t qi = 0; qi < Hq; qi++) {
            const int64_t h = qi / G;
            const double ks = sc ? k_ks[(rows ? layer * t->H : 0) + h] : 1.0;
            const double vs = sc ? k_vs[(rows ? layer * t->H : 0) + h] : 1.0;
            double ref[64];
            dec_ref(c, layer, qb + (s * Hq + qi) * D, h, sl, n, smscale, ks, vs, ref);
            for (int64_t d = 0; d < D; d++) {
                float *op = &ob[(s * Hq + qi) * row + d];
                const double err =
                    fabs((double)*op - ref[d]) / (fabs(ref[d]) > 0.1 ? fabs(ref[d]) : 0.1);
                if (!(err <= 1e-5)) {
                    trace(" [s%u q%lld d%lld: %.9g vs %.9g]", s, (long long)qi, (long long)d,
                          (double)*op, ref[d]);
                    CHECK(!"decode output within 1e-5 of the float64 reference");
                }
                *op = o0[op - ob];
            }
        }
    }
    CHECK(memcmp(ob, o0, no * 4) == 0); /* the rows' padding */
    check_attn_rec(&rec, &w);
    cache_check(c, c->gold, "cache after the decode");
    if (P.canonical && wl < 0) {
        struct hpages hp;
        host_pages(&P, &hp);
        st = kv__attn_decode_check("kv_attn_decode_cuda", &c->pc, layer, &q, NULL, &hp.kp, smscale,
                                   sc ? &hsc : NULL, &out, NULL, &j);
        trace(" host=%s", kv_status_name(st));
        CHECK((st == KV_OK) == (w.count == 0));
        if (st == KV_OK)
            kv__attn_job_free(&j);
    }
    kv__cdec_body = KV__CDEC_AUTO;
    kv__cdec_chunks = 0;
    free(qb), free(ob), free(o0);
    free_pages(&P);
}

/* ---- copy blocks, copy_ex ------------------------------------------------------------- */

/* Pairs into d from s (ex: two caches). Valid dst ids distinct (and, within
 * one cache, disjoint from the src ids: the device does not detect an
 * overlap, the result is then undefined). */
static uint32_t rd_pairs(struct rd *r, const struct cc *d, const struct cc *s, bool one,
                         struct kv_block_copy *pairs, struct want *w)
{
    const int64_t Bd = d->t.B, Bs = s->t.B, half = one ? Bd / 2 : 0;
    const int64_t nd = Bd - half;
    uint32_t n = rd_u8(r) % (MAX_PAIRS + 1);
    if (n > nd)
        n = (uint32_t)nd;
    bool used[64] = {false};
    trace(" pairs=[");
    for (uint32_t i = 0; i < n; i++) {
        bool bs, bd;
        uint32_t src = rd_bid(r, Bs, &bs);
        if (!bs && one)
            src %= (uint32_t)half;
        uint32_t dst = rd_bid(r, Bd, &bd);
        if (!bd) {
            dst %= (uint32_t)nd;
            while (used[dst])
                dst = (dst + 1) % (uint32_t)nd;
            used[dst] = true;
            dst += (uint32_t)half;
        }
        pairs[i] = (struct kv_block_copy){src, dst, (uint32_t)d->t.N};
        trace("%s%u>%u", i ? "," : "", src, dst);
        if (src >= (uint32_t)Bs)
            want_add(w, KV_ATTN_DEV_COPIES, 2 * (int64_t)i, src);
        else if (dst >= (uint32_t)Bd)
            want_add(w, KV_ATTN_DEV_COPIES, 2 * (int64_t)i + 1, dst);
    }
    trace("]");
    return n;
}

NOCOV static void ref_pairs(struct cc *d, const struct cc *s, const struct kv_block_copy *pairs,
                            uint32_t n, int64_t l0, int64_t l1, uint32_t planes)
{
    memcpy(d->ref, d->gold, d->bytes);
    for (uint32_t i = 0; i < n; i++) {
        if (pairs[i].src >= (uint32_t)s->t.B || pairs[i].dst >= (uint32_t)d->t.B)
            continue;
        for (int64_t l = l0; l < l1; l++)
            for (int kv = 0; kv < 2; kv++)
                if (planes & (1u << kv))
                    for (int64_t tk = 0; tk < d->t.N; tk++)
                        for (int64_t h = 0; h < d->t.H; h++)
                            copy_elem(d, d->ref, l, kv, pairs[i].dst, tk, s, s->gold, l,
                                      pairs[i].src, tk, h);
    }
}

static void op_copy(struct rd *r, struct cc *c)
{
    struct kv_block_copy *pairs = xmalloc(MAX_PAIRS * sizeof(*pairs));
    struct want w = {0, 0, 0, 0};
    trace(" copy{");
    uint32_t n = rd_pairs(r, c, c, true, pairs, &w);
    trace("}");
    /* exact size: shrink to n */
    struct kv_block_copy *p = xmalloc(n * sizeof(*p));
    if (n)
        memcpy(p, pairs, n * sizeof(*p));
    free(pairs);
    ref_pairs(c, c, p, n, 0, c->t.L, 3);
    struct kv_attn_cuda_errors rec;
    memset(&rec, 0, sizeof(rec));
    struct kv__attn_job j;
    kv_status st = kv__attn_copy_dev_check("kv_attn_copy_blocks_cuda_dev", &c->pc, p, n, &j);
    CHECK(st == KV_OK);
    st = kv__grid_attn_copy_dev(&j, p, n, &rec);
    kv__attn_job_free(&j);
    CHECK(st == KV_OK);
    check_attn_rec(&rec, &w);
    cache_check(c, c->ref, "cache after the copy");
    st = kv__attn_copy_check("kv_attn_copy_blocks_cuda", &c->pc, NULL, p, n, NULL, &j);
    trace(" host=%s", kv_status_name(st));
    CHECK((st == KV_OK) == (w.count == 0));
    if (st == KV_OK)
        kv__attn_job_free(&j);
    free(p);
}

/* The copy_ex partner of template ti: the next of the same L, N, H, D,
 * order and packing (-1: none). */
static int ex_partner(int ti)
{
    const struct tmpl *a = &k_tmpl[ti];
    for (int k = 1; k < N_TMPL; k++) {
        const struct tmpl *b = &k_tmpl[(ti + k) % N_TMPL];
        if (a->L == b->L && a->N == b->N && a->H == b->H && a->D == b->D && a->order == b->order &&
            a->packed == b->packed)
            return (ti + k) % N_TMPL;
    }
    return -1;
}

static void op_copy_ex(struct rd *r, int ti, int di)
{
    const int si = ex_partner(ti);
    if (si < 0) {
        op_copy(r, get_cache(ti, di));
        return;
    }
    struct cc *d = get_cache(ti, di), *s = get_cache(si, di);
    const uint8_t ob = rd_u8(r);
    struct kv_copy_blocks_opts o = KV_COPY_BLOCKS_OPTS_INIT;
    o.layer0 = (uint32_t)(ob % d->t.L);
    o.n_layers = (uint32_t)((ob >> 2) % (d->t.L - o.layer0 + 1)); /* 0: through L - 1 */
    o.planes = (ob >> 4) % 4;
    const uint32_t planes = o.planes ? o.planes : 3;
    const int64_t l1 = o.n_layers ? o.layer0 + o.n_layers : d->t.L;
    trace(" copy_ex{src=T%d layer0=%u n_layers=%u planes=%u", si, o.layer0, o.n_layers, o.planes);
    struct kv_block_copy *pairs = xmalloc(MAX_PAIRS * sizeof(*pairs));
    struct want w = {0, 0, 0, 0};
    uint32_t n = rd_pairs(r, d, s, false, pairs, &w);
    trace("}");
    struct kv_block_copy *p = xmalloc(n * sizeof(*p));
    if (n)
        memcpy(p, pairs, n * sizeof(*p));
    free(pairs);
    ref_pairs(d, s, p, n, o.layer0, l1, planes);
    struct kv_attn_cuda_errors rec;
    memset(&rec, 0, sizeof(rec));
    struct kv__attn_job j;
    kv_status st =
        kv__attn_copy_ex_dev_check("kv_attn_copy_blocks_ex_cuda_dev", &d->pc, &s->pc, p, n, &o, &j);
    CHECK(st == KV_OK);
    st = kv__grid_attn_copy_ex_dev(&j, p, n, &rec);
    kv__attn_job_free(&j);
    CHECK(st == KV_OK);
    check_attn_rec(&rec, &w);
    cache_check(d, d->ref, "destination after the copy_ex");
    cache_check(s, s->gold, "source after the copy_ex");
    st = kv__attn_copy_check("kv_attn_copy_blocks_ex_cuda", &d->pc, &s->pc, p, n, &o, &j);
    trace(" host=%s", kv_status_name(st));
    CHECK((st == KV_OK) == (w.count == 0));
    if (st == KV_OK)
        kv__attn_job_free(&j);
    free(p);
}

/* ---- plan copy with device block lists ---------------------------------------------- */

static kv_plan *g_plan[N_TMPL][N_TMPL][2];

static void op_plan(struct rd *r, int ti, int di)
{
    const uint8_t pb = rd_u8(r);
    int si = -1;
    for (int k = 1; k < N_TMPL && si < 0; k++) {
        const int x = (ti + (pb % (N_TMPL - 1)) + k) % N_TMPL;
        const struct tmpl *a = &k_tmpl[ti], *b = &k_tmpl[x];
        if (x != ti && a->L == b->L && a->H == b->H && a->D == b->D)
            si = x;
    }
    if (si < 0) {
        op_copy(r, get_cache(ti, di));
        return;
    }
    struct cc *d = get_cache(ti, di), *s = get_cache(si, di);
    kv_plan **pp = &g_plan[si][ti][di];
    if (!*pp)
        CHECK(kv_plan_create(&s->pc.layout, &d->pc.layout, NULL, pp) == KV_OK);
    const int64_t Ns = s->t.N, Nd = d->t.N;
    const uint64_t T = rd_u8(r) % 25;
    const uint32_t ns = (uint32_t)((T + (uint64_t)Ns - 1) / (uint64_t)Ns),
                   nd = (uint32_t)((T + (uint64_t)Nd - 1) / (uint64_t)Nd);
    uint32_t *sid = xmalloc(ns * sizeof(uint32_t)), *did = xmalloc(nd * sizeof(uint32_t));
    struct want w = {0, 0, 0, 0};
    bool used[64] = {false}, bad;
    trace(" plan{src=T%d T=%llu sid=[", si, (unsigned long long)T);
    for (uint32_t i = 0; i < ns; i++) {
        sid[i] = rd_bid(r, s->t.B, &bad);
        trace(i ? ",%u" : "%u", sid[i]);
        if (bad)
            want_add(&w, 0, i, sid[i]);
    }
    trace("] did=[");
    for (uint32_t i = 0; i < nd; i++) {
        did[i] = rd_bid(r, d->t.B, &bad);
        if (!bad) {
            while (used[did[i]])
                did[i] = (did[i] + 1) % (uint32_t)d->t.B;
            used[did[i]] = true;
        } else {
            want_add(&w, 1, i, did[i]);
        }
        trace(i ? ",%u" : "%u", did[i]);
    }
    trace("]}");
    /* blocks move whole: every token both lists' blocks cover (kv_plan.h) */
    const uint64_t cover = (uint64_t)ns * (uint64_t)Ns < (uint64_t)nd * (uint64_t)Nd
                               ? (uint64_t)ns * (uint64_t)Ns
                               : (uint64_t)nd * (uint64_t)Nd;
    memcpy(d->ref, d->gold, d->bytes);
    for (uint64_t tk = 0; tk < cover; tk++) {
        const uint32_t bs = sid[tk / (uint64_t)Ns], bd = did[tk / (uint64_t)Nd];
        if (bs >= (uint32_t)s->t.B || bd >= (uint32_t)d->t.B)
            continue;
        for (int64_t l = 0; l < d->t.L; l++)
            for (int kv = 0; kv < 2; kv++)
                for (int64_t h = 0; h < d->t.H; h++)
                    copy_elem(d, d->ref, l, kv, bd, (int64_t)(tk % (uint64_t)Nd), s, s->gold, l, bs,
                              (int64_t)(tk % (uint64_t)Ns), h);
    }
    struct kv_plan_cuda_errors rec;
    memset(&rec, 0, sizeof(rec));
    kv_status st = kv__plan_check_request_dev("kv_plan_copy_cuda_dev", *pp, &s->pc, sid, ns, &d->pc,
                                              did, nd, T);
    CHECK(st == KV_OK);
    st = kv__grid_plan_copy_dev(*pp, &s->pc, sid, ns, &d->pc, did, nd, T, &rec);
    CHECK(st == KV_OK);
    check_rec(rec.count, rec.first_key, rec.value_key, rec.first_value, &w, w.count);
    cache_check(d, d->ref, "destination after the plan copy");
    cache_check(s, s->gold, "source after the plan copy");
    st =
        kv__plan_check_request("kv_plan_copy_cuda", *pp, &s->pc, sid, ns, &d->pc, did, nd, T, true);
    trace(" host=%s", kv_status_name(st));
    CHECK((st == KV_OK) == (w.count == 0));
    free(sid), free(did);
}

/* ---- entry ------------------------------------------------------------------------ */

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc, (void)argv;
    CHECK(kv_set_threads(1) == KV_OK);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct rd r = {data, size, 0};
    trace_reset();
    const uint8_t ob = rd_u8(&r), tb = rd_u8(&r), db = rd_u8(&r);
    const int op = (ob & 7) % 6, ti = tb % N_TMPL, di = db & 1;
    trace(" op=%d T%d dt=%d", op, ti, di);
    switch (op) {
    case 0:
        op_write(&r, get_cache(ti, di));
        break;
    case 1:
        op_read(&r, get_cache(ti, di));
        break;
    case 2:
        op_decode(&r, get_cache(ti, di), (uint8_t)(db >> 1));
        break;
    case 3:
        op_copy(&r, get_cache(ti, di));
        break;
    case 4:
        op_copy_ex(&r, ti, di);
        break;
    default:
        op_plan(&r, ti, di);
        break;
    }
    return 0;
}
