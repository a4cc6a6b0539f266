"""Benchmark of tree verification (torch.ops.specdec.tree_rejection_sample) against its memory floor.

For each configuration (B requests, a fixed draft-tree shape of n nodes, vocabulary V, logits
dtype, draft probabilities given or not) and each fused backend (CUDA C++, Triton) it reports:
- floor_us: every node's target logit row read once (B*n*V*elem) plus, with draft
  probabilities, one draft row per request (the residual's), over the card's measured copy
  bandwidth -- DESIGN.md section 4;
- graph_us: GPU time per call, from a CUDA graph of several calls on distinct input sets
  (replay time / calls; L2 flushed before each replay), i.e. without launch overhead;
- eager_us: a call from Python (do_bench median, L2 flushed before each call);
- the mean number of accepted nodes per request (the trees are built so that walks go a few
  levels deep, as with a good drafter);
- with ``--settings``, the same calls with sampling filters (bench_filters.py's settings, e.g.
  "p0.9,k50 p0.9,minp0.05,kV-64,mixed"; "unfiltered" = none) and ``vs_unfiltered``, the graph
  time over the same backend's unfiltered call (issue #36's 2x bound); ``--temperature`` and
  ``--scale`` set every request's temperature and the logits' standard deviation.

No reference is run: only the kernels are timed. Writes <out>/bench_tree_rejection_sample.csv
(the long format of results_csv.py, one row per time; append it to benchmarks/results/tree.csv
with `python benchmarks/results_csv.py append`) and <out>/bench_tree_rejection_sample.md.

    python benchmarks/bench_tree_rejection_sample.py --out bench_out
    python benchmarks/bench_tree_rejection_sample.py --out bench_out --backends cuda --greedy
    # issue #36's tree cells: filtered trees, T = 0.8, N(0, 3^2) logits
    python benchmarks/bench_tree_rejection_sample.py --out bench_out --backends cuda --nodes 8,64 \
        --batches 1,8,32,64,128 --temperature 0.8 --scale 3 --settings "unfiltered,p0.9,k50 p0.9,minp0.05,mixed"
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results_csv  # noqa: E402
import specdec_kernels  # noqa: E402
from bench_rejection_sample import (  # noqa: E402
    DTYPES, copy_bandwidth, time_eager, time_graph, versions, write_csv)
from bench_filters import FILTER_SETTINGS, filter_tensors, inputs_for_setting  # noqa: E402
from specdec_kernels import _ops as ops  # noqa: E402
from specdec_kernels.triton import config as triton_config  # noqa: E402

# Draft-tree shapes (parents, local indices, parent < child): EAGLE / Medusa-like trees that
# branch most near the root.
TREES = {
    8: [-1, 0, 0, 0, 1, 1, 2, 4],                                  # depth 3
    16: [-1, 0, 0, 0, 0, 1, 1, 1, 2, 2, 3, 5, 5, 6, 8, 11],         # depth 4
    64: None,  # depth 6, the tree issue's bar shape: built below
}


def _bar_tree() -> list[int]:
    """64 nodes, depth 6: root with 4 children, then nodes of each level in order get children
    (4, 4, 3, 3, 2, 2, 1, ...) until the level budget (4, 12, 18, 14, 10, 5 nodes per level) is spent."""
    parents, level = [-1], [0]
    for budget in (4, 12, 18, 14, 10, 5):
        nxt = []
        for i, node in enumerate(level):
            for _ in range(max(4 - i // 2, 1)):
                if len(nxt) < budget:
                    parents.append(node)
                    nxt.append(len(parents) - 1)
        level = nxt
    assert len(parents) == 64, len(parents)
    return parents


TREES[64] = _bar_tree()


def tree_depth(parents: list[int]) -> int:
    depth = [0] * len(parents)
    for j in range(1, len(parents)):
        depth[j] = depth[parents[j]] + 1
    return max(depth)


def make_inputs(batch, parents, vocab, dtype, draft_probs, greedy, seed, temperature=1.0, scale=2.0, device="cuda"):
    """B copies of one tree shape with random target rows (N(0, scale^2)). Deterministic drafts:
    each node's children are the top tokens of a perturbed copy of its row (distinct), boosted in
    the target row so that walks go deep; draft probabilities: the children are drawn from the
    perturbed softmax."""
    g = torch.Generator(device=device).manual_seed(seed)
    n = len(parents)
    total = batch * n
    logits = torch.randn(total, vocab, device=device, generator=g) * scale
    perturbed = logits + torch.randn(total, vocab, device=device, generator=g)
    local_parent = torch.tensor(parents, device=device)
    offsets_of = torch.arange(batch, device=device).repeat_interleave(n) * n
    parent_row = (local_parent.clamp(min=0).repeat(batch) + offsets_of)  # the root's is unused
    probs = None
    if draft_probs:
        probs = torch.softmax(perturbed, -1)
        tokens = torch.multinomial(probs[parent_row], 1, generator=g).squeeze(1)
    else:
        rank = torch.zeros(n, dtype=torch.long)
        for j in range(1, n):  # the child's rank among its siblings
            rank[j] = sum(1 for i in range(1, j) if parents[i] == parents[j])
        kmax = int(rank.max()) + 1
        top = perturbed.topk(kmax, -1).indices
        tokens = top[parent_row, rank.to(device).repeat(batch)]
        # A good drafter's children are likely under the target: boost them in the parent row.
        child = (local_parent >= 0).repeat(batch)
        logits.index_put_((parent_row[child], tokens[child]), torch.full_like(tokens[child], 4, dtype=logits.dtype),
                          accumulate=True)
    return dict(
        target_logits=logits.to(dtype),
        tokens=tokens,
        parents=torch.tensor(parents, dtype=torch.int32, device=device).repeat(batch),
        cu_num_nodes=torch.arange(0, (batch + 1) * n, n, dtype=torch.int32, device=device),
        draft_probs=probs,
        temperature=torch.full((batch,), 0.0 if greedy else temperature, device=device),
        seeds=torch.arange(batch, device=device, dtype=torch.int64) + 1000 * seed,
        offsets=torch.zeros(batch, device=device, dtype=torch.int64),
        max_depth=tree_depth(parents),
    )


def tree_call(inp, backend, filters: dict | None = None):
    """The op on one input set (filters: top_k / top_p / min_p tensors), as a zero-argument callable."""
    return lambda: specdec_kernels.tree_rejection_sample(
        inp["target_logits"], inp["tokens"], inp["parents"], inp["cu_num_nodes"], inp["draft_probs"],
        inp["temperature"], inp["seeds"], inp["offsets"], inp["max_depth"], backend=backend, **(filters or {}))


def setting_call(inp, backend, setting: str, batch: int, vocab: int):
    """tree_call with bench_filters' filter setting `setting` ("unfiltered": none; "mixed" also
    makes every fourth request greedy)."""
    if setting == "unfiltered":
        return tree_call(inp, backend)
    filters = filter_tensors(batch, FILTER_SETTINGS[setting], vocab, device=inp["target_logits"].device)
    return tree_call(inputs_for_setting(inp, setting), backend, filters)


def floor_us(batch, nodes, vocab, dtype, draft_probs, bandwidth) -> float:
    nbytes = batch * nodes * vocab * DTYPES[dtype].itemsize
    if draft_probs:
        nbytes += batch * vocab * 4
    return nbytes / bandwidth * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--backends", default=None, help="comma list; default: every built GPU backend of the tree op")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--nodes", default="8,16", help=f"tree shapes by node count, of {sorted(TREES)}")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    ap.add_argument("--greedy", action="store_true", help="temperature 0 (default: --temperature)")
    ap.add_argument("--temperature", type=float, default=1.0, help="every request's temperature")
    ap.add_argument("--scale", type=float, default=2.0, help="the target logits' standard deviation")
    ap.add_argument("--settings", default="unfiltered",
                    help=f"comma list of filter settings: unfiltered, or of {list(FILTER_SETTINGS)}")
    ap.add_argument("--max-graph-calls", type=int, default=16)
    args = ap.parse_args()
    settings = [name.strip() for name in args.settings.split(",")]
    unknown = [name for name in settings if name != "unfiltered" and name not in FILTER_SETTINGS]
    if unknown:
        ap.error(f"unknown --settings {unknown}; choose from unfiltered, {list(FILTER_SETTINGS)}")
    os.makedirs(args.out, exist_ok=True)
    status = specdec_kernels.available_backends(ops.TREE_REJECTION_SAMPLE)
    backends = args.backends.split(",") if args.backends else \
        [b for b in ("cuda", "triton") if status[b] == "available"]
    info = versions()
    bandwidth = copy_bandwidth()
    print(f"# {info['card']}: copy bandwidth {bandwidth / 1e12:.2f} TB/s; torch {info['torch']}, "
          f"triton {info['triton']}, commit {info['commit']}; backends {backends}; {status}", flush=True)

    rows = []
    configs = itertools.product([int(b) for b in args.batches.split(",")], [int(n) for n in args.nodes.split(",")],
                                [False, True])
    for batch, nodes, probs in configs:
        parents = TREES[nodes]
        floor = floor_us(batch, nodes, args.vocab, args.dtype, probs, bandwidth)
        set_bytes = batch * nodes * args.vocab * (DTYPES[args.dtype].itemsize + (4 if probs else 0))
        n_sets = max(2, min(args.max_graph_calls, int(4e9 // max(set_bytes, 1))))
        sets = [make_inputs(batch, parents, args.vocab, DTYPES[args.dtype], probs, args.greedy, seed,
                            args.temperature, args.scale)
                for seed in range(n_sets)]
        unfiltered_graph = {}  # backend -> its unfiltered graph time in this configuration
        for backend, setting in itertools.product(backends, settings):
            _, _, num = setting_call(sets[0], backend, setting, batch, args.vocab)()
            accepted = num.float().mean().item()
            eager = time_eager(setting_call(sets[0], backend, setting, batch, args.vocab))
            graph = time_graph([setting_call(s, backend, setting, batch, args.vocab) for s in sets])
            if setting == "unfiltered":
                unfiltered_graph[backend] = graph
            base = unfiltered_graph.get(backend)
            row = dict(info, backend=backend, B=batch, nodes=nodes, depth=tree_depth(parents), V=args.vocab,
                       logits_dtype=args.dtype, draft_probs="fp32" if probs else "none",
                       temperature=0.0 if args.greedy else args.temperature, logit_std=args.scale,
                       filters=setting, mean_accepted=round(accepted, 3),
                       floor_us=round(floor, 2), graph_us=round(graph, 2), eager_us=round(eager, 2),
                       graph_over_floor=round(graph / floor, 3), eager_over_floor=round(eager / floor, 3),
                       vs_unfiltered=round(graph / base, 3) if base else float("nan"),
                       bandwidth_TBps=round(bandwidth / 1e12, 3))
            rows.append(row)
            print(f"B={batch:3d} nodes={nodes:2d} V={args.vocab} {args.dtype} draft={row['draft_probs']:4s} "
                  f"{backend:7s} {setting:12s} floor {floor:7.1f} us  graph {graph:8.1f} us ({graph / floor:5.2f}x"
                  f"{f', {graph / base:5.2f}x unfiltered' if base else ''})  eager {eager:8.1f} us  "
                  f"accepted {accepted:.2f}", flush=True)
        del sets
        torch.cuda.empty_cache()

    run = results_csv.run_info("tree")
    write_csv(os.path.join(args.out, "bench_tree_rejection_sample.csv"),
              results_csv.long_rows([dict(run, op="tree", method="token", **r) for r in rows],
                                    {"graph": "graph_us", "eager": "eager_us"},
                                    drop=("graph_over_floor", "eager_over_floor")))
    table = markdown_table(rows, info, bandwidth)
    with open(os.path.join(args.out, "bench_tree_rejection_sample.md"), "w") as f:
        f.write(table)
    print(table)


def markdown_table(rows, info, bandwidth) -> str:
    by_key = {(r["B"], r["nodes"], r["draft_probs"], r["filters"], r["backend"]): r for r in rows}
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    first = rows[0]
    lines = [f"Card: {info['card']} (copy {bandwidth / 1e12:.2f} TB/s), torch {info['torch']}, triton {info['triton']}, "
             f"commit {info['commit']}. V = {first['V']}, {first['logits_dtype']} logits, temperature "
             f"{first['temperature']}. Times in us; graph = GPU time per call in a CUDA graph, eager = called from "
             "Python; (x) = ratio to the floor; [x] = ratio to the same backend's unfiltered graph time.", ""]
    head = "| B | nodes | draft | filters | floor |" + "".join(f" {b} graph | {b} eager |" for b in backends) + " accepted |"
    lines += [head, "|" + "---|" * (6 + 2 * len(backends))]
    for key in dict.fromkeys(k[:4] for k in by_key):
        base = next(by_key[key + (b,)] for b in backends if key + (b,) in by_key)
        cells = [str(key[0]), str(key[1]), key[2], key[3], f"{base['floor_us']:.1f}"]
        for b in backends:
            r = by_key.get(key + (b,))
            ratio = "" if r is None or key[3] == "unfiltered" else f" [{r['vs_unfiltered']:.2f}x]"
            cells += ["", ""] if r is None else [f"{r['graph_us']:.1f} ({r['graph_over_floor']:.2f}x){ratio}",
                                                 f"{r['eager_us']:.1f}"]
        cells.append(f"{base['mean_accepted']:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    with triton_config.use(*triton_config.from_env()):  # SPECDEC_TRITON_* knobs: benchmarks/README.md
        main()
