/*
 * kv_xport_tcp.c - the TCP backend of the transport seam (kv_xport_int.h):
 * one progress thread per transport, non-blocking sockets under poll(),
 * conns_per_peer connections per peer, the frames of kv_xport_frame_int.h.
 *
 * Per connection, two directions:
 *   tx  a control stream (HELLO, REFUSE, ACK, NACK, NOTIFY, READ, BYE: small
 *       frames, sent between data frames) and at most one data frame in
 *       flight (WRITE or RDATA: a 64-byte header, then the payload straight
 *       from registered memory: sendmsg of two iovecs, no staging copy).
 *       Data frames are cut lazily, at most KV__TCP_CHUNK bytes, from the
 *       peer's transfers in post order: a free connection takes the next
 *       chunk, so one transfer stripes over every connection.
 *   rx  a header (checked: kv__xf_decode), then the payload: a WRITE into
 *       the region it names if that region is exposed to this peer and the
 *       range lies inside it (recv straight into place), else read into a
 *       scratch buffer and dropped, answered NACK. The payload's XXH3 is
 *       computed as it lands; ACK only when it matches.
 *
 * A notification goes on connection 0 once every entry of its transfer and
 * of every earlier one on the peer is acknowledged (acknowledged = landed
 * and verified), so the receiver queues it after the data. Its ACK ends the
 * transfer DONE.
 *
 * Every terminal transition is made by the progress thread, which is also
 * the only one that touches connections and the memory of transfers: so
 * the thread drops x->mu around its system calls and nothing it holds can
 * be freed meanwhile (a pending transfer is not freed; a region in use is
 * not deregistered). A transfer is `busy` while a frame of it is on the
 * wire or landing; a deadline or cancel that finds it busy closes the peer
 * (a half-sent frame cannot be taken back on a stream) unless it is a
 * cancel, which waits for the frame to finish.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "kv_mem.h"
#include "kv_xport_frame_int.h"
#include "kv_xport_int.h"

#define KV__TCP_CHUNK (512u << 10)    /* payload bytes per data frame sent */
#define KV__TCP_MAXV 64u              /* pieces per WRITE frame */
#define KV__TCP_DESC 24u              /* bytes of a piece's descriptor */
#define KV__TCP_MAX_FRAME (16u << 20) /* a larger payload is refused (corrupt) */
#define KV__TCP_RX_BUDGET (8u << 20)  /* bytes received per connection per round */
#define KV__TCP_SCRATCH (64u << 10)

enum rx_phase {
    RX_HDR,     /* filling hdr[] */
    RX_DESC,    /* a WRITE's descriptor table into small[] */
    RX_PIECES,  /* a WRITE's pieces, each into its place (or dropped) */
    RX_LAND,    /* an RDATA's payload into its read */
    RX_SMALL,   /* payload into small[] (HELLO, REFUSE, NOTIFY, READ, ACK) */
    RX_DISCARD, /* payload dropped (read data of an ended transfer) */
};

struct tcp_peer;

/* A read the peer asked of us: served on the connection it came on, in
 * order (the requester checks each RDATA's offset against what it has). */
struct serve {
    struct serve *next;
    uint64_t xfer;
    uint32_t entry;
    kv_xport_mem *mem; /* users++ while queued */
    uint64_t off, len, sent;
};

struct conn {
    int fd;
    uint32_t index;
    struct tcp_peer *tp; /* NULL: incoming, before its HELLO */
    bool connecting;     /* non-blocking connect in progress */
    bool up;             /* its HELLO exchange is done */
    bool dead;           /* close at the end of this round (unbound conns) */
    uint64_t deadline_ns;
    /* tx: control stream */
    unsigned char *ctl;
    size_t ctl_len, ctl_off, ctl_cap;
    /* tx: the data frame in flight: the header, the descriptor table (a
     * WRITE) and df_k pieces of registered memory; df_sent of df_total */
    bool df_on;
    unsigned char df_hdr[KV__XF_BYTES];
    unsigned char df_desc[KV__TCP_MAXV * KV__TCP_DESC];
    uint32_t df_desc_bytes, df_k;
    const char *df_src[KV__TCP_MAXV];
    uint64_t df_len[KV__TCP_MAXV];
    uint64_t df_total, df_sent;
    kv_xport_xfer *df_t;  /* the WRITE's transfer (busy++) */
    struct serve *df_srv; /* the RDATA's read */
    struct serve *srv_head, *srv_tail;
    /* rx */
    enum rx_phase ph;
    unsigned char hdr[KV__XF_BYTES];
    size_t hdr_got;
    struct kv__xf f;
    char *dst;    /* RX_SMALL, RDATA */
    uint64_t got; /* payload bytes so far */
    /* a WRITE's pieces: where each lands (NULL: refused, dropped) */
    uint32_t rx_k, rx_p;
    uint64_t rx_pgot;
    char *rx_dst[KV__TCP_MAXV];
    uint64_t rx_len[KV__TCP_MAXV];
    uint32_t rx_entry[KV__TCP_MAXV];
    kv_xport_mem *rx_mem[KV__TCP_MAXV]; /* landing++ while receiving */
    kv_xport_xfer *land_t;              /* busy++ while RX_LAND of an RDATA */
    struct kv__xxh3_state hs;
    unsigned char small[KV_XPORT_NOTIFY_MAX + 256]; /* >= MAXV * DESC, MAXV * ACK */
};

struct tcp_peer {
    kv_xport_peer *p;
    struct tcp_peer *next;
    struct conn *conns[KV__XPORT_MAX_CONNS];
    uint32_t n_conns, n_up;
    uint64_t deadline_ns; /* handshake */
    bool close_req;       /* the user closed it */
};

struct tcp {
    kv_xport *x;
    int lfd;
    int wake[2];
    pthread_t thr;
    bool stop;
    struct tcp_peer *peers;
    struct conn **unbound; /* incoming connections before their HELLO */
    uint32_t n_unbound, cap_unbound;
    struct pollfd *pfd;
    struct conn **pconn;
    uint32_t cap_pfd;
    char scratch[KV__TCP_SCRATCH];
};

static void wake(struct tcp *t)
{
    const char c = 1;
    ssize_t r = write(t->wake[1], &c, 1);
    (void)r; /* a full pipe is already a pending wake-up */
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

static struct conn *conn_new(int fd)
{
    struct conn *c = kv__mem_calloc(1, sizeof(*c));
    if (!c)
        return NULL;
    c->fd = fd;
    c->ph = RX_HDR;
    return c;
}

/* ---- the control stream --------------------------------------------- */

static bool ctl_reserve(struct conn *c, size_t more)
{
    if (c->ctl_off && c->ctl_off == c->ctl_len)
        c->ctl_off = c->ctl_len = 0;
    if (c->ctl_len + more <= c->ctl_cap)
        return true;
    size_t cap = c->ctl_cap ? c->ctl_cap : 4096;
    while (cap < c->ctl_len + more)
        cap *= 2;
    unsigned char *b = kv__mem_alloc(cap);
    if (!b)
        return false;
    if (c->ctl_len)
        memcpy(b, c->ctl, c->ctl_len);
    kv__mem_free(c->ctl);
    c->ctl = b;
    c->ctl_cap = cap;
    return true;
}

/* Append a control frame (header fields in f; payload p[len]). false: out
 * of memory (the caller closes the connection). */
static bool ctl_put(struct conn *c, struct kv__xf f, const void *p, uint32_t len)
{
    if (!ctl_reserve(c, KV__XF_BYTES + len))
        return false;
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

static bool put_hello(struct tcp *t, struct conn *c, kv_xport_peer *p, uint32_t conns)
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
    return ctl_put(c, (struct kv__xf){.type = KV__XF_HELLO}, b, sizeof(b));
}

/* ---- closing -------------------------------------------------------- */

static void serve_drop(struct conn *c)
{
    while (c->srv_head) {
        struct serve *s = c->srv_head;
        c->srv_head = s->next;
        s->mem->users--;
        kv__mem_free(s);
    }
    c->srv_tail = NULL;
}

/* mu held: release what the connection holds (landing counts, busy
 * counts, reads it serves) and close it. */
static void conn_free(struct conn *c)
{
    for (uint32_t i = c->rx_p; c->ph == RX_PIECES && i < c->rx_k; i++)
        if (c->rx_mem[i])
            c->rx_mem[i]->landing--;
    if (c->land_t && c->land_t->busy)
        c->land_t->busy--;
    if (c->df_t && c->df_t->busy)
        c->df_t->busy--;
    serve_drop(c);
    if (c->fd >= 0)
        close(c->fd);
    kv__mem_free(c->ctl);
    kv__mem_free(c);
}

/* mu held: close every connection of tp, end the peer (why, msg) and its
 * transfers, drop the backend's reference. tp is freed. */
static void peer_fail(struct tcp *t, struct tcp_peer *tp, kv_status why, const char *msg)
{
    for (struct tcp_peer **pp = &t->peers; *pp; pp = &(*pp)->next)
        if (*pp == tp) {
            *pp = tp->next;
            break;
        }
    for (uint32_t i = 0; i < tp->n_conns; i++)
        if (tp->conns[i])
            conn_free(tp->conns[i]);
    kv_xport_peer *p = tp->p;
    p->be = NULL;
    kv__xport_peer_closed(p, why, msg);
    kv__xport_peer_unref(p);
    kv__mem_free(tp);
    pthread_cond_broadcast(&t->x->cv);
}

/* mu held: a polite close: a BYE on each connection if it fits in the
 * socket buffer now (never waits), then peer_fail. */
static void peer_bye(struct tcp *t, struct tcp_peer *tp, kv_status why, const char *msg)
{
    for (uint32_t i = 0; i < tp->n_conns; i++) {
        struct conn *c = tp->conns[i];
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
    struct tcp *t = kv__mem_calloc(1, sizeof(*t));
    if (!t)
        return kv__error(KV_ERR_NO_MEMORY, "xport_create: tcp state");
    t->x = x;
    t->lfd = -1;
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
    x->be = t;
    const int e = pthread_create(&t->thr, NULL, progress, t);
    if (e != 0) {
        st = kv__error(KV_ERR_IO, "xport_create: progress thread: %s", strerror(e));
        x->be = NULL;
        goto fail_sock;
    }
    return KV_OK;

fail_sock:
    if (t->lfd >= 0)
        close(t->lfd);
fail_pipe:
    close(t->wake[0]);
    close(t->wake[1]);
    kv__mem_free(t);
    return st;
}

static void tcp_stop(kv_xport *x)
{
    struct tcp *t = x->be;
    pthread_mutex_lock(&x->mu);
    t->stop = true;
    wake(t);
    pthread_mutex_unlock(&x->mu);
    pthread_join(t->thr, NULL);
    pthread_mutex_lock(&x->mu);
    while (t->peers)
        peer_bye(t, t->peers, KV_ERR_CANCELLED, "the transport was destroyed");
    for (uint32_t i = 0; i < t->n_unbound; i++)
        conn_free(t->unbound[i]);
    pthread_mutex_unlock(&x->mu);
    if (t->lfd >= 0)
        close(t->lfd);
    close(t->wake[0]);
    close(t->wake[1]);
    kv__mem_free(t->unbound);
    kv__mem_free(t->pfd);
    kv__mem_free(t->pconn);
    kv__mem_free(t);
    x->be = NULL;
}

static kv_status tcp_connect(kv_xport_peer *p, const char *host, uint16_t port)
{
    kv_xport *x = p->x;
    struct tcp *t = x->be;
    struct addrinfo hints = {
        .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICSERV};
    struct addrinfo *ai = NULL;
    char ps[8];
    snprintf(ps, sizeof(ps), "%u", (unsigned)port);
    const int g = getaddrinfo(host, ps, &hints, &ai);
    if (g != 0)
        return kv__error(KV_ERR_INVALID_ARG, "xport_connect: host \"%s\": %s", host,
                         gai_strerror(g));
    struct tcp_peer *tp = kv__mem_calloc(1, sizeof(*tp));
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
        struct conn *c = conn_new(fd);
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
                conn_free(tp->conns[i]);
        kv__mem_free(tp);
        pthread_mutex_unlock(&x->mu);
        return st;
    }
    tp->deadline_ns = kv__xport_now_ns() + (uint64_t)x->cfg.timeout_ms * 1000000ull;
    p->be = tp;
    tp->next = t->peers;
    t->peers = tp;
    wake(t);
    pthread_mutex_unlock(&x->mu);
    return KV_OK;
}

static kv_status tcp_mem_reg(kv_xport_mem *m)
{
    (void)m;
    return KV_OK;
}

static void tcp_mem_dereg(kv_xport_mem *m)
{
    (void)m;
}

static kv_status tcp_mem_key(kv_xport_peer *p, kv_xport_mem *m, unsigned char *key, uint32_t *len)
{
    (void)p;
    (void)m;
    (void)key;
    *len = 0;
    return KV_OK;
}

static void tcp_post(kv_xport_xfer *xf)
{
    xf->be_entry = 0;
    xf->be_off = 0;
    wake(xf->peer->x->be);
}

static void tcp_cancel(kv_xport_xfer *xf)
{
    wake(xf->peer->x->be);
}

static void tcp_peer_close(kv_xport_peer *p)
{
    struct tcp *t = p->x->be;
    struct tcp_peer *tp = p->be;
    if (tp)
        tp->close_req = true;
    else /* the backend is done with it already: nothing in flight */
        kv__xport_peer_closed(p, KV_OK, "closed");
    wake(t);
}

const struct kv__xport_ops kv__xport_tcp_ops = {
    .version = KV__XPORT_OPS_VERSION,
    .kind = KV_XPORT_TCP,
    .name = "tcp",
    .start = tcp_start,
    .stop = tcp_stop,
    .connect = tcp_connect,
    .mem_reg = tcp_mem_reg,
    .mem_dereg = tcp_mem_dereg,
    .mem_key = tcp_mem_key,
    .post = tcp_post,
    .cancel = tcp_cancel,
    .peer_close = tcp_peer_close,
};

/* ---- received frames ------------------------------------------------ */

/* Result of handling a frame: keep going, or close (the peer, or this
 * unbound connection) with a status and a message. */
struct verdict {
    kv_status st;
    char msg[200];
};

#define OK_VERDICT ((struct verdict){.st = KV_OK})

static struct verdict bad(kv_status st, const char *fmt, ...) KV_PRINTF(2, 3);
static struct verdict bad(kv_status st, const char *fmt, ...)
{
    struct verdict v = {.st = st};
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(v.msg, sizeof(v.msg), fmt, ap);
    va_end(ap);
    return v;
}

/* mu held: the notifications of tp that may go now, in post order. */
static bool notes_flush(struct tcp_peer *tp)
{
    for (kv_xport_xfer *xf = tp->p->xfers; xf; xf = xf->next) {
        if (!xf->has_note || xf->note_sent || xf->cancel_req)
            continue;
        if (!kv__xport_note_may_go(xf))
            break;
        struct conn *c = tp->conns[0];
        struct kv__xf f = {.type = KV__XF_NOTIFY, .xfer = xf->id, .offset = xf->note_tag};
        if (!ctl_put(c, f, xf->note, xf->note_len))
            return false;
        xf->note_sent = true;
    }
    return true;
}

/* mu held: settle every transfer of tp whose entries have all ended. */
static void settle_all(struct tcp_peer *tp)
{
    for (kv_xport_xfer *xf = tp->p->xfers, *nx; xf; xf = nx) {
        nx = xf->next;
        if (!xf->left && !xf->busy)
            kv__xport_xfer_settle(xf);
    }
}

/* mu held: a HELLO on an incoming connection before its peer is known. */
static struct verdict hello_in(struct tcp *t, struct conn *c, const struct kv__xport_hello *h)
{
    kv_xport *x = t->x;
    char why[160];
    if (kv__xport_hello_check(x, h, why, sizeof(why)) != KV_OK) {
        (void)ctl_put(c, (struct kv__xf){.type = KV__XF_REFUSE}, why, (uint32_t)strlen(why));
        return bad(KV_ERR_MISMATCH, "%s", why);
    }
    if (h->echo != 0 || h->nonce == 0)
        return bad(KV_ERR_CORRUPT, "xport handshake: an incoming HELLO that answers 0x%016" PRIx64,
                   h->echo);
    struct tcp_peer *tp = NULL;
    for (struct tcp_peer *q = t->peers; q; q = q->next)
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
        tp->deadline_ns = kv__xport_now_ns() + (uint64_t)x->cfg.timeout_ms * 1000000ull;
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
    if (!put_hello(t, c, tp->p, tp->n_conns))
        return bad(KV_ERR_NO_MEMORY, "xport handshake: control buffer");
    if (++tp->n_up == tp->n_conns)
        kv__xport_peer_ready(tp->p);
    return OK_VERDICT;
}

/* mu held: a HELLO answering ours on an outgoing connection. */
static struct verdict hello_out(struct tcp *t, struct conn *c, const struct kv__xport_hello *h)
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
    return OK_VERDICT;
}

/* mu held: a header arrived (decoded into c->f): set up its payload. */
static struct verdict on_header(struct conn *c)
{
    const struct kv__xf *f = &c->f;
    struct tcp_peer *tp = c->tp;
    const bool bound = tp && c->up;
    if (f->length > KV__TCP_MAX_FRAME)
        return bad(KV_ERR_CORRUPT, "xport tcp: a frame of %" PRIu64 " payload bytes (limit %u)",
                   f->length, KV__TCP_MAX_FRAME);
    if (!bound && f->type != KV__XF_HELLO && f->type != KV__XF_REFUSE)
        return bad(KV_ERR_CORRUPT, "xport tcp: frame type %u before the handshake",
                   (unsigned)f->type);
    c->got = 0;
    kv__xxh3_reset(&c->hs);
    switch (f->type) {
    case KV__XF_HELLO:
    case KV__XF_REFUSE:
    case KV__XF_NOTIFY:
        if (bound && f->type != KV__XF_NOTIFY)
            return bad(KV_ERR_CORRUPT, "xport tcp: a handshake frame after the handshake");
        if ((f->type == KV__XF_HELLO && f->length != KV__XPORT_HELLO_BYTES) ||
            f->length > sizeof(c->small))
            return bad(KV_ERR_CORRUPT, "xport tcp: frame type %u with %" PRIu64 " bytes",
                       (unsigned)f->type, f->length);
        c->ph = RX_SMALL;
        c->dst = (char *)c->small;
        return OK_VERDICT;
    case KV__XF_WRITE:
        /* entry: the piece count; offset: XXH3 of the descriptor table,
         * checked before any piece lands (a damaged table must not steer
         * bytes anywhere). */
        if (f->entry == 0 || f->entry > KV__TCP_MAXV ||
            f->length < (uint64_t)f->entry * KV__TCP_DESC)
            return bad(KV_ERR_CORRUPT, "xport tcp: a WRITE of %u pieces in %" PRIu64 " bytes",
                       f->entry, f->length);
        c->ph = RX_DESC;
        c->dst = (char *)c->small;
        return OK_VERDICT;
    case KV__XF_RDATA: {
        kv_xport_xfer *xf = kv__xport_xfer_find(tp->p, f->xfer);
        if (!xf || xf->cancel_req) { /* ended or ending: nothing more lands */
            c->ph = RX_DISCARD;
            return OK_VERDICT;
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
        return OK_VERDICT;
    }
    case KV__XF_ACK:
        if (f->entry != KV__XF_ENTRY_NOTE) { /* a WRITE's: one record per piece */
            if (f->entry == 0 || f->entry > KV__TCP_MAXV || f->length != (uint64_t)f->entry * 16)
                return bad(KV_ERR_CORRUPT, "xport tcp: an ACK of %u pieces in %" PRIu64 " bytes",
                           f->entry, f->length);
            c->ph = RX_SMALL;
            c->dst = (char *)c->small;
            return OK_VERDICT;
        }
        /* A notification's ACK has no payload: as a NACK's. */
        /* fall through */
    case KV__XF_NACK: {
        if (f->length)
            return bad(KV_ERR_CORRUPT, "xport tcp: a NACK with payload");
        kv_xport_xfer *xf = kv__xport_xfer_find(tp->p, f->xfer);
        if (!xf)
            return OK_VERDICT; /* ended already (timed out, cancelled) */
        if (f->type == KV__XF_ACK) {
            if (!xf->note_sent)
                return bad(KV_ERR_CORRUPT, "xport tcp: an ACK of a notification not sent");
            xf->note_done = true;
        } else if (f->entry >= xf->n) {
            return bad(KV_ERR_CORRUPT, "xport tcp: a NACK of entry %u of a transfer of %u",
                       f->entry, xf->n);
        } else {
            const kv_status s = (kv_status)(int64_t)f->offset;
            kv__xport_entry_end(xf, f->entry, s < 0 ? s : KV_ERR_IO);
        }
        settle_all(tp);
        return OK_VERDICT;
    }
    case KV__XF_READ:
        if (f->length != 8)
            return bad(KV_ERR_CORRUPT, "xport tcp: a READ with %" PRIu64 " payload bytes (8)",
                       f->length);
        c->ph = RX_SMALL;
        c->dst = (char *)c->small;
        return OK_VERDICT;
    case KV__XF_BYE:
        return bad(KV_OK, "closed by the peer");
    }
    return bad(KV_ERR_CORRUPT, "xport tcp: frame type %u", (unsigned)f->type);
}

/* mu held: a READ's payload (its length) arrived: queue the read on c,
 * or NACK it when it is not inside a region exposed to the peer. */
static struct verdict serve_read(struct conn *c)
{
    const struct kv__xf *f = &c->f;
    uint64_t len = 0;
    for (int i = 7; i >= 0; i--)
        len = (len << 8) | c->small[i];
    kv_xport_mem *m = len ? kv__xport_exposed(c->tp->p, f->region, f->offset, len) : NULL;
    if (!m) {
        struct kv__xf n = {.type = KV__XF_NACK,
                           .xfer = f->xfer,
                           .entry = f->entry,
                           .offset = (uint64_t)(int64_t)KV_ERR_OUT_OF_BOUNDS};
        return ctl_put(c, n, NULL, 0) ? OK_VERDICT
                                      : bad(KV_ERR_NO_MEMORY, "xport tcp: control buffer");
    }
    struct serve *s = kv__mem_calloc(1, sizeof(*s));
    if (!s)
        return bad(KV_ERR_NO_MEMORY, "xport tcp: a read to serve");
    s->xfer = f->xfer;
    s->entry = f->entry;
    s->mem = m;
    m->users++;
    s->off = f->offset;
    s->len = len;
    if (c->srv_tail)
        c->srv_tail->next = s;
    else
        c->srv_head = s;
    c->srv_tail = s;
    return OK_VERDICT;
}

/* mu held: a WRITE's descriptor table arrived (c->small): check it whole,
 * then say where each piece lands (NULL: not inside a region exposed to
 * this peer: dropped, refused in the ACK). */
static struct verdict on_desc(struct conn *c)
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
        kv_xport_mem *m = kv__xport_exposed(c->tp->p, region, off, len);
        c->rx_entry[i] = (uint32_t)kv__le_get(d, 4);
        c->rx_len[i] = len;
        c->rx_mem[i] = m;
        c->rx_dst[i] = m ? m->base + off : NULL;
        if (m)
            m->landing++;
    }
    c->rx_k = k;
    c->rx_p = 0;
    c->rx_pgot = 0;
    kv__xxh3_reset(&c->hs);
    c->ph = RX_PIECES;
    return OK_VERDICT;
}

/* mu held: every piece of a WRITE arrived: one ACK with a record per
 * piece {entry, status, bytes}: KV_OK, KV_ERR_OUT_OF_BOUNDS (refused,
 * not written) or KV_ERR_CORRUPT (the data failed its checksum). */
static struct verdict on_pieces(struct conn *c, bool sum_ok)
{
    unsigned char rec[KV__TCP_MAXV * 16];
    for (uint32_t i = 0; i < c->rx_k; i++) {
        const kv_status st = !c->rx_dst[i] ? KV_ERR_OUT_OF_BOUNDS : sum_ok ? KV_OK : KV_ERR_CORRUPT;
        kv__le_put(rec + 16 * i, c->rx_entry[i], 4);
        kv__le_put(rec + 16 * i + 4, (uint32_t)(int32_t)st, 4);
        kv__le_put(rec + 16 * i + 8, c->rx_len[i], 8);
    }
    struct kv__xf a = {.type = KV__XF_ACK, .xfer = c->f.xfer, .entry = c->rx_k};
    c->rx_k = 0;
    return ctl_put(c, a, rec, 16 * a.entry) ? OK_VERDICT
                                            : bad(KV_ERR_NO_MEMORY, "xport tcp: control buffer");
}

/* mu held: the ACK of one of our WRITEs (c->small: a record per piece). */
static struct verdict on_acks(struct conn *c)
{
    struct tcp_peer *tp = c->tp;
    kv_xport_xfer *xf = kv__xport_xfer_find(tp->p, c->f.xfer);
    if (!xf)
        return OK_VERDICT; /* ended already (timed out, cancelled) */
    for (uint32_t i = 0; i < c->f.entry; i++) {
        const unsigned char *r = c->small + 16 * i;
        const uint32_t e = (uint32_t)kv__le_get(r, 4);
        const kv_status st = (kv_status)(int32_t)(uint32_t)kv__le_get(r + 4, 4);
        const uint64_t bytes = kv__le_get(r + 8, 8);
        if (e >= xf->n || xf->read)
            return bad(KV_ERR_CORRUPT, "xport tcp: an ACK of entry %u of transfer %" PRIu64, e,
                       xf->id);
        if (xf->ended[e])
            continue;
        if (st != KV_OK) {
            kv__xport_entry_end(xf, e, st < 0 ? st : KV_ERR_IO);
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
    if (!notes_flush(tp))
        return bad(KV_ERR_NO_MEMORY, "xport tcp: control buffer");
    settle_all(tp);
    return OK_VERDICT;
}

/* mu held: the payload of c->f is complete. */
static struct verdict on_payload(struct tcp *t, struct conn *c)
{
    const struct kv__xf *f = &c->f;
    struct tcp_peer *tp = c->tp;
    const bool sum_ok = f->length == 0 || kv__xxh3_digest(&c->hs) == f->payload_sum;
    switch (c->ph) {
    case RX_SMALL:
        if (!sum_ok)
            return bad(KV_ERR_CORRUPT, "xport tcp: frame type %u fails its payload checksum",
                       (unsigned)f->type);
        if (f->type == KV__XF_NOTIFY) {
            if (kv__xport_note_push(tp->p, f->offset, c->small, (uint32_t)f->length) != KV_OK)
                return bad(KV_ERR_NO_MEMORY, "xport tcp: a notification");
            struct kv__xf a = {.type = KV__XF_ACK, .xfer = f->xfer, .entry = KV__XF_ENTRY_NOTE};
            if (!ctl_put(c, a, NULL, 0))
                return bad(KV_ERR_NO_MEMORY, "xport tcp: control buffer");
            return OK_VERDICT;
        }
        if (f->type == KV__XF_READ)
            return serve_read(c);
        if (f->type == KV__XF_ACK)
            return on_acks(c);
        if (f->type == KV__XF_REFUSE) {
            char m[200];
            const size_t n = f->length < sizeof(m) - 1 ? (size_t)f->length : sizeof(m) - 1;
            memcpy(m, c->small, n);
            m[n] = 0;
            for (size_t i = 0; i < n; i++)
                if ((unsigned char)m[i] < 32 || (unsigned char)m[i] > 126)
                    m[i] = '?';
            return bad(KV_ERR_MISMATCH, "refused by the peer: %s", m);
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
            kv__xport_entry_end(xf, f->entry, KV_ERR_CORRUPT);
        } else {
            xf->moved[f->entry] += f->length;
            if (xf->moved[f->entry] == xf->ios[f->entry].bytes)
                kv__xport_entry_end(xf, f->entry, KV_OK);
        }
        settle_all(tp);
        return OK_VERDICT;
    }
    case RX_PIECES:
        return on_pieces(c, sum_ok);
    case RX_DESC:
    case RX_DISCARD:
    case RX_HDR:
        break;
    }
    return OK_VERDICT;
}

/* Receive on c until EAGAIN or the round's budget: mu held on entry and
 * exit, dropped around recv. */
static struct verdict conn_rx(struct tcp *t, struct conn *c)
{
    kv_xport *x = t->x;
    uint64_t budget = KV__TCP_RX_BUDGET;
    while (budget) {
        struct iovec iov[KV__TCP_MAXV];
        int niov = 1;
        if (c->ph == RX_HDR) {
            iov[0] = (struct iovec){c->hdr + c->hdr_got, KV__XF_BYTES - c->hdr_got};
        } else if (c->ph == RX_PIECES) {
            /* The pieces in place, in one call; a dropped one alone. */
            const uint64_t rest = c->rx_len[c->rx_p] - c->rx_pgot;
            if (!c->rx_dst[c->rx_p]) {
                iov[0] = (struct iovec){t->scratch, rest < sizeof(t->scratch) ? (size_t)rest
                                                                              : sizeof(t->scratch)};
            } else {
                iov[0] = (struct iovec){c->rx_dst[c->rx_p] + c->rx_pgot, (size_t)rest};
                for (uint32_t p = c->rx_p + 1; p < c->rx_k && c->rx_dst[p]; p++)
                    iov[niov++] = (struct iovec){c->rx_dst[p], (size_t)c->rx_len[p]};
            }
        } else {
            const uint64_t end =
                c->ph == RX_DESC ? (uint64_t)c->f.entry * KV__TCP_DESC : c->f.length;
            const size_t want = (size_t)(end - c->got);
            if (c->ph == RX_DISCARD)
                iov[0] = (struct iovec){t->scratch,
                                        want < sizeof(t->scratch) ? want : sizeof(t->scratch)};
            else
                iov[0] = (struct iovec){c->dst + c->got, want};
        }
        ssize_t r = 0;
        if (iov[0].iov_len) {
            struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)niov};
            pthread_mutex_unlock(&x->mu);
            r = recvmsg(c->fd, &mh, MSG_DONTWAIT);
            const int e = errno;
            pthread_mutex_lock(&x->mu);
            if (r == 0)
                return bad(KV_ERR_IO, "xport tcp: connection lost (closed by the other end)");
            if (r < 0) {
                if (e == EAGAIN || e == EWOULDBLOCK || e == EINTR)
                    return OK_VERDICT;
                return bad(KV_ERR_IO, "xport tcp: recv: %s", strerror(e));
            }
            budget -= (uint64_t)r < budget ? (uint64_t)r : budget;
        }
        if (c->ph == RX_HDR) {
            c->hdr_got += (size_t)r;
            if (c->hdr_got < KV__XF_BYTES)
                continue;
            c->hdr_got = 0;
            const kv_status ds = kv__xf_decode(c->hdr, &c->f);
            if (ds != KV_OK)
                return bad(ds, "%s", kv_last_error());
            struct verdict v = on_header(c);
            if (v.st != KV_OK || v.msg[0])
                return v;
            if (c->ph == RX_HDR)
                continue; /* a frame without payload, handled */
            if (c->f.length)
                continue;
        } else if (c->ph == RX_PIECES) {
            /* Hash what landed, piece by piece; a finished piece is no
             * longer landing (unexpose may proceed). */
            size_t n = (size_t)r;
            for (int k = 0; k < niov && n; k++) {
                const size_t take = n < iov[k].iov_len ? n : iov[k].iov_len;
                kv__xxh3_update(&c->hs, iov[k].iov_base, take);
                n -= take;
                c->rx_pgot += take;
                if (c->rx_pgot == c->rx_len[c->rx_p]) {
                    if (c->rx_mem[c->rx_p]) {
                        c->rx_mem[c->rx_p]->landing--;
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
            if (c->ph != RX_DISCARD)
                kv__xxh3_update(&c->hs, iov[0].iov_base, (size_t)r);
            c->got += (uint64_t)r;
            if (c->got < (c->ph == RX_DESC ? (uint64_t)c->f.entry * KV__TCP_DESC : c->f.length))
                continue;
            if (c->ph == RX_DESC) {
                struct verdict v = on_desc(c);
                if (v.st != KV_OK || v.msg[0])
                    return v;
                continue;
            }
        }
        struct verdict v = on_payload(t, c);
        c->ph = RX_HDR;
        if (v.st != KV_OK || v.msg[0])
            return v;
    }
    return OK_VERDICT;
}

/* ---- sending -------------------------------------------------------- */

/* mu held: c's data frame from a header and df_k pieces (df_src/df_len). */
static void frame_start(struct conn *c, struct kv__xf *f, uint32_t desc_bytes)
{
    uint64_t data = 0;
    for (uint32_t i = 0; i < c->df_k; i++)
        data += c->df_len[i];
    f->version = KV_XPORT_PROTOCOL_VERSION;
    f->conn = c->index;
    f->length = desc_bytes + data;
    kv__xf_encode(f, c->df_hdr);
    c->df_desc_bytes = desc_bytes;
    c->df_total = KV__XF_BYTES + desc_bytes + data;
    c->df_sent = 0;
    c->df_on = true;
}

/* mu held: the next data frame for c, or false when there is none: the
 * reads c serves first (they came on c), then the peer's writes in post
 * order, and the READ requests of its reads (control frames). A WRITE
 * gathers up to KV__TCP_MAXV pieces and KV__TCP_CHUNK bytes of one
 * transfer's entries, split where an entry is larger. */
static bool next_frame(struct tcp_peer *tp, struct conn *c)
{
    if (c->srv_head) {
        struct serve *s = c->srv_head;
        const uint64_t len = s->len - s->sent < KV__TCP_CHUNK ? s->len - s->sent : KV__TCP_CHUNK;
        const char *src = s->mem->base + s->off + s->sent;
        struct kv__xf f = {.type = KV__XF_RDATA,
                           .entry = s->entry,
                           .xfer = s->xfer,
                           .offset = s->sent,
                           .payload_sum = kv__xxh3_64(src, (size_t)len)};
        c->df_k = 1;
        c->df_src[0] = src;
        c->df_len[0] = len;
        c->df_srv = s;
        c->df_t = NULL;
        s->sent += len;
        frame_start(c, &f, 0);
        return true;
    }
    for (kv_xport_xfer *xf = tp->p->xfers; xf; xf = xf->next) {
        if (xf->cancel_req || xf->be_entry >= xf->n)
            continue;
        if (xf->read) {
            /* One READ per entry, round robin over the connections. */
            const uint32_t e = (uint32_t)xf->be_entry++;
            const struct kv_xport_io *io = &xf->ios[e];
            struct kv__xf f = {.type = KV__XF_READ,
                               .xfer = xf->id,
                               .entry = e,
                               .region = io->remote->region,
                               .offset = io->remote_off};
            unsigned char len[8];
            kv__le_put(len, io->bytes, 8);
            struct conn *rc = tp->conns[e % tp->n_conns];
            if (!ctl_put(rc, f, len, sizeof(len)))
                return false;
            return next_frame(tp, c);
        }
        struct kv__xxh3_state hs;
        kv__xxh3_reset(&hs);
        uint32_t k = 0;
        uint64_t bytes = 0;
        while (k < KV__TCP_MAXV && bytes < KV__TCP_CHUNK && xf->be_entry < xf->n) {
            const uint32_t e = (uint32_t)xf->be_entry;
            const struct kv_xport_io *io = &xf->ios[e];
            const uint64_t rest = io->bytes - xf->be_off;
            const uint64_t len = rest < KV__TCP_CHUNK - bytes ? rest : KV__TCP_CHUNK - bytes;
            unsigned char *d = c->df_desc + (size_t)k * KV__TCP_DESC;
            kv__le_put(d, e, 4);
            kv__le_put(d + 4, io->remote->region, 4);
            kv__le_put(d + 8, io->remote_off + xf->be_off, 8);
            kv__le_put(d + 16, len, 8);
            c->df_src[k] = io->local->base + io->local_off + xf->be_off;
            c->df_len[k] = len;
            kv__xxh3_update(&hs, c->df_src[k], (size_t)len);
            k++;
            bytes += len;
            xf->be_off += len;
            if (xf->be_off == io->bytes) {
                xf->be_entry++;
                xf->be_off = 0;
            }
        }
        struct kv__xf f = {.type = KV__XF_WRITE,
                           .entry = k,
                           .xfer = xf->id,
                           .offset = kv__xxh3_64(c->df_desc, (size_t)k * KV__TCP_DESC),
                           .payload_sum = kv__xxh3_digest(&hs)};
        c->df_k = k;
        c->df_t = xf;
        c->df_srv = NULL;
        xf->busy++;
        frame_start(c, &f, k * KV__TCP_DESC);
        return true;
    }
    return false;
}

/* mu held: c has something to send. */
static bool tx_pending(struct conn *c)
{
    return c->df_on || c->ctl_off < c->ctl_len;
}

/* mu held: c's data frame is on the wire whole. */
static void frame_done(struct conn *c)
{
    c->df_on = false;
    if (c->df_t) {
        c->df_t->busy--;
        c->df_t = NULL;
    }
    if (c->df_srv && c->df_srv->sent == c->df_srv->len) {
        struct serve *s = c->df_srv;
        c->srv_head = s->next;
        if (!c->srv_head)
            c->srv_tail = NULL;
        s->mem->users--;
        kv__mem_free(s);
    }
    c->df_srv = NULL;
}

/* The unsent rest of c's data frame as iovecs (at most 2 + MAXV). */
static int frame_iov(const struct conn *c, struct iovec *iov)
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
    for (uint32_t i = 0; i < c->df_k; i++) {
        if (skip >= c->df_len[i]) {
            skip -= c->df_len[i];
            continue;
        }
        iov[k++] = (struct iovec){(char *)c->df_src[i] + skip, (size_t)(c->df_len[i] - skip)};
        skip = 0;
    }
    return k;
}

/* Send on c until EAGAIN: mu held on entry and exit, dropped around send.
 * Control frames go between data frames, never inside one. */
static struct verdict conn_tx(struct tcp *t, struct conn *c)
{
    kv_xport *x = t->x;
    for (;;) {
        const bool ctl = c->ctl_off < c->ctl_len;
        if (!c->df_on && !ctl && (!c->tp || !c->up || !next_frame(c->tp, c)) &&
            c->ctl_off == c->ctl_len)
            return OK_VERDICT;
        ssize_t r;
        int e = 0;
        if (c->ctl_off < c->ctl_len && (!c->df_on || c->df_sent == 0)) {
            const unsigned char *p = c->ctl + c->ctl_off;
            const size_t n = c->ctl_len - c->ctl_off;
            pthread_mutex_unlock(&x->mu);
            r = send(c->fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
            e = errno;
            pthread_mutex_lock(&x->mu);
            if (r > 0)
                c->ctl_off += (size_t)r;
        } else {
            struct iovec iov[2 + KV__TCP_MAXV];
            struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)frame_iov(c, iov)};
            pthread_mutex_unlock(&x->mu);
            r = sendmsg(c->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
            e = errno;
            pthread_mutex_lock(&x->mu);
            if (r > 0) {
                c->df_sent += (uint64_t)r;
                if (c->df_sent == c->df_total)
                    frame_done(c);
            }
        }
        if (r < 0) {
            if (e == EAGAIN || e == EWOULDBLOCK || e == EINTR)
                return OK_VERDICT;
            return bad(KV_ERR_IO, "xport tcp: send: %s", strerror(e));
        }
    }
}

/* ---- the progress loop ---------------------------------------------- */

static void unbound_drop(struct tcp *t, uint32_t i)
{
    conn_free(t->unbound[i]);
    t->unbound[i] = t->unbound[--t->n_unbound];
}

static void accept_all(struct tcp *t)
{
    for (;;) {
        const int fd = accept4(t->lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0)
            return;
        tune(fd);
        if (t->n_unbound == t->cap_unbound) {
            const uint32_t cap = t->cap_unbound ? 2 * t->cap_unbound : 8;
            struct conn **u = kv__mem_alloc(cap * sizeof(*u));
            if (!u) {
                close(fd);
                return;
            }
            if (t->n_unbound)
                memcpy(u, t->unbound, t->n_unbound * sizeof(*u));
            kv__mem_free(t->unbound);
            t->unbound = u;
            t->cap_unbound = cap;
        }
        struct conn *c = conn_new(fd);
        if (!c) {
            close(fd);
            return;
        }
        c->deadline_ns = kv__xport_now_ns() + (uint64_t)t->x->cfg.timeout_ms * 1000000ull;
        t->unbound[t->n_unbound++] = c;
    }
}

/* mu held: deadlines and cancels of tp's transfers; false when tp was
 * closed. */
static bool sweep(struct tcp *t, struct tcp_peer *tp, uint64_t now)
{
    kv_xport_peer *p = tp->p;
    if (p->state == KV_XPORT_CONNECTING && now >= tp->deadline_ns) {
        peer_fail(t, tp, KV_ERR_TIMEOUT, "xport: handshake not done within the timeout");
        return false;
    }
    for (kv_xport_xfer *xf = p->xfers, *nx; xf; xf = nx) {
        nx = xf->next;
        if (xf->cancel_req && !xf->busy) {
            kv__xport_xfer_end(xf, KV_XPORT_CANCELLED, KV_ERR_CANCELLED);
        } else if (now >= xf->deadline_ns) {
            const bool busy = xf->busy != 0;
            const bool cancel = xf->cancel_req;
            char m[160];
            snprintf(m, sizeof(m),
                     "xport tcp: transfer %" PRIu64 " not done within %u ms with a frame of it "
                     "on the wire: the connection is closed",
                     xf->id, t->x->cfg.timeout_ms);
            kv__xport_xfer_end(xf, cancel ? KV_XPORT_CANCELLED : KV_XPORT_TIMED_OUT,
                               cancel ? KV_ERR_CANCELLED : KV_ERR_TIMEOUT);
            if (busy) {
                peer_fail(t, tp, KV_ERR_TIMEOUT, m);
                return false;
            }
        }
    }
    if (p->state == KV_XPORT_READY && !notes_flush(tp)) {
        peer_fail(t, tp, KV_ERR_NO_MEMORY, "xport tcp: control buffer");
        return false;
    }
    settle_all(tp);
    return true;
}

static uint64_t next_deadline(struct tcp *t)
{
    uint64_t d = UINT64_MAX;
    for (uint32_t i = 0; i < t->n_unbound; i++)
        d = t->unbound[i]->deadline_ns < d ? t->unbound[i]->deadline_ns : d;
    for (struct tcp_peer *tp = t->peers; tp; tp = tp->next) {
        if (tp->p->state == KV_XPORT_CONNECTING)
            d = tp->deadline_ns < d ? tp->deadline_ns : d;
        for (kv_xport_xfer *xf = tp->p->xfers; xf; xf = xf->next)
            d = xf->deadline_ns < d ? xf->deadline_ns : d;
    }
    return d;
}

static bool pfd_reserve(struct tcp *t, uint32_t n)
{
    if (n <= t->cap_pfd)
        return true;
    uint32_t cap = t->cap_pfd ? t->cap_pfd : 16;
    while (cap < n)
        cap *= 2;
    struct pollfd *p = kv__mem_alloc(cap * sizeof(*p));
    struct conn **c = kv__mem_alloc(cap * sizeof(*c));
    if (!p || !c) {
        kv__mem_free(p);
        kv__mem_free(c);
        return false;
    }
    kv__mem_free(t->pfd);
    kv__mem_free(t->pconn);
    t->pfd = p;
    t->pconn = c;
    t->cap_pfd = cap;
    return true;
}

static void *progress(void *arg)
{
    struct tcp *t = arg;
    kv_xport *x = t->x;
    pthread_mutex_lock(&x->mu);
    while (!t->stop) {
        /* Closes the user asked for. */
        for (struct tcp_peer *tp = t->peers, *nx; tp; tp = nx) {
            nx = tp->next;
            if (tp->close_req)
                peer_bye(t, tp, KV_OK, "closed");
        }
        const uint64_t now = kv__xport_now_ns();
        for (struct tcp_peer *tp = t->peers, *nx; tp; tp = nx) {
            nx = tp->next;
            sweep(t, tp, now);
        }
        for (uint32_t i = 0; i < t->n_unbound;)
            if (t->unbound[i]->dead || now >= t->unbound[i]->deadline_ns)
                unbound_drop(t, i);
            else
                i++;
        /* Fill the poll set: wake pipe, listener, every connection. */
        uint32_t n = 2 + t->n_unbound;
        for (struct tcp_peer *tp = t->peers; tp; tp = tp->next)
            n += tp->n_conns;
        if (!pfd_reserve(t, n)) {
            pthread_mutex_unlock(&x->mu);
            usleep(1000);
            pthread_mutex_lock(&x->mu);
            continue;
        }
        uint32_t k = 0;
        t->pfd[k] = (struct pollfd){.fd = t->wake[0], .events = POLLIN};
        t->pconn[k++] = NULL;
        t->pfd[k] = (struct pollfd){.fd = t->lfd, .events = POLLIN};
        t->pconn[k++] = NULL;
        for (uint32_t i = 0; i < t->n_unbound; i++) {
            struct conn *c = t->unbound[i];
            t->pfd[k] = (struct pollfd){.fd = c->fd,
                                        .events = (short)(POLLIN | (tx_pending(c) ? POLLOUT : 0))};
            t->pconn[k++] = c;
        }
        for (struct tcp_peer *tp = t->peers; tp; tp = tp->next)
            for (uint32_t i = 0; i < tp->n_conns; i++) {
                struct conn *c = tp->conns[i];
                if (!c)
                    continue;
                bool out = c->connecting || tx_pending(c) || c->srv_head;
                if (!out && c->up)
                    for (kv_xport_xfer *xf = tp->p->xfers; xf && !out; xf = xf->next)
                        out = !xf->cancel_req && xf->be_entry < xf->n;
                t->pfd[k] =
                    (struct pollfd){.fd = c->fd, .events = (short)(POLLIN | (out ? POLLOUT : 0))};
                t->pconn[k++] = c;
            }
        const uint64_t d = next_deadline(t);
        const uint64_t now2 = kv__xport_now_ns();
        int ms = d == UINT64_MAX ? 1000 : d <= now2 ? 0 : (int)((d - now2) / 1000000u + 1);
        ms = ms > 1000 ? 1000 : ms;
        pthread_mutex_unlock(&x->mu);
        const int r = poll(t->pfd, k, ms);
        pthread_mutex_lock(&x->mu);
        if (r <= 0)
            continue;
        if (t->pfd[0].revents) {
            char b[64];
            while (read(t->wake[0], b, sizeof(b)) > 0) {
            }
        }
        if (t->pfd[1].revents && t->lfd >= 0)
            accept_all(t);
        /* Connections: a peer closed while handling one of its connections
         * leaves dangling entries behind it, so look each one up again. */
        for (uint32_t i = 2; i < k; i++) {
            struct conn *c = t->pconn[i];
            const short ev = t->pfd[i].revents;
            if (!ev)
                continue;
            bool live = false;
            struct tcp_peer *owner = NULL;
            for (uint32_t j = 0; j < t->n_unbound && !live; j++)
                live = t->unbound[j] == c;
            for (struct tcp_peer *tp = t->peers; tp && !live; tp = tp->next)
                for (uint32_t j = 0; j < tp->n_conns && !live; j++)
                    if (tp->conns[j] == c) {
                        live = true;
                        owner = tp;
                    }
            if (!live || c->dead)
                continue;
            struct verdict v = OK_VERDICT;
            if (c->connecting && (ev & (POLLOUT | POLLERR | POLLHUP))) {
                int err = 0;
                socklen_t el = sizeof(err);
                getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &el);
                if (err) {
                    v = bad(KV_ERR_IO, "xport tcp: connect: %s", strerror(err));
                } else {
                    c->connecting = false;
                    if (!put_hello(t, c, owner->p, owner->n_conns))
                        v = bad(KV_ERR_NO_MEMORY, "xport tcp: control buffer");
                }
            }
            if (v.st == KV_OK && !v.msg[0] && !c->connecting && (ev & (POLLIN | POLLHUP | POLLERR)))
                v = conn_rx(t, c);
            if (v.st == KV_OK && !v.msg[0] && !c->connecting)
                v = conn_tx(t, c);
            if (v.st == KV_OK && !v.msg[0])
                continue;
            /* A bound connection takes its peer with it; an unbound one
             * goes alone (after its REFUSE, if any, had its chance). */
            if (c->tp && (c->up || c->tp->p->outgoing)) {
                peer_fail(t, c->tp, v.st, v.msg);
            } else {
                if (c->ctl_off < c->ctl_len)
                    (void)send(c->fd, c->ctl + c->ctl_off, c->ctl_len - c->ctl_off,
                               MSG_NOSIGNAL | MSG_DONTWAIT);
                c->dead = true;
            }
        }
    }
    pthread_mutex_unlock(&x->mu);
    return NULL;
}
