// Fused chain verification (docs/ALGORITHM.md): one launch per call, torch-free.
//
// Work units, numbered like the Triton kernel (specdec_kernels/triton/chain.py):
//   phase 1: unit (request b, row t, split s), t = 0..max_spec_len; units with t > n_b exit.
//            Streams tiles [s * tiles_per_split, ...) of target row cu[b] + b + t once and
//            writes an RsSplitRecord: max, sum of exp2((l - max) k), greedy argmax, and for
//            random requests the split's winner of the chunk race with its in-chunk
//            inverse-CDF sample; split 0 also the draft x_t, l(x_t) and p(x_t), so the
//            decision needs no dependent loads. For deterministic drafts row t < n_b leaves
//            x_t out of its sample (that is the residual).
//   phase 2: only with draft probabilities: unit (request b, residual split s). Waits for the
//            request's phase 1, recomputes the (cheap) decision and samples its split of the
//            one rejected row from max(0, q - p) the same way (RsResidualRecord).
// The unit that finishes a request last (an atomic counter per request) combines the records,
// runs the accept tests, writes the outputs and resets the counter, so the cached workspace
// is zero between calls (CUDA graphs); it reads nothing but records. With draft
// probabilities units are handed out by an atomic ticket in the order CTAs start, so a
// phase-2 unit only waits for phase-1 units that already run: no deadlock.
//
// Block verification (docs/ALGORITHM.md §6; the kernel is a template on RsMethod, so the token
// instances compile none of it) changes only the decision and phase 2. Deterministic
// drafts: the finalizer's decide_block computes tau from the same records (R_i is a scalar),
// and row tau's recorded sample is the residual. Draft probabilities: phase-2 units are
// (request b, draft row r, split s); each computes P_r (decide_block over rows 0..r), streams
// its split of max(0, P_r q_r - p_r) and records its race winner and its mass; the last one
// sums each row's masses into R_r, picks tau and takes row tau's residual winner.
//
// The chunk race (docs/ALGORITHM.md §3) runs in the stream rather than over a table of row
// t* afterwards: the same scores and winner (up to float rounding), no table traffic, and the
// request's last unit reads nothing but records. Each lane group races the chunks it streams,
// in increasing order, relative to its running max (branch-free: score and chunk); at the end
// the unit combines the groups and one warp locates the inverse-CDF sample inside the unit's
// winning chunk, from the staging buffers while its tile is still there, else from global
// memory (L2). The noise (u_c, log2(-log2(v_c))) of a unit's chunks is precomputed into
// shared memory.
//
// One CTA of 256 threads per unit. A tile is 32 chunks of 256 logits; lane group g (a
// quarter-warp, threads 8g .. 8g + 7) holds chunk g, 32 logits per lane as 4 segments of 8
// consecutive logits (one 16-byte load of bf16 / fp16, two of fp32; a group's load covers 128
// contiguous bytes). So a chunk's max and sum are 3-step shuffle reductions that one warp
// instruction does for 4 chunks, the per-chunk race costs a few instructions per 32 logits,
// and the streaming loop has no CTA barrier: about 8 instructions per logit in all (4 of
// them the conversion, the exp2 as one FMA + MUFU, and the sum). Tiles are staged through
// shared memory with cp.async (sm_80+), each thread copying and reading back only its own
// segments (no barrier either), so no registers hold data in flight: with 16-bit logits two
// tiles (32 KB) are in flight per CTA while one is processed, and 4 CTAs per SM (64
// registers) keep up to 128 KB in flight per SM. Rare paths (NaN / +inf logits, the excluded
// draft) recompute weights from the staged tile instead of keeping them in registers.
//
// Files (csrc/kernels/README.md has the map): the pieces shared with the tree kernel are
// common.cuh, pdl.cuh, philox.cuh, elements.cuh, warp.cuh, stream.cuh and chunk_sampling.cuh;
// the chain kernel's own are rejection_sample_params.cuh (limits, records, launch parameters,
// host plan), rejection_sample_records.cuh (CTA state, combining records, the decisions, the
// outputs), rejection_sample_trace.cuh (profiling build) and this file (stream configuration,
// phase 1, phase 2, the kernel and its launchers).
#pragma once

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
#include "kernels/rejection_sample_params.cuh"
#include "kernels/rejection_sample_records.cuh"
#include "kernels/rejection_sample_trace.cuh"
#include "kernels/stream.cuh"
#include "kernels/warp.cuh"

// Tiles of 16-bit logits staged per CTA without draft probabilities (tuning macro:
// SPECDEC_NVCC_FLAGS=-D...; 3 keeps 4 CTAs per SM; docs/DECISIONS.md#cuda-staging-depth).
#ifndef SPECDEC_CHAIN_STREAM_STAGES_16BIT
#define SPECDEC_CHAIN_STREAM_STAGES_16BIT 3
#endif

namespace specdec {
namespace rs_detail {

// ------------------------------------------------ stream configuration, race noise, race leads

// Per instance: pipeline depths, shared memory and CTAs per SM.
//  - deterministic drafts, 16-bit logits: 3 stages of 16 KB tiles (two in flight while one
//    is processed), 4 CTAs per SM (64 registers); fp32 logits: 2 stages of 32 KB, 3 CTAs;
//  - draft probabilities: phase 2 stages one tile of each of its two rows at a time (a tile
//    of logits + one of probabilities, 32-64 KB); phase 1 uses the same staging memory for as
//    many tiles as fit; 3 CTAs per SM (80 registers).
template <typename T, typename P>
struct RsConfig {
  static constexpr bool kHasDraftProbs = !std::is_same<P, NoDraftProbs>::value;
  static constexpr int kTileBytes = kRsTileEntries * static_cast<int>(sizeof(T));
  static constexpr int kResidualStages = 1;
  static constexpr int kResidualBytes =
      kHasDraftProbs ? kResidualStages * kRsTileEntries * static_cast<int>(sizeof(T) + sizeof(P)) : 0;
  static constexpr int kStages =
      kHasDraftProbs ? (kResidualBytes / kTileBytes > 2 ? kResidualBytes / kTileBytes : 2)
                     : (sizeof(T) == 2 ? SPECDEC_CHAIN_STREAM_STAGES_16BIT : 2);
  static constexpr int kSmemBytes = kStages * kTileBytes > kResidualBytes ? kStages * kTileBytes : kResidualBytes;
  static constexpr int kMinBlocksPerSM = (!kHasDraftProbs && sizeof(T) == 2 && kStages <= 3) ? 4 : 3;
};

// Race noise of chunks [chunk_lo, chunk_lo + count) of row `node` into sm.noise (count <=
// kRsMaxUnitChunks); read after a barrier.
__device__ __forceinline__ void fill_race_noise(RsShared& sm, const RequestContext& rq, int node, int chunk_lo,
                                                int count) {
  for (int j = threadIdx.x; j < count; j += kRsThreads) {
    const PhiloxBlock w = philox_words(rq.seed, rq.offset, kStreamSample, static_cast<uint32_t>(node),
                                       static_cast<uint32_t>(chunk_lo + j));
    sm.noise[j] = make_float2(uniform_from_word(w.x), log2f(-log2f(open_uniform_from_word(w.y))));
  }
}

// The lane groups' race leads in sm.reduce_*: the highest score after shifting each by (its
// running max - m) k (kScaled), lowest chunk on ties; chunk -1: none.
template <bool kScaled>
__device__ __forceinline__ void warp_combine_chunk_races(const RsShared& sm, float m, float k, float& score,
                                                         int& chunk) {
  static_assert(kRsGroups == 32, "one lane per lane group");
  const int lane = threadIdx.x & 31;
  score = sm.reduce_score[lane];
  if (score > -INFINITY) {
    if (kScaled) score += (sm.reduce_max[lane] - m) * k;
    chunk = sm.reduce_chunk[lane];
  } else {
    score = -INFINITY;
    chunk = INT_MAX;
  }
  int unused = 0;
  warp_race_winner(score, chunk, unused);
  if (score == -INFINITY) chunk = -1;
}

// The end of a phase-1 unit: its record, its count, and the request's finalization by the last
// unit (deterministic drafts and greedy requests; phase 2 finalizes the others).
template <typename T, typename P, RsMethod kMethod>
__device__ __forceinline__ void finish_phase1_unit(const RejectionSampleParams& p, RsShared& sm, int unit, int b,
                                                   const RequestContext& rq, float m, float s, int argmax,
                                                   float score, int draft, int candidate) {
  constexpr bool kHasDraftProbs = !std::is_same<P, NoDraftProbs>::value;
  RS_TRACE(kRsTraceCombined, candidate + __float_as_uint(s) + __float_as_uint(score));
  if (threadIdx.x == 0) {
    float4* rec = reinterpret_cast<float4*>(p.split_records + static_cast<int64_t>(unit));
    __stcg(rec, make_float4(m, s, __int_as_float(argmax), score));
    __stcg(rec + 1, make_float4(__int_as_float(draft), sm.draft_logit, sm.draft_prob, __int_as_float(candidate)));
    // Release the record and count it; the last unit of the request finalizes it.
    const int done = count_unit(p.counters + b);
    RS_TRACE(kRsTraceCounted, done);
    sm.is_last = done == (rq.n + 1) * p.plan.num_splits - 1;
  }
  __syncthreads();
  // With draft probabilities random requests are finalized by their phase-2 units.
  if (sm.is_last && (!kHasDraftProbs || rq.greedy)) {
    const int32_t out_draft = preload_output_draft(p, rq);
    if constexpr (kMethod == kRsMethodBlock && !kHasDraftProbs) {
      // Point-mass drafts: R_i comes from the accept-test operands, and the sample of row tau
      // (its draft left out when tau < n') is already in its records.
      if (rq.greedy) {
        decide_request(p, b, sm);
      } else {
        decide_block<false, true>(p, b, sm, rq.n);
      }
    } else {
      decide_request(p, b, sm);
    }
    const RequestContext rq = sm.rq;
    const int t_star = sm.t_star;
    int token = rq.greedy ? sm.argmax_star : sm.sample_star;
    RS_TRACE(kRsTraceDecided, t_star + token);
    if (!rq.greedy && token < 0) {
      // Deterministic drafts: q minus the rejected draft is empty only if q is a point mass,
      // which is then the argmax (-1 for a row without a valid logit).
      const int64_t row_star = rq.cu_lo + b + t_star;
      const bool star_ok = row_star >= 0 && row_star < p.num_rows;
      token = row_argmax(static_cast<const T*>(p.target_logits) + (star_ok ? row_star : 0) * p.logits_row_stride,
                         star_ok ? p.vocab_size : 0, sm);
    }
    write_outputs(p, rq, b, t_star, token, out_draft);
    RS_TRACE(kRsTraceFinalized, token);
    if (threadIdx.x == 0) p.counters[b] = 0;
  }
}

// -------------------------------------------------------------------------------- phase 1

// kFiltered: the instance for calls with sampling filters (p.row_thresholds set); the
// unfiltered instance compiles none of the filter paths.
template <typename T, typename P, RsMethod kMethod, bool kFiltered>
__device__ void phase1_unit(const RejectionSampleParams& p, RsShared& sm, int unit) {
  constexpr bool kHasDraftProbs = !std::is_same<P, NoDraftProbs>::value;
  constexpr int kStages = RsConfig<T, P>::kStages;
  constexpr int kE = kRsLaneEntries;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int width = p.max_spec_len + 1;
  const int split = unit % p.plan.num_splits;
  const int row_unit = unit / p.plan.num_splits;
  const int b = row_unit / width;
  const int t = row_unit % width;
  // Sampling filters: the row's threshold, loaded before and alongside the request's fields (it
  // does not depend on them; slot < B (K + 1) for every unit).
  const int64_t slot = static_cast<int64_t>(b) * width + t;
  float row_thr = -INFINITY;
  if constexpr (kFiltered) row_thr = p.row_thresholds[slot];
  const int tile_lo = split * p.plan.tiles_per_split;
  const int tile_hi = min(tile_lo + p.plan.tiles_per_split, p.plan.num_tiles);
  // The request's fields (and the guessed draft id below) go out before the first tiles: behind
  // them, they would wait for them. They are decoded after the tiles are issued.
  const RequestWords rq_words = load_request_words(p, b);
  // Uniform batches (every request has max_spec_len drafts: num_drafts == B * max_spec_len,
  // which well-formed offsets imply) hold row (b, t) at b (K + 1) + t and its draft at b K + t.
  // The first tiles and the draft id then go out with the request's fields rather than after
  // them (a global round trip; docs/DECISIONS.md#cuda-rows-before-offsets); the fields
  // confirm the guess, and a miss (malformed offsets only) waits for the guessed copies and
  // issues the row's own.
  const bool uniform = !kFiltered && p.num_drafts == static_cast<int64_t>(p.num_requests) * p.max_spec_len;
  const int64_t guess_row = uniform && slot < p.num_rows ? slot : -1;
  const int64_t guess_draft = static_cast<int64_t>(b) * p.max_spec_len + t;
  TileStream<T, kStages, 0> stream{static_cast<const T*>(p.target_logits) + (guess_row >= 0 ? guess_row : 0) *
                                                                                   p.logits_row_stride,
                                   guess_row >= 0 ? p.vocab_size : 0, p.logits_vectorized, ElemBits<T>::kNegInf};
  int64_t guess_x = -1;
  if (uniform && t < p.max_spec_len && guess_draft < p.num_drafts) {
    guess_x = load_index(p.draft_token_ids, p.draft_ids_int64, guess_draft);
  }
  const auto issue = [&](int tile, int stage) { stream.issue(tile, stage); };
  if (guess_row >= 0) issue_first_tiles<kStages>(tile_lo, tile_hi, issue);

  const RequestContext rq = decode_request(p, rq_words);
  RS_TRACE(kRsTraceRequest, rq.n + static_cast<uint32_t>(rq.seed) + __float_as_uint(rq.k));
  if (t > rq.n) {
    cp_async_wait<0>();  // a guessed stream's copies land before the CTA leaves
    return;
  }

  const int64_t row = rq.cu_lo + b + t;
  const bool row_ok = row >= 0 && row < p.num_rows;
  const int limit = row_ok ? p.vocab_size : 0;
  const T* row_ptr = static_cast<const T*>(p.target_logits) + (row_ok ? row : 0) * p.logits_row_stride;
  const float k = rq.k;
  // The threshold (-inf: unfiltered; greedy rows ignore the filters).
  const float thr = rq.greedy ? -INFINITY : row_thr;
  if (!(guess_row >= 0 && row == guess_row)) {
    cp_async_wait<0>();
    stream.row = row_ptr;
    stream.limit = limit;
    issue_first_tiles<kStages>(tile_lo, tile_hi, issue);
  }

  // While the first tiles arrive: the draft of this row. Split 0 records it with l(x) and
  // p(x) for the accept test (thread 0 loads them; they hit lines the stream reads anyway),
  // and deterministic drafts leave it out of the row's sample.
  int draft = -1;
  if (t < rq.n && (split == 0 || (!kHasDraftProbs && !rq.greedy))) {
    const int64_t d = rq.cu_lo + t;
    if (d >= 0 && d < p.num_drafts) {
      const int64_t x = uniform && d == guess_draft ? guess_x : load_index(p.draft_token_ids, p.draft_ids_int64, d);
      if (x >= 0 && x < p.vocab_size) draft = static_cast<int>(x);
    }
  }
  // Thread 0 stores them to shared memory only after the next barrier (random rows) or before
  // its stream (greedy rows), so that no barrier waits for these loads.
  float draft_logit = -INFINITY, draft_prob = 1.0f;
  if (threadIdx.x == 0) {
    sm.rq = rq;
    if (split == 0 && t < rq.n) {
      // (-inf below the filter threshold: q(x) = 0, the draft is rejected)
      if (draft >= 0 && row_ok) draft_logit = sanitize_below(load_value(row_ptr + draft), thr);
      if constexpr (kHasDraftProbs) {
        draft_prob = draft >= 0 ? load_value(static_cast<const P*>(p.draft_probs) +
                                             (rq.cu_lo + t) * p.draft_probs_row_stride + draft)
                                : 0.0f;
      }
    }
  }
  const auto store_draft_operands = [&] {
    if (threadIdx.x == 0) {
      sm.draft_logit = draft_logit;
      sm.draft_prob = draft_prob;
    }
  };

  const int group = threadIdx.x / kRsChunkLanes;  // this thread's chunk of a tile
  const int gl = threadIdx.x % kRsChunkLanes;
  using Seg = Segment<T, kE>;
  if (rq.greedy) {
    store_draft_operands();
    // Per-lane running max and its first index (stream.cuh, greedy_tile).
    float run_max = -INFINITY;
    int run_arg = INT_MAX;
    pipeline_tiles<kStages>(tile_lo, tile_hi, issue, [&](int tile, int stage) {
      greedy_tile(stream, tile, stage, group, run_max, run_arg);
    });
    RS_TRACE(kRsTraceStreamed, __float_as_uint(run_max));
    const float wm = warp_max(run_max);
    const int arg = warp_min(run_max == wm ? run_arg : INT_MAX);
    if (lane == 0) {
      sm.reduce_max[warp] = wm;
      sm.reduce_index[warp] = arg;
    }
  } else {
    // Per lane group running max, sum and race lead over its chunks (uniform over the group).
    const int excluded = kHasDraftProbs ? -1 : draft;
    const int excluded_chunk = excluded >= 0 ? excluded / kSampleChunk : -1;
    const int excluded_tile = excluded >= 0 ? excluded_chunk / kRsTileChunks : -1;
    const int chunk_lo = tile_lo * kRsTileChunks;
    fill_race_noise(sm, rq, t, chunk_lo, min(tile_hi * kRsTileChunks, p.plan.num_chunks) - chunk_lo);
    __syncthreads();
    store_draft_operands();
    float run_max = -INFINITY, run_sum = 0.0f, race = -INFINITY;
    int race_chunk = INT_MAX;
    // A filtered row (CTA-uniform) takes a plain per-entry path: logits below thr count as -inf.
    const bool filtered = kFiltered && thr > -INFINITY;
    pipeline_tiles<kStages>(tile_lo, tile_hi, issue, [&](int tile, int stage) {
      const int chunk = tile * kRsTileChunks + group;
      Seg seg[kRsLaneSegments];
#pragma unroll
      for (int h = 0; h < kRsLaneSegments; ++h) seg[h] = stream.segment(stage, h);
      // The chunk max (sanitized, filtered), its mass without the excluded draft, and with it.
      float m, mass, full;
      if (filtered) {
        m = masked_chunk_max(seg, thr);
        const float m_safe = m > -INFINITY ? m : 0.0f;
        float lane_mass = 0.0f, lane_excluded = 0.0f;
#pragma unroll
        for (int h = 0; h < kRsLaneSegments; ++h) {
#pragma unroll
          for (int j = 0; j < kE; ++j) {
            const float x = sanitize_below(segment_value(seg[h], j), thr);
            const float w = x > -INFINITY ? exp2f((x - m_safe) * k) : 0.0f;
            if (entry_index(chunk, h, j) == excluded) {
              lane_excluded += w;
            } else {
              lane_mass += w;
            }
          }
        }
        mass = group_sum(lane_mass);
        full = mass + group_sum(lane_excluded);
      } else {
        float lane_max = -INFINITY;
#pragma unroll
        for (int h = 0; h < kRsLaneSegments; ++h) lane_max = fmaxf(lane_max, segment_max(seg[h]));
        m = group_max(fminf(lane_max, FLT_MAX));  // the chunk max (sanitized)
        // exp2((l - m) k) as one FMA, exp2(l k - m k), while m k is small: its float rounding
        // (|m k| 2^-24, one factor for the whole chunk, but a different one per chunk) stays
        // below 2^-16, as accurate as (l - m) k. Larger |m k| (tiny temperatures: T = 1e-6 makes
        // m k ~ 1e7, rounded by up to 0.5, a factor of up to 1.41 between chunks) use the exact
        // form. A chunk without a valid logit gets weights 0 from m = 0 (-inf entries; NaNs are
        // fixed below).
        const float mk = (m > -INFINITY ? m : 0.0f) * k;
        const bool fma_exact = fabsf(mk) <= 256.0f;  // uniform over the lane group
        const auto weight = [=](float v) { return exp2f(fma_exact ? fmaf(v, k, -mk) : (v - m) * k); };
        mass = lane_chunk_mass(seg, m, k, mk, fma_exact);
        // This lane's weights of segment h as the sample uses them, recomputed from the tile:
        // NaN logits (weight NaN) -> 0, +inf logits (weight inf) -> 1, the excluded draft -> 0.
        const auto segment_weights = [=](int h, float(&w)[kE]) {
          const Seg sg = *TileStream<T, kStages, 0>::slot(stage, h);
#pragma unroll
          for (int j = 0; j < kE; ++j) {
            const float x = weight(segment_value(sg, j));
            w[j] = (is_nan(x) || entry_index(chunk, h, j) == excluded) ? 0.0f : fminf(x, 1.0f);
          }
        };
        // Each weight is about <= 1: a larger sum means a NaN or +inf logit in this lane. Rare,
        // like the chunk holding a deterministic draft (its weight leaves the sample, not the
        // softmax sum): recompute the lane's mass from the sanitized weights.
        float excluded_w = 0.0f;
        if (!(__float_as_uint(mass) <= __float_as_uint(2.0f * kRsLaneSegments * kE)) || chunk == excluded_chunk) {
          mass = 0.0f;
#pragma unroll 1
          for (int h = 0; h < kRsLaneSegments; ++h) {
            float w[kE];
            segment_weights(h, w);
#pragma unroll
            for (int j = 0; j < kE; ++j) mass += w[j];
          }
          const int jx = excluded - entry_index(chunk, 0, 0);
          if (chunk == excluded_chunk && jx >= 0 && jx % (kRsChunkLanes * kE) < kE) {
            // One element at a run-time position: a scalar shared-memory load.
            const T* e = reinterpret_cast<const T*>(TileStream<T, kStages, 0>::slot(stage, jx / (kRsChunkLanes * kE)));
            const float x = weight(shared_value(e + jx % kE));
            excluded_w = is_nan(x) ? 0.0f : fminf(x, 1.0f);
          }
        }
        mass = group_sum(mass);
        full = tile == excluded_tile ? mass + group_sum(excluded_w) : mass;
      }
      // The race relative to the running max (docs/ALGORITHM.md §3: shift by (m_c - M) k).
      const float new_max = fmaxf(run_max, m);
      const float old_score = run_max > -INFINITY ? race + (run_max - new_max) * k : -INFINITY;
      const float2 noise = sm.noise[chunk - chunk_lo];
      const float new_score = mass > 0.0f ? (log2f(mass) - noise.y) + (m - new_max) * k : -INFINITY;
      // The group's lead (chunks increase: the first one wins ties); the unit samples inside
      // its winning chunk once, at the end.
      const bool take = new_score > old_score;
      race = take ? new_score : old_score;
      race_chunk = take ? chunk : race_chunk;
      if (m > run_max) {
        run_sum = run_sum * exp2f((run_max - m) * k) + full;  // 0 while run_max = -inf
      } else if (m > -INFINITY) {
        run_sum += full * exp2f((m - run_max) * k);
      }
      run_max = new_max;
    });
    RS_TRACE(kRsTraceStreamed, __float_as_uint(run_sum));
    if (gl == 0) {
      sm.reduce_max[group] = run_max;
      sm.reduce_sum[group] = run_sum;
      sm.reduce_score[group] = race;
      sm.reduce_chunk[group] = race_chunk;
    }
  }

  __syncthreads();
  RS_TRACE(kRsTraceWaited, 0);
  // Combine the parts (warps for greedy rows, lane groups for random ones), warp 0; it samples
  // in a random row's winning chunk, reading it again.
  float m = -INFINITY, s = 0.0f, score = -INFINITY;
  int a = INT_MAX, candidate = -1;
  if (warp == 0) {
    if (rq.greedy) {
      warp_combine_max_index(sm.reduce_max, sm.reduce_index, kRsWarps, m, a);
    } else {
      int chunk = -1;
      warp_combine_max_sum(sm.reduce_max, sm.reduce_sum, kRsGroups, k, m, s);
      warp_combine_chunk_races<true>(sm, m, k, score, chunk);
      if (chunk >= 0) {
        const int excluded = kHasDraftProbs ? -1 : draft;
        candidate = warp_sample_chunk(stream.chunk_segment(chunk, tile_lo, tile_hi), chunk, k, excluded,
                                      sm.noise[chunk - tile_lo * kRsTileChunks].x, thr);
      }
    }
  }
  finish_phase1_unit<T, P, kMethod>(p, sm, unit, b, rq, m, s, (rq.greedy && m > -INFINITY) ? a : -1, score, draft,
                                    candidate);
}

// -------------------------------------------------------------------------------- phase 2

template <typename T, typename P, RsMethod kMethod, bool kFiltered>
__device__ void phase2_unit(const RejectionSampleParams& p, RsShared& sm, int unit) {
  constexpr bool kBlock = kMethod == kRsMethodBlock;
  constexpr int kE = kRsLaneEntries;
  constexpr int kStages = RsConfig<T, P>::kResidualStages;
  using LogitStream = TileStream<T, kStages, 0>;
  using ProbStream = TileStream<P, kStages, LogitStream::kBytes>;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int r = unit - p.plan.units_phase1;
  // Unit (request b, residual row, split): token verification has one residual row per request
  // (the rejected one, known after the decision), block verification one per draft row.
  const int units_per_request = kBlock ? p.plan.residual_rows * p.plan.residual_splits : p.plan.residual_splits;
  const int b = r / units_per_request;
  const int residual_row = kBlock ? (r % units_per_request) / p.plan.residual_splits : 0;
  const int split = r % p.plan.residual_splits;
  {
    const RequestContext rq = load_request(p, b);
    RS_TRACE(kRsTraceRequest, rq.n + static_cast<uint32_t>(rq.seed) + __float_as_uint(rq.k));
    if (rq.greedy) return;  // finalized by its last phase-1 unit
    if (threadIdx.x == 0) sm.rq = rq;  // for the decision, rather than registers across it
    if (p.plan.prefetch_residual) {
      // While phase 1 runs: this unit's tiles of the draft-probability rows its residual may read
      // (token verification: any draft row, the rejected one is not known yet; block
      // verification: its own row) into L2. The target rows are there from phase 1's stream.
      const int tile_lo = split * p.plan.residual_tiles_per_split;
      const int tile_hi = min(tile_lo + p.plan.residual_tiles_per_split, p.plan.num_tiles);
      const int t_lo = kBlock ? residual_row : 0;
      const int t_hi = kBlock ? min(residual_row + 1, rq.n) : rq.n;
      for (int t = t_lo; t < t_hi; ++t) {
        const int64_t d = rq.cu_lo + t;
        if (d >= 0 && d < p.num_drafts) {
          prefetch_tiles_l2(static_cast<const P*>(p.draft_probs) + d * p.draft_probs_row_stride, p.vocab_size, tile_lo,
                            tile_hi);
        }
      }
    }
  }

  // Wait for the request's phase 1 (those units hold lower tickets: they already run). Block
  // verification's units past the chain wait too: any unit may be the one that finalizes.
  if (threadIdx.x == 0) {
    const int need = (sm.rq.n + 1) * p.plan.num_splits;
    unsigned sleep_ns = 32;
    while (load_acquire(p.counters + b) < need) {  // acquires the phase-1 records
      __nanosleep(sleep_ns);
      if (sleep_ns < 1024) sleep_ns *= 2;
    }
    RS_TRACE(kRsTraceWaited, need);
  }
  __syncthreads();
  int t_star;             // the row this unit streams
  float max_star, sum_star;  // its statistics
  float residual_scale;    // P of block verification (1 for token verification)
  bool in_chain;           // the row's residual is part of the decision (records must be written)
  if constexpr (kBlock) {
    // Row residual_row's residual max(0, P q - p), P = the joint ratio of the drafts before it;
    // rows from n' on (past an invalid draft, or past n) have none.
    t_star = residual_row;
    in_chain = false;
    residual_scale = 1.0f;
    max_star = -INFINITY;
    sum_star = 0.0f;
    if (residual_row < sm.rq.n) {
      decide_block<true, false>(p, b, sm, residual_row);
      in_chain = residual_row < sm.block_end;
      residual_scale = sm.block_scale;
      max_star = sm.max_star;
      sum_star = sm.sum_star;
    }
  } else {
    decide_request(p, b, sm);
    t_star = sm.t_star;
    max_star = sm.max_star;
    sum_star = sm.sum_star;
    residual_scale = 1.0f;
    // An invalid draft id at t* ends the chain with nothing to subtract: q's sample is final.
    in_chain = t_star < sm.rq.n && sm.x_star >= 0;
  }
  const RequestContext rq = sm.rq;
  const int64_t row = rq.cu_lo + b + t_star;
  const bool row_ok = row >= 0 && row < p.num_rows && max_star > -INFINITY;
  const bool needs_residual = in_chain && row_ok;
  // This unit's record slot: (request, residual row, split).
  const int64_t request_slot = kBlock ? static_cast<int64_t>(b) * p.plan.residual_rows + residual_row : b;
  const int64_t slot = request_slot * p.plan.residual_splits + split;
  if (needs_residual) {
    const float k = rq.k;
    // Sampling filters: q is 0 below the row's threshold (-inf: unfiltered).
    const float thr = kFiltered
                          ? p.row_thresholds[static_cast<int64_t>(b) * (p.max_spec_len + 1) + t_star] : -INFINITY;
    // q * P as exp2((l - M) k) * (P / S): P folds into the normalizer (P = 1 for token mode).
    float inv_sum = kBlock ? residual_scale * __frcp_rn(sum_star) : __frcp_rn(sum_star);
    // Lenience (token method): the residual max(0, q - l p) = l max(0, q / l - p), the same law
    // with 1 / l folded into the normalizer (the race and the inverse CDF are scale-free).
    if (!kBlock && p.lenience != nullptr) inv_sum = __fdiv_rn(inv_sum, __ldg(p.lenience + b));
    const int limit = p.vocab_size;
    const int tile_lo = split * p.plan.residual_tiles_per_split;
    const int tile_hi = min(tile_lo + p.plan.residual_tiles_per_split, p.plan.num_tiles);
    const LogitStream logits{static_cast<const T*>(p.target_logits) + row * p.logits_row_stride, limit,
                             p.logits_vectorized, ElemBits<T>::kNegInf};
    const ProbStream probs{static_cast<const P*>(p.draft_probs) + (rq.cu_lo + t_star) * p.draft_probs_row_stride,
                           limit, p.probs_vectorized, 0u};
    const auto issue = [&](int tile, int stage) {
      logits.issue(tile, stage);
      probs.issue(tile, stage);
    };
    issue_first_tiles<kStages>(tile_lo, tile_hi, issue);
    const int chunk_lo = tile_lo * kRsTileChunks;
    fill_race_noise(sm, rq, t_star, chunk_lo, min(tile_hi * kRsTileChunks, p.plan.num_chunks) - chunk_lo);
    __syncthreads();
    const int group = threadIdx.x / kRsChunkLanes;
    const int gl = threadIdx.x % kRsChunkLanes;
    float race = -INFINITY;
    int race_chunk = INT_MAX;
    float unit_mass = 0.0f;  // block verification: the group's residual mass (uniform over the group)
    pipeline_tiles<kStages>(tile_lo, tile_hi, issue, [&](int tile, int stage) {
      const int chunk = tile * kRsTileChunks + group;
      float mass = 0.0f;
#pragma unroll
      for (int h = 0; h < kRsLaneSegments; ++h) {
        const auto lseg = logits.segment(stage, h);
        const auto pseg = probs.segment(stage, h);
#pragma unroll
        for (int j = 0; j < kE; ++j) {
          mass += residual_weight(segment_value(lseg, j), segment_value(pseg, j), max_star, k, inv_sum, thr);
        }
      }
      mass = group_sum(mass);
      if constexpr (kBlock) unit_mass += mass;
      const float2 noise = sm.noise[chunk - chunk_lo];
      const float score = mass > 0.0f ? log2f(mass) - noise.y : -INFINITY;
      const bool take = score > race;
      race = take ? score : race;
      race_chunk = take ? chunk : race_chunk;
    });
    RS_TRACE(kRsTraceStreamed, __float_as_uint(race));
    if (gl == 0) {
      sm.reduce_score[group] = race;
      sm.reduce_chunk[group] = race_chunk;
      if constexpr (kBlock) sm.reduce_sum[group] = unit_mass;
    }
    __syncthreads();
    if (warp == 0) {
      float score = -INFINITY;
      int chunk = -1;
      warp_combine_chunk_races<false>(sm, 0.0f, k, score, chunk);
      int candidate = -1;
      if (chunk >= 0) {
        candidate = warp_sample_residual_chunk(logits.chunk_segment(chunk, tile_lo, tile_hi),
                                               probs.chunk_segment(chunk, tile_lo, tile_hi), chunk, max_star, k,
                                               inv_sum, sm.noise[chunk - chunk_lo].x, thr);
      }
      if (threadIdx.x == 0) {
        __stcg(reinterpret_cast<float2*>(p.residual_records + slot), make_float2(score, __int_as_float(candidate)));
      }
      if constexpr (kBlock) {
        const float split_mass = warp_sum(sm.reduce_sum[lane]);  // lane g: group g
        if (threadIdx.x == 0) __stcg(p.residual_masses + slot, split_mass);
      }
    }
  } else if (kBlock && residual_row < rq.n && threadIdx.x == 0) {
    // No residual to stream (a row past the chain, n' <= row < n, or one without a valid
    // logit): the finalizer reads the masses of every row below n, and the records of row tau.
    __stcg(reinterpret_cast<float2*>(p.residual_records + slot), make_float2(-INFINITY, __int_as_float(-1)));
    __stcg(p.residual_masses + slot, 0.0f);
  }

  if (threadIdx.x == 0) {
    const int done = count_unit(p.counters + p.num_requests + b);
    RS_TRACE(kRsTraceCounted, done);
    sm.is_last = done == units_per_request - 1;
  }
  __syncthreads();
  if (sm.is_last) {
    const int32_t out_draft = preload_output_draft(p, rq);
    bool final_residual = needs_residual;
    if constexpr (kBlock) {
      // Every row's residual mass is in: tau, and the residual of row tau if tau < n'.
      decide_block<true, true>(p, b, sm, rq.n);
      t_star = sm.t_star;
      final_residual = sm.t_star < sm.block_end;
    }
    const int64_t final_slot = kBlock ? static_cast<int64_t>(b) * p.plan.residual_rows + t_star : b;
    const RsResidualRecord* records = p.residual_records + final_slot * p.plan.residual_splits;
    if (threadIdx.x < 32) {
      // q's own sample of row t*: the bonus, an invalid draft's row, or a residual without
      // mass (q == p up to rounding), with the same noise.
      int token = sm.sample_star;
      if (final_residual) {
        float best = -INFINITY;
        int best_split = INT_MAX, best_cand = -1;
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          const int s = lane + 32 * rr;
          if (s < p.plan.residual_splits) {
            const float2 rec = __ldcg(reinterpret_cast<const float2*>(records + s));
            if (rec.x > best) {
              best = rec.x;
              best_split = s;
              best_cand = __float_as_int(rec.y);
            }
          }
        }
        warp_race_winner(best, best_split, best_cand);
        if (best > -INFINITY && best_cand >= 0) token = best_cand;
      }
      if (lane == 0) sm.token = token;
    }
    __syncthreads();
    write_outputs(p, rq, b, t_star, sm.token, out_draft);
    RS_TRACE(kRsTraceFinalized, sm.token);
    if (threadIdx.x == 0) {
      p.counters[b] = 0;
      p.counters[p.num_requests + b] = 0;
    }
  }
}

}  // namespace rs_detail

// ---------------------------------------------------------------------------------- kernel

template <typename T, typename P>
constexpr int rejection_sample_smem_bytes() {
  return rs_detail::RsConfig<T, P>::kSmemBytes;
}

template <typename T, typename P, RsMethod kMethod, bool kFiltered>
__global__ void __launch_bounds__(kRsThreads, rs_detail::RsConfig<T, P>::kMinBlocksPerSM)
    rejection_sample_kernel(const RejectionSampleParams p) {
  constexpr bool kHasDraftProbs = !std::is_same<P, NoDraftProbs>::value;
  __shared__ rs_detail::RsShared sm;
  wait_for_prior_kernels();
  allow_next_kernel_launch();
  RS_TRACE(kRsTraceEntry, 0);
  int unit = static_cast<int>(blockIdx.x);
  if constexpr (kHasDraftProbs) {
    // Tickets in start order: phase-2 units only wait for units that already run.
    if (threadIdx.x == 0) sm.unit = atomicAdd(p.counters + 2 * p.num_requests, 1);
    __syncthreads();
    unit = sm.unit;
  }
  RS_TRACE_UNIT(unit, unit >= p.plan.units_phase1);
  if (unit < p.plan.units_phase1) {
    rs_detail::phase1_unit<T, P, kMethod, kFiltered>(p, sm, unit);
  } else {
    if constexpr (kHasDraftProbs) rs_detail::phase2_unit<T, P, kMethod, kFiltered>(p, sm, unit);
  }
  if constexpr (kHasDraftProbs) {
    if (threadIdx.x == 0) {
      // Every unit has its ticket once the last one finishes: reset ticket and count.
      const int finished = atomicAdd(p.counters + 2 * p.num_requests + 1, 1);
      if (finished == p.plan.units_total - 1) {
        p.counters[2 * p.num_requests] = 0;
        p.counters[2 * p.num_requests + 1] = 0;
      }
    }
  }
}

// Prepares an instance for launches on the current device (its shared-memory limit) and
// returns how many of its CTAs an SM runs at once, for the plan's target grid size.
template <typename T, typename P, RsMethod kMethod = kRsMethodToken, bool kFiltered = false>
cudaError_t rejection_sample_prepare(int* blocks_per_sm) {
  constexpr int kSmem = rejection_sample_smem_bytes<T, P>();
  cudaError_t err = cudaFuncSetAttribute(rejection_sample_kernel<T, P, kMethod, kFiltered>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (err != cudaSuccess) return err;
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks_per_sm, rejection_sample_kernel<T, P, kMethod, kFiltered>,
                                                       kRsThreads, kSmem);
}

// params.plan must come from plan_rejection_sample(..., kMethod); kFiltered iff
// params.row_thresholds is set. pdl: programmatic dependent launch (sm_90+ only).
template <typename T, typename P, RsMethod kMethod = kRsMethodToken, bool kFiltered = false>
cudaError_t launch_rejection_sample(const RejectionSampleParams& params, cudaStream_t stream, bool pdl = false) {
  return launch_with_pdl(rejection_sample_kernel<T, P, kMethod, kFiltered>,
                         static_cast<unsigned int>(params.plan.units_total), kRsThreads,
                         rejection_sample_smem_bytes<T, P>(), stream, pdl, params);
}

}  // namespace specdec
