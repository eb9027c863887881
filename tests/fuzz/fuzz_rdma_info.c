/*
 * fuzz_rdma_info.c - libFuzzer target for kv__rd_info_decode, the RDMA
 * backend's decoder of a peer's INFO message (connector/transport/
 * kv_xport_rdma_info_verbs.c; the table is in kv_xport_rdma_int.h).
 *
 * Input: byte 0 picks the QP count per rail this side expects (1..16),
 * byte 1 this side's rails (1..3) and their link layers (infiniband,
 * ethernet, or an unknown code), byte 2 the mode, the rest is the message:
 *
 *   mode 0 (raw)         the bytes exactly as received;
 *   mode 1 (structured)  kind, version, QP count, a rail count that fits
 *                        and the length made right, so the checks behind
 *                        them (each rail's link layer, flags, MTU, LID,
 *                        GID; each qpn/psn) are reached.
 *
 * The message lives in a malloc of its exact length (ASan sees any read
 * past it). The decode is checked against a reference decoder written here
 * from the table, not from the library's code:
 *
 *   the library accepts exactly what the reference accepts;
 *   failure: the reference's class (KV_ERR_MISMATCH for kind, version, QP
 *            count, link layer; KV_ERR_CORRUPT for the rest), a non-empty
 *            NUL-terminated message, *out untouched;
 *   success: every field equals the reference's, and kv__rd_info_encode
 *            gives back the input bytes (the encoding is canonical).
 * Any violation aborts.
 */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_xport_rdma_int.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void die(const char *what)
{
    fprintf(stderr, "fuzz_rdma_info: %s\n", what);
    abort();
}

static uint64_t rd(const unsigned char *p, int n)
{
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

static void wr(unsigned char *p, uint64_t v, int n)
{
    for (int i = 0; i < n; i++, v >>= 8)
        p[i] = (unsigned char)v;
}

/* Where rail r's 24 bytes start, and the message's length. */
static uint32_t rail_off(uint32_t r)
{
    return r == 0 ? 16 : 40 + 24 * (r - 1);
}

static uint32_t info_len(uint32_t nq, uint32_t rails)
{
    return 40 + 24 * (rails - 1) + 8 * nq * rails;
}

/* The reference: the table read literally. 0 = accepted. */
static kv_status reference(const unsigned char *b, uint32_t len, uint32_t nq, const uint8_t *links,
                           uint32_t nlinks)
{
    if (len < 40)
        return KV_ERR_CORRUPT;
    if (rd(b, 2) != 2 || rd(b + 2, 2) != 2 || rd(b + 4, 4) != nq)
        return KV_ERR_MISMATCH;
    const uint32_t rails = b[37] + 1u;
    if (rails > 8 || rails * nq > 16)
        return KV_ERR_CORRUPT;
    if (len != info_len(nq, rails))
        return KV_ERR_CORRUPT;
    for (uint32_t r = 0; r < rails; r++) {
        const unsigned char *p = b + rail_off(r);
        const uint8_t link = p[18];
        if (r < nlinks && link != links[r])
            return KV_ERR_MISMATCH;
        if (link != IBV_LINK_LAYER_INFINIBAND && link != IBV_LINK_LAYER_ETHERNET)
            return KV_ERR_CORRUPT;
        if (p[20] > 1 || (r > 0 && p[21]) || p[22] || p[23])
            return KV_ERR_CORRUPT;
        if (p[19] < 1 || p[19] > 5) /* IBV_MTU_256 .. IBV_MTU_4096 */
            return KV_ERR_CORRUPT;
        const uint64_t lid = rd(p + 16, 2);
        const bool ib = link == IBV_LINK_LAYER_INFINIBAND;
        if (ib ? lid == 0 || lid > 0xbfff : lid != 0)
            return KV_ERR_CORRUPT;
        bool nonzero = false;
        for (int i = 0; i < 16; i++)
            nonzero |= p[i] != 0;
        if ((p[20] == 1) != nonzero || (!ib && !nonzero))
            return KV_ERR_CORRUPT;
    }
    const uint32_t q0 = len - 8 * nq * rails;
    for (uint32_t i = 0; i < nq * rails; i++) {
        const uint64_t qpn = rd(b + q0 + 8 * i, 4), psn = rd(b + q0 + 8 * i + 4, 4);
        if (qpn < 2 || qpn > 0xffffff || psn > 0xffffff)
            return KV_ERR_CORRUPT;
    }
    return KV_OK;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 3 || size > 3 + INFO_MAX + 64)
        return 0;
    const uint32_t nq = 1 + data[0] % KV__XPORT_MAX_CONNS;
    static const uint8_t kinds[] = {IBV_LINK_LAYER_INFINIBAND, IBV_LINK_LAYER_ETHERNET, 7};
    const uint32_t nlinks = 1 + data[1] % 3;
    uint8_t links[3];
    for (uint32_t i = 0, v = data[1] / 3u; i < nlinks; i++, v /= 3)
        links[i] = kinds[v % 3];
    const int mode = data[2] % 2;
    uint32_t len = (uint32_t)(size - 3);
    uint32_t rails = 1;
    if (mode == 1) {
        rails = size > 3 + 37 ? 1 + data[3 + 37] % 4u : 1;
        while (rails * nq > KV__XPORT_MAX_CONNS)
            rails--;
        len = info_len(nq, rails);
    }
    unsigned char *b = malloc(len ? len : 1);
    if (!b)
        return 0;
    memset(b, 0, len);
    memcpy(b, data + 3, size - 3 < len ? size - 3 : len);
    if (mode == 1) {
        wr(b, 2, 2);
        wr(b + 2, 2, 2);
        wr(b + 4, nq, 4);
        b[37] = (unsigned char)(rails - 1);
    }
    const kv_status want = reference(b, len, nq, links, nlinks);

    struct rd_info out;
    memset(&out, 0xa5, sizeof(out));
    const uint64_t conn0 = out.conn;
    const uint32_t nq0 = out.nq;
    char msg[256];
    memset(msg, 'x', sizeof(msg));
    const kv_status got = kv__rd_info_decode(b, len, nq, links, nlinks, &out, msg, sizeof(msg));
    if ((got == KV_OK) != (want == KV_OK))
        die(got == KV_OK ? "accepted what the table refuses" : "refused what the table accepts");
    if (got != KV_OK) {
        if (got != want)
            die("refused with the wrong class (MISMATCH vs CORRUPT)");
        if (!memchr(msg, 0, sizeof(msg)) || msg[0] == 0)
            die("a refusal without a message");
        if (out.conn != conn0 || out.nq != nq0)
            die("a refusal wrote *out");
    } else {
        const uint32_t nr = b[37] + 1u;
        if (out.nq != nq || out.nrail != nr || out.conn != rd(b + 8, 8))
            die("a decoded header field differs from the message");
        for (uint32_t r = 0; r < nr; r++) {
            const unsigned char *p = b + rail_off(r);
            const struct rd_rail_info *ri = &out.rail[r];
            if (memcmp(ri->gid, p, 16) != 0 || ri->lid != rd(p + 16, 2) || ri->link != p[18] ||
                ri->mtu != p[19] || ri->has_gid != (p[20] == 1))
                die("a decoded rail field differs from the message");
        }
        const uint32_t q0 = len - 8 * nq * nr;
        for (uint32_t i = 0; i < nq * nr; i++)
            if (out.qpn[i] != rd(b + q0 + 8 * i, 4) || out.psn[i] != rd(b + q0 + 8 * i + 4, 4))
                die("a decoded qpn/psn differs from the message");
        unsigned char again[INFO_MAX];
        if (kv__rd_info_encode(&out, again) != len || memcmp(again, b, len) != 0)
            die("encode(decode(x)) != x");
    }
    free(b);
    return 0;
}
