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
 *   rails         several devices (cfg.rdma_devices), as NCCL's rails:
 *                 each its own context, PD, channel, and per peer a CQ and
 *                 conns_per_peer QPs (QP qi on rail qi / conns), connected
 *                 to the peer's rail of the same index; both INFO carry
 *                 every rail, and a peer with fewer rails is connected on
 *                 the common count (our QPs past it stay in INIT). A region
 *                 lives on one rail (rdma_mem_reg: the caller's, else for
 *                 device memory the rail fewest PCIe hops from its GPU,
 *                 else the least loaded rail on the memory's NUMA node,
 *                 else round robin), its exposures too, and the blob key
 *                 names the rail; a WR goes on a QP of its regions'
 *                 rail, and an entry whose local and remote regions sit
 *                 on different rails (or on a rail not connected) is
 *                 refused at post (rdma_check): nothing is staged across
 *                 rails.
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
 *                 inside one local chunk; a READ scatters into up to
 *                 max_sge_rd, 1 where the device says 0; both capped at
 *                 RD_MAX_SGE), WRs round robin over the peer's
 *                 QPs. Every 16th WR of a posting round and its last are
 *                 signaled; a QP's ring of WR records (wr_id = sequence)
 *                 retires in order, so a signaled completion retires the
 *                 unsignaled WRs before it (RC completes in order), and a
 *                 QP never holds more than max_send_wr WRs whose slots are
 *                 not freed. An entry ends KV_OK when every byte of it was
 *                 covered by a successful completion: results are exact.
 *   notifications a SEND on QP 0 (a NOTE: the message table in
 *                 kv_xport_rdma_int.h) into a receive buffer the receiver
 *                 pre-posted (registered), sent only when every earlier
 *                 write on the peer has completed (kv__xport_note_may_go):
 *                 with several QPs RC orders nothing across QPs, so the
 *                 gate is on completions, not on posting order. The
 *                 receiver turns the receive completion into
 *                 kv__xport_note_push (or a refusal: queue full, no
 *                 memory), re-posts the buffer and owes an
 *                 acknowledgement record, sent in an ACK message on QP 0;
 *                 the transfer ends DONE on a KV_OK record, FAILED on a
 *                 refusal (its note status). At most RD_NOTE_SLOTS
 *                 notifications unacknowledged per peer.
 *   close cause   a side that fails a peer for a reason of its own sends
 *                 an out-of-band FAIL (status, message) before its OOB
 *                 peer closes; the other side fails with it.
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
 * regions of one rail share a PD, so an rkey leaked to another peer of
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
#include <sys/syscall.h>
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
    snprintf(r->teardown_msg, sizeof(r->teardown_msg), "xport rdma: %s on %.120s: %s", what, r->dev,
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

/* Event mode: a completion channel per rail (fd non-blocking) and the
 * eventfd. */
static kv_status events_open(struct rdma *r)
{
    for (uint32_t i = 0; i < r->nrail; i++) {
        struct rrail *rl = &r->rail[i];
        rl->ch = r->v->create_comp_channel(rl->ctx);
        if (!rl->ch)
            return kv__error(kv__rd_errno_status(errno),
                             "xport_create(rdma): create_comp_channel on %s: %s", rl->dev,
                             strerror(errno));
        const int fl = fcntl(rl->ch->fd, F_GETFL);
        if (fl < 0 || fcntl(rl->ch->fd, F_SETFL, fl | O_NONBLOCK) != 0)
            return kv__error(KV_ERR_IO,
                             "xport_create(rdma): O_NONBLOCK on the completion channel of %s: %s",
                             rl->dev, strerror(errno));
    }
    r->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (r->wake_fd < 0)
        return kv__error(KV_ERR_IO, "xport_create(rdma): eventfd: %s", strerror(errno));
    return KV_OK;
}

/* What events_open made, also after it failed half-way. */
static void events_close(struct rdma *r)
{
    for (uint32_t i = 0; i < r->nrail; i++) {
        struct rrail *rl = &r->rail[i];
        if (rl->ch)
            kv__rd_teardown_check(r, r->v->destroy_comp_channel(rl->ch),
                                  "ibv_destroy_comp_channel");
        rl->ch = NULL;
    }
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

/* The GID of rail rl: cfg's index (it must hold a GID), else automatic
 * (Ethernet: the best gid_score, lowest index on a tie; InfiniBand: index
 * 0, or none when the port has no GID there: then no GRH is possible). */
static kv_status pick_gid(struct rdma *r, struct rrail *rl, int32_t want)
{
    const struct kv__verbs *v = r->v;
    struct ibv_gid_entry e;
    rl->gid_index = -1;
    if (want < -1)
        return kv__error(KV_ERR_INVALID_ARG,
                         "xport_create(rdma): rdma_gid_index %d (an index >= 0, or -1: automatic)",
                         want);
    if (want >= 0) {
        if (want >= rl->pa.gid_tbl_len)
            return kv__error(KV_ERR_INVALID_ARG,
                             "xport_create(rdma): rdma_gid_index %d, but %s port %u has %d GIDs",
                             want, rl->dev, rl->port, rl->pa.gid_tbl_len);
        const int err = v->query_gid_ex(rl->ctx, rl->port, (uint32_t)want, &e, 0);
        if (err != 0)
            return kv__error(err == ENODATA ? KV_ERR_INVALID_ARG : KV_ERR_IO,
                             "xport_create(rdma): GID index %d of %s port %u: %s", want, rl->dev,
                             rl->port, err == ENODATA ? "empty" : strerror(err));
        rl->gid_index = want;
        rl->gid = e.gid;
        rl->gid_type = (enum ibv_gid_type)e.gid_type;
        return KV_OK;
    }
    int best = -1;
    for (int i = 0; i < rl->pa.gid_tbl_len; i++) {
        if (v->query_gid_ex(rl->ctx, rl->port, (uint32_t)i, &e, 0) != 0)
            continue; /* empty (ENODATA) or unreadable: not a candidate */
        const int sc = gid_score(&e);
        if (rl->link == IBV_LINK_LAYER_INFINIBAND || sc > best) {
            best = sc;
            rl->gid_index = i;
            rl->gid = e.gid;
            rl->gid_type = (enum ibv_gid_type)e.gid_type;
        }
        if (rl->link == IBV_LINK_LAYER_INFINIBAND || sc == 3)
            break; /* InfiniBand: the first; RoCE: none scores higher */
    }
    if (rl->gid_index < 0 && rl->link == IBV_LINK_LAYER_ETHERNET)
        return kv__error(KV_ERR_UNSUPPORTED,
                         "xport_create(rdma): %s port %u (ethernet) has no GID among %d entries "
                         "(RoCE needs one: is an IP address configured on its netdev?)",
                         rl->dev, rl->port, rl->pa.gid_tbl_len);
    return KV_OK;
}

/* Device and port of rail rl: the device `want` by name (NULL: each in
 * list order) and cfg's port (else its first ACTIVE one); rl->ctx open on
 * success. Every device and port looked at is named in the error when
 * none fits. */
static kv_status pick_port(struct rdma *r, struct rrail *rl, struct ibv_device **list, int num,
                           const char *want)
{
    const struct kv__verbs *v = r->v;
    const struct kv_xport_config *cfg = &r->x->cfg;
    char seen[512] = "", names[512] = "";
    bool named = false, no_memory = false; /* a device or port query ran out of memory */
    if (cfg->rdma_port > 255)
        return kv__error(KV_ERR_INVALID_ARG, "xport_create(rdma): rdma_port %u (ports are 1..255)",
                         cfg->rdma_port);
    for (int d = 0; d < num; d++) {
        const char *name = v->get_device_name(list[d]);
        say(names, sizeof(names), "%s%s", names[0] ? ", " : "", name ? name : "?");
        if (want && strcmp(want, name ? name : "") != 0)
            continue;
        named = true;
        snprintf(rl->dev, sizeof(rl->dev), "%s", name ? name : "?");
        rl->ctx = v->open_device(list[d]);
        int e = rl->ctx ? v->query_device(rl->ctx, &rl->da) : (errno ? errno : ENODEV);
        no_memory |= e == ENOMEM;
        if (e != 0) {
            if (rl->ctx)
                (void)v->close_device(rl->ctx);
            rl->ctx = NULL;
            if (want)
                return kv__error(kv__rd_errno_status(e), "xport_create(rdma): open/query %s: %s",
                                 rl->dev, strerror(e));
            say(seen, sizeof(seen), "%s%s: %s", seen[0] ? ", " : "", rl->dev, strerror(e));
            continue;
        }
        if (cfg->rdma_port > (uint32_t)rl->da.phys_port_cnt) {
            (void)v->close_device(rl->ctx);
            rl->ctx = NULL;
            if (!want) { /* another device may have that port */
                say(seen, sizeof(seen), "%s%s: %u ports", seen[0] ? ", " : "", rl->dev,
                    (unsigned)rl->da.phys_port_cnt);
                continue;
            }
            return kv__error(KV_ERR_INVALID_ARG, "xport_create(rdma): rdma_port %u, but %s has %u",
                             cfg->rdma_port, rl->dev, (unsigned)rl->da.phys_port_cnt);
        }
        const uint32_t lo = cfg->rdma_port ? cfg->rdma_port : 1;
        const uint32_t hi = cfg->rdma_port ? cfg->rdma_port : rl->da.phys_port_cnt;
        for (uint32_t pt = lo; pt <= hi; pt++) {
            e = v->query_port(rl->ctx, (uint8_t)pt, &rl->pa);
            no_memory |= e == ENOMEM;
            if (e != 0) {
                say(seen, sizeof(seen), "%s%s port %u: %s", seen[0] ? ", " : "", rl->dev, pt,
                    strerror(e));
                continue;
            }
            if (rl->pa.state != IBV_PORT_ACTIVE) {
                say(seen, sizeof(seen), "%s%s port %u %s", seen[0] ? ", " : "", rl->dev, pt,
                    port_state_str(rl->pa.state));
                continue;
            }
            rl->port = (uint8_t)pt;
            rl->link = rl->pa.link_layer == IBV_LINK_LAYER_ETHERNET ? IBV_LINK_LAYER_ETHERNET
                                                                    : IBV_LINK_LAYER_INFINIBAND;
            if (rl->link == IBV_LINK_LAYER_INFINIBAND && (rl->pa.lid == 0 || rl->pa.lid > 0xbfff)) {
                say(seen, sizeof(seen), "%s%s port %u ACTIVE but LID 0x%x (no subnet manager?)",
                    seen[0] ? ", " : "", rl->dev, pt, rl->pa.lid);
                continue;
            }
            if (kv__rd_mtu_bytes(rl->pa.active_mtu) == 0) {
                say(seen, sizeof(seen), "%s%s port %u active MTU code %d", seen[0] ? ", " : "",
                    rl->dev, pt, (int)rl->pa.active_mtu);
                continue;
            }
            return KV_OK;
        }
        (void)v->close_device(rl->ctx);
        rl->ctx = NULL;
    }
    if (no_memory) /* not "no port": a device could not be looked at */
        return kv__error(KV_ERR_NO_MEMORY,
                         "xport_create(rdma): out of memory opening or querying "
                         "the devices (%s)",
                         seen);
    if (want && !named)
        return kv__error(KV_ERR_NOT_FOUND,
                         "xport_create(rdma): no RDMA device \"%s\" (%s lists: %s)", want, v->name,
                         names);
    if (cfg->rdma_port)
        return kv__error(KV_ERR_UNSUPPORTED, "xport_create(rdma): rdma_port %u not usable (%s)",
                         cfg->rdma_port, seen);
    if (want)
        return kv__error(KV_ERR_UNSUPPORTED, "xport_create(rdma): no ACTIVE port on %s (%s)", want,
                         seen);
    return kv__error(KV_ERR_UNSUPPORTED, "xport_create(rdma): no ACTIVE port on any device (%s)",
                     seen);
}

/* ---- NUMA: which rail is near a region --------------------------------- */

const char *kv__rd_sysfs_root = "/sys";
int (*kv__rd_mem_node)(const void *base, size_t bytes) = kv__rd_mem_node_sys;

/* A sysfs numa_node file: the node, or -1 (no file, unreadable, or the
 * kernel's -1: not known). */
static int numa_file(const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    int n = -1;
    if (fscanf(f, "%d", &n) != 1 || n < 0 || n > 4095)
        n = -1;
    fclose(f);
    return n;
}

/* "<root>/class/infiniband/<dev>/device/numa_node" */
int kv__rd_sysfs_numa(const char *root, const char *dev)
{
    char path[512];
    snprintf(path, sizeof(path), "%s/class/infiniband/%s/device/numa_node", root, dev);
    return numa_file(path);
}

/* move_pages(2) with nodes NULL reports where each page is (a negative
 * errno for a page not present); up to 8 pages spread over the range, the
 * node most of them are on. -1 when none is known (pages not touched yet,
 * the call refused). */
int kv__rd_mem_node_sys(const void *base, size_t bytes)
{
    const long pg = sysconf(_SC_PAGESIZE) > 0 ? sysconf(_SC_PAGESIZE) : 4096;
    const uintptr_t first = (uintptr_t)base & ~(uintptr_t)(pg - 1);
    const uintptr_t last = ((uintptr_t)base + bytes - 1) & ~(uintptr_t)(pg - 1);
    const uint64_t npages = (last - first) / (uintptr_t)pg + 1;
    const unsigned n = npages < 8 ? (unsigned)npages : 8;
    void *pages[8];
    int status[8];
    for (unsigned i = 0; i < n; i++) {
        const uint64_t k = n == 1 ? 0 : (npages - 1) * i / (n - 1);
        pages[i] = (void *)(first + (uintptr_t)(k * (uint64_t)pg));
        status[i] = -1;
    }
    if (syscall(SYS_move_pages, 0, (unsigned long)n, pages, NULL, status, 0) != 0)
        return -1;
    int best = -1, best_n = 0;
    for (unsigned i = 0; i < n; i++) {
        if (status[i] < 0)
            continue;
        int c = 0;
        for (unsigned j = 0; j < n; j++)
            c += status[j] == status[i];
        if (c > best_n || (c == best_n && status[i] < best)) {
            best = status[i];
            best_n = c;
        }
    }
    return best;
}

uint32_t kv__rd_rail_choose(const int *dev_hops, const int *dev_node, const uint32_t *load,
                            uint32_t n, int mem_node, uint32_t *spread, kv_xport_mem_choice *how)
{
    if (n <= 1) {
        *how = KV_XPORT_CHOSEN_ONLY;
        return 0;
    }
    uint32_t best = UINT32_MAX;
    for (uint32_t i = 0; i < n && dev_hops; i++)
        if (dev_hops[i] >= 0 && (best == UINT32_MAX || dev_hops[i] < dev_hops[best] ||
                                 (dev_hops[i] == dev_hops[best] && load[i] < load[best])))
            best = i;
    if (best != UINT32_MAX) {
        *how = KV_XPORT_CHOSEN_PCI;
        return best;
    }
    for (uint32_t i = 0; i < n && mem_node >= 0; i++)
        if (dev_node[i] == mem_node && (best == UINT32_MAX || load[i] < load[best]))
            best = i;
    if (best != UINT32_MAX) {
        *how = KV_XPORT_CHOSEN_NUMA;
        return best;
    }
    *how = KV_XPORT_CHOSEN_SPREAD;
    return (*spread)++ % n;
}

/* Where a region's memory is: its NUMA node and, for device memory, each
 * rail's PCIe hops to its GPU (hops[i] -1: not known). The GPU's NUMA node
 * is the GPU's (sysfs); host memory's (or a GPU's not known) is what
 * kv__rd_mem_node says. No lock: CUDA and sysfs only. */
static void region_near(const struct rdma *r, enum kv_mem_kind kind, const void *base, size_t bytes,
                        int *node, int *hops)
{
    for (uint32_t i = 0; i < r->nrail; i++)
        hops[i] = -1;
    *node = -1;
    char raw[64], id[24], rel[64], gpu[512], path[560];
    if (kind == KV_MEM_DEVICE && kv__rd_gpu_busid(base, raw, sizeof(raw)) == 0 &&
        memchr(raw, '\0', sizeof(raw)) && kv__rd_pci_busid_norm(raw, id, sizeof(id))) {
        snprintf(rel, sizeof(rel), "bus/pci/devices/%s", id);
        if (kv__rd_sysfs_pci(kv__rd_sysfs_root, rel, gpu, sizeof(gpu))) {
            snprintf(path, sizeof(path), "%s/numa_node", gpu);
            *node = numa_file(path);
            for (uint32_t i = 0; i < r->nrail; i++)
                hops[i] = r->rail[i].pci[0] ? kv__rd_pci_hops(gpu, r->rail[i].pci) : -1;
        }
    }
    if (*node < 0)
        *node = kv__rd_mem_node(base, bytes);
}

void kv__rd_region_place(struct rdma *r, uint32_t device, enum kv_mem_kind kind, const void *base,
                         size_t bytes, struct rmr *rm)
{
    int hops[RD_MAX_RAILS];
    region_near(r, kind, base, bytes, &rm->numa, hops);
    pthread_mutex_lock(&r->x->mu); /* the rails' loads and the round-robin counter */
    if (device != KV_XPORT_DEVICE_AUTO) {
        rm->rail = device;
        rm->how = KV_XPORT_CHOSEN_CALLER;
    } else {
        int node[RD_MAX_RAILS];
        uint32_t load[RD_MAX_RAILS];
        for (uint32_t i = 0; i < r->nrail; i++) {
            node[i] = r->rail[i].numa;
            load[i] = r->rail[i].regions;
        }
        rm->rail = kv__rd_rail_choose(kind == KV_MEM_DEVICE ? hops : NULL, node, load, r->nrail,
                                      rm->numa, &r->spread, &rm->how);
    }
    rm->pci_hops = hops[rm->rail];
    r->rail[rm->rail].regions++;
    pthread_mutex_unlock(&r->x->mu);
}

/* The rails' device names from the config: rdma_devices[], else
 * rdma_device alone (NULL: automatic), checked. */
static kv_status rails_named(const struct kv_xport_config *cfg, uint32_t *n)
{
    if (cfg->n_rdma_devices == 0) {
        if (cfg->rdma_devices)
            return kv__error(KV_ERR_INVALID_ARG,
                             "xport_create(rdma): rdma_devices given with n_rdma_devices 0");
        *n = 1;
        return KV_OK;
    }
    if (!cfg->rdma_devices)
        return kv__error(KV_ERR_NULL,
                         "xport_create(rdma): rdma_devices is NULL with "
                         "n_rdma_devices %u",
                         cfg->n_rdma_devices);
    if (cfg->rdma_device)
        return kv__error(KV_ERR_INVALID_ARG,
                         "xport_create(rdma): rdma_device \"%s\" and %u rdma_devices (name the "
                         "devices one way)",
                         cfg->rdma_device, cfg->n_rdma_devices);
    if (cfg->n_rdma_devices > RD_MAX_RAILS)
        return kv__error(KV_ERR_INVALID_ARG, "xport_create(rdma): %u rdma_devices (at most %u)",
                         cfg->n_rdma_devices, RD_MAX_RAILS);
    if ((uint64_t)cfg->n_rdma_devices * cfg->conns_per_peer > KV__XPORT_MAX_CONNS)
        return kv__error(KV_ERR_INVALID_ARG,
                         "xport_create(rdma): %u rails of %u QPs (conns_per_peer) per peer: %u "
                         "QPs at most",
                         cfg->n_rdma_devices, cfg->conns_per_peer, KV__XPORT_MAX_CONNS);
    for (uint32_t i = 0; i < cfg->n_rdma_devices; i++) {
        if (!cfg->rdma_devices[i])
            return kv__error(KV_ERR_NULL, "xport_create(rdma): rdma_devices[%u] is NULL", i);
        for (uint32_t j = 0; j < i; j++)
            if (strcmp(cfg->rdma_devices[i], cfg->rdma_devices[j]) == 0)
                return kv__error(KV_ERR_INVALID_ARG,
                                 "xport_create(rdma): rdma_devices[%u] \"%s\" repeats "
                                 "rdma_devices[%u]",
                                 i, cfg->rdma_devices[i], j);
    }
    *n = cfg->n_rdma_devices;
    return KV_OK;
}

/* Rail i: device, port, GID, limits, PD. */
static kv_status rail_open(struct rdma *r, uint32_t i, struct ibv_device **list, int num)
{
    const struct kv_xport_config *cfg = &r->x->cfg;
    struct rrail *rl = &r->rail[i];
    const char *want = cfg->n_rdma_devices ? cfg->rdma_devices[i] : cfg->rdma_device;
    kv_status st = pick_port(r, rl, list, num, want);
    if (st != KV_OK)
        return st;
    st = pick_gid(r, rl, cfg->rdma_gid_index);
    if (st == KV_OK &&
        (rl->da.max_qp_wr < (int)RD_SQ_WR || rl->da.max_sge < 1 || rl->da.max_mr_size < 4096))
        st = kv__error(KV_ERR_UNSUPPORTED,
                       "xport_create(rdma): %s: max_qp_wr %d (need %u), max_sge %d, "
                       "max_mr_size %" PRIu64,
                       rl->dev, rl->da.max_qp_wr, RD_SQ_WR, rl->da.max_sge,
                       (uint64_t)rl->da.max_mr_size);
    if (st == KV_OK) {
        rl->sge = (uint32_t)rl->da.max_sge < RD_MAX_SGE ? (uint32_t)rl->da.max_sge : RD_MAX_SGE;
        /* READs scatter into at most max_sge_rd SGEs, often fewer than
         * max_sge (0: a device that does not say; one is always taken). */
        const uint32_t rd = rl->da.max_sge_rd < 1 ? 1u : (uint32_t)rl->da.max_sge_rd;
        rl->sge_rd = rd < rl->sge ? rd : rl->sge;
        rl->chunk = (uint64_t)rl->da.max_mr_size & ~4095ull;
        rl->numa = kv__rd_sysfs_numa(kv__rd_sysfs_root, rl->dev);
        char rel[128];
        snprintf(rel, sizeof(rel), "class/infiniband/%s/device", rl->dev);
        if (kv__rd_sysfs_pci(kv__rd_sysfs_root, rel, rl->pci, sizeof(rl->pci))) {
            const char *slash = strrchr(rl->pci, '/');
            (void)kv__rd_pci_busid_norm(slash ? slash + 1 : rl->pci, rl->pci_id,
                                        sizeof(rl->pci_id));
        }
        rl->pd = r->v->alloc_pd(rl->ctx);
        if (!rl->pd)
            st = kv__error(kv__rd_errno_status(errno), "xport_create(rdma): alloc_pd on %s: %s",
                           rl->dev, strerror(errno));
    }
    if (st != KV_OK) {
        (void)r->v->close_device(rl->ctx);
        rl->ctx = NULL;
    }
    return st;
}

/* Rails [0, n) opened by rail_open: PD and context closed. */
static void rails_close(struct rdma *r, uint32_t n)
{
    for (uint32_t i = n; i-- > 0;) {
        struct rrail *rl = &r->rail[i];
        kv__rd_teardown_check(r, r->v->dealloc_pd(rl->pd), "ibv_dealloc_pd");
        kv__rd_teardown_check(r, r->v->close_device(rl->ctx), "ibv_close_device");
        rl->pd = NULL;
        rl->ctx = NULL;
    }
}

static kv_status rdma_start(kv_xport *x)
{
    const struct kv__verbs *v = NULL;
    kv_status st = kv__verbs_acquire(&v);
    if (st != KV_OK)
        return kv__error_wrap(st, "xport_create(rdma)");
    uint32_t nrail = 0;
    st = rails_named(&x->cfg, &nrail);
    if (st != KV_OK)
        return st;
    struct rdma *r = kv__mem_calloc(1, sizeof(*r));
    if (!r)
        return kv__error(KV_ERR_NO_MEMORY, "xport_create: rdma state");
    r->x = x;
    r->v = v;
    r->wake_fd = -1;
    r->busy_poll = x->cfg.rdma_busy_poll;
    int num = 0;
    errno = 0;
    struct ibv_device **list = v->get_device_list(&num);
    if (!list && errno == ENOMEM) { /* the call failed (NULL): not "no device" */
        st = kv__error(KV_ERR_NO_MEMORY, "xport_create(rdma): %s: ibv_get_device_list: %s", v->name,
                       strerror(errno));
        goto fail_state;
    }
    if (!list || num <= 0) {
        if (list)
            v->free_device_list(list);
        st = kv__error(KV_ERR_UNSUPPORTED,
                       "xport_create(rdma): no RDMA device found (%s: ibv_get_device_list "
                       "lists none)",
                       v->name);
        goto fail_state;
    }
    for (; r->nrail < nrail; r->nrail++) {
        st = rail_open(r, r->nrail, list, num);
        if (st != KV_OK)
            break;
        say(r->dev, sizeof(r->dev), "%s%s", r->nrail ? "," : "", r->rail[r->nrail].dev);
    }
    v->free_device_list(list);
    if (st != KV_OK)
        goto fail_rails;
    if (!r->busy_poll) {
        st = events_open(r);
        if (st != KV_OK)
            goto fail_events;
    }
    /* Out of band: the checked TCP handshake and the QP exchange. */
    struct kv_xport_config oc = x->cfg;
    oc.kind = KV_XPORT_TCP;
    oc.conns_per_peer = 1;
    /* Its notifications are ours (INFO, READY, FAIL: at most RD_OOB_N per
     * peer, polled at once), not the caller's: the caller's
     * max_pending_notes (1, say) bounds the RDMA peer's notifications, and
     * on the OOB it refused a peer's READY behind its INFO. */
    oc.max_pending_notes = KV__XPORT_DEFAULT_NOTES;
    oc.rdma_devices = NULL;
    oc.n_rdma_devices = 0;
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
    const int e = pthread_create(&r->thr, NULL, progress, r);
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
fail_rails:
    rails_close(r, r->nrail);
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
    rails_close(r, r->nrail);
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

/* Register [base, base + bytes) on rail rl: one MR per chunk with access
 * acc into rm (rm->n counts those made; on an error the ones made are
 * deregistered). */
static kv_status rmr_reg(struct rdma *r, struct rmr *rm, char *base, uint64_t bytes, int acc,
                         const char *fn, const char *what)
{
    const struct rrail *rl = &r->rail[rm->rail];
    const uint64_t n = (bytes + rm->chunk - 1) / rm->chunk;
    for (uint32_t i = 0; i < n; i++) {
        const uint64_t off = (uint64_t)i * rm->chunk;
        const uint64_t len = bytes - off < rm->chunk ? bytes - off : rm->chunk;
        rm->mr[i] = r->v->reg_mr(rl->pd, base + off, (size_t)len, acc);
        if (!rm->mr[i]) {
            const int e = errno;
            const uint32_t at = i; /* the chunk refused (i counts down below) */
            while (i--) /* an error here leaks the MR: noted for destroy */
                kv__rd_teardown_check(r, r->v->dereg_mr(rm->mr[i]), "ibv_dereg_mr (unwinding)");
            rm->n = 0;
            /* EFAULT: the pages cannot be pinned for the access asked;
             * every MR here has local write access (the SGEs a READ lands
             * in), so a read-only mapping is refused as unmapped memory. */
            if (e == EFAULT)
                return kv__error(KV_ERR_INVALID_ARG,
                                 "%s(rdma): %s (%p, %" PRIu64 " bytes; chunk %u, %" PRIu64
                                 " bytes at +%" PRIu64 ") on %s: reg_mr says %s: RDMA regions "
                                 "must be mapped, readable and writable memory (registered "
                                 "with local write access; a read-only mapping is refused)",
                                 fn, what, (void *)base, bytes, at, len, off, rl->dev, strerror(e));
            return kv__error(e == ENOMEM ? KV_ERR_NO_MEMORY : KV_ERR_IO,
                             "%s(rdma): reg_mr of chunk %u (%" PRIu64 " bytes at +%" PRIu64
                             ") of %s on %s: %s",
                             fn, at, len, off, what, rl->dev, strerror(e));
        }
        rm->n = i + 1;
    }
    return KV_OK;
}

/* The region's rail: the caller's (m->device) or automatic
 * (kv__rd_region_place). */
static kv_status rdma_mem_reg(kv_xport_mem *m)
{
    struct rdma *r = m->x->be;
    kv_xport *x = m->x;
    if (m->device != KV_XPORT_DEVICE_AUTO && m->device >= r->nrail)
        return kv__error(KV_ERR_INVALID_ARG,
                         "xport_mem_reg: device %u, but the transport has %u (rails: %s)",
                         m->device, r->nrail, r->dev);
    /* A notification is delivered when its SEND lands, with no flush READ
     * behind the data (NCCL's ncclIbIflush): the NIC's PCIe
     * writes into GPU memory may still be invisible to a kernel launched on
     * it. Refused until that flush exists (docs/connector.md, "Regions"). */
    if (m->kind == KV_MEM_DEVICE)
        return kv__error(KV_ERR_UNSUPPORTED,
                         "xport_mem_reg(rdma): %s memory (%p, %" PRIu64 " bytes) not yet: a notification "
                         "is delivered without a flush READ, so a kernel could read stale bytes "
                         "(register host or pinned memory)",
                         kv_mem_kind_name(m->kind), (void *)m->base, m->bytes);
    struct rmr *rm = kv__mem_calloc(1, sizeof(*rm));
    if (!rm)
        return kv__error(KV_ERR_NO_MEMORY, "xport_mem_reg(rdma): region state");
    kv__rd_region_place(r, m->device, m->kind, m->base, (size_t)m->bytes, rm);
    struct rrail *rl = &r->rail[rm->rail]; /* its regions count taken back below on an error */
    rm->chunk = rl->chunk;
    const uint64_t n = (m->bytes + rl->chunk - 1) / rl->chunk;
    kv_status st = KV_OK;
    if (n > RD_MAX_CHUNKS)
        st = kv__error(KV_ERR_CAPACITY,
                       "xport_mem_reg(rdma): %" PRIu64 " bytes need %" PRIu64
                       " MRs of at most %" PRIu64 " bytes (max_mr_size of %s); a blob holds "
                       "%u",
                       m->bytes, n, rl->chunk, rl->dev, RD_MAX_CHUNKS);
    /* Our own WRs' SGEs only: a peer reaches the region through the MRs of
     * an exposure (rdma_expose), never these. */
    if (st == KV_OK)
        st = rmr_reg(r, rm, m->base, m->bytes, IBV_ACCESS_LOCAL_WRITE, "xport_mem_reg",
                     "the region");
    if (st != KV_OK) {
        pthread_mutex_lock(&x->mu);
        rl->regions--;
        pthread_mutex_unlock(&x->mu);
        kv__mem_free(rm);
        return st;
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
                             what, rm->n - 1, r->rail[rm->rail].dev, strerror(e < 0 ? -e : e));
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
    pthread_mutex_lock(&m->x->mu);
    r->rail[rm->rail].regions--;
    pthread_mutex_unlock(&m->x->mu);
    kv__mem_free(rm);
    m->be = NULL;
    return KV_OK;
}

/* The exposure's own MRs, remote access, on the region's rail with its
 * chunking; its key (LE): 0 4 chunks, 4 4 the rail, 8 8 chunk bytes, 16 8
 * base address, 24 4*chunks rkeys. */
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
    rm->rail = lm->rail;
    const int acc = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
    char what[32];
    snprintf(what, sizeof(what), "region %u", m->region);
    const kv_status st = rmr_reg(r, rm, m->base, m->bytes, acc, "xport_mem_expose", what);
    if (st != KV_OK) {
        kv__mem_free(rm);
        return st;
    }
    unsigned char *key = e->key;
    kv__le_put(key, rm->n, 4);
    kv__le_put(key + 4, rm->rail, 4);
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

bool kv__rd_rkey_check(const unsigned char *key, uint32_t key_len, uint64_t bytes, struct rkey *k,
                       char *msg, size_t cap)
{
    if (key_len < RD_KEY_HEAD) {
        if (msg)
            snprintf(msg, cap, "a key of %u bytes (the head alone is %u)", key_len, RD_KEY_HEAD);
        return false;
    }
    k->n = (uint32_t)kv__le_get(key, 4);
    k->rail = (uint32_t)kv__le_get(key + 4, 4);
    k->chunk = kv__le_get(key + 8, 8);
    k->base = kv__le_get(key + 16, 8);
    k->keys = key + RD_KEY_HEAD;
    /* n == ceil(bytes / chunk), computed without overflow */
    const uint64_t need = bytes && k->chunk ? (bytes - 1) / k->chunk + 1 : 0;
    if (k->n < 1 || k->n > RD_MAX_CHUNKS || key_len != RD_KEY_HEAD + 4 * k->n ||
        k->rail >= RD_MAX_RAILS || !k->chunk || !bytes || need != k->n ||
        k->base > UINT64_MAX - bytes) {
        if (msg)
            snprintf(msg, cap,
                     "a key of %u bytes: %u chunk(s) (1..%u, key bytes %u + 4 each) of %" PRIu64
                     " bytes (nonzero) for a region of %" PRIu64 " bytes (needs %" PRIu64
                     "), rail %u (< %u), base 0x%" PRIx64 " (base + bytes must not wrap)",
                     key_len, k->n, RD_MAX_CHUNKS, RD_KEY_HEAD, k->chunk, bytes, need, k->rail,
                     RD_MAX_RAILS, k->base);
        return false;
    }
    return true;
}

bool kv__rd_rkey_get(const kv_xport_rmem *rm, struct rkey *k)
{
    return kv__rd_rkey_check(rm->key, rm->key_len, rm->bytes, k, NULL, 0);
}

/* The rkey of the chunk holding remote offset off (past the last chunk:
 * the last one's, and the responder refuses). */
uint32_t kv__rd_rkey_of(const struct rkey *k, uint64_t off)
{
    uint64_t c = off / k->chunk;
    c = c >= k->n ? k->n - 1 : c;
    return (uint32_t)kv__le_get(k->keys + 4 * c, 4);
}

/* mu held, p READY: every entry moves between a local and a remote region
 * of one rail, a rail connected to p. Refused otherwise (nothing posted):
 * staging across rails is not done. */
static kv_status rdma_check(kv_xport_peer *p, const struct kv_xport_io *ios, uint32_t n, bool read)
{
    const struct rdma *r = p->x->be;
    const struct rpeer *rp = p->be;
    if (!r || !rp)
        return kv__error(KV_ERR_BAD_STATE, "peer %" PRIu64 " has no RDMA state", p->id);
    for (uint32_t i = 0; i < n; i++) {
        const struct rmr *lm = ios[i].local->be;
        struct rkey k;
        char why[320];
        if (!kv__rd_rkey_check(ios[i].remote->key, ios[i].remote->key_len, ios[i].remote->bytes, &k,
                               why, sizeof(why)))
            return kv__error(KV_ERR_CORRUPT,
                             "entry %u: the remote region's key fails its checks (region %u): %s",
                             i, ios[i].remote->region, why);
        if (lm->rail != k.rail)
            return kv__error(KV_ERR_INVALID_ARG,
                             "entry %u: local region %u is on rail %u (%s), remote region %u on "
                             "the peer's rail %u: RDMA %s only between regions of one rail "
                             "(register the local one on rail %u: kv_xport_mem_reg_on)",
                             i, ios[i].local->region, lm->rail, r->rail[lm->rail].dev,
                             ios[i].remote->region, k.rail, read ? "reads" : "writes", k.rail);
        if (lm->rail >= rp->nlink)
            return kv__error(KV_ERR_INVALID_ARG,
                             "entry %u: region %u is on rail %u (%s), but peer %" PRIu64
                             " is connected on %u rail(s) (the fewer of both sides' devices)",
                             i, ios[i].local->region, lm->rail, r->rail[lm->rail].dev, p->id,
                             rp->nlink);
    }
    return KV_OK;
}

/* mu held, p READY: a peer's key at import (kv__rd_rkey_check; a rail
 * not connected is still refused at post, rdma_check, naming the entry). */
static kv_status rdma_import_check(kv_xport_peer *p, const unsigned char *key, uint32_t key_len,
                                   uint64_t bytes, char *msg, size_t cap)
{
    (void)p;
    struct rkey k;
    return kv__rd_rkey_check(key, key_len, bytes, &k, msg, cap) ? KV_OK : KV_ERR_CORRUPT;
}

/* mu held: m's rail, how it was chosen, the NUMA nodes compared. */
static void rdma_mem_info(kv_xport_mem *m, struct kv_xport_mem_info *out)
{
    const struct rdma *r = m->x->be;
    const struct rmr *rm = m->be;
    if (!r || !rm)
        return;
    out->rdma_rail = rm->rail;
    snprintf(out->rdma_device, sizeof(out->rdma_device), "%s", r->rail[rm->rail].dev);
    out->rdma_chosen = rm->how;
    out->numa_node = rm->numa;
    out->device_numa_node = r->rail[rm->rail].numa;
    out->pci_distance = rm->pci_hops;
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

/* mu held: what rd_pick chose, per rail (rail 0 also in the top-level
 * fields), and p's path on each rail once its QPs are connected. */
static void rdma_info(kv_xport *x, kv_xport_peer *p, struct kv_xport_info *out)
{
    const struct rdma *r = x->be;
    if (!r)
        return;
    const struct rpeer *rp = p ? p->be : NULL;
    const bool conn = rp && (rp->ph == PH_RTS || rp->ph == PH_READY);
    out->rdma_rails = r->nrail;
    out->rdma_peer_rails = conn ? rp->nlink : 0;
    for (uint32_t i = 0; i < r->nrail; i++) {
        const struct rrail *rl = &r->rail[i];
        struct kv_xport_rail_info *o = &out->rdma_rail[i];
        snprintf(o->device, sizeof(o->device), "%s", rl->dev);
        o->port = rl->port;
        o->link =
            rl->link == IBV_LINK_LAYER_ETHERNET ? KV_XPORT_LINK_ETHERNET : KV_XPORT_LINK_INFINIBAND;
        o->lid = rl->link == IBV_LINK_LAYER_INFINIBAND ? rl->pa.lid : 0;
        o->gid_index = rl->gid_index;
        o->gid_type = rl->gid_index >= 0 ? gid_type_pub(rl->gid_type, rl->link) : KV_XPORT_GID_NONE;
        if (rl->gid_index >= 0)
            memcpy(o->gid, rl->gid.raw, 16);
        o->active_mtu = kv__rd_mtu_bytes(rl->pa.active_mtu);
        o->numa_node = rl->numa;
        snprintf(o->pci_bus_id, sizeof(o->pci_bus_id), "%s", rl->pci_id);
        o->regions = rl->regions;
        if (!conn || i >= rp->nlink)
            continue;
        const struct rpath *ph = &rp->path[i];
        o->qps = rp->conns;
        o->path_mtu = kv__rd_mtu_bytes(ph->path_mtu);
        o->grh = ph->grh;
        o->hop_limit = ph->grh ? INFO_HOP_LIMIT : 0;
        o->remote_lid = ph->rlid;
        memcpy(o->remote_gid, ph->rgid, 16);
    }
    const struct kv_xport_rail_info *r0 = &out->rdma_rail[0];
    snprintf(out->rdma_device, sizeof(out->rdma_device), "%s", r0->device);
    out->rdma_port = r0->port;
    out->rdma_link = r0->link;
    out->rdma_lid = r0->lid;
    out->rdma_gid_index = r0->gid_index;
    out->rdma_gid_type = r0->gid_type;
    memcpy(out->rdma_gid, r0->gid, 16);
    out->rdma_active_mtu = r0->active_mtu;
    if (!conn)
        return;
    out->rdma_qps = rp->nlink * rp->conns;
    out->rdma_path_mtu = r0->path_mtu;
    out->rdma_grh = r0->grh;
    out->rdma_hop_limit = r0->hop_limit;
    out->rdma_remote_lid = r0->remote_lid;
    memcpy(out->rdma_remote_gid, r0->remote_gid, 16);
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
    .check = rdma_check,
    .mem_info = rdma_mem_info,
    .import_check = rdma_import_check,
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
    for (struct rpeer *rp = r->peers; rp && !r->busy_poll; rp = rp->next)
        for (uint32_t i = 0; i < rp->nrail && !r->busy_poll; i++) {
            if (!rp->cq[i] || rp->armed[i])
                continue;
            struct ibv_cq *cq = rp->cq[i];
            pthread_mutex_unlock(&x->mu);
            const int e = r->v->req_notify_cq(cq, 0);
            pthread_mutex_lock(&x->mu);
            rp->armed[i] = e == 0;
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
 * eventfd and every rail's channel until one is readable or the deadline;
 * then each event got, acknowledged, and its CQ marked for re-arming. */
static void wait_events(struct rdma *r, uint64_t deadline)
{
    kv_xport *x = r->x;
    int ms = -1;
    if (deadline != UINT64_MAX) {
        const uint64_t now = kv__now_ns();
        const uint64_t left = deadline > now ? (deadline - now + 999999u) / 1000000u : 0;
        ms = left > INT_MAX ? INT_MAX : (int)left;
    }
    struct pollfd pf[1 + RD_MAX_RAILS] = {{.fd = r->wake_fd, .events = POLLIN}};
    for (uint32_t i = 0; i < r->nrail; i++)
        pf[1 + i] = (struct pollfd){.fd = r->rail[i].ch->fd, .events = POLLIN};
    pthread_mutex_unlock(&x->mu);
    const int n = poll(pf, 1 + r->nrail, ms);
    if (n > 0 && pf[0].revents) {
        uint64_t v;
        const ssize_t got = read(r->wake_fd, &v, sizeof(v));
        (void)got; /* EAGAIN: nothing to clear */
    }
    int err = 0;
    for (uint32_t i = 0; i < r->nrail && n > 0; i++)
        while (pf[1 + i].revents) {
            struct ibv_cq *cq = NULL;
            void *ctx = NULL;
            const int e = r->v->get_cq_event(r->rail[i].ch, &cq, &ctx);
            if (e == EAGAIN || e == EWOULDBLOCK)
                break;
            if (e != 0) {
                err = e;
                break;
            }
            r->v->ack_cq_events(cq, 1);
            struct rpeer *rp = ctx; /* only this thread touches armed[] */
            rp->armed[i] = false;
        }
    pthread_mutex_lock(&x->mu);
    if (err != 0) {
        kv__rd_teardown_check(r, err, "ibv_get_cq_event (now busy polling)");
        r->busy_poll = true;
    }
}

/* mu held: an OOB notification of rp (INFO, READY, FAIL) not yet terminal. */
static bool oob_pending(const struct rpeer *rp)
{
    for (uint32_t i = 0; i < RD_OOB_N; i++) {
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
            if (rp->cq[0])
                any |= kv__rd_poll_round(r, rp);
            if (rp->ph == PH_FAIL) {
                kv__rd_send_fail(r, rp); /* why, to the peer, before the OOB close */
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
