/*
 * test_xport_rdma_oom.c - allocation failure injection over the RDMA
 * transport, run on the software verbs device (tests/softverbs,
 * kv__verbs_set(kvt_softverbs())): the pair lives in this process.
 *
 * The caller's thread (kv__mem_fail_after(k), k = 0, 1, ...): create,
 * connect, mem_reg, expose, rmem_import, a write (with and without a
 * notification) and a read; each failed call answers KV_ERR_NO_MEMORY
 * with a message, leaves the observable state as it was (nothing queued,
 * no reference held: the regions deregister / free at once, no
 * notification arrives), its outputs untouched; each call that succeeds
 * ends DONE with its bytes compared.
 *
 * The library's threads (kv__mem_fail_others_after(k), k = 0, 1, ... until
 * a run the countdown never reaches; both progress modes, rdma_busy_poll
 * false and true): a pair connected with injection off, then, while every
 * allocation of the other threads (both progress threads and the soft
 * verbs device's thread) fails from the k-th on, four writes with
 * notifications (distinct tags, 4000 bytes each past 32 KiB) and a read.
 * The receiver queues at most three notifications, so one is refused
 * (KV_ERR_CAPACITY) when nothing else fails. Every transfer ends within
 * its deadline; a write DONE has its notification polled exactly once and
 * its bytes landed; a write whose notification was refused (KV_ERR_CAPACITY,
 * KV_ERR_NO_MEMORY) ends FAILED, its entry KV_OK, its bytes landed, its
 * notification never polled; no notification is polled twice or for a tag
 * never sent, and one of a write not DONE only where the peer closed (or
 * the write timed out) after the receiver queued it, its bytes landed;
 * nothing lands outside the written ranges. With injection off everything
 * frees (transfers, regions, peers; kv_xport_destroy KV_OK) and a clean
 * write with its notification round-trips (on the same pair if both ends
 * are still READY, else on a fresh one).
 *
 * Not asserted: which cause a closed peer carries. A side that fails a
 * connection tells the other why (an out-of-band FAIL), but while every
 * allocation of its threads fails the FAIL itself cannot be sent, and the
 * other side sees a clean close (KV_OK). test_xport_rdma's
 * forged_ack_refused checks the cause where memory is not short.
 *
 * Also seen, and allowed: a notification queued at the receiver whose
 * acknowledgement was lost with the connection (the write ends FAILED or
 * TIMED_OUT, its bytes landed). DONE promises delivery; a write that did
 * not end DONE promises nothing about its notification.
 *
 * Leaks are caught by the sanitizer build (ASan's leak checker).
 */
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <kvcache/kv.h>
#include "kv_mem.h"
#include "kv_verbs_int.h"
#include "kv_xport_int.h"
#include "kvt_oom.h"
#include "kvt_oom_post.h"
#include "kvt_oom_xport.h"
#include "kvt_softverbs.h"
#include "kvt_xport.h"
#include "kvtest.h"

#define TOKEN 0x0DD5ull
#define FP 0xF00Dull

enum { PB = 1u << 16 }; /* bytes of each buffer */

static uint32_t g_timeout_ms = 3000; /* the transfers' timeout */

static struct kv_xport_config rd_cfg(bool listen, bool busy)
{
    struct kv_xport_config c = KV_XPORT_CONFIG_INIT;
    c.kind = KV_XPORT_RDMA;
    c.listen_host = listen ? "127.0.0.1" : NULL;
    c.token = TOKEN;
    c.fingerprint = FP;
    c.conns_per_peer = 2;
    c.timeout_ms = g_timeout_ms;
    c.rdma_busy_poll = busy;
    return c;
}

static void pair_open(struct kvt_pair *p, bool busy)
{
    struct kv_xport_config cb = rd_cfg(true, busy), ca = rd_cfg(false, busy);
    kvt_pair_open(p, &ca, &cb);
}

/* ---- create, connect, regions (caller's thread) -------------------------------------- */

/* The cases of kvt_oom_xport.h over an RDMA pair. */
static void test_rdma_setup(void **state)
{
    (void)state;
    static struct kvt_ox x;
    struct kv_xport_config ca = rd_cfg(false, false), cb = rd_cfg(true, false);
    static const struct kvt_ox_names names = {"rdma create", "rdma connect", "rdma mem_reg",
                                              "rdma mem_expose", "rdma rmem_import"};
    kvt_ox_run(&x, &names, &ca, &cb);
}

/* ---- posting transfers (caller's thread) --------------------------------------------- */

static void test_rdma_post(void **state)
{
    (void)state;
    static struct kvt_po x;
    memset(&x, 0, sizeof(x));
    pair_open(&x.p, false);
    kvt_po_open(&x);
    static const char *const names[3] = {"rdma write", "rdma write+note", "rdma read"};
    for (int mode = 0; mode < 3; mode++) {
        x.mode = mode;
        if (mode == 2)
            kvt_fill(x.dst, KVT_PO_BYTES, 9); /* what the read brings back */
        struct oom_case c = {names[mode],   &x,   kvt_po_call, kvt_po_snap, kvt_po_ok,
                             kvt_po_failed, KV_OK};
        assert_true(oom_run(&c) > 0); /* every call here allocates */
    }
    kvt_po_close(&x);
}

/* ---- the library's threads out of memory ---------------------------------------------- */

enum {
    LT_NW = 4,        /* notified writes per run */
    LT_EB = 4000,     /* bytes of each entry */
    LT_ROFF = 56000,  /* the read's remote range [LT_ROFF, + LT_EB) ... */
    LT_LOFF = 40000,  /* ... into the reader's [LT_LOFF, + LT_EB) */
    LT_COFF = 60000,  /* the clean write's range, source and destination */
    LT_TAG = 0x7a00,  /* write i's tag is LT_TAG + i */
    LT_CTAG = 0x7aff, /* the clean write's tag */
    LT_KMAX = 60,     /* runs of one mode at most: injection must stop reaching before */
};

/* The pairs' timeout_ms in this case: a transfer whose device stalls (the
 * soft verbs thread retries while out of memory) ends TIMED_OUT in this. */
#define LT_TIMEOUT_MS 400u

/* Write i's source and destination offsets: far from 0, distinct, 4000
 * bytes each, all below LT_ROFF. */
static uint64_t lt_src(int i)
{
    return 32768u + 4096u * (uint64_t)i + 8u;
}
static uint64_t lt_dst(int i)
{
    return 33000u + 5000u * (uint64_t)i;
}

/* How the runs of one mode ended (printed; only the invariants are asserted). */
struct lt_tally {
    uint64_t injected;
    int done, note_refused, note_nomem, failed, timed_out, ack_lost, refused_post, closed,
        closed_ok, reads_failed;
};

/* t's state within its deadline (timeout_ms and a margin): terminal, never
 * CANCELLED (nothing cancels it), FAILED with a message. */
static kv_xport_state lt_end(kv_xport_xfer *t, const char *what, int i, bool busy, int64_t k)
{
    kv_xport_state s = KV_XPORT_PENDING;
    const uint32_t ms = 2 * g_timeout_ms + 2000;
    const kv_status w = kv_xport_xfer_wait(t, ms, &s);
    if (w != KV_OK)
        fail_msg("%s %d: busy=%d k=%lld: not terminal after %u ms: %s", what, i, (int)busy,
                 (long long)k, ms, kv_status_name(w));
    if (s != KV_XPORT_DONE && s != KV_XPORT_FAILED && s != KV_XPORT_TIMED_OUT)
        fail_msg("%s %d: busy=%d k=%lld: ended %d: %s", what, i, (int)busy, (long long)k, (int)s,
                 kv_xport_xfer_error(t));
    if (s == KV_XPORT_FAILED && !kv_xport_xfer_error(t)[0])
        fail_msg("%s %d: busy=%d k=%lld: FAILED without a message", what, i, (int)busy,
                 (long long)k);
    return s;
}

/* A post from the test thread (exempt from injection) is refused only for a
 * peer a progress thread closed already: KV_ERR_BAD_STATE, the peer CLOSED
 * (its cause not asserted: a failure on the other side may arrive as a
 * clean close). */
static void lt_refused(struct kvt_pair *p, kv_status st, kv_xport_xfer *t, const char *what, int i,
                       bool busy, int64_t k)
{
    kv_xport_peer_state ps = KV_XPORT_CONNECTING;
    kv_status why = KV_OK;
    const char *e = kv_last_error();
    assert_int_equal(kv_xport_peer_state_get(p->pa, &ps, &why), KV_OK);
    if (st != KV_ERR_BAD_STATE || ps != KV_XPORT_CLOSED)
        fail_msg("%s %d: busy=%d k=%lld: post refused: %s (%s), peer state %d (%s)", what, i,
                 (int)busy, (long long)k, kv_status_name(st), e, (int)ps, kv_status_name(why));
    assert_null(t);
}

/* The peer's state; CLOSED counts. */
static bool lt_ready(kv_xport_peer *pe, struct lt_tally *ty)
{
    kv_xport_peer_state s = KV_XPORT_CONNECTING;
    kv_status why = KV_OK;
    assert_int_equal(kv_xport_peer_state_get(pe, &s, &why), KV_OK);
    if (s == KV_XPORT_CLOSED) {
        ty->closed++;
        if (why == KV_OK)
            ty->closed_ok++;
    }
    return s == KV_XPORT_READY;
}

/* With injection off: a write of LT_EB bytes at LT_COFF with a notification
 * (tag LT_CTAG) over p, from ms (src) into the region md (dst) of b, ends
 * DONE; its notification is the next one b polls, exactly once (nothing
 * left over from the run before), and the bytes are the source's. */
static void lt_clean(struct kvt_pair *p, kv_xport_mem *ms, kv_xport_mem *md,
                     const unsigned char *src, const unsigned char *dst, struct kv_xport_msg *msg,
                     bool busy, int64_t k)
{
    kv_xport_rmem *r = kvt_share_direct(p, md);
    struct kv_xport_io io = {ms, LT_COFF, r, LT_COFF, LT_EB};
    struct kv_xport_notify nt = {.tag = LT_CTAG, .msg = "clean", .len = sizeof("clean")};
    kv_xport_xfer *t = NULL;
    assert_int_equal(kv_xport_write(p->pa, &io, 1, &nt, &t), KV_OK);
    kv_xport_state s = KV_XPORT_PENDING;
    assert_int_equal(kv_xport_xfer_wait(t, 2 * g_timeout_ms + 2000, &s), KV_OK);
    if (s != KV_XPORT_DONE)
        fail_msg("clean write: busy=%d k=%lld: ended %d: %s", (int)busy, (long long)k, (int)s,
                 kv_xport_xfer_error(t));
    assert_int_equal(kv_xport_xfer_free(t), KV_OK);
    assert_int_equal(kv_xport_notify_poll(p->b, 0, msg), KV_OK); /* queued before DONE */
    if (msg->tag != LT_CTAG)
        fail_msg("clean write: busy=%d k=%lld: polled tag %#llx first", (int)busy, (long long)k,
                 (unsigned long long)msg->tag);
    assert_int_equal(msg->peer_id, kv_xport_peer_id(p->pb));
    assert_int_equal(msg->len, sizeof("clean"));
    assert_memory_equal(msg->data, "clean", sizeof("clean"));
    assert_int_equal(kv_xport_notify_poll(p->b, 50, msg), KV_ERR_TIMEOUT);
    assert_memory_equal(dst + LT_COFF, src + LT_COFF, LT_EB);
    assert_int_equal(kv_xport_rmem_free(r), KV_OK);
}

/* A pair whose receiver (b) queues at most LT_NW - 1 notifications not yet
 * polled: of LT_NW notified writes one is refused (KV_ERR_CAPACITY) when
 * nothing else fails, so every run has a refused notification too. */
static void lt_pair_open(struct kvt_pair *p, bool busy)
{
    struct kv_xport_config cb = rd_cfg(true, busy), ca = rd_cfg(false, busy);
    cb.max_pending_notes = LT_NW - 1;
    kvt_pair_open(p, &ca, &cb);
}

/* One run: a pair connected with injection off; then, while every
 * allocation of the other threads (both transports' progress threads and
 * the soft verbs device's thread) fails from the k-th on, LT_NW writes with
 * notifications (distinct tags) and a read. Returns the failures injected. */
static uint64_t lt_run(bool busy, int64_t k, unsigned char *src, unsigned char *dst,
                       unsigned char *dst0, unsigned char *loc, struct kv_xport_msg *msg,
                       struct lt_tally *ty)
{
    struct kvt_pair p;
    lt_pair_open(&p, busy);
    kvt_fill(src, PB, 1000 + (uint64_t)k);
    kvt_fill(dst, PB, 2000 + (uint64_t)k);
    memcpy(dst0, dst, PB);
    memset(loc, 0, PB);
    kv_xport_mem *ms = NULL, *md = NULL, *ml = NULL;
    assert_int_equal(kv_xport_mem_reg(p.a, src, PB, KV_MEM_HOST, &ms), KV_OK);
    assert_int_equal(kv_xport_mem_reg(p.a, loc, PB, KV_MEM_HOST, &ml), KV_OK);
    assert_int_equal(kv_xport_mem_reg(p.b, dst, PB, KV_MEM_HOST, &md), KV_OK);
    kv_xport_rmem *r = kvt_share_direct(&p, md);

    const uint64_t f0 = kv__mem_others_failed();
    kv__mem_fail_others_after(k);
    kv_xport_xfer *tw[LT_NW] = {NULL}, *tr = NULL;
    kv_xport_state sw[LT_NW], sr = KV_XPORT_FAILED;
    char note[LT_NW][8];
    for (int i = 0; i < LT_NW; i++) {
        snprintf(note[i], sizeof(note[i]), "note-%d", i);
        struct kv_xport_io io = {ms, lt_src(i), r, lt_dst(i), LT_EB};
        struct kv_xport_notify nt = {
            .tag = LT_TAG + (uint64_t)i, .msg = note[i], .len = (uint32_t)sizeof(note[i])};
        const kv_status st = kv_xport_write(p.pa, &io, 1, &nt, &tw[i]);
        if (st != KV_OK) {
            lt_refused(&p, st, tw[i], "write", i, busy, k);
            tw[i] = NULL;
        }
    }
    struct kv_xport_io rio = {ml, LT_LOFF, r, LT_ROFF, LT_EB};
    const kv_status rst = kv_xport_read(p.pa, &rio, 1, &tr);
    if (rst != KV_OK) {
        lt_refused(&p, rst, tr, "read", 0, busy, k);
        tr = NULL;
    }
    /* every transfer terminal within its deadline (still injecting) */
    for (int i = 0; i < LT_NW; i++) {
        sw[i] = KV_XPORT_FAILED;
        if (tw[i])
            sw[i] = lt_end(tw[i], "write", i, busy, k);
        else
            ty->refused_post++;
    }
    if (tr)
        sr = lt_end(tr, "read", 0, busy, k);
    else
        ty->refused_post++;
    kv__mem_fail_others_after(-1);
    const uint64_t nf = kv__mem_others_failed() - f0;
    ty->injected += nf;

    /* the notifications b received: each of ours at most once, none of
     * another tag, each from a with its message */
    int polled[LT_NW] = {0};
    kv_status ps;
    while ((ps = kv_xport_notify_poll(p.b, 100, msg)) == KV_OK) {
        const uint64_t i = msg->tag - LT_TAG;
        if (msg->tag < LT_TAG || i >= LT_NW)
            fail_msg("busy=%d k=%lld: a notification with tag %#llx, never sent", (int)busy,
                     (long long)k, (unsigned long long)msg->tag);
        if (++polled[i] > 1)
            fail_msg("busy=%d k=%lld: write %d's notification polled twice", (int)busy,
                     (long long)k, (int)i);
        assert_int_equal(msg->peer_id, kv_xport_peer_id(p.pb));
        assert_int_equal(msg->len, sizeof(note[i]));
        assert_memory_equal(msg->data, note[i], sizeof(note[i]));
    }
    assert_int_equal(ps, KV_ERR_TIMEOUT);
    const bool ready_a = lt_ready(p.pa, ty), ready_b = lt_ready(p.pb, ty);

    for (int i = 0; i < LT_NW; i++) {
        const bool landed = memcmp(dst + lt_dst(i), src + lt_src(i), LT_EB) == 0;
        kv_status ns = KV_OK, es = KV_OK;
        if (tw[i]) {
            const kv_status *st;
            uint32_t n = 0;
            assert_int_equal(kv_xport_xfer_results(tw[i], &st, &n), KV_OK);
            assert_int_equal(n, 1);
            es = st[0];
            assert_int_equal(kv_xport_xfer_note_status(tw[i], &ns), KV_OK);
        }
        if (sw[i] == KV_XPORT_DONE) {
            /* DONE: the notification was queued (polled once), the bytes landed */
            ty->done++;
            if (polled[i] != 1 || !landed || es != KV_OK || ns != KV_OK)
                fail_msg("busy=%d k=%lld: write %d DONE: polled %d times, landed %d, entry %s, "
                         "note %s",
                         (int)busy, (long long)k, i, polled[i], (int)landed, kv_status_name(es),
                         kv_status_name(ns));
        } else if (ns == KV_ERR_NO_MEMORY || ns == KV_ERR_CAPACITY) {
            /* the receiver could not queue it: FAILED, the data landed, never polled */
            ty->note_refused++;
            ty->note_nomem += ns == KV_ERR_NO_MEMORY;
            if (sw[i] != KV_XPORT_FAILED || polled[i] != 0 || !landed || es != KV_OK)
                fail_msg("busy=%d k=%lld: write %d note %s: ended %d, polled %d times, landed "
                         "%d, entry %s",
                         (int)busy, (long long)k, i, kv_status_name(ns), (int)sw[i], polled[i],
                         (int)landed, kv_status_name(es));
        } else {
            /* not DONE otherwise (the peer lost, or no answer in time): its
             * notification is polled only if the peer closed (or the transfer
             * timed out) after the receiver queued it, its acknowledgement
             * lost on the way back; then its bytes landed before it */
            if (sw[i] == KV_XPORT_TIMED_OUT)
                ty->timed_out++;
            else
                ty->failed++;
            const bool lost = !ready_a || !ready_b || sw[i] == KV_XPORT_TIMED_OUT;
            if (polled[i] == 1)
                ty->ack_lost++;
            if (ns != KV_OK || (polled[i] == 1 && (!lost || !landed)))
                fail_msg("busy=%d k=%lld: write %d ended %d (%s): note %s, polled %d times, "
                         "entry %s, landed %d, peers ready %d/%d",
                         (int)busy, (long long)k, i, (int)sw[i],
                         tw[i] ? kv_xport_xfer_error(tw[i]) : "refused", kv_status_name(ns),
                         polled[i], kv_status_name(es), (int)landed, (int)ready_a, (int)ready_b);
        }
        /* nothing of it outside its range */
        const uint64_t end = lt_dst(i) + LT_EB, next = i + 1 < LT_NW ? lt_dst(i + 1) : LT_ROFF;
        assert_memory_equal(dst + end, dst0 + end, next - end);
    }
    assert_memory_equal(dst, dst0, lt_dst(0));
    /* a read writes nothing there */
    assert_memory_equal(dst + LT_ROFF, dst0 + LT_ROFF, PB - LT_ROFF);
    if (sr == KV_XPORT_DONE)
        assert_memory_equal(loc + LT_LOFF, dst0 + LT_ROFF, LT_EB);
    else
        ty->reads_failed++;
    if (nf == 0) { /* the countdown never reached: all DONE but the one over the queue */
        int done = 0, full = 0;
        for (int i = 0; i < LT_NW; i++) {
            kv_status ns = KV_OK;
            if (tw[i])
                assert_int_equal(kv_xport_xfer_note_status(tw[i], &ns), KV_OK);
            done += sw[i] == KV_XPORT_DONE;
            full += ns == KV_ERR_CAPACITY;
        }
        if (done != LT_NW - 1 || full != 1)
            fail_msg("busy=%d k=%lld: no failure injected: %d writes DONE, %d refused full",
                     (int)busy, (long long)k, done, full);
        assert_int_equal(sr, KV_XPORT_DONE);
    }

    /* injection off: everything frees; a clean write with a notification
     * round-trips on the same pair if it is still up, else on a fresh one */
    for (int i = 0; i < LT_NW; i++)
        if (tw[i])
            assert_int_equal(kv_xport_xfer_free(tw[i]), KV_OK);
    if (tr)
        assert_int_equal(kv_xport_xfer_free(tr), KV_OK);
    assert_int_equal(kv_xport_rmem_free(r), KV_OK);
    if (ready_a && ready_b)
        lt_clean(&p, ms, md, src, dst, msg, busy, k);
    kvt_pair_close_with(&p, (kv_xport_mem *[]){ms, ml, md}, 3);
    if (!(ready_a && ready_b)) {
        lt_pair_open(&p, busy);
        assert_int_equal(kv_xport_mem_reg(p.a, src, PB, KV_MEM_HOST, &ms), KV_OK);
        assert_int_equal(kv_xport_mem_reg(p.b, dst, PB, KV_MEM_HOST, &md), KV_OK);
        lt_clean(&p, ms, md, src, dst, msg, busy, k);
        kvt_pair_close_with(&p, (kv_xport_mem *[]){ms, md}, 2);
    }
    return nf;
}

static void test_rdma_library_threads(void **state)
{
    (void)state;
    unsigned char *src = malloc(PB), *dst = malloc(PB), *dst0 = malloc(PB), *loc = malloc(PB);
    struct kv_xport_msg *msg = malloc(sizeof(*msg));
    assert_true(src && dst && dst0 && loc && msg);
    const uint32_t saved = g_timeout_ms;
    g_timeout_ms = LT_TIMEOUT_MS;
    for (int busy = 0; busy < 2; busy++) {
        struct lt_tally ty = {0};
        int64_t k = 0, runs = 0;
        for (;; k++, runs++) {
            if (runs >= LT_KMAX)
                fail_msg("busy=%d: injection still reached at k=%lld after %lld runs", busy,
                         (long long)k, (long long)runs);
            if (lt_run(busy, k, src, dst, dst0, loc, msg, &ty) == 0)
                break;
        }
        print_message(
            "  rdma library threads, busy_poll=%d: %lld runs (k = 0..%lld), %llu "
            "injected failures; writes: %d DONE, %d notes refused (%d no memory), %d FAILED, %d "
            "TIMED_OUT, %d of those polled (queued, acknowledgement lost); %d posts "
            "refused, %d reads not DONE; %d "
            "peers closed (%d with KV_OK)\n",
            busy, (long long)runs + 1, (long long)k, (unsigned long long)ty.injected, ty.done,
            ty.note_refused, ty.note_nomem, ty.failed, ty.timed_out, ty.ack_lost, ty.refused_post,
            ty.reads_failed, ty.closed, ty.closed_ok);
        assert_true(ty.injected > 0);
    }
    g_timeout_ms = saved;
    free(src);
    free(dst);
    free(dst0);
    free(loc);
    free(msg);
}

/* A failed case leaves no injection on for the next. */
static int injection_off(void **state)
{
    (void)state;
    kv__mem_fail_after(-1);
    kv__mem_fail_others_after(-1);
    return 0;
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    kv__verbs_set(kvt_softverbs());
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_rdma_setup, injection_off),
        cmocka_unit_test_teardown(test_rdma_post, injection_off),
        cmocka_unit_test_teardown(test_rdma_library_threads, injection_off),
    };
    return cmocka_run_group_tests_name("xport_rdma_oom", tests, NULL, NULL);
}
