// The specdec op schemas, defined once for every backend.
//
// CPU (the reference) and the Triton kernel are registered from Python
// (specdec_kernels/ops.py); the fused CUDA kernel registers itself for the CUDA
// dispatch key in rejection_sample_cuda.cu when the extension is built with CUDA.
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
      "Tensor? draft_probs, Tensor? temperature, Tensor? seeds, Tensor? offsets, int max_spec_len) "
      "-> (Tensor output_token_ids, Tensor num_accepted)");
}
