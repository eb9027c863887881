/*
 * kv_attn_gpu.c - public entries of the CUDA kernels: the CPU kernels'
 * validators (kv_attn_check.c), then the launch through the CUDA boundary
 * (kv_attn_cuda_int.h). Index arrays (slots, pages, copies) are host memory,
 * checked here before anything is launched.
 */
#include "kv_attn_cuda_int.h"

/* One launch, or one per layer when the scales differ per layer (the
 * split the CPU executor makes, kv__attn_job_layer). */
static kv_status cuda_move(const struct kv__attn_job *j, bool to_cache, kv_cuda_stream stream)
{
    if (!j->scale_layer_stride || j->n_layers == 1)
        return kv__cuda_attn_move(j, to_cache, stream);
    for (uint32_t l = 0; l < j->n_layers; l++) {
        struct kv__attn_job one;
        kv__attn_job_layer(j, l, &one);
        const kv_status st = kv__cuda_attn_move(&one, to_cache, stream);
        if (st != KV_OK)
            return st;
    }
    return KV_OK;
}

/* kv_attn_write_cuda and kv_attn_write_i32_cuda: only the slots' index
 * width differs. */
static kv_status write_slots_cuda(const char *fn, struct kv_paged_cache cache, int32_t layer,
                                  const struct kv_view *k, const struct kv_view *v,
                                  struct kv__attn_slots sl, int64_t n_slots,
                                  const struct kv_scales *scales, kv_cuda_stream stream)
{
    struct kv__attn_job j;
    kv_status st = kv__attn_write_check(fn, &cache, layer, k, v, sl, n_slots, scales, &j);
    if (st != KV_OK)
        return st;
    st = cuda_move(&j, true, stream);
    if (st == KV_OK)
        kv__attn_count(&j, true);
    kv__attn_job_free(&j);
    return st == KV_OK ? kv__ok() : st;
}

kv_status kv_attn_write_cuda(struct kv_paged_cache cache, int32_t layer, const struct kv_view *k,
                             const struct kv_view *v, const int64_t *slots, int64_t n_slots,
                             const struct kv_scales *scales, kv_cuda_stream stream)
{
    return write_slots_cuda("kv_attn_write_cuda", cache, layer, k, v,
                            (struct kv__attn_slots){slots, false}, n_slots, scales, stream);
}

kv_status kv_attn_write_i32_cuda(struct kv_paged_cache cache, int32_t layer,
                                 const struct kv_view *k, const struct kv_view *v,
                                 const int32_t *slots, int64_t n_slots,
                                 const struct kv_scales *scales, kv_cuda_stream stream)
{
    return write_slots_cuda("kv_attn_write_i32_cuda", cache, layer, k, v,
                            (struct kv__attn_slots){slots, true}, n_slots, scales, stream);
}

kv_status kv_attn_read_cuda(struct kv_paged_cache cache, int32_t layer,
                            const struct kv_pages *pages, const struct kv_view *k_out,
                            const struct kv_view *v_out, const struct kv_scales *scales,
                            kv_cuda_stream stream)
{
    struct kv__attn_job j;
    kv_status st =
        kv__attn_read_check("kv_attn_read_cuda", &cache, layer, pages, k_out, v_out, scales, &j);
    if (st != KV_OK)
        return st;
    st = cuda_move(&j, false, stream);
    if (st == KV_OK)
        kv__attn_count(&j, true);
    kv__attn_job_free(&j);
    return st == KV_OK ? kv__ok() : st;
}

kv_status kv_attn_copy_blocks_cuda(struct kv_paged_cache cache, const struct kv_block_copy *copies,
                                   uint32_t n_copies, kv_cuda_stream stream)
{
    struct kv__attn_job j;
    kv_status st =
        kv__attn_copy_check("kv_attn_copy_blocks_cuda", &cache, NULL, copies, n_copies, NULL, &j);
    if (st != KV_OK)
        return st;
    st = kv__cuda_attn_copy(&j, stream);
    if (st == KV_OK) {
        kv__attn_count(&j, true);
        kv__copy_count(KV_COPY_BLOCK_COPY, kv__attn_copy_bytes(&j));
    }
    kv__attn_job_free(&j);
    return st == KV_OK ? kv__ok() : st;
}

kv_status kv_attn_copy_blocks_ex_cuda(struct kv_paged_cache dst, struct kv_paged_cache src,
                                      const struct kv_block_copy *copies, uint32_t n_copies,
                                      const struct kv_copy_blocks_opts *opts, kv_cuda_stream stream)
{
    struct kv__attn_job j;
    kv_status st =
        kv__attn_copy_check("kv_attn_copy_blocks_ex_cuda", &dst, &src, copies, n_copies, opts, &j);
    if (st != KV_OK)
        return st;
    st = kv__attn_copy_is_whole(&j) ? kv__cuda_attn_copy(&j, stream)
                                    : kv__cuda_attn_copy_ex(&j, stream);
    if (st == KV_OK) {
        kv__attn_count(&j, true);
        kv__copy_count(KV_COPY_BLOCK_COPY, kv__attn_copy_bytes(&j));
    }
    kv__attn_job_free(&j);
    return st == KV_OK ? kv__ok() : st;
}

/* The decode entries on CUDA: one validator with the CPU's; the CUDA
 * kernel runs one query row per sequence with every option (window, soft
 * cap, lse) and runs multi-token jobs (qo_indptr) on the
 * multi-token kernel. */
static kv_status decode_cuda(const char *fn, struct kv_paged_cache cache, uint32_t layer,
                             const struct kv_view *q, const int32_t *qo_indptr,
                             const struct kv_pages *pages, float softmax_scale,
                             const struct kv_scales *scales, const struct kv_view *out,
                             const struct kv_attn_opts *opts, kv_cuda_stream stream)
{
    struct kv__attn_job j;
    kv_status st = kv__attn_decode_check(fn, &cache, layer, q, qo_indptr, pages, softmax_scale,
                                         scales, out, opts, &j);
    if (st != KV_OK)
        return st;
    if (j.q_start)
        st = kv__cuda_attn_prefill(&j, stream);
    else
        st = kv__cuda_attn_decode(&j, stream);
    if (st == KV_OK)
        kv__attn_count(&j, true);
    kv__attn_job_free(&j);
    return st == KV_OK ? kv__ok() : st;
}

kv_status kv_attn_decode_cuda(struct kv_paged_cache cache, uint32_t layer, const struct kv_view *q,
                              const struct kv_pages *pages, float softmax_scale,
                              const struct kv_scales *scales, const struct kv_view *out,
                              kv_cuda_stream stream)
{
    return decode_cuda("kv_attn_decode_cuda", cache, layer, q, NULL, pages, softmax_scale, scales,
                       out, NULL, stream);
}

kv_status kv_attn_decode_mla_cuda(struct kv_paged_cache cache, uint32_t layer,
                                  const struct kv_view *q, const struct kv_pages *pages, int64_t dv,
                                  float softmax_scale, const struct kv_scales *scales,
                                  const struct kv_view *out, kv_cuda_stream stream)
{
    struct kv__attn_job j;
    kv_status st = kv__attn_decode_mla_check("kv_attn_decode_mla_cuda", &cache, layer, q, pages, dv,
                                             softmax_scale, scales, out, &j);
    if (st != KV_OK)
        return st;
    st = kv__cuda_attn_decode_mla(&j, stream);
    if (st == KV_OK)
        kv__attn_count(&j, true);
    kv__attn_job_free(&j);
    return st == KV_OK ? kv__ok() : st;
}

kv_status kv_attn_prefill_mla_cuda(struct kv_paged_cache cache, uint32_t layer,
                                   const struct kv_view *q, const int32_t *qo_indptr,
                                   const struct kv_pages *pages, int64_t dv, float softmax_scale,
                                   const struct kv_scales *scales, const struct kv_view *out,
                                   const struct kv_attn_opts *opts, kv_cuda_stream stream)
{
    struct kv__attn_job j;
    kv_status st =
        kv__attn_prefill_mla_check("kv_attn_prefill_mla_cuda", &cache, layer, q, qo_indptr, pages,
                                   dv, softmax_scale, scales, out, opts, &j);
    if (st != KV_OK)
        return st;
    st = kv__cuda_attn_prefill(&j, stream); /* kv_attn_prefill_hd.h: its MLA form (mla_dv) */
    if (st == KV_OK)
        kv__attn_count(&j, true);
    kv__attn_job_free(&j);
    return st == KV_OK ? kv__ok() : st;
}

kv_status kv_attn_decode_ex_cuda(struct kv_paged_cache cache, uint32_t layer,
                                 const struct kv_view *q, const struct kv_pages *pages,
                                 float softmax_scale, const struct kv_scales *scales,
                                 const struct kv_view *out, const struct kv_attn_opts *opts,
                                 kv_cuda_stream stream)
{
    return decode_cuda("kv_attn_decode_ex_cuda", cache, layer, q, NULL, pages, softmax_scale,
                       scales, out, opts, stream);
}

kv_status kv_attn_prefill_cuda(struct kv_paged_cache cache, uint32_t layer, const struct kv_view *q,
                               const int32_t *qo_indptr, const struct kv_pages *pages,
                               float softmax_scale, const struct kv_scales *scales,
                               const struct kv_view *out, const struct kv_attn_opts *opts,
                               kv_cuda_stream stream)
{
    return decode_cuda("kv_attn_prefill_cuda", cache, layer, q, qo_indptr, pages, softmax_scale,
                       scales, out, opts, stream);
}
