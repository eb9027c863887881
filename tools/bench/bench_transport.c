/*
 * bench_transport.c - the TCP transport (connector/transport/kv_transport.h) between
 * two processes over loopback: a prefill parent and a decode child.
 *
 *   transport.tcp          a 4,096-token request of a Llama-3-8B-shaped
 *                          cache (32 layers, 8 KV heads, D 128, bf16,
 *                          layer-major, 16-token pages: 512 MiB of K and V,
 *                          16,384 runs of 32 KiB) written with
 *                          kv_xport_write_plan straight into the decode
 *                          cache's blocks (same layout, other block ids),
 *                          from post until decode has the notification;
 *   transport.tcp_convert  the same request into a decode cache of another
 *                          layout through kv_xport_write_plan alone (one
 *                          transfer, as an engine posts it): HND
 *                          block-major 32-token pages (256-byte runs on the
 *                          source side: sent gathered, see docs/connector.md
 *                          "Fragment-proof conversions"); and, where the
 *                          gather threshold lies, NHD block-major 1- and
 *                          8-token pages (4 and 16 KiB runs) and NHD
 *                          layer-major 32-token pages (32 KiB runs); timed
 *                          until decode has the notification.
 * Baselines, interleaved (A B A B ...): transport.tcp against a plain socket
 * stream of the same number of bytes over the same loopback between the
 * same two processes (one connection, blocking send of one contiguous
 * buffer, recv with MSG_WAITALL into another), timed until the receiver
 * reports; transport.tcp_convert against transport.tcp's same-layout write
 * of the same request between the same two processes (the ratio the issue
 * asks for: converted / same-layout). Both use the kernel's default socket
 * buffers. Each case runs with the default 2 connections per peer and with
 * 1 (as many streams as the stream baseline). KVB_GATHER_BELOW=n sets the
 * transports' plan_gather_below_bytes (1: never gather), how the threshold
 * was measured. After the last run decode sends the XXH3-64 of its whole
 * destination pool; prefill computes it from kv_plan_copy of the same
 * request into a pool of its own: a difference fails the case.
 * The software verbs device (tests) is not a benchmark: none is reported.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <xxhash.h>

#include "bench.h"
#include "bench_proc.h"
#include "kv_plan.h"
#include "kv_transport.h"

#define TOKEN 0xB3AC4ull

struct side {
    struct kv_layout lo;
    char *base;
    uint32_t *ids;
    uint32_t n;
};

/* Destination layouts: the same as the source, or a conversion target. */
enum target { T_SAME = 0, T_HND_BM32 = 1, T_NHD_LM32 = 2, T_NHD_BM1 = 3, T_NHD_BM8 = 4, T_N = 5 };

static kv_status side_make(struct side *s, int64_t N, kv_order order, kv_arrange arr, int64_t T,
                           uint64_t seed)
{
    struct kv_layout_config c;
    kv_layout_config_init(&c);
    c.num_layers = 32;
    c.block_tokens = N;
    c.num_heads = 8;
    c.head_dim = 128;
    c.dtype = KV_BF16;
    c.order = order;
    c.arrange = arr;
    s->n = (uint32_t)(T / N);
    c.num_blocks = 2 * (int64_t)s->n + 3;
    kv_status st = kv_layout_init(&c, &s->lo);
    if (st != KV_OK)
        return st;
    s->base = kvb_alloc((size_t)s->lo.total_bytes);
    s->ids = malloc(s->n * sizeof(*s->ids));
    if (!s->ids)
        return KV_ERR_NO_MEMORY;
    uint32_t *perm = malloc((size_t)c.num_blocks * sizeof(*perm));
    if (!perm)
        return KV_ERR_NO_MEMORY;
    kvb_shuffle_ids(perm, (uint32_t)c.num_blocks, (uint32_t)c.num_blocks, seed);
    for (uint32_t i = 0; i < s->n; i++)
        s->ids[i] = perm[i];
    free(perm);
    return KV_OK;
}

static kv_status target_make(struct side *s, enum target tg, int64_t T, uint64_t seed)
{
    switch (tg) {
    case T_HND_BM32:
        return side_make(s, 32, KV_ORDER_HND, KV_ARRANGE_BLOCK_MAJOR, T, seed);
    case T_NHD_LM32:
        return side_make(s, 32, KV_ORDER_NHD, KV_ARRANGE_LAYER_MAJOR, T, seed);
    case T_NHD_BM1:
        return side_make(s, 1, KV_ORDER_NHD, KV_ARRANGE_BLOCK_MAJOR, T, seed);
    case T_NHD_BM8:
        return side_make(s, 8, KV_ORDER_NHD, KV_ARRANGE_BLOCK_MAJOR, T, seed);
    case T_SAME:
    case T_N:
        break;
    }
    return side_make(s, 16, KV_ORDER_NHD, KV_ARRANGE_LAYER_MAJOR, T, seed);
}

static void side_free(struct side *s)
{
    kvb_free(s->base);
    free(s->ids);
}

static int send_all(int fd, const void *p, size_t n)
{
    const char *c = p;
    while (n) {
        ssize_t r = send(fd, c, n, MSG_NOSIGNAL);
        if (r <= 0) {
            if (r < 0 && errno == EINTR)
                continue;
            return -1;
        }
        c += r;
        n -= (size_t)r;
    }
    return 0;
}

static int recv_all(int fd, void *p, size_t n)
{
    char *c = p;
    while (n) {
        ssize_t r = recv(fd, c, n, MSG_WAITALL);
        if (r <= 0) {
            if (r < 0 && errno == EINTR)
                continue;
            return -1;
        }
        c += r;
        n -= (size_t)r;
    }
    return 0;
}

/* Commands from prefill to decode over the control socket. */
enum { CMD_STREAM = 'S', CMD_XPORT = 'T', CMD_HASH = 'H', CMD_QUIT = 'Q' };

struct setup {
    uint16_t xport_port, stream_port;
    uint32_t blob_len[2];
    unsigned char blob[2][KV_XPORT_BLOB_MAX];
};

/* The transports' config: KVB_GATHER_BELOW sets plan_gather_below_bytes. */
static struct kv_xport_config xport_config(uint32_t conns, bool listen)
{
    struct kv_xport_config xc = KV_XPORT_CONFIG_INIT;
    xc.kind = KV_XPORT_TCP;
    xc.listen_host = listen ? "127.0.0.1" : NULL;
    xc.conns_per_peer = conns;
    xc.token = TOKEN;
    xc.timeout_ms = 600000;
    xc.plan_gather_below_bytes = (uint32_t)kvb_env_long("KVB_GATHER_BELOW", 0, 0, UINT32_MAX);
    return xc;
}

/* Decode: the child. Holds the same-layout cache (dst 0) and, converting,
 * the target's (dst 1), both exposed; answers each transfer's
 * notification. Returns its exit status. */
static int decode_main(int ctl, enum target tg, uint32_t conns, int64_t T, uint64_t bytes)
{
    struct side d[2];
    memset(d, 0, sizeof(d));
    const uint32_t nd = tg == T_SAME ? 1 : 2;
    if (side_make(&d[0], 16, KV_ORDER_NHD, KV_ARRANGE_LAYER_MAJOR, T, 77) != KV_OK ||
        (nd == 2 && target_make(&d[1], tg, T, 78) != KV_OK))
        return 10;
    for (uint32_t i = 0; i < nd; i++)
        memset(d[i].base, 0, (size_t)d[i].lo.total_bytes);
    char *stage = kvb_alloc((size_t)bytes);
    const struct kv_xport_config xc = xport_config(conns, true);
    kv_xport *x = NULL;
    if (kv_xport_create(&xc, &x) != KV_OK)
        return 13;
    int ls = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t sl = sizeof(sa);
    if (bind(ls, (struct sockaddr *)&sa, sizeof(sa)) || listen(ls, 4) ||
        getsockname(ls, (struct sockaddr *)&sa, &sl))
        return 14;
    struct setup su = {.xport_port = kv_xport_port(x), .stream_port = ntohs(sa.sin_port)};
    if (send_all(ctl, &su, sizeof(su)))
        return 15;
    kv_xport_peer *peer = NULL;
    if (kv_xport_accept(x, 60000, &peer) != KV_OK)
        return 16;
    const int sfd = accept(ls, NULL, NULL);
    if (sfd < 0)
        return 17;
    kv_xport_mem *m[2] = {NULL, NULL};
    for (uint32_t i = 0; i < nd; i++) {
        size_t bl = 0;
        if (kv_xport_mem_reg(x, d[i].base, (size_t)d[i].lo.total_bytes, KV_MEM_HOST, &m[i]) !=
                KV_OK ||
            kv_xport_mem_expose(peer, m[i], su.blob[i], sizeof(su.blob[i]), &bl) != KV_OK)
            return 18;
        su.blob_len[i] = (uint32_t)bl;
    }
    if (send_all(ctl, &su, sizeof(su)))
        return 19;
    for (uint32_t i = 0; i < nd; i++)
        if (send_all(ctl, d[i].ids, d[i].n * sizeof(*d[i].ids)))
            return 19;
    struct kv_xport_msg *msg = malloc(sizeof(*msg));
    int rc = 0;
    for (;;) {
        char cmd;
        if (recv_all(ctl, &cmd, 1))
            return 20;
        if (cmd == CMD_QUIT)
            break;
        if (cmd == CMD_STREAM) {
            if (recv_all(sfd, stage, (size_t)bytes))
                return 21;
        } else if (cmd == CMD_XPORT) {
            if (kv_xport_notify_poll(x, 600000, msg) != KV_OK)
                return 22;
        } else if (cmd == CMD_HASH) {
            uint64_t h[2] = {0, 0};
            for (uint32_t i = 0; i < nd; i++)
                h[i] = XXH3_64bits(d[i].base, (size_t)d[i].lo.total_bytes);
            if (send_all(ctl, h, sizeof(h)))
                return 24;
            continue;
        }
        if (send_all(ctl, "k", 1))
            return 25;
    }
    free(msg);
    close(sfd);
    close(ls);
    kv_xport_peer_close(peer);
    for (uint32_t i = 0; i < nd; i++)
        if (kv_xport_mem_dereg(m[i]) != KV_OK)
            rc = 26;
    if (kv_xport_destroy(x) != KV_OK)
        rc = 27;
    kvb_free(stage);
    for (uint32_t i = 0; i < nd; i++)
        side_free(&d[i]);
    return rc;
}

/* One transfer of the whole request through plan, timed from post until
 * decode has its notification. <0: failed. */
static double xport_once(int ctl, kv_xport_peer *peer, const kv_plan *plan, kv_xport_mem *m,
                         const struct side *s, kv_xport_rmem *r, const struct side *d, uint64_t T,
                         uint64_t tag)
{
    char k;
    kv_xport_xfer *t = NULL;
    kv_xport_state state;
    struct kv_xport_notify n = {.tag = tag};
    if (send_all(ctl, (char[]){CMD_XPORT}, 1))
        return -1;
    const double t0 = kvb_now();
    if (kv_xport_write_plan(peer, plan, m, 0, s->ids, s->n, r, 0, d->ids, d->n, T, &n, &t) != KV_OK)
        return -1;
    if (recv_all(ctl, &k, 1))
        return -1;
    const double t1 = kvb_now();
    if (kv_xport_xfer_wait(t, 600000, &state) != KV_OK || state != KV_XPORT_DONE ||
        kv_xport_xfer_free(t) != KV_OK)
        return -1;
    return t1 - t0;
}

/* Decode's pool i (hash got) against kv_plan_copy of the request here. */
static bool pool_ok(const struct side *s, struct side *d, uint64_t got)
{
    const uint64_t T = (uint64_t)s->n * (uint64_t)s->lo.block_tokens;
    return kvb_pool_hash_ok(NULL, &s->lo, s->base, s->ids, s->n, &d->lo, d->base, d->ids, d->n, T,
                            got);
}

static void transport_case(enum target tg, uint32_t conns)
{
    const bool convert = tg != T_SAME;
    const char *bench = convert ? "transport.tcp_convert" : "transport.tcp";
    static const char *const names[T_N] = {
        "llama3_8b_T4096_nhd_lm_N16", "llama3_8b_T4096_nhd_lm_N16_to_hnd_bm_N32",
        "llama3_8b_T4096_nhd_lm_N16_to_nhd_lm_N32", "llama3_8b_T4096_nhd_lm_N16_to_nhd_bm_N1",
        "llama3_8b_T4096_nhd_lm_N16_to_nhd_bm_N8"};
    char name[96];
    snprintf(name, sizeof(name), "%s_conns%u", names[tg], conns);
    if (!kvb_selected(bench, name))
        return;
    kvb_progress("transport", name);
    const int64_t T = kvb_quick() ? 1024 : 4096;
    struct side s;
    if (side_make(&s, 16, KV_ORDER_NHD, KV_ARRANGE_LAYER_MAJOR, T, 31) != KV_OK) {
        kvb_failed(bench, name, "setup: %s", kv_last_error());
        return;
    }
    kvb_fill_random(s.base, (size_t)s.lo.total_bytes, 9);
    const uint64_t bytes = (uint64_t)s.n * 64ull * (uint64_t)s.lo.block_bytes;
    /* Decode runs in a fresh image of this program (kvb_spawn_self). */
    char args[80];
    snprintf(args, sizeof(args), "%d,%u,%lld,%llu", (int)tg, conns, (long long)T,
             (unsigned long long)bytes);
    int ctl = -1;
    const pid_t pid = kvb_spawn_self("KVB_TRANSPORT_DECODE", args, &ctl);
    if (pid < 0) {
        kvb_failed(bench, name, "socketpair");
        side_free(&s);
        return;
    }
    const uint32_t nd = convert ? 2 : 1;
    kv_xport *x = NULL;
    kv_xport_peer *peer = NULL;
    kv_xport_mem *m = NULL;
    kv_xport_rmem *r[2] = {NULL, NULL};
    kv_plan *plan[2] = {NULL, NULL};
    const char *fail = NULL;
    struct setup su;
    struct side d[2];
    memset(d, 0, sizeof(d));
    int sfd = -1;
    double *ts = calloc((size_t)kvb_runs(), sizeof(double));
    double *bs = calloc((size_t)kvb_runs(), sizeof(double));
    const struct kv_xport_config xc = xport_config(conns, false);
    if (recv_all(ctl, &su, sizeof(su)) || kv_xport_create(&xc, &x) != KV_OK ||
        kv_xport_connect(x, "127.0.0.1", su.xport_port, &peer) != KV_OK ||
        kv_xport_peer_wait(peer, 60000, NULL) != KV_OK) {
        fail = "connect";
        goto out;
    }
    sfd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET,
                             .sin_port = htons(su.stream_port),
                             .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (connect(sfd, (struct sockaddr *)&sa, sizeof(sa))) {
        fail = "stream connect";
        goto out;
    }
    /* decode's layouts as it would describe them in a placement message */
    if (side_make(&d[0], 16, KV_ORDER_NHD, KV_ARRANGE_LAYER_MAJOR, T, 77) != KV_OK ||
        (convert && target_make(&d[1], tg, T, 78) != KV_OK)) {
        fail = "decode layout";
        goto out;
    }
    if (recv_all(ctl, &su, sizeof(su))) {
        fail = "setup from decode";
        goto out;
    }
    for (uint32_t i = 0; i < nd; i++)
        if (recv_all(ctl, d[i].ids, d[i].n * sizeof(*d[i].ids))) {
            fail = "setup from decode";
            goto out;
        }
    if (kv_xport_mem_reg(x, s.base, (size_t)s.lo.total_bytes, KV_MEM_HOST, &m) != KV_OK) {
        fail = "register";
        goto out;
    }
    for (uint32_t i = 0; i < nd; i++)
        if (kv_xport_rmem_import(peer, su.blob[i], su.blob_len[i], &r[i]) != KV_OK ||
            kv_plan_create(&s.lo, &d[i].lo, NULL, &plan[i]) != KV_OK) {
            fail = "import/plan";
            goto out;
        }
    struct kv_xport_stats st0 = KV_XPORT_STATS_INIT, st1 = KV_XPORT_STATS_INIT;
    if (kv_xport_stats_get(x, &st0) != KV_OK) {
        fail = "stats";
        goto out;
    }
    const int runs = kvb_runs();
    for (int i = 0; i < runs; i++) {
        char k;
        if (!convert) { /* A: the socket stream */
            const double t0 = kvb_now();
            if (send_all(ctl, (char[]){CMD_STREAM}, 1) || send_all(sfd, s.base, (size_t)bytes) ||
                recv_all(ctl, &k, 1)) {
                fail = "stream";
                goto out;
            }
            bs[i] = kvb_now() - t0;
        } else { /* A: the same-layout write */
            bs[i] = xport_once(ctl, peer, plan[0], m, &s, r[0], &d[0], (uint64_t)T, 2u * i);
        }
        /* B: the candidate */
        ts[i] = xport_once(ctl, peer, plan[nd - 1], m, &s, r[nd - 1], &d[nd - 1], (uint64_t)T,
                           2u * i + 1);
        if (bs[i] < 0 || ts[i] < 0) {
            fail = "transfer";
            goto out;
        }
    }
    if (kv_xport_stats_get(x, &st1) != KV_OK) {
        fail = "stats";
        goto out;
    }
    /* The check: decode's whole pools against kv_plan_copy here. */
    {
        uint64_t got[2];
        if (send_all(ctl, (char[]){CMD_HASH}, 1) || recv_all(ctl, got, sizeof(got))) {
            fail = "hash";
            goto out;
        }
        bool ok = true;
        for (uint32_t i = 0; i < nd; i++)
            ok = ok && pool_ok(&s, &d[i], got[i]);
        const uint64_t gathered = st1.plans_gathered - st0.plans_gathered;
        if (!ok)
            kvb_mismatch(bench, name, "a decode pool's XXH3 differs from kv_plan_copy's");
        else if (convert && tg == T_HND_BM32 && xc.plan_gather_below_bytes == 0 &&
                 gathered < (uint64_t)runs)
            kvb_mismatch(bench, name,
                         "%llu writes gathered for %d converted ones (want all of them)",
                         (unsigned long long)gathered, runs);
        else
            kvb_emit_gbps(bench, name, bytes, kvb_median(ts, runs),
                          convert ? "transport_tcp_same_layout" : "socket_stream",
                          kvb_median(bs, runs), runs);
    }
out:
    if (fail)
        kvb_failed(bench, name, "%s: %s", fail, kv_last_error());
    (void)send_all(ctl, (char[]){CMD_QUIT}, 1);
    kvb_reap(pid, fail != NULL, bench, name);
    if (sfd >= 0)
        close(sfd);
    close(ctl);
    for (uint32_t i = 0; i < 2; i++) {
        kv_plan_destroy(plan[i]);
        if (kv_xport_rmem_free(r[i]) != KV_OK)
            kvb_failed(bench, name, "rmem_free: %s", kv_last_error());
    }
    kv_xport_peer_close(peer);
    if (m && kv_xport_mem_dereg(m) != KV_OK)
        kvb_failed(bench, name, "dereg: %s", kv_last_error());
    if (kv_xport_destroy(x) != KV_OK)
        kvb_failed(bench, name, "destroy: %s", kv_last_error());
    free(ts);
    free(bs);
    for (uint32_t i = 0; i < 2; i++)
        if (d[i].base)
            side_free(&d[i]);
    side_free(&s);
}

/* The decode process: this program started again with
 * KVB_TRANSPORT_DECODE=fd,target,conns,T,bytes runs decode_main before main. */
__attribute__((constructor)) static void transport_decode_entry(void)
{
    const char *e = getenv("KVB_TRANSPORT_DECODE");
    if (!e)
        return;
    int fd = -1, tg = 0;
    unsigned conns = 0;
    long long T = 0;
    unsigned long long bytes = 0;
    if (sscanf(e, "%d,%d,%u,%lld,%llu", &fd, &tg, &conns, &T, &bytes) != 5 || tg < 0 || tg >= T_N)
        _exit(2);
    signal(SIGPIPE, SIG_IGN);
    _exit(decode_main(fd, (enum target)tg, conns, (int64_t)T, (uint64_t)bytes));
}

static void transport_suite(void)
{
    signal(SIGPIPE, SIG_IGN);
    /* The default (2 connections per peer), and 1: as many streams as the
     * stream baseline. */
    transport_case(T_SAME, 2);
    transport_case(T_SAME, 1);
    transport_case(T_HND_BM32, 2);
    transport_case(T_HND_BM32, 1);
    /* where the threshold lies: runs of 4 KiB (to 1-token pages, block-
     * major), 16 KiB (8-token pages) and 32 KiB (32-token pages, layer-
     * major), each merged on the destination side when gathered */
    transport_case(T_NHD_BM1, 2);
    transport_case(T_NHD_BM8, 2);
    transport_case(T_NHD_LM32, 2);
}

KVB_REGISTER("transport", transport_suite)
