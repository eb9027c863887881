#!/usr/bin/python3
"""plot_offload.py - docs/img/offload.png from the JSON lines of one kvbench run.

    scripts/plot_offload.py RESULTS.jsonl [--out docs/img/offload.png]

Reads the offload.store and offload.load lines of kvbench (the last line
seen for each (bench, case) wins; quick lines and errors are ignored) and
draws GB/s against the fragment one copy moves (the "fragNKiB" part of the
case name: layer-major caches move 2L runs of N x H x D x 2 bytes per block,
a block-major cache one run of the whole block), with the memcpy baseline
each case measured in the same run, and the store's second baseline (a
1-thread memcpy of its own runs: the cost of the access pattern alone). Needs python3-matplotlib (Debian).
"""
import argparse
import os
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(path):
    """The offload lines of plot_bench.load (one loader: last line per
    (bench, case, baseline) wins, quick and failed lines skipped)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from plot_bench import load as load_all
    return [o for o in load_all(path) if o.get("bench") in ("offload.store", "offload.load")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("results")
    ap.add_argument("--out", default="docs/img/offload.png")
    a = ap.parse_args()
    rows = load(a.results)
    if not rows:
        sys.exit("plot_offload.py: no offload.store / offload.load lines in " + a.results)
    series = {}  # (bench, arrangement) -> [(frag KiB, gbps, baseline gbps)]
    runs1 = []  # (frag KiB, GB/s of a 1-thread memcpy of the store's own runs)
    cpu = rows[0].get("cpu", "?")
    for o in rows:
        m = re.search(r"/(nhd-layer|nhd-block)/frag(\d+)KiB", o["case"])
        if not m:
            continue
        if o.get("baseline") == "memcpy_runs_1thread":
            runs1.append((int(m.group(2)), o["baseline_gbps"]))
            continue
        if o.get("baseline") != "memcpy":
            continue
        series.setdefault((o["bench"], m.group(1)), []).append(
            (int(m.group(2)), o["gbps"], o["baseline_gbps"]))
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    style = {"offload.store": ("tab:blue", "o"), "offload.load": ("tab:orange", "s")}
    base = []
    for (bench, arr), pts in sorted(series.items()):
        pts.sort()
        color, marker = style[bench]
        label = "%s, %s" % (bench.split(".")[1], "layer-major" if arr == "nhd-layer"
                            else "block-major")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, color=color,
                linestyle="-" if arr == "nhd-layer" else "none", markersize=7,
                fillstyle="full" if arr == "nhd-layer" else "none", label=label)
        base += [(p[0], p[2]) for p in pts]
    per = {}  # fragment -> the baselines its cases measured
    for f, g in base:
        per.setdefault(f, []).append(g)
    xs = sorted(per)
    ax.plot(xs, [sum(per[x]) / len(per[x]) for x in xs], color="gray", linestyle=":",
            marker=".", label="memcpy of the same bytes (baseline, mean of its cases)")
    runs1.sort()
    if runs1:
        ax.plot([r[0] for r in runs1], [r[1] for r in runs1], color="gray", linestyle="--",
                marker="x", label="memcpy of the store's own runs, 1 thread (baseline)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("fragment per copy (KiB)")
    ax.set_ylabel("GB/s")
    ax.set_ylim(bottom=0)
    ax.set_title("offload tier: 4,096-token Llama-3-8B request (512 MiB)\n%s" % cpu,
                 fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print("wrote " + a.out)


if __name__ == "__main__":
    main()
