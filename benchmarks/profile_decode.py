"""Where a decoding step of the main job's target goes on a GPU (issue #37, item 5).

Times ``target.generate`` (greedy, the main job's baseline) per token, then profiles a few
tokens of it with ``torch.profiler``: CUDA kernels launched per token, host time per token,
the host-side synchronizations (``cudaStreamSynchronize`` / ``cudaDeviceSynchronize`` /
device-to-host copies) per token and the ops with the most host time. It also times a plain
loop of single-token forwards with the model's dynamic cache (no ``generate`` machinery) and,
with ``--static``, ``generate`` with a static cache, to split the step's cost between the
model's own forward and the generation loop around it.

    python benchmarks/profile_decode.py --device cuda --dtype bfloat16
"""
from __future__ import annotations

import argparse
import time

import torch

from specdec_kernels.hf import default_model


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_generate(model, ids, new_tokens: int, device: str, **kwargs) -> float:
    """Milliseconds per generated token of ``model.generate`` (greedy), after one warm-up."""
    for _ in range(2):
        _sync(device)
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **kwargs)
        _sync(device)
        elapsed = time.perf_counter() - t0
    return 1e3 * elapsed / (out.shape[1] - ids.shape[1])


@torch.no_grad()
def time_forward_loop(model, ids, new_tokens: int, device: str) -> float:
    """Milliseconds per token of a bare loop: one forward per token, argmax kept on the device."""
    for _ in range(2):
        _sync(device)
        t0 = time.perf_counter()
        out = model(ids, use_cache=True)
        cache = out.past_key_values
        token = out.logits[:, -1:].argmax(-1)
        for _ in range(new_tokens - 1):
            out = model(token, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            token = out.logits[:, -1:].argmax(-1)
        _sync(device)
        elapsed = time.perf_counter() - t0
    return 1e3 * elapsed / new_tokens


def profile_generate(model, ids, new_tokens: int, device: str, top: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        _sync(device)
    events = prof.key_averages()
    per = 1.0 / new_tokens
    kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    print(f"CUDA kernels per token: {kernels * per:.0f}")
    syncs = {name: 0 for name in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync",
                                  "cudaLaunchKernel", "aten::item", "aten::_local_scalar_dense")}
    for e in events:
        if e.key in syncs:
            syncs[e.key] += e.count
    print("per token: " + ", ".join(f"{k} {v * per:.1f}" for k, v in syncs.items()))
    cpu_ops = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CPU),
                     key=lambda e: e.self_cpu_time_total, reverse=True)
    total_self = sum(e.self_cpu_time_total for e in cpu_ops)
    print(f"host self time per token: {total_self * per / 1e3:.2f} ms over "
          f"{sum(e.count for e in cpu_ops) * per:.0f} host events")
    print(f"{'op':48s} {'calls/token':>11s} {'self ms/token':>13s}")
    for e in cpu_ops[:top]:
        print(f"{e.key[:48]:48s} {e.count * per:11.1f} {e.self_cpu_time_total * per / 1e3:13.3f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--top", type=int, default=25, help="host ops listed")
    parser.add_argument("--static", action="store_true", help="also time generate with a static cache")
    parser.add_argument("--target", help="a .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    path = args.target or default_model.default_model_path()
    model, _ = default_model.load_gguf(path, dtype)
    model = model.to(args.device).eval()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, device {args.device}, "
          f"dtype {args.dtype}, parameters on {next(model.parameters()).device}")
    ids = torch.randint(100, 20000, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(0))
    ids = ids.to(args.device)
    print(f"generate:            {time_generate(model, ids, args.new_tokens, args.device):7.2f} ms/token")
    print(f"forward loop:        {time_forward_loop(model, ids, args.new_tokens, args.device):7.2f} ms/token")
    if args.static:
        try:
            ms = time_generate(model, ids, args.new_tokens, args.device, cache_implementation="static")
            print(f"generate, static:    {ms:7.2f} ms/token")
        except Exception as exc:  # a diagnostic: report and go on
            print(f"generate, static: failed: {type(exc).__name__}: {exc}")
    profile_generate(model, ids, min(args.new_tokens, 16), args.device, args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
