// Host-side helpers shared by the torch bindings of the CUDA kernels (rejection_sample_cuda.cu,
// tree_rejection_sample_cuda.cu): dtype and device checks, layout checks, the per-request
// kernel parameters and the cached per-device workspace. Each op keeps its own WorkspaceCache.
// Included by the .cu bindings only (it pulls in a kernel header).
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <utility>
#include <vector>

#include "kernels/rejection_sample.cuh"  // the temperature dtype codes (kRsTemperature*)

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

}  // namespace specdec::binding
