/*
 * kv_xport_tcp_rx.c - the TCP backend's receive state machine
 * (kv_xport_tcp_int.h): every frame a peer sends is checked where it
 * arrives, before its payload is read: the header (kv__xf_decode), the
 * length for its type, the limits of the generic layer (notifications
 * queued, reads served), the region and range of every WRITE piece, the
 * transfer and entry an ACK, NACK or RDATA names, the status codes it
 * carries. A frame that fails a check closes the peer (KV_ERR_CORRUPT or
 * KV_ERR_MISMATCH, the field named); one over a limit is refused (NACK
 * KV_ERR_CAPACITY) and its payload dropped. Fuzzed by
 * tests/fuzz/fuzz_xport_rx.c.
 */
#include <errno.h>
#include <inttypes.h>
#include <string.h>
#include <sys/socket.h>

#include "kv_mem.h"
#include "kv_xport_tcp_int.h"

#define bad kv__xport_bad

/* Whether [a, a + n) and [b, b + m) overlap. */
static bool overlaps(const char *a, uint64_t n, const char *b, uint64_t m)
{
    return a < b + m && b < a + n;
}

/* Whether [p, p + n) overlaps a piece of j that lands in place. */
static bool range_hits(const char *p, uint64_t n, const struct kv__tcp_vjob *j)
{
    if (!j->lo || !overlaps(p, n, j->lo, (uint64_t)(j->hi - j->lo)))
        return false;
    for (uint32_t i = 0; i < j->k; i++)
        if (j->dst[i] && overlaps(p, n, j->dst[i], j->len[i]))
            return true;
    return false;
}

/* Whether a piece of a that lands in place overlaps one of b. */
static bool vj_hits(const struct kv__tcp_vjob *a, const struct kv__tcp_vjob *b)
{
    if (!a->lo || !b->lo || !overlaps(a->lo, (uint64_t)(a->hi - a->lo), b->lo,
                                      (uint64_t)(b->hi - b->lo)))
        return false;
    for (uint32_t i = 0; i < a->k; i++)
        if (a->dst[i] && range_hits(a->dst[i], a->len[i], b))
            return true;
    return false;
}

/* mu held: whether the frame c is about to receive (a held WRITE's pieces,
 * a held RDATA) would land on bytes that an earlier verify slot still
 * covers, or (a WRITE) that an RDATA landing now writes. */
static bool rx_clash(const struct kv__tcp *t, const struct kv__tcp_conn *c)
{
    const struct kv__tcp_vjob *me = c->ph == RX_PIECES ? c->rx_j : NULL;
    for (const struct kv__tcp_peer *tp = t->peers; tp; tp = tp->next)
        for (uint32_t i = 0; i < tp->n_conns; i++) {
            const struct kv__tcp_conn *o = tp->conns[i];
            if (!o)
                continue;
            for (uint32_t v = 0; v < KV__TCP_VQ; v++) {
                const struct kv__tcp_vjob *j = &o->vj[v];
                if (j->st == VJ_FREE || j == me)
                    continue;
                if (me ? j->seq < me->seq && vj_hits(me, j)
                       : range_hits(c->dst, c->f.length, j))
                    return true;
            }
            if (me && o != c && o->ph == RX_LAND && !o->rx_held &&
                range_hits(o->dst, o->f.length, me))
                return true;
            /* a frame to send being hashed reads these bytes */
            const struct kv__tcp_vjob *x = &o->txj;
            if ((x->st == VJ_QUEUED || x->st == VJ_RUNNING) &&
                (me ? vj_hits(me, x) : range_hits(c->dst, c->f.length, x)))
                return true;
        }
    return false;
}

bool kv__tcp_rx_covers(const struct kv__tcp *t, const struct kv__tcp_vjob *j)
{
    for (const struct kv__tcp_peer *tp = t->peers; tp; tp = tp->next)
        for (uint32_t i = 0; i < tp->n_conns; i++) {
            const struct kv__tcp_conn *o = tp->conns[i];
            if (!o)
                continue;
            for (uint32_t v = 0; v < KV__TCP_VQ; v++)
                if (o->vj[v].st != VJ_FREE && vj_hits(j, &o->vj[v]))
                    return true;
            if (o->ph == RX_LAND && range_hits(o->dst, o->f.length, j))
                return true;
        }
    return false;
}

void kv__tcp_vq_push(struct kv__tcp *t, struct kv__tcp_vjob *j)
{
    j->st = VJ_QUEUED;
    j->next = NULL;
    if (t->vq_tail)
        t->vq_tail->next = j;
    else
        t->vq_head = j;
    t->vq_tail = j;
    t->vkick = true; /* signalled once mu is dropped (kv__tcp_unlock) */
}

static struct kv__tcp_vjob *vj_free_slot(struct kv__tcp_conn *c)
{
    for (uint32_t v = 0; v < KV__TCP_VQ; v++)
        if (c->vj[v].st == VJ_FREE)
            return &c->vj[v];
    return NULL;
}

/* Whether a receive slot of c is DONE (verified, its ACK not queued). */
static bool vj_done(const struct kv__tcp_conn *c)
{
    for (uint32_t v = 0; v < KV__TCP_VQ; v++)
        if (c->vj[v].st == VJ_DONE)
            return true;
    return false;
}

/* A QUEUED receive slot of c (the oldest), or NULL. */
static struct kv__tcp_vjob *vj_queued(struct kv__tcp_conn *c)
{
    struct kv__tcp_vjob *q = NULL;
    for (uint32_t v = 0; v < KV__TCP_VQ; v++)
        if (c->vj[v].st == VJ_QUEUED && (!q || c->vj[v].seq < q->seq))
            q = &c->vj[v];
    return q;
}

bool kv__tcp_rx_wanted(struct kv__tcp *t, struct kv__tcp_conn *c)
{
    if (c->ph == RX_HDR && c->hdr_got == 0 && kv__tcp_ctl_pending(c) > KV__TCP_CTL_HIGH)
        return false;
    if (c->ph == RX_DESC && !vj_free_slot(c) && !vj_queued(c) && !vj_done(c))
        return false; /* every slot busy: the verify thread is on one */
    if (c->rx_held) {
        if (rx_clash(t, c))
            return false;
        c->rx_held = false;
    }
    return true;
}

/* mu held: j (of a WRITE) is verified (ok: its hash matched): one ACK
 * with a record per piece {entry, status, bytes}: KV_OK,
 * KV_ERR_OUT_OF_BOUNDS (refused, not written) or KV_ERR_CORRUPT (the data
 * failed its checksum); its exposures are no longer busy, the slot FREE.
 * false: no memory for the ACK. */
static bool vj_retire(struct kv__tcp *t, struct kv__tcp_vjob *j, bool ok)
{
    unsigned char rec[KV__TCP_MAXV * KV__TCP_ACK_REC];
    for (uint32_t i = 0; i < j->k; i++) {
        const kv_status st = !j->dst[i] ? KV_ERR_OUT_OF_BOUNDS : ok ? KV_OK : KV_ERR_CORRUPT;
        unsigned char *r = rec + KV__TCP_ACK_REC * i;
        kv__le_put(r, j->entry[i], 4);
        kv__le_put(r + 4, (uint32_t)(int32_t)st, 4);
        kv__le_put(r + 8, j->len[i], 8);
    }
    struct kv__xf a = {.type = KV__XF_ACK, .xfer = j->xfer, .entry = j->k};
    const bool put = j->dead || kv__tcp_ctl_put(j->c, a, rec, KV__TCP_ACK_REC * a.entry);
    bool idle = false;
    for (uint32_t i = 0; i < j->k; i++)
        if (j->expo[i] && --j->expo[i]->busy == 0)
            idle = true;
    j->st = VJ_FREE;
    j->dead = false;
    j->lo = j->hi = NULL;
    /* kv_xport_mem_unexpose waits on x->cv for an exposure's busy to reach
     * 0: woken only then, not at every frame (an application thread in
     * kv_xport_notify_poll waits on it too) */
    if (idle)
        pthread_cond_broadcast(&t->x->cv);
    pthread_cond_broadcast(&t->vdone);
    return put;
}

/* mu held: j out of the verify thread's queue (it is QUEUED). */
static void vq_unlink(struct kv__tcp *t, struct kv__tcp_vjob *j)
{
    struct kv__tcp_vjob **pp = &t->vq_head, *prev = NULL;
    while (*pp != j) {
        prev = *pp;
        pp = &(*pp)->next;
    }
    *pp = j->next;
    if (t->vq_tail == j)
        t->vq_tail = prev;
}

void kv__tcp_vj_drop(struct kv__tcp *t, struct kv__tcp_conn *c)
{
    /* the frame to send next: its hash ends, its transfer is not busy */
    if (c->txj.st == VJ_QUEUED)
        vq_unlink(t, &c->txj);
    while (c->txj.st == VJ_RUNNING)
        pthread_cond_wait(&t->vdone, &t->x->mu);
    c->txj.st = VJ_FREE;
    if (c->nx_on && c->nx_t->busy)
        c->nx_t->busy--;
    c->nx_on = false;
    for (uint32_t v = 0; v < KV__TCP_VQ; v++) {
        struct kv__tcp_vjob *j = &c->vj[v];
        if (j->st == VJ_QUEUED)
            vq_unlink(t, j);
        while (j->st == VJ_RUNNING)
            pthread_cond_wait(&t->vdone, &t->x->mu);
        if (j->st != VJ_FREE) {
            j->dead = true;
            (void)vj_retire(t, j, false);
        }
    }
    c->rx_j = NULL;
}

bool kv__tcp_vj_collect(struct kv__tcp *t, struct kv__tcp_conn *c)
{
    for (uint32_t v = 0; v < KV__TCP_VQ; v++)
        if (c->vj[v].st == VJ_DONE && !vj_retire(t, &c->vj[v], c->vj[v].ok))
            return false;
    return true;
}

/* mu held, j taken off the queue: hash it, mu dropped, and mark it DONE.
 * A frame to send: its hash goes in its header (want); a received WRITE:
 * ok says whether it matched, and the progress thread acknowledges it
 * (only that thread writes a control stream, which it sends with mu
 * dropped). */
static void vj_hash(struct kv__tcp *t, struct kv__tcp_vjob *j)
{
    j->st = VJ_RUNNING;
    /* The frame's bytes are in place and nothing lands on them until this
     * slot is FREE (kv__tcp_rx_wanted); its exposures (its transfer, to
     * send) are busy. */
    kv__tcp_unlock(t);
    uint64_t sum;
    if (j->pack) { /* a gathered frame to send: packed, hashed where it is sent from */
        j->pbytes = kv__tcp_pack(j->pstage, j->psrc, j->plen, j->pn);
        sum = kv__xxh3_64(j->pstage, (size_t)j->pbytes);
    } else {
        struct kv__xxh3_state hs;
        kv__xxh3_reset(&hs);
        for (uint32_t i = 0; i < j->k; i++)
            kv__xxh3_update(&hs, j->dst[i], (size_t)j->len[i]);
        sum = kv__xxh3_digest(&hs);
    }
    pthread_mutex_lock(&t->x->mu);
    if (j->tx)
        j->want = sum;
    else
        j->ok = sum == j->want;
    j->st = VJ_DONE;
    pthread_cond_broadcast(&t->vdone);
}

void kv__tcp_vj_hash_now(struct kv__tcp *t, struct kv__tcp_vjob *j)
{
    vq_unlink(t, j);
    vj_hash(t, j);
}

void *kv__tcp_verify_main(void *arg)
{
    struct kv__tcp *t = arg;
    kv_xport *x = t->x;
    pthread_mutex_lock(&x->mu);
    for (;;) {
        struct kv__tcp_vjob *j = t->vq_head;
        if (!j) {
            if (t->vstop)
                break;
            pthread_cond_wait(&t->vcv, &x->mu);
            continue;
        }
        t->vq_head = j->next;
        if (!t->vq_head)
            t->vq_tail = NULL;
        vj_hash(t, j);
        t->hashed = true;
        if (t->polling) /* else it sees `hashed` before it polls */
            kv__tcp_wake(t);
    }
    pthread_mutex_unlock(&x->mu);
    return NULL;
}

/* mu held: an AUTO probe (kv_xport_int.h): checked as a HELLO is, then
 * answered with this transport's same-host offer (or refused); the
 * connection ends once the answer is out (dead: dropped next round, not
 * counted as refused). */
static struct kv__xport_verdict probe_in(struct kv__tcp *t, struct kv__tcp_conn *c,
                                         const struct kv__xport_hello *h)
{
    kv_xport *x = t->x;
    char why[160];
    struct kv__xport_hello hc = *h; /* a probe has no connections to agree on */
    hc.conns = x->cfg.conns_per_peer;
    if (kv__xport_hello_check(x, &hc, why, sizeof(why)) != KV_OK) {
        (void)kv__tcp_put_refuse(c, KV_ERR_MISMATCH, why);
        return bad(KV_ERR_MISMATCH, "%s", why);
    }
    if (h->echo != 0 || h->nonce == 0 || h->conn != 0)
        return bad(KV_ERR_CORRUPT,
                   "xport auto: a probe answering 0x%016" PRIx64 " on connection %u", h->echo,
                   h->conn);
    unsigned char b[KV__XPORT_PROBE_BYTES];
    kv__xport_probe_answer(x, h, b);
    if (!kv__tcp_ctl_put(c, (struct kv__xf){.type = KV__XF_HELLO}, b, sizeof(b)))
        return bad(KV_ERR_NO_MEMORY, "xport auto: control buffer");
    c->dead = true;
    return KV__XPORT_OK;
}

/* mu held: a HELLO on an incoming connection before its peer is known. */
static struct kv__xport_verdict hello_in(struct kv__tcp *t, struct kv__tcp_conn *c,
                                         const struct kv__xport_hello *h)
{
    kv_xport *x = t->x;
    char why[160];
    if (c->dead) /* a probe answered: a frame after it closes the connection */
        return bad(KV_ERR_CORRUPT, "xport handshake: a HELLO after a probe");
    if (kv__xport_is_probe(x, h))
        return probe_in(t, c, h);
    if (kv__xport_hello_check(x, h, why, sizeof(why)) != KV_OK) {
        (void)kv__tcp_put_refuse(c, KV_ERR_MISMATCH, why);
        return bad(KV_ERR_MISMATCH, "%s", why);
    }
    if (h->echo != 0 || h->nonce == 0)
        return bad(KV_ERR_CORRUPT, "xport handshake: an incoming HELLO that answers 0x%016" PRIx64,
                   h->echo);
    struct kv__tcp_peer *tp = NULL;
    for (struct kv__tcp_peer *q = t->peers; q; q = q->next)
        if (!q->p->outgoing && q->p->nonce_remote == h->nonce)
            tp = q;
    if (!tp) {
        kv_xport_peer *p = kv__xport_peer_new(x, false);
        tp = p ? kv__mem_calloc(1, sizeof(*tp)) : NULL;
        if (!tp) {
            if (p)
                kv__xport_peer_unref(p);
            return bad(KV_ERR_NO_MEMORY, "xport accept: peer state");
        }
        tp->p = p;
        p->be = tp;
        p->nonce_remote = h->nonce;
        tp->n_conns = h->conns;
        tp->deadline_ns = kv__deadline_ns(x->cfg.timeout_ms);
        tp->next = t->peers;
        t->peers = tp;
    }
    if (tp->p->state != KV_XPORT_CONNECTING || tp->conns[h->conn])
        return bad(KV_ERR_CORRUPT, "xport handshake: connection %u of a peer given twice", h->conn);
    c->index = h->conn;
    c->tp = tp;
    c->up = true;
    tp->conns[h->conn] = c;
    for (uint32_t i = 0; i < t->n_unbound; i++) /* the peer owns it now */
        if (t->unbound[i] == c) {
            t->unbound[i] = t->unbound[--t->n_unbound];
            break;
        }
    if (!kv__tcp_put_hello(t, c, tp->p, tp->n_conns))
        return bad(KV_ERR_NO_MEMORY, "xport handshake: control buffer");
    if (++tp->n_up == tp->n_conns)
        kv__xport_peer_ready(tp->p);
    return KV__XPORT_OK;
}

/* mu held: a HELLO answering ours on an outgoing connection. */
static struct kv__xport_verdict hello_out(struct kv__tcp *t, struct kv__tcp_conn *c,
                                          const struct kv__xport_hello *h)
{
    char why[160];
    kv_xport_peer *p = c->tp->p;
    if (kv__xport_hello_check(t->x, h, why, sizeof(why)) != KV_OK)
        return bad(KV_ERR_MISMATCH, "%s", why);
    if (h->echo != p->nonce_local || h->conn != c->index || c->up)
        return bad(KV_ERR_CORRUPT,
                   "xport handshake: a HELLO answering 0x%016" PRIx64 " on connection %u", h->echo,
                   h->conn);
    if (p->nonce_remote && p->nonce_remote != h->nonce)
        return bad(KV_ERR_CORRUPT, "xport handshake: two peer ids on one peer");
    p->nonce_remote = h->nonce;
    c->up = true;
    if (++c->tp->n_up == c->tp->n_conns)
        kv__xport_peer_ready(p);
    return KV__XPORT_OK;
}

/* mu held: a NACK (or a notification's ACK) of one of our transfers. */
static struct kv__xport_verdict on_nack(struct kv__tcp_peer *tp, const struct kv__xf *f)
{
    kv_xport_xfer *xf = kv__xport_xfer_find(tp->p, f->xfer);
    if (!xf)
        return KV__XPORT_OK; /* ended already (timed out, cancelled) */
    const bool note = f->entry == KV__XF_ENTRY_NOTE;
    if (note && !xf->note_sent)
        return bad(KV_ERR_CORRUPT,
                   "xport tcp: %s of the notification of transfer %" PRIu64 ", never sent",
                   f->type == KV__XF_ACK ? "an ACK" : "a NACK", f->xfer);
    if (f->type == KV__XF_ACK) {
        xf->note_done = true;
    } else if (!note && f->entry >= xf->n) {
        return bad(KV_ERR_CORRUPT, "xport tcp: a NACK of entry %u of a transfer of %u", f->entry,
                   xf->n);
    } else {
        const int64_t v = (int64_t)f->offset;
        const kv_status s = kv__xport_wire_status(v, false);
        char why[200];
        kv__xport_refusal_msg(why, sizeof(why), tp->p->id, f->xfer, note, f->entry, v, s);
        if (note)
            kv__xport_note_refused(xf, s, why);
        else
            kv__xport_entry_fail(xf, f->entry, s, "%s", why);
    }
    kv__xport_settle_idle(tp->p);
    return KV__XPORT_OK;
}

/* mu held: a header arrived (decoded into c->f): set up its payload. */
static struct kv__xport_verdict on_header(struct kv__tcp *t, struct kv__tcp_conn *c)
{
    const struct kv__xf *f = &c->f;
    struct kv__tcp_peer *tp = c->tp;
    const bool bound = tp && c->up;
    if (f->length > KV__TCP_MAX_FRAME)
        return bad(KV_ERR_CORRUPT, "xport tcp: a frame of %" PRIu64 " payload bytes (limit %u)",
                   f->length, KV__TCP_MAX_FRAME);
    if (!bound && f->type != KV__XF_HELLO && f->type != KV__XF_REFUSE)
        return bad(KV_ERR_CORRUPT, "xport tcp: frame type %u before the handshake",
                   (unsigned)f->type);
    /* An incoming peer is READY at its last connection's HELLO, the one we
     * answer last; it cannot be READY itself before, so it sends nothing
     * else before. (An outgoing peer's listener may: it is READY when we
     * are not yet, and a connection's answer can trail another's frames.) */
    if (bound && !tp->p->outgoing && tp->p->state == KV_XPORT_CONNECTING &&
        f->type != KV__XF_HELLO && f->type != KV__XF_REFUSE)
        return bad(KV_ERR_CORRUPT,
                   "xport tcp: frame type %u on connection %u before the peer's handshake is "
                   "done (%u of its %u connections up)",
                   (unsigned)f->type, c->index, tp->n_up, tp->n_conns);
    c->got = 0;
    kv__xxh3_reset(&c->hs);
    c->dst = (char *)c->small;
    switch (f->type) {
    case KV__XF_HELLO:
    case KV__XF_REFUSE:
        if (bound)
            return bad(KV_ERR_CORRUPT, "xport tcp: a handshake frame after the handshake");
        if ((f->type == KV__XF_HELLO && f->length != KV__XPORT_HELLO_BYTES) ||
            f->length > sizeof(c->small))
            return bad(KV_ERR_CORRUPT, "xport tcp: frame type %u with %" PRIu64 " bytes",
                       (unsigned)f->type, f->length);
        c->ph = RX_SMALL;
        return KV__XPORT_OK;
    case KV__XF_NOTIFY: {
        /* The limits, before a byte of the payload is read: too long is a
         * protocol violation; a full queue refuses this one by name. */
        char why[160];
        const kv_status st = kv__xport_note_admit(tp->p, f->length, why, sizeof(why));
        if (st == KV_ERR_CORRUPT)
            return bad(st, "xport tcp: %s", why);
        if (st != KV_OK) {
            t->x->stats.notes_refused++;
            struct kv__xf n = {.type = KV__XF_NACK,
                               .xfer = f->xfer,
                               .entry = KV__XF_ENTRY_NOTE,
                               .offset = (uint64_t)(int64_t)st};
            if (!kv__tcp_ctl_put(c, n, NULL, 0))
                return bad(KV_ERR_NO_MEMORY, "xport tcp: control buffer");
            c->ph = RX_DISCARD;
            return KV__XPORT_OK;
        }
        c->ph = RX_SMALL;
        return KV__XPORT_OK;
    }
    case KV__XF_WRITE:
        /* entry: the piece count; offset: XXH3 of the descriptor table,
         * checked before any piece lands (a damaged table must not steer
         * bytes anywhere). */
        if (f->entry == 0 || f->entry > KV__TCP_MAXV ||
            f->length <= (uint64_t)f->entry * KV__TCP_DESC)
            return bad(KV_ERR_CORRUPT, "xport tcp: a WRITE of %u pieces in %" PRIu64 " bytes",
                       f->entry, f->length);
        c->ph = RX_DESC;
        return KV__XPORT_OK;
    case KV__XF_RDATA: {
        kv_xport_xfer *xf = kv__xport_xfer_find(tp->p, f->xfer);
        if (!xf || xf->cancel_req) { /* ended or ending: nothing more lands */
            c->ph = RX_DISCARD;
            return KV__XPORT_OK;
        }
        if (!xf->read || f->entry >= xf->n || xf->ended[f->entry] ||
            f->offset != xf->moved[f->entry] || f->length == 0 ||
            f->length > xf->ios[f->entry].bytes - f->offset)
            return bad(KV_ERR_CORRUPT,
                       "xport tcp: read data for transfer %" PRIu64 " entry %u at %" PRIu64
                       " (+%" PRIu64 ") that was not asked for",
                       f->xfer, f->entry, f->offset, f->length);
        const struct kv_xport_io *io = &xf->ios[f->entry];
        xf->busy++;
        c->land_t = xf;
        c->dst = io->local->base + io->local_off + f->offset;
        c->ph = RX_LAND;
        c->rx_held = true; /* until no verify slot covers its bytes */
        return KV__XPORT_OK;
    }
    case KV__XF_ACK:
        if (f->entry != KV__XF_ENTRY_NOTE) { /* a WRITE's: one record per piece */
            if (f->entry == 0 || f->entry > KV__TCP_MAXV ||
                f->length != (uint64_t)f->entry * KV__TCP_ACK_REC)
                return bad(KV_ERR_CORRUPT, "xport tcp: an ACK of %u pieces in %" PRIu64 " bytes",
                           f->entry, f->length);
            c->ph = RX_SMALL;
            return KV__XPORT_OK;
        }
        /* A notification's ACK has no payload: handled as a NACK is. */
        if (f->length)
            return bad(KV_ERR_CORRUPT, "xport tcp: a notification's ACK with payload");
        return on_nack(tp, f);
    case KV__XF_NACK:
        if (f->length)
            return bad(KV_ERR_CORRUPT, "xport tcp: a NACK with payload");
        return on_nack(tp, f);
    case KV__XF_READ:
        if (f->length != 8)
            return bad(KV_ERR_CORRUPT, "xport tcp: a READ with %" PRIu64 " payload bytes (8)",
                       f->length);
        c->ph = RX_SMALL;
        return KV__XPORT_OK;
    case KV__XF_BYE:
        if (f->length)
            return bad(KV_ERR_CORRUPT, "xport tcp: a BYE with payload");
        return bad(KV_OK, "closed by the peer");
    }
    return bad(KV_ERR_CORRUPT, "xport tcp: frame type %u", (unsigned)f->type);
}

/* mu held: a READ's payload (its length) arrived: queue the read on c, or
 * NACK it (not inside a region exposed to the peer; max_pending_reads). */
static struct kv__xport_verdict serve_read(struct kv__tcp *t, struct kv__tcp_conn *c)
{
    const struct kv__xf *f = &c->f;
    struct kv__tcp_peer *tp = c->tp;
    const uint64_t len = kv__le_get(c->small, 8);
    struct kv__xport_expo *e = len ? kv__xport_exposed(tp->p, f->region, f->offset, len) : NULL;
    const bool full = tp->n_serves >= t->x->cfg.max_pending_reads;
    if (!e || full) {
        t->x->stats.reads_refused++;
        struct kv__xf n = {.type = KV__XF_NACK,
                           .xfer = f->xfer,
                           .entry = f->entry,
                           .offset =
                               (uint64_t)(int64_t)(full ? KV_ERR_CAPACITY : KV_ERR_OUT_OF_BOUNDS)};
        return kv__tcp_ctl_put(c, n, NULL, 0) ? KV__XPORT_OK
                                              : bad(KV_ERR_NO_MEMORY, "xport tcp: control buffer");
    }
    struct kv__xport_serve *s = kv__mem_calloc(1, sizeof(*s));
    if (!s)
        return bad(KV_ERR_NO_MEMORY, "xport tcp: a read to serve");
    s->xfer = f->xfer;
    s->entry = f->entry;
    s->expo = e;
    e->busy++;
    tp->n_serves++;
    s->off = f->offset;
    s->len = len;
    if (c->srv_tail)
        c->srv_tail->next = s;
    else
        c->srv_head = s;
    c->srv_tail = s;
    return KV__XPORT_OK;
}

/* mu held: a WRITE's descriptor table arrived (c->small): check it whole,
 * then say where each piece lands (NULL: not inside a region exposed to
 * this peer: dropped, refused in the ACK). */
static struct kv__xport_verdict on_desc(struct kv__tcp *t, struct kv__tcp_conn *c)
{
    const struct kv__xf *f = &c->f;
    const uint32_t k = f->entry;
    if (kv__xxh3_64(c->small, (size_t)k * KV__TCP_DESC) != f->offset)
        return bad(KV_ERR_CORRUPT, "xport tcp: a WRITE's descriptor table fails its checksum");
    const uint64_t data = f->length - (uint64_t)k * KV__TCP_DESC;
    uint64_t sum = 0;
    for (uint32_t i = 0; i < k; i++) {
        const unsigned char *d = c->small + (size_t)i * KV__TCP_DESC;
        const uint64_t len = kv__le_get(d + 16, 8);
        if (len == 0 || len > data - sum)
            return bad(KV_ERR_CORRUPT, "xport tcp: WRITE piece %u of %" PRIu64 " bytes", i, len);
        sum += len;
    }
    if (sum != data)
        return bad(KV_ERR_CORRUPT, "xport tcp: WRITE pieces of %" PRIu64 " bytes in %" PRIu64, sum,
                   data);
    struct kv__tcp_vjob *j = vj_free_slot(c); /* kv__tcp_rx_wanted saw one */
    j->c = c;
    j->k = k;
    j->xfer = f->xfer;
    j->want = f->payload_sum;
    j->lo = j->hi = NULL;
    j->inline_ = !t->rx_defer;
    for (uint32_t i = 0; i < k; i++) {
        const unsigned char *d = c->small + (size_t)i * KV__TCP_DESC;
        const uint32_t region = (uint32_t)kv__le_get(d + 4, 4);
        const uint64_t off = kv__le_get(d + 8, 8), len = kv__le_get(d + 16, 8);
        struct kv__xport_expo *e = kv__xport_exposed(c->tp->p, region, off, len);
        j->entry[i] = (uint32_t)kv__le_get(d, 4);
        j->len[i] = len;
        j->expo[i] = e;
        j->dst[i] = e ? e->mem->base + off : NULL;
        if (e) {
            e->busy++;
            j->lo = !j->lo || j->dst[i] < j->lo ? j->dst[i] : j->lo;
            j->hi = !j->hi || j->dst[i] + len > j->hi ? j->dst[i] + len : j->hi;
        } else {
            j->inline_ = true; /* its bytes are dropped: hashed as they come */
        }
    }
    /* Pieces that overlap each other are hashed as they land (a later
     * piece rewrites an earlier one's bytes before a deferred hash could
     * read them). */
    for (uint32_t i = 0; i < k && !j->inline_; i++)
        for (uint32_t q = i + 1; q < k && j->dst[i] && !j->inline_; q++)
            j->inline_ = overlaps(j->dst[i], j->len[i], j->dst[q], j->len[q]);
    j->st = VJ_FILLING;
    j->seq = ++t->vseq;
    c->rx_j = j;
    c->rx_held = true; /* until no earlier slot covers its bytes */
    c->rx_p = 0;
    c->rx_pgot = 0;
    kv__xxh3_reset(&c->hs);
    c->ph = RX_PIECES;
    return KV__XPORT_OK;
}

/* mu held: every piece of a WRITE arrived: verified now (hashed as it
 * landed) or queued for the verify thread. */
static struct kv__xport_verdict on_pieces(struct kv__tcp *t, struct kv__tcp_conn *c, bool sum_ok)
{
    struct kv__tcp_vjob *j = c->rx_j;
    c->rx_j = NULL;
    if (j->inline_)
        return vj_retire(t, j, sum_ok) ? KV__XPORT_OK
                                       : bad(KV_ERR_NO_MEMORY, "xport tcp: control buffer");
    kv__tcp_vq_push(t, j);
    return KV__XPORT_OK;
}

/* mu held: the ACK of one of our WRITEs (c->small: a record per piece). */
static struct kv__xport_verdict on_acks(struct kv__tcp_conn *c)
{
    struct kv__tcp_peer *tp = c->tp;
    kv_xport_xfer *xf = kv__xport_xfer_find(tp->p, c->f.xfer);
    if (!xf)
        return KV__XPORT_OK; /* ended already (its peer closed under it: see sweep) */
    /* One ACK answers one WRITE frame sent whole (that one landed whole):
     * none waiting, this one answers nothing we sent. */
    if (!xf->unacked)
        return bad(KV_ERR_CORRUPT,
                   "xport tcp: an ACK of transfer %" PRIu64
                   ", which has no WRITE frame sent and not yet acknowledged",
                   xf->id);
    xf->unacked--;
    for (uint32_t i = 0; i < c->f.entry; i++) {
        const unsigned char *r = c->small + KV__TCP_ACK_REC * i;
        const uint32_t e = (uint32_t)kv__le_get(r, 4);
        const int32_t v = (int32_t)(uint32_t)kv__le_get(r + 4, 4);
        const uint64_t bytes = kv__le_get(r + 8, 8);
        if (e >= xf->n || xf->read)
            return bad(KV_ERR_CORRUPT, "xport tcp: an ACK of entry %u of transfer %" PRIu64, e,
                       xf->id);
        /* bytes of entry e cut into frames so far (the send cursor) */
        const uint64_t cut = e < xf->be_entry    ? xf->ios[e].bytes
                             : e == xf->be_entry ? xf->be_off
                                                 : 0;
        if (xf->ended[e])
            continue;
        const kv_status st = kv__xport_wire_status(v, true);
        if (st != KV_OK) {
            if (st == KV_ERR_CORRUPT && v != KV_ERR_CORRUPT)
                kv__xport_entry_fail(xf, e, st,
                                     "peer %" PRIu64 " answered entry %u of transfer %" PRIu64
                                     " with status %d, which is not a kv_status",
                                     tp->p->id, e, xf->id, (int)v);
            else
                kv__xport_entry_fail(
                    xf, e, st, "peer %" PRIu64 " refused entry %u of transfer %" PRIu64 ": %s",
                    tp->p->id, e, xf->id, kv_status_name(st));
            continue;
        }
        if (bytes == 0 || bytes > cut - xf->moved[e])
            return bad(KV_ERR_CORRUPT,
                       "xport tcp: an ACK of %" PRIu64 " bytes of entry %u of transfer %" PRIu64
                       ", %" PRIu64 " sent and not yet acknowledged",
                       bytes, e, xf->id, cut - xf->moved[e]);
        xf->moved[e] += bytes;
        if (xf->moved[e] == xf->ios[e].bytes)
            kv__xport_entry_end(xf, e, KV_OK);
    }
    if (!kv__tcp_notes_flush(tp))
        return bad(KV_ERR_NO_MEMORY, "xport tcp: control buffer");
    kv__xport_settle_idle(tp->p);
    return KV__XPORT_OK;
}

/* mu held: the payload of c->f is complete. */
static struct kv__xport_verdict on_payload(struct kv__tcp *t, struct kv__tcp_conn *c)
{
    const struct kv__xf *f = &c->f;
    struct kv__tcp_peer *tp = c->tp;
    const bool sum_ok = f->length == 0 || kv__xxh3_digest(&c->hs) == f->payload_sum;
    switch (c->ph) {
    case RX_SMALL:
        if (!sum_ok)
            return bad(KV_ERR_CORRUPT, "xport tcp: frame type %u fails its payload checksum",
                       (unsigned)f->type);
        if (f->type == KV__XF_NOTIFY) { /* not queued for lack of memory: refused, named */
            const bool queued =
                kv__xport_note_push(tp->p, f->offset, c->small, (uint32_t)f->length) == KV_OK;
            t->x->stats.notes_refused += !queued;
            const struct kv__xf a = {.type = queued ? KV__XF_ACK : KV__XF_NACK,
                                     .xfer = f->xfer,
                                     .entry = KV__XF_ENTRY_NOTE,
                                     .offset = queued ? 0 : (uint64_t)(int64_t)KV_ERR_NO_MEMORY};
            if (!kv__tcp_ctl_put(c, a, NULL, 0))
                return bad(KV_ERR_NO_MEMORY, "xport tcp: control buffer");
            return KV__XPORT_OK;
        }
        if (f->type == KV__XF_READ)
            return serve_read(t, c);
        if (f->type == KV__XF_ACK)
            return on_acks(c);
        if (f->type == KV__XF_REFUSE) {
            char m[201];
            const size_t n = f->length < sizeof(m) - 1 ? (size_t)f->length : sizeof(m) - 1;
            memcpy(m, c->small, n);
            m[n] = 0;
            for (size_t i = 0; i < n; i++)
                if ((unsigned char)m[i] < 32 || (unsigned char)m[i] > 126)
                    m[i] = '?';
            kv_status st = kv__xport_wire_status((int64_t)f->offset, false);
            st =
                st == KV_ERR_CORRUPT && (int64_t)f->offset != KV_ERR_CORRUPT ? KV_ERR_MISMATCH : st;
            return bad(st, "refused by the peer: %s", m);
        }
        {
            struct kv__xport_hello h;
            kv__xport_hello_decode(c->small, &h);
            return tp ? hello_out(t, c, &h) : hello_in(t, c, &h);
        }
    case RX_LAND: { /* RDATA into our read */
        kv_xport_xfer *xf = c->land_t;
        c->land_t = NULL;
        xf->busy--;
        if (!sum_ok) {
            kv__xport_entry_fail(xf, f->entry, KV_ERR_CORRUPT,
                                 "read data of entry %u at %" PRIu64 " (+%" PRIu64
                                 ") fails its checksum",
                                 f->entry, f->offset, f->length);
        } else {
            xf->moved[f->entry] += f->length;
            if (xf->moved[f->entry] == xf->ios[f->entry].bytes)
                kv__xport_entry_end(xf, f->entry, KV_OK);
        }
        kv__xport_settle_idle(tp->p);
        return KV__XPORT_OK;
    }
    case RX_PIECES:
        return on_pieces(t, c, sum_ok);
    case RX_DESC:
    case RX_DISCARD:
    case RX_HDR:
        break;
    }
    return KV__XPORT_OK;
}

/* The iovecs of c's next recvmsg (mu held): where the bytes of the current
 * phase go. Pieces are gathered only while their destinations are
 * disjoint, so each is hashed before any other byte can land on it. */
static int rx_iov(struct kv__tcp *t, struct kv__tcp_conn *c, struct iovec *iov)
{
    if (c->ph == RX_HDR) {
        iov[0] = (struct iovec){c->hdr + c->hdr_got, KV__XF_BYTES - c->hdr_got};
        return 1;
    }
    if (c->ph == RX_PIECES) {
        const struct kv__tcp_vjob *j = c->rx_j;
        const uint64_t rest = j->len[c->rx_p] - c->rx_pgot;
        if (!j->dst[c->rx_p]) {
            iov[0] = (struct iovec){t->scratch,
                                    rest < sizeof(t->scratch) ? (size_t)rest : sizeof(t->scratch)};
            return 1;
        }
        int n = 0;
        iov[n++] = (struct iovec){j->dst[c->rx_p] + c->rx_pgot, (size_t)rest};
        for (uint32_t p = c->rx_p + 1; p < j->k && j->dst[p]; p++) {
            bool clash = false;
            for (int k = 0; k < n && !clash; k++)
                clash = overlaps(iov[k].iov_base, iov[k].iov_len, j->dst[p], j->len[p]);
            if (clash)
                break;
            iov[n++] = (struct iovec){j->dst[p], (size_t)j->len[p]};
        }
        return n;
    }
    const uint64_t end = c->ph == RX_DESC ? (uint64_t)c->f.entry * KV__TCP_DESC : c->f.length;
    const size_t want = (size_t)(end - c->got);
    if (c->ph == RX_DISCARD)
        iov[0] = (struct iovec){t->scratch, want < sizeof(t->scratch) ? want : sizeof(t->scratch)};
    else
        iov[0] = (struct iovec){c->dst + c->got, want};
    return 1;
}

struct kv__xport_verdict kv__tcp_conn_rx(struct kv__tcp *t, struct kv__tcp_conn *c)
{
    kv_xport *x = t->x;
    uint64_t budget = KV__TCP_RX_BUDGET;
    uint32_t frames = 0;
    while (budget && frames < x->cfg.frames_per_round && kv__tcp_rx_wanted(t, c)) {
        if (c->ph == RX_DESC && !vj_free_slot(c)) {
            /* every slot taken: first those the verify thread finished
             * (their ACKs queued, the slots FREE) */
            if (vj_done(c)) {
                if (!kv__tcp_vj_collect(t, c))
                    return bad(KV_ERR_NO_MEMORY, "xport tcp: control buffer");
                continue;
            }
            /* else the verify thread is behind (busy, or not scheduled on
             * a loaded machine): verify the oldest here */
            struct kv__tcp_vjob *j = vj_queued(c);
            if (!j)
                break;
            kv__tcp_vj_hash_now(t, j);
            if (!kv__tcp_vj_collect(t, c))
                return bad(KV_ERR_NO_MEMORY, "xport tcp: control buffer");
            continue;
        }
        struct iovec iov[KV__TCP_MAXV];
        const int niov = rx_iov(t, c, iov);
        ssize_t r = 0;
        if (iov[0].iov_len) {
            /* The lock is dropped around recvmsg and the hashing of what it
             * returned: the destination is held (a busy exposure, a busy
             * read) and only this thread touches c's receive side. */
            const bool hash = c->ph != RX_HDR && c->ph != RX_DISCARD &&
                              (c->ph != RX_PIECES || c->rx_j->inline_);
            struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)niov};
            kv__tcp_unlock(t);
            r = recvmsg(c->fd, &mh, MSG_DONTWAIT);
            const int e = errno;
            for (int k = 0; hash && r > 0 && k < niov; k++) {
                const size_t done = (size_t)r;
                size_t before = 0;
                for (int j = 0; j < k; j++)
                    before += iov[j].iov_len;
                if (before >= done)
                    break;
                const size_t take = done - before < iov[k].iov_len ? done - before : iov[k].iov_len;
                kv__xxh3_update(&c->hs, iov[k].iov_base, take);
            }
            pthread_mutex_lock(&x->mu);
            if (r == 0)
                return bad(KV_ERR_IO, "xport tcp: connection lost (closed by the other end)");
            if (r < 0) {
                if (e == EAGAIN || e == EWOULDBLOCK || e == EINTR)
                    return KV__XPORT_OK;
                return bad(KV_ERR_IO, "xport tcp: recv: %s", strerror(e));
            }
            budget -= (uint64_t)r < budget ? (uint64_t)r : budget;
        }
        if (c->ph == RX_HDR) {
            if (c->hdr_got == 0)
                c->rx_since_ns = kv__now_ns();
            c->hdr_got += (size_t)r;
            if (c->hdr_got < KV__XF_BYTES)
                continue;
            c->hdr_got = 0;
            const kv_status ds = kv__xf_decode(c->hdr, &c->f);
            if (ds != KV_OK)
                return bad(ds, "%s", kv_last_error());
            struct kv__xport_verdict v = on_header(t, c);
            if (!kv__xport_ok(&v))
                return v;
            if (c->ph != RX_HDR && c->f.length)
                continue;
            if (c->ph == RX_HDR) { /* a frame without payload, handled */
                c->rx_since_ns = 0;
                frames++;
                continue;
            }
        } else if (c->ph == RX_PIECES) {
            /* Account what landed, piece by piece (the exposures stay
             * busy until the frame is verified). */
            size_t n = (size_t)r;
            for (int k = 0; k < niov && n; k++) {
                const size_t take = n < iov[k].iov_len ? n : iov[k].iov_len;
                n -= take;
                c->rx_pgot += take;
                if (c->rx_pgot == c->rx_j->len[c->rx_p]) {
                    c->rx_p++;
                    c->rx_pgot = 0;
                }
            }
            c->got += (uint64_t)r;
            if (c->rx_p < c->rx_j->k)
                continue;
        } else {
            c->got += (uint64_t)r;
            if (c->got < (c->ph == RX_DESC ? (uint64_t)c->f.entry * KV__TCP_DESC : c->f.length))
                continue;
            if (c->ph == RX_DESC) {
                struct kv__xport_verdict v = on_desc(t, c);
                if (!kv__xport_ok(&v))
                    return v;
                continue;
            }
        }
        struct kv__xport_verdict v = on_payload(t, c);
        c->ph = RX_HDR;
        c->rx_since_ns = 0;
        frames++;
        if (!kv__xport_ok(&v))
            return v;
    }
    return KV__XPORT_OK;
}
