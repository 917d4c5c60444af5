// A pinned template's part of attention as matrix products in bf16 with float32 sums: oneDNN's brgemm
// micro-kernel on AMX tiles (at::native::cpublas::brgemm), this file's loops of AVX512-BF16 dot-product
// instructions (vdpbf16ps: 16 float32 sums, each adding two bf16 products, per instruction) where the CPU
// has those but no AMX (AMD Zen 4 and later, Intel Cooper Lake), else torch's fallback GEMM.
//
// The native kernels (cpu_attention.cpp) walk a template's keys with float32 vector FMAs. Here the query
// rows that read one KV head of a template (already scaled, rounded to bf16) meet its keys in products,
// with the softmax in float32 between them and its probabilities rounded to bf16. The result is each
// row's softmax state after the template (unnormalised output, maximum, sum of exponentials), the state
// the native kernels carry on from over the rest of the context. Two walks:
// - The key-row walk (walk_rows; AMX and the fallback GEMM): per block of up to 64 query rows and 256
//   keys, S^T = K Q^T with the keys as the rows of A, the softmax down S^T's columns sixteen query rows
//   to a vector, then O^T += V^T P^T. Two products per 256 keys, each the same shape from call to call,
//   with the template as plain rows (A operands: no oneDNN packing) and the rows' queries and
//   probabilities as B, written by this file in VNNI pairs where the kernel takes them.
// - attend_dot (the dot products): per chunk of 64 keys and block of four query rows, S = Q K^T, the
//   softmax along each row, O += P V, while the chunk's K and V are in L1; faster than the key-row walk
//   with the dot products for the few rows of a decode step (which the key-row walk pads to 16).
//
// A template is packed once, when it is pinned (ps_onednn_template_pack), zero past its end. Built into
// the oneDNN library with onednn_linear.cpp (onednn.py); its entry points report failures through
// ps_onednn_last_error.
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

constexpr int64_t kTK = 64;  // keys per chunk: a template's keys are padded to whole chunks (attend_dot's N and K)
constexpr int64_t kTM = 32;  // query rows per block of attend_dot's walk
constexpr int64_t kSK = 256; // template keys per pair of products in the key-row walk (a multiple of kTK)
constexpr int kNB = 64;      // query rows per block of the key-row walk: the N of both its products, the leading
                             // dimension of their B operands (16, 32, 48 or 64: what AMX's brgemm takes)

struct TemplateKV {
  int64_t r_len = 0, hkv = 0, d = 0, chunks = 0;
  int kernel = 0;  // what multiplies (kernel_for's numbers): 2 AMX's brgemm, 1 the dot products, 0 the fallback GEMM
  bool by_chunk = false;  // attend_dot's layout (a prompt's own keys: pack_dot_rows), else the key-row walk's
  // The key-row walk's (every packed template): k [hkv][chunks * kTK][d] (the keys as rows), v [hkv][d][chunks * kTK]
  // (V^T), bf16, zero past r_len: both are the A operands of the walk's products, which no kernel packs.
  // attend_dot's: k [hkv][chunks][d / 2][kTK][2], v [hkv][chunks][kTK / 2][d][2] (the pairs a dot-product
  // instruction multiplies).
  at::Tensor k, v;
};

constexpr int kRB = 4;  // the dot products: rows per block of accumulators (4 rows x 4 vectors of 16 sums)


// The kernel a template of head size d multiplies with on a CPU where oneDNN's brgemm takes
// VNNI-packed bf16 (amx) and this file's dot products are built (dot): 2 oneDNN's brgemm
// micro-kernel (AMX) and 1 the AVX512-BF16 dot products, each for head sizes a multiple of 16; 0 torch's
// fallback GEMM. (The key-row walk hands AMX's brgemm the template as plain rows, its A operands, and its
// own VNNI pairs of 16 to 64 query rows as B: no oneDNN packing, whose leading dimension of 16 to 64 kept
// AMX to head sizes up to 64 when the template's V was packed.)
int kernel_rule(int64_t d, bool amx, bool dot) {
  if (amx && d % 16 == 0) return 2;
  return dot && d % 16 == 0 ? 1 : 0;
}

// The kernel for head size d here, using none above `most` (2: any; 1: not AMX; 0: the fallback GEMM).
int kernel_for(int64_t d, int most) {
  return kernel_rule(d, most >= 2 && at::native::cpublas::could_pack(at::kBFloat16), most >= 1 && kDotBf16);
}

// Per-thread scratch, grown and never shrunk: the rows' queries in bf16 (Q^T in the key-row walk), its
// scores and probabilities S^T and P^T, the rows' outputs (O^T).
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

// c [kRB][16 NV] (rows ldc apart) = (c if add, else 0) + a [kRB][kk] (bf16 rows lda apart) times the first 16 NV
// columns of b, VNNI pairs [kk / 2][ldb][2]: every product of the dot products, attend_dot's scores (a the
// queries, b a chunk's K^T) and values (a the probabilities, b a chunk's V) and the key-row walk's (gemm_dot).
// Inlined into each caller, where the strides are constants or loop invariants
template <int NV>
[[gnu::always_inline]] inline void dot_block(const c10::BFloat16* a, int64_t lda, int64_t kk, const c10::BFloat16* b,
                                             int64_t ldb, float* c, int64_t ldc, bool add) {
  __m512 acc[kRB][NV];
  #pragma GCC unroll 4
  for (int i = 0; i < kRB; ++i)
    #pragma GCC unroll 4
    for (int w = 0; w < NV; ++w) acc[i][w] = add ? _mm512_loadu_ps(c + i * ldc + w * 16) : _mm512_setzero_ps();
  for (int64_t p = 0; p < kk / 2; ++p) {
    const c10::BFloat16* bp = b + p * ldb * 2;
    __m512bh bv[NV];
    #pragma GCC unroll 4
    for (int w = 0; w < NV; ++w) bv[w] = pairs(_mm512_loadu_si512(bp + w * 32));
    #pragma GCC unroll 4
    for (int i = 0; i < kRB; ++i) {
      const __m512bh x = broadcast_pair(a + i * lda + 2 * p);
      #pragma GCC unroll 4
      for (int w = 0; w < NV; ++w) acc[i][w] = _mm512_dpbf16_ps(acc[i][w], x, bv[w]);
    }
  }
  #pragma GCC unroll 4
  for (int i = 0; i < kRB; ++i)
    #pragma GCC unroll 4
    for (int w = 0; w < NV; ++w) _mm512_storeu_ps(c + i * ldc + w * 16, acc[i][w]);
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
      dot_block<4>(qb + r * d, d, d, kc, kTK, sb, kTK, false);  // the block's scores
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
      for (; e0 + 64 <= d; e0 += 64) dot_block<4>(pb, kTK, kTK, vc + e0 * 2, d, ob + r * d + e0, d, true);
      switch ((d - e0) / 16) {
        case 3: dot_block<3>(pb, kTK, kTK, vc + e0 * 2, d, ob + r * d + e0, d, true); break;
        case 2: dot_block<2>(pb, kTK, kTK, vc + e0 * 2, d, ob + r * d + e0, d, true); break;
        case 1: dot_block<1>(pb, kTK, kTK, vc + e0 * 2, d, ob + r * d + e0, d, true); break;
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

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// c [m][NV 16] (+)= a [m][kk] (bf16 rows lda apart; m a multiple of kRB) times b, VNNI pairs [kk / 2][NV 16][2]:
// the key-row walk's products on the dot-product instructions, kRB rows of a at a time against all of b's columns
template <int NV>
void gemm_dot(int64_t m, int64_t kk, const c10::BFloat16* a, int64_t lda, const c10::BFloat16* b, float* c, bool add) {
  constexpr int64_t n = NV * 16;
  for (int64_t i0 = 0; i0 < m; i0 += kRB) dot_block<NV>(a + i0 * lda, lda, kk, b, n, c + i0 * n, n, add);
}
#endif

// c [m][n] (+)= a [m][kk] (bf16 rows lda apart) times b [kk][n] on `kernel`: b as VNNI pairs [kk / 2][n][2] for
// AMX's brgemm (2) and the dot products (1), as rows for the fallback GEMM (0); n one of 16, 32, 48, 64
void product(int kernel, int64_t m, int64_t n, int64_t kk, const c10::BFloat16* a, int64_t lda, const c10::BFloat16* b,
             float* c, bool add) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  if (kernel == 1) {
    switch (n / 16) {
      case 1: gemm_dot<1>(m, kk, a, lda, b, c, add); return;
      case 2: gemm_dot<2>(m, kk, a, lda, b, c, add); return;
      case 3: gemm_dot<3>(m, kk, a, lda, b, c, add); return;
      default: gemm_dot<4>(m, kk, a, lda, b, c, add); return;
    }
  }
#endif
  at::native::cpublas::brgemm(m, n, kk, lda, n, n, add, a, b, c, kernel == 2);
}

// One block of the key-row walk: rows [0, mr) (mr <= kNB) of q (scaled already; rows q_stride floats apart) over
// KV head h of the template, each row's state after it into o (rows ld_o apart), m, l. The rows are the columns
// of both products, nb of them (mr padded to 16 with zero queries): per kSK keys, S^T = K Q^T (the keys as the
// rows of A, M = kSK, N = nb, K = d), the softmax down S^T's columns, sixteen rows to a vector (no reduction
// across lanes), into P^T rounded to bf16, then O^T (+)= V^T P^T (M = d, N = nb, K = kSK), after O^T's columns
// are rescaled where a row's maximum moved. Two products per kSK keys, whatever the rows, each a shape that
// repeats from call to call (AMX's tile configuration loaded once per shape).
void walk_rows(const TemplateKV& t, int64_t h, const float* q, int64_t q_stride, int mr, float* o, int64_t ld_o,
               float* m, float* l) {
  const int64_t d = t.d, kp = t.chunks * kTK, nb = (mr + 15) / 16 * 16;
  const bool vnni = t.kernel != 0;
  const auto* kh = static_cast<const c10::BFloat16*>(t.k.data_ptr()) + h * kp * d;
  const auto* vh = static_cast<const c10::BFloat16*>(t.v.data_ptr()) + h * d * kp;
  c10::BFloat16* qt = grown(scratch.q, 2 * d * nb);  // Q^T, B of the first product; then the rows of q in bf16
  c10::BFloat16* rows = qt + d * nb;                  // [nb][d], zero past mr (a padding row: a zero query)
  float* st = grown(scratch.s, kSK * nb);            // S^T [kSK][nb]
  c10::BFloat16* pt = grown(scratch.p, kSK * nb);    // P^T, B of the second product
  float* ot = grown(scratch.o, d * nb + 2 * nb);     // O^T [d][nb], then each row's maximum and sum
  float* mx = ot + d * nb;
  float* sum = mx + nb;
  for (int64_t r = 0; r < mr; ++r) to_bf16(q + r * q_stride, d, rows + r * d);
  std::fill(rows + mr * d, rows + nb * d, c10::BFloat16(0.0f));
  // Q^T: VNNI [d / 2][nb][2], each pair of a row's values one 32-bit word (a transpose of [nb][d / 2] words),
  // or [d][nb]
#if defined(__AVX512F__)
  if (vnni) {
    const auto* words = reinterpret_cast<const float*>(rows);  // 32-bit words moved as floats: the bits unchanged
    auto* out = reinterpret_cast<float*>(qt);
    for (int64_t r0 = 0; r0 < nb; r0 += 16)
      for (int64_t p0 = 0; p0 < d / 2; p0 += 16) {
        const int n = static_cast<int>(std::min<int64_t>(16, d / 2 - p0));
        ps::vf blk[16];
        for (int i = 0; i < 16; ++i) blk[i] = ps::vload_first(words + (r0 + i) * (d / 2) + p0, n);
        ps::transpose16(blk);
        for (int k = 0; k < n; ++k) ps::vstore(out + (p0 + k) * nb + r0, blk[k]);
      }
  } else
#endif
    for (int64_t r = 0; r < nb; ++r)
      for (int64_t e = 0; e < d; ++e) qt[vnni ? ((e / 2) * nb + r) * 2 + e % 2 : e * nb + r] = rows[r * d + e];
  for (int64_t c0 = 0; c0 < kp; c0 += kSK) {
    const int64_t sk = std::min(kSK, kp - c0), seen = std::min(sk, t.r_len - c0);  // seen: keys before the end
    product(t.kernel, sk, nb, d, kh + c0 * d, d, qt, st, false);
    for (int64_t r0 = 0; r0 < nb; r0 += 16) {  // sixteen rows at a time
#if defined(PS_SIMD)
      ps::vf hi = ps::vload(st + r0);
      for (int64_t j = 1; j < seen; ++j) hi = ps::vmax(hi, ps::vload(st + j * nb + r0));
      ps::vf ref = hi, total = ps::vzero();
      if (c0 > 0) {  // the state so far moves to the larger maximum
        const ps::vf before = ps::vload(mx + r0);
        ref = ps::vmax(before, hi);
        const ps::vf alpha = ps::exp_ps(ps::vsub(before, ref));
        total = ps::vmul(ps::vload(sum + r0), alpha);
        for (int64_t e = 0; e < d; ++e) ps::vstore(ot + e * nb + r0, ps::vmul(ps::vload(ot + e * nb + r0), alpha));
      }
      ps::vstore(mx + r0, ref);
#if defined(__AVX512F__)
      if (vnni) {  // keys two by two: their probabilities' bf16 bits in each 32-bit lane, P^T [kSK / 2][nb][2]
        for (int64_t j = 0; j < sk; j += 2) {
          const __m512 e0 = j < seen ? exp_small(_mm512_sub_ps(_mm512_loadu_ps(st + j * nb + r0), ref.v))
                                     : _mm512_setzero_ps();
          const __m512 e1 = j + 1 < seen ? exp_small(_mm512_sub_ps(_mm512_loadu_ps(st + (j + 1) * nb + r0), ref.v))
                                         : _mm512_setzero_ps();
#if defined(__AVX512BF16__)
          // one instruction a rounding (to nearest even, as bf16_round_bits: the exponentials are 0 or normal
          // numbers, where its flush of subnormals cannot act), and the pair's sum by a dot product with (1, 1)
          const __m512i w0 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(e0));
          const __m512i w1 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(e1));
          const __m512i w = _mm512_or_si512(w0, _mm512_slli_epi32(w1, 16));
          _mm512_storeu_si512(pt + (j / 2 * nb + r0) * 2, w);
          total.v = _mm512_dpbf16_ps(total.v, (__m512bh)w, (__m512bh)_mm512_set1_epi32(0x3f803f80));
#else
          const __m512i b0 = ps::bf16_round_bits(e0), b1 = ps::bf16_round_bits(e1);
          _mm512_storeu_si512(pt + (j / 2 * nb + r0) * 2, _mm512_or_si512(b0, _mm512_slli_epi32(b1, 16)));
          total.v = _mm512_add_ps(total.v, _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(b0, 16)),
                                                         _mm512_castsi512_ps(_mm512_slli_epi32(b1, 16))));
#endif
        }
        ps::vstore(sum + r0, total);
        continue;
      }
#endif
      for (int64_t j = 0; j < sk; ++j) {  // P^T [kSK][nb]
        auto* dst = reinterpret_cast<uint16_t*>(pt + j * nb + r0);
        ps::vstore_bf16_first(dst, j < seen ? ps::exp_ps(ps::vsub(ps::vload(st + j * nb + r0), ref)) : ps::vzero(),
                              16);
        total = ps::vadd(total, ps::vload_bf16_first(dst, 16));
      }
      ps::vstore(sum + r0, total);
#else
      for (int64_t r = r0; r < r0 + 16; ++r) {
        float hi = st[r];
        for (int64_t j = 1; j < seen; ++j) hi = std::max(hi, st[j * nb + r]);
        float ref = hi, total = 0.0f;
        if (c0 > 0) {
          ref = std::max(mx[r], hi);
          const float alpha = std::exp(mx[r] - ref);
          total = sum[r] * alpha;
          for (int64_t e = 0; e < d; ++e) ot[e * nb + r] *= alpha;
        }
        mx[r] = ref;
        for (int64_t j = 0; j < sk; ++j) {
          const c10::BFloat16 p(j < seen ? std::exp(st[j * nb + r] - ref) : 0.0f);
          pt[vnni ? (j / 2 * nb + r) * 2 + j % 2 : j * nb + r] = p;
          total += static_cast<float>(p);
        }
        sum[r] = total;
      }
#endif
    }
    product(t.kernel, d, nb, sk, vh + c0, kp, pt, ot, c0 > 0);
  }
  for (int r = 0; r < mr; ++r) {
    m[r] = mx[r];
    l[r] = sum[r];
  }
#if defined(PS_SIMD)
  if (d % 16 == 0) {  // O^T [d][nb] to the rows' outputs, 16 x 16 at a time
    for (int64_t e0 = 0; e0 < d; e0 += 16)
      for (int64_t r0 = 0; r0 < mr; r0 += 16) {
        ps::vf blk[16];
        for (int i = 0; i < 16; ++i) blk[i] = ps::vload(ot + (e0 + i) * nb + r0);
        ps::transpose16(blk);
        for (int64_t k = 0; k < 16 && r0 + k < mr; ++k) ps::vstore(o + (r0 + k) * ld_o + e0, blk[k]);
      }
    return;
  }
#endif
  for (int r = 0; r < mr; ++r)
    for (int64_t e = 0; e < d; ++e) o[r * ld_o + e] = ot[e * nb + r];
}

// Rows [0, rows) of q (scaled already; rows q_stride floats apart) over head h of the template:
// o (rows ld_o apart), m, l receive each row's state after it.
void attend(const TemplateKV& t, int64_t h, const float* q, int64_t q_stride, int rows, float* o, int64_t ld_o,
            float* m, float* l) {
  if (!t.by_chunk) {
    for (int r0 = 0; r0 < rows; r0 += kNB)
      walk_rows(t, h, q + r0 * q_stride, q_stride, std::min(kNB, rows - r0), o + r0 * ld_o, ld_o, m + r0, l + r0);
    if (t.kernel == 2) at::native::cpublas::brgemm_release(true);
    return;
  }
  const int64_t d = t.d, chunk_k = d * kTK;
  const auto* kh = static_cast<const c10::BFloat16*>(t.k.data_ptr()) + h * t.chunks * chunk_k;
  const auto* vh = static_cast<const c10::BFloat16*>(t.v.data_ptr()) + h * t.chunks * chunk_k;
  c10::BFloat16* qb = grown(scratch.q, kTM * d);
  float* ob = grown(scratch.o, kTM * d);
  float mi[kTM], li[kTM];
  for (int r0 = 0; r0 < rows; r0 += kTM) {
    // rows, padded to whole blocks of accumulators
    const int mr = std::min<int>(kTM, rows - r0), mm = (mr + kRB - 1) / kRB * kRB;
    for (int r = 0; r < mr; ++r) to_bf16(q + (r0 + r) * q_stride, d, qb + r * d);
    std::fill(qb + mr * d, qb + mm * d, c10::BFloat16(0.0f));  // padding rows
    std::fill(ob, ob + mm * d, 0.0f);
    attend_dot(qb, d, kh, vh, t.chunks, t.r_len, mm, ob, mi, li);
    for (int r = 0; r < mr; ++r) {
      std::memcpy(o + (r0 + r) * ld_o, ob + r * d, sizeof(float) * d);
      m[r0 + r] = mi[r];
      l[r0 + r] = li[r];
    }
  }
}

// kin, vin [r_len][hkv][d] bf16, packed for the key-row walk on `kernel` (kernel_for's numbers); with by_chunk
// (the dot products only) for attend_dot instead. A prompt's own float32 rows take pack_dot_rows.
std::unique_ptr<TemplateKV> pack_kv(const at::Tensor& kin, const at::Tensor& vin, int kernel, bool by_chunk) {
  const int64_t r_len = kin.size(0), hkv = kin.size(1), d = kin.size(2);
  auto t = std::make_unique<TemplateKV>();
  t->r_len = r_len;
  t->hkv = hkv;
  t->d = d;
  t->chunks = (r_len + kTK - 1) / kTK;
  t->kernel = kernel;
  t->by_chunk = by_chunk && kernel == 1;
  const auto bf16 = at::TensorOptions().dtype(at::kBFloat16);
  // [hkv][chunks * kTK][d], zero past r_len
  at::Tensor kp = at::zeros({hkv, t->chunks * kTK, d}, bf16), vp = at::zeros({hkv, t->chunks * kTK, d}, bf16);
  kp.narrow(1, 0, r_len).copy_(kin.transpose(0, 1));
  vp.narrow(1, 0, r_len).copy_(vin.transpose(0, 1));
  if (!t->by_chunk) {
    t->k = kp;
    t->v = vp.transpose(1, 2).contiguous();  // V^T
    return t;
  }
  // pairs: each chunk's K^T rows two by two along d, its V rows two by two along the keys
  t->k = kp.view({hkv, t->chunks, kTK, d / 2, 2}).permute({0, 1, 3, 2, 4}).contiguous();
  t->v = vp.view({hkv, t->chunks, kTK / 2, 2, d}).transpose(3, 4).contiguous();
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
  t->kernel = 1;
  t->by_chunk = true;
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
                                         int64_t hkv, int64_t d, int most, int key_rows) {
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
    return pack_kv(kin, vin, kernel_for(d, most), key_rows == 0).release();
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

// Whether a packed template walks its keys as the rows of its products (1), or 64 at a time (attend_dot, 0).
extern "C" int ps_onednn_template_key_rows(const void* handle) {
  const auto* t = static_cast<const TemplateKV*>(handle);
  return t != nullptr && !t->by_chunk ? 1 : 0;
}

// The kernel a packed template multiplies with (kernel_for's numbers).
extern "C" int ps_onednn_template_packed_kernel(const void* handle) {
  const auto* t = static_cast<const TemplateKV*>(handle);
  return t == nullptr ? 0 : t->kernel;
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
