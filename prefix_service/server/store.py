"""TemplateStore: the templates added through the admin API, persisted to a JSON state file.

Every save writes the whole list to a temp file in the same folder, fsyncs it, renames it over
the state file (atomic on POSIX) and fsyncs the folder, so a crash at any point leaves either
the old or the new file, never a torn one. Leftover temp files of a crashed write are ignored
(and removed) at load.

    {"version": 1, "templates": [{"name": "faq", "content": "..."},
                                 {"name": "bot", "system_prompt": "...",
                                  "structured_output": {"choice": ["yes", "no"]}}]}
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from prefix_service.config import ServiceConfig, validate_template_name
from prefix_service.errors import ConfigError, InvalidRequest
from prefix_service.fsutil import fsync_dir
from prefix_service.sampling_params import StructuredOutput

log = logging.getLogger("prefix_service.server")

STATE_VERSION = 1


@dataclass(frozen=True)
class TemplateSource:
    """How a template is defined: exactly one of content (raw text) or system_prompt, and the
    default output of the requests on it that name none (structured)."""
    name: str
    content: str | None = None
    system_prompt: str | None = None
    origin: str = "admin"  # "config" (the YAML file) or "admin" (added at run time)
    structured: StructuredOutput | None = None

    def definition(self) -> dict[str, str]:
        """{"content": ...} or {"system_prompt": ...}: its text, as TemplateView.source."""
        if self.content is not None:
            return {"content": self.content}
        assert self.system_prompt is not None  # one of the two: the registry refuses a source without
        return {"system_prompt": self.system_prompt}

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, **self.definition()}
        if self.structured is not None:
            out["structured_output"] = self.structured.to_dict()
        return out


def state_path(config: ServiceConfig) -> Path | None:
    """server.state_file, else <config stem>.state.json next to the config file, else None."""
    if config.server.state_file:
        return Path(config.server.state_file)
    if config.source:
        src = Path(config.source)
        return src.with_name(f"{src.stem}.state.json")
    return None


def snapshot_dir(config: ServiceConfig, state_file: Path | None) -> Path | None:
    """The template snapshot folder of a one-process server on `config` whose state file is
    state_file: cache.snapshot_dir when set ("" : none), else a folder next to the state file
    (state.json: state.snapshots/, default.state.json: default.snapshots/), else none. The server
    (parts.with_snapshot_dir) and `prefix-service snapshot` both ask this."""
    folder = config.engine.cache.snapshot_dir
    if folder is not None:
        return Path(folder) if folder else None
    if state_file is None:
        return None
    return state_file.with_name(state_file.name.removesuffix(".json").removesuffix(".state") + ".snapshots")


def state_file_name(store: TemplateStore | None) -> str:
    """The state file as an error message names it (a store that failed to save has one)."""
    return str(store.path) if store is not None else "(no state file)"


class StateFileError(ConfigError):
    """The state file exists but cannot be read as a template list."""


class TemplateStore:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def _temp_prefix(self) -> str:
        return f".{self.path.name}.tmp-"

    def load(self) -> list[TemplateSource]:
        for stale in self.path.parent.glob(self._temp_prefix() + "*"):  # a write that never finished
            log.warning("ignoring %s, left by an interrupted write of %s", stale, self.path.name)
            stale.unlink(missing_ok=True)
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return []
        except (OSError, UnicodeDecodeError) as e:  # a file that is not UTF-8 text too
            raise StateFileError(f"cannot read the template state file {self.path}: {e}") from e
        fix = "fix it, or move it away to start without the templates added at run time"
        try:
            data = json.loads(text)
        except ValueError as e:
            raise StateFileError(f"the template state file {self.path} is not valid JSON ({e}); {fix}") from None
        if not isinstance(data, dict) or data.get("version") != STATE_VERSION \
                or not isinstance(data.get("templates"), list):
            raise StateFileError(f"the template state file {self.path} is not a version-{STATE_VERSION} "
                                 f"template list; {fix}")
        out = []
        for i, entry in enumerate(data["templates"]):
            keys = set(entry) - {"structured_output"} if isinstance(entry, dict) else set()
            if not ({"name"} < keys <= {"name", "content", "system_prompt"}) or len(keys) != 2 \
                    or not all(isinstance(entry[k], str) for k in keys):
                raise StateFileError(f"{self.path}: templates[{i}] must be {{name, content}} or "
                                     f"{{name, system_prompt}} with string values (and a structured_output); {fix}")
            try:
                validate_template_name(entry["name"])
                structured = (StructuredOutput.from_dict(entry["structured_output"])
                              if "structured_output" in entry else None)
            except (ConfigError, InvalidRequest) as e:
                raise StateFileError(f"{self.path}: templates[{i}]: {e}") from None
            out.append(TemplateSource(entry["name"], entry.get("content"), entry.get("system_prompt"),
                                      structured=structured))
        return out

    def save(self, templates: Iterable[TemplateSource]) -> None:
        """Atomically replace the state file with this list. Raises OSError."""
        data = {"version": STATE_VERSION, "templates": [t.to_json() for t in templates]}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=self._temp_prefix(), dir=self.path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f, ensure_ascii=False, indent=1)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        fsync_dir(self.path.parent)
