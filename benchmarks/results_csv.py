"""The long format of the benchmark results, in one place.

Every benchmark script writes its CSV through this module, and `benchmarks/results/*.csv` hold
the same format. One row is one measured time (long format): the run's identity, the shape, the
timing mode, the time and the floor. The common columns come first, in this order; a script adds
columns of its own after them (e.g. `filters`, `tp`, `config`, `stage`).

| column | meaning |
|---|---|
| bench | the script: chain, tree, filters, distributed, verify_share, stream_probe, tune_cuda_plan, trace_chain_timeline |
| experiment | the docs/DECISIONS.md heading the row is evidence for (`$SPECDEC_EXPERIMENT`; empty for plain runs) |
| variant | what was timed, in words (`$SPECDEC_VARIANT`, or the script's own label: an A/B side, a filter setting) |
| knobs | the `SPECDEC_*` environment of the run (tuning switches; `SPECDEC_COMMIT` and the two above excluded) |
| card, torch, triton, cuda | `torch.cuda.get_device_name()` and the versions |
| commit | `$SPECDEC_COMMIT`, else `git rev-parse --short HEAD` of the checkout, else `unknown` |
| source | measured (written by a script), transcribed (from a log or a doc, the run's CSV lost) or quoted (another party's number) |
| backend | cuda, triton, torch (the PyTorch pipeline), a peer (vllm-mrv2, flashinfer, vllm-v1) or a probe |
| op, method | chain or tree; token or block verification |
| B, K, V, nodes | requests, drafts per request (chains), vocabulary, nodes per tree |
| logits_dtype, draft_probs | bf16 / fp16 / fp32; none or the draft probabilities' dtype |
| mode | graph (GPU time per call replayed in a CUDA graph), eager (a Python call), graph1 (a graph of that one call), host (the host time of an eager call, calls queued back to back), kernel (one kernel's GPU time), trace (a stage of the traced kernel) |
| time_us, floor_us, ratio | the time, the memory floor (DESIGN.md section 4) and time / floor |
| bandwidth_TBps | the card's measured copy bandwidth that the floor uses |
| note | provenance and caveats |

    python benchmarks/results_csv.py append --to benchmarks/results/chain.csv OUT/bench_rejection_sample.csv
    python benchmarks/results_csv.py check benchmarks/results/*.csv

`append` adds rows to a results file (the header becomes the union of both; rows keep their
values); `check` verifies that every row names its card, versions, commit, mode and time.
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import subprocess
import sys

COLUMNS = ("bench", "experiment", "variant", "knobs", "card", "torch", "triton", "cuda", "commit", "source",
           "backend", "op", "method", "B", "K", "V", "nodes", "logits_dtype", "draft_probs",
           "mode", "time_us", "floor_us", "ratio", "bandwidth_TBps", "note")
REQUIRED = ("bench", "card", "torch", "triton", "commit", "source", "mode", "time_us")
RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
_NOT_KNOBS = ("SPECDEC_COMMIT", "SPECDEC_EXPERIMENT", "SPECDEC_VARIANT")


def commit() -> str:
    """$SPECDEC_COMMIT (copies without .git, such as the GPU machine's, pass it), else the checkout's HEAD."""
    value = os.environ.get("SPECDEC_COMMIT")
    if value:
        return value
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], stderr=subprocess.DEVNULL,
                                       cwd=os.path.dirname(os.path.abspath(__file__)), text=True).strip()
    except Exception:
        return "unknown"


def knobs() -> str:
    """The run's SPECDEC_* settings, sorted, space-separated ('' when none)."""
    return " ".join(f"{k}={v}" for k, v in sorted(os.environ.items())
                    if k.startswith("SPECDEC_") and k not in _NOT_KNOBS)


def versions(device=None) -> dict:
    """card, torch, triton, cuda, commit. `device`: a torch.device whose type is not cuda gives card 'cpu'."""
    import torch
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    on_cuda = torch.cuda.is_available() and (device is None or getattr(device, "type", "cuda") == "cuda")
    return dict(card=torch.cuda.get_device_name(device) if on_cuda else "cpu", torch=torch.__version__,
                triton=triton_version, cuda=torch.version.cuda or "none", commit=commit())


def run_info(bench: str, device=None) -> dict:
    """The columns every row of one run shares."""
    return dict(bench=bench, experiment=os.environ.get("SPECDEC_EXPERIMENT", ""),
                variant=os.environ.get("SPECDEC_VARIANT", ""), knobs=knobs(), **versions(device),
                source="measured")


def _finite(x) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(v) or math.isinf(v) else v


def long_rows(rows: list[dict], times: dict[str, str], drop: tuple[str, ...] = ()) -> list[dict]:
    """Wide rows (one per shape, a time column per mode) -> long rows (one per shape and mode).

    times: mode -> the wide column holding its time in us; drop: derived wide columns to leave out
    (ratios that the long row's `ratio` replaces). A time that is missing or NaN gives no row."""
    out = []
    for r in rows:
        base = {k: v for k, v in r.items() if k not in times.values() and k not in drop}
        floor = _finite(base.get("floor_us"))
        for mode, key in times.items():
            t = _finite(r.get(key))
            if t is None:
                continue
            out.append(dict(base, mode=mode, time_us=round(t, 3),
                            ratio=round(t / floor, 3) if floor else ""))
    return out


def header(rows: list[dict], first: tuple[str, ...] = COLUMNS) -> list[str]:
    """The common columns, then the others in order of first appearance."""
    extra = dict.fromkeys(k for r in rows for k in r if k not in first)
    return list(first) + list(extra)


def write(path: str, rows: list[dict]) -> None:
    """The rows in the long format (missing columns empty)."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=header(rows), restval="")
        w.writeheader()
        w.writerows(rows)


def read(path: str) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def append(path: str, rows: list[dict]) -> None:
    """Adds rows to a results file; the header becomes the union of the file's and the rows'."""
    old, first = [], COLUMNS
    if os.path.exists(path):
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            old = list(reader)
            first = tuple(reader.fieldnames or COLUMNS)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=header(old + rows, first), restval="")
        w.writeheader()
        w.writerows(old + rows)


def check(path: str) -> list[str]:
    """Problems of one results file: missing required columns or empty required values."""
    rows = read(path)
    problems = []
    cols = set(rows[0]) if rows else set()
    problems += [f"{path}: no column {c}" for c in REQUIRED if rows and c not in cols]
    for i, r in enumerate(rows, start=2):
        empty = [c for c in REQUIRED if c in cols and not r[c]]
        if empty:
            problems.append(f"{path}:{i}: empty {', '.join(empty)}")
        if r.get("time_us") and _finite(r["time_us"]) is None:
            problems.append(f"{path}:{i}: time_us {r['time_us']!r}")
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("append", help="append the rows of CSVs written by the benchmarks to a results file")
    a.add_argument("--to", required=True, help="e.g. benchmarks/results/chain.csv")
    a.add_argument("--experiment", help="set the experiment column of the appended rows (a DECISIONS.md heading)")
    a.add_argument("csvs", nargs="+")
    c = sub.add_parser("check", help="check results files")
    c.add_argument("csvs", nargs="+")
    args = ap.parse_args(argv)
    if args.cmd == "append":
        rows = [r for p in args.csvs for r in read(p)]
        if args.experiment is not None:
            rows = [dict(r, experiment=args.experiment) for r in rows]
        append(args.to, rows)
        print(f"{args.to}: +{len(rows)} rows")
        return 0
    problems = [p for path in args.csvs for p in check(path)]
    print("\n".join(problems) if problems else f"{len(args.csvs)} files: ok")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
