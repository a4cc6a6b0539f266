"""Bad-input cases for compute-sanitizer memcheck on the GPU kernels (issue #38).

Run under ``compute-sanitizer --tool memcheck`` by scripts/gpu_robustness.sh; on its own it is
a quick GPU check. It reuses the suite's bad-input generators and sizes them for the
sanitizer (memcheck slows every launch by ~100x):

- chain, on every GPU backend built (CUDA C++ and Triton), in token and block mode: the fuzz
  suite's ``chain_batches`` (python_tests/test_fuzz.py: NaN / +-inf / all -inf / all NaN rows,
  ids -1 and >= V, malformed offsets, hostile draft probabilities, V = 1..4097) and fixed cases
  at V = 1, 7, 8193 (NaN row, -inf rows, bad ids, malformed offsets);
- trees, on every GPU tree backend built (the CUDA tree kernel and Triton): the fuzz suite's
  ``tree_batches`` (malformed links and ids, -inf / NaN rows), test_tree_gpu.py's malformed and
  hostile batches, and fixed cases at V = 1, 7, 8193.

Every call's outputs must satisfy the layout invariants; token-mode chains and trees must
equal the reference (as the fuzz suite requires); block-mode disagreements are counted and
printed (issue #9 follows them). Exit status 1 on any failure.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python_tests"))

import specdec_kernels  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from specdec_kernels import _ops as ops  # noqa: E402

import test_fuzz  # noqa: E402
import test_tree_gpu  # noqa: E402
from utils import gpu_backends, random_batch  # noqa: E402

VOCABS = [1, 7, 8193]


class Tally:
    def __init__(self):
        self.calls = {"chain": 0, "tree": 0}
        self.block_mismatches = 0
        self.failures: list[str] = []

    def fail(self, what: str, error: BaseException) -> None:
        self.failures.append(f"{what}: {type(error).__name__}: {error}")
        print(f"FAILED {what}: {type(error).__name__}: {error}", flush=True)


def to_cuda(args):
    return tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)


def check_chain(tally: Tally, what: str, args, backends) -> None:
    """One chain batch (CPU tensors) on every backend and method, against the reference."""
    for method in ("token", "block"):
        ref_out, ref_num = specdec_kernels.rejection_sample(*args, method=method, backend="reference")
        for backend in backends:
            name = f"{what} {backend} {method}"
            try:
                out, num = specdec_kernels.rejection_sample(*to_cuda(args), method=method, backend=backend)
                torch.cuda.synchronize()
                tally.calls["chain"] += 1
                test_fuzz._check_chain_outputs(out, num, args)
                same = torch.equal(out.cpu(), ref_out) and torch.equal(num.cpu(), ref_num)
                if method == "token":
                    assert same, "differs from the reference"
                elif not same:
                    tally.block_mismatches += 1
            except Exception as error:  # noqa: BLE001 -- every case runs; the failures are listed
                tally.fail(name, error)


def check_tree(tally: Tally, what: str, args, backends) -> None:
    ref = specdec_kernels.tree_rejection_sample(*args, backend="reference")
    for backend in backends:
        try:
            got = specdec_kernels.tree_rejection_sample(*to_cuda(args), backend=backend)
            torch.cuda.synchronize()
            tally.calls["tree"] += 1
            for r, o in zip(ref, got):
                assert torch.equal(r, o.cpu()), "differs from the reference"
        except Exception as error:  # noqa: BLE001
            tally.fail(f"{what} {backend}", error)


def fixed_chain_cases(vocab: int, seed: int):
    """random_batch at ``vocab`` with one hostile value each (CPU tensors)."""
    for draft_probs in (False, True):
        base = random_batch(6, 4, vocab, draft_probs=draft_probs, seed=seed, device="cpu")
        logits, ids, cu, probs, temperature, seeds, offsets, k = base
        rows, n = logits.shape[0], ids.shape[0]
        g = torch.Generator().manual_seed(seed)
        cases = {}
        nan = logits.clone()
        nan[int(torch.randint(0, rows, (1,), generator=g))] = float("nan")
        cases["nan_row"] = (nan, ids, cu)
        neginf = logits.clone()
        neginf[torch.rand(neginf.shape, generator=g) < 0.3] = float("-inf")
        neginf[int(torch.randint(0, rows, (1,), generator=g))] = float("-inf")
        cases["neginf_rows"] = (neginf, ids, cu)
        if n:
            bad = ids.clone()
            bad[::3] = -1
            bad[1::3] = vocab + 5
            cases["bad_ids"] = (logits, bad, cu)
        malformed = cu.clone()
        malformed[1] = malformed[-1] + 3       # decreasing afterwards, and past N
        cases["malformed_cu"] = (logits, ids, malformed)
        for name, (lg, dr, c) in cases.items():
            yield f"V={vocab} probs={draft_probs} {name}", (lg, dr, c, probs, temperature, seeds, offsets, k)


def fixed_tree_cases(vocab: int, seed: int):
    """test_tree_gpu.tree_batch at ``vocab`` with the malformed-tree mutations of
    test_tree_gpu_malformed_and_hostile (CPU tensors)."""
    for draft_probs in (False, True):
        args = list(test_tree_gpu.tree_batch(6, 8, vocab, draft_probs=draft_probs, seed=seed, device="cpu"))
        logits, tokens, parents, cu = args[0], args[1], args[2], args[3]
        n = logits.shape[0]
        if n:
            g = torch.Generator().manual_seed(seed)
            which = torch.rand(n, generator=g) < 0.25
            parents[which] = torch.randint(-3, 12, (int(which.sum()),), generator=g, dtype=torch.int32)
            tokens[torch.rand(n, generator=g) < 0.15] = -1
            tokens[torch.rand(n, generator=g) < 0.1] = vocab + 7
            logits[torch.rand(logits.shape, generator=g) < 0.3] = float("-inf")
            logits[int(torch.randint(0, n, (1,), generator=g))] = float("nan")
            cu[2] = cu[-1] + 3                 # decreasing afterwards, and past N
        yield f"V={vocab} probs={draft_probs} malformed", tuple(args)


def hypothesis_run(strategy, body, examples: int) -> None:
    """``body`` on the fuzz suite's first ``examples`` derandomized examples of ``strategy``."""
    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def run(args):
        body(args)
    run()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=12,
                        help="fuzz examples per generator (chain and tree; default 12)")
    parser.add_argument("--seeds", type=int, default=2, help="seeds of the fixed cases per vocabulary (default 2)")
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU", file=sys.stderr)
        return 2
    chain_backends = [b for b in gpu_backends() if b in ("cuda", "triton")]
    tree_backends = [b for b in gpu_backends(ops.TREE_REJECTION_SAMPLE) if b in ("cuda", "triton")]
    print(f"chain backends {chain_backends}, tree backends {tree_backends}", flush=True)
    if "cuda" not in chain_backends or "cuda" not in tree_backends:
        print("error: the CUDA kernels are not built (bash scripts/build.sh on the GPU machine)", file=sys.stderr)
        return 2
    tally = Tally()
    start = time.time()
    for vocab in VOCABS:
        for seed in range(opts.seeds):
            for what, args in fixed_chain_cases(vocab, seed):
                check_chain(tally, f"chain {what} seed={seed}", args, chain_backends)
            for what, args in fixed_tree_cases(vocab, seed):
                check_tree(tally, f"tree {what} seed={seed}", args, tree_backends)
        print(f"V = {vocab}: done ({time.time() - start:.0f} s)", flush=True)
    counter = iter(range(10**6))
    hypothesis_run(test_fuzz.chain_batches(),
                   lambda args: check_chain(tally, f"chain fuzz #{next(counter)}", args, chain_backends), opts.examples)
    print(f"chain fuzz: done ({time.time() - start:.0f} s)", flush=True)
    hypothesis_run(test_fuzz.tree_batches(),
                   lambda args: check_tree(tally, f"tree fuzz #{next(counter)}", args, tree_backends), opts.examples)
    print(f"tree fuzz: done ({time.time() - start:.0f} s)", flush=True)
    for backend in tree_backends:
        for draft_probs in (False, True):
            try:  # test_tree_gpu's malformed and hostile batches (24 requests, V = 1000, 4 seeds)
                test_tree_gpu.test_tree_gpu_malformed_and_hostile(backend, draft_probs)
                tally.calls["tree"] += 4
            except Exception as error:  # noqa: BLE001
                tally.fail(f"test_tree_gpu_malformed_and_hostile {backend} probs={draft_probs}", error)
    torch.cuda.synchronize()
    print(f"sanitize cases: {tally.calls['chain']} chain calls, {tally.calls['tree']} tree calls, "
          f"{len(tally.failures)} failures, {tally.block_mismatches} block-mode calls differing from the "
          f"reference, {time.time() - start:.0f} s", flush=True)
    return 1 if tally.failures else 0


if __name__ == "__main__":
    sys.exit(main())
