// The CPU dispatch of torch.ops.specdec.rejection_sample: the fused C++ kernel of csrc/cpu/
// (verify.h), one request per parallel_for item (docs/ALGORITHM.md §1-3, §6-7).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>

#include "cpu/binding.h"
#include "cpu/verify.h"

namespace {

using namespace specdec::cpu;
using namespace specdec::cpu::binding;

constexpr const char* kOp = "specdec::rejection_sample (CPU)";

template <typename T, typename P>
void run_chain(const ChainParams& params, int64_t batch) {
  at::parallel_for(0, batch, grain(params.vocab, params.max_spec_len + 1), [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t b = begin; b < end; ++b) chain_request<T, P>(params, b, scratch);
  });
}

template <typename T>
void run_chain_for_probs(const ChainParams& params, int64_t batch, const at::Tensor& probs) {
  if (!probs.defined()) return run_chain<T, float>(params, batch);
  switch (probs.scalar_type()) {
    case at::kFloat: return run_chain<T, float>(params, batch);
    case at::kBFloat16: return run_chain<T, bf16_t>(params, batch);
    default: return run_chain<T, f16_t>(params, batch);
  }
}

std::tuple<at::Tensor, at::Tensor> rejection_sample_cpu(
    const at::Tensor& target_logits, const at::Tensor& draft_token_ids, const at::Tensor& cu_num_draft_tokens,
    const std::optional<at::Tensor>& draft_probs, const std::optional<at::Tensor>& temperature,
    const std::optional<at::Tensor>& seeds, const std::optional<at::Tensor>& offsets, int64_t max_spec_len,
    c10::string_view method, const std::optional<at::Tensor>& top_k, const std::optional<at::Tensor>& top_p,
    const std::optional<at::Tensor>& min_p, const std::optional<at::Tensor>& lenience) {
  const bool block = method == "block";
  TORCH_CHECK_VALUE(method == "token" || block, kOp, ": method must be 'token' or 'block', got '", std::string(method),
                    "'");
  check_logits(kOp, target_logits);
  check_index(kOp, "draft_token_ids", draft_token_ids);
  check_index(kOp, "cu_num_draft_tokens", cu_num_draft_tokens);
  TORCH_CHECK_VALUE(cu_num_draft_tokens.size(0) >= 1, kOp,
                    ": cu_num_draft_tokens must have B + 1 >= 1 entries (a leading 0)");
  const int64_t num_rows = target_logits.size(0), vocab = target_logits.size(1);
  const int64_t batch = cu_num_draft_tokens.size(0) - 1, num_drafts = draft_token_ids.size(0);
  TORCH_CHECK_VALUE(num_rows == num_drafts + batch, kOp, ": target_logits has ", num_rows,
                    " rows but draft_token_ids has N = ", num_drafts, " and cu_num_draft_tokens has B = ", batch,
                    " requests: expected N + B = ", num_drafts + batch, " rows");
  check_draft_probs(kOp, draft_probs, num_drafts, vocab);
  check_vector(kOp, "temperature", temperature, batch, false);
  check_vector(kOp, "seeds", seeds, batch, true);
  check_vector(kOp, "offsets", offsets, batch, true);
  check_vector(kOp, "top_k", top_k, batch, true);
  check_vector(kOp, "top_p", top_p, batch, false);
  check_vector(kOp, "min_p", min_p, batch, false);
  check_vector(kOp, "lenience", lenience, batch, false);
  TORCH_CHECK_VALUE(!(block && lenience.has_value()), kOp,
                    ": lenience must be None with method='block' (block verification has no lenient form)");
  check_width(kOp, "max_spec_len", max_spec_len);

  const at::Tensor logits = inner_contiguous(target_logits);
  const at::Tensor probs = draft_probs.has_value() ? inner_contiguous(*draft_probs) : at::Tensor();
  const at::Tensor ids = draft_token_ids.contiguous(), cu = cu_num_draft_tokens.contiguous();
  const at::Tensor seed_values = seeds_or_draw(seeds, batch);
  at::Tensor holders[7];
  ChainParams p;
  p.logits = logits.data_ptr();
  p.logit_stride = logits.stride(0);
  if (probs.defined()) {
    p.probs = probs.data_ptr();
    p.prob_stride = probs.stride(0);
  }
  p.num_rows = num_rows;
  p.vocab = vocab;
  p.num_drafts = num_drafts;
  p.max_spec_len = max_spec_len;
  p.ids = view(ids);
  p.cu = view(cu);
  p.seeds = view(seed_values);
  p.temperature = optional_view(temperature, holders[0]);
  p.offsets = optional_view(offsets, holders[1]);
  p.top_k = optional_view(top_k, holders[2]);
  p.top_p = optional_view(top_p, holders[3]);
  p.min_p = optional_view(min_p, holders[4]);
  p.lenience = optional_view(lenience, holders[5]);
  p.block = block;
  at::Tensor out = at::empty({batch, max_spec_len + 1}, at::TensorOptions().dtype(at::kInt));
  at::Tensor num = at::empty({batch}, at::TensorOptions().dtype(at::kInt));
  p.out = out.data_ptr<int32_t>();
  p.num = num.data_ptr<int32_t>();
  switch (logits.scalar_type()) {
    case at::kFloat: run_chain_for_probs<float>(p, batch, probs); break;
    case at::kBFloat16: run_chain_for_probs<bf16_t>(p, batch, probs); break;
    default: run_chain_for_probs<f16_t>(p, batch, probs); break;
  }
  return {out, num};
}

}  // namespace

// Schema: csrc/ops.cpp.
TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("rejection_sample", &rejection_sample_cpu); }
