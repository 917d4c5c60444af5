"""Speculative decoding by prompt lookup (scheduler.speculative_tokens): draft tokens that cost no model.

A sequence whose answer copies from its context (a template's document quoted, a record's fields
repeated, a loop) often continues its last few tokens the way they were continued before. The
draft is the tokens that followed an earlier occurrence of the sequence's last n tokens (n from
`max_ngram` down to `min_ngram`) in its template, prompt or output (propose). The scheduler runs the
draft as decode rows after the sequence's last token, and the engine samples each row in turn as
a step of its own would (EngineCore._verify_drafts): a draft token is kept while it is the token
drawn there, and the first one drawn otherwise ends the run. So the tokens are those of decoding
a step each wherever the rows' logits are (docs/architecture.md, "Speculative decoding").
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

if TYPE_CHECKING:
    from prefix_service.config import SchedulerConfig
    from prefix_service.engine.sequence import Sequence


def propose(ids: np.ndarray, num_tokens: int, max_ngram: int, min_ngram: int) -> list[int]:
    """ids: a sequence's token ids (int64) -> up to num_tokens ids that followed an earlier occurrence
    of its last n ids, for the largest n in [min_ngram, max_ngram] that occurs: the latest with
    num_tokens ids after it, else the earliest; [] where none occurs."""
    total = len(ids)
    if num_tokens < 1:
        return []
    for n in range(min(max_ngram, total - 1), min_ngram - 1, -1):
        tail = ids[total - n:]
        # windows starting at 0 .. total - n - 1: each earlier occurrence, with a token after it
        windows = sliding_window_view(ids[:total - 1], n)
        hits = np.flatnonzero((windows == tail).all(axis=1))
        if len(hits):
            # the latest with num_tokens after it, else the earliest (in a loop, a recent occurrence
            # has only the loop's last turn after it)
            whole = hits[hits + n + num_tokens <= total]
            start = int(whole[-1] if len(whole) else hits[0]) + n
            return [int(token) for token in ids[start:start + num_tokens]]
    return []


class Drafter:
    """The scheduler's source of drafts (Scheduler.draft), and the count of what they gave."""

    def __init__(self, config: SchedulerConfig, max_model_len: int) -> None:
        self.num_tokens = config.speculative_tokens
        self.max_ngram, self.min_ngram = config.speculative_max_ngram, config.speculative_min_ngram
        self.max_model_len = max_model_len
        self.drafted = 0  # draft tokens a step checked
        self.accepted = 0  # of them, those drawn there and kept

    def __call__(self, seq: Sequence, limit: int) -> tuple[int, ...]:
        """A draft for `seq`, a running sequence whose one uncomputed token is its last, of at most
        `limit` tokens and of the length its drafts earn (learn): for a structured output, as far as
        its matcher allows the tokens in turn; none for a run held for its logprobs; no more tokens
        than max_tokens and the context leave after the one the draft's last row draws."""
        if seq.held_from is not None or not seq.samples:
            return ()
        length = len(seq.token_ids)
        earned = self.num_tokens if seq.draft_length is None else seq.draft_length
        limit = min(limit, earned, seq.max_tokens - seq.num_output_tokens - 1, self.max_model_len - length - 1)
        if limit < 1:
            return ()
        draft = propose(seq.ids_array(), limit, self.max_ngram, self.min_ngram)
        if draft and seq.matcher is not None:  # a token its constraint refuses would not be drawn there
            draft = draft[:seq.matcher.validate_tokens(draft)]
        return tuple(draft)

    def learn(self, seq: Sequence, drafted: int, kept: int) -> None:
        """A step checked `drafted` tokens of seq's draft and kept `kept`: its next draft is twice as
        long where all were kept (up to speculative_tokens), else one longer than those kept. A
        sequence whose text its context does not foresee drafts a token at a time, which costs a
        row a step, while one that quotes its context soon drafts the most."""
        self.drafted += drafted
        self.accepted += kept
        seq.draft_length = min(self.num_tokens, 2 * drafted if kept == drafted else kept + 1)
