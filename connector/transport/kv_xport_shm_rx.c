/*
 * kv_xport_shm_rx.c - the same-host backend's receive side
 * (kv_xport_shm_int.h): every control message a peer sends is checked
 * before anything is copied: the header (kv__shm_msg_decode), the slot and
 * lengths for its type, a DATA's descriptor table against the exposure
 * table, the transfer and entry an ACK, RNACK or RDATA names against what we
 * recorded, the limits of the generic layer (notifications queued, reads
 * served). A message that fails a check closes the peer (KV_ERR_CORRUPT or
 * KV_ERR_MISMATCH, the field named); a piece outside every exposure is
 * refused in its ACK record (KV_ERR_OUT_OF_BOUNDS) and not written; one
 * over a limit is refused (KV_ERR_CAPACITY). The shared memory is read only
 * as payload, copied out of a slot the message names. Fuzzed by
 * tests/fuzz/fuzz_xport_shm_rx.c.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "kv_mem.h"
#include "kv_wire.h"
#include "kv_xport_shm_int.h"

#define bad kv__xport_bad

static const unsigned char MAGIC[4] = {'K', 'V', 'S', 'M'};

void kv__shm_msg_encode(const struct kv__shm_msg *m, unsigned char out[KV__SHM_HDR])
{
    memcpy(out, MAGIC, 4);
    kv__le_put(out + 4, m->version, 2);
    kv__le_put(out + 6, m->type, 2);
    kv__le_put(out + 8, m->slot, 4);
    kv__le_put(out + 12, m->entry, 4);
    kv__le_put(out + 16, m->xfer, 8);
    kv__le_put(out + 24, m->region, 4);
    kv__le_put(out + 28, (uint32_t)m->status, 4);
    kv__le_put(out + 32, m->off, 8);
    kv__le_put(out + 40, m->len, 8);
    kv__le_put(out + 48, m->tag, 8);
    kv__le_put(out + 56, m->plen, 4);
    kv__le_put(out + 60, 0, 4);
}

kv_status kv__shm_msg_decode(const unsigned char *in, size_t n, struct kv__shm_msg *m)
{
    if (n < KV__SHM_HDR || n > KV__SHM_MSG_MAX)
        return kv__error(KV_ERR_CORRUPT, "xport shm: a message of %zu bytes (%u to %u)", n,
                         KV__SHM_HDR, KV__SHM_MSG_MAX);
    if (memcmp(in, MAGIC, 4) != 0)
        return kv__error(KV_ERR_CORRUPT, "xport shm: bad magic 0x%08" PRIx64, kv__le_get(in, 4));
    struct kv__shm_msg d = {
        .version = (uint16_t)kv__le_get(in + 4, 2),
        .type = (uint16_t)kv__le_get(in + 6, 2),
        .slot = (uint32_t)kv__le_get(in + 8, 4),
        .entry = (uint32_t)kv__le_get(in + 12, 4),
        .xfer = kv__le_get(in + 16, 8),
        .region = (uint32_t)kv__le_get(in + 24, 4),
        .status = (int32_t)(uint32_t)kv__le_get(in + 28, 4),
        .off = kv__le_get(in + 32, 8),
        .len = kv__le_get(in + 40, 8),
        .tag = kv__le_get(in + 48, 8),
        .plen = (uint32_t)kv__le_get(in + 56, 4),
    };
    if (d.version != KV_XPORT_PROTOCOL_VERSION)
        return kv__error(KV_ERR_MISMATCH, "xport shm: protocol version %u (here %u)",
                         (unsigned)d.version, KV_XPORT_PROTOCOL_VERSION);
    if (kv__le_get(in + 60, 4) != 0)
        return kv__error(KV_ERR_CORRUPT, "xport shm: reserved field 0x%08" PRIx64,
                         kv__le_get(in + 60, 4));
    if (d.type == 0 || d.type > KV__SM_TYPE_MAX)
        return kv__error(KV_ERR_CORRUPT, "xport shm: message type %u", (unsigned)d.type);
    if ((uint64_t)d.plen != n - KV__SHM_HDR)
        return kv__error(KV_ERR_CORRUPT,
                         "xport shm: message type %u says %u payload bytes, carries %zu",
                         (unsigned)d.type, d.plen, n - KV__SHM_HDR);
    *m = d;
    return KV_OK;
}

bool kv__shm_rx_wanted(const struct kv__shm_peer *tp)
{
    return tp->ctl_len - tp->ctl_off <= KV__SHM_CTL_HIGH;
}

/* ---- the handshake -------------------------------------------------- */

static struct kv__xport_verdict refuse(struct kv__shm_peer *tp, kv_status st, const char *why)
{
    const size_t n = strlen(why);
    (void)kv__shm_put(tp, (struct kv__shm_msg){.type = KV__SM_REFUSE, .status = st}, why,
                      (uint32_t)(n < 200 ? n : 200));
    return bad(st, "%s", why);
}

/* mu held: the HELLO of an incoming connection (with its memfd). */
static struct kv__xport_verdict hello_in(struct kv__shm *t, struct kv__shm_peer *tp,
                                         const struct kv__shm_msg *m, int fd)
{
    kv_xport *x = t->x;
    if (fd < 0)
        return bad(KV_ERR_CORRUPT, "xport shm handshake: a HELLO without its memfd");
    struct kv__xport_hello h;
    kv__xport_hello_decode(tp->rbuf + KV__SHM_HDR, &h);
    char why[160];
    if (kv__xport_hello_check(x, &h, why, sizeof(why)) != KV_OK) {
        close(fd);
        return refuse(tp, KV_ERR_MISMATCH, why);
    }
    if (h.echo != 0 || h.nonce == 0) {
        close(fd);
        return bad(KV_ERR_CORRUPT,
                   "xport shm handshake: an incoming HELLO that answers 0x%016" PRIx64, h.echo);
    }
    if (m->slot != KV__SHM_SLOTS || m->len != KV__SHM_SLOT) {
        close(fd);
        snprintf(why, sizeof(why),
                 "xport shm handshake: rings of %u slots of %" PRIu64 " bytes (here %u of %u)",
                 m->slot, m->len, KV__SHM_SLOTS, KV__SHM_SLOT);
        return refuse(tp, KV_ERR_MISMATCH, why);
    }
    struct kv__xport_verdict v = kv__shm_map(tp, fd, false);
    close(fd);
    if (!kv__xport_ok(&v))
        return refuse(tp, v.st, v.msg);
    kv_xport_peer *p = kv__xport_peer_new(x, false);
    if (!p)
        return bad(KV_ERR_NO_MEMORY, "xport shm accept: peer state");
    p->nonce_remote = h.nonce;
    p->ops = &kv__xport_shm_ops; /* AUTO: an SHM peer */
    p->be = tp;
    tp->p = p;
    v = kv__shm_hello(t, tp, -1);
    if (!kv__xport_ok(&v))
        return v;
    kv__xport_peer_ready(p);
    return KV__XPORT_OK;
}

/* mu held: the HELLO answering ours (m: its header). */
static struct kv__xport_verdict hello_out(struct kv__shm *t, struct kv__shm_peer *tp,
                                          const struct kv__shm_msg *m)
{
    struct kv__xport_hello h;
    kv__xport_hello_decode(tp->rbuf + KV__SHM_HDR, &h);
    char why[160];
    if (kv__xport_hello_check(t->x, &h, why, sizeof(why)) != KV_OK)
        return bad(KV_ERR_MISMATCH, "%s", why);
    if (h.echo != tp->p->nonce_local || h.nonce == 0)
        return bad(KV_ERR_CORRUPT, "xport shm handshake: a HELLO answering 0x%016" PRIx64, h.echo);
    if (tp->expect_secret && m->tag != tp->expect_secret)
        return bad(KV_ERR_MISMATCH,
                   "xport auto: the same-host proof failed: the socket the listener named "
                   "answered without the secret it gave over TCP (0x%016" PRIx64
                   "): not that listener, refused",
                   m->tag);
    tp->p->nonce_remote = h.nonce;
    kv__xport_peer_ready(tp->p);
    return KV__XPORT_OK;
}

/* ---- data ----------------------------------------------------------- */

/* mu held: a DATA: its pieces checked whole, copied from the peer's slot
 * into place where exposed (mu dropped: each exposure busy), one ACK
 * record per piece. */
static struct kv__xport_verdict on_data(struct kv__shm *t, struct kv__shm_peer *tp,
                                        const struct kv__shm_msg *m)
{
    const uint32_t k = m->entry;
    if (k == 0 || k > KV__SHM_MAXV || m->plen != k * KV__SHM_DESC || m->slot >= KV__SHM_SLOTS ||
        m->len == 0 || m->len > KV__SHM_SLOT)
        return bad(KV_ERR_CORRUPT,
                   "xport shm: a DATA of %u pieces, %u table bytes, %" PRIu64 " bytes in slot %u",
                   k, m->plen, m->len, m->slot);
    uint32_t entry[KV__SHM_MAXV];
    uint64_t len[KV__SHM_MAXV];
    char *dst[KV__SHM_MAXV];
    struct kv__xport_expo *ex[KV__SHM_MAXV];
    uint64_t sum = 0;
    for (uint32_t i = 0; i < k; i++) {
        const unsigned char *d = tp->rbuf + KV__SHM_HDR + (size_t)i * KV__SHM_DESC;
        len[i] = kv__le_get(d + 16, 8);
        if (len[i] == 0 || len[i] > m->len - sum)
            return bad(KV_ERR_CORRUPT, "xport shm: DATA piece %u of %" PRIu64 " bytes", i, len[i]);
        sum += len[i];
    }
    if (sum != m->len)
        return bad(KV_ERR_CORRUPT, "xport shm: DATA pieces of %" PRIu64 " bytes in %" PRIu64, sum,
                   m->len);
    for (uint32_t i = 0; i < k; i++) {
        const unsigned char *d = tp->rbuf + KV__SHM_HDR + (size_t)i * KV__SHM_DESC;
        const uint32_t region = (uint32_t)kv__le_get(d + 4, 4);
        const uint64_t off = kv__le_get(d + 8, 8);
        entry[i] = (uint32_t)kv__le_get(d, 4);
        ex[i] = kv__xport_exposed(tp->p, region, off, len[i]);
        dst[i] = ex[i] ? ex[i]->mem->base + off : NULL;
        if (ex[i])
            ex[i]->busy++;
    }
    const char *src = tp->rx + (uint64_t)m->slot * KV__SHM_SLOT;
    pthread_mutex_unlock(&t->x->mu);
    uint64_t at = 0;
    for (uint32_t i = 0; i < k; i++) {
        if (dst[i])
            memcpy(dst[i], src + at, (size_t)len[i]);
        at += len[i];
    }
    pthread_mutex_lock(&t->x->mu);
    tp->rx_copied += m->len;
    unsigned char rec[KV__SHM_MAXV * KV__SHM_REC];
    for (uint32_t i = 0; i < k; i++) {
        if (ex[i])
            ex[i]->busy--;
        unsigned char *r = rec + (size_t)i * KV__SHM_REC;
        kv__le_put(r, entry[i], 4);
        kv__le_put(r + 4, (uint32_t)(int32_t)(dst[i] ? KV_OK : KV_ERR_OUT_OF_BOUNDS), 4);
        kv__le_put(r + 8, len[i], 8);
    }
    kv__xport_signal(t->x);
    struct kv__shm_msg a = {.type = KV__SM_ACK, .slot = m->slot, .xfer = m->xfer, .entry = k};
    return kv__shm_put(tp, a, rec, k * KV__SHM_REC)
               ? KV__XPORT_OK
               : bad(KV_ERR_NO_MEMORY, "xport shm: control buffer");
}

/* mu held: the ACK of one of our DATAs: it must match what the slot holds. */
static struct kv__xport_verdict on_ack(struct kv__shm_peer *tp, const struct kv__shm_msg *m)
{
    struct kv__shm_slot *s = m->slot < KV__SHM_SLOTS ? &tp->slot[m->slot] : NULL;
    if (!s || !s->used || s->serve || s->xfer != m->xfer || s->k != m->entry ||
        m->plen != m->entry * KV__SHM_REC)
        return bad(KV_ERR_CORRUPT,
                   "xport shm: an ACK of slot %u (transfer %" PRIu64 ", %u records) that "
                   "holds no such DATA",
                   m->slot, m->xfer, m->entry);
    kv_status st[KV__SHM_MAXV];
    for (uint32_t i = 0; i < s->k; i++) {
        const unsigned char *r = tp->rbuf + KV__SHM_HDR + (size_t)i * KV__SHM_REC;
        const int32_t v = (int32_t)(uint32_t)kv__le_get(r + 4, 4);
        if ((uint32_t)kv__le_get(r, 4) != s->entry[i] || kv__le_get(r + 8, 8) != s->len[i])
            return bad(KV_ERR_CORRUPT,
                       "xport shm: ACK record %u of slot %u names entry %u (%" PRIu64
                       " bytes), the slot holds entry %u (%" PRIu64 ")",
                       i, m->slot, (uint32_t)kv__le_get(r, 4), kv__le_get(r + 8, 8), s->entry[i],
                       s->len[i]);
        st[i] = kv__xport_wire_status(v, true);
    }
    s->used = false;
    tp->n_used--;
    kv_xport_xfer *xf = kv__xport_xfer_find(tp->p, m->xfer);
    for (uint32_t i = 0; xf && i < s->k; i++) {
        const uint32_t e = s->entry[i];
        if (xf->ended[e])
            continue;
        if (st[i] != KV_OK) {
            kv__xport_entry_fail(xf, e, st[i],
                                 "peer %" PRIu64 " refused entry %u of transfer %" PRIu64 ": %s",
                                 tp->p->id, e, xf->id, kv_status_name(st[i]));
            continue;
        }
        xf->moved[e] += s->len[i];
        if (xf->moved[e] == xf->ios[e].bytes)
            kv__xport_entry_end(xf, e, KV_OK);
    }
    if (!kv__shm_notes_flush(tp))
        return bad(KV_ERR_NO_MEMORY, "xport shm: control buffer");
    kv__xport_settle_idle(tp->p);
    return KV__XPORT_OK;
}

/* mu held: a READ of our memory: queued, or refused by name. */
static struct kv__xport_verdict on_read(struct kv__shm *t, struct kv__shm_peer *tp,
                                        const struct kv__shm_msg *m)
{
    if (m->plen)
        return bad(KV_ERR_CORRUPT, "xport shm: a READ with %u payload bytes", m->plen);
    struct kv__xport_expo *e = m->len ? kv__xport_exposed(tp->p, m->region, m->off, m->len) : NULL;
    const bool full = tp->n_serves >= t->x->cfg.max_pending_reads;
    if (!e || full) {
        t->x->stats.reads_refused++;
        struct kv__shm_msg n = {.type = KV__SM_RNACK,
                                .xfer = m->xfer,
                                .entry = m->entry,
                                .status = full ? KV_ERR_CAPACITY : KV_ERR_OUT_OF_BOUNDS};
        return kv__shm_put(tp, n, NULL, 0) ? KV__XPORT_OK
                                           : bad(KV_ERR_NO_MEMORY, "xport shm: control buffer");
    }
    struct kv__xport_serve *s = kv__mem_calloc(1, sizeof(*s));
    if (!s)
        return bad(KV_ERR_NO_MEMORY, "xport shm: a read to serve");
    *s = (struct kv__xport_serve){
        .xfer = m->xfer, .entry = m->entry, .expo = e, .off = m->off, .len = m->len};
    e->busy++;
    tp->n_serves++;
    if (tp->srv_tail)
        tp->srv_tail->next = s;
    else
        tp->srv_head = s;
    tp->srv_tail = s;
    return KV__XPORT_OK;
}

/* mu held: read data for one of our reads, in the peer's slot: copied
 * into place (mu dropped, the transfer busy) if it is what we asked for
 * next; the slot returned either way. */
static struct kv__xport_verdict on_rdata(struct kv__shm *t, struct kv__shm_peer *tp,
                                         const struct kv__shm_msg *m)
{
    if (m->plen || m->slot >= KV__SHM_SLOTS || m->len == 0 || m->len > KV__SHM_SLOT)
        return bad(KV_ERR_CORRUPT,
                   "xport shm: an RDATA of %" PRIu64 " bytes in slot %u (%u payload bytes)", m->len,
                   m->slot, m->plen);
    kv_xport_xfer *xf = kv__xport_xfer_find(tp->p, m->xfer);
    if (xf && !xf->cancel_req) {
        if (!xf->read || m->entry >= xf->n || xf->ended[m->entry] ||
            m->off != xf->moved[m->entry] || m->len > xf->ios[m->entry].bytes - m->off)
            return bad(KV_ERR_CORRUPT,
                       "xport shm: read data for transfer %" PRIu64 " entry %u at %" PRIu64
                       " (+%" PRIu64 ") that was not asked for",
                       m->xfer, m->entry, m->off, m->len);
        const struct kv_xport_io *io = &xf->ios[m->entry];
        char *dst = io->local->base + io->local_off + m->off;
        const char *src = tp->rx + (uint64_t)m->slot * KV__SHM_SLOT;
        xf->busy++;
        pthread_mutex_unlock(&t->x->mu);
        memcpy(dst, src, (size_t)m->len);
        pthread_mutex_lock(&t->x->mu);
        xf->busy--;
        tp->rx_copied += m->len;
        xf->moved[m->entry] += m->len;
        if (xf->moved[m->entry] == io->bytes)
            kv__xport_entry_end(xf, m->entry, KV_OK);
        kv__xport_settle_idle(tp->p);
    }
    return kv__shm_put(tp, (struct kv__shm_msg){.type = KV__SM_FREE, .slot = m->slot}, NULL, 0)
               ? KV__XPORT_OK
               : bad(KV_ERR_NO_MEMORY, "xport shm: control buffer");
}

/* mu held: a NOTE_ACK or RNACK: the peer's verdict on a notification or a
 * read entry of ours. */
static struct kv__xport_verdict on_verdict(struct kv__shm_peer *tp, const struct kv__shm_msg *m)
{
    if (m->plen)
        return bad(KV_ERR_CORRUPT, "xport shm: message type %u with payload", (unsigned)m->type);
    kv_xport_xfer *xf = kv__xport_xfer_find(tp->p, m->xfer);
    if (!xf)
        return KV__XPORT_OK; /* ended already (timed out, cancelled) */
    const bool note = m->type == KV__SM_NOTE_ACK;
    if (note ? !xf->note_sent : !xf->read || m->entry >= xf->n)
        return bad(KV_ERR_CORRUPT,
                   "xport shm: a verdict (type %u) on entry %u of transfer %" PRIu64
                   ", never asked",
                   (unsigned)m->type, m->entry, m->xfer);
    const kv_status s = kv__xport_wire_status(m->status, note);
    char why[200];
    kv__xport_refusal_msg(why, sizeof(why), tp->p->id, m->xfer, note, m->entry, m->status, s);
    if (note && s == KV_OK)
        xf->note_done = true;
    else if (note)
        kv__xport_note_refused(xf, s, why);
    else if (!xf->ended[m->entry])
        kv__xport_entry_fail(xf, m->entry, s, "%s", why);
    kv__xport_settle_idle(tp->p);
    return KV__XPORT_OK;
}

/* mu held: a NOTIFY: the limits first, then queued. */
static struct kv__xport_verdict on_notify(struct kv__shm *t, struct kv__shm_peer *tp,
                                          const struct kv__shm_msg *m)
{
    char why[160];
    kv_status st = kv__xport_note_admit(tp->p, m->plen, why, sizeof(why));
    if (st == KV_ERR_CORRUPT)
        return bad(st, "xport shm: %s", why);
    if (st == KV_OK && kv__xport_note_push(tp->p, m->tag, tp->rbuf + KV__SHM_HDR, m->plen) != KV_OK)
        st = KV_ERR_NO_MEMORY; /* not queued: refused, named, as a full queue */
    if (st != KV_OK)
        t->x->stats.notes_refused++;
    struct kv__shm_msg a = {.type = KV__SM_NOTE_ACK, .xfer = m->xfer, .status = st};
    return kv__shm_put(tp, a, NULL, 0) ? KV__XPORT_OK
                                       : bad(KV_ERR_NO_MEMORY, "xport shm: control buffer");
}

struct kv__xport_verdict kv__shm_on_msg(struct kv__shm *t, struct kv__shm_peer *tp, size_t len,
                                        int fd)
{
    struct kv__shm_msg m;
    const kv_status ds = kv__shm_msg_decode(tp->rbuf, len, &m);
    if (ds != KV_OK || (fd >= 0 && (m.type != KV__SM_HELLO || tp->p))) {
        if (fd >= 0)
            close(fd);
        return ds != KV_OK ? bad(ds, "%s", kv_last_error())
                           : bad(KV_ERR_CORRUPT, "xport shm: a descriptor with message type %u",
                                 (unsigned)m.type);
    }
    const bool ready = tp->p && tp->p->state == KV_XPORT_READY;
    if (m.type == KV__SM_HELLO) {
        if (ready || m.plen != KV__XPORT_HELLO_BYTES) {
            if (fd >= 0)
                close(fd);
            return bad(KV_ERR_CORRUPT, "xport shm: a HELLO of %u bytes%s", m.plen,
                       ready ? " after the handshake" : "");
        }
        return tp->p ? hello_out(t, tp, &m) : hello_in(t, tp, &m, fd);
    }
    if (m.type == KV__SM_REFUSE && tp->p && !ready) {
        char s[201];
        const size_t n = m.plen < sizeof(s) - 1 ? m.plen : sizeof(s) - 1;
        memcpy(s, tp->rbuf + KV__SHM_HDR, n);
        s[n] = 0;
        for (size_t i = 0; i < n; i++)
            if ((unsigned char)s[i] < 32 || (unsigned char)s[i] > 126)
                s[i] = '?';
        kv_status st = kv__xport_wire_status(m.status, false);
        st = st == KV_ERR_CORRUPT && m.status != KV_ERR_CORRUPT ? KV_ERR_MISMATCH : st;
        return bad(st, "refused by the peer: %s", s);
    }
    if (!ready)
        return bad(KV_ERR_CORRUPT, "xport shm: message type %u before the handshake",
                   (unsigned)m.type);
    switch ((enum kv__shm_type)m.type) {
    case KV__SM_DATA:
        return on_data(t, tp, &m);
    case KV__SM_ACK:
        return on_ack(tp, &m);
    case KV__SM_NOTIFY:
        return on_notify(t, tp, &m);
    case KV__SM_NOTE_ACK:
    case KV__SM_RNACK:
        return on_verdict(tp, &m);
    case KV__SM_READ:
        return on_read(t, tp, &m);
    case KV__SM_RDATA:
        return on_rdata(t, tp, &m);
    case KV__SM_FREE:
        if (m.plen || m.slot >= KV__SHM_SLOTS || !tp->slot[m.slot].used || !tp->slot[m.slot].serve)
            return bad(KV_ERR_CORRUPT, "xport shm: a FREE of slot %u, which holds no read data",
                       m.slot);
        tp->slot[m.slot].used = false;
        tp->n_used--;
        return KV__XPORT_OK;
    case KV__SM_BYE:
        return m.plen ? bad(KV_ERR_CORRUPT, "xport shm: a BYE with payload")
                      : bad(KV_OK, "closed by the peer");
    case KV__SM_HELLO:
    case KV__SM_REFUSE:
        break;
    }
    return bad(KV_ERR_CORRUPT, "xport shm: message type %u after the handshake", (unsigned)m.type);
}

struct kv__xport_verdict kv__shm_rx(struct kv__shm *t, struct kv__shm_peer *tp)
{
    tp->rx_copied = 0;
    for (uint32_t n = 0; n < t->x->cfg.frames_per_round && tp->rx_copied < KV__SHM_RX_BUDGET &&
                         kv__shm_rx_wanted(tp);
         n++) {
        union {
            struct cmsghdr h;
            char b[CMSG_SPACE(4 * sizeof(int))];
        } cm;
        struct iovec iov = {tp->rbuf, sizeof(tp->rbuf)};
        struct msghdr mh = {
            .msg_iov = &iov, .msg_iovlen = 1, .msg_control = cm.b, .msg_controllen = sizeof(cm.b)};
        const ssize_t r = recvmsg(tp->fd, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
        const int e = errno;
        int fd = -1, extra = 0;
        for (struct cmsghdr *c = r >= 0 ? CMSG_FIRSTHDR(&mh) : NULL; c; c = CMSG_NXTHDR(&mh, c)) {
            if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
                continue;
            const size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
            for (size_t i = 0; i < k; i++) {
                int g;
                memcpy(&g, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
                if (fd < 0) {
                    fd = g;
                } else {
                    close(g);
                    extra++;
                }
            }
        }
        if (r <= 0 && fd >= 0) { /* an empty datagram can carry one too */
            close(fd);
            fd = -1;
        }
        if (r == 0)
            return bad(KV_ERR_IO, "xport shm: connection lost (closed by the other end)");
        if (r < 0) {
            if (e == EAGAIN || e == EWOULDBLOCK || e == EINTR)
                return KV__XPORT_OK;
            return bad(KV_ERR_IO, "xport shm: recv: %s", strerror(e));
        }
        if (extra || (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC))) {
            if (fd >= 0)
                close(fd);
            return bad(KV_ERR_CORRUPT, "xport shm: a message %s",
                       extra                        ? "with several descriptors"
                       : (mh.msg_flags & MSG_TRUNC) ? "over the largest (truncated)"
                                                    : "with its descriptors cut");
        }
        struct kv__xport_verdict v = kv__shm_on_msg(t, tp, (size_t)r, fd);
        if (!kv__xport_ok(&v))
            return v;
        /* an ACK or FREE goes now: the sender refills that slot while we
         * copy the next */
        v = kv__shm_flush(tp);
        if (!kv__xport_ok(&v))
            return v;
    }
    return KV__XPORT_OK;
}
