// Linear layers on the CPU, float32, AVX-512 or AVX2 (simd.h): y[M][N] = x[M][K] W^T (+ bias), W packed at load.
//
// W [N][K] is held as panels of 16 output columns, [ceil(N/16)][K][16] (zero-padded columns past
// N), so one vector load gives a row of a panel and a panel streams through memory in order.
// Output tiles are 6 rows x up to 4 panels (AVX-512: 24 accumulators in registers; AVX2, with half
// the register space: 6 rows x 1 panel); a tile reads K broadcasts of each of its 6 x rows and K
// rows of its panels, and writes its outputs once. Over bf16 panels (below) on AVX-512, a call of 24
// rows or more takes tiles of 12 rows x 2 panels instead: each panel row widened (an integer operation
// on the ports the FMAs use) then serves 12 rows, not 6.
//
// Threads split the panels (or, with fewer panels than threads can share, the rows). Each takes
// its panels in groups of 4: a group's panels stay in L2 while every row tile of a chunk of rows
// passes over them (a chunk: up to 1 MiB of x, so it stays in L2 too), so the weights come from
// memory once per chunk, once per call up to a few hundred rows. Serving reads weights that are not in
// any cache (a model is larger than the caches; the previous layers pushed this one out), and at
// a few hundred rows the hardware prefetcher leaves the first row tile of each group waiting on
// memory; so while a group is computed, the next group's panels are prefetched into L2, a few
// lines per step spread evenly over the group's row tiles. With int8 weights (model.quantization:
// int8) the panels hold int8 values, a quarter of the bytes, each panel row widened to floats in
// registers, and the sums are scaled per column before the bias (ps_linear_int8). A float32 weight
// whose values are all bf16 ones (a bf16 checkpoint served in float32) can be held in bf16 panels,
// half the bytes, widened exactly in registers: the same products in the same order, so the same bits
// (ps_packed_linear_bf16w). Built into the
// native library by prefix_service/backends/cpu/native.py; without AVX-512 or AVX2 ps_linear returns 1.
#include <cstdint>
#include <type_traits>

#include "simd.h"
#include <omp.h>

#if defined(PS_SIMD)
namespace {

using ps::vf;
constexpr int NR = 16;  // output columns per panel (one vector)
constexpr int MR = 6;   // rows per tile
constexpr int NG = 4;   // panels per group
constexpr int64_t CHUNK_BYTES = 1 << 20;  // x rows per chunk: at most this much of x

// A row of a panel (16 columns at one k) as floats: float32 weights as they are, int8 ones widened
inline vf wload(const float* p) { return ps::vload(p); }
inline vf wload(const int8_t* p) { return ps::vload_i8(p); }
// bf16 weights (uint16 bits) are packed in pairs of rows, [ceil(K/2)][16][2]: one 64-byte line holds a
// panel's rows k and k + 1, each widened by one integer operation (ps::vload_bf16_even/odd)
template <typename T>
constexpr int kStep = std::is_same<T, uint16_t>::value ? 2 : 1;

// One register tile: R rows of x against NP panels of T (float, int8 or bf16) weights. ps: weights
// between panels. `last`: the valid columns of the tile's last panel. float32: the sums start at
// the bias; int8 (scale set): y = sums scale + bias. Prefetches pf_lines 64-byte lines from pf on,
// spread over K steps.
template <int R, int NP, typename T>
inline void tile(const float* x, int64_t ldx, int K, const T* w, int64_t ps, float* y, int64_t ldy,
                 const float* bias, const float* scale, int last, const char* pf, int pf_lines) {
  // known when compiled, so the float32 kernel's inner loop carries nothing of the int8 one's scaling
  constexpr bool kScaled = std::is_same<T, int8_t>::value;
  vf acc[R][NP];
#pragma GCC unroll 4
  for (int j = 0; j < NP; ++j) {
    const vf b = bias && !kScaled ? ps::vload_first(bias + j * NR, j == NP - 1 ? last : NR) : ps::vzero();
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) acc[r][j] = b;
  }
  int pf_acc = 0;
  // the products in k order per output, whatever T: float32 over bf16 panels sums as over float32 ones
  const auto step = [&](int k, const vf* wv) {
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const vf a = ps::vset1(x[r * ldx + k]);
#pragma GCC unroll 4
      for (int j = 0; j < NP; ++j) acc[r][j] = ps::vfmadd(a, wv[j], acc[r][j]);
    }
  };
  if constexpr (kStep<T> == 2) {
    const int pairs = K / 2;
    for (int i = 0; i < pairs; ++i) {
      const T* row = w + (int64_t)i * 2 * NR;
      vf wv[NP];
      for (pf_acc += 2 * pf_lines; pf_acc >= K; pf_acc -= K, pf += 64) _mm_prefetch(pf, _MM_HINT_T1);
#pragma GCC unroll 4
      for (int j = 0; j < NP; ++j) wv[j] = ps::vload_bf16_even(row + j * ps);
      step(2 * i, wv);
#pragma GCC unroll 4
      for (int j = 0; j < NP; ++j) wv[j] = ps::vload_bf16_odd(row + j * ps);
      step(2 * i + 1, wv);
    }
    if (K % 2 != 0) {  // an odd K's last pair holds one row
      vf wv[NP];
#pragma GCC unroll 4
      for (int j = 0; j < NP; ++j) wv[j] = ps::vload_bf16_even(w + (int64_t)(K - 1) * NR + j * ps);
      step(K - 1, wv);
    }
  } else {
    for (int k = 0; k < K; ++k) {
      vf wv[NP];
#pragma GCC unroll 4
      for (int j = 0; j < NP; ++j) wv[j] = wload(w + j * ps + (int64_t)k * NR);
      for (pf_acc += pf_lines; pf_acc >= K; pf_acc -= K, pf += 64) _mm_prefetch(pf, _MM_HINT_T1);
      step(k, wv);
    }
  }
  if constexpr (kScaled) {
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) {
      const int n = j == NP - 1 ? last : NR;
      const vf sc = ps::vload_first(scale + j * NR, n), b = bias ? ps::vload_first(bias + j * NR, n) : ps::vzero();
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r) acc[r][j] = ps::vfmadd(acc[r][j], sc, b);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) ps::vstore_first(y + r * ldy + j * NR, acc[r][j], j == NP - 1 ? last : NR);
  }
}

// np <= NG panels: in one register tile where the registers hold them (AVX-512), else one tile per
// panel (AVX2: 6 rows x 16 columns is 12 of its 16 registers), the prefetching shared between them.
template <int R, typename T>
inline void tile_np(int np, const float* x, int64_t ldx, int K, const T* w, int64_t ps, float* y, int64_t ldy,
                    const float* bias, const float* scale, int last, const char* pf, int pf_lines) {
  if constexpr (ps::REG_PANELS >= 4) {
    switch (np) {
      case 1: tile<R, 1>(x, ldx, K, w, ps, y, ldy, bias, scale, last, pf, pf_lines); break;
      case 2: tile<R, 2>(x, ldx, K, w, ps, y, ldy, bias, scale, last, pf, pf_lines); break;
      case 3: tile<R, 3>(x, ldx, K, w, ps, y, ldy, bias, scale, last, pf, pf_lines); break;
      default: tile<R, 4>(x, ldx, K, w, ps, y, ldy, bias, scale, last, pf, pf_lines); break;
    }
  } else {
    const int per = (pf_lines + np - 1) / np;
    for (int j = 0, done = 0; j < np; ++j) {
      const int lines = pf_lines - done < per ? pf_lines - done : per;
      tile<R, 1>(x, ldx, K, w + j * ps, ps, y + j * NR, ldy, bias ? bias + j * NR : nullptr,
                 scale ? scale + j * NR : nullptr, j == np - 1 ? last : NR,
                 lines > 0 ? pf + (int64_t)done * 64 : nullptr, lines);
      done += lines;
    }
  }
}

// Rows of a tile for weights of T: 12 for bf16 panels where the registers hold 12 rows x 2 panels
// (AVX-512), so each widened panel row serves 12 rows' products; else MR.
template <typename T>
constexpr int kTileRows = std::is_same<T, uint16_t>::value && ps::REG_PANELS >= 4 ? 2 * MR : MR;
constexpr int kWideRows = 24;

// 12 rows against np <= NG bf16 panels: tiles of 12 rows x 2 panels (x 1 for an odd last one), the
// prefetching shared between them.
inline void tile_wide(int np, const float* x, int64_t ldx, int K, const uint16_t* w, int64_t ps, float* y,
                      int64_t ldy, const float* bias, int last, const char* pf, int pf_lines) {
  const int tiles = (np + 1) / 2;
  const int per = (pf_lines + tiles - 1) / tiles;
  for (int j = 0, done = 0; j < np; j += 2) {
    const int lines = pf_lines - done < per ? pf_lines - done : per;
    const char* tpf = lines > 0 ? pf + (int64_t)done * 64 : nullptr;
    const float* b = bias ? bias + j * NR : nullptr;
    if (np - j >= 2) {
      tile<2 * MR, 2>(x, ldx, K, w + j * ps, ps, y + j * NR, ldy, b, nullptr, j + 2 == np ? last : NR, tpf, lines);
    } else {
      tile<2 * MR, 1>(x, ldx, K, w + j * ps, ps, y + j * NR, ldy, b, nullptr, last, tpf, lines);
    }
    done += lines;
  }
}

template <typename T>
inline void tile_any(int rows, int np, const float* x, int64_t ldx, int K, const T* w, int64_t ps, float* y,
                     int64_t ldy, const float* bias, const float* scale, int last, const char* pf, int pf_lines) {
  if constexpr (kTileRows<T> > MR) {
    if (rows == kTileRows<T>) {
      tile_wide(np, x, ldx, K, w, ps, y, ldy, bias, last, pf, pf_lines);
      return;
    }
    if (rows > MR) {  // 7-11 rows: 6, then the rest
      tile_np<MR>(np, x, ldx, K, w, ps, y, ldy, bias, scale, last, pf, pf_lines);
      tile_any(rows - MR, np, x + MR * ldx, ldx, K, w, ps, y + MR * ldy, ldy, bias, scale, last, nullptr, 0);
      return;
    }
  }
  switch (rows) {
    case 1: tile_np<1>(np, x, ldx, K, w, ps, y, ldy, bias, scale, last, pf, pf_lines); break;
    case 2: tile_np<2>(np, x, ldx, K, w, ps, y, ldy, bias, scale, last, pf, pf_lines); break;
    case 3: tile_np<3>(np, x, ldx, K, w, ps, y, ldy, bias, scale, last, pf, pf_lines); break;
    case 4: tile_np<4>(np, x, ldx, K, w, ps, y, ldy, bias, scale, last, pf, pf_lines); break;
    case 5: tile_np<5>(np, x, ldx, K, w, ps, y, ldy, bias, scale, last, pf, pf_lines); break;
    default: tile_np<6>(np, x, ldx, K, w, ps, y, ldy, bias, scale, last, pf, pf_lines); break;
  }
}

// Rows [m0, m1) against panels [p0, p1): the rows in chunks whose x fits in L2 next to a group
// of panels (~1 MiB), and per chunk the panels group by group, each next group prefetched.
template <typename T>
void run_block(const float* x, int64_t ldx, int m0, int m1, int K, const T* wp, int64_t ps, int p0, int p1,
               int P, int tail, const float* bias, const float* scale, float* y, int64_t ldy, int TR) {
  const int64_t x_bytes = (int64_t)(m1 - m0) * K * (int64_t)sizeof(float);
  const int chunks = (int)((x_bytes + CHUNK_BYTES - 1) / CHUNK_BYTES);
  const int chunk_tiles = ((m1 - m0 + TR - 1) / TR + chunks - 1) / chunks;  // equal chunks
  for (int c0 = m0; c0 < m1; c0 += chunk_tiles * TR) {
    const int c1 = m1 < c0 + chunk_tiles * TR ? m1 : c0 + chunk_tiles * TR;
    const int tiles = (c1 - c0 + TR - 1) / TR;
    // groups of as equal a size as NG allows (18 panels: 4 4 4 3 3, not 4 4 4 4 2)
    const int groups = (p1 - p0 + NG - 1) / NG;
    const auto group_size = [&](int i) { return i >= groups ? 0 : (p1 - p0) / groups + (i < (p1 - p0) % groups); };
    for (int gi = 0, g = p0; gi < groups; g += group_size(gi), ++gi) {
      const int np = group_size(gi);
      const int next = g + np;
      const int next_np = group_size(gi + 1);  // 0 after the last group
      const int last = next == P ? tail : NR;
      // the next group's panels are contiguous: their 64-byte lines, an equal share per row tile
      const int64_t lines = ((int64_t)next_np * ps * (int64_t)sizeof(T) + 63) / 64, per = (lines + tiles - 1) / tiles;
      const char* next_panels = reinterpret_cast<const char*>(wp + next * ps);
      for (int t = 0; t < tiles; ++t) {
        const int r0 = c0 + t * TR;
        const int rows = c1 - r0 < TR ? c1 - r0 : TR;
        const int64_t first = t * per < lines ? t * per : lines;
        const int pf_lines = (int)(lines - first < per ? lines - first : per);
        tile_any(rows, np, x + r0 * ldx, ldx, K, wp + g * ps, ps, y + r0 * ldy + (int64_t)g * NR, ldy,
                 bias ? bias + g * NR : nullptr, scale ? scale + g * NR : nullptr, last,
                 pf_lines ? next_panels + first * 64 : nullptr, pf_lines);
      }
    }
  }
}

// y = x W^T (+ bias) over panels of T on `threads` OpenMP threads (ps_linear, ps_linear_int8)
template <typename T>
void run(const float* x, int64_t ldx, int M, int K, const T* wp, int N, const float* bias, const float* scale,
         float* y, int64_t ldy, int threads) {
  if (M <= 0 || N <= 0) return;
  const int P = (N + NR - 1) / NR;
  const int64_t ps = (int64_t)(K + kStep<T> - 1) / kStep<T> * kStep<T> * NR;  // T per panel
  const int tail = N - (P - 1) * NR;
  const int team = threads > 0 ? threads : 1;
  // wide tiles from kWideRows rows on: below, the rows they leave to narrow tiles cost what they save
  const int TR = M >= kWideRows ? kTileRows<T> : MR;
  // panels per thread when there are enough to share (the weights read once), else rows per thread
  const bool by_rows = P < 2 * team && M >= 2 * MR * team;
#pragma omp parallel num_threads(team)
  {
    const int nt = omp_get_num_threads(), t = omp_get_thread_num();
    if (by_rows) {
      const int tiles = (M + TR - 1) / TR;
      const int m0 = (int)((int64_t)tiles * t / nt) * TR, m1 = (int)((int64_t)tiles * (t + 1) / nt) * TR;
      if (m0 < M) run_block(x, ldx, m0, m1 < M ? m1 : M, K, wp, ps, 0, P, P, tail, bias, scale, y, ldy, TR);
    } else {
      const int p0 = (int)((int64_t)P * t / nt), p1 = (int)((int64_t)P * (t + 1) / nt);
      if (p0 < p1) run_block(x, ldx, 0, M, K, wp, ps, p0, p1, P, tail, bias, scale, y, ldy, TR);
    }
  }
}

}  // namespace
#endif

// y = x W^T + bias. x: M rows of K floats, ldx apart; wp: W packed [ceil(N/16)][K][16]; bias: N
// floats or null; y: M rows of N floats, ldy apart. threads: the OpenMP team size (torch's).
// Returns 0, or 1 when this build has neither AVX-512 nor AVX2 with FMA.
extern "C" int ps_linear(const float* x, int64_t ldx, int M, int K, const float* wp, int N, const float* bias,
                         float* y, int64_t ldy, int threads) {
#if !defined(PS_SIMD)
  (void)x; (void)ldx; (void)M; (void)K; (void)wp; (void)N; (void)bias; (void)y; (void)ldy; (void)threads;
  return 1;
#else
  run(x, ldx, M, K, wp, N, bias, nullptr, y, ldy, threads);
  return 0;
#endif
}

// The same over int8 weights W = q diag(scale) (model.quantization: int8): qp: q packed as W is for
// ps_linear, [ceil(N/16)][K][16] int8; scale: N floats. y = (x q^T) scale + bias, the sums in float32
// over q widened exactly: a quarter of float32 weights' bytes to stream.
extern "C" int ps_linear_int8(const float* x, int64_t ldx, int M, int K, const int8_t* qp, int N, const float* scale,
                              const float* bias, float* y, int64_t ldy, int threads) {
#if !defined(PS_SIMD)
  (void)x; (void)ldx; (void)M; (void)K; (void)qp; (void)N; (void)scale; (void)bias; (void)y; (void)ldy; (void)threads;
  return 1;
#else
  run(x, ldx, M, K, qp, N, bias, scale, y, ldy, threads);
  return 0;
#endif
}

// ps_linear behind the decoder stack's linear interface (cpu_layer.cpp, PsLinear): `self` points to
// {const float* panels, int64_t n, int64_t k, const float* bias}, a weight packed for ps_linear.
struct PsPackedLinear {
  const float* panels;
  int64_t n, k;
  const float* bias;
};

extern "C" int ps_packed_linear(const void* self, const float* x, int64_t ldx, int M, float* y, int64_t ldy,
                                int threads) {
  const PsPackedLinear* w = static_cast<const PsPackedLinear*>(self);
  return ps_linear(x, ldx, M, (int)w->k, w->panels, (int)w->n, w->bias, y, ldy, threads);
}

// A weight held in bf16 behind the same interface: `self` as for ps_packed_linear, its panels the
// weight's bf16 bits in pairs of rows ([ceil(N/16)][ceil(K/2)][16][2], linear.pack_weight_bf16), each
// row widened to floats exactly: where W's values are bf16 ones (a bf16 checkpoint served in float32)
// y has the bits ps_linear gives over the float32 panels, from half their bytes.
extern "C" int ps_packed_linear_bf16w(const void* self, const float* x, int64_t ldx, int M, float* y, int64_t ldy,
                                      int threads) {
  const PsPackedLinear* w = static_cast<const PsPackedLinear*>(self);
#if !defined(PS_SIMD)
  (void)w; (void)x; (void)ldx; (void)M; (void)y; (void)ldy; (void)threads;
  return 1;
#else
  run(x, ldx, M, (int)w->k, reinterpret_cast<const uint16_t*>(w->panels), (int)w->n, w->bias, nullptr, y, ldy, threads);
  return 0;
#endif
}

// ps_linear_int8 behind the same interface: `self` points to {const int8_t* q, const float* scale,
// int64_t n, int64_t k, const float* bias}, q packed as ps_linear_int8 reads it. Every call reads q:
// from a few hundred rows on, where the arithmetic and not the bytes limits the kernel, widening q
// costs 0-3% against float32 panels (docs/benchmarks.md), which are not kept.
struct PsPackedLinearInt8 {
  const int8_t* q;
  const float* scale;
  int64_t n, k;
  const float* bias;
};

extern "C" int ps_packed_linear_int8(const void* self, const float* x, int64_t ldx, int M, float* y, int64_t ldy,
                                     int threads) {
  const PsPackedLinearInt8* w = static_cast<const PsPackedLinearInt8*>(self);
  return ps_linear_int8(x, ldx, M, (int)w->k, w->q, (int)w->n, w->scale, w->bias, y, ldy, threads);
}
