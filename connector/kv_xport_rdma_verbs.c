/* kv_xport_rdma_verbs.c - placeholder until the RDMA backend lands (issue 9,
 * in progress): kv_xport_create(KV_XPORT_RDMA) says so. */
#include "kv_xport_int.h"

static kv_status rdma_start(kv_xport *x)
{
    (void)x;
    return kv__error(KV_ERR_UNSUPPORTED, "xport_create: the RDMA backend is not built yet");
}

const struct kv__xport_ops kv__xport_rdma_ops = {
    .version = KV__XPORT_OPS_VERSION, .kind = KV_XPORT_RDMA, .name = "rdma", .start = rdma_start};
