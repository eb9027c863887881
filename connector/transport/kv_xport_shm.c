/*
 * kv_xport_shm.c - the same-host backend of the transport seam
 * (KV_XPORT_SHM; the design in kv_xport_shm_int.h): the ops table, peers,
 * the progress loop and the send scheduler.
 *
 * One progress thread per transport, as TCP's: it alone touches the
 * sockets, the rings and the memory of transfers and exposures, and drops
 * x->mu only around its copies, with what it copies held (a busy transfer,
 * a busy exposure, a read being served: srv_cur). A write's bytes are
 * copied from the source into a free slot of our ring and described in a
 * DATA; the peer's thread copies them into place and ACKs: two copies on
 * two cores, pipelined over KV__SHM_SLOTS slots. A notification goes once
 * every entry of its transfer and of every earlier one on the peer is
 * acknowledged (landed), so the receiver queues it after the data.
 *
 * Deadlines, all timeout_ms: a transfer from its post (a write whose
 * pieces are already in the ring ends at once: its source is no longer
 * read, and their ACKs then only return the slots); a handshake from its
 * connect or accept; a peer that reads none of our control messages for
 * timeout_ms while some wait is closed. Messages are whole (SOCK_SEQPACKET):
 * there is no partial frame to stall.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <sys/un.h>
#include <unistd.h>
#include <linux/sockios.h>

#include "kv_mem.h"
#include "kv_xport_shm_int.h"

#define MAP_BYTES (2 * KV__SHM_RING_BYTES)

/* The backend's state: x->be, or x->be_shm in an AUTO transport (whose
 * x->be is TCP's). */
struct kv__shm *kv__shm_of(const kv_xport *x)
{
    return x->cfg.kind == KV_XPORT_AUTO ? x->be_shm : x->be;
}

#define bad kv__xport_bad

void kv__shm_wake(struct kv__shm *t)
{
    kv__xport_wake_pipe(t->wake[1]);
}

/* ---- the control stream --------------------------------------------- */

bool kv__shm_put(struct kv__shm_peer *tp, struct kv__shm_msg m, const void *p, uint32_t plen)
{
    if (tp->ctl_off && tp->ctl_off == tp->ctl_len)
        tp->ctl_off = tp->ctl_len = 0;
    if (tp->ctl_off > tp->ctl_cap / 2) {
        memmove(tp->ctl, tp->ctl + tp->ctl_off, tp->ctl_len - tp->ctl_off);
        tp->ctl_len -= tp->ctl_off;
        tp->ctl_off = 0;
    }
    const size_t need = 4 + KV__SHM_HDR + plen;
    unsigned char *b =
        kv__mem_grow(tp->ctl, &tp->ctl_cap, tp->ctl_len, tp->ctl_len + need, 1, 4096);
    if (!b)
        return false;
    tp->ctl = b;
    if (tp->ctl_off == tp->ctl_len)
        tp->tx_since_ns = kv__now_ns();
    m.version = KV_XPORT_PROTOCOL_VERSION;
    m.plen = plen;
    unsigned char *at = tp->ctl + tp->ctl_len;
    kv__le_put(at, KV__SHM_HDR + plen, 4);
    kv__shm_msg_encode(&m, at + 4);
    if (plen)
        memcpy(at + 4 + KV__SHM_HDR, p, plen);
    tp->ctl_len += need;
    return true;
}

struct kv__xport_verdict kv__shm_flush(struct kv__shm_peer *tp)
{
    while (tp->ctl_off < tp->ctl_len) {
        const size_t n = (size_t)kv__le_get(tp->ctl + tp->ctl_off, 4);
        const ssize_t r = send(tp->fd, tp->ctl + tp->ctl_off + 4, n, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (r < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)
                return KV__XPORT_OK;
            return bad(KV_ERR_IO, "xport shm: send: %s", strerror(errno));
        }
        tp->ctl_off += 4 + n;
        tp->tx_since_ns = kv__now_ns();
    }
    return KV__XPORT_OK;
}

struct kv__xport_verdict kv__shm_hello(struct kv__shm *t, struct kv__shm_peer *tp, int fd)
{
    kv_xport *x = t->x;
    unsigned char b[KV__XPORT_HELLO_BYTES];
    const struct kv__xport_hello h = {.version = KV_XPORT_PROTOCOL_VERSION,
                                      .kind = (uint32_t)x->cfg.kind,
                                      .token = x->cfg.token,
                                      .fingerprint = x->cfg.fingerprint,
                                      .nonce = tp->p->nonce_local,
                                      .echo = tp->p->nonce_remote,
                                      .conns = x->cfg.conns_per_peer,
                                      .conn = 0};
    kv__xport_hello_encode(&h, b);
    /* AUTO: the listener's answer carries the secret its probe answers
     * gave (tag): the connecting side's proof that this socket is the
     * listener it asked over TCP (docs/connector.md, "Automatic choice") */
    const struct kv__shm_msg m = {.type = KV__SM_HELLO,
                                  .slot = KV__SHM_SLOTS,
                                  .len = KV__SHM_SLOT,
                                  .tag =
                                      fd < 0 && x->cfg.kind == KV_XPORT_AUTO ? x->auto_secret : 0};
    if (fd < 0)
        return kv__shm_put(tp, m, b, sizeof(b))
                   ? KV__XPORT_OK
                   : bad(KV_ERR_NO_MEMORY, "xport shm: control buffer");
    /* The connecting side's, with the memfd, on a fresh socket: sent now. */
    unsigned char msg[KV__SHM_HDR + KV__XPORT_HELLO_BYTES];
    struct kv__shm_msg mm = m;
    mm.version = KV_XPORT_PROTOCOL_VERSION;
    mm.plen = sizeof(b);
    kv__shm_msg_encode(&mm, msg);
    memcpy(msg + KV__SHM_HDR, b, sizeof(b));
    union {
        struct cmsghdr h;
        char b[CMSG_SPACE(sizeof(int))];
    } cm;
    memset(&cm, 0, sizeof(cm));
    struct iovec iov = {msg, sizeof(msg)};
    struct msghdr mh = {
        .msg_iov = &iov, .msg_iovlen = 1, .msg_control = cm.b, .msg_controllen = sizeof(cm.b)};
    struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof(int));
    if (sendmsg(tp->fd, &mh, MSG_DONTWAIT | MSG_NOSIGNAL) != (ssize_t)sizeof(msg))
        return bad(KV_ERR_IO, "xport shm: sending the HELLO: %s", strerror(errno));
    return KV__XPORT_OK;
}

/* F_SEAL_FUTURE_WRITE (Linux 5.1), where the C library does not name it */
#ifdef F_SEAL_FUTURE_WRITE
#define SEAL_FUTURE_WRITE F_SEAL_FUTURE_WRITE
#else
#define SEAL_FUTURE_WRITE 0x0010
#endif

struct kv__xport_verdict kv__shm_map(struct kv__shm_peer *tp, int fd, bool connecting)
{
    const int seals = fcntl(fd, F_GET_SEALS);
    struct stat sb;
    if (seals < 0 || !(seals & F_SEAL_SHRINK) || fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode))
        return bad(KV_ERR_CORRUPT,
                   "xport shm handshake: the ring's descriptor is not a memfd sealed against "
                   "shrinking (seals 0x%x)",
                   seals < 0 ? 0 : seals);
    /* shmem only: a hugetlbfs file with a hole punched in it could fault
     * (SIGBUS) when the copy reaches the hole */
    struct statfs fs;
    memset(&fs, 0, sizeof(fs));
    if (fstatfs(fd, &fs) != 0 || fs.f_type != 0x01021994 /* TMPFS_MAGIC */)
        return bad(KV_ERR_CORRUPT,
                   "xport shm handshake: the ring's memfd is not on shmem (file system 0x%lx)",
                   (unsigned long)fs.f_type);
    if ((uint64_t)sb.st_size != MAP_BYTES)
        return bad(KV_ERR_CORRUPT, "xport shm handshake: a ring memfd of %lld bytes (%" PRIu64 ")",
                   (long long)sb.st_size, (uint64_t)MAP_BYTES);
    /* ours to write into: opened read-write, not sealed against writes
     * (else the allocation or the mapping below fails, which is the
     * peer's descriptor, not our memory) */
    const int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || (fl & O_ACCMODE) != O_RDWR || (seals & (F_SEAL_WRITE | SEAL_FUTURE_WRITE)))
        return bad(KV_ERR_CORRUPT,
                   "xport shm handshake: the ring's memfd is not writable (%s, seals 0x%x)",
                   fl < 0 || (fl & O_ACCMODE) != O_RDWR ? "not opened read-write"
                                                        : "sealed against writes",
                   seals);
    /* Every page allocated now: a later shortage cannot fault a copy. */
    const int fe = posix_fallocate(fd, 0, (off_t)MAP_BYTES);
    if (fe != 0)
        return bad(KV_ERR_NO_MEMORY, "xport shm: allocating the %" PRIu64 "-byte ring: %s",
                   (uint64_t)MAP_BYTES, strerror(fe));
    void *p = mmap(NULL, MAP_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED)
        return bad(KV_ERR_NO_MEMORY, "xport shm: mapping the %" PRIu64 "-byte ring: %s",
                   (uint64_t)MAP_BYTES, strerror(errno));
    tp->map = p;
    tp->tx = tp->map + (connecting ? 0 : KV__SHM_RING_BYTES);
    tp->rx = tp->map + (connecting ? KV__SHM_RING_BYTES : 0);
    return KV__XPORT_OK;
}

/* ---- closing -------------------------------------------------------- */

/* mu held: serve s ends (RNACK its entry when nack). */
static void serve_end(struct kv__shm_peer *tp, struct kv__xport_serve *s, bool nack)
{
    if (nack) {
        struct kv__shm_msg n = {.type = KV__SM_RNACK,
                                .xfer = s->xfer,
                                .entry = s->entry,
                                .status = KV_ERR_OUT_OF_BOUNDS};
        (void)kv__shm_put(tp, n, NULL, 0); /* out of memory: the requester times out */
    }
    kv__xport_serve_end(&tp->srv_head, &tp->srv_tail, s, &tp->n_serves);
    kv__xport_signal(tp->p->x);
}

/* mu held: close tp (why, msg): its queued messages get one try, the
 * connection and the ring go, the peer ends with its transfers and the
 * backend's reference is dropped. tp is freed. */
static void peer_fail(struct kv__shm *t, struct kv__shm_peer *tp, kv_status why, const char *msg)
{
    for (struct kv__shm_peer **pp = &t->peers; *pp; pp = &(*pp)->next)
        if (*pp == tp) {
            *pp = tp->next;
            break;
        }
    (void)kv__shm_flush(tp);
    while (tp->srv_head)
        serve_end(tp, tp->srv_head, false);
    if (tp->fd >= 0)
        close(tp->fd);
    if (tp->map)
        munmap(tp->map, MAP_BYTES);
    kv_xport_peer *p = tp->p;
    if (p) {
        p->be = NULL;
        kv__xport_peer_closed(p, why, msg);
        kv__xport_peer_unref(p);
    } else {
        t->x->stats.peers_refused++;
    }
    kv__mem_free(tp->ctl);
    kv__mem_free(tp);
    kv__xport_signal(t->x);
}

static void peer_bye(struct kv__shm *t, struct kv__shm_peer *tp, kv_status why, const char *msg)
{
    if (tp->p && tp->p->state == KV_XPORT_READY)
        (void)kv__shm_put(tp, (struct kv__shm_msg){.type = KV__SM_BYE}, NULL, 0);
    peer_fail(t, tp, why, msg);
}

/* ---- addresses ------------------------------------------------------ */

/* host "/path": that socket file; else the abstract "kvcache-shm:host:port". */
static kv_status addr_make(const char *host, uint16_t port, struct sockaddr_un *sa, socklen_t *len,
                           const char *who)
{
    memset(sa, 0, sizeof(*sa));
    sa->sun_family = AF_UNIX;
    const size_t hl = strlen(host);
    if (host[0] == '/') {
        if (hl >= sizeof(sa->sun_path))
            return kv__error(KV_ERR_INVALID_ARG, "%s: socket path of %zu characters (at most %zu)",
                             who, hl, sizeof(sa->sun_path) - 1);
        memcpy(sa->sun_path, host, hl);
        *len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + hl + 1);
        return KV_OK;
    }
    if (hl == 0)
        return kv__error(KV_ERR_INVALID_ARG, "%s: an empty host", who);
    const int n = snprintf(sa->sun_path + 1, sizeof(sa->sun_path) - 1, "kvcache-shm:%s:%u", host,
                           (unsigned)port);
    if (n < 0 || (size_t)n >= sizeof(sa->sun_path) - 1)
        return kv__error(KV_ERR_INVALID_ARG, "%s: host \"%s\" too long for a socket name", who,
                         host);
    *len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
    return KV_OK;
}

/* ---- start, stop, connect ------------------------------------------- */

static void *progress(void *arg);

static kv_status listen_on(struct kv__shm *t)
{
    kv_xport *x = t->x;
    const bool aut = x->cfg.kind == KV_XPORT_AUTO; /* its own name, any port */
    const char *host = aut ? x->auto_name : x->cfg.listen_host;
    const uint16_t want = aut ? 0 : x->cfg.listen_port;
    const bool path = host[0] == '/';
    /* port 0 on an abstract name: a free one from a start that differs
     * per process */
    const uint32_t start =
        want ? want
             : 20000u +
                   (uint32_t)((kv__now_ns() / 1000u ^ (uint64_t)getpid() * 2654435761u) % 40000u);
    const uint32_t tries = want || path ? 1 : 4096;
    t->lfd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (t->lfd < 0)
        return kv__error(KV_ERR_IO, "xport_create: socket: %s", strerror(errno));
    int e = 0;
    for (uint32_t i = 0; i < tries; i++) {
        const uint16_t port = (uint16_t)(path ? 0 : 1 + (start - 1 + i) % 65535u);
        struct sockaddr_un sa;
        socklen_t sl;
        const kv_status st = addr_make(host, port, &sa, &sl, "xport_create");
        if (st != KV_OK)
            return st;
        if (bind(t->lfd, (struct sockaddr *)&sa, sl) == 0) {
            if (listen(t->lfd, 128) != 0) {
                e = errno;
                break;
            }
            if (aut)
                x->auto_shm_port = port;
            else
                x->port = port;
            if (path)
                snprintf(t->path, sizeof(t->path), "%s", host);
            return KV_OK;
        }
        e = errno;
        if (e != EADDRINUSE)
            break;
    }
    return kv__error(KV_ERR_IO, "xport_create: listen on shm \"%s\" port %u: %s", host,
                     (unsigned)want, strerror(e));
}

static kv_status shm_start(kv_xport *x)
{
    struct kv__shm *t = kv__mem_calloc(1, sizeof(*t));
    if (!t)
        return kv__error(KV_ERR_NO_MEMORY, "xport_create: shm state");
    t->x = x;
    t->lfd = -1;
    if (pipe2(t->wake, O_NONBLOCK | O_CLOEXEC) != 0) {
        const int e = errno;
        kv__mem_free(t);
        return kv__error(KV_ERR_IO, "xport_create: pipe2: %s", strerror(e));
    }
    kv_status st = x->cfg.listen_host ? listen_on(t) : KV_OK;
    if (st != KV_OK)
        goto fail;
    void **be = x->cfg.kind == KV_XPORT_AUTO ? &x->be_shm : &x->be;
    *be = t;
    if (!x->manual) {
        const int e = pthread_create(&t->thr, NULL, progress, t);
        if (e != 0) {
            st = kv__error(KV_ERR_IO, "xport_create: progress thread: %s", strerror(e));
            *be = NULL;
            goto fail;
        }
        t->thread = true;
    }
    return KV_OK;

fail:
    if (t->lfd >= 0)
        close(t->lfd);
    if (t->path[0])
        unlink(t->path);
    close(t->wake[0]);
    close(t->wake[1]);
    kv__mem_free(t);
    return st;
}

static kv_status shm_stop(kv_xport *x)
{
    struct kv__shm *t = kv__shm_of(x);
    pthread_mutex_lock(&x->mu);
    t->stop = true;
    kv__shm_wake(t);
    pthread_mutex_unlock(&x->mu);
    if (t->thread)
        pthread_join(t->thr, NULL);
    pthread_mutex_lock(&x->mu);
    while (t->peers)
        peer_bye(t, t->peers, KV_ERR_CANCELLED, "the transport was destroyed");
    pthread_mutex_unlock(&x->mu);
    kv_status st = KV_OK;
    if (t->lfd >= 0 && close(t->lfd) != 0)
        st = kv__error(KV_ERR_IO, "xport_destroy: close of the listener: %s", strerror(errno));
    if (t->path[0] && unlink(t->path) != 0 && st == KV_OK)
        st = kv__error(KV_ERR_IO, "xport_destroy: unlink %s: %s", t->path, strerror(errno));
    close(t->wake[0]);
    close(t->wake[1]);
    kv__mem_free(t->pfd);
    kv__mem_free(t->pl);
    kv__mem_free(t);
    if (x->cfg.kind == KV_XPORT_AUTO)
        x->be_shm = NULL;
    else
        x->be = NULL;
    return st;
}

kv_status kv__shm_connect_proof(kv_xport_peer *p, const char *host, uint16_t port, uint64_t secret)
{
    kv_xport *x = p->x;
    struct kv__shm *t = kv__shm_of(x);
    struct sockaddr_un sa;
    socklen_t sl;
    kv_status st = addr_make(host, port, &sa, &sl, "xport_connect");
    if (st != KV_OK)
        return st;
    struct kv__shm_peer *tp = kv__mem_calloc(1, sizeof(*tp));
    if (!tp)
        return kv__error(KV_ERR_NO_MEMORY, "xport_connect: peer state");
    tp->p = p;
    tp->expect_secret = secret;
    tp->fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    int mfd = -1;
    if (tp->fd < 0) {
        st = kv__error(KV_ERR_IO, "xport_connect: socket: %s", strerror(errno));
        goto fail;
    }
    if (connect(tp->fd, (struct sockaddr *)&sa, sl) != 0) {
        st = kv__error(KV_ERR_IO, "xport_connect: connect to shm \"%s\" port %u: %s", host,
                       (unsigned)port, strerror(errno));
        goto fail;
    }
    mfd = memfd_create("kvcache-shm", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (mfd < 0 || ftruncate(mfd, (off_t)MAP_BYTES) != 0 ||
        fcntl(mfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
        st = kv__error(KV_ERR_IO, "xport_connect: a %" PRIu64 "-byte memfd: %s",
                       (uint64_t)MAP_BYTES, strerror(errno));
        goto fail;
    }
    struct kv__xport_verdict v = kv__shm_map(tp, mfd, true);
    if (kv__xport_ok(&v))
        v = kv__shm_hello(t, tp, mfd);
    close(mfd);
    mfd = -1;
    if (!kv__xport_ok(&v)) {
        st = kv__error(v.st, "xport_connect: %s", v.msg);
        goto fail;
    }
    pthread_mutex_lock(&x->mu);
    tp->deadline_ns = kv__deadline_ns(x->cfg.timeout_ms);
    p->be = tp;
    tp->next = t->peers;
    t->peers = tp;
    kv__shm_wake(t);
    pthread_mutex_unlock(&x->mu);
    return KV_OK;

fail:
    if (mfd >= 0)
        close(mfd);
    if (tp->map)
        munmap(tp->map, MAP_BYTES);
    if (tp->fd >= 0)
        close(tp->fd);
    kv__mem_free(tp);
    return st;
}

static kv_status shm_connect(kv_xport_peer *p, const char *host, uint16_t port)
{
    return kv__shm_connect_proof(p, host, port, 0);
}

static void shm_unexpose(kv_xport_peer *p, struct kv__xport_expo *e)
{
    struct kv__shm_peer *tp = p->be;
    if (!tp)
        return;
    for (struct kv__xport_serve *s = tp->srv_head, *nx; s; s = nx) {
        nx = s->next;
        if (s->expo != e)
            continue;
        if (s == tp->srv_cur) { /* being copied: the rest is refused after it */
            s->refused = s->sent < s->len;
            s->len = s->sent;
        } else {
            serve_end(tp, s, true);
        }
    }
    kv__shm_wake(kv__shm_of(p->x));
}

static void shm_post(kv_xport_xfer *xf)
{
    kv__xport_cursor_reset(xf);
    kv__shm_wake(kv__shm_of(xf->peer->x));
}

static void shm_cancel(kv_xport_xfer *xf)
{
    kv__shm_wake(kv__shm_of(xf->peer->x));
}

static void shm_peer_close(kv_xport_peer *p)
{
    struct kv__shm_peer *tp = p->be;
    if (tp)
        tp->close_req = true;
    else /* the backend is done with it already: nothing in flight */
        kv__xport_peer_closed(p, KV_OK, "closed");
    kv__shm_wake(kv__shm_of(p->x));
}

static void round_once(struct kv__shm *t, uint32_t cap_ms);

static void shm_step(kv_xport *x, uint32_t timeout_ms)
{
    pthread_mutex_lock(&x->mu);
    round_once(kv__shm_of(x), timeout_ms);
    pthread_mutex_unlock(&x->mu);
}

const struct kv__xport_ops kv__xport_shm_ops = {
    .version = KV__XPORT_OPS_VERSION,
    .kind = KV_XPORT_SHM,
    .name = "shm",
    .gather = true,
    .start = shm_start,
    .stop = shm_stop,
    .connect = shm_connect,
    .mem_reg = kv__xport_mem_none,
    .mem_dereg = kv__xport_mem_none,
    .expose = kv__xport_expose_keyless,
    .unexpose = shm_unexpose,
    .post = shm_post,
    .cancel = shm_cancel,
    .peer_close = shm_peer_close,
    .step = shm_step,
};

/* ---- incoming connections ------------------------------------------- */

static uint32_t handshaking(const struct kv__shm *t)
{
    uint32_t n = 0;
    for (const struct kv__shm_peer *tp = t->peers; tp; tp = tp->next)
        n += !tp->p || (!tp->p->outgoing && !tp->p->user_owned); /* or not yet accepted */
    return n;
}

/* mu held: fd as an incoming connection, before its HELLO. */
static kv_status adopt(struct kv__shm *t, int fd)
{
    kv_xport *x = t->x;
    const uint32_t busy = handshaking(t);
    if (busy >= x->cfg.max_handshakes) {
        x->stats.peers_refused++;
        x->stats.handshakes_over_limit++;
        char why[120];
        snprintf(why, sizeof(why), "%u connections in their handshake already (max_handshakes)",
                 busy);
        struct kv__shm_peer tmp = {.fd = fd};
        if (kv__shm_put(&tmp,
                        (struct kv__shm_msg){.type = KV__SM_REFUSE, .status = KV_ERR_CAPACITY}, why,
                        (uint32_t)strlen(why)))
            (void)kv__shm_flush(&tmp);
        kv__mem_free(tmp.ctl);
        close(fd);
        return kv__error(KV_ERR_CAPACITY, "xport shm: a connection refused: %s", why);
    }
    struct kv__shm_peer *tp = kv__mem_calloc(1, sizeof(*tp));
    if (!tp) {
        close(fd);
        return kv__error(KV_ERR_NO_MEMORY, "xport shm: a connection refused: no memory");
    }
    tp->fd = fd;
    tp->deadline_ns = kv__deadline_ns(x->cfg.timeout_ms);
    tp->next = t->peers;
    t->peers = tp;
    return KV_OK;
}

kv_status kv__shm_adopt(kv_xport *x, int fd)
{
    struct kv__shm *t = kv__shm_of(x);
    const int fl = fcntl(fd, F_GETFL, 0);
    if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) != 0) {
        close(fd);
        return kv__error(KV_ERR_IO, "xport shm: adopt: %s", strerror(errno));
    }
    pthread_mutex_lock(&x->mu);
    const kv_status st = adopt(t, fd);
    kv__shm_wake(t);
    pthread_mutex_unlock(&x->mu);
    return st;
}

static void accept_all(struct kv__shm *t)
{
    for (;;) {
        const int fd = accept4(t->lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0)
            return;
        kv__error_mute();
        (void)adopt(t, fd);
        kv__error_unmute();
    }
}

/* ---- settling, notifications ---------------------------------------- */

bool kv__shm_notes_flush(struct kv__shm_peer *tp)
{
    for (kv_xport_xfer *xf = kv__xport_note_next(tp->p->xfers); xf;
         xf = kv__xport_note_next(xf->next)) {
        struct kv__shm_msg m = {.type = KV__SM_NOTIFY, .xfer = xf->id, .tag = xf->note_tag};
        if (!kv__shm_put(tp, m, xf->note, xf->note_len))
            return false;
        xf->note_sent = true;
    }
    return true;
}

/* ---- the send scheduler --------------------------------------------- */

/* Read entries of xf requested and not yet ended. */
static uint64_t reads_out(const kv_xport_xfer *xf)
{
    return xf->be_entry - (uint64_t)(xf->n - xf->left);
}

/* mu held: READ requests of tp's reads, post order, while fewer than
 * max_pending_reads are outstanding. false: out of memory. */
static bool reads_ask(struct kv__shm *t, struct kv__shm_peer *tp)
{
    const uint32_t window = t->x->cfg.max_pending_reads;
    uint64_t out = 0;
    for (kv_xport_xfer *xf = tp->p->xfers; xf; xf = xf->next) {
        if (!xf->read)
            continue;
        out += reads_out(xf);
        while (!xf->cancel_req && xf->be_entry < xf->n && out < window) {
            const uint32_t e = (uint32_t)xf->be_entry;
            const struct kv_xport_io *io = &xf->ios[e];
            struct kv__shm_msg m = {.type = KV__SM_READ,
                                    .xfer = xf->id,
                                    .entry = e,
                                    .region = io->remote->region,
                                    .off = io->remote_off,
                                    .len = io->bytes};
            if (!kv__shm_put(tp, m, NULL, 0))
                return false;
            xf->be_entry++;
            out++;
        }
    }
    return true;
}

static uint32_t slot_free(const struct kv__shm_peer *tp)
{
    for (uint32_t i = 0; i < KV__SHM_SLOTS; i++)
        if (!tp->slot[i].used)
            return i;
    return KV__SHM_SLOTS;
}

/* mu held: the first write of tp with bytes to send. */
static kv_xport_xfer *write_next(struct kv__shm_peer *tp)
{
    for (kv_xport_xfer *xf = tp->p->xfers; xf; xf = xf->next)
        if (!xf->read && !xf->cancel_req && xf->be_entry < xf->n)
            return xf;
    return NULL;
}

static bool tx_work(const struct kv__shm_peer *tp)
{
    if (!tp->p || tp->p->state != KV_XPORT_READY || tp->n_used == KV__SHM_SLOTS)
        return false;
    if (tp->srv_head && tp->srv_head->sent < tp->srv_head->len)
        return true;
    return write_next((struct kv__shm_peer *)tp) != NULL;
}

/* mu held: fill free slots of our ring: reads served first (they are
 * waited on), then writes in post order, each slot up to KV__SHM_MAXV
 * pieces of one transfer (a gathered write's segments packed in order).
 * The copy is made with mu dropped. false: out of memory. */
static bool tx_fill(struct kv__shm *t, struct kv__shm_peer *tp)
{
    kv_xport *x = t->x;
    if (!reads_ask(t, tp))
        return false;
    for (uint32_t round = 0; round < KV__SHM_SLOTS && tx_work(tp); round++) {
        const uint32_t si = slot_free(tp);
        struct kv__shm_slot *sl = &tp->slot[si];
        char *dst = tp->tx + (uint64_t)si * KV__SHM_SLOT;
        struct kv__xport_serve *s = tp->srv_head;
        if (s && s->sent < s->len) {
            const uint64_t at = s->sent;
            const uint64_t len = s->len - at < KV__SHM_SLOT ? s->len - at : KV__SHM_SLOT;
            const char *src = s->expo->mem->base + s->off + at;
            s->sent += len;
            tp->srv_cur = s;
            *sl = (struct kv__shm_slot){
                .used = true, .serve = true, .xfer = s->xfer, .sent_ns = kv__now_ns()};
            tp->n_used++;
            pthread_mutex_unlock(&x->mu);
            memcpy(dst, src, (size_t)len);
            pthread_mutex_lock(&x->mu);
            tp->srv_cur = NULL;
            struct kv__shm_msg m = {.type = KV__SM_RDATA,
                                    .slot = si,
                                    .xfer = s->xfer,
                                    .entry = s->entry,
                                    .off = at,
                                    .len = len};
            if (!kv__shm_put(tp, m, NULL, 0))
                return false;
            (void)kv__shm_flush(tp); /* the peer copies it out while we fill the next */
            if (s->sent >= s->len)
                serve_end(tp, s, s->refused);
            continue;
        }
        kv_xport_xfer *xf = write_next(tp);
        unsigned char desc[KV__SHM_MAXV * KV__SHM_DESC];
        uint32_t k = 0, ns = 0;
        uint64_t bytes = 0;
        /* Pieces (destination ranges, parts of entries) and their source
         * ranges: one per piece, or a gathered entry's segments in order. */
        while (k < KV__SHM_MAXV && bytes < KV__SHM_SLOT && ns < KV__SHM_MAXSRC &&
               xf->be_entry < xf->n) {
            const uint32_t e = (uint32_t)xf->be_entry;
            const struct kv_xport_io *io = &xf->ios[e];
            const uint64_t at = xf->be_off;
            if (xf->seg) {
                kv__xport_cursor_gather(xf, io, KV__SHM_SLOT, KV__SHM_MAXSRC, tp->gsrc, tp->glen,
                                        &ns, &bytes);
            } else {
                const uint64_t rest = io->bytes - xf->be_off;
                const uint64_t len = rest < KV__SHM_SLOT - bytes ? rest : KV__SHM_SLOT - bytes;
                tp->gsrc[ns] = io->local->base + io->local_off + xf->be_off;
                tp->glen[ns++] = len;
                bytes += len;
                xf->be_off += len;
            }
            unsigned char *d = desc + (size_t)k * KV__SHM_DESC;
            kv__le_put(d, e, 4);
            kv__le_put(d + 4, io->remote->region, 4);
            kv__le_put(d + 8, io->remote_off + at, 8);
            kv__le_put(d + 16, xf->be_off - at, 8);
            sl->entry[k] = e;
            sl->len[k] = xf->be_off - at;
            k++;
            if (xf->be_off == io->bytes) {
                xf->be_entry++;
                xf->be_off = 0;
            }
        }
        sl->used = true;
        sl->serve = false;
        sl->xfer = xf->id;
        sl->sent_ns = kv__now_ns();
        sl->k = k;
        tp->n_used++;
        xf->busy++;
        pthread_mutex_unlock(&x->mu);
        uint64_t at = 0;
        for (uint32_t i = 0; i < ns; i++) {
            if (i + 8 < ns) /* strided sources: ask for them ahead */
                for (uint64_t o = 0; o < tp->glen[i + 8] && o < 512; o += 64)
                    __builtin_prefetch(tp->gsrc[i + 8] + o);
            memcpy(dst + at, tp->gsrc[i], (size_t)tp->glen[i]);
            at += tp->glen[i];
        }
        pthread_mutex_lock(&x->mu);
        xf->busy--;
        struct kv__shm_msg m = {
            .type = KV__SM_DATA, .slot = si, .xfer = xf->id, .entry = k, .len = bytes};
        if (!kv__shm_put(tp, m, desc, k * KV__SHM_DESC))
            return false;
        (void)kv__shm_flush(tp); /* an error is met again by peer_io's flush */
    }
    return true;
}

/* ---- deadlines ------------------------------------------------------ */

/* The slot of tp's ring taken longest ago, or NULL when none is. */
static const struct kv__shm_slot *slot_oldest(const struct kv__shm_peer *tp)
{
    const struct kv__shm_slot *o = NULL;
    for (uint32_t i = 0; i < KV__SHM_SLOTS; i++)
        if (tp->slot[i].used && (!o || tp->slot[i].sent_ns < o->sent_ns))
            o = &tp->slot[i];
    return o;
}

/* mu held: deadlines and cancels of tp; false when tp was closed. */
static bool sweep(struct kv__shm *t, struct kv__shm_peer *tp, uint64_t now)
{
    kv_xport *x = t->x;
    const uint64_t lim = (uint64_t)x->cfg.timeout_ms * 1000000ull;
    if (!tp->p || tp->p->state == KV_XPORT_CONNECTING) {
        if (now >= tp->deadline_ns) {
            peer_fail(t, tp, KV_ERR_TIMEOUT, "xport: handshake not done within the timeout");
            return false;
        }
        if (!tp->p)
            return true;
    }
    kv_xport_peer *p = tp->p;
    for (kv_xport_xfer *xf = p->xfers, *nx; xf; xf = nx) {
        nx = xf->next;
        if (xf->cancel_req && !xf->busy) {
            kv__xport_xfer_end(xf, KV_XPORT_CANCELLED, KV_ERR_CANCELLED);
        } else if (now >= xf->deadline_ns && !xf->busy) {
            kv__xport_xfer_end(xf, xf->cancel_req ? KV_XPORT_CANCELLED : KV_XPORT_TIMED_OUT,
                               xf->cancel_req ? KV_ERR_CANCELLED : KV_ERR_TIMEOUT);
        }
    }
    if (tp->ctl_off < tp->ctl_len && now - tp->tx_since_ns >= lim) {
        x->stats.sends_stalled++;
        char m[200];
        snprintf(m, sizeof(m),
                 "xport shm: the peer read none of %zu control bytes for %u ms: the peer is "
                 "closed",
                 tp->ctl_len - tp->ctl_off, x->cfg.timeout_ms);
        peer_fail(t, tp, KV_ERR_TIMEOUT, m);
        return false;
    }
    /* Our messages all went into the socket, yet the peer does not read
     * them: a slot unanswered for timeout_ms while messages of ours wait
     * unread in its socket (SIOCOUTQ: bytes it has not received) closes
     * it, as a peer that leaves our control stream unsent does. One that
     * reads and only answers late keeps its connection. */
    const struct kv__shm_slot *old = slot_oldest(tp);
    int unread = 0;
    if (old && now - old->sent_ns >= lim && ioctl(tp->fd, SIOCOUTQ, &unread) == 0 && unread > 0) {
        x->stats.sends_stalled++;
        char m[200];
        snprintf(m, sizeof(m),
                 "xport shm: the peer left %d bytes of our messages unread and slot %u "
                 "unanswered for %u ms: the peer is closed",
                 unread, (unsigned)(old - tp->slot), x->cfg.timeout_ms);
        peer_fail(t, tp, KV_ERR_TIMEOUT, m);
        return false;
    }
    if (p->state == KV_XPORT_READY && !kv__shm_notes_flush(tp)) {
        peer_fail(t, tp, KV_ERR_NO_MEMORY, "xport shm: control buffer");
        return false;
    }
    kv__xport_settle_idle(tp->p);
    return true;
}

static uint64_t next_deadline(const struct kv__shm *t)
{
    const uint64_t lim = (uint64_t)t->x->cfg.timeout_ms * 1000000ull;
    uint64_t d = UINT64_MAX;
    for (const struct kv__shm_peer *tp = t->peers; tp; tp = tp->next) {
        if (!tp->p || tp->p->state == KV_XPORT_CONNECTING)
            d = kv__xport_min64(d, tp->deadline_ns);
        if (tp->ctl_off < tp->ctl_len)
            d = kv__xport_min64(d, tp->tx_since_ns + lim);
        /* a slot's check (sweep); once passed, looked at every round */
        const struct kv__shm_slot *old = slot_oldest(tp);
        if (old && old->sent_ns + lim > kv__now_ns())
            d = kv__xport_min64(d, old->sent_ns + lim);
        for (kv_xport_xfer *xf = tp->p ? tp->p->xfers : NULL; xf; xf = xf->next)
            d = kv__xport_min64(d, xf->deadline_ns);
    }
    return d;
}

/* ---- the progress loop ---------------------------------------------- */

static bool peer_live(const struct kv__shm *t, const struct kv__shm_peer *tp)
{
    for (const struct kv__shm_peer *q = t->peers; q; q = q->next)
        if (q == tp)
            return true;
    return false;
}

/* mu held: tp's receive (when the socket said so), then its sends. */
static void peer_io(struct kv__shm *t, struct kv__shm_peer *tp, short ev)
{
    struct kv__xport_verdict v = KV__XPORT_OK;
    if (ev & (POLLIN | POLLHUP | POLLERR))
        v = kv__shm_rx(t, tp);
    if (kv__xport_ok(&v) && tp->p && tp->p->state == KV_XPORT_READY) {
        if (!tx_fill(t, tp))
            v = bad(KV_ERR_NO_MEMORY, "xport shm: control buffer");
        else if (!kv__shm_notes_flush(tp))
            v = bad(KV_ERR_NO_MEMORY, "xport shm: control buffer");
        kv__xport_settle_idle(tp->p);
    }
    if (kv__xport_ok(&v))
        v = kv__shm_flush(tp);
    if (!kv__xport_ok(&v))
        peer_fail(t, tp, v.st, v.msg);
}

static void round_once(struct kv__shm *t, uint32_t cap_ms)
{
    kv_xport *x = t->x;
    for (struct kv__shm_peer *tp = t->peers, *nx; tp; tp = nx) {
        nx = tp->next;
        if (tp->close_req)
            peer_bye(t, tp, KV_OK, "closed");
    }
    const uint64_t now = kv__now_ns();
    bool busy = false;
    uint32_t n = 2;
    for (struct kv__shm_peer *tp = t->peers, *nx; tp; tp = nx) {
        nx = tp->next;
        if (sweep(t, tp, now)) {
            busy |= tx_work(tp);
            n++;
        }
    }
    struct pollfd *pf = kv__mem_grow(t->pfd, &t->cap_pfd, 0, n, sizeof(*pf), 16);
    if (pf)
        t->pfd = pf;
    struct kv__shm_peer **pl = pf ? kv__mem_grow(t->pl, &t->cap_pl, 0, n, sizeof(*pl), 16) : NULL;
    if (!pl) {
        pthread_mutex_unlock(&x->mu);
        usleep(1000);
        pthread_mutex_lock(&x->mu);
        return;
    }
    t->pl = pl;
    uint32_t k = 0;
    t->pfd[k] = (struct pollfd){.fd = t->wake[0], .events = POLLIN};
    t->pl[k++] = NULL;
    t->pfd[k] = (struct pollfd){.fd = t->lfd, .events = POLLIN};
    t->pl[k++] = NULL;
    for (struct kv__shm_peer *tp = t->peers; tp; tp = tp->next) {
        const short in = kv__shm_rx_wanted(tp) ? POLLIN : 0;
        const short out = tp->ctl_off < tp->ctl_len ? POLLOUT : 0;
        t->pfd[k] = (struct pollfd){.fd = tp->fd, .events = (short)(in | out)};
        t->pl[k++] = tp;
    }
    const int ms = busy ? 0 : kv__xport_poll_ms(next_deadline(t), cap_ms);
    pthread_mutex_unlock(&x->mu);
    const int r = poll(t->pfd, k, ms);
    pthread_mutex_lock(&x->mu);
    if (r < 0)
        return;
    if (t->pfd[0].revents)
        kv__xport_wake_drain(t->wake[0]);
    if (t->pfd[1].revents && t->lfd >= 0)
        accept_all(t);
    for (uint32_t i = 2; i < k; i++) {
        struct kv__shm_peer *tp = t->pl[i];
        if (!peer_live(t, tp))
            continue;
        peer_io(t, tp, t->pfd[i].revents);
    }
}

static void *progress(void *arg)
{
    struct kv__shm *t = arg;
    kv_xport *x = t->x;
    pthread_mutex_lock(&x->mu);
    while (!t->stop)
        round_once(t, 1000);
    pthread_mutex_unlock(&x->mu);
    return NULL;
}
