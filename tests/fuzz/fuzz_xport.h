/*
 * fuzz_xport.h - the harness the transport receive targets share
 * (fuzz_xport_rx.c: TCP, fuzz_xport_shm_rx.c: SHM): a transport driven by
 * hand with small limits (4 notifications, 4 reads served) and a 64 KiB
 * region registered; after the handshake that region exposed to the
 * harness, a region 7 the harness claims imported, a write (transfer 1:
 * two entries and a notification) and a read (transfer 2: two entries)
 * posted; after the input everything released in order, and destroy must
 * succeed. Define FUZZ_NAME (the target's name, for the message) before
 * including it. Any violation aborts.
 */
#ifndef FUZZ_XPORT_H
#define FUZZ_XPORT_H

#include <stdio.h>
#include <stdlib.h>

#include "kv_xport_int.h"

#define FUZZ_REGION (64u << 10)

static unsigned char g_mem[FUZZ_REGION];
static unsigned char g_src[8192];

static void die(const char *what)
{
    fprintf(stderr, FUZZ_NAME ": %s: %s\n", what, kv_last_error());
    abort();
}

/* The handles of one input; NULL where not made. */
struct fz_xport {
    kv_xport *x;
    kv_xport_mem *m;  /* g_mem: region 1, the one exposed */
    kv_xport_mem *ms; /* g_src: the transfers' local side */
    kv_xport_peer *p;
    kv_xport_rmem *r; /* region 7 of the harness */
    kv_xport_xfer *tw, *tr;
};

/* A manual transport of kind listening on host (the peer comes through
 * adopt), token, conns connections per peer (0: the default), g_mem
 * registered. */
static void fz_open(struct fz_xport *f, kv_xport_kind kind, const char *host, uint64_t token,
                    uint32_t conns)
{
    memset(f, 0, sizeof(*f));
    struct kv_xport_config c = KV_XPORT_CONFIG_INIT;
    c.kind = kind;
    c.listen_host = host;
    c.token = token;
    c.conns_per_peer = conns;
    c.timeout_ms = 1000;
    c.max_pending_notes = 4;
    c.max_pending_reads = 4;
    c.max_handshakes = 4;
    c.frames_per_round = 16;
    if (kv__xport_create_manual(&c, &f->x) != KV_OK)
        die("create");
    if (kv_xport_mem_reg(f->x, g_mem, FUZZ_REGION, KV_MEM_HOST, &f->m) != KV_OK)
        die("mem_reg");
}

/* f->p accepted and READY: g_mem exposed to it, the harness's region
 * imported from blob[bl], g_src registered, the write and the read
 * posted. */
static void fz_post(struct fz_xport *f, const unsigned char *blob, size_t bl)
{
    unsigned char mine[KV_XPORT_BLOB_MAX];
    size_t ml = 0;
    if (kv_xport_mem_expose(f->p, f->m, mine, sizeof(mine), &ml) != KV_OK)
        die("expose");
    if (kv_xport_rmem_import(f->p, blob, bl, &f->r) != KV_OK)
        die("import");
    if (kv_xport_mem_reg(f->x, g_src, sizeof(g_src), KV_MEM_HOST, &f->ms) != KV_OK)
        die("mem_reg src");
    const struct kv_xport_io w[2] = {{f->ms, 0, f->r, 0, 1000}, {f->ms, 1000, f->r, 4096, 1000}};
    const struct kv_xport_notify n = {.tag = 1, .msg = "n", .len = 1};
    if (kv_xport_write(f->p, w, 2, &n, &f->tw) != KV_OK)
        die("write");
    const struct kv_xport_io rd[2] = {{f->ms, 2000, f->r, 0, 1000},
                                      {f->ms, 4000, f->r, 8192, 3000}};
    if (kv_xport_read(f->p, rd, 2, &f->tr) != KV_OK)
        die("read");
}

/* Release everything, in order; destroy must then succeed (notifications
 * the input queued, and peers it made that nobody accepted, go with the
 * transport). */
static void fz_close(struct fz_xport *f)
{
    if (f->p)
        kv_xport_peer_close(f->p);
    if ((f->tw && kv_xport_xfer_free(f->tw) != KV_OK) ||
        (f->tr && kv_xport_xfer_free(f->tr) != KV_OK))
        die("xfer_free after the peer closed");
    if (kv_xport_rmem_free(f->r) != KV_OK)
        die("rmem_free");
    if (f->ms && kv_xport_mem_dereg(f->ms) != KV_OK)
        die("dereg src");
    if (kv_xport_mem_dereg(f->m) != KV_OK)
        die("dereg");
    if (kv_xport_destroy(f->x) != KV_OK)
        die("destroy");
}

#endif /* FUZZ_XPORT_H */
