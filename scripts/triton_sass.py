"""SASS of the Triton chain (or tree) kernel's streaming loops, without a GPU: instruction counts.

Compiles ``_rejection_sample_kernel`` (``--tree``: ``_tree_rejection_sample_kernel``) for sm_90
exactly as the launcher's JIT call would on a GPU: the launcher runs on CPU tensors shaped like
the benchmark's call with the launch captured, and Triton's own binder specializes the captured
arguments (integers equal to 1 become constants; integers divisible by 16 and 16-byte aligned
pointers are marked, so loads vectorize as they do at V = 128256). It assembles the kernel with
Triton's bundled ptxas, disassembles it with its nvdisasm, then prints the registers, the stack
(spills) and, for each loop that streams logits (contains a 16-byte global load), its length and
its most frequent instructions.

    python scripts/triton_sass.py [--batch 32] [--logits fp32] [--draft-probs] [--sms 132]
        [--warps 4] [--set NAME=VALUE ...] [--tree NODES] [--lenience] [--out DIR]   (keeps the .ttgir / .ptx / .sass there)

The counts are static: a loop's body includes its branches (the greedy argmax, the excluded
draft's chunk), so the path a random request takes is shorter (docs/DECISIONS.md,
"triton-halves").

The code depends on the Triton version: compile with the one the GPU runs (the GPU machine:
3.6), e.g. ``pip install --no-deps --target /tmp/triton36 triton==3.6.0`` and
``PYTHONPATH=/tmp/triton36 python scripts/triton_sass.py``. A variant that looked 30% shorter
under Triton 3.8 went through shared memory under 3.6 and ran slower (docs/DECISIONS.md, "triton-tile-pieces").
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
os.environ.pop("TRITON_INTERPRET", None)  # triton.jit must give compilable functions
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # the benchmarks' dtypes and tree shapes


def _value(text: str):
    return {"True": True, "False": False}.get(text, int(text) if text.lstrip("-").isdigit() else text)


class _Capture:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kwargs)`` records the call."""

    def __init__(self):
        self.call = {}

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.call.update(args=args, kwargs=kwargs)


@contextlib.contextmanager
def _gpu_launch(module, kernel: str, sms: int):
    """Within: ``module.kernel`` records its launch (a ``_Capture``, yielded), and the launcher
    rules that ask the device answer as on an sm_90 GPU of ``sms`` SMs, so a launcher run on CPU
    tensors passes the kernel what it would there: the split's program target, programmatic
    dependent launch, the L2 prefetch (``common.prefetch_tiles`` asks ``common.sm90``) and the
    chunk tables stored from registers (``asm_table_enabled``, looked up in ``module``, which
    imports it by name)."""
    from specdec_kernels.triton import common

    capture = _Capture()
    stand_ins = [(module, kernel, capture),
                 (common, "target_programs", lambda device, programs_per_sm: programs_per_sm * sms),
                 (common, "sm90", lambda device: True),
                 (module, "asm_table_enabled", lambda device, asm_table=True: asm_table)]
    if hasattr(module, "pdl_enabled"):
        stand_ins.append((module, "pdl_enabled", lambda device: True))
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in stand_ins]
    for owner, name, value in stand_ins:
        setattr(owner, name, value)
    try:
        yield capture
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def launcher_call(batch: int, k: int, vocab: int, logits: str, draft_probs: bool, sms: int, lenience: bool = False):
    """(args, kwargs) the launcher passes to ``_rejection_sample_kernel`` for the benchmark's call
    (bench_rejection_sample.make_inputs: a uniform batch, temperatures, seeds and offsets) on a GPU
    of ``sms`` SMs with launch overlap: ``rejection_sample_triton`` runs on CPU tensors with the
    launch captured, not made (``_gpu_launch``)."""
    import torch
    from bench_rejection_sample import DTYPES
    from specdec_kernels.triton import chain as module

    dtype = DTYPES[logits]
    with _gpu_launch(module, "_rejection_sample_kernel", sms) as capture:
        module.rejection_sample_triton(
            torch.zeros(batch * (k + 1), vocab, dtype=dtype), torch.zeros(batch * k, dtype=torch.int64),
            torch.arange(0, (batch + 1) * k, k, dtype=torch.int32),
            torch.zeros(batch * k, vocab) if draft_probs else None, torch.ones(batch),
            torch.arange(batch, dtype=torch.int64), torch.zeros(batch, dtype=torch.int64), k,
            lenience=torch.full((batch,), 0.5) if lenience else None)
    return capture.call["args"], capture.call["kwargs"]


def tree_launcher_call(batch: int, nodes: int, vocab: int, logits: str, draft_probs: bool, sms: int,
                       lenience: bool = False):
    """``launcher_call`` for the tree kernel: ``batch`` copies of the tree benchmark's shape of
    ``nodes`` nodes (bench_tree_rejection_sample.TREES; 64 is the tree bar's)."""
    import torch
    from bench_rejection_sample import DTYPES
    from bench_tree_rejection_sample import TREES, tree_depth
    from specdec_kernels.triton import tree as module

    if nodes not in TREES:
        raise SystemExit(f"--tree: the tree benchmark's shapes have {sorted(TREES)} nodes, not {nodes}")
    dtype = DTYPES[logits]
    n = batch * nodes
    parents = torch.tensor(TREES[nodes], dtype=torch.int32).repeat(batch)
    with _gpu_launch(module, "_tree_rejection_sample_kernel", sms) as capture:
        module.tree_rejection_sample_triton(
            torch.zeros(n, vocab, dtype=dtype), torch.zeros(n, dtype=torch.int64), parents,
            torch.arange(0, n + 1, nodes, dtype=torch.int32), torch.zeros(n, vocab) if draft_probs else None,
            torch.ones(batch), torch.arange(batch, dtype=torch.int64), torch.zeros(batch, dtype=torch.int64),
            tree_depth(TREES[nodes]), lenience=torch.full((batch,), 0.5) if lenience else None)
    return capture.call["args"], capture.call["kwargs"]


def compile_kernel(args, kwargs, overrides: dict, tree: bool = False):
    """``_rejection_sample_kernel`` (with ``tree``: ``_tree_rejection_sample_kernel``) compiled for
    sm_90 from the JIT's own specialization of this call: integer arguments equal to 1 become
    constants, those divisible by 16 (and 16-byte aligned pointers) are marked so, as on a GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature
    from specdec_kernels.triton import chain as module
    from specdec_kernels.triton import tree as tree_module

    fn = tree_module._tree_rejection_sample_kernel if tree else module._rejection_sample_kernel
    kwargs = {**kwargs, **overrides}
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args, specialization, options)
    kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
    names = [p.name for p in fn.params]
    shown = {names[path[0]]: value for path, value in constexprs.items()}
    return {"ttgir": kernel.asm["ttgir"], "ptx": kernel.asm["ptx"], "constexprs": shown}


def disassemble(ptx: str, workdir: Path) -> tuple[str, str]:
    import triton
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    (workdir / "kernel.ptx").write_text(ptx)
    subprocess.run([str(tools / "ptxas"), "-arch=sm_90a", str(workdir / "kernel.ptx"), "-o",
                    str(workdir / "kernel.cubin")], check=True)
    sass = subprocess.run([str(tools / "nvdisasm"), "-c", str(workdir / "kernel.cubin")], check=True,
                          capture_output=True, text=True).stdout
    usage = subprocess.run([str(tools / "cuobjdump"), "-res-usage", str(workdir / "kernel.cubin")],
                           capture_output=True, text=True).stdout
    return sass, usage


def streaming_loops(sass: str):
    """(start, end, body) of each loop (a backward branch) whose body has a 16-byte global load."""
    instructions, labels = [], {}
    for line in sass.splitlines():
        label = re.match(r"^\.(L_x_\d+):", line.strip())
        if label:
            labels[label.group(1)] = len(instructions)
            continue
        op = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if op:
            instructions.append(op.group(2).strip())
    for end, text in enumerate(instructions):
        target = re.search(r"BRA\s+`\(\.(L_x_\d+)\)", text)
        if target and labels.get(target.group(1), end + 1) <= end:
            body = instructions[labels[target.group(1)]:end + 1]
            if any("LDG.E.128" in op for op in body):
                yield labels[target.group(1)], end, body


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32, help="requests (K = 4 drafts each), default 32")
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--logits", default="bf16", choices=["bf16", "fp16", "fp32"], help="the logits' dtype")
    parser.add_argument("--draft-probs", action="store_true", help="with fp32 draft probabilities")
    parser.add_argument("--lenience", action="store_true", help="a lenient call (lenience 0.5: HAS_LENIENCE)")
    parser.add_argument("--sms", type=int, default=132, help="the GPU's SMs (the launcher's split), default 132")
    parser.add_argument("--warps", type=int, default=None, help="num_warps (default: the launcher's)")
    parser.add_argument("--tree", type=int, default=0, metavar="NODES",
                        help="the tree kernel instead: --batch copies of the tree benchmark's shape of NODES "
                             "nodes (8, 16 or 64)")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="a constexpr of the kernel, e.g. GROUP=16")
    parser.add_argument("--out", default=None, help="folder for the .ttgir / .ptx / .sass")
    args = parser.parse_args()
    import triton
    if args.tree:
        call_args, call_kwargs = tree_launcher_call(args.batch, args.tree, args.vocab, args.logits, args.draft_probs,
                                                    args.sms, args.lenience)
    else:
        call_args, call_kwargs = launcher_call(args.batch, 4, args.vocab, args.logits, args.draft_probs, args.sms,
                                               args.lenience)
    overrides = dict((kv.split("=", 1)[0], _value(kv.split("=", 1)[1])) for kv in args.set)
    if args.warps:
        overrides["num_warps"] = args.warps
    warps = overrides.get("num_warps", call_kwargs["num_warps"])
    compiled = compile_kernel(call_args, call_kwargs, overrides, tree=bool(args.tree))
    workdir = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="triton_sass_"))
    workdir.mkdir(parents=True, exist_ok=True)
    sass, usage = disassemble(compiled["ptx"], workdir)
    (workdir / "kernel.ttgir").write_text(compiled["ttgir"])
    (workdir / "kernel.sass").write_text(sass)
    registers = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)  # bytes of local memory a thread: spills
    print(f"Triton {triton.__version__}, sm_90, {args.logits} logits, {warps} warps, {registers.group(1) if registers else '?'} registers, "
          f"{stack.group(1) if stack else '?'} bytes of stack, {sass.count(';')} instructions; "
          f"constexprs {compiled['constexprs']}")
    for line in compiled["ttgir"].splitlines():
        if line.startswith("#blocked"):
            print(" ", line.split("=", 1)[0].strip(), line.split("<", 1)[1].rstrip(">"))
    for start, end, body in streaming_loops(sass):
        ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", op).split()[0] for op in body)
        top = ", ".join(f"{n} {op}" for op, n in ops.most_common(8))
        barriers = sum(n for op, n in ops.items() if op.startswith("BAR"))
        spills = sum(n for op, n in ops.items() if op.startswith(("STL", "LDL")))
        print(f"loop [{start}, {end}]: {len(body)} instructions, {ops['LDG.E.128']} LDG.E.128, "
              f"{barriers} BAR, {ops['SHFL.BFLY']} SHFL, {spills} spill accesses | {top}")
    print(f"files: {workdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
