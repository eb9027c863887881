/*
 * kv_pack_int.h - the bulk copies of the local data path (pack, unpack, the
 * offload tier's store and load, kv_plan_copy), shared by connector/pack,
 * connector/offload and connector/plan. Module-private: not installed.
 *
 * Two things a plain memcpy of each row does not do:
 *  - non-temporal stores for large moves: a call that moves at least
 *    kv__pack_nt_min_bytes writes around the cache (SSE2 streaming stores),
 *    so the destination is not read for ownership first and the source's
 *    lines are not evicted by the destination's; its bytes are past the
 *    last-level cache anyway by the time anyone reads them;
 *  - one pass for copy + checksum: each row is taken in pieces of
 *    KV__PACK_PIECE bytes that are read once from memory into an L1-sized
 *    buffer, hashed there and written from there, so the hash covers exactly
 *    the bytes written even if the source changes meanwhile.
 */
#ifndef KV_PACK_INT_H
#define KV_PACK_INT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kv_plan_int.h"

/* Bytes hashed and copied per step of kv__pack_copy_hash (L1-resident). */
#define KV__PACK_PIECE 4096

/* Rows up to this wide (a layout conversion's head rows) are written by
 * kv__pack_copy_hash_src across a chunk's copies in destination order, or
 * (copies of another shape) in one loop per run of whole rows, streamed,
 * not one call each. */
#define KV__PACK_ROW_RUN 1024

/* How far ahead kv__pack_copy_hash asks for its source: every line of the
 * plan's rows up to this many bytes past the piece being copied is
 * prefetched into L2, a line per 64 bytes copied (16 KiB by default;
 * docs/benchmarks.md has the measurements). */
extern int64_t kv__pack_prefetch_bytes;
/* Only the first this many bytes of a row are prefetched (128 KiB): the
 * hardware prefetchers stream the rest of a longer row faster alone. */
extern int64_t kv__pack_prefetch_row_bytes;

/* A call moving at least this many bytes uses non-temporal stores (8 MiB by
 * default: past what one core's share of a last-level cache keeps; a
 * smaller move stays in cache for the reader that usually follows).
 * Tests lower it to reach the streaming path with small pools; set it only
 * while no pack, unpack or offload op runs. */
extern uint64_t kv__pack_nt_min_bytes;

/* True when a call moving `bytes` should stream its stores. */
static inline bool kv__pack_use_nt(uint64_t bytes)
{
    return bytes >= kv__pack_nt_min_bytes;
}

/* memcpy with non-temporal stores for the 16-byte-aligned middle of dst
 * (plain stores for the edges; plain memcpy where SSE2 is absent). The
 * caller calls kv__pack_nt_fence before another thread may read dst. */
void kv__pack_copy_nt(char *dst, const char *src, size_t n);

/* src to dst as kv__pack_copy_nt, and the same bytes to keep (plain
 * stores): each 64 bytes of the middle loaded once into registers, then
 * stored to both, so keep holds exactly what dst was given however src
 * changes meanwhile. */
void kv__pack_copy_keep_nt(char *dst, char *keep, const char *src, size_t n);

/* How kv__pack_copy_hash streams the pieces of a row of KV__PACK_PIECE
 * bytes or more: 1, fused (each piece read from the source once, written
 * to the destination and to the L1 buffer in the same pass, then hashed
 * there); 0, staged (read into the L1 buffer, hashed, then streamed from
 * it: three passes over L1); -1 (default), fused on Intel CPUs, staged
 * elsewhere. Shorter rows are always staged. Both hash exactly the bytes
 * written. On the Intel Xeon host fused packed 1.1x the bytes of staged
 * (32 KiB rows) but lost 20% on 2 KiB rows; the AMD EPYC hosts were
 * measured only with staged (docs/benchmarks.md). Set only while no pack,
 * unpack or offload op runs. */
extern int kv__pack_fused_nt;

/* Order this thread's streaming stores before its later stores (sfence). */
void kv__pack_nt_fence(void);

/* Execute a plan of one block to one block from block src to block dst on
 * this thread and return the XXH3-64 of the bytes written, in the order
 * the plan's rows take them, in one read of the source: each piece is read
 * into an L1 buffer, hashed there and written from there (streaming stores
 * when nt; or, kv__pack_fused_nt, written and kept in one pass, then
 * hashed), the source kv__pack_prefetch_bytes ahead asked into L2
 * meanwhile. For a plan that writes its destination front to back
 * (kv__plan_is_sequential: pack, the offload store) that is the hash of
 * the destination block; for one that reads its source front to back
 * (kv__pack_reads_sequential) the hash of the source block. */
uint64_t kv__pack_copy_hash(const kv_plan *plan, const char *src, char *dst, bool nt);

/* True when plan moves one block to one block (a window of 1 + 1) and
 * reads the source block front to back without gaps, total bytes in all:
 * every byte of a compact source image (an unpack's payload block) is read
 * once, in order. */
bool kv__pack_reads_sequential(const kv_plan *plan, int64_t total);

/* Bytes of a source block kv__pack_copy_hash_src hashes before writing
 * them (64 KiB: L2-resident on every core these machines have). */
extern int64_t kv__pack_src_chunk_bytes;

/* Execute a plan that reads its source block front to back
 * (kv__pack_reads_sequential(plan, total)) from block src to block dst on
 * this thread and return the XXH3-64 of the source block's total bytes,
 * reading them from memory once: each chunk of kv__pack_src_chunk_bytes is
 * hashed, then the parts of the plan's rows it holds are written from it
 * while it is in cache (streaming stores when nt), however narrow the rows
 * (a conversion's head rows). The source must not change during the call
 * (the bytes written are read a second time, from cache). */
uint64_t kv__pack_copy_hash_src(const kv_plan *plan, const char *src, char *dst, int64_t total,
                                bool nt);

/* Zero every byte the request (n_src source blocks, n_dst destination
 * blocks at dst_blk[], n_tokens tokens) would write through plan, and
 * nothing else: the unpacked layers and heads of each destination block,
 * as kv__pack_exec would have written them. This thread only. */
void kv__pack_zero(const kv_plan *plan, char *const *dst_blk, uint32_t n_src, uint32_t n_dst,
                   uint64_t n_tokens);

/* The CPU executor of a plan on block start addresses (nothing checked:
 * source block i of the request starts at src_blk[i], destination block j
 * at dst_blk[j]; kv_plan_copy, unpack, the offload tier): the rows written
 * by streaming stores when nt (rows of 256 bytes and more) and, when
 * reverse, the items taken last to first (an unpack copies the payload it
 * verified last first: that part is still in cache). threads <= 0:
 * kv_threads() when the request moves 256 KiB or more, else 1. */
void kv__pack_exec(const kv_plan *plan, const char *const *src_blk, uint32_t n_src,
                   char *const *dst_blk, uint32_t n_dst, uint64_t n_tokens, int threads, bool nt,
                   bool reverse);

#endif /* KV_PACK_INT_H */
