"""Sampler: one call per step for every row the step samples.

    logits [N, vocab] float32, the model's
      -> log-probabilities for the rows that asked for them (log-softmax of the model's logits,
         before anything below: what `logprobs` reports, whatever the sampling)
      -> per row that asks: logit_bias, repetition / presence / frequency penalties, min_tokens'
         mask of its stop tokens (SamplingParams.adjusts_logits)
      -> greedy: one argmax over the batch; temperature / top-k / top-p: the sampled rows together
         (scaled, cut to their top-k and top-p, inverse-CDF draws), each from one uniform of the
         request's own generator, so a seeded request draws the same tokens whatever else is in
         the batch, and the host waits for the device once a step, not once a row

Rows that ask for nothing pay nothing: the logits are copied only when some row adjusts them.
"""
from __future__ import annotations

from typing import Iterable

import torch

from prefix_service.backends.base import TORCH_SAMPLER_OPS, SamplerOps
from prefix_service.engine.sequence import Sequence, TokenLogprob
from prefix_service.engine.structured import mask_rows
from prefix_service.sampling_params import SamplingParams


def uniforms(seqs: list[Sequence]) -> list[float | None]:
    """This step's uniform of each row that is drawn (None for a greedy row), from its sequence's
    generator: one a row a step, taken before anything else of the step's sampling can fail, so that
    a step sampled again row by row (EngineCore._sample) draws the same tokens."""
    return [None if seq.sampling.greedy else _uniform(seq) for seq in seqs]


def sample(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: Iterable[int] = (),
           ops: SamplerOps = TORCH_SAMPLER_OPS, drawn_uniforms: list[float | None] | None = None
           ) -> tuple[list[int], list[TokenLogprob | None]]:
    """-> (each row's token, each row's TokenLogprob or None). logits: [N, vocab], row i is seqs[i]'s;
    eos_token_ids: the model's, which min_tokens masks (with the request's stop_token_ids); ops: the
    backend's passes over its logits (Backend.sampler_ops); drawn_uniforms: uniforms(seqs), taken
    here when not given."""
    if drawn_uniforms is None:
        drawn_uniforms = uniforms(seqs)
    want = [i for i, seq in enumerate(seqs) if seq.sampling.logprobs is not None]
    raw = _rows(logits, want).float() if want else None  # the model's logits of those rows, before any adjustment
    adjust = [i for i, seq in enumerate(seqs) if seq.sampling.adjusts_logits]
    constrained = [i for i, seq in enumerate(seqs) if seq.matcher is not None]
    if adjust or constrained:
        model = logits  # the model's, left as they are
        logits = logits.clone(memory_format=torch.contiguous_format)
        if adjust:
            adjust_logits(logits, adjust, seqs, tuple(eos_token_ids))
        if constrained:  # every constrained row of the batch in one mask
            mask_rows(logits, constrained, [seqs[i].matcher for i in constrained])
            # a constrained row still short of min_tokens: the constraint may allow only stop tokens
            held = [i for i in constrained if seqs[i].num_output_tokens < seqs[i].sampling.min_tokens]
            if held:
                _let_the_constraint_win(logits, held, model, seqs)
    tokens = [0] * len(seqs)
    greedy = [i for i, seq in enumerate(seqs) if seq.sampling.greedy]
    drawn = [i for i, seq in enumerate(seqs) if not seq.sampling.greedy]
    if greedy:  # their argmax only
        for i, token in zip(greedy, first_argmax(_rows(logits, greedy)).tolist()):
            tokens[i] = token
    if drawn:
        for i, token in zip(drawn, draw(logits, drawn, seqs, ops, [drawn_uniforms[i] for i in drawn])):
            tokens[i] = token
    out: list[TokenLogprob | None] = [None] * len(seqs)
    if raw is not None:
        for i, lp in zip(want, token_logprobs(raw, [tokens[i] for i in want],
                                              [seqs[i].sampling.logprobs or 0 for i in want], ops)):
            out[i] = lp
    return tokens, out


def token_logprobs(raw: torch.Tensor, tokens: list[int], alternatives: list[int],
                   ops: SamplerOps = TORCH_SAMPLER_OPS) -> list[TokenLogprob]:
    """Each row's token's log-probability under the model's logits raw [N, vocab] (float32, before any
    adjustment), and its alternatives[i] most likely tokens. Every row's at once: the host reads the
    device twice, not twice a row."""
    # log-probabilities as the log-softmax gives them, x - log(sum(e^x)), read where needed only
    norm = ops.logsumexp(raw).unsqueeze(1)
    picked = torch.tensor(tokens, dtype=torch.int64, device=raw.device).unsqueeze(1)
    chosen = (raw.gather(1, picked) - norm).squeeze(1).tolist()
    most = max(alternatives, default=0)
    values, ids = ops.top_k(raw, most) if most else (raw[:, :0], picked[:, :0])
    values_l, ids_l = (values - norm).tolist(), ids.tolist()
    return [TokenLogprob(t, chosen[j], tuple(zip(ids_l[j][:k], values_l[j][:k])))
            for j, (t, k) in enumerate(zip(tokens, alternatives))]


def adjust_logits(logits: torch.Tensor, rows: list[int], seqs: list[Sequence], eos: tuple[int, ...], *,
                  hold_stops: bool = True) -> None:
    """The adjustments `rows` ask for (seqs[i] row i's sequence), each over all of those rows at once,
    in place on logits [N, vocab] (contiguous), in vLLM's order: logit_bias added; repetition penalty
    over the prompt and the output, as in the CTRL paper and vLLM (a seen token's positive logit
    divided by it, a negative one multiplied); presence and frequency penalties over the output
    only, as OpenAI; until min_tokens, the stop tokens masked (unless hold_stops is false). Each
    touches only the tokens it names, by their flat index row * vocab + token."""
    vocab, device = logits.shape[-1], logits.device
    flat = logits.view(-1)
    params = [seqs[i].sampling for i in rows]

    def flat_ids(tokens: list[torch.Tensor], on: list[int]) -> torch.Tensor:
        parts = [t + i * vocab for i, t in zip(on, tokens)]
        return torch.cat(parts).to(device) if parts else torch.zeros(0, dtype=torch.int64, device=device)

    def per_row(values: dict[int, float], at: torch.Tensor) -> torch.Tensor:
        # each flat index's row's value, float32 (what the logits hold)
        table = torch.zeros(logits.shape[0], dtype=torch.float32)
        table[list(values)] = torch.tensor(list(values.values()), dtype=torch.float32)
        return table.to(device)[at // vocab]

    biased = [i for i, p in zip(rows, params) if p.logit_bias]
    if biased:
        at = flat_ids([torch.tensor([t for t, _ in seqs[i].sampling.logit_bias], dtype=torch.int64) for i in biased],
                      biased)
        bias = [b for i in biased for _, b in seqs[i].sampling.logit_bias]
        flat.index_add_(0, at, torch.tensor(bias, dtype=logits.dtype).to(device))
    repeat = {i: p.repetition_penalty for i, p in zip(rows, params) if p.repetition_penalty != 1.0}
    if repeat:
        # a token seen twice is written twice with the same value, made from the logit before either
        history = [seqs[i].ids_tensor() for i in repeat]
        seen = flat_ids(history, list(repeat))
        penalty = torch.repeat_interleave(torch.tensor(list(repeat.values()), dtype=torch.float32),
                                          torch.tensor([len(h) for h in history])).to(device)  # each index's row's
        vals = flat.gather(0, seen)
        flat.scatter_(0, seen, torch.where(vals > 0, vals / penalty, vals * penalty))
    counted = [i for i, p in zip(rows, params) if p.presence_penalty or p.frequency_penalty]
    if counted:
        out, counts = torch.unique(flat_ids([seqs[i].ids_tensor(seqs[i].num_prompt_tokens) for i in counted], counted),
                                   return_counts=True)
        frequency = per_row({i: seqs[i].sampling.frequency_penalty for i in counted}, out)
        presence = per_row({i: seqs[i].sampling.presence_penalty for i in counted}, out)
        flat[out] -= frequency * counts.to(torch.float32) + presence
    held = [i for i, p in zip(rows, params) if hold_stops and seqs[i].num_output_tokens < p.min_tokens]
    stops = [sorted(set(seqs[i].sampling.stop_token_ids) | (set() if seqs[i].sampling.ignore_eos else set(eos)))
             for i in held]
    if any(stops):
        flat[flat_ids([torch.tensor(t, dtype=torch.int64) for t in stops], held)] = float("-inf")


def _let_the_constraint_win(logits: torch.Tensor, held: list[int], model: torch.Tensor, seqs: list[Sequence]
                            ) -> None:
    """Rows of `held` (constrained, short of min_tokens) where min_tokens' mask left no token the
    constraint allows: adjusted again from the model's logits without that mask, so the constraint's
    stop token or end wins over min_tokens (the output must conform), rather than a draw from a row
    of -inf."""
    starved = [j for j, top in enumerate(_rows(logits, held).amax(dim=1).tolist()) if top == float("-inf")]
    if not starved:
        return
    rows = [held[j] for j in starved]
    again = model[rows]  # a contiguous copy of those rows
    adjust_logits(again, list(range(len(rows))), [seqs[i] for i in rows], (), hold_stops=False)
    mask_rows(again, list(range(len(rows))), [seqs[i].matcher for i in rows])
    logits[torch.tensor(rows, dtype=torch.int64, device=logits.device)] = again


# a top-p row (without top-k) is cut among its this many most likely tokens, the next count where
# they hold less than its top_p of the probability, then its whole vocabulary
TOP_P_CANDIDATES = (64, 256, 1024, 2048, 8192)


def _uniform(seq: Sequence) -> float:
    """The next uniform in [0, 1) of a sampled sequence's generator (EngineCore._generator)."""
    if seq.generator is None:
        raise AssertionError(f"{seq.request_id}: a sampled sequence without a generator")
    return float(seq.generator.random())


def draw(logits: torch.Tensor, rows: list[int], seqs: list[Sequence], ops: SamplerOps = TORCH_SAMPLER_OPS,
         row_uniforms: list[float | None] | None = None) -> list[int]:
    """A token for each of logits' `rows` (seqs[i] row i's sequence, not greedy): the logits over
    its temperature; where it has a top_k, only its k most likely tokens (ties at the k-th broken
    by index); where it has a top_p, only the most likely tokens until the probability before one
    reaches top_p (after top_k); then the row's uniform (row_uniforms[j] for rows[j], else the next
    of the sequence's generator) picks a token by the inverse of the kept probabilities' cumulative
    sum (in float64)."""
    device, vocab = logits.device, logits.shape[-1]
    params = [seqs[i].sampling for i in rows]
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
    # one uniform a row from its own generator, on the host (EngineCore._generator), then one copy
    if row_uniforms is None:
        row_uniforms = [_uniform(seqs[i]) for i in rows]
    uniform = torch.tensor(row_uniforms, dtype=torch.float64).to(device)
    tokens = torch.empty(len(rows), dtype=torch.int64, device=device)
    whole = [j for j, p in enumerate(params) if not 0 < p.top_k < vocab and p.top_p >= 1.0]
    cut = [j for j, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1.0]

    def scaled(x: torch.Tensor, some: list[int]) -> torch.Tensor:  # rows x over their temperatures, a new tensor
        return x.float() / temperature[some].unsqueeze(1)

    if whole:
        x = _rows(logits, [rows[j] for j in whole])
        picked = ops.softmax_draw(x, temperature[whole], uniform[whole])
        tokens[whole] = picked if picked is not None else _inverse_cdf(scaled(x, whole).softmax(-1), uniform[whole])
    if cut:
        tokens[cut] = _draw_cut(scaled(_rows(logits, [rows[j] for j in cut]), cut), [params[j] for j in cut],
                                uniform[cut], ops)
    return tokens.tolist()


ARGMAX_BLOCK = 1024  # first_argmax's block of a row


def first_argmax(rows: torch.Tensor) -> torch.Tensor:
    """rows.argmax(-1) for rows [N, V]: the first index of each row's largest value (NaN the
    largest, as torch's). On a CPU, torch's argmax takes about ten times its amax's time (2.6 ms
    against 0.1 for 64 rows of 49,152 logits), so there each row's blocks of ARGMAX_BLOCK are
    reduced to their maxima first (a vocabulary's tail short of a block is one more), the first
    block that holds the row's largest is found, and its argmax taken: the same index."""
    n, v = rows.shape
    b = ARGMAX_BLOCK
    if rows.device.type != "cpu" or v < 2 * b or n == 0:
        return rows.argmax(dim=-1)
    rows = rows.contiguous()
    full = v // b * b
    maxima = rows.as_strided((n, full // b, b), (v, b, 1)).amax(-1)  # [N, blocks]
    if full < v:
        maxima = torch.cat([maxima, rows[:, full:].amax(-1, keepdim=True)], dim=1)
    start = maxima.argmax(dim=-1) * b  # the first block holding the row's largest
    # the block's indices; a short tail block repeats its last one, which cannot come first
    index = (start.unsqueeze(1) + torch.arange(b, dtype=start.dtype)).clamp_(max=v - 1)
    return start + rows.gather(1, index).argmax(dim=-1)


def _rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t's rows `rows` (increasing): t itself where they are all of them, else a gathered copy."""
    return t if len(rows) == t.shape[0] else t[rows]


def _inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row of probs [R, C] (not normalised; some positive, none negative), the first index whose
    cumulative sum passes uniform (in [0, 1)) times the row's total: index j with probability
    probs[j] / total. The sums go over blocks of up to 256 first (float32 within a block, float64
    across), then within the one block picked (float64), so a row costs about one pass over it; a
    pick of a token of probability 0 (a sum's rounding at a block's end, about 1e-7 of draws) falls
    back to the row's most likely token."""
    rows, width = probs.shape
    block = next((b for b in (256, 128, 64, 32, 16) if width % b == 0), width)
    sums = probs.view(rows, width // block, block).sum(-1).double()  # [R, blocks]
    ends = sums.cumsum(-1)
    target = (uniform * ends[:, -1]).unsqueeze(1)
    picked = torch.searchsorted(ends, target, right=True).clamp_(max=width // block - 1)  # [R, 1]
    rest = target - (ends.gather(1, picked) - sums.gather(1, picked))  # how far into the block
    start = picked * block
    within = probs.gather(1, start + torch.arange(block, device=probs.device)).double().cumsum(-1)
    index = (start + torch.searchsorted(within, rest, right=True).clamp_(max=block - 1)).squeeze(1)
    zero = probs.gather(1, index.unsqueeze(1)).squeeze(1) <= 0
    if bool(zero.any()):
        index = torch.where(zero, probs.argmax(-1), index)
    return index


def _draw_cut(scaled: torch.Tensor, params: list[SamplingParams], uniform: torch.Tensor, ops: SamplerOps
              ) -> torch.Tensor:
    """draw() for rows [R, vocab] with a top_k or a top_p: among their most likely tokens, sorted."""
    device, vocab = scaled.device, scaled.shape[-1]
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    top_p = torch.tensor([p.top_p if p.top_p < 1.0 else float("inf") for p in params], device=device)
    no_k = torch.tensor([k == 0 for k in ks], device=device)
    # the candidates: the largest top_k, at least TOP_P_CANDIDATES[0]; rows with only a top_p whose
    # nucleus is wider than that go on to the next width, the last the whole vocabulary, sorted
    width = min(vocab, max(max(ks), TOP_P_CANDIDATES[0]))
    # the log-normaliser over the whole vocabulary of the rows without a top_k, once for every width
    whole = ops.logsumexp(scaled) if 0 in ks else None
    probs, index = _nucleus(scaled, width, ks, no_k, top_p, whole, ops)
    picked = index.gather(1, _inverse_cdf(probs, uniform).unsqueeze(1)).squeeze(1)
    rows = torch.arange(len(params), device=device)
    for wider in [w for w in TOP_P_CANDIDATES[1:] if w > width] + [vocab]:
        short = no_k[rows] & (probs.sum(-1) < top_p[rows])  # a nucleus past the candidates
        if width >= vocab or not bool(short.any()):
            break
        rows, width = rows[short], min(wider, vocab)
        probs, index = _nucleus(scaled[rows], width, [0] * len(rows), no_k[rows], top_p[rows],
                                None if whole is None else whole[rows], ops)
        picked[rows] = index.gather(1, _inverse_cdf(probs, uniform[rows]).unsqueeze(1)).squeeze(1)
    return picked


def _nucleus(scaled: torch.Tensor, width: int, ks: list[int], no_k: torch.Tensor, top_p: torch.Tensor,
             whole: torch.Tensor | None, ops: SamplerOps) -> tuple[torch.Tensor, torch.Tensor]:
    """The `width` most likely tokens of each row [R, vocab], sorted (their ids [R, width]), and
    their probabilities, 0 past the row's k (ks[r], 0: none) and past its nucleus: the probability
    before a token reaching top_p[r]. A row with a top_k has its probabilities over its k tokens; one
    without, over its whole vocabulary, so that they sum to less than top_p where the nucleus is
    wider than `width` (whole: each row's log-normaliser over its vocabulary, where some row has no
    top_k)."""
    values, index = ops.top_k(scaled, width)  # sorted, largest first
    limit = torch.tensor([k or width for k in ks], device=scaled.device).unsqueeze(1)
    values = values.masked_fill(torch.arange(width, device=scaled.device) >= limit, float("-inf"))
    total = values.logsumexp(-1)  # log of each row's normaliser
    if whole is not None:
        total = torch.where(no_k, whole, total)
    probs = (values - total.unsqueeze(1)).exp()
    before = probs.cumsum(-1) - probs
    return probs.masked_fill(before >= top_p.unsqueeze(1), 0.0), index
