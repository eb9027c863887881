/*
 * kvt_xport_raw.h - a raw TCP peer of the transport for tests and fuzzing:
 * frames built by hand (kv_xport_frame_int.h), so a test can be the
 * hostile or careless peer the real transport must survive: lengths,
 * statuses and checksums of its choosing, and a socket it may stop reading.
 * Header-only; unit tests and tests/fuzz only (it includes private
 * connector headers).
 */
#ifndef KVT_XPORT_RAW_H
#define KVT_XPORT_RAW_H

#include <errno.h>
#include <poll.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "kv_xport_frame_int.h"
#include "kv_xport_int.h"

#define KVT_RAW_DESC 24u /* a WRITE piece's descriptor (kv_xport_tcp_int.h) */

/* A frame into out: the header with both checksums, then len payload
 * bytes. Returns its size. */
static inline size_t kvt_raw_frame(unsigned char *out, uint16_t type, uint32_t entry, uint64_t xfer,
                                   uint32_t region, uint64_t offset, const void *payload,
                                   uint64_t len)
{
    struct kv__xf f = {.version = KV_XPORT_PROTOCOL_VERSION,
                       .type = type,
                       .entry = entry,
                       .xfer = xfer,
                       .region = region,
                       .offset = offset,
                       .length = len,
                       .payload_sum = len ? kv__xxh3_64(payload, (size_t)len) : 0};
    kv__xf_encode(&f, out);
    if (len)
        memcpy(out + KV__XF_BYTES, payload, (size_t)len);
    return KV__XF_BYTES + (size_t)len;
}

/* A piece of a raw WRITE. */
struct kvt_raw_piece {
    uint32_t entry, region;
    uint64_t off;
    const void *data;
    uint64_t len;
};

/* A WRITE frame of k pieces into out (descriptor table, its checksum in
 * the header's offset, the payload checksum over the pieces). Its size. */
static inline size_t kvt_raw_write(unsigned char *out, uint64_t xfer,
                                   const struct kvt_raw_piece *pc, uint32_t k)
{
    unsigned char *d = out + KV__XF_BYTES;
    uint64_t data = 0;
    for (uint32_t i = 0; i < k; i++) {
        kv__le_put(d + KVT_RAW_DESC * i, pc[i].entry, 4);
        kv__le_put(d + KVT_RAW_DESC * i + 4, pc[i].region, 4);
        kv__le_put(d + KVT_RAW_DESC * i + 8, pc[i].off, 8);
        kv__le_put(d + KVT_RAW_DESC * i + 16, pc[i].len, 8);
        data += pc[i].len;
    }
    unsigned char *p = d + KVT_RAW_DESC * k;
    struct kv__xxh3_state hs;
    kv__xxh3_reset(&hs);
    for (uint32_t i = 0; i < k; i++) {
        memcpy(p, pc[i].data, (size_t)pc[i].len);
        kv__xxh3_update(&hs, p, (size_t)pc[i].len);
        p += pc[i].len;
    }
    struct kv__xf f = {.version = KV_XPORT_PROTOCOL_VERSION,
                       .type = KV__XF_WRITE,
                       .entry = k,
                       .xfer = xfer,
                       .offset = kv__xxh3_64(d, (size_t)KVT_RAW_DESC * k),
                       .length = KVT_RAW_DESC * k + data,
                       .payload_sum = kv__xxh3_digest(&hs)};
    kv__xf_encode(&f, out);
    return KV__XF_BYTES + (size_t)f.length;
}

/* Make every frame of buf[len] pass its checksums (the structure-aware
 * fuzzing mode: whatever the fields say, the sums agree with the bytes):
 * the header sum, the payload sum, a WRITE's descriptor-table sum. A
 * frame cut short by the end of buf gets its header fixed only. */
static inline void kvt_raw_fix_sums(unsigned char *buf, size_t len)
{
    size_t at = 0;
    while (len - at >= KV__XF_BYTES) {
        unsigned char *h = buf + at;
        const uint64_t flen = kv__le_get(h + 40, 8);
        const uint16_t type = (uint16_t)kv__le_get(h + 6, 2);
        const size_t avail = len - at - KV__XF_BYTES;
        const bool whole = flen <= avail;
        const unsigned char *pl = h + KV__XF_BYTES;
        if (whole) {
            uint64_t psum = flen ? kv__xxh3_64(pl, (size_t)flen) : 0;
            const uint32_t k = (uint32_t)kv__le_get(h + 12, 4);
            if (type == KV__XF_WRITE && k && (uint64_t)k * KVT_RAW_DESC <= flen) {
                kv__le_put(h + 32, kv__xxh3_64(pl, (size_t)k * KVT_RAW_DESC), 8);
                psum = kv__xxh3_64(pl + (size_t)k * KVT_RAW_DESC,
                                   (size_t)(flen - (uint64_t)k * KVT_RAW_DESC));
                if (flen == (uint64_t)k * KVT_RAW_DESC)
                    psum = 0;
            }
            kv__le_put(h + 48, psum, 8);
        }
        kv__le_put(h + 56, kv__xxh3_64(h, 56), 8);
        if (!whole)
            break;
        at += KV__XF_BYTES + (size_t)flen;
    }
}

/* Send all of buf (a blocking socket, or a non-blocking one polled). */
static inline bool kvt_raw_send(int fd, const void *buf, size_t len)
{
    const unsigned char *p = buf;
    while (len) {
        const ssize_t r = send(fd, p, len, MSG_NOSIGNAL);
        if (r < 0 && (errno == EAGAIN || errno == EINTR)) {
            struct pollfd pf = {.fd = fd, .events = POLLOUT};
            (void)poll(&pf, 1, 100);
            continue;
        }
        if (r <= 0)
            return false;
        p += r;
        len -= (size_t)r;
    }
    return true;
}

/* Receive exactly len bytes within timeout_ms. */
static inline bool kvt_raw_recv(int fd, void *buf, size_t len, int timeout_ms)
{
    unsigned char *p = buf;
    while (len) {
        struct pollfd pf = {.fd = fd, .events = POLLIN};
        if (poll(&pf, 1, timeout_ms) <= 0)
            return false;
        const ssize_t r = recv(fd, p, len, 0);
        if (r <= 0)
            return false;
        p += r;
        len -= (size_t)r;
    }
    return true;
}

/* The next frame: header decoded into *f, payload (at most cap bytes; the
 * rest dropped) into payload. false on a closed socket, a timeout or a
 * header that fails its checks. */
static inline bool kvt_raw_next(int fd, struct kv__xf *f, void *payload, size_t cap, int timeout_ms)
{
    unsigned char h[KV__XF_BYTES];
    if (!kvt_raw_recv(fd, h, sizeof(h), timeout_ms) || kv__xf_decode(h, f) != KV_OK)
        return false;
    uint64_t left = f->length;
    unsigned char *p = payload;
    while (left) {
        unsigned char sink[4096];
        const size_t take = cap ? (left < cap ? (size_t)left : cap)
                                : (left < sizeof(sink) ? (size_t)left : sizeof(sink));
        if (!kvt_raw_recv(fd, cap ? (void *)p : (void *)sink, take, timeout_ms))
            return false;
        left -= take;
        if (cap) {
            p += take;
            cap -= take;
        }
    }
    return true;
}

/* The HELLO this raw peer sends as connection `conn` of `conns`. */
static inline size_t kvt_raw_hello(unsigned char *out, uint64_t token, uint64_t fp, uint64_t nonce,
                                   uint64_t echo, uint32_t conns, uint32_t conn)
{
    const struct kv__xport_hello h = {.version = KV_XPORT_PROTOCOL_VERSION,
                                      .kind = KV_XPORT_TCP,
                                      .token = token,
                                      .fingerprint = fp,
                                      .nonce = nonce,
                                      .echo = echo,
                                      .conns = conns,
                                      .conn = conn};
    unsigned char b[KV__XPORT_HELLO_BYTES];
    kv__xport_hello_encode(&h, b);
    return kvt_raw_frame(out, KV__XF_HELLO, 0, 0, 0, 0, b, sizeof(b));
}

/* As a connecting peer on fd: send our HELLO (one connection), read the
 * answer; *their_nonce gets the listener's connection id. */
static inline bool kvt_raw_handshake(int fd, uint64_t token, uint64_t fp, uint64_t nonce,
                                     uint64_t *their_nonce)
{
    unsigned char b[KV__XF_BYTES + KV__XPORT_HELLO_BYTES];
    const size_t n = kvt_raw_hello(b, token, fp, nonce, 0, 1, 0);
    if (!kvt_raw_send(fd, b, n))
        return false;
    struct kv__xf f;
    unsigned char pl[KV__XPORT_HELLO_BYTES];
    if (!kvt_raw_next(fd, &f, pl, sizeof(pl), 5000) || f.type != KV__XF_HELLO ||
        f.length != KV__XPORT_HELLO_BYTES)
        return false;
    struct kv__xport_hello h;
    kv__xport_hello_decode(pl, &h);
    *their_nonce = h.nonce;
    return h.echo == nonce;
}

/* A blob as the raw peer would expose its region `region` of `bytes` to
 * the transport whose connection id is `importer`; its length. */
static inline size_t kvt_raw_blob(unsigned char *out, uint32_t region, uint64_t bytes,
                                  uint64_t exposer, uint64_t importer)
{
    struct kv__xport_blob b = {.version = KV_XPORT_PROTOCOL_VERSION,
                               .kind = KV_XPORT_TCP,
                               .region = region,
                               .bytes = bytes,
                               .exposer = exposer,
                               .importer = importer};
    return kv__xport_blob_encode(&b, out);
}

#endif /* KVT_XPORT_RAW_H */
