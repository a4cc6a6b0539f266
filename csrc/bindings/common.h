// Host-side helpers shared by the torch bindings of the CUDA kernels (chain_cuda.cu,
// tree_cuda.cu): dtype and device checks, layout checks, the per-request
// kernel parameters and the cached per-device workspace. Each op keeps its own WorkspaceCache.
// Included by the .cu bindings only (it pulls in a kernel header).
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kernels/common.cuh"  // the temperature dtype codes (kRsTemperature*)

namespace specdec::binding {

using specdec::kRsTemperatureBFloat16;
using specdec::kRsTemperatureFloat16;
using specdec::kRsTemperatureFloat32;
using specdec::kRsTemperatureFloat64;
using specdec::kRsTemperatureNone;

inline bool is_logit_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

inline bool is_index_dtype(at::ScalarType t) { return t == at::kInt || t == at::kLong; }

inline void check_device(const char* op, const char* name, const at::Tensor& t, const at::Device& device) {
  TORCH_CHECK(t.device() == device, op, ": ", name, " is on ", t.device(), " but target_logits is on ", device);
}

// A float32 vector the kernel indexes up to `entries` (the sampling filters' per-row inputs).
inline void check_float_vector(const char* op, const char* name, const at::Tensor& t, int64_t entries,
                               const at::Device& device) {
  TORCH_CHECK(t.dim() == 1 && t.numel() == entries, op, ": ", name, " must be 1-D with ", entries, " entries, got ",
              t.dim(), "-D with ", t.numel());
  TORCH_CHECK(t.scalar_type() == at::kFloat, op, ": ", name, " must be float32");
  check_device(op, name, t, device);
}

// Kernels need unit stride along the last dim (any row stride); 1-D inputs contiguous.
inline at::Tensor inner_contiguous(const at::Tensor& t) {
  return (t.size(-1) <= 1 || t.stride(-1) == 1) ? t : t.contiguous();
}

// 16-byte aligned base and row stride: every 8-entry segment of a row can be one 16-byte load
// (else rows are read element by element; e.g. V * sizeof(T) not a multiple of 16).
inline bool rows_vectorizable(const at::Tensor& t) {
  const auto addr = reinterpret_cast<std::uintptr_t>(t.data_ptr());
  return addr % 16 == 0 && (t.size(0) <= 1 || (t.stride(0) * t.element_size()) % 16 == 0);
}

// The optional inputs both ops take alike: draft_probs [num_rows, vocab] (one row per draft /
// node), and per request temperature, seeds and offsets [num_requests]. Errors name the argument.
inline void check_optional_inputs(const char* op, const at::Device& device, int64_t num_rows, int64_t vocab,
                                  int64_t num_requests, const std::optional<at::Tensor>& draft_probs,
                                  const std::optional<at::Tensor>& temperature,
                                  const std::optional<at::Tensor>& seeds, const std::optional<at::Tensor>& offsets) {
  if (draft_probs.has_value()) {
    const at::Tensor& dp = *draft_probs;
    TORCH_CHECK(dp.dim() == 2, op, ": draft_probs must be 2-D, got shape ", dp.sizes());
    TORCH_CHECK(is_logit_dtype(dp.scalar_type()), op,
                ": draft_probs must have dtype float32, bfloat16 or float16, got ", dp.scalar_type());
    check_device(op, "draft_probs", dp, device);
    TORCH_CHECK(dp.size(0) == num_rows && dp.size(1) == vocab, op, ": draft_probs must have shape (N, V) = (",
                num_rows, ", ", vocab, "), got ", dp.sizes());
  }
  if (temperature.has_value()) {
    const at::Tensor& t = *temperature;
    TORCH_CHECK(t.dim() == 1 && t.size(0) == num_requests, op, ": temperature must have shape (B,) = (",
                num_requests, ",), got ", t.sizes());
    TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble ||
                    t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf,
                op, ": temperature must have dtype float32, float64, bfloat16 or float16, got ", t.scalar_type());
    check_device(op, "temperature", t, device);
  }
  for (const auto& [name, t] : {std::make_pair("seeds", &seeds), std::make_pair("offsets", &offsets)}) {
    if (!t->has_value()) continue;
    const at::Tensor& v = **t;
    TORCH_CHECK(v.dim() == 1 && v.size(0) == num_requests, op, ": ", name, " must have shape (B,) = (",
                num_requests, ",), got ", v.sizes());
    TORCH_CHECK(is_index_dtype(v.scalar_type()), op, ": ", name, " must have dtype int32 or int64, got ",
                v.scalar_type());
    check_device(op, name, v, device);
  }
}

// The per-request lenience (docs/ALGORITHM.md §8): [B], a floating dtype, on the logits' device;
// returned as the contiguous float32 vector the kernels read (undefined when absent: exact).
inline at::Tensor lenience_f32(const char* op, const std::optional<at::Tensor>& lenience, int64_t num_requests,
                               const at::Device& device) {
  if (!lenience.has_value()) return at::Tensor();
  const at::Tensor& t = *lenience;
  TORCH_CHECK(t.dim() == 1 && t.size(0) == num_requests, op, ": lenience must have shape (B,) = (", num_requests,
              ",), got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble || t.scalar_type() == at::kBFloat16 ||
                  t.scalar_type() == at::kHalf,
              op, ": lenience must have dtype float32, float64, bfloat16 or float16, got ", t.scalar_type());
  check_device(op, "lenience", t, device);
  return t.to(at::kFloat).contiguous();
}

// The per-request parameters both ops' kernel params share (same field names): temperature
// (dtype code, or none), seeds and offsets with their index widths.
template <typename Params>
void set_request_params(Params& p, const at::Tensor& temperature, const at::Tensor& seeds, const at::Tensor& offsets) {
  p.temperature_dtype = kRsTemperatureNone;
  if (temperature.defined()) {
    p.temperature = temperature.data_ptr();
    switch (temperature.scalar_type()) {
      case at::kFloat: p.temperature_dtype = kRsTemperatureFloat32; break;
      case at::kDouble: p.temperature_dtype = kRsTemperatureFloat64; break;
      case at::kBFloat16: p.temperature_dtype = kRsTemperatureBFloat16; break;
      default: p.temperature_dtype = kRsTemperatureFloat16; break;
    }
  }
  p.seeds = seeds.data_ptr();
  p.seeds_int64 = seeds.scalar_type() == at::kLong;
  if (offsets.defined()) {
    p.offsets = offsets.data_ptr();
    p.offsets_int64 = offsets.scalar_type() == at::kLong;
  }
}

// One op's workspace per device: counters (zero between calls: the kernel's last units reset
// them) and records (always written before they are read). It only grows; the buffers it
// replaces stay alive, since CUDA graphs captured earlier keep using them. Create it with new
// and never delete it: tensors must not be freed by static destructors after CUDA shut down.
class WorkspaceCache {
 public:
  WorkspaceCache(const char* op, int64_t min_record_bytes) : op_(op), min_record_bytes_(min_record_bytes) {}

  // Counters (int32) and record bytes of at least the given sizes on `device`.
  std::pair<int32_t*, uint8_t*> get(const at::Device& device, int64_t num_counters, int64_t record_bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto index = static_cast<size_t>(device.index());
    if (per_device_.size() <= index) per_device_.resize(index + 1);
    Workspace& ws = per_device_[index];
    if (!ws.counters.defined() || ws.counters.numel() < num_counters) {
      check_not_capturing();
      const int64_t old = ws.counters.defined() ? ws.counters.numel() : 0;
      if (ws.counters.defined()) retired_.push_back(ws.counters);
      ws.counters = at::zeros({std::max<int64_t>({num_counters, 2 * old, 4096})},
                              at::TensorOptions().dtype(at::kInt).device(device));
    }
    if (!ws.records.defined() || ws.records.numel() < record_bytes) {
      check_not_capturing();
      const int64_t old = ws.records.defined() ? ws.records.numel() : 0;
      if (ws.records.defined()) retired_.push_back(ws.records);
      ws.records = at::empty({std::max<int64_t>({record_bytes, 2 * old, min_record_bytes_})},
                             at::TensorOptions().dtype(at::kByte).device(device));
    }
    return {ws.counters.data_ptr<int32_t>(), ws.records.data_ptr<uint8_t>()};
  }

 private:
  struct Workspace {
    at::Tensor counters;
    at::Tensor records;
  };

  void check_not_capturing() const {
    TORCH_CHECK(c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None, op_,
                ": the cached workspace must grow while a CUDA graph is being captured; "
                "call the op once eagerly with the largest batch before capturing");
  }

  const char* op_;
  int64_t min_record_bytes_;
  std::mutex mutex_;
  std::vector<Workspace> per_device_;
  std::vector<at::Tensor> retired_;
};

// Tuning knob for benchmarks (benchmarks/tune_cuda_plan.py, docs/DECISIONS.md#cuda-units-per-slot):
// SPECDEC_CUDA_UNITS_PER_SLOT=n makes the plans aim for n work units per resident CTA instead of
// the kernels' own rules (passed to the plan functions as units_per_slot_override). Read once per
// process (not on every call's path); unset, empty or not an integer in [1, 64] = 0, the shipped
// plan.
inline int64_t units_per_slot_override() {
  static const int64_t override_value = [] {
    const char* env = std::getenv("SPECDEC_CUDA_UNITS_PER_SLOT");
    if (env == nullptr || *env == '\0') return int64_t{0};
    char* end = nullptr;
    const long v = std::strtol(env, &end, 10);
    return (end != nullptr && *end == '\0' && v >= 1 && v <= 64) ? int64_t{v} : int64_t{0};
  }();
  return override_value;
}

// Whether a device has compute capability 9.0 or newer (programmatic dependent launch,
// thread-block clusters); read once per device.
inline bool sm90_or_newer(int device_index) {
  static std::mutex mutex;
  static std::vector<int8_t> cache;  // 0 unknown, 1 no, 2 yes
  std::lock_guard<std::mutex> lock(mutex);
  const auto index = static_cast<size_t>(device_index);
  if (cache.size() <= index) cache.resize(index + 1, 0);
  if (cache[index] == 0) {
    int major = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device_index));
    cache[index] = major >= 9 ? 2 : 1;
  }
  return cache[index] == 2;
}

// Programmatic dependent launch (docs/DECISIONS.md#cuda-pdl): on sm_90 and newer the kernels are
// launched so that their CTAs become resident while the previous kernel in the stream drains; they
// execute griddepcontrol.wait before reading or writing any memory, so ordering is that of a plain
// launch. SPECDEC_CUDA_PDL=0 turns it off (read once per process); older cards never use it.
inline bool pdl_enabled(int device_index) {
  static const bool allowed = [] {
    const char* env = std::getenv("SPECDEC_CUDA_PDL");
    return env == nullptr || std::string(env) != "0";
  }();
  return allowed && sm90_or_newer(device_index);
}

}  // namespace specdec::binding
