#!/usr/bin/python3
"""bench_python.py - the Python package's per-call overhead, against the same
call made from C in the same run.

    scripts/bench_python.py [--quick] [--out FILE] [--kvbench build/kvbench]

Case python.write_token: Cache.write of one token (K and V [1][8][128]
bf16 as torch tensors, or f16 NumPy arrays when torch is missing) into one
slot of a Llama-like cache layer (N 16, H 8, D 128), the slot moving
through 64 blocks; microseconds per call, median of 9 runs of 20,000
calls (quick: 3 of 2,000). The baseline is kvbench's call.write_token,
the same kv_attn_write from a C loop, run by this script just before. The
ratio is C us / Python us (1 would mean no overhead). The last token is read
back through the read kernel and compared before a line is printed. The
library is the package's (build-libc, MALLOC=libc); kvbench is the
jemalloc build, which is what C users link.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "python"))
os.environ.setdefault("KVCACHE_LIBRARY", os.path.join(ROOT, "build-libc", "libkvcache.so"))

try:
    import numpy as np  # noqa: E402
except ImportError:
    # nothing installed here: apt's python3-numpy (scripts/deps.sh) serves
    # /usr/bin/python3, which make bench runs this with
    sys.exit(f"bench_python.py: {sys.executable} lacks numpy; run it with /usr/bin/python3 "
             "(apt-get install python3-numpy) or install numpy into this interpreter")

import kvcache  # noqa: E402


def cpu_model():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return os.uname().machine


def c_baseline(kvbench, quick):
    with tempfile.NamedTemporaryFile("r", suffix=".jsonl") as f:
        cmd = [kvbench, "--bench", "call.write_token", "--out", f.name] + (["--quick"] if quick
                                                                           else [])
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        for line in open(f.name):
            o = json.loads(line)
            if o.get("bench") == "call.write_token" and "us" in o:
                return o["us"]
    sys.exit("bench_python.py: kvbench printed no call.write_token line")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results.jsonl"))
    ap.add_argument("--kvbench", default=os.path.join(ROOT, "build", "kvbench"))
    a = ap.parse_args()
    calls, runs = (2000, 3) if a.quick else (20000, 9)
    c_us = c_baseline(a.kvbench, a.quick)
    try:
        import torch
        k = torch.randn(1, 8, 128).to(torch.bfloat16)
        v = torch.randn(1, 8, 128).to(torch.bfloat16)
        dtype, kind = "bf16", "torch"
    except ImportError:
        k = np.random.default_rng(1).standard_normal((1, 8, 128)).astype(np.float16)
        v = np.random.default_rng(2).standard_normal((1, 8, 128)).astype(np.float16)
        dtype, kind = "f16", "numpy"
    lay = kvcache.Layout(num_layers=1, num_blocks=65, block_tokens=16, num_heads=8,
                         head_dim=128, dtype=dtype)
    c = kvcache.Cache(lay, max_seqs=1)
    slots = [[(i * 17) % (64 * 16) + 16] for i in range(calls)]
    times = []
    for r in range(-1, runs):
        t0 = time.perf_counter()
        for s in slots:
            c.write(0, k, v, s)
        t1 = time.perf_counter()
        if r >= 0:
            times.append((t1 - t0) / calls * 1e6)
    # the last token, back through the read kernel from a one-token sequence view
    last = slots[-1][0]
    got = c.kv(0, 0).select(0, last // 16).select(0, last % 16).numpy()
    want = (k.view(dtype=__import__("torch").int16).numpy().view(np.uint16) if kind == "torch"
            else k.view(np.uint16))
    # compared as bits: numpy() gives f16 for f16 and the raw 16 bits for bf16
    got_bits = np.ascontiguousarray(got).view(np.uint16).reshape(-1)
    if not np.array_equal(got_bits, np.asarray(want).reshape(-1)):
        print(json.dumps({"bench": "python.write_token", "error": "the token written differs"}))
        sys.exit(3)
    py_us = statistics.median(times)
    line = {"bench": "python.write_token", "case": "%s/N16/H8/D128/1token/%s" % (dtype, kind),
            "us": round(py_us, 4), "baseline": "c_call", "baseline_us": round(c_us, 4),
            "ratio": round(c_us / py_us, 4), "overhead_us": round(py_us - c_us, 4),
            "ratio_is": "baseline_us/us", "runs": runs, "cpu": cpu_model(), "quick": a.quick}
    print(json.dumps(line))
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "a") as f:
        f.write(json.dumps(line) + "\n")
    c.close()


if __name__ == "__main__":
    main()
