/*
 * kv_xport_rdma_verbs.c - the RDMA backend of the transport seam
 * (kv_xport_int.h): RC queue pairs, one-sided RDMA WRITE / READ straight
 * between registered regions, every verbs call through kv__verbs_get()
 * (kv_verbs_int.h), so tests run it over the software device.
 *
 * Model:
 *
 *   parameters    device, port and GID from the config or chosen at start
 *                 (pick_port, pick_gid: the first ACTIVE port, the RoCE v2
 *                 IPv4-mapped GID on Ethernet, index 0 on InfiniBand); the
 *                 path per peer from both INFO (got_info: path MTU the
 *                 smaller active MTU, a GRH on Ethernet or across IB
 *                 subnets, the LID otherwise); all reported (rdma_info).
 *
 *   out of band   an internal TCP kv_xport (same token, fingerprint, host,
 *                 port; one connection per peer) carries the checked
 *                 handshake (version, token, fingerprint) and then, as its
 *                 notifications, INFO (per QP: qpn, psn; the GID, LID,
 *                 link layer and active MTU; this side's connection id)
 *                 and READY (every QP of the sender
 *                 is RTR/RTS). A peer is READY once both INFO were applied
 *                 (INIT -> RTR -> RTS) and the other side's READY came, so
 *                 nothing is sent to a QP that cannot take it yet. A dead
 *                 OOB peer closes the RDMA peer.
 *   regions       one local-access MR per chunk of at most max_mr_size
 *                 bytes (rounded down to 4 KiB) for the SGEs of our own
 *                 WRs; each exposure to a peer registers the region again,
 *                 remote access only, with its own rkeys: the blob key is
 *                 the chunk count, the chunk size, the region's virtual
 *                 base and each of that exposure's rkeys. Unexposing (or
 *                 closing the peer) deregisters them: the peer's rkeys stop
 *                 working at the NIC.
 *   writes/reads  a WR is one remote-contiguous range inside one remote
 *                 chunk, gathered from up to max_sge local pieces (each
 *                 inside one local chunk), WRs round robin over the peer's
 *                 QPs. Every 16th WR of a posting round and its last are
 *                 signaled; a QP's ring of WR records (wr_id = sequence)
 *                 retires in order, so a signaled completion retires the
 *                 unsignaled WRs before it (RC completes in order), and a
 *                 QP never holds more than max_send_wr WRs whose slots are
 *                 not freed. An entry ends KV_OK when every byte of it was
 *                 covered by a successful completion: results are exact.
 *   notifications a SEND on QP 0 (a 16-byte header: magic, tag, length,
 *                 then the message) into a receive buffer the receiver
 *                 pre-posted (registered), sent only when every earlier
 *                 write on the peer has completed (kv__xport_note_may_go):
 *                 with several QPs RC orders nothing across QPs, so the
 *                 gate is on completions, not on posting order. Its
 *                 completion ends the transfer DONE. The receiver turns
 *                 the receive completion into kv__xport_note_push and
 *                 re-posts the buffer.
 *   errors        a completion error ends its entries with a status
 *                 mapped from ibv_wc_status (REM_ACCESS_ERR ->
 *                 KV_ERR_OUT_OF_BOUNDS, others KV_ERR_IO; the wc status
 *                 string in the peer's message) and closes the peer: every
 *                 QP goes to ERR, a signaled marker WR is posted behind
 *                 what is outstanding, and only once each marker's flush
 *                 completion arrived (nothing of the peer in flight any
 *                 more) are transfers ended and QPs destroyed. A transfer
 *                 past its deadline with nothing outstanding ends
 *                 TIMED_OUT; with WRs outstanding it cannot be taken back:
 *                 the peer is closed that way and the transfer ends
 *                 TIMED_OUT after the drain. A cancel waits until nothing
 *                 of the transfer is outstanding. WRs retired by a marker
 *                 without their own completion count as not done.
 *
 * Receiver-side bounds: the NIC enforces them. A peer can address only
 * what an MR covers with the rkey it holds, and it learns rkeys only from
 * the blobs of regions exposed to it (kv_xport_mem_expose); a write outside
 * an MR is refused by the responder (REM_ACCESS_ERR: nothing written, the
 * sender's entry FAILED with KV_ERR_OUT_OF_BOUNDS), and so is one with the
 * rkey of an exposure that ended. What RDMA cannot give that TCP does:
 * regions of one transport share a PD, so an rkey leaked to another peer of
 * the same transport would work there too while its exposure lasts.
 *
 * Threads: one progress thread per transport makes every terminal
 * transition and every post/poll (the rule of kv_xport_tcp.c); it drops
 * x->mu around verbs calls and around calls into the OOB transport (whose
 * own lock is never held while taking x->mu, so the order is x->mu ->
 * oob). WR records name transfers by id (kv__xport_xfer_find), never by
 * pointer, and a transfer's `busy` counts its WRs not yet retired.
 *
 * Waiting (progress): in event mode (the default) every peer's CQ is
 * created on one completion channel and armed (req_notify_cq, one-shot)
 * before it is polled; with nothing to do the thread sleeps in poll() on
 * the channel's fd and an eventfd, which kv__rd_kick (a post, a cancel, a
 * close, a connect, stop) and the OOB transport's on_signal (a peer, a
 * notification) write, for at most the nearest deadline (handshakes,
 * drains, transfers). An event is got, acknowledged at once (destroy_cq
 * waits for acks) and its CQ re-armed before it is polled again: a
 * completion that lands between the poll and the sleep finds the CQ armed.
 * Idle, the thread uses no CPU. With cfg.rdma_busy_poll it instead polls
 * every 0.2 ms (a condition-variable wait), as before events existed.
 */
#include <errno.h>
#include <inttypes.h>
#include <netdb.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "kv_mem.h"
#include "kv_xport_rdma_int.h"

static void *progress(void *arg);

/* mu NOT needed: note the first teardown call that failed (rc != 0). */
void kv__rd_teardown_check(struct rdma *r, int rc, const char *what)
{
    if (rc == 0 || r->teardown != KV_OK)
        return;
    r->teardown = KV_ERR_DEVICE;
    snprintf(r->teardown_msg, sizeof(r->teardown_msg), "xport rdma: %s on %s: %s", what, r->dev,
             strerror(rc < 0 ? -rc : rc));
}

/* Destroy an internal transport on an error path, keeping the caller's
 * error message. */
static void oob_destroy_quiet(kv_xport *oob)
{
    kv__error_mute();
    if (kv_xport_destroy(oob) != KV_OK)
        kv__error_clear();
    kv__error_unmute();
}

kv_status kv__rd_wc_status(enum ibv_wc_status s)
{
    switch (s) {
    case IBV_WC_SUCCESS:
        return KV_OK;
    case IBV_WC_REM_ACCESS_ERR:
        return KV_ERR_OUT_OF_BOUNDS;
    case IBV_WC_LOC_PROT_ERR:
    case IBV_WC_LOC_ACCESS_ERR:
        return KV_ERR_INVALID_ARG;
    case IBV_WC_REM_INV_REQ_ERR:
        return KV_ERR_INVALID_ARG;
    default: /* RETRY_EXC, RNR_RETRY_EXC, WR_FLUSH, REM_OP ... */
        return KV_ERR_IO;
    }
}

const char *kv__rd_wc_str(enum ibv_wc_status s)
{
    return ibv_wc_status_str(s);
}

/* Wake the progress thread's poll() (event mode); safe from any thread,
 * with or without a lock (the OOB transport's on_signal). */
static void wake_write(const struct rdma *r)
{
    if (r->wake_fd < 0)
        return;
    const uint64_t one = 1;
    const ssize_t n = write(r->wake_fd, &one, sizeof(one));
    (void)n; /* EAGAIN: the counter is at its maximum, a wake-up already pending */
}

static void oob_signal(void *arg)
{
    wake_write(arg);
}

void kv__rd_kick(kv_xport *x)
{
    pthread_cond_broadcast(&x->cv);
    if (x->be)
        wake_write(x->be);
}

/* Event mode: the completion channel (fd non-blocking) and the eventfd. */
static kv_status events_open(struct rdma *r)
{
    r->ch = r->v->create_comp_channel(r->ctx);
    if (!r->ch)
        return kv__error(KV_ERR_IO, "xport_create(rdma): create_comp_channel on %s: %s", r->dev,
                         strerror(errno));
    const int fl = fcntl(r->ch->fd, F_GETFL);
    if (fl < 0 || fcntl(r->ch->fd, F_SETFL, fl | O_NONBLOCK) != 0) {
        const int e = errno;
        kv__rd_teardown_check(r, r->v->destroy_comp_channel(r->ch), "ibv_destroy_comp_channel");
        r->ch = NULL;
        return kv__error(KV_ERR_IO, "xport_create(rdma): O_NONBLOCK on the completion channel: %s",
                         strerror(e));
    }
    r->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (r->wake_fd < 0) {
        const int e = errno;
        kv__rd_teardown_check(r, r->v->destroy_comp_channel(r->ch), "ibv_destroy_comp_channel");
        r->ch = NULL;
        return kv__error(KV_ERR_IO, "xport_create(rdma): eventfd: %s", strerror(e));
    }
    return KV_OK;
}

static void events_close(struct rdma *r)
{
    if (r->ch)
        kv__rd_teardown_check(r, r->v->destroy_comp_channel(r->ch), "ibv_destroy_comp_channel");
    r->ch = NULL;
    if (r->wake_fd >= 0)
        close(r->wake_fd);
    r->wake_fd = -1;
}

static const char *port_state_str(enum ibv_port_state s)
{
    switch (s) {
    case IBV_PORT_DOWN:
        return "DOWN";
    case IBV_PORT_INIT:
        return "INIT";
    case IBV_PORT_ARMED:
        return "ARMED";
    case IBV_PORT_ACTIVE:
        return "ACTIVE";
    default:
        return "not active";
    }
}

/* Append to buf[cap] (a note of what was tried, for the error message). */
static void say(char *buf, size_t cap, const char *fmt, ...) KV_PRINTF(3, 4);
static void say(char *buf, size_t cap, const char *fmt, ...)
{
    const size_t len = strlen(buf);
    if (len + 1 >= cap)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf + len, cap - len, fmt, ap);
    va_end(ap);
}

/* How much a GID suits RoCE (higher is better), NCCL's order: RoCE v2
 * with an IPv4-mapped address, then other RoCE v2 (not link-local), then
 * any RoCE v2, then RoCE v1. */
static int gid_score(const struct ibv_gid_entry *e)
{
    static const uint8_t v4[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    const bool mapped = memcmp(e->gid.raw, v4, 12) == 0;
    const bool link_local = e->gid.raw[0] == 0xfe && (e->gid.raw[1] & 0xc0) == 0x80;
    if (e->gid_type != IBV_GID_TYPE_ROCE_V2)
        return 0;
    return mapped ? 3 : !link_local ? 2 : 1;
}

/* The GID: cfg's index (it must hold a GID), else automatic (Ethernet:
 * the best gid_score, lowest index on a tie; InfiniBand: index 0, or none
 * when the port has no GID there: then no GRH is possible). */
static kv_status pick_gid(struct rdma *r, int32_t want)
{
    const struct kv__verbs *v = r->v;
    struct ibv_gid_entry e;
    r->gid_index = -1;
    if (want < -1)
        return kv__error(KV_ERR_INVALID_ARG,
                         "xport_create(rdma): rdma_gid_index %d (an index >= 0, or -1: automatic)",
                         want);
    if (want >= 0) {
        if (want >= r->pa.gid_tbl_len)
            return kv__error(KV_ERR_INVALID_ARG,
                             "xport_create(rdma): rdma_gid_index %d, but %s port %u has %d GIDs",
                             want, r->dev, r->port, r->pa.gid_tbl_len);
        const int err = v->query_gid_ex(r->ctx, r->port, (uint32_t)want, &e, 0);
        if (err != 0)
            return kv__error(err == ENODATA ? KV_ERR_INVALID_ARG : KV_ERR_IO,
                             "xport_create(rdma): GID index %d of %s port %u: %s", want, r->dev,
                             r->port, err == ENODATA ? "empty" : strerror(err));
        r->gid_index = want;
        r->gid = e.gid;
        r->gid_type = (enum ibv_gid_type)e.gid_type;
        return KV_OK;
    }
    int best = -1;
    for (int i = 0; i < r->pa.gid_tbl_len; i++) {
        if (v->query_gid_ex(r->ctx, r->port, (uint32_t)i, &e, 0) != 0)
            continue; /* empty (ENODATA) or unreadable: not a candidate */
        const int sc = gid_score(&e);
        if (r->link == IBV_LINK_LAYER_INFINIBAND || sc > best) {
            best = sc;
            r->gid_index = i;
            r->gid = e.gid;
            r->gid_type = (enum ibv_gid_type)e.gid_type;
        }
        if (r->link == IBV_LINK_LAYER_INFINIBAND || sc == 3)
            break; /* InfiniBand: the first; RoCE: none scores higher */
    }
    if (r->gid_index < 0 && r->link == IBV_LINK_LAYER_ETHERNET)
        return kv__error(KV_ERR_UNSUPPORTED,
                         "xport_create(rdma): %s port %u (ethernet) has no GID among %d entries "
                         "(RoCE needs one: is an IP address configured on its netdev?)",
                         r->dev, r->port, r->pa.gid_tbl_len);
    return KV_OK;
}

/* Device and port: cfg's device by name (else each in list order) and
 * cfg's port (else its first ACTIVE one); r->ctx open on success. Every
 * device and port looked at is named in the error when none fits. */
static kv_status pick_port(struct rdma *r, struct ibv_device **list, int num)
{
    const struct kv__verbs *v = r->v;
    const struct kv_xport_config *cfg = &r->x->cfg;
    char seen[512] = "", names[512] = "";
    bool named = false;
    if (cfg->rdma_port > 255)
        return kv__error(KV_ERR_INVALID_ARG, "xport_create(rdma): rdma_port %u (ports are 1..255)",
                         cfg->rdma_port);
    for (int d = 0; d < num; d++) {
        const char *name = v->get_device_name(list[d]);
        say(names, sizeof(names), "%s%s", names[0] ? ", " : "", name ? name : "?");
        if (cfg->rdma_device && strcmp(cfg->rdma_device, name ? name : "") != 0)
            continue;
        named = true;
        snprintf(r->dev, sizeof(r->dev), "%s", name ? name : "?");
        r->ctx = v->open_device(list[d]);
        int e = r->ctx ? v->query_device(r->ctx, &r->da) : (errno ? errno : ENODEV);
        if (e != 0) {
            if (r->ctx)
                (void)v->close_device(r->ctx);
            r->ctx = NULL;
            if (cfg->rdma_device)
                return kv__error(KV_ERR_IO, "xport_create(rdma): open/query %s: %s", r->dev,
                                 strerror(e));
            say(seen, sizeof(seen), "%s%s: %s", seen[0] ? ", " : "", r->dev, strerror(e));
            continue;
        }
        if (cfg->rdma_port > (uint32_t)r->da.phys_port_cnt) {
            (void)v->close_device(r->ctx);
            r->ctx = NULL;
            if (!cfg->rdma_device) { /* another device may have that port */
                say(seen, sizeof(seen), "%s%s: %u ports", seen[0] ? ", " : "", r->dev,
                    (unsigned)r->da.phys_port_cnt);
                continue;
            }
            return kv__error(KV_ERR_INVALID_ARG, "xport_create(rdma): rdma_port %u, but %s has %u",
                             cfg->rdma_port, r->dev, (unsigned)r->da.phys_port_cnt);
        }
        const uint32_t lo = cfg->rdma_port ? cfg->rdma_port : 1;
        const uint32_t hi = cfg->rdma_port ? cfg->rdma_port : r->da.phys_port_cnt;
        for (uint32_t pt = lo; pt <= hi; pt++) {
            e = v->query_port(r->ctx, (uint8_t)pt, &r->pa);
            if (e != 0) {
                say(seen, sizeof(seen), "%s%s port %u: %s", seen[0] ? ", " : "", r->dev, pt,
                    strerror(e));
                continue;
            }
            if (r->pa.state != IBV_PORT_ACTIVE) {
                say(seen, sizeof(seen), "%s%s port %u %s", seen[0] ? ", " : "", r->dev, pt,
                    port_state_str(r->pa.state));
                continue;
            }
            r->port = (uint8_t)pt;
            r->link = r->pa.link_layer == IBV_LINK_LAYER_ETHERNET ? IBV_LINK_LAYER_ETHERNET
                                                                  : IBV_LINK_LAYER_INFINIBAND;
            if (r->link == IBV_LINK_LAYER_INFINIBAND && (r->pa.lid == 0 || r->pa.lid > 0xbfff)) {
                say(seen, sizeof(seen), "%s%s port %u ACTIVE but LID 0x%x (no subnet manager?)",
                    seen[0] ? ", " : "", r->dev, pt, r->pa.lid);
                continue;
            }
            if (kv__rd_mtu_bytes(r->pa.active_mtu) == 0) {
                say(seen, sizeof(seen), "%s%s port %u active MTU code %d", seen[0] ? ", " : "",
                    r->dev, pt, (int)r->pa.active_mtu);
                continue;
            }
            return KV_OK;
        }
        (void)v->close_device(r->ctx);
        r->ctx = NULL;
    }
    if (cfg->rdma_device && !named)
        return kv__error(KV_ERR_NOT_FOUND,
                         "xport_create(rdma): no RDMA device \"%s\" (%s lists: %s)",
                         cfg->rdma_device, v->name, names);
    if (cfg->rdma_port)
        return kv__error(KV_ERR_UNSUPPORTED, "xport_create(rdma): rdma_port %u not usable (%s)",
                         cfg->rdma_port, seen);
    if (cfg->rdma_device)
        return kv__error(KV_ERR_UNSUPPORTED, "xport_create(rdma): no ACTIVE port on %s (%s)",
                         cfg->rdma_device, seen);
    return kv__error(KV_ERR_UNSUPPORTED, "xport_create(rdma): no ACTIVE port on any device (%s)",
                     seen);
}

static kv_status rdma_start(kv_xport *x)
{
    const struct kv__verbs *v = NULL;
    kv_status st = kv__verbs_acquire(&v);
    if (st != KV_OK)
        return kv__error_wrap(st, "xport_create(rdma)");
    struct rdma *r = kv__mem_calloc(1, sizeof(*r));
    if (!r)
        return kv__error(KV_ERR_NO_MEMORY, "xport_create: rdma state");
    r->x = x;
    r->v = v;
    r->wake_fd = -1;
    r->busy_poll = x->cfg.rdma_busy_poll;
    int num = 0;
    struct ibv_device **list = v->get_device_list(&num);
    if (!list || num <= 0) {
        if (list)
            v->free_device_list(list);
        st = kv__error(KV_ERR_UNSUPPORTED,
                       "xport_create(rdma): no RDMA device found (%s: ibv_get_device_list "
                       "lists none)",
                       v->name);
        goto fail_state;
    }
    st = pick_port(r, list, num);
    v->free_device_list(list);
    if (st != KV_OK)
        goto fail_state;
    st = pick_gid(r, x->cfg.rdma_gid_index);
    if (st != KV_OK)
        goto fail_ctx;
    int e;
    if (r->da.max_qp_wr < (int)RD_SQ_WR || r->da.max_sge < 1 || r->da.max_mr_size < 4096) {
        st = kv__error(KV_ERR_UNSUPPORTED,
                       "xport_create(rdma): %s: max_qp_wr %d (need %u), max_sge %d, "
                       "max_mr_size %" PRIu64,
                       r->dev, r->da.max_qp_wr, RD_SQ_WR, r->da.max_sge,
                       (uint64_t)r->da.max_mr_size);
        goto fail_ctx;
    }
    r->sge = (uint32_t)r->da.max_sge < RD_MAX_SGE ? (uint32_t)r->da.max_sge : RD_MAX_SGE;
    r->chunk = (uint64_t)r->da.max_mr_size & ~4095ull;
    r->pd = v->alloc_pd(r->ctx);
    if (!r->pd) {
        st = kv__error(KV_ERR_IO, "xport_create(rdma): alloc_pd: %s", strerror(errno));
        goto fail_ctx;
    }
    if (!r->busy_poll) {
        st = events_open(r);
        if (st != KV_OK)
            goto fail_pd;
    }
    /* Out of band: the checked TCP handshake and the QP exchange. */
    struct kv_xport_config oc = x->cfg;
    oc.kind = KV_XPORT_TCP;
    oc.conns_per_peer = 1;
    st = kv_xport_create(&oc, &r->oob);
    if (st != KV_OK) {
        st = kv__error_wrap(st, "xport_create(rdma): the out-of-band transport");
        goto fail_events;
    }
    if (!r->busy_poll) { /* its peers and notifications wake our poll() */
        pthread_mutex_lock(&r->oob->mu);
        r->oob->on_signal = oob_signal;
        r->oob->on_signal_arg = r;
        pthread_mutex_unlock(&r->oob->mu);
    }
    x->port = kv_xport_port(r->oob);
    x->be = r;
    e = pthread_create(&r->thr, NULL, progress, r);
    if (e != 0) {
        x->be = NULL;
        st = kv__error(KV_ERR_IO, "xport_create(rdma): progress thread: %s", strerror(e));
        goto fail_oob;
    }
    return KV_OK;

fail_oob:
    oob_destroy_quiet(r->oob);
fail_events:
    events_close(r);
fail_pd:
    (void)v->dealloc_pd(r->pd);
fail_ctx:
    (void)v->close_device(r->ctx);
fail_state:
    kv__mem_free(r);
    return st;
}

static kv_status rdma_stop(kv_xport *x)
{
    struct rdma *r = x->be;
    pthread_mutex_lock(&x->mu);
    r->stop = true;
    kv__rd_kick(x);
    pthread_mutex_unlock(&x->mu);
    pthread_join(r->thr, NULL);
    if (kv_xport_destroy(r->oob) != KV_OK && r->teardown == KV_OK) {
        r->teardown = kv__error_wrap(KV_ERR_BAD_STATE, "xport rdma: the out-of-band transport");
        snprintf(r->teardown_msg, sizeof(r->teardown_msg), "%s", kv_last_error());
    }
    events_close(r); /* after the OOB transport: its thread may still signal */
    kv__rd_teardown_check(r, r->v->dealloc_pd(r->pd), "ibv_dealloc_pd");
    kv__rd_teardown_check(r, r->v->close_device(r->ctx), "ibv_close_device");
    const kv_status st = r->teardown;
    char msg[sizeof(r->teardown_msg)];
    memcpy(msg, r->teardown_msg, sizeof(msg));
    kv__mem_free(r);
    x->be = NULL;
    return st == KV_OK ? KV_OK : kv__error(st, "xport_destroy: %s", msg);
}

static kv_status rdma_connect(kv_xport_peer *p, const char *host, uint16_t port)
{
    kv_xport *x = p->x;
    struct rdma *r = x->be;
    struct rpeer *rp = kv__rd_rpeer_new(r, p, NULL);
    if (!rp)
        return kv__error(KV_ERR_NO_MEMORY, "xport_connect(rdma): peer state");
    kv_status st = kv__rd_peer_verbs(r, rp);
    if (st != KV_OK) {
        kv__rd_peer_verbs_free(r, rp);
        kv__mem_free(rp);
        return st;
    }
    /* The name is resolved first, without x->mu (a DNS lookup must not
     * hold up calls on other peers); the OOB connect of the numeric address
     * then runs under x->mu (the order x->mu -> oob): the progress thread
     * matches the OOB peer's first notification only with x->mu held, so it
     * finds rp listed. */
    char num[NI_MAXHOST];
    {
        struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM};
        struct addrinfo *ai = NULL;
        const int g = getaddrinfo(host, NULL, &hints, &ai);
        int n = g;
        if (g == 0 && ai) {
            n = getnameinfo(ai->ai_addr, ai->ai_addrlen, num, sizeof(num), NULL, 0, NI_NUMERICHOST);
            freeaddrinfo(ai);
        }
        if (g != 0 || n != 0) {
            kv__rd_peer_verbs_free(r, rp);
            kv__mem_free(rp);
            return kv__error(KV_ERR_INVALID_ARG, "xport_connect(rdma): host \"%s\": %s", host,
                             gai_strerror(g != 0 ? g : n));
        }
    }
    pthread_mutex_lock(&x->mu);
    kv_xport_peer *op = NULL;
    st = kv_xport_connect(r->oob, num, port, &op);
    if (st != KV_OK) {
        pthread_mutex_unlock(&x->mu);
        kv__rd_peer_verbs_free(r, rp);
        kv__mem_free(rp);
        return kv__error_wrap(st, "xport_connect(rdma): out of band");
    }
    rp->oob = op;
    rp->oob_id = kv_xport_peer_id(op);
    p->be = rp;
    rp->next = r->peers;
    r->peers = rp;
    kv__rd_kick(x);
    pthread_mutex_unlock(&x->mu);
    return KV_OK;
}

static kv_status rdma_mem_reg(kv_xport_mem *m)
{
    struct rdma *r = m->x->be;
    /* A notification is delivered when the SEND's completion arrives, with
     * no flush READ behind the data (NCCL's ncclIbIflush): the NIC's PCIe
     * writes into GPU memory may still be invisible to a kernel launched on
     * it. Refused until that flush exists (docs/connector.md, "Regions"). */
    if (m->kind == KV_MEM_DEVICE)
        return kv__error(KV_ERR_UNSUPPORTED,
                         "xport_mem_reg(rdma): %s memory (%p, %" PRIu64 " bytes) not yet: a notification "
                         "is delivered without a flush READ, so a kernel could read stale bytes "
                         "(register host or pinned memory)",
                         kv_mem_kind_name(m->kind), (void *)m->base, m->bytes);
    const uint64_t n = (m->bytes + r->chunk - 1) / r->chunk;
    if (n > RD_MAX_CHUNKS)
        return kv__error(KV_ERR_CAPACITY,
                         "xport_mem_reg(rdma): %" PRIu64 " bytes need %" PRIu64
                         " MRs of at most %" PRIu64 " bytes (max_mr_size of %s); a blob holds "
                         "%u",
                         m->bytes, n, r->chunk, r->dev, RD_MAX_CHUNKS);
    struct rmr *rm = kv__mem_calloc(1, sizeof(*rm));
    if (!rm)
        return kv__error(KV_ERR_NO_MEMORY, "xport_mem_reg(rdma): region state");
    rm->chunk = r->chunk;
    /* Our own WRs' SGEs only: a peer reaches the region through the MRs of
     * an exposure (rdma_expose), never these. */
    const int acc = IBV_ACCESS_LOCAL_WRITE;
    for (uint32_t i = 0; i < n; i++) {
        const uint64_t off = (uint64_t)i * r->chunk;
        const uint64_t len = m->bytes - off < r->chunk ? m->bytes - off : r->chunk;
        rm->mr[i] = r->v->reg_mr(r->pd, m->base + off, (size_t)len, acc);
        if (!rm->mr[i]) {
            const int e = errno;
            while (i--)
                r->v->dereg_mr(rm->mr[i]);
            kv__mem_free(rm);
            return kv__error(e == ENOMEM ? KV_ERR_NO_MEMORY : KV_ERR_IO,
                             "xport_mem_reg(rdma): reg_mr of chunk %u (%" PRIu64
                             " bytes at +%" PRIu64 "): %s",
                             (unsigned)(off / r->chunk), len, off, strerror(e));
        }
        rm->n = i + 1;
    }
    m->be = rm;
    return KV_OK;
}

/* Deregister rm's MRs from the last; an error keeps that one and the ones
 * before it (the region stays registered: the caller can retry). */
static kv_status rmr_dereg(struct rdma *r, struct rmr *rm, const char *what)
{
    while (rm->n) {
        const int e = r->v->dereg_mr(rm->mr[rm->n - 1]);
        if (e != 0)
            return kv__error(KV_ERR_DEVICE, "xport rdma: ibv_dereg_mr of %s chunk %u on %s: %s",
                             what, rm->n - 1, r->dev, strerror(e < 0 ? -e : e));
        rm->n--;
    }
    return KV_OK;
}

static kv_status rdma_mem_dereg(kv_xport_mem *m)
{
    struct rdma *r = m->x->be;
    struct rmr *rm = m->be;
    if (!rm)
        return KV_OK;
    const kv_status st = rmr_dereg(r, rm, "a region");
    if (st != KV_OK)
        return kv__error_wrap(st, "xport_mem_dereg: region %u", m->region);
    kv__mem_free(rm);
    m->be = NULL;
    return KV_OK;
}

/* The exposure's own MRs, remote access, the region's chunking; its key
 * (LE): 0 4 chunks, 4 4 reserved, 8 8 chunk bytes, 16 8 base address,
 * 24 4*chunks rkeys. */
static kv_status rdma_expose(kv_xport_peer *p, struct kv__xport_expo *e)
{
    (void)p;
    kv_xport_mem *m = e->mem;
    struct rdma *r = m->x->be;
    const struct rmr *lm = m->be;
    struct rmr *rm = kv__mem_calloc(1, sizeof(*rm));
    if (!rm)
        return kv__error(KV_ERR_NO_MEMORY, "xport_mem_expose(rdma): exposure state");
    rm->chunk = lm->chunk;
    const int acc = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
    for (uint32_t i = 0; i < lm->n; i++) {
        const uint64_t off = (uint64_t)i * rm->chunk;
        const uint64_t len = m->bytes - off < rm->chunk ? m->bytes - off : rm->chunk;
        rm->mr[i] = r->v->reg_mr(r->pd, m->base + off, (size_t)len, acc);
        if (!rm->mr[i]) {
            const int err = errno;
            if (rmr_dereg(r, rm, "an exposure") != KV_OK)
                kv__error_clear(); /* keeps failing: leaked, noted for destroy */
            kv__mem_free(rm);
            return kv__error(err == ENOMEM ? KV_ERR_NO_MEMORY : KV_ERR_IO,
                             "xport_mem_expose(rdma): reg_mr of chunk %u of region %u: %s", i,
                             m->region, strerror(err));
        }
        rm->n = i + 1;
    }
    unsigned char *key = e->key;
    kv__le_put(key, rm->n, 4);
    kv__le_put(key + 4, 0, 4);
    kv__le_put(key + 8, rm->chunk, 8);
    kv__le_put(key + 16, (uint64_t)(uintptr_t)m->base, 8);
    for (uint32_t i = 0; i < rm->n; i++)
        kv__le_put(key + RD_KEY_HEAD + 4 * i, rm->mr[i]->rkey, 4);
    e->key_len = RD_KEY_HEAD + 4 * rm->n;
    e->be = rm;
    return KV_OK;
}

/* mu held (dropped around the verbs calls): the exposure's MRs go, so the
 * rkeys the peer holds stop working. */
static void rdma_unexpose(kv_xport_peer *p, struct kv__xport_expo *e)
{
    struct rmr *rm = e->be;
    kv_xport *x = p->x;
    struct rdma *r = x->be;
    if (!rm || !r)
        return;
    e->be = NULL;
    pthread_mutex_unlock(&x->mu);
    if (rmr_dereg(r, rm, "an exposure") != KV_OK) {
        kv__rd_teardown_check(r, EBUSY, "ibv_dereg_mr of an exposure");
        kv__error_clear();
    }
    pthread_mutex_lock(&x->mu);
    kv__mem_free(rm);
}

bool kv__rd_rkey_get(const kv_xport_rmem *rm, struct rkey *k)
{
    if (rm->key_len < RD_KEY_HEAD)
        return false;
    k->n = (uint32_t)kv__le_get(rm->key, 4);
    k->chunk = kv__le_get(rm->key + 8, 8);
    k->base = kv__le_get(rm->key + 16, 8);
    k->keys = rm->key + RD_KEY_HEAD;
    return k->n >= 1 && k->n <= RD_MAX_CHUNKS && k->chunk && rm->key_len == RD_KEY_HEAD + 4 * k->n;
}

/* The rkey of the chunk holding remote offset off (past the last chunk:
 * the last one's, and the responder refuses). */
uint32_t kv__rd_rkey_of(const struct rkey *k, uint64_t off)
{
    uint64_t c = off / k->chunk;
    c = c >= k->n ? k->n - 1 : c;
    return (uint32_t)kv__le_get(k->keys + 4 * c, 4);
}

static void rdma_post(kv_xport_xfer *t)
{
    t->be_entry = 0;
    t->be_off = 0;
    kv__rd_kick(t->peer->x);
}

static void rdma_cancel(kv_xport_xfer *t)
{
    kv__rd_kick(t->peer->x);
}

static kv_xport_gid_type gid_type_pub(enum ibv_gid_type t, uint8_t link)
{
    if (link == IBV_LINK_LAYER_INFINIBAND)
        return KV_XPORT_GID_IB;
    return t == IBV_GID_TYPE_ROCE_V2 ? KV_XPORT_GID_ROCE_V2 : KV_XPORT_GID_ROCE_V1;
}

/* mu held: what rd_pick chose, and p's path once its QPs are connected. */
static void rdma_info(kv_xport *x, kv_xport_peer *p, struct kv_xport_info *out)
{
    const struct rdma *r = x->be;
    if (!r)
        return;
    snprintf(out->rdma_device, sizeof(out->rdma_device), "%s", r->dev);
    out->rdma_port = r->port;
    out->rdma_link =
        r->link == IBV_LINK_LAYER_ETHERNET ? KV_XPORT_LINK_ETHERNET : KV_XPORT_LINK_INFINIBAND;
    out->rdma_lid = r->link == IBV_LINK_LAYER_INFINIBAND ? r->pa.lid : 0;
    out->rdma_gid_index = r->gid_index;
    out->rdma_gid_type = r->gid_index >= 0 ? gid_type_pub(r->gid_type, r->link) : KV_XPORT_GID_NONE;
    if (r->gid_index >= 0)
        memcpy(out->rdma_gid, r->gid.raw, 16);
    out->rdma_active_mtu = kv__rd_mtu_bytes(r->pa.active_mtu);
    const struct rpeer *rp = p ? p->be : NULL;
    if (!rp || (rp->ph != PH_RTS && rp->ph != PH_READY))
        return;
    out->rdma_qps = rp->nq;
    out->rdma_path_mtu = kv__rd_mtu_bytes(rp->path_mtu);
    out->rdma_grh = rp->grh;
    out->rdma_hop_limit = rp->grh ? INFO_HOP_LIMIT : 0;
    out->rdma_remote_lid = rp->rlid;
    memcpy(out->rdma_remote_gid, rp->rgid, 16);
}

static void rdma_peer_close(kv_xport_peer *p)
{
    struct rpeer *rp = p->be;
    if (rp)
        rp->close_req = true;
    else
        kv__xport_peer_closed(p, KV_OK, "closed");
    kv__rd_kick(p->x);
}

static const struct kv__xport_ops kv__xport_rdma_ops = {
    .version = KV__XPORT_OPS_VERSION,
    .kind = KV_XPORT_RDMA,
    .name = "rdma",
    .start = rdma_start,
    .stop = rdma_stop,
    .connect = rdma_connect,
    .mem_reg = rdma_mem_reg,
    .mem_dereg = rdma_mem_dereg,
    .expose = rdma_expose,
    .unexpose = rdma_unexpose,
    .post = rdma_post,
    .cancel = rdma_cancel,
    .peer_close = rdma_peer_close,
    .info = rdma_info,
};

const struct kv__xport_ops *kv__xport_rdma(void)
{
    return &kv__xport_rdma_ops;
}

/* mu held: deadlines and cancels; false when rp began failing. */
static void sweep(struct rdma *r, struct rpeer *rp, uint64_t now)
{
    if (rp->ph != PH_READY && rp->ph != PH_FAIL && now >= rp->deadline_ns) {
        static const char *const ph[] = {"out-of-band handshake", "QP info exchange",
                                         "waiting for the peer's READY"};
        kv__rd_peer_fail(r, rp, KV_ERR_TIMEOUT,
                         "xport rdma: handshake not done within %u ms (%s; info %s, ready %s/%s)",
                         r->x->cfg.timeout_ms, ph[rp->ph], rp->info_sent ? "sent" : "not sent",
                         rp->ready_sent ? "sent" : "not sent", rp->ready_got ? "got" : "not got");
        return;
    }
    for (kv_xport_xfer *t = rp->p->xfers, *nx; t; t = nx) {
        nx = t->next;
        if (now < t->deadline_ns || t->state != KV_XPORT_PENDING)
            continue;
        if (!t->busy) {
            kv__xport_xfer_end(t, t->cancel_req ? KV_XPORT_CANCELLED : KV_XPORT_TIMED_OUT,
                               t->cancel_req ? KV_ERR_CANCELLED : KV_ERR_TIMEOUT);
            continue;
        }
        /* WRs of it outstanding: they cannot be taken back. */
        kv__rd_peer_fail(r, rp, KV_ERR_TIMEOUT,
                         "xport rdma: transfer %" PRIu64 " not done within %u ms with %u work "
                         "request(s) outstanding: the peer is closed",
                         t->id, r->x->cfg.timeout_ms, t->busy);
        return;
    }
}

/* mu held (dropped around the verbs calls): arm every CQ not armed since
 * its last event; it is polled after this, so nothing is missed. A failure
 * is noted for kv_xport_destroy and the transport polls from then on. */
static void arm_all(struct rdma *r)
{
    kv_xport *x = r->x;
    for (struct rpeer *rp = r->peers; rp && !r->busy_poll; rp = rp->next) {
        if (!rp->cq || rp->armed)
            continue;
        struct ibv_cq *cq = rp->cq;
        pthread_mutex_unlock(&x->mu);
        const int e = r->v->req_notify_cq(cq, 0);
        pthread_mutex_lock(&x->mu);
        rp->armed = e == 0;
        if (e != 0) {
            kv__rd_teardown_check(r, e, "ibv_req_notify_cq (now busy polling)");
            r->busy_poll = true;
        }
    }
}

/* mu held: the nearest deadline the thread must wake for (UINT64_MAX:
 * none): a handshake or a drain, a pending transfer's. */
static uint64_t next_deadline(const struct rdma *r)
{
    uint64_t d = UINT64_MAX;
    for (const struct rpeer *rp = r->peers; rp; rp = rp->next) {
        if (rp->ph != PH_READY && rp->deadline_ns < d)
            d = rp->deadline_ns;
        for (const kv_xport_xfer *t = rp->p->xfers; t; t = t->next)
            if (t->state == KV_XPORT_PENDING && t->deadline_ns < d)
                d = t->deadline_ns;
    }
    return d;
}

/* mu held (dropped while asleep): event mode's wait: poll() on the
 * eventfd and the channel until one is readable or the deadline; then each
 * event got, acknowledged, and its CQ marked for re-arming. */
static void wait_events(struct rdma *r, uint64_t deadline)
{
    kv_xport *x = r->x;
    int ms = -1;
    if (deadline != UINT64_MAX) {
        const uint64_t now = kv__now_ns();
        const uint64_t left = deadline > now ? (deadline - now + 999999u) / 1000000u : 0;
        ms = left > INT_MAX ? INT_MAX : (int)left;
    }
    struct pollfd pf[2] = {{.fd = r->wake_fd, .events = POLLIN},
                           {.fd = r->ch->fd, .events = POLLIN}};
    pthread_mutex_unlock(&x->mu);
    const int n = poll(pf, 2, ms);
    if (n > 0 && pf[0].revents) {
        uint64_t v;
        const ssize_t got = read(r->wake_fd, &v, sizeof(v));
        (void)got; /* EAGAIN: nothing to clear */
    }
    int err = 0;
    if (n > 0 && pf[1].revents)
        for (;;) {
            struct ibv_cq *cq = NULL;
            void *ctx = NULL;
            const int e = r->v->get_cq_event(r->ch, &cq, &ctx);
            if (e == EAGAIN || e == EWOULDBLOCK)
                break;
            if (e != 0) {
                err = e;
                break;
            }
            r->v->ack_cq_events(cq, 1);
            ((struct rpeer *)ctx)->armed = false; /* only this thread touches it */
        }
    pthread_mutex_lock(&x->mu);
    if (err != 0) {
        kv__rd_teardown_check(r, err, "ibv_get_cq_event (now busy polling)");
        r->busy_poll = true;
    }
}

/* mu held: an OOB notification of rp (INFO, READY) not yet terminal. */
static bool oob_pending(const struct rpeer *rp)
{
    for (int i = 0; i < 2; i++) {
        kv_xport_state s = KV_XPORT_DONE;
        if (rp->oob_x[i] && kv_xport_xfer_test(rp->oob_x[i], &s) == KV_OK && s == KV_XPORT_PENDING)
            return true;
    }
    return false;
}

static void *progress(void *arg)
{
    struct rdma *r = arg;
    kv_xport *x = r->x;
    struct chain *c = kv__mem_alloc(sizeof(*c));
    pthread_mutex_lock(&x->mu);
    while (!r->stop || r->peers) {
        bool any = false;
        arm_all(r); /* before the CQs are polled below */
        if (r->stop)
            for (struct rpeer *rp = r->peers; rp; rp = rp->next)
                kv__rd_peer_fail(r, rp, KV_ERR_CANCELLED, "the transport was destroyed");
        if (!r->stop)
            any |= kv__rd_oob_round(r);
        const uint64_t now = kv__now_ns();
        for (struct rpeer *rp = r->peers, *nx; rp; rp = nx) {
            nx = rp->next;
            if (rp->close_req && rp->ph != PH_FAIL)
                kv__rd_peer_fail(r, rp, KV_OK, "closed");
            if (rp->cq)
                any |= kv__rd_poll_round(r, rp);
            if (rp->ph == PH_FAIL) {
                bool done = true;
                for (uint32_t i = 0; i < rp->nq; i++)
                    done &= rp->q[i].drained || !rp->q[i].qp;
                /* Our INFO / READY out first (bounded by the drain
                 * deadline): a peer refused at INFO (a link layer, an MTU
                 * code) then reads our INFO and names the refusal itself,
                 * rather than seeing only a closed connection. */
                done = done && (r->stop || !oob_pending(rp));
                if (done || now >= rp->deadline_ns) {
                    kv__rd_finish_fail(r, rp);
                    any = true;
                }
                continue;
            }
            if (!c) {
                kv__rd_peer_fail(r, rp, KV_ERR_NO_MEMORY, "xport rdma: WR staging");
                continue;
            }
            sweep(r, rp, now);
            if (rp->ph == PH_READY)
                any |= kv__rd_send_round(r, rp, c);
            if (rp->ph == PH_READY)
                kv__rd_notes_flush(r, rp, c);
            if (rp->ph != PH_FAIL)
                kv__rd_settle_all(rp);
        }
        if (any)
            continue;
        if (!r->busy_poll) {
            wait_events(r, next_deadline(r));
        } else { /* 0.2 ms: completions are polled */
            const struct timespec ts = kv__ns_to_ts(kv__now_ns() + 200000u);
            pthread_cond_timedwait(&x->cv, &x->mu, &ts);
        }
    }
    pthread_mutex_unlock(&x->mu);
    kv__mem_free(c);
    return NULL;
}
