"""Synthetic models for tests and benchmarks: a small BPE tokenizer trained locally, random-weight
Hugging Face models of any Llama-family shape, and config-only directories for `load_format: dummy`."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
          "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 512

_WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly brew potent elixirs "
          "classify intent label example user assistant system question answer table row column value "
          "price order refund shipping account password reset billing cancel upgrade weather music "
          "héllo naïve café 東京 北京 пример ü ö ß € 😀 🚀 données société").split()


def _corpus() -> list[str]:
    import random
    rng = random.Random(0)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 30))) for _ in range(2000)]


def build_tokenizer(path: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                   unk_token=None, pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(str(path))
    return path


def tiny_config(arch: str, vocab_size: int, **overrides):
    from transformers import AutoConfig
    common: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, rms_norm_eps=1e-6,
        tie_word_embeddings=False, eos_token_id=0, bos_token_id=0, rope_theta=10000.0)
    model_type = {"llama": "llama", "qwen2": "qwen2", "mistral": "mistral", "qwen3": "qwen3"}[arch]
    if arch == "mistral":
        common["sliding_window"] = None
    if arch == "qwen3":
        common["head_dim"] = 32
    if arch == "qwen2":
        common["use_sliding_window"] = False
    common.update(overrides)
    return AutoConfig.for_model(model_type, **common)


def build_model(path: Path, arch: str, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """Save a random model of the given architecture, with the test tokenizer, under path."""
    import shutil
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(arch, VOCAB_SIZE, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(str(path), safe_serialization=True)
    for f in Path(tokenizer_dir).iterdir():
        shutil.copy(f, path / f.name)
    return path


LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                 rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False)


def build_config_only(path: Path, tokenizer_dir: Path, arch: str = "llama", **shape) -> Path:
    """A model directory with config.json and a tokenizer but no weights: serve it with
    model.load_format = dummy (random weights made on the device)."""
    import shutil
    cfg = tiny_config(arch, shape.pop("vocab_size", VOCAB_SIZE), **shape)
    cfg.architectures = [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                          "mistral": "MistralForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]]
    path.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(str(path))
    for f in Path(tokenizer_dir).iterdir():
        shutil.copy(f, path / f.name)
    return path
