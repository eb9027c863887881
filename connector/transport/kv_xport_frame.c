/* kv_xport_frame.c - the TCP frame header (kv_xport_frame_int.h). */
#include <inttypes.h>
#include <string.h>

#include "kv_lib.h"
#include "kv_transport.h" /* KV_XPORT_PROTOCOL_VERSION: defined there only */
#include "kv_xport_frame_int.h"

static const unsigned char kv__xf_magic[4] = {'K', 'V', 'X', 'F'};

void kv__xf_encode(const struct kv__xf *f, unsigned char out[KV__XF_BYTES])
{
    memcpy(out, kv__xf_magic, 4);
    kv__le_put16(out + 4, f->version);
    kv__le_put16(out + 6, f->type);
    kv__le_put32(out + 8, f->flags);
    kv__le_put32(out + 12, f->entry);
    kv__le_put64(out + 16, f->xfer);
    kv__le_put32(out + 24, f->region);
    kv__le_put32(out + 28, f->conn);
    kv__le_put64(out + 32, f->offset);
    kv__le_put64(out + 40, f->length);
    kv__le_put64(out + 48, f->payload_sum);
    kv__le_put64(out + 56, kv__xxh3_64(out, 56));
}

kv_status kv__xf_decode(const unsigned char in[KV__XF_BYTES], struct kv__xf *f)
{
    if (memcmp(in, kv__xf_magic, 4) != 0)
        return kv__error(KV_ERR_CORRUPT, "transport frame: magic %02x %02x %02x %02x, not \"KVXF\"",
                         in[0], in[1], in[2], in[3]);
    const uint64_t want = kv__le_get64(in + 56), got = kv__xxh3_64(in, 56);
    if (want != got)
        return kv__error(KV_ERR_CORRUPT,
                         "transport frame: header checksum 0x%016" PRIx64 " recorded, 0x%016" PRIx64
                         " computed",
                         want, got);
    struct kv__xf x = {.version = kv__le_get16(in + 4),
                       .type = kv__le_get16(in + 6),
                       .flags = kv__le_get32(in + 8),
                       .entry = kv__le_get32(in + 12),
                       .xfer = kv__le_get64(in + 16),
                       .region = kv__le_get32(in + 24),
                       .conn = kv__le_get32(in + 28),
                       .offset = kv__le_get64(in + 32),
                       .length = kv__le_get64(in + 40),
                       .payload_sum = kv__le_get64(in + 48)};
    if (x.version != KV_XPORT_PROTOCOL_VERSION)
        return kv__error(KV_ERR_MISMATCH,
                         "transport frame: protocol version %u, this library speaks %u",
                         (unsigned)x.version, (unsigned)KV_XPORT_PROTOCOL_VERSION);
    if (x.flags != 0)
        return kv__error(KV_ERR_CORRUPT, "transport frame: flags 0x%08x (none defined)", x.flags);
    if (x.type < KV__XF_HELLO || x.type > KV__XF_TYPE_MAX)
        return kv__error(KV_ERR_CORRUPT, "transport frame: unknown type %u", (unsigned)x.type);
    if (x.length > KV__XF_MAX_PAYLOAD)
        return kv__error(KV_ERR_CORRUPT,
                         "transport frame: payload length %" PRIu64 " over the limit %" PRIu64,
                         x.length, KV__XF_MAX_PAYLOAD);
    if (x.length == 0 && x.payload_sum != 0)
        return kv__error(KV_ERR_CORRUPT,
                         "transport frame: a payload checksum 0x%016" PRIx64 " without payload",
                         x.payload_sum);
    *f = x;
    return KV_OK;
}
