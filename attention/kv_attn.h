/*
 * kv_attn.h - stride-aware KV kernels over paged caches: write (reshape and
 * cache), read (gather), block copy, and paged decode attention; CPU (OpenMP)
 * and CUDA (docs/kernels.md).
 *
 * Every kernel takes the cache as a complete layout by value plus its
 * storage (struct kv_paged_cache), and the tensors it reads or writes as
 * kv_views with any strides. Tokens are addressed through the page-table
 * exports that already exist: a slot mapping (write) or pages (read and
 * decode: the FlashInfer CSR or the vLLM block table, with a page ratio r).
 * Nothing infers a layout from a shape.
 *
 *   write   K, V [T][H][D] (one layer) or [L][T][H][D] (every layer at once)
 *           -> the slots slots[0..n_slots) (-1 skipped; n_slots <= T),
 *           int64 or int32 (kv_attn_write_i32)
 *   read    the tokens of the sequences in `pages`, sequence after sequence
 *           -> K, V [T][H][D] or [L][T][H][D] (T = their total), any strides
 *   copy    whole blocks src -> dst, every layer, K and V (copy-on-write,
 *           compaction); or a layer range and K, V or both, within one
 *           cache or between two of one block format (swap in / out)
 *   decode  one query per sequence q [S][Hq][D] over its paged K, V (Hq a
 *           multiple of H: query head i reads KV head i / (Hq / H)) ->
 *           out [S][Hq][D]: softmax(scale * q.k) . v, f32 accumulation with an
 *           online softmax; a sequence of 0 tokens gives zeros; with options
 *           (kv_attn_decode_ex): a sliding window, a logit soft cap, the
 *           log-sum-exp
 *   prefill q_len >= 1 queries per sequence (qo_indptr, CSR) with a causal
 *           mask over the sequence's cached tokens, the same options
 *   MLA     decode and prefill over a K-only (latent) layout, FlashMLA's
 *           convention (kv_attn_decode_mla, kv_attn_prefill_mla): K only is
 *           written, read and copied (a V tensor, V scales or a V plane
 *           given for it is refused)
 *
 * Element types. The cache dtype is the layout's: f32, f16, bf16, fp8 e4m3fn
 * or fp8 e5m2. Tensors may be any of the five. In a call without scales, a
 * tensor of the cache's dtype moves its bytes exactly (inf and NaN payloads
 * included); every other element goes through f32 (attention/kv_convert_hd.h:
 * round to nearest even, fp8 saturating, NaNs canonical), and so does every
 * element of a call with scales, whatever their values (1.0 included).
 * Scales (struct kv_scales, per tensor or per KV head) follow the vLLM
 * convention: stored = convert(x / scale) on write, a true division (not
 * x * (1 / scale), which rounds differently for some x), and
 * x = to_f32(stored) * scale on read and in decode. read(write(x)) == x bit
 * for bit when the dtypes agree and there are no scales, and
 * == dequant(quant(x)) otherwise.
 *
 * Paths, chosen per call from the tensor side (the cache side always has a
 * contiguous head dim) and counted by kv_attn_stats_get():
 *   canonical     the tensor is C-contiguous [T][H][D] (natural strides):
 *                 whole token rows move at once, runs of consecutive slots
 *                 of one block in one copy
 *   outer stride  head dim contiguous, any token and head strides (a slice
 *                 of a fused QKV tensor, a padded batch): one copy per head row
 *   generic       any strides: element by element
 *
 * Refusals (each a kv_status with a message naming the tensor and values),
 * all checked before anything is written, by one validator per kernel that
 * the CPU and CUDA entry points share:
 *   KV_ERR_NULL          a required pointer is NULL
 *   KV_ERR_INVALID_ARG   a layout that is not what kv_layout_init computes for
 *                        its own fields, an unsupported dtype, a layer out of
 *                        range, a bad scale (not finite and > 0, wrong count),
 *                        a page ratio that does not divide N, a copy's
 *                        layer range or planes, options of another size,
 *                        an index or scale array (slots, indptr, indices,
 *                        last_page_len, block_table, seq_lens, qo_indptr,
 *                        copies, scales) not aligned to its element
 *   KV_ERR_BAD_SHAPE     a tensor whose shape is not [T][H][D] ([L][T][H][D])
 *                        of the layout's H and D, K and V shapes differing,
 *                        n_slots > T, q/out shapes, Hq % H != 0
 *   KV_ERR_OUT_OF_BOUNDS a slot outside [-1, B*N), a page id outside [0, B*r),
 *                        a block id >= B, storage smaller than the layout
 *   KV_ERR_OVERLAP       an output whose elements overlap (stride 0), two
 *                        outputs sharing memory, a tensor inside the cache's
 *                        storage, a slot written twice in one call, a copy
 *                        whose dst is another copy's src or dst, src == dst,
 *                        two caches of a copy whose storages overlap
 *   KV_ERR_MISMATCH      two caches of a copy with different block formats
 *   KV_ERR_CORRUPT       pages that contradict themselves (indptr decreasing,
 *                        last_page_len outside 1..N/r for a sequence with
 *                        pages, or not 0 for an empty one: indptr[s] ==
 *                        indptr[s+1])
 * Thread safety: the kernels may run concurrently on different outputs; the
 * stats counters are atomic; kv_set_threads is process-wide.
 */
#ifndef KV_ATTN_H
#define KV_ATTN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kv_arena.h"
#include "kv_cache.h"
#include "kv_layout.h"
#include "kv_page_table.h"
#include "kv_paged.h"
#include "kv_status.h"
#include "kv_threads.h"
#include "kv_view.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The cache a kernel reads and writes: struct kv_paged_cache (kv_paged.h;
 * kv_cache_paged() for a kv_cache), checked as kv_paged_check does. */

/* The `layer` argument of write/read for every layer in one call: the
 * tensors are then [L][T][H][D]. */
#define KV_ATTN_ALL_LAYERS (-1)

/* Quantization scales (stored = convert(x / scale), x = stored * scale).
 * NULL pointer to the struct: no scaling (bytes moved where the dtypes
 * agree); a struct of 1.0s still converts. Engines quantize per layer:
 * with layers == L, layer l's scales are k[l * n .. l * n + n) (v alike)
 * whatever the call (one layer, KV_ATTN_ALL_LAYERS, decode of layer l);
 * with layers 0 or 1, the same n scales serve every layer. Scales apply
 * to every cache dtype (vLLM applies them to fp8 caches only: pass NULL
 * for the others to match it). */
struct kv_scales {
    const float *k;  /* [layers][n] (layers 0 counts as 1) */
    const float *v;  /* [layers][n] */
    uint32_t n;      /* per layer: 1 (per tensor) or H (per KV head) */
    uint32_t layers; /* 0 or 1: shared by every layer; L: one row of n per layer */
};

/* Which page-table export describes the sequences of a read or decode. */
enum kv_pages_format {
    KV_PAGES_CSR = 1,         /* kv_page_table_export_flashinfer */
    KV_PAGES_BLOCK_TABLE = 2, /* kv_page_table_export_vllm's block table + lengths */
};

/* The pages of n_seqs sequences, in kernel pages of N / page_ratio tokens:
 * page p holds the slots p * (N/r) .. p * (N/r) + N/r - 1, i.e. block p / r.
 * Sequence s's token t is in its page t / (N/r), at t % (N/r).
 *   CSR           pages of s: indices[indptr[s] .. indptr[s+1]); its tokens:
 *                 (pages - 1) * (N/r) + last_page_len[s] (0 pages: 0 tokens)
 *   block table   pages of s: block_table[s * block_table_cols + i] for
 *                 i < ceil(seq_lens[s] / (N/r)); its tokens: seq_lens[s]
 * Only the pages a sequence's tokens use are read (padding is ignored). */
struct kv_pages {
    enum kv_pages_format format;
    uint32_t n_seqs;
    uint32_t page_ratio; /* r >= 1 (0 means 1), dividing N */
    /* KV_PAGES_CSR */
    const int32_t *indptr;        /* [n_seqs + 1] */
    const int32_t *indices;       /* [indptr[n_seqs]] */
    const int32_t *last_page_len; /* [n_seqs] */
    /* KV_PAGES_BLOCK_TABLE */
    const int32_t *block_table; /* [n_seqs][block_table_cols] */
    uint32_t block_table_cols;
    const int64_t *seq_lens; /* [n_seqs] */
};

/* ---- CPU kernels (OpenMP; kv_set_threads) ------------------------------ */

/* Write K and V of tokens 0..n_slots-1 into their slots (see the top of the
 * file): layer in [0, L) with k, v [T][H][D], or KV_ATTN_ALL_LAYERS with
 * [L][T][H][D]. slots[i] == -1 skips token i. Consecutive slots of one block
 * are written as one run; scattered single slots (a decode step) are
 * prefetched. scales may be NULL. A K-only layout (k_only, MLA) takes k
 * alone: v must be NULL and scales->v NULL (KV_ERR_INVALID_ARG naming
 * them otherwise). */
KV_API KV_NODISCARD kv_status kv_attn_write(struct kv_paged_cache cache, int32_t layer,
                                            const struct kv_view *k, const struct kv_view *v,
                                            const int64_t *slots, int64_t n_slots,
                                            const struct kv_scales *scales);

/* Read the tokens of the sequences in pages into k_out, v_out ([T][H][D], or
 * [L][T][H][D] with KV_ATTN_ALL_LAYERS; either may be NULL to read only the
 * other; a K-only layout refuses v_out). The exact inverse of
 * kv_attn_write. */
KV_API KV_NODISCARD kv_status kv_attn_read(struct kv_paged_cache cache, int32_t layer,
                                           const struct kv_pages *pages,
                                           const struct kv_view *k_out, const struct kv_view *v_out,
                                           const struct kv_scales *scales);

/* Copy whole blocks copies[i].src -> copies[i].dst for every layer, K and V
 * (the tokens field is not needed: the whole block is copied). The pairs
 * kv_page_table_take_copies hands out are valid input; a batch in which a
 * dst is another copy's src or dst is refused (the copies run at once). */
KV_API KV_NODISCARD kv_status kv_attn_copy_blocks(struct kv_paged_cache cache,
                                                  const struct kv_block_copy *copies,
                                                  uint32_t n_copies);

/* Which planes a block copy moves (struct kv_copy_blocks_opts.planes). */
enum kv_attn_planes {
    KV_ATTN_PLANE_K = 1,
    KV_ATTN_PLANE_V = 2,
    KV_ATTN_PLANES_KV = 3, /* both (0 means this too) */
};

/* Options of kv_attn_copy_blocks_ex. Start from kv_copy_blocks_opts_init()
 * (or KV_COPY_BLOCKS_OPTS_INIT): zero for every other field copies every
 * layer, K and V. struct_size lets the library refuse options compiled
 * against other headers (KV_ERR_INVALID_ARG naming both sizes). */
struct kv_copy_blocks_opts {
    size_t struct_size; /* sizeof this struct: set by its _init() or _INIT */
    uint32_t layer0;    /* the first layer copied, < L */
    uint32_t n_layers;  /* layers layer0 .. layer0 + n_layers - 1; 0: through L - 1 */
    uint32_t planes;    /* enum kv_attn_planes: K, V or both; 0: both */
};

/* C initializer: struct kv_copy_blocks_opts o = KV_COPY_BLOCKS_OPTS_INIT; */
#define KV_COPY_BLOCKS_OPTS_INIT                                                                   \
    {                                                                                              \
        .struct_size = sizeof(struct kv_copy_blocks_opts)                                          \
    }

/* Zero *opts and set its struct_size (C and C++). */
static inline void kv_copy_blocks_opts_init(struct kv_copy_blocks_opts *opts)
{
    memset(opts, 0, sizeof(*opts));
    opts->struct_size = sizeof(*opts);
}

/* Copy blocks copies[i].src of src -> copies[i].dst of dst, for the layers
 * and planes opts names (NULL: every layer, K and V): vLLM's copy_blocks
 * (src and dst the same cache) and swap_blocks (two caches, e.g. a device
 * cache and a host cache). The two caches must hold the same block format
 * (layout.block_format_fingerprint: L, N, H, D, dtype, order, K|V packing;
 * the block count, arrangement, padding and alignment may differ): a block
 * moves as bytes, never converted. With packed K|V and one plane, each head
 * row's K (or V) half moves.
 *   same cache (equal base and fingerprint): the rules of
 *       kv_attn_copy_blocks (ids < B, src != dst, no dst another copy's
 *       src or dst)
 *   two caches: storages that do not overlap; src ids < src's B, dst ids <
 *       dst's B, no dst block twice (any id may appear on both sides)
 * KV_ERR_MISMATCH for block formats that differ (naming the field and
 * both values; a K-only and a two-plane cache differ in k_only),
 * KV_ERR_INVALID_ARG for a layer range outside [0, L), planes outside 0..3,
 * planes naming V for K-only caches (0 means K there) or a struct_size of
 * other headers, KV_ERR_OUT_OF_BOUNDS for a
 * block id, KV_ERR_OVERLAP as above; every check before the first byte
 * moves. */
KV_API KV_NODISCARD kv_status kv_attn_copy_blocks_ex(struct kv_paged_cache dst,
                                                     struct kv_paged_cache src,
                                                     const struct kv_block_copy *copies,
                                                     uint32_t n_copies,
                                                     const struct kv_copy_blocks_opts *opts);

/* kv_attn_write with an int32 slot mapping (FlashInfer's, and most engines'
 * outside vLLM), read in place: the same checks (a slot outside [-1, B*N) is
 * refused naming its index and value), runs and executor as the int64 form,
 * and the same bytes in the cache. */
KV_API KV_NODISCARD kv_status kv_attn_write_i32(struct kv_paged_cache cache, int32_t layer,
                                                const struct kv_view *k, const struct kv_view *v,
                                                const int32_t *slots, int64_t n_slots,
                                                const struct kv_scales *scales);

/* Paged decode attention of layer: out[s][i] = sum_t softmax_t(scale *
 * q[s][i] . K[s][t][i / g]) V[s][t][i / g], g = Hq / H, over sequence s's
 * tokens in pages (n_seqs == S). f32 accumulation; q and out any of the five
 * dtypes and any strides; out must not overlap q or the cache. */
KV_API KV_NODISCARD kv_status kv_attn_decode(struct kv_paged_cache cache, uint32_t layer,
                                             const struct kv_view *q, const struct kv_pages *pages,
                                             float softmax_scale, const struct kv_scales *scales,
                                             const struct kv_view *out);

/* Options of kv_attn_decode_ex and kv_attn_prefill (docs/kernels.md has
 * the formulas). Start from kv_attn_opts_init() or KV_ATTN_OPTS_INIT: they
 * set window_left to KV_ATTN_WINDOW_OFF (a zeroed struct means a window of
 * one token), every other field off. NULL options: every field off. A query
 * at position p (decode: p = len - 1) of a sequence of len tokens sees the
 * tokens lo(p) .. p, lo(p) = max(0, p - window_left) (FlashInfer's
 * window_left: the last window_left + 1 tokens; -1 = no window). Its
 * logits are x = softmax_scale * (q . k) (k dequantized with the scales),
 * then, with a cap c > 0, c * tanh(x / c) (FlashInfer's logits_soft_cap,
 * vLLM's soft_cap), before the softmax. lse, when not NULL, receives for
 * each query row and query head the natural log of sum over the visible
 * tokens of exp(logit) (vLLM / flash-attention's softmax_lse; FlashInfer's
 * is base 2: times log2(e)), -inf where no token is visible. struct_size
 * lets the library refuse options of other headers. */
#define KV_ATTN_WINDOW_OFF (-1)
struct kv_attn_opts {
    size_t struct_size;   /* sizeof this struct: set by its _init() or _INIT */
    int32_t window_left;  /* -1 (KV_ATTN_WINDOW_OFF): no window; >= 0: see above */
    float logit_soft_cap; /* 0: off; finite, >= 1 / FLT_MAX: c * tanh(x / c) */
    float *lse;           /* NULL or [rows][Hq] f32 (rows: S for decode, T for prefill) */
    int64_t lse_stride;   /* elements between rows of lse (heads at stride 1); 0: Hq */
};

/* C initializer: struct kv_attn_opts o = KV_ATTN_OPTS_INIT; */
#define KV_ATTN_OPTS_INIT                                                                          \
    {                                                                                              \
        .struct_size = sizeof(struct kv_attn_opts), .window_left = KV_ATTN_WINDOW_OFF              \
    }

/* Zero *opts, set its struct_size and window_left = KV_ATTN_WINDOW_OFF. */
static inline void kv_attn_opts_init(struct kv_attn_opts *opts)
{
    memset(opts, 0, sizeof(*opts));
    opts->struct_size = sizeof(*opts);
    opts->window_left = KV_ATTN_WINDOW_OFF;
}

/* kv_attn_decode with options (opts NULL: kv_attn_decode exactly): a
 * sliding window, a logit soft cap, the log-sum-exp of each query head.
 * The refusals of kv_attn_decode, and KV_ERR_INVALID_ARG for options of
 * another struct_size, window_left < -1, a soft cap negative, not finite or
 * below 1 / FLT_MAX (its reciprocal not finite),
 * an lse_stride < 0 or below Hq, an lse not 4-byte aligned; KV_ERR_OVERLAP
 * for an lse overlapping out, q or the cache. Nothing is written when a
 * call is refused. */
KV_API KV_NODISCARD kv_status kv_attn_decode_ex(struct kv_paged_cache cache, uint32_t layer,
                                                const struct kv_view *q,
                                                const struct kv_pages *pages, float softmax_scale,
                                                const struct kv_scales *scales,
                                                const struct kv_view *out,
                                                const struct kv_attn_opts *opts);

/* Paged attention of q_len >= 0 queries per sequence with a causal mask
 * (chunked prefill over a cached prefix, a whole prefill, speculative
 * verification): the queries of sequence s are the rows qo_indptr[s] ..
 * qo_indptr[s+1] - 1 of q [T][Hq][D] (FlashInfer's qo_indptr, [n_seqs + 1],
 * qo_indptr[0] == 0, qo_indptr[n_seqs] == T), and are its last q_len
 * tokens: query i sits at position len - q_len + i (len: s's tokens in
 * pages, its K/V already written) and sees the tokens 0 .. that position
 * (less with a window). out [T][Hq][D]; a row with q_len 1 is exactly
 * kv_attn_decode_ex's. Refusals: those of kv_attn_decode_ex, KV_ERR_NULL for
 * a NULL qo_indptr, KV_ERR_CORRUPT for qo_indptr[0] != 0 or decreasing,
 * KV_ERR_BAD_SHAPE for qo_indptr[n_seqs] != T or a q_len above the
 * sequence's len (each naming the sequence and the values). */
KV_API KV_NODISCARD kv_status kv_attn_prefill(struct kv_paged_cache cache, uint32_t layer,
                                              const struct kv_view *q, const int32_t *qo_indptr,
                                              const struct kv_pages *pages, float softmax_scale,
                                              const struct kv_scales *scales,
                                              const struct kv_view *out,
                                              const struct kv_attn_opts *opts);

/* MLA decode in FlashMLA's convention, over a K-only layout (k_only: one
 * latent plane, DeepSeek's D = 576 = 512 latent + 64 rope dims) with one KV
 * head (H == 1): every query head reads the same latent rows,
 *   out[s][i] = sum_t softmax_t(scale * q[s][i] . K[s][t][0..D)) K[s][t][0..dv)
 * scores over all D dims, values the first dv dims of the same rows. q
 * [S][Hq][D] (Hq >= 1, up to 128 in DeepSeek), out [S][Hq][dv], any of the
 * five dtypes and any strides; f32 accumulation, an online softmax; a
 * sequence of 0 tokens gives zeros. scales: NULL, or K scales only
 * (scales->v NULL: the layout has no V) with n == 1 (per tensor; layers 0,
 * 1 or L), x = to_f32(stored) * scale in the scores and the values alike (an
 * fp8 latent cache with a per-tensor scale). One pass over each K row serves
 * every query head of a task (CPU: tasks of (sequence, query-head group),
 * AVX2/FMA where the CPU has it and D, dv are multiples of 8).
 * Refusals: those of kv_attn_decode for the cache, q, out, pages and
 * scales, plus KV_ERR_INVALID_ARG for a layout that is not K-only or has
 * H != 1, dv outside [1, D], V scales; KV_ERR_BAD_SHAPE for q not
 * [S][Hq][D] or out not [S][Hq][dv]. kv_attn_decode and the other decode
 * entries refuse a K-only layout (naming this one). */
KV_API KV_NODISCARD kv_status kv_attn_decode_mla(struct kv_paged_cache cache, uint32_t layer,
                                                 const struct kv_view *q,
                                                 const struct kv_pages *pages, int64_t dv,
                                                 float softmax_scale,
                                                 const struct kv_scales *scales,
                                                 const struct kv_view *out);

/* MLA prefill: kv_attn_prefill's multi-token causal attention in
 * kv_attn_decode_mla's convention (a K-only layout of one KV head, scores
 * over all D dims, values the first dv dims of the same rows). The queries
 * of sequence s are the rows qo_indptr[s] .. qo_indptr[s+1] - 1 of q
 * [T][Hq][D] and are its last q_len tokens: query i sits at position len -
 * q_len + i and sees the tokens 0 .. that position (less with a window);
 * out [T][Hq][dv]. opts (NULL: all off) as kv_attn_prefill's: window, logit
 * soft cap, lse [T][Hq]. q, out any of the five dtypes and any strides;
 * scales as kv_attn_decode_mla's. One pass over each latent row serves
 * every (query token, query head) of a task (CPU: tasks of (sequence, tile
 * of query tokens, query-head group), AVX2/FMA as the decode); a row with
 * q_len 1 and no options is exactly kv_attn_decode_mla's (the same sums in
 * the same order). Refusals: those of kv_attn_decode_mla (the layout, H,
 * dv, V scales, q not [T][Hq][D], out not [T][Hq][dv]) and of
 * kv_attn_prefill (opts, qo_indptr: KV_ERR_NULL, KV_ERR_CORRUPT,
 * KV_ERR_BAD_SHAPE for a q_len above the sequence's len, each naming the
 * sequence and the values); nothing is written when a call is refused. */
KV_API KV_NODISCARD kv_status kv_attn_prefill_mla(struct kv_paged_cache cache, uint32_t layer,
                                                  const struct kv_view *q,
                                                  const int32_t *qo_indptr,
                                                  const struct kv_pages *pages, int64_t dv,
                                                  float softmax_scale,
                                                  const struct kv_scales *scales,
                                                  const struct kv_view *out,
                                                  const struct kv_attn_opts *opts);

/* The CPU kernels use kv_threads() threads (kv_threads.h). */

/* ---- CUDA kernels -------------------------------------------------------------
 * The same kernels on device memory (cache.base and the tensors' bases are
 * device pointers; slots, pages and copies are HOST arrays, validated on the
 * host by the CPU kernels' validators), launched on `stream`. Each call
 * uploads its index arrays (runs of slots, pages, copy offsets, scales) to
 * stream-ordered device memory with cudaMemcpyAsync from pageable host
 * memory: no explicit synchronize, but CUDA may synchronize with the stream
 * to stage that copy, and a call cannot be captured in a CUDA graph (the
 * host arrays are freed when it returns). The *_cuda_dev entries below
 * take device-resident indices. KV_ERR_UNSUPPORTED without CUDA in the
 * build or a usable device; KV_ERR_NO_MEMORY when host or device memory for the index arrays runs
 * out; KV_ERR_DEVICE when a CUDA call or a launch fails. */

KV_API KV_NODISCARD kv_status kv_attn_write_cuda(struct kv_paged_cache cache, int32_t layer,
                                                 const struct kv_view *k, const struct kv_view *v,
                                                 const int64_t *slots, int64_t n_slots,
                                                 const struct kv_scales *scales,
                                                 kv_cuda_stream stream);
KV_API KV_NODISCARD kv_status kv_attn_read_cuda(struct kv_paged_cache cache, int32_t layer,
                                                const struct kv_pages *pages,
                                                const struct kv_view *k_out,
                                                const struct kv_view *v_out,
                                                const struct kv_scales *scales,
                                                kv_cuda_stream stream);
KV_API KV_NODISCARD kv_status kv_attn_copy_blocks_cuda(struct kv_paged_cache cache,
                                                       const struct kv_block_copy *copies,
                                                       uint32_t n_copies, kv_cuda_stream stream);
KV_API KV_NODISCARD kv_status kv_attn_copy_blocks_ex_cuda(
    struct kv_paged_cache dst, struct kv_paged_cache src, const struct kv_block_copy *copies,
    uint32_t n_copies, const struct kv_copy_blocks_opts *opts, kv_cuda_stream stream);
KV_API KV_NODISCARD kv_status kv_attn_write_i32_cuda(
    struct kv_paged_cache cache, int32_t layer, const struct kv_view *k, const struct kv_view *v,
    const int32_t *slots, int64_t n_slots, const struct kv_scales *scales, kv_cuda_stream stream);
KV_API KV_NODISCARD kv_status kv_attn_decode_cuda(struct kv_paged_cache cache, uint32_t layer,
                                                  const struct kv_view *q,
                                                  const struct kv_pages *pages, float softmax_scale,
                                                  const struct kv_scales *scales,
                                                  const struct kv_view *out, kv_cuda_stream stream);

/* kv_attn_decode_ex and kv_attn_prefill on CUDA: the same validation,
 * then everything the CPU entries do (qo_indptr, the causal mask, window,
 * soft cap, lse into device memory, scales, every dtype and stride).
 * kv_attn_decode_ex_cuda runs kv_attn_decode_cuda's kernel with the options;
 * kv_attn_prefill_cuda (qo_indptr) the multi-token kernel: one CUDA block
 * per (tile of up to
 * 32 (query, query head) rows, KV head), K/V tiles in shared memory shared
 * by the tile's rows (docs/kernels.md). Host page arrays, uploaded as
 * kv_attn_decode_cuda does. KV_ERR_UNSUPPORTED where one query row of head
 * dim D exceeds the 48 KiB of shared memory (D > 3071). */
KV_API KV_NODISCARD kv_status kv_attn_decode_ex_cuda(
    struct kv_paged_cache cache, uint32_t layer, const struct kv_view *q,
    const struct kv_pages *pages, float softmax_scale, const struct kv_scales *scales,
    const struct kv_view *out, const struct kv_attn_opts *opts, kv_cuda_stream stream);
KV_API KV_NODISCARD kv_status kv_attn_prefill_cuda(
    struct kv_paged_cache cache, uint32_t layer, const struct kv_view *q, const int32_t *qo_indptr,
    const struct kv_pages *pages, float softmax_scale, const struct kv_scales *scales,
    const struct kv_view *out, const struct kv_attn_opts *opts, kv_cuda_stream stream);

/* kv_attn_prefill_mla on CUDA: the same validation, then
 * kv_attn_prefill_cuda's multi-token kernel in its MLA form (only K rows
 * loaded into shared memory, the values their first dv dims; at D 576 / dv
 * 512 the tiles are small: 4-8 rows x 4-8 tokens a block, what fits in 48
 * KiB). Host arrays, uploaded as kv_attn_prefill_cuda does; lse in device
 * memory. Tested on the CPU grid emulator only so far. */
KV_API KV_NODISCARD kv_status kv_attn_prefill_mla_cuda(
    struct kv_paged_cache cache, uint32_t layer, const struct kv_view *q, const int32_t *qo_indptr,
    const struct kv_pages *pages, int64_t dv, float softmax_scale, const struct kv_scales *scales,
    const struct kv_view *out, const struct kv_attn_opts *opts, kv_cuda_stream stream);

/* kv_attn_decode_mla on CUDA: the same validation; one block per
 * (sequence, group of up to 8 query heads), a tile of latent rows converted
 * into shared memory once for the group (docs/kernels.md "MLA"). Host page
 * arrays, uploaded as kv_attn_decode_cuda does. */
KV_API KV_NODISCARD kv_status kv_attn_decode_mla_cuda(
    struct kv_paged_cache cache, uint32_t layer, const struct kv_view *q,
    const struct kv_pages *pages, int64_t dv, float softmax_scale, const struct kv_scales *scales,
    const struct kv_view *out, kv_cuda_stream stream);

/* ---- CUDA kernels with device-resident indices ------------------------------
 * The calling convention an engine embeds: the index arrays are DEVICE
 * memory (the engine's slot_mapping), read by the kernel itself. The host
 * side checks only scalars (layout, dtypes, tensor views, lengths): no host
 * allocation, no host copy, no host loop over indices, no synchronization,
 * so a call is safe inside cudaStreamBeginCapture and a captured graph can
 * be replayed after new indices are written in place. The kernel checks
 * every index against the layout: an invalid one is skipped (nothing is read
 * or written out of bounds for it) and recorded in `errors`, a record in
 * device memory (NULL: not recorded) that the caller reads when it wants.
 * Every device array must be aligned to its element and `errors` to 8
 * bytes (KV_ERR_INVALID_ARG before any launch: a misaligned load or atomic
 * faults with cudaErrorMisalignedAddress, which loses the context).
 * The host-index entries above stay the explicit host-input / debug mode:
 * they validate every index on the host before anything is launched. */

/* The device-side error record (device memory; all zero = no error: reset
 * with kv_attn_cuda_errors_reset or cudaMemsetAsync). Updated atomically by
 * the kernels; read it with kv_attn_cuda_errors_get. */
struct kv_attn_cuda_errors {
    uint64_t count;      /* invalid indices skipped since the reset */
    uint64_t first_key;  /* ~(array << 56 | index) of the first; 0: none */
    uint64_t value_key;  /* the first_key first_value belongs to */
    int64_t first_value; /* the value found at that index */
};

/* Which index array an error names. */
enum kv_attn_dev_array {
    KV_ATTN_DEV_NONE = 0,
    KV_ATTN_DEV_SLOTS = 1,     /* slots[index] outside [-1, num_blocks * block_tokens) */
    KV_ATTN_DEV_INDPTR = 2,    /* indptr[index] < indptr[index - 1], < 0 or > n_pages (the
                                * sequence index - 1 is skipped: its output is 0) */
    KV_ATTN_DEV_LAST_LEN = 3,  /* last_page_len[index] outside 1..N/r (0 with no pages):
                                * the sequence is skipped, its output 0 */
    KV_ATTN_DEV_PAGES = 4,     /* indices[index] outside [0, B x r): its tokens skipped */
    KV_ATTN_DEV_COPIES = 5,    /* copies[index / 2].src (even) or .dst (odd) >= the
                                * cache's B (dst: the dst cache's): the pair is skipped */
    KV_ATTN_DEV_SEQ_LENS = 6,  /* seq_lens[index] outside [0, block_table_cols x N/r]:
                                * the sequence is skipped, its output 0 */
    KV_ATTN_DEV_OUT_INDPTR = 7 /* out_indptr[index] (a read's output rows) outside
                                * [0, T], decreasing, or not the sequence's
                                * tokens apart: the sequence is skipped */
};

/* The record as read on the host. */
struct kv_attn_cuda_error_info {
    uint64_t count;               /* 0: no error */
    enum kv_attn_dev_array array; /* of the first (lowest array, then index) */
    int64_t index, value;         /* its position in the array and the value there */
};

/* Allocate (cudaMalloc, zeroed) / free a record. destroy(NULL) is a no-op.
 * Outside the hot path. KV_ERR_NULL, KV_ERR_UNSUPPORTED without CUDA,
 * KV_ERR_DEVICE. */
KV_API KV_NODISCARD kv_status kv_attn_cuda_errors_create(struct kv_attn_cuda_errors **out);
KV_API void kv_attn_cuda_errors_destroy(struct kv_attn_cuda_errors *errors);
/* Zero the record on `stream` (cudaMemsetAsync: capture-safe). */
KV_API KV_NODISCARD kv_status kv_attn_cuda_errors_reset(struct kv_attn_cuda_errors *errors,
                                                        kv_cuda_stream stream);
/* Copy the record to the host on `stream` and wait for it: the one
 * synchronizing call of this convention, never inside a capture. */
KV_API KV_NODISCARD kv_status kv_attn_cuda_errors_get(const struct kv_attn_cuda_errors *errors,
                                                      struct kv_attn_cuda_error_info *out,
                                                      kv_cuda_stream stream);

/* Device-resident pages, all int32 device memory: FlashInfer's CSR
 * (paged_kv_indptr / indices / last_page_len; format 0 or KV_PAGES_CSR)
 * or vLLM's block table + seq_lens (format KV_PAGES_BLOCK_TABLE: sequence
 * s's pages are block_table[s * block_table_cols + i] for i <
 * ceil(seq_lens[s] / (N/r)), as in struct kv_pages). The fields of the
 * other form are ignored. */
struct kv_attn_dev_pages {
    uint32_t n_seqs;
    uint32_t page_ratio;          /* r >= 1 (0 means 1), dividing N */
    const int32_t *indptr;        /* CSR: [n_seqs + 1], device */
    const int32_t *indices;       /* CSR: [n_pages], device */
    int64_t n_pages;              /* CSR: length of indices */
    const int32_t *last_page_len; /* CSR: [n_seqs], device */
    enum kv_pages_format format;  /* 0 (CSR), KV_PAGES_CSR or KV_PAGES_BLOCK_TABLE */
    const int32_t *block_table;   /* block table: [n_seqs][block_table_cols], device */
    uint32_t block_table_cols;    /* block table: row length (>= 1) */
    const int32_t *seq_lens;      /* block table: [n_seqs] tokens, device */
};

/* The scales of the device-index entries (vLLM's k_scale / v_scale), the
 * rules of struct kv_scales (stored = x / scale, x = stored * scale; n 1
 * or H; layers 0 or 1 shared, L one row per layer), in one of two forms:
 *   device 0  k, v host arrays, checked (finite, > 0) and read at the call
 *             into the launch's parameters (by value: at most
 *             KV_ATTN_DEV_SCALES_MAX values per plane over the rows the
 *             call reads); a captured graph replays the captured values
 *   device 1  k, v device memory, read by the kernel when it runs (a
 *             replay reads the current values); not checked: a scale that
 *             is not finite and > 0 gives inf / NaN elements, never an
 *             access out of bounds */
#define KV_ATTN_DEV_SCALES_MAX 128
struct kv_attn_dev_scales {
    const float *k;  /* [layers][n] */
    const float *v;  /* [layers][n] */
    uint32_t n;      /* per layer: 1 (per tensor) or H (per KV head) */
    uint32_t layers; /* 0 or 1: shared by every layer; L: one row of n per layer */
    uint32_t device; /* 0: host arrays (by value); 1: device memory */
};

/* kv_attn_write_cuda with slots_dev [n_slots] in device memory (int64;
 * -1 skips a token). Slots are checked by the kernel (KV_ATTN_DEV_SLOTS);
 * a slot given twice is not detected (one of the tokens lands). scales:
 * NULL, or struct kv_attn_dev_scales (a KV_ATTN_ALL_LAYERS call with a row
 * per layer is still one launch). KV_ERR_BAD_SHAPE for n_slots outside
 * [0, T]; KV_ERR_NULL for slots_dev NULL with n_slots > 0; the refusals of
 * kv_scales for the scales, and KV_ERR_UNSUPPORTED for by-value scales
 * past KV_ATTN_DEV_SCALES_MAX. */
KV_API KV_NODISCARD kv_status kv_attn_write_cuda_dev(
    struct kv_paged_cache cache, int32_t layer, const struct kv_view *k, const struct kv_view *v,
    const int64_t *slots_dev, int64_t n_slots, const struct kv_attn_dev_scales *scales,
    struct kv_attn_cuda_errors *errors, kv_cuda_stream stream);

/* kv_attn_decode_cuda with device-resident pages (CSR or block table):
 * the kernel checks indptr, last_page_len, seq_lens and every page id it
 * uses (KV_ATTN_DEV_INDPTR, _LAST_LEN, _SEQ_LENS, _PAGES; a block-table
 * page's index is s x block_table_cols + i); a sequence with a bad indptr,
 * last_page_len or seq_lens gets output 0, a bad page's tokens are left out
 * of the softmax. scales: NULL or struct kv_attn_dev_scales, as in
 * kv_attn_write_cuda_dev. KV_ERR_NULL for an array of the chosen form that
 * is NULL, KV_ERR_INVALID_ARG for another format or block_table_cols 0.
 * Capture-safe as kv_attn_write_cuda_dev. */
KV_API KV_NODISCARD kv_status
kv_attn_decode_cuda_dev(struct kv_paged_cache cache, uint32_t layer, const struct kv_view *q,
                        const struct kv_attn_dev_pages *pages, float softmax_scale,
                        const struct kv_attn_dev_scales *scales, const struct kv_view *out,
                        struct kv_attn_cuda_errors *errors, kv_cuda_stream stream);

/* kv_attn_decode_cuda_dev with options (opts NULL: exactly it): a window, a
 * soft cap, the log-sum-exp (opts->lse: DEVICE memory, [S][lse_stride]
 * f32), as kv_attn_decode_ex; the refusals of both. The engine's sliding
 * window or Gemma-style soft cap layer in one capture-safe call. */
KV_API KV_NODISCARD kv_status kv_attn_decode_ex_cuda_dev(
    struct kv_paged_cache cache, uint32_t layer, const struct kv_view *q,
    const struct kv_attn_dev_pages *pages, float softmax_scale,
    const struct kv_attn_dev_scales *scales, const struct kv_view *out,
    const struct kv_attn_opts *opts, struct kv_attn_cuda_errors *errors, kv_cuda_stream stream);

/* kv_attn_decode_mla_cuda with device-resident pages (CSR or block table),
 * checked by the kernel as kv_attn_decode_cuda_dev checks them (a bad
 * sequence gets output 0, a bad page's tokens are left out of the
 * softmax). scales: NULL, or the latent cache's K scale only (v NULL, n
 * 1, layers 0 / 1 or L) by value or in device memory (device = 1: read by
 * the kernel; an engine's k_scale tensor). Capture-safe as
 * kv_attn_write_cuda_dev. */
KV_API KV_NODISCARD kv_status
kv_attn_decode_mla_cuda_dev(struct kv_paged_cache cache, uint32_t layer, const struct kv_view *q,
                            const struct kv_attn_dev_pages *pages, int64_t dv, float softmax_scale,
                            const struct kv_attn_dev_scales *scales, const struct kv_view *out,
                            struct kv_attn_cuda_errors *errors, kv_cuda_stream stream);

/* kv_attn_read_cuda with device-resident pages (CSR or block table) and
 * out_indptr_dev [n_seqs + 1] (int32 device memory, vLLM gather_cache's
 * cu_seq_lens): sequence s's tokens go to rows out_indptr[s] ..
 * out_indptr[s + 1] - 1 of k_out / v_out ([T][H][D] or [L][T][H][D], any
 * strides). The kernel checks the pages as kv_attn_decode_cuda_dev does and
 * out_indptr (KV_ATTN_DEV_OUT_INDPTR: inside [0, T], non-decreasing, as
 * many rows as the sequence's tokens); a bad sequence is skipped (its rows
 * untouched), a bad page's tokens too. One CUDA block per (page entry,
 * layer). scales as in kv_attn_write_cuda_dev (x = stored x scale).
 * KV_ERR_NULL for a NULL array of the chosen form or out_indptr_dev with
 * n_seqs > 0, KV_ERR_BAD_SHAPE for k_out and v_out of different T; the
 * host mode's tensor checks. Capture-safe as kv_attn_write_cuda_dev. */
KV_API KV_NODISCARD kv_status kv_attn_read_cuda_dev(
    struct kv_paged_cache cache, int32_t layer, const struct kv_attn_dev_pages *pages,
    const int32_t *out_indptr_dev, const struct kv_view *k_out, const struct kv_view *v_out,
    const struct kv_attn_dev_scales *scales, struct kv_attn_cuda_errors *errors,
    kv_cuda_stream stream);

/* kv_attn_copy_blocks_cuda with copies_dev [n_copies] in device memory
 * (whole blocks within one cache; .tokens is ignored, as there). The kernel
 * checks every id (KV_ATTN_DEV_COPIES) and skips a bad pair. Not detected on
 * the device: a dst that is also a src or another pair's dst (the host mode
 * refuses these; here the result is then undefined). Capture-safe as
 * kv_attn_write_cuda_dev. */
KV_API KV_NODISCARD kv_status kv_attn_copy_blocks_cuda_dev(struct kv_paged_cache cache,
                                                           const struct kv_block_copy *copies_dev,
                                                           uint32_t n_copies,
                                                           struct kv_attn_cuda_errors *errors,
                                                           kv_cuda_stream stream);

/* kv_attn_copy_blocks_ex_cuda with copies_dev [n_copies] in device memory:
 * the layers and planes of opts, within one cache or between two of one
 * block format. The host side makes the checks of
 * kv_attn_copy_blocks_ex_cuda that read no pair; the kernel checks every id
 * (src < src's B, dst < dst's B: KV_ATTN_DEV_COPIES) and skips a bad pair.
 * Not detected on the device: a dst given twice, or (one cache) a dst that
 * is another pair's src (the host mode refuses these; the result is then
 * undefined). KV_ERR_NULL for copies_dev NULL with n_copies > 0.
 * Capture-safe as kv_attn_write_cuda_dev. */
KV_API KV_NODISCARD kv_status kv_attn_copy_blocks_ex_cuda_dev(
    struct kv_paged_cache dst, struct kv_paged_cache src, const struct kv_block_copy *copies_dev,
    uint32_t n_copies, const struct kv_copy_blocks_opts *opts, struct kv_attn_cuda_errors *errors,
    kv_cuda_stream stream);

/* ---- which path ran ---------------------------------------------------------- */

/* The kernels, for kv_attn_stats. */
enum kv_attn_kernel {
    KV_ATTN_WRITE,
    KV_ATTN_READ,
    KV_ATTN_COPY,
    KV_ATTN_DECODE,
    KV_ATTN_PREFILL, /* kv_attn_prefill (kv_attn_decode_ex counts as decode) */
    KV_ATTN_KERNEL_COUNT
};

/* The paths (see the top of the file); a block copy always counts as
 * canonical (it moves whole byte runs). */
enum kv_attn_path {
    KV_ATTN_PATH_CANONICAL,
    KV_ATTN_PATH_OUTER_STRIDE,
    KV_ATTN_PATH_GENERIC,
    KV_ATTN_PATH_COUNT
};

/* Calls per kernel and path since start (or the last reset). */
struct kv_attn_stats {
    uint64_t cpu[KV_ATTN_KERNEL_COUNT][KV_ATTN_PATH_COUNT];
    uint64_t cuda[KV_ATTN_KERNEL_COUNT][KV_ATTN_PATH_COUNT];
};

/* Snapshot of the counters. Thread-safe. */
KV_API void kv_attn_stats_get(struct kv_attn_stats *out);
/* Zero the counters. Thread-safe. */
KV_API void kv_attn_stats_reset(void);
/* "canonical", "outer_stride", "generic"; "?" otherwise. */
KV_API const char *kv_attn_path_name(enum kv_attn_path p);

#ifdef __cplusplus
}
#endif

#endif /* KV_ATTN_H */
