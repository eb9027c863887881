/*
 * bench_shm.c - the same-host transport (KV_XPORT_SHM, kv_transport.h)
 * between two processes: a prefill parent and a decode child.
 *
 *   transport.shm  a 4,096-token request of a Llama-3-8B-shaped cache (32
 *                  layers, 8 KV heads, D 128, bf16, NHD layer-major,
 *                  16-token pages: 512 MiB of K and V, 16,384 runs of 32
 *                  KiB; --quick: 1,024 tokens) written with
 *                  kv_xport_write_plan straight into the decode cache's
 *                  blocks (same layout, other block ids, shuffled), timed
 *                  from post until decode has the notification.
 * Baseline, interleaved (A B A B ...): one single-thread memcpy of the
 * same number of bytes between two buffers of the prefill process (both
 * touched before timing). The transport makes two copies of every byte
 * (into a ring slot, out of it), on two cores in parallel; the goal is >=
 * 0.5x. After the last run decode sends the XXH3-64 of its whole
 * destination pool; prefill computes it from kv_plan_copy of the same
 * request into a pool of its own: a difference fails the case.
 */
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

#define TOKEN 0x5B3ull

enum { SHM_CMD_XPORT = 'x', SHM_CMD_HASH = 'h', SHM_CMD_QUIT = 'q' };

struct shm_side {
    struct kv_layout lo;
    char *base;
    uint32_t *ids;
    uint32_t n;
};

struct shm_setup {
    uint16_t port;
    uint32_t blob_len;
    unsigned char blob[KV_XPORT_BLOB_MAX];
};

/* A Llama-3-8B-shaped cache holding T tokens in ceil(T / 16) of 2T/16
 * blocks, ids shuffled by seed. */
static kv_status shm_side_make(struct shm_side *s, int64_t T, uint64_t seed)
{
    struct kv_layout_config c;
    kv_layout_config_init(&c);
    c.num_layers = 32;
    c.block_tokens = 16;
    c.num_heads = 8;
    c.head_dim = 128;
    c.dtype = KV_BF16;
    c.num_blocks = 2 * ((T + 15) / 16);
    kv_status st = kv_layout_init(&c, &s->lo);
    if (st != KV_OK)
        return st;
    s->n = (uint32_t)((T + 15) / 16);
    s->base = kvb_alloc((size_t)s->lo.total_bytes);
    s->ids = malloc((size_t)c.num_blocks * sizeof(*s->ids));
    if (!s->base || !s->ids)
        return KV_ERR_NO_MEMORY;
    kvb_shuffle_ids(s->ids, (uint32_t)c.num_blocks, (uint32_t)c.num_blocks, seed);
    return KV_OK;
}

static void shm_side_free(struct shm_side *s)
{
    kvb_free(s->base);
    free(s->ids);
}

static int shm_io(int fd, void *p, size_t n, bool out)
{
    char *c = p;
    while (n) {
        const ssize_t r = out ? write(fd, c, n) : read(fd, c, n);
        if (r <= 0)
            return -1;
        c += r;
        n -= (size_t)r;
    }
    return 0;
}

static struct kv_xport_config shm_config(bool listen)
{
    struct kv_xport_config xc = KV_XPORT_CONFIG_INIT;
    xc.kind = KV_XPORT_SHM;
    xc.listen_host = listen ? "kvbench" : NULL;
    xc.token = TOKEN;
    xc.timeout_ms = 600000;
    return xc;
}

/* Decode: the child. Exposes its cache, answers each notification. */
static int shm_decode_main(int ctl, int64_t T)
{
    struct shm_side d;
    memset(&d, 0, sizeof(d));
    if (shm_side_make(&d, T, 77) != KV_OK)
        return 10;
    memset(d.base, 0, (size_t)d.lo.total_bytes);
    const struct kv_xport_config xc = shm_config(true);
    kv_xport *x = NULL;
    if (kv_xport_create(&xc, &x) != KV_OK)
        return 11;
    struct shm_setup su = {.port = kv_xport_port(x)};
    if (shm_io(ctl, &su, sizeof(su), true))
        return 12;
    kv_xport_peer *peer = NULL;
    kv_xport_mem *m = NULL;
    size_t bl = 0;
    if (kv_xport_accept(x, 60000, &peer) != KV_OK ||
        kv_xport_mem_reg(x, d.base, (size_t)d.lo.total_bytes, KV_MEM_HOST, &m) != KV_OK ||
        kv_xport_mem_expose(peer, m, su.blob, sizeof(su.blob), &bl) != KV_OK)
        return 13;
    su.blob_len = (uint32_t)bl;
    if (shm_io(ctl, &su, sizeof(su), true))
        return 14;
    struct kv_xport_msg *msg = malloc(sizeof(*msg));
    int rc = 0;
    for (;;) {
        char cmd;
        if (shm_io(ctl, &cmd, 1, false))
            return 15;
        if (cmd == SHM_CMD_QUIT)
            break;
        if (cmd == SHM_CMD_XPORT) {
            if (kv_xport_notify_poll(x, 600000, msg) != KV_OK)
                return 16;
            if (shm_io(ctl, "k", 1, true))
                return 17;
        } else {
            const uint64_t h = XXH3_64bits(d.base, (size_t)d.lo.total_bytes);
            if (shm_io(ctl, (void *)&h, sizeof(h), true))
                return 18;
        }
    }
    free(msg);
    kv_xport_peer_close(peer);
    if (kv_xport_mem_dereg(m) != KV_OK)
        rc = 19;
    if (kv_xport_destroy(x) != KV_OK)
        rc = 20;
    shm_side_free(&d);
    return rc;
}

static void shm_case(void)
{
    const char *bench = "transport.shm";
    const int64_t T = kvb_quick() ? 1024 : 4096;
    char name[64];
    snprintf(name, sizeof(name), "llama3_8b_T%lld_nhd_lm_N16", (long long)T);
    if (!kvb_selected(bench, name))
        return;
    kvb_progress("transport", name);
    struct shm_side s, d;
    memset(&s, 0, sizeof(s));
    memset(&d, 0, sizeof(d));
    if (shm_side_make(&s, T, 31) != KV_OK || shm_side_make(&d, T, 77) != KV_OK) {
        kvb_failed(bench, name, "setup: out of memory");
        shm_side_free(&s);
        shm_side_free(&d);
        return;
    }
    kvb_fill_random(s.base, (size_t)s.lo.total_bytes, 9);
    const uint64_t bytes = (uint64_t)s.n * 64ull * (uint64_t)s.lo.block_bytes;
    char *ma = kvb_alloc((size_t)bytes), *mb = kvb_alloc((size_t)bytes);
    if (ma && mb) {
        memcpy(ma, s.base, (size_t)bytes);
        memset(mb, 1, (size_t)bytes);
    }
    /* Decode in a fresh image of this program (kvb_spawn_self). */
    char args[32];
    snprintf(args, sizeof(args), "%lld", (long long)T);
    int ctl = -1;
    const pid_t pid = ma && mb ? kvb_spawn_self("KVB_SHM_DECODE", args, &ctl) : -1;
    if (pid < 0) {
        kvb_failed(bench, name, "setup");
        kvb_free(ma);
        kvb_free(mb);
        shm_side_free(&s);
        shm_side_free(&d);
        return;
    }
    kv_xport *x = NULL;
    kv_xport_peer *peer = NULL;
    kv_xport_mem *m = NULL;
    kv_xport_rmem *r = NULL;
    kv_plan *plan = NULL;
    const char *fail = NULL;
    struct shm_setup su;
    const int runs = kvb_runs();
    double *ts = calloc((size_t)runs, sizeof(double)), *bs = calloc((size_t)runs, sizeof(double));
    const struct kv_xport_config xc = shm_config(false);
    if (shm_io(ctl, &su, sizeof(su), false) || kv_xport_create(&xc, &x) != KV_OK ||
        kv_xport_connect(x, "kvbench", su.port, &peer) != KV_OK ||
        kv_xport_peer_wait(peer, 60000, NULL) != KV_OK || shm_io(ctl, &su, sizeof(su), false) ||
        kv_xport_mem_reg(x, s.base, (size_t)s.lo.total_bytes, KV_MEM_HOST, &m) != KV_OK ||
        kv_xport_rmem_import(peer, su.blob, su.blob_len, &r) != KV_OK ||
        kv_plan_create(&s.lo, &d.lo, NULL, &plan) != KV_OK) {
        fail = "connect";
        goto out;
    }
    for (int i = 0; i < runs; i++) {
        double t0 = kvb_now();
        memcpy(mb, ma, (size_t)bytes); /* A: the memcpy */
        bs[i] = kvb_now() - t0;
        kvb_sink((uint64_t)(unsigned char)mb[bytes / 2]);
        char k;
        kv_xport_xfer *t = NULL;
        kv_xport_state state;
        struct kv_xport_notify n = {.tag = (uint64_t)i};
        if (shm_io(ctl, (char[]){SHM_CMD_XPORT}, 1, true)) {
            fail = "control";
            goto out;
        }
        t0 = kvb_now(); /* B: the transport */
        if (kv_xport_write_plan(peer, plan, m, 0, s.ids, s.n, r, 0, d.ids, d.n, (uint64_t)T, &n,
                                &t) != KV_OK ||
            shm_io(ctl, &k, 1, false)) {
            fail = "transfer";
            goto out;
        }
        ts[i] = kvb_now() - t0;
        if (kv_xport_xfer_wait(t, 600000, &state) != KV_OK || state != KV_XPORT_DONE ||
            kv_xport_xfer_free(t) != KV_OK) {
            fail = "transfer";
            goto out;
        }
    }
    {
        uint64_t got = 0;
        if (shm_io(ctl, (char[]){SHM_CMD_HASH}, 1, true) || shm_io(ctl, &got, sizeof(got), false)) {
            fail = "hash";
            goto out;
        }
        if (!kvb_pool_hash_ok(plan, &s.lo, s.base, s.ids, s.n, &d.lo, d.base, d.ids, d.n,
                              (uint64_t)T, got))
            kvb_mismatch(bench, name, "decode's pool XXH3 differs from kv_plan_copy's");
        else
            kvb_emit_gbps(bench, name, bytes, kvb_median(ts, runs), "memcpy", kvb_median(bs, runs),
                          runs);
    }
out:
    if (fail)
        kvb_failed(bench, name, "%s: %s", fail, kv_last_error());
    (void)shm_io(ctl, (char[]){SHM_CMD_QUIT}, 1, true);
    kvb_reap(pid, fail != NULL, bench, name);
    close(ctl);
    kv_plan_destroy(plan);
    if (kv_xport_rmem_free(r) != KV_OK)
        kvb_failed(bench, name, "rmem_free: %s", kv_last_error());
    kv_xport_peer_close(peer);
    if (m && kv_xport_mem_dereg(m) != KV_OK)
        kvb_failed(bench, name, "dereg: %s", kv_last_error());
    if (kv_xport_destroy(x) != KV_OK)
        kvb_failed(bench, name, "destroy: %s", kv_last_error());
    free(ts);
    free(bs);
    kvb_free(ma);
    kvb_free(mb);
    shm_side_free(&s);
    shm_side_free(&d);
}

/* The decode process: this program started again with KVB_SHM_DECODE=fd,T
 * runs shm_decode_main before main. */
__attribute__((constructor)) static void shm_decode_entry(void)
{
    const char *e = getenv("KVB_SHM_DECODE");
    if (!e)
        return;
    int fd = -1;
    long long T = 0;
    if (sscanf(e, "%d,%lld", &fd, &T) != 2 || T <= 0)
        _exit(2);
    signal(SIGPIPE, SIG_IGN);
    _exit(shm_decode_main(fd, (int64_t)T));
}

static void shm_suite(void)
{
    signal(SIGPIPE, SIG_IGN);
    shm_case();
}

KVB_REGISTER("transport", shm_suite)
