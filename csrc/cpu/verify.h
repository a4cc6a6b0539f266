// Torch-free verification of one request on the CPU: the chain (token and block methods,
// docs/ALGORITHM.md §1, §6) and the tree walk (§5), with the sampling filters (§7) and lenience
// (docs/API.md). The same decisions as the float64 reference (specdec_kernels/reference/) with
// the same Philox streams; rows are read only when a decision needs them (a chain stops reading
// at its first rejection; greedy rows take one max pass and the argmax search).
#pragma once

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu/rows.h"

namespace specdec::cpu {

// A 1-D input read as one dtype or another (the bindings pass contiguous tensors).
enum VecKind : int { kNone = 0, kF32, kF64, kBF16, kF16, kI32, kI64 };

struct Vec1 {
  const void* data = nullptr;
  int kind = kNone;

  bool present() const { return data != nullptr && kind != kNone; }
  double f(int64_t i) const {
    switch (kind) {
      case kF32: return static_cast<const float*>(data)[i];
      case kF64: return static_cast<const double*>(data)[i];
      case kBF16: return to_float(static_cast<const bf16_t*>(data)[i]);
      case kF16: return to_float(static_cast<const f16_t*>(data)[i]);
      case kI32: return static_cast<const int32_t*>(data)[i];
      case kI64: return static_cast<double>(static_cast<const int64_t*>(data)[i]);
      default: return 0.0;
    }
  }
  int64_t i(int64_t idx) const {
    switch (kind) {
      case kI32: return static_cast<const int32_t*>(data)[idx];
      case kI64: return static_cast<const int64_t*>(data)[idx];
      default: return static_cast<int64_t>(f(idx));
    }
  }
};

// What a request reads of the per-request inputs.
struct RequestParams {
  bool greedy = false;
  double inv_temp = 1.0;
  double kd = kLog2eD;  // log2(e) / T
  float kf = static_cast<float>(kLog2eD);
  uint64_t seed = 0, offset = 0;
  float lenience = 1.0f;
  FilterParams filters;
  bool filtered = false;
};

inline RequestParams request_params(int64_t b, int64_t vocab, const Vec1& temperature, const Vec1& seeds,
                                    const Vec1& offsets, const Vec1& top_k, const Vec1& top_p, const Vec1& min_p,
                                    const Vec1& lenience) {
  RequestParams r;
  const double temp = temperature.present() ? temperature.f(b) : 1.0;
  r.greedy = !(temp > 0.0);  // 0, negative and NaN temperatures are greedy
  r.inv_temp = r.greedy ? 1.0 : 1.0 / temp;
  r.kd = kLog2eD * r.inv_temp;
  r.kf = static_cast<float>(std::min(r.kd, static_cast<double>(FLT_MAX)));
  r.seed = static_cast<uint64_t>(seeds.i(b));
  r.offset = offsets.present() ? static_cast<uint64_t>(offsets.i(b)) : 0;
  r.lenience = lenience.present() ? static_cast<float>(lenience.f(b)) : 1.0f;
  if (!r.greedy) {  // greedy requests ignore the filters
    if (top_k.present()) r.filters.top_k = top_k.i(b);
    if (top_p.present()) r.filters.top_p = top_p.f(b);
    if (min_p.present()) r.filters.min_p = min_p.f(b);
    r.filtered = r.filters.any(vocab);
  }
  return r;
}

inline float accept_uniform(const RequestParams& r, uint32_t node) {
  return uniform_from_word(philox_words(r.seed, r.offset, kStreamAccept, node, 0).x);
}

// The greedy rule: x is the argmax, or (lenience l < 1) its logit is within ln(l) of the row max.
template <typename T>
inline bool greedy_accepts(const Row<T>& row, int64_t x, int64_t argmax, float row_max, float lenience) {
  if (x == argmax) return true;
  if (!(lenience < 1.0f)) return false;
  const float lx = logit_at(row, x, -INFINITY);
  return (static_cast<double>(lx) - row_max) >= std::log(static_cast<double>(lenience));
}

struct ChainParams {
  const void* logits = nullptr;
  int64_t logit_stride = 0;
  const void* probs = nullptr;  // nullptr: deterministic drafts
  int64_t prob_stride = 0;
  int64_t num_rows = 0, vocab = 0, num_drafts = 0, max_spec_len = 0;
  Vec1 ids, cu, temperature, seeds, offsets, top_k, top_p, min_p, lenience;
  bool block = false;
  int32_t* out = nullptr;  // [B, max_spec_len + 1]
  int32_t* num = nullptr;  // [B]
};

struct Scratch {
  RowTable table;
  std::vector<RowTable> tables;  // block method: one per row
  std::vector<double> mass;
  std::vector<float> filter_row, filter_work;
};

template <typename T, typename P>
void chain_request(const ChainParams& a, int64_t b, Scratch& s) {
  const int64_t L = a.max_spec_len, V = a.vocab;
  int32_t* out = a.out + b * (L + 1);
  for (int64_t j = 0; j <= L; ++j) out[j] = -1;
  const int64_t c0 = a.cu.i(b);
  const int64_t n = std::clamp<int64_t>(a.cu.i(b + 1) - c0, 0, L);  // drafts beyond L are ignored
  const RequestParams r = request_params(b, V, a.temperature, a.seeds, a.offsets, a.top_k, a.top_p, a.min_p,
                                         a.lenience);
  const bool has_probs = a.probs != nullptr;
  auto row_of = [&](int64_t t) {
    const int64_t idx = c0 + b + t;
    Row<T> row;
    row.vocab = V;
    if (t <= n && idx >= 0 && idx < a.num_rows) row.data = static_cast<const T*>(a.logits) + idx * a.logit_stride;
    return row;
  };
  auto prow_of = [&](int64_t t) {
    const int64_t idx = c0 + t;
    Row<P> row;
    row.vocab = V;
    if (has_probs && idx >= 0 && idx < a.num_drafts) row.data = static_cast<const P*>(a.probs) + idx * a.prob_stride;
    return row;
  };
  auto draft_of = [&](int64_t t) -> int64_t {
    const int64_t idx = c0 + t;
    if (t >= n || idx < 0 || idx >= a.num_drafts) return -1;
    return a.ids.i(idx);
  };
  auto valid = [&](int64_t x) { return x >= 0 && x < V; };
  auto threshold = [&](const Row<T>& row) {
    return r.filtered ? filter_threshold(row, r.inv_temp, r.filters, s.filter_row, s.filter_work) : -INFINITY;
  };

  int64_t t_star = n;
  int64_t token = -1;
  if (r.greedy) {
    float row_max = -INFINITY;
    int64_t argmax = -1;
    for (int64_t t = 0; t <= n; ++t) {
      const Row<T> row = row_of(t);
      argmax = row_argmax(row, &row_max);
      if (t == n) break;
      const int64_t x = draft_of(t);
      if (!valid(x) || !greedy_accepts(row, x, argmax, row_max, r.lenience)) {
        t_star = t;
        break;
      }
    }
    token = argmax;
  } else if (!a.block) {
    RowTable& tab = s.table;
    bool built = false;  // tab holds row t_star
    for (int64_t t = 0; t < n; ++t) {
      const int64_t x = draft_of(t);
      if (!valid(x)) {  // an invalid id ends the chain
        t_star = t;
        break;
      }
      const Row<T> row = row_of(t);
      build_table(row, threshold(row), r.kf, r.kd, tab);
      const double q_x = q_at(row, tab, x);
      const Row<P> prow = prow_of(t);
      const double p_x = has_probs ? static_cast<double>(to_float(prow.data[x])) : 1.0;
      const double u = accept_uniform(r, static_cast<uint32_t>(t + 1));
      if (!(u * (static_cast<double>(r.lenience) * p_x) < q_x)) {
        t_star = t;
        built = true;
        break;
      }
    }
    const Row<T> row = row_of(t_star);
    const uint32_t node = static_cast<uint32_t>(t_star);
    if (!built) build_table(row, threshold(row), r.kf, r.kd, tab);
    const int64_t x_star = t_star < n ? draft_of(t_star) : -1;
    if (t_star < n && valid(x_star)) {
      if (has_probs) {
        const Row<P> prow = prow_of(t_star);
        residual_table(row, prow, tab, 1.0f, r.lenience, &s.mass);
        token = sample_residual(row, prow, tab, 1.0f, r.lenience, s.mass, r.seed, r.offset, node);
        if (token < 0) token = sample_q<T>(row, tab, nullptr, 0, r.seed, r.offset, node);
      } else {
        token = sample_q(row, tab, &x_star, 1, r.seed, r.offset, node);
        if (token < 0) {
          float m;
          token = row_argmax(row, &m);
        }
      }
    } else {
      token = sample_q<T>(row, tab, nullptr, 0, r.seed, r.offset, node);
    }
  } else {
    // Block verification (Sun et al. 2024; docs/ALGORITHM.md §6), positions i = 1..n'.
    int64_t n_eff = n;
    for (int64_t t = 0; t < n; ++t) {
      if (!valid(draft_of(t))) {
        n_eff = t;
        break;
      }
    }
    if (static_cast<int64_t>(s.tables.size()) < n_eff + 1) s.tables.resize(n_eff + 1);
    std::vector<double> q_x(n_eff), p_x(n_eff), joint(n_eff + 1, 1.0);  // joint: P_i
    for (int64_t t = 0; t < n_eff; ++t) {
      const Row<T> row = row_of(t);
      build_table(row, threshold(row), r.kf, r.kd, s.tables[t]);
      const int64_t x = draft_of(t);
      q_x[t] = q_at(row, s.tables[t], x);
      p_x[t] = has_probs ? static_cast<double>(to_float(prow_of(t).data[x])) : 1.0;
      const double num = joint[t] * q_x[t], den = p_x[t];
      joint[t + 1] = num >= den ? (num > 0.0 ? 1.0 : 0.0) : num / (den > 0.0 ? den : 1.0);
    }
    int64_t tau = 0;
    for (int64_t pos = 1; pos <= n_eff; ++pos) {
      double h;
      if (pos == n_eff) {
        h = joint[pos];
      } else {
        double R;
        if (has_probs) {
          R = residual_table(row_of(pos), prow_of(pos), s.tables[pos], static_cast<float>(joint[pos]), 1.0f, nullptr);
        } else {
          R = joint[pos] * (1.0 - q_x[pos]);
        }
        const double den = R + 1.0 - joint[pos];
        h = den > 0.0 ? R / den : 1.0;
      }
      if (accept_uniform(r, static_cast<uint32_t>(pos)) < h) tau = pos;
    }
    t_star = tau;
    const Row<T> row = row_of(t_star);
    const uint32_t node = static_cast<uint32_t>(t_star);
    RowTable& tab = s.tables[t_star];
    if (t_star == n_eff) build_table(row, threshold(row), r.kf, r.kd, tab);
    const int64_t x_star = t_star < n ? draft_of(t_star) : -1;
    if (t_star < n && valid(x_star)) {
      if (has_probs) {
        const Row<P> prow = prow_of(t_star);
        const float scale = static_cast<float>(joint[t_star]);
        residual_table(row, prow, tab, scale, 1.0f, &s.mass);
        token = sample_residual(row, prow, tab, scale, 1.0f, s.mass, r.seed, r.offset, node);
        if (token < 0) token = sample_q<T>(row, tab, nullptr, 0, r.seed, r.offset, node);
      } else {
        token = sample_q(row, tab, &x_star, 1, r.seed, r.offset, node);
        if (token < 0) {
          float m;
          token = row_argmax(row, &m);
        }
      }
    } else {
      token = sample_q<T>(row, tab, nullptr, 0, r.seed, r.offset, node);
    }
  }
  for (int64_t t = 0; t < t_star; ++t) out[t] = static_cast<int32_t>(draft_of(t));
  out[t_star] = static_cast<int32_t>(token);
  a.num[b] = static_cast<int32_t>(t_star);
}

struct TreeParams {
  const void* logits = nullptr;
  int64_t logit_stride = 0;
  const void* probs = nullptr;
  int64_t prob_stride = 0;
  int64_t num_nodes = 0, vocab = 0, max_depth = 0;
  const int64_t* cu = nullptr;  // [B + 1], clamped to [0, N] and made non-decreasing
  Vec1 tokens, parents, temperature, seeds, offsets, top_k, top_p, min_p, lenience;
  int32_t* out = nullptr;    // [B, D + 1]
  int32_t* nodes = nullptr;  // [B, D + 1]
  int32_t* num = nullptr;    // [B]
};

struct TreeScratch {
  RowTable table;
  std::vector<double> mass;
  std::vector<float> filter_row, filter_work;
  std::vector<int64_t> first_child, next_sibling, last_child, excluded;
};

template <typename T, typename P>
void tree_request(const TreeParams& a, int64_t b, TreeScratch& s) {
  const int64_t D = a.max_depth, V = a.vocab;
  int32_t* out = a.out + b * (D + 1);
  int32_t* path = a.nodes + b * (D + 1);
  for (int64_t j = 0; j <= D; ++j) out[j] = path[j] = -1;
  a.num[b] = 0;
  const int64_t base = a.cu[b], count = a.cu[b + 1] - base;
  if (count <= 0) return;
  const RequestParams r = request_params(b, V, a.temperature, a.seeds, a.offsets, a.top_k, a.top_p, a.min_p,
                                         a.lenience);
  const bool has_probs = a.probs != nullptr;
  // Children in index order; a link counts only if 0 <= parent < child (docs/ALGORITHM.md §5).
  s.first_child.assign(count, -1);
  s.next_sibling.assign(count, -1);
  s.last_child.assign(count, -1);
  for (int64_t j = 1; j < count; ++j) {
    const int64_t parent = a.parents.i(base + j);
    if (parent < 0 || parent >= j) continue;
    if (s.last_child[parent] < 0) s.first_child[parent] = j; else s.next_sibling[s.last_child[parent]] = j;
    s.last_child[parent] = j;
  }
  auto row_of = [&](int64_t v) {
    Row<T> row;
    row.vocab = V;
    row.data = static_cast<const T*>(a.logits) + (base + v) * a.logit_stride;
    return row;
  };
  auto prow_of = [&](int64_t v) {
    Row<P> row;
    row.vocab = V;
    if (has_probs) row.data = static_cast<const P*>(a.probs) + (base + v) * a.prob_stride;
    return row;
  };
  RowTable& tab = s.table;
  float row_max = -INFINITY;
  int64_t argmax = -1;
  auto load = [&](int64_t v) {
    const Row<T> row = row_of(v);
    if (r.greedy) {
      argmax = row_argmax(row, &row_max);
    } else {
      const float thr =
          r.filtered ? filter_threshold(row, r.inv_temp, r.filters, s.filter_row, s.filter_work) : -INFINITY;
      build_table(row, thr, r.kf, r.kd, tab);
    }
  };
  int64_t node = 0, depth = 0;
  path[0] = 0;
  int64_t cand = D > 0 ? s.first_child[0] : -1;
  double acc = 0.0;  // the residual is (q - acc l p)+ (draft probabilities)
  s.excluded.clear();  // the residual is q without these (deterministic drafts)
  load(0);
  while (cand >= 0) {
    const int64_t x = a.tokens.i(base + cand);
    bool accept = false;
    if (x >= 0 && x < V) {
      const Row<T> row = row_of(node);
      if (r.greedy) {
        accept = greedy_accepts(row, x, argmax, row_max, r.lenience);
      } else {
        const double u = accept_uniform(r, static_cast<uint32_t>(cand));
        const double q_x = q_at(row, tab, x);
        if (has_probs) {
          const Row<P> prow = prow_of(node);
          const double p_x = static_cast<double>(r.lenience) * static_cast<double>(to_float(prow.data[x]));
          const double mass = acc == 0.0 ? 1.0
                                         : residual_table(row, prow, tab, 1.0f,
                                                          static_cast<float>(acc * r.lenience), nullptr);
          accept = u * p_x * mass < std::max(q_x - acc * p_x, 0.0);
          if (!accept) acc += mass;
        } else {
          const bool seen = std::find(s.excluded.begin(), s.excluded.end(), x) != s.excluded.end();
          double removed = 0.0;
          for (const int64_t e : s.excluded) removed += q_at(row, tab, e);
          accept = !seen && (u * r.lenience) * (1.0 - removed) < q_x;
          if (!accept && !seen) s.excluded.push_back(x);
        }
      }
    }
    if (accept) {
      out[depth] = static_cast<int32_t>(x);
      ++depth;
      path[depth] = static_cast<int32_t>(cand);
      node = cand;
      cand = depth >= D ? -1 : s.first_child[node];
      acc = 0.0;
      s.excluded.clear();
      load(node);
    } else {
      cand = s.next_sibling[cand];
    }
  }
  int64_t token;
  const Row<T> row = row_of(node);
  const uint32_t local = static_cast<uint32_t>(node);
  if (r.greedy) {
    token = argmax;
  } else if (has_probs) {
    const Row<P> prow = prow_of(node);
    const float beta = static_cast<float>(acc * r.lenience);
    residual_table(row, prow, tab, 1.0f, beta, &s.mass);
    token = sample_residual(row, prow, tab, 1.0f, beta, s.mass, r.seed, r.offset, local);
    if (token < 0) token = sample_q<T>(row, tab, nullptr, 0, r.seed, r.offset, local);
  } else {
    token = sample_q(row, tab, s.excluded.data(), static_cast<int>(s.excluded.size()), r.seed, r.offset, local);
    if (token < 0) token = sample_q<T>(row, tab, nullptr, 0, r.seed, r.offset, local);
  }
  out[depth] = static_cast<int32_t>(token);
  a.num[b] = static_cast<int32_t>(depth);
}

}  // namespace specdec::cpu
