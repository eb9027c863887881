/*
 * kv_pack.h - pack the blocks of a request into one self-describing buffer,
 * and unpack such a buffer into a cache whose layout may differ
 * (docs/connector.md "Pack and unpack", where the format is given byte by
 * byte).
 *
 * A packed buffer is a header followed by a payload:
 *
 *   header   magic, version, sizes, the request's token and block counts,
 *            the complete source layout (every field kv_layout_init needs)
 *            and its fingerprint, the packed layer range, an XXH3-64
 *            checksum per block, and an XXH3-64 checksum of the header
 *            itself; all little-endian, padded with zeros to a multiple of
 *            64 bytes.
 *   payload  the blocks in request order, each one contiguous: the source's
 *            own in-block format (order, K|V packing, dtype) without padding,
 *            layer by layer (the packed layers only), K then V - the "wire
 *            layout", a block-major unpadded layout of one block
 *            (kv_pack_wire_layout for every layer).
 *
 * Layer ranges: a pack carries layers [src_layer0, src_layer0 + n_layers)
 * of the source (a struct kv_plan_config; NULL or n_layers 0: every layer),
 * every head. kv_unpack takes the config between the two caches (the same
 * struct: kv_pack reads only src_layer0 and n_layers, so one config serves
 * both ends) and refuses a buffer that carries other layers than its
 * src_layer0 / n_layers name (KV_ERR_MISMATCH), before any write.
 *
 * Packing never converts; unpacking converts to the destination's layout
 * (NHD <-> HND, layer-/block-major, padding, packed K|V, page size, a head
 * range) through a transfer plan (kv_plan.h). kv_unpack checks the header,
 * sizes, layout, fingerprint, layer range and the request before it writes
 * a byte: a truncated, foreign, version-mismatched or mismatched buffer is
 * refused with a message naming what failed, the destination left
 * bit-identical. The payload's block checksums are verified as the payload
 * is copied, in the same read of it: a block that fails its checksum is
 * refused (KV_ERR_CORRUPT, naming the first failing block) and every listed
 * destination block's unpacked layers (the bytes the request writes) are
 * zeroed, so no unverified byte stays visible; nothing else of dst is
 * written. An engine unpacks into blocks it has just allocated and frees
 * them on a failure.
 *
 * Plans: packing moves a source layout into its wire layout, unpacking the
 * wire layout into the destination's layout. Pass a plan built once for the
 * pair (kv_pack_plan_create / kv_unpack_plan_create) to pay nothing per call
 * but the copy; NULL builds one per call (for the Llama-3-8B shape that is
 * a few hundred microseconds).
 *
 * Thread safety: every function reads only its arguments; calls on disjoint
 * destinations may run at once. The CPU work runs on kv_threads()
 * OpenMP threads.
 */
#ifndef KV_PACK_H
#define KV_PACK_H

#include <stddef.h>
#include <stdint.h>

#include "kv_paged.h"
#include "kv_threads.h"
#include "kv_layout.h"
#include "kv_plan.h"
#include "kv_status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KV_PACK_VERSION 2u /* the format this library writes and reads (1: no layer range) */
#define KV_PACK_ALIGN 64u  /* the header is padded to a multiple of this */

/* What a packed buffer's header says (kv_pack_inspect). */
struct kv_pack_info {
    uint32_t version;
    uint32_t n_blocks;       /* blocks in the payload: ceil(n_tokens / source N) */
    uint64_t n_tokens;       /* tokens of the request */
    uint64_t header_bytes;   /* offset of the payload (a multiple of KV_PACK_ALIGN) */
    uint64_t payload_bytes;  /* n_blocks * block_bytes */
    uint64_t total_bytes;    /* header_bytes + payload_bytes: what kv_unpack reads */
    uint64_t block_bytes;    /* one payload block: the packed layers, K and V */
    int64_t src_layer0;      /* the packed layers: [src_layer0, src_layer0 + n_layers) */
    int64_t n_layers;        /*   of the source, 1 <= n_layers <= source L */
    struct kv_layout source; /* the sender's layout, rebuilt and fingerprint-checked */
    struct kv_layout wire;   /* one payload block as a layout (L = n_layers) */
};

/* The wire layout of src: one block (B = 1), block-major, unpadded,
 * element alignment, with src's L, N, H, D, dtype, order and K|V packing.
 * KV_ERR_NULL; KV_ERR_INVALID_ARG for a layout kv_layout_init would not
 * compute (the message names the field). */
KV_API KV_NODISCARD kv_status kv_pack_wire_layout(const struct kv_layout *src,
                                                  struct kv_layout *out);

/* Bytes kv_pack writes for a request of n_tokens tokens of layout src, of
 * the layers cfg names (src_layer0, n_layers; NULL: every layer).
 * KV_ERR_NULL, KV_ERR_INVALID_ARG (layout, a config of another
 * struct_size), KV_ERR_BAD_SHAPE (a layer range outside src, n_layers 0
 * with src_layer0 > 0; the message names the values), KV_ERR_OVERFLOW. */
KV_API KV_NODISCARD kv_status kv_pack_size(const struct kv_layout *src,
                                           const struct kv_plan_config *cfg, uint64_t n_tokens,
                                           uint64_t *out_bytes);

/* The plan kv_pack uses for caches of layout src and the layers cfg names
 * (src -> the wire layout of those layers; NULL: every layer); destroy it
 * with kv_plan_destroy. Errors as kv_pack_size and kv_plan_create. */
KV_API KV_NODISCARD kv_status kv_pack_plan_create(const struct kv_layout *src,
                                                  const struct kv_plan_config *cfg, kv_plan **out);

/* The plan kv_unpack uses for buffers packed from layout src into caches of
 * layout dst, with cfg the config between the two caches as kv_plan_create
 * takes it (heads and layers; NULL: every head and layer): such a plan
 * unpacks buffers carrying layers [src_layer0, +n_layers) of src onto
 * [dst_layer0, +n_layers) of dst. Errors as kv_plan_create. */
KV_API KV_NODISCARD kv_status kv_unpack_plan_create(const struct kv_layout *src,
                                                    const struct kv_layout *dst,
                                                    const struct kv_plan_config *cfg,
                                                    kv_plan **out);

/* Pack blocks[0..n_blocks) of src (a request of n_tokens tokens: token t is
 * in blocks[t / N], so n_blocks == ceil(n_tokens / N)) into buf[0..cap).
 * Blocks move whole (the packed layers of them); a block id may repeat.
 * plan: from kv_pack_plan_create for src's layout, or NULL; the layers are
 * the plan's, else cfg's (src_layer0, n_layers; NULL: every layer; cfg is
 * not read when there is a plan). On success *out_bytes is the packed size.
 * KV_ERR_NULL         out_bytes, buf (cap > 0), blocks (n_blocks > 0) NULL.
 * KV_ERR_INVALID_ARG  src as the kernels refuse it (kv_paged_check,
 *                     CPU-addressable), buf not aligned to the element size,
 *                     blocks not 4-byte aligned, a plan for another layout,
 *                     a config of another struct_size.
 * KV_ERR_BAD_SHAPE    n_blocks other than ceil(n_tokens / N), cfg's layer
 *                     range outside src.
 * KV_ERR_OUT_OF_BOUNDS a block id >= B.
 * KV_ERR_CAPACITY     cap smaller than the packed size (*out_bytes then says
 *                     the size needed; nothing is written).
 * KV_ERR_OVERLAP      buf overlaps src's storage, or the packed bytes would
 *                     overwrite blocks (read while they are written).
 * KV_ERR_NO_MEMORY    the copy schedule could not be allocated.
 * Nothing is written on an error. */
KV_API KV_NODISCARD kv_status kv_pack(const kv_plan *plan, struct kv_paged_cache src,
                                      const uint32_t *blocks, uint32_t n_blocks, uint64_t n_tokens,
                                      void *buf, size_t cap, size_t *out_bytes,
                                      const struct kv_plan_config *cfg);

/* Check a packed buffer's header (not the payload's checksums) and describe
 * it. len may exceed total_bytes (trailing bytes are not read) but must
 * cover the header.
 * KV_ERR_NULL; KV_ERR_MISMATCH (not a kvcache pack: magic; a layout whose
 * fingerprint is not the one recorded); KV_ERR_UNSUPPORTED (another format
 * version, version 1 included); KV_ERR_CORRUPT (truncated header, header
 * checksum, a field out of range or inconsistent with another - a packed
 * layer range outside the source among them -, non-zero padding). Each
 * message names the field and the values. */
KV_API KV_NODISCARD kv_status kv_pack_inspect(const void *buf, size_t len,
                                              struct kv_pack_info *out);

/* Unpack buf[0..len) into dst_blocks[0..n_dst) of dst, converting to dst's
 * layout; n_dst must be ceil(n_tokens / dst N). Heads and layers: cfg as
 * kv_plan_create takes it between the source cache and dst (NULL: every
 * head and every layer; the source and destination counts must then
 * agree); the buffer must carry exactly layers [src_layer0, +n_layers) of
 * its source, which land on [dst_layer0, +n_layers) of dst; dst's other
 * layers are not written. plan: from kv_unpack_plan_create for (the
 * buffer's source layout, dst's layout, cfg), or NULL (cfg is then used).
 * Refusals before any byte of dst is written:
 *   everything kv_pack_inspect refuses;
 *   KV_ERR_CORRUPT      len shorter than total_bytes (truncated payload);
 *   KV_ERR_MISMATCH     a buffer packed with other layers than cfg (or the
 *                       plan) unpacks (the message names both ranges);
 *   KV_ERR_INVALID_ARG  dst as the kernels refuse it, the payload not
 *                       aligned to the element size, dst_blocks not 4-byte
 *                       aligned, a plan for other
 *                       layouts, a dtype the plan cannot move
 *                       (kv_plan_create's refusals);
 *   KV_ERR_BAD_SHAPE    n_dst other than ceil(n_tokens / dst N), a head or
 *                       layer range outside a layout (kv_plan_create's);
 *   KV_ERR_OUT_OF_BOUNDS a block id >= dst B;
 *   KV_ERR_OVERLAP      a destination block listed twice, buf inside dst's
 *                       storage;
 *   KV_ERR_NO_MEMORY    the copy schedule could not be allocated.
 * Refused after the copy, which verifies every block's checksum as it reads
 * the payload:
 *   KV_ERR_CORRUPT      a block whose checksum fails (the message names the
 *                       first one); every byte the request writes - the
 *                       unpacked layers (and heads: cfg's range) of every
 *                       listed destination block - is then zero, and
 *                       nothing else of dst was written. The buffer must not
 *                       change during the call. */
KV_API KV_NODISCARD kv_status kv_unpack(const kv_plan *plan, const void *buf, size_t len,
                                        struct kv_paged_cache dst, const uint32_t *dst_blocks,
                                        uint32_t n_dst, const struct kv_plan_config *cfg);

#ifdef __cplusplus
}
#endif

#endif /* KV_PACK_H */
