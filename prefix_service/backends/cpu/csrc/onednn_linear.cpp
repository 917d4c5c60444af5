// Linear layers through oneDNN, the GEMM library inside torch: y[M][N] = x[M][K] W^T (+ bias), W
// packed once at load into the layout oneDNN picks for this CPU (AMX, AVX512-BF16, AVX-512 or AVX2).
// x and y are float32; W is float32 or bfloat16.
//
// torch does not export oneDNN's symbols, but it exports ATen, which reaches oneDNN two ways this
// library uses: the operators mkldnn::_reorder_linear_weight (the prepack) and
// mkldnn::_linear_pointwise (the inner product), called through the c10 dispatcher, boxed (a stack
// of IValues, so a change in an operator's C++ signature across torch versions cannot abort the
// process); and at::native::cpublas::brgemm / pack, oneDNN's batch-reduce GEMM micro-kernel (AMX
// tiles), which torch's own CPU flash attention calls. The library exports plain C functions, so
// the native decoder stack can call a linear through a function pointer (ps_onednn_linear on float32
// rows; ps_onednn_linear_bf16 on bf16 rows in or out, for a bf16 weight: the stack's hand-offs).
// Nothing throws across the C boundary: a failure returns nullptr or 5, and ps_onednn_last_error()
// says why.
//
// A bfloat16 weight runs one of three ways, chosen by the caller at pack time:
//   brgemm   (where oneDNN's micro-kernel takes VNNI-packed bf16, ps_onednn_brgemm_vnni(): AMX):
//            W split into blocks of `nb` output columns (the caller's choice, 32 by default), each packed
//            once; each call rounds x to a bf16
//            scratch copy (rows zero-padded to a multiple of 16), and each thread runs the
//            micro-kernel over its blocks, kMB rows at a time, into float32 sums, adds the bias and
//            rounds each output to bf16 as it writes y. The kernels are generated once per shape and
//            cached by torch, so a call creates nothing: the inner product below sets up a oneDNN
//            primitive on every call. Elsewhere the same blocks run unpacked through torch's
//            fallback GEMM (tests use that to check this path on any CPU).
//   native   (where torch's oneDNN supports bf16): W packed in bf16; each call rounds x to a bf16
//            scratch copy, runs the bf16 inner product (float32 sums, bf16 output) and widens the
//            output into y.
//   emulated (elsewhere): W widened (exactly) to float32 and packed as a float32 weight; each call
//            rounds x through bf16, runs the float32 product and rounds the output through bf16.
// Where the CPU has AVX512-BF16, a native weight is also packed a second time for calls of up to
// kDotRows rows (a decode step's, one row per sequence, or a short prompt's): W in blocks of kDotNB
// output columns, each [K / 2][kDotNB][2] (pairs of K, as the VNNI dot product takes them), which
// this file's dot-product kernel streams once per call from memory on torch's threads. oneDNN's
// inner product spends more per call than such a call's arithmetic (scripts/bench_cpu_linear_call.py),
// so a decode step's linears read their weights at a fraction of the memory's rate through it, and
// up to about 256 rows it was faster than oneDNN's on a Zen 5 as well (kDotRows); the blocks cost the
// weight's bytes once more. PREFIX_SERVICE_BF16_FEW_ROWS=0 packs none (onednn.py). With int8 weights
// (model.quantization: int8; ps_onednn_pack's q) those blocks hold int8 values and a scale per
// column instead: half the bytes, widened to bf16 in registers (exactly) on the way to the same dot
// products.
// All of these multiply bf16 operands (the products are exact in float32), sum in float32 and round
// the output to bf16; only the order of the sums may differ (and `vdpbf16ps`, the few-row kernel's
// dot product, reads bf16 subnormals, below 1.2e-38, as zero). In all of them the bias is rounded to
// bf16 and added to the float32 sums before the output is rounded, as torch's bf16 F.linear does. A
// float32 weight is packed in float32 and nothing is rounded. Built by
// prefix_service/backends/cpu/onednn.py against torch's headers and libraries; loaded into a process
// that has imported torch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/native/CPUBlas.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "onednn_bf16.h"
#include "onednn_error.h"
#include "onednn_scratch.h"

namespace ps_onednn {
thread_local std::string last_error;  // also onednn_attention.cpp's (onednn_error.h)
}

namespace {

using ps_onednn::grown;
using ps_onednn::guarded;
using ps_onednn::last_error;

// the `kernel` argument of ps_onednn_pack for a bf16 weight
enum class Mode { f32 = -1, bf16_native = 0, bf16_emulated = 1, bf16_brgemm = 2 };

constexpr int64_t kMB = 32;  // brgemm: rows per micro-kernel call (two AMX tiles of 16)
constexpr int kDefaultNB = 32;  // brgemm: output columns per block when the caller names none
constexpr int kDotNB = 32;      // the few-row kernel: output columns per block (two vectors of 16 sums)
// the few-row kernel: rows per pass over a block, bf16 or int8 (8 x 2 accumulators: enough
// independent sums to cover the dot product's latency; with 4 x 2 a 64-row call ran at 0.76x the
// speed on a Zen 5, and 10 x 2 or more gave nothing further, docs/benchmarks.md)
constexpr int kDotRB = 8;
// calls of up to this many rows take the few-row kernel where it is packed: on a Zen 5 it beat oneDNN's
// inner product (through `run`) by 1.1-1.2x at 64-128 rows, by up to 3% at 192-256 and lost from 512
constexpr int kDotRows = 128;

struct Packed {
  at::Tensor weight;                // oneDNN's blocked layout, as _reorder_linear_weight made it (not brgemm)
  std::optional<at::Tensor> bias;   // [N]: float32 (f32, emulated: the bf16 values widened) or bf16 (native)
  int64_t n = 0, k = 0;
  Mode mode = Mode::f32;
  // brgemm: blocks [ceil(N / nb)][kp][nb] bf16, block j holding W^T's columns j nb .. j nb + nb - 1
  // (zero past N), VNNI-packed when `vnni`; kp = K rounded up to even when vnni (a zero row past K);
  // bias_f32 [N]: the bias rounded to bf16, widened (zeros when there is none)
  at::Tensor blocks;
  std::vector<float> bias_f32;
  int64_t kp = 0;
  int64_t nb = kDefaultNB;  // brgemm: output columns per block (a multiple of 16: whole AMX tiles)
  bool vnni = false;
  // native with brgemm for few rows: calls of up to this many rows run brgemm on `blocks` (packed as
  // for brgemm), the others the inner product on `weight`; 0: none
  int brgemm_rows = 0;
  // native with the few-row kernel: dot [ceil(N / kDotNB)][kp / 2][kDotNB][2] bf16, W^T's columns
  // j kDotNB .. in block j, pairs of rows of K side by side (zero past N and K; kp: K rounded up to
  // even), and bias_f32 as for brgemm; undefined without
  at::Tensor dot;
  // the most rows a call runs on `dot` (or `dot8`): kDotRows, or every call (ps_onednn_pack's few_rows 2)
  int dot_rows = 0;
  // int8 weights (ps_onednn_pack's q): W = q diag(scale) with q int8, in place of `dot` in the same
  // layout, [ceil(N / kDotNB)][kp / 2][kDotNB][2] int8, and scale [ceil(N / kDotNB) kDotNB] float32
  // (zero past N); undefined without
  at::Tensor dot8;
  std::vector<float> scale;
};

// A call's rows: x [m][k] float32, or bf16 bits where x_bf16 (rows the caller rounded to bf16 as this
// file would have); y [m][n] float32, or bf16 bits where y_bf16 (the rounded outputs, not widened);
// strides count elements of each one's type. A bf16 hand-off gives the same bits as the float32 rows.
struct Rows {
  const void* x;
  bool x_bf16;
  int64_t ldx;
  int m;
  void* y;
  bool y_bf16;
  int64_t ldy;
  const float* xf(int64_t r) const { return static_cast<const float*>(x) + r * ldx; }
  const c10::BFloat16* xb(int64_t r) const { return static_cast<const c10::BFloat16*>(x) + r * ldx; }
  float* yf(int64_t r) const { return static_cast<float*>(y) + r * ldy; }
  c10::BFloat16* yb(int64_t r) const { return static_cast<c10::BFloat16*>(y) + r * ldy; }
};

// Per-thread scratch, grown and never shrunk, so a call allocates no data buffers of its own
// beyond the operator's output: x rounded to bf16, x rounded back to float32 (emulated), the
// output rounded to bf16 (emulated), and a brgemm worker's float32 sums.
struct Scratch {
  std::vector<c10::BFloat16> x_bf16;
  std::vector<float> x_f32;
  std::vector<c10::BFloat16> y_bf16;
  std::vector<float> sums;
};
thread_local Scratch scratch;

const c10::OperatorHandle& reorder_op() {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_reorder_linear_weight", "");
  return op;
}

const c10::OperatorHandle& linear_op() {
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  return op;
}

// Calls op on the leading arguments in stack, the rest at their defaults (an argument a later torch
// adds comes with one); its first result.
at::Tensor call(const c10::OperatorHandle& op, torch::jit::Stack& stack) {
  const auto& args = op.schema().arguments();
  for (size_t i = stack.size(); i < args.size(); ++i) {
    TORCH_CHECK(args[i].default_value().has_value(), op.schema().name(), ": no value for argument ", args[i].name());
    stack.push_back(*args[i].default_value());
  }
  op.callBoxed(stack);
  return stack.at(0).toTensor();
}

// mkldnn::_reorder_linear_weight(Tensor self, int? batch_size=None) -> Tensor
at::Tensor reorder(const at::Tensor& w) {
  torch::jit::Stack stack{c10::IValue(w)};
  return call(reorder_op(), stack);
}

// mkldnn::_linear_pointwise(Tensor X, Tensor W, Tensor? B, str attr, Scalar?[] scalars, str? algorithm) -> Tensor
at::Tensor linear(const at::Tensor& x, const Packed& p) {
  torch::jit::Stack stack{c10::IValue(x),
                          c10::IValue(p.weight),
                          p.bias ? c10::IValue(*p.bias) : c10::IValue(),
                          c10::IValue("none"),
                          c10::IValue(c10::List<std::optional<at::Scalar>>()),
                          c10::IValue()};
  return call(linear_op(), stack);
}

bool brgemm_vnni() { return at::native::cpublas::could_pack(at::kBFloat16); }

// brgemm: W [n][k] bf16 into p's blocks (see Packed).
void pack_blocks(Packed& p, const at::Tensor& w) {
  p.vnni = brgemm_vnni();
  p.kp = p.vnni ? (p.k + 1) / 2 * 2 : p.k;
  const int64_t nb = p.nb, nblocks = (p.n + nb - 1) / nb;
  p.blocks = at::empty({nblocks, p.kp, nb}, at::TensorOptions().dtype(at::kBFloat16));
  at::Tensor wt = at::zeros({nblocks * nb, p.kp}, at::TensorOptions().dtype(at::kBFloat16));
  wt.narrow(0, 0, p.n).narrow(1, 0, p.k).copy_(w);
  for (int64_t j = 0; j < nblocks; ++j) {
    at::Tensor plain = wt.narrow(0, j * nb, nb).t().contiguous();  // [kp][nb]
    if (p.vnni)
      at::native::cpublas::pack(p.kp, nb, nb, nb, at::kBFloat16, at::kBFloat16, plain.data_ptr(),
                                p.blocks[j].data_ptr());
    else
      p.blocks[j].copy_(plain);
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// 16 outputs (the lanes of `keep`) rounded to bf16: widened into a float32 row, or as bf16 bits
inline void store_out(const Rows& io, int64_t r, int64_t c, __mmask16 keep, __m512 v) {
  if (io.y_bf16)
    _mm256_mask_storeu_epi16(io.yb(r) + c, keep, _mm512_cvtepi32_epi16(ps::bf16_round_bits(v)));
  else
    _mm512_mask_storeu_ps(io.yf(r) + c, keep, ps_onednn::round_bf16(v));
}
#endif

// Output row r, columns [n0, n0 + cols): round_bf16(s[c] + bias[n0 + c]), 16 at a time where the
// CPU has AVX-512 (the same bits as the scalar loop, whose NaN test keeps the compiler from
// vectorizing it: a decode step of 64 sequences rounds ~10 million outputs)
inline void store_sums(const Rows& io, int64_t r, int64_t n0, int64_t cols, const float* s, const float* bias) {
  int64_t c = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  for (; c < cols; c += 16) {
    const __mmask16 keep = ps::first_mask(static_cast<int>(std::min<int64_t>(16, cols - c)));
    store_out(io, r, n0 + c, keep,
              _mm512_add_ps(_mm512_maskz_loadu_ps(keep, s + c), _mm512_maskz_loadu_ps(keep, bias + n0 + c)));
  }
#endif
  for (; c < cols; ++c) {
    const c10::BFloat16 out(s[c] + bias[n0 + c]);
    if (io.y_bf16)
      io.yb(r)[n0 + c] = out;
    else
      io.yf(r)[n0 + c] = static_cast<float>(out);
  }
}

std::atomic<int64_t> brgemm_calls{0};  // run_brgemm's calls, for ps_onednn_brgemm_calls

// brgemm: y = round_bf16(round_bf16(x) W^T + bias).
void run_brgemm(const Packed& p, const Rows& io) {
  brgemm_calls.fetch_add(1, std::memory_order_relaxed);
  const int m = io.m;
  const int64_t kp = p.kp, rows = (m + 15) / 16 * 16;  // A's rows: zero-padded to whole AMX tiles
  c10::BFloat16* a = grown(scratch.x_bf16, rows * kp);
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      c10::BFloat16* dst = a + r * kp;
      if (r < m && io.x_bf16)
        std::memcpy(dst, io.xb(r), sizeof(c10::BFloat16) * (size_t)p.k);
      else if (r < m)
        ps_onednn::to_bf16(io.xf(r), p.k, dst);  // round to nearest even
      std::fill(dst + (r < m ? p.k : 0), dst + kp, c10::BFloat16(0.0f));
    }
  });
  const int64_t nb = p.nb, nblocks = p.blocks.size(0), mblocks = (m + kMB - 1) / kMB;
  const auto* blocks = static_cast<const c10::BFloat16*>(p.blocks.data_ptr());
  const float* bias = p.bias_f32.data();
  // work items block-major, so a thread's contiguous range reads each of its weight blocks once
  at::parallel_for(0, nblocks * mblocks, 1, [&](int64_t begin, int64_t end) {
    float* sums = grown(scratch.sums, kMB * nb);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t j = item / mblocks, m0 = item % mblocks * kMB;
      const int64_t valid = std::min<int64_t>(kMB, m - m0), mm = (valid + 15) / 16 * 16;
      if (!p.vnni) std::memset(sums, 0, sizeof(float) * (size_t)(mm * nb));
      at::native::cpublas::brgemm(mm, nb, kp, kp, nb, nb, /*add_C=*/false, a + m0 * kp, blocks + j * kp * nb,
                                  sums, p.vnni);
      const int64_t n0 = j * nb, cols = std::min<int64_t>(nb, p.n - n0);
      for (int64_t r = 0; r < valid; ++r) store_sums(io, m0 + r, n0, cols, sums + r * nb, bias);
    }
    at::native::cpublas::brgemm_release(p.vnni);
  });
}

// W [n][k] (contiguous) into dot blocks [ceil(n / kDotNB)][kp / 2][kDotNB][2] of T (see Packed),
// zero past n and k
template <typename T>
at::Tensor dot_blocks(const T* src, int64_t n, int64_t k, int64_t kp, at::ScalarType type) {
  const int64_t nblocks = (n + kDotNB - 1) / kDotNB, pairs = kp / 2;
  at::Tensor out = at::zeros({nblocks, pairs, kDotNB, 2}, at::TensorOptions().dtype(type));
  T* dst = static_cast<T*>(out.data_ptr());
  // written in order, read from a block's 32 rows at once (a scatter from each row in turn wrote a
  // cache line per element: seconds for a model)
  at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t j = b0; j < b1; ++j) {
      const int64_t cols = std::min<int64_t>(kDotNB, n - j * kDotNB);
      const T* rows = src + j * kDotNB * k;
      for (int64_t q = 0; q < pairs; ++q) {
        T* d = dst + (j * pairs + q) * kDotNB * 2;
        const bool second = 2 * q + 1 < k;
        for (int64_t c = 0; c < cols; ++c) {
          d[2 * c] = rows[c * k + 2 * q];
          if (second) d[2 * c + 1] = rows[c * k + 2 * q + 1];
        }
      }
    }
  });
  return out;
}

// native, few rows: W into p's dot blocks, or its int8 form q, scale where given (see Packed)
void pack_dot(Packed& p, const at::Tensor& w, const int8_t* q, const float* scale) {
  p.kp = (p.k + 1) / 2 * 2;
  if (q == nullptr) {
    p.dot = dot_blocks(static_cast<const c10::BFloat16*>(w.data_ptr()), p.n, p.k, p.kp, at::kBFloat16);
    return;
  }
  p.dot8 = dot_blocks(q, p.n, p.k, p.kp, at::kChar);
  p.scale.assign((size_t)p.dot8.size(0) * kDotNB, 0.0f);
  std::copy(scale, scale + p.n, p.scale.begin());
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// One pair-step of a dot block (kDotNB columns x 2 of K, 64 values) as the two bf16 operands of the
// dot product: a bf16 block's as they are; an int8 block's widened to float32 and rounded to bf16,
// both exact for |q| <= 128, so the int8 block streams half the bytes for the same products
inline void block_pairs(const c10::BFloat16* wq, __m512bh& w0, __m512bh& w1) {
  w0 = ps_onednn::pairs(_mm512_loadu_si512(wq));
  w1 = ps_onednn::pairs(_mm512_loadu_si512(wq + 32));
}
inline __m512 int8_floats(const int8_t* p) {  // 16 int8 values widened to float32
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline void block_pairs(const int8_t* wq, __m512bh& w0, __m512bh& w1) {
  const __m512 f0 = int8_floats(wq), f1 = int8_floats(wq + 16), f2 = int8_floats(wq + 32), f3 = int8_floats(wq + 48);
  w0 = _mm512_cvtne2ps_pbh(f1, f0);  // f0's 16 values in the low half
  w1 = _mm512_cvtne2ps_pbh(f3, f2);
}

// sums [R][kDotNB] = a [R][kp] (bf16, rows lda apart) times one dot block, w [kp / 2][kDotNB][2] of
// bf16 or int8 values (kDotRB rows a pass, which also share an int8 pair-step's widening).
// The loops over rows and vectors are unrolled so the accumulators stay in registers (the library
// builds at -O2).
template <int R, typename T>
void dot_block(const c10::BFloat16* a, int64_t lda, int64_t kp, const T* w, float* sums) {
  __m512 acc[R][2];
  #pragma GCC unroll 8
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int64_t q = 0; q < kp / 2; ++q) {
    __m512bh w0, w1;
    block_pairs(w + q * kDotNB * 2, w0, w1);
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const __m512bh xv = ps_onednn::broadcast_pair(a + i * lda + 2 * q);
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], xv, w0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], xv, w1);
    }
  }
  #pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    _mm512_storeu_ps(sums + i * kDotNB, acc[i][0]);
    _mm512_storeu_ps(sums + i * kDotNB + 16, acc[i][1]);
  }
}

// dot_block for a pass of `rows` (1 to kDotRB) rows
template <typename T>
void dot_rows(int rows, const c10::BFloat16* a, int64_t lda, int64_t kp, const T* w, float* sums) {
  switch (rows) {
    case 1: dot_block<1>(a, lda, kp, w, sums); break;
    case 2: dot_block<2>(a, lda, kp, w, sums); break;
    case 3: dot_block<3>(a, lda, kp, w, sums); break;
    case 4: dot_block<4>(a, lda, kp, w, sums); break;
    case 5: dot_block<5>(a, lda, kp, w, sums); break;
    case 6: dot_block<6>(a, lda, kp, w, sums); break;
    case 7: dot_block<7>(a, lda, kp, w, sums); break;
    default: dot_block<8>(a, lda, kp, w, sums); break;
  }
}

// native, m <= kDotRows rows: y = round_bf16(round_bf16(x) W^T + bias) over p's dot blocks
void run_dot(const Packed& p, const Rows& io) {
  const int m = io.m;
  const int64_t kp = p.kp, nblocks = (p.n + kDotNB - 1) / kDotNB;
  const c10::BFloat16* a = nullptr;  // the rows in bf16, lda apart (the workers read them through `a`)
  int64_t lda = kp;
  if (io.x_bf16 && kp == p.k) {  // the caller's rows as they are (checked_run gives one row ldx = k)
    a = io.xb(0);
    lda = io.ldx;
  } else {
    c10::BFloat16* rows = grown(scratch.x_bf16, m * kp);  // this thread's
    for (int r = 0; r < m; ++r) {
      if (io.x_bf16)
        std::memcpy(rows + r * kp, io.xb(r), sizeof(c10::BFloat16) * (size_t)p.k);
      else
        ps_onednn::to_bf16(io.xf(r), p.k, rows + r * kp);
      if (kp > p.k) rows[r * kp + p.k] = c10::BFloat16(0.0f);
    }
    a = rows;
  }
  const bool int8 = p.dot8.defined();
  const auto* blocks = int8 ? nullptr : static_cast<const c10::BFloat16*>(p.dot.data_ptr());
  const auto* blocks8 = int8 ? static_cast<const int8_t*>(p.dot8.data_ptr()) : nullptr;
  const float* bias = p.bias_f32.data();
  at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
    alignas(64) float sums[kDotRB * kDotNB];
    for (int64_t j = b0; j < b1; ++j) {
      const c10::BFloat16* w = int8 ? nullptr : blocks + j * kp * kDotNB;
      const int8_t* w8 = int8 ? blocks8 + j * kp * kDotNB : nullptr;
      const int64_t n0 = j * kDotNB, cols = std::min<int64_t>(kDotNB, p.n - n0);
      const __mmask16 lo = cols >= 16 ? 0xffff : (__mmask16)((1u << cols) - 1);
      const __mmask16 hi = cols >= 32 ? 0xffff : cols <= 16 ? 0 : (__mmask16)((1u << (cols - 16)) - 1);
      const __m512 b_lo = _mm512_maskz_loadu_ps(lo, bias + n0), b_hi = _mm512_maskz_loadu_ps(hi, bias + n0 + 16);
      // int8: each column's sums times its scale (zero past n), then the bias
      const __m512 s_lo = int8 ? _mm512_loadu_ps(p.scale.data() + n0) : _mm512_set1_ps(1.0f);
      const __m512 s_hi = int8 ? _mm512_loadu_ps(p.scale.data() + n0 + 16) : _mm512_set1_ps(1.0f);
      for (int r0 = 0; r0 < m; r0 += kDotRB) {
        const int rows = std::min(kDotRB, m - r0);
        const c10::BFloat16* ar = a + r0 * lda;
        if (int8)
          dot_rows(rows, ar, lda, kp, w8, sums);
        else
          dot_rows(rows, ar, lda, kp, w, sums);
        for (int i = 0; i < rows; ++i) {
          const float* si = sums + i * kDotNB;
          store_out(io, r0 + i, n0, lo, _mm512_fmadd_ps(_mm512_load_ps(si), s_lo, b_lo));
          store_out(io, r0 + i, n0 + 16, hi, _mm512_fmadd_ps(_mm512_load_ps(si + 16), s_hi, b_hi));
        }
      }
    }
  });
}
#else
void run_dot(const Packed&, const Rows&) {}
#endif

// io's rows with a bf16 weight or float32 one (f32: float32 rows only, nothing rounded)
void run(const Packed& p, const Rows& io) {
  const int m = io.m;
  if (ps_onednn::kDotBf16 && m <= p.dot_rows && (p.dot.defined() || p.dot8.defined())) {
    run_dot(p, io);
    return;
  }
  if (p.mode == Mode::bf16_brgemm || m <= p.brgemm_rows) {
    run_brgemm(p, io);
    return;
  }
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  const auto bf16 = at::TensorOptions().dtype(at::kBFloat16);
  // [M, K] and [M, N], rows ldx and ldy apart, in their own dtypes
  at::Tensor xv = at::from_blob(const_cast<void*>(io.x), {m, p.k}, {io.ldx, 1}, io.x_bf16 ? bf16 : f32);
  at::Tensor yv = at::from_blob(io.y, {m, p.n}, {io.ldy, 1}, io.y_bf16 ? bf16 : f32);
  if (p.mode == Mode::f32) {
    if (!xv.is_contiguous()) xv = at::from_blob(grown(scratch.x_f32, m * p.k), {m, p.k}, f32).copy_(xv);
    yv.copy_(linear(xv, p));
    return;
  }
  at::Tensor xb = xv;  // the rows in bf16, dense: the caller's where it handed them over so
  if (!io.x_bf16 || !xv.is_contiguous())
    xb = at::from_blob(grown(scratch.x_bf16, m * p.k), {m, p.k}, bf16).copy_(xv);  // round to nearest even
  if (p.mode == Mode::bf16_native) {
    yv.copy_(linear(xb, p));  // bf16 output, widened exactly (or copied as it is)
    return;
  }
  at::Tensor xr = at::from_blob(grown(scratch.x_f32, m * p.k), {m, p.k}, f32).copy_(xb);  // exact
  if (io.y_bf16) {
    yv.copy_(linear(xr, p));  // rounded to nearest even
    return;
  }
  at::Tensor yb = at::from_blob(grown(scratch.y_bf16, m * p.n), {m, p.n}, bf16).copy_(linear(xr, p));
  yv.copy_(yb);
}

// The C entry points' call: the operands checked (a failure leaves 5 and the reason in last_error,
// under the entry point's name `who`), then the product, nothing thrown across the C boundary.
int checked_run(const char* who, const void* handle, const void* x, bool x_bf16, int64_t ldx, int m, void* y,
                bool y_bf16, int64_t ldy) {
  if (m == 0) return 0;
  const auto* p = static_cast<const Packed*>(handle);
  const bool bf16_rows = x_bf16 || y_bf16;
  if (p == nullptr || x == nullptr || y == nullptr || m < 0 || (m > 1 && (ldx < p->k || ldy < p->n)) ||
      (p->mode == Mode::f32 && bf16_rows)) {
    last_error = std::string(who) + (p == nullptr ? ": a null handle"
                                      : p->mode == Mode::f32 && bf16_rows
                                          ? ": bf16 rows need a bf16 weight; this one is float32"
                                          : ": bad operands: m = " + std::to_string(m) + ", ldx = " +
                                                std::to_string(ldx) + " for k = " + std::to_string(p->k) +
                                                ", ldy = " + std::to_string(ldy) + " for n = " +
                                                std::to_string(p->n) +
                                                (x == nullptr || y == nullptr ? ", a null x or y" : ""));
    return 5;
  }
  return guarded(who, 5, [&] {
    c10::InferenceMode guard;
    run(*p, Rows{x, x_bf16, m > 1 ? ldx : p->k, m, y, y_bf16, m > 1 ? ldy : p->n});
    return 0;
  });
}

}  // namespace

extern "C" const char* ps_onednn_last_error() { return last_error.c_str(); }

// 1 where the brgemm kernel runs oneDNN's micro-kernel on VNNI-packed bf16 weights (AMX), else 0
// (it then runs torch's fallback GEMM). 0 as well if asking fails.
extern "C" int ps_onednn_brgemm_vnni() {
  try {
    return brgemm_vnni() ? 1 : 0;
  } catch (...) {
    return 0;
  }
}

// On how many of torch's threads an at::parallel_for over `items` work items (as the brgemm kernel
// splits a call) runs here: up to torch's thread count with the library built with OpenMP, 1
// without (the header then runs the loop on the caller's thread). 0 if it fails.
extern "C" int ps_onednn_threads_used(int64_t items) {
  try {
    std::atomic<uint64_t> seen{0};
    at::parallel_for(0, items, 1, [&](int64_t, int64_t) { seen |= uint64_t(1) << (at::get_thread_num() % 64); });
    return __builtin_popcountll(seen.load());
  } catch (...) {
    return 0;
  }
}

// weight: [n][k] row-major, float32 (weight_bf16 = 0) or bfloat16 bits (weight_bf16 = 1), copied;
// bias: n float32 values or null; kernel, for a bf16 weight (see the top): 0 native inner product,
// 1 emulated, 2 brgemm; columns: brgemm's output columns per block (16, 32, 48 or 64: what oneDNN packs for AMX;
// 0: 32), ignored by the others; few_rows: 1 to pack a native weight for the few-row kernel as well
// where the CPU has AVX512-BF16, for calls of up to kDotRows rows, 2 to run every call on it (one
// kernel whatever a call's rows, so a row's output does not depend on the others: batch invariance;
// the inner product's copy is then not made), 0 for none (ps_onednn_few_rows says what was). q, scale (both or
// neither): the weight's int8 form, q [n][k] int8 (|q| <= 127) and scale [n] float32, W[i][j] =
// q[i][j] scale[i] (model/quantize.py; `weight` is then the caller's copy of q diag(scale)): where
// the few-row kernel is packed it reads q instead of a bf16 copy, so its calls of up to kDotRows
// rows compute round_bf16(scale[i] sum_j round_bf16(x[j]) q[i][j] + bias[i]) from half the bytes
// (ps_onednn_int8 says whether it does); elsewhere they are not used. A handle for
// brgemm_rows: for the native inner product (kernel 0), a positive count packs the weight for brgemm
// as well (in `columns`-wide blocks), and calls of up to that many rows run brgemm, the rest the
// inner product (the few-row kernel is then not packed: ps_onednn_brgemm_rows says the count); 0: none.
// A handle for ps_onednn_linear and ps_onednn_free, or nullptr (ps_onednn_last_error() says why).
extern "C" void* ps_onednn_pack(const void* weight, int weight_bf16, int64_t n, int64_t k, const float* bias,
                                int kernel, int columns, int few_rows, const int8_t* q, const float* scale,
                                int brgemm_rows) {
  if (weight == nullptr || n <= 0 || k <= 0) {
    last_error = "ps_onednn_pack: a weight of at least 1 x 1 is needed, got " + std::to_string(n) + " x " +
                 std::to_string(k) + (weight == nullptr ? " at a null pointer" : "");
    return nullptr;
  }
  if ((q == nullptr) != (scale == nullptr)) {
    last_error = "ps_onednn_pack: int8 weights need both q and scale";
    return nullptr;
  }
  if (weight_bf16 && (kernel < 0 || kernel > 2)) {
    last_error = "ps_onednn_pack: kernel " + std::to_string(kernel) + " is none of 0 (native), 1 (emulated), 2 (brgemm)";
    return nullptr;
  }
  if (brgemm_rows < 0 || (brgemm_rows > 0 && (!weight_bf16 || kernel != 0))) {
    last_error = "ps_onednn_pack: brgemm_rows " + std::to_string(brgemm_rows) +
                 " (brgemm for calls of few rows) needs a bf16 weight on the native inner product (kernel 0)";
    return nullptr;
  }
  if (few_rows < 0 || few_rows > 2) {
    last_error = "ps_onednn_pack: few_rows " + std::to_string(few_rows) + " is none of 0 (none), 1 (calls of up to " +
                 std::to_string(kDotRows) + " rows), 2 (every call)";
    return nullptr;
  }
  if (columns != 0 && (columns < 16 || columns > 64 || columns % 16 != 0)) {
    last_error = "ps_onednn_pack: brgemm's columns per block must be 16, 32, 48 or 64 (or 0: 32), got " +
                 std::to_string(columns);
    return nullptr;
  }
  return guarded<void*>("ps_onednn_pack", nullptr, [&]() -> void* {
    c10::InferenceMode guard;
    auto p = std::make_unique<Packed>();
    p->n = n;
    p->k = k;
    p->mode = !weight_bf16 ? Mode::f32 : static_cast<Mode>(kernel);
    const auto f32 = at::TensorOptions().dtype(at::kFloat);
    at::Tensor w = at::from_blob(const_cast<void*>(weight), {n, k}, at::TensorOptions().dtype(
                                     weight_bf16 ? at::kBFloat16 : at::kFloat));
    // dot blocks as well (not beside brgemm blocks: those take the few rows)
    const bool dot = p->mode == Mode::bf16_native && ps_onednn::kDotBf16 && few_rows && brgemm_rows == 0;
    if (dot && q != nullptr && std::any_of(q, q + n * k, [](int8_t v) { return v < -127; })) {
      last_error = "ps_onednn_pack: q holds -128; int8 weights are symmetric, -127 to 127";
      return nullptr;
    }
    if (p->mode == Mode::bf16_brgemm || dot || brgemm_rows > 0) {
      p->bias_f32.assign((size_t)n, 0.0f);  // rounded to bf16, widened
      if (bias != nullptr)
        for (int64_t i = 0; i < n; ++i) p->bias_f32[i] = static_cast<float>(c10::BFloat16(bias[i]));
    }
    if (p->mode == Mode::bf16_brgemm) {
      p->nb = columns != 0 ? columns : kDefaultNB;
      pack_blocks(*p, w);
      return p.release();
    }
    if (dot) {
      pack_dot(*p, w, q, scale);
      p->dot_rows = few_rows == 2 ? std::numeric_limits<int>::max() : kDotRows;
      if (few_rows == 2) return p.release();  // no call reaches the inner product
    }
    if (brgemm_rows > 0) {
      p->nb = columns != 0 ? columns : kDefaultNB;
      pack_blocks(*p, w);
      p->brgemm_rows = brgemm_rows;
    }
    // the reorder writes a new tensor; the clone makes the copy explicit whatever layout it picks
    w = p->mode == Mode::bf16_emulated ? w.to(at::kFloat) : w.clone();
    p->weight = reorder(w);
    if (bias != nullptr) {
      at::Tensor b = at::from_blob(const_cast<float*>(bias), {n}, f32);
      if (p->mode == Mode::f32) b = b.clone();
      else if (p->mode == Mode::bf16_native) b = b.to(at::kBFloat16);
      else b = b.to(at::kBFloat16).to(at::kFloat);
      p->bias = b;
    }
    return p.release();
  });
}

// y[m][n] (rows ldy floats apart) = x[m][k] (rows ldx floats apart) W^T (+ bias). 0, or 5 on a
// failure (ps_onednn_last_error() says why). threads: ignored; oneDNN runs on torch's OpenMP threads.
extern "C" int ps_onednn_linear(const void* handle, const float* x, int64_t ldx, int m, float* y, int64_t ldy,
                                int threads) {
  (void)threads;
  return checked_run("ps_onednn_linear", handle, x, false, ldx, m, y, false, ldy);
}

// The same with bf16 hand-offs (csrc/cpu_layer.cpp's PsLinearBf16Fn): x as bf16 bits where x_bf16, y
// written as bf16 bits where y_bf16 (strides in elements of each one's type); a bf16 weight only. The
// bits are those of ps_onednn_linear on the float32 rows the bf16 ones widen to, with its output
// rounded (it rounds both itself). 0, or 5 on a failure.
extern "C" int ps_onednn_linear_bf16(const void* handle, const void* x, int x_bf16, int64_t ldx, int m, void* y,
                                     int y_bf16, int64_t ldy, int threads) {
  (void)threads;
  return checked_run("ps_onednn_linear_bf16", handle, x, x_bf16 != 0, ldx, m, y, y_bf16 != 0, ldy);
}

// The most rows a call of this handle runs through the few-row kernel: kDotRows where it was
// packed for it, INT_MAX where every call runs it (few_rows 2), else 0.
extern "C" int ps_onednn_few_rows(const void* handle) {
  const auto* p = static_cast<const Packed*>(handle);
  return p != nullptr && (p->dot.defined() || p->dot8.defined()) ? p->dot_rows : 0;
}

// 1 where this build has the few-row kernel (AVX512-BF16 dot products), else 0
extern "C" int ps_onednn_few_rows_built() { return ps_onednn::kDotBf16 ? 1 : 0; }

// How many calls have run on brgemm in this process (either way: a brgemm weight, or few rows beside
// the inner product).
extern "C" int64_t ps_onednn_brgemm_calls() { return brgemm_calls.load(std::memory_order_relaxed); }

// The most rows a call of this handle runs through brgemm beside the inner product (ps_onednn_pack's
// brgemm_rows), else 0.
extern "C" int ps_onednn_brgemm_rows(const void* handle) {
  const auto* p = static_cast<const Packed*>(handle);
  return p != nullptr ? p->brgemm_rows : 0;
}

// 1 where the handle's few-row calls read int8 weights (ps_onednn_pack's q), else 0
extern "C" int ps_onednn_int8(const void* handle) {
  const auto* p = static_cast<const Packed*>(handle);
  return p != nullptr && p->dot8.defined() ? 1 : 0;
}

extern "C" void ps_onednn_free(void* handle) {
  try {
    delete static_cast<Packed*>(handle);
  } catch (...) {  // a tensor's destructor does not throw; nothing may cross the C boundary regardless
  }
}
