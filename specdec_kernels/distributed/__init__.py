"""Vocabulary-parallel verification over torch.distributed (tensor-parallel LM heads): each rank
verifies on its own vocabulary shard of the logits and the ranks exchange O(rows) numbers
instead of all-gathering the logits (``vocab_parallel``; docs/INTEGRATION.md)."""
from .vocab_parallel import rejection_sample_vocab_parallel, tree_rejection_sample_vocab_parallel

__all__ = ["rejection_sample_vocab_parallel", "tree_rejection_sample_vocab_parallel"]
