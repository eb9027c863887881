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

#define bad kv__tcp_bad

void kv__tcp_settle_all(struct kv__tcp_peer *tp)
{
    for (kv_xport_xfer *xf = tp->p->xfers, *nx; xf; xf = nx) {
        nx = xf->next;
        if (!xf->left && !xf->busy)
            kv__xport_xfer_settle(xf);
    }
}

bool kv__tcp_rx_wanted(const struct kv__tcp_conn *c)
{
    return !(c->ph == RX_HDR && c->hdr_got == 0 && kv__tcp_ctl_pending(c) > KV__TCP_CTL_HIGH);
}

/* mu held: a HELLO on an incoming connection before its peer is known. */
static struct kv__tcp_verdict hello_in(struct kv__tcp *t, struct kv__tcp_conn *c,
                                       const struct kv__xport_hello *h)
{
    kv_xport *x = t->x;
    char why[160];
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
    return KV__TCP_OK;
}

/* mu held: a HELLO answering ours on an outgoing connection. */
static struct kv__tcp_verdict hello_out(struct kv__tcp *t, struct kv__tcp_conn *c,
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
    return KV__TCP_OK;
}

/* mu held: a NACK (or a notification's ACK) of one of our transfers. */
static struct kv__tcp_verdict on_nack(struct kv__tcp_peer *tp, const struct kv__xf *f)
{
    kv_xport_xfer *xf = kv__xport_xfer_find(tp->p, f->xfer);
    if (!xf)
        return KV__TCP_OK; /* ended already (timed out, cancelled) */
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
        if (s == KV_ERR_CORRUPT && v != KV_ERR_CORRUPT)
            snprintf(why, sizeof(why),
                     "peer %" PRIu64 " refused %s%u of transfer %" PRIu64 " with status %" PRId64
                     ", which is not a kv_status",
                     tp->p->id, note ? "the notification" : "entry ", note ? 0u : f->entry, f->xfer,
                     v);
        else
            snprintf(why, sizeof(why),
                     "peer %" PRIu64 " refused %s%u of transfer %" PRIu64 ": %s%s", tp->p->id,
                     note ? "the notification" : "entry ", note ? 0u : f->entry, f->xfer,
                     kv_status_name(s),
                     s == KV_ERR_CAPACITY && note ? " (its queue of notifications not yet polled "
                                                    "is full: max_pending_notes)"
                     : s == KV_ERR_CAPACITY       ? " (its reads being served are at "
                                                    "max_pending_reads)"
                                                  : "");
        if (note)
            kv__xport_note_refused(xf, s, why);
        else
            kv__xport_entry_fail(xf, f->entry, s, "%s", why);
    }
    kv__tcp_settle_all(tp);
    return KV__TCP_OK;
}

/* mu held: a header arrived (decoded into c->f): set up its payload. */
static struct kv__tcp_verdict on_header(struct kv__tcp *t, struct kv__tcp_conn *c)
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
        return KV__TCP_OK;
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
            return KV__TCP_OK;
        }
        c->ph = RX_SMALL;
        return KV__TCP_OK;
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
        return KV__TCP_OK;
    case KV__XF_RDATA: {
        kv_xport_xfer *xf = kv__xport_xfer_find(tp->p, f->xfer);
        if (!xf || xf->cancel_req) { /* ended or ending: nothing more lands */
            c->ph = RX_DISCARD;
            return KV__TCP_OK;
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
        return KV__TCP_OK;
    }
    case KV__XF_ACK:
        if (f->entry != KV__XF_ENTRY_NOTE) { /* a WRITE's: one record per piece */
            if (f->entry == 0 || f->entry > KV__TCP_MAXV ||
                f->length != (uint64_t)f->entry * KV__TCP_ACK_REC)
                return bad(KV_ERR_CORRUPT, "xport tcp: an ACK of %u pieces in %" PRIu64 " bytes",
                           f->entry, f->length);
            c->ph = RX_SMALL;
            return KV__TCP_OK;
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
        return KV__TCP_OK;
    case KV__XF_BYE:
        if (f->length)
            return bad(KV_ERR_CORRUPT, "xport tcp: a BYE with payload");
        return bad(KV_OK, "closed by the peer");
    }
    return bad(KV_ERR_CORRUPT, "xport tcp: frame type %u", (unsigned)f->type);
}

/* mu held: a READ's payload (its length) arrived: queue the read on c, or
 * NACK it (not inside a region exposed to the peer; max_pending_reads). */
static struct kv__tcp_verdict serve_read(struct kv__tcp *t, struct kv__tcp_conn *c)
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
        return kv__tcp_ctl_put(c, n, NULL, 0) ? KV__TCP_OK
                                              : bad(KV_ERR_NO_MEMORY, "xport tcp: control buffer");
    }
    struct kv__tcp_serve *s = kv__mem_calloc(1, sizeof(*s));
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
    return KV__TCP_OK;
}

/* mu held: a WRITE's descriptor table arrived (c->small): check it whole,
 * then say where each piece lands (NULL: not inside a region exposed to
 * this peer: dropped, refused in the ACK). */
static struct kv__tcp_verdict on_desc(struct kv__tcp_conn *c)
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
    for (uint32_t i = 0; i < k; i++) {
        const unsigned char *d = c->small + (size_t)i * KV__TCP_DESC;
        const uint32_t region = (uint32_t)kv__le_get(d + 4, 4);
        const uint64_t off = kv__le_get(d + 8, 8), len = kv__le_get(d + 16, 8);
        struct kv__xport_expo *e = kv__xport_exposed(c->tp->p, region, off, len);
        c->rx_entry[i] = (uint32_t)kv__le_get(d, 4);
        c->rx_len[i] = len;
        c->rx_expo[i] = e;
        c->rx_dst[i] = e ? e->mem->base + off : NULL;
        if (e)
            e->busy++;
    }
    c->rx_k = k;
    c->rx_p = 0;
    c->rx_pgot = 0;
    kv__xxh3_reset(&c->hs);
    c->ph = RX_PIECES;
    return KV__TCP_OK;
}

/* mu held: every piece of a WRITE arrived: one ACK with a record per
 * piece {entry, status, bytes}: KV_OK, KV_ERR_OUT_OF_BOUNDS (refused,
 * not written) or KV_ERR_CORRUPT (the data failed its checksum). */
static struct kv__tcp_verdict on_pieces(struct kv__tcp_conn *c, bool sum_ok)
{
    unsigned char rec[KV__TCP_MAXV * KV__TCP_ACK_REC];
    for (uint32_t i = 0; i < c->rx_k; i++) {
        const kv_status st = !c->rx_dst[i] ? KV_ERR_OUT_OF_BOUNDS : sum_ok ? KV_OK : KV_ERR_CORRUPT;
        unsigned char *r = rec + KV__TCP_ACK_REC * i;
        kv__le_put(r, c->rx_entry[i], 4);
        kv__le_put(r + 4, (uint32_t)(int32_t)st, 4);
        kv__le_put(r + 8, c->rx_len[i], 8);
    }
    struct kv__xf a = {.type = KV__XF_ACK, .xfer = c->f.xfer, .entry = c->rx_k};
    c->rx_k = 0;
    return kv__tcp_ctl_put(c, a, rec, KV__TCP_ACK_REC * a.entry)
               ? KV__TCP_OK
               : bad(KV_ERR_NO_MEMORY, "xport tcp: control buffer");
}

/* mu held: the ACK of one of our WRITEs (c->small: a record per piece). */
static struct kv__tcp_verdict on_acks(struct kv__tcp_conn *c)
{
    struct kv__tcp_peer *tp = c->tp;
    kv_xport_xfer *xf = kv__xport_xfer_find(tp->p, c->f.xfer);
    if (!xf)
        return KV__TCP_OK; /* ended already (timed out, cancelled) */
    for (uint32_t i = 0; i < c->f.entry; i++) {
        const unsigned char *r = c->small + KV__TCP_ACK_REC * i;
        const uint32_t e = (uint32_t)kv__le_get(r, 4);
        const int32_t v = (int32_t)(uint32_t)kv__le_get(r + 4, 4);
        const uint64_t bytes = kv__le_get(r + 8, 8);
        if (e >= xf->n || xf->read)
            return bad(KV_ERR_CORRUPT, "xport tcp: an ACK of entry %u of transfer %" PRIu64, e,
                       xf->id);
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
        if (bytes == 0 || bytes > xf->ios[e].bytes - xf->moved[e])
            return bad(KV_ERR_CORRUPT,
                       "xport tcp: an ACK of %" PRIu64 " bytes of entry %u, %" PRIu64
                       " outstanding",
                       bytes, e, xf->ios[e].bytes - xf->moved[e]);
        xf->moved[e] += bytes;
        if (xf->moved[e] == xf->ios[e].bytes)
            kv__xport_entry_end(xf, e, KV_OK);
    }
    if (!kv__tcp_notes_flush(tp))
        return bad(KV_ERR_NO_MEMORY, "xport tcp: control buffer");
    kv__tcp_settle_all(tp);
    return KV__TCP_OK;
}

/* mu held: the payload of c->f is complete. */
static struct kv__tcp_verdict on_payload(struct kv__tcp *t, struct kv__tcp_conn *c)
{
    const struct kv__xf *f = &c->f;
    struct kv__tcp_peer *tp = c->tp;
    const bool sum_ok = f->length == 0 || kv__xxh3_digest(&c->hs) == f->payload_sum;
    switch (c->ph) {
    case RX_SMALL:
        if (!sum_ok)
            return bad(KV_ERR_CORRUPT, "xport tcp: frame type %u fails its payload checksum",
                       (unsigned)f->type);
        if (f->type == KV__XF_NOTIFY) {
            if (kv__xport_note_push(tp->p, f->offset, c->small, (uint32_t)f->length) != KV_OK)
                return bad(KV_ERR_NO_MEMORY, "xport tcp: %s", kv_last_error());
            struct kv__xf a = {.type = KV__XF_ACK, .xfer = f->xfer, .entry = KV__XF_ENTRY_NOTE};
            if (!kv__tcp_ctl_put(c, a, NULL, 0))
                return bad(KV_ERR_NO_MEMORY, "xport tcp: control buffer");
            return KV__TCP_OK;
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
        kv__tcp_settle_all(tp);
        return KV__TCP_OK;
    }
    case RX_PIECES:
        return on_pieces(c, sum_ok);
    case RX_DESC:
    case RX_DISCARD:
    case RX_HDR:
        break;
    }
    return KV__TCP_OK;
}

/* Whether [a, a + n) and [b, b + m) overlap. */
static bool overlaps(const char *a, uint64_t n, const char *b, uint64_t m)
{
    return a < b + m && b < a + n;
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
        const uint64_t rest = c->rx_len[c->rx_p] - c->rx_pgot;
        if (!c->rx_dst[c->rx_p]) {
            iov[0] = (struct iovec){t->scratch,
                                    rest < sizeof(t->scratch) ? (size_t)rest : sizeof(t->scratch)};
            return 1;
        }
        int n = 0;
        iov[n++] = (struct iovec){c->rx_dst[c->rx_p] + c->rx_pgot, (size_t)rest};
        for (uint32_t p = c->rx_p + 1; p < c->rx_k && c->rx_dst[p]; p++) {
            bool clash = false;
            for (int k = 0; k < n && !clash; k++)
                clash = overlaps(iov[k].iov_base, iov[k].iov_len, c->rx_dst[p], c->rx_len[p]);
            if (clash)
                break;
            iov[n++] = (struct iovec){c->rx_dst[p], (size_t)c->rx_len[p]};
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

struct kv__tcp_verdict kv__tcp_conn_rx(struct kv__tcp *t, struct kv__tcp_conn *c)
{
    kv_xport *x = t->x;
    uint64_t budget = KV__TCP_RX_BUDGET;
    uint32_t frames = 0;
    while (budget && frames < x->cfg.frames_per_round && kv__tcp_rx_wanted(c)) {
        struct iovec iov[KV__TCP_MAXV];
        const int niov = rx_iov(t, c, iov);
        ssize_t r = 0;
        if (iov[0].iov_len) {
            /* The lock is dropped around recvmsg and the hashing of what it
             * returned: the destination is held (a busy exposure, a busy
             * read) and only this thread touches c's receive side. */
            const bool hash = c->ph != RX_HDR && c->ph != RX_DISCARD;
            struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)niov};
            pthread_mutex_unlock(&x->mu);
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
                    return KV__TCP_OK;
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
            struct kv__tcp_verdict v = on_header(t, c);
            if (!kv__tcp_ok(&v))
                return v;
            if (c->ph != RX_HDR && c->f.length)
                continue;
            if (c->ph == RX_HDR) { /* a frame without payload, handled */
                c->rx_since_ns = 0;
                frames++;
                continue;
            }
        } else if (c->ph == RX_PIECES) {
            /* Account what landed, piece by piece; a finished piece is no
             * longer busy (unexpose may proceed). */
            size_t n = (size_t)r;
            for (int k = 0; k < niov && n; k++) {
                const size_t take = n < iov[k].iov_len ? n : iov[k].iov_len;
                n -= take;
                c->rx_pgot += take;
                if (c->rx_pgot == c->rx_len[c->rx_p]) {
                    if (c->rx_expo[c->rx_p]) {
                        c->rx_expo[c->rx_p]->busy--;
                        c->rx_expo[c->rx_p] = NULL;
                        pthread_cond_broadcast(&x->cv);
                    }
                    c->rx_p++;
                    c->rx_pgot = 0;
                }
            }
            c->got += (uint64_t)r;
            if (c->rx_p < c->rx_k)
                continue;
        } else {
            c->got += (uint64_t)r;
            if (c->got < (c->ph == RX_DESC ? (uint64_t)c->f.entry * KV__TCP_DESC : c->f.length))
                continue;
            if (c->ph == RX_DESC) {
                struct kv__tcp_verdict v = on_desc(c);
                if (!kv__tcp_ok(&v))
                    return v;
                continue;
            }
        }
        struct kv__tcp_verdict v = on_payload(t, c);
        c->ph = RX_HDR;
        c->rx_since_ns = 0;
        frames++;
        if (!kv__tcp_ok(&v))
            return v;
    }
    return KV__TCP_OK;
}
