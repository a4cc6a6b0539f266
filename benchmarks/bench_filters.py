"""Benchmark of the fused sampling filters (issue #6): filtered vs unfiltered vs a sort pipeline.

Issue #6's bar: with top_k = 50 and top_p = 0.9 on every request, B = 32, K = 4, V = 128256,
bf16 logits, the filtered call takes at most 2x the unfiltered one. Rows (all on the same
inputs: bench_rejection_sample.make_inputs, random logits N(0, 2^2) unless --scale, temperature
1, drafts from a perturbed copy of the target):

- ``triton``: the Triton kernel without filters (the baseline of the bar);
- ``triton k50 p0.9``: the same call with top_k = 50, top_p = 0.9 (the bar's numerator), and
  the other filter settings (top-k alone, top-p alone, min-p, all three);
- ``sort+triton k50 p0.9``: what vLLM does -- fp32 logits / T, ``torch.sort`` of every row,
  softmax, ``cumsum``, mask, scatter back (vLLM's ``apply_top_k_top_p``) -- then the
  unfiltered Triton call on the masked fp32 logits; ``sort only`` is that filtering step alone;
- ``cuda`` / ``auto``: the CUDA C++ kernel, when built, without and with each filter setting
  (its own threshold pass, sm_90+); ``--backends`` picks which backends run.

``--breakdown`` prints each setting's GPU time per kernel (the threshold pass's stats stream and
search, the verification kernel); ``--profile-one SETTING`` runs only that call (for ncu).

Times as in bench_rejection_sample.py: ``graph`` = GPU time per call from a CUDA graph of
several calls on distinct input sets (L2 flushed before each replay), ``eager`` = the Python
call (L2 flushed before each). ``graph1`` = a graph of that one call (the eager call's conditions:
cold L2, no neighbouring call to overlap with); ``host`` = the host time per eager call (calls
queued back to back): below the GPU time, eager calls are GPU-bound. ``vs_unfiltered`` = graph time over the unfiltered Triton graph time of the same
configuration. ``--knobs`` also times the filtered call for several FilterConfig cap / tile
values (specdec_kernels/triton/config.py; each is a separate compile); ``--knob-runs`` times the
chosen settings under explicit FilterConfig field sets, e.g. ``"maxnreg=0;maxnreg=128 pivot_tile=1"``.
SPECDEC_TRITON_* variables set the configs of the whole run (``config.from_env``).

    python benchmarks/bench_filters.py --out bench_out            # the bar's configuration (+ fp32 + draft probs)
    python benchmarks/bench_filters.py --out bench_out --knobs    # + the knob sweep
    python benchmarks/bench_filters.py --out bench_out --batches 1,8,32,128 --scale 2,4
    # issue #36's matrix (CUDA pass, T = 0.8, N(0, 3^2) logits):
    python benchmarks/bench_filters.py --out bench_out --backends cuda --temperature 0.8 --scale 3 \
        --batches 1,8,32,64,128 --vocab 32000,128256,151936 \
        --settings "p0.9,k50 p0.9,k50,minp0.05,p0.9999,kV-64,mixed" --configs bf16,fp32+draft

Writes <out>/bench_filters.csv (the long format of results_csv.py, one row per time: the filter
setting in `filters`, a knob run's settings in `variant`; append it to
benchmarks/results/filters.csv with `python benchmarks/results_csv.py append`) and
<out>/bench_filters.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import specdec_kernels  # noqa: E402
from specdec_kernels.triton import config  # noqa: E402
from bench_rejection_sample import (  # noqa: E402
    DTYPES, copy_bandwidth, floor_us, make_inputs, time_eager, time_graph, versions, write_csv)
import results_csv  # noqa: E402

# The script's row names ("triton k50 p0.9 cap=64") -> results_csv's backend column.
BACKEND_PREFIXES = (("sort+triton", "sort pipeline + triton"), ("sort only", "sort pipeline"),
                    ("triton", "triton"), ("cuda", "cuda"), ("auto", "auto"))


def result_rows(rows: list[dict]) -> list[dict]:
    """The rows in the long format of results_csv: the name split into backend, filter setting
    (`filters`) and knob run (in `variant`), one row per timing mode."""
    run = results_csv.run_info("filters")
    out = []
    for r in rows:
        name = r["variant"]
        prefix, backend = next(p for p in BACKEND_PREFIXES if name.startswith(p[0]))
        words = name[len(prefix):].split()
        knob = " ".join(w for w in words if "=" in w)
        variant = "; ".join(x for x in (run["variant"], knob and f"knobs {knob}") if x)
        out.append(dict(run, **dict(r, variant=variant), backend=backend, op="chain", method="token",
                        filters=" ".join(w for w in words if "=" not in w) or "unfiltered"))
    return results_csv.long_rows(out, {"graph": "graph_us", "eager": "eager_us", "graph1": "graph1_us", "host": "host_us"},
                                 drop=("graph_over_floor", "eager_vs_graph_us"))

FILTER_SETTINGS = {
    # name: (top_k, top_p, min_p); None = the argument not passed
    "k50 p0.9": (50, 0.9, None),
    "k50": (50, None, None),
    "p0.9": (None, 0.9, None),
    "minp0.05": (None, None, 0.05),
    "k50 p0.9 minp0.05": (50, 0.9, 0.05),
    # The worst cases of a threshold search: top-p alone near 1, top-k near V (NEAR_V = V - 64).
    "p0.9999": (None, 0.9999, None),
    "kV-64": ("NEAR_V", None, None),
    # Per-request values mixed in one batch, with unfiltered and greedy requests (MIXED below).
    "mixed": ("MIXED", "MIXED", "MIXED"),
    # Probes (not in the default sweep): where the filtered call's time goes.
    "k0 (off)": (0, None, None),        # the filtered kernel variant, no row filtered
    "k1": (1, None, None),              # the smallest bracket
    "minp0.999": (None, None, 0.999),   # a closed-form threshold keeping ~1 token: no search
}
DEFAULT_SETTINGS = ["k50 p0.9", "k50", "p0.9", "minp0.05", "k50 p0.9 minp0.05"]
CONFIGS = {"bf16": ("bf16", False), "fp32+draft": ("fp32", True)}


def op_call(inp: dict, k: int, backend: str, filters: dict | None = None):
    """The op on one input set, as a zero-argument callable (filters: top_k / top_p / min_p)."""
    return lambda: specdec_kernels.rejection_sample(
        inp["target_logits"], inp["draft_token_ids"], inp["cu_num_draft_tokens"], inp["draft_probs"],
        inp["temperature"], inp["seeds"], inp["offsets"], k, backend=backend, **(filters or {}))


def kernel_breakdown(fns, calls: int = 32) -> list[tuple[str, float]]:
    """GPU time per call of each kernel the calls launch, from torch.profiler (eager calls over
    the input sets in turn)."""
    from torch.profiler import ProfilerActivity, profile
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            fns[i % len(fns)]()
        torch.cuda.synchronize()
    out = []
    for e in prof.key_averages():
        total = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if total > 0 and e.count >= calls:
            out.append((e.key[:34], total / calls))
    return sorted(out, key=lambda kv: -kv[1])


def time_host(fn, calls: int = 50) -> float:
    """Host time per call (us): `calls` calls back to back without waiting for the GPU, whose
    launch queue absorbs them. Below the GPU time, an eager call is GPU-bound."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return host / calls * 1e6


def filter_tensors(batch: int, setting, vocab: int = 0, device="cuda") -> dict:
    top_k, top_p, min_p = setting
    if setting == FILTER_SETTINGS["mixed"]:
        # Request i: top-k from (off, 20, 50, 1000), top-p from (off, 0.9, 0.95, 0.5), min-p from
        # (off, 0.05), in patterns that do not repeat together; inputs_for_setting makes every
        # fourth request greedy.
        i = torch.arange(batch, device=device)
        return dict(top_k=torch.tensor([0, 20, 50, 1000], dtype=torch.int32, device=device)[i % 4],
                    top_p=torch.tensor([1.0, 0.9, 0.95, 0.5], device=device)[(i // 2) % 4],
                    min_p=torch.tensor([0.0, 0.05], device=device)[(i // 3) % 2])
    if top_k == "NEAR_V":
        top_k = max(vocab - 64, 1)
    out = {}
    if top_k is not None:
        out["top_k"] = torch.full((batch,), top_k, dtype=torch.int32, device=device)
    if top_p is not None:
        out["top_p"] = torch.full((batch,), top_p, dtype=torch.float32, device=device)
    if min_p is not None:
        out["min_p"] = torch.full((batch,), min_p, dtype=torch.float32, device=device)
    return out


def scaled_inputs(batch, k, vocab, dtype, probs, seed, scale, temperature=1.0):
    inp = make_inputs(batch, k, vocab, DTYPES[dtype], probs, seed)
    if scale != 2.0:  # make_inputs draws N(0, 2^2) logits
        logits = inp["target_logits"].float() * (scale / 2.0)
        inp["target_logits"] = logits.to(DTYPES[dtype])
    inp["temperature"].fill_(temperature)
    return inp


def inputs_for_setting(inp: dict, name: str) -> dict:
    """The "mixed" setting makes every fourth request greedy (a copy of the temperatures)."""
    if name.split()[-1] != "mixed":
        return inp
    temperature = inp["temperature"].clone()
    temperature[3::4] = 0.0
    return dict(inp, temperature=temperature)


def sort_filter(logits: torch.Tensor, temperature: torch.Tensor, row_to_request: torch.Tensor,
                top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """vLLM's sort-based top-k / top-p (v1/sample/ops/topk_topp_sampler.apply_top_k_top_p) on
    fp32 logits / T: one ascending sort per row, mask by the k-th value and the cumulative
    probability, scatter back. Returns the masked fp32 logits (at T = 1, divided by T)."""
    logits = logits.float() / temperature[row_to_request, None]
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    k = top_k[row_to_request].long()
    kth = logits_sort.gather(-1, (logits_sort.shape[-1] - k).clamp(min=0)[:, None])
    logits_sort.masked_fill_(logits_sort < kth, float("-inf"))
    probs_sort = logits_sort.softmax(dim=-1)
    probs_sum = torch.cumsum(probs_sort, dim=-1, out=probs_sort)
    mask = probs_sum <= 1 - top_p[row_to_request, None]
    mask[:, -1] = False  # at least one
    logits_sort.masked_fill_(mask, float("-inf"))
    return logits_sort.scatter(dim=-1, index=logits_idx, src=logits_sort)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--batches", default="32")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--vocab", default="128256", help="comma list of vocabulary sizes")
    ap.add_argument("--scale", default="2", help="comma list of logit standard deviations")
    ap.add_argument("--temperature", type=float, default=1.0, help="every request's temperature")
    ap.add_argument("--backends", default="triton,cuda",
                    help="comma list of backends to time (auto, triton, cuda); each against its own unfiltered call")
    ap.add_argument("--knobs", action="store_true", help="also sweep FILTER_CAP / FILTER_TILE on the bar setting")
    ap.add_argument("--max-graph-calls", type=int, default=16)
    ap.add_argument("--settings", default=",".join(DEFAULT_SETTINGS),
                    help=f"comma list of filter settings to time, of {list(FILTER_SETTINGS)}")
    ap.add_argument("--configs", default="bf16,fp32+draft", help=f"comma list of {list(CONFIGS)}")
    ap.add_argument("--knob-runs", default="",
                    help="';'-separated sets of 'field=value' FilterConfig fields, each timing every --settings "
                         "entry")
    ap.add_argument("--no-sort", action="store_true", help="skip the sort-based baselines")
    ap.add_argument("--tag", default="", help="a label for this run: a CSV column and the files' suffix")
    ap.add_argument("--breakdown", action="store_true",
                    help="also print each setting's GPU time per kernel (torch.profiler over eager calls): the "
                         "threshold pass's stats stream and search, and the verification kernel")
    ap.add_argument("--profile-one", default="",
                    help="run only this --settings entry a few times at the first batch / vocab / config, with the "
                         "first of --backends (for ncu)")
    args = ap.parse_args()
    verify_cfg, filter_cfg = config.from_env()
    configs = [CONFIGS[c.strip()] for c in args.configs.split(",")]
    settings = [name.strip() for name in args.settings.split(",")]
    unknown = [name for name in settings if name not in FILTER_SETTINGS]
    if unknown:
        ap.error(f"unknown --settings {unknown}; choose from {list(FILTER_SETTINGS)}")
    vocabs = [int(v) for v in args.vocab.split(",")]
    os.makedirs(args.out, exist_ok=True)
    if args.profile_one:
        batch, (dtype, probs) = int(args.batches.split(",")[0]), configs[0]
        inp = scaled_inputs(batch, args.k, vocabs[0], dtype, probs, 0, float(args.scale.split(",")[0]),
                            args.temperature)
        backend = args.backends.split(",")[0].strip()
        run = op_call(inp, args.k, backend, filter_tensors(batch, FILTER_SETTINGS[args.profile_one], vocabs[0]))
        for _ in range(6):
            run()
        torch.cuda.synchronize()
        return
    info = versions()
    bandwidth = copy_bandwidth()
    cuda_built = specdec_kernels.available_backends()["cuda"] == "available"
    print(f"# {info['card']}: copy bandwidth {bandwidth / 1e12:.2f} TB/s; torch {info['torch']}, "
          f"triton {info['triton']}, commit {info['commit']}; CUDA kernel built: {cuda_built}; "
          f"{verify_cfg} {filter_cfg}", flush=True)
    k = args.k
    rows = []
    for vocab in vocabs:
        for scale in (float(s) for s in args.scale.split(",")):
            for batch in (int(b) for b in args.batches.split(",")):
                for dtype, probs in configs:
                    floor = floor_us(batch, k, vocab, dtype, probs, bandwidth)
                    set_bytes = batch * (k + 1) * vocab * (DTYPES[dtype].itemsize + (4 if probs else 0))
                    n_sets = max(2, min(args.max_graph_calls, int(4e9 // max(set_bytes, 1))))
                    sets = [scaled_inputs(batch, k, vocab, dtype, probs, seed, scale, args.temperature)
                            for seed in range(n_sets)]
                    row_to_request = torch.repeat_interleave(torch.arange(batch, device="cuda"), k + 1)

                    def sort_only(inp):
                        f = filter_tensors(batch, FILTER_SETTINGS["k50 p0.9"])
                        return lambda: sort_filter(inp["target_logits"], inp["temperature"], row_to_request,
                                                   f["top_k"], f["top_p"])

                    def sort_then_triton(inp):
                        f = filter_tensors(batch, FILTER_SETTINGS["k50 p0.9"])
                        ones = torch.ones_like(inp["temperature"])

                        def run():
                            masked = sort_filter(inp["target_logits"], inp["temperature"], row_to_request,
                                                 f["top_k"], f["top_p"])
                            return specdec_kernels.rejection_sample(
                                masked, inp["draft_token_ids"], inp["cu_num_draft_tokens"], inp["draft_probs"], ones,
                                inp["seeds"], inp["offsets"], k, backend="triton")
                        return run

                    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
                    if not cuda_built:
                        backends = [b for b in backends if b != "cuda"]
                    variants = []
                    for backend in backends:
                        variants.append((backend, lambda inp, be=backend: op_call(inp, k, be)))
                        variants += [(f"{backend} {name}",
                                      lambda inp, s=s, be=backend, name=name: op_call(
                                          inputs_for_setting(inp, name), k, be, filter_tensors(batch, s, vocab)))
                                     for name, s in FILTER_SETTINGS.items() if name in settings]
                    if not args.no_sort:
                        variants += [("sort only k50 p0.9", sort_only), ("sort+triton k50 p0.9", sort_then_triton)]
                    knob_runs = [{}]
                    if args.knobs:
                        knob_runs += [dict(cap=cap, tile=tile) for cap in (64, 256, 512, 1024)
                                      for tile in (4, 8, 16) if (cap, tile) != (filter_cfg.cap, filter_cfg.tile)]
                    for spec in filter(None, (r.strip() for r in args.knob_runs.split(";"))):
                        knob_runs.append({n: int(v) for n, v in (kv.split("=") for kv in spec.split())})
                    base_graph = {}
                    for knobs in knob_runs:
                        try:
                            run_cfg = dataclasses.replace(filter_cfg, **knobs)
                        except TypeError as error:
                            raise SystemExit(f"--knob-runs: {error}") from None
                        if knobs:
                            label = " ".join(f"{n}={v}" for n, v in knobs.items())
                            chosen = settings if args.knob_runs else ["k50 p0.9"]
                            todo = [(f"triton {name} {label}",
                                     lambda inp, s=FILTER_SETTINGS[name]: op_call(inp, k, "triton",
                                                                                 filter_tensors(batch, s)))
                                    for name in chosen]
                        else:
                            todo = variants
                        with config.use(verify_cfg, run_cfg):
                            for name, make in todo:
                                eager = time_eager(make(sets[0]))
                                graph = time_graph([make(s) for s in sets])
                                graph1 = time_graph([make(sets[0])])
                                host = time_host(make(sets[0]))
                                if name in ("triton", "cuda", "auto"):
                                    base_graph[name] = graph
                                base = base_graph.get(name.split()[0]) or base_graph.get("triton")
                                row = dict(info, tag=args.tag, variant=name, B=batch, K=k, V=vocab, logits_dtype=dtype,
                                           draft_probs="fp32" if probs else "none", logit_std=scale,
                                           filter_cap=run_cfg.cap, filter_tile=run_cfg.tile,
                                           floor_us=round(floor, 2), graph_us=round(graph, 2), eager_us=round(eager, 2),
                                           graph1_us=round(graph1, 2), host_us=round(host, 2),
                                           graph_over_floor=round(graph / floor, 3),
                                           vs_unfiltered=round(graph / base, 3) if base else float("nan"),
                                           eager_vs_graph_us=round(eager - graph, 2),
                                           bandwidth_TBps=round(bandwidth / 1e12, 3))
                                rows.append(row)
                                print(f"B={batch:4d} K={k} V={vocab} {dtype} draft={row['draft_probs']:4s} "
                                      f"std={scale:g} {name:34s} graph {graph:8.1f} us ({graph / floor:5.2f}x floor, "
                                      f"{row['vs_unfiltered']:5.2f}x unfiltered)  eager {eager:8.1f} us  "
                                      f"graph1 {graph1:8.1f} us  host {host:6.1f} us", flush=True)
                    if args.breakdown:
                        for name, make in variants:
                            if name.startswith("sort"):
                                continue
                            for label, us in kernel_breakdown([make(s) for s in sets]):
                                print(f"  breakdown B={batch} {dtype} draft={'fp32' if probs else 'none'} {name:22s} "
                                      f"{label:34s} {us:8.1f} us/call", flush=True)
                    del sets
                    torch.cuda.empty_cache()

    write_csv(os.path.join(args.out, f"bench_filters{'_' + args.tag if args.tag else ''}.csv"), result_rows(rows))
    lines = [f"Card: {info['card']} (copy {bandwidth / 1e12:.2f} TB/s), torch {info['torch']}, "
             f"triton {info['triton']}, commit {info['commit']}. K = {k}. Times in us; graph = GPU time per call in a "
             "CUDA graph; (x) = graph time over the same backend's unfiltered graph time (the bar: <= 2x).", "",
             "| V | B | logits | draft | std | variant | floor | graph | vs unfiltered | eager | graph1 | host |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['V']} | {r['B']} | {r['logits_dtype']} | {r['draft_probs']} | {r['logit_std']:g} | {r['variant']} | "
                     f"{r['floor_us']:.1f} | {r['graph_us']:.1f} | {r['vs_unfiltered']:.2f}x | {r['eager_us']:.1f} | "
                     f"{r['graph1_us']:.1f} | {r['host_us']:.1f} |")
    table = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, f"bench_filters{'_' + args.tag if args.tag else ''}.md"), "w") as f:
        f.write(table)
    print(table)
    for r in rows:
        if r["variant"].startswith("sort") or r["variant"] in ("triton", "cuda", "auto"):
            continue
        missed = [what for what, bad in (("2x", r["vs_unfiltered"] > 2.0), ("eager +10us", r["eager_vs_graph_us"] > 10))
                  if bad]
        if missed:
            print(f"# MISSED {', '.join(missed)}: B={r['B']} V={r['V']} {r['logits_dtype']} draft={r['draft_probs']} "
                  f"{r['variant']}: {r['vs_unfiltered']:.2f}x unfiltered, eager {r['eager_us']:.1f} vs graph "
                  f"{r['graph_us']:.1f} us")


if __name__ == "__main__":
    main()
