"""Sweep the CUDA kernels' work decomposition (units per resident CTA) on the bar shapes.

The CUDA plans split every target row into about `units_per_slot x resident CTAs / rows` work
units (csrc/kernels/*.cuh, plan_*). SPECDEC_CUDA_UNITS_PER_SLOT overrides the default; the
extension reads it once per process, so this script times each value in a child process of
its own, for the chain op (K = 4) and the tree op (64-node depth-6 trees), graph-timed like
bench_rejection_sample.py, and writes tune_cuda_plan.csv in the long format of results_csv.py
(the run's SPECDEC_* switches in `knobs`; `SPECDEC_EXPERIMENT=<docs/DECISIONS.md heading>` labels
the rows, and `python benchmarks/results_csv.py append --to benchmarks/results/tuning.csv` keeps
them). Also used to hand `--profile-one` shapes to ncu:

    python benchmarks/tune_cuda_plan.py --out gpu_out
    ncu --clock-control none -k regex:rejection_sample --launch-skip 1 --launch-count 1 \
        python benchmarks/tune_cuda_plan.py --profile-one chain,32,bf16,none

(bash scripts/profile.sh --plan-sweep --ncu runs both.)
"""
import argparse
import csv
import os
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_rejection_sample as chain_bench  # noqa: E402
import bench_tree_rejection_sample as tree_bench  # noqa: E402
import results_csv  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def drop_last_draft(inp, k):
    """The batch with its last request one draft short: a ragged batch of the same size (the
    CUDA chain kernel guesses rows only for uniform batches, num_drafts == B * K)."""
    batch = inp["cu_num_draft_tokens"].numel() - 1
    draft = batch * k - 1  # the last request's last draft, and its target row
    row = draft + batch - 1

    def without(x, i):
        return torch.cat([x[:i], x[i + 1:]])

    out = dict(inp, target_logits=without(inp["target_logits"], row),
               draft_token_ids=without(inp["draft_token_ids"], draft),
               cu_num_draft_tokens=inp["cu_num_draft_tokens"].clone())
    out["cu_num_draft_tokens"][-1] -= 1
    if inp["draft_probs"] is not None:
        out["draft_probs"] = without(inp["draft_probs"], draft)
    return out


def make(op, batch, dtype, probs, seed, vocab, backend="cuda"):
    """op: chain (K = 4, every request with 4 drafts), ragged (the same, the last request with 3)
    or tree (64-node trees)."""
    if op in ("chain", "ragged"):
        inp = chain_bench.make_inputs(batch, 4, vocab, DTYPES[dtype], probs, seed)
        if op == "ragged":
            inp = drop_last_draft(inp, 4)
        return chain_bench.our_call(inp, 4, backend)
    inp = tree_bench.make_inputs(batch, tree_bench.TREES[64], vocab, DTYPES[dtype], probs, False, seed)
    return tree_bench.tree_call(inp, backend)


def floor(op, batch, dtype, probs, vocab, bandwidth):
    if op in ("chain", "ragged"):
        return chain_bench.floor_us(batch, 4, vocab, dtype, probs, bandwidth)
    return tree_bench.floor_us(batch, 64, vocab, dtype, probs, bandwidth)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--units-per-slot", default="1,2,3,4,6,8",
                    help="comma list of SPECDEC_CUDA_UNITS_PER_SLOT values; 'default': the knob unset")
    ap.add_argument("--shapes", help="op,B,dtype,probs[,backend];... (backend cuda unless named; the "
                    "units-per-slot knob only moves the CUDA plans)",
                    default="chain,1,bf16,none;chain,8,bf16,none;chain,32,bf16,none;chain,128,bf16,none;"
                    "chain,32,fp32,fp32;chain,128,fp32,fp32;tree,1,bf16,none;tree,32,bf16,none")
    ap.add_argument("--profile-one", default=None,
                    help="op,B,dtype,probs[,backend]: three eager calls (for ncu), no timing")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # times one value, set in the env
    args = ap.parse_args()
    if args.profile_one:
        op, b, dtype, probs, *backend = args.profile_one.split(",")
        fn = make(op, int(b), dtype, probs != "none", 0, args.vocab, *backend)
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        return
    os.makedirs(args.out, exist_ok=True)
    if not args.child:  # one child process per value: the extension reads the knob once
        rows = []
        for ups in args.units_per_slot.split(","):
            with tempfile.TemporaryDirectory() as tmp:
                env = dict(os.environ, SPECDEC_CUDA_UNITS_PER_SLOT=ups)
                if ups == "default":  # the plan as shipped (its one-wave rule included)
                    env.pop("SPECDEC_CUDA_UNITS_PER_SLOT")
                subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--out", tmp,
                                "--vocab", str(args.vocab), "--units-per-slot", ups, "--shapes", args.shapes],
                               env=env, check=True)
                with open(os.path.join(tmp, "tune_cuda_plan.csv"), newline="") as f:
                    rows += list(csv.DictReader(f))
        chain_bench.write_csv(os.path.join(args.out, "tune_cuda_plan.csv"), rows)
        return
    ups = args.units_per_slot
    info = results_csv.run_info("tune_cuda_plan")
    bandwidth = chain_bench.copy_bandwidth()
    rows = []
    for shape in args.shapes.split(";"):
        op, b, dtype, probs, *backend = shape.split(",")  # backend: cuda unless named
        backend = backend[0] if backend else "cuda"
        batch, has_probs = int(b), probs != "none"
        per_set = batch * (64 if op == "tree" else 5) * args.vocab * (DTYPES[dtype].itemsize + 4 * has_probs)
        n_sets = max(2, min(16, int(4e9 // per_set)))
        fns = [make(op, batch, dtype, has_probs, s, args.vocab, backend) for s in range(n_sets)]
        fl = floor(op, batch, dtype, has_probs, args.vocab, bandwidth)
        us = chain_bench.time_graph(fns)
        shape = dict(op="tree", method="token", B=batch, nodes=64) if op == "tree" else \
            dict(op="chain", method="token", B=batch, K=4, **({"ragged": "yes"} if op == "ragged" else {}))
        rows.append(dict(info, backend=backend, **shape, V=args.vocab, logits_dtype=dtype, draft_probs=probs,
                         units_per_slot=ups, floor_us=round(fl, 2), graph_us=round(us, 2)))
        print(f"{op:5s} {backend:6s} B={batch:4d} {dtype} draft={probs:4s} units/slot {ups:>7s}: "
              f"{us:8.1f} us  floor {fl:7.1f}  ({us / fl:5.2f}x)", flush=True)
        del fns
        torch.cuda.empty_cache()
    chain_bench.write_csv(os.path.join(args.out, "tune_cuda_plan.csv"),
                          results_csv.long_rows(rows, {"graph": "graph_us"}))

if __name__ == "__main__":
    main()
