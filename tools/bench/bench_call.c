/*
 * bench_call.c - the cost of one small kernel call from C, the number the
 * Python package's per-call overhead is measured against
 * (scripts/bench_python.py runs this case in the same process tree and
 * prints both).
 *
 *   call.write_token  kv_attn_write of one token (K and V [1][8][128] bf16,
 *                     4 KiB) into one slot of a Llama-like cache layer (N 16,
 *                     H 8, D 128), the slot moving through 64 blocks;
 *                     microseconds per call, median of runs of 20,000 calls.
 * Baseline: memcpy of the same 4 KiB to the same place, per call (what the
 * call would cost with no validation or dispatch). The last token written
 * is read back and compared before the case reports.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "kv_attn.h"
#include "kv_cache.h"

static void kvb__call_write(void)
{
    const char *bench = "call.write_token", *name = "bf16/N16/H8/D128/1token";
    if (!kvb_selected(bench, name))
        return;
    kvb_progress(bench, name);
    struct kv_cache_config cc;
    kv_cache_config_init(&cc);
    cc.layout.num_layers = 1;
    cc.layout.num_blocks = 65;
    cc.layout.block_tokens = 16;
    cc.layout.num_heads = 8;
    cc.layout.head_dim = 128;
    cc.layout.dtype = KV_BF16;
    cc.max_seqs = 1;
    kv_cache *c = NULL;
    struct kv_paged_cache pc;
    if (kv_cache_create(&cc, &c) != KV_OK || kv_cache_paged(c, &pc) != KV_OK) {
        kvb_failed(bench, name, "cache: %s", kv_last_error());
        kv_cache_destroy(c);
        return;
    }
    static uint16_t kbuf[8 * 128], vbuf[8 * 128];
    kvb_fill_random(kbuf, sizeof(kbuf), 3);
    kvb_fill_random(vbuf, sizeof(vbuf), 4);
    const int64_t shape[3] = {1, 8, 128};
    struct kv_view k, v;
    if (kv_view_init(kbuf, sizeof(kbuf), KV_BF16, 3, shape, &k) != KV_OK ||
        kv_view_init(vbuf, sizeof(vbuf), KV_BF16, 3, shape, &v) != KV_OK)
        exit(2);
    const int calls = kvb_quick() ? 2000 : 20000, runs = kvb_runs();
    double *tc = malloc(sizeof(double) * (size_t)runs), *tb = malloc(sizeof(double) * (size_t)runs);
    if (!tc || !tb)
        exit(2);
    int64_t slot = 0;
    kv_status st = KV_OK;
    for (int r = -1; r < runs && st == KV_OK; r++) {
        double t0 = kvb_now();
        for (int i = 0; i < calls && st == KV_OK; i++) {
            slot = (int64_t)((i * 17) % (64 * 16)) + 16; /* blocks 1..64 */
            st = kv_attn_write(pc, 0, &k, &v, &slot, 1, NULL);
        }
        double t1 = kvb_now();
        for (int i = 0; i < calls; i++) { /* the same bytes to the same rows */
            const int64_t s = (int64_t)((i * 17) % (64 * 16)) + 16;
            memcpy((char *)pc.base + (s / 16) * pc.layout.stride_block_bytes +
                       (s % 16) * pc.layout.stride_token_bytes,
                   kbuf, sizeof(kbuf));
            memcpy((char *)pc.base + pc.layout.stride_kv_bytes +
                       (s / 16) * pc.layout.stride_block_bytes +
                       (s % 16) * pc.layout.stride_token_bytes,
                   vbuf, sizeof(vbuf));
        }
        double t2 = kvb_now();
        if (r >= 0) {
            tc[r] = (t1 - t0) / calls * 1e6;
            tb[r] = (t2 - t1) / calls * 1e6;
        }
    }
    if (st != KV_OK) {
        kvb_failed(bench, name, "kv_attn_write: %s", kv_last_error());
    } else {
        st = kv_attn_write(pc, 0, &k, &v, &slot, 1, NULL);
        const char *row = (const char *)pc.base + (slot / 16) * pc.layout.stride_block_bytes +
                          (slot % 16) * pc.layout.stride_token_bytes;
        if (st != KV_OK || memcmp(row, kbuf, sizeof(kbuf)) != 0)
            kvb_mismatch(bench, name, "the token written is not where the layout says");
        kvb_emit_us(bench, name, kvb_median(tc, runs), "memcpy_token", kvb_median(tb, runs), runs);
    }
    free(tc);
    free(tb);
    kv_cache_destroy(c);
}

KVB_REGISTER("call", kvb__call_write)
