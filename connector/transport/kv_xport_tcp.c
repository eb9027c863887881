/*
 * kv_xport_tcp.c - the TCP backend of the transport seam (kv_xport_int.h,
 * its state in kv_xport_tcp_int.h): the ops table, connections and peers,
 * and the progress loop: one thread per transport, non-blocking sockets
 * under poll(), conns_per_peer connections per peer, the frames of
 * kv_xport_frame_int.h.
 *
 * A notification goes on connection 0 once every entry of its transfer and
 * of every earlier one on the peer is acknowledged (acknowledged = landed
 * and verified), so the receiver queues it after the data. Its ACK ends the
 * transfer DONE; a NACK (the receiver's queue is full) ends it FAILED.
 *
 * Every terminal transition is made by the progress thread, which is also
 * the only one that touches connections' sockets and control streams: so
 * the thread drops x->mu around its system calls and its hashing, and
 * nothing it holds can be freed meanwhile (a pending transfer is not freed;
 * an exposure that is busy is not ended; a region in use is not
 * deregistered). A second thread, the verify thread, hashes payloads
 * beside it (received WRITEs once landed, the next frame to send while the
 * current one goes out: kv_xport_tcp_int.h), holding the same busy counts;
 * closing a connection waits for a hash of it in progress. A transfer is `busy` while a frame of it
 * is on the wire or landing, and `unacked` while a WRITE frame of it sent whole waits for its ACK
 * (the peer may still be landing it); a deadline that finds either closes the peer (a half-sent
 * frame cannot be taken back on a stream, a landing one cannot be stopped); a cancel waits for both
 * to drain, so no notification posted after it overtakes its bytes.
 *
 * Deadlines, all timeout_ms: a transfer from its post; a handshake from its
 * connect or accept; an incoming frame from its first byte; a connection
 * with something to send from the last time it sent anything. The listener
 * rests after accept() fails for lack of descriptors or memory (10 ms,
 * doubling to 1 s), counted in the stats and said once on stderr.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "kv_mem.h"
#include "kv_xport_tcp_int.h"

#define ACCEPT_BACKOFF_MIN_NS (10ull * 1000000ull)
#define ACCEPT_BACKOFF_MAX_NS (1000ull * 1000000ull)

static _Atomic bool rx_defer = true;

void kv__tcp_rx_defer_set(bool on)
{
    atomic_store_explicit(&rx_defer, on, memory_order_relaxed);
}

static int set_nonblock(int fd)
{
    const int fl = fcntl(fd, F_GETFL, 0);
    return fl < 0 ? -1 : fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

static void tune(int fd)
{
    const int one = 1;
    (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

static struct kv__tcp_conn *conn_new(int fd)
{
    struct kv__tcp_conn *c = kv__mem_calloc(1, sizeof(*c));
    if (!c)
        return NULL;
    c->fd = fd;
    c->ph = RX_HDR;
    return c;
}

/* ---- closing -------------------------------------------------------- */

/* mu held: release what the connection holds (busy exposures and
 * transfers, reads it serves) and close it. */
static void conn_free(struct kv__tcp *t, struct kv__tcp_conn *c)
{
    kv__tcp_vj_drop(t, c);
    if (c->land_t && c->land_t->busy)
        c->land_t->busy--;
    if (c->df_t && c->df_t->busy)
        c->df_t->busy--;
    if (c->tp)
        kv__tcp_serve_drop(c->tp, c);
    if (c->fd >= 0)
        close(c->fd);
    kv__mem_free(c->ctl);
    kv__mem_free(c->stage);
    kv__mem_free(c->nx_stage);
    kv__mem_free(c);
}

/* mu held: take every job of tp's connections off the verify thread,
 * waiting (mu dropped) for any it is hashing. Before anything of the peer
 * is ended or freed: while mu is dropped a caller may free a transfer that
 * is no longer PENDING, deregister its regions, or unexpose (which walks
 * tp->conns), and the verify thread may still be reading a transfer's
 * bytes. After it, closing tp drops mu nowhere. */
static void peer_quiesce(struct kv__tcp *t, struct kv__tcp_peer *tp)
{
    for (uint32_t i = 0; i < tp->n_conns; i++)
        if (tp->conns[i])
            kv__tcp_vj_drop(t, tp->conns[i]);
}

/* mu held: close every connection of tp, end the peer (why, msg) and its
 * transfers, drop the backend's reference. tp is freed. */
static void peer_fail(struct kv__tcp *t, struct kv__tcp_peer *tp, kv_status why, const char *msg)
{
    peer_quiesce(t, tp);
    for (struct kv__tcp_peer **pp = &t->peers; *pp; pp = &(*pp)->next)
        if (*pp == tp) {
            *pp = tp->next;
            break;
        }
    kv_xport_peer *p = tp->p;
    if (p->state == KV_XPORT_CONNECTING && !p->outgoing)
        t->x->stats.peers_refused++;
    for (uint32_t i = 0; i < tp->n_conns; i++)
        if (tp->conns[i])
            conn_free(t, tp->conns[i]);
    p->be = NULL;
    kv__xport_peer_closed(p, why, msg);
    kv__xport_peer_unref(p);
    kv__mem_free(tp);
    pthread_cond_broadcast(&t->x->cv);
}

/* mu held: a polite close: a BYE on each connection if it fits in the
 * socket buffer now (never waits), then peer_fail. */
static void peer_bye(struct kv__tcp *t, struct kv__tcp_peer *tp, kv_status why, const char *msg)
{
    for (uint32_t i = 0; i < tp->n_conns; i++) {
        struct kv__tcp_conn *c = tp->conns[i];
        if (!c || !c->up || c->df_on || c->ctl_off != c->ctl_len)
            continue;
        unsigned char b[KV__XF_BYTES];
        struct kv__xf f = {
            .version = KV_XPORT_PROTOCOL_VERSION, .type = KV__XF_BYE, .conn = c->index};
        kv__xf_encode(&f, b);
        ssize_t r = send(c->fd, b, sizeof(b), MSG_NOSIGNAL | MSG_DONTWAIT);
        (void)r;
    }
    peer_fail(t, tp, why, msg);
}

/* ---- start, stop, connect ------------------------------------------- */

static void *progress(void *arg);

static kv_status tcp_start(kv_xport *x)
{
    struct kv__tcp *t = kv__mem_calloc(1, sizeof(*t));
    if (!t)
        return kv__error(KV_ERR_NO_MEMORY, "xport_create: tcp state");
    t->x = x;
    t->lfd = -1;
    t->accept_backoff_ns = ACCEPT_BACKOFF_MIN_NS;
    if (pipe2(t->wake, O_NONBLOCK | O_CLOEXEC) != 0) {
        const int e = errno;
        kv__mem_free(t);
        return kv__error(KV_ERR_IO, "xport_create: pipe2: %s", strerror(e));
    }
    kv_status st = KV_OK;
    if (x->cfg.listen_host) {
        struct addrinfo hints = {.ai_family = AF_UNSPEC,
                                 .ai_socktype = SOCK_STREAM,
                                 .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
        struct addrinfo *ai = NULL;
        char port[8];
        snprintf(port, sizeof(port), "%u", (unsigned)x->cfg.listen_port);
        const int g = getaddrinfo(x->cfg.listen_host, port, &hints, &ai);
        if (g != 0) {
            st = kv__error(KV_ERR_INVALID_ARG, "xport_create: listen_host \"%s\": %s",
                           x->cfg.listen_host, gai_strerror(g));
            goto fail_pipe;
        }
        t->lfd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
        const int one = 1;
        if (t->lfd < 0 || setsockopt(t->lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) ||
            bind(t->lfd, ai->ai_addr, ai->ai_addrlen) || listen(t->lfd, 128) ||
            set_nonblock(t->lfd)) {
            const int e = errno;
            freeaddrinfo(ai);
            st = kv__error(KV_ERR_IO, "xport_create: listen on %s:%u: %s", x->cfg.listen_host,
                           (unsigned)x->cfg.listen_port, strerror(e));
            goto fail_sock;
        }
        freeaddrinfo(ai);
        struct sockaddr_storage ss;
        socklen_t sl = sizeof(ss);
        getsockname(t->lfd, (struct sockaddr *)&ss, &sl);
        x->port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                                 : ((struct sockaddr_in *)&ss)->sin_port);
    }
    if (pthread_cond_init(&t->vcv, NULL) != 0 || pthread_cond_init(&t->vdone, NULL) != 0) {
        st = kv__error(KV_ERR_NO_MEMORY, "xport_create: condition variables");
        goto fail_sock;
    }
    x->be = t;
    if (!x->manual) {
        int e = pthread_create(&t->vthr, NULL, kv__tcp_verify_main, t);
        if (e != 0) {
            st = kv__error(KV_ERR_IO, "xport_create: verify thread: %s", strerror(e));
            goto fail_cv;
        }
        t->vthread = true;
        t->rx_defer = atomic_load_explicit(&rx_defer, memory_order_relaxed);
        e = pthread_create(&t->thr, NULL, progress, t);
        if (e != 0) {
            st = kv__error(KV_ERR_IO, "xport_create: progress thread: %s", strerror(e));
            goto fail_vthr;
        }
        t->thread = true;
    }
    return KV_OK;

fail_vthr:
    pthread_mutex_lock(&x->mu);
    t->vstop = true;
    pthread_cond_signal(&t->vcv);
    pthread_mutex_unlock(&x->mu);
    pthread_join(t->vthr, NULL);
fail_cv:
    x->be = NULL;
    pthread_cond_destroy(&t->vcv);
    pthread_cond_destroy(&t->vdone);
fail_sock:
    if (t->lfd >= 0)
        close(t->lfd);
fail_pipe:
    close(t->wake[0]);
    close(t->wake[1]);
    kv__mem_free(t);
    return st;
}

static kv_status tcp_stop(kv_xport *x)
{
    struct kv__tcp *t = x->be;
    pthread_mutex_lock(&x->mu);
    t->stop = true;
    kv__tcp_wake(t);
    pthread_mutex_unlock(&x->mu);
    if (t->thread)
        pthread_join(t->thr, NULL);
    pthread_mutex_lock(&x->mu);
    while (t->peers)
        peer_bye(t, t->peers, KV_ERR_CANCELLED, "the transport was destroyed");
    for (uint32_t i = 0; i < t->n_unbound; i++)
        conn_free(t, t->unbound[i]);
    t->n_unbound = 0;
    t->vstop = true; /* every slot is FREE now: nothing queued */
    pthread_cond_signal(&t->vcv);
    pthread_mutex_unlock(&x->mu);
    if (t->vthread)
        pthread_join(t->vthr, NULL);
    pthread_cond_destroy(&t->vcv);
    pthread_cond_destroy(&t->vdone);
    kv_status st = KV_OK;
    if (t->lfd >= 0 && close(t->lfd) != 0)
        st = kv__error(KV_ERR_IO, "xport_destroy: close of the listener: %s", strerror(errno));
    close(t->wake[0]);
    close(t->wake[1]);
    kv__mem_free(t->unbound);
    kv__mem_free(t->pfd);
    kv__mem_free(t->pconn);
    kv__mem_free(t);
    x->be = NULL;
    return st;
}

static kv_status tcp_connect(kv_xport_peer *p, const char *host, uint16_t port)
{
    kv_xport *x = p->x;
    struct kv__tcp *t = x->be;
    struct addrinfo hints = {
        .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICSERV};
    struct addrinfo *ai = NULL;
    char ps[8];
    snprintf(ps, sizeof(ps), "%u", (unsigned)port);
    const int g = getaddrinfo(host, ps, &hints, &ai); /* x->mu is not held */
    if (g != 0)
        return kv__error(KV_ERR_INVALID_ARG, "xport_connect: host \"%s\": %s", host,
                         gai_strerror(g));
    struct kv__tcp_peer *tp = kv__mem_calloc(1, sizeof(*tp));
    if (!tp) {
        freeaddrinfo(ai);
        return kv__error(KV_ERR_NO_MEMORY, "xport_connect: peer state");
    }
    tp->p = p;
    tp->n_conns = x->cfg.conns_per_peer;
    kv_status st = KV_OK;
    for (uint32_t i = 0; i < tp->n_conns; i++) {
        const int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (fd < 0) {
            st = kv__error(KV_ERR_IO, "xport_connect: socket: %s", strerror(errno));
            break;
        }
        tune(fd);
        struct kv__tcp_conn *c = conn_new(fd);
        if (!c) {
            close(fd);
            st = kv__error(KV_ERR_NO_MEMORY, "xport_connect: connection state");
            break;
        }
        c->index = i;
        c->tp = tp;
        tp->conns[i] = c;
        if (connect(fd, ai->ai_addr, ai->ai_addrlen) != 0 && errno != EINPROGRESS) {
            st = kv__error(KV_ERR_IO, "xport_connect: connect to %s:%u: %s", host, (unsigned)port,
                           strerror(errno));
            break;
        }
        c->connecting = true;
    }
    freeaddrinfo(ai);
    pthread_mutex_lock(&x->mu);
    if (st != KV_OK) {
        for (uint32_t i = 0; i < tp->n_conns; i++)
            if (tp->conns[i])
                conn_free(t, tp->conns[i]);
        kv__mem_free(tp);
        pthread_mutex_unlock(&x->mu);
        return st;
    }
    tp->deadline_ns = kv__deadline_ns(x->cfg.timeout_ms);
    p->be = tp;
    tp->next = t->peers;
    t->peers = tp;
    kv__tcp_wake(t);
    pthread_mutex_unlock(&x->mu);
    return KV_OK;
}

static void tcp_unexpose(kv_xport_peer *p, struct kv__xport_expo *e)
{
    struct kv__tcp_peer *tp = p->be;
    if (tp)
        kv__tcp_serve_unexpose(tp, e);
}

static void tcp_post(kv_xport_xfer *xf)
{
    kv__xport_cursor_reset(xf);
    kv__tcp_wake(xf->peer->x->be);
}

static void tcp_cancel(kv_xport_xfer *xf)
{
    kv__tcp_wake(xf->peer->x->be);
}

static void tcp_peer_close(kv_xport_peer *p)
{
    struct kv__tcp *t = p->x->be;
    struct kv__tcp_peer *tp = p->be;
    if (tp)
        tp->close_req = true;
    else /* the backend is done with it already: nothing in flight */
        kv__xport_peer_closed(p, KV_OK, "closed");
    kv__tcp_wake(t);
}

static void round_once(struct kv__tcp *t, uint32_t cap_ms);

static void tcp_step(kv_xport *x, uint32_t timeout_ms)
{
    pthread_mutex_lock(&x->mu);
    round_once(x->be, timeout_ms);
    pthread_mutex_unlock(&x->mu);
}

const struct kv__xport_ops kv__xport_tcp_ops = {
    .version = KV__XPORT_OPS_VERSION,
    .kind = KV_XPORT_TCP,
    .name = "tcp",
    .gather = true,
    .start = tcp_start,
    .stop = tcp_stop,
    .connect = tcp_connect,
    .mem_reg = kv__xport_mem_none,
    .mem_dereg = kv__xport_mem_none,
    .expose = kv__xport_expose_keyless,
    .unexpose = tcp_unexpose,
    .post = tcp_post,
    .cancel = tcp_cancel,
    .peer_close = tcp_peer_close,
    .step = tcp_step,
};

/* ---- incoming connections ------------------------------------------- */

uint32_t kv__tcp_handshaking(const struct kv__tcp *t)
{
    uint32_t n = t->n_unbound;
    for (const struct kv__tcp_peer *tp = t->peers; tp; tp = tp->next)
        if (!tp->p->outgoing && tp->p->state == KV_XPORT_CONNECTING)
            n += tp->n_up;
        else if (!tp->p->outgoing && !tp->p->user_owned) /* ready, not yet accepted */
            n += tp->n_conns;
    return n;
}

/* mu held: take fd as an incoming connection (see kv__tcp_adopt). */
static kv_status adopt(struct kv__tcp *t, int fd)
{
    kv_xport *x = t->x;
    tune(fd);
    const uint32_t busy = kv__tcp_handshaking(t);
    if (busy >= x->cfg.max_handshakes) {
        /* Refused by name, once, without waiting: what fits in the socket
         * now is all it gets. */
        x->stats.peers_refused++;
        x->stats.handshakes_over_limit++;
        struct kv__tcp_conn tmp = {.fd = fd};
        char why[120];
        snprintf(why, sizeof(why), "%u connections in their handshake already (max_handshakes)",
                 busy);
        if (kv__tcp_put_refuse(&tmp, KV_ERR_CAPACITY, why)) {
            ssize_t r = send(fd, tmp.ctl, tmp.ctl_len, MSG_NOSIGNAL | MSG_DONTWAIT);
            (void)r;
        }
        kv__mem_free(tmp.ctl);
        /* A FIN after the REFUSE, and what the peer sent already read, so
         * the close is not a reset that could discard the REFUSE. */
        (void)shutdown(fd, SHUT_WR);
        char sink[512];
        while (recv(fd, sink, sizeof(sink), MSG_DONTWAIT) > 0) {
        }
        close(fd);
        return kv__error(KV_ERR_CAPACITY, "xport tcp: a connection refused: %s", why);
    }
    if (t->n_unbound == t->cap_unbound) {
        struct kv__tcp_conn **u = kv__mem_grow(t->unbound, &t->cap_unbound, t->n_unbound,
                                               (size_t)t->n_unbound + 1, sizeof(*u), 8);
        if (!u) {
            close(fd);
            return kv__error(KV_ERR_NO_MEMORY, "xport tcp: a connection refused: no memory");
        }
        t->unbound = u;
    }
    struct kv__tcp_conn *c = conn_new(fd);
    if (!c) {
        close(fd);
        return kv__error(KV_ERR_NO_MEMORY, "xport tcp: a connection refused: no memory");
    }
    c->deadline_ns = kv__deadline_ns(x->cfg.timeout_ms);
    t->unbound[t->n_unbound++] = c;
    return KV_OK;
}

kv_status kv__tcp_adopt(kv_xport *x, int fd)
{
    struct kv__tcp *t = x->be;
    if (set_nonblock(fd) != 0) {
        close(fd);
        return kv__error(KV_ERR_IO, "xport tcp: adopt: %s", strerror(errno));
    }
    pthread_mutex_lock(&x->mu);
    const kv_status st = adopt(t, fd);
    kv__tcp_wake(t);
    pthread_mutex_unlock(&x->mu);
    return st;
}

/* mu held: accept what the listener has; on a shortage of descriptors or
 * memory rest the listener (a level-triggered listener that cannot be
 * drained would spin the thread). */
static void accept_all(struct kv__tcp *t)
{
    kv_xport *x = t->x;
    for (;;) {
        const int fd = accept4(t->lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            const int e = errno;
            if (e == EMFILE || e == ENFILE || e == ENOBUFS || e == ENOMEM) {
                t->accept_pause_ns = kv__now_ns() + t->accept_backoff_ns;
                t->accept_backoff_ns = 2 * t->accept_backoff_ns < ACCEPT_BACKOFF_MAX_NS
                                           ? 2 * t->accept_backoff_ns
                                           : ACCEPT_BACKOFF_MAX_NS;
                x->stats.accept_backoffs++;
                x->stats.accept_last_errno = e;
                if (!t->accept_said) {
                    t->accept_said = true;
                    fprintf(stderr,
                            "kvcache: xport tcp: accept on port %u: %s; the listener rests "
                            "(10 ms doubling to 1 s) until it succeeds (said once; counted in "
                            "kv_xport_stats_get)\n",
                            (unsigned)x->port, strerror(e));
                }
            }
            return;
        }
        t->accept_backoff_ns = ACCEPT_BACKOFF_MIN_NS;
        kv__error_mute();
        (void)adopt(t, fd);
        kv__error_unmute();
    }
}

/* ---- deadlines ------------------------------------------------------ */

/* mu held: deadlines of c (an incoming frame, sending); a message when one
 * passed. */
static bool conn_late(struct kv__tcp *t, const struct kv__tcp_conn *c, uint64_t now, char *msg,
                      size_t cap, kv_status *st)
{
    const uint64_t lim = (uint64_t)t->x->cfg.timeout_ms * 1000000ull;
    if (c->rx_since_ns && now - c->rx_since_ns >= lim) {
        t->x->stats.frames_stalled++;
        *st = KV_ERR_TIMEOUT;
        if (c->hdr_got)
            snprintf(msg, cap,
                     "xport tcp: a frame header on connection %u stalled at %zu of %u bytes for "
                     "%u ms: the peer is closed",
                     c->index, c->hdr_got, (unsigned)KV__XF_BYTES, t->x->cfg.timeout_ms);
        else
            snprintf(msg, cap,
                     "xport tcp: a frame of type %u on connection %u stalled at %" PRIu64
                     " of %" PRIu64 " payload bytes for %u ms: the peer is closed",
                     (unsigned)c->f.type, c->index, c->got, c->f.length, t->x->cfg.timeout_ms);
        return true;
    }
    if (!c->connecting && kv__tcp_tx_pending(c) && now - c->tx_since_ns >= lim) {
        t->x->stats.sends_stalled++;
        *st = KV_ERR_TIMEOUT;
        snprintf(msg, cap,
                 "xport tcp: the peer read nothing on connection %u for %u ms with %zu control "
                 "bytes and %" PRIu64 " frame bytes waiting: the peer is closed",
                 c->index, t->x->cfg.timeout_ms, kv__tcp_ctl_pending(c),
                 c->df_on ? c->df_total - c->df_sent : 0);
        return true;
    }
    return false;
}

/* mu held: deadlines and cancels of tp's transfers and connections; false
 * when tp was closed. */
static bool sweep(struct kv__tcp *t, struct kv__tcp_peer *tp, uint64_t now)
{
    kv_xport_peer *p = tp->p;
    if (p->state == KV_XPORT_CONNECTING && now >= tp->deadline_ns) {
        peer_fail(t, tp, KV_ERR_TIMEOUT, "xport: handshake not done within the timeout");
        return false;
    }
    /* transfers first: one whose own deadline passed ends TIMED_OUT even
     * when a late sweep also finds its connection stalled (which fails the
     * peer and, with it, the transfers still within their deadlines). One
     * with a frame on the wire (busy) fails the peer: its connections'
     * verify jobs are dropped before any transfer ends, since the verify
     * thread may be hashing that transfer's bytes (peer_quiesce). */
    char late[160] = "";
    for (kv_xport_xfer *xf = p->xfers; xf; xf = xf->next)
        if (now >= xf->deadline_ns && (xf->busy || xf->unacked)) {
            snprintf(late, sizeof(late),
                     "xport tcp: transfer %" PRIu64 " not done within %u ms with a frame of it "
                     "%s: the connection is closed",
                     xf->id, t->x->cfg.timeout_ms,
                     xf->busy ? "on the wire" : "sent and not acknowledged (it may still land)");
            peer_quiesce(t, tp);
            break;
        }
    for (kv_xport_xfer *xf = p->xfers, *nx; xf; xf = nx) {
        nx = xf->next;
        /* A WRITE frame sent and not yet acknowledged may still be landing
         * at the peer: the transfer is not over (a later notification on
         * another connection must not overtake it) until its ACK is in. */
        if (xf->cancel_req && !xf->busy && !xf->unacked)
            kv__xport_xfer_end(xf, KV_XPORT_CANCELLED, KV_ERR_CANCELLED);
        else if (now >= xf->deadline_ns)
            kv__xport_xfer_end(xf, xf->cancel_req ? KV_XPORT_CANCELLED : KV_XPORT_TIMED_OUT,
                               xf->cancel_req ? KV_ERR_CANCELLED : KV_ERR_TIMEOUT);
    }
    if (late[0]) {
        peer_fail(t, tp, KV_ERR_TIMEOUT, late);
        return false;
    }
    for (uint32_t i = 0; i < tp->n_conns; i++) {
        char m[200];
        kv_status st;
        if (tp->conns[i] && conn_late(t, tp->conns[i], now, m, sizeof(m), &st)) {
            peer_fail(t, tp, st, m);
            return false;
        }
    }
    if (p->state == KV_XPORT_READY && !kv__tcp_notes_flush(tp)) {
        peer_fail(t, tp, KV_ERR_NO_MEMORY, "xport tcp: control buffer");
        return false;
    }
    kv__xport_settle_idle(tp->p);
    return true;
}

static uint64_t next_deadline(struct kv__tcp *t)
{
    const uint64_t lim = (uint64_t)t->x->cfg.timeout_ms * 1000000ull;
    uint64_t d = UINT64_MAX;
    for (uint32_t i = 0; i < t->n_unbound; i++)
        d = kv__xport_min64(d, t->unbound[i]->deadline_ns);
    if (t->accept_pause_ns)
        d = kv__xport_min64(d, t->accept_pause_ns);
    for (struct kv__tcp_peer *tp = t->peers; tp; tp = tp->next) {
        if (tp->p->state == KV_XPORT_CONNECTING)
            d = kv__xport_min64(d, tp->deadline_ns);
        for (kv_xport_xfer *xf = tp->p->xfers; xf; xf = xf->next)
            d = kv__xport_min64(d, xf->deadline_ns);
        for (uint32_t i = 0; i < tp->n_conns; i++) {
            const struct kv__tcp_conn *c = tp->conns[i];
            if (c && c->rx_since_ns)
                d = kv__xport_min64(d, c->rx_since_ns + lim);
            if (c && !c->connecting && kv__tcp_tx_pending(c))
                d = kv__xport_min64(d, c->tx_since_ns + lim);
        }
    }
    return d;
}

/* ---- the progress loop ---------------------------------------------- */

static void unbound_drop(struct kv__tcp *t, uint32_t i)
{
    conn_free(t, t->unbound[i]);
    t->unbound[i] = t->unbound[--t->n_unbound];
}

/* Room for n entries in the poll set (rebuilt each round: nothing kept). */
static bool pfd_reserve(struct kv__tcp *t, uint32_t n)
{
    struct pollfd *p = kv__mem_grow(t->pfd, &t->cap_pfd, 0, n, sizeof(*p), 16);
    if (!p)
        return false;
    t->pfd = p;
    struct kv__tcp_conn **c = kv__mem_grow(t->pconn, &t->cap_pconn, 0, n, sizeof(*c), 16);
    if (!c)
        return false;
    t->pconn = c;
    return true;
}

/* mu held: whether c (of peer owner, NULL while unbound) is still open: a
 * peer closed while handling one of its connections leaves dangling entries
 * behind it in the poll set. */
static bool conn_live(const struct kv__tcp *t, const struct kv__tcp_conn *c,
                      struct kv__tcp_peer **owner)
{
    for (uint32_t j = 0; j < t->n_unbound; j++)
        if (t->unbound[j] == c) {
            *owner = NULL;
            return true;
        }
    for (struct kv__tcp_peer *tp = t->peers; tp; tp = tp->next)
        for (uint32_t j = 0; j < tp->n_conns; j++)
            if (tp->conns[j] == c) {
                *owner = tp;
                return true;
            }
    return false;
}

/* mu held: one round: closes asked for, deadlines, poll (at most cap_ms),
 * then every connection that is ready. */
static void round_once(struct kv__tcp *t, uint32_t cap_ms)
{
    kv_xport *x = t->x;
    for (struct kv__tcp_peer *tp = t->peers, *nx; tp; tp = nx) {
        nx = tp->next;
        if (tp->close_req)
            peer_bye(t, tp, KV_OK, "closed");
    }
    const uint64_t now = kv__now_ns();
    for (struct kv__tcp_peer *tp = t->peers, *nx; tp; tp = nx) {
        nx = tp->next;
        sweep(t, tp, now);
    }
    for (uint32_t i = 0; i < t->n_unbound;)
        if (t->unbound[i]->dead || now >= t->unbound[i]->deadline_ns) {
            if (!t->unbound[i]->dead)
                x->stats.peers_refused++;
            unbound_drop(t, i);
        } else {
            i++;
        }
    if (t->accept_pause_ns && now >= t->accept_pause_ns)
        t->accept_pause_ns = 0;
    /* The poll set: wake pipe, listener (unless resting), every connection. */
    uint32_t n = 2 + t->n_unbound;
    for (struct kv__tcp_peer *tp = t->peers; tp; tp = tp->next)
        n += tp->n_conns;
    if (!pfd_reserve(t, n)) {
        kv__tcp_unlock(t);
        usleep(1000);
        pthread_mutex_lock(&x->mu);
        return;
    }
    uint32_t k = 0;
    t->pfd[k] = (struct pollfd){.fd = t->wake[0], .events = POLLIN};
    t->pconn[k++] = NULL;
    t->pfd[k] = (struct pollfd){.fd = t->accept_pause_ns ? -1 : t->lfd, .events = POLLIN};
    t->pconn[k++] = NULL;
    for (uint32_t i = 0; i < t->n_unbound; i++) {
        struct kv__tcp_conn *c = t->unbound[i];
        t->pfd[k] = (struct pollfd){
            .fd = c->fd, .events = (short)(POLLIN | (kv__tcp_tx_pending(c) ? POLLOUT : 0))};
        t->pconn[k++] = c;
    }
    for (struct kv__tcp_peer *tp = t->peers; tp; tp = tp->next) {
        const bool work = tp->p->state == KV_XPORT_READY && kv__tcp_has_work(t, tp);
        for (uint32_t i = 0; i < tp->n_conns; i++) {
            struct kv__tcp_conn *c = tp->conns[i];
            if (!c)
                continue;
            /* a frame cut ahead and still being hashed: the verify
             * thread's wake-up says when it can go */
            const bool out =
                c->connecting || kv__tcp_tx_pending(c) ||
                (c->up && !c->nx_on &&
                 (work || (c->srv_head && c->srv_head->sent < c->srv_head->len)));
            const bool in = !c->connecting && kv__tcp_rx_wanted(t, c);
            t->pfd[k] = (struct pollfd){.fd = c->fd,
                                        .events = (short)((in ? POLLIN : 0) | (out ? POLLOUT : 0))};
            t->pconn[k++] = c;
        }
    }
    int ms = kv__xport_poll_ms(next_deadline(t), cap_ms);
    if (t->hashed) /* the verify thread finished a slot meanwhile: no wait */
        ms = 0;
    t->polling = true;
    kv__tcp_unlock(t);
    const int r = poll(t->pfd, k, ms);
    pthread_mutex_lock(&x->mu);
    t->polling = false;
    if (r < 0 || (r == 0 && !t->hashed))
        return;
    if (t->pfd[0].revents)
        kv__xport_wake_drain(t->wake[0]);
    if (t->pfd[1].revents && t->lfd >= 0 && !t->accept_pause_ns)
        accept_all(t);
    const bool hashed = t->hashed; /* the verify thread finished a slot */
    t->hashed = false;
    for (uint32_t i = 2; i < k; i++) {
        struct kv__tcp_conn *c = t->pconn[i];
        const short ev = t->pfd[i].revents;
        struct kv__tcp_peer *owner = NULL;
        if ((!ev && !hashed) || !conn_live(t, c, &owner) || c->dead)
            continue;
        struct kv__xport_verdict v = KV__XPORT_OK;
        if (hashed && c->tp && !kv__tcp_vj_collect(t, c)) /* ACKs of verified WRITEs */
            v = kv__xport_bad(KV_ERR_NO_MEMORY, "xport tcp: control buffer");
        /* without an event: what the verify thread made ready (ACKs, a
         * frame hashed ahead) goes now */
        if (kv__xport_ok(&v) && !ev && !kv__tcp_tx_nx_ready(c) && !kv__tcp_ctl_pending(c))
            continue;
        if (c->connecting && (ev & (POLLOUT | POLLERR | POLLHUP))) {
            int err = 0;
            socklen_t el = sizeof(err);
            getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &el);
            if (err) {
                v = kv__xport_bad(KV_ERR_IO, "xport tcp: connect: %s", strerror(err));
            } else {
                c->connecting = false;
                if (!kv__tcp_put_hello(t, c, owner->p, owner->n_conns))
                    v = kv__xport_bad(KV_ERR_NO_MEMORY, "xport tcp: control buffer");
            }
        }
        if (kv__xport_ok(&v) && !c->connecting && (ev & (POLLIN | POLLHUP | POLLERR)))
            v = kv__tcp_conn_rx(t, c);
        if (kv__xport_ok(&v) && !c->connecting)
            v = kv__tcp_conn_tx(t, c);
        if (kv__xport_ok(&v))
            continue;
        /* A bound connection takes its peer with it; an unbound one goes
         * alone (after its REFUSE, if any, had its chance). */
        if (c->tp && (c->up || c->tp->p->outgoing)) {
            peer_fail(t, c->tp, v.st, v.msg);
        } else {
            if (c->ctl_off < c->ctl_len)
                (void)send(c->fd, c->ctl + c->ctl_off, c->ctl_len - c->ctl_off,
                           MSG_NOSIGNAL | MSG_DONTWAIT);
            x->stats.peers_refused++;
            c->dead = true;
        }
    }
}

static void *progress(void *arg)
{
    struct kv__tcp *t = arg;
    kv_xport *x = t->x;
    pthread_mutex_lock(&x->mu);
    while (!t->stop)
        round_once(t, 1000);
    pthread_mutex_unlock(&x->mu);
    return NULL;
}
