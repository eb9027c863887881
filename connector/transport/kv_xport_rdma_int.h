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
 *                             chains, notifications, completions retired.
 */
#ifndef KV_XPORT_RDMA_INT_H
#define KV_XPORT_RDMA_INT_H

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
#define RD_NOTE_SLOTS 8u             /* notifications in flight per peer */
#define RD_NOTE_HDR 16u
#define RD_MSG_BYTES (RD_NOTE_HDR + KV_XPORT_NOTIFY_MAX)
#define RD_NOTE_MAGIC 0x4b56524eu /* "KVRN" */
#define RD_KEY_HEAD 24u
#define RD_MAX_CHUNKS ((KV__XPORT_KEY_MAX - RD_KEY_HEAD) / 4u)
#define RD_OOB_INFO 0x4b56524449000001ull  /* OOB tags: QP info */
#define RD_OOB_READY 0x4b56524449000002ull /* every QP of the sender is RTS */
#define RD_DRAIN_NS (2000ull * 1000000ull) /* a marker that never completes */
#define RD_RECV_BIT (1ull << 63)

_Static_assert(RD_MAX_CHUNKS >= 1, "a key holds at least one rkey");

enum rec_kind { REC_WRITE = 1, REC_READ, REC_NOTE, REC_MARK };

/* One posted send WR (ring slot seq % RD_SQ_WR of its QP). */
struct rec {
    uint8_t kind;
    uint8_t n;    /* pieces */
    uint8_t slot; /* REC_NOTE: the note buffer */
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

/* Region state: one MR per chunk. */
struct rmr {
    uint32_t n;
    uint64_t chunk;
    struct ibv_mr *mr[RD_MAX_CHUNKS];
};

enum rphase { PH_OOB, PH_INFO, PH_RTS, PH_READY, PH_FAIL };

struct rpeer {
    kv_xport_peer *p;
    struct rpeer *next;
    kv_xport_peer *oob;
    uint64_t oob_id; /* its id: how the OOB transport's messages name it */
    enum rphase ph;
    bool info_sent, ready_sent, ready_got, close_req;
    kv_xport_xfer *oob_x[2]; /* the INFO / READY notifications (freed when terminal) */
    uint32_t nq;
    struct rqp q[KV__XPORT_MAX_CONNS];
    struct rec *ring;    /* [nq][RD_SQ_WR] */
    struct ibv_cq *cq;   /* cq_context: this rpeer */
    bool armed;          /* event mode: req_notify_cq since its last event (progress thread) */
    unsigned char *bufs; /* [nq * RD_RECVS + RD_NOTE_SLOTS][RD_MSG_BYTES] */
    struct ibv_mr *bufs_mr;
    bool note_busy[RD_NOTE_SLOTS];
    uint32_t next_q;
    uint64_t deadline_ns; /* handshake; PH_FAIL: drain */
    kv_status why;
    char msg[256];
    /* The path, set when the peer's INFO was applied (PH_RTS on): */
    enum ibv_mtu path_mtu; /* min(ours, theirs) */
    bool grh;
    uint16_t rlid;
    uint8_t rgid[16];
};

struct rdma {
    kv_xport *x;
    const struct kv__verbs *v;
    struct ibv_context *ctx;
    struct ibv_pd *pd;
    struct ibv_device_attr da;
    /* Chosen at start (rd_pick: the config or the automatic defaults):
     * the port, its attributes, the GID (gid_index -1: none; on InfiniBand
     * it is used only for a GRH). */
    uint8_t port;
    struct ibv_port_attr pa;
    uint8_t link; /* IBV_LINK_LAYER_INFINIBAND or _ETHERNET (UNSPECIFIED read as IB) */
    int gid_index;
    enum ibv_gid_type gid_type;
    union ibv_gid gid;
    uint64_t chunk; /* MR chunk bytes */
    uint32_t sge;
    kv_xport *oob;
    /* Event mode (!busy_poll): the CQs' channel (its fd O_NONBLOCK) and an
     * eventfd kicked whenever the progress thread has work that is not a
     * completion (kv__rd_kick, the OOB transport's on_signal); -1 / NULL in
     * busy-poll mode. */
    bool busy_poll;
    struct ibv_comp_channel *ch;
    int wake_fd;
    pthread_t thr;
    bool stop;
    struct rpeer *peers;
    char dev[64];
    kv_status teardown; /* the first verbs teardown call that failed (kv_xport_destroy) */
    char teardown_msg[200];
};

/* A remote region's key, decoded: false when malformed. */
struct rkey {
    uint32_t n;
    uint64_t chunk, base;
    const unsigned char *keys;
};

struct chain {
    struct ibv_send_wr wr[RD_SQ_WR];
    struct ibv_sge sge[RD_SQ_WR][RD_MAX_SGE];
    uint32_t n;
    uint64_t first; /* seq of wr[0] */
};

/* INFO (LE), version 2: 0 2 kind (rdma), 2 2 INFO version, 4 4 QPs, 8 8
 * connection id, 16 16 GID (network order), 32 2 LID, 34 1 link layer
 * (IBV_LINK_LAYER_*), 35 1 active MTU (enum ibv_mtu), 36 1 flags (bit 0:
 * the GID is valid), 37 3 zero, then per QP 4 qpn, 4 psn. Version 1 (no
 * LID, MTU, link layer) read as kind 2, version 0: refused by name. */
#define INFO_HEAD 40u
#define INFO_VERSION 2u
#define INFO_HOP_LIMIT 255u /* with a GRH (routable RoCE v2 / across IB subnets) */

/* A peer's INFO, decoded and checked (kv__rd_info_decode). */
struct rd_info {
    uint32_t nq;
    uint64_t conn;
    uint8_t gid[16];
    bool has_gid;
    uint16_t lid;
    uint8_t link;
    uint8_t mtu; /* enum ibv_mtu */
    uint32_t qpn[KV__XPORT_MAX_CONNS], psn[KV__XPORT_MAX_CONNS];
};

/* kv_xport_rdma_verbs.c */
void kv__rd_teardown_check(struct rdma *r, int rc, const char *what);
kv_status kv__rd_wc_status(enum ibv_wc_status s);
const char *kv__rd_wc_str(enum ibv_wc_status s);
void kv__rd_kick(kv_xport *x);
bool kv__rd_rkey_get(const kv_xport_rmem *rm, struct rkey *k);
uint32_t kv__rd_rkey_of(const struct rkey *k, uint64_t off);

/* kv_xport_rdma_info_verbs.c */
/* INFO: encode ours into b (INFO_HEAD + 8 * in->nq bytes; returns that);
 * decode a peer's of len bytes, expecting nq QPs on link layer `link`:
 * KV_OK, or KV_ERR_MISMATCH (kind, version, QP count, link layer) /
 * KV_ERR_CORRUPT (length, MTU code, LID, GID, flags, a qpn or psn over 24
 * bits) with msg naming the values. Pure: no verbs, no state. */
uint32_t kv__rd_info_encode(const struct rd_info *in, unsigned char *b);
kv_status kv__rd_info_decode(const unsigned char *b, uint32_t len, uint32_t nq, uint8_t link,
                             struct rd_info *out, char *msg, size_t cap);
uint32_t kv__rd_mtu_bytes(enum ibv_mtu m);

/* kv_xport_rdma_qp_verbs.c */
unsigned char *kv__rd_buf_at(struct rpeer *rp, uint32_t i);
kv_status kv__rd_peer_verbs(struct rdma *r, struct rpeer *rp);
void kv__rd_peer_verbs_free(struct rdma *r, struct rpeer *rp);
struct rpeer *kv__rd_rpeer_new(struct rdma *r, kv_xport_peer *p, kv_xport_peer *oob);
void kv__rd_peer_fail(struct rdma *r, struct rpeer *rp, kv_status why, const char *fmt, ...)
    KV_PRINTF(4, 5);
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
