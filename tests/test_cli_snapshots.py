"""`prefix-service snapshot verify|export|import` (prefix_service/snapshot_cli.py): offline, on
snapshots a real Engine wrote for the tiny random model, against YAML configs in tmp_path. verify
says ok for matching files and names the reason for the others (block size, a damaged file) with
exit 1; export then import moves a template's snapshot to another config's folder, where a fresh
Engine pins the template from it; import refuses a file of another block size and writes nothing;
usage errors exit 2. Also the folder a config's snapshots default to (server/store.snapshot_dir)."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import yaml

from prefix_service.cli import main
from prefix_service.config import load_config
from prefix_service.engine import Engine
from prefix_service.server.store import snapshot_dir, state_path

TEMPLATE = list(range(20, 31))  # 11 token ids: 3 blocks of 4, the last partial


def write_config(path: Path, model: Path, *, block_size: int = 4, snapshots: str | None = None) -> Path:
    """A config of the tiny model as make_engine runs it (CPU, float32, torch backend)."""
    cache: dict[str, object] = {"block_size": block_size, "num_blocks": 64}
    if snapshots is not None:
        cache["snapshot_dir"] = snapshots
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({
        "model": {"path": str(model), "dtype": "float32", "device": "cpu", "backend": "torch"}, "cache": cache}))
    return path


@pytest.fixture
def folder(make_engine, tmp_path) -> Path:
    """A snapshot folder holding doc's and faq's snapshots, written by an Engine (block size 4)."""
    folder = tmp_path / "a" / "snaps"
    engine = make_engine(snapshot_dir=str(folder), backend="torch")
    engine.add_template("doc", token_ids=TEMPLATE)
    engine.add_template("faq", token_ids=TEMPLATE[:5])
    engine.flush_snapshots()
    assert sorted(p.name for p in folder.iterdir()) == ["doc.kv.safetensors", "faq.kv.safetensors"]
    return folder


@pytest.fixture
def config(folder, llama_dir) -> Path:
    return write_config(folder.parent / "a.yaml", llama_dir, snapshots=str(folder))


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["snapshot", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def lines(out: str) -> dict[str, str]:
    """verify's table: template name -> its row."""
    return {row.split()[0]: row for row in out.splitlines()[1:]}


def test_verify_reports_every_file_ok(config, folder, capsys):
    rc, out, err = run(capsys, "verify", "--config", str(config))
    assert rc == 0, err
    assert out.splitlines()[0].split() == ["NAME", "TOKENS", "SIZE", "STATUS"]
    rows = lines(out)
    assert sorted(rows) == ["doc", "faq"]
    assert rows["doc"].split()[1] == "11" and rows["faq"].split()[1] == "5"
    assert all(row.endswith("  ok") and "MiB" in row for row in rows.values())
    assert "dtype float32, block size 4" in err
    assert run(capsys, "verify", "--config", str(config), str(folder))[:2] == (rc, out)  # DIR named


def test_verify_json(config, folder, capsys):
    rc, out, _ = run(capsys, "verify", "--config", str(config), "--json")
    report = json.loads(out)
    assert rc == 0 and report["ok"] is True and report["folder"] == str(folder)
    assert report["expected"]["dtype"] == "float32" and report["expected"]["block_size"] == 4
    by_name = {s["name"]: s for s in report["snapshots"]}
    assert by_name["doc"] == {"name": "doc", "file": str(folder / "doc.kv.safetensors"), "num_tokens": 11,
                              "size_bytes": (folder / "doc.kv.safetensors").stat().st_size, "ok": True,
                              "reason": None}


def test_verify_against_another_block_size(folder, llama_dir, tmp_path, capsys):
    other = write_config(tmp_path / "b.yaml", llama_dir, block_size=8, snapshots=str(folder))
    rc, out, err = run(capsys, "verify", "--config", str(other))
    assert rc == 1
    for row in lines(out).values():
        assert "mismatch: block_size '4', expected '8'" in row
    assert "2 of 2 snapshot(s) would not be loaded" in err
    report = json.loads(run(capsys, "verify", "--config", str(other), "--json")[1])
    assert report["ok"] is False and all("block_size" in s["reason"] for s in report["snapshots"])


def test_verify_json_exits_1_when_a_file_does_not_match(config, folder, capsys):
    (folder / "junk.kv.safetensors").write_bytes(b"\x00" * 7)
    rc, out, _ = run(capsys, "verify", "--config", str(config), "--json")
    report = json.loads(out)
    assert rc == 1 and report["ok"] is False
    assert [s["name"] for s in report["snapshots"] if not s["ok"]] == ["junk"]


def test_verify_finds_a_corrupted_file(config, folder, capsys):
    path = folder / "doc.kv.safetensors"
    with open(path, "r+b") as f:  # flip a bit of the first tensor's data
        f.seek(8 + struct.unpack("<Q", f.read(8))[0])
        byte = f.read(1)[0]
        f.seek(-1, 1)
        f.write(bytes([byte ^ 0x01]))
    (folder / "junk.kv.safetensors").write_bytes(b"\x00" * 7)
    (folder / "gone.kv.safetensors").symlink_to(folder / "nowhere")  # or a file removed while verify reads
    rc, out, _ = run(capsys, "verify", "--config", str(config))
    rows = lines(out)
    assert rc == 1
    assert "mismatch: corrupt: checksum mismatch" in rows["doc"]
    assert "mismatch: unreadable" in rows["junk"] and rows["junk"].split()[1] == "-"
    assert "mismatch: unreadable" in rows["gone"] and rows["gone"].split()[1:3] == ["-", "-"]
    assert rows["faq"].endswith("  ok")
    gone = {s["name"]: s for s in json.loads(run(capsys, "verify", "--config", str(config), "--json")[1])[
        "snapshots"]}["gone"]
    assert (gone["ok"], gone["size_bytes"]) == (False, None) and gone["reason"].startswith("unreadable")


def test_verify_reads_only_snapshot_files(config, folder, capsys):
    """What else a snapshot folder holds (a note, a save in progress's temp folder) is not a snapshot
    that fails to load."""
    (folder / "README.txt").write_text("snapshots of the doc and faq templates")
    (folder / ".doc.kv.safetensors.tmp-live").mkdir()
    rc, out, err = run(capsys, "verify", "--config", str(config))
    assert rc == 0, err
    assert sorted(lines(out)) == ["doc", "faq"]


def test_verify_of_a_folder_with_no_snapshots_says_so_and_exits_0(llama_dir, tmp_path, capsys):
    snaps = tmp_path / "snaps"
    cfg = write_config(tmp_path / "svc.yaml", llama_dir, snapshots=str(snaps))
    rc, out, err = run(capsys, "verify", "--config", str(cfg))
    assert (rc, out) == (0, "")
    assert f"no snapshots in {snaps} (the folder does not exist yet)" in err
    snaps.mkdir()
    rc, out, err = run(capsys, "verify", "--config", str(cfg))
    assert (rc, out) == (0, "")
    assert f"no snapshots in {snaps}\n" in err


def test_export_then_import_pins_from_the_snapshot(config, folder, llama_dir, tmp_path, capsys):
    out_dir = tmp_path / "moved"
    out_dir.mkdir()
    rc, out, err = run(capsys, "export", "doc", str(out_dir / "doc.kv.safetensors"), "--config", str(config))
    assert rc == 0, err
    assert "exported doc: 11 tokens" in out
    moved = out_dir / "doc.kv.safetensors"
    assert moved.read_bytes() == (folder / "doc.kv.safetensors").read_bytes()

    target_dir = tmp_path / "b" / "snaps"  # does not exist yet: import creates it
    target = write_config(tmp_path / "b" / "b.yaml", llama_dir, snapshots=str(target_dir))
    rc, out, err = run(capsys, "import", str(moved), "--config", str(target), "--name", "help")
    assert rc == 0, err
    assert f"as template help's snapshot {target_dir / 'help.kv.safetensors'} (11 tokens)" in out
    rc, out, err = run(capsys, "import", str(moved), "--config", str(target))  # the name the file records
    assert rc == 0, err
    assert sorted(p.name for p in target_dir.iterdir()) == ["doc.kv.safetensors", "help.kv.safetensors"]

    engine = Engine(load_config(target))
    try:
        assert engine.add_template("doc", token_ids=TEMPLATE).kv_source == "snapshot"
        assert engine.add_template("help", token_ids=TEMPLATE).kv_source == "snapshot"
        engine.check_integrity()
    finally:
        engine.shutdown()


def test_export_into_a_folder_names_the_file_after_the_template(config, folder, tmp_path, capsys):
    out_dir = tmp_path / "moved"
    out_dir.mkdir()
    rc, out, err = run(capsys, "export", "faq", str(out_dir), "--config", str(config))
    assert rc == 0, err
    assert "exported faq: 5 tokens" in out and str(out_dir / "faq.kv.safetensors") in out
    assert [p.name for p in out_dir.iterdir()] == ["faq.kv.safetensors"]
    assert (out_dir / "faq.kv.safetensors").read_bytes() == (folder / "faq.kv.safetensors").read_bytes()


def test_export_refuses_a_mismatch_or_a_missing_template(folder, llama_dir, tmp_path, capsys):
    other = write_config(tmp_path / "b.yaml", llama_dir, block_size=8, snapshots=str(folder))
    rc, _, err = run(capsys, "export", "doc", str(tmp_path / "out.kv.safetensors"), "--config", str(other))
    assert rc == 1 and "block_size '4', expected '8'" in err and "nothing exported" in err
    assert not (tmp_path / "out.kv.safetensors").exists()
    rc, _, err = run(capsys, "export", "bot", str(tmp_path / "out.kv.safetensors"), "--config", str(other))
    assert rc == 1 and "'bot' has no snapshot" in err


def test_import_says_when_it_replaces_a_snapshot(folder, llama_dir, tmp_path, capsys):
    target = write_config(tmp_path / "b" / "b.yaml", llama_dir, snapshots=str(tmp_path / "b" / "snaps"))
    rc, out, err = run(capsys, "import", str(folder / "doc.kv.safetensors"), "--config", str(target))
    assert rc == 0, err
    assert "(11 tokens)" in out and "replacing" not in out
    rc, out, err = run(capsys, "import", str(folder / "faq.kv.safetensors"), "--config", str(target), "--name", "doc")
    assert rc == 0, err
    assert "(5 tokens, replacing the previous one)" in out


def test_import_refuses_a_file_of_another_block_size(folder, llama_dir, tmp_path, capsys):
    target_dir = tmp_path / "b" / "snaps"
    target = write_config(tmp_path / "b.yaml", llama_dir, block_size=8, snapshots=str(target_dir))
    rc, out, err = run(capsys, "import", str(folder / "doc.kv.safetensors"), "--config", str(target))
    assert rc == 1 and out == ""
    assert "does not match the config's model (block_size '4', expected '8'); nothing imported" in err
    assert not target_dir.exists()  # no file, no temp file, not even the folder the import would have made
    target_dir.mkdir()
    assert run(capsys, "import", str(folder / "doc.kv.safetensors"), "--config", str(target))[0] == 1
    assert target_dir.is_dir() and list(target_dir.iterdir()) == []  # a folder that was there stays


def test_an_import_whose_folder_cannot_be_written_exits_1(folder, llama_dir, tmp_path, capsys):
    """A snapshot folder that cannot be made (here, under a regular file) is a file that cannot be
    written: exit 1, as for a mismatch, not 2 (the command was asked right)."""
    (tmp_path / "a-file").write_text("not a folder")
    target = write_config(tmp_path / "b.yaml", llama_dir, snapshots=str(tmp_path / "a-file" / "snaps"))
    rc, out, err = run(capsys, "import", str(folder / "doc.kv.safetensors"), "--config", str(target))
    assert (rc, out) == (1, "") and err.startswith("error: ") and "a-file" in err
    assert (tmp_path / "a-file").read_text() == "not a folder"


def test_usage_errors_exit_2(config, folder, llama_dir, tmp_path, capsys):
    assert run(capsys, "verify", "--config", str(tmp_path / "absent.yaml"))[0] == 2
    assert run(capsys, "verify", "--config", str(config), str(tmp_path / "absent"))[0] == 2
    off = write_config(tmp_path / "off.yaml", llama_dir, snapshots="")
    rc, _, err = run(capsys, "verify", "--config", str(off))
    assert rc == 2 and "keeps no template snapshots" in err
    no_model = tmp_path / "nomodel.yaml"
    no_model.write_text(yaml.safe_dump({"model": {"path": str(tmp_path / "nothing"), "device": "cpu"}}))
    assert run(capsys, "verify", "--config", str(no_model))[0] == 2
    assert run(capsys, "import", str(tmp_path / "absent.kv.safetensors"), "--config", str(config))[0] == 2
    assert run(capsys, "import", str(folder / "doc.kv.safetensors"), "--config", str(config),
               "--name", "../x")[0] == 2
    assert run(capsys, "export", "doc", str(tmp_path / "no" / "such" / "f"), "--config", str(config))[0] == 2
    rc, _, err = run(capsys, "export", "doc", f"{tmp_path / 'newdir'}/", "--config", str(config))
    assert rc == 2 and "is not a folder" in err and not (tmp_path / "newdir").exists()  # a folder by its slash
    with pytest.raises(SystemExit) as exc:  # argparse: --config is required
        main(["snapshot", "verify"])
    assert exc.value.code == 2


def test_the_default_folder_is_the_servers(folder, llama_dir, tmp_path, capsys):
    """No cache.snapshot_dir: the folder next to the state file, as the server's (parts.with_snapshot_dir)."""
    from prefix_service.server.parts import with_snapshot_dir
    from prefix_service.server.store import TemplateStore
    cfg_file = write_config(tmp_path / "svc.yaml", llama_dir)
    cfg = load_config(cfg_file)
    assert snapshot_dir(cfg, state_path(cfg)) == tmp_path / "svc.snapshots"
    assert with_snapshot_dir(cfg, TemplateStore(tmp_path / "svc.state.json")).engine.cache.snapshot_dir == \
        str(tmp_path / "svc.snapshots")
    assert snapshot_dir(cfg, None) is None
    assert snapshot_dir(load_config(write_config(tmp_path / "x.yaml", llama_dir, snapshots="")), None) is None

    (tmp_path / "svc.snapshots").mkdir()
    (tmp_path / "svc.snapshots" / "doc.kv.safetensors").write_bytes((folder / "doc.kv.safetensors").read_bytes())
    rc, out, _ = run(capsys, "verify", "--config", str(cfg_file))
    assert rc == 0 and list(lines(out)) == ["doc"]
