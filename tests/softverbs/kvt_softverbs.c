/*
 * kvt_softverbs.c - the software RC verbs device (kvt_softverbs.h).
 *
 * Locking: one mutex per context (sv_ctx.lock) guards everything created
 * from it (PDs, MRs, CQs, QPs, connections); application calls and the
 * device thread take it; the device thread drops it only inside poll().
 * Only the device thread closes sockets and frees connections, so the fds
 * it polls stay valid while it is unlocked.
 *
 * Wire (AF_UNIX stream, one connection per requester QP, opened at RTR):
 * a fixed header (struct sv_hdr) then `len` payload bytes. A QP has at most
 * one request in flight (window 1), which makes RC ordering, RNR retry and
 * "the receive completes after all earlier data landed" hold by
 * construction.
 *
 * Send-queue accounting, the real rule: sq_used counts slots held; a WR
 * holds its slot from post until a CQE that covers it is polled. A signaled
 * (or error / flush) CQE covers itself and every unsignaled WR completed
 * before it on that QP (sv_cqe.retire), so a caller that never signals runs
 * out (post_send -> ENOMEM).
 *   sq_used == pending WRs + unsig_done + sum(retire of unpolled send CQEs)
 */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>
#include <fcntl.h>

#include "kv_mem.h"
#include "kvt_softverbs.h"

/* ------------------------------------------------------------ globals -- */

/* The device set (kvt_sv_set_devices); the default: one device, one
 * active Ethernet port. */
static struct ibv_device sv_devices[KVT_SV_MAX_DEVS] = {{
    .node_type = IBV_NODE_CA,
    .transport_type = IBV_TRANSPORT_IB,
    .name = "kvt_sv0",
    .dev_name = "uverbs_kvt_sv0",
}};
static struct kvt_sv_dev_spec sv_specs[KVT_SV_MAX_DEVS] = {
    {.n_ports = 1, .port = {{.link_layer = IBV_LINK_LAYER_ETHERNET, .active_mtu = IBV_MTU_4096}}}};
static uint32_t sv_n_devices = 1;

int kvt_sv_set_devices(const struct kvt_sv_dev_spec *devs, uint32_t n)
{
    if (!devs || n == 0) {
        static const struct kvt_sv_dev_spec def = {
            .name = "kvt_sv0",
            .n_ports = 1,
            .port = {{.link_layer = IBV_LINK_LAYER_ETHERNET, .active_mtu = IBV_MTU_4096}}};
        devs = &def;
        n = 1;
    }
    if (n > KVT_SV_MAX_DEVS)
        return EINVAL;
    for (uint32_t i = 0; i < n; i++) {
        const struct kvt_sv_dev_spec *d = &devs[i];
        if (!d->name || strlen(d->name) + 7 >= sizeof(sv_devices[i].dev_name) || d->n_ports < 1 ||
            d->n_ports > KVT_SV_MAX_PORTS)
            return EINVAL;
        for (uint32_t k = 0; k < d->n_ports; k++)
            if ((d->port[k].link_layer != IBV_LINK_LAYER_INFINIBAND &&
                 d->port[k].link_layer != IBV_LINK_LAYER_ETHERNET) ||
                d->port[k].active_mtu < IBV_MTU_256 || d->port[k].active_mtu > IBV_MTU_4096)
                return EINVAL;
    }
    memset(sv_devices, 0, sizeof(sv_devices));
    for (uint32_t i = 0; i < n; i++) {
        sv_devices[i].node_type = IBV_NODE_CA;
        sv_devices[i].transport_type = IBV_TRANSPORT_IB;
        snprintf(sv_devices[i].name, sizeof(sv_devices[i].name), "%s", devs[i].name);
        snprintf(sv_devices[i].dev_name, sizeof(sv_devices[i].dev_name), "uverbs_%s", devs[i].name);
        sv_specs[i] = devs[i];
        sv_specs[i].name = NULL; /* sv_devices[i].name is the copy */
    }
    sv_n_devices = n;
    return 0;
}

static _Atomic uint64_t max_mr_size = 1ull << 30;
static _Atomic uint32_t max_sge_rd = KVT_SV_MAX_SGE_RD;
static _Atomic uint32_t next_ctx_id = 1;

static pthread_mutex_t fault_lock = PTHREAD_MUTEX_INITIALIZER;
static struct {
    enum kvt_sv_fault kind;
    uint32_t left; /* events still let through */
    uint32_t arg;
    bool writes_only; /* kvt_sv_fault_writes: only RDMA WRITEs' events are eligible */
} fault; /* guarded by fault_lock */

static struct {
    _Atomic uint64_t requests_sent, requests_served, bytes_landed, naks_sent, cqes, faults_fired;
} stats;

/* Whether the armed fault is `kind` and hits this event (then disarms);
 * write: the event is an RDMA WRITE's (its request or its completion). */
static bool fault_hit(enum kvt_sv_fault kind, bool write, uint32_t *arg)
{
    bool hit = false;
    pthread_mutex_lock(&fault_lock);
    if (fault.kind == kind && (write || !fault.writes_only)) {
        if (fault.left > 0) {
            fault.left--;
        } else {
            hit = true;
            if (arg)
                *arg = fault.arg;
            fault.kind = KVT_SV_FAULT_NONE;
        }
    }
    pthread_mutex_unlock(&fault_lock);
    if (hit)
        atomic_fetch_add(&stats.faults_fired, 1);
    return hit;
}

static void fault_arm(enum kvt_sv_fault f, uint32_t after_n, uint32_t arg, bool writes_only)
{
    pthread_mutex_lock(&fault_lock);
    fault.kind = f;
    fault.left = after_n;
    fault.arg = arg;
    fault.writes_only = writes_only;
    pthread_mutex_unlock(&fault_lock);
}

void kvt_sv_fault(enum kvt_sv_fault f, uint32_t after_n, uint32_t arg)
{
    fault_arm(f, after_n, arg, false);
}

void kvt_sv_fault_writes(enum kvt_sv_fault f, uint32_t after_n, uint32_t arg)
{
    fault_arm(f, after_n, arg, true);
}

void kvt_sv_set_max_mr_size(uint64_t bytes)
{
    atomic_store(&max_mr_size, bytes);
}

int kvt_sv_set_max_sge_rd(uint32_t n)
{
    if (n > KVT_SV_MAX_SGE)
        return EINVAL;
    atomic_store(&max_sge_rd, n ? n : KVT_SV_MAX_SGE_RD);
    return 0;
}

void kvt_sv_stats_get(struct kvt_sv_stats *out)
{
    out->requests_sent = atomic_load(&stats.requests_sent);
    out->requests_served = atomic_load(&stats.requests_served);
    out->bytes_landed = atomic_load(&stats.bytes_landed);
    out->naks_sent = atomic_load(&stats.naks_sent);
    out->cqes = atomic_load(&stats.cqes);
    out->faults_fired = atomic_load(&stats.faults_fired);
}

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* -------------------------------------------------------------- types -- */

enum sv_type {
    SV_HELLO = 1, /* requester QP src_qpn -> responder QP dst_qpn */
    SV_WRITE,
    SV_WRITE_IMM,
    SV_SEND,
    SV_READ_REQ,
    SV_READ_RESP, /* payload: the bytes read */
    SV_ACK,
    SV_NAK, /* status: enum ibv_wc_status for the requester */
};

#define SV_MAGIC 0x6b767376u /* "kvsv" */
#define SV_FORCE_NAK 1u      /* flags: KVT_SV_REMOTE_ACCESS injected */

#define SV_PKEY_TBL 1         /* pkey_tbl_len of every port */
#define SV_PSN_MASK 0xffffffu /* PSNs are 24 bits */
#define SV_MAX_RD_ATOM 16     /* max_qp_rd_atom, max_qp_init_rd_atom */

struct sv_hdr {
    uint32_t magic;
    uint16_t type;
    uint16_t flags;
    uint32_t dst_qpn, src_qpn;
    uint32_t psn;
    uint32_t rkey;
    uint64_t raddr;
    uint64_t len; /* payload bytes after the header (READ_REQ: bytes asked) */
    uint32_t imm; /* network order, as in ibv_send_wr */
    uint32_t status;
};

struct sv_ctx;
struct sv_qp;

struct sv_pd {
    struct ibv_pd ibv;
    struct sv_pd *next;
    int refs; /* MRs + QPs on it */
};

struct sv_mr {
    struct ibv_mr ibv; /* lkey == rkey, unique in the context */
    struct sv_mr *next;
    int access;
};

/* One CQE; qp is valid while the CQE is in the CQ (destroy_qp removes its
 * CQEs). retire: the send-queue slots polling it releases (0 for recvs). */
struct sv_cqe {
    struct ibv_wc wc;
    struct sv_qp *qp;
    uint32_t retire;
    uint64_t visible_ns; /* DELAY_COMPLETION: not polled before */
};

struct sv_cq;

/* A completion event queued on a channel, not yet got. */
struct sv_ev {
    struct sv_cq *cq;
    struct sv_ev *next;
};

/* A completion channel. ibv.fd is one end of a socketpair whose other end
 * (wfd) gets one byte per queued event, so the fd is readable exactly while
 * an event waits, and a read of it blocks (or says EAGAIN when the caller
 * made it O_NONBLOCK) as ibv_get_cq_event does:
 *   bytes in the socket + bytes read by a get_cq_event not yet under the
 *   lock >= events queued; ibv.refcnt == CQs created on it */
struct sv_chan {
    struct ibv_comp_channel ibv;
    struct sv_chan *next;
    int wfd;
    struct sv_ev *head, *tail;
};

struct sv_cq {
    struct ibv_cq ibv;
    struct sv_cq *next;
    struct sv_cqe *ring;   /* [ibv.cqe] */
    int head, count;       /* 0 <= count <= ibv.cqe */
    int refs;              /* QPs using it */
    bool overflowed;       /* a CQE found it full: poll_cq fails from then on */
    struct sv_chan *chan;  /* NULL: created without a channel */
    bool armed;            /* req_notify_cq since its last event (one-shot) */
    uint64_t event_at_ns;  /* a held CQE (DELAY_COMPLETION) becomes visible: its event */
    uint64_t events_got;   /* get_cq_event returned it */
    uint64_t events_acked; /* ack_cq_events; destroy_cq needs acked == got */
};

struct sv_swr {
    uint64_t wr_id;
    enum ibv_wr_opcode op;
    bool signaled;
    uint32_t imm;
    uint64_t raddr;
    uint32_t rkey;
    int nsge;
    struct ibv_sge sge[KVT_SV_MAX_SGE];
    uint64_t len;
    bool is_inline; /* data in the slot's inline buffer */
    uint8_t *inl;   /* [KVT_SV_MAX_INLINE], the slot's */
};

struct sv_rwr {
    uint64_t wr_id;
    int nsge;
    struct ibv_sge sge[KVT_SV_MAX_SGE];
};

/* A queued outgoing message: header + payload iovecs (app or MR memory,
 * valid until the WR completes). */
struct sv_out {
    struct sv_out *next;
    struct sv_hdr hdr;
    struct iovec iov[KVT_SV_MAX_SGE + 1];
    int niov;
    size_t sent, total;
};

struct sv_conn {
    struct sv_conn *next;
    int fd;
    uint8_t port_num;  /* accepted: the port (1-based) whose listener took it */
    uint32_t path_mtu; /* accepted: the requester's path MTU (enum ibv_mtu, its HELLO) */
    uint32_t src_addr; /* accepted: the requester port's LID / Ethernet address (its HELLO) */
    bool outgoing;     /* a requester QP's; else accepted by our listener */
    bool dead;         /* closed by the peer or broken: no more I/O */
    bool doomed;       /* its QP is gone: the device thread closes and frees it */
    struct sv_qp *qp;  /* requester QP (outgoing) or bound responder QP; NULL if none */
    /* input: header, then payload into in_iov (or discarded) */
    struct sv_hdr in;
    size_t in_got;
    bool in_payload;
    struct iovec in_iov[KVT_SV_MAX_SGE];
    int in_niov;
    uint64_t in_left;
    bool in_discard;
    bool in_bad;          /* requester: the READ response cannot land (LOC_PROT_ERR) */
    uint32_t in_nak;      /* NAK to send once the payload is consumed (0: none) */
    struct sv_rwr in_rwr; /* receive consumed by this request */
    bool in_has_rwr;
    struct sv_out *out_head, *out_tail;
};

struct sv_qp {
    struct ibv_qp ibv;
    struct sv_qp *next;
    struct sv_ctx *ctx;
    struct sv_pd *pd;
    struct sv_cq *scq, *rcq;
    struct ibv_qp_attr attr; /* as last modified (what query_qp returns) */
    struct ibv_qp_cap cap;
    bool sq_sig_all;
    struct sv_conn *conn; /* outgoing, from RTR; NULL before */
    /* send queue: ring of pending WRs [sq_head, sq_head + sq_pending) */
    struct sv_swr *sq; /* [cap.max_send_wr] */
    uint8_t *inl;      /* [cap.max_send_wr][KVT_SV_MAX_INLINE] */
    uint32_t sq_head, sq_pending, sq_used, unsig_done;
    /* the head WR's state */
    bool in_flight;
    uint64_t fail_at_ns;   /* != 0: the head fails RETRY_EXC_ERR then */
    uint64_t resend_at_ns; /* != 0: RNR: resend the head then */
    uint32_t rnr_left;
    uint32_t psn;  /* requester: the PSN of the last request sent (sq_psn - 1 at RTS) */
    uint32_t epsn; /* responder: the PSN it expects next (rq_psn at RTR, + 1 per executed) */
    /* receive queue: ring [rq_head, rq_head + rq_count) */
    struct sv_rwr *rq; /* [cap.max_recv_wr] */
    uint32_t rq_head, rq_count;
};

/* A port of a context: its spec and, when active, its addresses and the
 * socket listening under them (-1 when down). */
struct sv_port {
    struct kvt_sv_port_spec spec;
    int listen_fd;
    uint16_t lid;  /* InfiniBand; 0 on Ethernet or down */
    uint32_t addr; /* Ethernet: A (24 bits); 0 otherwise */
    int gid_tbl_len;
    union ibv_gid gid[KVT_SV_GID_TBL];
    enum ibv_gid_type gid_type[KVT_SV_GID_TBL];
};

struct sv_ctx {
    struct ibv_context ibv;
    pthread_mutex_t lock;
    pthread_t thread;
    int wake[2];
    uint32_t id;
    bool stop;
    uint8_t n_ports;
    struct sv_port port[KVT_SV_MAX_PORTS]; /* port number i + 1 */
    struct sv_pd *pds;
    struct sv_mr *mrs;
    struct sv_cq *cqs;
    struct sv_chan *chans;
    struct sv_qp *qps;
    struct sv_conn *conns;
    uint32_t next_key, next_qpn;
};

static struct sv_ctx *ctx_of(struct ibv_context *c)
{
    return (struct sv_ctx *)c;
}

/* The port numbered port_num (1-based) of c, NULL when there is none. */
static struct sv_port *port_of(struct sv_ctx *c, uint32_t port_num)
{
    return port_num >= 1 && port_num <= c->n_ports ? &c->port[port_num - 1] : NULL;
}

static void wake(struct sv_ctx *c)
{
    const char b = 1;
    ssize_t r = write(c->wake[1], &b, 1);
    (void)r; /* full pipe: already awake */
}

/* The abstract socket a port listens on: "kvt_sv.ib.<LID>" or
 * "kvt_sv.eth.<A>" (the header's addressing). */
static void port_sockaddr(uint8_t link_layer, uint32_t addr, struct sockaddr_un *a, socklen_t *len)
{
    memset(a, 0, sizeof(*a));
    a->sun_family = AF_UNIX;
    const int n = link_layer == IBV_LINK_LAYER_INFINIBAND
                      ? snprintf(a->sun_path + 1, sizeof(a->sun_path) - 1, "kvt_sv.ib.%04x", addr)
                      : snprintf(a->sun_path + 1, sizeof(a->sun_path) - 1, "kvt_sv.eth.%06x", addr);
    *len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
}

/* The GID table of an active port from its LID / address. */
static void port_gids(struct sv_port *p)
{
    memset(p->gid, 0, sizeof(p->gid));
    if (p->spec.link_layer == IBV_LINK_LAYER_INFINIBAND) {
        p->gid_tbl_len = 2;
        union ibv_gid *g = &p->gid[0];
        g->raw[0] = 0xfe;
        g->raw[1] = 0x80;
        memcpy(&g->raw[8], "kvsv", 4);
        g->raw[14] = (uint8_t)(p->lid >> 8);
        g->raw[15] = (uint8_t)p->lid;
        p->gid_type[0] = p->gid_type[1] = IBV_GID_TYPE_IB;
        return;
    }
    p->gid_tbl_len = KVT_SV_GID_TBL;
    static const uint8_t ll[13] = {0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0x00, 0x6b, 0x76, 0xff, 0xfe};
    static const uint8_t v4[13] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10};
    for (int i = 0; i < 4; i++) {
        memcpy(p->gid[i].raw, i < 2 ? ll : v4, 13);
        p->gid[i].raw[13] = (uint8_t)(p->addr >> 16);
        p->gid[i].raw[14] = (uint8_t)(p->addr >> 8);
        p->gid[i].raw[15] = (uint8_t)p->addr;
        p->gid_type[i] = i % 2 ? IBV_GID_TYPE_ROCE_V2 : IBV_GID_TYPE_ROCE_V1;
    }
    for (int i = 4; i < KVT_SV_GID_TBL; i++)
        p->gid_type[i] = IBV_GID_TYPE_ROCE_V1;
}

/* The port a GID names (its link layer and LID / address); false when the
 * GID is none of ours. */
static bool gid_route(const union ibv_gid *g, uint8_t *link_layer, uint32_t *addr)
{
    static const uint8_t ib[12] = {0xfe, 0x80, 0, 0, 0, 0, 0, 0, 'k', 'v', 's', 'v'};
    static const uint8_t ll[13] = {0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0x00, 0x6b, 0x76, 0xff, 0xfe};
    static const uint8_t v4[13] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10};
    if (memcmp(g->raw, ib, 12) == 0 && g->raw[12] == 0 && g->raw[13] == 0) {
        *link_layer = IBV_LINK_LAYER_INFINIBAND;
        *addr = (uint32_t)g->raw[14] << 8 | g->raw[15];
        return *addr >= 1 && *addr <= 0xbfff;
    }
    if (memcmp(g->raw, ll, 13) == 0 || memcmp(g->raw, v4, 13) == 0) {
        *link_layer = IBV_LINK_LAYER_ETHERNET;
        *addr = (uint32_t)g->raw[13] << 16 | (uint32_t)g->raw[14] << 8 | g->raw[15];
        return true;
    }
    return false;
}

/* Bind port p's listener under an address no other port on the host has:
 * the abstract namespace refuses a second bind (EADDRINUSE), so probing
 * from a hash of (pid, context, port) finds a free one. */
static int port_listen(struct sv_port *p, uint32_t ctx_id, uint32_t port_num)
{
    p->listen_fd = -1;
    if (p->spec.down)
        return 0;
    const bool ib = p->spec.link_layer == IBV_LINK_LAYER_INFINIBAND;
    const uint32_t space = ib ? 0xbfffu : 0xffffffu;
    uint64_t h =
        ((uint64_t)getpid() << 20 ^ (uint64_t)ctx_id << 4 ^ port_num) * 0x9E3779B97F4A7C15ull;
    for (int tries = 0; tries < 4096; tries++, h += 0x9E3779B97F4A7C15ull) {
        const uint32_t a = (uint32_t)((h >> 32) % space) + (ib ? 1 : 0);
        const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (fd < 0)
            return -1;
        struct sockaddr_un sa;
        socklen_t len;
        port_sockaddr(p->spec.link_layer, a, &sa, &len);
        if (bind(fd, (struct sockaddr *)&sa, len) == 0 && listen(fd, 64) == 0) {
            p->listen_fd = fd;
            if (ib)
                p->lid = (uint16_t)a;
            else
                p->addr = a;
            port_gids(p);
            return 0;
        }
        const int e = errno;
        close(fd);
        if (e != EADDRINUSE)
            return -1;
    }
    return -1;
}

/* ---------------------------------------------------------- CQ and QP -- */

/* lock held: a completion was added to cq: one event on its channel when
 * it was armed (ibv_req_notify_cq: "the next" completion only; arming is
 * one-shot, so a CQ not re-armed since its last event gets no more). */
static void cq_event(struct sv_cq *cq)
{
    if (!cq->armed || !cq->chan)
        return;
    struct sv_ev *ev = kv__mem_calloc(1, sizeof(*ev));
    if (!ev)
        return; /* as the kernel when it cannot queue one: the event is lost */
    cq->armed = false;
    ev->cq = cq;
    struct sv_chan *ch = cq->chan;
    if (ch->tail)
        ch->tail->next = ev;
    else
        ch->head = ev;
    ch->tail = ev;
    const char b = 1;
    ssize_t r = write(ch->wfd, &b, 1);
    (void)r; /* 64 KiB of socket buffer: more events than CQs never queue */
}

static void cq_push(struct sv_cq *cq, struct sv_qp *qp, const struct ibv_wc *wc, uint32_t retire)
{
    atomic_fetch_add(&stats.cqes, 1);
    const bool write = wc->opcode == IBV_WC_RDMA_WRITE;
    if (fault_hit(KVT_SV_LOST_COMPLETION, write, NULL)) {
        qp->sq_used -= retire; /* as if polled: the slots do not leak */
        return;
    }
    if (cq->overflowed)
        return;
    if (cq->count == cq->ibv.cqe) {
        cq->overflowed = true; /* CQ overrun: the CQ is in error */
        qp->attr.qp_state = IBV_QPS_ERR;
        qp->ibv.state = IBV_QPS_ERR;
        return;
    }
    uint32_t delay_ms = 0;
    struct sv_cqe *e = &cq->ring[(cq->head + cq->count) % cq->ibv.cqe];
    e->wc = *wc;
    e->qp = qp;
    e->retire = retire;
    e->visible_ns = fault_hit(KVT_SV_DELAY_COMPLETION, write, &delay_ms)
                        ? now_ns() + (uint64_t)delay_ms * 1000000ull
                        : 0;
    cq->count++;
    if (e->visible_ns == 0) {
        cq_event(cq);
    } else if (cq->event_at_ns == 0 || e->visible_ns < cq->event_at_ns) {
        cq->event_at_ns = e->visible_ns; /* added when it becomes visible */
        wake(ctx_of(cq->ibv.context));   /* the device thread times it */
    }
}

static enum ibv_wc_opcode wc_opcode(enum ibv_wr_opcode op)
{
    switch (op) {
    case IBV_WR_RDMA_READ:
        return IBV_WC_RDMA_READ;
    case IBV_WR_SEND:
        return IBV_WC_SEND;
    default:
        return IBV_WC_RDMA_WRITE;
    }
}

static void qp_set_err(struct sv_qp *qp)
{
    qp->attr.qp_state = IBV_QPS_ERR;
    qp->ibv.state = IBV_QPS_ERR;
    wake(qp->ctx); /* the device thread flushes */
}

/* Complete the head send WR with `status` (error and flush CQEs are always
 * generated; success only when signaled). */
static void sq_complete_head(struct sv_qp *qp, enum ibv_wc_status status, uint32_t byte_len)
{
    struct sv_swr *w = &qp->sq[qp->sq_head];
    const bool cqe = status != IBV_WC_SUCCESS || w->signaled;
    if (cqe) {
        struct ibv_wc wc = {.wr_id = w->wr_id,
                            .status = status,
                            .opcode = wc_opcode(w->op),
                            .byte_len = byte_len,
                            .qp_num = qp->ibv.qp_num};
        cq_push(qp->scq, qp, &wc, qp->unsig_done + 1);
        qp->unsig_done = 0;
    } else {
        qp->unsig_done++;
    }
    qp->sq_head = (qp->sq_head + 1) % qp->cap.max_send_wr;
    qp->sq_pending--;
    qp->in_flight = false;
    qp->fail_at_ns = 0;
    qp->resend_at_ns = 0;
    qp->rnr_left = qp->attr.rnr_retry; /* the next WR gets its own retries */
    if (status != IBV_WC_SUCCESS && status != IBV_WC_WR_FLUSH_ERR)
        qp_set_err(qp);
}

/* In ERR: every pending send WR and posted receive completes WR_FLUSH_ERR. */
static void qp_flush(struct sv_qp *qp)
{
    while (qp->sq_pending > 0)
        sq_complete_head(qp, IBV_WC_WR_FLUSH_ERR, 0);
    while (qp->rq_count > 0) {
        struct sv_rwr *r = &qp->rq[qp->rq_head];
        struct ibv_wc wc = {.wr_id = r->wr_id,
                            .status = IBV_WC_WR_FLUSH_ERR,
                            .opcode = IBV_WC_RECV,
                            .qp_num = qp->ibv.qp_num};
        cq_push(qp->rcq, qp, &wc, 0);
        qp->rq_head = (qp->rq_head + 1) % qp->cap.max_recv_wr;
        qp->rq_count--;
    }
}

static struct sv_mr *mr_find(struct sv_ctx *c, uint32_t key)
{
    for (struct sv_mr *m = c->mrs; m; m = m->next)
        if (m->ibv.lkey == key)
            return m;
    return NULL;
}

/* [addr, addr + len) inside mr (overflow-safe). */
static bool mr_covers(const struct sv_mr *m, uint64_t addr, uint64_t len)
{
    const uint64_t base = (uint64_t)(uintptr_t)m->ibv.addr;
    return addr >= base && len <= m->ibv.length && addr - base <= m->ibv.length - len;
}

/* Local SGEs: lkey of an MR of the QP's PD, inside it, with LOCAL_WRITE
 * when the device writes them. Fills iov; false -> LOC_PROT_ERR. */
static bool sges_check(struct sv_qp *qp, const struct ibv_sge *sge, int n, bool write,
                       struct iovec *iov, uint64_t *total)
{
    *total = 0;
    for (int i = 0; i < n; i++) {
        struct sv_mr *m = mr_find(qp->ctx, sge[i].lkey);
        if (!m || m->ibv.pd != &qp->pd->ibv || !mr_covers(m, sge[i].addr, sge[i].length) ||
            (write && !(m->access & IBV_ACCESS_LOCAL_WRITE)))
            return false;
        iov[i].iov_base = (void *)(uintptr_t)sge[i].addr;
        iov[i].iov_len = sge[i].length;
        *total += sge[i].length;
    }
    return true;
}

/* ------------------------------------------------------------ the wire -- */

static void conn_queue(struct sv_conn *k, const struct sv_hdr *h, const struct iovec *iov, int n)
{
    if (k->dead || k->doomed)
        return;
    struct sv_out *o = kv__mem_calloc(1, sizeof(*o));
    if (!o) {
        k->dead = true;
        return;
    }
    o->hdr = *h;
    o->hdr.magic = SV_MAGIC;
    o->iov[0].iov_base = &o->hdr;
    o->iov[0].iov_len = sizeof(o->hdr);
    o->total = sizeof(o->hdr);
    for (int i = 0; i < n; i++) {
        o->iov[1 + i] = iov[i];
        o->total += iov[i].iov_len;
    }
    o->niov = 1 + n;
    if (k->out_tail)
        k->out_tail->next = o;
    else
        k->out_head = o;
    k->out_tail = o;
}

static void conn_drop_out(struct sv_conn *k)
{
    while (k->out_head) {
        struct sv_out *o = k->out_head;
        k->out_head = o->next;
        kv__mem_free(o);
    }
    k->out_tail = NULL;
}

/* Write what the socket takes without blocking. */
static void conn_flush(struct sv_conn *k)
{
    while (k->out_head && !k->dead) {
        struct sv_out *o = k->out_head;
        struct iovec v[KVT_SV_MAX_SGE + 1];
        int n = 0;
        size_t skip = o->sent;
        for (int i = 0; i < o->niov; i++) {
            if (skip >= o->iov[i].iov_len) {
                skip -= o->iov[i].iov_len;
                continue;
            }
            v[n].iov_base = (char *)o->iov[i].iov_base + skip;
            v[n].iov_len = o->iov[i].iov_len - skip;
            skip = 0;
            n++;
        }
        struct msghdr mh = {.msg_iov = v, .msg_iovlen = (size_t)n};
        ssize_t r = sendmsg(k->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (r < 0) {
            if (errno == EAGAIN || errno == EINTR)
                return;
            k->dead = true;
            return;
        }
        o->sent += (size_t)r;
        if (o->sent == o->total) {
            k->out_head = o->next;
            if (!k->out_head)
                k->out_tail = NULL;
            kv__mem_free(o);
        }
    }
}

static void send_ctl(struct sv_conn *k, enum sv_type t, const struct sv_hdr *req, uint32_t status)
{
    struct sv_hdr h = {.type = (uint16_t)t,
                       .dst_qpn = req->src_qpn,
                       .src_qpn = req->dst_qpn,
                       .psn = req->psn,
                       .status = status};
    if (t == SV_NAK)
        atomic_fetch_add(&stats.naks_sent, 1);
    conn_queue(k, &h, NULL, 0);
}

/* Requester: start the head WR of qp (state RTS, nothing in flight). */
static void qp_start_head(struct sv_qp *qp)
{
    struct sv_swr *w = &qp->sq[qp->sq_head];
    struct iovec iov[KVT_SV_MAX_SGE];
    uint64_t total = w->len;
    int n = 0;
    if (w->is_inline) {
        iov[0].iov_base = w->inl;
        iov[0].iov_len = w->len;
        n = w->len ? 1 : 0;
    } else {
        if (!sges_check(qp, w->sge, w->nsge, w->op == IBV_WR_RDMA_READ, iov, &total)) {
            sq_complete_head(qp, IBV_WC_LOC_PROT_ERR, 0);
            return;
        }
        n = w->nsge;
    }
    w->len = total;
    qp->in_flight = true;
    qp->psn = (qp->psn + 1) & SV_PSN_MASK;
    struct sv_hdr h = {.dst_qpn = qp->attr.dest_qp_num,
                       .src_qpn = qp->ibv.qp_num,
                       .psn = qp->psn,
                       .rkey = w->rkey,
                       .raddr = w->raddr,
                       .len = total,
                       .imm = w->imm};
    switch (w->op) {
    case IBV_WR_RDMA_WRITE:
        h.type = SV_WRITE;
        break;
    case IBV_WR_RDMA_WRITE_WITH_IMM:
        h.type = SV_WRITE_IMM;
        break;
    case IBV_WR_SEND:
        h.type = SV_SEND;
        break;
    default:
        h.type = SV_READ_REQ;
        n = 0; /* no payload; the response lands in the SGEs */
        break;
    }
    const bool write = w->op == IBV_WR_RDMA_WRITE || w->op == IBV_WR_RDMA_WRITE_WITH_IMM;
    if (fault_hit(KVT_SV_REMOTE_ACCESS, write, NULL))
        h.flags |= SV_FORCE_NAK;
    if (!qp->conn || qp->conn->dead || fault_hit(KVT_SV_RETRY_EXCEEDED, write, NULL)) {
        qp->fail_at_ns = now_ns() + KVT_SV_RETRY_MS * 1000000ull; /* nobody answers */
        return;
    }
    atomic_fetch_add(&stats.requests_sent, 1);
    conn_queue(qp->conn, &h, iov, n);
}

static struct sv_qp *qp_find(struct sv_ctx *c, uint32_t qpn)
{
    for (struct sv_qp *q = c->qps; q; q = q->next)
        if (q->ibv.qp_num == qpn)
            return q;
    return NULL;
}

/* Responder: a request header arrived on accepted connection k. Decide
 * where its payload goes (MR memory, a receive's SGEs, or nowhere) and what
 * to answer once it is consumed. */
static void resp_header(struct sv_ctx *c, struct sv_conn *k)
{
    struct sv_hdr *h = &k->in;
    struct sv_qp *qp = k->qp;
    k->in_left = h->len;
    k->in_discard = true;
    k->in_nak = 0;
    k->in_has_rwr = false;
    k->in_niov = 0;
    if (h->type == SV_READ_REQ)
        k->in_left = 0;
    if (!qp || qp->ibv.state == IBV_QPS_RESET || qp->ibv.state == IBV_QPS_INIT ||
        qp->ibv.state == IBV_QPS_ERR) {
        k->in_nak = IBV_WC_RETRY_EXC_ERR; /* a real responder drops it: retries run out */
        return;
    }
    /* Through a port the QP is not bound to, or in packets bigger than
     * that port's active MTU: lost on the fabric, the same. */
    const struct sv_port *pt = port_of(c, k->port_num);
    if (!pt || qp->attr.port_num != k->port_num || k->path_mtu > (uint32_t)pt->spec.active_mtu) {
        k->in_nak = IBV_WC_RETRY_EXC_ERR;
        return;
    }
    /* RC pairing: only the QP this one was connected to (dest_qp_num on
     * the port its AV names), at the PSN expected next; anything else a
     * real responder drops (a PSN sequence error, or a packet for another
     * connection): the requester's retries run out. */
    uint8_t ll = pt->spec.link_layer;
    uint32_t peer = qp->attr.ah_attr.dlid; /* the port the responder's AV names */
    if (ll == IBV_LINK_LAYER_ETHERNET && !gid_route(&qp->attr.ah_attr.grh.dgid, &ll, &peer))
        peer = UINT32_MAX;
    if (h->src_qpn != qp->attr.dest_qp_num || k->src_addr != peer || h->psn != qp->epsn) {
        k->in_nak = IBV_WC_RETRY_EXC_ERR;
        return;
    }
    /* The NAKs of responder class C errors (IBA 9.9.3.1.2; rxe's
     * responder: do_class_ac_error) put the responder's QP in ERR too: its
     * receives and its own sends flush (a real device also raises an
     * affiliated async event, IBV_EVENT_QP_REQ_ERR / QP_ACCESS_ERR). */
    if (h->flags & SV_FORCE_NAK) {
        k->in_nak = IBV_WC_REM_ACCESS_ERR;
        qp_set_err(qp);
        return;
    }
    if (h->type == SV_WRITE || h->type == SV_WRITE_IMM || h->type == SV_READ_REQ) {
        const int need = h->type == SV_READ_REQ ? IBV_ACCESS_REMOTE_READ : IBV_ACCESS_REMOTE_WRITE;
        /* An operation the QP does not take (its qp_access_flags, or a READ
         * with no responder resources, max_dest_rd_atomic 0), zero-length
         * or not: NAK Invalid Request (rxe: check_op_valid, check_resource). */
        if (!(qp->attr.qp_access_flags & need) ||
            (h->type == SV_READ_REQ && qp->attr.max_dest_rd_atomic == 0)) {
            k->in_nak = IBV_WC_REM_INV_REQ_ERR;
            qp_set_err(qp);
            return;
        }
        /* The rkey and bounds: only when there are bytes (C9-88). */
        struct sv_mr *m = mr_find(c, h->rkey);
        if (h->len > 0 && (!m || m->ibv.pd != &qp->pd->ibv || !(m->access & need) ||
                           !mr_covers(m, h->raddr, h->len))) {
            k->in_nak = IBV_WC_REM_ACCESS_ERR;
            qp_set_err(qp);
            return;
        }
    }
    if (h->type == SV_WRITE_IMM || h->type == SV_SEND) {
        if (qp->rq_count == 0) {
            k->in_nak = IBV_WC_RNR_RETRY_EXC_ERR; /* RNR NAK: the requester retries */
            return;
        }
        k->in_rwr = qp->rq[qp->rq_head];
        k->in_has_rwr = true;
        qp->rq_head = (qp->rq_head + 1) % qp->cap.max_recv_wr;
        qp->rq_count--;
    }
    if (h->type == SV_SEND) {
        uint64_t room;
        if (!sges_check(qp, k->in_rwr.sge, k->in_rwr.nsge, true, k->in_iov, &room) ||
            room < h->len) {
            const bool prot = room >= h->len;
            struct ibv_wc wc = {.wr_id = k->in_rwr.wr_id,
                                .status = prot ? IBV_WC_LOC_PROT_ERR : IBV_WC_LOC_LEN_ERR,
                                .opcode = IBV_WC_RECV,
                                .qp_num = qp->ibv.qp_num};
            cq_push(qp->rcq, qp, &wc, 0);
            k->in_has_rwr = false;
            qp_set_err(qp);
            k->in_nak = prot ? IBV_WC_REM_OP_ERR : IBV_WC_REM_INV_REQ_ERR;
            return;
        }
        k->in_niov = k->in_rwr.nsge;
    } else if (h->type != SV_READ_REQ && h->len > 0) {
        k->in_iov[0].iov_base = (void *)(uintptr_t)h->raddr;
        k->in_iov[0].iov_len = h->len;
        k->in_niov = 1;
    }
    k->in_discard = false;
}

/* Responder: the request's payload is consumed. */
static void resp_done(struct sv_conn *k)
{
    struct sv_hdr *h = &k->in;
    struct sv_qp *qp = k->qp;
    if (k->in_nak) {
        send_ctl(k, SV_NAK, h, k->in_nak);
        return;
    }
    atomic_fetch_add(&stats.requests_served, 1);
    if (qp)
        qp->epsn = (qp->epsn + 1) & SV_PSN_MASK;
    if (h->type == SV_READ_REQ) {
        struct iovec v = {.iov_base = (void *)(uintptr_t)h->raddr, .iov_len = h->len};
        struct sv_hdr r = {.type = SV_READ_RESP,
                           .dst_qpn = h->src_qpn,
                           .src_qpn = h->dst_qpn,
                           .psn = h->psn,
                           .rkey = h->rkey, /* the MR its payload is read from (dereg_mr) */
                           .len = h->len};
        conn_queue(k, &r, &v, h->len ? 1 : 0);
        return;
    }
    if (h->type != SV_SEND)
        atomic_fetch_add(&stats.bytes_landed, h->len);
    if (k->in_has_rwr) {
        struct ibv_wc wc = {.wr_id = k->in_rwr.wr_id,
                            .status = IBV_WC_SUCCESS,
                            .opcode = h->type == SV_SEND ? IBV_WC_RECV : IBV_WC_RECV_RDMA_WITH_IMM,
                            .byte_len = (uint32_t)h->len,
                            .imm_data = h->imm,
                            .wc_flags = h->type == SV_SEND ? 0 : IBV_WC_WITH_IMM,
                            .qp_num = qp->ibv.qp_num,
                            .src_qp = h->src_qpn};
        cq_push(qp->rcq, qp, &wc, 0);
        k->in_has_rwr = false;
    }
    send_ctl(k, SV_ACK, h, 0);
}

/* Requester: a response header arrived on qp's outgoing connection. */
static void req_header(struct sv_conn *k)
{
    struct sv_qp *qp = k->qp;
    k->in_left = k->in.type == SV_READ_RESP ? k->in.len : 0;
    k->in_discard = true;
    k->in_niov = 0;
    if (!qp || !qp->in_flight || k->in.psn != qp->psn)
        return; /* stale (the WR was flushed): consume and ignore */
    k->in_bad = false;
    if (k->in.type == SV_READ_RESP) {
        struct sv_swr *w = &qp->sq[qp->sq_head];
        uint64_t total;
        if (sges_check(qp, w->sge, w->nsge, true, k->in_iov, &total) && total >= k->in.len) {
            k->in_niov = w->nsge;
            k->in_discard = false;
        } else {
            k->in_bad = true;
        }
    }
}

static void req_done(struct sv_conn *k)
{
    struct sv_qp *qp = k->qp;
    if (!qp || !qp->in_flight || k->in.psn != qp->psn)
        return;
    if (k->in.type == SV_ACK || k->in.type == SV_READ_RESP) {
        sq_complete_head(qp, k->in_bad ? IBV_WC_LOC_PROT_ERR : IBV_WC_SUCCESS, (uint32_t)k->in.len);
    } else if (k->in.status == IBV_WC_RNR_RETRY_EXC_ERR &&
               (qp->attr.rnr_retry == 7 || qp->rnr_left > 0)) {
        if (qp->attr.rnr_retry != 7)
            qp->rnr_left--;
        qp->resend_at_ns = now_ns() + 1000000ull; /* min_rnr_timer, ~1 ms */
    } else {
        sq_complete_head(qp, (enum ibv_wc_status)k->in.status, 0);
    }
}

/* Read what has arrived on k without blocking. */
static void conn_read(struct sv_ctx *c, struct sv_conn *k)
{
    static _Thread_local char discard[65536]; /* written, never read */
    for (;;) {
        ssize_t r;
        if (!k->in_payload) {
            r = recv(k->fd, (char *)&k->in + k->in_got, sizeof(k->in) - k->in_got, MSG_DONTWAIT);
        } else if (k->in_discard) {
            size_t n = k->in_left < sizeof(discard) ? (size_t)k->in_left : sizeof(discard);
            r = recv(k->fd, discard, n, MSG_DONTWAIT);
        } else {
            /* consumed so far = in.len - in_left: walk the iovecs from there */
            struct iovec v[KVT_SV_MAX_SGE];
            int n = 0;
            uint64_t want = k->in_left, done = k->in.len - k->in_left;
            for (int i = 0; i < k->in_niov && want > 0; i++) {
                const uint64_t l = k->in_iov[i].iov_len;
                if (done >= l) {
                    done -= l;
                    continue;
                }
                const uint64_t take = l - done < want ? l - done : want;
                v[n].iov_base = (char *)k->in_iov[i].iov_base + done;
                v[n].iov_len = (size_t)take;
                want -= take;
                done = 0;
                n++;
            }
            r = readv(k->fd, v, n);
        }
        if (r == 0) {
            k->dead = true;
            return;
        }
        if (r < 0) {
            if (errno != EAGAIN && errno != EINTR)
                k->dead = true;
            return;
        }
        if (!k->in_payload) {
            k->in_got += (size_t)r;
            if (k->in_got < sizeof(k->in))
                continue;
            k->in_got = 0;
            if (k->in.magic != SV_MAGIC) {
                k->dead = true;
                return;
            }
            if (k->in.type == SV_HELLO) {
                /* HELLO: status = the requester's path MTU (checked per
                 * request: resp_header). */
                k->qp = qp_find(c, k->in.dst_qpn);
                k->path_mtu = k->in.status;
                k->src_addr = k->in.rkey;
                continue;
            }
            if (k->outgoing)
                req_header(k);
            else
                resp_header(c, k);
            k->in_payload = true;
        } else {
            k->in_left -= (uint64_t)r;
        }
        if (k->in_payload && k->in_left == 0) {
            k->in_payload = false;
            if (k->outgoing)
                req_done(k);
            else
                resp_done(k);
        }
    }
}

/* A connection died: the requester's WR in flight fails RETRY_EXC_ERR. */
static void conn_dead(struct sv_conn *k)
{
    conn_drop_out(k);
    if (k->outgoing && k->qp && k->qp->in_flight && k->qp->fail_at_ns == 0)
        sq_complete_head(k->qp, IBV_WC_RETRY_EXC_ERR, 0);
}

/* ------------------------------------------------------ device thread -- */

static void qp_progress(struct sv_qp *qp, uint64_t now, uint64_t *next)
{
    if (qp->ibv.state == IBV_QPS_ERR) {
        qp_flush(qp);
        return;
    }
    if (qp->in_flight && qp->fail_at_ns) {
        if (now >= qp->fail_at_ns)
            sq_complete_head(qp, IBV_WC_RETRY_EXC_ERR, 0);
        else if (qp->fail_at_ns < *next)
            *next = qp->fail_at_ns;
    }
    if (qp->in_flight && qp->resend_at_ns) {
        if (now >= qp->resend_at_ns) {
            qp->resend_at_ns = 0;
            qp->in_flight = false;
            qp->psn = (qp->psn - 1) & SV_PSN_MASK; /* the same request again */
        } else if (qp->resend_at_ns < *next) {
            *next = qp->resend_at_ns;
        }
    }
    if (qp->ibv.state == IBV_QPS_ERR) {
        qp_flush(qp);
        return;
    }
    if (qp->ibv.state == IBV_QPS_RTS && !qp->in_flight && qp->sq_pending > 0)
        qp_start_head(qp);
    if (qp->ibv.state == IBV_QPS_ERR)
        qp_flush(qp);
}

static void *device_thread(void *arg)
{
    struct sv_ctx *c = arg;
    struct pollfd *pf = NULL;
    struct sv_conn **pk = NULL;
    size_t cap = 0;
    pthread_mutex_lock(&c->lock);
    while (!c->stop) {
        const uint64_t now = now_ns();
        uint64_t next = UINT64_MAX;
        for (int pass = 0; pass < 2; pass++) /* a completion may start the next WR */
            for (struct sv_qp *q = c->qps; q; q = q->next)
                qp_progress(q, now, &next);
        for (struct sv_cq *q = c->cqs; q; q = q->next) { /* held CQEs now visible */
            if (q->event_at_ns == 0)
                continue;
            if (now >= q->event_at_ns) {
                q->event_at_ns = 0;
                cq_event(q);
            } else if (q->event_at_ns < next) {
                next = q->event_at_ns;
            }
        }
        /* reap dead and doomed connections */
        for (struct sv_conn **pp = &c->conns; *pp;) {
            struct sv_conn *k = *pp;
            if (k->dead)
                conn_dead(k);
            if (k->doomed || (k->dead && !k->outgoing)) {
                *pp = k->next;
                if (k->qp && k->qp->conn == k)
                    k->qp->conn = NULL;
                conn_drop_out(k);
                close(k->fd);
                kv__mem_free(k);
                continue;
            }
            pp = &k->next;
        }
        const size_t nl = 1 + KVT_SV_MAX_PORTS; /* the wake pipe, the listeners */
        size_t n = nl;
        for (struct sv_conn *k = c->conns; k; k = k->next)
            n++;
        if (n > cap) {
            /* Out of memory (the library's threads failed on purpose, or
             * the host's): nothing is dropped, the device stalls 1 ms and
             * tries again, as a device's firmware does not lose packets to
             * the host's malloc. */
            struct pollfd *npf = kv__mem_calloc(n * 2, sizeof(*npf));
            struct sv_conn **npk = kv__mem_calloc(n * 2, sizeof(*npk));
            if (!npf || !npk) {
                kv__mem_free(npf);
                kv__mem_free(npk);
                pthread_mutex_unlock(&c->lock);
                nanosleep(&(struct timespec){.tv_nsec = 1000000}, NULL);
                pthread_mutex_lock(&c->lock);
                continue;
            }
            kv__mem_free(pf);
            kv__mem_free(pk);
            pf = npf;
            pk = npk;
            cap = n * 2;
        }
        pf[0] = (struct pollfd){.fd = c->wake[0], .events = POLLIN};
        for (uint32_t i = 0; i < KVT_SV_MAX_PORTS; i++) /* -1 (none, down): ignored by poll */
            pf[1 + i] = (struct pollfd){.fd = c->port[i].listen_fd, .events = POLLIN};
        n = nl;
        for (struct sv_conn *k = c->conns; k; k = k->next) {
            if (k->dead)
                continue;
            if (k->out_head)
                conn_flush(k);
            pk[n] = k;
            pf[n++] = (struct pollfd){.fd = k->fd,
                                      .events = (short)(POLLIN | (k->out_head ? POLLOUT : 0))};
        }
        int timeout = -1;
        if (next != UINT64_MAX)
            timeout = (int)((next - now) / 1000000ull) + 1;
        pthread_mutex_unlock(&c->lock);
        int r = poll(pf, (nfds_t)n, timeout);
        pthread_mutex_lock(&c->lock);
        if (r <= 0)
            continue;
        if (pf[0].revents) {
            char b[64];
            while (read(c->wake[0], b, sizeof(b)) > 0) {
            }
        }
        for (uint32_t i = 0; i < KVT_SV_MAX_PORTS; i++) {
            if (!(pf[1 + i].revents & POLLIN))
                continue;
            int fd;
            while ((fd = accept4(c->port[i].listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC)) >=
                   0) {
                struct sv_conn *k = kv__mem_calloc(1, sizeof(*k));
                if (!k) {
                    close(fd);
                    continue;
                }
                k->fd = fd;
                k->port_num = (uint8_t)(i + 1);
                k->next = c->conns;
                c->conns = k;
            }
        }
        for (size_t i = nl; i < n; i++) {
            struct sv_conn *k = pk[i];
            if (k->doomed || k->dead)
                continue;
            if (pf[i].revents & (POLLIN | POLLHUP | POLLERR))
                conn_read(c, k);
            if (!k->dead && k->out_head)
                conn_flush(k);
        }
    }
    pthread_mutex_unlock(&c->lock);
    kv__mem_free(pf);
    kv__mem_free(pk);
    return NULL;
}

/* ------------------------------------------------------------ device --- */

static struct ibv_device **sv_get_device_list(int *num)
{
    struct ibv_device **l = kv__mem_calloc(sv_n_devices + 1, sizeof(*l));
    if (!l) {
        errno = ENOMEM;
        return NULL;
    }
    for (uint32_t i = 0; i < sv_n_devices; i++)
        l[i] = &sv_devices[i];
    if (num)
        *num = (int)sv_n_devices;
    return l;
}

static void sv_free_device_list(struct ibv_device **list)
{
    kv__mem_free(list);
}

static const char *sv_get_device_name(struct ibv_device *d)
{
    return d->name;
}

static struct ibv_context *sv_open_device(struct ibv_device *d)
{
    const ptrdiff_t di = d - sv_devices;
    if (di < 0 || (uint32_t)di >= sv_n_devices) {
        errno = ENODEV;
        return NULL;
    }
    struct sv_ctx *c = kv__mem_calloc(1, sizeof(*c));
    if (!c)
        goto fail;
    c->ibv.device = d;
    c->ibv.num_comp_vectors = 1;
    c->ibv.cmd_fd = -1;
    c->ibv.async_fd = -1;
    c->id = atomic_fetch_add(&next_ctx_id, 1);
    /* Keys of one context never equal another's in the process (a 64 Ki
     * range each): an lkey or rkey of another device is refused as unknown
     * wherever it is used, never resolved by chance to an MR of this one. */
    c->next_key = 0x100 + ((c->id & 0x7fffu) << 16);
    c->next_qpn = 0x10;
    c->n_ports = sv_specs[di].n_ports;
    for (uint32_t i = 0; i < KVT_SV_MAX_PORTS; i++)
        c->port[i].listen_fd = -1;
    if (pipe2(c->wake, O_NONBLOCK | O_CLOEXEC) != 0)
        goto free_ctx;
    for (uint32_t i = 0; i < c->n_ports; i++) {
        c->port[i].spec = sv_specs[di].port[i];
        if (port_listen(&c->port[i], c->id, i + 1) != 0)
            goto close_sock;
    }
    pthread_mutex_init(&c->lock, NULL);
    if (pthread_create(&c->thread, NULL, device_thread, c) != 0)
        goto destroy_lock;
    return &c->ibv;

destroy_lock:
    pthread_mutex_destroy(&c->lock);
close_sock:
    for (uint32_t i = 0; i < c->n_ports; i++)
        if (c->port[i].listen_fd >= 0)
            close(c->port[i].listen_fd);
    close(c->wake[0]);
    close(c->wake[1]);
free_ctx:
    kv__mem_free(c);
fail:
    errno = ENOMEM;
    return NULL;
}

static int sv_close_device(struct ibv_context *ic)
{
    struct sv_ctx *c = ctx_of(ic);
    pthread_mutex_lock(&c->lock);
    if (c->pds || c->mrs || c->cqs || c->qps || c->chans) {
        pthread_mutex_unlock(&c->lock);
        return EBUSY;
    }
    c->stop = true;
    pthread_mutex_unlock(&c->lock);
    wake(c);
    pthread_join(c->thread, NULL);
    while (c->conns) {
        struct sv_conn *k = c->conns;
        c->conns = k->next;
        conn_drop_out(k);
        close(k->fd);
        kv__mem_free(k);
    }
    for (uint32_t i = 0; i < c->n_ports; i++)
        if (c->port[i].listen_fd >= 0)
            close(c->port[i].listen_fd);
    close(c->wake[0]);
    close(c->wake[1]);
    pthread_mutex_destroy(&c->lock);
    kv__mem_free(c);
    return 0;
}

static int sv_query_device(struct ibv_context *ic, struct ibv_device_attr *a)
{
    memset(a, 0, sizeof(*a));
    snprintf(a->fw_ver, sizeof(a->fw_ver), "kvt-softverbs-1");
    a->max_mr_size = atomic_load(&max_mr_size);
    a->page_size_cap = 4096;
    a->vendor_id = 0x4b56;
    a->max_qp = 1024;
    a->max_qp_wr = KVT_SV_MAX_QP_WR;
    a->max_sge = KVT_SV_MAX_SGE;
    a->max_sge_rd = (int)atomic_load(&max_sge_rd);
    a->max_cq = 1024;
    a->max_cqe = KVT_SV_MAX_CQE;
    a->max_mr = 1 << 16;
    a->max_pd = 1024;
    a->max_qp_rd_atom = SV_MAX_RD_ATOM;
    a->max_qp_init_rd_atom = SV_MAX_RD_ATOM;
    a->phys_port_cnt = ctx_of(ic)->n_ports;
    return 0;
}

static int sv_query_port(struct ibv_context *ic, uint8_t port, struct ibv_port_attr *a)
{
    const struct sv_port *p = port_of(ctx_of(ic), port);
    if (!p)
        return EINVAL;
    memset(a, 0, sizeof(*a));
    a->state = p->spec.down ? IBV_PORT_DOWN : IBV_PORT_ACTIVE;
    a->max_mtu = IBV_MTU_4096;
    a->active_mtu = p->spec.active_mtu;
    a->gid_tbl_len = p->spec.link_layer == IBV_LINK_LAYER_INFINIBAND ? 2 : KVT_SV_GID_TBL;
    a->max_msg_sz = 1u << 31;
    a->pkey_tbl_len = SV_PKEY_TBL;
    a->lid = p->lid;
    a->sm_lid = p->spec.link_layer == IBV_LINK_LAYER_INFINIBAND && !p->spec.down ? 1 : 0;
    a->link_layer = p->spec.link_layer;
    a->phys_state = p->spec.down ? 3 : 5; /* Disabled, LinkUp */
    return 0;
}

/* Entry index of the port's table; EINVAL past gid_tbl_len (a down port's
 * entries are zero, as are Ethernet entries 4..7). */
static int gid_entry(struct ibv_context *ic, uint32_t port, uint32_t index, union ibv_gid *g,
                     enum ibv_gid_type *type)
{
    const struct sv_port *p = port_of(ctx_of(ic), port);
    const uint32_t len = p && p->spec.link_layer == IBV_LINK_LAYER_INFINIBAND ? 2 : KVT_SV_GID_TBL;
    if (!p || index >= len)
        return EINVAL;
    if (p->spec.down) {
        memset(g, 0, sizeof(*g));
        *type = p->spec.link_layer == IBV_LINK_LAYER_INFINIBAND ? IBV_GID_TYPE_IB
                                                                : IBV_GID_TYPE_ROCE_V1;
        return 0;
    }
    *g = p->gid[index];
    *type = p->gid_type[index];
    return 0;
}

static int sv_query_gid(struct ibv_context *ic, uint8_t port, int index, union ibv_gid *g)
{
    enum ibv_gid_type t;
    return index < 0 ? EINVAL : gid_entry(ic, port, (uint32_t)index, g, &t);
}

/* ibv_query_gid_ex(3): ENODATA for an empty (zero) entry, as the kernel
 * says for a GID table slot with nothing in it. */
static int sv_query_gid_ex(struct ibv_context *ic, uint32_t port, uint32_t index,
                           struct ibv_gid_entry *e, uint32_t flags)
{
    if (flags != 0)
        return EINVAL;
    union ibv_gid g;
    enum ibv_gid_type t;
    const int rc = gid_entry(ic, port, index, &g, &t);
    if (rc != 0)
        return rc;
    static const union ibv_gid zero;
    if (memcmp(g.raw, zero.raw, sizeof(g.raw)) == 0)
        return ENODATA;
    memset(e, 0, sizeof(*e));
    e->gid = g;
    e->gid_index = index;
    e->port_num = port;
    e->gid_type = t;
    return 0;
}

static struct ibv_pd *sv_alloc_pd(struct ibv_context *ic)
{
    struct sv_ctx *c = ctx_of(ic);
    struct sv_pd *p = kv__mem_calloc(1, sizeof(*p));
    if (!p) {
        errno = ENOMEM;
        return NULL;
    }
    p->ibv.context = ic;
    pthread_mutex_lock(&c->lock);
    p->ibv.handle = c->next_key++;
    p->next = c->pds;
    c->pds = p;
    pthread_mutex_unlock(&c->lock);
    return &p->ibv;
}

static int sv_dealloc_pd(struct ibv_pd *ip)
{
    struct sv_ctx *c = ctx_of(ip->context);
    struct sv_pd *p = (struct sv_pd *)ip;
    pthread_mutex_lock(&c->lock);
    if (p->refs > 0) {
        pthread_mutex_unlock(&c->lock);
        return EBUSY;
    }
    for (struct sv_pd **pp = &c->pds; *pp; pp = &(*pp)->next)
        if (*pp == p) {
            *pp = p->next;
            break;
        }
    pthread_mutex_unlock(&c->lock);
    kv__mem_free(p);
    return 0;
}

/* What the kernel's page pinning asks of [addr, addr + length): every
 * page mapped and readable and, when the MR may be written (LOCAL_WRITE or
 * REMOTE_WRITE), writable: 0, or EFAULT as ibv_reg_mr says for unmapped
 * memory and for a read-only mapping asked for write access. Read from
 * /proc/self/maps (sorted, non-overlapping ranges). */
static int mem_check(const void *addr, size_t length, bool write)
{
    uint64_t at = (uint64_t)(uintptr_t)addr;
    const uint64_t end = at + length; /* length <= max_mr_size: no wrap */
    FILE *f = fopen("/proc/self/maps", "re");
    if (!f)
        return EFAULT;
    char line[512];
    while (at < end && fgets(line, sizeof(line), f)) {
        if (!strchr(line, '\n')) { /* a long path: drop the rest of the line */
            int ch;
            while ((ch = fgetc(f)) != EOF && ch != '\n') {
            }
        }
        unsigned long lo, hi;
        char perm[5];
        if (sscanf(line, "%lx-%lx %4s", &lo, &hi, perm) != 3 || hi <= at)
            continue;
        if (lo > at || perm[0] != 'r' || (write && perm[1] != 'w'))
            break; /* a hole, or a mapping without the access */
        at = hi;
    }
    fclose(f);
    return at >= end ? 0 : EFAULT;
}

static struct ibv_mr *sv_reg_mr(struct ibv_pd *ip, void *addr, size_t length, int access)
{
    struct sv_ctx *c = ctx_of(ip->context);
    const int known = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
    /* ibv_reg_mr(3): REMOTE_WRITE (or atomic) needs LOCAL_WRITE. */
    if ((access & ~known) ||
        ((access & IBV_ACCESS_REMOTE_WRITE) && !(access & IBV_ACCESS_LOCAL_WRITE)) || length == 0 ||
        length > atomic_load(&max_mr_size) || !addr) {
        errno = EINVAL;
        return NULL;
    }
    const int unusable =
        mem_check(addr, length, (access & (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE)) != 0);
    if (unusable) {
        errno = unusable;
        return NULL;
    }
    struct sv_mr *m = kv__mem_calloc(1, sizeof(*m));
    if (!m) {
        errno = ENOMEM;
        return NULL;
    }
    m->ibv.context = ip->context;
    m->ibv.pd = ip;
    m->ibv.addr = addr;
    m->ibv.length = length;
    m->access = access;
    pthread_mutex_lock(&c->lock);
    m->ibv.lkey = m->ibv.rkey = m->ibv.handle = c->next_key++;
    m->next = c->mrs;
    c->mrs = m;
    ((struct sv_pd *)ip)->refs++;
    pthread_mutex_unlock(&c->lock);
    return &m->ibv;
}

/* lock held: whether SGE list sge[n] names MR key. */
static bool sges_use(const struct ibv_sge *sge, int n, uint32_t key)
{
    for (int i = 0; i < n; i++)
        if (sge[i].lkey == key)
            return true;
    return false;
}

/* lock held: MR m goes; nothing of this device touches its memory after
 * dereg_mr returns (the device thread moves bytes only under the lock):
 *   - a responder mid-payload into it discards the rest and NAKs
 *     REM_ACCESS_ERR (a WRITE_IMM / SEND's receive completes
 *     LOC_ACCESS_ERR / LOC_PROT_ERR and the QP goes to ERR);
 *   - a READ response read from it and not yet begun becomes a
 *     REM_ACCESS_ERR NAK; one partly sent breaks its connection (the
 *     requester's READ ends RETRY_EXC_ERR);
 *   - a READ response landing into it (a requester's SGE) discards the
 *     rest and completes LOC_PROT_ERR;
 *   - a request partly sent from it (a requester's SGE) breaks its
 *     connection (RETRY_EXC_ERR). */
static void mr_fence(struct sv_ctx *c, const struct sv_mr *m)
{
    const uint32_t key = m->ibv.lkey;
    for (struct sv_conn *k = c->conns; k; k = k->next) {
        if (k->in_payload && !k->in_discard && k->in_left > 0) {
            const struct sv_hdr *h = &k->in;
            if (!k->outgoing) {
                const bool hit = h->type == SV_SEND ? sges_use(k->in_rwr.sge, k->in_rwr.nsge, key)
                                                    : h->rkey == key;
                if (hit) {
                    k->in_discard = true;
                    k->in_nak = IBV_WC_REM_ACCESS_ERR;
                    if (k->in_has_rwr && k->qp) {
                        struct ibv_wc wc = {.wr_id = k->in_rwr.wr_id,
                                            .status = h->type == SV_SEND ? IBV_WC_LOC_PROT_ERR
                                                                         : IBV_WC_LOC_ACCESS_ERR,
                                            .opcode = IBV_WC_RECV,
                                            .qp_num = k->qp->ibv.qp_num};
                        cq_push(k->qp->rcq, k->qp, &wc, 0);
                        k->in_has_rwr = false;
                    }
                    if (k->qp)
                        qp_set_err(k->qp); /* class C, as resp_header's */
                }
            } else if (k->qp && k->qp->in_flight && h->type == SV_READ_RESP) {
                const struct sv_swr *w = &k->qp->sq[k->qp->sq_head];
                if (sges_use(w->sge, w->nsge, key)) {
                    k->in_discard = true;
                    k->in_bad = true;
                }
            }
        }
        for (struct sv_out **pp = &k->out_head, *prev = NULL; *pp;) {
            struct sv_out *o = *pp;
            bool hit;
            if (k->outgoing) { /* a request's payload: the head WR's SGEs */
                const struct sv_swr *w =
                    k->qp && k->qp->in_flight ? &k->qp->sq[k->qp->sq_head] : NULL;
                hit = o->niov > 1 && w && !w->is_inline && o->hdr.type != SV_READ_REQ &&
                      o->hdr.psn == k->qp->psn && sges_use(w->sge, w->nsge, key);
            } else {
                hit = o->hdr.type == SV_READ_RESP && o->niov > 1 && o->hdr.rkey == key;
            }
            if (hit && o->sent == 0 && !k->outgoing) {
                o->hdr.type = SV_NAK;
                o->hdr.len = 0;
                o->hdr.status = IBV_WC_REM_ACCESS_ERR;
                o->niov = 1;
                o->total = sizeof(o->hdr);
                atomic_fetch_add(&stats.naks_sent, 1);
                if (k->qp)
                    qp_set_err(k->qp); /* class C, as resp_header's */
            } else if (hit && o->sent == 0) {
                /* not begun: the request never leaves, the WR fails as lost */
                *pp = o->next;
                if (k->out_tail == o)
                    k->out_tail = prev;
                kv__mem_free(o);
                k->qp->fail_at_ns = now_ns() + KVT_SV_RETRY_MS * 1000000ull;
                continue;
            } else if (hit) {
                k->dead = true; /* cannot be cut short on the wire */
                conn_drop_out(k);
                break;
            }
            prev = o;
            pp = &o->next;
        }
    }
}

static int sv_dereg_mr(struct ibv_mr *im)
{
    struct sv_ctx *c = ctx_of(im->context);
    struct sv_mr *m = (struct sv_mr *)im;
    pthread_mutex_lock(&c->lock);
    for (struct sv_mr **pp = &c->mrs; *pp; pp = &(*pp)->next)
        if (*pp == m) {
            *pp = m->next;
            break;
        }
    mr_fence(c, m);
    ((struct sv_pd *)im->pd)->refs--;
    pthread_mutex_unlock(&c->lock);
    wake(c);
    kv__mem_free(m);
    return 0;
}

static struct ibv_cq *sv_create_cq(struct ibv_context *ic, int cqe, void *cq_context,
                                   struct ibv_comp_channel *channel, int comp_vector)
{
    struct sv_ctx *c = ctx_of(ic);
    if (cqe < 1 || cqe > KVT_SV_MAX_CQE || comp_vector < 0 || comp_vector >= ic->num_comp_vectors ||
        (channel && channel->context != ic)) {
        errno = EINVAL;
        return NULL;
    }
    struct sv_cq *q = kv__mem_calloc(1, sizeof(*q));
    if (!q || !(q->ring = kv__mem_calloc((size_t)cqe, sizeof(*q->ring)))) {
        kv__mem_free(q);
        errno = ENOMEM;
        return NULL;
    }
    q->ibv.context = ic;
    q->ibv.cq_context = cq_context;
    q->ibv.cqe = cqe;
    q->ibv.channel = channel;
    q->chan = (struct sv_chan *)channel;
    pthread_mutex_lock(&c->lock);
    if (channel)
        channel->refcnt++;
    q->next = c->cqs;
    c->cqs = q;
    pthread_mutex_unlock(&c->lock);
    return &q->ibv;
}

static int sv_destroy_cq(struct ibv_cq *icq)
{
    struct sv_ctx *c = ctx_of(icq->context);
    struct sv_cq *q = (struct sv_cq *)icq;
    pthread_mutex_lock(&c->lock);
    /* ibv_destroy_cq(3) waits until every event got was acknowledged
     * (forever, if never): here EBUSY, so a test sees it. */
    if (q->refs > 0 || q->events_acked < q->events_got) {
        pthread_mutex_unlock(&c->lock);
        return EBUSY;
    }
    if (q->events_acked > q->events_got) { /* acked what it never got */
        pthread_mutex_unlock(&c->lock);
        return EINVAL;
    }
    for (struct sv_cq **pp = &c->cqs; *pp; pp = &(*pp)->next)
        if (*pp == q) {
            *pp = q->next;
            break;
        }
    if (q->chan) {
        /* Its events not got yet go with it (as the kernel drops them). */
        struct sv_chan *ch = q->chan;
        struct sv_ev **pp = &ch->head, *last = NULL;
        while (*pp) {
            struct sv_ev *ev = *pp;
            if (ev->cq != q) {
                last = ev;
                pp = &ev->next;
                continue;
            }
            *pp = ev->next;
            kv__mem_free(ev);
            char b;
            ssize_t r = recv(ch->ibv.fd, &b, 1, MSG_DONTWAIT);
            (void)r; /* EAGAIN: a get_cq_event took the byte and finds no event */
        }
        ch->tail = last;
        ch->ibv.refcnt--;
    }
    pthread_mutex_unlock(&c->lock);
    kv__mem_free(q->ring);
    kv__mem_free(q);
    return 0;
}

static struct ibv_comp_channel *sv_create_comp_channel(struct ibv_context *ic)
{
    struct sv_ctx *c = ctx_of(ic);
    struct sv_chan *ch = kv__mem_calloc(1, sizeof(*ch));
    int sp[2];
    if (!ch) {
        errno = ENOMEM;
        return NULL;
    }
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sp) != 0) {
        const int e = errno;
        kv__mem_free(ch);
        errno = e;
        return NULL;
    }
    ch->ibv.context = ic;
    ch->ibv.fd = sp[0];
    ch->wfd = sp[1];
    pthread_mutex_lock(&c->lock);
    ch->next = c->chans;
    c->chans = ch;
    pthread_mutex_unlock(&c->lock);
    return &ch->ibv;
}

static int sv_destroy_comp_channel(struct ibv_comp_channel *ich)
{
    struct sv_ctx *c = ctx_of(ich->context);
    struct sv_chan *ch = (struct sv_chan *)ich;
    pthread_mutex_lock(&c->lock);
    if (ich->refcnt > 0) { /* CQs still use it (libibverbs: EBUSY) */
        pthread_mutex_unlock(&c->lock);
        return EBUSY;
    }
    for (struct sv_chan **pp = &c->chans; *pp; pp = &(*pp)->next)
        if (*pp == ch) {
            *pp = ch->next;
            break;
        }
    pthread_mutex_unlock(&c->lock);
    close(ch->ibv.fd);
    close(ch->wfd);
    kv__mem_free(ch);
    return 0;
}

/* Arm cq: an event for the next completion added to it (those already in
 * it raise none: poll after arming). solicited_only is not modelled. */
static int sv_req_notify_cq(struct ibv_cq *icq, int solicited_only)
{
    struct sv_ctx *c = ctx_of(icq->context);
    struct sv_cq *q = (struct sv_cq *)icq;
    if (solicited_only)
        return EOPNOTSUPP;
    pthread_mutex_lock(&c->lock);
    q->armed = true;
    pthread_mutex_unlock(&c->lock);
    return 0;
}

/* Read one byte (blocking unless O_NONBLOCK), then take the oldest event;
 * none left (destroy_cq dropped it): wait for the next. */
static int sv_get_cq_event(struct ibv_comp_channel *ich, struct ibv_cq **cq, void **cq_context)
{
    struct sv_ctx *c = ctx_of(ich->context);
    struct sv_chan *ch = (struct sv_chan *)ich;
    for (;;) {
        char b;
        const ssize_t r = read(ich->fd, &b, 1);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            return errno;
        if (r == 0)
            return EIO;
        pthread_mutex_lock(&c->lock);
        struct sv_ev *ev = ch->head;
        if (ev) {
            ch->head = ev->next;
            if (!ch->head)
                ch->tail = NULL;
            ev->cq->events_got++;
            *cq = &ev->cq->ibv;
            *cq_context = ev->cq->ibv.cq_context;
        }
        pthread_mutex_unlock(&c->lock);
        if (ev) {
            kv__mem_free(ev);
            return 0;
        }
    }
}

static void sv_ack_cq_events(struct ibv_cq *icq, unsigned int nevents)
{
    struct sv_ctx *c = ctx_of(icq->context);
    struct sv_cq *q = (struct sv_cq *)icq;
    pthread_mutex_lock(&c->lock);
    q->events_acked += nevents;
    pthread_mutex_unlock(&c->lock);
}

static struct ibv_qp *sv_create_qp(struct ibv_pd *ip, struct ibv_qp_init_attr *ia)
{
    struct sv_ctx *c = ctx_of(ip->context);
    if (ia->qp_type != IBV_QPT_RC || !ia->send_cq || !ia->recv_cq || ia->srq ||
        ia->send_cq->context != ip->context || ia->recv_cq->context != ip->context ||
        ia->cap.max_send_wr < 1 || ia->cap.max_send_wr > KVT_SV_MAX_QP_WR ||
        ia->cap.max_recv_wr < 1 || ia->cap.max_recv_wr > KVT_SV_MAX_QP_WR ||
        ia->cap.max_send_sge > KVT_SV_MAX_SGE || ia->cap.max_recv_sge > KVT_SV_MAX_SGE ||
        ia->cap.max_inline_data > KVT_SV_MAX_INLINE) {
        errno = EINVAL;
        return NULL;
    }
    struct sv_qp *q = kv__mem_calloc(1, sizeof(*q));
    if (!q)
        goto fail;
    q->sq = kv__mem_calloc(ia->cap.max_send_wr, sizeof(*q->sq));
    q->inl = kv__mem_calloc(ia->cap.max_send_wr, KVT_SV_MAX_INLINE);
    q->rq = kv__mem_calloc(ia->cap.max_recv_wr, sizeof(*q->rq));
    if (!q->sq || !q->inl || !q->rq)
        goto free_qp;
    for (uint32_t i = 0; i < ia->cap.max_send_wr; i++)
        q->sq[i].inl = q->inl + (size_t)i * KVT_SV_MAX_INLINE;
    q->ctx = c;
    q->pd = (struct sv_pd *)ip;
    q->scq = (struct sv_cq *)ia->send_cq;
    q->rcq = (struct sv_cq *)ia->recv_cq;
    q->cap = ia->cap;
    q->sq_sig_all = ia->sq_sig_all != 0;
    q->ibv.context = ip->context;
    q->ibv.qp_context = ia->qp_context;
    q->ibv.pd = ip;
    q->ibv.send_cq = ia->send_cq;
    q->ibv.recv_cq = ia->recv_cq;
    q->ibv.qp_type = IBV_QPT_RC;
    q->ibv.state = IBV_QPS_RESET;
    q->attr.qp_state = IBV_QPS_RESET;
    q->attr.cap = ia->cap;
    pthread_mutex_lock(&c->lock);
    q->ibv.qp_num = q->ibv.handle = c->next_qpn++;
    q->next = c->qps;
    c->qps = q;
    q->pd->refs++;
    q->scq->refs++;
    q->rcq->refs++;
    pthread_mutex_unlock(&c->lock);
    return &q->ibv;

free_qp:
    kv__mem_free(q->rq);
    kv__mem_free(q->inl);
    kv__mem_free(q->sq);
    kv__mem_free(q);
fail:
    errno = ENOMEM;
    return NULL;
}

/* Remove qp's CQEs from cq (destroy_qp, as mlx5's cq clean). */
static void cq_clean(struct sv_cq *cq, const struct sv_qp *qp)
{
    int kept = 0;
    for (int i = 0; i < cq->count; i++) {
        struct sv_cqe e = cq->ring[(cq->head + i) % cq->ibv.cqe];
        if (e.qp != qp)
            cq->ring[(cq->head + kept++) % cq->ibv.cqe] = e;
    }
    cq->count = kept;
}

static int sv_destroy_qp(struct ibv_qp *iqp)
{
    struct sv_ctx *c = ctx_of(iqp->context);
    struct sv_qp *q = (struct sv_qp *)iqp;
    pthread_mutex_lock(&c->lock);
    for (struct sv_qp **pp = &c->qps; *pp; pp = &(*pp)->next)
        if (*pp == q) {
            *pp = q->next;
            break;
        }
    /* its connections close: the peer's WRs in flight fail */
    for (struct sv_conn *k = c->conns; k; k = k->next)
        if (k->qp == q) {
            k->qp = NULL;
            k->doomed = true;
            conn_drop_out(k);
        }
    cq_clean(q->scq, q);
    cq_clean(q->rcq, q);
    q->pd->refs--;
    q->scq->refs--;
    q->rcq->refs--;
    pthread_mutex_unlock(&c->lock);
    wake(c);
    kv__mem_free(q->rq);
    kv__mem_free(q->inl);
    kv__mem_free(q->sq);
    kv__mem_free(q);
    return 0;
}

/* ibv_modify_qp(3), RC: the attributes each transition requires and the
 * ones it allows; anything else is EINVAL. */
struct sv_transition {
    enum ibv_qp_state from, to;
    int required, optional;
};

static const struct sv_transition transitions[] = {
    {IBV_QPS_RESET, IBV_QPS_RESET, 0, 0},
    {IBV_QPS_RESET, IBV_QPS_INIT, IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS, 0},
    {IBV_QPS_INIT, IBV_QPS_INIT, 0, IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS},
    {IBV_QPS_INIT, IBV_QPS_RTR,
     IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
         IBV_QP_MIN_RNR_TIMER,
     IBV_QP_ALT_PATH | IBV_QP_ACCESS_FLAGS | IBV_QP_PKEY_INDEX},
    {IBV_QPS_RTR, IBV_QPS_RTS,
     IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC,
     IBV_QP_CUR_STATE | IBV_QP_ALT_PATH | IBV_QP_ACCESS_FLAGS | IBV_QP_MIN_RNR_TIMER |
         IBV_QP_PATH_MIG_STATE},
    {IBV_QPS_RTS, IBV_QPS_RTS, 0,
     IBV_QP_CUR_STATE | IBV_QP_ACCESS_FLAGS | IBV_QP_ALT_PATH | IBV_QP_MIN_RNR_TIMER |
         IBV_QP_PATH_MIG_STATE},
};

/* As the kernel's table (ib_modify_qp_is_ok): -> RESET from any state,
 * -> ERR from any but RESET (RESET -> ERR is not a transition), both with
 * no attribute but the state (IBV_QP_CUR_STATE included: it is optional
 * only in RTR -> RTS and RTS -> RTS). */
static bool transition_ok(enum ibv_qp_state from, enum ibv_qp_state to, int mask)
{
    mask &= ~IBV_QP_STATE;
    if (to == IBV_QPS_RESET || to == IBV_QPS_ERR)
        return mask == 0 && (to == IBV_QPS_RESET || from != IBV_QPS_RESET);
    for (size_t i = 0; i < sizeof(transitions) / sizeof(transitions[0]); i++) {
        const struct sv_transition *t = &transitions[i];
        if (t->from == from && t->to == to)
            return (mask & t->required) == t->required &&
                   (mask & ~(t->required | t->optional)) == 0;
    }
    return false;
}

/* Whether a port on the host listens under the address a GID names. */
static bool gid_known(const union ibv_gid *g, uint8_t link_layer)
{
    uint8_t ll;
    uint32_t addr;
    if (!gid_route(g, &ll, &addr) || ll != link_layer)
        return false;
    struct sockaddr_un a;
    socklen_t alen;
    port_sockaddr(ll, addr, &a, &alen);
    const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return false;
    const bool ok = connect(fd, (struct sockaddr *)&a, alen) == 0;
    close(fd);
    return ok;
}

/* INIT -> RTR of a QP on port pt: the checks of the header's model;
 * 0 or EINVAL. */
static int rtr_check(const struct sv_qp *q, const struct sv_port *pt,
                     const struct ibv_qp_attr *attr)
{
    const struct ibv_ah_attr *ah = &attr->ah_attr;
    if (!pt || pt->spec.down || ah->port_num != q->attr.port_num || attr->path_mtu < IBV_MTU_256 ||
        attr->path_mtu > pt->spec.active_mtu)
        return EINVAL;
    if (ah->is_global) {
        static const union ibv_gid zero;
        if ((int)ah->grh.sgid_index >= pt->gid_tbl_len ||
            memcmp(pt->gid[ah->grh.sgid_index].raw, zero.raw, sizeof(zero.raw)) == 0 ||
            !gid_known(&ah->grh.dgid, pt->spec.link_layer))
            return EINVAL;
    }
    if (pt->spec.link_layer == IBV_LINK_LAYER_INFINIBAND)
        return ah->dlid >= 1 && ah->dlid <= 0xbfff ? 0 : EINVAL;
    return ah->is_global ? 0 : EINVAL; /* RoCE: a GRH always */
}

/* Connect qp (RTR, checked) along its route: the dlid on InfiniBand, the
 * dgid on Ethernet. A LID nobody has is not an error of modify_qp (as on a
 * real fabric): the WRs time out. */
static void qp_connect(struct sv_qp *q, const struct sv_port *pt)
{
    struct sockaddr_un a;
    socklen_t alen;
    struct sv_conn *k = kv__mem_calloc(1, sizeof(*k));
    if (!k)
        return;
    k->outgoing = true;
    k->qp = q;
    k->fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (k->fd < 0) {
        kv__mem_free(k);
        return;
    }
    uint8_t ll = pt->spec.link_layer;
    uint32_t addr = q->attr.ah_attr.dlid;
    bool routed =
        ll == IBV_LINK_LAYER_INFINIBAND || gid_route(&q->attr.ah_attr.grh.dgid, &ll, &addr);
    port_sockaddr(ll, addr, &a, &alen);
    if (!routed || connect(k->fd, (struct sockaddr *)&a, alen) != 0)
        k->dead = true;
    fcntl(k->fd, F_SETFL, fcntl(k->fd, F_GETFL) | O_NONBLOCK);
    struct sv_hdr h = {.type = SV_HELLO,
                       .dst_qpn = q->attr.dest_qp_num,
                       .src_qpn = q->ibv.qp_num,
                       .rkey = ll == IBV_LINK_LAYER_INFINIBAND ? pt->lid : pt->addr,
                       .status = (uint32_t)q->attr.path_mtu};
    conn_queue(k, &h, NULL, 0);
    k->next = q->ctx->conns;
    q->ctx->conns = k;
    q->conn = k;
}

static void qp_reset(struct sv_qp *q)
{
    for (struct sv_conn *k = q->ctx->conns; k; k = k->next)
        if (k->qp == q) {
            k->qp = NULL;
            k->doomed = true;
            conn_drop_out(k);
        }
    q->conn = NULL;
    cq_clean(q->scq, q);
    cq_clean(q->rcq, q);
    q->sq_head = q->sq_pending = q->sq_used = q->unsig_done = 0;
    q->rq_head = q->rq_count = 0;
    q->in_flight = false;
    q->fail_at_ns = q->resend_at_ns = 0;
}

/* The ranges of ibv_modify_qp(3)'s attributes, as the kernel checks
 * them: a pkey_index inside the table (1 entry), rd_atomic depths up to
 * the device's (query_device), 5-bit timers, 3-bit retry counts, 24-bit
 * QP numbers and PSNs. 0 or EINVAL. */
static int attr_ranges(const struct ibv_qp_attr *a, int mask)
{
    if (((mask & IBV_QP_PKEY_INDEX) && a->pkey_index >= SV_PKEY_TBL) ||
        ((mask & IBV_QP_MAX_QP_RD_ATOMIC) && a->max_rd_atomic > SV_MAX_RD_ATOM) ||
        ((mask & IBV_QP_MAX_DEST_RD_ATOMIC) && a->max_dest_rd_atomic > SV_MAX_RD_ATOM) ||
        ((mask & IBV_QP_TIMEOUT) && a->timeout > 31) ||
        ((mask & IBV_QP_MIN_RNR_TIMER) && a->min_rnr_timer > 31) ||
        ((mask & IBV_QP_RETRY_CNT) && a->retry_cnt > 7) ||
        ((mask & IBV_QP_RNR_RETRY) && a->rnr_retry > 7) ||
        ((mask & IBV_QP_DEST_QPN) && a->dest_qp_num > 0xffffffu) ||
        ((mask & IBV_QP_RQ_PSN) && a->rq_psn > 0xffffffu) ||
        ((mask & IBV_QP_SQ_PSN) && a->sq_psn > 0xffffffu))
        return EINVAL;
    return 0;
}

static int sv_modify_qp(struct ibv_qp *iqp, struct ibv_qp_attr *attr, int mask)
{
    struct sv_qp *q = (struct sv_qp *)iqp;
    struct sv_ctx *c = q->ctx;
    int rc = 0;
    pthread_mutex_lock(&c->lock);
    const enum ibv_qp_state from = q->ibv.state;
    const enum ibv_qp_state to = (mask & IBV_QP_STATE) ? attr->qp_state : from;
    if (((mask & IBV_QP_CUR_STATE) && attr->cur_qp_state != from) ||
        !transition_ok(from, to, mask) || ((mask & IBV_QP_PORT) && !port_of(c, attr->port_num)) ||
        attr_ranges(attr, mask)) {
        rc = EINVAL;
        goto out;
    }
    if (from == IBV_QPS_INIT && to == IBV_QPS_RTR) {
        rc = rtr_check(q, port_of(c, q->attr.port_num), attr);
        if (rc)
            goto out;
    }
    if (mask & IBV_QP_ACCESS_FLAGS)
        q->attr.qp_access_flags = attr->qp_access_flags;
    if (mask & IBV_QP_PKEY_INDEX)
        q->attr.pkey_index = attr->pkey_index;
    if (mask & IBV_QP_PORT)
        q->attr.port_num = attr->port_num;
    if (mask & IBV_QP_AV)
        q->attr.ah_attr = attr->ah_attr;
    if (mask & IBV_QP_PATH_MTU)
        q->attr.path_mtu = attr->path_mtu;
    if (mask & IBV_QP_DEST_QPN)
        q->attr.dest_qp_num = attr->dest_qp_num;
    if (mask & IBV_QP_RQ_PSN) {
        q->attr.rq_psn = attr->rq_psn;
        q->epsn = attr->rq_psn;
    }
    if (mask & IBV_QP_MAX_DEST_RD_ATOMIC)
        q->attr.max_dest_rd_atomic = attr->max_dest_rd_atomic;
    if (mask & IBV_QP_MIN_RNR_TIMER)
        q->attr.min_rnr_timer = attr->min_rnr_timer;
    if (mask & IBV_QP_TIMEOUT)
        q->attr.timeout = attr->timeout;
    if (mask & IBV_QP_RETRY_CNT)
        q->attr.retry_cnt = attr->retry_cnt;
    if (mask & IBV_QP_RNR_RETRY) {
        q->attr.rnr_retry = attr->rnr_retry;
        q->rnr_left = attr->rnr_retry;
    }
    if (mask & IBV_QP_SQ_PSN) {
        q->attr.sq_psn = attr->sq_psn;
        q->psn = (attr->sq_psn - 1) & SV_PSN_MASK; /* the first request carries sq_psn */
    }
    if (mask & IBV_QP_MAX_QP_RD_ATOMIC)
        q->attr.max_rd_atomic = attr->max_rd_atomic;
    if (to == IBV_QPS_RESET)
        qp_reset(q);
    if (from == IBV_QPS_INIT && to == IBV_QPS_RTR)
        qp_connect(q, port_of(c, q->attr.port_num));
    q->attr.qp_state = to;
    q->ibv.state = to;
    if (to == IBV_QPS_ERR)
        qp_flush(q);
out:
    pthread_mutex_unlock(&c->lock);
    wake(c);
    return rc;
}

static int sv_query_qp(struct ibv_qp *iqp, struct ibv_qp_attr *attr, int mask,
                       struct ibv_qp_init_attr *ia)
{
    struct sv_qp *q = (struct sv_qp *)iqp;
    (void)mask; /* everything is returned */
    pthread_mutex_lock(&q->ctx->lock);
    *attr = q->attr;
    attr->cur_qp_state = q->attr.qp_state;
    if (ia) {
        memset(ia, 0, sizeof(*ia));
        ia->qp_context = iqp->qp_context;
        ia->send_cq = iqp->send_cq;
        ia->recv_cq = iqp->recv_cq;
        ia->cap = q->cap;
        ia->qp_type = IBV_QPT_RC;
        ia->sq_sig_all = q->sq_sig_all;
    }
    pthread_mutex_unlock(&q->ctx->lock);
    return 0;
}

/* ----------------------------------------------------------- data path -- */

static int post_one_send(struct sv_qp *q, const struct ibv_send_wr *wr)
{
    if (q->ibv.state == IBV_QPS_RESET || q->ibv.state == IBV_QPS_INIT ||
        q->ibv.state == IBV_QPS_RTR)
        return EINVAL;
    if (wr->num_sge < 0 || wr->num_sge > (int)q->cap.max_send_sge ||
        (wr->opcode != IBV_WR_RDMA_WRITE && wr->opcode != IBV_WR_RDMA_WRITE_WITH_IMM &&
         wr->opcode != IBV_WR_RDMA_READ && wr->opcode != IBV_WR_SEND) ||
        (wr->send_flags & ~(IBV_SEND_SIGNALED | IBV_SEND_INLINE | IBV_SEND_FENCE)))
        return EINVAL;
    /* An RDMA READ scatters into at most max_sge_rd SGEs (query_device),
     * and is never inline: ibv_post_send(3), IBV_SEND_INLINE "valid only
     * for the Send and RDMA Write opcodes" (mlx5 would build an inline
     * segment the response cannot land in). */
    if (wr->opcode == IBV_WR_RDMA_READ &&
        (wr->num_sge > (int)atomic_load(&max_sge_rd) || (wr->send_flags & IBV_SEND_INLINE)))
        return EINVAL;
    if (q->sq_used >= q->cap.max_send_wr)
        return ENOMEM;
    struct sv_swr *w = &q->sq[(q->sq_head + q->sq_pending) % q->cap.max_send_wr];
    w->wr_id = wr->wr_id;
    w->op = wr->opcode;
    w->signaled = q->sq_sig_all || (wr->send_flags & IBV_SEND_SIGNALED);
    w->imm = wr->imm_data;
    w->raddr = wr->wr.rdma.remote_addr;
    w->rkey = wr->wr.rdma.rkey;
    w->nsge = wr->num_sge;
    w->is_inline = false;
    w->len = 0;
    for (int i = 0; i < wr->num_sge; i++) {
        w->sge[i] = wr->sg_list[i];
        w->len += wr->sg_list[i].length;
    }
    if (wr->send_flags & IBV_SEND_INLINE) {
        if (w->len > q->cap.max_inline_data)
            return EINVAL;
        size_t off = 0;
        for (int i = 0; i < wr->num_sge; i++) {
            memcpy(w->inl + off, (const void *)(uintptr_t)wr->sg_list[i].addr,
                   wr->sg_list[i].length);
            off += wr->sg_list[i].length;
        }
        w->is_inline = true;
    }
    q->sq_pending++;
    q->sq_used++;
    return 0;
}

static int sv_post_send(struct ibv_qp *iqp, struct ibv_send_wr *wr, struct ibv_send_wr **bad)
{
    struct sv_qp *q = (struct sv_qp *)iqp;
    int rc = 0;
    pthread_mutex_lock(&q->ctx->lock);
    for (; wr; wr = wr->next) {
        rc = post_one_send(q, wr);
        if (rc) {
            *bad = wr;
            break;
        }
    }
    pthread_mutex_unlock(&q->ctx->lock);
    wake(q->ctx);
    return rc;
}

static int sv_post_recv(struct ibv_qp *iqp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad)
{
    struct sv_qp *q = (struct sv_qp *)iqp;
    int rc = 0;
    pthread_mutex_lock(&q->ctx->lock);
    for (; wr; wr = wr->next) {
        if (q->ibv.state == IBV_QPS_RESET)
            rc = EINVAL;
        else if (wr->num_sge < 0 || wr->num_sge > (int)q->cap.max_recv_sge)
            rc = EINVAL;
        else if (q->rq_count >= q->cap.max_recv_wr)
            rc = ENOMEM;
        if (rc) {
            *bad = wr;
            break;
        }
        struct sv_rwr *r = &q->rq[(q->rq_head + q->rq_count) % q->cap.max_recv_wr];
        r->wr_id = wr->wr_id;
        r->nsge = wr->num_sge;
        for (int i = 0; i < wr->num_sge; i++)
            r->sge[i] = wr->sg_list[i];
        q->rq_count++;
    }
    if (q->ibv.state == IBV_QPS_ERR)
        qp_flush(q);
    pthread_mutex_unlock(&q->ctx->lock);
    return rc;
}

/* ibv_poll_cq(3): "If the completion status is other than IBV_WC_SUCCESS,
 * only the following attributes are valid: wr_id, status, qp_num, and
 * vendor_err." (mlx5 leaves the others as the caller's array had them.)
 * The rest are filled with a pattern no completion has: an opcode outside
 * enum ibv_wc_opcode, so nothing can tell a send's error from a receive's
 * by it. */
static void wc_poison(struct ibv_wc *w)
{
    w->opcode = (enum ibv_wc_opcode)0x5a5a;
    w->byte_len = 0x5a5a5a5au;
    w->imm_data = 0x5a5a5a5au;
    w->src_qp = 0x5a5a5au;
    w->wc_flags = 0x5a5a5a5au;
    w->pkey_index = 0x5a5a;
    w->slid = 0x5a5a;
    w->sl = 0x5a;
    w->dlid_path_bits = 0x5a;
}

static int sv_poll_cq(struct ibv_cq *icq, int n, struct ibv_wc *wc)
{
    struct sv_cq *q = (struct sv_cq *)icq;
    struct sv_ctx *c = ctx_of(icq->context);
    int got = 0;
    pthread_mutex_lock(&c->lock);
    if (q->overflowed) {
        pthread_mutex_unlock(&c->lock);
        return -EOVERFLOW;
    }
    const uint64_t now = now_ns();
    while (got < n && q->count > 0) {
        struct sv_cqe *e = &q->ring[q->head];
        if (e->visible_ns > now)
            break; /* held (DELAY_COMPLETION); what is behind it waits */
        wc[got] = e->wc;
        if (e->wc.status != IBV_WC_SUCCESS)
            wc_poison(&wc[got]);
        got++;
        e->qp->sq_used -= e->retire;
        q->head = (q->head + 1) % q->ibv.cqe;
        q->count--;
    }
    pthread_mutex_unlock(&c->lock);
    return got;
}

static const struct kv__verbs softverbs = {
    .version = KV__VERBS_VERSION,
    .name = "softverbs",
    .get_device_list = sv_get_device_list,
    .free_device_list = sv_free_device_list,
    .get_device_name = sv_get_device_name,
    .open_device = sv_open_device,
    .close_device = sv_close_device,
    .query_device = sv_query_device,
    .query_port = sv_query_port,
    .query_gid = sv_query_gid,
    .query_gid_ex = sv_query_gid_ex,
    .alloc_pd = sv_alloc_pd,
    .dealloc_pd = sv_dealloc_pd,
    .reg_mr = sv_reg_mr,
    .dereg_mr = sv_dereg_mr,
    .create_cq = sv_create_cq,
    .destroy_cq = sv_destroy_cq,
    .create_comp_channel = sv_create_comp_channel,
    .destroy_comp_channel = sv_destroy_comp_channel,
    .req_notify_cq = sv_req_notify_cq,
    .get_cq_event = sv_get_cq_event,
    .ack_cq_events = sv_ack_cq_events,
    .create_qp = sv_create_qp,
    .modify_qp = sv_modify_qp,
    .query_qp = sv_query_qp,
    .destroy_qp = sv_destroy_qp,
    .post_send = sv_post_send,
    .post_recv = sv_post_recv,
    .poll_cq = sv_poll_cq,
};

const struct kv__verbs *kvt_softverbs(void)
{
    return &softverbs;
}
