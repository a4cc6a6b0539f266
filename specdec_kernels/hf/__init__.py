"""Speculative generation with Hugging Face models on the verify ops: the application layer.

- ``speculative``: ``speculative_generate`` (chains and trees, a draft model, prompt lookup or a
  tree drafter), the per-request KV caches and the ``Drafter`` interface;
- ``drafters``: drafters by name (early exit, prompt lookup, draft models, trees);
- ``default_model``: the embedded SmolLM2-135M model file and the built-in prompts;
- ``cli``: ``python -m specdec_kernels.generate``, the main job (docs/MAIN_JOB.md).

Needs transformers (``pip install 'specdec_kernels[hf]'``); the kernel library does not.
"""
from .speculative import (CachedCausalLM, Drafter, GenerationResult, GenerationStats, ModelDrafter,
                          PromptLookupDrafter, SamplingParams, StepInfo, TreeDrafter, TreeSpec, lookahead_by_theory,
                          request_generators, speculative_generate)

__all__ = ["CachedCausalLM", "Drafter", "GenerationResult", "GenerationStats", "ModelDrafter", "PromptLookupDrafter",
           "SamplingParams", "StepInfo", "TreeDrafter", "TreeSpec", "lookahead_by_theory", "request_generators",
           "speculative_generate"]
