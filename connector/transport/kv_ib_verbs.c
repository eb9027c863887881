/*
 * kv_ib_verbs.c - the libibverbs table of kv_verbs_int.h and the
 * process-wide override tests use to put the software device underneath.
 *
 * Built only when the RDMA headers exist (the Makefile compiles *_verbs.c
 * with RDMA and links -libverbs). Each wrapper is the libibverbs call
 * itself (get_cq_event's -1 + errno turned into the errno value); the
 * inline ones (post_send, poll_cq, query_port, query_gid_ex, reg_mr, req_notify_cq) are
 * why the wrappers exist at all.
 */
#include <errno.h>
#include <stdatomic.h>

#include "kv_verbs_int.h"

static struct ibv_device **real_get_device_list(int *num_devices)
{
    return ibv_get_device_list(num_devices);
}

static void real_free_device_list(struct ibv_device **list)
{
    ibv_free_device_list(list);
}

static const char *real_get_device_name(struct ibv_device *device)
{
    return ibv_get_device_name(device);
}

static struct ibv_context *real_open_device(struct ibv_device *device)
{
    return ibv_open_device(device);
}

static int real_close_device(struct ibv_context *context)
{
    return ibv_close_device(context);
}

static int real_query_device(struct ibv_context *context, struct ibv_device_attr *device_attr)
{
    return ibv_query_device(context, device_attr);
}

static int real_query_port(struct ibv_context *context, uint8_t port_num,
                           struct ibv_port_attr *port_attr)
{
    return ibv_query_port(context, port_num, port_attr);
}

static int real_query_gid(struct ibv_context *context, uint8_t port_num, int index,
                          union ibv_gid *gid)
{
    return ibv_query_gid(context, port_num, index, gid);
}

/* ibv_query_gid_ex is static inline (a versioned _ibv_query_gid_ex). */
static int real_query_gid_ex(struct ibv_context *context, uint32_t port_num, uint32_t gid_index,
                             struct ibv_gid_entry *entry, uint32_t flags)
{
    return ibv_query_gid_ex(context, port_num, gid_index, entry, flags);
}

static struct ibv_pd *real_alloc_pd(struct ibv_context *context)
{
    return ibv_alloc_pd(context);
}

static int real_dealloc_pd(struct ibv_pd *pd)
{
    return ibv_dealloc_pd(pd);
}

static struct ibv_mr *real_reg_mr(struct ibv_pd *pd, void *addr, size_t length, int access)
{
    return ibv_reg_mr(pd, addr, length, access);
}

static int real_dereg_mr(struct ibv_mr *mr)
{
    return ibv_dereg_mr(mr);
}

static struct ibv_cq *real_create_cq(struct ibv_context *context, int cqe, void *cq_context,
                                     struct ibv_comp_channel *channel, int comp_vector)
{
    return ibv_create_cq(context, cqe, cq_context, channel, comp_vector);
}

static int real_destroy_cq(struct ibv_cq *cq)
{
    return ibv_destroy_cq(cq);
}

static struct ibv_comp_channel *real_create_comp_channel(struct ibv_context *context)
{
    return ibv_create_comp_channel(context);
}

static int real_destroy_comp_channel(struct ibv_comp_channel *channel)
{
    return ibv_destroy_comp_channel(channel);
}

static int real_req_notify_cq(struct ibv_cq *cq, int solicited_only)
{
    return ibv_req_notify_cq(cq, solicited_only);
}

/* ibv_get_cq_event says -1 + errno; the table says the errno value. */
static int real_get_cq_event(struct ibv_comp_channel *channel, struct ibv_cq **cq,
                             void **cq_context)
{
    if (ibv_get_cq_event(channel, cq, cq_context) == 0)
        return 0;
    return errno != 0 ? errno : EIO;
}

static void real_ack_cq_events(struct ibv_cq *cq, unsigned int nevents)
{
    ibv_ack_cq_events(cq, nevents);
}

static struct ibv_qp *real_create_qp(struct ibv_pd *pd, struct ibv_qp_init_attr *qp_init_attr)
{
    return ibv_create_qp(pd, qp_init_attr);
}

static int real_modify_qp(struct ibv_qp *qp, struct ibv_qp_attr *attr, int attr_mask)
{
    return ibv_modify_qp(qp, attr, attr_mask);
}

static int real_query_qp(struct ibv_qp *qp, struct ibv_qp_attr *attr, int attr_mask,
                         struct ibv_qp_init_attr *init_attr)
{
    return ibv_query_qp(qp, attr, attr_mask, init_attr);
}

static int real_destroy_qp(struct ibv_qp *qp)
{
    return ibv_destroy_qp(qp);
}

static int real_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad_wr)
{
    return ibv_post_send(qp, wr, bad_wr);
}

static int real_post_recv(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad_wr)
{
    return ibv_post_recv(qp, wr, bad_wr);
}

static int real_poll_cq(struct ibv_cq *cq, int num_entries, struct ibv_wc *wc)
{
    return ibv_poll_cq(cq, num_entries, wc);
}

static const struct kv__verbs real_verbs = {
    .version = KV__VERBS_VERSION,
    .name = "libibverbs",
    .get_device_list = real_get_device_list,
    .free_device_list = real_free_device_list,
    .get_device_name = real_get_device_name,
    .open_device = real_open_device,
    .close_device = real_close_device,
    .query_device = real_query_device,
    .query_port = real_query_port,
    .query_gid = real_query_gid,
    .query_gid_ex = real_query_gid_ex,
    .alloc_pd = real_alloc_pd,
    .dealloc_pd = real_dealloc_pd,
    .reg_mr = real_reg_mr,
    .dereg_mr = real_dereg_mr,
    .create_cq = real_create_cq,
    .destroy_cq = real_destroy_cq,
    .create_comp_channel = real_create_comp_channel,
    .destroy_comp_channel = real_destroy_comp_channel,
    .req_notify_cq = real_req_notify_cq,
    .get_cq_event = real_get_cq_event,
    .ack_cq_events = real_ack_cq_events,
    .create_qp = real_create_qp,
    .modify_qp = real_modify_qp,
    .query_qp = real_query_qp,
    .destroy_qp = real_destroy_qp,
    .post_send = real_post_send,
    .post_recv = real_post_recv,
    .poll_cq = real_poll_cq,
};

/* The installed table; NULL means the real one. */
static _Atomic(const struct kv__verbs *) installed;

const struct kv__verbs *kv__verbs_real(void)
{
    return &real_verbs;
}

void kv__verbs_set(const struct kv__verbs *v)
{
    atomic_store_explicit(&installed, v, memory_order_release);
}

const struct kv__verbs *kv__verbs_get(void)
{
    const struct kv__verbs *v = atomic_load_explicit(&installed, memory_order_acquire);
    return v != NULL ? v : &real_verbs;
}

kv_status kv__verbs_acquire(const struct kv__verbs **out)
{
    const struct kv__verbs *v = kv__verbs_get();
    if (v->version != KV__VERBS_VERSION)
        return kv__error(KV_ERR_UNSUPPORTED,
                         "verbs table \"%s\" has version %u, this library needs %u",
                         v->name ? v->name : "?", v->version, KV__VERBS_VERSION);
    *out = v;
    return kv__ok();
}
