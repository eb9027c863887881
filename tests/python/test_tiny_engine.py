"""The tiny engine (examples/tiny_engine.py) at a small size, its GQA model
and its MLA one (a K-only latent cache, Cache.prefill_mla and decode_mla):
every token of every sequence equals the unpaged reference; the run reused cached prefix
blocks and made a copy-on-write copy for its fork; and the check can fail
(a perturbed decode attention, a corrupted latent row, are caught)."""
import importlib.util
import os

import numpy as np
import pytest

import kvcache

HERE = os.path.dirname(os.path.abspath(__file__))
PATH = os.path.join(HERE, "..", "..", "examples", "tiny_engine.py")


def load():
    spec = importlib.util.spec_from_file_location("tiny_engine", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("model", ["gqa", "mla"])
def test_tiny_engine_matches_the_reference(capsys, model):
    st = load().main(["--small", "--model", model])
    assert st["bad"] == 0
    assert st["k_only"] == (model == "mla")  # MLA: one latent plane, no V
    assert st["sequences"] == 7  # 6 requests, one forked into 2 samples
    assert st["reused"] > 0 and st["hits"] > 0  # the shared system prompt
    assert st["cow"] >= 1  # the fork's first write into a shared block
    assert "PASS" in capsys.readouterr().out


def test_tiny_engine_check_can_fail(monkeypatch):
    real = kvcache.Cache.decode

    def noisy(self, layer, q, pages, out, **kw):
        real(self, layer, q, pages, out, **kw)
        out += np.float32(0.5)  # a wrong attention output

    monkeypatch.setattr(kvcache.Cache, "decode", noisy)
    st = load().main(["--small"])
    assert st["bad"] > 0


def test_tiny_engine_mla_check_can_fail(monkeypatch):
    """The MLA reference is independent of the absorbed, paged path: a latent
    row whose rope dims are lost in the cache is caught."""
    mod = load()
    real = kvcache.Cache.write

    def lossy(self, layer, k, v, slots, **kw):
        k = np.array(k)
        k[..., mod.D_LAT:] = 0  # the rope part of every latent row
        real(self, layer, k, v, slots, **kw)

    monkeypatch.setattr(kvcache.Cache, "write", lossy)
    st = mod.main(["--small", "--model", "mla"])
    assert st["bad"] > 0


def test_tiny_engine_mla_prefill_is_checked(monkeypatch):
    """MLA prefill attends with Cache.prefill_mla (one call per layer, no
    per-token decode_mla): a wrong prefill_mla output is caught."""
    real = kvcache.Cache.prefill_mla
    calls = []

    def noisy(self, layer, q, qo_indptr, pages, out, **kw):
        real(self, layer, q, qo_indptr, pages, out, **kw)
        calls.append(len(q))
        out += np.float32(0.5)

    monkeypatch.setattr(kvcache.Cache, "prefill_mla", noisy)
    st = load().main(["--small", "--model", "mla"])
    assert calls and max(calls) > 1 and st["bad"] > 0
