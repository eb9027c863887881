#!/usr/bin/python3
"""disagg_engine.py - the tiny engine split in two processes: prefill and
decode, its KV moving layer by layer over kvcache's transport.

    examples/disagg_engine.py [--model gqa|mla] [--requests N] [--small] [--seed S]
                                                                  (make example runs both)

The model, the paged engine, the requests and the unpaged reference are
tiny_engine.py's (imported, not copied). This process is the decode engine;
it starts the prefill engine as a child process (this file, --role
prefill) and the two talk over a kvcache.Transport (TCP on loopback):

  decode (this process)                          prefill (child process)
  cache: HND, block-major, 32-token blocks       cache: NHD, layer-major, 16-token blocks,
                                                        prefix caching
  listen; accept; register + expose the cache    connect; register its cache
  --hello(blob, layout) as a notification-->     import the blob; one Plan per layer
                                                 (NHD/16 -> HND/32, converted on the way)
  a request arrives: allocate blocks for
  prompt[:-1]; start_load_kv (expect it);
  --prefill(rid, prompt[:-1], blocks)-->         compute layer by layer; save_kv_layer(l)
                                                 posts layer l (LayerTx) as soon as its
                                                 K/V is written, while l + 1 computes
  forward of the last prompt token in the        wait_for_save; get_finished: the
  decode batch: wait_for_layer_load(l) before    request's blocks are the engine's again
  layer l touches the cache (LayerRx, fed by
  a receive thread), then generate as the
  tiny engine does (continuous batching, a fork)

Every generated token is checked against tiny_engine.reference (plain
contiguous K/V, no kvcache, no transport); the exit status is 0 only if all
of them agree.

The connector (LayerwiseConnector) has the method names engines already call
(vLLM's KVConnectorBase_V1): bind_connector_metadata, start_load_kv,
wait_for_layer_load, save_kv_layer, wait_for_save, get_finished. It moves
whatever the two caches' layouts hold, one Plan per layer.

--model mla runs tiny_engine's MLA model (DeepSeek-style latent attention:
one 80-dim latent row per token and layer, Cache.prefill_mla in the
prefill process, Cache.decode_mla in the decode one) the same way:
both caches are K-only (Layout(k_only=True), one KV head), prefill's
NHD/16-token layer-major, decode's HND/32-token block-major (MODELS below),
so each layer's plan regroups the latent rows on the way (two 16-token
source pages into one 32-token page, 2 runs of 5 KiB per window); every token is
checked against the float64 reference as for GQA. The connector and the
transport need no change: a plan moves whatever planes the layouts have.
"""
import argparse
import json
import os
import queue
import secrets
import subprocess
import sys
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "python"))
import kvcache  # noqa: E402
from kvcache import transport as xp  # noqa: E402
import tiny_engine as te  # noqa: E402  (the model, engine, requests and reference)

CTRL_TAG = 0x4C525443  # "CTRL": the engines' own control messages (JSON)
TIMEOUT_MS = 30000

# The cache of each side, by model. The layouts differ on purpose, so the
# plans convert (order, arrangement and page size) on the way.
MODELS = {
    "gqa": dict(prefill=dict(order="NHD", arrange="layer", block_tokens=16),
                decode=dict(order="HND", arrange="block", block_tokens=32)),
    # tiny_engine's MLA model: both caches K-only (one latent plane, one head
    # of D_MLA = 64 + 16 dims); with one head NHD and HND hold the same
    # bytes, so what the plans convert is the page size and arrangement:
    # prefill 16-token layer-major pages, decode 32-token block-major ones
    "mla": dict(prefill=dict(order="NHD", arrange="layer", block_tokens=16),
                decode=dict(order="HND", arrange="block", block_tokens=32)),
}


class LayerwiseConnector:
    """KV transfer between a prefill engine (producer) and a decode engine
    (consumer), layer by layer, in the shape of vLLM's KVConnectorBase_V1:

      both:      bind_connector_metadata(reqs) names the requests of the next
                 forward (vLLM: the scheduler's connector metadata);
                 get_finished() -> (finished_sending, finished_recving): the
                 request ids whose transfer ended, each once.
      producer:  save_kv_layer(layer, seq) once the layer's K/V is written
                 (LayerTx.post of that layer of every bound request);
                 wait_for_save() at the end of the forward.
      consumer:  start_load_kv() before the forward (LayerRx.expect);
                 wait_for_layer_load(layer) before the layer reads the cache.

    A request: dict(rid, n (tokens moved), dst_blocks; prefill adds seq,
    the sequence its blocks come from). The cache is registered whole once;
    the blocks of each request name where its tokens are."""

    def __init__(self, role, transport, peer, cache):
        self.role, self.x, self.peer, self.cache = role, transport, peer, cache
        self.layers = cache.layout.num_layers
        self.mem = transport.register(cache)  # the whole arena, once
        self.meta = []
        self.errors = []
        self.waited_s = 0.0
        if role == "producer":
            self.tx = kvcache.LayerTx()
            self.remote = self.plans = None
        else:
            self.rx = kvcache.LayerRx()
            self.ctrl = queue.Queue()  # the other engine's control messages
            self._stop = threading.Event()
            self._feeder = threading.Thread(target=self._feed, daemon=True)
            self._feeder.start()

    # ---- setup (the engines' side channel) --------------------------------

    def hello(self):
        """Consumer: expose the cache to the peer; send the blob and layout."""
        blob = self.peer.expose(self.mem)
        lay = self.cache.layout
        fields = {k: getattr(lay, k) for k in ("num_layers", "num_blocks", "block_tokens",
                                               "num_heads", "head_dim", "dtype", "order",
                                               "arrange", "kv_packed", "block_pad_elems",
                                               "block_stride_bytes", "align_bytes",
                                               "k_only")}
        send(self.peer, {"op": "hello", "blob": blob.hex(), "layout": fields})

    def add_remote(self, blob, layout):
        """Producer: the consumer's cache, and one plan per layer into it."""
        self.remote = self.peer.import_blob(blob)
        self.plans = [kvcache.Plan(self.cache.layout, layout, layers=(l, l, 1))
                      for l in range(self.layers)]

    # ---- both ---------------------------------------------------------------

    def bind_connector_metadata(self, reqs):
        self.meta = list(reqs)

    def get_finished(self):
        """(finished_sending, finished_recving): {rid: status name}."""
        if self.role == "producer":
            return {f.request: f.status for f in self.tx.finished()}, {}
        if self.errors:
            raise self.errors[0]
        return {}, {f.request: f.status for f in self.rx.finished()}

    # ---- producer -------------------------------------------------------------

    def save_kv_layer(self, layer, seq):
        """Post layer `layer` of every bound request: its K/V is written."""
        for r in self.meta:
            if layer == 0:
                self.tx.begin(self.peer, r["rid"], self.layers)
                ns = -(-r["n"] // self.cache.layout.block_tokens)
                r["src_blocks"] = self.cache.seq_blocks(seq)[:ns]
            self.tx.post(r["rid"], self.plans[layer], layer, 1, self.mem, r["src_blocks"],
                         self.remote, r["dst_blocks"], r["n"])

    def wait_for_save(self):
        for r in self.meta:
            self.tx.wait(r["rid"], TIMEOUT_MS)

    # ---- consumer -------------------------------------------------------------

    def start_load_kv(self):
        for r in self.meta:
            self.rx.expect(self.peer, r["rid"], self.layers)

    def wait_for_layer_load(self, layer):
        """Return once layer `layer` of every bound request landed. A request
        whose prefill is gone (the peer closed) or late past TIMEOUT_MS is
        failed from this side (LayerRx.fail): the wait raises its failure,
        and its blocks are never attended over."""
        t0 = time.perf_counter()
        for r in self.meta:
            deadline = t0 + TIMEOUT_MS / 1000
            while True:
                try:
                    self.rx.wait(r["rid"], layer, 200)
                    break
                except kvcache.Timeout:
                    if self.errors:
                        raise self.errors[0]
                    gone = self.peer.state()[0] == "closed"
                    if gone or time.perf_counter() > deadline:
                        self.rx.fail(r["rid"], "KV_ERR_IO" if gone else "KV_ERR_TIMEOUT")
                        if gone:  # nothing more can land: its blocks may be reused
                            self.rx.release(r["rid"])
        self.waited_s += time.perf_counter() - t0

    def _feed(self):
        """The receive thread: every layer notification into the tracker,
        control messages into self.ctrl."""
        while not self._stop.is_set():
            try:
                note = self.x.poll(20)
                if note is not None and note.tag == xp.XLAYER_TAG:
                    self.rx.feed(note)
                elif note is not None and note.tag == CTRL_TAG:
                    self.ctrl.put(json.loads(note.data))
            except kvcache.KvError as e:
                self.errors.append(e)
                return

    def close(self):
        """Stop, then free in dependency order: trackers, the imported region,
        the peer (which ends the exposure), the registered cache."""
        if self.role == "consumer":
            self._stop.set()
            self._feeder.join()
            self.rx.close()
        else:
            self.tx.close()
            if self.remote is not None:
                self.remote.close()
        self.peer.close()
        self.mem.close()


def send(peer, msg):
    """A control message to the other engine: a notification with no data."""
    peer.write([], notify=(CTRL_TAG, json.dumps(msg).encode())).check(TIMEOUT_MS)


# ---- prefill (the child process) ---------------------------------------------------


def prefill_main(a):
    model = te.Model(a.seed, a.model)
    eng = te.Engine(model, num_blocks=256, prefix_caching=True, **MODELS[a.model]["prefill"])
    x = kvcache.Transport(int(os.environ["KV_DISAGG_TOKEN"]), timeout_ms=TIMEOUT_MS)
    host, port = a.connect.rsplit(":", 1)
    peer = x.connect(host, int(port))
    peer.wait(TIMEOUT_MS)
    conn = LayerwiseConnector("producer", x, peer, eng.c)
    seqs, sent, t_busy = {}, 0, 0.0
    while True:
        note = x.poll(100)
        if note is None or note.tag != CTRL_TAG:
            continue
        msg = json.loads(note.data)
        if msg["op"] == "hello":
            conn.add_remote(bytes.fromhex(msg["blob"]), kvcache.Layout(**msg["layout"]))
        elif msg["op"] == "prefill":
            t0 = time.perf_counter()
            req = dict(rid=msg["rid"], n=msg["n"], dst_blocks=msg["blocks"])
            conn.bind_connector_metadata([req])
            seq = [None]

            def save(layer, s):
                seq[0] = s
                conn.save_kv_layer(layer, s)

            eng.prefill(msg["prompt"], after_write=save)  # computes and saves layer by layer
            conn.wait_for_save()
            seqs[req["rid"]] = seq[0]
            sending, _ = conn.get_finished()
            for rid, status in sending.items():
                if status != "KV_OK":
                    raise kvcache.KvError("request %d: transfer %s" % (rid, status))
                eng.c.free(seqs.pop(rid))  # its full blocks stay cached for later prefixes
                sent += 1
            t_busy += time.perf_counter() - t0
        elif msg["op"] == "bye":
            break
    st = x.stats()
    send(peer, {"op": "stats", "line": (
        "prefill process: %d requests, %d tokens computed, %d reused from cached prefix "
        "blocks, %d layer transfers (%d sent gathered), %.2f s busy" %
        (sent, eng.prefill_tokens, eng.reused_tokens, st["plans_gathered"] +
         st["plans_direct"], st["plans_gathered"], t_busy))})
    conn.close()
    x.close()
    eng.c.close()
    return 0


# ---- decode (this process) -----------------------------------------------------------


def spawn_prefill(a, port, token):
    env = dict(os.environ, KV_DISAGG_TOKEN=str(token))
    cmd = [sys.executable, os.path.abspath(__file__), "--role", "prefill", "--connect",
           "127.0.0.1:%d" % port, "--seed", str(a.seed), "--model", a.model]
    return subprocess.Popen(cmd, env=env)


def decode_main(a):
    rng = np.random.default_rng(a.seed)
    model = te.Model(a.seed, a.model)
    reqs = te.make_requests(6 if a.small else a.requests, rng, a.small)
    token = secrets.randbits(63) | 1
    x = kvcache.Transport(token, listen_host="127.0.0.1", timeout_ms=TIMEOUT_MS)
    proc = spawn_prefill(a, x.port, token)
    try:
        peer = x.accept(TIMEOUT_MS)
        if peer is None:
            raise kvcache.errors.error("KV_ERR_TIMEOUT", "the prefill process did not connect")
        eng = te.Engine(model, num_blocks=256, prefix_caching=False, **MODELS[a.model]["decode"])
        print("model %s\n" % model.describe())
        conn = LayerwiseConnector("consumer", x, peer, eng.c)
        conn.hello()
        stats = run_decode(a, model, reqs, eng, conn)
        send(peer, {"op": "bye"})
        msg = conn.ctrl.get(timeout=TIMEOUT_MS / 1000)  # prefill's last words
        print(msg["line"])
        if proc.wait(TIMEOUT_MS / 1000) != 0:
            raise RuntimeError("the prefill process exited with status %d" % proc.returncode)
        conn.close()
        x.close()
        eng.c.close()
        return stats
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def run_decode(a, model, reqs, eng, conn):
    Nd = eng.lay.block_tokens
    running, done = [], []
    loaded = 0
    t0 = time.perf_counter()
    step = 0
    while len(done) < sum(r["samples"] for r in reqs):
        # admit arrivals: blocks for prompt[:-1], expect their layers, ask prefill
        new = []
        for r in [r for r in reqs if r["arrive"] == step]:
            s = eng.c.seq_create()
            n = len(r["prompt"]) - 1
            eng.c.append(s, r["prompt"][:-1])
            new.append(dict(rid=r["rid"], n=n, dst_blocks=eng.c.seq_blocks(s)[:-(-n // Nd)],
                            seq=s, r=r))
        conn.bind_connector_metadata(new)
        conn.start_load_kv()  # before prefill can write a byte of them
        for q in new:
            send(conn.peer, {"op": "prefill", "rid": q["rid"], "n": q["n"],
                             "prompt": [int(t) for t in q["r"]["prompt"][:-1]],
                             "blocks": [int(b) for b in q["dst_blocks"]]})
        for x in [x for x in running if x["left"] == 0]:
            running.remove(x)
            done.append(x)
            eng.c.free(x["seq"])
        # one forward: the running sequences' next token and the arrivals'
        # last prompt token, each layer waiting for the arrivals' KV of it
        seqs = [x["seq"] for x in running] + [q["seq"] for q in new]
        if seqs:
            last = [x["out"][-1] for x in running] + [q["r"]["prompt"][-1] for q in new]
            h = eng.decode_step(seqs, last, before_layer=conn.wait_for_layer_load)
            n_run = len(running)
            for i, x in enumerate(running):
                x["out"].append(te.pick(model.logits(h[i]), x["rid"], x["sample"],
                                        len(x["out"])))
                x["left"] -= 1
            for i, q in enumerate(new):
                r = q["r"]
                lg = model.logits(h[n_run + i])
                forks = [q["seq"]] + [eng.c.fork(q["seq"]) for _ in range(r["samples"] - 1)]
                for j, sq in enumerate(forks):
                    running.append(dict(rid=r["rid"], sample=j, seq=sq,
                                        out=[te.pick(lg, r["rid"], j, 0)],
                                        left=r["max_new"] - 1, prompt=r["prompt"]))
        conn.bind_connector_metadata([])
        _, recving = conn.get_finished()
        for rid, status in recving.items():
            if status != "KV_OK":
                raise kvcache.KvError("request %d: KV transfer %s" % (rid, status))
            loaded += 1
        step += 1
    elapsed = time.perf_counter() - t0
    generated = sum(len(x["out"]) for x in done)
    bad = 0
    for x in sorted(done, key=lambda x: (x["rid"], x["sample"])):
        want = te.reference(model, x["prompt"], len(x["out"]), x["rid"], x["sample"])
        ok = want == x["out"]
        bad += not ok
        print("request %2d sample %d: prompt %3d tokens, %2d generated  %s" %
              (x["rid"], x["sample"], len(x["prompt"]), len(x["out"]),
               "matches the unpaged reference" if ok else "MISMATCH %s vs %s" % (x["out"], want)))
    st = conn.rx.stats()
    print("\n%d tokens generated in %.2f s by the decode process (%d steps), %d requests' KV "
          "received layer by layer (%d layer notifications, %.2f s waiting for layers)" %
          (generated, elapsed, step, loaded, st["notes_layers"], conn.waited_s))
    return dict(bad=bad, k_only=eng.lay.k_only, sequences=len(done), loaded=loaded,
                notes=st["notes_layers"], requests=len(reqs))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--small", action="store_true", help="a quick run (the pytest case)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--model", choices=sorted(MODELS), default="gqa")
    ap.add_argument("--role", choices=["decode", "prefill"], default="decode",
                    help=argparse.SUPPRESS)
    ap.add_argument("--connect", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.role == "prefill":
        return prefill_main(a)
    stats = decode_main(a)
    print("%s: %d of %d sequences match the reference" %
          ("PASS" if stats["bad"] == 0 else "FAIL", stats["sequences"] - stats["bad"],
           stats["sequences"]))
    return stats


if __name__ == "__main__":
    out = main()
    sys.exit(out if isinstance(out, int) else (1 if out["bad"] else 0))
