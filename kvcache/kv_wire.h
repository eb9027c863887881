/*
 * kv_wire.h - the one copy of the byte-level wire helpers (library-internal:
 * used by every module that writes or reads bytes another process or
 * another build will see -- the layout fingerprint and config codec, the
 * prefix-hash input, the pack header, the transport's frames, HELLO, blobs
 * and RDMA messages -- never installed, never included by a user).
 *
 *   little-endian   every integer on any of our wires is little-endian, at
 *                   any alignment: kv__le_put/kv__le_get of n <= 8 bytes, and
 *                   the fixed-width forms kv__le_put16/32/64, kv__le_get16/32/64
 *   range check     [offset, offset + len) inside [0, size) without wrapping:
 *                   kv__range_ok(size, offset, len)
 *
 * Bytes, not host integers: a field is read and written byte by byte (the
 * compiler turns these loops into one load or store), so no helper depends
 * on the host's endianness or alignment, and none reads outside p[0, n).
 */
#ifndef KV_WIRE_H
#define KV_WIRE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* The low n bytes of v (n <= 8) at p, least significant first. */
static inline void kv__le_put(void *p, uint64_t v, int n)
{
    unsigned char *b = (unsigned char *)p;
    for (int i = 0; i < n; i++)
        b[i] = (unsigned char)(v >> (8 * i));
}

/* The n bytes (n <= 8) at p as a little-endian unsigned integer. */
static inline uint64_t kv__le_get(const void *p, int n)
{
    const unsigned char *b = (const unsigned char *)p;
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--)
        v = (v << 8) | b[i];
    return v;
}

static inline void kv__le_put16(void *p, uint16_t v)
{
    kv__le_put(p, v, 2);
}
static inline void kv__le_put32(void *p, uint32_t v)
{
    kv__le_put(p, v, 4);
}
static inline void kv__le_put64(void *p, uint64_t v)
{
    kv__le_put(p, v, 8);
}
static inline uint16_t kv__le_get16(const void *p)
{
    return (uint16_t)kv__le_get(p, 2);
}
static inline uint32_t kv__le_get32(const void *p)
{
    return (uint32_t)kv__le_get(p, 4);
}
static inline uint64_t kv__le_get64(const void *p)
{
    return kv__le_get(p, 8);
}

/* Whether [offset, offset + len) lies inside [0, size): offset <= size and
 * len <= size - offset, so no sum can wrap (offset = UINT64_MAX, len = 2 is
 * refused, not read as [UINT64_MAX, 1)). len 0 at offset == size is inside. */
static inline bool kv__range_ok(uint64_t size, uint64_t offset, uint64_t len)
{
    return offset <= size && len <= size - offset;
}

#endif /* KV_WIRE_H */
