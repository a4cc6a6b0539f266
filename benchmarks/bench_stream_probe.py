"""The practical floor of one kernel launch in our timing harness: pure-read probes vs the op.

The op's bar is a ratio to the memory floor (every target logit row read once, plus one fp32
draft row per request with draft probabilities, over the device-to-device copy bandwidth;
bench_rejection_sample.floor_us). But any single kernel that reads those bytes, timed like the
op (a CUDA graph of one call per rotated input set, L2 flushed before each replay:
bench_rejection_sample.time_graph), also pays the launch, the ramp-up to full bandwidth and the
tail of the last wave. These probes read exactly the floor's bytes and nothing else (no
sampling, a tiny output that depends on every byte) and are timed the same way on the same
input sets, so their time is what the harness gives a kernel that only streams the bytes
(each probe's output on one input set is checked after timing: a probe that skipped bytes fails):

- ``triton``: ``_stream_max_kernel``, each program the max of a contiguous column range of one
  row (rows split like the op's Triton kernel: splits per row so that programs ~= a target per
  SM, or one program per block), swept over BLOCK, num_warps and the target; the best is kept;
- ``amax``: ``torch.amax`` of the logits rows (and of the draft rows) in one callable;
- ``cuda``: a CUDA C++ kernel built with load_inline: 256 threads, 4 independent 16-byte
  ``__ldg`` loads in flight per thread, each CTA XOR-folding a contiguous range of the raw
  words (a few CTAs per SM, or one CTA per 16 KB tile).

The draft rows read are draft_probs[b * K] (the first draft row of each request), laid at stride
K * V like the rows the op reads. Shapes: K = 4, V = 128256, B in 1..128, bf16 logits without
draft probabilities and fp32 logits with fp32 draft probabilities. The op (CUDA and Triton
backends) is timed in the same process. Writes <out>/stream_probe.csv (the long format of
results_csv.py: one row per probe configuration (`config`, `best` marks the fastest) and per op
backend; append it to benchmarks/results/stream_probe.csv with `python benchmarks/results_csv.py
append`), stream_probe.md (the table) and stream_probe.png.

    python benchmarks/bench_stream_probe.py --out bench_out
    python benchmarks/bench_stream_probe.py --batches 32 --configs bf16 --no-ours --out /tmp/probe
"""
from __future__ import annotations

import argparse
import inspect
import os
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results_csv  # noqa: E402
import bench_rejection_sample as chain_bench  # noqa: E402
import specdec_kernels  # noqa: E402
from specdec_kernels.triton.common import row_split as _row_split  # noqa: E402

K, VOCAB = 4, 128256
CONFIGS = {"bf16": ("bf16", False), "fp32+draft": ("fp32", True)}
# (BLOCK, num_warps, programs per SM target; None = one program per BLOCK of a row). 2 per SM
# was never the best on an H100 (B = 1..128, both configs) and is left out to keep the run short.
TRITON_SWEEP = [(block, warps, per_sm) for block in (2048, 4096, 8192) for warps in (4, 8)
                for per_sm in (4, 8, None)]
CUDA_GRIDS = (4, 8, None)  # CTAs per SM (8 x 256 threads fill an SM); None = one CTA per 16 KB tile
CUDA_TILE_BYTES = 256 * 4 * 16  # threads x unroll x 16-byte words: one pass of the inner loop


# --- Triton probe ----------------------------------------------------------------------------

@triton.jit
def _range_max(row_ptr, start, end, n_cols, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    acc = tl.full([BLOCK], float("-inf"), tl.float32)
    for col in range(start, end, BLOCK):
        # Masked on n_cols (divisible by 16 at V = 128256) rather than `end`, so loads stay vectorized.
        x = tl.load(row_ptr + col + offs, mask=col + offs < n_cols, other=float("-inf"))
        acc = tl.maximum(acc, x.to(tl.float32))
    return tl.max(acc, axis=0)


@triton.jit
def _stream_max_kernel(logits_ptr, logits_stride, logit_rows, draft_ptr, draft_stride, out_ptr, n_cols,
                       cols_per_split, num_splits, HAS_DRAFT: tl.constexpr, BLOCK: tl.constexpr):
    """Program p: the max of columns [s * cols_per_split, (s + 1) * cols_per_split) of row p // num_splits
    (s = p % num_splits); rows past the logits are draft rows. One store per program."""
    pid = tl.program_id(0)
    row = pid // num_splits
    start = (pid % num_splits) * cols_per_split
    end = tl.minimum(start + cols_per_split, n_cols)
    if HAS_DRAFT:
        if row < logit_rows:
            m = _range_max(logits_ptr + row.to(tl.int64) * logits_stride, start, end, n_cols, BLOCK)
        else:
            m = _range_max(draft_ptr + (row - logit_rows).to(tl.int64) * draft_stride, start, end, n_cols, BLOCK)
    else:
        m = _range_max(logits_ptr + row.to(tl.int64) * logits_stride, start, end, n_cols, BLOCK)
    tl.store(out_ptr + pid, m)


def split_rows(n_cols: int, block: int, want_splits: int) -> tuple[int, int]:
    """(splits per row, columns per split) for about ``want_splits`` splits: whole blocks per
    split, at most one split per block, no empty split (the op's Triton row_split rule)."""
    # With num_splits given, row_split does not look at the device, the row count or the programs per SM.
    splits, blocks_per_split = _row_split(torch.device("cpu"), 1, triton.cdiv(n_cols, block), want_splits, 4)
    return splits, blocks_per_split * block


def stream_max(logits, draft_rows, out, *, block: int, num_warps: int, num_splits: int) -> torch.Tensor:
    """Launch _stream_max_kernel over ``logits`` [R, V] and ``draft_rows`` (None or [D, V], rows
    at any stride); ``out`` needs (R + D) * splits entries. Returns its [R + D, splits] view."""
    rows, n_cols = logits.shape
    splits, cols_per_split = split_rows(n_cols, block, num_splits)
    total_rows = rows + (0 if draft_rows is None else draft_rows.shape[0])
    assert logits.stride(1) == 1 and (draft_rows is None or draft_rows.stride(1) == 1)
    _stream_max_kernel[(total_rows * splits,)](
        logits, logits.stride(0), rows, logits if draft_rows is None else draft_rows,
        0 if draft_rows is None else draft_rows.stride(0), out, n_cols, cols_per_split, splits,
        HAS_DRAFT=draft_rows is not None, BLOCK=block, num_warps=num_warps)
    return out[:total_rows * splits].view(total_rows, splits)


# --- CUDA probe ------------------------------------------------------------------------------

CUDA_SOURCE = r"""
#include <cstdint>
#include <cuda_runtime.h>

constexpr int kThreads = 256, kUnroll = 4;

__device__ __forceinline__ unsigned fold(uint4 v) { return v.x ^ v.y ^ v.z ^ v.w; }

// XOR of words[lo, hi): kUnroll independent 16-byte loads in flight per thread, the tail's too
// (predicated rather than a one-load loop, which would wait on each load: short ranges are common).
__device__ __forceinline__ unsigned xor_range(const uint4* __restrict__ words, int64_t lo, int64_t hi) {
  unsigned acc = 0;
  for (int64_t i = lo + threadIdx.x; i < hi; i += kUnroll * kThreads) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      v[u] = i + u * kThreads < hi ? __ldg(words + i + u * kThreads) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) acc ^= fold(v[u]);
  }
  return acc;
}

// Each CTA: a contiguous 1/grid of the logits' words, then 1/grid of the draft rows laid end to
// end (contiguous within a row); one XOR per CTA written to out.
__global__ void __launch_bounds__(kThreads) stream_xor_kernel(
    const uint4* __restrict__ logits, int64_t logit_words, const uint4* __restrict__ draft,
    int64_t draft_rows, int64_t row_words, int64_t row_stride_words, unsigned* __restrict__ out) {
  const int64_t per_cta = (logit_words + gridDim.x - 1) / gridDim.x;
  const int64_t lo = min(logit_words, (int64_t)blockIdx.x * per_cta);
  unsigned acc = xor_range(logits, lo, min(logit_words, lo + per_cta));
  const int64_t draft_words = draft_rows * row_words;
  const int64_t draft_per_cta = (draft_words + gridDim.x - 1) / gridDim.x;
  int64_t d = min(draft_words, (int64_t)blockIdx.x * draft_per_cta);
  const int64_t d_end = min(draft_words, d + draft_per_cta);
  while (d < d_end) {
    const int64_t row = d / row_words, col = d - row * row_words;
    const int64_t n = min(row_words - col, d_end - d);
    acc ^= xor_range(draft + row * row_stride_words, col, col + n);
    d += n;
  }
  for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
  __shared__ unsigned warp_acc[kThreads / 32];
  if ((threadIdx.x & 31) == 0) warp_acc[threadIdx.x / 32] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned r = 0;
    for (int w = 0; w < kThreads / 32; ++w) r ^= warp_acc[w];
    out[blockIdx.x] = r;
  }
}

int64_t stream_xor(int64_t logits, int64_t logit_words, int64_t draft, int64_t draft_rows, int64_t row_words,
                   int64_t row_stride_words, int64_t out, int64_t grid, int64_t stream) {
  stream_xor_kernel<<<(unsigned)grid, kThreads, 0, (cudaStream_t)stream>>>(
      (const uint4*)logits, logit_words, (const uint4*)draft, draft_rows, row_words, row_stride_words,
      (unsigned*)out);
  return (int64_t)cudaGetLastError();
}
"""
# Our own binding, pybind11 only: with no_implicit_headers neither file parses torch's headers,
# which would take most of the build time.
CPP_SOURCE = r"""
#include <cstdint>
#include <pybind11/pybind11.h>
int64_t stream_xor(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t);
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("stream_xor", &stream_xor); }
"""


def build_cuda_probe():
    """The compiled CUDA probe module, or the reason it could not be built (a str)."""
    try:
        from torch.utils.cpp_extension import load_inline
        has_option = "no_implicit_headers" in inspect.signature(load_inline).parameters  # torch >= 2.6
        extra = {"no_implicit_headers": True} if has_option else {}
        return load_inline("specdec_stream_probe", CPP_SOURCE, cuda_sources=CUDA_SOURCE, extra_cflags=["-O2"],
                           extra_cuda_cflags=["-O3"], **extra)
    except Exception as e:  # no nvcc / ninja / compiler: the other probes still run
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        errors = [ln for ln in lines if "error" in ln.lower()] or lines[-1:]
        return f"{type(e).__name__}: " + " | ".join(errors[-3:])[:300]


def cuda_probe_call(module, logits, draft_rows, out, grid):
    """The CUDA probe over ``logits`` (contiguous) and ``draft_rows`` (None or rows at a stride),
    as raw 16-byte words, on ``grid`` CTAs: a zero-argument callable."""
    words = lambda t: t.numel() * t.element_size() // 16  # noqa: E731
    assert logits.is_contiguous() and logits.numel() * logits.element_size() % 16 == 0
    assert all(t is None or t.data_ptr() % 16 == 0 for t in (logits, draft_rows))
    rows, row_words, stride_words, draft_ptr = 0, 0, 0, 0
    if draft_rows is not None:
        assert draft_rows.stride(1) == 1 and draft_rows.stride(0) * draft_rows.element_size() % 16 == 0
        rows, row_words = draft_rows.shape[0], words(draft_rows[0])
        stride_words, draft_ptr = draft_rows.stride(0) * draft_rows.element_size() // 16, draft_rows.data_ptr()
    args = (logits.data_ptr(), words(logits), draft_ptr, rows, row_words, stride_words, out.data_ptr(), grid)

    def call():
        err = module.stream_xor(*args, torch.cuda.current_stream().cuda_stream)
        assert err == 0, f"CUDA probe launch failed: error {err}"
    return call


def xor_fold(t: torch.Tensor) -> int:
    """XOR of all 32-bit words of ``t`` (on the GPU, by halving)."""
    x = t.contiguous().view(-1).view(torch.int32)
    while x.numel() > 1:
        half = x.numel() // 2
        x = torch.cat([x[:half] ^ x[half:2 * half], x[2 * half:]])
    return int(x[0]) if x.numel() else 0


# --- the benchmark ---------------------------------------------------------------------------

def probe_inputs(inp):
    """(logits [B*(K+1), V], draft rows [B, V] at stride K*V or None): the floor's bytes."""
    probs = inp["draft_probs"]
    return inp["target_logits"], None if probs is None else probs.view(-1, K, probs.shape[-1])[:, 0]


def time_shape(batch, dtype, probs, bandwidth, cuda_module, backends, info, max_calls) -> dict:
    """Every probe (and the op's ``backends``) on one shape, graph-timed on the same input sets;
    the CSV row."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    set_bytes = batch * (K + 1) * VOCAB * (chain_bench.DTYPES[dtype].itemsize + (4 if probs else 0))
    n_sets = max(2, min(max_calls, int(4e9 // set_bytes)))  # as bench_rejection_sample
    sets = [chain_bench.make_inputs(batch, K, VOCAB, chain_bench.DTYPES[dtype], probs, seed)
            for seed in range(n_sets)]
    reads = [probe_inputs(s) for s in sets]
    total_rows = reads[0][0].shape[0] + (0 if reads[0][1] is None else reads[0][1].shape[0])
    # What every probe must find on set 0 (checked after timing: a probe that skipped bytes fails).
    want_row_max = torch.cat([t.float().amax(dim=-1) for t in reads[0] if t is not None])
    want_xor = xor_fold(reads[0][0]) ^ (0 if reads[0][1] is None else xor_fold(reads[0][1]))
    floor = chain_bench.floor_us(batch, K, VOCAB, dtype, probs, bandwidth)
    read_bytes = sum(t.numel() * t.element_size() for t in reads[0] if t is not None)
    row = dict(info, B=batch, K=K, V=VOCAB, logits_dtype=dtype, draft_probs="fp32" if probs else "none",
               MB=round(read_bytes / 1e6, 2), floor_us=round(floor, 2), bandwidth_TBps=round(bandwidth / 1e12, 3),
               input_sets=n_sets)
    tag = f"B={batch:4d} {dtype} draft={row['draft_probs']:4s}"

    def report(name, us):
        print(f"{tag} {name:24s} {us:8.2f} us ({us / floor:5.2f}x floor)", flush=True)
        return us

    triton_times = {}
    for block, warps, per_sm in TRITON_SWEEP:
        want = triton.cdiv(VOCAB, block) if per_sm is None else triton.cdiv(per_sm * sms, total_rows)
        splits, _ = split_rows(VOCAB, block, want)
        outs = [torch.empty(total_rows * splits, device="cuda") for _ in sets]
        name = f"{block}x{warps}w@{'block' if per_sm is None else f'{per_sm}/SM'}"
        kw = dict(block=block, num_warps=warps, num_splits=splits)
        fns = [lambda r=r, o=o, kw=kw: stream_max(*r, o, **kw) for r, o in zip(reads, outs)]
        triton_times[name] = report(f"triton {name}", chain_bench.time_graph(fns))
        assert torch.equal(outs[0].view(total_rows, splits).amax(dim=1), want_row_max), \
            f"triton probe {name} missed bytes"
    amax = [lambda r=r: [torch.amax(t, dim=-1) for t in r if t is not None] for r in reads]
    probe = {"amax": report("torch.amax", chain_bench.time_graph(amax))}
    best = min(triton_times, key=triton_times.get)
    probe["triton"] = triton_times[best]
    row.update(triton_us=round(triton_times[best], 2), triton_config=best, amax_us=round(probe["amax"], 2))
    cuda_times = {}
    if not isinstance(cuda_module, str):
        for per_sm in CUDA_GRIDS:
            grid = triton.cdiv(read_bytes, CUDA_TILE_BYTES) if per_sm is None else per_sm * sms
            outs = [torch.empty(grid, dtype=torch.int32, device="cuda") for _ in sets]
            name = "tiles" if per_sm is None else f"{per_sm}/SM"
            fns = [cuda_probe_call(cuda_module, *r, o, grid) for r, o in zip(reads, outs)]
            cuda_times[name] = report(f"cuda probe {name}", chain_bench.time_graph(fns))
            assert xor_fold(outs[0]) == want_xor, f"CUDA probe {name} missed bytes"
        best_cuda = min(cuda_times, key=cuda_times.get)
        probe["cuda"] = cuda_times[best_cuda]
        row.update(cuda_probe_us=round(cuda_times[best_cuda], 2), cuda_probe_config=best_cuda)
    best_probe = min(probe, key=probe.get)
    row.update(best_probe=best_probe, best_probe_us=round(probe[best_probe], 2),
               probe_over_floor=round(probe[best_probe] / floor, 3))
    for backend in backends:
        us = report(f"op {backend}", chain_bench.time_graph([chain_bench.our_call(s, K, backend) for s in sets]))
        row.update({f"{backend}_op_us": round(us, 2), f"{backend}_op_over_floor": round(us / floor, 3),
                    f"{backend}_op_over_probe": round(us / probe[best_probe], 3)})
    row["triton_sweep"] = " ".join(f"{k}={v:.2f}" for k, v in triton_times.items())
    row["cuda_sweep"] = " ".join(f"{k}={v:.2f}" for k, v in cuda_times.items())
    del sets, reads
    torch.cuda.empty_cache()
    return row


def result_rows(rows: list[dict]) -> list[dict]:
    """The shapes' rows in the long format of results_csv: every probe configuration of the sweeps
    (backend probe-triton / probe-cuda / probe-amax, `config`, `best` = the fastest of all) and each
    op backend, graph-timed."""
    run = results_csv.run_info("stream_probe")
    out = []
    for r in rows:
        base = dict(run, **{k: r[k] for k in ("card", "torch", "triton", "cuda", "commit", "B", "K", "V",
                                               "logits_dtype", "draft_probs", "floor_us", "bandwidth_TBps")},
                    op="chain", method="token", MB=r["MB"], input_sets=r["input_sets"])
        best = (r["best_probe"], {"triton": r["triton_config"], "cuda": r.get("cuda_probe_config"),
                                  "amax": "torch.amax"}[r["best_probe"]])
        timed = [("triton", *item.rsplit("=", 1)) for item in r["triton_sweep"].split()]
        timed += [("cuda", *item.rsplit("=", 1)) for item in r["cuda_sweep"].split()]
        timed.append(("amax", "torch.amax", r["amax_us"]))
        for kind, config, us in timed:
            out.append(dict(base, backend=f"probe-{kind}", config=config, best="yes" if (kind, config) == best else "",
                            time_us=us))
        for backend in ("cuda", "triton"):
            if f"{backend}_op_us" in r:
                out.append(dict(base, backend=backend, time_us=r[f"{backend}_op_us"]))
    return results_csv.long_rows(out, {"graph": "time_us"})


def markdown_table(rows, info, bandwidth, cuda_note) -> str:
    fmt = lambda r, key: f"{r[key]:.1f}" if key in r else "-"  # noqa: E731
    ratio = lambda r, key: f"{r[key]:.2f}" if key in r else "-"  # noqa: E731
    lines = [f"Card: {info['card']} (copy {bandwidth / 1e12:.2f} TB/s), torch {info['torch']}, triton "
             f"{info['triton']}, commit {info['commit']}. K = 4, V = 128256; times in us, graph-timed like "
             f"bench_rejection_sample.py (one call per input set, L2 flushed). Probe = the fastest pure-read "
             f"kernel of the same bytes.{cuda_note}", "",
             "| B | logits | draft | MB read | floor | best probe | probe/floor | CUDA op | CUDA/floor | CUDA/probe "
             "| Triton op | Triton/floor | Triton/probe |", "|" + "---|" * 13]
    for r in rows:
        cfg = {"triton": r["triton_config"], "cuda": r.get("cuda_probe_config", ""), "amax": ""}[r["best_probe"]]
        best = f"{r['best_probe_us']:.1f} ({r['best_probe']} {cfg}".rstrip() + ")"
        cells = [str(r["B"]), r["logits_dtype"], r["draft_probs"], f"{r['MB']:.1f}", f"{r['floor_us']:.1f}", best,
                 f"{r['probe_over_floor']:.2f}"]
        for backend in ("cuda", "triton"):
            cells += [fmt(r, f"{backend}_op_us"), ratio(r, f"{backend}_op_over_floor"),
                      ratio(r, f"{backend}_op_over_probe")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows, info, path):
    plt = chain_bench.pyplot()
    if plt is None:
        return
    panels = [(d, p) for d, p in CONFIGS.values() if any(r["logits_dtype"] == d for r in rows)]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (dtype, probs) in zip(axes[0], panels):
        sel = sorted((r for r in rows if r["logits_dtype"] == dtype), key=lambda r: r["B"])
        for key, style, label in (("floor_us", "k--", "memory floor (copy bandwidth)"),
                                  ("best_probe_us", "ko-", "best pure-read probe"),
                                  ("cuda_op_us", "s-", "op, CUDA backend"),
                                  ("triton_op_us", "^-", "op, Triton backend")):
            pts = [(r["B"], r[key]) for r in sel if key in r]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size B (K=4, V=128256)")
        ax.set_ylabel("time per call (us, CUDA graph)")
        ax.set_title(f"{dtype} logits" + (" + fp32 draft probs" if probs else ", no draft probs"))
        ax.legend(fontsize=8)
    fig.suptitle(f"practical floor on {info['card']} (commit {info['commit']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32,64,128", help="comma list of B")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {list(CONFIGS)}")
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--no-cuda-probe", action="store_true", help="skip the load_inline CUDA probe (no nvcc build)")
    ap.add_argument("--no-ours", action="store_true", help="time the probes only, not the op")
    ap.add_argument("--max-graph-calls", type=int, default=16, help="input sets per graph (as the op's benchmark)")
    args = ap.parse_args()
    if any(c not in CONFIGS for c in args.configs.split(",")):
        ap.error(f"--configs takes {list(CONFIGS)}, got {args.configs!r}")
    if not torch.cuda.is_available():
        sys.exit("bench_stream_probe.py times GPU kernels: no CUDA device")
    os.makedirs(args.out, exist_ok=True)
    started = time.time()
    status = specdec_kernels.available_backends()
    backends = [] if args.no_ours else [b for b in ("cuda", "triton") if status[b] == "available"]
    info = chain_bench.versions()
    bandwidth = chain_bench.copy_bandwidth()
    built = time.time()
    cuda_module = "--no-cuda-probe" if args.no_cuda_probe else build_cuda_probe()
    print(f"# CUDA probe build: {time.time() - built:.1f} s", flush=True)
    cuda_note = f" CUDA probe not run ({cuda_module})." if isinstance(cuda_module, str) else ""
    print(f"# {info['card']}: copy bandwidth {bandwidth / 1e12:.2f} TB/s; torch {info['torch']}, triton "
          f"{info['triton']}, commit {info['commit']}; op backends timed: {backends or 'none'}.{cuda_note}",
          flush=True)
    rows = [time_shape(int(b), *CONFIGS[c], bandwidth, cuda_module, backends, info, args.max_graph_calls)
            for c in args.configs.split(",") for b in args.batches.split(",")]
    chain_bench.write_csv(os.path.join(args.out, "stream_probe.csv"), result_rows(rows))
    table = markdown_table(rows, info, bandwidth, cuda_note)
    with open(os.path.join(args.out, "stream_probe.md"), "w") as f:
        f.write(table)
    print(table)
    plot(rows, info, os.path.join(args.out, "stream_probe.png"))
    print(f"# {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
