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
 * Not here: the library's threads out of memory (kv__mem_fail_others_after)
 * under RDMA. Tried, it showed two open issues (docs/design.md, "The third
 * round"): a peer whose side failed reaches the other as a clean close
 * (the out-of-band close carries no cause), and a write can end DONE while
 * its notification, delivered to the receive buffer, was dropped by a
 * receiver that could not queue it (which then closes the peer).
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
#include "kvt_softverbs.h"
#include "kvt_xport.h"
#include "kvtest.h"

#define TOKEN 0x0DD5ull
#define FP 0xF00Dull
#define WAIT_MS 5000

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

struct xp_ctx {
    struct kvt_pair pair;
    struct kv_xport_config cfg;
    kv_xport *x;
    unsigned char mem[8192];
    kv_xport_mem *m;
    unsigned char blob[KV_XPORT_BLOB_MAX];
    size_t len;
    kv_xport_rmem *r;
    kv_xport_peer *cpeer;
    uint64_t npeers;
};

static kv_status call_create(void *p)
{
    struct xp_ctx *x = p;
    x->x = SENTINEL;
    return kv_xport_create(&x->cfg, &x->x);
}
static void ok_create(void *p)
{
    struct xp_ctx *x = p;
    assert_ptr_not_equal(x->x, SENTINEL);
    assert_true(kv_xport_port(x->x) != 0);
    assert_int_equal(kv_xport_destroy(x->x), KV_OK);
}
static void failed_create(void *p)
{
    struct xp_ctx *x = p;
    assert_ptr_equal(x->x, SENTINEL);
}

/* The peers x holds (a failed connect leaves none). */
static uint64_t xp_peers(kv_xport *x)
{
    uint64_t n = 0;
    pthread_mutex_lock(&x->mu);
    for (kv_xport_peer *p = x->peers; p; p = p->next)
        n++;
    pthread_mutex_unlock(&x->mu);
    return n;
}

static kv_status call_connect(void *p)
{
    struct xp_ctx *x = p;
    x->cpeer = SENTINEL;
    return kv_xport_connect(x->pair.a, "127.0.0.1", kv_xport_port(x->pair.b), &x->cpeer);
}
static void ok_connect(void *p)
{
    struct xp_ctx *x = p;
    kv_xport_peer_state s = KV_XPORT_CONNECTING;
    if (kv_xport_peer_wait(x->cpeer, WAIT_MS, &s) != KV_OK)
        fail_msg("connect: state %d: %s", (int)s, kv_last_error());
    kv_xport_peer *q = NULL;
    assert_int_equal(kv_xport_accept(x->pair.b, WAIT_MS, &q), KV_OK);
    kv_xport_peer_close(x->cpeer);
    kv_xport_peer_close(q);
    x->cpeer = NULL;
}
static void failed_connect(void *p)
{
    struct xp_ctx *x = p;
    assert_ptr_equal(x->cpeer, SENTINEL);
    assert_int_equal(xp_peers(x->pair.a), x->npeers);
    x->cpeer = NULL;
}

static kv_status call_reg(void *p)
{
    struct xp_ctx *x = p;
    x->m = SENTINEL;
    return kv_xport_mem_reg(x->pair.b, x->mem, sizeof(x->mem), KV_MEM_HOST, &x->m);
}
static void ok_reg(void *p)
{
    struct xp_ctx *x = p;
    assert_int_equal(kv_xport_mem_bytes(x->m), sizeof(x->mem));
    assert_int_equal(kv_xport_mem_dereg(x->m), KV_OK);
    x->m = NULL;
}
static void failed_reg(void *p)
{
    struct xp_ctx *x = p;
    assert_ptr_equal(x->m, SENTINEL);
    x->m = NULL;
}

static void xp_snap(void *p, struct snap *s)
{
    struct xp_ctx *x = p;
    pthread_mutex_lock(&x->pair.a->mu);
    snap_put(s, x->pair.a->n_xfers);
    snap_put(s, x->pair.a->n_rmems);
    snap_put(s, x->pair.pa->refs);
    snap_put(s, x->pair.pa->n_exposed);
    pthread_mutex_unlock(&x->pair.a->mu);
    pthread_mutex_lock(&x->pair.b->mu);
    snap_put(s, x->pair.pb->n_exposed);
    snap_put(s, x->pair.pb->refs);
    snap_put(s, x->m ? x->m->users : 0);
    pthread_mutex_unlock(&x->pair.b->mu);
}

static kv_status call_expose(void *p)
{
    struct xp_ctx *x = p;
    x->len = 0x5e17;
    return kv_xport_mem_expose(x->pair.pb, x->m, x->blob, sizeof(x->blob), &x->len);
}
static void ok_expose(void *p)
{
    struct xp_ctx *x = p;
    assert_true(x->len > 0 && x->len <= KV_XPORT_BLOB_MAX);
    assert_int_equal(kv_xport_mem_unexpose(x->pair.pb, x->m), KV_OK);
}
static void failed_expose(void *p)
{
    struct xp_ctx *x = p;
    assert_int_equal(x->len, 0x5e17);
    /* not exposed: nothing to withdraw */
    assert_int_equal(kv_xport_mem_unexpose(x->pair.pb, x->m), KV_ERR_NOT_FOUND);
}

static kv_status call_import(void *p)
{
    struct xp_ctx *x = p;
    x->r = SENTINEL;
    return kv_xport_rmem_import(x->pair.pa, x->blob, x->len, &x->r);
}
static void ok_import(void *p)
{
    struct xp_ctx *x = p;
    assert_int_equal(kv_xport_rmem_bytes(x->r), sizeof(x->mem));
    assert_int_equal(kv_xport_rmem_free(x->r), KV_OK);
    x->r = NULL;
}
static void failed_import(void *p)
{
    struct xp_ctx *x = p;
    assert_ptr_equal(x->r, SENTINEL);
    x->r = NULL;
}

static void test_rdma_setup(void **state)
{
    (void)state;
    static struct xp_ctx x;
    memset(&x, 0, sizeof(x));
    x.cfg = rd_cfg(true, false);
    struct oom_case c = {"rdma create", &x, call_create, NULL, ok_create, failed_create, KV_OK};
    assert_true(oom_run(&c) > 0); /* every call here allocates */

    pair_open(&x.pair, false);
    x.npeers = xp_peers(x.pair.a);
    c = (struct oom_case){"rdma connect", &x,   call_connect, NULL, ok_connect,
                          failed_connect, KV_OK};
    assert_true(oom_run(&c) > 0); /* every call here allocates */
    c = (struct oom_case){"rdma mem_reg", &x, call_reg, NULL, ok_reg, failed_reg, KV_OK};
    assert_true(oom_run(&c) > 0); /* every call here allocates */
    assert_int_equal(kv_xport_mem_reg(x.pair.b, x.mem, sizeof(x.mem), KV_MEM_HOST, &x.m), KV_OK);
    c = (struct oom_case){"rdma mem_expose", &x,   call_expose, xp_snap, ok_expose,
                          failed_expose,     KV_OK};
    assert_true(oom_run(&c) > 0); /* every call here allocates */
    assert_int_equal(kv_xport_mem_expose(x.pair.pb, x.m, x.blob, sizeof(x.blob), &x.len), KV_OK);
    c = (struct oom_case){"rdma rmem_import", &x,   call_import, xp_snap, ok_import,
                          failed_import,      KV_OK};
    assert_true(oom_run(&c) > 0); /* every call here allocates */
    assert_int_equal(kv_xport_mem_unexpose(x.pair.pb, x.m), KV_OK);
    assert_int_equal(kv_xport_mem_dereg(x.m), KV_OK);
    /* refused (KV_ERR_BAD_STATE) if a failed call left a region or a peer held */
    kvt_pair_close(&x.pair);
}

/* ---- posting transfers (caller's thread) --------------------------------------------- */

struct po_ctx {
    struct kvt_pair p;
    unsigned char *src, *dst, *back;
    kv_xport_mem *ms, *md, *mb;
    kv_xport_rmem *r;
    kv_xport_xfer *t;
    int mode; /* 0 write, 1 write + notification, 2 read */
    uint64_t tag;
    struct kv_xport_msg *msg;
};

static const struct kv_xport_io *po_ios(struct po_ctx *x, uint32_t *n)
{
    static struct kv_xport_io io[3];
    kv_xport_mem *l = x->mode == 2 ? x->mb : x->ms;
    io[0] = (struct kv_xport_io){l, 100, x->r, 200, 5000};
    io[1] = (struct kv_xport_io){l, 9000, x->r, 30000, 20000};
    io[2] = (struct kv_xport_io){l, PB - 7, x->r, 7, 7};
    *n = 3;
    return io;
}

static void po_snap(void *p, struct snap *s)
{
    struct po_ctx *x = p;
    kv_xport *a = x->p.a;
    pthread_mutex_lock(&a->mu);
    snap_put(s, a->n_xfers);
    snap_put(s, a->n_rmems);
    snap_put(s, x->p.pa->refs);
    snap_put(s, x->p.pa->xfers != NULL);
    snap_put(s, x->ms->users);
    snap_put(s, x->mb->users);
    snap_put(s, x->r->users);
    pthread_mutex_unlock(&a->mu);
    snap_bytes(s, x->dst, PB);
    snap_bytes(s, x->back, PB);
}

static kv_status call_post(void *p)
{
    struct po_ctx *x = p;
    x->t = SENTINEL;
    x->tag++;
    uint32_t n;
    const struct kv_xport_io *io = po_ios(x, &n);
    const char note[] = "posted";
    struct kv_xport_notify nt = {.tag = x->tag, .msg = note, .len = sizeof(note)};
    switch (x->mode) {
    case 0:
        return kv_xport_write(x->p.pa, io, n, NULL, &x->t);
    case 1:
        return kv_xport_write(x->p.pa, io, n, &nt, &x->t);
    default:
        return kv_xport_read(x->p.pa, io, n, &x->t);
    }
}

static void ok_post(void *p)
{
    struct po_ctx *x = p;
    assert_ptr_not_equal(x->t, SENTINEL);
    kvt_xfer_done(x->t, KV_XPORT_DONE);
    assert_int_equal(kv_xport_xfer_free(x->t), KV_OK);
    x->t = NULL;
    if (x->mode == 1) { /* the notification of the call that succeeded (a failed call's never) */
        assert_int_equal(kv_xport_notify_poll(x->p.b, WAIT_MS, x->msg), KV_OK);
        assert_int_equal(x->msg->tag, x->tag);
        assert_int_equal(x->msg->peer_id, kv_xport_peer_id(x->p.pb));
        assert_int_equal(x->msg->len, sizeof("posted"));
        assert_memory_equal(x->msg->data, "posted", sizeof("posted"));
    }
    uint32_t n;
    const struct kv_xport_io *io = po_ios(x, &n);
    for (uint32_t i = 0; i < n; i++) {
        if (x->mode == 2)
            assert_memory_equal(x->back + io[i].local_off, x->dst + io[i].remote_off, io[i].bytes);
        else
            assert_memory_equal(x->dst + io[i].remote_off, x->src + io[i].local_off, io[i].bytes);
    }
    if (x->mode == 2)
        memset(x->back, 0, PB);
    else
        memset(x->dst, 0, PB);
}

/* Nothing queued: the handle untouched, the regions free again at once
 * (deregistered / freed and made again), no notification at b. */
static void failed_post(void *p)
{
    struct po_ctx *x = p;
    assert_ptr_equal(x->t, SENTINEL);
    x->t = NULL;
    if (x->mode == 2) {
        assert_int_equal(kv_xport_mem_dereg(x->mb), KV_OK);
        assert_int_equal(kv_xport_mem_reg(x->p.a, x->back, PB, KV_MEM_HOST, &x->mb), KV_OK);
    } else {
        assert_int_equal(kv_xport_mem_dereg(x->ms), KV_OK);
        assert_int_equal(kv_xport_mem_reg(x->p.a, x->src, PB, KV_MEM_HOST, &x->ms), KV_OK);
    }
    assert_int_equal(kv_xport_rmem_free(x->r), KV_OK);
    x->r = kvt_share_direct(&x->p, x->md);
    assert_int_equal(kv_xport_notify_poll(x->p.b, 0, x->msg), KV_ERR_TIMEOUT);
}

static void test_rdma_post(void **state)
{
    (void)state;
    static struct po_ctx x;
    memset(&x, 0, sizeof(x));
    pair_open(&x.p, false);
    x.src = malloc(PB);
    x.dst = calloc(1, PB);
    x.back = calloc(1, PB);
    x.msg = malloc(sizeof(*x.msg));
    assert_true(x.src && x.dst && x.back && x.msg);
    kvt_fill(x.src, PB, 5);
    assert_int_equal(kv_xport_mem_reg(x.p.a, x.src, PB, KV_MEM_HOST, &x.ms), KV_OK);
    assert_int_equal(kv_xport_mem_reg(x.p.a, x.back, PB, KV_MEM_HOST, &x.mb), KV_OK);
    assert_int_equal(kv_xport_mem_reg(x.p.b, x.dst, PB, KV_MEM_HOST, &x.md), KV_OK);
    x.r = kvt_share_direct(&x.p, x.md);
    static const char *const names[3] = {"rdma write", "rdma write+note", "rdma read"};
    for (int mode = 0; mode < 3; mode++) {
        x.mode = mode;
        if (mode == 2)
            kvt_fill(x.dst, PB, 9); /* what the read brings back */
        struct oom_case c = {names[mode], &x, call_post, po_snap, ok_post, failed_post, KV_OK};
        assert_true(oom_run(&c) > 0); /* every call here allocates */
    }
    assert_int_equal(kv_xport_notify_poll(x.p.b, 0, x.msg), KV_ERR_TIMEOUT);
    assert_int_equal(kv_xport_rmem_free(x.r), KV_OK);
    assert_int_equal(kv_xport_mem_unexpose(x.p.pb, x.md), KV_OK);
    assert_int_equal(kv_xport_mem_dereg(x.ms), KV_OK);
    assert_int_equal(kv_xport_mem_dereg(x.mb), KV_OK);
    assert_int_equal(kv_xport_mem_dereg(x.md), KV_OK);
    kvt_pair_close(&x.p);
    free(x.src);
    free(x.dst);
    free(x.back);
    free(x.msg);
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
    };
    return cmocka_run_group_tests_name("xport_rdma_oom", tests, NULL, NULL);
}
