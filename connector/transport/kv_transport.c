/*
 * kv_transport.c - the transport seam's generic layer (kv_xport_int.h): the
 * transport and its peers (create, destroy and what the caller still holds;
 * connect, accept, wait, close; ids, reference counts) and the queue of
 * notifications with the limits a peer is held to. Regions and exposures
 * are in kv_xport_mem.c, transfers in kv_xport_xfer.c; the bytes move in
 * the backends (kv_xport_tcp*.c, kv_xport_rdma*_verbs.c); the codecs are in
 * kv_xport_codec.c, plan expansion in kv_xport_plan.c.
 */
#include <arpa/inet.h>
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
    case KV_XPORT_SHM:
        return "shm";
    case KV_XPORT_AUTO:
        return "auto";
    }
    return "unknown";
}

/* mu held: wait on x->cv until ts; false once it passed. A manual
 * transport (no progress thread) makes one round of progress instead. */
bool kv__xport_wait_until(kv_xport *x, const struct timespec *ts)
{
    if (x->manual) {
        pthread_mutex_unlock(&x->mu);
        kv__xport_step(x, 0);
        pthread_mutex_lock(&x->mu);
        return kv__now_ns() < (uint64_t)ts->tv_sec * 1000000000ull + (uint64_t)ts->tv_nsec;
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
    if (cfg->kind != KV_XPORT_TCP && cfg->kind != KV_XPORT_RDMA && cfg->kind != KV_XPORT_SHM &&
        cfg->kind != KV_XPORT_AUTO)
        return kv__error(KV_ERR_INVALID_ARG,
                         "xport_create: kind %d (tcp %d, rdma %d, shm %d, auto %d)", (int)cfg->kind,
                         KV_XPORT_TCP, KV_XPORT_RDMA, KV_XPORT_SHM, KV_XPORT_AUTO);
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
    c->plan_gather_below_bytes =
        c->plan_gather_below_bytes ? c->plan_gather_below_bytes : KV_XPORT_GATHER_BELOW_DEFAULT;
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

void kv__xport_wake_pipe(int fd)
{
    const char c = 1;
    ssize_t r = write(fd, &c, 1);
    (void)r; /* a full pipe is already a pending wake-up */
}

void kv__xport_wake_drain(int fd)
{
    char b[64];
    while (read(fd, b, sizeof(b)) > 0) {
    }
}

/* Append ", <n> <what>" and, when given, " (ids a b ...)" to buf. */
void kv__xport_held_say(char *buf, size_t cap, uint64_t n, const char *what, const uint64_t *ids,
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
    const uint64_t xfers = x->n_xfers, rmems = x->n_rmems, holds = x->n_holds,
                   waiting = x->n_waiting;
    pthread_mutex_unlock(&x->mu);
    if (peers || mems || xfers || rmems || holds || waiting) {
        char held[400] = "";
        kv__xport_held_say(held, sizeof(held), peers, "peer(s) not closed", pid,
                           (uint32_t)(peers < 4 ? peers : 4));
        kv__xport_held_say(held, sizeof(held), mems, "region(s) registered", mid,
                           (uint32_t)(mems < 4 ? mems : 4));
        kv__xport_held_say(held, sizeof(held), rmems, "imported region(s) not freed", NULL, 0);
        kv__xport_held_say(held, sizeof(held), xfers, "transfer(s) not freed", NULL, 0);
        kv__xport_held_say(held, sizeof(held), holds,
                           "layer-by-layer request(s) not reported (kv_xlayer_tx_finished)", NULL,
                           0);
        kv__xport_held_say(
            held, sizeof(held), waiting,
            "thread(s) inside kv_xport_accept, kv_xport_notify_poll or kv_xport_peer_close", NULL,
            0);
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

static kv_status info_get(kv_xport *x, kv_xport_peer *p, struct kv_xport_info *out, const char *fn)
{
    kv_status st = kv__check_struct_size(fn, "kv_xport_info", out->struct_size, sizeof(*out));
    if (st != KV_OK)
        return st;
    memset(out, 0, sizeof(*out));
    out->struct_size = sizeof(*out);
    out->kind = x->cfg.kind;
    out->path = p ? p->ops->kind : x->cfg.kind;
    snprintf(out->path_why, sizeof(out->path_why), "configured");
    out->rdma_gid_index = -1;
    pthread_mutex_lock(&x->mu);
    if (x->ops->info)
        x->ops->info(x, p, out);
    pthread_mutex_unlock(&x->mu);
    return KV_OK;
}

kv_status kv_xport_info_get(kv_xport *x, struct kv_xport_info *out)
{
    if (!x || !out)
        return kv__error(KV_ERR_NULL, "xport_info_get: %s is NULL", !x ? "x" : "out");
    return info_get(x, NULL, out, "xport_info_get");
}

kv_status kv_xport_peer_info_get(kv_xport_peer *peer, struct kv_xport_info *out)
{
    if (!peer || !out)
        return kv__error(KV_ERR_NULL, "xport_peer_info_get: %s is NULL", !peer ? "peer" : "out");
    return info_get(peer->x, peer, out, "xport_peer_info_get");
}

static const char *link_name(kv_xport_link l)
{
    return l == KV_XPORT_LINK_INFINIBAND ? "infiniband"
           : l == KV_XPORT_LINK_ETHERNET ? "ethernet"
                                         : "none";
}

static const char *gid_type_name(kv_xport_gid_type t)
{
    static const char *const n[] = {"none", "IB", "RoCE v1", "RoCE v2"};
    return (unsigned)t < 4 ? n[t] : "?";
}

static void gid_str(const uint8_t g[16], char *buf, size_t cap)
{
    if (!inet_ntop(AF_INET6, g, buf, (socklen_t)cap))
        snprintf(buf, cap, "?");
}

/* One rail as "device D port P link lid L gid[i] G (type) mtu M[ numa N[
 * pci B]]" (B when known), then, when connected, " | qps ... gid RG". */
static int rail_format(const struct kv_xport_rail_info *r, bool numa, char *buf, size_t cap)
{
    char g[INET6_ADDRSTRLEN], rg[INET6_ADDRSTRLEN], nn[64] = "";
    gid_str(r->gid, g, sizeof(g));
    gid_str(r->remote_gid, rg, sizeof(rg));
    if (numa)
        snprintf(nn, sizeof(nn), " numa %d%s%.*s", r->numa_node, r->pci_bus_id[0] ? " pci " : "",
                 (int)sizeof(r->pci_bus_id), r->pci_bus_id);
    char head[320];
    snprintf(head, sizeof(head), "device %s port %u %s lid %u gid[%d] %s (%s) mtu %u%s", r->device,
             r->port, link_name(r->link), r->lid, r->gid_index, r->gid_index >= 0 ? g : "-",
             gid_type_name(r->gid_type), r->active_mtu, nn);
    if (r->qps == 0)
        return snprintf(buf, cap, "%s", head);
    return snprintf(buf, cap, "%s | qps %u path_mtu %u %s hop_limit %u remote lid %u gid %s", head,
                    r->qps, r->path_mtu, r->grh ? "grh" : "no-grh", r->hop_limit, r->remote_lid,
                    rg);
}

int kv_xport_info_format(const struct kv_xport_info *in, char *buf, size_t cap)
{
    if (!in)
        return snprintf(buf, cap, "(null)");
    if (in->kind == KV_XPORT_AUTO)
        return snprintf(buf, cap, "auto path %s (%.*s)", kv_xport_kind_name(in->path),
                        (int)sizeof(in->path_why), in->path_why);
    if (in->kind != KV_XPORT_RDMA)
        return snprintf(buf, cap, "%s", kv_xport_kind_name(in->kind));
    if (in->rdma_rails <= 1) { /* rail 0 from the top-level fields */
        const struct kv_xport_rail_info r0 = {
            .port = in->rdma_port,
            .link = in->rdma_link,
            .lid = in->rdma_lid,
            .gid_index = in->rdma_gid_index,
            .gid_type = in->rdma_gid_type,
            .active_mtu = in->rdma_active_mtu,
            .qps = in->rdma_qps,
            .path_mtu = in->rdma_path_mtu,
            .grh = in->rdma_grh,
            .hop_limit = in->rdma_hop_limit,
            .remote_lid = in->rdma_remote_lid,
        };
        struct kv_xport_rail_info r = r0;
        memcpy(r.device, in->rdma_device, sizeof(r.device));
        r.device[sizeof(r.device) - 1] = 0;
        memcpy(r.gid, in->rdma_gid, 16);
        memcpy(r.remote_gid, in->rdma_remote_gid, 16);
        char line[512];
        rail_format(&r, false, line, sizeof(line));
        return snprintf(buf, cap, "rdma %s", line);
    }
    /* Several rails: built in a local buffer, then copied (snprintf's
     * contract: the length needed, whatever cap). */
    const uint32_t n = in->rdma_rails < KV_XPORT_MAX_RAILS ? in->rdma_rails : KV_XPORT_MAX_RAILS;
    char all[KV_XPORT_MAX_RAILS * 520 + 64];
    size_t len = (size_t)snprintf(all, sizeof(all), "rdma rails %u (peer %u):", in->rdma_rails,
                                  in->rdma_peer_rails);
    for (uint32_t i = 0; i < n && len < sizeof(all); i++) {
        char line[512];
        rail_format(&in->rdma_rail[i], true, line, sizeof(line));
        len +=
            (size_t)snprintf(all + len, sizeof(all) - len, "%s rail %u %s", i ? ";" : "", i, line);
    }
    return snprintf(buf, cap, "%s", all);
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
    /* AUTO: TCP until its connect (or the SHM backend's accept) says otherwise */
    p->ops = x->ops->kind == KV_XPORT_AUTO ? &kv__xport_tcp_ops : x->ops;
    /* A connection's id: distinct per connection and process (the blob of
     * one connection does not import on another). */
    static _Atomic uint64_t counter;
    const uint64_t c = ++counter;
    p->nonce_local =
        kv__xxh3_64(&(uint64_t[3]){kv__now_ns(), (uint64_t)getpid(), c}, 3 * sizeof(uint64_t)) | 1;
    p->next = x->peers;
    x->peers = p;
    return p;
}

uint64_t kv_xport_peer_id(const kv_xport_peer *peer)
{
    return peer ? peer->id : 0;
}

/* mu held: end every exposure of p (the backend refuses what it queued of
 * each; nothing of p is busy in them: the backend released that first).
 * The backend's unexpose may drop mu (RDMA: ibv_dereg_mr), so another
 * caller can see p CLOSED meanwhile: n_expo_ending counts the exposures
 * taken out of the table whose region still counts them as a user, and
 * kv_xport_peer_close waits for it to reach 0 (signalled here). */
static void expos_end(kv_xport_peer *p)
{
    while (p->n_exposed) {
        struct kv__xport_expo *e = p->exposed[--p->n_exposed];
        p->n_expo_ending++;
        p->ops->unexpose(p, e);
        e->mem->users--;
        kv__mem_free(e);
        if (--p->n_expo_ending == 0)
            kv__xport_signal(p->x);
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
    kv__xport_signal(x);
}

void kv__xport_peer_closed(kv_xport_peer *p, kv_status why, const char *msg)
{
    kv_xport *x = p->x;
    /* A peer that never got through its handshake never appears: what it
     * queued before (an outgoing peer's listener may send first) goes. */
    uint32_t dropped = 0;
    if (p->state == KV_XPORT_CONNECTING)
        for (struct kv__xport_note **pp = &x->note_head, *prev = NULL; *pp;) {
            struct kv__xport_note *n = *pp;
            if (n->peer != p) {
                prev = n;
                pp = &n->next;
                continue;
            }
            *pp = n->next;
            if (x->note_tail == n)
                x->note_tail = prev;
            p->n_notes--;
            x->stats.notes_refused++;
            kv__mem_free(n);
            dropped++;
        }
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
    kv__xport_signal(x);
    /* the dropped notes' references, last: the caller holds one (p lives) */
    while (dropped--)
        kv__xport_peer_unref(p);
}

kv_status kv_xport_connect(kv_xport *x, const char *host, uint16_t port, kv_xport_peer **peer)
{
    if (!x || !host || !peer)
        return kv__error(KV_ERR_NULL, "xport_connect: %s is NULL",
                         !x      ? "x"
                         : !host ? "host"
                                 : "peer");
    if ((port == 0 && !(x->cfg.kind == KV_XPORT_SHM && host[0] == '/')) || !*host)
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
    const struct timespec ts = kv__deadline_ts(timeout_ms);
    pthread_mutex_lock(&x->mu);
    x->n_waiting++; /* kv_xport_destroy refuses while a thread waits here */
    while (!x->accept_head)
        if (!kv__xport_wait_until(x, &ts))
            break;
    x->n_waiting--;
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
    const struct timespec ts = kv__deadline_ts(timeout_ms);
    pthread_mutex_lock(&x->mu);
    while (peer->state == KV_XPORT_CONNECTING)
        if (!kv__xport_wait_until(x, &ts))
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
    x->n_waiting++; /* kv_xport_destroy refuses until this returns */
    if (!peer->user_closed) {
        peer->user_closed = true;
        peer->ops->peer_close(peer);
        /* Nothing of it may be in flight once this returns, and every
         * region it had exposed is free to deregister. */
        const struct timespec never = {.tv_sec = (time_t)1 << 40};
        while (peer->xfers || peer->state != KV_XPORT_CLOSED || peer->n_expo_ending)
            if (x->manual)
                (void)kv__xport_wait_until(x, &never);
            else
                pthread_cond_wait(&x->cv, &x->mu);
    }
    kv__xport_peer_unref(peer);
    x->n_waiting--;
    pthread_mutex_unlock(&x->mu);
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
    kv__xport_signal(x);
    return KV_OK;
}

kv_status kv_xport_notify_poll(kv_xport *x, uint32_t timeout_ms, struct kv_xport_msg *out)
{
    if (!x || !out)
        return kv__error(KV_ERR_NULL, "xport_notify_poll: %s is NULL", !x ? "x" : "out");
    const struct timespec ts = kv__deadline_ts(timeout_ms);
    pthread_mutex_lock(&x->mu);
    x->n_waiting++; /* kv_xport_destroy refuses while a thread waits here */
    while (!x->note_head)
        if (!kv__xport_wait_until(x, &ts))
            break;
    x->n_waiting--;
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
