"""Block vs token verification on a real model: tokens per verify step, many seeds.

Runs ``specdec_kernels.hf.speculative_generate`` on the main job's model (SmolLM2-135M-Instruct,
``specdec_kernels.default_model``) and built-in prompts, sampling at temperature 0.8, with the
two verification methods on the same (seed, prompt, drafter) runs, interleaved so that a
shared machine's slow phases hit both alike. Drafters: early exit (probabilistic drafts: the
target's first ``--exit-layer`` layers) and prompt lookup (deterministic drafts). Every run
appends one JSON line to ``--out``; ``--summarize`` prints the table (mean +- standard error
over runs, and the paired block - token difference per (seed, prompt)).

Realized tokens per step vary a lot from run to run (each accept test is a coin flip), so the
script also records, for every verify step, the expected number of accepted drafts *given that
step's drafts and target rows* under both methods (``expected_accepted``): token verification
accepts at least i drafts with probability prod_{j<=i} min(1, q_j(x_j) / p_j(x_j)), block
verification with probability 1 - prod_{j>=i} (1 - h_j) (tau >= i iff some eta_j < h_j,
j >= i). Both are evaluated on the same steps, so their difference is a paired estimate with
a far smaller standard error than the realized counts.

    python benchmarks/hf_block_vs_token.py --seeds 16 --out block_vs_token.jsonl
    python benchmarks/hf_block_vs_token.py --summarize block_vs_token.jsonl

``--greedy-check`` first runs greedy decoding with both methods and checks that the outputs are
identical (block verification changes random requests only). Tokens per step and acceptance are
what this measures; on a shared CPU the times are noise.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import defaultdict

import torch

from specdec_kernels.hf import default_model, drafters, speculative as hf
from specdec_kernels.reference import sanitize_logits

METHODS = ("token", "block")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=16, help="seeds 0 .. N-1 (one request per seed and prompt)")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--exit-layer", type=int, default=28)
    parser.add_argument("--drafter", action="append", choices=["early-exit", "prompt-lookup"],
                        help="default: both")
    parser.add_argument("--greedy-check", action="store_true")
    parser.add_argument("--out", default="block_vs_token.jsonl")
    parser.add_argument("--summarize", metavar="JSONL", help="only print the table of an earlier run")
    return parser.parse_args(argv)


@torch.no_grad()
def expected_accepted(target_logits, draft_token_ids, cu_num_draft_tokens, draft_probs, temperature,
                      max_spec_len) -> list[tuple[float, float]]:
    """Expected accepted drafts of each random request given its drafts: (token, block).

    Arguments as ``rejection_sample``'s (the target logits already filtered); float64, the
    formulas of docs/ALGORITHM.md §1 and §6. Greedy requests are left out (both methods agree).
    """
    cu = cu_num_draft_tokens.tolist()
    out = []
    for b in range(len(cu) - 1):
        temp = float(temperature[b])
        n = min(cu[b + 1] - cu[b], max_spec_len)
        if not temp > 0:
            continue
        rows = sanitize_logits(target_logits[cu[b] + b:cu[b] + b + n + 1].double()) / temp
        q = torch.softmax(rows, -1)
        x = draft_token_ids[cu[b]:cu[b] + n].long()
        if draft_probs is None:
            p = torch.nn.functional.one_hot(x, q.shape[1]).double()
        else:
            p = draft_probs[cu[b]:cu[b] + n].double()
        ratio = [min(1.0, float(q[i, x[i]] / p[i, x[i]])) if p[i, x[i]] > 0 else 1.0 for i in range(n)]
        token = sum(math.prod(ratio[:i + 1]) for i in range(n))
        # Block: P_i, h_i with R_i = sum_x max(P_i q_{i+1} - p_{i+1}, 0), h_n = P_n.
        P = [1.0]
        for i in range(n):
            num, den = P[-1] * float(q[i, x[i]]), float(p[i, x[i]])
            P.append(1.0 if num >= den and num > 0 else (0.0 if num >= den else num / den))
        h = []
        for i in range(1, n + 1):
            if i == n:
                h.append(P[n])
                continue
            residual = float(torch.where(q[i] > 0, (P[i] * q[i] - p[i]).clamp(min=0), 0.0).sum())
            den = residual + 1 - P[i]
            h.append(residual / den if den > 0 else 1.0)
        block = sum(1 - math.prod(1 - hj for hj in h[i:]) for i in range(n))
        out.append((token, block))
    return out


class ExpectationRecorder:
    """Wraps ``hf.rejection_sample`` (as the engine calls it) and records ``expected_accepted``
    of every call; ``take()`` returns and clears them."""

    def __init__(self):
        self._real = hf.rejection_sample
        self._steps: list[tuple[float, float]] = []

    def __call__(self, target_logits, draft_token_ids, cu, draft_probs, temperature, seeds, offsets,
                 max_spec_len, *args, **kwargs):
        self._steps += expected_accepted(target_logits, draft_token_ids, cu, draft_probs, temperature,
                                         max_spec_len)
        return self._real(target_logits, draft_token_ids, cu, draft_probs, temperature, seeds, offsets,
                          max_spec_len, *args, **kwargs)

    def take(self) -> list[tuple[float, float]]:
        steps, self._steps = self._steps, []
        return steps


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and its standard error (sample standard deviation / sqrt(n))."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, float("nan")
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def summarize(rows: list[dict]) -> str:
    """Markdown table: per drafter and method, tokens/step and acceptance (mean +- SE over runs),
    then the paired block - token difference of tokens/step."""
    runs = defaultdict(dict)  # (drafter, seed, prompt) -> method -> row
    for row in rows:
        runs[(row["drafter"], row["seed"], row["prompt"])][row["method"]] = row
    lines = ["| drafter | method | runs | tokens | tokens/step (mean +- SE) | accepted/step | acceptance |",
             "|---|---|---|---|---|---|---|"]
    diffs = []
    for drafter in sorted({key[0] for key in runs}):
        paired = [by_method for key, by_method in runs.items() if key[0] == drafter and len(by_method) == 2]
        for method in METHODS:
            mine = [by_method[method] for by_method in paired]
            tps = mean_se([r["tokens"] / r["request_steps"] for r in mine])
            aps = mean_se([r["accepted"] / r["request_steps"] for r in mine])
            acc = sum(r["accepted"] for r in mine) / max(sum(r["proposed"] for r in mine), 1)
            lines.append(f"| {drafter} | {method} | {len(mine)} | {sum(r['tokens'] for r in mine)} | "
                         f"{tps[0]:.3f} +- {tps[1]:.3f} | {aps[0]:.3f} +- {aps[1]:.3f} | {acc:.3f} |")
        d = mean_se([m["block"]["tokens"] / m["block"]["request_steps"] - m["token"]["tokens"] / m["token"]["request_steps"]
                     for m in paired])
        z = d[0] / d[1] if d[1] > 0 else float("nan")
        diffs.append(f"{drafter}: block - token = {d[0]:+.3f} +- {d[1]:.3f} tokens/step "
                     f"({z:+.1f} SE) over {len(paired)} paired runs")
        expected = [step for key, by_method in runs.items() if key[0] == drafter
                    for row in by_method.values() for step in row.get("expected", [])]
        if expected:
            tok = mean_se([e[0] for e in expected])
            blk = mean_se([e[1] for e in expected])
            gain = mean_se([e[1] - e[0] for e in expected])
            diffs.append(f"{drafter}: expected accepted drafts per step given the drafts, over {len(expected)} "
                         f"steps: token {tok[0]:.4f} +- {tok[1]:.4f}, block {blk[0]:.4f} +- {blk[1]:.4f}, "
                         f"block - token {gain[0]:+.4f} +- {gain[1]:.4f} ({gain[0] / tok[0]:+.1%})")
    return "\n".join(lines + [""] + diffs)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.summarize:
        with open(args.summarize) as f:
            print(summarize([json.loads(line) for line in f if line.strip()]))
        return 0
    torch.set_num_threads(1)  # batch-1 forwards of a 135M model: memory-bound (the main job's default)
    target, tokenizer = default_model.load_gguf()
    prompts = [(p.kind, default_model.prompt_token_ids(tokenizer, p.text, True)) for p in default_model.BUILTIN_PROMPTS]
    recorder = ExpectationRecorder()
    hf.rejection_sample = recorder  # speculative_generate calls it through the module
    names = args.drafter or ["early-exit", "prompt-lookup"]
    built = {name: drafters.make_drafter(name, target, exit_layer=args.exit_layer, max_ngram=3, min_ngram=2)
             for name in names}
    if args.greedy_check:
        recorder.take()
        for name, drafter in built.items():
            outputs = {method: hf.speculative_generate(target, drafter, [ids for _, ids in prompts],
                                                       max_new_tokens=32, num_draft_tokens=args.k,
                                                       method=method).tokens for method in METHODS}
            same = outputs["token"] == outputs["block"]
            print(f"greedy {name}: block == token on {len(prompts)} prompts: {same}", flush=True)
            if not same:
                return 1
    with open(args.out, "a") as out:
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            for label, ids in prompts:
                for name, drafter in built.items():
                    for method in METHODS:
                        start = time.perf_counter()
                        result = hf.speculative_generate(target, drafter, [ids], max_new_tokens=args.max_new_tokens,
                                                         num_draft_tokens=args.k, temperature=args.temperature,
                                                         seed=seed, method=method)
                        s = result.stats
                        row = dict(seed=seed, prompt=label, drafter=name, method=method, k=args.k,
                                   temperature=args.temperature, tokens=s.num_generated_tokens,
                                   request_steps=s.num_request_steps, accepted=s.num_accepted_tokens,
                                   proposed=s.num_draft_tokens, seconds=time.perf_counter() - start,
                                   expected=[[round(t, 6), round(b, 6)] for t, b in recorder.take()])
                        out.write(json.dumps(row) + "\n")
                        out.flush()
            print(f"seed {seed} done", file=sys.stderr, flush=True)
    with open(args.out) as f:
        print(summarize([json.loads(line) for line in f if line.strip()]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
