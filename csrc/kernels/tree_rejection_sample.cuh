// Fused tree verification (docs/ALGORITHM.md §5): one launch per call, torch-free.
//
// The same function of the inputs and seeds as the Triton tree kernel
// (specdec_kernels/triton_tree_rejection_sample.py) and the CPU reference, with the same
// Philox streams, so the backends give the same tokens except at float near-ties.
//
// Work units (one CTA of 256 threads each):
//   phase 1: unit (node row g, split s) for g < N: streams tiles [s * tiles_per_split, ...) of
//            row g once and writes an RtSplitRecord (max, sum of exp2((l - max) k), greedy
//            argmax) and, for random requests, the split's part of the row's chunk table
//            (m_c, W_c) per 256 logits (docs/ALGORITHM.md §3). Split 0 also writes the node's
//            RtNodeRecord: its linked parent, its valid token, and the parent row's logit and
//            draft probability at that token, so the walk needs no dependent loads. The unit
//            finds its request by scanning cu (any cu: the sanitized offsets of the
//            reference, cu' = clamp(running max of cu, 0, N)).
//   empty:   unit (request b) for b < B: writes the outputs of a request without nodes.
// The unit that finishes a request last (an atomic counter per request) walks its tree from
// the root (the finalizer), with the whole CTA executing the walk in lockstep on data staged
// in shared memory: the node records, the accept uniforms and the combined row statistics of
// the first kRtCachedNodes nodes (further nodes are read from the records in global memory).
// It writes the accepted path while walking, then samples the final token:
//   - greedy requests: the argmax of the final node's row;
//   - deterministic drafts: the chunk race over the node's table, the chunks holding a
//     rejected child's token rewritten in place without those tokens (the table is private to
//     the request until the next call), then the inverse CDF in the winning chunk;
//   - draft probabilities: after a rejection the residual (q - a p)+ needs the node's logits
//     and draft row again: the finalizer streams both rows (one pass per rejection that is
//     followed by another test, for its mass, and one for the race); otherwise the table.
// The finalizer resets the counter, so the cached workspace is clean between calls (CUDA
// graphs). Nothing ever waits on another CTA: no tickets, no deadlock.
//
// Streaming, staging, chunk sampling and warp helpers are shared with the chain kernel
// (stream.cuh, elements.cuh, chunk_sampling.cuh, warp.cuh; namespace rs_detail).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <climits>
#include <cstdint>
#include <type_traits>

#include "kernels/chunk_sampling.cuh"
#include "kernels/common.cuh"
#include "kernels/elements.cuh"
#include "kernels/pdl.cuh"
#include "kernels/philox.cuh"
#include "kernels/stream.cuh"
#include "kernels/warp.cuh"

// Tiles of 16-bit logits staged per CTA in phase 1 (tuning macro: SPECDEC_NVCC_FLAGS=-D...;
// docs/DECISIONS.md#cuda-staging-depth).
#ifndef SPECDEC_TREE_STREAM_STAGES_16BIT
#define SPECDEC_TREE_STREAM_STAGES_16BIT 4
#endif

namespace specdec {

constexpr int kRtThreads = kRsThreads;  // 256; the helpers of rs_detail assume it
constexpr int kRtWarps = kRtThreads / 32;
constexpr int kRtMaxSplits = 64;        // a node's split records are combined by one thread
constexpr int kRtCachedNodes = 256;     // nodes whose walk data the finalizer stages in shared memory
constexpr int kRtMaxExcluded = 256;     // rejected children's tokens listed in shared memory (more: scans)
constexpr int kRtUnitsPerSlot = 2;      // phase-1 units per resident CTA the plan aims for
constexpr int kRtOwnerUnroll = 8;       // cu entries each thread loads per round of the owner search
constexpr int64_t kRtMaxVocab = int64_t{1} << 30;  // entry indices (+ one tile) stay in int32

// One phase-1 unit's statistics of its split of a row: one 16-byte access.
struct __align__(16) RtSplitRecord {
  float row_max;   // max of the sanitized logits of the split (-inf: no valid logit)
  float exp_sum;   // sum of exp2((l - row_max) k) (random requests; 0 for greedy ones)
  int32_t argmax;  // lowest index of row_max (greedy requests; -1 otherwise or without a valid logit)
  int32_t unused;
};

// What the walk needs of node j (written by split 0 of its row).
struct __align__(16) RtNodeRecord {
  int32_t parent;    // local parent index if 0 <= parent < j (the link counts), else -1
  int32_t token;     // the node's token if it is in [0, V), else -1 (never accepted)
  float edge_logit;  // sanitized logit of the parent's row at the token (-inf if no link or token)
  float edge_prob;   // the parent's draft probability of the token (0 without draft probs / link)
};

// The work decomposition, computed on the host (plan_tree_rejection_sample).
struct TreeRejectionSamplePlan {
  int32_t num_chunks;
  int32_t num_tiles;
  int32_t num_splits;
  int32_t tiles_per_split;
  int64_t units_phase1;  // num_nodes * num_splits
  int64_t units_total;   // + num_requests (the empty-request units)
  int64_t num_split_records;
  int64_t num_table_entries;  // num_nodes * num_chunks
};

struct TreeRejectionSampleParams {
  const void* target_logits;  // [num_nodes, vocab] T, unit stride along the vocabulary
  int64_t logits_row_stride;  // in elements
  bool logits_vectorized;     // base and row stride 16-byte aligned
  const void* tokens;         // [num_nodes] int32 / int64
  bool tokens_int64;
  const void* parents;  // [num_nodes] int32 / int64
  bool parents_int64;
  const void* cu_num_nodes;  // [num_requests + 1] int32 / int64
  bool cu_int64;
  const void* draft_probs;  // [num_nodes, vocab] P, or nullptr
  int64_t draft_probs_row_stride;
  bool probs_vectorized;
  const void* temperature;  // [num_requests], dtype temperature_dtype (RsTemperatureDtype)
  int32_t temperature_dtype;
  const void* seeds;  // [num_requests] int32 / int64
  bool seeds_int64;
  const void* offsets;  // [num_requests] int32 / int64, or nullptr (offset 0)
  bool offsets_int64;
  // Per-request lenience in (0, 1] (docs/ALGORITHM.md §8), float32 [num_requests], or nullptr:
  // exact. Read once by the finalizer's walk; l = 1 gives the exact op's tokens bit for bit.
  const float* lenience;
  int32_t* output_token_ids;  // [num_requests, max_depth + 1]
  int32_t* accepted_nodes;    // [num_requests, max_depth + 1]
  int32_t* num_accepted;      // [num_requests]
  // Workspace: counters [num_requests], zero between calls; records always written before read.
  int32_t* counters;
  RtSplitRecord* split_records;  // [units_phase1]
  RtNodeRecord* node_records;    // [num_nodes]
  float2* chunk_tables;          // [num_nodes, num_chunks]: (chunk max m_c, sum of exp2((l - m_c) k))
  // Sampling filters (docs/ALGORITHM.md §7): each node row's threshold logit from the threshold
  // pass; logits below it count as -inf (-inf: unfiltered). nullptr: no filters.
  const float* row_thresholds;   // [num_nodes]
  int64_t num_nodes;
  int32_t vocab_size;
  int32_t num_requests;
  int32_t max_depth;
  TreeRejectionSamplePlan plan;
};

// ------------------------------------------------------------------------------ host plan

// concurrent_ctas: CTAs the GPU runs at once. Rows are split so that there are about units_per_slot
// units per resident CTA (small batches spread the vocabulary over the GPU, large ones get one unit
// per row). units_per_slot_override > 0 (benchmarks) aims at that many instead of kRtUnitsPerSlot
// and turns off the one-wave rule; 0, the shipped plan, whose one-wave rule is the chain plan's
// (plan_rejection_sample): without draft probabilities, phase-1 units split at most twice as
// coarsely when that fits them and the finalizers in one wave of resident CTAs. The chain's cap on
// such units (kRsOneWaveMaxTiles) is not applied here: it was measured on the chain kernel only
// (64-node trees at B = 1 take 3-tile units, within it, either way;
// docs/DECISIONS.md#cuda-tree-one-wave).
inline TreeRejectionSamplePlan plan_tree_rejection_sample(int64_t num_nodes, int64_t num_requests, int64_t vocab,
                                                          int64_t concurrent_ctas,
                                                          bool has_draft_probs,
                                                          int64_t units_per_slot_override = 0) {
  const bool fit_one_wave = units_per_slot_override <= 0;
  const int64_t units_per_slot = fit_one_wave ? kRtUnitsPerSlot : units_per_slot_override;
  TreeRejectionSamplePlan plan{};
  const int64_t num_chunks = rs_ceil_div(vocab < 1 ? 1 : vocab, kSampleChunk);
  const int64_t num_tiles = rs_ceil_div(num_chunks, kRsTileChunks);
  const int64_t wanted = rs_ceil_div(units_per_slot * (concurrent_ctas < 1 ? 1 : concurrent_ctas),
                                     num_nodes < 1 ? 1 : num_nodes);
  const int64_t cap = num_tiles < kRtMaxSplits ? num_tiles : kRtMaxSplits;
  const int64_t splits = wanted < 1 ? 1 : (wanted > cap ? cap : wanted);
  int64_t per_split = rs_ceil_div(num_tiles, splits);
  if (fit_one_wave && !has_draft_probs && num_nodes > 0 &&
      num_nodes * rs_ceil_div(num_tiles, per_split) + num_requests > concurrent_ctas &&
      concurrent_ctas - num_requests >= num_nodes) {
    const int64_t one_wave = (concurrent_ctas - num_requests) / num_nodes;
    const int64_t coarse = rs_ceil_div(num_tiles, one_wave < cap ? one_wave : cap);
    if (coarse <= 2 * per_split && num_nodes * rs_ceil_div(num_tiles, coarse) + num_requests <= concurrent_ctas) {
      per_split = coarse;
    }
  }
  plan.num_chunks = static_cast<int32_t>(num_chunks);
  plan.num_tiles = static_cast<int32_t>(num_tiles);
  plan.tiles_per_split = static_cast<int32_t>(per_split);
  plan.num_splits = static_cast<int32_t>(rs_ceil_div(num_tiles, per_split));  // no empty split
  plan.units_phase1 = num_nodes * plan.num_splits;
  plan.units_total = plan.units_phase1 + num_requests;
  plan.num_split_records = plan.units_phase1;
  plan.num_table_entries = num_nodes * num_chunks;
  return plan;
}

namespace rt_detail {

using namespace rs_detail;

// Per instance: shared memory and CTAs per SM.
//  - phase 1 stages tiles of logits through all of the dynamic shared memory (at least 4
//    tiles of 16-bit logits or 2 of fp32: 64 KB, 3 CTAs per SM);
//  - the finalizer reuses it: the node cache (8 KB), then the rejected children's tokens
//    (deterministic drafts) or the staging of the two-row passes (draft probabilities: two
//    stages of a logits tile and a draft tile where that fits in 112 KB, else one).
template <typename T, typename P>
struct RtConfig {
  static constexpr bool kHasDraftProbs = !std::is_same<P, NoDraftProbs>::value;
  static constexpr int kTileBytes = kRsTileEntries * static_cast<int>(sizeof(T));
  static constexpr int kMinStreamStages = sizeof(T) == 2 ? SPECDEC_TREE_STREAM_STAGES_16BIT : 2;
  static constexpr int kNodeCacheBytes = kRtCachedNodes * 32;  // 8 arrays of 4-byte fields
  static constexpr int kExcludedBytes = kHasDraftProbs ? 0 : kRtMaxExcluded * 4;
  static constexpr int kPairTileBytes =
      kHasDraftProbs ? kRsTileEntries * static_cast<int>(sizeof(T) + sizeof(typename std::conditional<
                                                                                 kHasDraftProbs, P, float>::type))
                     : 0;
  static constexpr int kPassStages =
      kHasDraftProbs ? (kNodeCacheBytes + 2 * kPairTileBytes <= 112 * 1024 ? 2 : 1) : 0;
  static constexpr int kFinalizerBytes = kNodeCacheBytes + kExcludedBytes + kPassStages * kPairTileBytes;
  static constexpr int kStreamBytes = kMinStreamStages * kTileBytes;
  static constexpr int kSmemBytes = kStreamBytes > kFinalizerBytes ? kStreamBytes : kFinalizerBytes;
  static constexpr int kStages = kSmemBytes / kTileBytes;  // phase 1 uses all of it
  // 228 KB of shared memory per SM (H100/H200), about 2 KB per CTA besides the dynamic part.
  static constexpr int kFitBlocks = (228 * 1024) / (kSmemBytes + 2048);
  static constexpr int kMinBlocksPerSM = kFitBlocks > 4 ? 4 : (kFitBlocks < 1 ? 1 : kFitBlocks);
  static_assert(kSmemBytes <= 227 * 1024, "dynamic shared memory of the tree kernel");
  static_assert(kNodeCacheBytes % 16 == 0 && kExcludedBytes % 16 == 0, "staging stays 16-byte aligned");
};

// The request a unit works for.
struct RtRequest {
  int b;
  int n;         // nodes: cu'[b+1] - cu'[b]
  int64_t cu_lo;  // cu'[b]
  bool greedy;
  float k;  // log2(e) / T (log2(e) for greedy requests)
  uint64_t seed;
  uint64_t offset;
};

struct RtShared {
  float reduce_max[kRsGroups];
  float reduce_sum[kRsGroups];
  int reduce_index[kRsGroups];
  float reduce_score[kRsGroups];
  int reduce_chunk[kRsGroups];
  long long reduce_i64[kRtWarps];
  int reduce_i32[kRtWarps];
  float reduce_f32[kRtWarps];
  int is_last;
  int num_excluded;
  // Block-wide results, one field per producer (a barrier separates each read from the next write).
  int win_chunk;
  int token;
};

// The finalizer's node cache: 8 arrays of kRtCachedNodes 4-byte fields at the start of the
// dynamic shared memory (free once phase 1's stream is done), at fixed offsets.
struct NodeCache {
  enum Field { kParent, kToken, kEdgeLogit, kEdgeProb, kAcceptU, kRowMax, kRowSum, kArgmax };
  __device__ __forceinline__ static int& i32(Field f, int j) {
    return reinterpret_cast<int*>(rs_stage_smem)[f * kRtCachedNodes + j];
  }
  __device__ __forceinline__ static float& f32(Field f, int j) {
    return reinterpret_cast<float*>(rs_stage_smem)[f * kRtCachedNodes + j];
  }
};

// The rejected children's tokens (deterministic drafts), after the node cache.
template <typename T, typename P>
__device__ __forceinline__ int* excluded_tokens() {
  return reinterpret_cast<int*>(reinterpret_cast<unsigned char*>(rs_stage_smem) + RtConfig<T, P>::kNodeCacheBytes);
}

// ------------------------------------------------------------------------ block reductions

// Every thread gets the result; two barriers, so the scratch slots can be reused right after.
__device__ __forceinline__ int block_min_i32(int v, RtShared& sm) {
  v = warp_min(v);
  if ((threadIdx.x & 31) == 0) sm.reduce_i32[threadIdx.x >> 5] = v;
  __syncthreads();
  int r = sm.reduce_i32[0];
#pragma unroll
  for (int w = 1; w < kRtWarps; ++w) r = min(r, sm.reduce_i32[w]);
  __syncthreads();
  return r;
}

__device__ __forceinline__ long long block_max_i64(long long v, RtShared& sm) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const long long other = __shfl_xor_sync(kFullMask, v, o);
    v = other > v ? other : v;
  }
  if ((threadIdx.x & 31) == 0) sm.reduce_i64[threadIdx.x >> 5] = v;
  __syncthreads();
  long long r = sm.reduce_i64[0];
#pragma unroll
  for (int w = 1; w < kRtWarps; ++w) r = sm.reduce_i64[w] > r ? sm.reduce_i64[w] : r;
  __syncthreads();
  return r;
}

// Sum in a fixed order (lanes, then warps 0..7): the same value on every thread and every run.
__device__ __forceinline__ float block_sum_f32(float v, RtShared& sm) {
  v = warp_sum(v);
  if ((threadIdx.x & 31) == 0) sm.reduce_f32[threadIdx.x >> 5] = v;
  __syncthreads();
  float r = sm.reduce_f32[0];
#pragma unroll
  for (int w = 1; w < kRtWarps; ++w) r += sm.reduce_f32[w];
  __syncthreads();
  return r;
}

// Race winner over the CTA: highest score, lowest chunk on ties; -1 if no score > -inf.
__device__ __forceinline__ int block_race_winner(float score, int chunk, RtShared& sm) {
  int unused = 0;
  warp_race_winner(score, chunk, unused);
  if ((threadIdx.x & 31) == 0) {
    sm.reduce_score[threadIdx.x >> 5] = score;
    sm.reduce_chunk[threadIdx.x >> 5] = chunk;
  }
  __syncthreads();
  float best = -INFINITY;
  int best_chunk = INT_MAX;
#pragma unroll
  for (int w = 0; w < kRtWarps; ++w) {
    const float s = sm.reduce_score[w];
    const int c = sm.reduce_chunk[w];
    if (s > best || (s == best && c < best_chunk)) {
      best = s;
      best_chunk = c;
    }
  }
  __syncthreads();
  return best > -INFINITY ? best_chunk : -1;
}

// ------------------------------------------------------------------------------ requests

__device__ __forceinline__ float load_temperature(const TreeRejectionSampleParams& p, int b) {
  switch (p.temperature_dtype) {
    case kRsTemperatureFloat32:
      return __ldg(static_cast<const float*>(p.temperature) + b);
    case kRsTemperatureFloat64:
      return __double2float_rn(__ldg(static_cast<const double*>(p.temperature) + b));
    case kRsTemperatureBFloat16:
      return load_value(static_cast<const __nv_bfloat16*>(p.temperature) + b);
    case kRsTemperatureFloat16:
      return load_value(static_cast<const __half*>(p.temperature) + b);
    default:
      return 1.0f;
  }
}

__device__ __forceinline__ void load_request_params(const TreeRejectionSampleParams& p, RtRequest& rq) {
  const float temperature = load_temperature(p, rq.b);
  rq.greedy = !(temperature > 0.0f) || is_nan(temperature);  // 0, negative and NaN are greedy
  rq.k = rq.greedy ? kLog2e : __fdiv_rn(kLog2e, temperature);
  rq.seed = static_cast<uint64_t>(load_index(p.seeds, p.seeds_int64, rq.b));
  rq.offset = p.offsets != nullptr ? static_cast<uint64_t>(load_index(p.offsets, p.offsets_int64, rq.b)) : 0u;
}

// The request owning node row `row` under the sanitized offsets cu'[i] = clamp(max(cu[0..i]),
// 0, N) (block-wide; every thread gets the result). With first = the least i such that
// cu[i] > row: the owner is first - 1, cu'[owner] = max(0, cu[0..first-1]) <= row and
// cu'[owner + 1] = min(cu[first], N) > row. False when no request owns the row (first = 0,
// or no such i). Entries are scanned in rounds of kRtThreads * kRtOwnerUnroll, stopping at
// the first round that holds `first`: one round for B < 2048.
__device__ inline bool find_owner(const TreeRejectionSampleParams& p, RtShared& sm, int64_t row, RtRequest& rq) {
  const int entries = p.num_requests + 1;
  long long below = 0;  // max(0, cu[i]) over the entries scanned with i < first
  for (int base = 0; base < entries; base += kRtThreads * kRtOwnerUnroll) {
    long long vals[kRtOwnerUnroll];
#pragma unroll
    for (int r = 0; r < kRtOwnerUnroll; ++r) {
      const int i = base + r * kRtThreads + static_cast<int>(threadIdx.x);
      vals[r] = i < entries ? load_index(p.cu_num_nodes, p.cu_int64, i) : LLONG_MIN;
    }
    int local_first = INT_MAX;
#pragma unroll
    for (int r = kRtOwnerUnroll - 1; r >= 0; --r) {
      if (vals[r] > row) local_first = base + r * kRtThreads + static_cast<int>(threadIdx.x);
    }
    const int first = block_min_i32(local_first, sm);
#pragma unroll
    for (int r = 0; r < kRtOwnerUnroll; ++r) {
      const int i = base + r * kRtThreads + static_cast<int>(threadIdx.x);
      if (i < entries && i < first && vals[r] > below) below = vals[r];
    }
    if (first != INT_MAX) {
      const long long lo = block_max_i64(below, sm);
      if (first == 0) return false;
      const int64_t hi_raw = load_index(p.cu_num_nodes, p.cu_int64, first);
      const int64_t hi = hi_raw < p.num_nodes ? hi_raw : p.num_nodes;
      rq.b = first - 1;
      rq.cu_lo = lo;
      rq.n = static_cast<int>(hi - lo);
      return true;
    }
  }
  return false;
}

// ------------------------------------------------------------------------------- phase 1

// Split 0 of node row `row` (thread 0): the node's link, token and edge values (parents[row]
// and tokens[row] were loaded before the owner search).
template <typename T, typename P>
__device__ __forceinline__ void write_node_record(const TreeRejectionSampleParams& p, const RtRequest& rq,
                                                  int64_t row, int64_t parent, int64_t token) {
  constexpr bool kHasDraftProbs = !std::is_same<P, NoDraftProbs>::value;
  const int64_t j = row - rq.cu_lo;
  const bool linked = j > 0 && parent >= 0 && parent < j;  // parent < child: never a cycle
  const bool token_ok = token >= 0 && token < p.vocab_size;
  float edge_logit = -INFINITY, edge_prob = 0.0f;
  if (linked && token_ok) {
    const int64_t parent_row = rq.cu_lo + parent;  // in [cu'[b], row)
    // (-inf below the parent row's filter threshold: q(token) = 0, the edge is rejected)
    const float parent_thr = p.row_thresholds != nullptr ? p.row_thresholds[parent_row] : -INFINITY;
    edge_logit = sanitize_below(
        load_value(static_cast<const T*>(p.target_logits) + parent_row * p.logits_row_stride + token), parent_thr);
    if constexpr (kHasDraftProbs) {
      edge_prob = load_value(static_cast<const P*>(p.draft_probs) + parent_row * p.draft_probs_row_stride + token);
    }
  }
  __stcg(reinterpret_cast<float4*>(p.node_records + row),
         make_float4(__int_as_float(linked ? static_cast<int>(parent) : -1),
                     __int_as_float(token_ok ? static_cast<int>(token) : -1), edge_logit, edge_prob));
}

template <typename T, typename P>
__device__ void finalize_request(const TreeRejectionSampleParams& p, RtShared& sm, const RtRequest rq);

template <typename T, typename P>
__device__ void phase1_unit(const TreeRejectionSampleParams& p, RtShared& sm, int64_t unit) {
  constexpr int kStages = RtConfig<T, P>::kStages;
  constexpr int kE = kRsLaneEntries;
  using Seg = Segment<T, kE>;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int num_splits = p.plan.num_splits;
  const int64_t row = unit / num_splits;
  const int split = static_cast<int>(unit % num_splits);
  const int tile_lo = split * p.plan.tiles_per_split;
  const int tile_hi = min(tile_lo + p.plan.tiles_per_split, p.plan.num_tiles);
  const TileStream<T, kStages, 0> stream{static_cast<const T*>(p.target_logits) + row * p.logits_row_stride,
                                         p.vocab_size, p.logits_vectorized, ElemBits<T>::kNegInf};
  const auto issue = [&](int tile, int stage) { stream.issue(tile, stage); };
  // The row is known before its request: its first tiles (and split 0's node fields) load
  // while the owner is found.
  issue_first_tiles<kStages>(tile_lo, tile_hi, issue);
  const bool records_node = split == 0 && threadIdx.x == 0;
  int64_t node_parent = -1, node_token = -1;
  if (records_node) {
    node_parent = load_index(p.parents, p.parents_int64, row);
    node_token = load_index(p.tokens, p.tokens_int64, row);
  }
  RtRequest rq;
  if (!find_owner(p, sm, row, rq)) {
    cp_async_wait<0>();  // a row of no request (malformed cu): nothing to contribute
    return;
  }
  load_request_params(p, rq);
  if (records_node) write_node_record<T, P>(p, rq, row, node_parent, node_token);
  const float k = rq.k;
  const int group = threadIdx.x / kRsChunkLanes;  // this thread's chunk of a tile
  const int gl = threadIdx.x % kRsChunkLanes;
  if (rq.greedy) {
    // Per-lane running max and its first index (stream.cuh, greedy_tile).
    float run_max = -INFINITY;
    int run_arg = INT_MAX;
    pipeline_tiles<kStages>(tile_lo, tile_hi, issue, [&](int tile, int stage) {
      greedy_tile(stream, tile, stage, group, run_max, run_arg);
    });
    const float wm = warp_max(run_max);
    const int arg = warp_min(run_max == wm ? run_arg : INT_MAX);
    if (lane == 0) {
      sm.reduce_max[warp] = wm;
      sm.reduce_index[warp] = arg;
    }
  } else {
    // Per lane group: running max and sum over its chunks, and each chunk's table entry.
    float2* table = p.chunk_tables + row * p.plan.num_chunks;
    float run_max = -INFINITY, run_sum = 0.0f;
    // Sampling filters: a filtered row (CTA-uniform) takes a plain per-entry path, logits below
    // its threshold counting as -inf.
    const float thr = p.row_thresholds != nullptr ? p.row_thresholds[row] : -INFINITY;
    const bool filtered = thr > -INFINITY;
    pipeline_tiles<kStages>(tile_lo, tile_hi, issue, [&](int tile, int stage) {
      const int chunk = tile * kRsTileChunks + group;
      Seg seg[kRsLaneSegments];
#pragma unroll
      for (int h = 0; h < kRsLaneSegments; ++h) seg[h] = stream.segment(stage, h);
      float m, mass;  // the chunk max (sanitized, filtered) and its mass
      if (filtered) {
        m = masked_chunk_max(seg, thr);
        const float m_safe = m > -INFINITY ? m : 0.0f;
        float lane_mass = 0.0f;
#pragma unroll
        for (int h = 0; h < kRsLaneSegments; ++h) {
#pragma unroll
          for (int j = 0; j < kE; ++j) {
            const float x = sanitize_below(segment_value(seg[h], j), thr);
            lane_mass += x > -INFINITY ? exp2f((x - m_safe) * k) : 0.0f;
          }
        }
        mass = group_sum(lane_mass);
      } else {
        float lane_max = -INFINITY;
#pragma unroll
        for (int h = 0; h < kRsLaneSegments; ++h) lane_max = fmaxf(lane_max, segment_max(seg[h]));
        m = group_max(fminf(lane_max, FLT_MAX));  // the chunk max (sanitized)
        // exp2((l - m) k) as one FMA, exp2(l k - m k), while m k is small: its float rounding
        // (|m k| 2^-24, the same factor for the whole chunk) stays below 2^-16, as accurate as
        // (l - m) k. Larger |m k| (large logits, tiny temperatures: T = 1e-6 makes m k ~ 1e7,
        // rounded by up to 0.5) use the exact form. A chunk without a valid logit: m = 0, weights 0.
        const float mk = (m > -INFINITY ? m : 0.0f) * k;
        mass = lane_chunk_mass(seg, m, k, mk, fabsf(mk) <= 256.0f);  // the form is uniform over the lane group
        // Each weight is about <= 1, so a larger (or NaN) sum means a NaN or +inf logit in this
        // lane. Rare: recompute the lane's weights as the Triton kernel does,
        // exp2((sanitize(l) - m) k), with NaN -> 0 and +inf -> FLT_MAX.
        if (!(mass <= 2.0f * kRsLaneSegments * kE)) {
          mass = 0.0f;
#pragma unroll 1
          for (int h = 0; h < kRsLaneSegments; ++h) {
            const Seg sg = stream.segment(stage, h);
#pragma unroll
            for (int j = 0; j < kE; ++j) {
              const float x = sanitize(segment_value(sg, j));
              mass += x > -INFINITY ? exp2f((x - m) * k) : 0.0f;
            }
          }
        }
        mass = group_sum(mass);
      }
      if (gl == 0 && chunk < p.plan.num_chunks) __stcg(table + chunk, make_float2(m, mass));
      if (m > run_max) {
        run_sum = run_sum * exp2f((run_max - m) * k) + mass;  // 0 while run_max = -inf
        run_max = m;
      } else if (m > -INFINITY) {
        run_sum += mass * exp2f((m - run_max) * k);
      }
    });
    if (gl == 0) {
      sm.reduce_max[group] = run_max;
      sm.reduce_sum[group] = run_sum;
    }
  }
  __syncthreads();
  if (threadIdx.x < 32) {  // warp 0 combines the parts (rs_detail::warp_combine_*)
    float m = -INFINITY, s = 0.0f;
    int a = INT_MAX;
    if (rq.greedy) {
      warp_combine_max_index(sm.reduce_max, sm.reduce_index, kRsWarps, m, a);
    } else {
      warp_combine_max_sum(sm.reduce_max, sm.reduce_sum, kRsGroups, k, m, s);
    }
    if (threadIdx.x == 0) {
      __stcg(reinterpret_cast<float4*>(p.split_records + unit),
             make_float4(m, s, __int_as_float((rq.greedy && m > -INFINITY && a != INT_MAX) ? a : -1), 0.0f));
    }
  }
  // Release this unit's table entries and records (every writer fences), then count the unit;
  // the last unit of the request finalizes it.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const int done = atomicAdd(p.counters + rq.b, 1);
    sm.is_last = done == rq.n * num_splits - 1;
  }
  __syncthreads();
  if (sm.is_last) {
    __threadfence();  // acquire the other units' records
    finalize_request<T, P>(p, sm, rq);
  }
}

// Writes the outputs of request b if it has no node (cu'[b+1] == cu'[b]).
__device__ inline void empty_request_unit(const TreeRejectionSampleParams& p, RtShared& sm, int b) {
  long long lo = 0, hi = 0;  // max(0, cu[0..b]) and max(0, cu[0..b+1])
#pragma unroll 4
  for (int i = threadIdx.x; i <= b + 1; i += kRtThreads) {
    const long long v = load_index(p.cu_num_nodes, p.cu_int64, i);
    if (i <= b && v > lo) lo = v;
    if (v > hi) hi = v;
  }
  lo = block_max_i64(lo, sm);
  hi = block_max_i64(hi, sm);
  lo = lo < p.num_nodes ? lo : p.num_nodes;
  hi = hi < p.num_nodes ? hi : p.num_nodes;
  if (hi > lo) return;  // finalized by its last phase-1 unit
  const int width = p.max_depth + 1;
  int32_t* out = p.output_token_ids + static_cast<int64_t>(b) * width;
  int32_t* nodes = p.accepted_nodes + static_cast<int64_t>(b) * width;
  for (int pos = threadIdx.x; pos < width; pos += kRtThreads) {
    out[pos] = -1;
    nodes[pos] = -1;
  }
  if (threadIdx.x == 0) p.num_accepted[b] = 0;
}

// ------------------------------------------------------------------------------ the walk

struct RtNodeStats {
  float row_max;
  float row_sum;
  int argmax;
};

// A node's row statistics from its split records (one thread; records in increasing split
// order, so the first argmax is the lowest).
__device__ __forceinline__ RtNodeStats combine_splits(const TreeRejectionSampleParams& p, int64_t row, float k) {
  const float4* records = reinterpret_cast<const float4*>(p.split_records + row * p.plan.num_splits);
  float m = -INFINITY, s = 0.0f;
  int argmax = INT_MAX;
#pragma unroll 4
  for (int split = 0; split < p.plan.num_splits; ++split) {
    const float4 r = __ldcg(records + split);
    if (!(r.x > -INFINITY)) continue;
    const int am = __float_as_int(r.z);
    if (r.x > m) {
      s = (m > -INFINITY ? s * exp2f((m - r.x) * k) : 0.0f) + r.y;
      m = r.x;
      argmax = am >= 0 ? am : INT_MAX;
    } else {
      s += r.y * exp2f((r.x - m) * k);
      if (r.x == m && am >= 0) argmax = min(argmax, am);
    }
  }
  return RtNodeStats{m, s, (m > -INFINITY && argmax != INT_MAX) ? argmax : -1};
}

// Everything the walk of one request reads: the node cache for nodes < kRtCachedNodes, the
// records in global memory (L2) beyond. Every thread runs the walk on the same data, so every
// branch below is uniform over the CTA.
struct Walk {
  const TreeRejectionSampleParams& p;
  RtRequest rq;

  __device__ __forceinline__ int parent(int j) const {
    if (j < kRtCachedNodes) return NodeCache::i32(NodeCache::kParent, j);
    return __ldcg(reinterpret_cast<const int*>(p.node_records + rq.cu_lo + j));
  }

  __device__ __forceinline__ int token(int j) const {
    if (j < kRtCachedNodes) return NodeCache::i32(NodeCache::kToken, j);
    return __ldcg(reinterpret_cast<const int*>(p.node_records + rq.cu_lo + j) + 1);
  }

  __device__ __forceinline__ RtNodeRecord node(int j) const {
    if (j < kRtCachedNodes) {
      return RtNodeRecord{NodeCache::i32(NodeCache::kParent, j), NodeCache::i32(NodeCache::kToken, j),
                          NodeCache::f32(NodeCache::kEdgeLogit, j), NodeCache::f32(NodeCache::kEdgeProb, j)};
    }
    const float4 r = __ldcg(reinterpret_cast<const float4*>(p.node_records + rq.cu_lo + j));
    return RtNodeRecord{__float_as_int(r.x), __float_as_int(r.y), r.z, r.w};
  }

  // Node j's filter threshold (-inf: unfiltered).
  __device__ __forceinline__ float threshold(int j) const {
    return p.row_thresholds != nullptr ? p.row_thresholds[rq.cu_lo + j] : -INFINITY;
  }

  __device__ __forceinline__ float accept_uniform(int j) const {
    if (j < kRtCachedNodes) return NodeCache::f32(NodeCache::kAcceptU, j);
    return uniform_from_word(philox_words(rq.seed, rq.offset, kStreamAccept, static_cast<uint32_t>(j), 0u).x);
  }

  __device__ __forceinline__ RtNodeStats stats(int j) const {
    if (j < kRtCachedNodes) {
      return RtNodeStats{NodeCache::f32(NodeCache::kRowMax, j), NodeCache::f32(NodeCache::kRowSum, j),
                         NodeCache::i32(NodeCache::kArgmax, j)};
    }
    return combine_splits(p, rq.cu_lo + j, rq.k);
  }

  // The first child of v with local index > after, -1 if none (warp ballots, in index order).
  __device__ __forceinline__ int next_child(int v, int after) const {
    const int lane = threadIdx.x & 31;
    for (int base = after + 1; base < rq.n; base += 32) {
      const int j = base + lane;
      const unsigned hits = __ballot_sync(kFullMask, j < rq.n && parent(j) == v);
      if (hits != 0u) return base + __ffs(static_cast<int>(hits)) - 1;
    }
    return -1;
  }

  // Whether a child of v before `before` has token x (deterministic drafts: that sibling was
  // rejected, so x has no residual mass left).
  __device__ __forceinline__ bool earlier_sibling_has(int v, int before, int x) const {
    const int lane = threadIdx.x & 31;
    for (int base = v + 1; base < before; base += 32) {
      const int j = base + lane;
      const bool hit = j < before && parent(j) == v && token(j) == x;
      if (__any_sync(kFullMask, hit)) return true;
    }
    return false;
  }
};

// Stages the walk data of the request's first kRtCachedNodes nodes (block-wide).
__device__ inline void fill_node_cache(const TreeRejectionSampleParams& p, const RtRequest& rq) {
  const int cached = rq.n < kRtCachedNodes ? rq.n : kRtCachedNodes;
  for (int j = threadIdx.x; j < cached; j += kRtThreads) {
    const float4 r = __ldcg(reinterpret_cast<const float4*>(p.node_records + rq.cu_lo + j));
    NodeCache::i32(NodeCache::kParent, j) = __float_as_int(r.x);
    NodeCache::i32(NodeCache::kToken, j) = __float_as_int(r.y);
    NodeCache::f32(NodeCache::kEdgeLogit, j) = r.z;
    NodeCache::f32(NodeCache::kEdgeProb, j) = r.w;
    NodeCache::f32(NodeCache::kAcceptU, j) =
        uniform_from_word(philox_words(rq.seed, rq.offset, kStreamAccept, static_cast<uint32_t>(j), 0u).x);
    const RtNodeStats st = combine_splits(p, rq.cu_lo + j, rq.k);
    NodeCache::f32(NodeCache::kRowMax, j) = st.row_max;
    NodeCache::f32(NodeCache::kRowSum, j) = st.row_sum;
    NodeCache::i32(NodeCache::kArgmax, j) = st.argmax;
  }
  __syncthreads();
}

// -------------------------------------------------------------------- final token: tables

// E, the valid tokens of v's children (all rejected when the walk ends at v below
// max_depth): listed in shared memory, or, past kRtMaxExcluded of them, found by scanning the
// nodes. `active` false: the empty set.
struct ExcludedSet {
  const int* tokens;
  int count;
  int v;
  bool active;

  __device__ __forceinline__ bool contains(const Walk& walk, int x) const {
    if (!active) return false;
    if (count <= kRtMaxExcluded) {
      for (int i = 0; i < count; ++i) {
        if (tokens[i] == x) return true;
      }
      return false;
    }
    for (int j = v + 1; j < walk.rq.n; ++j) {
      if (walk.parent(j) == v && walk.token(j) == x) return true;
    }
    return false;
  }
};

// Weights exp2((l - m) k) of entries 256 c + 8 l .. + 7 of node v's row (lane l of a warp),
// relative to the chunk max m (returned), E left out: the weights of both the chunk rewrite
// and the inverse CDF, so they agree exactly.
template <typename T>
__device__ __forceinline__ float warp_chunk_weights(const Walk& walk, int v, int chunk, const ExcludedSet& excluded,
                                                    float (&w)[kRsLaneEntries]) {
  const TreeRejectionSampleParams& p = walk.p;
  const T* row = static_cast<const T*>(p.target_logits) + (walk.rq.cu_lo + v) * p.logits_row_stride;
  const int lane_base = chunk * kSampleChunk + (threadIdx.x & 31) * kRsLaneEntries;
  const Segment<T, kRsLaneEntries> seg =
      load_segment<T, kRsLaneEntries>(row, lane_base, p.vocab_size, p.logits_vectorized, ElemBits<T>::kNegInf);
  const float thr = walk.threshold(v);
  float lane_max = -INFINITY;
#pragma unroll
  for (int j = 0; j < kRsLaneEntries; ++j) {
    w[j] = sanitize_below(segment_value(seg, j), thr);
    lane_max = fmaxf(lane_max, w[j]);
  }
  const float m = warp_max(lane_max);
#pragma unroll
  for (int j = 0; j < kRsLaneEntries; ++j) {
    const bool out = w[j] == -INFINITY || excluded.contains(walk, lane_base + j);
    w[j] = out ? 0.0f : exp2f((w[j] - m) * walk.rq.k);
  }
  return m;
}

// Rewrites the table entries of node v's chunks that hold a token of E: their totals without
// E (excluded.active), or with every token again (the fallback to q). One warp per child of v;
// children sharing a chunk write the same value. Only this request's finalizer reads the table
// before the next call rewrites it.
template <typename T>
__device__ void rewrite_child_chunks(const Walk& walk, const ExcludedSet& excluded, int v) {
  const TreeRejectionSampleParams& p = walk.p;
  float2* table = p.chunk_tables + (walk.rq.cu_lo + v) * p.plan.num_chunks;
  for (int j = v + 1 + static_cast<int>(threadIdx.x >> 5); j < walk.rq.n; j += kRtWarps) {
    if (walk.parent(j) != v) continue;  // uniform over the warp
    const int x = walk.token(j);
    if (x < 0) continue;
    const int chunk = x / kSampleChunk;
    float w[kRsLaneEntries];
    const float m = warp_chunk_weights<T>(walk, v, chunk, excluded, w);
    float total = 0.0f;
#pragma unroll
    for (int e = 0; e < kRsLaneEntries; ++e) total += w[e];
    total = warp_sum(total);
    if ((threadIdx.x & 31) == 0) __stcg(table + chunk, make_float2(m, total));
  }
  __syncthreads();  // the CTA's own global writes are visible to it after the barrier
}

// The chunk race over node v's table (docs/ALGORITHM.md §3), then the inverse CDF in the
// winning chunk (E left out). -1 if no chunk has mass. Block-wide.
template <typename T>
__device__ int table_race(const Walk& walk, RtShared& sm, const ExcludedSet& excluded, int v, float row_max) {
  const TreeRejectionSampleParams& p = walk.p;
  const RtRequest& rq = walk.rq;
  const float2* table = p.chunk_tables + (rq.cu_lo + v) * p.plan.num_chunks;
  float best = -INFINITY;
  int best_chunk = INT_MAX;
  for (int c = threadIdx.x; c < p.plan.num_chunks; c += kRtThreads) {  // increasing: first wins ties
    const float2 e = __ldcg(table + c);
    if (e.y > 0.0f) {
      const PhiloxBlock w =
          philox_words(rq.seed, rq.offset, kStreamSample, static_cast<uint32_t>(v), static_cast<uint32_t>(c));
      const float score = (log2f(e.y) + (e.x - row_max) * rq.k) - log2f(-log2f(open_uniform_from_word(w.y)));
      if (score > best) {
        best = score;
        best_chunk = c;
      }
    }
  }
  const int chunk = block_race_winner(best, best_chunk, sm);
  if (threadIdx.x < 32) {
    int token = -1;
    if (chunk >= 0) {
      float w[kRsLaneEntries];
      warp_chunk_weights<T>(walk, v, chunk, excluded, w);
      const float u = uniform_from_word(
          philox_words(rq.seed, rq.offset, kStreamSample, static_cast<uint32_t>(v), static_cast<uint32_t>(chunk)).x);
      token = warp_inverse_cdf(w, u, chunk * kSampleChunk + (threadIdx.x & 31) * kRsLaneEntries);
    }
    if (threadIdx.x == 0) sm.token = token;
  }
  __syncthreads();
  const int token = sm.token;
  __syncthreads();
  return token;
}

// Deterministic drafts: q at node v without E (when `exclude`: every child of v was rejected),
// falling back to q itself if that has no mass, with the same noise.
template <typename T, typename P>
__device__ int sample_without_children(const Walk& walk, RtShared& sm, int v, float row_max, bool exclude) {
  ExcludedSet excluded{excluded_tokens<T, P>(), 0, v, false};
  if (exclude) {
    // E into shared memory (its order does not matter: membership only).
    if (threadIdx.x == 0) sm.num_excluded = 0;
    __syncthreads();
    for (int j = v + 1 + static_cast<int>(threadIdx.x); j < walk.rq.n; j += kRtThreads) {
      const int x = walk.parent(j) == v ? walk.token(j) : -1;
      if (x >= 0) {
        const int slot = atomicAdd(&sm.num_excluded, 1);
        if (slot < kRtMaxExcluded) excluded_tokens<T, P>()[slot] = x;
      }
    }
    __syncthreads();
    excluded.count = sm.num_excluded;
    excluded.active = excluded.count > 0;
  }
  if (!excluded.active) return table_race<T>(walk, sm, excluded, v, row_max);
  rewrite_child_chunks<T>(walk, excluded, v);
  int token = table_race<T>(walk, sm, excluded, v, row_max);
  if (token < 0) {
    excluded.active = false;
    rewrite_child_chunks<T>(walk, excluded, v);
    token = table_race<T>(walk, sm, excluded, v, row_max);
  }
  return token;
}

// ---------------------------------------------------------- final token: draft probabilities

// r = (q - a p)+ with q = exp2((l - row_max) k) / row_sum where q > 0, else 0; a NaN p gives 0
// (fmaxf drops the NaN), as the Triton kernel's where(r == r, r, 0).
__device__ __forceinline__ float scaled_residual_weight(float logit, float prob, float row_max, float k,
                                                        float inv_sum, float a, float thr) {
  const float q = exp2f((sanitize_below(logit, thr) - row_max) * k) * inv_sum;
  return q > 0.0f ? fmaxf(q - a * prob, 0.0f) : 0.0f;
}

struct ResidualResult {
  float mass;  // kRace = false: sum_x (q - a p)+
  int token;   // kRace = true: the sample, -1 if the residual has no mass
};

// One pass over node v's logits and draft rows (block-wide): the residual's mass
// sum_x (q - a p)+ (kRace = false), or its chunk race and the inverse CDF in the winning
// chunk (kRace = true).
template <typename T, typename P, bool kRace>
__device__ ResidualResult residual_pass(const Walk& walk, RtShared& sm, int v, const RtNodeStats& st, float a) {
  using Config = RtConfig<T, P>;
  constexpr int kStages = Config::kPassStages;
  constexpr int kE = kRsLaneEntries;
  using LogitStream = TileStream<T, kStages, Config::kNodeCacheBytes>;
  using ProbStream = TileStream<P, kStages, Config::kNodeCacheBytes + LogitStream::kBytes>;
  const TreeRejectionSampleParams& p = walk.p;
  const RtRequest& rq = walk.rq;
  const int64_t row = rq.cu_lo + v;
  const T* logits_row = static_cast<const T*>(p.target_logits) + row * p.logits_row_stride;
  const P* probs_row = static_cast<const P*>(p.draft_probs) + row * p.draft_probs_row_stride;
  const float thr = walk.threshold(v);
  const LogitStream logits{logits_row, p.vocab_size, p.logits_vectorized, ElemBits<T>::kNegInf};
  const ProbStream probs{probs_row, p.vocab_size, p.probs_vectorized, 0u};
  const auto issue = [&](int tile, int stage) {
    logits.issue(tile, stage);
    probs.issue(tile, stage);
  };
  const float inv_sum = __frcp_rn(st.row_sum);
  const float k = rq.k;
  const float row_max = st.row_max;
  const int group = threadIdx.x / kRsChunkLanes;
  __syncthreads();  // the staging slots are free (an earlier pass may have just read them)
  issue_first_tiles<kStages>(0, p.plan.num_tiles, issue);
  float total = 0.0f, race = -INFINITY;
  int race_chunk = INT_MAX;
  pipeline_tiles<kStages>(0, p.plan.num_tiles, issue, [&](int tile, int stage) {
    float mass = 0.0f;
#pragma unroll 1
    for (int h = 0; h < kRsLaneSegments; ++h) {
      const auto lseg = logits.segment(stage, h);
      const auto pseg = probs.segment(stage, h);
#pragma unroll
      for (int j = 0; j < kE; ++j) {
        mass += scaled_residual_weight(segment_value(lseg, j), segment_value(pseg, j), row_max, k, inv_sum, a, thr);
      }
    }
    if constexpr (kRace) {
      const int chunk = tile * kRsTileChunks + group;
      mass = group_sum(mass);
      if (mass > 0.0f) {  // chunks increase: the first wins ties
        const PhiloxBlock w = philox_words(rq.seed, rq.offset, kStreamSample, static_cast<uint32_t>(v),
                                           static_cast<uint32_t>(chunk));
        const float score = log2f(mass) - log2f(-log2f(open_uniform_from_word(w.y)));
        if (score > race) {
          race = score;
          race_chunk = chunk;
        }
      }
    } else {
      total += mass;
    }
  });
  if constexpr (!kRace) {
    return ResidualResult{block_sum_f32(total, sm), -1};
  } else {
    const int chunk = block_race_winner(race, race_chunk, sm);
    if (threadIdx.x < 32) {
      int token = -1;
      if (chunk >= 0) {
        const int lane_base = chunk * kSampleChunk + (threadIdx.x & 31) * kE;
        const Segment<T, kE> lseg =
            load_segment<T, kE>(logits_row, lane_base, p.vocab_size, p.logits_vectorized, ElemBits<T>::kNegInf);
        const Segment<P, kE> pseg = load_segment<P, kE>(probs_row, lane_base, p.vocab_size, p.probs_vectorized, 0u);
        float w[kE];
#pragma unroll
        for (int j = 0; j < kE; ++j) {
          w[j] = scaled_residual_weight(segment_value(lseg, j), segment_value(pseg, j), row_max, k, inv_sum, a, thr);
        }
        const float u = uniform_from_word(
            philox_words(rq.seed, rq.offset, kStreamSample, static_cast<uint32_t>(v), static_cast<uint32_t>(chunk)).x);
        token = warp_inverse_cdf(w, u, lane_base);
      }
      if (threadIdx.x == 0) sm.token = token;
    }
    __syncthreads();
    const int token = sm.token;
    __syncthreads();
    return ResidualResult{0.0f, token};
  }
}

// ---------------------------------------------------------------------------- finalizer

template <typename T, typename P>
__device__ void finalize_request(const TreeRejectionSampleParams& p, RtShared& sm, const RtRequest rq) {
  constexpr bool kHasDraftProbs = !std::is_same<P, NoDraftProbs>::value;
  fill_node_cache(p, rq);
  const Walk walk{p, rq};
  const int width = p.max_depth + 1;
  int32_t* out = p.output_token_ids + static_cast<int64_t>(rq.b) * width;
  int32_t* out_nodes = p.accepted_nodes + static_cast<int64_t>(rq.b) * width;

  // The walk (docs/ALGORITHM.md §5), every thread in lockstep; thread 0 writes the path.
  int v = 0, depth = 0;
  RtNodeStats st = walk.stats(0);
  float a = 0.0f;        // draft probabilities: the residual is (q - a p)+ / mass
  float mass = 1.0f;     // its total (exactly 1 while a = 0); recomputed lazily after a rejection
  bool mass_stale = false;
  float q_rejected = 0.0f;  // deterministic drafts: q of the rejected children's (distinct) tokens
  // Lenience (docs/ALGORITHM.md §8): u l p(c) mass < (q - a p)+(c) with a += l mass per
  // rejection, u l (1 - q(E)) < q(c), and greedy children within ln(l) of the row max.
  const bool lenient = p.lenience != nullptr;
  float lam = 1.0f, ln_lam = INFINITY;
  if (lenient) {
    lam = __ldg(p.lenience + rq.b);
    ln_lam = lam < 1.0f ? logf(lam) : INFINITY;
  }
  int cand = p.max_depth > 0 ? walk.next_child(0, 0) : -1;
  while (cand >= 0) {
    const RtNodeRecord c = walk.node(cand);
    const bool x_ok = c.token >= 0;
    const float q_x = (x_ok && c.edge_logit > -INFINITY && st.row_max > -INFINITY)
                          ? __fdiv_rn(exp2f((c.edge_logit - st.row_max) * rq.k), st.row_sum)
                          : 0.0f;
    bool accept, duplicate = false;
    if (rq.greedy) {
      accept = x_ok && c.token == st.argmax;
      if (lenient) accept = accept || (x_ok && c.edge_logit - st.row_max >= ln_lam);
    } else if constexpr (kHasDraftProbs) {
      if (x_ok && mass_stale) {
        mass = residual_pass<T, P, false>(walk, sm, v, st, a).mass;
        mass_stale = false;
      }
      const float u = walk.accept_uniform(cand);
      const float lp = lenient ? lam * c.edge_prob : c.edge_prob;
      accept = x_ok && u * lp * mass < fmaxf(q_x - a * c.edge_prob, 0.0f);
    } else {
      duplicate = x_ok && walk.earlier_sibling_has(v, cand, c.token);
      const float u = walk.accept_uniform(cand);
      const float ul = lenient ? u * lam : u;
      accept = x_ok && !duplicate && ul * (1.0f - q_rejected) < q_x;
    }
    if (accept) {
      if (threadIdx.x == 0) {
        out[depth] = c.token;
        out_nodes[depth + 1] = cand;
      }
      ++depth;
      v = cand;
      st = walk.stats(v);
      a = 0.0f;
      mass = 1.0f;
      mass_stale = false;
      q_rejected = 0.0f;
      cand = depth < p.max_depth ? walk.next_child(v, v) : -1;
    } else {
      if (x_ok && !rq.greedy) {
        if constexpr (kHasDraftProbs) {
          a += lenient ? lam * mass : mass;  // the residual loses l p per rejection
          mass_stale = true;
        } else {
          q_rejected += duplicate ? 0.0f : q_x;
        }
      }
      cand = walk.next_child(v, cand);
    }
  }

  // The final token at v: greedy argmax, or a sample of the residual (q itself when it has
  // no mass), with node v's sampling noise.
  int token;
  if (rq.greedy) {
    token = st.argmax;
  } else if constexpr (kHasDraftProbs) {
    token = -1;
    if (a > 0.0f) token = residual_pass<T, P, true>(walk, sm, v, st, a).token;
    if (token < 0) token = table_race<T>(walk, sm, ExcludedSet{nullptr, 0, v, false}, v, st.row_max);
  } else {
    // Below max_depth the walk ends at v only when every child of v was rejected.
    token = sample_without_children<T, P>(walk, sm, v, st.row_max, depth < p.max_depth);
  }

  for (int pos = threadIdx.x; pos < width; pos += kRtThreads) {
    if (pos >= depth) out[pos] = pos == depth ? token : -1;
    if (pos == 0) {
      out_nodes[0] = 0;
    } else if (pos > depth) {
      out_nodes[pos] = -1;
    }
  }
  if (threadIdx.x == 0) {
    p.num_accepted[rq.b] = depth;
    p.counters[rq.b] = 0;  // every unit of the request has counted: clean for the next call
  }
}

}  // namespace rt_detail

// ---------------------------------------------------------------------------------- kernel

template <typename T, typename P>
constexpr int tree_rejection_sample_smem_bytes() {
  return rt_detail::RtConfig<T, P>::kSmemBytes;
}

template <typename T, typename P>
__global__ void __launch_bounds__(kRtThreads, rt_detail::RtConfig<T, P>::kMinBlocksPerSM)
    tree_rejection_sample_kernel(const TreeRejectionSampleParams p) {
  __shared__ rt_detail::RtShared sm;
  wait_for_prior_kernels();
  allow_next_kernel_launch();
  const int64_t unit = blockIdx.x;
  if (unit < p.plan.units_phase1) {
    rt_detail::phase1_unit<T, P>(p, sm, unit);
  } else {
    rt_detail::empty_request_unit(p, sm, static_cast<int>(unit - p.plan.units_phase1));
  }
}

// Prepares an instance for launches on the current device (its shared-memory limit) and
// returns how many of its CTAs an SM runs at once, for the plan's target grid size.
template <typename T, typename P>
cudaError_t tree_rejection_sample_prepare(int* blocks_per_sm) {
  constexpr int kSmem = tree_rejection_sample_smem_bytes<T, P>();
  cudaError_t err = cudaFuncSetAttribute(tree_rejection_sample_kernel<T, P>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (err != cudaSuccess) return err;
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks_per_sm, tree_rejection_sample_kernel<T, P>,
                                                       kRtThreads, kSmem);
}

// pdl: programmatic dependent launch (sm_90+ only; rejection_sample.cuh).
template <typename T, typename P>
cudaError_t launch_tree_rejection_sample(const TreeRejectionSampleParams& params, cudaStream_t stream,
                                         bool pdl = false) {
  return launch_with_pdl(tree_rejection_sample_kernel<T, P>, static_cast<unsigned int>(params.plan.units_total),
                         kRtThreads, tree_rejection_sample_smem_bytes<T, P>(), stream, pdl, params);
}

}  // namespace specdec
