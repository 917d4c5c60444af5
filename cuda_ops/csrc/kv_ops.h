// Host entry points of the cuda_ops KV-cache kernels (kv_ops.cu), registered as torch ops in
// kv_ops.cpp under the namespace `prefix_service_ops`. The Python wrappers in cuda_ops/ops.py
// validate arguments first; these functions re-check only what keeps memory accesses in bounds.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <tuple>

// Gathers per sequence its cached prefix rows (through its block table) and then its new rows
// into contiguous [total_k, H, D] K and V, plus cu_seqlens_k [num_seqs + 1] int32.
// total_k < 0: read it from the device (one host sync); otherwise trusted.
std::tuple<at::Tensor, at::Tensor, at::Tensor> concat_kvcache_with_prefix_cuda(
    const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
    const at::Tensor& prefix_lens, const at::Tensor& k_new, const at::Tensor& v_new,
    const at::Tensor& cu_seqlens_q, int64_t total_k);

// k_cache.view(-1, H, D)[slot_mapping[t]] = k[t] (same for v); slots < 0 are skipped.
void store_kvcache_cuda(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, const at::Tensor& slot_mapping);

// For every pair (src, dst) in src_dst [num_pairs, 2] and every cache: cache[dst] = cache[src].
void copy_blocks_cuda(at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& src_dst);
