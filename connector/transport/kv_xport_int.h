/*
 * kv_xport_int.h - the inside of the transport seam (kv_transport.h), shared
 * by the generic layer (kv_transport.c) and the backends (kv_xport_tcp*.c,
 * kv_xport_rdma_verbs.c). Module-private: not installed.
 *
 * Division of work:
 *   generic  the handles and their lifetimes (reference counts, what is
 *            still held), argument checks at post, the exposure table a
 *            receiver checks against, the blobs, the accept and
 *            notification queues, every limit the API states (the
 *            backends ask before they read a payload), transfer bookkeeping
 *            (per-entry status, the terminal state, waiting);
 *   backend  moving the bytes: its progress thread, connections or queue
 *            pairs, the handshake on the wire, deadlines of what it holds.
 *
 * A backend provides exactly struct kv__xport_ops and its own state behind
 * the `be` pointers (x->be, p->be, m->be, e->be); the generic structs hold
 * nothing of one backend. A third backend is a new file with an ops table.
 *
 * One mutex per transport (x->mu) guards every field below that is not
 * marked otherwise, in every object of that transport; x->cv is broadcast
 * on every change a caller may wait for (a transfer terminal, a peer ready
 * or closed, a notification queued, an exposure no longer busy). Memory a
 * transfer names is touched only by the backend's progress thread, and only
 * while the transfer is not terminal; memory an exposure names only while
 * the exposure is in its peer's table or busy.
 *
 * Lifetimes: a peer is freed when its references drop to 0: the user's
 * handle (until kv_xport_peer_close), one per transfer and imported region
 * still allocated, one per queued notification, and the backend's (until it
 * has closed the peer's connections). A transfer is freed by the user only
 * (kv_xport_xfer_free, once terminal). An imported region counts the
 * transfers not yet terminal that name it (rmem_free refuses while any do).
 *
 *   x->n_xfers == transfers posted and not freed
 *   x->n_rmems == imported regions not freed
 *   x->n_holds == layer-by-layer requests holding one of x's peers, not yet
 *                 reported (kv_xlayer_tx_begin .. kv_xlayer_tx_finished)
 *   m->users   == transfers not terminal naming m + exposures of m
 *   r->users   == transfers not terminal naming r
 *   p->n_notes == notifications of p queued, not yet polled (<= max_pending_notes)
 */
#ifndef KV_XPORT_INT_H
#define KV_XPORT_INT_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <time.h>

#include "kv_lib.h"
#include "kv_transport.h"

#define KV__XPORT_OPS_VERSION 6u
#define KV__XPORT_KEY_MAX 160 /* backend key bytes inside a blob */
#define KV__XPORT_DEFAULT_TIMEOUT_MS 30000u
#define KV__XPORT_DEFAULT_CONNS 2u
#define KV__XPORT_MAX_CONNS 16u
#define KV__XPORT_DEFAULT_NOTES 1024u
#define KV__XPORT_DEFAULT_READS 1024u
#define KV__XPORT_DEFAULT_HANDSHAKES 64u
#define KV__XPORT_DEFAULT_FRAMES 64u

struct kv__xport_expo;

/* A backend: the versioned ops table (kv__xport_tcp_ops, kv__xport_rdma()).
 * Every entry is called with x->mu NOT held unless it says "mu held". */
struct kv__xport_ops {
    uint32_t version; /* KV__XPORT_OPS_VERSION: checked at kv_xport_create */
    kv_xport_kind kind;
    const char *name;
    /* Backend state into x->be; listen when x->cfg.listen_host; start the
     * progress thread (none when x->manual: kv__xport_step drives it).
     * x->port set when listening. */
    kv_status (*start)(kv_xport *x);
    /* Close every peer left (mu taken inside: their transfers end), join
     * the thread, free x->be. The result of every teardown call: the first
     * that failed, named (the rest is still freed). */
    kv_status (*stop)(kv_xport *x);
    /* Begin connecting p (state CONNECTING, p->be to be set); the progress
     * thread finishes the handshake and calls kv__xport_peer_ready or
     * kv__xport_peer_closed. */
    kv_status (*connect)(kv_xport_peer *p, const char *host, uint16_t port);
    /* Per-region backend state (RDMA: local-access MRs) into m->be. */
    kv_status (*mem_reg)(kv_xport_mem *m);
    /* Release m->be; an error leaves it registered. */
    kv_status (*mem_dereg)(kv_xport_mem *m);
    /* A new exposure e of e->mem to p (not yet in p's table): its backend
     * state into e->be and the key the blob carries into e->key/e->key_len
     * (RDMA: its own remote-access MRs and their rkeys; TCP: nothing). */
    kv_status (*expose)(kv_xport_peer *p, struct kv__xport_expo *e);
    /* mu held (may be dropped inside): e left p's table (unexpose, or p
     * closed); refuse what the backend queued of it, release e->be. The
     * caller then waits for e->busy == 0. */
    void (*unexpose)(kv_xport_peer *p, struct kv__xport_expo *e);
    /* mu held: take t (entries checked, state PENDING, on p's list). */
    void (*post)(kv_xport_xfer *t);
    /* mu held: t->cancel_req was just set; end it as soon as nothing of it
     * is in flight. */
    void (*cancel)(kv_xport_xfer *t);
    /* mu held: the user closed p; close its connections (transfers end
     * CANCELLED) from the progress thread and drop the backend's
     * reference. */
    void (*peer_close)(kv_xport_peer *p);
    /* Manual progress (x->manual, no thread): one round, waiting at most
     * timeout_ms for something to do. NULL where the backend has none. */
    void (*step)(kv_xport *x, uint32_t timeout_ms);
    /* mu held (v3): what the backend chose into *out (kind and struct_size
     * already set, the rest zero): the transport's, and p's path when p is
     * not NULL. NULL: nothing to report. */
    void (*info)(kv_xport *x, kv_xport_peer *p, struct kv_xport_info *out);
    /* (v4) Whether post takes gathered writes (kv_xport_xfer.seg): an entry's
     * payload read from several source ranges. false: never given one. */
    bool gather;
    /* (v5) mu held, p READY: refuse entries the backend cannot move, before
     * the transfer exists (RDMA: a local and a remote region on different
     * rails, a rail the peer is not connected on); the error names the
     * entry. NULL: none. */
    kv_status (*check)(kv_xport_peer *p, const struct kv_xport_io *ios, uint32_t n, bool read);
    /* (v5) mu held: m's device into *out (struct_size set, the rest zero,
     * numa nodes -1). NULL: nothing to report. */
    void (*mem_info)(kv_xport_mem *m, struct kv_xport_mem_info *out);
    /* (v6) mu held, p READY: check a remote region's backend key (the
     * blob's key[key_len], the region's bytes) at kv_xport_rmem_import;
     * KV_OK, or a status with msg[cap] naming the values. NULL: none. */
    kv_status (*import_check)(kv_xport_peer *p, const unsigned char *key, uint32_t key_len,
                              uint64_t bytes, char *msg, size_t cap);
};

/* For a backend that keeps nothing per region (TCP, SHM): mem_reg and
 * mem_dereg that do nothing, and an expose with no key (the receiver checks
 * each incoming write against its exposure table). Always KV_OK. */
kv_status kv__xport_mem_none(kv_xport_mem *m);
kv_status kv__xport_expose_keyless(kv_xport_peer *p, struct kv__xport_expo *e);

/* The backends: TCP here; RDMA through the verbs boundary header
 * (kv__xport_rdma() in kv_verbs_int.h: NULL in a build without rdma-core;
 * the generic layer reaches it only through kv__xport_backend()); AUTO
 * (kv_xport_auto.c) runs TCP and SHM side by side in one transport. */
extern const struct kv__xport_ops kv__xport_tcp_ops;
extern const struct kv__xport_ops kv__xport_auto_ops;
const struct kv__xport_ops *kv__xport_backend(kv_xport_kind kind);

/* A notification received, queued for kv_xport_notify_poll. */
struct kv__xport_note {
    struct kv__xport_note *next;
    kv_xport_peer *peer; /* a reference until polled (its n_notes) */
    uint64_t tag;
    uint32_t len;
    unsigned char data[];
};

struct kv_xport {
    struct kv_xport_config cfg; /* defaults applied; listen_host -> host[] */
    char host[64];
    const struct kv__xport_ops *ops;
    void *be;
    /* KV_XPORT_AUTO (kv_xport_auto.c): x->be is the TCP backend's state,
     * be_shm the SHM backend's; the SHM listener's abstract name
     * ("kvcache-shm:<auto_name>:<auto_shm_port>", random) and the secret
     * it echoes in its HELLO (auto_secret: random, nonzero), both given
     * only to a probe that presents the token. auto_offer_elsewhere
     * (tests): the probe's answer names a socket nobody listens on, as a
     * listener in another network namespace would be seen. Set at start. */
    void *be_shm;
    char auto_name[24];
    uint16_t auto_shm_port;
    uint64_t auto_secret;
    bool auto_offer_elsewhere;
    bool manual; /* no progress thread: kv__xport_step */
    uint16_t port;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    /* Called (mu held) wherever cv is broadcast for a peer, a notification
     * or a transfer (kv__xport_signal): how a transport that drives this
     * one (RDMA's out-of-band TCP) learns of it without polling. Set under
     * mu; NULL: none. It must not take mu. */
    void (*on_signal)(void *arg);
    void *on_signal_arg;
    kv_xport_peer *peers;                     /* every peer not yet freed */
    kv_xport_peer *accept_head, *accept_tail; /* ready, not yet accepted */
    struct kv__xport_note *note_head, *note_tail;
    kv_xport_mem *mems;
    uint32_t next_region; /* region ids: 1, 2, ... (0 never names one) */
    uint64_t next_xfer;   /* transfer ids: 1, 2, ... */
    uint64_t next_peer;   /* peer ids: 1, 2, ... */
    uint64_t n_xfers, n_rmems, n_holds;
    uint32_t n_waiting; /* threads inside kv_xport_accept / _notify_poll / _peer_close */
    struct kv_xport_stats stats;
};

struct kv_xport_mem {
    kv_xport *x;
    kv_xport_mem *next;
    char *base;
    uint64_t bytes;
    enum kv_mem_kind kind;
    uint32_t region;
    uint32_t users;  /* transfers not terminal that name it + exposures */
    uint32_t device; /* kv_xport_mem_reg_on's: asked for (KV_XPORT_DEVICE_AUTO: backend's) */
    kv_cache *cache;     /* kv_xport_mem_reg_cache's reference, dropped when deregistered */
    kv_offload *offload; /* kv_xport_mem_reg_offload's hold, released when deregistered */
    kv_arena *arena;     /* kv_xport_mem_reg_arena's reference, released when deregistered */
    void *be;
};

/* mem exposed to one peer: an entry of that peer's table. */
struct kv__xport_expo {
    kv_xport_mem *mem;
    uint32_t busy; /* backend: its incoming writes landing / its reads of mem being sent */
    uint32_t key_len;
    unsigned char key[KV__XPORT_KEY_MAX];
    void *be;
};

struct kv_xport_peer {
    kv_xport *x;
    kv_xport_peer *next;        /* x->peers */
    kv_xport_peer *accept_next; /* x->accept_head */
    uint64_t id;                /* kv_xport_peer_id */
    uint32_t refs;
    kv_xport_peer_state state;
    kv_status why; /* CLOSED: why (KV_OK for a clean close) */
    char why_msg[256];
    bool outgoing;    /* made by kv_xport_connect */
    bool user_closed; /* kv_xport_peer_close called */
    bool user_owned;  /* the user holds a handle (connect, or accept returned it) */
    uint64_t nonce_local, nonce_remote; /* this connection's ids on each side */
    /* The backend carrying this peer: x->ops, except in an AUTO transport
     * (TCP or SHM, set before the backend sees the peer; never changes). */
    const struct kv__xport_ops *ops;
    char path_why[256];              /* AUTO, outgoing: why ops (kv_xport_info's path_why) */
    struct kv__xport_expo **exposed; /* what this peer may write or read */
    uint32_t n_exposed;
    size_t cap_exposed;
    /* exposures out of the table whose regions are not yet released (by
     * the peer's close or kv_xport_mem_unexpose): the backend's unexpose
     * drops mu (ibv_dereg_mr), and kv_xport_peer_close must not return
     * before every region's users count is down */
    uint32_t n_expo_ending;
    uint32_t n_notes;     /* queued, not yet polled */
    kv_xport_xfer *xfers; /* not yet terminal, oldest first (via next) */
    kv_xport_xfer *xfers_tail;
    void *be;
};

struct kv_xport_rmem {
    kv_xport_peer *peer; /* a reference */
    uint32_t region;     /* the peer's region id */
    uint32_t users;      /* transfers not terminal that name it */
    uint64_t bytes;
    uint32_t key_len;
    unsigned char key[KV__XPORT_KEY_MAX];
};

/* A read a peer asked of us, queued until its bytes are sent (TCP: on the
 * connection it came on; SHM: through our ring), in order. */
struct kv__xport_serve {
    struct kv__xport_serve *next;
    uint64_t xfer;
    uint32_t entry;
    struct kv__xport_expo *expo; /* busy++ while queued */
    uint64_t off, len, sent;
    bool refused; /* unexposed while being sent: refused once what is on its way is out */
};

/* mu held: s leaves the queue *head .. *tail and is freed; its exposure is
 * no longer busy with it and *n_serves drops. The caller wakes waiters. */
void kv__xport_serve_end(struct kv__xport_serve **head, struct kv__xport_serve **tail,
                         struct kv__xport_serve *s, uint32_t *n_serves);

/* Source ranges of a gathered entry: count ranges of bytes each, the
 * first at off of the entry's local region, the next ones pitch bytes
 * apart (pitch >= bytes; count 1: one range). */
struct kv__xport_seg {
    uint64_t off;
    uint64_t bytes;
    uint64_t count;
    uint64_t pitch;
};

/*
 * A gathered write (kv_xport_write_plan on a backend with ops->gather):
 * entry i lands at ios[i].remote_off as usual, but its ios[i].bytes are the
 * concatenation of seg[seg_at[i] .. seg_at[i + 1]) of ios[i].local, in
 * order (ios[i].local_off == seg[seg_at[i]].off, unused):
 *
 *   source (NHD)  |h0 t0|h1 t0|..|h0 t1|h1 t1|..     256-byte runs
 *                    \          ___/
 *   entry (HND)   |h0 t0|h0 t1|..|h1 t0|h1 t1|..|    one destination run
 *
 *   sum over k in [seg_at[i], seg_at[i + 1]) of seg[k].bytes * seg[k].count
 *       == ios[i].bytes
 *   seg_at[0] == 0, seg_at[n] == n_seg
 */
struct kv_xport_xfer {
    kv_xport_peer *peer; /* a reference */
    kv_xport_xfer *next; /* peer->xfers while not terminal */
    uint64_t id;
    bool read;
    uint32_t n;
    struct kv_xport_io *ios; /* copied at post */
    kv_status *st;           /* [n]: KV_OK once acknowledged; set once */
    uint64_t *moved;         /* [n]: bytes acknowledged (write) / landed (read) */
    bool *ended;             /* [n] */
    uint32_t left;           /* entries not ended */
    uint32_t failed;         /* entries ended with an error */
    bool has_note, note_sent, note_done;
    kv_status note_st; /* the notification refused by the peer (KV_OK: not) */
    uint64_t note_tag;
    uint32_t note_len;
    unsigned char *note;
    kv_xport_state state;
    uint64_t post_ns, deadline_ns;
    bool cancel_req;
    uint32_t busy;             /* backend: frames / WRs of it on the wire or landing now */
    uint32_t unacked;          /* TCP: WRITE frames of it sent whole, their ACK not yet in (the
                                * peer may still be landing them) */
    uint64_t be_entry, be_off; /* backend: the send cursor */
    struct kv__xport_seg *seg; /* [n_seg]: a gathered write's source ranges; NULL: none */
    uint32_t *seg_at;          /* [n + 1] */
    uint32_t n_seg;
    uint64_t be_seg, be_rep, be_seg_off; /* backend: the send cursor in seg (gathered): the
                                            record, the range in it, the offset in that */
    char why[200];                       /* kv_xport_xfer_error: the first failure's detail */
};

/* Clocks and deadlines: kv__now_ns / kv__deadline_ns / kv__deadline_ts
 * (kvcache/kv_lib.h), the library's one monotonic clock. */
/* mu held: broadcast x->cv and call x->on_signal. */
static inline void kv__xport_signal(kv_xport *x)
{
    pthread_cond_broadcast(&x->cv);
    if (x->on_signal)
        x->on_signal(x->on_signal_arg);
}

/* mu held: wait on x->cv until ts; false once it passed. A manual transport
 * (no progress thread) makes one round of progress instead. */
bool kv__xport_wait_until(kv_xport *x, const struct timespec *ts);
/* Append ", <n> <what>" and, when given, " (ids a b ...)" to buf (the
 * messages naming what is still held). */
void kv__xport_held_say(char *buf, size_t cap, uint64_t n, const char *what, const uint64_t *ids,
                        uint32_t n_ids);

/* kv_xport_write with gathered entries (struct kv__xport_seg): the same
 * checks and post, each segment checked inside its entry's local region and
 * the segments' sum against the entry's bytes; takes ownership of seg and
 * seg_at (freed with the transfer, or here on an error). The backend must
 * have ops->gather. */
kv_status kv__xport_write_gather(kv_xport_peer *peer, const struct kv_xport_io *ios, uint32_t n,
                                 struct kv__xport_seg *seg, uint32_t *seg_at, uint32_t n_seg,
                                 const struct kv_xport_notify *notify, kv_xport_xfer **xfer);

/* mu held: entry i of t ended with st (KV_OK: all its bytes moved). */
void kv__xport_entry_end(kv_xport_xfer *t, uint32_t i, kv_status st);
/* mu held: as kv__xport_entry_end with an error and its detail (the first
 * detail of a transfer is kept: kv_xport_xfer_error). */
void kv__xport_entry_fail(kv_xport_xfer *t, uint32_t i, kv_status st, const char *fmt, ...)
    KV_PRINTF(4, 5);

/* A status read from the wire: itself when it is one of ours and an error
 * (KV_OK when ok is allowed and it is 0), else KV_ERR_CORRUPT. */
kv_status kv__xport_wire_status(int64_t v, bool ok_allowed);

/* A socket backend's (TCP, shm) result of handling a received frame or
 * message: keep going (KV__XPORT_OK), or close (the peer, or an unbound
 * connection) with a status and a message. */
struct kv__xport_verdict {
    kv_status st;
    char msg[200];
};
#define KV__XPORT_OK ((struct kv__xport_verdict){.st = KV_OK})
static inline bool kv__xport_ok(const struct kv__xport_verdict *v)
{
    return v->st == KV_OK && !v->msg[0];
}
/* A verdict closing with st, its message formatted from fmt. */
struct kv__xport_verdict kv__xport_bad(kv_status st, const char *fmt, ...) KV_PRINTF(2, 3);

/* A progress thread's wake-up pipe (a socket backend's): one byte written
 * to its write end fd (a full pipe is already a pending wake-up), and its
 * read end fd emptied once poll saw it readable. */
void kv__xport_wake_pipe(int fd);
void kv__xport_wake_drain(int fd);

/* mu held: t ends in state (terminal) now: unended entries get `why`;
 * it leaves the peer's list; waiters are woken. */
void kv__xport_xfer_end(kv_xport_xfer *t, kv_xport_state state, kv_status why);

/* mu held: the state a transfer whose entries have all ended reaches next:
 * true (and t terminal) when it is DONE or FAILED; false while its
 * notification is still to be sent or acknowledged. */
bool kv__xport_xfer_settle(kv_xport_xfer *t);

/* mu held: whether every transfer posted on p before t has ended all its
 * entries successfully (and t's own): t's notification may go. */
bool kv__xport_note_may_go(const kv_xport_xfer *t);

/* mu held: the first transfer from t on (t, t->next, ...) whose
 * notification may go now (kv__xport_note_may_go), skipping those without
 * one, sent or cancelled; NULL when none may go yet. A backend's flush:
 * for (t = kv__xport_note_next(p->xfers); t; t = kv__xport_note_next(t->next)). */
kv_xport_xfer *kv__xport_note_next(kv_xport_xfer *t);

/* mu held: settle (kv__xport_xfer_settle) every transfer of p whose entries
 * have all ended and that has nothing on the wire (busy == 0) nor a frame
 * sent and not yet acknowledged (unacked == 0). */
void kv__xport_settle_idle(kv_xport_peer *p);

/* mu held: t's send cursor (be_entry, be_off, be_seg, be_rep, be_seg_off)
 * back to its start: a backend's post. */
static inline void kv__xport_cursor_reset(kv_xport_xfer *t)
{
    t->be_entry = 0;
    t->be_off = 0;
    t->be_seg = 0;
    t->be_rep = 0;
    t->be_seg_off = 0;
}

/* mu held: the source ranges of t's gathered entry io (t->seg) from t's send
 * cursor on, appended at src[*ns] / len[*ns] until the entry ends, *bytes
 * reaches cap or *ns reaches max_src; *bytes and *ns count what was taken
 * and the cursor (be_off, be_seg, be_rep, be_seg_off) moves past it. A
 * backend's cut of a WRITE. */
static inline void kv__xport_cursor_gather(kv_xport_xfer *t, const struct kv_xport_io *io,
                                           uint64_t cap, uint32_t max_src, const char **src,
                                           uint64_t *len, uint32_t *ns, uint64_t *bytes)
{
    while (t->be_off < io->bytes && *bytes < cap && *ns < max_src) {
        const struct kv__xport_seg *sg = &t->seg[t->be_seg];
        const uint64_t rest = sg->bytes - t->be_seg_off;
        const uint64_t n = rest < cap - *bytes ? rest : cap - *bytes;
        src[*ns] = io->local->base + sg->off + t->be_rep * sg->pitch + t->be_seg_off;
        len[(*ns)++] = n;
        *bytes += n;
        t->be_off += n;
        t->be_seg_off += n;
        if (t->be_seg_off == sg->bytes) {
            t->be_seg_off = 0;
            if (++t->be_rep == sg->count) {
                t->be_rep = 0;
                t->be_seg++;
            }
        }
    }
}

/* The smaller of a and b (deadlines). */
static inline uint64_t kv__xport_min64(uint64_t a, uint64_t b)
{
    return a < b ? a : b;
}

/* A progress thread's poll timeout in ms for the next deadline d (ns;
 * UINT64_MAX: none): to d from now, rounded up, at most 1000 and cap_ms. */
static inline int kv__xport_poll_ms(uint64_t d, uint32_t cap_ms)
{
    const uint64_t now = kv__now_ns();
    const int ms = d == UINT64_MAX ? 1000
                   : d <= now      ? 0
                                   : (int)kv__xport_min64((d - now) / 1000000u + 1, 1000);
    return ms > (int)cap_ms ? (int)cap_ms : ms;
}

/* mu held: the peer refused t's notification with st (detail msg). */
void kv__xport_note_refused(kv_xport_xfer *t, kv_status st, const char *msg);

/* The message of a peer's refusal of the notification (note) or of entry
 * `entry` of our transfer `xfer`, into why[cap]: "peer P refused the
 * notification of transfer X: KV_ERR_CAPACITY (its queue ...)", the limit
 * named for KV_ERR_CAPACITY; s is kv__xport_wire_status of the wire value
 * `wire` (one that is not a kv_status is named as such). All three
 * backends. */
void kv__xport_refusal_msg(char *why, size_t cap, uint64_t peer, uint64_t xfer, bool note,
                           uint32_t entry, int64_t wire, kv_status s);

/* mu held: the peer's handshake completed (accept queue for incoming). */
void kv__xport_peer_ready(kv_xport_peer *p);

/* mu held: p is closed (why, message): its exposures end (the backend's
 * unexpose for each; mu may be dropped), every transfer not terminal ends
 * (CANCELLED when asked, else FAILED with why, or KV_ERR_IO for a clean
 * close while transfers were pending). The backend released everything
 * of p it held busy before. */
void kv__xport_peer_closed(kv_xport_peer *p, kv_status why, const char *msg);

/* mu held: a new peer (refs: 1, the backend's). */
kv_xport_peer *kv__xport_peer_new(kv_xport *x, bool outgoing);
/* mu held: drop a reference (frees at 0). */
void kv__xport_peer_unref(kv_xport_peer *p);

/* mu held: may a notification of len bytes from p be queued? KV_OK;
 * KV_ERR_CORRUPT (over KV_XPORT_NOTIFY_MAX: a protocol violation);
 * KV_ERR_CAPACITY (p has max_pending_notes queued). msg (may be NULL) gets
 * the detail. Backends ask before they read the payload. */
kv_status kv__xport_note_admit(const kv_xport_peer *p, uint64_t len, char *msg, size_t cap);
/* mu held: queue a received notification (admitted again).
 * KV_ERR_CORRUPT; KV_ERR_CAPACITY; KV_ERR_NO_MEMORY. */
kv_status kv__xport_note_push(kv_xport_peer *p, uint64_t tag, const void *data, uint32_t len);

/* mu held: the exposure of local region `region` to p if [off, off + len)
 * lies in it; NULL otherwise. */
struct kv__xport_expo *kv__xport_exposed(kv_xport_peer *p, uint32_t region, uint64_t off,
                                         uint64_t len);

/* A transfer with id in p's list (mu held); NULL when none (ended). */
kv_xport_xfer *kv__xport_xfer_find(kv_xport_peer *p, uint64_t id);

/* Create a transport without a progress thread (tests, fuzzing): progress
 * is made by kv__xport_step, one round per call, in the caller's thread.
 * Calls that wait (accept, peer_wait, xfer_wait, notify_poll, unexpose,
 * peer_close) must then be made with nothing left to wait for. */
kv_status kv__xport_create_manual(const struct kv_xport_config *cfg, kv_xport **out);
void kv__xport_step(kv_xport *x, uint32_t timeout_ms);

/* The handshake's payload (both backends): what a HELLO carries, encoded
 * little-endian in KV__XPORT_HELLO_BYTES. */
#define KV__XPORT_HELLO_BYTES 48
struct kv__xport_hello {
    uint32_t version, kind;
    uint64_t token, fingerprint;
    uint64_t nonce;       /* the sender's id of this connection */
    uint64_t echo;        /* the nonce it answers (0 in the first HELLO) */
    uint32_t conns, conn; /* connections per peer, this one's index */
};
void kv__xport_hello_encode(const struct kv__xport_hello *h, unsigned char *out);
void kv__xport_hello_decode(const unsigned char *in, struct kv__xport_hello *h);
/* KV_ERR_MISMATCH naming the first field that differs from x's config
 * (version, kind, token, fingerprint, connections); msg gets the text a
 * REFUSE carries. */
kv_status kv__xport_hello_check(const kv_xport *x, const struct kv__xport_hello *h, char *msg,
                                size_t cap);

/* AUTO's probe (kv_xport_auto.c; docs/connector.md, "Automatic choice"):
 * the connecting side sends a TCP HELLO with conns 0 on a connection of
 * its own; an AUTO listener answers, if the hello checks (token,
 * fingerprint, ...), with a HELLO (conns 0, echo: the probe's nonce) of
 * KV__XPORT_PROBE_BYTES: the hello, then this offer, little-endian:
 *
 *   off size field
 *     0    8 secret (nonzero): what the SHM listener's HELLO echoes (tag)
 *     8    2 port (nonzero) of the SHM listener's abstract name
 *    10    2 name_len, 1 .. KV__XPORT_OFFER_NAME_MAX
 *    12    4 reserved (0)
 *    16   40 name: [0-9a-z-] bytes, zero past name_len
 *    56    8 reserved (0)
 */
#define KV__XPORT_OFFER_BYTES 64
#define KV__XPORT_OFFER_NAME_MAX 40
#define KV__XPORT_PROBE_BYTES (KV__XPORT_HELLO_BYTES + KV__XPORT_OFFER_BYTES)
struct kv__xport_offer {
    uint64_t secret;
    uint16_t port;
    char name[KV__XPORT_OFFER_NAME_MAX + 1];
};
void kv__xport_offer_encode(const struct kv__xport_offer *o, unsigned char *out);
/* The listener's answer to a probe: in[n] is the whole frame (header and
 * payload) as received; x the probing transport, nonce its probe's.
 * KV_OK and *o; a REFUSE: its status (KV_ERR_MISMATCH, ...) with the
 * reason; KV_ERR_CORRUPT naming the first field that fails (the frame
 * header, length, checksum, the hello's conns or echo, the offer's
 * secret, port, name length or bytes, reserved bytes). Pure: fuzzed
 * (tests/fuzz/fuzz_xport_probe.c). */
kv_status kv__xport_probe_parse(const kv_xport *x, uint64_t nonce, const unsigned char *in,
                                size_t n, struct kv__xport_offer *o);
/* mu held, x AUTO: the answer's payload (KV__XPORT_PROBE_BYTES) to the
 * probe hello h (already checked) into out. */
void kv__xport_probe_answer(const kv_xport *x, const struct kv__xport_hello *h, unsigned char *out);
/* The hello of a probe: conns 0 from an AUTO peer. */
static inline bool kv__xport_is_probe(const kv_xport *x, const struct kv__xport_hello *h)
{
    return x->cfg.kind == KV_XPORT_AUTO && h->kind == (uint32_t)KV_XPORT_AUTO && h->conns == 0;
}

/* The blob of an exposure (kv_xport_codec.c has the byte layout). */
#define KV__XPORT_BLOB_HEAD 40
struct kv__xport_blob {
    uint32_t version, kind, region, key_len;
    uint64_t bytes;
    uint64_t exposer, importer; /* the connection's ids on the exposing / importing side */
    unsigned char key[KV__XPORT_KEY_MAX];
};
/* Bytes written to out (at most KV_XPORT_BLOB_MAX). */
size_t kv__xport_blob_encode(const struct kv__xport_blob *b, unsigned char *out);
/* Every field checked: KV_ERR_CORRUPT (length, magic, key length,
 * checksum, region 0 or 0 bytes); KV_ERR_MISMATCH (another version). */
kv_status kv__xport_blob_decode(const void *in, size_t len, struct kv__xport_blob *b);

#endif /* KV_XPORT_INT_H */
