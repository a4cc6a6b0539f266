"""Benchmark of chain verification against the memory floor and the baselines.

For each configuration (B requests, K drafts each, vocabulary V, logits dtype, draft
probabilities given or not, verification method) it reports:
- floor_us: every target logit row read once (B*(K+1)*V*elem) plus, with draft
  probabilities, one draft row per request (token verification) or every draft row
  (block verification: B*K rows), over the card's measured copy bandwidth (a
  device-to-device copy, bytes read + written) -- DESIGN.md section 4;
- graph_us: GPU time per call, from a CUDA graph of several calls on distinct input sets
  (replay time / calls; L2 flushed before each replay), i.e. without launch overhead;
- eager_us: a call from Python (do_bench median, L2 flushed before each call), which
  includes the Python wrapper and the launch when they exceed the GPU time;
- ratios to the floor and the speedup over the straightforward PyTorch pipeline.

Writes <out>/bench_rejection_sample.csv (the long format of results_csv.py: one row per time, with
card, versions and commit; append it to benchmarks/results/chain.csv with
`python benchmarks/results_csv.py append`), <out>/bench_rejection_sample.md (the table) and
<out>/bench_rejection_sample.png.

    python benchmarks/bench_rejection_sample.py --out bench_out            # the core table
    python benchmarks/bench_rejection_sample.py --sweep full --out bench_out
    python benchmarks/bench_rejection_sample.py --methods token --out bench_out  # token verification only
    python benchmarks/bench_rejection_sample.py --methods token,lenient --out bench_out  # exact vs lenient calls

"lenient" is token verification with lenience = 0.5 for every request (docs/ALGORITHM.md §8;
issue #39: a lenient call must cost at most an exact one, and exact calls must not get slower);
its CSV rows have method "token" and variant "lenience 0.5".

The PyTorch pipeline (and FlashInfer) verify token by token: they are timed in token rows only.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
import triton
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import specdec_kernels  # noqa: E402
from specdec_kernels.triton import config as triton_config  # noqa: E402
from torch_pipeline import flashinfer_pipeline, torch_pipeline  # noqa: E402
import results_csv  # noqa: E402

# Anchors measured on one H200 (copy 4.25 TB/s), K=4, V=128256 -- ../shared/DESIGN.md §4 (also the
# quoted rows of benchmarks/results/chain.csv). (B -> microseconds.) Quoted, not re-measured here.
ANCHORS_H200 = {
    "vLLM MRV2 graph (bf16, no draft)": {1: 11.5, 8: 19.4, 32: 38.2, 64: 62.9, 128: 112.8},
    "vLLM MRV2 eager (bf16, no draft)": {1: 133, 8: 133, 32: 141, 64: 300, 128: 294},
    "FlashInfer softmax+chain graph (fp32 + draft)": {1: 59.8, 8: 99.4, 32: 163.8, 64: 260.2, 128: 387.9},
    "vLLM V1 graph (bf16 + fp32 draft)": {1: 179, 8: 231, 32: 449, 64: 758, 128: 1433},
}

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def write_csv(path: str, rows: list[dict]) -> None:
    """Long-format rows (results_csv.COLUMNS first) as CSV."""
    results_csv.write(path, rows)


def copy_bandwidth() -> float:
    """Bytes/s of a device-to-device copy (read + write), median of do_bench."""
    n = 1 << 29  # 2 GiB of fp32
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=200, return_mode="median")
    del src, dst
    return 2 * n * 4 / (ms * 1e-3)


def make_inputs(batch, k, vocab, dtype, draft_probs, seed):
    """Random target logits; drafts from a perturbed copy of the target (acceptance ~0.5-0.7),
    sampled (with draft probabilities) or its argmax (deterministic drafts)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(batch, k + 1, vocab, device="cuda", generator=g) * 2
    draft_logits = logits[:, :k] + torch.randn(batch, k, vocab, device="cuda", generator=g)
    probs = torch.softmax(draft_logits, -1)
    if draft_probs:
        drafts = torch.multinomial(probs.view(-1, vocab), 1, generator=g).view(batch, k)
    else:
        drafts = probs.argmax(-1)
    cu = torch.arange(0, (batch + 1) * k, k, dtype=torch.int32, device="cuda") if k else \
        torch.zeros(batch + 1, dtype=torch.int32, device="cuda")
    return dict(
        padded_logits=logits.to(dtype),
        padded_drafts=drafts,
        padded_probs=probs if draft_probs else None,
        target_logits=logits.to(dtype).view(batch * (k + 1), vocab),
        draft_token_ids=drafts.reshape(-1),
        cu_num_draft_tokens=cu,
        draft_probs=probs.reshape(batch * k, vocab) if draft_probs else None,
        temperature=torch.ones(batch, device="cuda"),
        seeds=torch.arange(batch, device="cuda", dtype=torch.int64) + seed,
        offsets=torch.zeros(batch, device="cuda", dtype=torch.int64),
    )


LENIENCE = 0.5  # the "lenient" method's value, every request


def our_call(inp, k, backend, method="token"):
    lenience = None
    if method == "lenient":
        method = "token"
        lenience = torch.full_like(inp["temperature"], LENIENCE, dtype=torch.float32)
    return lambda: specdec_kernels.rejection_sample(
        inp["target_logits"], inp["draft_token_ids"], inp["cu_num_draft_tokens"], inp["draft_probs"],
        inp["temperature"], inp["seeds"], inp["offsets"], k, method, lenience=lenience, backend=backend)


def pipeline_call(inp, _k, _backend, _method="token"):
    return lambda: torch_pipeline(inp["padded_logits"], inp["padded_drafts"], inp["padded_probs"], inp["temperature"])


def time_eager(fn) -> float:
    fn()
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def time_graph(fns) -> float:
    """GPU time per call: one graph holding one call per input set."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    ms = triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median")
    return ms * 1e3 / len(fns)


def floor_us(batch, k, vocab, dtype, draft_probs, bandwidth, method="token") -> float:
    """Bytes that must cross HBM once over the copy bandwidth: every target row, and with draft
    probabilities the rejected row's draft row (token) or every draft row (block: each R_i
    needs its own draft row, docs/ALGORITHM.md §6)."""
    nbytes = batch * (k + 1) * vocab * DTYPES[dtype].itemsize
    if draft_probs:
        nbytes += batch * (k if method == "block" else 1) * vocab * 4
    return nbytes / bandwidth * 1e6


def versions() -> dict:
    """card, torch, triton, cuda, commit ($SPECDEC_COMMIT, else the checkout's HEAD): results_csv.versions."""
    return results_csv.versions()


def configs(sweep: str):
    if sweep == "core":
        # bf16 logits with and without draft probabilities (issue #2's table), fp32 + fp32 draft
        # (FlashInfer's inputs).
        pairs = [("bf16", False), ("bf16", True), ("fp32", True)]
        for batch, (dtype, probs) in itertools.product([1, 8, 32, 64, 128], pairs):
            yield batch, 4, 128256, dtype, probs
    else:
        for batch, k, vocab, dtype, probs in itertools.product(
                [1, 8, 32, 128], [1, 4, 8], [32000, 128256, 151936], ["bf16", "fp32"], [False, True]):
            yield batch, k, vocab, dtype, probs


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", choices=["core", "full"], default="core")
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--backends", default=None, help="comma list; default: every built GPU backend + torch")
    ap.add_argument("--max-graph-calls", type=int, default=16)
    ap.add_argument("--methods", default="token,block",
                    help="comma list of verification methods (token, block, lenient = token with lenience "
                         f"{LENIENCE}); default: token,block")
    args = ap.parse_args()
    methods = args.methods.split(",")
    if not methods or any(m not in ("token", "block", "lenient") for m in methods):
        ap.error(f"--methods takes token, block and/or lenient, got {args.methods!r}")
    os.makedirs(args.out, exist_ok=True)
    status = specdec_kernels.available_backends()
    backends = args.backends.split(",") if args.backends else \
        [b for b in ("cuda", "triton") if status[b] == "available"] + ["torch"]
    info = versions()
    bandwidth = copy_bandwidth()
    print(f"# {info['card']}: copy bandwidth {bandwidth / 1e12:.2f} TB/s; torch {info['torch']}, "
          f"triton {info['triton']}, commit {info['commit']}; backends {backends}; {status}", flush=True)
    fi = flashinfer_pipeline()
    if fi is None:
        print("# FlashInfer not installed: its numbers below are the H200 anchors of DESIGN.md, not re-measured")

    rows = []
    for batch, k, vocab, dtype, probs in configs(args.sweep):
        set_bytes = batch * (k + 1) * vocab * (DTYPES[dtype].itemsize + (4 if probs else 0))
        n_sets = max(2, min(args.max_graph_calls, int(4e9 // max(set_bytes, 1))))
        sets = [make_inputs(batch, k, vocab, DTYPES[dtype], probs, seed) for seed in range(n_sets)]
        timed = [(b, our_call if b != "torch" else pipeline_call) for b in backends]
        if fi is not None and probs and dtype == "fp32":
            timed.append(("flashinfer", lambda inp, _k, _b, _m="token": (lambda: fi[0](
                inp["padded_logits"], inp["padded_drafts"], inp["padded_probs"], inp["temperature"]))))
        for method, (backend, make) in itertools.product(methods, timed):
            if method != "token" and backend in ("torch", "flashinfer"):
                continue  # token-by-token verifiers
            floor = floor_us(batch, k, vocab, dtype, probs, bandwidth, "token" if method == "lenient" else method)
            eager = time_eager(make(sets[0], k, backend, method))
            graph = time_graph([make(s, k, backend, method) for s in sets]) if backend != "flashinfer" else float("nan")
            row = dict(info, backend=backend, method=method, B=batch, K=k, V=vocab, logits_dtype=dtype,
                       draft_probs="fp32" if probs else "none", floor_us=round(floor, 2),
                       graph_us=round(graph, 2), eager_us=round(eager, 2),
                       graph_over_floor=round(graph / floor, 3), eager_over_floor=round(eager / floor, 3),
                       bandwidth_TBps=round(bandwidth / 1e12, 3))
            rows.append(row)
            print(f"B={batch:4d} K={k} V={vocab} {dtype} draft={row['draft_probs']:4s} {method:5s} {backend:8s} "
                  f"floor {floor:8.1f} us  graph {graph:8.1f} us ({graph / floor:5.2f}x)  "
                  f"eager {eager:8.1f} us", flush=True)
        del sets
        torch.cuda.empty_cache()

    csv_path = os.path.join(args.out, "bench_rejection_sample.csv")
    run = results_csv.run_info("chain")
    csv_rows = [dict(r, method="token", variant=f"lenience {LENIENCE}") if r["method"] == "lenient" else r
                for r in rows]
    write_csv(csv_path, results_csv.long_rows([dict(run, op="chain", **r) for r in csv_rows],
                                              {"graph": "graph_us", "eager": "eager_us"},
                                              drop=("graph_over_floor", "eager_over_floor")))
    table = markdown_table(rows, info, bandwidth)
    with open(os.path.join(args.out, "bench_rejection_sample.md"), "w") as f:
        f.write(table)
    print(table)
    plot(rows, info, os.path.join(args.out, "bench_rejection_sample.png"))


def markdown_table(rows, info, bandwidth) -> str:
    by_key = {(r["B"], r["K"], r["V"], r["logits_dtype"], r["draft_probs"], r["method"], r["backend"]): r
              for r in rows}
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    lines = [f"Card: {info['card']} (copy {bandwidth / 1e12:.2f} TB/s), torch {info['torch']}, "
             f"triton {info['triton']}, commit {info['commit']}. Times in us; graph = GPU time per call "
             "in a CUDA graph, eager = called from Python; (x) = ratio to the floor of the row's method "
             "(block with draft probabilities reads every draft row).", ""]
    head = "| B | K | V | logits | draft | method | floor |" + "".join(f" {b} graph | {b} eager |" for b in backends)
    lines += [head, "|" + "---|" * (7 + 2 * len(backends))]
    for key in dict.fromkeys(k[:6] for k in by_key):
        first = next(by_key[key + (b,)] for b in backends if key + (b,) in by_key)
        cells = [str(key[0]), str(key[1]), str(key[2]), key[3], key[4], key[5], f"{first['floor_us']:.1f}"]
        for b in backends:
            r = by_key.get(key + (b,))
            if r is None:
                cells += ["", ""]
                continue
            cells.append(f"{r['graph_us']:.1f} ({r['graph_over_floor']:.2f}x)")
            cells.append(f"{r['eager_us']:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (with a message) when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# matplotlib not installed: no plot")
        return None
    return plt


def plot(rows, info, path):
    plt = pyplot()
    if plt is None:
        return
    panels = [("bf16", "none", "bf16 logits, deterministic drafts"), ("fp32", "fp32", "fp32 logits + fp32 draft probs")]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, (dtype, probs, title) in zip(axes, panels):
        sel = [r for r in rows if r["K"] == 4 and r["V"] == 128256 and r["logits_dtype"] == dtype and r["draft_probs"] == probs]
        if not sel:
            continue
        for method, style in (("token", "k--"), ("block", "k:")):
            floor = {r["B"]: r["floor_us"] for r in sel if r["method"] == method}
            if floor and (method == "token" or probs != "none"):  # without draft rows the floors coincide
                ax.plot(sorted(floor), [floor[b] for b in sorted(floor)], style, label=f"memory floor ({method})")
        for backend, method in dict.fromkeys((r["backend"], r["method"]) for r in sel):
            pts = sorted((r["B"], r["graph_us"] if r["graph_us"] == r["graph_us"] else r["eager_us"])
                         for r in sel if r["backend"] == backend and r["method"] == method)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-" if method == "token" else "s--",
                    label=f"{backend} {method} (graph)")
        for name, anchor in ANCHORS_H200.items():
            if ("no draft" in name) == (probs == "none"):
                ax.plot(list(anchor), list(anchor.values()), "x:", alpha=0.6, label=f"{name} [H200, quoted]")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size B (K=4, V=128256)")
        ax.set_ylabel("time per call (us)")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.suptitle(f"specdec_kernels rejection_sample on {info['card']} (commit {info['commit']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    with triton_config.use(*triton_config.from_env()):  # SPECDEC_TRITON_* knobs: benchmarks/README.md
        main()
