/*
 * kv_layout.h - the KV cache layout: where every K/V element of every layer
 * and block lives (docs/design.md section 2, docs/kv-layout.md).
 *
 * Logical coordinates of one element:
 *
 *     (layer l < L, kv in {0 = K, 1 = V}, block b < B, token n < N,
 *      head h < H, d < D)
 *
 * A `struct kv_layout` is built once from a `struct kv_layout_config` by
 * kv_layout_init(), which checks the config and computes every stride (int64,
 * in elements AND in bytes), the total size and a stable fingerprint. After
 * that the element offset of any coordinate is one dot product:
 *
 *     offset_elems = l*stride_layer + kv*stride_kv + b*stride_block
 *                  + n*stride_token + h*stride_head + d*stride_dim
 *
 * and its address is base + offset_elems * elem_bytes.
 *
 * The physical order is chosen by the config:
 *
 *   arrangement  KV_ARRANGE_LAYER_MAJOR (default)  [L][2][B][block]
 *                KV_ARRANGE_BLOCK_MAJOR            [B][L][2][block]
 *   in-block     KV_ORDER_NHD (default)            block = [N][H][D]
 *                KV_ORDER_HND                      block = [H][N][D]
 *   packed K|V   kv_packed = true: K and V share one block, interleaved in
 *                the content dim of each head row:
 *                    NHD: block = [N][H][2D]   row = K[0..D) V[0..D)
 *                    HND: block = [H][N][2D]
 *                and the "2" plane disappears from the arrangement:
 *                    layer-major [L][B][block], block-major [B][L][block].
 *   K only       k_only = true (MLA latent caches, DeepSeek: one latent row
 *                of D = 576 = 512 latent + 64 rope dims per token and KV
 *                head): one plane, no V; kv_planes = 1, stride_kv = 0, and
 *                every kernel, plan and codec refuses a V tensor or plane:
 *                    layer-major [L][B][block], block-major [B][L][block].
 *                Not with kv_packed.
 *   padding      each block occupies block_stride elements, possibly more
 *                than its natural size (pad elements follow the data and are
 *                never part of a view or a byte run).
 *
 * "Block" in this header always means the storage unit one (layer, kv, block
 * id) occupies -- or one (layer, block id) when kv_packed, since K and V then
 * share it. Its natural size is N*H*D elements (N*H*2D when packed).
 *
 * The layout is a plain value (no pointers, no handle): copy it, pass it to
 * kernels by value, compare fingerprints to refuse mismatched peers.
 * Thread-safe: all functions (they read only their arguments).
 */
#ifndef KV_LAYOUT_H
#define KV_LAYOUT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kv_dtype.h"
#include "kv_status.h"
#include "kv_view.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Order of (token, head) inside a block; head_dim is always innermost. */
typedef enum kv_order {
    KV_ORDER_NHD = 0, /* [N][H][D] (vLLM flash-attn, FlashInfer "NHD") */
    KV_ORDER_HND = 1, /* [H][N][D] (FlashInfer "HND", TRT-LLM) */
} kv_order;

/* Order of (layer, kv, block) around the blocks. */
typedef enum kv_arrange {
    KV_ARRANGE_LAYER_MAJOR = 0, /* [L][2][B][block]: each layer's K (V) is one tensor */
    KV_ARRANGE_BLOCK_MAJOR = 1, /* [B][L][2][block]: one block across all layers is contiguous */
} kv_arrange;

/* Input of kv_layout_init(). Start from kv_layout_config_init() (or
 * KV_LAYOUT_CONFIG_INIT), then set the dims and dtype: zero for every other
 * field means its default (NHD, layer-major, unpacked, unpadded,
 * element-size alignment). struct_size lets the library refuse a config
 * compiled against other headers (KV_ERR_INVALID_ARG naming both sizes)
 * instead of misreading it. */
struct kv_layout_config {
    size_t struct_size;   /* sizeof this struct: set by its _init() or _INIT */
    int64_t num_layers;   /* L >= 1 */
    int64_t num_blocks;   /* B >= 1, <= 2^32 (block ids are uint32); a kv_cache keeps
                             block 0 as its null block: B - 1 usable, B >= 2 there */
    int64_t block_tokens; /* N >= 1, tokens per block (the page size) */
    int64_t num_heads;    /* H >= 1, KV heads */
    int64_t head_dim;     /* D >= 1 */
    kv_dtype dtype;
    kv_order order;
    kv_arrange arrange;
    bool kv_packed; /* K|V interleaved in each head row (see top of file) */

    /* Padding: at most one of the two may be non-zero.
     * block_pad_elems      elements appended after each block (>= 0);
     * block_stride_bytes   explicit distance between consecutive blocks in
     *                      bytes (0 = natural + pad); must be >= the natural
     *                      block size and a multiple of the element size. */
    int64_t block_pad_elems;
    int64_t block_stride_bytes;

    /* Required alignment (bytes, a power of two) of every block start
     * relative to the base pointer; 0 = element size. block_stride_bytes must
     * be a multiple of it. The caller aligns the base itself. */
    int64_t align_bytes;

    /* One plane, K only (MLA latent caches; see the top of the file): no V
     * plane is stored, kv_planes == 1. Refused with kv_packed. */
    bool k_only;
};

/* C initializer: struct kv_layout_config cfg = KV_LAYOUT_CONFIG_INIT; */
#define KV_LAYOUT_CONFIG_INIT                                                                      \
    {                                                                                              \
        .struct_size = sizeof(struct kv_layout_config)                                             \
    }

/* Zero *cfg and set its struct_size (C and C++). */
static inline void kv_layout_config_init(struct kv_layout_config *cfg)
{
    memset(cfg, 0, sizeof(*cfg));
    cfg->struct_size = sizeof(*cfg);
}

/* The computed layout. Every field is derived by kv_layout_init(); treat it
 * as read-only. Invariants:
 *
 *     stride_dim_elems == 1 (unpacked and packed alike)
 *     kv_planes == 1 + !(kv_packed || k_only); stride_kv_elems == 0 when k_only
 *     block_stride_elems >= block_elems,  block_stride_bytes % align_bytes == 0
 *     total_elems == L * kv_planes * B * block_stride_elems
 *     total_bytes == total_elems * elem_bytes
 *     every x_bytes == x_elems * elem_bytes
 */
struct kv_layout {
    /* dims (copied from the config) */
    int64_t num_layers, num_blocks, block_tokens, num_heads, head_dim;
    kv_dtype dtype;
    kv_order order;
    kv_arrange arrange;
    bool kv_packed;
    int64_t elem_bytes;
    int64_t align_bytes;
    int64_t kv_planes; /* 2 unpacked, 1 packed or K only: storage units per (layer, block) */

    /* one block (per layer and plane) */
    int64_t block_elems; /* natural: N*H*D (N*H*2D packed) */
    int64_t block_bytes;
    int64_t block_stride_elems; /* distance between consecutive storage blocks */
    int64_t block_stride_bytes;

    /* the dot product of the header comment */
    int64_t stride_layer_elems, stride_kv_elems, stride_block_elems;
    int64_t stride_token_elems, stride_head_elems, stride_dim_elems;
    int64_t stride_layer_bytes, stride_kv_bytes, stride_block_bytes;
    int64_t stride_token_bytes, stride_head_bytes, stride_dim_bytes;

    int64_t total_elems;
    int64_t total_bytes;

    /* XXH3-64 of a canonical little-endian serialization of every dim,
     * stride, the dtype (name and size), order, arrangement, packing,
     * alignment and page size. Equal fingerprints <=> interchangeable data. */
    uint64_t fingerprint;

    /* XXH3-64 of what one block holds, not where blocks sit: L, N, H, D,
     * dtype, in-block order and K|V packing (not B, padding, alignment or
     * arrangement). Equal values <=> a block of one layout can be moved into
     * the other by relocating byte runs only (no element conversion), as
     * between a prefill and a decode cache with different block counts.
     * Different values: the data needs converting (order, dtype, heads). */
    uint64_t block_format_fingerprint;

    /* K only (copied from the config): one plane, no V (MLA latent caches).
     * Both fingerprints cover it. */
    bool k_only;
};

/* Check cfg and compute *out (written only on success).
 * KV_ERR_NULL        cfg or out NULL.
 * KV_ERR_BAD_SHAPE   a dim <= 0, num_blocks > 2^32, num_layers > 2^32, pad < 0.
 * KV_ERR_INVALID_ARG unknown dtype/order/arrangement; both padding fields set;
 *                    k_only with kv_packed;
 *                    block_stride_bytes not a multiple of the element size or
 *                    of align_bytes; align_bytes not a power of two.
 * KV_ERR_OVERLAP     block_stride_bytes smaller than the natural block.
 * KV_ERR_OVERFLOW    any size or stride in bytes exceeds int64.
 * Each message names the offending values. */
KV_API KV_NODISCARD kv_status kv_layout_init(const struct kv_layout_config *cfg,
                                             struct kv_layout *out);

/* The config that rebuilds exactly lo: kv_layout_init(out) gives a layout
 * equal to *lo field by field, fingerprints included. Every config field is
 * set: dims, dtype, order, arrangement, K|V packing, align_bytes (resolved:
 * never 0), and the padding as block_stride_bytes (0 when unpadded;
 * block_pad_elems is always 0). This is how a layout goes back to a config
 * (to send it: kv_layout_config_encode; to derive a layout from it: change
 * a field and init) instead of copying fields by hand.
 * lo must be what kv_layout_init computed; anything else is refused:
 * KV_ERR_NULL        lo or out NULL.
 * KV_ERR_INVALID_ARG lo's own fields are refused by kv_layout_init, or a
 *                    derived field (a stride, a size, a fingerprint) is not
 *                    what kv_layout_init computes for them (a hand-built or
 *                    corrupted layout): the message names the first field.
 * *out is written only on success. */
KV_API KV_NODISCARD kv_status kv_layout_config_from(const struct kv_layout *lo,
                                                    struct kv_layout_config *out);

/* ---- the config on the wire ------------------------------------------------
 *
 * A config as bytes another process (another build, another host) can
 * rebuild the same layout from: how a decode node tells a prefill node where
 * its blocks live. Little-endian, fixed offsets, a magic, a version, the
 * length, the dtype by name (not by enum value), the fingerprint of the
 * layout the config builds, and an XXH3-64 checksum of everything before it.
 * Version 1, 128 bytes (docs/kv-layout.md, "The config on the wire"):
 *
 *   off  size  field
 *     0     8  magic "KVLAYCFG"
 *     8     2  version (1)
 *    10     2  flags (0: version 1 defines none)
 *    12     4  length of the whole encoding in bytes (128)
 *    16     8  num_layers          i64
 *    24     8  num_blocks          i64
 *    32     8  block_tokens        i64
 *    40     8  num_heads           i64
 *    48     8  head_dim            i64
 *    56     8  block_pad_elems     i64
 *    64     8  block_stride_bytes  i64
 *    72     8  align_bytes         i64 (as given: 0 = element size)
 *    80     4  order               u32 (kv_order: 0 NHD, 1 HND)
 *    84     4  arrange             u32 (kv_arrange: 0 layer-major, 1 block-major)
 *    88     4  planes              u32 (0 K and V, 1 kv_packed, 2 k_only)
 *    92     4  reserved (0)
 *    96    16  dtype name, NUL-padded (kv_dtype_name: "bf16")
 *   112     8  fingerprint of kv_layout_init(config) (kv_layout.fingerprint)
 *   120     8  checksum: XXH3-64 (seed 0) of bytes [0, 120)
 *
 * The encoding is canonical: a config has exactly one, and whatever decodes
 * re-encodes to the same bytes. A later version may be longer; the version
 * and length fields stay where they are. */
#define KV_LAYOUT_CONFIG_WIRE_VERSION 1u
#define KV_LAYOUT_CONFIG_WIRE_BYTES 128u /* version 1's length */

/* Encode cfg into buf[0, cap); *len = the bytes written
 * (KV_LAYOUT_CONFIG_WIRE_BYTES). cfg is checked as kv_layout_init checks
 * it: only a config that builds a layout is encoded.
 * KV_ERR_NULL        cfg or len NULL; buf NULL while cap is large enough.
 * KV_ERR_CAPACITY    cap < KV_LAYOUT_CONFIG_WIRE_BYTES (*len then says how
 *                    many bytes it needs; buf untouched).
 * kv_layout_init's statuses for a config it refuses, with its message.
 * buf is written only on success. */
KV_API KV_NODISCARD kv_status kv_layout_config_encode(const struct kv_layout_config *cfg, void *buf,
                                                      size_t cap, size_t *len);

/* The config encoded in buf[0, len), len being exactly the encoding's length.
 * The bytes are treated as hostile: every length and field is checked before
 * it is used, and the config is validated as kv_layout_init validates it, so
 * kv_layout_init(out) succeeds after a successful decode and builds the
 * layout whose fingerprint the sender recorded.
 * KV_ERR_NULL        buf or out NULL.
 * KV_ERR_MISMATCH    another encoding version (the message names it and the
 *                    version this library reads); a config whose layout
 *                    here has another fingerprint than the one recorded
 *                    (another fingerprint scheme on the sending side).
 * KV_ERR_CORRUPT     naming what: truncated (len shorter than the magic,
 *                    the preamble or the encoding), trailing bytes, the
 *                    magic, the length field, the checksum, flags, reserved
 *                    bytes, order/arrange/planes out of range, a dtype
 *                    name that is not one, or a config kv_layout_init
 *                    refuses (its message, naming the field, follows).
 * *out is written only on success (struct_size set to this build's). */
KV_API KV_NODISCARD kv_status kv_layout_config_decode(const void *buf, size_t len,
                                                      struct kv_layout_config *out);

/* The K (kv = 0) or V (kv = 1) tensor of one layer as a view over
 * (base, storage_bytes): shape [B][N][H][D], strides
 * [stride_block, stride_token, stride_head, stride_dim] in elements,
 * offset layer*stride_layer + kv*stride_kv. Contiguous only for an unpadded,
 * unpacked, layer-major NHD layout; otherwise the strides say how it is not.
 * KV_ERR_NULL (lo/base/out NULL), KV_ERR_OUT_OF_BOUNDS (layer >= L or
 * storage_bytes < total_bytes), KV_ERR_INVALID_ARG (kv not 0 or 1; kv 1 of a
 * K-only layout). */
KV_API KV_NODISCARD kv_status kv_layout_kv_view(const struct kv_layout *lo, void *base,
                                                size_t storage_bytes, uint32_t layer, int kv,
                                                struct kv_view *out);

/* Element offset (from base) of one coordinate, range-checked:
 * KV_ERR_OUT_OF_BOUNDS naming the coordinate and its limit;
 * KV_ERR_INVALID_ARG for kv not 0 or 1, or kv 1 of a K-only layout. */
KV_API KV_NODISCARD kv_status kv_layout_offset(const struct kv_layout *lo, uint32_t layer, int kv,
                                               uint32_t block, uint32_t token, uint32_t head,
                                               uint32_t d, int64_t *out_elems);

/* The unchecked form for inner loops and kernels (coordinates in range). */
static inline int64_t kv_layout_elem_offset(const struct kv_layout *lo, uint32_t layer, int kv,
                                            uint32_t block, uint32_t token, uint32_t head,
                                            uint32_t d)
{
    return (int64_t)layer * lo->stride_layer_elems + (int64_t)kv * lo->stride_kv_elems +
           (int64_t)block * lo->stride_block_elems + (int64_t)token * lo->stride_token_elems +
           (int64_t)head * lo->stride_head_elems + (int64_t)d * lo->stride_dim_elems;
}

/* Where the data of one block id lives across all layers, as byte runs:
 * run i covers [first_offset_bytes + i*run_stride_bytes,
 *               first_offset_bytes + i*run_stride_bytes + run_bytes).
 * Runs hold data only (never padding), in (layer, kv) order: run i is layer
 * i / kv_planes, plane i % kv_planes, each run being one block in its
 * in-block order. Adjacent runs are coalesced when they touch, so:
 *
 *   layer-major, unpacked   2L runs of block_bytes at stride
 *                           B * block_stride_bytes (one 2D copy)
 *   layer-major, packed     L runs (K|V interleaved inside each run)
 *   layer-major, K only     L runs of block_bytes
 *   block-major             one run of kv_planes*L*block_bytes when unpadded;
 *                           kv_planes*L runs at stride block_stride_bytes
 *                           when padded
 *   (any case where run_stride_bytes == run_bytes collapses to one run)
 */
struct kv_byte_runs {
    int64_t first_offset_bytes; /* from base */
    int64_t run_bytes;
    int64_t run_count;
    int64_t run_stride_bytes; /* >= run_bytes (runs never overlap); run_bytes when one run */
};

/* Byte runs of block `block` (KV_ERR_OUT_OF_BOUNDS when block >= B). */
KV_API KV_NODISCARD kv_status kv_layout_block_runs(const struct kv_layout *lo, uint32_t block,
                                                   struct kv_byte_runs *out);

/* "L=32 B=1024 N=16 H=8 D=128 f16 NHD layer-major ... fp=0x..." (snprintf
 * semantics: returns the length it needed). */
KV_API int kv_layout_describe(const struct kv_layout *lo, char *buf, size_t cap);

KV_API const char *kv_order_name(kv_order o);     /* "NHD", "HND", "?" */
KV_API const char *kv_arrange_name(kv_arrange a); /* "layer-major", "block-major", "?" */

#ifdef __cplusplus
}
#endif

#endif /* KV_LAYOUT_H */
