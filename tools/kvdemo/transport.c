/*
 * transport.c - what both role processes do on the transport.
 *
 * The transport (connector/transport/kv_transport.h; TCP, or RDMA where a device
 * exists) carries two things between decode and prefill: notifications,
 * small tagged messages (placements and the END of the batch from decode;
 * DONE or FAILED per request from prefill), and prefill's one-sided writes into decode's
 * registered arenas. These helpers create an endpoint, register a cache's
 * arena, post a notification and wait for the next one.
 */
#include <inttypes.h>
#include <stdio.h>

#include "kvdemo.h"

/* A transfer's state, for messages. */
const char *xstate_name(kv_xport_state st)
{
    switch (st) {
    case KV_XPORT_PENDING:
        return "PENDING";
    case KV_XPORT_DONE:
        return "DONE";
    case KV_XPORT_FAILED:
        return "FAILED";
    case KV_XPORT_TIMED_OUT:
        return "TIMED_OUT";
    case KV_XPORT_CANCELLED:
        return "CANCELLED";
    }
    return "unknown";
}

/* The next notification from peer, waiting at most WAIT_MS, in short
 * slices so that a peer that went away ends the wait at once. Another
 * peer's (decode listens: anyone with the token can connect, and is
 * never accepted) is not ours: ignored, the first one named. */
kv_status poll_msg(kv_xport *x, kv_xport_peer *peer, struct kv_xport_msg *msg)
{
    static uint64_t ignored;
    const uint64_t t0 = now_ns();
    for (;;) {
        const kv_status st = kv_xport_notify_poll(x, 200, msg);
        if (st == KV_OK && msg->peer_id == kv_xport_peer_id(peer))
            return st;
        if (st != KV_OK && st != KV_ERR_TIMEOUT)
            return st;
        kv_xport_peer_state ps = KV_XPORT_READY;
        kv_status why = KV_OK;
        if (st == KV_OK) { /* ours may still have notifications queued behind it */
            if (!ignored++)
                fprintf(stderr,
                        "%s: ignored a notification (tag %" PRIu64 ", %u bytes) from peer %" PRIu64
                        ", not the one accepted (peer %" PRIu64 ")\n",
                        g_role, msg->tag, msg->len, msg->peer_id, kv_xport_peer_id(peer));
        } else if (kv_xport_peer_state_get(peer, &ps, &why) == KV_OK && ps == KV_XPORT_CLOSED) {
            fail_msg("the peer closed the connection (%s)", kv_status_name(why));
            return KV_ERR_IO;
        }
        if (now_ns() - t0 >= (uint64_t)WAIT_MS * 1000000u) {
            fail_msg("no notification from the peer within %d ms", WAIT_MS);
            return KV_ERR_TIMEOUT;
        }
    }
}

/* Post a notification with no data (a placement, a failure, the end). */
bool send_msg(kv_xport_peer *peer, uint64_t tag, const void *msg, uint32_t len)
{
    const struct kv_xport_notify nt = {tag, msg, len};
    kv_xport_xfer *x = NULL;
    if (!ok_call(kv_xport_write(peer, NULL, 0, &nt, &x), "kv_xport_write (notification)"))
        return false;
    kv_xport_state st = KV_XPORT_PENDING;
    bool ok = ok_call(kv_xport_xfer_wait(x, WAIT_MS, &st), "kv_xport_xfer_wait (notification)");
    if (ok && st != KV_XPORT_DONE)
        ok = fail_msg("a notification (tag %" PRIu64 ") ended %s", tag, xstate_name(st));
    if (kv_xport_xfer_free(x) != KV_OK)
        ok = fail_msg("kv_xport_xfer_free refused a terminal transfer");
    return ok;
}

bool xport_new(const struct opts *o, bool listen, kv_xport **x)
{
    struct kv_xport_config cfg = KV_XPORT_CONFIG_INIT;
    cfg.kind = o->kind;
    cfg.listen_host = listen ? "127.0.0.1" : NULL;
    cfg.listen_port = listen ? (uint16_t)o->port : 0;
    cfg.token = XPORT_TOKEN;
    cfg.timeout_ms = WAIT_MS;
    const kv_status st = kv_xport_create(&cfg, x);
    if (st == KV_ERR_UNSUPPORTED)
        return fail_msg("the %s transport is not available here: %s", kv_xport_kind_name(o->kind),
                        kv_last_error());
    return ok_call(st, "kv_xport_create");
}

/* Register a cache's arena (one region), holding a reference on the cache
 * until it is deregistered. */
bool xport_reg(kv_xport *x, const struct side *s, kv_xport_mem **mem)
{
    struct kv_mem_region rg[4];
    size_t n = 0;
    if (!ok_call(kv_cache_regions(s->c, rg, 4, &n), "kv_cache_regions"))
        return false;
    if (n != 1 || rg[0].ptr != s->pc.base)
        return fail_msg("the cache arena is %zu regions, not one at its base", n);
    return ok_call(kv_xport_mem_reg_cache(x, s->c, mem), "kv_xport_mem_reg_cache");
}

/* Check up front that the transport can be created at all (RDMA without a
 * device fails here, cleanly, before any process starts). */
bool xport_probe(const struct opts *o)
{
    kv_xport *x = NULL;
    if (!xport_new(o, false, &x))
        return false;
    return ok_call(kv_xport_destroy(x), "kv_xport_destroy");
}
