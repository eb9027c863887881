/*
 * kv_verbs_int.h - the verbs boundary of the connector module (private).
 *
 * The RDMA transport makes every verbs call through one function table,
 * struct kv__verbs, never through libibverbs directly: ibv_post_send() and
 * ibv_poll_cq() are static inline in <infiniband/verbs.h>, so a table is the
 * only way a test can put another device underneath. Two tables exist:
 *
 *   kv__verbs_real()   thin wrappers over libibverbs (kv_ib_verbs.c)
 *   kvt_softverbs()    a software RC device for tests, two processes on one
 *                      host (tests/softverbs/kvt_softverbs.h)
 *
 * kv__verbs_get() is the one the transport uses: the real table unless a
 * test installed another with kv__verbs_set(). Each entry has the signature
 * and the return convention of the ibverbs call it is named after (pointer
 * or NULL + errno; int 0 or an errno value; poll_cq: count or < 0;
 * get_cq_event: 0 or an errno value, where libibverbs says -1 + errno), so
 * `v->post_send(qp, wr, &bad)` reads like ibv_post_send(qp, wr, &bad).
 *
 * The only place in connector/ where KV_HAVE_RDMA is tested. Without RDMA
 * the table type is opaque, no table exists, and kv__verbs_acquire() fails
 * with KV_ERR_UNSUPPORTED.
 */
#ifndef KV_VERBS_INT_H
#define KV_VERBS_INT_H

#include <stddef.h>
#include <stdint.h>

#include "kv_lib.h"

/* Bumped whenever an entry is added, removed or changes signature; a table
 * whose version differs is refused by kv__verbs_acquire(). */
#define KV__VERBS_VERSION 3

#if KV_HAVE_RDMA

#include <infiniband/verbs.h>

struct kv__verbs {
    uint32_t version; /* KV__VERBS_VERSION */
    const char *name; /* "libibverbs", "softverbs" */

    struct ibv_device **(*get_device_list)(int *num_devices);
    void (*free_device_list)(struct ibv_device **list);
    const char *(*get_device_name)(struct ibv_device *device);
    struct ibv_context *(*open_device)(struct ibv_device *device);
    int (*close_device)(struct ibv_context *context);
    int (*query_device)(struct ibv_context *context, struct ibv_device_attr *device_attr);
    int (*query_port)(struct ibv_context *context, uint8_t port_num,
                      struct ibv_port_attr *port_attr);
    int (*query_gid)(struct ibv_context *context, uint8_t port_num, int index, union ibv_gid *gid);
    /* ibv_query_gid_ex(3) (v3): the entry with its type (IB, RoCE v1, RoCE
     * v2); ENODATA for an empty slot of the table. */
    int (*query_gid_ex)(struct ibv_context *context, uint32_t port_num, uint32_t gid_index,
                        struct ibv_gid_entry *entry, uint32_t flags);

    struct ibv_pd *(*alloc_pd)(struct ibv_context *context);
    int (*dealloc_pd)(struct ibv_pd *pd);
    struct ibv_mr *(*reg_mr)(struct ibv_pd *pd, void *addr, size_t length, int access);
    int (*dereg_mr)(struct ibv_mr *mr);

    struct ibv_cq *(*create_cq)(struct ibv_context *context, int cqe, void *cq_context,
                                struct ibv_comp_channel *channel, int comp_vector);
    int (*destroy_cq)(struct ibv_cq *cq);

    /* Completion events (ibv_get_cq_event(3), ibv_req_notify_cq(3)): a CQ
     * created with a channel and armed with req_notify_cq gets one event on
     * the channel at its next completion (one-shot: re-arm after each);
     * channel->fd is readable while an event waits, get_cq_event blocks on
     * it unless the fd is O_NONBLOCK (EAGAIN then). Every event got must be
     * acknowledged (ack_cq_events) before its CQ is destroyed; a channel
     * with CQs still attached is not destroyed (EBUSY). */
    struct ibv_comp_channel *(*create_comp_channel)(struct ibv_context *context);
    int (*destroy_comp_channel)(struct ibv_comp_channel *channel);
    int (*req_notify_cq)(struct ibv_cq *cq, int solicited_only);
    int (*get_cq_event)(struct ibv_comp_channel *channel, struct ibv_cq **cq, void **cq_context);
    void (*ack_cq_events)(struct ibv_cq *cq, unsigned int nevents);
    struct ibv_qp *(*create_qp)(struct ibv_pd *pd, struct ibv_qp_init_attr *qp_init_attr);
    int (*modify_qp)(struct ibv_qp *qp, struct ibv_qp_attr *attr, int attr_mask);
    int (*query_qp)(struct ibv_qp *qp, struct ibv_qp_attr *attr, int attr_mask,
                    struct ibv_qp_init_attr *init_attr);
    int (*destroy_qp)(struct ibv_qp *qp);

    /* Thread-safe, as in libibverbs: post_send, post_recv and poll_cq may be
     * called from different threads on the same QP / CQ. */
    int (*post_send)(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad_wr);
    int (*post_recv)(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad_wr);
    int (*poll_cq)(struct ibv_cq *cq, int num_entries, struct ibv_wc *wc);
};

/* The libibverbs table (static storage; never NULL). */
const struct kv__verbs *kv__verbs_real(void);

/* Install v as the process-wide table (tests: kvt_softverbs()); NULL
 * restores the real one. v must stay valid while installed. Thread-safe
 * (an atomic pointer), but swapping it under live verbs objects is the
 * caller's bug: objects belong to the table that created them. */
void kv__verbs_set(const struct kv__verbs *v);

/* The table in use now: the installed one, else kv__verbs_real(). */
const struct kv__verbs *kv__verbs_get(void);

/* The table in use in *out after checking its version; KV_ERR_UNSUPPORTED
 * (naming both versions) when it was built against another one. */
KV_NODISCARD kv_status kv__verbs_acquire(const struct kv__verbs **out);

/* The RDMA backend of the transport seam (kv_xport_rdma_verbs.c). */
struct kv__xport_ops;
const struct kv__xport_ops *kv__xport_rdma(void);

#else /* !KV_HAVE_RDMA */

struct kv__verbs; /* opaque: no table in a build without verbs */

/* No RDMA backend: kv_xport_create(KV_XPORT_RDMA) says KV_ERR_UNSUPPORTED. */
struct kv__xport_ops;
static inline const struct kv__xport_ops *kv__xport_rdma(void)
{
    return NULL;
}

static inline const struct kv__verbs *kv__verbs_real(void)
{
    return NULL;
}

static inline void kv__verbs_set(const struct kv__verbs *v)
{
    (void)v;
}

static inline const struct kv__verbs *kv__verbs_get(void)
{
    return NULL;
}

static inline kv_status kv__verbs_acquire(const struct kv__verbs **out)
{
    (void)out;
    return kv__error(KV_ERR_UNSUPPORTED,
                     "RDMA verbs: this build has no verbs support (KV_HAVE_RDMA=0)");
}

#endif /* KV_HAVE_RDMA */

#endif /* KV_VERBS_INT_H */
