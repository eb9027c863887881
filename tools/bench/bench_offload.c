/*
 * bench_offload.c - the host offload tier (connector/offload/kv_offload.h).
 *
 *   offload.store   a 4,096-token request of a Llama-3-8B-like cache (32
 *                   layers, 8 KV heads, D 128, bf16: 512 MiB of K and V)
 *                   posted as one store of its blocks and waited for: the
 *                   worker copies each block into its entry and takes its
 *                   XXH3-64;
 *   offload.load    the same entries loaded back into newly allocated blocks
 *                   of the cache: checksum verified, copy, commit.
 * Cases vary the fragment a copy moves: layer-major caches with 1, 4, 16
 * and 64 tokens per block (each block is 2L runs of N x H x D x 2 bytes:
 * 2 KiB to 128 KiB, one 2-D copy) and a block-major cache (one run of a
 * whole 2 MiB block). docs/img/offload.png plots GB/s against the fragment
 * (scripts/plot_offload.py).
 * Baselines, interleaved: one memcpy of the same bytes given the tier's
 * copy threads (kv_threads(), KVB_THREADS; `memcpy_t<n>`: n contiguous
 * parts, one memcpy per thread; `t<n>` in the case); and for the store a
 * memcpy of its own runs (each block's per-layer K and V blocks, request
 * order) on one thread, the cost of the access pattern without the tier. Before a store run
 * the entries are evicted (outside the timing), so every run copies; after
 * a load run its blocks are released (outside). The last load is compared
 * with its source blocks byte for byte (every layer, K and V) before a case
 * reports.
 */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "kv_attn.h"
#include "kv_cache.h"
#include "kv_offload.h"

enum { KVB_OFF_WAIT_MS = 600000 };

struct kvb__off {
    kv_cache *cache;
    struct kv_paged_cache pc;
    kv_offload *off;
    uint32_t nb;
    uint32_t *src;    /* the request's blocks, committed under hashes */
    uint32_t *loaded; /* the last load's blocks */
    uint64_t *hashes;
};

static void kvb__off_free(struct kvb__off *o)
{
    kv_offload_destroy(o->off);
    kv_cache_destroy(o->cache);
    free(o->src);
    free(o->loaded);
    free(o->hashes);
}

static kv_status kvb__off_setup(struct kvb__off *o, int64_t N, kv_arrange arr, int64_t T)
{
    memset(o, 0, sizeof(*o));
    o->nb = (uint32_t)(T / N);
    struct kv_cache_config cc;
    kv_cache_config_init(&cc);
    cc.layout.num_layers = 32;
    cc.layout.num_blocks = 2 * (int64_t)o->nb + 2; /* sources + the loads' blocks */
    cc.layout.block_tokens = N;
    cc.layout.num_heads = 8;
    cc.layout.head_dim = 128;
    cc.layout.dtype = KV_BF16;
    cc.layout.order = KV_ORDER_NHD;
    cc.layout.arrange = arr;
    cc.max_seqs = 1;
    cc.enable_prefix_caching = true;
    kv_status st = kv_cache_create(&cc, &o->cache);
    if (st == KV_OK)
        st = kv_cache_paged(o->cache, &o->pc);
    if (st != KV_OK)
        return st;
    kvb_fill_random(o->pc.base, (size_t)o->pc.layout.total_bytes, 41);
    o->src = malloc(o->nb * sizeof(*o->src));
    o->loaded = malloc(o->nb * sizeof(*o->loaded));
    o->hashes = malloc(o->nb * sizeof(*o->hashes));
    uint32_t *all = malloc((2 * o->nb + 1) * sizeof(*all));
    if (!o->src || !o->loaded || !o->hashes || !all) {
        free(all);
        return KV_ERR_NO_MEMORY;
    }
    /* take every block, keep a shuffled half (spread over the pool) */
    kv_block_pool *pool = kv_cache_pool(o->cache);
    const uint32_t total = 2 * o->nb + 1;
    st = kv_block_pool_alloc(pool, total, all);
    if (st == KV_OK) {
        uint32_t *perm = malloc(total * sizeof(*perm));
        if (!perm) {
            free(all);
            return KV_ERR_NO_MEMORY;
        }
        kvb_shuffle_ids(perm, total, total, 53);
        for (uint32_t i = 0; i < o->nb; i++)
            o->src[i] = all[perm[i]];
        for (uint32_t i = o->nb; i < total && st == KV_OK; i++)
            st = kv_block_pool_release(pool, &all[perm[i]], 1);
        free(perm);
    }
    for (uint32_t i = 0; i < o->nb && st == KV_OK; i++) {
        o->hashes[i] = 0x9E3779B97F4A7C15ull * (i + 1);
        st = kv_block_pool_commit_hash(pool, o->src[i], o->hashes[i], NULL);
    }
    free(all);
    if (st != KV_OK)
        return st;
    struct kv_offload_config oc = KV_OFFLOAD_CONFIG_INIT;
    /* room for every entry: each takes its size class (at most a quarter
     * more than its bytes) and, for a large one, a page (docs/connector.md,
     * "Capacity and LRU") */
    const size_t eb = (size_t)(o->pc.layout.kv_planes * 32) * (size_t)o->pc.layout.block_bytes;
    oc.capacity_bytes = (size_t)o->nb * (eb + eb / 4 + 4096);
    oc.mem = KV_OFFLOAD_MEM_AUTO;
    return kv_offload_create(&oc, &o->off);
}

static kv_status kvb__off_run(kv_offload_op *op)
{
    kv_offload_state s;
    kv_status st = kv_offload_wait(op, KVB_OFF_WAIT_MS, &s);
    if (st == KV_OK && s != KV_OFFLOAD_DONE) { /* report the first failed entry */
        const struct kv_offload_result *res;
        uint32_t n;
        st = KV_ERR_INTERNAL;
        if (kv_offload_results(op, &res, &n) == KV_OK)
            for (uint32_t i = 0; i < n; i++)
                if (res[i].status != KV_OK) {
                    fprintf(stderr, "kvbench offload: op %s, entry %u of %u: %s\n",
                            kv_offload_state_name(s), i, n, kv_status_name(res[i].status));
                    st = res[i].status;
                    break;
                }
    }
    if (st != KV_OK && kv_offload_cancel(op) == KV_OK &&
        kv_offload_wait(op, KVB_OFF_WAIT_MS, NULL) != KV_OK)
        exit(2); /* an op that never ends: nothing sane to report */
    return st;
}

static kv_status kvb__off_store(struct kvb__off *o)
{
    kv_offload_op *op = NULL;
    kv_status st = kv_offload_store(o->off, o->cache, o->src, o->nb, &op);
    if (st == KV_OK)
        st = kvb__off_run(op);
    if (op && kv_offload_op_free(op) != KV_OK)
        st = KV_ERR_INTERNAL;
    return st;
}

static kv_status kvb__off_load(struct kvb__off *o)
{
    kv_offload_op *op = NULL;
    kv_status st = kv_offload_load(o->off, o->cache, o->hashes, o->nb, &op);
    if (st == KV_OK)
        st = kvb__off_run(op);
    if (st == KV_OK) {
        const struct kv_offload_result *res;
        uint32_t n;
        st = kv_offload_results(op, &res, &n);
        for (uint32_t i = 0; st == KV_OK && i < n; i++)
            o->loaded[i] = res[i].block;
    }
    if (op && kv_offload_op_free(op) != KV_OK)
        st = KV_ERR_INTERNAL;
    return st;
}

/* 0 when every loaded block equals its source, every layer, K and V. */
static int kvb__off_check(const struct kvb__off *o)
{
    const struct kv_layout *lo = &o->pc.layout;
    for (uint32_t i = 0; i < o->nb; i++)
        for (uint32_t l = 0; l < (uint32_t)lo->num_layers; l++)
            for (int kv = 0; kv < lo->kv_planes; kv++) {
                int64_t so = 0, dof = 0;
                if (kv_layout_offset(lo, l, kv, o->src[i], 0, 0, 0, &so) != KV_OK ||
                    kv_layout_offset(lo, l, kv, o->loaded[i], 0, 0, 0, &dof) != KV_OK ||
                    memcmp((char *)o->pc.base + so * lo->elem_bytes,
                           (char *)o->pc.base + dof * lo->elem_bytes, (size_t)lo->block_bytes) != 0)
                    return -1;
            }
    return 0;
}

static void kvb__off_case(int64_t N, kv_arrange arr, int64_t T, int threads)
{
    char name[160];
    const int64_t frag = arr == KV_ARRANGE_LAYER_MAJOR ? N * 8 * 128 * 2 : 32 * 2 * N * 8 * 128 * 2;
    snprintf(name, sizeof(name), "llama8b/bf16/N%lld/%lldtok/%s/frag%lldKiB/t%d", (long long)N,
             (long long)T, arr == KV_ARRANGE_LAYER_MAJOR ? "nhd-layer" : "nhd-block",
             (long long)(frag >> 10), threads);
    const bool do_store = kvb_selected("offload.store", name),
               do_load = kvb_selected("offload.load", name);
    if (!do_store && !do_load)
        return;
    kvb_progress("offload", name);
    struct kvb__off o;
    const int runs = kvb_runs();
    double *ts = calloc((size_t)runs, sizeof(double)), *tl = calloc((size_t)runs, sizeof(double));
    double *bs = calloc((size_t)runs, sizeof(double)), *bl = calloc((size_t)runs, sizeof(double));
    double *br = calloc((size_t)runs, sizeof(double));
    const char **runs_src = NULL;
    char *ma = NULL, *mb = NULL;
    kv_status st = kvb__off_setup(&o, N, arr, T);
    const uint64_t bytes =
        (uint64_t)o.nb * (uint64_t)(o.pc.layout.kv_planes * 32) * (uint64_t)o.pc.layout.block_bytes;
    if (!ts || !tl || !bs || !bl || !br)
        exit(2);
    if (st != KV_OK) {
        kvb_failed("offload.store", name, "setup: %s (%s)", kv_status_name(st), kv_last_error());
        goto out;
    }
    ma = kvb_alloc((size_t)bytes);
    mb = kvb_alloc((size_t)bytes);
    kvb_fill_random(ma, (size_t)bytes, 5);
    /* the second baseline: memcpy of the store's own runs (every block's
     * layer and plane blocks, in request order) on one thread: the price of
     * the access pattern alone, without the tier */
    const struct kv_layout *lo = &o.pc.layout;
    const int64_t n_runs = (int64_t)o.nb * lo->num_layers * lo->kv_planes;
    runs_src = malloc((size_t)n_runs * sizeof(*runs_src));
    if (!runs_src)
        exit(2);
    for (uint32_t i = 0, r = 0; i < o.nb; i++)
        for (uint32_t l = 0; l < (uint32_t)lo->num_layers; l++)
            for (int kv = 0; kv < lo->kv_planes; kv++, r++) {
                int64_t so = 0;
                if (kv_layout_offset(lo, l, kv, o.src[i], 0, 0, 0, &so) != KV_OK)
                    exit(2);
                runs_src[r] = (const char *)o.pc.base + so * lo->elem_bytes;
            }
    kv_block_pool *pool = kv_cache_pool(o.cache);
    for (int r = -1; r < runs; r++) { /* r = -1: warm-up */
        uint32_t ne = 0;
        if ((st = kv_offload_evict(o.off, o.hashes, o.nb, &ne)) != KV_OK)
            break;
        double t0 = kvb_now();
        st = kvb__off_store(&o);
        double t1 = kvb_now();
        kvb_settle();
        const double t1b = kvb_now();
        kvb_memcpy_threads(mb, ma, (size_t)bytes, threads);
        double t2 = kvb_now();
        if (st != KV_OK)
            break;
        st = kvb__off_load(&o);
        double t3 = kvb_now();
        kvb_settle();
        const double t3b = kvb_now();
        kvb_memcpy_threads(ma, mb, (size_t)bytes, threads);
        double t4 = kvb_now();
        for (int64_t r2 = 0; r2 < n_runs; r2++)
            memcpy(mb + r2 * lo->block_bytes, runs_src[r2], (size_t)lo->block_bytes);
        double t5 = kvb_now();
        if (st != KV_OK)
            break;
        if (r == runs - 1 && kvb__off_check(&o) != 0)
            kvb_mismatch(do_load ? "offload.load" : "offload.store", name,
                         "a loaded block differs from its source");
        if ((st = kv_block_pool_release(pool, o.loaded, o.nb)) != KV_OK)
            break;
        if (r >= 0) {
            ts[r] = t1 - t0;
            bs[r] = t2 - t1b;
            tl[r] = t3 - t2;
            bl[r] = t4 - t3b;
            br[r] = t5 - t4;
        }
    }
    kvb_sink((uint64_t)(unsigned char)mb[bytes / 2]);
    if (st != KV_OK) {
        kvb_failed("offload.store", name, "%s (%s)", kv_status_name(st), kv_last_error());
        goto out;
    }
    char base[32];
    snprintf(base, sizeof(base), threads > 1 ? "memcpy_t%d" : "memcpy", threads);
    if (do_store) {
        kvb_emit_gbps("offload.store", name, bytes, kvb_median(ts, runs), base,
                      kvb_median(bs, runs), runs);
        kvb_emit_gbps("offload.store", name, bytes, kvb_median(ts, runs), "memcpy_runs_1thread",
                      kvb_median(br, runs), runs);
    }
    if (do_load)
        kvb_emit_gbps("offload.load", name, bytes, kvb_median(tl, runs), base, kvb_median(bl, runs),
                      runs);
out:
    kvb__off_free(&o);
    kvb_free(ma);
    kvb_free(mb);
    free(ts);
    free(tl);
    free(bs);
    free(bl);
    free(br);
    free(runs_src);
}

static void kvb__offload(void)
{
    const int64_t T = kvb_quick() ? 256 : 4096;
    static const int64_t Ns[] = {1, 4, 16, 64};
    const int t = kvb_threads();
    for (size_t i = 0; i < sizeof(Ns) / sizeof(Ns[0]); i++)
        kvb__off_case(Ns[i], KV_ARRANGE_LAYER_MAJOR, T, t);
    kvb__off_case(16, KV_ARRANGE_BLOCK_MAJOR, T, t);
}

KVB_REGISTER("offload", kvb__offload)
