#!/usr/bin/python3
"""tiny_engine.py - a small decoder-only transformer served on kvcache.

    examples/tiny_engine.py [--model gqa|mla] [--requests N] [--small] [--seed S]
                                                                  (make example runs both)

The model: 2 layers, grouped-query attention (8 query heads over 2 KV heads,
head dim 16), RoPE, RMSNorm, a SiLU MLP, seeded random weights, NumPy f32.
--model mla swaps the attention for DeepSeek's multi-head latent attention
in miniature: per layer the cache holds one latent row per token, 80 dims
(64 latent c_kv + 16 rope; DeepSeek: 512 + 64), in a K-only layout
(Layout(k_only=True), one KV head); the 8 query heads are absorbed into
latent space (q_latent = W_uk q_nope, then q_rope), scores run over all 80
dims, the values are the rows' first 64 dims, and W_uv projects each head's
output back. Decode attention is Cache.decode_mla (kv_attn_decode_mla),
prefill attention Cache.prefill_mla (kv_attn_prefill_mla: the new tokens
as queries, a causal mask over the sequence's cached latent rows).

The engine serves a batch of requests with continuous batching on a paged
kvcache.Cache (f32, HND pages of 16 tokens):
  - requests arrive over time; all running sequences decode together, one
    token per step, through kvcache's decode attention over the paged cache
    (Cache.decode, MLA: Cache.decode_mla: every sequence of the batch in
    one call per layer);
  - prefill writes K/V through the write kernel (Cache.write) at the slots
    the page table gives, and attends with kvcache's multi-token paged
    attention (Cache.prefill, MLA: Cache.prefill_mla: the prompt's new
    tokens as queries, a causal mask over the sequence's cached tokens, a
    reused prefix included), with no K/V gathered out of the cache;
  - requests that share a system prompt reuse its cached blocks
    (Cache.reuse_prefix): only the rest of the prompt is computed;
  - one request forks for parallel sampling (Cache.fork): the samples share
    the prompt's blocks, and the first write into a shared block is a
    copy-on-write (take_copies -> copy_blocks -> copies_done).
Every generated token is checked against an unpaged reference run of the
same model (plain contiguous K/V per sequence, no kvcache; for MLA the
naive form in float64: each head's K and V decompressed from the latent,
no absorption); the exit status is 0 only if all of them agree. It
prints tokens/s and the cache's stats.
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import kvcache  # noqa: E402

VOCAB, D_MODEL, LAYERS, HQ, HKV, HD, FF = 96, 128, 2, 8, 2, 16, 256
BLOCK = 16
# The MLA variant: DeepSeek's latent attention in miniature. Per token and
# layer the cache holds one latent row of D_MLA = D_LAT + D_ROPE dims
# (DeepSeek: 512 + 64); every query head has D_NOPE + D_ROPE dims before
# absorption and D_VH value dims after W_uv.
D_LAT, D_ROPE, D_NOPE, D_VH = 64, 16, 16, 16
D_MLA = D_LAT + D_ROPE
ARCHS = ("gqa", "mla")


class Model:
    """arch "gqa": grouped-query attention, a K and a V plane of HKV heads.
    arch "mla": multi-head latent attention (DeepSeek-V2/V3's, small): the
    cache holds one latent row per token, [c_kv (D_LAT), k_rope (D_ROPE)],
    in a K-only layout of one KV head; the engine absorbs W_uk into the
    query (q_latent = W_uk q_nope, so scores run over the latent rows'
    D_MLA dims), attends with Cache.prefill_mla and Cache.decode_mla
    (values: the rows' first D_LAT dims) and applies W_uv after attention. The reference decompresses
    instead (each head's K = [c_kv W_uk, k_rope], V = c_kv W_uv, plain
    attention in float64), so the two share no attention code."""

    def __init__(self, seed, arch="gqa"):
        if arch not in ARCHS:
            raise ValueError("arch %r: one of %s" % (arch, ARCHS))
        self.arch = arch
        mla = arch == "mla"
        # the cache's rows: heads and dims per token; attention's output dims per head
        self.kv_heads, self.kv_dim, self.k_only = (1, D_MLA, True) if mla else (HKV, HD, False)
        self.attn_dim = D_LAT if mla else HD
        # DeepSeek's softmax scale: 1/sqrt of the un-absorbed query head dim
        self.scale = 1 / np.sqrt(D_NOPE + D_ROPE) if mla else 1 / np.sqrt(HD)
        self.ref_dtype = np.float64 if mla else np.float32
        r = np.random.default_rng(seed)
        s = 1 / np.sqrt(D_MODEL)
        self.emb = r.standard_normal((VOCAB, D_MODEL)).astype(np.float32)
        self.layers = []
        for _ in range(LAYERS):
            if mla:
                att = dict(
                    wq=(r.standard_normal((D_MODEL, HQ * (D_NOPE + D_ROPE))) * s),
                    wkv=(r.standard_normal((D_MODEL, D_LAT + D_ROPE)) * s),  # W_dkv and W_kr
                    w_uk=(r.standard_normal((HQ, D_LAT, D_NOPE)) / np.sqrt(D_LAT)),
                    w_uv=(r.standard_normal((HQ, D_LAT, D_VH)) / np.sqrt(D_LAT)),
                    wo=(r.standard_normal((HQ * D_VH, D_MODEL)) * s))
                att = {k: v.astype(np.float32) for k, v in att.items()}
            else:
                att = dict(
                    wq=(r.standard_normal((D_MODEL, HQ * HD)) * s).astype(np.float32),
                    wk=(r.standard_normal((D_MODEL, HKV * HD)) * s).astype(np.float32),
                    wv=(r.standard_normal((D_MODEL, HKV * HD)) * s).astype(np.float32),
                    wo=(r.standard_normal((HQ * HD, D_MODEL)) * s).astype(np.float32))
            self.layers.append(dict(
                att,
                w1=(r.standard_normal((D_MODEL, FF)) * s).astype(np.float32),
                w2=(r.standard_normal((FF, D_MODEL)) / np.sqrt(FF)).astype(np.float32)))
        self.out = (r.standard_normal((D_MODEL, VOCAB)) * s).astype(np.float32)
        # the reference's float64 copies of the attention weights (MLA)
        self.layers64 = [{n: a.astype(np.float64) for n, a in w.items()}
                         for w in self.layers] if mla else None

    def describe(self):
        if self.arch == "mla":
            return ("mla: %d layers, %d query heads absorbed into one latent row per token of "
                    "%d dims (%d latent + %d rope; values its first %d), a K-only cache" %
                    (LAYERS, HQ, D_MLA, D_LAT, D_ROPE, D_LAT))
        return ("gqa: %d layers, %d query heads over %d KV heads of %d dims, K and V planes" %
                (LAYERS, HQ, HKV, HD))

    @staticmethod
    def norm(x):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6)

    @staticmethod
    def rope(x, pos):  # x [T][H][dims], pos [T]; float32, or float64 for float64 x
        dt = np.float64 if x.dtype == np.float64 else np.float32
        half = x.shape[-1] // 2
        inv = 1.0 / (10000 ** (np.arange(half, dtype=dt) / half))
        ang = pos[:, None].astype(dt) * inv[None, :]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        a, b = x[..., :half], x[..., half:]
        return np.concatenate([a * c - b * s, a * s + b * c], -1).astype(dt)

    def qkv(self, layer, h, pos):
        """The engine's q, k, v of tokens h at positions pos. GQA: q [T][HQ][HD],
        k and v [T][HKV][HD]. MLA: the absorbed query q [T][HQ][D_MLA]
        (W_uk q_nope, then the roped q_rope), the latent rows k [T][1][D_MLA]
        (RMS-normed c_kv, then the roped k_rope shared by every head), v None."""
        w = self.layers[layer]
        x = self.norm(h)
        if self.arch == "mla":
            q = (x @ w["wq"]).reshape(-1, HQ, D_NOPE + D_ROPE)
            q_lat = np.einsum("thn,hln->thl", q[..., :D_NOPE], w["w_uk"])  # W_uk absorbed
            q = np.concatenate([q_lat, self.rope(q[..., D_NOPE:], pos)], -1)
            kv = x @ w["wkv"]
            lat = np.concatenate([self.norm(kv[:, :D_LAT]),
                                  self.rope(kv[:, None, D_LAT:], pos)[:, 0]], -1)
            return q.astype(np.float32), lat[:, None, :].astype(np.float32), None
        q = self.rope((x @ w["wq"]).reshape(-1, HQ, HD), pos)
        k = self.rope((x @ w["wk"]).reshape(-1, HKV, HD), pos)
        v = (x @ w["wv"]).reshape(-1, HKV, HD).astype(np.float32)
        return q, k, v

    def ref_qkv(self, layer, h, pos):
        """The reference's q, k, v: GQA's are qkv's. MLA's are decompressed,
        in float64: q [T][HQ][D_NOPE + D_ROPE], k = [c_kv W_uk, k_rope] and
        v = c_kv W_uv per head, [T][HQ][...] (no absorption, no latent cache)."""
        if self.arch != "mla":
            return self.qkv(layer, h, pos)
        w = self.layers64[layer]
        x = self.norm(h.astype(np.float64))
        q = (x @ w["wq"]).reshape(-1, HQ, D_NOPE + D_ROPE)
        q = np.concatenate([q[..., :D_NOPE], self.rope(q[..., D_NOPE:], pos)], -1)
        kv = x @ w["wkv"]
        c_kv = self.norm(kv[:, :D_LAT])
        k_rope = np.broadcast_to(self.rope(kv[:, None, D_LAT:], pos), (len(x), HQ, D_ROPE))
        k = np.concatenate([np.einsum("tl,hln->thn", c_kv, w["w_uk"]), k_rope], -1)
        return q, k, np.einsum("tl,hlv->thv", c_kv, w["w_uv"])

    def attn_out(self, layer, out):
        """The engine's attention output per head: GQA's as is; MLA's latent
        [T][HQ][D_LAT] through W_uv to [T][HQ][D_VH]."""
        if self.arch != "mla":
            return out
        return np.einsum("thl,hlv->thv", out, self.layers[layer]["w_uv"])

    def finish(self, layer, h, attn):  # attn [T][HQ][dims]; float32, or float64 for float64 h
        w = self.layers[layer]
        dt = h.dtype
        h = h + attn.reshape(len(h), -1) @ w["wo"]
        x = self.norm(h)
        a = x @ w["w1"]
        return (h + (a / (1 + np.exp(-a))) @ w["w2"]).astype(dt)

    def logits(self, h):
        return self.norm(h) @ self.out


def attend(q, k, v, q_pos0, scale=None):
    """Causal attention of queries q [Tq][Hq][dk] at positions q_pos0.. over
    k [Tk][Hkv][dk], v [Tk][Hkv][dv]; scale defaults to 1/sqrt(dk)."""
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    g = q.shape[1] // k.shape[1]
    out = np.zeros(q.shape[:2] + v.shape[2:], np.result_type(q, v))
    for i in range(q.shape[1]):
        lg = (q[:, i] @ k[:, i // g].T) * scale  # [Tq][Tk]
        tq = q_pos0 + np.arange(len(q))[:, None]
        lg = np.where(np.arange(len(k))[None, :] <= tq, lg, -np.inf)
        p = np.exp(lg - lg.max(-1, keepdims=True))
        out[:, i] = (p / p.sum(-1, keepdims=True)) @ v[:, i // g]
    return out


def pick(logits, rid, sample, step):
    """Greedy for sample 0; a seeded Gumbel draw for the other samples of a
    fork (robust to last-bit differences, like argmax)."""
    if sample == 0:
        return int(np.argmax(logits))
    g = np.random.default_rng(1000003 * rid + 7919 * sample + step).gumbel(size=logits.shape)
    return int(np.argmax(logits / 0.8 + g))


def reference(model, prompt, max_new, rid, sample):
    """The same model with contiguous K/V and no kvcache: GQA's K/V as the
    engine computes them, MLA's decompressed per head in float64
    (Model.ref_qkv); plain causal attention in NumPy."""
    ks, vs = [None] * LAYERS, [None] * LAYERS
    toks = list(prompt)
    out = []
    feed, pos0 = np.array(prompt), 0
    for step in range(max_new):
        h = model.emb[feed].astype(model.ref_dtype)
        pos = pos0 + np.arange(len(feed))
        for l in range(LAYERS):
            q, k, v = model.ref_qkv(l, h, pos)
            ks[l] = k if ks[l] is None else np.concatenate([ks[l], k])
            vs[l] = v if vs[l] is None else np.concatenate([vs[l], v])
            h = model.finish(l, h, attend(q, ks[l], vs[l], pos0, model.scale))
        t = pick(model.logits(h[-1]), rid, sample, step)
        out.append(t)
        toks.append(t)
        pos0 += len(feed)
        feed = np.array([t])
    return out


class Engine:
    """The paged engine. order, arrange, block_tokens: its cache's layout
    (the split engine, examples/disagg_engine.py, runs prefill NHD and
    decode HND); prefix_caching as Cache's. An MLA model's cache is K-only
    (one latent plane, one head of D_MLA dims)."""

    def __init__(self, model, num_blocks, order="HND", arrange="layer", block_tokens=BLOCK,
                 prefix_caching=True):
        self.m = model
        self.lay = kvcache.Layout(num_layers=LAYERS, num_blocks=num_blocks,
                                  block_tokens=block_tokens, num_heads=model.kv_heads,
                                  head_dim=model.kv_dim, dtype="f32", order=order,
                                  arrange=arrange, k_only=model.k_only)
        self.c = kvcache.Cache(self.lay, max_seqs=64, prefix_caching=prefix_caching)
        self.cow_copies = 0
        self.prefill_tokens = self.reused_tokens = self.decode_tokens = 0

    def _sync_copies(self):
        cp = self.c.take_copies()
        if len(cp):
            self.c.copy_blocks(cp)
            self.cow_copies += len(cp)
        self.c.copies_done()

    def prefill(self, prompt, after_write=None):
        """A new sequence for prompt, reusing cached prefix blocks; returns
        (seq, last hidden state). after_write(layer, seq), when given, runs
        as soon as each layer's K/V is written (a connector's save_kv_layer)."""
        c = self.c
        s = c.seq_create()
        have = c.reuse_prefix(s, prompt)
        if have == len(prompt):  # keep one token to compute the first logits from
            c.truncate(s, have - 1)
            have -= 1
        self.reused_tokens += have
        new = np.array(prompt[have:])
        c.append(s, new)
        self._sync_copies()
        slots = [c.slot(s, t) for t in range(have, len(prompt))]
        pos = np.arange(have, len(prompt))
        h = self.m.emb[new]
        mla = self.m.arch == "mla"
        pg = c.pages([s])
        qo = np.array([0, len(new)], np.int32)  # one sequence: its new tokens are the queries
        for l in range(LAYERS):
            q, k, v = self.m.qkv(l, h, pos)
            c.write(l, k, v, slots)  # the write kernel, at the page table's slots (MLA: v None)
            if after_write is not None:
                after_write(l, s)
            out = np.empty(q.shape[:2] + (self.m.attn_dim,), np.float32)
            # kvcache's multi-token paged attention: query i at position have + i
            # sees tokens 0 .. have + i (the reused prefix and the new tokens)
            if mla:
                c.prefill_mla(l, q, qo, pg, out, scale=self.m.scale)  # FlashMLA's convention
            else:
                c.prefill(l, q, qo, pg, out)
            h = self.m.finish(l, h, self.m.attn_out(l, out))
        self.prefill_tokens += len(new)
        return s, h[-1]

    def decode_step(self, seqs, last_tokens, before_layer=None):
        """One token for every sequence of the batch; returns their last hidden
        states. before_layer(layer), when given, runs before each layer
        touches the cache (a connector's wait_for_layer_load)."""
        c = self.c
        pos = np.array([c.seq_len(s) for s in seqs])
        for s, t in zip(seqs, last_tokens):
            c.append(s, [t])
        self._sync_copies()  # a fork's first write into a shared block
        slots = [c.slot(s, int(p)) for s, p in zip(seqs, pos)]
        pg = c.pages(seqs)
        h = self.m.emb[np.array(last_tokens)]
        for l in range(LAYERS):
            qs, ks, vs = zip(*(self.m.qkv(l, h[i:i + 1], pos[i:i + 1])
                               for i in range(len(seqs))))
            q, k = np.concatenate(qs), np.concatenate(ks)
            v = None if vs[0] is None else np.concatenate(vs)
            if before_layer is not None:
                before_layer(l)
            c.write(l, k, v, slots)
            out = np.empty(q.shape[:2] + (self.m.attn_dim,), np.float32)
            # kvcache's paged decode attention, the whole batch in one call
            if self.m.arch == "mla":
                c.decode_mla(l, q, pg, out, scale=self.m.scale)  # FlashMLA's convention
            else:
                c.decode(l, q, pg, out)
            h = self.m.finish(l, h, self.m.attn_out(l, out))
        self.decode_tokens += len(seqs)
        return h


def make_requests(n, rng, small):
    system = list(rng.integers(0, VOCAB, 40))  # shared by most requests (2 full blocks + 8)
    reqs = []
    for rid in range(n):
        own = list(rng.integers(0, VOCAB, int(rng.integers(3, 12 if small else 30))))
        prompt = (system + own) if rid % 4 != 3 else own
        reqs.append(dict(rid=rid, arrive=int(rng.integers(0, 6)), prompt=prompt,
                         max_new=int(rng.integers(4, 8 if small else 24)),
                         samples=2 if rid == 1 else 1))
    return reqs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--small", action="store_true", help="a quick run (the pytest case)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--model", choices=ARCHS, default="gqa",
                    help="gqa (K and V planes) or mla (one latent plane, K-only)")
    a = ap.parse_args(argv)
    rng = np.random.default_rng(a.seed)
    model = Model(a.seed, a.model)
    reqs = make_requests(6 if a.small else a.requests, rng, a.small)
    eng = Engine(model, num_blocks=512)
    print("model %s\n" % model.describe())
    running = []  # dicts: rid, sample, seq, out, left, last
    done = []
    t0 = time.perf_counter()
    step = 0
    while len(done) < sum(r["samples"] for r in reqs):
        for r in [r for r in reqs if r["arrive"] == step]:  # admit arrivals
            s, h = eng.prefill(r["prompt"])
            lg = model.logits(h)
            seqs = [s] + [eng.c.fork(s) for _ in range(r["samples"] - 1)]
            for j, q in enumerate(seqs):
                t = pick(lg, r["rid"], j, 0)
                running.append(dict(rid=r["rid"], sample=j, seq=q, out=[t], left=r["max_new"] - 1,
                                    prompt=r["prompt"]))
        for x in [x for x in running if x["left"] == 0]:
            running.remove(x)
            done.append(x)
            eng.c.free(x["seq"])  # its full blocks stay cached for later prefixes
        if running:
            h = eng.decode_step([x["seq"] for x in running], [x["out"][-1] for x in running])
            for i, x in enumerate(running):
                x["out"].append(pick(model.logits(h[i]), x["rid"], x["sample"], len(x["out"])))
                x["left"] -= 1
        step += 1
    elapsed = time.perf_counter() - t0
    generated = sum(len(x["out"]) for x in done)

    bad = 0
    for x in sorted(done, key=lambda x: (x["rid"], x["sample"])):
        want = reference(model, x["prompt"], len(x["out"]), x["rid"], x["sample"])
        ok = want == x["out"]
        bad += not ok
        print("request %2d sample %d: prompt %3d tokens, %2d generated  %s" %
              (x["rid"], x["sample"], len(x["prompt"]), len(x["out"]),
               "matches the unpaged reference" if ok else "MISMATCH %s vs %s" % (x["out"], want)))
    ps, ts = eng.c.pool_stats(), eng.c.table_stats()
    print("\n%d tokens generated in %.2f s (%.0f tokens/s, continuous batching over %d steps)" %
          (generated, elapsed, generated / elapsed, step))
    print("prefill: %d tokens computed, %d reused from cached prefix blocks" %
          (eng.prefill_tokens, eng.reused_tokens))
    print("cache: blocks used high-water %d of %d, prefix hits %d, misses %d, "
          "copy-on-write copies %d, evictions %d" %
          (ps["used_high_water"], ps["capacity"], ps["hits"], ps["misses"], eng.cow_copies,
           ps["evictions"]))
    print("%s: %d of %d sequences match the reference" %
          ("PASS" if bad == 0 else "FAIL", len(done) - bad, len(done)))
    stats = dict(bad=bad, k_only=eng.lay.k_only, reused=eng.reused_tokens, cow=eng.cow_copies,
                 hits=ps["hits"], live=ts["live_seqs"], sequences=len(done))
    eng.c.close()
    return stats


if __name__ == "__main__":
    sys.exit(1 if main()["bad"] else 0)
