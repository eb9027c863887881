/*
 * kv_xport_auto.c - KV_XPORT_AUTO: one transport whose peers are carried
 * by the same-host backend (SHM) when both ends prove to be on one host,
 * by TCP otherwise (docs/connector.md, "Automatic choice").
 *
 * Both backends run side by side in the transport: TCP's state in x->be
 * (its listener on the configured address: kv_xport_port), SHM's in
 * x->be_shm (a listener on a random abstract name, when listening). Each
 * peer names its backend (p->ops), fixed before the backend sees it; the
 * generic layer sends every per-peer call there. Regions need nothing of
 * either backend (both keyless), so one region serves peers of both.
 *
 * The choice, made by the connecting side in kv_xport_connect:
 *
 *   A (connects)                                  B (listens, AUTO)
 *   TCP connect to host:port, HELLO conns 0 ---> checked as a HELLO (token, ...)
 *                  <--- HELLO + offer: B's secret, B's abstract name and port
 *   connect to that abstract name:  reachable only in A's network namespace
 *     (ENOENT / ECONNREFUSED: another host or namespace -> TCP, below)
 *   SHM HELLO + the rings' memfd -------------->  (B's SHM listener)
 *                  <--- SHM HELLO, tag = B's secret
 *   tag == secret: READY over SHM; else CLOSED, KV_ERR_MISMATCH (whoever
 *   holds that name is not B)
 *   no offer, or the name not reachable: the ordinary TCP connect to host:port
 *
 * Why this is a proof: an abstract socket name is reachable only from the
 * network namespace it was bound in (so from the same kernel, the same
 * host); the secret is random, given only over the TCP connection to a
 * probe that presented the token, and echoed only by the SHM listener of
 * the transport that gave it. A boot_id or a host name is not used: two
 * containers can share a kernel (and its boot_id) without sharing a
 * network namespace, and then the name is not reachable and TCP is kept.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include "kv_xport_frame_int.h"
#include "kv_xport_int.h"
#include "kv_xport_shm_int.h"

/* 8 random bytes (getrandom; a hash of the clock, pid and a counter if
 * the kernel has none to give). */
static uint64_t random64(void)
{
    uint64_t v = 0;
    if (getrandom(&v, sizeof(v), 0) == (ssize_t)sizeof(v))
        return v;
    static _Atomic uint64_t counter;
    const uint64_t c = ++counter;
    return kv__xxh3_64(&(uint64_t[3]){kv__now_ns(), (uint64_t)getpid(), c}, 3 * sizeof(uint64_t));
}

static kv_status auto_start(kv_xport *x)
{
    x->auto_secret = random64() | 1;
    snprintf(x->auto_name, sizeof(x->auto_name), "auto-%016" PRIx64, random64());
    kv_status st = kv__xport_tcp_ops.start(x);
    if (st != KV_OK)
        return st;
    st = kv__xport_shm_ops.start(x);
    if (st != KV_OK) {
        kv__error_mute(); /* the SHM backend's error is the one to report */
        (void)kv__xport_tcp_ops.stop(x);
        kv__error_unmute();
    }
    return st;
}

static kv_status auto_stop(kv_xport *x)
{
    const kv_status a = kv__xport_shm_ops.stop(x);
    if (a != KV_OK)
        kv__error_mute();
    const kv_status b = kv__xport_tcp_ops.stop(x);
    if (a != KV_OK)
        kv__error_unmute();
    return a != KV_OK ? a : b;
}

/* ---- the probe (the connecting side) -------------------------------- */

/* Wait for ev on fd until deadline: 1 ready, 0 the deadline passed, -1 an
 * error (errno). */
static int wait_fd(int fd, short ev, uint64_t deadline_ns)
{
    for (;;) {
        const uint64_t now = kv__now_ns();
        if (now >= deadline_ns)
            return 0;
        struct pollfd pf = {.fd = fd, .events = ev};
        const uint64_t ms = (deadline_ns - now) / 1000000u + 1;
        const int r = poll(&pf, 1, ms > 1000 ? 1000 : (int)ms);
        if (r > 0)
            return 1;
        if (r < 0 && errno != EINTR)
            return -1;
    }
}

static kv_status io_full(int fd, unsigned char *b, size_t n, bool out, uint64_t deadline_ns,
                         const char *what)
{
    size_t done = 0;
    while (done < n) {
        const ssize_t r = out ? send(fd, b + done, n - done, MSG_NOSIGNAL | MSG_DONTWAIT)
                              : recv(fd, b + done, n - done, MSG_DONTWAIT);
        if (r > 0) {
            done += (size_t)r;
            continue;
        }
        if (r == 0)
            return kv__error(KV_ERR_IO,
                             "xport auto: the probe's connection closed at %zu of %zu "
                             "bytes of %s",
                             done, n, what);
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
            return kv__error(KV_ERR_IO, "xport auto: the probe's %s: %s", what, strerror(errno));
        const int w = wait_fd(fd, out ? POLLOUT : POLLIN, deadline_ns);
        if (w <= 0)
            return kv__error(w == 0 ? KV_ERR_TIMEOUT : KV_ERR_IO, "xport auto: the probe's %s: %s",
                             what, w == 0 ? "no answer within the timeout" : strerror(errno));
    }
    return KV_OK;
}

/* Ask the listener at host:port for its same-host offer (at most
 * timeout_ms). KV_OK and *o, else the reason (kv_last_error). */
static kv_status probe(kv_xport *x, const char *host, uint16_t port, uint64_t nonce,
                       struct kv__xport_offer *o)
{
    const uint64_t deadline = kv__deadline_ns(x->cfg.timeout_ms);
    struct addrinfo hints = {
        .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICSERV};
    struct addrinfo *ai = NULL;
    char ps[8];
    snprintf(ps, sizeof(ps), "%u", (unsigned)port);
    const int g = getaddrinfo(host, ps, &hints, &ai);
    if (g != 0)
        return kv__error(KV_ERR_INVALID_ARG, "xport auto: host \"%s\": %s", host, gai_strerror(g));
    const int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
        freeaddrinfo(ai);
        return kv__error(KV_ERR_IO, "xport auto: socket: %s", strerror(errno));
    }
    kv_status st = KV_OK;
    if (connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
        int e = errno;
        if (e == EINPROGRESS) {
            const int w = wait_fd(fd, POLLOUT, deadline);
            socklen_t el = sizeof(e);
            e = w == 0 ? ETIMEDOUT : w < 0 ? errno : 0;
            if (w > 0 && getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &el) != 0)
                e = errno;
        }
        if (e != 0)
            st = kv__error(KV_ERR_IO, "xport auto: the probe's connect to %s:%u: %s", host,
                           (unsigned)port, strerror(e));
    }
    freeaddrinfo(ai);
    if (st == KV_OK) {
        const int one = 1;
        (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        unsigned char req[KV__XF_BYTES + KV__XPORT_HELLO_BYTES];
        const struct kv__xport_hello h = {.version = KV_XPORT_PROTOCOL_VERSION,
                                          .kind = (uint32_t)KV_XPORT_AUTO,
                                          .token = x->cfg.token,
                                          .fingerprint = x->cfg.fingerprint,
                                          .nonce = nonce};
        kv__xport_hello_encode(&h, req + KV__XF_BYTES);
        const struct kv__xf f = {.version = KV_XPORT_PROTOCOL_VERSION,
                                 .type = KV__XF_HELLO,
                                 .length = KV__XPORT_HELLO_BYTES,
                                 .payload_sum =
                                     kv__xxh3_64(req + KV__XF_BYTES, KV__XPORT_HELLO_BYTES)};
        kv__xf_encode(&f, req);
        st = io_full(fd, req, sizeof(req), true, deadline, "HELLO");
    }
    /* The answer: a header, then at most a REFUSE's reason or an offer. */
    unsigned char ans[KV__XF_BYTES + 256];
    struct kv__xf af;
    if (st == KV_OK)
        st = io_full(fd, ans, KV__XF_BYTES, false, deadline, "answer");
    if (st == KV_OK)
        st = kv__xf_decode(ans, &af);
    if (st == KV_OK && af.length > sizeof(ans) - KV__XF_BYTES)
        st =
            kv__error(KV_ERR_CORRUPT, "xport auto: a probe answer of %" PRIu64 " bytes", af.length);
    if (st == KV_OK)
        st = io_full(fd, ans + KV__XF_BYTES, (size_t)af.length, false, deadline, "answer");
    if (st == KV_OK)
        st = kv__xport_probe_parse(x, nonce, ans, KV__XF_BYTES + (size_t)af.length, o);
    close(fd);
    return st;
}

static kv_status auto_connect(kv_xport_peer *p, const char *host, uint16_t port)
{
    kv_xport *x = p->x;
    struct kv__xport_offer o;
    char why[224];
    kv_status st = probe(x, host, port, p->nonce_local, &o);
    if (st == KV_OK) {
        snprintf(p->path_why, sizeof(p->path_why),
                 "shm: %.40s:%u answered the probe with its same-host socket "
                 "kvcache-shm:%.40s:%u, reachable from here; its HELLO echoes the listener's "
                 "secret",
                 host, (unsigned)port, o.name, (unsigned)o.port);
        p->ops = &kv__xport_shm_ops;
        st = kv__shm_connect_proof(p, o.name, o.port, o.secret);
        if (st == KV_OK)
            return KV_OK;
        snprintf(why, sizeof(why), "the offered socket kvcache-shm:%s:%u: %.90s", o.name,
                 (unsigned)o.port, kv_last_error());
    } else {
        snprintf(why, sizeof(why), "no same-host offer: %.140s", kv_last_error());
    }
    p->ops = &kv__xport_tcp_ops;
    snprintf(p->path_why, sizeof(p->path_why), "tcp: %s", why);
    return kv__xport_tcp_ops.connect(p, host, port);
}

/* ---- the listening side --------------------------------------------- */

void kv__xport_probe_answer(const kv_xport *x, const struct kv__xport_hello *h, unsigned char *out)
{
    const struct kv__xport_hello a = {
        .version = KV_XPORT_PROTOCOL_VERSION,
        .kind = (uint32_t)KV_XPORT_AUTO,
        .token = x->cfg.token,
        .fingerprint = x->cfg.fingerprint,
        .nonce = kv__xxh3_64(&(uint64_t[2]){x->auto_secret, h->nonce}, 2 * sizeof(uint64_t)) | 1,
        .echo = h->nonce};
    kv__xport_hello_encode(&a, out);
    struct kv__xport_offer o = {.secret = x->auto_secret, .port = x->auto_shm_port};
    snprintf(o.name, sizeof(o.name), "%s%s", x->auto_name,
             x->auto_offer_elsewhere ? "-elsewhere" : "");
    kv__xport_offer_encode(&o, out + KV__XPORT_HELLO_BYTES);
}

/* mu held: the transport's sockets, or the peer's backend and why. */
static void auto_info(kv_xport *x, kv_xport_peer *p, struct kv_xport_info *out)
{
    if (!p) {
        out->path = KV_XPORT_AUTO;
        if (x->cfg.listen_host)
            snprintf(out->path_why, sizeof(out->path_why),
                     "auto: tcp %.60s:%u, same-host socket kvcache-shm:%s:%u", x->cfg.listen_host,
                     (unsigned)x->port, x->auto_name, (unsigned)x->auto_shm_port);
        else
            snprintf(out->path_why, sizeof(out->path_why), "auto: not listening");
        return;
    }
    if (p->path_why[0])
        snprintf(out->path_why, sizeof(out->path_why), "%s", p->path_why);
    else if (p->ops == &kv__xport_shm_ops)
        snprintf(out->path_why, sizeof(out->path_why),
                 "shm: accepted on this transport's same-host socket kvcache-shm:%s:%u",
                 x->auto_name, (unsigned)x->auto_shm_port);
    else
        snprintf(out->path_why, sizeof(out->path_why), "tcp: accepted on tcp port %u",
                 (unsigned)x->port);
}

/* The peer-level entries are never called through this table: each
 * peer's own backend (p->ops) takes them. */
const struct kv__xport_ops kv__xport_auto_ops = {
    .version = KV__XPORT_OPS_VERSION,
    .kind = KV_XPORT_AUTO,
    .name = "auto",
    .start = auto_start,
    .stop = auto_stop,
    .connect = auto_connect,
    .mem_reg = kv__xport_mem_none,
    .mem_dereg = kv__xport_mem_none,
    .info = auto_info,
};
