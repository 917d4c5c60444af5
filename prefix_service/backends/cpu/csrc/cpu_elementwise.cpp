// A decoder layer's element-wise work on the CPU, float32, AVX-512, one pass each:
//   ps_add_rms_norm: x += residual (in place, optional), out = x / sqrt(mean(x^2) + eps) * w
//   ps_silu_mul:     out = silu(gate) * up, from the fused [gate | up] projection
//   ps_head_rms_norm: each head's RMSNorm in place (Qwen3's q and k norms)
//   ps_rope:         rotate-half rotary embedding of q and k heads in place, by position
// torch runs each of these as five to seven operators, each its own pass over the activations
// and its own parallel region; on a short prefill or a decode step those fixed costs are most of
// their time. Rows are split over OpenMP threads (torch's runtime) only when there are enough of
// them to pay for the fork. Each row is computed the same way whatever the split.
#include <cmath>
#include <cstdint>

#include "timers.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <omp.h>

#include "simd_math.h"

#if defined(__AVX512F__)
namespace {

constexpr int64_t PARALLEL_FLOATS = 1 << 15;  // below this much work, one thread

inline int team(int64_t rows, int64_t row_floats, int threads) {
  return rows * row_floats >= PARALLEL_FLOATS && threads > 1 ? threads : 1;
}

inline __mmask16 lanes(int n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u); }

using ps::exp_ps;

// out[d] = w[d] * (x[d] * inv) for the dim floats of a row (out may be x).
inline void scale_row(const float* x, float inv, const float* w, float* out, int dim) {
  const __m512 s = _mm512_set1_ps(inv);
  for (int d = 0; d < dim; d += 16) {
    const __mmask16 m = lanes(dim - d);
    const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + d), s);
    _mm512_mask_storeu_ps(out + d, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, w + d), v));
  }
}

}  // namespace
#endif

extern "C" int ps_add_rms_norm(float* x, int64_t ldx, const float* residual, int64_t ldr, const float* w, float eps,
                               float* out, int64_t ldo, int rows, int dim, int threads) {
#if !defined(__AVX512F__)
  (void)x; (void)ldx; (void)residual; (void)ldr; (void)w; (void)eps; (void)out; (void)ldo; (void)rows; (void)dim;
  (void)threads;
  return 1;
#else
  ps::TimerScope timer(ps::kElementwise);
#pragma omp parallel for num_threads(team(rows, dim, threads)) schedule(static)
  for (int r = 0; r < rows; ++r) {
    float* xr = x + r * ldx;
    const float* rr = residual ? residual + r * ldr : nullptr;
    __m512 ss = _mm512_setzero_ps();
    for (int d = 0; d < dim; d += 16) {
      const __mmask16 m = lanes(dim - d);
      __m512 v = _mm512_maskz_loadu_ps(m, xr + d);
      if (rr) {
        v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, rr + d));
        _mm512_mask_storeu_ps(xr + d, m, v);
      }
      ss = _mm512_fmadd_ps(v, v, ss);
    }
    scale_row(xr, 1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / (float)dim + eps), w, out + r * ldo, dim);
  }
  return 0;
#endif
}

// x: rows of `heads` heads of `dim` floats (heads dense, rows ld apart); each head normalized in
// place, x = x / sqrt(mean(x^2) + eps) * w (w: dim floats): the per-head q and k norms of Qwen3.
extern "C" int ps_head_rms_norm(float* x, int64_t ld, int rows, int heads, int dim, const float* w, float eps,
                                int threads) {
#if !defined(__AVX512F__)
  (void)x; (void)ld; (void)rows; (void)heads; (void)dim; (void)w; (void)eps; (void)threads;
  return 1;
#else
  ps::TimerScope timer(ps::kElementwise);
#pragma omp parallel for num_threads(team(rows, (int64_t)heads * dim, threads)) schedule(static)
  for (int r = 0; r < rows; ++r) {
    for (int hd = 0; hd < heads; ++hd) {
      float* xh = x + r * ld + (int64_t)hd * dim;
      __m512 ss = _mm512_setzero_ps();
      for (int d = 0; d < dim; d += 16) {
        const __m512 v = _mm512_maskz_loadu_ps(lanes(dim - d), xh + d);
        ss = _mm512_fmadd_ps(v, v, ss);
      }
      scale_row(xh, 1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / (float)dim + eps), w, xh, dim);
    }
  }
  return 0;
#endif
}

// gate_up: rows of [gate (inter) | up (inter)], ld apart; out: rows of inter, ldo apart.
extern "C" int ps_silu_mul(const float* gate_up, int64_t ld, float* out, int64_t ldo, int rows, int inter,
                           int threads) {
#if !defined(__AVX512F__)
  (void)gate_up; (void)ld; (void)out; (void)ldo; (void)rows; (void)inter; (void)threads;
  return 1;
#else
  ps::TimerScope timer(ps::kElementwise);
#pragma omp parallel for num_threads(team(rows, 2 * (int64_t)inter, threads)) schedule(static)
  for (int r = 0; r < rows; ++r) {
    const float* g = gate_up + r * ld;
    const float* u = g + inter;
    float* o = out + r * ldo;
    for (int d = 0; d < inter; d += 16) {
      const __mmask16 m = lanes(inter - d);
      const __m512 gv = _mm512_maskz_loadu_ps(m, g + d);
      const __m512 sig = _mm512_div_ps(_mm512_set1_ps(1.0f),
                                       _mm512_add_ps(_mm512_set1_ps(1.0f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
      _mm512_mask_storeu_ps(o + d, m, _mm512_mul_ps(_mm512_mul_ps(gv, sig), _mm512_maskz_loadu_ps(m, u + d)));
    }
  }
  return 0;
#endif
}

// x: rows of `heads` heads of `dim` floats (heads dense, rows ld apart), rotated in place:
// with h = dim / 2, c = cos[pos], s = sin[pos] (tables [positions][dim]),
//   x'[i] = x[i] c[i] - x[i + h] s[i],   x'[i + h] = x[i + h] c[i + h] + x[i] s[i + h]   (i < h).
extern "C" int ps_rope(float* x, int64_t ld, int rows, int heads, int dim, const int64_t* positions,
                       const float* cos_table, const float* sin_table, int threads) {
#if !defined(__AVX512F__)
  (void)x; (void)ld; (void)rows; (void)heads; (void)dim; (void)positions; (void)cos_table; (void)sin_table;
  (void)threads;
  return 1;
#else
  ps::TimerScope timer(ps::kElementwise);
  if (dim % 2 != 0) return 2;
  const int h = dim / 2;
#pragma omp parallel for num_threads(team(rows, (int64_t)heads * dim, threads)) schedule(static)
  for (int r = 0; r < rows; ++r) {
    const float* c = cos_table + positions[r] * dim;
    const float* s = sin_table + positions[r] * dim;
    for (int hd = 0; hd < heads; ++hd) {
      float* a = x + r * ld + (int64_t)hd * dim;
      float* b = a + h;
      for (int i = 0; i < h; i += 16) {
        const __mmask16 m = lanes(h - i);
        const __m512 av = _mm512_maskz_loadu_ps(m, a + i), bv = _mm512_maskz_loadu_ps(m, b + i);
        const __m512 na = _mm512_fnmadd_ps(bv, _mm512_maskz_loadu_ps(m, s + i),
                                           _mm512_mul_ps(av, _mm512_maskz_loadu_ps(m, c + i)));
        const __m512 nb = _mm512_fmadd_ps(av, _mm512_maskz_loadu_ps(m, s + h + i),
                                          _mm512_mul_ps(bv, _mm512_maskz_loadu_ps(m, c + h + i)));
        _mm512_mask_storeu_ps(a + i, m, na);
        _mm512_mask_storeu_ps(b + i, m, nb);
      }
    }
  }
  return 0;
#endif
}
