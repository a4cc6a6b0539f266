// The specdec op schemas, defined once for every backend.
//
// CPU (the reference) and the Triton kernels are registered from Python
// (specdec_kernels/ops.py); a fused CUDA kernel registers itself for the CUDA dispatch
// key (rejection_sample_cuda.cu) when the extension is built with CUDA.
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
  m.def(
      "rejection_sample(Tensor target_logits, Tensor draft_token_ids, Tensor cu_num_draft_tokens, "
      "Tensor? draft_probs, Tensor? temperature, Tensor? seeds, Tensor? offsets, int max_spec_len, "
      "str method=\"token\", Tensor? top_k=None, Tensor? top_p=None, Tensor? min_p=None) "
      "-> (Tensor output_token_ids, Tensor num_accepted)");
  m.def(
      "tree_rejection_sample(Tensor target_logits, Tensor tokens, Tensor parents, Tensor cu_num_nodes, "
      "Tensor? draft_probs, Tensor? temperature, Tensor? seeds, Tensor? offsets, int max_depth, "
      "Tensor? top_k=None, Tensor? top_p=None, Tensor? min_p=None) "
      "-> (Tensor output_token_ids, Tensor accepted_nodes, Tensor num_accepted)");
  // The CUDA chain kernel with the sampling filters' per-row thresholds (the threshold pass's,
  // specdec_kernels/triton_filters.py); private: the Python API calls it.
  m.def(
      "_rejection_sample_cuda_filtered(Tensor target_logits, Tensor draft_token_ids, Tensor cu_num_draft_tokens, "
      "Tensor? draft_probs, Tensor? temperature, Tensor? seeds, Tensor? offsets, int max_spec_len, "
      "str method, Tensor? row_thresholds, Tensor? kept_sum=None, Tensor? kept_max=None, Tensor? chunk_max=None, "
      "Tensor? kept_chunk_mass=None) -> (Tensor output_token_ids, Tensor num_accepted)");
  m.def(
      "_tree_rejection_sample_cuda_filtered(Tensor target_logits, Tensor tokens, Tensor parents, "
      "Tensor cu_num_nodes, Tensor? draft_probs, Tensor? temperature, Tensor? seeds, Tensor? offsets, "
      "int max_depth, Tensor? row_thresholds) "
      "-> (Tensor output_token_ids, Tensor accepted_nodes, Tensor num_accepted)");
}
