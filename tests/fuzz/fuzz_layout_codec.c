/*
 * fuzz_layout_codec.c - libFuzzer target for kv_layout_config_decode of
 * untrusted bytes (kvcache/kv_layout.h, "the config on the wire").
 *
 * Input: byte 0 picks the mode, the rest is
 *
 *   mode 0 (raw)         the buffer itself, exactly as received;
 *   mode 1 (resealed)    the buffer with its checksum recomputed when it is
 *                        long enough to hold one, so the field checks behind
 *                        the checksum are reached;
 *   mode 2 (structured)  the 96 field bytes [16, 112) of a version 1
 *                        encoding, completed here from the documented table:
 *                        magic, version, length, the fingerprint of the
 *                        config those fields describe (read leniently, when
 *                        it builds one), the checksum -- so the success path
 *                        and every field check are reached.
 *
 * The buffer lives in a malloc of its exact length (ASan sees any read past
 * it). The decode is checked against a reference decoder written here from
 * the table in docs/kv-layout.md, not from the library's code:
 *
 *   the library accepts exactly what the reference accepts;
 *   success: the config equals the reference's field by field,
 *            kv_layout_init builds it with the recorded fingerprint, and
 *            kv_layout_config_encode gives back the input bytes (canonical);
 *   failure: KV_ERR_CORRUPT or KV_ERR_MISMATCH, a non-empty
 *            kv_last_error(), *out untouched.
 *
 * A decoded layout then goes where a peer's layout goes: into a plan
 * (kv_plan_create from it to itself, kv_pack_plan_create). One whose rows
 * cannot be counted in 64 bits must be refused by name (KV_ERR_OVERFLOW, or
 * its window first), never built (the 2026-12-05 audit found a wrapped
 * allocation written past); a
 * small one (at most 2^14 rows and 256 KiB) is built and run: blocks
 * 0..n-1 copied into blocks n-1..0 of a second pool, which is compared whole
 * against a reference made with kv_layout_offset (every element moved,
 * every other byte untouched).
 * Any violation aborts.
 */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "kv_layout.h"
#include "kv_pack.h"
#include "kv_plan.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define WIRE 128

static void die(const char *what)
{
    fprintf(stderr, "fuzz_layout_codec: %s (last error: %s)\n", what, kv_last_error());
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
    for (int i = 0; i < n; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

/* The config the fields [16, 112) describe. strict: as the table says
 * (order, arrange, planes in range -- 0 K and V, 1 packed, 2 K only --,
 * reserved zero, the dtype name NUL-padded); lenient: any value read as C
 * would (kv_packed = value == 1, k_only = value == 2,
 * order and arrange as they are, a dtype name followed by anything), which
 * is what mode 2 fingerprints so that a decoder too lenient in one field
 * still reaches the success path and is caught there. */
static bool parse_fields(const unsigned char *b, bool strict, struct kv_layout_config *c)
{
    kv_layout_config_init(c);
    c->num_layers = (int64_t)rd(b + 16, 8);
    c->num_blocks = (int64_t)rd(b + 24, 8);
    c->block_tokens = (int64_t)rd(b + 32, 8);
    c->num_heads = (int64_t)rd(b + 40, 8);
    c->head_dim = (int64_t)rd(b + 48, 8);
    c->block_pad_elems = (int64_t)rd(b + 56, 8);
    c->block_stride_bytes = (int64_t)rd(b + 64, 8);
    c->align_bytes = (int64_t)rd(b + 72, 8);
    const uint64_t order = rd(b + 80, 4), arrange = rd(b + 84, 4), planes = rd(b + 88, 4);
    if (strict && (order > 1 || arrange > 1 || planes > 2 || rd(b + 92, 4) != 0))
        return false;
    c->order = (kv_order)(order & 0xff);
    c->arrange = (kv_arrange)(arrange & 0xff);
    c->kv_packed = planes == 1;
    c->k_only = planes == 2;
    /* the dtype: a name from kv_dtype_name, then zeros to the end of the 16 */
    for (int d = 0; d < KV_DTYPE_COUNT; d++) {
        const char *name = kv_dtype_name((kv_dtype)d);
        const size_t n = strlen(name);
        bool same = memcmp(b + 96, name, n) == 0;
        for (size_t i = n; same && strict && i < 16; i++)
            same = b[96 + i] == 0;
        if (same) {
            c->dtype = (kv_dtype)d;
            return true;
        }
    }
    return false;
}

/* The reference: whether b[0, len) is a valid version 1 encoding, and its
 * config. */
static bool ref_decode(const unsigned char *b, size_t len, struct kv_layout_config *c)
{
    if (len != WIRE || memcmp(b, "KVLAYCFG", 8) != 0 || rd(b + 8, 2) != 1 || rd(b + 10, 2) != 0 ||
        rd(b + 12, 4) != WIRE || rd(b + 120, 8) != XXH3_64bits(b, 120) || !parse_fields(b, true, c))
        return false;
    struct kv_layout lo;
    return kv_layout_init(c, &lo) == KV_OK && lo.fingerprint == rd(b + 112, 8);
}

static void same_config(const struct kv_layout_config *a, const struct kv_layout_config *b)
{
    if (a->struct_size != b->struct_size || a->num_layers != b->num_layers ||
        a->num_blocks != b->num_blocks || a->block_tokens != b->block_tokens ||
        a->num_heads != b->num_heads || a->head_dim != b->head_dim || a->dtype != b->dtype ||
        a->order != b->order || a->arrange != b->arrange || a->kv_packed != b->kv_packed ||
        a->k_only != b->k_only || a->block_pad_elems != b->block_pad_elems ||
        a->block_stride_bytes != b->block_stride_bytes || a->align_bytes != b->align_bytes)
        die("the decoded config differs from the reference's");
}

/* A decoded layout as a peer's: planned to itself (see the header). */
static void exercise_plan(const struct kv_layout *lo)
{
    const int64_t P = lo->k_only ? 1 : 2;
    int64_t rows = 0;
    const bool wraps = __builtin_mul_overflow(lo->num_layers * P, lo->block_tokens, &rows) ||
                       __builtin_mul_overflow(rows, lo->num_heads, &rows) ||
                       (uint64_t)rows > SIZE_MAX / 64 ||
                       __builtin_mul_overflow(rows, lo->head_dim * lo->elem_bytes, &(int64_t){0});
    kv_plan *p = NULL;
    if (wraps) { /* refused (KV_ERR_OVERFLOW, or its window first), never built */
        if (kv_plan_create(lo, lo, NULL, &p) == KV_OK || p || kv_last_error()[0] == '\0')
            die("a plan of more rows than 64 bits hold was not refused by name");
        if (kv_pack_plan_create(lo, NULL, &p) == KV_OK || p || kv_last_error()[0] == '\0')
            die("a pack plan of more rows than 64 bits hold was not refused by name");
        return;
    }
    if (rows > (1 << 14) || lo->total_bytes > (256 << 10))
        return; /* valid but too large to build here, each run */
    const kv_status ps = kv_pack_plan_create(lo, NULL, &p);
    if (ps != KV_OK && kv_last_error()[0] == '\0')
        die("a pack plan refused without a message");
    kv_plan_destroy(p);
    p = NULL;
    const kv_status st = kv_plan_create(lo, lo, NULL, &p);
    if (st != KV_OK) {
        if (p || kv_last_error()[0] == '\0')
            die("a plan refused without a message, or with a plan");
        return; /* a dtype the executors do not handle */
    }
    const size_t bytes = (size_t)lo->total_bytes;
    unsigned char *src = aligned_alloc(64, (bytes + 63) / 64 * 64),
                  *dst = aligned_alloc(64, (bytes + 63) / 64 * 64), *want = malloc(bytes);
    if (!src || !dst || !want)
        die("malloc");
    for (size_t i = 0; i < bytes; i++)
        src[i] = (unsigned char)(i * 131 + 7);
    memset(dst, 0xEE, bytes);
    memcpy(want, dst, bytes);
    const uint32_t n = lo->num_blocks < 4 ? (uint32_t)lo->num_blocks : 4;
    uint32_t sid[4], did[4];
    for (uint32_t i = 0; i < n; i++) {
        sid[i] = i;
        did[i] = (uint32_t)lo->num_blocks - 1 - i;
    }
    for (int64_t l = 0; l < lo->num_layers; l++)
        for (int kv = 0; kv < (int)P; kv++)
            for (uint32_t b = 0; b < n; b++)
                for (int64_t t = 0; t < lo->block_tokens; t++)
                    for (int64_t h = 0; h < lo->num_heads; h++)
                        for (int64_t d = 0; d < lo->head_dim; d++) {
                            int64_t so = 0, dof = 0;
                            if (kv_layout_offset(lo, (uint32_t)l, kv, sid[b], (uint32_t)t,
                                                 (uint32_t)h, (uint32_t)d, &so) != KV_OK ||
                                kv_layout_offset(lo, (uint32_t)l, kv, did[b], (uint32_t)t,
                                                 (uint32_t)h, (uint32_t)d, &dof) != KV_OK)
                                die("kv_layout_offset refused an element of the layout");
                            memcpy(want + dof * lo->elem_bytes, src + so * lo->elem_bytes,
                                   (size_t)lo->elem_bytes);
                        }
    const struct kv_paged_cache cs = {.layout = *lo, .base = src, .storage_bytes = bytes},
                                cd = {.layout = *lo, .base = dst, .storage_bytes = bytes};
    if (kv_plan_copy(p, cs, sid, n, cd, did, n, (uint64_t)n * (uint64_t)lo->block_tokens) != KV_OK)
        die("a plan of a valid layout refused its own blocks");
    if (memcmp(dst, want, bytes) != 0) /* check-test-compares: bytes (the whole pool) */
        die("the plan's copy differs from the reference (whole destination pool)");
    kv_plan_destroy(p);
    free(src);
    free(dst);
    free(want);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    const unsigned mode = data[0] % 3;
    data++;
    size--;
    size_t len = size;
    if (mode == 2)
        len = WIRE;
    unsigned char *buf = malloc(len ? len : 1);
    if (!buf)
        die("malloc");
    if (mode == 2) {
        memset(buf, 0, WIRE);
        memcpy(buf, "KVLAYCFG", 8);
        wr(buf + 8, 1, 2);
        wr(buf + 12, WIRE, 4);
        memcpy(buf + 16, data, size < 96 ? size : 96);
        struct kv_layout_config c;
        struct kv_layout lo;
        if (parse_fields(buf, false, &c) && kv_layout_init(&c, &lo) == KV_OK)
            wr(buf + 112, lo.fingerprint, 8);
        else if (size > 96)
            memcpy(buf + 112, data + 96, size - 96 < 8 ? size - 96 : 8);
        wr(buf + 120, XXH3_64bits(buf, 120), 8);
    } else {
        memcpy(buf, data, len);
        if (mode == 1 && len >= WIRE)
            wr(buf + 120, XXH3_64bits(buf, 120), 8);
    }

    struct kv_layout_config want, out;
    unsigned char before[sizeof(out)]; /* its bytes: a refusal must not write any */
    const bool valid = ref_decode(buf, len, &want);
    memset(&out, 0xA5, sizeof(out));
    memcpy(before, &out, sizeof(out));
    const kv_status st = kv_layout_config_decode(buf, len, &out);
    if (st == KV_OK) {
        if (!valid)
            die("decode accepted what the reference refuses");
        same_config(&out, &want);
        struct kv_layout lo;
        if (kv_layout_init(&out, &lo) != KV_OK)
            die("a decoded config that kv_layout_init refuses");
        if (lo.fingerprint != rd(buf + 112, 8))
            die("a decoded config whose layout has another fingerprint than recorded");
        unsigned char again[WIRE];
        size_t n = 0;
        if (kv_layout_config_encode(&out, again, sizeof(again), &n) != KV_OK || n != WIRE)
            die("a decoded config does not encode");
        if (memcmp(again, buf, WIRE) != 0)
            die("a decoded config encodes to other bytes (not canonical)");
        exercise_plan(&lo);
    } else {
        if (valid)
            die("decode refused what the reference accepts");
        if ((st != KV_ERR_CORRUPT && st != KV_ERR_MISMATCH) || kv_last_error()[0] == '\0')
            die("a refusal without KV_ERR_CORRUPT/KV_ERR_MISMATCH or a message");
        if (memcmp(&out, before, sizeof(out)) != 0) /* check-test-compares: bytes (unwritten) */
            die("a refused decode wrote *out");
    }
    free(buf);
    return 0;
}
