/*
 * kv_plan.c - transfer plans (kv_plan.h) and their CPU executor.
 *
 * Build: every head row (layer and head of the ranges, K/V, token of the window)
 * is one (source block, destination block, src_rel, dst_rel) record of D
 * elements, offsets from kvcache/kv_layout_hd.h. Records are sorted by
 * (source block, destination block, src_rel) - made in the source's stride
 * order, counted into their block pairs, and only a pair found unsorted is
 * sorted - and merged while both sides continue; the resulting runs are
 * grouped into 2-D copies while width and both pitches stay the same.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_layout_hd.h"
#include "kv_lib.h"
#include "kv_mem.h"
#include "kv_plan.h"
#include "kv_pack_int.h"
#include "kv_plan_int.h"

#define KV__PLAN_MAX_WINDOW 65536

struct kv__row {
    int64_t ks, kd, src_rel, dst_rel;
};

static int row_cmp(const void *a, const void *b)
{
    const struct kv__row *x = a, *y = b;
    if (x->ks != y->ks)
        return x->ks < y->ks ? -1 : 1;
    if (x->kd != y->kd)
        return x->kd < y->kd ? -1 : 1;
    return x->src_rel < y->src_rel ? -1 : x->src_rel > y->src_rel;
}

static int64_t gcd64(int64_t a, int64_t b)
{
    while (b) {
        const int64_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

kv_status kv__plan_check_layout(const char *fn, const char *what, const struct kv_layout *lo)
{
    static char dummy[64] __attribute__((aligned(64)));
    struct kv_paged_cache c = {
        .layout = *lo, .base = dummy, .storage_bytes = (size_t)lo->total_bytes};
    kv_status st = kv_paged_check(&c, false);
    return st == KV_OK ? KV_OK : kv__error_wrap(st, "%s: %s", fn, what);
}

/* A range [s0, s0 + n) of the source's heads or layers (stem "head" or
 * "layer", sn of them) onto [d0, d0 + n) of the destination's (dn); n 0
 * means every one, then both counts agree, both offsets are 0, and n
 * becomes the count. */
static kv_status resolve_range(const char *fn, const char *stem, const char *sym, int64_t sn,
                               int64_t dn, int64_t *s0, int64_t *d0, int64_t *n)
{
    if (*n == 0) {
        if (sn != dn || *s0 != 0 || *d0 != 0)
            return kv__error(KV_ERR_BAD_SHAPE,
                             "%s: n_%ss 0 (every %s) needs equal %s counts and %s offsets 0: "
                             "source %s %" PRId64 " destination %s %" PRId64 ", src_%s0 %" PRId64
                             " dst_%s0 %" PRId64,
                             fn, stem, stem, stem, stem, sym, sn, sym, dn, stem, *s0, stem, *d0);
        *n = sn;
    }
    if (*n < 0 || *s0 < 0 || *d0 < 0 || *s0 > sn - *n || *d0 > dn - *n)
        return kv__error(KV_ERR_BAD_SHAPE,
                         "%s: %ss [%" PRId64 ", %" PRId64 "+%" PRId64
                         ") of a source with %s %" PRId64 " onto [%" PRId64 ", %" PRId64 "+%" PRId64
                         ") of a destination with %s %" PRId64 ": outside a layout",
                         fn, stem, *s0, *s0, *n, sym, sn, *d0, *d0, *n, sym, dn);
    return KV_OK;
}

kv_status kv__plan_resolve(const char *fn, const struct kv_layout *src, const struct kv_layout *dst,
                           const struct kv_plan_config *cfg, struct kv_plan_config *out)
{
    struct kv_plan_config c = KV_PLAN_CONFIG_INIT;
    kv_status st;
    if (cfg) {
        if ((st = kv__check_struct_size(fn, "kv_plan_config", cfg->struct_size, sizeof(c))) !=
            KV_OK)
            return st;
        c = *cfg;
    }
    if ((st = kv__plan_check_layout(fn, "source layout", src)) != KV_OK ||
        (st = kv__plan_check_layout(fn, "destination layout", dst)) != KV_OK)
        return st;
    if (src->dtype != dst->dtype || src->elem_bytes != dst->elem_bytes)
        return kv__error(KV_ERR_INVALID_ARG,
                         "%s: source dtype %s, destination %s: a plan moves bytes "
                         "and does not convert elements",
                         fn, kv_dtype_name(src->dtype), kv_dtype_name(dst->dtype));
    if (src->k_only != dst->k_only)
        return kv__error(KV_ERR_INVALID_ARG,
                         "%s: source %s, destination %s: a K-only (MLA latent) layout moves to "
                         "a K-only layout only (a plan moves planes, it does not make or drop V)",
                         fn, src->k_only ? "K-only" : "K and V planes",
                         dst->k_only ? "K-only" : "K and V planes");
    if (src->head_dim != dst->head_dim)
        return kv__error(KV_ERR_BAD_SHAPE,
                         "%s: source D %" PRId64 ", destination D %" PRId64
                         ": head dims must agree",
                         fn, src->head_dim, dst->head_dim);
    if ((st = resolve_range(fn, "head", "H", src->num_heads, dst->num_heads, &c.src_head0,
                            &c.dst_head0, &c.n_heads)) != KV_OK ||
        (st = resolve_range(fn, "layer", "L", src->num_layers, dst->num_layers, &c.src_layer0,
                            &c.dst_layer0, &c.n_layers)) != KV_OK)
        return st;
    *out = c;
    return KV_OK;
}

kv_status kv_plan_create(const struct kv_layout *src, const struct kv_layout *dst,
                         const struct kv_plan_config *cfg, kv_plan **out)
{
    if (!src || !dst || !out)
        return kv__error(KV_ERR_NULL, "kv_plan_create: %s is NULL",
                         !src   ? "src"
                         : !dst ? "dst"
                                : "out");
    *out = NULL;
    struct kv_plan_config c;
    kv_status st = kv__plan_resolve("kv_plan_create", src, dst, cfg, &c);
    if (st != KV_OK)
        return st;
    const int64_t nh = c.n_heads;
    const int64_t Ns = src->block_tokens, Nd = dst->block_tokens, g = gcd64(Ns, Nd);
    if (Ns / g > KV__PLAN_MAX_WINDOW / Nd)
        return kv__error(KV_ERR_BAD_SHAPE,
                         "kv_plan_create: page sizes %" PRId64 " and %" PRId64
                         " make a window of more than %d tokens",
                         Ns, Nd, KV__PLAN_MAX_WINDOW);
    /* L: the layers moved; layer l of the plan is c.src_layer0 + l of the
     * source and c.dst_layer0 + l of the destination */
    const int64_t W = Ns / g * Nd, L = c.n_layers;
    const int64_t P = src->k_only ? 1 : 2; /* planes moved: K (and V) */
    const int64_t row_bytes = src->head_dim * src->elem_bytes;
    /* Rows (32 bytes each), their lengths and the copies (64 bytes each) are
     * arrays of n_rows; the window is n_rows * row_bytes: none may wrap,
     * whatever layer and head counts two valid layouts name. */
    const size_t row_item = sizeof(struct kv__plan_copy) > sizeof(struct kv__row)
                                ? sizeof(struct kv__plan_copy)
                                : sizeof(struct kv__row);
    int64_t n_rows = 0, window_bytes = 0;
    if (!kv__mul_i64(L * P, W, &n_rows) || !kv__mul_i64(n_rows, nh, &n_rows) ||
        (uint64_t)n_rows > SIZE_MAX / row_item || !kv__mul_i64(n_rows, row_bytes, &window_bytes))
        return kv__error(KV_ERR_OVERFLOW,
                         "kv_plan_create: %" PRId64 " layers x %" PRId64 " planes x %" PRId64
                         " window tokens x %" PRId64 " heads of %" PRId64
                         " bytes: more rows or bytes than 64 bits hold",
                         L, P, W, nh, row_bytes);

    struct kv__row *rows = kv__mem_alloc((size_t)n_rows * sizeof(*rows));
    kv_plan *p = kv__mem_calloc(1, sizeof(*p));
    if (!rows || !p) {
        kv__mem_free(rows);
        kv__mem_free(p);
        return kv__error(KV_ERR_NO_MEMORY, "kv_plan_create: %" PRId64 " rows", n_rows);
    }
    /* Rows are made in the source's stride order (the loop over the dim with
     * the largest source stride outermost), so within one (source block,
     * destination block) pair they mostly come out sorted by src_rel; a
     * stable counting sort by pair then leaves only the unsorted pairs (if
     * any) to qsort. */
    const int64_t ext[4] = {L, P, W, nh};
    const int64_t sstr[4] = {src->stride_layer_bytes, src->stride_kv_bytes, src->stride_token_bytes,
                             src->stride_head_bytes};
    int ord[4] = {0, 1, 2, 3};
    for (int i = 1; i < 4; i++) /* by stride, descending; ties keep l, kv, t, h */
        for (int j = i; j > 0 && sstr[ord[j]] > sstr[ord[j - 1]]; j--) {
            const int x = ord[j];
            ord[j] = ord[j - 1];
            ord[j - 1] = x;
        }
    const int64_t ndb = W / Nd, n_pairs = (W / Ns) * ndb;
    struct kv__row *tmp = kv__mem_alloc((size_t)n_rows * sizeof(*tmp));
    int64_t *cnt = kv__mem_calloc((size_t)n_pairs + 1, sizeof(*cnt));
    if (!tmp || !cnt) {
        kv__mem_free(tmp);
        kv__mem_free(cnt);
        kv__mem_free(rows);
        kv__mem_free(p);
        return kv__error(KV_ERR_NO_MEMORY, "kv_plan_create: %" PRId64 " rows", n_rows);
    }
    int64_t r = 0, i4[4];
    for (i4[ord[0]] = 0; i4[ord[0]] < ext[ord[0]]; i4[ord[0]]++)
        for (i4[ord[1]] = 0; i4[ord[1]] < ext[ord[1]]; i4[ord[1]]++)
            for (i4[ord[2]] = 0; i4[ord[2]] < ext[ord[2]]; i4[ord[2]]++)
                for (i4[ord[3]] = 0; i4[ord[3]] < ext[ord[3]]; i4[ord[3]]++) {
                    const int64_t l = i4[0], t = i4[2], h = i4[3];
                    const int kv = (int)i4[1];
                    /* offsets of slot t % N in block 0: the block part is added per request */
                    struct kv__row *w = &tmp[r++];
                    w->ks = t / Ns;
                    w->kd = t / Nd;
                    w->src_rel =
                        kv_layout_slot_offset_bytes(src, (uint32_t)(c.src_layer0 + l), kv, t % Ns) +
                        (c.src_head0 + h) * src->stride_head_bytes;
                    w->dst_rel =
                        kv_layout_slot_offset_bytes(dst, (uint32_t)(c.dst_layer0 + l), kv, t % Nd) +
                        (c.dst_head0 + h) * dst->stride_head_bytes;
                    cnt[w->ks * ndb + w->kd + 1]++;
                }
    for (int64_t k = 0; k < n_pairs; k++)
        cnt[k + 1] += cnt[k];
    for (int64_t i = 0; i < n_rows; i++) /* stable: each pair keeps the made order */
        rows[cnt[tmp[i].ks * ndb + tmp[i].kd]++] = tmp[i];
    for (int64_t k = 0, at = 0; k < n_pairs; k++) { /* cnt[k] is now the end of pair k */
        bool sorted = true;
        for (int64_t i = at + 1; i < cnt[k] && sorted; i++)
            sorted = rows[i - 1].src_rel < rows[i].src_rel;
        if (!sorted)
            qsort(rows + at, (size_t)(cnt[k] - at), sizeof(*rows), row_cmp);
        at = cnt[k];
    }
    kv__mem_free(tmp);
    kv__mem_free(cnt);

    /* coalesce into runs (in place: run i = rows[i] with its length in len[i]) */
    int64_t *len = kv__mem_alloc((size_t)n_rows * sizeof(*len));
    p->copies = kv__mem_alloc((size_t)n_rows * sizeof(*p->copies));
    if (!len || !p->copies) {
        kv__mem_free(len);
        kv__mem_free(rows);
        kv_plan_destroy(p);
        return kv__error(KV_ERR_NO_MEMORY, "kv_plan_create: %" PRId64 " runs", n_rows);
    }
    int64_t n_runs = 0;
    for (int64_t i = 0; i < n_rows; i++) {
        if (n_runs > 0) {
            struct kv__row *q = &rows[n_runs - 1];
            if (q->ks == rows[i].ks && q->kd == rows[i].kd &&
                q->src_rel + len[n_runs - 1] == rows[i].src_rel &&
                q->dst_rel + len[n_runs - 1] == rows[i].dst_rel) {
                len[n_runs - 1] += row_bytes;
                continue;
            }
        }
        rows[n_runs] = rows[i];
        len[n_runs] = row_bytes;
        n_runs++;
    }
    /* group runs into 2-D copies: same blocks, same width, constant pitches */
    int64_t nc = 0;
    for (int64_t i = 0; i < n_runs; i++) {
        if (nc > 0) {
            struct kv__plan_copy *q = &p->copies[nc - 1];
            if (q->ks == rows[i].ks && q->kd == rows[i].kd && q->width == len[i]) {
                const int64_t sp = rows[i].src_rel - (q->src_rel + (q->height - 1) * q->src_pitch);
                const int64_t dp = rows[i].dst_rel - (q->dst_rel + (q->height - 1) * q->dst_pitch);
                if (q->height == 1 && sp >= q->width && dp >= q->width) {
                    q->src_pitch = sp;
                    q->dst_pitch = dp;
                    q->height = 2;
                    continue;
                }
                if (q->height > 1 && sp == q->src_pitch && dp == q->dst_pitch) {
                    q->height++;
                    continue;
                }
            }
        }
        p->copies[nc++] = (struct kv__plan_copy){
            rows[i].ks, rows[i].kd, rows[i].src_rel, rows[i].dst_rel, len[i], 1, len[i], len[i]};
    }
    kv__mem_free(len);
    kv__mem_free(rows);
    p->n_copies = nc;
    p->src = *src;
    p->dst = *dst;
    p->cfg = c;
    p->wire_layer0 = 0;
    p->stats = (struct kv_plan_stats){.window_tokens = W,
                                      .window_src_blocks = W / Ns,
                                      .window_dst_blocks = W / Nd,
                                      .rows = n_rows,
                                      .runs = n_runs,
                                      .copies = nc,
                                      .window_bytes = window_bytes};
    *out = p;
    return kv__ok();
}

void kv_plan_destroy(kv_plan *plan)
{
    if (!plan)
        return;
    kv__mem_free(plan->copies);
    kv__mem_free(plan);
}

kv_status kv_plan_stats_get(const kv_plan *plan, struct kv_plan_stats *out)
{
    if (!plan || !out)
        return kv__error(KV_ERR_NULL, "kv_plan_stats_get: %s is NULL", !plan ? "plan" : "out");
    *out = plan->stats;
    return kv__ok();
}

kv_status kv__plan_check_ids(const char *fn, const char *side, const uint32_t *ids, uint32_t n,
                             int64_t num_blocks)
{
    if (n > 0 && !ids)
        return kv__error(KV_ERR_NULL, "%s: %s_blocks is NULL", fn, side);
    if (n > 0) { /* read as words: misaligned is undefined behaviour */
        char name[32];
        snprintf(name, sizeof(name), "%s_blocks", side);
        const kv_status st = kv__check_aligned(fn, name, ids, sizeof(*ids));
        if (st != KV_OK)
            return st;
    }
    for (uint32_t i = 0; i < n; i++)
        if ((int64_t)ids[i] >= num_blocks)
            return kv__error(KV_ERR_OUT_OF_BOUNDS,
                             "%s: %s_blocks[%u] = %u, the %s cache has %" PRId64 " blocks", fn,
                             side, i, ids[i], side, num_blocks);
    return KV_OK;
}

static int u32_cmp(const void *a, const void *b)
{
    const uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return (x > y) - (x < y);
}

kv_status kv__plan_check_unique(const char *fn, const uint32_t *dids, uint32_t nd,
                                const uint32_t *sids, uint32_t ns)
{
    if (nd == 0)
        return KV_OK;
    /* a sorted copy of the destination ids: O((nd + ns) log nd) per request,
     * nothing proportional to the pool */
    uint32_t *sorted = kv__mem_alloc((size_t)nd * sizeof(*sorted));
    if (!sorted)
        return kv__error(KV_ERR_NO_MEMORY, "%s: %u block ids", fn, nd);
    memcpy(sorted, dids, (size_t)nd * sizeof(*sorted));
    qsort(sorted, nd, sizeof(*sorted), u32_cmp);
    kv_status st = KV_OK;
    for (uint32_t i = 1; i < nd && st == KV_OK; i++)
        if (sorted[i] == sorted[i - 1])
            st = kv__error(KV_ERR_OVERLAP, "%s: destination block %u listed twice", fn, sorted[i]);
    for (uint32_t i = 0; sids && i < ns && st == KV_OK; i++)
        if (bsearch(&sids[i], sorted, nd, sizeof(*sorted), u32_cmp))
            st = kv__error(KV_ERR_OVERLAP,
                           "%s: block %u is both a source and a destination of one "
                           "cache (src_blocks[%u])",
                           fn, sids[i], i);
    kv__mem_free(sorted);
    return st;
}

/* ids_dev: device-resident ids (kv_plan_copy_cuda_dev): non-NULL when n >
 * 0, never read. */
static kv_status check_side(const char *fn, const char *side, const struct kv_paged_cache *c,
                            const struct kv_layout *want, const uint32_t *ids, uint32_t n,
                            uint64_t need, bool cuda, bool ids_dev)
{
    kv_status st = kv_paged_check(c, cuda);
    if (st != KV_OK)
        return kv__error_wrap(st, "%s: %s cache", fn, side);
    if (c->layout.fingerprint != want->fingerprint)
        return kv__error(KV_ERR_INVALID_ARG,
                         "%s: %s cache layout fingerprint 0x%016" PRIx64
                         " is not the plan's 0x%016" PRIx64,
                         fn, side, c->layout.fingerprint, want->fingerprint);
    if (n != need)
        return kv__error(KV_ERR_BAD_SHAPE, "%s: %u %s blocks for a request that needs %" PRIu64, fn,
                         n, side, need);
    if (ids_dev)
        return n && !ids
                   ? kv__error(KV_ERR_NULL, "%s: %s_blocks_dev is NULL with %u blocks", fn, side, n)
                   : KV_OK;
    return kv__plan_check_ids(fn, side, ids, n, c->layout.num_blocks);
}

/* A destination block twice; with shared storage, a block on both sides. */
static kv_status check_blocks(const char *fn, const struct kv_paged_cache *src,
                              const uint32_t *sids, uint32_t ns, const struct kv_paged_cache *dst,
                              const uint32_t *dids, uint32_t nd)
{
    const uintptr_t sa = (uintptr_t)src->base, sb = sa + src->storage_bytes;
    const uintptr_t da = (uintptr_t)dst->base, db = da + dst->storage_bytes;
    const bool shared = sa == da && src->layout.fingerprint == dst->layout.fingerprint;
    if (!shared && sa < db && da < sb)
        return kv__error(KV_ERR_OVERLAP,
                         "%s: source storage [%p, %p) and destination storage [%p, %p) "
                         "overlap without being one cache",
                         fn, (void *)sa, (void *)sb, (void *)da, (void *)db);
    if (!sids && !dids && (ns || nd))
        return KV_OK; /* device-resident lists: not read */
    return kv__plan_check_unique(fn, dids, nd, shared ? sids : NULL, shared ? ns : 0);
}

kv_status kv__plan_check_request(const char *fn, const kv_plan *plan,
                                 const struct kv_paged_cache *src, const uint32_t *src_blocks,
                                 uint32_t n_src, const struct kv_paged_cache *dst,
                                 const uint32_t *dst_blocks, uint32_t n_dst, uint64_t n_tokens,
                                 bool cuda)
{
    if (!plan)
        return kv__error(KV_ERR_NULL, "%s: plan is NULL", fn);
    kv_status st;
    if ((st = check_side(fn, "src", src, &plan->src, src_blocks, n_src,
                         kv__plan_blocks(&plan->src, n_tokens), cuda, false)) != KV_OK ||
        (st = check_side(fn, "dst", dst, &plan->dst, dst_blocks, n_dst,
                         kv__plan_blocks(&plan->dst, n_tokens), cuda, false)) != KV_OK ||
        (st = check_blocks(fn, src, src_blocks, n_src, dst, dst_blocks, n_dst)) != KV_OK)
        return st;
    return KV_OK;
}

kv_status kv__plan_check_request_dev(const char *fn, const kv_plan *plan,
                                     const struct kv_paged_cache *src, const uint32_t *src_blocks,
                                     uint32_t n_src, const struct kv_paged_cache *dst,
                                     const uint32_t *dst_blocks, uint32_t n_dst, uint64_t n_tokens)
{
    if (!plan)
        return kv__error(KV_ERR_NULL, "%s: plan is NULL", fn);
    kv_status st;
    if ((st = check_side(fn, "src", src, &plan->src, src_blocks, n_src,
                         kv__plan_blocks(&plan->src, n_tokens), true, true)) != KV_OK ||
        (st = check_side(fn, "dst", dst, &plan->dst, dst_blocks, n_dst,
                         kv__plan_blocks(&plan->dst, n_tokens), true, true)) != KV_OK ||
        (st = check_blocks(fn, src, NULL, n_src, dst, NULL, n_dst)) != KV_OK)
        return st;
    return KV_OK;
}

kv_status kv_plan_copy(const kv_plan *plan, struct kv_paged_cache src, const uint32_t *src_blocks,
                       uint32_t n_src, struct kv_paged_cache dst, const uint32_t *dst_blocks,
                       uint32_t n_dst, uint64_t n_tokens)
{
    static const char fn[] = "kv_plan_copy";
    kv_status st = kv__plan_check_request(fn, plan, &src, src_blocks, n_src, &dst, dst_blocks,
                                          n_dst, n_tokens, false);
    if (st != KV_OK)
        return st;
    if (n_tokens == 0)
        return kv__ok();
    const char **sp = kv__mem_alloc(((size_t)n_src + n_dst) * sizeof(*sp));
    if (!sp)
        return kv__error(KV_ERR_NO_MEMORY, "%s: %u + %u block addresses", fn, n_src, n_dst);
    char **dp = (char **)(sp + n_src);
    for (uint32_t i = 0; i < n_src; i++)
        sp[i] = kv__plan_block_addr(&src, &plan->src, src_blocks[i]);
    for (uint32_t i = 0; i < n_dst; i++)
        dp[i] = kv__plan_block_addr(&dst, &plan->dst, dst_blocks[i]);
    /* the CPU executor (kv_pack_int.h): kv_threads() threads for 256 KiB
     * and more, streaming stores for a move of 8 MiB and more (the
     * destination is not read for ownership: 0.63-0.76 -> 0.90-1.03x a
     * 2-thread memcpy, docs/benchmarks.md) */
    const uint64_t bytes =
        n_tokens * (uint64_t)plan->stats.window_bytes / (uint64_t)plan->stats.window_tokens;
    kv__pack_exec(plan, sp, n_src, dp, n_dst, n_tokens, 0, kv__pack_use_nt(bytes), false);
    kv__mem_free(sp);
    return kv__ok();
}

bool kv__plan_is_sequential(const kv_plan *plan, int64_t total)
{
    if (plan->stats.window_src_blocks != 1 || plan->stats.window_dst_blocks != 1)
        return false;
    int64_t at = 0;
    for (int64_t i = 0; i < plan->n_copies; i++) {
        const struct kv__plan_copy *c = &plan->copies[i];
        if (c->dst_rel != at || (c->height > 1 && c->dst_pitch != c->width))
            return false;
        at += c->width * c->height;
    }
    return at == total;
}
