// The sampling filters' threshold pass on CUDA (docs/ALGORITHM.md §7): per target row of a
// filtered request, the threshold logit t such that the row keeps exactly the logits >= t
// (top-k, then top-p on what top-k kept, then min-p; t = max of the three). One cluster of
// kThrCluster CTAs per row (kThrSmallCluster in big batches); the row is read from global memory
// once, into the CTAs' shared memory, and every later pass runs there. No sort:
//
// - the row max M: each CTA's max, combined through distributed shared memory;
// - top-k / top-p: a radix select of the k-th largest value (by count) and of the largest value v
//   with mass(l >= v) >= p * Z_k (by mass). Level 0 bins the row by log-probability
//   (kThrLogBins bins per halving of the probability below M, the last bin catching everything
//   further down), so that the bins split where the mass is; each later level splits the chosen
//   bin's key range into kThrBins digits, until the range is one float: at most 2 + 4 levels per
//   selection, whatever the row. Level 0 first sweeps the slice without histogram atomics: it
//   lists the entries within 2^-16 of the max and sums the count and mass of the rest -- most of a
//   row -- in registers; then it bins the list, and only an answer in that rest takes a second
//   level-0 pass, which bins it (top-p with p >= kThrOnePassTopP bins the row in one pass). From a
//   list that holds the chosen bin (level 0's, or the one level 1 fills), later levels and the
//   finish read a handful of entries, not the slice.
// - the finish: once the chosen bin holds at most kThrFinishCap members in the whole cluster (on
//   most rows right after level 0), every CTA gathers them -- or every member at or above the bin,
//   when those fit -- and ranks them itself: one pass and one cluster barrier instead of the
//   remaining levels. When top-k finished on every member at or above its bin, top-p on what it
//   kept is read off the same ranked candidates, without a pass of its own.
// - min-p: closed form, a bisection on the float bits (no memory traffic). Min-p alone (no top_k /
//   top_p tensors) runs row_min_p_threshold_kernel instead, which only reads the row max.
//
// Counts and masses are integers (mass: exp2((l - M) k) in fixed point, 2^-40 units), summed
// with integer atomics: the same thresholds on every run, whatever the atomics' order.
//
// Thread-block clusters need sm_90; the binding (bindings/filters_cuda.cu) refuses older GPUs.
#pragma once

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>
#include <cstdlib>

#include "kernels/common.cuh"
#include "kernels/elements.cuh"

namespace specdec {

constexpr int kThrThreads = 512;  // one bin per thread in the scans
constexpr int kThrWarps = kThrThreads / 32;
// CTAs per row: the portable cluster size, or half of it for big batches of 2-byte logits
// (launch_row_thresholds; docs/DECISIONS.md#cuda-threshold-cluster-size).
constexpr int kThrCluster = 8;
constexpr int kThrSmallCluster = 4;
constexpr int kThrBins = kThrThreads;
constexpr int kThrDigitBits = 9;  // log2(kThrBins): a sub-level's digit
constexpr int kThrMaxBinsPerRank = kThrBins / kThrSmallCluster;
constexpr float kThrLogBins = 16.0f;  // level-0 bins per halving of the probability
constexpr float kThrMassUnit = 1099511627776.0f;  // 2^40: fixed-point scale of a token's mass (<= 1)
constexpr int kThrListCap = 4096;  // entries of a CTA's short list
// Level 0 lists the entries of its first kThrListBins bins (probabilities within 2^-16 of the
// max), so that a pick among them needs no pass over the slice afterwards. Its first pass bins
// only those (from the list) and sums the rest, most of a row, as one bin in registers; only when
// the answer lies in that rest does a second level-0 pass bin it.
constexpr int kThrListBins = 256;
// Top-p from this p on bins level 0 in one pass (its answer is usually below the listed bins).
constexpr double kThrOnePassTopP = 0.99;
constexpr int kThrSliceAlign = 8;  // slice lengths are multiples of 8 entries (16-byte loads)
constexpr int kThrLoadUnroll = 4;  // 16-byte loads in flight per thread while a slice loads
// A selection finishes on its candidates (the chosen bin's members, or every member at or above
// it) once the cluster holds at most this many: every CTA gathers them all and ranks them itself.
constexpr int kThrFinishCap = 128;
constexpr int kThrFinishParts = kThrThreads / kThrFinishCap;  // threads per candidate when ranking

struct RowThresholdParams {
  const void* logits;   // [num_rows, vocab] of T, unit inner stride
  int64_t row_stride;   // in elements
  const void* cu;       // chain: cu_num_draft_tokens; tree: cu_num_nodes
  bool cu_int64;
  const float* temperature;  // [num_requests] or nullptr (= 1)
  const void* top_k;         // [num_requests] int32 / int64, or nullptr
  bool top_k_int64;
  const float* top_p;  // [num_requests] or nullptr
  const float* min_p;  // [num_requests] or nullptr
  int64_t num_requests;
  int64_t num_rows;
  int64_t vocab;
  int64_t max_rows;  // chain: max_spec_len + 1 rows per request (slot = b * max_rows + t)
  bool tree;         // tree: slot = node row
  bool vectorized;   // rows 16-byte aligned: slices load as 16-byte vectors
  int64_t slice;     // entries per CTA: ceil(vocab / CTAs per row) rounded up to kThrSliceAlign
  float* thresholds;  // [slots]: the threshold logit, -inf for rows that are not filtered
};

namespace thr_detail {

// Order-preserving key of a float without NaN: x < y <=> key(x) < key(y); -0.0 and +0.0 share
// key 0x80000000 (key equality is float equality).
__device__ __forceinline__ uint32_t key_of(float x) {
  uint32_t b = __float_as_uint(x);
  if ((b & 0x7FFFFFFFu) == 0) b = 0;
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float value_of(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7FFFFFFFu) : ~key);
}

constexpr uint32_t kKeyNegInf = 0x007FFFFFu;  // key_of(-inf)

template <typename T>
__device__ __forceinline__ float to_float(T x) {
  if constexpr (std::is_same<T, float>::value) {
    return x;
  } else if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    return __bfloat162float(x);
  } else {
    return __half2float(x);
  }
}

// Level-0 bin of a logit: how many 1/kThrLogBins-halvings its probability lies below the max,
// the last bin catching the rest (and -inf). Non-increasing in x: the bins are key ranges.
__device__ __forceinline__ int log_bin(float x, float row_max, float k_bins) {
  const float y = (row_max - x) * k_bins;
  return y < static_cast<float>(kThrBins - 1) ? static_cast<int>(y) : kThrBins - 1;
}

// A token's mass exp2((x - M) k) in 2^-40 units.
__device__ __forceinline__ unsigned long long mass_of(float x, float row_max, float k) {
  return __float2ull_rn(exp2f((x - row_max) * k) * kThrMassUnit);
}

struct Shared {
  unsigned int cnt[kThrBins];  // this CTA's histogram of the level
  // Its masses, as two 32-bit halves: sm_90's 64-bit shared atomic add is a compare-and-swap
  // loop that the level's contention retries (docs/DECISIONS.md#cuda-threshold-finish), a 32-bit
  // one is one instruction. mass = mass_hi * 2^32 + mass_lo, the low half's wraps carried up.
  unsigned int mass_lo[kThrBins], mass_hi[kThrBins];
  // The cluster's histogram, bins [rank * bins_per_rank, ...) on CTA `rank`: the CTAs add theirs
  // into it with distributed-shared-memory atomics. Three buffers, level L using L % 3: one
  // cluster barrier per level suffices (a buffer is zeroed by its owner one level before its use,
  // after everyone has read it two levels before).
  unsigned int red_cnt[3][kThrMaxBinsPerRank];
  unsigned long long red_mass[3][kThrMaxBinsPerRank];
  uint32_t list[kThrListCap];
  int list_n;
  // The finish: this CTA's gathered candidates (read by the whole cluster), then all of them.
  uint32_t fin_key[kThrFinishCap];
  int fin_n;
  int fin_rank_n[kThrCluster];
  uint32_t cand_key[kThrFinishCap];
  unsigned long long cand_mass[kThrFinishCap];
  unsigned long long rank_mass[kThrThreads];  // the ranks' masses (their counts: cnt)
  float cta_max;
  float warp_f[kThrWarps];
  unsigned long long warp_u64[kThrWarps];
  unsigned int warp_u32[kThrWarps];
  int warp_i[kThrWarps];
  int64_t owner;
  // The level's decision, written by the picking thread.
  int pick;
  unsigned int pick_cnt, pick_cnt_incl;
  unsigned long long pick_mass, pick_mass_incl;
};

__device__ __forceinline__ float block_max(float v, Shared& sm) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  if ((threadIdx.x & 31) == 0) sm.warp_f[threadIdx.x >> 5] = v;
  __syncthreads();
  float r = sm.warp_f[0];
  for (int w = 1; w < kThrWarps; ++w) r = fmaxf(r, sm.warp_f[w]);
  __syncthreads();
  return r;
}

__device__ __forceinline__ int block_min(int v, Shared& sm) {
  for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(kFullMask, v, o));
  if ((threadIdx.x & 31) == 0) sm.warp_i[threadIdx.x >> 5] = v;
  __syncthreads();
  int r = sm.warp_i[0];
  for (int w = 1; w < kThrWarps; ++w) r = min(r, sm.warp_i[w]);
  __syncthreads();
  return r;
}

// Inclusive scans over the block's threads in thread order (integers: exact, order-free).
__device__ __forceinline__ void block_scan(unsigned int& c, unsigned long long& m, Shared& sm) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned int c_up = __shfl_up_sync(kFullMask, c, o);
    const unsigned long long m_up = __shfl_up_sync(kFullMask, m, o);
    if (lane >= o) {
      c += c_up;
      m += m_up;
    }
  }
  if (lane == 31) {
    sm.warp_u32[warp] = c;
    sm.warp_u64[warp] = m;
  }
  __syncthreads();
  for (int w = 0; w < warp; ++w) {
    c += sm.warp_u32[w];
    m += sm.warp_u64[w];
  }
  __syncthreads();
}

__device__ __forceinline__ uint32_t block_max_u32(uint32_t v, Shared& sm) {
  v = __reduce_max_sync(kFullMask, v);
  if ((threadIdx.x & 31) == 0) sm.warp_u32[threadIdx.x >> 5] = v;
  __syncthreads();
  uint32_t r = sm.warp_u32[0];
  for (int w = 1; w < kThrWarps; ++w) r = max(r, sm.warp_u32[w]);
  __syncthreads();
  return r;
}

// A mass into bin `bin` of this CTA's histogram (Shared::mass_lo / mass_hi): the low half's
// atomic returns the old sum, so the one add that wraps it around knows to carry.
__device__ __forceinline__ void add_mass(Shared& sm, int bin, unsigned long long m) {
  const unsigned int lo = static_cast<unsigned int>(m);
  const unsigned int old = atomicAdd(&sm.mass_lo[bin], lo);
  const unsigned int hi = static_cast<unsigned int>(m >> 32) + (old + lo < old ? 1u : 0u);
  if (hi != 0) atomicAdd(&sm.mass_hi[bin], hi);
}

__device__ __forceinline__ unsigned long long bin_mass(const Shared& sm, int bin) {
  return (static_cast<unsigned long long>(sm.mass_hi[bin]) << 32) | sm.mass_lo[bin];
}

// Sums of a per-thread count and mass over the warp, added by lane 0 to bin `bin`.
__device__ __forceinline__ void warp_add_to_bin(unsigned int c, unsigned long long m, Shared& sm, int bin) {
  for (int o = 16; o > 0; o >>= 1) {
    c += __shfl_xor_sync(kFullMask, c, o);
    m += __shfl_xor_sync(kFullMask, m, o);
  }
  if ((threadIdx.x & 31) == 0 && c > 0) {
    atomicAdd(&sm.cnt[bin], c);
    add_mass(sm, bin, m);
  }
}

// The state of one selection: the answer's key lies in [lo, hi]; cnt_above / mass_above count
// the keys above hi (and >= the floor); goal_mass is top-p's goal once level 0 knows the total.
// A selection that finished on every member at or above its last bin (all_above) leaves them
// ranked in shared memory (gather_candidates): top-p after top-k reads them there.
struct Selection {
  uint32_t lo, hi;
  unsigned long long mass_above;
  unsigned int cnt_above;
  bool level0;
  double goal_mass;
  bool all_above;
  int candidates;
  // This CTA's list holds every member of the range (use_list), and also every member above it
  // (list_all_above: level 0's list of its first bins).
  bool use_list, list_all_above;
  // Level 0's first pass bins [0, kThrListBins) (bin_from = 0); its second [kThrListBins, ...).
  int bin_from;
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900

// The least key in [kKeyNegInf, top] whose value satisfies `pred` (pred is monotone: false below
// some key, true from it on); top when none below does. A bisection on the float bits.
template <typename Pred>
__device__ __forceinline__ uint32_t least_key(uint32_t top, Pred pred) {
  uint32_t a = kKeyNegInf, z = top;
  while (a < z) {
    const uint32_t mid = a + ((z - a) >> 1);
    if (pred(value_of(mid))) {
      z = mid;
    } else {
      a = mid + 1;
    }
  }
  return a;
}

// Appends `key` where `take` to a shared-memory list (count: its length, counting past `cap`;
// entries past cap are dropped), in lane order; called by whole warps: one shared atomic per warp.
__device__ __forceinline__ void warp_append(bool take, uint32_t key, int& count, uint32_t* list, int cap, int lane) {
  const unsigned ballot = __ballot_sync(kFullMask, take);
  int base = 0;
  if (lane == 0 && ballot != 0) base = atomicAdd(&count, __popc(ballot));
  base = __shfl_sync(kFullMask, base, 0);
  const int at = base + __popc(ballot & ((1u << lane) - 1u));
  if (take && at < cap) list[at] = key;
}

// Calls visit(valid, x) for the entries [0, n) of a shared-memory slice (x sanitized), in whole
// warps: every lane of a warp makes the same number of calls (valid = false past the end), so that
// `visit` may use warp votes. 16-byte loads (the slices start 16-byte aligned), then the ragged end.
template <typename T, typename Visit>
__device__ __forceinline__ void for_each_entry(const T* slice, int n, Visit&& visit) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  const int n_vec = n / kVec;
  const int rounded_vec = (n_vec + 31) & ~31;
  for (int i = threadIdx.x; i < rounded_vec; i += kThrThreads) {
    const bool ok = i < n_vec;
    const uint4 v = ok ? reinterpret_cast<const uint4*>(slice)[i] : make_uint4(0u, 0u, 0u, 0u);
    const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
    for (int q = 0; q < kVec; ++q) visit(ok, rs_detail::sanitize(to_float(e[q])));
  }
  const int done = n_vec * kVec, rest = n - done;
  const int rounded = (rest + 31) & ~31;
  for (int i = threadIdx.x; i < rounded; i += kThrThreads) {
    const bool ok = i < rest;
    visit(ok, ok ? rs_detail::sanitize(to_float(slice[done + i])) : -INFINITY);
  }
}

// Level 0's first pass when it runs in two (Selection::bin_from == 0): lists this CTA's members
// (keys >= floor) of the bins below kThrListBins -- within 2^-16 of the max -- in sm.list, and
// sums the count and (need_mass) the mass of the other members in registers. No histogram atomic
// and no vote per entry: one warp scan and one shared atomic per vector step for the appends.
// The listed entries are binned afterwards from the list (select_level).
template <bool kNeedMass, typename T>
__device__ __forceinline__ void sweep_head(const T* slice, int n, float floor_value, float row_max, float k_bins,
                                           float k, Shared& sm, unsigned int& tail_c, unsigned long long& tail_m) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  const int lane = threadIdx.x & 31;
  const int n_vec = n / kVec;
  const int rounded_vec = (n_vec + 31) & ~31;
  // One step: kVec entries of this thread (q < valid), appended warp-wide in lane order.
  auto step = [&](const float (&x)[kVec], int valid) {
    unsigned int head = 0;
#pragma unroll
    for (int q = 0; q < kVec; ++q) {
      // y < kThrListBins <=> log_bin(x) < kThrListBins (the same float arithmetic; y >= 0)
      const float y = (row_max - x[q]) * k_bins;
      const bool member = q < valid && x[q] >= floor_value;
      const bool listed = member && y < static_cast<float>(kThrListBins);
      const bool tail = member && !listed;
      head |= static_cast<unsigned int>(listed) << q;
      tail_c += static_cast<unsigned int>(tail);
      if constexpr (kNeedMass) {  // (branch-free: a select, not a divergent branch per entry)
        const unsigned long long m = mass_of(x[q], row_max, k);
        tail_m += tail ? m : 0ull;
      }
    }
    const int c = __popc(head);
    int incl = c;
    for (int o = 1; o < 32; o <<= 1) {
      const int up = __shfl_up_sync(kFullMask, incl, o);
      if (lane >= o) incl += up;
    }
    int base = 0;
    if (lane == 31 && incl != 0) base = atomicAdd(&sm.list_n, incl);
    base = __shfl_sync(kFullMask, base, 31);
    int at = base + incl - c;
#pragma unroll
    for (int q = 0; q < kVec; ++q) {
      if ((head >> q) & 1u) {
        if (at < kThrListCap) sm.list[at] = key_of(x[q]);
        ++at;
      }
    }
  };
  for (int i = threadIdx.x; i < rounded_vec; i += kThrThreads) {
    const bool ok = i < n_vec;
    const uint4 v = ok ? reinterpret_cast<const uint4*>(slice)[i] : make_uint4(0u, 0u, 0u, 0u);
    const T* e = reinterpret_cast<const T*>(&v);
    float x[kVec];
#pragma unroll
    for (int q = 0; q < kVec; ++q) x[q] = rs_detail::sanitize(to_float(e[q]));
    step(x, ok ? kVec : 0);
  }
  const int done = n_vec * kVec, rest = n - done;
  const int rounded = (rest + 31) & ~31;
  for (int i = threadIdx.x; i < rounded; i += kThrThreads) {
    float x[kVec];
#pragma unroll
    for (int q = 0; q < kVec; ++q) x[q] = -INFINITY;
    const bool ok = i < rest;
    if (ok) x[0] = rs_detail::sanitize(to_float(slice[done + i]));
    step(x, ok ? 1 : 0);
  }
}

// Which entries a finish gathers: keys >= floor and, by_bin, level-0 bins in [bin_lo, bin_hi],
// else keys in [lo, hi].
struct CandidateRange {
  bool by_bin;
  int bin_lo, bin_hi;
  uint32_t lo, hi, floor;
  float row_max, k_bins;
  __device__ __forceinline__ bool holds(uint32_t key, float x) const {
    if (key < floor) return false;
    if (by_bin) {
      const int b = log_bin(x, row_max, k_bins);
      return b >= bin_lo && b <= bin_hi;
    }
    return key >= lo && key <= hi;
  }
};

// The end of a selection, once the cluster's candidates are few (<= kThrFinishCap, which the
// level's counts guarantee): each CTA appends its candidates (in `range`, from its slice or its
// list) to fin_key; after a cluster barrier every CTA copies all of them, with their
// masses, into cand_key / cand_mass and ranks each against all (kThrFinishParts threads per
// candidate): cnt[t] / rank_mass[t] become the count / mass of the candidates with key >=
// cand_key[t] (the level's count array is free once it was combined). Returns the number of candidates.
// The next writer of fin_key runs after the next level's cluster barrier, so after every reader.
template <typename T>
__device__ int gather_candidates(cooperative_groups::cluster_group& cluster, Shared& sm, const T* slice, int n,
                                 bool from_list, const CandidateRange range, float row_max, float k) {
  if (threadIdx.x == 0) sm.fin_n = 0;
  __syncthreads();
  const int lane = threadIdx.x & 31;
  // Called by whole warps: one shared atomic per warp for the appends.
  auto append = [&](bool valid, float x) {
    const uint32_t key = key_of(x);
    const bool take = valid && range.holds(key, x);
    warp_append(take, key, sm.fin_n, sm.fin_key, kThrFinishCap, lane);
  };
  if (from_list) {
    const int count = sm.list_n;
    const int rounded = (count + 31) & ~31;
    for (int i = threadIdx.x; i < rounded; i += kThrThreads) {
      const bool ok = i < count;
      append(ok, ok ? value_of(sm.list[i]) : -INFINITY);
    }
  } else {
    for_each_entry(slice, n, append);
  }
  cluster.sync();
  const int ranks = static_cast<int>(cluster.num_blocks());
  if (threadIdx.x < ranks) {
    sm.fin_rank_n[threadIdx.x] = min(cluster.map_shared_rank(&sm.fin_n, static_cast<int>(threadIdx.x))[0],
                                     kThrFinishCap);
  }
  __syncthreads();
  int total = 0;
  for (int q = 0; q < ranks; ++q) {
    const int t = static_cast<int>(threadIdx.x) - total;
    if (t >= 0 && t < sm.fin_rank_n[q] && threadIdx.x < kThrFinishCap) {
      const uint32_t key = cluster.map_shared_rank(&sm.fin_key[0], q)[t];
      sm.cand_key[threadIdx.x] = key;
      sm.cand_mass[threadIdx.x] = mass_of(value_of(key), row_max, k);
    }
    total += sm.fin_rank_n[q];
  }
  total = min(total, kThrFinishCap);
  __syncthreads();
  // Partial ranks: candidate i against the part-th share of the candidates.
  const int i = threadIdx.x % kThrFinishCap, part = threadIdx.x / kThrFinishCap;
  const int share = (total + kThrFinishParts - 1) / kThrFinishParts;
  unsigned int c = 0;
  unsigned long long m = 0;
  if (i < total) {
    const uint32_t key = sm.cand_key[i];
    const int end = min(total, (part + 1) * share);
    for (int j = part * share; j < end; ++j) {
      if (sm.cand_key[j] >= key) {
        c += 1;
        m += sm.cand_mass[j];
      }
    }
  }
  sm.cnt[threadIdx.x] = c;
  sm.rank_mass[threadIdx.x] = m;
  __syncthreads();
  if (threadIdx.x < total) {
    for (int q = 1; q < kThrFinishParts; ++q) {
      c += sm.cnt[q * kThrFinishCap + threadIdx.x];
      m += sm.rank_mass[q * kThrFinishCap + threadIdx.x];
    }
    sm.cnt[threadIdx.x] = c;
    sm.rank_mass[threadIdx.x] = m;
  }
  __syncthreads();
  return total;
}

// The largest ranked candidate key whose count (by_mass: mass) at or above it, plus the base,
// reaches the goal (the same comparisons as the levels'); 0 (below every key) when none does.
__device__ inline uint32_t largest_reaching(Shared& sm, int total, bool by_mass, unsigned int base_cnt,
                                            unsigned int goal_cnt, unsigned long long base_mass, double goal_mass) {
  uint32_t best = 0;
  for (int t = threadIdx.x; t < total; t += kThrThreads) {
    const bool reached = by_mass ? static_cast<double>(base_mass + sm.rank_mass[t]) >= goal_mass
                                 : base_cnt + sm.cnt[t] >= goal_cnt;
    if (reached) best = max(best, sm.cand_key[t]);
  }
  return block_max_u32(best, sm);
}

// Top-p on what top-k kept, when top-k's selection finished on every member at or above its bin
// (sel.all_above): the kept set (keys >= k_key) lies among the ranked candidates, so the goal
// (p times its mass) and the answer come from them, without another pass over the row.
__device__ inline uint32_t top_p_on_ranked(Shared& sm, int total, uint32_t k_key, double goal_fraction) {
  for (int t = threadIdx.x; t < total; t += kThrThreads) {
    if (sm.cand_key[t] == k_key) sm.pick_mass_incl = sm.rank_mass[t];  // ties: the same value
  }
  __syncthreads();
  const double goal = goal_fraction * static_cast<double>(sm.pick_mass_incl);
  __syncthreads();
  const uint32_t key = largest_reaching(sm, total, true, 0u, 0u, 0ull, goal);
  return key >= k_key ? key : k_key;
}

// One level of a selection: histogram this CTA's members, combine the cluster's histograms,
// pick the bin that holds the answer (the same pick on every CTA: the same integers in the same
// order), narrow the selection to it. by_mass: the goal is on the mass (top-p: goal_fraction of
// the mass at or above the floor), else on the count (top-k: goal_cnt). Returns true when the
// selection is done: sel.lo is the answer's key.
template <typename T>
__device__ bool select_level(cooperative_groups::cluster_group& cluster, Shared& sm, const T* slice, int n,
                             int level, uint32_t floor_key, Selection& sel, bool need_mass, bool by_mass,
                             unsigned int goal_cnt, double goal_fraction, float row_max, float k) {
  const int rb = level % 3;
  const float k_bins = k * kThrLogBins;
  // Level 0 runs in two passes: the first (sweep_head) lists the bins below kThrListBins and
  // sums the rest -- one bin, the last -- in registers; the list is binned from there. Only an
  // answer in that rest takes the second pass, which bins it from the slice. A top-p with p near 1
  // usually has its answer there, so it bins the whole row in one pass instead
  // (docs/DECISIONS.md#cuda-threshold-sweep).
  const bool two_pass = sel.level0 && sel.bin_from == 0 && !(by_mass && goal_fraction >= kThrOnePassTopP);
  // (level 0 starts without a list; its second pass keeps the first's)
  const bool fill_list = !sel.use_list && !(sel.level0 && sel.bin_from != 0);
  const int tail_from = two_pass ? kThrListBins : kThrBins - 1;
  // Digits of a sub-level: (key - lo) >> shift, in [0, kThrBins).
  const uint32_t width = sel.hi - sel.lo;
  const int shift = max(0, 32 - __clz(width) - kThrDigitBits);
  for (int i = threadIdx.x; i < kThrBins; i += kThrThreads) {
    sm.cnt[i] = 0;
    sm.mass_lo[i] = 0;
    sm.mass_hi[i] = 0;
  }
  // The cluster's bins live kThrBins / ranks per CTA (a power of two).
  const int rank_shift = 31 - __clz(kThrBins / static_cast<int>(cluster.num_blocks()));
  const int rank_mask = (1 << rank_shift) - 1;
  for (int i = threadIdx.x; i <= rank_mask; i += kThrThreads) {
    sm.red_cnt[(level + 1) % 3][i] = 0;
    sm.red_mass[(level + 1) % 3][i] = 0;
  }
  if (fill_list && threadIdx.x == 0) sm.list_n = 0;
  __syncthreads();
  unsigned int tail_c = 0;
  unsigned long long tail_m = 0;
  const int lane = threadIdx.x & 31;
  // Called by whole warps (for_each_entry, the list loop), so that the list appends and the
  // count-only bins are warp-aggregated: one shared atomic per warp, not one per member.
  auto visit = [&](bool valid, float x) {
    bool member = false;
    int bin = 0;
    uint32_t key = 0;
    if (valid) {
      key = key_of(x);
      if (key >= floor_key) {
        if (sel.level0) {
          bin = log_bin(x, row_max, k_bins);
          member = bin >= sel.bin_from;  // (the bins above: counted by the first pass)
        } else if (key >= sel.lo && key <= sel.hi) {
          member = true;
          bin = static_cast<int>((key - sel.lo) >> shift);
        }
      }
    }
    if (fill_list && !two_pass) {
      const bool listed = member && (!sel.level0 || bin < kThrListBins);
      warp_append(listed, key, sm.list_n, sm.list, kThrListCap, lane);
    }
    // Level 0's tail is summed in registers; the other bins with shared atomics.
    const bool tail = member && sel.level0 && bin >= tail_from;
    if (tail) {
      if (!two_pass) {  // (two passes: sweep_head summed the tail)
        tail_c += 1;
        if (need_mass) tail_m += mass_of(x, row_max, k);
      }
    } else if (member) {
      atomicAdd(&sm.cnt[bin], 1u);
      if (need_mass) add_mass(sm, bin, mass_of(x, row_max, k));
    }
  };
  if (two_pass) {
    if (need_mass) {
      sweep_head<true>(slice, n, value_of(floor_key), row_max, k_bins, k, sm, tail_c, tail_m);
    } else {
      sweep_head<false>(slice, n, value_of(floor_key), row_max, k_bins, k, sm, tail_c, tail_m);
    }
    __syncthreads();
  }
  // A CTA whose first pass overflowed its list bins the head from its slice.
  if (sel.use_list || (two_pass && sm.list_n <= kThrListCap)) {
    const int count = sm.list_n;
    const int rounded = (count + 31) & ~31;
    for (int i = threadIdx.x; i < rounded; i += kThrThreads) {
      const bool ok = i < count;
      visit(ok, ok ? value_of(sm.list[i]) : -INFINITY);
    }
  } else {
    for_each_entry(slice, n, visit);
  }
  if (sel.level0) warp_add_to_bin(tail_c, tail_m, sm, kThrBins - 1);
  __syncthreads();
  // From the next level on, a CTA whose members all fit reads its list instead of its slice
  // (level 0's list: when the pick is among its bins; decided below).
  const bool list_fits = fill_list && sm.list_n <= kThrListCap;
  if (fill_list && !sel.level0) {
    sel.use_list = list_fits;
    sel.list_all_above = false;
  }
  // Add this CTA's bins into their owners' (integer atomics: the same sums in any order).
  for (int b = threadIdx.x; b < kThrBins; b += kThrThreads) {
    const unsigned int c = sm.cnt[b];
    if (c != 0) {
      const int owner = b >> rank_shift, at = b & rank_mask;
      atomicAdd(cluster.map_shared_rank(&sm.red_cnt[rb][at], owner), c);
      if (need_mass) atomicAdd(cluster.map_shared_rank(&sm.red_mass[rb][at], owner), bin_mass(sm, b));
    }
  }
  cluster.sync();
  // Thread j holds the j-th bin in descending value order (level 0: bin j; later: digit kThrBins - 1 - j).
  const int j = threadIdx.x;
  const int bin = sel.level0 ? j : kThrBins - 1 - j;
  const int owner = bin >> rank_shift, at = bin & rank_mask;
  const unsigned int c_bin = cluster.map_shared_rank(&sm.red_cnt[rb][at], owner)[0];
  const unsigned long long m_bin = cluster.map_shared_rank(&sm.red_mass[rb][at], owner)[0];
  unsigned int c = c_bin;
  unsigned long long m = m_bin;
  block_scan(c, m, sm);
  if (sel.level0 && sel.bin_from == 0 && by_mass) {
    // The mass at or above the floor is level 0's total (the last thread's inclusive sum).
    if (j == kThrThreads - 1) sm.pick_mass_incl = m;
    __syncthreads();
    sel.goal_mass = goal_fraction * static_cast<double>(sm.pick_mass_incl);
    __syncthreads();
  }
  const bool reached =
      by_mass ? static_cast<double>(sel.mass_above + m) >= sel.goal_mass : sel.cnt_above + c >= goal_cnt;
  const int pick = block_min(c_bin > 0 && reached ? j : kThrBins, sm);
  if (pick == kThrBins) {  // nothing reaches the goal (rounding of a goal at the total): keep all
    sel.lo = floor_key;
    return true;
  }
  if (j == pick) {
    sm.pick_cnt = c_bin;
    sm.pick_cnt_incl = c;
    sm.pick_mass = m_bin;
    sm.pick_mass_incl = m;
  }
  __syncthreads();
  sel.cnt_above += sm.pick_cnt_incl - sm.pick_cnt;
  sel.mass_above += sm.pick_mass_incl - sm.pick_mass;
  const unsigned int picked_cnt = sm.pick_cnt;
  const unsigned long long picked_mass = sm.pick_mass;
  __syncthreads();
  // Few candidates left: finish on them, with every member at or above the bin when they fit
  // (top-p after top-k then needs no pass of its own), else with the bin's members.
  const bool all_above = sel.cnt_above + picked_cnt <= static_cast<unsigned>(kThrFinishCap);
  if (all_above || picked_cnt <= static_cast<unsigned>(kThrFinishCap)) {
    // (level 0's last bin spans the bins from tail_from on)
    const int pick_from = sel.level0 && pick == kThrBins - 1 ? tail_from : pick;
    CandidateRange range{sel.level0, all_above ? 0 : pick_from, pick, 0u, 0xFFFFFFFFu, floor_key, row_max, k_bins};
    if (!sel.level0) {
      const uint64_t lo = static_cast<uint64_t>(sel.lo) + (static_cast<uint64_t>(kThrBins - 1 - pick) << shift);
      const uint64_t hi = lo + ((uint64_t{1} << shift) - 1);
      range.lo = static_cast<uint32_t>(lo);
      if (!all_above) range.hi = static_cast<uint32_t>(hi < sel.hi ? hi : sel.hi);
    }
    const bool from_list = sel.level0 ? list_fits && pick < kThrListBins
                                      : sel.use_list && (!all_above || sel.list_all_above);
    const int total = gather_candidates<T>(cluster, sm, slice, n, from_list, range, row_max, k);
    const uint32_t key = all_above ? largest_reaching(sm, total, by_mass, 0u, goal_cnt, 0ull, sel.goal_mass)
                                   : largest_reaching(sm, total, by_mass, sel.cnt_above, goal_cnt, sel.mass_above,
                                                      sel.goal_mass);
    sel.lo = key != 0 ? key : floor_key;  // none reaches (cannot happen: the bin did): keep all
    sel.all_above = all_above && key != 0;
    sel.candidates = total;
    return true;
  }
  if (sel.level0 && pick == kThrBins - 1 && two_pass) {
    // The answer lies in level 0's tail: a second pass bins it.
    sel.bin_from = kThrListBins;
    return false;
  }
  if (sel.level0) {
    // Bin `pick`'s key range, by bisection on log_bin (the same float arithmetic as the pass).
    const uint32_t top = key_of(row_max);
    auto at_most = [&](int limit) { return [&, limit](float v) { return log_bin(v, row_max, k_bins) <= limit; }; };
    sel.lo = max(pick == kThrBins - 1 ? kKeyNegInf : least_key(top, at_most(pick)), floor_key);
    sel.hi = pick == 0 ? top : least_key(top, at_most(pick - 1)) - 1;
    sel.level0 = false;
    sel.use_list = list_fits && pick < kThrListBins;
    sel.list_all_above = sel.use_list;
  } else {
    const uint64_t lo = static_cast<uint64_t>(sel.lo) + (static_cast<uint64_t>(kThrBins - 1 - pick) << shift);
    const uint64_t hi = lo + ((uint64_t{1} << shift) - 1);
    sel.lo = static_cast<uint32_t>(lo);
    sel.hi = static_cast<uint32_t>(hi < sel.hi ? hi : sel.hi);
  }
  if (sel.lo == sel.hi) {
    sel.mass_above += picked_mass;
    return true;
  }
  return false;
}

// A whole selection (top-k: by count; top-p: by mass), from level 0 over the slice: the answer's
// key. *ranked_above: the selection finished on every member at or above its bin, now ranked in
// shared memory (*candidates of them; see top_p_on_ranked).
template <typename T>
__device__ __noinline__ uint32_t select_key(cooperative_groups::cluster_group& cluster, Shared& sm, const T* slice, int n,
                               int& level, uint32_t floor_key, bool need_mass, bool by_mass, unsigned int goal_cnt,
                               double goal_fraction, float row_max, float k, bool* ranked_above, int* candidates) {
  Selection sel{kKeyNegInf, key_of(row_max), 0ull, 0u, true, 0.0, false, 0, false, false, 0};
  while (!select_level<T>(cluster, sm, slice, n, level++, floor_key, sel, need_mass, by_mass, goal_cnt,
                          goal_fraction, row_max, k)) {
  }
  *ranked_above = sel.all_above;
  *candidates = sel.candidates;
  return sel.lo;
}

// Request b's filters and the slot's target row: false when the slot is not filtered.
struct SlotFilters {
  int64_t row;
  float k;  // log2(e) / T
  int top_k;
  float top_p, min_p;
  bool k_on, p_on, mp_on;
};

// owner: a shared-memory slot for the tree's owner search.
__device__ inline bool slot_filters(const RowThresholdParams& p, int64_t slot, int64_t& owner, SlotFilters& f) {
  int64_t b, row;
  if (p.tree) {
    // The owner of node row `slot`: the least i with cu[i] > row is owner + 1 (cu may be
    // malformed: this is the owner under the sanitized offsets of the tree kernel).
    row = slot;
    if (threadIdx.x < 32) {
      int64_t first = -1;
      for (int64_t base = 0; base <= p.num_requests && first < 0; base += 32) {
        const int64_t i = base + threadIdx.x;
        const bool above = i <= p.num_requests && rs_detail::load_index(p.cu, p.cu_int64, i) > row;
        const unsigned ballot = __ballot_sync(kFullMask, above);
        if (ballot != 0) first = base + __ffs(ballot) - 1;
      }
      if (threadIdx.x == 0) owner = first - 1;
    }
    __syncthreads();
    b = owner;
    if (b < 0 || row >= p.num_rows) return false;
  } else {
    b = slot / p.max_rows;
    const int64_t t = slot % p.max_rows;
    const int64_t cu_lo = rs_detail::load_index(p.cu, p.cu_int64, b);
    int64_t n = rs_detail::load_index(p.cu, p.cu_int64, b + 1) - cu_lo;
    n = n < 0 ? 0 : (n > p.max_rows - 1 ? p.max_rows - 1 : n);
    row = cu_lo + b + t;
    if (t > n || row < 0 || row >= p.num_rows) return false;
  }
  const float temp = p.temperature != nullptr ? p.temperature[b] : 1.0f;
  if (!(temp > 0.0f)) return false;  // greedy requests ignore the filters
  f.row = row;
  f.k = kLog2e / temp;
  f.top_k = 0;
  if (p.top_k != nullptr) {
    const int64_t kk = rs_detail::load_index(p.top_k, p.top_k_int64, b);
    f.top_k = static_cast<int>(kk < -1 ? -1 : (kk > p.vocab ? p.vocab : kk));
  }
  f.top_p = p.top_p != nullptr ? p.top_p[b] : 1.0f;
  f.min_p = p.min_p != nullptr ? fminf(p.min_p[b], 1.0f) : 0.0f;
  f.k_on = f.top_k > 0 && f.top_k < p.vocab;
  f.p_on = f.top_p < 1.0f;  // NaN: off
  f.mp_on = f.min_p > 0.0f;  // NaN: off
  return f.k_on || f.p_on || f.mp_on;
}

// Key of the smallest float v with (v - M) k >= log2(min_p): 33 bisection steps on the key.
__device__ inline uint32_t min_p_key(float row_max, float k, float min_p) {
  const float goal = log2f(min_p);
  return least_key(key_of(row_max), [&](float v) { return (v - row_max) * k >= goal; });
}

// This CTA's share of slot f's row: `rank` of the cluster's CTAs, p.slice entries each (fewer or
// none at the row's end); *n gets its length.
template <typename T>
__device__ __forceinline__ const T* slice_source(const RowThresholdParams& p, const SlotFilters& f, int rank, int* n) {
  const int64_t start = static_cast<int64_t>(rank) * p.slice;
  const int64_t left = p.vocab - start;
  *n = static_cast<int>(left <= 0 ? 0 : (left < p.slice ? left : p.slice));
  return static_cast<const T*>(p.logits) + f.row * p.row_stride + start;
}

// The max of a slice's n entries (sanitized), read with kUnroll 16-byte loads in flight per thread
// when the rows are 16-byte aligned; kStore also copies the slice to `dst` (shared memory).
template <int kThreads, int kUnroll, bool kStore, typename T>
__device__ __forceinline__ float load_slice_max(const T* src, int n, bool vectorized, T* dst) {
  float local_max = -INFINITY;
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  int done = 0;
  if (vectorized) {
    // All kUnroll loads are issued before any is used: a slice is a few of them.
    const int n_vec = n / kVec;
    for (int base = threadIdx.x; base < n_vec; base += kThreads * kUnroll) {
      uint4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = base + u * kThreads;
        v[u] = i < n_vec ? __ldcg(reinterpret_cast<const uint4*>(src) + i) : make_uint4(0u, 0u, 0u, 0u);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = base + u * kThreads;
        if (i < n_vec) {
          if constexpr (kStore) reinterpret_cast<uint4*>(dst)[i] = v[u];
          const T* e = reinterpret_cast<const T*>(&v[u]);
#pragma unroll
          for (int q = 0; q < kVec; ++q) local_max = fmaxf(local_max, rs_detail::sanitize(to_float(e[q])));
        }
      }
    }
    done = n_vec * kVec;
  }
  for (int i = done + threadIdx.x; i < n; i += kThreads) {
    const T v = src[i];
    if constexpr (kStore) dst[i] = v;
    local_max = fmaxf(local_max, rs_detail::sanitize(to_float(v)));
  }
  return local_max;
}

#endif  // __CUDA_ARCH__ >= 900

}  // namespace thr_detail

// One cluster of kThrCluster (or kThrSmallCluster) CTAs per slot; launched with the cluster
// dimension by launch_row_thresholds. Dynamic shared memory: p.slice entries of T. Two CTAs per
// SM (64 registers): the clusters of many rows share the SMs.
template <typename T>
__global__ void __launch_bounds__(kThrThreads, 2) row_threshold_kernel(const RowThresholdParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  using namespace thr_detail;
  __shared__ Shared sm;
  extern __shared__ __align__(16) unsigned char thr_dynamic_smem[];
  T* slice = reinterpret_cast<T*>(thr_dynamic_smem);
  cg::cluster_group cluster = cg::this_cluster();
  const int ranks = static_cast<int>(cluster.num_blocks());
  const int64_t slot = blockIdx.x / ranks;
  const int rank = static_cast<int>(cluster.block_rank());
  SlotFilters f;
  // Uniform over the cluster: every CTA returns here, or none does.
  if (!slot_filters(p, slot, sm.owner, f)) {
    if (rank == 0 && threadIdx.x == 0) p.thresholds[slot] = -INFINITY;
    return;
  }
  // This CTA's slice of the row, into shared memory; its max.
  int n;
  const T* src = slice_source<T>(p, f, rank, &n);
  float local_max = load_slice_max<kThrThreads, kThrLoadUnroll, true>(src, n, p.vectorized, slice);
  for (int i = threadIdx.x; i < 3 * kThrMaxBinsPerRank; i += kThrThreads) {
    sm.red_cnt[i / kThrMaxBinsPerRank][i % kThrMaxBinsPerRank] = 0;
    sm.red_mass[i / kThrMaxBinsPerRank][i % kThrMaxBinsPerRank] = 0;
  }
  local_max = block_max(local_max, sm);  // (its barriers also publish the slice and the zeros)
  if (threadIdx.x == 0) sm.cta_max = local_max;
  cluster.sync();
  float row_max = -INFINITY;
  for (int q = 0; q < ranks; ++q) row_max = fmaxf(row_max, cluster.map_shared_rank(&sm.cta_max, q)[0]);
  uint32_t t_key = kKeyNegInf;
  if (row_max > -INFINITY) {
    int level = 0;
    uint32_t k_key = kKeyNegInf;
    bool k_ranked = false;
    int k_candidates = 0;
    if (f.k_on) {
      k_key = select_key<T>(cluster, sm, slice, n, level, kKeyNegInf, false, false, static_cast<unsigned>(f.top_k),
                            0.0, row_max, f.k, &k_ranked, &k_candidates);
    }
    uint32_t p_key = kKeyNegInf;
    if (f.p_on) {
      // top-p on what top-k kept: the floor is t_k; p <= 0 keeps the top token(s) (goal 0).
      const double goal_fraction = static_cast<double>(fmaxf(f.top_p, 0.0f));
      if (k_ranked) {
        p_key = top_p_on_ranked(sm, k_candidates, k_key, goal_fraction);
      } else {
        bool ranked;
        int candidates;
        p_key = select_key<T>(cluster, sm, slice, n, level, k_key, true, true, 0u, goal_fraction, row_max, f.k,
                              &ranked, &candidates);
      }
    }
    const uint32_t mp_key = f.mp_on ? min_p_key(row_max, f.k, f.min_p) : kKeyNegInf;
    t_key = max(max(k_key, p_key), mp_key);
    t_key = min(t_key, key_of(row_max));  // every filter keeps the max
  }
  if (rank == 0 && threadIdx.x == 0) p.thresholds[slot] = value_of(t_key);
  // No CTA leaves while another may still read its shared memory.
  cluster.sync();
#else
  __trap();  // sm_90 only: the binding checks the device first
#endif
}

// Entries per CTA when a row is split over `ranks` CTAs (16-byte loads: a multiple of kThrSliceAlign).
inline int64_t thr_slice(int64_t vocab, int ranks) {
  const int64_t per_cta = (vocab + ranks - 1) / ranks;
  return (per_cta + kThrSliceAlign - 1) / kThrSliceAlign * kThrSliceAlign;
}

// CTAs per row: kThrSmallCluster once the rows outnumber what the GPU runs in about two waves of
// kThrCluster-CTA clusters (two CTAs per SM) and two such CTAs still fit an SM's shared memory
// (on an H200: 2-byte logits up to V ~ 190K, fp32 up to ~90K): half the CTAs per row, so half the per-CTA fixed costs, at twice
// the entries each (docs/DECISIONS.md#cuda-threshold-cluster-size). $SPECDEC_CUDA_THR_CLUSTER = 4
// or 8 forces one (read once per process; benchmarks' A/B).
template <typename T>
int thr_cluster_size(int64_t vocab, int64_t slots) {
  static const int forced = [] {
    const char* e = std::getenv("SPECDEC_CUDA_THR_CLUSTER");
    return e != nullptr ? std::atoi(e) : 0;
  }();
  if (forced == kThrCluster || forced == kThrSmallCluster) return forced;
  int device = 0, sms = 0, smem_per_sm = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device) != cudaSuccess) {
    return kThrCluster;
  }
  const int64_t rows_per_wave = 2 * static_cast<int64_t>(sms) / kThrCluster;
  const int64_t cta_bytes = thr_slice(vocab, kThrSmallCluster) * static_cast<int64_t>(sizeof(T)) +
                            static_cast<int64_t>(sizeof(thr_detail::Shared)) + 1024;  // (+ the runtime's reserve)
  return slots > 2 * rows_per_wave && 2 * cta_bytes <= smem_per_sm ? kThrSmallCluster : kThrCluster;
}

// One cluster of `ranks` CTAs per slot.
template <typename Kernel>
cudaError_t launch_clusters(Kernel kernel, const RowThresholdParams& p, int64_t slots, int ranks, int threads,
                            size_t smem, cudaStream_t stream) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(slots * ranks), 1, 1);
  config.blockDim = dim3(static_cast<unsigned>(threads), 1, 1);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned>(ranks);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  config.attrs = attr;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, p);
}

template <typename T>
cudaError_t launch_row_thresholds(RowThresholdParams p, int64_t slots, cudaStream_t stream) {
  const int ranks = thr_cluster_size<T>(p.vocab, slots);
  p.slice = thr_slice(p.vocab, ranks);
  const size_t smem = static_cast<size_t>(p.slice) * sizeof(T);
  cudaError_t err = cudaFuncSetAttribute(row_threshold_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  return launch_clusters(row_threshold_kernel<T>, p, slots, ranks, kThrThreads, smem, stream);
}

// Min-p alone (top_k and top_p not given): the threshold needs only the row max, so a cluster of
// kThrCluster small CTAs per slot reads its slices into registers -- no shared-memory copy, no
// selection -- and many clusters share an SM: the pass runs at the logits' read, not in waves of
// two big CTAs per SM. The same max and min_p_key as row_threshold_kernel: the same thresholds.
constexpr int kThrMaxThreads = 256;
constexpr int kThrMaxUnroll = 4;  // 16-byte loads in flight per thread (40 registers: 6 CTAs per SM)

template <typename T>
__global__ void __launch_bounds__(kThrMaxThreads, 6) row_min_p_threshold_kernel(const RowThresholdParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  using namespace thr_detail;
  __shared__ int64_t owner;
  __shared__ float warp_max[kThrMaxThreads / 32];
  __shared__ float cta_max;
  cg::cluster_group cluster = cg::this_cluster();
  const int64_t slot = blockIdx.x / kThrCluster;
  const int rank = static_cast<int>(cluster.block_rank());
  SlotFilters f;
  if (!slot_filters(p, slot, owner, f)) {  // (uniform over the cluster)
    if (rank == 0 && threadIdx.x == 0) p.thresholds[slot] = -INFINITY;
    return;
  }
  int n;
  const T* src = slice_source<T>(p, f, rank, &n);
  float local_max = load_slice_max<kThrMaxThreads, kThrMaxUnroll, false>(src, n, p.vectorized, static_cast<T*>(nullptr));
  for (int o = 16; o > 0; o >>= 1) local_max = fmaxf(local_max, __shfl_xor_sync(kFullMask, local_max, o));
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = local_max;
  __syncthreads();
  if (threadIdx.x == 0) {
    float m = warp_max[0];
    for (int w = 1; w < kThrMaxThreads / 32; ++w) m = fmaxf(m, warp_max[w]);
    cta_max = m;
  }
  cluster.sync();
  if (rank == 0 && threadIdx.x == 0) {
    float row_max = -INFINITY;
    for (int q = 0; q < kThrCluster; ++q) row_max = fmaxf(row_max, cluster.map_shared_rank(&cta_max, q)[0]);
    uint32_t t_key = kKeyNegInf;
    if (row_max > -INFINITY && f.mp_on) t_key = min(min_p_key(row_max, f.k, f.min_p), key_of(row_max));
    p.thresholds[slot] = value_of(t_key);
  }
  // No CTA leaves while rank 0 may still read its shared memory.
  cluster.sync();
#else
  __trap();  // sm_90 only: the binding checks the device first
#endif
}

// Launched instead of launch_row_thresholds when p.top_k and p.top_p are null.
template <typename T>
cudaError_t launch_row_min_p_thresholds(RowThresholdParams p, int64_t slots, cudaStream_t stream) {
  p.slice = thr_slice(p.vocab, kThrCluster);
  return launch_clusters(row_min_p_threshold_kernel<T>, p, slots, kThrCluster, kThrMaxThreads, 0, stream);
}

}  // namespace specdec
