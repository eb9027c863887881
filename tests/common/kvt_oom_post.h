/*
 * kvt_oom_post.h - posting transfers out of memory (test_oom over TCP and
 * SHM, test_xport_rdma_oom over RDMA): three buffers on a connected pair
 * (src and back registered at a, dst at b and shared with a), and the
 * oom_case callbacks of a write (mode 0), a write with a notification
 * (mode 1) and a read (mode 2). A failed call leaves nothing queued: the
 * handle untouched, the regions free again at once (deregistered / freed
 * and made again), no notification at b; a call that succeeds ends DONE
 * with its bytes compared, a notification polled exactly once.
 * The test opens the pair; modes above 2 are its own.
 * Include after <cmocka.h>; uses the transport's internals
 * (kv_xport_int.h) for its snapshot.
 */
#ifndef KVT_OOM_POST_H
#define KVT_OOM_POST_H

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <kvcache/kv.h>
#include "kv_xport_int.h"
#include "kvt_oom.h"
#include "kvt_xport.h"

enum { KVT_PO_BYTES = 1u << 16 }; /* bytes of each buffer */

/* What each notification carries (its tag: the call's). */
#define KVT_PO_NOTE "posted"

struct kvt_po {
    struct kvt_pair p;
    unsigned char *src, *dst, *back;
    kv_xport_mem *ms, *md, *mb;
    kv_xport_rmem *r;
    kv_xport_xfer *t;
    int mode; /* 0 write, 1 write + notification, 2 read; above 2: the test's own */
    uint64_t tag;
    struct kv_xport_msg *msg;
};

/* The buffers on x->p (opened by the test): src random (seed 5), dst and
 * back zero; src and back registered at a, dst at b and shared with a. */
static inline void kvt_po_open(struct kvt_po *x)
{
    x->src = malloc(KVT_PO_BYTES);
    x->dst = calloc(1, KVT_PO_BYTES);
    x->back = calloc(1, KVT_PO_BYTES);
    x->msg = malloc(sizeof(*x->msg));
    assert_true(x->src && x->dst && x->back && x->msg);
    kvt_fill(x->src, KVT_PO_BYTES, 5);
    assert_int_equal(kv_xport_mem_reg(x->p.a, x->src, KVT_PO_BYTES, KV_MEM_HOST, &x->ms), KV_OK);
    assert_int_equal(kv_xport_mem_reg(x->p.a, x->back, KVT_PO_BYTES, KV_MEM_HOST, &x->mb), KV_OK);
    assert_int_equal(kv_xport_mem_reg(x->p.b, x->dst, KVT_PO_BYTES, KV_MEM_HOST, &x->md), KV_OK);
    x->r = kvt_share_direct(&x->p, x->md);
}

/* No notification left at b; the regions freed, the pair closed (refused if
 * a failed call left a region or a peer held), the buffers freed. The
 * test's own regions go first. */
static inline void kvt_po_close(struct kvt_po *x)
{
    assert_int_equal(kv_xport_notify_poll(x->p.b, 0, x->msg), KV_ERR_TIMEOUT);
    assert_int_equal(kv_xport_rmem_free(x->r), KV_OK);
    assert_int_equal(kv_xport_mem_unexpose(x->p.pb, x->md), KV_OK);
    assert_int_equal(kv_xport_mem_dereg(x->ms), KV_OK);
    assert_int_equal(kv_xport_mem_dereg(x->mb), KV_OK);
    assert_int_equal(kv_xport_mem_dereg(x->md), KV_OK);
    kvt_pair_close(&x->p);
    free(x->src);
    free(x->dst);
    free(x->back);
    free(x->msg);
}

/* The entries of a write (from src) or a read (into back), both over dst:
 * one short, one long, one at the far end (local KVT_PO_BYTES - 7, remote
 * 7). */
static inline const struct kv_xport_io *kvt_po_ios(struct kvt_po *x, uint32_t *n)
{
    static struct kv_xport_io io[3];
    kv_xport_mem *l = x->mode == 2 ? x->mb : x->ms;
    io[0] = (struct kv_xport_io){l, 100, x->r, 200, 5000};
    io[1] = (struct kv_xport_io){l, 9000, x->r, 30000, 20000};
    io[2] = (struct kv_xport_io){l, KVT_PO_BYTES - 7, x->r, 7, 7};
    *n = 3;
    return io;
}

/* The observable state: a's transfers and imported regions, a's peer's
 * references and queued transfers, the regions' users, dst and back. */
static inline void kvt_po_snap(void *p, struct snap *s)
{
    struct kvt_po *x = p;
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
    snap_bytes(s, x->dst, KVT_PO_BYTES);
    snap_bytes(s, x->back, KVT_PO_BYTES);
}

/* A call begins: the handle SENTINEL, the next tag; its notification. */
static inline struct kv_xport_notify kvt_po_begin(struct kvt_po *x)
{
    x->t = SENTINEL;
    x->tag++;
    return (struct kv_xport_notify){.tag = x->tag, .msg = KVT_PO_NOTE, .len = sizeof(KVT_PO_NOTE)};
}

/* Modes 0-2: the write, the write with its notification, the read. */
static inline kv_status kvt_po_call(void *p)
{
    struct kvt_po *x = p;
    const struct kv_xport_notify nt = kvt_po_begin(x);
    uint32_t n;
    const struct kv_xport_io *io = kvt_po_ios(x, &n);
    switch (x->mode) {
    case 0:
        return kv_xport_write(x->p.pa, io, n, NULL, &x->t);
    case 1:
        return kv_xport_write(x->p.pa, io, n, &nt, &x->t);
    default:
        return kv_xport_read(x->p.pa, io, n, &x->t);
    }
}

/* The call's transfer ends DONE; freed. */
static inline void kvt_po_done(struct kvt_po *x)
{
    assert_ptr_not_equal(x->t, SENTINEL);
    kvt_xfer_done(x->t, KV_XPORT_DONE);
    assert_int_equal(kv_xport_xfer_free(x->t), KV_OK);
    x->t = NULL;
}

/* The next notification at b: the one of the call that succeeded (a failed
 * call's tag never arrives), from a, with KVT_PO_NOTE. */
static inline void kvt_po_note(struct kvt_po *x)
{
    assert_int_equal(kv_xport_notify_poll(x->p.b, 5000, x->msg), KV_OK);
    assert_int_equal(x->msg->tag, x->tag);
    assert_int_equal(x->msg->peer_id, kv_xport_peer_id(x->p.pb));
    assert_int_equal(x->msg->len, sizeof(KVT_PO_NOTE));
    assert_memory_equal(x->msg->data, KVT_PO_NOTE, sizeof(KVT_PO_NOTE));
}

/* Modes 0-2 succeeded: DONE, the notification (mode 1), each entry's bytes
 * landed; the buffer written zeroed again. */
static inline void kvt_po_ok(void *p)
{
    struct kvt_po *x = p;
    kvt_po_done(x);
    if (x->mode == 1)
        kvt_po_note(x);
    uint32_t n;
    const struct kv_xport_io *io = kvt_po_ios(x, &n);
    for (uint32_t i = 0; i < n; i++) {
        if (x->mode == 2)
            assert_memory_equal(x->back + io[i].local_off, x->dst + io[i].remote_off, io[i].bytes);
        else
            assert_memory_equal(x->dst + io[i].remote_off, x->src + io[i].local_off, io[i].bytes);
    }
    if (x->mode == 2)
        memset(x->back, 0, KVT_PO_BYTES);
    else
        memset(x->dst, 0, KVT_PO_BYTES);
}

/* A failed call's handle untouched. */
static inline void kvt_po_untouched(struct kvt_po *x)
{
    assert_ptr_equal(x->t, SENTINEL);
    x->t = NULL;
}

/* No notification at b. */
static inline void kvt_po_quiet(struct kvt_po *x)
{
    assert_int_equal(kv_xport_notify_poll(x->p.b, 0, x->msg), KV_ERR_TIMEOUT);
}

/* Modes 0-2 failed: nothing queued (the local region and r free again at
 * once: deregistered / freed and made again), no notification at b. */
static inline void kvt_po_failed(void *p)
{
    struct kvt_po *x = p;
    kvt_po_untouched(x);
    if (x->mode == 2) {
        assert_int_equal(kv_xport_mem_dereg(x->mb), KV_OK);
        assert_int_equal(kv_xport_mem_reg(x->p.a, x->back, KVT_PO_BYTES, KV_MEM_HOST, &x->mb),
                         KV_OK);
    } else {
        assert_int_equal(kv_xport_mem_dereg(x->ms), KV_OK);
        assert_int_equal(kv_xport_mem_reg(x->p.a, x->src, KVT_PO_BYTES, KV_MEM_HOST, &x->ms),
                         KV_OK);
    }
    assert_int_equal(kv_xport_rmem_free(x->r), KV_OK);
    x->r = kvt_share_direct(&x->p, x->md);
    kvt_po_quiet(x);
}

#endif /* KVT_OOM_POST_H */
