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
 *                        GID; each qpn/psn) are reached;
 *   mode 2, 3            a message on QP 0 instead (kv__rd_msg_decode: a
 *                        NOTE or an ACK of our notifications), raw or with
 *                        its magic, length and zero fields made right;
 *                        checked against a reference read from the message
 *                        table, a NOTE or an ACK re-encoded byte for byte;
 *   mode 4               an out-of-band FAIL (kv__rd_fail_decode: status,
 *                        then text), against the status table; printable
 *                        text re-encoded byte for byte.
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
    if (rd(b, 2) != 2 || rd(b + 2, 2) != 3 || rd(b + 4, 4) != nq)
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

/* ---- messages on QP 0 (NOTE, ACK) ---------------------------------- */

/* The reference: the message table read literally. 0 = accepted. */
static kv_status msg_reference(const unsigned char *b, uint32_t len)
{
    if (len < 24 || len > 24 + 4096 || rd(b + 4, 4) + 24 != len)
        return KV_ERR_CORRUPT;
    if (rd(b, 4) == 0x4b56524e) /* "KVRN" */
        return KV_OK;
    if (rd(b, 4) != 0x4b565241 || rd(b + 8, 8) != 0 || rd(b + 16, 8) != 0) /* "KVRA" */
        return KV_ERR_CORRUPT;
    const uint32_t pl = len - 24;
    if (pl == 0 || pl % 12 != 0 || pl / 12 > 8)
        return KV_ERR_CORRUPT;
    for (uint32_t i = 0; i < pl / 12; i++) {
        const int32_t st = (int32_t)(uint32_t)rd(b + 24 + 12 * i + 8, 4);
        if (st != KV_OK && st != KV_ERR_CAPACITY && st != KV_ERR_NO_MEMORY)
            return KV_ERR_CORRUPT;
    }
    return KV_OK;
}

/* Modes 2 and 3: the bytes after the mode byte are a message, raw or with
 * its magic (byte 0: NOTE or ACK), length and, for an ACK, its zero fields
 * made right and its statuses drawn from the three it may carry (or not). */
static int fuzz_msg(const uint8_t *data, size_t size, bool structured)
{
    uint32_t len = (uint32_t)(size < 24 + 4096 + 64 ? size : 24 + 4096 + 64);
    if (structured && size >= 2) {
        const bool ack = data[0] & 1;
        len = ack ? 24 + 12 * (1 + data[1] % 9u) : 24 + (uint32_t)(size > 24 ? size - 24 : 0);
        if (len > 24 + 4096)
            len = 24 + 4096;
    }
    unsigned char *b = malloc(len ? len : 1);
    if (!b)
        return 0;
    memset(b, 0, len);
    memcpy(b, data, size < len ? size : len);
    if (structured && size >= 2 && len >= 24) {
        const bool ack = data[0] & 1;
        wr(b, ack ? 0x4b565241 : 0x4b56524e, 4);
        wr(b + 4, len - 24, 4);
        if (ack) {
            wr(b + 8, 0, 8);
            wr(b + 16, 0, 8);
            static const int32_t sts[4] = {KV_OK, KV_ERR_CAPACITY, KV_ERR_NO_MEMORY, 0};
            for (uint32_t i = 0; 24 + 12 * (i + 1) <= len; i++) {
                const unsigned char *st = b + 24 + 12 * i + 8;
                const uint32_t k = st[0] % 5u;
                if (k < 3)
                    wr(b + 24 + 12 * i + 8, (uint32_t)sts[k], 4); /* else: as drawn */
            }
        }
    }
    const kv_status want = msg_reference(b, len);
    struct rd_msg out;
    memset(&out, 0xa5, sizeof(out));
    const uint64_t tag0 = out.tag;
    char msg[256];
    memset(msg, 'x', sizeof(msg));
    const kv_status got = kv__rd_msg_decode(b, len, &out, msg, sizeof(msg));
    if ((got == KV_OK) != (want == KV_OK))
        die(got == KV_OK ? "accepted a message the table refuses"
                         : "refused a message the table accepts");
    if (got != KV_OK) {
        if (got != KV_ERR_CORRUPT)
            die("a message refused with a class other than CORRUPT");
        if (!memchr(msg, 0, sizeof(msg)) || msg[0] == 0)
            die("a message refused without a message");
        if (out.tag != tag0)
            die("a refused message wrote *out");
    } else if (rd(b, 4) == 0x4b56524e) {
        if (out.kind != RD_MSG_NOTE || out.tag != rd(b + 8, 8) || out.xfer != rd(b + 16, 8) ||
            out.len != len - 24 || out.data != b + 24)
            die("a decoded NOTE differs from the message");
        unsigned char *again = malloc(len);
        if (!again) {
            free(b);
            return 0;
        }
        if (kv__rd_note_encode(again, out.tag, out.xfer, out.data, out.len) != len ||
            memcmp(again, b, len) != 0)
            die("encode(decode(NOTE)) != NOTE");
        free(again);
    } else {
        if (out.kind != RD_MSG_ACK || out.n != (len - 24) / 12)
            die("a decoded ACK has the wrong record count");
        for (uint32_t i = 0; i < out.n; i++)
            if (out.ack_xfer[i] != rd(b + 24 + 12 * i, 8) ||
                (int32_t)out.ack_st[i] != (int32_t)(uint32_t)rd(b + 24 + 12 * i + 8, 4))
                die("a decoded ACK record differs from the message");
        unsigned char again[24 + 12 * 8];
        if (kv__rd_ack_encode(again, out.ack_xfer, out.ack_st, out.n) != len ||
            memcmp(again, b, len) != 0)
            die("encode(decode(ACK)) != ACK");
    }
    free(b);
    return 0;
}

/* ---- FAIL (an OOB notification) ------------------------------------ */

/* Whether v is a kv_status other than KV_OK: the status table itself. */
static bool an_error(int32_t v)
{
    switch (v) {
#define KNOWN(name, value, msg)                                                                    \
    case value:                                                                                    \
        return value != 0;
        KV_STATUS_MAP(KNOWN)
#undef KNOWN
    }
    return false;
}

/* Mode 4: the bytes after the mode byte are a FAIL: 4 status, then text.
 * Accepted exactly when 4 <= len <= 204 and the status is an error; the
 * text comes back printable, NUL-terminated, cut to the buffer. */
static int fuzz_fail(const uint8_t *data, size_t size)
{
    const uint32_t len = (uint32_t)(size < 300 ? size : 300);
    unsigned char *b = malloc(len ? len : 1);
    if (!b)
        return 0;
    memcpy(b, data, len);
    const bool want = len >= 4 && len <= 204 && an_error((int32_t)(uint32_t)rd(b, 4));
    const size_t cap = len ? 1 + data[0] % 64u : 16; /* small buffers cut the text */
    char text[64], msg[160];
    memset(text, 'z', sizeof(text));
    memset(msg, 'x', sizeof(msg));
    kv_status st = KV_OK;
    const kv_status got = kv__rd_fail_decode(b, len, &st, text, cap, msg, sizeof(msg));
    if ((got == KV_OK) != want)
        die(got == KV_OK ? "accepted a FAIL the table refuses"
                         : "refused a FAIL the table accepts");
    if (got != KV_OK) {
        if (got != KV_ERR_CORRUPT || st != KV_OK || text[0] != 'z')
            die("a refused FAIL: wrong class, or wrote its outputs");
        if (!memchr(msg, 0, sizeof(msg)) || msg[0] == 0)
            die("a refused FAIL without a message");
    } else {
        if ((int32_t)st != (int32_t)(uint32_t)rd(b, 4))
            die("a FAIL's status differs from the message");
        const size_t n = len - 4 < cap - 1 ? len - 4 : cap - 1;
        if (strlen(text) != n)
            die("a FAIL's text has the wrong length");
        for (size_t i = 0; i < n; i++)
            if (text[i] != (b[4 + i] >= 32 && b[4 + i] <= 126 ? (char)b[4 + i] : '?'))
                die("a FAIL's text differs from the message");
        unsigned char again[4 + 200];
        if (n == len - 4 && strlen(text) == n && !memchr(b + 4, 0, len - 4)) {
            int printable = 1;
            for (size_t i = 0; i < n; i++)
                printable &= b[4 + i] >= 32 && b[4 + i] <= 126;
            if (printable &&
                (kv__rd_fail_encode(again, st, text) != len || memcmp(again, b, len) != 0))
                die("encode(decode(FAIL)) != FAIL");
        }
    }
    free(b);
    return 0;
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
    const int mode = data[2] % 5;
    if (mode == 4)
        return fuzz_fail(data + 3, size - 3);
    if (mode >= 2)
        return fuzz_msg(data + 3, size - 3, mode == 3);
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
        wr(b + 2, 3, 2);
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
