"""Which implementation runs a call, and which ones this install has.

Backends: "cpu" (fused C++ kernels for CPU tensors, compiled into specdec_kernels._C in every
build: csrc/cpu/), "cuda" (fused CUDA C++ kernel, compiled into specdec_kernels._C when built with
CUDA), "triton" (fused Triton kernel), "reference" (vectorized PyTorch in float64, any device; the
oracle of the tests). "auto" = what ``torch.ops.specdec.*`` dispatches to: on CUDA tensors the CUDA
kernel when built, else Triton; on CPU tensors the C++ CPU kernel (the ops' CPU dispatch). The
environment variable SPECDEC_BACKEND sets the default of the Python API's ``backend=`` argument
(engines that call ``torch.ops`` directly always get "auto").
"""
from __future__ import annotations

import os

import torch

from . import _ops

BACKENDS = ("auto", "cpu", "cuda", "triton", "reference")


def available_backends(op: str = _ops.REJECTION_SAMPLE) -> dict[str, str]:
    """Each backend of ``op`` ("specdec::rejection_sample" or "specdec::tree_rejection_sample")
    with "available" or the reason it is not."""
    status = {"reference": "available"}
    if _ops.cpu_kernel_built(op):
        status["cpu"] = "available"
    else:
        status["cpu"] = "not built (specdec_kernels._C registers no CPU kernel: rebuild the extension)"
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
    if backend == "cpu":
        if device.type != "cpu":
            raise ValueError(f"backend 'cpu' needs CPU tensors, got tensors on {device}")
        if not _ops.cpu_kernel_built(op):
            raise RuntimeError(f"backend 'cpu' of {op} is {available_backends(op)['cpu']}")
    if backend == "triton":
        if _ops.rejection_sample_triton is None:
            raise RuntimeError(f"backend 'triton' is {available_backends()['triton']}")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"backend 'triton' needs CUDA tensors (or TRITON_INTERPRET=1 set before importing "
                f"triton, to run it on the CPU), got tensors on {device}")
    return backend
