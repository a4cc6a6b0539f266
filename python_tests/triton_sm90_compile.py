"""Compile our Triton kernels for sm_90 on a machine without a GPU.

The CPU test suite runs the kernels in Triton's interpreter, which does not type-check the way
the compiler does (an ``if`` whose branches give a variable different integer types compiles
in the interpreter and fails on the GPU). This script compiles each kernel with
``triton.compile`` for an sm_90 target -- front end, MLIR passes and PTX, no GPU needed --
over its constexpr variants. ``test_triton_compile.py`` runs it in a subprocess, because the
tests' process has TRITON_INTERPRET=1 set, under which ``triton.jit`` returns interpreted
functions.

    python python_tests/triton_sm90_compile.py KERNEL [i/n]

Besides the constexpr variants, each kernel is compiled once with every integer argument equal
to 1, as Triton specializes it at run time (a Python int then, without tensor methods).

KERNEL: chain, tree, filters_stats, filters_threshold, vocab_parallel or vocab_parallel_tree_fused. i/n: only every n-th variant from the i-th, to split a slow kernel
over several tests.
"""
from __future__ import annotations

import importlib
import itertools
import os
import sys

KERNELS = {
    "chain": ("specdec_kernels.triton.chain", ["_rejection_sample_kernel"]),
    "tree": ("specdec_kernels.triton.tree", ["_tree_rejection_sample_kernel"]),
    # The threshold pass's two kernels apart: its threshold kernel alone takes ~7 min on a 2-core
    # machine (18 variants), so test_triton_compile.py compiles it in two shards.
    "filters_stats": ("specdec_kernels.triton.filters", ["_filter_stats_kernel"]),
    "filters_threshold": ("specdec_kernels.triton.filters", ["_filter_threshold_kernel"]),
    "vocab_parallel": ("specdec_kernels.triton.vocab_parallel",
                       ["_chain_local_stats_kernel", "_chain_final_totals_kernel", "_chunk_race_kernel",
                        "_chunk_pick_kernel", "_chain_finish_kernel", "_philox01_kernel"]),
    "vocab_parallel_tree_fused": ("specdec_kernels.triton.vocab_parallel",
                                  ["_tree_local_stats_kernel", "_tree_residual_mass_kernel",
                                   "_tree_final_totals_kernel", "_tree_chunk_pick_kernel", "_tree_finish_kernel"]),
}
LOGITS_TYPES = ("*bf16", "*fp16", "*fp32")


def pointer_type(module, name: str, logits_type: str, probs_type: str) -> str:
    """The element type of a ``*_ptr`` argument: the module's ``POINTER_TYPES``, else by its
    name (the launchers' conventions)."""
    if name in getattr(module, "POINTER_TYPES", {}):
        return module.POINTER_TYPES[name]
    if name.startswith("logits"):
        return logits_type
    if name.startswith("draft_probs"):
        return probs_type
    if name.startswith(("seeds", "offsets", "draft_ids", "tokens")):
        return "*i64"
    if name.startswith(("temperature", "top_p", "min_p", "lenience", "rec_m", "rec_s", "table", "residual_sum",
                        "thr", "cmax", "buf", "kept")):
        return "*fp32"
    return "*i32"


def constexpr_value(module, name: str):
    """A constexpr's shipped value: the module's constant, the default configs' field, or a size."""
    from specdec_kernels.reference.philox import SAMPLE_CHUNK, STREAM_SAMPLE
    from specdec_kernels.triton.common import CU_BLOCK
    from specdec_kernels.triton.config import FilterConfig, VerifyConfig
    if hasattr(module, name):
        return getattr(module, name)
    if hasattr(module, "FILTER_" + name):  # the threshold pass's fixed sizes (triton/filters.py)
        return getattr(module, "FILTER_" + name)
    shipped = {"CHUNK": SAMPLE_CHUNK, "STREAM": STREAM_SAMPLE, "CU_BLOCK": CU_BLOCK, "GROUP": VerifyConfig().group,
               "PREFETCH": VerifyConfig().prefetch, "CAP": FilterConfig().cap, "TILE": FilterConfig().tile,
               "PIVOT_TILE": FilterConfig().pivot_tile, "FAST_EXP": True}
    if name in shipped:
        return shipped[name]
    if name == "CHUNKS_PAD":
        return 512
    if name.endswith("_PAD"):
        return 8
    raise KeyError(f"no value for constexpr {name}: add it to triton_sm90_compile.py")


def flags(names: list[str]) -> list[str]:
    """Boolean constexprs: HAS_* switches, *_VERIFY modes, the threshold pass's switches and the
    chain kernel's launch-shape and A/B switches."""
    return [n for n in names if n.startswith("HAS_") or n.endswith("_VERIFY")
            or n in ("TREE", "KEPT_SET", "EXCLUDE_DRAFT", "UNIFORM", "USE_PDL", "ASM_TABLE")]


def variants(flag_names: list[str]):
    """All flags off, all on, and each one alone on and alone off, with each logits dtype on the
    all-on variant: every branch compiled without the full cross product."""
    seen = set()
    base = [dict.fromkeys(flag_names, False), dict.fromkeys(flag_names, True)]
    for name in flag_names:
        base.append({n: n == name for n in flag_names})
        base.append({n: n != name for n in flag_names})
    for setting, logits_type in itertools.chain(((s, "*bf16") for s in base),
                                                ((base[1], t) for t in LOGITS_TYPES)):
        key = (tuple(sorted(setting.items())), logits_type)
        if key not in seen:
            seen.add(key)
            yield setting, logits_type


def compile_variant(module, fn, values: dict, logits_type: str, num_warps: int):
    """``triton.compile`` of ``fn`` for sm_90 with the constexprs ``values``; pointer element
    types from ``logits_type``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(fn.arg_names)
    probs_type = "*fp32" if logits_type != "*fp16" else "*fp16"
    signature = {n: "constexpr" if n in values else
                 pointer_type(module, n, logits_type, probs_type) if n.endswith("_ptr") else "i32" for n in names}
    source = ASTSource(fn=fn, signature=signature, constexprs={(names.index(n),): v for n, v in values.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def compile_kernel(which: str, shard: str = "0/1") -> int:
    """Compile the variants of ``which``; shard "i/n": only every n-th variant from the i-th."""
    index, shards = (int(x) for x in shard.split("/"))
    os.environ.pop("TRITON_INTERPRET", None)
    module = importlib.import_module(KERNELS[which][0])
    count = 0
    for kernel in KERNELS[which][1]:
        fn = getattr(module, kernel)
        constexprs = [p.name for p in fn.params if p.is_constexpr]

        def values_of(setting: dict) -> dict:
            return {n: setting[n] if n in setting else constexpr_value(module, n) for n in constexprs}

        jobs = [(f"{logits_type} {setting}", values_of(setting), logits_type)
                for number, (setting, logits_type) in enumerate(variants(flags(constexprs)))
                if number % shards == index]
        if index == 0:
            # Triton passes an integer argument equal to 1 as a constant (a Python int, no .to()):
            # every integer argument at once, on the all-on variant.
            values = values_of(dict.fromkeys(flags(constexprs), True))
            ones = {n: 1 for n in fn.arg_names if n not in values and not n.endswith("_ptr")}
            jobs.append(("*bf16 with its integer arguments = 1", {**values, **ones}, "*bf16"))
        for label, values, logits_type in jobs:
            try:
                compile_variant(module, fn, values, logits_type, 4)
            except Exception as error:  # report the variant, then fail
                print(f"FAILED {which} {kernel} {label}: {type(error).__name__}: {error}", file=sys.stderr)
                cause = error.__cause__ or error.__context__
                while cause is not None:  # the nested call's error says what is wrong
                    print(f"caused by {type(cause).__name__}: {cause}", file=sys.stderr)
                    cause = cause.__cause__ or cause.__context__
                return 1
            count += 1
    print(f"compiled {which}: {count} variants for sm_90")
    return 0


if __name__ == "__main__":
    sys.exit(compile_kernel(*sys.argv[1:3]))
