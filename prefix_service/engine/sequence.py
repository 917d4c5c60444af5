"""Requests as the caller gives them, and sequences as the scheduler tracks them."""
from __future__ import annotations

import enum
from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from prefix_service.engine.block_allocator import BlockId
from prefix_service.sampling_params import SamplingParams

if TYPE_CHECKING:
    from prefix_service.engine.template_pins import TemplateHandle


@dataclass
class GenerateRequest:
    """One generation request. Give `prompt` (text) or `prompt_token_ids`; with `prefix_name`
    the request continues that pinned template (the prompt is tokenized without special tokens)."""
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    prefix_name: str | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_id: str | None = None


@dataclass
class ScoreRequest:
    """Score each candidate continuation after the prompt (text or ids; on `prefix_name`, the
    template it continues). A text candidate is tokenized alone, without special tokens."""
    candidates: list[str] | list[list[int]]
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    prefix_name: str | None = None
    request_id: str | None = None


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # cancelled by the caller or the server


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model, and the most likely alternatives
    (the sampling parameter `logprobs` says how many), most likely first."""
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, log-probability)


@dataclass(frozen=True)
class CandidateScore:
    """One candidate continuation's log-probability under the model, token by token (teacher
    forced after the prompt)."""
    token_ids: tuple[int, ...]
    token_logprobs: tuple[float, ...]

    @property
    def logprob(self) -> float:
        return sum(self.token_logprobs)


@dataclass
class ScoreOutput:
    """A Score request's answer: each candidate's score in the order given. prompt_tokens counts
    the template and the prompt once; cached_tokens those of them whose KV came from the pinned
    template."""
    request_id: str
    candidates: list[CandidateScore]
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: BaseException | None = None


@dataclass
class RequestOutput:
    """What one step produced for one request: the new text and token ids since the last output.
    `finished` is set on the last one, with its reason and usage."""
    request_id: str
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0  # template included
    cached_tokens: int = 0  # prompt tokens whose KV came from a pinned template
    completion_tokens: int = 0
    ttft_ms: float | None = None
    error: BaseException | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for them
    index: int = 0  # which of the request's n samples this output belongs to (finished: that sample is)


class Sequence:
    """A request's scheduling state. Owned by the scheduler; the runner only reads it.

    token_ids:  [0, T) template | [T, num_prompt_tokens) prompt | outputs (T: the template's tokens)
    KV state:   [0, num_computed_tokens) in the cache through block_table | the rest uncomputed
    block_table[:num_shared_blocks] are the template's pinned full blocks (read-only, shared);
    every later block is the sequence's own (the first may be a copy of the template's tail), or, for
    a sequence forked from another (Scheduler.fork), blocks it shares with its siblings.

    What it does once its prompt is computed: a generation samples; a template's warmup
    (prefill_only) is pinned; a fork point (fork_point) is forked into sequences that continue
    it; a scoring sequence (score_from set) samples nothing, and the logits of each of its
    positions from score_from on score its next token (score_targets[position - score_from]).
    """

    def __init__(self, request_id: str, token_ids: list[int], sampling: SamplingParams, max_tokens: int,
                 template: TemplateHandle | None, generator: np.random.Generator | None, prefill_only: bool = False,
                 *, fork_point: bool = False, score_from: int | None = None,
                 score_targets: tuple[int, ...] = ()) -> None:
        self.request_id = request_id
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.sampling = sampling
        self.max_tokens = max_tokens
        self.template = template
        self.generator = generator
        self.prefill_only = prefill_only  # a template's warmup: prefill, keep the blocks, no sampling
        self.fork_point = fork_point
        self.forked = False  # a sample or candidate that continues a fork point (Scheduler.fork): part of its request
        self.score_from = score_from
        self.score_targets = score_targets
        self.matcher: Any = None  # a structured output's matcher (engine/structured.py), fed each token
        # a forced run that waits for its logprobs (engine/core.py): the logits of each position from
        # this one on give the next token's, those of the run's tokens, then the next draw's
        self.held_from: int | None = None
        self.draft_length: int | None = None  # the most draft tokens its next draft may have (speculation.Drafter)
        self.draft_kept = 0  # its draft tokens kept so far
        self.draft_missed = 0  # its drafts cut by a token drawn otherwise
        self.status = SeqStatus.WAITING
        self.block_table: list[BlockId] = []
        self.num_shared_blocks = 0
        self.num_computed_tokens = 0
        self.cached_tokens = 0  # set at admission; reported in usage
        self.num_preemptions = 0
        self.num_failed_steps = 0  # steps the backend failed to compute with it (Scheduler.quarantine)
        self.finish_reason: FinishReason | None = None
        self._id_array = array("q")  # token_ids as int64, converted once each as they come (ids_tensor)

    def ids_tensor(self, start: int = 0) -> torch.Tensor:
        """token_ids[start:] as a new int64 tensor. The penalties read every token of a sequence at
        every step: converted from Python ints once each, as token_ids grows, the step's cost does
        not grow with the sequence."""
        held = self._synced_ids()
        if start >= len(held):
            return torch.zeros(0, dtype=torch.int64)
        return torch.frombuffer(held, dtype=torch.int64)[start:].clone()  # the view dies here

    def ids_array(self) -> np.ndarray:
        """token_ids as a new int64 array, converted as ids_tensor's are."""
        return np.array(self._synced_ids(), dtype=np.int64)

    def _synced_ids(self) -> array[int]:
        ids, held = self.token_ids, self._id_array
        if len(held) > len(ids):  # token_ids only grows; a shorter list put in its place starts again
            del held[:]
        if len(held) < len(ids):
            held.extend(ids[len(held):])
        return held

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def samples(self) -> bool:
        return not (self.prefill_only or self.fork_point or self.score_from is not None)

    @property
    def first_logit_position(self) -> int | None:
        """The first position whose logits the sequence needs (its KV is never taken from a template
        from there on): its last token's when it samples, each from score_from on when it scores,
        none otherwise."""
        if self.score_from is not None:
            return self.score_from
        if self.held_from is not None:
            return self.held_from
        return len(self.token_ids) - 1 if self.samples else None

    @property
    def own_blocks(self) -> list[BlockId]:
        return self.block_table[self.num_shared_blocks:]

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, tokens={len(self.token_ids)}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})")
