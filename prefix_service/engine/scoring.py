"""Label scoring: each candidate continuation's log-probability after a prompt on a template.

One request, two kinds of sequence, all on the template's pinned KV:

    fork point:  [ template | prompt ]                  computed once (the template's blocks shared)
    candidate i: [ template | prompt | c_i[:-1] ]       forked from it (Scheduler.fork): shares its
                                                        KV, computes its last token and c_i[:-1]

Candidate i's token k is scored by the logits at the position before it, so each candidate
sequence needs the logits of every position from P - 1 on (P: the fork point's tokens) and
samples nothing. Candidates run in one step where the token budget allows; a candidate of one
token computes one token.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from prefix_service.engine.sequence import CandidateScore, ScoreOutput, Sequence
from prefix_service.errors import InvalidRequest
from prefix_service.sampling_params import SamplingParams

if TYPE_CHECKING:
    from prefix_service.engine.template_pins import TemplateHandle

MAX_CANDIDATES = 256

ScoreSink = Callable[[ScoreOutput], None]


def check_candidates(candidates: list[list[int]], vocab_size: int) -> None:
    if not candidates:
        raise InvalidRequest("candidates: give at least one candidate continuation", param="candidates")
    if len(candidates) > MAX_CANDIDATES:
        raise InvalidRequest(f"candidates: at most {MAX_CANDIDATES} per request, got {len(candidates)}",
                             param="candidates")
    for i, ids in enumerate(candidates):
        if not ids:
            raise InvalidRequest(f"candidates[{i}] is empty (no tokens)", param="candidates")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequest(f"candidates[{i}]: token ids must be in [0, {vocab_size}), got {bad[:4]}",
                                 param="candidates")


@dataclass
class Scoring:
    """A Score request in flight: its fork point until it is computed, then its candidates."""
    request_id: str
    sink: ScoreSink
    candidates: list[tuple[int, ...]]
    prompt_tokens: int
    cached_tokens: int
    members: list[Sequence] = field(default_factory=list)  # unfinished sequences of this request
    logprobs: list[list[float | None]] = field(default_factory=list)  # [candidate][token]
    index: dict[int, int] = field(default_factory=dict)  # id(candidate's sequence) -> its candidate

    def __post_init__(self) -> None:
        self.logprobs = [[None] * len(c) for c in self.candidates]

    def fork_point(self, token_ids: list[int], template: TemplateHandle | None) -> Sequence:
        seq = Sequence(f"{self.request_id}/prompt", token_ids, SamplingParams(max_tokens=1), 1, template, None,
                       fork_point=True)
        self.members.append(seq)
        return seq

    def candidate_sequences(self, parent: Sequence) -> list[Sequence]:
        """One scoring sequence per candidate, continuing the computed fork point `parent`."""
        base = list(parent.token_ids)
        children = [Sequence(f"{self.request_id}/{i}", base + list(c[:-1]), SamplingParams(max_tokens=1), 1,
                             parent.template, None, score_from=len(base) - 1, score_targets=c)
                    for i, c in enumerate(self.candidates)]
        self.members.remove(parent)
        self.members += children
        self.index.update((id(child), i) for i, child in enumerate(children))
        return children

    def record(self, seq: Sequence, end: int, logits: torch.Tensor) -> None:
        """logits [n, vocab]: the model's at positions end - n .. end - 1 of `seq`, which score the
        tokens after them."""
        n = logits.shape[0]
        assert seq.score_from is not None
        first = end - n - seq.score_from  # index of the first scored token
        targets = torch.tensor(seq.score_targets[first:first + n], dtype=torch.int64, device=logits.device)
        values = torch.log_softmax(logits.float(), dim=-1).gather(1, targets[:, None])[:, 0].tolist()
        self.logprobs[self.index[id(seq)]][first:first + n] = values

    def finished(self, seq: Sequence) -> bool:
        """seq is done; True when it was the last."""
        self.members.remove(seq)
        return not self.members

    def output(self, error: BaseException | None = None) -> ScoreOutput:
        if error is not None:
            return ScoreOutput(self.request_id, [], self.prompt_tokens, self.cached_tokens, error)
        scores = []
        for c, lps in zip(self.candidates, self.logprobs):
            values = [v for v in lps if v is not None]
            assert len(values) == len(c), "a candidate token was never scored"
            scores.append(CandidateScore(c, tuple(values)))
        return ScoreOutput(self.request_id, scores, self.prompt_tokens, self.cached_tokens)
