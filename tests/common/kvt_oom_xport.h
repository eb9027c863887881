/*
 * kvt_oom_xport.h - a transport's own calls out of memory (test_oom over
 * TCP and SHM, test_xport_rdma_oom over RDMA): create, connect, mem_reg,
 * mem_expose and rmem_import as oom_case callbacks, and kvt_ox_run, which
 * runs them in that order on a pair it opens and closes. Each failed call
 * leaves its output untouched (SENTINEL, or the length 0x5e17), holds
 * nothing (no peer left at a after a failed connect, no exposure after a
 * failed expose; expose and import compare the pair's references and
 * regions' users before and after); each call that succeeds is checked and
 * undone. Every case must inject at least one failure.
 * The test gives the configs (its transport kind) and the cases' names.
 * Include after <cmocka.h>; uses the transport's internals
 * (kv_xport_int.h) for its snapshot.
 */
#ifndef KVT_OOM_XPORT_H
#define KVT_OOM_XPORT_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <kvcache/kv.h>
#include "kv_xport_int.h"
#include "kvt_oom.h"
#include "kvt_xport.h"

struct kvt_ox {
    struct kvt_pair pair;
    struct kv_xport_config cfg; /* b's (listening): what create makes */
    kv_xport *x;
    unsigned char mem[8192];
    kv_xport_mem *m;
    unsigned char blob[KV_XPORT_BLOB_MAX];
    size_t len;
    kv_xport_rmem *r;
    kv_xport_peer *cpeer;
    uint64_t npeers;
};

static inline kv_status kvt_ox_call_create(void *p)
{
    struct kvt_ox *x = p;
    x->x = SENTINEL;
    return kv_xport_create(&x->cfg, &x->x);
}
static inline void kvt_ox_ok_create(void *p)
{
    struct kvt_ox *x = p;
    assert_ptr_not_equal(x->x, SENTINEL);
    assert_true(kv_xport_port(x->x) != 0);
    assert_int_equal(kv_xport_destroy(x->x), KV_OK);
}
static inline void kvt_ox_failed_create(void *p)
{
    struct kvt_ox *x = p;
    assert_ptr_equal(x->x, SENTINEL);
}

/* The peers x holds (its list: a failed connect leaves none). */
static inline uint64_t kvt_ox_peers(kv_xport *x)
{
    uint64_t n = 0;
    pthread_mutex_lock(&x->mu);
    for (kv_xport_peer *p = x->peers; p; p = p->next)
        n++;
    pthread_mutex_unlock(&x->mu);
    return n;
}

/* a connects to b again (at b's listening host). */
static inline kv_status kvt_ox_call_connect(void *p)
{
    struct kvt_ox *x = p;
    x->cpeer = SENTINEL;
    return kv_xport_connect(x->pair.a, x->cfg.listen_host, kv_xport_port(x->pair.b), &x->cpeer);
}
static inline void kvt_ox_ok_connect(void *p)
{
    struct kvt_ox *x = p;
    kv_xport_peer_state s = KV_XPORT_CONNECTING;
    if (kv_xport_peer_wait(x->cpeer, 5000, &s) != KV_OK)
        fail_msg("connect: state %d: %s", (int)s, kv_last_error());
    assert_int_equal(s, KV_XPORT_READY);
    kv_xport_peer *q = NULL;
    assert_int_equal(kv_xport_accept(x->pair.b, 5000, &q), KV_OK); /* accept makes no allocation */
    kv_xport_peer_close(x->cpeer);
    kv_xport_peer_close(q);
    x->cpeer = NULL;
}
static inline void kvt_ox_failed_connect(void *p)
{
    struct kvt_ox *x = p;
    assert_ptr_equal(x->cpeer, SENTINEL);
    assert_int_equal(kvt_ox_peers(x->pair.a), x->npeers);
    x->cpeer = NULL;
}

static inline kv_status kvt_ox_call_reg(void *p)
{
    struct kvt_ox *x = p;
    x->m = SENTINEL;
    return kv_xport_mem_reg(x->pair.b, x->mem, sizeof(x->mem), KV_MEM_HOST, &x->m);
}
static inline void kvt_ox_ok_reg(void *p)
{
    struct kvt_ox *x = p;
    assert_int_equal(kv_xport_mem_bytes(x->m), sizeof(x->mem));
    assert_int_equal(kv_xport_mem_dereg(x->m), KV_OK);
    x->m = NULL;
}
static inline void kvt_ox_failed_reg(void *p)
{
    struct kvt_ox *x = p;
    assert_ptr_equal(x->m, SENTINEL);
    x->m = NULL;
}

/* The observable state: a's transfers and imported regions, both peers'
 * references and exposures, m's users. */
static inline void kvt_ox_snap(void *p, struct snap *s)
{
    struct kvt_ox *x = p;
    pthread_mutex_lock(&x->pair.a->mu);
    snap_put(s, x->pair.a->n_xfers);
    snap_put(s, x->pair.a->n_rmems);
    snap_put(s, x->pair.pa->refs);
    snap_put(s, x->pair.pa->n_exposed);
    pthread_mutex_unlock(&x->pair.a->mu);
    pthread_mutex_lock(&x->pair.b->mu);
    snap_put(s, x->pair.pb->n_exposed);
    snap_put(s, x->pair.pb->refs);
    snap_put(s, x->m ? x->m->users : 0);
    pthread_mutex_unlock(&x->pair.b->mu);
}

static inline kv_status kvt_ox_call_expose(void *p)
{
    struct kvt_ox *x = p;
    x->len = 0x5e17;
    return kv_xport_mem_expose(x->pair.pb, x->m, x->blob, sizeof(x->blob), &x->len);
}
static inline void kvt_ox_ok_expose(void *p)
{
    struct kvt_ox *x = p;
    assert_true(x->len > 0 && x->len <= KV_XPORT_BLOB_MAX);
    assert_int_equal(kv_xport_mem_unexpose(x->pair.pb, x->m), KV_OK);
}
static inline void kvt_ox_failed_expose(void *p)
{
    struct kvt_ox *x = p;
    assert_int_equal(x->len, 0x5e17);
    /* not exposed: nothing to withdraw */
    assert_int_equal(kv_xport_mem_unexpose(x->pair.pb, x->m), KV_ERR_NOT_FOUND);
}

static inline kv_status kvt_ox_call_import(void *p)
{
    struct kvt_ox *x = p;
    x->r = SENTINEL;
    return kv_xport_rmem_import(x->pair.pa, x->blob, x->len, &x->r);
}
static inline void kvt_ox_ok_import(void *p)
{
    struct kvt_ox *x = p;
    assert_int_equal(kv_xport_rmem_bytes(x->r), sizeof(x->mem));
    assert_int_equal(kv_xport_rmem_free(x->r), KV_OK);
    x->r = NULL;
}
static inline void kvt_ox_failed_import(void *p)
{
    struct kvt_ox *x = p;
    assert_ptr_equal(x->r, SENTINEL);
    x->r = NULL;
}

/* The cases' names (oom_run's lines); connect NULL: no connect case. */
struct kvt_ox_names {
    const char *create, *connect, *reg, *expose, *import;
};

/* x zeroed; create from cb; then on a pair from ca and cb: connect (if
 * named), mem_reg, mem_expose (of a region made at b), rmem_import (of
 * its blob at a); the pair closed, refused (KV_ERR_BAD_STATE) if a failed
 * call left a region or a peer held. */
static inline void kvt_ox_run(struct kvt_ox *x, const struct kvt_ox_names *n,
                              const struct kv_xport_config *ca, const struct kv_xport_config *cb)
{
    memset(x, 0, sizeof(*x));
    x->cfg = *cb;
    struct oom_case c = {
        n->create, x, kvt_ox_call_create, NULL, kvt_ox_ok_create, kvt_ox_failed_create, KV_OK};
    assert_true(oom_run(&c) > 0); /* every call here allocates */

    kvt_pair_open(&x->pair, ca, cb);
    x->npeers = kvt_ox_peers(x->pair.a);
    if (n->connect) {
        c = (struct oom_case){
            n->connect, x, kvt_ox_call_connect, NULL, kvt_ox_ok_connect, kvt_ox_failed_connect,
            KV_OK};
        assert_true(oom_run(&c) > 0);
    }
    c = (struct oom_case){n->reg, x, kvt_ox_call_reg, NULL, kvt_ox_ok_reg, kvt_ox_failed_reg,
                          KV_OK};
    assert_true(oom_run(&c) > 0);
    assert_int_equal(kv_xport_mem_reg(x->pair.b, x->mem, sizeof(x->mem), KV_MEM_HOST, &x->m),
                     KV_OK);
    c = (struct oom_case){
        n->expose, x, kvt_ox_call_expose, kvt_ox_snap, kvt_ox_ok_expose, kvt_ox_failed_expose,
        KV_OK};
    assert_true(oom_run(&c) > 0);
    assert_int_equal(kv_xport_mem_expose(x->pair.pb, x->m, x->blob, sizeof(x->blob), &x->len),
                     KV_OK);
    c = (struct oom_case){
        n->import, x, kvt_ox_call_import, kvt_ox_snap, kvt_ox_ok_import, kvt_ox_failed_import,
        KV_OK};
    assert_true(oom_run(&c) > 0);
    assert_int_equal(kv_xport_mem_unexpose(x->pair.pb, x->m), KV_OK);
    assert_int_equal(kv_xport_mem_dereg(x->m), KV_OK);
    kvt_pair_close(&x->pair);
}

#endif /* KVT_OOM_XPORT_H */
