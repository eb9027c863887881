/*
 * kv_xport_rdma_wr_verbs.c - the RDMA backend's data path
 * (kv_xport_rdma_int.h): WRs cut from the peer's transfers (one
 * remote-contiguous range in one remote MR, gathered from up to max_sge
 * local pieces, a READ scattered into up to max_sge_rd), posted in chains round robin over the QPs
 * with selective signaling, notifications as SENDs on QP 0 once every earlier write completed, and
 * completions polled and retired in order per QP.
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

/* mu held: retire the records of QP qi up to and including seq; `st` is
 * the completion's status for seq, the records before it succeeded unless
 * st is a flush (then they were flushed too, or, behind a marker, unknown:
 * not done either way). */
void kv__rd_retire(struct rdma *r, struct rpeer *rp, uint32_t qi, uint64_t seq,
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
        if (rc->kind == REC_ACK) {
            rp->ack_busy[rc->slot] = false;
            continue;
        }
        if (rc->kind == REC_NOTE) { /* sent: the slot waits for the peer's acknowledgement */
            rp->note_cqe[rc->slot] = true;
            if (st != IBV_WC_SUCCESS || rp->note_acked[rc->slot])
                rp->note_busy[rc->slot] = false;
        }
        kv_xport_xfer *t = kv__xport_xfer_find(rp->p, rc->xfer);
        if (!t)
            continue;
        if (t->busy)
            t->busy--;
        const kv_status ks = st == IBV_WC_SUCCESS ? KV_OK : kv__rd_wc_status(st);
        if (rc->kind == REC_NOTE) { /* DONE waits for the acknowledgement (rd_msg) */
            if (ks != KV_OK)
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

/* mu held: cut the next WR of t into chain c of QP qi (false: t has nothing
 * more to send on qi's rail now: its next entry is on another rail, or
 * nothing is left). An SGE list joins entries of qi's rail only. */
static bool cut_wr(struct rdma *r, struct rpeer *rp, kv_xport_xfer *t, uint32_t qi, struct chain *c)
{
    if (t->be_entry >= t->n)
        return false;
    const uint32_t rail = qi / rp->conns;
    if (((const struct rmr *)t->ios[t->be_entry].local->be)->rail != rail)
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
    if (!kv__rd_rkey_get(rmem, &k) || k.rail != rail) { /* kv_xport_write checked both */
        kv__xport_entry_end(t, (uint32_t)t->be_entry, KV_ERR_CORRUPT);
        t->be_entry++;
        t->be_off = 0;
        return true; /* nothing posted: the caller sees n unchanged */
    }
    uint64_t wr_bytes = 0, roff0 = 0;
    const uint32_t max_sge = t->read ? r->rail[rail].sge_rd : r->rail[rail].sge;
    while (t->be_entry < t->n && rc->n < max_sge && wr_bytes < RD_WR_MAX_BYTES) {
        const uint32_t e = (uint32_t)t->be_entry;
        const struct kv_xport_io *io = &t->ios[e];
        const uint64_t roff = io->remote_off + t->be_off;
        if (rc->n) { /* joins only when remote-contiguous in the same chunk */
            if (io->remote != rmem || roff != roff0 + wr_bytes || roff % k.chunk == 0 ||
                t->ended[e] || ((const struct rmr *)io->local->be)->rail != rail)
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
    wr->wr.rdma.rkey = kv__rd_rkey_of(&k, roff0);
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
        if (rc->kind == REC_ACK)
            rp->ack_busy[rc->slot] = false;
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
    kv__rd_peer_fail(r, rp, KV_ERR_IO, "xport rdma: post_send on QP %u: %s", qi, strerror(e));
}

/* mu held: a SEND of b[len] (a message buffer) appended to chain c of QP 0,
 * recorded as kind / slot / xfer. */
static void send_append(struct rpeer *rp, struct chain *c, unsigned char *b, uint32_t len,
                        enum rec_kind kind, uint32_t slot, uint64_t xfer)
{
    struct rqp *q = &rp->q[0];
    struct rec *rc = &rp->ring[q->head % RD_SQ_WR];
    memset(rc, 0, sizeof(*rc));
    rc->kind = (uint8_t)kind;
    rc->slot = (uint8_t)slot;
    rc->xfer = xfer;
    const uint32_t w = c->n++;
    c->sge[w][0] = (struct ibv_sge){.addr = (uintptr_t)b, .length = len, .lkey = rp->bufs_mr->lkey};
    c->wr[w] = (struct ibv_send_wr){.wr_id = q->head,
                                    .opcode = IBV_WR_SEND,
                                    .sg_list = c->sge[w],
                                    .num_sge = 1,
                                    .send_flags = IBV_SEND_SIGNALED};
    if (w)
        c->wr[w - 1].next = &c->wr[w];
    q->head++;
}

/* mu held: what rp's QP 0 has to send now (post order): the
 * acknowledgements we owe the peer, in one message, then the
 * notifications that may go, each in a free slot (at most RD_NOTE_SLOTS
 * unacknowledged). */
void kv__rd_notes_flush(struct rdma *r, struct rpeer *rp, struct chain *c)
{
    struct rqp *q = &rp->q[0];
    c->n = 0;
    c->first = q->head;
    uint32_t as = 0;
    while (as < RD_ACK_SLOTS && rp->ack_busy[as])
        as++;
    if (rp->n_ack && as < RD_ACK_SLOTS && q->head - q->tail + 2 <= RD_SQ_WR) {
        rp->ack_busy[as] = true;
        unsigned char *b = kv__rd_buf_at(rp, rp->nrecv + RD_NOTE_SLOTS + as);
        send_append(rp, c, b, kv__rd_ack_encode(b, rp->ack_xfer, rp->ack_st, rp->n_ack), REC_ACK,
                    as, 0);
        rp->n_ack = 0;
    }
    for (kv_xport_xfer *t = kv__xport_note_next(rp->p->xfers); t;
         t = kv__xport_note_next(t->next)) {
        uint32_t slot = 0;
        while (slot < RD_NOTE_SLOTS && rp->note_busy[slot])
            slot++;
        if (slot == RD_NOTE_SLOTS || q->head - q->tail + 2 > RD_SQ_WR)
            break;
        rp->note_busy[slot] = true;
        rp->note_cqe[slot] = rp->note_acked[slot] = false;
        rp->note_xfer[slot] = t->id;
        unsigned char *b = kv__rd_buf_at(rp, rp->nrecv + slot);
        send_append(rp, c, b, kv__rd_note_encode(b, t->note_tag, t->id, t->note, t->note_len),
                    REC_NOTE, slot, t->id);
        t->busy++;
        t->note_sent = true;
    }
    post_chain(r, rp, 0, c);
}

/* mu held: transfers of rp that can end now; false when rp failed. */
void kv__rd_settle_all(struct rpeer *rp)
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

/* mu held: post what rp's transfers have to send, each WR on a QP of its
 * regions' rail (the connected rails' QPs: nlink * conns). */
bool kv__rd_send_round(struct rdma *r, struct rpeer *rp, struct chain *c)
{
    bool any = false;
    const uint32_t nq = rp->nlink * rp->conns;
    for (uint32_t round = 0; round < 4; round++) {
        bool posted = false;
        for (uint32_t qi = 0; qi < nq; qi++) {
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
                    if (rp->conns > 1 && c->n % 8 == 0)
                        goto full; /* leave the next WRs to the rail's other QPs */
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

/* mu held: the peer's NOTE: queued, or refused by the generic layer's
 * limits (a full queue: KV_ERR_CAPACITY; no memory: KV_ERR_NO_MEMORY),
 * either way owed an acknowledgement that says which. false: rp failed
 * (the peer went over its RD_NOTE_SLOTS unacknowledged, or over the
 * length). */
static bool on_note(struct rdma *r, struct rpeer *rp, const struct rd_msg *d)
{
    if (rp->n_ack == RD_NOTE_SLOTS) {
        kv__rd_peer_fail(r, rp, KV_ERR_CORRUPT,
                         "xport rdma: a notification (transfer %" PRIu64
                         ") past the %u a peer may have unacknowledged",
                         d->xfer, RD_NOTE_SLOTS);
        return false;
    }
    char why[160];
    kv_status st = kv__xport_note_admit(rp->p, d->len, why, sizeof(why));
    if (st == KV_ERR_CORRUPT) {
        kv__rd_peer_fail(r, rp, st, "xport rdma: %s", why);
        return false;
    }
    if (st == KV_OK && kv__xport_note_push(rp->p, d->tag, d->data, d->len) != KV_OK)
        st = KV_ERR_NO_MEMORY;
    if (st != KV_OK)
        r->x->stats.notes_refused++;
    rp->ack_xfer[rp->n_ack] = d->xfer;
    rp->ack_st[rp->n_ack++] = st;
    return true;
}

/* mu held: the peer's ACK of our notifications: each frees its slot (once
 * its SEND completed too) and ends the notification of its transfer, if
 * that is still pending: done, or refused with the peer's status. false:
 * rp failed (a record naming no notification awaiting one). */
static bool on_acks(struct rdma *r, struct rpeer *rp, const struct rd_msg *d)
{
    for (uint32_t i = 0; i < d->n; i++) {
        uint32_t s = 0;
        while (s < RD_NOTE_SLOTS &&
               !(rp->note_busy[s] && !rp->note_acked[s] && rp->note_xfer[s] == d->ack_xfer[i]))
            s++;
        if (s == RD_NOTE_SLOTS) {
            kv__rd_peer_fail(r, rp, KV_ERR_CORRUPT,
                             "xport rdma: an acknowledgement of transfer %" PRIu64
                             ", which has no notification awaiting one",
                             d->ack_xfer[i]);
            return false;
        }
        rp->note_acked[s] = true;
        if (rp->note_cqe[s])
            rp->note_busy[s] = false;
        kv_xport_xfer *t = kv__xport_xfer_find(rp->p, d->ack_xfer[i]);
        if (!t)
            continue; /* ended already (timed out, cancelled) */
        if (d->ack_st[i] == KV_OK) {
            t->note_done = true;
            continue;
        }
        char why[200];
        kv__xport_refusal_msg(why, sizeof(why), rp->p->id, t->id, true, 0, d->ack_st[i],
                              d->ack_st[i]);
        kv__xport_note_refused(t, d->ack_st[i], why);
    }
    return true;
}

/* mu held: poll rp's CQ of rail ri until empty. */
static bool poll_cq_round(struct rdma *r, struct rpeer *rp, uint32_t ri)
{
    kv_xport *x = r->x;
    struct ibv_wc wc[32];
    bool any = false;
    for (;;) {
        struct ibv_cq *cq = rp->cq[ri];
        pthread_mutex_unlock(&x->mu);
        const int n = r->v->poll_cq(cq, 32, wc);
        pthread_mutex_lock(&x->mu);
        if (n < 0) {
            kv__rd_peer_fail(r, rp, KV_ERR_IO, "xport rdma: poll_cq: %d (CQ overrun?)", n);
            for (uint32_t i = 0; i < rp->nq; i++)
                rp->q[i].drained = true; /* nothing more can be polled */
            return true;
        }
        if (n == 0)
            return any;
        any = true;
        for (int k = 0; k < n; k++) {
            const struct ibv_wc *w = &wc[k];
            uint32_t qi = ri * rp->conns;
            while (qi < (ri + 1) * rp->conns && rp->q[qi].qp->qp_num != w->qp_num)
                qi++;
            if (qi == (ri + 1) * rp->conns)
                continue;
            if (w->wr_id & RD_RECV_BIT) {
                const uint32_t b = (uint32_t)(w->wr_id & ~RD_RECV_BIT);
                if (w->status != IBV_WC_SUCCESS) {
                    if (w->status != IBV_WC_WR_FLUSH_ERR)
                        kv__rd_peer_fail(r, rp, kv__rd_wc_status(w->status),
                                         "xport rdma: receive on QP %u: %s", qi,
                                         kv__rd_wc_str(w->status));
                    continue;
                }
                if (b >= rp->nrecv || rp->ph == PH_FAIL)
                    continue;
                /* Only a SEND fills a receive buffer. A peer's RDMA WRITE
                 * with immediate also consumes a receive, but leaves the
                 * buffer as the last SEND into it left it: taken as a
                 * notification, that one would be delivered again. */
                if (w->opcode != IBV_WC_RECV) {
                    kv__rd_peer_fail(r, rp, KV_ERR_CORRUPT,
                                     "xport rdma: a receive on QP %u completed as opcode %d "
                                     "(%u bytes), not a SEND (IBV_WC_RECV %d): only SENDs carry "
                                     "notifications",
                                     qi, (int)w->opcode, w->byte_len, (int)IBV_WC_RECV);
                    continue;
                }
                struct rd_msg d;
                char why[200];
                if (kv__rd_msg_decode(kv__rd_buf_at(rp, b), w->byte_len, &d, why, sizeof(why)) !=
                    KV_OK) {
                    kv__rd_peer_fail(r, rp, KV_ERR_CORRUPT, "xport rdma: %s", why);
                    continue;
                }
                if (!(d.kind == RD_MSG_ACK ? on_acks(r, rp, &d) : on_note(r, rp, &d)))
                    continue; /* rp failed */
                const unsigned char *m = kv__rd_buf_at(rp, b);
                struct ibv_sge sg = {
                    .addr = (uintptr_t)m, .length = RD_MSG_BYTES, .lkey = rp->bufs_mr->lkey};
                struct ibv_recv_wr rw = {.wr_id = w->wr_id, .sg_list = &sg, .num_sge = 1},
                                   *bad = NULL;
                struct ibv_qp *qp = rp->q[qi].qp;
                pthread_mutex_unlock(&x->mu);
                const int e = r->v->post_recv(qp, &rw, &bad);
                pthread_mutex_lock(&x->mu);
                if (e)
                    kv__rd_peer_fail(r, rp, KV_ERR_IO, "xport rdma: post_recv: %s", strerror(e));
                continue;
            }
            kv__rd_retire(r, rp, qi, w->wr_id, w->status);
            if (w->status != IBV_WC_SUCCESS && w->status != IBV_WC_WR_FLUSH_ERR)
                kv__rd_peer_fail(
                    r, rp, kv__rd_wc_status(w->status),
                    "xport rdma: a work request on QP %u completed %s (%d, vendor 0x%x)", qi,
                    kv__rd_wc_str(w->status), (int)w->status, w->vendor_err);
        }
    }
}

/* mu held: poll rp's CQs, rail by rail (QP numbers are per device: a
 * completion is matched among its own rail's QPs). */
bool kv__rd_poll_round(struct rdma *r, struct rpeer *rp)
{
    bool any = false;
    for (uint32_t ri = 0; ri < rp->nrail && rp->cq[ri]; ri++)
        any |= poll_cq_round(r, rp, ri);
    return any;
}
