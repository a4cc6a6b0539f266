"""Vocabulary-parallel verification vs all-gather + the single-device op, over torch.distributed.

Each rank holds a contiguous vocabulary shard of the target logits (V split over the ranks,
ragged when V is not divisible). Per configuration (op chain / tree, B requests, K drafts
or a tree of depth K, draft probabilities or not) it times, on every rank:

- vp_us: ``specdec_kernels.distributed.{tree_,}rejection_sample_vocab_parallel`` on the shards
  (a few collectives of O(nodes) numbers);
- gather_us: the engines' way: all_gather of the logit shards (all_gather_into_tensor of
  equal-size padded shards, then the shards laid side by side into [rows, V]) and the
  single-device op (``backend``: auto = the CUDA kernel when built, else Triton; CPU: the
  reference). Draft probabilities are taken as replicated on every rank (not gathered),
  which favours the baseline;
- allgather_us: the all-gather and the concatenation alone.

Timing: CUDA events around one eager call (``--iters`` calls after ``--warmup``, barrier and
synchronize before each, so a call includes its Python and launch overhead), median per
rank, the largest median over the ranks reported. ``--graph`` also times both from CUDA
graphs (NCCL collectives captured; replay time / calls), i.e. the GPU time without launch
overhead. On CPU (gloo) perf_counter replaces the events.

It also checks, for ``--check-seeds`` seeds per configuration, that every rank returns the
same outputs and that they equal the single-device op's on the gathered logits (a request
matches when all its outputs match; float near-ties may flip a rare one), and counts the
host synchronizations inside one vocab-parallel call (torch.cuda.set_sync_debug_mode).

Writes <out>/bench_distributed.csv (the long format of results_csv.py: one row per timed thing
and mode -- backend vocab-parallel, all-gather + <op backend>, all-gather alone; graph / eager --
with card, versions, NCCL, TP and commit; append it to benchmarks/results/distributed.csv with
`python benchmarks/results_csv.py append`) and <out>/bench_distributed.md, and prints the table.

    torchrun --nproc-per-node 2 benchmarks/bench_distributed.py --out bench_out
    torchrun --nproc-per-node 2 benchmarks/bench_distributed.py --out bench_out --graph
    torchrun --nproc-per-node 2 benchmarks/bench_distributed.py --device cpu --out /tmp/smoke   # gloo smoke test
    SPECDEC_VP_TRITON=0 torchrun ...   # the vocab-parallel op's torch path (before the fused kernels)
    TRITON_INTERPRET=1 SPECDEC_VP_TRITON=1 torchrun --nproc-per-node 2 benchmarks/bench_distributed.py \
        --device cpu --ops chain,tree --batches 2 --vocab 600 --warmup 0 --iters 1 --out /tmp/smoke   # fused paths, CPU
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist

import results_csv  # benchmarks/results_csv.py: the script's directory is on sys.path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import specdec_kernels  # noqa: E402
from specdec_kernels import _ops as ops  # noqa: E402
from specdec_kernels.backends import resolve_backend  # noqa: E402
from specdec_kernels.distributed import (  # noqa: E402
    rejection_sample_vocab_parallel,
    tree_rejection_sample_vocab_parallel,
)
from specdec_kernels.triton import config as triton_config  # noqa: E402

# all_gather_into_tensor was renamed all_gather_single (torch 2.14 deprecates the old name).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Default tree (local parents): root with 3 children, depth 4 along 0-1-4-7-8; 9 nodes.
DEFAULT_TREE = "-1,0,0,0,1,1,2,4,7"


def shard_bounds(vocab: int, world: int) -> list[tuple[int, int]]:
    base, extra = divmod(vocab, world)
    bounds, start = [], 0
    for r in range(world):
        size = base + (r < extra)
        bounds.append((start, start + size))
        start += size
    return bounds


def tree_shape(parents: list[int]) -> tuple[list[int], int, int]:
    """(sibling rank of each node, max children, depth) of one request's tree."""
    assert parents[0] == -1 and all(0 <= p < i for i, p in enumerate(parents) if i), "bad --tree-parents"
    seen: dict[int, int] = {}
    rank = [0] * len(parents)
    depth = [0] * len(parents)
    for i, p in enumerate(parents[1:], 1):
        rank[i] = seen.get(p, 0)
        seen[p] = rank[i] + 1
        depth[i] = depth[p] + 1
    return rank, max(seen.values(), default=0), max(depth)


def make_inputs(op, batch, k, vocab, dtype, probs, seed, device, tree_parents):
    """Full (unsharded) inputs, identical on every rank: target logits, and a draft close to the
    target (acceptance ~0.5-0.7); chain drafts sampled from it (probs) or its argmax; tree
    children sampled i.i.d. from the parent's draft row (probs) or its top-k (deterministic)."""
    g = torch.Generator(device=device).manual_seed(seed)
    if op == "chain":
        rows = batch * (k + 1)
        logits = torch.randn(batch, k + 1, vocab, device=device, generator=g) * 2
        draft = torch.softmax(logits[:, :k] + torch.randn(batch, k, vocab, device=device, generator=g), -1)
        ids = torch.multinomial(draft.reshape(-1, vocab), 1, generator=g).view(-1) if probs else \
            draft.argmax(-1).reshape(-1)
        cu = torch.arange(0, (batch + 1) * k, k, dtype=torch.int32, device=device)
        return dict(logits=logits.reshape(rows, vocab).to(dtype), ids=ids, cu=cu,
                    probs=draft.reshape(batch * k, vocab) if probs else None, width=k, max_children=None)
    parents = torch.tensor(tree_parents, dtype=torch.int32)
    n = len(tree_parents)
    sib_rank, max_children, _ = tree_shape(tree_parents)
    logits = torch.randn(batch * n, vocab, device=device, generator=g) * 2
    draft = torch.softmax(logits + torch.randn(batch * n, vocab, device=device, generator=g), -1)
    par_g = (torch.arange(batch)[:, None] * n + parents.clamp(min=0)[None, :]).reshape(-1).to(device)
    if probs:
        tokens = torch.multinomial(draft[par_g], 1, generator=g).view(-1)
    else:
        top = draft.topk(max(max_children, 1), -1).indices  # [rows, max_children]
        tokens = top[par_g, torch.tensor(sib_rank, device=device).repeat(batch)]
    tokens = tokens.view(batch, n)
    tokens[:, 0] = 0  # the root's token is not read
    cu = torch.arange(0, (batch + 1) * n, n, dtype=torch.int32, device=device)
    return dict(logits=logits.to(dtype), ids=tokens.reshape(-1), parents=parents.repeat(batch).to(device), cu=cu,
                probs=draft if probs else None, width=k, max_children=max_children)


def versions(device) -> dict:
    commit = results_csv.commit()  # $SPECDEC_COMMIT, else the checkout's HEAD
    cuda = device.type == "cuda"
    nccl = "-"
    if cuda:
        v = torch.cuda.nccl.version()
        nccl = ".".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v)
    # the vocab-parallel path: auto = fused Triton kernels on CUDA tensors; 0 = the torch path
    # everywhere; 1 = Triton forced on CPU tensors too (with TRITON_INTERPRET=1)
    vp_path = os.environ.get("SPECDEC_VP_TRITON", "auto")
    return dict(card=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__,
                cuda=torch.version.cuda if cuda else "-", nccl=nccl, commit=commit, vp_path=vp_path)


def concrete_backend(backend, device, op) -> str:
    """The backend the single-device op runs ("auto" resolved as torch.ops dispatches it)."""
    name = ops.TREE_REJECTION_SAMPLE if op == "tree" else ops.REJECTION_SAMPLE
    backend = resolve_backend(backend, device, name)
    if backend != "auto":
        return backend
    if device.type != "cuda":
        return "reference"
    return "cuda" if ops.cuda_kernel_built(name) else "triton"


class Case:
    """One configuration's inputs on this rank and its two callables."""

    def __init__(self, op, batch, k, vocab, dtype, probs, seed, device, args, rank, world):
        self.op, self.batch, self.k, self.vocab = op, batch, k, vocab
        full = make_inputs(op, batch, k, vocab, dtype, probs, seed, device, args.tree_parents)
        bounds = shard_bounds(vocab, world)
        self.lo, self.hi = bounds[rank]
        self.width = max(h - lo for lo, h in bounds)
        self.sizes = [h - lo for lo, h in bounds]
        self.full_logits = full["logits"]
        self.shard = full["logits"][:, self.lo:self.hi].contiguous()
        self.probs = full["probs"]
        self.probs_shard = None if full["probs"] is None else full["probs"][:, self.lo:self.hi].contiguous()
        self.ids, self.cu, self.parents = full["ids"], full["cu"], full.get("parents")
        self.max_children = full["max_children"]
        self.temperature = torch.ones(batch, device=device)
        self.temperature[::4] = 0.0  # every fourth request greedy
        self.seeds = torch.arange(batch, device=device, dtype=torch.int64) + 1000 * seed
        self.offsets = torch.zeros(batch, dtype=torch.int64, device=device)
        rows = self.shard.shape[0]
        self.gather_buf = torch.empty(world * rows, self.width, dtype=self.shard.dtype, device=device)
        self.padded = torch.zeros(rows, self.width, dtype=self.shard.dtype, device=device)
        self.backend = args.backend
        self.world = world

    def vocab_parallel(self):
        if self.op == "chain":
            return rejection_sample_vocab_parallel(
                self.shard, self.ids, self.cu, self.probs_shard, self.temperature, self.seeds, self.offsets, self.k,
                vocab_start=self.lo, vocab_size=self.vocab)
        return tree_rejection_sample_vocab_parallel(
            self.shard, self.ids, self.parents, self.cu, self.probs_shard, self.temperature, self.seeds, self.offsets,
            self.k, vocab_start=self.lo, vocab_size=self.vocab, max_children=self.max_children)

    def all_gather(self):
        """[rows, V]: every rank's shard side by side (padded shards of equal size on the wire)."""
        self.padded[:, :self.hi - self.lo].copy_(self.shard)
        _all_gather_single(self.gather_buf, self.padded)
        rows = self.shard.shape[0]
        buf = self.gather_buf.view(self.world, rows, self.width)
        if all(s == self.width for s in self.sizes):
            return buf.permute(1, 0, 2).reshape(rows, self.vocab)
        return torch.cat([buf[w, :, :s] for w, s in enumerate(self.sizes)], -1)

    def single_device(self, logits):
        if self.op == "chain":
            return specdec_kernels.rejection_sample(logits, self.ids, self.cu, self.probs, self.temperature, self.seeds,
                                                    self.offsets, self.k, backend=self.backend)
        return specdec_kernels.tree_rejection_sample(logits, self.ids, self.parents, self.cu, self.probs,
                                                     self.temperature, self.seeds, self.offsets, self.k,
                                                     backend=self.backend)

    def gather_then_op(self):
        return self.single_device(self.all_gather())


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_eager(fn, device, warmup, iters) -> float:
    """Median microseconds of one call on this rank."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        sync(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def time_graph(fn, device, warmup, iters, calls=8) -> float:
    """Microseconds per call replaying a CUDA graph of ``calls`` calls; NaN (on every rank) if
    any rank fails to capture."""
    for _ in range(warmup):
        fn()
    sync(device)
    ok = torch.ones(1, device=device)
    graph = torch.cuda.CUDAGraph()
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(calls):
                    fn()
        torch.cuda.current_stream().wait_stream(stream)
    except Exception as e:  # noqa: BLE001 -- reported, then every rank skips the replay together
        print(f"# rank {dist.get_rank()}: graph capture failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        ok.zero_()
    sync(device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if ok.item() < 1:
        return float("nan")
    times = []
    for _ in range(iters):
        dist.barrier()
        sync(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    graph.reset()  # frees the graph's memory pool
    return statistics.median(times)


def max_over_ranks(value: float, device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    t = torch.nan_to_num(t, nan=float("inf"))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    v = float(t.item())
    return float("nan") if v == float("inf") else v


def check(case: Case, device) -> tuple[int, int, bool]:
    """(requests matching the single-device op, requests, every rank returned the same)."""
    got = case.vocab_parallel()
    ref = case.single_device(case.full_logits)  # the same logits, never gathered: no collective
    same = torch.ones(case.batch, dtype=torch.bool, device=device)
    for a, b in zip(got, ref):
        same &= (a == b).reshape(case.batch, -1).all(1)
    flat = torch.cat([t.reshape(-1).to(torch.int64) for t in got])
    gathered = [torch.empty_like(flat) for _ in range(case.world)]
    dist.all_gather(gathered, flat)
    agree = all(torch.equal(g, gathered[0]) for g in gathered)
    return int(same.sum()), case.batch, agree


def count_syncs(fn, device) -> int:
    """Host synchronizations inside one call (CUDA only; -1 on CPU). Warn mode, never raise:
    every rank must still reach every collective."""
    if device.type != "cuda":
        return -1
    sync(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sync(device)
    return sum("synchroniz" in str(w.message) for w in caught)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--ops", default="chain,tree")
    ap.add_argument("--batches", default=None, help="comma list (default 1,8,32,128; CPU: 1,4)")
    ap.add_argument("--k", type=int, default=4, help="chain drafts per request / tree depth limit")
    ap.add_argument("--vocab", type=int, default=None, help="default 128256 (CPU: 1000)")
    ap.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    ap.add_argument("--draft-probs", default="none,fp32", help="comma list of none / fp32")
    ap.add_argument("--tree-parents", default=DEFAULT_TREE, help="local parents of one request's tree")
    ap.add_argument("--backend", default=None, help="single-device op backend (default auto)")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--check-seeds", type=int, default=3)
    ap.add_argument("--graph", action="store_true", help="also time CUDA graphs (NCCL captured)")
    args = ap.parse_args()
    args.tree_parents = [int(p) for p in args.tree_parents.split(",")]
    cpu = args.device == "cpu"
    batches = [int(b) for b in (args.batches or ("1,4" if cpu else "1,8,32,128")).split(",")]
    vocab = args.vocab or (1000 if cpu else 128256)
    warmup = args.warmup if args.warmup is not None else (1 if cpu else 10)
    iters = args.iters if args.iters is not None else (3 if cpu else 50)

    if cpu:
        dist.init_process_group("gloo")
        device = torch.device("cpu")
        torch.set_num_threads(1)
    else:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    info = versions(device)
    single = {op: concrete_backend(args.backend, device, op) for op in ("chain", "tree")}
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"# {world} x {info['card']}, torch {info['torch']}, CUDA {info['cuda']}, NCCL {info['nccl']}, "
              f"commit {info['commit']}; vocab-parallel path {info['vp_path']}; backend {dist.get_backend()}; "
              f"V={vocab} split {shard_bounds(vocab, world)}; "
              f"single-device op backend {single}; tree parents {args.tree_parents}", flush=True)

    rows = []
    for op in args.ops.split(","):
        nodes = len(args.tree_parents) if op == "tree" else args.k + 1
        for probs_name in args.draft_probs.split(","):
            probs = probs_name == "fp32"
            for batch in batches:
                case = Case(op, batch, args.k, vocab, DTYPES[args.dtype], probs, 0, device, args, rank, world)
                matched = total = 0
                agree = True
                for seed in range(args.check_seeds):
                    c = case if seed == 0 else Case(op, batch, args.k, vocab, DTYPES[args.dtype], probs, seed,
                                                    device, args, rank, world)
                    m, t, a = check(c, device)
                    matched, total, agree = matched + m, total + t, agree and a
                syncs = count_syncs(case.vocab_parallel, device)
                vp = max_over_ranks(time_eager(case.vocab_parallel, device, warmup, iters), device)
                gather = max_over_ranks(time_eager(case.gather_then_op, device, warmup, iters), device)
                ag = max_over_ranks(time_eager(case.all_gather, device, warmup, iters), device)
                row = dict(op=op, B=batch, K=args.k, nodes_per_request=nodes, V=vocab, world=world,
                           logits_dtype=args.dtype, draft_probs=probs_name, vp_us=round(vp, 1),
                           gather_us=round(gather, 1), allgather_us=round(ag, 1),
                           speedup=round(gather / vp, 2))
                if args.graph and not cpu:
                    vpg = max_over_ranks(time_graph(case.vocab_parallel, device, warmup, iters), device)
                    gg = max_over_ranks(time_graph(case.gather_then_op, device, warmup, iters), device)
                    row.update(vp_graph_us=round(vpg, 1), gather_graph_us=round(gg, 1),
                               graph_speedup=round(gg / vpg, 2))
                row.update(matched=f"{matched}/{total}", ranks_agree=agree, vp_host_syncs=syncs,
                           single_backend=single[op], **info)
                rows.append(row)
                if rank == 0:
                    graph = f"  graph vp {row['vp_graph_us']:8.1f} gather {row['gather_graph_us']:8.1f}" \
                        if "vp_graph_us" in row else ""
                    print(f"{op:5s} B={batch:4d} nodes/req={nodes:2d} draft={probs_name:4s}  vp {vp:8.1f} us  "
                          f"gather+op {gather:8.1f} us (all-gather {ag:8.1f})  x{gather / vp:5.2f}{graph}  "
                          f"match {matched}/{total} agree={agree} syncs={syncs}", flush=True)
                del case
                if not cpu:
                    torch.cuda.empty_cache()

    if rank == 0:
        results_csv.write(os.path.join(args.out, "bench_distributed.csv"), result_rows(rows))
        table = markdown_table(rows, info, world)
        with open(os.path.join(args.out, "bench_distributed.md"), "w") as f:
            f.write(table)
        print(table, flush=True)
    dist.barrier()
    if not args.graph:  # destroying a group after NCCL graph capture can hang (pytorch#115388)
        dist.destroy_process_group()


def result_rows(rows: list[dict]) -> list[dict]:
    """The rows in the long format of results_csv: one row per timed thing and mode. Every row has
    the same columns (the graph columns empty without --graph), so runs concatenate."""
    run = results_csv.run_info("distributed")
    out = []
    for r in rows:
        base = dict(run, card=r["card"], torch=r["torch"], cuda=r["cuda"], commit=r["commit"], op=r["op"],
                    method="token", B=r["B"], K=r["K"] if r["op"] == "chain" else "", nodes=r["nodes_per_request"],
                    V=r["V"], logits_dtype=r["logits_dtype"], draft_probs=r["draft_probs"], floor_us="",
                    tp=r["world"], nccl=r["nccl"], vp_path=r["vp_path"], single_backend=r["single_backend"],
                    matched=r["matched"], ranks_agree=r["ranks_agree"], vp_host_syncs=r["vp_host_syncs"])
        for backend, times in (("vocab-parallel", {"graph": "vp_graph_us", "eager": "vp_us"}),
                               (f"all-gather + {r['single_backend']}", {"graph": "gather_graph_us",
                                                                        "eager": "gather_us"}),
                               ("all-gather alone", {"eager": "allgather_us"})):
            out += results_csv.long_rows([dict(base, backend=backend, **{k: r.get(k) for k in times.values()})],
                                         times)
    return out


def markdown_table(rows, info, world) -> str:
    graph = any("vp_graph_us" in r for r in rows)
    head = (f"{world} x {info['card']}, torch {info['torch']}, CUDA {info['cuda']}, NCCL {info['nccl']}, "
            f"commit {info['commit']}; vocab-parallel path {info['vp_path']}; "
            f"times in us, eager (median per rank, max over ranks)\n\n")
    cols = ["op", "B", "nodes/req", "draft", "vocab-parallel", "all-gather + op", "all-gather alone", "speedup"]
    if graph:
        cols += ["vp graph", "gather graph"]
    cols += ["match", "ranks agree", "host syncs"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        vals = [r["op"], r["B"], r["nodes_per_request"], r["draft_probs"], r["vp_us"], r["gather_us"],
                r["allgather_us"], r["speedup"]]
        if graph:
            vals += [r.get("vp_graph_us", ""), r.get("gather_graph_us", "")]
        vals += [r["matched"], r["ranks_agree"], r["vp_host_syncs"]]
        lines.append("| " + " | ".join(str(v) for v in vals) + " |")
    return head + "\n".join(lines) + "\n"


if __name__ == "__main__":
    with triton_config.use(*triton_config.from_env()):  # SPECDEC_TRITON_* knobs: benchmarks/README.md
        main()
