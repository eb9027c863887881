/*
 * kv_transport.c - the transport seam's generic layer (kv_xport_int.h):
 * handles, checks at post, exposures and blobs, queues, transfer
 * bookkeeping. The bytes move in the backends (kv_xport_tcp.c,
 * kv_xport_rdma_verbs.c).
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kv_mem.h"
#include "kv_plan_int.h"
#include "kv_verbs_int.h"
#include "kv_xport_frame_int.h"
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

/* A deadline timeout_ms from now, for pthread_cond_timedwait. */
static struct timespec deadline_ts(uint32_t timeout_ms)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    ts.tv_sec += timeout_ms / 1000;
    ts.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    return ts;
}

static const struct kv__xport_ops *ops_of(kv_xport_kind kind)
{
    switch (kind) {
    case KV_XPORT_TCP:
        return &kv__xport_tcp_ops;
    case KV_XPORT_RDMA:
        return kv__xport_rdma();
    }
    return NULL;
}

kv_status kv_xport_create(const struct kv_xport_config *cfg, kv_xport **out)
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
    const struct kv__xport_ops *ops = ops_of(cfg->kind);
    if (!ops)
        return kv__error(KV_ERR_UNSUPPORTED,
                         "xport_create: %s transport not in this build (built without rdma-core)",
                         kv_xport_kind_name(cfg->kind));
    kv_xport *x = kv__mem_calloc(1, sizeof(*x));
    if (!x)
        return kv__error(KV_ERR_NO_MEMORY, "xport_create: %zu bytes", sizeof(*x));
    x->cfg = *cfg;
    if (cfg->listen_host) {
        strcpy(x->host, cfg->listen_host);
        x->cfg.listen_host = x->host;
    }
    if (!x->cfg.conns_per_peer)
        x->cfg.conns_per_peer = KV__XPORT_DEFAULT_CONNS;
    if (!x->cfg.timeout_ms)
        x->cfg.timeout_ms = KV__XPORT_DEFAULT_TIMEOUT_MS;
    x->ops = ops;
    x->next_region = 1;
    x->next_xfer = 1;
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

void kv_xport_destroy(kv_xport *x)
{
    if (!x)
        return;
    x->ops->stop(x);
    /* What the user never freed: notifications, imported regions and
     * transfers keep references; the peers are released with them. */
    pthread_mutex_lock(&x->mu);
    while (x->accept_head) { /* ready, never accepted */
        kv_xport_peer *p = x->accept_head;
        x->accept_head = p->accept_next;
        kv__xport_peer_unref(p);
    }
    x->accept_tail = NULL;
    while (x->note_head) {
        struct kv__xport_note *n = x->note_head;
        x->note_head = n->next;
        kv__xport_peer_unref(n->peer);
        kv__mem_free(n);
    }
    pthread_mutex_unlock(&x->mu);
    pthread_cond_destroy(&x->cv);
    pthread_mutex_destroy(&x->mu);
    kv__mem_free(x);
}

uint16_t kv_xport_port(const kv_xport *x)
{
    return x ? x->port : 0;
}

/* ---- peers ---------------------------------------------------------- */

kv_xport_peer *kv__xport_peer_new(kv_xport *x, bool outgoing)
{
    kv_xport_peer *p = kv__mem_calloc(1, sizeof(*p));
    if (!p)
        return NULL;
    p->x = x;
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
    for (uint32_t i = 0; i < p->n_exposed; i++)
        p->exposed[i]->users--;
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
    /* Nothing of it lands any more (the backend released its landings
     * before): its exposures end, the regions can be deregistered. */
    for (uint32_t i = 0; i < p->n_exposed; i++)
        p->exposed[i]->users--;
    p->n_exposed = 0;
    const kv_status fail = why == KV_OK ? KV_ERR_IO : why;
    while (p->xfers) {
        kv_xport_xfer *t = p->xfers;
        kv__xport_xfer_end(t,
                           t->cancel_req || p->user_closed ? KV_XPORT_CANCELLED : KV_XPORT_FAILED,
                           t->cancel_req || p->user_closed ? KV_ERR_CANCELLED : fail);
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
        if (pthread_cond_timedwait(&x->cv, &x->mu, &ts) == ETIMEDOUT)
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
        if (pthread_cond_timedwait(&x->cv, &x->mu, &ts) == ETIMEDOUT)
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
        while (peer->xfers || peer->state != KV_XPORT_CLOSED)
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
    for (kv_xport_mem **pp = &x->mems; *pp; pp = &(*pp)->next)
        if (*pp == mem) {
            *pp = mem->next;
            break;
        }
    pthread_mutex_unlock(&x->mu);
    x->ops->mem_dereg(mem);
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

kv_xport_mem *kv__xport_exposed(kv_xport_peer *p, uint32_t region, uint64_t off, uint64_t len)
{
    for (uint32_t i = 0; i < p->n_exposed; i++) {
        kv_xport_mem *m = p->exposed[i];
        if (m->region == region)
            return off <= m->bytes && len <= m->bytes - off ? m : NULL;
    }
    return NULL;
}

/*
 * The blob (little-endian, KV_XPORT_BLOB_MAX at most):
 *   0  4  magic "KVXB"        4  2  version      6  2  kind
 *   8  4  region             12  4  key_len
 *  16  8  bytes              24  8  exposer's connection id
 *  32  8  importer's connection id
 *  40  key_len  backend key  then 8  XXH3-64 of everything before it
 */
#define BLOB_HEAD 40

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
    unsigned char key[KV__XPORT_KEY_MAX];
    uint32_t key_len = 0;
    kv_status st = x->ops->mem_key(peer, mem, key, &key_len);
    if (st != KV_OK)
        return st;
    const size_t need = BLOB_HEAD + key_len + 8;
    if (cap < need)
        return kv__error(KV_ERR_CAPACITY, "xport_mem_expose: blob of %zu bytes needs %zu", cap,
                         need);
    pthread_mutex_lock(&x->mu);
    if (peer->state != KV_XPORT_READY) {
        const int s = peer->state;
        pthread_mutex_unlock(&x->mu);
        return kv__error(KV_ERR_BAD_STATE, "xport_mem_expose: peer %s (not ready)",
                         s == KV_XPORT_CONNECTING ? "connecting" : "closed");
    }
    bool have = false;
    for (uint32_t i = 0; i < peer->n_exposed; i++)
        have |= peer->exposed[i] == mem;
    if (!have) {
        if (peer->n_exposed == peer->cap_exposed) {
            const uint32_t c = peer->cap_exposed ? 2 * peer->cap_exposed : 4;
            kv_xport_mem **e = kv__mem_alloc(c * sizeof(*e));
            if (!e) {
                pthread_mutex_unlock(&x->mu);
                return kv__error(KV_ERR_NO_MEMORY, "xport_mem_expose: table of %u", c);
            }
            if (peer->n_exposed)
                memcpy(e, peer->exposed, peer->n_exposed * sizeof(*e));
            kv__mem_free(peer->exposed);
            peer->exposed = e;
            peer->cap_exposed = c;
        }
        peer->exposed[peer->n_exposed++] = mem;
        mem->users++;
    }
    unsigned char *b = blob;
    memcpy(b, "KVXB", 4);
    kv__le_put(b + 4, KV_XPORT_PROTOCOL_VERSION, 2);
    kv__le_put(b + 6, (uint64_t)x->cfg.kind, 2);
    kv__le_put(b + 8, mem->region, 4);
    kv__le_put(b + 12, key_len, 4);
    kv__le_put(b + 16, mem->bytes, 8);
    kv__le_put(b + 24, peer->nonce_local, 8);
    kv__le_put(b + 32, peer->nonce_remote, 8);
    pthread_mutex_unlock(&x->mu);
    memcpy(b + BLOB_HEAD, key, key_len);
    kv__le_put(b + BLOB_HEAD + key_len, kv__xxh3_64(b, BLOB_HEAD + key_len), 8);
    *len = need;
    return KV_OK;
}

kv_status kv_xport_mem_unexpose(kv_xport_peer *peer, kv_xport_mem *mem)
{
    if (!peer || !mem)
        return kv__error(KV_ERR_NULL, "xport_mem_unexpose: %s is NULL", !peer ? "peer" : "mem");
    kv_xport *x = peer->x;
    pthread_mutex_lock(&x->mu);
    uint32_t i = 0;
    while (i < peer->n_exposed && peer->exposed[i] != mem)
        i++;
    if (i == peer->n_exposed) {
        pthread_mutex_unlock(&x->mu);
        return kv__error(KV_ERR_NOT_FOUND,
                         "xport_mem_unexpose: region %u is not exposed to "
                         "this peer",
                         mem->region);
    }
    peer->exposed[i] = peer->exposed[--peer->n_exposed];
    while (mem->landing) /* a write admitted before is still landing */
        pthread_cond_wait(&x->cv, &x->mu);
    mem->users--;
    pthread_mutex_unlock(&x->mu);
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
    const unsigned char *b = blob;
    if (len < BLOB_HEAD + 8 || len > KV_XPORT_BLOB_MAX)
        return kv__error(KV_ERR_CORRUPT, "xport_rmem_import: blob of %zu bytes (%d..%d)", len,
                         BLOB_HEAD + 8, KV_XPORT_BLOB_MAX);
    if (memcmp(b, "KVXB", 4) != 0)
        return kv__error(KV_ERR_CORRUPT, "xport_rmem_import: magic is not \"KVXB\"");
    const uint32_t key_len = (uint32_t)kv__le_get(b + 12, 4);
    if (key_len > KV__XPORT_KEY_MAX || BLOB_HEAD + key_len + 8 != len)
        return kv__error(KV_ERR_CORRUPT, "xport_rmem_import: key of %u bytes in a blob of %zu",
                         key_len, len);
    const uint64_t sum = kv__le_get(b + BLOB_HEAD + key_len, 8);
    if (sum != kv__xxh3_64(b, BLOB_HEAD + key_len))
        return kv__error(
            KV_ERR_CORRUPT,
            "xport_rmem_import: blob checksum 0x%016" PRIx64 " does not match its bytes", sum);
    const uint32_t ver = (uint32_t)kv__le_get(b + 4, 2), kind = (uint32_t)kv__le_get(b + 6, 2);
    if (ver != KV_XPORT_PROTOCOL_VERSION)
        return kv__error(KV_ERR_MISMATCH, "xport_rmem_import: blob version %u, this library %u",
                         ver, KV_XPORT_PROTOCOL_VERSION);
    kv_xport *x = peer->x;
    if (kind != (uint32_t)x->cfg.kind)
        return kv__error(KV_ERR_MISMATCH, "xport_rmem_import: a %s blob on a %s transport",
                         kv_xport_kind_name((kv_xport_kind)kind), kv_xport_kind_name(x->cfg.kind));
    const uint64_t exposer = kv__le_get(b + 24, 8), importer = kv__le_get(b + 32, 8);
    kv_xport_peer_state ps;
    if (kv_xport_peer_wait(peer, x->cfg.timeout_ms, &ps) != KV_OK)
        return kv__error(KV_ERR_BAD_STATE, "xport_rmem_import: peer not ready (%s)",
                         ps == KV_XPORT_CONNECTING ? "still connecting" : "closed");
    pthread_mutex_lock(&x->mu);
    const bool ours = exposer == peer->nonce_remote && importer == peer->nonce_local;
    if (!ours) {
        pthread_mutex_unlock(&x->mu);
        return kv__error(KV_ERR_CORRUPT,
                         "xport_rmem_import: the blob was made for another connection (ids "
                         "0x%016" PRIx64 "/0x%016" PRIx64 ", this one 0x%016" PRIx64
                         "/0x%016" PRIx64 ")",
                         exposer, importer, peer->nonce_remote, peer->nonce_local);
    }
    kv_xport_rmem *r = kv__mem_calloc(1, sizeof(*r));
    if (!r) {
        pthread_mutex_unlock(&x->mu);
        return kv__error(KV_ERR_NO_MEMORY, "xport_rmem_import");
    }
    r->peer = peer;
    peer->refs++;
    r->region = (uint32_t)kv__le_get(b + 8, 4);
    r->bytes = kv__le_get(b + 16, 8);
    r->key_len = key_len;
    memcpy(r->key, b + BLOB_HEAD, key_len);
    pthread_mutex_unlock(&x->mu);
    *out = r;
    return KV_OK;
}

void kv_xport_rmem_free(kv_xport_rmem *rmem)
{
    if (!rmem)
        return;
    kv_xport *x = rmem->peer->x;
    pthread_mutex_lock(&x->mu);
    kv__xport_peer_unref(rmem->peer);
    pthread_mutex_unlock(&x->mu);
    kv__mem_free(rmem);
}

/* ---- transfers ------------------------------------------------------ */

/* [off, off + len) inside [0, bytes), no overflow. */
static bool range_ok(uint64_t bytes, uint64_t off, uint64_t len)
{
    return off <= bytes && len <= bytes - off;
}

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
        if (!range_ok(io->local->bytes, io->local_off, io->bytes))
            return kv__error(KV_ERR_OUT_OF_BOUNDS,
                             "%s: entry %u: local [%" PRIu64 ", +%" PRIu64
                             ") outside region %u of %" PRIu64 " bytes",
                             fn, i, io->local_off, io->bytes, io->local->region, io->local->bytes);
        if (!range_ok(io->remote->bytes, io->remote_off, io->bytes))
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
    for (uint32_t i = 0; i < n; i++)
        ios[i].local->users++;
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
    for (uint32_t i = 0; i < t->n; i++)
        t->ios[i].local->users--;
    pthread_cond_broadcast(&p->x->cv);
}

bool kv__xport_xfer_settle(kv_xport_xfer *t)
{
    if (t->state != KV_XPORT_PENDING || t->left)
        return t->state != KV_XPORT_PENDING;
    if (t->failed) {
        kv__xport_xfer_end(t, KV_XPORT_FAILED, KV_ERR_IO);
        return true;
    }
    if (t->has_note && !t->note_done)
        return false;
    kv__xport_xfer_end(t, KV_XPORT_DONE, KV_OK);
    return true;
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
        if (pthread_cond_timedwait(&x->cv, &x->mu, &ts) == ETIMEDOUT)
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
    kv__xport_peer_unref(p);
    pthread_mutex_unlock(&x->mu);
    xfer_release(xfer);
    return KV_OK;
}

/* ---- notifications -------------------------------------------------- */

kv_status kv__xport_note_push(kv_xport_peer *p, uint64_t tag, const void *data, uint32_t len)
{
    struct kv__xport_note *n = kv__mem_alloc(sizeof(*n) + len);
    if (!n)
        return kv__error(KV_ERR_NO_MEMORY, "notification of %u bytes", len);
    n->next = NULL;
    n->peer = p;
    p->refs++;
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
        if (pthread_cond_timedwait(&x->cv, &x->mu, &ts) == ETIMEDOUT)
            break;
    struct kv__xport_note *n = x->note_head;
    if (!n) {
        pthread_mutex_unlock(&x->mu);
        return kv__error(KV_ERR_TIMEOUT, "xport_notify_poll: none within %u ms", timeout_ms);
    }
    x->note_head = n->next;
    if (!x->note_head)
        x->note_tail = NULL;
    out->peer = n->peer;
    out->tag = n->tag;
    out->len = n->len;
    memcpy(out->data, n->data, n->len);
    /* The message names the peer: its handle stays valid while the user
     * holds it; the queue's reference ends here. */
    kv__xport_peer_unref(n->peer);
    pthread_mutex_unlock(&x->mu);
    kv__mem_free(n);
    return KV_OK;
}

/* ---- the handshake payload ------------------------------------------ */

void kv__xport_hello_encode(const struct kv__xport_hello *h, unsigned char *out)
{
    kv__le_put(out, h->version, 4);
    kv__le_put(out + 4, h->kind, 4);
    kv__le_put(out + 8, h->token, 8);
    kv__le_put(out + 16, h->fingerprint, 8);
    kv__le_put(out + 24, h->nonce, 8);
    kv__le_put(out + 32, h->echo, 8);
    kv__le_put(out + 40, h->conns, 4);
    kv__le_put(out + 44, h->conn, 4);
}

void kv__xport_hello_decode(const unsigned char *in, struct kv__xport_hello *h)
{
    h->version = (uint32_t)kv__le_get(in, 4);
    h->kind = (uint32_t)kv__le_get(in + 4, 4);
    h->token = kv__le_get(in + 8, 8);
    h->fingerprint = kv__le_get(in + 16, 8);
    h->nonce = kv__le_get(in + 24, 8);
    h->echo = kv__le_get(in + 32, 8);
    h->conns = (uint32_t)kv__le_get(in + 40, 4);
    h->conn = (uint32_t)kv__le_get(in + 44, 4);
}

kv_status kv__xport_hello_check(const kv_xport *x, const struct kv__xport_hello *h, char *msg,
                                size_t cap)
{
    if (h->version != KV_XPORT_PROTOCOL_VERSION)
        snprintf(msg, cap, "protocol version mismatch: peer %u, here %u", h->version,
                 KV_XPORT_PROTOCOL_VERSION);
    else if (h->kind != (uint32_t)x->cfg.kind)
        snprintf(msg, cap, "transport kind mismatch: peer %s, here %s",
                 kv_xport_kind_name((kv_xport_kind)h->kind), kv_xport_kind_name(x->cfg.kind));
    else if (h->token != x->cfg.token)
        snprintf(msg, cap, "token mismatch: the peer presented another token");
    else if (h->fingerprint != x->cfg.fingerprint)
        snprintf(msg, cap, "layout fingerprint mismatch: peer 0x%016" PRIx64 ", here 0x%016" PRIx64,
                 h->fingerprint, x->cfg.fingerprint);
    else if (h->conns != x->cfg.conns_per_peer || h->conn >= h->conns)
        snprintf(msg, cap, "connections mismatch: peer %u (this one %u), here %u", h->conns,
                 h->conn, x->cfg.conns_per_peer);
    else
        return KV_OK;
    return kv__error(KV_ERR_MISMATCH, "xport handshake: %s", msg);
}

/* ---- prefill -> decode: a plan's runs as one write ------------------- */

kv_status kv_xport_write_plan(kv_xport_peer *peer, const kv_plan *plan, kv_xport_mem *local,
                              uint64_t local_base_off, const uint32_t *src_blocks, uint32_t n_src,
                              kv_xport_rmem *remote, uint64_t remote_base_off,
                              const uint32_t *dst_blocks, uint32_t n_dst, uint64_t n_tokens,
                              const struct kv_xport_notify *notify, kv_xport_xfer **xfer)
{
    static const char fn[] = "xport_write_plan";
    if (!peer || !plan || !local || !remote || !xfer || (n_src && !src_blocks) ||
        (n_dst && !dst_blocks))
        return kv__error(KV_ERR_NULL,
                         "%s: a NULL argument (peer, plan, local, remote, xfer, "
                         "block lists)",
                         fn);
    const struct kv_layout *sl = &plan->src, *dl = &plan->dst;
    if (n_tokens == 0 || n_src != kv__plan_blocks(sl, n_tokens) ||
        n_dst != kv__plan_blocks(dl, n_tokens))
        return kv__error(KV_ERR_BAD_SHAPE,
                         "%s: %" PRIu64 " tokens need %" PRIu64 " source and %" PRIu64
                         " destination blocks, got %u and %u",
                         fn, n_tokens, kv__plan_blocks(sl, n_tokens), kv__plan_blocks(dl, n_tokens),
                         n_src, n_dst);
    kv_status st = kv__plan_check_ids(fn, "source", src_blocks, n_src, sl->num_blocks);
    if (st == KV_OK)
        st = kv__plan_check_ids(fn, "destination", dst_blocks, n_dst, dl->num_blocks);
    if (st == KV_OK)
        st = kv__plan_check_unique(fn, dst_blocks, n_dst, NULL, 0);
    if (st != KV_OK)
        return st;
    /* Both caches whole inside their regions: then every run is. */
    if (!range_ok(local->bytes, local_base_off, (uint64_t)sl->total_bytes) ||
        !range_ok(remote->bytes, remote_base_off, (uint64_t)dl->total_bytes))
        return kv__error(KV_ERR_OUT_OF_BOUNDS,
                         "%s: a cache outside its region: source [%" PRIu64 ", +%" PRIu64
                         ") in %" PRIu64 " bytes, destination [%" PRIu64 ", +%" PRIu64
                         ") in %" PRIu64,
                         fn, local_base_off, (uint64_t)sl->total_bytes, local->bytes,
                         remote_base_off, (uint64_t)dl->total_bytes, remote->bytes);
    const int64_t items = kv__plan_items(plan, n_tokens);
    uint64_t cap = 0;
    for (int64_t w = 0; w < items; w++) {
        int64_t si, di;
        const struct kv__plan_copy *cp = kv__plan_item(plan, w, n_src, n_dst, &si, &di);
        if (cp)
            cap += (uint64_t)cp->height;
    }
    if (cap > UINT32_MAX)
        return kv__error(KV_ERR_TOO_COSTLY, "%s: %" PRIu64 " runs (more than 2^32)", fn, cap);
    struct kv_xport_io *ios = kv__mem_alloc((cap ? cap : 1) * sizeof(*ios));
    if (!ios)
        return kv__error(KV_ERR_NO_MEMORY, "%s: %" PRIu64 " entries", fn, cap);
    uint32_t n = 0;
    for (int64_t w = 0; w < items; w++) {
        int64_t si, di;
        const struct kv__plan_copy *cp = kv__plan_item(plan, w, n_src, n_dst, &si, &di);
        if (!cp)
            continue;
        const uint64_t sb = local_base_off +
                            (uint64_t)src_blocks[si] * (uint64_t)sl->stride_block_bytes +
                            (uint64_t)cp->src_rel;
        const uint64_t db = remote_base_off +
                            (uint64_t)dst_blocks[di] * (uint64_t)dl->stride_block_bytes +
                            (uint64_t)cp->dst_rel;
        for (int64_t r = 0; r < cp->height; r++) {
            const uint64_t lo = sb + (uint64_t)(r * cp->src_pitch);
            const uint64_t ro = db + (uint64_t)(r * cp->dst_pitch);
            struct kv_xport_io *prev = n ? &ios[n - 1] : NULL;
            if (prev && prev->local_off + prev->bytes == lo &&
                prev->remote_off + prev->bytes == ro) {
                prev->bytes += (uint64_t)cp->width;
                continue;
            }
            ios[n++] = (struct kv_xport_io){.local = local,
                                            .local_off = lo,
                                            .remote = remote,
                                            .remote_off = ro,
                                            .bytes = (uint64_t)cp->width};
        }
    }
    st = kv_xport_write(peer, ios, n, notify, xfer);
    kv__mem_free(ios);
    return st;
}
