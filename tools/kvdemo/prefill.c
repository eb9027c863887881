/*
 * prefill.c - prefill's work on a request.
 *
 * Prefill has one cache (N 16, NHD, layer-major) with prefix caching on, and
 * a host offload tier. For each request it opens a sequence from the prefix
 * the page table already holds, appends the rest, and writes the generator's
 * K/V into the new slots with the write kernel (kv_attn_write); the role
 * (prefill_role.c, or local.c) then moves the blocks to decode.
 *
 * The first request with the shared prefix also exercises the tier: its
 * prefix blocks are stored (prefill_offload_store), and once the request is
 * freed every free and cached block of the pool is scrambled, the prefix
 * loaded back and compared bit for bit (prefill_offload_roundtrip). Later
 * prefix requests fetch what the pool lost from the tier first, so the page
 * table's prefix match finds all of it.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "kvdemo.h"

bool prefill_init(struct prefill *p, uint64_t seed)
{
    memset(p, 0, sizeof(*p));
    p->seed = seed;
    struct kv_layout_config lc;
    kv_layout_config_init(&lc);
    lc.num_layers = L_LAYERS;
    lc.num_blocks = PF_BLOCKS;
    lc.block_tokens = PF_N;
    lc.num_heads = H_KV;
    lc.head_dim = D_HEAD;
    lc.dtype = DTYPE;
    if (!side_make(&p->s, &lc, true))
        return false;
    struct kv_offload_config oc;
    kv_offload_config_init(&oc);
    oc.capacity_bytes = 16u << 20;
    oc.mem = KV_OFFLOAD_MEM_HOST;
    if (!ok_call(kv_offload_create(&oc, &p->off), "kv_offload_create"))
        return false;
    const size_t elems = (size_t)L_LAYERS * MAX_TOKENS * H_KV * D_HEAD;
    p->k = malloc(elems * ELEM);
    p->v = malloc(elems * ELEM);
    p->slots = malloc(MAX_TOKENS * sizeof(*p->slots));
    p->tokens = malloc(MAX_TOKENS * sizeof(*p->tokens));
    mla_layout(false, &lc);
    if (!side_make(&p->mla, &lc, false))
        return false;
    p->mla_k = malloc((size_t)MLA_L * MAX_TOKENS * MLA_D * sizeof(float));
    if (!p->k || !p->v || !p->slots || !p->tokens || !p->mla_k)
        return fail_msg("out of memory");
    return true;
}

void prefill_fini(struct prefill *p)
{
    kv_offload_destroy(p->off);
    side_free(&p->s);
    side_free(&p->mla);
    free(p->mla_k);
    free(p->k);
    free(p->v);
    free(p->slots);
    free(p->tokens);
}

static bool offload_wait(kv_offload_op *op, kv_offload_state *st)
{
    if (!ok_call(kv_offload_wait(op, WAIT_MS, st), "kv_offload_wait"))
        return false;
    return true;
}

/* A later prefix request: the prefix blocks the pool lost come back from the
 * tier, so the page table's prefix match finds all of them. */
static bool prefill_prefix_fetch(struct prefill *p)
{
    uint32_t held[PREFIX_BLOCKS], n_found = 0;
    if (!ok_call(kv_block_pool_lookup(p->s.pool, p->prefix_hash, PREFIX_BLOCKS, held, &n_found),
                 "kv_block_pool_lookup"))
        return false;
    bool ok = true;
    if (n_found < PREFIX_BLOCKS) {
        const uint32_t n = PREFIX_BLOCKS - n_found;
        kv_offload_op *op = NULL;
        const uint64_t t0 = now_ns();
        ok = ok_call(kv_offload_load(p->off, p->s.c, p->prefix_hash + n_found, n, &op),
                     "kv_offload_load");
        kv_offload_state st = KV_OFFLOAD_PENDING;
        if (ok && (ok = offload_wait(op, &st))) {
            stage_add(ST_LOAD, n * block_data_bytes(&p->s), t0);
            const struct kv_offload_result *res;
            uint32_t nr = 0;
            ok = ok_call(kv_offload_results(op, &res, &nr), "kv_offload_results");
            for (uint32_t i = 0; ok && i < nr; i++) {
                check(res[i].status == KV_OK, "offload load of prefix block %u: %s", n_found + i,
                      kv_status_name(res[i].status));
                if (res[i].status == KV_OK)
                    ok = ok_call(kv_block_pool_release(p->s.pool, &res[i].block, 1),
                                 "kv_block_pool_release");
            }
            check(st == KV_OFFLOAD_DONE, "offload load ended %s", kv_offload_state_name(st));
        }
        if (op && kv_offload_op_free(op) != KV_OK)
            ok = fail_msg("kv_offload_op_free refused a terminal op");
    }
    /* the found blocks stay held until the sequence has taken its own refs */
    if (n_found && !ok_call(kv_block_pool_release(p->s.pool, held, n_found), "release"))
        return false;
    return ok;
}

/* Write request r into a new sequence of the prefill cache: *seq, blocks. */
bool prefill_request(struct prefill *p, const struct request *r, uint32_t *seq)
{
    for (uint32_t t = 0; t < r->n_tokens; t++)
        p->tokens[t] = token_id(r, t);
    if (r->prefix && p->prefix_stored && !prefill_prefix_fetch(p))
        return false;
    uint64_t cached = 0;
    if (!ok_call(
            kv_page_table_seq_create_from_prefix(p->s.pt, p->tokens, r->n_tokens, seq, &cached),
            "kv_page_table_seq_create_from_prefix"))
        return false;
    if (r->prefix && p->prefix_stored)
        check(cached == PREFIX_TOKENS,
              "request %u: prefix reuse found %" PRIu64 " of %d tokens (pool + offload tier)",
              r->id, cached, PREFIX_TOKENS);
    const uint32_t T = r->n_tokens - (uint32_t)cached;
    if (!ok_call(kv_page_table_seq_append(p->s.pt, *seq, p->tokens + cached, T),
                 "kv_page_table_seq_append"))
        return false;
    const struct kv_token_range range = {cached, T};
    const struct kv_vllm_export vx = {.slot_mapping = p->slots, .slot_mapping_len = T};
    if (!ok_call(kv_page_table_export_vllm(p->s.pt, seq, 1, &range, &vx),
                 "kv_page_table_export_vllm"))
        return false;
    gen_kv(p->seed, r, (uint32_t)cached, T, p->k, p->v);
    struct kv_view kv_, vv;
    if (!views_of_kv(p->k, p->v, T, &kv_, &vv))
        return false;
    const uint64_t t0 = now_ns();
    if (!ok_call(kv_attn_write(p->s.pc, KV_ATTN_ALL_LAYERS, &kv_, &vv, p->slots, T, NULL),
                 "kv_attn_write"))
        return false;
    stage_add(ST_WRITE, (uint64_t)T * TOKEN_BYTES, t0);
    return true;
}

/* The first prefix request, once written: store its prefix blocks in the
 * tier (they carry the hashes the page table committed). */
bool prefill_offload_store(struct prefill *p, uint32_t seq, unsigned char *snap)
{
    const uint32_t *blocks;
    uint32_t nb = 0;
    if (!ok_call(kv_page_table_seq_blocks(p->s.pt, seq, &blocks, &nb), "kv_page_table_seq_blocks"))
        return false;
    if (nb < PREFIX_BLOCKS)
        return fail_msg("prefix request holds %u blocks, fewer than the prefix", nb);
    const uint64_t bb = block_data_bytes(&p->s);
    for (uint32_t i = 0; i < PREFIX_BLOCKS; i++) {
        if (!ok_call(kv_block_pool_block_hash(p->s.pool, blocks[i], &p->prefix_hash[i]),
                     "kv_block_pool_block_hash (prefix block)"))
            return false;
        block_bytes(&p->s, blocks[i], snap + i * bb, NULL, 0);
    }
    kv_offload_op *op = NULL;
    const uint64_t t0 = now_ns();
    if (!ok_call(kv_offload_store(p->off, p->s.c, blocks, PREFIX_BLOCKS, &op), "kv_offload_store"))
        return false;
    kv_offload_state st = KV_OFFLOAD_PENDING;
    bool ok = offload_wait(op, &st);
    if (ok) {
        stage_add(ST_STORE, PREFIX_BLOCKS * bb, t0);
        check(st == KV_OFFLOAD_DONE, "offload store of the prefix ended %s",
              kv_offload_state_name(st));
    }
    if (kv_offload_op_free(op) != KV_OK)
        ok = fail_msg("kv_offload_op_free refused a terminal op");
    p->prefix_stored = ok && st == KV_OFFLOAD_DONE;
    return ok;
}

/* After the first prefix request is freed: take every free and cached block
 * of the pool (evicting the prefix's hashes), scramble them, give them back,
 * load the prefix from the tier and compare it with the snapshot. */
bool prefill_offload_roundtrip(struct prefill *p, const uint32_t *old_ids,
                               const unsigned char *snap)
{
    struct kv_block_pool_stats ps;
    kv_block_pool_stats_get(p->s.pool, &ps);
    const uint32_t n = ps.free_blocks + ps.cached_blocks;
    uint32_t *ids = malloc((size_t)n * sizeof(*ids));
    const uint64_t bb = block_data_bytes(&p->s);
    unsigned char *tmp = malloc(bb);
    if (!ids || !tmp) {
        free(ids);
        free(tmp);
        return fail_msg("out of memory");
    }
    bool ok = ok_call(kv_block_pool_alloc(p->s.pool, n, ids), "kv_block_pool_alloc (scramble)");
    for (uint32_t i = 0; ok && i < n; i++)
        block_bytes(&p->s, ids[i], NULL, NULL, 0xa5);
    for (uint32_t i = 0; ok && i < PREFIX_BLOCKS; i++) {
        block_bytes(&p->s, old_ids[i], tmp, NULL, 0);
        check(memcmp(tmp, snap + i * bb, bb) != 0, "scramble left prefix block %u intact",
              old_ids[i]);
    }
    uint32_t held[PREFIX_BLOCKS], found = 0;
    if (ok)
        ok = ok_call(kv_block_pool_release(p->s.pool, ids, n), "kv_block_pool_release");
    if (ok)
        ok = ok_call(kv_block_pool_lookup(p->s.pool, p->prefix_hash, PREFIX_BLOCKS, held, &found),
                     "kv_block_pool_lookup");
    if (ok) {
        check(found == 0, "the pool still holds %u prefix blocks after the scramble", found);
        if (found)
            ok = ok_call(kv_block_pool_release(p->s.pool, held, found), "release");
    }
    kv_offload_op *op = NULL;
    kv_offload_state st = KV_OFFLOAD_PENDING;
    const uint64_t t0 = now_ns();
    if (ok)
        ok = ok_call(kv_offload_load(p->off, p->s.c, p->prefix_hash, PREFIX_BLOCKS, &op),
                     "kv_offload_load");
    if (ok && (ok = offload_wait(op, &st))) {
        stage_add(ST_LOAD, PREFIX_BLOCKS * bb, t0);
        const struct kv_offload_result *res;
        uint32_t nr = 0;
        ok = ok_call(kv_offload_results(op, &res, &nr), "kv_offload_results");
        for (uint32_t i = 0; ok && i < nr; i++) {
            if (!check(res[i].status == KV_OK, "offload load of prefix block %u: %s", i,
                       kv_status_name(res[i].status)))
                continue;
            block_bytes(&p->s, res[i].block, tmp, NULL, 0);
            check(memcmp(tmp, snap + i * bb, bb) == 0,
                  "prefix block %u (hash %016" PRIx64 ") loaded into block %u is not "
                  "bit-identical to what was stored",
                  i, p->prefix_hash[i], res[i].block);
            ok = ok_call(kv_block_pool_release(p->s.pool, &res[i].block, 1), "release");
        }
        check(st == KV_OFFLOAD_DONE, "offload load ended %s", kv_offload_state_name(st));
    }
    if (op && kv_offload_op_free(op) != KV_OK)
        ok = fail_msg("kv_offload_op_free refused a terminal op");
    free(ids);
    free(tmp);
    return ok;
}
