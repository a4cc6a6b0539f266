// The chain kernel's CTA state (RsShared, a request's fields) and what its finalizers do with
// the records: combine a row's split records, decide (token verification: decide_request;
// block verification: decide_block) and write the outputs.
#pragma once

#include <cuda_runtime.h>

#include <cfloat>
#include <climits>
#include <cstdint>

#include "kernels/common.cuh"
#include "kernels/elements.cuh"
#include "kernels/philox.cuh"
#include "kernels/rejection_sample_params.cuh"
#include "kernels/rejection_sample_trace.cuh"
#include "kernels/warp.cuh"

namespace specdec {
namespace rs_detail {

// ---------------------------------------------------------------------------- shared state

struct RequestContext {
  int64_t cu_lo;
  int n;  // drafts used: clamp(cu[b+1] - cu[b], 0, max_spec_len)
  bool greedy;
  float k;  // log2(e) / T (log2(e) for greedy requests)
  uint64_t seed;
  uint64_t offset;
};

// One row of block verification's scan (decide_block), written by the warp that combined it.
struct RsBlockRow {
  float q_x;      // q_r(x_r) (0 when x_r is invalid)
  float p_x;      // p_r(x_r) (1 for deterministic drafts)
  float eta;      // the accept uniform of position r (draft r - 1), final scans only
  float mass;     // R_r with draft probabilities: the residual units' masses of row r, final scans only
  float row_max;
  float row_sum;
  int32_t sample;  // the row's sample of q (-1: none)
  int32_t draft;   // x_r if r < n and it is a valid id, else -1
};

struct RsShared {
  float2 noise[kRsMaxUnitChunks];  // per chunk of the unit: (u_c, log2(-log2(v_c)))
  // Per lane group (or per warp) partial results of a unit, combined by thread 0.
  float reduce_max[kRsGroups];
  float reduce_sum[kRsGroups];
  float reduce_score[kRsGroups];
  int reduce_index[kRsGroups];
  int reduce_chunk[kRsGroups];
  int unit;
  int is_last;
  // Block-wide results, one field per producer so that a result is never overwritten
  // before every thread read it (a barrier separates each read from the next write).
  int token;
  int argmax;
  // The request's decision (decide_request).
  int t_star;
  int x_star;  // draft at t_star when it is a valid id and t_star < n, else -1
  int argmax_star;
  int sample_star;
  float max_star;
  float sum_star;
  // Block verification (decide_block): a batch of rows, then P_tau (or P of the unit's row)
  // and n' (INT_MAX while a partial scan has not seen it).
  RsBlockRow block_rows[kRsWarps];
  float block_scale;
  int block_end;
  // Phase 1: the unit's request (for its finalizer) and split 0's accept-test operands, kept
  // here rather than in registers across the stream.
  RequestContext rq;
  float draft_logit;
  float draft_prob;
};

// A request's fields as loaded: 32-bit words, each load issued without a branch (predicated
// on the dtypes), so that a caller can issue them, then its first tiles, and only then
// decode_request, whose arithmetic waits for the loads.
struct RequestWords {
  uint32_t cu_lo[2], cu_hi[2];  // cu[b], cu[b + 1] (high words of int64 offsets)
  uint32_t temperature[2];      // fp32 bits, fp64 words, or a bf16 / fp16 in the low half
  uint32_t seed[2];
  uint32_t offset[2];
};

__device__ __forceinline__ uint32_t load_word(const void* base, int64_t i) {
  return __ldg(static_cast<const unsigned int*>(base) + i);
}

// Entry i of an int32 / int64 tensor as its words (the high word only for int64).
__device__ __forceinline__ void load_index_words(const void* base, bool is_int64, int64_t i, uint32_t (&w)[2]) {
  w[0] = load_word(base, is_int64 ? 2 * i : i);
  w[1] = is_int64 ? load_word(base, 2 * i + 1) : 0u;
}

__device__ __forceinline__ int64_t index_from_words(const uint32_t (&w)[2], bool is_int64) {
  return is_int64 ? static_cast<int64_t>((static_cast<uint64_t>(w[1]) << 32) | w[0])
                  : static_cast<int64_t>(static_cast<int32_t>(w[0]));
}

__device__ __forceinline__ RequestWords load_request_words(const RejectionSampleParams& p, int b) {
  RequestWords w;
  load_index_words(p.cu_num_draft_tokens, p.cu_int64, b, w.cu_lo);
  load_index_words(p.cu_num_draft_tokens, p.cu_int64, b + 1, w.cu_hi);
  const int dt = p.temperature_dtype;
  const bool words = dt == kRsTemperatureFloat32 || dt == kRsTemperatureFloat64;
  const bool halves = dt == kRsTemperatureBFloat16 || dt == kRsTemperatureFloat16;
  w.temperature[0] = words ? load_word(p.temperature, dt == kRsTemperatureFloat64 ? 2 * b : b)
                     : halves ? static_cast<uint32_t>(__ldg(static_cast<const unsigned short*>(p.temperature) + b))
                              : 0u;
  w.temperature[1] = dt == kRsTemperatureFloat64 ? load_word(p.temperature, 2 * b + 1) : 0u;
  load_index_words(p.seeds, p.seeds_int64, b, w.seed);
  w.offset[0] = w.offset[1] = 0u;
  if (p.offsets != nullptr) load_index_words(p.offsets, p.offsets_int64, b, w.offset);
  return w;
}

__device__ __forceinline__ float temperature_from_words(const RejectionSampleParams& p, const uint32_t (&w)[2]) {
  switch (p.temperature_dtype) {
    case kRsTemperatureFloat32:
      return __uint_as_float(w[0]);
    case kRsTemperatureFloat64:
      return __double2float_rn(__hiloint2double(static_cast<int>(w[1]), static_cast<int>(w[0])));
    case kRsTemperatureBFloat16:
      return __uint_as_float(w[0] << 16);
    case kRsTemperatureFloat16:
      return __half2float(__ushort_as_half(static_cast<unsigned short>(w[0])));
    default:
      return 1.0f;  // every request has temperature 1
  }
}

__device__ __forceinline__ RequestContext decode_request(const RejectionSampleParams& p, const RequestWords& w) {
  RequestContext rq;
  rq.cu_lo = index_from_words(w.cu_lo, p.cu_int64);
  const int64_t count = index_from_words(w.cu_hi, p.cu_int64) - rq.cu_lo;
  rq.n = static_cast<int>(count < 0 ? 0 : (count > p.max_spec_len ? p.max_spec_len : count));
  const float temperature = temperature_from_words(p, w.temperature);
  rq.greedy = !(temperature > 0.0f) || is_nan(temperature);  // 0, negative and NaN are greedy
  rq.k = rq.greedy ? kLog2e : __fdiv_rn(kLog2e, temperature);
  rq.seed = static_cast<uint64_t>(index_from_words(w.seed, p.seeds_int64));
  rq.offset = static_cast<uint64_t>(index_from_words(w.offset, p.offsets_int64));
  return rq;
}

__device__ __forceinline__ RequestContext load_request(const RejectionSampleParams& p, int b) {
  return decode_request(p, load_request_words(p, b));
}

// ------------------------------------------------------------------------ record combining

struct RowStats {
  float row_max;
  float row_sum;
  int argmax;  // -1: no valid logit, or a random request
  int sample;  // the race winner's sample of q (-1: no mass, or a greedy request)
};

struct NoWork {
  __device__ void operator()() const {}
};

// Combines the num_splits records of one row (one warp, two per lane), as the Triton kernel
// combines its per-split statistics. Lane 0 also gets split 0's draft fields in `first`.
// while_loading() runs between the record loads and their first use.
template <typename Work = NoWork>
__device__ __forceinline__ RowStats combine_row_records(const RsSplitRecord* records, int num_splits, float k,
                                                        int lane, float4& first, Work&& while_loading = Work{}) {
  float m[2], s[2], g[2];
  int am[2], cand[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int split = lane + 32 * r;
    if (split < num_splits) {
      const float4* rec = reinterpret_cast<const float4*>(records + split);
      const float4 a = __ldcg(rec);
      const float4 c = __ldcg(rec + 1);
      if (r == 0) first = c;
      m[r] = a.x;
      s[r] = a.y;
      am[r] = __float_as_int(a.z);
      g[r] = a.w;
      cand[r] = __float_as_int(c.w);
    } else {
      m[r] = -INFINITY;
      s[r] = 0.0f;
      am[r] = -1;
      g[r] = -INFINITY;
      cand[r] = -1;
    }
  }
  while_loading();
  const float row_max = warp_max(fmaxf(m[0], m[1]));
  float sum = 0.0f, best = -INFINITY;
  int argmax = INT_MAX, best_split = INT_MAX, best_cand = -1;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (m[r] > -INFINITY) {
      const float shift = (m[r] - row_max) * k;
      sum += s[r] * exp2f(shift);
      if (m[r] == row_max && am[r] >= 0) argmax = min(argmax, am[r]);
      if (g[r] > -INFINITY && g[r] + shift > best) {  // splits increase with r: lowest wins ties
        best = g[r] + shift;
        best_split = lane + 32 * r;
        best_cand = cand[r];
      }
    }
  }
  sum = warp_sum(sum);
  argmax = warp_min(argmax);
  warp_race_winner(best, best_split, best_cand);
  return RowStats{row_max, sum, (row_max > -INFINITY && argmax != INT_MAX) ? argmax : -1,
                  best > -INFINITY ? best_cand : -1};
}

// t* and the statistics of row t* into shared memory (sm.t_star .. sm.sample_star) for the
// request in sm.rq (written before a barrier). Every warp takes rows t = warp, warp + 8, ...,
// combines their records and runs their accept tests with the draft fields of split 0; it
// stops at its first rejection, and t* is the least such row over warps.
__device__ inline void decide_request(const RejectionSampleParams& p, int b, RsShared& sm) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  if (threadIdx.x == 0) sm.t_star = INT_MAX;
  __syncthreads();
  const RequestContext rq = sm.rq;
  // Lenience (docs/ALGORITHM.md §8): random requests test u (l p(x)) < q(x); greedy ones also
  // accept a draft whose logit is within ln(l) of the row max (never when l = 1: +inf).
  const bool lenient = p.lenience != nullptr;
  float lam = 1.0f, ln_lam = INFINITY;
  if (lenient) {
    lam = __ldg(p.lenience + b);
    ln_lam = lam < 1.0f ? logf(lam) : INFINITY;
  }
  int stop_row = INT_MAX, stop_x = -1, stop_argmax = -1, stop_sample = -1;
  float stop_max = -INFINITY, stop_sum = 0.0f;
  for (int t = warp; t <= rq.n; t += kRsWarps) {
    const RsSplitRecord* records =
        p.split_records + (static_cast<int64_t>(b) * (p.max_spec_len + 1) + t) * p.plan.num_splits;
    float4 first = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    const bool is_draft = t < rq.n;
    float u = 0.0f;  // the accept uniform, drawn while the records load
    const RowStats rs = combine_row_records(records, p.plan.num_splits, rq.k, lane, first, [&] {
      if (is_draft && !rq.greedy) {
        u = uniform_from_word(philox_words(rq.seed, rq.offset, kStreamAccept, static_cast<uint32_t>(t + 1), 0u).x);
      }
    });
    const int x = __float_as_int(first.x);  // lane 0: split 0's draft (-1 unless a valid id)
    bool stop = true;
    if (lane == 0 && is_draft) {
      bool accept;
      if (rq.greedy) {
        accept = x >= 0 && x == rs.argmax;
        if (lenient) accept = accept || (x >= 0 && first.y - rs.row_max >= ln_lam);
      } else {
        const float lx = first.y, px = lenient ? lam * first.z : first.z;
        const float q = (x >= 0 && lx > -INFINITY && rs.row_max > -INFINITY)
                            ? __fdiv_rn(exp2f((lx - rs.row_max) * rq.k), rs.row_sum)
                            : 0.0f;
        accept = x >= 0 && u * px < q;
      }
      stop = !accept;
    }
    if (__shfl_sync(kFullMask, stop ? 1 : 0, 0) != 0) {
      stop_row = t;
      stop_x = is_draft ? x : -1;
      stop_max = rs.row_max;
      stop_sum = rs.row_sum;
      stop_argmax = rs.argmax;
      stop_sample = rs.sample;
      break;
    }
  }
  RS_TRACE(kRsTraceRecords, stop_row);
  if (lane == 0 && stop_row != INT_MAX) atomicMin(&sm.t_star, stop_row);
  __syncthreads();
  if (lane == 0 && stop_row == sm.t_star) {
    sm.x_star = stop_x;
    sm.max_star = stop_max;
    sm.sum_star = stop_sum;
    sm.argmax_star = stop_argmax;
    sm.sample_star = stop_sample;
  }
  __syncthreads();
}

// Block verification's decision (docs/ALGORITHM.md §6) for the random request in sm.rq,
// block-wide, the same arithmetic as the Triton kernel's _block_ratios / _block_tau. Rows are
// scanned in batches of kRsWarps: warp w combines row base + w's records (as decide_request)
// into sm.block_rows[w], then thread 0 walks the batch in order carrying the running joint
// ratio P (before row r: P_r of the 1-based notation, the scale of row r's residual).
//  - kFinal (the request's finalizer): rows 0 .. n' (n' = the first row without a valid draft,
//    at most n). h_r = R_r / (R_r + 1 - P_r) (1 when the denominator is 0) for 1 <= r < n',
//    with R_r = the residual units' masses of row r (draft probabilities) or P_r (1 - q_r(x_r))
//    (point masses); h_n' = P_n'; tau = the largest r with eta_r < h_r, else 0. Writes
//    sm.t_star = tau, sm.block_scale = P_tau, sm.block_end = n' and row tau's max, sum and
//    sample (sm.max_star, sm.sum_star, sm.sample_star).
//  - otherwise (a residual unit of row stop_row < n): rows 0 .. stop_row. Writes
//    sm.block_scale = P_stop_row, that row's max and sum, and sm.block_end = n' if n' <=
//    stop_row (the row is then past the chain and has no residual to stream), else INT_MAX.
// Results are read after it returns; callers pass a barrier before the next decision.
template <bool kHasDraftProbs, bool kFinal>
__device__ void decide_block(const RejectionSampleParams& p, int b, RsShared& sm, int stop_row) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const RequestContext rq = sm.rq;
  const int last_row = min(stop_row, rq.n);
  if (threadIdx.x == 0) {
    sm.t_star = 0;
    sm.block_scale = 1.0f;
    sm.block_end = INT_MAX;
  }
  float ratio = 1.0f;  // thread 0: P before row `base`
  for (int base = 0;; base += kRsWarps) {
    const int r = base + warp;
    if (r <= last_row) {
      const RsSplitRecord* records =
          p.split_records + (static_cast<int64_t>(b) * (p.max_spec_len + 1) + r) * p.plan.num_splits;
      float4 first = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      const RowStats rs = combine_row_records(records, p.plan.num_splits, rq.k, lane, first);
      float mass = 0.0f;
      if constexpr (kFinal && kHasDraftProbs) {
        if (r >= 1 && r < rq.n) {  // rows < n <= residual_rows, all written by this call's units
          const float* masses = p.residual_masses +
                                (static_cast<int64_t>(b) * p.plan.residual_rows + r) * p.plan.residual_splits;
          for (int s = lane; s < p.plan.residual_splits; s += 32) mass += __ldcg(masses + s);
          mass = warp_sum(mass);
        }
      }
      if (lane == 0) {
        const int x = r < rq.n ? __float_as_int(first.x) : -1;  // split 0's draft: -1 unless valid
        const float lx = first.y;
        RsBlockRow row;
        row.draft = x;
        row.q_x = (x >= 0 && lx > -INFINITY && rs.row_max > -INFINITY)
                      ? __fdiv_rn(exp2f((lx - rs.row_max) * rq.k), rs.row_sum)
                      : 0.0f;
        row.p_x = first.z;
        row.eta = (kFinal && r >= 1)
                      ? uniform_from_word(
                            philox_words(rq.seed, rq.offset, kStreamAccept, static_cast<uint32_t>(r), 0u).x)
                      : 0.0f;
        row.mass = mass;
        row.row_max = rs.row_max;
        row.row_sum = rs.row_sum;
        row.sample = rs.sample;
        sm.block_rows[warp] = row;
      }
    }
    __syncthreads();
    bool done = false;
    if (threadIdx.x == 0) {
      const int count = min(kRsWarps, last_row + 1 - base);
      for (int j = 0; j < count && !done; ++j) {
        const RsBlockRow& row = sm.block_rows[j];
        const int rr = base + j;
        const bool chain_end = rr == rq.n || row.draft < 0;  // rr = n'
        bool keep = false;  // row rr's statistics are the result's
        if constexpr (kFinal) {
          keep = rr == 0;  // tau = 0 unless a later position passes its test
          if (rr >= 1) {
            float h = ratio;  // h_n' = P_n'
            if (!chain_end) {
              const float residual = kHasDraftProbs ? row.mass : ratio * (1.0f - row.q_x);
              const float den = residual + 1.0f - ratio;
              h = den > 0.0f ? __fdiv_rn(residual, den) : 1.0f;
            }
            keep = row.eta < h;
          }
          if (keep) sm.t_star = rr;
        } else {
          keep = rr == stop_row;
        }
        if (keep) {
          sm.block_scale = ratio;
          sm.max_star = row.row_max;
          sm.sum_star = row.row_sum;
          sm.sample_star = row.sample;
        }
        if (chain_end) sm.block_end = rr;
        done = chain_end || rr == stop_row;
        if (!done) {
          // P after draft rr: min(1, P q(x) / p(x)), division-free where p(x) = 0.
          const float num = ratio * row.q_x;
          ratio = num >= row.p_x ? (num > 0.0f ? 1.0f : 0.0f) : __fdiv_rn(num, row.p_x);
        }
      }
    }
    // Also the barrier after which the batch's slots may be rewritten.
    if (__syncthreads_or(done)) break;
  }
}

// Draft threadIdx.x of the request (-1 from n on, or outside the tensor), loaded by a finalizer
// before its decision so that the load overlaps it; write_outputs takes it.
__device__ __forceinline__ int32_t preload_output_draft(const RejectionSampleParams& p, const RequestContext& rq) {
  const int64_t d = rq.cu_lo + threadIdx.x;
  return (static_cast<int>(threadIdx.x) < rq.n && d >= 0 && d < p.num_drafts)
             ? static_cast<int32_t>(load_index(p.draft_token_ids, p.draft_ids_int64, d))
             : -1;
}

// preloaded: preload_output_draft's value (positions past the first kRsThreads load theirs).
__device__ __forceinline__ void write_outputs(const RejectionSampleParams& p, const RequestContext& rq, int b,
                                              int t_star, int token, int32_t preloaded) {
  const int width = p.max_spec_len + 1;
  int32_t* out = p.output_token_ids + static_cast<int64_t>(b) * width;
  for (int pos = threadIdx.x; pos < width; pos += kRsThreads) {
    // Accepted drafts were checked in range by their accept tests.
    int32_t value = pos == t_star ? token : -1;
    if (pos < t_star) {
      value = pos == static_cast<int>(threadIdx.x)
                  ? preloaded
                  : static_cast<int32_t>(load_index(p.draft_token_ids, p.draft_ids_int64, rq.cu_lo + pos));
    }
    out[pos] = value;
  }
  if (threadIdx.x == 0) p.num_accepted[b] = t_star;
}

// Lowest index of the row maximum, -1 without a valid logit (block-wide). A slow path: the
// stream keeps argmaxes for greedy requests only, and random ones need one only when q
// minus the rejected draft has no mass (q a point mass).
template <typename T>
__device__ int row_argmax(const T* row, int limit, RsShared& sm) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  float best = -INFINITY;
  int index = INT_MAX;
  for (int i = threadIdx.x; i < limit; i += kRsThreads) {
    const float v = sanitize(load_value(row + i));
    if (v > best) {
      best = v;
      index = i;
    }
  }
  const float m = warp_max(best);
  index = warp_min(best == m ? index : INT_MAX);
  if (lane == 0) {
    sm.reduce_max[warp] = m;
    sm.reduce_index[warp] = index;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float mm = -INFINITY;
    int a = INT_MAX;
#pragma unroll
    for (int w = 0; w < kRsWarps; ++w) {
      if (sm.reduce_max[w] > mm) {
        mm = sm.reduce_max[w];
        a = sm.reduce_index[w];
      } else if (sm.reduce_max[w] == mm) {
        a = min(a, sm.reduce_index[w]);
      }
    }
    sm.argmax = mm > -INFINITY ? a : -1;
  }
  __syncthreads();
  return sm.argmax;
}

}  // namespace rs_detail
}  // namespace specdec
