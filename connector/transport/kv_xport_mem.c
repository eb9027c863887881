/*
 * kv_xport_mem.c - the transport's memory (kv_transport.h, generic layer):
 * registered regions, their exposures per (peer, region) with the blob a
 * peer imports, and imported regions (counted while transfers name them).
 */
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kv_mem.h"
#include "kv_wire.h"
#include "kv_offload_int.h"
#include "kv_xport_int.h"

/* ---- memory --------------------------------------------------------- */

kv_status kv_xport_mem_reg(kv_xport *x, void *base, size_t bytes, enum kv_mem_kind kind,
                           kv_xport_mem **out)
{
    return kv_xport_mem_reg_on(x, base, bytes, kind, KV_XPORT_DEVICE_AUTO, out);
}

kv_status kv_xport_mem_reg_on(kv_xport *x, void *base, size_t bytes, enum kv_mem_kind kind,
                              uint32_t device, kv_xport_mem **out)
{
    if (!x || !base || !out)
        return kv__error(KV_ERR_NULL, "xport_mem_reg: %s is NULL",
                         !x      ? "x"
                         : !base ? "base"
                                 : "out");
    if (bytes == 0)
        return kv__error(KV_ERR_INVALID_ARG, "xport_mem_reg: 0 bytes");
    if ((uintptr_t)base + bytes < (uintptr_t)base)
        return kv__error(KV_ERR_OVERFLOW, "xport_mem_reg: %p + %zu wraps", base, bytes);
    if (kind != KV_MEM_HOST && kind != KV_MEM_PINNED &&
        !(kind == KV_MEM_DEVICE && x->cfg.kind == KV_XPORT_RDMA))
        return kv__error(KV_ERR_UNSUPPORTED,
                         "xport_mem_reg: %s memory on the %s transport (host or pinned only)",
                         kv_mem_kind_name(kind), kv_xport_kind_name(x->cfg.kind));
    if (device != KV_XPORT_DEVICE_AUTO && device != 0 && !x->ops->mem_info)
        return kv__error(KV_ERR_INVALID_ARG,
                         "xport_mem_reg: device %u on the %s transport (one device: 0, or "
                         "KV_XPORT_DEVICE_AUTO)",
                         device, kv_xport_kind_name(x->cfg.kind));
    kv_xport_mem *m = kv__mem_calloc(1, sizeof(*m));
    if (!m)
        return kv__error(KV_ERR_NO_MEMORY, "xport_mem_reg: %zu bytes", sizeof(*m));
    m->x = x;
    m->device = device;
    m->base = base;
    m->bytes = bytes;
    m->kind = kind;
    kv_status st = x->ops->mem_reg(m);
    if (st != KV_OK) {
        kv__mem_free(m);
        return st;
    }
    pthread_mutex_lock(&x->mu);
    m->region = x->next_region++;
    m->next = x->mems;
    x->mems = m;
    pthread_mutex_unlock(&x->mu);
    *out = m;
    return KV_OK;
}

kv_status kv_xport_mem_reg_cache(kv_xport *x, kv_cache *c, kv_xport_mem **out)
{
    if (!x || !c || !out)
        return kv__error(KV_ERR_NULL, "xport_mem_reg_cache: %s is NULL",
                         !x   ? "x"
                         : !c ? "cache"
                              : "out");
    struct kv_mem_region rg;
    size_t n = 0;
    kv_status st = kv_cache_regions(c, &rg, 1, &n);
    if (st != KV_OK)
        return st;
    kv_xport_mem *m = NULL;
    if ((st = kv_xport_mem_reg(x, rg.ptr, rg.bytes, rg.kind, &m)) != KV_OK)
        return st;
    /* before the region can be named by anyone but the caller */
    m->cache = kv_cache_retain(c);
    *out = m;
    return KV_OK;
}

kv_status kv_xport_mem_reg_offload(kv_xport *x, kv_offload *off, kv_xport_mem **out)
{
    if (!x || !off || !out)
        return kv__error(KV_ERR_NULL, "xport_mem_reg_offload: %s is NULL",
                         !x     ? "x"
                         : !off ? "off"
                                : "out");
    struct kv_mem_region rg;
    size_t n = 0;
    kv_status st = kv_offload_regions(off, &rg, 1, &n);
    if (st != KV_OK || (st = kv__offload_region_hold(off)) != KV_OK)
        return st;
    kv_xport_mem *m = NULL;
    if ((st = kv_xport_mem_reg(x, rg.ptr, rg.bytes, rg.kind, &m)) != KV_OK) {
        kv__offload_region_release(off);
        return st;
    }
    m->offload = off;
    *out = m;
    return KV_OK;
}

kv_status kv_xport_mem_reg_arena(kv_xport *x, kv_arena *arena, kv_xport_mem **out)
{
    if (!x || !arena || !out)
        return kv__error(KV_ERR_NULL, "xport_mem_reg_arena: %s is NULL",
                         !x       ? "x"
                         : !arena ? "arena"
                                  : "out");
    struct kv_mem_region rg;
    size_t n = 0;
    kv_status st = kv_arena_regions(arena, &rg, 1, &n);
    if (st != KV_OK)
        return st;
    kv_xport_mem *m = NULL;
    if ((st = kv_xport_mem_reg(x, rg.ptr, rg.bytes, rg.kind, &m)) != KV_OK)
        return st;
    m->arena = kv_arena_retain(arena);
    *out = m;
    return KV_OK;
}

kv_status kv_xport_mem_info_get(kv_xport_mem *mem, struct kv_xport_mem_info *out)
{
    if (!mem || !out)
        return kv__error(KV_ERR_NULL, "xport_mem_info_get: %s is NULL", !mem ? "mem" : "out");
    const kv_status st = kv__check_struct_size("xport_mem_info_get", "kv_xport_mem_info",
                                               out->struct_size, sizeof(*out));
    if (st != KV_OK)
        return st;
    memset(out, 0, sizeof(*out));
    out->struct_size = sizeof(*out);
    out->numa_node = -1;
    out->device_numa_node = -1;
    out->pci_distance = -1;
    kv_xport *x = mem->x;
    pthread_mutex_lock(&x->mu);
    if (x->ops->mem_info)
        x->ops->mem_info(mem, out);
    pthread_mutex_unlock(&x->mu);
    return KV_OK;
}

kv_status kv_xport_mem_dereg(kv_xport_mem *mem)
{
    if (!mem)
        return kv__error(KV_ERR_NULL, "xport_mem_dereg: mem is NULL");
    kv_xport *x = mem->x;
    pthread_mutex_lock(&x->mu);
    if (mem->users) {
        const uint32_t u = mem->users;
        pthread_mutex_unlock(&x->mu);
        return kv__error(KV_ERR_BAD_STATE,
                         "xport_mem_dereg: region %u still used by %u transfer(s) or exposure(s)",
                         mem->region, u);
    }
    /* Off the list while the backend lets go: nothing can take it meanwhile
     * (a user of it would have to name it in a call racing with this one). */
    for (kv_xport_mem **pp = &x->mems; *pp; pp = &(*pp)->next)
        if (*pp == mem) {
            *pp = mem->next;
            break;
        }
    pthread_mutex_unlock(&x->mu);
    const kv_status st = x->ops->mem_dereg(mem);
    if (st != KV_OK) {
        pthread_mutex_lock(&x->mu);
        mem->next = x->mems;
        x->mems = mem;
        pthread_mutex_unlock(&x->mu);
        return st;
    }
    kv_cache_destroy(mem->cache); /* kv_xport_mem_reg_cache's reference; NULL: none */
    if (mem->offload)
        kv__offload_region_release(mem->offload);
    kv_arena_release(mem->arena); /* kv_xport_mem_reg_arena's; NULL: none */
    kv__mem_free(mem);
    return KV_OK;
}

uint64_t kv_xport_mem_bytes(const kv_xport_mem *mem)
{
    return mem ? mem->bytes : 0;
}

uint64_t kv_xport_rmem_bytes(const kv_xport_rmem *rmem)
{
    return rmem ? rmem->bytes : 0;
}

struct kv__xport_expo *kv__xport_exposed(kv_xport_peer *p, uint32_t region, uint64_t off,
                                         uint64_t len)
{
    for (uint32_t i = 0; i < p->n_exposed; i++) {
        struct kv__xport_expo *e = p->exposed[i];
        if (e->mem->region == region)
            return kv__range_ok(e->mem->bytes, off, len) ? e : NULL;
    }
    return NULL;
}

/* mu held: mem's exposure to peer, or NULL (*at: its index). */
static struct kv__xport_expo *expo_find(kv_xport_peer *peer, const kv_xport_mem *mem, uint32_t *at)
{
    for (uint32_t i = 0; i < peer->n_exposed; i++)
        if (peer->exposed[i]->mem == mem) {
            if (at)
                *at = i;
            return peer->exposed[i];
        }
    return NULL;
}

/* mu held: the blob of exposure e to peer into out (cap checked). */
static kv_status blob_make(kv_xport_peer *peer, const struct kv__xport_expo *e, void *out,
                           size_t cap, size_t *len)
{
    const size_t need = KV__XPORT_BLOB_HEAD + e->key_len + 8;
    if (cap < need)
        return kv__error(KV_ERR_CAPACITY, "xport_mem_expose: blob of %zu bytes needs %zu", cap,
                         need);
    struct kv__xport_blob b = {.version = KV_XPORT_PROTOCOL_VERSION,
                               .kind = (uint32_t)peer->x->cfg.kind,
                               .region = e->mem->region,
                               .key_len = e->key_len,
                               .bytes = e->mem->bytes,
                               .exposer = peer->nonce_local,
                               .importer = peer->nonce_remote};
    memcpy(b.key, e->key, e->key_len);
    *len = kv__xport_blob_encode(&b, out);
    return KV_OK;
}

kv_status kv_xport_mem_expose(kv_xport_peer *peer, kv_xport_mem *mem, void *blob, size_t cap,
                              size_t *len)
{
    if (!peer || !mem || !blob || !len)
        return kv__error(KV_ERR_NULL, "xport_mem_expose: %s is NULL",
                         !peer   ? "peer"
                         : !mem  ? "mem"
                         : !blob ? "blob"
                                 : "len");
    kv_xport *x = peer->x;
    if (mem->x != x)
        return kv__error(KV_ERR_INVALID_ARG,
                         "xport_mem_expose: region %u is registered on another transport",
                         mem->region);
    pthread_mutex_lock(&x->mu);
    struct kv__xport_expo *have = expo_find(peer, mem, NULL);
    if (have) { /* exposed already: the same blob again */
        const kv_status st = blob_make(peer, have, blob, cap, len);
        pthread_mutex_unlock(&x->mu);
        return st;
    }
    pthread_mutex_unlock(&x->mu);
    struct kv__xport_expo *e = kv__mem_calloc(1, sizeof(*e));
    if (!e)
        return kv__error(KV_ERR_NO_MEMORY, "xport_mem_expose: an exposure");
    e->mem = mem;
    kv_status st = peer->ops->expose(peer, e);
    if (st != KV_OK) {
        kv__mem_free(e);
        return st;
    }
    pthread_mutex_lock(&x->mu);
    if (peer->state != KV_XPORT_READY || peer->user_closed || expo_find(peer, mem, NULL)) {
        const int s = peer->state;
        const bool dup = expo_find(peer, mem, NULL) != NULL;
        peer->ops->unexpose(peer, e);
        pthread_mutex_unlock(&x->mu);
        kv__mem_free(e);
        if (dup) /* a racing call exposed it first: its blob */
            return kv_xport_mem_expose(peer, mem, blob, cap, len);
        return kv__error(KV_ERR_BAD_STATE, "xport_mem_expose: peer %s (not ready)",
                         s == KV_XPORT_CONNECTING ? "connecting" : "closed");
    }
    st = KV_OK;
    if (peer->n_exposed == peer->cap_exposed) { /* before the blob: nothing written on failure */
        struct kv__xport_expo **t = kv__mem_grow(peer->exposed, &peer->cap_exposed, peer->n_exposed,
                                                 (size_t)peer->n_exposed + 1, sizeof(*t), 4);
        if (!t)
            st = kv__error(KV_ERR_NO_MEMORY, "xport_mem_expose: growing the table of %zu",
                           peer->cap_exposed);
        else
            peer->exposed = t;
    }
    if (st == KV_OK)
        st = blob_make(peer, e, blob, cap, len);
    if (st != KV_OK) {
        peer->ops->unexpose(peer, e);
        pthread_mutex_unlock(&x->mu);
        kv__mem_free(e);
        return st;
    }
    peer->exposed[peer->n_exposed++] = e;
    mem->users++;
    pthread_mutex_unlock(&x->mu);
    return KV_OK;
}

kv_status kv_xport_mem_unexpose(kv_xport_peer *peer, kv_xport_mem *mem)
{
    if (!peer || !mem)
        return kv__error(KV_ERR_NULL, "xport_mem_unexpose: %s is NULL", !peer ? "peer" : "mem");
    kv_xport *x = peer->x;
    pthread_mutex_lock(&x->mu);
    uint32_t i = 0;
    struct kv__xport_expo *e = expo_find(peer, mem, &i);
    const struct timespec never = {.tv_sec = (time_t)1 << 40};
    if (!e) {
        /* Perhaps ended by the peer's close (or another thread's unexpose),
         * whose release may still be under way with mu dropped (RDMA:
         * ibv_dereg_mr): answered once it ended, so the region is free to
         * deregister then. */
        while (peer->n_expo_ending)
            if (x->manual)
                (void)kv__xport_wait_until(x, &never);
            else
                pthread_cond_wait(&x->cv, &x->mu);
        pthread_mutex_unlock(&x->mu);
        return kv__error(KV_ERR_NOT_FOUND,
                         "xport_mem_unexpose: region %u is not exposed to peer %" PRIu64,
                         mem->region, peer->id);
    }
    /* Out of the table: nothing new of this peer is admitted into mem.
     * Counted ending until mem lets it go (a kv_xport_peer_close meanwhile
     * waits for it: the backend's unexpose may drop mu). */
    peer->exposed[i] = peer->exposed[--peer->n_exposed];
    peer->n_expo_ending++;
    peer->ops->unexpose(peer, e);
    /* What was admitted before finishes (each frame has a deadline: a
     * stalled one closes the peer, which releases it). Only this peer's
     * traffic in this region counts. */
    while (e->busy)
        if (x->manual)
            (void)kv__xport_wait_until(x, &never);
        else
            pthread_cond_wait(&x->cv, &x->mu);
    mem->users--;
    if (--peer->n_expo_ending == 0)
        kv__xport_signal(x);
    pthread_mutex_unlock(&x->mu);
    kv__mem_free(e);
    return KV_OK;
}

kv_status kv_xport_rmem_import(kv_xport_peer *peer, const void *blob, size_t len,
                               kv_xport_rmem **out)
{
    if (!peer || !blob || !out)
        return kv__error(KV_ERR_NULL, "xport_rmem_import: %s is NULL",
                         !peer   ? "peer"
                         : !blob ? "blob"
                                 : "out");
    struct kv__xport_blob b;
    kv_status st = kv__xport_blob_decode(blob, len, &b);
    if (st != KV_OK)
        return st;
    kv_xport *x = peer->x;
    if (b.kind != (uint32_t)x->cfg.kind)
        return kv__error(KV_ERR_MISMATCH, "xport_rmem_import: a %s blob on a %s transport",
                         kv_xport_kind_name((kv_xport_kind)b.kind),
                         kv_xport_kind_name(x->cfg.kind));
    kv_xport_peer_state ps;
    if (kv_xport_peer_wait(peer, x->cfg.timeout_ms, &ps) != KV_OK)
        return kv__error(KV_ERR_BAD_STATE, "xport_rmem_import: peer not ready (%s)",
                         ps == KV_XPORT_CONNECTING ? "still connecting" : "closed");
    pthread_mutex_lock(&x->mu);
    const bool ours = b.exposer == peer->nonce_remote && b.importer == peer->nonce_local;
    if (!ours) {
        pthread_mutex_unlock(&x->mu);
        return kv__error(KV_ERR_CORRUPT,
                         "xport_rmem_import: the blob was made for another connection (ids "
                         "0x%016" PRIx64 "/0x%016" PRIx64 ", this one 0x%016" PRIx64
                         "/0x%016" PRIx64 ")",
                         b.exposer, b.importer, peer->nonce_remote, peer->nonce_local);
    }
    if (x->ops->import_check) {
        char why[320] = "";
        const kv_status ks =
            x->ops->import_check(peer, b.key, b.key_len, b.bytes, why, sizeof(why));
        if (ks != KV_OK) {
            pthread_mutex_unlock(&x->mu);
            return kv__error(ks, "xport_rmem_import: region %u: %s", b.region, why);
        }
    }
    kv_xport_rmem *r = kv__mem_calloc(1, sizeof(*r));
    if (!r) {
        pthread_mutex_unlock(&x->mu);
        return kv__error(KV_ERR_NO_MEMORY, "xport_rmem_import");
    }
    r->peer = peer;
    peer->refs++;
    x->n_rmems++;
    r->region = b.region;
    r->bytes = b.bytes;
    r->key_len = b.key_len;
    memcpy(r->key, b.key, b.key_len);
    pthread_mutex_unlock(&x->mu);
    *out = r;
    return KV_OK;
}

kv_status kv_xport_rmem_free(kv_xport_rmem *rmem)
{
    if (!rmem)
        return KV_OK;
    kv_xport *x = rmem->peer->x;
    pthread_mutex_lock(&x->mu);
    if (rmem->users) {
        /* Name the transfers (those of its peer that are not terminal). */
        uint64_t ids[4];
        uint32_t k = 0;
        for (kv_xport_xfer *t = rmem->peer->xfers; t && k < 4; t = t->next)
            for (uint32_t i = 0; i < t->n; i++)
                if (t->ios[i].remote == rmem) {
                    ids[k++] = t->id;
                    break;
                }
        char list[120] = "";
        kv__xport_held_say(list, sizeof(list), rmem->users, "transfer(s) not terminal", ids, k);
        const uint32_t region = rmem->region;
        pthread_mutex_unlock(&x->mu);
        return kv__error(KV_ERR_BAD_STATE,
                         "xport_rmem_free: the peer's region %u is still named by %s (wait for "
                         "them or cancel them first)",
                         region, list);
    }
    x->n_rmems--;
    kv__xport_peer_unref(rmem->peer);
    pthread_mutex_unlock(&x->mu);
    kv__mem_free(rmem);
    return KV_OK;
}

kv_status kv__xport_mem_none(kv_xport_mem *m)
{
    (void)m;
    return KV_OK;
}

kv_status kv__xport_expose_keyless(kv_xport_peer *p, struct kv__xport_expo *e)
{
    (void)p;
    e->key_len = 0;
    return KV_OK;
}
