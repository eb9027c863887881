/*
 * kvt_xport.h - fixtures of the transport tests, whatever the kind (TCP,
 * SHM): a test config, a connected pair of transports in one process, a
 * region shared between them (its blob as a notification, or handed over
 * in memory), waiting for a peer or a transfer, random bytes, the regions
 * of a whole-region case, a receiver process and its loss, and network
 * namespaces.
 * Public API only. Include after <cmocka.h>.
 */
#ifndef KVT_XPORT_H
#define KVT_XPORT_H

#include <fcntl.h>
#include <sched.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

#include <kvcache/kv.h>

#include "kvtest.h"

/* The address a listener of `kind` takes in these tests: TCP's loopback,
 * SHM's abstract name "test". */
static inline const char *kvt_xport_host(kv_xport_kind kind)
{
    return kind == KV_XPORT_SHM ? "test" : "127.0.0.1";
}

/* A config of `kind` (listening on kvt_xport_host when listen), with token
 * and fingerprint fp, timeout_ms 5000; the rest defaults. */
static inline struct kv_xport_config kvt_xport_cfg(kv_xport_kind kind, bool listen, uint64_t token,
                                                   uint64_t fp)
{
    struct kv_xport_config c = KV_XPORT_CONFIG_INIT;
    c.kind = kind;
    c.listen_host = listen ? kvt_xport_host(kind) : NULL;
    c.token = token;
    c.fingerprint = fp;
    c.timeout_ms = 5000;
    return c;
}

/* Wait (10 s at most) until p leaves CONNECTING; its state. */
static inline kv_xport_peer_state kvt_xport_settle(kv_xport_peer *p, kv_status *why)
{
    kv_xport_peer_state s = KV_XPORT_CONNECTING;
    for (int i = 0; i < 10000; i++) {
        assert_int_equal(kv_xport_peer_state_get(p, &s, why), KV_OK);
        if (s != KV_XPORT_CONNECTING)
            break;
        usleep(1000);
    }
    return s;
}

/* A connected pair in one process: a (connects; prefill) and b (listens;
 * decode); pa is a's peer (b), pb is b's peer (a). */
struct kvt_pair {
    kv_xport *a, *b;
    kv_xport_peer *pa, *pb;
};

/* b from cb (which listens), a from ca; a connects to b, b accepts, a's
 * peer READY. */
static inline void kvt_pair_open(struct kvt_pair *p, const struct kv_xport_config *ca,
                                 const struct kv_xport_config *cb)
{
    assert_int_equal(kv_xport_create(cb, &p->b), KV_OK);
    assert_int_equal(kv_xport_create(ca, &p->a), KV_OK);
    assert_true(kv_xport_port(p->b) != 0);
    assert_int_equal(kv_xport_connect(p->a, cb->listen_host, kv_xport_port(p->b), &p->pa), KV_OK);
    assert_int_equal(kv_xport_accept(p->b, 5000, &p->pb), KV_OK);
    assert_int_equal(kvt_xport_settle(p->pa, NULL), KV_XPORT_READY);
}

/* The peers closed (which ends their exposures), the regions m[n] of
 * either side deregistered (NULL ones skipped), both transports destroyed:
 * each call KV_OK. */
static inline void kvt_pair_close_with(struct kvt_pair *p, kv_xport_mem *const *m, size_t n)
{
    kv_xport_peer_close(p->pa);
    kv_xport_peer_close(p->pb);
    for (size_t i = 0; i < n; i++)
        if (m[i])
            assert_int_equal(kv_xport_mem_dereg(m[i]), KV_OK);
    assert_int_equal(kv_xport_destroy(p->a), KV_OK);
    assert_int_equal(kv_xport_destroy(p->b), KV_OK);
}

static inline void kvt_pair_close(struct kvt_pair *p)
{
    kvt_pair_close_with(p, NULL, 0);
}

/* Wait (10 s at most) for t to end; it must end in `want` (else the
 * failure names its error). */
static inline void kvt_xfer_done(kv_xport_xfer *t, kv_xport_state want)
{
    kv_xport_state s;
    assert_int_equal(kv_xport_xfer_wait(t, 10000, &s), KV_OK);
    if (s != want)
        fail_msg("transfer ended %d (want %d): %s", (int)s, (int)want, kv_xport_xfer_error(t));
}

/* b exposes m to a; a imports it, the blob handed over in memory. */
static inline kv_xport_rmem *kvt_share_direct(struct kvt_pair *p, kv_xport_mem *m)
{
    unsigned char blob[KV_XPORT_BLOB_MAX];
    size_t len = 0;
    assert_int_equal(kv_xport_mem_expose(p->pb, m, blob, sizeof(blob), &len), KV_OK);
    kv_xport_rmem *r = NULL;
    assert_int_equal(kv_xport_rmem_import(p->pa, blob, len, &r), KV_OK);
    return r;
}

/* b exposes m to a; the blob travels as a notification (tag 1, as an
 * engine would send it), a imports it: of m's size. */
static inline kv_xport_rmem *kvt_share_notify(struct kvt_pair *p, kv_xport_mem *m)
{
    unsigned char blob[KV_XPORT_BLOB_MAX];
    size_t len = 0;
    assert_int_equal(kv_xport_mem_expose(p->pb, m, blob, sizeof(blob), &len), KV_OK);
    struct kv_xport_notify n = {.tag = 1, .msg = blob, .len = (uint32_t)len};
    kv_xport_xfer *t = NULL;
    assert_int_equal(kv_xport_write(p->pb, NULL, 0, &n, &t), KV_OK);
    kvt_xfer_done(t, KV_XPORT_DONE);
    assert_int_equal(kv_xport_xfer_free(t), KV_OK);
    struct kv_xport_msg *msg = malloc(sizeof(*msg));
    assert_non_null(msg);
    assert_int_equal(kv_xport_notify_poll(p->a, 5000, msg), KV_OK);
    assert_int_equal(msg->peer_id, kv_xport_peer_id(p->pa));
    assert_int_equal(msg->tag, 1);
    kv_xport_rmem *r = NULL;
    assert_int_equal(kv_xport_rmem_import(p->pa, msg->data, msg->len, &r), KV_OK);
    assert_int_equal(kv_xport_rmem_bytes(r), kv_xport_mem_bytes(m));
    free(msg);
    return r;
}

/* A child process running child(fd), fd the write end of a pipe whose
 * read end goes to *rfd; the child exits with child's result. Its pid. */
static inline pid_t kvt_xport_fork(int (*child)(int fd), int *rfd)
{
    int fds[2];
    assert_int_equal(pipe(fds), 0);
    fflush(NULL);
    const pid_t pid = fork();
    if (pid == 0) {
        close(fds[0]);
        _exit(child(fds[1]));
    }
    close(fds[1]);
    *rfd = fds[0];
    return pid;
}

/* A child's receiving end (kvt_xport_fork): a listener of kind with token
 * whose port goes to fd (2 bytes), the peer it accepts (10 s at most),
 * and `bytes` of fresh memory registered (*m) and exposed to it, its blob
 * into blob[KV_XPORT_BLOB_MAX] (*bl bytes). 0, or the step that failed
 * (1 create, 2 the port, 3 accept, 4 register or expose): an exit code. */
static inline int kvt_sink_open(kv_xport_kind kind, uint64_t token, int fd, size_t bytes,
                                kv_xport **x, kv_xport_peer **p, kv_xport_mem **m,
                                unsigned char *blob, size_t *bl)
{
    struct kv_xport_config c = kvt_xport_cfg(kind, true, token, 0);
    if (kv_xport_create(&c, x) != KV_OK)
        return 1;
    const uint16_t port = kv_xport_port(*x);
    if (write(fd, &port, 2) != 2)
        return 2;
    if (kv_xport_accept(*x, 10000, p) != KV_OK)
        return 3;
    unsigned char *dst = malloc(bytes);
    if (kv_xport_mem_reg(*x, dst, bytes, KV_MEM_HOST, m) != KV_OK ||
        kv_xport_mem_expose(*p, *m, blob, KV_XPORT_BLOB_MAX, bl) != KV_OK)
        return 4;
    return 0;
}

/* The other end of kvt_sink_open, in the parent: the port read from rfd,
 * a transport of kind (*x) connected to it (*p READY), src[bytes]
 * registered (*ms), and the region the child exposed imported (*r) from
 * the first notification it sends (the blob). */
static inline void kvt_sink_join(kv_xport_kind kind, uint64_t token, int rfd, void *src,
                                 size_t bytes, kv_xport **x, kv_xport_peer **p, kv_xport_mem **ms,
                                 kv_xport_rmem **r)
{
    uint16_t port = 0;
    assert_int_equal(read(rfd, &port, 2), 2);
    struct kv_xport_config c = kvt_xport_cfg(kind, false, token, 0);
    assert_int_equal(kv_xport_create(&c, x), KV_OK);
    assert_int_equal(kv_xport_connect(*x, kvt_xport_host(kind), port, p), KV_OK);
    assert_int_equal(kvt_xport_settle(*p, NULL), KV_XPORT_READY);
    assert_int_equal(kv_xport_mem_reg(*x, src, bytes, KV_MEM_HOST, ms), KV_OK);
    struct kv_xport_msg *msg = malloc(sizeof(*msg));
    assert_non_null(msg);
    assert_int_equal(kv_xport_notify_poll(*x, 10000, msg), KV_OK);
    assert_int_equal(kv_xport_rmem_import(*p, msg->data, msg->len, r), KV_OK);
    free(msg);
}

/* A notification refused for capacity, seen from its sender: decode (b)
 * takes max_pending_notes 1 and polls nothing; prefill's first write with a
 * notification is DONE, its second lands its data but not its notification:
 * FAILED, every entry KV_OK, kv_xport_xfer_note_status KV_ERR_CAPACITY and
 * the error naming max_pending_notes. */
static inline void kvt_note_refused_for_capacity(kv_xport_kind kind, uint64_t token)
{
    struct kv_xport_config ca = kvt_xport_cfg(kind, false, token, 7),
                           cb = kvt_xport_cfg(kind, true, token, 7);
    cb.max_pending_notes = 1;
    struct kvt_pair p;
    kvt_pair_open(&p, &ca, &cb);
    enum { BYTES = 1u << 20 };
    unsigned char *src = malloc(BYTES), *dst = calloc(1, BYTES);
    kvt_fill(src, BYTES, 21);
    kv_xport_mem *ms = NULL, *md = NULL;
    assert_int_equal(kv_xport_mem_reg(p.a, src, BYTES, KV_MEM_HOST, &ms), KV_OK);
    assert_int_equal(kv_xport_mem_reg(p.b, dst, BYTES, KV_MEM_HOST, &md), KV_OK);
    kv_xport_rmem *r = kvt_share_direct(&p, md);
    kv_status ns = KV_ERR_INTERNAL;
    assert_int_equal(kv_xport_xfer_note_status(NULL, &ns), KV_ERR_NULL);
    kv_xport_xfer *t[2] = {NULL, NULL};
    for (int i = 0; i < 2; i++) {
        struct kv_xport_io io = {ms, (uint64_t)i * (BYTES / 2), r, (uint64_t)i * (BYTES / 2),
                                 BYTES / 2};
        struct kv_xport_notify n = {.tag = 80u + (uint64_t)i};
        assert_int_equal(kv_xport_write(p.pa, &io, 1, &n, &t[i]), KV_OK);
        kvt_xfer_done(t[i], i == 0 ? KV_XPORT_DONE : KV_XPORT_FAILED);
    }
    assert_int_equal(kv_xport_xfer_note_status(t[0], NULL), KV_ERR_NULL);
    assert_int_equal(kv_xport_xfer_note_status(t[0], &ns), KV_OK);
    assert_int_equal(ns, KV_OK);
    assert_int_equal(kv_xport_xfer_note_status(t[1], &ns), KV_OK);
    assert_int_equal(ns, KV_ERR_CAPACITY);
    const kv_status *st = NULL;
    uint32_t n = 0;
    assert_int_equal(kv_xport_xfer_results(t[1], &st, &n), KV_OK);
    assert_int_equal(n, 1);
    assert_int_equal(st[0], KV_OK);
    assert_non_null(strstr(kv_xport_xfer_error(t[1]), "max_pending_notes"));
    assert_memory_equal(dst, src, BYTES); /* both halves landed */
    struct kv_xport_msg *msg = malloc(sizeof(*msg));
    assert_int_equal(kv_xport_notify_poll(p.b, 1000, msg), KV_OK);
    assert_int_equal(msg->tag, 80);
    assert_int_equal(kv_xport_notify_poll(p.b, 50, msg), KV_ERR_TIMEOUT); /* never queued */
    free(msg);
    for (int i = 0; i < 2; i++)
        assert_int_equal(kv_xport_xfer_free(t[i]), KV_OK);
    assert_int_equal(kv_xport_rmem_free(r), KV_OK);
    kvt_pair_close_with(&p, (kv_xport_mem *[]){ms, md}, 2);
    free(src);
    free(dst);
}

/* The other end's teardown of kvt_sink_join: rfd closed, r freed, p
 * closed, ms deregistered, x destroyed. */
static inline void kvt_sink_leave(int rfd, kv_xport *x, kv_xport_peer *p, kv_xport_mem *ms,
                                  kv_xport_rmem *r)
{
    close(rfd);
    assert_int_equal(kv_xport_rmem_free(r), KV_OK);
    kv_xport_peer_close(p);
    assert_int_equal(kv_xport_mem_dereg(ms), KV_OK);
    assert_int_equal(kv_xport_destroy(x), KV_OK);
}

/* What a receiver killed under transfer t leaves: t ends FAILED (10 s at
 * most), its peer p CLOSED with KV_ERR_IO. */
static inline void kvt_xfer_peer_lost(kv_xport_xfer *t, kv_xport_peer *p)
{
    kvt_xfer_done(t, KV_XPORT_FAILED);
    kv_status why = KV_OK;
    kv_xport_peer_state ps;
    assert_int_equal(kv_xport_peer_state_get(p, &ps, &why), KV_OK);
    assert_int_equal(ps, KV_XPORT_CLOSED);
    assert_int_equal(why, KV_ERR_IO);
}

/* t (terminal) has at least one entry that is not KV_OK; t freed. */
static inline void kvt_xfer_some_failed(kv_xport_xfer *t)
{
    const kv_status *st;
    uint32_t ns;
    assert_int_equal(kv_xport_xfer_results(t, &st, &ns), KV_OK);
    uint32_t ok = 0;
    for (uint32_t i = 0; i < ns; i++)
        ok += st[i] == KV_OK;
    assert_true(ok < ns);
    assert_int_equal(kv_xport_xfer_free(t), KV_OK);
}

/* The regions of a whole-region case over a pair: src (random) and back
 * (zero) registered on a (ms, mb), dst (0xEE) on b (md) and imported by a
 * as r (its blob as a notification, kvt_share_notify); want starts as a
 * copy of dst, the caller's expectation of it. Each buffer `bytes`. */
struct kvt_region {
    size_t bytes;
    unsigned char *src, *dst, *want, *back;
    kv_xport_mem *ms, *md, *mb;
    kv_xport_rmem *r;
};

/* g's buffers (src from seed, kvt_fill) and regions over pair p. */
static inline void kvt_region_open(struct kvt_region *g, struct kvt_pair *p, size_t bytes,
                                   uint64_t seed)
{
    g->bytes = bytes;
    g->src = malloc(bytes);
    g->dst = malloc(bytes);
    g->want = malloc(bytes);
    g->back = calloc(1, bytes);
    kvt_fill(g->src, bytes, seed);
    memset(g->dst, 0xEE, bytes);
    memcpy(g->want, g->dst, bytes);
    assert_int_equal(kv_xport_mem_reg(p->a, g->src, bytes, KV_MEM_HOST, &g->ms), KV_OK);
    assert_int_equal(kv_xport_mem_reg(p->a, g->back, bytes, KV_MEM_HOST, &g->mb), KV_OK);
    assert_int_equal(kv_xport_mem_reg(p->b, g->dst, bytes, KV_MEM_HOST, &g->md), KV_OK);
    g->r = kvt_share_notify(p, g->md);
}

/* r freed, md, ms and mb deregistered, the pair closed (kvt_pair_close),
 * then g's buffers freed. */
static inline void kvt_region_close(struct kvt_region *g, struct kvt_pair *p)
{
    assert_int_equal(kv_xport_rmem_free(g->r), KV_OK);
    assert_int_equal(kv_xport_mem_dereg(g->md), KV_OK);
    assert_int_equal(kv_xport_mem_dereg(g->ms), KV_OK);
    assert_int_equal(kv_xport_mem_dereg(g->mb), KV_OK);
    kvt_pair_close(p);
    free(g->src);
    free(g->dst);
    free(g->want);
    free(g->back);
}

/* ios[ne]: ranges of src onto disjoint ranges of dst (r), from a stream
 * seeded by seed. Entry i moves 1 + rand % (i % every == 0 ? big : small)
 * bytes into a random place of its slot of dst (bytes / ne each; the last
 * entry ends at dst's last byte) from a random offset of src; want gets
 * each move. big < bytes / ne. */
static inline void kvt_region_ios(struct kvt_region *g, struct kv_xport_io *ios, int ne, int every,
                                  uint64_t big, uint64_t small, uint64_t seed)
{
    uint64_t rng = seed;
    const uint64_t slot = g->bytes / (uint64_t)ne;
    for (int i = 0; i < ne; i++) {
        const uint64_t bytes = 1 + kvt_rand(&rng) % (i % every == 0 ? big : small);
        const uint64_t roff =
            i == ne - 1 ? g->bytes - bytes : (uint64_t)i * slot + kvt_rand(&rng) % (slot - bytes);
        const uint64_t loff = kvt_rand(&rng) % (g->bytes - bytes);
        ios[i] = (struct kv_xport_io){g->ms, loff, g->r, roff, bytes};
        memcpy(g->want + roff, g->src + loff, bytes);
    }
}

/* a writes ios[ne] with a notification (tag 42, "request 42 landed"); b
 * polls it (10 s at most) into msg: its tag, length, bytes and sender (b's
 * peer) as sent, and on its arrival dst already equals want, before the
 * sender's transfer is even looked at (the notification implies the
 * data). Then the transfer DONE, each of its ne entries KV_OK. */
static inline void kvt_region_write_noted(struct kvt_pair *p, struct kvt_region *g,
                                          const struct kv_xport_io *ios, int ne,
                                          struct kv_xport_msg *msg)
{
    const char note[] = "request 42 landed";
    struct kv_xport_notify n = {.tag = 42, .msg = note, .len = sizeof(note)};
    kv_xport_xfer *t = NULL;
    assert_int_equal(kv_xport_write(p->pa, ios, (uint32_t)ne, &n, &t), KV_OK);
    assert_int_equal(kv_xport_notify_poll(p->b, 10000, msg), KV_OK);
    assert_int_equal(msg->tag, 42);
    assert_int_equal(msg->len, sizeof(note));
    assert_memory_equal(msg->data, note, sizeof(note));
    assert_int_equal(msg->peer_id, kv_xport_peer_id(p->pb));
    assert_memory_equal(g->dst, g->want, g->bytes);
    kvt_xfer_done(t, KV_XPORT_DONE);
    const kv_status *st;
    uint32_t ns;
    assert_int_equal(kv_xport_xfer_results(t, &st, &ns), KV_OK);
    assert_int_equal(ns, ne);
    for (int i = 0; i < ne; i++)
        assert_int_equal(st[i], KV_OK);
    assert_int_equal(kv_xport_xfer_free(t), KV_OK);
}

/* a reads the ranges ios[ne] wrote (disjoint) back from r into back, at
 * the same offsets: DONE, and back then equals dst there and stays zero
 * elsewhere. bwant (bytes, zero): that expectation, left for the caller. */
static inline void kvt_region_read_back(struct kvt_pair *p, struct kvt_region *g,
                                        const struct kv_xport_io *ios, int ne, unsigned char *bwant)
{
    struct kv_xport_io *rd = malloc((size_t)ne * sizeof(*rd));
    assert_non_null(rd);
    for (int i = 0; i < ne; i++) {
        rd[i] =
            (struct kv_xport_io){g->mb, ios[i].remote_off, g->r, ios[i].remote_off, ios[i].bytes};
        memcpy(bwant + ios[i].remote_off, g->dst + ios[i].remote_off, ios[i].bytes);
    }
    kv_xport_xfer *t = NULL;
    assert_int_equal(kv_xport_read(p->pa, rd, (uint32_t)ne, &t), KV_OK);
    kvt_xfer_done(t, KV_XPORT_DONE);
    assert_memory_equal(g->back, bwant, g->bytes);
    assert_int_equal(kv_xport_xfer_free(t), KV_OK);
    free(rd);
}

/* The receiver's own check, r forged by the caller to claim more than dst
 * (kv_xport_int.h): a writes three entries with a notification (tag 43),
 * the second past dst's end: the transfer FAILED, that entry
 * KV_ERR_OUT_OF_BOUNDS (the error naming entry 1), the other two KV_OK and
 * landed (want updated), nothing else of dst changed. */
static inline void kvt_region_write_forged(struct kvt_pair *p, struct kvt_region *g)
{
    const uint64_t R = g->bytes;
    struct kv_xport_io f2[3] = {{g->ms, 0, g->r, 100, 1000},
                                {g->ms, 0, g->r, R - 8, 64}, /* past the end */
                                {g->ms, 5000, g->r, 7000, 100}};
    memcpy(g->want + 100, g->src, 1000);
    memcpy(g->want + 7000, g->src + 5000, 100);
    struct kv_xport_notify n2 = {.tag = 43};
    kv_xport_xfer *t = NULL;
    assert_int_equal(kv_xport_write(p->pa, f2, 3, &n2, &t), KV_OK);
    kvt_xfer_done(t, KV_XPORT_FAILED);
    const kv_status *st;
    uint32_t ns;
    assert_int_equal(kv_xport_xfer_results(t, &st, &ns), KV_OK);
    assert_int_equal(st[0], KV_OK);
    assert_int_equal(st[1], KV_ERR_OUT_OF_BOUNDS);
    assert_int_equal(st[2], KV_OK);
    assert_non_null(strstr(kv_xport_xfer_error(t), "entry 1"));
    assert_int_equal(kv_xport_xfer_free(t), KV_OK);
    assert_memory_equal(g->dst, g->want, R);
}

/* This thread (and the threads it creates) into the network namespace
 * /run/netns/<name>; "" back to `home` (an fd of the namespace it left). */
static inline bool kvt_enter_netns(const char *name, int home)
{
    if (!*name)
        return setns(home, CLONE_NEWNET) == 0;
    char path[96];
    snprintf(path, sizeof(path), "/run/netns/%s", name);
    const int fd = open(path, O_RDONLY | O_CLOEXEC);
    const bool ok = fd >= 0 && setns(fd, CLONE_NEWNET) == 0;
    if (fd >= 0)
        close(fd);
    return ok;
}

#endif /* KVT_XPORT_H */
