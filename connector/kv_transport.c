/*
 * kv_transport.c - the transport seam's generic layer (kv_xport_int.h):
 * handles and what each still holds, checks at post, exposures, the limits
 * a peer is held to, queues, transfer bookkeeping. The bytes move in the
 * backends (kv_xport_tcp*.c, kv_xport_rdma_verbs.c); the codecs are in
 * kv_xport_codec.c, plan expansion in kv_xport_plan.c.
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
#include "kv_xport_int.h"

const char *kv_xport_kind_name(kv_xport_kind k)
{
    switch (k) {
    case KV_XPORT_TCP:
        return "tcp";
    case KV_XPORT_RDMA:
        return "rdma";
    }
    return "unknown";
}

uint64_t kv__xport_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

uint64_t kv__xport_deadline_ns(uint32_t timeout_ms)
{
    return kv__xport_now_ns() + (uint64_t)timeout_ms * 1000000ull;
}

/* A deadline timeout_ms from now, for pthread_cond_timedwait. */
static struct timespec deadline_ts(uint32_t timeout_ms)
{
    const uint64_t ns = kv__xport_deadline_ns(timeout_ms);
    return (struct timespec){.tv_sec = (time_t)(ns / 1000000000ull),
                             .tv_nsec = (long)(ns % 1000000000ull)};
}

/* mu held: wait on x->cv until ts; false once it passed. A manual
 * transport (no progress thread) makes one round of progress instead. */
static bool wait_until(kv_xport *x, const struct timespec *ts)
{
    if (x->manual) {
        pthread_mutex_unlock(&x->mu);
        kv__xport_step(x, 0);
        pthread_mutex_lock(&x->mu);
        struct timespec now;
        clock_gettime(CLOCK_MONOTONIC, &now);
        return now.tv_sec < ts->tv_sec || (now.tv_sec == ts->tv_sec && now.tv_nsec < ts->tv_nsec);
    }
    return pthread_cond_timedwait(&x->cv, &x->mu, ts) != ETIMEDOUT;
}

static kv_status create(const struct kv_xport_config *cfg, bool manual, kv_xport **out)
{
    if (!cfg || !out)
        return kv__error(KV_ERR_NULL, "xport_create: %s is NULL", !cfg ? "cfg" : "out");
    if (cfg->struct_size != sizeof(*cfg))
        return kv__error(KV_ERR_INVALID_ARG,
                         "xport_create: cfg struct_size %zu, this library's is %zu (start from "
                         "KV_XPORT_CONFIG_INIT)",
                         cfg->struct_size, sizeof(*cfg));
    if (cfg->kind != KV_XPORT_TCP && cfg->kind != KV_XPORT_RDMA)
        return kv__error(KV_ERR_INVALID_ARG, "xport_create: kind %d (tcp %d, rdma %d)",
                         (int)cfg->kind, KV_XPORT_TCP, KV_XPORT_RDMA);
    if (cfg->token == 0)
        return kv__error(KV_ERR_INVALID_ARG,
                         "xport_create: token 0 (a shared nonzero token is required)");
    if (cfg->conns_per_peer > KV__XPORT_MAX_CONNS)
        return kv__error(KV_ERR_INVALID_ARG, "xport_create: conns_per_peer %u over the limit %u",
                         cfg->conns_per_peer, KV__XPORT_MAX_CONNS);
    if (cfg->listen_host && strlen(cfg->listen_host) >= sizeof(((kv_xport *)0)->host))
        return kv__error(KV_ERR_INVALID_ARG, "xport_create: listen_host of %zu characters",
                         strlen(cfg->listen_host));
    const struct kv__xport_ops *ops = kv__xport_backend(cfg->kind);
    if (!ops)
        return kv__error(KV_ERR_UNSUPPORTED,
                         "xport_create: %s transport not in this build (built without rdma-core)",
                         kv_xport_kind_name(cfg->kind));
    if (ops->version != KV__XPORT_OPS_VERSION || ops->kind != cfg->kind)
        return kv__error(KV_ERR_INTERNAL,
                         "xport_create: the %s backend's ops table is version %u for kind %d "
                         "(this layer: version %u)",
                         ops->name, ops->version, (int)ops->kind, KV__XPORT_OPS_VERSION);
    if (manual && !ops->step)
        return kv__error(KV_ERR_UNSUPPORTED, "xport_create: the %s backend has no manual mode",
                         ops->name);
    kv_xport *x = kv__mem_calloc(1, sizeof(*x));
    if (!x)
        return kv__error(KV_ERR_NO_MEMORY, "xport_create: %zu bytes", sizeof(*x));
    x->cfg = *cfg;
    if (cfg->listen_host) {
        strcpy(x->host, cfg->listen_host);
        x->cfg.listen_host = x->host;
    }
    struct kv_xport_config *c = &x->cfg;
    c->conns_per_peer = c->conns_per_peer ? c->conns_per_peer : KV__XPORT_DEFAULT_CONNS;
    c->timeout_ms = c->timeout_ms ? c->timeout_ms : KV__XPORT_DEFAULT_TIMEOUT_MS;
    c->max_pending_notes = c->max_pending_notes ? c->max_pending_notes : KV__XPORT_DEFAULT_NOTES;
    c->max_pending_reads = c->max_pending_reads ? c->max_pending_reads : KV__XPORT_DEFAULT_READS;
    c->max_handshakes = c->max_handshakes ? c->max_handshakes : KV__XPORT_DEFAULT_HANDSHAKES;
    c->frames_per_round = c->frames_per_round ? c->frames_per_round : KV__XPORT_DEFAULT_FRAMES;
    x->ops = ops;
    x->manual = manual;
    x->next_region = 1;
    x->next_xfer = 1;
    x->next_peer = 1;
    x->stats = (struct kv_xport_stats)KV_XPORT_STATS_INIT;
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_mutex_init(&x->mu, NULL);
    pthread_cond_init(&x->cv, &ca);
    pthread_condattr_destroy(&ca);
    kv_status st = ops->start(x);
    if (st != KV_OK) {
        pthread_cond_destroy(&x->cv);
        pthread_mutex_destroy(&x->mu);
        kv__mem_free(x);
        return st;
    }
    *out = x;
    return KV_OK;
}

kv_status kv_xport_create(const struct kv_xport_config *cfg, kv_xport **out)
{
    return create(cfg, false, out);
}

kv_status kv__xport_create_manual(const struct kv_xport_config *cfg, kv_xport **out)
{
    return create(cfg, true, out);
}

void kv__xport_step(kv_xport *x, uint32_t timeout_ms)
{
    x->ops->step(x, timeout_ms);
}

/* Append ", <n> <what>" and, when given, " (ids a b ...)" to buf. */
static void held_say(char *buf, size_t cap, uint64_t n, const char *what, const uint64_t *ids,
                     uint32_t n_ids)
{
    if (!n)
        return;
    size_t len = strlen(buf);
    len += (size_t)snprintf(buf + len, len < cap ? cap - len : 0, "%s%" PRIu64 " %s",
                            len ? ", " : "", n, what);
    for (uint32_t i = 0; i < n_ids && len < cap; i++)
        len += (size_t)snprintf(buf + len, cap - len, "%s%" PRIu64, i ? " " : " (ids ", ids[i]);
    if (n_ids && len < cap)
        snprintf(buf + len, cap - len, "%s)", n > n_ids ? " ..." : "");
}

kv_status kv_xport_destroy(kv_xport *x)
{
    if (!x)
        return KV_OK;
    /* What the caller still holds: refused, nothing freed. */
    pthread_mutex_lock(&x->mu);
    uint64_t peers = 0, mems = 0, pid[4], mid[4];
    for (kv_xport_peer *p = x->peers; p; p = p->next)
        if (p->user_owned && !p->user_closed) {
            if (peers < 4)
                pid[peers] = p->id;
            peers++;
        }
    for (kv_xport_mem *m = x->mems; m; m = m->next) {
        if (mems < 4)
            mid[mems] = m->region;
        mems++;
    }
    const uint64_t xfers = x->n_xfers, rmems = x->n_rmems;
    pthread_mutex_unlock(&x->mu);
    if (peers || mems || xfers || rmems) {
        char held[400] = "";
        held_say(held, sizeof(held), peers, "peer(s) not closed", pid,
                 (uint32_t)(peers < 4 ? peers : 4));
        held_say(held, sizeof(held), mems, "region(s) registered", mid,
                 (uint32_t)(mems < 4 ? mems : 4));
        held_say(held, sizeof(held), rmems, "imported region(s) not freed", NULL, 0);
        held_say(held, sizeof(held), xfers, "transfer(s) not freed", NULL, 0);
        return kv__error(KV_ERR_BAD_STATE, "xport_destroy: still held by the caller: %s", held);
    }
    const kv_status st = x->ops->stop(x);
    /* What nobody holds a handle of: peers never accepted, notifications
     * never polled (each keeps its peer's last references). */
    pthread_mutex_lock(&x->mu);
    while (x->accept_head) {
        kv_xport_peer *p = x->accept_head;
        x->accept_head = p->accept_next;
        kv__xport_peer_unref(p);
    }
    x->accept_tail = NULL;
    while (x->note_head) {
        struct kv__xport_note *n = x->note_head;
        x->note_head = n->next;
        n->peer->n_notes--;
        kv__xport_peer_unref(n->peer);
        kv__mem_free(n);
    }
    pthread_mutex_unlock(&x->mu);
    pthread_cond_destroy(&x->cv);
    pthread_mutex_destroy(&x->mu);
    kv__mem_free(x);
    return st;
}

uint16_t kv_xport_port(const kv_xport *x)
{
    return x ? x->port : 0;
}

kv_status kv_xport_stats_get(kv_xport *x, struct kv_xport_stats *out)
{
    if (!x || !out)
        return kv__error(KV_ERR_NULL, "xport_stats_get: %s is NULL", !x ? "x" : "out");
    kv_status st =
        kv__check_struct_size("xport_stats_get", "kv_xport_stats", out->struct_size, sizeof(*out));
    if (st != KV_OK)
        return st;
    pthread_mutex_lock(&x->mu);
    *out = x->stats;
    pthread_mutex_unlock(&x->mu);
    return KV_OK;
}

/* ---- peers ---------------------------------------------------------- */

kv_xport_peer *kv__xport_peer_new(kv_xport *x, bool outgoing)
{
    kv_xport_peer *p = kv__mem_calloc(1, sizeof(*p));
    if (!p)
        return NULL;
    p->x = x;
    p->id = x->next_peer++;
    p->refs = 1;
    p->outgoing = outgoing;
    p->state = KV_XPORT_CONNECTING;
    /* A connection's id: distinct per connection and process (the blob of
     * one connection does not import on another). */
    static _Atomic uint64_t counter;
    const uint64_t c = ++counter;
    p->nonce_local = kv__xxh3_64(&(uint64_t[3]){kv__xport_now_ns(), (uint64_t)getpid(), c},
                                 3 * sizeof(uint64_t)) |
                     1;
    p->next = x->peers;
    x->peers = p;
    return p;
}

uint64_t kv_xport_peer_id(const kv_xport_peer *peer)
{
    return peer ? peer->id : 0;
}

/* mu held: end every exposure of p (the backend refuses what it queued of
 * each; nothing of p is busy in them: the backend released that first). */
static void expos_end(kv_xport_peer *p)
{
    while (p->n_exposed) {
        struct kv__xport_expo *e = p->exposed[--p->n_exposed];
        p->x->ops->unexpose(p, e);
        e->mem->users--;
        kv__mem_free(e);
    }
}

void kv__xport_peer_unref(kv_xport_peer *p)
{
    if (--p->refs)
        return;
    kv_xport *x = p->x;
    for (kv_xport_peer **pp = &x->peers; *pp; pp = &(*pp)->next)
        if (*pp == p) {
            *pp = p->next;
            break;
        }
    /* A peer never closed by its backend (it failed before it had one). */
    expos_end(p);
    kv__mem_free(p->exposed);
    kv__mem_free(p);
}

void kv__xport_peer_ready(kv_xport_peer *p)
{
    kv_xport *x = p->x;
    if (p->state != KV_XPORT_CONNECTING)
        return;
    p->state = KV_XPORT_READY;
    if (!p->outgoing) {
        p->refs++; /* the accept queue's, then the user's */
        p->accept_next = NULL;
        if (x->accept_tail)
            x->accept_tail->accept_next = p;
        else
            x->accept_head = p;
        x->accept_tail = p;
    }
    pthread_cond_broadcast(&x->cv);
}

void kv__xport_peer_closed(kv_xport_peer *p, kv_status why, const char *msg)
{
    kv_xport *x = p->x;
    if (p->state != KV_XPORT_CLOSED) {
        p->state = KV_XPORT_CLOSED;
        p->why = why;
        snprintf(p->why_msg, sizeof(p->why_msg), "%s", msg ? msg : "");
    }
    /* Nothing of it lands any more: its exposures end, the regions can be
     * deregistered. */
    expos_end(p);
    const kv_status fail = why == KV_OK ? KV_ERR_IO : why;
    while (p->xfers) {
        kv_xport_xfer *t = p->xfers;
        const bool cancel = t->cancel_req || p->user_closed;
        if (!cancel && !t->why[0])
            snprintf(t->why, sizeof(t->why), "peer %" PRIu64 " closed: %.150s", p->id,
                     p->why_msg[0] ? p->why_msg : kv_status_name(fail));
        kv__xport_xfer_end(t, cancel ? KV_XPORT_CANCELLED : KV_XPORT_FAILED,
                           cancel ? KV_ERR_CANCELLED : fail);
    }
    pthread_cond_broadcast(&x->cv);
}

kv_status kv_xport_connect(kv_xport *x, const char *host, uint16_t port, kv_xport_peer **peer)
{
    if (!x || !host || !peer)
        return kv__error(KV_ERR_NULL, "xport_connect: %s is NULL",
                         !x      ? "x"
                         : !host ? "host"
                                 : "peer");
    if (port == 0 || !*host)
        return kv__error(KV_ERR_INVALID_ARG, "xport_connect: host \"%s\" port %u", host,
                         (unsigned)port);
    pthread_mutex_lock(&x->mu);
    kv_xport_peer *p = kv__xport_peer_new(x, true);
    if (!p) {
        pthread_mutex_unlock(&x->mu);
        return kv__error(KV_ERR_NO_MEMORY, "xport_connect: a peer");
    }
    p->refs++; /* the user's */
    p->user_owned = true;
    pthread_mutex_unlock(&x->mu);
    kv_status st = x->ops->connect(p, host, port);
    if (st != KV_OK) {
        pthread_mutex_lock(&x->mu);
        p->user_closed = true;
        kv__xport_peer_unref(p); /* the user's */
        kv__xport_peer_unref(p); /* the backend's: connect took nothing */
        pthread_mutex_unlock(&x->mu);
        return st;
    }
    *peer = p;
    return KV_OK;
}

kv_status kv_xport_accept(kv_xport *x, uint32_t timeout_ms, kv_xport_peer **peer)
{
    if (!x || !peer)
        return kv__error(KV_ERR_NULL, "xport_accept: %s is NULL", !x ? "x" : "peer");
    if (!x->cfg.listen_host)
        return kv__error(KV_ERR_BAD_STATE, "xport_accept: this transport does not listen");
    const struct timespec ts = deadline_ts(timeout_ms);
    pthread_mutex_lock(&x->mu);
    while (!x->accept_head)
        if (!wait_until(x, &ts))
            break;
    kv_xport_peer *p = x->accept_head;
    if (!p) {
        pthread_mutex_unlock(&x->mu);
        return kv__error(KV_ERR_TIMEOUT, "xport_accept: no peer within %u ms", timeout_ms);
    }
    x->accept_head = p->accept_next;
    if (!x->accept_head)
        x->accept_tail = NULL;
    p->user_owned = true; /* the queue's reference becomes the user's */
    pthread_mutex_unlock(&x->mu);
    *peer = p;
    return KV_OK;
}

kv_status kv_xport_peer_state_get(kv_xport_peer *peer, kv_xport_peer_state *state, kv_status *why)
{
    if (!peer || !state)
        return kv__error(KV_ERR_NULL, "xport_peer_state_get: %s is NULL", !peer ? "peer" : "state");
    kv_xport *x = peer->x;
    pthread_mutex_lock(&x->mu);
    *state = peer->state;
    if (why)
        *why = peer->state == KV_XPORT_CLOSED ? peer->why : KV_OK;
    if (peer->state == KV_XPORT_CLOSED && peer->why != KV_OK)
        kv__error(peer->why, "%s", peer->why_msg);
    pthread_mutex_unlock(&x->mu);
    return KV_OK;
}

kv_status kv_xport_peer_wait(kv_xport_peer *peer, uint32_t timeout_ms, kv_xport_peer_state *state)
{
    if (!peer)
        return kv__error(KV_ERR_NULL, "xport_peer_wait: peer is NULL");
    kv_xport *x = peer->x;
    const struct timespec ts = deadline_ts(timeout_ms);
    pthread_mutex_lock(&x->mu);
    while (peer->state == KV_XPORT_CONNECTING)
        if (!wait_until(x, &ts))
            break;
    const kv_xport_peer_state s = peer->state;
    const kv_status why = peer->why;
    char msg[sizeof(peer->why_msg)];
    memcpy(msg, peer->why_msg, sizeof(msg));
    pthread_mutex_unlock(&x->mu);
    if (state)
        *state = s;
    if (s == KV_XPORT_CONNECTING)
        return kv__error(KV_ERR_TIMEOUT, "xport_peer_wait: still connecting after %u ms",
                         timeout_ms);
    if (s == KV_XPORT_CLOSED)
        return why == KV_OK ? kv__error(KV_ERR_BAD_STATE, "xport_peer_wait: peer closed")
                            : kv__error(why, "%s", msg);
    return KV_OK;
}

void kv_xport_peer_close(kv_xport_peer *peer)
{
    if (!peer)
        return;
    kv_xport *x = peer->x;
    pthread_mutex_lock(&x->mu);
    if (!peer->user_closed) {
        peer->user_closed = true;
        x->ops->peer_close(peer);
        /* Nothing of it may be in flight once this returns. */
        const struct timespec never = {.tv_sec = (time_t)1 << 40};
        while (peer->xfers || peer->state != KV_XPORT_CLOSED)
            if (x->manual)
                (void)wait_until(x, &never);
            else
                pthread_cond_wait(&x->cv, &x->mu);
    }
    kv__xport_peer_unref(peer);
    pthread_mutex_unlock(&x->mu);
}

/* ---- memory --------------------------------------------------------- */

kv_status kv_xport_mem_reg(kv_xport *x, void *base, size_t bytes, enum kv_mem_kind kind,
                           kv_xport_mem **out)
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
    kv_xport_mem *m = kv__mem_calloc(1, sizeof(*m));
    if (!m)
        return kv__error(KV_ERR_NO_MEMORY, "xport_mem_reg: %zu bytes", sizeof(*m));
    m->x = x;
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
    kv_status st = x->ops->expose(peer, e);
    if (st != KV_OK) {
        kv__mem_free(e);
        return st;
    }
    pthread_mutex_lock(&x->mu);
    if (peer->state != KV_XPORT_READY || peer->user_closed || expo_find(peer, mem, NULL)) {
        const int s = peer->state;
        const bool dup = expo_find(peer, mem, NULL) != NULL;
        x->ops->unexpose(peer, e);
        pthread_mutex_unlock(&x->mu);
        kv__mem_free(e);
        if (dup) /* a racing call exposed it first: its blob */
            return kv_xport_mem_expose(peer, mem, blob, cap, len);
        return kv__error(KV_ERR_BAD_STATE, "xport_mem_expose: peer %s (not ready)",
                         s == KV_XPORT_CONNECTING ? "connecting" : "closed");
    }
    st = blob_make(peer, e, blob, cap, len);
    if (st == KV_OK && peer->n_exposed == peer->cap_exposed) {
        struct kv__xport_expo **t = kv__mem_grow(peer->exposed, &peer->cap_exposed, peer->n_exposed,
                                                 (size_t)peer->n_exposed + 1, sizeof(*t), 4);
        if (!t)
            st = kv__error(KV_ERR_NO_MEMORY, "xport_mem_expose: growing the table of %zu",
                           peer->cap_exposed);
        else
            peer->exposed = t;
    }
    if (st != KV_OK) {
        x->ops->unexpose(peer, e);
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
    if (!e) {
        pthread_mutex_unlock(&x->mu);
        return kv__error(KV_ERR_NOT_FOUND,
                         "xport_mem_unexpose: region %u is not exposed to peer %" PRIu64,
                         mem->region, peer->id);
    }
    /* Out of the table: nothing new of this peer is admitted into mem. */
    peer->exposed[i] = peer->exposed[--peer->n_exposed];
    x->ops->unexpose(peer, e);
    /* What was admitted before finishes (each frame has a deadline: a
     * stalled one closes the peer, which releases it). Only this peer's
     * traffic in this region counts. */
    const struct timespec never = {.tv_sec = (time_t)1 << 40};
    while (e->busy)
        if (x->manual)
            (void)wait_until(x, &never);
        else
            pthread_cond_wait(&x->cv, &x->mu);
    mem->users--;
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
        held_say(list, sizeof(list), rmem->users, "transfer(s) not terminal", ids, k);
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

/* ---- transfers ------------------------------------------------------ */

/* The checks at post (nothing sent yet). */
static kv_status check_ios(const char *fn, kv_xport_peer *peer, const struct kv_xport_io *ios,
                           uint32_t n)
{
    for (uint32_t i = 0; i < n; i++) {
        const struct kv_xport_io *io = &ios[i];
        if (!io->local || !io->remote)
            return kv__error(KV_ERR_NULL, "%s: entry %u: %s is NULL", fn, i,
                             !io->local ? "local" : "remote");
        if (io->local->x != peer->x)
            return kv__error(KV_ERR_INVALID_ARG,
                             "%s: entry %u: local region %u is registered on another transport", fn,
                             i, io->local->region);
        if (io->remote->peer != peer)
            return kv__error(KV_ERR_INVALID_ARG,
                             "%s: entry %u: remote region %u was imported from another peer", fn, i,
                             io->remote->region);
        if (io->bytes == 0)
            return kv__error(KV_ERR_INVALID_ARG, "%s: entry %u of 0 bytes", fn, i);
        if (!kv__range_ok(io->local->bytes, io->local_off, io->bytes))
            return kv__error(KV_ERR_OUT_OF_BOUNDS,
                             "%s: entry %u: local [%" PRIu64 ", +%" PRIu64
                             ") outside region %u of %" PRIu64 " bytes",
                             fn, i, io->local_off, io->bytes, io->local->region, io->local->bytes);
        if (!kv__range_ok(io->remote->bytes, io->remote_off, io->bytes))
            return kv__error(KV_ERR_OUT_OF_BOUNDS,
                             "%s: entry %u: remote [%" PRIu64 ", +%" PRIu64
                             ") outside the peer's region %u of %" PRIu64 " bytes",
                             fn, i, io->remote_off, io->bytes, io->remote->region,
                             io->remote->bytes);
    }
    return KV_OK;
}

static void xfer_release(kv_xport_xfer *t)
{
    kv__mem_free(t->ios);
    kv__mem_free(t->st);
    kv__mem_free(t->moved);
    kv__mem_free(t->ended);
    kv__mem_free(t->note);
    kv__mem_free(t);
}

static kv_status post(const char *fn, kv_xport_peer *peer, const struct kv_xport_io *ios,
                      uint32_t n, const struct kv_xport_notify *notify, bool read,
                      kv_xport_xfer **xfer)
{
    if (!peer || !xfer || (n && !ios))
        return kv__error(KV_ERR_NULL, "%s: %s is NULL", fn,
                         !peer   ? "peer"
                         : !xfer ? "xfer"
                                 : "ios");
    if (n == 0 && !notify)
        return kv__error(KV_ERR_INVALID_ARG, "%s: no entries and no notification", fn);
    if (notify && notify->len > KV_XPORT_NOTIFY_MAX)
        return kv__error(KV_ERR_INVALID_ARG, "%s: notification of %u bytes (at most %u)", fn,
                         notify->len, KV_XPORT_NOTIFY_MAX);
    if (notify && notify->len && !notify->msg)
        return kv__error(KV_ERR_NULL, "%s: notification msg is NULL with len %u", fn, notify->len);
    kv_status st = check_ios(fn, peer, ios, n);
    if (st != KV_OK)
        return st;
    kv_xport_xfer *t = kv__mem_calloc(1, sizeof(*t));
    const uint32_t m = n ? n : 1;
    if (t) {
        t->ios = kv__mem_alloc(m * sizeof(*t->ios));
        t->st = kv__mem_calloc(m, sizeof(*t->st));
        t->moved = kv__mem_calloc(m, sizeof(*t->moved));
        t->ended = kv__mem_calloc(m, sizeof(*t->ended));
        t->note = notify && notify->len ? kv__mem_alloc(notify->len) : NULL;
    }
    if (!t || !t->ios || !t->st || !t->moved || !t->ended || (notify && notify->len && !t->note)) {
        if (t)
            xfer_release(t);
        return kv__error(KV_ERR_NO_MEMORY, "%s: a transfer of %u entries", fn, n);
    }
    if (n)
        memcpy(t->ios, ios, n * sizeof(*ios));
    t->n = n;
    t->left = n;
    t->read = read;
    if (notify) {
        t->has_note = true;
        t->note_tag = notify->tag;
        t->note_len = notify->len;
        if (notify->len)
            memcpy(t->note, notify->msg, notify->len);
    }
    kv_xport *x = peer->x;
    pthread_mutex_lock(&x->mu);
    if (peer->state != KV_XPORT_READY || peer->user_closed) {
        const kv_xport_peer_state s = peer->state;
        const kv_status why = peer->why;
        pthread_mutex_unlock(&x->mu);
        xfer_release(t);
        if (s == KV_XPORT_CONNECTING)
            return kv__error(KV_ERR_BAD_STATE, "%s: peer still connecting", fn);
        return kv__error(KV_ERR_BAD_STATE, "%s: peer closed (%s)", fn, kv_status_name(why));
    }
    t->peer = peer;
    peer->refs++;
    x->n_xfers++;
    for (uint32_t i = 0; i < n; i++) {
        ios[i].local->users++;
        ios[i].remote->users++;
    }
    t->id = x->next_xfer++;
    t->state = KV_XPORT_PENDING;
    t->post_ns = kv__xport_now_ns();
    t->deadline_ns = t->post_ns + (uint64_t)x->cfg.timeout_ms * 1000000ull;
    if (peer->xfers_tail)
        peer->xfers_tail->next = t;
    else
        peer->xfers = t;
    peer->xfers_tail = t;
    x->ops->post(t);
    pthread_mutex_unlock(&x->mu);
    *xfer = t;
    return KV_OK;
}

kv_status kv_xport_write(kv_xport_peer *peer, const struct kv_xport_io *ios, uint32_t n,
                         const struct kv_xport_notify *notify, kv_xport_xfer **xfer)
{
    return post("xport_write", peer, ios, n, notify, false, xfer);
}

kv_status kv_xport_read(kv_xport_peer *peer, const struct kv_xport_io *ios, uint32_t n,
                        kv_xport_xfer **xfer)
{
    if (n == 0)
        return kv__error(KV_ERR_INVALID_ARG, "xport_read: no entries");
    return post("xport_read", peer, ios, n, NULL, true, xfer);
}

void kv__xport_entry_end(kv_xport_xfer *t, uint32_t i, kv_status st)
{
    if (i >= t->n || t->ended[i])
        return;
    t->ended[i] = true;
    t->st[i] = st;
    t->left--;
    t->failed += st != KV_OK;
}

void kv__xport_entry_fail(kv_xport_xfer *t, uint32_t i, kv_status st, const char *fmt, ...)
{
    if (i >= t->n || t->ended[i])
        return;
    if (!t->why[0]) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(t->why, sizeof(t->why), fmt, ap);
        va_end(ap);
    }
    kv__xport_entry_end(t, i, st);
}

kv_status kv__xport_wire_status(int64_t v, bool ok_allowed)
{
    switch (v) {
#define KV__WIRE_STATUS(name, value, msg)                                                          \
    case value:                                                                                    \
        return value == 0 && !ok_allowed ? KV_ERR_CORRUPT : (kv_status)value;
        KV_STATUS_MAP(KV__WIRE_STATUS)
#undef KV__WIRE_STATUS
    }
    return KV_ERR_CORRUPT;
}

void kv__xport_xfer_end(kv_xport_xfer *t, kv_xport_state state, kv_status why)
{
    if (t->state != KV_XPORT_PENDING)
        return;
    for (uint32_t i = 0; i < t->n; i++)
        kv__xport_entry_end(t, i, why);
    t->state = state;
    t->busy = 0;
    kv_xport_peer *p = t->peer;
    kv_xport_xfer *prev = NULL;
    for (kv_xport_xfer *q = p->xfers; q; prev = q, q = q->next)
        if (q == t) {
            if (prev)
                prev->next = t->next;
            else
                p->xfers = t->next;
            if (p->xfers_tail == t)
                p->xfers_tail = prev;
            break;
        }
    t->next = NULL;
    for (uint32_t i = 0; i < t->n; i++) {
        t->ios[i].local->users--;
        t->ios[i].remote->users--;
    }
    if (state == KV_XPORT_TIMED_OUT && !t->why[0])
        snprintf(t->why, sizeof(t->why), "transfer %" PRIu64 " not done within %u ms", t->id,
                 p->x->cfg.timeout_ms);
    pthread_cond_broadcast(&p->x->cv);
}

bool kv__xport_xfer_settle(kv_xport_xfer *t)
{
    if (t->state != KV_XPORT_PENDING || t->left)
        return t->state != KV_XPORT_PENDING;
    if (t->failed || t->note_st != KV_OK) {
        kv__xport_xfer_end(t, KV_XPORT_FAILED, KV_ERR_IO);
        return true;
    }
    if (t->has_note && !t->note_done)
        return false;
    kv__xport_xfer_end(t, KV_XPORT_DONE, KV_OK);
    return true;
}

void kv__xport_note_refused(kv_xport_xfer *t, kv_status st, const char *msg)
{
    t->note_st = st;
    if (!t->why[0])
        snprintf(t->why, sizeof(t->why), "%s", msg);
}

bool kv__xport_note_may_go(const kv_xport_xfer *t)
{
    if (t->left || t->failed)
        return false;
    for (const kv_xport_xfer *q = t->peer->xfers; q && q != t; q = q->next)
        if (q->left || q->failed || (q->has_note && !q->note_sent))
            return false;
    return true;
}

kv_xport_xfer *kv__xport_xfer_find(kv_xport_peer *p, uint64_t id)
{
    for (kv_xport_xfer *t = p->xfers; t; t = t->next)
        if (t->id == id)
            return t;
    return NULL;
}

kv_status kv_xport_xfer_test(kv_xport_xfer *xfer, kv_xport_state *state)
{
    if (!xfer || !state)
        return kv__error(KV_ERR_NULL, "xport_xfer_test: %s is NULL", !xfer ? "xfer" : "state");
    kv_xport *x = xfer->peer->x;
    if (x->manual)
        kv__xport_step(x, 0);
    pthread_mutex_lock(&x->mu);
    *state = xfer->state;
    pthread_mutex_unlock(&x->mu);
    return KV_OK;
}

kv_status kv_xport_xfer_wait(kv_xport_xfer *xfer, uint32_t timeout_ms, kv_xport_state *state)
{
    if (!xfer)
        return kv__error(KV_ERR_NULL, "xport_xfer_wait: xfer is NULL");
    kv_xport *x = xfer->peer->x;
    const struct timespec ts = deadline_ts(timeout_ms);
    pthread_mutex_lock(&x->mu);
    while (xfer->state == KV_XPORT_PENDING)
        if (!wait_until(x, &ts))
            break;
    const kv_xport_state s = xfer->state;
    pthread_mutex_unlock(&x->mu);
    if (state)
        *state = s;
    if (s == KV_XPORT_PENDING)
        return kv__error(KV_ERR_TIMEOUT,
                         "xport_xfer_wait: transfer %" PRIu64 " still pending after %u ms",
                         xfer->id, timeout_ms);
    return KV_OK;
}

kv_status kv_xport_xfer_cancel(kv_xport_xfer *xfer)
{
    if (!xfer)
        return kv__error(KV_ERR_NULL, "xport_xfer_cancel: xfer is NULL");
    kv_xport *x = xfer->peer->x;
    pthread_mutex_lock(&x->mu);
    if (xfer->state == KV_XPORT_PENDING && !xfer->cancel_req) {
        xfer->cancel_req = true;
        x->ops->cancel(xfer);
    }
    pthread_mutex_unlock(&x->mu);
    return KV_OK;
}

kv_status kv_xport_xfer_results(kv_xport_xfer *xfer, const kv_status **st, uint32_t *n)
{
    if (!xfer || !st || !n)
        return kv__error(KV_ERR_NULL, "xport_xfer_results: %s is NULL",
                         !xfer ? "xfer"
                         : !st ? "st"
                               : "n");
    kv_xport *x = xfer->peer->x;
    pthread_mutex_lock(&x->mu);
    const kv_xport_state s = xfer->state;
    pthread_mutex_unlock(&x->mu);
    if (s == KV_XPORT_PENDING)
        return kv__error(KV_ERR_BAD_STATE, "xport_xfer_results: transfer %" PRIu64 " pending",
                         xfer->id);
    *st = xfer->st;
    *n = xfer->n;
    return KV_OK;
}

const char *kv_xport_xfer_error(kv_xport_xfer *xfer)
{
    if (!xfer)
        return "";
    kv_xport *x = xfer->peer->x;
    pthread_mutex_lock(&x->mu);
    const bool ended = xfer->state != KV_XPORT_PENDING && xfer->state != KV_XPORT_DONE;
    pthread_mutex_unlock(&x->mu);
    return ended ? xfer->why : "";
}

kv_status kv_xport_xfer_free(kv_xport_xfer *xfer)
{
    if (!xfer)
        return KV_OK;
    kv_xport_peer *p = xfer->peer;
    kv_xport *x = p->x;
    pthread_mutex_lock(&x->mu);
    if (xfer->state == KV_XPORT_PENDING) {
        pthread_mutex_unlock(&x->mu);
        return kv__error(KV_ERR_BAD_STATE,
                         "xport_xfer_free: transfer %" PRIu64 " pending (wait or cancel first)",
                         xfer->id);
    }
    x->n_xfers--;
    kv__xport_peer_unref(p);
    pthread_mutex_unlock(&x->mu);
    xfer_release(xfer);
    return KV_OK;
}

/* ---- notifications -------------------------------------------------- */

kv_status kv__xport_note_admit(const kv_xport_peer *p, uint64_t len, char *msg, size_t cap)
{
    char tmp[1];
    if (!msg) {
        msg = tmp;
        cap = sizeof(tmp);
    }
    if (len > KV_XPORT_NOTIFY_MAX) {
        snprintf(msg, cap, "peer %" PRIu64 " sent a notification of %" PRIu64 " bytes (at most %u)",
                 p->id, len, KV_XPORT_NOTIFY_MAX);
        return KV_ERR_CORRUPT;
    }
    if (p->n_notes >= p->x->cfg.max_pending_notes) {
        snprintf(msg, cap,
                 "the receiver's queue of notifications from this peer is full: %u not yet "
                 "polled (max_pending_notes)",
                 p->n_notes);
        return KV_ERR_CAPACITY;
    }
    return KV_OK;
}

kv_status kv__xport_note_push(kv_xport_peer *p, uint64_t tag, const void *data, uint32_t len)
{
    char why[160];
    const kv_status st = kv__xport_note_admit(p, len, why, sizeof(why));
    if (st != KV_OK)
        return kv__error(st, "xport: %s", why);
    struct kv__xport_note *n = kv__mem_alloc(sizeof(*n) + len);
    if (!n)
        return kv__error(KV_ERR_NO_MEMORY, "notification of %u bytes", len);
    n->next = NULL;
    n->peer = p;
    p->refs++;
    p->n_notes++;
    n->tag = tag;
    n->len = len;
    if (len)
        memcpy(n->data, data, len);
    kv_xport *x = p->x;
    if (x->note_tail)
        x->note_tail->next = n;
    else
        x->note_head = n;
    x->note_tail = n;
    pthread_cond_broadcast(&x->cv);
    return KV_OK;
}

kv_status kv_xport_notify_poll(kv_xport *x, uint32_t timeout_ms, struct kv_xport_msg *out)
{
    if (!x || !out)
        return kv__error(KV_ERR_NULL, "xport_notify_poll: %s is NULL", !x ? "x" : "out");
    const struct timespec ts = deadline_ts(timeout_ms);
    pthread_mutex_lock(&x->mu);
    while (!x->note_head)
        if (!wait_until(x, &ts))
            break;
    struct kv__xport_note *n = x->note_head;
    if (!n) {
        pthread_mutex_unlock(&x->mu);
        return kv__error(KV_ERR_TIMEOUT, "xport_notify_poll: none within %u ms", timeout_ms);
    }
    x->note_head = n->next;
    if (!x->note_head)
        x->note_tail = NULL;
    out->peer_id = n->peer->id;
    out->tag = n->tag;
    out->len = n->len;
    memcpy(out->data, n->data, n->len);
    /* The message names the peer by id; the queue's reference ends here. */
    n->peer->n_notes--;
    kv__xport_peer_unref(n->peer);
    pthread_mutex_unlock(&x->mu);
    kv__mem_free(n);
    return KV_OK;
}
