// bfloat16 storage for the KV cache: a bf16 value is the upper 16 bits of a float32, so widening is
// a shift (exact) and narrowing rounds to nearest, ties to even (as torch's conversion does). The
// kernels compute in float32 whatever the cache holds: a bf16 cache row is widened into a float32
// row where a float32 cache row is read in place. Plain loops the compiler vectorizes.
#pragma once
#include <cstdint>
#include <cstring>

namespace ps {

inline float bf16_to_f32(uint16_t b) {
  const uint32_t u = (uint32_t)b << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);  // NaN stays a (quiet) NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

// A KV cache of float32 or bf16 elements: element i of it as float32, and stores into it.
struct KvStore {
  void* base;
  bool bf16;

  // n elements from element `at` on, as float32: in place for a float32 cache, else widened into buf
  const float* row(int64_t at, int n, float* buf) const {
    if (!bf16) return static_cast<const float*>(base) + at;
    const uint16_t* src = static_cast<const uint16_t*>(base) + at;
    for (int i = 0; i < n; ++i) buf[i] = bf16_to_f32(src[i]);
    return buf;
  }
  void read(int64_t at, int n, float* dst) const {
    if (!bf16) {
      std::memcpy(dst, static_cast<const float*>(base) + at, sizeof(float) * (size_t)n);
      return;
    }
    const uint16_t* src = static_cast<const uint16_t*>(base) + at;
    for (int i = 0; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
  }
  // asks for the cache lines of n elements from element `at` on: into L1 (`soon`), else into L2
  void prefetch(int64_t at, int64_t n, bool soon) const {
    const char* p = static_cast<const char*>(base) + at * (bf16 ? 2 : 4);
    const int64_t bytes = n * (bf16 ? 2 : 4);
    if (soon)
      for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 3);
    else
      for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 2);
  }
  void write(int64_t at, int n, const float* src) const {
    if (!bf16) {
      std::memcpy(static_cast<float*>(base) + at, src, sizeof(float) * (size_t)n);
      return;
    }
    uint16_t* dst = static_cast<uint16_t*>(base) + at;
    for (int i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
  }
};

// x[0 : n] rounded to bfloat16 precision in place (each value the float32 its bf16 widens to)
inline void round_to_bf16(float* x, int n) {
  for (int i = 0; i < n; ++i) x[i] = bf16_to_f32(f32_to_bf16(x[i]));
}

}  // namespace ps
