"""Speed against quality of lenient verification (issue #39), from the CSV the CLI writes.

    python -m specdec_kernels.generate --sample --lenience 1 0.7 0.5 0.3 --csv benchmarks/results/lenience.csv
    python benchmarks/plot_lenience.py                                  # -> benchmarks/results/plots/lenience.png
    python benchmarks/plot_lenience.py --csv OTHER.csv --out /tmp/lenience.png

One panel per quality measure (the target's mean log-likelihood of the generated tokens, against
the measured tokens per verify step; the first token's total-variation distance from the target,
closed form and measured, against the closed-form probability that the first draft is accepted
on the same contexts, which carries no sampling noise); the measured speedup is printed beside
each point (noisy on a shared machine). One line per drafter and card, a point per lenience, labelled
with l; target.generate is the reference point of the log-likelihood panel. Plots are generated
outputs (benchmarks/results/plots/ is gitignored). Only the csv module and matplotlib are used.
"""
from __future__ import annotations

import argparse
import csv
import math
import os
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))


def _float(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def read(path: str) -> list[dict]:
    with open(path, newline="") as f:
        return [r for r in csv.DictReader(f) if r.get("bench") == "lenience"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--csv", default=os.path.join(HERE, "results", "lenience.csv"))
    ap.add_argument("--out", default=os.path.join(HERE, "results", "plots", "lenience.png"))
    args = ap.parse_args(argv)
    rows = read(args.csv)
    if not rows:
        raise SystemExit(f"{args.csv}: no lenience rows")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = defaultdict(list)
    baselines = []
    for r in rows:
        if r["drafter"] == "generate":
            baselines.append(r)
        else:
            lines[(r["card"], r["drafter"])].append(r)
    # (y column, x column, title): the log-likelihood against the measured tokens per step; the
    # first-token distances against the closed-form acceptance of the first draft (noise-free).
    panels = (("mean_loglik", "tokens_per_step",
               "target mean log-likelihood of the output\n(exact sampling: about minus the target's entropy; "
               "higher is not better)"),
              ("tv_first_law", "accept_first_law", "first-token TV from the target, closed form (0 = exact)"),
              ("tv_first_measured", "accept_first_law", "first-token TV from the target, measured (l = 1: noise floor)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5))
    for ax, (column, x_column, title) in zip(axes, panels):
        for (card, drafter), pts in sorted(lines.items()):
            pts = sorted(pts, key=lambda r: -_float(r["lenience"]))
            x = [_float(r[x_column]) for r in pts]
            y = [_float(r[column]) for r in pts]
            ax.plot(x, y, "o-", label=f"{drafter} ({card})")
            for r, xi, yi in zip(pts, x, y):
                ax.annotate(f"l={_float(r['lenience']):g}, {_float(r['speedup']):.2f}x", (xi, yi), fontsize=7,
                            textcoords="offset points", xytext=(3, 3))
        if column == "mean_loglik":
            for r in baselines:
                ax.axhline(_float(r[column]), color="k", ls=":", lw=1, label=f"target.generate ({r['card']})")
        ax.set_xlabel("tokens per verify step (measured)" if x_column == "tokens_per_step"
                      else "P(first draft accepted), closed form, on the fixed contexts")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    first = rows[0]
    k_text = f"K = {first['K']}, " if first.get("K") else "K per drafter, "
    fig.suptitle(f"lenience: speed against quality (T = {first['temperature']}, {k_text}"
                 f"{first['prompts']} prompts x {first['max_new_tokens']} tokens, commit {first['commit']})", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
