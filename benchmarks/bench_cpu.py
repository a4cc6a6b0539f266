"""The CPU kernels (csrc/cpu/, the ops' CPU dispatch) against the float64 reference and against a
plain softmax + argmax of the same rows, per call, on CPU tensors.

Chain verification at V = 49152, K = 4 by default, random requests (T = 1), no filters, with
deterministic drafts and with float32 draft probabilities, two cases:
- accept: every draft accepted (q(draft) ~ 1), so the kernel reads all K + 1 rows;
- reject_last: drafts 0..K-2 accepted and the last one rejected (q(draft) = 0), so it reads K rows
  and, with draft probabilities, streams the rejected row again with its draft row (the residual).
The baseline ("softmax_argmax") is torch.softmax(rows.float(), -1).argmax(-1) over the K + 1 rows.
The machine may be shared: every time is the min and the median of --repeats calls (after warm-up);
the CSV's time_us is the median, min_us the min.

    python benchmarks/bench_cpu.py --threads 1 --out benchmarks/results/cpu.csv
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results_csv  # noqa: E402

from specdec_kernels.reference import rejection_sample_reference  # noqa: E402


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def batch(b: int, k: int, vocab: int, dtype, draft_probs: bool, case: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b * (k + 1), vocab, generator=g) * 2
    drafts = torch.randint(0, vocab, (b * k,), generator=g)
    rows = torch.arange(b * k) + torch.arange(b * k) // k  # request r's draft row t is r (k + 1) + t
    logits[rows, drafts] += 40.0  # q(draft) ~ 1: accepted
    if case == "reject_last":
        last = torch.arange(b) * (k + 1) + k - 1
        logits[last, drafts[torch.arange(b) * k + k - 1]] = float("-inf")  # q(draft) = 0: rejected
    probs = torch.softmax(torch.randn(b * k, vocab, generator=g), -1) if draft_probs else None
    cu = torch.arange(0, (b + 1) * k, k, dtype=torch.int32)
    return (logits.to(dtype), drafts, cu, probs, torch.ones(b), torch.arange(b, dtype=torch.int64) + 1,
            torch.zeros(b, dtype=torch.int64), k)


def timed(fn, repeats: int) -> tuple[float, float]:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e6, statistics.median(times) * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (at::parallel_for's threads)")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--reference-repeats", type=int, default=10)
    ap.add_argument("--out", default=None, help="CSV to write (long format, benchmarks/results_csv.py)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    info = results_csv.run_info("cpu", torch.device("cpu"))
    info["card"] = cpu_model()
    rows = []
    print(f"{info['card']}, {args.threads} thread(s), V = {args.vocab}, K = {args.k}; times in us (min / median)")
    print(f"{'B':>3} {'logits':>6} {'draft_probs':>11} {'case':>11} | {'cpu kernel':>17} {'softmax+argmax':>17} "
          f"{'reference':>19}")
    for b in args.batch:
        for dtype, dname in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            for draft_probs in (False, True):
                for case in ("accept", "reject_last"):
                    call = batch(b, args.k, args.vocab, dtype, draft_probs, case)
                    out, num = torch.ops.specdec.rejection_sample(*call)
                    expected = args.k if case == "accept" else args.k - 1
                    assert bool((num == expected).all()), (case, num)
                    logits = call[0]
                    results = {
                        "cpu": timed(lambda: torch.ops.specdec.rejection_sample(*call), args.repeats),
                        "softmax_argmax": timed(lambda: torch.softmax(logits.float(), -1).argmax(-1), args.repeats),
                        "reference": timed(lambda: rejection_sample_reference(*call), args.reference_repeats),
                    }
                    cells = [f"{lo:7.1f} / {med:7.1f}" for lo, med in results.values()]
                    print(f"{b:>3} {dname:>6} {'fp32' if draft_probs else 'none':>11} {case:>11} | "
                          f"{cells[0]:>17} {cells[1]:>17} {cells[2]:>19}")
                    for backend, (lo, med) in results.items():
                        rows.append(dict(info, backend=backend, op="chain", method="token", B=b, K=args.k,
                                         V=args.vocab, logits_dtype=dname, draft_probs="fp32" if draft_probs else "none",
                                         mode="eager", time_us=round(med, 2), min_us=round(lo, 2), case=case,
                                         threads=args.threads,
                                         repeats=args.reference_repeats if backend == "reference" else args.repeats,
                                         note="median of repeats; min_us the min"))
    if args.out:
        results_csv.append(args.out, rows)
        print(f"wrote {len(rows)} rows to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
