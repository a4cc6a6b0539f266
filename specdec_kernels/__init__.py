"""specdec_kernels: fused kernels for the verify step of speculative decoding.

``torch.ops.specdec.rejection_sample`` verifies chains of drafts and
``torch.ops.specdec.tree_rejection_sample`` trees of drafts; the Python functions below
validate, pick a backend and document the arguments; ``tree_utils`` builds the tree
attention mask, position ids, KV-cache indices and EAGLE-style trees. See README.md and
docs/ALGORITHM.md.
"""
from . import _ops  # noqa: F401  (registers the ops' Python kernels)
from . import tree_utils  # noqa: F401
from .backends import available_backends
from .chain import rejection_sample, rejection_sample_padded
from .tree import tree_rejection_sample
from .reference import rejection_sample_reference, tree_rejection_sample_reference

__all__ = ["available_backends", "rejection_sample", "rejection_sample_padded", "rejection_sample_reference",
           "tree_rejection_sample", "tree_rejection_sample_reference"]
__version__ = "0.1.0"
