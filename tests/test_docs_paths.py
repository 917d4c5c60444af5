"""The docs cite only paths that exist: every repository path README.md and docs/*.md name (in
prose, in backticks, in code blocks, as a markdown link) is a file or folder of the repository.

What counts as a repository path:
- a path whose first folder is a top-level folder of the repository (`prefix_service/engine/core.py`,
  `scripts/bench_prefix.py`, `docs/benchmarks/`, `tests/test_fleet*.py`), resolved against the root;
- a module path written relative to the package, as docs/architecture.md's layout table writes them
  (`engine/core.py`, `backends/cpu/`: a file with its extension or a folder with its slash),
  resolved against `prefix_service/`; `csrc/...` against the folders that hold native sources,
  `benchmarks/...` against docs/;
- a root file (`Makefile`, `setup.cfg`, an upper-case `NAME.md` such as `README.md`), also at the end
  of a `../` path: a doc names no file outside the repository;
- a relative markdown link target (`[data](benchmarks/run.json)`), resolved against the doc's folder;
  it must stay inside the repository. Other `../` paths are relative to a folder the text names (a
  config's, a command's) and are not checked.
URLs, absolute paths (`/tmp/...`, `~/.cache/...`), folders the project writes (`bench_out/`,
`.cache/`), placeholders (`FILE`, `fleet.yaml`) and dotted module names are not repository paths.
A `*` in a path is a glob that must match something.
"""
from __future__ import annotations

import glob
import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCS = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))

# first folder of a path -> the folders it is resolved against (it must exist under one of them)
BASES: dict[str, tuple[str, ...]] = {
    **{top: ("",) for top in ("prefix_service", "cuda_ops", "scripts", "docs", "configs", "tests",
                              "proto", ".ci")},
    **{sub: ("prefix_service",) for sub in ("engine", "backends", "model", "server", "fleet", "bench")},
    "csrc": ("prefix_service/backends/cpu", "cuda_ops"),
    "benchmarks": ("docs",),  # docs/benchmarks.md names its data files from its own folder
}
ROOT_FILES = frozenset({"Makefile", "setup.cfg", "pyproject.toml"})

_COMPONENT = r"[A-Za-z0-9_.*-]+"
# a path-like token: not glued to a URL, an absolute path, a `~`/`$` prefix or a dotted name before it
_TOKEN = re.compile(rf"(?<![\w/~$.:@-])((?:\.\./)*{_COMPONENT}(?:/{_COMPONENT})*/?)")
_LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_UPPER_MD = re.compile(r"[A-Z][A-Z0-9_-]*\.md")


@dataclass(frozen=True)
class Citation:
    doc: Path
    line: int
    path: str
    from_doc: bool  # a link: relative to the doc's folder, else to the repository


def _is_repo_path(token: str) -> bool:
    parts = token.rstrip("/").split("/")
    if len(parts) == 1 and not token.endswith("/"):
        return token in ROOT_FILES or bool(_UPPER_MD.fullmatch(token))
    if BASES.get(parts[0]) == ("",):
        return True
    # relative to the package: a file name with its extension or a folder with its slash, so that
    # prose such as "the model/template pair" is no path
    return parts[0] in BASES and (token.endswith("/") or "." in parts[-1])


def citations(text: str, doc: Path) -> list[Citation]:
    """The repository paths `text` (the contents of `doc`) cites, in order, with their line numbers."""
    found: list[tuple[int, int, Citation]] = []
    in_fence = False
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
            continue
        if not in_fence:
            for m in _LINK.finditer(line):
                target = m.group(1).split("#", 1)[0]
                if target and ":" not in target and not target.startswith("/"):
                    found.append((lineno, m.start(), Citation(doc, lineno, target, from_doc=True)))
            line = _LINK.sub(lambda m: " " * len(m.group(0)), line)
        for m in _TOKEN.finditer(line):
            token = m.group(1).rstrip(".")
            if token.startswith("../"):
                # relative to a folder the text names (a config's, a command's), not to the doc;
                # an upper-case NAME.md at its end still names a root doc, which must be in the repo
                last = token.rsplit("/", 1)[-1]
                if _UPPER_MD.fullmatch(last):
                    found.append((lineno, m.start(), Citation(doc, lineno, last, from_doc=False)))
            elif _is_repo_path(token):
                found.append((lineno, m.start(), Citation(doc, lineno, token, from_doc=False)))
    return [c for _, _, c in sorted(found, key=lambda f: f[:2])]


def resolves(c: Citation, root: Path = REPO) -> bool:
    """Whether the cited path exists inside `root` (a glob: matches something there)."""
    root = root.resolve()
    if c.from_doc:
        candidates = [c.doc.parent / c.path]
    else:
        first = c.path.rstrip("/").split("/")[0]
        candidates = [root / base / c.path for base in BASES.get(first, ("",))]
    for path in candidates:
        matches = [Path(p) for p in glob.glob(str(path))] if "*" in c.path else [path]
        if any(p.exists() and p.resolve().is_relative_to(root) for p in matches):
            return True
    return False


def missing(docs: tuple[Path, ...], root: Path = REPO) -> list[str]:
    """'doc:line: path' for every cited path that does not exist."""
    return [f"{doc.relative_to(root)}:{c.line}: {c.path}" for doc in docs
            for c in citations(doc.read_text(encoding="utf-8"), doc) if not resolves(c, root)]


# --------------------------------------------------------------------------- the extractor itself

SAMPLE = """\
See `prefix_service/engine/core.py` and `engine/scheduler.py`, the [data](benchmarks/run.json),
[a section](#targets), [upstream](https://github.com/vllm-project/vllm/blob/main/docs/x.md) and
DESIGN.md. Run `python scripts/bench_prefix.py --json bench_out/bench.json --config FILE`.
Not paths: `/tmp/x/y.json`, `~/.cache/prefix_service`, `prefix_service.engine.core`,
`application/json`, `float16/bfloat16`, `127.0.0.1:50051`, `fleet.yaml`, http://host/docs/a.md.
Out of the repository: `../shared/NOTES.md`; a config's `../secret.txt`; the model/template pair.
```
model: {path: ../.cache/models/SmolLM2-135M-Instruct}
python scripts/profile_prefill.py --runs 16
```
Kernels in `csrc/*.cpp`, and docs/server.md.
"""


def test_extractor_finds_repository_paths_only(tmp_path):
    doc = tmp_path / "docs" / "sample.md"
    assert [(c.line, c.path) for c in citations(SAMPLE, doc)] == [
        (1, "prefix_service/engine/core.py"), (1, "engine/scheduler.py"), (1, "benchmarks/run.json"),
        (3, "DESIGN.md"), (3, "scripts/bench_prefix.py"),
        (6, "NOTES.md"),
        (9, "scripts/profile_prefill.py"),
        (11, "csrc/*.cpp"), (11, "docs/server.md"),
    ]


def test_missing_paths_are_reported_with_doc_and_line(tmp_path):
    """A copy of the repository's layout where some cited paths exist and others do not."""
    root = tmp_path / "repo"
    for rel in ("prefix_service/engine/core.py", "prefix_service/engine/scheduler.py",
                "scripts/bench_prefix.py", "docs/server.md", "prefix_service/backends/cpu/csrc/a.cpp"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("")
    doc = root / "docs" / "sample.md"
    doc.write_text(SAMPLE + "And `scripts/bench_gone.py`, `tests/test_gone*.py`.\n")
    (root / "docs" / "benchmarks").mkdir()
    (root / "docs" / "benchmarks" / "run.json").write_text("{}")

    assert missing((doc,), root) == [
        "docs/sample.md:3: DESIGN.md", "docs/sample.md:6: NOTES.md",
        "docs/sample.md:9: scripts/profile_prefill.py", "docs/sample.md:12: scripts/bench_gone.py",
        "docs/sample.md:12: tests/test_gone*.py"]

    (root / "DESIGN.md").write_text("")
    (root / "scripts" / "profile_prefill.py").write_text("")
    (root / "tests").mkdir()
    (root / "tests" / "test_gone_not.py").write_text("")
    assert missing((doc,), root) == ["docs/sample.md:6: NOTES.md", "docs/sample.md:12: scripts/bench_gone.py"]


def test_links_must_stay_inside_the_repository(tmp_path):
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    (tmp_path / "outside.md").write_text("")
    (root / "inside.md").write_text("")
    doc = root / "docs" / "a.md"
    doc.write_text("[in](../inside.md) and [out](../../outside.md)\n")
    assert [(c.path, resolves(c, root)) for c in citations(doc.read_text(), doc)] == [
        ("../inside.md", True), ("../../outside.md", False)]


def test_docs_cite_only_paths_that_exist():
    assert DOCS[0].is_file() and len(DOCS) > 1
    gone = missing(DOCS)
    assert not gone, "docs cite paths that do not exist in the repository:\n  " + "\n  ".join(gone)
