/*
 * bench_plan.c - transfer plans executed on the CPU (connector/kv_plan.h).
 *
 *   connector.copy   a 4,096-token request (256 blocks of 16 tokens) of a
 *                    Llama-3-8B-like cache (32 layers, 8 KV heads, D 128,
 *                    bf16: 512 MiB of K and V) from one cache to another,
 *                    blocks in random order far from 0: the same layout, NHD
 *                    layer-major -> HND block-major, and 16-token -> 32-token
 *                    pages; vs one memcpy of the same bytes.
 *
 * The destination is checked at 4,096 random (token, layer, K/V, head) rows
 * against kv_layout_offset on both sides before the case reports.
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

static void kvb__shuffle(uint32_t *ids, uint32_t n, uint32_t B, uint64_t seed)
{
    uint32_t *all = malloc((size_t)B * sizeof(*all));
    if (!all)
        exit(2);
    for (uint32_t i = 0; i < B; i++)
        all[i] = i;
    for (uint32_t i = 0; i < n; i++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        const uint32_t j = i + (uint32_t)((seed >> 33) % (B - i));
        const uint32_t t = all[i];
        all[i] = all[j];
        all[j] = t;
        ids[i] = all[i];
    }
    free(all);
}

static void kvb__copy_case(const char *name, int64_t Nd, kv_order dord, kv_arrange darr, int64_t T)
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
    kvb__shuffle(sid, (uint32_t)ns, (uint32_t)(ns + 64), 11);
    kvb__shuffle(did, (uint32_t)nd, (uint32_t)(nd + 64), 13);
    const int runs = kvb_runs();
    double *tc = malloc(sizeof(double) * (size_t)runs), *tb = malloc(sizeof(double) * (size_t)runs);
    if (!tc || !tb)
        exit(2);
    for (int r = -1; r < runs; r++) { /* r = -1: warm-up */
        double t0 = kvb_now();
        st = kv_plan_copy(p, s.pc, sid, (uint32_t)ns, d.pc, did, (uint32_t)nd, (uint64_t)T);
        double t1 = kvb_now();
        memcpy(mb, ma, bytes);
        double t2 = kvb_now();
        if (st != KV_OK) {
            kvb_failed(bench, name, "kv_plan_copy: %s (%s)", kv_status_name(st), kv_last_error());
            free(tc);
            free(tb);
            goto out;
        }
        if (r >= 0) {
            tc[r] = t1 - t0;
            tb[r] = t2 - t1;
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
    kvb_emit_gbps(bench, name, bytes, kvb_median(tc, runs), "memcpy", kvb_median(tb, runs), runs);
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

static void kvb__plan(void)
{
    const int64_t T = kvb_quick() ? 256 : 4096;
    char name[160];
    snprintf(name, sizeof(name), "llama8b/bf16/N16/%lldtok/nhd-layer->nhd-layer", (long long)T);
    kvb__copy_case(name, 16, KV_ORDER_NHD, KV_ARRANGE_LAYER_MAJOR, T);
    snprintf(name, sizeof(name), "llama8b/bf16/N16/%lldtok/nhd-layer->hnd-block", (long long)T);
    kvb__copy_case(name, 16, KV_ORDER_HND, KV_ARRANGE_BLOCK_MAJOR, T);
    snprintf(name, sizeof(name), "llama8b/bf16/N16->N32/%lldtok/nhd-layer->nhd-layer",
             (long long)T);
    kvb__copy_case(name, 32, KV_ORDER_NHD, KV_ARRANGE_LAYER_MAJOR, T);
}

KVB_REGISTER("connector", kvb__plan)
