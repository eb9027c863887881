/*
 * kv_transport.h - moving bytes between two nodes: one-sided writes into a
 * peer's registered memory, and a notification delivered strictly after the
 * data it covers (docs/connector.md, "Transports").
 *
 * Model (the one RDMA gives, which TCP emulates):
 *
 *   node A (prefill)                                  node B (decode)
 *   kv_xport_create(cfg)                              kv_xport_create(cfg, listening)
 *   kv_xport_mem_reg(buf) -> mem                      kv_xport_mem_reg(cache arena) -> mem
 *   kv_xport_connect(host, port) -> peer  ---hello--> kv_xport_accept -> peer
 *        (version, token, fingerprint checked both ways; a mismatch names the field)
 *                                          <--blob--  kv_xport_mem_expose(peer, mem) -> blob
 *   kv_xport_rmem_import(peer, blob) -> rmem           (B sends the blob out of band or
 *                                                        in a notification)
 *   kv_xport_write(peer, ios, notify) -> xfer ==data=> bytes land in B's mem; B's CPU is not
 *                                         --notify--> kv_xport_notify_poll -> (peer id, tag, msg)
 *   kv_xport_xfer_wait(xfer) -> DONE / FAILED / TIMED_OUT / CANCELLED
 *
 * A write is a list of entries (local mem, offset, remote mem, offset,
 * bytes) with an optional notification (struct kv_xport_notify). The
 * receiver checks every entry against the regions it exposed to that peer
 * (bounds and region id); anything else is refused, nothing of it is
 * written, and the sender's entry fails with KV_ERR_OUT_OF_BOUNDS.
 *
 * Every posted transfer reaches exactly one terminal state within the
 * configured bound (timeout_ms): DONE (every entry acknowledged), FAILED
 * (an entry refused, the connection lost: per-entry statuses say which),
 * TIMED_OUT, or CANCELLED. Its local memory stays owned by the transfer
 * until then: the caller must not free or reuse it before a terminal state.
 * A notification is delivered only after every write posted before it on
 * the same peer has landed completely; a receiver that sees it may read the
 * data. A peer that disconnects fails everything in flight to it.
 *
 * Everything a peer sends is untrusted. Its frames are checked where they
 * arrive (lengths, checksums, the limits below); everything it can make us
 * queue is bounded by this config (notifications not yet polled, reads being
 * served, connections in their handshake, frames handled per round) and
 * refused by name when full; a frame that stalls, or a peer that stops
 * reading what we send it, is closed within timeout_ms.
 *
 * Handles can be released in any order: a call that would free something
 * still in use is refused (KV_ERR_BAD_STATE naming the users), never freed
 * under them. kv_xport_destroy refuses while the caller still holds peers,
 * regions, imported regions or transfers of it.
 *
 * Backends share this seam through a versioned ops table (module-private,
 * connector/transport/kv_xport_int.h): TCP (real sockets; always built), RDMA
 * (libibverbs through its own function table; built where rdma-core is) and
 * SHM (peers on one host: control over a Unix-domain socket, the bytes
 * through shared-memory rings, copied in by the sender and out by the
 * receiver, which checks every piece against its exposures; always built).
 * SHM addresses: listen_host "/path" is a socket file (port unused); any
 * other host names the abstract socket "kvcache-shm:<host>:<port>", port 0
 * picking a free one (kv_xport_port); kv_xport_connect takes the same.
 * AUTO (both ends AUTO): TCP addresses; kv_xport_connect first asks the
 * listener over TCP for its same-host socket (one round trip, at most
 * timeout_ms: the only AUTO call that waits on the network), and carries
 * the peer over SHM when that socket is reachable from here and proves to
 * be the listener's, else over TCP. kv_xport_peer_info_get says which, and
 * why (struct kv_xport_info's path, path_why).
 *
 * Thread safety: every call may be made from any thread; one progress
 * thread per transport does the I/O.
 */
#ifndef KV_TRANSPORT_H
#define KV_TRANSPORT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kv_arena.h"
#include "kv_cache.h"
#include "kv_offload.h"
#include "kv_plan.h"
#include "kv_status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KV_XPORT_PROTOCOL_VERSION 1u

typedef enum kv_xport_kind {
    KV_XPORT_TCP = 1,
    KV_XPORT_RDMA = 2,
    KV_XPORT_SHM = 3,  /* same host: a Unix socket and shared-memory rings
                          (docs/connector.md, "Same-host transport") */
    KV_XPORT_AUTO = 4, /* TCP addresses; a peer proved to be on this host (same kernel
                          and network namespace) is carried by SHM, any other by TCP
                          (docs/connector.md, "Automatic choice") */
} kv_xport_kind;

/* "tcp", "rdma", "shm", "auto"; "unknown". */
KV_API const char *kv_xport_kind_name(kv_xport_kind k);

/* Input of kv_xport_create. Start from KV_XPORT_CONFIG_INIT. */
struct kv_xport_config {
    size_t struct_size;
    kv_xport_kind kind;
    const char *listen_host; /* accept peers on this address ("127.0.0.1"); NULL: none */
    uint16_t listen_port;    /* 0: any free port (kv_xport_port) */
    uint64_t token;          /* shared secret: a peer presenting another is refused */
    uint64_t fingerprint;    /* what both sides must agree on (a layout fingerprint;
                                0 on both sides: not checked) */
    uint32_t conns_per_peer; /* TCP connections / RDMA QPs per peer; 0 = 2 (SHM: one
                                connection; both ends must still agree) */
    uint32_t timeout_ms;     /* bound on every transfer, handshake and incoming frame, and
                                on a peer that stops reading; 0 = 30,000 */
    /* What a peer can make us hold (0 = the default). A frame over a limit
     * is refused by name: its sender's transfer (or entry) ends FAILED with
     * KV_ERR_CAPACITY. */
    uint32_t max_pending_notes; /* per peer: notifications received, not yet polled; 1024 */
    uint32_t max_pending_reads; /* per peer: its reads of our memory being served (TCP,
                                   SHM); 1024 */
    uint32_t max_handshakes;    /* incoming connections not through their handshake, or
                                   whose peer kv_xport_accept has not yet returned (each
                                   refused beyond it); 64 */
    uint32_t frames_per_round;  /* frames handled per connection per progress round, so one
                                   peer's flood cannot starve another; 64 */
    /* RDMA: how the progress thread learns of completions. false (the
     * default): events; it sleeps on a completion channel and the
     * transport's own wake-ups and deadlines, so an idle transport uses no
     * CPU. true: busy polling; it polls every CQ at least every 0.2 ms even
     * when idle (lower completion latency; about 7% of a core). TCP, SHM: unused. */
    bool rdma_busy_poll;
    /* RDMA: which device, port and GID the transport uses, each automatic
     * by default (docs/connector.md, "RDMA parameters"); what was chosen is
     * reported by kv_xport_info_get. TCP, SHM: unused. */
    const char *rdma_device; /* a device by name ("mlx5_0"); NULL: the first device
                                (in ibv_get_device_list order) with an ACTIVE port */
    uint32_t rdma_port;      /* that port (1-based; it must be ACTIVE); 0: the device's
                                first ACTIVE port */
    int32_t rdma_gid_index;  /* that GID table index; -1 (KV_XPORT_CONFIG_INIT's): on
                                Ethernet the RoCE v2 IPv4-mapped GID (else the best
                                RoCE v2, else RoCE v1 one), on InfiniBand index 0 */
    /* kv_xport_write_plan: a plan whose byte runs average fewer bytes than
     * this (kv_plan_stats: window_bytes / runs) is sent gathered on a
     * backend that can gather (TCP, SHM): one entry per run contiguous in the
     * destination, its payload gathered from the source's small runs by
     * the sender as it sends (TCP: packed frame by frame into one 512 KiB
     * staging buffer per connection; SHM: straight into each ring slot),
     * so the wire carries the
     * destination's large runs. 0 = KV_XPORT_GATHER_BELOW_DEFAULT (measured:
     * docs/connector.md, "Fragment-proof conversions"); 1: never; UINT32_MAX:
     * always. RDMA: not gathered (one work request per run, as before). */
    uint32_t plan_gather_below_bytes;
    /* RDMA rails: several devices in one transport, as NCCL's rails
     * (docs/connector.md, "Rails"). rdma_devices[n_rdma_devices] names each
     * device (rail i is rdma_devices[i]; read during kv_xport_create; at
     * most KV_XPORT_MAX_RAILS, no name twice, rdma_device NULL then);
     * rdma_port and rdma_gid_index apply to each (0 / -1: chosen per
     * device). Each rail has its own context, PD, CQs and conns_per_peer
     * QPs per peer (rails * conns_per_peer <= 16), connected to the peer's
     * rail of the same index; with a peer that has fewer rails, only the
     * common count is connected. A region lives on one rail
     * (kv_xport_mem_reg_on: the caller's; kv_xport_mem_reg: the rail on the
     * memory's NUMA node, else round robin) and a write or read moves
     * bytes between regions of the same rail only. NULL / 0: one rail,
     * rdma_device's (automatic when NULL). TCP: unused. */
    const char *const *rdma_devices;
    uint32_t n_rdma_devices;
};

/* Rails of one RDMA transport at most. */
#define KV_XPORT_MAX_RAILS 8u

/* The default of plan_gather_below_bytes. */
#define KV_XPORT_GATHER_BELOW_DEFAULT 24576u

#define KV_XPORT_CONFIG_INIT                                                                       \
    {                                                                                              \
        .struct_size = sizeof(struct kv_xport_config), .rdma_gid_index = -1                        \
    }

/* Handles (opaque). */
typedef struct kv_xport kv_xport;           /* one transport endpoint */
typedef struct kv_xport_peer kv_xport_peer; /* a connection (conns_per_peer sockets / QPs) */
typedef struct kv_xport_mem kv_xport_mem;   /* a local registered region */
typedef struct kv_xport_rmem kv_xport_rmem; /* a peer's region, from its blob */
typedef struct kv_xport_xfer kv_xport_xfer; /* a posted transfer */

/* Create the transport (and its progress thread); listening when
 * cfg->listen_host is set. KV_ERR_NULL; KV_ERR_INVALID_ARG (struct_size,
 * kind, a token of 0, conns_per_peer over 16, a listen_host of 64 characters
 * or more); KV_ERR_UNSUPPORTED (KV_XPORT_RDMA without a device);
 * KV_ERR_IO (bind/listen, errno named); KV_ERR_NO_MEMORY. */
KV_API KV_NODISCARD kv_status kv_xport_create(const struct kv_xport_config *cfg, kv_xport **out);

/* Close what is left (peers never accepted, connections in their
 * handshake, notifications never polled), join the progress thread, free.
 * Refused with KV_ERR_BAD_STATE, naming what is still held, while the
 * caller holds a peer not closed (kv_xport_peer_close), a registered region
 * (kv_xport_mem_dereg), an imported region (kv_xport_rmem_free), a
 * transfer not freed (kv_xport_xfer_free) or a layer-by-layer request not
 * reported (kv_xlayer_tx_finished), or while another thread is inside
 * kv_xport_accept, kv_xport_notify_poll or kv_xport_peer_close: nothing is
 * freed then. Once past
 * that check the transport is gone whatever the result; KV_ERR_DEVICE or
 * KV_ERR_IO then reports a backend teardown call that failed (named).
 * NULL: KV_OK. */
KV_API KV_NODISCARD kv_status kv_xport_destroy(kv_xport *x);

/* The port it listens on (0 when not listening). */
KV_API uint16_t kv_xport_port(const kv_xport *x);

/* States of a peer. */
typedef enum kv_xport_peer_state {
    KV_XPORT_CONNECTING = 0, /* TCP connect or the handshake in progress */
    KV_XPORT_READY = 1,      /* handshake done: version, token, fingerprint agree */
    KV_XPORT_CLOSED = 2,     /* terminal: closed, refused or lost (see the status) */
} kv_xport_peer_state;

/* Start connecting to host:port (non-blocking: *peer is CONNECTING until
 * the handshake ends; AUTO: after its probe, see above). Port 0 only for
 * an SHM socket path ("/..."), which has none. KV_ERR_NULL;
 * KV_ERR_INVALID_ARG (host, port); KV_ERR_IO. */
KV_API KV_NODISCARD kv_status kv_xport_connect(kv_xport *x, const char *host, uint16_t port,
                                               kv_xport_peer **peer);

/* The next peer whose handshake completed on the listening side, waiting at
 * most timeout_ms. KV_ERR_TIMEOUT when none; KV_ERR_BAD_STATE (not
 * listening). A peer refused at the handshake never appears here. */
KV_API KV_NODISCARD kv_status kv_xport_accept(kv_xport *x, uint32_t timeout_ms,
                                              kv_xport_peer **peer);

/* The peer's state now, and (CLOSED) why: KV_OK for a clean close,
 * KV_ERR_MISMATCH (version, token or fingerprint: named in the message),
 * KV_ERR_IO, KV_ERR_TIMEOUT, KV_ERR_CORRUPT (a frame that fails its checks).
 * KV_ERR_NULL. */
KV_API KV_NODISCARD kv_status kv_xport_peer_state_get(kv_xport_peer *peer,
                                                      kv_xport_peer_state *state, kv_status *why);

/* Wait at most timeout_ms for the peer to leave CONNECTING; *state (may be
 * NULL) as kv_xport_peer_state_get. KV_OK once READY; the close reason
 * once CLOSED (KV_ERR_MISMATCH, ...); KV_ERR_TIMEOUT while still
 * connecting. KV_ERR_NULL. */
KV_API KV_NODISCARD kv_status kv_xport_peer_wait(kv_xport_peer *peer, uint32_t timeout_ms,
                                                 kv_xport_peer_state *state);

/* Close the peer (its transfers end CANCELLED, its exposures end) and
 * release the caller's handle. Transfers and imported regions of the peer
 * stay valid until freed (their calls then answer for a closed peer). */
KV_API void kv_xport_peer_close(kv_xport_peer *peer);

/* The peer's id: unique within this transport for its lifetime (never
 * reused), what a kv_xport_msg names its sender by. 0 for NULL. */
KV_API uint64_t kv_xport_peer_id(const kv_xport_peer *peer);

/* Register [base, base + bytes) of memory kind `kind` (host or pinned for
 * TCP and RDMA; RDMA splits it at max_mr_size). Once per region: an arena,
 * the offload tier's region. RDMA with several devices: on the rail
 * kv_xport_mem_reg_on's KV_XPORT_DEVICE_AUTO picks. KV_ERR_NULL;
 * KV_ERR_INVALID_ARG; KV_ERR_UNSUPPORTED (a kind the backend cannot reach;
 * KV_MEM_DEVICE on RDMA too: a notification is delivered without a flush
 * READ, so a kernel could read stale bytes); KV_ERR_NO_MEMORY. */
KV_API KV_NODISCARD kv_status kv_xport_mem_reg(kv_xport *x, void *base, size_t bytes,
                                               enum kv_mem_kind kind, kv_xport_mem **out);

/* kv_xport_mem_reg on a given device: `device` is the rail index of an
 * RDMA transport (0 .. rails - 1, struct kv_xport_config's rdma_devices),
 * or KV_XPORT_DEVICE_AUTO (what kv_xport_mem_reg does: device memory,
 * once RDMA accepts it, the rail fewest PCIe hops from its GPU under the
 * GPU's root complex;
 * else the rail whose device is on the memory's (a GPU's: the GPU's) NUMA
 * node, the least used of those, else round robin over every rail;
 * docs/connector.md, "Rails"). TCP: 0 or
 * KV_XPORT_DEVICE_AUTO. What was chosen: kv_xport_mem_info_get. The
 * statuses of kv_xport_mem_reg, and KV_ERR_INVALID_ARG for a device index
 * past the transport's (named). */
#define KV_XPORT_DEVICE_AUTO UINT32_MAX
KV_API KV_NODISCARD kv_status kv_xport_mem_reg_on(kv_xport *x, void *base, size_t bytes,
                                                  enum kv_mem_kind kind, uint32_t device,
                                                  kv_xport_mem **out);

/* Register cache c's memory (its arena: kv_cache_regions' one region, of
 * the arena's kind) on the transport's automatic device, and hold a
 * reference on c (kv_cache_retain) until the region is deregistered. So
 * the engine's kv_cache_destroy while the region is registered, exposed or
 * named by a transfer drops only the engine's reference: the memory a
 * peer's bytes land in stays mapped until kv_xport_mem_dereg, which drops
 * the last reference (and frees the cache) once it succeeds. The
 * statuses of kv_xport_mem_reg; KV_ERR_NULL; no reference kept on
 * failure. */
KV_API KV_NODISCARD kv_status kv_xport_mem_reg_cache(kv_xport *x, kv_cache *c,
                                                     kv_xport_mem **out);

/* The same for an offload tier's region (kv_offload_regions' one region):
 * the registration holds the region, so kv_offload_destroy while it is
 * registered ends the tier's ops and entries but keeps the region mapped
 * until kv_xport_mem_dereg releases the hold (and frees it). The statuses
 * of kv_xport_mem_reg; KV_ERR_NULL; KV_ERR_BAD_STATE (the tier is being
 * destroyed). Nothing held on failure. */
KV_API KV_NODISCARD kv_status kv_xport_mem_reg_offload(kv_xport *x, kv_offload *off,
                                                       kv_xport_mem **out);

/* The same for an arena (kv_arena_regions' one region): a reference on it
 * (kv_arena_retain) until the deregistration, so kv_arena_destroy before
 * it frees nothing a peer writes into. The statuses of kv_xport_mem_reg;
 * KV_ERR_NULL. Nothing held on failure. */
KV_API KV_NODISCARD kv_status kv_xport_mem_reg_arena(kv_xport *x, kv_arena *arena,
                                                     kv_xport_mem **out);

/* Deregister (KV_ERR_BAD_STATE while a transfer or an exposure uses it;
 * KV_ERR_DEVICE when the backend's deregistration fails: still registered).
 * A region of kv_xport_mem_reg_cache / _offload / _arena drops its
 * reference or hold here. */
KV_API KV_NODISCARD kv_status kv_xport_mem_dereg(kv_xport_mem *mem);

/* Let peer write into mem, and write into blob[cap] what the peer imports
 * (kv_xport_rmem_import) to address it: *len bytes (at most
 * KV_XPORT_BLOB_MAX). Writes from this peer into memory it was not exposed
 * are refused and not written. KV_ERR_NULL; KV_ERR_CAPACITY (cap). */
#define KV_XPORT_BLOB_MAX 256
KV_API KV_NODISCARD kv_status kv_xport_mem_expose(kv_xport_peer *peer, kv_xport_mem *mem,
                                                  void *blob, size_t cap, size_t *len);

/* Bytes of a registered region / an imported one. */
KV_API uint64_t kv_xport_mem_bytes(const kv_xport_mem *mem);
KV_API uint64_t kv_xport_rmem_bytes(const kv_xport_rmem *rmem);

/* Withdraw peer's access to mem. When it returns, nothing of that peer
 * touches mem any more: writes of that peer landing in it finished (it
 * waits for them, at most the frame deadline of timeout_ms; other peers'
 * traffic never delays it), its reads of mem not yet sent are refused
 * (KV_ERR_OUT_OF_BOUNDS at the reader), and later writes and reads are
 * refused. TCP: checked by the receiver per frame. RDMA: each exposure has
 * its own memory registration, deregistered here, so the rkey the peer holds
 * stops working (the NIC refuses it: REM_ACCESS_ERR at the peer).
 * KV_ERR_NOT_FOUND when it was not exposed to peer (or the peer's close
 * already ended the exposure: answered once that close has released it,
 * so kv_xport_mem_dereg may follow either answer). */
KV_API KV_NODISCARD kv_status kv_xport_mem_unexpose(kv_xport_peer *peer, kv_xport_mem *mem);

/* A peer's region from its blob (waits for a CONNECTING peer's handshake,
 * at most the configured timeout: the blob names the connection).
 * KV_ERR_NULL; KV_ERR_CORRUPT (a blob that fails its checks: magic,
 * version, checksum, another peer's); KV_ERR_BAD_STATE (the peer did not
 * become ready). */
KV_API KV_NODISCARD kv_status kv_xport_rmem_import(kv_xport_peer *peer, const void *blob,
                                                   size_t len, kv_xport_rmem **out);

/* Free an imported region: KV_ERR_BAD_STATE (naming the transfers) while a
 * transfer that is not terminal names it. NULL: KV_OK. */
KV_API KV_NODISCARD kv_status kv_xport_rmem_free(kv_xport_rmem *rmem);

/* One write of a transfer: bytes from local + local_off to remote +
 * remote_off. */
struct kv_xport_io {
    kv_xport_mem *local;
    uint64_t local_off;
    kv_xport_rmem *remote;
    uint64_t remote_off;
    uint64_t bytes;
};

/*
 * Post ios[n] as one-sided reads: bytes from remote + remote_off land in
 * local + local_off (the io's fields keep their names; the direction is the
 * call's). The same checks at post as kv_xport_write; the peer checks each
 * read against what it exposed to us and refuses the rest (that entry
 * FAILED with KV_ERR_OUT_OF_BOUNDS, nothing read). The local memory
 * belongs to the transfer until it is terminal: after a TIMED_OUT or
 * CANCELLED read nothing more lands there. Reads carry no notification.
 */
KV_API KV_NODISCARD kv_status kv_xport_read(kv_xport_peer *peer, const struct kv_xport_io *ios,
                                            uint32_t n, kv_xport_xfer **xfer);

/* The notification of a transfer: delivered to the peer strictly after every
 * byte of every write posted on this peer before it (this transfer's
 * included) has landed. A transfer with a notification ends DONE only once
 * the peer has queued it (every backend acknowledges it). The peer refuses
 * it when its queue of notifications not yet polled is full
 * (max_pending_notes) or it cannot allocate the copy: the transfer then
 * ends FAILED, its entries KV_OK (the data landed), and
 * kv_xport_xfer_note_status gives KV_ERR_CAPACITY or KV_ERR_NO_MEMORY; the
 * peer stays connected. */
struct kv_xport_notify {
    uint64_t tag;
    const void *msg; /* copied at post */
    uint32_t len;    /* <= KV_XPORT_NOTIFY_MAX */
};
#define KV_XPORT_NOTIFY_MAX 4096

/*
 * Post ios[n] (and notify, may be NULL) to peer. *xfer set on success; the
 * local memory of the ios belongs to the transfer until it is terminal.
 * Checked at post, before anything is sent (KV_ERR_OUT_OF_BOUNDS naming the
 * entry and range; KV_ERR_INVALID_ARG for ios not aligned for its struct,
 * a remote region of another peer,
 * and, RDMA, for a local and a remote region on different rails or a rail
 * the peer is not connected on; KV_ERR_CORRUPT for a remote key that fails
 * its checks);
 * the receiver checks every write again against what it exposed. Entries
 * whose destination ranges overlap land in an unspecified order (each is
 * verified as it was received); the overlap then holds one of them.
 */
KV_API KV_NODISCARD kv_status kv_xport_write(kv_xport_peer *peer, const struct kv_xport_io *ios,
                                             uint32_t n, const struct kv_xport_notify *notify,
                                             kv_xport_xfer **xfer);

/*
 * Prefill -> decode: post the byte runs of a transfer plan (kv_plan.h) for
 * one request as one write, then notify. The source cache's base is
 * local_base_off bytes into local, the destination cache's base
 * remote_base_off bytes into remote; the plan's source and destination
 * layouts say where each block lies (64-bit offsets from the bases). Block
 * lists as kv_plan_copy takes them (n_src = ceil(n_tokens / Ns), n_dst =
 * ceil(n_tokens / Nd)); each 2-D copy of the plan becomes `height` entries
 * of `width` bytes, merged where consecutive entries are contiguous on both
 * sides. The plan's head and layer ranges decide what moves (a pipeline
 * stage's layers into the decoder's matching ones, one layer per write);
 * the receiver checks the writes against its exposed regions only, so
 * which layout and layers it expects is for the two sides to agree (the
 * placement the plan is built from). A plan whose runs are small (below
 * the config's plan_gather_below_bytes) is sent gathered where the backend
 * can (TCP, SHM): one entry per run contiguous in the destination, its payload
 * gathered from the source's runs as it is sent; the same checks,
 * statuses, notification order, terminal states and cancel as any write
 * (kv_xport_stats counts which way each post went). KV_ERR_NULL; KV_ERR_INVALID_ARG (a
 * block list not 4-byte aligned); KV_ERR_BAD_SHAPE (list lengths); KV_ERR_OUT_OF_BOUNDS
 * (a block id >= the layout's block count, a block outside either region);
 * KV_ERR_OVERLAP (a destination block twice); KV_ERR_NO_MEMORY; then those
 * of kv_xport_write. Nothing is sent on an error.
 */
KV_API KV_NODISCARD kv_status kv_xport_write_plan(
    kv_xport_peer *peer, const kv_plan *plan, kv_xport_mem *local, uint64_t local_base_off,
    const uint32_t *src_blocks, uint32_t n_src, kv_xport_rmem *remote, uint64_t remote_base_off,
    const uint32_t *dst_blocks, uint32_t n_dst, uint64_t n_tokens,
    const struct kv_xport_notify *notify, kv_xport_xfer **xfer);

/* States of a transfer; the last four are terminal. */
typedef enum kv_xport_state {
    KV_XPORT_PENDING = 0,
    KV_XPORT_DONE = 1,      /* every write acknowledged, the notification delivered */
    KV_XPORT_FAILED = 2,    /* an entry refused or the peer lost: per-entry statuses */
    KV_XPORT_TIMED_OUT = 3, /* not terminal within timeout_ms of its post */
    KV_XPORT_CANCELLED = 4,
} kv_xport_state;

KV_API KV_NODISCARD kv_status kv_xport_xfer_test(kv_xport_xfer *xfer, kv_xport_state *state);
/* KV_OK when terminal within timeout_ms, KV_ERR_TIMEOUT otherwise. */
KV_API KV_NODISCARD kv_status kv_xport_xfer_wait(kv_xport_xfer *xfer, uint32_t timeout_ms,
                                                 kv_xport_state *state);
/* Ask to cancel: ends CANCELLED once nothing of it is in flight any more
 * (its memory is then the caller's again); a terminal transfer is left. */
KV_API KV_NODISCARD kv_status kv_xport_xfer_cancel(kv_xport_xfer *xfer);
/* Per-entry statuses (*st[n], valid until free); KV_ERR_BAD_STATE until
 * terminal. */
KV_API KV_NODISCARD kv_status kv_xport_xfer_results(kv_xport_xfer *xfer, const kv_status **st,
                                                    uint32_t *n);
/* The notification's outcome, once terminal: KV_OK when it was delivered,
 * or the transfer has none or ended before sending it; else the status the
 * peer refused it with (KV_ERR_CAPACITY: its queue of notifications not yet
 * polled was full; KV_ERR_NO_MEMORY: it could not allocate the copy). Such a transfer ends FAILED
 * with every entry KV_OK: its data landed, its notification did not. KV_ERR_BAD_STATE until
 * terminal. */
KV_API KV_NODISCARD kv_status kv_xport_xfer_note_status(kv_xport_xfer *xfer, kv_status *st);
/* Why a terminal transfer that is not DONE ended: the first failure's
 * detail, naming the entry and the values ("" when DONE or pending, or when
 * no more than the status is known). Valid until free. */
KV_API const char *kv_xport_xfer_error(kv_xport_xfer *xfer);
/* Free a terminal transfer (KV_ERR_BAD_STATE otherwise). */
KV_API KV_NODISCARD kv_status kv_xport_xfer_free(kv_xport_xfer *xfer);

/* A notification received. Its sender is named by id (kv_xport_peer_id),
 * never by pointer: the message stays meaningful after the peer is closed
 * and freed. */
struct kv_xport_msg {
    uint64_t peer_id;
    uint64_t tag;
    uint32_t len;
    unsigned char data[KV_XPORT_NOTIFY_MAX];
};

/* The oldest notification received, waiting at most timeout_ms:
 * KV_ERR_TIMEOUT when none. Every write it covers has landed. */
KV_API KV_NODISCARD kv_status kv_xport_notify_poll(kv_xport *x, uint32_t timeout_ms,
                                                   struct kv_xport_msg *out);

/* What the transport refused or closed, since its creation (monotonic
 * counters; a snapshot under the transport's lock). */
struct kv_xport_stats {
    size_t struct_size;
    uint64_t peers_refused;         /* handshakes refused (mismatch, corrupt, the handshake
                                       limit, a deadline) */
    uint64_t handshakes_over_limit; /* of which: over max_handshakes */
    uint64_t notes_refused;         /* notifications refused (max_pending_notes, or no memory
                                       to queue one), or dropped with a peer that failed its
                                       handshake */
    uint64_t reads_refused;         /* reads refused (max_pending_reads, not exposed) */
    uint64_t frames_stalled;        /* peers closed: an incoming frame past its deadline */
    uint64_t sends_stalled;         /* peers closed: not reading what we send for timeout_ms */
    uint64_t accept_backoffs;       /* accept() failed for lack of resources (EMFILE, ...):
                                       the listener paused, 10 ms doubling to 1 s */
    int accept_last_errno;          /* the errno of the last such failure (0: none) */
    uint64_t plans_gathered;        /* kv_xport_write_plan posts sent gathered */
    uint64_t plans_direct;          /* kv_xport_write_plan posts sent one entry per run */
    uint64_t plan_segments;         /* source runs of the gathered posts */
    uint64_t plan_entries;          /* entries (destination runs) of the gathered posts */
};
#define KV_XPORT_STATS_INIT                                                                        \
    {                                                                                              \
        .struct_size = sizeof(struct kv_xport_stats)                                               \
    }

/* Fill *out (start from KV_XPORT_STATS_INIT). KV_ERR_NULL; KV_ERR_INVALID_ARG
 * (struct_size). */
KV_API KV_NODISCARD kv_status kv_xport_stats_get(kv_xport *x, struct kv_xport_stats *out);

/* Link layers and GID types kv_xport_info reports. */
typedef enum kv_xport_link {
    KV_XPORT_LINK_NONE = 0, /* TCP */
    KV_XPORT_LINK_INFINIBAND = 1,
    KV_XPORT_LINK_ETHERNET = 2, /* RoCE */
} kv_xport_link;

typedef enum kv_xport_gid_type {
    KV_XPORT_GID_NONE = 0, /* no GID in use (or TCP) */
    KV_XPORT_GID_IB = 1,
    KV_XPORT_GID_ROCE_V1 = 2,
    KV_XPORT_GID_ROCE_V2 = 3,
} kv_xport_gid_type;

/* One rail of an RDMA transport (struct kv_xport_info's rdma_rail[]). */
struct kv_xport_rail_info {
    char device[64];
    uint32_t port;
    kv_xport_link link;
    uint32_t lid;
    int32_t gid_index;
    kv_xport_gid_type gid_type;
    uint8_t gid[16];
    uint32_t active_mtu;
    int32_t numa_node;   /* the device's (sysfs numa_node); -1: unknown */
    uint32_t regions;    /* regions registered on it now */
    char pci_bus_id[24]; /* the device's PCI address ("0000:03:00.0", the name of
                            its sysfs device directory); "": unknown */
    /* the peer's path on this rail; zero when not connected */
    uint32_t qps;
    uint32_t path_mtu;
    bool grh;
    uint32_t hop_limit;
    uint32_t remote_lid;
    uint8_t remote_gid[16];
};

/* What the transport chose and, for a peer, what its path uses: every
 * value the RDMA backend picked by itself (the config's automatic
 * defaults) or took from the config; AUTO: which backend carries the peer
 * and why (path, path_why). TCP, SHM: kind and path only, the rest zero. */
struct kv_xport_info {
    size_t struct_size;
    kv_xport_kind kind;
    /* The transport (kv_xport_create). */
    char rdma_device[64];
    uint32_t rdma_port;
    kv_xport_link rdma_link;
    uint32_t rdma_lid;      /* InfiniBand: the port's LID; Ethernet: 0 */
    int32_t rdma_gid_index; /* -1: none */
    kv_xport_gid_type rdma_gid_type;
    uint8_t rdma_gid[16];     /* network order, as in the GID table */
    uint32_t rdma_active_mtu; /* bytes: the port's active MTU */
    /* A peer (kv_xport_peer_info_get), once its QPs are connected; 0 before. */
    uint32_t rdma_qps;        /* QPs to the peer */
    uint32_t rdma_path_mtu;   /* bytes: min(both sides' active MTU) */
    bool rdma_grh;            /* a GRH on the path (always on Ethernet; on InfiniBand
                                 only when the peer's GID is on another subnet) */
    uint32_t rdma_hop_limit;  /* with a GRH */
    uint32_t rdma_remote_lid; /* the peer's LID (InfiniBand; the path's dlid) */
    uint8_t rdma_remote_gid[16];
    /* Rails (the fields above are rail 0's; rdma_qps counts every rail's):
     * each device of the transport and, for a peer, its path on that rail. */
    uint32_t rdma_rails;      /* devices of the transport (1 unless rdma_devices) */
    uint32_t rdma_peer_rails; /* rails connected to the peer: min(both sides' rails) */
    struct kv_xport_rail_info rdma_rail[KV_XPORT_MAX_RAILS];
    /* The backend carrying the bytes and why: for a peer, the kind of its
     * data path (KV_XPORT_AUTO: KV_XPORT_SHM or KV_XPORT_TCP, chosen at
     * connect); for the transport, its kind. path_why: AUTO, the reason in
     * words (the probe's answer, the socket tried, the proof, or why it
     * stayed on TCP; the transport: its same-host socket); other kinds,
     * "configured". */
    kv_xport_kind path;
    char path_why[256];
};
#define KV_XPORT_INFO_INIT                                                                         \
    {                                                                                              \
        .struct_size = sizeof(struct kv_xport_info)                                                \
    }

/* Fill *out (start from KV_XPORT_INFO_INIT) with what x chose.
 * KV_ERR_NULL; KV_ERR_INVALID_ARG (struct_size). */
KV_API KV_NODISCARD kv_status kv_xport_info_get(kv_xport *x, struct kv_xport_info *out);

/* kv_xport_info_get of the peer's transport plus the peer's path (zero
 * until the peer's QPs are connected: before READY, or for TCP). */
KV_API KV_NODISCARD kv_status kv_xport_peer_info_get(kv_xport_peer *peer,
                                                     struct kv_xport_info *out);

/* info as one line of text into buf[cap] (always terminated when cap > 0):
 * "rdma device mlx5_0 port 1 ethernet lid 0 gid[3] ::ffff:10.0.0.1 (RoCE
 * v2) mtu 4096", then, for a peer, " | qps 2 path_mtu 4096 grh hop_limit
 * 255 remote lid 0 gid ...". With several rails, each rail so, after
 * "rdma rails 2 (peer 2):", as "; rail 1 device mlx5_1 ... numa 1 pci
 * 0000:03:00.0 | qps 2 ..." (pci only when known). AUTO: "auto path shm
 * (<path_why>)". Returns the length it needed (snprintf's). */
KV_API int kv_xport_info_format(const struct kv_xport_info *info, char *buf, size_t cap);

/* How a region's device was chosen (kv_xport_mem_info). */
typedef enum kv_xport_mem_choice {
    KV_XPORT_CHOSEN_NONE = 0,   /* TCP: no device */
    KV_XPORT_CHOSEN_CALLER = 1, /* kv_xport_mem_reg_on with an index */
    KV_XPORT_CHOSEN_ONLY = 2,   /* automatic, one rail */
    KV_XPORT_CHOSEN_NUMA = 3,   /* automatic: a device on the memory's NUMA node */
    KV_XPORT_CHOSEN_SPREAD = 4, /* automatic, no device known near it: round robin */
    KV_XPORT_CHOSEN_PCI = 5,    /* automatic, device (GPU) memory: the device fewest PCIe
                                   hops from the GPU under the GPU's root complex */
} kv_xport_mem_choice;

/* A registered region's device (RDMA: its rail), how it was chosen, and
 * the NUMA nodes and PCIe distance compared. TCP: choice NONE, the rest
 * zero / -1. */
struct kv_xport_mem_info {
    size_t struct_size;
    uint32_t rdma_rail;
    char rdma_device[64];
    kv_xport_mem_choice rdma_chosen;
    int32_t numa_node;        /* the memory's, at registration (-1: unknown) */
    int32_t device_numa_node; /* the chosen device's (-1: unknown) */
    /* Device memory: PCIe hops from the GPU up to the deepest bridge it
     * shares with the chosen device and down to that device (4: one switch
     * between them); -1: host memory, or the GPU or device not found under
     * one PCI root complex (docs/connector.md, "Where a region lives"). */
    int32_t pci_distance;
};
#define KV_XPORT_MEM_INFO_INIT                                                                     \
    {                                                                                              \
        .struct_size = sizeof(struct kv_xport_mem_info)                                            \
    }

/* Fill *out (start from KV_XPORT_MEM_INFO_INIT) with mem's device.
 * KV_ERR_NULL; KV_ERR_INVALID_ARG (struct_size). */
KV_API KV_NODISCARD kv_status kv_xport_mem_info_get(kv_xport_mem *mem,
                                                    struct kv_xport_mem_info *out);

#ifdef __cplusplus
}
#endif

#endif /* KV_TRANSPORT_H */
