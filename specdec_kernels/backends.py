"""Which implementation runs a call, and which ones this install has.

Backends: "cuda" (fused CUDA C++ kernel, compiled into specdec_kernels._C), "triton" (fused
Triton kernel), "reference" (vectorized PyTorch, any device; the CPU dispatch of the ops).
"auto" = what ``torch.ops.specdec.*`` dispatches to: the CUDA kernel when built, else Triton,
on CUDA tensors; the reference on CPU tensors. The environment variable SPECDEC_BACKEND sets
the default of the Python API's ``backend=`` argument (engines that call ``torch.ops``
directly always get "auto").
"""
from __future__ import annotations

import os

import torch

from . import _ops

BACKENDS = ("auto", "cuda", "triton", "reference")


def available_backends(op: str = _ops.REJECTION_SAMPLE) -> dict[str, str]:
    """Each backend of ``op`` ("specdec::rejection_sample" or "specdec::tree_rejection_sample")
    with "available" or the reason it is not."""
    status = {"reference": "available"}
    if _ops.rejection_sample_triton is None:
        status["triton"] = f"not installed ({_ops.TRITON_IMPORT_ERROR})"
    else:
        status["triton"] = "available"
    if _ops.cuda_kernel_built(op):
        status["cuda"] = "available"
    else:
        status["cuda"] = ("not built (specdec_kernels._C was compiled without CUDA: install with a CUDA "
                          "build of torch and the CUDA toolkit, without SPECDEC_SKIP_CUDA=1)")
    return status


def resolve_backend(backend: str | None, device: torch.device, op: str = _ops.REJECTION_SAMPLE) -> str:
    backend = backend or os.environ.get("SPECDEC_BACKEND") or "auto"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "cuda":
        if device.type != "cuda":
            raise ValueError(f"backend 'cuda' needs CUDA tensors, got tensors on {device}")
        if not _ops.cuda_kernel_built(op):
            raise RuntimeError(f"backend 'cuda' of {op} is {available_backends(op)['cuda']}")
    if backend == "triton":
        if _ops.rejection_sample_triton is None:
            raise RuntimeError(f"backend 'triton' is {available_backends()['triton']}")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"backend 'triton' needs CUDA tensors (or TRITON_INTERPRET=1 set before importing "
                f"triton, to run it on the CPU), got tensors on {device}")
    return backend
