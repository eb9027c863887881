/*
 * kv_xport_rdma_int.h - the RDMA backend's state, shared by its three files
 * (module-private; included only by *_verbs.c files, which are built only
 * where rdma-core is):
 *
 *   kv_xport_rdma_verbs.c     the model (its top comment), the ops table:
 *                             device, start/stop, connect, regions and
 *                             exposures (MRs, rkeys), the progress loop and
 *                             its deadlines;
 *   kv_xport_rdma_qp_verbs.c  a peer's verbs resources (CQ, QPs, message
 *                             buffers), the handshake after the OOB one (INFO,
 *                             READY), failing and draining a peer;
 *   kv_xport_rdma_wr_verbs.c  the data path: WRs cut from transfers, posted in
 *                             chains, notifications, completions retired;
 *   kv_xport_rdma_pci_verbs.c how far a GPU is from each rail's device on the
 *                             PCIe tree (sysfs), for a region's rail.
 */
#ifndef KV_XPORT_RDMA_INT_H
#define KV_XPORT_RDMA_INT_H

#include <errno.h>
#include <stdbool.h>
#include <stdint.h>

#include "kv_verbs_int.h"
#include "kv_xport_frame_int.h"
#include "kv_xport_int.h"

#define RD_SIG_EVERY 16u             /* a signaled WR at least every this many */
#define RD_WR_MAX_BYTES (256u << 10) /* bytes per WR (spreads a transfer over QPs) */
#define RD_MAX_SGE 16u               /* SGEs per WR at most (and max_sge of the device) */
#define RD_SQ_WR 256u                /* send queue depth per QP (and max_qp_wr) */
#define RD_RECVS 16u                 /* receive buffers per QP */
#define RD_NOTE_SLOTS 8u             /* notifications sent, not yet acknowledged, per peer */
#define RD_ACK_SLOTS 2u              /* acknowledgement messages in flight per peer */
#define RD_NOTE_HDR 24u
#define RD_ACK_REC 12u
#define RD_MSG_BYTES (RD_NOTE_HDR + KV_XPORT_NOTIFY_MAX)
#define RD_NOTE_MAGIC 0x4b56524eu /* "KVRN" */
#define RD_ACK_MAGIC 0x4b565241u  /* "KVRA" */
#define RD_KEY_HEAD 24u
#define RD_MAX_CHUNKS ((KV__XPORT_KEY_MAX - RD_KEY_HEAD) / 4u)
#define RD_OOB_INFO 0x4b56524449000001ull  /* OOB tags: QP info */
#define RD_OOB_READY 0x4b56524449000002ull /* every QP of the sender is RTS */
#define RD_OOB_FAIL 0x4b56524449000003ull  /* the sender failed the connection: why */
#define RD_OOB_N 3u                        /* OOB messages of a peer: INFO, READY, FAIL */
#define RD_FAIL_TEXT 200u                  /* FAIL: the message's bytes at most */
#define RD_DRAIN_NS (2000ull * 1000000ull) /* a marker that never completes */
#define RD_RECV_BIT (1ull << 63)
#define RD_MAX_RAILS KV_XPORT_MAX_RAILS

_Static_assert(RD_MAX_CHUNKS >= 1, "a key holds at least one rkey");
/* QP 0's receive ring holds, unpolled, at most the peer's RD_NOTE_SLOTS
 * notifications and one ACK message per notification of ours not yet
 * acknowledged (each carries a record for a slot still busy here). */
_Static_assert(RD_RECVS >= 2 * RD_NOTE_SLOTS, "QP 0's receives hold what a peer may send");

enum rec_kind { REC_WRITE = 1, REC_READ, REC_NOTE, REC_ACK, REC_MARK };

/* One posted send WR (ring slot seq % RD_SQ_WR of its QP). */
struct rec {
    uint8_t kind;
    uint8_t n;    /* pieces */
    uint8_t slot; /* REC_NOTE: the note slot; REC_ACK: the acknowledgement buffer */
    uint64_t xfer;
    uint32_t entry[RD_MAX_SGE];
    uint32_t bytes[RD_MAX_SGE];
};

struct rqp {
    struct ibv_qp *qp;
    uint32_t psn;
    uint64_t head, tail; /* records posted / retired: head - tail <= RD_SQ_WR */
    bool marked;         /* a drain marker posted */
    bool drained;        /* its completion arrived (or nothing was ever posted) */
};

/* Region (or exposure) state: one MR per chunk, all on one rail. */
struct rmr {
    uint32_t n;
    uint32_t rail; /* the device its MRs are on */
    uint64_t chunk;
    kv_xport_mem_choice how; /* region: how the rail was chosen */
    int numa;                /* region: the memory's NUMA node (-1: unknown) */
    int pci_hops;            /* region: device memory's PCIe hops to the rail (-1: unknown) */
    struct ibv_mr *mr[RD_MAX_CHUNKS];
};

/* A peer's path on one rail, set when the peer's INFO was applied. */
struct rpath {
    enum ibv_mtu path_mtu; /* min(ours, theirs) */
    bool grh;
    uint16_t rlid;
    uint8_t rgid[16];
};

enum rphase { PH_OOB, PH_INFO, PH_RTS, PH_READY, PH_FAIL };

struct rpeer {
    kv_xport_peer *p;
    struct rpeer *next;
    kv_xport_peer *oob;
    uint64_t oob_id; /* its id: how the OOB transport's messages name it */
    enum rphase ph;
    bool info_sent, ready_sent, ready_got, close_req;
    kv_xport_xfer *oob_x[RD_OOB_N]; /* INFO / READY / FAIL notifications (freed when terminal) */
    bool fail_sent;                 /* our FAIL (why) went out, or will not */
    bool oob_ready;                 /* the OOB peer is READY (a FAIL can go on it) */
    bool fail_from_peer;            /* failed by the peer's FAIL: not echoed */
    /* QPs: conns per rail, rail-major (QP qi is on rail qi / conns); nlink
     * rails connected once the peer's INFO was applied (min of both
     * sides' rails; the QPs of the rails past it stay in INIT, unused):
     *   nq == nrail * conns <= KV__XPORT_MAX_CONNS, nlink <= nrail */
    uint32_t nq, conns, nrail, nlink;
    struct rqp q[KV__XPORT_MAX_CONNS];
    struct rec *ring;                /* [nq][RD_SQ_WR] */
    struct ibv_cq *cq[RD_MAX_RAILS]; /* one per rail (its device's); cq_context: this rpeer */
    bool armed[RD_MAX_RAILS];        /* event mode: req_notify_cq since its last event */
    unsigned char *bufs;             /* [nrecv + RD_NOTE_SLOTS + RD_ACK_SLOTS][RD_MSG_BYTES] */
    uint32_t nrecv;                  /* receive buffers: rail 0's QPs (notifications) */
    struct ibv_mr *bufs_mr;          /* on rail 0 */
    /* Our notifications: a slot is busy from its SEND until both its
     * completion (note_cqe) and the peer's acknowledgement (note_acked)
     * came: at most RD_NOTE_SLOTS unacknowledged (the peer's bound). */
    bool note_busy[RD_NOTE_SLOTS], note_cqe[RD_NOTE_SLOTS], note_acked[RD_NOTE_SLOTS];
    uint64_t note_xfer[RD_NOTE_SLOTS];
    /* The peer's notifications we owe an acknowledgement (n_ack <=
     * RD_NOTE_SLOTS: more is a peer over its bound), sent in one message
     * from a free acknowledgement buffer. */
    uint64_t ack_xfer[RD_NOTE_SLOTS];
    kv_status ack_st[RD_NOTE_SLOTS];
    uint32_t n_ack;
    bool ack_busy[RD_ACK_SLOTS];
    uint32_t next_q;
    uint64_t deadline_ns; /* handshake; PH_FAIL: drain */
    kv_status why;
    char msg[256];
    struct rpath path[RD_MAX_RAILS]; /* [nlink] (PH_RTS on) */
};

/* One device of the transport. Chosen at start (pick_port, pick_gid: the
 * config or the automatic defaults): the port, its attributes, the GID
 * (gid_index -1: none; on InfiniBand it is used only for a GRH). */
struct rrail {
    struct ibv_context *ctx;
    struct ibv_pd *pd;
    struct ibv_device_attr da;
    uint8_t port;
    struct ibv_port_attr pa;
    uint8_t link; /* IBV_LINK_LAYER_INFINIBAND or _ETHERNET (UNSPECIFIED read as IB) */
    int gid_index;
    enum ibv_gid_type gid_type;
    union ibv_gid gid;
    uint64_t chunk; /* MR chunk bytes */
    uint32_t sge;   /* SGEs per WRITE / SEND: min(max_sge, RD_MAX_SGE) */
    uint32_t sge_rd;             /* SGEs per READ: min(max_sge_rd (0 read as 1), sge) */
    struct ibv_comp_channel *ch; /* event mode: its CQs' channel (fd O_NONBLOCK) */
    int numa;                    /* sysfs numa_node of the device (-1: unknown) */
    uint32_t regions;            /* regions registered on it now */
    char dev[64];
    char pci[512];   /* realpath of <sysfs>/class/infiniband/<dev>/device ("": unknown) */
    char pci_id[24]; /* its PCI address, normalised ("": unknown or not a PCI device) */
};

struct rdma {
    kv_xport *x;
    const struct kv__verbs *v;
    uint32_t nrail;
    struct rrail rail[RD_MAX_RAILS];
    uint32_t spread; /* automatic choices made by round robin so far */
    kv_xport *oob;
    /* Event mode (!busy_poll): each rail's channel and an eventfd kicked
     * whenever the progress thread has work that is not a completion
     * (kv__rd_kick, the OOB transport's on_signal); -1 / NULL in busy-poll
     * mode. */
    bool busy_poll;
    int wake_fd;
    pthread_t thr;
    bool stop;
    struct rpeer *peers;
    char dev[200];      /* the rails' device names, for messages */
    kv_status teardown; /* the first verbs teardown call that failed (kv_xport_destroy) */
    char teardown_msg[200];
};

/* A remote region's key, decoded: false when malformed. */
struct rkey {
    uint32_t n;
    uint32_t rail; /* the peer's rail its MRs are on */
    uint64_t chunk, base;
    const unsigned char *keys;
};

struct chain {
    struct ibv_send_wr wr[RD_SQ_WR];
    struct ibv_sge sge[RD_SQ_WR][RD_MAX_SGE];
    uint32_t n;
    uint64_t first; /* seq of wr[0] */
};

/* Messages on QP 0: a SEND into a receive buffer the receiver pre-posted
 * (LE): 0 4 magic, 4 4 payload length L, 8 8 tag, 16 8 transfer id, 24 L
 * payload (L <= KV_XPORT_NOTIFY_MAX).
 *   NOTE "KVRN": tag and payload are the notification's; the transfer id
 *        is the sender's, named back in its acknowledgement.
 *   ACK  "KVRA": tag 0, transfer id 0, L = 12 n (1 <= n <= RD_NOTE_SLOTS):
 *        n records of 8 transfer id (a NOTE the receiver took), 4 status
 *        (int32): KV_OK (queued), KV_ERR_CAPACITY (its queue was full:
 *        max_pending_notes) or KV_ERR_NO_MEMORY (it could not queue it).
 * A transfer with a notification ends DONE only on a KV_OK record, so
 * DONE means the notification is queued at the receiver, as over TCP and
 * shm; a sender has at most RD_NOTE_SLOTS notifications unacknowledged. */
enum rd_msg_kind { RD_MSG_NOTE = 1, RD_MSG_ACK };
struct rd_msg {
    enum rd_msg_kind kind;
    uint64_t tag, xfer;        /* NOTE */
    uint32_t len;              /* NOTE: the message's bytes */
    const unsigned char *data; /* NOTE: the message (inside the decoded bytes) */
    uint32_t n;                /* ACK: records */
    uint64_t ack_xfer[RD_NOTE_SLOTS];
    kv_status ack_st[RD_NOTE_SLOTS];
};

/* FAIL (an OOB notification, tag RD_OOB_FAIL; LE): 0 4 status (int32: a
 * kv_status other than KV_OK), 4 .. the failing side's message (0 to
 * RD_FAIL_TEXT bytes, not NUL-terminated). Sent by the side that fails a
 * connection for a reason of its own (not a caller's close, not the
 * peer's FAIL) before its OOB peer closes, so the other side's peer ends
 * with that status and message, not as a clean close. */

/* INFO (LE), version 3 (version 2 had unacknowledged notifications): 0 2 kind (rdma), 2 2 INFO
 * version, 4 4 QPs per rail, 8 8 connection id, 16 24 rail 0, then 24 bytes per further rail, then
 * per rail (rail-major) per QP 4 qpn, 4 psn. A rail's 24 bytes: 0 16 GID (network order), 16 2 LID,
 * 18 1 link layer (IBV_LINK_LAYER_*), 19 1 active MTU (enum ibv_mtu), 20 1 flags (bit 0: the GID is
 * valid), 21 1 rail 0: the rail count - 1 (other rails: zero), 22 2 zero. With one rail it is the
 * single-device INFO byte for byte (byte 37 was reserved, 0). Version 1 (no LID, MTU, link layer)
 * read as kind 2, version 0: refused by name. */
#define INFO_HEAD 40u
#define INFO_RAIL 24u
#define INFO_VERSION 3u
#define INFO_HOP_LIMIT 255u /* with a GRH (routable RoCE v2 / across IB subnets) */
#define INFO_MAX (INFO_HEAD + INFO_RAIL * (RD_MAX_RAILS - 1) + 8 * KV__XPORT_MAX_CONNS)

/* A peer's INFO, decoded and checked (kv__rd_info_decode). */
struct rd_rail_info {
    uint8_t gid[16];
    bool has_gid;
    uint16_t lid;
    uint8_t link;
    uint8_t mtu; /* enum ibv_mtu */
};
struct rd_info {
    uint32_t nq;    /* per rail */
    uint32_t nrail; /* nq * nrail <= KV__XPORT_MAX_CONNS */
    uint64_t conn;
    struct rd_rail_info rail[RD_MAX_RAILS];
    uint32_t qpn[KV__XPORT_MAX_CONNS], psn[KV__XPORT_MAX_CONNS]; /* rail-major */
};

/* kv_xport_rdma_verbs.c */
void kv__rd_teardown_check(struct rdma *r, int rc, const char *what);
kv_status kv__rd_wc_status(enum ibv_wc_status s);
/* The status of a verbs call that failed with errno e: KV_ERR_NO_MEMORY
 * for ENOMEM (the call could not allocate: not a device fault), else
 * KV_ERR_IO. */
static inline kv_status kv__rd_errno_status(int e)
{
    return e == ENOMEM ? KV_ERR_NO_MEMORY : KV_ERR_IO;
}
const char *kv__rd_wc_str(enum ibv_wc_status s);
void kv__rd_kick(kv_xport *x);
/* A remote region's key (key[key_len], the region's bytes as its blob
 * says) decoded into *k and checked: 1 .. RD_MAX_CHUNKS chunks, key_len ==
 * RD_KEY_HEAD + 4 * chunks, chunk bytes nonzero, chunks == ceil(bytes /
 * chunk), rail < RD_MAX_RAILS, base + bytes not past 2^64. false, with msg
 * (when not NULL) naming the values, otherwise. kv__rd_rkey_get: the same
 * for an imported region, no message. */
bool kv__rd_rkey_check(const unsigned char *key, uint32_t key_len, uint64_t bytes, struct rkey *k,
                       char *msg, size_t cap);
bool kv__rd_rkey_get(const kv_xport_rmem *rm, struct rkey *k);
/* The automatic rail of a region (pure), the first rule that names one:
 *   one rail: 0, ONLY;
 *   device memory (dev_hops non-NULL): among the rails with a PCIe
 *     distance to its GPU (dev_hops[i] >= 0), the fewest hops, then the
 *     fewest regions (load[i]), then the lowest index: PCI;
 *   among the rails whose device is on the memory's NUMA node (mem_node
 *     >= 0, dev_node[i] == mem_node), the fewest regions, then the lowest
 *     index: NUMA;
 *   *spread % n, then *spread++: SPREAD. */
uint32_t kv__rd_rail_choose(const int *dev_hops, const int *dev_node, const uint32_t *load,
                            uint32_t n, int mem_node, uint32_t *spread, kv_xport_mem_choice *how);
/* Place a region [base, base + bytes) of memory kind `kind` (rm->rail,
 * how, numa, pci_hops) on rail `device`, or KV_XPORT_DEVICE_AUTO:
 * kv__rd_rail_choose over the devices' NUMA nodes and, for device memory,
 * their PCIe hops to its GPU (a GPU's NUMA node is the GPU's); counts it
 * in that rail's regions (taken back by the caller on a later error).
 * Takes x->mu; reads sysfs and asks CUDA without it. Never fails:
 * anything not known falls to the next rule. device < nrail. */
void kv__rd_region_place(struct rdma *r, uint32_t device, enum kv_mem_kind kind, const void *base,
                         size_t bytes, struct rmr *rm);
/* Test seams: the sysfs root the devices' numa_node is read under
 * ("<root>/class/infiniband/<dev>/device/numa_node"; default "/sys"), and
 * the lookup of a range's NUMA node (default kv__rd_mem_node_sys:
 * move_pages(2) of up to 8 sampled pages, the most common node; -1 when
 * none is known). Set before kv_xport_create / kv_xport_mem_reg. */
extern const char *kv__rd_sysfs_root;
extern int (*kv__rd_mem_node)(const void *base, size_t bytes);
int kv__rd_mem_node_sys(const void *base, size_t bytes);
int kv__rd_sysfs_numa(const char *root, const char *dev);

/* kv_xport_rdma_pci_verbs.c */
/* Test seam: the PCI bus id of the GPU owning device pointer ptr into
 * busid[cap] (0; -1 not known), in any form CUDA writes
 * ("00000000:03:00.0", either letter case). Default
 * kv__xport_cuda_busid (kv_xport_cuda_int.h; always -1 without CUDA). */
extern int (*kv__rd_gpu_busid)(const void *ptr, char *busid, size_t cap);
/* A PCI address "D:B:S.F" (1-8, 1-2, 1-2, 1 hex digits, either case; S <=
 * 0x1f, F <= 7) as sysfs names it, "%04x:%02x:%02x.%x" lower case, into
 * out[cap]: true; false (out "") for anything else. */
bool kv__rd_pci_busid_norm(const char *in, char *out, size_t cap);
/* realpath("<root>/<rel>") into out[cap]: true; false (out "") when it
 * does not resolve or does not fit. */
bool kv__rd_sysfs_pci(const char *root, const char *rel, char *out, size_t cap);
/* PCIe hops between two device directories (pure, on the strings): from
 * each up to their deepest common directory, which must lie below one
 * root complex ("pciDDDD:BB", the first such component of a, with a
 * device below it on both); -1 otherwise (another root complex, another
 * tree, no root, deeper than 64). */
int kv__rd_pci_hops(const char *a, const char *b);
uint32_t kv__rd_rkey_of(const struct rkey *k, uint64_t off);

/* kv_xport_rdma_info_verbs.c */
/* INFO: encode ours into b (kv__rd_info_len bytes; returns that); decode
 * a peer's of len bytes, expecting nq QPs per rail, our rails' link layers
 * links[nlinks] (the peer's rail i, i < nlinks, must have links[i]; the
 * peer may have more or fewer rails): KV_OK, or KV_ERR_MISMATCH (kind,
 * version, QP count, a link layer) / KV_ERR_CORRUPT (length, rail count,
 * MTU code, LID, GID, flags, a qpn or psn over 24 bits) with msg naming
 * the values. Pure: no verbs, no state. */
uint32_t kv__rd_info_len(uint32_t nq, uint32_t nrail);
uint32_t kv__rd_info_encode(const struct rd_info *in, unsigned char *b);
kv_status kv__rd_info_decode(const unsigned char *b, uint32_t len, uint32_t nq,
                             const uint8_t *links, uint32_t nlinks, struct rd_info *out, char *msg,
                             size_t cap);
uint32_t kv__rd_mtu_bytes(enum ibv_mtu m);
/* A message on QP 0 of byte_len bytes at m (the table above), decoded and
 * checked into *out: KV_OK, or KV_ERR_CORRUPT with msg naming the values
 * (*out untouched). Pure, as the INFO codec. kv__rd_note_encode writes a
 * NOTE (len <= KV_XPORT_NOTIFY_MAX bytes of data) into b, kv__rd_ack_encode
 * an ACK of n records (1..RD_NOTE_SLOTS); each returns its bytes. */
kv_status kv__rd_msg_decode(const unsigned char *m, uint32_t byte_len, struct rd_msg *out,
                            char *msg, size_t cap);
uint32_t kv__rd_note_encode(unsigned char *b, uint64_t tag, uint64_t xfer, const void *data,
                            uint32_t len);
uint32_t kv__rd_ack_encode(unsigned char *b, const uint64_t *xfer, const kv_status *st, uint32_t n);
/* A peer's FAIL of len bytes at b: KV_OK with *st (a known kv_status,
 * not KV_OK) and its text in text[cap] (NUL-terminated, bytes outside
 * 32..126 shown as '?', cut at cap - 1); KV_ERR_CORRUPT with msg naming
 * the values (*st, text untouched) otherwise. kv__rd_fail_encode writes
 * ours (st, the first RD_FAIL_TEXT bytes of text) and returns its bytes
 * (b: 4 + RD_FAIL_TEXT). */
kv_status kv__rd_fail_decode(const unsigned char *b, uint32_t len, kv_status *st, char *text,
                             size_t cap, char *msg, size_t mcap);
uint32_t kv__rd_fail_encode(unsigned char *b, kv_status st, const char *text);

/* kv_xport_rdma_qp_verbs.c */
unsigned char *kv__rd_buf_at(struct rpeer *rp, uint32_t i);
kv_status kv__rd_peer_verbs(struct rdma *r, struct rpeer *rp);
void kv__rd_peer_verbs_free(struct rdma *r, struct rpeer *rp);
struct rpeer *kv__rd_rpeer_new(struct rdma *r, kv_xport_peer *p, kv_xport_peer *oob);
void kv__rd_peer_fail(struct rdma *r, struct rpeer *rp, kv_status why, const char *fmt, ...)
    KV_PRINTF(4, 5);
void kv__rd_send_fail(struct rdma *r, struct rpeer *rp);
void kv__rd_finish_fail(struct rdma *r, struct rpeer *rp);
bool kv__rd_oob_round(struct rdma *r);

/* kv_xport_rdma_wr_verbs.c */
void kv__rd_retire(struct rdma *r, struct rpeer *rp, uint32_t qi, uint64_t seq,
                   enum ibv_wc_status wst);
void kv__rd_notes_flush(struct rdma *r, struct rpeer *rp, struct chain *c);
void kv__rd_settle_all(struct rpeer *rp);
bool kv__rd_send_round(struct rdma *r, struct rpeer *rp, struct chain *c);
bool kv__rd_poll_round(struct rdma *r, struct rpeer *rp);

#endif /* KV_XPORT_RDMA_INT_H */
