"""Diagnose disagreements between a GPU backend and the CPU reference in block mode (#9).

For the test_backends batches (B=256, K=4, V=32000, draft probs) it reports, per disagreeing
request: drafts, temperature, reference vs backend tokens, whether the backend is
deterministic over repeated runs, and whether a single split per row (Triton) changes it.
    python scripts/diagnose_block_agreement.py [--backend triton] [--vocab 32000]
"""
import argparse
import sys

import torch

sys.path.insert(0, "python_tests")
import specdec_kernels  # noqa: E402
from utils import random_batch  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--backend", default="triton")
ap.add_argument("--vocab", type=int, default=32000)
ap.add_argument("--method", default="block")
ap.add_argument("--repeats", type=int, default=5)
a = ap.parse_args()

for dtype in (torch.float32, torch.bfloat16):
    for seed in range(3):
        args = random_batch(256, 4, a.vocab, dtype=dtype, draft_probs=True, seed=1000 * seed + a.vocab % 997,
                            device="cuda")
        cpu_args = [t.cpu() if isinstance(t, torch.Tensor) else t for t in args]
        ref_out, ref_num = specdec_kernels.rejection_sample(*cpu_args, backend="reference", method=a.method)
        # Near-tie probe: does the reference itself flip under a relative perturbation of 1e-6?
        pert = list(cpu_args)
        pert[0] = (cpu_args[0].float() * (1 + 1e-6)).to(cpu_args[0].dtype) if dtype == torch.float32 else cpu_args[0]
        if pert[3] is not None:
            pert[3] = cpu_args[3] * (1 + 1e-6)
        p_out, p_num = specdec_kernels.rejection_sample(*pert, backend="reference", method=a.method)
        runs = [specdec_kernels.rejection_sample(*args, backend=a.backend, method=a.method) for _ in range(a.repeats)]
        outs = [(o.cpu(), n.cpu()) for o, n in runs]
        det = all(torch.equal(o, outs[0][0]) and torch.equal(n, outs[0][1]) for o, n in outs)
        out, num = outs[0]
        bad = ((out != ref_out).any(1) | (num != ref_num)).nonzero().flatten().tolist()
        print(f"dtype={dtype} seed={seed}: {len(bad)} of 256 disagree; deterministic over {a.repeats} runs: {det}")
        extra = ""
        if a.backend == "triton" and bad:
            from specdec_kernels.triton.chain import rejection_sample_triton
            o1, n1 = rejection_sample_triton(*args, num_splits=1, method=a.method)
            o1, n1 = o1.cpu(), n1.cpu()
            extra = "num_splits=1 -> " + ", ".join(
                str((o1[b].tolist(), int(n1[b]))) for b in bad)
        cu = cpu_args[2]
        for b in bad:
            lo, hi = int(cu[b]), int(cu[b + 1])
            print(f"  req {b}: drafts {cpu_args[1][lo:hi].tolist()} T={float(cpu_args[4][b]):.4f}"
                  f" ref {ref_out[b].tolist()}/{int(ref_num[b])} perturbed-ref {p_out[b].tolist()}/{int(p_num[b])}"
                  f" {a.backend} {out[b].tolist()}/{int(num[b])}")
        if extra:
            print("  " + extra)
