/*
 * fuzz_unpack.c - libFuzzer target for kv_unpack / kv_pack_inspect of
 * untrusted buffers (connector/pack/kv_pack.h).
 *
 * Input: byte 0 picks the mode (bit 0), K-only (MLA) layouts on both
 * sides (bit 1: k_only, no packing) and, for edits, whether the header's
 * fingerprint is recomputed from its (edited) layout fields (bit 2, before
 * the header reseal: forged layouts reach the checks behind the
 * fingerprint), byte 1 the destination layout (order,
 * arrangement, padding, packing, page size, a head slice) and the layers
 * (bit 7: layer 1 of the source packed alone and unpacked onto layer
 * (byte 1 >> 4) & 1; else every layer), the rest is
 *
 *   mode 0 (raw)     the buffer itself, exactly as received;
 *   mode 1 (edited)  edits to a valid pack of a seeded source request:
 *                    (offset u16, xor u8) triples, then optionally a
 *                    truncation, a resealed header checksum (so the
 *                    field checks behind it are reached) and recomputed
 *                    block checksums (so a forged structure reaches the
 *                    copy).
 *
 * The buffer lives in a malloc of its exact length (ASan sees any read past
 * it). After each call:
 *   failure: a known kv_status, a non-empty kv_last_error(); the whole
 *            destination pool bit-identical, except after a block checksum
 *            failure (KV_ERR_CORRUPT, "fails its checksum"): then the pool
 *            is as before with every byte the request writes zero, those
 *            bytes found by kv_plan_copy from a zero block of the buffer's
 *            source format (the listed blocks' unpacked layers and heads);
 *   success: kv_pack_inspect agrees, no byte outside the listed destination
 *            blocks changed, and when the buffer was an unedited pack the
 *            destination equals kv_plan_copy from the source itself.
 * Any violation aborts.
 */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "kv_pack.h"
#include "kv_plan.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define SRC_BLOCKS 12
#define DST_BLOCKS 10
#define FIXED 152 /* the fixed header of pack format version 2 */

static void die(const char *what)
{
    fprintf(stderr, "fuzz_unpack: %s (last error: %s)\n", what, kv_last_error());
    abort();
}

static void layout(int64_t B, int64_t N, int64_t H, unsigned bits, struct kv_layout *out)
{
    struct kv_layout_config c = KV_LAYOUT_CONFIG_INIT;
    c.num_layers = 2;
    c.num_blocks = B;
    c.block_tokens = N;
    c.num_heads = H;
    c.head_dim = 8;
    c.dtype = KV_BF16;
    c.order = (bits & 1) ? KV_ORDER_HND : KV_ORDER_NHD;
    c.arrange = (bits & 2) ? KV_ARRANGE_BLOCK_MAJOR : KV_ARRANGE_LAYER_MAJOR;
    c.block_pad_elems = (bits & 4) ? 8 : 0;
    c.k_only = (bits & 32) != 0;
    c.kv_packed = (bits & 8) != 0 && !c.k_only;
    if (kv_layout_init(&c, out) != KV_OK)
        die("layout");
}

static void fill(unsigned char *p, size_t n, uint64_t seed)
{
    for (size_t i = 0; i < n; i++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        p[i] = (unsigned char)(seed >> 56);
    }
}

static uint64_t rd64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

static void wr64(unsigned char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

/* Bytes of the destination pool that listed blocks may change. */
static void mark_blocks(const struct kv_layout *lo, const uint32_t *ids, uint32_t n,
                        unsigned char *mask)
{
    for (uint32_t i = 0; i < n; i++) {
        struct kv_byte_runs r;
        if (kv_layout_block_runs(lo, ids[i], &r) != KV_OK)
            die("block_runs");
        for (int64_t k = 0; k < r.run_count; k++)
            memset(mask + r.first_offset_bytes + k * r.run_stride_bytes, 1, (size_t)r.run_bytes);
    }
}

/* The pool a checksum failure must leave: before, with every byte a
 * request of info's tokens from info's source (layers and heads as pc)
 * writes into did[0..nd) zero: kv_plan_copy from a cache of one zero block
 * of the source's format, every source id 0. */
static void zeroed_ref(const struct kv_pack_info *info, const struct kv_layout *dlo,
                       const struct kv_plan_config *pc, const uint32_t *did, uint32_t nd,
                       const unsigned char *before, unsigned char *ref)
{
    struct kv_layout_config c;
    struct kv_layout zlo;
    if (kv_layout_config_from(&info->source, &c) != KV_OK)
        die("zero source config");
    c.num_blocks = 1;
    if (kv_layout_init(&c, &zlo) != KV_OK)
        die("zero source layout");
    unsigned char *z = calloc(1, (size_t)zlo.total_bytes);
    uint32_t *sid = calloc(info->n_blocks ? info->n_blocks : 1, sizeof(*sid));
    kv_plan *p = NULL;
    if (!z || !sid || kv_plan_create(&zlo, dlo, pc, &p) != KV_OK)
        die("zero reference plan");
    memcpy(ref, before, (size_t)dlo->total_bytes);
    struct kv_paged_cache zc = {zlo, z, (size_t)zlo.total_bytes, KV_MEM_HOST};
    struct kv_paged_cache rc = {*dlo, ref, (size_t)dlo->total_bytes, KV_MEM_HOST};
    if (kv_plan_copy(p, zc, sid, info->n_blocks, rc, did, nd, info->n_tokens) != KV_OK)
        die("zero reference copy");
    kv_plan_destroy(p);
    free(sid);
    free(z);
}

/* The header's fingerprint recomputed from the layout fields it records
 * (anyone can: a forged layout then reaches every check behind the
 * fingerprint; an audit found a payload size that wrapped 64 bits there). */
static void refingerprint(unsigned char *b)
{
    struct kv_layout_config c = KV_LAYOUT_CONFIG_INIT;
    c.num_layers = (int64_t)rd64(b + 56);
    c.num_blocks = (int64_t)rd64(b + 64);
    c.block_tokens = (int64_t)rd64(b + 72);
    c.num_heads = (int64_t)rd64(b + 80);
    c.head_dim = (int64_t)rd64(b + 88);
    c.dtype = (kv_dtype)(b[96] | b[97] << 8);
    c.order = (kv_order)(b[100] | b[101] << 8);
    c.arrange = (kv_arrange)(b[104] | b[105] << 8);
    c.kv_packed = b[108] == 1;
    c.k_only = b[108] == 2;
    c.block_stride_bytes = (int64_t)rd64(b + 112);
    c.align_bytes = (int64_t)rd64(b + 120);
    struct kv_layout lo;
    if (kv_layout_init(&c, &lo) == KV_OK)
        wr64(b + 48, lo.fingerprint);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 2)
        return 0;
    const unsigned mode = data[0] % 2, dsel = data[1], konly = data[0] & 2 ? 32u : 0u;
    const bool refp = (data[0] & 4) != 0;
    data += 2;
    size -= 2;
    /* the source every edited buffer starts from: 4 heads, N 8, NHD padded layer-major */
    struct kv_layout slo, dlo;
    layout(SRC_BLOCKS, 8, 4, 4 | konly, &slo);
    static const int64_t dN[4] = {4, 8, 16, 8};
    const bool slice = (dsel & 0x40) != 0;
    layout(DST_BLOCKS, dN[(dsel >> 4) & 3], slice ? 2 : 4, (dsel & 15) | konly, &dlo);
    struct kv_plan_config pc = KV_PLAN_CONFIG_INIT;
    if (slice) {
        pc.src_head0 = 2; /* heads 2..3 of the source onto 0..1 */
        pc.n_heads = 2;
    }
    if (dsel & 0x80) { /* layer 1 of 2 onto layer 0 or 1: one config for both ends */
        pc.src_layer0 = 1;
        pc.dst_layer0 = (dsel >> 4) & 1;
        pc.n_layers = 1;
    }
    unsigned char *smem = malloc((size_t)slo.total_bytes);
    unsigned char *dmem = malloc((size_t)dlo.total_bytes);
    unsigned char *before = malloc((size_t)dlo.total_bytes);
    unsigned char *mask = calloc(1, (size_t)dlo.total_bytes);
    if (!smem || !dmem || !before || !mask)
        die("malloc");
    fill(smem, (size_t)slo.total_bytes, 1);
    fill(dmem, (size_t)dlo.total_bytes, 2);
    memcpy(before, dmem, (size_t)dlo.total_bytes);
    struct kv_paged_cache src = {slo, smem, (size_t)slo.total_bytes, KV_MEM_HOST};
    struct kv_paged_cache dst = {dlo, dmem, (size_t)dlo.total_bytes, KV_MEM_HOST};
    const uint64_t T = 21; /* 3 source blocks of 8 */
    const uint32_t sid[3] = {11, 4, 7};
    const uint32_t did_all[6] = {9, 2, 5, 0, 7, 3};
    unsigned char *buf = NULL;
    size_t len = 0;
    bool pristine = false;
    if (mode == 0) {
        len = size;
        buf = malloc(len ? len : 1);
        if (!buf)
            die("malloc");
        memcpy(buf, data, len);
    } else {
        uint64_t need = 0;
        if (kv_pack_size(&slo, &pc, T, &need) != KV_OK)
            die("pack_size");
        buf = malloc((size_t)need);
        if (!buf || kv_pack(NULL, src, sid, 3, T, buf, (size_t)need, &len, &pc) != KV_OK)
            die("pack");
        size_t i = 0;
        const uint8_t flags = size ? data[i++] : 0;
        unsigned edits = 0;
        while (i + 3 <= size && edits < 16) {
            const size_t at = (size_t)(data[i] | data[i + 1] << 8) % len;
            buf[at] ^= data[i + 2] ? data[i + 2] : 1;
            i += 3;
            edits++;
        }
        const uint32_t nb =
            (uint32_t)(buf[40] | buf[41] << 8 | buf[42] << 16 | (uint32_t)buf[43] << 24);
        const uint64_t sum_at = FIXED + 8 * (uint64_t)nb, hdr = rd64(buf + 16);
        if ((flags & 2) && nb == 3 && hdr + 3 * rd64(buf + 128) <= len && hdr <= len &&
            rd64(buf + 128) <= len)
            for (uint32_t k = 0; k < 3; k++) /* recompute block checksums */
                wr64(buf + FIXED + 8 * k,
                     XXH3_64bits(buf + hdr + k * rd64(buf + 128), (size_t)rd64(buf + 128)));
        if (refp && len >= FIXED) /* the fingerprint of the (edited) layout in the header */
            refingerprint(buf);
        if ((flags & 1) && sum_at + 8 <= len)
            wr64(buf + sum_at, XXH3_64bits(buf, (size_t)sum_at));
        if (flags & 4)
            len = (size_t)(flags >> 3) * len / 32;
        pristine = edits == 0 && !(flags & 4);
    }
    const uint64_t Nd = (uint64_t)dlo.block_tokens;
    /* the destination list the buffer's token count asks for, when it fits */
    struct kv_pack_info info;
    uint32_t nd = 0;
    kv_status ist = kv_pack_inspect(buf, len, &info);
    if (ist == KV_OK) {
        const uint64_t want = info.n_tokens / Nd + (info.n_tokens % Nd != 0);
        nd = want <= 6 ? (uint32_t)want : 6;
    }
    kv_status st = kv_unpack(NULL, buf, len, dst, did_all, nd, &pc);
    if (st == KV_OK) {
        if (ist != KV_OK)
            die("kv_unpack accepted what kv_pack_inspect refused");
        mark_blocks(&dlo, did_all, nd, mask);
        for (int64_t i = 0; i < dlo.total_bytes; i++)
            if (!mask[i] && dmem[i] != before[i])
                die("a byte outside the destination blocks changed");
        if (pristine) {
            unsigned char *ref = malloc((size_t)dlo.total_bytes);
            kv_plan *p = NULL;
            if (!ref || kv_plan_create(&slo, &dlo, &pc, &p) != KV_OK)
                die("reference plan");
            memcpy(ref, before, (size_t)dlo.total_bytes);
            struct kv_paged_cache rc = {dlo, ref, (size_t)dlo.total_bytes, KV_MEM_HOST};
            if (kv_plan_copy(p, src, sid, 3, rc, did_all, nd, T) != KV_OK)
                die("reference copy");
            if (memcmp(ref, dmem, (size_t)dlo.total_bytes) != 0)
                die("unpack differs from kv_plan_copy of the same request");
            kv_plan_destroy(p);
            free(ref);
        }
    } else {
        if (st >= 0 || !kv_status_name(st) || kv_last_error()[0] == '\0')
            die("a refusal without a known status or a message");
        if (st == KV_ERR_CORRUPT && strstr(kv_last_error(), "fails its checksum")) {
            if (ist != KV_OK)
                die("a checksum refusal of a buffer kv_pack_inspect refused");
            /* the exact reference copies from a one-block cache of the
             * source's format: a forged source of billions of layers (one
             * of them packed) has no such cache here; then every byte
             * outside the listed blocks unchanged */
            if (info.source.total_bytes / info.source.num_blocks <= ((int64_t)64 << 20)) {
                unsigned char *ref = malloc((size_t)dlo.total_bytes);
                if (!ref)
                    die("malloc");
                zeroed_ref(&info, &dlo, &pc, did_all, nd, before, ref);
                if (memcmp(ref, dmem, (size_t)dlo.total_bytes) != 0)
                    die("a checksum refusal left other than the request's bytes zeroed");
                free(ref);
            } else {
                mark_blocks(&dlo, did_all, nd, mask);
                for (int64_t i = 0; i < dlo.total_bytes; i++)
                    if (!mask[i] && dmem[i] != before[i])
                        die("a checksum refusal changed a byte outside the destination blocks");
            }
        } else if (memcmp(before, dmem, (size_t)dlo.total_bytes) != 0) {
            die("a refused unpack changed the destination");
        }
        if (pristine && nd > 0)
            die("an unedited pack was refused");
    }
    free(buf);
    free(smem);
    free(dmem);
    free(before);
    free(mask);
    return 0;
}
