/*
 * kv_xport_layers.c - layer-by-layer transfer of a request (kv_xport_layers.h):
 * the notification codec, the decode side's tracker (expect, feed, wait,
 * fail, finished) and the prefill side's (begin, post, cancel, wait,
 * finished). Built on the public transport API only.
 */
#include <assert.h>
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdbool.h>
#include <string.h>
#include <time.h>

#include "kv_lib.h"
#include "kv_mem.h"
#include "kv_wire.h"
#include "kv_plan_int.h"
#include "kv_xport_int.h"
#include "kv_xport_layers.h"

#define NOTE_MAGIC 0x574C564Bu
#define DEFAULT_REQUESTS 256u
#define DEFAULT_LAYERS 128u

/* ---- the notification --------------------------------------------- */

void kv_xlayer_note_encode(const struct kv_xlayer_note *note,
                           unsigned char out[KV_XLAYER_NOTE_BYTES])
{
    memset(out, 0, KV_XLAYER_NOTE_BYTES);
    kv__le_put32(out, NOTE_MAGIC);
    kv__le_put16(out + 4, KV_XLAYER_VERSION);
    out[6] = (unsigned char)note->kind;
    kv__le_put64(out + 8, note->request);
    kv__le_put32(out + 16, note->layer0);
    kv__le_put32(out + 20, note->n_layers);
    kv__le_put32(out + 24, (uint32_t)(int32_t)note->status);
}

/* Whether s is a failure kv_status (negative and one of the list). */
static bool is_failure(kv_status s)
{
    return s < 0 && strcmp(kv_status_name(s), "KV_UNKNOWN_STATUS") != 0;
}

kv_status kv_xlayer_note_decode(const void *p, size_t len, struct kv_xlayer_note *out)
{
    if (!p || !out)
        return kv__error(KV_ERR_NULL, "xlayer_note_decode: %s is NULL", !p ? "p" : "out");
    if (len != KV_XLAYER_NOTE_BYTES)
        return kv__error(KV_ERR_CORRUPT, "xlayer_note_decode: length %zu, want %u", len,
                         KV_XLAYER_NOTE_BYTES);
    const unsigned char *b = p;
    const uint32_t magic = kv__le_get32(b), version = kv__le_get16(b + 4);
    const uint32_t layer0 = kv__le_get32(b + 16), n = kv__le_get32(b + 20);
    const int32_t status = (int32_t)kv__le_get32(b + 24);
    if (magic != NOTE_MAGIC)
        return kv__error(KV_ERR_CORRUPT, "xlayer_note_decode: magic 0x%08" PRIx32 ", want 0x%08x",
                         magic, NOTE_MAGIC);
    if (version != KV_XLAYER_VERSION)
        return kv__error(KV_ERR_CORRUPT, "xlayer_note_decode: version %" PRIu32 ", want %u",
                         version, KV_XLAYER_VERSION);
    if (b[7] != 0 || kv__le_get32(b + 28) != 0)
        return kv__error(KV_ERR_CORRUPT,
                         "xlayer_note_decode: reserved bytes 7 (0x%02x) and 28..31 (0x%08" PRIx32
                         ") must be 0",
                         b[7], kv__le_get32(b + 28));
    struct kv_xlayer_note note = {.request = kv__le_get64(b + 8), .layer0 = layer0, .n_layers = n};
    if (b[6] == KV_XLAYER_LAYERS) {
        if (n == 0 || layer0 >= KV_XLAYER_LAYERS_MAX || n > KV_XLAYER_LAYERS_MAX - layer0)
            return kv__error(KV_ERR_CORRUPT,
                             "xlayer_note_decode: LAYERS of request %" PRIu64 ": layers [%" PRIu32
                             ", +%" PRIu32 ") not a non-empty range of [0, %u)",
                             note.request, layer0, n, KV_XLAYER_LAYERS_MAX);
        if (status != 0)
            return kv__error(KV_ERR_CORRUPT,
                             "xlayer_note_decode: LAYERS of request %" PRIu64
                             " with status %" PRId32 ", want 0",
                             note.request, status);
        note.kind = KV_XLAYER_LAYERS;
        note.status = KV_OK;
    } else if (b[6] == KV_XLAYER_ABORT) {
        if (layer0 != 0 || n != 0)
            return kv__error(KV_ERR_CORRUPT,
                             "xlayer_note_decode: ABORT of request %" PRIu64
                             " with layers [%" PRIu32 ", +%" PRIu32 "), want 0, 0",
                             note.request, layer0, n);
        if (!is_failure((kv_status)status))
            return kv__error(KV_ERR_CORRUPT,
                             "xlayer_note_decode: ABORT of request %" PRIu64 " with status %" PRId32
                             ", not a failure status",
                             note.request, status);
        note.kind = KV_XLAYER_ABORT;
        note.status = (kv_status)status;
    } else {
        return kv__error(KV_ERR_CORRUPT,
                         "xlayer_note_decode: kind %u, want 1 (LAYERS) or 2 (ABORT)", b[6]);
    }
    *out = note;
    return KV_OK;
}

static kv_status limits(const char *fn, uint32_t *reqs, uint32_t *layers)
{
    if (*reqs > KV_XLAYER_REQUESTS_MAX)
        return kv__error(KV_ERR_INVALID_ARG, "%s: max_requests %" PRIu32 " over %u", fn, *reqs,
                         KV_XLAYER_REQUESTS_MAX);
    if (*layers > KV_XLAYER_LAYERS_MAX)
        return kv__error(KV_ERR_INVALID_ARG, "%s: max_layers %" PRIu32 " over %u", fn, *layers,
                         KV_XLAYER_LAYERS_MAX);
    if (*reqs == 0)
        *reqs = DEFAULT_REQUESTS;
    if (*layers == 0)
        *layers = DEFAULT_LAYERS;
    return KV_OK;
}

/* Whether any bit of [l0, l0 + n) is set in w. */
static bool bits_any(const uint64_t *w, uint32_t l0, uint32_t n)
{
    for (uint32_t l = l0; l < l0 + n; l++)
        if (w[l / 64] >> (l % 64) & 1u)
            return true;
    return false;
}

static void bits_set(uint64_t *w, uint32_t l0, uint32_t n)
{
    for (uint32_t l = l0; l < l0 + n; l++)
        w[l / 64] |= 1ull << (l % 64);
}

/* ---- decode side -------------------------------------------------- */

/*
 * A slot is FREE or tracks one request. Invariants (checked by rx_check in
 * DEBUG builds, after every call that changes them):
 *   landed == popcount(bits) <= n_layers
 *   terminal <=> (landed == n_layers || status != KV_OK)
 *   held => terminal && status != KV_OK && landed < n_layers (failed from
 *           this side; prefill may still be writing its blocks)
 *   reported => terminal && !held;   a slot is freed once reported && waiters == 0
 *   terminal && !held && !reported <=> the slot is in the ring exactly once
 *   tracked == the slots not FREE
 */
struct rx_slot {
    bool used;
    bool terminal;
    bool held; /* failed here (kv_xlayer_rx_fail), not reportable yet */
    bool reported;
    uint64_t request;
    uint64_t peer_id;
    uint32_t n_layers;
    uint32_t landed;
    uint32_t waiters;
    kv_status status;
    uint64_t *bits; /* [words] */
};

struct kv_xlayer_rx {
    pthread_mutex_t mu; /* guards everything below */
    pthread_cond_t cv;  /* a layer landed, a request became terminal, a waiter left */
    uint32_t max_requests, max_layers, words;
    struct rx_slot *slots; /* [max_requests] */
    uint64_t *bits;        /* [max_requests][words] */
    uint32_t *ring;        /* [max_requests]: terminal, not reported, in order */
    uint32_t ring_head, ring_len;
    uint32_t waiters;
    struct kv_xlayer_rx_stats st;
};

#ifdef KV_DEBUG_CHECKS
static uint32_t popcount_words(const uint64_t *w, uint32_t n)
{
    uint32_t c = 0;
    for (uint32_t i = 0; i < n; i++)
        c += (uint32_t)__builtin_popcountll(w[i]);
    return c;
}

static void rx_check(const kv_xlayer_rx *rx)
{
    uint32_t tracked = 0, in_ring = 0, waiters = 0;
    for (uint32_t i = 0; i < rx->max_requests; i++) {
        const struct rx_slot *s = &rx->slots[i];
        if (!s->used)
            continue;
        tracked++;
        waiters += s->waiters;
        assert(s->landed == popcount_words(s->bits, rx->words) && s->landed <= s->n_layers);
        assert(s->terminal == (s->landed == s->n_layers || s->status != KV_OK));
        assert(!s->held || (s->terminal && s->status != KV_OK && s->landed < s->n_layers));
        assert(!s->reported || (s->terminal && !s->held));
        assert(!(s->reported && s->waiters == 0));
        uint32_t seen = 0;
        for (uint32_t k = 0; k < rx->ring_len; k++)
            seen += rx->ring[(rx->ring_head + k) % rx->max_requests] == i;
        assert(seen == (s->terminal && !s->held && !s->reported ? 1u : 0u));
        in_ring += seen;
    }
    assert(in_ring == rx->ring_len && tracked == rx->st.tracked && waiters == rx->waiters);
}
#else
static void rx_check(const kv_xlayer_rx *rx)
{
    (void)rx;
}
#endif

kv_status kv_xlayer_rx_create(const struct kv_xlayer_rx_config *cfg, kv_xlayer_rx **out)
{
    if (!cfg || !out)
        return kv__error(KV_ERR_NULL, "xlayer_rx_create: %s is NULL", !cfg ? "cfg" : "out");
    kv_status st = kv__check_struct_size("xlayer_rx_create", "kv_xlayer_rx_config",
                                         cfg->struct_size, sizeof(*cfg));
    if (st != KV_OK)
        return st;
    uint32_t reqs = cfg->max_requests, layers = cfg->max_layers;
    if ((st = limits("xlayer_rx_create", &reqs, &layers)) != KV_OK)
        return st;
    kv_xlayer_rx *rx = kv__mem_calloc(1, sizeof(*rx));
    if (!rx)
        return kv__error(KV_ERR_NO_MEMORY, "xlayer_rx_create: %zu bytes", sizeof(*rx));
    rx->max_requests = reqs;
    rx->max_layers = layers;
    rx->words = (layers + 63) / 64;
    rx->slots = kv__mem_calloc(reqs, sizeof(*rx->slots));
    rx->bits = kv__mem_calloc((size_t)reqs * rx->words, sizeof(uint64_t));
    rx->ring = kv__mem_calloc(reqs, sizeof(*rx->ring));
    if (!rx->slots || !rx->bits || !rx->ring) {
        kv__mem_free(rx->slots);
        kv__mem_free(rx->bits);
        kv__mem_free(rx->ring);
        kv__mem_free(rx);
        return kv__error(KV_ERR_NO_MEMORY,
                         "xlayer_rx_create: %" PRIu32 " requests of %" PRIu32 " layers", reqs,
                         layers);
    }
    for (uint32_t i = 0; i < reqs; i++)
        rx->slots[i].bits = rx->bits + (size_t)i * rx->words;
    rx->st.struct_size = sizeof(rx->st);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&rx->cv, &ca);
    pthread_condattr_destroy(&ca);
    pthread_mutex_init(&rx->mu, NULL);
    *out = rx;
    return KV_OK;
}

kv_status kv_xlayer_rx_destroy(kv_xlayer_rx *rx)
{
    if (!rx)
        return KV_OK;
    pthread_mutex_lock(&rx->mu);
    const uint32_t w = rx->waiters;
    pthread_mutex_unlock(&rx->mu);
    if (w)
        return kv__error(KV_ERR_BAD_STATE, "xlayer_rx_destroy: %" PRIu32 " thread(s) still waiting",
                         w);
    pthread_cond_destroy(&rx->cv);
    pthread_mutex_destroy(&rx->mu);
    kv__mem_free(rx->slots);
    kv__mem_free(rx->bits);
    kv__mem_free(rx->ring);
    kv__mem_free(rx);
    return KV_OK;
}

/* mu held: the slot tracking request (not reported), or NULL. */
static struct rx_slot *rx_find(kv_xlayer_rx *rx, uint64_t request)
{
    for (uint32_t i = 0; i < rx->max_requests; i++) {
        struct rx_slot *s = &rx->slots[i];
        if (s->used && !s->reported && s->request == request)
            return s;
    }
    return NULL;
}

/* mu held: s may be reported (into the ring, in order). */
static void rx_reportable(kv_xlayer_rx *rx, struct rx_slot *s)
{
    s->held = false;
    rx->ring[(rx->ring_head + rx->ring_len) % rx->max_requests] = (uint32_t)(s - rx->slots);
    rx->ring_len++;
}

/* mu held: s just became terminal; held: failed from this side, reported
 * only once prefill is known to write no more of it. */
static void rx_terminal(kv_xlayer_rx *rx, struct rx_slot *s, bool held)
{
    s->terminal = true;
    if (held)
        s->held = true;
    else
        rx_reportable(rx, s);
    pthread_cond_broadcast(&rx->cv);
}

static void rx_free_slot(kv_xlayer_rx *rx, struct rx_slot *s)
{
    uint64_t *bits = s->bits;
    memset(bits, 0, rx->words * sizeof(uint64_t));
    memset(s, 0, sizeof(*s));
    s->bits = bits;
    rx->st.tracked--;
}

kv_status kv_xlayer_rx_expect(kv_xlayer_rx *rx, uint64_t peer_id, uint64_t request,
                              uint32_t n_layers)
{
    if (!rx)
        return kv__error(KV_ERR_NULL, "xlayer_rx_expect: rx is NULL");
    if (n_layers == 0 || n_layers > rx->max_layers)
        return kv__error(KV_ERR_INVALID_ARG,
                         "xlayer_rx_expect: request %" PRIu64 " with n_layers %" PRIu32
                         ", want 1..%" PRIu32 " (max_layers)",
                         request, n_layers, rx->max_layers);
    pthread_mutex_lock(&rx->mu);
    kv_status st = KV_OK;
    struct rx_slot *free_slot = NULL;
    if (rx_find(rx, request)) {
        st = kv__error(KV_ERR_BAD_STATE, "xlayer_rx_expect: request %" PRIu64 " is tracked already",
                       request);
        goto out;
    }
    for (uint32_t i = 0; i < rx->max_requests && !free_slot; i++)
        if (!rx->slots[i].used)
            free_slot = &rx->slots[i];
    if (!free_slot) {
        st = kv__error(KV_ERR_CAPACITY,
                       "xlayer_rx_expect: request %" PRIu64 ": %" PRIu32
                       " requests tracked already (max_requests)",
                       request, rx->max_requests);
        goto out;
    }
    free_slot->used = true;
    free_slot->request = request;
    free_slot->peer_id = peer_id;
    free_slot->n_layers = n_layers;
    free_slot->status = KV_OK;
    rx->st.tracked++;
out:
    rx_check(rx);
    pthread_mutex_unlock(&rx->mu);
    return st;
}

kv_status kv_xlayer_rx_feed(kv_xlayer_rx *rx, const struct kv_xport_msg *msg)
{
    if (!rx || !msg)
        return kv__error(KV_ERR_NULL, "xlayer_rx_feed: %s is NULL", !rx ? "rx" : "msg");
    struct kv_xlayer_note n;
    kv_status st = KV_OK;
    if (msg->tag != KV_XLAYER_TAG)
        st = kv__error(KV_ERR_INVALID_ARG, "xlayer_rx_feed: tag 0x%" PRIx64 ", want 0x%llx",
                       msg->tag, KV_XLAYER_TAG);
    else if (msg->len > KV_XPORT_NOTIFY_MAX)
        st = kv__error(KV_ERR_CORRUPT, "xlayer_rx_feed: length %" PRIu32 " over %u", msg->len,
                       KV_XPORT_NOTIFY_MAX);
    else
        st = kv_xlayer_note_decode(msg->data, msg->len, &n);
    pthread_mutex_lock(&rx->mu);
    if (st != KV_OK)
        goto out;
    struct rx_slot *s = rx_find(rx, n.request);
    if (!s) {
        st = kv__error(KV_ERR_NOT_FOUND,
                       "xlayer_rx_feed: %s of request %" PRIu64 " from peer %" PRIu64
                       ", not expected",
                       n.kind == KV_XLAYER_LAYERS ? "LAYERS" : "ABORT", n.request, msg->peer_id);
        goto out;
    }
    if (s->peer_id != msg->peer_id) {
        st = kv__error(KV_ERR_MISMATCH,
                       "xlayer_rx_feed: request %" PRIu64 " from peer %" PRIu64
                       ", expected from peer %" PRIu64,
                       n.request, msg->peer_id, s->peer_id);
        goto out;
    }
    if (s->terminal && !s->held) {
        rx->st.notes_late++;
        goto out;
    }
    if (n.kind == KV_XLAYER_ABORT) {
        rx->st.notes_abort++;
        if (s->held) { /* prefill has stopped: reported with this side's failure */
            rx_reportable(rx, s);
            goto out;
        }
        s->status = n.status;
        rx_terminal(rx, s, false);
        goto out;
    }
    if (n.layer0 >= s->n_layers || n.n_layers > s->n_layers - n.layer0) {
        st = kv__error(KV_ERR_OUT_OF_BOUNDS,
                       "xlayer_rx_feed: request %" PRIu64 ": layers [%" PRIu32 ", +%" PRIu32
                       ") past its %" PRIu32,
                       n.request, n.layer0, n.n_layers, s->n_layers);
        goto out;
    }
    if (bits_any(s->bits, n.layer0, n.n_layers)) {
        st = kv__error(KV_ERR_CORRUPT,
                       "xlayer_rx_feed: request %" PRIu64 ": layers [%" PRIu32 ", +%" PRIu32
                       ") landed before (in part)",
                       n.request, n.layer0, n.n_layers);
        goto out;
    }
    bits_set(s->bits, n.layer0, n.n_layers);
    s->landed += n.n_layers;
    rx->st.notes_layers++;
    if (s->held) { /* failed here: prefill goes on until its last layer */
        if (s->landed == s->n_layers)
            rx_reportable(rx, s);
    } else if (s->landed == s->n_layers) {
        rx_terminal(rx, s, false);
    } else {
        pthread_cond_broadcast(&rx->cv);
    }
out:
    if (st != KV_OK)
        rx->st.notes_refused++;
    rx_check(rx);
    pthread_mutex_unlock(&rx->mu);
    return st;
}

static struct timespec deadline_after(uint32_t ms)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    ts.tv_sec += ms / 1000;
    ts.tv_nsec += (long)(ms % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    return ts;
}

kv_status kv_xlayer_rx_wait(kv_xlayer_rx *rx, uint64_t request, uint32_t layer, uint32_t timeout_ms)
{
    if (!rx)
        return kv__error(KV_ERR_NULL, "xlayer_rx_wait: rx is NULL");
    const struct timespec ts = deadline_after(timeout_ms);
    pthread_mutex_lock(&rx->mu);
    kv_status st = KV_OK;
    struct rx_slot *s = rx_find(rx, request);
    if (!s) {
        st = kv__error(KV_ERR_NOT_FOUND, "xlayer_rx_wait: request %" PRIu64 " is not tracked",
                       request);
        goto out;
    }
    if (layer >= s->n_layers) {
        st = kv__error(KV_ERR_OUT_OF_BOUNDS,
                       "xlayer_rx_wait: layer %" PRIu32 " of request %" PRIu64 " of %" PRIu32
                       " layers",
                       layer, request, s->n_layers);
        goto out;
    }
    s->waiters++;
    rx->waiters++;
    bool timed_out = false;
    while (s->status == KV_OK && !(s->bits[layer / 64] >> (layer % 64) & 1u) && !timed_out)
        timed_out = pthread_cond_timedwait(&rx->cv, &rx->mu, &ts) == ETIMEDOUT;
    if (s->status != KV_OK)
        st = kv__error(s->status,
                       "xlayer_rx_wait: request %" PRIu64 " failed (%s): layer %" PRIu32
                       " is not to be attended over",
                       request, kv_status_name(s->status), layer);
    else if (!(s->bits[layer / 64] >> (layer % 64) & 1u))
        st = kv__error(KV_ERR_TIMEOUT,
                       "xlayer_rx_wait: layer %" PRIu32 " of request %" PRIu64
                       " not landed within %" PRIu32 " ms (%" PRIu32 " of %" PRIu32 " landed)",
                       layer, request, timeout_ms, s->landed, s->n_layers);
    s->waiters--;
    rx->waiters--;
    if (s->reported && s->waiters == 0)
        rx_free_slot(rx, s);
    pthread_cond_broadcast(&rx->cv);
out:
    rx_check(rx);
    pthread_mutex_unlock(&rx->mu);
    return st;
}

kv_status kv_xlayer_rx_fail(kv_xlayer_rx *rx, uint64_t request, kv_status why)
{
    if (!rx)
        return kv__error(KV_ERR_NULL, "xlayer_rx_fail: rx is NULL");
    if (!is_failure(why))
        return kv__error(KV_ERR_INVALID_ARG,
                         "xlayer_rx_fail: request %" PRIu64 ": %d is not a failure status", request,
                         (int)why);
    pthread_mutex_lock(&rx->mu);
    kv_status st = KV_OK;
    struct rx_slot *s = rx_find(rx, request);
    if (!s)
        st = kv__error(KV_ERR_NOT_FOUND, "xlayer_rx_fail: request %" PRIu64 " is not tracked",
                       request);
    else if (s->terminal)
        st = kv__error(KV_ERR_BAD_STATE, "xlayer_rx_fail: request %" PRIu64 " is terminal (%s)",
                       request, kv_status_name(s->status));
    else {
        s->status = why;
        rx_terminal(rx, s, true);
    }
    rx_check(rx);
    pthread_mutex_unlock(&rx->mu);
    return st;
}

kv_status kv_xlayer_rx_release(kv_xlayer_rx *rx, uint64_t request)
{
    if (!rx)
        return kv__error(KV_ERR_NULL, "xlayer_rx_release: rx is NULL");
    pthread_mutex_lock(&rx->mu);
    kv_status st = KV_OK;
    struct rx_slot *s = rx_find(rx, request);
    if (!s)
        st = kv__error(KV_ERR_NOT_FOUND, "xlayer_rx_release: request %" PRIu64 " is not tracked",
                       request);
    else if (!s->held)
        st = kv__error(KV_ERR_BAD_STATE,
                       "xlayer_rx_release: request %" PRIu64 " is not held (%s): only a request "
                       "failed from this side and not yet ended by prefill is",
                       request, !s->terminal ? "in flight" : "reportable already");
    else
        rx_reportable(rx, s);
    rx_check(rx);
    pthread_mutex_unlock(&rx->mu);
    return st;
}

kv_status kv_xlayer_rx_finished(kv_xlayer_rx *rx, struct kv_xlayer_done *out, uint32_t cap,
                                uint32_t *n)
{
    if (!rx || (!out && cap) || !n)
        return kv__error(KV_ERR_NULL, "xlayer_rx_finished: %s is NULL",
                         !rx  ? "rx"
                         : !n ? "n"
                              : "out");
    if (cap > 0) { /* written as words: misaligned is undefined behaviour */
        const kv_status st =
            kv__check_aligned("xlayer_rx_finished", "out", out, _Alignof(struct kv_xlayer_done));
        if (st != KV_OK)
            return st;
    }
    pthread_mutex_lock(&rx->mu);
    uint32_t k = 0;
    while (k < cap && rx->ring_len) {
        struct rx_slot *s = &rx->slots[rx->ring[rx->ring_head]];
        rx->ring_head = (rx->ring_head + 1) % rx->max_requests;
        rx->ring_len--;
        out[k].request = s->request;
        out[k].status = s->status;
        k++;
        s->reported = true;
        if (s->waiters == 0)
            rx_free_slot(rx, s);
    }
    *n = k;
    rx_check(rx);
    pthread_mutex_unlock(&rx->mu);
    return KV_OK;
}

kv_status kv_xlayer_rx_stats_get(kv_xlayer_rx *rx, struct kv_xlayer_rx_stats *out)
{
    if (!rx || !out)
        return kv__error(KV_ERR_NULL, "xlayer_rx_stats_get: %s is NULL", !rx ? "rx" : "out");
    kv_status st = kv__check_struct_size("xlayer_rx_stats_get", "kv_xlayer_rx_stats",
                                         out->struct_size, sizeof(*out));
    if (st != KV_OK)
        return st;
    pthread_mutex_lock(&rx->mu);
    *out = rx->st;
    out->waiting = rx->waiters;
    pthread_mutex_unlock(&rx->mu);
    return KV_OK;
}

/* ---- prefill side ------------------------------------------------- */

/*
 * An open request. Invariants:
 *   acked <= posted == popcount(bits) <= n_layers
 *   status != KV_OK => nothing more is posted but the ABORT
 *   terminal <=> n_xf == 0 && !abort_xf && (status == KV_OK ? acked == n_layers : abort_sent)
 */
/* A request holds a reference on its peer from begin until it is
 * reported: a caller may close the peer at any point (its transfers then
 * end), and the tracker's posts and ABORT still find a peer, a closed one
 * that refuses them, never a freed one. */
static void peer_hold(kv_xport_peer *p)
{
    pthread_mutex_lock(&p->x->mu);
    p->refs++;
    p->x->n_holds++; /* kv_xport_destroy refuses until it is released */
    pthread_mutex_unlock(&p->x->mu);
}

static void peer_release(kv_xport_peer *p)
{
    kv_xport *x = p->x;
    pthread_mutex_lock(&x->mu);
    x->n_holds--;
    kv__xport_peer_unref(p);
    pthread_mutex_unlock(&x->mu);
}

struct tx_req {
    bool used;
    bool cancel_sent; /* kv_xport_xfer_cancel asked of every transfer in flight */
    bool abort_sent;  /* the ABORT was posted (or could not be: the peer is gone) */
    uint64_t request;
    uint64_t seq; /* begin order: _finished reports oldest first */
    kv_xport_peer *peer;
    uint32_t n_layers, posted, acked;
    kv_status status;
    uint64_t *bits;      /* [words]: layers posted */
    kv_xport_xfer **xf;  /* [max_layers]: layer transfers in flight */
    uint32_t *xf_layers; /* [max_layers]: layers of each */
    uint32_t n_xf;
    kv_xport_xfer *abort_xf;
};

struct kv_xlayer_tx {
    uint32_t max_requests, max_layers, words;
    struct tx_req *reqs; /* [max_requests] */
    uint64_t *bits;      /* [max_requests][words] */
    kv_xport_xfer **xf;  /* [max_requests][max_layers] */
    uint32_t *xf_layers; /* [max_requests][max_layers] */
    uint64_t seq;
    uint32_t open;
};

kv_status kv_xlayer_tx_create(const struct kv_xlayer_tx_config *cfg, kv_xlayer_tx **out)
{
    if (!cfg || !out)
        return kv__error(KV_ERR_NULL, "xlayer_tx_create: %s is NULL", !cfg ? "cfg" : "out");
    kv_status st = kv__check_struct_size("xlayer_tx_create", "kv_xlayer_tx_config",
                                         cfg->struct_size, sizeof(*cfg));
    if (st != KV_OK)
        return st;
    uint32_t reqs = cfg->max_requests, layers = cfg->max_layers;
    if ((st = limits("xlayer_tx_create", &reqs, &layers)) != KV_OK)
        return st;
    if ((uint64_t)reqs * layers > KV_XLAYER_TX_SLOTS_MAX)
        return kv__error(KV_ERR_INVALID_ARG,
                         "xlayer_tx_create: max_requests %" PRIu32 " x max_layers %" PRIu32
                         " over %u slots",
                         reqs, layers, KV_XLAYER_TX_SLOTS_MAX);
    kv_xlayer_tx *tx = kv__mem_calloc(1, sizeof(*tx));
    if (!tx)
        return kv__error(KV_ERR_NO_MEMORY, "xlayer_tx_create: %zu bytes", sizeof(*tx));
    tx->max_requests = reqs;
    tx->max_layers = layers;
    tx->words = (layers + 63) / 64;
    tx->reqs = kv__mem_calloc(reqs, sizeof(*tx->reqs));
    tx->bits = kv__mem_calloc((size_t)reqs * tx->words, sizeof(uint64_t));
    tx->xf = kv__mem_calloc((size_t)reqs * layers, sizeof(*tx->xf));
    tx->xf_layers = kv__mem_calloc((size_t)reqs * layers, sizeof(*tx->xf_layers));
    if (!tx->reqs || !tx->bits || !tx->xf || !tx->xf_layers) {
        kv__mem_free(tx->reqs);
        kv__mem_free(tx->bits);
        kv__mem_free(tx->xf);
        kv__mem_free(tx->xf_layers);
        kv__mem_free(tx);
        return kv__error(KV_ERR_NO_MEMORY,
                         "xlayer_tx_create: %" PRIu32 " requests of %" PRIu32 " layers", reqs,
                         layers);
    }
    for (uint32_t i = 0; i < reqs; i++) {
        tx->reqs[i].bits = tx->bits + (size_t)i * tx->words;
        tx->reqs[i].xf = tx->xf + (size_t)i * layers;
        tx->reqs[i].xf_layers = tx->xf_layers + (size_t)i * layers;
    }
    *out = tx;
    return KV_OK;
}

kv_status kv_xlayer_tx_destroy(kv_xlayer_tx *tx)
{
    if (!tx)
        return KV_OK;
    if (tx->open)
        return kv__error(KV_ERR_BAD_STATE,
                         "xlayer_tx_destroy: %" PRIu32
                         " request(s) open (cancel them, collect them with kv_xlayer_tx_finished)",
                         tx->open);
    kv__mem_free(tx->reqs);
    kv__mem_free(tx->bits);
    kv__mem_free(tx->xf);
    kv__mem_free(tx->xf_layers);
    kv__mem_free(tx);
    return KV_OK;
}

static struct tx_req *tx_find(kv_xlayer_tx *tx, uint64_t request)
{
    for (uint32_t i = 0; i < tx->max_requests; i++)
        if (tx->reqs[i].used && tx->reqs[i].request == request)
            return &tx->reqs[i];
    return NULL;
}

kv_status kv_xlayer_tx_begin(kv_xlayer_tx *tx, kv_xport_peer *peer, uint64_t request,
                             uint32_t n_layers)
{
    if (!tx || !peer)
        return kv__error(KV_ERR_NULL, "xlayer_tx_begin: %s is NULL", !tx ? "tx" : "peer");
    if (n_layers == 0 || n_layers > tx->max_layers)
        return kv__error(KV_ERR_INVALID_ARG,
                         "xlayer_tx_begin: request %" PRIu64 " with n_layers %" PRIu32
                         ", want 1..%" PRIu32 " (max_layers)",
                         request, n_layers, tx->max_layers);
    if (tx_find(tx, request))
        return kv__error(KV_ERR_BAD_STATE, "xlayer_tx_begin: request %" PRIu64 " is open already",
                         request);
    struct tx_req *r = NULL;
    for (uint32_t i = 0; i < tx->max_requests && !r; i++)
        if (!tx->reqs[i].used)
            r = &tx->reqs[i];
    if (!r)
        return kv__error(KV_ERR_CAPACITY,
                         "xlayer_tx_begin: request %" PRIu64 ": %" PRIu32
                         " requests open already (max_requests)",
                         request, tx->max_requests);
    r->used = true;
    r->request = request;
    r->seq = ++tx->seq;
    r->peer = peer;
    peer_hold(peer);
    r->n_layers = n_layers;
    r->status = KV_OK;
    tx->open++;
    return KV_OK;
}

kv_status kv_xlayer_tx_post(kv_xlayer_tx *tx, uint64_t request, const kv_plan *plan,
                            uint32_t layer0, uint32_t n_layers, kv_xport_mem *local,
                            uint64_t local_base_off, const uint32_t *src_blocks, uint32_t n_src,
                            kv_xport_rmem *remote, uint64_t remote_base_off,
                            const uint32_t *dst_blocks, uint32_t n_dst, uint64_t n_tokens)
{
    if (!tx)
        return kv__error(KV_ERR_NULL, "xlayer_tx_post: tx is NULL");
    struct tx_req *r = tx_find(tx, request);
    if (!r)
        return kv__error(KV_ERR_NOT_FOUND, "xlayer_tx_post: request %" PRIu64 " is not open",
                         request);
    if (r->status != KV_OK)
        return kv__error(KV_ERR_BAD_STATE, "xlayer_tx_post: request %" PRIu64 " failed (%s)",
                         request, kv_status_name(r->status));
    if (n_layers == 0 || layer0 >= r->n_layers || n_layers > r->n_layers - layer0)
        return kv__error(KV_ERR_OUT_OF_BOUNDS,
                         "xlayer_tx_post: request %" PRIu64 ": layers [%" PRIu32 ", +%" PRIu32
                         ") not a non-empty range of its %" PRIu32,
                         request, layer0, n_layers, r->n_layers);
    if (bits_any(r->bits, layer0, n_layers))
        return kv__error(KV_ERR_OVERLAP,
                         "xlayer_tx_post: request %" PRIu64 ": layers [%" PRIu32 ", +%" PRIu32
                         ") posted before (in part)",
                         request, layer0, n_layers);
    /* the layers the notification names are the ones the plan writes (a
     * plan of other layers made decode attend over layers never written) */
    if (!plan)
        return kv__error(KV_ERR_NULL, "xlayer_tx_post: plan is NULL");
    if (plan->cfg.dst_layer0 != (int64_t)layer0 || plan->cfg.n_layers != (int64_t)n_layers)
        return kv__error(KV_ERR_INVALID_ARG,
                         "xlayer_tx_post: request %" PRIu64 ": layers [%" PRIu32 ", +%" PRIu32
                         ") named, but the plan writes destination layers [%" PRId64 ", +%" PRId64
                         ")",
                         request, layer0, n_layers, plan->cfg.dst_layer0, plan->cfg.n_layers);
    unsigned char note_bytes[KV_XLAYER_NOTE_BYTES];
    const struct kv_xlayer_note note = {
        .kind = KV_XLAYER_LAYERS, .request = request, .layer0 = layer0, .n_layers = n_layers};
    kv_xlayer_note_encode(&note, note_bytes);
    const struct kv_xport_notify nt = {
        .tag = KV_XLAYER_TAG, .msg = note_bytes, .len = KV_XLAYER_NOTE_BYTES};
    kv_xport_xfer *xf = NULL;
    kv_status st =
        kv_xport_write_plan(r->peer, plan, local, local_base_off, src_blocks, n_src, remote,
                            remote_base_off, dst_blocks, n_dst, n_tokens, &nt, &xf);
    if (st != KV_OK)
        return kv__error_wrap(
            st, "xlayer_tx_post: request %" PRIu64 " layers [%" PRIu32 ", +%" PRIu32 ")", request,
            layer0, n_layers);
    bits_set(r->bits, layer0, n_layers);
    r->posted += n_layers;
    r->xf[r->n_xf] = xf;
    r->xf_layers[r->n_xf] = n_layers;
    r->n_xf++;
    return KV_OK;
}

/* Why a terminal, not DONE transfer ended: its first failed entry's
 * status, or the state's. */
static kv_status xfer_why(kv_xport_xfer *xf, kv_xport_state s)
{
    if (s == KV_XPORT_TIMED_OUT)
        return KV_ERR_TIMEOUT;
    if (s == KV_XPORT_CANCELLED)
        return KV_ERR_CANCELLED;
    const kv_status *res = NULL;
    uint32_t n = 0;
    if (kv_xport_xfer_results(xf, &res, &n) == KV_OK)
        for (uint32_t i = 0; i < n; i++)
            if (res[i] != KV_OK)
                return res[i];
    return KV_ERR_IO;
}

static bool tx_terminal(const struct tx_req *r)
{
    return r->n_xf == 0 && !r->abort_xf &&
           (r->status == KV_OK ? r->acked == r->n_layers : r->abort_sent);
}

/* One round of progress on r: collect terminal transfers; a failure fails
 * the request, cancels the rest and, once none is in flight, sends ABORT. */
static void tx_step(struct tx_req *r)
{
    for (uint32_t i = 0; i < r->n_xf;) {
        kv_xport_state s = KV_XPORT_PENDING;
        if (kv_xport_xfer_test(r->xf[i], &s) != KV_OK || s == KV_XPORT_PENDING) {
            i++;
            continue;
        }
        if (s == KV_XPORT_DONE)
            r->acked += r->xf_layers[i];
        else if (r->status == KV_OK)
            r->status = xfer_why(r->xf[i], s);
        kv_status ign = kv_xport_xfer_free(r->xf[i]); /* terminal: not refused */
        (void)ign;
        r->xf[i] = r->xf[r->n_xf - 1];
        r->xf_layers[i] = r->xf_layers[r->n_xf - 1];
        r->n_xf--;
    }
    if (r->status != KV_OK && r->n_xf && !r->cancel_sent) {
        for (uint32_t i = 0; i < r->n_xf; i++) {
            kv_status ign = kv_xport_xfer_cancel(r->xf[i]); /* a terminal one is left */
            (void)ign;
        }
        r->cancel_sent = true;
    }
    if (r->status != KV_OK && r->n_xf == 0 && !r->abort_sent) {
        unsigned char b[KV_XLAYER_NOTE_BYTES];
        const struct kv_xlayer_note note = {
            .kind = KV_XLAYER_ABORT, .request = r->request, .status = r->status};
        kv_xlayer_note_encode(&note, b);
        const struct kv_xport_notify nt = {.tag = KV_XLAYER_TAG, .msg = b, .len = sizeof(b)};
        const kv_status ws = kv_xport_write(r->peer, NULL, 0, &nt, &r->abort_xf);
        if (ws != KV_OK)
            r->abort_xf = NULL;
        /* out of memory or over a limit: the ABORT is posted again at the
         * next step, and the request is not terminal until it is (decode
         * must hear it, or it holds the request's blocks forever); any
         * other refusal: the peer is gone, decode learns it from the
         * transport */
        r->abort_sent = ws != KV_ERR_NO_MEMORY && ws != KV_ERR_CAPACITY;
    }
    if (r->abort_xf) {
        kv_xport_state s = KV_XPORT_PENDING;
        if (kv_xport_xfer_test(r->abort_xf, &s) == KV_OK && s != KV_XPORT_PENDING) {
            /* decode refused it for its queue of notifications full: it
             * never heard, and the queue drains as decode polls, so the
             * ABORT is posted again at the next step, as one refused at
             * post. Refused for decode's memory: not retried (a lasting
             * shortage there would keep prefill's request open for good;
             * decode's own deadline fails the request on its side). */
            kv_status ns = KV_OK;
            if (s == KV_XPORT_FAILED && kv_xport_xfer_note_status(r->abort_xf, &ns) == KV_OK &&
                ns == KV_ERR_CAPACITY)
                r->abort_sent = false;
            kv_status ign = kv_xport_xfer_free(r->abort_xf);
            (void)ign;
            r->abort_xf = NULL;
        }
    }
}

kv_status kv_xlayer_tx_cancel(kv_xlayer_tx *tx, uint64_t request)
{
    if (!tx)
        return kv__error(KV_ERR_NULL, "xlayer_tx_cancel: tx is NULL");
    struct tx_req *r = tx_find(tx, request);
    if (!r)
        return kv__error(KV_ERR_NOT_FOUND, "xlayer_tx_cancel: request %" PRIu64 " is not open",
                         request);
    tx_step(r);
    if (r->status != KV_OK || tx_terminal(r))
        return kv__error(KV_ERR_BAD_STATE, "xlayer_tx_cancel: request %" PRIu64 " is %s (%s)",
                         request, tx_terminal(r) ? "terminal" : "failing",
                         kv_status_name(r->status));
    r->status = KV_ERR_CANCELLED;
    tx_step(r);
    return KV_OK;
}

kv_status kv_xlayer_tx_wait(kv_xlayer_tx *tx, uint64_t request, uint32_t timeout_ms)
{
    if (!tx)
        return kv__error(KV_ERR_NULL, "xlayer_tx_wait: tx is NULL");
    struct tx_req *r = tx_find(tx, request);
    if (!r)
        return kv__error(KV_ERR_NOT_FOUND, "xlayer_tx_wait: request %" PRIu64 " is not open",
                         request);
    struct timespec now, end = deadline_after(timeout_ms);
    for (;;) {
        tx_step(r);
        if (tx_terminal(r))
            break;
        clock_gettime(CLOCK_MONOTONIC, &now);
        const int64_t left_ms =
            (int64_t)(end.tv_sec - now.tv_sec) * 1000 + (end.tv_nsec - now.tv_nsec) / 1000000;
        if (left_ms <= 0)
            return kv__error(KV_ERR_TIMEOUT,
                             "xlayer_tx_wait: request %" PRIu64 " not terminal within %" PRIu32
                             " ms (%" PRIu32 " of %" PRIu32 " layers posted, %" PRIu32
                             " acknowledged)",
                             request, timeout_ms, r->posted, r->n_layers, r->acked);
        const uint32_t slice = left_ms < 20 ? (uint32_t)left_ms : 20u;
        kv_xport_xfer *w = r->n_xf ? r->xf[0] : r->abort_xf;
        kv_xport_state s;
        if (w) {
            kv_status ign = kv_xport_xfer_wait(w, slice, &s); /* TIMEOUT: next round */
            (void)ign;
        } else {
            const struct timespec nap = {0, 1000000L};
            nanosleep(&nap, NULL);
        }
    }
    if (r->status != KV_OK)
        return kv__error(r->status, "xlayer_tx_wait: request %" PRIu64 " failed (%s)", request,
                         kv_status_name(r->status));
    return KV_OK;
}

kv_status kv_xlayer_tx_finished(kv_xlayer_tx *tx, struct kv_xlayer_done *out, uint32_t cap,
                                uint32_t *n)
{
    if (!tx || (!out && cap) || !n)
        return kv__error(KV_ERR_NULL, "xlayer_tx_finished: %s is NULL",
                         !tx  ? "tx"
                         : !n ? "n"
                              : "out");
    if (cap > 0) { /* written as words: misaligned is undefined behaviour */
        const kv_status st =
            kv__check_aligned("xlayer_tx_finished", "out", out, _Alignof(struct kv_xlayer_done));
        if (st != KV_OK)
            return st;
    }
    for (uint32_t i = 0; i < tx->max_requests; i++)
        if (tx->reqs[i].used)
            tx_step(&tx->reqs[i]);
    uint32_t k = 0;
    while (k < cap) {
        struct tx_req *best = NULL;
        for (uint32_t i = 0; i < tx->max_requests; i++) {
            struct tx_req *r = &tx->reqs[i];
            if (r->used && tx_terminal(r) && (!best || r->seq < best->seq))
                best = r;
        }
        if (!best)
            break;
        out[k].request = best->request;
        out[k].status = best->status;
        k++;
        peer_release(best->peer);
        uint64_t *bits = best->bits;
        kv_xport_xfer **xf = best->xf;
        uint32_t *xl = best->xf_layers;
        memset(bits, 0, tx->words * sizeof(uint64_t));
        memset(best, 0, sizeof(*best));
        best->bits = bits;
        best->xf = xf;
        best->xf_layers = xl;
        tx->open--;
    }
    *n = k;
    return KV_OK;
}
