/*
 * decode_role.c - the decode process (kvdemo decode --port P ...).
 *
 * Decode listens on 127.0.0.1 (port 0: any; the parent learns it through
 * --port-fd), registers each group's arena and accepts prefill. It keeps up
 * to WINDOW requests in flight: for each it allocates the blocks and sends
 * a placement (the first of a group carries the arena's exposure). Each
 * DONE from prefill arrives after that request's data (one notification
 * rides behind the writes); decode then checks the request (decode_check),
 * frees it and places the next. After the last one it places the longest
 * request once more for the layer-wise comparison (layerwise.c), then
 * the MLA group (mla.c: latent caches, decode attention by
 * kv_attn_decode_mla), then sends END, checks that no held block was written, and closes.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvdemo.h"

/* Allocate r's blocks and send its placement under tag (the first of a
 * group carries the group's exposure). */
static bool place_send(struct decode *d, const struct request *r, kv_xport_peer *peer,
                       kv_xport_mem **mem, bool *exposed, uint64_t tag)
{
    struct placement pl;
    if (!decode_place(d, r, &pl))
        return false;
    const uint32_t g = pl.group;
    unsigned char blob[KV_XPORT_BLOB_MAX];
    size_t blob_len = 0;
    bool ok = true;
    if (!exposed[g]) {
        ok = ok_call(kv_xport_mem_expose(peer, mem[g], blob, sizeof(blob), &blob_len),
                     "kv_xport_mem_expose");
        exposed[g] = ok;
        pl.blob = blob;
        pl.blob_len = (uint32_t)blob_len;
    }
    unsigned char buf[KV_XPORT_NOTIFY_MAX];
    size_t len = 0;
    ok = ok && place_encode(&pl, buf, sizeof(buf), &len);
    if (ok && len == 0)
        ok = fail_msg("request %u: the placement does not fit in a notification", r->id);
    return ok && send_msg(peer, tag, buf, (uint32_t)len);
}

int run_decode(const struct opts *o, const struct request *reqs)
{
    g_role = "decode";
    struct decode *d = calloc(1, sizeof(*d));
    kv_xport *x = NULL;
    kv_xport_peer *peer = NULL;
    kv_xport_mem *mem[N_GROUPS] = {0}, *mla_mem = NULL;
    bool exposed[N_GROUPS] = {0};
    struct kv_xport_msg *msg = malloc(sizeof(*msg));
    bool ok = d && msg;
    if (!ok)
        fail_msg("out of memory");
    ok = ok && decode_init(d, o->seed) && xport_new(o, true, &x);
    if (ok) {
        d->fault = o->fault;
        d->fault_req = o->requests / 2;
    }
    if (o->port_fd >= 0) {
        char line[32];
        const int n = snprintf(line, sizeof(line), "%u\n", ok ? kv_xport_port(x) : 0u);
        if (write(o->port_fd, line, (size_t)n) != n)
            ok = fail_msg("cannot tell the parent the port: %s", strerror(errno));
        close(o->port_fd);
    } else if (ok) {
        printf("decode: listening on 127.0.0.1:%u\n", kv_xport_port(x));
        fflush(stdout);
    }
    for (uint32_t g = 0; ok && g < N_GROUPS; g++)
        ok = xport_reg(x, &d->g[g].s, &mem[g]);
    ok = ok && xport_reg(x, &d->mla.s, &mla_mem);
    ok = ok && ok_call(kv_xport_accept(x, WAIT_MS, &peer), "kv_xport_accept");
    if (ok && o->port_fd < 0) { /* run by hand: the peer it takes (tests/cli/test_peers.sh) */
        printf("decode: accepted its peer\n");
        fflush(stdout);
    }
    uint32_t next = 0, inflight = 0, done = 0;
    const uint64_t t_start = now_ns();
    while (ok && done < o->requests) {
        while (ok && inflight < WINDOW && next < o->requests) {
            ok = place_send(d, &reqs[next++], peer, mem, exposed, TAG_PLACE);
            inflight++;
        }
        if (!ok)
            break;
        const kv_status st = poll_msg(x, peer, msg);
        if (st == KV_ERR_TIMEOUT || st == KV_ERR_IO) {
            ok = fail_msg("waiting for prefill with %u requests in flight", inflight);
            break;
        }
        if (!(ok = ok_call(st, "kv_xport_notify_poll")))
            break;
        uint32_t req = msg->len >= 4 ? le32_get(msg->data) : UINT32_MAX;
        if ((msg->tag != TAG_DONE && msg->tag != TAG_FAILED) || msg->len != 4 ||
            req >= o->requests || !d->fl[req].live) {
            ok = fail_msg("unexpected notification: tag %" PRIu64 ", %u bytes", msg->tag, msg->len);
            break;
        }
        g_rep.requests++;
        g_rep.tokens += reqs[req].n_tokens;
        g_rep.xfer_bytes += (uint64_t)reqs[req].n_tokens * TOKEN_BYTES;
        if (check(msg->tag == TAG_DONE, "request %u: prefill says its transfer did not end DONE",
                  req)) {
            const uint64_t before = g_rep.checks - g_rep.passed;
            ok = decode_check(d, &reqs[req]);
            if (ok && g_rep.checks - g_rep.passed == before)
                g_rep.requests_ok++;
        }
        decode_release(d, req);
        inflight--;
        progress(++done, o->requests, t_start);
    }
    /* layer by layer against whole-request, on the longest request without
     * the shared prefix (prefill checks what a prefix request reuses) */
    uint32_t lw = UINT32_MAX;
    for (uint32_t i = 0; i < o->requests; i++)
        if (!reqs[i].prefix && (lw == UINT32_MAX || reqs[i].n_tokens > reqs[lw].n_tokens))
            lw = i;
    if (ok && lw != UINT32_MAX)
        ok = place_send(d, &reqs[lw], peer, mem, exposed, TAG_LAYERWISE) &&
             decode_layerwise(d, x, peer, &reqs[lw]);
    ok = ok && decode_mla(d, x, peer, mla_mem, reqs, o->requests);
    if (peer && ok)
        ok = send_msg(peer, TAG_END, NULL, 0);
    for (uint32_t g = 0; ok && g < N_GROUPS; g++)
        decode_group_check(&d->g[g], g);
    if (ok)
        decode_group_check(&d->mla, MLA_GROUP);
    for (uint32_t i = 0; d && i < o->requests; i++)
        decode_release(d, i);
    if (d)
        mla_decode_release(d);
    /* Closing the peer ends its exposures (prefill may have closed first:
     * then they are gone already); then the regions deregister. */
    if (peer)
        kv_xport_peer_close(peer);
    peer = NULL;
    for (uint32_t g = 0; g < N_GROUPS; g++)
        if (mem[g] && kv_xport_mem_dereg(mem[g]) != KV_OK)
            ok = fail_msg("kv_xport_mem_dereg: %s", kv_last_error());
    if (mla_mem && kv_xport_mem_dereg(mla_mem) != KV_OK)
        ok = fail_msg("kv_xport_mem_dereg (MLA): %s", kv_last_error());
    if (kv_xport_destroy(x) != KV_OK)
        ok = fail_msg("kv_xport_destroy: %s", kv_last_error());
    if (d)
        decode_fini(d);
    free(d);
    free(msg);
    return ok ? 0 : EXIT_FAILED;
}
