/*
 * fuzz_xlayer_rx.c - libFuzzer target for the decode side of layer-by-layer
 * transfer (connector/transport/kv_xport_layers.h): notifications from a
 * peer are hostile bytes.
 *
 * A tracker (max_requests 4, max_layers 16) expects three requests: 10
 * (peer 1, 16 layers), 11 (peer 1, 5 layers), 12 (peer 2, 1 layer). The
 * input is a list of operations, each [op][len][len bytes]:
 *
 *   op % 4 == 0  feed the bytes as they are (tag, peer and length from the
 *                first bytes, the rest the payload);
 *   op % 4 == 1  feed a well-formed notification built from the bytes
 *                (kind, request, layer0, n_layers, status), one byte then
 *                flipped when op >= 128 -- so every check behind the
 *                magic is reached;
 *   op % 4 == 2  wait(request, layer, 0 ms);
 *   op % 4 == 3  finished (then a request of the three is expected again).
 *
 * A model written here from the table in the header (not from the
 * library's code) predicts every status, every wait and every finished
 * request; the library's stats must equal the model's counts after every
 * operation. Any difference aborts.
 */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_xport_layers.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void die(const char *what)
{
    fprintf(stderr, "fuzz_xlayer_rx: %s (last error: %s)\n", what, kv_last_error());
    abort();
}

static uint64_t rd(const unsigned char *p, int n)
{
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

struct mreq {
    bool tracked, terminal;
    uint64_t id, peer;
    uint32_t n;
    uint16_t bits; /* layers landed */
    kv_status status;
};

static const struct mreq INIT[3] = {
    {true, false, 10, 1, 16, 0, KV_OK},
    {true, false, 11, 1, 5, 0, KV_OK},
    {true, false, 12, 2, 1, 0, KV_OK},
};

struct model {
    struct mreq r[3];
    uint64_t layers, aborts, late, refused;
    int order[3], n_order; /* terminal, not reported, in order */
};

static bool known_failure(int32_t s)
{
    return s < 0 && s >= -22; /* kv_status.h: KV_ERR_INVALID_ARG (-1) .. KV_ERR_DEVICE (-22) */
}

/* The model's verdict on one message. */
static kv_status model_feed(struct model *m, const struct kv_xport_msg *msg)
{
    if (msg->tag != KV_XLAYER_TAG)
        return KV_ERR_INVALID_ARG;
    const unsigned char *b = msg->data;
    if (msg->len != 32 || rd(b, 4) != 0x574C564Bu || rd(b + 4, 2) != 1 || b[7] != 0 ||
        rd(b + 28, 4) != 0)
        return KV_ERR_CORRUPT;
    const uint64_t req = rd(b + 8, 8);
    const uint32_t l0 = (uint32_t)rd(b + 16, 4), n = (uint32_t)rd(b + 20, 4);
    const int32_t st = (int32_t)(uint32_t)rd(b + 24, 4);
    if (b[6] == 1) {
        if (n == 0 || l0 >= 4096 || n > 4096 - l0 || st != 0)
            return KV_ERR_CORRUPT;
    } else if (b[6] == 2) {
        if (l0 || n || !known_failure(st))
            return KV_ERR_CORRUPT;
    } else {
        return KV_ERR_CORRUPT;
    }
    struct mreq *r = NULL;
    for (int i = 0; i < 3; i++)
        if (m->r[i].tracked && m->r[i].id == req)
            r = &m->r[i];
    if (!r)
        return KV_ERR_NOT_FOUND;
    if (r->peer != msg->peer_id)
        return KV_ERR_MISMATCH;
    if (r->terminal) {
        m->late++;
        return KV_OK;
    }
    if (b[6] == 2) {
        r->status = (kv_status)st;
        r->terminal = true;
        m->order[m->n_order++] = (int)(r - m->r);
        m->aborts++;
        return KV_OK;
    }
    if (l0 >= r->n || n > r->n - l0)
        return KV_ERR_OUT_OF_BOUNDS;
    const uint16_t mask = (uint16_t)(((1u << n) - 1u) << l0);
    if (r->bits & mask)
        return KV_ERR_CORRUPT;
    r->bits |= mask;
    m->layers++;
    if (r->bits == (uint16_t)((1u << r->n) - 1u)) {
        r->terminal = true;
        m->order[m->n_order++] = (int)(r - m->r);
    }
    return KV_OK;
}

static void check_stats(kv_xlayer_rx *rx, const struct model *m)
{
    struct kv_xlayer_rx_stats s = KV_XLAYER_RX_STATS_INIT;
    if (kv_xlayer_rx_stats_get(rx, &s) != KV_OK)
        die("stats_get");
    uint32_t tracked = 0;
    for (int i = 0; i < 3; i++)
        tracked += m->r[i].tracked;
    if (s.notes_layers != m->layers || s.notes_abort != m->aborts || s.notes_late != m->late ||
        s.notes_refused != m->refused || s.tracked != tracked)
        die("stats differ from the model");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct kv_xlayer_rx_config cfg = KV_XLAYER_RX_CONFIG_INIT;
    cfg.max_requests = 4;
    cfg.max_layers = 16;
    kv_xlayer_rx *rx = NULL;
    if (kv_xlayer_rx_create(&cfg, &rx) != KV_OK)
        die("create");
    struct model m;
    memset(&m, 0, sizeof(m));
    memcpy(m.r, INIT, sizeof(INIT));
    for (int i = 0; i < 3; i++)
        if (kv_xlayer_rx_expect(rx, m.r[i].peer, m.r[i].id, m.r[i].n) != KV_OK)
            die("expect");
    struct kv_xport_msg *msg = malloc(sizeof(*msg));
    if (!msg)
        return 0;
    size_t at = 0;
    while (at + 2 <= size) {
        const uint8_t op = data[at], len = data[at + 1];
        const unsigned char *p = data + at + 2;
        const size_t avail = size - at - 2 < len ? size - at - 2 : len;
        at += 2 + avail;
        memset(msg, 0, sizeof(*msg));
        unsigned char q[48];
        memset(q, 0, sizeof(q));
        memcpy(q, p, avail < sizeof(q) ? avail : sizeof(q));
        switch (op % 4) {
        case 0:
        case 1: {
            msg->peer_id = 1 + (q[0] & 1);
            msg->tag = (q[0] & 2) ? q[1] : KV_XLAYER_TAG;
            if (op % 4 == 0) {
                const size_t n = avail > 2 ? avail - 2 : 0;
                msg->len = (uint32_t)n;
                memcpy(msg->data, p + (avail > 2 ? 2 : avail), n);
            } else {
                static const uint64_t reqs[4] = {10, 11, 12, 13};
                struct kv_xlayer_note nt = {
                    .kind = (q[2] & 1) ? KV_XLAYER_ABORT : KV_XLAYER_LAYERS,
                    .request = reqs[q[3] & 3],
                    .layer0 = (q[4] & 0x80) ? (uint32_t)rd(q + 5, 4) : (uint32_t)(q[4] & 31),
                    .n_layers = (q[2] & 2) ? (uint32_t)rd(q + 9, 4) : (uint32_t)(q[13] & 15),
                    .status = (kv_status)(int8_t)q[14]};
                if (nt.kind == KV_XLAYER_ABORT && !(q[2] & 4))
                    nt.layer0 = nt.n_layers = 0;
                if (nt.kind == KV_XLAYER_LAYERS && !(q[2] & 8))
                    nt.status = KV_OK;
                msg->len = KV_XLAYER_NOTE_BYTES;
                kv_xlayer_note_encode(&nt, msg->data);
                if (op >= 128)
                    msg->data[q[15] % 32] ^= (unsigned char)(1u << (q[16] & 7));
            }
            const kv_status want = model_feed(&m, msg);
            const kv_status got = kv_xlayer_rx_feed(rx, msg);
            if (got != want) {
                fprintf(stderr, "feed: %s, the model says %s\n", kv_status_name(got),
                        kv_status_name(want));
                die("feed differs from the model");
            }
            if (got != KV_OK) {
                m.refused++;
                if (!kv_last_error()[0])
                    die("a refusal without a message");
            }
            break;
        }
        case 2: {
            const int i = q[0] % 3;
            const uint32_t layer = q[1] & 31;
            const kv_status got = kv_xlayer_rx_wait(rx, m.r[i].id, layer, 0);
            kv_status want;
            if (!m.r[i].tracked)
                want = KV_ERR_NOT_FOUND;
            else if (layer >= m.r[i].n)
                want = KV_ERR_OUT_OF_BOUNDS;
            else if (m.r[i].status != KV_OK)
                want = m.r[i].status;
            else
                want = (m.r[i].bits >> layer & 1u) ? KV_OK : KV_ERR_TIMEOUT;
            if (got != want)
                die("wait differs from the model");
            break;
        }
        default: {
            struct kv_xlayer_done done[4];
            uint32_t n = 99;
            const uint32_t cap = q[0] % 4;
            if (kv_xlayer_rx_finished(rx, done, cap, &n) != KV_OK)
                die("finished");
            const uint32_t want_n = (uint32_t)m.n_order < cap ? (uint32_t)m.n_order : cap;
            if (n != want_n)
                die("finished: count differs from the model");
            for (uint32_t k = 0; k < n; k++) {
                struct mreq *r = &m.r[m.order[k]];
                if (done[k].request != r->id || done[k].status != r->status)
                    die("finished: a request differs from the model");
                r->tracked = false;
            }
            memmove(m.order, m.order + n, (size_t)(m.n_order - (int)n) * sizeof(int));
            m.n_order -= (int)n;
            /* expect one forgotten request again (a fresh start) */
            const int i = q[1] % 3;
            if (!m.r[i].tracked) {
                if (kv_xlayer_rx_expect(rx, INIT[i].peer, INIT[i].id, INIT[i].n) != KV_OK)
                    die("expect again");
                m.r[i] = INIT[i];
            }
            break;
        }
        }
        check_stats(rx, &m);
    }
    free(msg);
    if (kv_xlayer_rx_destroy(rx) != KV_OK)
        die("destroy");
    return 0;
}
