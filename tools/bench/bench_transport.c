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
 *                          layout (HND, block-major, 32-token pages):
 *                          prefill writes its blocks compact into a staging
 *                          region as 8 transfers of 512 tokens with a
 *                          notification each, decode converts each slice
 *                          with kv_plan_copy when its notification comes
 *                          (while the next slices travel); timed until
 *                          decode has converted the last.
 * Baseline, interleaved: a plain socket stream of the same number of bytes
 * over the same loopback between the same two processes (one connection,
 * blocking send of one contiguous buffer, recv with MSG_WAITALL into
 * another), also timed until the receiver reports. Both transports use
 * the kernel's default socket buffers. Each case runs with the default 2
 * connections per peer and with 1 (as many streams as the baseline).
 * After the last run decode sends the XXH3-64 of its whole destination
 * pool; prefill computes it from kv_plan_copy of the same request into a
 * pool of its own: a difference fails the case.
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
#include "kv_plan.h"
#include "kv_transport.h"

#define TOKEN 0xB3AC4ull

struct side {
    struct kv_layout lo;
    char *base;
    uint32_t *ids;
    uint32_t n;
};

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

static void side_free(struct side *s)
{
    kvb_free(s->base);
    free(s->ids);
}

/* The compact staging layout of src's blocks (src's block format, K|V
 * packing included; block-major, unpadded). */
static kv_status staging_layout(const struct kv_layout *src, uint32_t n, struct kv_layout *out)
{
    struct kv_layout_config c;
    kv_status st = kv_layout_config_from(src, &c);
    if (st != KV_OK)
        return st;
    c.arrange = KV_ARRANGE_BLOCK_MAJOR;
    c.num_blocks = n;
    c.block_pad_elems = 0;
    c.block_stride_bytes = 0;
    c.align_bytes = 0;
    return kv_layout_init(&c, out);
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

/* transport.tcp_convert sends a request as SLICES transfers with a
 * notification each, so decode converts slice j while j + 1.. travel. */
#define SLICES 8u

struct setup {
    uint16_t xport_port, stream_port;
    uint32_t blob_len;
    unsigned char blob[KV_XPORT_BLOB_MAX];
};

/* Decode: the child. Returns its exit status. */
static int decode_main(int ctl, bool convert, uint32_t conns, int64_t T, uint64_t bytes)
{
    struct side d;
    const kv_status st0 = convert ? side_make(&d, 32, KV_ORDER_HND, KV_ARRANGE_BLOCK_MAJOR, T, 77)
                                  : side_make(&d, 16, KV_ORDER_NHD, KV_ARRANGE_LAYER_MAJOR, T, 77);
    if (st0 != KV_OK)
        return 10;
    memset(d.base, 0, (size_t)d.lo.total_bytes);
    struct kv_layout src_lo, stg_lo;
    struct side s_shape;
    memset(&s_shape, 0, sizeof(s_shape));
    struct kv_layout_config c;
    kv_layout_config_init(&c);
    c.num_layers = 32;
    c.block_tokens = 16;
    c.num_heads = 8;
    c.head_dim = 128;
    c.dtype = KV_BF16;
    c.num_blocks = 1;
    if (kv_layout_init(&c, &src_lo) != KV_OK ||
        staging_layout(&src_lo, (uint32_t)(T / 16), &stg_lo) != KV_OK)
        return 11;
    char *stage =
        kvb_alloc((size_t)stg_lo.total_bytes > bytes ? (size_t)stg_lo.total_bytes : (size_t)bytes);
    kv_plan *conv = NULL;
    if (convert && kv_plan_create(&stg_lo, &d.lo, NULL, &conv) != KV_OK)
        return 12;
    uint32_t *stg_ids = malloc((size_t)(T / 16) * sizeof(*stg_ids));
    for (uint32_t i = 0; i < (uint32_t)(T / 16); i++)
        stg_ids[i] = i;

    struct kv_xport_config xc = KV_XPORT_CONFIG_INIT;
    xc.kind = KV_XPORT_TCP;
    xc.listen_host = "127.0.0.1";
    xc.conns_per_peer = conns;
    xc.token = TOKEN;
    xc.timeout_ms = 600000;
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
    kv_xport_mem *m = NULL;
    char *region = convert ? stage : d.base;
    const size_t rbytes = convert ? (size_t)stg_lo.total_bytes : (size_t)d.lo.total_bytes;
    size_t bl = 0;
    if (kv_xport_mem_reg(x, region, rbytes, KV_MEM_HOST, &m) != KV_OK ||
        kv_xport_mem_expose(peer, m, su.blob, sizeof(su.blob), &bl) != KV_OK)
        return 18;
    su.blob_len = (uint32_t)bl;
    if (send_all(ctl, &su, sizeof(su)) || send_all(ctl, d.ids, d.n * sizeof(*d.ids)))
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
            /* convert: SLICES notifications, each slice converted as soon
             * as its notification says it landed (while the next ones are
             * still on the wire). */
            for (uint32_t j = 0; j < (convert ? SLICES : 1); j++) {
                if (kv_xport_notify_poll(x, 600000, msg) != KV_OK)
                    return 22;
                if (!convert)
                    break;
                const uint32_t sj = (uint32_t)msg->tag % SLICES;
                const uint64_t tok = (uint64_t)T / SLICES;
                struct kv_paged_cache s = {
                    .layout = stg_lo, .base = stage, .storage_bytes = (size_t)stg_lo.total_bytes};
                struct kv_paged_cache dd = {
                    .layout = d.lo, .base = d.base, .storage_bytes = (size_t)d.lo.total_bytes};
                if (kv_plan_copy(conv, s, stg_ids + sj * (tok / 16), (uint32_t)(tok / 16), dd,
                                 d.ids + sj * (tok / 32), (uint32_t)(tok / 32), tok) != KV_OK)
                    return 23;
            }
        } else if (cmd == CMD_HASH) {
            const uint64_t h = XXH3_64bits(d.base, (size_t)d.lo.total_bytes);
            if (send_all(ctl, &h, sizeof(h)))
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
    if (kv_xport_mem_dereg(m) != KV_OK)
        rc = 26;
    if (kv_xport_destroy(x) != KV_OK)
        rc = 27;
    kv_plan_destroy(conv);
    kvb_free(stage);
    free(stg_ids);
    side_free(&d);
    return rc;
}

static void transport_case(bool convert, uint32_t conns)
{
    const char *bench = convert ? "transport.tcp_convert" : "transport.tcp";
    char name[96];
    snprintf(name, sizeof(name), "%s_conns%u",
             convert ? "llama3_8b_T4096_nhd_lm_N16_to_hnd_bm_N32" : "llama3_8b_T4096_nhd_lm_N16",
             conns);
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
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv)) {
        kvb_failed(bench, name, "socketpair");
        side_free(&s);
        return;
    }
    /* Decode runs in a fresh image of this program (fork + exec): a forked
     * child of a process that ran OpenMP cannot use OpenMP (libgomp's pool
     * does not survive fork), and decode converts with it. */
    fflush(NULL);
    char env[96];
    snprintf(env, sizeof(env), "KVB_TRANSPORT_DECODE=%d,%d,%u,%lld,%llu", sv[1], convert ? 1 : 0,
             conns, (long long)T, (unsigned long long)bytes);
    const pid_t pid = fork();
    if (pid == 0) {
        close(sv[0]);
        putenv(env);
        execl("/proc/self/exe", "kvbench", (char *)NULL);
        _exit(127);
    }
    close(sv[1]);
    const int ctl = sv[0];
    kv_xport *x = NULL;
    kv_xport_peer *peer = NULL;
    kv_xport_mem *m = NULL;
    kv_xport_rmem *r = NULL;
    kv_plan *plan = NULL;
    const char *fail = NULL;
    struct setup su;
    struct side d = {0};
    struct kv_layout stg_lo;
    uint32_t *stg_ids = NULL;
    int sfd = -1;
    double *ts = calloc((size_t)kvb_runs(), sizeof(double));
    double *bs = calloc((size_t)kvb_runs(), sizeof(double));
    struct kv_xport_config xc = KV_XPORT_CONFIG_INIT;
    xc.kind = KV_XPORT_TCP;
    xc.token = TOKEN;
    xc.conns_per_peer = conns;
    xc.timeout_ms = 600000;
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
    /* decode's layout as it would describe it in a placement message */
    if (convert ? side_make(&d, 32, KV_ORDER_HND, KV_ARRANGE_BLOCK_MAJOR, T, 77)
                : side_make(&d, 16, KV_ORDER_NHD, KV_ARRANGE_LAYER_MAJOR, T, 77)) {
        fail = "decode layout";
        goto out;
    }
    if (recv_all(ctl, &su, sizeof(su)) || recv_all(ctl, d.ids, d.n * sizeof(*d.ids))) {
        fail = "setup from decode";
        goto out;
    }
    if (kv_xport_mem_reg(x, s.base, (size_t)s.lo.total_bytes, KV_MEM_HOST, &m) != KV_OK ||
        kv_xport_rmem_import(peer, su.blob, su.blob_len, &r) != KV_OK) {
        fail = "register/import";
        goto out;
    }
    const struct kv_layout *dst_lo = &d.lo;
    const uint32_t *dst_ids = d.ids;
    if (convert) {
        if (staging_layout(&s.lo, s.n, &stg_lo) != KV_OK) {
            fail = "staging layout";
            goto out;
        }
        stg_ids = malloc(s.n * sizeof(*stg_ids));
        for (uint32_t i = 0; i < s.n; i++)
            stg_ids[i] = i;
        dst_lo = &stg_lo;
        dst_ids = stg_ids;
    }
    if (kv_plan_create(&s.lo, dst_lo, NULL, &plan) != KV_OK) {
        fail = "plan";
        goto out;
    }
    const int runs = kvb_runs();
    for (int i = 0; i < runs; i++) {
        char k;
        double t0 = kvb_now();
        if (send_all(ctl, (char[]){CMD_STREAM}, 1) || send_all(sfd, s.base, (size_t)bytes) ||
            recv_all(ctl, &k, 1)) {
            fail = "stream";
            goto out;
        }
        double t1 = kvb_now();
        const uint32_t S = convert ? SLICES : 1, per = s.n / S;
        kv_xport_xfer *t[SLICES] = {0};
        kv_xport_state state;
        if (send_all(ctl, (char[]){CMD_XPORT}, 1)) {
            fail = "control";
            goto out;
        }
        for (uint32_t j = 0; j < S; j++) {
            struct kv_xport_notify n = {.tag = (uint64_t)i * SLICES + j};
            if (kv_xport_write_plan(peer, plan, m, 0, s.ids + j * per, per, r, 0, dst_ids + j * per,
                                    per, (uint64_t)per * 16, &n, &t[j]) != KV_OK) {
                fail = "post";
                goto out;
            }
        }
        if (recv_all(ctl, &k, 1)) {
            fail = "transfer";
            goto out;
        }
        double t2 = kvb_now();
        for (uint32_t j = 0; j < S; j++)
            if (kv_xport_xfer_wait(t[j], 600000, &state) != KV_OK || state != KV_XPORT_DONE ||
                kv_xport_xfer_free(t[j]) != KV_OK) {
                fail = "transfer";
                goto out;
            }
        bs[i] = t1 - t0;
        ts[i] = t2 - t1;
    }
    /* The check: decode's whole pool against kv_plan_copy here. */
    {
        uint64_t got = 0;
        if (send_all(ctl, (char[]){CMD_HASH}, 1) || recv_all(ctl, &got, sizeof(got))) {
            fail = "hash";
            goto out;
        }
        kv_plan *ref = NULL;
        memset(d.base, 0, (size_t)d.lo.total_bytes);
        struct kv_paged_cache sc = {
            .layout = s.lo, .base = s.base, .storage_bytes = (size_t)s.lo.total_bytes};
        struct kv_paged_cache dc = {
            .layout = d.lo, .base = d.base, .storage_bytes = (size_t)d.lo.total_bytes};
        if (kv_plan_create(&s.lo, &d.lo, NULL, &ref) != KV_OK ||
            kv_plan_copy(ref, sc, s.ids, s.n, dc, d.ids, d.n, (uint64_t)T) != KV_OK) {
            kv_plan_destroy(ref);
            fail = "reference";
            goto out;
        }
        kv_plan_destroy(ref);
        const uint64_t want = XXH3_64bits(d.base, (size_t)d.lo.total_bytes);
        if (got != want)
            kvb_mismatch(bench, name, "decode pool XXH3 %016llx, reference %016llx",
                         (unsigned long long)got, (unsigned long long)want);
        else
            kvb_emit_gbps(bench, name, bytes, kvb_median(ts, runs), "socket_stream",
                          kvb_median(bs, runs), runs);
    }
out:
    if (fail)
        kvb_failed(bench, name, "%s: %s", fail, kv_last_error());
    (void)send_all(ctl, (char[]){CMD_QUIT}, 1);
    int wst = 0;
    if (fail)
        kill(pid, SIGKILL);
    waitpid(pid, &wst, 0);
    if (!fail && (!WIFEXITED(wst) || WEXITSTATUS(wst) != 0))
        kvb_failed(bench, name, "decode process exit status %d", WEXITSTATUS(wst));
    if (sfd >= 0)
        close(sfd);
    close(ctl);
    kv_plan_destroy(plan);
    if (kv_xport_rmem_free(r) != KV_OK)
        kvb_failed(bench, name, "rmem_free: %s", kv_last_error());
    kv_xport_peer_close(peer);
    if (m && kv_xport_mem_dereg(m) != KV_OK)
        kvb_failed(bench, name, "dereg: %s", kv_last_error());
    if (kv_xport_destroy(x) != KV_OK)
        kvb_failed(bench, name, "destroy: %s", kv_last_error());
    free(stg_ids);
    free(ts);
    free(bs);
    if (d.base)
        side_free(&d);
    side_free(&s);
}

/* The decode process: this program started again with
 * KVB_TRANSPORT_DECODE=fd,convert,T,bytes runs decode_main before main. */
__attribute__((constructor)) static void transport_decode_entry(void)
{
    const char *e = getenv("KVB_TRANSPORT_DECODE");
    if (!e)
        return;
    int fd = -1, conv = 0;
    unsigned conns = 0;
    long long T = 0;
    unsigned long long bytes = 0;
    if (sscanf(e, "%d,%d,%u,%lld,%llu", &fd, &conv, &conns, &T, &bytes) != 5)
        _exit(2);
    signal(SIGPIPE, SIG_IGN);
    _exit(decode_main(fd, conv != 0, conns, (int64_t)T, (uint64_t)bytes));
}

static void transport_suite(void)
{
    signal(SIGPIPE, SIG_IGN);
    /* The default (2 connections per peer), and 1: as many streams as the
     * baseline. */
    transport_case(false, 2);
    transport_case(false, 1);
    transport_case(true, 2);
    transport_case(true, 1);
}

KVB_REGISTER("transport", transport_suite)
