"""load_tokenizer gives the tokenizer AutoTokenizer gives, without the model's config class when the
tokenizer names its own class (that class's imports cost seconds of every start), and falls back to
AutoTokenizer's own choice from the model's config when it names none or brings its own code."""
import json
import shutil

import pytest

from helpers import assert_same_tokenizer
from prefix_service.model.loader import _tokenizer_config_kwargs, load_tokenizer


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3"])
def test_the_tokenizer_is_the_one_autotokenizer_loads(model_dirs, arch):
    from transformers import AutoTokenizer
    path = model_dirs[arch]
    light = _tokenizer_config_kwargs(path)["config"]  # the tokenizer names its class: the light config
    assert light.model_type == arch == json.loads((path / "config.json").read_text())["model_type"]
    assert_same_tokenizer(load_tokenizer(path), AutoTokenizer.from_pretrained(str(path)))


@pytest.mark.parametrize("change", ["no tokenizer_class", "auto_map", "no model_type", "bad json"])
def test_anything_else_gets_autotokenizers_own_choice(model_dirs, tmp_path, change):
    from transformers import AutoTokenizer
    path = tmp_path / "model"
    shutil.copytree(model_dirs["llama"], path)
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    model_config = json.loads((path / "config.json").read_text())
    if change == "no tokenizer_class":
        del tokenizer_config["tokenizer_class"]
    elif change == "auto_map":
        tokenizer_config["auto_map"] = {"AutoTokenizer": [None, None]}
    elif change == "no model_type":
        del model_config["model_type"]
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (path / "config.json").write_text("{" if change == "bad json" else json.dumps(model_config))
    assert _tokenizer_config_kwargs(path) == {}
    if change == "no tokenizer_class":  # AutoTokenizer itself still loads this one
        assert_same_tokenizer(load_tokenizer(path), AutoTokenizer.from_pretrained(str(path)))


def test_a_tokenizer_saved_as_vocab_and_merges_alone_loads(model_dirs, tmp_path):
    """A checkpoint whose tokenizer is vocab.json and merges.txt (no tokenizer.json) loads, as AutoTokenizer
    loads it, and splits text into the ids of the same BPE saved as tokenizer.json."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer
    path = tmp_path / "model"
    shutil.copytree(model_dirs["llama"], path)
    Tokenizer.from_file(str(path / "tokenizer.json")).model.save(str(path))  # vocab.json, merges.txt
    (path / "tokenizer.json").unlink()
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GPT2Tokenizer", "eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>",
        "add_prefix_space": False}))
    tok = load_tokenizer(path)
    assert_same_tokenizer(tok, AutoTokenizer.from_pretrained(str(path)))
    full = load_tokenizer(model_dirs["llama"])
    for text in ("the quick brown fox jumps over a lazy dog", "refund order 42 for the account"):
        assert tok(text)["input_ids"] == full(text)["input_ids"]
