// The vector of 16 floats the native CPU kernels compute with, on two instruction sets:
//   AVX-512F: one __m512 register;
//   AVX2 + FMA: two __m256 registers (low and high 8 lanes).
// Kernels are written once against these functions; the panel layouts (16 floats, 64 bytes) are
// the same on both. With AVX2 a register tile must hold half as many vectors (16 registers of 8
// floats, not 32 of 16): REG_PANELS says how many 16-float panels one tile may keep in flight.
// Masks are "the first n lanes" (n clamped to [0, 16]): every partial vector the kernels touch is
// the start of a row or panel. Masked loads never read the lanes they leave out.
#pragma once
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define PS_SIMD 1
#include <immintrin.h>

#include <cstdint>

namespace ps {

constexpr int LANES = 16;

#if defined(__AVX512F__)
constexpr int ISA = 512;
constexpr int REG_PANELS = 4;

struct vf {
  __m512 v;
};

inline __mmask16 first_mask(int n) {
  return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1u);
}
inline vf vzero() { return {_mm512_setzero_ps()}; }
inline vf vset1(float x) { return {_mm512_set1_ps(x)}; }
inline vf vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void vstore(float* p, vf a) { _mm512_storeu_ps(p, a.v); }
inline vf vload_first(const float* p, int n) { return {_mm512_maskz_loadu_ps(first_mask(n), p)}; }
// 16 int8 values widened to float32 (exactly)
inline vf vload_i8(const int8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
// 16 pairs of bf16 values (uint16 bits; a pair: its first value in the low half of a 32-bit lane), the
// first or the second value of each widened to float32 (exactly): one load and one integer operation
// for 16 floats
inline vf vload_bf16_even(const uint16_t* p) {
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(p), 16))};
}
inline vf vload_bf16_odd(const uint16_t* p) {
  return {_mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512(p), _mm512_set1_epi32(int(0xffff0000u))))};
}
inline void vstore_first(float* p, vf a, int n) { _mm512_mask_storeu_ps(p, first_mask(n), a.v); }
inline vf vadd(vf a, vf b) { return {_mm512_add_ps(a.v, b.v)}; }
inline vf vsub(vf a, vf b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline vf vmul(vf a, vf b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline vf vdiv(vf a, vf b) { return {_mm512_div_ps(a.v, b.v)}; }
inline vf vmax(vf a, vf b) { return {_mm512_max_ps(a.v, b.v)}; }
inline vf vmin(vf a, vf b) { return {_mm512_min_ps(a.v, b.v)}; }
inline vf vfmadd(vf a, vf b, vf c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }    // a b + c
inline vf vfnmadd(vf a, vf b, vf c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }  // c - a b
// acc with its first n lanes replaced by max(acc, x)
inline vf vmax_first(vf acc, vf x, int n) { return {_mm512_mask_max_ps(acc.v, first_mask(n), acc.v, x.v)}; }
// a with the lanes from n on zeroed
inline vf vkeep_first(vf a, int n) { return {_mm512_maskz_mov_ps(first_mask(n), a.v)}; }
// bit i set where lane i of a is greater than t (never for a NaN)
inline unsigned vgt_bits(vf a, float t) { return _mm512_cmp_ps_mask(a.v, _mm512_set1_ps(t), _CMP_GT_OQ); }
inline float vreduce_add(vf a) { return _mm512_reduce_add_ps(a.v); }
inline float vreduce_max(vf a) { return _mm512_reduce_max_ps(a.v); }
inline vf vround(vf a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
// a 2^n, n integral
inline vf vscale2(vf a, vf n) { return {_mm512_scalef_ps(a.v, n.v)}; }

// The bf16 bits of 16 float32 values (u: their bits), in the low half of each 32-bit lane, rounded to
// nearest, ties to even (a NaN is the caller's to handle)
inline __m512i bf16_bits(__m512i u) {
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
}

// The same, NaN included, as c10::BFloat16 rounds it (0x7fc0)
inline __m512i bf16_round_bits(__m512 a) {
  return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), bf16_bits(_mm512_castps_si512(a)),
                                 _mm512_set1_epi32(0x7fc0));
}

// bf16 rows (uint16 bits) in and out: the first n values widened (exactly; the other lanes 0), and the
// first n of a rounded to bf16 (bf16_round_bits)
#if defined(__AVX512BW__) && defined(__AVX512VL__)
inline vf vload_bf16_first(const uint16_t* p, int n) {
  const __m256i h = _mm256_maskz_loadu_epi16(first_mask(n), p);
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
}
inline void vstore_bf16_first(uint16_t* p, vf a, int n) {
  _mm256_mask_storeu_epi16(p, first_mask(n), _mm512_cvtepi32_epi16(bf16_round_bits(a.v)));
}
#else
inline vf vload_bf16_first(const uint16_t* p, int n) {
  alignas(32) uint16_t t[16] = {};
  for (int i = 0; i < 16 && i < n; ++i) t[i] = p[i];
  const __m256i h = _mm256_load_si256(reinterpret_cast<const __m256i*>(t));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
}
inline void vstore_bf16_first(uint16_t* p, vf a, int n) {
  alignas(32) uint16_t t[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(t), _mm512_cvtepi32_epi16(bf16_round_bits(a.v)));
  for (int i = 0; i < 16 && i < n; ++i) p[i] = t[i];
}
#endif

// The 16 x 16 floats of r[0..15] transposed: afterwards r[k] holds what was column k.
inline void transpose16(vf r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i].v, r[i + 1].v);
    t[i + 1] = _mm512_unpackhi_ps(r[i].v, r[i + 1].v);
  }
  const auto lo = [](__m512 a, __m512 b) {
    return _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
  };
  const auto hi = [](__m512 a, __m512 b) {
    return _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
  };
  for (int i = 0; i < 16; i += 4) {
    r[i].v = lo(t[i], t[i + 2]);
    r[i + 1].v = hi(t[i], t[i + 2]);
    r[i + 2].v = lo(t[i + 1], t[i + 3]);
    r[i + 3].v = hi(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 16; i += 8)
    for (int k = 0; k < 4; ++k) {
      t[i + k] = _mm512_shuffle_f32x4(r[i + k].v, r[i + 4 + k].v, 0x88);
      t[i + 4 + k] = _mm512_shuffle_f32x4(r[i + k].v, r[i + 4 + k].v, 0xdd);
    }
  for (int k = 0; k < 8; ++k) {
    r[k].v = _mm512_shuffle_f32x4(t[k], t[8 + k], 0x88);
    r[8 + k].v = _mm512_shuffle_f32x4(t[k], t[8 + k], 0xdd);
  }
}

#else  // AVX2 + FMA
constexpr int ISA = 256;
constexpr int REG_PANELS = 1;

struct vf {
  __m256 lo, hi;
};

// lane masks for the first n lanes of the low and high halves
inline __m256i half_mask(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline vf vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline vf vset1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline vf vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline vf vload_i8(const int8_t* p) {
  const auto eight = [](const int8_t* q) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
  };
  return {eight(p), eight(p + 8)};
}
inline vf vload_bf16_even(const uint16_t* p) {
  const auto eight = [](const uint16_t* q) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)), 16));
  };
  return {eight(p), eight(p + 16)};
}
inline vf vload_bf16_odd(const uint16_t* p) {
  const auto eight = [](const uint16_t* q) {
    return _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)),
                                                _mm256_set1_epi32(int(0xffff0000u))));
  };
  return {eight(p), eight(p + 16)};
}
inline void vstore(float* p, vf a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline vf vload_first(const float* p, int n) {
  if (n >= 16) return vload(p);
  return {_mm256_maskload_ps(p, half_mask(n)), _mm256_maskload_ps(p + 8, half_mask(n - 8))};
}
inline void vstore_first(float* p, vf a, int n) {
  if (n >= 16) return vstore(p, a);
  _mm256_maskstore_ps(p, half_mask(n), a.lo);
  _mm256_maskstore_ps(p + 8, half_mask(n - 8), a.hi);
}
inline vf vadd(vf a, vf b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline vf vsub(vf a, vf b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline vf vmul(vf a, vf b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline vf vdiv(vf a, vf b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline vf vmax(vf a, vf b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline vf vmin(vf a, vf b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline vf vfmadd(vf a, vf b, vf c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline vf vfnmadd(vf a, vf b, vf c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline vf vmax_first(vf acc, vf x, int n) {
  const vf m = vmax(acc, x);
  return {_mm256_blendv_ps(acc.lo, m.lo, _mm256_castsi256_ps(half_mask(n))),
          _mm256_blendv_ps(acc.hi, m.hi, _mm256_castsi256_ps(half_mask(n - 8)))};
}
inline vf vkeep_first(vf a, int n) {
  return {_mm256_and_ps(a.lo, _mm256_castsi256_ps(half_mask(n))),
          _mm256_and_ps(a.hi, _mm256_castsi256_ps(half_mask(n - 8)))};
}
// bit i set where lane i of a is greater than t (never for a NaN)
inline unsigned vgt_bits(vf a, float t) {
  const __m256 tt = _mm256_set1_ps(t);
  return (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(a.lo, tt, _CMP_GT_OQ)) |
         ((unsigned)_mm256_movemask_ps(_mm256_cmp_ps(a.hi, tt, _CMP_GT_OQ)) << 8);
}
inline float hsum8(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float vreduce_add(vf a) { return hsum8(_mm256_add_ps(a.lo, a.hi)); }
inline float vreduce_max(vf a) {
  const __m256 m8 = _mm256_max_ps(a.lo, a.hi);
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
inline vf vround(vf a) {
  return {_mm256_round_ps(a.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
          _mm256_round_ps(a.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
// a 2^n for integral n in [-126, 127]: 2^n built in the exponent field
inline __m256 pow2_8(__m256 n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline vf vscale2(vf a, vf n) { return {_mm256_mul_ps(a.lo, pow2_8(n.lo)), _mm256_mul_ps(a.hi, pow2_8(n.hi))}; }

// bf16 rows (uint16 bits) in and out, as in the AVX-512 section
inline __m256i bf16_round_bits8(__m256 a) {
  const __m256i u = _mm256_castps_si256(a);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)));
}
inline vf vload_bf16_first(const uint16_t* p, int n) {
  alignas(32) uint16_t t[16] = {};
  const uint16_t* src = p;
  if (n < 16) {
    for (int i = 0; i < n; ++i) t[i] = p[i];
    src = t;
  }
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  const auto widen = [](__m128i x) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16)); };
  return {widen(_mm256_castsi256_si128(h)), widen(_mm256_extracti128_si256(h, 1))};
}
inline void vstore_bf16_first(uint16_t* p, vf a, int n) {
  // packus interleaves the halves' 128-bit lanes: the permute puts the 16 values back in order
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bf16_round_bits8(a.lo), bf16_round_bits8(a.hi)),
                                                  0xD8);
  if (n >= 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), packed);
    return;
  }
  alignas(32) uint16_t t[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(t), packed);
  for (int i = 0; i < n; ++i) p[i] = t[i];
}

// r[0..7] (8 x 8) transposed in place.
inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int k = 0; k < 4; ++k) {
    r[k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x20);
    r[4 + k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x31);
  }
}

// The 16 x 16 floats of r[0..15] transposed: afterwards r[k] holds what was column k. Four 8 x 8
// transposes: column k < 8 is the low halves' column k, rows 0-7 then 8-15; k >= 8 the high halves'.
inline void transpose16(vf r[16]) {
  __m256 a[8], b[8], c[8], d[8];  // low halves of rows 0-7, 8-15; high halves of rows 0-7, 8-15
  for (int i = 0; i < 8; ++i) {
    a[i] = r[i].lo;
    b[i] = r[8 + i].lo;
    c[i] = r[i].hi;
    d[i] = r[8 + i].hi;
  }
  transpose8(a);
  transpose8(b);
  transpose8(c);
  transpose8(d);
  for (int k = 0; k < 8; ++k) {
    r[k] = {a[k], b[k]};
    r[8 + k] = {c[k], d[k]};
  }
}
#endif

// e^x: range reduction by ln 2, a degree-7 polynomial (Cephes' expf coefficients), then scale
// by 2^n. x is clamped to [-87, 88] (e^-87 ~ 1.6e-38, e^88 ~ 1.7e38).
inline vf exp_ps(vf x) {
  x = vmin(vmax(x, vset1(-87.0f)), vset1(88.0f));
  const vf n = vround(vmul(x, vset1(1.44269504088896341f)));
  vf r = vfnmadd(n, vset1(0.693359375f), x);
  r = vfnmadd(n, vset1(-2.12194440e-4f), r);
  vf p = vset1(1.9875691500e-4f);
  p = vfmadd(p, r, vset1(1.3981999507e-3f));
  p = vfmadd(p, r, vset1(8.3334519073e-3f));
  p = vfmadd(p, r, vset1(4.1665795894e-2f));
  p = vfmadd(p, r, vset1(1.6666665459e-1f));
  p = vfmadd(p, r, vset1(5.0000001201e-1f));
  p = vfmadd(p, vmul(r, r), vadd(r, vset1(1.0f)));
  return vscale2(p, n);
}

}  // namespace ps
#endif
