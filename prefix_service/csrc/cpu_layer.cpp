// A decoder layer's work before and after attention, each one call: the kernels of cpu_linear.cpp
// and cpu_elementwise.cpp run in sequence, in the order and with the arguments the layer would pass
// them one by one, so the results are the same bit for bit. A kernel call from Python costs its argument
// checks, an allocation and a ctypes call, a few microseconds each; over the nine calls of a layer
// that was most of a short prefill's time outside the kernels. Built into the native library by
// prefix_service/native.py.
#include <cstdint>
#include <cstdlib>

extern "C" int ps_linear(const float* x, int64_t ldx, int M, int K, const float* wp, int N, const float* bias,
                         float* y, int64_t ldy, int threads);
extern "C" int ps_add_rms_norm(float* x, int64_t ldx, const float* residual, int64_t ldr, const float* w, float eps,
                               float* out, int64_t ldo, int rows, int dim, int threads);
extern "C" int ps_silu_mul(const float* gate_up, int64_t ld, float* out, int64_t ldo, int rows, int inter,
                           int threads);
extern "C" int ps_rope(float* x, int64_t ld, int rows, int heads, int dim, const int64_t* positions,
                       const float* cos_table, const float* sin_table, int threads);

namespace {

// rows x cols floats, freed at the end of the scope; p is null when out of memory.
struct Buffer {
  float* p;
  Buffer(int rows, int cols) : p(static_cast<float*>(std::malloc(sizeof(float) * (size_t)rows * (size_t)cols + 64))) {}
  ~Buffer() { std::free(p); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
};

}  // namespace

// Before attention. x [rows][hidden] (ldx apart), the residual stream: x += pending (the previous
// layer's MLP output [rows][hidden], or null); h = RMSNorm(x) * norm_w; qkv [rows][n_qkv] = h Wqkv^T
// (+ bias; wqkv packed as cpu_linear.cpp's panels); then the first rot_heads heads of head_dim
// floats of each qkv row (the q and k heads) rotated in place by position (cos/sin tables
// [positions][head_dim]). Returns 0, the first failing kernel's status, or 3 when out of memory.
extern "C" int ps_layer_qkv(float* x, int64_t ldx, const float* pending, int rows, int hidden, const float* norm_w,
                            float eps, const float* wqkv, int n_qkv, const float* bias, int rot_heads, int head_dim,
                            const int64_t* positions, const float* cos_table, const float* sin_table, float* qkv,
                            int threads) {
  Buffer h(rows, hidden);
  if (h.p == nullptr) return 3;
  int code = ps_add_rms_norm(x, ldx, pending, hidden, norm_w, eps, h.p, hidden, rows, hidden, threads);
  if (code == 0) code = ps_linear(h.p, hidden, rows, hidden, wqkv, n_qkv, bias, qkv, n_qkv, threads);
  if (code == 0) code = ps_rope(qkv, n_qkv, rows, rot_heads, head_dim, positions, cos_table, sin_table, threads);
  return code;
}

// After attention. attn [rows][attn_dim] (ld_attn apart): o = attn Wo^T; x += o; h = RMSNorm(x) *
// norm_w; [gate | up] = h Wgu^T (2 inter wide); out [rows][hidden] = (silu(gate) * up) Wdown^T, the
// MLP output the next layer's norm adds to x. Returns 0, the first failing kernel's status, or 3.
extern "C" int ps_layer_mlp(const float* attn, int64_t ld_attn, int rows, int attn_dim, const float* wo, float* x,
                            int64_t ldx, int hidden, const float* norm_w, float eps, const float* wgu, int inter,
                            const float* wdown, float* out, int threads) {
  // each intermediate its own allocation, of the size the kernel-by-kernel path allocates (so the
  // same ones come from the heap, not fresh mappings: hostmem.py)
  Buffer o(rows, hidden), h(rows, hidden), gate_up(rows, 2 * inter), act(rows, inter);
  if (!(o.p && h.p && gate_up.p && act.p)) return 3;
  int code = ps_linear(attn, ld_attn, rows, attn_dim, wo, hidden, nullptr, o.p, hidden, threads);
  if (code == 0) code = ps_add_rms_norm(x, ldx, o.p, hidden, norm_w, eps, h.p, hidden, rows, hidden, threads);
  if (code == 0) code = ps_linear(h.p, hidden, rows, hidden, wgu, 2 * inter, nullptr, gate_up.p, 2 * inter, threads);
  if (code == 0) code = ps_silu_mul(gate_up.p, 2 * inter, act.p, inter, rows, inter, threads);
  if (code == 0) code = ps_linear(act.p, inter, rows, inter, wdown, hidden, nullptr, out, hidden, threads);
  return code;
}
