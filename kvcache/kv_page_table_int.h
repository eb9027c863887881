/*
 * kv_page_table_int.h - the page table's state, shared by kv_page_table.c
 * (lifetime, sequences, prefix reuse, copy-on-write, queries) and
 * kv_page_table_export.c (the vLLM and FlashInfer exports). Module-private.
 */
#ifndef KV_PAGE_TABLE_INT_H
#define KV_PAGE_TABLE_INT_H

#include <stdbool.h>
#include <stdint.h>

#include "kv_page_table.h"

/*
 * One sequence. Invariants (checked by seq_check() in debug builds):
 *
 *     live  => n_blocks == ceil(n_tokens / N)
 *     n_committed <= n_blocks <= cap,  n_blocks <= max_blocks_per_seq
 *     blocks [0, n_committed) are sealed: hashes[i] is block i's chained hash
 *     prefix caching off => n_committed == 0, hashes == tokens == NULL
 */
struct kv__seq {
    uint32_t *blocks; /* [cap] physical block ids */
    uint64_t *hashes; /* [cap] chained hash of committed block i (prefix caching only) */
    int32_t *tokens;  /* [cap * N] token ids (prefix caching only) */
    uint32_t cap;     /* blocks the arrays can hold */
    uint32_t n_blocks;
    uint32_t n_committed;
    uint64_t n_tokens;
    uint64_t extra_key;
    bool live;
};

struct kv_page_table {
    struct kv_page_table_config cfg;
    bool owned;           /* a kv_cache's part: kv_page_table_destroy refuses it */
    uint32_t N;           /* tokens per block */
    uint32_t r;           /* kernel pages per block */
    uint32_t page_tokens; /* N / r */
    bool prefix;          /* prefix caching on */

    struct kv__seq *seqs; /* [max_seqs], lazily zeroed pages: only ids < fresh_id touched */
    uint32_t *free_ids;   /* [max_seqs] stack of retired ids (LIFO) */
    uint32_t n_retired;   /* entries on free_ids */
    uint32_t fresh_id;    /* ids >= fresh_id were never handed out */
    uint32_t n_free; /* live_seqs + n_free == max_seqs; n_free == n_retired + max_seqs - fresh_id */

    /* Copies not yet done, oldest first: [0, n_taken) taken by the caller,
     * [n_taken, n_copies) still queued. Each holds one reference on its src
     * and one on its dst until kv_page_table_copies_done() (or destroy). */
    struct kv_block_copy *copies; /* [cap_copies] */
    uint32_t n_copies, n_taken, cap_copies;

    bool any_block;  /* a block id was ever held */
    uint32_t max_id; /* largest block id ever held (for the int32 export check) */
    struct kv_page_table_stats stats;
};

/* Sequence id of pt when live, else NULL. */
struct kv__seq *kv__pt_seq_get(const kv_page_table *pt, uint32_t id);

#endif /* KV_PAGE_TABLE_INT_H */
