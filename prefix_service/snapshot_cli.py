"""`prefix-service snapshot verify|export|import`: template KV snapshot files checked and moved
between machines offline, against a config's model, with no server and no weights in memory.

Each command reads the config, resolves what an engine on it would run on this machine (the
device model.device picks, the dtype model.dtype picks there: EngineCore's resolve_device and
choose_dtype) and builds the key its snapshots must match (engine/snapshots.snapshot_key: a
fingerprint of config.json and samples of the weight files, the dtype, the block size). The folder
is the one a one-process server on the config uses (server/store.snapshot_dir). A file is checked
as the engine checks it before a load (SnapshotStore.verify), all but the template's token ids,
which the engine checks when it pins the template.

Exit codes: 0 all files match; 1 a file does not match (or is missing, or cannot be written);
2 a usage error (a bad config, an unknown folder or file).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch and the engine load only when a command runs
    from prefix_service.engine.snapshots import SnapshotKey, SnapshotStore

EXIT_OK, EXIT_MISMATCH, EXIT_USAGE = 0, 1, 2

EPILOG = """\
These work on files, offline: no server is needed (template add/list/remove talk to a running one).
Run them where the config's model is, on the kind of machine that serves it: model.dtype auto
picks the dtype by the CPU or GPU, and a snapshot of another dtype does not match.

examples:
  prefix-service snapshot verify --config configs/default.yaml
  prefix-service snapshot export table_qa /tmp/table_qa.kv.safetensors --config configs/default.yaml
  prefix-service snapshot import /tmp/table_qa.kv.safetensors --config configs/default.yaml
"""


class UsageError(Exception):
    """A command that cannot run as asked (exit 2)."""


def add_parser(sub: Any) -> None:
    """The `snapshot` command group, on the CLI's subparsers."""
    p = sub.add_parser("snapshot", help="verify, export or import template KV snapshot files (offline, no server)",
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
                       description="Template KV snapshots (cache.snapshot_dir) checked against a config's model "
                                   "and moved between machines of the same model, without a server.")
    ssub = p.add_subparsers(dest="snapshot_command", required=True, metavar="ACTION")
    v = ssub.add_parser("verify", help="check every snapshot in a folder against the config's model",
                        description="One line per *.kv.safetensors file: template, tokens, size, and ok or why it "
                                    "would not be loaded (other weights, dtype, block size, layout; unreadable or "
                                    "corrupt). Exit 0 if all are ok, 1 if any is not.")
    v.add_argument("dir", nargs="?", metavar="DIR",
                   help="folder to check (default: the config's: cache.snapshot_dir, else next to the state file)")
    v.add_argument("--json", action="store_true", help="one JSON object: the expected key and every file's result")
    e = ssub.add_parser("export", help="copy a template's snapshot out of the config's folder, verified first",
                        description="Copy NAME's snapshot from the config's snapshot folder to FILE (atomically), "
                                    "if it matches the config's model.")
    e.add_argument("name", metavar="NAME", help="template name")
    e.add_argument("file", metavar="FILE", help="where to write it (a folder: FOLDER/NAME.kv.safetensors)")
    i = ssub.add_parser("import", help="verify a snapshot file and copy it into the config's folder",
                        description="Copy FILE into the config's snapshot folder (temp file, fsync, rename) if it "
                                    "matches the config's model; a file made by other weights, dtype or block size "
                                    "is refused and nothing is written. A server loads it the next time the "
                                    "template is pinned (its next start, or template add) if its tokens match.")
    i.add_argument("file", metavar="FILE", help="a snapshot file (.kv.safetensors)")
    i.add_argument("--name", metavar="NAME", help="the template it is for (default: the name the file records)")
    for q in (v, e, i):
        q.add_argument("--config", required=True, metavar="FILE", help="YAML service config of the model it is for")


def main(args: argparse.Namespace) -> int:
    from prefix_service.engine.snapshots import SnapshotMismatch
    from prefix_service.errors import PrefixServiceError
    try:
        if args.snapshot_command == "verify":
            return _verify(args)
        if args.snapshot_command == "export":
            return _export(args)
        return _import(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (SnapshotMismatch, PrefixServiceError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_MISMATCH


def _store(config_file: str, folder: str | None = None) -> SnapshotStore:
    """The SnapshotStore of the config's folder (or `folder`) and the key of the config's model."""
    from prefix_service.config import load_config
    from prefix_service.engine.core import resolve_device
    from prefix_service.engine.snapshots import SnapshotStore, snapshot_key
    from prefix_service.errors import PrefixServiceError
    from prefix_service.model.loader import choose_dtype
    from prefix_service.server.store import snapshot_dir, state_path

    try:
        config = load_config(config_file)
        mc = config.engine.model
        device = resolve_device(mc.device)
        dtype, _ = choose_dtype(mc.dtype, mc.path, device)
        key = snapshot_key(config.engine, device, dtype)
    except (PrefixServiceError, OSError) as e:  # a bad config, a missing model
        raise UsageError(f"{config_file}: {e}") from e
    where = Path(folder) if folder is not None else snapshot_dir(config, state_path(config))
    if where is None:
        raise UsageError(f"{config_file} keeps no template snapshots (cache.snapshot_dir is \"\", or the config "
                         "has no state file); name a folder")
    return SnapshotStore(where, key)


def _describe(key: SnapshotKey) -> str:
    return f"fingerprint {key.fingerprint}, dtype {key.dtype}, block size {key.block_size}, layout {key.layout}"


def _verify(args: argparse.Namespace) -> int:
    from prefix_service.engine.snapshots import SUFFIX, SnapshotMismatch, read_snapshot_file

    store = _store(args.config, args.dir)
    if args.dir is not None and not store.folder.is_dir():
        raise UsageError(f"{args.dir} is not a folder")
    files = sorted(store.folder.glob(f"*{SUFFIX}")) if store.folder.is_dir() else []
    results: list[dict[str, Any]] = []
    for path in files:
        result: dict[str, Any] = {"name": path.name.removesuffix(SUFFIX), "file": str(path),
                                  "num_tokens": None, "size_bytes": None, "ok": True, "reason": None}
        try:  # a dangling link, or a file a running server removes meanwhile, is one unreadable row
            result["size_bytes"] = path.stat().st_size
            result["num_tokens"] = read_snapshot_file(path).num_tokens
            store.verify(path)
        except SnapshotMismatch as e:
            result.update(ok=False, reason=str(e))
        except OSError as e:
            result.update(ok=False, reason=f"unreadable: {e}")
        results.append(result)
    all_ok = all(r["ok"] for r in results)
    if args.json:
        key = store.key
        print(json.dumps({"folder": str(store.folder), "ok": all_ok,
                          "expected": {"fingerprint": key.fingerprint, "dtype": key.dtype,
                                       "block_size": key.block_size, "layout": key.layout},
                          "snapshots": results}, indent=2))
        return EXIT_OK if all_ok else EXIT_MISMATCH
    print(f"{store.folder} against {_describe(store.key)}", file=sys.stderr)
    if not results:
        print(f"no snapshots in {store.folder}" + ("" if store.folder.is_dir() else " (the folder does not exist yet)"),
              file=sys.stderr)
        return EXIT_OK
    rows = [("NAME", "TOKENS", "SIZE", "STATUS")] + [
        (r["name"], "-" if r["num_tokens"] is None else str(r["num_tokens"]),
         "-" if r["size_bytes"] is None else f"{r['size_bytes'] / 2**20:.1f} MiB",
         "ok" if r["ok"] else f"mismatch: {r['reason']}") for r in results]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    bad = sum(not r["ok"] for r in results)
    if bad:
        print(f"{bad} of {len(results)} snapshot(s) would not be loaded (a template whose snapshot does not "
              "match is prefilled instead)", file=sys.stderr)
    return EXIT_OK if all_ok else EXIT_MISMATCH


def _export(args: argparse.Namespace) -> int:
    from prefix_service.config import validate_template_name
    from prefix_service.engine.snapshots import SUFFIX, SnapshotMismatch
    from prefix_service.errors import ConfigError

    try:
        validate_template_name(args.name)
    except ConfigError as e:
        raise UsageError(str(e)) from e
    store = _store(args.config)
    dest = Path(args.file)
    if dest.is_dir():
        dest = dest / f"{args.name}{SUFFIX}"
    elif args.file.endswith(("/", os.sep)):  # a folder by its spelling, as cp reads it: one that is not there
        raise UsageError(f"{args.file} is not a folder")
    if not dest.parent.is_dir():
        raise UsageError(f"{dest.parent} is not a folder")
    source = store.path(args.name)
    if not source.exists():
        print(f"error: template {args.name!r} has no snapshot in {store.folder}", file=sys.stderr)
        return EXIT_MISMATCH
    try:
        info = store.export(args.name, dest)
    except SnapshotMismatch as e:
        print(f"error: {source} does not match the config's model ({e}); nothing exported", file=sys.stderr)
        return EXIT_MISMATCH
    print(f"exported {args.name}: {info.num_tokens} tokens, {info.size / 2**20:.1f} MiB to {dest}")
    return EXIT_OK


def _import(args: argparse.Namespace) -> int:
    from prefix_service.config import validate_template_name
    from prefix_service.engine.snapshots import SUFFIX, SnapshotMismatch, read_snapshot_file
    from prefix_service.errors import ConfigError

    source = Path(args.file)
    if not source.is_file():
        raise UsageError(f"{source} is not a file")
    store = _store(args.config)
    try:
        recorded = read_snapshot_file(source).metadata.get("name")
    except SnapshotMismatch as e:
        print(f"error: {source} is not a snapshot ({e}); nothing imported", file=sys.stderr)
        return EXIT_MISMATCH
    name = args.name or recorded or source.name.removesuffix(SUFFIX)
    try:
        validate_template_name(name)
    except ConfigError as e:
        raise UsageError(f"{e} (name the template with --name)") from e
    replaced = store.path(name).exists()
    try:
        path = store.install(source, name)
    except SnapshotMismatch as e:
        print(f"error: {source} does not match the config's model ({e}); nothing imported", file=sys.stderr)
        return EXIT_MISMATCH
    tokens = read_snapshot_file(path).num_tokens
    print(f"imported {source} as template {name}'s snapshot {path} ({tokens} tokens"
          f"{', replacing the previous one' if replaced else ''}); it is loaded when {name} is next pinned "
          "with the same tokens")
    return EXIT_OK
