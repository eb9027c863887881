/*
 * workload.c - the batch of requests and the K/V generator.
 *
 * Both role processes derive the same batch from the seed (random lengths
 * 1..MAX_TOKENS, every third request sharing a prefix of PREFIX_BLOCKS
 * prefill blocks), so nothing but placements and data crosses the wire.
 * Prefill writes what gen_kv() says; decode compares what arrived with it
 * (decode.c), so every value must be a pure function of (seed, stream,
 * layer, position, head, dim).
 */
#include "kvdemo.h"

/* splitmix64's finalizer: a 64-bit hash. */
static uint64_t mix64(uint64_t x)
{
    x ^= x >> 33;
    x *= UINT64_C(0xff51afd7ed558ccd);
    x ^= x >> 33;
    x *= UINT64_C(0xc4ceb9fe1a85ec53);
    x ^= x >> 33;
    return x;
}

/* The next number of the stream *s (splitmix64). */
uint64_t rng_next(uint64_t *s)
{
    *s += UINT64_C(0x9e3779b97f4a7c15);
    return mix64(*s);
}

/* The batch both sides derive from the seed. */
void make_requests(uint64_t seed, uint32_t n, struct request *out)
{
    uint64_t s = seed;
    for (uint32_t r = 0; r < n; r++) {
        out[r].id = r;
        out[r].prefix = r % 3 == 0;
        uint32_t len = 1 + (uint32_t)(rng_next(&s) % MAX_TOKENS);
        if (out[r].prefix && len <= PREFIX_TOKENS)
            len += PREFIX_TOKENS;
        out[r].n_tokens = len;
    }
}

/* Which stream token t of request r belongs to: the shared prefix (0) or
 * the request's own (r + 1). Values and token ids depend on the stream and
 * the position only, so a shared prefix has the same K/V in every request. */
static uint32_t stream_of(const struct request *r, uint32_t t)
{
    return r->prefix && t < PREFIX_TOKENS ? 0 : r->id + 1;
}

int32_t token_id(const struct request *r, uint32_t t)
{
    const uint32_t s = stream_of(r, t);
    return (int32_t)(mix64(((uint64_t)s << 32) | t) & 0x7fffffff);
}

/* The generator: one bf16 value per (stream, layer, position, head, dim,
 * k|v|q), an integer / 64 in [-2, 2) (exact in bf16). kv 2 is the query. */
float gen_value(uint64_t seed, uint32_t stream, uint32_t layer, uint32_t pos, uint32_t head,
                uint32_t d, uint32_t kv)
{
    const uint64_t key = ((uint64_t)stream << 32) | ((uint64_t)layer << 27) | ((uint64_t)kv << 25) |
                         ((uint64_t)pos << 11) | ((uint64_t)head << 7) | d;
    const int8_t b = (int8_t)(mix64(key ^ (seed * UINT64_C(0x2545f4914f6cdd1d))) & 0xff);
    return (float)b / 64.0f;
}

/* K and V of tokens [t0, t0 + T) of r as [L][T][H][D] bf16. */
void gen_kv(uint64_t seed, const struct request *r, uint32_t t0, uint32_t T, uint16_t *k,
            uint16_t *v)
{
    size_t i = 0;
    for (uint32_t l = 0; l < L_LAYERS; l++)
        for (uint32_t t = t0; t < t0 + T; t++) {
            const uint32_t s = stream_of(r, t);
            for (uint32_t h = 0; h < H_KV; h++)
                for (uint32_t d = 0; d < D_HEAD; d++, i++) {
                    k[i] = demo_f32_to_bf16(gen_value(seed, s, l, t, h, d, 0));
                    v[i] = demo_f32_to_bf16(gen_value(seed, s, l, t, h, d, 1));
                }
        }
}
