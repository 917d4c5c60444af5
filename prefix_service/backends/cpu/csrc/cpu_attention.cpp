// Prefill and decode attention on the CPU, float32, AVX-512 or AVX2 (simd.h). The paged KV cache
// holds float32 or bfloat16 (kv_bf16, bf16.h): bf16 rows are widened to float32 as they are read and
// narrowed as they are stored; the arithmetic is float32 either way.
//
// The new tokens' queries attend over two key segments, in one online softmax:
//   A: a pinned template's first R keys, every one visible, held packed at pin time
//      (K as panels of 16 keys [Hkv][ceil(R/16)][D][16], V as rows [Hkv][R][D]);
//   B: the C keys after it: the L cached ones that follow the template, read from the paged
//      cache through the sequence's block table, then N >= M keys given row-strided [N][Hkv][D]
//      (the new tokens' own, as the projection left them); query i (of M) sees the first
//      C - M + i + 1.
// With R = 0 and L = 0 it is plain causal attention over the given keys. The given K/V can be
// written into their cache slots by the same call (the store every layer makes).
//
// Work is split over (KV head, block of 6 query rows), the query heads of one KV head taken
// together so each K/V read serves all of them; all in one OpenMP parallel region (the runtime
// torch itself uses, so the same threads). Scores are made 64 keys at a time in registers
// (6 rows x 4 panels; AVX2: a panel at a time; a decode's own tokens as dot products over their cache
// rows, qk_rows), exponentiated with a polynomial exp, and P V accumulated into each
// row's output, rescaled when its running maximum moves. Built at first use by
// prefix_service/backends/cpu/native.py into the native library; without AVX-512 or AVX2 its entry points return 1.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <atomic>
#include <limits>
#include <new>
#include <type_traits>

#include <omp.h>

#include "bf16.h"
#include "simd.h"
#include "timers.h"

// The vector width this build computes with: 512 (AVX-512), 256 (AVX2 + FMA) or 0 (neither).
extern "C" int ps_isa() {
#if defined(PS_SIMD)
  return ps::ISA;
#else
  return 0;
#endif
}

namespace {
constexpr int KP = 16;        // keys per panel (one vector)
}

#if defined(PS_SIMD)
namespace {

using ps::vf;

constexpr int KC = 64;        // keys per chunk (4 panels)
constexpr int MR = 6;         // query rows per tile
constexpr int MAX_D = 256;    // largest head size handled
constexpr int kKeysAhead = 8; // how far ahead the per-sequence pass asks for its key rows (qk_rows)

using ps::exp_ps;  // scores minus their row maximum: x <= 0

// S[r][0 : 16 NP] = Qs[r] . K for the first R rows and NP panels of 16 keys (panel j at kp + j * D * KP).
// A row's sums are the same whatever R: rows share only the loads.
template <int NP, int R>
inline void qk_tile(const float* qs, int d_len, const float* kp, float* s) {
  vf acc[R][NP];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) acc[r][j] = ps::vzero();
  for (int d = 0; d < d_len; ++d) {
    vf kv[NP];
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) kv[j] = ps::vload(kp + (int64_t)j * d_len * KP + d * KP);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const vf qb = ps::vset1(qs[r * MAX_D + d]);
#pragma GCC unroll 4
      for (int j = 0; j < NP; ++j) acc[r][j] = ps::vfmadd(qb, kv[j], acc[r][j]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) ps::vstore(s + r * KC + j * KP, acc[r][j]);
}

// O[r][c0 : c0 + 16 NV] = alpha[r] * O[r][...] + sum_j P[r][j] V[j][...], j < nk, for the first R rows.
template <int NV, int R>
inline void pv_tile(const float* p, int nk, const float* v, int64_t v_stride, float* o, const float* alpha) {
  vf acc[R][NV];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    const vf a = ps::vset1(alpha[r]);
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) acc[r][c] = ps::vmul(ps::vload(o + r * MAX_D + c * KP), a);
  }
  for (int j = 0; j < nk; ++j) {
    const float* vj = v + j * v_stride;
    vf vv[NV];
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) vv[c] = ps::vload(vj + c * KP);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const vf pb = ps::vset1(p[r * KC + j]);
#pragma GCC unroll 4
      for (int c = 0; c < NV; ++c) acc[r][c] = ps::vfmadd(pb, vv[c], acc[r][c]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) ps::vstore(o + r * MAX_D + c * KP, acc[r][c]);
}

// np <= 4 panels: in one register tile where the registers hold them (AVX-512), else a panel at a
// time (AVX2: 6 rows x 16 keys is 12 of its 16 registers).
template <int R>
inline void qk_panels(int np, const float* qs, int d_len, const float* kp, float* s) {
  if constexpr (ps::REG_PANELS >= 4) {
    switch (np) {
      case 1: qk_tile<1, R>(qs, d_len, kp, s); break;
      case 2: qk_tile<2, R>(qs, d_len, kp, s); break;
      case 3: qk_tile<3, R>(qs, d_len, kp, s); break;
      default: qk_tile<4, R>(qs, d_len, kp, s); break;
    }
  } else {
    for (int j = 0; j < np; ++j) qk_tile<1, R>(qs, d_len, kp + (int64_t)j * d_len * KP, s + j * KP);
  }
}

inline void qk_any(int rows, int np, const float* qs, int d_len, const float* kp, float* s) {
  switch (rows) {
    case 1: qk_panels<1>(np, qs, d_len, kp, s); break;
    case 2: qk_panels<2>(np, qs, d_len, kp, s); break;
    case 3: qk_panels<3>(np, qs, d_len, kp, s); break;
    case 4: qk_panels<4>(np, qs, d_len, kp, s); break;
    case 5: qk_panels<5>(np, qs, d_len, kp, s); break;
    default: qk_panels<MR>(np, qs, d_len, kp, s); break;
  }
}

// S[r][j] = Qs[r] . K_j for the first R rows and nk keys, key j's D floats at rows[j], read where they
// lie (no panels): each score one sum over D in the lanes of a vector, then across them, so a score's
// bits are the same whatever keys share its pass. Each row kKeysAhead keys on is asked for (into L1) as
// a key is taken: rows scattered over a cache then come from memory at a steady pace, where asking for
// a whole chunk's at once left most of them still to wait for when they were read. Not `paced`: the rows
// are in L1 already (a bf16 cache's, widened into a buffer) and nothing is asked for. `values` (not null,
// with `paced`): key j's value row, asked for with its key's.
template <int R>
inline void qk_rows(const float* qs, int d_len, const float* const* rows, int nk, float* s, bool paced,
                    const float* const* values) {
  constexpr int J = R <= 3 ? 2 : 1;  // keys at a time: AVX2 holds 2 x 3 rows' accumulators in 12 registers
  const auto keys = [&](auto per, int j) {
    constexpr int n = decltype(per)::value;
    vf acc[n][R];
#pragma GCC unroll 2
    for (int k = 0; k < n; ++k)
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r) acc[k][r] = ps::vzero();
    for (int d = 0; d < d_len; d += KP) {
      vf kv[n];
#pragma GCC unroll 2
      for (int k = 0; k < n; ++k) kv[k] = ps::vload(rows[j + k] + d);
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r) {
        const vf qv = ps::vload(qs + r * MAX_D + d);
#pragma GCC unroll 2
        for (int k = 0; k < n; ++k) acc[k][r] = ps::vfmadd(qv, kv[k], acc[k][r]);
      }
    }
#pragma GCC unroll 2
    for (int k = 0; k < n; ++k)
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r) s[r * KC + j + k] = ps::vreduce_add(acc[k][r]);
  };
  int j = 0;
  for (; j + J <= nk; j += J) {
    for (int k = 0; k < J; ++k)
      if (paced && j + k + kKeysAhead < nk) {
        const char* p = reinterpret_cast<const char*>(rows[j + k + kKeysAhead]);
        for (int b = 0; b < d_len * 4; b += 64) __builtin_prefetch(p + b, 0, 3);
        if (values != nullptr) {
          const char* pv = reinterpret_cast<const char*>(values[j + k + kKeysAhead]);
          for (int b = 0; b < d_len * 4; b += 64) __builtin_prefetch(pv + b, 0, 3);
        }
      }
    keys(std::integral_constant<int, J>{}, j);
  }
  for (; j < nk; ++j) keys(std::integral_constant<int, 1>{}, j);
}

inline void qk_rows_any(int rows, const float* qs, int d_len, const float* const* keys, int nk, float* s,
                        bool paced, const float* const* values) {
  switch (rows) {
    case 1: qk_rows<1>(qs, d_len, keys, nk, s, paced, values); break;
    case 2: qk_rows<2>(qs, d_len, keys, nk, s, paced, values); break;
    case 3: qk_rows<3>(qs, d_len, keys, nk, s, paced, values); break;
    case 4: qk_rows<4>(qs, d_len, keys, nk, s, paced, values); break;
    case 5: qk_rows<5>(qs, d_len, keys, nk, s, paced, values); break;
    default: qk_rows<MR>(qs, d_len, keys, nk, s, paced, values); break;
  }
}

// The head's columns in passes over the value rows, each pass as many panels of 16 columns as the
// registers hold beside the rows' accumulators: AVX-512 4; AVX2 (2 registers a panel and row, 12 of its
// 16 for them) 4 for 1 row, 2 for 2-3, 1 for more. Fewer passes read each value row in fewer pieces,
// which matters when the rows come from memory. A column's sums are the same whatever the pass.
template <int R>
inline void pv_columns(const float* p, int nk, const float* v, int64_t v_stride, float* o, int d_len,
                       const float* alpha) {
  constexpr int per_pass = ps::REG_PANELS >= 4 || R == 1 ? 4 : R <= 3 ? 2 : 1;
  for (int c0 = 0; c0 < d_len; c0 += per_pass * KP) {
    const int left = (d_len - c0) / KP;
    switch (left < per_pass ? left : per_pass) {
      case 1: pv_tile<1, R>(p, nk, v + c0, v_stride, o + c0, alpha); break;
      case 2: if constexpr (per_pass >= 2) pv_tile<2, R>(p, nk, v + c0, v_stride, o + c0, alpha); break;
      case 3: if constexpr (per_pass >= 3) pv_tile<3, R>(p, nk, v + c0, v_stride, o + c0, alpha); break;
      default: if constexpr (per_pass >= 4) pv_tile<4, R>(p, nk, v + c0, v_stride, o + c0, alpha); break;
    }
  }
}

inline void pv_any(int rows, const float* p, int nk, const float* v, int64_t v_stride, float* o, int d_len,
                   const float* alpha) {
  switch (rows) {
    case 1: pv_columns<1>(p, nk, v, v_stride, o, d_len, alpha); break;
    case 2: pv_columns<2>(p, nk, v, v_stride, o, d_len, alpha); break;
    case 3: pv_columns<3>(p, nk, v, v_stride, o, d_len, alpha); break;
    case 4: pv_columns<4>(p, nk, v, v_stride, o, d_len, alpha); break;
    case 5: pv_columns<5>(p, nk, v, v_stride, o, d_len, alpha); break;
    default: pv_columns<MR>(p, nk, v, v_stride, o, d_len, alpha); break;
  }
}

// The state of one tile of MR query rows.
struct Tile {
  alignas(64) float qs[MR * MAX_D];  // scaled queries
  alignas(64) float o[MR * MAX_D];   // unnormalised output
  alignas(64) float s[MR * KC];      // scores, then probabilities, of one chunk
  float m[MR], l[MR], alpha[MR];
};

// The softmax half of a chunk of nk <= KC keys, on their scores in t.s, for the tile's first `rows`
// rows: each row's probabilities into t.s, its maximum and sum moved on, and in t.alpha what its output
// is to be scaled by before the chunk's P V is added; row r sees the first valid[r] keys.
inline void softmax_chunk(Tile& t, const int* valid, int rows) {
  const vf neg_inf = ps::vset1(-std::numeric_limits<float>::infinity());
  for (int r = 0; r < rows; ++r) {
    float* s = t.s + r * KC;
    const int n = valid[r];
    if (n <= 0) {  // nothing visible in this chunk: state unchanged
      t.alpha[r] = 1.0f;
      std::memset(s, 0, sizeof(float) * KC);
      continue;
    }
    vf mx = neg_inf;
    for (int j = 0; j < KC; j += KP) mx = ps::vmax_first(mx, ps::vload(s + j), n - j);
    // Past a row's first chunks its maximum seldom moves: where no score exceeds it, the maximum stays
    // and the scale is 1 (what the reduction and exp(0) would give) without reducing across lanes
    float m_new = t.m[r];
    t.alpha[r] = 1.0f;
    if (ps::vgt_bits(mx, t.m[r]) != 0) {
      m_new = std::fmax(t.m[r], ps::vreduce_max(mx));
      t.alpha[r] = std::exp(t.m[r] - m_new);  // 0 on the first chunk (m = -inf)
    }
    const vf mb = ps::vset1(m_new);
    vf sum = ps::vzero();
    for (int j = 0; j < KC; j += KP) {
      const vf e = ps::vkeep_first(exp_ps(ps::vsub(ps::vload(s + j), mb)), n - j);
      ps::vstore(s + j, e);
      sum = ps::vadd(sum, e);
    }
    t.l[r] = t.l[r] * t.alpha[r] + ps::vreduce_add(sum);
    t.m[r] = m_new;
  }
}

// A chunk's scores from its keys as panels (K panels at kp), then their softmax.
inline void chunk_scores(Tile& t, int d_len, const float* kp, int nk, const int* valid, int rows) {
  qk_any(rows, (nk + KP - 1) / KP, t.qs, d_len, kp, t.s);
  softmax_chunk(t, valid, rows);
}

// chunk_scores with the chunk's keys as rows (key j's D floats at keys[j]) instead of panels; `values`
// (not null, with `paced`): the value rows, asked for as their keys are.
inline void chunk_scores_rows(Tile& t, int d_len, const float* const* keys, int nk, const int* valid, int rows,
                              bool paced, const float* const* values = nullptr) {
  qk_rows_any(rows, t.qs, d_len, keys, nk, t.s, paced, values);
  softmax_chunk(t, valid, rows);
}

// One chunk of nk <= KC keys for the tile's first `rows` rows: K panels at kp, V rows at v (stride
// v_stride); row r sees the first valid[r] of them.
inline void chunk(Tile& t, int d_len, const float* kp, int nk, const float* v, int64_t v_stride, const int* valid,
                  int rows = MR) {
  chunk_scores(t, d_len, kp, nk, valid, rows);
  pv_any(rows, t.s, nk, v, v_stride, t.o, d_len, t.alpha);
}

constexpr float kOnes[MR] = {1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f};  // a scale that leaves a row's output as it is

// Row r of a tile starts: its scaled query from src, an empty output and softmax state.
inline void start_row(Tile& t, int r, const float* src, int d_len, float scale) {
  for (int d = 0; d < d_len; ++d) t.qs[r * MAX_D + d] = src[d] * scale;
  std::memset(t.o + r * MAX_D, 0, sizeof(float) * d_len);
  t.m[r] = -std::numeric_limits<float>::infinity();
  t.l[r] = 0.0f;
}

// The tile's first `rows` rows over a packed template's r_len keys, all visible (K panels at kt_h, V
// rows at vt_h).
inline void attend_template(Tile& t, int d_len, const float* kt_h, const float* vt_h, int r_len, int rows) {
  int valid[MR];
  for (int c0 = 0; c0 < r_len; c0 += KC) {
    const int nk = r_len - c0 < KC ? r_len - c0 : KC;
    for (int r = 0; r < MR; ++r) valid[r] = nk;
    chunk(t, d_len, kt_h + (int64_t)(c0 / KP) * d_len * KP, nk, vt_h + (int64_t)c0 * d_len, d_len, valid, rows);
  }
}

// Row r of a tile takes the softmax state of n >= 1 ranges of keys, each D + 2 floats (unnormalised
// output, maximum, sum) one after another from st, merged in order: one range's is taken as it is.
inline void merge_states(Tile& t, int r, const float* st, int n, int d_len) {
  const int64_t state_floats = d_len + 2;
  float* o = t.o + r * MAX_D;
  std::memcpy(o, st, sizeof(float) * d_len);
  float m = st[d_len], l = st[d_len + 1];
  for (int i = 1; i < n; ++i) {
    const float* s = st + i * state_floats;
    const float m_new = std::fmax(m, s[d_len]);
    const float a = std::exp(m - m_new), b = std::exp(s[d_len] - m_new);
    for (int d = 0; d < d_len; ++d) o[d] = o[d] * a + s[d] * b;
    l = l * a + s[d_len + 1] * b;
    m = m_new;
  }
  t.m[r] = m;
  t.l[r] = l;
}

// Row r's normalised output into dst.
inline void store_row(const Tile& t, int r, float* dst, int d_len) {
  const float inv = 1.0f / t.l[r];
  for (int d = 0; d < d_len; ++d) dst[d] = t.o[r * MAX_D + d] * inv;
}

// Writes n rows of K and V (rows k_stride / v_stride apart, Hkv x D floats each) into the
// cache's slots (block * block_size + offset; slot_floats = Hkv x D elements), narrowed to bf16
// where the cache holds bf16. Rows are split over the team's threads; call from inside a parallel region.
inline void store_rows(const float* k, int64_t k_stride, const float* v, int64_t v_stride, int n,
                       const int64_t* slots, const ps::KvStore& k_cache, const ps::KvStore& v_cache,
                       int64_t slot_floats) {
#pragma omp for schedule(static) nowait
  for (int i = 0; i < n; ++i) {
    k_cache.write(slots[i] * slot_floats, (int)slot_floats, k + i * k_stride);
    v_cache.write(slots[i] * slot_floats, (int)slot_floats, v + i * v_stride);
  }
}

// The keys of nk <= KC tokens as panels [D][16] at kp, in the layout qk_tile reads (the unused keys
// of the last panel zero); key j's D floats at rows[j]. 16 keys at a time, transposed in registers.
inline void gather_panels(float* kp, const float* const* rows, int nk, int d_len) {
  const vf zero = ps::vzero();
  for (int p0 = 0; p0 < nk; p0 += KP) {
    float* panel = kp + (int64_t)(p0 / KP) * d_len * KP;
    for (int d0 = 0; d0 < d_len; d0 += KP) {
      vf r[KP];
      for (int k = 0; k < KP; ++k) r[k] = p0 + k < nk ? ps::vload(rows[p0 + k] + d0) : zero;
      ps::transpose16(r);
      for (int k = 0; k < KP; ++k) ps::vstore(panel + (int64_t)(d0 + k) * KP, r[k]);
    }
  }
}

// True when every slot lies in a cache of num_slots slots.
inline bool slots_fit(const int64_t* slots, int n, int64_t num_slots) {
  for (int i = 0; i < n; ++i)
    if (slots[i] < 0 || slots[i] >= num_slots) return false;
  return true;
}

}  // namespace
#endif

// Returns 0, or a nonzero code: 1 neither AVX-512 nor AVX2 in this build, 2 unsupported head size, 3 out of
// memory, 4 a slot or block id outside the cache.
//
// q [M][Hq][D] rows q_stride apart; out likewise; kt/vt: segment A (r_len keys, or null with 0);
// kn/vn: kn_len >= M keys and values [kn_len][Hkv][D] after the cached part (the new tokens' own),
// rows kn_stride / vn_stride apart; k_cache/v_cache
// [num_blocks][block_size][Hkv][D] of float32, or of bf16 when kv_bf16; segment B's cached part: tokens [l_start, l_start + l_len) of
// the sequence, through block_table (table_len ids); slots: kn_len cache slots to store kn/vn in, or null.
//
// scratch: null (the call allocates what it needs), or ps_prefill_scratch_floats(hkv, d_len,
// l_len + kn_len) floats, 64-byte aligned, that the call may overwrite. template_fn (not 0) with
// t_handle (not null, the same template packed for it): segment A runs there instead (a
// PsTemplateAttendFn), per KV head and block of query rows, before the tiles carry on from each
// row's state over segment B; 6 when it fails. Its rows and states live in buffers each thread keeps
// from call to call (GrownBuffer), not in scratch. causal_fn (not 0; a PsCausalAttendFn, the
// oneDNN library's ps_onednn_causal_attend): where nothing comes before the new tokens (no template,
// no cached part), the cache holds bf16 and there are kCausalMin or more of them, their attention
// over their own keys runs there (bf16 dot products) after the store; 6 when it fails.
extern "C" int64_t ps_prefill_scratch_floats(int hkv, int d_len, int c_len) {
  const int64_t panels = (c_len + KP - 1) / KP;
  const int64_t kb = (int64_t)hkv * panels * d_len * KP + KP;  // a multiple of 16: 64-byte aligned
  const int64_t vb = ((int64_t)hkv * c_len * d_len + KP - 1) / KP * KP;
  return kb + (vb > 0 ? vb : KP);
}

// A template's part of attention computed outside this library (the oneDNN library's
// ps_onednn_template_attend, matrix products in bf16): rows [0, rows) of q (scaled, rows q_stride
// apart) over KV head h of the template `handle` packed; o (rows ld_o apart), m, l receive each row's
// softmax state after it. 0, or a nonzero status.
using PsCausalAttendFn = int (*)(const float* q, int64_t q_stride, float* out, int64_t out_stride, int m_len, int hq,
                                 int hkv, int d, float scale, const float* kn, int64_t kn_stride, const float* vn,
                                 int64_t vn_stride);
constexpr int kCausalMin = 128;  // fewer new tokens stay on the tiles below (nearly all in one chunk of keys)
using PsTemplateAttendFn = int (*)(const void* handle, int h, const float* q, int64_t q_stride, int rows, float* o,
                                   int64_t ld_o, float* m, float* l);

#if defined(PS_SIMD)
namespace {
// A buffer of one thread's, grown and never shrunk: the matrix-product template path's rows and
// states, so that once a thread has served its largest step, a call allocates nothing (OpenMP's
// workers persist across calls). Null when out of memory.
struct GrownBuffer {
  float* data = nullptr;
  int64_t floats = 0;
  GrownBuffer() = default;
  GrownBuffer(const GrownBuffer&) = delete;
  GrownBuffer& operator=(const GrownBuffer&) = delete;
  ~GrownBuffer() { std::free(data); }
  float* at_least(int64_t count) {
    if (count > floats) {
      std::free(data);
      const int64_t rounded = (count + KP - 1) / KP * KP;  // 64 bytes a multiple of, as aligned_alloc wants
      data = static_cast<float*>(std::aligned_alloc(64, sizeof(float) * rounded));
      floats = data != nullptr ? rounded : 0;
    }
    return data;
  }
};
thread_local GrownBuffer template_states;  // a prefill's rows' states after the template (the calling thread's)
thread_local GrownBuffer template_row_buf;  // one task's rows: queries, outputs, maxima, sums (each thread's)

// n rows over KV head h of a template through template_fn: row i's query at query(i) (times
// scale), its state written to state(i) (D floats of unnormalised output, its maximum, its sum).
// buf: n (2 D + 2) floats. 0, or the call's nonzero status.
template <typename Query, typename State>
int template_rows(int64_t template_fn, const void* handle, int h, int n, int d_len, float scale, float* buf,
                  Query query, State state) {
  float* o = buf + (int64_t)n * d_len;
  float* m = o + (int64_t)n * d_len;
  float* l = m + n;
  for (int i = 0; i < n; ++i) {
    const float* src = query(i);
    for (int e = 0; e < d_len; ++e) buf[(int64_t)i * d_len + e] = src[e] * scale;
  }
  const int code = reinterpret_cast<PsTemplateAttendFn>(template_fn)(handle, h, buf, d_len, n, o, d_len, m, l);
  if (code != 0) return code;
  for (int i = 0; i < n; ++i) {
    float* st = state(i);
    std::memcpy(st, o + (int64_t)i * d_len, sizeof(float) * d_len);
    st[d_len] = m[i];
    st[d_len + 1] = l[i];
  }
  return 0;
}
}  // namespace
#endif

extern "C" int ps_prefill_attention(const float* q, int64_t q_stride, float* out, int64_t out_stride,
                                    int m_len, int hq, int hkv, int d_len, float scale,
                                    const float* kt, const float* vt, int r_len,
                                    const float* kn, int64_t kn_stride, const float* vn, int64_t vn_stride, int kn_len,
                                    void* k_cache, void* v_cache, int num_blocks, int block_size,
                                    const int32_t* block_table, int table_len, int l_start, int l_len,
                                    const int64_t* slots, float* scratch, int kv_bf16, const void* t_handle,
                                    int64_t template_fn, int64_t causal_fn) {
#if !defined(PS_SIMD)
  (void)q; (void)q_stride; (void)out; (void)out_stride; (void)m_len; (void)hq; (void)hkv; (void)d_len;
  (void)scale; (void)kt; (void)vt; (void)r_len; (void)kn; (void)kn_stride; (void)vn; (void)vn_stride; (void)kn_len;
  (void)k_cache; (void)v_cache; (void)num_blocks; (void)block_size; (void)block_table; (void)table_len;
  (void)l_start; (void)l_len; (void)slots; (void)scratch; (void)kv_bf16; (void)t_handle; (void)template_fn;
  (void)causal_fn;
  return 1;
#else
  ps::TimerScope timer(ps::kAttention);
  if (d_len <= 0 || d_len > MAX_D || d_len % KP != 0 || hkv <= 0 || hq % hkv != 0 || kn_len < m_len) return 2;
  const int64_t slot_floats = (int64_t)hkv * d_len;
  if (slots != nullptr && !slots_fit(slots, kn_len, (int64_t)num_blocks * block_size)) return 4;
  if (l_len > 0) {  // the cached part's blocks
    if (l_start < 0 || block_size <= 0 || (int64_t)(l_start + l_len - 1) / block_size >= table_len) return 4;
    for (int b = l_start / block_size; b <= (l_start + l_len - 1) / block_size; ++b)
      if (block_table[b] < 0 || block_table[b] >= num_blocks) return 4;
  }
  if (causal_fn != 0 && kv_bf16 != 0 && r_len == 0 && l_len == 0 && kn_len == m_len && m_len >= kCausalMin) {
    const ps::KvStore kc{k_cache, true}, vc{v_cache, true};
    if (slots != nullptr) {
#pragma omp parallel
      store_rows(kn, kn_stride, vn, vn_stride, kn_len, slots, kc, vc, slot_floats);
    }
    return reinterpret_cast<PsCausalAttendFn>(causal_fn)(q, q_stride, out, out_stride, m_len, hq, hkv, d_len, scale,
                                                         kn, kn_stride, vn, vn_stride) == 0 ? 0 : 6;
  }
  const int g = hq / hkv;
  const int c_len = l_len + kn_len;              // segment B: cached part, then kn's keys
  const int rows = m_len * g;                    // per KV head, in (token, head in group) order
  const int tiles = (rows + MR - 1) / MR;
  const int c_panels = (c_len + KP - 1) / KP;
  const int64_t panel_floats = (int64_t)d_len * KP;
  // segment B's keys as panels [Hkv][c_panels][D][16] and its values as rows [Hkv][C][D], made
  // once per call by all threads, in the caller's scratch or in memory of the call's own
  const int64_t kb_floats = hkv * (int64_t)c_panels * panel_floats + KP;  // a multiple of 16: 64-byte aligned
  float* owned = nullptr;
  if (scratch == nullptr) {
    owned = static_cast<float*>(std::aligned_alloc(64, sizeof(float) * ps_prefill_scratch_floats(hkv, d_len, c_len)));
    if (owned == nullptr) return 3;
  }
  float* kb = scratch != nullptr ? scratch : owned;
  float* vb = kb + kb_floats;
  const ps::KvStore kc{k_cache, kv_bf16 != 0}, vc{v_cache, kv_bf16 != 0};
  // segment B's cached key j (j < l_len): the element its row starts at in the cache, through the block table
  const auto cached_at = [&](int j) -> int64_t {
    const int tok = l_start + j;
    return ((int64_t)block_table[tok / block_size] * block_size + tok % block_size) * slot_floats;
  };
  const int r_panels = (r_len + KP - 1) / KP;
  // segment A as matrix products: each row's softmax state after the template, made first per
  // (KV head, block of ab rows) so each product call serves many rows; [hkv][rows][D + 2]. A call
  // has a fixed cost and pads its rows to whole blocks of 4, so the blocks are as large as leaves
  // each thread two or more, in multiples of 4, and at least kABMin rows
  constexpr int kABMin = 24;
  const int per_head = (2 * omp_get_max_threads() + hkv - 1) / hkv;  // blocks a KV head's rows are cut into
  int ab = ((rows + per_head - 1) / per_head + 3) / 4 * 4;
  if (ab < kABMin) ab = kABMin;
  const bool matrix = r_len > 0 && template_fn != 0 && t_handle != nullptr;
  const int64_t state_floats = d_len + 2;
  float* state = matrix ? template_states.at_least(hkv * (int64_t)rows * state_floats) : nullptr;
  if (matrix && state == nullptr) {
    std::free(owned);
    return 3;
  }
  const int a_blocks = (rows + ab - 1) / ab;
  int status = 0;
#pragma omp parallel
  {
    if (slots != nullptr) store_rows(kn, kn_stride, vn, vn_stride, kn_len, slots, kc, vc, slot_floats);
    if (matrix) {
      float* buf = template_row_buf.at_least(ab * (2 * (int64_t)d_len + 2));
      if (buf == nullptr) {
#pragma omp atomic write
        status = 3;
      }
#pragma omp for schedule(static, 1)
      for (int64_t task = 0; task < (int64_t)hkv * a_blocks; ++task) {
        if (buf == nullptr) continue;
        const int h = (int)(task / a_blocks), r0 = (int)(task % a_blocks) * ab;
        const int nr = rows - r0 < ab ? rows - r0 : ab;
        const auto query = [&](int i) {
          return q + ((r0 + i) / g) * q_stride + (int64_t)(h * g + (r0 + i) % g) * d_len;
        };
        const auto dst = [&](int i) { return state + ((int64_t)h * rows + r0 + i) * state_floats; };
        if (template_rows(template_fn, t_handle, h, nr, d_len, scale, buf, query, dst) != 0) {
#pragma omp atomic write
          status = 6;
        }
      }
      // (the loop's end is a barrier: every state is written before the tiles read it)
    }
    alignas(64) float widened[KP * MAX_D];  // a panel's cached keys, widened from a bf16 cache
#pragma omp for schedule(static)
    for (int64_t hp = 0; hp < (int64_t)hkv * c_panels; ++hp) {
      const int h = (int)(hp / c_panels), pnl = (int)(hp % c_panels);
      const int n = c_len - pnl * KP < KP ? c_len - pnl * KP : KP;  // this panel's keys
      const float* key_rows[KP];
      for (int k = 0; k < n; ++k) {
        const int key = pnl * KP + k;
        float* v_row = vb + ((int64_t)h * c_len + key) * d_len;
        if (key >= l_len) {  // a new token's own
          key_rows[k] = kn + (int64_t)(key - l_len) * kn_stride + (int64_t)h * d_len;
          std::memcpy(v_row, vn + (int64_t)(key - l_len) * vn_stride + (int64_t)h * d_len, sizeof(float) * d_len);
        } else {
          const int64_t at = cached_at(key) + (int64_t)h * d_len;
          key_rows[k] = kc.row(at, d_len, widened + k * MAX_D);
          vc.read(at, d_len, v_row);
        }
      }
      gather_panels(kb + hp * panel_floats, key_rows, n, d_len);
    }
    Tile t;
    int valid[MR];
    int tok[MR];
#pragma omp for schedule(static, 1)
    for (int64_t task = 0; task < (int64_t)hkv * tiles; ++task) {
      const int h = (int)(task / tiles), r0 = (int)(task % tiles) * MR;
      const int real = rows - r0 < MR ? rows - r0 : MR;  // the tile's real rows: no work for padding ones
      int last_visible = 0;  // segment B keys seen by the tile's last row
      for (int r = 0; r < MR; ++r) {
        const int row = r0 + r < rows ? r0 + r : rows - 1;  // a padding row repeats the last one
        tok[r] = row / g;
        start_row(t, r, q + tok[r] * q_stride + (int64_t)(h * g + row % g) * d_len, d_len, scale);
        const int visible = c_len - m_len + tok[r] + 1;
        if (visible > last_visible) last_visible = visible;
      }
      if (status != 0) continue;
      if (matrix) {  // A: the rows' states after the template, from the matrix products above
        for (int r = 0; r < real; ++r) {
          const float* st = state + ((int64_t)h * rows + r0 + r) * state_floats;
          std::memcpy(t.o + r * MAX_D, st, sizeof(float) * d_len);
          t.m[r] = st[d_len];
          t.l[r] = st[d_len + 1];
        }
      } else if (r_len > 0) {  // A: every key visible
        attend_template(t, d_len, kt + (int64_t)h * r_panels * panel_floats, vt + (int64_t)h * r_len * d_len, r_len,
                        real);
      }
      const float* kb_h = kb + (int64_t)h * c_panels * panel_floats;
      const float* vb_h = vb + (int64_t)h * c_len * d_len;
      for (int c0 = 0; c0 < last_visible; c0 += KC) {  // B: causal
        const int nk = last_visible - c0 < KC ? last_visible - c0 : KC;
        for (int r = 0; r < MR; ++r) {
          const int n = c_len - m_len + tok[r] + 1 - c0;
          valid[r] = n < 0 ? 0 : n > nk ? nk : n;
        }
        chunk(t, d_len, kb_h + (int64_t)(c0 / KP) * panel_floats, nk, vb_h + (int64_t)c0 * d_len, d_len, valid, real);
      }
      for (int r = 0; r < MR && r0 + r < rows; ++r)
        store_row(t, r, out + tok[r] * out_stride + (int64_t)(h * g + (r0 + r) % g) * d_len, d_len);
    }
  }
  std::free(owned);
  return status;
#endif
}

// How a decode's second pass (each sequence's own rows, scattered over the cache) asks for the rows it
// reads, ahead of reading them (ps_decode_prefetch). Asking never changes what is computed:
//   kPrefetchTask: every row of a task into L2 as the task starts; then, per chunk of 64 keys, each key
//     row into L1 kKeysAhead keys before its scores read it, and a float32 cache's value rows into L1
//     all at the chunk's start;
//   kPrefetchPaced: no task-wide asking; a float32 cache's value rows go into L1 with their keys,
//     kKeysAhead keys ahead (a bf16 cache's keys and values are paced as they are widened, either way).
// On a Zen 3 the task-wide asking made the pass faster (docs/benchmarks.md); on an Intel Xeon its
// hundreds of prefetches at once stalled the core (each one that misses holds one of its few fill
// buffers) and the paced way took 0.85-0.93x the time. native.py chooses by the CPU's maker.
constexpr int kPrefetchTask = 0, kPrefetchPaced = 1;
std::atomic<int> decode_prefetch{kPrefetchTask};

// Sets how ps_decode_attention asks for its rows (kPrefetchTask or kPrefetchPaced) and returns the
// way before; any other mode (-1: to ask) leaves it as it is and returns it.
extern "C" int ps_decode_prefetch(int mode) {
  if (mode == kPrefetchTask || mode == kPrefetchPaced) return decode_prefetch.exchange(mode);
  return decode_prefetch.load();
}

namespace {
// A decode's packed template is attended in ranges of template_split(r_len) keys, each range's
// softmax state made on its own (pass A) and the states merged in order (pass B): at most
// kMaxSplits ranges, each a multiple of 64 keys and at least kSplitMin. The ranges depend on the
// template's length alone, never on the batch or the thread count, so neither changes a row's bits.
// They share out even one sequence's reading of its template: by KV head alone, SmolLM2's 3 would be
// 3 tasks on 2 threads, one thread reading two thirds.
constexpr int kMaxSplits = 8;
constexpr int kSplitMin = 512;
inline int template_split(int r_len) {
  const int per = (r_len + kMaxSplits - 1) / kMaxSplits;
  const int keys = (per + 63) / 64 * 64;  // whole chunks of 64 keys
  return keys < kSplitMin ? kSplitMin : keys;
}
inline int template_splits(int r_len) {
  const int span = template_split(r_len);
  return r_len <= 0 ? 0 : (r_len + span - 1) / span;
}
}  // namespace

// The floats of scratch ps_decode_attention needs for n_seq sequences of hq query heads: each
// query row's softmax state after each range of its template's keys (unnormalised output, running
// maximum, sum).
extern "C" int64_t ps_decode_scratch_floats(int n_seq, int hq, int d_len) {
  return ((int64_t)n_seq * hq * kMaxSplits * (d_len + 2) + KP - 1) / KP * KP;
}

// Decode attention: n_seq sequences, one new token each, over their paged cache
// (k_cache/v_cache [blocks][block_size][Hkv][D], float32 or, when kv_bf16, bf16; the new tokens' K/V already stored, or stored
// first from kn/vn into `slots` when slots is not null; num_blocks bounds the slots). Sequence n
// sees context_lens[n] tokens through its block table; where kt_ptrs[n] is not 0 its first
// skip_blocks[n] blocks come instead from a packed template (the layout of segment A above).
//
// Two passes in one parallel region. A: the sequences that read the same packed template attend
// to it together: per KV head and range of the template's keys (template_split), the query heads of
// all of them are the rows of tiles that walk the range's keys 64 at a time, each chunk serving
// every tile while it is in cache, so the template is read from memory once per (KV head, block of
// tiles) instead of once per sequence, and even one sequence's reading is shared out; each row's
// softmax state after each range is kept in `scratch` (ps_decode_scratch_floats; null: the call
// allocates it). B: each sequence's rest of context, through its block table, per (sequence, tile
// of query heads) over all its KV heads (per KV head too when there are fewer than two sequences a
// thread), from its ranges' states merged in order: a task asks for the cache rows it reads ahead of
// reading them (ps_decode_prefetch's way), takes the keys 64 at a time, each score a dot product over
// the key's row where it lies (qk_rows: no panels to gather), and the values likewise (a bf16 cache's
// keys and values widened into a per-thread buffer first). A row's arithmetic is the same whatever
// rows share its tile or task.
// template_fn (not 0) with th_ptrs[n] (not 0): pass A of the group of sequence n calls template_fn
// on the handle th_ptrs[n] instead (a PsTemplateAttendFn: the template's part as matrix products),
// with the same rows per task; its state goes where the native pass puts its own. kt_ptrs[n] then
// only names the template (the rows are grouped by it) and is not read.
extern "C" int ps_decode_attention(const float* q, int64_t q_stride, float* out, int64_t out_stride,
                                   int n_seq, int hq, int hkv, int d_len, float scale,
                                   void* k_cache, void* v_cache, int block_size,
                                   const int32_t* block_tables, int64_t table_stride, const int32_t* context_lens,
                                   const int32_t* skip_blocks, const int64_t* kt_ptrs, const int64_t* vt_ptrs,
                                   const float* kn, int64_t kn_stride, const float* vn, int64_t vn_stride,
                                   const int64_t* slots, int num_blocks, float* scratch, int kv_bf16,
                                   const int64_t* th_ptrs, int64_t template_fn) {
#if !defined(PS_SIMD)
  (void)q; (void)q_stride; (void)out; (void)out_stride; (void)n_seq; (void)hq; (void)hkv; (void)d_len;
  (void)scale; (void)k_cache; (void)v_cache; (void)block_size; (void)block_tables; (void)table_stride;
  (void)context_lens; (void)skip_blocks; (void)kt_ptrs; (void)vt_ptrs; (void)kn; (void)kn_stride; (void)vn;
  (void)vn_stride; (void)slots; (void)num_blocks; (void)scratch; (void)kv_bf16; (void)th_ptrs; (void)template_fn;
  return 1;
#else
  ps::TimerScope timer(ps::kAttention);
  if (d_len <= 0 || d_len > MAX_D || d_len % KP != 0 || hkv <= 0 || hq % hkv != 0) return 2;
  const int g = hq / hkv;
  const int tiles = (g + MR - 1) / MR;  // tiles of query heads per KV head
  const int64_t slot_stride = (int64_t)hkv * d_len;
  const int64_t block_floats = (int64_t)block_size * slot_stride;
  const int64_t panel_floats = (int64_t)d_len * KP;
  const int64_t state_floats = d_len + 2;  // a row's output, then its maximum and sum
  const ps::KvStore kc{k_cache, kv_bf16 != 0}, vc{v_cache, kv_bf16 != 0};
  if (slots != nullptr && !slots_fit(slots, n_seq, (int64_t)num_blocks * block_size)) return 4;
  const bool paced = decode_prefetch.load(std::memory_order_relaxed) == kPrefetchPaced;

  // the sequences with a template, grouped by it (members[group_start[i] .. group_start[i + 1])),
  // and the ranges of keys each sequence's template is attended in (1 where template_fn does it whole)
  int* members = static_cast<int*>(std::malloc(sizeof(int) * 3 * ((size_t)n_seq + 1)));
  if (members == nullptr) return 3;
  int* group_start = members + n_seq;
  int* splits = group_start + n_seq + 1;
  int n_groups = 0, n_members = 0, split_units = 0;  // split_units: (group, KV head, range) tasks before blocks
  if (kt_ptrs != nullptr)
    for (int n = 0; n < n_seq; ++n) {
      if (kt_ptrs[n] == 0) continue;
      bool seen = false;  // a member of an earlier group: the same template, read as far
      for (int i = 0; i < n_members && !seen; ++i)
        seen = kt_ptrs[members[i]] == kt_ptrs[n] && skip_blocks[members[i]] == skip_blocks[n];
      if (seen) continue;
      const bool matrix = template_fn != 0 && th_ptrs != nullptr && th_ptrs[n] != 0;
      const int ranges = matrix ? 1 : template_splits(skip_blocks[n] * block_size);
      split_units += hkv * ranges;
      group_start[n_groups++] = n_members;
      for (int m = n; m < n_seq; ++m)
        if (kt_ptrs[m] == kt_ptrs[n] && skip_blocks[m] == skip_blocks[n]) {
          members[n_members++] = m;
          splits[m] = ranges;
        }
    }
  group_start[n_groups] = n_members;
  float* owned = nullptr;
  float* state = scratch;
  if (n_groups > 0 && state == nullptr) {
    owned = static_cast<float*>(std::aligned_alloc(64, sizeof(float) * ps_decode_scratch_floats(n_seq, hq, d_len)));
    if (owned == nullptr) {
      std::free(members);
      return 3;
    }
    state = owned;
  }
  // query head `head` of sequence n: its kMaxSplits states, one per range of its template's keys
  const auto row_states = [&](int n, int head) { return state + ((int64_t)n * hq + head) * kMaxSplits * state_floats; };
  // pass A's tasks: (group, KV head, range of keys, block of up to TB tiles), at least two per thread
  // where the rows allow; a group with fewer ranges than kMaxSplits skips the tasks of the others
  constexpr int TB = 8;
  const int threads = omp_get_max_threads();
  int blocks_per_head = 0;  // the same for every group: the largest group's tiles decide
  int max_tiles = 0;
  for (int i = 0; i < n_groups; ++i) {
    const int rows = (group_start[i + 1] - group_start[i]) * g;
    const int t = (rows + MR - 1) / MR;
    if (t > max_tiles) max_tiles = t;
  }
  if (n_groups > 0) {
    blocks_per_head = (max_tiles + TB - 1) / TB;
    const int want = (2 * threads + split_units - 1) / split_units;
    if (blocks_per_head < want) blocks_per_head = want < max_tiles ? want : max_tiles;
  }
  int status = 0;
#pragma omp parallel
  {
    if (slots != nullptr) {  // the new tokens' K/V first: each sequence reads its own
      store_rows(kn, kn_stride, vn, vn_stride, n_seq, slots, kc, vc, slot_stride);
#pragma omp barrier
    }
    int valid[MR];
    if (n_groups > 0) {  // A: templates, read once per (KV head, block of tiles)
      Tile* block = new (std::nothrow) Tile[TB];
      // the template_fn path's rows of one task (at most TB tiles): queries, outputs, maxima, sums
      float* rows_q = template_fn != 0 ? template_row_buf.at_least((int64_t)TB * MR * (2 * d_len + 2)) : nullptr;
      if (block == nullptr || (template_fn != 0 && rows_q == nullptr)) {
#pragma omp atomic write
        status = 3;
      }
#pragma omp for schedule(dynamic, 1)
      for (int64_t task = 0; task < (int64_t)n_groups * hkv * kMaxSplits * blocks_per_head; ++task) {
        if (block == nullptr || (template_fn != 0 && rows_q == nullptr)) continue;
        const int gi = (int)(task / ((int64_t)hkv * kMaxSplits * blocks_per_head));
        const int h = (int)((task / ((int64_t)kMaxSplits * blocks_per_head)) % hkv);
        const int sp = (int)((task / blocks_per_head) % kMaxSplits);  // the range of keys
        const int b = (int)(task % blocks_per_head);
        const int* seqs = members + group_start[gi];
        if (sp >= splits[seqs[0]]) continue;
        const int rows = (group_start[gi + 1] - group_start[gi]) * g;
        const int n_tiles = (rows + MR - 1) / MR;
        const int t0 = (int)((int64_t)n_tiles * b / blocks_per_head);
        const int t1 = (int)((int64_t)n_tiles * (b + 1) / blocks_per_head);
        if (template_fn != 0 && th_ptrs != nullptr && th_ptrs[seqs[0]] != 0) {  // the template as matrix products
          const int r0 = t0 * MR, nr = (t1 * MR < rows ? t1 * MR : rows) - r0;
          const auto query = [&](int i) {
            return q + seqs[(r0 + i) / g] * q_stride + (int64_t)(h * g + (r0 + i) % g) * d_len;
          };
          const auto dst = [&](int i) {
            return row_states(seqs[(r0 + i) / g], h * g + (r0 + i) % g);
          };
          if (template_rows(template_fn, reinterpret_cast<const void*>(th_ptrs[seqs[0]]), h, nr, d_len, scale, rows_q,
                            query, dst) != 0) {
#pragma omp atomic write
            status = 6;
          }
          continue;
        }
        for (int ti = t0; ti < t1; ++ti)
          for (int r = 0; r < MR; ++r) {
            const int row = ti * MR + r < rows ? ti * MR + r : rows - 1;  // a padding row repeats the last one
            start_row(block[ti - t0], r, q + seqs[row / g] * q_stride + (int64_t)(h * g + row % g) * d_len, d_len,
                      scale);
          }
        const int n0 = seqs[0];
        const int r_len = skip_blocks[n0] * block_size;
        const int r_panels = (r_len + KP - 1) / KP;
        const float* kt_h = reinterpret_cast<const float*>(kt_ptrs[n0]) + (int64_t)h * r_panels * panel_floats;
        const float* vt_h = reinterpret_cast<const float*>(vt_ptrs[n0]) + (int64_t)h * r_len * d_len;
        const int span = template_split(r_len);
        const int k0 = sp * span, k1 = k0 + span < r_len ? k0 + span : r_len;  // the range's keys, whole panels from k0
        for (int c0 = k0; c0 < k1; c0 += KC) {
          const int nk = k1 - c0 < KC ? k1 - c0 : KC;
          if (ps::REG_PANELS < 4 && rows - t0 * MR > 3) {
            // AVX2 takes a tile of 4-6 rows' values in 16-column passes (pv_columns), each a 64-byte piece of
            // every value row: the chunk's rows are asked for (into L2) first, while its scores are computed
            const char* vp = reinterpret_cast<const char*>(vt_h + (int64_t)c0 * d_len);
            const int64_t bytes = (int64_t)nk * d_len * (int64_t)sizeof(float);
            for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(vp + at, 0, 2);
          }
          for (int r = 0; r < MR; ++r) valid[r] = nk;
          for (int ti = t0; ti < t1; ++ti)
            chunk(block[ti - t0], d_len, kt_h + (int64_t)(c0 / KP) * panel_floats, nk, vt_h + (int64_t)c0 * d_len,
                  d_len, valid, rows - ti * MR < MR ? rows - ti * MR : MR);
        }
        for (int ti = t0; ti < t1; ++ti)
          for (int r = 0; r < MR && ti * MR + r < rows; ++r) {
            const int row = ti * MR + r;
            const Tile& t = block[ti - t0];
            float* st = row_states(seqs[row / g], h * g + row % g) + sp * state_floats;
            std::memcpy(st, t.o + r * MAX_D, sizeof(float) * d_len);
            st[d_len] = t.m[r];
            st[d_len + 1] = t.l[r];
          }
      }
      delete[] block;  // (the loop's end is a barrier: every state is written before B reads it)
    }
    // a bf16 cache's keys and values of a chunk, widened to float32 (a float32 cache's are read in place)
    float* widened = kv_bf16 ? static_cast<float*>(std::aligned_alloc(64, sizeof(float) * 2 * KC * d_len)) : nullptr;
    float* vbuf = widened != nullptr ? widened + KC * d_len : nullptr;
    if (kv_bf16 && widened == nullptr) {
#pragma omp atomic write
      status = 3;
    }
    Tile t;
    // B's tasks: (sequence, tile) over all of the sequence's KV heads where there are sequences enough
    // to share out, so that a task reads whole slots of the cache; (sequence, KV head, tile) otherwise
    const int heads_per_task = n_seq >= 2 * threads ? hkv : 1;
    const int head_groups = hkv / heads_per_task;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < (int64_t)n_seq * head_groups * tiles; ++task) {  // B: the rest of each context
      if (status != 0) continue;
      const int n = (int)(task / ((int64_t)head_groups * tiles));
      const int h0 = (int)((task / tiles) % head_groups) * heads_per_task;
      const int g0 = (int)(task % tiles) * MR;
      const bool templated = kt_ptrs != nullptr && kt_ptrs[n] != 0;
      const int first = templated ? skip_blocks[n] * block_size : 0;  // first cache token to read
      const int ctx = context_lens[n];
      const int32_t* table = block_tables + n * table_stride;
      const int heads = g - g0 < MR ? g - g0 : MR;  // the tile's real rows: no work for padding ones
      const auto slot = [&](int tok) {  // the first element of token tok's slot in the cache
        return (int64_t)table[tok / block_size] * block_floats + (int64_t)(tok % block_size) * slot_stride;
      };
      // kPrefetchTask: every row the task reads, asked for at once (into L2), so that the misses overlap
      // each other and the arithmetic: read one after another, the scattered blocks' rows cost 2-3x their
      // bytes' time
      if (!paced)
        for (int tok = first; tok < ctx; ++tok) {
          kc.prefetch(slot(tok) + (int64_t)h0 * d_len, (int64_t)heads_per_task * d_len, false);
          vc.prefetch(slot(tok) + (int64_t)h0 * d_len, (int64_t)heads_per_task * d_len, false);
        }
      for (int h = h0; h < h0 + heads_per_task; ++h) {
        for (int r = 0; r < MR; ++r) {
          const int gg = g0 + r < g ? g0 + r : g - 1;  // a padding row repeats the last head
          start_row(t, r, q + n * q_stride + (int64_t)(h * g + gg) * d_len, d_len, scale);
          if (templated)  // from its state after the template: pass A's, its ranges merged in order
            merge_states(t, r, row_states(n, h * g + gg), splits[n], d_len);
        }
        const float* key_rows[KC];
        const float* value_rows[KC];  // a float32 cache's, kPrefetchPaced: asked for with their keys
        int64_t row_at[KC];  // the chunk's rows of head h in the cache
        for (int c0 = first; c0 < ctx; c0 += KC) {
          const int nk = ctx - c0 < KC ? ctx - c0 : KC;
          // the chunk's rows into L1, each kKeysAhead keys before it is read: the first kKeysAhead now, the
          // others as the keys before them are read (a float32 cache's keys by the scores, in qk_rows; a bf16
          // cache's keys and values as they are widened, just below); a float32 cache's values, read after
          // the scores, all now (kPrefetchTask) or with their keys (kPrefetchPaced)
          const bool pace_values = paced && !kv_bf16;
          for (int j = 0; j < nk; ++j) {
            row_at[j] = slot(c0 + j) + (int64_t)h * d_len;
            if (pace_values) value_rows[j] = static_cast<const float*>(v_cache) + row_at[j];
            if (j < kKeysAhead) kc.prefetch(row_at[j], d_len, true);
            if ((!kv_bf16 && !paced) || j < kKeysAhead) vc.prefetch(row_at[j], d_len, true);
          }
          for (int j = 0; j < nk; ++j) {
            if (kv_bf16 && j + kKeysAhead < nk) {
              kc.prefetch(row_at[j + kKeysAhead], d_len, true);
              vc.prefetch(row_at[j + kKeysAhead], d_len, true);
            }
            key_rows[j] = kc.row(row_at[j], d_len, widened + (int64_t)j * d_len);
            if (kv_bf16) vc.read(row_at[j], d_len, vbuf + (int64_t)j * d_len);
          }
          for (int r = 0; r < MR; ++r) valid[r] = nk;
          chunk_scores_rows(t, d_len, key_rows, nk, valid, heads, !kv_bf16, pace_values ? value_rows : nullptr);
          if (kv_bf16) {
            pv_any(heads, t.s, nk, vbuf, d_len, t.o, d_len, t.alpha);
            continue;
          }
          // a float32 cache's values read where they lie, a block's run of slots at a time (slot_stride
          // apart): the same products in the same order as over a copy, the output scaled by 1 after the first
          for (int j0 = 0; j0 < nk;) {
            const int left = block_size - (c0 + j0) % block_size;
            const int run = left < nk - j0 ? left : nk - j0;
            pv_any(heads, t.s + j0, run, static_cast<const float*>(v_cache) + row_at[j0], slot_stride, t.o, d_len,
                   j0 == 0 ? t.alpha : kOnes);
            j0 += run;
          }
        }
        for (int r = 0; r < MR && g0 + r < g; ++r)
          store_row(t, r, out + n * out_stride + (int64_t)(h * g + g0 + r) * d_len, d_len);
      }
    }
    std::free(widened);
  }
  std::free(owned);
  std::free(members);
  return status;
#endif
}
