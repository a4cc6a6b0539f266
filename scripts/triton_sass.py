"""SASS of the Triton chain kernel's streaming loops, without a GPU: instruction counts.

Compiles ``_rejection_sample_kernel`` for sm_90 the way the launcher's JIT call does on a GPU
(16-byte aligned pointers and a row stride and vocabulary divisible by 16 marked as such, so
loads vectorize as they do at V = 128256), assembles it with Triton's bundled ptxas and
disassembles it with its nvdisasm, then prints the registers and, for each loop that streams
logits (contains a 16-byte global load), its length and its most frequent instructions.

    python scripts/triton_sass.py [--warps 4] [--logits fp32] [--set HAS_DRAFT_PROBS=True ...]
        [--out DIR]   (keeps the .ttgir / .ptx / .sass there)

The counts are static: a loop's body includes its branches (the greedy argmax, the excluded
draft's chunk), so the path a random request takes is shorter (docs/PERF.md, section "The
Triton chain kernel's instructions").

The code depends on the Triton version: compile with the one the GPU runs (the GPU machine:
3.6), e.g. ``pip install --no-deps --target /tmp/triton36 triton==3.6.0`` and
``PYTHONPATH=/tmp/triton36 python scripts/triton_sass.py``. A variant that looked 30% shorter
under Triton 3.8 went through shared memory under 3.6 and ran 1.4-3.6x slower (PERF.md).
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
os.environ.pop("TRITON_INTERPRET", None)  # triton.jit must give compilable functions
sys.path.insert(0, str(ROOT / "python_tests"))
sys.path.insert(0, str(ROOT))


def _value(text: str):
    return {"True": True, "False": False}.get(text, int(text) if text.lstrip("-").isdigit() else text)


def compile_chain_kernel(warps: int, overrides: dict, logits: str = "bf16") -> dict:
    import triton_sm90_compile as sm90
    from specdec_kernels import triton_rejection_sample as module

    fn = module._rejection_sample_kernel
    constexprs = [p.name for p in fn.params if p.is_constexpr]
    flags = sm90.flags(constexprs)
    values = {n: False if n in flags else sm90.constexpr_value(module, n) for n in constexprs}
    # The benchmark's call: a uniform batch with temperatures, launch overlap on.
    values.update({n: True for n in ("UNIFORM", "USE_PDL", "HAS_TEMPERATURE") if n in values})
    values.update(overrides)
    kernel = sm90.compile_variant(module, fn, values, "*" + logits, warps,
                                  aligned=("logits_row_stride", "vocab_size"))
    return {"ttgir": kernel.asm["ttgir"], "ptx": kernel.asm["ptx"], "constexprs": values}

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
    parser.add_argument("--warps", type=int, default=None, help="num_warps (default: the launcher's NUM_WARPS)")
    parser.add_argument("--logits", default="bf16", choices=["bf16", "fp16", "fp32"], help="the logits' dtype")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="a constexpr of the kernel, e.g. GROUP=16 or HAS_DRAFT_PROBS=True")
    parser.add_argument("--out", default=None, help="folder for the .ttgir / .ptx / .sass")
    args = parser.parse_args()
    import triton
    from specdec_kernels import triton_rejection_sample as module
    warps = args.warps or module.NUM_WARPS
    overrides = dict((kv.split("=", 1)[0], _value(kv.split("=", 1)[1])) for kv in args.set)
    compiled = compile_chain_kernel(warps, overrides, args.logits)
    workdir = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="triton_sass_"))
    workdir.mkdir(parents=True, exist_ok=True)
    sass, usage = disassemble(compiled["ptx"], workdir)
    (workdir / "kernel.ttgir").write_text(compiled["ttgir"])
    (workdir / "kernel.sass").write_text(sass)
    registers = re.search(r"REG:(\d+)", usage)
    print(f"Triton {triton.__version__}, sm_90, {args.logits} logits, {warps} warps, {registers.group(1) if registers else '?'} registers, "
          f"{sass.count(';')} instructions; constexprs {compiled['constexprs']}")
    for line in compiled["ttgir"].splitlines():
        if line.startswith("#blocked"):
            print(" ", line.split("=", 1)[0].strip(), line.split("<", 1)[1].rstrip(">"))
    for start, end, body in streaming_loops(sass):
        ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", op).split()[0] for op in body)
        top = ", ".join(f"{n} {op}" for op, n in ops.most_common(8))
        print(f"loop [{start}, {end}]: {len(body)} instructions, {ops['LDG.E.128']} LDG.E.128, "
              f"{sum(op.startswith('BAR') for op in ops.elements())} BAR, {ops['SHFL.BFLY']} SHFL | {top}")
    print(f"files: {workdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
