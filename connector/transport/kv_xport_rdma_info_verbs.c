/*
 * kv_xport_rdma_info_verbs.c - the RDMA backend's INFO message
 * (kv_xport_rdma_int.h has the table): encode ours, decode a peer's as
 * hostile bytes. Pure code: no verbs calls, no state (only the verbs
 * header's enums), so tests/fuzz/fuzz_rdma_info.c builds it alone.
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "kv_xport_rdma_int.h"

uint32_t kv__rd_mtu_bytes(enum ibv_mtu m)
{
    return m >= IBV_MTU_256 && m <= IBV_MTU_4096 ? 128u << m : 0;
}

uint32_t kv__rd_info_len(uint32_t nq, uint32_t nrail)
{
    return INFO_HEAD + INFO_RAIL * (nrail - 1) + 8 * nq * nrail;
}

static uint32_t rail_at(uint32_t i)
{
    return i == 0 ? 16 : INFO_HEAD + INFO_RAIL * (i - 1);
}

uint32_t kv__rd_info_encode(const struct rd_info *in, unsigned char *b)
{
    kv__le_put(b, KV_XPORT_RDMA, 2);
    kv__le_put(b + 2, INFO_VERSION, 2);
    kv__le_put(b + 4, in->nq, 4);
    kv__le_put(b + 8, in->conn, 8);
    for (uint32_t r = 0; r < in->nrail; r++) {
        unsigned char *p = b + rail_at(r);
        const struct rd_rail_info *ri = &in->rail[r];
        memcpy(p, ri->gid, 16);
        kv__le_put(p + 16, ri->lid, 2);
        p[18] = ri->link;
        p[19] = ri->mtu;
        p[20] = ri->has_gid ? 1 : 0;
        p[21] = r == 0 ? (unsigned char)(in->nrail - 1) : 0;
        p[22] = p[23] = 0;
    }
    const uint32_t q0 = kv__rd_info_len(in->nq, in->nrail) - 8 * in->nq * in->nrail;
    for (uint32_t i = 0; i < in->nq * in->nrail; i++) {
        kv__le_put(b + q0 + 8 * i, in->qpn[i], 4);
        kv__le_put(b + q0 + 8 * i + 4, in->psn[i], 4);
    }
    return kv__rd_info_len(in->nq, in->nrail);
}

static const char *link_str(unsigned l)
{
    return l == IBV_LINK_LAYER_INFINIBAND ? "infiniband"
           : l == IBV_LINK_LAYER_ETHERNET ? "ethernet"
                                          : "unknown";
}

/* Rail r's 24 bytes at p, expecting link layer `want` (0: any known one). */
static kv_status rail_decode(const unsigned char *p, uint32_t r, uint8_t want,
                             struct rd_rail_info *ri, char *msg, size_t cap)
{
    static const uint8_t zero[16];
    char pre[24] = "";
    if (r)
        snprintf(pre, sizeof(pre), "rail %u: ", r);
    memcpy(ri->gid, p, 16);
    ri->lid = (uint16_t)kv__le_get(p + 16, 2);
    ri->link = p[18];
    ri->mtu = p[19];
    ri->has_gid = p[20] & 1;
    if (want && ri->link != want) {
        snprintf(msg, cap, "%sthe peer's port is %s (link layer %u), this one %s", pre,
                 link_str(ri->link), ri->link, link_str(want));
        return KV_ERR_MISMATCH;
    }
    if (ri->link != IBV_LINK_LAYER_INFINIBAND && ri->link != IBV_LINK_LAYER_ETHERNET) {
        snprintf(msg, cap, "%slink layer %u (infiniband 1 or ethernet 2)", pre, ri->link);
        return KV_ERR_CORRUPT;
    }
    if (p[20] & ~1u || (r && p[21]) || p[22] || p[23]) {
        if (r)
            snprintf(msg, cap, "%sQP info flags 0x%02x, reserved %02x %02x %02x (must be 0)", pre,
                     p[20], p[21], p[22], p[23]);
        else
            snprintf(msg, cap, "QP info flags 0x%02x, reserved %02x %02x (must be 0)", p[20], p[22],
                     p[23]);
        return KV_ERR_CORRUPT;
    }
    if (kv__rd_mtu_bytes((enum ibv_mtu)ri->mtu) == 0) {
        snprintf(msg, cap, "%sactive MTU code %u (1..5: 256..4096 bytes)", pre, ri->mtu);
        return KV_ERR_CORRUPT;
    }
    const uint8_t link = ri->link;
    if (link == IBV_LINK_LAYER_INFINIBAND && (ri->lid == 0 || ri->lid > 0xbfff)) {
        snprintf(msg, cap, "%sLID 0x%04x on infiniband (unicast: 0x0001..0xbfff)", pre, ri->lid);
        return KV_ERR_CORRUPT;
    }
    if (link != IBV_LINK_LAYER_INFINIBAND && ri->lid != 0) {
        snprintf(msg, cap, "%sLID 0x%04x on ethernet (must be 0)", pre, ri->lid);
        return KV_ERR_CORRUPT;
    }
    if (ri->has_gid != (memcmp(ri->gid, zero, 16) != 0) ||
        (link == IBV_LINK_LAYER_ETHERNET && !ri->has_gid)) {
        snprintf(msg, cap, "%sGID %s, flagged %s, on %s (ethernet needs one)", pre,
                 memcmp(ri->gid, zero, 16) ? "nonzero" : "zero", ri->has_gid ? "valid" : "absent",
                 link_str(link));
        return KV_ERR_CORRUPT;
    }
    return KV_OK;
}

kv_status kv__rd_info_decode(const unsigned char *b, uint32_t len, uint32_t nq,
                             const uint8_t *links, uint32_t nlinks, struct rd_info *out, char *msg,
                             size_t cap)
{
    if (len < INFO_HEAD) {
        snprintf(msg, cap, "QP info of %u bytes (the header alone is %u)", len, INFO_HEAD);
        return KV_ERR_CORRUPT;
    }
    const unsigned kind = (unsigned)kv__le_get(b, 2), ver = (unsigned)kv__le_get(b + 2, 2);
    const uint64_t n = kv__le_get(b + 4, 4);
    if (kind != KV_XPORT_RDMA || ver != INFO_VERSION) {
        snprintf(msg, cap, "QP info kind %u version %u (here rdma %u, version %u)", kind, ver,
                 (unsigned)KV_XPORT_RDMA, INFO_VERSION);
        return KV_ERR_MISMATCH;
    }
    if (n != nq) {
        snprintf(msg, cap, "QP info for %" PRIu64 " QPs (here %u)", n, nq);
        return KV_ERR_MISMATCH;
    }
    const uint32_t nrail = (uint32_t)b[37] + 1;
    if (nrail > RD_MAX_RAILS || nq * nrail > KV__XPORT_MAX_CONNS) {
        snprintf(msg, cap, "QP info for %u rails of %u QPs (at most %u rails, %u QPs)", nrail, nq,
                 RD_MAX_RAILS, KV__XPORT_MAX_CONNS);
        return KV_ERR_CORRUPT;
    }
    const uint32_t want = kv__rd_info_len(nq, nrail);
    if (len != want) {
        if (nrail == 1)
            snprintf(msg, cap, "QP info of %u bytes for %u QPs (must be %u)", len, nq, want);
        else
            snprintf(msg, cap, "QP info of %u bytes for %u rails of %u QPs (must be %u)", len,
                     nrail, nq, want);
        return KV_ERR_CORRUPT;
    }
    struct rd_info in = {.nq = nq, .nrail = nrail, .conn = kv__le_get(b + 8, 8)};
    for (uint32_t r = 0; r < nrail; r++) {
        const kv_status st =
            rail_decode(b + rail_at(r), r, r < nlinks ? links[r] : 0, &in.rail[r], msg, cap);
        if (st != KV_OK)
            return st;
    }
    const uint32_t q0 = want - 8 * nq * nrail;
    for (uint32_t i = 0; i < nq * nrail; i++) {
        in.qpn[i] = (uint32_t)kv__le_get(b + q0 + 8 * i, 4);
        in.psn[i] = (uint32_t)kv__le_get(b + q0 + 8 * i + 4, 4);
        if (in.qpn[i] < 2 || in.qpn[i] > 0xffffff || in.psn[i] > 0xffffff) {
            snprintf(msg, cap, "QP %u: qpn 0x%x, psn 0x%x (qpn 0x2..0xffffff, psn 24 bits)", i,
                     in.qpn[i], in.psn[i]);
            return KV_ERR_CORRUPT;
        }
    }
    *out = in;
    return KV_OK;
}

kv_status kv__rd_msg_decode(const unsigned char *m, uint32_t byte_len, struct rd_msg *out,
                            char *msg, size_t cap)
{
    if (byte_len < RD_NOTE_HDR || byte_len > RD_MSG_BYTES) {
        snprintf(msg, cap, "a message of %u bytes (%u to %u)", byte_len, RD_NOTE_HDR, RD_MSG_BYTES);
        return KV_ERR_CORRUPT;
    }
    const uint32_t magic = (uint32_t)kv__le_get(m, 4);
    const uint64_t len = kv__le_get(m + 4, 4);
    struct rd_msg d = {.tag = kv__le_get(m + 8, 8), .xfer = kv__le_get(m + 16, 8)};
    if (len + RD_NOTE_HDR != byte_len) {
        snprintf(msg, cap, "a message of %u bytes naming a payload of %" PRIu64 " bytes", byte_len,
                 len);
        return KV_ERR_CORRUPT;
    }
    if (magic == RD_NOTE_MAGIC) {
        d.kind = RD_MSG_NOTE;
        d.len = (uint32_t)len;
        d.data = m + RD_NOTE_HDR;
        *out = d;
        return KV_OK;
    }
    if (magic != RD_ACK_MAGIC) {
        snprintf(msg, cap,
                 "a message with magic 0x%08x (a notification has 0x%08x, an acknowledgement "
                 "0x%08x)",
                 magic, RD_NOTE_MAGIC, RD_ACK_MAGIC);
        return KV_ERR_CORRUPT;
    }
    if (d.tag != 0 || d.xfer != 0 || len == 0 || len % RD_ACK_REC != 0 ||
        len / RD_ACK_REC > RD_NOTE_SLOTS) {
        snprintf(msg, cap,
                 "an acknowledgement with tag %" PRIu64 ", transfer %" PRIu64 " and %" PRIu64
                 " bytes (tag and transfer 0; 1 to %u records of %u bytes)",
                 d.tag, d.xfer, len, RD_NOTE_SLOTS, RD_ACK_REC);
        return KV_ERR_CORRUPT;
    }
    d.kind = RD_MSG_ACK;
    d.n = (uint32_t)(len / RD_ACK_REC);
    for (uint32_t i = 0; i < d.n; i++) {
        const unsigned char *p = m + RD_NOTE_HDR + RD_ACK_REC * i;
        const int32_t st = (int32_t)(uint32_t)kv__le_get(p + 8, 4);
        d.ack_xfer[i] = kv__le_get(p, 8);
        if (st != KV_OK && st != KV_ERR_CAPACITY && st != KV_ERR_NO_MEMORY) {
            snprintf(msg, cap,
                     "acknowledgement record %u (transfer %" PRIu64 ") with status %d (%d OK, %d "
                     "capacity or %d no memory)",
                     i, d.ack_xfer[i], (int)st, (int)KV_OK, (int)KV_ERR_CAPACITY,
                     (int)KV_ERR_NO_MEMORY);
            return KV_ERR_CORRUPT;
        }
        d.ack_st[i] = (kv_status)st;
    }
    *out = d;
    return KV_OK;
}

uint32_t kv__rd_note_encode(unsigned char *b, uint64_t tag, uint64_t xfer, const void *data,
                            uint32_t len)
{
    kv__le_put(b, RD_NOTE_MAGIC, 4);
    kv__le_put(b + 4, len, 4);
    kv__le_put(b + 8, tag, 8);
    kv__le_put(b + 16, xfer, 8);
    if (len)
        memcpy(b + RD_NOTE_HDR, data, len);
    return RD_NOTE_HDR + len;
}

uint32_t kv__rd_ack_encode(unsigned char *b, const uint64_t *xfer, const kv_status *st, uint32_t n)
{
    kv__le_put(b, RD_ACK_MAGIC, 4);
    kv__le_put(b + 4, (uint64_t)RD_ACK_REC * n, 4);
    kv__le_put(b + 8, 0, 8);
    kv__le_put(b + 16, 0, 8);
    for (uint32_t i = 0; i < n; i++) {
        unsigned char *p = b + RD_NOTE_HDR + RD_ACK_REC * i;
        kv__le_put(p, xfer[i], 8);
        kv__le_put(p + 8, (uint32_t)(int32_t)st[i], 4);
    }
    return RD_NOTE_HDR + RD_ACK_REC * n;
}

kv_status kv__rd_fail_decode(const unsigned char *b, uint32_t len, kv_status *st, char *text,
                             size_t cap, char *msg, size_t mcap)
{
    if (len < 4 || len > 4 + RD_FAIL_TEXT) {
        snprintf(msg, mcap, "%u bytes (4 to %u)", len, 4 + RD_FAIL_TEXT);
        return KV_ERR_CORRUPT;
    }
    const int32_t v = (int32_t)(uint32_t)kv__le_get(b, 4);
    if (v == KV_OK || strcmp(kv_status_name((kv_status)v), "KV_UNKNOWN_STATUS") == 0) {
        snprintf(msg, mcap, "status %d (a kv_status other than KV_OK)", (int)v);
        return KV_ERR_CORRUPT;
    }
    *st = (kv_status)v;
    if (cap == 0)
        return KV_OK;
    size_t n = len - 4;
    n = n < cap - 1 ? n : cap - 1;
    for (size_t i = 0; i < n; i++)
        text[i] = b[4 + i] >= 32 && b[4 + i] <= 126 ? (char)b[4 + i] : '?';
    text[n] = 0;
    return KV_OK;
}

uint32_t kv__rd_fail_encode(unsigned char *b, kv_status st, const char *text)
{
    kv__le_put(b, (uint32_t)(int32_t)st, 4);
    size_t n = strnlen(text, RD_FAIL_TEXT);
    memcpy(b + 4, text, n);
    return (uint32_t)(4 + n);
}
