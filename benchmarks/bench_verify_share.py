"""The share of a verify step spent in rejection sampling, on random-weight HF models (GPU).

A verify step is the target's forward over every request's K drafts + 1 (on top of a KV cache
of ``--prefix`` tokens) and then the rejection sampling that decides what to keep. This times
both parts on Llama-shaped random-weight targets, with

- our op (``specdec_kernels.rejection_sample``, the fastest built GPU backend, probabilistic
  drafts: ``draft_probs`` from the draft model's softmax),
- the straightforward PyTorch pipeline an engine would write first (``torch_pipeline``),

and reports each one's share of the step: sampling / (target forward + sampling). The draft
model's K decoding steps are timed too, for context (they are not part of the verify step).

Weights are random (normal, std 0.02) and in bf16: speed does not depend on their values. The
models are built from configs on the meta device and materialized on the GPU, so nothing is
downloaded. Each model that does not fit the card is skipped with a message.

    python benchmarks/bench_verify_share.py --out DIR      # CSV + markdown table in DIR

The CSV is in the long format of results_csv.py: one row per timed part (target forward, draft
steps, our op, the PyTorch pipeline; eager medians), `share` on the two samplers' rows; append it
to benchmarks/results/verify_share.csv with `python benchmarks/results_csv.py append`.

Needs transformers (present on the GPU machine).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import specdec_kernels  # noqa: E402
from torch_pipeline import torch_pipeline  # noqa: E402
import results_csv  # noqa: E402

# (name, config kwargs): Llama-3.1-8B / Llama-3.2-1B shapes (vocabulary 128256, shared), and a
# Qwen2.5-32B-shaped target with its vocabulary (152064) for the largest pair that fits 80 GB.
MODELS = {
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    "qwen-32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                     num_key_value_heads=8, vocab_size=152064),
    "qwen-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                      num_key_value_heads=2, vocab_size=152064, tie_word_embeddings=True),
}
PAIRS = [("llama-8b", "llama-1b"), ("qwen-32b", "qwen-0.5b")]


def build_model(name: str, device: str):
    """A random-weight LlamaForCausalLM of the named shape, bf16, on ``device``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(max_position_embeddings=8192, **MODELS[name])
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)  # bf16 before memory exists: no fp32 copy
    model = model.to_empty(device=device)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02)
    # Rotary frequencies are non-persistent buffers, garbage after to_empty: rebuild those modules.
    for name, module in list(model.named_modules()):
        if "inv_freq" in dict(module.named_buffers(recurse=False)):
            parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
            setattr(parent, name.rpartition(".")[2], type(module)(config=model.config).to(device))
    return model.eval()


def median_ms(fn, repeats: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def prefill_cache(model, batch: int, prefix: int):
    """A DynamicCache holding ``prefix`` random tokens for each of ``batch`` requests."""
    from transformers import DynamicCache

    cache = DynamicCache()
    ids = torch.randint(0, model.config.vocab_size, (batch, prefix), device="cuda")
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    return cache


def crop(cache, length: int):
    """Drop the cache's tokens past ``length`` (a negative count: accepted by transformers 4.x and 5.x)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def measure_pair(target_name: str, draft_name: str, batches: list[int], k: int, prefix: int,
                 temperature: float) -> list[dict]:
    rows = []
    target = build_model(target_name, "cuda")
    draft = build_model(draft_name, "cuda")
    vocab = target.config.vocab_size
    params = sum(p.numel() for p in target.parameters()) / 1e9
    draft_params = sum(p.numel() for p in draft.parameters()) / 1e9
    for batch in batches:
        torch.manual_seed(batch)
        target_cache = prefill_cache(target, batch, prefix)
        draft_cache = prefill_cache(draft, batch, prefix)
        drafts = torch.randint(0, vocab, (batch, k), device="cuda")
        last = torch.randint(0, vocab, (batch, 1), device="cuda")
        verify_ids = torch.cat([last, drafts], 1)  # [B, K+1]: the last committed token, then the drafts

        def target_forward():
            with torch.no_grad():
                logits = target(verify_ids, past_key_values=target_cache, use_cache=True).logits
            crop(target_cache, prefix)
            return logits

        def draft_steps():
            # K batch decoding steps of the draft, each sampling (here: reading) its next token.
            with torch.no_grad():
                token = last
                for _ in range(k):
                    probs = torch.softmax(draft(token, past_key_values=draft_cache, use_cache=True).logits[:, -1]
                                          .float() / temperature, -1)
                    token = torch.multinomial(probs, 1)
            crop(draft_cache, prefix)

        logits = target_forward()  # [B, K+1, V] bf16
        with torch.no_grad():
            draft_logits = draft(verify_ids[:, :k], past_key_values=draft_cache, use_cache=True).logits
        crop(draft_cache, prefix)
        draft_probs = torch.softmax(draft_logits.float() / temperature, -1)  # [B, K, V]
        temp = torch.full((batch,), temperature, device="cuda")
        seeds = torch.arange(batch, device="cuda", dtype=torch.int64)
        flat_logits = logits.reshape(batch * (k + 1), vocab)
        flat_drafts = drafts.reshape(-1)
        flat_probs = draft_probs.reshape(batch * k, vocab)
        cu = torch.arange(0, batch * k + 1, k, device="cuda", dtype=torch.int32)

        def ours():
            return specdec_kernels.rejection_sample(flat_logits, flat_drafts, cu, flat_probs, temp, seeds,
                                                    max_spec_len=k)

        def pipeline():
            return torch_pipeline(logits, drafts, draft_probs, temp)

        forward_ms = median_ms(target_forward)
        draft_ms = median_ms(draft_steps, repeats=10)
        ours_ms = median_ms(ours)
        pipeline_ms = median_ms(pipeline)
        backend = specdec_kernels.backends.resolve_backend(None, flat_logits.device)
        row = dict(card=torch.cuda.get_device_name(), torch=torch.__version__, target=target_name,
                   target_params_b=round(params, 2), draft=draft_name, draft_params_b=round(draft_params, 2),
                   vocab=vocab, batch=batch, k=k, prefix=prefix, backend=backend,
                   target_forward_ms=round(forward_ms, 3), draft_k_steps_ms=round(draft_ms, 3),
                   ours_ms=round(ours_ms, 4), torch_pipeline_ms=round(pipeline_ms, 4),
                   ours_share=round(ours_ms / (forward_ms + ours_ms), 4),
                   torch_pipeline_share=round(pipeline_ms / (forward_ms + pipeline_ms), 4))
        print(row, flush=True)
        rows.append(row)
        del target_cache, draft_cache, logits, draft_probs, flat_probs
        torch.cuda.empty_cache()
    del target, draft
    torch.cuda.empty_cache()
    return rows


def result_rows(rows: list[dict]) -> list[dict]:
    """The rows in the long format of results_csv: one row per timed part, time in us."""
    run = results_csv.run_info("verify_share")
    out = []
    for r in rows:
        base = dict(run, card=r["card"], torch=r["torch"], op="chain", method="token", B=r["batch"], K=r["k"],
                    V=r["vocab"], logits_dtype="bf16", draft_probs="fp32", mode="eager", target=r["target"],
                    target_params_b=r["target_params_b"], draft=r["draft"], draft_params_b=r["draft_params_b"],
                    prefix=r["prefix"])
        for backend, key, share in (("target forward (HF, SDPA)", "target_forward_ms", None),
                                    ("draft K steps (HF)", "draft_k_steps_ms", None),
                                    (f"ours ({r['backend']})", "ours_ms", "ours_share"),
                                    ("torch pipeline", "torch_pipeline_ms", "torch_pipeline_share")):
            out.append(dict(base, backend=backend, time_us=round(1000 * r[key], 3),
                            **({"share": r[share]} if share else {})))
    return out


def markdown(rows: list[dict]) -> str:
    lines = ["| card | target (B params) | draft | B | target forward ms | draft K steps ms | our op ms | "
             "share | torch pipeline ms | share |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['card']} | {r['target']} ({r['target_params_b']}) | {r['draft']} | {r['batch']} | "
                     f"{r['target_forward_ms']:.2f} | {r['draft_k_steps_ms']:.2f} | {r['ours_ms']:.3f} | "
                     f"{100 * r['ours_share']:.2f}% | {r['torch_pipeline_ms']:.3f} | "
                     f"{100 * r['torch_pipeline_share']:.2f}% |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--prefix", type=int, default=1024, help="tokens already in each request's KV cache")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--pairs", default=",".join(f"{t}:{d}" for t, d in PAIRS))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_verify_share needs a GPU", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    for pair in args.pairs.split(","):
        target_name, draft_name = pair.split(":")
        try:
            rows += measure_pair(target_name, draft_name, batches, args.k, args.prefix, args.temperature)
        except torch.OutOfMemoryError as error:
            print(f"skipped {pair}: does not fit ({str(error).splitlines()[0]})", flush=True)
            torch.cuda.empty_cache()
    if rows:
        results_csv.write(os.path.join(args.out, "verify_share.csv"), result_rows(rows))
        table = markdown(rows)
        with open(os.path.join(args.out, "verify_share.md"), "w") as f:
            f.write(table + "\n")
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
