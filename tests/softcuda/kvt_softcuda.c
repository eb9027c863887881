/*
 * kvt_softcuda.c - the CUDA double of kvt_softcuda.h. One mutex (mu)
 * guards everything; each stream's thread runs its items in order, under
 * the legacy-stream rule, and broadcasts cv after each.
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "allocator_int.h"
#include "kv_lib.h"
#include "kv_plan_grid_int.h"
#include "kvt_softcuda.h"

enum { ALLOC_DEVICE = 1, ALLOC_PINNED = 2 };

struct alloc {
    char *base;
    size_t bytes;
    int kind, device;
    uint32_t users; /* queued copies that touch it */
    struct alloc *next;
};

enum { ITEM_COPY = 1, ITEM_EVENT = 2, ITEM_HOLD = 3, ITEM_WRITE = 4 };

struct stream;
struct event {
    int device;
    pthread_t owner; /* the thread that made it: the only one that may use it */
    bool destroyed;
    uint64_t recorded;  /* records made (0: never recorded) */
    uint64_t done;      /* records the stream ran */
    bool on_engine;     /* the last record was on an engine stream */
    uint32_t queued;    /* records queued, not run */
    struct event *next; /* every event made, freed at uninstall (a destroyed one
                           stays, marked, so a use after destroy is seen) */
};

struct item {
    int kind;
    uint64_t seq; /* global order of issue (the legacy-stream rule) */
    struct kv__plan_sched sched;
    struct alloc *a[2];
    /* copy: its device sides (cache and block), for the race check */
    struct kv_paged_cache dev[2];
    uint32_t dev_block[2];
    int n_dev;
    /* engine write: [p, p + bytes) set to value */
    char *p;
    size_t bytes;
    unsigned char value;
    struct event *ev;
    uint64_t gen; /* hold: released when release_gen > gen */
    struct item *next;
};

struct stream {
    int device;
    bool blocking;   /* waits for, and is waited for by, the legacy stream */
    bool tier;       /* made through the seam */
    pthread_t owner; /* tier: the thread that made it, the only one that may use it */
    bool destroyed, stop;
    struct item *head, *tail;
    pthread_t thread;
    struct stream *next;
};

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static struct alloc *allocs;
static struct stream *streams; /* every live stream, the legacy one included */
static struct stream *legacy;
static struct event *events;
static uint64_t seq_next = 1, release_gen;
static bool paused;
static bool sticky; /* a sticky error: the context is unusable */
static char sticky_why[96];
static struct kvt_softcuda_stats st;

/* mu held. */
static kv_status fault(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(st.last_fault, sizeof(st.last_fault), fmt, ap);
    va_end(ap);
    st.faults++;
    return kv__error(KV_ERR_DEVICE, "softcuda: %s", st.last_fault);
}

/* mu held: the error every call returns once the context is unusable. */
static kv_status sticky_error(const char *what)
{
    return kv__error(KV_ERR_DEVICE, "softcuda: %s: %s (sticky: the context is unusable)", what,
                     sticky_why);
}

/* The live allocation holding [p, p + bytes) entirely, of kind; NULL. */
static struct alloc *alloc_find(const void *p, size_t bytes, int kind)
{
    for (struct alloc *a = allocs; a; a = a->next)
        if ((const char *)p >= a->base && (const char *)p + bytes <= a->base + a->bytes)
            return a->kind == kind ? a : NULL;
    return NULL;
}

static bool stream_live(const struct stream *s)
{
    for (const struct stream *x = streams; x; x = x->next)
        if (x == s)
            return !s->destroyed;
    return false;
}

/* mu held: KV_OK when the calling thread made the tier's stream s (NULL:
 * not checked) and event e (NULL: not checked). Every entry of the CUDA
 * table sets the calling thread's device (cudaSetDevice) and leaves it so:
 * a tier's stream or event used from another thread, an engine's, would
 * move that thread's current device under it. CUDA itself accepts the call
 * (the handle knows its device); the double refuses it. */
static kv_status same_thread(const char *what, const struct stream *s, const struct event *e)
{
    const pthread_t me = pthread_self();
    if (s && s->tier && !pthread_equal(s->owner, me))
        return fault("%s on a thread other than the one that made the stream (the CUDA "
                     "table's cudaSetDevice would move that thread's current device)",
                     what);
    if (e && !pthread_equal(e->owner, me))
        return fault("%s on a thread other than the one that made the event (the CUDA "
                     "table's cudaSetDevice would move that thread's current device)",
                     what);
    return KV_OK;
}

/* ---- memory (allocator_int.h) ------------------------------------------ */

static kv_status mem_alloc(int kind, int device, size_t bytes, void **out)
{
    struct alloc *a = calloc(1, sizeof(*a));
    void *p = NULL;
    if (!a || posix_memalign(&p, 256, bytes ? bytes : 1) != 0) {
        free(a);
        return kv__error(KV_ERR_NO_MEMORY, "softcuda: %zu bytes", bytes);
    }
    memset(p, 0xA5, bytes); /* cudaMalloc does not zero */
    *a = (struct alloc){.base = p, .bytes = bytes, .kind = kind, .device = device};
    pthread_mutex_lock(&mu);
    a->next = allocs;
    allocs = a;
    st.allocs++;
    pthread_mutex_unlock(&mu);
    *out = p;
    return KV_OK;
}

static void mem_free(int kind, void *p)
{
    if (!p)
        return;
    pthread_mutex_lock(&mu);
    struct alloc **pp = &allocs;
    while (*pp && (*pp)->base != (char *)p)
        pp = &(*pp)->next;
    struct alloc *a = *pp;
    if (!a || a->kind != kind) {
        fault("free of %p: not a live %s allocation", p,
              kind == ALLOC_DEVICE ? "device" : "pinned");
    } else if (a->users > 0) {
        fault("free of %p (%zu bytes) while %u queued copies use it", p, a->bytes, a->users);
        a = NULL; /* kept: the copies run on it (the fault is the finding) */
    } else {
        *pp = a->next;
        st.allocs--;
    }
    pthread_mutex_unlock(&mu);
    if (a && a->kind == kind) {
        free(a->base);
        free(a);
    }
}

static kv_status host_alloc(size_t bytes, void **out)
{
    return mem_alloc(ALLOC_PINNED, -1, bytes, out);
}
static void host_free(void *p)
{
    mem_free(ALLOC_PINNED, p);
}
static kv_status device_alloc(int device, size_t bytes, void **out)
{
    return mem_alloc(ALLOC_DEVICE, device, bytes, out);
}
static void device_free(int device, void *p)
{
    (void)device;
    mem_free(ALLOC_DEVICE, p);
}

static const struct kv__arena_cuda_mem arena_mem = {host_alloc, host_free, device_alloc,
                                                    device_free};

/* ---- streams ------------------------------------------------------------- */

/* mu held: may s's head item run now? */
static bool can_run(const struct stream *s)
{
    const struct item *it = s->head;
    if (!it)
        return false;
    if (sticky)
        return true; /* abandoned (stream_main) */
    if (paused)
        return false;
    if (it->kind == ITEM_HOLD && release_gen <= it->gen)
        return false;
    if (!s->blocking)
        return true;
    /* the legacy rule: an earlier item on the other side runs first */
    for (const struct stream *o = streams; o; o = o->next) {
        if (o == s || !o->blocking || !o->head)
            continue;
        if ((s == legacy || o == legacy) && o->head->seq < it->seq)
            return false;
    }
    return true;
}

/* Does block b of device cache c (each (layer, plane) storage unit of it)
 * meet [p, p + n)? */
static bool block_meets(const struct kv_paged_cache *c, uint32_t b, const char *p, size_t n)
{
    const struct kv_layout *lo = &c->layout;
    for (int64_t l = 0; l < lo->num_layers; l++)
        for (int64_t k = 0; k < lo->kv_planes; k++) {
            const char *u = (const char *)c->base + (int64_t)b * lo->stride_block_bytes +
                            l * lo->stride_layer_bytes + k * lo->stride_kv_bytes;
            if (u < p + n && p < u + lo->block_bytes)
                return true;
        }
    return false;
}

/* mu held, copy it about to run: an engine write issued before it (a
 * smaller seq) to a block it reads or writes, not run yet, is a race the
 * GPU would lose silently (the tier's non-blocking stream does not wait
 * for an engine's stream, the legacy one included): a fault. */
static void race_check(const struct item *it)
{
    for (const struct stream *o = streams; o; o = o->next) {
        if (o->tier)
            continue;
        for (const struct item *w = o->head; w; w = w->next) {
            if (w->kind != ITEM_WRITE || w->seq > it->seq)
                continue;
            for (int d = 0; d < it->n_dev; d++)
                if (block_meets(&it->dev[d], it->dev_block[d], w->p, w->bytes))
                    fault("race: the tier's copy of device block %u ran before engine work "
                          "issued earlier on stream %p (a write of %zu bytes at %p) landed: "
                          "the tier's stream does not wait for an engine's",
                          it->dev_block[d], (const void *)o, w->bytes, (const void *)w->p);
        }
    }
}

/* mu held, engine write w about to run: a copy of the tier still queued
 * (or running) whatever its seq, on a device block w meets, breaks offload
 * rule (1) or (2) of kv_offload.h (a store's blocks are not written from
 * post to end, a load's not touched until it is terminal): on a GPU the
 * streams are unordered, the copy gets the engine's bytes or a mix: a
 * fault. (A copy that runs first with w queued is race_check's.) */
static void write_race_check(const struct item *w)
{
    for (const struct stream *o = streams; o; o = o->next) {
        if (!o->tier)
            continue;
        for (const struct item *it = o->head; it; it = it->next) {
            if (it->kind != ITEM_COPY)
                continue;
            for (int d = 0; d < it->n_dev; d++)
                if (block_meets(&it->dev[d], it->dev_block[d], w->p, w->bytes))
                    fault("race: an engine write of %zu bytes at %p ran while the tier's copy of "
                          "device block %u was queued on stream %p: the engine wrote a block of "
                          "an op before it ended (kv_offload.h rules 1 and 2)",
                          w->bytes, (const void *)w->p, it->dev_block[d], (const void *)o);
        }
    }
}

static void *stream_main(void *arg)
{
    struct stream *s = arg;
    pthread_mutex_lock(&mu);
    for (;;) {
        while (!(s->stop && !s->head) && !can_run(s))
            pthread_cond_wait(&cv, &mu);
        if (s->stop && !s->head)
            break;
        struct item *it = s->head;
        if (it->kind == ITEM_COPY && !sticky)
            race_check(it);
        if (it->kind == ITEM_WRITE && !sticky)
            write_race_check(it);
        if (sticky) { /* a dead context runs nothing more: the work is dropped */
            if (it->kind == ITEM_COPY || it->kind == ITEM_WRITE)
                it->a[0]->users--;
            if (it->kind == ITEM_COPY)
                it->a[1]->users--;
            if (it->kind == ITEM_EVENT)
                it->ev->queued--;
        } else if (it->kind == ITEM_WRITE) {
            pthread_mutex_unlock(&mu);
            memset(it->p, it->value, it->bytes);
            pthread_mutex_lock(&mu);
            it->a[0]->users--;
        } else if (it->kind == ITEM_COPY) {
            pthread_mutex_unlock(&mu);
            const kv_status r = kv__grid_plan_copy(&it->sched); /* the kernel body */
            pthread_mutex_lock(&mu);
            if (r != KV_OK)
                fault("a copy faulted on the device: %s", kv_last_error());
            it->a[0]->users--;
            it->a[1]->users--;
            st.copies_done++;
        } else if (it->kind == ITEM_EVENT) {
            it->ev->done++;
            it->ev->queued--;
        }
        s->head = it->next;
        if (!s->head)
            s->tail = NULL;
        st.queued--;
        pthread_cond_broadcast(&cv);
        pthread_mutex_unlock(&mu);
        if (it->kind == ITEM_COPY)
            kv__plan_sched_free(&it->sched);
        free(it);
        pthread_mutex_lock(&mu);
    }
    pthread_mutex_unlock(&mu);
    return NULL;
}

static struct stream *stream_new(int device, bool blocking, bool tier)
{
    struct stream *s = calloc(1, sizeof(*s));
    if (!s)
        return NULL;
    s->device = device;
    s->blocking = blocking;
    s->tier = tier;
    s->owner = pthread_self();
    pthread_mutex_lock(&mu);
    s->next = streams;
    streams = s;
    if (tier)
        st.tier_streams++;
    pthread_mutex_unlock(&mu);
    if (pthread_create(&s->thread, NULL, stream_main, s) != 0)
        abort();
    return s;
}

/* Stop s (its queue run first) and free it. */
static void stream_end(struct stream *s)
{
    pthread_mutex_lock(&mu);
    s->stop = true;
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
    pthread_join(s->thread, NULL);
    pthread_mutex_lock(&mu);
    struct stream **pp = &streams;
    while (*pp != s)
        pp = &(*pp)->next;
    *pp = s->next;
    if (s->tier)
        st.tier_streams--;
    pthread_mutex_unlock(&mu);
    free(s);
}

/* mu held: append it to s. */
static void enqueue(struct stream *s, struct item *it)
{
    it->seq = seq_next++;
    if (s->tail)
        s->tail->next = it;
    else
        s->head = it;
    s->tail = it;
    st.queued++;
    pthread_cond_broadcast(&cv);
}

/* ---- the seam ------------------------------------------------------------ */

static kv_status sc_stream_create(int device, void **stream)
{
    /* cudaStreamNonBlocking: the tier's own stream never waits for the
     * legacy default stream an engine may use */
    pthread_mutex_lock(&mu);
    const kv_status r = sticky ? sticky_error("cudaStreamCreateWithFlags") : KV_OK;
    pthread_mutex_unlock(&mu);
    if (r != KV_OK)
        return r;
    struct stream *s = stream_new(device, false, true);
    if (!s)
        return kv__error(KV_ERR_NO_MEMORY, "softcuda: a stream");
    *stream = s;
    return KV_OK;
}

static kv_status sc_stream_destroy(int device, void *stream)
{
    struct stream *s = stream;
    pthread_mutex_lock(&mu);
    kv_status r = KV_OK;
    if (!stream_live(s))
        r = fault("cudaStreamDestroy of a stream not live (%p)", stream);
    else if (s->device != device)
        r = fault("cudaStreamDestroy on device %d of a stream of device %d", device, s->device);
    else if ((r = same_thread("cudaStreamDestroy", s, NULL)) != KV_OK)
        ;
    else if (s->head && !sticky)
        r = fault("cudaStreamDestroy with work queued (the tier waits for its events first)");
    const bool gone = r == KV_OK; /* dead context: destroyed, its work dropped, an error */
    if (gone)
        s->destroyed = true;
    if (gone && sticky)
        r = sticky_error("cudaStreamDestroy");
    pthread_mutex_unlock(&mu);
    if (gone)
        stream_end(s);
    return r;
}

static kv_status sc_event_create(int device, void **event)
{
    pthread_mutex_lock(&mu);
    const kv_status r = sticky ? sticky_error("cudaEventCreateWithFlags") : KV_OK;
    pthread_mutex_unlock(&mu);
    if (r != KV_OK)
        return r;
    struct event *e = calloc(1, sizeof(*e));
    if (!e)
        return kv__error(KV_ERR_NO_MEMORY, "softcuda: an event");
    e->device = device;
    e->owner = pthread_self();
    pthread_mutex_lock(&mu);
    e->next = events;
    events = e;
    pthread_mutex_unlock(&mu);
    *event = e;
    return KV_OK;
}

static kv_status sc_event_destroy(int device, void *event)
{
    struct event *e = event;
    pthread_mutex_lock(&mu);
    kv_status r = KV_OK;
    if (e->destroyed)
        r = fault("cudaEventDestroy of a destroyed event");
    else if (e->device != device)
        r = fault("cudaEventDestroy on device %d of an event of device %d", device, e->device);
    else if ((r = same_thread("cudaEventDestroy", NULL, e)) != KV_OK)
        ;
    else if (e->queued && !sticky)
        r = fault("cudaEventDestroy with %u records queued", e->queued);
    if (r == KV_OK)
        e->destroyed = true;
    if (r == KV_OK && sticky)
        r = sticky_error("cudaEventDestroy");
    pthread_mutex_unlock(&mu);
    return r;
}

static kv_status sc_event_record(int device, void *event, void *stream)
{
    struct event *e = event;
    struct stream *s = stream ? stream : legacy;
    pthread_mutex_lock(&mu);
    kv_status r = KV_OK;
    if (sticky)
        r = sticky_error("cudaEventRecord");
    else if (e->destroyed)
        r = fault("cudaEventRecord of a destroyed event");
    else if (!stream_live(s))
        r = fault("cudaEventRecord on a stream not live (%p)", stream);
    else if (s->device != device || e->device != device)
        r = fault("cudaEventRecord on device %d: stream of device %d, event of device %d", device,
                  s->device, e->device);
    else
        r = same_thread("cudaEventRecord", s, e);
    struct item *it = r == KV_OK ? calloc(1, sizeof(*it)) : NULL;
    if (r == KV_OK && !it)
        r = kv__error(KV_ERR_NO_MEMORY, "softcuda: a record");
    if (r == KV_OK) {
        it->kind = ITEM_EVENT;
        it->ev = e;
        e->recorded++;
        e->queued++;
        e->on_engine = !s->tier;
        enqueue(s, it);
    }
    pthread_mutex_unlock(&mu);
    return r;
}

static kv_status sc_event_sync(int device, void *event)
{
    struct event *e = event;
    pthread_mutex_lock(&mu);
    kv_status r = KV_OK;
    st.event_syncs++;
    if (sticky)
        r = sticky_error("cudaEventSynchronize");
    else if (e->destroyed)
        r = fault("cudaEventSynchronize of a destroyed event");
    else if (e->recorded == 0)
        r = fault("cudaEventSynchronize of an event never recorded");
    else if (e->device != device)
        r = fault("cudaEventSynchronize on device %d of an event of device %d", device, e->device);
    else
        r = same_thread("cudaEventSynchronize", NULL, e);
    if (r == KV_OK) {
        if (e->on_engine)
            st.engine_waits++;
        const uint64_t want = e->recorded;
        while (e->done < want && !sticky)
            pthread_cond_wait(&cv, &mu);
        if (e->done < want) /* the context died while the work ran */
            r = sticky_error("cudaEventSynchronize");
    }
    pthread_mutex_unlock(&mu);
    return r;
}

/* cudaStreamSynchronize of a stream the tier made: sleeps until all its
 * work ran (holds included). */
static kv_status sc_stream_sync(int device, void *stream)
{
    struct stream *s = stream;
    pthread_mutex_lock(&mu);
    kv_status r = KV_OK;
    if (sticky)
        r = sticky_error("cudaStreamSynchronize");
    else if (!stream_live(s))
        r = fault("cudaStreamSynchronize of a stream not live (%p)", stream);
    else if (!s->tier)
        r = fault("cudaStreamSynchronize of an engine's stream by the tier");
    else if (s->device != device)
        r = fault("cudaStreamSynchronize on device %d of a stream of device %d", device, s->device);
    else
        r = same_thread("cudaStreamSynchronize", s, NULL);
    while (r == KV_OK && s->head && !sticky)
        pthread_cond_wait(&cv, &mu);
    if (r == KV_OK && s->head) /* the context died while the work ran */
        r = sticky_error("cudaStreamSynchronize");
    pthread_mutex_unlock(&mu);
    return r;
}

/* mu held: the live allocation a cache's storage lies in, of its kind. */
static struct alloc *cache_alloc(const struct kv_paged_cache *c, const char *side, int device,
                                 kv_status *r)
{
    const int kind = c->mem == KV_MEM_DEVICE   ? ALLOC_DEVICE
                     : c->mem == KV_MEM_PINNED ? ALLOC_PINNED
                                               : 0;
    struct alloc *a = kind ? alloc_find(c->base, c->storage_bytes, kind) : NULL;
    if (!a)
        *r = fault("copy: the %s cache (%p, %zu bytes, %s) is not inside one live %s allocation",
                   side, c->base, c->storage_bytes, kv_mem_kind_name(c->mem),
                   kind == ALLOC_PINNED ? "pinned" : "device");
    else if (kind == ALLOC_DEVICE && a->device != device)
        *r = fault("copy on device %d: the %s cache is memory of device %d", device, side,
                   a->device);
    return *r == KV_OK ? a : NULL;
}

static kv_status sc_copy(int device, const kv_plan *plan, const struct kv_paged_cache *src,
                         uint32_t src_block, const struct kv_paged_cache *dst, uint32_t dst_block,
                         uint64_t n_tokens, void *stream)
{
    static const char fn[] = "softcuda copy (kv_plan_copy_cuda)";
    struct stream *s = stream ? stream : legacy;
    /* kv_plan_copy_cuda's checks (host memory refused), then the schedule */
    kv_status r =
        kv__plan_check_request(fn, plan, src, &src_block, 1, dst, &dst_block, 1, n_tokens, true);
    if (r != KV_OK)
        return r;
    struct item *it = calloc(1, sizeof(*it));
    if (!it)
        return kv__error(KV_ERR_NO_MEMORY, "softcuda: a copy");
    r = kv__plan_cuda_schedule(fn, plan, src, &src_block, 1, dst, &dst_block, 1, n_tokens, 0,
                               &it->sched);
    if (r != KV_OK) {
        free(it);
        return r;
    }
    pthread_mutex_lock(&mu);
    if (sticky)
        r = sticky_error("cudaMemcpy2DAsync");
    else if (!stream_live(s))
        r = fault("copy on a stream not live (%p)", stream);
    else if (s->device != device)
        r = fault("copy on device %d, stream of device %d", device, s->device);
    else
        r = same_thread("copy", s, NULL);
    if (r == KV_OK)
        it->a[0] = cache_alloc(src, "source", device, &r);
    if (r == KV_OK)
        it->a[1] = cache_alloc(dst, "destination", device, &r);
    if (r == KV_OK) {
        if (src->mem == KV_MEM_DEVICE) {
            it->dev[it->n_dev] = *src;
            it->dev_block[it->n_dev++] = src_block;
        }
        if (dst->mem == KV_MEM_DEVICE) {
            it->dev[it->n_dev] = *dst;
            it->dev_block[it->n_dev++] = dst_block;
        }
        it->kind = ITEM_COPY;
        it->a[0]->users++;
        it->a[1]->users++;
        st.copies_issued++;
        enqueue(s, it);
    }
    pthread_mutex_unlock(&mu);
    if (r != KV_OK) {
        kv__plan_sched_free(&it->sched);
        free(it);
    }
    return r;
}

static const struct kv__offdev_ops ops = {
    .version = KV__OFFDEV_VERSION,
    .name = "softcuda",
    .stream_create = sc_stream_create,
    .stream_destroy = sc_stream_destroy,
    .event_create = sc_event_create,
    .event_destroy = sc_event_destroy,
    .event_record = sc_event_record,
    .event_sync = sc_event_sync,
    .stream_sync = sc_stream_sync,
    .copy = sc_copy,
};

const struct kv__offdev_ops *kvt_softcuda_ops(void)
{
    return &ops;
}

/* ---- test controls ------------------------------------------------------- */

void kvt_softcuda_install(void)
{
    pthread_mutex_lock(&mu);
    memset(&st, 0, sizeof(st));
    paused = false;
    sticky = false;
    pthread_mutex_unlock(&mu);
    legacy = stream_new(0, true, false);
    kv__arena_set_cuda_mem(&arena_mem);
    kv__offdev_set(&ops);
}

void kvt_softcuda_uninstall(void)
{
    kvt_softcuda_release();
    kvt_softcuda_pause(false);
    stream_end(legacy);
    legacy = NULL;
    pthread_mutex_lock(&mu);
    for (struct event *e = events, *n; e; e = n) {
        n = e->next;
        if (!e->destroyed)
            fault("an event never destroyed");
        free(e);
    }
    events = NULL;
    if (streams)
        fault("a stream never destroyed");
    if (allocs)
        fault("%" PRIu64 " allocations never freed", st.allocs);
    for (struct alloc *a = allocs, *n; a; a = n) {
        n = a->next;
        free(a->base);
        free(a);
    }
    allocs = NULL;
    st.allocs = 0;
    pthread_mutex_unlock(&mu);
    kv__offdev_set(NULL);
    kv__arena_set_cuda_mem(NULL);
}

void *kvt_softcuda_engine_stream(int device, bool non_blocking)
{
    return stream_new(device, !non_blocking, false);
}

void kvt_softcuda_engine_stream_free(void *stream)
{
    stream_end(stream);
}

void kvt_softcuda_hold(void *stream)
{
    struct stream *s = stream ? stream : legacy;
    struct item *it = calloc(1, sizeof(*it));
    if (!it)
        abort();
    pthread_mutex_lock(&mu);
    it->kind = ITEM_HOLD;
    it->gen = release_gen;
    enqueue(s, it);
    pthread_mutex_unlock(&mu);
}

void kvt_softcuda_engine_write(void *stream, void *p, size_t bytes, unsigned char value)
{
    struct stream *s = stream ? stream : legacy;
    struct item *it = calloc(1, sizeof(*it));
    if (!it)
        abort();
    pthread_mutex_lock(&mu);
    struct alloc *a = alloc_find(p, bytes, ALLOC_DEVICE);
    if (!a || s->tier) {
        fault("engine write of %zu bytes at %p: %s", bytes, p,
              !a ? "not inside one live device allocation" : "on a stream of the tier");
        pthread_mutex_unlock(&mu);
        free(it);
        return;
    }
    it->kind = ITEM_WRITE;
    it->a[0] = a;
    a->users++;
    it->p = p;
    it->bytes = bytes;
    it->value = value;
    enqueue(s, it);
    pthread_mutex_unlock(&mu);
}

void kvt_softcuda_engine_sync(void *stream)
{
    struct stream *s = stream ? stream : legacy;
    pthread_mutex_lock(&mu);
    while (s->head)
        pthread_cond_wait(&cv, &mu);
    pthread_mutex_unlock(&mu);
}

void kvt_softcuda_release(void)
{
    pthread_mutex_lock(&mu);
    release_gen++;
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
}

void kvt_softcuda_sticky(const char *why)
{
    pthread_mutex_lock(&mu);
    sticky = true;
    snprintf(sticky_why, sizeof(sticky_why), "%s", why);
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
}

void kvt_softcuda_pause(bool p)
{
    pthread_mutex_lock(&mu);
    paused = p;
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
}

void kvt_softcuda_stats(struct kvt_softcuda_stats *out)
{
    pthread_mutex_lock(&mu);
    *out = st;
    pthread_mutex_unlock(&mu);
}
