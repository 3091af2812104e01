// Sampling a row of logits: the stages of loom/sample/sampler.py's non-greedy rows (temperature,
// top-k, min-p, top-p, one draw by inversion), in a few passes over the row where torch's ops
// took a dozen, each writing a fresh [R, V] tensor. Gemma 3's 262,144-entry rows made that the
// largest cost of a sampled decode step, and top-p's full sort of every row far more than the
// step itself. Here top-p sorts only the entries near the nucleus' end (nucleus_end).
//
// Per row, over V = its vector traits:
//   scale    y = x / T in place, NaN -> -inf, +inf -> the largest float; m = max y
//   top-k    kth = the k-th largest y (the largest_above search); ties with it are kept
//   exp      e = exp(y - m) where y >= kth and y > -inf, else 0; S = sum e
//   min-p    e < min_p (e of the most probable is exp(0) = 1) -> 0; S = what is left
//   top-p    most probable first (of equal entries, the higher index first: torch's stable
//            ascending sort read backwards), an entry is kept while the mass before it < p S
//   draw     the first id whose running sum exceeds u times the total, or, without a draw,
//            e / total in place: the distribution itself
// Min-p comes before top-p, as vLLM v1 orders them: the nucleus is taken of what min-p left.
// The sums run in double across vectors. Rows are independent of each other, so a row's token
// does not depend on the batch.
#pragma once

#include <cfloat>

#include "loom_kernels_loops.h"

namespace loom {

constexpr int64_t SUM_BLOCK = 64;   // vectors summed in float lanes before the double total

// y = x / T, NaN -> -inf, +inf -> FLT_MAX, in place; returns max y
template <class V>
float scale_row(float* x, int64_t N, float T) {
  using F = typename V::F;
  const F tv = V::set1(T), big = V::set1(FLT_MAX), neg = V::set1(-INFINITY);
  F mx = neg;
  int64_t v = 0;
  for (; v + V::W <= N; v += V::W) {
    const F y = V::div(V::load(x + v), tv);
    const F c = V::select(V::ge(y, y), V::min(y, big), neg);   // ge is false only for NaN
    V::store(x + v, c);
    mx = V::max(mx, c);
  }
  float m = V::hmax(mx);
  for (; v < N; ++v) {
    const float y = x[v] / T;
    x[v] = std::isnan(y) ? -INFINITY : std::min(y, FLT_MAX);
    m = std::max(m, x[v]);
  }
  return m;
}

// e = exp(y - m) where y >= thr (thr finite: -inf never passes), else 0, in place; returns sum e
template <class V>
double exp_row(float* y, int64_t N, float thr, float m) {
  using F = typename V::F;
  const F tv = V::set1(thr), mv = V::set1(m);
  double total = 0.0;
  int64_t v = 0;
  while (v + V::W <= N) {
    F acc = V::zero();
    for (int64_t b = 0; b < SUM_BLOCK && v + V::W <= N; ++b, v += V::W) {
      const F x = V::load(y + v);
      const F e = V::keep(V::ge(x, tv), vexp<V>(V::sub(x, mv)));
      V::store(y + v, e);
      acc = V::add(acc, e);
    }
    total += V::hsum(acc);
  }
  for (; v < N; ++v) {
    y[v] = y[v] >= thr ? std::exp(y[v] - m) : 0.0f;
    total += y[v];
  }
  return total;
}

// the k-th largest finite entry of y, or -FLT_MAX (every finite entry) when k is off or the row
// has fewer finite entries
template <class V>
float kth_largest(const float* y, int64_t N, int64_t k, std::vector<Scored>& cand) {
  if (k <= 0 || k >= N) return -FLT_MAX;
  largest_above<V>(y, N, -INFINITY, k, cand);
  if ((int64_t)cand.size() < k) return -FLT_MAX;
  float kth = INFINITY;
  for (const Scored& c : cand) kth = std::min(kth, c.first);
  return kth;
}

// The nucleus of e (total S): its last kept entry (value, index). Entries above the value are
// kept, entries equal to it only from that index up.
//
// A peaked row's nucleus is a few entries: it is searched among the 64 largest, then the 512
// largest. A wider one (a flat distribution, a high temperature) is found in two passes over
// the row whatever its width: each positive entry's mass is added to a bucket of its float's
// exponent and first mantissa bits (ordered like the values), the bucket where the mass from
// the top reaches p S is found, and only its entries are sorted.
constexpr int NUCLEUS_SHIFT = 19;   // 4 mantissa bits: 4096 buckets over [0, 1]

template <class V>
Scored nucleus_end(const float* e, int64_t N, double S, float p, std::vector<Scored>& cand) {
  const double P = (double)p * S;
  const auto desc = [](const Scored& a, const Scored& b) {
    return a.first > b.first || (a.first == b.first && a.second > b.second);
  };
  for (int64_t m : {64, 512}) {
    const float lo = largest_above<V>(e, N, 0.0f, m, cand);   // every entry left out is <= lo
    const bool all = (int64_t)cand.size() < m;                // every positive entry is here
    std::sort(cand.begin(), cand.end(), desc);
    double before = 0.0;
    for (const Scored& c : cand) {
      before += c.first;
      if (before >= P) {   // the nucleus ends at c; every entry equal to c is here where c > lo
        if (all || c.first > lo) return c;
        break;
      }
    }
    if (all) return cand.empty() ? Scored{0.0f, 0} : cand.back();   // rounding left P unreached: keep all
  }
  thread_local std::vector<double> mass;
  mass.assign((size_t)1 << (31 - NUCLEUS_SHIFT), 0.0);
  const auto bucket = [](float x) {
    uint32_t b;
    std::memcpy(&b, &x, 4);
    return b >> NUCLEUS_SHIFT;
  };
  for (int64_t i = 0; i < N; ++i)
    if (e[i] > 0.0f) mass[bucket(e[i])] += e[i];
  double above = 0.0;
  int64_t b = (int64_t)mass.size() - 1;
  for (; b >= 0 && above + mass[b] < P; --b) above += mass[b];
  if (b < 0) {   // rounding left P unreached: every entry stays (the smallest, of equals the lowest id)
    Scored low{INFINITY, 0};
    for (int64_t i = 0; i < N; ++i)
      if (e[i] > 0.0f && e[i] < low.first) low = Scored{e[i], (int32_t)i};
    return low;
  }
  cand.clear();   // bucket b holds mass (it took the sum to P), so at least one entry
  for (int64_t i = 0; i < N; ++i)
    if (e[i] > 0.0f && (int64_t)bucket(e[i]) == b) cand.emplace_back(e[i], (int32_t)i);
  std::sort(cand.begin(), cand.end(), desc);
  for (const Scored& c : cand)
    if ((above += c.first) >= P) return c;
  return cand.back();   // the entries' own sum a rounding short of the buckets': keep the bucket
}

// e < floor -> 0, and entries equal to the nucleus' last value below its index (where that value
// is the floor); returns the sum of what is left
template <class V>
double cut_row(float* e, int64_t N, float floor, const Scored& end, const std::vector<Scored>& cand) {
  using F = typename V::F;
  const F fv = V::set1(floor);
  double total = 0.0;
  int64_t v = 0;
  while (v + V::W <= N) {
    F acc = V::zero();
    for (int64_t b = 0; b < SUM_BLOCK && v + V::W <= N; ++b, v += V::W) {
      const F x = V::keep(V::ge(V::load(e + v), fv), V::load(e + v));
      V::store(e + v, x);
      acc = V::add(acc, x);
    }
    total += V::hsum(acc);
  }
  for (; v < N; ++v) {
    e[v] = e[v] >= floor ? e[v] : 0.0f;
    total += e[v];
  }
  if (end.first == floor)   // ties with the nucleus' last entry: only those from its index up
    for (const Scored& c : cand)
      if (c.first == floor && c.second < end.second && e[c.second] != 0.0f) {
        total -= e[c.second];
        e[c.second] = 0.0f;
      }
  return total;
}

// the first id whose running sum of e exceeds u * total (total > 0); a rounding that leaves the
// target unreached gives the last positive entry
template <class V>
int64_t draw_row(const float* e, int64_t N, double total, double u) {
  const double target = std::min(u * total, std::nextafter(total, 0.0));
  double run = 0.0;
  int64_t v = 0;
  for (; v + V::W <= N; v += V::W) {
    const float b = V::hsum(V::load(e + v));
    if (run + b <= target) {
      run += b;
      continue;
    }
    for (int64_t i = v; i < v + V::W; ++i) {
      run += e[i];
      if (run > target && e[i] > 0.0f) return i;
    }
  }
  for (; v < N; ++v) {
    run += e[v];
    if (run > target && e[v] > 0.0f) return v;
  }
  for (int64_t i = N - 1; i >= 0; --i)
    if (e[i] > 0.0f) return i;
  return 0;
}

// one row: its token (draw), or its distribution left in x and -1
template <class V>
int64_t sample_row(float* x, int64_t N, float T, int64_t top_k, float top_p, float min_p, double u, bool draw,
                   std::vector<Scored>& cand) {
  const float m = scale_row<V>(x, N, T);
  if (!(m > -INFINITY)) {   // nothing left to draw (callers refuse such rows before)
    if (!draw) std::fill(x, x + N, 0.0f);
    return draw ? 0 : -1;
  }
  const float kth = kth_largest<V>(x, N, top_k, cand);
  double total = exp_row<V>(x, N, kth, m);
  if (min_p > 0.0f) total = cut_row<V>(x, N, min_p, Scored{0.0f, 0}, cand);   // the most probable entry's e is 1
  if (top_p < 1.0f) {
    const Scored end = nucleus_end<V>(x, N, total, top_p, cand);
    total = cut_row<V>(x, N, end.first, end, cand);
  }
  if (draw) return draw_row<V>(x, N, total, u);
  const typename V::F inv = V::set1((float)(1.0 / total));
  int64_t v = 0;
  for (; v + V::W <= N; v += V::W) V::store(x + v, V::mul(V::load(x + v), inv));
  for (; v < N; ++v) x[v] = (float)(x[v] / total);
  return -1;
}

// log(sum exp x) over a row, in double past its max (-inf entries add nothing); the max itself
// where it is not finite
template <class V>
float logsumexp_row(const float* x, int64_t N) {
  using F = typename V::F;
  F mx = V::set1(-INFINITY);
  int64_t v = 0;
  for (; v + V::W <= N; v += V::W) mx = V::max(mx, V::load(x + v));
  float m = V::hmax(mx);
  for (int64_t t = v; t < N; ++t) m = std::max(m, x[t]);
  if (!std::isfinite(m)) return m;
  const F mv = V::set1(m), lowest = V::set1(-FLT_MAX);
  double total = 0.0;
  v = 0;
  while (v + V::W <= N) {
    F acc = V::zero();
    for (int64_t b = 0; b < SUM_BLOCK && v + V::W <= N; ++b, v += V::W) {
      const F e = V::load(x + v);
      acc = V::add(acc, V::keep(V::ge(e, lowest), vexp<V>(V::sub(e, mv))));
    }
    total += V::hsum(acc);
  }
  for (; v < N; ++v) total += x[v] > -INFINITY ? std::exp(x[v] - m) : 0.0f;
  return (float)(m + std::log(total));
}

// how many entries of the row are above t
template <class V>
int64_t count_above(const float* x, int64_t N, float t) {
  const typename V::F tv = V::set1(t);
  int64_t n = 0, v = 0;
  for (; v + V::W <= N; v += V::W) n += __builtin_popcount(V::gt_bits(V::load(x + v), tv));
  for (; v < N; ++v) n += x[v] > t;
  return n;
}

}  // namespace loom
