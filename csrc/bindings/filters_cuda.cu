// Torch binding of the sampling filters' threshold pass on CUDA (csrc/kernels/row_threshold.cuh)
// and of the ops that run it before the chain or tree kernel: _rejection_sample_cuda_filters and
// _tree_rejection_sample_cuda_filters (what the public ops' CUDA kernels call when given top_k /
// top_p / min_p). Two launches per call, no synchronization, CUDA-graph capturable; sm_90+.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>

#include "kernels/row_threshold.cuh"
#include "bindings/common.h"

namespace {

namespace binding = specdec::binding;

constexpr const char* kOp = "specdec sampling filters (cuda)";

// A per-request filter vector [B] on the logits' device; floating ones are read as float32.
at::Tensor request_vector(const char* name, const at::Tensor& t, int64_t num_requests, const at::Device& device,
                          bool integral) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == num_requests, kOp, ": ", name, " must have shape (B,) = (", num_requests,
              ",), got ", t.sizes());
  binding::check_device(kOp, name, t, device);
  if (integral) {
    TORCH_CHECK(binding::is_index_dtype(t.scalar_type()), kOp, ": ", name, " must have dtype int32 or int64, got ",
                t.scalar_type());
    return t.contiguous();
  }
  TORCH_CHECK(at::isFloatingType(t.scalar_type()), kOp, ": ", name, " must be a floating tensor, got ",
              t.scalar_type());
  return t.to(at::kFloat).contiguous();
}

// The threshold logit of every slot: chain (tree = false): slot b * max_rows + t for request b's
// row t (max_rows = max_spec_len + 1); tree: one slot per node row. -inf where nothing is
// filtered (greedy requests, requests without a filter on, rows past a request's drafts).
at::Tensor row_thresholds_cuda(const at::Tensor& target_logits, const at::Tensor& cu,
                               const std::optional<at::Tensor>& temperature, const std::optional<at::Tensor>& top_k,
                               const std::optional<at::Tensor>& top_p, const std::optional<at::Tensor>& min_p,
                               bool tree, int64_t max_rows) {
  TORCH_CHECK(target_logits.dim() == 2, kOp, ": target_logits must be 2-D, got shape ", target_logits.sizes());
  TORCH_CHECK(binding::is_logit_dtype(target_logits.scalar_type()), kOp,
              ": target_logits must have dtype float32, bfloat16 or float16, got ", target_logits.scalar_type());
  TORCH_CHECK(target_logits.is_cuda(), kOp, ": target_logits must be a CUDA tensor, got one on ",
              target_logits.device());
  const at::Device device = target_logits.device();
  // Thread-block clusters (one per row) need compute capability 9.0.
  TORCH_CHECK(binding::sm90_or_newer(device.index()), kOp,
              ": the CUDA threshold pass needs compute capability 9.0 or newer (thread-block clusters); "
              "use backend='triton' for sampling filters on this GPU");
  TORCH_CHECK(cu.dim() == 1 && cu.size(0) >= 1, kOp, ": the cumulative offsets must be 1-D with B + 1 >= 1 entries");
  TORCH_CHECK(binding::is_index_dtype(cu.scalar_type()), kOp, ": the cumulative offsets must be int32 or int64");
  binding::check_device(kOp, "cu", cu, device);
  TORCH_CHECK(tree || max_rows >= 1, kOp, ": max_rows must be >= 1, got ", max_rows);
  const int64_t num_requests = cu.size(0) - 1;
  const int64_t num_rows = target_logits.size(0);
  const int64_t vocab = target_logits.size(1);
  TORCH_CHECK(vocab >= 1, kOp, ": target_logits has an empty vocabulary dimension");
  at::Tensor temp, k, p, mp;
  if (temperature.has_value()) temp = request_vector("temperature", *temperature, num_requests, device, false);
  if (top_k.has_value()) k = request_vector("top_k", *top_k, num_requests, device, true);
  if (top_p.has_value()) p = request_vector("top_p", *top_p, num_requests, device, false);
  if (min_p.has_value()) mp = request_vector("min_p", *min_p, num_requests, device, false);

  const c10::cuda::CUDAGuard guard(device);
  const int64_t slots = tree ? num_rows : num_requests * max_rows;
  at::Tensor thresholds = at::empty({slots}, at::TensorOptions().dtype(at::kFloat).device(device));
  if (slots == 0) return thresholds;
  const at::Tensor logits = binding::inner_contiguous(target_logits);
  const at::Tensor cu_c = cu.contiguous();

  specdec::RowThresholdParams params{};
  params.logits = logits.data_ptr();
  params.row_stride = logits.stride(0);
  params.cu = cu_c.data_ptr();
  params.cu_int64 = cu_c.scalar_type() == at::kLong;
  params.temperature = temp.defined() ? temp.data_ptr<float>() : nullptr;
  params.top_k = k.defined() ? k.data_ptr() : nullptr;
  params.top_k_int64 = k.defined() && k.scalar_type() == at::kLong;
  params.top_p = p.defined() ? p.data_ptr<float>() : nullptr;
  params.min_p = mp.defined() ? mp.data_ptr<float>() : nullptr;
  params.num_requests = num_requests;
  params.num_rows = num_rows;
  params.vocab = vocab;
  params.max_rows = tree ? 1 : max_rows;
  params.tree = tree;
  params.vectorized = binding::rows_vectorizable(logits);
  // (params.slice: set by the launcher, which picks the CTAs per row)
  params.thresholds = thresholds.data_ptr<float>();

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  cudaError_t err;
  // Min-p alone needs only the row max: the light pass (the same thresholds).
  const bool min_p_only = !k.defined() && !p.defined();
  switch (logits.scalar_type()) {
    case at::kFloat:
      err = min_p_only ? specdec::launch_row_min_p_thresholds<float>(params, slots, stream)
                       : specdec::launch_row_thresholds<float>(params, slots, stream);
      break;
    case at::kBFloat16:
      err = min_p_only ? specdec::launch_row_min_p_thresholds<__nv_bfloat16>(params, slots, stream)
                       : specdec::launch_row_thresholds<__nv_bfloat16>(params, slots, stream);
      break;
    default:
      err = min_p_only ? specdec::launch_row_min_p_thresholds<__half>(params, slots, stream)
                       : specdec::launch_row_thresholds<__half>(params, slots, stream);
      break;
  }
  C10_CUDA_CHECK(err);
  return thresholds;
}

using ChainResult = std::tuple<at::Tensor, at::Tensor>;
using TreeResult = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using OptTensor = std::optional<at::Tensor>;

// The chain kernel with the filters: the thresholds, then _rejection_sample_cuda_filtered.
ChainResult rejection_sample_cuda_filters(const at::Tensor& target_logits, const at::Tensor& draft_token_ids,
                                          const at::Tensor& cu_num_draft_tokens, const OptTensor& draft_probs,
                                          const OptTensor& temperature, const OptTensor& seeds, const OptTensor& offsets,
                                          int64_t max_spec_len, c10::string_view method, const OptTensor& top_k,
                                          const OptTensor& top_p, const OptTensor& min_p, const OptTensor& lenience) {
  TORCH_CHECK(max_spec_len >= 0, kOp, ": max_spec_len must be >= 0, got ", max_spec_len);
  const at::Tensor thresholds =
      row_thresholds_cuda(target_logits, cu_num_draft_tokens, temperature, top_k, top_p, min_p, false, max_spec_len + 1);
  static const auto filtered =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("specdec::_rejection_sample_cuda_filtered", "")
          .typed<ChainResult(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&, const OptTensor&,
                             const OptTensor&, const OptTensor&, int64_t, c10::string_view, const OptTensor&,
                             const OptTensor&)>();
  return filtered.call(target_logits, draft_token_ids, cu_num_draft_tokens, draft_probs, temperature, seeds, offsets,
                       max_spec_len, method, thresholds, lenience);
}

TreeResult tree_rejection_sample_cuda_filters(const at::Tensor& target_logits, const at::Tensor& tokens,
                                              const at::Tensor& parents, const at::Tensor& cu_num_nodes,
                                              const OptTensor& draft_probs, const OptTensor& temperature,
                                              const OptTensor& seeds, const OptTensor& offsets, int64_t max_depth,
                                              const OptTensor& top_k, const OptTensor& top_p, const OptTensor& min_p,
                                              const OptTensor& lenience) {
  const at::Tensor thresholds =
      row_thresholds_cuda(target_logits, cu_num_nodes, temperature, top_k, top_p, min_p, true, 1);
  static const auto filtered =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("specdec::_tree_rejection_sample_cuda_filtered", "")
          .typed<TreeResult(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&, int64_t,
                            const OptTensor&, const OptTensor&)>();
  return filtered.call(target_logits, tokens, parents, cu_num_nodes, draft_probs, temperature, seeds, offsets,
                       max_depth, thresholds, lenience);
}

}  // namespace

// Schemas: csrc/ops.cpp.
TORCH_LIBRARY_IMPL(specdec, CUDA, m) {
  m.impl("_row_thresholds_cuda", &row_thresholds_cuda);
  m.impl("_rejection_sample_cuda_filters", &rejection_sample_cuda_filters);
  m.impl("_tree_rejection_sample_cuda_filters", &tree_rejection_sample_cuda_filters);
}
