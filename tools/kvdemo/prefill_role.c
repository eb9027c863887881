/*
 * prefill_role.c - the prefill process (kvdemo prefill --port P ...).
 *
 * Prefill registers its arena, connects to decode and serves placements
 * until decode says END. For each placement: decode's layout is rebuilt
 * from the message (placement.c) and a plan made from prefill's layout to
 * it (kv_plan_create, one per group); the request is written (prefill.c);
 * kv_xport_write_plan posts the plan's runs as one-sided writes into
 * decode's blocks with a DONE notification behind them; prefill waits for
 * the transfer and frees its sequence. A transfer that is refused or does
 * not end DONE fails its request (FAILED to decode) rather than the run.
 * A LAYERWISE placement runs the layer-by-layer comparison
 * (layerwise.c); an MLA placement moves one request's latent cache
 * (mla.c).
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvdemo.h"

/* Connect and wait for the handshake. */
static bool prefill_connect(kv_xport *x, uint16_t port, kv_xport_peer **peer)
{
    if (!ok_call(kv_xport_connect(x, "127.0.0.1", port, peer), "kv_xport_connect"))
        return false;
    const uint64_t t0 = now_ns();
    for (;;) {
        kv_xport_peer_state ps = KV_XPORT_CONNECTING;
        kv_status why = KV_OK;
        if (!ok_call(kv_xport_peer_state_get(*peer, &ps, &why), "kv_xport_peer_state_get"))
            return false;
        if (ps == KV_XPORT_READY) {
            struct kv_xport_info in = KV_XPORT_INFO_INIT;
            char line[320];
            if (kv_xport_peer_info_get(*peer, &in) == KV_OK && in.kind == KV_XPORT_AUTO &&
                kv_xport_info_format(&in, line, sizeof(line)) >= 0)
                printf("  prefill's peer: %s\n", line);
            return true;
        }
        if (ps == KV_XPORT_CLOSED)
            return fail_msg("the connection to decode closed: %s: %s", kv_status_name(why),
                            kv_last_error());
        if (now_ns() - t0 > (uint64_t)WAIT_MS * 1000000u)
            return fail_msg("no handshake with decode within %d ms", WAIT_MS);
        usleep(1000);
    }
}

/* A placement from decode into *pl (blocks[] its block list), decode's
 * layout into *lo, the group's exposure imported when it comes with it.
 * 1: taken; 0: refused (decode was told FAILED; no failure of the run);
 * -1: a failure. */
static int placement_take(const struct opts *o, const struct request *reqs, kv_xport_peer *peer,
                          kv_xport_rmem **rmem, const struct kv_xport_msg *msg,
                          struct placement *pl, uint32_t *blocks, struct kv_layout *lo)
{
    char why[160];
    if (!place_decode(msg->data, msg->len, pl, blocks, why, sizeof(why)))
        return fail_msg("bad placement from decode: %s", why) ? 0 : -1;
    unsigned char req_le[4];
    le32_put(req_le, pl->req);
    if (!place_accept(pl, reqs, o->requests, lo))
        return pl->req < o->requests && send_msg(peer, TAG_FAILED, req_le, 4) ? 0 : -1;
    const uint32_t g = pl->group;
    if (pl->blob_len && !rmem[g] &&
        !ok_call(kv_xport_rmem_import(peer, pl->blob, pl->blob_len, &rmem[g]),
                 "kv_xport_rmem_import"))
        return -1;
    if (!rmem[g])
        return fail_msg("request %u: no exposure of group %u's arena yet", pl->req, g) ? 0 : -1;
    return 1;
}

/* One placement: write the request, post the plan's runs into decode's
 * blocks with the completion notification, wait, free. */
static bool prefill_serve(struct prefill *p, const struct opts *o, const struct request *reqs,
                          kv_xport_peer *peer, kv_xport_mem *mem, kv_xport_rmem **rmem,
                          kv_plan **plans, const struct kv_xport_msg *msg, unsigned char *snap)
{
    struct placement pl;
    uint32_t blocks[KV_XPORT_NOTIFY_MAX / 4];
    struct kv_layout lo;
    unsigned char req_le[4];
    const int taken = placement_take(o, reqs, peer, rmem, msg, &pl, blocks, &lo);
    if (taken <= 0)
        return taken == 0;
    le32_put(req_le, pl.req);
    const uint32_t g = pl.group;
    if (!plans[g] && !ok_call(kv_plan_create(p->s.lo, &lo, NULL, &plans[g]), "kv_plan_create"))
        return false;
    const struct request *r = &reqs[pl.req];
    uint32_t seq = 0;
    if (!prefill_request(p, r, &seq))
        return false;
    const bool first_prefix = r->prefix && !p->prefix_stored;
    if (first_prefix && !prefill_offload_store(p, seq, snap))
        return false;
    const uint32_t *src;
    uint32_t n_src = 0;
    if (!ok_call(kv_page_table_seq_blocks(p->s.pt, seq, &src, &n_src), "seq_blocks"))
        return false;
    uint32_t old_prefix[PREFIX_BLOCKS];
    if (first_prefix)
        memcpy(old_prefix, src, sizeof(old_prefix));
    const struct kv_xport_notify nt = {TAG_DONE, req_le, 4};
    kv_xport_xfer *x = NULL;
    kv_xport_state st = KV_XPORT_FAILED;
    const uint64_t t0 = now_ns();
    const kv_status pst = kv_xport_write_plan(peer, plans[g], mem, 0, src, n_src, rmem[g], 0,
                                              pl.blocks, pl.n_blocks, r->n_tokens, &nt, &x);
    bool ok = true;
    if (pst == KV_OK) {
        kv_status wst = kv_xport_xfer_wait(x, WAIT_MS, &st);
        if (wst == KV_ERR_TIMEOUT && kv_xport_xfer_cancel(x) == KV_OK)
            wst = kv_xport_xfer_wait(x, WAIT_MS, &st);
        if (wst != KV_OK) /* not terminal: its memory (our blocks) is not ours to free */
            return ok_call(wst, "kv_xport_xfer_wait (after a cancel)");
        xfer_add(g, r->n_tokens, t0);
        if (kv_xport_xfer_free(x) != KV_OK)
            ok = fail_msg("kv_xport_xfer_free refused a terminal transfer");
    }
    g_rep.requests++;
    g_rep.tokens += r->n_tokens;
    if (pst != KV_OK)
        check(false, "request %u: kv_xport_write_plan refused: %s: %s", r->id, kv_status_name(pst),
              kv_last_error());
    else if (check(st == KV_XPORT_DONE, "request %u: the transfer ended %s", r->id,
                   xstate_name(st)))
        g_rep.requests_ok++;
    if (!ok_call(kv_page_table_seq_free(p->s.pt, seq), "kv_page_table_seq_free"))
        return false;
    if (ok && st != KV_XPORT_DONE)
        ok = send_msg(peer, TAG_FAILED, req_le, 4);
    if (ok && first_prefix && p->prefix_stored)
        ok = prefill_offload_roundtrip(p, old_prefix, snap);
    return ok;
}

int run_prefill(const struct opts *o, const struct request *reqs)
{
    g_role = "prefill";
    struct prefill *p = calloc(1, sizeof(*p));
    kv_xport *x = NULL;
    kv_xport_peer *peer = NULL;
    kv_xport_mem *mem = NULL, *mla_mem = NULL;
    kv_xport_rmem *mla_rmem = NULL;
    kv_plan *mla_plan = NULL;
    kv_xport_rmem *rmem[N_GROUPS] = {0};
    kv_plan *plans[N_GROUPS] = {0};
    struct kv_xport_msg *msg = malloc(sizeof(*msg));
    unsigned char *snap = malloc(PREFIX_BLOCKS * PF_BLOCK_BYTES);
    bool ok = p && msg && snap;
    if (!ok)
        fail_msg("out of memory");
    ok = ok && prefill_init(p, o->seed) && xport_new(o, false, &x) && xport_reg(x, &p->s, &mem) &&
         xport_reg(x, &p->mla, &mla_mem) && prefill_connect(x, (uint16_t)o->port, &peer);
    while (ok) {
        const kv_status st = poll_msg(x, peer, msg);
        if (st == KV_ERR_TIMEOUT || st == KV_ERR_IO) {
            ok = fail_msg("waiting for a placement from decode");
            break;
        }
        if (!(ok = ok_call(st, "kv_xport_notify_poll")))
            break;
        if (msg->tag == TAG_END)
            break;
        if (msg->tag == TAG_LAYERWISE) {
            struct placement pl;
            uint32_t blocks[KV_XPORT_NOTIFY_MAX / 4];
            struct kv_layout lo;
            const int taken = placement_take(o, reqs, peer, rmem, msg, &pl, blocks, &lo);
            ok = taken > 0 &&
                 prefill_layerwise(p, &reqs[pl.req], &pl, &lo, peer, mem, rmem[pl.group]);
            continue;
        }
        if (msg->tag == TAG_MLA) {
            ok = prefill_mla(p, reqs, o->requests, peer, mla_mem, &mla_rmem, &mla_plan, msg);
            continue;
        }
        if (msg->tag != TAG_PLACE) {
            ok = fail_msg("unexpected notification: tag %" PRIu64, msg->tag);
            break;
        }
        ok = prefill_serve(p, o, reqs, peer, mem, rmem, plans, msg, snap);
    }
    for (uint32_t g = 0; g < N_GROUPS; g++) {
        if (kv_xport_rmem_free(rmem[g]) != KV_OK)
            ok = fail_msg("kv_xport_rmem_free: %s", kv_last_error());
        kv_plan_destroy(plans[g]);
    }
    if (kv_xport_rmem_free(mla_rmem) != KV_OK)
        ok = fail_msg("kv_xport_rmem_free (MLA): %s", kv_last_error());
    kv_plan_destroy(mla_plan);
    if (peer)
        kv_xport_peer_close(peer);
    if (mem && kv_xport_mem_dereg(mem) != KV_OK)
        ok = fail_msg("kv_xport_mem_dereg: %s", kv_last_error());
    if (mla_mem && kv_xport_mem_dereg(mla_mem) != KV_OK)
        ok = fail_msg("kv_xport_mem_dereg (MLA): %s", kv_last_error());
    if (kv_xport_destroy(x) != KV_OK)
        ok = fail_msg("kv_xport_destroy: %s", kv_last_error());
    if (p)
        prefill_fini(p);
    free(p);
    free(msg);
    free(snap);
    return ok ? 0 : EXIT_FAILED;
}
