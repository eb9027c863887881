/*
 * test_xport_layers.c - layer-by-layer transfer of a request
 * (connector/transport/kv_xport_layers.h) over TCP loopback, in one process.
 *
 *   - a request of 6 layers posted in 4 groups ({0}, {1, 2}, {3}, {4, 5})
 *     from an NHD layer-major cache of 16-token pages into an HND
 *     block-major padded decoder of 32-token pages, block ids spread over
 *     both pools: a waiter thread waits for layers 0..5 in order and each
 *     wait returns only once its group's notification was accounted (and a
 *     layer not landed yet times out); the whole destination pool equals
 *     a local kv_plan_copy of the whole request and the config-only
 *     reference; each side reports the request once, KV_OK; refused posts
 *     (a layer twice, layers past the request's, bad block lists) send
 *     nothing and leave the request as it was;
 *   - the same for a K-only (MLA latent, H 1, D 576) request of 5 layers
 *     in 3 groups into a K-only decoder of 64-token pages, waits per layer;
 *   - a layer failure: the decoder unexposes its cache, layer 2's writes are
 *     refused, the request fails as a whole: prefill sends ABORT, a waiter on
 *     layer 7 wakes with the failure, a wait on landed layer 0 answers it
 *     too, each side reports it once; the pool holds layers 0 and 1 and
 *     nothing else; a cancel in flight ends the same way (KV_ERR_CANCELLED);
 *   - limits and hostile notifications refused by name with nothing
 *     changed (stats compared field by field, waits still pending);
 *   - kv_xlayer_rx_destroy refused while a thread waits, nothing freed;
 *   - prefill's peer closed under an open request (its imported region
 *     freed too): the request holds the peer, fails, is reported once.
 */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include <kvcache/kv.h>
#include "kvt_side.h"
#include "kvt_xport.h"
#include "kvtest.h"

#define TOKEN 0x1A7E25ull

/* a (prefill) connected to b (decode) over TCP, both in this process. */
static void pair_open(struct kvt_pair *p)
{
    struct kv_xport_config ca = kvt_xport_cfg(KV_XPORT_TCP, false, TOKEN, 0),
                           cb = kvt_xport_cfg(KV_XPORT_TCP, true, TOKEN, 0);
    kvt_pair_open(p, &ca, &cb);
}

/* The next notification on b, which must be a layer notification, fed. */
static kv_status feed_next(struct kvt_pair *p, kv_xlayer_rx *rx)
{
    struct kv_xport_msg *m = malloc(sizeof(*m));
    assert_non_null(m);
    assert_int_equal(kv_xport_notify_poll(p->b, 10000, m), KV_OK);
    assert_int_equal(m->tag, KV_XLAYER_TAG);
    assert_int_equal(m->peer_id, kv_xport_peer_id(p->pb));
    const kv_status st = kv_xlayer_rx_feed(rx, m);
    free(m);
    return st;
}

static void rx_stats(kv_xlayer_rx *rx, struct kv_xlayer_rx_stats *s)
{
    *s = (struct kv_xlayer_rx_stats)KV_XLAYER_RX_STATS_INIT;
    assert_int_equal(kv_xlayer_rx_stats_get(rx, s), KV_OK);
}

static void stats_equal(const struct kv_xlayer_rx_stats *a, const struct kv_xlayer_rx_stats *b)
{
    assert_int_equal(a->notes_layers, b->notes_layers);
    assert_int_equal(a->notes_abort, b->notes_abort);
    assert_int_equal(a->notes_late, b->notes_late);
    assert_int_equal(a->notes_refused, b->notes_refused);
    assert_int_equal(a->tracked, b->tracked);
}

/* ---- layer by layer ------------------------------------------------- */

enum { L = 6, NG = 4, REQ = 987654 };
static const uint32_t G0[NG] = {0, 1, 3, 4}, GN[NG] = {1, 2, 1, 2};

/* One request's endpoints over a pair: the references of the whole move,
 * a plan per group of layers, both pools registered (ms on a, md on b) and
 * md shared with a (r), a layer receiver (rx, expecting the request from
 * b's peer) and sender (tx, begun on a's). */
struct run {
    unsigned char *ref;  /* d's pool after a local kv_plan_copy of the whole request */
    unsigned char *src0; /* s's pool before */
    kv_plan *whole;
    kv_plan *plans[8];
    int n_plans;
    kv_xport_mem *ms, *md;
    kv_xport_rmem *r;
    kv_xlayer_rx *rx;
    kv_xlayer_tx *tx;
};

/* u's references: kv_plan_copy of the whole request (heads [0, nh)) equal
 * to the config-only reference; s's pool as it was. */
static void run_refs(struct run *u, const struct kvt_side *s, const uint32_t *sid, uint32_t ns,
                     const struct kvt_side *d, const uint32_t *did, uint32_t nd, uint64_t T,
                     int64_t nh)
{
    unsigned char *ref2 = malloc((size_t)d->lo.total_bytes);
    u->ref = malloc((size_t)d->lo.total_bytes);
    assert_true(u->ref && ref2);
    memcpy(u->ref, d->mem, (size_t)d->lo.total_bytes);
    memcpy(ref2, d->mem, (size_t)d->lo.total_bytes);
    assert_int_equal(kv_plan_create(&s->lo, &d->lo, NULL, &u->whole), KV_OK);
    struct kv_paged_cache rc = d->pc;
    rc.base = u->ref;
    /* one thread: the reference needs none, and libgomp's barriers are
     * invisible to ThreadSanitizer (this test runs under it in CI) */
    assert_int_equal(kv_set_threads(1), KV_OK);
    assert_int_equal(kv_plan_copy(u->whole, s->pc, sid, ns, rc, did, nd, T), KV_OK);
    assert_int_equal(kv_set_threads(0), KV_OK); /* the default again */
    kvt_ref_move(s, sid, ns, d, did, nd, 0, 0, nh, ref2);
    assert_int_equal(kvt_first_diff(u->ref, ref2, d->lo.total_bytes), -1);
    free(ref2);
    u->src0 = malloc((size_t)s->lo.total_bytes);
    assert_non_null(u->src0);
    memcpy(u->src0, s->mem, (size_t)s->lo.total_bytes);
}

/* u's plans (group g: layers [l0[g], +nl[g])), pools, share and layer
 * endpoints for request req of nl_all layers. */
static void run_open(struct run *u, struct kvt_pair *p, const struct kvt_side *s,
                     const struct kvt_side *d, const uint32_t *l0, const uint32_t *nl, int ng,
                     uint64_t req, uint32_t nl_all)
{
    assert_true(ng <= 8);
    u->n_plans = ng;
    for (int g = 0; g < ng; g++) {
        struct kv_plan_config pc = KV_PLAN_CONFIG_INIT;
        pc.src_layer0 = pc.dst_layer0 = l0[g];
        pc.n_layers = nl[g];
        assert_int_equal(kv_plan_create(&s->lo, &d->lo, &pc, &u->plans[g]), KV_OK);
    }
    assert_int_equal(kv_xport_mem_reg(p->a, s->mem, (size_t)s->lo.total_bytes, KV_MEM_HOST, &u->ms),
                     KV_OK);
    assert_int_equal(kv_xport_mem_reg(p->b, d->mem, (size_t)d->lo.total_bytes, KV_MEM_HOST, &u->md),
                     KV_OK);
    u->r = kvt_share_direct(p, u->md);
    struct kv_xlayer_rx_config rcfg = KV_XLAYER_RX_CONFIG_INIT;
    struct kv_xlayer_tx_config tcfg = KV_XLAYER_TX_CONFIG_INIT;
    assert_int_equal(kv_xlayer_rx_create(&rcfg, &u->rx), KV_OK);
    assert_int_equal(kv_xlayer_tx_create(&tcfg, &u->tx), KV_OK);
    assert_int_equal(kv_xlayer_rx_expect(u->rx, kv_xport_peer_id(p->pb), req, nl_all), KV_OK);
    assert_int_equal(kv_xlayer_tx_begin(u->tx, p->pa, req, nl_all), KV_OK);
}

/* Everything of u released (each call must succeed). */
static void run_close(struct run *u, struct kvt_pair *p)
{
    assert_int_equal(kv_xlayer_tx_destroy(u->tx), KV_OK);
    assert_int_equal(kv_xlayer_rx_destroy(u->rx), KV_OK);
    assert_int_equal(kv_xport_mem_unexpose(p->pb, u->md), KV_OK);
    assert_int_equal(kv_xport_rmem_free(u->r), KV_OK);
    assert_int_equal(kv_xport_mem_dereg(u->md), KV_OK);
    assert_int_equal(kv_xport_mem_dereg(u->ms), KV_OK);
    for (int g = 0; g < u->n_plans; g++)
        kv_plan_destroy(u->plans[g]);
    kv_plan_destroy(u->whole);
    free(u->ref);
    free(u->src0);
}

struct waiter {
    kv_xlayer_rx *rx;
    uint64_t req;
    uint32_t n;
    kv_status st[8];
    uint64_t seen[8]; /* LAYERS notifications accounted when wait l returned */
};

static void *waiter_main(void *arg)
{
    struct waiter *w = arg;
    for (uint32_t l = 0; l < w->n; l++) {
        w->st[l] = kv_xlayer_rx_wait(w->rx, w->req, l, 20000);
        struct kv_xlayer_rx_stats s = KV_XLAYER_RX_STATS_INIT;
        if (kv_xlayer_rx_stats_get(w->rx, &s) == KV_OK)
            w->seen[l] = s.notes_layers;
    }
    return NULL;
}

static void test_xport_layers_layer_by_layer(void **state)
{
    (void)state;
    struct kvt_pair p;
    pair_open(&p);
    struct kvt_side s, d;
    kvt_side_make(&s, L, 90, 16, 4, 32, KV_BF16, 0, 11);
    kvt_side_make(&d, L, 80, 32, 4, 32, KV_BF16, 1 | 2 | 4, 12);
    const uint64_t T = 150;
    const uint32_t ns = 10, nd = 5;
    uint32_t sid[10], did[5];
    uint64_t rng = 5;
    kvt_pick_ids(&rng, s.lo.num_blocks, ns, sid);
    kvt_pick_ids(&rng, d.lo.num_blocks, nd, did);

    /* references: a local kv_plan_copy of the whole request, and the
     * config-only addressing */
    struct run u;
    run_refs(&u, &s, sid, ns, &d, did, nd, T, 4);
    run_open(&u, &p, &s, &d, G0, GN, NG, REQ, L);

    struct waiter w = {.rx = u.rx, .req = REQ, .n = L};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, waiter_main, &w), 0);
    for (int g = 0; g < NG; g++) {
        /* not landed yet: a wait on the group's first layer times out */
        assert_int_equal(kv_xlayer_rx_wait(u.rx, REQ, G0[g], 0), KV_ERR_TIMEOUT);
        kvt_assert_msg_has("not landed");
        if (g == 1) {
            /* refused posts send nothing and change nothing */
            assert_int_equal(kv_xlayer_tx_post(u.tx, REQ, u.plans[0], 0, 1, u.ms, 0, sid, ns, u.r,
                                               0, did, nd, T),
                             KV_ERR_OVERLAP);
            kvt_assert_msg_has("layers [0, +1)");
            assert_int_equal(kv_xlayer_tx_post(u.tx, REQ, u.plans[g], 5, 2, u.ms, 0, sid, ns, u.r,
                                               0, did, nd, T),
                             KV_ERR_OUT_OF_BOUNDS);
            kvt_assert_msg_has("[5, +2)");
            assert_int_equal(kv_xlayer_tx_post(u.tx, REQ, u.plans[g], G0[g], GN[g], u.ms, 0, sid,
                                               ns - 1, u.r, 0, did, nd, T),
                             KV_ERR_BAD_SHAPE);
            assert_int_equal(kv_xlayer_tx_post(u.tx, REQ + 1, u.plans[g], G0[g], GN[g], u.ms, 0,
                                               sid, ns, u.r, 0, did, nd, T),
                             KV_ERR_NOT_FOUND);
        }
        assert_int_equal(kv_xlayer_tx_post(u.tx, REQ, u.plans[g], G0[g], GN[g], u.ms, 0, sid, ns,
                                           u.r, 0, did, nd, T),
                         KV_OK);
        assert_int_equal(feed_next(&p, u.rx), KV_OK);
    }
    assert_int_equal(pthread_join(th, NULL), 0);
    for (uint32_t l = 0; l < L; l++) {
        assert_int_equal(w.st[l], KV_OK);
        uint64_t group = 0;
        while (!(l >= G0[group] && l < G0[group] + GN[group]))
            group++;
        if (w.seen[l] < group + 1)
            fail_msg("wait for layer %u returned after %llu notifications, its group is %llu", l,
                     (unsigned long long)w.seen[l], (unsigned long long)group);
    }
    assert_int_equal(kv_xlayer_tx_wait(u.tx, REQ, 10000), KV_OK);
    struct kv_xlayer_done done[4];
    uint32_t n = 9;
    assert_int_equal(kv_xlayer_tx_finished(u.tx, done, 4, &n), KV_OK);
    assert_int_equal(n, 1);
    assert_int_equal(done[0].request, REQ);
    assert_int_equal(done[0].status, KV_OK);
    assert_int_equal(kv_xlayer_tx_finished(u.tx, done, 4, &n), KV_OK);
    assert_int_equal(n, 0);
    assert_int_equal(kv_xlayer_rx_finished(u.rx, done, 4, &n), KV_OK);
    assert_int_equal(n, 1);
    assert_int_equal(done[0].request, REQ);
    assert_int_equal(done[0].status, KV_OK);
    assert_int_equal(kv_xlayer_rx_finished(u.rx, done, 4, &n), KV_OK);
    assert_int_equal(n, 0);
    assert_int_equal(kv_xlayer_rx_wait(u.rx, REQ, 0, 0), KV_ERR_NOT_FOUND);

    const int64_t at = kvt_first_diff(u.ref, d.mem, d.lo.total_bytes);
    if (at >= 0)
        fail_msg("destination byte %lld of %lld differs from kv_plan_copy", (long long)at,
                 (long long)d.lo.total_bytes);
    assert_int_equal(kvt_first_diff(u.src0, s.mem, s.lo.total_bytes), -1);

    struct kv_xlayer_rx_stats st;
    rx_stats(u.rx, &st);
    assert_int_equal(st.notes_layers, NG);
    assert_int_equal(st.notes_refused, 0);
    assert_int_equal(st.tracked, 0);
    run_close(&u, &p);
    kvt_side_free(&s);
    kvt_side_free(&d);
    kvt_pair_close(&p);
}

/* ---- K only ---------------------------------------------------------- */

/* A K-only (MLA latent: one plane, H = 1, D = 576) request of 5 layers
 * posted in 3 groups ({0, 1}, {2}, {3, 4}) from a K-only NHD layer-major
 * cache of 16-token pages into a K-only HND block-major padded decoder of
 * 64-token pages: after each group's notification its layers are waited
 * for (KV_OK) and the next group's first layer is not landed; the whole
 * destination pool equals kv_plan_copy and the config-only reference. */
static void test_xport_layers_k_only(void **state)
{
    (void)state;
    enum { KL = 5, KG = 3, KREQ = 4242 };
    static const uint32_t K0[KG] = {0, 2, 3}, KN[KG] = {2, 1, 2};
    struct kvt_pair p;
    pair_open(&p);
    struct kvt_side s, d;
    kvt_side_make(&s, KL, 60, 16, 1, 576, KV_BF16, 32, 21);
    kvt_side_make(&d, KL, 30, 64, 1, 576, KV_BF16, 32 | 1 | 2 | 4, 22);
    const uint64_t T = 16 * 11 - 9;
    const uint32_t ns = 11, nd = 3;
    uint32_t sid[11], did[3];
    uint64_t rng = 23;
    kvt_pick_ids(&rng, s.lo.num_blocks, ns, sid);
    kvt_pick_ids(&rng, d.lo.num_blocks, nd, did);
    struct run u;
    run_refs(&u, &s, sid, ns, &d, did, nd, T, 1);
    run_open(&u, &p, &s, &d, K0, KN, KG, KREQ, KL);
    for (int g = 0; g < KG; g++) {
        assert_int_equal(kv_xlayer_rx_wait(u.rx, KREQ, K0[g], 0), KV_ERR_TIMEOUT);
        assert_int_equal(kv_xlayer_tx_post(u.tx, KREQ, u.plans[g], K0[g], KN[g], u.ms, 0, sid, ns,
                                           u.r, 0, did, nd, T),
                         KV_OK);
        assert_int_equal(feed_next(&p, u.rx), KV_OK);
        for (uint32_t l = K0[g]; l < K0[g] + KN[g]; l++)
            assert_int_equal(kv_xlayer_rx_wait(u.rx, KREQ, l, 5000), KV_OK);
        if (g + 1 < KG)
            assert_int_equal(kv_xlayer_rx_wait(u.rx, KREQ, K0[g + 1], 0), KV_ERR_TIMEOUT);
    }
    assert_int_equal(kv_xlayer_tx_wait(u.tx, KREQ, 10000), KV_OK);
    struct kv_xlayer_done done[2];
    uint32_t n = 9;
    assert_int_equal(kv_xlayer_tx_finished(u.tx, done, 2, &n), KV_OK);
    assert_int_equal(n, 1);
    assert_int_equal(done[0].request, KREQ);
    assert_int_equal(done[0].status, KV_OK);
    assert_int_equal(kv_xlayer_rx_finished(u.rx, done, 2, &n), KV_OK);
    assert_int_equal(n, 1);
    assert_int_equal(done[0].request, KREQ);
    assert_int_equal(done[0].status, KV_OK);
    const int64_t at = kvt_first_diff(u.ref, d.mem, d.lo.total_bytes);
    if (at >= 0)
        fail_msg("K-only destination byte %lld of %lld differs from kv_plan_copy", (long long)at,
                 (long long)d.lo.total_bytes);
    assert_int_equal(kvt_first_diff(u.src0, s.mem, s.lo.total_bytes), -1);
    run_close(&u, &p);
    kvt_side_free(&s);
    kvt_side_free(&d);
    kvt_pair_close(&p);
}

/* ---- failure and cancel ----------------------------------------------- */

static void *wait_one(void *arg)
{
    struct waiter *w = arg;
    w->st[0] = kv_xlayer_rx_wait(w->rx, w->req, w->n, 20000);
    return NULL;
}

static void test_xport_layers_failure_fails_request_once(void **state)
{
    (void)state;
    struct kvt_pair p;
    pair_open(&p);
    struct kvt_side s, d;
    kvt_side_make(&s, 8, 70, 16, 2, 32, KV_F16, 2, 21);
    kvt_side_make(&d, 8, 60, 16, 2, 32, KV_F16, 1 | 4, 22);
    const uint64_t T = 70;
    uint32_t sid[5], did[5];
    uint64_t rng = 9;
    kvt_pick_ids(&rng, s.lo.num_blocks, 5, sid);
    kvt_pick_ids(&rng, d.lo.num_blocks, 5, did);
    unsigned char *ref = malloc((size_t)d.lo.total_bytes);
    assert_non_null(ref);
    memcpy(ref, d.mem, (size_t)d.lo.total_bytes);
    kvt_ref_move_layers(&s, sid, 5, &d, did, 5, 0, 0, 2, 0, 0, 2, ref);
    kv_plan *pl[8];
    for (int l = 0; l < 8; l++) {
        struct kv_plan_config pc = KV_PLAN_CONFIG_INIT;
        pc.src_layer0 = pc.dst_layer0 = l;
        pc.n_layers = 1;
        assert_int_equal(kv_plan_create(&s.lo, &d.lo, &pc, &pl[l]), KV_OK);
    }
    kv_xport_mem *ms = NULL, *md = NULL;
    assert_int_equal(kv_xport_mem_reg(p.a, s.mem, (size_t)s.lo.total_bytes, KV_MEM_HOST, &ms),
                     KV_OK);
    assert_int_equal(kv_xport_mem_reg(p.b, d.mem, (size_t)d.lo.total_bytes, KV_MEM_HOST, &md),
                     KV_OK);
    kv_xport_rmem *r = kvt_share_direct(&p, md);
    struct kv_xlayer_rx_config rcfg = KV_XLAYER_RX_CONFIG_INIT;
    struct kv_xlayer_tx_config tcfg = KV_XLAYER_TX_CONFIG_INIT;
    kv_xlayer_rx *rx = NULL;
    kv_xlayer_tx *tx = NULL;
    assert_int_equal(kv_xlayer_rx_create(&rcfg, &rx), KV_OK);
    assert_int_equal(kv_xlayer_tx_create(&tcfg, &tx), KV_OK);
    const uint64_t pid = kv_xport_peer_id(p.pb);

    /* request 700: layers 0, 1 land, then the decoder unexposes */
    assert_int_equal(kv_xlayer_rx_expect(rx, pid, 700, 8), KV_OK);
    assert_int_equal(kv_xlayer_tx_begin(tx, p.pa, 700, 8), KV_OK);
    struct waiter w = {.rx = rx, .req = 700, .n = 7};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, wait_one, &w), 0);
    for (uint32_t l = 0; l < 2; l++) {
        assert_int_equal(kv_xlayer_tx_post(tx, 700, pl[l], l, 1, ms, 0, sid, 5, r, 0, did, 5, T),
                         KV_OK);
        assert_int_equal(feed_next(&p, rx), KV_OK);
        assert_int_equal(kv_xlayer_rx_wait(rx, 700, l, 5000), KV_OK);
    }
    assert_int_equal(kv_xport_mem_unexpose(p.pb, md), KV_OK);
    assert_int_equal(kv_xlayer_tx_post(tx, 700, pl[2], 2, 1, ms, 0, sid, 5, r, 0, did, 5, T),
                     KV_OK);
    assert_int_equal(kv_xlayer_tx_wait(tx, 700, 10000), KV_ERR_OUT_OF_BOUNDS);
    kvt_assert_msg_has("request 700 failed");
    assert_int_equal(kv_xlayer_tx_post(tx, 700, pl[3], 3, 1, ms, 0, sid, 5, r, 0, did, 5, T),
                     KV_ERR_BAD_STATE);
    kvt_assert_msg_has("KV_ERR_OUT_OF_BOUNDS");
    /* the refused layer's notification never comes: the next is ABORT */
    assert_int_equal(feed_next(&p, rx), KV_OK);
    assert_int_equal(pthread_join(th, NULL), 0);
    assert_int_equal(w.st[0], KV_ERR_OUT_OF_BOUNDS);
    assert_int_equal(kv_xlayer_rx_wait(rx, 700, 0, 0), KV_ERR_OUT_OF_BOUNDS);
    kvt_assert_msg_has("not to be attended over");
    struct kv_xlayer_rx_stats st;
    rx_stats(rx, &st);
    assert_int_equal(st.notes_layers, 2);
    assert_int_equal(st.notes_abort, 1);
    struct kv_xlayer_done done[4];
    uint32_t n = 0;
    for (int k = 0; k < 2; k++) {
        assert_int_equal(kv_xlayer_rx_finished(rx, done, 4, &n), KV_OK);
        assert_int_equal(n, k == 0 ? 1 : 0);
        assert_int_equal(kv_xlayer_tx_finished(tx, done + 2, 2, &n), KV_OK);
        assert_int_equal(n, k == 0 ? 1 : 0);
    }
    assert_int_equal(done[0].request, 700);
    assert_int_equal(done[0].status, KV_ERR_OUT_OF_BOUNDS);
    assert_int_equal(done[2].request, 700);
    assert_int_equal(done[2].status, KV_ERR_OUT_OF_BOUNDS);
    /* layers 0 and 1 landed, nothing else of the pool changed */
    assert_int_equal(kvt_first_diff(ref, d.mem, d.lo.total_bytes), -1);

    /* request 701: cancelled with layers in flight */
    assert_int_equal(kv_xport_rmem_free(r), KV_OK);
    r = kvt_share_direct(&p, md);
    assert_int_equal(kv_xlayer_rx_expect(rx, pid, 701, 8), KV_OK);
    assert_int_equal(kv_xlayer_tx_begin(tx, p.pa, 701, 8), KV_OK);
    for (uint32_t l = 0; l < 3; l++)
        assert_int_equal(kv_xlayer_tx_post(tx, 701, pl[l], l, 1, ms, 0, sid, 5, r, 0, did, 5, T),
                         KV_OK);
    assert_int_equal(kv_xlayer_tx_cancel(tx, 701), KV_OK);
    assert_int_equal(kv_xlayer_tx_cancel(tx, 701), KV_ERR_BAD_STATE);
    assert_int_equal(kv_xlayer_tx_wait(tx, 701, 10000), KV_ERR_CANCELLED);
    n = 0;
    for (int k = 0; k < 20 && n == 0; k++) {
        assert_int_equal(feed_next(&p, rx), KV_OK); /* LAYERS already on their way, then ABORT */
        assert_int_equal(kv_xlayer_rx_finished(rx, done, 4, &n), KV_OK);
    }
    assert_int_equal(n, 1);
    assert_int_equal(done[0].request, 701);
    assert_int_equal(done[0].status, KV_ERR_CANCELLED);
    assert_int_equal(kv_xlayer_tx_finished(tx, done, 4, &n), KV_OK);
    assert_int_equal(n, 1);
    assert_int_equal(done[0].request, 701);
    assert_int_equal(done[0].status, KV_ERR_CANCELLED);
    assert_int_equal(kv_xlayer_tx_cancel(tx, 701), KV_ERR_NOT_FOUND);
    assert_int_equal(kv_xlayer_rx_finished(rx, done, 4, &n), KV_OK);
    assert_int_equal(n, 0);

    /* decode fails a request itself: waiters wake with its reason; it is
     * held (prefill may still write its blocks) until released */
    assert_int_equal(kv_xlayer_rx_expect(rx, pid, 702, 3), KV_OK);
    assert_int_equal(kv_xlayer_rx_release(rx, 702), KV_ERR_BAD_STATE);
    kvt_assert_msg_has("request 702 is not held (in flight)");
    assert_int_equal(kv_xlayer_rx_fail(rx, 702, KV_ERR_TIMEOUT), KV_OK);
    assert_int_equal(kv_xlayer_rx_fail(rx, 702, KV_ERR_TIMEOUT), KV_ERR_BAD_STATE);
    assert_int_equal(kv_xlayer_rx_wait(rx, 702, 2, 1000), KV_ERR_TIMEOUT);
    kvt_assert_msg_has("request 702 failed");
    assert_int_equal(kv_xlayer_rx_finished(rx, done, 4, &n), KV_OK);
    assert_int_equal(n, 0);
    assert_int_equal(kv_xlayer_rx_release(rx, 702), KV_OK);
    assert_int_equal(kv_xlayer_rx_release(rx, 702), KV_ERR_BAD_STATE);
    assert_int_equal(kv_xlayer_rx_finished(rx, done, 4, &n), KV_OK);
    assert_int_equal(n, 1);
    assert_int_equal(done[0].status, KV_ERR_TIMEOUT);
    assert_int_equal(kv_xlayer_rx_release(rx, 702), KV_ERR_NOT_FOUND);

    /* held while prefill goes on: decode fails 703 after its layer 0 landed;
     * prefill, not told, posts layers 1 and 2; the request is reported once
     * the last of them is accounted, with decode's reason, and nothing of
     * it was attended over */
    assert_int_equal(kv_xlayer_rx_expect(rx, pid, 703, 3), KV_OK);
    assert_int_equal(kv_xlayer_tx_begin(tx, p.pa, 703, 3), KV_OK);
    for (uint32_t l = 0; l < 3; l++) {
        if (l == 1) {
            assert_int_equal(kv_xlayer_rx_fail(rx, 703, KV_ERR_TIMEOUT), KV_OK);
            assert_int_equal(kv_xlayer_rx_wait(rx, 703, 0, 0), KV_ERR_TIMEOUT);
        }
        assert_int_equal(kv_xlayer_tx_post(tx, 703, pl[l], l, 1, ms, 0, sid, 5, r, 0, did, 5, T),
                         KV_OK);
        assert_int_equal(feed_next(&p, rx), KV_OK);
        assert_int_equal(kv_xlayer_rx_finished(rx, done, 4, &n), KV_OK);
        assert_int_equal(n, l == 2 ? 1u : 0u);
    }
    assert_int_equal(done[0].request, 703);
    assert_int_equal(done[0].status, KV_ERR_TIMEOUT);
    assert_int_equal(kv_xlayer_tx_wait(tx, 703, 10000), KV_OK);
    assert_int_equal(kv_xlayer_tx_finished(tx, done, 4, &n), KV_OK);
    assert_int_equal(n, 1);
    assert_int_equal(done[0].status, KV_OK); /* prefill's side: every layer acknowledged */

    /* a plan of other layers than the ones named (decode would be told of
     * layer 1 while layer 0 was written): refused, nothing sent */
    assert_int_equal(kv_xlayer_rx_expect(rx, pid, 704, 3), KV_OK);
    assert_int_equal(kv_xlayer_tx_begin(tx, p.pa, 704, 3), KV_OK);
    assert_int_equal(kv_xlayer_tx_post(tx, 704, pl[0], 1, 1, ms, 0, sid, 5, r, 0, did, 5, T),
                     KV_ERR_INVALID_ARG);
    kvt_assert_msg_has("layers [1, +1) named, but the plan writes destination layers [0, +1)");
    assert_int_equal(kv_xlayer_tx_cancel(tx, 704), KV_OK);
    assert_int_equal(feed_next(&p, rx), KV_OK); /* the ABORT: nothing else was sent */
    assert_int_equal(kv_xlayer_rx_finished(rx, done, 4, &n), KV_OK);
    assert_int_equal(n, 1);
    assert_int_equal(done[0].request, 704);
    assert_int_equal(done[0].status, KV_ERR_CANCELLED);
    assert_int_equal(kv_xlayer_tx_wait(tx, 704, 10000), KV_ERR_CANCELLED);
    assert_int_equal(kv_xlayer_tx_finished(tx, done, 4, &n), KV_OK);
    assert_int_equal(n, 1);

    assert_int_equal(kv_xlayer_tx_destroy(tx), KV_OK);
    assert_int_equal(kv_xlayer_rx_destroy(rx), KV_OK);
    assert_int_equal(kv_xport_mem_unexpose(p.pb, md), KV_OK);
    assert_int_equal(kv_xport_rmem_free(r), KV_OK);
    assert_int_equal(kv_xport_mem_dereg(md), KV_OK);
    assert_int_equal(kv_xport_mem_dereg(ms), KV_OK);
    for (int l = 0; l < 8; l++)
        kv_plan_destroy(pl[l]);
    free(ref);
    kvt_side_free(&s);
    kvt_side_free(&d);
    kvt_pair_close(&p);
}

/* ---- limits and hostile notifications ----------------------------------- */

static struct kv_xport_msg *note_msg(uint64_t peer, const struct kv_xlayer_note *nt)
{
    struct kv_xport_msg *m = calloc(1, sizeof(*m));
    assert_non_null(m);
    m->peer_id = peer;
    m->tag = KV_XLAYER_TAG;
    m->len = KV_XLAYER_NOTE_BYTES;
    kv_xlayer_note_encode(nt, m->data);
    return m;
}

static void test_xport_layers_limits_refused_by_name(void **state)
{
    (void)state;
    kv_xlayer_rx *rx = NULL;
    struct kv_xlayer_rx_config rc = KV_XLAYER_RX_CONFIG_INIT;
    rc.max_requests = 70000;
    assert_int_equal(kv_xlayer_rx_create(&rc, &rx), KV_ERR_INVALID_ARG);
    kvt_assert_msg_has("max_requests 70000");
    rc.max_requests = 2;
    rc.max_layers = 5000;
    assert_int_equal(kv_xlayer_rx_create(&rc, &rx), KV_ERR_INVALID_ARG);
    kvt_assert_msg_has("max_layers 5000");
    rc.struct_size = 8;
    assert_int_equal(kv_xlayer_rx_create(&rc, &rx), KV_ERR_INVALID_ARG);
    rc.struct_size = sizeof(rc);
    rc.max_layers = 8;
    assert_int_equal(kv_xlayer_rx_create(&rc, &rx), KV_OK);
    assert_int_equal(kv_xlayer_rx_expect(rx, 3, 1000, 9), KV_ERR_INVALID_ARG);
    kvt_assert_msg_has("n_layers 9");
    assert_int_equal(kv_xlayer_rx_expect(rx, 3, 1000, 0), KV_ERR_INVALID_ARG);
    assert_int_equal(kv_xlayer_rx_expect(rx, 3, 1000, 8), KV_OK);
    assert_int_equal(kv_xlayer_rx_expect(rx, 3, 1000, 8), KV_ERR_BAD_STATE);
    kvt_assert_msg_has("request 1000");
    assert_int_equal(kv_xlayer_rx_expect(rx, 3, 1001, 4), KV_OK);
    assert_int_equal(kv_xlayer_rx_expect(rx, 3, 1002, 4), KV_ERR_CAPACITY);
    kvt_assert_msg_has("max_requests");

    struct kv_xlayer_note ok = {
        .kind = KV_XLAYER_LAYERS, .request = 1000, .layer0 = 2, .n_layers = 3};
    struct kv_xport_msg *m = note_msg(3, &ok);
    assert_int_equal(kv_xlayer_rx_feed(rx, m), KV_OK);

    struct {
        int field; /* what is changed */
        uint64_t v;
        kv_status want;
        const char *word;
    } cases[] = {
        {0, 99, KV_ERR_INVALID_ARG, "tag"},
        {1, 31, KV_ERR_CORRUPT, "length 31"},
        {2, 0x12345678, KV_ERR_CORRUPT, "magic"},
        {3, 2, KV_ERR_CORRUPT, "version 2"},
        {4, 3, KV_ERR_CORRUPT, "kind 3"},
        {5, 1, KV_ERR_CORRUPT, "reserved"},
        {6, 0, KV_ERR_CORRUPT, "+0"},
        {7, 7, KV_ERR_CORRUPT, "status 7"},
        {8, 4000, KV_ERR_NOT_FOUND, "request 4000"},
        {9, 4, KV_ERR_MISMATCH, "peer 4"},
        {10, 7, KV_ERR_OUT_OF_BOUNDS, "[7, +2)"},
        {11, 3, KV_ERR_CORRUPT, "landed before"},
        {12, 0, KV_ERR_CORRUPT, "not a failure"},
        {13, 4096, KV_ERR_CORRUPT, "[4096, +1)"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        struct kv_xlayer_note nt = {
            .kind = KV_XLAYER_LAYERS, .request = 1000, .layer0 = 0, .n_layers = 1};
        uint64_t peer = 3;
        switch (cases[i].field) {
        case 6:
            nt.n_layers = 0;
            break;
        case 7:
            nt.status = (kv_status)7;
            break;
        case 8:
            nt.request = cases[i].v;
            break;
        case 9:
            peer = cases[i].v;
            break;
        case 10:
            nt.layer0 = 7, nt.n_layers = 2;
            break;
        case 11:
            nt.layer0 = 3;
            break;
        case 12:
            nt.kind = KV_XLAYER_ABORT, nt.n_layers = 0, nt.status = KV_OK;
            break;
        case 13:
            nt.layer0 = 4096;
            break;
        default:
            break;
        }
        struct kv_xport_msg *b = note_msg(peer, &nt);
        switch (cases[i].field) {
        case 0:
            b->tag = cases[i].v;
            break;
        case 1:
            b->len = 31;
            break;
        case 2:
            b->data[0] ^= 0x5A;
            break;
        case 3:
            b->data[4] = 2;
            break;
        case 4:
            b->data[6] = 3;
            break;
        case 5:
            b->data[29] = 1;
            break;
        default:
            break;
        }
        struct kv_xlayer_rx_stats before, after;
        rx_stats(rx, &before);
        const kv_status st = kv_xlayer_rx_feed(rx, b);
        if (st != cases[i].want)
            fail_msg("case %zu: %s, want %s (%s)", i, kv_status_name(st),
                     kv_status_name(cases[i].want), kv_last_error());
        kvt_assert_msg_has(cases[i].word);
        rx_stats(rx, &after);
        before.notes_refused++;
        stats_equal(&before, &after);
        /* nothing landed, nothing failed */
        assert_int_equal(kv_xlayer_rx_wait(rx, 1000, 0, 0), KV_ERR_TIMEOUT);
        assert_int_equal(kv_xlayer_rx_wait(rx, 1000, 2, 0), KV_OK);
        assert_int_equal(kv_xlayer_rx_wait(rx, 1001, 0, 0), KV_ERR_TIMEOUT);
        free(b);
    }
    assert_int_equal(kv_xlayer_rx_wait(rx, 1000, 8, 0), KV_ERR_OUT_OF_BOUNDS);
    assert_int_equal(kv_xlayer_rx_fail(rx, 1000, KV_OK), KV_ERR_INVALID_ARG);
    /* failed here, 1001 is held: prefill's ABORT for it releases it, and a
     * notification after that is late, not refused */
    assert_int_equal(kv_xlayer_rx_fail(rx, 1001, KV_ERR_IO), KV_OK);
    struct kv_xlayer_note ab = {
        .kind = KV_XLAYER_ABORT, .request = 1001, .status = KV_ERR_CANCELLED};
    struct kv_xport_msg *abm = note_msg(3, &ab);
    assert_int_equal(kv_xlayer_rx_feed(rx, abm), KV_OK);
    free(abm);
    struct kv_xlayer_note late = {.kind = KV_XLAYER_LAYERS, .request = 1001, .n_layers = 1};
    struct kv_xport_msg *lm = note_msg(3, &late);
    assert_int_equal(kv_xlayer_rx_feed(rx, lm), KV_OK);
    struct kv_xlayer_rx_stats st;
    rx_stats(rx, &st);
    assert_int_equal(st.notes_late, 1);
    assert_int_equal(st.notes_abort, 1);
    assert_int_equal(st.notes_refused, sizeof(cases) / sizeof(cases[0]));
    assert_int_equal(st.tracked, 2);
    struct kv_xlayer_done done[2];
    uint32_t n = 0;
    /* an out array misaligned for its 8-byte records (written as words:
     * undefined behaviour) is refused before anything is reported */
    _Alignas(struct kv_xlayer_done) char dbuf[4 + 2 * sizeof(struct kv_xlayer_done)];
    struct kv_xlayer_done *dm = (struct kv_xlayer_done *)(void *)(dbuf + 4);
    n = 77;
    assert_int_equal(kv_xlayer_rx_finished(rx, dm, 2, &n), KV_ERR_INVALID_ARG);
    kvt_assert_msg_has("xlayer_rx_finished: out=");
    assert_int_equal(n, 77);
    assert_int_equal(kv_xlayer_rx_finished(rx, done, 2, &n), KV_OK);
    assert_int_equal(n, 1);
    assert_int_equal(done[0].request, 1001);
    assert_int_equal(done[0].status, KV_ERR_IO);
    /* the slot is free again: the limit counts tracked requests */
    assert_int_equal(kv_xlayer_rx_expect(rx, 3, 1002, 4), KV_OK);
    assert_int_equal(kv_xlayer_rx_destroy(rx), KV_OK);
    free(m);
    free(lm);

    /* prefill side */
    kv_xlayer_tx *tx = NULL;
    struct kv_xlayer_tx_config tc = KV_XLAYER_TX_CONFIG_INIT;
    tc.max_layers = 4097;
    assert_int_equal(kv_xlayer_tx_create(&tc, &tx), KV_ERR_INVALID_ARG);
    kvt_assert_msg_has("max_layers 4097");
    tc.max_layers = 4096;
    tc.max_requests = 65536;
    assert_int_equal(kv_xlayer_tx_create(&tc, &tx), KV_ERR_INVALID_ARG);
    kvt_assert_msg_has("max_requests 65536 x max_layers 4096");
    assert_null(tx);
    tc.max_layers = 4;
    tc.max_requests = 1;
    assert_int_equal(kv_xlayer_tx_create(&tc, &tx), KV_OK);
    struct kvt_pair p;
    pair_open(&p);
    assert_int_equal(kv_xlayer_tx_begin(tx, p.pa, 5, 5), KV_ERR_INVALID_ARG);
    kvt_assert_msg_has("n_layers 5");
    assert_int_equal(kv_xlayer_tx_begin(tx, p.pa, 5, 4), KV_OK);
    assert_int_equal(kv_xlayer_tx_begin(tx, p.pa, 5, 4), KV_ERR_BAD_STATE);
    assert_int_equal(kv_xlayer_tx_begin(tx, p.pa, 6, 4), KV_ERR_CAPACITY);
    kvt_assert_msg_has("max_requests");
    assert_int_equal(kv_xlayer_tx_destroy(tx), KV_ERR_BAD_STATE);
    kvt_assert_msg_has("1 request(s) open");
    assert_int_equal(kv_xlayer_tx_wait(tx, 5, 0), KV_ERR_TIMEOUT);
    kvt_assert_msg_has("0 of 4 layers posted");
    assert_int_equal(kv_xlayer_tx_cancel(tx, 5), KV_OK);
    assert_int_equal(kv_xlayer_tx_wait(tx, 5, 5000), KV_ERR_CANCELLED);
    n = 77;
    assert_int_equal(kv_xlayer_tx_finished(tx, dm, 2, &n), KV_ERR_INVALID_ARG);
    kvt_assert_msg_has("xlayer_tx_finished: out=");
    assert_int_equal(n, 77);
    assert_int_equal(kv_xlayer_tx_finished(tx, done, 2, &n), KV_OK);
    assert_int_equal(n, 1);
    assert_int_equal(done[0].status, KV_ERR_CANCELLED);
    assert_int_equal(kv_xlayer_tx_destroy(tx), KV_OK);
    /* the ABORT went out (a request nobody expected here: drained) */
    struct kv_xport_msg *am = malloc(sizeof(*am));
    assert_non_null(am);
    assert_int_equal(kv_xport_notify_poll(p.b, 5000, am), KV_OK);
    struct kv_xlayer_note an;
    assert_int_equal(kv_xlayer_note_decode(am->data, am->len, &an), KV_OK);
    assert_int_equal(an.kind, KV_XLAYER_ABORT);
    assert_int_equal(an.request, 5);
    assert_int_equal(an.status, KV_ERR_CANCELLED);
    free(am);
    kvt_pair_close(&p);
}

/* ---- destroy against its users ------------------------------------- */

struct rx_waiter {
    kv_xlayer_rx *rx;
    kv_status st;
};

static void *rx_waiter_main(void *arg)
{
    struct rx_waiter *w = arg;
    w->st = kv_xlayer_rx_wait(w->rx, 4242, 3, 60000);
    return NULL;
}

/* kv_xlayer_rx_destroy refuses while a thread waits (naming the count) and
 * frees nothing: the waiter is still woken by a failure afterwards, and the
 * destroy succeeds once it left. */
static void test_xport_layers_rx_destroy_refused_while_waiting(void **state)
{
    (void)state;
    kv_xlayer_rx *rx = NULL;
    struct kv_xlayer_rx_config rc = KV_XLAYER_RX_CONFIG_INIT;
    rc.max_requests = 4;
    rc.max_layers = 8;
    assert_int_equal(kv_xlayer_rx_create(&rc, &rx), KV_OK);
    assert_int_equal(kv_xlayer_rx_expect(rx, 11, 4242, 8), KV_OK);
    struct rx_waiter w = {.rx = rx, .st = KV_OK};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, rx_waiter_main, &w), 0);
    struct kv_xlayer_rx_stats s;
    for (;;) { /* until the waiter is inside the wait (no timing asserted) */
        rx_stats(rx, &s);
        if (s.waiting == 1)
            break;
        usleep(1000);
    }
    assert_int_equal(kv_xlayer_rx_destroy(rx), KV_ERR_BAD_STATE);
    kvt_assert_msg_has("1 thread(s) still waiting");
    struct kv_xlayer_rx_stats s2;
    rx_stats(rx, &s2);
    stats_equal(&s, &s2);
    assert_int_equal(s2.tracked, 1);
    assert_int_equal(s2.waiting, 1);
    assert_int_equal(kv_xlayer_rx_fail(rx, 4242, KV_ERR_IO), KV_OK);
    assert_int_equal(pthread_join(th, NULL), 0);
    assert_int_equal(w.st, KV_ERR_IO);
    rx_stats(rx, &s2);
    assert_int_equal(s2.waiting, 0);
    assert_int_equal(kv_xlayer_rx_release(rx, 4242), KV_OK); /* no peer: nothing can land */
    struct kv_xlayer_done done[2];
    uint32_t n = 0;
    assert_int_equal(kv_xlayer_rx_finished(rx, done, 2, &n), KV_OK);
    assert_int_equal(n, 1);
    assert_int_equal(done[0].request, 4242);
    assert_int_equal(done[0].status, KV_ERR_IO);
    assert_int_equal(kv_xlayer_rx_destroy(rx), KV_OK);
}

/* ---- the peer closed under an open request ----------------------------- */

/* The caller closes prefill's peer after posting layer 0 and frees the
 * imported region (allowed: nothing pending); the tracker's request holds
 * the peer (was a use after free: its last transfer freed, then ABORT sent
 * through the freed peer), ends failed, is reported once, and
 * kv_xport_destroy is refused until it is. */
static void test_xport_layers_peer_closed_under_a_request(void **state)
{
    (void)state;
    enum { PL = 3, PREQ = 515 };
    static const uint32_t P0[1] = {0}, PN[1] = {1};
    struct kvt_pair p;
    pair_open(&p);
    struct kvt_side s, d;
    kvt_side_make(&s, PL, 40, 16, 2, 64, KV_BF16, 0, 31);
    kvt_side_make(&d, PL, 40, 16, 2, 64, KV_BF16, 0, 32);
    const uint64_t T = 16 * 3;
    uint32_t sid[3], did[3];
    uint64_t rng = 33;
    kvt_pick_ids(&rng, s.lo.num_blocks, 3, sid);
    kvt_pick_ids(&rng, d.lo.num_blocks, 3, did);
    struct run u;
    run_refs(&u, &s, sid, 3, &d, did, 3, T, 2);
    run_open(&u, &p, &s, &d, P0, PN, 1, PREQ, PL);
    assert_int_equal(
        kv_xlayer_tx_post(u.tx, PREQ, u.plans[0], 0, 1, u.ms, 0, sid, 3, u.r, 0, did, 3, T), KV_OK);
    kv_xport_peer_close(p.pa);
    assert_int_equal(kv_xport_rmem_free(u.r), KV_OK);
    assert_int_equal(kv_xport_destroy(p.a), KV_ERR_BAD_STATE); /* the request holds the peer */
    /* layer 0's transfer ended DONE or CANCELLED (whether it landed before
     * the close is timing); layers 1 and 2 will never come: cancelled, the
     * request fails, its ABORT refused by the closed peer, never sent
     * through a freed one */
    const kv_status cs = kv_xlayer_tx_cancel(u.tx, PREQ);
    assert_true(cs == KV_OK || cs == KV_ERR_BAD_STATE);
    struct kv_xlayer_done done[2];
    uint32_t n = 0;
    assert_int_equal(kv_xlayer_tx_finished(u.tx, done, 2, &n), KV_OK);
    assert_int_equal(n, 1);
    assert_int_equal(done[0].request, PREQ);
    assert_true(done[0].status != KV_OK);
    assert_int_equal(kv_xlayer_tx_finished(u.tx, done, 2, &n), KV_OK);
    assert_int_equal(n, 0);
    assert_int_equal(kv_xlayer_tx_destroy(u.tx), KV_OK);
    assert_int_equal(kv_xlayer_rx_destroy(u.rx), KV_OK);
    assert_int_equal(kv_xport_mem_dereg(u.ms), KV_OK);
    assert_int_equal(kv_xport_destroy(p.a), KV_OK);
    if (kv_xport_mem_unexpose(p.pb, u.md) != KV_OK) /* prefill's close may have ended it */
        kvt_assert_msg_has("not exposed");
    kv_xport_peer_close(p.pb);
    assert_int_equal(kv_xport_mem_dereg(u.md), KV_OK);
    assert_int_equal(kv_xport_destroy(p.b), KV_OK);
    kv_plan_destroy(u.plans[0]);
    kv_plan_destroy(u.whole);
    free(u.ref);
    free(u.src0);
    kvt_side_free(&s);
    kvt_side_free(&d);
}

/* Audit (2026-12-05): a request begun (nothing posted) holds its peer; the
 * caller closes the peer and destroys the transport: refused by name while
 * the request is not reported (it was freed under the request's peer: a use
 * after free in kv_xlayer_tx_finished), then allowed. TCP and SHM. */
static void request_holds_transport(kv_xport_kind kind)
{
    struct kv_xport_config ca = kvt_xport_cfg(kind, false, TOKEN, 0),
                           cb = kvt_xport_cfg(kind, true, TOKEN, 0);
    struct kvt_pair p;
    kvt_pair_open(&p, &ca, &cb);
    struct kv_xlayer_tx_config tc = KV_XLAYER_TX_CONFIG_INIT;
    kv_xlayer_tx *tx = NULL;
    assert_int_equal(kv_xlayer_tx_create(&tc, &tx), KV_OK);
    assert_int_equal(kv_xlayer_tx_begin(tx, p.pa, 42, 2), KV_OK);
    kv_xport_peer_close(p.pa);
    assert_int_equal(kv_xport_destroy(p.a), KV_ERR_BAD_STATE);
    kvt_assert_msg_has("1 layer-by-layer request(s) not reported");
    const kv_status cs = kv_xlayer_tx_cancel(tx, 42);
    assert_true(cs == KV_OK || cs == KV_ERR_BAD_STATE);
    struct kv_xlayer_done done[2];
    uint32_t n = 0;
    for (int i = 0; i < 1000 && n == 0; i++) {
        assert_int_equal(kv_xlayer_tx_finished(tx, done, 2, &n), KV_OK);
        if (n == 0)
            usleep(2000);
    }
    assert_int_equal(n, 1);
    assert_int_equal(done[0].request, 42);
    assert_true(done[0].status != KV_OK);
    assert_int_equal(kv_xport_destroy(p.a), KV_OK); /* reported: the hold is gone */
    assert_int_equal(kv_xlayer_tx_destroy(tx), KV_OK);
    kv_xport_peer_close(p.pb);
    assert_int_equal(kv_xport_destroy(p.b), KV_OK);
}

static void test_xport_layers_request_holds_transport(void **state)
{
    (void)state;
    request_holds_transport(KV_XPORT_TCP);
    request_holds_transport(KV_XPORT_SHM);
}

/* ---- an ABORT decode refused ------------------------------------------- */

/* Audit (2026-12-05): decode's queue of notifications is full (max_pending_notes
 * 1, a note not polled yet) when prefill cancels a request that decode failed
 * itself: the ABORT is refused (its transfer FAILED, note status
 * KV_ERR_CAPACITY). Prefill reported the request terminal anyway and decode,
 * never told, held it for ever; now the ABORT is posted again and the
 * request is terminal once decode queued it, reported once on each side.
 * (One refused for decode's memory is not retried: test_oom_async's
 * layers case, where that shortage lasts, needs prefill's request to end.) */
static void test_xport_layers_abort_refused_posted_again(void **state)
{
    (void)state;
    enum { AREQ = 77 };
    struct kv_xport_config ca = kvt_xport_cfg(KV_XPORT_TCP, false, TOKEN, 0),
                           cb = kvt_xport_cfg(KV_XPORT_TCP, true, TOKEN, 0);
    cb.max_pending_notes = 1;
    struct kvt_pair p;
    kvt_pair_open(&p, &ca, &cb);
    struct kv_xlayer_rx_config rcfg = KV_XLAYER_RX_CONFIG_INIT;
    struct kv_xlayer_tx_config tcfg = KV_XLAYER_TX_CONFIG_INIT;
    kv_xlayer_rx *rx = NULL;
    kv_xlayer_tx *tx = NULL;
    assert_int_equal(kv_xlayer_rx_create(&rcfg, &rx), KV_OK);
    assert_int_equal(kv_xlayer_tx_create(&tcfg, &tx), KV_OK);
    assert_int_equal(kv_xlayer_rx_expect(rx, kv_xport_peer_id(p.pb), AREQ, 2), KV_OK);
    assert_int_equal(kv_xlayer_tx_begin(tx, p.pa, AREQ, 2), KV_OK);
    assert_int_equal(kv_xlayer_rx_fail(rx, AREQ, KV_ERR_TIMEOUT), KV_OK); /* held */
    /* decode's queue filled: one note queued, not polled */
    const unsigned char one = 1;
    const struct kv_xport_notify fill = {.tag = 1, .msg = &one, .len = 1};
    kv_xport_xfer *xf = NULL;
    kv_xport_state xs = KV_XPORT_PENDING;
    assert_int_equal(kv_xport_write(p.pa, NULL, 0, &fill, &xf), KV_OK);
    assert_int_equal(kv_xport_xfer_wait(xf, 10000, &xs), KV_OK);
    assert_int_equal(xs, KV_XPORT_DONE);
    assert_int_equal(kv_xport_xfer_free(xf), KV_OK);
    /* the ABORT is refused while the queue is full: not terminal, not reported */
    assert_int_equal(kv_xlayer_tx_cancel(tx, AREQ), KV_OK);
    assert_int_equal(kv_xlayer_tx_wait(tx, AREQ, 100), KV_ERR_TIMEOUT);
    struct kv_xlayer_done done[2];
    uint32_t n = 0;
    assert_int_equal(kv_xlayer_tx_finished(tx, done, 2, &n), KV_OK);
    assert_int_equal(n, 0);
    /* decode polls the filler: the ABORT goes through, decode reports it */
    struct kv_xport_msg *m = malloc(sizeof(*m));
    assert_non_null(m);
    assert_int_equal(kv_xport_notify_poll(p.b, 10000, m), KV_OK);
    assert_int_equal(m->tag, 1);
    free(m);
    assert_int_equal(kv_xlayer_tx_wait(tx, AREQ, 10000), KV_ERR_CANCELLED);
    assert_int_equal(feed_next(&p, rx), KV_OK);
    assert_int_equal(kv_xlayer_rx_finished(rx, done, 2, &n), KV_OK);
    assert_int_equal(n, 1);
    assert_int_equal(done[0].request, AREQ);
    assert_int_equal(done[0].status, KV_ERR_TIMEOUT);
    assert_int_equal(kv_xlayer_tx_finished(tx, done, 2, &n), KV_OK);
    assert_int_equal(n, 1);
    assert_int_equal(done[0].request, AREQ);
    assert_int_equal(done[0].status, KV_ERR_CANCELLED);
    assert_int_equal(kv_xlayer_tx_destroy(tx), KV_OK);
    assert_int_equal(kv_xlayer_rx_destroy(rx), KV_OK);
    kvt_pair_close(&p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_xport_layers_layer_by_layer),
        cmocka_unit_test(test_xport_layers_k_only),
        cmocka_unit_test(test_xport_layers_failure_fails_request_once),
        cmocka_unit_test(test_xport_layers_limits_refused_by_name),
        cmocka_unit_test(test_xport_layers_rx_destroy_refused_while_waiting),
        cmocka_unit_test(test_xport_layers_peer_closed_under_a_request),
        cmocka_unit_test(test_xport_layers_request_holds_transport),
        cmocka_unit_test(test_xport_layers_abort_refused_posted_again),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
