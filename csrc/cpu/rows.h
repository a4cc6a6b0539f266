// Torch-free row primitives of the CPU kernels (docs/ALGORITHM.md §1-3, §7): a target row's
// chunk table, the chunked categorical sampler, the residual max(0, a q - b p), greedy argmax and
// the sampling filters' threshold. Float32 weights, float64 sums (chunk totals, row sums,
// prefix sums of the inverse CDF) and float64 decisions.
//
// A chunk's weights are always computed by `chunk_q_weights` / `chunk_residual_weights`, the
// same code for the table pass and for the in-chunk inverse CDF, so a chunk that has mass in the
// table has it in the sampler too.
#pragma once

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include "cpu/vec.h"
#include "kernels/philox.cuh"

namespace specdec::cpu {

constexpr int kChunk = 256;  // docs/ALGORITHM.md §3 (SAMPLE_CHUNK)
constexpr double kLog2eD = 1.4426950408889634;

inline int64_t num_chunks(int64_t vocab) { return (vocab + kChunk - 1) / kChunk; }

// One row of V values with unit stride.
template <typename T>
struct Row {
  const T* data = nullptr;  // nullptr: a row without any valid logit (bad index)
  int64_t vocab = 0;
};

// Entries [256 c, 256 c + 256) of a logit row, sanitized and filtered (below thr -> -inf), as
// float32 in buf (padded with -inf); returns their max (-inf if none is valid).
template <typename T>
inline float load_chunk(const Row<T>& row, int64_t c, float thr, float* buf) {
  const int64_t begin = c * kChunk;
  const int64_t n = std::min<int64_t>(kChunk, row.vocab - begin);
  if (n == kChunk) {
    vf m = splat(-INFINITY);
    for (int i = 0; i < kChunk; i += kLanes) {
      const vf v = sanitizev(loadv(row.data + begin + i), thr);
      storev(buf + i, v);
      m = vmax(m, v);
    }
    return hmax(m);
  }
  float m = -INFINITY;
  for (int64_t i = 0; i < n; ++i) {
    buf[i] = sanitize1(to_float(row.data[begin + i]), thr);
    m = buf[i] > m ? buf[i] : m;
  }
  for (int64_t i = n; i < kChunk; ++i) buf[i] = -INFINITY;
  return m;
}

// Entries of a draft-probability row as float32 (padded with 0; NaN kept: the residual drops it).
template <typename P>
inline void load_prob_chunk(const Row<P>& row, int64_t c, float* buf) {
  const int64_t begin = c * kChunk;
  const int64_t n = std::min<int64_t>(kChunk, row.vocab - begin);
  if (n == kChunk) {
    for (int i = 0; i < kChunk; i += kLanes) storev(buf + i, loadv(row.data + begin + i));
    return;
  }
  for (int64_t i = 0; i < n; ++i) buf[i] = to_float(row.data[begin + i]);
  for (int64_t i = n; i < kChunk; ++i) buf[i] = 0.0f;
}

// w_i = exp2((l_i - m) k) of a loaded chunk; returns their sum. m = -inf: all 0.
__attribute__((noinline)) inline double chunk_q_weights(const float* buf, float m, float k, float* w) {
  if (m == -INFINITY) {
    for (int i = 0; i < kChunk; ++i) w[i] = 0.0f;
    return 0.0;
  }
  DoubleAcc acc;
  for (int i = 0; i < kChunk; i += kLanes) {
    const vf e = exp2v((loadv(buf + i) - m) * k);
    storev(w + i, e);
    acc.add(e);
  }
  return acc.sum();
}

// The residual's weights max(alpha q_i - beta p_i, 0) where q_i = exp2((l_i - M) k) inv_sum > 0,
// else 0 (a NaN p gives 0); returns their sum.
__attribute__((noinline)) inline double chunk_residual_weights(const float* lbuf, const float* pbuf, float row_max,
                                                              float k, float inv_sum, float alpha, float beta,
                                                              float* w) {
  DoubleAcc acc;
  for (int i = 0; i < kChunk; i += kLanes) {
    const vf q = exp2v((loadv(lbuf + i) - row_max) * k) * inv_sum;
    const vf r = alpha * q - beta * loadv(pbuf + i);
    const vf out = (vf)((vi)r & (q > splat(0.0f)) & (r > splat(0.0f)));
    storev(w + i, out);
    acc.add(out);
  }
  return acc.sum();
}

// A target row's chunk table: per chunk its max m_c and W_c = sum exp2((l - m_c) k); the row's
// max M and S = sum_c W_c 2^((m_c - M) k) (so q(x) = 2^((l(x) - M) k) / S).
struct RowTable {
  std::vector<float> m;
  std::vector<double> w;
  float row_max = -INFINITY;
  double sum = 0.0;
  float thr = -INFINITY;
  float k = 0.0f;     // float32 log2(e) / T for the weights
  double kd = 0.0;    // float64 log2(e) / T for decisions
};

template <typename T>
inline void build_table(const Row<T>& row, float thr, float k, double kd, RowTable& t) {
  const int64_t nc = num_chunks(row.vocab);
  t.m.assign(nc, -INFINITY);
  t.w.assign(nc, 0.0);
  t.thr = thr;
  t.k = k;
  t.kd = kd;
  t.row_max = -INFINITY;
  t.sum = 0.0;
  if (row.data == nullptr) return;
  alignas(64) float buf[kChunk];
  alignas(64) float w[kChunk];
  for (int64_t c = 0; c < nc; ++c) {
    const float m = load_chunk(row, c, thr, buf);
    t.m[c] = m;
    t.w[c] = chunk_q_weights(buf, m, k, w);
    t.row_max = std::max(t.row_max, m);
  }
  if (t.row_max == -INFINITY) return;
  double s = 0.0;
  for (int64_t c = 0; c < nc; ++c) {
    if (t.w[c] > 0.0) s += t.w[c] * std::exp2((static_cast<double>(t.m[c]) - t.row_max) * kd);
  }
  t.sum = s;
}

// A logit as the kernels read it (sanitized, filtered).
template <typename T>
inline float logit_at(const Row<T>& row, int64_t x, float thr) {
  if (row.data == nullptr) return -INFINITY;
  return sanitize1(to_float(row.data[x]), thr);
}

// q(x) in float64 from the table; 0 for a logit that is -inf.
template <typename T>
inline double q_at(const Row<T>& row, const RowTable& t, int64_t x) {
  const float l = logit_at(row, x, t.thr);
  if (l == -INFINITY || t.sum <= 0.0) return 0.0;
  return std::exp2((static_cast<double>(l) - t.row_max) * t.kd) / t.sum;
}

// Max of the sanitized row and its lowest index (-1, -inf for a row without a valid logit).
template <typename T>
inline int64_t row_argmax(const Row<T>& row, float* max_out) {
  *max_out = -INFINITY;
  if (row.data == nullptr) return -1;
  const int64_t vocab = row.vocab;
  const int64_t full = vocab / kLanes * kLanes;
  vf mv = splat(-INFINITY);
  for (int64_t i = 0; i < full; i += kLanes) mv = vmax(mv, sanitizev(loadv(row.data + i), -INFINITY));
  float m = hmax(mv);
  for (int64_t i = full; i < vocab; ++i) m = std::max(m, sanitize1(to_float(row.data[i]), -INFINITY));
  *max_out = m;
  if (m == -INFINITY) return -1;
  for (int64_t i = 0; i < full; i += kLanes) {
    const vf v = sanitizev(loadv(row.data + i), -INFINITY);
    const vi hit = v == splat(m);
    bool any = false;
    for (int j = 0; j < kLanes; ++j) any |= hit[j] != 0;
    if (any) {
      for (int j = 0; j < kLanes; ++j)
        if (hit[j] != 0) return i + j;
    }
  }
  for (int64_t i = full; i < vocab; ++i)
    if (sanitize1(to_float(row.data[i]), -INFINITY) == m) return i;
  return -1;
}

// The chunk race of docs/ALGORITHM.md §3 over chunk totals (score log2 W_c + shift_c -
// log2(-log2 v_c), lowest chunk on ties, empty chunks out); -1 if every chunk is empty.
template <typename ShiftFn, typename MassFn>
inline int64_t race(int64_t nc, uint64_t seed, uint64_t offset, uint32_t node, MassFn mass, ShiftFn shift) {
  double best = -INFINITY;
  int64_t winner = -1;
  for (int64_t c = 0; c < nc; ++c) {
    const double w = mass(c);
    if (!(w > 0.0)) continue;
    const PhiloxBlock r = philox_words(seed, offset, kStreamSample, node, static_cast<uint32_t>(c));
    const double v = open_uniform_from_word(r.y);
    const double score = std::log2(w) + shift(c) - std::log2(-std::log2(v));
    if (winner < 0 || score > best) {
      best = score;
      winner = c;
    }
  }
  return winner;
}

// Inverse CDF inside chunk c: the smallest entry with w > 0 whose float64 prefix sum reaches u * W.
inline int64_t chunk_inverse_cdf(const float* w, int64_t c, uint64_t seed, uint64_t offset, uint32_t node) {
  const PhiloxBlock r = philox_words(seed, offset, kStreamSample, node, static_cast<uint32_t>(c));
  const double u = uniform_from_word(r.x);
  double total = 0.0;
  for (int i = 0; i < kChunk; ++i) total += w[i];
  const double target = u * total;
  double prefix = 0.0;
  for (int i = 0; i < kChunk; ++i) {
    prefix += w[i];
    if (w[i] > 0.0f && prefix >= target) return c * kChunk + i;
  }
  return -1;
}

// A sample of q (the table's row) with the tokens in `excluded` left out; -1 without mass.
template <typename T>
inline int64_t sample_q(const Row<T>& row, const RowTable& t, const int64_t* excluded, int num_excluded,
                        uint64_t seed, uint64_t offset, uint32_t node) {
  const int64_t nc = static_cast<int64_t>(t.m.size());
  if (t.row_max == -INFINITY) return -1;
  alignas(64) float buf[kChunk];
  alignas(64) float w[kChunk];
  // Chunks holding an excluded token: their totals without it (same weights as the table pass).
  auto chunk_weights = [&](int64_t c) {
    load_chunk(row, c, t.thr, buf);
    for (int e = 0; e < num_excluded; ++e)
      if (excluded[e] >= c * kChunk && excluded[e] < (c + 1) * kChunk) buf[excluded[e] - c * kChunk] = -INFINITY;
    return chunk_q_weights(buf, t.m[c], t.k, w);
  };
  std::vector<std::pair<int64_t, double>> patched;
  for (int e = 0; e < num_excluded; ++e) {
    if (excluded[e] < 0 || excluded[e] >= row.vocab) continue;
    const int64_t c = excluded[e] / kChunk;
    bool seen = false;
    for (const auto& pc : patched) seen |= pc.first == c;
    if (!seen) patched.emplace_back(c, chunk_weights(c));
  }
  auto mass = [&](int64_t c) {
    for (const auto& pc : patched)
      if (pc.first == c) return pc.second;
    return t.w[c];
  };
  auto shift = [&](int64_t c) { return (static_cast<double>(t.m[c]) - t.row_max) * t.kd; };
  const int64_t c = race(nc, seed, offset, node, mass, shift);
  if (c < 0) return -1;
  chunk_weights(c);
  return chunk_inverse_cdf(w, c, seed, offset, node);
}

// The residual max(alpha q - beta p, 0) (0 where q = 0) of a row: per-chunk totals into `mass`
// (may be null) and the total; float32 weights relative to the row max.
template <typename T, typename P>
inline double residual_table(const Row<T>& row, const Row<P>& prow, const RowTable& t, float alpha, float beta,
                             std::vector<double>* mass) {
  const int64_t nc = static_cast<int64_t>(t.m.size());
  if (mass != nullptr) mass->assign(nc, 0.0);
  if (t.row_max == -INFINITY || row.data == nullptr || prow.data == nullptr) return 0.0;
  alignas(64) float lbuf[kChunk];
  alignas(64) float pbuf[kChunk];
  alignas(64) float w[kChunk];
  const float inv_sum = static_cast<float>(1.0 / t.sum);
  double total = 0.0;
  for (int64_t c = 0; c < nc; ++c) {
    if (t.m[c] == -INFINITY) continue;  // q = 0 on the whole chunk
    load_chunk(row, c, t.thr, lbuf);
    load_prob_chunk(prow, c, pbuf);
    const double s = chunk_residual_weights(lbuf, pbuf, t.row_max, t.k, inv_sum, alpha, beta, w);
    if (mass != nullptr) (*mass)[c] = s;
    total += s;
  }
  return total;
}

// A sample of the residual (mass = residual_table's per-chunk totals); -1 without mass.
template <typename T, typename P>
inline int64_t sample_residual(const Row<T>& row, const Row<P>& prow, const RowTable& t, float alpha, float beta,
                               const std::vector<double>& mass, uint64_t seed, uint64_t offset, uint32_t node) {
  const int64_t nc = static_cast<int64_t>(t.m.size());
  const int64_t c = race(nc, seed, offset, node, [&](int64_t i) { return mass[i]; }, [](int64_t) { return 0.0; });
  if (c < 0) return -1;
  alignas(64) float lbuf[kChunk];
  alignas(64) float pbuf[kChunk];
  alignas(64) float w[kChunk];
  load_chunk(row, c, t.thr, lbuf);
  load_prob_chunk(prow, c, pbuf);
  chunk_residual_weights(lbuf, pbuf, t.row_max, t.k, static_cast<float>(1.0 / t.sum), alpha, beta, w);
  return chunk_inverse_cdf(w, c, seed, offset, node);
}

// ------------------------------------------------------------------------------ filters

// Per-request filter parameters (docs/ALGORITHM.md §7), already switched off for greedy requests.
struct FilterParams {
  int64_t top_k = 0;      // on iff 0 < k < V
  double top_p = 1.0;     // on iff p < 1 (NaN: off)
  double min_p = 0.0;     // on iff > 0 (NaN: off)
  bool any(int64_t vocab) const { return (top_k > 0 && top_k < vocab) || top_p < 1.0 || min_p > 0.0; }
};

// Ordered integer key of a float (a < b <=> key(a) < key(b)) and back.
inline int64_t float_key(float f) {
  int32_t i;
  std::memcpy(&i, &f, 4);
  return i >= 0 ? i : -static_cast<int64_t>(i & 0x7fffffff);
}
inline float key_float(int64_t k) {
  const uint32_t i = k >= 0 ? static_cast<uint32_t>(k) : (0x80000000u | static_cast<uint32_t>(-k));
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}

// The row's threshold logit t = max(t_k, t_p, t_mp) of the sort-based definition
// (sampling_filters.filter_keep_mask, float64 arithmetic): a logit is kept iff it is >= t.
// -inf when no filter is on or the row has no valid logit. `scratch` holds V floats.
template <typename T>
inline float filter_threshold(const Row<T>& row, double inv_temp, const FilterParams& f,
                              std::vector<float>& scratch, std::vector<float>& work) {
  const int64_t vocab = row.vocab;
  if (row.data == nullptr || !f.any(vocab)) return -INFINITY;
  scratch.resize(vocab);
  float row_max = -INFINITY;
  for (int64_t i = 0; i < vocab; ++i) {
    scratch[i] = sanitize1(to_float(row.data[i]), -INFINITY);
    row_max = std::max(row_max, scratch[i]);
  }
  if (row_max == -INFINITY) return -INFINITY;
  const double M = row_max;
  float thr = -INFINITY;
  if (f.top_k > 0 && f.top_k < vocab) {
    work.assign(scratch.begin(), scratch.end());
    std::nth_element(work.begin(), work.begin() + (f.top_k - 1), work.end(), std::greater<float>());
    thr = work[f.top_k - 1];
  }
  if (f.top_p < 1.0) {
    work.clear();
    for (int64_t i = 0; i < vocab; ++i)
      if (scratch[i] >= thr) work.push_back(scratch[i]);
    const int64_t kept = static_cast<int64_t>(work.size());
    double z = 0.0;
    for (const float v : work) z += std::exp((static_cast<double>(v) - M) * inv_temp);
    z = std::max(z, std::numeric_limits<double>::min());
    int64_t j = kept - 1;
    int64_t top = std::min<int64_t>(kept, 256);
    for (;;) {
      std::partial_sort(work.begin(), work.begin() + top, work.end(), std::greater<float>());
      double cum = 0.0;
      int64_t found = -1;
      for (int64_t i = 0; i < top; ++i) {
        cum += std::exp((static_cast<double>(work[i]) - M) * inv_temp) / z;
        if (cum >= f.top_p) {
          found = i;
          break;
        }
      }
      if (found >= 0) {
        j = found;
        break;
      }
      if (top == kept) break;
      top = std::min<int64_t>(kept, top * 4);
    }
    if (kept > 0) {
      // partial_sort of the final `top` holds the sorted prefix up to j
      thr = std::max(thr, work[j]);
    }
  }
  if (f.min_p > 0.0) {
    const double log_mp = std::log(std::min(f.min_p, 1.0));
    auto pred = [&](float v) { return (static_cast<double>(v) - M) * inv_temp >= log_mp; };
    float t_mp;
    if (pred(-FLT_MAX)) {
      t_mp = -FLT_MAX;
    } else {  // smallest float in (-FLT_MAX, M] with pred true (pred(M) holds)
      int64_t lo = float_key(-FLT_MAX), hi = float_key(row_max);
      while (hi - lo > 1) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (pred(key_float(mid))) hi = mid; else lo = mid;
      }
      t_mp = key_float(hi);
    }
    thr = std::max(thr, t_mp);
  }
  return thr;
}

}  // namespace specdec::cpu
