/*
 * test_offload_dev.c - connector/kv_offload with device caches
 * (KV_MEM_DEVICE), over the CUDA double tests/softcuda: its device and
 * pinned memory are host memory it tracks, its streams run the plan copy's
 * CUDA schedule on the grid emulator on their own threads, and it refuses
 * (counting a fault) what CUDA refuses or a tier must never do.
 *
 * Every load compares the WHOLE destination pool against its snapshot plus
 * the loaded blocks (written by the reference addressing of kvt_cache.h);
 * pools are scrambled (block ids far from 0) and padded. Cases:
 *   - the double refuses: a host cache, an event never recorded, a stream
 *     destroyed with work queued, a free under a queued copy, a stream or
 *     event used from a thread that did not make it;
 *   - device -> tier -> device round trip (several chunks), and the same
 *     entries loaded into a host cache (the D2H wrote the host tier's format);
 *   - a corrupted entry refused before any H2D: its block untouched;
 *   - cancel with a chunk's copies in flight (store and load): the op stays
 *     RUNNING until they land, then CANCELLED with the usual results;
 *   - destroy orders: the engine's cache destroyed with a store in flight,
 *     the tier destroyed with a load in flight: no device memory freed
 *     under a queued copy, every stream and event of the tier destroyed;
 *   - engine streams held (the legacy default stream and a blocking one):
 *     the tier still finishes, and never waits on an engine's event;
 *   - the engine's writes to a block: landed before the store (the entry
 *     holds them), or still queued on its stream (the race the GPU loses
 *     silently: the double's fault), or written after the store was posted
 *     while its copy is still queued (a fault too; a write to a block not
 *     in the op is none);
 *   - a failing copy (injected): its chunk's entries KV_ERR_DEVICE, what was
 *     issued still waited for, the other chunks done;
 *   - the event record or synchronize failing with a store's copies held:
 *     the worker waits for its stream instead (the op RUNNING until they
 *     land); with the stream synchronize failing too, the chunk's region
 *     pieces stay out of the free pool (a host store meanwhile is intact
 *     after the late copies land), device ops are refused, and a load's
 *     blocks stay held until destroy;
 *   - a sticky error with a load's copies in flight: they never run, every
 *     entry KV_ERR_DEVICE, the chunk's blocks held until destroy, the pool
 *     as it was; later ops fail without issuing, destroy ends;
 *   - refusals at post: a host-memory region, nothing retained.
 * Runs under SANITIZE=thread in CI (.ci/run).
 */
#include <pthread.h>
#include <setjmp.h>
#include <stdatomic.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include <kvcache/kv.h>
#include "kv_lib.h" /* kv__error */
#include "kv_offload_int.h"
#include "kv_offload_tier_int.h" /* op->cancel: destroy has begun */
#include "kv_plan_int.h"
#include "kvt_cache.h"
#include "kvt_offload.h"
#include "kvt_side.h"
#include "kvt_softcuda.h"
#include "kvtest.h"

static uint64_t hash_of(uint64_t k)
{
    return 0x9E3779B97F4A7C15ull * (k + 1) ^ 0xD1B54A32D192ED03ull;
}

/* kvt_cache_make with the memory kind: a device cache's arena comes from
 * the double (host memory it tracks, written here as a test would with
 * cudaMemcpy). bits: 1 HND, 2 block-major, 4 padded. */
static void mk_cache(struct kvt_cache *t, enum kv_mem_kind mem, int bits, uint64_t seed)
{
    memset(t, 0, sizeof(*t));
    kv_cache_config_init(&t->cfg);
    struct kv_layout_config *lc = &t->cfg.layout;
    lc->num_layers = 3;
    lc->num_blocks = 300;
    lc->block_tokens = 16;
    lc->num_heads = 2;
    lc->head_dim = 32;
    lc->dtype = KV_BF16;
    lc->order = (bits & 1) ? KV_ORDER_HND : KV_ORDER_NHD;
    lc->arrange = (bits & 2) ? KV_ARRANGE_BLOCK_MAJOR : KV_ARRANGE_LAYER_MAJOR;
    lc->block_pad_elems = (bits & 4) ? 24 : 0;
    t->cfg.max_seqs = 4;
    t->cfg.enable_prefix_caching = true;
    t->cfg.mem_kind = mem;
    assert_int_equal(kv_cache_create(&t->cfg, &t->c), KV_OK);
    t->pool = kv_cache_pool(t->c);
    assert_int_equal(kv_cache_paged(t->c, &t->pc), KV_OK);
    assert_int_equal(t->pc.mem, mem);
    t->base = t->pc.base;
    t->bytes = (size_t)t->pc.layout.total_bytes;
    uint64_t st = seed;
    for (size_t i = 0; i < t->bytes; i++)
        t->base[i] = (unsigned char)kvt_rand(&st);
}

static kv_offload *mk_tier(uint32_t chunk)
{
    struct kv_offload_config cfg = KV_OFFLOAD_CONFIG_INIT;
    cfg.capacity_bytes = (size_t)4 << 20;
    cfg.mem = KV_OFFLOAD_MEM_AUTO; /* pinned: the double's */
    cfg.threads = 1;
    kv_offload *off = NULL;
    assert_int_equal(kv_offload_create(&cfg, &off), KV_OK);
    assert_int_equal(kv_offload_mem_kind(off), KV_MEM_PINNED);
    kv__offload_test_set_chunk(off, chunk);
    return off;
}

/* Two device caches of one layout (bits): s from seed, d from seed + 1,
 * both pools scrambled (from rng) so their blocks are far from 0. */
static void mk_pair(struct kvt_cache *s, struct kvt_cache *d, int bits, uint64_t seed, uint64_t rng)
{
    mk_cache(s, KV_MEM_DEVICE, bits, seed);
    mk_cache(d, KV_MEM_DEVICE, bits, seed + 1);
    kvt_pool_scramble(s, &rng);
    kvt_pool_scramble(d, &rng);
}

/* The tier destroyed, then the caches of mk_pair freed. */
static void free_pair(kv_offload *off, struct kvt_cache *s, struct kvt_cache *d)
{
    kv_offload_destroy(off);
    kvt_cache_free(s);
    kvt_cache_free(d);
}

static int setup_double(void **state)
{
    (void)state;
    kvt_softcuda_install();
    return 0;
}

static struct kvt_softcuda_stats sc_stats(void)
{
    struct kvt_softcuda_stats s;
    kvt_softcuda_stats(&s);
    return s;
}

/* The double uninstalled: nothing left in it (no allocation, no tier
 * stream) and exactly `faults` faults in the whole case. */
static void double_clean(uint64_t faults)
{
    kvt_softcuda_uninstall();
    const struct kvt_softcuda_stats s = sc_stats();
    if (s.faults != faults)
        fprintf(stderr, "softcuda fault: %s\n", s.last_fault);
    assert_int_equal(s.faults, faults);
    assert_int_equal(s.allocs, 0);
    assert_int_equal(s.tier_streams, 0);
}

/* Nothing left in the double, and no fault in the whole case. */
static int teardown_double(void **state)
{
    (void)state;
    double_clean(0);
    return 0;
}

/* Wait (bounded) until the double has accepted `issued` copies. */
static void wait_issued(uint64_t issued)
{
    for (int i = 0; i < 200000 && sc_stats().copies_issued < issued; i++) {
        const struct timespec ts = {0, 100000};
        nanosleep(&ts, NULL);
    }
    assert_true(sc_stats().copies_issued >= issued);
}

/* ---- the double can fail --------------------------------------------------- */

/* Seam calls on a stream and an event another thread made. */
struct other_call {
    const struct kv__offdev_ops *o;
    const kv_plan *plan;
    const struct kv_paged_cache *pc;
    void *s, *e;
    kv_status st[5];
};

static void *other_thread_calls(void *arg)
{
    struct other_call *c = arg;
    c->st[0] = c->o->copy(0, c->plan, c->pc, 7, c->pc, 9, 16, c->s);
    c->st[1] = c->o->event_record(0, c->e, c->s);
    c->st[2] = c->o->event_sync(0, c->e);
    c->st[3] = c->o->event_destroy(0, c->e);
    c->st[4] = c->o->stream_destroy(0, c->s);
    return NULL;
}

static void test_softcuda_refuses(void **state)
{
    (void)state;
    const struct kv__offdev_ops *o = kvt_softcuda_ops();
    struct kvt_cache dv, hc;
    mk_cache(&dv, KV_MEM_DEVICE, 4, 1);
    mk_cache(&hc, KV_MEM_HOST, 4, 2);
    kv_plan *plan = NULL;
    assert_int_equal(kv_plan_create(&dv.pc.layout, &hc.pc.layout, NULL, &plan), KV_OK);
    void *s = NULL, *e = NULL;
    assert_int_equal(o->stream_create(0, &s), KV_OK);
    assert_int_equal(o->event_create(0, &e), KV_OK);
    uint64_t f0 = sc_stats().faults;
    /* a host cache where device memory is required: kv_plan_copy_cuda's own check */
    assert_int_equal(o->copy(0, plan, &dv.pc, 7, &hc.pc, 9, 16, s), KV_ERR_INVALID_ARG);
    /* a device cache claimed pinned: not a live pinned allocation */
    struct kv_paged_cache lie = dv.pc;
    lie.mem = KV_MEM_PINNED;
    struct kv_paged_cache dv2 = dv.pc;
    assert_int_equal(o->copy(0, plan, &dv2, 7, &lie, 9, 16, s), KV_ERR_DEVICE);
    assert_int_equal(sc_stats().faults, f0 + 1);
    /* a copy on another device than its memory */
    assert_int_equal(o->copy(1, plan, &dv2, 7, &dv2, 9, 16, s), KV_ERR_DEVICE);
    /* an event synchronized before it was ever recorded */
    assert_int_equal(o->event_sync(0, e), KV_ERR_DEVICE);
    assert_int_equal(sc_stats().faults, f0 + 3);
    /* a stream destroyed with work queued; a free under a queued copy */
    kvt_softcuda_hold(s);
    assert_int_equal(o->copy(0, plan, &dv2, 7, &dv2, 9, 16, s), KV_OK);
    assert_int_equal(o->stream_destroy(0, s), KV_ERR_DEVICE);
    kvt_cache_free(&dv); /* the copy still uses its memory */
    assert_int_equal(sc_stats().faults, f0 + 5);
    kvt_softcuda_release();
    assert_int_equal(o->event_record(0, e, s), KV_OK);
    assert_int_equal(o->event_sync(0, e), KV_OK);
    assert_int_equal(sc_stats().copies_done, 1);
    assert_int_equal(o->event_destroy(0, e), KV_OK);
    assert_int_equal(o->stream_destroy(0, s), KV_OK);
    /* used after destroy: the event, the stream */
    assert_int_equal(o->event_record(0, e, NULL), KV_ERR_DEVICE);
    void *e2 = NULL;
    assert_int_equal(o->event_create(0, &e2), KV_OK);
    assert_int_equal(o->event_record(0, e2, s), KV_ERR_DEVICE);
    assert_int_equal(o->event_destroy(0, e2), KV_OK);
    assert_int_equal(o->copy(0, plan, &hc.pc, 7, &hc.pc, 9, 16, s), KV_ERR_INVALID_ARG);
    /* a stream and an event used from a thread that did not make them (the
     * CUDA table would move that thread's current device): each entry */
    struct other_call oc = {o, plan, &dv2, NULL, NULL, {0}};
    assert_int_equal(o->stream_create(0, &oc.s), KV_OK);
    assert_int_equal(o->event_create(0, &oc.e), KV_OK);
    assert_int_equal(o->event_record(0, oc.e, oc.s), KV_OK);
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, other_thread_calls, &oc), 0);
    assert_int_equal(pthread_join(t, NULL), 0);
    for (int i = 0; i < 5; i++)
        assert_int_equal(oc.st[i], KV_ERR_DEVICE);
    assert_int_equal(sc_stats().faults, f0 + 12);
    assert_non_null(strstr(sc_stats().last_fault, "other than the one that made"));
    assert_int_equal(o->event_sync(0, oc.e), KV_OK); /* its own thread: accepted */
    assert_int_equal(o->event_destroy(0, oc.e), KV_OK);
    assert_int_equal(o->stream_destroy(0, oc.s), KV_OK);
    kv_plan_destroy(plan);
    kvt_cache_free(&hc);
    /* the cache freed under the copy is now freed for real (the model kept
     * it for the copy): nothing leaks; this case's faults were expected */
    kvt_softcuda_uninstall();
    struct kvt_softcuda_stats st = sc_stats();
    assert_int_equal(st.faults, f0 + 13); /* + the allocation the fault kept, at uninstall */
    assert_int_equal(st.allocs, 0);
}

/* ---- round trips ----------------------------------------------------------------- */

static void test_offload_dev_round_trip(void **state)
{
    (void)state;
    uint64_t rng = 0xDE71CE;
    for (int bits = 4; bits <= 7; bits++) { /* padded: NHD/HND x layer-/block-major */
        kv_offload *off = mk_tier(4);
        struct kvt_cache s, d, h;
        mk_cache(&s, KV_MEM_DEVICE, bits, 10 + (uint64_t)bits);
        mk_cache(&d, KV_MEM_DEVICE, bits, 20 + (uint64_t)bits);
        mk_cache(&h, KV_MEM_HOST, bits ^ 2, 30 + (uint64_t)bits);
        kvt_pool_scramble(&s, &rng);
        kvt_pool_scramble(&d, &rng);
        kvt_pool_scramble(&h, &rng);
        enum { NB = 10 };
        uint64_t hs[NB];
        kv_status want[NB];
        for (int i = 0; i < NB; i++) {
            hs[i] = hash_of((uint64_t)(bits * 100 + i));
            want[i] = KV_OK;
        }
        const struct kvt_softcuda_stats a = sc_stats();
        kvt_store_all(off, &s, hs, NB, true);
        const struct kvt_softcuda_stats b = sc_stats();
        assert_int_equal(b.copies_issued - a.copies_issued, NB);
        assert_int_equal(b.copies_done - a.copies_done, NB);
        assert_int_equal(kvt_load_check(off, &d, hs, NB, want, true), KV_OFFLOAD_DONE);
        const struct kvt_softcuda_stats c = sc_stats();
        assert_int_equal(c.copies_issued - b.copies_issued, NB);
        /* what the D2H wrote is the host tier's entry format: a host cache of
         * another arrangement loads the same bytes (CPU path, no copy issued) */
        assert_int_equal(kvt_load_check(off, &h, hs, NB, want, true), KV_OFFLOAD_DONE);
        const struct kvt_softcuda_stats e = sc_stats();
        assert_int_equal(e.copies_issued, c.copies_issued);
        assert_int_equal(e.queued, 0);
        assert_int_equal(e.engine_waits, 0);
        assert_int_equal(e.tier_streams, 1);
        struct kv_offload_stats os;
        assert_int_equal(kv_offload_stats_get(off, &os), KV_OK);
        assert_int_equal(os.stores, NB);
        assert_int_equal(os.loads, 2 * NB);
        kv_offload_destroy(off);
        kvt_cache_free(&s);
        kvt_cache_free(&d);
        kvt_cache_free(&h);
    }
}

/* A corrupted entry is refused on the host before any H2D is issued: its
 * block is released untouched, the others load. */
static void test_offload_dev_corrupt_before_h2d(void **state)
{
    (void)state;
    kv_offload *off = mk_tier(0);
    struct kvt_cache s, d;
    mk_pair(&s, &d, 5, 41, 0xBAD5EED);
    const uint64_t h[4] = {hash_of(71), hash_of(72), hash_of(73), hash_of(74)};
    kvt_store_all(off, &s, h, 4, true);
    assert_int_equal(kv__offload_test_corrupt(off, s.c, h[2], 777), KV_OK);
    const uint64_t issued = sc_stats().copies_issued;
    const kv_status want[4] = {KV_OK, KV_OK, KV_ERR_CORRUPT, KV_OK};
    assert_int_equal(kvt_load_check(off, &d, h, 4, want, true), KV_OFFLOAD_FAILED);
    assert_int_equal(sc_stats().copies_issued - issued, 3); /* none for the corrupt one */
    assert_false(kv_offload_contains(off, s.c, h[2]));
    struct kv_offload_stats os;
    assert_int_equal(kv_offload_stats_get(off, &os), KV_OK);
    assert_int_equal(os.checksum_failures, 1);
    free_pair(off, &s, &d);
}

/* ---- cancel and destroy with copies in flight ------------------------------------ */

static void test_offload_dev_cancel_in_flight(void **state)
{
    (void)state;
    kv_offload *off = mk_tier(1);
    struct kvt_cache s, d;
    mk_pair(&s, &d, 4, 51, 0xCA9CE1);
    enum { NB = 6 };
    uint64_t h[NB];
    uint32_t ids[NB];
    for (int i = 0; i < NB; i++)
        h[i] = hash_of(500 + (uint64_t)i);
    kvt_put_blocks(&s, h, NB, ids);

    /* store: the first chunk's D2H held in flight, cancel, then let it land */
    kvt_softcuda_pause(true);
    uint64_t i0 = sc_stats().copies_issued;
    kv_offload_op *op = NULL;
    assert_int_equal(kv_offload_store(off, s.c, ids, NB, &op), KV_OK);
    wait_issued(i0 + 1);
    assert_int_equal(kv_offload_cancel(op), KV_OK);
    kv_offload_state st;
    assert_int_equal(kv_offload_test(op, &st), KV_OK);
    assert_int_equal(st, KV_OFFLOAD_RUNNING); /* its copy has not landed */
    kvt_softcuda_pause(false);
    assert_int_equal(kvt_offload_finish(op), KV_OFFLOAD_CANCELLED);
    assert_int_equal(sc_stats().queued, 0);
    const struct kv_offload_result *res;
    uint32_t nr;
    assert_int_equal(kv_offload_results(op, &res, &nr), KV_OK);
    assert_int_equal(res[0].status, KV_OK); /* its chunk finished */
    assert_true(kv_offload_contains(off, s.c, h[0]));
    for (int i = 1; i < NB; i++) {
        assert_int_equal(res[i].status, KV_ERR_CANCELLED);
        assert_false(kv_offload_contains(off, s.c, h[i]));
    }
    assert_int_equal(kv_offload_op_free(op), KV_OK);

    /* load: every entry, the first H2D held; cancelled: nothing committed,
     * every block released (after its copy landed) */
    kv_offload_op *all = NULL;
    assert_int_equal(kv_offload_store(off, s.c, ids, NB, &all), KV_OK);
    assert_int_equal(kvt_offload_finish(all), KV_OFFLOAD_DONE);
    assert_int_equal(kv_offload_op_free(all), KV_OK);
    const uint64_t refs = kvt_pool_refs(&d);
    struct kv_block_pool_stats p0, p1;
    kv_block_pool_stats_get(d.pool, &p0);
    kvt_softcuda_pause(true);
    i0 = sc_stats().copies_issued;
    assert_int_equal(kv_offload_load(off, d.c, h, NB, &op), KV_OK);
    wait_issued(i0 + 1);
    assert_int_equal(kv_offload_cancel(op), KV_OK);
    assert_int_equal(kv_offload_test(op, &st), KV_OK);
    assert_int_equal(st, KV_OFFLOAD_RUNNING);
    kvt_softcuda_pause(false);
    assert_int_equal(kvt_offload_finish(op), KV_OFFLOAD_CANCELLED);
    assert_int_equal(sc_stats().queued, 0);
    assert_int_equal(kv_offload_results(op, &res, &nr), KV_OK);
    for (int i = 0; i < NB; i++) {
        assert_int_equal(res[i].status, KV_ERR_CANCELLED);
        assert_int_equal(res[i].block, KV_BLOCK_NULL);
    }
    assert_int_equal(kvt_pool_refs(&d), refs);
    kv_block_pool_stats_get(d.pool, &p1);
    assert_int_equal(p1.used_blocks, p0.used_blocks);
    uint32_t found[NB], nf = 0;
    assert_int_equal(kv_block_pool_lookup(d.pool, h, NB, found, &nf), KV_OK);
    assert_int_equal(nf, 0);
    assert_int_equal(kv_offload_op_free(op), KV_OK);
    assert_int_equal(kv_block_pool_release(s.pool, ids, NB), KV_OK);
    free_pair(off, &s, &d);
}

static void *destroy_tier(void *arg)
{
    kv_offload_destroy(arg);
    return NULL;
}

static void test_offload_dev_destroy_order(void **state)
{
    (void)state;
    kv_offload *off = mk_tier(2);
    struct kvt_cache s, d;
    mk_pair(&s, &d, 6, 61, 0xDE5700);
    enum { NB = 6 };
    uint64_t h[NB];
    uint32_t ids[NB];
    for (int i = 0; i < NB; i++)
        h[i] = hash_of(600 + (uint64_t)i);
    kvt_put_blocks(&s, h, NB, ids);

    /* the engine destroys its cache with a store's copies in flight: the op's
     * reference keeps the device memory until they landed (the double faults
     * on a free under a queued copy) */
    kvt_softcuda_pause(true);
    const uint64_t i0 = sc_stats().copies_issued;
    kv_offload_op *op = NULL;
    assert_int_equal(kv_offload_store(off, s.c, ids, NB, &op), KV_OK);
    assert_int_equal(kv_block_pool_release(s.pool, ids, NB), KV_OK);
    wait_issued(i0 + 2);
    const uint64_t allocs = sc_stats().allocs;
    kvt_cache_free(&s);
    assert_int_equal(sc_stats().allocs, allocs); /* still held by the op */
    kvt_softcuda_pause(false);
    assert_int_equal(kvt_offload_finish(op), KV_OFFLOAD_DONE);
    assert_int_equal(sc_stats().allocs, allocs - 1); /* freed by the worker, after */
    assert_int_equal(kv_offload_op_free(op), KV_OK);

    /* the tier destroyed with a load's copies in flight: it waits for them,
     * then the op is CANCELLED with every block released, and its stream and
     * event are gone */
    const uint64_t refs = kvt_pool_refs(&d);
    kvt_softcuda_pause(true);
    const uint64_t i1 = sc_stats().copies_issued;
    assert_int_equal(kv_offload_load(off, d.c, h, NB, &op), KV_OK);
    wait_issued(i1 + 2);
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, destroy_tier, off), 0);
    /* destroy has asked the running op to cancel before its copies land */
    for (int i = 0; i < 200000 && !atomic_load(&op->cancel); i++) {
        const struct timespec ts = {0, 100000};
        nanosleep(&ts, NULL);
    }
    assert_true(atomic_load(&op->cancel));
    kvt_softcuda_pause(false);
    assert_int_equal(pthread_join(t, NULL), 0);
    kv_offload_state st;
    assert_int_equal(kv_offload_test(op, &st), KV_OK);
    assert_int_equal(st, KV_OFFLOAD_CANCELLED);
    assert_int_equal(kvt_pool_refs(&d), refs);
    assert_int_equal(kv_offload_op_free(op), KV_OK);
    const struct kvt_softcuda_stats sc = sc_stats();
    assert_int_equal(sc.queued, 0);
    assert_int_equal(sc.tier_streams, 0);
    kvt_cache_free(&d);
}

/* ---- engine streams ----------------------------------------------------------------- */

/* The engine's streams are held (the legacy default stream and a blocking
 * stream of its own, as an engine busy with a long kernel): the tier's
 * store and load still finish, on its own non-blocking stream, and it
 * never synchronizes an engine's stream or event. */
static void test_offload_dev_engine_streams_not_blocked(void **state)
{
    (void)state;
    void *eng = kvt_softcuda_engine_stream(0, false);
    kvt_softcuda_hold(NULL);
    kvt_softcuda_hold(eng);
    kv_offload *off = mk_tier(3);
    struct kvt_cache s, d;
    mk_pair(&s, &d, 4, 71, 0x57AEA);
    uint64_t h[8];
    kv_status want[8];
    for (int i = 0; i < 8; i++) {
        h[i] = hash_of(700 + (uint64_t)i);
        want[i] = KV_OK;
    }
    kvt_store_all(off, &s, h, 8, true);
    assert_int_equal(kvt_load_check(off, &d, h, 8, want, true), KV_OFFLOAD_DONE);
    const struct kvt_softcuda_stats sc = sc_stats();
    assert_int_equal(sc.queued, 2); /* the engine's holds, still there */
    assert_int_equal(sc.engine_waits, 0);
    assert_true(sc.event_syncs >= 6);
    kvt_softcuda_release();
    kv_offload_destroy(off);
    kvt_softcuda_engine_stream_free(eng);
    kvt_cache_free(&s);
    kvt_cache_free(&d);
}

/* Store blocks ids[n] of s (held, hashed): DONE. */
static void store_ids(kv_offload *off, struct kvt_cache *s, const uint32_t *ids, uint32_t n)
{
    kv_offload_op *op = NULL;
    assert_int_equal(kv_offload_store(off, s->c, ids, n, &op), KV_OK);
    assert_int_equal(kvt_offload_finish(op), KV_OFFLOAD_DONE);
    assert_int_equal(kv_offload_op_free(op), KV_OK);
}

/* Load hash h into a new block of d: DONE; the block (held: release it). */
static uint32_t load_one(kv_offload *off, struct kvt_cache *d, uint64_t h)
{
    kv_offload_op *op = NULL;
    assert_int_equal(kv_offload_load(off, d->c, &h, 1, &op), KV_OK);
    assert_int_equal(kvt_offload_finish(op), KV_OFFLOAD_DONE);
    const struct kv_offload_result *res;
    uint32_t nr;
    assert_int_equal(kv_offload_results(op, &res, &nr), KV_OK);
    const uint32_t b = res[0].block;
    assert_int_equal(kv_offload_op_free(op), KV_OK);
    return b;
}

/* Block sb of s and block db of d (one layout) hold the same bytes, every
 * (layer, plane) unit. */
static void same_block(const struct kvt_cache *s, uint32_t sb, const struct kvt_cache *d,
                       uint32_t db)
{
    const struct kv_layout *lo = &s->pc.layout;
    for (int64_t l = 0; l < lo->num_layers; l++)
        for (int64_t k = 0; k < lo->kv_planes; k++) {
            const int64_t u = l * lo->stride_layer_bytes + k * lo->stride_kv_bytes;
            assert_int_equal(memcmp(s->base + (int64_t)sb * lo->stride_block_bytes + u,
                                    d->base + (int64_t)db * lo->stride_block_bytes + u,
                                    (size_t)lo->block_bytes),
                             0);
        }
}

/* The engine's rule for a device cache: its writes to a block have landed
 * before it posts a store of the block (the tier's stream waits for no
 * engine stream). Kept (the engine synchronized its stream): the entry
 * holds the written bytes. Broken (the write still queued behind a
 * long kernel): the GPU would store stale bytes silently; the double
 * counts the race. */
static void test_offload_dev_engine_write_race(void **state)
{
    (void)state;
    void *eng = kvt_softcuda_engine_stream(0, false);
    kv_offload *off = mk_tier(4);
    struct kvt_cache s, d;
    mk_pair(&s, &d, 6, 41, 0x4ACE);
    const struct kv_layout *lo = &s.pc.layout;
    uint64_t h[2] = {hash_of(410), hash_of(411)};
    uint32_t ids[2];
    kvt_put_blocks(&s, h, 2, ids);
    /* kept: layer 1's V of block ids[0] written, the stream synchronized */
    unsigned char *u0 = s.base + (int64_t)ids[0] * lo->stride_block_bytes + lo->stride_layer_bytes +
                        lo->stride_kv_bytes;
    kvt_softcuda_engine_write(eng, u0, (size_t)lo->block_bytes, 0x3C);
    kvt_softcuda_engine_sync(eng);
    assert_int_equal(u0[0], 0x3C);
    store_ids(off, &s, ids, 1);
    uint32_t b = load_one(off, &d, h[0]);
    same_block(&s, ids[0], &d, b);
    assert_int_equal(kv_block_pool_release(d.pool, &b, 1), KV_OK);
    assert_int_equal(sc_stats().faults, 0);
    /* broken: the write to block ids[1] queued behind a hold on the engine's
     * stream when the store is posted */
    unsigned char *u1 = s.base + (int64_t)ids[1] * lo->stride_block_bytes;
    const unsigned char was = u1[0];
    kvt_softcuda_hold(eng);
    kvt_softcuda_engine_write(eng, u1, (size_t)lo->block_bytes, (unsigned char)(was ^ 0xFF));
    store_ids(off, &s, ids + 1, 1); /* DONE: the tier cannot see it */
    assert_int_equal(sc_stats().faults, 1);
    assert_non_null(strstr(sc_stats().last_fault, "race"));
    b = load_one(off, &d, h[1]);
    assert_int_equal(d.base[(int64_t)b * lo->stride_block_bytes], was); /* the stale byte */
    assert_int_equal(kv_block_pool_release(d.pool, &b, 1), KV_OK);
    kvt_softcuda_release();
    kvt_softcuda_engine_sync(eng);
    assert_int_equal(u1[0], was ^ 0xFF);
    assert_int_equal(kv_block_pool_release(s.pool, ids, 2), KV_OK);
    kv_offload_destroy(off);
    kvt_softcuda_engine_stream_free(eng);
    kvt_cache_free(&s);
    kvt_cache_free(&d);
    double_clean(1); /* the race alone */
}

/* Rule (1) of kv_offload.h broken the other way: the engine writes a block
 * of a store after posting it, and the write lands before the tier's D2H
 * (issued, held behind a busy copy engine) runs. On a GPU the streams are
 * unordered: the entry gets the engine's new bytes (or a mix); the double
 * counts the write as a race when it runs with the copy still queued. */
static void test_offload_dev_engine_write_after_post(void **state)
{
    (void)state;
    void *eng = kvt_softcuda_engine_stream(0, false);
    kv_offload *off = mk_tier(4);
    struct kvt_cache s, d;
    mk_pair(&s, &d, 6, 43, 0x5ACE);
    const struct kv_layout *lo = &s.pc.layout;
    uint64_t h[2] = {hash_of(420), hash_of(421)};
    uint32_t ids[2];
    kvt_put_blocks(&s, h, 2, ids);
    store_ids(off, &s, ids, 1); /* the tier's stream now exists */
    assert_int_equal(sc_stats().faults, 0);
    const uint64_t issued = sc_stats().copies_issued;
    kvt_softcuda_hold(off->dev_stream[0]); /* the tier's D2H waits */
    /* layer 2's K of the stored block: one storage unit, not its start */
    unsigned char *u1 =
        s.base + (int64_t)ids[1] * lo->stride_block_bytes + 2 * lo->stride_layer_bytes;
    const unsigned char was = u1[0];
    kv_offload_op *op = NULL;
    assert_int_equal(kv_offload_store(off, s.c, ids + 1, 1, &op), KV_OK);
    wait_issued(issued + 1); /* the store's copy is queued on the tier's stream */
    /* an engine write to the other block, not in the op: no race */
    unsigned char *u0 = s.base + (int64_t)ids[0] * lo->stride_block_bytes;
    kvt_softcuda_engine_write(eng, u0, (size_t)lo->block_bytes, 0x5A);
    kvt_softcuda_engine_sync(eng);
    assert_int_equal(sc_stats().faults, 0);
    /* the engine breaks rule (1): its write lands while the store's copy
     * is still queued */
    kvt_softcuda_engine_write(eng, u1, (size_t)lo->block_bytes, (unsigned char)(was ^ 0xFF));
    kvt_softcuda_engine_sync(eng);
    const struct kvt_softcuda_stats raced = sc_stats();
    kvt_softcuda_release(); /* before asserting: nothing left held on a failure */
    assert_int_equal(kvt_offload_finish(op), KV_OFFLOAD_DONE);
    assert_int_equal(kv_offload_op_free(op), KV_OK);
    assert_int_equal(raced.faults, 1);
    assert_non_null(strstr(raced.last_fault, "race: an engine write"));
    assert_non_null(strstr(raced.last_fault, "rules 1 and 2"));
    uint32_t b = load_one(off, &d, h[1]);
    /* what the GPU may do silently: the entry holds the engine's bytes */
    assert_int_equal(d.base[(int64_t)b * lo->stride_block_bytes + 2 * lo->stride_layer_bytes],
                     was ^ 0xFF);
    assert_int_equal(kv_block_pool_release(d.pool, &b, 1), KV_OK);
    assert_int_equal(kv_block_pool_release(s.pool, ids, 2), KV_OK);
    kv_offload_destroy(off);
    kvt_softcuda_engine_stream_free(eng);
    kvt_cache_free(&s);
    kvt_cache_free(&d);
    double_clean(1); /* the race alone, counted once */
}

/* ---- a failing CUDA call --------------------------------------------------------- */

/* The double's table with its copy failing on call fail_at (counted from
 * 1), as a CUDA error would. */
static atomic_int copy_calls, copy_fail_at;
static kv_status failing_copy(int device, const kv_plan *plan, const struct kv_paged_cache *src,
                              uint32_t sb, const struct kv_paged_cache *dst, uint32_t db,
                              uint64_t n_tokens, void *stream)
{
    if (atomic_fetch_add(&copy_calls, 1) + 1 == atomic_load(&copy_fail_at))
        return kv__error(KV_ERR_DEVICE, "injected: cudaMemcpy2DAsync failed");
    return kvt_softcuda_ops()->copy(device, plan, src, sb, dst, db, n_tokens, stream);
}

/* A failed copy fails its chunk's entries with KV_ERR_DEVICE (a store's
 * entries dropped, a load's blocks released uncommitted), the copies
 * issued before it are still waited for, the other chunks go on; a
 * duplicate of a dropped entry in the same store fails with it. */
static void test_offload_dev_copy_failure(void **state)
{
    (void)state;
    struct kv__offdev_ops ops = *kvt_softcuda_ops();
    ops.copy = failing_copy;
    kv__offdev_set(&ops);
    kv_offload *off = mk_tier(2);
    kv__offdev_set(kvt_softcuda_ops()); /* the tier keeps the one it was made with */
    struct kvt_cache s, d;
    mk_pair(&s, &d, 4, 91, 0xFA11ED);
    uint64_t h[4];
    uint32_t ids[4];
    for (int i = 0; i < 4; i++)
        h[i] = hash_of(900 + (uint64_t)i);
    kvt_put_blocks(&s, h, 4, ids);
    unsigned char *snap = malloc(s.bytes);
    assert_non_null(snap);
    memcpy(snap, s.base, s.bytes);
    atomic_store(&copy_calls, 0);
    atomic_store(&copy_fail_at, 2); /* the second copy of the first chunk */
    kv_offload_op *op = NULL;
    assert_int_equal(kv_offload_store(off, s.c, ids, 4, &op), KV_OK);
    assert_int_equal(kvt_offload_finish(op), KV_OFFLOAD_FAILED);
    const struct kv_offload_result *res;
    uint32_t nr;
    assert_int_equal(kv_offload_results(op, &res, &nr), KV_OK);
    const kv_status want_store[4] = {KV_ERR_DEVICE, KV_ERR_DEVICE, KV_OK, KV_OK};
    for (int i = 0; i < 4; i++) {
        assert_int_equal(res[i].status, want_store[i]);
        assert_int_equal(kv_offload_contains(off, s.c, h[i]), want_store[i] == KV_OK);
    }
    assert_int_equal(kv_offload_op_free(op), KV_OK);
    assert_int_equal(kvt_first_diff(snap, s.base, (int64_t)s.bytes), -1);
    struct kv_offload_stats os;
    assert_int_equal(kv_offload_stats_get(off, &os), KV_OK);
    assert_int_equal(os.entries, 2);
    assert_int_equal(os.stores, 2);
    assert_int_equal(sc_stats().queued, 0);

    /* load h[2], h[3] (one chunk): the second H2D fails, so both blocks of
     * the chunk are released uncommitted (the first copy landed before) */
    atomic_store(&copy_calls, 0);
    atomic_store(&copy_fail_at, 2);
    const uint64_t refs = kvt_pool_refs(&d);
    assert_int_equal(kv_offload_load(off, d.c, h + 2, 2, &op), KV_OK);
    assert_int_equal(kvt_offload_finish(op), KV_OFFLOAD_FAILED);
    assert_int_equal(kv_offload_results(op, &res, &nr), KV_OK);
    for (int i = 0; i < 2; i++) {
        assert_int_equal(res[i].status, KV_ERR_DEVICE);
        assert_int_equal(res[i].block, KV_BLOCK_NULL);
    }
    assert_int_equal(kvt_pool_refs(&d), refs);
    assert_int_equal(kv_offload_op_free(op), KV_OK);
    assert_int_equal(sc_stats().queued, 0);
    /* the entries stay: a load without the failure gets them */
    atomic_store(&copy_fail_at, 0);
    const kv_status want_load[2] = {KV_OK, KV_OK};
    assert_int_equal(kvt_load_check(off, &d, h + 2, 2, want_load, true), KV_OFFLOAD_DONE);
    /* the same block twice in one store, its first copy failing: the
     * duplicate found the entry being written and was reported KV_OK
     * although the entry went with the failure; both fail now */
    uint64_t h5 = hash_of(905);
    uint32_t id5;
    kvt_put_blocks(&s, &h5, 1, &id5);
    const uint32_t twice[2] = {id5, id5};
    atomic_store(&copy_calls, 0);
    atomic_store(&copy_fail_at, 1);
    assert_int_equal(kv_offload_store(off, s.c, twice, 2, &op), KV_OK);
    assert_int_equal(kvt_offload_finish(op), KV_OFFLOAD_FAILED);
    assert_int_equal(kv_offload_results(op, &res, &nr), KV_OK);
    assert_int_equal(res[0].status, KV_ERR_DEVICE);
    assert_int_equal(res[1].status, KV_ERR_DEVICE);
    assert_false(kv_offload_contains(off, s.c, h5));
    assert_int_equal(kv_offload_op_free(op), KV_OK);
    atomic_store(&copy_fail_at, 0);
    assert_int_equal(kv_block_pool_release(s.pool, &id5, 1), KV_OK);
    assert_int_equal(kv_block_pool_release(s.pool, ids, 4), KV_OK);
    free(snap);
    free_pair(off, &s, &d);
}

/* ---- the wait itself failing ----------------------------------------------------- */

/* The double's table with its event record or synchronize failing (as a
 * transient CUDA error would: the copies before it still run) while
 * wait_fail is set, and its stream synchronize too while stream_fail is
 * set; wait_fails counts the injected failures. */
static atomic_int wait_fail, stream_fail, wait_fails;
enum { FAIL_RECORD = 1, FAIL_SYNC = 2 };
static kv_status failing_record(int device, void *event, void *stream)
{
    if (atomic_load(&wait_fail) == FAIL_RECORD) {
        atomic_fetch_add(&wait_fails, 1);
        return kv__error(KV_ERR_DEVICE,
                         "injected: cudaEventRecord: cudaErrorInvalidResourceHandle");
    }
    return kvt_softcuda_ops()->event_record(device, event, stream);
}
static kv_status failing_sync(int device, void *event)
{
    if (atomic_load(&wait_fail) == FAIL_SYNC) {
        atomic_fetch_add(&wait_fails, 1);
        return kv__error(KV_ERR_DEVICE, "injected: cudaEventSynchronize: cudaErrorUnknown");
    }
    return kvt_softcuda_ops()->event_sync(device, event);
}
static kv_status failing_stream_sync(int device, void *stream)
{
    if (atomic_load(&stream_fail))
        return kv__error(KV_ERR_DEVICE, "injected: cudaStreamSynchronize: cudaErrorUnknown");
    return kvt_softcuda_ops()->stream_sync(device, stream);
}

/* A tier over the double with the failing wait of this section. */
static kv_offload *mk_wait_failing_tier(uint32_t chunk)
{
    static struct kv__offdev_ops ops;
    ops = *kvt_softcuda_ops();
    ops.event_record = failing_record;
    ops.event_sync = failing_sync;
    ops.stream_sync = failing_stream_sync;
    atomic_store(&wait_fail, 0);
    atomic_store(&stream_fail, 0);
    atomic_store(&wait_fails, 0);
    kv__offdev_set(&ops);
    kv_offload *off = mk_tier(chunk);
    kv__offdev_set(kvt_softcuda_ops());
    return off;
}

/* Until the injected failures reach n (bounded). */
static void wait_wait_fails(int n)
{
    for (int i = 0; i < 200000 && atomic_load(&wait_fails) < n; i++) {
        const struct timespec ts = {0, 100000};
        nanosleep(&ts, NULL);
    }
    assert_true(atomic_load(&wait_fails) >= n);
}

/* Until the double's streams ran everything (bounded). */
static void wait_drained(void)
{
    for (int i = 0; i < 200000 && sc_stats().queued > 0; i++) {
        const struct timespec ts = {0, 100000};
        nanosleep(&ts, NULL);
    }
    assert_int_equal(sc_stats().queued, 0);
}

/* A store op ended: each of its n entries KV_ERR_DEVICE and not in the
 * tier (hashes h, cache t); the op freed. */
static void store_failed_free(kv_offload *off, kv_offload_op *op, struct kvt_cache *t,
                              const uint64_t *h, uint32_t n)
{
    const struct kv_offload_result *res;
    uint32_t nr;
    assert_int_equal(kv_offload_results(op, &res, &nr), KV_OK);
    assert_int_equal(nr, n);
    for (uint32_t i = 0; i < n; i++) {
        assert_int_equal(res[i].status, KV_ERR_DEVICE);
        assert_false(kv_offload_contains(off, t->c, h[i]));
    }
    assert_int_equal(kv_offload_op_free(op), KV_OK);
}

/* The event record or synchronize fails while the chunk's D2H copies are
 * still queued: the worker waits for its stream instead, so the op stays
 * RUNNING until they landed; then the chunk fails KV_ERR_DEVICE as for a
 * failed copy (its entries freed only now) and the tier goes on. */
static void test_offload_dev_wait_failure_stream_sync(void **state)
{
    (void)state;
    for (int mode = FAIL_RECORD; mode <= FAIL_SYNC; mode++) {
        kv_offload *off = mk_wait_failing_tier(2);
        struct kvt_cache s, d;
        mk_pair(&s, &d, 4, 97 + (uint64_t)mode, 0x3A17);
        uint64_t h[2] = {hash_of(980 + (uint64_t)mode * 2), hash_of(981 + (uint64_t)mode * 2)};
        uint32_t ids[2];
        kvt_put_blocks(&s, h, 2, ids);
        kvt_softcuda_pause(true);
        atomic_store(&wait_fail, mode);
        kv_offload_op *op = NULL;
        assert_int_equal(kv_offload_store(off, s.c, ids, 2, &op), KV_OK);
        wait_wait_fails(1);
        atomic_store(&wait_fail, 0);
        kv_offload_state st = KV_OFFLOAD_PENDING;
        const kv_status waited = kv_offload_wait(op, 20, &st); /* the copies are held */
        const uint64_t queued = sc_stats().queued;
        kvt_softcuda_pause(false);
        assert_int_equal(waited, KV_ERR_TIMEOUT);
        assert_int_equal(st, KV_OFFLOAD_RUNNING);
        assert_int_equal(queued, mode == FAIL_SYNC ? 3 : 2); /* the copies (and the record) */
        assert_int_equal(kvt_offload_finish(op), KV_OFFLOAD_FAILED);
        assert_int_equal(sc_stats().queued, 0);
        store_failed_free(off, op, &s, h, 2);
        struct kv_offload_stats os;
        assert_int_equal(kv_offload_stats_get(off, &os), KV_OK);
        assert_int_equal(os.entries, 0);
        assert_int_equal(os.bytes, 0); /* freed once the copies landed */
        /* the stream is fine: the same store and a load now succeed */
        store_ids(off, &s, ids, 2);
        const kv_status want[2] = {KV_OK, KV_OK};
        assert_int_equal(kvt_load_check(off, &d, h, 2, want, true), KV_OFFLOAD_DONE);
        assert_int_equal(kv_block_pool_release(s.pool, ids, 2), KV_OK);
        free_pair(off, &s, &d);
    }
}

/* The wait and the stream synchronize both fail while a store's D2H copies
 * are still queued: the op ends FAILED at once, but the chunk's region
 * pieces stay out of the free pool (still counted in bytes): a store from a
 * host cache meanwhile gets other pieces, and the late D2H, when it lands,
 * corrupts nothing (a reuse would fail that entry's checksum at load). The
 * tier's stream is unusable from then on: device ops fail KV_ERR_DEVICE
 * without issuing anything; host ops go on. Then the same for a load: its
 * blocks stay held (not back in the pool, where the engine could get them
 * while the H2D still writes them) until the tier is destroyed. */
static void test_offload_dev_wait_failure_quarantine(void **state)
{
    (void)state;
    for (int mode = FAIL_RECORD; mode <= FAIL_SYNC; mode++) {
        kv_offload *off = mk_wait_failing_tier(2);
        struct kvt_cache s, d, hc, hd;
        mk_pair(&s, &d, 5, 101 + (uint64_t)mode, 0x9A4A);
        mk_cache(&hc, KV_MEM_HOST, 5, 111 + (uint64_t)mode);
        mk_cache(&hd, KV_MEM_HOST, 5, 121 + (uint64_t)mode);
        uint64_t h[2], hh[2];
        for (int i = 0; i < 2; i++) {
            h[i] = hash_of(1000 + (uint64_t)(mode * 10 + i));
            hh[i] = hash_of(1100 + (uint64_t)(mode * 10 + i));
        }
        uint32_t ids[2];
        kvt_put_blocks(&s, h, 2, ids);
        kvt_softcuda_pause(true);
        atomic_store(&wait_fail, mode);
        atomic_store(&stream_fail, 1);
        kv_offload_op *op = NULL;
        assert_int_equal(kv_offload_store(off, s.c, ids, 2, &op), KV_OK);
        const kv_offload_state fin = kvt_offload_finish(op);
        atomic_store(&wait_fail, 0);
        const uint64_t queued = sc_stats().queued;
        struct kv_offload_stats os;
        assert_int_equal(kv_offload_stats_get(off, &os), KV_OK);
        /* a host store while the D2H copies are still queued */
        kvt_store_all(off, &hc, hh, 2, true);
        kvt_softcuda_pause(false);
        wait_drained();
        assert_int_equal(fin, KV_OFFLOAD_FAILED);
        assert_int_equal(queued, mode == FAIL_SYNC ? 3 : 2);
        store_failed_free(off, op, &s, h, 2);
        /* the late D2H landed in its own pieces: the host entries are intact */
        const kv_status want[2] = {KV_OK, KV_OK};
        assert_int_equal(kvt_load_check(off, &hd, hh, 2, want, true), KV_OFFLOAD_DONE);
        assert_int_equal(os.entries, 0);
        assert_true(os.bytes > 0); /* the pieces the copies may write, kept */
        /* device ops are refused now: nothing issued */
        const uint64_t issued = sc_stats().copies_issued;
        const kv_status refused[2] = {KV_ERR_DEVICE, KV_ERR_DEVICE};
        assert_int_equal(kvt_load_check(off, &d, hh, 2, refused, true), KV_OFFLOAD_FAILED);
        assert_int_equal(sc_stats().copies_issued, issued);
        atomic_store(&stream_fail, 0);
        assert_int_equal(kv_block_pool_release(s.pool, ids, 2), KV_OK);
        kv_offload_destroy(off);
        kvt_cache_free(&hc);
        kvt_cache_free(&hd);

        /* a load: its first chunk's blocks held until destroy */
        off = mk_wait_failing_tier(2);
        for (int i = 0; i < 2; i++)
            h[i] = hash_of(1200 + (uint64_t)(mode * 10 + i));
        kvt_store_all(off, &s, h, 2, true);
        const uint64_t refs = kvt_pool_refs(&d);
        kvt_softcuda_pause(true);
        atomic_store(&wait_fail, mode);
        atomic_store(&stream_fail, 1);
        assert_int_equal(kv_offload_load(off, d.c, h, 2, &op), KV_OK);
        const kv_offload_state lfin = kvt_offload_finish(op);
        atomic_store(&wait_fail, 0);
        const uint64_t held = kvt_pool_refs(&d);
        kvt_softcuda_pause(false);
        wait_drained();
        atomic_store(&stream_fail, 0);
        assert_int_equal(lfin, KV_OFFLOAD_FAILED);
        assert_int_equal(held, refs + 2); /* not back in the pool */
        const struct kv_offload_result *res;
        uint32_t nr;
        assert_int_equal(kv_offload_results(op, &res, &nr), KV_OK);
        for (int i = 0; i < 2; i++) {
            assert_int_equal(res[i].status, KV_ERR_DEVICE);
            assert_int_equal(res[i].block, KV_BLOCK_NULL);
        }
        assert_int_equal(kv_offload_op_free(op), KV_OK);
        kv_offload_destroy(off);
        assert_int_equal(kvt_pool_refs(&d), refs); /* given back at destroy */
        kvt_cache_free(&s);
        kvt_cache_free(&d);
    }
}

/* ---- a sticky error ---------------------------------------------------------------- */

/* The context dies (a sticky error) while a load's first chunk is in flight:
 * its copies are dropped, the wait and the stream synchronize return the
 * error, every entry of the load fails KV_ERR_DEVICE, the first chunk's
 * blocks kept until destroy and the others released, the WHOLE pool as it
 * was; a later store fails every entry without issuing and adds none;
 * destroy returns (the stream and event released with the error, the kept
 * blocks given back). */
static void test_offload_dev_sticky_error(void **state)
{
    (void)state;
    kv_offload *off = mk_tier(2);
    struct kvt_cache s, d;
    mk_pair(&s, &d, 5, 95, 0x571C4);
    enum { NB = 6 };
    uint64_t h[NB], h2[NB];
    for (int i = 0; i < NB; i++) {
        h[i] = hash_of(950 + (uint64_t)i);
        h2[i] = hash_of(970 + (uint64_t)i);
    }
    kvt_store_all(off, &s, h, NB, true);
    unsigned char *snap = malloc(d.bytes);
    assert_non_null(snap);
    memcpy(snap, d.base, d.bytes);
    const uint64_t refs = kvt_pool_refs(&d);
    kvt_softcuda_pause(true);
    const uint64_t i0 = sc_stats().copies_issued;
    kv_offload_op *op = NULL;
    assert_int_equal(kv_offload_load(off, d.c, h, NB, &op), KV_OK);
    wait_issued(i0 + 2); /* the first chunk's copies, queued */
    kvt_softcuda_sticky("cudaErrorIllegalAddress (injected)");
    assert_int_equal(kvt_offload_finish(op), KV_OFFLOAD_FAILED);
    const struct kv_offload_result *res;
    uint32_t nr;
    assert_int_equal(kv_offload_results(op, &res, &nr), KV_OK);
    for (int i = 0; i < NB; i++) {
        assert_int_equal(res[i].status, KV_ERR_DEVICE);
        assert_int_equal(res[i].block, KV_BLOCK_NULL);
    }
    assert_int_equal(kv_offload_op_free(op), KV_OK);
    /* the first chunk's two blocks are kept until destroy (the wait and the
     * stream synchronize failed: nothing says their H2D stopped) */
    assert_int_equal(kvt_pool_refs(&d), refs + 2);
    assert_int_equal(kvt_first_diff(snap, d.base, (int64_t)d.bytes), -1);
    assert_int_equal(sc_stats().copies_done, i0); /* nothing ran */
    /* a store now: every entry fails (nothing issued), none is added, the
     * blocks go back */
    uint32_t ids[NB];
    kvt_put_blocks(&s, h2, NB, ids);
    const uint64_t srefs = kvt_pool_refs(&s);
    assert_int_equal(kv_offload_store(off, s.c, ids, NB, &op), KV_OK);
    assert_int_equal(kvt_offload_finish(op), KV_OFFLOAD_FAILED);
    assert_int_equal(kv_offload_results(op, &res, &nr), KV_OK);
    for (int i = 0; i < NB; i++) {
        assert_int_equal(res[i].status, KV_ERR_DEVICE);
        assert_false(kv_offload_contains(off, s.c, h2[i]));
    }
    assert_int_equal(kv_offload_op_free(op), KV_OK);
    assert_int_equal(kvt_pool_refs(&s), srefs);
    struct kv_offload_stats os;
    assert_int_equal(kv_offload_stats_get(off, &os), KV_OK);
    assert_int_equal(os.entries, NB); /* the first store's, kept */
    assert_int_equal(os.failed_ops, 2);
    assert_int_equal(kv_block_pool_release(s.pool, ids, NB), KV_OK);
    const uint64_t issued = sc_stats().copies_issued;
    kv_offload_destroy(off);
    kvt_softcuda_pause(false);
    assert_int_equal(sc_stats().copies_issued, issued); /* the store issued nothing */
    assert_int_equal(kvt_pool_refs(&d), refs);          /* given back at destroy */
    assert_int_equal(sc_stats().tier_streams, 0);
    kvt_cache_free(&s);
    kvt_cache_free(&d);
    free(snap);
}

/* ---- refusals at post -------------------------------------------------------------- */

static void test_offload_dev_refusals(void **state)
{
    (void)state;
    struct kv_offload_config cfg = KV_OFFLOAD_CONFIG_INIT;
    cfg.capacity_bytes = (size_t)1 << 20;
    cfg.mem = KV_OFFLOAD_MEM_HOST;
    cfg.threads = 1;
    kv_offload *off = NULL;
    assert_int_equal(kv_offload_create(&cfg, &off), KV_OK);
    struct kvt_cache s;
    mk_cache(&s, KV_MEM_DEVICE, 4, 81);
    uint64_t h = hash_of(800);
    uint32_t id;
    kvt_put_blocks(&s, &h, 1, &id);
    const uint64_t refs = kvt_pool_refs(&s);
    kv_offload_op *op = NULL;
    assert_int_equal(kv_offload_store(off, s.c, &id, 1, &op), KV_ERR_UNSUPPORTED);
    assert_non_null(strstr(kv_last_error(), "pinned"));
    assert_null(op);
    assert_int_equal(kv_offload_load(off, s.c, &h, 1, &op), KV_ERR_UNSUPPORTED);
    assert_int_equal(kvt_pool_refs(&s), refs);
    assert_int_equal(sc_stats().copies_issued, 0);
    assert_int_equal(kv_block_pool_release(s.pool, &id, 1), KV_OK);
    kv_offload_destroy(off);
    kvt_cache_free(&s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_softcuda_refuses, setup_double, NULL),
        cmocka_unit_test_setup_teardown(test_offload_dev_round_trip, setup_double, teardown_double),
        cmocka_unit_test_setup_teardown(test_offload_dev_corrupt_before_h2d, setup_double,
                                        teardown_double),
        cmocka_unit_test_setup_teardown(test_offload_dev_cancel_in_flight, setup_double,
                                        teardown_double),
        cmocka_unit_test_setup_teardown(test_offload_dev_destroy_order, setup_double,
                                        teardown_double),
        cmocka_unit_test_setup_teardown(test_offload_dev_engine_streams_not_blocked, setup_double,
                                        teardown_double),
        cmocka_unit_test_setup_teardown(test_offload_dev_engine_write_race, setup_double, NULL),
        cmocka_unit_test_setup_teardown(test_offload_dev_engine_write_after_post, setup_double,
                                        NULL),
        cmocka_unit_test_setup_teardown(test_offload_dev_copy_failure, setup_double,
                                        teardown_double),
        cmocka_unit_test_setup_teardown(test_offload_dev_wait_failure_stream_sync, setup_double,
                                        teardown_double),
        cmocka_unit_test_setup_teardown(test_offload_dev_wait_failure_quarantine, setup_double,
                                        teardown_double),
        cmocka_unit_test_setup_teardown(test_offload_dev_sticky_error, setup_double,
                                        teardown_double),
        cmocka_unit_test_setup_teardown(test_offload_dev_refusals, setup_double, teardown_double),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
