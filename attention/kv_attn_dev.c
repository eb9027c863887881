/*
 * kv_attn_dev.c - the CUDA entries with device-resident indices
 * (kv_attn.h, "CUDA kernels with device-resident indices"): scalar checks
 * on the host, the indices checked by the kernel itself (kv__move_run in
 * kv_attn_kernels_hd.h), errors recorded in a device-side record.
 */
#include <inttypes.h>

#include "kv_attn_cuda_int.h"

/* Before the validator: device-index scales in host memory become the
 * struct kv_scales the validator checks (every value it reads: finite, > 0)
 * and points the job at; device memory is never read here (*out NULL). */
static kv_status dev_scales_pre(const char *fn, const struct kv_attn_dev_scales *s,
                                struct kv_scales *hs, const struct kv_scales **out)
{
    *out = NULL;
    if (!s)
        return KV_OK;
    if (s->device > 1)
        return kv__error(KV_ERR_INVALID_ARG,
                         "%s: scales device %" PRIu32
                         ": expected 0 (host arrays, by value) or 1 (device memory)",
                         fn, s->device);
    if (s->device)
        return KV_OK;
    *hs = (struct kv_scales){s->k, s->v, s->n, s->layers};
    *out = hs;
    return KV_OK;
}

/* After the validator (the job's layout, layer0 and n_layers set): by value,
 * the count the launch parameters hold; in device memory, the scalar checks
 * of struct kv_scales (no value read) and the job's scale fields (device
 * pointers, layer0's row). */
static kv_status dev_scales_post(const char *fn, const struct kv_attn_dev_scales *s,
                                 struct kv__attn_job *job)
{
    if (!s)
        return KV_OK;
    if (!s->device) {
        const int64_t n =
            (job->scale_layer_stride ? (int64_t)job->n_layers : 1) * (int64_t)job->n_scales;
        if (n > KV_ATTN_DEV_SCALES_MAX)
            return kv__error(KV_ERR_UNSUPPORTED,
                             "%s: %" PRId64 " scales per plane by value (at most %d): pass them "
                             "in device memory (device = 1)",
                             fn, n, KV_ATTN_DEV_SCALES_MAX);
        return KV_OK;
    }
    const struct kv_layout *lo = &job->cache.layout;
    const uint32_t rows = s->layers ? s->layers : 1;
    /* the host validator's checks of the same fields (kv__attn_scales_shape) */
    kv_status st = kv__attn_scales_shape(fn, "device ", s->k, s->v, s->n, s->layers, lo->num_layers,
                                         lo->num_heads, lo->k_only);
    if (st != KV_OK ||
        (st = kv__check_dev_aligned(fn, "device scales k", s->k, sizeof(float))) != KV_OK ||
        (st = kv__check_dev_aligned(fn, "device scales v", s->v, sizeof(float))) != KV_OK)
        return st;
    const size_t r0 = rows == 1 ? 0 : job->layer0;
    job->k_scale = s->k + r0 * s->n;
    job->v_scale = s->v ? s->v + r0 * s->n : NULL;
    job->n_scales = s->n;
    job->scale_layer_stride = rows == 1 ? 0 : (int64_t)s->n;
    return KV_OK;
}

/* The caller's error record: the kernels' 64-bit atomics need it 8-byte
 * aligned (NULL: not recorded). */
static kv_status errors_aligned(const char *fn, const struct kv_attn_cuda_errors *errors)
{
    return kv__check_dev_aligned(fn, "errors", errors, _Alignof(struct kv_attn_cuda_errors));
}

/* An entry's end: the job freed, the launch's status (KV_OK clearing the
 * last error). */
static kv_status dev_done(struct kv__attn_job *j, kv_status st)
{
    kv__attn_job_free(j);
    return st == KV_OK ? kv__ok() : st;
}

kv_status kv__attn_write_dev_check(const char *fn, const struct kv_paged_cache *cache,
                                   int32_t layer, const struct kv_view *k, const struct kv_view *v,
                                   const int64_t *slots, int64_t n_slots,
                                   const struct kv_attn_dev_scales *scales,
                                   struct kv__attn_job *job)
{
    struct kv_scales hs;
    const struct kv_scales *hsp = NULL;
    memset(job, 0, sizeof(*job));
    kv_status st = dev_scales_pre(fn, scales, &hs, &hsp);
    if (st != KV_OK)
        return st;
    /* every scalar check of the host mode, with no slots to read */
    st = kv__attn_write_check(fn, cache, layer, k, v, (struct kv__attn_slots){NULL, false}, 0, hsp,
                              job);
    if (st != KV_OK)
        return st;
    if ((st = dev_scales_post(fn, scales, job)) != KV_OK)
        return st;
    if (n_slots < 0 || n_slots > job->k.n_tokens)
        return kv__error(KV_ERR_BAD_SHAPE, "%s: n_slots %" PRId64 " outside [0, T = %" PRId64 "]",
                         fn, n_slots, job->k.n_tokens);
    if (n_slots > 0 && !slots)
        return kv__error(KV_ERR_NULL, "%s: slots_dev is NULL with n_slots %" PRId64, fn, n_slots);
    return kv__check_dev_aligned(fn, "slots_dev", slots, sizeof(int64_t));
}

kv_status kv_attn_write_cuda_dev(struct kv_paged_cache cache, int32_t layer,
                                 const struct kv_view *k, const struct kv_view *v,
                                 const int64_t *slots_dev, int64_t n_slots,
                                 const struct kv_attn_dev_scales *scales,
                                 struct kv_attn_cuda_errors *errors, kv_cuda_stream stream)
{
    static const char fn[] = "kv_attn_write_cuda_dev";
    struct kv__attn_job j;
    kv_status st = errors_aligned(fn, errors);
    if (st != KV_OK)
        return st;
    st = kv__attn_write_dev_check(fn, &cache, layer, k, v, slots_dev, n_slots, scales, &j);
    if (st != KV_OK)
        return st;
    return dev_done(&j, kv__cuda_attn_write_dev(&j, slots_dev, n_slots, scales && !scales->device,
                                                errors, stream));
}

kv_status kv_attn_cuda_errors_create(struct kv_attn_cuda_errors **out)
{
    if (!out)
        return kv__error(KV_ERR_NULL, "kv_attn_cuda_errors_create: out is NULL");
    struct kv_attn_cuda_errors *e = NULL;
    const kv_status st = kv__cuda_attn_errors_alloc(&e);
    if (st != KV_OK)
        return st;
    *out = e;
    return kv__ok();
}

void kv_attn_cuda_errors_destroy(struct kv_attn_cuda_errors *errors)
{
    if (errors)
        kv__cuda_attn_errors_free(errors);
}

kv_status kv_attn_cuda_errors_reset(struct kv_attn_cuda_errors *errors, kv_cuda_stream stream)
{
    if (!errors)
        return kv__error(KV_ERR_NULL, "kv_attn_cuda_errors_reset: errors is NULL");
    const kv_status st = kv__cuda_attn_errors_zero(errors, stream);
    return st == KV_OK ? kv__ok() : st;
}

void kv__attn_errors_decode(const struct kv_attn_cuda_errors *r,
                            struct kv_attn_cuda_error_info *out)
{
    memset(out, 0, sizeof(*out));
    out->count = r->count;
    if (r->first_key == 0)
        return;
    const uint64_t k = ~r->first_key;
    out->array = (enum kv_attn_dev_array)(k >> 56);
    out->index = (int64_t)(k & ((UINT64_C(1) << 56) - 1));
    out->value = r->value_key == r->first_key ? r->first_value : 0;
}

kv_status kv_attn_cuda_errors_get(const struct kv_attn_cuda_errors *errors,
                                  struct kv_attn_cuda_error_info *out, kv_cuda_stream stream)
{
    if (!errors || !out)
        return kv__error(KV_ERR_NULL, "kv_attn_cuda_errors_get: errors=%p out=%p",
                         (const void *)errors, (void *)out);
    struct kv_attn_cuda_errors host = {0, 0, 0, 0};
    const kv_status st = kv__cuda_attn_errors_read(errors, &host, stream);
    if (st != KV_OK)
        return st;
    kv__attn_errors_decode(&host, out);
    return kv__ok();
}

/* The device pages' scalars: the format, the arrays of that form non-NULL
 * when n_seqs > 0, n_pages and block_table_cols in range. */
static kv_status dev_pages_check(const char *fn, const struct kv_attn_dev_pages *pages)
{
    if (pages->format == KV_PAGES_BLOCK_TABLE) {
        if (pages->n_seqs && (!pages->block_table || !pages->seq_lens))
            return kv__error(KV_ERR_NULL,
                             "%s: device block-table pages need block_table=%p seq_lens=%p "
                             "(n_seqs %" PRIu32 ")",
                             fn, (const void *)pages->block_table, (const void *)pages->seq_lens,
                             pages->n_seqs);
        if (pages->n_seqs && pages->block_table_cols == 0)
            return kv__error(KV_ERR_INVALID_ARG, "%s: block_table_cols 0 with n_seqs %" PRIu32, fn,
                             pages->n_seqs);
    } else if (pages->format != 0 && pages->format != KV_PAGES_CSR) {
        return kv__error(KV_ERR_INVALID_ARG,
                         "%s: pages format %d: expected 0 or %d (CSR) or %d (block table)", fn,
                         (int)pages->format, (int)KV_PAGES_CSR, (int)KV_PAGES_BLOCK_TABLE);
    } else if (pages->n_seqs &&
               (!pages->indptr || !pages->last_page_len || (pages->n_pages > 0 && !pages->indices)))
        return kv__error(KV_ERR_NULL,
                         "%s: device CSR pages need indptr=%p indices=%p last_page_len=%p "
                         "(n_seqs %" PRIu32 ", n_pages %" PRId64 ")",
                         fn, (const void *)pages->indptr, (const void *)pages->indices,
                         (const void *)pages->last_page_len, pages->n_seqs, pages->n_pages);
    else if (pages->n_pages < 0 || pages->n_pages > INT32_MAX)
        return kv__error(KV_ERR_BAD_SHAPE, "%s: n_pages %" PRId64 " outside [0, 2^31)", fn,
                         pages->n_pages);
    /* the int32 arrays of the chosen form (the other form's are not read) */
    const bool bt = pages->format == KV_PAGES_BLOCK_TABLE;
    const int32_t *arr[3] = {bt ? pages->block_table : pages->indptr,
                             bt ? pages->seq_lens : pages->indices,
                             bt ? NULL : pages->last_page_len};
    static const char *const names[2][3] = {{"indptr", "indices", "last_page_len"},
                                            {"block_table", "seq_lens", ""}};
    for (int i = 0; i < 3; i++) {
        const kv_status st = kv__check_dev_aligned(fn, names[bt][i], arr[i], sizeof(int32_t));
        if (st != KV_OK)
            return st;
    }
    return KV_OK;
}

/* The start of a device-pages entry's checks: job cleared, pages non-NULL,
 * the scales before the validator (dev_scales_pre), the pages' scalars and
 * *pg, what the validator reads of them (no array). */
static kv_status dev_pages_pre(const char *fn, const struct kv_attn_dev_pages *pages,
                               const struct kv_attn_dev_scales *scales, struct kv_scales *hs,
                               const struct kv_scales **hsp, struct kv_pages *pg,
                               struct kv__attn_job *job)
{
    memset(job, 0, sizeof(*job));
    job->fn = fn;
    *hsp = NULL;
    if (!pages)
        return kv__error(KV_ERR_NULL, "%s: pages is NULL", fn);
    const kv_status st = dev_scales_pre(fn, scales, hs, hsp);
    if (st != KV_OK)
        return st;
    *pg = (struct kv_pages){
        .format = KV__PAGES_DEVICE, .n_seqs = pages->n_seqs, .page_ratio = pages->page_ratio};
    return dev_pages_check(fn, pages);
}

kv_status kv__attn_decode_dev_check(const char *fn, const struct kv_paged_cache *cache,
                                    uint32_t layer, const struct kv_view *q,
                                    const struct kv_attn_dev_pages *pages, float softmax_scale,
                                    const struct kv_attn_dev_scales *scales,
                                    const struct kv_view *out, const struct kv_attn_opts *opts,
                                    struct kv__attn_job *job)
{
    struct kv_scales hs;
    const struct kv_scales *hsp;
    struct kv_pages pg;
    kv_status st = dev_pages_pre(fn, pages, scales, &hs, &hsp, &pg, job);
    if (st != KV_OK)
        return st;
    /* every scalar check of the host mode; check_pages reads no array */
    st = kv__attn_decode_check(fn, cache, layer, q, NULL, &pg, softmax_scale, hsp, out, opts, job);
    if (st != KV_OK)
        return st;
    return dev_scales_post(fn, scales, job);
}

static kv_status decode_dev(const char *fn, struct kv_paged_cache cache, uint32_t layer,
                            const struct kv_view *q, const struct kv_attn_dev_pages *pages,
                            float softmax_scale, const struct kv_attn_dev_scales *scales,
                            const struct kv_view *out, const struct kv_attn_opts *opts,
                            struct kv_attn_cuda_errors *errors, kv_cuda_stream stream)
{
    struct kv__attn_job j;
    kv_status st = errors_aligned(fn, errors);
    if (st != KV_OK)
        return st;
    st = kv__attn_decode_dev_check(fn, &cache, layer, q, pages, softmax_scale, scales, out, opts,
                                   &j);
    if (st != KV_OK)
        return st;
    return dev_done(&j,
                    kv__cuda_attn_decode_dev(&j, pages, scales && !scales->device, errors, stream));
}

/* kv_attn_decode_ex_cuda_dev with a caller workspace for split-KV
 * (library-internal, for the GPU tests and bench until split-KV has a
 * public form): ws device memory of ws_bytes, max_tokens the longest
 * sequence's tokens or -1 (kv__cuda_attn_decode_dev_ws). Capture-safe. */
kv_status kv__attn_decode_ex_cuda_dev_ws(struct kv_paged_cache cache, uint32_t layer,
                                         const struct kv_view *q,
                                         const struct kv_attn_dev_pages *pages, float softmax_scale,
                                         const struct kv_attn_dev_scales *scales,
                                         const struct kv_view *out, const struct kv_attn_opts *opts,
                                         void *ws, size_t ws_bytes, int64_t max_tokens,
                                         struct kv_attn_cuda_errors *errors, kv_cuda_stream stream);
kv_status kv__attn_decode_ex_cuda_dev_ws(struct kv_paged_cache cache, uint32_t layer,
                                         const struct kv_view *q,
                                         const struct kv_attn_dev_pages *pages, float softmax_scale,
                                         const struct kv_attn_dev_scales *scales,
                                         const struct kv_view *out, const struct kv_attn_opts *opts,
                                         void *ws, size_t ws_bytes, int64_t max_tokens,
                                         struct kv_attn_cuda_errors *errors, kv_cuda_stream stream)
{
    static const char fn[] = "kv_attn_decode_ex_cuda_dev";
    struct kv__attn_job j;
    kv_status st = errors_aligned(fn, errors);
    if (st != KV_OK)
        return st;
    st = kv__attn_decode_dev_check(fn, &cache, layer, q, pages, softmax_scale, scales, out, opts,
                                   &j);
    if (st != KV_OK)
        return st;
    return dev_done(&j, kv__cuda_attn_decode_dev_ws(&j, pages, scales && !scales->device, errors,
                                                    ws, ws_bytes, max_tokens, stream));
}

kv_status kv_attn_decode_cuda_dev(struct kv_paged_cache cache, uint32_t layer,
                                  const struct kv_view *q, const struct kv_attn_dev_pages *pages,
                                  float softmax_scale, const struct kv_attn_dev_scales *scales,
                                  const struct kv_view *out, struct kv_attn_cuda_errors *errors,
                                  kv_cuda_stream stream)
{
    return decode_dev("kv_attn_decode_cuda_dev", cache, layer, q, pages, softmax_scale, scales, out,
                      NULL, errors, stream);
}

kv_status kv_attn_decode_ex_cuda_dev(struct kv_paged_cache cache, uint32_t layer,
                                     const struct kv_view *q, const struct kv_attn_dev_pages *pages,
                                     float softmax_scale, const struct kv_attn_dev_scales *scales,
                                     const struct kv_view *out, const struct kv_attn_opts *opts,
                                     struct kv_attn_cuda_errors *errors, kv_cuda_stream stream)
{
    return decode_dev("kv_attn_decode_ex_cuda_dev", cache, layer, q, pages, softmax_scale, scales,
                      out, opts, errors, stream);
}

kv_status kv__attn_decode_mla_dev_check(const char *fn, const struct kv_paged_cache *cache,
                                        uint32_t layer, const struct kv_view *q,
                                        const struct kv_attn_dev_pages *pages, int64_t dv,
                                        float softmax_scale,
                                        const struct kv_attn_dev_scales *scales,
                                        const struct kv_view *out, struct kv__attn_job *job,
                                        const float **ksc)
{
    struct kv_scales hs;
    const struct kv_scales *hsp;
    struct kv_pages pg;
    *ksc = NULL;
    kv_status st = dev_pages_pre(fn, pages, scales, &hs, &hsp, &pg, job);
    if (st != KV_OK)
        return st;
    st = kv__attn_decode_mla_check(fn, cache, layer, q, &pg, dv, softmax_scale, hsp, out, job);
    if (st != KV_OK || !scales || !scales->device)
        return st;
    /* device memory: the K scale of a one-plane latent cache, per tensor */
    const struct kv_layout *lo = &cache->layout;
    const uint32_t rows = scales->layers ? scales->layers : 1;
    if (!scales->k || scales->v)
        return kv__error(KV_ERR_INVALID_ARG,
                         "%s: device scales k=%p v=%p: an MLA cache takes a K scale only", fn,
                         (const void *)scales->k, (const void *)scales->v);
    if (scales->n != 1)
        return kv__error(KV_ERR_INVALID_ARG,
                         "%s: %" PRIu32 " scales per layer: an MLA latent cache has one (per "
                         "tensor)",
                         fn, scales->n);
    if (rows != 1 && (int64_t)rows != lo->num_layers)
        return kv__error(KV_ERR_INVALID_ARG,
                         "%s: scales for %" PRIu32 " layers: expected 0 or 1 (shared by every "
                         "layer) or %" PRId64 " (one row per layer)",
                         fn, scales->layers, lo->num_layers);
    if ((st = kv__check_dev_aligned(fn, "device scales k", scales->k, sizeof(float))) != KV_OK)
        return st;
    *ksc = scales->k + (rows == 1 ? 0 : layer);
    return KV_OK;
}

kv_status kv_attn_decode_mla_cuda_dev(struct kv_paged_cache cache, uint32_t layer,
                                      const struct kv_view *q,
                                      const struct kv_attn_dev_pages *pages, int64_t dv,
                                      float softmax_scale, const struct kv_attn_dev_scales *scales,
                                      const struct kv_view *out, struct kv_attn_cuda_errors *errors,
                                      kv_cuda_stream stream)
{
    static const char fn[] = "kv_attn_decode_mla_cuda_dev";
    struct kv__attn_job j;
    kv_status st = errors_aligned(fn, errors);
    if (st != KV_OK)
        return st;
    const float *ksc;
    st = kv__attn_decode_mla_dev_check(fn, &cache, layer, q, pages, dv, softmax_scale, scales, out,
                                       &j, &ksc);
    if (st != KV_OK)
        return st;
    return dev_done(&j, kv__cuda_attn_decode_mla_dev(&j, pages, ksc, errors, stream));
}

kv_status kv__attn_copy_dev_check(const char *fn, const struct kv_paged_cache *cache,
                                  const struct kv_block_copy *copies, uint32_t n_copies,
                                  struct kv__attn_job *job)
{
    /* copy_ex's with no source cache and no options: the one cache's */
    return kv__attn_copy_ex_dev_check(fn, cache, NULL, copies, n_copies, NULL, job);
}

kv_status kv__attn_read_dev_check(const char *fn, const struct kv_paged_cache *cache, int32_t layer,
                                  const struct kv_attn_dev_pages *pages, const int32_t *out_indptr,
                                  const struct kv_view *k_out, const struct kv_view *v_out,
                                  const struct kv_attn_dev_scales *scales, struct kv__attn_job *job)
{
    struct kv_scales hs;
    const struct kv_scales *hsp;
    struct kv_pages pg;
    kv_status st = dev_pages_pre(fn, pages, scales, &hs, &hsp, &pg, job);
    if (st != KV_OK)
        return st;
    if (pages->n_seqs && !out_indptr)
        return kv__error(KV_ERR_NULL, "%s: out_indptr_dev is NULL with n_seqs %" PRIu32, fn,
                         pages->n_seqs);
    if ((st = kv__check_dev_aligned(fn, "out_indptr_dev", out_indptr, sizeof(int32_t))) != KV_OK)
        return st;
    /* every scalar check of the host mode; no page array read, no T */
    st = kv__attn_read_check(fn, cache, layer, &pg, k_out, v_out, hsp, job);
    if (st != KV_OK)
        return st;
    if (job->has_k && job->has_v && job->k.n_tokens != job->v.n_tokens)
        return kv__error(KV_ERR_BAD_SHAPE, "%s: k_out has %" PRId64 " tokens, v_out %" PRId64, fn,
                         job->k.n_tokens, job->v.n_tokens);
    return dev_scales_post(fn, scales, job);
}

kv_status kv_attn_read_cuda_dev(struct kv_paged_cache cache, int32_t layer,
                                const struct kv_attn_dev_pages *pages,
                                const int32_t *out_indptr_dev, const struct kv_view *k_out,
                                const struct kv_view *v_out,
                                const struct kv_attn_dev_scales *scales,
                                struct kv_attn_cuda_errors *errors, kv_cuda_stream stream)
{
    static const char fn[] = "kv_attn_read_cuda_dev";
    struct kv__attn_job j;
    kv_status st = errors_aligned(fn, errors);
    if (st != KV_OK)
        return st;
    st =
        kv__attn_read_dev_check(fn, &cache, layer, pages, out_indptr_dev, k_out, v_out, scales, &j);
    if (st != KV_OK)
        return st;
    return dev_done(&j, kv__cuda_attn_read_dev(&j, pages, out_indptr_dev, scales && !scales->device,
                                               errors, stream));
}

kv_status kv__attn_copy_ex_dev_check(const char *fn, const struct kv_paged_cache *dst,
                                     const struct kv_paged_cache *src,
                                     const struct kv_block_copy *copies, uint32_t n_copies,
                                     const struct kv_copy_blocks_opts *opts,
                                     struct kv__attn_job *job)
{
    /* the caches', formats' and options' checks of the host mode, no pair */
    kv_status st = kv__attn_copy_check(fn, dst, src, NULL, 0, opts, job);
    if (st != KV_OK)
        return st;
    if (n_copies && !copies)
        return kv__error(KV_ERR_NULL, "%s: copies_dev is NULL with n_copies %" PRIu32, fn,
                         n_copies);
    return kv__check_dev_aligned(fn, "copies_dev", copies, _Alignof(struct kv_block_copy));
}

kv_status kv_attn_copy_blocks_ex_cuda_dev(struct kv_paged_cache dst, struct kv_paged_cache src,
                                          const struct kv_block_copy *copies_dev, uint32_t n_copies,
                                          const struct kv_copy_blocks_opts *opts,
                                          struct kv_attn_cuda_errors *errors, kv_cuda_stream stream)
{
    static const char fn[] = "kv_attn_copy_blocks_ex_cuda_dev";
    struct kv__attn_job j;
    kv_status st = errors_aligned(fn, errors);
    if (st != KV_OK)
        return st;
    st = kv__attn_copy_ex_dev_check(fn, &dst, &src, copies_dev, n_copies, opts, &j);
    if (st != KV_OK)
        return st;
    return dev_done(&j, kv__cuda_attn_copy_ex_dev(&j, copies_dev, n_copies, errors, stream));
}

kv_status kv_attn_copy_blocks_cuda_dev(struct kv_paged_cache cache,
                                       const struct kv_block_copy *copies_dev, uint32_t n_copies,
                                       struct kv_attn_cuda_errors *errors, kv_cuda_stream stream)
{
    static const char fn[] = "kv_attn_copy_blocks_cuda_dev";
    struct kv__attn_job j;
    kv_status st = errors_aligned(fn, errors);
    if (st != KV_OK)
        return st;
    st = kv__attn_copy_dev_check(fn, &cache, copies_dev, n_copies, &j);
    if (st != KV_OK)
        return st;
    return dev_done(&j, kv__cuda_attn_copy_dev(&j, copies_dev, n_copies, errors, stream));
}
