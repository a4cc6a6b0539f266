"""The fused Triton kernels (they run on CPU tensors in Triton's interpreter, TRITON_INTERPRET=1).

Imports flow one way: ``common`` (Philox, sanitize, workspace) -> ``stream`` (the row stream of
the chain and tree kernels) -> ``filters`` (top-k / top-p / min-p threshold pass) -> ``chain``
and ``tree`` (kernel -> launcher) and ``vocab_parallel`` (the kernels of the vocabulary-parallel
ops); ``config`` holds their launch parameters. Importing this package needs triton.
"""
from .chain import rejection_sample_triton
from .config import FilterConfig, VerifyConfig
from .tree import tree_rejection_sample_triton

__all__ = ["FilterConfig", "VerifyConfig", "rejection_sample_triton", "tree_rejection_sample_triton"]
