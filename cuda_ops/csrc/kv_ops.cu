// Host launchers of the cuda_ops kernels (device code in kv_kernels.cuh):
// concat_kvcache_with_prefix, store_kvcache, copy_blocks.
//
// All three only move bytes, so the kernels are dtype-agnostic: they copy rows of
// `H * D * element_size` bytes with the widest vector type (16, 8, 4 or 2 bytes) that divides
// every pointer, row size and row stride involved (16 for any normal allocation, since
// head_dim % 8 == 0). Results are bitwise equal to the torch references.
//
// Launch design:
//  - concat: (1) cu_seqlens_k_kernel, 1 block x 1024 threads, scans q_len + prefix_len;
//    (2) only if total_k is not given: one 4-byte device->host copy + stream sync;
//    (3) concat_kv_kernel: a "group" of G threads (G = min(32, pow2 >= row_vecs)) copies one
//    output row of K and of V; 256-thread blocks hold 256 / G groups; grid =
//    min(ceil(total_k / (256 / G)), 8 * num_SMs) blocks walking rows with a grid-stride loop;
//    each row finds its sequence by binary search in cu_seqlens_k.
//  - store: store_kv_kernel, the same group/grid layout over tokens.
//  - copy_blocks: copy_blocks_kernel, grid (2 * num_layers, min(num_pairs, 65535)) x 256
//    threads; block (c, p) copies pair p's whole block in cache c (cache addresses passed as a
//    device int64 tensor, staged through pinned memory without a sync).
// No kernel reads or writes out of bounds whatever the index values: bad block ids, slots or
// token offsets are skipped (store/copy) or produce zero rows (concat).
#include "kv_ops.h"
#include "kv_kernels.cuh"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>

namespace {

using namespace prefix_service_ops;

constexpr int kThreads = 256;    // threads per block of the row and block kernels
constexpr int kBlocksPerSm = 8;  // grid cap for the grid-stride row loops

// ---------------------------------------------------------------------------------------------
// Host helpers

// Largest power of two <= 16 dividing every value (addresses, byte sizes, byte strides).
int vec_width(std::initializer_list<int64_t> values) {
  int width = 16;
  for (const int64_t v : values) {
    while (width > 1 && v % width != 0) width >>= 1;
  }
  return width;
}

int64_t address(const at::Tensor& t) { return reinterpret_cast<int64_t>(t.data_ptr()); }

// Calls f(Vec{}) with the vector type of `width` bytes.
template <typename F>
void dispatch_vec(int width, F&& f) {
  switch (width) {
    case 16: f(uint4{}); break;
    case 8: f(uint2{}); break;
    case 4: f(uint32_t{}); break;
    case 2: f(uint16_t{}); break;
    default: f(uint8_t{}); break;
  }
}

// Threads that copy one row: a power of two, at most a warp.
int threads_per_row(int64_t row_vecs) {
  int g = 1;
  while (g < 32 && g < row_vecs) g <<= 1;
  return g;
}

int sm_count() {
  static int cached[256] = {0};  // per device index; a benign race writes the same value
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  if (device < 256 && cached[device] > 0) return cached[device];
  int count = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  if (device < 256) cached[device] = count;
  return count;
}

unsigned row_grid(int64_t rows, int group) {
  const int64_t rows_per_block = kThreads / group;
  const int64_t needed = (rows + rows_per_block - 1) / rows_per_block;
  const int64_t cap = int64_t(sm_count()) * kBlocksPerSm;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(needed, cap)));
}

void check_cache(const at::Tensor& cache, const at::Tensor& like, const char* name) {
  TORCH_CHECK(cache.is_cuda() && cache.dim() == 4 && cache.is_contiguous(), name,
              " must be a contiguous 4-d CUDA tensor");
  TORCH_CHECK(cache.device() == like.device() && cache.scalar_type() == like.scalar_type() &&
                  cache.sizes() == like.sizes(),
              name, " must match the first cache's device, dtype and shape");
}

// [T, H, D] with a dense [H, D] row (any row stride) matching the cache row.
void check_rows(const at::Tensor& x, const at::Tensor& cache, const char* name) {
  TORCH_CHECK(x.is_cuda() && x.device() == cache.device() && x.dim() == 3 &&
                  x.scalar_type() == cache.scalar_type() && x.size(1) == cache.size(2) &&
                  x.size(2) == cache.size(3),
              name, " must be [T, H, D] on the cache's device with the cache's dtype");
  TORCH_CHECK((x.size(2) == 1 || x.stride(2) == 1) && (x.size(1) == 1 || x.stride(1) == x.size(2)),
              name, " rows must be dense ([H, D] contiguous)");
}

void check_index(const at::Tensor& x, const at::Tensor& cache, at::ScalarType dtype,
                 const char* name) {
  TORCH_CHECK(x.device() == cache.device() && x.scalar_type() == dtype && x.is_contiguous(), name,
              " must be a contiguous ", dtype, " tensor on the cache's device");
}

}  // namespace

// -------------------------------------------------------------------------------------------------
// Entry points

std::tuple<at::Tensor, at::Tensor, at::Tensor> concat_kvcache_with_prefix_cuda(
    const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
    const at::Tensor& prefix_lens, const at::Tensor& k_new, const at::Tensor& v_new,
    const at::Tensor& cu_seqlens_q, int64_t total_k) {
  check_cache(k_cache, k_cache, "k_cache");
  check_cache(v_cache, k_cache, "v_cache");
  check_rows(k_new, k_cache, "k_new");
  check_rows(v_new, k_cache, "v_new");
  TORCH_CHECK(v_new.size(0) == k_new.size(0), "v_new must have as many rows as k_new");
  check_index(block_tables, k_cache, at::kInt, "block_tables");
  check_index(prefix_lens, k_cache, at::kInt, "prefix_lens");
  check_index(cu_seqlens_q, k_cache, at::kInt, "cu_seqlens_q");
  const int64_t num_seqs = prefix_lens.numel();
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_seqs,
              "block_tables must be [num_seqs, max_blocks]");
  TORCH_CHECK(cu_seqlens_q.numel() == num_seqs + 1, "cu_seqlens_q must be [num_seqs + 1]");

  const c10::cuda::CUDAGuard guard(k_cache.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor cu_seqlens_k = at::empty({num_seqs + 1}, cu_seqlens_q.options());  // [S + 1] int32
  cu_seqlens_k_kernel<<<1, kScanThreads, 0, stream>>>(
      cu_seqlens_q.data_ptr<int>(), prefix_lens.data_ptr<int>(), static_cast<int>(num_seqs),
      cu_seqlens_k.data_ptr<int>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (total_k < 0) {  // the output size must be known on the host: one sync
    int host_total = 0;
    C10_CUDA_CHECK(cudaMemcpyAsync(&host_total, cu_seqlens_k.data_ptr<int>() + num_seqs,
                                   sizeof(int), cudaMemcpyDeviceToHost, stream));
    C10_CUDA_CHECK(cudaStreamSynchronize(stream));
    total_k = host_total;
  }
  const int64_t heads = k_cache.size(2), head_dim = k_cache.size(3);
  at::Tensor k_out = at::empty({total_k, heads, head_dim}, k_new.options());  // [total_k, H, D]
  at::Tensor v_out = at::empty({total_k, heads, head_dim}, v_new.options());  // [total_k, H, D]
  if (total_k == 0) return {k_out, v_out, cu_seqlens_k};

  const int64_t esize = k_cache.element_size();
  const int64_t row_bytes = heads * head_dim * esize;
  const int64_t k_stride_bytes = k_new.stride(0) * esize;
  const int64_t v_stride_bytes = v_new.stride(0) * esize;
  const int width = vec_width({row_bytes, k_stride_bytes, v_stride_bytes, address(k_cache),
                               address(v_cache), address(k_new), address(v_new),
                               address(k_out), address(v_out)});
  const int64_t row_vecs = row_bytes / width;
  const int group = threads_per_row(row_vecs);
  dispatch_vec(width, [&](auto tag) {
    using Vec = decltype(tag);
    concat_kv_kernel<Vec><<<row_grid(total_k, group), kThreads, 0, stream>>>(
        static_cast<const Vec*>(k_cache.data_ptr()), static_cast<const Vec*>(v_cache.data_ptr()),
        block_tables.data_ptr<int>(), prefix_lens.data_ptr<int>(), cu_seqlens_q.data_ptr<int>(),
        cu_seqlens_k.data_ptr<int>(), static_cast<const Vec*>(k_new.data_ptr()),
        static_cast<const Vec*>(v_new.data_ptr()), static_cast<Vec*>(k_out.data_ptr()),
        static_cast<Vec*>(v_out.data_ptr()), static_cast<int>(num_seqs),
        static_cast<int>(block_tables.size(1)), static_cast<int>(k_cache.size(1)),
        k_cache.size(0), k_new.size(0), k_stride_bytes / width, v_stride_bytes / width, total_k,
        row_vecs, group);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {k_out, v_out, cu_seqlens_k};
}

void store_kvcache_cuda(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  check_cache(k_cache, k_cache, "k_cache");
  check_cache(v_cache, k_cache, "v_cache");
  check_rows(k, k_cache, "k");
  check_rows(v, k_cache, "v");
  const int64_t num_tokens = k.size(0);
  TORCH_CHECK(v.size(0) == num_tokens && slot_mapping.dim() == 1 &&
                  slot_mapping.numel() == num_tokens,
              "v and slot_mapping must have one row per token of k");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kInt || slot_mapping.scalar_type() == at::kLong,
              "slot_mapping must be int32 or int64");
  check_index(slot_mapping, k_cache, slot_mapping.scalar_type(), "slot_mapping");
  if (num_tokens == 0) return;

  const c10::cuda::CUDAGuard guard(k_cache.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t esize = k_cache.element_size();
  const int64_t row_bytes = k_cache.size(2) * k_cache.size(3) * esize;
  const int64_t k_stride_bytes = k.stride(0) * esize;
  const int64_t v_stride_bytes = v.stride(0) * esize;
  const int width = vec_width({row_bytes, k_stride_bytes, v_stride_bytes, address(k), address(v),
                               address(k_cache), address(v_cache)});
  const int64_t row_vecs = row_bytes / width;
  const int group = threads_per_row(row_vecs);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const bool wide_index = slot_mapping.scalar_type() == at::kLong;
  dispatch_vec(width, [&](auto tag) {
    using Vec = decltype(tag);
    const unsigned grid = row_grid(num_tokens, group);
    const Vec* k_ptr = static_cast<const Vec*>(k.data_ptr());
    const Vec* v_ptr = static_cast<const Vec*>(v.data_ptr());
    Vec* kc = static_cast<Vec*>(k_cache.data_ptr());
    Vec* vc = static_cast<Vec*>(v_cache.data_ptr());
    if (wide_index) {
      store_kv_kernel<Vec, int64_t><<<grid, kThreads, 0, stream>>>(
          k_ptr, v_ptr, kc, vc, slot_mapping.data_ptr<int64_t>(), num_tokens, num_slots,
          k_stride_bytes / width, v_stride_bytes / width, row_vecs, group);
    } else {
      store_kv_kernel<Vec, int32_t><<<grid, kThreads, 0, stream>>>(
          k_ptr, v_ptr, kc, vc, slot_mapping.data_ptr<int32_t>(), num_tokens, num_slots,
          k_stride_bytes / width, v_stride_bytes / width, row_vecs, group);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void copy_blocks_cuda(at::TensorList k_caches, at::TensorList v_caches,
                      const at::Tensor& src_dst) {
  TORCH_CHECK(k_caches.size() == v_caches.size(), "k_caches and v_caches must have equal length");
  TORCH_CHECK(src_dst.dim() == 2 && src_dst.size(1) == 2, "src_dst must be [num_pairs, 2]");
  const int64_t num_pairs = src_dst.size(0);
  if (k_caches.empty() || num_pairs == 0) return;
  const at::Tensor& first = k_caches[0];
  const c10::cuda::CUDAGuard guard(first.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  // Every cache's address, in pinned host memory, copied to the device without a sync.
  const int64_t num_caches = 2 * static_cast<int64_t>(k_caches.size());
  at::Tensor ptrs_host =
      at::empty({num_caches}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* ptrs = ptrs_host.data_ptr<int64_t>();
  const int64_t block_bytes = first.stride(0) * first.element_size();
  int width = vec_width({block_bytes});
  for (size_t i = 0; i < k_caches.size(); ++i) {
    check_cache(k_caches[i], first, "k_caches[i]");
    check_cache(v_caches[i], first, "v_caches[i]");
    ptrs[2 * i] = address(k_caches[i]);
    ptrs[2 * i + 1] = address(v_caches[i]);
    width = std::min(width, vec_width({ptrs[2 * i], ptrs[2 * i + 1]}));
  }
  const at::Tensor cache_ptrs =
      ptrs_host.to(first.device(), at::kLong, /*non_blocking=*/true);  // [2 * num_layers]
  const at::Tensor pairs =
      src_dst.to(first.device(), at::kLong, /*non_blocking=*/true).contiguous();  // [P, 2]
  const dim3 grid(static_cast<unsigned>(num_caches),
                  static_cast<unsigned>(std::min<int64_t>(num_pairs, 65535)));
  dispatch_vec(width, [&](auto tag) {
    using Vec = decltype(tag);
    copy_blocks_kernel<Vec><<<grid, kThreads, 0, stream>>>(
        cache_ptrs.data_ptr<int64_t>(), pairs.data_ptr<int64_t>(), num_pairs, first.size(0),
        block_bytes / width);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
