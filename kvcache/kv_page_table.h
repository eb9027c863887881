/*
 * kv_page_table.h - page tables: which physical block holds which logical
 * token of each sequence (docs/design.md section 3, docs/page-table.md).
 *
 * A kv_page_table holds up to max_seqs sequences. A sequence is a token
 * count n_tokens and a list of physical block ids (uint32) obtained from a
 * block source (struct kv_block_ops: the allocator's pool, or a fake):
 *
 *     n_blocks == ceil(n_tokens / N)             (blocks are taken only when
 *                                                 the first token needs them)
 *     logical token t < n_tokens  ->  block table[t / N],
 *                                     slot  table[t / N] * N + t % N   (int64)
 *
 * Kernel pages. An allocation block may be r kernel pages (page_ratio r,
 * N % r == 0): block b expands to pages b*r .. b*r + r-1 of N/r tokens each.
 * Slots do not depend on r (page p = b*r + j holds slot p*(N/r) + i ==
 * b*N + j*(N/r) + i). Exports in page units cover ceil(n_tokens / (N/r))
 * pages per sequence.
 *
 * Sharing. fork() shares every block of the parent (ref += 1), the partial
 * last block included. Before the first write into a partial last block that
 * is shared (held by another sequence) or sealed in the prefix cache (see
 * below), the writer gets a private block and a (src, dst) copy is queued;
 * the caller takes the queue with kv_page_table_take_copies(), performs the
 * copies (attention/ block copy, all at once if it likes) BEFORE writing K/V
 * for this step (vLLM's order: schedule -> copy blocks -> write K/V), then
 * calls kv_page_table_copies_done().
 *
 * Copies are safe to run concurrently: a copy holds one reference on its src
 * and one on its dst from the moment it is queued until copies_done (or
 * destroy), so neither block can return to the pool and be handed out again
 * -- as another copy's dst, say -- while the batch runs; and a copy whose src
 * is the dst of a copy still queued reads that copy's src instead, so no copy
 * of a batch reads a block another one writes. An append that would copy the
 * dst of a copy taken and not yet done is refused (KV_ERR_BAD_STATE, nothing
 * changed): that copy may have run and its dst been written since, or not;
 * call copies_done once the taken copies ran. These holds do not count as
 * sharing: a block held by one sequence and by pending copies is still that
 * sequence's to write in place.
 *
 * Prefix caching (enable_prefix_caching and the block source provides
 * match_prefix / commit_full). Each block that becomes full is committed
 * with commit_full(id, parent_hash, its N tokens, extra_key); the first
 * block's parent hash is KV_PAGE_TABLE_ROOT_HASH (0). A committed block is
 * "sealed": it is never written in place again (after a truncate into it,
 * the next append copies it first). reuse_prefix() starts an empty sequence
 * with the longest cached prefix, at most floor((n - 1) / N) blocks so that
 * the last prompt token is always computed.
 *
 * Ids. Sequence ids are handed out by the table, in [0, max_seqs); a freed
 * id may be handed out again.
 *
 * Errors. Every call returns a kv_status and on failure changes nothing
 * (the block source included) and sets kv_last_error() naming the values.
 * Common to every call taking a sequence id: KV_ERR_NULL (pt or an output
 * pointer NULL) and KV_ERR_NOT_FOUND (the id is >= max_seqs or not live).
 * Calls that take blocks may also return the block source's statuses
 * (KV_ERR_NO_BLOCKS when it is short); calls that release them return the
 * source's status if it refuses (a bug in the caller's bookkeeping).
 *
 * Thread safety: one thread per page table (no internal locking). The block
 * source must be thread-safe if several page tables share it.
 */
#ifndef KV_PAGE_TABLE_H
#define KV_PAGE_TABLE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kv_block_ops.h"
#include "kv_status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The page table handle (opaque). */
typedef struct kv_page_table kv_page_table;

/* Parent hash of a sequence's first block in commit_full. */
#define KV_PAGE_TABLE_ROOT_HASH UINT64_C(0)

/* Most live sequences a table holds (max_seqs): 2^20, far above any
 * engine's batch. */
#define KV_PAGE_TABLE_MAX_SEQS (1u << 20)
/* Most blocks one sequence may hold (max_blocks_per_seq): the pool's id
 * space. */
#define KV_PAGE_TABLE_MAX_BLOCKS_PER_SEQ (1u << 31)

/* Input of kv_page_table_create(); copied (ops.ctx is borrowed: held
 * through ops.hold / ops.drop where the source has them). Creating a
 * table touches memory for none of its max_seqs sequences until they are
 * used, so the bounds above cost nothing unless reached. */
struct kv_page_table_config {
    size_t struct_size;          /* sizeof this struct: set by its _init() or _INIT */
    uint32_t block_tokens;       /* N >= 1: tokens per allocation block */
    uint32_t page_ratio;         /* r >= 1 (0 means 1), N % r == 0: kernel pages per block */
    uint32_t max_seqs;           /* 1 .. KV_PAGE_TABLE_MAX_SEQS: live sequences at once */
    uint32_t max_blocks_per_seq; /* 1 .. KV_PAGE_TABLE_MAX_BLOCKS_PER_SEQ */
    struct kv_block_ops ops;     /* block source: alloc, retain, release, ref_count required */
    bool enable_prefix_caching;  /* needs ops.match_prefix and ops.commit_full */
    uint64_t extra_key;          /* default extra key of new sequences (LoRA id, salt) */
};

/* C initializer: struct kv_page_table_config cfg = KV_PAGE_TABLE_CONFIG_INIT; */
#define KV_PAGE_TABLE_CONFIG_INIT                                                                  \
    {                                                                                              \
        .struct_size = sizeof(struct kv_page_table_config)                                         \
    }

/* Zero *cfg and set its struct_size (C and C++). */
static inline void kv_page_table_config_init(struct kv_page_table_config *cfg)
{
    memset(cfg, 0, sizeof(*cfg));
    cfg->struct_size = sizeof(*cfg);
}

/* A queued copy-on-write: copy the first `tokens` tokens (the whole block is
 * fine too) of block src into block dst, for every layer and K/V. */
struct kv_block_copy {
    uint32_t src;
    uint32_t dst;
    uint32_t tokens;
};

/* Tokens [start, start + count) of one sequence (already appended). */
struct kv_token_range {
    uint64_t start;
    uint64_t count;
};

/* ---- lifetime ------------------------------------------------------------- */

/* KV_ERR_NULL, KV_ERR_INVALID_ARG (a zero size or one past its bound above,
 * N % r != 0, a missing op or another ops version, prefix caching without
 * match_prefix/commit_full, a struct_size of other headers),
 * KV_ERR_NO_MEMORY.
 * cfg is copied; ops.ctx is borrowed for the table's life (ops.hold at
 * create, ops.drop at destroy, when set: the pool's own ops count it). */
KV_API KV_NODISCARD kv_status kv_page_table_create(const struct kv_page_table_config *cfg,
                                                   kv_page_table **out);

/* Releases every block still held by live sequences; NULL is a no-op. The
 * page table of a kv_cache (kv_cache_page_table) is refused: nothing is
 * freed, kv_last_error() says so (KV_ERR_BAD_STATE); kv_cache_destroy
 * frees it. */
KV_API void kv_page_table_destroy(kv_page_table *pt);

/* ---- sequences -------------------------------------------------------------- */

/* A new empty sequence with the default extra key; id in *seq_out.
 * KV_ERR_CAPACITY when max_seqs sequences are live. */
KV_API KV_NODISCARD kv_status kv_page_table_seq_create(kv_page_table *pt, uint32_t *seq_out);

/* Set the extra key of an empty sequence (KV_ERR_BAD_STATE otherwise). */
KV_API KV_NODISCARD kv_status kv_page_table_seq_set_extra_key(kv_page_table *pt, uint32_t seq,
                                                              uint64_t extra_key);

/* Start the empty sequence seq with the longest cached prefix of
 * tokens[n_tokens]: at most min(floor((n_tokens - 1) / N), max_blocks_per_seq)
 * blocks (0 for n_tokens == 0). *cached_tokens = reused blocks * N; the
 * caller then appends tokens + *cached_tokens. Reuses nothing (KV_OK, 0)
 * when prefix caching is off. KV_ERR_BAD_STATE when seq is not empty. */
KV_API KV_NODISCARD kv_status kv_page_table_seq_reuse_prefix(kv_page_table *pt, uint32_t seq,
                                                             const int32_t *tokens,
                                                             uint64_t n_tokens,
                                                             uint64_t *cached_tokens);

/* create + reuse_prefix in one call (nothing created on failure). */
KV_API KV_NODISCARD kv_status kv_page_table_seq_create_from_prefix(kv_page_table *pt,
                                                                   const int32_t *tokens,
                                                                   uint64_t n_tokens,
                                                                   uint32_t *seq_out,
                                                                   uint64_t *cached_tokens);

/* Append n token ids, taking whole blocks from the source at block
 * boundaries (plus one private block when copy-on-write is due), and
 * committing blocks that become full when prefix caching is on. tokens may
 * be NULL when prefix caching is off. All or nothing: KV_ERR_NO_BLOCKS (the
 * source is short) or KV_ERR_CAPACITY (would exceed max_blocks_per_seq)
 * leave the sequence as it was. A failed commit_full does not fail the
 * append: the block stays out of the cache (counted in commit_failures). */
KV_API KV_NODISCARD kv_status kv_page_table_seq_append(kv_page_table *pt, uint32_t seq,
                                                       const int32_t *tokens, uint64_t n);

/* Blocks that appending n tokens to seq would take from the block source
 * right now (new blocks plus one private copy when copy-on-write is due),
 * for admission control: an append succeeds when the source has this many
 * free or evictable blocks. Changes nothing. KV_ERR_CAPACITY when the
 * append would exceed max_blocks_per_seq. */
KV_API KV_NODISCARD kv_status kv_page_table_blocks_needed(const kv_page_table *pt, uint32_t seq,
                                                          uint64_t n, uint32_t *blocks);

/* A new sequence sharing all of parent's blocks (ref += 1 each), tokens and
 * extra key; id in *child_out. KV_ERR_CAPACITY when max_seqs sequences are
 * live; the source's status if retain fails. */
KV_API KV_NODISCARD kv_status kv_page_table_seq_fork(kv_page_table *pt, uint32_t parent,
                                                     uint32_t *child_out);

/* Keep the first n_tokens tokens (<= current length, else
 * KV_ERR_INVALID_ARG); blocks no longer needed are released, last first. */
KV_API KV_NODISCARD kv_status kv_page_table_seq_truncate(kv_page_table *pt, uint32_t seq,
                                                         uint64_t n_tokens);

/* Release every block of seq (last block first, so its prefix stays cached
 * longest) and retire its id. */
KV_API KV_NODISCARD kv_status kv_page_table_seq_free(kv_page_table *pt, uint32_t seq);

/* ---- queries -------------------------------------------------------------- */

/* Token count of seq. */
KV_API KV_NODISCARD kv_status kv_page_table_seq_len(const kv_page_table *pt, uint32_t seq,
                                                    uint64_t *n_tokens);

/* seq's block ids: *blocks borrows the table's array (valid until the next
 * call that changes seq), *n_blocks its length. */
KV_API KV_NODISCARD kv_status kv_page_table_seq_blocks(const kv_page_table *pt, uint32_t seq,
                                                       const uint32_t **blocks, uint32_t *n_blocks);

/* Slot of logical token t of seq: block * N + t % N (KV_ERR_OUT_OF_BOUNDS
 * when t >= length; KV_ERR_OVERFLOW when the slot does not fit int64). */
KV_API KV_NODISCARD kv_status kv_page_table_slot(const kv_page_table *pt, uint32_t seq, uint64_t t,
                                                 int64_t *slot);

/* Number of queued copies not yet taken. */
KV_API uint32_t kv_page_table_pending_copies(const kv_page_table *pt);

/* Move up to cap queued copies, oldest first, into out[cap]; *n_out says how
 * many (the rest stay queued). Taken copies keep their src and dst held
 * until kv_page_table_copies_done(). */
KV_API KV_NODISCARD kv_status kv_page_table_take_copies(kv_page_table *pt,
                                                        struct kv_block_copy *out, uint32_t cap,
                                                        uint32_t *n_out);

/* The caller has performed every copy it took (or ordered them on its stream
 * before any later K/V write): release the src and dst each taken copy held,
 * oldest copy first, src before dst. A no-op with nothing taken. Returns the
 * block source's status if it refuses a release (the copies not released
 * stay held). */
KV_API KV_NODISCARD kv_status kv_page_table_copies_done(kv_page_table *pt);

/* Counters since create (kv_page_table_stats_get). */
struct kv_page_table_stats {
    uint32_t live_seqs;
    uint64_t held_blocks;     /* sum over live sequences of n_blocks */
    uint64_t cow_copies;      /* copies queued since create */
    uint32_t copies_held;     /* copies not yet done (queued or taken): each holds 2 refs */
    uint64_t reused_blocks;   /* blocks obtained through match_prefix */
    uint64_t committed;       /* successful commit_full calls */
    uint64_t commit_failures; /* failed commit_full calls */
};
/* Snapshot of the counters (zeros for a NULL pt). */
KV_API void kv_page_table_stats_get(const kv_page_table *pt, struct kv_page_table_stats *out);

/* ---- exports for attention kernels (no allocation, no per-token calls) ---- */

/*
 * Both exports validate the whole batch first, then fill: on an error
 * nothing is written. Every output buffer may be NULL: it is then neither
 * written nor is its length checked. Size queries: call with NULL buffers
 * and the export reports what it would write, after every check a real
 * export makes except the buffers' lengths; so buffers of those sizes are
 * then accepted by the same call (same table, same seqs and ranges). vLLM
 * form: *out->sizes; FlashInfer form: *nnz_out (indptr needs n_seqs + 1
 * entries and last_page_len n_seqs). Page units are N/r tokens; a sequence
 * of n tokens lists ceil(n / (N/r)) pages (0 when empty).
 */

/* What kv_page_table_export_vllm writes for a batch (set only on KV_OK). */
struct kv_vllm_export_sizes {
    uint32_t block_table_cols; /* pages of the longest sequence: the fewest columns accepted */
    uint64_t block_table_len;  /* n_seqs * block_table_cols entries (with more columns c:
                                  n_seqs * c) */
    uint64_t slot_mapping_len; /* tokens_per_seq == 0: the sum of ranges[i].count;
                                  tokens_per_seq > 0: n_seqs * tokens_per_seq;
                                  0 without ranges */
    uint64_t seq_lens_len;     /* n_seqs */
};

/* Output buffers of kv_page_table_export_vllm (see its contract below).
 * Zero-initialize it ({0}): a field added later is then NULL (skipped). */
struct kv_vllm_export {
    int32_t *block_table; /* [n_seqs][block_table_cols] */
    uint64_t block_table_len;
    uint32_t block_table_cols;
    int32_t block_table_pad; /* e.g. 0 (vLLM's null block) or -1 */
    int64_t *slot_mapping;   /* [slot_mapping_len] */
    uint64_t slot_mapping_len;
    uint32_t tokens_per_seq;
    int64_t *seq_lens; /* [seq_lens_len]: token count of each seqs[i] */
    uint64_t seq_lens_len;
    struct kv_vllm_export_sizes *sizes; /* NULL, or receives what the call writes */
};
/* vLLM form. Any output may be NULL (skipped).
 *
 *   block_table [n_seqs][block_table_cols] int32, row i = kernel pages of
 *     seqs[i] (ceil(len / (N/r)) of them), then block_table_pad up to the
 *     column count. block_table_len (entries) >= n_seqs * block_table_cols
 *     and block_table_cols >= the longest row, else KV_ERR_INVALID_ARG.
 *   slot_mapping int64 for tokens ranges[i] of each seqs[i] (ranges required):
 *     tokens_per_seq == 0: packed, sequence after sequence (sum of counts);
 *     tokens_per_seq  > 0: padded, sequence i at [i * tokens_per_seq, ...),
 *                          each count <= tokens_per_seq;
 *     every other entry up to slot_mapping_len is -1 (padding, skipped by
 *     writers), so a batch padded to a graph size needs no extra pass.
 *     slot_mapping_len must cover the written entries, else KV_ERR_INVALID_ARG.
 *   seq_lens [n_seqs] int64: the token count of each seqs[i] (entries past
 *     n_seqs are not written); seq_lens_len >= n_seqs, else
 *     KV_ERR_INVALID_ARG. With block_table this is struct kv_pages'
 *     KV_PAGES_BLOCK_TABLE form (attention/kv_attn.h) as it stands: pages
 *     = block_table, block_table_cols, seq_lens, page_ratio r.
 *   sizes (may be NULL): set on KV_OK (struct kv_vllm_export_sizes). With
 *     every buffer NULL the call is a size query; ranges given, they are
 *     checked and the slot mapping sized as if it were written.
 * KV_ERR_NULL (pt, out, seqs with n_seqs > 0, or ranges with slot_mapping);
 * KV_ERR_INVALID_ARG naming an array misaligned for its elements (seqs and
 * ranges with n_seqs > 0, any output given); KV_ERR_OVERLAP naming an
 * output that overlaps seqs, or ranges when they are read;
 * KV_ERR_NOT_FOUND naming seqs[i]; KV_ERR_OUT_OF_BOUNDS (a range past its
 * sequence); KV_ERR_OVERFLOW when a page id does not fit int32. */
KV_API KV_NODISCARD kv_status kv_page_table_export_vllm(const kv_page_table *pt,
                                                        const uint32_t *seqs, uint32_t n_seqs,
                                                        const struct kv_token_range *ranges,
                                                        const struct kv_vllm_export *out);

/* Output buffers of kv_page_table_export_flashinfer (contract below). */
struct kv_flashinfer_export {
    int32_t *indptr; /* [n_seqs + 1] */
    uint64_t indptr_len;
    int32_t *indices; /* [nnz] */
    uint64_t indices_len;
    int32_t *last_page_len; /* [n_seqs] */
    uint64_t last_page_len_len;
};
/* FlashInfer form (page units of N/r tokens), struct kv_pages' KV_PAGES_CSR:
 *   indptr[n_seqs + 1]: indptr[0] = 0, indptr[i+1] = indptr[i] + pages(seqs[i])
 *   indices[nnz]:       the pages, sequence after sequence
 *   last_page_len[n_seqs]: tokens in the last page:
 *       a sequence of n >= 1 tokens:  1..N/r  (n - (pages - 1) * N/r)
 *       an empty sequence:            0, with indptr[i] == indptr[i+1]
 *     (FlashInfer's convention; the kernels accept exactly this and refuse
 *     anything else with KV_ERR_CORRUPT: 0 for a sequence with pages, a
 *     non-zero value for one without).
 * out may be NULL, and any buffer in it (skipped, its length unchecked):
 * with none, the call is a size query. Lengths of the buffers given are
 * checked (KV_ERR_INVALID_ARG naming them); *nnz_out (may be NULL) = total
 * pages, the indices_len needed. KV_ERR_NULL (pt, or seqs with n_seqs > 0);
 * KV_ERR_INVALID_ARG naming an array misaligned for its elements;
 * KV_ERR_OVERLAP naming an output that overlaps seqs;
 * KV_ERR_NOT_FOUND naming seqs[i]; KV_ERR_OVERFLOW when nnz or a page id
 * exceeds int32. */
KV_API KV_NODISCARD kv_status
kv_page_table_export_flashinfer(const kv_page_table *pt, const uint32_t *seqs, uint32_t n_seqs,
                                const struct kv_flashinfer_export *out, uint64_t *nnz_out);

#ifdef __cplusplus
}
#endif

#endif /* KV_PAGE_TABLE_H */
