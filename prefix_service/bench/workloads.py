"""The four benchmark workloads, as token ids every system receives unchanged.

Each workload is tokenized once with the model's tokenizer. A request is (prompt text, prompt
ids) continuing the workload's prefix; the no-prefix systems get `prefix_ids + prompt_ids`.
Every request is checked at build time so that text and ids agree on both paths the service
takes (the gRPC API takes text only):

    encode(prompt_text, add_special_tokens=False)            == prompt_ids
    encode(prefix_text + prompt_text, add_special_tokens=True) == prefix_ids + prompt_ids

  intent      the intent-classifier template + `\\nMessage: "..."\\nIntent:` of exactly
              `prompt_tokens` tokens
  doc_qa      the departures-board template (a long markdown table) + a short `\\nQ: ...\\nA:`
  ratio_0_32  a prefix of ~0.32 x `total_tokens` (the classifier template's first lines) + a
              user segment so that prefix : prompt = 0.32 : 1
  no_shared   `total_tokens` of text unique to each request, no prefix at all

and, asked for by name (not in a full run):

  intent_labels  the intent workload as its users run it: the same template and form of message,
                 each answer one of the template's labels (a choice constraint), ending where the
                 label does (EOS honoured); the measure is requests/s, not tokens
  doc_records    the departures-board template + `\nQ: <a flight's row asked for as JSON>\nA:`,
                 each answer a JSON record of six of the board's columns (a JSON schema, compact
                 JSON), ending where the record does, at most 96 tokens

Templates are the files of configs/prompts/ with their trailing blank lines reduced to one newline.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from prefix_service.bench import corpus

WORKLOADS = ("intent", "doc_qa", "ratio_0_32", "no_shared")
# answers under a constraint (labels, records): asked for by name, not in a full run
CONSTRAINED_WORKLOADS = ("intent_labels", "doc_records")
KNOWN_WORKLOADS = WORKLOADS + CONSTRAINED_WORKLOADS  # what --workloads takes
PREFIX_NAMES = {"intent": "intent_classifier", "doc_qa": "table_qa", "ratio_0_32": "ratio_0_32_prefix",
                "intent_labels": "intent_classifier", "doc_records": "table_qa"}
PROMPTS_DIR = Path(__file__).resolve().parents[2] / "configs" / "prompts"
# the labels the intent template defines ("Labels and when to use them"), in its order
INTENT_LABELS = ("order_status", "order_change", "cancel_order", "return_refund", "billing", "product_question",
                 "damaged_item", "account", "warranty_repair", "feedback", "other")

# doc_records: a flight's row as a record of these columns of the board, each a string
RECORD_FIELDS = ("flight", "airline", "destination", "departs", "gate", "status")
RECORD_SCHEMA: dict[str, Any] = {
    "type": "object", "properties": {f: {"type": "string", "maxLength": 40} for f in RECORD_FIELDS},
    "required": list(RECORD_FIELDS), "additionalProperties": False}
RECORD_MAX_TOKENS = 96  # a record of the board's row is 40-80 tokens


@dataclass(frozen=True)
class Sizes:
    prompt_tokens: int = 100  # intent: the user segment
    total_tokens: int = 1000  # ratio_0_32 and no_shared: the whole prompt
    output_tokens: int = 30  # every free-text workload (EOS ignored, so every request makes exactly this many)
    max_prefix_tokens: int | None = None  # cut the templates (at a line end) to at most this many tokens
    ratio: float = 0.32  # ratio_0_32: prefix tokens / total prompt tokens


@dataclass(frozen=True)
class BenchRequest:
    index: int
    prompt_text: str  # what follows the prefix (the whole prompt when there is none)
    prompt_ids: tuple[int, ...]


class Answers:
    """What a workload's answers must be, for the systems and the records (Workload and the view a
    child process gets): one of `labels`, a JSON record of `record_schema`, or free text."""
    labels: tuple[str, ...]
    record_schema: dict[str, Any] | None

    @property
    def constrained(self) -> bool:
        """Answers under a constraint, EOS honoured, output_tokens a cap; else free text with EOS
        ignored, exactly output_tokens tokens."""
        return bool(self.labels) or self.record_schema is not None

    def structured_outputs(self) -> dict[str, Any] | None:
        """The constraint as vLLM's `structured_outputs` field (our HTTP API takes it too), or None."""
        if self.labels:
            return {"choice": list(self.labels)}
        if self.record_schema is not None:  # compact JSON, as ours writes it
            return {"json": self.record_schema, "disable_any_whitespace": True}
        return None

    def structured_output(self) -> dict[str, Any] | None:
        """The constraint as our Python client's `structured_output` (one key), or None."""
        if self.labels:
            return {"choice": list(self.labels)}
        return {"json_schema": self.record_schema} if self.record_schema is not None else None

    def wrong_answers(self, answers: list[str]) -> dict[str, Any]:
        """The record fields that check answers: labels, how many are none of them and how often each
        came; records, how many are not a JSON object of the schema's fields."""
        if self.labels:
            return {"answers_not_labels": sum(a not in self.labels for a in answers),
                    "label_counts": {label.strip(): answers.count(label) for label in self.labels if label in answers}}
        if self.record_schema is not None:
            return {"answers_not_records": sum(not _is_record(a, self.record_schema) for a in answers)}
        return {}


def _is_record(text: str, schema: dict[str, Any]) -> bool:
    try:
        record = json.loads(text)
    except ValueError:
        return False
    return isinstance(record, dict) and set(record) == set(schema["required"]) and \
        all(isinstance(v, str) for v in record.values())


@dataclass
class Workload(Answers):
    name: str
    prefix_name: str | None
    prefix_text: str
    prefix_ids: tuple[int, ...]
    output_tokens: int
    make_text: Callable[[int], str]  # request index -> prompt text
    encode: Callable[[str, bool], list[int]]  # (text, add_special_tokens) -> ids
    # set: every answer is one of these (a choice constraint), EOS ends it, output_tokens is its cap
    labels: tuple[str, ...] = ()
    # set: every answer is a JSON record of this schema, EOS ends it, output_tokens is its cap
    # (neither set: free text, EOS ignored, exactly output_tokens tokens)
    record_schema: dict[str, Any] | None = None
    _cache: dict[int, BenchRequest] = field(default_factory=dict, repr=False)

    @property
    def has_prefix(self) -> bool:
        return self.prefix_name is not None

    def request(self, index: int) -> BenchRequest:
        req = self._cache.get(index)
        if req is None:
            text = self.make_text(index)
            ids = tuple(self.encode(text, not self.has_prefix))
            if self.has_prefix and tuple(self.encode(self.prefix_text + text, True)) != self.prefix_ids + ids:
                raise ValueError(f"workload {self.name}: request {index} tokenizes differently after the prefix "
                                 f"than alone; the text sent through gRPC would not match the ids")
            req = self._cache[index] = BenchRequest(index, text, ids)
        return req

    def full_ids(self, req: BenchRequest) -> list[int]:
        return list(self.prefix_ids) + list(req.prompt_ids)

    def full_text(self, req: BenchRequest) -> str:
        return self.prefix_text + req.prompt_text

    def describe(self, sample: int = 8) -> dict:
        lens = [len(self.request(i).prompt_ids) for i in range(sample)]
        out = {"prefix_name": self.prefix_name, "prefix_tokens": len(self.prefix_ids),
               "prompt_tokens_min": min(lens), "prompt_tokens_max": max(lens), "output_tokens": self.output_tokens}
        if self.labels:
            return {**out, "labels": list(self.labels), "output_tokens_is": "at most"}
        if self.record_schema is not None:
            return {**out, "record_fields": list(self.record_schema["required"]), "output_tokens_is": "at most"}
        return out


def cut_to_tokens(text: str, max_tokens: int | None, count: Callable[[str], int]) -> str:
    """The longest run of whole lines of `text` within max_tokens (whole words, then a newline,
    when even the first line is longer)."""
    if max_tokens is None or count(text) <= max_tokens:
        return text
    kept = ""
    for line in text.splitlines(keepends=True):
        if count(kept + line) > max_tokens:
            break
        kept += line
    if kept:
        return kept
    words = text.split(" ")
    lo, hi = 0, len(words)  # largest k with count(words[:k] + "\n") <= max_tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(" ".join(words[:mid]) + "\n") <= max_tokens:
            lo = mid
        else:
            hi = mid - 1
    if lo == 0:
        raise ValueError(f"max_prefix_tokens={max_tokens} is too small for even one word of the template")
    return " ".join(words[:lo]) + "\n"


def fit_text(count: Callable[[str], int], head: str, body: Iterator[str], tail: str, n: int) -> str:
    """head + words from `body` joined by spaces + tail, with exactly n tokens (count() of the whole).

    Words are added on an estimate (each word's own count: a byte-level tokenizer splits at the
    space before a word, so counts add up), then the whole text is counted exactly and topped up
    with one-token fillers, dropping words where no filler adds exactly one token."""
    def compose(p: list[str]) -> str:
        return head + " ".join(p) + tail

    parts: list[str] = []
    estimate = count(compose([]))
    if estimate > n:
        raise ValueError(f"cannot fit a prompt in {n} tokens: the fixed text alone is longer")
    for sentence in body:
        words = sentence.split(" ")
        step = count(" " + sentence)
        if estimate + step <= n:
            parts += words
            estimate += step
            continue
        for word in words:  # the sentence that overflows: as many words as fit
            step = count(" " + word)
            if estimate + step > n:
                break
            parts.append(word)
            estimate += step
        break
    for _ in range(4 * n):
        have = count(compose(parts))
        if have == n:
            return compose(parts)
        if have < n:
            filler = next((f for f in ("ok", "yes", "a", "I", ".") if count(compose(parts + [f])) == have + 1), None)
            if filler is not None:
                parts.append(filler)
                continue
        if not parts:
            break
        parts.pop()
    raise ValueError(f"cannot make a prompt of exactly {n} tokens with this tokenizer")


def build_workload(name: str, tokenizer, sizes: Sizes = Sizes(), prompts_dir: Path = PROMPTS_DIR) -> Workload:
    def encode(text: str, special: bool) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=special)

    def count_after_prefix(text: str) -> int:
        return len(encode(text, False))

    intent_text = (prompts_dir / "intent_classifier.txt").read_text(encoding="utf-8")
    out = sizes.output_tokens
    labels: tuple[str, ...] = ()
    schema: dict[str, Any] | None = None
    if name in ("intent", "intent_labels"):
        prefix = _one_newline(cut_to_tokens(intent_text, sizes.max_prefix_tokens, count_after_prefix))
        key = "intent" if name == "intent" else "labels"  # messages of their own: no peer's cache sees one twice
        make = lambda i: fit_text(count_after_prefix, '\nMessage: "', corpus.sentences(f"{key}-{i}"),
                                  '"\nIntent:', sizes.prompt_tokens)
        if name == "intent_labels":
            labels = tuple(" " + label for label in INTENT_LABELS)
            out = max(count_after_prefix(label) for label in labels) + 1  # the longest label, then room for EOS
    elif name in ("doc_qa", "doc_records"):
        doc = (prompts_dir / "lisbon_departures.md").read_text(encoding="utf-8")
        prefix = _one_newline(cut_to_tokens(doc, sizes.max_prefix_tokens, count_after_prefix))
        dests = corpus.destinations(prefix)
        forms = corpus.QUESTION_FORMS if name == "doc_qa" else corpus.RECORD_FORMS
        make = lambda i: f"\nQ: {corpus.question(i, dests, forms)}\nA:"
        if name == "doc_records":
            schema, out = RECORD_SCHEMA, RECORD_MAX_TOKENS
    elif name == "ratio_0_32":
        budget = round(sizes.ratio * sizes.total_tokens)
        if sizes.max_prefix_tokens is not None:
            budget = min(budget, sizes.max_prefix_tokens)
        prefix = _one_newline(cut_to_tokens(intent_text, budget, count_after_prefix))
        prefix_len = len(encode(prefix, True))
        user_len = round(prefix_len / sizes.ratio) - prefix_len
        make = lambda i: fit_text(count_after_prefix, '\nMessage: "', corpus.sentences(f"ratio-{i}"),
                                  '"\nIntent:', user_len)
    elif name == "no_shared":
        def count_alone(text: str) -> int:
            return len(encode(text, True))
        return Workload(name, None, "", (), out,
                        lambda i: fit_text(count_alone, f"Support ticket {1000 + i}: ", corpus.sentences(f"none-{i}"),
                                           "\nSummary:", sizes.total_tokens), encode)
    else:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(KNOWN_WORKLOADS)}")
    return Workload(name, PREFIX_NAMES[name], prefix, tuple(encode(prefix, True)), out, make, encode, labels, schema)


def _one_newline(text: str) -> str:
    """End a template with exactly one newline: a run of trailing newlines tokenizes as one token
    alone but splits when text follows, which would break ids == encode(prefix + prompt)."""
    return text.rstrip() + "\n"
