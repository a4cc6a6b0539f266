"""Speculative generation from the command line, with the speedup over the target's ``generate``.

    python -m specdec_kernels.generate --target PATH --draft PATH --prompt "Once upon a time" \\
        [--prompt ...] [--max-new-tokens 64 --k 4 --temperature 0 --top-k 0 --top-p 1 --seed 0]

Models and the tokenizer (the target's) load from local directories or the local Hugging Face
cache; nothing is downloaded unless ``--allow-download`` is given. After a short warm-up of
both paths, the speculative run and the target's own ``model.generate`` (the same prompts,
left-padded into one batch when there are several, same sampling settings) are timed in the
same process; the summary gives tokens per step, the acceptance rate, tokens/s of both and
the speedup. Needs transformers (``pip install 'specdec_kernels[hf]'``).
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from . import hf


class _Progress:
    """tqdm when it is installed, else a plain counter on stderr."""

    def __init__(self, total: int, desc: str):
        self.total, self.count, self.desc = total, 0, desc
        try:
            from tqdm import tqdm
        except ImportError:
            self._bar = None
        else:
            self._bar = tqdm(total=total, desc=desc, unit="tok", file=sys.stderr)

    def update(self, info: hf.StepInfo) -> None:
        self.count += info.num_new_tokens
        if self._bar is not None:
            self._bar.update(info.num_new_tokens)
        else:
            print(f"\r{self.desc}: {self.count}/{self.total} tokens", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        else:
            print(file=sys.stderr)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m specdec_kernels.generate", description=__doc__.split("\n")[0])
    parser.add_argument("--target", required=True, help="target model: a local directory or a cached hub name")
    drafter = parser.add_mutually_exclusive_group(required=True)
    drafter.add_argument("--draft", help="draft model sharing the target's tokenizer (directory or cached name)")
    drafter.add_argument("--prompt-lookup", action="store_true", help="draft by prompt lookup (n-grams), no model")
    parser.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4, help="draft tokens per step")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="auto = bfloat16 on CUDA, float32 otherwise")
    parser.add_argument("--allow-download", action="store_true", help="let transformers download missing models")
    parser.add_argument("--no-baseline", action="store_true", help="skip timing the target's own generate")
    return parser.parse_args(argv)


def _dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    return getattr(torch, name)


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def _baseline(target, tokenizer, prompt_ids: list[list[int]], args, eos: set[int]) -> tuple[list[list[int]], float]:
    """The target's own ``generate`` on the same prompts: new tokens per prompt and seconds."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (min(eos) if eos else 0)
    width = max(len(ids) for ids in prompt_ids)
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in prompt_ids], device=args.device)
    attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompt_ids], device=args.device)
    # top_k=0 and top_p=1 switch HF's warpers off (a None would leave generation_config's defaults).
    sampling = dict(do_sample=True, temperature=args.temperature, top_k=max(args.top_k, 0),
                    top_p=args.top_p) if args.temperature > 0 else dict(do_sample=False)
    torch.manual_seed(args.seed)
    _sync(args.device)
    start = time.perf_counter()
    out = target.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=args.max_new_tokens,
                          pad_token_id=pad, eos_token_id=sorted(eos) or None, **sampling)
    _sync(args.device)
    seconds = time.perf_counter() - start
    tokens = []
    for row in out[:, width:].tolist():
        stop = next((j for j, t in enumerate(row) if t in eos), None)
        tokens.append(row if stop is None else row[:stop + 1])
    return tokens, seconds


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = parse_args(argv)
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    local = not args.allow_download
    # transformers 4.56 renamed from_pretrained's torch_dtype to dtype.
    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    dtype_kwarg = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    dtype = _dtype(args.dtype, args.device)

    def load(name):
        model = AutoModelForCausalLM.from_pretrained(name, local_files_only=local, **{dtype_kwarg: dtype})
        return model.to(args.device).eval()

    tokenizer = AutoTokenizer.from_pretrained(args.target, local_files_only=local)
    target = load(args.target)
    draft = hf.PromptLookupDrafter() if args.prompt_lookup else load(args.draft)
    prompt_ids = [tokenizer(p)["input_ids"] for p in args.prompt]
    eos = hf._eos_set(None, target)
    common = dict(num_draft_tokens=args.k, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)

    # Warm-up: first calls pay for allocations, kernel selection and Triton compilation.
    hf.speculative_generate(target, draft, prompt_ids, max_new_tokens=min(4, args.max_new_tokens), seed=args.seed,
                            **common)
    if not args.no_baseline:
        warm = argparse.Namespace(**{**vars(args), "max_new_tokens": min(4, args.max_new_tokens)})
        _baseline(target, tokenizer, prompt_ids, warm, eos)

    progress = _Progress(len(prompt_ids) * args.max_new_tokens, "speculative")
    _sync(args.device)
    result = hf.speculative_generate(target, draft, prompt_ids, max_new_tokens=args.max_new_tokens, seed=args.seed,
                                     on_step=progress.update, **common)
    _sync(args.device)
    progress.close()

    for prompt, tokens in zip(args.prompt, result.tokens):
        print(f"--- {prompt!r}\n{tokenizer.decode(tokens, skip_special_tokens=True)}")
    stats = result.stats
    print("\n=== summary")
    print(f"requests {len(prompt_ids)} | steps {stats.num_steps} | tokens {stats.num_generated_tokens} | "
          f"tokens/step {stats.tokens_per_step:.3f} | acceptance {stats.acceptance_rate:.3f} "
          f"({stats.num_accepted_tokens}/{stats.num_draft_tokens} drafts)")
    print(f"speculative: {stats.wall_time_s:.3f} s, {stats.tokens_per_second:.1f} tokens/s "
          f"(draft {stats.draft_time_s:.3f} s, target {stats.target_time_s:.3f} s, verify {stats.verify_time_s:.3f} s)")
    if not args.no_baseline:
        base_tokens, base_seconds = _baseline(target, tokenizer, prompt_ids, args, eos)
        base_count = sum(len(t) for t in base_tokens)
        base_rate = base_count / base_seconds
        print(f"target.generate: {base_seconds:.3f} s, {base_count} tokens, {base_rate:.1f} tokens/s")
        print(f"speedup (tokens/s): {stats.tokens_per_second / base_rate:.2f}x")
        if args.temperature <= 0:
            same = sum(a == b for a, b in zip(result.tokens, base_tokens))
            print(f"greedy outputs identical to target.generate: {same}/{len(base_tokens)} prompts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
