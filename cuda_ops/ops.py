"""Checked entry points of cuda_ops: validate arguments, then run the CUDA kernel or the reference.

Validation reads only tensor metadata (no device syncs) and raises TypeError (wrong type or
dtype) or ValueError (shape, device, layout), naming the argument, what was expected and what
was given. Dispatch: CUDA tensors with the kernels available (`cuda_ops_available()`) run the
compiled kernels (compiled on first use, see build.py); everything else runs the torch
references in reference.py. The checks are the same on both paths, so code tested on the CPU
passes the same checks on a GPU, except the kernel-only limit on head_dim (multiple of 8, at
most 256).

Layout contract: caches are contiguous `[num_blocks, block_size, num_kv_heads, head_dim]`; new
K/V rows `[num_tokens, num_kv_heads, head_dim]` need dense `[H, D]` rows but may have any row
stride (e.g. slices of a fused QKV projection output). Index tensors may be int32 or int64.
"""
from __future__ import annotations

from typing import NoReturn, Sequence

import torch

from cuda_ops import build
from cuda_ops.reference import (
    concat_kvcache_with_prefix_ref,
    copy_blocks_ref,
    store_kvcache_ref,
)

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
MAX_KERNEL_HEAD_DIM = 256


def _kernels(device: torch.device):
    """The compiled op namespace for tensors on `device`, or None to use the references.
    Raises RuntimeError if the kernels should be used but fail to build."""
    if device.type != "cuda" or not build.cuda_ops_available():
        return None
    return build.load_cuda_ops()


# ------------------------------------------------------------------------------ validation


def _fail(exc: type[Exception], name: str, expected: str, got) -> NoReturn:
    """Raise `exc("<name>: expected <expected>, got <got>")`."""
    raise exc(f"{name}: expected {expected}, got {got}")


def _check_tensor(name: str, x, ndim: int) -> None:
    if not isinstance(x, torch.Tensor):
        _fail(TypeError, name, "a torch.Tensor", type(x).__name__)
    if x.dim() != ndim:
        _fail(ValueError, name, f"a {ndim}-d tensor", f"shape {tuple(x.shape)}")


def _check_device(name: str, x: torch.Tensor, device: torch.device) -> None:
    if x.device != device:
        _fail(ValueError, name, f"device {device} (the cache's)", x.device)


def _check_caches(names: tuple[str, str], k_cache, v_cache) -> None:
    """Both `[num_blocks, block_size, H, D]`, contiguous, same shape/dtype/device."""
    for name, cache in zip(names, (k_cache, v_cache)):
        _check_tensor(name, cache, 4)
        if cache.dtype not in FLOAT_DTYPES:
            _fail(TypeError, name, "dtype float32, float16 or bfloat16", cache.dtype)
        if not cache.is_contiguous():
            _fail(ValueError, name, "a contiguous tensor", f"strides {cache.stride()}")
    k_name, v_name = names
    if v_cache.shape != k_cache.shape:
        _fail(ValueError, v_name, f"shape {tuple(k_cache.shape)} ({k_name}'s)", tuple(v_cache.shape))
    if v_cache.dtype != k_cache.dtype:
        _fail(TypeError, v_name, f"dtype {k_cache.dtype} ({k_name}'s)", v_cache.dtype)
    _check_device(v_name, v_cache, k_cache.device)


def _check_rows(name: str, x, cache: torch.Tensor, num_rows: int | None = None) -> None:
    """`[T, H, D]` matching the cache's H, D, dtype and device, with dense `[H, D]` rows."""
    _check_tensor(name, x, 3)
    rows, h, d = x.shape
    if h != cache.shape[2] or d != cache.shape[3]:
        expected = f"[num_tokens, {cache.shape[2]}, {cache.shape[3]}] (the cache's H, D)"
        _fail(ValueError, name, expected, tuple(x.shape))
    if num_rows is not None and rows != num_rows:
        _fail(ValueError, name, f"{num_rows} rows (as many as the K tensor)", rows)
    if x.dtype != cache.dtype:
        _fail(TypeError, name, f"dtype {cache.dtype} (the cache dtype)", x.dtype)
    _check_device(name, x, cache.device)
    _, s1, s2 = x.stride()
    if not ((d == 1 or s2 == 1) and (h == 1 or s1 == d)):
        _fail(ValueError, name, f"contiguous [H, D] rows (strides (*, {d}, 1))", f"strides {x.stride()}")


def _check_index(name: str, x, ndim: int, device: torch.device | None) -> None:
    _check_tensor(name, x, ndim)
    if x.dtype not in INDEX_DTYPES:
        _fail(TypeError, name, "dtype int32 or int64", x.dtype)
    if device is not None:
        _check_device(name, x, device)


def _check_kernel_head_dim(cache: torch.Tensor) -> None:
    """Kernel-only limit; the references handle any head_dim."""
    head_dim = cache.shape[3]
    if head_dim % 8 != 0 or head_dim > MAX_KERNEL_HEAD_DIM:
        expected = f"a multiple of 8 of at most {MAX_KERNEL_HEAD_DIM} for the CUDA kernels"
        _fail(ValueError, "head_dim", expected, f"{head_dim} (cache shape {tuple(cache.shape)})")


def _as_int32(x: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.int32 and x.is_contiguous():
        return x
    return x.to(torch.int32).contiguous()


# ------------------------------------------------------------------------------ entry points


def concat_kvcache_with_prefix(
    k_cache: torch.Tensor,  # [num_blocks, block_size, H, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, H, D]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32/int64, -1 padded
    prefix_lens: torch.Tensor,  # [num_seqs] int32/int64, cached tokens per sequence
    k_new: torch.Tensor,  # [total_q, H, D]
    v_new: torch.Tensor,  # [total_q, H, D]
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32/int64
    *,
    total_k: int | None = None,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per sequence: its `prefix_lens[i]` cached rows, then its new rows, into contiguous
    `[total_k, H, D]` K and V; returns (k_out, v_out, cu_seqlens_k [num_seqs + 1] int32).

    `total_k` (= sum(prefix_lens) + total_q) avoids the one host sync the CUDA path otherwise
    needs to size the output. It must be exact: the CPU path checks it; the CUDA path trusts it
    (extra rows come back zero, missing rows are cut off). check=False skips the argument checks
    (about 20 us of Python): for a caller that checked the same shapes already, e.g. every layer of
    a step after the first."""
    device = k_cache.device
    if check:
        _check_caches(("k_cache", "v_cache"), k_cache, v_cache)
        _check_index("prefix_lens", prefix_lens, 1, device)
        num_seqs = prefix_lens.shape[0]
        _check_index("block_tables", block_tables, 2, device)
        if block_tables.shape[0] != num_seqs:
            _fail(ValueError, "block_tables", f"{num_seqs} rows (one per sequence)", block_tables.shape[0])
        _check_index("cu_seqlens_q", cu_seqlens_q, 1, device)
        if cu_seqlens_q.shape[0] != num_seqs + 1:
            _fail(ValueError, "cu_seqlens_q", f"length {num_seqs + 1} (num_seqs + 1)", cu_seqlens_q.shape[0])
        _check_rows("k_new", k_new, k_cache)
        _check_rows("v_new", v_new, k_cache, k_new.shape[0])
        if total_k is not None and (type(total_k) is not int or total_k < 0):
            _fail(TypeError, "total_k", "None or an int >= 0", repr(total_k))

    ops = _kernels(device)
    if ops is None:
        k_out, v_out, cu_seqlens_k = concat_kvcache_with_prefix_ref(
            k_cache, v_cache, block_tables, prefix_lens, k_new, v_new, cu_seqlens_q
        )
        if total_k is not None and total_k != k_out.shape[0]:
            _fail(ValueError, "total_k", f"{k_out.shape[0]} (sum(prefix_lens) + total_q)", total_k)
        return k_out, v_out, cu_seqlens_k
    if check:
        _check_kernel_head_dim(k_cache)
    return ops.concat_kvcache_with_prefix(
        k_cache, v_cache, _as_int32(block_tables), _as_int32(prefix_lens), k_new, v_new,
        _as_int32(cu_seqlens_q), -1 if total_k is None else total_k,
    )


def store_kvcache(
    k: torch.Tensor,  # [num_tokens, H, D]
    v: torch.Tensor,  # [num_tokens, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, H, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, H, D]
    slot_mapping: torch.Tensor,  # [num_tokens] int32/int64 flat slot, -1 = skip
    *,
    check: bool = True,
) -> None:
    """k_cache.view(-1, H, D)[slot_mapping[t]] = k[t] (same for v), skipping slots of -1.
    Slots must be < num_blocks * block_size (the CUDA kernel skips larger ones, unchecked).
    check=False skips the argument checks, as for concat_kvcache_with_prefix."""
    if check:
        _check_caches(("k_cache", "v_cache"), k_cache, v_cache)
        _check_rows("k", k, k_cache)
        _check_rows("v", v, k_cache, k.shape[0])
        _check_index("slot_mapping", slot_mapping, 1, k_cache.device)
        if slot_mapping.shape[0] != k.shape[0]:
            _fail(ValueError, "slot_mapping", f"length {k.shape[0]} (one slot per token of k)",
                  slot_mapping.shape[0])
    ops = _kernels(k_cache.device)
    if ops is None:
        store_kvcache_ref(k, v, k_cache, v_cache, slot_mapping)
        return
    if check:
        _check_kernel_head_dim(k_cache)
    ops.store_kvcache(k, v, k_cache, v_cache, slot_mapping.contiguous())


def copy_blocks(
    k_caches: Sequence[torch.Tensor],  # per layer [num_blocks, block_size, H, D]
    v_caches: Sequence[torch.Tensor],  # per layer [num_blocks, block_size, H, D]
    src_dst: torch.Tensor,  # [num_pairs, 2] int32/int64: block src -> block dst, every layer
) -> None:
    """Copy whole blocks in every layer (copy-on-write of a partial prefix tail block).

    `src_dst` may live on the CPU (the scheduler's output) or on the caches' device. Destination
    blocks must be distinct from each other and from every source block."""
    if not isinstance(k_caches, (list, tuple)) or not isinstance(v_caches, (list, tuple)):
        got = f"{type(k_caches).__name__}, {type(v_caches).__name__}"
        _fail(TypeError, "k_caches, v_caches", "lists of tensors", got)
    if len(k_caches) != len(v_caches):
        _fail(ValueError, "v_caches", f"{len(k_caches)} layers (as many as k_caches)", len(v_caches))
    _check_index("src_dst", src_dst, 2, None)
    if src_dst.shape[1] != 2:
        _fail(ValueError, "src_dst", "shape [num_pairs, 2]", tuple(src_dst.shape))
    if not k_caches:
        return
    first = k_caches[0]
    _check_caches(("k_caches[0]", "v_caches[0]"), first, v_caches[0])
    for i in range(1, len(k_caches)):
        for name, cache in ((f"k_caches[{i}]", k_caches[i]), (f"v_caches[{i}]", v_caches[i])):
            _check_tensor(name, cache, 4)
            if cache.shape != first.shape or cache.dtype != first.dtype or not cache.is_contiguous():
                expected = f"a contiguous {first.dtype} tensor of shape {tuple(first.shape)} (like k_caches[0])"
                _fail(ValueError, name, expected, f"{cache.dtype} {tuple(cache.shape)} strides {cache.stride()}")
            _check_device(name, cache, first.device)
    if src_dst.device.type != "cpu" and src_dst.device != first.device:
        _fail(ValueError, "src_dst", f"the CPU or {first.device} (the caches' device)", src_dst.device)
    if src_dst.shape[0] == 0:
        return
    ops = _kernels(first.device)
    if ops is None:
        copy_blocks_ref(list(k_caches), list(v_caches), src_dst)
        return
    _check_kernel_head_dim(first)
    pairs = src_dst.to(torch.int64).contiguous()  # [P, 2]
    if pairs.device.type == "cpu" and first.is_cuda:  # pageable host->device copies wait
        pairs = pairs.pin_memory()
    ops.copy_blocks(list(k_caches), list(v_caches), pairs.to(first.device, non_blocking=True))
