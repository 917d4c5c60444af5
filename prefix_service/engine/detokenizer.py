"""Incremental detokenization and stop strings.

Text is emitted only once it is final: a token that ends in the middle of a multi-byte
character (the decoder yields U+FFFD) waits for the next ones, and while stop strings are set
the last (longest stop - 1) characters are held back, since they may begin a stop string.
"""
from __future__ import annotations

from typing import Any

CONTEXT_TOKENS = 6  # prompt tokens decoded with the output so leading spaces come out right


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: list[int], stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self._ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""  # all final text so far (stop string excluded)
        self._emitted = 0  # characters of self.text already returned
        self.stop = stop
        self._holdback = max((len(s) for s in stop), default=1) - 1

    def _decode(self, ids: list[int]) -> str:
        text: str = self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        return text

    def add(self, token_id: int, check_stop: bool = True) -> tuple[str, bool]:
        """Add one token. Returns (text that is now final, whether a stop string was hit).
        On a stop string, self.text is cut before it. check_stop False: the text so far may hold
        a stop string (before min_tokens), and it is not looked for."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return "", False  # an incomplete character (or nothing printable) so far
        search_from = max(0, len(self.text) - self._holdback)
        self.text += new_text[len(prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        if self.stop and check_stop:
            hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[:min(hits)]
                return self.flush(), True
        end = len(self.text) - self._holdback
        if end <= self._emitted:
            return "", False
        delta = self.text[self._emitted:end]
        self._emitted = end
        return delta, False

    def flush(self) -> str:
        """At the end of the request: everything not yet returned."""
        delta = self.text[self._emitted:]
        self._emitted = len(self.text)
        return delta
