// A decoder layer's element-wise work on the CPU, float32, AVX-512 or AVX2 (simd.h), one pass each:
//   ps_add_rms_norm: x += residual (in place, optional), out = x / sqrt(mean(x^2) + eps) * w
//   ps_silu_mul:     out = silu(gate) * up, from the fused [gate | up] projection
// (both also in bf16 where they hand rows to or take them from a bf16 linear layer: out rounded to
// bf16 bits as the linear would round its input, gate_up read as the bf16 bits the linear wrote,
// and the arithmetic in float32 as ever, so the bits are those of the float32 hand-off)
//   ps_head_rms_norm: each head's RMSNorm in place (Qwen3's q and k norms)
//   ps_rope:         rotate-half rotary embedding of q and k heads in place, by position
// torch runs each of these as five to seven operators, each its own pass over the activations
// and its own parallel region; on a short prefill or a decode step those fixed costs are most of
// their time. Rows are split over OpenMP threads (torch's runtime) only when there are enough of
// them to pay for the fork. Each row is computed the same way whatever the split.
#include <cmath>
#include <cstdint>

#include "simd.h"
#include "timers.h"
#include <omp.h>

#if defined(PS_SIMD)
namespace {

using ps::vf;

constexpr int64_t PARALLEL_FLOATS = 1 << 15;  // below this much work, one thread

inline int team(int64_t rows, int64_t row_floats, int threads) {
  return rows * row_floats >= PARALLEL_FLOATS && threads > 1 ? threads : 1;
}

using ps::exp_ps;

// a vector's first n values stored as float32, or rounded to bf16 bits
inline void store_first(float* p, vf a, int n) { ps::vstore_first(p, a, n); }
inline void store_first(uint16_t* p, vf a, int n) { ps::vstore_bf16_first(p, a, n); }

// out[d] = w[d] * (x[d] * inv) for the dim floats of a row (out may be x), float32 or bf16 bits.
template <typename Out>
inline void scale_row(const float* x, float inv, const float* w, Out* out, int dim) {
  const vf s = ps::vset1(inv);
  for (int d = 0; d < dim; d += 16) {
    const int m = dim - d;
    const vf v = ps::vmul(ps::vload_first(x + d, m), s);
    store_first(out + d, ps::vmul(ps::vload_first(w + d, m), v), m);
  }
}

}  // namespace
#endif

// out: float32 rows, or bf16 bits (uint16) where out_bf16 (ldo then counts bf16 elements)
extern "C" int ps_add_rms_norm(float* x, int64_t ldx, const float* residual, int64_t ldr, const float* w, float eps,
                               void* out, int64_t ldo, int rows, int dim, int out_bf16, int threads) {
#if !defined(PS_SIMD)
  (void)x; (void)ldx; (void)residual; (void)ldr; (void)w; (void)eps; (void)out; (void)ldo; (void)rows; (void)dim;
  (void)threads; (void)out_bf16;
  return 1;
#else
  ps::TimerScope timer(ps::kElementwise);
#pragma omp parallel for num_threads(team(rows, dim, threads)) schedule(static)
  for (int r = 0; r < rows; ++r) {
    float* xr = x + r * ldx;
    const float* rr = residual ? residual + r * ldr : nullptr;
    vf ss = ps::vzero();
    for (int d = 0; d < dim; d += 16) {
      const int m = dim - d;
      vf v = ps::vload_first(xr + d, m);
      if (rr) {
        v = ps::vadd(v, ps::vload_first(rr + d, m));
        ps::vstore_first(xr + d, v, m);
      }
      ss = ps::vfmadd(v, v, ss);
    }
    const float inv = 1.0f / std::sqrt(ps::vreduce_add(ss) / (float)dim + eps);
    if (out_bf16)
      scale_row(xr, inv, w, static_cast<uint16_t*>(out) + r * ldo, dim);
    else
      scale_row(xr, inv, w, static_cast<float*>(out) + r * ldo, dim);
  }
  return 0;
#endif
}

// x: rows of `heads` heads of `dim` floats (heads dense, rows ld apart); each head normalized in
// place, x = x / sqrt(mean(x^2) + eps) * w (w: dim floats): the per-head q and k norms of Qwen3.
extern "C" int ps_head_rms_norm(float* x, int64_t ld, int rows, int heads, int dim, const float* w, float eps,
                                int threads) {
#if !defined(PS_SIMD)
  (void)x; (void)ld; (void)rows; (void)heads; (void)dim; (void)w; (void)eps; (void)threads;
  return 1;
#else
  ps::TimerScope timer(ps::kElementwise);
#pragma omp parallel for num_threads(team(rows, (int64_t)heads * dim, threads)) schedule(static)
  for (int r = 0; r < rows; ++r) {
    for (int hd = 0; hd < heads; ++hd) {
      float* xh = x + r * ld + (int64_t)hd * dim;
      vf ss = ps::vzero();
      for (int d = 0; d < dim; d += 16) {
        const vf v = ps::vload_first(xh + d, dim - d);
        ss = ps::vfmadd(v, v, ss);
      }
      scale_row(xh, 1.0f / std::sqrt(ps::vreduce_add(ss) / (float)dim + eps), w, xh, dim);
    }
  }
  return 0;
#endif
}

// gate_up: rows of [gate (inter) | up (inter)], ld apart, float32 or bf16 bits where in_bf16; out:
// rows of inter, ldo apart, float32 or bf16 bits where out_bf16 (ld and ldo count elements of their
// own type).
extern "C" int ps_silu_mul(const void* gate_up, int64_t ld, void* out, int64_t ldo, int rows, int inter,
                           int in_bf16, int out_bf16, int threads) {
#if !defined(PS_SIMD)
  (void)gate_up; (void)ld; (void)out; (void)ldo; (void)rows; (void)inter; (void)threads; (void)in_bf16;
  (void)out_bf16;
  return 1;
#else
  ps::TimerScope timer(ps::kElementwise);
#pragma omp parallel for num_threads(team(rows, 2 * (int64_t)inter, threads)) schedule(static)
  for (int r = 0; r < rows; ++r) {
    const float* g = in_bf16 ? nullptr : static_cast<const float*>(gate_up) + r * ld;
    const uint16_t* g16 = in_bf16 ? static_cast<const uint16_t*>(gate_up) + r * ld : nullptr;
    for (int d = 0; d < inter; d += 16) {
      const int m = inter - d;
      const vf gv = in_bf16 ? ps::vload_bf16_first(g16 + d, m) : ps::vload_first(g + d, m);
      const vf uv = in_bf16 ? ps::vload_bf16_first(g16 + inter + d, m) : ps::vload_first(g + inter + d, m);
      const vf sig = ps::vdiv(ps::vset1(1.0f), ps::vadd(ps::vset1(1.0f), exp_ps(ps::vsub(ps::vzero(), gv))));
      const vf o = ps::vmul(ps::vmul(gv, sig), uv);
      if (out_bf16)
        store_first(static_cast<uint16_t*>(out) + r * ldo + d, o, m);
      else
        store_first(static_cast<float*>(out) + r * ldo + d, o, m);
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
#if !defined(PS_SIMD)
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
        const int m = h - i;
        const vf av = ps::vload_first(a + i, m), bv = ps::vload_first(b + i, m);
        const vf na = ps::vfnmadd(bv, ps::vload_first(s + i, m), ps::vmul(av, ps::vload_first(c + i, m)));
        const vf nb = ps::vfmadd(av, ps::vload_first(s + h + i, m), ps::vmul(bv, ps::vload_first(c + h + i, m)));
        ps::vstore_first(a + i, na, m);
        ps::vstore_first(b + i, nb, m);
      }
    }
  }
  return 0;
#endif
}
