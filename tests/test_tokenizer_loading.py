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
