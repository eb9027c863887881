/*
 * fuzz_rdma_info.c - libFuzzer target for kv__rd_info_decode, the RDMA
 * backend's decoder of a peer's INFO message (connector/transport/
 * kv_xport_rdma_info_verbs.c; the table is in kv_xport_rdma_int.h).
 *
 * Input: byte 0 picks the QP count this side expects (1..16), byte 1 this
 * side's link layer (infiniband, ethernet, or an unknown code), byte 2 the
 * mode, the rest is the message:
 *
 *   mode 0 (raw)         the bytes exactly as received;
 *   mode 1 (structured)  kind, version, QP count and length made right, so
 *                        the checks behind them (link layer, flags, MTU,
 *                        LID, GID, qpn/psn) are reached.
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

/* The reference: the table read literally. 0 = accepted. */
static kv_status reference(const unsigned char *b, uint32_t len, uint32_t nq, uint8_t link)
{
    const uint32_t head = 40;
    if (len < head)
        return KV_ERR_CORRUPT;
    if (rd(b, 2) != 2 || rd(b + 2, 2) != 2 || rd(b + 4, 4) != nq)
        return KV_ERR_MISMATCH;
    if (len != head + 8 * nq)
        return KV_ERR_CORRUPT;
    if (b[34] != link)
        return KV_ERR_MISMATCH;
    if (b[36] > 1 || b[37] || b[38] || b[39])
        return KV_ERR_CORRUPT;
    if (b[35] < 1 || b[35] > 5) /* IBV_MTU_256 .. IBV_MTU_4096 */
        return KV_ERR_CORRUPT;
    const uint64_t lid = rd(b + 32, 2);
    const bool ib = link == IBV_LINK_LAYER_INFINIBAND;
    if (ib ? lid == 0 || lid > 0xbfff : lid != 0)
        return KV_ERR_CORRUPT;
    bool nonzero = false;
    for (int i = 16; i < 32; i++)
        nonzero |= b[i] != 0;
    if ((b[36] == 1) != nonzero || (link == IBV_LINK_LAYER_ETHERNET && !nonzero))
        return KV_ERR_CORRUPT;
    for (uint32_t i = 0; i < nq; i++) {
        const uint64_t qpn = rd(b + head + 8 * i, 4), psn = rd(b + head + 8 * i + 4, 4);
        if (qpn < 2 || qpn > 0xffffff || psn > 0xffffff)
            return KV_ERR_CORRUPT;
    }
    return KV_OK;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 3 || size > 3 + 40 + 8 * KV__XPORT_MAX_CONNS + 64)
        return 0;
    const uint32_t nq = 1 + data[0] % KV__XPORT_MAX_CONNS;
    static const uint8_t links[] = {IBV_LINK_LAYER_INFINIBAND, IBV_LINK_LAYER_ETHERNET, 0, 7};
    const uint8_t link = links[data[1] % 4];
    const int mode = data[2] % 2;
    uint32_t len = (uint32_t)(size - 3);
    if (mode == 1)
        len = 40 + 8 * nq;
    unsigned char *b = malloc(len ? len : 1);
    if (!b)
        return 0;
    memset(b, 0, len);
    memcpy(b, data + 3, size - 3 < len ? size - 3 : len);
    if (mode == 1) {
        wr(b, 2, 2);
        wr(b + 2, 2, 2);
        wr(b + 4, nq, 4);
    }
    const kv_status want = reference(b, len, nq, link);

    struct rd_info out;
    memset(&out, 0xa5, sizeof(out));
    const uint64_t conn0 = out.conn;
    const uint32_t nq0 = out.nq;
    char msg[256];
    memset(msg, 'x', sizeof(msg));
    const kv_status got = kv__rd_info_decode(b, len, nq, link, &out, msg, sizeof(msg));
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
        if (out.nq != nq || out.conn != rd(b + 8, 8) || memcmp(out.gid, b + 16, 16) != 0 ||
            out.lid != rd(b + 32, 2) || out.link != b[34] || out.mtu != b[35] ||
            out.has_gid != (b[36] == 1))
            die("a decoded field differs from the message");
        for (uint32_t i = 0; i < nq; i++)
            if (out.qpn[i] != rd(b + 40 + 8 * i, 4) || out.psn[i] != rd(b + 44 + 8 * i, 4))
                die("a decoded qpn/psn differs from the message");
        unsigned char again[40 + 8 * KV__XPORT_MAX_CONNS];
        if (kv__rd_info_encode(&out, again) != len || memcmp(again, b, len) != 0)
            die("encode(decode(x)) != x");
    }
    free(b);
    return 0;
}
