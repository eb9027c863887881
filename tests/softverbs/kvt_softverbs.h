/*
 * kvt_softverbs.h - a software RC verbs device for tests (not in the
 * library): a struct kv__verbs table whose device "kvt_sv0" moves data
 * between processes on one host with verbs semantics, so the RDMA transport
 * runs end to end without RDMA hardware.
 *
 * Model. Each open_device() context owns one device thread and one AF_UNIX
 * listening socket per active port in the abstract namespace, named from
 * the port's address (below). Moving a QP to RTR connects it to the port
 * its route names (the dlid on InfiniBand, ah_attr.grh.dgid on Ethernet);
 * every WR is then a request packet executed by the
 * peer's device thread, which checks the MR (rkey, bounds, access flags,
 * PD) and reads or writes the registered memory itself (one-sided: the
 * target's application threads take no part), then ACKs or NAKs. Loopback
 * (both QPs in one process, one context or two) takes the same path.
 *
 * What is faithful (see kvt_softverbs.c for the rules, man-page wording):
 * QP states RESET/INIT/RTR/RTS/ERR with the RC attr masks of ibv_modify_qp
 * and the kernel's transition table (ib_modify_qp_is_ok: RESET -> ERR is
 * EINVAL; -> RESET and -> ERR take no attribute but the state, not even
 * IBV_QP_CUR_STATE, optional only in RTR -> RTS and RTS -> RTS);
 * RDMA_WRITE, RDMA_WRITE_WITH_IMM, RDMA_READ, SEND, up to max_sge SGEs
 * (an RDMA_READ up to max_sge_rd, smaller: post_send says EINVAL past it),
 * SIGNALED, INLINE (SEND and WRITE only: an inline READ is EINVAL at
 * post); in-order execution and completion per QP; lkey/rkey,
 * bounds, access and PD checks (LOC_PROT_ERR, REM_ACCESS_ERR); an
 * operation the responder QP does not take (a WRITE without REMOTE_WRITE
 * or a READ without REMOTE_READ in its qp_access_flags, zero-length too;
 * a READ with max_dest_rd_atomic 0) NAKed Invalid Request
 * (REM_INV_REQ_ERR, as rxe); these responder (class C) errors, a
 * REM_ACCESS_ERR included, put the responder's QP in ERR too, as on real
 * devices (its receives and sends flush; the async event is not
 * modelled); an error CQE has only wr_id, status, qp_num and vendor_err
 * (ibv_poll_cq(3)): its opcode, byte_len, imm_data, wc_flags, src_qp ...
 * are a poison pattern (opcode 0x5a5a, in no enum); reg_mr
 * checks the memory as the kernel's page pinning does (EFAULT for a range
 * not wholly mapped and readable, or not writable when LOCAL_WRITE or
 * REMOTE_WRITE is asked: /proc/self/maps); dereg_mr fences the device:
 * once it returns no byte moves into or out of the MR (a responder
 * mid-payload into it discards the rest and NAKs REM_ACCESS_ERR, a READ
 * response from it not yet begun becomes that NAK, one partly sent breaks
 * its connection: RETRY_EXC_ERR at the requester); RNR
 * (RNR_RETRY_EXC_ERR); ERR flushes every WR (WR_FLUSH_ERR, unsignaled ones
 * too); send-queue slots released only when a signaled completion is polled;
 * CQ overflow puts the CQ in error; a peer that dies fails the WRs in flight
 * with RETRY_EXC_ERR; completion channels (an fd readable only while an
 * event waits; req_notify_cq arms one event for the next completion added,
 * none for those already in the CQ; get_cq_event blocks, or EAGAIN on an
 * O_NONBLOCK fd; destroy_cq with events got but not acked is EBUSY where
 * libibverbs would wait forever; destroy_comp_channel with CQs on it is
 * EBUSY). Thread-safe like libibverbs.
 *
 * Devices, ports and link layers (kvt_sv_set_devices; by default one device
 * "kvt_sv0" with one active Ethernet port, active MTU 4096). Each open
 * context is its own node: every active port of it gets addresses of its
 * own, unique on the host (an abstract socket per port, bound under the
 * address, so two processes never pick the same one):
 *   InfiniBand  a LID (1..0xbfff); GID table [0] fe80::"kvsv":0:LID (type
 *               IB), [1] zero; gid_tbl_len 2;
 *   Ethernet    a 24-bit address A (the port's IPv4 address 10.A, its MAC
 *               02:6b:76:A): GID table [0] fe80::6b:76ff:feA (RoCE v1),
 *               [1] the same (RoCE v2), [2] ::ffff:10.A (RoCE v1), [3] the
 *               same (RoCE v2), [4..7] zero; gid_tbl_len 8; LID 0.
 * A down port has neither (LID 0, a zero GID table) and refuses RTR.
 * ibv_modify_qp is as strict as the world or stricter: attributes in the
 * kernel's ranges (pkey_index < pkey_tbl_len 1, max_rd_atomic and
 * max_dest_rd_atomic <= 16, the device's; timeout, min_rnr_timer <= 31;
 * retry_cnt, rnr_retry <= 7; dest_qp_num, rq_psn, sq_psn < 2^24: EINVAL
 * otherwise); INIT needs a port
 * that exists; RTR needs ah_attr.port_num == the QP's port, that port
 * ACTIVE, path_mtu <= its active MTU; on InfiniBand a unicast dlid, and a
 * GRH (is_global) only to a GID some port on the host has (EINVAL
 * otherwise); on Ethernet a GRH, an sgid_index naming a nonzero entry of
 * the table and a dgid that resolves to a port (EINVAL otherwise). The
 * route is the dlid on InfiniBand, the dgid on Ethernet. The responder
 * checks the path MTU again against its own port's active MTU, and that
 * the request arrived on the port its QP is bound to: a request that fails
 * either is dropped, nothing written (the requester's WR ends
 * RETRY_EXC_ERR, as packets a port cannot take are lost on a fabric).
 *
 * Devices do not mix: a QP takes only CQs of its own context (EINVAL), a
 * CQ only a channel of its own; lkeys resolve only to MRs of the QP's
 * context and PD (LOC_PROT_ERR), rkeys only to MRs of the responder QP's
 * context and PD (REM_ACCESS_ERR); the keys of the contexts of one process
 * are disjoint, so a key of another device never aliases an MR.
 *
 * RC pairing and PSNs: a request carries its QP number and a 24-bit PSN
 * (the first sq_psn, then + 1 per request; an RNR retry resends the same);
 * the responder executes it only when it comes from its dest_qp_num on the
 * port its AV names (QP numbers repeat across contexts), at the PSN it
 * expects (rq_psn, then + 1 per request executed), and drops anything
 * else, nothing written (the requester's WR ends RETRY_EXC_ERR, at once
 * here).
 *
 * Simplified or absent: one request in flight per QP (no pipelining, so no
 * out-of-window duplicates, and max_rd_atomic is not enforced); a request to a
 * responder QP that is missing, in RESET/INIT or in ERR fails at once with
 * RETRY_EXC_ERR instead of after timeout * retry_cnt; the retry timeout is
 * KVT_SV_RETRY_MS whatever the QP's timeout/retry_cnt; RNR retries wait
 * ~1 ms whatever min_rnr_timer (rnr_retry 7 = forever, as in the spec); no
 * atomics, SRQ, UD/UC, solicited-only events (EOPNOTSUPP), async events,
 * memory windows,
 * SEND_WITH_IMM or SQD; no subnets or routers (a GRH's hop limit and
 * traffic class are not checked), pkey ignored; an MR
 * is checked on every access; dereg_mr fences the MR (above) but does not
 * fail WRs that would use it later (they fail at their own check); CQ overrun moves the QP that
 * overran to ERR (no async event).
 */
#ifndef KVT_SOFTVERBS_H
#define KVT_SOFTVERBS_H

#include <stdbool.h>
#include <stdint.h>

#include "kv_verbs_int.h"

/* The software device's table (static storage). Install it with
 * kv__verbs_set(kvt_softverbs()) before opening anything. */
const struct kv__verbs *kvt_softverbs(void);

/* Faults, process-wide and one-shot: the fault lets after_n eligible events
 * pass, hits the next one, then disarms. Events are counted in the process
 * that armed it (arm it in the requester for the request faults). */
enum kvt_sv_fault {
    KVT_SV_FAULT_NONE = 0,       /* disarm every fault */
    KVT_SV_RETRY_EXCEEDED = 1,   /* a request is dropped on the wire: its WR completes
                                    IBV_WC_RETRY_EXC_ERR after KVT_SV_RETRY_MS, QP to ERR */
    KVT_SV_REMOTE_ACCESS = 2,    /* the responder NAKs a request, nothing written:
                                    IBV_WC_REM_ACCESS_ERR, both QPs to ERR */
    KVT_SV_LOST_COMPLETION = 3,  /* a CQE (any CQ) is silently dropped; its send-queue
                                    slots are released as if it had been polled */
    KVT_SV_DELAY_COMPLETION = 4, /* a CQE is held arg ms (the CQE after it waits too) */
};
void kvt_sv_fault(enum kvt_sv_fault f, uint32_t after_n, uint32_t arg);
/* The same, counting and hitting only RDMA WRITEs' events (their requests,
 * their completions): a session's other traffic (notifications and their
 * acknowledgements, SENDs) passes untouched and uncounted. */
void kvt_sv_fault_writes(enum kvt_sv_fault f, uint32_t after_n, uint32_t arg);

/* How long a dropped request or a dead connection takes to fail its WR. */
#define KVT_SV_RETRY_MS 50

/* The device set (process-wide; call before any open_device, in both
 * processes of a test, e.g. before fork). n == 0 (or devs NULL): the
 * default, one device "kvt_sv0", one active Ethernet port, MTU 4096.
 * Returns 0, or EINVAL (n over KVT_SV_MAX_DEVS, a port count of 0 or over
 * KVT_SV_MAX_PORTS, a name that does not fit, an unknown link layer or
 * MTU). */
#define KVT_SV_MAX_DEVS 4
#define KVT_SV_MAX_PORTS 2
#define KVT_SV_GID_TBL 8 /* Ethernet; InfiniBand ports have 2 */
struct kvt_sv_port_spec {
    uint8_t link_layer;      /* IBV_LINK_LAYER_INFINIBAND or IBV_LINK_LAYER_ETHERNET */
    enum ibv_mtu active_mtu; /* IBV_MTU_256 .. IBV_MTU_4096 */
    bool down;               /* state IBV_PORT_DOWN: no addresses, refuses RTR */
};
struct kvt_sv_dev_spec {
    const char *name;
    uint8_t n_ports; /* 1 .. KVT_SV_MAX_PORTS */
    struct kvt_sv_port_spec port[KVT_SV_MAX_PORTS];
};
int kvt_sv_set_devices(const struct kvt_sv_dev_spec *devs, uint32_t n);

/* Limits reported by query_device; the MR size is settable so tests can
 * exercise MR splitting (default 1 GiB), max_sge_rd so they can exercise
 * READs cut to fewer SGEs than WRITEs. Process-wide. */
#define KVT_SV_MAX_SGE 16
#define KVT_SV_MAX_SGE_RD 4 /* default max_sge_rd: a READ of more SGEs is EINVAL at post */
#define KVT_SV_MAX_QP_WR 4096
#define KVT_SV_MAX_CQE 65536
#define KVT_SV_MAX_INLINE 256
void kvt_sv_set_max_mr_size(uint64_t bytes);
/* max_sge_rd 1 .. KVT_SV_MAX_SGE (0: back to KVT_SV_MAX_SGE_RD): 0, or
 * EINVAL over KVT_SV_MAX_SGE. */
int kvt_sv_set_max_sge_rd(uint32_t n);

/* Process-wide counters (atomic). */
struct kvt_sv_stats {
    uint64_t requests_sent;   /* request packets (WRITE, READ, SEND) sent */
    uint64_t requests_served; /* requests executed by this process's responders */
    uint64_t bytes_landed;    /* bytes this process's responders wrote into MRs */
    uint64_t naks_sent;       /* access / RNR / invalid NAKs sent */
    uint64_t cqes;            /* CQEs generated */
    uint64_t faults_fired;
};
void kvt_sv_stats_get(struct kvt_sv_stats *out);

#endif /* KVT_SOFTVERBS_H */
