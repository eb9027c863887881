#!/usr/bin/python3
"""plot_bench.py - docs/img/kernels.png from the JSON lines of one benchmark run.

    scripts/plot_bench.py RESULTS.jsonl [--out docs/img/kernels.png]

Reads the kernel.* lines of kvbench and the peer.* lines of bench_peers.py
(the last line seen for each (bench, case, baseline) wins; quick lines are
ignored) and draws, per kernel case, kvcache's rate beside each baseline's:
GB/s for write and read, tokens/s (log scale) for decode attention.
Needs python3-matplotlib (Debian).
"""
import argparse
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(path):
    lines = {}
    for raw in open(path):
        try:
            o = json.loads(raw)
        except ValueError:
            continue
        if o.get("quick") or "error" in o or "ratio" not in o:
            continue
        lines[(o["bench"], o["case"], o["baseline"])] = o
    return list(lines.values())


def kernel_key(o):
    """(kernel, order) of a kernel.* or peer.* line: kernel.read/nhd/..."""
    case = o["case"]
    if o["bench"].startswith("kernel."):
        case = o["bench"] + "/" + case
    parts = case.split("/")
    return parts[0], parts[1] if len(parts) > 1 else ""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("results")
    ap.add_argument("--out", default="docs/img/kernels.png")
    a = ap.parse_args()
    rows = load(a.results)
    groups = {}  # (kernel, order) -> {label: rate}
    cpu = ""
    # kvbench cases end in /t<threads>: draw the run with the most threads
    most = {}
    for o in rows:
        if o["bench"].startswith("kernel.") and "/t" in o["case"]:
            t = o["case"].rsplit("/t", 1)[1]
            if t.isdigit():
                k = kernel_key(o)
                most[k] = max(most.get(k, 0), int(t))
    rows = [o for o in rows if not (o["bench"].startswith("kernel.") and "/t" in o["case"]
                                    and o["case"].rsplit("/t", 1)[1].isdigit()
                                    and int(o["case"].rsplit("/t", 1)[1]) != most[kernel_key(o)])]
    for o in rows:
        if not (o["bench"].startswith("kernel.") or o["bench"].startswith("peer.")):
            continue
        k = kernel_key(o)
        if not k[0].startswith("kernel."):
            continue
        rate, brate = ("gbps", "baseline_gbps") if "gbps" in o else ("ops_per_s", "baseline_ops_per_s")
        g = groups.setdefault(k, {})
        # kvbench's and bench_peers.py's own kvcache measurements stay apart
        g["kvcache" if o["bench"].startswith("kernel.") else "kvcache (peers run)"] = o[rate]
        label = o["baseline"] if o["bench"].startswith("kernel.") else o["bench"][5:]
        g[label] = o[brate]
        cpu = o.get("cpu", cpu)
    if not groups:
        sys.exit(f"plot_bench: no kernel or peer lines in {a.results}")
    copy = sorted(k for k in groups if k[0] != "kernel.decode_attn")
    dec = sorted(k for k in groups if k[0] == "kernel.decode_attn")
    fig, axes = plt.subplots(1, 2, figsize=(15, 5.5), gridspec_kw={"width_ratios": [3, 1]})
    for ax, keys, unit, log in ((axes[0], copy, "GB/s", False),
                                (axes[1], dec, "tokens/s", True)):
        labels = []
        for k in keys:
            for lb in groups[k]:
                if lb not in labels:
                    labels.append(lb)
        labels.sort(key=lambda s: (not s.startswith("kvcache"), s))
        w = 0.8 / max(1, len(labels))
        cmap = plt.get_cmap("tab10")
        for i, lb in enumerate(labels):
            xs = [j + i * w for j, k in enumerate(keys) if lb in groups[k]]
            ys = [groups[k][lb] for k in keys if lb in groups[k]]
            ax.bar(xs, ys, w, label=lb, color=cmap(i % 10))
        ax.set_xticks([j + 0.4 - w / 2 for j in range(len(keys))])
        ax.set_xticklabels([f"{k[0][7:]}\n{k[1]}" for k in keys])
        ax.set_ylabel(unit)
        if log:
            ax.set_yscale("log")
        ax.legend(fontsize=7, loc="upper left", ncol=2 if len(labels) > 5 else 1)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"kvcache CPU kernels vs baselines and peers (bf16, N16 H8 D128) - {cpu}")
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(f"plot_bench: wrote {a.out}")


if __name__ == "__main__":
    main()
