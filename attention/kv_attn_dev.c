/*
 * kv_attn_dev.c - the CUDA entries with device-resident indices
 * (kv_attn.h, "CUDA kernels with device-resident indices"): scalar checks
 * on the host, the indices checked by the kernel itself (kv__move_run in
 * kv_attn_kernels_hd.h), errors recorded in a device-side record.
 */
#include <inttypes.h>

#include "kv_attn_cuda_int.h"

kv_status kv__attn_write_dev_check(const char *fn, const struct kv_paged_cache *cache,
                                   int32_t layer, const struct kv_view *k, const struct kv_view *v,
                                   const int64_t *slots, int64_t n_slots,
                                   const struct kv_scales *scales, struct kv__attn_job *job)
{
    if (scales)
        return kv__error(KV_ERR_UNSUPPORTED,
                         "%s: scales with device-resident slots: not yet (scales %p)", fn,
                         (const void *)scales);
    /* every scalar check of the host mode, with no slots to read */
    kv_status st = kv__attn_write_check(fn, cache, layer, k, v, (struct kv__attn_slots){NULL, false},
                                        0, NULL, job);
    if (st != KV_OK)
        return st;
    if (n_slots < 0 || n_slots > job->k.n_tokens)
        return kv__error(KV_ERR_BAD_SHAPE, "%s: n_slots %" PRId64 " outside [0, T = %" PRId64 "]",
                         fn, n_slots, job->k.n_tokens);
    if (n_slots > 0 && !slots)
        return kv__error(KV_ERR_NULL, "%s: slots_dev is NULL with n_slots %" PRId64, fn, n_slots);
    return KV_OK;
}

kv_status kv_attn_write_cuda_dev(struct kv_paged_cache cache, int32_t layer,
                                 const struct kv_view *k, const struct kv_view *v,
                                 const int64_t *slots_dev, int64_t n_slots,
                                 const struct kv_scales *scales,
                                 struct kv_attn_cuda_errors *errors, kv_cuda_stream stream)
{
    static const char fn[] = "kv_attn_write_cuda_dev";
    struct kv__attn_job j;
    kv_status st = kv__attn_write_dev_check(fn, &cache, layer, k, v, slots_dev, n_slots, scales, &j);
    if (st != KV_OK)
        return st;
    st = kv__cuda_attn_write_dev(&j, slots_dev, n_slots, errors, stream);
    kv__attn_job_free(&j);
    return st == KV_OK ? kv__ok() : st;
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

void kv__attn_errors_decode(const struct kv_attn_cuda_errors *r, struct kv_attn_cuda_error_info *out)
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

kv_status kv__attn_decode_dev_check(const char *fn, const struct kv_paged_cache *cache,
                                    uint32_t layer, const struct kv_view *q,
                                    const struct kv_attn_dev_pages *pages, float softmax_scale,
                                    const struct kv_scales *scales, const struct kv_view *out,
                                    struct kv__attn_job *job)
{
    memset(job, 0, sizeof(*job));
    job->fn = fn;
    if (!pages)
        return kv__error(KV_ERR_NULL, "%s: pages is NULL", fn);
    if (scales)
        return kv__error(KV_ERR_UNSUPPORTED,
                         "%s: scales with device-resident pages: not yet (scales %p)", fn,
                         (const void *)scales);
    if (pages->n_seqs &&
        (!pages->indptr || !pages->last_page_len || (pages->n_pages > 0 && !pages->indices)))
        return kv__error(KV_ERR_NULL,
                         "%s: device CSR pages need indptr=%p indices=%p last_page_len=%p "
                         "(n_seqs %" PRIu32 ", n_pages %" PRId64 ")",
                         fn, (const void *)pages->indptr, (const void *)pages->indices,
                         (const void *)pages->last_page_len, pages->n_seqs, pages->n_pages);
    if (pages->n_pages < 0 || pages->n_pages > INT32_MAX)
        return kv__error(KV_ERR_BAD_SHAPE, "%s: n_pages %" PRId64 " outside [0, 2^31)", fn,
                         pages->n_pages);
    const struct kv_pages pg = {.format = KV__PAGES_DEVICE,
                                .n_seqs = pages->n_seqs,
                                .page_ratio = pages->page_ratio};
    /* every scalar check of the host mode; check_pages reads no array */
    return kv__attn_decode_check(fn, cache, layer, q, NULL, &pg, softmax_scale, NULL, out, NULL,
                                 job);
}

kv_status kv_attn_decode_cuda_dev(struct kv_paged_cache cache, uint32_t layer,
                                  const struct kv_view *q, const struct kv_attn_dev_pages *pages,
                                  float softmax_scale, const struct kv_scales *scales,
                                  const struct kv_view *out, struct kv_attn_cuda_errors *errors,
                                  kv_cuda_stream stream)
{
    static const char fn[] = "kv_attn_decode_cuda_dev";
    struct kv__attn_job j;
    kv_status st = kv__attn_decode_dev_check(fn, &cache, layer, q, pages, softmax_scale, scales,
                                             out, &j);
    if (st != KV_OK)
        return st;
    st = kv__cuda_attn_decode_dev(&j, pages, errors, stream);
    kv__attn_job_free(&j);
    return st == KV_OK ? kv__ok() : st;
}

kv_status kv__attn_copy_dev_check(const char *fn, const struct kv_paged_cache *cache,
                                  const struct kv_block_copy *copies, uint32_t n_copies,
                                  struct kv__attn_job *job)
{
    /* the cache's checks of the host mode, with no pair to read */
    kv_status st = kv__attn_copy_check(fn, cache, NULL, NULL, 0, NULL, job);
    if (st != KV_OK)
        return st;
    if (n_copies && !copies)
        return kv__error(KV_ERR_NULL, "%s: copies_dev is NULL with n_copies %" PRIu32, fn,
                         n_copies);
    return KV_OK;
}

kv_status kv_attn_copy_blocks_cuda_dev(struct kv_paged_cache cache,
                                       const struct kv_block_copy *copies_dev, uint32_t n_copies,
                                       struct kv_attn_cuda_errors *errors, kv_cuda_stream stream)
{
    static const char fn[] = "kv_attn_copy_blocks_cuda_dev";
    struct kv__attn_job j;
    kv_status st = kv__attn_copy_dev_check(fn, &cache, copies_dev, n_copies, &j);
    if (st != KV_OK)
        return st;
    st = kv__cuda_attn_copy_dev(&j, copies_dev, n_copies, errors, stream);
    kv__attn_job_free(&j);
    return st == KV_OK ? kv__ok() : st;
}
