/*
 * mla.c - the MLA request group: a DeepSeek-shaped latent cache moved
 * prefill -> decode and decoded there (kv_attn_decode_mla).
 *
 * The latent cache is one plane (k_only), one KV head, D = 576 (512 latent
 * + 64 rope dims), fp8 e4m3 with a per-tensor scale (MLA_SCALE), MLA_L
 * layers. Prefill holds it in 16-token NHD layer-major pages, decode in
 * 64-token block-major padded pages of a churned pool (half its blocks
 * held with a pattern, checked at the end like the GQA groups). After the
 * layer-wise pass decode places the first MLA_REQS requests of the batch
 * again (at most MLA_MAX_TOKENS tokens each), one at a time (tag MLA, the
 * first carrying the exposure of the latent arena); prefill writes each
 * request's latent through the write kernel (f32 in, the scale dividing)
 * and posts kv_xport_write_plan into decode's blocks with DONE behind it.
 * Decode then reads every byte back through the page table (kv_attn_read,
 * fp8 out, no scale: the stored bytes) against the demo's own e4m3
 * encoding of the generator, and runs kv_attn_decode_mla per layer (Hq =
 * MLA_HQ query heads, scores over all 576 dims, values the first MLA_DV)
 * against a plain double reference.
 *
 * The generator's latent values are n * MLA_SCALE with n in [-8, 7]: the
 * stored value is the integer n, exact in e4m3, so both the bytes and the
 * dequantized values are known without the library's conversion code.
 */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvdemo.h"

/* The latent cache of either side (decode: N 64, block-major, padded). */
void mla_layout(bool decode, struct kv_layout_config *lc)
{
    kv_layout_config_init(lc);
    lc->num_layers = MLA_L;
    lc->num_heads = 1;
    lc->head_dim = MLA_D;
    lc->dtype = KV_FP8_E4M3;
    lc->k_only = true;
    lc->block_tokens = decode ? 64 : PF_N;
    lc->num_blocks = decode ? 3 * MAX_TOKENS / 64 + 1 : MAX_TOKENS / PF_N + 1;
    if (decode) {
        lc->arrange = KV_ARRANGE_BLOCK_MAJOR;
        lc->block_pad_elems = 64;
    }
}

/* The latent of request r, layer l, token t, dim e: n in [-8, 7] (the value n * MLA_SCALE). */
static int mla_n(uint64_t seed, const struct request *r, uint32_t l, uint32_t t, uint32_t e)
{
    const float g = gen_value(seed, 0x20000 + r->id, l, t, 0, e, 3); /* b / 64, b int8 */
    return (int)lrintf(g * 64.0f) >> 4;
}

/* The demo's own e4m3 encoding of an integer n in [-8, 8] (bias 7, 3
 * mantissa bits): exact for these. */
static uint8_t e4m3_of_int(int n)
{
    if (n == 0)
        return 0;
    const uint8_t sign = n < 0 ? 0x80 : 0;
    unsigned a = (unsigned)(n < 0 ? -n : n), e = 0;
    while ((a >> (e + 1)) != 0)
        e++;
    const unsigned mant = ((a << 3) >> e) & 7u; /* a / 2^e = 1.mmm */
    return (uint8_t)(sign | ((e + 7) << 3) | mant);
}

uint32_t mla_count(uint32_t n_req)
{
    return n_req < MLA_REQS ? n_req : MLA_REQS;
}

/* The MLA request of batch request r: its id, at most MLA_MAX_TOKENS tokens
 * (the group keeps the demo quick). */
static struct request mla_request(const struct request *r)
{
    struct request m = *r;
    if (m.n_tokens > MLA_MAX_TOKENS)
        m.n_tokens = MLA_MAX_TOKENS;
    return m;
}

/* ---- decode ---------------------------------------------------------------------------------- */

/* Allocate request r's latent blocks; the placement (group MLA_GROUP) in *pl. */
bool mla_decode_place(struct decode *d, const struct request *r, struct placement *pl)
{
    struct side *s = &d->mla.s;
    if (!ok_call(kv_page_table_seq_create(s->pt, &d->mla_seq), "kv_page_table_seq_create (MLA)"))
        return false;
    d->mla_live = true;
    memset(pl, 0, sizeof(*pl));
    pl->req = r->id;
    pl->group = MLA_GROUP;
    pl->n_tokens = r->n_tokens;
    return ok_call(kv_page_table_seq_append(s->pt, d->mla_seq, NULL, r->n_tokens),
                   "kv_page_table_seq_append (MLA)") &&
           ok_call(kv_layout_config_from(s->lo, &pl->lc), "kv_layout_config_from") &&
           ok_call(kv_page_table_seq_blocks(s->pt, d->mla_seq, &pl->blocks, &pl->n_blocks),
                   "kv_page_table_seq_blocks");
}

void mla_decode_release(struct decode *d)
{
    if (d->mla_live)
        (void)ok_call(kv_page_table_seq_free(d->mla.s.pt, d->mla_seq), "kv_page_table_seq_free");
    d->mla_live = false;
}

/* The reference of one query head: softmax over all D dims, values the
 * first DV, in double. The generator's values are integers over a power
 * of two (q = qi / 64, the latent n * MLA_SCALE), so each score's dot
 * product is an exact integer sum. qi: [D]; K: [T][D], the integers n. */
static void mla_reference(const int16_t *qi, const int16_t *K, uint32_t T, float scale, double *ref)
{
    static double score[MAX_TOKENS];
    double m = -INFINITY, sum = 0;
    for (uint32_t t = 0; t < T; t++) {
        const int16_t *kr = K + (size_t)t * MLA_D;
        int32_t s = 0; /* |s| <= 576 * 128 * 8 */
        for (uint32_t e = 0; e < MLA_D; e++)
            s += (int32_t)qi[e] * kr[e];
        score[t] = (double)s / 64.0 * MLA_SCALE * scale;
        if (score[t] > m)
            m = score[t];
    }
    for (uint32_t e = 0; e < MLA_DV; e++)
        ref[e] = 0;
    for (uint32_t t = 0; t < T; t++) {
        const double w = exp(score[t] - m);
        const int16_t *kr = K + (size_t)t * MLA_D;
        sum += w;
        for (uint32_t e = 0; e < MLA_DV; e++)
            ref[e] += w * kr[e];
    }
    for (uint32_t e = 0; e < MLA_DV; e++)
        ref[e] = ref[e] / sum * MLA_SCALE;
}

/* Request r's latent read back through the page table, every byte against
 * the generator's encoding; then MLA decode attention per layer against the
 * reference. A mismatch is a failed check (true); false when the library
 * refused a call. */
bool mla_decode_check(struct decode *d, const struct request *r)
{
    struct side *s = &d->mla.s;
    const uint32_t T = r->n_tokens;
    int32_t indptr[2], last[1];
    struct kv_pages pages;
    if (!seq_pages(s, d->mla_seq, indptr, d->indices, MAX_TOKENS + 1, last, &pages))
        return false;
    const int64_t shape[4] = {MLA_L, T, 1, MLA_D};
    const size_t n = (size_t)MLA_L * T * MLA_D;
    struct kv_view kv_;
    if (!ok_call(kv_view_init(d->mla_k, n, KV_FP8_E4M3, 4, shape, &kv_), "kv_view_init (latent)"))
        return false;
    size_t i = 0;
    for (uint32_t l = 0; l < MLA_L; l++)
        for (uint32_t t = 0; t < T; t++)
            for (uint32_t e = 0; e < MLA_D; e++, i++) {
                const int v = mla_n(d->seed, r, l, t, e);
                d->mla_ek[i] = e4m3_of_int(v);
                d->mla_kn[i] = (int16_t)v;
            }
    if (!ok_call(kv_attn_read(s->pc, KV_ATTN_ALL_LAYERS, &pages, &kv_, NULL, NULL),
                 "kv_attn_read (MLA)"))
        return false;
    size_t bad = n;
    for (i = 0; i < n && bad == n; i++)
        if (d->mla_k[i] != d->mla_ek[i])
            bad = i;
    if (!check(bad == n,
               "MLA request %u (%u tokens, decode %s): latent of layer %zu token %zu dim %zu is "
               "0x%02x, the generator says 0x%02x",
               r->id, T, s->desc, bad / ((size_t)T * MLA_D), bad / MLA_D % T, bad % MLA_D,
               bad < n ? d->mla_k[bad] : 0, bad < n ? d->mla_ek[bad] : 0))
        return true;
    /* q [1][Hq][D] f32, out [1][Hq][DV] f32 */
    static float q[MLA_HQ * MLA_D], out[MLA_HQ * MLA_DV];
    static int16_t qi[MLA_HQ * MLA_D];
    double ref[MLA_DV];
    const float scale = 1.0f / sqrtf((float)MLA_D), ks = MLA_SCALE;
    const struct kv_scales sc = {&ks, NULL, 1, 0};
    const int64_t qshape[3] = {1, MLA_HQ, MLA_D}, oshape[3] = {1, MLA_HQ, MLA_DV};
    struct kv_view qv, ov;
    if (!ok_call(kv_view_init(q, sizeof(q), KV_F32, 3, qshape, &qv), "kv_view_init (q)") ||
        !ok_call(kv_view_init(out, sizeof(out), KV_F32, 3, oshape, &ov), "kv_view_init (out)"))
        return false;
    double max_err = 0;
    for (uint32_t l = 0; l < MLA_L; l++) {
        for (uint32_t h = 0; h < MLA_HQ; h++)
            for (uint32_t e = 0; e < MLA_D; e++)
                q[h * MLA_D + e] = gen_value(d->seed, 0x30000 + r->id, l, h, 0, e, 2);
        for (uint32_t j = 0; j < MLA_HQ * MLA_D; j++)
            qi[j] = (int16_t)lrintf(q[j] * 64.0f); /* exact: q = b / 64 */
        const uint64_t t0 = now_ns();
        if (!ok_call(kv_attn_decode_mla(s->pc, l, &qv, &pages, MLA_DV, scale, &sc, &ov),
                     "kv_attn_decode_mla"))
            return false;
        g_rep.mla_attn_ns += now_ns() - t0;
        g_rep.mla_attn_bytes += (uint64_t)T * MLA_D;
        const int16_t *K = d->mla_kn + (size_t)l * T * MLA_D; /* [T][D] */
        for (uint32_t h = 0; h < MLA_HQ; h++) {
            mla_reference(qi + h * MLA_D, K, T, scale, ref);
            for (uint32_t e = 0; e < MLA_DV; e++) {
                const double err = fabs(out[h * MLA_DV + e] - ref[e]);
                if (err > max_err)
                    max_err = err;
                if (err > 1e-3 * (1 + fabs(ref[e]))) {
                    check(false,
                          "MLA request %u (decode %s): attention layer %u head %u dim %u = %.6f, "
                          "reference %.6f",
                          r->id, s->desc, l, h, e, out[h * MLA_DV + e], ref[e]);
                    return true;
                }
            }
        }
    }
    if (max_err > g_rep.mla_attn_err)
        g_rep.mla_attn_err = max_err;
    check(true, "MLA attention");
    return true;
}

/* ---- prefill --------------------------------------------------------------------------------- */

/* Decode's latent layout from a placement, the request agreeing with the batch. */
bool mla_accept(const struct placement *pl, const struct request *reqs, uint32_t n_req,
                struct kv_layout *lo)
{
    if (!check(pl->group == MLA_GROUP && pl->req < n_req &&
                   pl->n_tokens == mla_request(&reqs[pl->req]).n_tokens,
               "MLA placement for request %u (group %u, %" PRIu64 " tokens) does not match the "
               "batch",
               pl->req, pl->group, pl->n_tokens))
        return false;
    const kv_status st = kv_layout_init(&pl->lc, lo);
    if (!check(st == KV_OK && lo->k_only,
               "MLA request %u: decode's layout is refused or not K-only: %s: %s", pl->req,
               kv_status_name(st), st ? kv_last_error() : "two planes"))
        return false;
    return check((uint64_t)pl->n_blocks * (uint64_t)lo->block_tokens >= pl->n_tokens &&
                     (uint64_t)(pl->n_blocks - 1) * (uint64_t)lo->block_tokens < pl->n_tokens,
                 "MLA request %u: %u blocks for %" PRIu64 " tokens of %" PRId64, pl->req,
                 pl->n_blocks, pl->n_tokens, lo->block_tokens);
}

/* Write request r's latent into a new sequence of prefill's latent cache. */
bool mla_prefill_write(struct prefill *p, const struct request *r, uint32_t *seq)
{
    struct side *s = &p->mla;
    const uint32_t T = r->n_tokens;
    if (!ok_call(kv_page_table_seq_create(s->pt, seq), "kv_page_table_seq_create (MLA)"))
        return false;
    const struct kv_token_range range = {0, T};
    const struct kv_vllm_export vx = {.slot_mapping = p->slots, .slot_mapping_len = T};
    if (!ok_call(kv_page_table_seq_append(s->pt, *seq, NULL, T), "kv_page_table_seq_append") ||
        !ok_call(kv_page_table_export_vllm(s->pt, seq, 1, &range, &vx),
                 "kv_page_table_export_vllm"))
        return false;
    size_t i = 0;
    for (uint32_t l = 0; l < MLA_L; l++)
        for (uint32_t t = 0; t < T; t++)
            for (uint32_t e = 0; e < MLA_D; e++)
                p->mla_k[i++] = (float)mla_n(p->seed, r, l, t, e) * MLA_SCALE;
    const int64_t shape[4] = {MLA_L, T, 1, MLA_D};
    struct kv_view kv_;
    const float ks = MLA_SCALE;
    const struct kv_scales sc = {&ks, NULL, 1, 0};
    return ok_call(kv_view_init(p->mla_k, i * sizeof(float), KV_F32, 4, shape, &kv_),
                   "kv_view_init (latent)") &&
           ok_call(kv_attn_write(s->pc, KV_ATTN_ALL_LAYERS, &kv_, NULL, p->slots, T, &sc),
                   "kv_attn_write (MLA)");
}

/* ---- the two roles --------------------------------------------------------------------------- */

/* Decode: place the MLA group's requests one at a time, each checked once
 * prefill's DONE arrived. mem: the latent arena's registration. */
bool decode_mla(struct decode *d, kv_xport *x, kv_xport_peer *peer, kv_xport_mem *mem,
                const struct request *reqs, uint32_t n_req)
{
    struct kv_xport_msg *msg = malloc(sizeof(*msg));
    unsigned char *buf = malloc(KV_XPORT_NOTIFY_MAX);
    bool ok = msg && buf;
    if (!ok)
        fail_msg("out of memory");
    const uint64_t t_start = now_ns();
    for (uint32_t i = 0; ok && i < mla_count(n_req); i++) {
        const struct request mr = mla_request(&reqs[i]), *r = &mr;
        struct placement pl;
        unsigned char blob[KV_XPORT_BLOB_MAX];
        size_t blob_len = 0, len = 0;
        ok = mla_decode_place(d, r, &pl);
        if (ok && i == 0) {
            ok = ok_call(kv_xport_mem_expose(peer, mem, blob, sizeof(blob), &blob_len),
                         "kv_xport_mem_expose (MLA)");
            pl.blob = blob;
            pl.blob_len = (uint32_t)blob_len;
        }
        ok = ok && place_encode(&pl, buf, KV_XPORT_NOTIFY_MAX, &len);
        if (ok && len == 0)
            ok = fail_msg("MLA request %u: the placement does not fit in a notification", r->id);
        ok = ok && send_msg(peer, TAG_MLA, buf, (uint32_t)len) &&
             ok_call(poll_msg(x, peer, msg), "kv_xport_notify_poll");
        if (!ok)
            break;
        if ((msg->tag != TAG_DONE && msg->tag != TAG_FAILED) || msg->len != 4 ||
            le32_get(msg->data) != r->id) {
            ok = fail_msg("MLA: unexpected notification: tag %" PRIu64 ", %u bytes", msg->tag,
                          msg->len);
            break;
        }
        g_rep.mla_requests++;
        if (check(msg->tag == TAG_DONE, "MLA request %u: prefill says its transfer failed",
                  r->id)) {
            const uint64_t before = g_rep.checks - g_rep.passed;
            ok = mla_decode_check(d, r);
            if (ok && g_rep.checks - g_rep.passed == before)
                g_rep.mla_ok++;
        }
        mla_decode_release(d);
    }
    g_rep.mla_wall_ns += now_ns() - t_start;
    free(msg);
    free(buf);
    return ok;
}

/* Prefill: one MLA placement (msg): write the latent, post the plan's runs
 * into decode's blocks with DONE behind them, wait, free. */
bool prefill_mla(struct prefill *p, const struct request *reqs, uint32_t n_req, kv_xport_peer *peer,
                 kv_xport_mem *mem, kv_xport_rmem **rmem, kv_plan **plan,
                 const struct kv_xport_msg *msg)
{
    struct placement pl;
    uint32_t blocks[KV_XPORT_NOTIFY_MAX / 4];
    struct kv_layout lo;
    char why[160];
    if (!place_decode(msg->data, msg->len, &pl, blocks, why, sizeof(why)))
        return fail_msg("bad MLA placement from decode: %s", why);
    unsigned char req_le[4];
    le32_put(req_le, pl.req);
    if (!mla_accept(&pl, reqs, n_req, &lo))
        return pl.req < n_req && send_msg(peer, TAG_FAILED, req_le, 4);
    if (pl.blob_len && !*rmem &&
        !ok_call(kv_xport_rmem_import(peer, pl.blob, pl.blob_len, rmem), "kv_xport_rmem_import"))
        return false;
    if (!*rmem)
        return fail_msg("MLA request %u: no exposure of decode's latent arena yet", pl.req);
    if (!*plan && !ok_call(kv_plan_create(p->mla.lo, &lo, NULL, plan), "kv_plan_create (MLA)"))
        return false;
    const struct request mr = mla_request(&reqs[pl.req]), *r = &mr;
    uint32_t seq = 0;
    const uint32_t *src;
    uint32_t n_src = 0;
    if (!mla_prefill_write(p, r, &seq) ||
        !ok_call(kv_page_table_seq_blocks(p->mla.pt, seq, &src, &n_src), "seq_blocks"))
        return false;
    const struct kv_xport_notify nt = {TAG_DONE, req_le, 4};
    kv_xport_xfer *x = NULL;
    kv_xport_state st = KV_XPORT_FAILED;
    const uint64_t t0 = now_ns();
    const kv_status pst = kv_xport_write_plan(peer, *plan, mem, 0, src, n_src, *rmem, 0, pl.blocks,
                                              pl.n_blocks, r->n_tokens, &nt, &x);
    bool ok = true;
    if (pst == KV_OK) {
        kv_status wst = kv_xport_xfer_wait(x, WAIT_MS, &st);
        if (wst == KV_ERR_TIMEOUT && kv_xport_xfer_cancel(x) == KV_OK)
            wst = kv_xport_xfer_wait(x, WAIT_MS, &st);
        if (wst != KV_OK)
            return ok_call(wst, "kv_xport_xfer_wait (MLA, after a cancel)");
        g_rep.mla_xfer_ns += now_ns() - t0;
        g_rep.mla_xfer_bytes += (uint64_t)r->n_tokens * MLA_TOKEN_BYTES;
        g_rep.mla_xfers++;
        if (kv_xport_xfer_free(x) != KV_OK)
            ok = fail_msg("kv_xport_xfer_free refused a terminal transfer");
    }
    if (pst != KV_OK)
        check(false, "MLA request %u: kv_xport_write_plan refused: %s: %s", r->id,
              kv_status_name(pst), kv_last_error());
    else
        check(st == KV_XPORT_DONE, "MLA request %u: the transfer ended %s", r->id, xstate_name(st));
    if (!ok_call(kv_page_table_seq_free(p->mla.pt, seq), "kv_page_table_seq_free (MLA)"))
        return false;
    if (ok && st != KV_XPORT_DONE)
        ok = send_msg(peer, TAG_FAILED, req_le, 4);
    return ok;
}

/* --local: the same group in one process, the transfer by kv_plan_copy. */
bool local_mla(struct prefill *p, struct decode *d, const struct request *reqs, uint32_t n_req)
{
    kv_plan *plan = NULL;
    bool ok = true;
    const uint64_t t_start = now_ns();
    for (uint32_t i = 0; ok && i < mla_count(n_req); i++) {
        const struct request mr = mla_request(&reqs[i]), *r = &mr;
        struct placement dpl, pl;
        struct kv_layout lo;
        uint32_t seq = 0, blocks[KV_XPORT_NOTIFY_MAX / 4];
        unsigned char buf[KV_XPORT_NOTIFY_MAX];
        size_t len = 0;
        char why[160];
        ok = mla_decode_place(d, r, &dpl) && place_encode(&dpl, buf, sizeof(buf), &len);
        if (ok && (len == 0 || !place_decode(buf, len, &pl, blocks, why, sizeof(why))))
            ok = fail_msg("MLA request %u: the placement does not survive its encoding", r->id);
        ok = ok && mla_accept(&pl, reqs, n_req, &lo) && mla_prefill_write(p, r, &seq);
        if (ok && !plan)
            ok = ok_call(kv_plan_create(p->mla.lo, &lo, NULL, &plan), "kv_plan_create (MLA)");
        const uint32_t *src;
        uint32_t n_src = 0;
        ok = ok && ok_call(kv_page_table_seq_blocks(p->mla.pt, seq, &src, &n_src), "seq_blocks");
        const uint64_t t0 = now_ns();
        ok = ok && ok_call(kv_plan_copy(plan, p->mla.pc, src, n_src, d->mla.s.pc, pl.blocks,
                                        pl.n_blocks, r->n_tokens),
                           "kv_plan_copy (MLA)");
        if (ok) {
            g_rep.mla_xfer_ns += now_ns() - t0;
            g_rep.mla_xfer_bytes += (uint64_t)r->n_tokens * MLA_TOKEN_BYTES;
            g_rep.mla_xfers++;
        }
        ok = ok && ok_call(kv_page_table_seq_free(p->mla.pt, seq), "kv_page_table_seq_free");
        const uint64_t before = g_rep.checks - g_rep.passed;
        ok = ok && mla_decode_check(d, r);
        g_rep.mla_requests++;
        if (ok && g_rep.checks - g_rep.passed == before)
            g_rep.mla_ok++;
        mla_decode_release(d);
    }
    kv_plan_destroy(plan);
    g_rep.mla_wall_ns += now_ns() - t_start;
    return ok;
}
