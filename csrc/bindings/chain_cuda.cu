// Torch binding of the fused CUDA kernel behind torch.ops.specdec.rejection_sample
// (the kernel itself is torch-free: csrc/kernels/rejection_sample.cuh). It checks the
// inputs, picks the work decomposition, keeps a cached per-device workspace and makes
// exactly one launch (plus one at::randint when seeds are absent), without synchronizing.
// Only c10's CUDA headers (ATen/cuda/CUDAContext.h would also need the cuSPARSE/cuBLAS
// headers, which a minimal toolkit lacks): c10::cuda's stream and capture-status functions
// are the ones at::cuda re-exports.
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

#include "kernels/rejection_sample.cuh"
#include "bindings/common.h"

namespace {

namespace binding = specdec::binding;

using specdec::NoDraftProbs;
using specdec::RejectionSampleParams;
using specdec::RejectionSamplePlan;
using specdec::RsMethod;

constexpr const char* kOp = "specdec.rejection_sample (cuda)";

using binding::inner_contiguous;
using binding::is_index_dtype;
using binding::is_logit_dtype;
using binding::rows_vectorizable;

void check_device(const char* name, const at::Tensor& t, const at::Device& device) {
  binding::check_device(kOp, name, t, device);
}

// Counters (int32) and record bytes of at least the given sizes on `device` (this op's cache).
std::pair<int32_t*, uint8_t*> workspace(const at::Device& device, int64_t num_counters, int64_t record_bytes) {
  static auto* cache = new binding::WorkspaceCache(kOp, int64_t{1} << 18);  // leaked on purpose (bindings/common.h)
  return cache->get(device, num_counters, record_bytes);
}

// CTAs of an instance the current device runs at once (SMs x resident CTAs per SM, after
// raising the instance's shared-memory limit), cached per device.
template <typename T, typename P, RsMethod kMethod, bool kFiltered>
int64_t concurrent_ctas(int device_index) {
  static std::mutex mutex;
  static std::vector<int64_t> cache;
  std::lock_guard<std::mutex> lock(mutex);
  const auto index = static_cast<size_t>(device_index);
  if (cache.size() <= index) cache.resize(index + 1, 0);
  if (cache[index] == 0) {
    int blocks = 0, sms = 0;
    const cudaError_t prepared = specdec::rejection_sample_prepare<T, P, kMethod, kFiltered>(&blocks);
    C10_CUDA_CHECK(prepared);
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_index));
    cache[index] = int64_t{std::max(blocks, 1)} * std::max(sms, 1);
  }
  return cache[index];
}

struct Call {
  at::Tensor logits, draft_ids, cu, draft_probs, temperature, seeds, offsets;
  at::Tensor row_thresholds;  // sampling filters' thresholds per (request, row), or undefined
  at::Tensor lenience;  // float32 [B], or undefined (exact)
  int64_t num_requests, max_spec_len;
  at::Tensor out_tokens, num_accepted;
};

template <typename T, typename P, RsMethod kMethod>
void launch(const Call& call) {
  constexpr bool kHasDraftProbs = !std::is_same<P, NoDraftProbs>::value;
  const at::Device device = call.logits.device();
  const int64_t num_rows = call.logits.size(0);
  const int64_t vocab = call.logits.size(1);
  // Calls with sampling filters run the instance with the filter paths; the others one without.
  const bool filtered = call.row_thresholds.defined();
  const RejectionSamplePlan plan =
      specdec::plan_rejection_sample(num_rows, call.num_requests, vocab, call.max_spec_len, kHasDraftProbs,
                                     filtered ? concurrent_ctas<T, P, kMethod, true>(device.index())
                                              : concurrent_ctas<T, P, kMethod, false>(device.index()),
                                     kMethod, binding::units_per_slot_override());
  TORCH_CHECK(plan.units_total <= std::numeric_limits<int32_t>::max(), kOp, ": the batch needs ",
              plan.units_total, " work units, more than one launch can have (2^31 - 1)");

  // Split records, then residual records, then residual masses (each 256-byte aligned).
  const auto aligned = [](int64_t bytes) { return (bytes + 255) / 256 * 256; };
  const int64_t residual_offset =
      aligned(plan.num_split_records * static_cast<int64_t>(sizeof(specdec::RsSplitRecord)));
  const int64_t masses_offset =
      residual_offset + aligned(plan.num_residual_records * static_cast<int64_t>(sizeof(specdec::RsResidualRecord)));
  const int64_t record_bytes = masses_offset + plan.num_residual_masses * static_cast<int64_t>(sizeof(float));
  const auto [counters, records] = workspace(device, plan.num_counters, record_bytes);

  RejectionSampleParams p{};
  p.target_logits = call.logits.data_ptr();
  p.logits_row_stride = call.logits.stride(0);
  p.logits_vectorized = rows_vectorizable(call.logits);
  p.draft_token_ids = call.draft_ids.data_ptr();
  p.draft_ids_int64 = call.draft_ids.scalar_type() == at::kLong;
  p.cu_num_draft_tokens = call.cu.data_ptr();
  p.cu_int64 = call.cu.scalar_type() == at::kLong;
  if constexpr (kHasDraftProbs) {
    p.draft_probs = call.draft_probs.data_ptr();
    p.draft_probs_row_stride = call.draft_probs.stride(0);
    p.probs_vectorized = rows_vectorizable(call.draft_probs);
  }
  binding::set_request_params(p, call.temperature, call.seeds, call.offsets);
  p.lenience = call.lenience.defined() ? call.lenience.data_ptr<float>() : nullptr;
  p.output_token_ids = call.out_tokens.data_ptr<int32_t>();
  p.num_accepted = call.num_accepted.data_ptr<int32_t>();
  p.counters = counters;
  p.row_thresholds = call.row_thresholds.defined() ? call.row_thresholds.data_ptr<float>() : nullptr;
  p.split_records = reinterpret_cast<specdec::RsSplitRecord*>(records);
  p.residual_records = reinterpret_cast<specdec::RsResidualRecord*>(records + residual_offset);
  p.residual_masses = plan.num_residual_masses > 0 ? reinterpret_cast<float*>(records + masses_offset) : nullptr;
  p.num_rows = num_rows;
  p.num_drafts = call.draft_ids.size(0);
  p.vocab_size = static_cast<int32_t>(vocab);
  p.num_requests = static_cast<int32_t>(call.num_requests);
  p.max_spec_len = static_cast<int32_t>(call.max_spec_len);
  p.plan = plan;

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  const bool pdl = binding::pdl_enabled(device.index());
  const cudaError_t launched = filtered ? specdec::launch_rejection_sample<T, P, kMethod, true>(p, stream, pdl)
                                        : specdec::launch_rejection_sample<T, P, kMethod, false>(p, stream, pdl);
  C10_CUDA_CHECK(launched);
}

template <typename T, RsMethod kMethod>
void launch_for_probs(const Call& call) {
  if (!call.draft_probs.defined()) return launch<T, NoDraftProbs, kMethod>(call);
  switch (call.draft_probs.scalar_type()) {
    case at::kFloat: return launch<T, float, kMethod>(call);
    case at::kBFloat16: return launch<T, __nv_bfloat16, kMethod>(call);
    default: return launch<T, __half, kMethod>(call);
  }
}

template <RsMethod kMethod>
void launch_for_dtypes(const Call& call) {
  switch (call.logits.scalar_type()) {
    case at::kFloat: return launch_for_probs<float, kMethod>(call);
    case at::kBFloat16: return launch_for_probs<__nv_bfloat16, kMethod>(call);
    default: return launch_for_probs<__half, kMethod>(call);
  }
}

// The op's work, with the sampling filters' row thresholds when given (the threshold pass's,
// computed by the caller: _rejection_sample_cuda_filtered).
std::tuple<at::Tensor, at::Tensor> run_rejection_sample(
    const at::Tensor& target_logits, const at::Tensor& draft_token_ids, const at::Tensor& cu_num_draft_tokens,
    const std::optional<at::Tensor>& draft_probs, const std::optional<at::Tensor>& temperature,
    const std::optional<at::Tensor>& seeds, const std::optional<at::Tensor>& offsets, int64_t max_spec_len,
    c10::string_view method, const std::optional<at::Tensor>& row_thresholds,
    const std::optional<at::Tensor>& lenience) {
  const bool block_method = method == "block";
  TORCH_CHECK(method == "token" || block_method, kOp, ": method must be 'token' or 'block', got '",
              std::string(method), "'");
  TORCH_CHECK(!(block_method && lenience.has_value()), kOp,
              ": lenience is not defined for method='block': pass lenience=None, or method='token'");
  TORCH_CHECK(target_logits.dim() == 2, kOp, ": target_logits must be 2-D, got shape ", target_logits.sizes());
  TORCH_CHECK(is_logit_dtype(target_logits.scalar_type()), kOp,
              ": target_logits must have dtype float32, bfloat16 or float16, got ", target_logits.scalar_type());
  TORCH_CHECK(target_logits.is_cuda(), kOp, ": target_logits must be a CUDA tensor, got one on ",
              target_logits.device());
  const at::Device device = target_logits.device();
  const int64_t num_rows = target_logits.size(0);
  const int64_t vocab = target_logits.size(1);
  TORCH_CHECK(vocab >= 1, kOp, ": target_logits has an empty vocabulary dimension");
  TORCH_CHECK(vocab <= specdec::kRsMaxVocab, kOp, ": target_logits has a vocabulary of ", vocab,
              " entries, more than the kernel supports (", specdec::kRsMaxVocab, ")");

  TORCH_CHECK(draft_token_ids.dim() == 1, kOp, ": draft_token_ids must be 1-D, got shape ", draft_token_ids.sizes());
  TORCH_CHECK(is_index_dtype(draft_token_ids.scalar_type()), kOp,
              ": draft_token_ids must have dtype int32 or int64, got ", draft_token_ids.scalar_type());
  check_device("draft_token_ids", draft_token_ids, device);
  TORCH_CHECK(cu_num_draft_tokens.dim() == 1, kOp, ": cu_num_draft_tokens must be 1-D, got shape ",
              cu_num_draft_tokens.sizes());
  TORCH_CHECK(is_index_dtype(cu_num_draft_tokens.scalar_type()), kOp,
              ": cu_num_draft_tokens must have dtype int32 or int64, got ", cu_num_draft_tokens.scalar_type());
  check_device("cu_num_draft_tokens", cu_num_draft_tokens, device);
  TORCH_CHECK(cu_num_draft_tokens.size(0) >= 1, kOp,
              ": cu_num_draft_tokens must have B + 1 >= 1 entries (a leading 0)");
  const int64_t num_requests = cu_num_draft_tokens.size(0) - 1;
  const int64_t num_drafts = draft_token_ids.size(0);
  TORCH_CHECK(num_rows == num_drafts + num_requests, kOp, ": target_logits has ", num_rows,
              " rows but draft_token_ids has N = ", num_drafts, " and cu_num_draft_tokens has B = ", num_requests,
              " requests: expected N + B = ", num_drafts + num_requests, " rows");
  TORCH_CHECK(num_requests <= std::numeric_limits<int32_t>::max() - 1, kOp, ": too many requests (",
              num_requests, ")");
  // Rows t = 0..max_spec_len are Philox nodes (docs/ALGORITHM.md §2: node < 2^24).
  TORCH_CHECK(max_spec_len >= 0, kOp, ": max_spec_len must be >= 0, got ", max_spec_len);
  TORCH_CHECK(max_spec_len < (int64_t{1} << specdec::kNodeBits), kOp, ": max_spec_len must be < 2^24, got ",
              max_spec_len);

  binding::check_optional_inputs(kOp, device, num_drafts, vocab, num_requests, draft_probs, temperature, seeds,
                                 offsets);
  const at::Tensor lenience_f32 = binding::lenience_f32(kOp, lenience, num_requests, device);

  // Sampling filters: the thresholds per (request, row), a float32 vector of the size the kernel indexes.
  if (row_thresholds.has_value()) {
    binding::check_float_vector(kOp, "row_thresholds", *row_thresholds, num_requests * (max_spec_len + 1), device);
  }

  const c10::cuda::CUDAGuard guard(device);
  const auto int32_options = at::TensorOptions().dtype(at::kInt).device(device);
  Call call;
  call.out_tokens = at::empty({num_requests, max_spec_len + 1}, int32_options);
  call.num_accepted = at::empty({num_requests}, int32_options);
  if (num_requests == 0) return {call.out_tokens, call.num_accepted};

  call.logits = inner_contiguous(target_logits);
  call.draft_ids = draft_token_ids.contiguous();
  call.cu = cu_num_draft_tokens.contiguous();
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
  call.max_spec_len = max_spec_len;

  if (block_method) {
    launch_for_dtypes<specdec::kRsMethodBlock>(call);
  } else {
    launch_for_dtypes<specdec::kRsMethodToken>(call);
  }
  return {call.out_tokens, call.num_accepted};
}

std::tuple<at::Tensor, at::Tensor> rejection_sample_cuda(
    const at::Tensor& target_logits, const at::Tensor& draft_token_ids, const at::Tensor& cu_num_draft_tokens,
    const std::optional<at::Tensor>& draft_probs, const std::optional<at::Tensor>& temperature,
    const std::optional<at::Tensor>& seeds, const std::optional<at::Tensor>& offsets, int64_t max_spec_len,
    c10::string_view method, const std::optional<at::Tensor>& top_k, const std::optional<at::Tensor>& top_p,
    const std::optional<at::Tensor>& min_p, const std::optional<at::Tensor>& lenience) {
  if (top_k.has_value() || top_p.has_value() || min_p.has_value()) {
    // The threshold pass, then the kernel with the thresholds (bindings/filters_cuda.cu).
    using Opt = const std::optional<at::Tensor>&;
    static const auto with_filters =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("specdec::_rejection_sample_cuda_filters", "")
            .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&, Opt,
                                                      Opt, Opt, Opt, int64_t, c10::string_view, Opt, Opt, Opt, Opt)>();
    return with_filters.call(target_logits, draft_token_ids, cu_num_draft_tokens, draft_probs, temperature, seeds,
                             offsets, max_spec_len, method, top_k, top_p, min_p, lenience);
  }
  return run_rejection_sample(target_logits, draft_token_ids, cu_num_draft_tokens, draft_probs, temperature, seeds,
                              offsets, max_spec_len, method, std::nullopt, lenience);
}

#ifdef SPECDEC_TRACE
// The profiling build's timeline (csrc/kernels/rejection_sample.cuh, RS_TRACE): a copy of the
// trace buffer of the current device as int64 [kRsTraceCtas, kRsTraceSlots], zeroed after
// reading when `reset`. Synchronizes; benchmarks/trace_chain_timeline.py reads it.
at::Tensor rejection_sample_trace(bool reset) {
  constexpr size_t kBytes = sizeof(unsigned long long) * specdec::kRsTraceCtas * specdec::kRsTraceSlots;
  at::Tensor out = at::empty({specdec::kRsTraceCtas, specdec::kRsTraceSlots}, at::kLong);
  C10_CUDA_CHECK(cudaDeviceSynchronize());
  C10_CUDA_CHECK(cudaMemcpyFromSymbol(out.data_ptr(), specdec::rs_trace, kBytes));
  if (reset) {
    std::vector<unsigned long long> zeros(specdec::kRsTraceCtas * specdec::kRsTraceSlots, 0);
    C10_CUDA_CHECK(cudaMemcpyToSymbol(specdec::rs_trace, zeros.data(), kBytes));
  }
  return out;
}
#endif

}  // namespace

// The host plan for given sizes, without a GPU (python_tests/test_cuda_plan.py pins its rules):
// [num_splits, tiles_per_split, units_phase1, units_total, residual_splits,
// residual_tiles_per_split, prefetch_residual]. units_per_slot 0: the shipped plan; > 0: that
// target, rules off (what SPECDEC_CUDA_UNITS_PER_SLOT does).
std::vector<int64_t> rejection_sample_plan(int64_t num_rows, int64_t num_requests, int64_t vocab, int64_t max_spec_len,
                                           bool has_draft_probs, int64_t concurrent_ctas, int64_t block_method,
                                           int64_t units_per_slot) {
  const RejectionSamplePlan plan = specdec::plan_rejection_sample(
      num_rows, num_requests, vocab, max_spec_len, has_draft_probs, concurrent_ctas,
      block_method != 0 ? specdec::kRsMethodBlock : specdec::kRsMethodToken, units_per_slot);
  return {plan.num_splits, plan.tiles_per_split, plan.units_phase1, plan.units_total, plan.residual_splits,
          plan.residual_tiles_per_split, plan.prefetch_residual};
}

// Schemas: csrc/ops.cpp. The ops with tensor arguments dispatch on their device (CUDA).
TORCH_LIBRARY_IMPL(specdec, CUDA, m) {
  m.impl("rejection_sample", &rejection_sample_cuda);
  m.impl("_rejection_sample_cuda_filtered", &run_rejection_sample);
}

// The tensor-free ops have no device to dispatch on: their kernels are registered for
// CompositeImplicitAutograd, so that they run from any caller, without a GPU.
TORCH_LIBRARY_IMPL(specdec, CompositeImplicitAutograd, m) {
  m.impl("_rejection_sample_plan", &rejection_sample_plan);
#ifdef SPECDEC_TRACE
  m.impl("_rejection_sample_trace", &rejection_sample_trace);
#endif
}
