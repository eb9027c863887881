/*
 * kv_attn_int.h - what the attention module's validators hand its executors
 * (module-private).
 *
 * One validator per kernel (kv_attn_check.c) turns the public arguments into
 * a job: every pointer, shape, dtype, stride, slot, page and block id checked,
 * the tensor sides resolved to byte strides, the tokens grouped into runs.
 * The CPU executors (kv_attn_cpu.c) and the CUDA launchers (kv_attn_gpu.c ->
 * kv_attn_cuda.cu) run the same job: there is no second validator.
 */
#ifndef KV_ATTN_INT_H
#define KV_ATTN_INT_H

#include "kv_attn.h"
#include "kv_attn_hd.h"
#include "kv_lib.h"

/* n consecutive tokens of the tensor side <-> n consecutive slots of one
 * block: tokens token .. token+n-1, slots slot .. slot+n-1 (slot / N the
 * same for all). */
struct kv__attn_run {
    int64_t token;
    int64_t slot;
    int64_t n;
};

/* A tensor side of a kernel, [L?][T][H][D], resolved: the address of element
 * [0][0][0][0] and byte strides (layer_stride is 0 for a one-layer tensor). */
struct kv__attn_tensor {
    char *base;
    kv_dtype dtype;
    int64_t layer_stride, token_stride, head_stride, dim_stride; /* bytes */
    int64_t n_tokens;                                            /* T */
};

/* Threads for CPU work of `bytes`: 1 below 256 KiB (a fork/join costs more
 * than it saves), else kv_threads(). */
int kv__attn_threads_for(int64_t bytes);

/* The part of a write or read job j that covers its layer layer0 + lrel
 * alone (n_layers 1, the tensors' bases and the scales of that layer): how
 * the CPU and CUDA executors run a KV_ATTN_ALL_LAYERS call whose scales
 * differ per layer. *out shares j's runs (free only j). */
struct kv__attn_job;
void kv__attn_job_layer(const struct kv__attn_job *j, uint32_t lrel, struct kv__attn_job *out);

/* Decode: sequence s's pages are page_ids[page_start[s] .. page_start[s+1])
 * and it has seq_tokens[s] tokens. */
struct kv__attn_job {
    const char *fn; /* the public entry, for messages */
    enum kv_attn_kernel kernel;
    enum kv_attn_path path;
    struct kv_paged_cache cache;
    uint32_t layer0, n_layers; /* the layers the call covers */

    /* write / read: k, v are the tensor side (source of a write, destination
     * of a read); either may be absent in a read */
    struct kv__attn_tensor k, v;
    bool has_k, has_v;
    struct kv__attn_run *runs; /* [n_runs], in token order */
    int64_t n_runs;
    int64_t max_run; /* longest run, tokens */

    /* scales: [n_scales] each, 1 or H, of layer0; NULL = 1. Layer layer0 +
     * lrel's are at k_scale + lrel * scale_layer_stride (0: shared). */
    const float *k_scale, *v_scale;
    uint32_t n_scales;
    int64_t scale_layer_stride;

    /* decode */
    struct kv__attn_tensor q, out; /* [S][Hq][D]: token = sequence, head = query head */
    uint32_t n_seqs, q_heads;
    float softmax_scale;
    int32_t *page_ids;    /* [page_start[n_seqs]] */
    int64_t *page_start;  /* [n_seqs + 1] */
    int64_t *seq_tokens;  /* [n_seqs] */
    uint32_t page_tokens; /* N / r */
    uint32_t page_ratio;
    /* decode options and prefill (kv_attn_opts): q and out rows of
     * sequence s are q_start[s] .. q_start[s+1] (NULL: row s alone, a
     * decode); window_left -1 = off; soft_cap 0 = off; lse NULL = none */
    int64_t *q_start; /* [n_seqs + 1] */
    int64_t mla_dv;   /* kv_attn_decode_mla / prefill_mla: the value dims (0: not MLA) */
    int32_t window_left;
    float soft_cap;
    float *lse; /* [rows][lse_stride], q_heads used per row */
    int64_t lse_stride;

    /* copy: copies[i].src of src -> copies[i].dst of cache (dst), layers
     * layer0 .. + n_layers, the planes (enum kv_attn_planes, 1..3) */
    const struct kv_block_copy *copies;
    uint32_t n_copies;
    struct kv_paged_cache src; /* == cache when one cache */
    uint32_t planes;
};

/* A slot mapping as the caller holds it: int64 (vLLM) or int32, read in
 * place by the write validator. */
struct kv__attn_slots {
    const void *p;
    bool i32;
};

/* The validators: KV_OK with *job filled (free with kv__attn_job_free), or
 * the refusal with nothing allocated. fn names the public entry in every
 * message. */
kv_status kv__attn_write_check(const char *fn, const struct kv_paged_cache *cache, int32_t layer,
                               const struct kv_view *k, const struct kv_view *v,
                               struct kv__attn_slots slots, int64_t n_slots,
                               const struct kv_scales *scales, struct kv__attn_job *job);
/* The fields of a set of scales, host or device (no value read): rows 0, 1
 * or L; V scales refused for a K-only layout, required otherwise; K always;
 * n 1 or H. what prefixes "scales" in the messages ("device " or ""). */
kv_status kv__attn_scales_shape(const char *fn, const char *what, const float *k, const float *v,
                                uint32_t n, uint32_t layers, int64_t L, int64_t H, bool k_only);

/* The scalar checks of a device-index write (kv_attn_write_cuda_dev):
 * cache, layer, k, v, n_slots in [0, T], slots non-NULL when n_slots > 0;
 * scales: by value, checked as kv_scales (values read), or in device
 * memory (scalars only; job->k_scale / v_scale are then device pointers).
 * The slots are device memory, never read here; *job has no runs (nothing
 * allocated: kv__attn_job_free is still fine). */
kv_status kv__attn_write_dev_check(const char *fn, const struct kv_paged_cache *cache,
                                   int32_t layer, const struct kv_view *k, const struct kv_view *v,
                                   const int64_t *slots, int64_t n_slots,
                                   const struct kv_attn_dev_scales *scales,
                                   struct kv__attn_job *job);
/* check_pages' device mode (never a caller's value): pages of the
 * device-index decode, whose arrays the kernel reads and checks; the
 * validator checks n_seqs and page_ratio only and allocates nothing. */
#define KV__PAGES_DEVICE ((enum kv_pages_format)0x4445)

/* The scalar checks of a device-index decode (kv_attn_decode_cuda_dev):
 * every check of kv__attn_decode_check but the page arrays' contents; the
 * arrays of the chosen form (CSR or block table) must be non-NULL when
 * n_seqs > 0, n_pages >= 0, block_table_cols > 0; scales as for the write;
 * opts (NULL: all off) as kv_attn_decode_ex's (lse: device memory, never
 * read here). Nothing allocated. */
kv_status kv__attn_decode_dev_check(const char *fn, const struct kv_paged_cache *cache,
                                    uint32_t layer, const struct kv_view *q,
                                    const struct kv_attn_dev_pages *pages, float softmax_scale,
                                    const struct kv_attn_dev_scales *scales,
                                    const struct kv_view *out, const struct kv_attn_opts *opts,
                                    struct kv__attn_job *job);

/* The scalar checks of a device-index MLA decode (kv_attn_decode_mla_cuda_dev):
 * every check of kv__attn_decode_mla_check but the page arrays' contents
 * (the arrays as for kv__attn_decode_dev_check); scales: NULL, or K only
 * (v NULL) with n 1, by value (checked as kv_scales) or in device memory
 * (*ksc: layer's value, never read here; NULL otherwise). Nothing
 * allocated. */
kv_status kv__attn_decode_mla_dev_check(const char *fn, const struct kv_paged_cache *cache,
                                        uint32_t layer, const struct kv_view *q,
                                        const struct kv_attn_dev_pages *pages, int64_t dv,
                                        float softmax_scale,
                                        const struct kv_attn_dev_scales *scales,
                                        const struct kv_view *out, struct kv__attn_job *job,
                                        const float **ksc);

/* The scalar checks of a device-index read (kv_attn_read_cuda_dev): those
 * of kv__attn_read_check but the pages' contents and T (read on the
 * device), the pages' arrays as for the decode, out_indptr non-NULL when
 * n_seqs > 0, k_out and v_out of one T; scales as for the write. Nothing
 * allocated. */
kv_status kv__attn_read_dev_check(const char *fn, const struct kv_paged_cache *cache, int32_t layer,
                                  const struct kv_attn_dev_pages *pages, const int32_t *out_indptr,
                                  const struct kv_view *k_out, const struct kv_view *v_out,
                                  const struct kv_attn_dev_scales *scales,
                                  struct kv__attn_job *job);

/* The scalar checks of a device-index copy_blocks (kv_attn_copy_blocks_cuda_dev):
 * the cache, copies non-NULL when n_copies > 0. Nothing allocated. */
kv_status kv__attn_copy_dev_check(const char *fn, const struct kv_paged_cache *cache,
                                  const struct kv_block_copy *copies, uint32_t n_copies,
                                  struct kv__attn_job *job);
/* The scalar checks of a device-index copy_ex (kv_attn_copy_blocks_ex_cuda_dev):
 * kv__attn_copy_check's with no pair read (caches, block formats, opts),
 * copies non-NULL when n_copies > 0. Nothing allocated. */
kv_status kv__attn_copy_ex_dev_check(const char *fn, const struct kv_paged_cache *dst,
                                     const struct kv_paged_cache *src,
                                     const struct kv_block_copy *copies, uint32_t n_copies,
                                     const struct kv_copy_blocks_opts *opts,
                                     struct kv__attn_job *job);

/* A record read back (host memory) as the caller sees it. */
void kv__attn_errors_decode(const struct kv_attn_cuda_errors *rec,
                            struct kv_attn_cuda_error_info *out);
kv_status kv__attn_read_check(const char *fn, const struct kv_paged_cache *cache, int32_t layer,
                              const struct kv_pages *pages, const struct kv_view *k_out,
                              const struct kv_view *v_out, const struct kv_scales *scales,
                              struct kv__attn_job *job);
/* copy: src NULL for one cache (kv_attn_copy_blocks); opts NULL for every
 * layer, K and V. */
kv_status kv__attn_copy_check(const char *fn, const struct kv_paged_cache *dst,
                              const struct kv_paged_cache *src, const struct kv_block_copy *copies,
                              uint32_t n_copies, const struct kv_copy_blocks_opts *opts,
                              struct kv__attn_job *job);
/* Whether a copy job moves whole blocks of every layer and plane of one
 * cache (kv_attn_copy_blocks' byte runs serve it), and the bytes it moves. */
bool kv__attn_copy_is_whole(const struct kv__attn_job *job);
uint64_t kv__attn_copy_bytes(const struct kv__attn_job *job);
/* decode and prefill: qo_indptr NULL for a decode (one query row per
 * sequence), opts NULL for every option off. */
kv_status kv__attn_decode_check(const char *fn, const struct kv_paged_cache *cache, uint32_t layer,
                                const struct kv_view *q, const int32_t *qo_indptr,
                                const struct kv_pages *pages, float softmax_scale,
                                const struct kv_scales *scales, const struct kv_view *out,
                                const struct kv_attn_opts *opts, struct kv__attn_job *job);
/* kv_attn_decode_mla: every check of kv__attn_decode_check that applies
 * (the cache K-only with one KV head, q [S][Hq][D], out [S][Hq][dv], dv in
 * [1, D], K scales only), job->mla_dv = dv. */
kv_status kv__attn_decode_mla_check(const char *fn, const struct kv_paged_cache *cache,
                                    uint32_t layer, const struct kv_view *q,
                                    const struct kv_pages *pages, int64_t dv, float softmax_scale,
                                    const struct kv_scales *scales, const struct kv_view *out,
                                    struct kv__attn_job *job);
/* kv_attn_prefill_mla: kv__attn_decode_mla_check's checks with q, out
 * [T][Hq][.], qo_indptr as kv__attn_decode_check's prefill, opts (NULL:
 * all off) as kv_attn_decode_ex's. */
kv_status kv__attn_prefill_mla_check(const char *fn, const struct kv_paged_cache *cache,
                                     uint32_t layer, const struct kv_view *q,
                                     const int32_t *qo_indptr, const struct kv_pages *pages,
                                     int64_t dv, float softmax_scale,
                                     const struct kv_scales *scales, const struct kv_view *out,
                                     const struct kv_attn_opts *opts, struct kv__attn_job *job);
void kv__attn_job_free(struct kv__attn_job *job);

/* Test hooks of the CPU executors (library-internal; the unit tests use
 * them to reach every code path on small inputs):
 *   nt_min_bytes  moves of at least this many bytes use streaming stores
 *                 (< 0: the default, KV__NT_MIN_BYTES in kv_attn_cpu.c)
 *   portable      true: decode attention never takes the AVX2 path
 * Process-wide; not thread-safe against running kernels. */
void kv__attn_test_tune(int64_t nt_min_bytes, bool portable);
/* Set by kv__attn_test_tune: the portable (non-SIMD, non-streaming) paths only. */
extern bool kv__attn_portable;
/* Set by tests: the decode's fp8 row conversion takes its AVX2 form where
 * the CPU also has AVX-512BW, and the MLA kernels the f32 scores where it
 * has AVX512_BF16 (both forms tested on such a CPU). */
extern bool kv__attn_avx2_only;
/* Set by tests: fp8 rows go through F16C even where the CPU has
 * AVX512_VBMI, in the decode (for the bf16 dot products) and in the MLA
 * kernels (the form a CPU with AVX512_BF16 and without VBMI, Cooper Lake,
 * takes; both tested on a CPU with both). */
extern bool kv__attn_fp8_via_f16;
/* Whether decode attention of dtype dt and head dim D takes the AVX2/FMA
 * path on this CPU (with the current tuning). */
bool kv__attn_decode_simd(kv_dtype dt, int64_t D);
/* Whether decode (the one-query chunks) over a cache of cache_dt with q of
 * q_dt takes its scores as bf16 dot products (AVX512_BF16): a bf16 or fp8
 * cache, q bf16, D % 32 == 0, the AVX2 path, kv__attn_avx2_only not set. */
bool kv__attn_decode_bdot(kv_dtype cache_dt, kv_dtype q_dt, int64_t D);
/* What the AVX2 decode path reads for n elements (a multiple of 8) of
 * dtype dt at p, as floats into out: fp8 rows go through the same f16
 * conversion decode uses; false (out untouched) where decode of dt does not
 * take that path. For tests: every fp8 byte against kv_e4m3_to_f32 /
 * kv_e5m2_to_f32. */
bool kv__attn_decode_row_f32(kv_dtype dt, const void *p, int64_t n, float *out);
/* The bf16 the decode's bf16 dot-product chunks take for n fp8 elements
 * (n % 32 == 0) at p (K and V rows alike), into out; false (out untouched)
 * where decode of dt with q bf16 does not convert fp8 rows to bf16 (no
 * AVX512_VBMI or AVX512_BF16, kv__attn_fp8_via_f16 or kv__attn_avx2_only
 * set). */
bool kv__attn_decode_row_bf16(kv_dtype dt, const void *p, int64_t n, uint16_t *out);

/* Count one call of job's kernel on its path (cuda: the CUDA counters). */
void kv__attn_count(const struct kv__attn_job *job, bool cuda);

#endif /* KV_ATTN_INT_H */
