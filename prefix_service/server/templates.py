"""TemplateRegistry: adds, removes and lists prefix templates on the engine, remembers where
each came from (the YAML config or the admin API) and keeps the admin ones in the TemplateStore.

Its methods block (an add prefills the template); the servicers call them from worker threads.
Adds and removes run one at a time (admin changes are rare; a remove racing an add of the same
name could otherwise leave the file out of step), so the state file always holds exactly the
admin templates the engine has. Listing does not wait for them.
"""
from __future__ import annotations

import builtins
import logging
import threading

from prefix_service.engine import Engine
from prefix_service.errors import InvalidRequest
from prefix_service.engine.template_pins import TemplateInfo
from prefix_service.server.chat import system_prompt_ids
from prefix_service.server.status import PersistError
from prefix_service.server.store import TemplateSource, TemplateStore, state_file_name

log = logging.getLogger("prefix_service.server")


def template_bytes(text: str) -> int:
    """A template text's size as server.max_template_bytes counts it: its UTF-8 bytes (a lone
    surrogate, which JSON can carry, as three)."""
    return len(text.encode("utf-8", "surrogatepass"))


class TemplateRegistry:
    def __init__(self, engine: Engine, store: TemplateStore | None, max_template_bytes: int = 1 << 20) -> None:
        self.engine = engine
        self.store = store  # None: admin templates live until the process ends
        self.max_template_bytes = max_template_bytes
        self._origins: dict[str, str] = {}
        self._admin: dict[str, TemplateSource] = {}  # what the state file holds, in insertion order
        self._lock = threading.Lock()  # guards _origins and _admin
        self._mutate = threading.Lock()  # one add or remove at a time

    def add(self, src: TemplateSource, *, persist: bool = True) -> TemplateInfo:
        """Tokenize, prefill and pin; then (for admin templates) persist. Raises InvalidRequest
        (also for a text over max_template_bytes), the engine's errors (TemplateExists,
        TemplateBudgetExceeded, PromptTooLong, CacheExhausted) or PersistError."""
        with self._mutate:
            return self._add(src, persist)

    def _add(self, src: TemplateSource, persist: bool) -> TemplateInfo:
        if (src.content is None) == (src.system_prompt is None):
            raise InvalidRequest(f"template {src.name!r}: give exactly one of content or system_prompt")
        text = src.content if src.content is not None else src.system_prompt or ""
        size = template_bytes(text)
        if size > self.max_template_bytes:
            raise InvalidRequest(f"template {src.name!r} is {size} bytes; templates may have at most "
                                 f"{self.max_template_bytes} bytes (server.max_template_bytes)")
        if src.system_prompt is not None:
            ids = system_prompt_ids(self.engine.tokenizer, src.system_prompt)
            info = self.engine.add_template(src.name, token_ids=ids, source={"system_prompt": src.system_prompt},
                                            structured=src.structured)
        else:
            if not src.content:
                raise InvalidRequest(f"template {src.name!r}: content is empty")
            info = self.engine.add_template(src.name, src.content, structured=src.structured)
        with self._lock:
            self._origins[src.name] = src.origin
            if src.origin == "admin":
                self._admin[src.name] = src
                if persist:
                    try:
                        self._save()
                    except OSError as e:
                        del self._admin[src.name], self._origins[src.name]
                        self.engine.remove_template(src.name)
                        raise PersistError(f"template {src.name!r} was not added: cannot write the state "
                                           f"file {state_file_name(self.store)}: {e}") from e
        return info

    def remove(self, name: str, *, keep_snapshot: bool = False) -> bool:
        """Unregister. True if the blocks were freed now, False if deferred until the requests
        using it finish. keep_snapshot: leave its snapshot file (the template moves to another
        replica rather than leaving). Raises TemplateNotFound or PersistError."""
        with self._mutate, self._lock:
            freed = self.engine.remove_template(name, keep_snapshot=keep_snapshot)
            self._origins.pop(name, None)
            if self._admin.pop(name, None) is not None:
                try:
                    self._save()
                except OSError as e:
                    raise PersistError(f"template {name!r} was removed, but the state file "
                                       f"{state_file_name(self.store)} could not be updated ({e}); it will come "
                                       f"back at the next start") from e
        return freed

    def list(self) -> list[tuple[TemplateInfo, str]]:
        infos = self.engine.list_templates()
        with self._lock:
            return [(info, self._origins.get(info.name, "admin")) for info in infos]

    def known(self, name: str) -> bool:
        """True if a template of this name is registered. Called on the event loop, so it takes no
        lock (the holders of _lock may wait on the engine or an fsync): one dict lookup is atomic."""
        return name in self._origins

    async def lookup(self, name: str) -> bool:
        """known(name): always current here."""
        return self.known(name)

    # below `def list`, the class body's `list` is that method: builtins.list is the type
    def listing(self) -> builtins.list[tuple[TemplateInfo, str, tuple[str, ...]]]:
        """list() with where each template lives: one process, so no replica ids."""
        return [(info, origin, ()) for info, origin in self.list()]

    def _save(self) -> None:
        if self.store is not None:
            self.store.save(self._admin.values())
