// Every specdec op schema, defined once, here, for every backend and every build.
//
// Kernels register themselves elsewhere, per dispatch key:
// - CPU: the fused C++ kernels of the public ops (csrc/cpu/, every build); the private twins'
//   CPU kernel (the reference), Meta/fake, and the Triton kernels on CUDA: from Python
//   (specdec_kernels/_ops.py);
// - the fused CUDA kernels, when the extension is built with CUDA: the torch bindings in
//   csrc/bindings/ (chain_cuda.cu, tree_cuda.cu, filters_cuda.cu), with TORCH_LIBRARY_IMPL blocks only.
// A schema whose kernel exists only in some builds (the CUDA bindings' private ops, the profiling
// build's trace) is still defined in every build: calling it where the kernel is missing raises
// torch's own "could not run ... with arguments from the ... backend" error. Code that needs to
// know whether a kernel exists asks the dispatcher (torch._C._dispatch_has_kernel_for_dispatch_key,
// as specdec_kernels/_ops.py does), not hasattr(torch.ops.specdec, name).
#include <Python.h>
#include <torch/library.h>

extern "C" {
// `import specdec_kernels._C` loads this library, which runs the registrations below.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(specdec, m) {
  // ---------------------------------------------------------------------------- public ops

  // Chain verification. CPU: the fused C++ kernel (cpu/chain_cpu.cpp); CUDA: the fused CUDA kernel
  // (bindings/chain_cuda.cu) when built, else the Triton kernel (specdec_kernels/_ops.py).
  m.def(
      "rejection_sample(Tensor target_logits, Tensor draft_token_ids, Tensor cu_num_draft_tokens, "
      "Tensor? draft_probs, Tensor? temperature, Tensor? seeds, Tensor? offsets, int max_spec_len, "
      "str method=\"token\", Tensor? top_k=None, Tensor? top_p=None, Tensor? min_p=None, Tensor? lenience=None) "
      "-> (Tensor output_token_ids, Tensor num_accepted)");
  // Tree verification; kernels as for rejection_sample
  // (bindings/tree_cuda.cu).
  m.def(
      "tree_rejection_sample(Tensor target_logits, Tensor tokens, Tensor parents, Tensor cu_num_nodes, "
      "Tensor? draft_probs, Tensor? temperature, Tensor? seeds, Tensor? offsets, int max_depth, "
      "Tensor? top_k=None, Tensor? top_p=None, Tensor? min_p=None, Tensor? lenience=None) "
      "-> (Tensor output_token_ids, Tensor accepted_nodes, Tensor num_accepted)");

  // ------------------------------------------------------------------------- private ops
  // Called by the Python API (specdec_kernels/chain.py, tree.py, _ops.py), tests and benchmarks
  // only; each is one op rather than a Python call so that torch.compile(fullgraph=True) and
  // CUDA graphs see one opaque call.

  // Twins of the public ops that always run the Triton kernel on CUDA tensors (the reference on
  // CPU tensors): backend "triton", and what "auto" calls for sampling filters on GPUs older
  // than sm_90. Kernels and fakes: specdec_kernels/_ops.py; callers: chain.py, tree.py.
  m.def(
      "_rejection_sample_triton(Tensor target_logits, Tensor draft_token_ids, Tensor cu_num_draft_tokens, "
      "Tensor? draft_probs, Tensor? temperature, Tensor? seeds, Tensor? offsets, int max_spec_len, "
      "str method=\"token\", Tensor? top_k=None, Tensor? top_p=None, Tensor? min_p=None, Tensor? lenience=None) "
      "-> (Tensor output_token_ids, Tensor num_accepted)");
  m.def(
      "_tree_rejection_sample_triton(Tensor target_logits, Tensor tokens, Tensor parents, Tensor cu_num_nodes, "
      "Tensor? draft_probs, Tensor? temperature, Tensor? seeds, Tensor? offsets, int max_depth, "
      "Tensor? top_k=None, Tensor? top_p=None, Tensor? min_p=None, Tensor? lenience=None) "
      "-> (Tensor output_token_ids, Tensor accepted_nodes, Tensor num_accepted)");
  // The same schemas for the CUDA C++ kernels with sampling filters: the threshold pass
  // (_row_thresholds_cuda), then the _cuda_filtered op below. CUDA kernels: bindings/filters_cuda.cu;
  // CPU kernels (the reference) and fakes: specdec_kernels/_ops.py; callers: the public ops' CUDA
  // kernels when given filters (bindings/chain_cuda.cu, tree_cuda.cu).
  m.def(
      "_rejection_sample_cuda_filters(Tensor target_logits, Tensor draft_token_ids, Tensor cu_num_draft_tokens, "
      "Tensor? draft_probs, Tensor? temperature, Tensor? seeds, Tensor? offsets, int max_spec_len, "
      "str method=\"token\", Tensor? top_k=None, Tensor? top_p=None, Tensor? min_p=None, Tensor? lenience=None) "
      "-> (Tensor output_token_ids, Tensor num_accepted)");
  m.def(
      "_tree_rejection_sample_cuda_filters(Tensor target_logits, Tensor tokens, Tensor parents, "
      "Tensor cu_num_nodes, Tensor? draft_probs, Tensor? temperature, Tensor? seeds, Tensor? offsets, "
      "int max_depth, Tensor? top_k=None, Tensor? top_p=None, Tensor? min_p=None, Tensor? lenience=None) "
      "-> (Tensor output_token_ids, Tensor accepted_nodes, Tensor num_accepted)");

  // The CUDA chain / tree kernels given the threshold pass's per-row thresholds. CUDA kernels:
  // bindings/chain_cuda.cu, tree_cuda.cu; fakes: specdec_kernels/_ops.py; caller: the _cuda_filters
  // ops above.
  m.def(
      "_rejection_sample_cuda_filtered(Tensor target_logits, Tensor draft_token_ids, Tensor cu_num_draft_tokens, "
      "Tensor? draft_probs, Tensor? temperature, Tensor? seeds, Tensor? offsets, int max_spec_len, "
      "str method, Tensor? row_thresholds, Tensor? lenience=None) -> (Tensor output_token_ids, Tensor num_accepted)");
  m.def(
      "_tree_rejection_sample_cuda_filtered(Tensor target_logits, Tensor tokens, Tensor parents, "
      "Tensor cu_num_nodes, Tensor? draft_probs, Tensor? temperature, Tensor? seeds, Tensor? offsets, "
      "int max_depth, Tensor? row_thresholds, Tensor? lenience=None) "
      "-> (Tensor output_token_ids, Tensor accepted_nodes, Tensor num_accepted)");

  // The sampling filters' threshold pass of the CUDA kernels (sm_90+): per slot (chain: request b's row
  // t at b * max_rows + t; tree: each node row) the threshold logit, -inf where nothing is
  // filtered. CUDA kernel: bindings/filters_cuda.cu, which also implements the _cuda_filters ops
  // above with it; callers: those ops, python_tests/test_filters.py.
  m.def(
      "_row_thresholds_cuda(Tensor target_logits, Tensor cu, Tensor? temperature, Tensor? top_k, Tensor? top_p, "
      "Tensor? min_p, bool tree, int max_rows) -> Tensor");

  // The CUDA kernels' host plans for given sizes, computed without a GPU (tensor-free, so their
  // kernels are registered for CompositeImplicitAutograd: bindings/chain_cuda.cu, tree_cuda.cu;
  // CUDA builds only). Caller: python_tests/test_cuda_plan.py.
  m.def(
      "_rejection_sample_plan(int num_rows, int num_requests, int vocab, int max_spec_len, bool has_draft_probs, "
      "int concurrent_ctas, int block_method, int units_per_slot) -> int[]");
  m.def(
      "_tree_rejection_sample_plan(int num_nodes, int num_requests, int vocab, bool has_draft_probs, "
      "int concurrent_ctas, int units_per_slot) -> int[]");

  // The chain kernel's per-CTA timeline of a profiling build (SPECDEC_NVCC_FLAGS=-DSPECDEC_TRACE
  // only; kernel: bindings/chain_cuda.cu, registered as the plans are). Caller:
  // benchmarks/trace_chain_timeline.py.
  m.def("_rejection_sample_trace(bool reset) -> Tensor");
}
