"""Sampler: one call per step for every row the step samples.

    logits [N, vocab] float32, the model's
      -> log-probabilities for the rows that asked for them (log-softmax of the model's logits,
         before anything below: what `logprobs` reports, whatever the sampling)
      -> per row that asks: logit_bias, repetition / presence / frequency penalties, min_tokens'
         mask of its stop tokens (SamplingParams.adjusts_logits)
      -> greedy: one argmax over the batch; temperature / top-k / top-p: per row, with the
         request's own generator, so a seeded request draws the same tokens whatever else is in
         the batch

Rows that ask for nothing pay nothing: the logits are copied only when some row adjusts them.
"""
from __future__ import annotations

from typing import Iterable

import torch

from prefix_service.engine.sequence import Sequence, TokenLogprob
from prefix_service.engine.structured import mask_rows


def sample(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: Iterable[int] = ()
           ) -> tuple[list[int], list[TokenLogprob | None]]:
    """-> (each row's token, each row's TokenLogprob or None). logits: [N, vocab], row i is seqs[i]'s;
    eos_token_ids: the model's, which min_tokens masks (with the request's stop_token_ids)."""
    want = [i for i, seq in enumerate(seqs) if seq.sampling.logprobs is not None]
    model_logprobs = torch.log_softmax(logits[want], dim=-1) if want else None  # [len(want), vocab]
    adjust = [i for i, seq in enumerate(seqs) if seq.sampling.adjusts_logits]
    constrained = [i for i, seq in enumerate(seqs) if seq.matcher is not None]
    if adjust or constrained:
        logits = logits.clone()
        eos = tuple(eos_token_ids)
        for i in adjust:
            _adjust_row(logits[i], seqs[i], eos)
        if constrained:  # every constrained row of the batch in one mask
            mask_rows(logits, constrained, [seqs[i].matcher for i in constrained])
    tokens = logits.argmax(dim=-1).tolist()
    for i, seq in enumerate(seqs):
        if not seq.sampling.greedy:
            tokens[i] = _sample_row(logits[i], seq)
    out: list[TokenLogprob | None] = [None] * len(seqs)
    for j, i in enumerate(want):
        assert model_logprobs is not None
        row, k = model_logprobs[j], seqs[i].sampling.logprobs
        top = row.topk(k) if k else None
        out[i] = TokenLogprob(tokens[i], float(row[tokens[i]]),
                              tuple(zip(top.indices.tolist(), top.values.tolist())) if top is not None else ())
    return tokens, out


def _adjust_row(logits: torch.Tensor, seq: Sequence, eos: tuple[int, ...]) -> None:
    # logits: [vocab], changed in place
    p = seq.sampling
    vocab, device = logits.shape[0], logits.device

    def ids(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)
    if p.repetition_penalty != 1.0:  # over the prompt and the output, as in the CTRL paper and vLLM
        seen = torch.unique(ids(seq.token_ids))
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if p.presence_penalty or p.frequency_penalty:  # over the output only, as OpenAI
        counts = torch.bincount(ids(seq.token_ids[seq.num_prompt_tokens:]), minlength=vocab)[:vocab].to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    if p.logit_bias:
        logits.index_add_(0, ids([t for t, _ in p.logit_bias]),
                          torch.tensor([b for _, b in p.logit_bias], dtype=logits.dtype, device=device))
    if seq.num_output_tokens < p.min_tokens:
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos))
        if stops:
            logits[ids(sorted(stops))] = float("-inf")


def _sample_row(logits: torch.Tensor, seq: Sequence) -> int:
    # logits: [vocab]
    p = seq.sampling
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= p.top_p  # mass before this token already reaches top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(0, order, sorted_logits)
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=seq.generator).item())
