"""Warmup: prefill and pin every template before the server reports SERVING. The YAML templates
come first (a failure stops the start: the config is wrong), then the ones restored from the
state file (a failure is logged and the template skipped: e.g. the prefix budget shrank)."""
from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from prefix_service.errors import PrefixServiceError
from prefix_service.server.store import TemplateSource
from prefix_service.server.templates import TemplateRegistry

log = logging.getLogger("prefix_service.server")

WarmupHook = Callable[[TemplateSource], None]


def warm_up(registry: TemplateRegistry, configured: Sequence[TemplateSource], restored: Sequence[TemplateSource],
            hook: WarmupHook | None = None) -> int:
    """Pin every template; returns how many were pinned. Blocks (run it in a worker thread)."""
    names = {t.name for t in configured}
    for t in restored:
        if t.name in names:
            log.warning("template %r from the state file is also in the config; the config's wins and the "
                        "state file drops it at the next admin change", t.name)
    todo = list(configured) + [t for t in restored if t.name not in names]
    pinned = 0
    with logging_redirect_tqdm(), tqdm(total=len(todo), desc="warming prefix templates", unit="template",
                                       disable=None if todo else True) as bar:
        for src in todo:
            if hook is not None:
                hook(src)
            t0 = time.perf_counter()
            try:
                info = registry.add(src, persist=False)
            except PrefixServiceError as e:
                if src.origin == "config":
                    raise PrefixServiceError(f"prefix template {src.name!r} from the config failed to warm up: {e}") from e
                log.error("template %r from the state file was not restored and will be dropped from it at the "
                          "next admin change: %s", src.name, e)
                bar.update(1)
                continue
            ms = (time.perf_counter() - t0) * 1000
            log.info("prefix template %r (%s) pinned: %d tokens, %d blocks, %.0f ms",
                     info.name, src.origin, info.num_tokens, info.num_blocks, ms)
            pinned += 1
            bar.update(1)
    return pinned
