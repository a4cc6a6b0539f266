"""Kernels behind ``torch.ops.specdec.*`` that live in Python, and the fake implementations.

Registrations only: the schemas are defined once, in C++ (csrc/ops.cpp). Registered here, for
each op:
- CPU: nothing for ``rejection_sample`` and ``tree_rejection_sample``, whose CPU key the fused C++
  kernels of specdec_kernels._C own (csrc/cpu/); the reference (specdec_kernels.reference, float64)
  for the private twins below;
- Meta/fake: output shapes only, for torch.compile and FakeTensor tracing;
- CUDA: the fused Triton kernel, unless the C++ extension has a fused CUDA kernel for the op
  (which then owns the CUDA key; today rejection_sample). If neither is available, calling
  the op on CUDA tensors raises an error that says so. The CUDA C++ kernels run the sampling
  filters (top_k / top_p / min_p) with their own threshold pass on sm_90 and newer; on older
  GPUs they refuse them, and the Python API's backend "auto" sends filtered calls to Triton.
"""
from __future__ import annotations

import functools

import torch

from . import _C  # noqa: F401  (loads the schemas, and the CUDA kernels when built)
from .checks import check_rejection_sample_inputs, check_tree_rejection_sample_inputs
from .reference import rejection_sample_reference, tree_rejection_sample_reference
from .reference.philox import draw_seeds

REJECTION_SAMPLE = "specdec::rejection_sample"
TREE_REJECTION_SAMPLE = "specdec::tree_rejection_sample"

for _name in ("rejection_sample", "tree_rejection_sample", "_rejection_sample_triton", "_tree_rejection_sample_triton",
              "_rejection_sample_cuda_filters", "_tree_rejection_sample_cuda_filters"):
    if not hasattr(torch.ops.specdec, _name):
        raise ImportError(
            f"specdec_kernels._C defines no specdec::{_name}: the compiled extension is older than the "
            "Python package; rebuild it (pip install --no-build-isolation -e .)")

try:
    from .triton.chain import rejection_sample_triton
    from .triton.common import inner_contiguous
    from .triton.tree import tree_rejection_sample_triton
    TRITON_IMPORT_ERROR: str | None = None
except ImportError as e:  # triton is an optional dependency
    rejection_sample_triton = tree_rejection_sample_triton = None
    TRITON_IMPORT_ERROR = str(e)

# Ops whose CUDA dispatch key a C++ kernel of specdec_kernels._C owns (checked before Python
# registers anything): the others get the Triton kernel on CUDA.
_CUDA_BUILT = {op: torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA")
               for op in (REJECTION_SAMPLE, TREE_REJECTION_SAMPLE)}


def cpu_kernel_built(op: str = REJECTION_SAMPLE) -> bool:
    """True when specdec_kernels._C registers the fused C++ CPU kernel of ``op`` (every build does)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(op, "CPU")


def cuda_kernel_built(op: str = REJECTION_SAMPLE) -> bool:
    """True when the fused CUDA C++ kernel of ``op`` was compiled into specdec_kernels._C."""
    return _CUDA_BUILT[op]


def triton_call(target_logits, draft_token_ids, cu_num_draft_tokens, draft_probs, temperature,
                seeds, offsets, max_spec_len, method="token", top_k=None, top_p=None, min_p=None, lenience=None):
    """The Triton chain kernel on checked inputs (seeds drawn when absent)."""
    if seeds is None:
        seeds = draw_seeds(cu_num_draft_tokens.shape[0] - 1, target_logits.device)
    tensors = (target_logits, draft_token_ids, cu_num_draft_tokens, draft_probs, temperature, seeds, offsets)
    filters = (inner_contiguous(t) for t in (top_k, top_p, min_p))
    return rejection_sample_triton(*(inner_contiguous(t) for t in tensors), max_spec_len, method=method,
                                   **dict(zip(("top_k", "top_p", "min_p"), filters)),
                                   lenience=_lenience_f32(lenience))


def tree_triton_call(target_logits, tokens, parents, cu_num_nodes, draft_probs, temperature, seeds,
                     offsets, max_depth, top_k=None, top_p=None, min_p=None, lenience=None):
    """The Triton tree kernel on checked inputs (seeds drawn when absent)."""
    if seeds is None:
        seeds = draw_seeds(cu_num_nodes.shape[0] - 1, target_logits.device)
    tensors = (target_logits, tokens, parents, cu_num_nodes, draft_probs, temperature, seeds, offsets)
    filters = (inner_contiguous(t) for t in (top_k, top_p, min_p))
    return tree_rejection_sample_triton(*(inner_contiguous(t) for t in tensors), max_depth,
                                        **dict(zip(("top_k", "top_p", "min_p"), filters)),
                                        lenience=_lenience_f32(lenience))


def _lenience_f32(lenience):
    """The kernels read lenience as a contiguous float32 vector (None stays None: exact)."""
    return None if lenience is None else lenience.to(torch.float32).contiguous()


_lib = torch.library.Library("specdec", "IMPL")


@torch.library.register_fake(REJECTION_SAMPLE)
def _rejection_sample_fake(target_logits, draft_token_ids, cu_num_draft_tokens, draft_probs,
                           temperature, seeds, offsets, max_spec_len, method="token", top_k=None,
                           top_p=None, min_p=None, lenience=None):
    batch = cu_num_draft_tokens.shape[0] - 1
    out = target_logits.new_empty((batch, max_spec_len + 1), dtype=torch.int32)
    return out, target_logits.new_empty((batch,), dtype=torch.int32)


@torch.library.register_fake("specdec::_rejection_sample_cuda_filtered")
def _rejection_sample_cuda_filtered_fake(target_logits, draft_token_ids, cu_num_draft_tokens, draft_probs,
                                         temperature, seeds, offsets, max_spec_len, method, row_thresholds,
                                         lenience=None):
    return _rejection_sample_fake(target_logits, draft_token_ids, cu_num_draft_tokens, draft_probs, temperature,
                                  seeds, offsets, max_spec_len, method)


@torch.library.register_fake("specdec::_tree_rejection_sample_cuda_filtered")
def _tree_rejection_sample_cuda_filtered_fake(target_logits, tokens, parents, cu_num_nodes, draft_probs,
                                              temperature, seeds, offsets, max_depth, row_thresholds, lenience=None):
    return _tree_rejection_sample_fake(target_logits, tokens, parents, cu_num_nodes, draft_probs, temperature,
                                       seeds, offsets, max_depth)


def _rejection_sample_cpu(target_logits, draft_token_ids, cu_num_draft_tokens, draft_probs,
                          temperature, seeds, offsets, max_spec_len, method="token", top_k=None,
                          top_p=None, min_p=None, lenience=None):
    check_rejection_sample_inputs(target_logits, draft_token_ids, cu_num_draft_tokens, draft_probs,
                                  temperature, seeds, offsets, max_spec_len, method, top_k, top_p, min_p,
                                  lenience)
    if seeds is None:
        seeds = draw_seeds(cu_num_draft_tokens.shape[0] - 1, target_logits.device)
    return rejection_sample_reference(target_logits, draft_token_ids, cu_num_draft_tokens, draft_probs,
                                      temperature, seeds, offsets, max_spec_len, method=method,
                                      top_k=top_k, top_p=top_p, min_p=min_p, lenience=lenience)


def _no_gpu_backend(op: str):
    raise RuntimeError(
        f"{op} on CUDA: no GPU backend is available -- the CUDA kernel was not built into "
        f"specdec_kernels._C and triton cannot be imported ({TRITON_IMPORT_ERROR})")


def _rejection_sample_cuda_triton(target_logits, draft_token_ids, cu_num_draft_tokens, draft_probs,
                                  temperature, seeds, offsets, max_spec_len, method="token", top_k=None,
                                  top_p=None, min_p=None, lenience=None):
    if rejection_sample_triton is None:
        _no_gpu_backend(REJECTION_SAMPLE)
    check_rejection_sample_inputs(target_logits, draft_token_ids, cu_num_draft_tokens, draft_probs,
                                  temperature, seeds, offsets, max_spec_len, method, top_k, top_p, min_p,
                                  lenience)
    return triton_call(target_logits, draft_token_ids, cu_num_draft_tokens, draft_probs, temperature,
                       seeds, offsets, max_spec_len, method, top_k, top_p, min_p, lenience)


@torch.library.register_fake(TREE_REJECTION_SAMPLE)
def _tree_rejection_sample_fake(target_logits, tokens, parents, cu_num_nodes, draft_probs, temperature,
                                seeds, offsets, max_depth, top_k=None, top_p=None, min_p=None, lenience=None):
    batch = cu_num_nodes.shape[0] - 1
    out = target_logits.new_empty((batch, max_depth + 1), dtype=torch.int32)
    nodes = target_logits.new_empty((batch, max_depth + 1), dtype=torch.int32)
    return out, nodes, target_logits.new_empty((batch,), dtype=torch.int32)


def _tree_rejection_sample_cpu(target_logits, tokens, parents, cu_num_nodes, draft_probs, temperature,
                               seeds, offsets, max_depth, top_k=None, top_p=None, min_p=None, lenience=None):
    check_tree_rejection_sample_inputs(target_logits, tokens, parents, cu_num_nodes, draft_probs,
                                       temperature, seeds, offsets, max_depth, top_k, top_p, min_p, lenience)
    if seeds is None:
        seeds = draw_seeds(cu_num_nodes.shape[0] - 1, target_logits.device)
    return tree_rejection_sample_reference(target_logits, tokens, parents, cu_num_nodes, draft_probs,
                                           temperature, seeds, offsets, max_depth, top_k=top_k, top_p=top_p,
                                           min_p=min_p, lenience=lenience)


def _tree_rejection_sample_cuda_triton(target_logits, tokens, parents, cu_num_nodes, draft_probs,
                                       temperature, seeds, offsets, max_depth, top_k=None, top_p=None,
                                       min_p=None, lenience=None):
    if tree_rejection_sample_triton is None:
        _no_gpu_backend(TREE_REJECTION_SAMPLE)
    check_tree_rejection_sample_inputs(target_logits, tokens, parents, cu_num_nodes, draft_probs,
                                       temperature, seeds, offsets, max_depth, top_k, top_p, min_p, lenience)
    return tree_triton_call(target_logits, tokens, parents, cu_num_nodes, draft_probs, temperature,
                            seeds, offsets, max_depth, top_k, top_p, min_p, lenience)


# Private twins of the two ops (schemas in csrc/ops.cpp): ``_rejection_sample_triton`` /
# ``_tree_rejection_sample_triton`` always run the Triton kernel on CUDA tensors (backend
# "triton", and what "auto" calls with sampling filters on GPUs older than sm_90);
# ``_*_cuda_filters`` are the CUDA C++ kernels' threshold pass and kernel (C++ only:
# bindings/filters_cuda.cu). Ops rather than plain Python calls, so that torch.compile(fullgraph=True)
# and CUDA graphs see one opaque call either way; the reference on CPU tensors.
# Each twin: (fake, CPU kernel = the reference, CUDA kernel or None).
for _name, (_fake, _cpu, _cuda) in {
    "_rejection_sample_triton": (_rejection_sample_fake, _rejection_sample_cpu, _rejection_sample_cuda_triton),
    "_tree_rejection_sample_triton": (_tree_rejection_sample_fake, _tree_rejection_sample_cpu,
                                      _tree_rejection_sample_cuda_triton),
    "_rejection_sample_cuda_filters": (_rejection_sample_fake, _rejection_sample_cpu, None),
    "_tree_rejection_sample_cuda_filters": (_tree_rejection_sample_fake, _tree_rejection_sample_cpu, None),
}.items():
    torch.library.register_fake(f"specdec::{_name}")(_fake)
    _lib.impl(_name, _cpu, "CPU")
    if _cuda is not None:
        _lib.impl(_name, _cuda, "CUDA")


@torch.library.register_fake("specdec::_row_thresholds_cuda")
def _row_thresholds_cuda_fake(target_logits, cu, temperature, top_k, top_p, min_p, tree, max_rows):
    slots = target_logits.shape[0] if tree else (cu.shape[0] - 1) * max_rows
    return target_logits.new_empty((slots,), dtype=torch.float32)


@functools.cache
def cuda_filters_supported(device_index: int) -> bool:
    """True when the CUDA C++ kernels run sampling filters themselves on this GPU: the kernels
    are built and their threshold pass (thread-block clusters) has sm_90 or newer."""
    return (_CUDA_BUILT[REJECTION_SAMPLE] and _CUDA_BUILT[TREE_REJECTION_SAMPLE]
            and torch.cuda.get_device_capability(device_index)[0] >= 9)

# rejection_sample and tree_rejection_sample on CPU tensors: the C++ kernels (csrc/cpu/) own the
# key; the reference stays reachable as backend="reference" (chain.py, tree.py call it directly).
for _op in (REJECTION_SAMPLE, TREE_REJECTION_SAMPLE):
    if not cpu_kernel_built(_op):
        raise ImportError(f"specdec_kernels._C registers no CPU kernel for {_op}: the compiled extension is older "
                          "than the Python package; rebuild it (pip install --no-build-isolation -e .)")
if not _CUDA_BUILT[REJECTION_SAMPLE]:
    _lib.impl("rejection_sample", _rejection_sample_cuda_triton, "CUDA")
if not _CUDA_BUILT[TREE_REJECTION_SAMPLE]:
    _lib.impl("tree_rejection_sample", _tree_rejection_sample_cuda_triton, "CUDA")
