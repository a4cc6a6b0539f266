"""Where greedy speculative output leaves ``target.generate``'s, and at which logit margin.

Greedy speculative decoding emits the argmax of the target's logits at every position, like
``model.generate(do_sample=False)``; the two differ only in *how* those logits are computed:
the verify forward scores 1 + K positions at once (other matrix shapes, so other kernels and
accumulation orders) and its KV cache holds keys and values computed that way, while
``generate`` decodes one token per forward. In float32 the differences are ~1e-6 relative; in
bfloat16 they are ~1e-2, and the logits themselves are rounded to bf16 (8 significant bits: at
a logit of 16 adjacent values are 0.125 apart), so two tokens whose logits are within a few
bf16 steps can swap places. Once a token differs, the texts go separate ways.

For every built-in prompt (``specdec_kernels.hf.default_model``) and drafter this script runs
``generate`` (keeping its logits) and ``speculative_generate``, finds the first position where
the tokens differ and prints the target's top-1 minus top-2 logit margin there, as ``generate``
computed it, with the bf16 spacing of the top logit. It also prints, over all positions
``generate`` decoded, how many had a margin at most that large, which says how rare such
near-ties are. The docs' guarantee (docs/MAIN_JOB.md, "Exactness") rests on its output.

    python benchmarks/greedy_divergence.py --device cuda --dtype bfloat16 --max-new-tokens 128
    python benchmarks/greedy_divergence.py --device cuda --dtype float32      # expect no divergence
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from specdec_kernels.hf import default_model, drafters
from specdec_kernels.hf import speculative as hf

DRAFTERS = ("prompt-lookup", "prompt-lookup-tree", "early-exit", "early-exit-tree")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4, help="drafts per step (chains)")
    parser.add_argument("--exit-layer", type=int, default=22)
    parser.add_argument("--drafter", action="append", choices=DRAFTERS,
                        help=f"drafters to check (default: all of {', '.join(DRAFTERS)})")
    parser.add_argument("--target", help="a .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1 or args.k < 1:
        parser.error("--max-new-tokens and --k must be >= 1")
    return args


def bf16_spacing(value: float) -> float:
    """The distance between adjacent bfloat16 numbers at ``value`` (8 significant bits)."""
    v = torch.tensor([abs(value)], dtype=torch.bfloat16)
    up = (v.view(torch.int16) + 1).view(torch.bfloat16)
    return (up.float() - v.float()).item()


def margins(logits: torch.Tensor) -> torch.Tensor:
    """Top-1 minus top-2 of every row [n, V] (float32)."""
    top = logits.float().topk(2, dim=-1).values
    return top[:, 0] - top[:, 1]


def main(argv=None) -> int:
    args = parse_args(argv)
    dtype = getattr(torch, args.dtype)
    model, tokenizer = default_model.load_gguf(args.target, dtype)
    model = model.to(args.device)
    eos = hf._eos_set(None, model)
    names = args.drafter or list(DRAFTERS)
    print(f"model {default_model.MODEL_FILE_NAME if args.target is None else args.target}, {args.dtype} on "
          f"{args.device}, {args.max_new_tokens} new tokens, K = {args.k}, exit layer {args.exit_layer}")
    print(f"{'prompt':<10} {'drafter':<20} {'identical':>9} {'first diff':>10} {'margin':>8} {'bf16 step':>9} "
          f"{'positions with margin <= it':>28}")
    identical, divergences = 0, []
    start = time.perf_counter()
    for prompt in default_model.BUILTIN_PROMPTS:
        ids = default_model.prompt_token_ids(tokenizer, prompt.text)
        input_ids = torch.tensor([ids], device=args.device)
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=args.max_new_tokens,
                             do_sample=False, eos_token_id=sorted(eos), pad_token_id=min(eos),
                             output_logits=True, return_dict_in_generate=True)
        reference = out.sequences[0, len(ids):].tolist()
        logits = torch.cat([row for row in out.logits])  # [n, V], one row per decoded position
        reference_margins = margins(logits).cpu()
        for name in names:
            drafter = drafters.make_drafter(name, model, exit_layer=args.exit_layer, max_ngram=8, min_ngram=1,
                                            tree_spec=hf.TreeSpec(num_draft_nodes=8, top_k=4, max_depth=4))
            k = None if isinstance(drafter, hf.TreeDrafter) else args.k
            result = hf.speculative_generate(model, drafter, [ids], max_new_tokens=args.max_new_tokens,
                                             num_draft_tokens=k)
            tokens = result.tokens[0]
            first = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), None)
            if first is None and len(tokens) != len(reference):
                first = min(len(tokens), len(reference))
            if first is None:
                identical += 1
                print(f"{prompt.kind:<10} {name:<20} {'yes':>9} {'-':>10} {'-':>8} {'-':>9} {'-':>28}", flush=True)
                continue
            margin = reference_margins[first].item() if first < len(reference_margins) else float("nan")
            top = logits[first].float().max().item() if first < len(logits) else float("nan")
            near = int((reference_margins <= margin).sum())
            divergences.append(margin)
            print(f"{prompt.kind:<10} {name:<20} {'no':>9} {first:>10} {margin:>8.4f} {bf16_spacing(top):>9.4f} "
                  f"{near:>12} of {len(reference_margins):<13}", flush=True)
    runs = len(default_model.BUILTIN_PROMPTS) * len(names)
    print(f"\nidentical: {identical}/{runs} runs ({time.perf_counter() - start:.0f} s)")
    if divergences:
        print(f"margins at the first divergence: max {max(divergences):.4f}, "
              f"all: {', '.join(f'{m:.4f}' for m in sorted(divergences))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
