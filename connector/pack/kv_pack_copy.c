/*
 * kv_pack_copy.c - the bulk copies of pack, unpack and the offload tier
 * (kv_pack_int.h): streaming stores for large moves, copy + checksum in one
 * read of the source.
 */
#include <omp.h>
#include <string.h>

#include "kv_lib.h"
#include "kv_pack_int.h"
#include "kv_stream.h"
#include "kv_threads.h"

uint64_t kv__pack_nt_min_bytes = (uint64_t)8 << 20;
int64_t kv__pack_src_chunk_bytes = (int64_t)64 << 10;
int64_t kv__pack_prefetch_bytes = (int64_t)16 << 10;
int64_t kv__pack_prefetch_row_bytes = (int64_t)128 << 10;

void kv__pack_copy_nt(char *dst, const char *src, size_t n)
{
#if KV__HAVE_STREAM
    const size_t head = (size_t)(-(uintptr_t)dst & 15);
    if (n < head + 64) {
        memcpy(dst, src, n);
        return;
    }
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    const size_t body = n & ~(size_t)63;
    for (size_t i = 0; i < body; i += 64)
        kv__stream64(dst + i, src + i);
    memcpy(dst + body, src + body, n - body);
#else
    memcpy(dst, src, n);
#endif
}

void kv__pack_copy_keep_nt(char *dst, char *keep, const char *src, size_t n)
{
#if KV__HAVE_STREAM
    const size_t head = (size_t)(-(uintptr_t)dst & 15);
    if (n < head + 64) {
        memcpy(keep, src, n);
        memcpy(dst, keep, n);
        return;
    }
    memcpy(keep, src, head);
    memcpy(dst, keep, head);
    dst += head;
    keep += head;
    src += head;
    n -= head;
    const size_t body = n & ~(size_t)63;
    for (size_t i = 0; i < body; i += 64) {
        const __m128i a = _mm_loadu_si128((const __m128i *)(const void *)(src + i));
        const __m128i b = _mm_loadu_si128((const __m128i *)(const void *)(src + i + 16));
        const __m128i c = _mm_loadu_si128((const __m128i *)(const void *)(src + i + 32));
        const __m128i e = _mm_loadu_si128((const __m128i *)(const void *)(src + i + 48));
        _mm_storeu_si128((__m128i *)(void *)(keep + i), a);
        _mm_storeu_si128((__m128i *)(void *)(keep + i + 16), b);
        _mm_storeu_si128((__m128i *)(void *)(keep + i + 32), c);
        _mm_storeu_si128((__m128i *)(void *)(keep + i + 48), e);
        _mm_stream_si128((__m128i *)(void *)(dst + i), a);
        _mm_stream_si128((__m128i *)(void *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(void *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(void *)(dst + i + 48), e);
    }
    memcpy(keep + body, src + body, n - body);
    memcpy(dst + body, keep + body, n - body);
#else
    memcpy(keep, src, n);
    memcpy(dst, keep, n);
#endif
}

int kv__pack_fused_nt = -1;

/* kv__pack_fused_nt resolved: -1 is 1 on an Intel CPU, else 0. */
static bool use_fused_nt(void)
{
    const int v = kv__pack_fused_nt;
    if (v >= 0)
        return v != 0;
    return kv__cpu_vendor() == KV__CPU_INTEL;
}

void kv__pack_nt_fence(void)
{
    kv__stream_fence();
}

/* The prefetch stream of kv__pack_copy_hash: the next source line to ask
 * for, a, in row (copy i, row y), whose first kv__pack_prefetch_row_bytes
 * end at end; at, the place of a in
 * the plan's row order (the bytes of the rows before it, plus a's offset
 * into its row, from the row's first line). */
struct pf_cursor {
    int64_t i, y, at, row_at;
    uintptr_t a, end;
};

/* Point c at row (i, y) of plan, which starts at row_at in the row order
 * (i == n_copies: the stream is done). */
static inline void pf_row(struct pf_cursor *c, const kv_plan *plan, const char *src, int64_t i,
                          int64_t y, int64_t row_at)
{
    c->i = i;
    c->y = y;
    c->row_at = c->at = row_at;
    if (i >= plan->n_copies)
        return;
    const struct kv__plan_copy *pc = &plan->copies[i];
    const uintptr_t s = (uintptr_t)(src + pc->src_rel + y * pc->src_pitch);
    const int64_t cap = kv__pack_prefetch_row_bytes;
    const int64_t w = pc->width < cap ? pc->width : cap;
    c->a = s & ~(uintptr_t)63;
    c->end = s + (uintptr_t)w;
}

uint64_t kv__pack_copy_hash(const kv_plan *plan, const char *src, char *dst, bool nt)
{
    struct kv__xxh3_state hs;
    kv__xxh3_reset(&hs);
    _Alignas(64) char piece[KV__PACK_PIECE];
    const int64_t dist = kv__pack_prefetch_bytes;
    struct pf_cursor pf;
    pf_row(&pf, plan, src, 0, 0, 0);
    const bool fused = nt && use_fused_nt();
    int64_t done = 0; /* bytes of the plan's rows placed so far */
    for (int64_t i = 0; i < plan->n_copies; i++) {
        const struct kv__plan_copy *c = &plan->copies[i];
        const char *s = src + c->src_rel;
        char *d = dst + c->dst_rel;
        for (int64_t y = 0; y < c->height; y++) {
            const char *sr = s + y * c->src_pitch;
            char *dr = d + y * c->dst_pitch;
            for (int64_t x = 0; x < c->width; x += KV__PACK_PIECE) {
                /* plain stores: the row in one piece, in cache after its copy */
                const int64_t k = !nt                           ? c->width
                                  : c->width - x < KV__PACK_PIECE ? c->width - x
                                                                  : KV__PACK_PIECE;
                /* every source line up to dist bytes past this piece (a
                 * plain-store row: past its first KV__PACK_PIECE bytes) into
                 * L2 while the piece is hashed and written, a line per 64
                 * bytes placed: the rows of a layer-major block (2 KiB to
                 * 128 KiB, scattered) otherwise start with misses the
                 * hardware prefetchers cannot foresee, and they ramp up
                 * inside a row too slowly to keep memory busy. In the
                 * loop, not a helper: gcc drops calls to a function that
                 * only prefetches (no side effect). */
                const int64_t ahead = done + (k < KV__PACK_PIECE ? k : KV__PACK_PIECE) + dist;
                if (pf.at < done) { /* behind, past a plain-store row: from here */
                    pf_row(&pf, plan, src, i, y, done - x);
                    pf.a = (uintptr_t)(sr + x) & ~(uintptr_t)63;
                    pf.at = done;
                }
                while (pf.i < plan->n_copies && pf.at < ahead) {
                    if (pf.a < pf.end) {
                        __builtin_prefetch((const void *)pf.a, 0, 2); /* into L2 */
                        pf.a += 64;
                        pf.at += 64;
                        continue;
                    }
                    const struct kv__plan_copy *pc = &plan->copies[pf.i];
                    const int64_t next_at = pf.row_at + pc->width;
                    if (pf.y + 1 < pc->height)
                        pf_row(&pf, plan, src, pf.i, pf.y + 1, next_at);
                    else
                        pf_row(&pf, plan, src, pf.i + 1, 0, next_at);
                }
                done += k;
                if (!nt) {
                    memcpy(dr, sr, (size_t)k);
                    kv__xxh3_update(&hs, dr, (size_t)k);
                    break;
                }
                if (fused && c->width >= KV__PACK_PIECE) {
                    /* written and kept in one pass, then hashed (rows of a
                     * piece or more: on shorter ones, 2 KiB, it lost 20%) */
                    kv__pack_copy_keep_nt(dr + x, piece, sr + x, (size_t)k);
                    kv__xxh3_update(&hs, piece, (size_t)k);
                    continue;
                }
                memcpy(piece, sr + x, (size_t)k);
                kv__xxh3_update(&hs, piece, (size_t)k);
                kv__pack_copy_nt(dr + x, piece, (size_t)k);
            }
        }
    }
    if (nt)
        kv__pack_nt_fence();
    return kv__xxh3_digest(&hs);
}

bool kv__pack_reads_sequential(const kv_plan *plan, int64_t total)
{
    if (plan->stats.window_src_blocks != 1 || plan->stats.window_dst_blocks != 1)
        return false;
    int64_t at = 0;
    for (int64_t i = 0; i < plan->n_copies; i++) {
        const struct kv__plan_copy *c = &plan->copies[i];
        if (c->src_rel != at || (c->height > 1 && c->src_pitch != c->width))
            return false;
        at += c->width * c->height;
    }
    return at == total;
}

/* n rows of w bytes, back to back at s, to d with pitch dp. Streamed 64
 * bytes at a time when nt and every row is 16-byte aligned and a multiple of
 * 64 bytes (a conversion's head rows), each 64 bytes paired with a prefetch
 * into L2 of the next line of [*pf, pf_end) (the next source chunk: its
 * hash then reads cache while these stores drain); else row by row. */
static void copy_rows(char *d, int64_t dp, const char *s, int64_t w, int64_t n, bool nt,
                      const char **pf, const char *pf_end)
{
#if KV__HAVE_STREAM
    if (nt && w % 64 == 0 && (((uintptr_t)d | (uintptr_t)dp) & 15) == 0) {
        for (int64_t y = 0; y < n; y++, d += dp, s += w)
            for (int64_t i = 0; i < w; i += 64) {
                if (*pf < pf_end) {
                    __builtin_prefetch(*pf, 0, 2);
                    *pf += 64;
                }
                kv__stream64(d + i, s + i);
            }
        return;
    }
#endif
    for (int64_t y = 0; y < n; y++, d += dp, s += w)
        if (nt)
            kv__pack_copy_nt(d, s, (size_t)w);
        else
            memcpy(d, s, (size_t)w);
}

uint64_t kv__pack_copy_hash_src(const kv_plan *plan, const char *src, char *dst, int64_t total,
                                bool nt)
{
    struct kv__xxh3_state hs;
    kv__xxh3_reset(&hs);
    const int64_t chunk = kv__pack_src_chunk_bytes;
    /* the source is the plan's rows back to back: (copy ci, row y, byte x)
     * is the next source byte to place */
    int64_t ci = 0, y = 0, x = 0;
    for (int64_t a = 0; a < total; a += chunk) {
        const int64_t k = total - a < chunk ? total - a : chunk;
        const char *piece = src + a;
        kv__xxh3_update(&hs, piece, (size_t)k); /* from memory into cache */
        const char *pf = piece + k, *pf_end = src + (a + k + chunk < total ? a + k + chunk : total);
        for (int64_t o = 0; o < k;) { /* then its rows, from cache */
            const struct kv__plan_copy *c = &plan->copies[ci];
            /* several whole copies of short rows in this chunk (a layout
             * conversion: one copy per token, a row per head): row 0 of
             * each, then row 1, so the stores run through the destination
             * front to back (HND: one head's rows of consecutive tokens)
             * instead of striding a head pitch apart (NHD -> HND unpack:
             * median 0.87 -> 1.06x memcpy; docs/benchmarks.md) */
            if (x == 0 && y == 0 && c->width <= KV__PACK_ROW_RUN && c->height > 1) {
                const int64_t cb = c->width * c->height;
                int64_t j = ci + 1;
                while (j < plan->n_copies && (j - ci + 1) * cb <= k - o &&
                       plan->copies[j].width == c->width && plan->copies[j].height == c->height &&
                       plan->copies[j].dst_pitch == c->dst_pitch)
                    j++;
                if (j - ci >= 2) {
                    for (int64_t yy = 0; yy < c->height; yy++)
                        for (int64_t q = ci; q < j; q++)
                            copy_rows(dst + plan->copies[q].dst_rel + yy * c->dst_pitch, 0,
                                      piece + o + (q - ci) * cb + yy * c->width, c->width, 1, nt,
                                      &pf, pf_end);
                    o += (j - ci) * cb;
                    ci = j;
                    continue;
                }
            }
            const int64_t whole = x == 0 && c->width <= KV__PACK_ROW_RUN ? (k - o) / c->width : 0;
            /* short rows the grouping leaves, whole ones in a loop, streamed
             * and paired with the prefetch as above: a chunk's split copy,
             * and NHD -> HND's plane edges (the plan merges a plane's last
             * head row with the next plane's first into one 512-byte copy,
             * leaving the copies beside it a row short: 0.81-0.94 instead
             * of 0.92-1.0 with these rows one call each) */
            if (whole > 0) {
                const int64_t r = c->height - y < whole ? c->height - y : whole;
                char *d = dst + c->dst_rel + y * c->dst_pitch;
                copy_rows(d, c->dst_pitch, piece + o, c->width, r, nt, &pf, pf_end);
                o += r * c->width;
                if ((y += r) == c->height) {
                    y = 0;
                    ci++;
                }
                continue;
            }
            const int64_t take = c->width - x < k - o ? c->width - x : k - o;
            char *d = dst + c->dst_rel + y * c->dst_pitch + x;
            if (nt)
                kv__pack_copy_nt(d, piece + o, (size_t)take);
            else
                memcpy(d, piece + o, (size_t)take);
            o += take;
            x += take;
            if (x == c->width) {
                x = 0;
                if (++y == c->height) {
                    y = 0;
                    ci++;
                }
            }
        }
    }
    if (nt)
        kv__pack_nt_fence();
    return kv__xxh3_digest(&hs);
}

void kv__pack_zero(const kv_plan *plan, char *const *dst_blk, uint32_t n_src, uint32_t n_dst,
                   uint64_t n_tokens)
{
    if (n_tokens == 0)
        return;
    const int64_t work = kv__plan_items(plan, n_tokens);
    for (int64_t w = 0; w < work; w++) {
        int64_t si, di;
        const struct kv__plan_copy *cp = kv__plan_item(plan, w, n_src, n_dst, &si, &di);
        if (!cp)
            continue; /* a copy the request does not make */
        char *d = dst_blk[di] + cp->dst_rel;
        for (int64_t y = 0; y < cp->height; y++)
            memset(d + y * cp->dst_pitch, 0, (size_t)cp->width);
    }
}

/* Item w of the request: its rows, streamed when nt and wide enough. */
static void exec_item(const kv_plan *plan, const char *const *src_blk, uint32_t n_src,
                      char *const *dst_blk, uint32_t n_dst, int64_t w, bool nt)
{
    int64_t si, di;
    const struct kv__plan_copy *cp = kv__plan_item(plan, w, n_src, n_dst, &si, &di);
    if (!cp)
        return; /* past the request's last block on one side */
    const char *s = src_blk[si] + cp->src_rel;
    char *d = dst_blk[di] + cp->dst_rel;
    if (nt && cp->width >= 256)
        for (int64_t y = 0; y < cp->height; y++)
            kv__pack_copy_nt(d + y * cp->dst_pitch, s + y * cp->src_pitch, (size_t)cp->width);
    else
        for (int64_t y = 0; y < cp->height; y++)
            memcpy(d + y * cp->dst_pitch, s + y * cp->src_pitch, (size_t)cp->width);
}

/* The i-th item to run: in plan order, or with reverse the windows last to
 * first (each window's copies still in order: the rows of a conversion run
 * forward, as the prefetchers want). */
static inline int64_t item_at(const kv_plan *plan, int64_t work, int64_t i, bool reverse)
{
    if (!reverse)
        return i;
    const int64_t nc = plan->n_copies, win = i / nc;
    return (work / nc - 1 - win) * nc + (i - win * nc);
}

void kv__pack_exec(const kv_plan *plan, const char *const *src_blk, uint32_t n_src,
                   char *const *dst_blk, uint32_t n_dst, uint64_t n_tokens, int threads, bool nt,
                   bool reverse)
{
    if (n_tokens == 0)
        return;
    const struct kv_plan_stats *ps = &plan->stats;
    const int64_t work = kv__plan_items(plan, n_tokens);
    int nth = threads;
    if (nth <= 0)
        nth = (int64_t)n_tokens * ps->window_bytes / ps->window_tokens < ((int64_t)256 << 10)
                  ? 1
                  : kv_threads();
    if (nth == 1) { /* no OpenMP runtime on this path (the offload worker's TSan tests) */
        for (int64_t i = 0; i < work; i++)
            exec_item(plan, src_blk, n_src, dst_blk, n_dst, item_at(plan, work, i, reverse), nt);
        if (nt)
            kv__pack_nt_fence();
        return;
    }
#pragma omp parallel num_threads(nth)
    {
#pragma omp for schedule(static) nowait
        for (int64_t i = 0; i < work; i++)
            exec_item(plan, src_blk, n_src, dst_blk, n_dst, item_at(plan, work, i, reverse), nt);
        if (nt)
            kv__pack_nt_fence();
    }
}
