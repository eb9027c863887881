/*
 * layerwise.c - layer-by-layer transfer against whole-request transfer, on
 * one request, in the same run (kv_xport_layers.h).
 *
 * After the last request decode places the longest one again (tag
 * LAYERWISE). Prefill writes it once (the write kernel), then sends it
 * three times into the same decode blocks, each pass a request of the
 * layer-wise trackers (kv_xlayer_tx / kv_xlayer_rx) with its own id:
 *
 *   pass 0  calibration: the whole request as one write, no compute: its
 *           time X gives the compute per layer c = X / L (a layer's
 *           compute of the same order as its transfer);
 *   pass 1  whole request: compute every layer (c each), then one write of
 *           all L layers with one LAYERS notification;
 *   pass 2  layer by layer: compute layer l (c), post layer l at once.
 *
 * The compute is a wait (a GPU computing while the CPU moves bytes). Each
 * pass is timed on prefill from its start until its last transfer is
 * acknowledged (kv_xlayer_tx_wait: decode holds the last layer, plus the
 * acknowledgement back, the same for both). Decode waits for each layer of
 * each pass in order (kv_xlayer_rx_wait), then verifies the request's
 * bytes and its attention (decode_check) and releases its blocks.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <time.h>

#include "kvdemo.h"

#define LW_ID0 UINT64_C(0x4c570000) /* request ids of the three passes: LW_ID0 + pass */
#define LW_PASSES 3u

bool decode_layerwise(struct decode *d, kv_xport *x, kv_xport_peer *peer, const struct request *r)
{
    struct kv_xlayer_rx_config rc = KV_XLAYER_RX_CONFIG_INIT;
    rc.max_requests = LW_PASSES;
    rc.max_layers = L_LAYERS;
    kv_xlayer_rx *rx = NULL;
    struct kv_xport_msg *msg = malloc(sizeof(*msg));
    if (!msg)
        return fail_msg("out of memory");
    bool ok = ok_call(kv_xlayer_rx_create(&rc, &rx), "kv_xlayer_rx_create");
    for (uint32_t k = 0; ok && k < LW_PASSES; k++)
        ok = ok_call(kv_xlayer_rx_expect(rx, kv_xport_peer_id(peer), LW_ID0 + k, L_LAYERS),
                     "kv_xlayer_rx_expect");
    /* each layer of each pass, in order: feed notifications until it is there */
    for (uint32_t k = 0; ok && k < LW_PASSES; k++)
        for (uint32_t l = 0; ok && l < L_LAYERS; l++)
            for (;;) {
                const kv_status st = kv_xlayer_rx_wait(rx, LW_ID0 + k, l, 0);
                if (st == KV_OK)
                    break;
                if (st != KV_ERR_TIMEOUT) {
                    ok = ok_call(st, "kv_xlayer_rx_wait");
                    break;
                }
                if (!(ok = ok_call(poll_msg(x, peer, msg), "kv_xport_notify_poll")))
                    break;
                if (msg->tag != KV_XLAYER_TAG) {
                    ok = fail_msg("layer-wise: unexpected notification: tag %" PRIu64, msg->tag);
                    break;
                }
                ok = ok_call(kv_xlayer_rx_feed(rx, msg), "kv_xlayer_rx_feed");
                if (!ok)
                    break;
            }
    struct kv_xlayer_done done[LW_PASSES];
    uint32_t n = 0;
    ok = ok && ok_call(kv_xlayer_rx_finished(rx, done, LW_PASSES, &n), "kv_xlayer_rx_finished");
    if (ok && check(n == LW_PASSES, "layer-wise: %u of %u passes finished", n, LW_PASSES))
        for (uint32_t k = 0; k < n; k++)
            check(done[k].status == KV_OK, "layer-wise: pass %" PRIu64 " ended %s",
                  done[k].request - LW_ID0, kv_status_name(done[k].status));
    const bool fault = d->fault; /* --fault corrupts one of the batch, not this pass */
    d->fault = false;
    ok = ok && decode_check(d, r);
    d->fault = fault;
    decode_release(d, r->id);
    if (rx && kv_xlayer_rx_destroy(rx) != KV_OK)
        ok = fail_msg("kv_xlayer_rx_destroy: %s", kv_last_error());
    free(msg);
    return ok;
}

static void compute(uint64_t ns)
{
    const struct timespec ts = {(time_t)(ns / 1000000000u), (long)(ns % 1000000000u)};
    nanosleep(&ts, NULL);
}

/* One pass: LW_ID0 + k; 0 layers of compute and one write (pass 0), L
 * layers of compute then one write (1), or compute and post per layer
 * (2). Its time in *ns. */
static bool lw_pass(kv_xlayer_tx *tx, uint32_t k, uint64_t c_ns, kv_plan *whole, kv_plan **layer,
                    kv_xport_peer *peer, kv_xport_mem *mem, kv_xport_rmem *rmem,
                    const uint32_t *src, uint32_t n_src, const struct placement *pl,
                    uint64_t n_tokens, uint64_t *ns)
{
    const uint64_t id = LW_ID0 + k;
    if (!ok_call(kv_xlayer_tx_begin(tx, peer, id, L_LAYERS), "kv_xlayer_tx_begin"))
        return false;
    const uint64_t t0 = now_ns();
    kv_status st = KV_OK;
    if (k < 2) {
        if (k == 1)
            compute(c_ns * L_LAYERS);
        st = kv_xlayer_tx_post(tx, id, whole, 0, L_LAYERS, mem, 0, src, n_src, rmem, 0, pl->blocks,
                               pl->n_blocks, n_tokens);
    } else {
        for (uint32_t l = 0; l < L_LAYERS && st == KV_OK; l++) {
            compute(c_ns);
            st = kv_xlayer_tx_post(tx, id, layer[l], l, 1, mem, 0, src, n_src, rmem, 0, pl->blocks,
                                   pl->n_blocks, n_tokens);
        }
    }
    if (st != KV_OK) {
        (void)ok_call(st, "kv_xlayer_tx_post");
        (void)!kv_xlayer_tx_cancel(tx, id);
    }
    const kv_status wst = kv_xlayer_tx_wait(tx, id, WAIT_MS);
    *ns = now_ns() - t0;
    return st == KV_OK && ok_call(wst, "kv_xlayer_tx_wait");
}

bool prefill_layerwise(struct prefill *p, const struct request *r, const struct placement *pl,
                       const struct kv_layout *lo, kv_xport_peer *peer, kv_xport_mem *mem,
                       kv_xport_rmem *rmem)
{
    kv_plan *whole = NULL, *layer[L_LAYERS] = {0};
    kv_xlayer_tx *tx = NULL;
    struct kv_xlayer_tx_config tc = KV_XLAYER_TX_CONFIG_INIT;
    tc.max_requests = LW_PASSES;
    tc.max_layers = L_LAYERS;
    bool ok = ok_call(kv_plan_create(p->s.lo, lo, NULL, &whole), "kv_plan_create") &&
              ok_call(kv_xlayer_tx_create(&tc, &tx), "kv_xlayer_tx_create");
    for (uint32_t l = 0; ok && l < L_LAYERS; l++) {
        struct kv_plan_config pc = KV_PLAN_CONFIG_INIT;
        pc.src_layer0 = pc.dst_layer0 = l;
        pc.n_layers = 1;
        ok = ok_call(kv_plan_create(p->s.lo, lo, &pc, &layer[l]), "kv_plan_create (one layer)");
    }
    uint32_t seq = 0;
    bool have_seq = false;
    const uint32_t *src = NULL;
    uint32_t n_src = 0;
    ok = ok && (have_seq = prefill_request(p, r, &seq)) &&
         ok_call(kv_page_table_seq_blocks(p->s.pt, seq, &src, &n_src), "seq_blocks");
    uint64_t ns[LW_PASSES] = {0}, c_ns = 0;
    for (uint32_t k = 0; ok && k < LW_PASSES; k++) {
        ok = lw_pass(tx, k, c_ns, whole, layer, peer, mem, rmem, src, n_src, pl, r->n_tokens,
                     &ns[k]);
        if (k == 0)
            c_ns = ns[0] / L_LAYERS;
    }
    struct kv_xlayer_done done[LW_PASSES];
    uint32_t n = 0;
    if (tx && kv_xlayer_tx_finished(tx, done, LW_PASSES, &n) != KV_OK)
        ok = fail_msg("kv_xlayer_tx_finished: %s", kv_last_error());
    if (ok && check(n == LW_PASSES, "layer-wise: prefill reports %u of %u passes", n, LW_PASSES)) {
        g_rep.lw_bytes = (uint64_t)r->n_tokens * TOKEN_BYTES;
        g_rep.lw_c_ns = c_ns;
        g_rep.lw_whole_ns = ns[1];
        g_rep.lw_layers_ns = ns[2];
    }
    if (have_seq && !ok_call(kv_page_table_seq_free(p->s.pt, seq), "kv_page_table_seq_free"))
        ok = false;
    if (tx && kv_xlayer_tx_destroy(tx) != KV_OK)
        ok = fail_msg("kv_xlayer_tx_destroy: %s", kv_last_error());
    for (uint32_t l = 0; l < L_LAYERS; l++)
        kv_plan_destroy(layer[l]);
    kv_plan_destroy(whole);
    return ok;
}
