/*
 * test_xport_rdma_rails.c - several devices in one RDMA transport (rails,
 * docs/connector.md "Rails"), in one process over the software verbs
 * device (tests/softverbs) with three devices: kvt_r0 (Ethernet, MTU
 * 4096), kvt_r1 (InfiniBand, MTU 2048), kvt_r2 (Ethernet, MTU 1024). A
 * prefill transport A connects to a decode transport B; both have the
 * rails [kvt_r0, kvt_r1] unless a test says otherwise (every open context
 * is a node of its own, so A's kvt_r0 and B's kvt_r0 are two NICs).
 *
 *   - reported: each rail's device, link layer, MTU and path (a GRH on
 *     the RoCE rail, LID-routed on the InfiniBand one, each path MTU its
 *     own), the rails connected, the QPs; each region's rail and how it
 *     was chosen;
 *   - data: a write_plan per rail (posted together) and one write whose
 *     entries alternate between the rails, then a read back on both: the
 *     WHOLE destination pools equal a reference computed from the layout
 *     configs (kvt_ref_move) and plain copies; QP numbers repeat across
 *     the soft devices, so a completion matched on the wrong rail fails;
 *   - a write or read between a region on rail 0 and one on rail 1 is
 *     refused at post (KV_ERR_INVALID_ARG naming the entry, both regions
 *     and rails), nothing sent;
 *   - automatic choice: the devices' NUMA nodes from a fake sysfs tree,
 *     the memory's node injected: the near rail, the less loaded of two
 *     near ones, round robin when nothing is known; the pure chooser; the
 *     real move_pages lookup on this machine; sysfs files that are absent,
 *     -1 or garbage;
 *   - automatic choice for device memory by PCIe distance: the hop counter
 *     on path strings against a random tree model (hops from depths and
 *     parent walks), bus id normalisation (CUDA's 8-digit domain, upper
 *     case), the chooser with hops; a fake PCI tree (two switches under
 *     one root complex, a GPU and NIC A behind one, NIC B behind the
 *     other, NIC C and a third GPU on other root complexes and node 1) and
 *     an injected CUDA bus id lookup: the GPU goes to A (4 hops), ties
 *     split by regions then index, a GPU under no rail's root complex to
 *     the rail on its node, a pointer CUDA does not know or a bus id sysfs
 *     lacks to the NUMA / round-robin rules, A's sysfs entry gone: B (8
 *     hops); placed through kv__rd_region_place, since kv_xport_mem_reg
 *     still refuses device memory (checked: nothing counted). The real
 *     CUDA lookup and real sysfs PCI paths are not exercised here (no GPU,
 *     no RDMA device);
 *   - a peer with fewer devices: connected on the common count (reported),
 *     data on those rails lands, a blob naming a rail not connected is
 *     refused; config refusals (too many QPs, both device fields, a name
 *     twice, an unknown name);
 *   - the model is strict: the soft device refuses a QP with another
 *     device's CQ, a CQ with another device's channel, an rkey registered
 *     on another device than the target QP's (REM_ACCESS_ERR: nothing
 *     written) and an lkey of another device than the QP's (LOC_PROT_ERR).
 */
#include <errno.h>
#include <inttypes.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include <kvcache/kv.h>
#include "kv_verbs_int.h"
#include "kv_xport_int.h"
#include "kv_xport_rdma_int.h"
#include "kvt_side.h"
#include "kvt_softverbs.h"
#include "kvtest.h"

#define TOKEN 0x7A115ull

static const struct kvt_sv_dev_spec FABRIC[] = {
    {.name = "kvt_r0", .n_ports = 1, .port = {{IBV_LINK_LAYER_ETHERNET, IBV_MTU_4096, false}}},
    {.name = "kvt_r1", .n_ports = 1, .port = {{IBV_LINK_LAYER_INFINIBAND, IBV_MTU_2048, false}}},
    {.name = "kvt_r2", .n_ports = 1, .port = {{IBV_LINK_LAYER_ETHERNET, IBV_MTU_1024, false}}},
};
static const char *const RAILS2[] = {"kvt_r0", "kvt_r1"};
static const char *const RAILS3[] = {"kvt_r0", "kvt_r1", "kvt_r2"};

static struct kv_xport_config cfg_rails(bool listen, const char *const *devs, uint32_t n)
{
    struct kv_xport_config c = KV_XPORT_CONFIG_INIT;
    c.kind = KV_XPORT_RDMA;
    c.listen_host = listen ? "127.0.0.1" : NULL;
    c.token = TOKEN;
    c.conns_per_peer = 2;
    c.timeout_ms = 5000;
    c.rdma_devices = devs;
    c.n_rdma_devices = n;
    return c;
}

/* A connected pair: a (prefill, connects) and b (decode, listens). */
struct pair {
    kv_xport *a, *b;
    kv_xport_peer *pa, *pb;
};

static void pair_connect(struct pair *p)
{
    assert_int_equal(kv_xport_connect(p->a, "127.0.0.1", kv_xport_port(p->b), &p->pa), KV_OK);
    assert_int_equal(kv_xport_accept(p->b, 5000, &p->pb), KV_OK);
    kv_xport_peer_state s;
    if (kv_xport_peer_wait(p->pa, 5000, &s) != KV_OK)
        fail_msg("connect: state %d: %s", (int)s, kv_last_error());
}

static void pair_open(struct pair *p, const char *const *da, uint32_t na, const char *const *db,
                      uint32_t nb)
{
    memset(p, 0, sizeof(*p));
    struct kv_xport_config ca = cfg_rails(false, da, na), cb = cfg_rails(true, db, nb);
    assert_int_equal(kv_xport_create(&cb, &p->b), KV_OK);
    assert_int_equal(kv_xport_create(&ca, &p->a), KV_OK);
    pair_connect(p);
}

static void pair_peers_close(struct pair *p)
{
    kv_xport_peer_close(p->pa);
    kv_xport_peer_close(p->pb);
    p->pa = p->pb = NULL;
}

static void pair_close(struct pair *p)
{
    if (p->pa)
        pair_peers_close(p);
    assert_int_equal(kv_xport_destroy(p->a), KV_OK);
    assert_int_equal(kv_xport_destroy(p->b), KV_OK);
}

/* B exposes md to its peer; A imports the blob. */
static kv_xport_rmem *share(struct pair *p, kv_xport_mem *md)
{
    unsigned char blob[KV_XPORT_BLOB_MAX];
    size_t len = 0;
    assert_int_equal(kv_xport_mem_expose(p->pb, md, blob, sizeof(blob), &len), KV_OK);
    kv_xport_rmem *r = NULL;
    assert_int_equal(kv_xport_rmem_import(p->pa, blob, len, &r), KV_OK);
    return r;
}

static kv_xport_state finish(kv_xport_xfer *t)
{
    kv_xport_state s = KV_XPORT_PENDING;
    assert_int_equal(kv_xport_xfer_wait(t, 10000, &s), KV_OK);
    return s;
}

static void mem_info_is(kv_xport_mem *m, uint32_t rail, const char *dev, kv_xport_mem_choice how,
                        int numa, int dev_numa)
{
    struct kv_xport_mem_info mi = KV_XPORT_MEM_INFO_INIT;
    assert_int_equal(kv_xport_mem_info_get(m, &mi), KV_OK);
    assert_int_equal(mi.rdma_rail, rail);
    assert_string_equal(mi.rdma_device, dev);
    assert_int_equal(mi.rdma_chosen, how);
    assert_int_equal(mi.numa_node, numa);
    assert_int_equal(mi.device_numa_node, dev_numa);
    assert_int_equal(mi.pci_distance, -1); /* host memory */
}

/* ---- reported, and data on both rails -------------------------------- */

static void test_xport_rdma_rails_reported(void **state)
{
    (void)state;
    struct pair p;
    pair_open(&p, RAILS2, 2, RAILS2, 2);
    struct kv_xport_info xi = KV_XPORT_INFO_INIT, pi = KV_XPORT_INFO_INIT;
    assert_int_equal(kv_xport_info_get(p.a, &xi), KV_OK);
    assert_int_equal(kv_xport_peer_info_get(p.pa, &pi), KV_OK);
    char line[2048];
    assert_true(kv_xport_info_format(&pi, line, sizeof(line)) < (int)sizeof(line));
    printf("    rails: %s\n", line);
    assert_int_equal(xi.rdma_rails, 2);
    assert_int_equal(xi.rdma_peer_rails, 0);
    assert_int_equal(xi.rdma_rail[0].qps, 0);
    assert_int_equal(pi.rdma_rails, 2);
    assert_int_equal(pi.rdma_peer_rails, 2);
    assert_int_equal(pi.rdma_qps, 4); /* 2 per rail */
    /* rail 0: RoCE, a GRH, the RoCE v2 IPv4-mapped GID, path MTU 4096 */
    const struct kv_xport_rail_info *r0 = &pi.rdma_rail[0], *r1 = &pi.rdma_rail[1];
    assert_string_equal(r0->device, "kvt_r0");
    assert_int_equal(r0->port, 1);
    assert_int_equal(r0->link, KV_XPORT_LINK_ETHERNET);
    assert_int_equal(r0->gid_index, 3);
    assert_int_equal(r0->gid_type, KV_XPORT_GID_ROCE_V2);
    assert_int_equal(r0->active_mtu, 4096);
    assert_int_equal(r0->numa_node, -1); /* no sysfs entry for a soft device */
    assert_int_equal(r0->qps, 2);
    assert_int_equal(r0->path_mtu, 4096);
    assert_true(r0->grh);
    assert_int_equal(r0->hop_limit, 255);
    assert_int_equal(r0->remote_gid[10], 0xff);
    /* rail 1: InfiniBand, LID-routed, MTU 2048 */
    assert_string_equal(r1->device, "kvt_r1");
    assert_int_equal(r1->link, KV_XPORT_LINK_INFINIBAND);
    assert_in_range(r1->lid, 1, 0xbfff);
    assert_int_equal(r1->gid_index, 0);
    assert_int_equal(r1->gid_type, KV_XPORT_GID_IB);
    assert_int_equal(r1->active_mtu, 2048);
    assert_int_equal(r1->qps, 2);
    assert_int_equal(r1->path_mtu, 2048);
    assert_false(r1->grh);
    assert_in_range(r1->remote_lid, 1, 0xbfff);
    assert_int_not_equal(r1->remote_lid, r1->lid);
    /* the top-level fields are rail 0's */
    assert_string_equal(pi.rdma_device, "kvt_r0");
    assert_int_equal(pi.rdma_link, KV_XPORT_LINK_ETHERNET);
    assert_int_equal(pi.rdma_path_mtu, 4096);
    assert_true(pi.rdma_grh);
    assert_memory_equal(pi.rdma_gid, r0->gid, 16);
    assert_memory_equal(pi.rdma_remote_gid, r0->remote_gid, 16);
    assert_non_null(strstr(line, "rdma rails 2 (peer 2): rail 0 device kvt_r0 port 1 ethernet"));
    assert_non_null(strstr(line, "numa -1 | qps 2 path_mtu 4096 grh hop_limit 255"));
    assert_non_null(strstr(line, "; rail 1 device kvt_r1 port 1 infiniband"));
    assert_non_null(strstr(line, "| qps 2 path_mtu 2048 no-grh hop_limit 0"));
    /* B sees the same rails from its side */
    struct kv_xport_info bi = KV_XPORT_INFO_INIT;
    assert_int_equal(kv_xport_peer_info_get(p.pb, &bi), KV_OK);
    assert_int_equal(bi.rdma_peer_rails, 2);
    assert_int_equal(bi.rdma_rail[1].remote_lid, r1->lid);
    assert_int_equal(bi.rdma_rail[1].lid, r1->remote_lid);
    assert_memory_equal(bi.rdma_rail[0].remote_gid, r0->gid, 16);
    /* explicit placement, reported; a device past the rails refused */
    void *buf = aligned_alloc(4096, 1 << 16);
    assert_non_null(buf);
    memset(buf, 1, 1 << 16);
    kv_xport_mem *m0 = NULL, *m1 = NULL, *mx = NULL;
    assert_int_equal(kv_xport_mem_reg_on(p.a, buf, 1 << 15, KV_MEM_HOST, 1, &m1), KV_OK);
    assert_int_equal(
        kv_xport_mem_reg_on(p.a, (char *)buf + (1 << 15), 1 << 15, KV_MEM_HOST, 0, &m0), KV_OK);
    /* the memory's node: what move_pages says (0 on a one-node machine) */
    mem_info_is(m1, 1, "kvt_r1", KV_XPORT_CHOSEN_CALLER, kv__rd_mem_node_sys(buf, 1 << 15), -1);
    mem_info_is(m0, 0, "kvt_r0", KV_XPORT_CHOSEN_CALLER,
                kv__rd_mem_node_sys((char *)buf + (1 << 15), 1 << 15), -1);
    assert_int_equal(kv_xport_mem_reg_on(p.a, buf, 4096, KV_MEM_HOST, 2, &mx), KV_ERR_INVALID_ARG);
    assert_null(mx);
    kvt_assert_msg_has("device 2, but the transport has 2 (rails: kvt_r0,kvt_r1)");
    assert_int_equal(kv_xport_info_get(p.a, &xi), KV_OK);
    assert_int_equal(xi.rdma_rail[0].regions, 1);
    assert_int_equal(xi.rdma_rail[1].regions, 1);
    struct kv_xport_mem_info mi = KV_XPORT_MEM_INFO_INIT;
    mi.struct_size--;
    assert_int_equal(kv_xport_mem_info_get(m0, &mi), KV_ERR_INVALID_ARG);
    assert_int_equal(kv_xport_mem_info_get(NULL, &mi), KV_ERR_NULL);
    assert_int_equal(kv_xport_mem_dereg(m0), KV_OK);
    assert_int_equal(kv_xport_mem_dereg(m1), KV_OK);
    assert_int_equal(kv_xport_info_get(p.a, &xi), KV_OK);
    assert_int_equal(xi.rdma_rail[0].regions + xi.rdma_rail[1].regions, 0);
    pair_close(&p);
    /* TCP: device 0 or automatic only, nothing chosen */
    struct kv_xport_config tc = KV_XPORT_CONFIG_INIT;
    tc.kind = KV_XPORT_TCP;
    tc.token = TOKEN;
    kv_xport *t = NULL;
    assert_int_equal(kv_xport_create(&tc, &t), KV_OK);
    assert_int_equal(kv_xport_mem_reg_on(t, buf, 4096, KV_MEM_HOST, 1, &mx), KV_ERR_INVALID_ARG);
    kvt_assert_msg_has("device 1 on the tcp transport");
    assert_int_equal(kv_xport_mem_reg_on(t, buf, 4096, KV_MEM_HOST, 0, &mx), KV_OK);
    assert_int_equal(kv_xport_mem_info_get(mx, &mi), KV_ERR_INVALID_ARG); /* still short */
    mi.struct_size = sizeof(mi);
    assert_int_equal(kv_xport_mem_info_get(mx, &mi), KV_OK);
    assert_int_equal(mi.rdma_chosen, KV_XPORT_CHOSEN_NONE);
    assert_int_equal(mi.numa_node, -1);
    assert_string_equal(mi.rdma_device, "");
    assert_int_equal(kv_xport_mem_dereg(mx), KV_OK);
    assert_int_equal(kv_xport_destroy(t), KV_OK);
    free(buf);
}

enum { L = 2, B = 40, N = 16, H = 4, D = 32, NB = 12 };

/* Everything a data test needs on both sides: per rail a source (A) and
 * a destination pool (B), the destination exposed and imported. */
struct rails_data {
    struct kvt_side s[2], d[2];
    kv_xport_mem *ms[2], *md[2];
    kv_xport_rmem *r[2];
    unsigned char *want[2];
};

static void data_open(struct pair *p, struct rails_data *w)
{
    for (uint32_t i = 0; i < 2; i++) {
        kvt_side_make(&w->s[i], L, B, N, H, D, KV_BF16, 0, 10 + i);
        kvt_side_make(&w->d[i], L, B, N, H, D, KV_BF16, i ? 1 : 2, 20 + i);
        assert_int_equal(kv_xport_mem_reg_on(p->a, w->s[i].mem, (size_t)w->s[i].lo.total_bytes,
                                             KV_MEM_HOST, i, &w->ms[i]),
                         KV_OK);
        assert_int_equal(kv_xport_mem_reg_on(p->b, w->d[i].mem, (size_t)w->d[i].lo.total_bytes,
                                             KV_MEM_HOST, i, &w->md[i]),
                         KV_OK);
        w->r[i] = share(p, w->md[i]);
        w->want[i] = malloc((size_t)w->d[i].lo.total_bytes);
        assert_non_null(w->want[i]);
        memcpy(w->want[i], w->d[i].mem, (size_t)w->d[i].lo.total_bytes);
    }
}

/* Both destination pools equal their reference, whole. */
static void data_check(const struct rails_data *w)
{
    for (uint32_t i = 0; i < 2; i++) {
        const int64_t at = kvt_first_diff(w->want[i], w->d[i].mem, w->d[i].lo.total_bytes);
        if (at != -1)
            fail_msg("rail %u: the destination pool differs from the reference at byte %" PRId64, i,
                     at);
    }
}

static void data_close(struct pair *p, struct rails_data *w)
{
    for (uint32_t i = 0; i < 2; i++) {
        assert_int_equal(kv_xport_rmem_free(w->r[i]), KV_OK);
        if (p->pb)
            assert_int_equal(kv_xport_mem_unexpose(p->pb, w->md[i]), KV_OK);
        kv_status st;
        if ((st = kv_xport_mem_dereg(w->ms[i])) != KV_OK)
            fail_msg("rail %u: dereg of A's source: %s: %s", i, kv_status_name(st), kv_last_error());
        if ((st = kv_xport_mem_dereg(w->md[i])) != KV_OK)
            fail_msg("rail %u: dereg of B's destination: %s: %s", i, kv_status_name(st),
                     kv_last_error());
        kvt_side_free(&w->s[i]);
        kvt_side_free(&w->d[i]);
        free(w->want[i]);
    }
}

static void test_xport_rdma_rails_data_both_rails(void **state)
{
    (void)state;
    struct pair p;
    pair_open(&p, RAILS2, 2, RAILS2, 2);
    struct rails_data w;
    data_open(&p, &w);
    /* one write_plan per rail, posted together (NHD -> HND on rail 1) */
    kv_plan *plan[2] = {NULL, NULL};
    uint32_t sid[2][NB], did[2][NB];
    uint64_t rng = 31;
    kv_xport_xfer *t[2] = {NULL, NULL};
    for (uint32_t i = 0; i < 2; i++) {
        assert_int_equal(kv_plan_create(&w.s[i].lo, &w.d[i].lo, NULL, &plan[i]), KV_OK);
        kvt_pick_ids(&rng, B, NB, sid[i]);
        kvt_pick_ids(&rng, B, NB, did[i]);
        const struct kv_xport_notify n = {.tag = 100 + i};
        assert_int_equal(kv_xport_write_plan(p.pa, plan[i], w.ms[i], 0, sid[i], NB, w.r[i], 0,
                                             did[i], NB, (uint64_t)NB * N, &n, &t[i]),
                         KV_OK);
        kvt_ref_move(&w.s[i], sid[i], NB, &w.d[i], did[i], NB, 0, 0, H, w.want[i]);
    }
    for (uint32_t i = 0; i < 2; i++) {
        assert_int_equal(finish(t[i]), KV_XPORT_DONE);
        assert_int_equal(kv_xport_xfer_free(t[i]), KV_OK);
        kv_plan_destroy(plan[i]);
    }
    struct kv_xport_msg *msg = malloc(sizeof(*msg));
    assert_non_null(msg);
    for (uint32_t i = 0; i < 2; i++) {
        assert_int_equal(kv_xport_notify_poll(p.b, 5000, msg), KV_OK);
        assert_int_equal(msg->tag, 100 + i); /* in post order: the first waits for nothing */
    }
    data_check(&w);
    /* one write whose entries alternate between the rails: odd sizes and
     * offsets, up to the last byte of each pool */
    enum { NE = 64 };
    struct kv_xport_io ios[NE];
    const uint64_t tot = (uint64_t)w.d[0].lo.total_bytes;
    for (uint32_t k = 0; k < NE; k++) {
        const uint32_t i = k % 2;
        const uint64_t len = 1 + kvt_rand(&rng) % 20000;
        const uint64_t roff = k >= NE - 2 ? tot - len : (tot / NE) * k + kvt_rand(&rng) % 97;
        const uint64_t loff = kvt_rand(&rng) % (tot - len);
        ios[k] = (struct kv_xport_io){.local = w.ms[i],
                                      .local_off = loff,
                                      .remote = w.r[i],
                                      .remote_off = roff,
                                      .bytes = len};
        memcpy(w.want[i] + roff, w.s[i].mem + loff, len);
    }
    const struct kv_xport_notify n = {.tag = 200, .msg = "both", .len = 4};
    kv_xport_xfer *x = NULL;
    assert_int_equal(kv_xport_write(p.pa, ios, NE, &n, &x), KV_OK);
    assert_int_equal(finish(x), KV_XPORT_DONE);
    const kv_status *st = NULL;
    uint32_t ne = 0;
    assert_int_equal(kv_xport_xfer_results(x, &st, &ne), KV_OK);
    assert_int_equal(ne, NE);
    for (uint32_t k = 0; k < NE; k++)
        assert_int_equal(st[k], KV_OK);
    assert_int_equal(kv_xport_xfer_free(x), KV_OK);
    assert_int_equal(kv_xport_notify_poll(p.b, 5000, msg), KV_OK);
    assert_int_equal(msg->tag, 200);
    data_check(&w); /* the notification came after every byte */
    /* read back from both rails into zeroed sources, compared whole */
    for (uint32_t i = 0; i < 2; i++)
        memset(w.s[i].mem, 0, (size_t)w.s[i].lo.total_bytes);
    struct kv_xport_io rio[2];
    for (uint32_t i = 0; i < 2; i++)
        rio[i] = (struct kv_xport_io){
            .local = w.ms[i], .local_off = 0, .remote = w.r[i], .remote_off = 0, .bytes = tot};
    assert_int_equal(kv_xport_read(p.pa, rio, 2, &x), KV_OK);
    assert_int_equal(finish(x), KV_XPORT_DONE);
    assert_int_equal(kv_xport_xfer_free(x), KV_OK);
    for (uint32_t i = 0; i < 2; i++)
        assert_int_equal(kvt_first_diff(w.s[i].mem, w.want[i], (int64_t)tot), -1);
    free(msg);
    data_close(&p, &w);
    pair_close(&p);
}

/* ---- cross-rail refusals ------------------------------------------- */

static void test_xport_rdma_rails_cross_rail_refused(void **state)
{
    (void)state;
    struct pair p;
    pair_open(&p, RAILS2, 2, RAILS2, 2);
    struct rails_data w;
    data_open(&p, &w);
    struct kv_xport_io ios[3] = {
        {.local = w.ms[0], .local_off = 0, .remote = w.r[0], .remote_off = 0, .bytes = 4096},
        {.local = w.ms[1], .local_off = 0, .remote = w.r[1], .remote_off = 0, .bytes = 4096},
        {.local = w.ms[0], .local_off = 8, .remote = w.r[1], .remote_off = 64, .bytes = 100},
    };
    kv_xport_xfer *x = NULL;
    char words[200];
    snprintf(words, sizeof(words),
             "xport_write: entry 2: local region %u is on rail 0 (kvt_r0), remote region %u on "
             "the peer's rail 1: RDMA writes only between regions of one rail",
             w.ms[0]->region, w.md[1]->region);
    assert_int_equal(kv_xport_write(p.pa, ios, 3, NULL, &x), KV_ERR_INVALID_ARG);
    assert_null(x);
    kvt_assert_msg_has(words);
    kvt_assert_msg_has("register the local one on rail 1: kv_xport_mem_reg_on");
    ios[2].local = w.ms[1];
    ios[2].remote = w.r[0];
    assert_int_equal(kv_xport_read(p.pa, &ios[2], 1, &x), KV_ERR_INVALID_ARG);
    kvt_assert_msg_has("xport_read: entry 0: local region");
    kvt_assert_msg_has("on rail 1 (kvt_r1), remote region");
    kvt_assert_msg_has("RDMA reads only");
    /* a plan across rails: refused the same way */
    kv_plan *plan = NULL;
    assert_int_equal(kv_plan_create(&w.s[0].lo, &w.d[1].lo, NULL, &plan), KV_OK);
    const uint32_t ids[2] = {3, 7};
    assert_int_equal(
        kv_xport_write_plan(p.pa, plan, w.ms[0], 0, ids, 2, w.r[1], 0, ids, 2, 2 * N, NULL, &x),
        KV_ERR_INVALID_ARG);
    kvt_assert_msg_has("on the peer's rail 1");
    kv_plan_destroy(plan);
    /* nothing was sent: the pools are untouched, and the peer still works */
    data_check(&w);
    assert_int_equal(kv_xport_write(p.pa, ios, 2, NULL, &x), KV_OK);
    assert_int_equal(finish(x), KV_XPORT_DONE);
    assert_int_equal(kv_xport_xfer_free(x), KV_OK);
    for (uint32_t i = 0; i < 2; i++)
        memcpy(w.want[i], w.s[i].mem, 4096);
    data_check(&w);
    data_close(&p, &w);
    pair_close(&p);
}

/* ---- automatic choice ---------------------------------------------- */

static char sysroot[64];
static void *near0, *near1; /* the fake memory-node lookup: node 0, node 1, else unknown */

static int fake_node(const void *base, size_t bytes)
{
    (void)bytes;
    return base == near0 ? 0 : base == near1 ? 1 : -1;
}

static void sys_write(const char *dev, const char *text)
{
    char path[256];
    snprintf(path, sizeof(path), "%s/class", sysroot);
    mkdir(path, 0700);
    snprintf(path, sizeof(path), "%s/class/infiniband", sysroot);
    mkdir(path, 0700);
    snprintf(path, sizeof(path), "%s/class/infiniband/%s", sysroot, dev);
    mkdir(path, 0700);
    snprintf(path, sizeof(path), "%s/class/infiniband/%s/device", sysroot, dev);
    mkdir(path, 0700);
    snprintf(path, sizeof(path), "%s/class/infiniband/%s/device/numa_node", sysroot, dev);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

static void sys_rm(void)
{
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", sysroot);
    assert_int_equal(system(cmd), 0);
}

static void test_xport_rdma_rails_auto_choice(void **state)
{
    (void)state;
    /* the pure chooser */
    kv_xport_mem_choice how;
    uint32_t spread = 0;
    const int nodes[4] = {1, 0, 0, -1};
    const uint32_t load[4] = {0, 3, 2, 0};
    assert_int_equal(kv__rd_rail_choose(NULL, nodes, load, 4, 0, &spread, &how),
                     2); /* less loaded */
    assert_int_equal(how, KV_XPORT_CHOSEN_NUMA);
    const uint32_t even[4] = {0, 2, 2, 0};
    assert_int_equal(kv__rd_rail_choose(NULL, nodes, even, 4, 0, &spread, &how),
                     1); /* tie: lowest */
    assert_int_equal(kv__rd_rail_choose(NULL, nodes, load, 4, 1, &spread, &how), 0);
    assert_int_equal(spread, 0);
    for (uint32_t k = 0; k < 6; k++) { /* node 2 or unknown: round robin */
        assert_int_equal(kv__rd_rail_choose(NULL, nodes, load, 4, k % 2 ? 2 : -1, &spread, &how),
                         k % 4);
        assert_int_equal(how, KV_XPORT_CHOSEN_SPREAD);
    }
    assert_int_equal(kv__rd_rail_choose(NULL, nodes, load, 1, 0, &spread, &how), 0);
    assert_int_equal(how, KV_XPORT_CHOSEN_ONLY);
    /* sysfs values: absent, -1, garbage, a node */
    snprintf(sysroot, sizeof(sysroot), "/tmp/kvt_rails_sys.XXXXXX");
    assert_non_null(mkdtemp(sysroot));
    assert_int_equal(kv__rd_sysfs_numa(sysroot, "kvt_r0"), -1);
    sys_write("kvt_r0", "-1\n");
    assert_int_equal(kv__rd_sysfs_numa(sysroot, "kvt_r0"), -1);
    sys_write("kvt_r0", "zero\n");
    assert_int_equal(kv__rd_sysfs_numa(sysroot, "kvt_r0"), -1);
    sys_write("kvt_r0", "1\n"); /* rail 0 on node 1, rail 1 on node 0, rail 2 unknown */
    sys_write("kvt_r1", "0\n");
    assert_int_equal(kv__rd_sysfs_numa(sysroot, "kvt_r0"), 1);
    /* the real lookup: touched memory on this machine's only node is on 0 */
    char *buf = aligned_alloc(4096, 6 << 12);
    assert_non_null(buf);
    memset(buf, 7, 6 << 12);
    struct stat sb;
    if (stat("/sys/devices/system/node/node0", &sb) == 0 &&
        stat("/sys/devices/system/node/node1", &sb) != 0) {
        assert_int_equal(kv__rd_mem_node_sys(buf, 6 << 12), 0);
        assert_int_equal(kv__rd_mem_node_sys(buf + 100, 1), 0);
    }
    /* end to end: the seams pointed at the fake tree and lookup */
    const char *root0 = kv__rd_sysfs_root;
    int (*node0)(const void *, size_t) = kv__rd_mem_node;
    kv__rd_sysfs_root = sysroot;
    kv__rd_mem_node = fake_node;
    near0 = buf;
    near1 = buf + 4096;
    struct kv_xport_config c = cfg_rails(false, RAILS3, 3);
    kv_xport *x = NULL;
    assert_int_equal(kv_xport_create(&c, &x), KV_OK);
    kv_xport_mem *m[6] = {NULL};
    /* node 0: rail 1; node 1: rail 0; unknown: round robin 0, 1, 2 */
    assert_int_equal(kv_xport_mem_reg(x, near0, 4096, KV_MEM_HOST, &m[0]), KV_OK);
    assert_int_equal(kv_xport_mem_reg(x, near1, 4096, KV_MEM_HOST, &m[1]), KV_OK);
    for (uint32_t k = 2; k < 5; k++)
        assert_int_equal(kv_xport_mem_reg(x, buf + 4096 * k, 4096, KV_MEM_HOST, &m[k]), KV_OK);
    /* the caller's choice wins over the node */
    assert_int_equal(kv_xport_mem_reg_on(x, near0, 4096, KV_MEM_HOST, 2, &m[5]), KV_OK);
    mem_info_is(m[0], 1, "kvt_r1", KV_XPORT_CHOSEN_NUMA, 0, 0);
    mem_info_is(m[1], 0, "kvt_r0", KV_XPORT_CHOSEN_NUMA, 1, 1);
    mem_info_is(m[2], 0, "kvt_r0", KV_XPORT_CHOSEN_SPREAD, -1, 1);
    mem_info_is(m[3], 1, "kvt_r1", KV_XPORT_CHOSEN_SPREAD, -1, 0);
    mem_info_is(m[4], 2, "kvt_r2", KV_XPORT_CHOSEN_SPREAD, -1, -1);
    mem_info_is(m[5], 2, "kvt_r2", KV_XPORT_CHOSEN_CALLER, 0, -1);
    struct kv_xport_info in = KV_XPORT_INFO_INIT;
    assert_int_equal(kv_xport_info_get(x, &in), KV_OK);
    assert_int_equal(in.rdma_rails, 3);
    assert_int_equal(in.rdma_rail[0].numa_node, 1);
    assert_int_equal(in.rdma_rail[1].numa_node, 0);
    assert_int_equal(in.rdma_rail[2].numa_node, -1);
    assert_int_equal(in.rdma_rail[0].regions, 2);
    assert_int_equal(in.rdma_rail[1].regions, 2);
    assert_int_equal(in.rdma_rail[2].regions, 2);
    char line[2048];
    kv_xport_info_format(&in, line, sizeof(line));
    assert_non_null(strstr(line, "rdma rails 3 (peer 0): rail 0 device kvt_r0"));
    assert_non_null(strstr(line, "mtu 4096 numa 1; rail 1 device kvt_r1"));
    assert_non_null(strstr(line, "mtu 1024 numa -1"));
    for (uint32_t k = 0; k < 6; k++)
        assert_int_equal(kv_xport_mem_dereg(m[k]), KV_OK);
    assert_int_equal(kv_xport_destroy(x), KV_OK);
    kv__rd_sysfs_root = root0;
    kv__rd_mem_node = node0;
    sys_rm();
    free(buf);
}

/* ---- automatic choice by PCIe distance (device memory) ----------------- */

/* The hop counter on path strings against a tree model: random trees of
 * root complexes and bridges/functions, each node's path written from its
 * parent chain, the expected hops from depths and the lowest common
 * ancestor found by walking parents (never by comparing strings). */
#define MODEL_NODES 48

struct pci_model {
    int parent[MODEL_NODES]; /* -1: the "devices" directory's child list */
    int root[MODEL_NODES];   /* the root complex a node is under (itself for a root) */
    int depth[MODEL_NODES];  /* a root: 0 */
    char name[MODEL_NODES][16];
};

static uint64_t rng_next(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static void model_path(const struct pci_model *t, int i, const char *prefix, char *out, size_t cap)
{
    int chain[MODEL_NODES], n = 0;
    for (int k = i; k >= 0; k = t->parent[k])
        chain[n++] = k;
    size_t used = (size_t)snprintf(out, cap, "%s/devices", prefix);
    while (n--)
        used += (size_t)snprintf(out + used, cap - used, "/%s", t->name[chain[n]]);
    assert_true(used < cap);
}

static int model_hops(const struct pci_model *t, int a, int b)
{
    if (t->root[a] != t->root[b] || t->depth[a] == 0 || t->depth[b] == 0)
        return -1;
    int x = a, y = b, h = 0;
    while (t->depth[x] > t->depth[y]) {
        x = t->parent[x];
        h++;
    }
    while (t->depth[y] > t->depth[x]) {
        y = t->parent[y];
        h++;
    }
    while (x != y) {
        x = t->parent[x];
        y = t->parent[y];
        h += 2;
    }
    return h;
}

static void test_xport_rdma_rails_pci_hops(void **state)
{
    (void)state;
    /* by hand: one switch (4), same root other ports, other roots */
    const char *gpu = "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0";
    assert_int_equal(kv__rd_pci_hops(gpu, gpu), 0);
    assert_int_equal(
        kv__rd_pci_hops(gpu, "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0/"
                             "0000:04:00.0"),
        4);
    assert_int_equal(kv__rd_pci_hops(gpu, "/sys/devices/pci0000:00/0000:00:02.0/0000:05:00.0"), 6);
    assert_int_equal(kv__rd_pci_hops("/sys/devices/pci0000:00/0000:00:02.0/0000:05:00.0", gpu), 6);
    assert_int_equal(kv__rd_pci_hops(gpu, "/sys/devices/pci0000:80/0000:80:01.0/0000:81:00.0"), -1);
    assert_int_equal(kv__rd_pci_hops(gpu, "/sys/devices/pci0000:00"), -1); /* a root, no device */
    assert_int_equal(kv__rd_pci_hops(gpu, "/sys/devices/virtual/net/lo"), -1);
    assert_int_equal(kv__rd_pci_hops("/sys/devices/virtual/net/lo", "/sys/devices/virtual/net/lo"),
                     -1);
    assert_int_equal(kv__rd_pci_hops(gpu, "/other/devices/pci0000:00/0000:00:01.0"), -1);
    assert_int_equal(kv__rd_pci_hops(gpu, NULL), -1);
    assert_int_equal(kv__rd_pci_hops("//sys//devices/pci0000:00//0000:00:01.0/", gpu), 3);
    /* not a root: "pcide" (hex letters), a bus of 3 digits, a domain of 3 */
    assert_int_equal(kv__rd_pci_hops("/d/pcide/0000:00:01.0", "/d/pcide/0000:00:02.0"), -1);
    assert_int_equal(kv__rd_pci_hops("/d/pci0000:000/a", "/d/pci0000:000/b"), -1);
    assert_int_equal(kv__rd_pci_hops("/d/pci000:00/a", "/d/pci000:00/b"), -1);
    assert_int_equal(kv__rd_pci_hops("/d/pci10000:3a/a", "/d/pci10000:3a/b"), 2);
    /* random trees */
    uint64_t seed = 0x9e3779b97f4a7c15ull;
    for (int trial = 0; trial < 200; trial++) {
        struct pci_model t;
        const int roots = 1 + (int)(rng_next(&seed) % 3);
        for (int i = 0; i < MODEL_NODES; i++) {
            if (i < roots) {
                t.parent[i] = -1;
                t.root[i] = i;
                t.depth[i] = 0;
                snprintf(t.name[i], sizeof(t.name[i]), "pci%04x:%02x", i * 3, i * 0x40);
            } else {
                const int p = (int)(rng_next(&seed) % (uint64_t)i);
                t.parent[i] = p;
                t.root[i] = t.root[p];
                t.depth[i] = t.depth[p] + 1;
                snprintf(t.name[i], sizeof(t.name[i]), "%04x:%02x:%02x.%x", t.root[p] * 3, i,
                         i % 32, i % 8);
            }
        }
        char pa[2048], pb[2048];
        for (int k = 0; k < 50; k++) {
            const int a = (int)(rng_next(&seed) % MODEL_NODES);
            const int b = (int)(rng_next(&seed) % MODEL_NODES);
            model_path(&t, a, "/tmp/kvt_pci.x", pa, sizeof(pa));
            model_path(&t, b, "/tmp/kvt_pci.x", pb, sizeof(pb));
            if (kv__rd_pci_hops(pa, pb) != model_hops(&t, a, b))
                fail_msg("%s vs %s: %d hops, the model says %d", pa, pb, kv__rd_pci_hops(pa, pb),
                         model_hops(&t, a, b));
        }
    }
    /* bus ids as CUDA and lspci write them, normalised to sysfs names */
    static const struct {
        const char *in, *out; /* out NULL: refused */
    } ids[] = {
        {"00000000:0A:00.0", "0000:0a:00.0"},
        {"0000:0a:00.0", "0000:0a:00.0"},
        {"0000:3B:1F.7", "0000:3b:1f.7"},
        {"00010000:00:01.1", "10000:00:01.1"},
        {"0:3:0.0", "0000:03:00.0"},
        {"03:00.0", NULL},           /* no domain */
        {"000000000:03:00.0", NULL}, /* 9 domain digits */
        {"0000:003:00.0", NULL},
        {"0000:03:20.0", NULL}, /* device 32 */
        {"0000:03:00.8", NULL}, /* function 8 */
        {"0000:03:00.0 ", NULL},
        {"0000:03:00.0\n", NULL},
        {"0000:0g:00.0", NULL},
        {"0000:03-00.0", NULL},
        {"", NULL},
    };
    for (size_t i = 0; i < sizeof(ids) / sizeof(ids[0]); i++) {
        char out[24] = "junk";
        assert_int_equal(kv__rd_pci_busid_norm(ids[i].in, out, sizeof(out)), ids[i].out != NULL);
        assert_string_equal(out, ids[i].out ? ids[i].out : "");
    }
    char small[12] = "junk"; /* "0000:03:00.0" needs 13 */
    assert_false(kv__rd_pci_busid_norm("0000:03:00.0", small, sizeof(small)));
    assert_string_equal(small, "");
    assert_false(kv__rd_pci_busid_norm(NULL, small, sizeof(small)));
    /* the chooser with hops: fewest hops, then regions, then index; none
     * known: the NUMA rule as before; one rail: ONLY */
    kv_xport_mem_choice how;
    uint32_t spread = 0;
    const int nodes[4] = {0, 0, 1, 1};
    const int hops[4] = {-1, 6, 4, 4};
    const uint32_t load[4] = {0, 0, 2, 1}, even[4] = {0, 0, 1, 1};
    assert_int_equal(kv__rd_rail_choose(hops, nodes, load, 4, 0, &spread, &how), 3);
    assert_int_equal(how, KV_XPORT_CHOSEN_PCI);
    assert_int_equal(kv__rd_rail_choose(hops, nodes, even, 4, 0, &spread, &how), 2);
    const int far[4] = {-1, -1, -1, -1};
    assert_int_equal(kv__rd_rail_choose(far, nodes, load, 4, 1, &spread, &how), 3);
    assert_int_equal(how, KV_XPORT_CHOSEN_NUMA);
    assert_int_equal(kv__rd_rail_choose(far, nodes, load, 4, -1, &spread, &how), 0);
    assert_int_equal(how, KV_XPORT_CHOSEN_SPREAD);
    assert_int_equal(kv__rd_rail_choose(hops, nodes, load, 1, 0, &spread, &how), 0);
    assert_int_equal(how, KV_XPORT_CHOSEN_ONLY);
    assert_int_equal(spread, 1);
}

/* The fake PCI tree (sysfs as the kernel lays it out: class/infiniband/
 * <dev>/device and bus/pci/devices/<id> are relative links into
 * devices/):
 *
 *   pci0000:00 (node 0) - 00:01.0 - 01:00.0 (switch) -+- 02:00.0 - 0a:00.0 GPU0
 *               |                                     '- 02:01.0 - 04:00.0 kvt_r0 (A)
 *               +- 00:02.0 - 05:00.0 (switch) - 06:00.0 - 07:00.0 kvt_r1 (B)
 *               '- 00:1f.0 GPU1 (5 hops from A and from B)
 *   pci0000:40 (node 1) - 40:01.0 - 41:00.0 GPU2
 *   pci0000:80 (node 1) - 80:01.0 - 81:00.0 kvt_r2 (C)
 *
 * GPU0 - A: 4 hops, GPU0 - B: 8, GPU0 - C: another root complex. */
static char pciroot[64];
static const char *const PCI_DEVS[][3] = {
    /* path under devices/, its numa_node, and the link to it */
    {"pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:0a:00.0", "0",
     "bus/pci/devices/0000:0a:00.0"},
    {"pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0/0000:04:00.0", "0",
     "class/infiniband/kvt_r0/device"},
    {"pci0000:00/0000:00:02.0/0000:05:00.0/0000:06:00.0/0000:07:00.0", "0",
     "class/infiniband/kvt_r1/device"},
    {"pci0000:00/0000:00:1f.0", "0", "bus/pci/devices/0000:00:1f.0"},
    {"pci0000:40/0000:40:01.0/0000:41:00.0", "1", "bus/pci/devices/0000:41:00.0"},
    {"pci0000:80/0000:80:01.0/0000:81:00.0", "1", "class/infiniband/kvt_r2/device"},
};

/* mkdir -p of root/rel */
static void mkdirs(const char *root, const char *rel)
{
    char path[512];
    snprintf(path, sizeof(path), "%s/%s", root, rel);
    for (char *p = path + strlen(root) + 1; *p; p++)
        if (*p == '/') {
            *p = '\0';
            mkdir(path, 0700);
            *p = '/';
        }
    mkdir(path, 0700);
}

static void pci_tree(void)
{
    snprintf(pciroot, sizeof(pciroot), "/tmp/kvt_rails_pci.XXXXXX");
    assert_non_null(mkdtemp(pciroot));
    for (size_t i = 0; i < sizeof(PCI_DEVS) / sizeof(PCI_DEVS[0]); i++) {
        char rel[256], path[512], link[512], up[64] = "";
        snprintf(rel, sizeof(rel), "devices/%s", PCI_DEVS[i][0]);
        mkdirs(pciroot, rel);
        snprintf(path, sizeof(path), "%s/%s/numa_node", pciroot, rel);
        FILE *f = fopen(path, "w");
        assert_non_null(f);
        fprintf(f, "%s\n", PCI_DEVS[i][1]);
        fclose(f);
        const char *name = PCI_DEVS[i][2];
        snprintf(path, sizeof(path), "%s", name);
        *strrchr(path, '/') = '\0';
        mkdirs(pciroot, path);
        for (const char *p = name; *p; p++) /* "../" per directory above the link */
            if (*p == '/')
                strcat(up, "../");
        snprintf(link, sizeof(link), "%s%s", up, rel);
        snprintf(path, sizeof(path), "%s/%s", pciroot, name);
        assert_int_equal(symlink(link, path), 0);
    }
}

static void pci_tree_rm(void)
{
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", pciroot);
    assert_int_equal(system(cmd), 0);
}

/* The fake device memory: each pointer's GPU as CUDA names it (8-digit
 * domain, upper case), one not in sysfs, one CUDA does not know. */
static char gpu_mem[6][64];
static int fake_busid(const void *ptr, char *busid, size_t cap)
{
    static const char *const id[6] = {
        "00000000:0A:00.0", "00000000:00:1F.0", "00000000:41:00.0", "00000000:99:00.0", NULL, NULL};
    for (int i = 0; i < 6; i++)
        if (ptr == gpu_mem[i] && id[i]) {
            snprintf(busid, cap, "%s", id[i]);
            return 0;
        }
    return -1;
}

struct placed {
    uint32_t rail;
    kv_xport_mem_choice how;
    int numa, hops;
};

/* Place memory ptr of kind `kind` (kv__rd_region_place, what
 * kv_xport_mem_reg does; device memory is refused before it today),
 * keeping it in the rail's load or not. */
static struct placed place_kind(kv_xport *x, uint32_t device, enum kv_mem_kind kind,
                                const void *ptr, bool keep)
{
    struct rdma *r = x->be;
    struct rmr rm;
    memset(&rm, 0xa5, sizeof(rm));
    kv__rd_region_place(r, device, kind, ptr, 64, &rm);
    if (!keep) {
        pthread_mutex_lock(&x->mu);
        r->rail[rm.rail].regions--;
        pthread_mutex_unlock(&x->mu);
    }
    return (struct placed){rm.rail, rm.how, rm.numa, rm.pci_hops};
}

static struct placed place(kv_xport *x, uint32_t device, const void *ptr, bool keep)
{
    return place_kind(x, device, KV_MEM_DEVICE, ptr, keep);
}

static void placed_is(struct placed p, uint32_t rail, kv_xport_mem_choice how, int numa, int hops)
{
    assert_int_equal(p.rail, rail);
    assert_int_equal(p.how, how);
    assert_int_equal(p.numa, numa);
    assert_int_equal(p.hops, hops);
}

static void test_xport_rdma_rails_pci_choice(void **state)
{
    (void)state;
    pci_tree();
    const char *root0 = kv__rd_sysfs_root;
    int (*node0)(const void *, size_t) = kv__rd_mem_node;
    int (*busid0)(const void *, char *, size_t) = kv__rd_gpu_busid;
    kv__rd_sysfs_root = pciroot;
    kv__rd_mem_node = fake_node;
    kv__rd_gpu_busid = fake_busid;
    near0 = gpu_mem[4]; /* CUDA does not know it; "move_pages" says node 0 */
    near1 = NULL;
    struct kv_xport_config c = cfg_rails(false, RAILS3, 3);
    kv_xport *x = NULL;
    assert_int_equal(kv_xport_create(&c, &x), KV_OK);
    /* reported: each rail's PCI address and node */
    struct kv_xport_info in = KV_XPORT_INFO_INIT;
    assert_int_equal(kv_xport_info_get(x, &in), KV_OK);
    assert_string_equal(in.rdma_rail[0].pci_bus_id, "0000:04:00.0");
    assert_string_equal(in.rdma_rail[1].pci_bus_id, "0000:07:00.0");
    assert_string_equal(in.rdma_rail[2].pci_bus_id, "0000:81:00.0");
    assert_int_equal(in.rdma_rail[2].numa_node, 1);
    char line[2048];
    kv_xport_info_format(&in, line, sizeof(line));
    assert_non_null(strstr(line, "mtu 4096 numa 0 pci 0000:04:00.0; rail 1 device kvt_r1"));
    assert_non_null(strstr(line, "mtu 1024 numa 1 pci 0000:81:00.0"));
    /* GPU0: A, 4 hops, whatever the loads (B and C empty, A loaded) */
    placed_is(place(x, KV_XPORT_DEVICE_AUTO, gpu_mem[0], false), 0, KV_XPORT_CHOSEN_PCI, 0, 4);
    for (int k = 0; k < 3; k++)
        placed_is(place(x, KV_XPORT_DEVICE_AUTO, gpu_mem[0], true), 0, KV_XPORT_CHOSEN_PCI, 0, 4);
    /* GPU1: A and B 5 hops each: the fewer regions (B), then A and B in
     * turn once even (A holds 3) */
    placed_is(place(x, KV_XPORT_DEVICE_AUTO, gpu_mem[1], true), 1, KV_XPORT_CHOSEN_PCI, 0, 5);
    placed_is(place(x, KV_XPORT_DEVICE_AUTO, gpu_mem[1], true), 1, KV_XPORT_CHOSEN_PCI, 0, 5);
    placed_is(place(x, KV_XPORT_DEVICE_AUTO, gpu_mem[1], true), 1, KV_XPORT_CHOSEN_PCI, 0, 5);
    placed_is(place(x, KV_XPORT_DEVICE_AUTO, gpu_mem[1], true), 0, KV_XPORT_CHOSEN_PCI, 0, 5);
    placed_is(place(x, KV_XPORT_DEVICE_AUTO, gpu_mem[1], true), 1, KV_XPORT_CHOSEN_PCI, 0, 5);
    assert_int_equal(kv_xport_info_get(x, &in), KV_OK);
    assert_int_equal(in.rdma_rail[0].regions, 4);
    assert_int_equal(in.rdma_rail[1].regions, 4);
    /* GPU2: no rail under its root complex; C on its node beats A and B */
    placed_is(place(x, KV_XPORT_DEVICE_AUTO, gpu_mem[2], false), 2, KV_XPORT_CHOSEN_NUMA, 1, -1);
    /* the caller's choice: the distance of the rail it named */
    placed_is(place(x, 1, gpu_mem[0], false), 1, KV_XPORT_CHOSEN_CALLER, 0, 8);
    placed_is(place(x, 2, gpu_mem[0], false), 2, KV_XPORT_CHOSEN_CALLER, 0, -1);
    /* CUDA does not know the pointer: the memory's node (0: A and B, the
     * less loaded... both 4: A); a bus id sysfs lacks: round robin */
    struct rdma *r = x->be;
    const uint32_t spread = r->spread;
    placed_is(place(x, KV_XPORT_DEVICE_AUTO, gpu_mem[4], false), 0, KV_XPORT_CHOSEN_NUMA, 0, -1);
    placed_is(place(x, KV_XPORT_DEVICE_AUTO, gpu_mem[3], false), spread % 3, KV_XPORT_CHOSEN_SPREAD,
              -1, -1);
    placed_is(place(x, KV_XPORT_DEVICE_AUTO, gpu_mem[5], false), (spread + 1) % 3,
              KV_XPORT_CHOSEN_SPREAD, -1, -1);
    /* host or pinned memory is not asked about a GPU (the fake would name
     * one): its node (not known: round robin), no distance */
    placed_is(place_kind(x, KV_XPORT_DEVICE_AUTO, KV_MEM_PINNED, gpu_mem[0], false),
              (spread + 2) % 3, KV_XPORT_CHOSEN_SPREAD, -1, -1);
    placed_is(place_kind(x, KV_XPORT_DEVICE_AUTO, KV_MEM_HOST, gpu_mem[4], false), 0,
              KV_XPORT_CHOSEN_NUMA, 0, -1);
    kv_xport_mem *hm = NULL;
    assert_int_equal(kv_xport_mem_reg(x, gpu_mem[0], 64, KV_MEM_HOST, &hm), KV_OK);
    struct kv_xport_mem_info mi = KV_XPORT_MEM_INFO_INIT;
    assert_int_equal(kv_xport_mem_info_get(hm, &mi), KV_OK);
    assert_int_equal(mi.rdma_chosen, KV_XPORT_CHOSEN_SPREAD); /* fake_node: not known */
    assert_int_equal(mi.pci_distance, -1);
    assert_int_equal(kv_xport_mem_dereg(hm), KV_OK);
    /* device memory through the public call: still refused (no flush READ),
     * nothing counted */
    const uint32_t spread1 = r->spread;
    kv_xport_mem *dm = NULL;
    assert_int_equal(kv_xport_mem_reg(x, gpu_mem[0], 64, KV_MEM_DEVICE, &dm), KV_ERR_UNSUPPORTED);
    assert_null(dm);
    assert_int_equal(kv_xport_info_get(x, &in), KV_OK);
    assert_int_equal(in.rdma_rail[0].regions, 4);
    assert_int_equal(in.rdma_rail[1].regions, 4);
    assert_int_equal(in.rdma_rail[2].regions, 0);
    assert_int_equal(r->spread, spread1);
    pthread_mutex_lock(&x->mu); /* the kept placements out of the loads */
    r->rail[0].regions = r->rail[1].regions = 0;
    pthread_mutex_unlock(&x->mu);
    assert_int_equal(kv_xport_destroy(x), KV_OK);
    /* A's sysfs entry gone: GPU0 goes to B (8 hops), A reports no address */
    char path[256];
    snprintf(path, sizeof(path), "%s/class/infiniband/kvt_r0/device", pciroot);
    assert_int_equal(unlink(path), 0);
    assert_int_equal(kv_xport_create(&c, &x), KV_OK);
    assert_int_equal(kv_xport_info_get(x, &in), KV_OK);
    assert_string_equal(in.rdma_rail[0].pci_bus_id, "");
    assert_int_equal(in.rdma_rail[0].numa_node, -1);
    kv_xport_info_format(&in, line, sizeof(line));
    assert_non_null(strstr(line, "mtu 4096 numa -1; rail 1 device kvt_r1"));
    placed_is(place(x, KV_XPORT_DEVICE_AUTO, gpu_mem[0], false), 1, KV_XPORT_CHOSEN_PCI, 0, 8);
    assert_int_equal(kv_xport_destroy(x), KV_OK);
    /* one rail: ONLY, with its distance */
    c = cfg_rails(false, RAILS3 + 1, 1);
    assert_int_equal(kv_xport_create(&c, &x), KV_OK);
    placed_is(place(x, KV_XPORT_DEVICE_AUTO, gpu_mem[0], false), 0, KV_XPORT_CHOSEN_ONLY, 0, 8);
    assert_int_equal(kv_xport_destroy(x), KV_OK);
    kv__rd_sysfs_root = root0;
    kv__rd_mem_node = node0;
    kv__rd_gpu_busid = busid0;
    near0 = near1 = NULL;
    pci_tree_rm();
}

/* ---- a peer with fewer devices; config refusals ------------------------ */

static void create_refused(struct kv_xport_config c, kv_status st, const char *words)
{
    kv_xport *x = NULL;
    assert_int_equal(kv_xport_create(&c, &x), st);
    assert_null(x);
    kvt_assert_msg_has(words);
}

static void test_xport_rdma_rails_fewer_devices(void **state)
{
    (void)state;
    struct pair p; /* A: three rails, B: two */
    pair_open(&p, RAILS3, 3, RAILS2, 2);
    struct kv_xport_info ai = KV_XPORT_INFO_INIT, bi = KV_XPORT_INFO_INIT;
    assert_int_equal(kv_xport_peer_info_get(p.pa, &ai), KV_OK);
    assert_int_equal(kv_xport_peer_info_get(p.pb, &bi), KV_OK);
    assert_int_equal(ai.rdma_rails, 3);
    assert_int_equal(ai.rdma_peer_rails, 2);
    assert_int_equal(ai.rdma_qps, 4);
    assert_int_equal(ai.rdma_rail[1].qps, 2);
    assert_int_equal(ai.rdma_rail[2].qps, 0); /* kvt_r2: no peer rail, not connected */
    assert_int_equal(ai.rdma_rail[2].path_mtu, 0);
    assert_int_equal(bi.rdma_rails, 2);
    assert_int_equal(bi.rdma_peer_rails, 2);
    char line[2048];
    kv_xport_info_format(&ai, line, sizeof(line));
    assert_non_null(strstr(line, "rdma rails 3 (peer 2):"));
    assert_non_null(strstr(line, "; rail 2 device kvt_r2 port 1 ethernet"));
    assert_null(strstr(strstr(line, "; rail 2"), "| qps"));
    /* data on the common rails lands */
    struct rails_data w;
    data_open(&p, &w);
    struct kv_xport_io ios[2];
    for (uint32_t i = 0; i < 2; i++) {
        ios[i] = (struct kv_xport_io){.local = w.ms[i],
                                      .local_off = 4096 * (i + 1),
                                      .remote = w.r[i],
                                      .remote_off = 333 * (i + 1),
                                      .bytes = 50000};
        memcpy(w.want[i] + 333 * (i + 1), w.s[i].mem + 4096 * (i + 1), 50000);
    }
    kv_xport_xfer *x = NULL;
    assert_int_equal(kv_xport_write(p.pa, ios, 2, NULL, &x), KV_OK);
    assert_int_equal(finish(x), KV_XPORT_DONE);
    assert_int_equal(kv_xport_xfer_free(x), KV_OK);
    data_check(&w);
    /* a region on A's third rail has no peer region to meet; a blob that
     * claims the peer's rail 2 is refused as not connected */
    kv_xport_mem *m2 = NULL;
    assert_int_equal(kv_xport_mem_reg_on(p.a, w.s[0].mem, 4096, KV_MEM_HOST, 2, &m2), KV_OK);
    kv_xport_rmem forged = *w.r[0];
    kv__le_put(forged.key + 4, 2, 4);
    const struct kv_xport_io io2 = {
        .local = m2, .local_off = 0, .remote = &forged, .remote_off = 0, .bytes = 64};
    assert_int_equal(kv_xport_write(p.pa, &io2, 1, NULL, &x), KV_ERR_INVALID_ARG);
    kvt_assert_msg_has("is on rail 2 (kvt_r2), but peer");
    kvt_assert_msg_has("is connected on 2 rail(s)");
    kv__le_put(forged.key + 4, 9, 4); /* past any rail: the key fails its checks */
    assert_int_equal(kv_xport_write(p.pa, &io2, 1, NULL, &x), KV_ERR_CORRUPT);
    kvt_assert_msg_has("entry 0: the remote region's key fails its checks");
    assert_int_equal(kv_xport_mem_dereg(m2), KV_OK);
    data_check(&w);
    data_close(&p, &w);
    pair_close(&p);
    /* config refusals */
    struct kv_xport_config c = cfg_rails(false, RAILS3, 3);
    c.conns_per_peer = 6;
    create_refused(c, KV_ERR_INVALID_ARG, "3 rails of 6 QPs (conns_per_peer) per peer: 16 QPs");
    c = cfg_rails(false, RAILS2, 2);
    c.rdma_device = "kvt_r0";
    create_refused(c, KV_ERR_INVALID_ARG, "rdma_device \"kvt_r0\" and 2 rdma_devices");
    static const char *const twice[] = {"kvt_r1", "kvt_r0", "kvt_r1"};
    create_refused(cfg_rails(false, twice, 3), KV_ERR_INVALID_ARG,
                   "rdma_devices[2] \"kvt_r1\" repeats rdma_devices[0]");
    static const char *const unknown[] = {"kvt_r0", "kvt_nope"};
    create_refused(cfg_rails(false, unknown, 2), KV_ERR_NOT_FOUND,
                   "no RDMA device \"kvt_nope\" (softverbs lists: kvt_r0, kvt_r1, kvt_r2)");
    static const char *const holes[] = {"kvt_r0", NULL};
    create_refused(cfg_rails(false, holes, 2), KV_ERR_NULL, "rdma_devices[1] is NULL");
    create_refused(cfg_rails(false, NULL, 2), KV_ERR_NULL, "rdma_devices is NULL");
    create_refused(cfg_rails(false, RAILS2, 0), KV_ERR_INVALID_ARG,
                   "rdma_devices given with n_rdma_devices 0");
    static const char *const nine[9] = {"a", "b", "c", "d", "e", "f", "g", "h", "i"};
    c = cfg_rails(false, nine, 9);
    c.conns_per_peer = 1;
    create_refused(c, KV_ERR_INVALID_ARG, "9 rdma_devices (at most 8)");
}

/* ---- the model is strict ----------------------------------------------- */

static void test_xport_rdma_rails_device_mix_refused(void **state)
{
    (void)state;
    /* verbs objects of two devices do not mix */
    const struct kv__verbs *v = kvt_softverbs();
    int num = 0;
    struct ibv_device **list = v->get_device_list(&num);
    assert_int_equal(num, 3);
    struct ibv_context *c0 = v->open_device(list[0]), *c2 = v->open_device(list[2]);
    v->free_device_list(list);
    assert_non_null(c0);
    assert_non_null(c2);
    struct ibv_pd *pd2 = v->alloc_pd(c2);
    struct ibv_comp_channel *ch0 = v->create_comp_channel(c0);
    struct ibv_cq *cq0 = v->create_cq(c0, 16, NULL, NULL, 0);
    assert_non_null(pd2);
    assert_non_null(ch0);
    assert_non_null(cq0);
    struct ibv_qp_init_attr ia = {
        .send_cq = cq0,
        .recv_cq = cq0,
        .cap = {.max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1},
        .qp_type = IBV_QPT_RC};
    errno = 0;
    assert_null(v->create_qp(pd2, &ia)); /* kvt_r0's CQ on a kvt_r2 QP */
    assert_int_equal(errno, EINVAL);
    assert_null(v->create_cq(c2, 16, NULL, ch0, 0)); /* kvt_r0's channel, a kvt_r2 CQ */
    assert_int_equal(v->destroy_cq(cq0), 0);
    assert_int_equal(v->destroy_comp_channel(ch0), 0);
    assert_int_equal(v->dealloc_pd(pd2), 0);
    assert_int_equal(v->close_device(c0), 0);
    assert_int_equal(v->close_device(c2), 0);
    /* an rkey of B's rail-1 device presented to B's rail-0 device: the
     * blob's rail forged to 0, so our own check lets it through and the
     * responder refuses it (nothing written) */
    struct pair p;
    pair_open(&p, RAILS2, 2, RAILS2, 2);
    struct rails_data w;
    data_open(&p, &w);
    kv_xport_rmem forged = *w.r[1];
    kv__le_put(forged.key + 4, 0, 4);
    forged.users = 0;
    struct kv_xport_io io = {
        .local = w.ms[0], .local_off = 0, .remote = &forged, .remote_off = 0, .bytes = 4096};
    kv_xport_xfer *x = NULL;
    assert_int_equal(kv_xport_write(p.pa, &io, 1, NULL, &x), KV_OK);
    assert_int_equal(finish(x), KV_XPORT_FAILED);
    const kv_status *st = NULL;
    uint32_t ne = 0;
    assert_int_equal(kv_xport_xfer_results(x, &st, &ne), KV_OK);
    assert_int_equal(st[0], KV_ERR_OUT_OF_BOUNDS); /* REM_ACCESS_ERR */
    assert_int_equal(kv_xport_xfer_free(x), KV_OK);
    data_check(&w);
    pair_peers_close(&p);
    /* an lkey of A's rail-1 device on a rail-0 QP: the local region's rail
     * forged to 0; the requester's device refuses it (LOC_PROT_ERR) */
    p.pa = NULL;
    pair_connect(&p);
    for (uint32_t i = 0; i < 2; i++) { /* the old imports name the closed peer */
        assert_int_equal(kv_xport_rmem_free(w.r[i]), KV_OK);
        w.r[i] = share(&p, w.md[i]);
    }
    struct rmr *lm = w.ms[1]->be;
    lm->rail = 0;
    io = (struct kv_xport_io){
        .local = w.ms[1], .local_off = 0, .remote = w.r[0], .remote_off = 0, .bytes = 4096};
    assert_int_equal(kv_xport_write(p.pa, &io, 1, NULL, &x), KV_OK);
    assert_int_equal(finish(x), KV_XPORT_FAILED);
    assert_int_equal(kv_xport_xfer_results(x, &st, &ne), KV_OK);
    assert_int_equal(st[0], KV_ERR_INVALID_ARG); /* LOC_PROT_ERR */
    assert_int_equal(kv_xport_xfer_free(x), KV_OK);
    lm->rail = 1;
    data_check(&w);
    pair_peers_close(&p);
    data_close(&p, &w);
    pair_close(&p);
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    if (kvt_sv_set_devices(FABRIC, 3) != 0)
        return 2;
    kv__verbs_set(kvt_softverbs());
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_xport_rdma_rails_reported),
        cmocka_unit_test(test_xport_rdma_rails_data_both_rails),
        cmocka_unit_test(test_xport_rdma_rails_cross_rail_refused),
        cmocka_unit_test(test_xport_rdma_rails_auto_choice),
        cmocka_unit_test(test_xport_rdma_rails_pci_hops),
        cmocka_unit_test(test_xport_rdma_rails_pci_choice),
        cmocka_unit_test(test_xport_rdma_rails_fewer_devices),
        cmocka_unit_test(test_xport_rdma_rails_device_mix_refused),
    };
    return cmocka_run_group_tests_name("xport_rdma rails (two and three soft devices)", tests, NULL,
                                       NULL);
}
