/*
 * kv_xport_rdma_verbs.c - the RDMA backend of the transport seam
 * (kv_xport_int.h): RC queue pairs, one-sided RDMA WRITE / READ straight
 * between registered regions, every verbs call through kv__verbs_get()
 * (kv_verbs_int.h), so tests run it over the software device.
 *
 * Model:
 *
 *   out of band   an internal TCP kv_xport (same token, fingerprint, host,
 *                 port; one connection per peer) carries the checked
 *                 handshake (version, token, fingerprint) and then, as its
 *                 notifications, INFO (per QP: qpn, psn; the GID; this
 *                 side's connection id) and READY (every QP of the sender
 *                 is RTR/RTS). A peer is READY once both INFO were applied
 *                 (INIT -> RTR -> RTS) and the other side's READY came, so
 *                 nothing is sent to a QP that cannot take it yet. A dead
 *                 OOB peer closes the RDMA peer.
 *   regions       one local-access MR per chunk of at most max_mr_size
 *                 bytes (rounded down to 4 KiB) for the SGEs of our own
 *                 WRs; each exposure to a peer registers the region again,
 *                 remote access only, with its own rkeys: the blob key is
 *                 the chunk count, the chunk size, the region's virtual
 *                 base and each of that exposure's rkeys. Unexposing (or
 *                 closing the peer) deregisters them: the peer's rkeys stop
 *                 working at the NIC.
 *   writes/reads  a WR is one remote-contiguous range inside one remote
 *                 chunk, gathered from up to max_sge local pieces (each
 *                 inside one local chunk), WRs round robin over the peer's
 *                 QPs. Every 16th WR of a posting round and its last are
 *                 signaled; a QP's ring of WR records (wr_id = sequence)
 *                 retires in order, so a signaled completion retires the
 *                 unsignaled WRs before it (RC completes in order), and a
 *                 QP never holds more than max_send_wr WRs whose slots are
 *                 not freed. An entry ends KV_OK when every byte of it was
 *                 covered by a successful completion: results are exact.
 *   notifications a SEND on QP 0 (a 16-byte header: magic, tag, length,
 *                 then the message) into a receive buffer the receiver
 *                 pre-posted (registered), sent only when every earlier
 *                 write on the peer has completed (kv__xport_note_may_go):
 *                 with several QPs RC orders nothing across QPs, so the
 *                 gate is on completions, not on posting order. Its
 *                 completion ends the transfer DONE. The receiver turns
 *                 the receive completion into kv__xport_note_push and
 *                 re-posts the buffer.
 *   errors        a completion error ends its entries with a status
 *                 mapped from ibv_wc_status (REM_ACCESS_ERR ->
 *                 KV_ERR_OUT_OF_BOUNDS, others KV_ERR_IO; the wc status
 *                 string in the peer's message) and closes the peer: every
 *                 QP goes to ERR, a signaled marker WR is posted behind
 *                 what is outstanding, and only once each marker's flush
 *                 completion arrived (nothing of the peer in flight any
 *                 more) are transfers ended and QPs destroyed. A transfer
 *                 past its deadline with nothing outstanding ends
 *                 TIMED_OUT; with WRs outstanding it cannot be taken back:
 *                 the peer is closed that way and the transfer ends
 *                 TIMED_OUT after the drain. A cancel waits until nothing
 *                 of the transfer is outstanding. WRs retired by a marker
 *                 without their own completion count as not done.
 *
 * Receiver-side bounds: the NIC enforces them. A peer can address only
 * what an MR covers with the rkey it holds, and it learns rkeys only from
 * the blobs of regions exposed to it (kv_xport_mem_expose); a write outside
 * an MR is refused by the responder (REM_ACCESS_ERR: nothing written, the
 * sender's entry FAILED with KV_ERR_OUT_OF_BOUNDS), and so is one with the
 * rkey of an exposure that ended. What RDMA cannot give that TCP does:
 * regions of one transport share a PD, so an rkey leaked to another peer of
 * the same transport would work there too while its exposure lasts.
 *
 * Threads: one progress thread per transport makes every terminal
 * transition and every post/poll (the rule of kv_xport_tcp.c); it drops
 * x->mu around verbs calls and around calls into the OOB transport (whose
 * own lock is never held while taking x->mu, so the order is x->mu ->
 * oob). WR records name transfers by id (kv__xport_xfer_find), never by
 * pointer, and a transfer's `busy` counts its WRs not yet retired.
 */
#include <errno.h>
#include <stdarg.h>
#include <inttypes.h>
#include <netdb.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "kv_mem.h"
#include "kv_verbs_int.h"
#include "kv_xport_frame_int.h"
#include "kv_xport_int.h"

#define RD_SIG_EVERY 16u             /* a signaled WR at least every this many */
#define RD_WR_MAX_BYTES (256u << 10) /* bytes per WR (spreads a transfer over QPs) */
#define RD_MAX_SGE 16u               /* SGEs per WR at most (and max_sge of the device) */
#define RD_SQ_WR 256u                /* send queue depth per QP (and max_qp_wr) */
#define RD_RECVS 16u                 /* receive buffers per QP */
#define RD_NOTE_SLOTS 8u             /* notifications in flight per peer */
#define RD_NOTE_HDR 16u
#define RD_MSG_BYTES (RD_NOTE_HDR + KV_XPORT_NOTIFY_MAX)
#define RD_NOTE_MAGIC 0x4b56524eu /* "KVRN" */
#define RD_KEY_HEAD 24u
#define RD_MAX_CHUNKS ((KV__XPORT_KEY_MAX - RD_KEY_HEAD) / 4u)
#define RD_OOB_INFO 0x4b56524449000001ull  /* OOB tags: QP info */
#define RD_OOB_READY 0x4b56524449000002ull /* every QP of the sender is RTS */
#define RD_DRAIN_NS (2000ull * 1000000ull) /* a marker that never completes */
#define RD_RECV_BIT (1ull << 63)

_Static_assert(RD_MAX_CHUNKS >= 1, "a key holds at least one rkey");

enum rec_kind { REC_WRITE = 1, REC_READ, REC_NOTE, REC_MARK };

/* One posted send WR (ring slot seq % RD_SQ_WR of its QP). */
struct rec {
    uint8_t kind;
    uint8_t n;    /* pieces */
    uint8_t slot; /* REC_NOTE: the note buffer */
    uint64_t xfer;
    uint32_t entry[RD_MAX_SGE];
    uint32_t bytes[RD_MAX_SGE];
};

struct rqp {
    struct ibv_qp *qp;
    uint32_t psn;
    uint64_t head, tail; /* records posted / retired: head - tail <= RD_SQ_WR */
    bool marked;         /* a drain marker posted */
    bool drained;        /* its completion arrived (or nothing was ever posted) */
};

/* Region state: one MR per chunk. */
struct rmr {
    uint32_t n;
    uint64_t chunk;
    struct ibv_mr *mr[RD_MAX_CHUNKS];
};

enum rphase { PH_OOB, PH_INFO, PH_RTS, PH_READY, PH_FAIL };

struct rpeer {
    kv_xport_peer *p;
    struct rpeer *next;
    kv_xport_peer *oob;
    uint64_t oob_id; /* its id: how the OOB transport's messages name it */
    enum rphase ph;
    bool info_sent, ready_sent, ready_got, close_req;
    kv_xport_xfer *oob_x[2]; /* the INFO / READY notifications (freed when terminal) */
    uint32_t nq;
    struct rqp q[KV__XPORT_MAX_CONNS];
    struct rec *ring; /* [nq][RD_SQ_WR] */
    struct ibv_cq *cq;
    unsigned char *bufs; /* [nq * RD_RECVS + RD_NOTE_SLOTS][RD_MSG_BYTES] */
    struct ibv_mr *bufs_mr;
    bool note_busy[RD_NOTE_SLOTS];
    uint32_t next_q;
    uint64_t deadline_ns; /* handshake; PH_FAIL: drain */
    kv_status why;
    char msg[256];
};

struct rdma {
    kv_xport *x;
    const struct kv__verbs *v;
    struct ibv_context *ctx;
    struct ibv_pd *pd;
    struct ibv_device_attr da;
    union ibv_gid gid;
    uint64_t chunk; /* MR chunk bytes */
    uint32_t sge;
    kv_xport *oob;
    pthread_t thr;
    bool stop;
    struct rpeer *peers;
    char dev[64];
    kv_status teardown; /* the first verbs teardown call that failed (kv_xport_destroy) */
    char teardown_msg[200];
};

/* mu NOT needed: note the first teardown call that failed (rc != 0). */
static void teardown_check(struct rdma *r, int rc, const char *what)
{
    if (rc == 0 || r->teardown != KV_OK)
        return;
    r->teardown = KV_ERR_DEVICE;
    snprintf(r->teardown_msg, sizeof(r->teardown_msg), "xport rdma: %s on %s: %s", what, r->dev,
             strerror(rc < 0 ? -rc : rc));
}

/* Destroy an internal transport on an error path, keeping the caller's
 * error message. */
static void oob_destroy_quiet(kv_xport *oob)
{
    kv__error_mute();
    if (kv_xport_destroy(oob) != KV_OK)
        kv__error_clear();
    kv__error_unmute();
}

static kv_status wc_status(enum ibv_wc_status s)
{
    switch (s) {
    case IBV_WC_SUCCESS:
        return KV_OK;
    case IBV_WC_REM_ACCESS_ERR:
        return KV_ERR_OUT_OF_BOUNDS;
    case IBV_WC_LOC_PROT_ERR:
    case IBV_WC_LOC_ACCESS_ERR:
        return KV_ERR_INVALID_ARG;
    case IBV_WC_REM_INV_REQ_ERR:
        return KV_ERR_INVALID_ARG;
    default: /* RETRY_EXC, RNR_RETRY_EXC, WR_FLUSH, REM_OP ... */
        return KV_ERR_IO;
    }
}

static const char *wc_str(enum ibv_wc_status s)
{
    return ibv_wc_status_str(s);
}

static void kick(kv_xport *x)
{
    pthread_cond_broadcast(&x->cv);
}

/* ---- start / stop ----------------------------------------------------- */

static void *progress(void *arg);

static kv_status rdma_start(kv_xport *x)
{
    const struct kv__verbs *v = NULL;
    kv_status st = kv__verbs_acquire(&v);
    if (st != KV_OK)
        return kv__error_wrap(st, "xport_create(rdma)");
    struct rdma *r = kv__mem_calloc(1, sizeof(*r));
    if (!r)
        return kv__error(KV_ERR_NO_MEMORY, "xport_create: rdma state");
    r->x = x;
    r->v = v;
    int num = 0;
    struct ibv_device **list = v->get_device_list(&num);
    if (!list || num <= 0) {
        if (list)
            v->free_device_list(list);
        st = kv__error(KV_ERR_UNSUPPORTED,
                       "xport_create(rdma): no RDMA device found (%s: ibv_get_device_list "
                       "lists none)",
                       v->name);
        goto fail_state;
    }
    snprintf(r->dev, sizeof(r->dev), "%s", v->get_device_name(list[0]));
    r->ctx = v->open_device(list[0]);
    v->free_device_list(list);
    if (!r->ctx) {
        st =
            kv__error(KV_ERR_IO, "xport_create(rdma): open_device %s: %s", r->dev, strerror(errno));
        goto fail_state;
    }
    int e = v->query_device(r->ctx, &r->da);
    if (e == 0)
        e = v->query_gid(r->ctx, 1, 0, &r->gid);
    if (e != 0) {
        st = kv__error(KV_ERR_IO, "xport_create(rdma): query device/gid of %s: %s", r->dev,
                       strerror(e));
        goto fail_ctx;
    }
    if (r->da.max_qp_wr < (int)RD_SQ_WR || r->da.max_sge < 1 || r->da.max_mr_size < 4096) {
        st = kv__error(KV_ERR_UNSUPPORTED,
                       "xport_create(rdma): %s: max_qp_wr %d (need %u), max_sge %d, "
                       "max_mr_size %" PRIu64,
                       r->dev, r->da.max_qp_wr, RD_SQ_WR, r->da.max_sge,
                       (uint64_t)r->da.max_mr_size);
        goto fail_ctx;
    }
    r->sge = (uint32_t)r->da.max_sge < RD_MAX_SGE ? (uint32_t)r->da.max_sge : RD_MAX_SGE;
    r->chunk = (uint64_t)r->da.max_mr_size & ~4095ull;
    r->pd = v->alloc_pd(r->ctx);
    if (!r->pd) {
        st = kv__error(KV_ERR_IO, "xport_create(rdma): alloc_pd: %s", strerror(errno));
        goto fail_ctx;
    }
    /* Out of band: the checked TCP handshake and the QP exchange. */
    struct kv_xport_config oc = x->cfg;
    oc.kind = KV_XPORT_TCP;
    oc.conns_per_peer = 1;
    st = kv_xport_create(&oc, &r->oob);
    if (st != KV_OK) {
        st = kv__error_wrap(st, "xport_create(rdma): the out-of-band transport");
        goto fail_pd;
    }
    x->port = kv_xport_port(r->oob);
    x->be = r;
    e = pthread_create(&r->thr, NULL, progress, r);
    if (e != 0) {
        x->be = NULL;
        st = kv__error(KV_ERR_IO, "xport_create(rdma): progress thread: %s", strerror(e));
        goto fail_oob;
    }
    return KV_OK;

fail_oob:
    oob_destroy_quiet(r->oob);
fail_pd:
    (void)v->dealloc_pd(r->pd);
fail_ctx:
    (void)v->close_device(r->ctx);
fail_state:
    kv__mem_free(r);
    return st;
}

/* ---- peers: QPs, buffers, teardown ------------------------------------ */

static unsigned char *buf_at(struct rpeer *rp, uint32_t i)
{
    return rp->bufs + (size_t)i * RD_MSG_BYTES;
}

/* mu NOT held: the verbs resources of rp (CQ, QPs in INIT, buffers, the
 * receives posted). */
static kv_status peer_verbs(struct rdma *r, struct rpeer *rp)
{
    const struct kv__verbs *v = r->v;
    const uint32_t nq = rp->nq;
    rp->ring = kv__mem_calloc((size_t)nq * RD_SQ_WR, sizeof(*rp->ring));
    const size_t nb = (size_t)nq * RD_RECVS + RD_NOTE_SLOTS;
    rp->bufs = kv__mem_calloc(nb, RD_MSG_BYTES);
    if (!rp->ring || !rp->bufs)
        return kv__error(KV_ERR_NO_MEMORY, "xport rdma: peer buffers");
    rp->bufs_mr = v->reg_mr(r->pd, rp->bufs, nb * RD_MSG_BYTES, IBV_ACCESS_LOCAL_WRITE);
    if (!rp->bufs_mr)
        return kv__error(KV_ERR_IO, "xport rdma: reg_mr of the message buffers: %s",
                         strerror(errno));
    const int cqe = (int)(nq * (RD_SQ_WR + RD_RECVS) + 16);
    rp->cq = v->create_cq(r->ctx, cqe, NULL, NULL, 0);
    if (!rp->cq)
        return kv__error(KV_ERR_IO, "xport rdma: create_cq of %d: %s", cqe, strerror(errno));
    for (uint32_t i = 0; i < nq; i++) {
        struct ibv_qp_init_attr ia = {.send_cq = rp->cq,
                                      .recv_cq = rp->cq,
                                      .cap = {.max_send_wr = RD_SQ_WR,
                                              .max_recv_wr = RD_RECVS,
                                              .max_send_sge = r->sge,
                                              .max_recv_sge = 1},
                                      .qp_type = IBV_QPT_RC};
        struct rqp *q = &rp->q[i];
        q->qp = v->create_qp(r->pd, &ia);
        if (!q->qp)
            return kv__error(KV_ERR_IO, "xport rdma: create_qp: %s", strerror(errno));
        q->drained = true; /* nothing posted yet */
        q->psn = (uint32_t)(kv__xxh3_64(&(uint64_t[2]){kv__xport_now_ns(), i}, 16) & 0xffffff);
        struct ibv_qp_attr a = {.qp_state = IBV_QPS_INIT,
                                .pkey_index = 0,
                                .port_num = 1,
                                .qp_access_flags = IBV_ACCESS_LOCAL_WRITE |
                                                   IBV_ACCESS_REMOTE_WRITE |
                                                   IBV_ACCESS_REMOTE_READ};
        int e = v->modify_qp(q->qp, &a,
                             IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
        if (e)
            return kv__error(KV_ERR_IO, "xport rdma: QP %u to INIT: %s", i, strerror(e));
        for (uint32_t k = 0; k < RD_RECVS; k++) {
            const uint32_t b = i * RD_RECVS + k;
            struct ibv_sge sg = {.addr = (uintptr_t)buf_at(rp, b),
                                 .length = RD_MSG_BYTES,
                                 .lkey = rp->bufs_mr->lkey};
            struct ibv_recv_wr w = {.wr_id = RD_RECV_BIT | b, .sg_list = &sg, .num_sge = 1},
                               *bad = NULL;
            e = v->post_recv(q->qp, &w, &bad);
            if (e)
                return kv__error(KV_ERR_IO, "xport rdma: post_recv: %s", strerror(e));
        }
    }
    return KV_OK;
}

/* mu NOT held: free what peer_verbs made (QPs first: nothing lands after);
 * a call that fails is noted for kv_xport_destroy. */
static void peer_verbs_free(struct rdma *r, struct rpeer *rp)
{
    const struct kv__verbs *v = r->v;
    for (uint32_t i = 0; i < rp->nq; i++)
        if (rp->q[i].qp)
            teardown_check(r, v->destroy_qp(rp->q[i].qp), "ibv_destroy_qp");
    if (rp->cq)
        teardown_check(r, v->destroy_cq(rp->cq), "ibv_destroy_cq");
    if (rp->bufs_mr)
        teardown_check(r, v->dereg_mr(rp->bufs_mr), "ibv_dereg_mr (message buffers)");
    kv__mem_free(rp->bufs);
    kv__mem_free(rp->ring);
}

static struct rpeer *rpeer_new(struct rdma *r, kv_xport_peer *p, kv_xport_peer *oob)
{
    struct rpeer *rp = kv__mem_calloc(1, sizeof(*rp));
    if (!rp)
        return NULL;
    rp->p = p;
    rp->oob = oob;
    rp->nq = r->x->cfg.conns_per_peer;
    rp->ph = PH_OOB;
    rp->deadline_ns = kv__xport_now_ns() + (uint64_t)r->x->cfg.timeout_ms * 1000000ull;
    return rp;
}

/* mu held: start closing rp (why, msg): every QP to ERR behind a marker;
 * the transfers end once the markers completed (finish_fail). */
static void peer_fail(struct rdma *r, struct rpeer *rp, kv_status why, const char *fmt, ...)
    KV_PRINTF(4, 5);
static void peer_fail(struct rdma *r, struct rpeer *rp, kv_status why, const char *fmt, ...)
{
    if (rp->ph == PH_FAIL)
        return;
    rp->ph = PH_FAIL;
    rp->why = why;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(rp->msg, sizeof(rp->msg), fmt, ap);
    va_end(ap);
    rp->deadline_ns = kv__xport_now_ns() + RD_DRAIN_NS;
    kv_xport *x = r->x;
    for (uint32_t i = 0; i < rp->nq; i++) {
        struct rqp *q = &rp->q[i];
        if (!q->qp)
            continue;
        pthread_mutex_unlock(&x->mu);
        struct ibv_qp_attr a = {.qp_state = IBV_QPS_ERR};
        const int e = r->v->modify_qp(q->qp, &a, IBV_QP_STATE);
        pthread_mutex_lock(&x->mu);
        if (e != 0 || q->head == q->tail) {
            q->drained = true; /* nothing outstanding (or nothing can flush) */
            continue;
        }
        /* A marker behind what is outstanding: its flush completion says
         * the QP is done with everything before it (a slot is always kept
         * free for it). */
        struct rec *rc = &rp->ring[(size_t)i * RD_SQ_WR + q->head % RD_SQ_WR];
        memset(rc, 0, sizeof(*rc));
        rc->kind = REC_MARK;
        const uint64_t seq = q->head++;
        q->marked = true;
        q->drained = false;
        struct ibv_send_wr w = {.wr_id = seq,
                                .opcode = IBV_WR_RDMA_WRITE,
                                .send_flags = IBV_SEND_SIGNALED,
                                .num_sge = 0},
                           *bad = NULL;
        pthread_mutex_unlock(&x->mu);
        const int pe = r->v->post_send(q->qp, &w, &bad);
        pthread_mutex_lock(&x->mu);
        if (pe != 0)
            q->drained = true;
    }
}

/* mu held: retire the records of QP qi up to and including seq; `st` is
 * the completion's status for seq, the records before it succeeded unless
 * st is a flush (then they were flushed too, or, behind a marker, unknown:
 * not done either way). */
static void retire(struct rdma *r, struct rpeer *rp, uint32_t qi, uint64_t seq,
                   enum ibv_wc_status wst)
{
    struct rqp *q = &rp->q[qi];
    if (seq < q->tail || seq >= q->head)
        return; /* stale */
    for (uint64_t s = q->tail; s <= seq; s++) {
        struct rec *rc = &rp->ring[(size_t)qi * RD_SQ_WR + s % RD_SQ_WR];
        const enum ibv_wc_status st =
            s == seq ? wst : (wst == IBV_WC_WR_FLUSH_ERR ? IBV_WC_WR_FLUSH_ERR : IBV_WC_SUCCESS);
        if (rc->kind == REC_MARK) {
            if (s == seq)
                q->drained = true;
            continue;
        }
        if (rc->kind == REC_NOTE)
            rp->note_busy[rc->slot] = false;
        kv_xport_xfer *t = kv__xport_xfer_find(rp->p, rc->xfer);
        if (!t)
            continue;
        if (t->busy)
            t->busy--;
        const kv_status ks = st == IBV_WC_SUCCESS ? KV_OK : wc_status(st);
        if (rc->kind == REC_NOTE) {
            if (ks == KV_OK)
                t->note_done = true;
            else
                t->failed++; /* ended FAILED at settle (its entries all ended OK) */
            continue;
        }
        for (uint32_t k = 0; k < rc->n; k++) {
            const uint32_t e = rc->entry[k];
            if (t->ended[e])
                continue;
            if (ks != KV_OK) {
                kv__xport_entry_end(t, e, ks);
                continue;
            }
            t->moved[e] += rc->bytes[k];
            if (t->moved[e] == t->ios[e].bytes)
                kv__xport_entry_end(t, e, KV_OK);
        }
    }
    q->tail = seq + 1;
    (void)r;
}

/* mu held: the markers have all completed (or the drain deadline passed):
 * end the transfers, free the verbs state, close the OOB peer, drop the
 * backend's reference. rp is freed. */
static void finish_fail(struct rdma *r, struct rpeer *rp)
{
    kv_xport *x = r->x;
    for (struct rpeer **pp = &r->peers; *pp; pp = &(*pp)->next)
        if (*pp == rp) {
            *pp = rp->next;
            break;
        }
    kv_xport_peer *p = rp->p;
    const uint64_t now = kv__xport_now_ns();
    for (kv_xport_xfer *t = p->xfers, *nx; t; t = nx) {
        nx = t->next;
        if (now >= t->deadline_ns)
            kv__xport_xfer_end(t, t->cancel_req ? KV_XPORT_CANCELLED : KV_XPORT_TIMED_OUT,
                               t->cancel_req ? KV_ERR_CANCELLED : KV_ERR_TIMEOUT);
    }
    p->be = NULL;
    kv__xport_peer_closed(p, rp->why, rp->msg);
    kv__xport_peer_unref(p);
    pthread_mutex_unlock(&x->mu);
    peer_verbs_free(r, rp);
    if (rp->oob) /* its transfers end (CANCELLED at the latest) before it returns */
        kv_xport_peer_close(rp->oob);
    for (int i = 0; i < 2; i++)
        if (rp->oob_x[i])
            if (kv_xport_xfer_free(rp->oob_x[i]) != KV_OK)
                kv__error_clear(); /* cannot be pending: the OOB peer is closed */
    kv__mem_free(rp);
    pthread_mutex_lock(&x->mu);
    kick(x);
}

static kv_status rdma_stop(kv_xport *x)
{
    struct rdma *r = x->be;
    pthread_mutex_lock(&x->mu);
    r->stop = true;
    kick(x);
    pthread_mutex_unlock(&x->mu);
    pthread_join(r->thr, NULL);
    if (kv_xport_destroy(r->oob) != KV_OK && r->teardown == KV_OK) {
        r->teardown = kv__error_wrap(KV_ERR_BAD_STATE, "xport rdma: the out-of-band transport");
        snprintf(r->teardown_msg, sizeof(r->teardown_msg), "%s", kv_last_error());
    }
    teardown_check(r, r->v->dealloc_pd(r->pd), "ibv_dealloc_pd");
    teardown_check(r, r->v->close_device(r->ctx), "ibv_close_device");
    const kv_status st = r->teardown;
    char msg[sizeof(r->teardown_msg)];
    memcpy(msg, r->teardown_msg, sizeof(msg));
    kv__mem_free(r);
    x->be = NULL;
    return st == KV_OK ? KV_OK : kv__error(st, "xport_destroy: %s", msg);
}

static kv_status rdma_connect(kv_xport_peer *p, const char *host, uint16_t port)
{
    kv_xport *x = p->x;
    struct rdma *r = x->be;
    struct rpeer *rp = rpeer_new(r, p, NULL);
    if (!rp)
        return kv__error(KV_ERR_NO_MEMORY, "xport_connect(rdma): peer state");
    kv_status st = peer_verbs(r, rp);
    if (st != KV_OK) {
        peer_verbs_free(r, rp);
        kv__mem_free(rp);
        return st;
    }
    /* The name is resolved first, without x->mu (a DNS lookup must not
     * hold up calls on other peers); the OOB connect of the numeric address
     * then runs under x->mu (the order x->mu -> oob): the progress thread
     * matches the OOB peer's first notification only with x->mu held, so it
     * finds rp listed. */
    char num[NI_MAXHOST];
    {
        struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM};
        struct addrinfo *ai = NULL;
        const int g = getaddrinfo(host, NULL, &hints, &ai);
        const int n = g == 0 ? getnameinfo(ai->ai_addr, ai->ai_addrlen, num, sizeof(num), NULL, 0,
                                           NI_NUMERICHOST)
                             : g;
        if (ai)
            freeaddrinfo(ai);
        if (g != 0 || n != 0) {
            peer_verbs_free(r, rp);
            kv__mem_free(rp);
            return kv__error(KV_ERR_INVALID_ARG, "xport_connect(rdma): host \"%s\": %s", host,
                             gai_strerror(g != 0 ? g : n));
        }
    }
    pthread_mutex_lock(&x->mu);
    kv_xport_peer *op = NULL;
    st = kv_xport_connect(r->oob, num, port, &op);
    if (st != KV_OK) {
        pthread_mutex_unlock(&x->mu);
        peer_verbs_free(r, rp);
        kv__mem_free(rp);
        return kv__error_wrap(st, "xport_connect(rdma): out of band");
    }
    rp->oob = op;
    rp->oob_id = kv_xport_peer_id(op);
    p->be = rp;
    rp->next = r->peers;
    r->peers = rp;
    kick(x);
    pthread_mutex_unlock(&x->mu);
    return KV_OK;
}

/* ---- memory ----------------------------------------------------------- */

static kv_status rdma_mem_reg(kv_xport_mem *m)
{
    struct rdma *r = m->x->be;
    const uint64_t n = (m->bytes + r->chunk - 1) / r->chunk;
    if (n > RD_MAX_CHUNKS)
        return kv__error(KV_ERR_CAPACITY,
                         "xport_mem_reg(rdma): %" PRIu64 " bytes need %" PRIu64
                         " MRs of at most %" PRIu64 " bytes (max_mr_size of %s); a blob holds "
                         "%u",
                         m->bytes, n, r->chunk, r->dev, RD_MAX_CHUNKS);
    struct rmr *rm = kv__mem_calloc(1, sizeof(*rm));
    if (!rm)
        return kv__error(KV_ERR_NO_MEMORY, "xport_mem_reg(rdma): region state");
    rm->chunk = r->chunk;
    /* Our own WRs' SGEs only: a peer reaches the region through the MRs of
     * an exposure (rdma_expose), never these. */
    const int acc = IBV_ACCESS_LOCAL_WRITE;
    for (uint32_t i = 0; i < n; i++) {
        const uint64_t off = (uint64_t)i * r->chunk;
        const uint64_t len = m->bytes - off < r->chunk ? m->bytes - off : r->chunk;
        rm->mr[i] = r->v->reg_mr(r->pd, m->base + off, (size_t)len, acc);
        if (!rm->mr[i]) {
            const int e = errno;
            while (i--)
                r->v->dereg_mr(rm->mr[i]);
            kv__mem_free(rm);
            return kv__error(e == ENOMEM ? KV_ERR_NO_MEMORY : KV_ERR_IO,
                             "xport_mem_reg(rdma): reg_mr of chunk %u (%" PRIu64
                             " bytes at +%" PRIu64 "): %s",
                             (unsigned)(off / r->chunk), len, off, strerror(e));
        }
        rm->n = i + 1;
    }
    m->be = rm;
    return KV_OK;
}

/* Deregister rm's MRs from the last; an error keeps that one and the ones
 * before it (the region stays registered: the caller can retry). */
static kv_status rmr_dereg(struct rdma *r, struct rmr *rm, const char *what)
{
    while (rm->n) {
        const int e = r->v->dereg_mr(rm->mr[rm->n - 1]);
        if (e != 0)
            return kv__error(KV_ERR_DEVICE, "xport rdma: ibv_dereg_mr of %s chunk %u on %s: %s",
                             what, rm->n - 1, r->dev, strerror(e < 0 ? -e : e));
        rm->n--;
    }
    return KV_OK;
}

static kv_status rdma_mem_dereg(kv_xport_mem *m)
{
    struct rdma *r = m->x->be;
    struct rmr *rm = m->be;
    if (!rm)
        return KV_OK;
    const kv_status st = rmr_dereg(r, rm, "a region");
    if (st != KV_OK)
        return kv__error_wrap(st, "xport_mem_dereg: region %u", m->region);
    kv__mem_free(rm);
    m->be = NULL;
    return KV_OK;
}

/* The exposure's own MRs, remote access, the region's chunking; its key
 * (LE): 0 4 chunks, 4 4 reserved, 8 8 chunk bytes, 16 8 base address,
 * 24 4*chunks rkeys. */
static kv_status rdma_expose(kv_xport_peer *p, struct kv__xport_expo *e)
{
    (void)p;
    kv_xport_mem *m = e->mem;
    struct rdma *r = m->x->be;
    const struct rmr *lm = m->be;
    struct rmr *rm = kv__mem_calloc(1, sizeof(*rm));
    if (!rm)
        return kv__error(KV_ERR_NO_MEMORY, "xport_mem_expose(rdma): exposure state");
    rm->chunk = lm->chunk;
    const int acc = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
    for (uint32_t i = 0; i < lm->n; i++) {
        const uint64_t off = (uint64_t)i * rm->chunk;
        const uint64_t len = m->bytes - off < rm->chunk ? m->bytes - off : rm->chunk;
        rm->mr[i] = r->v->reg_mr(r->pd, m->base + off, (size_t)len, acc);
        if (!rm->mr[i]) {
            const int err = errno;
            if (rmr_dereg(r, rm, "an exposure") != KV_OK)
                kv__error_clear(); /* keeps failing: leaked, noted for destroy */
            kv__mem_free(rm);
            return kv__error(err == ENOMEM ? KV_ERR_NO_MEMORY : KV_ERR_IO,
                             "xport_mem_expose(rdma): reg_mr of chunk %u of region %u: %s", i,
                             m->region, strerror(err));
        }
        rm->n = i + 1;
    }
    unsigned char *key = e->key;
    kv__le_put(key, rm->n, 4);
    kv__le_put(key + 4, 0, 4);
    kv__le_put(key + 8, rm->chunk, 8);
    kv__le_put(key + 16, (uint64_t)(uintptr_t)m->base, 8);
    for (uint32_t i = 0; i < rm->n; i++)
        kv__le_put(key + RD_KEY_HEAD + 4 * i, rm->mr[i]->rkey, 4);
    e->key_len = RD_KEY_HEAD + 4 * rm->n;
    e->be = rm;
    return KV_OK;
}

/* mu held (dropped around the verbs calls): the exposure's MRs go, so the
 * rkeys the peer holds stop working. */
static void rdma_unexpose(kv_xport_peer *p, struct kv__xport_expo *e)
{
    struct rmr *rm = e->be;
    kv_xport *x = p->x;
    struct rdma *r = x->be;
    if (!rm || !r)
        return;
    e->be = NULL;
    pthread_mutex_unlock(&x->mu);
    if (rmr_dereg(r, rm, "an exposure") != KV_OK) {
        teardown_check(r, EBUSY, "ibv_dereg_mr of an exposure");
        kv__error_clear();
    }
    pthread_mutex_lock(&x->mu);
    kv__mem_free(rm);
}

/* A remote region's key, decoded: false when malformed. */
struct rkey {
    uint32_t n;
    uint64_t chunk, base;
    const unsigned char *keys;
};

static bool rkey_get(const kv_xport_rmem *rm, struct rkey *k)
{
    if (rm->key_len < RD_KEY_HEAD)
        return false;
    k->n = (uint32_t)kv__le_get(rm->key, 4);
    k->chunk = kv__le_get(rm->key + 8, 8);
    k->base = kv__le_get(rm->key + 16, 8);
    k->keys = rm->key + RD_KEY_HEAD;
    return k->n >= 1 && k->n <= RD_MAX_CHUNKS && k->chunk && rm->key_len == RD_KEY_HEAD + 4 * k->n;
}

/* The rkey of the chunk holding remote offset off (past the last chunk:
 * the last one's, and the responder refuses). */
static uint32_t rkey_of(const struct rkey *k, uint64_t off)
{
    uint64_t c = off / k->chunk;
    c = c >= k->n ? k->n - 1 : c;
    return (uint32_t)kv__le_get(k->keys + 4 * c, 4);
}

static void rdma_post(kv_xport_xfer *t)
{
    t->be_entry = 0;
    t->be_off = 0;
    kick(t->peer->x);
}

static void rdma_cancel(kv_xport_xfer *t)
{
    kick(t->peer->x);
}

static void rdma_peer_close(kv_xport_peer *p)
{
    struct rpeer *rp = p->be;
    if (rp)
        rp->close_req = true;
    else
        kv__xport_peer_closed(p, KV_OK, "closed");
    kick(p->x);
}

static const struct kv__xport_ops kv__xport_rdma_ops = {
    .version = KV__XPORT_OPS_VERSION,
    .kind = KV_XPORT_RDMA,
    .name = "rdma",
    .start = rdma_start,
    .stop = rdma_stop,
    .connect = rdma_connect,
    .mem_reg = rdma_mem_reg,
    .mem_dereg = rdma_mem_dereg,
    .expose = rdma_expose,
    .unexpose = rdma_unexpose,
    .post = rdma_post,
    .cancel = rdma_cancel,
    .peer_close = rdma_peer_close,
};

const struct kv__xport_ops *kv__xport_rdma(void)
{
    return &kv__xport_rdma_ops;
}

/* ---- the handshake after the OOB one ---------------------------------- */

/* INFO (LE): 0 4 kind, 4 4 QPs, 8 8 connection id, 16 16 GID, then per QP
 * 4 qpn, 4 psn. */
#define INFO_HEAD 32u

/* mu held: send an OOB notification of rp (INFO or READY). */
static bool oob_send(struct rdma *r, struct rpeer *rp, int which, const void *msg, uint32_t len)
{
    kv_xport *x = r->x;
    const struct kv_xport_notify n = {
        .tag = which ? RD_OOB_READY : RD_OOB_INFO, .msg = msg, .len = len};
    kv_xport_peer *op = rp->oob;
    pthread_mutex_unlock(&x->mu);
    kv_xport_xfer *t = NULL;
    const kv_status st = kv_xport_write(op, NULL, 0, &n, &t);
    pthread_mutex_lock(&x->mu);
    if (st != KV_OK)
        return false;
    rp->oob_x[which] = t;
    return true;
}

static void send_info(struct rdma *r, struct rpeer *rp)
{
    unsigned char b[INFO_HEAD + 8 * KV__XPORT_MAX_CONNS];
    kv__le_put(b, KV_XPORT_RDMA, 4);
    kv__le_put(b + 4, rp->nq, 4);
    kv__le_put(b + 8, rp->p->nonce_local, 8);
    memcpy(b + 16, r->gid.raw, 16);
    for (uint32_t i = 0; i < rp->nq; i++) {
        kv__le_put(b + INFO_HEAD + 8 * i, rp->q[i].qp->qp_num, 4);
        kv__le_put(b + INFO_HEAD + 8 * i + 4, rp->q[i].psn, 4);
    }
    if (!oob_send(r, rp, 0, b, INFO_HEAD + 8 * rp->nq))
        peer_fail(r, rp, KV_ERR_IO, "xport rdma: sending QP info: %s", kv_last_error());
    else
        rp->info_sent = true;
}

/* mu held: the peer's INFO: every QP INIT -> RTR -> RTS, then READY. */
static void got_info(struct rdma *r, struct rpeer *rp, const unsigned char *b, uint32_t len)
{
    kv_xport *x = r->x;
    if (rp->ph != PH_INFO && rp->ph != PH_OOB) {
        peer_fail(r, rp, KV_ERR_CORRUPT, "xport rdma: QP info twice");
        return;
    }
    if (len < INFO_HEAD || kv__le_get(b, 4) != KV_XPORT_RDMA || kv__le_get(b + 4, 4) != rp->nq ||
        len != INFO_HEAD + 8 * rp->nq) {
        peer_fail(r, rp, KV_ERR_MISMATCH,
                  "xport rdma handshake: QP info of %u bytes (kind %u, %u QPs; here rdma, %u)", len,
                  len >= 8 ? (unsigned)kv__le_get(b, 4) : 0u,
                  len >= 8 ? (unsigned)kv__le_get(b + 4, 4) : 0u, rp->nq);
        return;
    }
    if (!rp->info_sent) /* theirs came first: ours before anything else */
        send_info(r, rp);
    if (rp->ph == PH_FAIL)
        return;
    rp->p->nonce_remote = kv__le_get(b + 8, 8);
    union ibv_gid gid = {.raw = {0}};
    memcpy(gid.raw, b + 16, 16);
    const uint8_t rd = (uint8_t)(r->da.max_qp_rd_atom < 1    ? 1
                                 : r->da.max_qp_rd_atom > 16 ? 16
                                                             : r->da.max_qp_rd_atom);
    const uint8_t rdi = (uint8_t)(r->da.max_qp_init_rd_atom < 1    ? 1
                                  : r->da.max_qp_init_rd_atom > 16 ? 16
                                                                   : r->da.max_qp_init_rd_atom);
    for (uint32_t i = 0; i < rp->nq; i++) {
        struct ibv_qp_attr a = {.qp_state = IBV_QPS_RTR,
                                .path_mtu = IBV_MTU_1024,
                                .dest_qp_num = (uint32_t)kv__le_get(b + INFO_HEAD + 8 * i, 4),
                                .rq_psn = (uint32_t)kv__le_get(b + INFO_HEAD + 8 * i + 4, 4),
                                .max_dest_rd_atomic = rd,
                                .min_rnr_timer = 12,
                                .ah_attr = {.is_global = 1, .port_num = 1}};
        a.ah_attr.grh.dgid = gid;
        a.ah_attr.grh.hop_limit = 1;
        a.ah_attr.grh.sgid_index = 0;
        struct ibv_qp *qp = rp->q[i].qp;
        pthread_mutex_unlock(&x->mu);
        int e =
            r->v->modify_qp(qp, &a,
                            IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                                IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
        const char *what = "RTR";
        if (e == 0) {
            struct ibv_qp_attr s = {.qp_state = IBV_QPS_RTS,
                                    .timeout = 14,
                                    .retry_cnt = 7,
                                    .rnr_retry = 7, /* receivers re-post; RNR never gives up */
                                    .sq_psn = rp->q[i].psn,
                                    .max_rd_atomic = rdi};
            e = r->v->modify_qp(qp, &s,
                                IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                                    IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC);
            what = "RTS";
        }
        pthread_mutex_lock(&x->mu);
        if (e != 0) {
            peer_fail(r, rp, KV_ERR_IO, "xport rdma: QP %u to %s: %s", i, what, strerror(e));
            return;
        }
    }
    rp->ph = PH_RTS;
    unsigned char ok = 1;
    if (!oob_send(r, rp, 1, &ok, 1)) {
        peer_fail(r, rp, KV_ERR_IO, "xport rdma: sending READY: %s", kv_last_error());
        return;
    }
    rp->ready_sent = true;
}

static void maybe_ready(struct rpeer *rp)
{
    if (rp->ph == PH_RTS && rp->ready_got) {
        rp->ph = PH_READY;
        kv__xport_peer_ready(rp->p);
    }
}

/* mu held: the OOB side of every peer: new incoming peers, INFO / READY
 * notifications, dead OOB peers. */
static struct rpeer *find_oob(struct rdma *r, uint64_t oob_id)
{
    for (struct rpeer *rp = r->peers; rp; rp = rp->next)
        if (rp->oob && rp->oob_id == oob_id)
            return rp;
    return NULL;
}

/* mu held: one incoming OOB peer accepted: an RDMA peer for it. */
static bool accept_one(struct rdma *r)
{
    kv_xport *x = r->x;
    if (!x->cfg.listen_host)
        return false;
    kv_xport_peer *op = NULL;
    pthread_mutex_unlock(&x->mu);
    kv__error_mute();
    const kv_status st = kv_xport_accept(r->oob, 0, &op);
    kv__error_unmute();
    pthread_mutex_lock(&x->mu);
    if (st != KV_OK)
        return false;
    kv_xport_peer *p = kv__xport_peer_new(x, false);
    struct rpeer *rp = p ? rpeer_new(r, p, op) : NULL;
    if (!rp) {
        if (p)
            kv__xport_peer_unref(p);
        pthread_mutex_unlock(&x->mu);
        kv_xport_peer_close(op);
        pthread_mutex_lock(&x->mu);
        return true;
    }
    rp->oob_id = kv_xport_peer_id(op);
    p->be = rp;
    rp->next = r->peers;
    r->peers = rp;
    pthread_mutex_unlock(&x->mu);
    const kv_status vs = peer_verbs(r, rp);
    pthread_mutex_lock(&x->mu);
    if (vs != KV_OK)
        peer_fail(r, rp, vs, "%s", kv_last_error());
    return true;
}

static bool oob_round(struct rdma *r)
{
    kv_xport *x = r->x;
    bool any = false;
    while (accept_one(r))
        any = true;
    for (;;) {
        struct kv_xport_msg m;
        pthread_mutex_unlock(&x->mu);
        kv__error_mute();
        const kv_status st = kv_xport_notify_poll(r->oob, 0, &m);
        kv__error_unmute();
        pthread_mutex_lock(&x->mu);
        if (st != KV_OK)
            break;
        any = true;
        struct rpeer *rp = find_oob(r, m.peer_id);
        while (!rp && accept_one(r)) /* ready before we accepted it */
            rp = find_oob(r, m.peer_id);
        if (!rp || rp->ph == PH_FAIL)
            continue;
        if (m.tag == RD_OOB_INFO)
            got_info(r, rp, m.data, m.len);
        else if (m.tag == RD_OOB_READY) {
            rp->ready_got = true;
            maybe_ready(rp);
        } else
            peer_fail(r, rp, KV_ERR_CORRUPT, "xport rdma: OOB message tag 0x%" PRIx64, m.tag);
    }
    for (struct rpeer *rp = r->peers; rp; rp = rp->next) {
        if (rp->ph == PH_FAIL)
            continue;
        kv_xport_peer_state s;
        kv_status why = KV_OK;
        kv_xport_peer *op = rp->oob;
        pthread_mutex_unlock(&x->mu);
        kv__error_clear();
        if (kv_xport_peer_state_get(op, &s, &why) != KV_OK)
            s = KV_XPORT_CONNECTING;
        char msg[200];
        snprintf(msg, sizeof(msg), "%s", s == KV_XPORT_CLOSED ? kv_last_error() : "");
        pthread_mutex_lock(&x->mu);
        if (s == KV_XPORT_CLOSED) {
            any = true;
            if (why == KV_OK)
                peer_fail(r, rp, KV_OK, "closed by the peer");
            else
                peer_fail(r, rp, why, "xport rdma: out of band: %s", msg);
        } else if (s == KV_XPORT_READY && !rp->info_sent) {
            if (rp->ph == PH_OOB)
                rp->ph = PH_INFO;
            send_info(r, rp);
            any = true;
        }
    }
    return any;
}

/* ---- the data path ---------------------------------------------------- */

struct chain {
    struct ibv_send_wr wr[RD_SQ_WR];
    struct ibv_sge sge[RD_SQ_WR][RD_MAX_SGE];
    uint32_t n;
    uint64_t first; /* seq of wr[0] */
};

/* mu held: cut the next WR of t into chain c of QP qi (false: t has nothing
 * more to send). */
static bool cut_wr(struct rdma *r, struct rpeer *rp, kv_xport_xfer *t, uint32_t qi, struct chain *c)
{
    if (t->be_entry >= t->n)
        return false;
    struct rqp *q = &rp->q[qi];
    const uint32_t w = c->n;
    struct rec *rc = &rp->ring[(size_t)qi * RD_SQ_WR + q->head % RD_SQ_WR];
    memset(rc, 0, offsetof(struct rec, entry));
    rc->kind = t->read ? REC_READ : REC_WRITE;
    rc->xfer = t->id;
    struct ibv_send_wr *wr = &c->wr[w];
    memset(wr, 0, sizeof(*wr));
    wr->wr_id = q->head;
    wr->opcode = t->read ? IBV_WR_RDMA_READ : IBV_WR_RDMA_WRITE;
    wr->sg_list = c->sge[w];
    const kv_xport_rmem *rmem = t->ios[t->be_entry].remote;
    struct rkey k;
    if (!rkey_get(rmem, &k)) {
        kv__xport_entry_end(t, (uint32_t)t->be_entry, KV_ERR_CORRUPT);
        t->be_entry++;
        t->be_off = 0;
        return true; /* nothing posted: the caller sees n unchanged */
    }
    uint64_t wr_bytes = 0, roff0 = 0;
    while (t->be_entry < t->n && rc->n < r->sge && wr_bytes < RD_WR_MAX_BYTES) {
        const uint32_t e = (uint32_t)t->be_entry;
        const struct kv_xport_io *io = &t->ios[e];
        const uint64_t roff = io->remote_off + t->be_off;
        if (rc->n) { /* joins only when remote-contiguous in the same chunk */
            if (io->remote != rmem || roff != roff0 + wr_bytes || roff % k.chunk == 0 ||
                t->ended[e])
                break;
        } else {
            roff0 = roff;
        }
        const struct rmr *lm = io->local->be;
        const uint64_t loff = io->local_off + t->be_off;
        uint64_t len = io->bytes - t->be_off;
        const uint64_t lrest = lm->chunk - loff % lm->chunk;
        const uint64_t rrest = k.chunk - roff % k.chunk;
        len = len < lrest ? len : lrest;
        len = len < rrest ? len : rrest;
        len = len < RD_WR_MAX_BYTES - wr_bytes ? len : RD_WR_MAX_BYTES - wr_bytes;
        c->sge[w][rc->n] = (struct ibv_sge){.addr = (uintptr_t)(io->local->base + loff),
                                            .length = (uint32_t)len,
                                            .lkey = lm->mr[loff / lm->chunk]->lkey};
        rc->entry[rc->n] = e;
        rc->bytes[rc->n] = (uint32_t)len;
        rc->n++;
        wr_bytes += len;
        t->be_off += len;
        if (t->be_off == io->bytes) {
            t->be_entry++;
            t->be_off = 0;
        }
        if ((roff0 + wr_bytes) % k.chunk == 0)
            break; /* the remote chunk ends here */
    }
    wr->num_sge = (int)rc->n;
    wr->wr.rdma.remote_addr = k.base + roff0;
    wr->wr.rdma.rkey = rkey_of(&k, roff0);
    if (w)
        c->wr[w - 1].next = wr;
    c->n++;
    q->head++;
    t->busy++;
    return true;
}

/* mu held: post chain c on QP qi (mu dropped around the call). */
static void post_chain(struct rdma *r, struct rpeer *rp, uint32_t qi, struct chain *c)
{
    if (!c->n)
        return;
    kv_xport *x = r->x;
    c->wr[c->n - 1].next = NULL;
    c->wr[c->n - 1].send_flags |= IBV_SEND_SIGNALED;
    struct ibv_send_wr *bad = NULL;
    struct ibv_qp *qp = rp->q[qi].qp;
    rp->q[qi].drained = false;
    pthread_mutex_unlock(&x->mu);
    const int e = r->v->post_send(qp, c->wr, &bad);
    pthread_mutex_lock(&x->mu);
    if (e == 0)
        return;
    /* What was not posted is retired as not done, then the peer fails. */
    const uint64_t from = bad ? bad->wr_id : c->first;
    struct rqp *q = &rp->q[qi];
    for (uint64_t s = from; s < q->head; s++) {
        struct rec *rc = &rp->ring[(size_t)qi * RD_SQ_WR + s % RD_SQ_WR];
        if (rc->kind == REC_NOTE)
            rp->note_busy[rc->slot] = false;
        kv_xport_xfer *t = kv__xport_xfer_find(rp->p, rc->xfer);
        if (t && t->busy)
            t->busy--;
        if (t)
            for (uint32_t k = 0; k < rc->n; k++)
                kv__xport_entry_end(t, rc->entry[k], KV_ERR_IO);
    }
    q->head = from;
    if (q->head == q->tail)
        q->drained = true;
    peer_fail(r, rp, KV_ERR_IO, "xport rdma: post_send on QP %u: %s", qi, strerror(e));
}

/* mu held: the notifications of rp that may go now (QP 0, post order). */
static void notes_flush(struct rdma *r, struct rpeer *rp, struct chain *c)
{
    struct rqp *q = &rp->q[0];
    c->n = 0;
    c->first = q->head;
    for (kv_xport_xfer *t = rp->p->xfers; t; t = t->next) {
        if (!t->has_note || t->note_sent || t->cancel_req)
            continue;
        if (!kv__xport_note_may_go(t))
            break;
        uint32_t slot = 0;
        while (slot < RD_NOTE_SLOTS && rp->note_busy[slot])
            slot++;
        if (slot == RD_NOTE_SLOTS || q->head - q->tail + 2 > RD_SQ_WR)
            break;
        rp->note_busy[slot] = true;
        unsigned char *b = buf_at(rp, rp->nq * RD_RECVS + slot);
        kv__le_put(b, RD_NOTE_MAGIC, 4);
        kv__le_put(b + 4, t->note_len, 4);
        kv__le_put(b + 8, t->note_tag, 8);
        if (t->note_len)
            memcpy(b + RD_NOTE_HDR, t->note, t->note_len);
        struct rec *rc = &rp->ring[q->head % RD_SQ_WR];
        memset(rc, 0, sizeof(*rc));
        rc->kind = REC_NOTE;
        rc->slot = (uint8_t)slot;
        rc->xfer = t->id;
        const uint32_t w = c->n++;
        c->sge[w][0] = (struct ibv_sge){
            .addr = (uintptr_t)b, .length = RD_NOTE_HDR + t->note_len, .lkey = rp->bufs_mr->lkey};
        c->wr[w] = (struct ibv_send_wr){.wr_id = q->head,
                                        .opcode = IBV_WR_SEND,
                                        .sg_list = c->sge[w],
                                        .num_sge = 1,
                                        .send_flags = IBV_SEND_SIGNALED};
        if (w)
            c->wr[w - 1].next = &c->wr[w];
        q->head++;
        t->busy++;
        t->note_sent = true;
    }
    post_chain(r, rp, 0, c);
}

/* mu held: transfers of rp that can end now; false when rp failed. */
static void settle_all(struct rpeer *rp)
{
    for (kv_xport_xfer *t = rp->p->xfers, *nx; t; t = nx) {
        nx = t->next;
        if (t->busy)
            continue;
        if (t->cancel_req)
            kv__xport_xfer_end(t, KV_XPORT_CANCELLED, KV_ERR_CANCELLED);
        else if (t->failed) /* the rest is not sent: they end KV_ERR_IO */
            kv__xport_xfer_end(t, KV_XPORT_FAILED, KV_ERR_IO);
        else if (!t->left)
            kv__xport_xfer_settle(t);
    }
}

/* mu held: post what rp's transfers have to send. */
static bool send_round(struct rdma *r, struct rpeer *rp, struct chain *c)
{
    bool any = false;
    for (uint32_t round = 0; round < 4; round++) {
        bool posted = false;
        for (uint32_t qi = 0; qi < rp->nq; qi++) {
            c->n = 0;
            c->first = rp->q[qi].head;
            uint32_t unsig = 0;
            for (kv_xport_xfer *t = rp->p->xfers; t && rp->ph == PH_READY; t = t->next) {
                if (t->cancel_req || t->failed)
                    continue;
                while (t->be_entry < t->n) {
                    const uint64_t used = rp->q[qi].head - rp->q[qi].tail;
                    if (used + (qi == 0 ? 3 : 2) > RD_SQ_WR || c->n == RD_SQ_WR)
                        goto full;
                    const uint32_t before = c->n;
                    if (!cut_wr(r, rp, t, qi, c))
                        break;
                    if (c->n == before)
                        continue; /* an entry refused without a WR */
                    if (++unsig == RD_SIG_EVERY) {
                        c->wr[c->n - 1].send_flags |= IBV_SEND_SIGNALED;
                        unsig = 0;
                    }
                    if (rp->nq > 1 && c->n % 8 == 0)
                        goto full; /* leave the next WRs to the other QPs */
                }
            }
        full:
            if (c->n) {
                posted = any = true;
                post_chain(r, rp, qi, c);
                if (rp->ph != PH_READY)
                    return true;
            }
        }
        if (!posted)
            break;
    }
    return any;
}

/* mu held: poll rp's CQ. */
static bool poll_round(struct rdma *r, struct rpeer *rp)
{
    kv_xport *x = r->x;
    struct ibv_wc wc[32];
    bool any = false;
    for (;;) {
        struct ibv_cq *cq = rp->cq;
        pthread_mutex_unlock(&x->mu);
        const int n = r->v->poll_cq(cq, 32, wc);
        pthread_mutex_lock(&x->mu);
        if (n < 0) {
            peer_fail(r, rp, KV_ERR_IO, "xport rdma: poll_cq: %d (CQ overrun?)", n);
            for (uint32_t i = 0; i < rp->nq; i++)
                rp->q[i].drained = true; /* nothing more can be polled */
            return true;
        }
        if (n == 0)
            return any;
        any = true;
        for (int k = 0; k < n; k++) {
            const struct ibv_wc *w = &wc[k];
            uint32_t qi = 0;
            while (qi < rp->nq && rp->q[qi].qp->qp_num != w->qp_num)
                qi++;
            if (qi == rp->nq)
                continue;
            if (w->wr_id & RD_RECV_BIT) {
                const uint32_t b = (uint32_t)(w->wr_id & ~RD_RECV_BIT);
                if (w->status != IBV_WC_SUCCESS) {
                    if (w->status != IBV_WC_WR_FLUSH_ERR)
                        peer_fail(r, rp, wc_status(w->status), "xport rdma: receive on QP %u: %s",
                                  qi, wc_str(w->status));
                    continue;
                }
                if (b >= rp->nq * RD_RECVS || rp->ph == PH_FAIL)
                    continue;
                const unsigned char *m = buf_at(rp, b);
                const uint64_t len = w->byte_len >= RD_NOTE_HDR ? kv__le_get(m + 4, 4) : 0;
                if (w->byte_len < RD_NOTE_HDR || w->byte_len > RD_MSG_BYTES ||
                    kv__le_get(m, 4) != RD_NOTE_MAGIC || len + RD_NOTE_HDR != w->byte_len) {
                    peer_fail(r, rp, KV_ERR_CORRUPT,
                              "xport rdma: a notification of %u bytes fails its checks",
                              w->byte_len);
                    continue;
                }
                /* The generic layer's limits (length, queue): a peer over
                 * them is closed, named. */
                char why[160];
                const kv_status as = kv__xport_note_admit(rp->p, len, why, sizeof(why));
                if (as != KV_OK) {
                    r->x->stats.notes_refused += as == KV_ERR_CAPACITY;
                    peer_fail(r, rp, as, "xport rdma: %s", why);
                    continue;
                }
                if (kv__xport_note_push(rp->p, kv__le_get(m + 8, 8), m + RD_NOTE_HDR,
                                        (uint32_t)len) != KV_OK) {
                    peer_fail(r, rp, KV_ERR_NO_MEMORY, "xport rdma: a notification");
                    continue;
                }
                struct ibv_sge sg = {
                    .addr = (uintptr_t)m, .length = RD_MSG_BYTES, .lkey = rp->bufs_mr->lkey};
                struct ibv_recv_wr rw = {.wr_id = w->wr_id, .sg_list = &sg, .num_sge = 1},
                                   *bad = NULL;
                struct ibv_qp *qp = rp->q[qi].qp;
                pthread_mutex_unlock(&x->mu);
                const int e = r->v->post_recv(qp, &rw, &bad);
                pthread_mutex_lock(&x->mu);
                if (e)
                    peer_fail(r, rp, KV_ERR_IO, "xport rdma: post_recv: %s", strerror(e));
                continue;
            }
            retire(r, rp, qi, w->wr_id, w->status);
            if (w->status != IBV_WC_SUCCESS && w->status != IBV_WC_WR_FLUSH_ERR)
                peer_fail(r, rp, wc_status(w->status),
                          "xport rdma: a work request on QP %u completed %s (%d, vendor 0x%x)", qi,
                          wc_str(w->status), (int)w->status, w->vendor_err);
        }
    }
}

/* mu held: deadlines and cancels; false when rp began failing. */
static void sweep(struct rdma *r, struct rpeer *rp, uint64_t now)
{
    if (rp->ph != PH_READY && rp->ph != PH_FAIL && now >= rp->deadline_ns) {
        static const char *const ph[] = {"out-of-band handshake", "QP info exchange",
                                         "waiting for the peer's READY"};
        peer_fail(r, rp, KV_ERR_TIMEOUT,
                  "xport rdma: handshake not done within %u ms (%s; info %s, ready %s/%s)",
                  r->x->cfg.timeout_ms, ph[rp->ph], rp->info_sent ? "sent" : "not sent",
                  rp->ready_sent ? "sent" : "not sent", rp->ready_got ? "got" : "not got");
        return;
    }
    for (kv_xport_xfer *t = rp->p->xfers, *nx; t; t = nx) {
        nx = t->next;
        if (now < t->deadline_ns || t->state != KV_XPORT_PENDING)
            continue;
        if (!t->busy) {
            kv__xport_xfer_end(t, t->cancel_req ? KV_XPORT_CANCELLED : KV_XPORT_TIMED_OUT,
                               t->cancel_req ? KV_ERR_CANCELLED : KV_ERR_TIMEOUT);
            continue;
        }
        /* WRs of it outstanding: they cannot be taken back. */
        peer_fail(r, rp, KV_ERR_TIMEOUT,
                  "xport rdma: transfer %" PRIu64 " not done within %u ms with %u work "
                  "request(s) outstanding: the peer is closed",
                  t->id, r->x->cfg.timeout_ms, t->busy);
        return;
    }
}

static void *progress(void *arg)
{
    struct rdma *r = arg;
    kv_xport *x = r->x;
    struct chain *c = kv__mem_alloc(sizeof(*c));
    pthread_mutex_lock(&x->mu);
    while (!r->stop || r->peers) {
        bool any = false;
        if (r->stop)
            for (struct rpeer *rp = r->peers; rp; rp = rp->next)
                peer_fail(r, rp, KV_ERR_CANCELLED, "the transport was destroyed");
        if (!r->stop)
            any |= oob_round(r);
        const uint64_t now = kv__xport_now_ns();
        for (struct rpeer *rp = r->peers, *nx; rp; rp = nx) {
            nx = rp->next;
            if (rp->close_req && rp->ph != PH_FAIL)
                peer_fail(r, rp, KV_OK, "closed");
            if (rp->cq)
                any |= poll_round(r, rp);
            if (rp->ph == PH_FAIL) {
                bool done = true;
                for (uint32_t i = 0; i < rp->nq; i++)
                    done &= rp->q[i].drained || !rp->q[i].qp;
                if (done || now >= rp->deadline_ns) {
                    finish_fail(r, rp);
                    any = true;
                }
                continue;
            }
            if (!c) {
                peer_fail(r, rp, KV_ERR_NO_MEMORY, "xport rdma: WR staging");
                continue;
            }
            sweep(r, rp, now);
            if (rp->ph == PH_READY)
                any |= send_round(r, rp, c);
            if (rp->ph == PH_READY)
                notes_flush(r, rp, c);
            if (rp->ph != PH_FAIL)
                settle_all(rp);
        }
        if (!any) {
            struct timespec ts;
            clock_gettime(CLOCK_MONOTONIC, &ts);
            ts.tv_nsec += 200000; /* 0.2 ms: completions are polled */
            if (ts.tv_nsec >= 1000000000L) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000L;
            }
            pthread_cond_timedwait(&x->cv, &x->mu, &ts);
        }
    }
    pthread_mutex_unlock(&x->mu);
    kv__mem_free(c);
    return NULL;
}
