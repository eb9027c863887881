/*
 * kv_xport_layers.h - layer-by-layer transfer of a request (prefill ->
 * decode) on top of kv_transport.h (docs/connector.md, "Layer by layer").
 *
 * Prefill writes a request's K/V one layer (or one group of layers) at a
 * time; as soon as a group is written it posts it, so the transfer of
 * layer l overlaps the compute of layer l + 1. Decode waits for
 * (request, layer) and may start on layer 0 while later layers travel.
 *
 *   prefill (kv_xlayer_tx)                      decode (kv_xlayer_rx)
 *                                               kv_xlayer_rx_expect(peer, req, L)
 *   kv_xlayer_tx_begin(peer, req, L)
 *   for each group [l0, l0 + n) once written:
 *     kv_xlayer_tx_post(req, plan, l0, n, ...)  kv_xport_notify_poll -> msg
 *       = kv_xport_write_plan + a notification  kv_xlayer_rx_feed(msg)   (tag KV_XLAYER_TAG)
 *         LAYERS(req, l0, n) after the data     kv_xlayer_rx_wait(req, l) -> KV_OK: attend
 *   kv_xlayer_tx_finished -> (req, status)      kv_xlayer_rx_finished -> (req, status)
 *     once: the source blocks may be released     once: the blocks may be released
 *                                                       (or attended over when KV_OK)
 *
 * Completion, failure and cancel are per request. A request is DONE when
 * all of its L layers landed. It FAILS as a whole when one of its layer
 * transfers fails (refused, timed out, the peer lost) or is cancelled
 * (kv_xlayer_tx_cancel): prefill cancels the rest, and once none of its
 * transfers is in flight sends decode an ABORT(req, status) notification;
 * decode may also fail a request itself (kv_xlayer_rx_fail: a deadline, an
 * unexposed cache). A failed request is never attended over: every wait on
 * any of its layers, landed or not, returns its failure, and waiters
 * sleeping on later layers wake with it. Each side reports each request
 * exactly once through its _finished call, after which it forgets it.
 * Decode reports a request it failed itself only once prefill writes no
 * more of its blocks: prefill's ABORT for it, or its last layer landed, or
 * the caller's kv_xlayer_rx_release (it closed the peer or unexposed the
 * cache); until then the request is held, so its blocks are not reused
 * while prefill still writes them.
 *
 * The notification (KV_XLAYER_NOTE_BYTES, little-endian, tag KV_XLAYER_TAG):
 *
 *   offset  size  field
 *        0     4  magic     0x574C564B ("KVLW")
 *        4     2  version   1
 *        6     1  kind      1 = LAYERS (data of layers landed), 2 = ABORT
 *        7     1  zero
 *        8     8  request   the request id (any value)
 *       16     4  layer0    LAYERS: first destination layer; ABORT: 0
 *       20     4  n_layers  LAYERS: 1 .. KV_XLAYER_LAYERS_MAX; ABORT: 0
 *       24     4  status    ABORT: the failure (a negative kv_status); LAYERS: 0
 *       28     4  zero
 *
 * Decode parses it as hostile bytes (kv_xlayer_note_decode): a length,
 * magic, version, kind, reserved field or status outside this table is
 * KV_ERR_CORRUPT. A peer cannot make decode hold anything: only requests
 * decode registered itself (kv_xlayer_rx_expect, at most max_requests) are
 * tracked, and each only for the peer it was registered for.
 *
 * Thread safety: kv_xlayer_rx is Thread-safe: one thread may feed
 * notifications while others wait (one lock guards every request).
 * kv_xlayer_tx: one thread per handle.
 */
#ifndef KV_XPORT_LAYERS_H
#define KV_XPORT_LAYERS_H

#include <stddef.h>
#include <stdint.h>

#include "kv_plan.h"
#include "kv_status.h"
#include "kv_transport.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KV_XLAYER_TAG 0x574C564Bull /* the kv_xport_notify tag of every layer notification */
#define KV_XLAYER_NOTE_BYTES 32u
#define KV_XLAYER_VERSION 1u
#define KV_XLAYER_LAYERS_MAX 4096u        /* layers of one request */
#define KV_XLAYER_REQUESTS_MAX 65536u     /* bound on max_requests */
#define KV_XLAYER_TX_SLOTS_MAX (1u << 22) /* bound on a kv_xlayer_tx's max_requests x max_layers   \
                                           */

typedef enum kv_xlayer_kind {
    KV_XLAYER_LAYERS = 1, /* layers [layer0, layer0 + n_layers) of request landed */
    KV_XLAYER_ABORT = 2,  /* request failed as a whole with status */
} kv_xlayer_kind;

/* One notification, decoded. */
struct kv_xlayer_note {
    kv_xlayer_kind kind;
    uint64_t request;
    uint32_t layer0;
    uint32_t n_layers;
    kv_status status;
};

/* The KV_XLAYER_NOTE_BYTES bytes of note at out (no check beyond what a
 * caller of this library can pass). */
KV_API void kv_xlayer_note_encode(const struct kv_xlayer_note *note,
                                  unsigned char out[KV_XLAYER_NOTE_BYTES]);

/* Parse len bytes from a peer. KV_ERR_NULL; KV_ERR_CORRUPT (length, magic,
 * version, kind, a reserved byte, a LAYERS range outside [0,
 * KV_XLAYER_LAYERS_MAX) or empty, an ABORT status that is not a failure
 * kv_status: each named with its value). *out set only on success. */
KV_API KV_NODISCARD kv_status kv_xlayer_note_decode(const void *p, size_t len,
                                                    struct kv_xlayer_note *out);

/* A request that reached its terminal state: status KV_OK (every layer
 * landed / acknowledged) or its failure. Reported once. */
struct kv_xlayer_done {
    uint64_t request;
    kv_status status;
};

/* ---- decode side ---------------------------------------------------- */

typedef struct kv_xlayer_rx kv_xlayer_rx;

/* Input of kv_xlayer_rx_create. Start from KV_XLAYER_RX_CONFIG_INIT. */
struct kv_xlayer_rx_config {
    size_t struct_size;
    uint32_t max_requests; /* requests tracked at once (expected, not yet reported by
                              _finished); 0 = 256; at most KV_XLAYER_REQUESTS_MAX */
    uint32_t max_layers;   /* layers of one request; 0 = 128; at most KV_XLAYER_LAYERS_MAX */
};
#define KV_XLAYER_RX_CONFIG_INIT                                                                   \
    {                                                                                              \
        .struct_size = sizeof(struct kv_xlayer_rx_config)                                          \
    }

/* KV_ERR_NULL; KV_ERR_INVALID_ARG (struct_size, a limit over its bound);
 * KV_ERR_NO_MEMORY. */
KV_API KV_NODISCARD kv_status kv_xlayer_rx_create(const struct kv_xlayer_rx_config *cfg,
                                                  kv_xlayer_rx **out);

/* Free (requests still tracked are forgotten). KV_ERR_BAD_STATE, naming
 * the count, while a thread waits in kv_xlayer_rx_wait: nothing freed.
 * NULL: KV_OK. */
KV_API KV_NODISCARD kv_status kv_xlayer_rx_destroy(kv_xlayer_rx *rx);

/* Track request from peer peer_id (kv_xport_peer_id) with n_layers layers
 * (the decoder's layers [0, n_layers)), before its blocks can be written:
 * notifications of requests not expected are refused. KV_ERR_NULL;
 * KV_ERR_INVALID_ARG (n_layers 0 or over max_layers); KV_ERR_BAD_STATE (the
 * request is tracked already); KV_ERR_CAPACITY (max_requests tracked). */
KV_API KV_NODISCARD kv_status kv_xlayer_rx_expect(kv_xlayer_rx *rx, uint64_t peer_id,
                                                  uint64_t request, uint32_t n_layers);

/* Account one notification (its tag must be KV_XLAYER_TAG): LAYERS marks
 * the layers landed (every byte of them has, by the transport's order) and
 * wakes their waiters; ABORT fails the request. A notification of a
 * request already terminal is ignored (KV_OK, counted as late). A refused
 * one changes nothing: KV_ERR_NULL; KV_ERR_INVALID_ARG (another tag);
 * KV_ERR_CORRUPT (kv_xlayer_note_decode; a layer that landed already);
 * KV_ERR_NOT_FOUND (a request not expected); KV_ERR_MISMATCH (expected from
 * another peer); KV_ERR_OUT_OF_BOUNDS (layers past the request's). */
KV_API KV_NODISCARD kv_status kv_xlayer_rx_feed(kv_xlayer_rx *rx, const struct kv_xport_msg *msg);

/* Wait at most timeout_ms until layer `layer` of request has landed:
 * KV_OK; the request's failure (a failed request answers it for every
 * layer); KV_ERR_TIMEOUT; KV_ERR_NOT_FOUND (not tracked: never expected or
 * already reported by _finished); KV_ERR_OUT_OF_BOUNDS (layer >= its
 * n_layers); KV_ERR_NULL. */
KV_API KV_NODISCARD kv_status kv_xlayer_rx_wait(kv_xlayer_rx *rx, uint64_t request, uint32_t layer,
                                                uint32_t timeout_ms);

/* Fail request from this side with why (a failure kv_status): its waiters
 * wake with why at once. The request is held, not reported by
 * kv_xlayer_rx_finished, until prefill writes no more of its blocks:
 * prefill's ABORT for it arrives, or the LAYERS notifications of its last
 * layers (prefill's transfers go on until it learns of the failure), or
 * kv_xlayer_rx_release. (Until 2026-12-05 it was reported at once, and a
 * caller that reused its blocks had them overwritten by prefill's later
 * layers.) KV_ERR_NOT_FOUND; KV_ERR_BAD_STATE (already terminal);
 * KV_ERR_INVALID_ARG (why not a failure). */
KV_API KV_NODISCARD kv_status kv_xlayer_rx_fail(kv_xlayer_rx *rx, uint64_t request, kv_status why);

/* A request failed from this side (kv_xlayer_rx_fail) and held: reported
 * now. Call it once no byte of the request can land any more: the peer
 * closed (kv_xport_peer_close, or its state CLOSED), or the cache's region
 * unexposed to it (kv_xport_mem_unexpose: it waits for the copies in
 * flight and refuses the rest). KV_ERR_NULL; KV_ERR_NOT_FOUND;
 * KV_ERR_BAD_STATE (not held: in flight, or reportable already). */
KV_API KV_NODISCARD kv_status kv_xlayer_rx_release(kv_xlayer_rx *rx, uint64_t request);

/* Up to cap terminal requests not reported before, oldest first, into
 * out[*n]; each is reported once and then forgotten (its blocks are the
 * caller's again; a later wait on it is KV_ERR_NOT_FOUND). KV_ERR_NULL;
 * KV_ERR_INVALID_ARG (out not aligned for its struct, cap > 0: nothing
 * reported). */
KV_API KV_NODISCARD kv_status kv_xlayer_rx_finished(kv_xlayer_rx *rx, struct kv_xlayer_done *out,
                                                    uint32_t cap, uint32_t *n);

struct kv_xlayer_rx_stats {
    size_t struct_size;
    uint64_t notes_layers;  /* LAYERS notifications accounted */
    uint64_t notes_abort;   /* ABORT notifications accounted */
    uint64_t notes_late;    /* ignored: their request was terminal already */
    uint64_t notes_refused; /* refused by kv_xlayer_rx_feed */
    uint32_t tracked;       /* requests tracked now */
    uint32_t waiting;       /* threads inside kv_xlayer_rx_wait now */
};
#define KV_XLAYER_RX_STATS_INIT                                                                    \
    {                                                                                              \
        .struct_size = sizeof(struct kv_xlayer_rx_stats)                                           \
    }
/* KV_ERR_NULL; KV_ERR_INVALID_ARG (struct_size). */
KV_API KV_NODISCARD kv_status kv_xlayer_rx_stats_get(kv_xlayer_rx *rx,
                                                     struct kv_xlayer_rx_stats *out);

/* ---- prefill side --------------------------------------------------- */

typedef struct kv_xlayer_tx kv_xlayer_tx;

struct kv_xlayer_tx_config {
    size_t struct_size;
    uint32_t max_requests; /* requests open at once; 0 = 256; at most KV_XLAYER_REQUESTS_MAX */
    uint32_t max_layers;   /* layers of one request; 0 = 128; at most KV_XLAYER_LAYERS_MAX */
};
#define KV_XLAYER_TX_CONFIG_INIT                                                                   \
    {                                                                                              \
        .struct_size = sizeof(struct kv_xlayer_tx_config)                                          \
    }

/* Holds 12 bytes per (request, layer) slot, allocated here.
 * KV_ERR_NULL; KV_ERR_INVALID_ARG (struct_size, a limit over its bound,
 * max_requests x max_layers over KV_XLAYER_TX_SLOTS_MAX); KV_ERR_NO_MEMORY. */
KV_API KV_NODISCARD kv_status kv_xlayer_tx_create(const struct kv_xlayer_tx_config *cfg,
                                                  kv_xlayer_tx **out);

/* Free. KV_ERR_BAD_STATE, naming the count, while requests are open (not
 * yet reported by kv_xlayer_tx_finished): cancel them and collect them
 * first. NULL: KV_OK. */
KV_API KV_NODISCARD kv_status kv_xlayer_tx_destroy(kv_xlayer_tx *tx);

/* Open request to peer with n_layers layers (the decoder's count: the
 * request is DONE once every one of them was posted and acknowledged).
 * The request holds a reference on the peer until it is reported: a peer
 * closed meanwhile ends its transfers and the request fails (reported
 * once, like any failure), and kv_xport_destroy is refused until it has
 * been reported. KV_ERR_NULL;
 * KV_ERR_INVALID_ARG (n_layers 0 or over max_layers); KV_ERR_BAD_STATE
 * (request open already); KV_ERR_CAPACITY (max_requests open). */
KV_API KV_NODISCARD kv_status kv_xlayer_tx_begin(kv_xlayer_tx *tx, kv_xport_peer *peer,
                                                 uint64_t request, uint32_t n_layers);

/* Post the destination layers [layer0, layer0 + n_layers) of request: one
 * kv_xport_write_plan of plan (built with dst_layer0 = layer0 and this
 * n_layers: the plan decides what moves, these name it to decode) with the
 * LAYERS notification. The arguments after n_layers are those of
 * kv_xport_write_plan; the memory belongs to the request until it is
 * reported. KV_ERR_NULL; KV_ERR_NOT_FOUND (request not open);
 * KV_ERR_BAD_STATE (the request failed: its status named);
 * KV_ERR_OUT_OF_BOUNDS (layers past the request's); KV_ERR_OVERLAP (a layer
 * posted before); KV_ERR_INVALID_ARG (the plan writes other destination
 * layers than [layer0, +n_layers): decode would be told of layers never
 * written); then those of kv_xport_write_plan. A refused post sends
 * nothing and leaves the request as it was. */
KV_API KV_NODISCARD kv_status kv_xlayer_tx_post(
    kv_xlayer_tx *tx, uint64_t request, const kv_plan *plan, uint32_t layer0, uint32_t n_layers,
    kv_xport_mem *local, uint64_t local_base_off, const uint32_t *src_blocks, uint32_t n_src,
    kv_xport_rmem *remote, uint64_t remote_base_off, const uint32_t *dst_blocks, uint32_t n_dst,
    uint64_t n_tokens);

/* Fail request (KV_ERR_CANCELLED): its transfers in flight are cancelled,
 * then decode is told (ABORT). KV_ERR_NOT_FOUND; KV_ERR_BAD_STATE (already
 * terminal). */
KV_API KV_NODISCARD kv_status kv_xlayer_tx_cancel(kv_xlayer_tx *tx, uint64_t request);

/* Wait at most timeout_ms until request is terminal (every layer posted and
 * acknowledged, or failed with nothing in flight): KV_OK, its failure, or
 * KV_ERR_TIMEOUT (still running; a request with layers not yet posted
 * waits for them). KV_ERR_NOT_FOUND. The request stays open until
 * reported by kv_xlayer_tx_finished. */
KV_API KV_NODISCARD kv_status kv_xlayer_tx_wait(kv_xlayer_tx *tx, uint64_t request,
                                                uint32_t timeout_ms);

/* Make progress (collect terminal transfers, fail requests with a failed
 * layer, send their ABORT), then report up to cap terminal requests not
 * reported before into out[*n], each once: its source blocks are the
 * caller's again. KV_ERR_NULL; KV_ERR_INVALID_ARG (out not aligned for its
 * struct, cap > 0: nothing done). */
KV_API KV_NODISCARD kv_status kv_xlayer_tx_finished(kv_xlayer_tx *tx, struct kv_xlayer_done *out,
                                                    uint32_t cap, uint32_t *n);

#ifdef __cplusplus
}
#endif

#endif /* KV_XPORT_LAYERS_H */
