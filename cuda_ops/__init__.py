"""The cuda backend's GPU ops: KV-cache copy kernels (CUDA C++, below), the Triton paged decode
(paged_decode.py) and a layer's fused element-wise kernels (fused.py), each with its torch reference;
timing.py times them for the op benchmarks.

KV-cache copy ops: torch references and (on CUDA) compiled kernels behind checked wrappers.

`concat_kvcache_with_prefix` gathers, per prefill sequence, its cached context (a pinned prefix
and/or earlier prefill chunks) from the paged cache and appends its new K/V, producing the
contiguous varlen K/V a FlashAttention varlen kernel reads. `store_kvcache` writes new K/V into
the paged cache by slot mapping. `copy_blocks` copies whole cache blocks (copy-on-write of a
partial prefix tail). `cuda_ops_available()` says whether the kernels can run here (CUDA torch
and a GPU); `load_cuda_ops()` compiles them on first use.
"""
from cuda_ops.build import cuda_ops_available, load_cuda_ops, references_reason, use_references
from cuda_ops.reference import (
    concat_kvcache_with_prefix_ref,
    copy_blocks_ref,
    store_kvcache_ref,
)
from cuda_ops.ops import concat_kvcache_with_prefix, copy_blocks, store_kvcache

__all__ = [
    "concat_kvcache_with_prefix",
    "concat_kvcache_with_prefix_ref",
    "copy_blocks",
    "copy_blocks_ref",
    "cuda_ops_available",
    "load_cuda_ops",
    "references_reason",
    "store_kvcache",
    "store_kvcache_ref",
    "use_references",
]
