/*
 * local.c - --local: both sides in one process, the transfer by kv_plan_copy.
 *
 * The self-check of everything but the transport: for each request decode
 * places it (decode.c), the placement goes through its encoding and back
 * (placement.c), prefill writes it (prefill.c), kv_plan_copy moves it from
 * prefill's layout into decode's blocks (the same plans the transport
 * executes in prefill_role.c), decode checks it and frees it; then the
 * MLA group the same way (mla.c).
 */
#include <stdlib.h>
#include <string.h>

#include "kvdemo.h"

int run_local(uint64_t seed, bool fault, const struct request *reqs, uint32_t n_req)
{
    struct prefill *p = calloc(1, sizeof(*p));
    struct decode *d = calloc(1, sizeof(*d));
    kv_plan *plans[N_GROUPS] = {0};
    unsigned char *snap = malloc(PREFIX_BLOCKS * PF_BLOCK_BYTES);
    bool ok = p && d && snap;
    if (!ok)
        fail_msg("out of memory");
    ok = ok && prefill_init(p, seed) && decode_init(d, seed);
    if (ok) {
        d->fault = fault;
        d->fault_req = n_req / 2;
    }
    const uint64_t t_start = now_ns();
    for (uint32_t i = 0; ok && i < n_req; i++) {
        const struct request *r = &reqs[i];
        struct placement dpl, pl;
        struct kv_layout lo;
        uint32_t seq = 0, blocks[KV_XPORT_NOTIFY_MAX / 4];
        unsigned char buf[KV_XPORT_NOTIFY_MAX];
        size_t len = 0;
        char why[160];
        ok = decode_place(d, r, &dpl);
        /* the placement goes through its message format here too */
        ok = ok && place_encode(&dpl, buf, sizeof(buf), &len);
        if (ok && (len == 0 || !place_decode(buf, len, &pl, blocks, why, sizeof(why))))
            ok = fail_msg("request %u: the placement does not survive its encoding", r->id);
        if (ok && !place_accept(&pl, reqs, n_req, &lo)) {
            decode_release(d, r->id);
            continue;
        }
        ok = ok && prefill_request(p, r, &seq);
        if (!ok)
            break;
        const bool first_prefix = r->prefix && !p->prefix_stored;
        if (first_prefix)
            ok = prefill_offload_store(p, seq, snap);
        const uint32_t g = pl.group;
        if (ok && !plans[g])
            ok = ok_call(kv_plan_create(p->s.lo, &lo, NULL, &plans[g]), "kv_plan_create");
        const uint32_t *src;
        uint32_t n_src = 0;
        ok = ok && ok_call(kv_page_table_seq_blocks(p->s.pt, seq, &src, &n_src), "seq_blocks");
        uint32_t old_prefix[PREFIX_BLOCKS];
        if (ok && first_prefix)
            memcpy(old_prefix, src, sizeof(old_prefix));
        const uint64_t t0 = now_ns();
        ok = ok && ok_call(kv_plan_copy(plans[g], p->s.pc, src, n_src, d->g[g].s.pc, pl.blocks,
                                        pl.n_blocks, r->n_tokens),
                           "kv_plan_copy");
        if (ok)
            xfer_add(g, r->n_tokens, t0);
        ok = ok && ok_call(kv_page_table_seq_free(p->s.pt, seq), "kv_page_table_seq_free");
        if (ok && first_prefix && p->prefix_stored)
            ok = prefill_offload_roundtrip(p, old_prefix, snap);
        const uint64_t before = g_rep.checks - g_rep.passed;
        ok = ok && decode_check(d, r);
        g_rep.requests++;
        g_rep.tokens += r->n_tokens;
        if (ok && g_rep.checks - g_rep.passed == before)
            g_rep.requests_ok++;
        decode_release(d, r->id);
        progress(i + 1, n_req, t_start);
    }
    ok = ok && local_mla(p, d, reqs, n_req);
    for (uint32_t g = 0; ok && g < N_GROUPS; g++)
        decode_group_check(&d->g[g], g);
    if (ok)
        decode_group_check(&d->mla, MLA_GROUP);
    for (uint32_t g = 0; g < N_GROUPS; g++)
        kv_plan_destroy(plans[g]);
    if (p)
        prefill_fini(p);
    if (d)
        decode_fini(d);
    free(p);
    free(d);
    free(snap);
    return ok ? 0 : EXIT_FAILED;
}
