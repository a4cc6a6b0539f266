// Warp and lane-group reductions (max / min as redux.sync on sm_80+, sums and scans as
// shuffles), the race winner over lanes, and the end of a unit: combining its parts with one
// warp.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "kernels/common.cuh"
#include "kernels/elements.cuh"

namespace specdec {
namespace rs_detail {

// ---------------------------------------------------------------------------- warp helpers

// Order-preserving map of floats onto uint32 keys (a NaN ranks lowest, as fmaxf drops it) and
// back, for max reductions on the integer reduce unit.
__device__ __forceinline__ uint32_t ordered_key(float v) {
  const uint32_t b = __float_as_uint(v);
  const uint32_t key = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  return is_nan(v) ? 0u : key;
}

__device__ __forceinline__ float from_ordered_key(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7FFFFFFFu) : ~key);
}

// Warp reductions; every lane ends with the same value. Max and min are one redux.sync each
// (sm_80+) instead of five dependent shuffles: the ends of units and the finalizers chain a dozen
// of them (docs/DECISIONS.md#cuda-warp-redux). The max of floats is exact either way (one of the
// inputs; NaNs dropped unless all are NaN); sums add in butterfly order.
__device__ __forceinline__ float warp_max(float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return from_ordered_key(__reduce_max_sync(kFullMask, ordered_key(v)));
#else
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
#endif
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

__device__ __forceinline__ int warp_min(int v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return __reduce_min_sync(kFullMask, v);
#else
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
#endif
}

__device__ __forceinline__ float warp_inclusive_scan(float v, int lane) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const float up = __shfl_up_sync(kFullMask, v, o);
    if (lane >= o) v += up;
  }
  return v;
}

// Lane-group reductions (the 8 lanes that hold a chunk, each group separately; every lane
// gets its group's value); `mask` names whole groups.
__device__ __forceinline__ float group_max(float v, unsigned mask = kFullMask) {
#pragma unroll
  for (int o = kRsChunkLanes / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(mask, v, o));
  return v;
}

__device__ __forceinline__ float group_sum(float v, unsigned mask = kFullMask) {
#pragma unroll
  for (int o = kRsChunkLanes / 2; o > 0; o >>= 1) v += __shfl_xor_sync(mask, v, o);
  return v;
}

__device__ __forceinline__ int group_min(int v, unsigned mask = kFullMask) {
#pragma unroll
  for (int o = kRsChunkLanes / 2; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(mask, v, o));
  return v;
}

__device__ __forceinline__ float group_inclusive_scan(float v, int gl, unsigned mask) {
#pragma unroll
  for (int o = 1; o < kRsChunkLanes; o <<= 1) {
    const float up = __shfl_up_sync(mask, v, o, kRsChunkLanes);
    if (gl >= o) v += up;
  }
  return v;
}

// Race winner over lanes: highest score, lowest chunk on ties, and that lane's candidate (the
// lowest such lane's if several hold the same score and chunk); every lane gets the result.
__device__ __forceinline__ void warp_race_winner(float& score, int& chunk, int& candidate) {
  const float best = warp_max(score);
  const bool at_best = ordered_key(score) == ordered_key(best);
  const int best_chunk = warp_min(at_best ? chunk : INT_MAX);
  const unsigned holders = __ballot_sync(kFullMask, at_best && chunk == best_chunk);
  candidate = __shfl_sync(kFullMask, candidate, holders != 0u ? __ffs(holders) - 1 : 0);
  score = best;
  chunk = best_chunk;
}

// The end of a unit: combining its parts (kRsGroups lane groups, or kRsWarps warps for greedy
// rows) left in shared memory. One warp, lane c reading part c, every lane gets the result;
// never a thread-0 loop over the parts, whose dependent shared loads sit on the critical path of
// every unit (docs/DECISIONS.md#cuda-warp-combine). Sums are added in a butterfly order, so
// they may differ from a serial sum in the last bit (the backends agree up to near-ties).

// The parts' max m and their sums rescaled to it: sum_c s_c exp2((m_c - m) k).
__device__ __forceinline__ void warp_combine_max_sum(const float* part_max, const float* part_sum, int parts, float k,
                                                     float& m, float& s) {
  const int lane = threadIdx.x & 31;
  const float mc = lane < parts ? part_max[lane] : -INFINITY;
  m = warp_max(mc);
  s = warp_sum(mc > -INFINITY ? part_sum[lane] * exp2f((mc - m) * k) : 0.0f);
}

// The parts' max m and the lowest index among the parts at m (INT_MAX: none).
__device__ __forceinline__ void warp_combine_max_index(const float* part_max, const int* part_index, int parts,
                                                       float& m, int& index) {
  const int lane = threadIdx.x & 31;
  const float mc = lane < parts ? part_max[lane] : -INFINITY;
  m = warp_max(mc);
  index = warp_min(mc > -INFINITY && mc == m ? part_index[lane] : INT_MAX);
}

}  // namespace rs_detail
}  // namespace specdec
