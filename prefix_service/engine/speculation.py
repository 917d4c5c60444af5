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

import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from prefix_service.config import SchedulerConfig
    from prefix_service.engine.sequence import Sequence


def propose(ids: np.ndarray, num_tokens: int, max_ngram: int, min_ngram: int) -> list[int]:
    """ids: a sequence's token ids (int64) -> up to num_tokens ids that followed an earlier occurrence
    of its last n ids, for the largest n in [min_ngram, max_ngram] that occurs: the latest with
    num_tokens ids after it, else the earliest; [] where none occurs."""
    total = len(ids)
    longest = min(max_ngram, total - 1)
    if num_tokens < 1 or longest < min_ngram:
        return []
    # where an earlier occurrence of the last n ids ends, for n = 1, 2, ...: each n keeps those of
    # n - 1 whose id n - 1 places before matches (one pass over the ids, then over the few matches)
    ends = np.flatnonzero(ids[:total - 1] == ids[total - 1])
    n = 1
    while n < longest and len(ends):
        longer = ends[ends >= n]
        longer = longer[ids[longer - n] == ids[total - 1 - n]]
        if not len(longer):
            break
        ends, n = longer, n + 1
    if not len(ends) or n < min_ngram:
        return []
    # the latest with num_tokens ids after it, else the earliest (in a loop, a recent occurrence has
    # only the loop's last turn after it)
    whole = ends[ends + 1 + num_tokens <= total]
    start = int(whole[-1] if len(whole) else ends[0]) + 1
    return [int(token) for token in ids[start:start + num_tokens]]


DEFAULT_ROW_COST = 0.08  # a decode row's time over a decode step's fixed time, until measured (StepCost)
PRIOR_WEIGHT = 2.0  # a sequence's acceptance starts as this many draft tokens at the engine's rate


class StepCost:
    """What a decode step costs, fitted to the engine's own steps: time = fixed + per_row x rows, by
    least squares over recent steps (each older one weighing `decay` times the next). row_cost is
    per_row / fixed: what one more row adds to a step, as a share of a step's cost without rows."""

    def __init__(self, fixed_row_cost: float | None = None, decay: float = 0.98) -> None:
        self.fixed = fixed_row_cost  # set: row_cost is this, whatever the steps take
        self.decay = decay
        self._sums = [0.0] * 5  # weight, rows, seconds, rows^2, rows x seconds
        self.observed = 0  # steps seen

    def observe(self, rows: int, seconds: float) -> None:
        """A decode step of `rows` rows (drafts included) took `seconds`."""
        d = self.decay
        w, x, y, xx, xy = self._sums
        self._sums = [d * w + 1, d * x + rows, d * y + seconds, d * xx + rows * rows, d * xy + rows * seconds]
        self.observed += 1

    @property
    def row_cost(self) -> float:
        if self.fixed is not None:
            return self.fixed
        w, x, y, xx, xy = self._sums
        if w == 0:
            return DEFAULT_ROW_COST
        mx, my = x / w, y / w
        var = xx / w - mx * mx
        if var < 1.0:  # the steps' rows hardly differ: no slope to fit yet
            return DEFAULT_ROW_COST
        per_row = (xy / w - mx * my) / var
        fixed = my - per_row * mx
        if per_row <= 0:  # noise: rows that cost nothing to speak of
            return 0.0
        if fixed <= 0:  # a step's cost all in its rows
            return 1.0
        return min(per_row / fixed, 1.0)


class Drafter:
    """The scheduler's source of drafts (Scheduler.draft), and the count of what they gave."""

    def __init__(self, config: SchedulerConfig, max_model_len: int) -> None:
        self.num_tokens = config.speculative_tokens
        self.max_ngram, self.min_ngram = config.speculative_max_ngram, config.speculative_min_ngram
        self.max_model_len = max_model_len
        self.cost = StepCost(config.speculative_row_cost)
        self.drafted = 0  # draft tokens a step checked
        self.accepted = 0  # of them, those drawn there and kept
        self.missed = 0  # drafts cut by a token drawn otherwise

    def acceptance(self, seq: Sequence) -> float:
        """The chance that a draft token of seq whose tokens before it were kept is kept too: its own
        draft tokens kept over those looked at (a draft's tokens after its first miss are not), from
        a start at the engine's rate so far."""
        engine = (self.accepted + 1) / (self.accepted + self.missed + 2)
        return (seq.draft_kept + PRIOR_WEIGHT * engine) / (seq.draft_kept + seq.draft_missed + PRIOR_WEIGHT)

    def worth(self, seq: Sequence, running: int) -> int:
        """The most draft tokens of seq worth their rows in a step of `running` sequences: the k-th
        is kept with acceptance^k, and a row adds row_cost of a step's fixed time to each of the
        running sequences' tokens, so it pays while acceptance^k >= n r / (1 + n r), the tokens a
        step makes per unit of its time (n running, r = StepCost.row_cost)."""
        p, nr = self.acceptance(seq), running * self.cost.row_cost
        bar = nr / (1 + nr)
        if bar <= 0 or p >= 1:
            return self.num_tokens
        if p <= bar:
            return 0
        return min(self.num_tokens, int(math.log(bar) / math.log(p)))

    def __call__(self, seq: Sequence, limit: int, running: int = 1) -> tuple[int, ...]:
        """A draft for `seq`, a running sequence whose one uncomputed token is its last, in a step of
        `running` sequences: at most `limit` tokens, the length its drafts earn (learn) and the
        number worth their rows (worth); for a structured output, as far as its matcher allows the
        tokens in turn; none for a run held for its logprobs; no more tokens than max_tokens and the
        context leave after the one the draft's last row draws."""
        if seq.held_from is not None or not seq.samples:
            return ()
        length = len(seq.token_ids)
        earned = self.num_tokens if seq.draft_length is None else seq.draft_length
        limit = min(limit, earned, seq.max_tokens - seq.num_output_tokens - 1, self.max_model_len - length - 1,
                    self.worth(seq, running))
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
        self.missed += kept < drafted
        seq.draft_kept += kept
        seq.draft_missed += kept < drafted
        seq.draft_length = min(self.num_tokens, 2 * drafted if kept == drafted else kept + 1)
