"""The transports, from Python: one-sided writes of KV blocks into a peer's
registered memory, with a notification delivered after the data
(connector/transport/kv_transport.h), transfer plans between two layouts
(connector/plan/kv_plan.h), and the layer-by-layer trackers of a request
(connector/transport/kv_xport_layers.h). docs/connector.md has the model;
python/README.md ("Transports") the Python side.

    # decode                                    # prefill
    x = Transport(token, listen_host="127.0.0.1")
                                                y = Transport(token)
                                                peer = y.connect("127.0.0.1", x.port)
    peer = x.accept(5000)
    mem = x.register(decode_cache)              mem = y.register(prefill_cache)
    blob = peer.expose(mem)  --out of band-->   rmem = peer.import_blob(blob)
                                                plan = Plan(prefill_layout, decode_layout)
                                                xf = peer.write_plan(plan, mem, src_blocks,
                                                                     rmem, dst_blocks, n_tokens,
                                                                     notify=(tag, b"msg"))
    note = x.poll(5000)  # (peer_id, tag, data)  xf.wait(5000) -> "done"

Lifetimes. Every object keeps a reference to what it depends on (a Peer
its Transport, a Mem its Transport and the memory it registered, a
RemoteMem its Peer, a Transfer everything it moves between, a LayerTx
request its peer, plan, regions and block lists until it is reported), so
dropping them in any order is safe. close() frees the C handle now, and is
refused (BadState, naming them) while something still uses it: the C
library refuses a transport with peers, regions or transfers, a region
exposed or in a transfer, a transfer not terminal; here, a peer with
requests of a LayerTx open, and any handle while a call on it is in flight
on another thread. An object collected while its handle is still in use
(a transfer not terminal: it is cancelled first) is kept, with what it
holds, until the library lets it go.

Errors: every failed call raises the KvError subclass of its status with
the C library's message (kvcache.errors).
"""
import ctypes
import threading
import time
from collections import namedtuple
from typing import List, Optional, Tuple

from . import _lib
from ._ints import I32, INT, U32, U64, CInt, int_array, integer
from .cache import Cache, Layout, _plan_config
from .errors import STATUS, check, error, error_class
from .paged import PagedCache
from .tensors import region

L = _lib.lib
_U16 = CInt("uint16", ctypes.c_uint16)

KINDS = {"tcp": 1, "rdma": 2, "auto": 4}
STATES = ("pending", "done", "failed", "timed_out", "cancelled")
PEER_STATES = ("connecting", "ready", "closed")
BLOB_MAX = _lib.KV_XPORT_BLOB_MAX
NOTIFY_MAX = _lib.KV_XPORT_NOTIFY_MAX
XLAYER_TAG = _lib.KV_XLAYER_TAG
_MEM_HOST, _MEM_PINNED = 0, 1
_NAMES = {v: k for k, v in STATUS.items()}

Note = namedtuple("Note", "peer_id tag data")
Note.__doc__ = """A notification received (kv_xport_msg): the sender's peer id
(Peer.id), the tag, the message bytes. Every write it covers has landed."""

Finished = namedtuple("Finished", "request status")
Finished.__doc__ = """A request of a LayerTx / LayerRx that reached its terminal
state: status "KV_OK" (every layer landed / acknowledged) or its failure's
name ("KV_ERR_CANCELLED", ...). Reported once."""


def _text(v, name):
    """A str argument as C bytes: refused (InvalidArgument) when not a str
    or when it holds a NUL, which C would read as its end."""
    if not isinstance(v, str) or "\0" in v:
        raise error("KV_ERR_INVALID_ARG", "%s: a string without NUL, got %s %r" %
                    (name, type(v).__name__, v))
    return v.encode()


def _octets(v, name):
    """A bytes-like argument (bytes, bytearray, memoryview, a buffer) as
    bytes: a str or an int is refused (InvalidArgument), not encoded or
    turned into that many zeros."""
    try:
        return bytes(memoryview(v))
    except TypeError:
        raise error("KV_ERR_INVALID_ARG", "%s: bytes-like, got %s" %
                    (name, type(v).__name__)) from None


def _status_name(code):
    return _NAMES.get(code) or L.kv_status_name(code).decode()


# ---- handles -----------------------------------------------------------------

_ORPHANS = []  # (free function, handle, what it holds): collected while still in use
_ORPHANS_LOCK = threading.Lock()


def _reap():
    """Free the orphaned handles the library now lets go of. The list is
    taken out under the lock and worked on outside it: dropping a freed
    entry's deps can run a finalizer (Transport.__del__) that reaps in turn,
    and the lock is not reentrant (it hung for good)."""
    with _ORPHANS_LOCK:
        pending = list(_ORPHANS)
        del _ORPHANS[:]
    keep = []
    for free, h, deps in pending:
        try:
            if not free(h):
                keep.append((free, h, deps))
        except Exception:  # noqa: BLE001 - interpreter shutdown
            keep.append((free, h, deps))
    del pending
    with _ORPHANS_LOCK:
        _ORPHANS[:0] = keep


class _Handle:
    """A C handle and the calls in flight on it: close() is refused
    (BadState) while another thread is inside a call, never frees the handle
    under it."""
    _what = "handle"

    def __init__(self):
        self._h = None
        self._lock = threading.Lock()
        self._busy = 0

    def _enter(self):
        with self._lock:
            if not self._h:
                raise error("KV_ERR_BAD_STATE", "the %s is closed" % self._what)
            self._busy += 1
            return self._h

    def _leave(self):
        with self._lock:
            self._busy -= 1

    def _take(self):
        """The handle, detached from this object (None when closed):
        refused while calls are in flight."""
        with self._lock:
            if self._busy:
                raise error("KV_ERR_BAD_STATE", "close(): %d call(s) on the %s in flight on "
                            "other threads" % (self._busy, self._what))
            h, self._h = self._h, None
            return h

    def _restore(self, h):
        with self._lock:
            self._h = h

    def _free(self, free_fn) -> bool:
        """close()'s common part: detach the handle and free it with
        free_fn; a refusal gives the handle back and raises. False when it
        was closed already."""
        h = self._take()
        if not h:
            return False
        st = free_fn(h)
        if st != 0:
            self._restore(h)
        check(st)
        return True

    @property
    def closed(self) -> bool:
        return not self._h

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _Use:
    """with _Use(obj) as h: one call in flight on obj's handle h."""
    __slots__ = ("o", "h")

    def __init__(self, o):
        self.o = o

    def __enter__(self):
        self.h = self.o._enter()
        return self.h

    def __exit__(self, *exc):
        self.o._leave()


def _orphan(free, h, deps):
    """Keep h (and what its memory depends on) until free(h) succeeds."""
    with _ORPHANS_LOCK:
        _ORPHANS.append((free, h, deps))


def _ok(status):
    return status == 0


# ---- plans -------------------------------------------------------------------


def _layout(x, what):
    lay = x if isinstance(x, Layout) else getattr(x, "layout", None)
    if not isinstance(lay, Layout):
        raise error("KV_ERR_INVALID_ARG", "%s: a kvcache.Layout (or a Cache or PagedCache), got "
                    "%s" % (what, type(x).__name__))
    return lay


class Plan:
    """How the blocks of one layout become the blocks of another
    (kv_plan_create): src and dst are Layouts (or Caches / PagedCaches:
    their layouts) of the same dtype and head dim. heads = (src_head0,
    dst_head0, n_heads) moves a head range; layers = (src_layer0,
    dst_layer0, n_layers) a layer range (one layer per transfer, or a
    pipeline stage's layers into the decoder's matching ones); None: all.
    Immutable; freed when collected."""

    def __init__(self, src, dst, heads: Optional[Tuple[int, int, int]] = None,
                 layers: Optional[Tuple[int, int, int]] = None):
        self._h = None
        self.src, self.dst = _layout(src, "src"), _layout(dst, "dst")
        self.heads, self.layers = heads, layers
        cfg = _plan_config(
            None if heads is None else (heads, ("src_head0", "dst_head0", "n_heads")),
            None if layers is None else (layers, ("src_layer0", "dst_layer0", "n_layers")))
        h = ctypes.c_void_p()
        check(L.kv_plan_create(ctypes.byref(self.src._c), ctypes.byref(self.dst._c),
                               ctypes.byref(cfg) if cfg is not None else None,
                               ctypes.byref(h)))
        self._h = h.value

    def stats(self) -> dict:
        """kv_plan_stats: window_tokens, window_src_blocks, window_dst_blocks,
        rows, runs, copies, window_bytes (per window of lcm(Ns, Nd) tokens)."""
        st = _lib.PlanStats()
        check(L.kv_plan_stats_get(self._h, ctypes.byref(st)))
        return {n: int(getattr(st, n)) for n, _ in st._fields_}

    def blocks(self, n_tokens: int) -> Tuple[int, int]:
        """(n_src, n_dst): the block-list lengths a request of n_tokens needs."""
        n = integer(n_tokens, "n_tokens", U64)
        ns, nd = self.src.block_tokens, self.dst.block_tokens
        return -(-n // ns), -(-n // nd)

    def __del__(self):
        h, self._h = getattr(self, "_h", None), None
        if h:
            try:
                L.kv_plan_destroy(h)
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass

    def __repr__(self):
        return "Plan(%s %s -> %s %s, heads=%r, layers=%r)" % (
            self.src.order, self.src.block_tokens, self.dst.order, self.dst.block_tokens,
            self.heads, self.layers)


# ---- the transport -----------------------------------------------------------


class Transport(_Handle):
    """One transport endpoint (kv_xport_create) and its progress thread.

    token: the shared secret (non-zero; a peer presenting another is
    refused). kind "tcp" (default), "rdma", or "auto" (TCP addresses; a peer
    on this host, proved at connect, is carried through shared memory, any
    other over TCP; both ends "auto": docs/connector.md, "Automatic
    choice"). listen_host: accept peers on
    this address ("127.0.0.1"; None: do not listen), listen_port (0: any
    free port, see .port). fingerprint: what both sides must agree on (0 on
    both: unchecked). The other keywords are the C config's fields of the
    same names (0 = the library's default; docs/connector.md)."""
    _what = "transport"

    def __init__(self, token: int, kind: str = "tcp", listen_host: Optional[str] = None,
                 listen_port: int = 0, fingerprint: int = 0, conns_per_peer: int = 0,
                 timeout_ms: int = 0, max_pending_notes: int = 0, max_pending_reads: int = 0,
                 max_handshakes: int = 0, frames_per_round: int = 0,
                 plan_gather_below_bytes: int = 0, rdma_device: Optional[str] = None,
                 rdma_port: int = 0, rdma_gid_index: int = -1, rdma_busy_poll: bool = False):
        super().__init__()
        if not isinstance(kind, str) or kind not in KINDS:
            raise error("KV_ERR_INVALID_ARG", "kind %r: one of %s" % (kind, sorted(KINDS)))
        cfg = _lib.XportConfig()
        cfg.struct_size = ctypes.sizeof(cfg)
        cfg.kind = KINDS[kind]
        host = _text(listen_host, "listen_host") if listen_host is not None else None
        dev = _text(rdma_device, "rdma_device") if rdma_device is not None else None
        cfg.listen_host = host
        cfg.listen_port = integer(listen_port, "listen_port", _U16)
        cfg.token = integer(token, "token", U64)
        cfg.fingerprint = integer(fingerprint, "fingerprint", U64)
        for n, v in (("conns_per_peer", conns_per_peer), ("timeout_ms", timeout_ms),
                     ("max_pending_notes", max_pending_notes),
                     ("max_pending_reads", max_pending_reads),
                     ("max_handshakes", max_handshakes), ("frames_per_round", frames_per_round),
                     ("plan_gather_below_bytes", plan_gather_below_bytes),
                     ("rdma_port", rdma_port)):
            setattr(cfg, n, integer(v, n, U32))
        cfg.rdma_device = dev
        cfg.rdma_gid_index = integer(rdma_gid_index, "rdma_gid_index", I32)
        cfg.rdma_busy_poll = bool(rdma_busy_poll)
        h = ctypes.c_void_p()
        check(L.kv_xport_create(ctypes.byref(cfg), ctypes.byref(h)))
        self._h = h.value
        self.kind = kind
        self.port = int(L.kv_xport_port(self._h))  # 0 when not listening

    def connect(self, host: str, port: int) -> "Peer":
        """Start connecting to host:port; the Peer is "connecting" until the
        handshake ends (Peer.wait)."""
        p = ctypes.c_void_p()
        with _Use(self) as h:
            check(L.kv_xport_connect(h, _text(host, "host"), integer(port, "port", _U16),
                                     ctypes.byref(p)))
        return Peer(self, p.value)

    def accept(self, timeout_ms: int = 0) -> Optional["Peer"]:
        """The next peer whose handshake completed, waiting at most
        timeout_ms: a Peer, or None when none came."""
        p = ctypes.c_void_p()
        with _Use(self) as h:
            st = L.kv_xport_accept(h, integer(timeout_ms, "timeout_ms", U32), ctypes.byref(p))
        if st == STATUS["KV_ERR_TIMEOUT"]:
            return None
        check(st)
        return Peer(self, p.value)

    def register(self, memory) -> "Mem":
        """Register memory for transfers (kv_xport_mem_reg): a Cache (its
        whole arena), a PagedCache (its memory), or any writable C-contiguous
        host buffer (a NumPy array, a torch tensor, a bytearray). The Mem
        holds the memory (a reference on the C cache for a Cache) until it
        is deregistered."""
        _reap()
        cref = None
        if isinstance(memory, (Cache, PagedCache)):
            memory._enter()  # a closed Cache is refused (BadState)
            try:
                pc = memory._paged()  # so is one in device memory
                # a Cache: a C reference of the Mem's own, released only once
                # the region is deregistered (a _Memory's finalizer, run by gc
                # with the rest of a cycle, freed the arena under an orphaned
                # registration that a transfer was still sending from)
                keep = memory if isinstance(memory, PagedCache) else None
                if isinstance(memory, Cache):
                    cref = L.kv_cache_retain(memory._h)
            finally:
                memory._leave()
            ptr, nbytes, kind = pc.base, pc.storage_bytes, pc.mem
        else:
            r = region(memory, "memory")
            keep = r
            ptr, nbytes = r.ptr, r.nbytes
            kind = _MEM_PINNED if r.device[0] == 3 else _MEM_HOST
        m = ctypes.c_void_p()
        try:
            with _Use(self) as h:
                check(L.kv_xport_mem_reg(h, ptr, nbytes, kind, ctypes.byref(m)))
        except BaseException:
            if cref:
                L.kv_cache_destroy(cref)
            raise
        return Mem(self, m.value, keep, cref)

    def poll(self, timeout_ms: int = 0) -> Optional[Note]:
        """The oldest notification received (kv_xport_notify_poll), waiting
        at most timeout_ms; None when none came."""
        msg = _lib.XportMsg()
        with _Use(self) as h:
            st = L.kv_xport_notify_poll(h, integer(timeout_ms, "timeout_ms", U32),
                                        ctypes.byref(msg))
        if st == STATUS["KV_ERR_TIMEOUT"]:
            return None
        check(st)
        return Note(int(msg.peer_id), int(msg.tag), bytes(msg.data[:msg.len]))

    def stats(self) -> dict:
        """What the transport refused or closed, and how write_plan posted
        (kv_xport_stats)."""
        st = _lib.XportStats()
        st.struct_size = ctypes.sizeof(st)
        with _Use(self) as h:
            check(L.kv_xport_stats_get(h, ctypes.byref(st)))
        return {n: int(getattr(st, n)) for n, _ in st._fields_ if n != "struct_size"}

    def close(self) -> None:
        """Destroy the transport (kv_xport_destroy). Refused (BadState, the
        library naming them) while it has peers not closed, regions
        registered, imported regions or transfers not freed. Idempotent."""
        _reap()
        h = self._take()
        if not h:
            return
        st = L.kv_xport_destroy(h)
        if st == STATUS["KV_ERR_BAD_STATE"]:
            self._restore(h)  # refused: nothing was freed
        check(st)

    def __del__(self):
        h = getattr(self, "_h", None)
        if h:  # nothing holds it any more: its peers, regions and transfers are gone
            self._h = None
            try:
                _reap()
                if L.kv_xport_destroy(h) == STATUS["KV_ERR_BAD_STATE"]:
                    _orphan(lambda x: _ok(L.kv_xport_destroy(x)), h, ())
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass

    def __repr__(self):
        return "Transport(%s, port %d%s)" % (self.kind, self.port,
                                             ", closed" if self.closed else "")


class Peer(_Handle):
    """A connection to another transport (kv_xport_connect / accept)."""
    _what = "peer"

    def __init__(self, transport, h):
        super().__init__()
        self.transport = transport
        self._h = h
        self.id = int(L.kv_xport_peer_id(h))
        self._exposed = {}  # id(Mem) -> Mem: what the peer may write (held while exposed)
        self._tx_open = 0  # requests of a LayerTx open on this peer

    def state(self) -> Tuple[str, str]:
        """(state, why): "connecting", "ready" or "closed"; why the status
        name of a close ("KV_OK" for a clean one, "KV_ERR_MISMATCH", ...)."""
        s, why = ctypes.c_int(), ctypes.c_int()
        with _Use(self) as h:
            check(L.kv_xport_peer_state_get(h, ctypes.byref(s), ctypes.byref(why)))
        return PEER_STATES[s.value], _status_name(why.value)

    def path(self) -> Tuple[str, str]:
        """(kind, why): the backend carrying this peer ("tcp", "shm", "rdma")
        and why (kv_xport_peer_info_get's path, path_why: for a transport of
        kind "auto", the probe's answer and the proof, or why it stayed on
        TCP; otherwise "configured")."""
        inf = _lib.XportInfo()
        inf.struct_size = ctypes.sizeof(inf)
        with _Use(self) as h:
            check(L.kv_xport_peer_info_get(h, ctypes.byref(inf)))
        return L.kv_xport_kind_name(inf.path).decode(), inf.path_why.decode()

    def wait(self, timeout_ms: int) -> None:
        """Wait for the handshake: returns once ready; raises the close
        reason (Mismatch naming the field, IoError, ...) or Timeout."""
        with _Use(self) as h:
            check(L.kv_xport_peer_wait(h, integer(timeout_ms, "timeout_ms", U32), None))

    def expose(self, mem: "Mem") -> bytes:
        """Let the peer write (and read) mem; returns the blob it imports
        (Peer.import_blob on its side) to address it. The peer holds mem
        until unexpose() or close()."""
        if not isinstance(mem, Mem):
            raise error("KV_ERR_INVALID_ARG", "mem: a kvcache.transport.Mem, got %s" %
                        type(mem).__name__)
        blob = (ctypes.c_ubyte * BLOB_MAX)()
        n = ctypes.c_size_t()
        with _Use(self) as h, _Use(mem) as m:
            check(L.kv_xport_mem_expose(h, m, blob, BLOB_MAX, ctypes.byref(n)))
            self._exposed[id(mem)] = mem
        return bytes(blob[:n.value])

    def unexpose(self, mem: "Mem") -> None:
        """Withdraw the peer's access to mem (waits for its writes landing in
        it; later ones are refused)."""
        if not isinstance(mem, Mem):
            raise error("KV_ERR_INVALID_ARG", "mem: a kvcache.transport.Mem, got %s" %
                        type(mem).__name__)
        with _Use(self) as h, _Use(mem) as m:
            check(L.kv_xport_mem_unexpose(h, m))
            self._exposed.pop(id(mem), None)

    def import_blob(self, blob: bytes) -> "RemoteMem":
        """The peer's region from the blob its side's expose() returned
        (Corrupt for a blob that fails its checks or names another peer)."""
        b = _octets(blob, "blob")
        r = ctypes.c_void_p()
        with _Use(self) as h:
            check(L.kv_xport_rmem_import(h, b, len(b), ctypes.byref(r)))
        return RemoteMem(self, r.value)

    @staticmethod
    def _notify(notify, keep):
        if notify is None:
            return None
        if not isinstance(notify, tuple) or len(notify) != 2:
            raise error("KV_ERR_INVALID_ARG", "notify: (tag, message bytes), got %r" %
                        (notify,))
        tag, msg = notify
        b = _octets(msg, "notify message")
        keep.append(b)
        nt = _lib.XportNotify(integer(tag, "notify tag", U64), ctypes.cast(b, ctypes.c_void_p),
                              integer(len(b), "notify length", U32))
        return ctypes.byref(nt)

    @staticmethod
    def _ios(ios, deps):
        """ios checked: [(Mem, local_off, RemoteMem, remote_off, bytes)], their
        regions appended to deps."""
        if isinstance(ios, (str, bytes, bytearray)) or not hasattr(ios, "__iter__"):
            raise error("KV_ERR_INVALID_ARG", "ios: a list of (local Mem, local_off, RemoteMem, "
                        "remote_off, bytes), got %s" % type(ios).__name__)
        out = []
        for i, io in enumerate(ios):
            if not isinstance(io, (tuple, list)) or len(io) != 5:
                raise error("KV_ERR_INVALID_ARG", "ios[%d]: (local Mem, local_off, RemoteMem, "
                            "remote_off, bytes), got %r" % (i, io))
            lm, lo, rm, ro, n = io
            if not isinstance(lm, Mem) or not isinstance(rm, RemoteMem):
                raise error("KV_ERR_INVALID_ARG", "ios[%d]: a Mem and a RemoteMem, got %s and %s"
                            % (i, type(lm).__name__, type(rm).__name__))
            deps += [lm, rm]
            out.append((lm, integer(lo, "ios[%d] local_off" % i, U64), rm,
                        integer(ro, "ios[%d] remote_off" % i, U64),
                        integer(n, "ios[%d] bytes" % i, U64)))
        return out, integer(len(out), "len(ios)", U32)

    @staticmethod
    def _io_array(ios):
        """The kv_xport_io array (the regions' handles read while held)."""
        arr = (_lib.XportIo * max(len(ios), 1))()
        for i, (lm, lo, rm, ro, n) in enumerate(ios):
            arr[i] = _lib.XportIo(lm._h, lo, rm._h, ro, n)
        return arr

    def write(self, ios, notify: Optional[Tuple[int, bytes]] = None) -> "Transfer":
        """Post one-sided writes: ios = [(local Mem, local_off, RemoteMem,
        remote_off, bytes), ...] and an optional notification (tag, message
        bytes, at most NOTIFY_MAX) delivered after every byte landed. An
        empty ios with a notification sends the notification alone."""
        deps, keep = [self], []
        ios, n = self._ios(ios, deps)
        nt = self._notify(notify, keep)
        xf = ctypes.c_void_p()
        with _Use(self) as h, _Hold(deps[1:]):
            check(L.kv_xport_write(h, self._io_array(ios), n, nt, ctypes.byref(xf)))
        return Transfer(xf.value, deps)

    def read(self, ios) -> "Transfer":
        """Post one-sided reads: bytes from each RemoteMem + remote_off land in
        the Mem + local_off (the same tuples as write)."""
        deps = [self]
        ios, n = self._ios(ios, deps)
        xf = ctypes.c_void_p()
        with _Use(self) as h, _Hold(deps[1:]):
            check(L.kv_xport_read(h, self._io_array(ios), n, ctypes.byref(xf)))
        return Transfer(xf.value, deps)

    def write_plan(self, plan: Plan, local: "Mem", src_blocks, remote: "RemoteMem",
                   dst_blocks, n_tokens: int, notify: Optional[Tuple[int, bytes]] = None,
                   local_base_off: int = 0, remote_base_off: int = 0) -> "Transfer":
        """Post the byte runs of plan for one request (kv_xport_write_plan):
        token t of the request lies in src_blocks[t // Ns] of the cache at
        local + local_base_off and goes to dst_blocks[t // Nd] of the cache
        at remote + remote_base_off (n_src = ceil(n_tokens / Ns), n_dst =
        ceil(n_tokens / Nd)); then the notification. Nothing is sent on an
        error."""
        deps, keep = [self, plan, local, remote], []
        sb, db = _blocks(src_blocks, "src_blocks"), _blocks(dst_blocks, "dst_blocks")
        deps += [sb, db]
        _types(plan, local, remote)
        xf = ctypes.c_void_p()
        with _Use(self) as h, _Hold([local, remote]):
            check(L.kv_xport_write_plan(
                h, plan._h, local._h, integer(local_base_off, "local_base_off", U64),
                _u32p(sb), sb.size, remote._h, integer(remote_base_off, "remote_base_off", U64),
                _u32p(db), db.size, integer(n_tokens, "n_tokens", U64),
                self._notify(notify, keep), ctypes.byref(xf)))
        return Transfer(xf.value, deps)

    def close(self) -> None:
        """Close the peer (kv_xport_peer_close: its transfers end CANCELLED,
        its exposures end). Refused (BadState) while a LayerTx has requests
        open on it. Idempotent."""
        with self._lock:
            if self._tx_open and self._h:
                raise error("KV_ERR_BAD_STATE", "close(): the peer has %d request(s) of a "
                            "LayerTx open (cancel them and collect them with finished())" %
                            self._tx_open)
        h = self._take()
        if h:
            L.kv_xport_peer_close(h)
            self._exposed.clear()

    def __del__(self):
        h = getattr(self, "_h", None)
        if h:  # no transfer, imported region or LayerTx request holds this object
            self._h = None
            try:
                L.kv_xport_peer_close(h)
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass

    def __repr__(self):
        return "Peer(id %d%s)" % (self.id, ", closed" if self.closed else "")


class _Hold:
    """Calls in flight on several handles (their close() refused meanwhile)."""

    def __init__(self, objs):
        self.objs = [o for o in objs if isinstance(o, _Handle)]
        self.n = 0

    def __enter__(self):
        try:
            for o in self.objs:
                o._enter()
                self.n += 1
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        for o in self.objs[:self.n]:
            o._leave()
        self.n = 0


def _blocks(xs, what):
    return int_array(xs, what, U32, ndim=1)


def _u32p(a):
    return a.ctypes.data_as(_lib.c_u32p) if a.size else None


def _types(plan, local, remote):
    if not isinstance(plan, Plan):
        raise error("KV_ERR_INVALID_ARG", "plan: a kvcache.transport.Plan, got %s" %
                    type(plan).__name__)
    if not isinstance(local, Mem) or not isinstance(remote, RemoteMem):
        raise error("KV_ERR_INVALID_ARG", "local, remote: a Mem and a RemoteMem, got %s and %s"
                    % (type(local).__name__, type(remote).__name__))


def _mem_free(cref):
    """A free function for a Mem handle: deregister, then drop the C
    reference on a registered Cache (cref, or None)."""
    def free(h):
        if not _ok(L.kv_xport_mem_dereg(h)):
            return False
        if cref:
            L.kv_cache_destroy(cref)
        return True
    return free


class Mem(_Handle):
    """A registered local region (kv_xport_mem_reg): Transport.register."""
    _what = "registered region"

    def __init__(self, transport, h, memory, cref=None):
        super().__init__()
        self.transport = transport
        self._h = h
        self._memory = memory
        self._cref = cref  # a registered Cache: the Mem's own C reference on it
        self.nbytes = int(L.kv_xport_mem_bytes(h))

    def close(self) -> None:
        """Deregister (kv_xport_mem_dereg): refused (BadState) while a
        transfer or an exposure uses it. Idempotent."""
        if not self._free(L.kv_xport_mem_dereg):
            return
        self._memory = None
        cref, self._cref = self._cref, None
        if cref:
            L.kv_cache_destroy(cref)

    def __del__(self):
        h = getattr(self, "_h", None)
        if h:
            self._h = None
            cref, self._cref = self._cref, None
            try:
                free = _mem_free(cref)
                if not free(h):
                    _orphan(free, h, (self.transport, self._memory))
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass

    def __repr__(self):
        return "Mem(%d bytes%s)" % (self.nbytes, ", closed" if self.closed else "")


class RemoteMem(_Handle):
    """A peer's region imported from its blob (Peer.import_blob)."""
    _what = "imported region"

    def __init__(self, peer, h):
        super().__init__()
        self.peer = peer
        self._h = h
        self.nbytes = int(L.kv_xport_rmem_bytes(h))

    def close(self) -> None:
        """Free (kv_xport_rmem_free): refused (BadState, naming them) while a
        transfer that is not terminal uses it. Idempotent."""
        if not self._free(L.kv_xport_rmem_free):
            return

    def __del__(self):
        h = getattr(self, "_h", None)
        if h:
            self._h = None
            try:
                if L.kv_xport_rmem_free(h) != 0:
                    _orphan(lambda x: _ok(L.kv_xport_rmem_free(x)), h, (self.peer,))
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass

    def __repr__(self):
        return "RemoteMem(%d bytes%s)" % (self.nbytes, ", closed" if self.closed else "")


class Transfer(_Handle):
    """A posted transfer: every one reaches exactly one terminal state
    ("done", "failed", "timed_out", "cancelled") within the transport's
    timeout. It holds what it moves (regions, plan, block lists) until it
    is freed; collected while pending, it is cancelled and kept until
    terminal."""
    _what = "transfer"

    def __init__(self, h, deps):
        super().__init__()
        self._h = h
        self._deps = deps

    def test(self) -> str:
        """The state now."""
        s = ctypes.c_int()
        with _Use(self) as h:
            check(L.kv_xport_xfer_test(h, ctypes.byref(s)))
        return STATES[s.value]

    def wait(self, timeout_ms: int) -> str:
        """The terminal state, waiting at most timeout_ms (Timeout when it is
        still pending)."""
        s = ctypes.c_int()
        with _Use(self) as h:
            check(L.kv_xport_xfer_wait(h, integer(timeout_ms, "timeout_ms", U32),
                                       ctypes.byref(s)))
        return STATES[s.value]

    def cancel(self) -> None:
        """Ask to cancel: it ends "cancelled" once nothing of it is in flight."""
        with _Use(self) as h:
            check(L.kv_xport_xfer_cancel(h))

    def results(self) -> List[str]:
        """Each entry's status name, once terminal (BadState before)."""
        p = ctypes.POINTER(ctypes.c_int)()
        n = ctypes.c_uint32()
        with _Use(self) as h:
            check(L.kv_xport_xfer_results(h, ctypes.byref(p), ctypes.byref(n)))
            return [_status_name(p[i]) for i in range(n.value)]

    def note_status(self) -> str:
        """The notification's status name, once terminal (BadState before):
        "KV_OK" when delivered (or none was sent), else the peer's refusal
        ("KV_ERR_CAPACITY": its queue of unpolled notifications was full;
        the entries' data landed)."""
        st = ctypes.c_int()
        with _Use(self) as h:
            check(L.kv_xport_xfer_note_status(h, ctypes.byref(st)))
        return _status_name(st.value)

    @property
    def error(self) -> str:
        """Why a terminal transfer that is not done ended ("" otherwise)."""
        with _Use(self) as h:
            return (L.kv_xport_xfer_error(h) or b"").decode(errors="replace")

    def check(self, timeout_ms: int) -> None:
        """Wait, then raise the failure of a transfer that did not end done:
        the KvError of its first failed entry (or of its refused notification:
        Capacity when the peer's queue was full), with the library's words."""
        state = self.wait(timeout_ms)
        if state == "done":
            return
        res = [s for s in self.results() if s != "KV_OK"]
        if not res and state == "failed":  # every entry landed: the notification refused
            res = [s for s in (self.note_status(),) if s != "KV_OK"]
        name = res[0] if res else {"cancelled": "KV_ERR_CANCELLED",
                                   "timed_out": "KV_ERR_TIMEOUT"}.get(state, "KV_ERR_IO")
        raise error_class(name)("transfer %s: %s" % (state, self.error or name), status=name,
                                code=STATUS.get(name))

    def close(self) -> None:
        """Free (kv_xport_xfer_free): refused (BadState) until terminal.
        Idempotent."""
        if not self._free(L.kv_xport_xfer_free):
            return
        self._deps = ()

    def __del__(self):
        h = getattr(self, "_h", None)
        if not h:
            return
        self._h = None
        try:
            if L.kv_xport_xfer_free(h) == 0:
                return
            L.kv_xport_xfer_cancel(h)
            L.kv_xport_xfer_wait(h, 1000, None)
            if L.kv_xport_xfer_free(h) != 0:
                _orphan(lambda x: _ok(L.kv_xport_xfer_free(x)), h, self._deps)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def __repr__(self):
        return "Transfer(%s)" % ("freed" if self.closed else self.test())


# ---- layer by layer (kv_xport_layers.h) ---------------------------------------


def _xlayer_config(max_requests, max_layers):
    c = _lib.XlayerConfig()
    c.struct_size = ctypes.sizeof(c)
    c.max_requests = integer(max_requests, "max_requests", U32)
    c.max_layers = integer(max_layers, "max_layers", U32)
    return c


def _finished(fn, h, cap=64):
    out = []
    buf = (_lib.XlayerDone * cap)()
    n = ctypes.c_uint32()
    while True:
        check(fn(h, buf, cap, ctypes.byref(n)))
        out += [Finished(int(buf[i].request), _status_name(buf[i].status))
                for i in range(n.value)]
        if n.value < cap:
            return out


class LayerTx(_Handle):
    """Prefill's side of layer-by-layer transfers (kv_xlayer_tx): open a
    request to a peer (begin), post each group of its layers as soon as it
    is written (post: one write_plan plus a LAYERS notification), and
    collect it once terminal (finished: its source blocks are free again).
    One thread at a time. A request holds its peer, plans, regions and
    block lists until finished() reports it."""
    _what = "layer sender"

    def __init__(self, max_requests: int = 0, max_layers: int = 0):
        super().__init__()
        # the C tracker is one thread's at a time: every call takes _mu (two
        # threads, wait and finished, had freed one transfer twice)
        self._mu = threading.Lock()
        self._req = {}  # request -> [peer, things its posts hold]
        h = ctypes.c_void_p()
        check(L.kv_xlayer_tx_create(ctypes.byref(_xlayer_config(max_requests, max_layers)),
                                    ctypes.byref(h)))
        self._h = h.value

    def begin(self, peer: Peer, request: int, n_layers: int) -> None:
        """Open request to peer with n_layers layers (the decoder's count)."""
        if not isinstance(peer, Peer):
            raise error("KV_ERR_INVALID_ARG", "peer: a kvcache.transport.Peer, got %s" %
                        type(peer).__name__)
        request = integer(request, "request", U64)
        with self._mu, _Use(self) as h, _Use(peer) as p:
            check(L.kv_xlayer_tx_begin(h, p, request, integer(n_layers, "n_layers", U32)))
            with peer._lock:
                peer._tx_open += 1
            self._req[request] = [peer]

    def post(self, request: int, plan: Plan, layer0: int, n_layers: int, local: Mem,
             src_blocks, remote: RemoteMem, dst_blocks, n_tokens: int,
             local_base_off: int = 0, remote_base_off: int = 0) -> None:
        """Post the destination layers [layer0, layer0 + n_layers) of
        request: plan must be built with layers=(src_layer0, layer0,
        n_layers) (it decides what moves; these name it to decode). The
        other arguments as Peer.write_plan. A refused post sends nothing."""
        request = integer(request, "request", U64)
        _types(plan, local, remote)
        sb, db = _blocks(src_blocks, "src_blocks"), _blocks(dst_blocks, "dst_blocks")
        with self._mu, _Use(self) as h, _Hold([local, remote]):
            check(L.kv_xlayer_tx_post(
                h, request, plan._h, integer(layer0, "layer0", U32),
                integer(n_layers, "n_layers", U32), local._h,
                integer(local_base_off, "local_base_off", U64), _u32p(sb), sb.size, remote._h,
                integer(remote_base_off, "remote_base_off", U64), _u32p(db), db.size,
                integer(n_tokens, "n_tokens", U64)))
            self._req[request] += [plan, local, remote, sb, db]

    def cancel(self, request: int) -> None:
        """Fail request (KV_ERR_CANCELLED): its transfers are cancelled, then
        decode is told (ABORT)."""
        with self._mu, _Use(self) as h:
            check(L.kv_xlayer_tx_cancel(h, integer(request, "request", U64)))

    def wait(self, request: int, timeout_ms: int) -> None:
        """Wait until request is terminal: returns when every layer was
        acknowledged, raises its failure, or Timeout. Waits in slices of
        20 ms, so other threads' calls on this LayerTx run between them."""
        request = integer(request, "request", U64)
        timeout_ms = integer(timeout_ms, "timeout_ms", U32)
        deadline = time.monotonic() + timeout_ms / 1000.0
        while True:
            left = max(0, int((deadline - time.monotonic()) * 1000))
            with self._mu, _Use(self) as h:
                st = L.kv_xlayer_tx_wait(h, request, min(left, 20))
            if st != STATUS["KV_ERR_TIMEOUT"]:
                check(st)
                return
            if left <= 20:
                raise error("KV_ERR_TIMEOUT", "LayerTx.wait: request %d not terminal within "
                            "%d ms" % (request, timeout_ms))

    def finished(self) -> List[Finished]:
        """Make progress, then the requests terminal since the last call,
        each reported once (their source blocks are the caller's again)."""
        with self._mu, _Use(self) as h:
            out = _finished(L.kv_xlayer_tx_finished, h)
        for f in out:
            held = self._req.pop(f.request, None)
            if held:
                with held[0]._lock:
                    held[0]._tx_open -= 1
        return out

    def close(self) -> None:
        """Free (kv_xlayer_tx_destroy): refused (BadState, naming the count)
        while requests are open: cancel them and collect them first."""
        if not self._free(L.kv_xlayer_tx_destroy):
            return

    def __del__(self):
        h = getattr(self, "_h", None)
        if not h:
            return
        self._h = None
        try:
            if L.kv_xlayer_tx_destroy(h) == 0:
                return
            for r in list(self._req):  # open requests: cancelled, never waited for here
                L.kv_xlayer_tx_cancel(h, r)
            free = _tx_free(tuple(self._req.values()))
            if not free(h):  # transfers still in flight: the reaper finishes it
                _orphan(free, h, tuple(self._req.values()))
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _tx_free(held):
    """A free function for a LayerTx handle whose open requests held the
    lists in held: collects, destroys, and then lets each request's peer be
    closed again (its _tx_open count; left at 1 for good before)."""
    def free(h):
        _finished(L.kv_xlayer_tx_finished, h)
        if not _ok(L.kv_xlayer_tx_destroy(h)):
            return False
        for req in held:
            with req[0]._lock:
                req[0]._tx_open -= 1
        return True
    return free


class LayerRx(_Handle):
    """Decode's side of layer-by-layer transfers (kv_xlayer_rx): expect a
    request from a peer before its blocks can be written, feed it every
    notification with tag XLAYER_TAG, wait for (request, layer), and
    collect each request once terminal (finished). Thread-safe: one thread
    may feed while others wait."""
    _what = "layer receiver"

    def __init__(self, max_requests: int = 0, max_layers: int = 0):
        super().__init__()
        h = ctypes.c_void_p()
        check(L.kv_xlayer_rx_create(ctypes.byref(_xlayer_config(max_requests, max_layers)),
                                    ctypes.byref(h)))
        self._h = h.value

    def expect(self, peer, request: int, n_layers: int) -> None:
        """Track request from peer (a Peer or its id) with n_layers layers."""
        pid = peer.id if isinstance(peer, Peer) else integer(peer, "peer id", U64)
        with _Use(self) as h:
            check(L.kv_xlayer_rx_expect(h, pid, integer(request, "request", U64),
                                        integer(n_layers, "n_layers", U32)))

    def feed(self, note: Note) -> None:
        """Account one notification (Transport.poll's Note with tag
        XLAYER_TAG). A refused one changes nothing and raises by name."""
        if not isinstance(note, Note):
            raise error("KV_ERR_INVALID_ARG", "note: a kvcache.transport.Note, got %s" %
                        type(note).__name__)
        data = _octets(note.data, "note data")  # an int is not that many zero bytes
        if len(data) > NOTIFY_MAX:
            raise error("KV_ERR_INVALID_ARG", "note: %d bytes, at most %d" %
                        (len(data), NOTIFY_MAX))
        msg = _lib.XportMsg()
        msg.peer_id = integer(note.peer_id, "peer_id", U64)
        msg.tag = integer(note.tag, "tag", U64)
        msg.len = len(data)
        ctypes.memmove(msg.data, data, len(data))
        with _Use(self) as h:
            check(L.kv_xlayer_rx_feed(h, ctypes.byref(msg)))

    def wait(self, request: int, layer: int, timeout_ms: int) -> None:
        """Returns once layer of request has landed; raises the request's
        failure (for every layer of a failed request), Timeout, NotFound
        (not tracked) or OutOfBounds (a layer past it)."""
        with _Use(self) as h:
            check(L.kv_xlayer_rx_wait(h, integer(request, "request", U64),
                                      integer(layer, "layer", U32),
                                      integer(timeout_ms, "timeout_ms", U32)))

    def fail(self, request: int, why: str = "KV_ERR_CANCELLED") -> None:
        """Fail request from this side with why (a failure status name):
        its waiters raise why at once. It is held, not in finished(), until
        prefill writes no more of its blocks (its ABORT, or its last layers
        landed) or release() says nothing more can land."""
        if not isinstance(why, str) or why not in STATUS:
            raise error("KV_ERR_INVALID_ARG", "why: a status name (KV_ERR_...), got %r" % (why,))
        with _Use(self) as h:
            check(L.kv_xlayer_rx_fail(h, integer(request, "request", U64),
                                      integer(STATUS[why], "why", INT)))

    def release(self, request: int) -> None:
        """A request this side failed, held: into finished() now. Call it
        once no byte of it can land any more (the peer closed, or the cache's
        region unexposed to it); BadState if it is not held."""
        with _Use(self) as h:
            check(L.kv_xlayer_rx_release(h, integer(request, "request", U64)))

    def finished(self) -> List[Finished]:
        """The requests terminal since the last call, each reported once
        ("KV_OK": its blocks hold every layer; else they are not to be
        attended over)."""
        with _Use(self) as h:
            return _finished(L.kv_xlayer_rx_finished, h)

    def stats(self) -> dict:
        st = _lib.XlayerRxStats()
        st.struct_size = ctypes.sizeof(st)
        with _Use(self) as h:
            check(L.kv_xlayer_rx_stats_get(h, ctypes.byref(st)))
        return {n: int(getattr(st, n)) for n, _ in st._fields_ if n != "struct_size"}

    def close(self) -> None:
        """Free (requests still tracked are forgotten). Refused (BadState)
        while another thread is in a call (a wait). Idempotent."""
        if not self._free(L.kv_xlayer_rx_destroy):
            return

    def __del__(self):
        h = getattr(self, "_h", None)
        if h:  # no thread waits: a waiter holds this object
            self._h = None
            try:
                L.kv_xlayer_rx_destroy(h)
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass

