/*
 * kv_xport_int.h - the inside of the transport seam (kv_transport.h), shared
 * by the generic layer (kv_transport.c) and the backends (kv_xport_tcp.c,
 * kv_xport_rdma_verbs.c). Module-private: not installed.
 *
 * Division of work:
 *   generic  the handles and their lifetimes (reference counts), argument
 *            checks at post, the exposure table a receiver checks against,
 *            the blobs, the accept and notification queues, transfer
 *            bookkeeping (per-entry status, the terminal state, waiting);
 *   backend  moving the bytes: its progress thread, connections or queue
 *            pairs, the handshake on the wire, deadlines of what it holds.
 *
 * One mutex per transport (x->mu) guards every field below that is not
 * marked otherwise, in every object of that transport; x->cv is broadcast
 * on every change a caller may wait for (a transfer terminal, a peer ready
 * or closed, a notification queued, a landing write finished). Memory a
 * transfer names is touched only by the backend's progress thread, and only
 * while the transfer is not terminal.
 *
 * Lifetimes: a peer is freed when its references drop to 0: the user's
 * handle (until kv_xport_peer_close), one per transfer and imported region
 * still allocated, and the backend's (until it has closed the peer's
 * connections). A transfer is freed by the user only (kv_xport_xfer_free,
 * once terminal).
 */
#ifndef KV_XPORT_INT_H
#define KV_XPORT_INT_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include "kv_lib.h"
#include "kv_transport.h"

#define KV__XPORT_OPS_VERSION 1u
#define KV__XPORT_KEY_MAX 160 /* backend key bytes inside a blob */
#define KV__XPORT_DEFAULT_TIMEOUT_MS 30000u
#define KV__XPORT_DEFAULT_CONNS 2u
#define KV__XPORT_MAX_CONNS 16u

/* A backend: the versioned ops table (kv__xport_tcp_ops, kv__xport_rdma_ops).
 * Every entry is called with x->mu NOT held unless it says "mu held". */
struct kv__xport_ops {
    uint32_t version; /* KV__XPORT_OPS_VERSION */
    kv_xport_kind kind;
    const char *name;
    /* Backend state into x->be; listen when x->cfg.listen_host; start the
     * progress thread. x->port set when listening. */
    kv_status (*start)(kv_xport *x);
    /* Close every peer (mu taken inside: their transfers end), join the
     * thread, free x->be. */
    void (*stop)(kv_xport *x);
    /* Begin connecting p (state CONNECTING, p->be to be set); the progress
     * thread finishes the handshake and calls kv__xport_peer_ready or
     * kv__xport_peer_closed. */
    kv_status (*connect)(kv_xport_peer *p, const char *host, uint16_t port);
    /* Per-region backend state (RDMA: the MRs) into m->be. */
    kv_status (*mem_reg)(kv_xport_mem *m);
    void (*mem_dereg)(kv_xport_mem *m);
    /* The backend part of a blob exposing m to p: at most KV__XPORT_KEY_MAX
     * bytes into key (TCP: none). */
    kv_status (*mem_key)(kv_xport_peer *p, kv_xport_mem *m, unsigned char *key, uint32_t *len);
    /* mu held: take t (entries checked, state PENDING, on p's list). */
    void (*post)(kv_xport_xfer *t);
    /* mu held: t->cancel_req was just set; end it as soon as nothing of it
     * is in flight. */
    void (*cancel)(kv_xport_xfer *t);
    /* mu held: the user closed p; close its connections (transfers end
     * CANCELLED) from the progress thread and drop the backend's
     * reference. */
    void (*peer_close)(kv_xport_peer *p);
};

/* The backends. This header is the RDMA boundary: a build without
 * rdma-core has no RDMA ops (kv_xport_create says KV_ERR_UNSUPPORTED). */
extern const struct kv__xport_ops kv__xport_tcp_ops;
#if KV_HAVE_RDMA
extern const struct kv__xport_ops kv__xport_rdma_ops;
#define KV__XPORT_RDMA_OPS (&kv__xport_rdma_ops)
#else
#define KV__XPORT_RDMA_OPS NULL
#endif

/* A notification received, queued for kv_xport_notify_poll. */
struct kv__xport_note {
    struct kv__xport_note *next;
    kv_xport_peer *peer; /* holds a reference until polled */
    uint64_t tag;
    uint32_t len;
    unsigned char data[];
};

struct kv_xport {
    struct kv_xport_config cfg; /* defaults applied; listen_host -> host[] */
    char host[64];
    const struct kv__xport_ops *ops;
    void *be;
    uint16_t port;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    kv_xport_peer *peers;                     /* every peer not yet freed */
    kv_xport_peer *accept_head, *accept_tail; /* ready, not yet accepted */
    struct kv__xport_note *note_head, *note_tail;
    kv_xport_mem *mems;
    uint32_t next_region; /* region ids: 1, 2, ... (0 never names one) */
    uint64_t next_xfer;   /* transfer ids: 1, 2, ... */
};

struct kv_xport_mem {
    kv_xport *x;
    kv_xport_mem *next;
    char *base;
    uint64_t bytes;
    enum kv_mem_kind kind;
    uint32_t region;
    uint32_t users;   /* transfers not freed that name it + exposures */
    uint32_t landing; /* incoming writes being received into it now */
    void *be;
};

struct kv_xport_peer {
    kv_xport *x;
    kv_xport_peer *next;        /* x->peers */
    kv_xport_peer *accept_next; /* x->accept_head */
    uint32_t refs;
    kv_xport_peer_state state;
    kv_status why; /* CLOSED: why (KV_OK for a clean close) */
    char why_msg[256];
    bool outgoing;    /* made by kv_xport_connect */
    bool user_closed; /* kv_xport_peer_close called */
    bool user_owned;  /* the user holds a handle (connect, or accept returned it) */
    uint64_t nonce_local, nonce_remote; /* this connection's ids on each side */
    kv_xport_mem **exposed;             /* what this peer may write or read */
    uint32_t n_exposed, cap_exposed;
    kv_xport_xfer *xfers; /* not yet terminal, oldest first (via next) */
    kv_xport_xfer *xfers_tail;
    void *be;
};

struct kv_xport_rmem {
    kv_xport_peer *peer; /* a reference */
    uint32_t region;     /* the peer's region id */
    uint64_t bytes;
    uint32_t key_len;
    unsigned char key[KV__XPORT_KEY_MAX];
};

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
    uint64_t note_tag;
    uint32_t note_len;
    unsigned char *note;
    kv_xport_state state;
    uint64_t post_ns, deadline_ns;
    bool cancel_req;
    uint32_t busy;             /* backend: frames of it on the wire or landing now */
    uint64_t be_entry, be_off; /* backend: the send cursor */
};

/* Monotonic nanoseconds. */
uint64_t kv__xport_now_ns(void);

/* mu held: entry i of t ended with st (KV_OK: all its bytes moved). */
void kv__xport_entry_end(kv_xport_xfer *t, uint32_t i, kv_status st);

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

/* mu held: the peer's handshake completed (accept queue for incoming). */
void kv__xport_peer_ready(kv_xport_peer *p);

/* mu held: p is closed (why, message): every transfer not terminal ends
 * (CANCELLED when asked, else FAILED with why, or KV_ERR_IO for a clean
 * close while transfers were pending). */
void kv__xport_peer_closed(kv_xport_peer *p, kv_status why, const char *msg);

/* mu held: a new peer (refs: 1, the backend's). */
kv_xport_peer *kv__xport_peer_new(kv_xport *x, bool outgoing);
/* mu held: drop a reference (frees at 0). */
void kv__xport_peer_unref(kv_xport_peer *p);

/* mu held: queue a received notification. KV_ERR_NO_MEMORY. */
kv_status kv__xport_note_push(kv_xport_peer *p, uint64_t tag, const void *data, uint32_t len);

/* mu held: the region p exposed to us... the local region `region` if it is
 * exposed to p and [off, off + len) lies in it; NULL otherwise. */
kv_xport_mem *kv__xport_exposed(kv_xport_peer *p, uint32_t region, uint64_t off, uint64_t len);

/* A transfer with id in p's list (mu held); NULL when none (ended). */
kv_xport_xfer *kv__xport_xfer_find(kv_xport_peer *p, uint64_t id);

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

#endif /* KV_XPORT_INT_H */
