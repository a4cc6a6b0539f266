// Tile streaming: a row's tiles staged through dynamic shared memory with cp.async, each thread
// copying and reading back only its own segments (no barrier), kStages - 1 tiles in flight; and
// the per-chunk arithmetic of the stream both kernels run (masked chunk max, chunk mass).
#pragma once

#include <cuda_runtime.h>

#include <cfloat>
#include <climits>
#include <cstdint>

#include "kernels/common.cuh"
#include "kernels/elements.cuh"
#include "kernels/warp.cuh"

namespace specdec {
namespace rs_detail {

// ------------------------------------------------------------------------ tile streaming

// Tile staging buffers: the dynamic shared memory of a kernel instance
// (rejection_sample_smem_bytes<T, P>(), tree_rejection_sample_smem_bytes<T, P>()).
extern __shared__ uint4 rs_stage_smem[];

// Stages a row's tiles through shared memory at byte offset kOffset of rs_stage_smem. Lane
// group g (threads 8g .. 8g + 7) holds chunk g of a tile; its lane l owns the slots of
// segments s = 0..3: entries 64 s + 8 l .. + 7 of the chunk (so each 16-byte load of a lane
// group covers 128 contiguous bytes).
template <typename T, int kStages, int kOffset>
struct TileStream {
  using Seg = Segment<T, kRsLaneEntries>;
  static constexpr int kBytes = kStages * kRsLaneSegments * kRsThreads * static_cast<int>(sizeof(Seg));
  const T* row;
  int limit;
  bool vectorized;
  uint32_t fill;

  __device__ __forceinline__ static Seg* slot(int stage, int h, int thread = threadIdx.x) {
    return reinterpret_cast<Seg*>(reinterpret_cast<unsigned char*>(rs_stage_smem) + kOffset) +
           (stage * kRsLaneSegments + h) * kRsThreads + thread;
  }

  // After the stream of tiles [lo, hi): the 8 entries 8 l .. 8 l + 7 of `chunk` for lane l of a
  // warp, from the staging slots while its tile is still there (the last kStages tiles), else
  // from global memory (usually L2).
  __device__ __forceinline__ Seg chunk_segment(int chunk, int lo, int hi) const {
    const int tile = chunk / kRsTileChunks, lane = threadIdx.x & 31;
    if (tile >= hi - kStages && tile >= lo) {
      const int owner = (chunk % kRsTileChunks) * kRsChunkLanes + lane % kRsChunkLanes;
      return *slot((tile - lo) % kStages, lane / kRsChunkLanes, owner);
    }
    return load_segment<T, kRsLaneEntries>(row, chunk * kSampleChunk + lane * kRsLaneEntries, limit, vectorized, fill);
  }

  __device__ __forceinline__ void issue(int tile, int stage) const {
    const int base = (tile * kRsTileChunks + static_cast<int>(threadIdx.x) / kRsChunkLanes) * kSampleChunk +
                     (threadIdx.x % kRsChunkLanes) * kRsLaneEntries;
#pragma unroll
    for (int h = 0; h < kRsLaneSegments; ++h) {
      issue_segment(slot(stage, h), row, base + h * kRsChunkLanes * kRsLaneEntries, limit, vectorized, fill);
    }
  }

  __device__ __forceinline__ Seg segment(int stage, int h) const { return *slot(stage, h); }
};

// Index of entry (segment h, j) of this thread's chunk `chunk`.
__device__ __forceinline__ int entry_index(int chunk, int h, int j) {
  return chunk * kSampleChunk + h * kRsChunkLanes * kRsLaneEntries + (threadIdx.x % kRsChunkLanes) * kRsLaneEntries +
         j;
}

// Runs process(tile, stage) over tiles [lo, hi) with kStages - 1 tiles in flight (kStages = 1:
// each tile is copied, then processed); issue(tile, stage) starts a tile's copies. A slot is
// refilled one iteration after it was read, when its values have been consumed.
template <int kStages, typename Issue>
__device__ __forceinline__ void issue_first_tiles(int lo, int hi, Issue&& issue) {
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (lo + s < hi) issue(lo + s, s);
    cp_async_commit();
  }
}

// The loop after issue_first_tiles<kStages>(lo, hi, issue).
template <int kStages, typename Issue, typename Process>
__device__ __forceinline__ void pipeline_tiles(int lo, int hi, Issue&& issue, Process&& process) {
  int stage = 0;
  for (int tile = lo; tile < hi; ++tile) {
    if constexpr (kStages == 1) {
      issue(tile, 0);
      cp_async_commit();
      cp_async_wait<0>();
    } else {
      cp_async_wait<kStages - 2>();
      if (tile + kStages - 1 < hi) issue(tile + kStages - 1, stage == 0 ? kStages - 1 : stage - 1);
      cp_async_commit();
    }
    process(tile, stage);
    stage = stage + 1 == kStages ? 0 : stage + 1;
  }
  cp_async_wait<0>();
}

// One tile of the greedy stream, the process(tile, stage) step of pipeline_tiles for both
// kernels' greedy rows: this lane's running max of the sanitized logits (NaN dropped, +inf read
// as FLT_MAX) and the first index holding it. A lane's entries come in increasing order, so only
// a new max looks for its first entry. No exp, no table, no race. group: this thread's chunk of
// a tile (threadIdx.x / kRsChunkLanes). Callers keep the loop itself, pipeline_tiles with a
// lambda calling this (a lambda defined inside a shared loop helper reorders two register
// initializations in the SASS of some chain instances; this form compiles to the same SASS).
template <typename T, int kStages, int kOffset>
__device__ __forceinline__ void greedy_tile(const TileStream<T, kStages, kOffset>& stream, int tile, int stage,
                                            int group, float& run_max, int& run_arg) {
  constexpr int kE = kRsLaneEntries;
  using Seg = Segment<T, kE>;
  float lane_max = -INFINITY;
#pragma unroll
  for (int h = 0; h < kRsLaneSegments; ++h) lane_max = fmaxf(lane_max, segment_max(stream.segment(stage, h)));
  const float m = fminf(lane_max, FLT_MAX);
  if (m > run_max) {  // rare after the first tiles: find its first entry
    int first = INT_MAX;
#pragma unroll 1
    for (int h = kRsLaneSegments - 1; h >= 0; --h) {
      const Seg seg = stream.segment(stage, h);
#pragma unroll
      for (int j = kE - 1; j >= 0; --j) {
        if (sanitize(segment_value(seg, j)) == m) first = entry_index(tile * kRsTileChunks + group, h, j);
      }
    }
    run_max = m;
    run_arg = first;
  }
}

// The max of a lane group's chunk in a tile with logits below thr read as -inf (the per-entry
// path of filtered rows; group-uniform).
template <typename T>
__device__ __forceinline__ float masked_chunk_max(const Segment<T, kRsLaneEntries> (&seg)[kRsLaneSegments],
                                                  float thr) {
  float lane_max = -INFINITY;
#pragma unroll
  for (int h = 0; h < kRsLaneSegments; ++h) {
#pragma unroll
    for (int j = 0; j < kRsLaneEntries; ++j) lane_max = fmaxf(lane_max, sanitize_below(segment_value(seg[h], j), thr));
  }
  return group_max(lane_max);
}

// A lane's share of its group's chunk mass over the lane's segments, sum of exp2((l - m) k):
// as one FMA, exp2(l k - m k) with mk = m k, when fma_exact (|m k| small, see the callers), else
// in the exact form. Two accumulators: two independent add chains. The unfiltered hot loop of
// the chain and the tree kernels.
template <typename T>
__device__ __forceinline__ float lane_chunk_mass(const Segment<T, kRsLaneEntries> (&seg)[kRsLaneSegments], float m,
                                                 float k, float mk, bool fma_exact) {
  float mass0 = 0.0f, mass1 = 0.0f;
  if (fma_exact) {
#pragma unroll
    for (int h = 0; h < kRsLaneSegments; ++h) {
#pragma unroll
      for (int j = 0; j < kRsLaneEntries; j += 2) {
        mass0 += exp2f(fmaf(segment_value(seg[h], j), k, -mk));
        mass1 += exp2f(fmaf(segment_value(seg[h], j + 1), k, -mk));
      }
    }
  } else {
#pragma unroll
    for (int h = 0; h < kRsLaneSegments; ++h) {
#pragma unroll
      for (int j = 0; j < kRsLaneEntries; j += 2) {
        mass0 += exp2f((segment_value(seg[h], j) - m) * k);
        mass1 += exp2f((segment_value(seg[h], j + 1) - m) * k);
      }
    }
  }
  return mass0 + mass1;
}

}  // namespace rs_detail
}  // namespace specdec
