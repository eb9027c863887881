/*
 * kv_attn_mla_int.h - the chunk primitives of the CPU MLA kernels
 * (module-private): kv_attn_cpu_mla.c (decode, and these primitives) and
 * kv_attn_cpu_mla_prefill.c (prefill) run the same code on every chunk, so
 * a prefill row with q_len 1 is computed exactly as the decode computes it.
 *
 * A chunk is up to KV__MLA_CHUNK latent rows converted to f32, kf
 * [n][D] (unscaled); nh query heads q [nh][D] (times softmax_scale) keep
 * an online softmax m, l [nh] and acc [nh][dv]; sc [nh][KV__MLA_CHUNK] is
 * scratch (a caller may pass sc + a with n <= KV__MLA_CHUNK - a).
 */
#ifndef KV_ATTN_MLA_INT_H
#define KV_ATTN_MLA_INT_H

#include "kv_attn_int.h"

#define KV__MLA_CHUNK 32
#define KV__MLA_GROUP 64 /* most (query token, query head) rows a task */

/* Whether MLA of D, dv takes the AVX2/FMA path here (with the current
 * tuning: kv__attn_portable). Every result of one call must use one value. */
bool kv__mla_simd(int64_t D, int64_t dv);
/* The factor that turns q . kf into unscaled-q logits and acc / l into
 * values (the per-tensor K scale; times 256 for e4m3 on the AVX2 path),
 * and, for fp8 off that path, lut[256] the dtype's values. */
float kv__mla_prepare(const struct kv__attn_job *j, bool simd, float *lut);
/* rows[0..n) (latent rows in the cache) -> kf [n][D] f32. */
void kv__mla_rows(const struct kv_layout *lo, bool simd, const char *const *rows, int n, float *kf,
                  const float *lut);
/* The scores by bf16 dot products (AVX512_BF16; kv_attn_cpu_mla.c): q's
 * heads as bf16, unscaled, and the chunk's rows as bf16. */
struct kv__mla_bdot {
    const uint16_t *qb;        /* [nh][D] */
    const uint16_t *const *kb; /* [n] row pointers (the cache's rows, or kbuf's) */
    float kmul;                /* softmax_scale x the factor of kv__mla_prepare */
};
/* Whether job j (MLA, simd as kv__mla_simd gave) takes the bf16 dot
 * product scores: q bf16, the cache bf16 or fp8 (exact in bf16), D % 32 ==
 * 0, a CPU with AVX512_BF16 (and kv__attn_avx2_only not set). One value a
 * call. */
bool kv__mla_bdot_ok(const struct kv__attn_job *j, bool simd);
/* The bf16 rows of a chunk for the dot products: kb[t] = rows[t] for a
 * bf16 cache, else kf's rows (already converted by kv__mla_rows) rounded to
 * bf16 (exactly) into kbuf [n][D] and kb[t] = kbuf + t * D. */
void kv__mla_rows_bf16(const struct kv_layout *lo, const char *const *rows, int n, const float *kf,
                       uint16_t *kbuf, const uint16_t **kb);
/* One chunk for nh heads: sc = kmul * q . kf (all D dims), or with bd
 * (kv__mla_bdot_ok) sc = bd->kmul * bd->qb . bd->kb; with cap > 0
 * cap * tanh(sc / cap), then the online softmax and acc += w . kf[.][0..dv).
 * The order of every sum depends on n, nh and the head's index within the
 * call only (4 heads at a time, then one; with bd, a score's order does not
 * depend on those either). */
void kv__mla_chunk(bool simd, const float *kf, int n, int nh, int64_t D, int64_t dv, const float *q,
                   float kmul, const struct kv__mla_bdot *bd, float cap, float *m, float *l,
                   float *acc, float *sc);

#endif /* KV_ATTN_MLA_INT_H */
