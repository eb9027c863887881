/*
 * placement.c - the message decode sends prefill for each request.
 *
 * A placement says where one request's K/V must land: which request (and
 * so, by group, which of decode's arenas), how many tokens, decode's layout
 * and the ids of the blocks decode allocated; the first placement of a
 * group also carries the blob that exposes that arena to prefill
 * (kv_xport_mem_expose -> kv_xport_rmem_import). It travels as the data of
 * a TAG_PLACE notification (at most KV_XPORT_NOTIFY_MAX bytes).
 *
 * The layout travels as the library's own encoding of its config
 * (kv_layout_config_encode / _decode: versioned, checksummed, with the
 * layout's fingerprint, which the decoder matches against the layout it
 * builds); the demo's few fields around it are little-endian integers.
 * --local sends every placement through the same encoding.
 */
#include <endian.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "kvdemo.h"

#define PLACE_MAGIC UINT32_C(0x4c50564b) /* "KVPL" */
#define PLACE_VERSION 2u                 /* 2: the layout as kv_layout_config_encode's bytes */
#define PLACE_FIXED 36u

/* The demo's own fields, little-endian through <endian.h>; the layout goes
 * through the library's codec. */
void le32_put(unsigned char *p, uint32_t v)
{
    v = htole32(v);
    memcpy(p, &v, 4);
}

static void le64_put(unsigned char *p, uint64_t v)
{
    v = htole64(v);
    memcpy(p, &v, 8);
}

uint32_t le32_get(const unsigned char *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return le32toh(v);
}

static uint64_t le64_get(const unsigned char *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return le64toh(v);
}

/* The placement as bytes:
 *
 *    0  u32 magic "KVPL"          24  u32 n_blocks
 *    4  u32 version (2)           28  u32 blob bytes
 *    8  u32 request               32  u32 layout bytes (KV_LAYOUT_CONFIG_WIRE_BYTES)
 *   12  u32 group                 36  decode's layout config (kv_layout_config_encode:
 *   16  u64 n_tokens                  versioned, checksummed, its fingerprint inside)
 *   36 + layout bytes             u32[n_blocks] block ids, then the blob
 *
 * *len = 0 when it does not fit in cap; false when the library refuses the
 * config (named). */
bool place_encode(const struct placement *pl, unsigned char *buf, size_t cap, size_t *len)
{
    *len = 0;
    unsigned char lc[KV_LAYOUT_CONFIG_WIRE_BYTES];
    size_t lc_len = 0;
    if (!ok_call(kv_layout_config_encode(&pl->lc, lc, sizeof(lc), &lc_len),
                 "kv_layout_config_encode"))
        return false;
    const size_t need = PLACE_FIXED + lc_len + 4u * (size_t)pl->n_blocks + pl->blob_len;
    if (need > cap)
        return true;
    le32_put(buf + 0, PLACE_MAGIC);
    le32_put(buf + 4, PLACE_VERSION);
    le32_put(buf + 8, pl->req);
    le32_put(buf + 12, pl->group);
    le64_put(buf + 16, pl->n_tokens);
    le32_put(buf + 24, pl->n_blocks);
    le32_put(buf + 28, pl->blob_len);
    le32_put(buf + 32, (uint32_t)lc_len);
    memcpy(buf + PLACE_FIXED, lc, lc_len);
    unsigned char *ids = buf + PLACE_FIXED + lc_len;
    for (uint32_t i = 0; i < pl->n_blocks; i++)
        le32_put(ids + 4 * (size_t)i, pl->blocks[i]);
    if (pl->blob_len)
        memcpy(ids + 4 * (size_t)pl->n_blocks, pl->blob, pl->blob_len);
    *len = need;
    return true;
}

/* Parse a placement (bad input: false with the reason; blocks and blob
 * point into buf). The layout config is checked by the library's decoder:
 * length, version, checksum, every field, kv_layout_init's validation and
 * the sender's fingerprint against the layout it builds here. */
bool place_decode(const unsigned char *buf, size_t len, struct placement *pl, uint32_t *blocks,
                  char *why, size_t why_cap)
{
    if (len < PLACE_FIXED || le32_get(buf) != PLACE_MAGIC || le32_get(buf + 4) != PLACE_VERSION) {
        snprintf(why, why_cap, "not a version %u placement (%zu bytes)", PLACE_VERSION, len);
        return false;
    }
    memset(pl, 0, sizeof(*pl));
    pl->req = le32_get(buf + 8);
    pl->group = le32_get(buf + 12);
    pl->n_tokens = le64_get(buf + 16);
    pl->n_blocks = le32_get(buf + 24);
    pl->blob_len = le32_get(buf + 28);
    const uint32_t lc_len = le32_get(buf + 32);
    if (pl->n_blocks > KV_XPORT_NOTIFY_MAX / 4 || pl->blob_len > KV_XPORT_BLOB_MAX ||
        (uint64_t)PLACE_FIXED + lc_len + 4ull * pl->n_blocks + pl->blob_len != len) {
        snprintf(why, why_cap,
                 "placement of %zu bytes says a %u-byte layout, %u blocks and a %u-byte blob", len,
                 lc_len, pl->n_blocks, pl->blob_len);
        return false;
    }
    const kv_status st = kv_layout_config_decode(buf + PLACE_FIXED, lc_len, &pl->lc);
    if (st != KV_OK) {
        snprintf(why, why_cap, "its layout config: %s: %s", kv_status_name(st), kv_last_error());
        return false;
    }
    const unsigned char *ids = buf + PLACE_FIXED + lc_len;
    for (uint32_t i = 0; i < pl->n_blocks; i++)
        blocks[i] = le32_get(ids + 4 * (size_t)i);
    pl->blocks = blocks;
    pl->blob = pl->blob_len ? ids + 4 * (size_t)pl->n_blocks : NULL;
    return true;
}

static uint32_t ceil_div(uint64_t a, uint64_t b)
{
    return (uint32_t)((a + b - 1) / b);
}

/* Prefill's side of a placement: decode's layout rebuilt from the config
 * the message carried (kv_layout_config_decode has already matched its
 * fingerprint against the one decode recorded), the request agreeing with
 * prefill's own batch. *lo out. */
bool place_accept(const struct placement *pl, const struct request *reqs, uint32_t n_req,
                  struct kv_layout *lo)
{
    if (!check(pl->req < n_req && pl->group < N_GROUPS && pl->n_tokens == reqs[pl->req].n_tokens,
               "placement for request %u (group %u, %" PRIu64 " tokens) does not match the batch",
               pl->req, pl->group, pl->n_tokens))
        return false;
    const kv_status st = kv_layout_init(&pl->lc, lo);
    if (!check(st == KV_OK, "request %u: decode's layout config is refused: %s: %s", pl->req,
               kv_status_name(st), kv_last_error()))
        return false;
    return check(pl->n_blocks == ceil_div(pl->n_tokens, (uint64_t)lo->block_tokens),
                 "request %u: %u blocks for %" PRIu64 " tokens of %" PRId64, pl->req, pl->n_blocks,
                 pl->n_tokens, lo->block_tokens);
}
