// Device code of cuda_ops (included by kv_ops.cu): dtype-agnostic row and block copy kernels.
// Rows of `H * D * element_size` bytes are moved as `Vec` words (uint4, uint2, uint32_t or
// uint16_t, picked by the host so that every address and stride is aligned to it).
#pragma once

#include <cstdint>

namespace prefix_service_ops {

constexpr int kScanThreads = 1024;  // one block computes cu_seqlens_k

// ---------------------------------------------------------------------------------------------
// Device helpers

// Copies one K row and one V row (n vectors each); lanes of a group stride over the vectors.
template <typename Vec>
__device__ __forceinline__ void copy_kv_row(Vec* __restrict__ k_dst, Vec* __restrict__ v_dst,
                                            const Vec* __restrict__ k_src,
                                            const Vec* __restrict__ v_src, int64_t n, int lane,
                                            int group) {
#pragma unroll 4
  for (int64_t i = lane; i < n; i += group) {
    const Vec a = k_src[i];
    const Vec b = v_src[i];
    k_dst[i] = a;
    v_dst[i] = b;
  }
}

template <typename Vec>
__device__ __forceinline__ void zero_kv_row(Vec* __restrict__ k_dst, Vec* __restrict__ v_dst,
                                            int64_t n, int lane, int group) {
  const Vec z{};
  for (int64_t i = lane; i < n; i += group) {
    k_dst[i] = z;
    v_dst[i] = z;
  }
}

__device__ __forceinline__ int inclusive_warp_scan(int x, int lane) {
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, offset);
    if (lane >= offset) x += y;
  }
  return x;
}

// ---------------------------------------------------------------------------------------------
// Kernels

// cu_seqlens_k[0] = 0, cu_seqlens_k[i + 1] = cu_seqlens_k[i] + q_len[i] + prefix_lens[i].
// One block of kScanThreads threads scans the sequences in chunks of kScanThreads.
__global__ void cu_seqlens_k_kernel(const int* __restrict__ cu_seqlens_q,  // [num_seqs + 1]
                                    const int* __restrict__ prefix_lens,   // [num_seqs]
                                    int num_seqs,
                                    int* __restrict__ cu_seqlens_k) {  // [num_seqs + 1]
  __shared__ int warp_totals[kScanThreads / 32];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  int carry = 0;  // total of the previous chunks, the same in every thread
  if (threadIdx.x == 0) cu_seqlens_k[0] = 0;
  for (int base = 0; base < num_seqs; base += kScanThreads) {
    const int i = base + threadIdx.x;
    int x = i < num_seqs ? cu_seqlens_q[i + 1] - cu_seqlens_q[i] + prefix_lens[i] : 0;
    x = inclusive_warp_scan(x, lane);
    if (lane == 31) warp_totals[warp] = x;
    __syncthreads();
    if (warp == 0) warp_totals[lane] = inclusive_warp_scan(warp_totals[lane], lane);
    __syncthreads();
    const int before = warp == 0 ? 0 : warp_totals[warp - 1];
    if (i < num_seqs) cu_seqlens_k[i + 1] = carry + before + x;
    carry += warp_totals[kScanThreads / 32 - 1];
    __syncthreads();  // warp_totals is rewritten by the next chunk
  }
}

// Output row r belongs to sequence s (largest s with cu_seqlens_k[s] <= r), token t = r -
// cu_seqlens_k[s]:  t < prefix_lens[s] -> cache slot block_tables[s][t / bs] * bs + t % bs,
// else new row cu_seqlens_q[s] + t - prefix_lens[s]. Rows past cu_seqlens_k[num_seqs] (a
// total_k larger than the real one) and rows with an invalid source are written as zeros.
template <typename Vec>
__global__ void concat_kv_kernel(
    const Vec* __restrict__ k_cache,      // [num_blocks * block_size, row_vecs]
    const Vec* __restrict__ v_cache,      // [num_blocks * block_size, row_vecs]
    const int* __restrict__ block_tables,  // [num_seqs, max_blocks]
    const int* __restrict__ prefix_lens,  // [num_seqs]
    const int* __restrict__ cu_seqlens_q,  // [num_seqs + 1]
    const int* __restrict__ cu_seqlens_k,  // [num_seqs + 1]
    const Vec* __restrict__ k_new,        // [num_new, k_new_stride]
    const Vec* __restrict__ v_new,        // [num_new, v_new_stride]
    Vec* __restrict__ k_out,              // [total_k, row_vecs]
    Vec* __restrict__ v_out,              // [total_k, row_vecs]
    int num_seqs, int max_blocks, int block_size, int64_t num_blocks, int64_t num_new,
    int64_t k_new_stride, int64_t v_new_stride, int64_t total_k, int64_t row_vecs, int group) {
  const int lane = threadIdx.x & (group - 1);
  const int64_t rows_per_block = blockDim.x / group;
  const int64_t row_step = gridDim.x * rows_per_block;
  const int64_t end = cu_seqlens_k[num_seqs];
  for (int64_t row = blockIdx.x * rows_per_block + threadIdx.x / group; row < total_k;
       row += row_step) {
    const Vec* k_src = nullptr;
    const Vec* v_src = nullptr;
    if (row < end) {
      int lo = 0, hi = num_seqs - 1;  // binary search; empty sequences repeat an offset
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (cu_seqlens_k[mid] <= row) lo = mid; else hi = mid - 1;
      }
      const int64_t t = row - cu_seqlens_k[lo];
      const int64_t p = prefix_lens[lo];
      if (t < p) {
        const int64_t b = t / block_size;
        const int64_t block = b < max_blocks ? block_tables[int64_t(lo) * max_blocks + b] : -1;
        if (block >= 0 && block < num_blocks) {
          const int64_t slot = block * block_size + t % block_size;
          k_src = k_cache + slot * row_vecs;
          v_src = v_cache + slot * row_vecs;
        }
      } else {
        const int64_t q = cu_seqlens_q[lo] + (t - p);
        if (q >= 0 && q < num_new) {
          k_src = k_new + q * k_new_stride;
          v_src = v_new + q * v_new_stride;
        }
      }
    }
    Vec* k_dst = k_out + row * row_vecs;
    Vec* v_dst = v_out + row * row_vecs;
    if (k_src != nullptr) copy_kv_row(k_dst, v_dst, k_src, v_src, row_vecs, lane, group);
    else zero_kv_row(k_dst, v_dst, row_vecs, lane, group);
  }
}

// Token t's K/V row goes to cache slot slot_mapping[t]; slots outside [0, num_slots) skipped.
template <typename Vec, typename Idx>
__global__ void store_kv_kernel(const Vec* __restrict__ k,  // [num_tokens, k_stride]
                                const Vec* __restrict__ v,  // [num_tokens, v_stride]
                                Vec* __restrict__ k_cache,  // [num_slots, row_vecs]
                                Vec* __restrict__ v_cache,  // [num_slots, row_vecs]
                                const Idx* __restrict__ slot_mapping,  // [num_tokens]
                                int64_t num_tokens, int64_t num_slots, int64_t k_stride,
                                int64_t v_stride, int64_t row_vecs, int group) {
  const int lane = threadIdx.x & (group - 1);
  const int64_t rows_per_block = blockDim.x / group;
  const int64_t row_step = gridDim.x * rows_per_block;
  for (int64_t t = blockIdx.x * rows_per_block + threadIdx.x / group; t < num_tokens;
       t += row_step) {
    const int64_t slot = slot_mapping[t];
    if (slot < 0 || slot >= num_slots) continue;
    copy_kv_row(k_cache + slot * row_vecs, v_cache + slot * row_vecs, k + t * k_stride,
                v + t * v_stride, row_vecs, lane, group);
  }
}

// blockIdx.x picks a cache (layer K or V), blockIdx.y strides over the (src, dst) pairs; the
// whole block copies one cache block. Pairs with an id outside [0, num_blocks) are skipped.
template <typename Vec>
__global__ void copy_blocks_kernel(const int64_t* __restrict__ cache_ptrs,  // [num_caches]
                                   const int64_t* __restrict__ src_dst,     // [num_pairs, 2]
                                   int64_t num_pairs, int64_t num_blocks, int64_t block_vecs) {
  Vec* cache = reinterpret_cast<Vec*>(cache_ptrs[blockIdx.x]);
  for (int64_t p = blockIdx.y; p < num_pairs; p += gridDim.y) {
    const int64_t src = src_dst[2 * p];
    const int64_t dst = src_dst[2 * p + 1];
    if (src < 0 || src >= num_blocks || dst < 0 || dst >= num_blocks) continue;
    const Vec* s = cache + src * block_vecs;
    Vec* d = cache + dst * block_vecs;
#pragma unroll 4
    for (int64_t i = threadIdx.x; i < block_vecs; i += blockDim.x) d[i] = s[i];
  }
}

}  // namespace prefix_service_ops
