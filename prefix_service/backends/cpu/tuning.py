"""Choosing the template attention by timing it on the machine itself (onednn.template_attention()
"measure", the default where the CPU has AMX tiles).

A bfloat16 model's rows may attend over a pinned template in two ways: the native kernels' float32
FMAs over a float32 copy, or bf16 matrix products (OneDnnTemplate) on one of the kernels the CPU
has for them (AMX tiles, AVX512-BF16 dot products). Which is fastest depends on the CPU's matrix
units and on its thread count, so where no figure settles it the decoder stack times each once,
when it is built, on the model's own layers:

1. a synthetic template is written into free blocks of the (still empty) KV cache and packed each way;
2. each kernel's results are checked against float64 on the first layer's heads (`disagreement`: a
   kernel whose operands are laid out wrong for this CPU must not win on speed);
3. in rounds that alternate the order, a `PREFILL_TOKENS`-token prompt continuing the template and a
   decode step of `DECODE_SEQUENCES` sequences on it run as the engine runs them, and are timed.

The fastest matrix products on the sum of both are kept when they are faster than the native kernels
on each and by at least `MARGIN` on the sum; anything else (slower, too close to call, a failure or a
wrong result in the products, a cache too small for the test) keeps the native kernels, and says why.
The blocks used are zeroed again afterwards, so the cache is handed to the engine as allocated.
"""
from __future__ import annotations

import logging
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from prefix_service.backends.cpu import onednn
from prefix_service.backends.cpu.native import NativeKernelError
from prefix_service.backends.cpu.packed_template import PackedTemplate

if TYPE_CHECKING:
    from prefix_service.backends.cpu.stack import DecoderStack, StackPlan

log = logging.getLogger("prefix_service.engine")

TEMPLATE_TOKENS = 1024  # the synthetic template's length, at most (less where the cache is small)
MIN_TEMPLATE_TOKENS = 128  # below this the test says little: the native kernels are kept untimed
PREFILL_TOKENS = 100
DECODE_SEQUENCES = 16
ROUNDS = 3  # timed rounds of each way, after one untimed
MARGIN = 0.05  # how much faster, on the sum of both, the matrix products must be to be chosen


@dataclass(frozen=True)
class TemplateTiming:
    """What timing the template attention found: milliseconds a forward (median of the timed
    rounds) for each way ("native", and each kernel of the matrix products, TEMPLATE_KERNELS' names)
    and each case ("prefill", "decode"); the way chosen ("native" or "matrix"), with `kernel`, the
    matrix products' kernel chosen, and `products`, the cap (onednn.template_products()'s kind of
    number) that packs templates for it (both None for "native"); and why. `ms` is empty where
    nothing was timed (`why` says what stopped it)."""
    choice: str
    why: str
    kernel: str | None = None
    products: int | None = None
    template_tokens: int = 0
    ms: dict[str, dict[str, float]] = field(default_factory=dict)

    def summary(self) -> str:
        """One line for the start-up log."""
        if not self.ms:
            return f"{self.choice} ({self.why})"
        ways = "; ".join(f"{way} {t['prefill']:.1f} and {t['decode']:.1f} ms" for way, t in self.ms.items())
        return (f"{self.kernel or 'native kernels'} ({self.why}); on a {self.template_tokens}-token template, "
                f"a {PREFILL_TOKENS}-token prefill and a {DECODE_SEQUENCES}-sequence decode step took: {ways}")


def choose(ms: dict[str, dict[str, float]], margin: float = MARGIN) -> tuple[str, str]:
    """(way, why) from the medians `ms` (TemplateTiming.ms, "native" among them): the matrix
    products' kernel of the least sum that is faster than the native kernels in both cases, and on
    the sum by at least `margin`; else "native"."""
    n = ms["native"]
    total = {way: t["prefill"] + t["decode"] for way, t in ms.items()}
    faster = [way for way, t in ms.items()
              if way != "native" and t["prefill"] < n["prefill"] and t["decode"] < n["decode"]]
    if not faster:
        return "native", "no matrix products were faster on both the prefill and the decode step"
    best = min(faster, key=total.__getitem__)
    ratio = total[best] / total["native"]
    if ratio > 1 - margin:
        return "native", (f"the fastest matrix products ({best}) took {ratio:.0%} of the native time, within the "
                          f"{margin:.0%} margin")
    return best, f"{ratio:.0%} of the native kernels' time"


def candidates(head_size: int) -> dict[str, int]:
    """The matrix products' kernels to time here: TEMPLATE_KERNELS' name -> number, each that runs
    in bf16 units on this CPU for heads of head_size (not the fallback GEMM), within what
    onednn.template_products() allows."""
    most = onednn.template_products()
    found: dict[str, int] = {}
    for products in range(most, 0, -1):
        kernel = onednn.template_kernel(head_size, products)
        if kernel != onednn.TEMPLATE_KERNELS[0]:
            found.setdefault(kernel, products)
    return found


def disagreement(template: onednn.OneDnnTemplate, k: torch.Tensor, v: torch.Tensor,
                 gen: torch.Generator) -> str | None:
    """None when the packed `template` (of k, v [R, Hkv, D] bf16) gives, on every KV head, each row's
    softmax state within bf16 rounding of float64's for 3 and for 80 query rows (a decode's few, and
    more than one block of rows); else what differed. The products' kernel is checked on the
    machine before it is timed: a fast kernel whose operands are laid out wrong must not win."""
    d = template.head_size
    for rows in (3, 80):
        q = torch.randn(rows, d, generator=gen) * d ** -0.5
        qb = q.bfloat16().double()
        for h in range(template.num_kv_heads):
            kd, vd = k[:, h].double(), v[:, h].double()
            s = qb @ kd.T
            m_ref = s.max(dim=1).values
            p = torch.exp(s - m_ref[:, None])
            w = p / p.sum(dim=1, keepdim=True)
            o, m, l = template.attend(h, q)
            out = o.double() / l.double()[:, None]
            # the scores' float32 sums; the probabilities' bf16 rounding, doubled for the normalisation
            m_tol = 2 * (d + 1) * 2.0 ** -24 * (qb.abs() @ kd.abs().T).max(dim=1).values + 1e-6
            tol = 2 * 2.0 ** -8 * (w @ vd.abs()) + 1e-5
            if not bool(((m.double() - m_ref).abs() <= m_tol).all()):
                return f"gave maxima of the scores outside float32's summation error on head {h} of {rows} rows"
            err = (out - w @ vd).abs()
            if not bool((err <= tol).all()):
                return (f"gave outputs up to {float(err.max()):.3g} from float64's on head {h} of {rows} rows, "
                        f"outside bf16's rounding (at most {float(tol.max()):.3g})")
    return None


def _plans(stack: DecoderStack, template_blocks: list[int], own: list[int]) -> tuple[StackPlan, StackPlan]:
    """A prefill of PREFILL_TOKENS after the template into blocks own[:p], and a decode step of
    DECODE_SEQUENCES sequences on the template, each storing its token in one block of own[p:]."""
    from prefix_service.backends.cpu.stack import StackPlan
    bs, r = stack.block_size, len(template_blocks) * stack.block_size
    p_blocks = -(-PREFILL_TOKENS // bs)
    pre_own, dec_own = own[:p_blocks], own[p_blocks:]
    prefill = StackPlan(
        slots=torch.tensor([pre_own[i // bs] * bs + i % bs for i in range(PREFILL_TOKENS)]),
        positions=torch.arange(r, r + PREFILL_TOKENS), num_decodes=0,
        decode_tables=torch.zeros(0, 0, dtype=torch.int32), decode_context=torch.zeros(0, dtype=torch.int32),
        decode_skip=None, prefill_info=torch.tensor([[PREFILL_TOKENS, r, r]], dtype=torch.int32),
        prefill_tables=torch.tensor([template_blocks + pre_own], dtype=torch.int32), templates=None)
    n = DECODE_SEQUENCES
    decode = StackPlan(
        slots=torch.tensor([b * bs for b in dec_own]), positions=torch.full((n,), r), num_decodes=n,
        decode_tables=torch.tensor([template_blocks + [b] for b in dec_own], dtype=torch.int32),
        decode_context=torch.full((n,), r + 1, dtype=torch.int32),
        decode_skip=torch.full((n,), len(template_blocks), dtype=torch.int32),
        prefill_info=torch.zeros(0, 3, dtype=torch.int32), prefill_tables=torch.zeros(0, 0, dtype=torch.int32),
        templates=None)
    return prefill, decode


def measure_template_attention(stack: DecoderStack) -> TemplateTiming:
    """Times a bf16 stack's template attention each way (the module's docstring) and returns the
    choice; the stack is left as it was (its template_fn untouched, the blocks used zeroed)."""
    bs, nb, positions = stack.block_size, stack.num_blocks, stack.cos.shape[0]
    kernels = candidates(stack.head_dim)
    if not kernels:
        capped = f" within {onednn.TEMPLATE_PRODUCTS_ENV}" if os.environ.get(onednn.TEMPLATE_PRODUCTS_ENV) else ""
        return TemplateTiming("native", f"no matrix products on bf16 units for heads of {stack.head_dim} here{capped}")
    own_blocks = -(-PREFILL_TOKENS // bs) + DECODE_SEQUENCES
    t_blocks = min((nb - own_blocks) * bs, TEMPLATE_TOKENS, positions - PREFILL_TOKENS - 1) // bs
    if t_blocks * bs < MIN_TEMPLATE_TOKENS:
        return TemplateTiming("native", f"not timed: {nb} blocks of {bs} tokens and {positions} positions leave no "
                                        f"room for a {MIN_TEMPLATE_TOKENS}-token template and the test's rows")
    template_blocks = list(range(t_blocks))
    own = list(range(t_blocks, t_blocks + own_blocks))
    gen = torch.Generator().manual_seed(0)
    shape = (t_blocks, bs, stack.hkv, stack.head_dim)
    try:
        for k, v in stack.kv_layers:
            k[:t_blocks] = torch.randn(shape, generator=gen).to(k.dtype)
            v[:t_blocks] = torch.randn(shape, generator=gen).to(v.dtype)
        packed = {"native": PackedTemplate(stack.kv_layers, template_blocks)}
        matrix_fn = onednn.template_attend_fn()
        fns = {"native": 0}
        failed: dict[str, str] = {}
        for kernel, products in kernels.items():
            try:
                packed[kernel] = PackedTemplate(stack.kv_layers, template_blocks, matrix=True, products=products)
            except (onednn.OneDnnError, ValueError) as e:
                failed[kernel] = f"could not pack the template: {e}"
                continue
            k0, v0 = (c[:t_blocks].flatten(0, 1) for c in stack.kv_layers[0])
            wrong = disagreement(packed[kernel].matrix[0], k0, v0, gen)
            if wrong is None:
                fns[kernel] = matrix_fn
            else:
                failed[kernel] = wrong
        prefill, decode = _plans(stack, template_blocks, own)
        x = {"prefill": torch.randn(PREFILL_TOKENS, stack.hidden, generator=gen) * 0.1,
             "decode": torch.randn(DECODE_SEQUENCES, stack.hidden, generator=gen) * 0.1}
        times: dict[str, dict[str, list[float]]] = {w: {"prefill": [], "decode": []} for w in fns}
        saved = stack.template_fn
        try:
            for round_ in range(ROUNDS + 1):
                order = [w for w in fns if w not in failed]
                for way in (order if round_ % 2 == 0 else order[::-1]):
                    stack.template_fn = fns[way]
                    for case, plan in (("prefill", prefill), ("decode", decode)):
                        rows = plan.num_decodes or 1
                        plan.templates = packed[way].pointers.unsqueeze(0).expand(rows, -1, -1).contiguous()
                        h = x[case].clone()
                        start = time.perf_counter()
                        try:
                            stack.forward(h, plan)
                        except (NativeKernelError, onednn.OneDnnError) as e:
                            if way == "native":
                                raise
                            failed[way] = f"failed: {e}"
                            break
                        if round_:
                            times[way][case].append((time.perf_counter() - start) * 1e3)
        finally:
            stack.template_fn = saved
        for way, reason in failed.items():
            log.warning("template attention: the matrix products on %s %s", way, reason)
        ms = {w: {c: statistics.median(t) for c, t in cases.items()} for w, cases in times.items() if w not in failed}
        way, why = choose(ms)
        if failed:
            why += "; " + "; ".join(f"{w} {reason}" for w, reason in failed.items())
        if way == "native":
            return TemplateTiming("native", why, None, None, t_blocks * bs, ms)
        return TemplateTiming("matrix", why, way, kernels[way], t_blocks * bs, ms)
    finally:
        for k, v in stack.kv_layers:
            k[:t_blocks + own_blocks] = 0
            v[:t_blocks + own_blocks] = 0


# --- bf16 linears on AMX: brgemm, the inner product, or brgemm for few rows ---------------------

LINEAR_ROWS = (1, 2, 4, 8, 16, 32, 64)  # row counts timed, in order, until brgemm loses
LINEAR_CALLS = 5  # timed calls of each kernel at each row count, alternating, after 2 untimed


@dataclass(frozen=True)
class LinearTiming:
    """What timing a weight shape's calls found: microseconds a call (median) for each kernel
    ("brgemm", "inner_product") at each row count timed, and the choice: `kernel` with
    `brgemm_rows` (the inner product with calls of up to that many rows on brgemm; 0: none)."""
    kernel: str
    brgemm_rows: int
    why: str
    us: dict[str, dict[int, float]] = field(default_factory=dict)


def choose_linear(us: dict[str, dict[int, float]]) -> tuple[str, int, str]:
    """(kernel, brgemm_rows, why) from per-call medians: brgemm for the row counts, from 1 up, at
    which it was not slower than the inner product; the inner product from the first at which it was
    (and for every row count past the last timed where brgemm never was: "brgemm" alone)."""
    rows = sorted(us["brgemm"])
    won = 0
    for r in rows:
        if us["brgemm"][r] > us["inner_product"].get(r, float("inf")):
            break
        won = r
    else:
        return "brgemm", 0, f"brgemm no slower at every row count timed, 1 to {rows[-1]}"
    if not won:
        return "inner_product", 0, "the inner product faster from one row"
    return "inner_product", won, f"brgemm up to {won} rows, the inner product faster at {r}"


_LINEAR_TIMINGS: dict[tuple[int, int, int, int], LinearTiming] = {}


def time_linear(n: int, k: int, columns: int) -> LinearTiming:
    """Times a bf16 weight of n x k (random values) on brgemm (blocks of `columns`) and on oneDNN's
    inner product at LINEAR_ROWS in order until brgemm is slower, and returns choose_linear()'s
    choice; once per shape, block width and torch thread count in a process (what it found is kept)."""
    key = (n, k, columns, torch.get_num_threads())
    if key in _LINEAR_TIMINGS:
        return _LINEAR_TIMINGS[key]
    gen = torch.Generator().manual_seed(n * 7 + k)
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).bfloat16()
    layers = {"brgemm": onednn.OneDnnLinear(w, None, kernel="brgemm", columns=columns),
              "inner_product": onednn.OneDnnLinear(w, None, kernel="inner_product", few_rows=False, brgemm_rows=0)}
    us: dict[str, dict[int, float]] = {name: {} for name in layers}
    for r in LINEAR_ROWS:
        x = torch.randn(r, k, generator=gen)
        outs = {name: torch.empty(r, n) for name in layers}
        samples: dict[str, list[float]] = {name: [] for name in layers}
        for call in range(LINEAR_CALLS + 2):
            for name in (layers if call % 2 == 0 else reversed(list(layers))):
                start = time.perf_counter()
                layers[name](x, outs[name])
                if call >= 2:
                    samples[name].append((time.perf_counter() - start) * 1e6)
        for name in layers:
            us[name][r] = statistics.median(samples[name])
        if us["brgemm"][r] > us["inner_product"][r]:
            break
    kernel, rows, why = choose_linear(us)
    timing = _LINEAR_TIMINGS[key] = LinearTiming(kernel, rows, why, us)
    log.info("bf16 linear %d x %d timed on %d threads: %s (%s)", n, k, key[3],
             kernel if not rows else f"brgemm up to {rows} rows, the inner product above", why)
    return timing
