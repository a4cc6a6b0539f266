// The CPU dispatch of torch.ops.specdec.tree_rejection_sample: the fused C++ kernel of csrc/cpu/
// (verify.h), one request per parallel_for item (docs/ALGORITHM.md §5, §7).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <vector>

#include "cpu/binding.h"
#include "cpu/verify.h"

namespace {

using namespace specdec::cpu;
using namespace specdec::cpu::binding;

constexpr const char* kOp = "specdec::tree_rejection_sample (CPU)";

template <typename T, typename P>
void run_tree(const TreeParams& params, int64_t batch) {
  // A request's work is its walk's rows: grain by the average request size.
  const int64_t rows = batch > 0 ? std::max<int64_t>(1, params.num_nodes / batch) : 1;
  at::parallel_for(0, batch, grain(params.vocab, rows), [&](int64_t begin, int64_t end) {
    TreeScratch scratch;
    for (int64_t b = begin; b < end; ++b) tree_request<T, P>(params, b, scratch);
  });
}

template <typename T>
void run_tree_for_probs(const TreeParams& params, int64_t batch, const at::Tensor& probs) {
  if (!probs.defined()) return run_tree<T, float>(params, batch);
  switch (probs.scalar_type()) {
    case at::kFloat: return run_tree<T, float>(params, batch);
    case at::kBFloat16: return run_tree<T, bf16_t>(params, batch);
    default: return run_tree<T, f16_t>(params, batch);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> tree_rejection_sample_cpu(
    const at::Tensor& target_logits, const at::Tensor& tokens, const at::Tensor& parents,
    const at::Tensor& cu_num_nodes, const std::optional<at::Tensor>& draft_probs,
    const std::optional<at::Tensor>& temperature, const std::optional<at::Tensor>& seeds,
    const std::optional<at::Tensor>& offsets, int64_t max_depth, const std::optional<at::Tensor>& top_k,
    const std::optional<at::Tensor>& top_p, const std::optional<at::Tensor>& min_p,
    const std::optional<at::Tensor>& lenience) {
  check_logits(kOp, target_logits);
  const int64_t num_nodes = target_logits.size(0), vocab = target_logits.size(1);
  for (const auto& [name, t] : {std::make_pair("tokens", &tokens), std::make_pair("parents", &parents)}) {
    check_index(kOp, name, *t);
    TORCH_CHECK_VALUE(t->size(0) == num_nodes, kOp, ": ", name,
                      " must have one entry per node (target_logits row): shape (", num_nodes, ",), got ",
                      t->sizes());
  }
  check_index(kOp, "cu_num_nodes", cu_num_nodes);
  TORCH_CHECK_VALUE(cu_num_nodes.size(0) >= 1, kOp, ": cu_num_nodes must have B + 1 >= 1 entries (a leading 0)");
  const int64_t batch = cu_num_nodes.size(0) - 1;
  check_draft_probs(kOp, draft_probs, num_nodes, vocab);
  check_vector(kOp, "temperature", temperature, batch, false);
  check_vector(kOp, "seeds", seeds, batch, true);
  check_vector(kOp, "offsets", offsets, batch, true);
  check_vector(kOp, "top_k", top_k, batch, true);
  check_vector(kOp, "top_p", top_p, batch, false);
  check_vector(kOp, "min_p", min_p, batch, false);
  check_vector(kOp, "lenience", lenience, batch, false);
  check_width(kOp, "max_depth", max_depth);

  const at::Tensor logits = inner_contiguous(target_logits);
  const at::Tensor probs = draft_probs.has_value() ? inner_contiguous(*draft_probs) : at::Tensor();
  const at::Tensor tok = tokens.contiguous(), par = parents.contiguous();
  const at::Tensor seed_values = seeds_or_draw(seeds, batch);
  // Offsets clamped into [0, N] and made non-decreasing: a malformed cu reads as empty requests.
  const at::Tensor cu_holder = cu_num_nodes.contiguous();
  const Vec1 cu_raw = view(cu_holder);
  std::vector<int64_t> cu(batch + 1);
  int64_t running = 0;
  for (int64_t b = 0; b <= batch; ++b) {
    running = std::max(running, std::clamp<int64_t>(cu_raw.i(b), 0, num_nodes));
    cu[b] = running;
  }
  at::Tensor holders[6];
  TreeParams p;
  p.logits = logits.data_ptr();
  p.logit_stride = logits.stride(0);
  if (probs.defined()) {
    p.probs = probs.data_ptr();
    p.prob_stride = probs.stride(0);
  }
  p.num_nodes = num_nodes;
  p.vocab = vocab;
  p.max_depth = max_depth;
  p.cu = cu.data();
  p.tokens = view(tok);
  p.parents = view(par);
  p.seeds = view(seed_values);
  p.temperature = optional_view(temperature, holders[0]);
  p.offsets = optional_view(offsets, holders[1]);
  p.top_k = optional_view(top_k, holders[2]);
  p.top_p = optional_view(top_p, holders[3]);
  p.min_p = optional_view(min_p, holders[4]);
  p.lenience = optional_view(lenience, holders[5]);
  const auto opts = at::TensorOptions().dtype(at::kInt);
  at::Tensor out = at::empty({batch, max_depth + 1}, opts);
  at::Tensor nodes = at::empty({batch, max_depth + 1}, opts);
  at::Tensor num = at::empty({batch}, opts);
  p.out = out.data_ptr<int32_t>();
  p.nodes = nodes.data_ptr<int32_t>();
  p.num = num.data_ptr<int32_t>();
  switch (logits.scalar_type()) {
    case at::kFloat: run_tree_for_probs<float>(p, batch, probs); break;
    case at::kBFloat16: run_tree_for_probs<bf16_t>(p, batch, probs); break;
    default: run_tree_for_probs<f16_t>(p, batch, probs); break;
  }
  return {out, nodes, num};
}

}  // namespace

// Schema: csrc/ops.cpp.
TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("tree_rejection_sample", &tree_rejection_sample_cpu); }
