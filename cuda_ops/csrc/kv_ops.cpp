// Registers the cuda_ops kernels as torch ops: torch.ops.prefix_service_ops.<name>.
// Only CUDA implementations exist; CPU tensors go to the torch references (cuda_ops/ops.py).
#include <torch/library.h>

#include "kv_ops.h"

TORCH_LIBRARY(prefix_service_ops, m) {
  // total_k < 0: computed on the device (one host sync); otherwise trusted as the exact total.
  m.def(
      "concat_kvcache_with_prefix(Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor prefix_lens, Tensor k_new, Tensor v_new, Tensor cu_seqlens_q, int total_k) "
      "-> (Tensor, Tensor, Tensor)");
  m.def(
      "store_kvcache(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slot_mapping) -> ()");
  m.def("copy_blocks(Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor src_dst) -> ()");
}

TORCH_LIBRARY_IMPL(prefix_service_ops, CUDA, m) {
  m.impl("concat_kvcache_with_prefix", &concat_kvcache_with_prefix_cuda);
  m.impl("store_kvcache", &store_kvcache_cuda);
  m.impl("copy_blocks", &copy_blocks_cuda);
}
