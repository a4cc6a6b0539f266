// Sampling inside one chunk of 256 entries, by one warp (lane l holds entries 8 l .. 8 l + 7):
// the inverse CDF over given weights, and the weights of q (softmax, filters, an excluded
// draft) and of the residual max(0, q - p).
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "kernels/common.cuh"
#include "kernels/elements.cuh"
#include "kernels/warp.cuh"

namespace specdec {
namespace rs_detail {

// The residual weight r = max(0, q - p) with q = exp2((l - row_max) k) / row_sum where q > 0,
// else 0: a NaN logit (or one below the filter threshold thr) reads as -inf (q = 0), a NaN p
// gives 0 (fmaxf drops the NaN).
__device__ __forceinline__ float residual_weight(float logit, float prob, float row_max, float k, float inv_sum,
                                                 float thr) {
  const float q = exp2f((sanitize_below(logit, thr) - row_max) * k) * inv_sum;
  return q > 0.0f ? fmaxf(q - prob, 0.0f) : 0.0f;
}

// Inverse CDF inside one chunk, held by a warp (lane l: entries lane_base = 256 c + 8 l .. + 7
// with weights w): the smallest entry with w > 0 whose prefix sum reaches u * W, W the largest
// prefix sum at an entry with w > 0 (so a crossing exists whenever the chunk has mass); -1 if
// it has none. Warp-uniform.
__device__ __forceinline__ int warp_inverse_cdf(const float (&w)[kRsLaneEntries], float u, int lane_base) {
  const int lane = threadIdx.x & 31;
  float lane_sum = 0.0f;
#pragma unroll
  for (int j = 0; j < kRsLaneEntries; ++j) lane_sum += w[j];
  const float incl = warp_inclusive_scan(lane_sum, lane);
  const float before = __shfl_up_sync(kFullMask, incl, 1);
  const float excl = lane == 0 ? 0.0f : before;
  float prefix = excl, pmax = -INFINITY;
#pragma unroll
  for (int j = 0; j < kRsLaneEntries; ++j) {
    prefix += w[j];
    if (w[j] > 0.0f) pmax = fmaxf(pmax, prefix);
  }
  const float threshold = u * warp_max(pmax);
  int first = INT_MAX;
  prefix = excl;
#pragma unroll
  for (int j = 0; j < kRsLaneEntries; ++j) {
    prefix += w[j];
    if (first == INT_MAX && w[j] > 0.0f && prefix >= threshold) first = lane_base + j;
  }
  first = warp_min(first);
  return first == INT_MAX ? -1 : first;
}

// The sample of q inside chunk `chunk` (one warp; lane l holds its entries 8 l .. 8 l + 7 in
// seg): weights exp2((l - m) k) relative to the chunk max m, `excluded` and logits below the
// filter threshold thr left out.
template <typename T>
__device__ __forceinline__ int warp_sample_chunk(const Segment<T, kRsLaneEntries>& seg, int chunk, float k,
                                                 int excluded, float u, float thr) {
  const int lane_base = chunk * kSampleChunk + (threadIdx.x & 31) * kRsLaneEntries;
  float w[kRsLaneEntries];
  float lane_max = -INFINITY;
#pragma unroll
  for (int j = 0; j < kRsLaneEntries; ++j) {
    w[j] = sanitize_below(segment_value(seg, j), thr);
    lane_max = fmaxf(lane_max, w[j]);
  }
  const float m = warp_max(lane_max);
#pragma unroll
  for (int j = 0; j < kRsLaneEntries; ++j) {
    w[j] = (w[j] > -INFINITY && lane_base + j != excluded) ? exp2f((w[j] - m) * k) : 0.0f;
  }
  return warp_inverse_cdf(w, u, lane_base);
}

// The sample of the residual max(0, q - p) inside chunk `chunk` (one warp, as above).
template <typename T, typename P>
__device__ __forceinline__ int warp_sample_residual_chunk(const Segment<T, kRsLaneEntries>& lseg,
                                                          const Segment<P, kRsLaneEntries>& pseg, int chunk,
                                                          float row_max, float k, float inv_sum, float u,
                                                          float thr) {
  const int lane_base = chunk * kSampleChunk + (threadIdx.x & 31) * kRsLaneEntries;
  float w[kRsLaneEntries];
#pragma unroll
  for (int j = 0; j < kRsLaneEntries; ++j) {
    w[j] = residual_weight(segment_value(lseg, j), segment_value(pseg, j), row_max, k, inv_sum, thr);
  }
  return warp_inverse_cdf(w, u, lane_base);
}

}  // namespace rs_detail
}  // namespace specdec
