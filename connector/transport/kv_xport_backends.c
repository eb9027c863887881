/*
 * kv_xport_backends.c - the transport backends this build has, by kind:
 * the one place the generic layer (kv_transport.c) learns of them, so it
 * never sees a backend's headers (the shared-memory one in
 * kv_xport_shm_int.h; AUTO, which runs TCP and SHM together, in
 * kv_xport_int.h; the RDMA one comes through the verbs boundary,
 * kv_verbs_int.h: NULL in a build without rdma-core).
 */
#include "kv_verbs_int.h"
#include "kv_xport_int.h"
#include "kv_xport_shm_int.h"

const struct kv__xport_ops *kv__xport_backend(kv_xport_kind kind)
{
    switch (kind) {
    case KV_XPORT_TCP:
        return &kv__xport_tcp_ops;
    case KV_XPORT_RDMA:
        return kv__xport_rdma();
    case KV_XPORT_SHM:
        return &kv__xport_shm_ops;
    case KV_XPORT_AUTO:
        return &kv__xport_auto_ops;
    }
    return NULL;
}
