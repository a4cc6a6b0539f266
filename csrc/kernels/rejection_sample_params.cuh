// The chain kernel's contract with the host: its limits and plan constants, the records of its
// work units, the parameters a launch takes (RejectionSampleParams, filled by
// bindings/chain_cuda.cu) and the host plan (plan_rejection_sample: how a call is cut into work
// units, computed without a GPU).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/common.cuh"

namespace specdec {

constexpr int kRsMaxSplits = 64;     // a row's records are combined by one warp, two per lane
constexpr int kRsMaxUnitTiles = 16;  // a unit's race noise lives in shared memory (4 KB)
constexpr int kRsMaxUnitChunks = kRsMaxUnitTiles * kRsTileChunks;
constexpr int64_t kRsMaxVocab = int64_t{kRsMaxSplits} * kRsMaxUnitTiles * kRsTileEntries;
// Units per resident CTA the plan aims for: small units keep the last wave short.
constexpr int kRsUnitsPerSlot = 2;
// Batches whose rows alone fill a wave of resident CTAs aim at this many units per CTA instead
// (plan_rejection_sample's shipped rules).
constexpr int kRsUnitsPerSlotLarge = 4;
// The longest units the one-wave rule makes (tiles): the rule pays only while its units stay
// this short (docs/DECISIONS.md#cuda-one-wave-cap).
constexpr int kRsOneWaveMaxTiles = 3;

// One phase-1 unit's statistics of its split of a row: two 16-byte accesses.
struct __align__(16) RsSplitRecord {
  float row_max;     // max of the sanitized logits of the split (-inf: no valid logit)
  float exp_sum;     // sum of exp2((l - row_max) * k) (random requests only)
  int32_t argmax;    // lowest index of row_max, greedy requests only (else -1)
  float race_score;  // best chunk race score relative to row_max (-inf: no mass / greedy)
  int32_t draft;     // split 0 of a row t < n: the draft x_t if it is in [0, V), else -1
  float draft_logit;  // split 0: sanitized l_t(x_t) (-inf when x_t or the row is invalid)
  float draft_prob;   // split 0: p_t(x_t) (1 for deterministic drafts, 0 when x_t is invalid)
  int32_t candidate;  // the race winner's in-chunk sample (-1: none)
};

// One phase-2 unit's race winner on the residual (absolute scale).
struct __align__(8) RsResidualRecord {
  float race_score;
  int32_t candidate;
};

// Verification methods (docs/ALGORITHM.md §1 and §6); the kernel is a template on them.
enum RsMethod : int32_t {
  kRsMethodToken = 0,  // draft by draft
  kRsMethodBlock = 1,  // block verification (Sun et al. 2024)
};

// The work decomposition, computed on the host (plan_rejection_sample).
struct RejectionSamplePlan {
  int32_t num_chunks;
  int32_t num_tiles;
  int32_t num_splits;
  int32_t tiles_per_split;
  int32_t residual_splits;
  int32_t residual_tiles_per_split;
  // Rows whose residual phase 2 streams per request: 1 (token: the rejected row), or
  // max(max_spec_len, 1) (block verification with draft probabilities: every draft row).
  int32_t residual_rows;
  // 1: every unit is resident at once (small batches with draft probabilities), so phase-2 units
  // wait for most of phase 1; they prefetch the draft-probability tiles they may read into L2.
  int32_t prefetch_residual;
  int64_t units_phase1;
  int64_t units_total;
  int64_t num_counters;
  int64_t num_split_records;
  int64_t num_residual_records;  // num_requests * residual_rows * residual_splits, or 0
  int64_t num_residual_masses;   // the same count for block verification, else 0
};

struct RejectionSampleParams {
  const void* target_logits;  // [num_rows, vocab] T, unit stride along the vocabulary
  int64_t logits_row_stride;  // in elements
  bool logits_vectorized;     // base and row stride 16-byte aligned: segments are cp.async
  const void* draft_token_ids;  // [num_drafts] int32 / int64
  bool draft_ids_int64;
  const void* cu_num_draft_tokens;  // [num_requests + 1] int32 / int64
  bool cu_int64;
  const void* draft_probs;  // [num_drafts, vocab] P, or nullptr
  int64_t draft_probs_row_stride;
  bool probs_vectorized;
  const void* temperature;  // [num_requests], dtype temperature_dtype
  int32_t temperature_dtype;
  const void* seeds;  // [num_requests] int32 / int64
  bool seeds_int64;
  const void* offsets;  // [num_requests] int32 / int64, or nullptr (offset 0)
  bool offsets_int64;
  // Per-request lenience in (0, 1] (docs/ALGORITHM.md §8), float32 [num_requests], or nullptr:
  // exact for every request. Read by the finalizers' decisions and phase 2 only, never in a
  // stream loop; l = 1 gives the exact op's tokens bit for bit. Token method only.
  const float* lenience;
  int32_t* output_token_ids;  // [num_requests, max_spec_len + 1]
  int32_t* num_accepted;      // [num_requests]
  // Workspace. counters [2 * num_requests + 2], zero between calls: per-request phase-1 and
  // phase-2 completion counts, then the ticket and the finished count.
  int32_t* counters;
  // Sampling filters (docs/ALGORITHM.md §7): the threshold logit of each (request b, row t) at
  // b * (max_spec_len + 1) + t from the threshold pass; logits below it count as -inf (-inf:
  // unfiltered). nullptr: no filters.
  const float* row_thresholds;
  RsSplitRecord* split_records;        // [units_phase1]
  RsResidualRecord* residual_records;  // [num_requests * residual_rows * residual_splits]
  // Block verification with draft probabilities: each phase-2 unit's residual mass
  // sum_x max(P q(x) - p(x), 0) over its split, [num_requests * residual_rows * residual_splits].
  float* residual_masses;
  int64_t num_rows;
  int64_t num_drafts;
  int32_t vocab_size;
  int32_t num_requests;
  int32_t max_spec_len;
  RejectionSamplePlan plan;
};

// ------------------------------------------------------------------------------ host plan

// Splits a row of num_tiles tiles into about `wanted` equal ranges of at most
// kRsMaxUnitTiles tiles, and at most kRsMaxSplits of them.
inline void rs_split_row(int64_t num_tiles, int64_t wanted, int32_t& splits, int32_t& per_split) {
  const int64_t cap = num_tiles < kRsMaxSplits ? num_tiles : kRsMaxSplits;
  const int64_t s = wanted < 1 ? 1 : (wanted > cap ? cap : wanted);
  int64_t per = rs_ceil_div(num_tiles, s);
  if (per > kRsMaxUnitTiles) per = kRsMaxUnitTiles;  // vocab <= kRsMaxVocab keeps splits <= 64
  per_split = static_cast<int32_t>(per);
  splits = static_cast<int32_t>(rs_ceil_div(num_tiles, per));
}

// concurrent_ctas: CTAs the GPU runs at once (SMs x resident CTAs per SM). Rows are split so
// that there are about kRsUnitsPerSlot units per resident CTA (at least one row per unit;
// docs/DECISIONS.md#cuda-units-per-slot).
// units_per_slot_override > 0 (benchmarks: SPECDEC_CUDA_UNITS_PER_SLOT) aims at that many
// instead and turns off the shipped rules; 0, the shipped plan:
// - Large batches (num_rows >= concurrent_ctas) aim at kRsUnitsPerSlotLarge units per resident
//   CTA: the last wave's tail is one unit long, and since units combine their parts with a warp
//   (not thread 0) smaller units cost less than that tail; below a full wave of rows the rule
//   loses, so it is off there (docs/DECISIONS.md#cuda-units-large-batches).
// - Small batches, one wave: without draft probabilities, when those units overflow the
//   resident CTAs but rows split at most twice as coarsely, into units of at most
//   kRsOneWaveMaxTiles tiles, fit in one wave, take that -- a short second wave costs a whole
//   unit's time, and each unit its fixed costs. E.g. B = 8, K = 4, V = 128256 on 132 SMs: 640
//   one-tile units in two waves -> 320 two-tile units in one. Longer units lose, since units
//   start by issuing their tiles (docs/DECISIONS.md#cuda-one-wave-cap). With draft
//   probabilities the rule (phase-1 units only) helps small and hurts middle batches, so it is
//   off there (docs/DECISIONS.md#cuda-one-wave).
inline RejectionSamplePlan plan_rejection_sample(int64_t num_rows, int64_t num_requests, int64_t vocab,
                                                 int64_t max_spec_len, bool has_draft_probs,
                                                 int64_t concurrent_ctas, RsMethod method = kRsMethodToken,
                                                 int64_t units_per_slot_override = 0) {
  const bool shipped_rules = units_per_slot_override <= 0;
  const int64_t units_per_slot = !shipped_rules ? units_per_slot_override
                                 : num_rows >= concurrent_ctas ? kRsUnitsPerSlotLarge : kRsUnitsPerSlot;
  RejectionSamplePlan plan{};
  const int64_t num_chunks = rs_ceil_div(vocab < 1 ? 1 : vocab, kSampleChunk);
  const int64_t num_tiles = rs_ceil_div(num_chunks, kRsTileChunks);
  const int64_t target_units = units_per_slot * concurrent_ctas;
  plan.num_chunks = static_cast<int32_t>(num_chunks);
  plan.num_tiles = static_cast<int32_t>(num_tiles);
  rs_split_row(num_tiles, rs_ceil_div(target_units, num_rows < 1 ? 1 : num_rows), plan.num_splits,
               plan.tiles_per_split);
  const int64_t row_slots = num_requests * (max_spec_len + 1);  // phase-1 units per split
  if (shipped_rules && !has_draft_probs && row_slots > 0 && row_slots * plan.num_splits > concurrent_ctas &&
      concurrent_ctas >= row_slots) {
    int32_t splits = 0, per_split = 0;
    rs_split_row(num_tiles, concurrent_ctas / row_slots, splits, per_split);
    if (row_slots * splits <= concurrent_ctas && per_split <= 2 * plan.tiles_per_split &&
        per_split <= kRsOneWaveMaxTiles) {
      plan.num_splits = splits;
      plan.tiles_per_split = per_split;
    }
  }
  plan.units_phase1 = row_slots * plan.num_splits;
  plan.units_total = plan.units_phase1;
  plan.residual_rows = 1;
  const bool block_residuals = has_draft_probs && method == kRsMethodBlock;
  if (has_draft_probs) {
    // Token verification reads the rejected row of each request again with its draft row;
    // block verification needs the residual mass of every draft row (docs/ALGORITHM.md §6).
    // Split those rows too.
    if (block_residuals) plan.residual_rows = static_cast<int32_t>(max_spec_len < 1 ? 1 : max_spec_len);
    const int64_t residual_rows = num_requests * plan.residual_rows;
    rs_split_row(num_tiles, rs_ceil_div(target_units, residual_rows < 1 ? 1 : residual_rows), plan.residual_splits,
                 plan.residual_tiles_per_split);
    plan.units_total += residual_rows * plan.residual_splits;
    plan.prefetch_residual = plan.units_total <= concurrent_ctas ? 1 : 0;
  }
  plan.num_counters = 2 * num_requests + 2;
  plan.num_split_records = plan.units_phase1;
  plan.num_residual_records = has_draft_probs ? num_requests * plan.residual_rows * plan.residual_splits : 0;
  plan.num_residual_masses = block_residuals ? plan.num_residual_records : 0;
  return plan;
}

}  // namespace specdec
