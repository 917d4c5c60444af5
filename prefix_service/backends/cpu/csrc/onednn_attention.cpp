// A pinned template's part of attention as matrix products through oneDNN's brgemm micro-kernel
// (at::native::cpublas::brgemm, AMX tiles where the CPU has them): bf16 operands, float32 sums.
//
// The native kernels (cpu_attention.cpp) walk a template's keys with float32 vector FMAs. Here the
// query rows that read one KV head of a template are the rows of two products per chunk of kTK
// keys: S = Q K^T (Q rounded to bf16, already scaled), then, after the online softmax over S in
// float32, O = alpha O + P V with P rounded to bf16. The result is each row's softmax state after
// the template (unnormalised output, running maximum, sum of exponentials), the state the native
// kernels carry on from over the rest of the context.
//
// A template is packed once, when it is pinned (ps_onednn_template_pack): per KV head, K^T and V
// in chunks of kTK keys (zero past the template's end), VNNI-packed for the micro-kernel where it
// takes VNNI (AMX). Where the CPU has AVX512-BF16 but no AMX (AMD Zen 4 and later, Intel Cooper
// Lake), the two products run instead as this file's own loops of bf16 dot-product instructions
// (vdpbf16ps: 16 float32 sums, each adding two bf16 products, per instruction) over the same
// VNNI pairs (the brgemm micro-kernel takes bf16 only on AMX, and torch's fallback GEMM is 2-3x
// slower than the native float32 kernels), a few rows at a time with the softmax between the two
// products while the chunk's K and V are in L1 (attend_dot). Elsewhere plain row-major for that
// fallback GEMM. Built
// into the oneDNN library with onednn_linear.cpp (onednn.py); its entry points report failures
// through ps_onednn_last_error.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "onednn_bf16.h"
#include "onednn_error.h"
#include "onednn_scratch.h"
#include "simd.h"

namespace {

using ps_onednn::grown;
using ps_onednn::guarded;
using ps_onednn::kDotBf16;
using ps_onednn::last_error;
using ps_onednn::to_bf16;
#if defined(__AVX512F__)
using ps::bf16_bits;
#endif

std::atomic<int64_t> attend_calls{0};  // ps_onednn_template_attend's calls, for ps_onednn_template_calls
std::atomic<int64_t> causal_calls{0};  // ps_onednn_causal_attend's, for ps_onednn_causal_calls

constexpr int64_t kTK = 64;  // template keys per chunk (the N of S = Q K^T, the K of P V)
constexpr int64_t kTM = 32;  // query rows per pair of products (two AMX tiles of 16)

struct TemplateKV {
  int64_t r_len = 0, hkv = 0, d = 0, chunks = 0;
  bool vnni = false;  // AMX: brgemm on VNNI-packed chunks
  bool dot = false;   // AVX512-BF16 without AMX: attend_dot on VNNI pairs
  // k: [hkv][chunks][d][kTK] (K^T of each chunk), v: [hkv][chunks][kTK][d], bf16, each chunk
  // VNNI-packed when vnni; when dot, k [hkv][chunks][d / 2][kTK][2] and v [hkv][chunks][kTK / 2][d][2]
  // (the pairs a dot-product instruction multiplies)
  at::Tensor k, v;
};

constexpr int kRB = 4;  // the dot products: rows per block of accumulators (4 rows x 4 vectors of 16 sums)


// The kernel a template of head size d multiplies with on a CPU where oneDNN's brgemm takes
// VNNI-packed bf16 (amx) and this file's dot products are built (dot): 2 oneDNN's brgemm
// micro-kernel (AMX, VNNI-packed chunks) for head sizes of 16, 32, 48 or 64 (oneDNN packs V's
// chunks, [kTK][d], only with a leading dimension of one to four whole tiles), 1 the AVX512-BF16
// dot products (head sizes a multiple of 16), 0 torch's fallback GEMM.
int kernel_rule(int64_t d, bool amx, bool dot) {
  if (amx && d % 16 == 0 && d <= 64) return 2;
  return dot && d % 16 == 0 ? 1 : 0;
}

// The kernel for head size d here, using none above `most` (2: any; 1: not AMX; 0: the fallback GEMM).
int kernel_for(int64_t d, int most) {
  return kernel_rule(d, most >= 2 && at::native::cpublas::could_pack(at::kBFloat16), most >= 1 && kDotBf16);
}

// Per-thread scratch, grown and never shrunk: the rows' queries in bf16, a chunk's scores and
// probabilities, the rows' outputs.
struct Scratch {
  std::vector<c10::BFloat16> q, p;
  std::vector<float> s, o;
};
thread_local Scratch scratch;


#if defined(__AVX512F__)
// e^x for x <= 0 (a score less its row's maximum) or a little above (at most kLazy, attend_dot),
// to well within the bf16 rounding P goes through: x = n ln 2 + f, |f| <= ln 2 / 2, e^f by its
// degree-5 Taylor polynomial (relative error below 2.5e-6, against bf16's 2^-9), scaled by 2^n; x
// below -87 is clamped (e^-87 ~ 1.6e-38).
inline __m512 exp_small(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147180559945f), x);
  __m512 p = _mm512_set1_ps(1.0f / 120.0f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}
#endif

#if defined(__AVX512F__)
// p[j] = e^(src[j] - m) rounded to bf16 for j < n, 0 for n <= j < kTK; returns acc plus those rounded
// values, lane by lane (e^(src - m) may exceed 1 by up to e^kLazy in attend_dot, never NaN)
inline __m512 exp_round_add(const float* src, int n, float m, c10::BFloat16* p, __m512 acc) {
  const __m512 mb = _mm512_set1_ps(m);
  #pragma GCC unroll 4
  for (int j = 0; j < kTK; j += ps::LANES) {
    const __m512 e = _mm512_maskz_mov_ps(ps::first_mask(n - j), exp_small(_mm512_sub_ps(_mm512_loadu_ps(src + j), mb)));
#if defined(__AVX512BF16__)
    // one instruction for the rounding: to nearest even, as bf16_bits, and the same bits here (the
    // exponentials are 0 or normal numbers, e^-87 and up, where its flush of subnormals cannot act)
    const __m256i b = (__m256i)_mm512_cvtneps_pbh(e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j), b);
    acc = _mm512_add_ps(acc, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
#else
    const __m512i r = bf16_bits(_mm512_castps_si512(e));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j), _mm512_cvtepi32_epi16(r));
    acc = _mm512_add_ps(acc, _mm512_castsi512_ps(_mm512_slli_epi32(r, 16)));
#endif
  }
  return acc;
}
#endif

// dst[j] = exp(src[j] - m) for j < n, 0 for n <= j < kTK; returns the sum of dst rounded to bf16,
// each value rounded to bf16 into p (the weights P V multiplies)
float exp_row(const float* src, int n, float m, c10::BFloat16* p) {
#if defined(__AVX512F__)
  const __m512 sum = exp_round_add(src, n, m, p, _mm512_setzero_ps());
  return _mm512_reduce_add_ps(sum);
#else
  float sum = 0.0f;
#if defined(PS_SIMD)
  alignas(64) float e[kTK];
  const ps::vf mb = ps::vset1(m);
  for (int j = 0; j < kTK; j += ps::LANES) ps::vstore(e + j, ps::vkeep_first(ps::exp_ps(ps::vsub(ps::vload(src + j), mb)), n - j));
  for (int j = 0; j < kTK; ++j) {
    p[j] = c10::BFloat16(e[j]);
    sum += static_cast<float>(p[j]);
  }
#else
  for (int j = 0; j < kTK; ++j) {
    p[j] = c10::BFloat16(j < n ? std::exp(src[j] - m) : 0.0f);
    sum += static_cast<float>(p[j]);
  }
#endif
  return sum;
#endif
}

// The larger of init and the first n (<= kTK) of a row's scores
float row_max(const float* sr, int n, float init) {
#if defined(PS_SIMD)
  ps::vf acc = ps::vset1(init);
  for (int j = 0; j < n; j += ps::LANES) acc = ps::vmax_first(acc, ps::vload_first(sr + j, n - j), n - j);
  return ps::vreduce_max(acc);
#else
  for (int j = 0; j < n; ++j) init = std::max(init, sr[j]);
  return init;
#endif
}

// o[0, d) *= alpha
void scale_row(float* o, int64_t d, float alpha) {
#if defined(PS_SIMD)
  const ps::vf a = ps::vset1(alpha);
  for (int64_t e = 0; e < d; e += ps::LANES) {
    const int n = static_cast<int>(std::min<int64_t>(ps::LANES, d - e));
    ps::vstore_first(o + e, ps::vmul(ps::vload_first(o + e, n), a), n);
  }
#else
  for (int64_t e = 0; e < d; ++e) o[e] *= alpha;
#endif
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
using ps_onednn::broadcast_pair;
using ps_onednn::pairs;

// The loops over rows and vectors below are unrolled, so the accumulators stay in registers: the
// library builds at -O2, which would keep them on the stack (2.2x slower).

// s [kRB][kTK] = q [kRB][d] (bf16, rows d apart) times a chunk's K^T, k [d / 2][kTK][2]
inline void scores_rows(const c10::BFloat16* q, int64_t d, const c10::BFloat16* k, float* s) {
  __m512 acc[kRB][4];
  #pragma GCC unroll 4
  for (int i = 0; i < kRB; ++i)
    #pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) acc[i][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < d / 2; ++p) {
    const c10::BFloat16* kp = k + p * kTK * 2;
    __m512bh kv[4];
    #pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) kv[v] = pairs(_mm512_loadu_si512(kp + v * 32));
    #pragma GCC unroll 4
    for (int i = 0; i < kRB; ++i) {
      const __m512bh a = broadcast_pair(q + i * d + 2 * p);
      #pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], a, kv[v]);
    }
  }
  #pragma GCC unroll 4
  for (int i = 0; i < kRB; ++i)
    #pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) _mm512_store_ps(s + i * kTK + v * 16, acc[i][v]);
}

// o[0, kRB)[e0, e0 + 16 NV) (rows d apart) += p [kRB][kTK] (bf16) times columns e0.. of a chunk's V,
// v [kTK / 2][d][2]
template <int NV>
inline void values_rows(const c10::BFloat16* p, const c10::BFloat16* v, int64_t d, int64_t e0, float* o) {
  __m512 acc[kRB][NV];
  #pragma GCC unroll 4
  for (int i = 0; i < kRB; ++i)
    #pragma GCC unroll 4
    for (int w = 0; w < NV; ++w) acc[i][w] = _mm512_loadu_ps(o + i * d + e0 + w * 16);
  for (int64_t j = 0; j < kTK / 2; ++j) {
    const c10::BFloat16* vp = v + (j * d + e0) * 2;
    __m512bh vv[NV];
    #pragma GCC unroll 4
    for (int w = 0; w < NV; ++w) vv[w] = pairs(_mm512_loadu_si512(vp + w * 32));
    #pragma GCC unroll 4
    for (int i = 0; i < kRB; ++i) {
      const __m512bh a = broadcast_pair(p + i * kTK + 2 * j);
      #pragma GCC unroll 4
      for (int w = 0; w < NV; ++w) acc[i][w] = _mm512_dpbf16_ps(acc[i][w], a, vv[w]);
    }
  }
  #pragma GCC unroll 4
  for (int i = 0; i < kRB; ++i)
    #pragma GCC unroll 4
    for (int w = 0; w < NV; ++w) _mm512_storeu_ps(o + i * d + e0 + w * 16, acc[i][w]);
}

constexpr float kLazy = 8.0f;  // how far a row's scores may rise above its reference before it moves

// The dot products' path over mm rows (a multiple of kRB; padding rows are zero queries) of qb:
// for each chunk of kTK keys and block of kRB rows, the block's scores (into L1), their
// exponentials rounded to bf16 into the block's P, and P V added into the rows' outputs ob
// (zeroed by the caller), while the chunk's K and V stay in L1. Each row's exponentials are taken
// against a reference score that moves (rescaling what came before) only when a chunk's scores
// pass it by more than kLazy, so rescaling is rare and a chunk needs no reduction across lanes;
// its sum of exponentials and its largest score are kept as 16 lanes each. At the end each row's
// output and sum are moved to its largest score: m and l receive the state's maximum and sum.
// visible (null: every key): row r sees the first visible[r] keys only (a causal prompt's own keys).
void attend_dot(const c10::BFloat16* qb, int64_t d, const c10::BFloat16* kh, const c10::BFloat16* vh, int64_t chunks,
                int64_t r_len, int mm, float* ob, float* m, float* l, const int* visible = nullptr) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const int64_t chunk_k = d * kTK;
  alignas(64) float sb[kRB * kTK];
  alignas(64) c10::BFloat16 pb[kRB * kTK];
  __m512 lsum[kTM], top[kTM];  // per row: 16 lanes of its sum and of its largest score
  float ref[kTM];              // per row: the score its exponentials are taken against
  for (int r = 0; r < mm; ++r) {
    lsum[r] = _mm512_setzero_ps();
    top[r] = _mm512_set1_ps(-kInf);
    ref[r] = -kInf;
  }
  for (int64_t c = 0; c < chunks; ++c) {
    const int nk = static_cast<int>(std::min<int64_t>(kTK, r_len - c * kTK));
    const c10::BFloat16* kc = kh + c * chunk_k;
    const c10::BFloat16* vc = vh + c * chunk_k;
    for (int r = 0; r < mm; r += kRB) {
      scores_rows(qb + r * d, d, kc, sb);
      for (int i = 0; i < kRB; ++i) {
        const int row = r + i;
        // the keys this row sees in the chunk: all but those past the template's end (or past the row's own)
        const int n = visible == nullptr ? nk : static_cast<int>(std::clamp<int64_t>(visible[row] - c * kTK, 0, nk));
        __m512 x[4];
        #pragma GCC unroll 4
        for (int v = 0; v < 4; ++v)  // the keys it does not see: no score
          x[v] = _mm512_mask_load_ps(_mm512_set1_ps(-kInf), ps::first_mask(n - v * 16), sb + i * kTK + v * 16);
        const __m512 hi = _mm512_max_ps(_mm512_max_ps(x[0], x[1]), _mm512_max_ps(x[2], x[3]));
        top[row] = _mm512_max_ps(top[row], hi);
        if (_mm512_cmp_ps_mask(hi, _mm512_set1_ps(ref[row] + kLazy), _CMP_GT_OQ) != 0) {  // the reference moves
          const float moved = _mm512_reduce_max_ps(hi);
          const float alpha = std::exp(ref[row] - moved);  // 0 on the first chunk (reference -inf)
          lsum[row] = _mm512_mul_ps(lsum[row], _mm512_set1_ps(alpha));
          if (c > 0) scale_row(ob + row * d, d, alpha);
          ref[row] = moved;
        }
        // e^(score - reference), at most e^kLazy, rounded into the block's P; 0 for the keys it does not see
        lsum[row] = exp_round_add(sb + i * kTK, n, ref[row], pb + i * kTK, lsum[row]);
      }
      int64_t e0 = 0;  // the block's outputs, 64 columns at a time
      for (; e0 + 64 <= d; e0 += 64) values_rows<4>(pb, vc, d, e0, ob + r * d);
      switch ((d - e0) / 16) {
        case 3: values_rows<3>(pb, vc, d, e0, ob + r * d); break;
        case 2: values_rows<2>(pb, vc, d, e0, ob + r * d); break;
        case 1: values_rows<1>(pb, vc, d, e0, ob + r * d); break;
        default: break;
      }
    }
  }
  for (int r = 0; r < mm; ++r) {  // each row's state at its largest score
    m[r] = _mm512_reduce_max_ps(top[r]);
    const float alpha = std::exp(ref[r] - m[r]);
    l[r] = _mm512_reduce_add_ps(lsum[r]) * alpha;
    if (alpha != 1.0f) scale_row(ob + r * d, d, alpha);
  }
}
#else
void attend_dot(const c10::BFloat16*, int64_t, const c10::BFloat16*, const c10::BFloat16*, int64_t, int64_t, int,
                float*, float*, float*, const int* = nullptr) {}
#endif

// Rows [0, rows) of q (scaled already; rows q_stride floats apart) over head h of the template:
// o (rows ld_o apart), m, l receive each row's state after it.
void attend(const TemplateKV& t, int64_t h, const float* q, int64_t q_stride, int rows, float* o, int64_t ld_o,
            float* m, float* l) {
  const int64_t d = t.d, chunk_k = d * kTK;
  const auto* kh = static_cast<const c10::BFloat16*>(t.k.data_ptr()) + h * t.chunks * chunk_k;
  const auto* vh = static_cast<const c10::BFloat16*>(t.v.data_ptr()) + h * t.chunks * chunk_k;
  c10::BFloat16* qb = grown(scratch.q, kTM * d);
  float* ob = grown(scratch.o, kTM * d);
  c10::BFloat16* pb = t.dot ? nullptr : grown(scratch.p, kTM * kTK);
  float* s = t.dot ? nullptr : grown(scratch.s, kTM * kTK);
  float mi[kTM], li[kTM];
  for (int r0 = 0; r0 < rows; r0 += kTM) {
    // rows, padded to whole AMX tiles (brgemm) or blocks of accumulators (the dot products)
    const int mr = std::min<int>(kTM, rows - r0), pad = t.dot ? kRB : 16, mm = (mr + pad - 1) / pad * pad;
    for (int r = 0; r < mr; ++r) to_bf16(q + (r0 + r) * q_stride, d, qb + r * d);
    std::fill(qb + mr * d, qb + mm * d, c10::BFloat16(0.0f));  // padding rows
    std::fill(ob, ob + mm * d, 0.0f);
    if (t.dot) {
      attend_dot(qb, d, kh, vh, t.chunks, t.r_len, mm, ob, mi, li);
    } else {
      std::fill(pb, pb + mm * kTK, c10::BFloat16(0.0f));  // padding rows keep P = 0
      for (int r = 0; r < mr; ++r) {
        mi[r] = -std::numeric_limits<float>::infinity();
        li[r] = 0.0f;
      }
      for (int64_t c = 0; c < t.chunks; ++c) {
        const int nk = static_cast<int>(std::min<int64_t>(kTK, t.r_len - c * kTK));
        at::native::cpublas::brgemm(mm, kTK, d, d, kTK, kTK, /*add_C=*/false, qb, kh + c * chunk_k, s, t.vnni);
        for (int r = 0; r < mr; ++r) {
          const float* sr = s + r * kTK;
          const float mx = row_max(sr, nk, mi[r]);
          const float sum = exp_row(sr, nk, mx, pb + r * kTK);
          if (mx != mi[r]) {  // the running maximum moved: what came before is rescaled
            const float alpha = std::exp(mi[r] - mx);  // 0 on the first chunk (m = -inf)
            li[r] *= alpha;
            if (c > 0) scale_row(ob + r * d, d, alpha);
          }
          li[r] += sum;
          mi[r] = mx;
        }
        at::native::cpublas::brgemm(mm, d, kTK, kTK, d, d, /*add_C=*/true, pb, vh + c * chunk_k, ob, t.vnni);
      }
    }
    for (int r = 0; r < mr; ++r) {
      std::memcpy(o + (r0 + r) * ld_o, ob + r * d, sizeof(float) * d);
      m[r0 + r] = mi[r];
      l[r0 + r] = li[r];
    }
  }
  if (!t.dot) at::native::cpublas::brgemm_release(t.vnni);
}

// kin, vin [r_len][hkv][d] bf16 packed for `kernel` (kernel_for's numbers); a prompt's own float32 rows take
// pack_dot_rows.
std::unique_ptr<TemplateKV> pack_kv(const at::Tensor& kin, const at::Tensor& vin, int kernel) {
  const int64_t r_len = kin.size(0), hkv = kin.size(1), d = kin.size(2);
  auto t = std::make_unique<TemplateKV>();
  t->r_len = r_len;
  t->hkv = hkv;
  t->d = d;
  t->chunks = (r_len + kTK - 1) / kTK;
  t->vnni = kernel == 2;
  t->dot = kernel == 1;
  const auto bf16 = at::TensorOptions().dtype(at::kBFloat16);
  // [hkv][chunks * kTK][d], zero past r_len
  at::Tensor kp = at::zeros({hkv, t->chunks * kTK, d}, bf16), vp = at::zeros({hkv, t->chunks * kTK, d}, bf16);
  kp.narrow(1, 0, r_len).copy_(kin.transpose(0, 1));
  vp.narrow(1, 0, r_len).copy_(vin.transpose(0, 1));
  // K^T per chunk: [hkv][chunks][d][kTK]; V per chunk: [hkv][chunks][kTK][d]
  at::Tensor kt = kp.view({hkv, t->chunks, kTK, d}).transpose(2, 3).contiguous();
  at::Tensor vt = vp.view({hkv, t->chunks, kTK, d}).contiguous();
  if (t->vnni) {
    t->k = at::empty_like(kt);
    t->v = at::empty_like(vt);
    for (int64_t h = 0; h < hkv; ++h)
      for (int64_t c = 0; c < t->chunks; ++c) {
        at::native::cpublas::pack(d, kTK, kTK, kTK, at::kBFloat16, at::kBFloat16, kt[h][c].data_ptr(),
                                  t->k[h][c].data_ptr());
        at::native::cpublas::pack(kTK, d, d, d, at::kBFloat16, at::kBFloat16, vt[h][c].data_ptr(),
                                  t->v[h][c].data_ptr());
      }
  } else if (t->dot) {  // pairs: K^T's rows two by two along d, V's rows two by two along the keys
    t->k = kt.view({hkv, t->chunks, d / 2, 2, kTK}).transpose(3, 4).contiguous();
    t->v = vt.view({hkv, t->chunks, kTK / 2, 2, d}).transpose(3, 4).contiguous();
  } else {
    t->k = kt;
    t->v = vt;
  }
  return t;
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// A prompt's own keys and values, float32 holding bf16 values as a bf16 cache stores them ([r_len][hkv][d],
// rows k_stride / v_stride floats apart; d a multiple of 16), in the dot products' layout in one pass over
// them: what pack_kv(kin, vin, 1) makes with five copies (the same bits: each value rounded to bf16 as torch
// rounds it, zero past r_len). k [hkv][chunks][d / 2][kTK][2], v [hkv][chunks][kTK / 2][d][2], as uint32 pairs:
// k's pair (p, j) holds key j's values 2p and 2p + 1, v's pair (jp, e) value e of keys 2 jp and 2 jp + 1.
std::unique_ptr<TemplateKV> pack_dot_rows(const float* kn, int64_t k_stride, const float* vn, int64_t v_stride,
                                          int64_t r_len, int64_t hkv, int64_t d) {
  auto t = std::make_unique<TemplateKV>();
  t->r_len = r_len;
  t->hkv = hkv;
  t->d = d;
  t->chunks = (r_len + kTK - 1) / kTK;
  t->dot = true;
  const auto bf16 = at::TensorOptions().dtype(at::kBFloat16);
  t->k = at::empty({hkv, t->chunks, d / 2, kTK, 2}, bf16);
  t->v = at::empty({hkv, t->chunks, kTK / 2, d, 2}, bf16);
  auto* kd = static_cast<uint32_t*>(t->k.data_ptr());
  auto* vd = static_cast<uint32_t*>(t->v.data_ptr());
  const int64_t pairs = d / 2 * kTK;  // a chunk's pairs of one head, of K or of V
  const int64_t chunks = t->chunks;
  at::parallel_for(0, hkv * chunks, 1, [&](int64_t b0, int64_t b1) {
    std::vector<c10::BFloat16> row(d);  // one key's values, in order: its pairs
    for (int64_t hc = b0; hc < b1; ++hc) {
      const int64_t h = hc / chunks, c = hc % chunks;
      uint32_t* kc = kd + hc * pairs;  // [d / 2][kTK]
      uint32_t* vc = vd + hc * pairs;  // [kTK / 2][d]
      for (int64_t j = 0; j < kTK; ++j) {
        const int64_t tok = c * kTK + j;
        if (tok < r_len)
          to_bf16(kn + tok * k_stride + h * d, d, row.data());
        else
          std::fill(row.begin(), row.end(), c10::BFloat16(0.0f));
        for (int64_t p = 0; p < d / 2; ++p) std::memcpy(kc + p * kTK + j, row.data() + 2 * p, sizeof(uint32_t));
      }
      for (int64_t jp = 0; jp < kTK / 2; ++jp) {
        const int64_t t0 = c * kTK + 2 * jp;
        const float* a = vn + t0 * v_stride + h * d;
        for (int64_t e = 0; e < d; e += 16) {
          const __m512i lo = t0 < r_len ? ps::bf16_round_bits(_mm512_loadu_ps(a + e)) : _mm512_setzero_si512();
          const __m512i hi = t0 + 1 < r_len ? ps::bf16_round_bits(_mm512_loadu_ps(a + v_stride + e)) : _mm512_setzero_si512();
          _mm512_storeu_si512(vc + jp * d + e, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
      }
    }
  });
  return t;
}
#endif

}  // namespace

// The template's keys and values of every KV head, packed: k, v [r_len][hkv][d] bf16 bits, rows
// row_stride elements apart (a cache's run of blocks, or any copy). d: a positive even head size.
// most: the most capable kernel the products may use (kernel_for). A handle for
// ps_onednn_template_attend and ps_onednn_template_free, or nullptr (and ps_onednn_last_error()).
extern "C" void* ps_onednn_template_pack(const void* k, const void* v, int64_t row_stride, int64_t r_len,
                                         int64_t hkv, int64_t d, int most) {
  if (k == nullptr || v == nullptr || r_len <= 0 || hkv <= 0 || d <= 0 || d % 2 != 0 || row_stride < hkv * d) {
    last_error = "ps_onednn_template_pack: bad operands: r_len " + std::to_string(r_len) + ", hkv " +
                 std::to_string(hkv) + ", d " + std::to_string(d) + " (a positive even head size), row_stride " +
                 std::to_string(row_stride) + (k == nullptr || v == nullptr ? ", a null k or v" : "");
    return nullptr;
  }
  return guarded<void*>("ps_onednn_template_pack", nullptr, [&]() -> void* {
    c10::InferenceMode guard;
    const auto bf16 = at::TensorOptions().dtype(at::kBFloat16);
    const at::Tensor kin = at::from_blob(const_cast<void*>(k), {r_len, hkv, d}, {row_stride, d, 1}, bf16);
    const at::Tensor vin = at::from_blob(const_cast<void*>(v), {r_len, hkv, d}, {row_stride, d, 1}, bf16);
    return pack_kv(kin, vin, kernel_for(d, most)).release();
  });
}

// Rows [0, rows) of q (float32, rows q_stride apart; each the query times the attention scale) over
// KV head h of the packed template: o [rows] (ld_o apart; d floats each), m [rows], l [rows] receive
// each row's state after all of the template's keys (unnormalised output, maximum score, sum of
// exponentials). Runs on the calling thread. 0, or 6 on bad operands or a failure
// (ps_onednn_last_error()).
extern "C" int ps_onednn_template_attend(const void* handle, int h, const float* q, int64_t q_stride, int rows,
                                         float* o, int64_t ld_o, float* m, float* l) {
  const auto* t = static_cast<const TemplateKV*>(handle);
  if (t == nullptr || h < 0 || h >= t->hkv || rows < 0 || q == nullptr || o == nullptr || m == nullptr ||
      l == nullptr || (rows > 1 && (q_stride < t->d || ld_o < t->d))) {
    last_error = "ps_onednn_template_attend: bad operands" +
                 (t == nullptr ? std::string(": a null handle")
                               : ": head " + std::to_string(h) + " of " + std::to_string(t->hkv) + ", rows " +
                                     std::to_string(rows) + ", q_stride " + std::to_string(q_stride) + ", ld_o " +
                                     std::to_string(ld_o) + " for d " + std::to_string(t->d));
    return 6;
  }
  return guarded("ps_onednn_template_attend", 6, [&] {
    attend(*t, h, q, q_stride, rows, o, ld_o, m, l);
    attend_calls.fetch_add(1, std::memory_order_relaxed);
    return 0;
  });
}

// A prompt's attention over its own keys, causal, on the dot products (attend_dot), where nothing
// comes before the prompt: q [m_len][hq][d] (unscaled, rows q_stride floats apart) over kn, vn
// [m_len][hkv][d] (float32 holding bf16 values, as a bf16 cache stores them; rows kn_stride /
// vn_stride apart); token t's rows see keys [0, t]. out [m_len][hq][d] (rows out_stride apart)
// receives the normalised outputs. The keys are packed once for the call, then per KV head and
// block of kTM rows (the group's query heads token by token) each row walks the chunks it sees,
// the last masked past its own token. Tasks split over torch's threads in an order that gives each
// thread as many late (long) blocks as early ones. 0; 2 where the library has no dot products or
// d is not a multiple of 16; 6 on bad operands or a failure (ps_onednn_last_error()).
extern "C" int ps_onednn_causal_attend(const float* q, int64_t q_stride, float* out, int64_t out_stride, int m_len,
                                       int hq, int hkv, int d, float scale, const float* kn, int64_t kn_stride,
                                       const float* vn, int64_t vn_stride) {
  if (!kDotBf16 || d <= 0 || d % 16 != 0) {
    last_error =
        "ps_onednn_causal_attend: no AVX512-BF16 dot products in this build for head size " + std::to_string(d);
    return 2;
  }
  if (q == nullptr || out == nullptr || kn == nullptr || vn == nullptr || m_len <= 0 || hkv <= 0 || hq % hkv != 0 ||
      q_stride < (int64_t)hq * d || out_stride < (int64_t)hq * d || kn_stride < (int64_t)hkv * d ||
      vn_stride < (int64_t)hkv * d) {
    last_error = "ps_onednn_causal_attend: bad operands: m_len " + std::to_string(m_len) + ", hq " +
                 std::to_string(hq) + ", hkv " + std::to_string(hkv) + ", d " + std::to_string(d);
    return 6;
  }
  return guarded("ps_onednn_causal_attend", 6, [&] {
    c10::InferenceMode guard;
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    const std::unique_ptr<TemplateKV> t = pack_dot_rows(kn, kn_stride, vn, vn_stride, m_len, hkv, d);
#else
    const std::unique_ptr<TemplateKV> t;  // not reached: kDotBf16 is false
#endif
    const int g = hq / hkv;
    const int64_t rows = (int64_t)m_len * g, blocks = (rows + kTM - 1) / kTM, chunk_k = (int64_t)d * kTK;
    // task i: KV head i / blocks, block zigzag(i % blocks): 0, last, 1, last - 1, ...
    at::parallel_for(0, hkv * blocks, 1, [&](int64_t begin, int64_t end) {
      c10::BFloat16* qb = grown(scratch.q, kTM * d);
      float* ob = grown(scratch.o, kTM * d);
      float* qs = grown(scratch.s, d);  // a row's scaled query (the dot products keep no scores here)
      float mi[kTM], li[kTM];
      int visible[kTM];
      for (int64_t task = begin; task < end; ++task) {
        const int64_t h = task / blocks, i = task % blocks, b = i % 2 == 0 ? i / 2 : blocks - 1 - i / 2;
        const int64_t r0 = b * kTM;
        const int mr = (int)std::min<int64_t>(kTM, rows - r0), mm = (mr + kRB - 1) / kRB * kRB;
        for (int r = 0; r < mm; ++r) {
          const int64_t row = std::min<int64_t>(r0 + r, rows - 1);  // a padding row repeats the last
          const int64_t tok = row / g, head = h * g + row % g;
          const float* src = q + tok * q_stride + head * d;
          for (int e = 0; e < d; ++e) qs[e] = src[e] * scale;
          to_bf16(qs, d, qb + r * d);
          visible[r] = (int)tok + 1;
        }
        std::fill(ob, ob + mm * d, 0.0f);
        const int64_t chunks = (visible[mm - 1] + kTK - 1) / kTK;  // the block's last row sees the most
        attend_dot(qb, d, static_cast<const c10::BFloat16*>(t->k.data_ptr()) + h * t->chunks * chunk_k,
                   static_cast<const c10::BFloat16*>(t->v.data_ptr()) + h * t->chunks * chunk_k, chunks, m_len, mm,
                   ob, mi, li, visible);
        for (int r = 0; r < mr; ++r) {
          const int64_t row = r0 + r, tok = row / g, head = h * g + row % g;
          float* dst = out + tok * out_stride + head * d;
          const float inv = 1.0f / li[r];
          for (int e = 0; e < d; ++e) dst[e] = ob[r * d + e] * inv;
        }
      }
    });
    causal_calls.fetch_add(1, std::memory_order_relaxed);
    return 0;
  });
}

// Which kernel a template of head size d packed here with the same `most` multiplies with
// (kernel_for); 0 as well if asking fails.
extern "C" int ps_onednn_template_kernel(int64_t d, int most) {
  try {
    return kernel_for(d, most);
  } catch (...) {
    return 0;
  }
}

// The same rule for a CPU with or without AMX's VNNI brgemm (amx) and the dot products (dot).
extern "C" int ps_onednn_template_kernel_rule(int64_t d, int amx, int dot) { return kernel_rule(d, amx != 0, dot != 0); }

// How many calls of ps_onednn_template_attend have succeeded in this process.
extern "C" int64_t ps_onednn_template_calls() { return attend_calls.load(std::memory_order_relaxed); }

// The kernel a packed template multiplies with (kernel_for's numbers).
extern "C" int ps_onednn_template_packed_kernel(const void* handle) {
  const auto* t = static_cast<const TemplateKV*>(handle);
  return t == nullptr ? 0 : t->vnni ? 2 : t->dot ? 1 : 0;
}

// How many calls of ps_onednn_causal_attend have succeeded in this process.
extern "C" int64_t ps_onednn_causal_calls() { return causal_calls.load(std::memory_order_relaxed); }

// The bytes a packed template holds.
extern "C" int64_t ps_onednn_template_bytes(const void* handle) {
  const auto* t = static_cast<const TemplateKV*>(handle);
  return t == nullptr ? 0 : (int64_t)(t->k.nbytes() + t->v.nbytes());
}

extern "C" void ps_onednn_template_free(void* handle) {
  try {
    delete static_cast<TemplateKV*>(handle);
  } catch (...) {
  }
}
