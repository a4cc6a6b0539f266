// Host-side helpers of the CPU kernels' torch bindings (chain_cpu.cpp, tree_cpu.cpp): argument
// checks whose errors name the argument, and the views the torch-free kernels read.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <string>

#include "cpu/verify.h"

namespace specdec::cpu::binding {

inline bool is_logit_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }
inline bool is_index_dtype(at::ScalarType t) { return t == at::kInt || t == at::kLong; }
inline bool is_float_param_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf;
}

inline void check_cpu(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), op, ": ", name, " is on ", t.device(), " but target_logits is on cpu");
}

// A [B] per-request input (optional); errors name it.
inline void check_vector(const char* op, const char* name, const std::optional<at::Tensor>& t, int64_t batch,
                         bool index_dtype) {
  if (!t.has_value()) return;
  const at::Tensor& v = *t;
  TORCH_CHECK_VALUE(v.dim() == 1 && v.size(0) == batch, op, ": ", name, " must have shape (B,) = (", batch,
                    ",), got ", v.sizes());
  if (index_dtype) {
    TORCH_CHECK_TYPE(is_index_dtype(v.scalar_type()), op, ": ", name, " must have dtype int32 or int64, got ",
                     v.scalar_type());
  } else {
    TORCH_CHECK_TYPE(is_float_param_dtype(v.scalar_type()), op, ": ", name,
                     " must have dtype float32, float64, bfloat16 or float16, got ", v.scalar_type());
  }
  check_cpu(op, name, v);
}

inline void check_logits(const char* op, const at::Tensor& logits) {
  TORCH_CHECK_VALUE(logits.dim() == 2, op, ": target_logits must be 2-D, got shape ", logits.sizes());
  TORCH_CHECK_TYPE(is_logit_dtype(logits.scalar_type()), op,
                   ": target_logits must have dtype float32, bfloat16 or float16, got ", logits.scalar_type());
  TORCH_CHECK_VALUE(logits.device().is_cpu(), op, ": target_logits must be a CPU tensor here, got one on ",
                    logits.device());
  TORCH_CHECK_VALUE(logits.size(1) >= 1, op, ": target_logits has an empty vocabulary dimension");
}

inline void check_index(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.dim() == 1, op, ": ", name, " must be 1-D, got shape ", t.sizes());
  TORCH_CHECK_TYPE(is_index_dtype(t.scalar_type()), op, ": ", name, " must have dtype int32 or int64, got ",
                   t.scalar_type());
  check_cpu(op, name, t);
}

inline void check_draft_probs(const char* op, const std::optional<at::Tensor>& probs, int64_t rows, int64_t vocab) {
  if (!probs.has_value()) return;
  const at::Tensor& p = *probs;
  TORCH_CHECK_VALUE(p.dim() == 2, op, ": draft_probs must be 2-D, got shape ", p.sizes());
  TORCH_CHECK_TYPE(is_logit_dtype(p.scalar_type()), op,
                   ": draft_probs must have dtype float32, bfloat16 or float16, got ", p.scalar_type());
  check_cpu(op, "draft_probs", p);
  TORCH_CHECK_VALUE(p.size(0) == rows && p.size(1) == vocab, op, ": draft_probs must have shape (N, V) = (", rows,
                    ", ", vocab, "), got ", p.sizes());
}

inline void check_width(const char* op, const char* name, int64_t value) {
  TORCH_CHECK_VALUE(value >= 0, op, ": ", name, " must be >= 0, got ", value);
  // node indices of the random streams have 24 bits (docs/ALGORITHM.md §2)
  TORCH_CHECK_VALUE(value < (int64_t{1} << 24), op, ": ", name, " must be < 2^24, got ", value);
}

// The kernels need unit stride along the vocabulary (any row stride).
inline at::Tensor inner_contiguous(const at::Tensor& t) {
  return (t.size(-1) <= 1 || t.stride(-1) == 1) ? t : t.contiguous();
}

inline Vec1 view(const at::Tensor& t) {
  Vec1 v;
  v.data = t.data_ptr();
  switch (t.scalar_type()) {
    case at::kFloat: v.kind = kF32; break;
    case at::kDouble: v.kind = kF64; break;
    case at::kBFloat16: v.kind = kBF16; break;
    case at::kHalf: v.kind = kF16; break;
    case at::kInt: v.kind = kI32; break;
    case at::kLong: v.kind = kI64; break;
    default: TORCH_CHECK(false, "specdec CPU kernel: unexpected dtype ", t.scalar_type());
  }
  return v;
}

// An optional 1-D input, contiguous (kept alive in `holder`), as a view; absent: an empty view.
inline Vec1 optional_view(const std::optional<at::Tensor>& t, at::Tensor& holder) {
  if (!t.has_value()) return Vec1{};
  holder = t->contiguous();
  return view(holder);
}

// Seeds when absent: drawn from torch's default CPU generator, as the Python wrappers do
// (specdec_kernels.reference.philox.draw_seeds).
inline at::Tensor seeds_or_draw(const std::optional<at::Tensor>& seeds, int64_t batch) {
  if (seeds.has_value()) return seeds->contiguous();
  return at::randint(std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max(), {batch},
                     at::TensorOptions().dtype(at::kLong));
}

// Requests per parallel_for task: about 64K logits of work each.
inline int64_t grain(int64_t vocab, int64_t rows_per_request) {
  const int64_t work = std::max<int64_t>(1, vocab * std::max<int64_t>(1, rows_per_request));
  return std::max<int64_t>(1, (int64_t{1} << 16) / work);
}

}  // namespace specdec::cpu::binding
