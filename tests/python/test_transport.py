"""The transport bindings (kvcache.transport) over loopback TCP and over
kind "auto" (which carries these same-host peers through shared memory),
two transports in one process: a plan's write into another layout (NHD
layer-major 16-token blocks -> HND block-major padded 32-token blocks),
the whole destination pool compared with a reference built by NumPy
assignment through the caches' K/V views; a layer-by-layer request
(LayerTx -> LayerRx, a feeder thread, waits per layer); refusals with
their messages; handles freed in any order."""
import gc
import threading

import numpy as np
import pytest

import kvcache
from kvcache import transport as T

TOKEN = 0x6b76636163686521
L, H, D = 3, 2, 16


def src_layout(B=12):
    return kvcache.Layout(num_layers=L, num_blocks=B, block_tokens=16, num_heads=H, head_dim=D,
                          dtype="f32", order="NHD")


def dst_layout(B=7):
    return kvcache.Layout(num_layers=L, num_blocks=B, block_tokens=32, num_heads=H, head_dim=D,
                          dtype="f32", order="HND", arrange="block", block_pad_elems=24)


def filled(layout, seed):
    c = kvcache.Cache(layout, max_seqs=2)
    c.arena()[:] = np.random.default_rng(seed).integers(0, 256, layout.total_bytes, np.uint8)
    return c


class Pair:
    """Decode (a, listening) and prefill (b) connected: pa, pb their peers."""

    def __init__(self, token_b=TOKEN, kind="tcp"):
        self.a = kvcache.Transport(TOKEN, kind=kind, listen_host="127.0.0.1", timeout_ms=5000)
        self.b = kvcache.Transport(token_b, kind=kind, timeout_ms=5000)
        self.pb = self.b.connect("127.0.0.1", self.a.port)


@pytest.fixture(params=["tcp", "auto"])
def pair(request):
    p = Pair(kind=request.param)
    p.pb.wait(5000)
    p.pa = p.a.accept(5000)
    assert p.pa is not None and p.pa.state() == ("ready", "KV_OK")
    yield p


def expected(dst, src, sb, db, n_tokens, layers=range(L)):
    """dst's arena with tokens [0, covered) of every layer in `layers`
    assigned from src through their K/V views (bits as uint32): token t of
    the request in src block sb[t // Ns] goes to dst block db[t // Nd]."""
    twin = kvcache.Cache(dst.layout, max_seqs=1)
    twin.arena()[:] = dst.arena()
    ns, nd = src.layout.block_tokens, dst.layout.block_tokens
    covered = min(len(sb) * ns, len(db) * nd)
    for l in layers:
        for kv in (0, 1):
            s = src.kv(l, kv).numpy().view(np.uint32)
            d = twin.kv(l, kv).numpy().view(np.uint32)
            for t in range(covered):
                d[db[t // nd], t % nd] = s[sb[t // ns], t % ns]
    out = twin.arena().copy()
    twin.close()
    return out


def test_write_plan_into_another_layout_whole_pool(pair):
    src, dst = filled(src_layout(), 1), filled(dst_layout(), 2)
    src_before = src.arena().copy()
    sb, db, n = [11, 0, 6], [5, 2], 40  # 3 source blocks (48 tokens), 2 destination blocks
    want = expected(dst, src, sb, db, n)
    ms, md = pair.b.register(src), pair.a.register(dst)
    rm = pair.pb.import_blob(pair.pa.expose(md))
    plan = kvcache.Plan(src, dst)
    assert plan.blocks(n) == (3, 2)
    xf = pair.pb.write_plan(plan, ms, sb, rm, db, n, notify=(77, b"request 9"))
    assert xf.wait(5000) == "done"
    assert set(xf.results()) == {"KV_OK"} and xf.error == ""
    note = pair.a.poll(5000)  # delivered after every byte of the write
    assert note == T.Note(pair.pa.id, 77, b"request 9")
    assert np.array_equal(dst.arena(), want)  # the whole pool: nothing else written
    assert np.array_equal(src.arena(), src_before)
    st = pair.b.stats()
    assert st["plans_gathered"] + st["plans_direct"] == 1
    assert pair.a.poll(0) is None


def test_note_refused_for_capacity_raises_capacity():
    """Decode's queue of unpolled notifications full (max_pending_notes 1):
    the second write's data lands, its notification is refused; check()
    raises Capacity (not IoError) and note_status names it."""
    a = kvcache.Transport(TOKEN, listen_host="127.0.0.1", timeout_ms=5000, max_pending_notes=1)
    b = kvcache.Transport(TOKEN, timeout_ms=5000)
    pb = b.connect("127.0.0.1", a.port)
    pb.wait(5000)
    pa = a.accept(5000)
    src = np.arange(1 << 16, dtype=np.uint8)
    dst = np.zeros(1 << 16, dtype=np.uint8)
    ms, md = b.register(src), a.register(dst)
    rm = pb.import_blob(pa.expose(md))
    first = pb.write([(ms, 0, rm, 0, 1 << 15)], notify=(1, b"one"))
    first.check(5000)
    assert first.note_status() == "KV_OK"
    second = pb.write([(ms, 1 << 15, rm, 1 << 15, 1 << 15)], notify=(2, b"two"))
    with pytest.raises(kvcache.errors.Capacity, match="max_pending_notes"):
        second.check(5000)
    assert second.results() == ["KV_OK"] and second.note_status() == "KV_ERR_CAPACITY"
    assert np.array_equal(dst, src)  # the data of both landed
    assert a.poll(1000).tag == 1 and a.poll(50) is None
    for o in (first, second, rm, pa, pb, ms, md, a, b):
        o.close()


def test_wrong_types_are_named_errors(pair):
    """Arguments of the wrong type are InvalidArgument naming the argument,
    never a TypeError / AttributeError from inside the binding, a str
    encoded as a blob, an int turned into that many zero bytes, or a host
    cut short at a NUL."""
    ms = pair.b.register(np.zeros(4096, np.uint8))
    md = pair.a.register(np.zeros(4096, np.uint8))
    rm = pair.pb.import_blob(pair.pa.expose(md))
    cases = [
        ("listen_host", lambda: kvcache.Transport(TOKEN, listen_host=5)),
        ("listen_host", lambda: kvcache.Transport(TOKEN, listen_host="127.0.0.1\0x")),
        ("rdma_device", lambda: kvcache.Transport(TOKEN, rdma_device=b"mlx5_0")),
        ("host", lambda: pair.b.connect(5, pair.a.port)),
        ("host", lambda: pair.b.connect("127.0.0.1\0evil", pair.a.port)),
        ("ios", lambda: pair.pb.write(5)),
        ("ios", lambda: pair.pb.read(7)),
        ("notify message", lambda: pair.pb.write([(ms, 0, rm, 0, 8)], notify=(1, "text"))),
        ("blob", lambda: pair.pb.import_blob(48)),
        ("blob", lambda: pair.pb.import_blob("x" * 64)),
        ("mem", lambda: pair.pa.unexpose(5)),
    ]
    for name, call in cases:
        with pytest.raises(kvcache.errors.InvalidArgument, match=name):
            call()
    assert pair.a.poll(0) is None  # nothing was sent


def test_layerwise_request(pair):
    src, dst = filled(src_layout(), 3), filled(dst_layout(), 4)
    before = filled(dst_layout(), 4)  # dst as it is before the request
    sb, db, n = [2, 9], [6], 29
    ms, md = pair.b.register(src), pair.a.register(dst)
    rm = pair.pb.import_blob(pair.pa.expose(md))
    tx, rx = kvcache.LayerTx(), kvcache.LayerRx()
    rx.expect(pair.pa, 5, L)
    tx.begin(pair.pb, 5, L)
    stop = threading.Event()

    def feeder():  # decode's receive thread
        while not stop.is_set():
            note = pair.a.poll(50)
            if note is not None and note.tag == T.XLAYER_TAG:
                rx.feed(note)

    th = threading.Thread(target=feeder)
    th.start()
    try:
        plans = [kvcache.Plan(src, dst, layers=(l, l, 1)) for l in range(L)]
        for l in range(L):
            if l == 2:  # not posted yet: the wait times out, naming what landed
                with pytest.raises(kvcache.Timeout, match="2 of 3 landed"):
                    rx.wait(5, 2, 0)
            tx.post(5, plans[l], l, 1, ms, sb, rm, db, n)
            rx.wait(5, l, 5000)  # returns once layer l landed
            if l == 0:  # layer 0 landed, nothing else written; layer 0 again refused
                assert np.array_equal(dst.arena(), expected(before, src, sb, db, n, [0]))
                with pytest.raises(kvcache.Overlap, match=r"layers \[0, \+1\) posted before"):
                    tx.post(5, plans[0], 0, 1, ms, sb, rm, db, n)
        tx.wait(5, 5000)
    finally:
        stop.set()
        th.join()
    assert tx.finished() == [T.Finished(5, "KV_OK")]
    assert rx.finished() == [T.Finished(5, "KV_OK")]
    assert tx.finished() == [] and rx.finished() == []  # each reported once
    # the whole destination pool: every layer of the request, nothing else
    assert np.array_equal(dst.arena(), expected(before, src, sb, db, n))
    st = rx.stats()
    assert (st["notes_layers"], st["notes_refused"], st["tracked"]) == (L, 0, 0)
    for x in (tx, rx):
        x.close()


def test_refusals_name_the_values(pair):
    src, dst = filled(src_layout(), 5), filled(dst_layout(), 6)
    ms, md = pair.b.register(src), pair.a.register(dst)
    rm = pair.pb.import_blob(pair.pa.expose(md))
    plan = kvcache.Plan(src, dst)
    with pytest.raises(kvcache.OutOfBounds, match="12"):  # block 12 of a 12-block source
        pair.pb.write_plan(plan, ms, [1, 12], rm, [0], 20)
    with pytest.raises(kvcache.BadShape):  # 2 destination blocks for 20 tokens of 32
        pair.pb.write_plan(plan, ms, [1, 2], rm, [0, 1], 20)
    with pytest.raises(kvcache.InvalidArgument, match="4294967296"):
        pair.pb.write_plan(plan, ms, [1, 2 ** 32], rm, [0], 20)
    with pytest.raises(kvcache.InvalidArgument, match="a Mem and a RemoteMem"):
        pair.pb.write_plan(plan, rm, [1, 2], ms, [0], 20)
    with pytest.raises(kvcache.Corrupt):
        pair.pb.import_blob(b"\0" * 40)
    with pytest.raises(kvcache.BadShape, match="head"):  # head dims 16 and 8
        kvcache.Plan(src, kvcache.Layout(num_layers=L, num_blocks=4, block_tokens=16,
                                         num_heads=H, head_dim=8, dtype="f32"))
    with pytest.raises(kvcache.InvalidArgument, match="token"):
        kvcache.Transport(0)
    gone = filled(src_layout(), 9)
    gone.close()
    with pytest.raises(kvcache.BadState, match="the cache is closed"):
        pair.b.register(gone)
    rx = kvcache.LayerRx()
    with pytest.raises(kvcache.NotFound, match="request 3 is not tracked"):
        rx.wait(3, 0, 0)
    bad = T.Note(pair.pa.id, T.XLAYER_TAG, b"KVLW" + b"\0" * 28)
    with pytest.raises(kvcache.Corrupt, match="version 0"):
        rx.feed(bad)
    rx.close()
    # a peer presenting another token is refused at the handshake, by name
    other = Pair(token_b=TOKEN + 1, kind=pair.a.kind)
    with pytest.raises(kvcache.Mismatch, match="token"):
        other.pb.wait(5000)
    assert other.pb.state()[0] == "closed"
    other.pb.close()


def test_handles_freed_in_any_order(pair):
    src, dst = filled(src_layout(), 7), filled(dst_layout(), 8)
    ms, md = pair.b.register(src), pair.a.register(dst)
    rm = pair.pb.import_blob(pair.pa.expose(md))
    with pytest.raises(kvcache.BadState, match="still held.*peer"):
        pair.a.close()  # a peer and a region of it are held: refused, nothing freed
    with pytest.raises(kvcache.BadState, match="exposure"):
        md.close()  # exposed to pa
    tx = kvcache.LayerTx()
    tx.begin(pair.pb, 1, L)
    with pytest.raises(kvcache.BadState, match="LayerTx open"):
        pair.pb.close()
    with pytest.raises(kvcache.BadState, match="open"):
        tx.close()
    tx.cancel(1)
    with pytest.raises(kvcache.Cancelled):
        tx.wait(1, 5000)
    assert tx.finished() == [T.Finished(1, "KV_ERR_CANCELLED")]
    tx.close()
    # a wait in flight on another thread: close() is refused, never frees under it
    rx = kvcache.LayerRx()
    rx.expect(pair.pa, 2, L)
    got = []
    th = threading.Thread(target=lambda: got.append(pytest.raises(kvcache.Cancelled,
                                                                  rx.wait, 2, 1, 10000)))
    th.start()
    while rx._busy == 0:
        threading.Event().wait(0.001)
    with pytest.raises(kvcache.BadState, match="in flight"):
        rx.close()
    rx.fail(2, "KV_ERR_CANCELLED")  # wakes the waiter with the request's failure
    th.join()
    assert got and rx.finished() == []  # held: prefill might still write its blocks
    rx.release(2)  # nothing was posted for it: nothing can land
    with pytest.raises(kvcache.BadState, match="not held"):
        rx.release(2)
    assert rx.finished() == [T.Finished(2, "KV_ERR_CANCELLED")]
    rx.close()
    # the caches go first: the regions hold their memory
    src.close(), dst.close()
    xf = pair.pb.write_plan(kvcache.Plan(src_layout(), dst_layout()), ms, [3], rm, [1], 16)
    assert xf.wait(5000) == "done"
    # then everything dropped at once, in no order: nothing is left behind
    del src, dst, ms, md, rm, xf, tx  # (rx is closed; the waiter lambda holds it)
    pair.pa = pair.pb = pair.a = pair.b = None
    gc.collect()
    T._reap()
    assert T._ORPHANS == []


# ---- the split engine (examples/disagg_engine.py) ------------------------------


def load_disagg():
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples",
                        "disagg_engine.py")
    spec = importlib.util.spec_from_file_location("disagg_engine", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("model", ["gqa", "mla"])
def test_disagg_engine_matches_the_reference(capsys, model):
    st = load_disagg().main(["--small", "--model", model])
    assert st["bad"] == 0 and st["sequences"] == 7  # 6 requests, one forked into 2
    assert st["k_only"] == (model == "mla")  # MLA: K-only latent caches on both sides
    assert st["loaded"] == st["requests"] == 6  # every request's KV came from prefill
    assert st["notes"] == 6 * 2  # layer by layer: one notification per layer
    assert "PASS" in capsys.readouterr().out


@pytest.mark.parametrize("model", ["gqa", "mla"])
def test_disagg_engine_check_can_fail(monkeypatch, model):
    mod = load_disagg()
    real = mod.LayerwiseConnector.wait_for_layer_load

    def lost(self, layer):  # the layer landed, then is lost (zeroed; MLA: negated)
        real(self, layer)
        for r in self.meta:
            if self.cache.layout.k_only:  # MLA: the received latent rows, K only
                self.cache.kv(layer, 0).numpy()[np.asarray(r["dst_blocks"])] *= -1
                continue
            for kv in (0, 1):
                self.cache.kv(layer, kv).numpy()[np.asarray(r["dst_blocks"])] = 0

    monkeypatch.setattr(mod.LayerwiseConnector, "wait_for_layer_load", lost)
    assert mod.main(["--small", "--model", model])["bad"] > 0


def test_path_says_which_backend_and_why(pair):
    kind, why = pair.pb.path()
    if pair.a.kind == "auto":  # both ends on this host: shared memory, proved
        assert kind == "shm", why
        assert why.startswith("shm: 127.0.0.1:%d answered the probe" % pair.a.port), why
        assert "kvcache-shm:auto-" in why
        assert pair.pa.path()[0] == "shm"
    else:
        assert (kind, why) == ("tcp", "configured")
        assert pair.pa.path() == ("tcp", "configured")


# ---- found by an audit (2026-12-05) -------------------------------------------

def test_layer_tx_from_two_threads(pair):
    # wait() on one thread, finished() on another: the C tracker is one
    # thread's at a time, and the two freed one transfer twice (a crash)
    src, dst = filled(src_layout(), 11), kvcache.Cache(dst_layout(), max_seqs=2)
    ms, md = pair.b.register(src), pair.a.register(dst)
    rm = pair.pb.import_blob(pair.pa.expose(md))
    plans = [kvcache.Plan(src, dst, layers=(l, l, 1)) for l in range(L)]
    stop = threading.Event()
    threading.Thread(target=lambda: [pair.a.poll(20) for _ in iter(stop.is_set, True)],
                     daemon=True).start()
    tx = kvcache.LayerTx()
    errs = []
    for req in range(20):
        tx.begin(pair.pb, req, L)
        for l in range(L):
            tx.post(req, plans[l], l, 1, ms, [0, 1], rm, [0], 20)

        def waiter():
            try:
                tx.wait(req, 10000)
            except kvcache.KvError as e:  # the other thread may report it first
                if not isinstance(e, kvcache.NotFound):
                    errs.append(e)
        th = threading.Thread(target=waiter)
        th.start()
        got = []
        while th.is_alive() or not got:
            got += tx.finished()
        th.join()
        assert got == [T.Finished(req, "KV_OK")]
    stop.set()
    assert errs == []
    # a plan of other layers than those named: refused, nothing sent
    tx.begin(pair.pb, 99, L)
    with pytest.raises(kvcache.InvalidArgument, match=r"layers \[1, \+1\) named, but the plan "
                       r"writes destination layers \[0, \+1\)"):
        tx.post(99, plans[0], 1, 1, ms, [0, 1], rm, [0], 20)
    tx.cancel(99)
    with pytest.raises(kvcache.Cancelled):
        tx.wait(99, 5000)
    assert tx.finished() == [T.Finished(99, "KV_ERR_CANCELLED")]
    tx.close()


_STALL_CHILD = r"""
import sys, time, numpy as np, kvcache
x = kvcache.Transport(%d, listen_host="127.0.0.1")
print(x.port, flush=True)
m = x.register(np.zeros(%d, np.uint8))
p = x.accept(10000)
print(p.expose(m).hex(), flush=True)
t_end = time.time() + 30
while time.time() < t_end:
    x.poll(200)
"""


def test_dropped_while_a_peer_stalls():
    # decode (another process) stops reading; prefill's objects are dropped
    # with a transfer in flight: a registered Cache in a reference cycle with
    # its Mem and Transfer (gc ran the cache's finalizers under the orphaned
    # registration: a use after free), and a LayerTx with a request open
    # (its peer could never be closed again)
    import os
    import signal
    import subprocess
    import sys
    import time
    nb = 8 << 20
    child = subprocess.Popen([sys.executable, "-c", _STALL_CHILD % (TOKEN, nb)],
                             stdout=subprocess.PIPE, text=True)
    try:
        port = int(child.stdout.readline())
        # 3 s: the transfers must still be in flight at gc.collect below
        # (1.5 s left a slow run, ASan or a loaded machine, ~1.3 s of margin)
        y = kvcache.Transport(TOKEN, timeout_ms=3000)
        peer = y.connect("127.0.0.1", port)
        peer.wait(5000)
        rm = peer.import_blob(bytes.fromhex(child.stdout.readline().strip()))
        lay = kvcache.Layout(num_layers=2, num_blocks=1024, block_tokens=16, num_heads=2,
                             head_dim=16, dtype="f32")
        os.kill(child.pid, signal.SIGSTOP)

        class Request:
            pass
        r = Request()
        r.me = r
        r.cache = kvcache.Cache(lay, max_seqs=1)
        r.cache.arena()[:] = 7
        r.mem = y.register(r.cache)
        t_write = time.monotonic()
        r.xf = peer.write([(r.mem, 0, rm, 0, min(r.mem.nbytes, nb))])
        cache2 = kvcache.Cache(lay, max_seqs=1)
        mem2 = y.register(cache2)
        tx = kvcache.LayerTx()
        tx.begin(peer, 7, 2)
        blocks = np.arange(1024, dtype=np.uint32)
        tx.post(7, kvcache.Plan(lay, lay, layers=(0, 0, 1)), 0, 1, mem2, blocks, rm, blocks,
                1024 * 16)
        time.sleep(0.2)
        del r, tx
        gc.collect()
        assert T._ORPHANS  # still in flight: kept, not freed
        # the stall deadline ends the transfers
        time.sleep(max(0.0, t_write + 3.3 - time.monotonic()))
        os.kill(child.pid, signal.SIGCONT)
        # the LayerTx's ABORT may still need decode's answer (when the
        # socket had taken the frames whole, the peer stayed open)
        for _ in range(100):
            T._reap()
            if not T._ORPHANS:
                break
            time.sleep(0.05)
        assert T._ORPHANS == []
        peer.close()  # was refused for good: "1 request(s) of a LayerTx open"
        rm.close()
        mem2.close()
        y.close()
    finally:
        child.kill()
        child.wait()
