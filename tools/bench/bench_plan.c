/*
 * bench_plan.c - transfer plans executed on the CPU (connector/plan/kv_plan.h).
 *
 *   connector.copy   a 4,096-token request (256 blocks of 16 tokens) of a
 *                    Llama-3-8B-like cache (32 layers, 8 KV heads, D 128,
 *                    bf16: 512 MiB of K and V) from one cache to another,
 *                    blocks in random order far from 0: the same layout, NHD
 *                    layer-major -> HND block-major, and 16-token -> 32-token
 *                    pages; vs one memcpy of the same bytes given the
 *                    copy's threads (kv_threads(), KVB_THREADS;
 *                    `memcpy_t<n>`: n contiguous parts, one memcpy per
 *                    thread; `t<n>` in the case), interleaved.
 *
 * The destination is checked at 4,096 random (token, layer, K/V, head) rows
 * against kv_layout_offset on both sides before the case reports.
 *
 *   plan.build       kv_plan_create for the same shape, plus the per-request
 *                    part of a 131,072-token request (the 8,192 + 8,192
 *                    block start addresses kv_plan_copy builds), in us.
 *                    Baseline "row_offsets_floor": only enumerating the
 *                    window's head rows with kv_layout_elem_offset on both
 *                    sides (no sort, no coalescing, no request part): not an
 *                    alternative but the floor of any plan, so its ratio is
 *                    < 1 by construction. The plan's row count is checked
 *                    against the enumeration.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "kv_plan.h"

struct kvb__side {
    struct kv_layout lo;
    char *mem;
    struct kv_paged_cache pc;
};

static int kvb__side(struct kvb__side *s, int64_t blocks, int64_t N, kv_order order, kv_arrange arr)
{
    struct kv_layout_config c = KV_LAYOUT_CONFIG_INIT;
    c.num_layers = 32;
    c.num_blocks = blocks;
    c.block_tokens = N;
    c.num_heads = 8;
    c.head_dim = 128;
    c.dtype = KV_BF16;
    c.order = order;
    c.arrange = arr;
    if (kv_layout_init(&c, &s->lo) != KV_OK)
        return -1;
    s->mem = kvb_alloc((size_t)s->lo.total_bytes);
    kvb_fill_random(s->mem, (size_t)s->lo.total_bytes, (uint64_t)blocks * 7 + (uint64_t)N);
    s->pc = (struct kv_paged_cache){s->lo, s->mem, (size_t)s->lo.total_bytes, KV_MEM_HOST};
    return 0;
}

static void kvb__copy_case(const char *name, int64_t Nd, kv_order dord, kv_arrange darr, int64_t T,
                           int threads)
{
    static const char bench[] = "connector.copy";
    if (!kvb_selected(bench, name))
        return;
    kvb_progress(bench, name);
    const int64_t Ns = 16, ns = T / Ns, nd = T / Nd;
    struct kvb__side s, d;
    if (kvb__side(&s, ns + 64, Ns, KV_ORDER_NHD, KV_ARRANGE_LAYER_MAJOR) ||
        kvb__side(&d, nd + 64, Nd, dord, darr)) {
        kvb_failed(bench, name, "layout");
        return;
    }
    kv_plan *p = NULL;
    kv_status st = kv_plan_create(&s.lo, &d.lo, NULL, &p);
    uint32_t *sid = malloc((size_t)ns * sizeof(*sid)), *did = malloc((size_t)nd * sizeof(*did));
    const uint64_t bytes = (uint64_t)T * 32 * 2 * 8 * 128 * 2;
    char *ma = kvb_alloc(bytes), *mb = kvb_alloc(bytes);
    if (st != KV_OK || !sid || !did) {
        kvb_failed(bench, name, "kv_plan_create: %s (%s)", kv_status_name(st), kv_last_error());
        goto out;
    }
    kvb_fill_random(ma, bytes, 5);
    kvb_shuffle_ids(sid, (uint32_t)ns, (uint32_t)(ns + 64), 11);
    kvb_shuffle_ids(did, (uint32_t)nd, (uint32_t)(nd + 64), 13);
    const int runs = kvb_runs();
    double *tc = malloc(sizeof(double) * (size_t)runs), *tb = malloc(sizeof(double) * (size_t)runs);
    if (!tc || !tb)
        exit(2);
    for (int r = -1; r < runs; r++) { /* r = -1: warm-up */
        double t0 = kvb_now();
        st = kv_plan_copy(p, s.pc, sid, (uint32_t)ns, d.pc, did, (uint32_t)nd, (uint64_t)T);
        double t1 = kvb_now();
        kvb_settle();
        const double t1b = kvb_now();
        kvb_memcpy_threads(mb, ma, (size_t)bytes, threads);
        double t2 = kvb_now();
        if (st != KV_OK) {
            kvb_failed(bench, name, "kv_plan_copy: %s (%s)", kv_status_name(st), kv_last_error());
            free(tc);
            free(tb);
            goto out;
        }
        if (r >= 0) {
            tc[r] = t1 - t0;
            tb[r] = t2 - t1b;
        }
    }
    kvb_sink((uint64_t)(unsigned char)mb[bytes / 2]);
    /* check rows against kv_layout_offset on both sides */
    uint64_t seed = 17;
    for (int i = 0; i < 4096; i++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        const int64_t t = (int64_t)((seed >> 20) % (uint64_t)T);
        const uint32_t l = (uint32_t)((seed >> 8) % 32), h = (uint32_t)((seed >> 14) % 8);
        const int kv = (int)((seed >> 40) & 1);
        int64_t so = 0, dof = 0;
        if (kv_layout_offset(&s.lo, l, kv, sid[t / Ns], (uint32_t)(t % Ns), h, 0, &so) != KV_OK ||
            kv_layout_offset(&d.lo, l, kv, did[t / Nd], (uint32_t)(t % Nd), h, 0, &dof) != KV_OK ||
            memcmp(s.mem + so * 2, d.mem + dof * 2, 256) != 0) {
            kvb_mismatch(bench, name, "token %lld layer %u kv %d head %u not where the layout says",
                         (long long)t, l, kv, h);
            break;
        }
    }
    char base[32];
    snprintf(base, sizeof(base), threads > 1 ? "memcpy_t%d" : "memcpy", threads);
    kvb_emit_gbps(bench, name, bytes, kvb_median(tc, runs), base, kvb_median(tb, runs), runs);
    free(tc);
    free(tb);
out:
    kv_plan_destroy(p);
    free(sid);
    free(did);
    kvb_free(ma);
    kvb_free(mb);
    kvb_free(s.mem);
    kvb_free(d.mem);
}

static void kvb__build_case(const char *name, int64_t Nd, kv_order dord, kv_arrange darr,
                            int64_t heads)
{
    static const char bench[] = "plan.build";
    if (!kvb_selected(bench, name))
        return;
    kvb_progress(bench, name);
    struct kv_layout_config c = KV_LAYOUT_CONFIG_INIT;
    c.num_layers = 32;
    c.num_blocks = 8192 + 64;
    c.block_tokens = 16;
    c.num_heads = 8;
    c.head_dim = 128;
    c.dtype = KV_BF16;
    struct kv_layout s, d;
    kv_status st = kv_layout_init(&c, &s);
    c.block_tokens = Nd;
    c.order = dord;
    c.arrange = darr;
    c.num_heads = heads;
    if (st == KV_OK)
        st = kv_layout_init(&c, &d);
    struct kv_plan_config pc = KV_PLAN_CONFIG_INIT;
    pc.n_heads = heads == 8 ? 0 : heads;
    pc.src_head0 = heads == 8 ? 0 : 8 - heads;
    const int64_t T = 131072, ns = T / 16, nd = T / Nd;
    char **addr = malloc((size_t)(ns + nd) * sizeof(*addr));
    uint32_t *ids = malloc((size_t)(ns > nd ? ns : nd) * sizeof(*ids));
    const int runs = kvb_runs();
    double *tc = malloc(sizeof(double) * (size_t)runs), *tb = malloc(sizeof(double) * (size_t)runs);
    if (st != KV_OK || !addr || !ids || !tc || !tb) {
        kvb_failed(bench, name, "setup: %s", kv_status_name(st));
        goto out;
    }
    kvb_shuffle_ids(ids, (uint32_t)(ns > nd ? ns : nd), (uint32_t)(8192 + 64), 31);
    char *base = (char *)(uintptr_t)4096; /* addresses only: never dereferenced */
    const int64_t W = Nd > 16 ? Nd : 16, nh = heads;
    uint64_t acc = 0;
    for (int r = -1; r < runs; r++) {
        double t0 = kvb_now();
        kv_plan *p = NULL;
        st = kv_plan_create(&s, &d, &pc, &p);
        for (int64_t i = 0; i < ns; i++)
            addr[i] = base + (int64_t)ids[i] * s.stride_block_bytes;
        for (int64_t i = 0; i < nd; i++)
            addr[ns + i] = base + (int64_t)ids[i] * d.stride_block_bytes;
        double t1 = kvb_now();
        int64_t rows = 0;
        for (uint32_t l = 0; l < 32; l++)
            for (int kv = 0; kv < 2; kv++)
                for (int64_t t = 0; t < W; t++)
                    for (int64_t h = 0; h < nh; h++) {
                        acc += (uint64_t)kv_layout_elem_offset(&s, l, kv, (uint32_t)(t / 16),
                                                               (uint32_t)(t % 16),
                                                               (uint32_t)(pc.src_head0 + h), 0);
                        acc += (uint64_t)kv_layout_elem_offset(&d, l, kv, (uint32_t)(t / Nd),
                                                               (uint32_t)(t % Nd), (uint32_t)h, 0);
                        rows++;
                    }
        double t2 = kvb_now();
        struct kv_plan_stats ps;
        if (st != KV_OK || kv_plan_stats_get(p, &ps) != KV_OK) {
            kvb_failed(bench, name, "kv_plan_create: %s (%s)", kv_status_name(st), kv_last_error());
            kv_plan_destroy(p);
            goto out;
        }
        if (ps.rows != rows) {
            kvb_mismatch(bench, name, "plan rows %lld, the window has %lld", (long long)ps.rows,
                         (long long)rows);
            kv_plan_destroy(p);
            goto out;
        }
        kv_plan_destroy(p);
        if (r >= 0) {
            tc[r] = (t1 - t0) * 1e6;
            tb[r] = (t2 - t1) * 1e6;
        }
    }
    kvb_sink(acc ^ (uint64_t)(uintptr_t)addr[ns / 2]);
    kvb_emit_us(bench, name, kvb_median(tc, runs), "row_offsets_floor", kvb_median(tb, runs), runs);
out:
    free(addr);
    free(ids);
    free(tc);
    free(tb);
}

static void kvb__plan(void)
{
    const int64_t T = kvb_quick() ? 256 : 4096;
    const int t = kvb_threads();
    char name[160];
    snprintf(name, sizeof(name), "llama8b/bf16/N16/%lldtok/nhd-layer->nhd-layer/t%d", (long long)T,
             t);
    kvb__copy_case(name, 16, KV_ORDER_NHD, KV_ARRANGE_LAYER_MAJOR, T, t);
    snprintf(name, sizeof(name), "llama8b/bf16/N16/%lldtok/nhd-layer->hnd-block/t%d", (long long)T,
             t);
    kvb__copy_case(name, 16, KV_ORDER_HND, KV_ARRANGE_BLOCK_MAJOR, T, t);
    snprintf(name, sizeof(name), "llama8b/bf16/N16->N32/%lldtok/nhd-layer->nhd-layer/t%d",
             (long long)T, t);
    kvb__copy_case(name, 32, KV_ORDER_NHD, KV_ARRANGE_LAYER_MAJOR, T, t);
    kvb__build_case("llama8b/bf16/131072tok/nhd-layer->nhd-layer", 16, KV_ORDER_NHD,
                    KV_ARRANGE_LAYER_MAJOR, 8);
    kvb__build_case("llama8b/bf16/131072tok/nhd-layer->hnd-block", 16, KV_ORDER_HND,
                    KV_ARRANGE_BLOCK_MAJOR, 8);
    kvb__build_case("llama8b/bf16/131072tok/N16->N32", 32, KV_ORDER_NHD, KV_ARRANGE_LAYER_MAJOR, 8);
    kvb__build_case("llama8b/bf16/131072tok/heads4-7->4-head-hnd", 16, KV_ORDER_HND,
                    KV_ARRANGE_LAYER_MAJOR, 4);
}

KVB_REGISTER("connector", kvb__plan)
