/*
 * kv_xport_xfer.c - the transport's transfers (kv_transport.h, generic
 * layer): the checks at post, per-entry statuses and the one terminal state
 * of each transfer, the order notifications go in, waiting, cancel,
 * results and free. The backends move the bytes and call the kv__xport_*
 * bookkeeping here from their progress threads.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kv_mem.h"
#include "kv_wire.h"
#include "kv_xport_int.h"

/* ---- transfers ------------------------------------------------------ */

/* The checks at post (nothing sent yet). */
/* The segments of gathered entry i (kv__xport_write_gather): inside the
 * entry's local region, summing to its bytes. */
static kv_status check_segs(const char *fn, const struct kv_xport_io *io, uint32_t i,
                            const struct kv__xport_seg *seg, const uint32_t *seg_at, uint32_t n_seg)
{
    if (seg_at[i] >= seg_at[i + 1] || seg_at[i + 1] > n_seg)
        return kv__error(KV_ERR_INVALID_ARG, "%s: entry %u: segments [%u, %u) of %u", fn, i,
                         seg_at[i], seg_at[i + 1], n_seg);
    uint64_t sum = 0;
    for (uint32_t k = seg_at[i]; k < seg_at[i + 1]; k++) {
        const struct kv__xport_seg *g = &seg[k];
        /* the span from the first range's start to the last one's end */
        const uint64_t cap = io->local->bytes;
        uint64_t span = 0;
        const bool ok = g->bytes && g->count && g->pitch >= g->bytes &&
                        !__builtin_mul_overflow(g->count - 1, g->pitch, &span) &&
                        !__builtin_add_overflow(span, g->bytes, &span);
        if (!ok || !kv__range_ok(cap, g->off, span))
            return kv__error(
                KV_ERR_OUT_OF_BOUNDS,
                "%s: entry %u: segment %u (%" PRIu64 " x %" PRIu64 " bytes from %" PRIu64
                ", pitch %" PRIu64 ") empty or outside region %u of %" PRIu64 " bytes",
                fn, i, k, g->count, g->bytes, g->off, g->pitch, io->local->region, cap);
        sum += g->bytes * g->count;
    }
    if (sum != io->bytes)
        return kv__error(KV_ERR_INVALID_ARG,
                         "%s: entry %u: segments of %" PRIu64 " bytes for %" PRIu64, fn, i, sum,
                         io->bytes);
    return KV_OK;
}

static kv_status check_ios(const char *fn, kv_xport_peer *peer, const struct kv_xport_io *ios,
                           uint32_t n, const struct kv__xport_seg *seg, const uint32_t *seg_at,
                           uint32_t n_seg)
{
    for (uint32_t i = 0; i < n; i++) {
        const struct kv_xport_io *io = &ios[i];
        if (!io->local || !io->remote)
            return kv__error(KV_ERR_NULL, "%s: entry %u: %s is NULL", fn, i,
                             !io->local ? "local" : "remote");
        if (io->local->x != peer->x)
            return kv__error(KV_ERR_INVALID_ARG,
                             "%s: entry %u: local region %u is registered on another transport", fn,
                             i, io->local->region);
        if (io->remote->peer != peer)
            return kv__error(KV_ERR_INVALID_ARG,
                             "%s: entry %u: remote region %u was imported from another peer", fn, i,
                             io->remote->region);
        if (io->bytes == 0)
            return kv__error(KV_ERR_INVALID_ARG, "%s: entry %u of 0 bytes", fn, i);
        if (seg) {
            const kv_status st = check_segs(fn, io, i, seg, seg_at, n_seg);
            if (st != KV_OK)
                return st;
        } else if (!kv__range_ok(io->local->bytes, io->local_off, io->bytes))
            return kv__error(KV_ERR_OUT_OF_BOUNDS,
                             "%s: entry %u: local [%" PRIu64 ", +%" PRIu64
                             ") outside region %u of %" PRIu64 " bytes",
                             fn, i, io->local_off, io->bytes, io->local->region, io->local->bytes);
        if (!kv__range_ok(io->remote->bytes, io->remote_off, io->bytes))
            return kv__error(KV_ERR_OUT_OF_BOUNDS,
                             "%s: entry %u: remote [%" PRIu64 ", +%" PRIu64
                             ") outside the peer's region %u of %" PRIu64 " bytes",
                             fn, i, io->remote_off, io->bytes, io->remote->region,
                             io->remote->bytes);
    }
    return KV_OK;
}

static void xfer_release(kv_xport_xfer *t)
{
    kv__mem_free(t->ios);
    kv__mem_free(t->st);
    kv__mem_free(t->moved);
    kv__mem_free(t->ended);
    kv__mem_free(t->note);
    kv__mem_free(t->seg);
    kv__mem_free(t->seg_at);
    kv__mem_free(t);
}

static kv_status post_checked(const char *fn, kv_xport_peer *peer, const struct kv_xport_io *ios,
                              uint32_t n, struct kv__xport_seg *seg, uint32_t *seg_at,
                              uint32_t n_seg, const struct kv_xport_notify *notify, bool read,
                              kv_xport_xfer **xfer)
{
    if (!peer || !xfer || (n && !ios))
        return kv__error(KV_ERR_NULL, "%s: %s is NULL", fn,
                         !peer   ? "peer"
                         : !xfer ? "xfer"
                                 : "ios");
    if (n == 0 && !notify)
        return kv__error(KV_ERR_INVALID_ARG, "%s: no entries and no notification", fn);
    kv_status st;
    if (n > 0 && (st = kv__check_aligned(fn, "ios", ios, _Alignof(struct kv_xport_io))) != KV_OK)
        return st;
    if (notify && notify->len > KV_XPORT_NOTIFY_MAX)
        return kv__error(KV_ERR_INVALID_ARG, "%s: notification of %u bytes (at most %u)", fn,
                         notify->len, KV_XPORT_NOTIFY_MAX);
    if (notify && notify->len && !notify->msg)
        return kv__error(KV_ERR_NULL, "%s: notification msg is NULL with len %u", fn, notify->len);
    if (seg && !peer->ops->gather)
        return kv__error(KV_ERR_UNSUPPORTED, "%s: the %s backend does not gather", fn,
                         peer->ops->name);
    st = check_ios(fn, peer, ios, n, seg, seg_at, n_seg);
    if (st != KV_OK)
        return st;
    kv_xport_xfer *t = kv__mem_calloc(1, sizeof(*t));
    const uint32_t m = n ? n : 1;
    if (t) {
        t->ios = kv__mem_alloc(m * sizeof(*t->ios));
        t->st = kv__mem_calloc(m, sizeof(*t->st));
        t->moved = kv__mem_calloc(m, sizeof(*t->moved));
        t->ended = kv__mem_calloc(m, sizeof(*t->ended));
        t->note = notify && notify->len ? kv__mem_alloc(notify->len) : NULL;
    }
    if (!t || !t->ios || !t->st || !t->moved || !t->ended || (notify && notify->len && !t->note)) {
        if (t)
            xfer_release(t);
        return kv__error(KV_ERR_NO_MEMORY, "%s: a transfer of %u entries", fn, n);
    }
    if (n)
        memcpy(t->ios, ios, n * sizeof(*ios));
    t->n = n;
    t->seg = seg; /* owned by t from here: xfer_release frees them */
    t->seg_at = seg_at;
    t->n_seg = seg ? n_seg : 0;
    t->left = n;
    t->read = read;
    if (notify) {
        t->has_note = true;
        t->note_tag = notify->tag;
        t->note_len = notify->len;
        if (notify->len)
            memcpy(t->note, notify->msg, notify->len);
    }
    kv_xport *x = peer->x;
    pthread_mutex_lock(&x->mu);
    if (peer->state != KV_XPORT_READY || peer->user_closed) {
        const kv_xport_peer_state s = peer->state;
        const kv_status why = peer->why;
        pthread_mutex_unlock(&x->mu);
        t->seg = NULL; /* still the caller's: post frees them on an error */
        t->seg_at = NULL;
        xfer_release(t);
        if (s == KV_XPORT_CONNECTING)
            return kv__error(KV_ERR_BAD_STATE, "%s: peer still connecting", fn);
        return kv__error(KV_ERR_BAD_STATE, "%s: peer closed (%s)", fn, kv_status_name(why));
    }
    if (peer->ops->check && n) {
        st = peer->ops->check(peer, ios, n, read);
        if (st != KV_OK) {
            pthread_mutex_unlock(&x->mu);
            t->seg = NULL; /* still the caller's: post frees them on an error */
            t->seg_at = NULL;
            xfer_release(t);
            return kv__error_wrap(st, "%s", fn);
        }
    }
    t->peer = peer;
    peer->refs++;
    x->n_xfers++;
    for (uint32_t i = 0; i < n; i++) {
        ios[i].local->users++;
        ios[i].remote->users++;
    }
    t->id = x->next_xfer++;
    t->state = KV_XPORT_PENDING;
    t->post_ns = kv__now_ns();
    t->deadline_ns = t->post_ns + (uint64_t)x->cfg.timeout_ms * 1000000ull;
    if (peer->xfers_tail)
        peer->xfers_tail->next = t;
    else
        peer->xfers = t;
    peer->xfers_tail = t;
    peer->ops->post(t);
    pthread_mutex_unlock(&x->mu);
    *xfer = t;
    return KV_OK;
}

/* seg, seg_at (may be NULL): a gathered write's, owned from here on. */
static kv_status post(const char *fn, kv_xport_peer *peer, const struct kv_xport_io *ios,
                      uint32_t n, struct kv__xport_seg *seg, uint32_t *seg_at, uint32_t n_seg,
                      const struct kv_xport_notify *notify, bool read, kv_xport_xfer **xfer)
{
    kv_status st = post_checked(fn, peer, ios, n, seg, seg_at, n_seg, notify, read, xfer);
    if (st != KV_OK) {
        kv__mem_free(seg);
        kv__mem_free(seg_at);
    }
    return st;
}

kv_status kv_xport_write(kv_xport_peer *peer, const struct kv_xport_io *ios, uint32_t n,
                         const struct kv_xport_notify *notify, kv_xport_xfer **xfer)
{
    return post("xport_write", peer, ios, n, NULL, NULL, 0, notify, false, xfer);
}

kv_status kv__xport_write_gather(kv_xport_peer *peer, const struct kv_xport_io *ios, uint32_t n,
                                 struct kv__xport_seg *seg, uint32_t *seg_at, uint32_t n_seg,
                                 const struct kv_xport_notify *notify, kv_xport_xfer **xfer)
{
    if (!seg || !seg_at) {
        kv__mem_free(seg);
        kv__mem_free(seg_at);
        return kv__error(KV_ERR_NULL, "xport_write_plan: gathered write without segments");
    }
    return post("xport_write_plan", peer, ios, n, seg, seg_at, n_seg, notify, false, xfer);
}

kv_status kv_xport_read(kv_xport_peer *peer, const struct kv_xport_io *ios, uint32_t n,
                        kv_xport_xfer **xfer)
{
    if (n == 0)
        return kv__error(KV_ERR_INVALID_ARG, "xport_read: no entries");
    return post("xport_read", peer, ios, n, NULL, NULL, 0, NULL, true, xfer);
}

void kv__xport_entry_end(kv_xport_xfer *t, uint32_t i, kv_status st)
{
    if (i >= t->n || t->ended[i])
        return;
    t->ended[i] = true;
    t->st[i] = st;
    t->left--;
    t->failed += st != KV_OK;
}

void kv__xport_entry_fail(kv_xport_xfer *t, uint32_t i, kv_status st, const char *fmt, ...)
{
    if (i >= t->n || t->ended[i])
        return;
    if (!t->why[0]) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(t->why, sizeof(t->why), fmt, ap);
        va_end(ap);
    }
    kv__xport_entry_end(t, i, st);
}

kv_status kv__xport_wire_status(int64_t v, bool ok_allowed)
{
    switch (v) {
#define KV__WIRE_STATUS(name, value, msg)                                                          \
    case value:                                                                                    \
        return value == 0 && !ok_allowed ? KV_ERR_CORRUPT : (kv_status)value;
        KV_STATUS_MAP(KV__WIRE_STATUS)
#undef KV__WIRE_STATUS
    }
    return KV_ERR_CORRUPT;
}

struct kv__xport_verdict kv__xport_bad(kv_status st, const char *fmt, ...)
{
    struct kv__xport_verdict v = {.st = st};
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(v.msg, sizeof(v.msg), fmt, ap);
    va_end(ap);
    return v;
}

void kv__xport_xfer_end(kv_xport_xfer *t, kv_xport_state state, kv_status why)
{
    if (t->state != KV_XPORT_PENDING)
        return;
    for (uint32_t i = 0; i < t->n; i++)
        kv__xport_entry_end(t, i, why);
    t->state = state;
    t->busy = 0;
    kv_xport_peer *p = t->peer;
    kv_xport_xfer *prev = NULL;
    for (kv_xport_xfer *q = p->xfers; q; prev = q, q = q->next)
        if (q == t) {
            if (prev)
                prev->next = t->next;
            else
                p->xfers = t->next;
            if (p->xfers_tail == t)
                p->xfers_tail = prev;
            break;
        }
    t->next = NULL;
    for (uint32_t i = 0; i < t->n; i++) {
        t->ios[i].local->users--;
        t->ios[i].remote->users--;
    }
    if (state == KV_XPORT_TIMED_OUT && !t->why[0])
        snprintf(t->why, sizeof(t->why), "transfer %" PRIu64 " not done within %u ms", t->id,
                 p->x->cfg.timeout_ms);
    kv__xport_signal(p->x);
}

bool kv__xport_xfer_settle(kv_xport_xfer *t)
{
    if (t->state != KV_XPORT_PENDING || t->left)
        return t->state != KV_XPORT_PENDING;
    if (t->failed || t->note_st != KV_OK) {
        kv__xport_xfer_end(t, KV_XPORT_FAILED, KV_ERR_IO);
        return true;
    }
    if (t->has_note && !t->note_done)
        return false;
    kv__xport_xfer_end(t, KV_XPORT_DONE, KV_OK);
    return true;
}

void kv__xport_note_refused(kv_xport_xfer *t, kv_status st, const char *msg)
{
    t->note_st = st;
    if (!t->why[0])
        snprintf(t->why, sizeof(t->why), "%s", msg);
}

void kv__xport_refusal_msg(char *why, size_t cap, uint64_t peer, uint64_t xfer, bool note,
                           uint32_t entry, int64_t wire, kv_status s)
{
    char what[40];
    if (note)
        snprintf(what, sizeof(what), "the notification");
    else
        snprintf(what, sizeof(what), "entry %u", entry);
    if (s == KV_ERR_CORRUPT && wire != KV_ERR_CORRUPT) {
        snprintf(why, cap,
                 "peer %" PRIu64 " refused %s of transfer %" PRIu64 " with status %" PRId64
                 ", which is not a kv_status",
                 peer, what, xfer, wire);
        return;
    }
    snprintf(why, cap, "peer %" PRIu64 " refused %s of transfer %" PRIu64 ": %s%s", peer, what,
             xfer, kv_status_name(s),
             s == KV_ERR_CAPACITY && note    ? " (its queue of notifications not yet polled is "
                                               "full: max_pending_notes)"
             : s == KV_ERR_CAPACITY          ? " (its reads being served are at max_pending_reads)"
             : s == KV_ERR_NO_MEMORY && note ? " (it could not allocate the notification)"
                                             : "");
}

bool kv__xport_note_may_go(const kv_xport_xfer *t)
{
    if (t->left || t->failed)
        return false;
    for (const kv_xport_xfer *q = t->peer->xfers; q && q != t; q = q->next)
        if (q->left || q->failed || (q->has_note && !q->note_sent))
            return false;
    return true;
}

kv_xport_xfer *kv__xport_note_next(kv_xport_xfer *t)
{
    for (; t; t = t->next) {
        if (!t->has_note || t->note_sent || t->cancel_req)
            continue;
        return kv__xport_note_may_go(t) ? t : NULL;
    }
    return NULL;
}

void kv__xport_settle_idle(kv_xport_peer *p)
{
    for (kv_xport_xfer *t = p->xfers, *nx; t; t = nx) {
        nx = t->next;
        /* a frame sent whole and not yet acknowledged may still be landing
         * (an entry refused by another frame ended it): not before its ACK */
        if (!t->left && !t->busy && !t->unacked)
            kv__xport_xfer_settle(t);
    }
}

void kv__xport_serve_end(struct kv__xport_serve **head, struct kv__xport_serve **tail,
                         struct kv__xport_serve *s, uint32_t *n_serves)
{
    struct kv__xport_serve **pp = head, *prev = NULL;
    while (*pp && *pp != s) {
        prev = *pp;
        pp = &(*pp)->next;
    }
    if (*pp) {
        *pp = s->next;
        if (*tail == s)
            *tail = prev;
    }
    s->expo->busy--;
    (*n_serves)--;
    kv__mem_free(s);
}

kv_xport_xfer *kv__xport_xfer_find(kv_xport_peer *p, uint64_t id)
{
    for (kv_xport_xfer *t = p->xfers; t; t = t->next)
        if (t->id == id)
            return t;
    return NULL;
}

kv_status kv_xport_xfer_test(kv_xport_xfer *xfer, kv_xport_state *state)
{
    if (!xfer || !state)
        return kv__error(KV_ERR_NULL, "xport_xfer_test: %s is NULL", !xfer ? "xfer" : "state");
    kv_xport *x = xfer->peer->x;
    if (x->manual)
        kv__xport_step(x, 0);
    pthread_mutex_lock(&x->mu);
    *state = xfer->state;
    pthread_mutex_unlock(&x->mu);
    return KV_OK;
}

kv_status kv_xport_xfer_wait(kv_xport_xfer *xfer, uint32_t timeout_ms, kv_xport_state *state)
{
    if (!xfer)
        return kv__error(KV_ERR_NULL, "xport_xfer_wait: xfer is NULL");
    kv_xport *x = xfer->peer->x;
    const struct timespec ts = kv__deadline_ts(timeout_ms);
    pthread_mutex_lock(&x->mu);
    while (xfer->state == KV_XPORT_PENDING)
        if (!kv__xport_wait_until(x, &ts))
            break;
    const kv_xport_state s = xfer->state;
    pthread_mutex_unlock(&x->mu);
    if (state)
        *state = s;
    if (s == KV_XPORT_PENDING)
        return kv__error(KV_ERR_TIMEOUT,
                         "xport_xfer_wait: transfer %" PRIu64 " still pending after %u ms",
                         xfer->id, timeout_ms);
    return KV_OK;
}

kv_status kv_xport_xfer_cancel(kv_xport_xfer *xfer)
{
    if (!xfer)
        return kv__error(KV_ERR_NULL, "xport_xfer_cancel: xfer is NULL");
    kv_xport *x = xfer->peer->x;
    pthread_mutex_lock(&x->mu);
    if (xfer->state == KV_XPORT_PENDING && !xfer->cancel_req) {
        xfer->cancel_req = true;
        xfer->peer->ops->cancel(xfer);
    }
    pthread_mutex_unlock(&x->mu);
    return KV_OK;
}

kv_status kv_xport_xfer_results(kv_xport_xfer *xfer, const kv_status **st, uint32_t *n)
{
    if (!xfer || !st || !n)
        return kv__error(KV_ERR_NULL, "xport_xfer_results: %s is NULL",
                         !xfer ? "xfer"
                         : !st ? "st"
                               : "n");
    kv_xport *x = xfer->peer->x;
    pthread_mutex_lock(&x->mu);
    const kv_xport_state s = xfer->state;
    pthread_mutex_unlock(&x->mu);
    if (s == KV_XPORT_PENDING)
        return kv__error(KV_ERR_BAD_STATE, "xport_xfer_results: transfer %" PRIu64 " pending",
                         xfer->id);
    *st = xfer->st;
    *n = xfer->n;
    return KV_OK;
}

kv_status kv_xport_xfer_note_status(kv_xport_xfer *xfer, kv_status *st)
{
    if (!xfer || !st)
        return kv__error(KV_ERR_NULL, "xport_xfer_note_status: %s is NULL", !xfer ? "xfer" : "st");
    kv_xport *x = xfer->peer->x;
    pthread_mutex_lock(&x->mu);
    const kv_xport_state s = xfer->state;
    const kv_status note = xfer->note_st;
    pthread_mutex_unlock(&x->mu);
    if (s == KV_XPORT_PENDING)
        return kv__error(KV_ERR_BAD_STATE, "xport_xfer_note_status: transfer %" PRIu64 " pending",
                         xfer->id);
    *st = note;
    return KV_OK;
}

const char *kv_xport_xfer_error(kv_xport_xfer *xfer)
{
    if (!xfer)
        return "";
    kv_xport *x = xfer->peer->x;
    pthread_mutex_lock(&x->mu);
    const bool ended = xfer->state != KV_XPORT_PENDING && xfer->state != KV_XPORT_DONE;
    pthread_mutex_unlock(&x->mu);
    return ended ? xfer->why : "";
}

kv_status kv_xport_xfer_free(kv_xport_xfer *xfer)
{
    if (!xfer)
        return KV_OK;
    kv_xport_peer *p = xfer->peer;
    kv_xport *x = p->x;
    pthread_mutex_lock(&x->mu);
    if (xfer->state == KV_XPORT_PENDING) {
        pthread_mutex_unlock(&x->mu);
        return kv__error(KV_ERR_BAD_STATE,
                         "xport_xfer_free: transfer %" PRIu64 " pending (wait or cancel first)",
                         xfer->id);
    }
    x->n_xfers--;
    kv__xport_peer_unref(p);
    pthread_mutex_unlock(&x->mu);
    xfer_release(xfer);
    return KV_OK;
}
