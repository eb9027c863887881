/*
 * test_xport_rdma.c - the transport seam over its RDMA backend
 * (connector/transport/kv_xport_rdma_verbs.c), end to end in two processes over the
 * software verbs device (tests/softverbs: kv__verbs_set(kvt_softverbs())),
 * or over the real device when KV_RDMA_REAL=1 (scripts/rdma-check.sh; the
 * fault cases, which need the soft device, are skipped then).
 *
 * A decode child (forked first, before anything else runs) listens,
 * exposes region A (written by the parent, zeroed, compared whole on
 * request) and region B (a pattern, read by the parent) to every peer that
 * connects, and sends both blobs as notifications. The prefill parent:
 *
 *   - without any device: kv_xport_create(KV_XPORT_RDMA) is
 *     KV_ERR_UNSUPPORTED naming that no RDMA device was found;
 *   - handshake; registration split into 8 MiB MRs (the soft device's
 *     max_mr_size set small); writes at offsets far from 0, across MR chunk
 *     boundaries on both sides, up to the region's last byte, remote-
 *     contiguous runs gathered into SGE lists, then a notification: the
 *     child compares the whole region when it arrives (so the data landed
 *     before it); 3000 small writes (more WRs than the send queue holds);
 *     reads, the whole local region compared; a K-only (MLA latent) write_plan
 *     into a decode layout of another page size and arrangement, the pool
 *     compared whole against kv_plan_copy;
 *   - faults: a delayed completion (still DONE), retry exceeded (FAILED,
 *     KV_ERR_IO, the peer closed), a forged out-of-bounds rmem (the
 *     responder refuses: KV_ERR_OUT_OF_BOUNDS), a lost completion
 *     (TIMED_OUT, the peer closed), cancel in flight (CANCELLED; every
 *     entry reported KV_OK really landed; the peer still works), a wrong
 *     token and a wrong fingerprint (refused, naming the field), the peer
 *     killed mid-transfer (FAILED, not every entry KV_OK);
 *   - idle: a connected pair left alone 1.5 s; in event mode each process
 *     uses < 0.05 s of CPU (its progress thread sleeps on the completion
 *     channel), in busy-poll mode the figure is printed (it polls).
 *
 *   - parameters: each side's device, port, link layer, LID, GID (index,
 *     type) and MTU, and the path (MTU, GRH, the peer's LID and GID), as
 *     kv_xport_info reports them; refusals of a device, port or GID index
 *     that does not exist or is not usable (named); the INFO decoder on
 *     every malformation and on 20,000 mutated blobs.
 *
 *   - in this process (a transport pair, or a hostile TCP peer): reads cut
 *     to the device's max_sge_rd (set small: every READ WR within it, the
 *     whole local region exact); kv_xport_peer_close after the remote side
 *     closed returns only once the exposure's slowed MR deregistration
 *     ended (the region then deregisters), as does kv_xport_mem_unexpose
 *     then (KV_ERR_NOT_FOUND: the close ended it), and a kv_xport_peer_close
 *     while another thread's unexpose of the peer's region is deregistering
 *     its MR; a read-only or unmapped region refused at
 *     kv_xport_mem_reg, named; a write in flight when its target region is
 *     unexposed and deregistered ends FAILED and lands nothing after (the
 *     memory overwritten at once stays as written); OOB READY messages of
 *     the wrong length, content or phase, or twice, close the peer
 *     KV_ERR_CORRUPT naming them; forged remote keys (no chunks, a chunk
 *     count the region's bytes do not need, chunk 0, a length that does
 *     not match, a base that wraps) refused KV_ERR_CORRUPT naming the
 *     values, nothing sent.
 *
 * The whole suite runs twice over a soft fabric of three devices (FABRIC),
 * each time with a decode child of its own: event mode (the default) on
 * both sides over RoCE, then cfg.rdma_busy_poll on both over InfiniBand
 * across two devices with different MTUs.
 */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include <kvcache/kv.h>
#include "kv_verbs_int.h"
#include "kv_xport_int.h"
#include "kv_xport_rdma_int.h"
#include "kvt_side.h"
#include "kvt_softverbs.h"
#include "kvt_xport.h"
#include "kvtest.h"

#define TOKEN 0x5EC12E7ull
#define FP 0xF00Dull
#define REGION (20u << 20) /* 3 MRs of 8 MiB on the soft device */
#define MR_MAX (8u << 20)
/* How long the parent waits for the child's answers (its blobs, a RESULT).
 * The child compares the whole region byte by byte before it answers: a
 * second under TSan, over 10 s on a loaded machine (seen: a RESULT later
 * than 10 s, and the next tests' sessions refused behind it). Only bounds
 * a wait; what the answer says is what is checked. */
#define ANSWER_MS 60000
#define SEED_B 77u

enum tags {
    TAG_BLOB_A = 1,
    TAG_BLOB_B,
    TAG_CHECK,      /* ranges (struct span[]): compare region A, reply RESULT */
    TAG_LOOSE,      /* the same, only inside the ranges */
    TAG_ZERO,       /* zero region A, reply RESULT */
    TAG_RESULT,     /* u64: the first bad offset, UINT64_MAX when none */
    TAG_UNEXPOSE_B, /* withdraw region B from this peer, reply RESULT */
    TAG_QUIET,      /* ignored (sess_quiesce) */
};

/* Bytes [roff, roff + len) of A hold pat(seed, loff + i): count runs, the
 * k-th at roff + k * rstride from loff + k * lstride. */
struct span {
    uint64_t roff, len, loff, seed, count, rstride, lstride;
};

static bool real_dev;    /* KV_RDMA_REAL=1: no soft device */
static pid_t child = -1; /* the decode process */
static uint16_t port;    /* its listening port */
static bool busy_poll;   /* this pass's cfg.rdma_busy_poll, both processes */
static bool pass_ib;     /* this pass's fabric: InfiniBand (else RoCE) */

/* The soft fabric (both processes): two InfiniBand devices, the first
 * with port 1 down, and a RoCE one. The event-mode pass runs over RoCE
 * (both sides on kvt_roce0, named); the busy-poll pass over InfiniBand
 * across two devices: this process picks its own (the first ACTIVE port:
 * kvt_ib0 port 2), the decode child is given kvt_ib1 by name, whose
 * smaller MTU (2048) the path must take. */
static const struct kvt_sv_dev_spec FABRIC[] = {
    {.name = "kvt_ib0",
     .n_ports = 2,
     .port = {{IBV_LINK_LAYER_INFINIBAND, IBV_MTU_4096, true},
              {IBV_LINK_LAYER_INFINIBAND, IBV_MTU_4096, false}}},
    {.name = "kvt_ib1", .n_ports = 1, .port = {{IBV_LINK_LAYER_INFINIBAND, IBV_MTU_2048, false}}},
    {.name = "kvt_roce0", .n_ports = 1, .port = {{IBV_LINK_LAYER_ETHERNET, IBV_MTU_1024, false}}},
};

static unsigned char pat(uint64_t seed, uint64_t off)
{
    uint64_t v = (off + 1) * 0x9E3779B97F4A7C15ull ^ seed * 0xD1B54A32D192ED03ull;
    v ^= v >> 29;
    return (unsigned char)(v >> 17);
}

static void pat_fill(unsigned char *p, uint64_t n, uint64_t seed)
{
    for (uint64_t i = 0; i < n; i++)
        p[i] = pat(seed, i);
}

/* KV_RDMA_DEVICES="mlx5_0,mlx5_1" (real device only): those rails; every
 * region of the test is registered on rail 0 (kv_xport_mem_reg_on), the
 * other rails are connected and reported (kv_xport_info_format). */
static char rails_buf[256];
static const char *rails[KV_XPORT_MAX_RAILS];

static void rails_from_env(struct kv_xport_config *c)
{
    const char *e = getenv("KV_RDMA_DEVICES");
    if (!e || !*e)
        return;
    snprintf(rails_buf, sizeof(rails_buf), "%s", e);
    uint32_t n = 0;
    for (char *save = NULL, *t = strtok_r(rails_buf, ",", &save); t && n < KV_XPORT_MAX_RAILS;
         t = strtok_r(NULL, ",", &save))
        rails[n++] = t;
    c->rdma_device = NULL;
    c->rdma_devices = rails;
    c->n_rdma_devices = n;
}

static struct kv_xport_config cfg_make(bool listen, uint64_t token, uint64_t fp, uint32_t ms)
{
    struct kv_xport_config c = KV_XPORT_CONFIG_INIT;
    c.kind = KV_XPORT_RDMA;
    c.listen_host = listen ? "127.0.0.1" : NULL;
    c.token = token;
    c.fingerprint = fp;
    c.conns_per_peer = 2;
    c.timeout_ms = ms;
    c.rdma_busy_poll = busy_poll;
    if (!real_dev) /* the child names its device; the parent names RoCE only */
        c.rdma_device =
            listen ? (pass_ib ? "kvt_ib1" : "kvt_roce0") : (pass_ib ? NULL : "kvt_roce0");
    if (real_dev) { /* scripts/rdma-check.sh passes what its caller chose, if anything */
        c.rdma_device = getenv("KV_RDMA_DEVICE");
        rails_from_env(&c);
        c.rdma_port = getenv("KV_RDMA_PORT") ? (uint32_t)atoi(getenv("KV_RDMA_PORT")) : 0;
        c.rdma_gid_index = getenv("KV_RDMA_GID_INDEX") ? atoi(getenv("KV_RDMA_GID_INDEX")) : -1;
    }
    return c;
}

static void *region_alloc(void)
{
    void *p = NULL;
    if (posix_memalign(&p, 4096, REGION) != 0)
        return NULL;
    memset(p, 0, REGION);
    return p;
}

/* ---- the decode child --------------------------------------------------- */

static void must(bool ok, const char *what)
{
    if (ok)
        return;
    fprintf(stderr, "decode child: %s failed: %s\n", what, kv_last_error());
    _exit(20);
}

static void child_send(kv_xport_peer *p, uint64_t tag, const void *msg, uint32_t len)
{
    const struct kv_xport_notify n = {.tag = tag, .msg = msg, .len = len};
    kv_xport_xfer *t = NULL;
    must(kv_xport_write(p, NULL, 0, &n, &t) == KV_OK, "notify");
    kv_xport_state s;
    if (kv_xport_xfer_wait(t, 10000, &s) != KV_OK)
        s = KV_XPORT_PENDING;
    /* The peer may go away meanwhile (fault cases): not an error here. */
    if (s != KV_XPORT_PENDING)
        must(kv_xport_xfer_free(t) == KV_OK, "xfer_free");
}

static uint64_t check_a(const unsigned char *a, const struct span *sp, uint32_t n, bool loose)
{
    unsigned char *want = loose ? NULL : calloc(1, REGION);
    unsigned char *mask = loose ? calloc(1, REGION) : NULL;
    must(want || mask, "calloc");
    for (uint32_t i = 0; i < n; i++)
        for (uint64_t k = 0; k < sp[i].count; k++)
            for (uint64_t j = 0; j < sp[i].len; j++) {
                const uint64_t o = sp[i].roff + k * sp[i].rstride + j;
                must(o < REGION, "span inside A");
                const unsigned char b = pat(sp[i].seed, sp[i].loff + k * sp[i].lstride + j);
                if (want)
                    want[o] = b;
                else if (a[o] != b)
                    mask[o] = 1;
            }
    /* the first bad offset: 64 KiB blocks by memcmp / memchr, then the
     * bad block byte by byte (a byte loop over the whole region took
     * seconds under TSan) */
    enum { BLK = 1u << 16 };
    _Static_assert(REGION % BLK == 0, "whole blocks");
    uint64_t bad = UINT64_MAX;
    for (uint64_t o = 0; o < REGION && bad == UINT64_MAX; o += BLK) {
        if (want ? memcmp(a + o, want + o, BLK) == 0 : memchr(mask + o, 1, BLK) == NULL)
            continue;
        for (uint64_t j = o; j < o + BLK && bad == UINT64_MAX; j++)
            if (want ? a[j] != want[j] : mask[j])
                bad = j;
    }
    free(want);
    free(mask);
    return bad;
}

static int decode_main(int wfd)
{
    if (!real_dev) {
        kv__verbs_set(kvt_softverbs());
        kvt_sv_set_max_mr_size(MR_MAX);
    }
    struct kv_xport_config c = cfg_make(true, TOKEN, FP, 3000);
    kv_xport *x = NULL;
    must(kv_xport_create(&c, &x) == KV_OK, "create");
    const uint16_t pt = kv_xport_port(x);
    must(write(wfd, &pt, sizeof(pt)) == sizeof(pt), "port to the parent");
    close(wfd);
    unsigned char *a = region_alloc(), *b = region_alloc();
    must(a && b, "regions");
    pat_fill(b, REGION, SEED_B);
    kv_xport_mem *ma = NULL, *mb = NULL;
    must(kv_xport_mem_reg_on(x, a, REGION, KV_MEM_HOST, 0, &ma) == KV_OK, "reg A");
    must(kv_xport_mem_reg_on(x, b, REGION, KV_MEM_HOST, 0, &mb) == KV_OK, "reg B");
    struct kv_xport_msg *m = malloc(sizeof(*m));
    must(m != NULL, "msg");
    for (;;) {
        kv_xport_peer *p = NULL;
        if (kv_xport_accept(x, ANSWER_MS, &p) != KV_OK)
            break; /* the parent is done (or dead) */
        unsigned char blob[KV_XPORT_BLOB_MAX];
        size_t len = 0;
        must(kv_xport_mem_expose(p, ma, blob, sizeof(blob), &len) == KV_OK, "expose A");
        child_send(p, TAG_BLOB_A, blob, (uint32_t)len);
        must(kv_xport_mem_expose(p, mb, blob, sizeof(blob), &len) == KV_OK, "expose B");
        child_send(p, TAG_BLOB_B, blob, (uint32_t)len);
        for (;;) {
            if (kv_xport_notify_poll(x, 50, m) != KV_OK) {
                kv_xport_peer_state s;
                must(kv_xport_peer_state_get(p, &s, NULL) == KV_OK, "state");
                if (s == KV_XPORT_CLOSED)
                    break;
                continue;
            }
            if (m->peer_id != kv_xport_peer_id(p))
                continue; /* an earlier peer's */
            uint64_t bad = UINT64_MAX;
            if (m->tag == TAG_CHECK || m->tag == TAG_LOOSE) {
                struct span sp[KV_XPORT_NOTIFY_MAX / sizeof(struct span)];
                const uint32_t n = m->len / (uint32_t)sizeof(struct span);
                memcpy(sp, m->data, n * sizeof(*sp)); /* data[] is not 8-byte aligned */
                bad = check_a(a, sp, n, m->tag == TAG_LOOSE);
            }
            if (m->tag == TAG_UNEXPOSE_B) {
                must(kv_xport_mem_unexpose(p, mb) == KV_OK, "unexpose B");
                child_send(p, TAG_RESULT, &bad, sizeof(bad));
            }
            if (m->tag == TAG_CHECK || m->tag == TAG_LOOSE || m->tag == TAG_ZERO) {
                memset(a, 0, REGION);
                child_send(p, TAG_RESULT, &bad, sizeof(bad));
            }
        }
        kv_xport_peer_close(p);
    }
    free(m);
    must(kv_xport_mem_dereg(ma) == KV_OK && kv_xport_mem_dereg(mb) == KV_OK, "dereg");
    must(kv_xport_destroy(x) == KV_OK, "destroy");
    free(a);
    free(b);
    return 0;
}

/* ---- the prefill parent ------------------------------------------------ */

struct sess {
    kv_xport *x;
    kv_xport_peer *p;
    kv_xport_rmem *ra, *rb;
    kv_xport_mem *ml;
    unsigned char *l; /* [REGION] */
};

static struct kv_xport_msg msg;

static kv_xport_peer_state wait_state(kv_xport_peer *p, kv_xport_peer_state want, uint32_t ms,
                                      kv_status *why)
{
    kv_xport_peer_state s = KV_XPORT_CONNECTING;
    for (uint32_t i = 0; i < ms; i++) {
        assert_int_equal(kv_xport_peer_state_get(p, &s, why), KV_OK);
        if (s == want || s == KV_XPORT_CLOSED)
            break;
        usleep(1000);
    }
    return s;
}

static void sess_connect(struct sess *s)
{
    assert_int_equal(kv_xport_connect(s->x, "127.0.0.1", port, &s->p), KV_OK);
    kv_status why = KV_OK;
    const kv_xport_peer_state ps = wait_state(s->p, KV_XPORT_READY, 5000, &why);
    if (ps != KV_XPORT_READY)
        fail_msg("connect: state %d why %s: %s", (int)ps, kv_status_name(why), kv_last_error());
    for (int i = 0; i < 2; i++) {
        assert_int_equal(kv_xport_notify_poll(s->x, ANSWER_MS, &msg), KV_OK);
        assert_int_equal(msg.peer_id, kv_xport_peer_id(s->p));
        assert_true(msg.tag == TAG_BLOB_A || msg.tag == TAG_BLOB_B);
        kv_xport_rmem **r = msg.tag == TAG_BLOB_A ? &s->ra : &s->rb;
        assert_int_equal(kv_xport_rmem_import(s->p, msg.data, msg.len, r), KV_OK);
        assert_int_equal(kv_xport_rmem_bytes(*r), REGION);
        /* chunks, chunk bytes, base, then one rkey per 8 MiB MR */
        if (!real_dev)
            assert_int_equal((*r)->key_len, 24 + 4 * 3);
    }
}

static void sess_drop(struct sess *s)
{
    assert_int_equal(kv_xport_rmem_free(s->ra), KV_OK);
    assert_int_equal(kv_xport_rmem_free(s->rb), KV_OK);
    s->ra = s->rb = NULL;
    kv_xport_peer_close(s->p);
    s->p = NULL;
}

static struct sess S;

static void sess_open(uint32_t timeout_ms)
{
    memset(&S, 0, sizeof(S));
    struct kv_xport_config c = cfg_make(false, TOKEN, FP, timeout_ms);
    assert_int_equal(kv_xport_create(&c, &S.x), KV_OK);
    S.l = region_alloc();
    assert_non_null(S.l);
    assert_int_equal(kv_xport_mem_reg_on(S.x, S.l, REGION, KV_MEM_HOST, 0, &S.ml), KV_OK);
    sess_connect(&S);
}

static void sess_close(void)
{
    if (S.p)
        sess_drop(&S);
    assert_int_equal(kv_xport_mem_dereg(S.ml), KV_OK);
    assert_int_equal(kv_xport_destroy(S.x), KV_OK);
    free(S.l);
    memset(&S, 0, sizeof(S));
}

static kv_xport_state run(kv_xport_xfer *t, uint32_t ms)
{
    kv_xport_state st = KV_XPORT_PENDING;
    assert_int_equal(kv_xport_xfer_wait(t, ms, &st), KV_OK);
    return st;
}

/* A notification the child ignores, DONE: the child acknowledged it, so
 * every acknowledgement we owed it went out on QP 0 before it. A fault
 * armed on the next write then meets no later SEND on that QP whose
 * completion would retire the write's records in its place. */
static void sess_quiesce(void)
{
    const struct kv_xport_notify nt = {.tag = TAG_QUIET};
    kv_xport_xfer *t = NULL;
    assert_int_equal(kv_xport_write(S.p, NULL, 0, &nt, &t), KV_OK);
    assert_int_equal(run(t, 5000), KV_XPORT_DONE);
    assert_int_equal(kv_xport_xfer_free(t), KV_OK);
}

/* Notify `tag` with spans (after the data of everything before), wait for
 * the child's RESULT: the first bad offset. */
static uint64_t ask(uint64_t tag, const struct span *sp, uint32_t n)
{
    const struct kv_xport_notify nt = {.tag = tag, .msg = sp, .len = n * (uint32_t)sizeof(*sp)};
    kv_xport_xfer *t = NULL;
    assert_int_equal(kv_xport_write(S.p, NULL, 0, &nt, &t), KV_OK);
    assert_int_equal(run(t, 10000), KV_XPORT_DONE);
    assert_int_equal(kv_xport_xfer_free(t), KV_OK);
    assert_int_equal(kv_xport_notify_poll(S.x, ANSWER_MS, &msg), KV_OK);
    assert_int_equal(msg.tag, TAG_RESULT);
    uint64_t bad;
    memcpy(&bad, msg.data, sizeof(bad));
    return bad;
}

static struct kv_xport_io io(uint64_t loff, uint64_t roff, uint64_t len)
{
    return (struct kv_xport_io){
        .local = S.ml, .local_off = loff, .remote = S.ra, .remote_off = roff, .bytes = len};
}

static void test_xport_rdma_unsupported_without_device(void **state)
{
    (void)state;
    if (real_dev)
        skip();
    kv__verbs_set(NULL);
    struct kv_xport_config c = cfg_make(false, TOKEN, FP, 1000);
    kv_xport *x = NULL;
    assert_int_equal(kv_xport_create(&c, &x), KV_ERR_UNSUPPORTED);
    assert_null(x);
    assert_non_null(strstr(kv_last_error(), "no RDMA device"));
    kv__verbs_set(kvt_softverbs());
    kvt_sv_set_max_mr_size(MR_MAX);
}

/* Device memory is refused for RDMA (no flush READ before a notification
 * is delivered): KV_ERR_UNSUPPORTED naming the kind and the reason, *out
 * untouched, the transport still registering pinned memory. */
static void test_xport_rdma_device_memory_refused(void **state)
{
    (void)state;
    struct kv_xport_config c = cfg_make(false, TOKEN, FP, 1000);
    kv_xport *x = NULL;
    assert_int_equal(kv_xport_create(&c, &x), KV_OK);
    unsigned char *buf = region_alloc();
    assert_non_null(buf);
    kv_xport_mem *m = NULL;
    assert_int_equal(kv_xport_mem_reg(x, buf, REGION, KV_MEM_DEVICE, &m), KV_ERR_UNSUPPORTED);
    assert_null(m);
    assert_non_null(strstr(kv_last_error(), "device memory"));
    assert_non_null(strstr(kv_last_error(), "without a flush READ"));
    /* host and pinned memory still register */
    assert_int_equal(kv_xport_mem_reg(x, buf, REGION, KV_MEM_PINNED, &m), KV_OK);
    assert_int_equal(kv_xport_mem_bytes(m), REGION);
    assert_int_equal(kv_xport_mem_dereg(m), KV_OK);
    assert_int_equal(kv_xport_destroy(x), KV_OK);
    free(buf);
}

static void test_xport_rdma_writes_notify_whole_region(void **state)
{
    (void)state;
    sess_open(3000);
    pat_fill(S.l, REGION, 5);
    struct kv_xport_io ios[64];
    struct span sp[64];
    uint32_t n = 0;
    const uint64_t M = 1u << 20;
    const uint64_t far[][3] = {
        {1000, 8 * M - 100, 300},            /* across the remote 8 MiB MR boundary */
        {8 * M - 50, 13 * M + 12345, M + 7}, /* across the local one */
        {2 * M + 3, REGION - 4096, 4096},    /* up to the last byte */
        {9 * M + 1, 15 * M + 7, 4 * M},      /* several WRs, across 16 MiB remotely */
    };
    for (uint32_t i = 0; i < 4; i++) {
        ios[n] = io(far[i][0], far[i][1], far[i][2]);
        sp[n++] = (struct span){far[i][1], far[i][2], far[i][0], 5, 1, 0, 0};
    }
    /* 40 remote-contiguous runs from scattered local ones: SGE lists of
     * at most max_sge per WR. */
    for (uint32_t k = 0; k < 40; k++)
        ios[n + k] = io(3 * M + k * 3000, 5 * M + 1 + k * 1000, 1000);
    sp[n] = (struct span){5 * M + 1, 1000, 3 * M, 5, 40, 1000, 3000};
    kv_xport_xfer *t = NULL;
    const struct kv_xport_notify nt = {.tag = TAG_CHECK, .msg = sp, .len = (n + 1) * sizeof(*sp)};
    assert_int_equal(kv_xport_write(S.p, ios, n + 40, &nt, &t), KV_OK);
    assert_int_equal(run(t, 10000), KV_XPORT_DONE);
    const kv_status *st;
    uint32_t m;
    assert_int_equal(kv_xport_xfer_results(t, &st, &m), KV_OK);
    assert_int_equal(m, n + 40);
    for (uint32_t i = 0; i < m; i++)
        assert_int_equal(st[i], KV_OK);
    assert_int_equal(kv_xport_xfer_free(t), KV_OK);
    /* The child compared the whole region when the notification came. */
    assert_int_equal(kv_xport_notify_poll(S.x, ANSWER_MS, &msg), KV_OK);
    assert_int_equal(msg.tag, TAG_RESULT);
    uint64_t bad;
    memcpy(&bad, msg.data, sizeof(bad));
    assert_int_equal(bad, UINT64_MAX);

    /* 3000 small writes, each its own WR: more than a send queue holds. */
    struct kv_xport_io *many = malloc(3000 * sizeof(*many));
    assert_non_null(many);
    for (uint32_t k = 0; k < 3000; k++)
        many[k] = io(11 * M + k * 64, M + k * 128, 64);
    const struct span s2 = {M, 64, 11 * M, 5, 3000, 128, 64};
    const struct kv_xport_notify n2 = {.tag = TAG_CHECK, .msg = &s2, .len = sizeof(s2)};
    assert_int_equal(kv_xport_write(S.p, many, 3000, &n2, &t), KV_OK);
    free(many);
    assert_int_equal(run(t, 10000), KV_XPORT_DONE);
    assert_int_equal(kv_xport_xfer_free(t), KV_OK);
    assert_int_equal(kv_xport_notify_poll(S.x, ANSWER_MS, &msg), KV_OK);
    memcpy(&bad, msg.data, sizeof(bad));
    assert_int_equal(bad, UINT64_MAX);
    sess_close();
}

static void test_xport_rdma_reads_whole_region(void **state)
{
    (void)state;
    sess_open(3000);
    const uint64_t M = 1u << 20;
    const uint64_t rd[][3] = {
        /* local, remote, bytes */
        {100, 8 * M - 1000, 5000},     /* across the remote MR boundary */
        {8 * M - 10, 3 * M + 7, M},    /* across the local one */
        {12 * M, REGION - 777, 777},   /* the peer's last byte */
        {REGION - 4096, 17 * M, 4096}, /* into our last byte */
    };
    struct kv_xport_io ios[4];
    for (int i = 0; i < 4; i++)
        ios[i] = (struct kv_xport_io){.local = S.ml,
                                      .local_off = rd[i][0],
                                      .remote = S.rb,
                                      .remote_off = rd[i][1],
                                      .bytes = rd[i][2]};
    kv_xport_xfer *t = NULL;
    assert_int_equal(kv_xport_read(S.p, ios, 4, &t), KV_OK);
    assert_int_equal(run(t, 10000), KV_XPORT_DONE);
    assert_int_equal(kv_xport_xfer_free(t), KV_OK);
    unsigned char *want = calloc(1, REGION);
    assert_non_null(want);
    for (int i = 0; i < 4; i++)
        for (uint64_t j = 0; j < rd[i][2]; j++)
            want[rd[i][0] + j] = pat(SEED_B, rd[i][1] + j);
    assert_memory_equal(S.l, want, REGION);
    free(want);
    sess_close();
}

/* K only (an MLA latent cache: one plane, H = 1, D = 576) over RDMA: a
 * write_plan from a K-only NHD layer-major prefill layout of 16-token
 * pages into a K-only HND block-major padded decode layout of 64-token
 * pages laid in region A at an odd offset across its 8 MiB MR boundary
 * (its starting bytes random, written first), block ids spread over both
 * pools. Region A read back whole: the pool equals kv_plan_copy onto the
 * same starting bytes and the config-only reference, the rest of A is
 * still zero, the source is unchanged. */
static void test_xport_rdma_k_only_write_plan(void **state)
{
    (void)state;
    enum { KL = 3, KD = 576, NS = 14, ND = 4 };
    struct kvt_side s, d;
    kvt_side_make(&s, KL, 48, 16, 1, KD, KV_BF16, 32, 41);
    kvt_side_make(&d, KL, 22, 64, 1, KD, KV_BF16, 32 | 1 | 2 | 4, 42);
    const uint64_t M = 1u << 20, T = 16 * NS - 5; /* the last page partly filled */
    const uint64_t roff = 5 * M + 4096 + 64, dst_at = 6 * M, back_at = 0;
    const uint64_t dtot = (uint64_t)d.lo.total_bytes, stot = (uint64_t)s.lo.total_bytes;
    assert_true(roff < 8 * M && roff + dtot > 8 * M && roff + dtot < REGION);
    assert_true(stot <= dst_at && dst_at + dtot <= REGION);
    uint32_t sid[NS], did[ND];
    uint64_t rng = 43;
    kvt_pick_ids(&rng, s.lo.num_blocks, NS, sid);
    kvt_pick_ids(&rng, d.lo.num_blocks, ND, did);
    kv_plan *plan = NULL;
    assert_int_equal(kv_plan_create(&s.lo, &d.lo, NULL, &plan), KV_OK);
    unsigned char *want = malloc((size_t)dtot), *ref = malloc((size_t)dtot);
    assert_true(want && ref);
    memcpy(want, d.mem, (size_t)dtot);
    memcpy(ref, d.mem, (size_t)dtot);
    struct kv_paged_cache wc = d.pc;
    wc.base = want;
    /* one thread: libgomp's barriers are invisible to ThreadSanitizer */
    assert_int_equal(kv_set_threads(1), KV_OK);
    assert_int_equal(kv_plan_copy(plan, s.pc, sid, NS, wc, did, ND, T), KV_OK);
    assert_int_equal(kv_set_threads(0), KV_OK); /* the default again */
    /* config-only: whole pages up to T's page (the plan moves whole blocks) */
    kvt_ref_move(&s, sid, NS, &d, did, ND, 0, 0, 1, ref);
    assert_int_equal(kvt_first_diff(want, ref, (int64_t)dtot), -1);

    sess_open(3000);
    assert_int_equal(ask(TAG_ZERO, NULL, 0), UINT64_MAX);
    /* the decode pool's starting bytes into A, the source at S.l + 0 */
    memcpy(S.l + dst_at, d.mem, (size_t)dtot);
    memcpy(S.l, s.mem, (size_t)stot);
    kv_xport_xfer *t = NULL;
    struct kv_xport_io w = io(dst_at, roff, dtot);
    assert_int_equal(kv_xport_write(S.p, &w, 1, NULL, &t), KV_OK);
    assert_int_equal(run(t, 10000), KV_XPORT_DONE);
    assert_int_equal(kv_xport_xfer_free(t), KV_OK);
    assert_int_equal(
        kv_xport_write_plan(S.p, plan, S.ml, 0, sid, NS, S.ra, roff, did, ND, T, NULL, &t), KV_OK);
    assert_int_equal(run(t, 10000), KV_XPORT_DONE);
    assert_int_equal(kv_xport_xfer_free(t), KV_OK);
    assert_int_equal(kvt_first_diff(S.l, s.mem, (int64_t)stot), -1); /* source unchanged */
    /* region A whole, back into S.l */
    memset(S.l, 0xA5, REGION);
    struct kv_xport_io rd = {
        .local = S.ml, .local_off = back_at, .remote = S.ra, .remote_off = 0, .bytes = REGION};
    assert_int_equal(kv_xport_read(S.p, &rd, 1, &t), KV_OK);
    assert_int_equal(run(t, 10000), KV_XPORT_DONE);
    assert_int_equal(kv_xport_xfer_free(t), KV_OK);
    const int64_t at = kvt_first_diff(S.l + roff, want, (int64_t)dtot);
    if (at >= 0)
        fail_msg("K-only decode pool byte %lld of %llu differs from kv_plan_copy", (long long)at,
                 (unsigned long long)dtot);
    for (uint64_t o = 0; o < REGION; o++)
        if ((o < roff || o >= roff + dtot) && S.l[o] != 0)
            fail_msg("region A byte %llu outside the pool was written", (unsigned long long)o);
    assert_int_equal(ask(TAG_ZERO, NULL, 0), UINT64_MAX);
    sess_close();
    kv_plan_destroy(plan);
    free(want);
    free(ref);
    kvt_side_free(&s);
    kvt_side_free(&d);
}

/* Unexpose revokes: each exposure has its own MRs, deregistered by
 * unexpose, so the rkeys the peer imported stop working at the NIC. */
static void test_xport_rdma_unexpose_revokes(void **state)
{
    (void)state;
    sess_open(3000);
    struct kv_xport_io rd = {
        .local = S.ml, .local_off = 0, .remote = S.rb, .remote_off = 9u << 20, .bytes = 4096};
    kv_xport_xfer *t = NULL;
    assert_int_equal(kv_xport_read(S.p, &rd, 1, &t), KV_OK);
    assert_int_equal(run(t, 10000), KV_XPORT_DONE);
    assert_int_equal(kv_xport_xfer_free(t), KV_OK);
    for (uint64_t j = 0; j < 4096; j++)
        assert_int_equal(S.l[j], pat(SEED_B, (9u << 20) + j));
    assert_int_equal(ask(TAG_UNEXPOSE_B, NULL, 0), UINT64_MAX);
    /* The same read with the same (imported) rkeys: refused by the NIC. */
    memset(S.l, 0, 4096);
    assert_int_equal(kv_xport_read(S.p, &rd, 1, &t), KV_OK);
    assert_int_equal(run(t, 10000), KV_XPORT_FAILED);
    const kv_status *st;
    uint32_t n;
    assert_int_equal(kv_xport_xfer_results(t, &st, &n), KV_OK);
    assert_int_equal(st[0], KV_ERR_OUT_OF_BOUNDS);
    for (uint64_t j = 0; j < 4096; j++)
        assert_int_equal(S.l[j], 0);
    /* Nothing is torn down under the caller: destroy refuses while the
     * transfer is held, naming it. */
    assert_int_equal(kv_xport_destroy(S.x), KV_ERR_BAD_STATE);
    assert_non_null(strstr(kv_last_error(), "transfer(s) not freed"));
    assert_int_equal(kv_xport_xfer_free(t), KV_OK);
    sess_close();
}

static void test_xport_rdma_delayed_completion_done(void **state)
{
    (void)state;
    if (real_dev)
        skip();
    sess_open(3000);
    pat_fill(S.l, REGION, 9);
    sess_quiesce();
    kvt_sv_fault_writes(KVT_SV_DELAY_COMPLETION, 0, 300);
    struct kv_xport_io e = io(4096, 10u << 20, 64u << 10);
    const struct span sp = {10u << 20, 64u << 10, 4096, 9, 1, 0, 0};
    const struct kv_xport_notify nt = {.tag = TAG_CHECK, .msg = &sp, .len = sizeof(sp)};
    kv_xport_xfer *t = NULL;
    assert_int_equal(kv_xport_write(S.p, &e, 1, &nt, &t), KV_OK);
    assert_int_equal(run(t, 10000), KV_XPORT_DONE);
    assert_int_equal(kv_xport_xfer_free(t), KV_OK);
    assert_int_equal(kv_xport_notify_poll(S.x, ANSWER_MS, &msg), KV_OK);
    uint64_t bad;
    memcpy(&bad, msg.data, sizeof(bad));
    assert_int_equal(bad, UINT64_MAX);
    kvt_sv_fault(KVT_SV_FAULT_NONE, 0, 0);
    sess_close();
}

/* One faulty write on a fresh session: its terminal state, entry 0's
 * status, the peer's state and why afterwards. */
static void faulty(enum kvt_sv_fault f, bool forged, uint32_t timeout_ms, kv_xport_state want,
                   kv_status want_st, kv_status want_why, const char *words)
{
    if (real_dev)
        skip();
    sess_open(timeout_ms);
    kv_xport_rmem *r = S.ra;
    kv_xport_rmem *forge = NULL;
    uint64_t roff = 2u << 20;
    if (forged) { /* an rmem claiming 1 MiB more than exposed: past the check at post */
        forge = malloc(sizeof(*forge));
        assert_non_null(forge);
        *forge = *S.ra;
        forge->bytes += 1u << 20;
        roff = REGION - 4096; /* starts inside, ends past the last MR */
        r = forge;
    }
    sess_quiesce();
    kvt_sv_fault_writes(f, 0, 0);
    const struct kv_xport_io e = {
        .local = S.ml, .local_off = 0, .remote = r, .remote_off = roff, .bytes = 1u << 20};
    const uint64_t t0 = kv__now_ns();
    kv_xport_xfer *t = NULL;
    assert_int_equal(kv_xport_write(S.p, &e, 1, NULL, &t), KV_OK);
    assert_int_equal(run(t, 10000), want);
    const kv_status *st;
    uint32_t n;
    assert_int_equal(kv_xport_xfer_results(t, &st, &n), KV_OK);
    assert_int_equal(n, 1);
    if (want_st != KV_OK)
        assert_int_equal(st[0], want_st);
    assert_int_not_equal(st[0], KV_OK);
    if (want == KV_XPORT_TIMED_OUT)
        assert_true(kv__now_ns() - t0 >= (uint64_t)timeout_ms * 1000000ull);
    assert_int_equal(kv_xport_xfer_free(t), KV_OK);
    kv_status why = KV_OK;
    assert_int_equal(wait_state(S.p, KV_XPORT_CLOSED, 30000, &why), KV_XPORT_CLOSED);
    assert_int_equal(why, want_why);
    assert_non_null(strstr(kv_last_error(), words));
    kvt_sv_fault(KVT_SV_FAULT_NONE, 0, 0);
    free(forge);
    sess_close();
}

static void test_xport_rdma_retry_exceeded(void **state)
{
    (void)state;
    faulty(KVT_SV_RETRY_EXCEEDED, false, 3000, KV_XPORT_FAILED, KV_ERR_IO, KV_ERR_IO,
           "retry counter exceeded");
}

static void test_xport_rdma_remote_access_out_of_bounds(void **state)
{
    (void)state;
    faulty(KVT_SV_FAULT_NONE, true, 3000, KV_XPORT_FAILED, KV_ERR_OUT_OF_BOUNDS,
           KV_ERR_OUT_OF_BOUNDS, "remote access error");
}

static void test_xport_rdma_lost_completion_times_out(void **state)
{
    (void)state;
    faulty(KVT_SV_LOST_COMPLETION, false, 1000, KV_XPORT_TIMED_OUT, KV_OK, KV_ERR_TIMEOUT,
           "not done within 1000 ms");
}

static void test_xport_rdma_cancel_in_flight(void **state)
{
    (void)state;
    sess_open(5000);
    pat_fill(S.l, REGION, 11);
    enum { N = 16 };
    struct kv_xport_io ios[N];
    struct span sp[N];
    for (uint32_t k = 0; k < N; k++)
        ios[k] = io((uint64_t)k << 20, (uint64_t)k << 20, 1u << 20);
    kv_xport_xfer *t = NULL;
    struct kvt_sv_stats c0, c1;
    kvt_sv_stats_get(&c0);
    assert_int_equal(kv_xport_write(S.p, ios, N, NULL, &t), KV_OK);
    /* In flight: some WRs on the wire (soft device), or 1 ms (real one). */
    for (int i = 0; i < 2000; i++) {
        kvt_sv_stats_get(&c1);
        if (c1.requests_sent >= c0.requests_sent + 3 || (real_dev && i >= 10))
            break;
        usleep(100);
    }
    assert_int_equal(kv_xport_xfer_cancel(t), KV_OK);
    const kv_xport_state s = run(t, 10000);
    assert_true(s == KV_XPORT_CANCELLED || s == KV_XPORT_DONE);
    const kv_status *st;
    uint32_t n, ok = 0;
    assert_int_equal(kv_xport_xfer_results(t, &st, &n), KV_OK);
    for (uint32_t k = 0; k < n; k++)
        if (st[k] == KV_OK)
            sp[ok++] = (struct span){(uint64_t)k << 20, 1u << 20, (uint64_t)k << 20, 11, 1, 0, 0};
        else
            assert_int_equal(st[k], KV_ERR_CANCELLED);
    printf("    cancel in flight: %s, %u of %u entries done\n",
           s == KV_XPORT_CANCELLED ? "CANCELLED" : "DONE (finished first)", ok, n);
    assert_int_equal(kv_xport_xfer_free(t), KV_OK);
    /* Every entry reported done did land; the peer is still usable. */
    kv_status why;
    assert_int_equal(wait_state(S.p, KV_XPORT_READY, 1, &why), KV_XPORT_READY);
    if (ok)
        assert_int_equal(ask(TAG_LOOSE, sp, ok), UINT64_MAX);
    else
        assert_int_equal(ask(TAG_ZERO, NULL, 0), UINT64_MAX);
    struct kv_xport_io e = io(0, 7, 4096);
    const struct span s1 = {7, 4096, 0, 11, 1, 0, 0};
    assert_int_equal(kv_xport_write(S.p, &e, 1, NULL, &t), KV_OK);
    assert_int_equal(run(t, 10000), KV_XPORT_DONE);
    assert_int_equal(kv_xport_xfer_free(t), KV_OK);
    assert_int_equal(ask(TAG_CHECK, &s1, 1), UINT64_MAX);
    sess_close();
}

static void refused_on(const char *dev, uint64_t token, uint64_t fp, const char *words)
{
    struct kv_xport_config c = cfg_make(false, token, fp, 3000);
    if (dev)
        c.rdma_device = dev;
    kv_xport *x = NULL;
    assert_int_equal(kv_xport_create(&c, &x), KV_OK);
    kv_xport_peer *p = NULL;
    assert_int_equal(kv_xport_connect(x, "127.0.0.1", port, &p), KV_OK);
    kv_status why = KV_OK;
    assert_int_equal(wait_state(p, KV_XPORT_READY, 5000, &why), KV_XPORT_CLOSED);
    if (why != KV_ERR_MISMATCH)
        fail_msg("closed with %s: %s", kv_status_name(why), kv_last_error());
    kvt_assert_msg_has(words);
    kv_xport_xfer *t = NULL;
    const struct kv_xport_notify nt = {.tag = 1};
    assert_int_equal(kv_xport_write(p, NULL, 0, &nt, &t), KV_ERR_BAD_STATE);
    kv_xport_peer_close(p);
    assert_int_equal(kv_xport_destroy(x), KV_OK);
}

static void refused(uint64_t token, uint64_t fp, const char *words)
{
    refused_on(NULL, token, fp, words);
}

/* A port of the other link layer: the QP info names both. */
static void test_xport_rdma_other_link_layer_refused(void **state)
{
    (void)state;
    if (real_dev)
        skip();
    if (pass_ib)
        refused_on("kvt_roce0", TOKEN, FP,
                   "the peer's port is infiniband (link layer 1), this one ethernet");
    else
        refused_on("kvt_ib0", TOKEN, FP,
                   "the peer's port is ethernet (link layer 2), this one infiniband");
}

static void test_xport_rdma_wrong_token_refused(void **state)
{
    (void)state;
    refused(TOKEN + 1, FP, "token mismatch");
}

static void test_xport_rdma_wrong_fingerprint_refused(void **state)
{
    (void)state;
    refused(TOKEN, FP + 1, "fingerprint mismatch");
}

static void test_xport_rdma_bandwidth(void **state)
{
    (void)state;
    sess_open(20000);
    const uint32_t reps = real_dev ? 256 : 8; /* 5 GiB on a real device, 160 MiB soft */
    struct kv_xport_io e = io(0, 0, REGION);
    const uint64_t t0 = kv__now_ns();
    kv_xport_xfer *ts[8];
    uint32_t done = 0;
    for (uint32_t k = 0; k < reps; k += 8) {
        for (uint32_t j = 0; j < 8; j++)
            assert_int_equal(kv_xport_write(S.p, &e, 1, NULL, &ts[j]), KV_OK);
        for (uint32_t j = 0; j < 8; j++) {
            assert_int_equal(run(ts[j], 20000), KV_XPORT_DONE);
            assert_int_equal(kv_xport_xfer_free(ts[j]), KV_OK);
            done++;
        }
    }
    const double s = (double)(kv__now_ns() - t0) / 1e9;
    printf("    rdma write bandwidth (%s): %u x %u MiB in %.3f s = %.2f GB/s\n",
           real_dev ? "real device" : "soft device", done, REGION >> 20, s,
           (double)done * REGION / s / 1e9);
    /* 1 MiB messages, as perftest's ib_write_bw -s 1048576 posts them
     * (scripts/rdma-check.sh compares the two): transfers of one 1 MiB
     * entry per MiB of the region, 8 transfers in flight. */
    enum { MSGS = REGION >> 20 };
    struct kv_xport_io m1[MSGS];
    for (uint32_t k = 0; k < MSGS; k++)
        m1[k] = io((uint64_t)k << 20, (uint64_t)k << 20, 1u << 20);
    const uint64_t t1 = kv__now_ns();
    uint64_t msgs = 0;
    for (uint32_t k = 0; k < reps; k += 8) {
        for (uint32_t j = 0; j < 8; j++)
            assert_int_equal(kv_xport_write(S.p, m1, MSGS, NULL, &ts[j]), KV_OK);
        for (uint32_t j = 0; j < 8; j++) {
            assert_int_equal(run(ts[j], 20000), KV_XPORT_DONE);
            assert_int_equal(kv_xport_xfer_free(ts[j]), KV_OK);
            msgs += MSGS;
        }
    }
    const double s1 = (double)(kv__now_ns() - t1) / 1e9;
    printf("    rdma write bandwidth 1MiB messages (%s): %" PRIu64 " x 1 MiB in %.3f s = %.2f GB/s\n",
           real_dev ? "real device" : "soft device", msgs, s1, (double)msgs * (1u << 20) / s1 / 1e9);
    sess_close();
}

static void test_xport_rdma_peer_killed_mid_transfer(void **state)
{
    (void)state;
    sess_open(5000);
    enum { N = 64 };
    struct kv_xport_io ios[N];
    for (uint32_t k = 0; k < N; k++)
        ios[k] = io((uint64_t)(k % 20) << 20, (uint64_t)(k % 20) << 20, 1u << 20);
    kv_xport_xfer *t = NULL;
    assert_int_equal(kv_xport_write(S.p, ios, N, NULL, &t), KV_OK);
    usleep(2000);
    assert_int_equal(kill(child, SIGKILL), 0);
    int ws = 0;
    assert_int_equal(waitpid(child, &ws, 0), child);
    child = -1;
    const kv_xport_state s = run(t, 10000);
    const kv_status *st;
    uint32_t n, ok = 0;
    assert_int_equal(kv_xport_xfer_results(t, &st, &n), KV_OK);
    for (uint32_t k = 0; k < n; k++)
        ok += st[k] == KV_OK;
    printf("    peer killed: %s, %u of %u entries done\n",
           s == KV_XPORT_FAILED ? "FAILED"
           : s == KV_XPORT_DONE ? "DONE (finished first)"
                                : "?",
           ok, n);
    if (s != KV_XPORT_DONE) {
        assert_int_equal(s, KV_XPORT_FAILED);
        assert_true(ok < n);
    }
    assert_int_equal(kv_xport_xfer_free(t), KV_OK);
    kv_status why = KV_OK;
    assert_int_equal(wait_state(S.p, KV_XPORT_CLOSED, 30000, &why), KV_XPORT_CLOSED);
    assert_int_not_equal(why, KV_OK);
    sess_close();
}

/* CPU seconds of the process behind clock c. */
static double cpu_s(clockid_t c)
{
    struct timespec ts;
    assert_int_equal(clock_gettime(c, &ts), 0);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void test_xport_rdma_idle_pair_cpu(void **state)
{
    (void)state;
    sess_open(20000);
    clockid_t cc;
    assert_int_equal(clock_getcpuclockid(child, &cc), 0);
    sess_quiesce(); /* every acknowledgement owed went out, and was answered */
    usleep(100000); /* the handshake's last notifications settle */
    const double p0 = cpu_s(CLOCK_PROCESS_CPUTIME_ID), c0 = cpu_s(cc);
    usleep(1500000);
    const double p = cpu_s(CLOCK_PROCESS_CPUTIME_ID) - p0, c = cpu_s(cc) - c0;
    printf("    idle connected pair, %s: %.4f s CPU (this process), %.4f s (the peer) over 1.5 s\n",
           busy_poll ? "busy polling" : "event mode", p, c);
    if (!busy_poll) { /* a behaviour check with a wide margin: polling costs ~0.1 s here */
        assert_true(p < 0.05);
        assert_true(c < 0.05);
    }
    /* Still works after sleeping: a write and its notification. */
    struct kv_xport_io e = io(4096, 8192, 65536);
    pat_fill(S.l + 4096, 65536, 5);
    kv_xport_xfer *t = NULL;
    assert_int_equal(kv_xport_write(S.p, &e, 1, NULL, &t), KV_OK);
    assert_int_equal(run(t, 10000), KV_XPORT_DONE);
    assert_int_equal(kv_xport_xfer_free(t), KV_OK);
    const struct span sp = {.roff = 8192, .len = 65536, .loff = 0, .seed = 5, .count = 1};
    assert_int_equal(ask(TAG_CHECK, &sp, 1), UINT64_MAX);
    sess_close();
}

/* What each side chose, as kv_xport_info reports it (the line
 * scripts/rdma-check.sh shows), checked against the soft fabric. */
static void test_xport_rdma_parameters_reported(void **state)
{
    (void)state;
    sess_open(3000);
    struct kv_xport_info xi = KV_XPORT_INFO_INIT, pi = KV_XPORT_INFO_INIT;
    assert_int_equal(kv_xport_info_get(S.x, &xi), KV_OK);
    assert_int_equal(kv_xport_peer_info_get(S.p, &pi), KV_OK);
    char line[2048]; /* every rail's (KV_RDMA_DEVICES) */
    assert_true(kv_xport_info_format(&pi, line, sizeof(line)) < (int)sizeof(line));
    printf("    rdma parameters: %s\n", line);
    /* the transport's part is the same in both */
    assert_int_equal(xi.kind, KV_XPORT_RDMA);
    assert_string_equal(xi.rdma_device, pi.rdma_device);
    assert_int_equal(xi.rdma_port, pi.rdma_port);
    assert_int_equal(xi.rdma_link, pi.rdma_link);
    assert_int_equal(xi.rdma_lid, pi.rdma_lid);
    assert_int_equal(xi.rdma_gid_index, pi.rdma_gid_index);
    assert_int_equal(xi.rdma_gid_type, pi.rdma_gid_type);
    assert_memory_equal(xi.rdma_gid, pi.rdma_gid, 16);
    assert_int_equal(xi.rdma_active_mtu, pi.rdma_active_mtu);
    assert_int_equal(xi.rdma_qps, 0); /* no peer part */
    assert_int_equal(xi.rdma_path_mtu, 0);
    assert_int_equal(pi.rdma_qps, 2 * pi.rdma_peer_rails);
    assert_true(pi.rdma_peer_rails >= 1 && pi.rdma_peer_rails <= pi.rdma_rails);
    assert_true(pi.rdma_path_mtu >= 256 && pi.rdma_path_mtu <= pi.rdma_active_mtu);
    if (real_dev) {
        sess_close();
        return;
    }
    static const uint8_t v4[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    if (!pass_ib) { /* RoCE: the RoCE v2 IPv4-mapped GID (index 3, not 0), a GRH */
        assert_string_equal(pi.rdma_device, "kvt_roce0");
        assert_int_equal(pi.rdma_port, 1);
        assert_int_equal(pi.rdma_link, KV_XPORT_LINK_ETHERNET);
        assert_int_equal(pi.rdma_lid, 0);
        assert_int_equal(pi.rdma_gid_index, 3);
        assert_int_equal(pi.rdma_gid_type, KV_XPORT_GID_ROCE_V2);
        assert_memory_equal(pi.rdma_gid, v4, 12);
        assert_int_equal(pi.rdma_gid[12], 10);
        assert_int_equal(pi.rdma_active_mtu, 1024);
        assert_int_equal(pi.rdma_path_mtu, 1024);
        assert_true(pi.rdma_grh);
        assert_int_equal(pi.rdma_hop_limit, 255);
        assert_int_equal(pi.rdma_remote_lid, 0);
        assert_memory_equal(pi.rdma_remote_gid, v4, 12);
        assert_memory_not_equal(pi.rdma_remote_gid, pi.rdma_gid, 16);
        assert_non_null(strstr(line, "gid[3] ::ffff:10."));
    } else { /* InfiniBand across two devices: LID-routed, no GRH, MTU min(4096, 2048) */
        assert_string_equal(pi.rdma_device, "kvt_ib0");
        assert_int_equal(pi.rdma_port, 2); /* port 1 is down */
        assert_int_equal(pi.rdma_link, KV_XPORT_LINK_INFINIBAND);
        assert_in_range(pi.rdma_lid, 1, 0xbfff);
        assert_int_equal(pi.rdma_gid_index, 0);
        assert_int_equal(pi.rdma_gid_type, KV_XPORT_GID_IB);
        assert_int_equal(pi.rdma_gid[0], 0xfe);
        assert_int_equal((uint32_t)pi.rdma_gid[14] << 8 | pi.rdma_gid[15], pi.rdma_lid);
        assert_int_equal(pi.rdma_active_mtu, 4096);
        assert_int_equal(pi.rdma_path_mtu, 2048);
        assert_false(pi.rdma_grh);
        assert_int_equal(pi.rdma_hop_limit, 0);
        assert_in_range(pi.rdma_remote_lid, 1, 0xbfff);
        assert_int_not_equal(pi.rdma_remote_lid, pi.rdma_lid);
        assert_int_equal((uint32_t)pi.rdma_remote_gid[14] << 8 | pi.rdma_remote_gid[15],
                         pi.rdma_remote_lid);
        assert_non_null(strstr(line, "no-grh"));
    }
    sess_close();
}

/* One create that must fail with st, the message naming `words`. */
static void create_refused(const char *dev, uint32_t pt, int32_t gid, kv_status st,
                           const char *words)
{
    struct kv_xport_config c = cfg_make(false, TOKEN, FP, 1000);
    c.rdma_device = dev;
    c.rdma_port = pt;
    c.rdma_gid_index = gid;
    kv_xport *x = NULL;
    assert_int_equal(kv_xport_create(&c, &x), st);
    assert_null(x);
    kvt_assert_msg_has(words);
}

static void test_xport_rdma_device_choice(void **state)
{
    (void)state;
    if (real_dev)
        skip();
    create_refused("kvt_nope", 0, -1, KV_ERR_NOT_FOUND, "kvt_ib0, kvt_ib1, kvt_roce0");
    create_refused("kvt_ib0", 1, -1, KV_ERR_UNSUPPORTED,
                   "rdma_port 1 not usable (kvt_ib0 port 1 DOWN)");
    create_refused("kvt_ib0", 3, -1, KV_ERR_INVALID_ARG, "rdma_port 3, but kvt_ib0 has 2");
    create_refused("kvt_ib1", 0, 1, KV_ERR_INVALID_ARG, "GID index 1 of kvt_ib1 port 1: empty");
    create_refused("kvt_ib1", 0, 2, KV_ERR_INVALID_ARG, "rdma_gid_index 2, but kvt_ib1 port 1");
    create_refused("kvt_roce0", 0, 5, KV_ERR_INVALID_ARG, "GID index 5 of kvt_roce0 port 1");
    create_refused("kvt_roce0", 0, -2, KV_ERR_INVALID_ARG, "rdma_gid_index -2");
    create_refused(NULL, 256, -1, KV_ERR_INVALID_ARG, "rdma_port 256 (ports are 1..255)");
    create_refused(
        NULL, 3, -1, KV_ERR_UNSUPPORTED,
        "rdma_port 3 not usable (kvt_ib0: 2 ports, kvt_ib1: 1 ports, kvt_roce0: 1 ports)");
    /* port 2 given, the device automatic: kvt_ib0, the one with a port 2 */
    struct kv_xport_config c2 = cfg_make(false, TOKEN, FP, 1000);
    c2.rdma_device = NULL;
    c2.rdma_port = 2;
    kv_xport *x2 = NULL;
    assert_int_equal(kv_xport_create(&c2, &x2), KV_OK);
    struct kv_xport_info i2 = KV_XPORT_INFO_INIT;
    assert_int_equal(kv_xport_info_get(x2, &i2), KV_OK);
    assert_string_equal(i2.rdma_device, "kvt_ib0");
    assert_int_equal(i2.rdma_port, 2);
    assert_int_equal(kv_xport_destroy(x2), KV_OK);
    /* A GID index given: taken as it is (the link-local RoCE v2 one). */
    struct kv_xport_config c = cfg_make(false, TOKEN, FP, 1000);
    c.rdma_device = "kvt_roce0";
    c.rdma_gid_index = 1;
    kv_xport *x = NULL;
    assert_int_equal(kv_xport_create(&c, &x), KV_OK);
    struct kv_xport_info in = KV_XPORT_INFO_INIT;
    assert_int_equal(kv_xport_info_get(x, &in), KV_OK);
    assert_int_equal(in.rdma_gid_index, 1);
    assert_int_equal(in.rdma_gid_type, KV_XPORT_GID_ROCE_V2);
    assert_int_equal(in.rdma_gid[0], 0xfe);
    in.struct_size--;
    assert_int_equal(kv_xport_info_get(x, &in), KV_ERR_INVALID_ARG);
    assert_int_equal(kv_xport_info_get(x, NULL), KV_ERR_NULL);
    assert_int_equal(kv_xport_peer_info_get(NULL, &in), KV_ERR_NULL);
    assert_int_equal(kv_xport_destroy(x), KV_OK);
    /* TCP reports its kind and nothing else */
    c.kind = KV_XPORT_TCP;
    assert_int_equal(kv_xport_create(&c, &x), KV_OK);
    struct kv_xport_info t = KV_XPORT_INFO_INIT;
    assert_int_equal(kv_xport_info_get(x, &t), KV_OK);
    assert_int_equal(t.kind, KV_XPORT_TCP);
    assert_string_equal(t.rdma_device, "");
    assert_int_equal(t.rdma_port, 0);
    assert_int_equal(t.rdma_link, KV_XPORT_LINK_NONE);
    assert_int_equal(t.rdma_gid_index, -1);
    assert_int_equal(t.rdma_active_mtu, 0);
    assert_int_equal(t.rdma_qps, 0);
    char line[64];
    assert_int_equal(kv_xport_info_format(&t, line, sizeof(line)), 3);
    assert_string_equal(line, "tcp");
    assert_int_equal(kv_xport_destroy(x), KV_OK);
}

/* The peer's INFO decoder: a round trip field by field, then each
 * malformation refused with the values named, then random bytes: whatever
 * it accepts encodes back to the same bytes. */
static struct rd_info info_ok(void)
{
    struct rd_info in = {.nq = 2, .nrail = 1, .conn = 0x0123456789abcdefull};
    in.rail[0] = (struct rd_rail_info){
        .has_gid = true, .lid = 0x1234, .link = IBV_LINK_LAYER_INFINIBAND, .mtu = IBV_MTU_2048};
    in.rail[0].gid[0] = 0xfe;
    in.rail[0].gid[1] = 0x80;
    in.rail[0].gid[15] = 0x77;
    in.qpn[0] = 0x10;
    in.qpn[1] = 0xfffffe;
    in.psn[0] = 0xabcdef;
    in.psn[1] = 5;
    return in;
}

/* The decoder with one rail of ours, on link layer `link`. */
static kv_status decode1(const unsigned char *b, uint32_t len, uint32_t nq, uint8_t link,
                         struct rd_info *out, char *why, size_t cap)
{
    return kv__rd_info_decode(b, len, nq, &link, 1, out, why, cap);
}

static void info_bad(unsigned char *b, uint32_t len, uint8_t link, kv_status st, const char *words)
{
    struct rd_info out;
    char emsg[200] = "";
    assert_int_equal(decode1(b, len, 2, link, &out, emsg, sizeof(emsg)), st);
    if (!strstr(emsg, words))
        fail_msg("'%s' lacks '%s'", emsg, words);
}

static void test_xport_rdma_info_decode(void **state)
{
    (void)state;
    unsigned char b[INFO_MAX + 8], m[sizeof(b)];
    const struct rd_info in = info_ok();
    const uint32_t len = kv__rd_info_encode(&in, b);
    assert_int_equal(len, INFO_HEAD + 16);
    struct rd_info out;
    char emsg[200];
    assert_int_equal(decode1(b, len, 2, IBV_LINK_LAYER_INFINIBAND, &out, emsg, sizeof(emsg)),
                     KV_OK);
    assert_int_equal(out.nq, in.nq);
    assert_int_equal(out.nrail, 1);
    assert_int_equal(out.conn, in.conn);
    assert_int_equal(out.rail[0].has_gid, in.rail[0].has_gid);
    assert_memory_equal(out.rail[0].gid, in.rail[0].gid, 16);
    assert_int_equal(out.rail[0].lid, in.rail[0].lid);
    assert_int_equal(out.rail[0].link, in.rail[0].link);
    assert_int_equal(out.rail[0].mtu, in.rail[0].mtu);
    for (uint32_t i = 0; i < 2; i++) {
        assert_int_equal(out.qpn[i], in.qpn[i]);
        assert_int_equal(out.psn[i], in.psn[i]);
    }
    const uint8_t IB = IBV_LINK_LAYER_INFINIBAND, ETH = IBV_LINK_LAYER_ETHERNET;
#define MUT(stmt, ln, link, st, words)                                                             \
    do {                                                                                           \
        memcpy(m, b, sizeof(b));                                                                   \
        stmt;                                                                                      \
        info_bad(m, ln, link, st, words);                                                          \
    } while (0)
    MUT((void)0, INFO_HEAD - 1, IB, KV_ERR_CORRUPT, "QP info of 39 bytes");
    MUT((void)0, len + 1, IB, KV_ERR_CORRUPT, "57 bytes for 2 QPs (must be 56)");
    MUT(m[2] = 1, len, IB, KV_ERR_MISMATCH, "version 1 (here rdma 2, version 3)");
    MUT(kv__le_put(m, KV_XPORT_RDMA, 4), len, IB, KV_ERR_MISMATCH, "kind 2 version 0");
    MUT(m[0] = 1, len, IB, KV_ERR_MISMATCH, "kind 1 version 3");
    MUT(m[4] = 3, len, IB, KV_ERR_MISMATCH, "for 3 QPs (here 2)");
    MUT((void)0, len, ETH, KV_ERR_MISMATCH, "port is infiniband (link layer 1), this one ethernet");
    MUT(m[36] = 3, len, IB, KV_ERR_CORRUPT, "flags 0x03");
    MUT(m[38] = 1, len, IB, KV_ERR_CORRUPT, "reserved 01 00");
    MUT(m[37] = 1, len, IB, KV_ERR_CORRUPT, "56 bytes for 2 rails of 2 QPs (must be 96)");
    MUT(m[37] = 8, len, IB, KV_ERR_CORRUPT, "9 rails of 2 QPs (at most 8 rails, 16 QPs)");
    MUT(m[34] = 7, len, 7, KV_ERR_CORRUPT, "link layer 7 (infiniband 1 or ethernet 2)");
    MUT(m[35] = 0, len, IB, KV_ERR_CORRUPT, "active MTU code 0");
    MUT(m[35] = 6, len, IB, KV_ERR_CORRUPT, "active MTU code 6");
    MUT(kv__le_put(m + 32, 0, 2), len, IB, KV_ERR_CORRUPT, "LID 0x0000 on infiniband");
    MUT(kv__le_put(m + 32, 0xc000, 2), len, IB, KV_ERR_CORRUPT, "LID 0xc000 on infiniband");
    MUT(m[34] = ETH, len, ETH, KV_ERR_CORRUPT, "LID 0x1234 on ethernet");
    MUT((m[34] = ETH, kv__le_put(m + 32, 0, 2), m[36] = 0, memset(m + 16, 0, 16)), len, ETH,
        KV_ERR_CORRUPT, "GID zero, flagged absent, on ethernet (ethernet needs one)");
    MUT(memset(m + 16, 0, 16), len, IB, KV_ERR_CORRUPT, "GID zero, flagged valid");
    MUT(m[36] = 0, len, IB, KV_ERR_CORRUPT, "GID nonzero, flagged absent");
    MUT(kv__le_put(m + INFO_HEAD, 1, 4), len, IB, KV_ERR_CORRUPT, "QP 0: qpn 0x1,");
    MUT(kv__le_put(m + INFO_HEAD + 8, 0x1000000, 4), len, IB, KV_ERR_CORRUPT,
        "QP 1: qpn 0x1000000");
    MUT(kv__le_put(m + INFO_HEAD + 12, 0x1000000, 4), len, IB, KV_ERR_CORRUPT, "psn 0x1000000");
#undef MUT
    /* InfiniBand without a GID is valid (no GRH then) */
    struct rd_info ng = in;
    ng.rail[0].has_gid = false;
    memset(ng.rail[0].gid, 0, 16);
    assert_int_equal(kv__rd_info_encode(&ng, m), len);
    assert_int_equal(decode1(m, len, 2, IB, &out, emsg, sizeof(emsg)), KV_OK);
    assert_false(out.rail[0].has_gid);
    /* Rails: three of the peer's against two of ours (InfiniBand, then
     * RoCE): each rail's fields and QPs rail-major; a link layer that
     * differs on a rail both have is named with the rail; the peer's third
     * rail (none of ours) is still checked. */
    struct rd_info r3 = in;
    r3.nrail = 3;
    r3.rail[1] = (struct rd_rail_info){.has_gid = true, .lid = 0, .link = ETH, .mtu = IBV_MTU_1024};
    r3.rail[1].gid[10] = r3.rail[1].gid[11] = 0xff;
    r3.rail[1].gid[12] = 10;
    r3.rail[2] = (struct rd_rail_info){.has_gid = false, .lid = 9, .link = IB, .mtu = IBV_MTU_4096};
    for (uint32_t i = 0; i < 6; i++) {
        r3.qpn[i] = 0x100 + i;
        r3.psn[i] = 0x200 + i;
    }
    const uint32_t l3 = kv__rd_info_encode(&r3, m);
    assert_int_equal(l3, INFO_HEAD + 2 * INFO_RAIL + 8 * 6);
    assert_int_equal(kv__rd_info_len(2, 3), l3);
    assert_int_equal(m[37], 2);
    const uint8_t ours[2] = {IB, ETH}, wrong[2] = {IB, IB};
    assert_int_equal(kv__rd_info_decode(m, l3, 2, ours, 2, &out, emsg, sizeof(emsg)), KV_OK);
    assert_int_equal(out.nrail, 3);
    for (uint32_t r = 0; r < 3; r++) {
        assert_int_equal(out.rail[r].link, r3.rail[r].link);
        assert_int_equal(out.rail[r].lid, r3.rail[r].lid);
        assert_int_equal(out.rail[r].mtu, r3.rail[r].mtu);
        assert_int_equal(out.rail[r].has_gid, r3.rail[r].has_gid);
        assert_memory_equal(out.rail[r].gid, r3.rail[r].gid, 16);
    }
    for (uint32_t i = 0; i < 6; i++) {
        assert_int_equal(out.qpn[i], r3.qpn[i]);
        assert_int_equal(out.psn[i], r3.psn[i]);
    }
    assert_int_equal(kv__rd_info_decode(m, l3, 2, wrong, 2, &out, emsg, sizeof(emsg)),
                     KV_ERR_MISMATCH);
    assert_non_null(
        strstr(emsg, "rail 1: the peer's port is ethernet (link layer 2), this one infiniband"));
    m[INFO_HEAD + INFO_RAIL + 18] = 7; /* the peer's rail 2: an unknown link layer */
    assert_int_equal(kv__rd_info_decode(m, l3, 2, ours, 2, &out, emsg, sizeof(emsg)),
                     KV_ERR_CORRUPT);
    assert_non_null(strstr(emsg, "rail 2: link layer 7"));
    m[INFO_HEAD + INFO_RAIL + 18] = IB;
    m[INFO_HEAD + 21] = 1; /* rail 1's rail-count byte */
    assert_int_equal(kv__rd_info_decode(m, l3, 2, ours, 2, &out, emsg, sizeof(emsg)),
                     KV_ERR_CORRUPT);
    assert_non_null(strstr(emsg, "rail 1: QP info flags 0x01, reserved 01 00 00"));
    /* Random mutations of a valid one: accepted only when it re-encodes
     * to the very bytes (nothing ignored, nothing read past len). */
    uint64_t rs = 22;
    uint32_t accepted = 0;
    for (uint32_t k = 0; k < 20000; k++) {
        memcpy(m, b, sizeof(b));
        const uint32_t flips = 1 + (uint32_t)(kvt_rand(&rs) % 3);
        for (uint32_t f = 0; f < flips; f++)
            m[kvt_rand(&rs) % len] ^= (unsigned char)(1u << (kvt_rand(&rs) % 8));
        const uint32_t l = kvt_rand(&rs) % 8 == 0 ? (uint32_t)(kvt_rand(&rs) % sizeof(m)) : len;
        if (decode1(m, l, 2, IB, &out, emsg, sizeof(emsg)) != KV_OK)
            continue;
        unsigned char re[sizeof(b)];
        assert_int_equal(kv__rd_info_encode(&out, re), l);
        assert_memory_equal(re, m, l);
        accepted++;
    }
    printf("    info decoder: %u of 20000 mutated blobs accepted (each re-encoded exactly)\n",
           accepted);
}

/* ---- in one process: a transport pair, hostile peers ------------------- */

/* a connects (prefill), b listens (decode); both this process's. */
struct duo {
    kv_xport *a, *b;
    kv_xport_peer *pa, *pb;
};

/* a connects to b over conns QPs; max_notes: b's max_pending_notes (0:
 * the default). */
static void duo_open(struct duo *d, uint32_t conns, uint32_t max_notes)
{
    memset(d, 0, sizeof(*d));
    struct kv_xport_config cb = cfg_make(true, TOKEN, FP, 3000),
                           ca = cfg_make(false, TOKEN, FP, 3000);
    ca.conns_per_peer = cb.conns_per_peer = conns;
    cb.max_pending_notes = max_notes;
    assert_int_equal(kv_xport_create(&cb, &d->b), KV_OK);
    assert_int_equal(kv_xport_create(&ca, &d->a), KV_OK);
    assert_int_equal(kv_xport_connect(d->a, "127.0.0.1", kv_xport_port(d->b), &d->pa), KV_OK);
    assert_int_equal(kv_xport_accept(d->b, 5000, &d->pb), KV_OK);
    kv_xport_peer_state s;
    if (kv_xport_peer_wait(d->pa, 5000, &s) != KV_OK)
        fail_msg("connect: state %d: %s", (int)s, kv_last_error());
}

/* The peers closed, then regions md[n] of b (unexposed first) and ma[n]
 * of a deregistered (NULL ones skipped), then both transports destroyed. */
static void duo_close(struct duo *d, kv_xport_mem *const *ma, uint32_t na, kv_xport_mem *const *mb,
                      uint32_t nb)
{
    for (uint32_t i = 0; i < nb; i++)
        if (mb[i]) {
            const kv_status st = kv_xport_mem_unexpose(d->pb, mb[i]);
            assert_true(st == KV_OK || st == KV_ERR_NOT_FOUND); /* already unexposed */
        }
    kv_xport_peer_close(d->pa);
    kv_xport_peer_close(d->pb);
    for (uint32_t i = 0; i < na; i++)
        if (ma[i])
            assert_int_equal(kv_xport_mem_dereg(ma[i]), KV_OK);
    for (uint32_t i = 0; i < nb; i++)
        if (mb[i])
            assert_int_equal(kv_xport_mem_dereg(mb[i]), KV_OK);
    assert_int_equal(kv_xport_destroy(d->a), KV_OK);
    assert_int_equal(kv_xport_destroy(d->b), KV_OK);
}

/* b exposes md to a; a imports it. */
static kv_xport_rmem *duo_share(struct duo *d, kv_xport_mem *md)
{
    unsigned char blob[KV_XPORT_BLOB_MAX];
    size_t len = 0;
    assert_int_equal(kv_xport_mem_expose(d->pb, md, blob, sizeof(blob), &len), KV_OK);
    kv_xport_rmem *r = NULL;
    assert_int_equal(kv_xport_rmem_import(d->pa, blob, len, &r), KV_OK);
    return r;
}

/* Two buffers of n bytes over d, both zero: rb at b (registered: mr) and
 * lb at a (ml); with share, rb exposed to a (r). */
struct duo_bufs {
    unsigned char *rb, *lb;
    kv_xport_mem *mr, *ml;
    kv_xport_rmem *r;
};

static void duo_bufs_open(struct duo *d, struct duo_bufs *g, size_t n, bool share)
{
    g->rb = calloc(1, n);
    g->lb = calloc(1, n);
    assert_true(g->rb && g->lb);
    g->mr = g->ml = NULL;
    assert_int_equal(kv_xport_mem_reg(d->b, g->rb, n, KV_MEM_HOST, &g->mr), KV_OK);
    assert_int_equal(kv_xport_mem_reg(d->a, g->lb, n, KV_MEM_HOST, &g->ml), KV_OK);
    g->r = share ? duo_share(d, g->mr) : NULL;
}

/* r freed (when shared), the duo closed with both regions, the buffers
 * freed. */
static void duo_bufs_close(struct duo *d, struct duo_bufs *g)
{
    if (g->r)
        assert_int_equal(kv_xport_rmem_free(g->r), KV_OK);
    duo_close(d, &g->ml, 1, &g->mr, 1);
    free(g->rb);
    free(g->lb);
}

/* The SGE counts of the WRs posted, per opcode (a verbs table wrapping the
 * soft device's post_send). */
static struct kv__verbs counting;
static int max_sge_read, max_sge_write, n_read_wrs;

static int counting_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad)
{
    for (const struct ibv_send_wr *w = wr; w; w = w->next) {
        if (w->opcode == IBV_WR_RDMA_READ) {
            n_read_wrs++;
            max_sge_read = w->num_sge > max_sge_read ? w->num_sge : max_sge_read;
        } else if (w->opcode == IBV_WR_RDMA_WRITE) {
            max_sge_write = w->num_sge > max_sge_write ? w->num_sge : max_sge_write;
        }
    }
    return kvt_softverbs()->post_send(qp, wr, bad);
}

/* The device's max_sge_rd (3 here) is smaller than max_sge (16): reads of
 * 64 remote-contiguous pieces scattered over the local region are cut
 * into READ WRs of at most 3 SGEs (a device refuses more: the old cut
 * failed the peer) and land exactly, the whole local region compared;
 * the same layout written back still gathers 16 per WRITE. */
static void test_xport_rdma_reads_within_max_sge_rd(void **state)
{
    (void)state;
    if (real_dev)
        skip();
    assert_int_equal(kvt_sv_set_max_sge_rd(3), 0);
    counting = *kvt_softverbs();
    counting.post_send = counting_post_send;
    kv__verbs_set(&counting);
    max_sge_read = max_sge_write = n_read_wrs = 0;
    struct duo d;
    duo_open(&d, 2, 0);
    const size_t n = 1u << 20;
    struct duo_bufs g;
    duo_bufs_open(&d, &g, n, true);
    unsigned char *want = calloc(1, n);
    assert_non_null(want);
    pat_fill(g.rb, n, 5);
    enum { N = 64 };
    struct kv_xport_io io[N];
    uint64_t roff = 5000;
    for (uint32_t i = 0; i < N; i++) {
        const uint64_t len = 64 + 13 * (i % 5);
        io[i] = (struct kv_xport_io){.local = g.ml,
                                     .local_off = 4096 + 512 * (uint64_t)i,
                                     .remote = g.r,
                                     .remote_off = roff,
                                     .bytes = len};
        memcpy(want + io[i].local_off, g.rb + roff, len);
        roff += len;
    }
    kv_xport_xfer *t = NULL;
    assert_int_equal(kv_xport_read(d.pa, io, N, &t), KV_OK);
    assert_int_equal(run(t, 10000), KV_XPORT_DONE);
    assert_int_equal(kv_xport_xfer_free(t), KV_OK);
    assert_memory_equal(g.lb, want, n);
    assert_true(max_sge_read >= 2 && max_sge_read <= 3);
    assert_true(n_read_wrs >= N / 3);
    assert_int_equal(kv_xport_write(d.pa, io, N, NULL, &t), KV_OK);
    assert_int_equal(run(t, 10000), KV_XPORT_DONE);
    assert_int_equal(kv_xport_xfer_free(t), KV_OK);
    assert_int_equal(max_sge_write, 16);
    duo_bufs_close(&d, &g);
    kv__verbs_set(kvt_softverbs());
    assert_int_equal(kvt_sv_set_max_sge_rd(0), 0);
    free(want);
}

/* A verbs table whose dereg_mr of an MR at slow_addr stalls 200 ms (a
 * real ibv_dereg_mr of a large region takes that long), flagging that it
 * started. */
static struct kv__verbs slow_dereg;
static _Atomic(const void *) slow_addr;
static atomic_int slow_entered;

static int slow_dereg_mr(struct ibv_mr *mr)
{
    if (mr && mr->addr == atomic_load(&slow_addr)) {
        atomic_store(&slow_entered, 1);
        usleep(200 * 1000);
    }
    return kvt_softverbs()->dereg_mr(mr);
}

/* A duo over the slowed table with one 64 KiB region of b exposed to a
 * (g), the stall armed on it. */
static void slow_open(struct duo *d, struct duo_bufs *g)
{
    if (real_dev) /* the stall needs the soft device */
        skip();
    slow_dereg = *kvt_softverbs();
    slow_dereg.dereg_mr = slow_dereg_mr;
    kv__verbs_set(&slow_dereg);
    duo_open(d, 1, 0);
    duo_bufs_open(d, g, (size_t)1 << 16, true);
    atomic_store(&slow_entered, 0);
    atomic_store(&slow_addr, (const void *)g->rb);
}

/* Until the stalled dereg_mr of `what` has started (30 s at most: the
 * bound of a wait, not a requirement on the speed). */
static void slow_wait(const char *what)
{
    const uint64_t t0 = kv__now_ns();
    while (!atomic_load(&slow_entered)) {
        if (kv__now_ns() - t0 > 30000000000ull)
            fail_msg("no dereg_mr of %s within 30 s", what);
        usleep(1000);
    }
}

/* The region deregistered at once (the stall disarmed): KV_OK, right after
 * `after` returned. */
static void slow_dereg_now(kv_xport_mem *m, const char *after)
{
    atomic_store(&slow_addr, NULL);
    const kv_status st = kv_xport_mem_dereg(m);
    if (st != KV_OK)
        fail_msg("dereg right after %s: %s: %s", after, kv_status_name(st), kv_last_error());
}

/* a closes its peer; b's backend ends pb, and its exposure's MR is
 * deregistered, slowly: returns once that dereg has started. */
static void slow_remote_close(struct duo *d)
{
    kv_xport_peer_close(d->pa);
    slow_wait("b's exposure after a closed its peer");
}

/* Both peers closed and b's region deregistered: the rest, and the soft
 * device's own table back. */
static void slow_close(struct duo *d, struct duo_bufs *g)
{
    assert_int_equal(kv_xport_rmem_free(g->r), KV_OK);
    assert_int_equal(kv_xport_mem_dereg(g->ml), KV_OK);
    assert_int_equal(kv_xport_destroy(d->a), KV_OK);
    assert_int_equal(kv_xport_destroy(d->b), KV_OK);
    free(g->rb);
    free(g->lb);
    kv__verbs_set(kvt_softverbs());
}

/* kv_xport_peer_close returns once the peer's exposures have ended, so
 * the region is free to deregister (kv_transport.h). The backend drops
 * the transport's lock around the exposure's ibv_dereg_mr; when the
 * remote side closed first, the user's close found the peer CLOSED and
 * returned while that dereg was still running, and kv_xport_mem_dereg
 * was refused: "region 1 still used by 1 transfer(s) or exposure(s)"
 * (seen 1 run in 20 of test_xport_rdma_rails under load). Made
 * deterministic by stalling that dereg. */
static void test_xport_rdma_peer_close_waits_for_unexpose(void **state)
{
    (void)state;
    struct duo d;
    struct duo_bufs g;
    slow_open(&d, &g);
    slow_remote_close(&d);
    kv_xport_peer_close(d.pb);
    slow_dereg_now(g.mr, "kv_xport_peer_close");
    slow_close(&d, &g);
}

/* The same with kv_xport_mem_unexpose in place of the close: the remote
 * side closed, b's backend is still deregistering the exposure's MR
 * (mu dropped), and the caller withdraws the region before it deregisters
 * it (duo_close's order). The exposure is out of pb's table already, so
 * unexpose found none and answered KV_ERR_NOT_FOUND at once, and the
 * kv_xport_mem_dereg right after was refused ("still used by 1 transfer(s)
 * or exposure(s)"). Now it answers only once that release ended. */
static void test_xport_rdma_unexpose_waits_for_close_unexpose(void **state)
{
    (void)state;
    struct duo d;
    struct duo_bufs g;
    slow_open(&d, &g);
    slow_remote_close(&d);
    const kv_status us = kv_xport_mem_unexpose(d.pb, g.mr);
    assert_true(us == KV_OK || us == KV_ERR_NOT_FOUND); /* ended by the close */
    slow_dereg_now(g.mr, "kv_xport_mem_unexpose");
    kv_xport_peer_close(d.pb);
    slow_close(&d, &g);
}

struct unexposer {
    kv_xport_peer *peer;
    kv_xport_mem *mem;
    kv_status st;
};

static void *unexpose_main(void *arg)
{
    struct unexposer *u = arg;
    u->st = kv_xport_mem_unexpose(u->peer, u->mem);
    return NULL;
}

/* kv_xport_peer_close while another thread's kv_xport_mem_unexpose of one
 * of the peer's regions is deregistering the exposure's MR (mu dropped):
 * the close returns once that region is free to deregister too (its
 * exposures end). The exposure was out of the table and not counted, so
 * the close returned at once and the dereg right after was refused ("still
 * used by 1 transfer(s) or exposure(s)"). */
static void test_xport_rdma_peer_close_waits_for_user_unexpose(void **state)
{
    (void)state;
    struct duo d;
    struct duo_bufs g;
    slow_open(&d, &g);
    /* static: a failing check below leaves the thread to finish on its own */
    static struct unexposer u;
    u = (struct unexposer){.peer = d.pb, .mem = g.mr, .st = KV_ERR_INTERNAL};
    pthread_t thr;
    assert_int_equal(pthread_create(&thr, NULL, unexpose_main, &u), 0);
    slow_wait("the unexpose's exposure");
    kv_xport_peer_close(d.pb);
    slow_dereg_now(g.mr, "kv_xport_peer_close");
    pthread_join(thr, NULL);
    assert_int_equal(u.st, KV_OK);
    kv_xport_peer_close(d.pa);
    slow_close(&d, &g);
}

/* Every region is registered with local write access (READs land in it):
 * read-only memory is refused at kv_xport_mem_reg (the kernel says EFAULT),
 * as is unmapped memory, with a message naming the region and the rule;
 * the same pages made writable register. */
static void test_xport_rdma_read_only_region_refused(void **state)
{
    (void)state;
    struct kv_xport_config c = cfg_make(false, TOKEN, FP, 3000);
    kv_xport *x = NULL;
    assert_int_equal(kv_xport_create(&c, &x), KV_OK);
    const size_t n = 1u << 16;
    void *ro = mmap(NULL, n, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    assert_true(ro != MAP_FAILED);
    kv_xport_mem *m = NULL;
    assert_int_equal(kv_xport_mem_reg(x, ro, n, KV_MEM_HOST, &m), KV_ERR_INVALID_ARG);
    assert_null(m);
    char addr[32];
    snprintf(addr, sizeof(addr), "%p", ro);
    assert_non_null(strstr(kv_last_error(), addr));
    assert_non_null(strstr(kv_last_error(), "65536 bytes; chunk 0, 65536 bytes at +0"));
    assert_non_null(strstr(kv_last_error(), "must be mapped, readable and writable"));
    assert_int_equal(mprotect(ro, n, PROT_READ | PROT_WRITE), 0);
    assert_int_equal(kv_xport_mem_reg(x, ro, n, KV_MEM_HOST, &m), KV_OK);
    assert_int_equal(kv_xport_mem_dereg(m), KV_OK);
    assert_int_equal(munmap(ro, n), 0);
    /* unmapped: another thread may map the freed range again before the
     * call (seen under TSan, 2026-12-06); a success over a range that is
     * mapped now is retried with a fresh range, one over a range that is
     * still unmapped fails */
    for (int tries = 0;; tries++) {
        m = NULL;
        snprintf(addr, sizeof(addr), "%p", ro);
        kv_status st = kv_xport_mem_reg(x, ro, n, KV_MEM_HOST, &m);
        if (st == KV_ERR_INVALID_ARG) {
            assert_null(m);
            assert_non_null(strstr(kv_last_error(), addr));
            break;
        }
        assert_int_equal(st, KV_OK);
        assert_true(kvt_range_mapped(ro, n));
        assert_true(tries < 8);
        assert_int_equal(kv_xport_mem_dereg(m), KV_OK);
        ro = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        assert_true(ro != MAP_FAILED);
        assert_int_equal(munmap(ro, n), 0);
    }
    assert_int_equal(kv_xport_destroy(x), KV_OK);
}

/* kv_xport_mem_unexpose: "when it returns, nothing of that peer touches
 * mem any more". A 128 MiB write (one QP, WRs of 256 KiB) whose 2nd WR is
 * half landed is in flight when the target region is unexposed and
 * deregistered; the memory is then made inaccessible at once (as a
 * caller unmapping it would): the soft device fences a responder
 * mid-payload at dereg_mr, as a NIC does, so nothing touches it (a device
 * that went on writing would fault there: its WR ends RETRY_EXC_ERR,
 * KV_ERR_IO), and the write ends FAILED with KV_ERR_OUT_OF_BOUNDS (the
 * responder's NAK), not DONE. Whether a WR is mid-payload at that instant
 * is up to the scheduler: 8 rounds, each on a fresh pair (the failed write
 * closes the peer); test_softverbs_dereg_mr_fences pins that case. A
 * loaded machine may also stall this thread between seeing the 2nd WR
 * land and the unexpose long enough for the whole write to land: the
 * soft device's count of landed bytes, read as soon as kv_xport_mem_dereg
 * returned (no byte moves after it), then holds all of it; nothing was in
 * flight, the round is not counted (returns false) and another is run. A
 * device that wrote after the dereg is caught either way: its bytes land
 * after that count (the write DONE, the count short) or fault. */
static bool unexpose_mid_write_round(void)
{
    struct duo d;
    duo_open(&d, 1, 0);
    const size_t n = 128u << 20;
    unsigned char *src = malloc(n);
    unsigned char *dst = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    assert_true(src && dst != MAP_FAILED);
    memset(src, 0x77, n);
    kv_xport_mem *ms = NULL, *md = NULL;
    assert_int_equal(kv_xport_mem_reg(d.a, src, n, KV_MEM_HOST, &ms), KV_OK);
    assert_int_equal(kv_xport_mem_reg(d.b, dst, n, KV_MEM_HOST, &md), KV_OK);
    kv_xport_rmem *r = duo_share(&d, md);
    struct kvt_sv_stats s0, s1;
    kvt_sv_stats_get(&s0);
    const struct kv_xport_io io1 = {.local = ms, .remote = r, .bytes = n};
    kv_xport_xfer *t = NULL;
    assert_int_equal(kv_xport_write(d.pa, &io1, 1, NULL, &t), KV_OK);
    /* The middle of the 2nd WR landed: that WR is mid-payload now (the
     * deadline only bounds the wait: 10 s) */
    const volatile unsigned char *mid = dst + RD_WR_MAX_BYTES + RD_WR_MAX_BYTES / 2;
    const uint64_t t0 = kv__now_ns();
    for (uint32_t i = 0; *mid == 0; i++)
        if ((i & 4095) == 0 && kv__now_ns() - t0 > 10000000000ull)
            break;
    assert_int_equal(*mid, 0x77);
    assert_int_equal(kv_xport_mem_unexpose(d.pb, md), KV_OK);
    assert_int_equal(kv_xport_mem_dereg(md), KV_OK);
    struct kvt_sv_stats sd;
    kvt_sv_stats_get(&sd);
    assert_int_equal(mprotect(dst, n, PROT_NONE), 0);
    const bool late = sd.bytes_landed - s0.bytes_landed >= n;
    const kv_xport_state ts = run(t, 10000);
    if (late) { /* all landed before the dereg: DONE, nothing to fence */
        assert_int_equal(ts, KV_XPORT_DONE);
    } else {
        assert_int_equal(ts, KV_XPORT_FAILED);
        kvt_sv_stats_get(&s1);
        assert_true(s1.bytes_landed - s0.bytes_landed < n); /* it was in flight */
        const kv_status *st;
        uint32_t ne;
        assert_int_equal(kv_xport_xfer_results(t, &st, &ne), KV_OK);
        assert_int_equal(ne, 1);
        if (st[0] != KV_ERR_OUT_OF_BOUNDS)
            fail_msg("the write ended %s, not KV_ERR_OUT_OF_BOUNDS: the device touched the "
                     "region after kv_xport_mem_unexpose returned",
                     kv_status_name(st[0]));
    }
    assert_int_equal(kv_xport_xfer_free(t), KV_OK);
    assert_int_equal(kv_xport_rmem_free(r), KV_OK);
    duo_close(&d, &ms, 1, NULL, 0);
    free(src);
    assert_int_equal(munmap(dst, n), 0);
    return !late;
}

static void test_xport_rdma_unexpose_mid_write(void **state)
{
    (void)state;
#if defined(__SANITIZE_THREAD__)
    /* It watches memory the soft NIC writes from its device thread, as a
     * program watches DMA it cannot synchronize with: the data reaches that
     * thread over a socket from another process, which TSan cannot see, so
     * every such write is a reported race by design. ASan/UBSan and the
     * plain build run it. */
    skip();
#endif
    if (real_dev)
        skip();
    int in_flight = 0, rounds = 0;
    for (; in_flight < 8 && rounds < 24; rounds++)
        in_flight += unexpose_mid_write_round();
    if (in_flight < 8)
        fail_msg("only %d of %d rounds had the write in flight at the unexpose", in_flight, rounds);
}

/* A hostile out-of-band peer (a TCP transport with the token) sends RDMA
 * READY messages: 4096 bytes of junk; one right byte before any QP info;
 * a wrong byte after our own QP info was echoed back to us (so our QPs
 * went RTS); the right one twice. Each closes the RDMA peer KV_ERR_CORRUPT
 * naming the length, the first byte and the phase; the right one once
 * after the info makes the peer READY. */
static struct kv_xport_msg hmsg;

/* The next notification of peer h on xh (earlier victims' are skipped). */
static void hostile_poll(kv_xport *xh, kv_xport_peer *h)
{
    do
        assert_int_equal(kv_xport_notify_poll(xh, 5000, &hmsg), KV_OK);
    while (hmsg.peer_id != kv_xport_peer_id(h));
}

static void hostile_send(kv_xport_peer *h, uint64_t tag, const void *m, uint32_t len)
{
    const struct kv_xport_notify nt = {.tag = tag, .msg = m, .len = len};
    kv_xport_xfer *t = NULL;
    assert_int_equal(kv_xport_write(h, NULL, 0, &nt, &t), KV_OK);
    kv_xport_state st;
    assert_int_equal(kv_xport_xfer_wait(t, 5000, &st), KV_OK);
    assert_int_equal(kv_xport_xfer_free(t), KV_OK);
}

static void hostile_ready(kv_xport *xh, int how, const char *words, const char *words2)
{
    struct kv_xport_config cv = cfg_make(false, TOKEN, FP, 2000);
    kv_xport *xv = NULL;
    assert_int_equal(kv_xport_create(&cv, &xv), KV_OK);
    kv_xport_peer *pv = NULL, *ph = NULL;
    assert_int_equal(kv_xport_connect(xv, "127.0.0.1", kv_xport_port(xh), &pv), KV_OK);
    assert_int_equal(kv_xport_accept(xh, 5000, &ph), KV_OK);
    static unsigned char junk[4096];
    memset(junk, 0xee, sizeof(junk));
    const unsigned char one = 1, two = 2;
    if (how >= 2) { /* echo the victim's own QP info: its QPs connect to themselves */
        hostile_poll(xh, ph);
        assert_true(hmsg.tag == RD_OOB_INFO);
        hostile_send(ph, RD_OOB_INFO, hmsg.data, hmsg.len);
        hostile_poll(xh, ph);
        assert_true(hmsg.tag == RD_OOB_READY); /* ours went RTS */
    }
    if (how == 0)
        hostile_send(ph, RD_OOB_READY, junk, sizeof(junk));
    else if (how == 1 || how == 3)
        hostile_send(ph, RD_OOB_READY, &one, 1);
    else
        hostile_send(ph, RD_OOB_READY, &two, 1);
    if (how == 3) {
        kv_xport_peer_state s;
        assert_int_equal(kv_xport_peer_wait(pv, 5000, &s), KV_OK);
        assert_int_equal(s, KV_XPORT_READY);
        hostile_send(ph, RD_OOB_READY, &one, 1);
    }
    kv_status why = KV_OK;
    assert_int_equal(wait_state(pv, KV_XPORT_CLOSED, 5000, &why), KV_XPORT_CLOSED);
    assert_int_equal(why, KV_ERR_CORRUPT);
    if (!strstr(kv_last_error(), words) || !strstr(kv_last_error(), words2))
        fail_msg("want \"%s\" and \"%s\" in: %s", words, words2, kv_last_error());
    kv_xport_peer_close(pv);
    kv_xport_peer_close(ph);
    assert_int_equal(kv_xport_destroy(xv), KV_OK);
}

static void test_xport_rdma_hostile_ready_refused(void **state)
{
    (void)state;
    struct kv_xport_config ch = KV_XPORT_CONFIG_INIT;
    ch.kind = KV_XPORT_TCP;
    ch.listen_host = "127.0.0.1";
    ch.token = TOKEN;
    ch.fingerprint = FP;
    ch.conns_per_peer = 1;
    ch.timeout_ms = 3000;
    kv_xport *xh = NULL;
    assert_int_equal(kv_xport_create(&ch, &xh), KV_OK);
    hostile_ready(xh, 0, "a READY of 4096 bytes (first byte 0xee", "in phase");
    hostile_ready(xh, 1, "a READY of 1 bytes (first byte 0x01", "want RTS");
    hostile_ready(xh, 2, "a READY of 1 bytes (first byte 0x02", "in phase RTS");
    hostile_ready(xh, 3, "in phase READY", "a READY came already");
    assert_int_equal(kv_xport_destroy(xh), KV_OK);
}

/* A remote key forged by the peer: every field checked against the others
 * and the region's bytes; refused KV_ERR_CORRUPT naming the values at
 * import (the post checks it again), the genuine key still works. */
static void forged(struct duo *d, kv_xport_mem *ml, const struct kv__xport_blob *good, uint32_t n,
                   uint32_t rail, uint32_t key_len, uint64_t chunk, uint64_t base,
                   const char *words)
{
    struct kv__xport_blob fb = *good;
    fb.key_len = key_len;
    kv__le_put(fb.key, n, 4);
    kv__le_put(fb.key + 4, rail, 4);
    kv__le_put(fb.key + 8, chunk, 8);
    kv__le_put(fb.key + 16, base, 8);
    for (uint32_t i = 24; i < key_len; i += 4)
        memcpy(fb.key + i, good->key + 24, 4); /* the real rkey of chunk 0 */
    unsigned char blob[KV_XPORT_BLOB_MAX];
    const size_t bl = kv__xport_blob_encode(&fb, blob);
    kv_xport_rmem *r = NULL;
    const kv_status st = kv_xport_rmem_import(d->pa, blob, bl, &r);
    if (st == KV_OK) {
        const struct kv_xport_io w = {.local = ml, .remote = r, .bytes = 64};
        kv_xport_xfer *t = NULL;
        const kv_status ps = kv_xport_write(d->pa, &w, 1, NULL, &t);
        if (ps == KV_OK) {
            (void)run(t, 5000);
            assert_int_equal(kv_xport_xfer_free(t), KV_OK);
        }
        assert_int_equal(kv_xport_rmem_free(r), KV_OK);
        fail_msg("a forged key (%s) was imported (the post: %s)", words, kv_status_name(ps));
    }
    assert_null(r);
    assert_int_equal(st, KV_ERR_CORRUPT);
    if (!strstr(kv_last_error(), words))
        fail_msg("want \"%s\" in: %s", words, kv_last_error());
}

static void test_xport_rdma_forged_key_refused(void **state)
{
    (void)state;
    if (real_dev)
        skip();
    struct duo d;
    duo_open(&d, 2, 0);
    const size_t n = 1u << 16;
    struct duo_bufs g;
    duo_bufs_open(&d, &g, n, false); /* the blob forged below, then the genuine one */
    unsigned char blob[KV_XPORT_BLOB_MAX];
    size_t len = 0;
    assert_int_equal(kv_xport_mem_expose(d.pb, g.mr, blob, sizeof(blob), &len), KV_OK);
    struct kv__xport_blob good;
    assert_int_equal(kv__xport_blob_decode(blob, len, &good), KV_OK);
    assert_int_equal(good.key_len, 28);
    const uint64_t chunk = kv__le_get(good.key + 8, 8), base = kv__le_get(good.key + 16, 8);
    forged(&d, g.ml, &good, 0, 0, 24, chunk, base, "0 chunk(s)");
    forged(&d, g.ml, &good, 2, 0, 32, chunk, base, "2 chunk(s)");
    forged(&d, g.ml, &good, 2, 0, 32, chunk, base, "region of 65536 bytes (needs 1)");
    forged(&d, g.ml, &good, 1, 0, 28, 0, base, "of 0 bytes");
    forged(&d, g.ml, &good, 1, 0, 32, chunk, base, "a key of 32 bytes: 1 chunk(s)");
    forged(&d, g.ml, &good, 1, 0, 28, chunk, UINT64_MAX - 100, "base 0xffffffffffffff9b");
    forged(&d, g.ml, &good, 1, KV_XPORT_MAX_RAILS, 28, chunk, base, "rail 8 (< 8)");
    /* the genuine key */
    assert_int_equal(kv_xport_rmem_import(d.pa, blob, len, &g.r), KV_OK);
    memset(g.lb, 0x3c, 64);
    const struct kv_xport_io w = {.local = g.ml, .remote = g.r, .remote_off = 100, .bytes = 64};
    kv_xport_xfer *t = NULL;
    assert_int_equal(kv_xport_write(d.pa, &w, 1, NULL, &t), KV_OK);
    assert_int_equal(run(t, 5000), KV_XPORT_DONE);
    assert_int_equal(kv_xport_xfer_free(t), KV_OK);
    assert_memory_equal(g.rb + 100, g.lb, 64);
    duo_bufs_close(&d, &g);
}

/* A peer's RDMA WRITE with immediate consumes one of our receives but
 * leaves the buffer as the last SEND into it left it. After 16
 * notifications of 29 bytes have gone round the one QP's 16 receives, a
 * 29-byte WRITE_WITH_IMM completes on the buffer that still holds the
 * first: it is not delivered again; the peer is closed KV_ERR_CORRUPT
 * naming the opcode. */
static struct kv__verbs imm_verbs;
static bool imm_next;

static int imm_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad)
{
    for (struct ibv_send_wr *w = wr; w; w = w->next)
        if (imm_next && w->opcode == IBV_WR_RDMA_WRITE) {
            w->opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
            w->imm_data = 0;
            imm_next = false;
        }
    return kvt_softverbs()->post_send(qp, wr, bad);
}

static void test_xport_rdma_write_with_imm_is_no_notification(void **state)
{
    (void)state;
    if (real_dev)
        skip();
    imm_verbs = *kvt_softverbs();
    imm_verbs.post_send = imm_post_send;
    kv__verbs_set(&imm_verbs);
    imm_next = false;
    struct duo d;
    duo_open(&d, 1, 0);
    const size_t n = 1u << 16;
    struct duo_bufs g;
    duo_bufs_open(&d, &g, n, true);
    pat_fill(g.lb, n, 9);
    struct kv_xport_msg got;
    for (uint32_t i = 0; i < RD_RECVS; i++) {
        const char text[5] = {'n', 'o', 't', 'e', (char)('a' + i)};
        const struct kv_xport_notify nt = {.tag = 100 + i, .msg = text, .len = sizeof(text)};
        kv_xport_xfer *t = NULL;
        assert_int_equal(kv_xport_write(d.pa, NULL, 0, &nt, &t), KV_OK);
        assert_int_equal(run(t, 5000), KV_XPORT_DONE);
        assert_int_equal(kv_xport_xfer_free(t), KV_OK);
        assert_int_equal(kv_xport_notify_poll(d.b, 5000, &got), KV_OK);
        assert_int_equal(got.tag, 100 + i);
        assert_int_equal(got.len, sizeof(text));
        assert_memory_equal(got.data, text, sizeof(text));
    }
    const struct kv_xport_io w = {.local = g.ml,
                                  .local_off = 64,
                                  .remote = g.r,
                                  .remote_off = 4096,
                                  .bytes = RD_NOTE_HDR + 5};
    imm_next = true;
    kv_xport_xfer *t = NULL;
    assert_int_equal(kv_xport_write(d.pa, &w, 1, NULL, &t), KV_OK);
    (void)run(t, 5000); /* DONE at the sender: the bytes landed */
    assert_false(imm_next);
    assert_int_equal(kv_xport_xfer_free(t), KV_OK);
    assert_memory_equal(g.rb + 4096, g.lb + 64, RD_NOTE_HDR + 5);
    kv_xport_peer_state ps = KV_XPORT_READY;
    kv_status why = KV_OK;
    for (int i = 0; i < 3000 && ps != KV_XPORT_CLOSED; i++) { /* 30 s at most */
        assert_int_equal(kv_xport_peer_state_get(d.pb, &ps, &why), KV_OK);
        if (ps != KV_XPORT_CLOSED)
            usleep(10 * 1000);
    }
    assert_int_equal(ps, KV_XPORT_CLOSED);
    assert_int_equal(why, KV_ERR_CORRUPT);
    char want[32];
    snprintf(want, sizeof(want), "(%u bytes)", RD_NOTE_HDR + 5);
    if (!strstr(kv_last_error(), "completed as opcode") || !strstr(kv_last_error(), want))
        fail_msg("want the opcode and length named: %s", kv_last_error());
    assert_int_equal(kv_xport_notify_poll(d.b, 200, &got), KV_ERR_TIMEOUT);
    duo_bufs_close(&d, &g);
    kv__verbs_set(kvt_softverbs());
}

/* The receiver's queue of notifications not yet polled is full
 * (max_pending_notes 2): the third notification is refused and
 * acknowledged as such. Its transfer ends FAILED with its entry KV_OK (the
 * bytes landed, compared), kv_xport_xfer_note_status KV_ERR_CAPACITY and
 * the limit named; both peers stay READY; once the queue is polled a
 * fourth is DONE and delivered. (Before notifications were acknowledged,
 * the SEND's completion ended the third DONE and the receiver then closed
 * the peer: a DONE whose notification nobody would ever poll.) */
static void test_xport_rdma_notes_over_the_queue_refused(void **state)
{
    (void)state;
    kvt_note_refused_for_capacity(KV_XPORT_RDMA, TOKEN); /* the check TCP and shm pass */
    struct duo d;
    duo_open(&d, 2, 2);
    const size_t n = 1u << 16;
    struct duo_bufs g;
    duo_bufs_open(&d, &g, n, true);
    pat_fill(g.lb, n, 7);
    const kv_xport_state want[4] = {KV_XPORT_DONE, KV_XPORT_DONE, KV_XPORT_FAILED, KV_XPORT_DONE};
    struct kv_xport_msg got;
    for (uint32_t i = 0; i < 4; i++) {
        if (i == 3) { /* the two queued, then room again */
            for (uint32_t k = 0; k < 2; k++) {
                assert_int_equal(kv_xport_notify_poll(d.b, 5000, &got), KV_OK);
                assert_int_equal(got.tag, 10 + k);
                assert_int_equal(got.peer_id, kv_xport_peer_id(d.pb));
            }
            assert_int_equal(kv_xport_notify_poll(d.b, 100, &got), KV_ERR_TIMEOUT);
        }
        const uint64_t off = 40960 - 4096 * (uint64_t)i; /* far from 0, descending */
        const struct kv_xport_io w = {
            .local = g.ml, .local_off = off + 3, .remote = g.r, .remote_off = off, .bytes = 4000};
        const char text[3] = {'n', 'o', (char)('0' + i)};
        const struct kv_xport_notify nt = {.tag = 10 + i, .msg = text, .len = sizeof(text)};
        kv_xport_xfer *t = NULL;
        assert_int_equal(kv_xport_write(d.pa, &w, 1, &nt, &t), KV_OK);
        assert_int_equal(run(t, 5000), want[i]);
        const kv_status *st;
        uint32_t m = 0;
        assert_int_equal(kv_xport_xfer_results(t, &st, &m), KV_OK);
        assert_int_equal(m, 1);
        assert_int_equal(st[0], KV_OK);
        kv_status ns = KV_ERR_IO;
        assert_int_equal(kv_xport_xfer_note_status(t, &ns), KV_OK);
        assert_int_equal(ns, i == 2 ? KV_ERR_CAPACITY : KV_OK);
        if (i == 2 && (!strstr(kv_xport_xfer_error(t), "max_pending_notes") ||
                       !strstr(kv_xport_xfer_error(t), "KV_ERR_CAPACITY")))
            fail_msg("want the limit named: %s", kv_xport_xfer_error(t));
        assert_int_equal(kv_xport_xfer_free(t), KV_OK);
        assert_memory_equal(g.rb + off, g.lb + off + 3, 4000);
        kv_xport_peer_state ps = KV_XPORT_CLOSED;
        kv_status why = KV_ERR_IO;
        assert_int_equal(kv_xport_peer_state_get(d.pb, &ps, &why), KV_OK);
        assert_int_equal(ps, KV_XPORT_READY);
        assert_int_equal(kv_xport_peer_state_get(d.pa, &ps, &why), KV_OK);
        assert_int_equal(ps, KV_XPORT_READY);
    }
    assert_int_equal(kv_xport_notify_poll(d.b, 5000, &got), KV_OK);
    assert_int_equal(got.tag, 13);
    assert_int_equal(got.len, 3);
    assert_memory_equal(got.data, "no3", 3);
    assert_int_equal(kv_xport_notify_poll(d.b, 100, &got), KV_ERR_TIMEOUT);
    struct kv_xport_stats xs = KV_XPORT_STATS_INIT;
    assert_int_equal(kv_xport_stats_get(d.b, &xs), KV_OK);
    assert_int_equal(xs.notes_refused, 1);
    /* the rest of b's region untouched */
    for (size_t k = 0; k < n; k++)
        if (k < 28672 || k >= 40960 + 4000 || (k - 28672) % 4096 >= 4000)
            assert_int_equal(g.rb[k], 0);
    duo_bufs_close(&d, &g);
}

/* A peer's acknowledgement is hostile bytes: a's first notification after
 * arming is rewritten on the wire into an ACK naming transfer `xfer` with
 * status `st`. b refuses it (closes the peer KV_ERR_CORRUPT naming what
 * is wrong); nothing is queued at b; a's transfer, whose notification b
 * never acknowledged, does not end DONE; and a's peer closes with b's
 * status and message (b's out-of-band FAIL), not as a clean close. */
static struct kv__verbs ack_verbs;
static bool ack_forge;
static uint64_t ack_xfer;
static int32_t ack_st;

static int ack_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad)
{
    for (struct ibv_send_wr *w = wr; w; w = w->next) {
        if (!ack_forge || w->opcode != IBV_WR_SEND || w->num_sge != 1)
            continue; /* (a drain marker has no SGE) */
        unsigned char *b = (unsigned char *)(uintptr_t)w->sg_list[0].addr;
        if (kv__le_get(b, 4) != RD_NOTE_MAGIC)
            continue;
        kv__le_put(b, RD_ACK_MAGIC, 4);
        kv__le_put(b + 4, RD_ACK_REC, 4);
        kv__le_put(b + 8, 0, 8);
        kv__le_put(b + 16, 0, 8);
        kv__le_put(b + RD_NOTE_HDR, ack_xfer, 8);
        kv__le_put(b + RD_NOTE_HDR + 8, (uint32_t)ack_st, 4);
        w->sg_list[0].length = RD_NOTE_HDR + RD_ACK_REC;
        ack_forge = false;
    }
    return kvt_softverbs()->post_send(qp, wr, bad);
}

static void forged_ack(uint64_t xfer, int32_t st, const char *words)
{
    ack_verbs = *kvt_softverbs();
    ack_verbs.post_send = ack_post_send;
    kv__verbs_set(&ack_verbs);
    struct duo d;
    duo_open(&d, 1, 0);
    ack_xfer = xfer;
    ack_st = st;
    ack_forge = true;
    const struct kv_xport_notify nt = {.tag = 5, .msg = "x", .len = 1};
    kv_xport_xfer *t = NULL;
    assert_int_equal(kv_xport_write(d.pa, NULL, 0, &nt, &t), KV_OK);
    assert_int_not_equal(run(t, 5000), KV_XPORT_DONE);
    assert_false(ack_forge);
    assert_int_equal(kv_xport_xfer_free(t), KV_OK);
    kv_status why = KV_OK;
    assert_int_equal(wait_state(d.pb, KV_XPORT_CLOSED, 5000, &why), KV_XPORT_CLOSED);
    assert_int_equal(why, KV_ERR_CORRUPT);
    if (!strstr(kv_last_error(), words))
        fail_msg("want '%s' named: %s", words, kv_last_error());
    /* a learns why (b's FAIL), not a clean close */
    why = KV_OK;
    assert_int_equal(wait_state(d.pa, KV_XPORT_CLOSED, 5000, &why), KV_XPORT_CLOSED);
    assert_int_equal(why, KV_ERR_CORRUPT);
    if (!strstr(kv_last_error(), "the peer failed the connection") ||
        !strstr(kv_last_error(), words))
        fail_msg("want b's cause at a: %s", kv_last_error());
    struct kv_xport_msg got;
    assert_int_equal(kv_xport_notify_poll(d.b, 100, &got), KV_ERR_TIMEOUT);
    duo_close(&d, NULL, 0, NULL, 0);
    kv__verbs_set(kvt_softverbs());
}

static void test_xport_rdma_forged_ack_refused(void **state)
{
    (void)state;
    if (real_dev)
        skip();
    /* b has sent no notification: an acknowledgement of any transfer
     * names none awaiting one */
    forged_ack(1, KV_OK, "acknowledgement of transfer 1, which has no notification");
    forged_ack(UINT64_MAX, KV_ERR_CAPACITY, "which has no notification awaiting one");
    /* a status an acknowledgement may not carry: refused while decoding */
    forged_ack(1, KV_ERR_IO, "with status");
    forged_ack(1, 7, "with status 7");
}

/* The acceptor cannot make its QPs for a connection (the device out of
 * QPs: create_qp ENOSPC, not out of memory), before it sent its INFO: the
 * connecting side's peer closes with the acceptor's status and message
 * (its out-of-band FAIL), not as a clean close (found by review: the FAIL
 * was sent only after our INFO). */
static struct kv__verbs qpfail_verbs;
static kv_xport *_Atomic qpfail_x;

static struct ibv_qp *qpfail_create_qp(struct ibv_pd *pd, struct ibv_qp_init_attr *ia)
{
    const struct rpeer *rp = ia->send_cq ? ia->send_cq->cq_context : NULL;
    if (rp && rp->p && rp->p->x == atomic_load(&qpfail_x)) {
        errno = ENOSPC;
        return NULL;
    }
    return kvt_softverbs()->create_qp(pd, ia);
}

static void test_xport_rdma_acceptor_failure_named(void **state)
{
    (void)state;
    if (real_dev)
        skip();
    qpfail_verbs = *kvt_softverbs();
    qpfail_verbs.create_qp = qpfail_create_qp;
    kv__verbs_set(&qpfail_verbs);
    struct kv_xport_config cb = cfg_make(true, TOKEN, FP, 3000),
                           ca = cfg_make(false, TOKEN, FP, 3000);
    kv_xport *a = NULL, *b = NULL;
    assert_int_equal(kv_xport_create(&cb, &b), KV_OK);
    assert_int_equal(kv_xport_create(&ca, &a), KV_OK);
    atomic_store(&qpfail_x, b);
    kv_xport_peer *pa = NULL;
    assert_int_equal(kv_xport_connect(a, "127.0.0.1", kv_xport_port(b), &pa), KV_OK);
    kv_status why = KV_OK;
    assert_int_equal(wait_state(pa, KV_XPORT_CLOSED, 6000, &why), KV_XPORT_CLOSED);
    assert_int_equal(why, KV_ERR_IO);
    if (!strstr(kv_last_error(), "the peer failed the connection") ||
        !strstr(kv_last_error(), "create_qp"))
        fail_msg("want the acceptor's cause at a: %s", kv_last_error());
    atomic_store(&qpfail_x, NULL);
    kv_xport_peer_close(pa);
    assert_int_equal(kv_xport_destroy(a), KV_OK);
    assert_int_equal(kv_xport_destroy(b), KV_OK);
    kv__verbs_set(kvt_softverbs());
}

/* Our INFO or READY refused by the peer's out-of-band transport fails the
 * peer at once, named, where the handshake used to go on as if it had
 * arrived (the sender READY, the receiver waiting until its deadline).
 * Found when a caller's max_pending_notes of 1 reached the OOB transport,
 * which then refused a READY behind an INFO not yet polled (under load).
 * The OOB transport now keeps the default queue, whatever the caller's;
 * here b's OOB queue is made to take nothing (white box), so a's INFO is
 * refused every time. */
static void test_xport_rdma_oob_refusal_named(void **state)
{
    (void)state;
    if (real_dev)
        skip();
    struct kv_xport_config cb = cfg_make(true, TOKEN, FP, 3000),
                           ca = cfg_make(false, TOKEN, FP, 3000);
    cb.max_pending_notes = 1;
    kv_xport *a = NULL, *b = NULL;
    assert_int_equal(kv_xport_create(&cb, &b), KV_OK);
    assert_int_equal(kv_xport_create(&ca, &a), KV_OK);
    kv_xport *boob = ((struct rdma *)b->be)->oob;
    pthread_mutex_lock(&boob->mu);
    assert_int_equal(boob->cfg.max_pending_notes, KV__XPORT_DEFAULT_NOTES);
    boob->cfg.max_pending_notes = 0; /* every notification refused (KV_ERR_CAPACITY) */
    pthread_mutex_unlock(&boob->mu);
    kv_xport_peer *pa = NULL;
    assert_int_equal(kv_xport_connect(a, "127.0.0.1", kv_xport_port(b), &pa), KV_OK);
    kv_status why = KV_OK;
    assert_int_equal(wait_state(pa, KV_XPORT_CLOSED, 6000, &why), KV_XPORT_CLOSED);
    assert_int_equal(why, KV_ERR_CAPACITY);
    if (!strstr(kv_last_error(), "our INFO did not reach the peer out of band") ||
        !strstr(kv_last_error(), "max_pending_notes"))
        fail_msg("want the refused INFO named: %s", kv_last_error());
    kv_xport_peer_close(pa);
    assert_int_equal(kv_xport_destroy(a), KV_OK);
    assert_int_equal(kv_xport_destroy(b), KV_OK);
}

/* One pass of the suite with its own decode child. */
static int run_pass(bool busy)
{
    busy_poll = busy;
    pass_ib = busy;
    int fds[2];
    if (pipe(fds) != 0)
        return 2;
    /* Fork first: nothing (threads, OpenMP) runs before it. */
    child = fork();
    if (child < 0)
        return 2;
    if (child == 0) {
        close(fds[0]);
        _exit(decode_main(fds[1]));
    }
    close(fds[1]);
    if (read(fds[0], &port, sizeof(port)) != sizeof(port)) {
        fprintf(stderr, "the decode child did not start\n");
        return 2;
    }
    close(fds[0]);
    if (!real_dev) {
        kv__verbs_set(kvt_softverbs());
        kvt_sv_set_max_mr_size(MR_MAX);
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_xport_rdma_idle_pair_cpu),
        cmocka_unit_test(test_xport_rdma_parameters_reported),
        cmocka_unit_test(test_xport_rdma_device_choice),
        cmocka_unit_test(test_xport_rdma_info_decode),
        cmocka_unit_test(test_xport_rdma_unsupported_without_device),
        cmocka_unit_test(test_xport_rdma_device_memory_refused),
        cmocka_unit_test(test_xport_rdma_writes_notify_whole_region),
        cmocka_unit_test(test_xport_rdma_reads_whole_region),
        cmocka_unit_test(test_xport_rdma_k_only_write_plan),
        cmocka_unit_test(test_xport_rdma_unexpose_revokes),
        cmocka_unit_test(test_xport_rdma_delayed_completion_done),
        cmocka_unit_test(test_xport_rdma_retry_exceeded),
        cmocka_unit_test(test_xport_rdma_remote_access_out_of_bounds),
        cmocka_unit_test(test_xport_rdma_lost_completion_times_out),
        cmocka_unit_test(test_xport_rdma_cancel_in_flight),
        cmocka_unit_test(test_xport_rdma_other_link_layer_refused),
        cmocka_unit_test(test_xport_rdma_wrong_token_refused),
        cmocka_unit_test(test_xport_rdma_wrong_fingerprint_refused),
        cmocka_unit_test(test_xport_rdma_bandwidth),
        cmocka_unit_test(test_xport_rdma_peer_killed_mid_transfer),
        cmocka_unit_test(test_xport_rdma_reads_within_max_sge_rd),
        cmocka_unit_test(test_xport_rdma_peer_close_waits_for_unexpose),
        cmocka_unit_test(test_xport_rdma_unexpose_waits_for_close_unexpose),
        cmocka_unit_test(test_xport_rdma_peer_close_waits_for_user_unexpose),
        cmocka_unit_test(test_xport_rdma_read_only_region_refused),
        cmocka_unit_test(test_xport_rdma_unexpose_mid_write),
        cmocka_unit_test(test_xport_rdma_hostile_ready_refused),
        cmocka_unit_test(test_xport_rdma_write_with_imm_is_no_notification),
        cmocka_unit_test(test_xport_rdma_notes_over_the_queue_refused),
        cmocka_unit_test(test_xport_rdma_forged_ack_refused),
        cmocka_unit_test(test_xport_rdma_acceptor_failure_named),
        cmocka_unit_test(test_xport_rdma_oob_refusal_named),
        cmocka_unit_test(test_xport_rdma_forged_key_refused),
    };
    const int rc =
        busy ? cmocka_run_group_tests_name("xport_rdma busy polling, InfiniBand, two devices",
                                           tests, NULL, NULL)
             : cmocka_run_group_tests_name("xport_rdma event mode, RoCE", tests, NULL, NULL);
    if (child > 0) {
        kill(child, SIGKILL);
        waitpid(child, NULL, 0);
    }
    child = -1;
    return rc;
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    real_dev = getenv("KV_RDMA_REAL") && strcmp(getenv("KV_RDMA_REAL"), "0") != 0;
    if (!real_dev && kvt_sv_set_devices(FABRIC, 3) != 0) /* before any fork: both see it */
        return 2;
    /* Each pass forks its child first, while no thread of ours runs (the
     * first pass's transports are destroyed and joined before the second). */
    const int rc = run_pass(false);
    return rc | run_pass(true);
}
