/*
 * kv_xport_shm_int.h - the same-host backend of the transport seam
 * (KV_XPORT_SHM; module-private). docs/connector.md, "Same-host transport".
 *
 *   kv_xport_shm.c     the ops table, peers, the progress loop (poll,
 *                      accept, deadlines), the send scheduler;
 *   kv_xport_shm_rx.c  the control-message codec and the receive side:
 *                      every message a peer sends checked before anything
 *                      is copied; fuzzed (tests/fuzz/fuzz_xport_shm_rx.c).
 *
 * Per peer: one Unix-domain SOCK_SEQPACKET connection (control: one message
 * per recv, never a partial frame) and one memfd (created by the connecting
 * side, sealed against shrinking, passed with SCM_RIGHTS in its HELLO and
 * mapped by both) holding two rings of KV__SHM_SLOTS slots of KV__SHM_SLOT
 * bytes, one per direction:
 *
 *   memfd  |conn->listener slot 0 .. 7 |listener->conn slot 0 .. 7|
 *           each side writes only its own ring (its tx), reads the other's
 *
 * The shared memory holds payload bytes only. Which slot holds what, and
 * where it goes, travels in the control message (DATA: slot, descriptor
 * table of up to KV__SHM_MAXV pieces {entry, region, offset, bytes}); the
 * receiver checks the table against its exposure table (as TCP's receiver
 * does), copies each piece from the slot into place, and answers with an
 * ACK record per piece; the ACK returns the slot. The sender owns a slot
 * from its DATA to that ACK (RDATA to FREE for reads served) and records
 * what it put there; an ACK must match the record. Nothing is read from the
 * shared memory but payload, so a peer scribbling on it can only change
 * bytes it was allowed to write anyway.
 *
 * Addresses: listen_host "/path" binds a filesystem socket there (port
 * unused, reported 0); any other listen_host binds the abstract socket
 * "kvcache-shm:<host>:<port>" (port 0: a free one, kv_xport_port); connect
 * takes the same (host, port).
 */
#ifndef KV_XPORT_SHM_INT_H
#define KV_XPORT_SHM_INT_H

#include <stdbool.h>
#include <stdint.h>
#include <poll.h>

#include "kv_wire.h"
#include "kv_xport_int.h"

#define KV__SHM_SLOT (1024u << 10)    /* bytes per slot */
#define KV__SHM_SLOTS 8u              /* slots per direction */
#define KV__SHM_MAXV 64u              /* pieces per DATA message */
#define KV__SHM_MAXSRC 4096u          /* source ranges per slot (a gathered write) */
#define KV__SHM_HDR 64u               /* bytes of a message header */
#define KV__SHM_DESC 24u              /* bytes of a DATA piece's descriptor */
#define KV__SHM_REC 16u               /* bytes of an ACK record */
#define KV__SHM_CTL_HIGH (256u << 10) /* control bytes queued: stop reading above */
#define KV__SHM_RX_BUDGET (8u << 20)  /* bytes copied in per peer per round */
#define KV__SHM_MSG_MAX (KV__SHM_HDR + KV_XPORT_NOTIFY_MAX)
#define KV__SHM_RING_BYTES ((uint64_t)KV__SHM_SLOTS * KV__SHM_SLOT)
_Static_assert(KV__SHM_MAXV *KV__SHM_DESC <= KV_XPORT_NOTIFY_MAX, "a DATA table fits");
_Static_assert(KV__SHM_MAXV *KV__SHM_REC <= KV_XPORT_NOTIFY_MAX, "an ACK fits");
_Static_assert(KV__XPORT_HELLO_BYTES <= KV_XPORT_NOTIFY_MAX, "a HELLO fits");

/* Messages: a 64-byte little-endian header, then plen payload bytes.
 *
 *   off size field      off size field
 *     0    4 magic KVSM  28    4 status (int32)
 *     4    2 version     32    8 off
 *     6    2 type        40    8 len
 *     8    4 slot        48    8 tag
 *    12    4 entry       56    4 plen (payload bytes after the header)
 *    16    8 xfer        60    4 reserved (0)
 *    24    4 region
 */
enum kv__shm_type {
    KV__SM_HELLO = 1,    /* payload: kv__xport_hello; slot: slots, len: slot bytes; the
                            connecting side's carries the memfd (SCM_RIGHTS) */
    KV__SM_REFUSE = 2,   /* status; payload: the reason */
    KV__SM_DATA = 3,     /* slot of the sender's ring; entry: pieces; len: their bytes;
                            payload: the descriptor table */
    KV__SM_ACK = 4,      /* slot returned; entry: records; payload: {entry, status, bytes} */
    KV__SM_NOTIFY = 5,   /* xfer, tag; payload: the notification */
    KV__SM_NOTE_ACK = 6, /* xfer; status: KV_OK or why the notification was refused */
    KV__SM_READ = 7,     /* xfer, entry; [off, +len) of region */
    KV__SM_RDATA = 8,    /* slot; len bytes of entry of xfer at off (in the entry) */
    KV__SM_RNACK = 9,    /* entry of xfer (a read) refused: status */
    KV__SM_FREE = 10,    /* slot of the receiver's ring (an RDATA's) returned */
    KV__SM_BYE = 11,
    KV__SM_TYPE_MAX = KV__SM_BYE,
};

struct kv__shm_msg {
    uint16_t version, type;
    uint32_t slot, entry, region;
    int32_t status;
    uint64_t xfer, off, len, tag;
    uint32_t plen;
};

void kv__shm_msg_encode(const struct kv__shm_msg *m, unsigned char out[KV__SHM_HDR]);
/* m from n received bytes: KV_ERR_CORRUPT naming the first field that fails
 * (length, magic, reserved, type, plen against n); KV_ERR_MISMATCH for
 * another protocol version. */
kv_status kv__shm_msg_decode(const unsigned char *in, size_t n, struct kv__shm_msg *m);

/* Reads the peer asked of us (struct kv__xport_serve) are served through
 * our ring in order; one unexposed while being copied is RNACKed once its
 * last RDATA is out. */

/* A slot of our ring, owned from its DATA / RDATA until its ACK / FREE
 * (sent_ns: when it was filled; one unanswered for timeout_ms while the
 * peer leaves our messages unread closes the peer). */
struct kv__shm_slot {
    bool used, serve;
    uint64_t xfer;
    uint64_t sent_ns;
    uint32_t k;
    uint32_t entry[KV__SHM_MAXV];
    uint64_t len[KV__SHM_MAXV];
};

struct kv__shm_peer {
    kv_xport_peer *p; /* NULL: incoming, before its HELLO */
    struct kv__shm_peer *next;
    int fd;
    bool dead;            /* an unbound one: close at the end of the round */
    bool close_req;       /* the user closed it */
    uint64_t deadline_ns; /* handshake */
    char *map;            /* the memfd, 2 x KV__SHM_RING_BYTES; NULL before the HELLO */
    char *tx, *rx;        /* our ring, the peer's */
    struct kv__shm_slot slot[KV__SHM_SLOTS];
    uint32_t n_used;
    struct kv__xport_serve *srv_head, *srv_tail, *srv_cur; /* srv_cur: being copied */
    uint32_t n_serves;                                     /* <= max_pending_reads */
    unsigned char *ctl; /* queued messages: {u32 length, bytes} each */
    size_t ctl_len, ctl_off, ctl_cap;
    uint64_t tx_since_ns;             /* when ctl last moved or became pending */
    const char *gsrc[KV__SHM_MAXSRC]; /* the slot being filled: its source ranges */
    uint64_t glen[KV__SHM_MAXSRC];
    uint64_t rx_copied; /* this round's bytes copied in (DATA, RDATA) */
    uint64_t expect_secret; /* AUTO, connecting: what the listener's HELLO must echo (0: none) */
    unsigned char rbuf[KV__SHM_MSG_MAX + 8];
};

struct kv__shm {
    kv_xport *x;
    int lfd;
    int wake[2];
    pthread_t thr;
    bool stop, thread;
    char path[108]; /* a filesystem socket we bound (unlinked at stop); "" */
    struct kv__shm_peer *peers;
    struct kv__shm_peer **pl; /* poll set's peers */
    struct pollfd *pfd;
    size_t cap_pfd, cap_pl;
};

extern const struct kv__xport_ops kv__xport_shm_ops;

/* kv_xport_shm.c (mu held unless said) */
/* The backend's state of x (x->be; AUTO: x->be_shm). */
struct kv__shm *kv__shm_of(const kv_xport *x);
/* mu not held: connect p (CONNECTING, p->ops the SHM backend's) to the
 * listener at (host, port), as kv_xport_connect of an SHM transport; with
 * secret != 0 (AUTO), the listener's HELLO must echo it (its tag) or the
 * peer is refused with KV_ERR_MISMATCH ("the same-host proof"). The
 * statuses of kv_xport_connect: KV_ERR_IO when nothing listens there. */
kv_status kv__shm_connect_proof(kv_xport_peer *p, const char *host, uint16_t port,
                                uint64_t secret);
void kv__shm_wake(struct kv__shm *t);
/* Queue message m (payload p, plen bytes) on tp's control stream. */
bool kv__shm_put(struct kv__shm_peer *tp, struct kv__shm_msg m, const void *p, uint32_t plen);
/* Send what is queued until the socket is full. */
struct kv__xport_verdict kv__shm_flush(struct kv__shm_peer *tp);
bool kv__shm_notes_flush(struct kv__shm_peer *tp);
/* Map memfd fd (checked: a memfd sealed against shrinking, of the right
 * size; its pages allocated), our ring the first half when connecting.
 * fd stays the caller's. */
struct kv__xport_verdict kv__shm_map(struct kv__shm_peer *tp, int fd, bool connecting);
/* Send our HELLO on tp (the memfd with it when fd >= 0), now. */
struct kv__xport_verdict kv__shm_hello(struct kv__shm *t, struct kv__shm_peer *tp, int fd);
/* An incoming connection (accepted, or a socketpair end in tests and
 * fuzzing): through the handshake like any other. KV_ERR_CAPACITY over
 * max_handshakes (fd closed). */
kv_status kv__shm_adopt(kv_xport *x, int fd);

/* kv_xport_shm_rx.c */
/* Receive on tp until EAGAIN, frames_per_round messages or
 * KV__SHM_RX_BUDGET bytes copied in, or its control stream's high-water
 * mark; every fd a message carries is closed unless
 * the HELLO takes it. */
struct kv__xport_verdict kv__shm_rx(struct kv__shm *t, struct kv__shm_peer *tp);
/* Handle one received message (len bytes in tp->rbuf; fd: the descriptor
 * it carried, -1: none; taken). */
struct kv__xport_verdict kv__shm_on_msg(struct kv__shm *t, struct kv__shm_peer *tp, size_t len,
                                        int fd);
bool kv__shm_rx_wanted(const struct kv__shm_peer *tp);

#endif /* KV_XPORT_SHM_INT_H */
