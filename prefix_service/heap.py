"""Python's cyclic garbage collector in a long-running serving process.

A process that has imported torch, transformers, grpc and a tokenizer holds a few hundred
thousand objects that live as long as it does. Every full (generation 2) collection walks all of
them: up to 125 ms on a 2-core CPU, on whichever thread allocated last, the engine's included, so a
request that is being prefilled or decoded then waits that long (docs/benchmarks.md, "Garbage
collector pauses"). Once start-up is over, `freeze_startup_objects` moves everything alive into
the collector's permanent generation: later collections walk only what was made after it.
Objects are still freed by their reference counts; only a reference cycle among the frozen ones,
should one be dropped later, is never reclaimed, which is why this runs once the process has
built what it keeps (the server after its templates are pinned, a replica after its warm-up), as a
process's own start-up step, never inside a library call; the benchmark freezes for its timed part
only and undoes it (gc.unfreeze) after.

`pauses()` times every collection in the process (a gc callback, installed once), for the
server's metrics: how long the collector held the interpreter, by generation.
"""
from __future__ import annotations

import gc
import logging
import time
from typing import Any

log = logging.getLogger(__name__)


def freeze_startup_objects() -> int:
    """Collect what start-up left unreachable, then keep every object alive now out of later
    collections (gc.freeze). Returns how many objects the collector no longer walks."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    if _pauses is not None:  # the longest pauses are counted from here: start-up's own walks are over
        _pauses.longest = [0.0, 0.0, 0.0]
    log.info("start-up done: %d objects moved out of the garbage collector's walks", frozen)
    return frozen


class GcPauses:
    """Every collection's duration, by generation (0, 1, 2): how many, the seconds in all, the
    longest (since start-up ended, once freeze_startup_objects has run). Filled by a gc callback
    with no lock: the collector runs one collection at a time, holding the interpreter, and a
    reader (a metrics scrape) sees each number whole."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.longest = [0.0, 0.0, 0.0]
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        took, generation = time.perf_counter() - self._started, info["generation"]
        self.count[generation] += 1
        self.seconds[generation] += took
        if took > self.longest[generation]:
            self.longest[generation] = took


_pauses: GcPauses | None = None


def pauses() -> GcPauses:
    """The process's collection timings, the callback installed on the first call."""
    global _pauses
    if _pauses is None:
        _pauses = GcPauses()
        gc.callbacks.append(_pauses)
    return _pauses
