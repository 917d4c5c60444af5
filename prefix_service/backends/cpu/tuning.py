"""Choosing the template attention, and a prompt's own, by timing them on the machine itself
(onednn.template_attention() and onednn.prompt_attention() "measure", the defaults where the CPU has
AMX tiles); and, asked for by name (PREFIX_SERVICE_F32_LINEAR=measure), the row count above which a
float32 model's linears run oneDNN's inner product (measure_float32_linears, at the end).

A bfloat16 model's rows may attend over a pinned template in two ways: the native kernels' float32
FMAs over a float32 copy, or bf16 matrix products (OneDnnTemplate) on one of the kernels the CPU
has for them (AMX tiles, AVX512-BF16 dot products). Which is fastest depends on the CPU's matrix
units and on its thread count, so where no figure settles it the decoder stack times each once,
when it is built, on the model's own layers:

1. a synthetic template is written into free blocks of the (still empty) KV cache and packed each way;
2. each kernel's results are checked against float64 on the first layer's heads (`disagreement`: a
   kernel whose operands are laid out wrong for this CPU must not win on speed);
3. in rounds that alternate the order, a `PREFILL_TOKENS`-token prompt continuing the template and a
   decode step of `DECODE_SEQUENCES` sequences on it run through the stack's first `TIMED_LAYERS`
   layers as the engine runs them (every layer does the same work), and are timed.

The fastest matrix products on the sum of both are kept when they are faster than the native kernels
on each and by at least `MARGIN` on the sum; anything else (slower, too close to call, a failure or a
wrong result in the products, a cache too small for the test) keeps the native kernels, and says why.
The blocks used are zeroed again afterwards, so the cache is handed to the engine as allocated.
"""
from __future__ import annotations

import contextlib
import logging
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

import torch

from prefix_service.backends.cpu import onednn
from prefix_service.backends.cpu.linear import CpuLinear, NativeLinear, float32_choice
from prefix_service.backends.cpu.native import NativeKernelError
from prefix_service.backends.cpu.packed_template import PackedTemplate
from prefix_service.backends.cpu.plan import StackPlan

log = logging.getLogger("prefix_service.engine")

TEMPLATE_TOKENS = 1024  # the synthetic template's length, at most (less where the cache is small)
MIN_TEMPLATE_TOKENS = 128  # below this the test says little: the native kernels are kept untimed
PREFILL_TOKENS = 100
DECODE_SEQUENCES = 16
ROUNDS = 5  # timed rounds of each way, after one untimed
# layers the timed steps run (the first ones: every layer does the same work, so a few give the
# ways' ratio at a fraction of a whole forward's start-up time)
TIMED_LAYERS = 4
MARGIN = 0.05  # how much faster, on the sum of both, the matrix products must be to be chosen


class TimedStack(Protocol):
    """What the timing reads and runs of the decoder stack (stack.DecoderStack)."""
    block_size: int
    num_blocks: int
    hkv: int
    head_dim: int
    hidden: int
    num_layers: int
    cos: torch.Tensor  # [positions, D]: its length is the most positions a row may take
    kv_layers: list[tuple[torch.Tensor, torch.Tensor]]
    template_fn: int
    causal_fn: int

    def forward(self, x: torch.Tensor, plan: StackPlan) -> torch.Tensor: ...


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
    softmax state within bf16 rounding of float64's for 3, 24, 40 and 80 query rows (a decode's few,
    and blocks of rows padded to 16, 32, 48 and 64 + 16, each width AMX's tiles take); else what
    differed. The products' kernel is checked on the machine before it is timed: a fast kernel whose
    operands are laid out wrong must not win."""
    d = template.head_size
    for rows in (3, 24, 40, 80):
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


def _timed_rounds(ways: list[str], cases: tuple[str, ...], step: Callable[[str, str], None],
                  failed: dict[str, str], rounds: int = ROUNDS) -> dict[str, dict[str, float]]:
    """Median milliseconds of step(way, case) for each way and case: one untimed round, then `rounds`
    timed, the ways' order reversed every other round. A way (not the first, the reference) whose step
    raises the kernels' errors is dropped, the reason kept in `failed`."""
    times: dict[str, dict[str, list[float]]] = {w: {c: [] for c in cases} for w in ways}
    for round_ in range(rounds + 1):
        order = [w for w in ways if w not in failed]
        for way in (order if round_ % 2 == 0 else order[::-1]):
            for case in cases:
                start = time.perf_counter()
                try:
                    step(way, case)
                except (NativeKernelError, onednn.OneDnnError) as e:
                    if way == ways[0]:
                        raise
                    failed[way] = f"failed: {e}"
                    break
                if round_:
                    times[way][case].append((time.perf_counter() - start) * 1e3)
    return {w: {c: statistics.median(t) for c, t in by_case.items()}
            for w, by_case in times.items() if w not in failed}


@contextlib.contextmanager
def _first_layers(stack: TimedStack, fn: str, blocks: int) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
    """The (K, V) caches of the stack's first TIMED_LAYERS layers, which its steps run alone meanwhile;
    afterwards every layer runs again, the stack's `fn` (template_fn, causal_fn) is what it was, and the
    first `blocks` blocks of those caches are zero again."""
    saved, all_layers = getattr(stack, fn), stack.num_layers
    layers = stack.kv_layers[:min(all_layers, TIMED_LAYERS)]
    stack.num_layers = len(layers)
    try:
        yield layers
    finally:
        setattr(stack, fn, saved)
        stack.num_layers = all_layers
        for k, v in layers:
            k[:blocks] = 0
            v[:blocks] = 0


def _prefill_plan(tokens: int, start: int, slots: list[int], table: list[int]) -> StackPlan:
    """One prefill of `tokens` tokens from position `start` into `slots`, the sequence's blocks `table`;
    the first `start` positions (a template's, packed) already in the cache."""
    return StackPlan(
        slots=torch.tensor(slots), positions=torch.arange(start, start + tokens), num_decodes=0,
        decode_tables=torch.zeros(0, 0, dtype=torch.int32), decode_context=torch.zeros(0, dtype=torch.int32),
        decode_skip=None, prefill_info=torch.tensor([[tokens, start, start]], dtype=torch.int32),
        prefill_tables=torch.tensor([table], dtype=torch.int32), templates=None)


def _plans(stack: TimedStack, template_blocks: list[int], own: list[int]) -> tuple[StackPlan, StackPlan]:
    """A prefill of PREFILL_TOKENS after the template into blocks own[:p], and a decode step of
    DECODE_SEQUENCES sequences on the template, each storing its token in one block of own[p:]."""
    bs, r = stack.block_size, len(template_blocks) * stack.block_size
    p_blocks = -(-PREFILL_TOKENS // bs)
    pre_own, dec_own = own[:p_blocks], own[p_blocks:]
    prefill = _prefill_plan(PREFILL_TOKENS, r, [pre_own[i // bs] * bs + i % bs for i in range(PREFILL_TOKENS)],
                            template_blocks + pre_own)
    n = DECODE_SEQUENCES
    decode = StackPlan(
        slots=torch.tensor([b * bs for b in dec_own]), positions=torch.full((n,), r), num_decodes=n,
        decode_tables=torch.tensor([template_blocks + [b] for b in dec_own], dtype=torch.int32),
        decode_context=torch.full((n,), r + 1, dtype=torch.int32),
        decode_skip=torch.full((n,), len(template_blocks), dtype=torch.int32),
        prefill_info=torch.zeros(0, 3, dtype=torch.int32), prefill_tables=torch.zeros(0, 0, dtype=torch.int32),
        templates=None)
    return prefill, decode


def measure_template_attention(stack: TimedStack) -> TemplateTiming:
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
    with _first_layers(stack, "template_fn", t_blocks + own_blocks) as layers:
        for k, v in layers:
            k[:t_blocks] = torch.randn(shape, generator=gen).to(k.dtype)
            v[:t_blocks] = torch.randn(shape, generator=gen).to(v.dtype)
        packed = {"native": PackedTemplate(layers, template_blocks)}
        matrix_fn = onednn.template_attend_fn()
        fns = {"native": 0}
        failed: dict[str, str] = {}
        for kernel, products in kernels.items():
            try:
                packed[kernel] = PackedTemplate(layers, template_blocks, matrix=True, products=products)
            except (onednn.OneDnnError, ValueError) as e:
                failed[kernel] = f"could not pack the template: {e}"
                continue
            k0, v0 = (c[:t_blocks].flatten(0, 1) for c in layers[0])
            wrong = disagreement(packed[kernel].matrix[0], k0, v0, gen)
            if wrong is None:
                fns[kernel] = matrix_fn
            else:
                failed[kernel] = wrong
        plans = dict(zip(("prefill", "decode"), _plans(stack, template_blocks, own)))
        x = {"prefill": torch.randn(PREFILL_TOKENS, stack.hidden, generator=gen) * 0.1,
             "decode": torch.randn(DECODE_SEQUENCES, stack.hidden, generator=gen) * 0.1}
        # each row's template pointers, per way and case
        rows = {w: {c: packed[w].pointers.unsqueeze(0).expand(p.num_decodes or 1, -1, -1).contiguous()
                    for c, p in plans.items()} for w in fns}

        def step(way: str, case: str) -> None:
            stack.template_fn = fns[way]
            plans[case].templates = rows[way][case]
            stack.forward(x[case].clone(), plans[case])
        ms = _timed_rounds([w for w in fns if w not in failed], ("prefill", "decode"), step, failed)
    for way, reason in failed.items():
        log.warning("template attention: the matrix products on %s %s", way, reason)
    way, why = choose(ms)
    if failed:
        why += "; " + "; ".join(f"{w} {reason}" for w, reason in failed.items())
    if way == "native":
        return TemplateTiming("native", why, None, None, t_blocks * bs, ms)
    return TemplateTiming("matrix", why, way, kernels[way], t_blocks * bs, ms)


# --- a prompt's own attention (PREFIX_SERVICE_BF16_PROMPT_ATTENTION=measure) ----------------------

PROMPT_TOKENS = 512  # the timed prompt's length, at most (a template being pinned, a long prompt)


@dataclass(frozen=True)
class PromptTiming:
    """What timing a prompt's own attention found: milliseconds a prefill of `tokens` tokens with
    nothing before it (median of the timed rounds) on the native kernels and on the AVX512-BF16 dot
    products ("native", "dot"), the way kept (`choice`) and why; `ms` is empty where nothing was
    timed."""
    choice: str
    why: str
    tokens: int = 0
    ms: dict[str, float] = field(default_factory=dict)


def choose_prompt(ms: dict[str, float], margin: float = MARGIN) -> tuple[str, str]:
    """("dot" or "native", why): the dot products where they took at most 1 - margin of the native time."""
    ratio = ms["dot"] / ms["native"]
    if ratio > 1 - margin:
        return "native", f"the dot products took {ratio:.0%} of the native time, not {1 - margin:.0%} or less"
    return "dot", f"{ratio:.0%} of the native kernels' time"


def measure_prompt_attention(stack: TimedStack) -> PromptTiming:
    """Times a bf16 stack's prefill of a prompt with nothing before it (up to PROMPT_TOKENS tokens,
    into free blocks of the still empty cache, through the first TIMED_LAYERS layers) with its own
    keys on the native kernels and on the dot products (stack.causal_fn), in alternating rounds, and
    returns the choice; the stack is left as it was (its causal_fn untouched, the blocks used zeroed)."""
    bs, nb, positions = stack.block_size, stack.num_blocks, stack.cos.shape[0]
    tokens = min(PROMPT_TOKENS, nb * bs, positions) // bs * bs
    if tokens < onednn.PROMPT_ATTENTION_MIN_TOKENS:
        return PromptTiming("native", f"not timed: {nb} blocks of {bs} tokens and {positions} positions leave no "
                                      f"room for a {onednn.PROMPT_ATTENTION_MIN_TOKENS}-token prompt")
    plan = _prefill_plan(tokens, 0, list(range(tokens)), list(range(tokens // bs)))  # blocks 0, 1, ... in turn
    x = torch.randn(tokens, stack.hidden, generator=torch.Generator().manual_seed(1)) * 0.1
    fns = {"native": 0, "dot": onednn.causal_attend_fn()}

    def step(way: str, case: str) -> None:
        stack.causal_fn = fns[way]
        stack.forward(x.clone(), plan)
    failed: dict[str, str] = {}
    with _first_layers(stack, "causal_fn", tokens // bs):
        ms = _timed_rounds(["native", "dot"], ("prefill",), step, failed)
    if failed:
        log.warning("a prompt's own attention: the dot products %s", failed["dot"])
        return PromptTiming("native", f"the dot products {failed['dot']}", tokens, {"native": ms["native"]["prefill"]})
    flat = {w: t["prefill"] for w, t in ms.items()}
    way, why = choose_prompt(flat)
    return PromptTiming(way, why, tokens, flat)


# --- a float32 model's linears: the native kernel, or oneDNN's inner product above a row count -------

FLOAT32_ROWS = (1, 16, 64, 128, 256, 512)  # rows a call, timed
FLOAT32_ROUNDS = 3  # timed rounds of each way, after one untimed
FLOAT32_MARGIN = 0.05  # how much faster the library must be at a row count to take it


@dataclass(frozen=True)
class Float32Timing:
    """What timing a float32 model's linears found: milliseconds for every linear of the first layers
    timed (median of the rounds) on each way ("native", "inner_product") at each row count of
    FLOAT32_ROWS, and the choice, `native_rows` as linear.make_linear takes it (None: the native kernel
    for every call; 0: oneDNN's inner product for every call; else the native kernel up to that
    many rows), and why."""
    native_rows: int | None
    why: str
    ms: dict[str, dict[int, float]] = field(default_factory=dict)

    def summary(self) -> str:
        """One line for the start-up log."""
        times = "; ".join(f"{r} rows {self.ms['native'][r]:.2f} and {self.ms['inner_product'][r]:.2f} ms"
                          for r in sorted(self.ms.get("native", {})))
        return (f"{float32_choice(self.native_rows)} ({self.why}); the first layers' linears on the native kernel "
                f"and on oneDNN's inner product took: {times}")


def choose_float32(ms: dict[str, dict[int, float]], margin: float = FLOAT32_MARGIN) -> tuple[int | None, str]:
    """(native_rows, why) from the medians: oneDNN's inner product from the least row count timed at
    which it took at most 1 - margin of the native time, there and at every larger count timed; the
    native kernel below it (native_rows: the count timed just below; 0: the library from the first
    count); None (the native kernel for every call) where the library did not win so at the largest."""
    rows = sorted(ms["native"])
    ratio = {r: ms["inner_product"][r] / ms["native"][r] for r in rows}
    first = None
    for r in reversed(rows):
        if ratio[r] > 1 - margin:
            break
        first = r
    if first is None:
        return None, (f"oneDNN's inner product took {ratio[rows[-1]]:.0%} of the native time at {rows[-1]} rows, "
                      f"not {1 - margin:.0%} or less")
    below = [r for r in rows if r < first]
    if not below:
        return 0, f"oneDNN's inner product took {ratio[first]:.0%} of the native time from {first} row(s) up"
    return below[-1], (f"oneDNN's inner product took {ratio[first]:.0%} of the native time at {first} rows and at most "
                       f"{1 - margin:.0%} above, {ratio[below[-1]]:.0%} at {below[-1]}")


_FLOAT32_TIMINGS: dict[tuple[tuple[tuple[int, ...], ...], int], Float32Timing] = {}


def measure_float32_linears(layers: list[list[torch.Tensor]]) -> Float32Timing:
    """Times the float32 weights `layers` (the first layers' linear weights, [out, in] each, in the
    order a forward calls them) packed for the native kernel and for oneDNN's inner product: at each
    row count of FLOAT32_ROWS, every weight in turn (each its own, as a forward reads them; a few layers'
    weights may still fit the caches where a whole model does not), in rounds that alternate the two ways; returns
    choose_float32()'s choice. Once per set of shapes and torch thread count in a process."""
    key = (tuple(tuple(w.shape) for layer in layers for w in layer), torch.get_num_threads())
    if key in _FLOAT32_TIMINGS:
        return _FLOAT32_TIMINGS[key]
    ways: dict[str, list[CpuLinear]] = {
        "native": [NativeLinear(w, None) for layer in layers for w in layer],
        "inner_product": [onednn.OneDnnLinear(w.detach(), None) for layer in layers for w in layer]}
    gen = torch.Generator().manual_seed(2)
    # dense rows in and out for each width, as the stack hands them over
    widths = {m.in_features for m in ways["native"]}
    x = {(r, k): torch.randn(r, k, generator=gen) for r in FLOAT32_ROWS for k in widths}
    out = {(r, n): torch.empty(r, n) for r in FLOAT32_ROWS for n in {m.out_features for m in ways["native"]}}

    def step(way: str, case: str) -> None:
        r = int(case)
        for m in ways[way]:
            m(x[r, m.in_features], out[r, m.out_features])
    failed: dict[str, str] = {}
    ms = _timed_rounds(list(ways), tuple(str(r) for r in FLOAT32_ROWS), step, failed, FLOAT32_ROUNDS)
    if failed:
        log.warning("float32 linears: oneDNN's inner product %s", failed["inner_product"])
        timing = Float32Timing(None, f"oneDNN's inner product {failed['inner_product']}")
    else:
        by_rows = {w: {int(c): t for c, t in cases.items()} for w, cases in ms.items()}
        rows, why = choose_float32(by_rows)
        timing = Float32Timing(rows, why, by_rows)
    _FLOAT32_TIMINGS[key] = timing
    return timing
