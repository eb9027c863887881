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

uint32_t kv__rd_info_encode(const struct rd_info *in, unsigned char *b)
{
    kv__le_put(b, KV_XPORT_RDMA, 2);
    kv__le_put(b + 2, INFO_VERSION, 2);
    kv__le_put(b + 4, in->nq, 4);
    kv__le_put(b + 8, in->conn, 8);
    memcpy(b + 16, in->gid, 16);
    kv__le_put(b + 32, in->lid, 2);
    b[34] = in->link;
    b[35] = in->mtu;
    b[36] = in->has_gid ? 1 : 0;
    memset(b + 37, 0, 3);
    for (uint32_t i = 0; i < in->nq; i++) {
        kv__le_put(b + INFO_HEAD + 8 * i, in->qpn[i], 4);
        kv__le_put(b + INFO_HEAD + 8 * i + 4, in->psn[i], 4);
    }
    return INFO_HEAD + 8 * in->nq;
}

static const char *link_str(unsigned l)
{
    return l == IBV_LINK_LAYER_INFINIBAND ? "infiniband"
           : l == IBV_LINK_LAYER_ETHERNET ? "ethernet"
                                          : "unknown";
}

kv_status kv__rd_info_decode(const unsigned char *b, uint32_t len, uint32_t nq, uint8_t link,
                             struct rd_info *out, char *msg, size_t cap)
{
    static const uint8_t zero[16];
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
    if (len != INFO_HEAD + 8 * nq) {
        snprintf(msg, cap, "QP info of %u bytes for %u QPs (must be %u)", len, nq,
                 INFO_HEAD + 8 * nq);
        return KV_ERR_CORRUPT;
    }
    struct rd_info in = {.nq = nq, .conn = kv__le_get(b + 8, 8)};
    memcpy(in.gid, b + 16, 16);
    in.lid = (uint16_t)kv__le_get(b + 32, 2);
    in.link = b[34];
    in.mtu = b[35];
    in.has_gid = b[36] & 1;
    if (in.link != link) {
        snprintf(msg, cap, "the peer's port is %s (link layer %u), this one %s", link_str(in.link),
                 in.link, link_str(link));
        return KV_ERR_MISMATCH;
    }
    if (b[36] & ~1u || b[37] || b[38] || b[39]) {
        snprintf(msg, cap, "QP info flags 0x%02x, reserved %02x %02x %02x (must be 0)", b[36],
                 b[37], b[38], b[39]);
        return KV_ERR_CORRUPT;
    }
    if (kv__rd_mtu_bytes((enum ibv_mtu)in.mtu) == 0) {
        snprintf(msg, cap, "active MTU code %u (1..5: 256..4096 bytes)", in.mtu);
        return KV_ERR_CORRUPT;
    }
    if (link == IBV_LINK_LAYER_INFINIBAND && (in.lid == 0 || in.lid > 0xbfff)) {
        snprintf(msg, cap, "LID 0x%04x on infiniband (unicast: 0x0001..0xbfff)", in.lid);
        return KV_ERR_CORRUPT;
    }
    if (link != IBV_LINK_LAYER_INFINIBAND && in.lid != 0) {
        snprintf(msg, cap, "LID 0x%04x on ethernet (must be 0)", in.lid);
        return KV_ERR_CORRUPT;
    }
    if (in.has_gid != (memcmp(in.gid, zero, 16) != 0) ||
        (link == IBV_LINK_LAYER_ETHERNET && !in.has_gid)) {
        snprintf(msg, cap, "GID %s, flagged %s, on %s (ethernet needs one)",
                 memcmp(in.gid, zero, 16) ? "nonzero" : "zero", in.has_gid ? "valid" : "absent",
                 link_str(link));
        return KV_ERR_CORRUPT;
    }
    for (uint32_t i = 0; i < nq; i++) {
        in.qpn[i] = (uint32_t)kv__le_get(b + INFO_HEAD + 8 * i, 4);
        in.psn[i] = (uint32_t)kv__le_get(b + INFO_HEAD + 8 * i + 4, 4);
        if (in.qpn[i] < 2 || in.qpn[i] > 0xffffff || in.psn[i] > 0xffffff) {
            snprintf(msg, cap, "QP %u: qpn 0x%x, psn 0x%x (qpn 0x2..0xffffff, psn 24 bits)", i,
                     in.qpn[i], in.psn[i]);
            return KV_ERR_CORRUPT;
        }
    }
    *out = in;
    return KV_OK;
}
