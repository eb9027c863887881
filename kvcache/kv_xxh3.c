/*
 * kv_xxh3.c - XXH3-64 for the bulk checksums (kv_lib.h), through libxxhash.
 *
 * On x86-64, libxxhash's own dispatcher (xxh_x86dispatch.h, built into
 * Debian's libxxhash) picks the widest XXH3 code the CPU and the OS support
 * -- SSE2, AVX2 or AVX-512 -- once, on first use; the Makefile refuses to
 * build against a libxxhash without it. Elsewhere the plain calls serve.
 * Every path gives the same values (XXH3's vector code is bit-identical by
 * design; tests/unit/test_xxh3.c checks it against XXH3_64bits).
 *
 * Streaming: the dispatcher has XXH3_64bits_update_dispatch but no reset or
 * digest of its own, and needs none. The state is the one XXH3_state_t of
 * libxxhash; reset only fills it in, and digest finishes at most the last
 * buffered 256 bytes, so the plain XXH3_64bits_reset/_digest are the ones
 * to pair with the dispatched update: only the bulk of the bytes goes
 * through the vector code, and that is the update.
 */
#include <stdint.h>
#include <string.h>

#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>
#if defined(__x86_64__)
#define XXH_DISPATCH_DISABLE_REPLACE /* call the _dispatch names by name */
#include <xxh_x86dispatch.h>
#define KV__XXH3_64(p, n) XXH3_64bits_dispatch(p, n)
#define KV__XXH3_UPDATE(st, p, n) XXH3_64bits_update_dispatch(st, p, n)
#else
#define KV__XXH3_64(p, n) XXH3_64bits(p, n)
#define KV__XXH3_UPDATE(st, p, n) XXH3_64bits_update(st, p, n)
#endif

#include "kv_lib.h"

_Static_assert(sizeof(XXH3_state_t) <= sizeof(struct kv__xxh3_state),
               "kv__xxh3_state too small for XXH3_state_t");
_Static_assert(_Alignof(XXH3_state_t) <= 64, "XXH3_state_t alignment above 64");

uint64_t kv__xxh3_64(const void *p, size_t n)
{
    return KV__XXH3_64(p, n);
}

void kv__xxh3_reset(struct kv__xxh3_state *s)
{
    memset(s->b, 0, sizeof(s->b)); /* every byte defined, whatever reset touches */
    XXH3_state_t *st = (XXH3_state_t *)(void *)s->b;
    XXH3_INITSTATE(st);
    (void)XXH3_64bits_reset(st);
}

void kv__xxh3_update(struct kv__xxh3_state *s, const void *p, size_t n)
{
    (void)KV__XXH3_UPDATE((XXH3_state_t *)(void *)s->b, p, n);
}

uint64_t kv__xxh3_digest(const struct kv__xxh3_state *s)
{
    return XXH3_64bits_digest((const XXH3_state_t *)(const void *)s->b);
}
