/*
 * kv_offload_carve.c - the offload tier's region carver (kv_offload_int.h):
 * a jemalloc arena with extent hooks confined to the region, or, in
 * sanitizer builds (KV_USE_LIBC_MALLOC), a first-fit free list.
 */
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "kv_lib.h"
#include "kv_mem.h"
#include "kv_offload_int.h"

#if !defined(KV_USE_LIBC_MALLOC)

#include <jemalloc/jemalloc.h>

/* The hooks' state. hooks first: jemalloc passes &hooks back to each hook.
 *   base <= next <= end; [base, next) handed to jemalloc, never returned. */
struct kv__carver {
    extent_hooks_t hooks;
    pthread_mutex_t mu; /* guards next */
    char *base, *next, *end;
    unsigned arena;
    /* what a piece of size class n takes of the region: n, and a page more
     * for a large class (n >= large_min) where jemalloc randomizes a large
     * piece's offset within a page (opt.cache_oblivious): measured, 1,000
     * pieces of 16 KiB take 20 KiB each, of 32 KiB 36 KiB */
    size_t large_min, large_pad;
};

static void *hook_alloc(extent_hooks_t *h, void *new_addr, size_t size, size_t alignment,
                        bool *zero, bool *commit, unsigned arena_ind)
{
    (void)arena_ind;
    struct kv__carver *c = (struct kv__carver *)h;
    if (alignment == 0)
        alignment = 1;
    pthread_mutex_lock(&c->mu);
    uintptr_t p = ((uintptr_t)c->next + (alignment - 1)) & ~(uintptr_t)(alignment - 1);
    /* new_addr: jemalloc asks to extend in place; only the bump point can be */
    if ((new_addr && (uintptr_t)new_addr != p) || p < (uintptr_t)c->next || p > (uintptr_t)c->end ||
        size > (uintptr_t)c->end - p) {
        pthread_mutex_unlock(&c->mu);
        return NULL; /* exhausted: refuse, never fall back to the OS */
    }
    c->next = (char *)(p + size);
    pthread_mutex_unlock(&c->mu);
    if (*zero)
        memset((void *)p, 0, size);
    *commit = true;
    return (void *)p;
}

/* true = refused: jemalloc keeps the extent (retained) and reuses it */
static bool hook_dalloc(extent_hooks_t *h, void *addr, size_t size, bool committed,
                        unsigned arena_ind)
{
    (void)h, (void)addr, (void)size, (void)committed, (void)arena_ind;
    return true;
}

/* arena.<i>.destroy: the region is freed as a whole by the tier */
static void hook_destroy(extent_hooks_t *h, void *addr, size_t size, bool committed,
                         unsigned arena_ind)
{
    (void)h, (void)addr, (void)size, (void)committed, (void)arena_ind;
}

/* the region is always committed: commit succeeds, decommit refuses */
static bool hook_commit(extent_hooks_t *h, void *addr, size_t size, size_t offset, size_t length,
                        unsigned arena_ind)
{
    (void)h, (void)addr, (void)size, (void)offset, (void)length, (void)arena_ind;
    return false;
}

static bool hook_refuse(extent_hooks_t *h, void *addr, size_t size, size_t offset, size_t length,
                        unsigned arena_ind)
{
    (void)h, (void)addr, (void)size, (void)offset, (void)length, (void)arena_ind;
    return true; /* decommit / purge: refused, the pages stay as they are */
}

static bool hook_split(extent_hooks_t *h, void *addr, size_t size, size_t size_a, size_t size_b,
                       bool committed, unsigned arena_ind)
{
    (void)h, (void)addr, (void)size, (void)size_a, (void)size_b, (void)committed, (void)arena_ind;
    return false;
}

static bool hook_merge(extent_hooks_t *h, void *addr_a, size_t size_a, void *addr_b, size_t size_b,
                       bool committed, unsigned arena_ind)
{
    (void)h, (void)addr_a, (void)size_a, (void)addr_b, (void)size_b, (void)committed,
        (void)arena_ind;
    return false; /* both pieces are in the region: one extent is fine */
}

kv_status kv__carver_create(void *base, size_t bytes, kv__carver **out)
{
    struct kv__carver *c = kv__mem_calloc(1, sizeof(*c));
    if (!c)
        return kv__error(KV_ERR_NO_MEMORY, "offload carver: %zu bytes", sizeof(*c));
    c->hooks = (extent_hooks_t){hook_alloc,  hook_dalloc, hook_destroy, hook_commit, hook_refuse,
                                hook_refuse, hook_refuse, hook_split,   hook_merge};
    pthread_mutex_init(&c->mu, NULL);
    c->base = c->next = base;
    c->end = (char *)base + bytes;
    extent_hooks_t *hp = &c->hooks;
    size_t sz = sizeof(c->arena);
    int e = mallctl("arenas.create", &c->arena, &sz, &hp, sizeof(hp));
    bool oblivious = true; /* jemalloc's default; counted as on if unreadable */
    size_t page = 4096, bsz = sizeof(oblivious), psz = sizeof(page), lsz = sizeof(c->large_min);
    (void)mallctl("opt.cache_oblivious", &oblivious, &bsz, NULL, 0);
    (void)mallctl("arenas.page", &page, &psz, NULL, 0);
    if (mallctl("arenas.lextent.0.size", &c->large_min, &lsz, NULL, 0) != 0)
        c->large_min = 4 * page; /* jemalloc 5's smallest large class */
    c->large_pad = oblivious ? page : 0;
    if (e != 0) {
        pthread_mutex_destroy(&c->mu);
        kv__mem_free(c);
        return kv__error(KV_ERR_INTERNAL,
                         "offload carver: mallctl(\"arenas.create\") with extent hooks over a "
                         "region of %zu bytes failed (error %d)",
                         bytes, e);
    }
    /* Freed extents go straight to the arena's retained set (decay 0: the
     * purge hooks refuse, so nothing is returned; the pages stay as they
     * are). Retained extents are split exactly and coalesced at once, with
     * no size-ratio limit (dirty ones are not carved below 1/64 of their
     * size). Growth asks for what is needed, not jemalloc's geometric
     * series: a series step is carved from the region for good and its
     * unused tail can serve nothing larger. */
    char name[64];
    ssize_t now = 0;
    size_t grow = 4096;
    snprintf(name, sizeof(name), "arena.%u.dirty_decay_ms", c->arena);
    int e1 = mallctl(name, NULL, NULL, &now, sizeof(now));
    snprintf(name, sizeof(name), "arena.%u.muzzy_decay_ms", c->arena);
    int e2 = mallctl(name, NULL, NULL, &now, sizeof(now));
    snprintf(name, sizeof(name), "arena.%u.retain_grow_limit", c->arena);
    int e3 = mallctl(name, NULL, NULL, &grow, sizeof(grow));
    /* Then the region, less a reserve for the arena's own metadata (extent
     * records, radix-tree nodes: allocated from the region through the same
     * hooks), becomes one retained extent that every piece is carved from:
     * allocated as the largest size classes that fit (a large piece costs
     * its class plus a page), then freed; adjacent retained extents merge. */
    const int flags = MALLOCX_ARENA(c->arena) | MALLOCX_TCACHE_NONE;
    const size_t reserve = ((size_t)4 << 20) + bytes / 128, pad = 4096;
    void *piece[64];
    int np = 0;
    while (!e1 && !e2 && !e3 && np < 64) {
        const size_t used = kv__carver_used(c);
        if (used + reserve + pad + ((size_t)1 << 20) > bytes)
            break;
        const size_t want = bytes - used - reserve - pad;
        size_t n = want;
        while (n > ((size_t)1 << 20) && nallocx(n, flags) > want)
            n -= n / 32;
        void *p = nallocx(n, flags) <= want ? mallocx(n, flags) : NULL;
        if (!p)
            break;
        piece[np++] = p;
    }
    for (int i = 0; i < np; i++)
        dallocx(piece[i], MALLOCX_TCACHE_NONE);
    if (e1 || e2 || e3 || np == 0) {
        kv__carver_destroy(c);
        return kv__error(e1 || e2 || e3 ? KV_ERR_INTERNAL : KV_ERR_INVALID_ARG,
                         "offload carver: a jemalloc arena over a region of %zu bytes: %s", bytes,
                         e1 || e2 || e3 ? "configuring its decay and growth failed"
                                        : "nothing is left beyond the arena's metadata and "
                                          "its reserve: raise slack_bytes");
    }
    *out = c;
    return KV_OK;
}

void kv__carver_destroy(kv__carver *c)
{
    if (!c)
        return;
    char name[64];
    snprintf(name, sizeof(name), "arena.%u.destroy", c->arena);
    (void)mallctl(name, NULL, NULL, NULL, 0);
    pthread_mutex_destroy(&c->mu);
    kv__mem_free(c);
}

void *kv__carver_alloc(kv__carver *c, size_t bytes, size_t align, bool *no_memory)
{
    *no_memory = false; /* the arena's metadata comes from the region too */
    if (bytes == 0)
        return NULL;
    return mallocx(bytes, MALLOCX_ARENA(c->arena) | MALLOCX_TCACHE_NONE | MALLOCX_ALIGN(align));
}

size_t kv__carver_size(kv__carver *c, size_t bytes, size_t align)
{
    if (!bytes)
        return 0;
    const size_t n =
        nallocx(bytes, MALLOCX_ARENA(c->arena) | MALLOCX_TCACHE_NONE | MALLOCX_ALIGN(align));
    return n >= c->large_min ? n + c->large_pad : n;
}

void kv__carver_free(kv__carver *c, void *p)
{
    (void)c;
    if (p)
        dallocx(p, MALLOCX_TCACHE_NONE);
}

size_t kv__carver_used(kv__carver *c)
{
    pthread_mutex_lock(&c->mu);
    const size_t u = (size_t)(c->next - c->base);
    pthread_mutex_unlock(&c->mu);
    return u;
}

const char *kv__carver_name(void)
{
    return "jemalloc-arena";
}

#else /* KV_USE_LIBC_MALLOC: first fit */

/* A segment of the region; the list covers it in address order, without
 * gaps: sum(len) == region bytes; no two adjacent free segments. */
struct seg {
    struct seg *prev, *next;
    uintptr_t at;
    size_t len;
    bool used;
};

struct kv__carver {
    pthread_mutex_t mu; /* guards the list and used */
    struct seg *head;
    size_t used;
};

kv_status kv__carver_create(void *base, size_t bytes, kv__carver **out)
{
    struct kv__carver *c = kv__mem_calloc(1, sizeof(*c));
    struct seg *s = kv__mem_calloc(1, sizeof(*s));
    if (!c || !s) {
        kv__mem_free(c);
        kv__mem_free(s);
        return kv__error(KV_ERR_NO_MEMORY, "offload carver: records");
    }
    pthread_mutex_init(&c->mu, NULL);
    *s = (struct seg){NULL, NULL, (uintptr_t)base, bytes, false};
    c->head = s;
    *out = c;
    return KV_OK;
}

void kv__carver_destroy(kv__carver *c)
{
    if (!c)
        return;
    for (struct seg *s = c->head, *n; s; s = n) {
        n = s->next;
        kv__mem_free(s);
    }
    pthread_mutex_destroy(&c->mu);
    kv__mem_free(c);
}

/* a new segment [at, at + len) after s (free) */
static struct seg *seg_after(struct seg *s, uintptr_t at, size_t len)
{
    struct seg *n = kv__mem_calloc(1, sizeof(*n));
    if (!n)
        return NULL;
    *n = (struct seg){s, s->next, at, len, false};
    if (s->next)
        s->next->prev = n;
    s->next = n;
    return n;
}

void *kv__carver_alloc(kv__carver *c, size_t bytes, size_t align, bool *no_memory)
{
    *no_memory = false;
    if (bytes == 0)
        return NULL;
    if (align == 0)
        align = 1;
    void *out = NULL;
    pthread_mutex_lock(&c->mu);
    for (struct seg *s = c->head; s; s = s->next) {
        if (s->used)
            continue;
        const uintptr_t p = (s->at + (align - 1)) & ~(uintptr_t)(align - 1);
        const size_t pad = (size_t)(p - s->at);
        if (pad > s->len || bytes > s->len - pad)
            continue;
        struct seg *u = s;
        if (pad) { /* leading free piece stays s; the piece at p follows it */
            u = seg_after(s, p, s->len - pad);
            if (!u) {
                *no_memory = true;
                break;
            }
            s->len = pad;
        }
        if (u->len > bytes) {
            if (!seg_after(u, p + bytes, u->len - bytes)) {
                *no_memory = true;
                if (u != s) { /* undo the leading split */
                    s->len += u->len;
                    s->next = u->next;
                    if (u->next)
                        u->next->prev = s;
                    kv__mem_free(u);
                }
                break;
            }
            u->len = bytes;
        }
        u->used = true;
        c->used += bytes;
        out = (void *)p;
        break;
    }
    pthread_mutex_unlock(&c->mu);
    return out;
}

size_t kv__carver_size(kv__carver *c, size_t bytes, size_t align)
{
    (void)c; /* a piece is the bytes asked after up to align - 1 of padding: counted whole
                (1-byte staging buffers of 4 KiB alignment each take a page) */
    return align > 1 ? (bytes + align - 1) / align * align : bytes;
}

/* merge b into a (a->next == b, both free) */
static void seg_merge(struct seg *a, struct seg *b)
{
    a->len += b->len;
    a->next = b->next;
    if (b->next)
        b->next->prev = a;
    kv__mem_free(b);
}

void kv__carver_free(kv__carver *c, void *p)
{
    if (!p)
        return;
    pthread_mutex_lock(&c->mu);
    struct seg *s = c->head;
    while (s && !(s->used && s->at == (uintptr_t)p))
        s = s->next;
    if (s) {
        s->used = false;
        c->used -= s->len;
        if (s->next && !s->next->used)
            seg_merge(s, s->next);
        if (s->prev && !s->prev->used)
            seg_merge(s->prev, s);
    }
    pthread_mutex_unlock(&c->mu);
}

size_t kv__carver_used(kv__carver *c)
{
    pthread_mutex_lock(&c->mu);
    const size_t u = c->used;
    pthread_mutex_unlock(&c->mu);
    return u;
}

const char *kv__carver_name(void)
{
    return "first-fit";
}

#endif
