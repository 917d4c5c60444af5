"""Load a Hugging Face model directory (config.json, *.safetensors, tokenizer files) into our decoder."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from prefix_service import cpuinfo
from prefix_service.errors import ModelLoadError
from prefix_service.model.llama import LlamaForCausalLM, ModelArch, RotaryEmbedding

SUPPORTED_ARCHITECTURES = {
    # architecture -> (qkv_bias, qk_norm)
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_arch(model_dir: str | os.PathLike) -> ModelArch:
    path = Path(model_dir)
    cfg_file = path / "config.json"
    if not path.is_dir():
        raise ModelLoadError(f"model directory {path} does not exist")
    if not cfg_file.is_file():
        raise ModelLoadError(f"{path} has no config.json; expected a Hugging Face model directory")
    try:
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{cfg_file}: cannot be read as JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{cfg_file}: expected a JSON object, got {type(cfg).__name__}")
    try:
        return _arch_from(cfg, cfg_file)
    except KeyError as e:
        raise ModelLoadError(f"{cfg_file}: the key {e} is missing; expected a Hugging Face model config") from None
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{cfg_file}: a value is malformed ({e}); expected a Hugging Face model config") \
            from None


def _arch_from(cfg: dict[str, Any], cfg_file: Path) -> ModelArch:
    archs = cfg.get("architectures") or []
    arch_name = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch_name is None:
        raise ModelLoadError(
            f"unsupported architecture {archs or cfg.get('model_type')!r} in {cfg_file}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    qkv_bias, qk_norm = SUPPORTED_ARCHITECTURES[arch_name]
    qkv_bias = bool(cfg.get("attention_bias", qkv_bias))
    # transformers >= 5 writes rope settings under rope_parameters; older configs at the top level
    rope = cfg.get("rope_parameters") or {}
    rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    num_heads = cfg["num_attention_heads"]
    if cfg.get("mlp_bias"):
        raise ModelLoadError(f"{cfg_file}: mlp_bias=true is not supported")
    return ModelArch(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None,
    )


def checkpoint_dtype(model_dir: str | os.PathLike) -> torch.dtype:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return _DTYPES.get(str(name).replace("torch.", ""), torch.float32)


def choose_dtype(name: str, model_dir: str | os.PathLike, device: torch.device,
                 cpu_flags: frozenset[str] | None = None, cpu_vendor: str | None = None) -> tuple[torch.dtype, str]:
    """model.dtype -> (the dtype, why). 'auto': on a GPU the checkpoint's dtype (bf16 when it is
    float32); on a CPU where bf16 outruns float32 (cpuinfo.bf16_is_faster: AMX-BF16, or AVX512-BF16
    on an AMD Zen 4 or 5) bfloat16, which the cpu backend's oneDNN linears multiply on those units
    with half the weight bytes to stream (docs/benchmarks.md: on a 2-vCPU AVX512-BF16 EPYC a first
    token 1.6x sooner and 1.4x the tokens per second of float32 at 16 and 64 requests); elsewhere
    float32: without bf16 units bf16 is only converted to float32 on the way, and an Intel core's
    AVX512-BF16 dot products without AMX run at half its float32 FMA rate."""
    if name != "auto":
        return _DTYPES[name], "asked for (model.dtype)"
    if device.type == "cpu":
        units = cpuinfo.bf16_units(cpu_flags)
        if cpuinfo.bf16_is_faster(cpu_flags, cpu_vendor):
            return torch.bfloat16, (f"auto, on a CPU: bfloat16 (this CPU has bf16 matrix units: {', '.join(units)}; "
                                    f"model.dtype: float32 for float32 arithmetic)")
        have = ", ".join(cpuinfo.isa(cpu_flags)) or "no AVX"
        if units:  # Intel's AVX512-BF16 without AMX
            return torch.float32, (f"auto, on a CPU: float32 (this Intel CPU has {have} but no AMX: its bf16 dot "
                                   f"products run at half its float32 rate; model.dtype: bfloat16 to ask for bf16)")
        return torch.float32, f"auto, on a CPU: float32 (this CPU has no bf16 matrix units; it has {have})"
    dtype = checkpoint_dtype(model_dir)
    if dtype == torch.float32:
        return torch.bfloat16, "auto, on a GPU: bfloat16 for a float32 checkpoint"
    return dtype, "auto, on a GPU: the checkpoint's dtype"


def resolve_dtype(name: str, model_dir: str | os.PathLike, device: torch.device) -> torch.dtype:
    """The dtype of choose_dtype."""
    return choose_dtype(name, model_dir, device)[0]


def _safetensors_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors weights (only safetensors checkpoints are supported)")
    return files


def _hf_to_ours(name: str) -> tuple[str, str | None]:
    """HF weight name -> (our parameter name, fused part or None)."""
    if name.startswith("model."):
        name = name[len("model."):]
    for part in ("q_proj", "k_proj", "v_proj"):
        if f".self_attn.{part}." in name:
            return name.replace(f".{part}.", ".qkv_proj."), part
    for part in ("gate_proj", "up_proj"):
        if f".mlp.{part}." in name:
            return name.replace(f".{part}.", ".gate_up_proj."), part
    return name, None


def dummy_model(model_dir: str | os.PathLike, dtype: torch.dtype, device: torch.device,
                max_positions: int, seed: int = 0) -> LlamaForCausalLM:
    """Random weights of the directory's architecture, made on the device (no weight files read)."""
    arch = read_arch(model_dir)
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(arch, max_positions)
    finally:
        torch.set_default_dtype(default)
    model.rotary = RotaryEmbedding(arch, max_positions).to(device)
    return model.eval()


def load_model(model_dir: str | os.PathLike, dtype: torch.dtype, device: torch.device,
               max_positions: int) -> LlamaForCausalLM:
    path = Path(model_dir)
    arch = read_arch(path)
    with torch.device("meta"):
        model = LlamaForCausalLM(arch, max_positions)
    params = dict(model.named_parameters())
    # fused parameters are gathered part by part, then concatenated in this order
    order = {"q_proj": 0, "k_proj": 1, "v_proj": 2, "gate_proj": 0, "up_proj": 1}
    parts: dict[str, dict[str, torch.Tensor]] = {}
    state: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                ours, part = _hf_to_ours(key)
                if ours not in params:
                    continue  # e.g. rotary inv_freq buffers, or lm_head of a tied model
                tensor = f.get_tensor(key).to(dtype)
                if part is None:
                    state[ours] = tensor
                else:
                    parts.setdefault(ours, {})[part] = tensor
    for ours, got in parts.items():
        names = sorted(got, key=order.__getitem__)
        expected = ["q_proj", "k_proj", "v_proj"] if "qkv_proj" in ours else ["gate_proj", "up_proj"]
        if names != expected:
            missing = sorted(set(expected) - set(names))
            raise ModelLoadError(f"{path}: weight {ours} is missing parts {missing}")
        state[ours] = torch.cat([got[n] for n in names], dim=0)
    missing = sorted(set(params) - set(state))
    if missing:
        raise ModelLoadError(f"{path}: missing weights {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(params[name].shape):
            raise ModelLoadError(f"{path}: weight {name} has shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}")
    model.load_state_dict({k: v.to(device) for k, v in state.items()}, strict=False, assign=True)
    model.rotary = RotaryEmbedding(arch, max_positions).to(device)
    return model.eval()


def load_tokenizer(model_dir: str | os.PathLike):
    path = Path(model_dir)
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        raise ModelLoadError(f"{path} has no tokenizer files (expected one of {', '.join(_TOKENIZER_FILES)})")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), **_tokenizer_config_kwargs(path))


def _tokenizer_config_kwargs(path: Path) -> dict:
    """AutoTokenizer's `config`, when the tokenizer names its own class: a base config holding the
    model type, the only fields of the model's config that its choice then reads. Without it
    AutoTokenizer loads the architecture's config class, whose imports (torch.distributed.tensor
    among them) take about a second of every start on a 2-core CPU. A tokenizer that names no
    class, or brings its own code (auto_map), gets the full config: its class comes from the
    config's type."""
    try:
        tokenizer_config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
        model_config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(tokenizer_config, dict) or not isinstance(model_config, dict) or \
            not tokenizer_config.get("tokenizer_class") or "auto_map" in tokenizer_config or \
            not isinstance(model_config.get("model_type"), str):
        return {}
    from transformers import PretrainedConfig

    config = PretrainedConfig(tokenizer_class=model_config.get("tokenizer_class"))
    config.model_type = model_config["model_type"]
    config._name_or_path = str(path)
    return {"config": config}
