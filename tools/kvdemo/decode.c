/*
 * decode.c - decode's work on a request.
 *
 * Decode keeps one cache per layout group (group_layout: page sizes 8..64,
 * NHD and HND, layer- and block-major, padded), none of them prefill's.
 * Each pool is churned first: half its blocks stay held for the whole run
 * as "other sequences" with a pattern, so a request gets ids spread over
 * the pool, and a transfer that strays into a held block is caught at the
 * end (decode_group_check).
 *
 * Per request: decode_place allocates the blocks and fills the placement
 * that prefill is sent (placement.c); once the data has arrived,
 * decode_check reads it back through the page table (kv_attn_read),
 * compares every byte with the generator, and runs decode attention per
 * layer against a plain double-precision reference; decode_release frees
 * the sequence.
 */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvdemo.h"

/* The decode layouts, one per request group: page size, order, arrangement
 * and padding all differ from prefill's (N 16, NHD, layer-major, unpadded). */
void group_layout(uint32_t g, struct kv_layout_config *lc)
{
    static const struct {
        int64_t n;
        kv_order order;
        kv_arrange arrange;
        int64_t pad_elems, stride_extra_bytes;
    } v[N_GROUPS] = {
        {32, KV_ORDER_NHD, KV_ARRANGE_LAYER_MAJOR, 0, 0},
        {16, KV_ORDER_HND, KV_ARRANGE_BLOCK_MAJOR, 0, 0},
        {8, KV_ORDER_NHD, KV_ARRANGE_BLOCK_MAJOR, 64, 0},
        {64, KV_ORDER_HND, KV_ARRANGE_LAYER_MAJOR, 0, 4096},
    };
    kv_layout_config_init(lc);
    lc->num_layers = L_LAYERS;
    lc->block_tokens = v[g].n;
    lc->num_blocks = 3 * MAX_TOKENS / v[g].n + 1; /* half held by "other sequences" */
    lc->num_heads = H_KV;
    lc->head_dim = D_HEAD;
    lc->dtype = DTYPE;
    lc->order = v[g].order;
    lc->arrange = v[g].arrange;
    lc->block_pad_elems = v[g].pad_elems;
    if (v[g].stride_extra_bytes)
        lc->block_stride_bytes = v[g].n * H_KV * D_HEAD * ELEM + v[g].stride_extra_bytes;
}

/* The pattern of held block b. */
static unsigned char ballast_fill(uint32_t b)
{
    return (unsigned char)(0x11 + b * 7);
}

/* Churn: take every block, give back half of them (the odd positions) in a
 * shuffled order, keep the other half held and patterned. Requests then get
 * ids spread over [1, B), many of them high. */
bool decode_group_make(struct decode_group *dg, const struct kv_layout_config *lc, uint64_t seed)
{
    memset(dg, 0, sizeof(*dg));
    if (!side_make(&dg->s, lc, false))
        return false;
    const uint32_t n = (uint32_t)lc->num_blocks - 1;
    uint32_t *ids = malloc((size_t)n * sizeof(*ids));
    dg->ballast = malloc((size_t)n * sizeof(*ids));
    if (!ids || !dg->ballast) {
        free(ids);
        return fail_msg("out of memory");
    }
    if (!ok_call(kv_block_pool_alloc(dg->s.pool, n, ids), "kv_block_pool_alloc (churn)")) {
        free(ids);
        return false;
    }
    uint64_t s = seed;
    for (uint32_t i = n - 1; i > 0; i--) {
        const uint32_t j = (uint32_t)(rng_next(&s) % (i + 1));
        const uint32_t t = ids[i];
        ids[i] = ids[j];
        ids[j] = t;
    }
    uint32_t n_free = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (i % 2) {
            ids[n_free++] = ids[i];
        } else {
            dg->ballast[dg->n_ballast++] = ids[i];
            block_bytes(&dg->s, ids[i], NULL, NULL, ballast_fill(ids[i]));
        }
    }
    const bool ok = ok_call(kv_block_pool_release(dg->s.pool, ids, n_free), "release (churn)");
    free(ids);
    return ok;
}

static bool decode_group_init(struct decode_group *dg, uint32_t g, uint64_t seed)
{
    struct kv_layout_config lc;
    group_layout(g, &lc);
    return decode_group_make(dg, &lc, seed ^ (0x51ed + g));
}

/* The blocks other sequences hold were never written by a transfer. */
void decode_group_check(struct decode_group *dg, uint32_t g)
{
    const uint64_t bb = block_data_bytes(&dg->s);
    unsigned char *tmp = malloc(bb);
    if (!tmp) {
        fail_msg("out of memory");
        return;
    }
    uint32_t bad = 0, first = 0;
    for (uint32_t i = 0; i < dg->n_ballast; i++) {
        block_bytes(&dg->s, dg->ballast[i], tmp, NULL, 0);
        const unsigned char f = ballast_fill(dg->ballast[i]);
        for (uint64_t j = 0; j < bb; j++)
            if (tmp[j] != f) {
                if (!bad++)
                    first = dg->ballast[i];
                break;
            }
    }
    check(bad == 0, "group %u (%s): %u blocks held by other sequences were overwritten (first: %u)",
          g, dg->s.desc, bad, first);
    free(tmp);
}

bool decode_init(struct decode *d, uint64_t seed)
{
    memset(d, 0, sizeof(*d));
    d->seed = seed;
    for (uint32_t g = 0; g < N_GROUPS; g++)
        if (!decode_group_init(&d->g[g], g, seed))
            return false;
    const size_t elems = (size_t)L_LAYERS * MAX_TOKENS * H_KV * D_HEAD;
    d->k = malloc(elems * ELEM);
    d->v = malloc(elems * ELEM);
    d->ek = malloc(elems * ELEM);
    d->ev = malloc(elems * ELEM);
    d->indices = malloc((MAX_TOKENS + 1) * sizeof(*d->indices));
    struct kv_layout_config mlc;
    mla_layout(true, &mlc);
    if (!decode_group_make(&d->mla, &mlc, seed ^ (0x51ed + MLA_GROUP)))
        return false;
    const size_t mla_elems = (size_t)MLA_L * MAX_TOKENS * MLA_D;
    d->mla_k = malloc(mla_elems);
    d->mla_ek = malloc(mla_elems);
    d->mla_kn = malloc(mla_elems * sizeof(*d->mla_kn));
    if (!d->k || !d->v || !d->ek || !d->ev || !d->indices || !d->mla_k || !d->mla_ek || !d->mla_kn)
        return fail_msg("out of memory");
    return true;
}

void decode_fini(struct decode *d)
{
    for (uint32_t g = 0; g < N_GROUPS; g++) {
        side_free(&d->g[g].s);
        free(d->g[g].ballast);
    }
    free(d->k);
    free(d->v);
    free(d->ek);
    free(d->ev);
    free(d->indices);
    side_free(&d->mla.s);
    free(d->mla.ballast);
    free(d->mla_k);
    free(d->mla_ek);
    free(d->mla_kn);
}

/* Allocate request r's blocks in its group's cache. */
bool decode_place(struct decode *d, const struct request *r, struct placement *pl)
{
    const uint32_t g = r->id % N_GROUPS;
    struct decode_group *dg = &d->g[g];
    struct inflight *f = &d->fl[r->id];
    if (!ok_call(kv_page_table_seq_create(dg->s.pt, &f->seq), "kv_page_table_seq_create"))
        return false;
    if (!ok_call(kv_page_table_seq_append(dg->s.pt, f->seq, NULL, r->n_tokens),
                 "kv_page_table_seq_append")) {
        if (kv_page_table_seq_free(dg->s.pt, f->seq) != KV_OK)
            fail_msg("kv_page_table_seq_free: %s", kv_last_error());
        return false;
    }
    f->live = true;
    f->req = r->id;
    const uint32_t *ids;
    uint32_t nb = 0;
    if (kv_page_table_seq_blocks(dg->s.pt, f->seq, &ids, &nb) == KV_OK)
        for (uint32_t i = 0; i < nb; i++) {
            if (!g_rep.id_min || ids[i] < g_rep.id_min)
                g_rep.id_min = ids[i];
            if (ids[i] > g_rep.id_max)
                g_rep.id_max = ids[i];
        }
    memset(pl, 0, sizeof(*pl));
    pl->req = r->id;
    pl->group = g;
    pl->n_tokens = r->n_tokens;
    return ok_call(kv_layout_config_from(dg->s.lo, &pl->lc), "kv_layout_config_from") &&
           ok_call(kv_page_table_seq_blocks(dg->s.pt, f->seq, &pl->blocks, &pl->n_blocks),
                   "kv_page_table_seq_blocks");
}

void decode_release(struct decode *d, uint32_t req)
{
    struct inflight *f = &d->fl[req];
    if (!f->live)
        return;
    (void)ok_call(kv_page_table_seq_free(d->g[req % N_GROUPS].s.pt, f->seq),
                  "kv_page_table_seq_free");
    f->live = false;
}

/* The plain reference of decode attention for one query head against its KV
 * head kh, in double: out_ref[e] = sum_t softmax_t(q . K[t] * scale) V[t][e].
 * K, V: [T][H][D] bf16 (one layer of the generator's K/V); q: [D] f32. */
static void attn_reference(const float *q, const uint16_t *K, const uint16_t *V, uint32_t T,
                           uint32_t kh, float scale, double *out_ref)
{
    static double score[MAX_TOKENS];
    double m = -INFINITY, sum = 0;
    for (uint32_t t = 0; t < T; t++) {
        double s = 0;
        const uint16_t *kr = K + ((size_t)t * H_KV + kh) * D_HEAD;
        for (uint32_t e = 0; e < D_HEAD; e++)
            s += (double)q[e] * demo_bf16_to_f32(kr[e]);
        score[t] = s * scale;
        if (score[t] > m)
            m = score[t];
    }
    for (uint32_t t = 0; t < T; t++)
        sum += score[t] = exp(score[t] - m);
    for (uint32_t e = 0; e < D_HEAD; e++) {
        double acc = 0;
        for (uint32_t t = 0; t < T; t++)
            acc += score[t] * demo_bf16_to_f32(V[((size_t)t * H_KV + kh) * D_HEAD + e]);
        out_ref[e] = acc / sum;
    }
}

/* Decode attention of request r, one query per layer, against the plain
 * reference over the generator's K/V (d->ek, d->ev). A mismatch is a failed
 * check (true: counted); false when the library refused a call. */
static bool decode_attention(struct decode *d, const struct request *r,
                             const struct kv_pages *pages)
{
    const struct decode_group *dg = &d->g[r->id % N_GROUPS];
    const uint32_t T = r->n_tokens;
    /* one query per request and layer: q [1][Hq][D] f32, out [1][Hq][D] f32 */
    float q[H_Q * D_HEAD], out[H_Q * D_HEAD];
    double ref[D_HEAD];
    const float scale = 1.0f / sqrtf((float)D_HEAD);
    const int64_t qshape[3] = {1, H_Q, D_HEAD};
    struct kv_view qv, ov;
    if (!ok_call(kv_view_init(q, sizeof(q), KV_F32, 3, qshape, &qv), "kv_view_init (q)") ||
        !ok_call(kv_view_init(out, sizeof(out), KV_F32, 3, qshape, &ov), "kv_view_init (out)"))
        return false;
    double max_err = 0;
    for (uint32_t l = 0; l < L_LAYERS; l++) {
        for (uint32_t h = 0; h < H_Q; h++)
            for (uint32_t e = 0; e < D_HEAD; e++)
                q[h * D_HEAD + e] = gen_value(d->seed, 0x10000 + r->id, l, 0, h, e, 2);
        const uint64_t t0 = now_ns();
        if (!ok_call(kv_attn_decode(dg->s.pc, l, &qv, pages, scale, NULL, &ov), "kv_attn_decode"))
            return false;
        stage_add(ST_ATTN, (uint64_t)T * TOKEN_BYTES / L_LAYERS, t0);
        const uint16_t *K = d->ek + (size_t)l * T * H_KV * D_HEAD; /* [T][H][D] */
        const uint16_t *V = d->ev + (size_t)l * T * H_KV * D_HEAD; /* [T][H][D] */
        for (uint32_t h = 0; h < H_Q; h++) {
            attn_reference(q + h * D_HEAD, K, V, T, h / (H_Q / H_KV), scale, ref);
            for (uint32_t e = 0; e < D_HEAD; e++) {
                const double err = fabs(out[h * D_HEAD + e] - ref[e]);
                if (err > max_err)
                    max_err = err;
                if (err > 1e-3 * (1 + fabs(ref[e]))) {
                    check(false,
                          "request %u (decode %s): attention layer %u head %u dim %u = %.6f, "
                          "reference %.6f",
                          r->id, dg->s.desc, l, h, e, out[h * D_HEAD + e], ref[e]);
                    return true;
                }
            }
        }
    }
    if (max_err > g_rep.attn_max_err)
        g_rep.attn_max_err = max_err;
    check(true, "attention");
    return true;
}

/* Read request r back through the page table, compare every byte with the
 * generator, run decode attention per layer against a plain reference.
 * A mismatch is a failed check (true: counted); false when the library
 * refused a call. */
bool decode_check(struct decode *d, const struct request *r)
{
    struct decode_group *dg = &d->g[r->id % N_GROUPS];
    const uint32_t T = r->n_tokens;
    int32_t indptr[2], last[1];
    struct kv_pages pages;
    if (!seq_pages(&dg->s, d->fl[r->id].seq, indptr, d->indices, MAX_TOKENS + 1, last, &pages))
        return false;
    struct kv_view kv_, vv;
    if (!views_of_kv(d->k, d->v, T, &kv_, &vv))
        return false;
    gen_kv(d->seed, r, 0, T, d->ek, d->ev); /* the expectation: not timed */
    if (d->fault && r->id == d->fault_req) {
        /* --fault: one bit of one transferred block flipped after the transfer */
        unsigned char *p = (unsigned char *)dg->s.pc.base;
        struct kv_byte_runs br;
        if (kv_layout_block_runs(dg->s.lo, (uint32_t)d->indices[0], &br) == KV_OK)
            p[br.first_offset_bytes + 2 * D_HEAD + 1] ^= 0x10;
        printf("  decode: --fault: flipped a bit of request %u's block %d\n", r->id, d->indices[0]);
    }
    const uint64_t t0 = now_ns();
    if (!ok_call(kv_attn_read(dg->s.pc, KV_ATTN_ALL_LAYERS, &pages, &kv_, &vv, NULL),
                 "kv_attn_read"))
        return false;
    const size_t n = (size_t)L_LAYERS * T * H_KV * D_HEAD;
    size_t bad = n;
    int plane = 0;
    for (size_t i = 0; i < n && bad == n; i++) {
        if (d->k[i] != d->ek[i])
            bad = i;
        else if (d->v[i] != d->ev[i])
            bad = i, plane = 1;
    }
    stage_add(ST_VERIFY, (uint64_t)T * TOKEN_BYTES, t0);
    if (!check(bad == n,
               "request %u (%u tokens, decode %s): %s of layer %zu token %zu head %zu dim %zu "
               "is 0x%04x, the generator says 0x%04x",
               r->id, T, dg->s.desc, plane ? "V" : "K", bad / ((size_t)T * H_KV * D_HEAD),
               bad / (H_KV * D_HEAD) % T, bad / D_HEAD % H_KV, bad % D_HEAD,
               bad < n ? (plane ? d->v[bad] : d->k[bad]) : 0,
               bad < n ? (plane ? d->ev[bad] : d->ek[bad]) : 0))
        return true; /* counted; attention over wrong data says nothing more */
    return decode_attention(d, r, &pages);
}
