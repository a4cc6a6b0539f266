"""Draws the plots of benchmarks/results/*.csv (the long format of results_csv.py).

    python benchmarks/plot_results.py                       # every plot into benchmarks/results/plots/
    python benchmarks/plot_results.py --out /tmp/plots      # elsewhere
    python benchmarks/plot_results.py --results DIR         # CSVs of another directory (e.g. a GPU run's $OUT)
    python benchmarks/plot_results.py --experiment triton-register-cap   # one decision's evidence only

Plots are generated outputs and are not committed (benchmarks/README.md): draw them from the
CSVs when you need them. Per card:
- chain_<card>.png: time per call against B for each backend (graph solid, eager dotted), the
  memory floor (dashed) and the peers quoted from DESIGN.md (crosses), one panel per input pair;
- stream_probe_<card>.png: the floor, the best pure-read probe and both kernels, against B;
and across cards: tree.png (64-node trees), distributed.png (speedup over all-gather + op),
filters.png (each filter setting over the unfiltered call), and tuning/<experiment>.png (each
decision's rows in tuning.csv: time against B per variant, one panel per card and input pair).
Only the csv module and matplotlib (Agg backend) are used.
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import re
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))


def pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def read(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def num(x) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(v) else v


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_").lower()


def inputs(r: dict) -> str:
    probs = "no draft probs" if r["draft_probs"] in ("", "none") else f"{r['draft_probs']} draft probs"
    return f"{r['logits_dtype']} logits, {probs}"


COLORS = {}


def color(name: str) -> str:
    """One color per backend across panels and modes."""
    return COLORS.setdefault(name, f"C{len(COLORS) % 10}")


def series(rows, key):
    """key(row) -> sorted [(B, time)] (the last row wins for a repeated B)."""
    out = defaultdict(dict)
    for r in rows:
        b, t = num(r["B"]), num(r["time_us"])
        if b is not None and t is not None:
            out[key(r)][b] = t
    return {k: sorted(v.items()) for k, v in out.items()}


def loglog(ax, xlabel="batch size B", ylabel="time per call (us)"):
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)


def panels(plt, n):
    cols = min(n, 3)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 4.3 * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:n])


def save(fig, path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def commits(rows) -> str:
    return ", ".join(sorted({f"{r['backend']} {r['commit']}" for r in rows if r["source"] == "measured"}))


def plot_chain(plt, rows, out):
    for card in sorted({r["card"] for r in rows}):
        sel = [r for r in rows if r["card"] == card and r["method"] == "token" and r["op"] == "chain"]
        pairs = sorted({inputs(r) for r in sel})
        fig, axes = panels(plt, len(pairs))
        for ax, pair in zip(axes, pairs):
            here = [r for r in sel if inputs(r) == pair]
            floor = series([dict(r, time_us=r["floor_us"]) for r in here if r["source"] == "measured"],
                           lambda r: "floor")
            for _, pts in floor.items():
                ax.plot(*zip(*pts), "k--", label="memory floor")
            for (backend, mode, source), pts in sorted(series(here, lambda r: (r["backend"], r["mode"],
                                                                                r["source"])).items()):
                quoted = source != "measured"
                style = ("x" if quoted else "o") + (":" if mode == "eager" else "-")
                ax.plot(*zip(*pts), style, color=color(backend), alpha=0.6 if quoted else 1.0,
                        label=f"{backend} {mode}" + (" (quoted)" if quoted else ""))
            ax.set_title(f"{pair}, K = 4, V = 128256", fontsize=9)
            loglog(ax)
        fig.suptitle(f"chain verification on {card} ({commits(sel)})", fontsize=9)
        save(fig, os.path.join(out, f"chain_{slug(card)}.png"))
        plt.close(fig)


def plot_stream_probe(plt, rows, out):
    for card in sorted({r["card"] for r in rows}):
        sel = [r for r in rows if r["card"] == card]
        pairs = sorted({inputs(r) for r in sel})
        fig, axes = panels(plt, len(pairs))
        for ax, pair in zip(axes, pairs):
            here = [r for r in sel if inputs(r) == pair]
            best = defaultdict(lambda: math.inf)
            for r in here:
                if r["backend"].startswith("probe-"):
                    best[num(r["B"])] = min(best[num(r["B"])], num(r["time_us"]))
            ax.plot(*zip(*series([dict(r, time_us=r["floor_us"]) for r in here], lambda r: 0)[0]), "k--",
                    label="memory floor")
            ax.plot(*zip(*sorted(best.items())), "s-", label="best pure-read probe")
            for backend, pts in sorted(series([r for r in here if not r["backend"].startswith("probe-")],
                                              lambda r: r["backend"]).items()):
                ax.plot(*zip(*pts), "o-", label=f"{backend} op")
            ax.set_title(f"{pair}, graph", fontsize=9)
            loglog(ax)
        fig.suptitle(f"the practical floor on {card} ({', '.join(sorted({r['commit'] for r in sel}))})", fontsize=9)
        save(fig, os.path.join(out, f"stream_probe_{slug(card)}.png"))
        plt.close(fig)


def plot_tree(plt, rows, out):
    sel = [r for r in rows if r["op"] == "tree" and r["nodes"] == "64" and r["mode"] == "graph"
           and r.get("filters", "") in ("", "unfiltered")]
    if not sel:
        return
    fig, (ax,) = panels(plt, 1)
    for (card, backend, pair, commit), pts in sorted(series(
            sel, lambda r: (r["card"], r["backend"], inputs(r), r["commit"])).items()):
        ax.plot(*zip(*pts), "o-", label=f"{card} {backend} {pair} ({commit})")
    for (card, pair), pts in sorted(series([dict(r, time_us=r["floor_us"]) for r in sel],
                                           lambda r: (r["card"], inputs(r))).items()):
        ax.plot(*zip(*pts), "--", color="gray", alpha=0.6, label=f"floor {card} {pair}")
    ax.set_title("tree verification, 64-node trees, V = 128256, graph", fontsize=9)
    loglog(ax)
    save(fig, os.path.join(out, "tree.png"))
    plt.close(fig)


def plot_distributed(plt, rows, out):
    sel = [r for r in rows if r["mode"] == "graph"]
    if not sel:
        return
    by = defaultdict(dict)
    for r in sel:
        key = (r["op"], r["vp_path"], r["tp"], r["V"], inputs(r))
        by[key].setdefault(num(r["B"]), {})[r["backend"].split(" + ")[0]] = num(r["time_us"])
    ops = sorted({k[0] for k in by})
    fig, axes = panels(plt, len(ops))
    for ax, op in zip(axes, ops):
        for key in sorted(k for k in by if k[0] == op):
            pts = sorted((b, t["all-gather"] / t["vocab-parallel"]) for b, t in by[key].items()
                         if t.get("all-gather") and t.get("vocab-parallel"))
            if pts:
                ax.plot(*zip(*pts), "o-", label=f"TP {key[2]}, V {key[3]}, {key[4]}, {key[1]}")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_title(f"{op}: all-gather + op over vocab-parallel (graph)", fontsize=9)
        loglog(ax, ylabel="speedup of vocab-parallel")
    fig.suptitle(f"vocabulary-parallel verification on {', '.join(sorted({r['card'] for r in sel}))}", fontsize=9)
    save(fig, os.path.join(out, "distributed.png"))
    plt.close(fig)


def plot_filters(plt, rows, out):
    # The current numbers: rows of plain runs (an experiment's rows are in tuning/<experiment>.png).
    sel = [r for r in rows if r["mode"] == "graph" and r["backend"] in ("triton", "cuda") and not r["experiment"]]
    if not sel:
        return
    groups = sorted({(r["card"], int(r["V"]), int(r["B"]), inputs(r)) for r in sel})
    fig, axes = panels(plt, len(groups))
    for ax, (card, v, b, pair) in zip(axes, groups):
        here = [r for r in sel if (r["card"], int(r["V"]), int(r["B"]), inputs(r)) == (card, v, b, pair)]
        settings = list(dict.fromkeys(r["filters"] for r in here))
        backends = sorted({r["backend"] for r in here})
        width = 0.8 / len(backends)
        for i, backend in enumerate(backends):
            t = {r["filters"]: num(r["time_us"]) for r in here if r["backend"] == backend}
            xs = [j + i * width for j, s in enumerate(settings) if s in t]
            ax.bar(xs, [t[s] for s in settings if s in t], width, label=backend)
            if "unfiltered" in t:
                ax.axhline(2 * t["unfiltered"], ls="--", lw=0.8, color=f"C{i}", label=f"2x {backend} unfiltered")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(settings))], settings, rotation=30, fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("time per call, graph (us)")
        ax.set_title(f"{card}, V = {v}, B = {b}, {pair}", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle("sampling filters", fontsize=9)
    save(fig, os.path.join(out, "filters.png"))
    plt.close(fig)


def plot_tuning(plt, rows, out, only=None):
    for exp in sorted({r["experiment"] for r in rows if r["experiment"]}):
        if only and exp != only:
            continue
        sel = [r for r in rows if r["experiment"] == exp and r["mode"] in ("graph", "kernel")]
        def group(r):
            return r["card"], r["op"], inputs(r) + (f", {r['filters']}" if r.get("filters") else "")

        groups = sorted({group(r) for r in sel})
        if not groups:
            continue
        fig, axes = panels(plt, len(groups))
        for ax, (card, op, pair) in zip(axes, groups):
            here = [r for r in sel if group(r) == (card, op, pair)]
            for (variant, commit), pts in sorted(series(here, lambda r: (r["variant"], r["commit"])).items()):
                label = f"{variant[:60]} ({commit[:24]})"
                if len(pts) == 1:
                    ax.plot(*zip(*pts), "o", label=label)
                else:
                    ax.plot(*zip(*pts), "o-", label=label)
            ax.set_title(f"{card[:12]}, {op}, {pair}", fontsize=8)
            loglog(ax)
            ax.legend(fontsize=5)
        fig.suptitle(f"docs/DECISIONS.md: {exp}", fontsize=9)
        save(fig, os.path.join(out, "tuning", f"{exp}.png"))
        plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=os.path.join(HERE, "results"), help="directory of the CSVs")
    ap.add_argument("--out", default=None, help="directory of the PNGs (default: RESULTS/plots)")
    ap.add_argument("--experiment", default=None, help="only tuning/<EXPERIMENT>.png")
    args = ap.parse_args(argv)
    out = args.out or os.path.join(args.results, "plots")
    plt = pyplot()
    csvs = {name: read(os.path.join(args.results, name + ".csv"))
            for name in ("chain", "stream_probe", "tree", "distributed", "filters", "tuning")}
    if args.experiment:
        plot_tuning(plt, csvs["tuning"], out, args.experiment)
        return
    plot_chain(plt, csvs["chain"], out)
    plot_stream_probe(plt, csvs["stream_probe"], out)
    plot_tree(plt, csvs["tree"], out)
    plot_distributed(plt, csvs["distributed"], out)
    plot_filters(plt, csvs["filters"], out)
    plot_tuning(plt, csvs["tuning"], out)


if __name__ == "__main__":
    main()
