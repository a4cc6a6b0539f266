"""The synthetic demo: ``python -m specdec_kernels.demo``.

Runs the verify op on synthetic target/draft pairs whose acceptance rate a is known exactly
(specdec_kernels.testing.iid_pair) and prints, side by side, the measured tokens per step
and the theory (1 - a^(K+1)) / (1 - a), and the total-variation distance between the
emitted tokens and the target distribution next to the distance an exact sampler would show
with as many samples. Uses the fused GPU kernel when a GPU is present, the CPU reference
otherwise, and says which. No arguments, no downloads.
"""
from __future__ import annotations

import argparse
import time

import torch

from . import available_backends, rejection_sample
from .backends import resolve_backend
from .testing import chain_batch_iid, iid_pair


def _tv(counts: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - q).abs().sum())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    ap.add_argument("--requests", type=int, default=None, help="requests per setting (default 8192 GPU / 2048 CPU)")
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = resolve_backend(None, device)
    if device.type == "cuda":
        name = "cuda" if backend in ("auto", "cuda") and available_backends()["cuda"] == "available" else \
            "triton" if backend in ("auto", "triton") else backend
        where = f"the fused {name} kernel on {torch.cuda.get_device_name(device)}"
    else:
        where = "the CPU reference (no GPU found)"
    batch = args.requests or (8192 if device.type == "cuda" else 2048)
    print(f"specdec_kernels demo: chain verification with {where}")
    print(f"backends: {available_backends()}")
    print(f"{batch} requests per setting, vocabulary {args.vocab}, draft tokens sampled from p, "
          "target q with sum_x min(p, q) = a exactly\n")
    header = (f"{'a':>5} {'K':>3} | {'tokens/step':>11} {'theory':>7} {'diff/SE':>7} | "
              f"{'TV(emitted, q)':>14} {'TV exact sampler':>16}")
    print(header)
    print("-" * len(header))
    g = torch.Generator().manual_seed(args.seed)
    worst = 0.0
    tv_ours = tv_exact = 0.0
    start = time.perf_counter()
    for a in (0.5, 0.7, 0.8, 0.9):
        q, p = iid_pair(args.vocab, a, generator=g)
        for k in (2, 4, 8):
            logits, drafts, cu, probs = chain_batch_iid(q, p, batch, k, generator=g, device=device)
            seeds = torch.randint(0, 2**62, (batch,), generator=g).to(device)
            out, num = rejection_sample(logits, drafts, cu, probs, seeds=seeds, max_spec_len=k)
            tokens = num.double().cpu() + 1
            theory = (1 - a ** (k + 1)) / (1 - a)
            se = float(tokens.std()) / batch ** 0.5
            # Every emitted token is a target sample (q does not depend on the context here).
            emitted = out.cpu().long().flatten()
            emitted = emitted[emitted >= 0]
            counts = torch.bincount(emitted, minlength=args.vocab).double()
            exact = torch.multinomial(q, emitted.numel(), replacement=True, generator=g)
            counts_exact = torch.bincount(exact, minlength=args.vocab).double()
            tv_ours += _tv(counts, q)
            tv_exact += _tv(counts_exact, q)
            diff = (float(tokens.mean()) - theory) / se
            worst = max(worst, abs(diff))
            print(f"{a:5.2f} {k:3d} | {float(tokens.mean()):11.3f} {theory:7.3f} {diff:+7.2f} | "
                  f"{_tv(counts, q):14.4f} {_tv(counts_exact, q):16.4f}")
    ratio = tv_ours / tv_exact
    verdict = "within sampling noise of" if 0.8 <= ratio <= 1.25 else "NOT within sampling noise of"
    print(f"\nlargest |measured - theory| = {worst:.2f} standard errors; mean TV to q is {ratio:.2f}x an exact "
          f"sampler's: {verdict} exact sampling. ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
