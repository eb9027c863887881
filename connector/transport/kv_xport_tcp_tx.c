/*
 * kv_xport_tcp_tx.c - the TCP backend's sending side (kv_xport_tcp_int.h):
 * the control stream, the send scheduler that cuts data frames from the
 * peer's transfers and from the reads it asked of us, and the send loop.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "kv_mem.h"
#include "kv_xport_tcp_int.h"

void kv__tcp_wake(struct kv__tcp *t)
{
    kv__xport_wake_pipe(t->wake[1]);
}

/* ---- the control stream --------------------------------------------- */

size_t kv__tcp_ctl_pending(const struct kv__tcp_conn *c)
{
    return c->ctl_len - c->ctl_off;
}

bool kv__tcp_tx_pending(const struct kv__tcp_conn *c)
{
    return c->df_on || c->ctl_off < c->ctl_len;
}

/* c is about to have something to send: a stall is timed from now if it
 * had nothing before. */
static void tx_touch(struct kv__tcp_conn *c)
{
    if (!kv__tcp_tx_pending(c))
        c->tx_since_ns = kv__now_ns();
}

static bool ctl_reserve(struct kv__tcp_conn *c, size_t more)
{
    if (c->ctl_off && c->ctl_off == c->ctl_len)
        c->ctl_off = c->ctl_len = 0;
    if (c->ctl_off > c->ctl_cap / 2) { /* slide the unsent rest down */
        memmove(c->ctl, c->ctl + c->ctl_off, c->ctl_len - c->ctl_off);
        c->ctl_len -= c->ctl_off;
        c->ctl_off = 0;
    }
    unsigned char *b = kv__mem_grow(c->ctl, &c->ctl_cap, c->ctl_len, c->ctl_len + more, 1, 4096);
    if (!b)
        return false;
    c->ctl = b;
    return true;
}

bool kv__tcp_ctl_put(struct kv__tcp_conn *c, struct kv__xf f, const void *p, uint32_t len)
{
    if (!ctl_reserve(c, KV__XF_BYTES + len))
        return false;
    tx_touch(c);
    f.version = KV_XPORT_PROTOCOL_VERSION;
    f.flags = 0;
    f.conn = c->index;
    f.length = len;
    f.payload_sum = len ? kv__xxh3_64(p, len) : 0;
    kv__xf_encode(&f, c->ctl + c->ctl_len);
    if (len)
        memcpy(c->ctl + c->ctl_len + KV__XF_BYTES, p, len);
    c->ctl_len += KV__XF_BYTES + len;
    return true;
}

bool kv__tcp_put_hello(struct kv__tcp *t, struct kv__tcp_conn *c, kv_xport_peer *p, uint32_t conns)
{
    unsigned char b[KV__XPORT_HELLO_BYTES];
    const struct kv__xport_hello h = {.version = KV_XPORT_PROTOCOL_VERSION,
                                      .kind = (uint32_t)t->x->cfg.kind,
                                      .token = t->x->cfg.token,
                                      .fingerprint = t->x->cfg.fingerprint,
                                      .nonce = p->nonce_local,
                                      .echo = p->nonce_remote,
                                      .conns = conns,
                                      .conn = c->index};
    kv__xport_hello_encode(&h, b);
    return kv__tcp_ctl_put(c, (struct kv__xf){.type = KV__XF_HELLO}, b, sizeof(b));
}

bool kv__tcp_put_refuse(struct kv__tcp_conn *c, kv_status st, const char *why)
{
    const size_t n = strlen(why);
    return kv__tcp_ctl_put(c,
                           (struct kv__xf){.type = KV__XF_REFUSE, .offset = (uint64_t)(int64_t)st},
                           why, (uint32_t)(n < 200 ? n : 200));
}

bool kv__tcp_notes_flush(struct kv__tcp_peer *tp)
{
    for (kv_xport_xfer *xf = kv__xport_note_next(tp->p->xfers); xf;
         xf = kv__xport_note_next(xf->next)) {
        struct kv__tcp_conn *c = tp->conns[0];
        struct kv__xf f = {.type = KV__XF_NOTIFY, .xfer = xf->id, .offset = xf->note_tag};
        if (!kv__tcp_ctl_put(c, f, xf->note, xf->note_len))
            return false;
        xf->note_sent = true;
    }
    return true;
}

/* ---- reads we serve ------------------------------------------------- */

/* Remove s from c's queue and release it; NACK its entry when `nack`. */
static void serve_end(struct kv__tcp_peer *tp, struct kv__tcp_conn *c, struct kv__xport_serve *s,
                      bool nack)
{
    if (nack) {
        struct kv__xf n = {.type = KV__XF_NACK,
                           .xfer = s->xfer,
                           .entry = s->entry,
                           .offset = (uint64_t)(int64_t)KV_ERR_OUT_OF_BOUNDS};
        (void)kv__tcp_ctl_put(c, n, NULL, 0); /* out of memory: the requester times out */
    }
    kv__xport_serve_end(&c->srv_head, &c->srv_tail, s, &tp->n_serves);
    pthread_cond_broadcast(&tp->p->x->cv);
}

void kv__tcp_serve_drop(struct kv__tcp_peer *tp, struct kv__tcp_conn *c)
{
    while (c->srv_head)
        serve_end(tp, c, c->srv_head, false);
}

void kv__tcp_serve_unexpose(struct kv__tcp_peer *tp, const struct kv__xport_expo *e)
{
    for (uint32_t i = 0; i < tp->n_conns; i++) {
        struct kv__tcp_conn *c = tp->conns[i];
        if (!c)
            continue;
        for (struct kv__xport_serve *s = c->srv_head, *nx; s; s = nx) {
            nx = s->next;
            if (s->expo != e)
                continue;
            if (s == c->df_srv) { /* its frame is on the wire: the rest is refused */
                s->refused = s->sent < s->len;
                s->len = s->sent;
            } else {
                serve_end(tp, c, s, true);
            }
        }
    }
}

/* ---- data frames ---------------------------------------------------- */

/* mu held: c's data frame from a header and df_nsrc ranges (df_src/df_len);
 * its payload is hashed and the header encoded by conn_tx, mu dropped. */
static void frame_start(struct kv__tcp_conn *c, const struct kv__xf *f, uint32_t desc_bytes)
{
    uint64_t data = 0;
    for (uint32_t i = 0; i < c->df_nsrc; i++)
        data += c->df_len[i];
    tx_touch(c);
    c->df_f = *f;
    c->df_f.version = KV_XPORT_PROTOCOL_VERSION;
    c->df_f.conn = c->index;
    c->df_f.length = desc_bytes + data;
    c->df_desc_bytes = desc_bytes;
    c->df_total = KV__XF_BYTES + desc_bytes + data;
    c->df_sent = 0;
    c->df_on = true;
    c->df_ready = false;
}

/* Read entries of xf requested and not yet ended. */
static uint64_t reads_out(const kv_xport_xfer *xf)
{
    return xf->be_entry - (uint64_t)(xf->n - xf->left);
}

/* mu held: whether xf has something to send now: a write with bytes left,
 * or a read with entries to request within the window of
 * max_pending_reads requests outstanding to the peer (`out`: those
 * outstanding of every read transfer up to xf, its own included). */
static bool xfer_sendable(const kv_xport_xfer *xf, uint64_t out, uint32_t window)
{
    if (xf->cancel_req || xf->be_entry >= xf->n || !xf->left)
        return false; /* every entry ended (one refused): nothing more to send */
    return !xf->read || out < window;
}

bool kv__tcp_has_work(const struct kv__tcp *t, const struct kv__tcp_peer *tp)
{
    uint64_t out = 0;
    for (const kv_xport_xfer *xf = tp->p->xfers; xf; xf = xf->next) {
        out += xf->read ? reads_out(xf) : 0;
        if (xfer_sendable(xf, out, t->x->cfg.max_pending_reads))
            return true;
    }
    return false;
}

/* mu held: the pieces of a WRITE frame of gathered transfer xf into a
 * descriptor table (desc) and source ranges (src/len, *nsrc of them), from
 * the send cursor on: up to KV__TCP_MAXV pieces, KV__TCP_CHUNK bytes
 * (*bytes) and KV__TCP_MAXSRC source ranges. A piece is one destination
 * range (part of an entry), its payload read from the entry's segments in
 * order. */
static uint32_t gather_pieces(kv_xport_xfer *xf, unsigned char *desc, const char **src,
                              uint64_t *len_out, uint32_t *nsrc, uint64_t *bytes)
{
    uint32_t k = 0, ns = 0;
    uint64_t b = 0;
    while (k < KV__TCP_MAXV && b < KV__TCP_CHUNK && ns < KV__TCP_MAXSRC && xf->be_entry < xf->n) {
        const uint32_t e = (uint32_t)xf->be_entry;
        const struct kv_xport_io *io = &xf->ios[e];
        const uint64_t at = xf->be_off;
        kv__xport_cursor_gather(xf, io, KV__TCP_CHUNK, KV__TCP_MAXSRC, src, len_out, &ns, &b);
        unsigned char *d = desc + (size_t)k * KV__TCP_DESC;
        kv__le_put(d, e, 4);
        kv__le_put(d + 4, io->remote->region, 4);
        kv__le_put(d + 8, io->remote_off + at, 8);
        kv__le_put(d + 16, xf->be_off - at, 8);
        k++;
        if (xf->be_off == io->bytes) {
            xf->be_entry++;
            xf->be_off = 0;
        }
    }
    *nsrc = ns;
    *bytes = b;
    return k;
}

/* mu held: the pieces of a WRITE frame of plain transfer xf from its send
 * cursor on (up to KV__TCP_MAXV pieces and KV__TCP_CHUNK bytes, an entry
 * split where it is larger): descriptors into desc, source ranges into
 * src/len; returns the piece count. */
static uint32_t cut_plain(kv_xport_xfer *xf, unsigned char *desc, const char **src,
                          uint64_t *len_out)
{
    uint32_t k = 0;
    uint64_t bytes = 0;
    while (k < KV__TCP_MAXV && bytes < KV__TCP_CHUNK && xf->be_entry < xf->n) {
        const uint32_t e = (uint32_t)xf->be_entry;
        const struct kv_xport_io *io = &xf->ios[e];
        const uint64_t rest = io->bytes - xf->be_off;
        const uint64_t len = rest < KV__TCP_CHUNK - bytes ? rest : KV__TCP_CHUNK - bytes;
        unsigned char *d = desc + (size_t)k * KV__TCP_DESC;
        kv__le_put(d, e, 4);
        kv__le_put(d + 4, io->remote->region, 4);
        kv__le_put(d + 8, io->remote_off + xf->be_off, 8);
        kv__le_put(d + 16, len, 8);
        src[k] = io->local->base + io->local_off + xf->be_off;
        len_out[k] = len;
        k++;
        bytes += len;
        xf->be_off += len;
        if (xf->be_off == io->bytes) {
            xf->be_entry++;
            xf->be_off = 0;
        }
    }
    return k;
}

/* mu held: the next data frame for c, or false when there is none: the
 * reads c serves first (they came on c), then the peer's writes in post
 * order; the READ requests of its reads (control frames, round robin over
 * the connections, at most max_pending_reads outstanding) on the way. A
 * WRITE gathers up to KV__TCP_MAXV pieces and KV__TCP_CHUNK bytes of one
 * transfer's entries, split where an entry is larger. */
static bool next_frame(struct kv__tcp *t, struct kv__tcp_peer *tp, struct kv__tcp_conn *c)
{
    if (c->srv_head && c->srv_head->sent < c->srv_head->len) {
        struct kv__xport_serve *s = c->srv_head;
        const uint64_t len = s->len - s->sent < KV__TCP_CHUNK ? s->len - s->sent : KV__TCP_CHUNK;
        struct kv__xf f = {
            .type = KV__XF_RDATA, .entry = s->entry, .xfer = s->xfer, .offset = s->sent};
        c->df_k = c->df_nsrc = 1;
        c->df_pack = false;
        c->df_src[0] = s->expo->mem->base + s->off + s->sent;
        c->df_len[0] = len;
        c->df_srv = s;
        c->df_t = NULL;
        s->sent += len;
        frame_start(c, &f, 0);
        return true;
    }
    const uint32_t window = t->x->cfg.max_pending_reads;
    uint64_t out = 0;
    for (kv_xport_xfer *xf = tp->p->xfers; xf; xf = xf->next) {
        out += xf->read ? reads_out(xf) : 0;
        if (!xfer_sendable(xf, out, window))
            continue;
        if (xf->read) {
            /* READ requests while the window has room. */
            while (xf->be_entry < xf->n && out < window) {
                const uint32_t e = (uint32_t)xf->be_entry;
                const struct kv_xport_io *io = &xf->ios[e];
                struct kv__xf f = {.type = KV__XF_READ,
                                   .xfer = xf->id,
                                   .entry = e,
                                   .region = io->remote->region,
                                   .offset = io->remote_off};
                unsigned char len[8];
                kv__le_put(len, io->bytes, 8);
                if (!kv__tcp_ctl_put(tp->conns[e % tp->n_conns], f, len, sizeof(len)))
                    return false;
                xf->be_entry++;
                out++;
            }
            continue;
        }
        uint32_t k = 0;
        uint64_t bytes = 0;
        if (xf->seg && !c->stage && !(c->stage = kv__mem_alloc(KV__TCP_CHUNK))) {
            /* A frame of it on another connection (busy), or one sent and
             * not yet acknowledged, may still read the transfer's source or
             * land at the peer: it cannot end now (ending resets busy, and
             * the caller may then free it under that frame). The connection
             * that has a buffer goes on sending it; this one sits the
             * transfer out. */
            if (xf->busy || xf->unacked)
                continue;
            snprintf(xf->why, sizeof(xf->why),
                     "transfer %" PRIu64 ": no memory for a %u-byte staging buffer", xf->id,
                     KV__TCP_CHUNK);
            kv__xport_xfer_end(xf, KV_XPORT_FAILED, KV_ERR_NO_MEMORY);
            return false; /* the peer's list changed: the next round looks again */
        }
        if (xf->seg)
            k = gather_pieces(xf, c->df_desc, c->df_src, c->df_len, &c->df_nsrc, &bytes);
        else
            k = cut_plain(xf, c->df_desc, c->df_src, c->df_len);
        struct kv__xf f = {.type = KV__XF_WRITE,
                           .entry = k,
                           .xfer = xf->id,
                           .offset = kv__xxh3_64(c->df_desc, (size_t)k * KV__TCP_DESC)};
        c->df_k = k;
        c->df_nsrc = xf->seg ? c->df_nsrc : k;
        c->df_pack = xf->seg && c->df_nsrc > k; /* one range per piece: sent in place */
        c->df_t = xf;
        c->df_srv = NULL;
        xf->busy++;
        frame_start(c, &f, k * KV__TCP_DESC);
        return true;
    }
    return false;
}

/* mu held, c's data frame ready and the verify thread running: cut c's
 * next frame now if it is a WRITE (what next_frame would cut next: no
 * read of ours to serve on c, the first sendable transfer a write) and
 * hand its hash to the verify thread, so it is hashed while df goes out.
 * A plain frame (or a gathered one whose pieces are one range each) is
 * hashed in place, not when its source bytes are being received into (the
 * hash would race with the landing bytes); a gathered frame of more ranges
 * is packed into nx_stage by the verify thread and hashed there, so the
 * progress thread only sends (the bytes sent are the bytes hashed). */
static void next_ahead(struct kv__tcp *t, struct kv__tcp_peer *tp, struct kv__tcp_conn *c)
{
    if (c->srv_head && (c->srv_head != c->df_srv || c->srv_head->sent < c->srv_head->len ||
                        c->srv_head->next))
        return;
    const uint32_t window = t->x->cfg.max_pending_reads;
    uint64_t out = 0;
    kv_xport_xfer *xf = tp->p->xfers;
    for (; xf; xf = xf->next) {
        out += xf->read ? reads_out(xf) : 0;
        if (xfer_sendable(xf, out, window))
            break;
    }
    if (!xf || xf->read)
        return;
    if (xf->seg && !c->nx_stage && !(c->nx_stage = kv__mem_alloc(KV__TCP_CHUNK)))
        return; /* no second buffer: next_frame packs it inline, as before */
    struct kv__tcp_vjob *j = &c->txj;
    /* the cut, undone if its bytes are being received into */
    const uint64_t e0 = xf->be_entry, o0 = xf->be_off;
    const uint64_t g0 = xf->be_seg, r0 = xf->be_rep, so0 = xf->be_seg_off;
    uint32_t k;
    j->pack = false;
    if (xf->seg) {
        uint64_t bytes = 0;
        k = gather_pieces(xf, c->nx_desc, c->nx_src, c->nx_len, &c->nx_nsrc, &bytes);
        if (c->nx_nsrc > k) { /* packed: nothing of it is read in place */
            j->pack = true;
            j->pn = c->nx_nsrc;
            j->psrc = c->nx_src;
            j->plen = c->nx_len;
            j->pstage = c->nx_stage;
            j->pbytes = 0;
        } else { /* one range per piece: sent in place, as a plain frame is */
            for (uint32_t i = 0; i < k; i++) {
                j->dst[i] = (char *)c->nx_src[i];
                j->len[i] = c->nx_len[i];
            }
        }
    } else {
        k = cut_plain(xf, c->nx_desc, (const char **)j->dst, j->len);
    }
    j->k = k;
    j->lo = j->hi = NULL;
    for (uint32_t i = 0; i < k && !j->pack; i++) {
        j->lo = !j->lo || j->dst[i] < j->lo ? j->dst[i] : j->lo;
        j->hi = !j->hi || j->dst[i] + j->len[i] > j->hi ? j->dst[i] + j->len[i] : j->hi;
    }
    if (!j->pack) {
        if (kv__tcp_rx_covers(t, j)) {
            xf->be_entry = e0;
            xf->be_off = o0;
            xf->be_seg = g0;
            xf->be_rep = r0;
            xf->be_seg_off = so0;
            return;
        }
    } else {
        for (uint32_t i = 0; i < k; i++)
            j->dst[i] = NULL; /* lands nowhere: no receive waits for it */
    }
    j->c = c;
    j->tx = true;
    c->nx_f = (struct kv__xf){.type = KV__XF_WRITE,
                              .entry = k,
                              .xfer = xf->id,
                              .offset = kv__xxh3_64(c->nx_desc, (size_t)k * KV__TCP_DESC)};
    c->nx_t = xf;
    c->nx_on = true;
    xf->busy++;
    kv__tcp_vq_push(t, j);
}

uint64_t kv__tcp_pack(char *stage, const char *const *src, const uint64_t *len, uint32_t n)
{
    uint64_t at = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (i + 8 < n) /* strided sources: ask for them ahead */
            for (uint64_t o = 0; o < len[i + 8] && o < 512; o += 64)
                __builtin_prefetch(src[i + 8] + o);
        memcpy(stage + at, src[i], (size_t)len[i]);
        at += len[i];
    }
    return at;
}

/* mu held, no data frame on c: the frame cut ahead becomes c's data frame
 * (its hash done: ready to go), or is dropped if its transfer is being
 * cancelled. */
static void next_promote(struct kv__tcp_conn *c)
{
    struct kv__tcp_vjob *j = &c->txj;
    c->nx_on = false;
    j->st = VJ_FREE;
    if (c->nx_t->cancel_req) {
        c->nx_t->busy--;
        j->pack = false;
        return;
    }
    const uint32_t k = j->k;
    memcpy(c->df_desc, c->nx_desc, (size_t)k * KV__TCP_DESC);
    if (j->pack) {
        /* sent from the buffer it was packed into; the other one (df's,
         * whose frame is out) takes the next frame packed ahead */
        char *s = c->stage;
        c->stage = c->nx_stage;
        c->nx_stage = s;
        c->df_src[0] = c->stage;
        c->df_len[0] = j->pbytes;
        c->df_nsrc = 1;
        j->pack = false;
    } else {
        for (uint32_t i = 0; i < k; i++) {
            c->df_src[i] = j->dst[i];
            c->df_len[i] = j->len[i];
        }
        c->df_nsrc = k;
    }
    c->df_k = k;
    c->df_pack = false;
    c->df_t = c->nx_t;
    c->df_srv = NULL;
    frame_start(c, &c->nx_f, k * KV__TCP_DESC);
    c->df_f.payload_sum = j->want;
    kv__xf_encode(&c->df_f, c->df_hdr);
    c->df_ready = true;
}

bool kv__tcp_tx_nx_ready(const struct kv__tcp_conn *c)
{
    return !c->df_on && c->nx_on && c->txj.st == VJ_DONE;
}

/* mu held: c's data frame is on the wire whole. */
static void frame_done(struct kv__tcp_conn *c)
{
    c->df_on = false;
    if (c->df_t) { /* its bytes are the peer's now, landing until it ACKs the frame */
        c->df_t->busy--;
        c->df_t->unacked++;
        c->df_t = NULL;
    }
    struct kv__xport_serve *s = c->df_srv;
    c->df_srv = NULL;
    if (s && s->sent == s->len)
        serve_end(c->tp, c, s, s->refused);
}

/* The unsent rest of c's data frame as iovecs (at most 2 + MAXSRC). */
static int frame_iov(const struct kv__tcp_conn *c, struct iovec *iov)
{
    int k = 0;
    uint64_t skip = c->df_sent;
    const void *part[2] = {c->df_hdr, c->df_desc};
    const uint64_t plen[2] = {KV__XF_BYTES, c->df_desc_bytes};
    for (int i = 0; i < 2; i++) {
        if (skip >= plen[i]) {
            skip -= plen[i];
            continue;
        }
        iov[k++] = (struct iovec){(char *)part[i] + skip, (size_t)(plen[i] - skip)};
        skip = 0;
    }
    for (uint32_t i = 0; i < c->df_nsrc; i++) {
        if (skip >= c->df_len[i]) {
            skip -= c->df_len[i];
            continue;
        }
        iov[k++] = (struct iovec){(char *)c->df_src[i] + skip, (size_t)(c->df_len[i] - skip)};
        skip = 0;
    }
    return k;
}

struct kv__xport_verdict kv__tcp_conn_tx(struct kv__tcp *t, struct kv__tcp_conn *c)
{
    kv_xport *x = t->x;
    for (;;) {
        if (!c->df_on && c->nx_on) {
            /* the frame cut ahead, its hash not started by the verify
             * thread (busy, or not scheduled on a loaded machine): hash it
             * here rather than leave the connection idle */
            if (c->txj.st == VJ_QUEUED)
                kv__tcp_vj_hash_now(t, &c->txj);
            if (c->txj.st != VJ_DONE) { /* being hashed: its wake-up */
                if (c->ctl_off == c->ctl_len)
                    return KV__XPORT_OK;
            } else {
                next_promote(c);
                continue;
            }
        }
        const bool ctl = c->ctl_off < c->ctl_len;
        if (!c->df_on && !c->nx_on && !ctl && (!c->tp || !c->up || !next_frame(t, c->tp, c)) &&
            c->ctl_off == c->ctl_len)
            return KV__XPORT_OK;
        ssize_t r;
        int e = 0;
        if (c->ctl_off < c->ctl_len && (!c->df_on || c->df_sent == 0)) {
            const unsigned char *p = c->ctl + c->ctl_off;
            const size_t n = c->ctl_len - c->ctl_off;
            kv__tcp_unlock(t);
            r = send(c->fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
            e = errno;
            pthread_mutex_lock(&x->mu);
            if (r > 0)
                c->ctl_off += (size_t)r;
        } else {
            if (!c->df_ready) {
                /* The payload's hash, with the lock dropped: the memory is
                 * held (a busy transfer, a busy exposure) until frame_done. */
                struct kv__xf f = c->df_f;
                const uint32_t k = c->df_nsrc;
                kv__tcp_unlock(t);
                if (c->df_pack) {
                    /* a gathered frame: its source ranges packed, in
                     * order, into the connection's staging buffer (<= one
                     * chunk), hashed and sent from there as one range */
                    const uint64_t at = kv__tcp_pack(c->stage, c->df_src, c->df_len, k);
                    f.payload_sum = kv__xxh3_64(c->stage, (size_t)at);
                } else {
                    struct kv__xxh3_state hs;
                    kv__xxh3_reset(&hs);
                    for (uint32_t i = 0; i < k; i++)
                        kv__xxh3_update(&hs, c->df_src[i], (size_t)c->df_len[i]);
                    f.payload_sum = kv__xxh3_digest(&hs);
                }
                kv__xf_encode(&f, c->df_hdr);
                pthread_mutex_lock(&x->mu);
                c->df_ready = true;
                if (c->df_pack) {
                    uint64_t at = 0;
                    for (uint32_t i = 0; i < c->df_nsrc; i++)
                        at += c->df_len[i];
                    c->df_src[0] = c->stage;
                    c->df_len[0] = at;
                    c->df_nsrc = 1;
                    c->df_pack = false;
                }
            }
            if (!c->nx_on && t->vthread && c->tp && c->up)
                next_ahead(t, c->tp, c);
            struct iovec iov[2 + KV__TCP_MAXSRC];
            struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)frame_iov(c, iov)};
            kv__tcp_unlock(t);
            r = sendmsg(c->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
            e = errno;
            pthread_mutex_lock(&x->mu);
            if (r > 0) {
                c->df_sent += (uint64_t)r;
                if (c->df_sent == c->df_total)
                    frame_done(c);
            }
        }
        if (r > 0)
            c->tx_since_ns = kv__now_ns();
        if (r < 0) {
            if (e == EAGAIN || e == EWOULDBLOCK || e == EINTR)
                return KV__XPORT_OK;
            return kv__xport_bad(KV_ERR_IO, "xport tcp: send: %s", strerror(e));
        }
    }
}
