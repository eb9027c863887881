/*
 * kv_xport_rdma_qp_verbs.c - a peer of the RDMA backend
 * (kv_xport_rdma_int.h): its verbs resources (CQ, RC QPs in INIT, the
 * registered message buffers and their posted receives), the handshake after
 * the OOB one (INFO, checked by kv__rd_info_decode in
 * kv_xport_rdma_info_verbs.c: per QP its qpn and
 * psn, the GID, LID, link layer and active MTU, the connection id;
 * INIT -> RTR -> RTS on the other side's INFO; READY), and failing a peer:
 * every QP to ERR behind a signaled marker, the transfers ended only once
 * every marker's flush completed (kv__rd_finish_fail).
 */
#include <errno.h>
#include <inttypes.h>
#include <netdb.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "kv_mem.h"
#include "kv_xport_rdma_int.h"

unsigned char *kv__rd_buf_at(struct rpeer *rp, uint32_t i)
{
    return rp->bufs + (size_t)i * RD_MSG_BYTES;
}

/* mu NOT held: the verbs resources of rp: per rail a CQ and conns QPs in
 * INIT (on that rail's device: its PD, CQ and port), the message buffers
 * (on rail 0) and the receives of rail 0's QPs posted (notifications
 * arrive on QP 0 only). */
kv_status kv__rd_peer_verbs(struct rdma *r, struct rpeer *rp)
{
    const struct kv__verbs *v = r->v;
    const uint32_t nq = rp->nq;
    rp->ring = kv__mem_calloc((size_t)nq * RD_SQ_WR, sizeof(*rp->ring));
    rp->nrecv = rp->conns * RD_RECVS;
    const size_t nb = (size_t)rp->nrecv + RD_NOTE_SLOTS + RD_ACK_SLOTS;
    rp->bufs = kv__mem_calloc(nb, RD_MSG_BYTES);
    if (!rp->ring || !rp->bufs)
        return kv__error(KV_ERR_NO_MEMORY, "xport rdma: peer buffers");
    rp->bufs_mr = v->reg_mr(r->rail[0].pd, rp->bufs, nb * RD_MSG_BYTES, IBV_ACCESS_LOCAL_WRITE);
    if (!rp->bufs_mr)
        return kv__error(kv__rd_errno_status(errno),
                         "xport rdma: reg_mr of the message buffers on %s: %s", r->rail[0].dev,
                         strerror(errno));
    for (uint32_t ri = 0; ri < rp->nrail; ri++) {
        const struct rrail *rl = &r->rail[ri];
        const int cqe = (int)(rp->conns * (RD_SQ_WR + RD_RECVS) + 16);
        rp->cq[ri] = v->create_cq(rl->ctx, cqe, rp, rl->ch, 0);
        if (!rp->cq[ri])
            return kv__error(kv__rd_errno_status(errno), "xport rdma: create_cq of %d on %s: %s",
                             cqe, rl->dev, strerror(errno));
        for (uint32_t j = 0; j < rp->conns; j++) {
            const uint32_t i = ri * rp->conns + j;
            struct ibv_qp_init_attr ia = {.send_cq = rp->cq[ri],
                                          .recv_cq = rp->cq[ri],
                                          .cap = {.max_send_wr = RD_SQ_WR,
                                                  .max_recv_wr = RD_RECVS,
                                                  .max_send_sge = rl->sge,
                                                  .max_recv_sge = 1},
                                          .qp_type = IBV_QPT_RC};
            struct rqp *q = &rp->q[i];
            q->qp = v->create_qp(rl->pd, &ia);
            if (!q->qp)
                return kv__error(kv__rd_errno_status(errno), "xport rdma: create_qp on %s: %s",
                                 rl->dev, strerror(errno));
            q->drained = true; /* nothing posted yet */
            q->psn = (uint32_t)(kv__xxh3_64(&(uint64_t[2]){kv__now_ns(), i}, 16) & 0xffffff);
            struct ibv_qp_attr a = {.qp_state = IBV_QPS_INIT,
                                    .pkey_index = 0,
                                    .port_num = rl->port,
                                    .qp_access_flags = IBV_ACCESS_LOCAL_WRITE |
                                                       IBV_ACCESS_REMOTE_WRITE |
                                                       IBV_ACCESS_REMOTE_READ};
            int e = v->modify_qp(
                q->qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
            if (e)
                return kv__error(kv__rd_errno_status(e), "xport rdma: QP %u to INIT on %s: %s", i,
                                 rl->dev, strerror(e));
            for (uint32_t k = 0; ri == 0 && k < RD_RECVS; k++) {
                const uint32_t b = i * RD_RECVS + k;
                struct ibv_sge sg = {.addr = (uintptr_t)kv__rd_buf_at(rp, b),
                                     .length = RD_MSG_BYTES,
                                     .lkey = rp->bufs_mr->lkey};
                struct ibv_recv_wr w = {.wr_id = RD_RECV_BIT | b, .sg_list = &sg, .num_sge = 1},
                                   *bad = NULL;
                e = v->post_recv(q->qp, &w, &bad);
                if (e)
                    return kv__error(kv__rd_errno_status(e), "xport rdma: post_recv: %s",
                                     strerror(e));
            }
        }
    }
    return KV_OK;
}

/* mu NOT held: free what peer_verbs made (QPs first: nothing lands after);
 * a call that fails is noted for kv_xport_destroy. */
void kv__rd_peer_verbs_free(struct rdma *r, struct rpeer *rp)
{
    const struct kv__verbs *v = r->v;
    for (uint32_t i = 0; i < rp->nq; i++)
        if (rp->q[i].qp)
            kv__rd_teardown_check(r, v->destroy_qp(rp->q[i].qp), "ibv_destroy_qp");
    for (uint32_t i = 0; i < rp->nrail; i++)
        if (rp->cq[i])
            kv__rd_teardown_check(r, v->destroy_cq(rp->cq[i]), "ibv_destroy_cq");
    if (rp->bufs_mr)
        kv__rd_teardown_check(r, v->dereg_mr(rp->bufs_mr), "ibv_dereg_mr (message buffers)");
    kv__mem_free(rp->bufs);
    kv__mem_free(rp->ring);
}

struct rpeer *kv__rd_rpeer_new(struct rdma *r, kv_xport_peer *p, kv_xport_peer *oob)
{
    struct rpeer *rp = kv__mem_calloc(1, sizeof(*rp));
    if (!rp)
        return NULL;
    rp->p = p;
    rp->oob = oob;
    rp->conns = r->x->cfg.conns_per_peer;
    rp->nrail = r->nrail;
    rp->nq = rp->conns * rp->nrail; /* <= KV__XPORT_MAX_CONNS: checked at start */
    rp->ph = PH_OOB;
    rp->deadline_ns = kv__now_ns() + (uint64_t)r->x->cfg.timeout_ms * 1000000ull;
    return rp;
}

/* mu held: start closing rp (why, msg): every QP to ERR behind a marker;
 * the transfers end once the markers completed (finish_fail). */
void kv__rd_peer_fail(struct rdma *r, struct rpeer *rp, kv_status why, const char *fmt, ...)
{
    if (rp->ph == PH_FAIL)
        return;
    rp->ph = PH_FAIL;
    rp->why = why;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(rp->msg, sizeof(rp->msg), fmt, ap);
    va_end(ap);
    rp->deadline_ns = kv__now_ns() + RD_DRAIN_NS;
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

/* mu held: the markers have all completed (or the drain deadline passed):
 * end the transfers, free the verbs state, close the OOB peer, drop the
 * backend's reference. rp is freed. */
void kv__rd_finish_fail(struct rdma *r, struct rpeer *rp)
{
    kv_xport *x = r->x;
    for (struct rpeer **pp = &r->peers; *pp; pp = &(*pp)->next)
        if (*pp == rp) {
            *pp = rp->next;
            break;
        }
    kv_xport_peer *p = rp->p;
    const uint64_t now = kv__now_ns();
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
    kv__rd_peer_verbs_free(r, rp);
    if (rp->oob) /* its transfers end (CANCELLED at the latest) before it returns */
        kv_xport_peer_close(rp->oob);
    for (uint32_t i = 0; i < RD_OOB_N; i++)
        if (rp->oob_x[i])
            if (kv_xport_xfer_free(rp->oob_x[i]) != KV_OK)
                kv__error_clear(); /* cannot be pending: the OOB peer is closed */
    kv__mem_free(rp);
    pthread_mutex_lock(&x->mu);
    kv__rd_kick(x);
}

/* mu held: send an OOB notification of rp (which: 0 INFO, 1 READY, 2
 * FAIL). */
static bool oob_send(struct rdma *r, struct rpeer *rp, int which, const void *msg, uint32_t len)
{
    static const uint64_t tags[RD_OOB_N] = {RD_OOB_INFO, RD_OOB_READY, RD_OOB_FAIL};
    kv_xport *x = r->x;
    const struct kv_xport_notify n = {.tag = tags[which], .msg = msg, .len = len};
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
    unsigned char b[INFO_MAX];
    struct rd_info in = {.nq = rp->conns, .nrail = rp->nrail, .conn = rp->p->nonce_local};
    for (uint32_t i = 0; i < rp->nrail; i++) {
        const struct rrail *rl = &r->rail[i];
        in.rail[i] =
            (struct rd_rail_info){.has_gid = rl->gid_index >= 0,
                                  .lid = rl->link == IBV_LINK_LAYER_INFINIBAND ? rl->pa.lid : 0,
                                  .link = rl->link,
                                  .mtu = (uint8_t)rl->pa.active_mtu};
        if (rl->gid_index >= 0)
            memcpy(in.rail[i].gid, rl->gid.raw, 16);
    }
    for (uint32_t i = 0; i < rp->nq; i++) {
        in.qpn[i] = rp->q[i].qp->qp_num;
        in.psn[i] = rp->q[i].psn;
    }
    const uint32_t len = kv__rd_info_encode(&in, b);
    if (!oob_send(r, rp, 0, b, len))
        kv__rd_peer_fail(r, rp, KV_ERR_IO, "xport rdma: sending QP info: %s", kv_last_error());
    else
        rp->info_sent = true;
}

/* mu held: the peer's INFO: the QPs of every rail both sides have
 * (rail i <-> the peer's rail i) INIT -> RTR -> RTS, then READY. */
static void got_info(struct rdma *r, struct rpeer *rp, const unsigned char *b, uint32_t len)
{
    kv_xport *x = r->x;
    if (rp->ph != PH_INFO && rp->ph != PH_OOB) {
        kv__rd_peer_fail(r, rp, KV_ERR_CORRUPT, "xport rdma: QP info twice");
        return;
    }
    /* Theirs came first: ours before anything else, even a refusal of
     * theirs, so the peer can name the refusal too (our INFO goes out
     * before the OOB peer closes: the drain waits for it). */
    if (!rp->info_sent)
        send_info(r, rp);
    if (rp->ph == PH_FAIL)
        return;
    struct rd_info in;
    char why[200];
    uint8_t links[RD_MAX_RAILS];
    for (uint32_t i = 0; i < rp->nrail; i++)
        links[i] = r->rail[i].link;
    const kv_status ds =
        kv__rd_info_decode(b, len, rp->conns, links, rp->nrail, &in, why, sizeof(why));
    if (ds != KV_OK) {
        kv__rd_peer_fail(r, rp, ds, "xport rdma handshake (%s port %u): %s", r->rail[0].dev,
                         r->rail[0].port, why);
        return;
    }
    rp->p->nonce_remote = in.conn;
    /* Rails: the common count (a peer with fewer devices connects on
     * fewer; our QPs past them stay in INIT, unused). */
    rp->nlink = in.nrail < rp->nrail ? in.nrail : rp->nrail;
    for (uint32_t ri = 0; ri < rp->nlink; ri++) {
        const struct rrail *rl = &r->rail[ri];
        const struct rd_rail_info *pr = &in.rail[ri];
        struct rpath *ph = &rp->path[ri];
        /* The path: MTU the smaller of both ports' active MTU; a GRH
         * always on Ethernet (RoCE routes by GID), on InfiniBand only when
         * the peer's GID is on another subnet (its prefix differs): within
         * a subnet the LID routes, as rc_pingpong does without a GID. */
        ph->path_mtu = pr->mtu < rl->pa.active_mtu ? (enum ibv_mtu)pr->mtu : rl->pa.active_mtu;
        ph->grh = rl->link == IBV_LINK_LAYER_ETHERNET ||
                  (pr->has_gid && rl->gid_index >= 0 && memcmp(pr->gid, rl->gid.raw, 8) != 0);
        ph->rlid = pr->lid;
        memcpy(ph->rgid, pr->gid, 16);
        const uint8_t rd = (uint8_t)(rl->da.max_qp_rd_atom < 1    ? 1
                                     : rl->da.max_qp_rd_atom > 16 ? 16
                                                                  : rl->da.max_qp_rd_atom);
        const uint8_t rdi =
            (uint8_t)(rl->da.max_qp_init_rd_atom < 1    ? 1
                      : rl->da.max_qp_init_rd_atom > 16 ? 16
                                                        : rl->da.max_qp_init_rd_atom);
        for (uint32_t j = 0; j < rp->conns; j++) {
            const uint32_t i = ri * rp->conns + j;
            /* the peer's QP of the same rail and index (its list is rail-major too) */
            const uint32_t pi = ri * in.nq + j;
            struct ibv_qp_attr a = {
                .qp_state = IBV_QPS_RTR,
                .path_mtu = ph->path_mtu,
                .dest_qp_num = in.qpn[pi],
                .rq_psn = in.psn[pi],
                .max_dest_rd_atomic = rd,
                .min_rnr_timer = 12,
                .ah_attr = {.is_global = ph->grh,
                            .dlid = rl->link == IBV_LINK_LAYER_INFINIBAND ? pr->lid : 0,
                            .port_num = rl->port}};
            if (ph->grh) {
                memcpy(a.ah_attr.grh.dgid.raw, pr->gid, 16);
                a.ah_attr.grh.hop_limit = INFO_HOP_LIMIT;
                a.ah_attr.grh.sgid_index = (uint8_t)rl->gid_index;
            }
            struct ibv_qp *qp = rp->q[i].qp;
            pthread_mutex_unlock(&x->mu);
            int e = r->v->modify_qp(qp, &a,
                                    IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                                        IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
                                        IBV_QP_MIN_RNR_TIMER);
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
                kv__rd_peer_fail(r, rp, KV_ERR_IO,
                                 "xport rdma: QP %u (rail %u) to %s (%s port %u, path_mtu %u, %s, "
                                 "dlid %u, sgid_index %d): %s",
                                 i, ri, what, rl->dev, rl->port, kv__rd_mtu_bytes(ph->path_mtu),
                                 ph->grh ? "grh" : "no grh", a.ah_attr.dlid, rl->gid_index,
                                 strerror(e));
                return;
            }
        }
    }
    rp->ph = PH_RTS;
    unsigned char ok = 1;
    if (!oob_send(r, rp, 1, &ok, 1)) {
        kv__rd_peer_fail(r, rp, KV_ERR_IO, "xport rdma: sending READY: %s", kv_last_error());
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

/* mu held: the peer's READY: exactly one byte, 1, once, after its INFO
 * was applied (phase RTS: the peer sends it only after ours, on one
 * ordered connection); anything else closes the peer, named. */
static void got_ready(struct rdma *r, struct rpeer *rp, const unsigned char *b, uint32_t len)
{
    static const char *const phase[] = {"OOB", "INFO", "RTS", "READY", "FAIL"};
    if (len != 1 || b[0] != 1 || rp->ph != PH_RTS || rp->ready_got) {
        kv__rd_peer_fail(r, rp, KV_ERR_CORRUPT,
                         "xport rdma: a READY of %u bytes (first byte 0x%02x; want 1 byte, 0x01) "
                         "in phase %s%s",
                         len, len ? b[0] : 0, phase[rp->ph],
                         rp->ready_got      ? " (a READY came already)"
                         : rp->ph != PH_RTS ? " (want RTS: after the peer's QP info)"
                                            : "");
        return;
    }
    rp->ready_got = true;
    maybe_ready(rp);
}

/* mu held: the peer's FAIL: rp fails with the peer's status and message
 * (a malformed one: KV_ERR_CORRUPT, named). */
static void got_fail(struct rdma *r, struct rpeer *rp, const unsigned char *b, uint32_t len)
{
    kv_status st = KV_OK;
    char text[RD_FAIL_TEXT + 1], why[160];
    if (kv__rd_fail_decode(b, len, &st, text, sizeof(text), why, sizeof(why)) != KV_OK) {
        kv__rd_peer_fail(r, rp, KV_ERR_CORRUPT, "xport rdma: the peer's FAIL: %s", why);
        return;
    }
    rp->fail_from_peer = true;
    kv__rd_peer_fail(r, rp, st, "xport rdma: the peer failed the connection: %s", text);
}

/* mu held (dropped around the send): rp failed for a reason of its own
 * (not a caller's close, not the peer's FAIL, not a destroy, not its OOB
 * peer closing), at any phase once the OOB peer is READY (an acceptor's
 * QPs that could not be made included): tell the peer why before the OOB
 * peer closes. Once. */
void kv__rd_send_fail(struct rdma *r, struct rpeer *rp)
{
    if (rp->fail_sent)
        return;
    rp->fail_sent = true;
    if (rp->why == KV_OK || rp->fail_from_peer || r->stop || !rp->oob_ready)
        return;
    unsigned char b[4 + RD_FAIL_TEXT];
    (void)oob_send(r, rp, 2, b, kv__rd_fail_encode(b, rp->why, rp->msg));
}

/* mu held, the OOB peer READY: our INFO or READY ended without reaching
 * the peer (its OOB transport refused it, or it timed out) fails rp,
 * named: the peer would wait for it until its handshake deadline while we
 * took the handshake for done. true when rp failed. */
static bool oob_undelivered(struct rdma *r, struct rpeer *rp)
{
    static const char *const name[2] = {"INFO", "READY"};
    static const char *const end[5] = {"pending", "done", "failed", "timed out", "cancelled"};
    for (int i = 0; i < 2; i++) {
        kv_xport_state xs = KV_XPORT_PENDING;
        if (!rp->oob_x[i] || kv_xport_xfer_test(rp->oob_x[i], &xs) != KV_OK ||
            xs == KV_XPORT_PENDING || xs == KV_XPORT_DONE)
            continue;
        kv_status ns = KV_OK;
        if (kv_xport_xfer_note_status(rp->oob_x[i], &ns) != KV_OK)
            ns = KV_OK;
        kv__rd_peer_fail(r, rp, ns != KV_OK ? ns : KV_ERR_IO,
                         "xport rdma: our %s did not reach the peer out of band (%s): %s", name[i],
                         (unsigned)xs < 5 ? end[xs] : "?", kv_xport_xfer_error(rp->oob_x[i]));
        return true;
    }
    return false;
}

/* mu held: the OOB side of every peer: new incoming peers, INFO / READY /
 * FAIL notifications, dead OOB peers. */
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
    struct rpeer *rp = p ? kv__rd_rpeer_new(r, p, op) : NULL;
    if (!rp) {
        if (p)
            kv__xport_peer_unref(p);
        pthread_mutex_unlock(&x->mu);
        kv_xport_peer_close(op);
        pthread_mutex_lock(&x->mu);
        return true;
    }
    rp->oob_id = kv_xport_peer_id(op);
    rp->oob_ready = true; /* accepted: READY */
    p->be = rp;
    rp->next = r->peers;
    r->peers = rp;
    pthread_mutex_unlock(&x->mu);
    const kv_status vs = kv__rd_peer_verbs(r, rp);
    pthread_mutex_lock(&x->mu);
    if (vs != KV_OK)
        kv__rd_peer_fail(r, rp, vs, "%s", kv_last_error());
    return true;
}

bool kv__rd_oob_round(struct rdma *r)
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
        else if (m.tag == RD_OOB_READY)
            got_ready(r, rp, m.data, m.len);
        else if (m.tag == RD_OOB_FAIL)
            got_fail(r, rp, m.data, m.len);
        else
            kv__rd_peer_fail(r, rp, KV_ERR_CORRUPT, "xport rdma: OOB message tag 0x%" PRIx64,
                             m.tag);
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
        rp->oob_ready = s == KV_XPORT_READY; /* a FAIL cannot go on a closed one */
        if (s == KV_XPORT_CLOSED) {
            any = true;
            if (why == KV_OK)
                kv__rd_peer_fail(r, rp, KV_OK, "closed by the peer");
            else
                kv__rd_peer_fail(r, rp, why, "xport rdma: out of band: %s", msg);
        } else if (s == KV_XPORT_READY && !rp->info_sent) {
            if (rp->ph == PH_OOB)
                rp->ph = PH_INFO;
            send_info(r, rp);
            any = true;
        } else if (s == KV_XPORT_READY) {
            any |= oob_undelivered(r, rp);
        }
    }
    return any;
}
