/*
 * kv_xport_codec.c - the transport's small wire codecs shared by every
 * backend: the HELLO payload of the handshake and the blob a peer imports
 * (kv_xport_mem_expose / kv_xport_rmem_import). Both are bytes from a
 * peer: decoding checks every field (fuzzed by tests/fuzz/fuzz_xport_rx.c).
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "kv_xport_frame_int.h"
#include "kv_xport_int.h"

/*
 * The blob (little-endian, KV_XPORT_BLOB_MAX at most):
 *   0  4  magic "KVXB"        4  2  version      6  2  kind
 *   8  4  region             12  4  key_len
 *  16  8  bytes              24  8  exposer's connection id
 *  32  8  importer's connection id
 *  40  key_len  backend key  then 8  XXH3-64 of everything before it
 */
size_t kv__xport_blob_encode(const struct kv__xport_blob *b, unsigned char *out)
{
    memcpy(out, "KVXB", 4);
    kv__le_put(out + 4, b->version, 2);
    kv__le_put(out + 6, b->kind, 2);
    kv__le_put(out + 8, b->region, 4);
    kv__le_put(out + 12, b->key_len, 4);
    kv__le_put(out + 16, b->bytes, 8);
    kv__le_put(out + 24, b->exposer, 8);
    kv__le_put(out + 32, b->importer, 8);
    memcpy(out + KV__XPORT_BLOB_HEAD, b->key, b->key_len);
    kv__le_put(out + KV__XPORT_BLOB_HEAD + b->key_len,
               kv__xxh3_64(out, KV__XPORT_BLOB_HEAD + b->key_len), 8);
    return KV__XPORT_BLOB_HEAD + b->key_len + 8;
}

kv_status kv__xport_blob_decode(const void *in, size_t len, struct kv__xport_blob *b)
{
    const unsigned char *p = in;
    if (len < KV__XPORT_BLOB_HEAD + 8 || len > KV_XPORT_BLOB_MAX)
        return kv__error(KV_ERR_CORRUPT, "xport_rmem_import: blob of %zu bytes (%d..%d)", len,
                         KV__XPORT_BLOB_HEAD + 8, KV_XPORT_BLOB_MAX);
    if (memcmp(p, "KVXB", 4) != 0)
        return kv__error(KV_ERR_CORRUPT, "xport_rmem_import: magic is not \"KVXB\"");
    const uint32_t key_len = (uint32_t)kv__le_get(p + 12, 4);
    if (key_len > KV__XPORT_KEY_MAX || KV__XPORT_BLOB_HEAD + (size_t)key_len + 8 != len)
        return kv__error(KV_ERR_CORRUPT, "xport_rmem_import: key of %u bytes in a blob of %zu",
                         key_len, len);
    const uint64_t sum = kv__le_get(p + KV__XPORT_BLOB_HEAD + key_len, 8);
    if (sum != kv__xxh3_64(p, KV__XPORT_BLOB_HEAD + key_len))
        return kv__error(
            KV_ERR_CORRUPT,
            "xport_rmem_import: blob checksum 0x%016" PRIx64 " does not match its bytes", sum);
    b->version = (uint32_t)kv__le_get(p + 4, 2);
    b->kind = (uint32_t)kv__le_get(p + 6, 2);
    if (b->version != KV_XPORT_PROTOCOL_VERSION)
        return kv__error(KV_ERR_MISMATCH, "xport_rmem_import: blob version %u, this library %u",
                         b->version, KV_XPORT_PROTOCOL_VERSION);
    b->region = (uint32_t)kv__le_get(p + 8, 4);
    b->key_len = key_len;
    b->bytes = kv__le_get(p + 16, 8);
    b->exposer = kv__le_get(p + 24, 8);
    b->importer = kv__le_get(p + 32, 8);
    if (b->region == 0 || b->bytes == 0)
        return kv__error(KV_ERR_CORRUPT,
                         "xport_rmem_import: blob names region %u of %" PRIu64 " bytes", b->region,
                         b->bytes);
    memcpy(b->key, p + KV__XPORT_BLOB_HEAD, key_len);
    return KV_OK;
}

void kv__xport_hello_encode(const struct kv__xport_hello *h, unsigned char *out)
{
    kv__le_put(out, h->version, 4);
    kv__le_put(out + 4, h->kind, 4);
    kv__le_put(out + 8, h->token, 8);
    kv__le_put(out + 16, h->fingerprint, 8);
    kv__le_put(out + 24, h->nonce, 8);
    kv__le_put(out + 32, h->echo, 8);
    kv__le_put(out + 40, h->conns, 4);
    kv__le_put(out + 44, h->conn, 4);
}

void kv__xport_hello_decode(const unsigned char *in, struct kv__xport_hello *h)
{
    h->version = (uint32_t)kv__le_get(in, 4);
    h->kind = (uint32_t)kv__le_get(in + 4, 4);
    h->token = kv__le_get(in + 8, 8);
    h->fingerprint = kv__le_get(in + 16, 8);
    h->nonce = kv__le_get(in + 24, 8);
    h->echo = kv__le_get(in + 32, 8);
    h->conns = (uint32_t)kv__le_get(in + 40, 4);
    h->conn = (uint32_t)kv__le_get(in + 44, 4);
}

kv_status kv__xport_hello_check(const kv_xport *x, const struct kv__xport_hello *h, char *msg,
                                size_t cap)
{
    if (h->version != KV_XPORT_PROTOCOL_VERSION)
        snprintf(msg, cap, "protocol version mismatch: peer %u, here %u", h->version,
                 KV_XPORT_PROTOCOL_VERSION);
    else if (h->kind != (uint32_t)x->cfg.kind)
        snprintf(msg, cap, "transport kind mismatch: peer %s, here %s",
                 kv_xport_kind_name((kv_xport_kind)h->kind), kv_xport_kind_name(x->cfg.kind));
    else if (h->token != x->cfg.token)
        snprintf(msg, cap, "token mismatch: the peer presented another token");
    else if (h->fingerprint != x->cfg.fingerprint)
        snprintf(msg, cap, "layout fingerprint mismatch: peer 0x%016" PRIx64 ", here 0x%016" PRIx64,
                 h->fingerprint, x->cfg.fingerprint);
    else if (h->conns != x->cfg.conns_per_peer || h->conn >= h->conns)
        snprintf(msg, cap, "connections mismatch: peer %u (this one %u), here %u", h->conns,
                 h->conn, x->cfg.conns_per_peer);
    else
        return KV_OK;
    return kv__error(KV_ERR_MISMATCH, "xport handshake: %s", msg);
}

/* ---- AUTO's probe answer (layout: kv_xport_int.h) -------------------- */

void kv__xport_offer_encode(const struct kv__xport_offer *o, unsigned char *out)
{
    memset(out, 0, KV__XPORT_OFFER_BYTES);
    const size_t n = strnlen(o->name, KV__XPORT_OFFER_NAME_MAX);
    kv__le_put(out, o->secret, 8);
    kv__le_put(out + 8, o->port, 2);
    kv__le_put(out + 10, n, 2);
    memcpy(out + 16, o->name, n);
}

static bool name_byte_ok(unsigned char ch)
{
    return (ch >= '0' && ch <= '9') || (ch >= 'a' && ch <= 'z') || ch == '-';
}

kv_status kv__xport_probe_parse(const kv_xport *x, uint64_t nonce, const unsigned char *in,
                                size_t n, struct kv__xport_offer *o)
{
    struct kv__xf f;
    if (n < KV__XF_BYTES)
        return kv__error(KV_ERR_CORRUPT, "xport auto: a probe answer of %zu bytes", n);
    kv_status st = kv__xf_decode(in, &f);
    if (st != KV_OK)
        return st;
    const unsigned char *p = in + KV__XF_BYTES;
    if (f.length != n - KV__XF_BYTES || (f.type != KV__XF_HELLO && f.type != KV__XF_REFUSE))
        return kv__error(KV_ERR_CORRUPT,
                         "xport auto: a probe answer of type %u with %" PRIu64
                         " payload bytes (%zu received)",
                         (unsigned)f.type, f.length, n - KV__XF_BYTES);
    if (f.payload_sum != (f.length ? kv__xxh3_64(p, (size_t)f.length) : 0))
        return kv__error(KV_ERR_CORRUPT, "xport auto: a probe answer failing its checksum");
    if (f.type == KV__XF_REFUSE) {
        char why[201];
        size_t k = 0;
        for (uint64_t i = 0; i < f.length && k < sizeof(why) - 1; i++)
            why[k++] = p[i] >= 0x20 && p[i] < 0x7f ? (char)p[i] : '?';
        why[k] = 0;
        return kv__error(kv__xport_wire_status((int64_t)f.offset, false),
                         "xport auto: the listener refused the probe: %s", why);
    }
    if (f.length != KV__XPORT_PROBE_BYTES)
        return kv__error(KV_ERR_CORRUPT,
                         "xport auto: a probe answer of %" PRIu64 " bytes (want %u)", f.length,
                         (unsigned)KV__XPORT_PROBE_BYTES);
    struct kv__xport_hello h;
    kv__xport_hello_decode(p, &h);
    if (h.conns != 0 || h.conn != 0 || h.echo != nonce || h.nonce == 0)
        return kv__error(
            KV_ERR_CORRUPT,
            "xport auto: a probe answer with conns %u, conn %u, answering 0x%016" PRIx64, h.conns,
            h.conn, h.echo);
    h.conns = x->cfg.conns_per_peer; /* a probe has no connections to agree on */
    char why[160];
    st = kv__xport_hello_check(x, &h, why, sizeof(why));
    if (st != KV_OK)
        return st;
    const unsigned char *q = p + KV__XPORT_HELLO_BYTES;
    const uint64_t secret = kv__le_get(q, 8);
    const uint32_t port = (uint32_t)kv__le_get(q + 8, 2);
    const uint32_t len = (uint32_t)kv__le_get(q + 10, 2);
    if (secret == 0 || port == 0 || len == 0 || len > KV__XPORT_OFFER_NAME_MAX)
        return kv__error(KV_ERR_CORRUPT,
                         "xport auto: an offer with secret %s, port %u, a name of %u bytes "
                         "(1 .. %u)",
                         secret ? "set" : "0", port, len, (unsigned)KV__XPORT_OFFER_NAME_MAX);
    if (kv__le_get(q + 12, 4) != 0 || kv__le_get(q + 56, 8) != 0)
        return kv__error(KV_ERR_CORRUPT, "xport auto: an offer with reserved bytes set");
    for (uint32_t i = 0; i < KV__XPORT_OFFER_NAME_MAX; i++)
        if (i < len ? !name_byte_ok(q[16 + i]) : q[16 + i] != 0)
            return kv__error(KV_ERR_CORRUPT, "xport auto: an offer's name byte %u is 0x%02x", i,
                             (unsigned)q[16 + i]);
    o->secret = secret;
    o->port = (uint16_t)port;
    memcpy(o->name, q + 16, len);
    o->name[len] = 0;
    return KV_OK;
}
