/*
 * bench_pack.c - pack and unpack in the wire format (connector/pack/kv_pack.h).
 *
 *   connector.pack          a 4,096-token request (256 blocks of 16 tokens,
 *                           random ids) of a Llama-3-8B-like cache (32
 *                           layers, 8 KV heads, D 128, bf16; NHD
 *                           layer-major: 512 MiB of K and V) into one
 *                           buffer: copy plus a per-block XXH3-64;
 *   connector.unpack        that buffer into a cache of the same layout:
 *                           header checks, then the copy, every block's
 *                           checksum taken in the same read of the payload;
 *   connector.pack_convert  the same buffer into an HND block-major cache
 *                           (the conversion runs on unpack).
 * Baseline: one memcpy of the same payload bytes, interleaved, given the
 * candidate's threads (kv_threads(), KVB_THREADS; `memcpy_t<n>`: n
 * contiguous parts, one memcpy per thread; `t<n>` in the case). Plans are
 * built once (kv_pack_plan_create / kv_unpack_plan_create), as an engine
 * would. The destination is checked at 4,096 random head rows against
 * kv_layout_offset on both sides before a case reports.
 */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "kv_pack.h"

static int kvb__pack_cache(struct kv_paged_cache *pc, int64_t blocks, kv_order order,
                           kv_arrange arr, uint64_t seed)
{
    struct kv_layout_config c = KV_LAYOUT_CONFIG_INIT;
    c.num_layers = 32;
    c.num_blocks = blocks;
    c.block_tokens = 16;
    c.num_heads = 8;
    c.head_dim = 128;
    c.dtype = KV_BF16;
    c.order = order;
    c.arrange = arr;
    if (kv_layout_init(&c, &pc->layout) != KV_OK)
        return -1;
    pc->base = kvb_alloc((size_t)pc->layout.total_bytes);
    pc->storage_bytes = (size_t)pc->layout.total_bytes;
    pc->mem = KV_MEM_HOST;
    kvb_fill_random(pc->base, pc->storage_bytes, seed);
    return 0;
}

/* 0 when 4,096 random head rows of dst are where the layouts say. */
static int kvb__rows_match(const struct kv_paged_cache *s, const uint32_t *sid,
                           const struct kv_paged_cache *d, const uint32_t *did, int64_t T)
{
    uint64_t seed = 23;
    for (int i = 0; i < 4096; i++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        const int64_t t = (int64_t)((seed >> 20) % (uint64_t)T);
        const uint32_t l = (uint32_t)((seed >> 8) % 32), h = (uint32_t)((seed >> 14) % 8);
        const int kv = (int)((seed >> 40) & 1);
        int64_t so = 0, dof = 0;
        if (kv_layout_offset(&s->layout, l, kv, sid[t / 16], (uint32_t)(t % 16), h, 0, &so) !=
                KV_OK ||
            kv_layout_offset(&d->layout, l, kv, did[t / 16], (uint32_t)(t % 16), h, 0, &dof) !=
                KV_OK ||
            memcmp((char *)s->base + so * 2, (char *)d->base + dof * 2, 256) != 0)
            return -1;
    }
    return 0;
}

enum kvb__pack_op { KVB_PACK, KVB_UNPACK };

static void kvb__pack_case(const char *bench, const char *name, enum kvb__pack_op op, kv_order dord,
                           kv_arrange darr, int64_t T, int threads)
{
    if (!kvb_selected(bench, name))
        return;
    kvb_progress(bench, name);
    const int64_t nb = T / 16;
    struct kv_paged_cache s = {0}, d = {0};
    kv_plan *pp = NULL, *up = NULL;
    uint32_t *sid = malloc((size_t)nb * sizeof(*sid)), *did = malloc((size_t)nb * sizeof(*did));
    char *buf = NULL, *ma = NULL, *mb = NULL;
    double *tc = NULL, *tb = NULL;
    uint64_t size = 0;
    if (!sid || !did || kvb__pack_cache(&s, nb + 64, KV_ORDER_NHD, KV_ARRANGE_LAYER_MAJOR, 3) ||
        kvb__pack_cache(&d, nb + 64, dord, darr, 4)) {
        kvb_failed(bench, name, "layout");
        goto out;
    }
    kvb_shuffle_ids(sid, (uint32_t)nb, (uint32_t)(nb + 64), 19);
    kvb_shuffle_ids(did, (uint32_t)nb, (uint32_t)(nb + 64), 29);
    kv_status st = kv_pack_plan_create(&s.layout, NULL, &pp);
    if (st == KV_OK)
        st = kv_unpack_plan_create(&s.layout, &d.layout, NULL, &up);
    if (st == KV_OK)
        st = kv_pack_size(&s.layout, NULL, (uint64_t)T, &size);
    if (st != KV_OK) {
        kvb_failed(bench, name, "%s (%s)", kv_status_name(st), kv_last_error());
        goto out;
    }
    buf = kvb_alloc((size_t)size);
    size_t len = 0;
    if ((st = kv_pack(pp, s, sid, (uint32_t)nb, (uint64_t)T, buf, (size_t)size, &len, NULL)) !=
        KV_OK) {
        kvb_failed(bench, name, "kv_pack: %s (%s)", kv_status_name(st), kv_last_error());
        goto out;
    }
    struct kv_pack_info info;
    if (kv_pack_inspect(buf, len, &info) != KV_OK) {
        kvb_failed(bench, name, "kv_pack_inspect: %s", kv_last_error());
        goto out;
    }
    const uint64_t bytes = info.payload_bytes;
    ma = kvb_alloc((size_t)bytes);
    mb = kvb_alloc((size_t)bytes);
    kvb_fill_random(ma, (size_t)bytes, 5);
    const int runs = kvb_runs();
    tc = malloc(sizeof(double) * (size_t)runs);
    tb = malloc(sizeof(double) * (size_t)runs);
    if (!tc || !tb)
        exit(2);
    for (int r = -1; r < runs; r++) { /* r = -1: warm-up */
        double t0 = kvb_now();
        st = op == KVB_PACK
                 ? kv_pack(pp, s, sid, (uint32_t)nb, (uint64_t)T, buf, (size_t)size, &len, NULL)
                 : kv_unpack(up, buf, len, d, did, (uint32_t)nb, NULL);
        double t1 = kvb_now();
        kvb_settle();
        const double t1b = kvb_now();
        kvb_memcpy_threads(mb, ma, (size_t)bytes, threads);
        double t2 = kvb_now();
        if (st != KV_OK) {
            kvb_failed(bench, name, "%s: %s (%s)", op == KVB_PACK ? "kv_pack" : "kv_unpack",
                       kv_status_name(st), kv_last_error());
            goto out;
        }
        if (r >= 0) {
            tc[r] = t1 - t0;
            tb[r] = t2 - t1b;
        }
    }
    kvb_sink((uint64_t)(unsigned char)mb[bytes / 2]);
    /* a pack case proves its buffer by unpacking it once */
    if (op == KVB_PACK && (st = kv_unpack(up, buf, len, d, did, (uint32_t)nb, NULL)) != KV_OK) {
        kvb_failed(bench, name, "kv_unpack: %s (%s)", kv_status_name(st), kv_last_error());
        goto out;
    }
    if (kvb__rows_match(&s, sid, &d, did, T) != 0)
        kvb_mismatch(bench, name, "a head row is not where the layouts say");
    char base[32];
    snprintf(base, sizeof(base), threads > 1 ? "memcpy_t%d" : "memcpy", threads);
    kvb_emit_gbps(bench, name, bytes, kvb_median(tc, runs), base, kvb_median(tb, runs), runs);
out:
    free(tc);
    free(tb);
    kv_plan_destroy(pp);
    kv_plan_destroy(up);
    free(sid);
    free(did);
    kvb_free(buf);
    kvb_free(ma);
    kvb_free(mb);
    kvb_free(s.base);
    kvb_free(d.base);
}

static void kvb__pack(void)
{
    const int64_t T = kvb_quick() ? 256 : 4096;
    const int t = kvb_threads();
    char name[160];
    snprintf(name, sizeof(name), "llama8b/bf16/N16/%lldtok/nhd-layer/t%d", (long long)T, t);
    kvb__pack_case("connector.pack", name, KVB_PACK, KV_ORDER_NHD, KV_ARRANGE_LAYER_MAJOR, T, t);
    kvb__pack_case("connector.unpack", name, KVB_UNPACK, KV_ORDER_NHD, KV_ARRANGE_LAYER_MAJOR, T,
                   t);
    snprintf(name, sizeof(name), "llama8b/bf16/N16/%lldtok/nhd-layer->hnd-block/t%d", (long long)T,
             t);
    kvb__pack_case("connector.pack_convert", name, KVB_UNPACK, KV_ORDER_HND, KV_ARRANGE_BLOCK_MAJOR,
                   T, t);
}

KVB_REGISTER("connector", kvb__pack)
