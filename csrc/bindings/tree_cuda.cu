// Torch binding of the fused CUDA kernel behind torch.ops.specdec.tree_rejection_sample (the
// kernel itself is torch-free: csrc/kernels/tree_rejection_sample.cuh). It checks the inputs,
// picks the work decomposition, keeps a cached per-device workspace and makes exactly one
// launch (plus one at::randint when seeds are absent), without synchronizing. Same structure
// as chain_cuda.cu (the chain op's binding); the workspaces are separate.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <mutex>
#include <optional>
#include <tuple>
#include <vector>

#include "kernels/tree_rejection_sample.cuh"
#include "bindings/common.h"

namespace {

namespace binding = specdec::binding;

using specdec::NoDraftProbs;
using specdec::TreeRejectionSampleParams;
using specdec::TreeRejectionSamplePlan;

constexpr const char* kOp = "specdec.tree_rejection_sample (cuda)";

using binding::inner_contiguous;
using binding::is_index_dtype;
using binding::is_logit_dtype;
using binding::rows_vectorizable;

void check_device(const char* name, const at::Tensor& t, const at::Device& device) {
  binding::check_device(kOp, name, t, device);
}

// Counters (int32) and record bytes of at least the given sizes on `device` (this op's cache).
std::pair<int32_t*, uint8_t*> workspace(const at::Device& device, int64_t num_counters, int64_t record_bytes) {
  static auto* cache = new binding::WorkspaceCache(kOp, int64_t{1} << 20);  // leaked on purpose (bindings/common.h)
  return cache->get(device, num_counters, record_bytes);
}

// CTAs of an instance the current device runs at once (SMs x resident CTAs per SM, after
// raising the instance's shared-memory limit), cached per device.
template <typename T, typename P>
int64_t concurrent_ctas(int device_index) {
  static std::mutex mutex;
  static std::vector<int64_t> cache;
  std::lock_guard<std::mutex> lock(mutex);
  const auto index = static_cast<size_t>(device_index);
  if (cache.size() <= index) cache.resize(index + 1, 0);
  if (cache[index] == 0) {
    int blocks = 0, sms = 0;
    const cudaError_t prepared = specdec::tree_rejection_sample_prepare<T, P>(&blocks);  // (no template commas in the macro)
    C10_CUDA_CHECK(prepared);
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_index));
    cache[index] = int64_t{std::max(blocks, 1)} * std::max(sms, 1);
  }
  return cache[index];
}

int64_t align256(int64_t bytes) { return (bytes + 255) / 256 * 256; }

struct Call {
  at::Tensor logits, tokens, parents, cu, draft_probs, temperature, seeds, offsets;
  at::Tensor lenience;  // float32 [B], or undefined (exact)
  at::Tensor row_thresholds;  // sampling filters' thresholds per node row, or undefined
  int64_t num_requests, max_depth;
  at::Tensor out_tokens, out_nodes, num_accepted;
};

template <typename T, typename P>
void launch(const Call& call) {
  constexpr bool kHasDraftProbs = !std::is_same<P, NoDraftProbs>::value;
  const at::Device device = call.logits.device();
  const int64_t num_nodes = call.logits.size(0);
  const int64_t vocab = call.logits.size(1);
  const TreeRejectionSamplePlan plan = specdec::plan_tree_rejection_sample(
      num_nodes, call.num_requests, vocab, concurrent_ctas<T, P>(device.index()),
      kHasDraftProbs, binding::units_per_slot_override());
  TORCH_CHECK(plan.units_total <= std::numeric_limits<int32_t>::max(), kOp, ": the batch needs ",
              plan.units_total, " work units, more than one launch can have (2^31 - 1)");

  // Split records, node records, chunk tables (each 256-byte aligned).
  const int64_t node_offset = align256(plan.num_split_records * int64_t{sizeof(specdec::RtSplitRecord)});
  const int64_t table_offset = node_offset + align256(num_nodes * int64_t{sizeof(specdec::RtNodeRecord)});
  const int64_t record_bytes = table_offset + plan.num_table_entries * int64_t{sizeof(float2)};
  const auto [counters, records] = workspace(device, call.num_requests, record_bytes);

  TreeRejectionSampleParams p{};
  p.target_logits = call.logits.data_ptr();
  p.logits_row_stride = call.logits.stride(0);
  p.logits_vectorized = rows_vectorizable(call.logits);
  p.tokens = call.tokens.data_ptr();
  p.tokens_int64 = call.tokens.scalar_type() == at::kLong;
  p.parents = call.parents.data_ptr();
  p.parents_int64 = call.parents.scalar_type() == at::kLong;
  p.cu_num_nodes = call.cu.data_ptr();
  p.cu_int64 = call.cu.scalar_type() == at::kLong;
  if constexpr (kHasDraftProbs) {
    p.draft_probs = call.draft_probs.data_ptr();
    p.draft_probs_row_stride = call.draft_probs.stride(0);
    p.probs_vectorized = rows_vectorizable(call.draft_probs);
  }
  binding::set_request_params(p, call.temperature, call.seeds, call.offsets);
  p.lenience = call.lenience.defined() ? call.lenience.data_ptr<float>() : nullptr;
  p.output_token_ids = call.out_tokens.data_ptr<int32_t>();
  p.accepted_nodes = call.out_nodes.data_ptr<int32_t>();
  p.num_accepted = call.num_accepted.data_ptr<int32_t>();
  p.counters = counters;
  p.row_thresholds = call.row_thresholds.defined() ? call.row_thresholds.data_ptr<float>() : nullptr;
  p.split_records = reinterpret_cast<specdec::RtSplitRecord*>(records);
  p.node_records = reinterpret_cast<specdec::RtNodeRecord*>(records + node_offset);
  p.chunk_tables = reinterpret_cast<float2*>(records + table_offset);
  p.num_nodes = num_nodes;
  p.vocab_size = static_cast<int32_t>(vocab);
  p.num_requests = static_cast<int32_t>(call.num_requests);
  p.max_depth = static_cast<int32_t>(call.max_depth);
  p.plan = plan;

  const cudaError_t launched = specdec::launch_tree_rejection_sample<T, P>(
      p, c10::cuda::getCurrentCUDAStream(device.index()).stream(), binding::pdl_enabled(device.index()));
  C10_CUDA_CHECK(launched);
}

template <typename T>
void launch_for_probs(const Call& call) {
  if (!call.draft_probs.defined()) return launch<T, NoDraftProbs>(call);
  switch (call.draft_probs.scalar_type()) {
    case at::kFloat: return launch<T, float>(call);
    case at::kBFloat16: return launch<T, __nv_bfloat16>(call);
    default: return launch<T, __half>(call);
  }
}

// The op's work, with the sampling filters' node-row thresholds when given (the threshold
// pass's, computed by the caller: _tree_rejection_sample_cuda_filtered).
std::tuple<at::Tensor, at::Tensor, at::Tensor> run_tree_rejection_sample(
    const at::Tensor& target_logits, const at::Tensor& tokens, const at::Tensor& parents,
    const at::Tensor& cu_num_nodes, const std::optional<at::Tensor>& draft_probs,
    const std::optional<at::Tensor>& temperature, const std::optional<at::Tensor>& seeds,
    const std::optional<at::Tensor>& offsets, int64_t max_depth, const std::optional<at::Tensor>& row_thresholds,
    const std::optional<at::Tensor>& lenience) {
  TORCH_CHECK(target_logits.dim() == 2, kOp, ": target_logits must be 2-D, got shape ", target_logits.sizes());
  TORCH_CHECK(is_logit_dtype(target_logits.scalar_type()), kOp,
              ": target_logits must have dtype float32, bfloat16 or float16, got ", target_logits.scalar_type());
  TORCH_CHECK(target_logits.is_cuda(), kOp, ": target_logits must be a CUDA tensor, got one on ",
              target_logits.device());
  const at::Device device = target_logits.device();
  const int64_t num_nodes = target_logits.size(0);
  const int64_t vocab = target_logits.size(1);
  TORCH_CHECK(vocab >= 1, kOp, ": target_logits has an empty vocabulary dimension");
  TORCH_CHECK(vocab <= specdec::kRtMaxVocab, kOp, ": target_logits has a vocabulary of ", vocab,
              " entries, more than the kernel supports (", specdec::kRtMaxVocab, ")");
  // Local node indices are int32 in the kernel (and 24-bit Philox node fields, as in the reference).
  TORCH_CHECK(num_nodes < (int64_t{1} << 31) - 64, kOp, ": too many nodes (", num_nodes, ")");

  for (const auto& [name, t] : {std::make_pair("tokens", &tokens), std::make_pair("parents", &parents)}) {
    TORCH_CHECK(t->dim() == 1 && t->size(0) == num_nodes, kOp, ": ", name,
                " must have one entry per node (target_logits row): shape (", num_nodes, ",), got ", t->sizes());
    TORCH_CHECK(is_index_dtype(t->scalar_type()), kOp, ": ", name, " must have dtype int32 or int64, got ",
                t->scalar_type());
    check_device(name, *t, device);
  }
  TORCH_CHECK(cu_num_nodes.dim() == 1, kOp, ": cu_num_nodes must be 1-D, got shape ", cu_num_nodes.sizes());
  TORCH_CHECK(is_index_dtype(cu_num_nodes.scalar_type()), kOp,
              ": cu_num_nodes must have dtype int32 or int64, got ", cu_num_nodes.scalar_type());
  check_device("cu_num_nodes", cu_num_nodes, device);
  TORCH_CHECK(cu_num_nodes.size(0) >= 1, kOp, ": cu_num_nodes must have B + 1 >= 1 entries (a leading 0)");
  const int64_t num_requests = cu_num_nodes.size(0) - 1;
  TORCH_CHECK(num_requests <= std::numeric_limits<int32_t>::max() - 1, kOp, ": too many requests (",
              num_requests, ")");
  // The output width; the node field of the random streams has 24 bits (docs/ALGORITHM.md §2).
  TORCH_CHECK(max_depth >= 0, kOp, ": max_depth must be >= 0, got ", max_depth);
  TORCH_CHECK(max_depth < (int64_t{1} << specdec::kNodeBits), kOp, ": max_depth must be < 2^24, got ", max_depth);

  binding::check_optional_inputs(kOp, device, num_nodes, vocab, num_requests, draft_probs, temperature, seeds,
                                 offsets);
  // Sampling filters: one threshold per node row (before any allocation, as the other checks).
  if (row_thresholds.has_value()) {
    binding::check_float_vector(kOp, "row_thresholds", *row_thresholds, target_logits.size(0), device);
  }
  const at::Tensor lenience_f32 = binding::lenience_f32(kOp, lenience, num_requests, device);

  const c10::cuda::CUDAGuard guard(device);
  const auto int32_options = at::TensorOptions().dtype(at::kInt).device(device);
  Call call;
  call.out_tokens = at::empty({num_requests, max_depth + 1}, int32_options);
  call.out_nodes = at::empty({num_requests, max_depth + 1}, int32_options);
  call.num_accepted = at::empty({num_requests}, int32_options);
  if (num_requests == 0) return {call.out_tokens, call.out_nodes, call.num_accepted};

  call.logits = inner_contiguous(target_logits);
  call.tokens = tokens.contiguous();
  call.parents = parents.contiguous();
  call.cu = cu_num_nodes.contiguous();
  if (draft_probs.has_value()) call.draft_probs = inner_contiguous(*draft_probs);
  if (temperature.has_value()) call.temperature = temperature->contiguous();
  // Without seeds, draw them from torch's CUDA generator (graph-safe), like the Python API.
  call.seeds = seeds.has_value() ? seeds->contiguous()
                                 : at::randint(std::numeric_limits<int64_t>::min(),
                                               std::numeric_limits<int64_t>::max(), {num_requests},
                                               at::TensorOptions().dtype(at::kLong).device(device));
  if (offsets.has_value()) call.offsets = offsets->contiguous();
  if (row_thresholds.has_value()) call.row_thresholds = row_thresholds->contiguous();
  call.lenience = lenience_f32;
  call.num_requests = num_requests;
  call.max_depth = max_depth;

  switch (call.logits.scalar_type()) {
    case at::kFloat: launch_for_probs<float>(call); break;
    case at::kBFloat16: launch_for_probs<__nv_bfloat16>(call); break;
    default: launch_for_probs<__half>(call); break;
  }
  return {call.out_tokens, call.out_nodes, call.num_accepted};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> tree_rejection_sample_cuda(
    const at::Tensor& target_logits, const at::Tensor& tokens, const at::Tensor& parents,
    const at::Tensor& cu_num_nodes, const std::optional<at::Tensor>& draft_probs,
    const std::optional<at::Tensor>& temperature, const std::optional<at::Tensor>& seeds,
    const std::optional<at::Tensor>& offsets, int64_t max_depth, const std::optional<at::Tensor>& top_k,
    const std::optional<at::Tensor>& top_p, const std::optional<at::Tensor>& min_p,
    const std::optional<at::Tensor>& lenience) {
  if (top_k.has_value() || top_p.has_value() || min_p.has_value()) {
    // The threshold pass, then the kernel with the thresholds (bindings/filters_cuda.cu).
    using Opt = const std::optional<at::Tensor>&;
    static const auto with_filters =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("specdec::_tree_rejection_sample_cuda_filters", "")
            .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                  const at::Tensor&, const at::Tensor&, Opt, Opt, Opt,
                                                                  Opt, int64_t, Opt, Opt, Opt, Opt)>();
    return with_filters.call(target_logits, tokens, parents, cu_num_nodes, draft_probs, temperature, seeds, offsets,
                             max_depth, top_k, top_p, min_p, lenience);
  }
  return run_tree_rejection_sample(target_logits, tokens, parents, cu_num_nodes, draft_probs, temperature, seeds,
                                   offsets, max_depth, std::nullopt, lenience);
}

// The host plan for given sizes, without a GPU (python_tests/test_cuda_plan.py):
// [num_splits, tiles_per_split, units_phase1, units_total]; units_per_slot 0: the shipped plan.
std::vector<int64_t> tree_rejection_sample_plan(int64_t num_nodes, int64_t num_requests, int64_t vocab,
                                                bool has_draft_probs, int64_t concurrent_ctas,
                                                int64_t units_per_slot) {
  const TreeRejectionSamplePlan plan = specdec::plan_tree_rejection_sample(
      num_nodes, num_requests, vocab, concurrent_ctas, has_draft_probs, units_per_slot);
  return {plan.num_splits, plan.tiles_per_split, plan.units_phase1, plan.units_total};
}

}  // namespace

// Schemas: csrc/ops.cpp. The ops with tensor arguments dispatch on their device (CUDA).
TORCH_LIBRARY_IMPL(specdec, CUDA, m) {
  m.impl("tree_rejection_sample", &tree_rejection_sample_cuda);
  m.impl("_tree_rejection_sample_cuda_filtered", &run_tree_rejection_sample);
}

// The tensor-free plan op: CompositeImplicitAutograd, as in chain_cuda.cu.
TORCH_LIBRARY_IMPL(specdec, CompositeImplicitAutograd, m) {
  m.impl("_tree_rejection_sample_plan", &tree_rejection_sample_plan);
}
