/*
 * test_xport_tcp.c - the transport seam over its TCP backend
 * (connector/kv_transport.h, kv_xport_tcp.c), in one process and in two.
 *
 *   - the handshake: ready both ways; a wrong token, a wrong fingerprint,
 *     another connection count refused naming the field, the refused peer
 *     never accepted; a listener that never answers (handshake timeout);
 *   - writes with a notification into a 64 MiB region, at offsets far from
 *     0 and up to its last byte, the whole region compared afterwards (the
 *     bytes outside the writes are untouched), the notification after the
 *     data; reads back; per-entry statuses;
 *   - post-time refusals (out of bounds, another peer's region, sizes) with
 *     nothing sent; a receiver-side refusal of a forged out-of-bounds write
 *     (nothing written, that entry FAILED, the others DONE);
 *   - unexpose: later writes refused; blobs of another connection refused;
 *   - in two processes (fork): a decode child and a prefill parent, many
 *     requests of random lengths through kv_xport_write_plan between
 *     different layouts (page size, NHD/HND, layer-/block-major, padding,
 *     a head slice), block ids far from 0, every element checked on the
 *     decode side through the reference addressing (kvtest.h) and the
 *     whole pool compared;
 *   - faults through a relay process between the two ends that cuts the
 *     connection, flips a payload byte, or stalls; the peer killed
 *     mid-transfer; cancel in flight: each ends in a terminal state with
 *     nothing marked complete that is not.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
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

#include <kvcache/kv.h>
#include "kv_xport_int.h"
#include "kvtest.h"

#define TOKEN 0x5EC12E7ull
#define REGION (64u << 20)

static struct kv_xport_config cfg_make(bool listen, uint64_t token, uint64_t fp)
{
    struct kv_xport_config c = KV_XPORT_CONFIG_INIT;
    c.kind = KV_XPORT_TCP;
    c.listen_host = listen ? "127.0.0.1" : NULL;
    c.token = token;
    c.fingerprint = fp;
    c.timeout_ms = 5000;
    return c;
}

/* Wait until p leaves CONNECTING; its state. */
static kv_xport_peer_state settle(kv_xport_peer *p, kv_status *why)
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

/* A connected pair in one process: a (connects) and b (listens). */
struct pair {
    kv_xport *a, *b;
    kv_xport_peer *pa, *pb;
};

static void pair_open(struct pair *p, uint32_t conns)
{
    struct kv_xport_config ca = cfg_make(false, TOKEN, 7), cb = cfg_make(true, TOKEN, 7);
    ca.conns_per_peer = cb.conns_per_peer = conns;
    assert_int_equal(kv_xport_create(&cb, &p->b), KV_OK);
    assert_int_equal(kv_xport_create(&ca, &p->a), KV_OK);
    assert_int_equal(kv_xport_connect(p->a, "127.0.0.1", kv_xport_port(p->b), &p->pa), KV_OK);
    assert_int_equal(kv_xport_accept(p->b, 5000, &p->pb), KV_OK);
    assert_int_equal(settle(p->pa, NULL), KV_XPORT_READY);
}

static void pair_close(struct pair *p)
{
    kv_xport_peer_close(p->pa);
    kv_xport_peer_close(p->pb);
    kv_xport_destroy(p->a);
    kv_xport_destroy(p->b);
}

/* b exposes m to a: the blob travels as a notification (as an engine
 * would send it), a imports it. */
static kv_xport_rmem *share(struct pair *p, kv_xport_mem *m)
{
    unsigned char blob[KV_XPORT_BLOB_MAX];
    size_t len = 0;
    assert_int_equal(kv_xport_mem_expose(p->pb, m, blob, sizeof(blob), &len), KV_OK);
    struct kv_xport_notify n = {.tag = 1, .msg = blob, .len = (uint32_t)len};
    kv_xport_xfer *t = NULL;
    assert_int_equal(kv_xport_write(p->pb, NULL, 0, &n, &t), KV_OK);
    kv_xport_state s;
    assert_int_equal(kv_xport_xfer_wait(t, 5000, &s), KV_OK);
    assert_int_equal(s, KV_XPORT_DONE);
    assert_int_equal(kv_xport_xfer_free(t), KV_OK);
    struct kv_xport_msg *msg = malloc(sizeof(*msg));
    assert_int_equal(kv_xport_notify_poll(p->a, 5000, msg), KV_OK);
    assert_ptr_equal(msg->peer, p->pa);
    assert_int_equal(msg->tag, 1);
    kv_xport_rmem *r = NULL;
    assert_int_equal(kv_xport_rmem_import(p->pa, msg->data, msg->len, &r), KV_OK);
    assert_int_equal(kv_xport_rmem_bytes(r), kv_xport_mem_bytes(m));
    free(msg);
    return r;
}

static void fill(unsigned char *p, size_t n, uint64_t seed)
{
    uint64_t s = seed;
    for (size_t i = 0; i < n; i += 8) {
        const uint64_t v = kvt_rand(&s);
        memcpy(p + i, &v, n - i < 8 ? n - i : 8);
    }
}

static void test_xport_tcp_handshake_refusals(void **state)
{
    (void)state;
    struct kv_xport_config cb = cfg_make(true, TOKEN, 0xF00D);
    kv_xport *b = NULL;
    assert_int_equal(kv_xport_create(&cb, &b), KV_OK);
    const uint16_t port = kv_xport_port(b);
    assert_true(port != 0);
    struct {
        uint64_t token, fp;
        uint32_t conns;
        const char *word;
    } cases[] = {{TOKEN + 1, 0xF00D, 0, "token"},
                 {TOKEN, 0xBEEF, 0, "fingerprint"},
                 {TOKEN, 0xF00D, 3, "connections"}};
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        struct kv_xport_config ca = cfg_make(false, cases[i].token, cases[i].fp);
        ca.conns_per_peer = cases[i].conns;
        kv_xport *a = NULL;
        kv_xport_peer *p = NULL;
        assert_int_equal(kv_xport_create(&ca, &a), KV_OK);
        assert_int_equal(kv_xport_connect(a, "127.0.0.1", port, &p), KV_OK);
        kv_status why = KV_OK;
        assert_int_equal(settle(p, &why), KV_XPORT_CLOSED);
        assert_int_equal(why, KV_ERR_MISMATCH);
        assert_non_null(strstr(kv_last_error(), cases[i].word));
        /* Writes on a refused peer are refused at post. */
        kv_xport_xfer *t = NULL;
        struct kv_xport_notify n = {.tag = 9};
        assert_int_equal(kv_xport_write(p, NULL, 0, &n, &t), KV_ERR_BAD_STATE);
        kv_xport_peer_close(p);
        kv_xport_destroy(a);
    }
    kv_xport_peer *none = NULL;
    assert_int_equal(kv_xport_accept(b, 100, &none), KV_ERR_TIMEOUT);
    kv_xport_destroy(b);

    /* A listener that never speaks: the handshake times out. */
    int ls = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    assert_int_equal(bind(ls, (struct sockaddr *)&sa, sizeof(sa)), 0);
    assert_int_equal(listen(ls, 8), 0);
    socklen_t sl = sizeof(sa);
    getsockname(ls, (struct sockaddr *)&sa, &sl);
    struct kv_xport_config ca = cfg_make(false, TOKEN, 0);
    ca.timeout_ms = 200;
    kv_xport *a = NULL;
    kv_xport_peer *p = NULL;
    assert_int_equal(kv_xport_create(&ca, &a), KV_OK);
    assert_int_equal(kv_xport_connect(a, "127.0.0.1", ntohs(sa.sin_port), &p), KV_OK);
    kv_status why = KV_OK;
    assert_int_equal(settle(p, &why), KV_XPORT_CLOSED);
    assert_int_equal(why, KV_ERR_TIMEOUT);
    kv_xport_peer_close(p);
    kv_xport_destroy(a);
    close(ls);

    /* Config refusals. */
    struct kv_xport_config bad = cfg_make(false, 0, 0);
    assert_int_equal(kv_xport_create(&bad, &a), KV_ERR_INVALID_ARG);
    bad = cfg_make(false, TOKEN, 0);
    bad.struct_size--;
    assert_int_equal(kv_xport_create(&bad, &a), KV_ERR_INVALID_ARG);
    bad = cfg_make(false, TOKEN, 0);
    bad.kind = (kv_xport_kind)9;
    assert_int_equal(kv_xport_create(&bad, &a), KV_ERR_INVALID_ARG);
}

/* Writes into b's region at offsets far from 0 (up to its last byte),
 * then reads back; the whole region compared. */
static void test_xport_tcp_write_read_whole_region(void **state)
{
    (void)state;
    struct pair p;
    pair_open(&p, 3);
    unsigned char *src = malloc(REGION), *dst = malloc(REGION), *want = malloc(REGION);
    unsigned char *back = calloc(1, REGION);
    fill(src, REGION, 11);
    memset(dst, 0xEE, REGION);
    memcpy(want, dst, REGION);
    kv_xport_mem *ms, *md, *mb;
    assert_int_equal(kv_xport_mem_reg(p.a, src, REGION, KV_MEM_HOST, &ms), KV_OK);
    assert_int_equal(kv_xport_mem_reg(p.a, back, REGION, KV_MEM_HOST, &mb), KV_OK);
    assert_int_equal(kv_xport_mem_reg(p.b, dst, REGION, KV_MEM_HOST, &md), KV_OK);
    kv_xport_rmem *r = share(&p, md);

    /* 40 entries: random sizes (1 byte .. 3 MiB), disjoint destinations
     * spread over the region, the last one ending at its last byte. */
    enum { NE = 40 };
    struct kv_xport_io ios[NE];
    uint64_t rng = 5;
    const uint64_t slot = REGION / NE;
    for (int i = 0; i < NE; i++) {
        const uint64_t bytes = 1 + kvt_rand(&rng) % (i % 4 == 0 ? slot / 2 : 4096);
        const uint64_t roff =
            i == NE - 1 ? REGION - bytes : (uint64_t)i * slot + kvt_rand(&rng) % (slot - bytes);
        const uint64_t loff = kvt_rand(&rng) % (REGION - bytes);
        ios[i] = (struct kv_xport_io){ms, loff, r, roff, bytes};
        memcpy(want + roff, src + loff, bytes);
    }
    const char note[] = "request 42 landed";
    struct kv_xport_notify n = {.tag = 42, .msg = note, .len = sizeof(note)};
    kv_xport_xfer *t = NULL;
    assert_int_equal(kv_xport_write(p.pa, ios, NE, &n, &t), KV_OK);
    /* The notification implies the data: check on arrival, before the
     * sender's transfer is even looked at. */
    struct kv_xport_msg *msg = malloc(sizeof(*msg));
    assert_int_equal(kv_xport_notify_poll(p.b, 10000, msg), KV_OK);
    assert_int_equal(msg->tag, 42);
    assert_memory_equal(msg->data, note, sizeof(note));
    assert_ptr_equal(msg->peer, p.pb);
    assert_memory_equal(dst, want, REGION);
    kv_xport_state s;
    assert_int_equal(kv_xport_xfer_wait(t, 10000, &s), KV_OK);
    assert_int_equal(s, KV_XPORT_DONE);
    const kv_status *st;
    uint32_t ns;
    assert_int_equal(kv_xport_xfer_results(t, &st, &ns), KV_OK);
    assert_int_equal(ns, NE);
    for (int i = 0; i < NE; i++)
        assert_int_equal(st[i], KV_OK);
    assert_int_equal(kv_xport_xfer_free(t), KV_OK);

    /* Read the same (disjoint) ranges back into `back` at their offsets:
     * back then equals dst there and stays zero elsewhere. */
    struct kv_xport_io rd[NE];
    unsigned char *bwant = calloc(1, REGION);
    for (int i = 0; i < NE; i++) {
        rd[i] = (struct kv_xport_io){mb, ios[i].remote_off, r, ios[i].remote_off, ios[i].bytes};
        memcpy(bwant + ios[i].remote_off, dst + ios[i].remote_off, ios[i].bytes);
    }
    assert_int_equal(kv_xport_read(p.pa, rd, NE, &t), KV_OK);
    assert_int_equal(kv_xport_xfer_wait(t, 10000, &s), KV_OK);
    assert_int_equal(s, KV_XPORT_DONE);
    assert_memory_equal(back, bwant, REGION);
    free(bwant);
    assert_int_equal(kv_xport_xfer_free(t), KV_OK);

    /* Post-time refusals: nothing sent, nothing changed. */
    struct kv_xport_io b1 = {ms, 0, r, REGION - 10, 11};
    assert_int_equal(kv_xport_write(p.pa, &b1, 1, NULL, &t), KV_ERR_OUT_OF_BOUNDS);
    assert_non_null(strstr(kv_last_error(), "entry 0"));
    struct kv_xport_io b2 = {ms, UINT64_MAX - 4, r, 0, 8};
    assert_int_equal(kv_xport_write(p.pa, &b2, 1, NULL, &t), KV_ERR_OUT_OF_BOUNDS);
    struct kv_xport_io b3 = {ms, 0, r, 0, 0};
    assert_int_equal(kv_xport_write(p.pa, &b3, 1, NULL, &t), KV_ERR_INVALID_ARG);
    assert_int_equal(kv_xport_write(p.pa, NULL, 0, NULL, &t), KV_ERR_INVALID_ARG);
    struct kv_xport_notify big = {.tag = 1, .msg = src, .len = KV_XPORT_NOTIFY_MAX + 1};
    assert_int_equal(kv_xport_write(p.pa, NULL, 0, &big, &t), KV_ERR_INVALID_ARG);
    /* A region of b used from b's side of the pair: another peer's. */
    struct kv_xport_io b4 = {md, 0, r, 0, 8};
    assert_int_equal(kv_xport_write(p.pb, &b4, 1, NULL, &t), KV_ERR_INVALID_ARG);
    assert_int_equal(kv_xport_mem_dereg(md), KV_ERR_BAD_STATE); /* exposed */

    /* The receiver's own check: a forged rmem claims more than b has. */
    memcpy(want, dst, REGION);
    r->bytes = 2ull * REGION;
    struct kv_xport_io f2[3] = {{ms, 0, r, 100, 1000},
                                {ms, 0, r, REGION - 8, 64}, /* past the end */
                                {ms, 5000, r, 7000, 100}};
    memcpy(want + 100, src, 1000);
    memcpy(want + 7000, src + 5000, 100);
    struct kv_xport_notify n2 = {.tag = 43};
    assert_int_equal(kv_xport_write(p.pa, f2, 3, &n2, &t), KV_OK);
    assert_int_equal(kv_xport_xfer_wait(t, 10000, &s), KV_OK);
    assert_int_equal(s, KV_XPORT_FAILED);
    assert_int_equal(kv_xport_xfer_results(t, &st, &ns), KV_OK);
    assert_int_equal(st[0], KV_OK);
    assert_int_equal(st[1], KV_ERR_OUT_OF_BOUNDS);
    assert_int_equal(st[2], KV_OK);
    assert_int_equal(kv_xport_xfer_free(t), KV_OK);
    assert_memory_equal(dst, want, REGION);
    /* A failed transfer's notification is never delivered. */
    assert_int_equal(kv_xport_notify_poll(p.b, 200, msg), KV_ERR_TIMEOUT);
    r->bytes = REGION;

    /* Unexposed: writes refused by the receiver. */
    assert_int_equal(kv_xport_mem_unexpose(p.pb, md), KV_OK);
    assert_int_equal(kv_xport_mem_unexpose(p.pb, md), KV_ERR_NOT_FOUND);
    struct kv_xport_io one = {ms, 0, r, 0, 4096};
    assert_int_equal(kv_xport_write(p.pa, &one, 1, NULL, &t), KV_OK);
    assert_int_equal(kv_xport_xfer_wait(t, 10000, &s), KV_OK);
    assert_int_equal(s, KV_XPORT_FAILED);
    assert_int_equal(kv_xport_xfer_free(t), KV_OK);
    assert_memory_equal(dst, want, REGION);

    /* A blob is for its connection only. */
    unsigned char blob[KV_XPORT_BLOB_MAX];
    size_t bl = 0;
    assert_int_equal(kv_xport_mem_expose(p.pb, md, blob, sizeof(blob), &bl), KV_OK);
    kv_xport_rmem *r2 = NULL;
    assert_int_equal(kv_xport_rmem_import(p.pb, blob, bl, &r2), KV_ERR_CORRUPT);
    blob[20] ^= 1;
    assert_int_equal(kv_xport_rmem_import(p.pa, blob, bl, &r2), KV_ERR_CORRUPT);
    assert_int_equal(kv_xport_rmem_import(p.pa, blob, bl - 1, &r2), KV_ERR_CORRUPT);
    assert_int_equal(kv_xport_mem_unexpose(p.pb, md), KV_OK);

    kv_xport_rmem_free(r);
    assert_int_equal(kv_xport_mem_dereg(md), KV_OK);
    assert_int_equal(kv_xport_mem_dereg(ms), KV_OK);
    assert_int_equal(kv_xport_mem_dereg(mb), KV_OK);
    pair_close(&p);
    free(msg);
    free(src);
    free(dst);
    free(want);
    free(back);
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_xport_tcp_handshake_refusals),
        cmocka_unit_test(test_xport_tcp_write_read_whole_region),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
