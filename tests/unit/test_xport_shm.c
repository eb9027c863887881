/*
 * test_xport_shm.c - the transport seam over its same-host backend
 * (KV_XPORT_SHM, connector/transport/kv_xport_shm*.c), in one process and
 * in two.
 *
 *   - refusals of bad config (kind, host, a path too long, a name nobody
 *     listens on) and of the handshake (token, fingerprint: named); a
 *     filesystem socket path as the address;
 *   - writes with a notification into a 16 MiB region at offsets far from
 *     0 up to its last byte, the whole region compared (the bytes outside
 *     the writes untouched), the notification after the data; reads back;
 *     many small entries packed into one slot;
 *   - the receiver's own check: a forged imported region, an unexposed
 *     region: those entries FAILED with KV_ERR_OUT_OF_BOUNDS, nothing of
 *     them written; a read outside the exposure refused;
 *   - kv_xport_write_plan between other layouts (NHD -> HND, padded,
 *     block-major, another page size, a layer range) with block ids far
 *     from 0: the whole destination pool against kv_plan_copy;
 *   - unexpose while a large write lands: when it returns nothing more of
 *     that peer lands (the region snapshot stays as it was);
 *   - cancel in flight; a peer (a child process) SIGKILLed mid-transfer:
 *     the survivor's transfer ends FAILED, its peer CLOSED with KV_ERR_IO;
 *   - handles released in any order (destroy refused while held, an
 *     imported region refused while a transfer names it);
 *   - a hostile peer on a raw socket: an unsealed memfd refused, a DATA
 *     naming a slot outside the ring closes the peer (KV_ERR_CORRUPT); a
 *     peer that never ACKs: the write TIMED_OUT within timeout_ms, the late
 *     ACK only returns the slot; a full notification queue refuses by name;
 *     a peer that reads nothing is closed (TIMEOUT, sends_stalled); a pipe,
 *     a directory, a small, read-only or write-sealed memfd: refused
 *     KV_ERR_CORRUPT, named, no descriptor kept.
 */
#include <errno.h>
#include <fcntl.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <dirent.h>

#include <cmocka.h>
#include <xxhash.h>

#include <kvcache/kv.h>
#include "kv_xport_shm_int.h"
#include "kvt_side.h"
#include "kvt_xport.h"
#include "kvtest.h"

#define TOKEN 0x5EC12E8ull
#define REGION (16u << 20)

/* gather_below: both ends' plan_gather_below_bytes (0: the default). */
static void pair_open_gather(struct kvt_pair *p, uint32_t gather_below)
{
    struct kv_xport_config ca = kvt_xport_cfg(KV_XPORT_SHM, false, TOKEN, 7),
                           cb = kvt_xport_cfg(KV_XPORT_SHM, true, TOKEN, 7);
    ca.plan_gather_below_bytes = cb.plan_gather_below_bytes = gather_below;
    kvt_pair_open(p, &ca, &cb);
}

static void pair_open(struct kvt_pair *p)
{
    pair_open_gather(p, 0);
}

/* Data landed, notification refused (decode's queue full): the sender
 * sees which (kvt_note_refused_for_capacity). */
static void test_xport_shm_note_refused_for_capacity(void **state)
{
    (void)state;
    kvt_note_refused_for_capacity(KV_XPORT_SHM, TOKEN);
}

static void test_xport_shm_refusals(void **state)
{
    (void)state;
    kv_xport *x = NULL;
    struct kv_xport_config c = kvt_xport_cfg(KV_XPORT_SHM, true, TOKEN, 0);
    c.kind = (kv_xport_kind)5;
    assert_int_equal(kv_xport_create(&c, &x), KV_ERR_INVALID_ARG);
    assert_non_null(strstr(kv_last_error(), "shm 3, auto 4"));
    assert_string_equal(kv_xport_kind_name(KV_XPORT_SHM), "shm");
    c = kvt_xport_cfg(KV_XPORT_SHM, true, TOKEN, 0);
    c.listen_host = "";
    assert_int_equal(kv_xport_create(&c, &x), KV_ERR_INVALID_ARG);
    char longp[120];
    memset(longp, 'a', sizeof(longp) - 1);
    longp[0] = '/';
    longp[sizeof(longp) - 1] = 0;
    c.listen_host = longp;
    assert_int_equal(kv_xport_create(&c, &x), KV_ERR_INVALID_ARG);
    c.token = 0;
    c.listen_host = "test";
    assert_int_equal(kv_xport_create(&c, &x), KV_ERR_INVALID_ARG);

    /* Nobody listens there. */
    struct kv_xport_config ca = kvt_xport_cfg(KV_XPORT_SHM, false, TOKEN, 0);
    kv_xport *a = NULL;
    kv_xport_peer *pa = NULL;
    assert_int_equal(kv_xport_create(&ca, &a), KV_OK);
    assert_int_equal(kv_xport_connect(a, "nobody-here", 9, &pa), KV_ERR_IO);
    assert_non_null(strstr(kv_last_error(), "nobody-here"));
    assert_int_equal(kv_xport_connect(a, longp, 0, &pa), KV_ERR_INVALID_ARG);
    assert_non_null(strstr(kv_last_error(), "socket path"));

    /* A listener on a filesystem path; a token, then a fingerprint refused
     * by name, the refused peer never accepted. */
    char path[64];
    snprintf(path, sizeof(path), "/tmp/kvshm-test-%d.sock", (int)getpid());
    c = kvt_xport_cfg(KV_XPORT_SHM, true, TOKEN, 5);
    c.listen_host = path;
    kv_xport *b = NULL;
    assert_int_equal(kv_xport_create(&c, &b), KV_OK);
    assert_int_equal(access(path, F_OK), 0);
    kv_xport *a2 = NULL;
    struct kv_xport_config cw = kvt_xport_cfg(KV_XPORT_SHM, false, TOKEN + 1, 5);
    assert_int_equal(kv_xport_create(&cw, &a2), KV_OK);
    assert_int_equal(kv_xport_connect(a2, path, 0, &pa), KV_OK);
    kv_status why = KV_OK;
    assert_int_equal(kvt_xport_settle(pa, &why), KV_XPORT_CLOSED);
    assert_int_equal(why, KV_ERR_MISMATCH);
    kv_xport_peer_close(pa);
    assert_int_equal(kv_xport_destroy(a2), KV_OK);
    cw = kvt_xport_cfg(KV_XPORT_SHM, false, TOKEN, 6);
    assert_int_equal(kv_xport_create(&cw, &a2), KV_OK);
    assert_int_equal(kv_xport_connect(a2, path, 0, &pa), KV_OK);
    assert_int_equal(kvt_xport_settle(pa, &why), KV_XPORT_CLOSED);
    assert_int_equal(why, KV_ERR_MISMATCH);
    kv_xport_peer_close(pa);
    assert_int_equal(kv_xport_destroy(a2), KV_OK);
    kv_xport_peer *pb = NULL;
    assert_int_equal(kv_xport_accept(b, 100, &pb), KV_ERR_TIMEOUT);
    struct kv_xport_stats st = KV_XPORT_STATS_INIT;
    assert_int_equal(kv_xport_stats_get(b, &st), KV_OK);
    assert_int_equal(st.peers_refused, 2);
    /* the right one: ready both ways */
    cw = kvt_xport_cfg(KV_XPORT_SHM, false, TOKEN, 5);
    assert_int_equal(kv_xport_create(&cw, &a2), KV_OK);
    assert_int_equal(kv_xport_connect(a2, path, 0, &pa), KV_OK);
    assert_int_equal(kv_xport_accept(b, 5000, &pb), KV_OK);
    assert_int_equal(kvt_xport_settle(pa, NULL), KV_XPORT_READY);
    /* destroy refused while the peer is held */
    assert_int_equal(kv_xport_destroy(b), KV_ERR_BAD_STATE);
    kv_xport_peer_close(pb);
    kv_xport_peer_close(pa);
    assert_int_equal(kv_xport_destroy(b), KV_OK);
    assert_int_equal(access(path, F_OK), -1);
    assert_int_equal(kv_xport_destroy(a2), KV_OK);
    assert_int_equal(kv_xport_destroy(a), KV_OK);
}

static void test_xport_shm_write_read_whole_region(void **state)
{
    (void)state;
    struct kvt_pair p;
    pair_open(&p);
    struct kvt_region g;
    kvt_region_open(&g, &p, REGION, 11);

    /* 200 entries: random sizes (1 byte .. 1 MiB; most small, so many
     * share a slot), disjoint destinations, the last ending at the last
     * byte. */
    enum { NE = 200 };
    struct kv_xport_io *ios = malloc(NE * sizeof(*ios));
    kvt_region_ios(&g, ios, NE, 8, REGION / NE - 1, 3000, 5);
    struct kv_xport_msg *msg = malloc(sizeof(*msg));
    kvt_region_write_noted(&p, &g, ios, NE, msg);

    /* Read the same ranges back into `back` at their offsets. */
    unsigned char *bwant = calloc(1, REGION);
    kvt_region_read_back(&p, &g, ios, NE, bwant);

    /* Post-time refusals. */
    kv_xport_xfer *t = NULL;
    struct kv_xport_io b1 = {g.ms, 0, g.r, REGION - 10, 11};
    assert_int_equal(kv_xport_write(p.pa, &b1, 1, NULL, &t), KV_ERR_OUT_OF_BOUNDS);
    assert_non_null(strstr(kv_last_error(), "entry 0"));

    /* The receiver's own check: a forged rmem claims more than b has. */
    g.r->bytes = 2ull * REGION;
    kvt_region_write_forged(&p, &g);
    /* a read past the end: refused by b, nothing read */
    const kv_status *st;
    uint32_t ns;
    struct kv_xport_io rb = {g.mb, 0, g.r, REGION - 8, 64};
    assert_int_equal(kv_xport_read(p.pa, &rb, 1, &t), KV_OK);
    kvt_xfer_done(t, KV_XPORT_FAILED);
    assert_int_equal(kv_xport_xfer_results(t, &st, &ns), KV_OK);
    assert_int_equal(st[0], KV_ERR_OUT_OF_BOUNDS);
    assert_int_equal(kv_xport_xfer_free(t), KV_OK);
    assert_memory_equal(g.back, bwant, REGION);
    assert_int_equal(kv_xport_notify_poll(p.b, 100, msg), KV_ERR_TIMEOUT);
    g.r->bytes = REGION;

    /* Unexposed: writes refused by the receiver. */
    assert_int_equal(kv_xport_mem_unexpose(p.pb, g.md), KV_OK);
    struct kv_xport_io one = {g.ms, 0, g.r, 0, 4096};
    assert_int_equal(kv_xport_write(p.pa, &one, 1, NULL, &t), KV_OK);
    kvt_xfer_done(t, KV_XPORT_FAILED);
    assert_int_equal(kv_xport_xfer_free(t), KV_OK);
    assert_memory_equal(g.dst, g.want, REGION);

    kvt_region_close(&g, &p);
    free(ios);
    free(bwant);
    free(msg);
}

/* kv_xport_write_plan into other layouts, sent gathered (the sender packs
 * the source's small runs into each slot) and direct (one entry per run):
 * the whole destination pool against kv_plan_copy of the same request. */
static void test_xport_shm_write_plan(void **state)
{
    (void)state;
    struct kvt_pair pairs[2];
    pair_open_gather(&pairs[0], UINT32_MAX);
    pair_open_gather(&pairs[1], 1);
    /* {source bits, destination bits, destination page} (kvt_side_make:
     * 1 HND, 2 block-major, 4 padded, 8 packed K|V) */
    static const int cases[][3] = {{0, 1, 16}, {1, 6, 32}, {4, 5, 8}, {2, 0, 16}, {8, 9, 16}};
    uint64_t rng = 99, tag = 500;
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        const int64_t Ls = 3, Ld = 4;
        struct kv_plan_config pc = KV_PLAN_CONFIG_INIT;
        pc.n_layers = 2;
        pc.src_layer0 = 1;
        pc.dst_layer0 = (int64_t)c % 3;
        struct kvt_side s, d;
        kvt_side_make(&s, Ls, 100, 16, 4, 64, KV_BF16, cases[c][0], tag);
        kvt_side_make(&d, Ld, 100, cases[c][2], 4, 64, KV_BF16, cases[c][1], tag + 1);
        kv_plan *plan = NULL;
        assert_int_equal(kv_plan_create(&s.lo, &d.lo, &pc, &plan), KV_OK);
        const uint64_t T = (uint64_t)kvt_range(&rng, 100, 600);
        const uint32_t ns = (uint32_t)((T + 15) / 16);
        const uint32_t nd =
            (uint32_t)((T + (uint64_t)d.lo.block_tokens - 1) / (uint64_t)d.lo.block_tokens);
        uint32_t sid[64], did[128];
        kvt_pick_ids(&rng, s.lo.num_blocks, ns, sid);
        kvt_pick_ids(&rng, d.lo.num_blocks, nd, did);
        const size_t db = (size_t)d.lo.total_bytes;
        unsigned char *want = malloc(db), *dst0 = malloc(db);
        memcpy(want, d.mem, db);
        memcpy(dst0, d.mem, db);
        const struct kv_paged_cache wc = {d.lo, want, db, KV_MEM_HOST};
        assert_int_equal(kv_plan_copy(plan, s.pc, sid, ns, wc, did, nd, T), KV_OK);

        for (int g = 0; g < 2; g++) {
            struct kvt_pair p = pairs[g];
            kv_xport_mem *ms = NULL, *md = NULL;
            struct kv_xport_stats s0 = KV_XPORT_STATS_INIT, s1 = KV_XPORT_STATS_INIT;
            assert_int_equal(kv_xport_stats_get(p.a, &s0), KV_OK);
            assert_int_equal(
                kv_xport_mem_reg(p.a, s.mem, (size_t)s.lo.total_bytes, KV_MEM_HOST, &ms), KV_OK);
            assert_int_equal(kv_xport_mem_reg(p.b, d.mem, db, KV_MEM_HOST, &md), KV_OK);
            kv_xport_rmem *r = kvt_share_notify(&p, md);
            struct kv_xport_notify n = {.tag = tag};
            kv_xport_xfer *t = NULL;
            kv_status st =
                kv_xport_write_plan(p.pa, plan, ms, 0, sid, ns, r, 0, did, nd, T, &n, &t);
            if (st != KV_OK)
                fail_msg("kv_xport_write_plan: %s: %s", kv_status_name(st), kv_last_error());
            struct kv_xport_msg *msg = malloc(sizeof(*msg));
            assert_int_equal(kv_xport_notify_poll(p.b, 10000, msg), KV_OK);
            assert_int_equal(msg->tag, tag);
            const int64_t at = kvt_first_diff(want, d.mem, d.lo.total_bytes);
            if (at >= 0)
                fail_msg("case %zu (%s): destination byte %lld of %lld differs", c,
                         g ? "direct" : "gathered", (long long)at, (long long)d.lo.total_bytes);
            kvt_xfer_done(t, KV_XPORT_DONE);
            assert_int_equal(kv_xport_stats_get(p.a, &s1), KV_OK);
            assert_int_equal(s1.plans_gathered - s0.plans_gathered, g ? 0 : 1);
            assert_int_equal(kv_xport_xfer_free(t), KV_OK);
            assert_int_equal(kv_xport_mem_unexpose(p.pb, md), KV_OK);
            assert_int_equal(kv_xport_rmem_free(r), KV_OK);
            assert_int_equal(kv_xport_mem_dereg(md), KV_OK);
            assert_int_equal(kv_xport_mem_dereg(ms), KV_OK);
            free(msg);
            memcpy(d.mem, dst0, db); /* the next pair starts from the same pool */
            tag++;
        }
        free(want);
        free(dst0);
        kv_plan_destroy(plan);
        kvt_side_free(&s);
        kvt_side_free(&d);
    }
    kvt_pair_close(&pairs[0]);
    kvt_pair_close(&pairs[1]);
}

/* Unexpose while a large write lands; cancel in flight; handles in any
 * order. */
static void test_xport_shm_unexpose_cancel_any_order(void **state)
{
    (void)state;
    struct kvt_pair p;
    pair_open(&p);
    unsigned char *src = malloc(REGION), *dst = calloc(1, REGION), *snap = malloc(REGION);
    kvt_fill(src, REGION, 21);
    kv_xport_mem *ms, *md;
    assert_int_equal(kv_xport_mem_reg(p.a, src, REGION, KV_MEM_HOST, &ms), KV_OK);
    assert_int_equal(kv_xport_mem_reg(p.b, dst, REGION, KV_MEM_HOST, &md), KV_OK);
    kv_xport_rmem *r = kvt_share_notify(&p, md);
    enum { NE = 8 };
    struct kv_xport_io ios[NE];
    for (int i = 0; i < NE; i++)
        ios[i] = (struct kv_xport_io){ms, 0, r, 0, REGION};
    kv_xport_xfer *t = NULL;
    assert_int_equal(kv_xport_write(p.pa, ios, NE, NULL, &t), KV_OK);
    /* refused while a transfer names them */
    assert_int_equal(kv_xport_rmem_free(r), KV_ERR_BAD_STATE);
    assert_int_equal(kv_xport_mem_dereg(ms), KV_ERR_BAD_STATE);
    usleep(2000);
    assert_int_equal(kv_xport_mem_unexpose(p.pb, md), KV_OK);
    memcpy(snap, dst, REGION);
    kv_xport_state s;
    assert_int_equal(kv_xport_xfer_wait(t, 10000, &s), KV_OK);
    assert_true(s == KV_XPORT_FAILED || s == KV_XPORT_DONE);
    const kv_status *st;
    uint32_t ns;
    assert_int_equal(kv_xport_xfer_results(t, &st, &ns), KV_OK);
    for (uint32_t i = 0; i < ns; i++)
        assert_true(st[i] == KV_OK || st[i] == KV_ERR_OUT_OF_BOUNDS);
    assert_memory_equal(dst, snap, REGION); /* nothing landed after unexpose returned */
    assert_int_equal(kv_xport_xfer_free(t), KV_OK);
    assert_int_equal(kv_xport_rmem_free(r), KV_OK);

    /* Cancel in flight: CANCELLED, its notification never delivered; the
     * next one is. */
    r = kvt_share_notify(&p, md);
    for (int i = 0; i < NE; i++)
        ios[i].remote = r;
    struct kv_xport_notify n = {.tag = 77};
    assert_int_equal(kv_xport_write(p.pa, ios, NE, &n, &t), KV_OK);
    assert_int_equal(kv_xport_xfer_cancel(t), KV_OK);
    assert_int_equal(kv_xport_xfer_wait(t, 10000, &s), KV_OK);
    assert_int_equal(s, KV_XPORT_CANCELLED);
    assert_int_equal(kv_xport_xfer_free(t), KV_OK);
    struct kv_xport_io one = {ms, 4096, r, 8192, 100000};
    struct kv_xport_notify n2 = {.tag = 78};
    assert_int_equal(kv_xport_write(p.pa, &one, 1, &n2, &t), KV_OK);
    struct kv_xport_msg *msg = malloc(sizeof(*msg));
    assert_int_equal(kv_xport_notify_poll(p.b, 10000, msg), KV_OK);
    assert_int_equal(msg->tag, 78);
    assert_memory_equal(dst + 8192, src + 4096, 100000);
    kvt_xfer_done(t, KV_XPORT_DONE);

    /* Any order: the peer closed before its transfer and imported region
     * are freed; destroy refused until everything is released. */
    kv_xport_peer_close(p.pa);
    assert_int_equal(kv_xport_destroy(p.a), KV_ERR_BAD_STATE);
    assert_int_equal(kv_xport_xfer_free(t), KV_OK);
    assert_int_equal(kv_xport_destroy(p.a), KV_ERR_BAD_STATE);
    assert_int_equal(kv_xport_rmem_free(r), KV_OK);
    assert_int_equal(kv_xport_mem_dereg(ms), KV_OK);
    assert_int_equal(kv_xport_destroy(p.a), KV_OK);
    /* b sees a clean close; its exposure ends with the peer */
    kv_status why = KV_ERR_INTERNAL;
    for (int i = 0; i < 5000; i++) {
        kv_xport_peer_state ps;
        assert_int_equal(kv_xport_peer_state_get(p.pb, &ps, &why), KV_OK);
        if (ps == KV_XPORT_CLOSED)
            break;
        usleep(1000);
    }
    assert_int_equal(why, KV_OK);
    assert_int_equal(kv_xport_mem_dereg(md), KV_OK); /* its exposure ended with pb */
    kv_xport_peer_close(p.pb);
    assert_int_equal(kv_xport_destroy(p.b), KV_OK);
    free(msg);
    free(src);
    free(dst);
    free(snap);
}

/* The receiver in a child process, SIGKILLed while a long write is in
 * flight: the transfer ends FAILED, the peer CLOSED with KV_ERR_IO. */
static int sink_child(int fd)
{
    kv_xport *x = NULL;
    kv_xport_peer *p = NULL;
    kv_xport_mem *m = NULL;
    unsigned char blob[KV_XPORT_BLOB_MAX];
    size_t bl = 0;
    const int rc = kvt_sink_open(KV_XPORT_SHM, TOKEN, fd, REGION, &x, &p, &m, blob, &bl);
    if (rc)
        return rc;
    struct kv_xport_notify n = {.tag = 1, .msg = blob, .len = (uint32_t)bl};
    kv_xport_xfer *t = NULL;
    if (kv_xport_write(p, NULL, 0, &n, &t) != KV_OK)
        return 5;
    pause(); /* until killed */
    return 0;
}

static void test_xport_shm_peer_killed(void **state)
{
    (void)state;
    unsigned char *src = malloc(REGION);
    kvt_fill(src, REGION, 3);
    int rfd = -1;
    const pid_t pid = kvt_xport_fork(sink_child, &rfd);
    kv_xport *x = NULL;
    kv_xport_peer *p = NULL;
    kv_xport_mem *ms = NULL;
    kv_xport_rmem *r = NULL;
    kvt_sink_join(KV_XPORT_SHM, TOKEN, rfd, src, REGION, &x, &p, &ms, &r);
    /* 256 x 16 MiB: in flight when the kill comes */
    enum { NE = 256 };
    struct kv_xport_io *ios = malloc(NE * sizeof(*ios));
    for (int i = 0; i < NE; i++)
        ios[i] = (struct kv_xport_io){ms, 0, r, 0, REGION};
    struct kv_xport_notify n = {.tag = 55};
    kv_xport_xfer *t = NULL;
    assert_int_equal(kv_xport_write(p, ios, NE, &n, &t), KV_OK);
    usleep(20000);
    assert_int_equal(kill(pid, SIGKILL), 0);
    kvt_xfer_peer_lost(t, p);
    waitpid(pid, NULL, 0);
    kvt_xfer_some_failed(t);
    kvt_sink_leave(rfd, x, p, ms, r);
    free(ios);
    free(src);
}

/* ---- prefill -> decode in two processes ----------------------------- */

/* Decode's pools: three layouts unlike prefill's (bits as kvt_side_make;
 * page sizes 8, 32, 16), the same in both processes (seeded). */
static const int pd_bits[3] = {1, 6, 13};
static const int64_t pd_page[3] = {8, 32, 16};

static void pd_pools(struct kvt_side *d)
{
    for (int i = 0; i < 3; i++)
        kvt_side_make(&d[i], 2, 160, pd_page[i], 4, 64, KV_BF16, pd_bits[i], 900 + (uint64_t)i);
}

/* The decode child: exposes its three pools, sends their blobs, takes a
 * notification per request, then sends the XXH3 of each whole pool. */
static int pd_child(int wfd, int rfd)
{
    struct kvt_side d[3];
    pd_pools(d);
    struct kv_xport_config c = kvt_xport_cfg(KV_XPORT_SHM, true, TOKEN, 0);
    kv_xport *x = NULL;
    kv_xport_peer *p = NULL;
    if (kv_xport_create(&c, &x) != KV_OK)
        return 1;
    const uint16_t port = kv_xport_port(x);
    if (write(wfd, &port, 2) != 2 || kv_xport_accept(x, 10000, &p) != KV_OK)
        return 2;
    kv_xport_mem *m[3];
    for (int i = 0; i < 3; i++) {
        unsigned char blob[KV_XPORT_BLOB_MAX];
        size_t bl = 0;
        if (kv_xport_mem_reg(x, d[i].mem, (size_t)d[i].lo.total_bytes, KV_MEM_HOST, &m[i]) !=
                KV_OK ||
            kv_xport_mem_expose(p, m[i], blob, sizeof(blob), &bl) != KV_OK)
            return 3;
        const uint32_t n = (uint32_t)bl;
        if (write(wfd, &n, 4) != 4 || write(wfd, blob, bl) != (ssize_t)bl)
            return 4;
    }
    uint32_t nreq = 0;
    if (read(rfd, &nreq, 4) != 4)
        return 5;
    struct kv_xport_msg *msg = malloc(sizeof(*msg));
    for (uint32_t i = 0; i < nreq; i++)
        if (kv_xport_notify_poll(x, 30000, msg) != KV_OK || msg->tag != 1000 + i)
            return 6;
    for (int i = 0; i < 3; i++) {
        const uint64_t h = XXH3_64bits(d[i].mem, (size_t)d[i].lo.total_bytes);
        if (write(wfd, &h, 8) != 8)
            return 7;
    }
    char q;
    if (read(rfd, &q, 1) != 1)
        return 8;
    kv_xport_peer_close(p);
    for (int i = 0; i < 3; i++)
        if (kv_xport_mem_dereg(m[i]) != KV_OK)
            return 9;
    free(msg);
    return kv_xport_destroy(x) == KV_OK ? 0 : 10;
}

/* Prefill (this process) writes requests of random lengths with
 * kv_xport_write_plan into decode's three layouts (block ids spread over
 * the pools, gathered where runs are small), one notification each, and
 * applies the same requests with kv_plan_copy to its own copies of
 * decode's pools: decode's whole pools must hash the same. */
static void test_xport_shm_prefill_to_decode_two_procs(void **state)
{
    (void)state;
    int up[2], down[2];
    assert_int_equal(pipe(up), 0);
    assert_int_equal(pipe(down), 0);
    fflush(NULL);
    const pid_t pid = fork();
    if (pid == 0) {
        close(up[0]);
        close(down[1]);
        _exit(pd_child(up[1], down[0]));
    }
    close(up[1]);
    close(down[0]);
    struct kvt_side s, d[3];
    kvt_side_make(&s, 2, 120, 16, 4, 64, KV_BF16, 0, 77);
    pd_pools(d); /* the reference: decode's pools as they start */
    uint16_t port = 0;
    assert_int_equal(read(up[0], &port, 2), 2);
    struct kv_xport_config c = kvt_xport_cfg(KV_XPORT_SHM, false, TOKEN, 0);
    kv_xport *x = NULL;
    kv_xport_peer *p = NULL;
    assert_int_equal(kv_xport_create(&c, &x), KV_OK);
    assert_int_equal(kv_xport_connect(x, "test", port, &p), KV_OK);
    assert_int_equal(kvt_xport_settle(p, NULL), KV_XPORT_READY);
    kv_xport_mem *ms = NULL;
    assert_int_equal(kv_xport_mem_reg(x, s.mem, (size_t)s.lo.total_bytes, KV_MEM_HOST, &ms), KV_OK);
    kv_xport_rmem *r[3];
    kv_plan *plan[3];
    for (int i = 0; i < 3; i++) {
        uint32_t n = 0;
        unsigned char blob[KV_XPORT_BLOB_MAX];
        assert_int_equal(read(up[0], &n, 4), 4);
        assert_true(n <= sizeof(blob));
        assert_int_equal(read(up[0], blob, n), (ssize_t)n);
        assert_int_equal(kv_xport_rmem_import(p, blob, n, &r[i]), KV_OK);
        assert_int_equal(kv_plan_create(&s.lo, &d[i].lo, NULL, &plan[i]), KV_OK);
    }
    enum { NREQ = 12 };
    const uint32_t nreq = NREQ;
    assert_int_equal(write(down[1], &nreq, 4), 4);
    uint64_t rng = 31337;
    for (uint32_t q = 0; q < NREQ; q++) {
        const int i = (int)(q % 3);
        const uint64_t T = (uint64_t)kvt_range(&rng, 1, 700);
        const uint32_t ns = (uint32_t)((T + 15) / 16);
        const uint32_t nd = (uint32_t)((T + (uint64_t)pd_page[i] - 1) / (uint64_t)pd_page[i]);
        uint32_t sid[64], did[128];
        kvt_pick_ids(&rng, s.lo.num_blocks, ns, sid);
        kvt_pick_ids(&rng, d[i].lo.num_blocks, nd, did);
        struct kv_xport_notify n = {.tag = 1000 + q};
        kv_xport_xfer *t = NULL;
        assert_int_equal(
            kv_xport_write_plan(p, plan[i], ms, 0, sid, ns, r[i], 0, did, nd, T, &n, &t), KV_OK);
        assert_int_equal(kv_plan_copy(plan[i], s.pc, sid, ns, d[i].pc, did, nd, T), KV_OK);
        kvt_xfer_done(t, KV_XPORT_DONE);
        assert_int_equal(kv_xport_xfer_free(t), KV_OK);
    }
    for (int i = 0; i < 3; i++) {
        uint64_t h = 0;
        assert_int_equal(read(up[0], &h, 8), 8);
        if (h != XXH3_64bits(d[i].mem, (size_t)d[i].lo.total_bytes))
            fail_msg("decode pool %d (bits %d, page %lld) differs from kv_plan_copy's", i,
                     pd_bits[i], (long long)pd_page[i]);
    }
    assert_int_equal(write(down[1], "q", 1), 1);
    int wst = 0;
    waitpid(pid, &wst, 0);
    assert_true(WIFEXITED(wst));
    assert_int_equal(WEXITSTATUS(wst), 0);
    for (int i = 0; i < 3; i++) {
        assert_int_equal(kv_xport_rmem_free(r[i]), KV_OK);
        kv_plan_destroy(plan[i]);
        kvt_side_free(&d[i]);
    }
    kv_xport_peer_close(p);
    assert_int_equal(kv_xport_mem_dereg(ms), KV_OK);
    assert_int_equal(kv_xport_destroy(x), KV_OK);
    kvt_side_free(&s);
    close(up[0]);
    close(down[1]);
}

/* ---- a hostile peer on a raw socket --------------------------------- */

static void raw_send(int fd, struct kv__shm_msg m, const void *p, uint32_t plen, int mfd)
{
    unsigned char b[KV__SHM_MSG_MAX];
    m.version = KV_XPORT_PROTOCOL_VERSION;
    m.plen = plen;
    kv__shm_msg_encode(&m, b);
    memcpy(b + KV__SHM_HDR, p, plen);
    union {
        struct cmsghdr h;
        char c[CMSG_SPACE(sizeof(int))];
    } cm;
    memset(&cm, 0, sizeof(cm));
    struct iovec iov = {b, KV__SHM_HDR + plen};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
    if (mfd >= 0) {
        mh.msg_control = cm.c;
        mh.msg_controllen = sizeof(cm.c);
        struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(c), &mfd, sizeof(int));
    }
    assert_int_equal(sendmsg(fd, &mh, MSG_NOSIGNAL), (ssize_t)(KV__SHM_HDR + plen));
}

static void raw_hello(int fd, int mfd)
{
    unsigned char h[KV__XPORT_HELLO_BYTES];
    const struct kv__xport_hello hh = {.version = KV_XPORT_PROTOCOL_VERSION,
                                       .kind = KV_XPORT_SHM,
                                       .token = TOKEN,
                                       .nonce = 0x1234,
                                       .conns = 2};
    kv__xport_hello_encode(&hh, h);
    raw_send(fd,
             (struct kv__shm_msg){.type = KV__SM_HELLO, .slot = KV__SHM_SLOTS, .len = KV__SHM_SLOT},
             h, sizeof(h), mfd);
}

static void test_xport_shm_hostile_peer(void **state)
{
    (void)state;
    struct kv_xport_config c = kvt_xport_cfg(KV_XPORT_SHM, true, TOKEN, 0);
    kv_xport *x = NULL;
    assert_int_equal(kv_xport_create(&c, &x), KV_OK);
    /* an unsealed memfd: refused (never accepted) */
    int sv[2];
    assert_int_equal(socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv), 0);
    assert_int_equal(kv__shm_adopt(x, sv[0]), KV_OK);
    int mfd = memfd_create("t", 0);
    assert_true(mfd >= 0);
    assert_int_equal(ftruncate(mfd, 2 * (off_t)KV__SHM_RING_BYTES), 0);
    raw_hello(sv[1], mfd);
    unsigned char b[KV__SHM_MSG_MAX];
    assert_true(recv(sv[1], b, sizeof(b), 0) >= KV__SHM_HDR); /* the REFUSE */
    struct kv__shm_msg m;
    assert_int_equal(kv__shm_msg_decode(b, KV__SHM_HDR + (size_t)kv__le_get(b + 56, 4), &m), KV_OK);
    assert_int_equal(m.type, KV__SM_REFUSE);
    assert_int_equal(m.status, KV_ERR_CORRUPT);
    close(mfd);
    close(sv[1]);
    /* sealed: accepted; then a DATA naming a slot outside the ring */
    assert_int_equal(socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv), 0);
    assert_int_equal(kv__shm_adopt(x, sv[0]), KV_OK);
    mfd = memfd_create("t", MFD_ALLOW_SEALING);
    assert_int_equal(ftruncate(mfd, 2 * (off_t)KV__SHM_RING_BYTES), 0);
    assert_int_equal(fcntl(mfd, F_ADD_SEALS, F_SEAL_SHRINK), 0);
    raw_hello(sv[1], mfd);
    kv_xport_peer *p = NULL;
    assert_int_equal(kv_xport_accept(x, 5000, &p), KV_OK);
    unsigned char d[KV__SHM_DESC] = {0};
    kv__le_put(d + 16, 10, 8);
    raw_send(
        sv[1],
        (struct kv__shm_msg){.type = KV__SM_DATA, .slot = KV__SHM_SLOTS, .entry = 1, .len = 10}, d,
        sizeof(d), -1);
    kv_status why = KV_OK;
    for (int i = 0; i < 5000; i++) {
        kv_xport_peer_state ps;
        assert_int_equal(kv_xport_peer_state_get(p, &ps, &why), KV_OK);
        if (ps == KV_XPORT_CLOSED)
            break;
        usleep(1000);
    }
    assert_int_equal(why, KV_ERR_CORRUPT);
    kv_xport_peer_close(p);
    close(mfd);
    close(sv[1]);
    assert_int_equal(kv_xport_destroy(x), KV_OK);
}

/* The next message the transport sent on fd (waiting up to 5 s); its
 * payload into pl (cap bytes). */
static struct kv__shm_msg raw_next(int fd, unsigned char *pl, size_t cap)
{
    unsigned char b[KV__SHM_MSG_MAX + 8];
    for (int i = 0; i < 5000; i++) {
        const ssize_t r = recv(fd, b, sizeof(b), MSG_DONTWAIT);
        if (r > 0) {
            struct kv__shm_msg m;
            assert_int_equal(kv__shm_msg_decode(b, (size_t)r, &m), KV_OK);
            memcpy(pl, b + KV__SHM_HDR, m.plen < cap ? m.plen : cap);
            return m;
        }
        usleep(1000);
    }
    fail_msg("no message from the transport");
    return (struct kv__shm_msg){0};
}

/* A transport of config c with a raw peer joined over a socketpair (its
 * end sv[1], its ring memfd mfd) and accepted (p), the HELLO read, and a
 * region the raw peer claims (region 7, 1 MiB) imported (r). */
struct shm_raw {
    kv_xport *x;
    int sv[2], mfd;
    kv_xport_peer *p;
    kv_xport_rmem *r;
};

static void shm_raw_open(struct shm_raw *o, const struct kv_xport_config *c)
{
    assert_int_equal(kv_xport_create(c, &o->x), KV_OK);
    assert_int_equal(socketpair(AF_UNIX, SOCK_SEQPACKET, 0, o->sv), 0);
    assert_int_equal(kv__shm_adopt(o->x, o->sv[0]), KV_OK);
    o->mfd = memfd_create("t", MFD_ALLOW_SEALING);
    assert_int_equal(ftruncate(o->mfd, 2 * (off_t)KV__SHM_RING_BYTES), 0);
    assert_int_equal(fcntl(o->mfd, F_ADD_SEALS, F_SEAL_SHRINK), 0);
    raw_hello(o->sv[1], o->mfd);
    o->p = NULL;
    assert_int_equal(kv_xport_accept(o->x, 5000, &o->p), KV_OK);
    unsigned char pl[KV__SHM_MSG_MAX];
    const struct kv__shm_msg m = raw_next(o->sv[1], pl, sizeof(pl));
    assert_int_equal(m.type, KV__SM_HELLO);
    struct kv__xport_hello hh;
    kv__xport_hello_decode(pl, &hh);
    unsigned char blob[KV_XPORT_BLOB_MAX];
    const struct kv__xport_blob b = {.version = KV_XPORT_PROTOCOL_VERSION,
                                     .kind = KV_XPORT_SHM,
                                     .region = 7,
                                     .bytes = 1u << 20,
                                     .exposer = 0x1234,
                                     .importer = hh.nonce};
    o->r = NULL;
    assert_int_equal(kv_xport_rmem_import(o->p, blob, kv__xport_blob_encode(&b, blob), &o->r),
                     KV_OK);
}

/* Its end: r freed, p closed, ms deregistered, the transport destroyed,
 * the raw peer's descriptors closed. */
static void shm_raw_close(struct shm_raw *o, kv_xport_mem *ms)
{
    assert_int_equal(kv_xport_rmem_free(o->r), KV_OK);
    kv_xport_peer_close(o->p);
    assert_int_equal(kv_xport_mem_dereg(ms), KV_OK);
    assert_int_equal(kv_xport_destroy(o->x), KV_OK);
    close(o->mfd);
    close(o->sv[1]);
}

/* A raw peer that never ACKs: the write ends TIMED_OUT within timeout_ms
 * and its late ACK only returns the slot; a full notification queue
 * (max_pending_notes 1) refuses the next by name. */
static void test_xport_shm_timeout_and_limits(void **state)
{
    (void)state;
    struct kv_xport_config c = kvt_xport_cfg(KV_XPORT_SHM, true, TOKEN, 0);
    c.timeout_ms = 300;
    c.max_pending_notes = 1;
    struct shm_raw o;
    shm_raw_open(&o, &c);
    kv_xport *x = o.x;
    kv_xport_peer *p = o.p;
    kv_xport_rmem *r = o.r;
    const int *sv = o.sv;
    unsigned char pl[KV__SHM_MSG_MAX];
    struct kv__shm_msg m;
    static unsigned char src[4096];
    kv_xport_mem *ms = NULL;
    assert_int_equal(kv_xport_mem_reg(x, src, sizeof(src), KV_MEM_HOST, &ms), KV_OK);
    struct kv_xport_io io = {ms, 0, r, 512, 4096};
    kv_xport_xfer *t = NULL;
    const uint64_t t0 = kv__now_ns();
    assert_int_equal(kv_xport_write(p, &io, 1, NULL, &t), KV_OK);
    m = raw_next(sv[1], pl, sizeof(pl));
    assert_int_equal(m.type, KV__SM_DATA);
    assert_int_equal(m.entry, 1);
    assert_int_equal(kv__le_get(pl + 4, 4), 7);
    assert_int_equal(kv__le_get(pl + 8, 8), 512);
    kv_xport_state st;
    assert_int_equal(kv_xport_xfer_wait(t, 5000, &st), KV_OK);
    assert_int_equal(st, KV_XPORT_TIMED_OUT);
    assert_true(kv__now_ns() - t0 >= 300ull * 1000000ull);
    assert_int_equal(kv_xport_xfer_free(t), KV_OK);
    /* the late ACK: the slot comes back, the peer stays up */
    unsigned char rec[KV__SHM_REC];
    kv__le_put(rec, 0, 4);
    kv__le_put(rec + 4, 0, 4);
    kv__le_put(rec + 8, 4096, 8);
    raw_send(sv[1],
             (struct kv__shm_msg){.type = KV__SM_ACK, .slot = m.slot, .xfer = m.xfer, .entry = 1},
             rec, sizeof(rec), -1);
    /* two notifications: the second refused (max_pending_notes 1) */
    raw_send(sv[1], (struct kv__shm_msg){.type = KV__SM_NOTIFY, .xfer = 50, .tag = 5}, "a", 1, -1);
    raw_send(sv[1], (struct kv__shm_msg){.type = KV__SM_NOTIFY, .xfer = 51, .tag = 6}, "b", 1, -1);
    m = raw_next(sv[1], pl, sizeof(pl));
    assert_int_equal(m.type, KV__SM_NOTE_ACK);
    assert_int_equal(m.xfer, 50);
    assert_int_equal(m.status, KV_OK);
    m = raw_next(sv[1], pl, sizeof(pl));
    assert_int_equal(m.type, KV__SM_NOTE_ACK);
    assert_int_equal(m.xfer, 51);
    assert_int_equal(m.status, KV_ERR_CAPACITY);
    struct kv_xport_stats xs = KV_XPORT_STATS_INIT;
    assert_int_equal(kv_xport_stats_get(x, &xs), KV_OK);
    assert_int_equal(xs.notes_refused, 1);
    struct kv_xport_msg *msg = malloc(sizeof(*msg));
    assert_int_equal(kv_xport_notify_poll(x, 1000, msg), KV_OK);
    assert_int_equal(msg->tag, 5);
    kv_xport_peer_state ps;
    kv_status why = KV_OK;
    assert_int_equal(kv_xport_peer_state_get(p, &ps, &why), KV_OK);
    assert_int_equal(ps, KV_XPORT_READY);
    free(msg);
    shm_raw_close(&o, ms);
}

/* Review (hostile peers, 2026-12-06): a peer that completes its
 * handshake, then reads nothing: our messages all fit its socket, so no
 * control byte waited on our side, and the peer stayed READY for ever, its
 * 8 slots taken (every later write TIMED_OUT, nothing counted in
 * sends_stalled), where TCP closes such a peer. Now a slot unanswered for
 * timeout_ms while our messages wait unread closes it, by name; one that
 * reads and answers late keeps its connection (timeout_and_limits). */
static void test_xport_shm_peer_stops_reading(void **state)
{
    (void)state;
    struct kv_xport_config c = kvt_xport_cfg(KV_XPORT_SHM, true, TOKEN, 0);
    c.timeout_ms = 300;
    struct shm_raw o;
    shm_raw_open(&o, &c);
    static unsigned char src[4096];
    kv_xport_mem *ms = NULL;
    assert_int_equal(kv_xport_mem_reg(o.x, src, sizeof(src), KV_MEM_HOST, &ms), KV_OK);
    /* a write, then nothing read: its DATA waits in the peer's socket */
    const struct kv_xport_io io = {ms, 0, o.r, 0, sizeof(src)};
    kv_xport_xfer *t = NULL;
    assert_int_equal(kv_xport_write(o.p, &io, 1, NULL, &t), KV_OK);
    kv_xport_state st;
    assert_int_equal(kv_xport_xfer_wait(t, 5000, &st), KV_OK);
    assert_int_equal(st, KV_XPORT_TIMED_OUT);
    kv_xport_peer_state ps = KV_XPORT_READY;
    kv_status why = KV_OK;
    for (int i = 0; i < 3000 && ps != KV_XPORT_CLOSED; i++) {
        assert_int_equal(kv_xport_peer_state_get(o.p, &ps, &why), KV_OK);
        if (ps != KV_XPORT_CLOSED)
            usleep(1000);
    }
    assert_int_equal(ps, KV_XPORT_CLOSED);
    assert_int_equal(why, KV_ERR_TIMEOUT);
    kvt_assert_msg_has("unread and slot");
    struct kv_xport_stats xs = KV_XPORT_STATS_INIT;
    assert_int_equal(kv_xport_stats_get(o.x, &xs), KV_OK);
    assert_int_equal(xs.sends_stalled, 1);
    assert_int_equal(kv_xport_xfer_free(t), KV_OK);
    shm_raw_close(&o, ms);
}

/* Open descriptors of this process naming a memfd called name. */
static int memfds_named(const char *name)
{
    char want[64];
    snprintf(want, sizeof(want), "/memfd:%s ", name);
    int n = 0;
    DIR *d = opendir("/proc/self/fd");
    assert_non_null(d);
    for (struct dirent *e; (e = readdir(d));) {
        char p[300], t[300];
        snprintf(p, sizeof(p), "/proc/self/fd/%s", e->d_name);
        const ssize_t k = readlink(p, t, sizeof(t) - 1);
        if (k > 0) {
            t[k] = 0;
            n += strncmp(t, want, strlen(want)) == 0;
        }
    }
    closedir(d);
    return n;
}

/* An empty datagram carrying a descriptor (was kept open for ever: the
 * connection closed before it was): closed with the connection. */
static void test_xport_shm_empty_message_with_a_descriptor(void **state)
{
    (void)state;
    struct kv_xport_config c = kvt_xport_cfg(KV_XPORT_SHM, true, TOKEN, 0);
    kv_xport *x = NULL;
    assert_int_equal(kv_xport_create(&c, &x), KV_OK);
    int sv[2];
    assert_int_equal(socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv), 0);
    assert_int_equal(kv__shm_adopt(x, sv[0]), KV_OK);
    const int mfd = memfd_create("kvt-empty-dgram", 0);
    assert_true(mfd >= 0);
    union {
        struct cmsghdr h;
        char c[CMSG_SPACE(sizeof(int))];
    } cm;
    memset(&cm, 0, sizeof(cm));
    char none = 0;
    struct iovec iov = {&none, 0};
    struct msghdr mh = {
        .msg_iov = &iov, .msg_iovlen = 1, .msg_control = cm.c, .msg_controllen = sizeof(cm.c)};
    struct cmsghdr *h = CMSG_FIRSTHDR(&mh);
    h->cmsg_level = SOL_SOCKET;
    h->cmsg_type = SCM_RIGHTS;
    h->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(h), &mfd, sizeof(int));
    assert_int_equal(sendmsg(sv[1], &mh, MSG_NOSIGNAL), 0);
    struct kv_xport_stats st = KV_XPORT_STATS_INIT;
    for (int i = 0; i < 5000 && st.peers_refused == 0; i++) {
        usleep(1000);
        assert_int_equal(kv_xport_stats_get(x, &st), KV_OK);
    }
    assert_int_equal(st.peers_refused, 1);
    assert_int_equal(memfds_named("kvt-empty-dgram"), 1); /* ours only */
    close(mfd);
    close(sv[1]);
    assert_int_equal(kv_xport_destroy(x), KV_OK);
}

/* Review (hostile peers, 2026-12-06): a descriptor that is not a ring
 * we can use is the peer's fault, refused KV_ERR_CORRUPT naming why: a
 * pipe, a directory, a memfd too small; a memfd opened read-only or
 * sealed against writes was refused KV_ERR_NO_MEMORY (the allocation or
 * the mapping failed: "Bad file descriptor", "Operation not permitted"),
 * which says this side is out of memory. The refused peer is never
 * accepted and no descriptor of it stays open. */
static void test_xport_shm_unusable_memfd(void **state)
{
    (void)state;
    struct kv_xport_config c = kvt_xport_cfg(KV_XPORT_SHM, true, TOKEN, 0);
    kv_xport *x = NULL;
    assert_int_equal(kv_xport_create(&c, &x), KV_OK);
    const int good = memfd_create("kvt-unusable", MFD_ALLOW_SEALING);
    assert_int_equal(ftruncate(good, 2 * (off_t)KV__SHM_RING_BYTES), 0);
    assert_int_equal(fcntl(good, F_ADD_SEALS, F_SEAL_SHRINK), 0);
    char path[64];
    snprintf(path, sizeof(path), "/proc/self/fd/%d", good);
    const int sealed = memfd_create("kvt-unusable", MFD_ALLOW_SEALING);
    assert_int_equal(ftruncate(sealed, 2 * (off_t)KV__SHM_RING_BYTES), 0);
    assert_int_equal(fcntl(sealed, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_WRITE), 0);
    const int small = memfd_create("kvt-unusable", MFD_ALLOW_SEALING);
    assert_int_equal(ftruncate(small, 4096), 0);
    assert_int_equal(fcntl(small, F_ADD_SEALS, F_SEAL_SHRINK), 0);
    int pp[2];
    assert_int_equal(pipe(pp), 0);
    const struct {
        int fd;
        const char *why;
    } cases[] = {
        {pp[0], "not a memfd sealed against shrinking"},
        {open("/tmp", O_RDONLY | O_DIRECTORY), "not a memfd sealed against shrinking"},
        {small, "a ring memfd of 4096 bytes"},
        {open(path, O_RDONLY), "not writable (not opened read-write"},
        {sealed, "not writable (sealed against writes"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        assert_true(cases[i].fd >= 0);
        int sv[2];
        assert_int_equal(socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv), 0);
        assert_int_equal(kv__shm_adopt(x, sv[0]), KV_OK);
        raw_hello(sv[1], cases[i].fd);
        unsigned char pl[KV__SHM_MSG_MAX] = {0};
        const struct kv__shm_msg m = raw_next(sv[1], pl, sizeof(pl) - 1);
        assert_int_equal(m.type, KV__SM_REFUSE);
        assert_int_equal(m.status, KV_ERR_CORRUPT);
        if (!strstr((const char *)pl, cases[i].why))
            fail_msg("case %zu: refused with '%s', not '%s'", i, (const char *)pl, cases[i].why);
        close(sv[1]);
    }
    kv_xport_peer *p = NULL;
    assert_int_equal(kv_xport_accept(x, 0, &p), KV_ERR_TIMEOUT);
    assert_int_equal(memfds_named("kvt-unusable"), 4); /* ours only */
    close(cases[1].fd);
    close(cases[3].fd);
    close(pp[0]);
    close(pp[1]);
    close(small);
    close(sealed);
    close(good);
    assert_int_equal(kv_xport_destroy(x), KV_OK);
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    /* one CPU thread for the local references (kv_plan_copy): libgomp's
     * barriers are invisible to ThreadSanitizer (as test_xport_tcp) */
    if (kv_set_threads(1) != KV_OK)
        return 1;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_xport_shm_refusals),
        cmocka_unit_test(test_xport_shm_note_refused_for_capacity),
        cmocka_unit_test(test_xport_shm_write_read_whole_region),
        cmocka_unit_test(test_xport_shm_write_plan),
        cmocka_unit_test(test_xport_shm_unexpose_cancel_any_order),
        cmocka_unit_test(test_xport_shm_peer_killed),
        cmocka_unit_test(test_xport_shm_prefill_to_decode_two_procs),
        cmocka_unit_test(test_xport_shm_hostile_peer),
        cmocka_unit_test(test_xport_shm_empty_message_with_a_descriptor),
        cmocka_unit_test(test_xport_shm_timeout_and_limits),
        cmocka_unit_test(test_xport_shm_peer_stops_reading),
        cmocka_unit_test(test_xport_shm_unusable_memfd),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
