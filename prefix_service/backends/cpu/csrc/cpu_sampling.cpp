// The sampler's passes over a step's logits on the CPU (engine/sampler.py), float32, AVX-512 or
// AVX2 (simd.h), rows split over OpenMP threads (torch's runtime):
//   ps_top_k_rows:        the k largest of each row, sorted, ties in index order (top-k and top-p's
//                         candidates)
//   ps_logsumexp_rows:    each row's log of the sum of its exponentials (top-p's normaliser)
//   ps_softmax_draw_rows: each row's token drawn from its whole softmax over its temperature
// On a CPU, torch's topk was most of a sampled step's time once many requests asked for a top-p. Here
// a row's k largest take two passes: the maxima of at least k blocks of it give a bar that at least
// k values reach (the k-th largest maximum), then the values that reach it, not many more than k,
// are the candidates, ranked by a stable radix sort. A draw from the whole softmax is a pass for the
// maximum, one for the blocks' sums and one within the block picked.
// A NaN counts as -inf throughout (a token that is never drawn). Each row is computed the same way
// whatever the split over threads.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "simd.h"
#include <omp.h>

namespace {

constexpr int64_t PARALLEL_FLOATS = 1 << 15;  // below this much work, one thread

inline int team(int64_t rows, int64_t row_floats, int threads) {
  return rows * row_floats >= PARALLEL_FLOATS && threads > 1 && rows > 1 ? threads : 1;
}

// A candidate as one integer that orders as `before` ranks, largest first: its value's bits made
// monotonic in the high half (-0 taken as +0, a NaN as -inf), the complement of its index in the low
// half (equal values: the earlier first)
using Candidate = uint64_t;

inline float no_nan(float x) { return std::isnan(x) ? -std::numeric_limits<float>::infinity() : x; }

inline Candidate candidate(float x, int j) {
  uint32_t u;
  const float v = no_nan(x) + 0.0f;  // -0 + 0 = +0
  std::memcpy(&u, &v, sizeof u);
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return ((uint64_t)u << 32) | (uint32_t)(0xFFFFFFFFu - (uint32_t)j);
}

inline float value_of(Candidate c) {
  uint32_t u = (uint32_t)(c >> 32);
  u = (u & 0x80000000u) ? (u & 0x7FFFFFFFu) : ~u;
  float v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

inline int64_t index_of(Candidate c) { return (int64_t)(0xFFFFFFFFu - (uint32_t)c); }

inline bool before(Candidate a, Candidate b) { return a > b; }

constexpr int kRadixFrom = 256;  // candidates from which rank() sorts them, not std::sort

// c[0, n) (in index order) ranked by `before`: a stable sort, largest value first, by the value's
// 32 bits alone (equal values keep their index order), least significant digits first, 11 bits at a
// time (a comparison sort mispredicts a branch about every other comparison). spare: room for n.
void rank(Candidate* c, int n, Candidate* spare) {
  Candidate* from = c;
  Candidate* to = spare;
  for (int shift = 32; shift < 64; shift += 11) {
    const int bits = std::min(11, 64 - shift);
    const uint32_t mask = (1u << bits) - 1u;
    int count[(1 << 11) + 1] = {};
    for (int t = 0; t < n; ++t) ++count[((~from[t] >> shift) & mask) + 1];  // ~: the larger value first
    for (uint32_t d = 0; d < mask + 1; ++d) count[d + 1] += count[d];
    for (int t = 0; t < n; ++t) to[count[(~from[t] >> shift) & mask]++] = from[t];
    std::swap(from, to);
  }
  if (from != c) std::memcpy(c, from, sizeof(Candidate) * n);  // three passes: the result is in spare
}

// The bar a row's k largest clear: the k-th largest of the maxima of nb >= k blocks of the row
// (at least k values reach it, the k maxima that do), so not many more than k pass it: blocks of
// as many vectors as leave at least 2k of them, else of one vector where that leaves k. -inf where
// the row has fewer than k vectors (every value is then a candidate). maxima: room for nb floats.
float bar(const float* x, int vocab, int k, float* maxima) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
#if defined(PS_SIMD)
  const int vectors = vocab / ps::LANES;
  if (vectors < k) return kNegInf;
  const int per = vectors >= 2 * k ? vectors / (2 * k) : 1;  // vectors a block
  int nb = 0;
  for (int v0 = 0; v0 + per <= vectors; v0 += per) {
    ps::vf acc = ps::vset1(kNegInf);
    for (int v = v0; v < v0 + per; ++v) acc = ps::vmax(ps::vload(x + v * ps::LANES), acc);  // a NaN lane keeps acc
    maxima[nb++] = ps::vreduce_max(acc);
  }
  std::nth_element(maxima, maxima + (k - 1), maxima + nb, [](float a, float b) { return a > b; });
  return maxima[k - 1];
#else
  (void)x; (void)vocab; (void)k; (void)maxima;
  return kNegInf;
#endif
}

// row x [vocab]: its k largest into values and index (ranked by `before`). kept and spare: room for
// vocab candidates; maxima: for vocab / 16.
void top_k_row(const float* x, int vocab, int k, float* values, int64_t* index, Candidate* kept, Candidate* spare,
               float* maxima) {
  const float b = bar(x, vocab, k, maxima);
  int n = 0;
  if (b != -std::numeric_limits<float>::infinity()) {
    const float below = std::nextafter(b, -std::numeric_limits<float>::infinity());  // x > below: x >= b
    int j = 0;
#if defined(PS_SIMD)
    for (; j + ps::LANES <= vocab; j += ps::LANES)
      for (unsigned bits = ps::vgt_bits(ps::vload(x + j), below); bits != 0; bits &= bits - 1) {
        const int t = j + __builtin_ctz(bits);
        kept[n++] = candidate(x[t], t);
      }
#endif
    for (; j < vocab; ++j)
      if (x[j] > below) kept[n++] = candidate(x[j], j);
  }
  if (n < k) {  // no bar (or NaN where its values were): every value a candidate
    n = 0;
    for (int j = 0; j < vocab; ++j) kept[n++] = candidate(x[j], j);
  }
  if (n >= kRadixFrom) {
    rank(kept, n, spare);
  } else {
    if (n > k) std::nth_element(kept, kept + (k - 1), kept + n, before);  // the k first-ranked, unsorted
    std::sort(kept, kept + k, before);
  }
  for (int t = 0; t < k; ++t) {
    values[t] = value_of(kept[t]);
    index[t] = index_of(kept[t]);
  }
}

// The largest of x[0, vocab), a NaN counted as -inf
float row_max(const float* x, int vocab) {
  float m = -std::numeric_limits<float>::infinity();
  int j = 0;
#if defined(PS_SIMD)
  ps::vf acc = ps::vset1(m);
  for (; j + ps::LANES <= vocab; j += ps::LANES) acc = ps::vmax(ps::vload(x + j), acc);  // a NaN lane keeps acc
  m = ps::vreduce_max(acc);
#endif
  for (; j < vocab; ++j) m = std::max(no_nan(x[j]), m);
  return m;
}

float logsumexp_row(const float* x, int vocab) {
  const float m = row_max(x, vocab);
  if (std::isinf(m)) return m;  // every token -inf (or NaN), or one +inf
  double sum = 0.0;
  int j = 0;
#if defined(PS_SIMD)
  // exp_ps clamps its argument to [-87, 88]: a -inf (or NaN) adds e^-87, ~1.6e-38, beside the 1 of
  // the largest. float32 sums over blocks of 16 vectors, added up in double.
  const ps::vf mb = ps::vset1(m);
  for (; j + ps::LANES <= vocab;) {
    ps::vf s = ps::vzero();
    for (int v = 0; v < 16 && j + ps::LANES <= vocab; ++v, j += ps::LANES)
      s = ps::vadd(s, ps::exp_ps(ps::vsub(ps::vload(x + j), mb)));
    sum += ps::vreduce_add(s);
  }
#endif
  for (; j < vocab; ++j) sum += std::exp(no_nan(x[j]) - m);
  return m + static_cast<float>(std::log(sum));
}

// The token of row x (temperature t > 0) that uniform u in [0, 1) picks from its softmax: the first
// index whose cumulative sum of e^(x / t - max) passes u times the whole sum (over blocks of 256 in
// float32, added up in double, then within the one block picked in double); a pick of a token whose
// exponential is 0 (a rounding at a block's end) or a row with no finite value gives the row's
// first largest. sums: room for vocab / 256 + 1 doubles.
int64_t softmax_draw_row(const float* x, int vocab, float t, double u, double* sums) {
  constexpr int kBlock = 256;
  const float m = row_max(x, vocab);
  const auto first_max = [&]() -> int64_t {  // the first index of the largest (NaN as -inf)
    for (int j = 0; j < vocab; ++j)
      if (no_nan(x[j]) == m) return j;
    return 0;
  };
  if (!std::isfinite(m)) return first_max();
  const float top = m / t;  // the largest of x / t (division keeps the order)
  const auto block_sum = [&](int j0, int j1) {  // sum of e^(x / t - top) over [j0, j1), float32
    float sum = 0.0f;
    int j = j0;
#if defined(PS_SIMD)
    ps::vf acc = ps::vzero();
    const ps::vf tb = ps::vset1(t), mb = ps::vset1(top);
    for (; j + ps::LANES <= j1; j += ps::LANES) acc = ps::vadd(acc, ps::exp_ps(ps::vsub(ps::vdiv(ps::vload(x + j), tb), mb)));
    sum = ps::vreduce_add(acc);
#endif
    for (; j < j1; ++j) sum += std::isnan(x[j]) ? 0.0f : std::exp(x[j] / t - top);
    return sum;
  };
  const int blocks = (vocab + kBlock - 1) / kBlock;
  double total = 0.0;
  for (int b = 0; b < blocks; ++b) {
    sums[b] = block_sum(b * kBlock, std::min(vocab, (b + 1) * kBlock));
    total += sums[b];
  }
  double rest = u * total;
  int b = 0;
  while (b < blocks - 1 && rest >= sums[b]) rest -= sums[b++];  // the block where the cumulative sum passes
  const int j0 = b * kBlock, j1 = std::min(vocab, j0 + kBlock);
  double cum = 0.0, e = 0.0;
  int j = j0;
  for (; j < j1; ++j) {
    e = std::isnan(x[j]) ? 0.0 : std::exp((double)(x[j] / t) - top);
    cum += e;
    if (cum > rest) break;
  }
  if (j == j1) j = j1 - 1;  // the block's float32 sum passed where its double sum does not: its last token
  return e > 0.0 ? j : first_max();
}

// A thread's buffers for its rows: top_k_row's candidates (kept, spare) and block maxima, or
// softmax_draw_row's block sums
struct RowScratch {
  std::vector<Candidate> kept, spare;
  std::vector<float> maxima;
  std::vector<double> sums;
};

// row(r, scratch) for r in [0, rows), the rows split over the team, each thread with its own
// scratch (for ranking: candidates, else block sums). 0, or 3 when a thread's could not be allocated.
template <typename Row>
int over_rows(int rows, int vocab, int threads, bool ranking, Row row) {
  int status = 0;
#pragma omp parallel num_threads(team(rows, vocab, threads))
  {
    RowScratch scratch;
    bool ok = true;
    try {
      if (ranking) {
        scratch.kept.resize(vocab);
        scratch.spare.resize(vocab);
        scratch.maxima.resize(vocab / 16 + 1);
      } else {
        scratch.sums.resize(vocab / 256 + 1);
      }
    } catch (...) {
      ok = false;
#pragma omp atomic write
      status = 3;
    }
#pragma omp for schedule(static)
    for (int r = 0; r < rows; ++r)
      if (ok) row(r, scratch);
  }
  return status;
}

}  // namespace

// For rows of x (float32, row r at x + r * stride, vocab values each), the k (1 <= k <= vocab)
// largest of each, largest first and equal values in index order: values [rows][k], index
// [rows][k]. 0, 2 for bad operands, or 3 out of memory.
extern "C" int ps_top_k_rows(const float* x, int64_t stride, int rows, int vocab, int k, float* values,
                             int64_t* index, int threads) {
  if (rows < 0 || vocab <= 0 || k <= 0 || k > vocab || (rows > 1 && stride < vocab)) return 2;
  return over_rows(rows, vocab, threads, true, [&](int r, RowScratch& s) {
    top_k_row(x + r * stride, vocab, k, values + (int64_t)r * k, index + (int64_t)r * k, s.kept.data(),
              s.spare.data(), s.maxima.data());
  });
}

// out[r] = log(sum_j e^x[r][j]) for rows of x as above. 0, or 2 for bad operands.
extern "C" int ps_logsumexp_rows(const float* x, int64_t stride, int rows, int vocab, float* out, int threads) {
  if (rows < 0 || vocab <= 0 || (rows > 1 && stride < vocab)) return 2;
#pragma omp parallel for num_threads(team(rows, vocab, threads)) schedule(static)
  for (int r = 0; r < rows; ++r) out[r] = logsumexp_row(x + r * stride, vocab);
  return 0;
}

// out[r] = the token uniform[r] draws from the softmax of row r of x over temperature[r] (> 0),
// rows as above (softmax_draw_row). 0, 2 for bad operands, or 3 out of memory.
extern "C" int ps_softmax_draw_rows(const float* x, int64_t stride, int rows, int vocab, const float* temperature,
                                    const double* uniform, int64_t* out, int threads) {
  if (rows < 0 || vocab <= 0 || (rows > 1 && stride < vocab)) return 2;
  return over_rows(rows, vocab, threads, false, [&](int r, RowScratch& s) {
    out[r] = softmax_draw_row(x + r * stride, vocab, temperature[r], uniform[r], s.sums.data());
  });
}
