/*
 * kv_xport_frame_int.h - the TCP transport's frame header (module-private):
 * 64 bytes, little-endian, checksummed.
 * docs/connector.md, "Transports": a frame is this header, then `length`
 * payload bytes whose XXH3-64 is payload_sum.
 *
 *   off  size  field
 *     0     4  magic "KVXF"
 *     4     2  version (KV_XPORT_PROTOCOL_VERSION)
 *     6     2  type (enum kv__xf_type)
 *     8     4  flags (0)
 *    12     4  entry (the index in its transfer)
 *    16     8  xfer (the sender's transfer id)
 *    24     4  region (the receiver's exposed region id)
 *    28     4  conn (the connection index of the peer)
 *    32     8  offset (in the region)
 *    40     8  length (payload bytes after the header)
 *    48     8  payload_sum (XXH3-64 of the payload; 0 when length is 0)
 *    56     8  header_sum (XXH3-64 of bytes [0, 56))
 */
#ifndef KV_XPORT_FRAME_INT_H
#define KV_XPORT_FRAME_INT_H

#include <stdbool.h>
#include <stdint.h>

#include "kv_status.h"
/* kv__le_put/kv__le_get (the frames, HELLO, blobs, ACK records, the RDMA key
 * and messages) and kv__range_ok come from the core's one wire header. */
#include "kv_wire.h"

#define KV__XF_BYTES 64
#define KV__XF_MAX_PAYLOAD ((uint64_t)1 << 40)
/* Void of an ACK of a notification (entry field). */
#define KV__XF_ENTRY_NOTE UINT32_MAX

enum kv__xf_type {
    KV__XF_HELLO = 1,  /* payload: version, token, fingerprint, conn count */
    KV__XF_REFUSE = 2, /* payload: the reason, text */
    KV__XF_WRITE = 3,  /* payload: the bytes for region + offset */
    KV__XF_ACK = 4,    /* entry of xfer landed */
    KV__XF_NACK = 5,   /* entry of xfer refused; offset carries the kv_status */
    KV__XF_NOTIFY = 6, /* payload: the notification; after every earlier write */
    KV__XF_BYE = 7,
    KV__XF_READ = 8,  /* read [offset, +length) of region into entry of xfer */
    KV__XF_RDATA = 9, /* payload: read data of entry of xfer at offset (in the entry) */
    KV__XF_TYPE_MAX = KV__XF_RDATA,
};

struct kv__xf {
    uint16_t version, type;
    uint32_t flags, entry;
    uint64_t xfer;
    uint32_t region, conn;
    uint64_t offset, length, payload_sum;
};

/* The 64 header bytes of f (header_sum computed). */
void kv__xf_encode(const struct kv__xf *f, unsigned char out[KV__XF_BYTES]);

/* f from 64 received bytes, every field checked: KV_ERR_CORRUPT naming the
 * first that fails (magic, header checksum, flags, type, a length over
 * KV__XF_MAX_PAYLOAD, a payload_sum without payload); KV_ERR_MISMATCH for
 * another protocol version. *f untouched on failure. */
kv_status kv__xf_decode(const unsigned char in[KV__XF_BYTES], struct kv__xf *f);

#endif /* KV_XPORT_FRAME_INT_H */
