// Rounding float32 to bf16 as c10::BFloat16 rounds a number (to nearest, ties to even; a NaN becomes
// 0x7fc0), sixteen values at a time where the CPU has AVX-512, and the pairs the bf16 dot product
// multiplies: the oneDNN library's template attention (its queries and probabilities) and its
// few-row linear kernel (its rows and outputs).
#pragma once
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

#include "simd.h"  // ps::bf16_bits and ps::bf16_round_bits, the native kernels' rounding too

namespace ps_onednn {

#if defined(__AVX512F__)
// 16 float32 values rounded to bf16 and widened back (exact): float(c10::BFloat16(x)) for each
inline __m512 round_bf16(__m512 x) { return _mm512_castsi512_ps(_mm512_slli_epi32(ps::bf16_round_bits(x), 16)); }
#endif

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// The CPU's bf16 dot product (vdpbf16ps), which the template attention's products and the few-row
// linear kernel run on where it has one
constexpr bool kDotBf16 = true;

inline __m512bh pairs(__m512i x) { return (__m512bh)x; }
inline __m512bh broadcast_pair(const c10::BFloat16* p) {  // p[0], p[1] in every lane's pair
  int32_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return (__m512bh)_mm512_set1_epi32(bits);
}
#else
constexpr bool kDotBf16 = false;
#endif

// dst[0, n) = src[0, n) rounded to bf16, 16 at a time where the CPU has AVX-512 (the scalar
// constructor's NaN test keeps the compiler from vectorizing it)
inline void to_bf16(const float* src, int64_t n, c10::BFloat16* dst) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm512_cvtepi32_epi16(ps::bf16_round_bits(_mm512_loadu_ps(src + i))));
#endif
  for (; i < n; ++i) dst[i] = c10::BFloat16(src[i]);
}

}  // namespace ps_onednn
