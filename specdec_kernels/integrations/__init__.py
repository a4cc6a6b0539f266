"""Adapters that plug ``specdec_kernels`` into inference engines.

- ``specdec_kernels.integrations.vllm``: a drop-in for vLLM V1's rejection sampler
  (``vllm/v1/sample/rejection_sampler.py``); it does not import vLLM.

Each adapter is imported explicitly (``from specdec_kernels.integrations import vllm``), so
that importing this package loads no engine code. docs/INTEGRATION.md has the how-to.
"""
