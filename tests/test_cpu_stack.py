"""The cpu backend's decoder stack (backends/cpu/stack.py): all layers of a forward in one native
call give, bit for bit, the hidden states and cache of the same kernels called one by one from
Python (the linear layers, elementwise.add_rms_norm and native_harness.py's wrappers, in the C++
loop's order), on every step of a mixed engine workload: decodes and prefills, on a packed template or not, chunked, in one step.
A step's plan lists its decodes, then its prefills, each with its packed template or none.
Bad input is refused with nothing written; the copy-on-write copies blocks in every layer; the
kernel timers observe the served path without changing it."""
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from helpers import generate_together, greedy, mixed_generate
from native_harness import Rotation, decode_attention, head_rms_norm, prefill_attention, silu_mul
from prefix_service import GenerateRequest
from prefix_service.backends.base import StepTensors
from prefix_service.backends.cpu import native
from prefix_service.backends.cpu import linear as linear_mod
from prefix_service.backends.cpu import stack as stack_mod
from prefix_service.backends.cpu.elementwise import add_rms_norm
from prefix_service.backends.cpu.native import NativeKernelError
from prefix_service.backends.cpu.plan import StackPlan
from prefix_service.backends.cpu.stack import DecoderStack
from prefix_service.bench.profiling import kernel_times
from prefix_service.engine.step import ScheduledRow, StepBatch
from prefix_service.model.loader import load_model

REASON = native.load()[1]
needs_native = pytest.mark.skipif(REASON is not None, reason=f"no native CPU kernels here: {REASON}")
BS = 4


def kernel_by_kernel(stack: DecoderStack, x: torch.Tensor, plan: StackPlan, templates: list,
                     round_kv: bool = False) -> torch.Tensor:
    """What ps_decoder_stack does, one wrapper call per kernel: x (the residual stream) updated in
    place, the caches written, the last layer's MLP output returned. templates: per sequence of the
    plan (decodes, then prefills), its PackedTemplate or None. round_kv: the new K and V rounded to
    bfloat16 precision after the rotation, as the stack does over a bfloat16 cache."""
    t = x.shape[0]
    hq, hkv, d = stack.hq, stack.hkv, stack.head_dim
    q_size, kv_size = hq * d, hkv * d
    rotate = Rotation(plan.positions, stack.cos, stack.sin)
    nd = plan.num_decodes
    slots = plan.slots
    pending = None
    for index, (w, (k_cache, v_cache)) in enumerate(zip(stack.layers, stack.kv_layers)):
        h = add_rms_norm(x, pending, w.input_norm, w.input_eps)
        qkv = w.qkv(h)
        if w.q_norm is not None:  # Qwen3
            head_rms_norm(qkv[:, :q_size].view(t, hq, d), w.q_norm, w.qk_eps)
            head_rms_norm(qkv[:, q_size:q_size + kv_size].view(t, hkv, d), w.k_norm, w.qk_eps)
        rotate(qkv[:, :q_size + kv_size].view(t, hq + hkv, d))
        if round_kv:
            kv = qkv[:, q_size:]
            kv.copy_(kv.bfloat16().float())
        q = qkv[:, :q_size].view(t, hq, d)
        k = qkv[:, q_size:q_size + kv_size].view(t, hkv, d)
        v = qkv[:, q_size + kv_size:].view(t, hkv, d)
        attn = torch.empty(t, hq, d)
        if nd:
            layer_templates = [p.layer(index) if p is not None else None for p in templates[:nd]]
            decode_attention(q[:nd], k_cache, v_cache, plan.decode_tables, plan.decode_context, stack.scale,
                             out=attn[:nd], templates=layer_templates if any(layer_templates) else None,
                             new_kv=(k[:nd], v[:nd], slots[:nd]))
        start = nd
        for i, (q_len, ctx, first) in enumerate(plan.prefill_info.tolist()):
            end = start + q_len
            packed = templates[nd + i]
            prefill_attention(q[start:end], k[start:end], v[start:end], stack.scale, out=attn[start:end],
                              template=packed.layer(index) if packed is not None else None, cache=(k_cache, v_cache),
                              block_table=plan.prefill_tables[i], cached=(first, ctx - first), slots=slots[start:end])
            start = end
        o = w.o(attn.view(t, q_size))
        h = add_rms_norm(x, o, w.post_norm, w.post_eps)
        pending = w.down(silu_mul(w.gate_up(h)))
    return pending


def templates_of(plan: StackPlan, packed_templates) -> list:
    """The PackedTemplate of each sequence of the plan, found by the pointers the plan holds."""
    if plan.templates is None:
        return [None] * (plan.num_decodes + plan.prefill_info.shape[0])
    by_pointer = {int(p.pointers[0, 0]): p for p in packed_templates}
    return [by_pointer.get(int(row[0, 0])) for row in plan.templates]


def check_mixed_workload(engine, monkeypatch, round_kv: bool = False) -> list[bool]:
    """Every step of a mixed workload on `engine` (a pinned template with a packed copy, requests on
    it and plain ones, prefills chunked beside decodes) runs kernel by kernel first (round_kv: with
    the new K/V rounded to bf16 after the rotation), from a copy of the cache, then through the
    stack: the same hidden states and cache, bit for bit. Returns, per step, whether the kernel by
    kernel forward without the rounding differs from the one checked (all False unless round_kv)."""
    seen, unrounded_differs = [], []
    real = DecoderStack.forward
    backend = engine._core.backend
    assert backend.name == "cpu"

    def checked(self, x, plan):
        before = [(k.clone(), v.clone()) for k, v in self.kv_layers]

        def restore():
            for (k, v), (k0, v0) in zip(self.kv_layers, before):
                k.copy_(k0)
                v.copy_(v0)
        templates = templates_of(plan, backend.templates.values())
        unrounded = None
        if round_kv:
            unrounded = kernel_by_kernel(self, x.clone(), plan, templates).clone()
            restore()
        x_ref = x.clone()
        want = kernel_by_kernel(self, x_ref, plan, templates, round_kv=round_kv)
        after = [(k.clone(), v.clone()) for k, v in self.kv_layers]
        restore()
        got = real(self, x, plan)
        assert torch.equal(got, want) and torch.equal(x, x_ref)
        for (k, v), (k1, v1) in zip(self.kv_layers, after):
            assert torch.equal(k, k1) and torch.equal(v, v1)
        unrounded_differs.append(unrounded is not None and not torch.equal(unrounded, want))
        nd = plan.num_decodes
        seen.append((nd, sum(p is not None for p in templates[:nd]),
                     [(q, c, f > 0) for q, c, f in plan.prefill_info.tolist()]))
        return got
    monkeypatch.setattr(DecoderStack, "forward", checked)
    engine.add_template("tpl", token_ids=[(3 * i + 7) % 500 + 3 for i in range(22)])  # 5 full blocks + 2
    prompts = [[(5 * i + k) % 500 + 3 for i in range(2 + 7 * k)] for k in range(4)]
    batch = [GenerateRequest(prompt_token_ids=p, prefix_name="tpl" if k % 2 == 0 else None, sampling=greedy(6))
             for k, p in enumerate(prompts)] + [GenerateRequest(prompt_token_ids=p, prefix_name="tpl",
                                                                sampling=greedy(5)) for p in prompts[1::2]]
    outs = generate_together(engine, batch)
    assert all(len(ids) in (5, 6) for ids in outs)
    assert any(nd and pre for nd, _, pre in seen)  # decodes and prefills in one step
    assert any(t for _, t, _ in seen)  # decodes on the packed template
    assert any(p for _, _, pre in seen for _, _, p in pre)  # prefills on it
    assert any(c > 0 and not p for _, _, pre in seen for _, c, p in pre)  # a chunk after cached context
    return unrounded_differs


@needs_native
@pytest.mark.parametrize("which", ["llama", "qwen2", "mistral", "qwen3"])
def test_stack_gives_the_kernel_by_kernel_forward_bit_for_bit(make_engine, model_dirs, which, monkeypatch):
    """Every step of a mixed workload (check_mixed_workload) runs kernel by kernel first, from a
    copy of the cache, then through the stack: the same hidden states and cache, bit for bit."""
    check_mixed_workload(make_engine(model_dirs[which], num_blocks=160, max_num_batched_tokens=24), monkeypatch)


def bound_stack(model_dir, num_blocks: int = 6, fill=torch.zeros):
    model = load_model(model_dir, torch.float32, torch.device("cpu"), max_positions=64)
    arch = model.arch
    caches = [(fill(num_blocks, BS, arch.num_kv_heads, arch.head_dim), fill(num_blocks, BS, arch.num_kv_heads,
                                                                              arch.head_dim))
              for _ in model.layers]
    embed = model.embed_tokens.weight.detach().clone()
    return DecoderStack(model, caches), caches, embed


def prefill_plan(n: int, blocks: list[int]) -> StackPlan:
    """One prefill of n tokens from position 0 into `blocks`."""
    return StackPlan(slots=torch.tensor([blocks[p // BS] * BS + p % BS for p in range(n)]), positions=torch.arange(n),
                     num_decodes=0, decode_tables=torch.zeros(0, 0, dtype=torch.int32),
                     decode_context=torch.zeros(0, dtype=torch.int32), decode_skip=None,
                     prefill_info=torch.tensor([[n, 0, 0]], dtype=torch.int32),
                     prefill_tables=torch.tensor([blocks], dtype=torch.int32), templates=None)


@needs_native
def test_stack_releases_the_models_linear_weights(llama_dir):
    model = load_model(llama_dir, torch.float32, torch.device("cpu"), max_positions=64)
    arch = model.arch
    caches = [(torch.zeros(4, BS, arch.num_kv_heads, arch.head_dim),) * 2 for _ in model.layers]
    stack = DecoderStack(model, caches)
    assert all(layer.self_attn.qkv_proj.weight is None and layer.mlp.down_proj.weight is None
               for layer in model.layers)
    assert len(stack.layers) == arch.num_layers and stack.weights.shape == (arch.num_layers, 8)


def test_a_steps_plan_lists_decodes_then_prefills_each_with_its_packed_template_or_none():
    """StackPlan.build on a step of two decodes and three prefills, some continuing a packed template
    (stood in for: its pointers for each of 2 layers, 8 tokens in 2 blocks): the decodes' tables,
    context lengths and blocks read from the template (decode_skip, 0 for a decode without one);
    each prefill's new tokens, cached tokens and, of those, the template's packed ones; the prefills'
    tables; each row's template pointers, decodes first, zeros for a row without one. Where no decode
    continues a template there is no decode_skip, where no row does no pointers, and a step of
    decodes alone has an empty [0, 3] prefill_info."""
    template = SimpleNamespace(pointers=torch.tensor([[11, 12, 13], [21, 22, 23]]), num_tokens=8, num_blocks=2)
    rows = (ScheduledRow("d0", True, (5,), 9, (1, 2, 3), template_id=1, num_template_blocks=2),
            ScheduledRow("d1", True, (6,), 2, (7,)),
            ScheduledRow("p0", False, (1, 2, 3), 8, (1, 2, 4), template_id=1, num_template_blocks=2),
            ScheduledRow("p1", False, (4, 5), 0, (8,)),
            ScheduledRow("p2", False, (6,), 10, (1, 2, 9), template_id=1, num_template_blocks=2))

    def plan_of(*chosen):
        step = StepBatch(chosen)
        host = StepTensors.build(step, BS)
        plan = StackPlan.build(step, host, 2, lambda row: template if row.template_id is not None else None)
        assert torch.equal(plan.slots, host.slots) and torch.equal(plan.positions, host.positions)
        return plan
    plan = plan_of(*rows)
    assert plan.num_decodes == 2
    assert plan.decode_tables.tolist() == [[1, 2, 3], [7, -1, -1]] and plan.decode_context.tolist() == [10, 3]
    assert plan.decode_skip.dtype == torch.int32 and plan.decode_skip.tolist() == [2, 0]
    assert plan.prefill_info.dtype == torch.int32 and plan.prefill_info.tolist() == [[3, 8, 8], [2, 0, 0], [1, 10, 8]]
    assert plan.prefill_tables.tolist() == [[1, 2, 4], [8, -1, -1], [1, 2, 9]]
    none, packed = [[0, 0, 0]] * 2, template.pointers.tolist()
    assert plan.templates.dtype == torch.int64 and plan.templates.tolist() == [packed, none, packed, none, packed]
    plan = plan_of(rows[1], *rows[2:])  # the template's rows all prefills
    assert plan.decode_skip is None and plan.templates.tolist() == [none, packed, none, packed]
    plan = plan_of(rows[1], rows[3])
    assert plan.decode_skip is None and plan.templates is None and plan.prefill_info.tolist() == [[2, 0, 0]]
    plan = plan_of(*rows[:2])
    assert plan.prefill_info.shape == (0, 3) and plan.prefill_tables.shape[0] == 0
    assert plan.decode_skip.tolist() == [2, 0] and plan.templates.tolist() == [packed, none]


@needs_native
def test_stack_refuses_bad_input_and_leaves_the_cache(llama_dir):
    with pytest.raises(NativeKernelError, match="KV caches for"):
        model = load_model(llama_dir, torch.float32, torch.device("cpu"), max_positions=64)
        DecoderStack(model, [(torch.zeros(6, BS, 2, 16),) * 2])
    with pytest.raises(NativeKernelError, match="the KV cache"):
        bound_stack(llama_dir, fill=lambda *shape: torch.zeros(*shape, dtype=torch.float64))
    stack, caches, embed = bound_stack(llama_dir)
    n = 9
    plan = prefill_plan(n, [0, 1, 2])
    x = embed[3:3 + n].clone()
    with pytest.raises(NativeKernelError, match="for 9 rows"):
        stack.forward(x.clone(), dataclasses.replace(plan, slots=torch.arange(n - 1)))
    with pytest.raises(NativeKernelError, match="x: contiguous float32"):
        stack.forward(x.double(), plan)
    with pytest.raises(NativeKernelError, match="rotary tables"):
        stack.forward(x.clone(), dataclasses.replace(plan, positions=torch.arange(n) + 60))
    outside = plan.slots.clone()
    outside[4] = 6 * BS  # one past the cache
    with pytest.raises(NativeKernelError, match="status 4"):
        stack.forward(x.clone(), dataclasses.replace(plan, slots=outside))
    assert all(not k.any() and not v.any() for k, v in caches)  # nothing written
    good = stack.forward(x.clone(), plan)
    assert good.shape == (n, stack.hidden) and all(k.any() and v.any() for k, v in caches)


@needs_native
def test_stack_copies_blocks_in_every_layer(llama_dir):
    """The copy-on-write of a template's partial last block: one native call for all layers, the
    same as copying block by block; bad pairs are refused with nothing copied."""
    stack, caches, _ = bound_stack(llama_dir, num_blocks=7, fill=torch.randn)
    want = [(k.clone(), v.clone()) for k, v in caches]
    for k, v in want:
        for src, dst in ((2, 5), (3, 0)):
            k[dst], v[dst] = k[src], v[src]
    stack.copy_blocks([(2, 5), (3, 0)])
    for (k, v), (k0, v0) in zip(caches, want):
        assert torch.equal(k, k0) and torch.equal(v, v0)
    with pytest.raises(NativeKernelError, match="status 4"):
        stack.copy_blocks([(1, 6), (2, 7)])  # block 7: outside the cache
    with pytest.raises(NativeKernelError, match="distinct"):
        stack.copy_blocks([(1, 4), (2, 4)])
    with pytest.raises(NativeKernelError, match="distinct"):
        stack.copy_blocks([(1, 4), (4, 6)])
    for (k, v), (k0, v0) in zip(caches, want):
        assert torch.equal(k, k0) and torch.equal(v, v0)


@needs_native
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kernel_timers_observe_the_served_path(make_engine, dtype):
    """kernel_times() times the stack's own kernel calls (linear, attention, element-wise) while it
    serves, in either dtype (bfloat16: oneDNN's linears): the same tokens with and without timing,
    and nothing counted once it is off."""
    if dtype == "bfloat16" and linear_mod.available(torch.bfloat16) is not None:
        pytest.skip(f"no bfloat16 linears here: {linear_mod.available(torch.bfloat16)}")
    engine = make_engine(dtype=dtype)
    want = mixed_generate(engine)
    backend = engine._core.backend

    def timed(core):
        with kernel_times(backend) as times:
            pass
        return times
    assert engine._run(timed) == {"linear": 0.0, "attention": 0.0, "elementwise": 0.0}
    holder = {}

    def start(core):
        holder["cm"] = kernel_times(backend)
        holder["times"] = holder["cm"].__enter__()
    engine._run(start)
    got = mixed_generate(engine)
    engine._run(lambda core: holder["cm"].__exit__(None, None, None))
    times = holder["times"]
    assert got == want
    assert times["linear"] > 0 and times["attention"] > 0 and times["elementwise"] > 0
    assert stack_mod.kernel_timers(False) == {"linear": 0.0, "attention": 0.0, "elementwise": 0.0}


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_linear_called_from_python_is_timed_as_a_linear(dtype):
    """The output head runs outside the stack, from Python: its time counts as linear, whichever
    library computes it (float32: the native kernel; bfloat16: oneDNN), and as nothing else."""
    if linear_mod.available(dtype) is not None:
        pytest.skip(f"no {dtype} linears here: {linear_mod.available(dtype)}")
    gen = torch.Generator().manual_seed(3)
    head = linear_mod.make_linear(torch.randn(4096, 256, generator=gen).to(dtype))
    x = torch.randn(8, 256, generator=gen)
    stack_mod.kernel_timers(True)
    try:
        got = head(x)
    finally:
        times = stack_mod.kernel_timers(False)
    assert times["linear"] > 0 and times["attention"] == 0 and times["elementwise"] == 0
    assert torch.equal(head(x), got)  # untimed, the same numbers
