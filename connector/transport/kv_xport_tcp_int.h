/*
 * kv_xport_tcp_int.h - the TCP backend's state, shared by its three files
 * (module-private):
 *
 *   kv_xport_tcp.c     the ops table, connections and peers (open, close),
 *                      the progress loop: poll, accept (with back-off),
 *                      deadlines (transfers, handshakes, incoming frames,
 *                      peers that stop reading);
 *   kv_xport_tcp_rx.c  the receive state machine: frames checked as they
 *                      arrive, every limit asked of the generic layer before
 *                      a payload is read; fuzzed (tests/fuzz/fuzz_xport_rx.c);
 *   kv_xport_tcp_tx.c  the control stream and the send scheduler (data
 *                      frames cut from transfers, reads served).
 *
 * Per connection, two directions:
 *   tx  a control stream (HELLO, REFUSE, ACK, NACK, NOTIFY, READ, BYE: small
 *       frames, sent between data frames) and at most one data frame in
 *       flight (WRITE or RDATA: a 64-byte header, then the payload straight
 *       from registered memory: sendmsg, no staging copy). Data frames are
 *       cut lazily, at most KV__TCP_CHUNK bytes, from the peer's transfers
 *       in post order: a free connection takes the next chunk, so one
 *       transfer stripes over every connection. The payload is hashed with
 *       x->mu dropped (the memory is held: a busy transfer or exposure):
 *       with a verify thread, a connection's next plain WRITE frame is cut
 *       while its current one goes out and hashed there (nx_*, txj), else
 *       by the progress thread before the frame goes.
 *   rx  a header (checked: kv__xf_decode), then the payload: a WRITE's
 *       pieces into the region each names if that region is exposed to this
 *       peer and the range lies inside it (recv straight into place), else
 *       read into a scratch buffer and dropped, refused in the ACK. ACK
 *       only when the payload's XXH3 matches. Each WRITE holds one of its
 *       connection's KV__TCP_VQ verify slots (struct kv__tcp_vjob) from
 *       its descriptor table until it is verified and acknowledged. With a
 *       progress thread (and rx_defer, the default), a WRITE whose pieces
 *       all land in place is hashed by the transport's verify thread once
 *       every piece landed, while the progress thread receives the next
 *       frames (the exposures stay busy until then); otherwise (no
 *       threads, rx_defer off, a refused piece) the
 *       progress thread hashes what each recvmsg returned, x->mu dropped
 *       (also for a frame whose pieces overlap each other).
 *       No byte is received into a range an earlier slot still covers, an
 *       RDATA is landing on, or a frame to send is being hashed from (the
 *       frame waits, not read, until it is free), so a hash never reads
 *       bytes another frame is writing, and pieces whose destinations
 *       overlap are never received by one call.
 * The verify thread (t->vthr) only hashes: it takes QUEUED slots (received
 * WRITEs, a connection's txj) and marks them DONE; the progress thread
 * acknowledges them, since only it writes a control stream (it sends one
 * with x->mu dropped).
 *
 * Bounds (kv_transport.h): a connection stops reading at a frame boundary
 * while more than KV__TCP_CTL_HIGH bytes of control frames wait to be sent
 * (a peer that does not read its ACKs stops being read), and handles at most
 * frames_per_round frames and KV__TCP_RX_BUDGET bytes per round; an
 * incoming frame must complete within timeout_ms of its first byte; a
 * connection with something to send that sends nothing for timeout_ms
 * closes its peer.
 */
#ifndef KV_XPORT_TCP_INT_H
#define KV_XPORT_TCP_INT_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/uio.h>

#include "kv_xport_frame_int.h"
#include "kv_xport_int.h"

#define KV__TCP_CHUNK (512u << 10)    /* payload bytes per data frame sent */
#define KV__TCP_MAXV 64u              /* pieces per WRITE frame */
#define KV__TCP_MAXSRC 2048u          /* source ranges per gathered WRITE frame (packed) */
#define KV__TCP_DESC 24u              /* bytes of a piece's descriptor */
#define KV__TCP_ACK_REC 16u           /* bytes of a piece's ACK record */
#define KV__TCP_MAX_FRAME (16u << 20) /* a larger payload is refused (corrupt) */
#define KV__TCP_RX_BUDGET (8u << 20)  /* bytes received per connection per round */
#define KV__TCP_CTL_HIGH (256u << 10) /* control bytes queued: stop reading above */
#define KV__TCP_SCRATCH (64u << 10)
#define KV__TCP_VQ 3 /* WRITE frames per connection between descriptor table and ACK */
/* The largest payload read into a connection's small[] buffer. */
#define KV__TCP_SMALL                                                                              \
    (KV_XPORT_NOTIFY_MAX > KV__TCP_MAXV * KV__TCP_DESC ? KV_XPORT_NOTIFY_MAX                       \
                                                       : KV__TCP_MAXV * KV__TCP_DESC)
_Static_assert(2 + KV__TCP_MAXV <= 1024, "a frame's iovecs within IOV_MAX (Linux: 1024)");
_Static_assert(KV__TCP_MAXSRC >= KV__TCP_MAXV, "a plain WRITE's pieces fit");
_Static_assert(KV__TCP_SMALL >= KV__TCP_MAXV * KV__TCP_ACK_REC, "an ACK fits in small[]");
_Static_assert(KV__TCP_SMALL >= KV__XPORT_HELLO_BYTES, "a HELLO fits in small[]");

enum kv__rx_phase {
    RX_HDR,     /* filling hdr[] */
    RX_DESC,    /* a WRITE's descriptor table into small[] */
    RX_PIECES,  /* a WRITE's pieces, each into its place (or dropped) */
    RX_LAND,    /* an RDATA's payload into its read */
    RX_SMALL,   /* payload into small[] (HELLO, REFUSE, NOTIFY, READ, ACK) */
    RX_DISCARD, /* payload dropped (read data of an ended transfer, a refused notification) */
};

struct kv__tcp_peer;
struct kv__tcp_conn;

/* A received WRITE from its descriptor table to its ACK (a verify slot):
 *   FREE -> FILLING (its pieces being received: the progress thread)
 *        -> QUEUED (every piece landed: waiting for the verify thread)
 *        -> RUNNING (being hashed, x->mu dropped) -> DONE (ok set)
 *        -> FREE (the progress thread queued its ACK and released the busy
 *   exposures: only that thread writes a control stream). Without a verify thread (or with a refused
 *   piece) it is hashed as it lands (`inline`) and freed at its last byte.
 *   Invariant: a byte covered by a slot that is not FREE is received only
 *   into that slot's frame (kv__tcp_rx_wanted holds any other frame). */
enum kv__vjob_state { VJ_FREE, VJ_FILLING, VJ_QUEUED, VJ_RUNNING, VJ_DONE };

struct kv__tcp_vjob {
    struct kv__tcp_vjob *next; /* the verify thread's queue */
    struct kv__tcp_conn *c;
    enum kv__vjob_state st;
    bool tx;       /* a frame to send (the connection's txj): RUNNING -> DONE, sum in want */
    bool inline_;  /* hashed by the progress thread as it lands */
    bool dead;     /* its connection is closing: no ACK */
    bool ok;       /* DONE (a received WRITE): the hash matched */
    uint64_t xfer; /* the WRITE's transfer id (the sender's) */
    uint64_t want; /* payload_sum */
    uint64_t seq;  /* when it left FREE: a frame waits only for earlier slots */
    uint32_t k;    /* pieces */
    /* a gathered frame to send (tx): its pn source ranges psrc/plen are
     * packed, in order, into pstage (pbytes in all) and the hash taken
     * there; dst/len then hold nothing (lo NULL: no byte of it lands) */
    bool pack;
    uint32_t pn;
    const char *const *psrc;
    const uint64_t *plen;
    char *pstage;
    uint64_t pbytes;
    const char *lo, *hi; /* the hull of the pieces that land in place */
    char *dst[KV__TCP_MAXV];
    uint64_t len[KV__TCP_MAXV];
    uint32_t entry[KV__TCP_MAXV];
    struct kv__xport_expo *expo[KV__TCP_MAXV]; /* busy++ until FREE */
};

/* Reads the peer asked of us (struct kv__xport_serve) are served on the
 * connection they came on, in order (the requester checks each RDATA's
 * offset against what it has); one unexposed while its frame is in flight
 * is NACKed once the frame is out. */

struct kv__tcp_conn {
    int fd;
    uint32_t index;
    struct kv__tcp_peer *tp; /* NULL: incoming, before its HELLO */
    bool connecting;         /* non-blocking connect in progress */
    bool up;                 /* its HELLO exchange is done */
    bool dead;               /* close at the end of this round (unbound conns) */
    uint64_t deadline_ns;    /* unbound: its handshake */
    /* tx: control stream; tx_since_ns: when tx last moved (or became
     * pending): a stall past timeout_ms closes the peer */
    unsigned char *ctl;
    size_t ctl_len, ctl_off, ctl_cap;
    uint64_t tx_since_ns;
    /* tx: the data frame in flight: the header (encoded once its payload is
     * hashed: df_ready), the descriptor table (a WRITE: df_k pieces) and the
     * payload from df_nsrc ranges of registered memory (df_nsrc == df_k
     * unless the transfer is gathered: then, when they are more than the
     * pieces, they are packed into stage[] with the hash, mu dropped, and
     * sent from there as one);
     * df_sent of df_total */
    bool df_on, df_ready;
    struct kv__xf df_f;
    unsigned char df_hdr[KV__XF_BYTES];
    unsigned char df_desc[KV__TCP_MAXV * KV__TCP_DESC];
    uint32_t df_desc_bytes, df_k, df_nsrc;
    bool df_pack; /* a gathered WRITE: pack df_src into stage before sending */
    char *stage;  /* KV__TCP_CHUNK bytes, allocated at the first gathered frame: a
                     connection's staging buffer (with nx_stage, per peer: up to
                     conns_per_peer x 2 x 512 KiB) */
    const char *df_src[KV__TCP_MAXSRC];
    uint64_t df_len[KV__TCP_MAXSRC];
    uint64_t df_total, df_sent;
    kv_xport_xfer *df_t;            /* the WRITE's transfer (busy++) */
    struct kv__xport_serve *df_srv; /* the RDATA's read */
    struct kv__xport_serve *srv_head, *srv_tail;
    /* tx: the next plain WRITE frame (nx_on), cut while df is on the wire
     * and hashed by the verify thread (txj: its pieces; nx_t busy++); it
     * becomes df once df is out and txj is DONE */
    bool nx_on;
    struct kv__xf nx_f;
    unsigned char nx_desc[KV__TCP_MAXV * KV__TCP_DESC];
    kv_xport_xfer *nx_t;
    struct kv__tcp_vjob txj;
    /* the next frame of a gathered transfer: its source ranges, packed by
     * the verify thread into nx_stage (a second KV__TCP_CHUNK buffer,
     * allocated at the first such frame); stage and nx_stage swap when it
     * becomes df */
    char *nx_stage;
    uint32_t nx_nsrc;
    const char *nx_src[KV__TCP_MAXSRC];
    uint64_t nx_len[KV__TCP_MAXSRC];
    /* rx; rx_since_ns: the current frame's first byte (0: between frames) */
    enum kv__rx_phase ph;
    unsigned char hdr[KV__XF_BYTES];
    size_t hdr_got;
    uint64_t rx_since_ns;
    struct kv__xf f;
    char *dst;    /* RX_SMALL, RDATA */
    uint64_t got; /* payload bytes so far */
    /* a WRITE's pieces (rx_j: its verify slot; dst NULL: refused,
     * dropped); rx_held: not read until nothing else covers its bytes */
    uint32_t rx_p;
    uint64_t rx_pgot;
    struct kv__tcp_vjob *rx_j;
    bool rx_held;
    struct kv__tcp_vjob vj[KV__TCP_VQ];
    kv_xport_xfer *land_t; /* busy++ while RX_LAND of an RDATA */
    struct kv__xxh3_state hs;
    unsigned char small[KV__TCP_SMALL];
};

struct kv__tcp_peer {
    kv_xport_peer *p;
    struct kv__tcp_peer *next;
    struct kv__tcp_conn *conns[KV__XPORT_MAX_CONNS];
    uint32_t n_conns, n_up;
    uint32_t n_serves;    /* reads of ours being served to it (<= max_pending_reads) */
    uint64_t deadline_ns; /* handshake */
    bool close_req;       /* the user closed it */
};

struct kv__tcp {
    kv_xport *x;
    int lfd;
    int wake[2];
    pthread_t thr;
    bool stop, thread;
    struct kv__tcp_peer *peers;
    struct kv__tcp_conn **unbound; /* incoming connections before their HELLO */
    uint32_t n_unbound;
    size_t cap_unbound;
    uint64_t accept_pause_ns, accept_backoff_ns; /* the listener rests until then */
    bool accept_said;                            /* the back-off was reported (stderr) */
    /* the verify thread (with the progress thread only): hashes QUEUED
     * slots, vq_head..vq_tail, x->mu dropped; vcv: work for it, vdone: a
     * slot went FREE */
    pthread_t vthr;
    bool vthread, vstop;
    bool rx_defer; /* received WRITEs are hashed by the verify thread (the
                      default, kv__tcp_rx_defer_set); else as they land */
    bool hashed;  /* the verify thread finished a slot since the last round */
    bool polling; /* the progress thread is in poll(), mu dropped: the verify
                     thread wakes it through the pipe (else it sees `hashed`
                     before it polls again, and does not wait) */
    bool vkick;   /* a slot was queued: vcv is signalled once mu is dropped
                     (kv__tcp_unlock), so the verify thread does not wake
                     only to block on mu */
    uint64_t vseq;
    struct kv__tcp_vjob *vq_head, *vq_tail;
    pthread_cond_t vcv, vdone;
    struct pollfd *pfd;                          /* [cap_pfd] */
    struct kv__tcp_conn **pconn;                 /* [cap_pconn]: pfd[i]'s connection */
    size_t cap_pfd, cap_pconn;
    char scratch[KV__TCP_SCRATCH];
};

/* The progress thread drops x->mu (around its system calls and hashing)
 * through this: then it wakes the verify thread if it queued a slot for
 * it. Signalling vcv without the mutex is safe: the verify thread checks
 * its queue under mu before it waits. */
static inline void kv__tcp_unlock(struct kv__tcp *t)
{
    const bool kick = t->vkick;
    t->vkick = false;
    pthread_mutex_unlock(&t->x->mu);
    if (kick)
        pthread_cond_signal(&t->vcv);
}

/* kv_xport_tcp_tx.c (mu held unless said) */
void kv__tcp_wake(struct kv__tcp *t);
bool kv__tcp_ctl_put(struct kv__tcp_conn *c, struct kv__xf f, const void *p, uint32_t len);
size_t kv__tcp_ctl_pending(const struct kv__tcp_conn *c);
bool kv__tcp_put_hello(struct kv__tcp *t, struct kv__tcp_conn *c, kv_xport_peer *p, uint32_t conns);
/* REFUSE with a status (in the offset field) and its reason. */
bool kv__tcp_put_refuse(struct kv__tcp_conn *c, kv_status st, const char *why);
/* The notifications of tp that may go now, in post order. false: out of
 * memory. */
bool kv__tcp_notes_flush(struct kv__tcp_peer *tp);
/* c has something to send; tp has something for a free connection. */
bool kv__tcp_tx_pending(const struct kv__tcp_conn *c);
bool kv__tcp_has_work(const struct kv__tcp *t, const struct kv__tcp_peer *tp);
/* c has no data frame on the wire and the one cut ahead is hashed. */
bool kv__tcp_tx_nx_ready(const struct kv__tcp_conn *c);
/* Send on c until EAGAIN (mu dropped around hashing and send). */
struct kv__xport_verdict kv__tcp_conn_tx(struct kv__tcp *t, struct kv__tcp_conn *c);
/* Drop c's queued reads (the peer is going). */
void kv__tcp_serve_drop(struct kv__tcp_peer *tp, struct kv__tcp_conn *c);
/* e left the peer's table: its queued reads are refused now (NACK), the
 * one on the wire once its frame is out (busy until then). */
void kv__tcp_serve_unexpose(struct kv__tcp_peer *tp, const struct kv__xport_expo *e);

/* kv_xport_tcp_rx.c */
/* Receive on c until EAGAIN, the round's budget or frame count, or the
 * control stream's high-water mark (mu dropped around recv and hashing). */
struct kv__xport_verdict kv__tcp_conn_rx(struct kv__tcp *t, struct kv__tcp_conn *c);
/* Whether c reads now: not held back by its control stream, nor by a
 * verify slot covering bytes its current frame lands on (mu held). */
bool kv__tcp_rx_wanted(struct kv__tcp *t, struct kv__tcp_conn *c);
/* mu held: whether a byte of j's pieces is covered by a receive slot
 * that is not FREE or by an RDATA landing now. */
bool kv__tcp_rx_covers(const struct kv__tcp *t, const struct kv__tcp_vjob *j);
/* mu held: queue j for the verify thread. */
void kv__tcp_vq_push(struct kv__tcp *t, struct kv__tcp_vjob *j);
/* mu held: acknowledge c's received WRITEs the verify thread finished;
 * false: no memory for an ACK. */
bool kv__tcp_vj_collect(struct kv__tcp *t, struct kv__tcp_conn *c);
/* n source ranges src/len packed, in order, into stage (their sum <=
 * KV__TCP_CHUNK); returns the bytes packed. No lock needed. */
uint64_t kv__tcp_pack(char *stage, const char *const *src, const uint64_t *len, uint32_t n);
/* mu held, j QUEUED: take it off the queue and hash it now, on this
 * thread (mu dropped meanwhile): the progress thread does this when it
 * would otherwise wait for the verify thread. */
void kv__tcp_vj_hash_now(struct kv__tcp *t, struct kv__tcp_vjob *j);
/* The verify thread's body (kv_xport_tcp.c starts it). */
void *kv__tcp_verify_main(void *arg);
/* mu held: c closes: its verify slots end (waits for one being hashed)
 * and release what they hold. */
void kv__tcp_vj_drop(struct kv__tcp *t, struct kv__tcp_conn *c);

/* kv_xport_tcp.c */
/* Where transports created from now on verify received WRITEs: on the
 * verify thread once every piece landed (true, the default), or on the
 * progress thread as each recvmsg returns (false: fewer threads to
 * schedule, the bytes hashed while in cache, but the hash on the receive
 * path; measured on 2 cores in docs/benchmarks.md, not better there).
 * Tests run both. */
void kv__tcp_rx_defer_set(bool on);

/* An incoming connection from an fd (accepted, or a socketpair in tests):
 * it goes through the handshake like any other. KV_ERR_CAPACITY when
 * max_handshakes connections are in their handshake (fd refused, closed). */
kv_status kv__tcp_adopt(kv_xport *x, int fd);
/* Connections in their handshake (unbound, or of an incoming peer not yet
 * ready). */
uint32_t kv__tcp_handshaking(const struct kv__tcp *t);

#endif /* KV_XPORT_TCP_INT_H */
