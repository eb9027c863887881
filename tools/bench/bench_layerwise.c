/*
 * bench_layerwise.c - layer-by-layer transfer (connector/transport/
 * kv_xport_layers.h) against whole-request transfer, over TCP loopback, both
 * ends in this process (each transport with its own progress thread; a
 * decode thread polls the notifications and feeds them to the tracker).
 *
 *   transport.layerwise   a 2,048-token request of a Llama-3-8B-shaped cache
 *                         (32 layers, 8 KV heads, D 128, bf16, NHD
 *                         layer-major, 16-token pages: 8 MiB of K and V per
 *                         layer, 256 MiB in all) into a decode cache of the
 *                         same layout at other block ids. Prefill "computes"
 *                         each layer (busy work of c seconds on the prefill
 *                         thread, c = the median time of one layer's
 *                         transfer measured first in this run), then:
 *     candidate           posts that layer at once (kv_xlayer_tx_post, one
 *                         write per layer with its LAYERS notification);
 *     baseline            computes all 32 layers, then posts the request as
 *                         one kv_xport_write_plan of every layer with one
 *                         notification (the same tracker, one group of 32).
 *                         Timed from prefill's start until the decode thread
 *                         holds the last layer (kv_xlayer_rx_wait on layer
 *                         31 answers KV_OK), interleaved, medians.
 *                         ratio = baseline / candidate (speedup); the goal
 *                         is candidate <= 0.6 x baseline (ratio >= 1.67).
 *                         compute=spin keeps a CPU busy (a CPU-bound
 *                         prefill: it takes a core from the transport on a
 *                         small machine); compute=wait sleeps (a GPU
 *                         computes while the CPU is free to move bytes).
 *                         Both follow one timeline from the request's start
 *                         t0: layer l is computed at t0 + (l + 1) c, in
 *                         either mode, so both compute for 32 c in all. A
 *                         GPU does not stop while the thread that posts
 *                         waits for a core, and a time-based spin forgives
 *                         a preemption inside a layer: timing each layer
 *                         from the end of the previous post instead (as
 *                         before 2026-12-04 evening) charged the candidate
 *                         32 wake-ups against the baseline's one (4-25 ms
 *                         with compute=wait, up to 150 ms with spin, on a
 *                         loaded 2-core machine: docs/benchmarks.md, "where
 *                         the time goes"). What the posts cost the
 *                         prefill thread is printed on stderr (median of
 *                         the candidate's runs, all 32 posts of a request).
 * After the runs the whole decode pool is compared byte by byte with a
 * kv_plan_copy of the request into a copy of its initial bytes.
 */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench.h"
#include "kv_plan.h"
#include "kv_transport.h"
#include "kv_xport_layers.h"

#define TOKEN 0x1A7E4ull
#define LAYERS 32u

struct lw {
    struct kv_layout slo, dlo;
    char *src, *dst;
    uint32_t *sid, *did;
    uint32_t n;
    uint64_t T;
    kv_plan *whole, *layer[LAYERS];
    kv_xport *xa, *xb;
    kv_xport_peer *pa, *pb;
    kv_xport_mem *ms, *md;
    kv_xport_rmem *r;
    kv_xlayer_tx *tx;
    kv_xlayer_rx *rx;
};

struct dec {
    struct lw *w;
    uint64_t req;
    uint32_t last;
    double t_end;
    kv_status st;
};

/* The decode thread: feed notifications until the request's last layer
 * is there. */
static void *decode_thread(void *arg)
{
    struct dec *d = arg;
    struct kv_xport_msg *m = malloc(sizeof(*m));
    d->st = m ? KV_OK : KV_ERR_NO_MEMORY;
    while (d->st == KV_OK) {
        d->st = kv_xport_notify_poll(d->w->xb, 60000, m);
        if (d->st == KV_OK)
            d->st = kv_xlayer_rx_feed(d->w->rx, m);
        if (d->st == KV_OK && kv_xlayer_rx_wait(d->w->rx, d->req, d->last, 0) == KV_OK)
            break;
    }
    d->t_end = kvb_now();
    free(m);
    return NULL;
}

/* Prefill computes until `end` (kvb_now's clock, CLOCK_MONOTONIC): sleeps
 * (wait) or keeps this CPU busy (spin); at once when end has passed. */
static void compute_until(double end, bool spin)
{
    if (!spin) {
        const struct timespec ts = {(time_t)end, (long)((end - (double)(time_t)end) * 1e9)};
        while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
        }
        return;
    }
    uint64_t x = 1;
    while (kvb_now() < end)
        for (int i = 0; i < 256; i++)
            x = x * 6364136223846793005ull + 1442695040888963407ull;
    kvb_sink(x);
}

/* One request: n_layers decoder layers, posted as `groups` groups of
 * LAYERS / groups (group g once its layers are computed, at t0 + (g + 1)
 * x c x LAYERS / groups) or, with groups == 0, one layer-0 calibration
 * write without compute. Seconds from the start until decode holds the
 * last layer; < 0 on failure. *post_s: seconds spent in the posts. */
static double one_request(struct lw *w, uint64_t req, uint32_t groups, double c, bool spin,
                          double *post_s)
{
    const uint32_t nl = groups ? LAYERS : 1;
    if (kv_xlayer_rx_expect(w->rx, kv_xport_peer_id(w->pb), req, nl) != KV_OK ||
        kv_xlayer_tx_begin(w->tx, w->pa, req, nl) != KV_OK)
        return -1;
    struct dec d = {.w = w, .req = req, .last = nl - 1};
    pthread_t th;
    if (pthread_create(&th, NULL, decode_thread, &d) != 0)
        return -1;
    const double t0 = kvb_now();
    kv_status st = KV_OK;
    if (groups == 0) {
        st = kv_xlayer_tx_post(w->tx, req, w->layer[0], 0, 1, w->ms, 0, w->sid, w->n, w->r, 0,
                               w->did, w->n, w->T);
    } else {
        const uint32_t per = LAYERS / groups;
        double in_post = 0;
        for (uint32_t g = 0; g < groups && st == KV_OK; g++) {
            compute_until(t0 + c * (double)(per * (g + 1)), spin);
            const double p0 = kvb_now();
            st = kv_xlayer_tx_post(w->tx, req, per == 1 ? w->layer[g] : w->whole, g * per, per,
                                   w->ms, 0, w->sid, w->n, w->r, 0, w->did, w->n, w->T);
            in_post += kvb_now() - p0;
        }
        if (post_s)
            *post_s = in_post;
    }
    if (st != KV_OK)
        (void)!kv_xlayer_tx_cancel(w->tx, req);
    const kv_status tw = kv_xlayer_tx_wait(w->tx, req, 60000);
    pthread_join(th, NULL);
    struct kv_xlayer_done done[2];
    uint32_t n = 0;
    if (kv_xlayer_tx_finished(w->tx, done, 2, &n) != KV_OK || n != 1 || done[0].status != KV_OK ||
        kv_xlayer_rx_finished(w->rx, done, 2, &n) != KV_OK || n != 1 || done[0].status != KV_OK ||
        st != KV_OK || tw != KV_OK || d.st != KV_OK)
        return -1;
    return d.t_end - t0;
}

static kv_status lw_layout(int64_t B, struct kv_layout *lo)
{
    struct kv_layout_config c;
    kv_layout_config_init(&c);
    c.num_layers = LAYERS;
    c.num_blocks = B;
    c.block_tokens = 16;
    c.num_heads = 8;
    c.head_dim = 128;
    c.dtype = KV_BF16;
    return kv_layout_init(&c, lo);
}

static const char *lw_open(struct lw *w)
{
    w->T = kvb_quick() ? 256 : 2048;
    w->n = (uint32_t)(w->T / 16);
    if (lw_layout(w->n + 7, &w->slo) != KV_OK || lw_layout(w->n + 13, &w->dlo) != KV_OK)
        return "layout";
    w->src = kvb_alloc((size_t)w->slo.total_bytes);
    w->dst = kvb_alloc((size_t)w->dlo.total_bytes);
    kvb_fill_random(w->src, (size_t)w->slo.total_bytes, 41);
    kvb_fill_random(w->dst, (size_t)w->dlo.total_bytes, 42);
    w->sid = malloc(w->n * sizeof(uint32_t));
    w->did = malloc(w->n * sizeof(uint32_t));
    if (!w->sid || !w->did)
        return "ids";
    kvb_shuffle_ids(w->sid, w->n, w->n + 7, 43);
    kvb_shuffle_ids(w->did, w->n, w->n + 13, 44);
    if (kv_plan_create(&w->slo, &w->dlo, NULL, &w->whole) != KV_OK)
        return "plan";
    for (uint32_t l = 0; l < LAYERS; l++) {
        struct kv_plan_config pc = KV_PLAN_CONFIG_INIT;
        pc.src_layer0 = pc.dst_layer0 = l;
        pc.n_layers = 1;
        if (kv_plan_create(&w->slo, &w->dlo, &pc, &w->layer[l]) != KV_OK)
            return "plan";
    }
    struct kv_xport_config ca = KV_XPORT_CONFIG_INIT, cb = KV_XPORT_CONFIG_INIT;
    ca.kind = cb.kind = KV_XPORT_TCP;
    ca.token = cb.token = TOKEN;
    ca.timeout_ms = cb.timeout_ms = 120000;
    cb.listen_host = "127.0.0.1";
    if (kv_xport_create(&cb, &w->xb) != KV_OK || kv_xport_create(&ca, &w->xa) != KV_OK ||
        kv_xport_connect(w->xa, "127.0.0.1", kv_xport_port(w->xb), &w->pa) != KV_OK ||
        kv_xport_accept(w->xb, 10000, &w->pb) != KV_OK ||
        kv_xport_peer_wait(w->pa, 10000, NULL) != KV_OK)
        return "connect";
    unsigned char blob[KV_XPORT_BLOB_MAX];
    size_t len = 0;
    if (kv_xport_mem_reg(w->xa, w->src, (size_t)w->slo.total_bytes, KV_MEM_HOST, &w->ms) != KV_OK ||
        kv_xport_mem_reg(w->xb, w->dst, (size_t)w->dlo.total_bytes, KV_MEM_HOST, &w->md) != KV_OK ||
        kv_xport_mem_expose(w->pb, w->md, blob, sizeof(blob), &len) != KV_OK ||
        kv_xport_rmem_import(w->pa, blob, len, &w->r) != KV_OK)
        return "register";
    struct kv_xlayer_tx_config tc = KV_XLAYER_TX_CONFIG_INIT;
    struct kv_xlayer_rx_config rc = KV_XLAYER_RX_CONFIG_INIT;
    if (kv_xlayer_tx_create(&tc, &w->tx) != KV_OK || kv_xlayer_rx_create(&rc, &w->rx) != KV_OK)
        return "tracker";
    return NULL;
}

static void lw_close(struct lw *w)
{
    (void)!kv_xlayer_tx_destroy(w->tx);
    (void)!kv_xlayer_rx_destroy(w->rx);
    if (w->md && w->pb)
        (void)!kv_xport_mem_unexpose(w->pb, w->md);
    (void)!kv_xport_rmem_free(w->r);
    if (w->ms)
        (void)!kv_xport_mem_dereg(w->ms);
    if (w->md)
        (void)!kv_xport_mem_dereg(w->md);
    if (w->pa)
        kv_xport_peer_close(w->pa);
    if (w->pb)
        kv_xport_peer_close(w->pb);
    (void)!kv_xport_destroy(w->xa);
    (void)!kv_xport_destroy(w->xb);
    for (uint32_t l = 0; l < LAYERS; l++)
        kv_plan_destroy(w->layer[l]);
    kv_plan_destroy(w->whole);
    free(w->sid);
    free(w->did);
    kvb_free(w->src);
    kvb_free(w->dst);
}

static void layerwise_case(struct lw *w, const char *name, bool spin, uint64_t *req)
{
    const char *bench = "transport.layerwise";
    const int runs = kvb_runs();
    /* c: the median of one layer's transfer, measured here */
    double cal[9];
    for (int i = 0; i < 9; i++)
        if ((cal[i] = one_request(w, (*req)++, 0, 0, spin, NULL)) < 0) {
            kvb_failed(bench, "calibration", "%s", kv_last_error());
            return;
        }
    const double c = kvb_median(cal, 9);
    kvb_progress(bench, name);
    fprintf(stderr, "%s %s: one layer's transfer (the compute per layer) %.3f ms\n", bench, name,
            c * 1e3);
    double *ts = malloc((size_t)runs * sizeof(double)), *bs = malloc((size_t)runs * sizeof(double));
    double *ps = malloc((size_t)runs * sizeof(double));
    if (!ts || !bs || !ps) {
        free(ts);
        free(bs);
        free(ps);
        kvb_failed(bench, name, "out of memory");
        return;
    }
    /* warm-up, then interleaved */
    if (one_request(w, (*req)++, LAYERS, c, spin, NULL) < 0 ||
        one_request(w, (*req)++, 1, c, spin, NULL) < 0) {
        kvb_failed(bench, name, "warm-up: %s", kv_last_error());
        goto out;
    }
    for (int i = 0; i < runs; i++) {
        ts[i] = one_request(w, (*req)++, LAYERS, c, spin, &ps[i]);
        bs[i] = one_request(w, (*req)++, 1, c, spin, NULL);
        if (ts[i] < 0 || bs[i] < 0) {
            kvb_failed(bench, name, "run %d: %s", i, kv_last_error());
            goto out;
        }
    }
    fprintf(stderr, "%s %s: the %u posts of a request took %.3f ms on the prefill thread\n", bench,
            name, LAYERS, kvb_median(ps, runs) * 1e3);
    kvb_emit_us(bench, name, kvb_median(ts, runs) * 1e6, "whole_request",
                kvb_median(bs, runs) * 1e6, runs);
out:
    free(ts);
    free(bs);
    free(ps);
}

static void layerwise_suite(void)
{
    const char *bench = "transport.layerwise";
    char names[2][128];
    bool sel[2];
    for (int k = 0; k < 2; k++) {
        snprintf(names[k], sizeof(names[k]),
                 "L%u/H8/D128/bf16/T%d/N16/layer-major/per-layer/compute=%s", LAYERS,
                 kvb_quick() ? 256 : 2048, k == 0 ? "spin" : "wait");
        sel[k] = kvb_selected(bench, names[k]) != 0;
    }
    if (!sel[0] && !sel[1])
        return;
    struct lw w;
    memset(&w, 0, sizeof(w));
    const char *fail = lw_open(&w);
    if (fail) {
        kvb_failed(bench, "setup", "%s: %s", fail, kv_last_error());
        lw_close(&w);
        return;
    }
    char *ref = kvb_alloc((size_t)w.dlo.total_bytes);
    memcpy(ref, w.dst, (size_t)w.dlo.total_bytes);
    uint64_t req = 1;
    for (int k = 0; k < 2; k++)
        if (sel[k])
            layerwise_case(&w, names[k], k == 0, &req);
    /* the data: the whole decode pool against kv_plan_copy */
    struct kv_paged_cache sc = {
        .layout = w.slo, .base = w.src, .storage_bytes = (size_t)w.slo.total_bytes};
    struct kv_paged_cache dc = {
        .layout = w.dlo, .base = ref, .storage_bytes = (size_t)w.dlo.total_bytes};
    if (kv_plan_copy(w.whole, sc, w.sid, w.n, dc, w.did, w.n, w.T) != KV_OK)
        kvb_failed(bench, "check", "reference: %s", kv_last_error());
    else if (memcmp(ref, w.dst, (size_t)w.dlo.total_bytes) != 0)
        kvb_mismatch(bench, "check", "the decode pool differs from kv_plan_copy of the request");
    kvb_free(ref);
    lw_close(&w);
}

KVB_REGISTER("transport", layerwise_suite)
