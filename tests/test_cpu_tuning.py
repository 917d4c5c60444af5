"""The template attention chosen by timing it (onednn.template_attention() "measure", tuning.py):
the rule that reads the timings, the stack's choice and what it leaves behind, and what happens
when the matrix products cannot run. Timings are never asserted; what is checked is that the
choice follows the rule from what was timed, that the cache comes back as allocated, and that the
engine then serves on its choice (prefix equals no prefix)."""
import pytest
import torch

from helpers import engine_last_logits, mixed_generate, pinned_handle, run_ids
from prefix_service.backends.cpu import linear, native, onednn, tuning
from prefix_service.backends.cpu.stack import DecoderStack
from test_cpu_bf16 import BS, assert_same_or_near_tie, assert_templates_equal_no_template, ids_of

REASON = native.load()[1] or linear.available(torch.bfloat16)
LIB = onednn.load()[1]
needs_lib = pytest.mark.skipif(LIB is not None, reason=f"no oneDNN library here: {LIB}")
needs_bf16 = pytest.mark.skipif(REASON is not None, reason=f"no native CPU kernels for bfloat16 here: {REASON}")
# a CPU whose bf16 units multiply the template's products (AMX tiles or AVX512-BF16 dot products)
KERNELS = tuning.candidates(16) if onednn.load()[0] is not None else {}
needs_units = pytest.mark.skipif(not KERNELS, reason="no bf16 units multiply the template's products here")


def ms(native_ms, **kernels):
    """A TemplateTiming.ms: (prefill, decode) milliseconds for the native kernels and each kernel."""
    return {way: {"prefill": p, "decode": d} for way, (p, d) in {"native": native_ms, **kernels}.items()}


def test_the_rule_keeps_matrix_products_only_when_faster_on_both_and_by_the_margin():
    assert tuning.choose(ms((40, 12), dot=(30, 9))) == ("dot", "75% of the native kernels' time")
    way, why = tuning.choose(ms((40, 12), dot=(30, 12.5)))  # faster on the sum, slower on the decode step
    assert way == "native" and "not faster" not in why and "on both the prefill and the decode step" in why
    way, why = tuning.choose(ms((40, 12), dot=(39, 11.5)))  # faster on both, by 2.9% on the sum
    assert way == "native" and "dot" in why and "97%" in why and "5% margin" in why
    assert tuning.choose(ms((40, 12), dot=(39, 11.5)), margin=0.02)[0] == "dot"
    # of two kernels the fastest on the sum among those faster on both
    assert tuning.choose(ms((40, 12), amx=(20, 12.1), dot=(30, 9)))[0] == "dot"
    assert tuning.choose(ms((40, 12), amx=(20, 8), dot=(30, 9)))[0] == "amx"
    # the least sum, not the fastest prefill: amx is faster on the prefill, dot on the two together
    assert tuning.choose(ms((40, 12), amx=(25, 11.9), dot=(30, 5))) == ("dot", "67% of the native kernels' time")
    assert tuning.choose(ms((40, 12)))[0] == "native"  # nothing else timed


def test_measure_is_the_default_only_where_amx_tiles_would_multiply(monkeypatch):
    monkeypatch.delenv(onednn.TEMPLATE_ATTENTION_ENV, raising=False)
    monkeypatch.delenv(onednn.TEMPLATE_PRODUCTS_ENV, raising=False)
    monkeypatch.setattr(onednn, "brgemm_vnni", lambda: True)
    monkeypatch.setattr(onednn, "template_kernel", lambda head_size, products=None: "AMX brgemm")
    assert onednn.template_attention(64) == "measure"
    monkeypatch.setattr(onednn, "template_kernel", lambda head_size, products=None: "fallback GEMM")
    assert onednn.template_attention(72) == "native"
    monkeypatch.setenv(onednn.TEMPLATE_ATTENTION_ENV, "measure")  # asked for anywhere
    assert onednn.template_attention(72) == "measure"


def stack_of(engine) -> DecoderStack:
    return engine._core.backend.stack


def built_with_failing(make_engine, monkeypatch, fn: str, message: str):
    """A bf16 engine built while every stack step with its `fn` (template_fn, causal_fn) set fails with
    `message`, as a kernel refusing a shape would; it then serves with the real steps."""
    real_forward = DecoderStack.forward

    def failing(self, x, plan):
        if getattr(self, fn):
            raise onednn.OneDnnError(message)
        return real_forward(self, x, plan)
    monkeypatch.setattr(DecoderStack, "forward", failing)
    try:
        return make_engine(block_size=BS, dtype="bfloat16", backend="cpu")
    finally:
        monkeypatch.setattr(DecoderStack, "forward", real_forward)


@needs_bf16
def test_the_stack_times_each_way_and_keeps_what_the_rule_picks(make_engine, monkeypatch):
    """With "measure" the stack times the native kernels and every kernel of the CPU's bf16 units,
    keeps the way tuning.choose() picks from those timings, hands the cache back zeroed, and the
    engine serves on it: greedy ids on a pinned template equal those without it (or first differ at
    a near tie), the template packed for the way chosen."""
    monkeypatch.setenv(onednn.TEMPLATE_ATTENTION_ENV, "measure")
    monkeypatch.setattr(tuning, "TIMED_LAYERS", 1)  # fewer than the model's 2: timed on the first only
    engine = make_engine(block_size=BS, dtype="bfloat16", backend="cpu")
    stack = stack_of(engine)
    timing = stack.template_timing
    assert timing is not None
    assert all(not k.any() and not v.any() for k, v in stack.kv_layers)  # the blocks it used, zeroed
    assert stack.num_layers == engine._core.arch.num_layers == len(stack.layers)  # every layer again
    if not KERNELS:  # nothing to time against
        assert timing.choice == "native" and not timing.ms and "no matrix products on bf16 units" in timing.why
    else:
        assert set(timing.ms) == {"native", *KERNELS}
        assert all(t["prefill"] > 0 and t["decode"] > 0 for t in timing.ms.values())
        way, why = tuning.choose(timing.ms)
        assert timing.why == why and timing.kernel == (None if way == "native" else way)
        assert timing.choice == ("native" if way == "native" else "matrix")
        assert timing.products == KERNELS.get(way)
        assert "a 100-token prefill and a 16-sequence decode step" in timing.summary()
    assert stack.template_matrix == (timing.choice == "matrix")
    assert (stack.template_fn != 0) == stack.template_matrix
    assert "timed each way: " + timing.why in engine._core.backend.describe()
    calls = onednn.template_attend_calls()
    assert_templates_equal_no_template(engine, (BS, 2 * BS + 1, 20 * BS + 3), 24)
    assert (onednn.template_attend_calls() > calls) == stack.template_matrix
    engine.add_template("t", token_ids=list(range(3, 40)))
    (packed,) = engine._core.backend.templates.values()
    assert bool(packed.matrix) == stack.template_matrix
    if stack.template_matrix:
        assert {m.kernel for m in packed.matrix} == {timing.kernel}
        stack.template_products = onednn.TEMPLATE_PRODUCTS["fallback"]  # templates are packed for the stack's cap
        engine.add_template("u", token_ids=list(range(5, 40)))
        assert {m.kernel for m in engine._core.backend.templates[pinned_handle(engine, "u").template_id].matrix} == {
            "fallback GEMM"}


@needs_bf16
@needs_units
def test_a_failure_in_the_matrix_products_keeps_the_native_kernels(make_engine, monkeypatch):
    """The matrix products refused when the template is packed, or failing inside the timed step:
    the stack keeps the native kernels, says which kernel failed and why, restores what it changed,
    and the engine serves."""
    monkeypatch.setenv(onednn.TEMPLATE_ATTENTION_ENV, "measure")
    real_pack = tuning.PackedTemplate

    def refuse(*args, matrix=False, **kwargs):
        if matrix:
            raise onednn.OneDnnError("ps_onednn_template_pack: refused here")
        return real_pack(*args, **kwargs)
    monkeypatch.setattr(tuning, "PackedTemplate", refuse)
    stack = stack_of(make_engine(block_size=BS, dtype="bfloat16", backend="cpu"))
    timing = stack.template_timing
    assert timing.choice == "native" and not stack.template_matrix and stack.template_fn == 0
    assert set(timing.ms) == {"native"}
    assert all(f"{kernel} could not pack the template: ps_onednn_template_pack: refused here" in timing.why
               for kernel in KERNELS)
    monkeypatch.setattr(tuning, "PackedTemplate", real_pack)

    engine = built_with_failing(make_engine, monkeypatch, "template_fn",
                                "ps_onednn_template_attend: a shape the kernel refused")
    stack = stack_of(engine)
    assert stack.template_timing.choice == "native" and stack.template_fn == 0
    assert "failed: ps_onednn_template_attend: a shape the kernel refused" in stack.template_timing.why
    assert all(not k.any() and not v.any() for k, v in stack.kv_layers)
    engine.add_template("t", token_ids=list(range(3, 40)))
    assert len(run_ids(engine, [5, 6, 7], prefix="t", max_tokens=4)) == 4


@needs_bf16
def test_a_cache_too_small_to_time_in_keeps_the_native_kernels(make_engine, monkeypatch):
    monkeypatch.setenv(onednn.TEMPLATE_ATTENTION_ENV, "measure")
    stack = stack_of(make_engine(block_size=BS, num_blocks=60, dtype="bfloat16", backend="cpu"))
    timing = stack.template_timing
    assert timing.choice == "native" and not stack.template_matrix and not timing.ms
    assert ("no matrix products on bf16 units" in timing.why if not KERNELS
            else "not timed: 60 blocks of 4 tokens and 512 positions leave no room" in timing.why)


@needs_bf16
@needs_units
def test_a_cache_with_room_for_exactly_the_smallest_template_is_timed(make_engine, monkeypatch):
    """MIN_TEMPLATE_TOKENS is the shortest template timed: a cache leaving room for exactly that many
    template tokens beside the test's rows is timed on them; one block fewer is not."""
    monkeypatch.setenv(onednn.TEMPLATE_ATTENTION_ENV, "measure")
    monkeypatch.setattr(tuning, "TIMED_LAYERS", 1)
    own = -(-tuning.PREFILL_TOKENS // BS) + tuning.DECODE_SEQUENCES
    blocks = own + tuning.MIN_TEMPLATE_TOKENS // BS
    timing = stack_of(make_engine(block_size=BS, num_blocks=blocks, dtype="bfloat16", backend="cpu")).template_timing
    assert timing.template_tokens == tuning.MIN_TEMPLATE_TOKENS and set(timing.ms) == {"native", *KERNELS}
    timing = stack_of(make_engine(block_size=BS, num_blocks=blocks - 1, dtype="bfloat16",
                                  backend="cpu")).template_timing
    assert not timing.ms and timing.why.startswith(f"not timed: {blocks - 1} blocks of {BS} tokens")


@needs_bf16
@needs_units
@pytest.mark.parametrize("faster", ["matrix", "native"])
def test_the_stack_keeps_the_way_its_timings_favour_and_packs_templates_for_it(make_engine, monkeypatch, faster):
    """Timings that favour one way (each way's steps run, their times replaced: the matrix products
    twice as fast as the native kernels, or twice as slow): the stack keeps that way, with the
    kernel and the cap that packs templates for it where it keeps the products, says so at start-up,
    and serves on it (prefix equals no prefix, or first differs at a near tie). The products' timed
    prefill and decode step each attend over the packed template through them, the native kernels' not."""
    monkeypatch.setenv(onednn.TEMPLATE_ATTENTION_ENV, "measure")
    monkeypatch.setattr(tuning, "TIMED_LAYERS", 1)
    real_rounds = tuning._timed_rounds
    kernel = min(KERNELS)  # the one given the least times among the products' kernels
    attended: dict[tuple[str, str], bool] = {}

    def favouring(ways, cases, step, failed, rounds=tuning.ROUNDS):
        def counted(way, case):
            calls = onednn.template_attend_calls()
            step(way, case)
            attended[way, case] = onednn.template_attend_calls() > calls
        timed = real_rounds(ways, cases, counted, failed, rounds=1)
        scale = {"native": 1.0, kernel: 0.5 if faster == "matrix" else 2.0}
        return {w: {"prefill": 40 * scale.get(w, 3.0), "decode": 12 * scale.get(w, 3.0)} for w in timed}
    monkeypatch.setattr(tuning, "_timed_rounds", favouring)
    engine = make_engine(block_size=BS, dtype="bfloat16", backend="cpu")
    stack = stack_of(engine)
    timing = stack.template_timing
    assert set(timing.ms) == {"native", *KERNELS} and timing.ms["native"] == {"prefill": 40, "decode": 12}
    assert attended == {(w, c): w != "native" for w in timing.ms for c in ("prefill", "decode")}
    if faster == "matrix":
        assert (timing.choice, timing.kernel, timing.products) == ("matrix", kernel, KERNELS[kernel])
        assert timing.why == "50% of the native kernels' time" and timing.summary().startswith(f"{kernel} (50%")
        assert stack.template_matrix and stack.template_fn != 0 and stack.template_products == KERNELS[kernel]
    else:
        assert (timing.choice, timing.kernel, timing.products) == ("native", None, None)
        assert timing.why == "no matrix products were faster on both the prefill and the decode step"
        assert not stack.template_matrix and stack.template_fn == 0
        assert timing.summary().startswith("native kernels (no matrix products were faster")
    assert "timed each way: " + timing.why in engine._core.backend.describe()
    assert all(not k.any() and not v.any() for k, v in stack.kv_layers)
    engine.add_template("t", token_ids=list(range(3, 40)))
    (packed,) = engine._core.backend.templates.values()
    assert [m.kernel for m in packed.matrix] == ([kernel] * stack.num_layers if faster == "matrix" else [])
    assert_templates_equal_no_template(engine, (BS, 2 * BS + 1, 20 * BS + 3), 24)


@needs_bf16
@needs_units
def test_a_template_timed_on_a_short_context_fits_its_positions(make_engine, monkeypatch):
    """A model served with a context shorter than the cache's room for a template (max_model_len 300):
    the timed template leaves positions for the test's prompt and decode token after it, in whole
    blocks, and the engine is built and serves."""
    monkeypatch.setenv(onednn.TEMPLATE_ATTENTION_ENV, "measure")
    monkeypatch.setattr(tuning, "TIMED_LAYERS", 1)
    engine = make_engine(block_size=BS, dtype="bfloat16", backend="cpu", max_model_len=300)
    stack = stack_of(engine)
    positions = stack.cos.shape[0]
    own = -(-tuning.PREFILL_TOKENS // BS) + tuning.DECODE_SEQUENCES
    assert (stack.num_blocks - own) * BS > positions - tuning.PREFILL_TOKENS - 1  # the context bounds it
    assert stack.template_timing.template_tokens == (positions - tuning.PREFILL_TOKENS - 1) // BS * BS
    assert set(stack.template_timing.ms) == {"native", *KERNELS}
    engine.add_template("t", token_ids=list(range(3, 40)))
    assert len(run_ids(engine, [5, 6, 7], prefix="t", max_tokens=4)) == 4


def swap_pairs(o):
    """o [rows, D] with each pair of dimensions (0 and 1, 2 and 3, ...) swapped."""
    return o.view(o.shape[0], -1, 2).flip(-1).reshape(o.shape)


class Swapped:
    """A packed template whose outputs come back with a pair of dimensions swapped: what a kernel
    reading its VNNI pairs in the wrong order gives."""

    def __init__(self, template, how):
        self.template, self.how = template, how
        self.head_size, self.num_kv_heads = template.head_size, template.num_kv_heads

    def attend(self, h, q):
        o, m, l = self.template.attend(h, q)
        if self.how == "pairs":
            o = swap_pairs(o)
        elif self.how == "rows":
            o = o.roll(1, 0)
        elif self.how == "last tile":  # rows past 64 (the fifth tile of 16) read in the wrong order
            o = torch.cat([o[:64], swap_pairs(o[64:])]) if o.shape[0] > 64 else o
        else:
            m = m + 0.5
        return o, m, l


@needs_lib
@pytest.mark.parametrize("products,key_rows", [("auto", False), ("dot", False), ("dot", True), ("fallback", False)])
def test_the_kernel_check_passes_each_real_kernel_and_catches_a_wrong_one(products, key_rows, monkeypatch):
    """tuning.disagreement: None for the kernels the products run on here (both walks, on 3, 24, 40
    and 80 rows over 1,000 keys), a message for outputs with their VNNI pairs swapped, rows shifted by one,
    or maxima off by 0.5, and for outputs wrong only past 64 rows (checked on 80 rows)."""
    if products == "dot" and "AVX512-BF16 dot products" not in KERNELS:
        pytest.skip("no AVX512-BF16 dot products here")
    monkeypatch.setenv(onednn.TEMPLATE_PRODUCTS_ENV, products)
    g = torch.Generator().manual_seed(5)
    k, v = (torch.randn(1000, 3, 64, generator=g).bfloat16() for _ in range(2))
    template = onednn.OneDnnTemplate(k, v, key_rows=key_rows)
    assert tuning.disagreement(template, k, v, g) is None
    assert "outside bf16's rounding" in tuning.disagreement(Swapped(template, "pairs"), k, v, g)
    assert "outputs up to" in tuning.disagreement(Swapped(template, "rows"), k, v, g)
    assert "maxima of the scores" in tuning.disagreement(Swapped(template, "max"), k, v, g)
    wrong = tuning.disagreement(Swapped(template, "last tile"), k, v, g)
    assert wrong.startswith("gave outputs up to") and "on head 0 of 80 rows, outside bf16's rounding" in wrong


@needs_bf16
@needs_units
def test_a_kernel_that_gives_wrong_outputs_is_not_timed(make_engine, monkeypatch, caplog):
    """Matrix products whose outputs are wrong (here, swapped pairs) are checked out before they are
    timed, whatever their speed: the native kernels are kept, the reason given, and each such kernel
    warned of at start-up."""
    monkeypatch.setenv(onednn.TEMPLATE_ATTENTION_ENV, "measure")
    real_attend = onednn.OneDnnTemplate.attend

    def swapped(self, h, q):
        o, m, l = real_attend(self, h, q)
        return swap_pairs(o), m, l
    monkeypatch.setattr(onednn.OneDnnTemplate, "attend", swapped)
    stack = stack_of(make_engine(block_size=BS, dtype="bfloat16", backend="cpu"))
    timing = stack.template_timing
    assert timing.choice == "native" and stack.template_fn == 0 and set(timing.ms) == {"native"}
    assert all(f"{kernel} gave outputs up to" in timing.why for kernel in KERNELS)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert all(any(w.startswith(f"template attention: the matrix products on {kernel} gave outputs up to")
                   for w in warned) for kernel in KERNELS), warned


@needs_bf16
def test_products_capped_at_the_fallback_leave_nothing_to_time(make_engine, monkeypatch):
    monkeypatch.setenv(onednn.TEMPLATE_ATTENTION_ENV, "measure")
    monkeypatch.setenv(onednn.TEMPLATE_PRODUCTS_ENV, "fallback")
    stack = stack_of(make_engine(block_size=BS, dtype="bfloat16", backend="cpu"))
    assert stack.template_timing.choice == "native" and not stack.template_timing.ms and stack.template_fn == 0
    assert stack.template_timing.why == ("no matrix products on bf16 units for heads of 16 here within "
                                         "PREFIX_SERVICE_BF16_TEMPLATE_PRODUCTS")


# --- bf16 linears: brgemm, the inner product, or brgemm for few rows ---------------------------------

def us(brgemm, inner):
    """A LinearTiming.us from per-row-count pairs of lists."""
    rows = [1, 2, 4, 8, 16, 32, 64]
    return {"brgemm": dict(zip(rows, brgemm)), "inner_product": dict(zip(rows, inner))}


def test_the_linear_rule_runs_brgemm_for_the_rows_it_wins_from_one_up():
    assert onednn.choose_linear(us([5, 6, 9], [7, 7, 8])) == (
        "inner_product", 2, "brgemm up to 2 rows, the inner product faster at 4")
    assert onednn.choose_linear(us([9], [7])) == ("inner_product", 0, "the inner product faster from one row")
    assert onednn.choose_linear(us([5] * 7, [7] * 7)) == (
        "brgemm", 0, "brgemm no slower at every row count timed, 1 to 64")
    assert onednn.choose_linear(us([5, 5], [5, 4]))[:2] == ("inner_product", 1)  # a tie goes to brgemm


@needs_bf16
@pytest.mark.skipif(not onednn.bf16_native(), reason="torch's oneDNN runs no bf16 inner product here")
def test_a_timed_linear_runs_what_the_rule_picks_from_its_timings(monkeypatch):
    """kernel "measure": the shape is timed until brgemm loses (or at every row count), the layer runs
    choose_linear's choice from those timings, and a second weight of the shape reuses them untimed;
    its outputs are the chosen kernel's, bit for bit."""
    monkeypatch.setattr(onednn, "_LINEAR_TIMINGS", {})
    g = torch.Generator().manual_seed(11)
    w = (torch.randn(80, 48, generator=g) * 48 ** -0.5).bfloat16()
    layer = onednn.OneDnnLinear(w, None, kernel="measure")
    timing = layer.timing
    assert (layer.kernel, layer.brgemm_rows, timing.why) == onednn.choose_linear(timing.us)
    timed = sorted(timing.us["brgemm"])
    assert timed == sorted(timing.us["inner_product"]) == list(onednn.LINEAR_ROWS[:len(timed)])
    lost = [r for r in timed if timing.us["brgemm"][r] > timing.us["inner_product"][r]]
    assert lost == ([timed[-1]] if layer.kernel == "inner_product" else [])  # timed up to the first loss
    assert layer.few_rows == 0  # the few-row kernel is not packed beside a timed choice
    again = onednn.OneDnnLinear(torch.randn(80, 48, generator=g).bfloat16(), None, kernel="measure")
    assert again.timing is timing
    x = torch.randn(70, 48, generator=g)
    alone = {"brgemm": onednn.OneDnnLinear(w, None, kernel="brgemm"),
             "inner_product": onednn.OneDnnLinear(w, None, kernel="inner_product", few_rows=False)}
    for m in (1, 5, 70):
        on_brgemm = layer.kernel == "brgemm" or m <= layer.brgemm_rows
        assert torch.equal(layer(x[:m]), alone["brgemm" if on_brgemm else "inner_product"](x[:m]))


@needs_bf16
@pytest.mark.skipif(not onednn.bf16_native(), reason="torch's oneDNN runs no bf16 inner product here")
@pytest.mark.parametrize("how", ["measure", "brgemm-rows"])
def test_an_engine_on_timed_or_split_linears_gives_prefix_equal_no_prefix(make_engine, how, monkeypatch):
    """The engine with its linears timed per shape, or with brgemm for calls of up to 6 rows beside the
    inner product (PREFIX_SERVICE_BF16_BRGEMM_ROWS: a decode step's calls on brgemm, a prefill's on the
    inner product): greedy ids on a pinned template equal those without it (or first differ at a near
    tie), and the start-up line says what each linear runs."""
    monkeypatch.setattr(onednn, "_LINEAR_TIMINGS", {})
    if how == "measure":
        monkeypatch.setenv(onednn.KERNEL_ENV, "measure")
    else:
        monkeypatch.setenv(onednn.KERNEL_ENV, "inner_product")
        monkeypatch.setenv(onednn.BRGEMM_ROWS_ENV, "6")
    engine = make_engine(block_size=BS, dtype="bfloat16", backend="cpu")
    backend = engine._core.backend
    layer = backend.stack.layers[0]
    linears = [layer.qkv, layer.o, layer.gate_up, layer.down, backend.head]
    if how == "measure":
        assert all(m.timing is not None and (m.kernel, m.brgemm_rows) == (m.timing.kernel, m.timing.brgemm_rows)
                   for m in linears)
        assert "each shape timed on brgemm and the inner product" in backend.describe()
        assert backend.linear_choices() in backend.describe()
    else:
        assert all((m.kernel, m.brgemm_rows, m.few_rows) == ("inner_product", 6, 0) for m in linears)
        assert "brgemm up to 6 rows)" in backend.describe()  # "(AMX; brgemm ...)" on AMX
    calls = onednn.brgemm_calls()
    assert_templates_equal_no_template(engine, (BS, 2 * BS + 1, 20 * BS + 3), 24)
    on_brgemm = any(m.kernel == "brgemm" or m.brgemm_rows for m in linears)
    assert (onednn.brgemm_calls() > calls) == on_brgemm  # the decode steps' calls, where brgemm takes them


# --- a prompt's own attention --------------------------------------------------------------------------

def test_the_prompt_rule_keeps_the_dot_products_only_by_the_margin():
    assert tuning.choose_prompt({"native": 20.0, "dot": 15.0}) == ("dot", "75% of the native kernels' time")
    way, why = tuning.choose_prompt({"native": 20.0, "dot": 19.5})
    assert way == "native" and "98%" in why and "95% or less" in why
    assert tuning.choose_prompt({"native": 20.0, "dot": 25.0})[0] == "native"


def test_each_rule_takes_the_faster_way_at_exactly_one_minus_the_margin():
    """"At most 1 - margin" of the native time: a way that took exactly that (here half, with a margin
    of one half, exact in binary) is taken by each rule."""
    assert tuning.choose(ms((40, 12), dot=(20, 6)), margin=0.5)[0] == "dot"
    assert tuning.choose_prompt({"native": 20.0, "dot": 10.0}, margin=0.5) == ("dot", "50% of the native kernels' time")
    assert tuning.choose_float32(f32_ms([1, 2], [0.5, 1]), margin=0.5)[0] == 0


def test_a_failure_of_the_reference_way_is_raised_and_of_another_way_drops_it():
    """The timing rounds: the first way is what the others are measured against, so its kernels' error
    stops the timing; another way's error drops that way, its reason kept."""
    def step(failing):
        def run(way, case):
            if way == failing:
                raise native.NativeKernelError(f"{way} refused {case}")
        return run
    with pytest.raises(native.NativeKernelError, match="native refused prefill"):
        tuning._timed_rounds(["native", "dot"], ("prefill", "decode"), step("native"), {}, rounds=1)
    failed: dict[str, str] = {}
    got = tuning._timed_rounds(["native", "dot"], ("prefill", "decode"), step("dot"), failed, rounds=1)
    assert set(got) == {"native"} and set(got["native"]) == {"prefill", "decode"}
    assert failed == {"dot": "failed: dot refused prefill"}


def test_the_timing_rounds_alternate_the_order_leave_out_the_first_round_and_keep_each_median(monkeypatch):
    """The timing rounds: one untimed round, then `rounds` timed with the ways' order reversed every
    other round (neither way always runs on what the other left in the caches), and each way's and
    case's median of the timed rounds. A clock that the steps advance stands in for the time taken:
    the first, untimed round takes a second, the timed ones a few milliseconds each."""
    clock = [0.0]
    monkeypatch.setattr(tuning, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: clock[0])}))
    took_ms = {("native", "prefill"): [1000, 10, 30, 11], ("native", "decode"): [1000, 4, 3, 9],
               ("dot", "prefill"): [1000, 7, 8, 20], ("dot", "decode"): [1000, 2, 6, 5]}
    calls: list[tuple[str, str]] = []

    def step(way, case):
        clock[0] += took_ms[way, case][sum(c == (way, case) for c in calls)] / 1e3
        calls.append((way, case))
    got = tuning._timed_rounds(["native", "dot"], ("prefill", "decode"), step, {}, rounds=3)
    assert [way for way, case in calls[::2]] == ["native", "dot", "dot", "native", "native", "dot", "dot", "native"]
    assert all(case == "prefill" for way, case in calls[::2]) and all(case == "decode" for way, case in calls[1::2])
    assert got == {"native": {"prefill": pytest.approx(11), "decode": pytest.approx(4)},
                   "dot": {"prefill": pytest.approx(8), "decode": pytest.approx(5)}}


def test_the_candidates_are_each_bf16_kernel_within_the_cap_never_the_fallback(monkeypatch):
    """tuning.candidates on a CPU with AMX tiles and AVX512-BF16 dot products (the library's rule
    stood in for: the most capable kernel within the number asked for, for heads of a multiple of
    16): each kernel at the number that picks it, within template_products()' cap; never torch's
    fallback GEMM (nothing to time for heads the units do not take)."""
    def kernel(head_size, products=None):
        return onednn.TEMPLATE_KERNELS[products if head_size % 16 == 0 else 0]
    monkeypatch.setattr(onednn, "template_kernel", kernel)
    monkeypatch.setattr(onednn, "template_products", lambda: 2)
    assert tuning.candidates(64) == {"AMX brgemm": 2, "AVX512-BF16 dot products": 1}
    assert tuning.candidates(72) == {}
    monkeypatch.setattr(onednn, "template_products", lambda: 1)
    assert tuning.candidates(64) == {"AVX512-BF16 dot products": 1}
    monkeypatch.setattr(onednn, "template_products", lambda: 0)
    assert tuning.candidates(64) == {}


def test_the_start_up_lines_name_the_kernel_kept_and_each_ways_times():
    """TemplateTiming.summary and Float32Timing.summary: the way kept first (the products' kernel, or
    the native kernels), why, then every way's times; the float32 line's row counts in increasing
    order whatever order they were timed in."""
    dot = "AVX512-BF16 dot products"
    timed = ms((40, 12), **{dot: (30, 9)})
    line = tuning.TemplateTiming("matrix", "75% of the native kernels' time", dot, 1, 256, timed).summary()
    assert line.startswith(f"{dot} (75% of the native kernels' time); on a 256-token template")
    assert line.endswith(f"took: native 40.0 and 12.0 ms; {dot} 30.0 and 9.0 ms")
    line = tuning.TemplateTiming("native", "too close", None, None, 256, timed).summary()
    assert line.startswith("native kernels (too close); on a 256-token template")
    assert tuning.TemplateTiming("native", "not timed: no room").summary() == "native (not timed: no room)"
    by_rows = {"native": {512: 8.0, 1: 0.5, 16: 1.25}, "inner_product": {512: 4.0, 1: 0.75, 16: 1.5}}
    line = tuning.Float32Timing(16, "chosen", by_rows).summary()
    assert line.startswith(f"{linear.float32_choice(16)} (chosen); ")
    assert line.endswith("took: 1 rows 0.50 and 0.75 ms; 16 rows 1.25 and 1.50 ms; 512 rows 8.00 and 4.00 ms")


@needs_lib
def test_products_capped_at_the_dot_products_leave_them_to_time_where_the_cpu_has_them(monkeypatch):
    """PREFIX_SERVICE_BF16_TEMPLATE_PRODUCTS=dot (the most the products may use: kernel number 1): the
    AVX512-BF16 dot products are the one candidate, timed as number 1, where the library has them."""
    monkeypatch.setenv(onednn.TEMPLATE_PRODUCTS_ENV, "dot")
    if onednn.template_kernel(16, 1) != "AVX512-BF16 dot products":
        pytest.skip("no AVX512-BF16 dot products here")
    assert tuning.candidates(16) == {"AVX512-BF16 dot products": 1}
    monkeypatch.setenv(onednn.TEMPLATE_PRODUCTS_ENV, "auto")
    assert "AVX512-BF16 dot products" in tuning.candidates(16) or onednn.template_kernel(16, 2) == "AMX brgemm"


needs_dot = pytest.mark.skipif(not onednn.load()[0] or onednn.template_kernel(16, 1) != "AVX512-BF16 dot products",
                               reason="no AVX512-BF16 dot products here")


@needs_bf16
@needs_dot
def test_the_stack_times_a_prompts_own_attention_and_keeps_what_the_rule_picks(make_engine, monkeypatch):
    """With "measure" the stack times a 512-token prompt's prefill on the native kernels and on the
    dot products, keeps choose_prompt's way from those timings, hands the cache back zeroed with every
    layer in use again, and serves: a 200-token prompt's greedy ids are those of an engine on the
    native kernels, or first differ at a near tie."""
    monkeypatch.setenv(onednn.PROMPT_ATTENTION_ENV, "measure")
    monkeypatch.setattr(tuning, "TIMED_LAYERS", 1)  # fewer than the model's 2: timed on the first only
    engine = make_engine(block_size=BS, dtype="bfloat16", backend="cpu")
    stack = stack_of(engine)
    timing = stack.prompt_timing
    assert timing.tokens == 512 and set(timing.ms) == {"native", "dot"} and min(timing.ms.values()) > 0
    assert (timing.choice, timing.why) == tuning.choose_prompt(timing.ms)
    assert stack.prompt_dot == (timing.choice == "dot") and (stack.causal_fn != 0) == stack.prompt_dot
    assert all(not k.any() and not v.any() for k, v in stack.kv_layers)
    assert stack.num_layers == len(stack.layers)
    assert f"(timed both ways: {timing.why})" in engine._core.backend.describe()
    monkeypatch.setenv(onednn.PROMPT_ATTENTION_ENV, "native")
    native_engine = make_engine(block_size=BS, dtype="bfloat16", backend="cpu")
    prompt = ids_of(200, salt=3)
    calls = onednn.causal_attend_calls()
    got = run_ids(engine, prompt, max_tokens=12)
    assert (onednn.causal_attend_calls() > calls) == stack.prompt_dot
    assert_same_or_near_tie(native_engine, prompt, run_ids(native_engine, prompt, max_tokens=12), got, "measured",
                            either_order=True)


@needs_bf16
@needs_dot
def test_a_prompt_timing_that_fails_or_has_no_room_keeps_the_native_kernels(make_engine, monkeypatch):
    monkeypatch.setenv(onednn.PROMPT_ATTENTION_ENV, "measure")
    engine = built_with_failing(make_engine, monkeypatch, "causal_fn", "ps_onednn_causal_attend: refused here")
    stack = stack_of(engine)
    assert stack.prompt_timing.choice == "native" and stack.causal_fn == 0 and not stack.prompt_dot
    assert stack.prompt_timing.why == "the dot products failed: ps_onednn_causal_attend: refused here"
    assert set(stack.prompt_timing.ms) == {"native"} and stack.num_layers == len(stack.layers)
    assert all(not k.any() and not v.any() for k, v in stack.kv_layers)
    assert len(run_ids(engine, ids_of(150), max_tokens=3)) == 3
    small = stack_of(make_engine(block_size=BS, num_blocks=30, dtype="bfloat16", backend="cpu"))
    assert small.prompt_timing.choice == "native" and not small.prompt_timing.ms
    assert small.prompt_timing.why == ("not timed: 30 blocks of 4 tokens and 512 positions leave no room for a "
                                       "128-token prompt")


@needs_bf16
@needs_dot
def test_a_prompt_timed_on_a_short_context_fits_its_positions(make_engine, monkeypatch):
    """A model served with a context shorter than PROMPT_TOKENS (max_model_len 200): the timed prompt
    is as long as the context allows, in whole blocks, and the engine is built and serves."""
    monkeypatch.setenv(onednn.PROMPT_ATTENTION_ENV, "measure")
    monkeypatch.setattr(tuning, "TIMED_LAYERS", 1)
    engine = make_engine(block_size=BS, dtype="bfloat16", backend="cpu", max_model_len=200)
    stack = stack_of(engine)
    assert stack.prompt_timing.tokens == stack.cos.shape[0] // BS * BS <= 200
    assert set(stack.prompt_timing.ms) == {"native", "dot"}
    assert len(run_ids(engine, ids_of(150), max_tokens=3)) == 3


class PromptStack:
    """A decoder stack as the timing reads and runs it (tuning.TimedStack) without a model: each
    forward writes ones into its rows' slots of the layers it runs and advances a stand-in clock by
    `took_ms` of the way its causal_fn stands for (the dot products' function, else the native kernels)."""

    def __init__(self, num_blocks: int, positions: int, clock: list[float], took_ms: dict[str, float]):
        self.block_size, self.num_blocks, self.hkv, self.head_dim, self.hidden = BS, num_blocks, 1, 16, 8
        self.num_layers, self.cos = 3, torch.zeros(positions, 16)
        self.kv_layers = [(torch.zeros(num_blocks, BS, 1, 16), torch.zeros(num_blocks, BS, 1, 16)) for _ in range(3)]
        self.template_fn, self.causal_fn = 0, 7  # what the stack ran before timing
        self.clock, self.took_ms, self.runs = clock, took_ms, []

    def forward(self, x, plan):
        way = "dot" if self.causal_fn == onednn.causal_attend_fn() else "native"
        self.runs.append((way, self.num_layers, x.shape[0], plan.slots.tolist()))
        for k, v in self.kv_layers[:self.num_layers]:
            k.view(-1, 1, 16)[plan.slots] = 1.0
            v.view(-1, 1, 16)[plan.slots] = 1.0
        self.clock[0] += self.took_ms[way] / 1e3
        return x


@needs_lib
@pytest.mark.parametrize("dot_ms,kept", [(15.0, "dot"), (19.5, "native")])
def test_a_prompts_own_attention_is_timed_in_whole_blocks_and_the_stack_left_as_it_was(monkeypatch, dot_ms, kept):
    """measure_prompt_attention on a stack whose steps take a known time: a cache of exactly the
    shortest prompt timed (128 tokens) is timed on it, from slot 0 on, through the first
    TIMED_LAYERS layers alone, each way in every round; the way kept follows choose_prompt from those
    times; the stack's causal_fn and layer count are what they were and the blocks used are zero
    again. One block fewer, or fewer positions than a prompt, is not timed."""
    clock = [0.0]
    monkeypatch.setattr(tuning, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: clock[0])}))
    monkeypatch.setattr(tuning, "TIMED_LAYERS", 2)
    took = {"native": 20.0, "dot": dot_ms}
    stack = PromptStack(onednn.PROMPT_ATTENTION_MIN_TOKENS // BS, 512, clock, took)
    timing = tuning.measure_prompt_attention(stack)
    assert (timing.choice, timing.why) == ((kept, "75% of the native kernels' time") if kept == "dot" else
                                           (kept, "the dot products took 98% of the native time, not 95% or less"))
    assert timing.tokens == 128 and timing.ms == pytest.approx(took)
    assert sorted(way for way, *_ in stack.runs) == ["dot"] * (tuning.ROUNDS + 1) + ["native"] * (tuning.ROUNDS + 1)
    assert all((layers, rows, slots) == (2, 128, list(range(128))) for _, layers, rows, slots in stack.runs)
    assert (stack.causal_fn, stack.num_layers) == (7, 3)
    assert all(not k.any() and not v.any() for k, v in stack.kv_layers)
    for blocks, positions in ((128 // BS - 1, 512), (64, 127)):
        short = PromptStack(blocks, positions, clock, took)
        timing = tuning.measure_prompt_attention(short)
        assert timing.choice == "native" and not timing.ms and not short.runs
        assert timing.why.startswith(f"not timed: {blocks} blocks of {BS} tokens and {positions} positions")
    # positions for 130 tokens: a prompt of the whole blocks among them
    assert tuning.measure_prompt_attention(PromptStack(64, 130, clock, took)).tokens == 128


# --- a float32 model's linears: the native kernel, or oneDNN's inner product above a row count ---------

def f32_ms(native_ms, library_ms):
    """A Float32Timing.ms over the row counts 1, 16, 64, ... (as many as given)."""
    rows = tuning.FLOAT32_ROWS[:len(native_ms)]
    return {"native": dict(zip(rows, native_ms)), "inner_product": dict(zip(rows, library_ms))}


def test_the_float32_rule_takes_the_library_only_where_it_wins_at_every_larger_count():
    rows, why = tuning.choose_float32(f32_ms([1, 5, 10, 20, 40, 80], [2, 9, 11, 18, 33, 66]))
    assert rows == 64 and "90% of the native time at 128 rows" in why and "110% at 64" in why
    # a win at 64 rows that does not hold at 128 is not a crossover
    assert tuning.choose_float32(f32_ms([1, 5, 10, 20, 40, 80], [2, 9, 9, 21, 33, 66]))[0] == 128
    rows, why = tuning.choose_float32(f32_ms([1, 5, 10, 20, 40, 80], [2, 9, 11, 18, 33, 77]))
    assert rows is None and "96% of the native time at 512 rows, not 95% or less" in why
    rows, why = tuning.choose_float32(f32_ms([2, 5, 10, 20, 40, 80], [1, 4, 9, 18, 33, 66]))
    assert rows == 0 and "from 1 row(s) up" in why
    assert tuning.choose_float32(f32_ms([1, 5, 10, 20, 40, 80], [2, 9, 11, 18, 33, 77]), margin=0.02)[0] == 64


@needs_lib
def test_a_float32_stack_times_its_linears_once_and_runs_what_the_rule_picks(make_engine, monkeypatch, caplog):
    """PREFIX_SERVICE_F32_LINEAR=measure: a float32 model's first layers' linears are timed both ways
    when the stack is built; the choice follows choose_float32 from those timings, every layer's
    linears are built for it, the start-up line says so, and a second engine of the same shapes
    reuses the timings untimed."""
    monkeypatch.setenv(linear.FLOAT32_ENV, "measure")
    monkeypatch.setattr(tuning, "_FLOAT32_TIMINGS", {})
    engine = make_engine(backend="cpu")
    backend = engine._core.backend
    timing = backend.stack.float32_timing
    assert timing is not None and (timing.native_rows, timing.why) == tuning.choose_float32(timing.ms)
    assert set(timing.ms) == {"native", "inner_product"}
    assert all(sorted(t) == list(tuning.FLOAT32_ROWS) for t in timing.ms.values())
    want = {None: linear.NativeLinear, 0: onednn.OneDnnLinear}.get(timing.native_rows, linear.SplitLinear)
    for layer in backend.stack.layers:
        for m in (layer.qkv, layer.o, layer.gate_up, layer.down):
            assert type(m) is want and getattr(m, "native_rows", timing.native_rows) == timing.native_rows
    assert isinstance(backend.head, linear.NativeLinear)  # the head is not timed
    assert f"linears on {linear.float32_choice(timing.native_rows)}; timed: {timing.why}" in backend.describe()
    assert make_engine(backend="cpu")._core.backend.stack.float32_timing is timing


@needs_lib
def test_float32_timings_are_kept_per_thread_count(monkeypatch):
    """The crossover depends on how many threads share the work: weights of the same shapes are timed
    again under another torch thread count, and reuse the timing under the same one."""
    monkeypatch.setattr(tuning, "_FLOAT32_TIMINGS", {})
    monkeypatch.setattr(tuning, "FLOAT32_ROUNDS", 1)
    g = torch.Generator().manual_seed(3)
    layers = [[torch.randn(32, 16, generator=g), torch.randn(16, 32, generator=g)]]
    threads = torch.get_num_threads()
    other = 1 if threads > 1 else 2
    try:
        first = tuning.measure_float32_linears(layers)
        torch.set_num_threads(other)
        second = tuning.measure_float32_linears(layers)
        assert second is not first and tuning.measure_float32_linears(layers) is second
    finally:
        torch.set_num_threads(threads)
    assert tuning.measure_float32_linears(layers) is first


@needs_lib
def test_a_float32_inner_product_that_fails_keeps_the_native_kernel_and_says_why(monkeypatch, caplog):
    """oneDNN's inner product raising its error while the float32 linears are timed: the native kernel
    for every call (native_rows None), the error in `why` and in a warning, and nothing timed kept."""
    monkeypatch.setattr(tuning, "_FLOAT32_TIMINGS", {})
    monkeypatch.setattr(tuning, "FLOAT32_ROUNDS", 1)

    def refuse(self, x, out=None):
        raise onednn.OneDnnError("ps_onednn_linear: refused here")
    monkeypatch.setattr(onednn.OneDnnLinear, "__call__", refuse)
    g = torch.Generator().manual_seed(3)
    timing = tuning.measure_float32_linears([[torch.randn(32, 16, generator=g), torch.randn(16, 32, generator=g)]])
    assert (timing.native_rows, timing.ms) == (None, {})
    assert timing.why == "oneDNN's inner product failed: ps_onednn_linear: refused here"
    assert timing.summary().startswith(f"{linear.float32_choice(None)} (oneDNN's inner product failed")
    assert "float32 linears: oneDNN's inner product failed: ps_onednn_linear: refused here" in [
        r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


@needs_lib
@pytest.mark.parametrize("rows", [3, 0])
def test_a_float32_engine_on_split_or_library_linears_serves_the_native_engines_tokens(make_engine, monkeypatch,
                                                                                    rows):
    """A crossover the timing might pick (3 rows: a decode step's calls on the native kernel, a
    prefill's on oneDNN; 0: oneDNN for every call): the same greedy ids as the engine on the native
    kernel alone, on plain prompts and on a pinned template (float32's exact contract), and logits
    within float32 tolerance."""
    monkeypatch.setattr(tuning, "choose_float32", lambda ms, margin=0.0: (rows, "chosen by the test"))
    monkeypatch.setattr(tuning, "_FLOAT32_TIMINGS", {})
    monkeypatch.setenv(linear.FLOAT32_ENV, "measure")
    split = make_engine(backend="cpu")
    monkeypatch.setenv(linear.FLOAT32_ENV, "native")
    alone = make_engine(backend="cpu")
    layer = split._core.backend.stack.layers[0]
    assert type(layer.gate_up) is (linear.SplitLinear if rows else onednn.OneDnnLinear)
    assert type(alone._core.backend.stack.layers[0].gate_up) is linear.NativeLinear
    want = mixed_generate(alone)
    assert mixed_generate(split) == want
    ids = [(7 * i + 3) % 500 + 3 for i in range(37)]
    assert (engine_last_logits(split, ids) - engine_last_logits(alone, ids)).abs().max().item() <= 1e-4


@needs_lib
@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_a_float32_engine_splits_its_linears_by_default_only_on_avx2(make_engine, monkeypatch, isa):
    """Without PREFIX_SERVICE_F32_LINEAR: where the native kernel is built for AVX2 every layer's linears
    run it up to 128 rows and oneDNN's inner product above, and the start-up line says so; elsewhere
    the native kernel alone. Nothing is timed either way."""
    monkeypatch.delenv(linear.FLOAT32_ENV, raising=False)
    monkeypatch.delenv(linear.FLOAT32_ROWS_ENV, raising=False)
    monkeypatch.setattr(native, "isa", lambda: isa)
    backend = make_engine(backend="cpu")._core.backend
    assert backend.stack.float32_timing is None
    for layer in backend.stack.layers:
        for m in (layer.qkv, layer.o, layer.gate_up, layer.down):
            if isa == "avx2":
                assert type(m) is linear.SplitLinear and m.native_rows == 128
            else:
                assert type(m) is linear.NativeLinear
    want = "the native kernel up to 128 rows, oneDNN's inner product above" if isa == "avx2" else "the native kernel"
    assert backend.describe().endswith(f"linears on {want})")
