/*
 * test_xport_auto.c - KV_XPORT_AUTO (connector/transport/kv_xport_auto.c):
 * the connecting side probes the listener over TCP and carries the peer
 * over shared memory when the listener's same-host socket is reachable and
 * echoes its secret, over TCP otherwise.
 *
 *   - two AUTO transports on this host: both ends' peers report path SHM
 *     and why; writes with a notification into a 16 MiB region at offsets
 *     far from 0 (the whole region compared), reads back, cancel in
 *     flight, an unexposed region refused by the receiver, through the
 *     same calls as any backend;
 *   - a proof that fails (the listener's answer names a socket not
 *     reachable from here, as one in another network namespace would be):
 *     the peer stays on TCP, says why, and carries the same traffic;
 *   - two network namespaces on this one kernel (the same boot_id), joined
 *     by a veth pair, as two containers: the listener's socket is not
 *     reachable across them, so both ends stay on TCP, and a write with a
 *     notification lands whole (root and iproute2; skipped otherwise);
 *   - an impostor: the answer names a socket whose owner does not know
 *     the listener's secret: the peer is refused (KV_ERR_MISMATCH naming
 *     the proof), never READY;
 *   - a wrong token: the probe is refused, the TCP handshake too (named);
 *     an AUTO peer against a plain TCP listener: refused (kind);
 *   - the receiver in a child process (two processes, path SHM), SIGKILLed
 *     mid-transfer: the transfer ends FAILED, the peer CLOSED (KV_ERR_IO);
 *   - hostile probe answers (kv__xport_probe_parse): each bad field
 *     refused by name (the fuzz target fuzz_xport_probe covers the rest).
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sched.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>
#include <xxhash.h>

#include <kvcache/kv.h>
#include "kv_xport_frame_int.h"
#include "kv_xport_int.h"
#include "kvt_xport.h"
#include "kvtest.h"

#define TOKEN 0xA070ull
#define REGION (16u << 20)

static kv_xport_kind peer_path(kv_xport_peer *p, char *why, size_t cap)
{
    struct kv_xport_info in = KV_XPORT_INFO_INIT;
    assert_int_equal(kv_xport_peer_info_get(p, &in), KV_OK);
    assert_int_equal(in.kind, KV_XPORT_AUTO);
    snprintf(why, cap, "%s", in.path_why);
    return in.path;
}

static void pair_auto(struct kvt_pair *p, kv_xport *b)
{
    struct kv_xport_config ca = kvt_xport_cfg(KV_XPORT_AUTO, false, TOKEN, 9);
    p->b = b;
    assert_int_equal(kv_xport_create(&ca, &p->a), KV_OK);
    assert_int_equal(kv_xport_connect(p->a, "127.0.0.1", kv_xport_port(p->b), &p->pa), KV_OK);
    assert_int_equal(kv_xport_accept(p->b, 5000, &p->pb), KV_OK);
    assert_int_equal(kvt_xport_settle(p->pa, NULL), KV_XPORT_READY);
}

static kv_xport *listener(void)
{
    struct kv_xport_config cb = kvt_xport_cfg(KV_XPORT_AUTO, true, TOKEN, 9);
    kv_xport *b = NULL;
    assert_int_equal(kv_xport_create(&cb, &b), KV_OK);
    assert_true(kv_xport_port(b) != 0);
    return b;
}

/* Writes, a notification, reads back, cancel and a refused entry over the
 * pair, whatever carries it; the whole destination compared each time. */
static void traffic(struct kvt_pair *p, uint64_t seed)
{
    unsigned char *src = malloc(REGION), *dst = malloc(REGION), *want = malloc(REGION);
    unsigned char *back = calloc(1, REGION), *bwant = calloc(1, REGION);
    kvt_fill(src, REGION, seed);
    memset(dst, 0xEE, REGION);
    memcpy(want, dst, REGION);
    kv_xport_mem *ms, *md, *mb;
    assert_int_equal(kv_xport_mem_reg(p->a, src, REGION, KV_MEM_HOST, &ms), KV_OK);
    assert_int_equal(kv_xport_mem_reg(p->a, back, REGION, KV_MEM_HOST, &mb), KV_OK);
    assert_int_equal(kv_xport_mem_reg(p->b, dst, REGION, KV_MEM_HOST, &md), KV_OK);
    kv_xport_rmem *r = kvt_share_notify(p, md);
    enum { NE = 64 };
    struct kv_xport_io ios[NE], rd[NE];
    uint64_t rng = seed;
    const uint64_t span = REGION / NE;
    for (int i = 0; i < NE; i++) {
        const uint64_t bytes = 1 + kvt_rand(&rng) % (i % 4 == 0 ? span - 1 : 5000);
        const uint64_t roff =
            i == NE - 1 ? REGION - bytes : (uint64_t)i * span + kvt_rand(&rng) % (span - bytes);
        const uint64_t loff = REGION / 2 + kvt_rand(&rng) % (REGION / 2 - bytes);
        ios[i] = (struct kv_xport_io){ms, loff, r, roff, bytes};
        rd[i] = (struct kv_xport_io){mb, roff, r, roff, bytes};
        memcpy(want + roff, src + loff, bytes);
    }
    const char note[] = "landed";
    struct kv_xport_notify n = {.tag = 42, .msg = note, .len = sizeof(note)};
    kv_xport_xfer *t = NULL;
    assert_int_equal(kv_xport_write(p->pa, ios, NE, &n, &t), KV_OK);
    struct kv_xport_msg *msg = malloc(sizeof(*msg));
    assert_int_equal(kv_xport_notify_poll(p->b, 10000, msg), KV_OK);
    assert_int_equal(msg->tag, 42);
    assert_int_equal(msg->peer_id, kv_xport_peer_id(p->pb));
    assert_memory_equal(msg->data, note, sizeof(note));
    assert_memory_equal(dst, want, REGION); /* the notification implies the data */
    kvt_xfer_done(t, KV_XPORT_DONE);
    assert_int_equal(kv_xport_xfer_free(t), KV_OK);

    for (int i = 0; i < NE; i++)
        memcpy(bwant + rd[i].local_off, dst + rd[i].remote_off, rd[i].bytes);
    assert_int_equal(kv_xport_read(p->pa, rd, NE, &t), KV_OK);
    kvt_xfer_done(t, KV_XPORT_DONE);
    assert_memory_equal(back, bwant, REGION);
    assert_int_equal(kv_xport_xfer_free(t), KV_OK);

    /* cancel in flight: CANCELLED (or DONE if it beat the cancel), its
     * notification never delivered; the next one is */
    struct kv_xport_io big[8];
    for (int i = 0; i < 8; i++)
        big[i] = (struct kv_xport_io){ms, 0, r, 0, REGION};
    struct kv_xport_notify n2 = {.tag = 77};
    assert_int_equal(kv_xport_write(p->pa, big, 8, &n2, &t), KV_OK);
    assert_int_equal(kv_xport_xfer_cancel(t), KV_OK);
    kv_xport_state s;
    assert_int_equal(kv_xport_xfer_wait(t, 10000, &s), KV_OK);
    assert_true(s == KV_XPORT_CANCELLED || s == KV_XPORT_DONE);
    const bool cancelled = s == KV_XPORT_CANCELLED;
    assert_int_equal(kv_xport_xfer_free(t), KV_OK);
    struct kv_xport_io one = {ms, 4096, r, 8192, 100000};
    struct kv_xport_notify n3 = {.tag = 78};
    assert_int_equal(kv_xport_write(p->pa, &one, 1, &n3, &t), KV_OK);
    assert_int_equal(kv_xport_notify_poll(p->b, 10000, msg), KV_OK);
    if (!cancelled && msg->tag == 77)
        assert_int_equal(kv_xport_notify_poll(p->b, 10000, msg), KV_OK);
    assert_int_equal(msg->tag, 78);
    assert_memory_equal(dst + 8192, src + 4096, 100000);
    kvt_xfer_done(t, KV_XPORT_DONE);
    assert_int_equal(kv_xport_xfer_free(t), KV_OK);

    /* the receiver's own check: unexposed, the write is refused there */
    memcpy(want, dst, REGION);
    assert_int_equal(kv_xport_mem_unexpose(p->pb, md), KV_OK);
    struct kv_xport_io late = {ms, 0, r, 1u << 20, 4096};
    assert_int_equal(kv_xport_write(p->pa, &late, 1, NULL, &t), KV_OK);
    kvt_xfer_done(t, KV_XPORT_FAILED);
    const kv_status *st;
    uint32_t ns;
    assert_int_equal(kv_xport_xfer_results(t, &st, &ns), KV_OK);
    assert_int_equal(st[0], KV_ERR_OUT_OF_BOUNDS);
    assert_int_equal(kv_xport_xfer_free(t), KV_OK);
    assert_memory_equal(dst, want, REGION);

    assert_int_equal(kv_xport_rmem_free(r), KV_OK);
    assert_int_equal(kv_xport_mem_dereg(md), KV_OK);
    assert_int_equal(kv_xport_mem_dereg(ms), KV_OK);
    assert_int_equal(kv_xport_mem_dereg(mb), KV_OK);
    free(msg);
    free(src);
    free(dst);
    free(want);
    free(back);
    free(bwant);
}

static void test_xport_auto_same_host_picks_shm(void **state)
{
    (void)state;
    struct kvt_pair p;
    pair_auto(&p, listener());
    char why[256];
    assert_int_equal(peer_path(p.pa, why, sizeof(why)), KV_XPORT_SHM);
    assert_non_null(strstr(why, "shm: 127.0.0.1:"));
    assert_non_null(strstr(why, "kvcache-shm:auto-"));
    assert_int_equal(peer_path(p.pb, why, sizeof(why)), KV_XPORT_SHM);
    assert_non_null(strstr(why, "accepted on this transport's same-host socket"));
    struct kv_xport_info in = KV_XPORT_INFO_INIT;
    assert_int_equal(kv_xport_info_get(p.b, &in), KV_OK);
    assert_int_equal(in.path, KV_XPORT_AUTO);
    assert_non_null(strstr(in.path_why, "same-host socket kvcache-shm:auto-"));
    assert_int_equal(kv_xport_peer_info_get(p.pa, &in), KV_OK);
    char line[400];
    kv_xport_info_format(&in, line, sizeof(line));
    assert_true(strncmp(line, "auto path shm (shm: ", 20) == 0);
    assert_string_equal(kv_xport_kind_name(KV_XPORT_AUTO), "auto");
    traffic(&p, 5);
    /* a second peer to the same listener takes the same path */
    kv_xport_peer *p2 = NULL, *q2 = NULL;
    assert_int_equal(kv_xport_connect(p.a, "127.0.0.1", kv_xport_port(p.b), &p2), KV_OK);
    assert_int_equal(kv_xport_accept(p.b, 5000, &q2), KV_OK);
    assert_int_equal(kvt_xport_settle(p2, NULL), KV_XPORT_READY);
    assert_int_equal(peer_path(p2, why, sizeof(why)), KV_XPORT_SHM);
    kv_xport_peer_close(p2);
    kv_xport_peer_close(q2);
    struct kv_xport_stats stb = KV_XPORT_STATS_INIT;
    assert_int_equal(kv_xport_stats_get(p.b, &stb), KV_OK);
    assert_int_equal(stb.peers_refused, 0); /* probe connections are not refusals */
    kvt_pair_close(&p);
}

static void test_xport_auto_failed_proof_stays_on_tcp(void **state)
{
    (void)state;
    kv_xport *b = listener();
    pthread_mutex_lock(&b->mu);
    b->auto_offer_elsewhere = true; /* as a listener in another namespace is seen */
    pthread_mutex_unlock(&b->mu);
    struct kvt_pair p;
    pair_auto(&p, b);
    char why[256];
    assert_int_equal(peer_path(p.pa, why, sizeof(why)), KV_XPORT_TCP);
    assert_non_null(strstr(why, "tcp: the offered socket kvcache-shm:auto-"));
    assert_non_null(strstr(why, "-elsewhere"));
    assert_int_equal(peer_path(p.pb, why, sizeof(why)), KV_XPORT_TCP);
    assert_non_null(strstr(why, "tcp: accepted"));
    traffic(&p, 6);
    kvt_pair_close(&p);
}

static void test_xport_auto_impostor_refused(void **state)
{
    (void)state;
    kv_xport *b = listener(), *m = listener();
    /* b's answer names m's socket: m answers with its own secret */
    pthread_mutex_lock(&b->mu);
    snprintf(b->auto_name, sizeof(b->auto_name), "%s", m->auto_name);
    b->auto_shm_port = m->auto_shm_port;
    pthread_mutex_unlock(&b->mu);
    struct kv_xport_config ca = kvt_xport_cfg(KV_XPORT_AUTO, false, TOKEN, 9);
    kv_xport *a = NULL;
    kv_xport_peer *pa = NULL;
    assert_int_equal(kv_xport_create(&ca, &a), KV_OK);
    assert_int_equal(kv_xport_connect(a, "127.0.0.1", kv_xport_port(b), &pa), KV_OK);
    kv_status why = KV_OK;
    assert_int_equal(kvt_xport_settle(pa, &why), KV_XPORT_CLOSED);
    assert_int_equal(why, KV_ERR_MISMATCH);
    char w[256];
    assert_int_equal(peer_path(pa, w, sizeof(w)), KV_XPORT_SHM);
    kv_xport_peer *pb = NULL;
    assert_int_equal(kv_xport_accept(b, 100, &pb), KV_ERR_TIMEOUT); /* never reached b */
    kv_xport_peer_close(pa);
    assert_int_equal(kv_xport_destroy(a), KV_OK);
    assert_int_equal(kv_xport_destroy(m), KV_OK);
    assert_int_equal(kv_xport_destroy(b), KV_OK);
}

static void test_xport_auto_refusals(void **state)
{
    (void)state;
    kv_xport *b = listener();
    /* a wrong token: the probe refused, the TCP handshake too */
    struct kv_xport_config ca = kvt_xport_cfg(KV_XPORT_AUTO, false, TOKEN + 1, 9);
    kv_xport *a = NULL;
    kv_xport_peer *pa = NULL;
    assert_int_equal(kv_xport_create(&ca, &a), KV_OK);
    assert_int_equal(kv_xport_connect(a, "127.0.0.1", kv_xport_port(b), &pa), KV_OK);
    char w[256];
    assert_int_equal(peer_path(pa, w, sizeof(w)), KV_XPORT_TCP);
    assert_non_null(strstr(w, "refused the probe"));
    assert_non_null(strstr(w, "token"));
    kv_status why = KV_OK;
    assert_int_equal(kvt_xport_settle(pa, &why), KV_XPORT_CLOSED);
    assert_int_equal(why, KV_ERR_MISMATCH);
    kv_xport_peer_close(pa);
    assert_int_equal(kv_xport_destroy(a), KV_OK);
    /* AUTO against a plain TCP listener: refused by kind */
    struct kv_xport_config ct = kvt_xport_cfg(KV_XPORT_TCP, true, TOKEN, 9);
    kv_xport *t = NULL;
    assert_int_equal(kv_xport_create(&ct, &t), KV_OK);
    ca = kvt_xport_cfg(KV_XPORT_AUTO, false, TOKEN, 9);
    assert_int_equal(kv_xport_create(&ca, &a), KV_OK);
    assert_int_equal(kv_xport_connect(a, "127.0.0.1", kv_xport_port(t), &pa), KV_OK);
    assert_int_equal(peer_path(pa, w, sizeof(w)), KV_XPORT_TCP);
    assert_non_null(strstr(w, "kind"));
    assert_int_equal(kvt_xport_settle(pa, &why), KV_XPORT_CLOSED);
    assert_int_equal(why, KV_ERR_MISMATCH);
    kv_xport_peer_close(pa);
    assert_int_equal(kv_xport_destroy(t), KV_OK);
    /* nobody listening there: the probe fails, so does TCP. The port is
     * held by a socket bound and never listening (a connection to it is
     * refused, and nothing else can listen there meanwhile): the destroyed
     * listener's port could be taken again by a test running beside this
     * one before the connect. */
    const int hold = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    assert_true(hold >= 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t sl = sizeof(sa);
    assert_int_equal(bind(hold, (struct sockaddr *)&sa, sizeof(sa)), 0);
    assert_int_equal(getsockname(hold, (struct sockaddr *)&sa, &sl), 0);
    const uint16_t gone = ntohs(sa.sin_port);
    assert_int_equal(kv_xport_connect(a, "127.0.0.1", gone, &pa), KV_OK);
    assert_int_equal(peer_path(pa, w, sizeof(w)), KV_XPORT_TCP);
    assert_non_null(strstr(w, "no same-host offer"));
    assert_int_equal(kvt_xport_settle(pa, &why), KV_XPORT_CLOSED);
    assert_int_equal(why, KV_ERR_IO);
    kv_xport_peer_close(pa);
    close(hold);
    assert_int_equal(kv_xport_destroy(a), KV_OK);
    struct kv_xport_stats st = KV_XPORT_STATS_INIT;
    assert_int_equal(kv_xport_stats_get(b, &st), KV_OK);
    /* the wrong token: its probe and each of its 2 TCP connections */
    assert_int_equal(st.peers_refused, 3);
    assert_int_equal(kv_xport_destroy(b), KV_OK);
}

/* ---- the receiver in another process, killed ------------------------ */

static int sink_child(int fd)
{
    kv_xport *x = NULL;
    kv_xport_peer *p = NULL;
    kv_xport_mem *m = NULL;
    unsigned char blob[KV_XPORT_BLOB_MAX];
    size_t bl = 0;
    const int rc = kvt_sink_open(KV_XPORT_AUTO, TOKEN, fd, REGION, &x, &p, &m, blob, &bl);
    if (rc)
        return rc;
    struct kv_xport_info in = KV_XPORT_INFO_INIT;
    if (kv_xport_peer_info_get(p, &in) != KV_OK || in.path != KV_XPORT_SHM)
        return 6;
    struct kv_xport_notify n = {.tag = 1, .msg = blob, .len = (uint32_t)bl};
    kv_xport_xfer *t = NULL;
    if (kv_xport_write(p, NULL, 0, &n, &t) != KV_OK)
        return 5;
    pause(); /* until killed */
    return 0;
}

static void test_xport_auto_two_procs_peer_killed(void **state)
{
    (void)state;
    unsigned char *src = malloc(REGION);
    kvt_fill(src, REGION, 3);
    int rfd = -1;
    const pid_t pid = kvt_xport_fork(sink_child, &rfd);
    kv_xport *x = NULL;
    kv_xport_peer *p = NULL;
    kv_xport_mem *ms = NULL;
    kv_xport_rmem *r = NULL;
    kvt_sink_join(KV_XPORT_AUTO, TOKEN, rfd, src, REGION, &x, &p, &ms, &r);
    char w[256];
    assert_int_equal(peer_path(p, w, sizeof(w)), KV_XPORT_SHM);
    /* one write that lands whole first */
    struct kv_xport_io first = {ms, 12345, r, REGION - 777777, 777777};
    kv_xport_xfer *t = NULL;
    assert_int_equal(kv_xport_write(p, &first, 1, NULL, &t), KV_OK);
    kvt_xfer_done(t, KV_XPORT_DONE);
    assert_int_equal(kv_xport_xfer_free(t), KV_OK);
    enum { NE = 256 };
    struct kv_xport_io *ios = malloc(NE * sizeof(*ios));
    for (int i = 0; i < NE; i++)
        ios[i] = (struct kv_xport_io){ms, 0, r, 0, REGION};
    struct kv_xport_notify n = {.tag = 55};
    assert_int_equal(kv_xport_write(p, ios, NE, &n, &t), KV_OK);
    usleep(20000);
    assert_int_equal(kill(pid, SIGKILL), 0);
    kvt_xfer_peer_lost(t, p);
    int wst = 0;
    assert_int_equal(waitpid(pid, &wst, 0), pid);
    assert_true(WIFSIGNALED(wst)); /* not an early exit of the child's own */
    assert_int_equal(kv_xport_xfer_free(t), KV_OK);
    kvt_sink_leave(rfd, x, p, ms, r);
    free(ios);
    free(src);
}

/* ---- two network namespaces, one kernel ------------------------------ */

static char g_ns_a[32], g_ns_b[32];
#define NS_HOST "10.231.8.2"
#define NS_BYTES (1u << 20)

/* Decode in netns b: listens on NS_HOST, its peer must be on TCP; sends its
 * region's blob, then checks the region against the XXH3 the notification
 * carries. 0, or the step that failed. */
static int netns_child(int wfd)
{
    if (!kvt_enter_netns(g_ns_b, -1))
        return 120;
    struct kv_xport_config c = kvt_xport_cfg(KV_XPORT_AUTO, true, TOKEN, 0);
    c.listen_host = NS_HOST;
    kv_xport *x = NULL;
    kv_xport_peer *p = NULL;
    kv_xport_mem *m = NULL;
    if (kv_xport_create(&c, &x) != KV_OK)
        return 1;
    const uint16_t port = kv_xport_port(x);
    if (write(wfd, &port, 2) != 2 || kv_xport_accept(x, 10000, &p) != KV_OK)
        return 2;
    struct kv_xport_info in = KV_XPORT_INFO_INIT;
    if (kv_xport_peer_info_get(p, &in) != KV_OK || in.path != KV_XPORT_TCP ||
        !strstr(in.path_why, "tcp: accepted"))
        return 3;
    unsigned char *dst = calloc(1, NS_BYTES), blob[KV_XPORT_BLOB_MAX];
    size_t bl = 0;
    if (kv_xport_mem_reg(x, dst, NS_BYTES, KV_MEM_HOST, &m) != KV_OK ||
        kv_xport_mem_expose(p, m, blob, sizeof(blob), &bl) != KV_OK)
        return 4;
    struct kv_xport_notify n = {.tag = 1, .msg = blob, .len = (uint32_t)bl};
    kv_xport_xfer *t = NULL;
    if (kv_xport_write(p, NULL, 0, &n, &t) != KV_OK)
        return 5;
    struct kv_xport_msg *msg = malloc(sizeof(*msg));
    uint64_t want = 0;
    if (kv_xport_notify_poll(x, 10000, msg) != KV_OK || msg->tag != 2 || msg->len != 8)
        return 6;
    memcpy(&want, msg->data, 8);
    if (XXH3_64bits(dst, NS_BYTES) != want)
        return 7;
    /* until the parent closes (its transfer DONE: the notification acknowledged) */
    kv_xport_peer_state ps = KV_XPORT_READY;
    kv_status why;
    for (int i = 0; i < 10000 && ps != KV_XPORT_CLOSED; i++) {
        if (kv_xport_peer_state_get(p, &ps, &why) != KV_OK)
            return 8;
        usleep(1000);
    }
    return ps == KV_XPORT_CLOSED ? 0 : 9;
}

static void test_xport_auto_two_netns_stays_on_tcp(void **state)
{
    (void)state;
    const int id = (int)getpid() % 100000;
    snprintf(g_ns_a, sizeof(g_ns_a), "kvaa%d", id);
    snprintf(g_ns_b, sizeof(g_ns_b), "kvab%d", id);
    const char *a = g_ns_a, *b = g_ns_b;
    char cmd[1024];
    snprintf(cmd, sizeof(cmd),
             "ip netns add %s && ip netns add %s && "
             "ip link add %s type veth peer name %s && "
             "ip link set %s netns %s && ip link set %s netns %s && "
             "ip -n %s addr add 10.231.8.1/30 dev %s && ip -n %s addr add " NS_HOST "/30 dev %s && "
             "ip -n %s link set %s up && ip -n %s link set %s up && "
             "ip -n %s link set lo up && ip -n %s link set lo up",
             a, b, a, b, a, a, b, b, a, a, b, b, a, a, b, b, a, b);
    if (system(cmd) != 0) {
        snprintf(cmd, sizeof(cmd), "ip netns del %s 2>/dev/null; ip netns del %s 2>/dev/null", a,
                 b);
        (void)system(cmd);
        fprintf(stderr, "test_xport_auto_two_netns_stays_on_tcp: SKIPPED: cannot create network "
                        "namespaces and a veth pair here (needs root and iproute2)\n");
        skip();
    }
    int rfd = -1;
    const pid_t pid = kvt_xport_fork(netns_child, &rfd);
    uint16_t port = 0;
    assert_int_equal(read(rfd, &port, 2), 2);
    /* prefill in netns a: its transport's threads are born there */
    const int home = open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC);
    assert_true(home >= 0);
    assert_true(kvt_enter_netns(a, home));
    struct kv_xport_config c = kvt_xport_cfg(KV_XPORT_AUTO, false, TOKEN, 0);
    kv_xport *x = NULL;
    kv_xport_peer *p = NULL;
    const kv_status cs = kv_xport_create(&c, &x);
    const kv_status ks = cs == KV_OK ? kv_xport_connect(x, NS_HOST, port, &p) : cs;
    assert_true(kvt_enter_netns("", home));
    close(home);
    assert_int_equal(cs, KV_OK);
    assert_int_equal(ks, KV_OK);
    assert_int_equal(kvt_xport_settle(p, NULL), KV_XPORT_READY);
    char w[256];
    assert_int_equal(peer_path(p, w, sizeof(w)), KV_XPORT_TCP);
    assert_non_null(strstr(w, "tcp: the offered socket kvcache-shm:auto-"));
    assert_non_null(strstr(w, "Connection refused"));
    unsigned char *src = malloc(NS_BYTES);
    kvt_fill(src, NS_BYTES, 8);
    kv_xport_mem *ms = NULL;
    assert_int_equal(kv_xport_mem_reg(x, src, NS_BYTES, KV_MEM_HOST, &ms), KV_OK);
    struct kv_xport_msg *msg = malloc(sizeof(*msg));
    assert_int_equal(kv_xport_notify_poll(x, 10000, msg), KV_OK);
    kv_xport_rmem *r = NULL;
    assert_int_equal(kv_xport_rmem_import(p, msg->data, msg->len, &r), KV_OK);
    const uint64_t h = XXH3_64bits(src, NS_BYTES);
    struct kv_xport_io io = {ms, 0, r, 0, NS_BYTES};
    struct kv_xport_notify n = {.tag = 2, .msg = &h, .len = 8};
    kv_xport_xfer *t = NULL;
    assert_int_equal(kv_xport_write(p, &io, 1, &n, &t), KV_OK);
    kvt_xfer_done(t, KV_XPORT_DONE);
    assert_int_equal(kv_xport_xfer_free(t), KV_OK);
    assert_int_equal(kv_xport_rmem_free(r), KV_OK);
    kv_xport_peer_close(p);
    int wst = 0;
    assert_int_equal(waitpid(pid, &wst, 0), pid);
    assert_true(WIFEXITED(wst));
    assert_int_equal(WEXITSTATUS(wst), 0);
    assert_int_equal(kv_xport_mem_dereg(ms), KV_OK);
    assert_int_equal(kv_xport_destroy(x), KV_OK);
    close(rfd);
    free(msg);
    free(src);
    snprintf(cmd, sizeof(cmd), "ip netns del %s; ip netns del %s", a, b);
    assert_int_equal(system(cmd), 0);
}

/* ---- hostile probe answers ------------------------------------------ */

/* A probe answer frame around payload[len] (checksums right). */
static size_t frame(unsigned char *out, const unsigned char *payload, size_t len, uint16_t type)
{
    const struct kv__xf f = {.version = KV_XPORT_PROTOCOL_VERSION,
                             .type = type,
                             .length = len,
                             .payload_sum = len ? XXH3_64bits(payload, len) : 0};
    kv__xf_encode(&f, out);
    memcpy(out + KV__XF_BYTES, payload, len);
    return KV__XF_BYTES + len;
}

static void expect_bad(const kv_xport *x, const unsigned char *pl, size_t len, uint16_t type,
                       kv_status want, const char *words)
{
    unsigned char b[KV__XF_BYTES + 512];
    const size_t n = frame(b, pl, len, type);
    struct kv__xport_offer o;
    assert_int_equal(kv__xport_probe_parse(x, 0x1234, b, n, &o), want);
    if (!strstr(kv_last_error(), words))
        fail_msg("\"%s\" does not say \"%s\"", kv_last_error(), words);
}

static void test_xport_auto_probe_answer_checked(void **state)
{
    (void)state;
    kv_xport *b = listener();
    unsigned char good[KV__XPORT_PROBE_BYTES], pl[KV__XPORT_PROBE_BYTES];
    const struct kv__xport_hello h = {.version = KV_XPORT_PROTOCOL_VERSION,
                                      .kind = KV_XPORT_AUTO,
                                      .token = TOKEN,
                                      .fingerprint = 9,
                                      .nonce = 0x1234};
    pthread_mutex_lock(&b->mu);
    kv__xport_probe_answer(b, &h, good);
    pthread_mutex_unlock(&b->mu);
    unsigned char fb[KV__XF_BYTES + KV__XPORT_PROBE_BYTES];
    size_t n = frame(fb, good, sizeof(good), KV__XF_HELLO);
    struct kv__xport_offer o;
    assert_int_equal(kv__xport_probe_parse(b, 0x1234, fb, n, &o), KV_OK);
    assert_int_equal(o.secret, b->auto_secret);
    assert_int_equal(o.port, b->auto_shm_port);
    assert_string_equal(o.name, b->auto_name);
    /* the frame: short, a payload cut, another nonce answered */
    assert_int_equal(kv__xport_probe_parse(b, 0x1234, fb, 10, &o), KV_ERR_CORRUPT);
    assert_int_equal(kv__xport_probe_parse(b, 0x1234, fb, n - 1, &o), KV_ERR_CORRUPT);
    assert_int_equal(kv__xport_probe_parse(b, 0x9999, fb, n, &o), KV_ERR_CORRUPT);
    assert_non_null(strstr(kv_last_error(), "answering 0x0000000000001234"));
    fb[KV__XF_BYTES + 70] ^= 1; /* payload checksum */
    assert_int_equal(kv__xport_probe_parse(b, 0x1234, fb, n, &o), KV_ERR_CORRUPT);
    assert_non_null(strstr(kv_last_error(), "checksum"));
    expect_bad(b, good, sizeof(good) - 1, KV__XF_HELLO, KV_ERR_CORRUPT, "111 bytes");
    expect_bad(b, good, sizeof(good), KV__XF_ACK, KV_ERR_CORRUPT, "type 4");
    const size_t O = KV__XPORT_HELLO_BYTES;
    struct {
        size_t at;
        unsigned char v;
        kv_status st;
        const char *words;
    } cases[] = {
        {40, 2, KV_ERR_CORRUPT, "conns 2"},                 /* a probe answer has no connections */
        {8, 0x55, KV_ERR_MISMATCH, "token"},                /* another token */
        {O + 0, 0, KV_ERR_CORRUPT, "secret"},               /* secret 0 (with the next) */
        {O + 10, 41, KV_ERR_CORRUPT, "a name of 41 bytes"}, /* name over the limit */
        {O + 10, 0, KV_ERR_CORRUPT, "a name of 0 bytes"},
        {O + 13, 1, KV_ERR_CORRUPT, "reserved"},
        {O + 60, 1, KV_ERR_CORRUPT, "reserved"},
        {O + 16, '/', KV_ERR_CORRUPT, "name byte 0 is 0x2f"},
        {O + 16 + 39, 'a', KV_ERR_CORRUPT, "name byte 39"}, /* past name_len: not zero */
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        memcpy(pl, good, sizeof(pl));
        if (cases[i].at == O + 0)
            memset(pl + O, 0, 8);
        else
            pl[cases[i].at] = cases[i].v;
        expect_bad(b, pl, sizeof(pl), KV__XF_HELLO, cases[i].st, cases[i].words);
    }
    memcpy(pl, good, sizeof(pl));
    pl[O + 8] = pl[O + 9] = 0; /* port 0 */
    expect_bad(b, pl, sizeof(pl), KV__XF_HELLO, KV_ERR_CORRUPT, "port 0");
    /* a REFUSE: its status and reason, unprintable bytes replaced */
    const char r[] = "no\x01way";
    unsigned char rb[KV__XF_BYTES + 16];
    const struct kv__xf rf = {.version = KV_XPORT_PROTOCOL_VERSION,
                              .type = KV__XF_REFUSE,
                              .offset = (uint64_t)(int64_t)KV_ERR_MISMATCH,
                              .length = sizeof(r) - 1,
                              .payload_sum = XXH3_64bits(r, sizeof(r) - 1)};
    kv__xf_encode(&rf, rb);
    memcpy(rb + KV__XF_BYTES, r, sizeof(r) - 1);
    assert_int_equal(kv__xport_probe_parse(b, 0x1234, rb, KV__XF_BYTES + sizeof(r) - 1, &o),
                     KV_ERR_MISMATCH);
    assert_non_null(strstr(kv_last_error(), "refused the probe: no?way"));
    assert_int_equal(kv_xport_destroy(b), KV_OK);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_xport_auto_same_host_picks_shm),
        cmocka_unit_test(test_xport_auto_failed_proof_stays_on_tcp),
        cmocka_unit_test(test_xport_auto_impostor_refused),
        cmocka_unit_test(test_xport_auto_refusals),
        cmocka_unit_test(test_xport_auto_two_procs_peer_killed),
        cmocka_unit_test(test_xport_auto_two_netns_stays_on_tcp),
        cmocka_unit_test(test_xport_auto_probe_answer_checked),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
