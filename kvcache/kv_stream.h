/*
 * kv_stream.h - streaming (non-temporal) stores for the bulk copies of
 * every module (library-internal: never installed; see kv_lib.h for the
 * header tiers): attention's block and view copies and connector's local
 * data path (pack, unpack, the offload tier, kv_plan_copy) move their large
 * runs through the one 64-byte step here.
 */
#ifndef KV_STREAM_H
#define KV_STREAM_H

#include <string.h>

/* 1 where SSE2's streaming stores exist (every x86-64): kv__stream64
 * streams; 0 elsewhere: it copies plainly and kv__stream_fence does
 * nothing. */
#if defined(__SSE2__)
#include <emmintrin.h>
#define KV__HAVE_STREAM 1
#else
#define KV__HAVE_STREAM 0
#endif

/* 64 bytes from s to d, d 16-byte aligned: four 16-byte streaming stores
 * (a plain copy where SSE2 is absent). The stores are ordered before this
 * thread's later ones only by kv__stream_fence. */
static inline void kv__stream64(char *d, const char *s)
{
#if KV__HAVE_STREAM
    const __m128i a = _mm_loadu_si128((const __m128i *)(const void *)s);
    const __m128i b = _mm_loadu_si128((const __m128i *)(const void *)(s + 16));
    const __m128i c = _mm_loadu_si128((const __m128i *)(const void *)(s + 32));
    const __m128i e = _mm_loadu_si128((const __m128i *)(const void *)(s + 48));
    _mm_stream_si128((__m128i *)(void *)d, a);
    _mm_stream_si128((__m128i *)(void *)(d + 16), b);
    _mm_stream_si128((__m128i *)(void *)(d + 32), c);
    _mm_stream_si128((__m128i *)(void *)(d + 48), e);
#else
    memcpy(d, s, 64);
#endif
}

/* Order this thread's streaming stores before its later stores (sfence):
 * before another thread may read what they wrote. */
static inline void kv__stream_fence(void)
{
#if KV__HAVE_STREAM
    _mm_sfence();
#endif
}

#endif /* KV_STREAM_H */
