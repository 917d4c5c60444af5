"""TemplatePins: the one owner of the named, pinned templates (a pin registry, not a cache).

A template is tokenized once, prefilled through the engine like any request, and its block
table pinned: TemplatePins holds one reference on each of its blocks, so the allocator never
frees them and (since requests write only to their own blocks) nothing writes them while the
template exists. Removal unregisters the name at once; the pin is dropped when the last
request that uses the template finishes (deferred removal).
"""
from __future__ import annotations

import builtins
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, NewType, Protocol

from prefix_service.engine.block_allocator import BlockAllocator, BlockId
from prefix_service.errors import TemplateBudgetExceeded, TemplateExists, TemplateNotFound
from prefix_service.sampling_params import StructuredOutput

TemplateName = NewType("TemplateName", str)


@dataclass(eq=False)
class TemplateHandle:
    name: TemplateName
    token_ids: tuple[int, ...]
    block_table: tuple[BlockId, ...]  # ceil(len / block_size) blocks; the last may be partial
    template_id: int  # unique for the engine's life: the steps' rows and the backend name the pin by it
    source: dict[str, str] = field(default_factory=dict)  # how it was defined: {"content": ...}, {"system_prompt": ...}
    created_at: float = field(default_factory=time.time)
    requests_served: int = 0
    active_requests: int = 0  # unfinished requests (waiting or running) that continue it
    removed: bool = False  # unregistered; blocks freed when active_requests reaches 0
    # the default output of requests that name no structured output, and its compiled matcher
    structured: StructuredOutput | None = None
    matcher: Any = None
    kv_source: str = "prefill"  # where its K/V came from: "prefill", "snapshot" (a file of an earlier pin) or "peer" (another replica)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_blocks(self) -> int:
        return len(self.block_table)

    def reused_tokens(self, num_tokens: int) -> int:
        """Tokens whose KV a request of `num_tokens` tokens in all (this template's and its own)
        takes from the pinned blocks: all of the template's, or all but the last when the request
        adds no token of its own (one token is computed to get its logits)."""
        return self.num_tokens if num_tokens > self.num_tokens else self.num_tokens - 1

    def info(self) -> TemplateInfo:
        return TemplateInfo(self.name, self.num_tokens, self.num_blocks, self.requests_served, self.active_requests,
                          dict(self.source), self.structured, self.kv_source)

    def view(self) -> TemplateView:
        return TemplateView(self.name, self.token_ids, dict(self.source), self.structured)


@dataclass(frozen=True)
class TemplateInfo:
    """A read-only snapshot for listing."""
    name: str
    num_tokens: int
    num_blocks: int
    requests_served: int
    active_requests: int
    source: dict[str, str]
    structured: StructuredOutput | None = None  # the default output
    kv_source: str = "prefill"  # "prefill", "snapshot" or "peer"


@dataclass(frozen=True)
class TemplateView:
    """What callers outside the engine read of one template (`get_template`): its name, its token
    ids and how it was defined. A copy, taken on the engine's loop thread: the live TemplateHandle
    (block table, counters) never leaves the engine."""
    name: str
    token_ids: tuple[int, ...]
    source: dict[str, str]  # {"content": ...} or {"system_prompt": ...}; {} for one added as token ids
    structured: StructuredOutput | None = None  # the default output of requests that name none

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class TemplateHooks(Protocol):
    """Told when a template's blocks are pinned and just before they are freed (the backend keeps
    what it derives from a template's K/V, e.g. a packed copy, exactly that long)."""

    def on_pin(self, handle: TemplateHandle) -> None: ...

    def on_unpin(self, handle: TemplateHandle) -> None: ...


class TemplatePins:
    def __init__(self, allocator: BlockAllocator, block_size: int, budget_blocks: int,
                 hooks: TemplateHooks | None = None) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.budget_blocks = budget_blocks
        self.hooks = hooks
        self._handles: dict[str, TemplateHandle] = {}
        self._pending: dict[str, int] = {}  # name -> blocks reserved while its warmup prefill runs
        self._detached: list[TemplateHandle] = []  # removed but still in use
        self._ids = itertools.count(1)

    # --- lookup -----------------------------------------------------------------------------
    def get(self, name: str) -> TemplateHandle:
        handle = self._handles.get(name)
        if handle is None:
            known = ", ".join(sorted(self._handles)) or "none"
            raise TemplateNotFound(f"no prefix template named {name!r} (known: {known})")
        return handle

    def __contains__(self, name: str) -> bool:
        return name in self._handles

    def list(self) -> list[TemplateInfo]:
        return [h.info() for h in sorted(self._handles.values(), key=lambda h: h.created_at)]

    @property
    def num_pinned_blocks(self) -> int:
        return sum(h.num_blocks for h in self.pinned_handles())

    # below `def list`, the class body's `list` is that method: builtins.list is the type
    def pinned_handles(self) -> builtins.list[TemplateHandle]:
        """Every template whose blocks are held: registered, or removed but still in use."""
        return list(self._handles.values()) + self._detached

    # --- add --------------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def reserve(self, name: str, num_tokens: int) -> None:
        """Claim the name and budget before the template's prefill runs."""
        self._pending[name] = self.check(name, num_tokens)

    def check(self, name: str, num_tokens: int) -> int:
        """The blocks a template of num_tokens under this name would take, if reserve would claim
        them now: else TemplateExists or TemplateBudgetExceeded, as reserve raises."""
        if name in self._handles or name in self._pending:
            raise TemplateExists(f"a prefix template named {name!r} already exists; remove it first")
        need = self.blocks_for(num_tokens)
        used = self.num_pinned_blocks + sum(self._pending.values())
        if used + need > self.budget_blocks:
            raise TemplateBudgetExceeded(
                f"prefix template {name!r} needs {need} blocks ({num_tokens} tokens) but the prefix budget "
                f"has {self.budget_blocks - used} of {self.budget_blocks} blocks left; raise "
                f"cache.prefix_budget_blocks or remove a template")
        return need

    def cancel(self, name: str) -> None:
        self._pending.pop(name, None)

    def pin(self, name: str, token_ids: builtins.list[int], block_table: builtins.list[BlockId],
            source: dict[str, str], structured: StructuredOutput | None = None, matcher: Any = None,
            kv_source: str = "prefill") -> TemplateHandle:
        """Take one reference on each block of a finished warmup prefill (or of blocks a snapshot
        filled, kv_source "snapshot") and register the name. structured, matcher: the template's
        default output and its compiled matcher, if it has one."""
        if self._pending.pop(name, None) is None:
            raise RuntimeError(f"pin of {name!r} without reserve")
        assert len(block_table) == self.blocks_for(len(token_ids)), "block table does not cover the prefix"
        self.allocator.incref(block_table)
        handle = TemplateHandle(TemplateName(name), tuple(token_ids), tuple(block_table), next(self._ids), source,
                              structured=structured, matcher=matcher, kv_source=kv_source)
        if self.hooks is not None:
            try:
                self.hooks.on_pin(handle)
            except BaseException:
                self.hooks.on_unpin(handle)
                self.allocator.free(block_table)
                raise
        self._handles[name] = handle
        return handle

    # --- use by requests ---------------------------------------------------------------------
    def acquire(self, handle: TemplateHandle, served: bool = True) -> None:
        """A request continues the template from its pinned blocks: held until release(). served
        False: a further sequence of a request already counted (a scored candidate)."""
        handle.active_requests += 1
        handle.requests_served += int(served)

    def count_unreused(self, handle: TemplateHandle) -> None:
        """A request named the template but prefills its tokens itself (cache.enable_prefix false)."""
        handle.requests_served += 1

    def release(self, handle: TemplateHandle) -> None:
        handle.active_requests -= 1
        if handle.removed and handle.active_requests == 0:
            self._unpin(handle)

    # --- remove -----------------------------------------------------------------------------
    def remove(self, name: str) -> bool:
        """Unregister now; free the pin now if unused, else when its last request ends.
        Returns True if the blocks were freed at once, False if the free is deferred."""
        handle = self.get(name)
        del self._handles[name]
        handle.removed = True
        if handle.active_requests == 0:
            self._free(handle)
            return True
        self._detached.append(handle)
        return False

    def _unpin(self, handle: TemplateHandle) -> None:
        self._detached.remove(handle)
        self._free(handle)

    def _free(self, handle: TemplateHandle) -> None:
        if self.hooks is not None:
            self.hooks.on_unpin(handle)
        self.allocator.free(handle.block_table)

    # --- integrity --------------------------------------------------------------------------
    def held_refs(self) -> dict[BlockId, int]:
        refs: dict[BlockId, int] = {}
        for h in self.pinned_handles():
            for b in h.block_table:
                refs[b] = refs.get(b, 0) + 1
        return refs
