"""The float64 oracle every backend is tested against, and the one definition of the random streams.

- ``philox``: the counter-based Philox4x32-10 streams every backend draws from (docs/ALGORITHM.md §2);
- ``chain`` / ``tree``: vectorized PyTorch references of the two ops, docs/ALGORITHM.md read literally;
- ``sampling_filters``: top-k / top-p / min-p, the sort-based definition.

Pure PyTorch: this package imports nothing else of specdec_kernels.
"""
from .chain import rejection_sample_reference
from .common import chunked_categorical, gather_rows, sanitize_logits
from .tree import tree_rejection_sample_reference

__all__ = ["chunked_categorical", "gather_rows", "rejection_sample_reference", "sanitize_logits",
           "tree_rejection_sample_reference"]
