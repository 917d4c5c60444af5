// The decoder stack: every layer of a forward in one call (ps_decoder_stack), each layer the kernels
// of cpu_linear.cpp, cpu_elementwise.cpp and cpu_attention.cpp in sequence, with the arguments a
// caller would pass them one by one, so the results are the same bit for bit. A kernel call from
// Python costs its argument checks, an allocation and a ctypes call, a few microseconds each; over
// a layer's ten calls and thirty layers that was most of a short prefill's time outside the kernels.
// Also the copy-on-write of blocks in every layer (ps_copy_blocks) and the kernel timers
// (ps_timers). Built into the native library by prefix_service/backends/cpu/native.py.
//
// A linear layer is whatever its PsLinear names: ps_packed_linear (cpu_linear.cpp, the float32
// kernel) or the oneDNN library's entry point (onednn_linear.cpp, bfloat16 weights); the stack only
// calls it. Activations (the residual stream, norms, attention) are float32 in either dtype, except
// the rows a bf16 linear layer takes or gives through its bf16 hand-offs (PsLinear.run_bf16): a
// norm's output and the gated activation's input and output then travel as bf16 bits, rounded
// where the layer would have rounded them, so the bits are the float32 path's with half the bytes
// and no rounding or widening pass (layer_qkv, layer_mlp). The KV
// cache holds the model's dtype (kv_bf16: bfloat16, with the new tokens' K and V rounded to bf16
// before anything reads them, so a token's key is the same number whether a later query reads it
// from this step's rows or from the cache).
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "bf16.h"
#include "timers.h"

// y[M][N] (rows ldy apart) = x[M][K] (rows ldx apart) W^T (+ bias), W and its shape held by `self`;
// returns 0 or a nonzero status
using PsLinearFn = int (*)(const void* self, const float* x, int64_t ldx, int M, float* y, int64_t ldy, int threads);
// The same product with bf16 hand-offs, for a bf16 weight: x as bf16 bits where x_bf16 (the rows the
// layer would have rounded to bf16 itself), y written as bf16 bits where y_bf16 (the outputs it
// would have widened); strides count elements of each one's type
using PsLinearBf16Fn = int (*)(const void* self, const void* x, int x_bf16, int64_t ldx, int M, void* y, int y_bf16,
                               int64_t ldy, int threads);
struct PsLinear {
  PsLinearFn run;
  const void* self;
  PsLinearBf16Fn run_bf16;  // null: float32 rows only (a float32 weight)
};

// Every linear layer the cpu backend runs is timed here, whatever library computes it: the
// stack's layers, and from Python the output head (ps_call_linear).
inline int run_linear(const PsLinear* w, const float* x, int64_t ldx, int rows, float* y, int64_t ldy, int threads) {
  ps::TimerScope timer(ps::kLinear);
  return w->run(w->self, x, ldx, rows, y, ldy, threads);
}

// x (float32, or bf16 bits where x_bf16) through w into y (float32, or bf16 bits where y_bf16): the bf16
// hand-offs where w takes them, else float32 rows (bf16 ones are then refused with status 7)
inline int run_linear_as(const PsLinear* w, const void* x, bool x_bf16, int64_t ldx, int rows, void* y, bool y_bf16,
                         int64_t ldy, int threads) {
  if (w->run_bf16 == nullptr) {
    if (x_bf16 || y_bf16) return 7;
    return run_linear(w, static_cast<const float*>(x), ldx, rows, static_cast<float*>(y), ldy, threads);
  }
  ps::TimerScope timer(ps::kLinear);
  return w->run_bf16(w->self, x, x_bf16, ldx, rows, y, y_bf16, ldy, threads);
}

// A linear layer called from Python (linear.py), through the same PsLinear the stack calls.
extern "C" int ps_call_linear(const PsLinear* w, const float* x, int64_t ldx, int rows, float* y, int64_t ldy,
                              int threads) {
  return run_linear(w, x, ldx, rows, y, ldy, threads);
}

// One weight held by two kernels, a call going to one by its row count: up to `rows` rows to `few`,
// more to `many` (linear.py's SplitLinear: the native float32 kernel for a decode step's and a short
// prompt's calls, oneDNN's inner product for long prefills, where it was timed faster). Both compute
// the same float32 product; only the order of the sums differs between them.
struct PsSplitLinear {
  PsLinear few;
  PsLinear many;
  int64_t rows;
};

// A PsLinearFn over a PsSplitLinear (float32 rows: neither side takes bf16 hand-offs)
extern "C" int ps_split_linear(const void* self, const float* x, int64_t ldx, int M, float* y, int64_t ldy,
                               int threads) {
  const PsSplitLinear* s = static_cast<const PsSplitLinear*>(self);
  const PsLinear& w = M <= s->rows ? s->few : s->many;
  return w.run(w.self, x, ldx, M, y, ldy, threads);
}

extern "C" int ps_add_rms_norm(float* x, int64_t ldx, const float* residual, int64_t ldr, const float* w, float eps,
                               void* out, int64_t ldo, int rows, int dim, int out_bf16, int threads);
extern "C" int ps_silu_mul(const void* gate_up, int64_t ld, void* out, int64_t ldo, int rows, int inter,
                           int in_bf16, int out_bf16, int threads);
extern "C" int ps_head_rms_norm(float* x, int64_t ld, int rows, int heads, int dim, const float* w, float eps,
                                int threads);
extern "C" int ps_rope(float* x, int64_t ld, int rows, int heads, int dim, const int64_t* positions,
                       const float* cos_table, const float* sin_table, int threads);

namespace ps {
bool timers_on = false;
int64_t timer_ns[kTimerKinds] = {0, 0, 0};
}  // namespace ps

// The kernel timers (timers.h): when totals is not null it receives the nanoseconds spent in each
// kind of kernel since the last call (linear, attention, element-wise); the totals start again from
// zero, and the timers stay on while `on` is not 0.
extern "C" void ps_timers(int on, int64_t* totals) {
  for (int k = 0; k < ps::kTimerKinds; ++k) {
    if (totals != nullptr) totals[k] = ps::timer_ns[k];
    ps::timer_ns[k] = 0;
  }
  ps::timers_on = on != 0;
}

extern "C" int64_t ps_prefill_scratch_floats(int hkv, int d_len, int c_len);
extern "C" int64_t ps_decode_scratch_floats(int n_seq, int hq, int d_len);

namespace {

int64_t round16(int64_t n) { return (n + 15) / 16 * 16; }  // floats: 64-byte multiples

// Slices of the caller's scratch (64-byte aligned), one after another.
struct Scratch {
  float* next;
  float* take(int64_t floats) {
    float* p = next;
    next += round16(floats);
    return p;
  }
};

// Before attention. x [rows][hidden] (ldx apart), the residual stream: x += pending (the previous
// layer's MLP output [rows][hidden], or null); h = RMSNorm(x) * norm_w; qkv [rows][n_qkv] = h Wqkv^T
// (+ bias; wqkv packed as cpu_linear.cpp's panels); with q_norm_w (Qwen3), each of the hq q heads
// and the hkv k heads normalized by its own RMSNorm (q_norm_w, k_norm_w, qk_eps); then the q and k
// heads rotated in place by position (cos/sin tables [positions][head_dim]). h: [rows][hidden] of
// scratch (bf16 bits where Wqkv takes them: the norm rounds as the linear would have). Returns 0 or
// the first failing kernel's status.
int layer_qkv(float* x, int64_t ldx, const float* pending, int rows, int hidden, const float* norm_w, float eps,
              const PsLinear* wqkv, int n_qkv, int hq, int hkv, int head_dim, const float* q_norm_w,
              const float* k_norm_w, float qk_eps, const int64_t* positions, const float* cos_table,
              const float* sin_table, float* qkv, float* h, int threads) {
  const bool h16 = wqkv->run_bf16 != nullptr;
  int code = ps_add_rms_norm(x, ldx, pending, hidden, norm_w, eps, h, hidden, rows, hidden, h16, threads);
  if (code == 0) code = run_linear_as(wqkv, h, h16, hidden, rows, qkv, false, n_qkv, threads);
  if (code == 0 && q_norm_w != nullptr) {
    code = ps_head_rms_norm(qkv, n_qkv, rows, hq, head_dim, q_norm_w, qk_eps, threads);
    if (code == 0)
      code = ps_head_rms_norm(qkv + (int64_t)hq * head_dim, n_qkv, rows, hkv, head_dim, k_norm_w, qk_eps, threads);
  }
  if (code == 0) code = ps_rope(qkv, n_qkv, rows, hq + hkv, head_dim, positions, cos_table, sin_table, threads);
  return code;
}

// After attention. attn [rows][attn_dim] (ld_attn apart): o = attn Wo^T; x += o; h = RMSNorm(x) *
// norm_w; [gate | up] = h Wgu^T (2 inter wide); out [rows][hidden] = (silu(gate) * up) Wdown^T, the
// MLP output the next layer's norm adds to x. o, h: [rows][hidden], gate_up: [rows][2 inter], act:
// [rows][inter] of scratch. Where the linears take bf16 hand-offs, h goes to Wgu, gate_up to the
// activation and act to Wdown as bf16 bits (rounded where the float32 path's linear would round
// them, so the bits are the same), half the bytes and no rounding or widening pass of their own.
// Returns 0 or the first failing kernel's status.
int layer_mlp(const float* attn, int64_t ld_attn, int rows, const PsLinear* wo, float* x, int64_t ldx, int hidden,
              const float* norm_w, float eps, const PsLinear* wgu, int inter, const PsLinear* wdown, float* out,
              float* o, float* h, float* gate_up, float* act, int threads) {
  const bool h16 = wgu->run_bf16 != nullptr, mid16 = h16 && wdown->run_bf16 != nullptr;
  int code = run_linear(wo, attn, ld_attn, rows, o, hidden, threads);
  if (code == 0) code = ps_add_rms_norm(x, ldx, o, hidden, norm_w, eps, h, hidden, rows, hidden, h16, threads);
  if (code == 0) code = run_linear_as(wgu, h, h16, hidden, rows, gate_up, mid16, 2 * inter, threads);
  if (code == 0) code = ps_silu_mul(gate_up, 2 * inter, act, inter, rows, inter, mid16, mid16, threads);
  if (code == 0) code = run_linear_as(wdown, act, mid16, inter, rows, out, false, hidden, threads);
  return code;
}

}  // namespace

extern "C" int ps_prefill_attention(const float* q, int64_t q_stride, float* out, int64_t out_stride, int m_len,
                                    int hq, int hkv, int d_len, float scale, const float* kt, const float* vt,
                                    int r_len, const float* kn, int64_t kn_stride, const float* vn, int64_t vn_stride,
                                    int kn_len, void* k_cache, void* v_cache, int num_blocks, int block_size,
                                    const int32_t* block_table, int table_len, int l_start, int l_len,
                                    const int64_t* slots, float* scratch, int kv_bf16, const void* t_handle,
                                    int64_t template_fn, int64_t causal_fn);
extern "C" int ps_decode_attention(const float* q, int64_t q_stride, float* out, int64_t out_stride, int n_seq,
                                   int hq, int hkv, int d_len, float scale, void* k_cache, void* v_cache,
                                   int block_size, const int32_t* block_tables, int64_t table_stride,
                                   const int32_t* context_lens, const int32_t* skip_blocks, const int64_t* kt_ptrs,
                                   const int64_t* vt_ptrs, const float* kn, int64_t kn_stride, const float* vn,
                                   int64_t vn_stride, const int64_t* slots, int num_blocks, float* scratch,
                                   int kv_bf16, const int64_t* th_ptrs, int64_t template_fn);

// The scratch floats ps_decoder_stack needs for a step of `rows` rows, n_dec of them decodes, whose
// largest prefill attends over `max_keys` keys after its packed template (its cached context after
// it, and its new tokens). The attention calls take their scratch one after another, from one region.
extern "C" int64_t ps_stack_scratch_floats(int rows, int hidden, int hq, int hkv, int head_dim, int inter,
                                           int n_dec, int max_keys) {
  const int64_t q_size = (int64_t)hq * head_dim, n_qkv = q_size + 2 * (int64_t)hkv * head_dim;
  const int64_t prefill = max_keys > 0 ? ps_prefill_scratch_floats(hkv, head_dim, max_keys) : 0;
  const int64_t decode = n_dec > 0 ? ps_decode_scratch_floats(n_dec, hq, head_dim) : 0;
  return round16(rows * n_qkv) + round16(rows * q_size) + 2 * round16((int64_t)rows * hidden) +
         round16((int64_t)rows * 2 * inter) + round16((int64_t)rows * inter) + (prefill > decode ? prefill : decode);
}

// A whole decoder stack over one step, each layer the kernels' calls in order (layer_qkv, then
// attention, then layer_mlp).
//
// x [rows][hidden] (dense): the residual stream, updated in place; pending [rows][hidden] receives the
// last layer's MLP output (the final norm adds it to x). Per layer l: weights[l] = {input norm w, q/k/v
// PsLinear (its bias, if any, inside), post-attention norm w, o PsLinear, gate|up PsLinear, down PsLinear,
// q norm w or 0, k norm w or 0}, eps[l] = {input norm eps, post-attention norm eps, q/k norm eps},
// caches[l] = {k_cache, v_cache} [num_blocks][block_size][hkv][head_dim], float32, or bf16 when kv_bf16.
// The step's rows: first n_dec decodes (one token each: dec_tables [n_dec] rows dec_stride apart,
// dec_ctx the new token included, dec_skip the blocks each reads from its packed template, or null
// when none has one), then n_pre prefills (pre_info [n_pre][3] = {new tokens, cached context
// tokens, of those the leading ones in a packed template}, their block tables pre_tables [n_pre]
// rows pre_stride apart, pre_width wide). templates: null, or [n_dec + n_pre][layers][3] = the
// packed template's K panels and V rows of each sequence's layer (0: none), and its handle for
// template_fn (0: none; a row's template part then runs there, see ps_decode_attention and
// ps_prefill_attention, and the first two only name the template; 0 template_fn: the native
// kernels throughout). causal_fn (0: none): a prefill with nothing before it in the cache runs its
// own keys' attention there (see ps_prefill_attention). slots: each row's cache
// slot. scratch: ps_stack_scratch_floats(...) floats, 64-byte aligned, for every intermediate (kept by
// the caller from step to step, so a step allocates no activation memory). Returns 0 or the first
// failing kernel's status (native.py's STATUS names them).
extern "C" int ps_decoder_stack(float* x, int rows, int hidden, int layers, const int64_t* weights, const float* eps,
                                const int64_t* caches, int num_blocks, int block_size, int hq, int hkv, int head_dim,
                                int inter, float scale, const int64_t* positions, const float* cos_table,
                                const float* sin_table, const int64_t* slots, int n_dec, const int32_t* dec_tables,
                                int64_t dec_stride, const int32_t* dec_ctx, const int32_t* dec_skip, int n_pre,
                                const int32_t* pre_info, const int32_t* pre_tables, int64_t pre_stride,
                                int pre_width, const int64_t* templates, float* pending, float* scratch, int threads,
                                int kv_bf16, int64_t template_fn, int64_t causal_fn) {
  const int q_size = hq * head_dim, kv_size = hkv * head_dim, n_qkv = q_size + 2 * kv_size;
  Scratch take{scratch};
  float* qkv = take.take((int64_t)rows * n_qkv);
  float* attn = take.take((int64_t)rows * q_size);
  float* h = take.take((int64_t)rows * hidden);
  float* o = take.take((int64_t)rows * hidden);
  float* gate_up = take.take((int64_t)rows * 2 * inter);
  float* act = take.take((int64_t)rows * inter);
  float* keys = take.next;  // the attention calls': decode states, a prefill's segment B K panels and V rows
  int64_t* kt = nullptr;  // the decodes' template pointers of one layer: K panels, V rows, handles
  if (n_dec > 0 && dec_skip != nullptr) {
    kt = static_cast<int64_t*>(std::malloc(sizeof(int64_t) * 3 * (size_t)n_dec));
    if (kt == nullptr) return 3;
  }
  int code = 0;
  for (int l = 0; l < layers && code == 0; ++l) {
    const int64_t* w = weights + 8 * (int64_t)l;
    void* k_cache = reinterpret_cast<void*>(caches[2 * l]);
    void* v_cache = reinterpret_cast<void*>(caches[2 * l + 1]);
    const auto f = [](int64_t p) { return reinterpret_cast<const float*>(p); };
    const auto lin = [](int64_t p) { return reinterpret_cast<const PsLinear*>(p); };
    code = layer_qkv(x, hidden, l == 0 ? nullptr : pending, rows, hidden, f(w[0]), eps[3 * l], lin(w[1]), n_qkv,
                     hq, hkv, head_dim, f(w[6]), f(w[7]), eps[3 * l + 2], positions, cos_table, sin_table, qkv, h,
                     threads);
    if (code == 0 && kv_bf16)  // the new K and V as the cache will hold them
      for (int r = 0; r < rows; ++r) ps::round_to_bf16(qkv + (int64_t)r * n_qkv + q_size, 2 * kv_size);
    if (code == 0 && n_dec > 0) {
      if (kt != nullptr)
        for (int n = 0; n < n_dec; ++n)
          for (int j = 0; j < 3; ++j) kt[j * n_dec + n] = templates[((int64_t)n * layers + l) * 3 + j];
      code = ps_decode_attention(qkv, n_qkv, attn, q_size, n_dec, hq, hkv, head_dim, scale, k_cache, v_cache,
                                 block_size, dec_tables, dec_stride, dec_ctx, dec_skip, kt,
                                 kt != nullptr ? kt + n_dec : nullptr, qkv + q_size, n_qkv,
                                 qkv + q_size + kv_size, n_qkv, slots, num_blocks, keys, kv_bf16,
                                 kt != nullptr ? kt + 2 * n_dec : nullptr, template_fn);
    }
    int64_t start = n_dec;
    for (int i = 0; i < n_pre && code == 0; ++i) {
      const int q_len = pre_info[3 * i], ctx = pre_info[3 * i + 1], first = pre_info[3 * i + 2];
      const int64_t* t = templates != nullptr ? templates + ((int64_t)(n_dec + i) * layers + l) * 3 : nullptr;
      const float* row = qkv + start * n_qkv;
      const bool rest = ctx > first;  // context after the template, read through the block table
      code = ps_prefill_attention(row, n_qkv, attn + start * q_size, q_size, q_len, hq, hkv, head_dim, scale,
                                  t != nullptr && t[0] != 0 ? f(t[0]) : nullptr,
                                  t != nullptr && t[0] != 0 ? f(t[1]) : nullptr, first, row + q_size, n_qkv,
                                  row + q_size + kv_size, n_qkv, q_len, k_cache, v_cache, num_blocks, block_size,
                                  rest ? pre_tables + i * pre_stride : nullptr, rest ? pre_width : 0, first,
                                  ctx - first, slots + start, keys, kv_bf16,
                                  t != nullptr ? reinterpret_cast<const void*>(t[2]) : nullptr, template_fn,
                                  causal_fn);
      start += q_len;
    }
    if (code == 0)
      code = layer_mlp(attn, q_size, rows, lin(w[3]), x, hidden, hidden, f(w[2]), eps[3 * l + 1], lin(w[4]), inter,
                       lin(w[5]), pending, o, h, gate_up, act, threads);
  }
  std::free(kt);
  return code;
}

// Copy whole blocks in every layer (the copy-on-write of a template's partial last block): for each
// of n_pairs pairs {src, dst}, block dst of each cache = block src. caches: [layers][2] = {k, v},
// each [num_blocks][block_bytes]. Returns 4 (nothing copied) when a block id is outside the cache.
extern "C" int ps_copy_blocks(const int64_t* caches, int layers, int num_blocks, int64_t block_bytes,
                              const int64_t* pairs, int n_pairs) {
  for (int p = 0; p < 2 * n_pairs; ++p)
    if (pairs[p] < 0 || pairs[p] >= num_blocks) return 4;
  for (int l = 0; l < 2 * layers; ++l) {
    char* cache = reinterpret_cast<char*>(caches[l]);
    for (int p = 0; p < n_pairs; ++p)
      std::memcpy(cache + pairs[2 * p + 1] * block_bytes, cache + pairs[2 * p] * block_bytes, (size_t)block_bytes);
  }
  return 0;
}
