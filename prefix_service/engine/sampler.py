"""Sampler: greedy for the whole batch in one argmax; temperature / top-k / top-p per sequence with
its own generator, so a seeded request draws the same tokens whatever else is in the batch."""
from __future__ import annotations

import torch

from prefix_service.engine.sequence import Sequence


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    # logits: [N, vocab] float32, row i belongs to seqs[i]
    tokens = logits.argmax(dim=-1).tolist()
    for i, seq in enumerate(seqs):
        if not seq.sampling.greedy:
            tokens[i] = _sample_row(logits[i], seq)
    return tokens


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
