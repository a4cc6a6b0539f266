"""Where the CUDA chain kernel's time goes: a per-CTA timeline from %globaltimer marks.

Needs the profiling build (the marks compile to nothing otherwise):

    SPECDEC_NVCC_FLAGS=-DSPECDEC_TRACE python setup.py build_ext --inplace

Thread 0 of every CTA stamps (csrc/kernels/rejection_sample_trace.cuh, RS_TRACE): entry, the
request's fields loaded, phase 2's wait over, its share of the stream processed, the record's
values known (combine + in-chunk sample), record released and counted, and for the request's
finalizer the outputs written. For each shape this runs the call eagerly `--runs` times and
reports medians over runs of: the launch spread (last CTA entry - first), per-stage durations
(median and max over CTAs), when the last unit was counted, the finalizer's own time and the
span from the first CTA's entry to the end; beside them the graph time per call (do_bench, no
trace) of the same build. Writes a CSV of the per-run summaries in the long format of
results_csv.py (one row per stage statistic, `stage`, mode trace; append it to
benchmarks/results/trace.csv with `python benchmarks/results_csv.py append`), one of the raw marks
of the last run per shape (with card, versions and commit), and a PNG of those timelines.

A mark costs a global store from thread 0 (and makes thread 0 wait for the value it closes),
so the traced kernel is a little slower than the shipped one; compare stages, not totals.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_rejection_sample as chain_bench  # noqa: E402
import results_csv  # noqa: E402

MARKS = ["entry", "request", "waited", "streamed", "combined", "counted", "finalized"]


def result_rows(summaries: list[dict], k: int, vocab: int) -> list[dict]:
    """The per-shape summaries in the long format of results_csv: the graph time of the traced build,
    then one row per stage statistic (`stage`, mode trace)."""
    run = results_csv.run_info("trace_chain_timeline")
    out = []
    for s in summaries:
        base = dict(run, backend="cuda", op="chain", method="token", B=s["batch"], K=k, V=vocab,
                    logits_dtype=s["logits"], draft_probs=s["draft_probs"], temperature=s["temperature"],
                    ctas=s["ctas"], finalizers=s.get("finalizers", ""))
        out.append(dict(base, stage="graph time of the traced build", mode="graph", time_us=round(s["graph_us"], 3)))
        for key, value in s.items():
            if key in ("card", "batch", "logits", "draft_probs", "temperature", "graph_us", "ctas", "finalizers"):
                continue
            if value == value:  # not NaN
                out.append(dict(base, stage=key, mode="trace", time_us=round(value, 3)))
    return out


def summarize(trace: torch.Tensor) -> dict:
    """Stage durations (µs) of one traced call; trace rows are CTAs that ran (entry != 0)."""
    rows = trace[trace[:, 0] != 0]
    t = rows[:, :7].double()
    t0 = t[:, 0].min()
    rel = torch.where(rows[:, :7] != 0, (t - t0) / 1e3, torch.full_like(t, float("nan")))
    phase1 = (rows[:, 7] & 0x80000000) == 0
    out = {"ctas": int(rows.shape[0]), "launch_spread": float(rel[:, 0].max())}

    def stage(name, a, b, mask):
        d = rel[mask][:, b] - rel[mask][:, a]
        d = d[~torch.isnan(d)]
        out[name + "_med"] = float(d.median()) if d.numel() else float("nan")
        out[name + "_max"] = float(d.max()) if d.numel() else float("nan")

    stage("p1_request", 0, 1, phase1)
    stage("p1_stream", 1, 3, phase1)
    stage("p1_barrier", 3, 2, phase1)  # phase 1 stamps 'waited' when every thread has streamed
    stage("p1_combine", 2, 4, phase1)
    stage("p1_count", 4, 5, phase1)
    p1_counted = rel[phase1][:, 5]
    out["p1_last_counted"] = float(p1_counted[~torch.isnan(p1_counted)].max())
    if (~phase1).any():
        stage("p2_wait", 1, 2, ~phase1)
        stage("p2_stream", 2, 3, ~phase1)
        stage("p2_count", 3, 5, ~phase1)
    fin = ~torch.isnan(rel[:, 6])
    out["finalizers"] = int(fin.sum())
    out["finalize_med"] = float((rel[fin][:, 6] - rel[fin][:, 5]).median())
    out["finalize_max"] = float((rel[fin][:, 6] - rel[fin][:, 5]).max())
    if trace.shape[1] > 9:  # the finalizer's own marks (slots 8, 9; phase-1 finalizers)
        extra = torch.where(rows[:, 8:10] != 0, (rows[:, 8:10].double() - t0) / 1e3,
                            torch.full_like(rows[:, 8:10].double(), float("nan")))
        fin1 = fin & ~torch.isnan(extra[:, 1])
        if fin1.any():
            for name, a, b in (("fin_records", rel[:, 5], extra[:, 0]), ("fin_decide", extra[:, 0], extra[:, 1]),
                               ("fin_outputs", extra[:, 1], rel[:, 6])):
                out[name + "_med"] = float((b[fin1] - a[fin1]).median())
    out["span"] = float(torch.nan_to_num(rel, nan=0.0).max())
    return out


def plot(raw: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = ["#bbbbbb", "#1f77b4", "#9467bd", "#2ca02c", "#ff7f0e", "#d62728"]
    fig, axes = plt.subplots(len(raw), 1, figsize=(10, 2.2 * len(raw)), squeeze=False)
    for ax, (name, rows) in zip(axes[:, 0], raw.items()):
        t = rows[:, :7].double()
        t0 = t[:, 0].min()
        rel = ((t - t0) / 1e3).tolist()
        order = sorted(range(len(rel)), key=lambda i: rel[i][0])
        for y, i in enumerate(order):
            marks = sorted(((m, v) for m, v in enumerate(rel[i]) if rows[i, m] != 0), key=lambda mv: mv[1])
            for (m0, a), (_m1, b) in zip(marks, marks[1:]):
                ax.plot([a, b], [y, y], color=colors[min(m0, 5)], lw=1)
        ax.set_title(name, fontsize=9)
        ax.set_ylabel("CTA (by entry)")
    axes[-1, 0].set_xlabel("µs since the first CTA's entry; a segment's colour is the mark it starts at: entry grey, "
                           "request blue, waited (phase 2) / all streamed (phase 1) purple, streamed green, "
                           "combined orange, counted red", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="1,bf16,none,1;1,bf16,none,0;8,bf16,none,1;32,bf16,none,1;"
                                        "128,bf16,none,1;1,fp32,fp32,1;32,fp32,fp32,1",
                    help="B,logits dtype,draft probs (none|fp32),temperature; ';'-separated")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--out", default="trace_chain_timeline")
    ap.add_argument("--no-flush", action="store_true",
                    help="keep L2 between the warm-up call and the traced one (the 2026-11-27 runs did: "
                         "inputs of <= ~50 MB, B <= 32 at bf16, were then partly read from L2)")
    args = ap.parse_args()
    if not torch._C._dispatch_has_kernel_for_dispatch_key("specdec::_rejection_sample_trace",
                                                          "CompositeImplicitAutograd"):
        sys.exit("this build has no trace: rebuild with SPECDEC_NVCC_FLAGS=-DSPECDEC_TRACE")

    card = torch.cuda.get_device_name()
    l2_flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    summaries, raw = [], {}
    print(f"{card}, K = {args.k}, V = {args.vocab}; µs, medians over {args.runs} runs (stage: median / max over CTAs)")
    for spec in args.shapes.split(";"):
        b, dtype, probs, temp = spec.split(",")
        b, temp = int(b), float(temp)
        # The benchmarks' graph time: 16 calls per graph on input copies (L2 does not flatter);
        # the first set is the one traced.
        sets = [chain_bench.make_inputs(b, args.k, args.vocab, chain_bench.DTYPES[dtype], probs != "none",
                                        seed=b + 1000 * i) for i in range(16 if b <= 32 else 4)]
        for s in sets:
            s["temperature"] = torch.full((b,), temp, device="cuda")
        graph_us = chain_bench.time_graph([chain_bench.our_call(s, args.k, "cuda") for s in sets])
        call = chain_bench.our_call(sets[0], args.k, "cuda")
        del sets[1:]
        per_run = []
        for _ in range(args.runs):
            call()
            torch.ops.specdec._rejection_sample_trace(True)
            if not args.no_flush:
                l2_flush.zero_()  # the traced call reads its logits from HBM, as in the benchmarks
            call()
            trace = torch.ops.specdec._rejection_sample_trace(True)
            per_run.append(summarize(trace))
        raw[f"B={b} {dtype} draft={probs} T={temp:g}"] = trace[trace[:, 0] != 0]
        med = {key: statistics.median(r[key] for r in per_run) for key in per_run[0]}
        med.update(card=card, batch=b, logits=dtype, draft_probs=probs, temperature=temp, graph_us=graph_us)
        summaries.append(med)
        p2 = (f" | p2 wait {med['p2_wait_med']:.2f}/{med['p2_wait_max']:.2f} stream {med['p2_stream_med']:.2f}/"
              f"{med['p2_stream_max']:.2f} count {med['p2_count_med']:.2f}") if "p2_wait_med" in med else ""
        print(f"B={b:4d} {dtype} draft={probs:4s} T={temp:g}: graph {graph_us:6.1f} | span {med['span']:6.2f} "
              f"ctas {med['ctas']:.0f} launch spread {med['launch_spread']:.2f} | p1 request "
              f"{med['p1_request_med']:.2f}/{med['p1_request_max']:.2f} stream {med['p1_stream_med']:.2f}/"
              f"{med['p1_stream_max']:.2f} barrier {med['p1_barrier_med']:.2f}/{med['p1_barrier_max']:.2f} combine {med['p1_combine_med']:.2f}/{med['p1_combine_max']:.2f} count "
              f"{med['p1_count_med']:.2f}/{med['p1_count_max']:.2f} last counted {med['p1_last_counted']:.2f}{p2} | "
              f"finalize {med['finalize_med']:.2f}/{med['finalize_max']:.2f}"
              + (f" (records {med['fin_records_med']:.2f} decide {med['fin_decide_med']:.2f} outputs "
                 f"{med['fin_outputs_med']:.2f})" if "fin_records_med" in med else ""))
    chain_bench.write_csv(args.out + ".csv", result_rows(summaries, args.k, args.vocab))
    raw_rows = []
    for name, rows in raw.items():
        for r in rows.tolist():
            raw_rows.append({"shape": name, **{m: r[i] for i, m in enumerate(MARKS)},
                             "smid": r[7] & 0x7FFFFFFF, "phase": 2 if r[7] & 0x80000000 else 1,
                             "unit": r[7] >> 32})
    info = results_csv.versions()
    with open(args.out + "_raw.csv", "w", newline="") as f:  # raw marks, not results: card and versions first
        w = csv.DictWriter(f, fieldnames=list(info) + list(dict.fromkeys(k for r in raw_rows for k in r)))
        w.writeheader()
        w.writerows(dict(info, **r) for r in raw_rows)
    plot(raw, args.out + ".png")
    print(f"wrote {args.out}.csv, {args.out}_raw.csv, {args.out}.png")



if __name__ == "__main__":
    main()
