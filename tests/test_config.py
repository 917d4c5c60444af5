"""YAML config: every key validated, errors name the key, the value and what is allowed."""
import pytest

from helpers import model_copy
from prefix_service.config import ConfigError, config_from_dict, load_config, parse_size


def test_full_config_roundtrip(tmp_path):
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "intent.txt").write_text("classify")
    path = tmp_path / "svc.yaml"
    path.write_text("""
model: {path: models/m, dtype: float32, device: cpu}
cache: {block_size: 16, kv_cache_memory: 2GiB, prefix_budget_blocks: 100}
scheduler: {max_num_seqs: 8, max_num_batched_tokens: 512, max_queue: 10}
prefixes:
  - {name: intent_classifier, file: prompts/intent.txt}
  - {name: table_qa, content: "You are a helpful assistant"}
""")
    cfg = load_config(path)
    assert cfg.engine.model.path == str((tmp_path / "models" / "m").resolve())
    assert cfg.engine.cache.kv_cache_memory == 2 * 1024**3
    assert cfg.engine.scheduler.max_num_seqs == 8
    assert [p.name for p in cfg.prefixes] == ["intent_classifier", "table_qa"]
    assert cfg.prefixes[0].read_text() == "classify"


@pytest.mark.parametrize("raw,match", [
    ({"model": {"path": "m"}, "cahce": {}}, r"unknown key\(s\) cahce; known keys: model, cache, scheduler"),
    ({"model": {"path": "m", "dtyp": "float32"}}, r"model: unknown key\(s\) dtyp; known keys: path, dtype"),
    ({"model": {"path": "m", "dtype": "int8"}}, r"model.dtype: 'int8' is not one of auto, float32"),
    ({"model": {"path": "m"}, "cache": {"block_size": 0}}, r"cache.block_size: expected an integer in \[1, 4096\]"),
    ({"model": {"path": "m"}, "cache": {"kv_cache_memory": "lots"}}, "cache.kv_cache_memory: expected a size"),
    ({"model": {"path": "m"}, "scheduler": {"max_num_seqs": "8"}}, "scheduler.max_num_seqs: expected an integer"),
    # no sequence could ever run: every request would wait forever
    ({"model": {"path": "m"}, "scheduler": {"max_num_seqs": 0}}, r"scheduler.max_num_seqs: expected an integer >= 1, "
                                                                  r"got 0"),
    ({"model": {"path": "m"}, "prefixes": [{"name": "a", "content": "x", "file": "y"}]}, "exactly one of"),
    ({"model": {"path": "m"}, "prefixes": [{"name": "a b", "content": "x"}]}, "invalid prefix name 'a b'"),
    ({"model": {"path": "m"}, "prefixes": [{"name": "a", "content": "x"}, {"name": "a", "content": "y"}]},
     "appears twice"),
    ({"cache": {}}, "the 'model' section"),
    ({"model": {"path": "m"}, "server": {"http_address": "8000"}}, "server.http_address: expected host:port"),
    ({"model": {"path": "m"}, "server": {"http_address": "127.0.0.1:50051"}}, "server.http_address: .* is "
                                                                              "server.address itself"),
    ({"model": {"path": "m"}, "server": {"api_key_env": "my key"}}, "server.api_key_env: expected an environment"),
    ({"model": {"path": "m", "served_name": ""}}, "model.served_name: expected a model id"),
    ({"model": {"path": "m"}, "cache": {"gpu_memory_utilization": 0}}, r"cache.gpu_memory_utilization: expected a "
                                                                        r"fraction in \(0, 1\]"),
    ({"model": {"path": "m", "cuda_graph_max_batch": -1}}, "model.cuda_graph_max_batch: expected an integer"),
    ({"model": {"path": "m", "cuda_fused_layers": "yes"}}, "model.cuda_fused_layers: expected true or false"),
    ({"model": {"path": "m", "seed": "abc"}}, "model.seed: expected an integer"),
    ({"model": {"path": "m", "seed": [1, 2]}}, "model.seed: expected an integer"),
    # the engine needs two blocks at least: one block was blamed on cache.kv_cache_memory
    ({"model": {"path": "m"}, "cache": {"num_blocks": 1}}, r"cache.num_blocks: expected an integer >= 2"),
    # two listening addresses alike: the start blamed another server
    ({"model": {"path": "m"}, "server": {"http_address": "127.0.0.1:8181", "metrics_address": "127.0.0.1:8181"}},
     "server.http_address: .* is server.metrics_address itself"),
    ({"model": {"dtype": "auto"}}, "model.path: required"),
    # a template with no text at all: refused, not pinned as an empty prefix
    ({"model": {"path": "m"}, "prefixes": [{"name": "a"}]},
     r"prefixes\[a\]: give exactly one of content, file or system_prompt \(got none\)"),
    # a control character would break the HTTP API's model list and the metrics' labels
    ({"model": {"path": "m", "served_name": "smol\nlm"}}, "model.served_name: expected a model id"),
    ({"model": {"path": "m"}, "cache": {"snapshot_dir": 5}}, "cache.snapshot_dir: expected a folder"),
])
def test_errors_name_the_key(raw, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict(raw)


def test_files_that_are_not_utf8_text_are_config_errors(tmp_path):
    """A config or template file in another encoding: one clear error, not a traceback."""
    from prefix_service.config import TemplateSpec
    path = tmp_path / "svc.yaml"
    path.write_bytes(b"model: {path: m}  # caf\xe9\n")
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(path)
    prompt = tmp_path / "prompt.txt"
    prompt.write_bytes(b"abc\xff\xfe")
    with pytest.raises(ConfigError, match=r"prefixes\[a\].file: cannot read"):
        TemplateSpec("a", file=str(prompt)).read_text()


def test_kv_cache_memory_auto_and_the_gpu_share():
    cfg = config_from_dict({"model": {"path": "m"}, "cache": {"kv_cache_memory": "auto", "gpu_memory_utilization": 0.8}})
    assert cfg.engine.cache.kv_cache_memory == "auto" and cfg.engine.cache.gpu_memory_utilization == 0.8
    assert config_from_dict({"model": {"path": "m"}}).engine.cache.kv_cache_memory == "auto"  # the default
    assert config_from_dict({"model": {"path": "m", "cuda_graph_max_batch": 0}}).engine.model.cuda_graph_max_batch == 0
    assert config_from_dict({"model": {"path": "m"}}).engine.model.cuda_fused_layers is True
    assert config_from_dict({"model": {"path": "m", "cuda_fused_layers": False}}).engine.model.cuda_fused_layers is False


def test_sizes():
    assert parse_size("512MiB", "k") == 512 * 1024**2
    assert parse_size("1.5GB", "k") == 1_500_000_000
    assert parse_size(4096, "k") == 4096
    for bad in ("-1GiB", 0, True, "2 parsecs"):
        with pytest.raises(ConfigError):
            parse_size(bad, "k")


@pytest.mark.parametrize("text", ["0GiB", "0", "0.4", "0.0001KB"])
def test_a_size_that_comes_to_zero_bytes_is_refused(text):
    """A size written as a string that rounds down to no bytes is refused as the integer 0 is (a KV
    cache or a template limit of 0 bytes is never meant)."""
    with pytest.raises(ConfigError, match=f"cache.kv_cache_memory: expected a size .*got '{text}'"):
        config_from_dict({"model": {"path": "m"}, "cache": {"kv_cache_memory": text}})


@pytest.mark.parametrize("cache, key, value", [
    ({"gpu_memory_utilization": 1}, "gpu_memory_utilization", 1),  # the whole GPU: (0, 1] includes 1
    ({"gpu_memory_utilization": 1.0}, "gpu_memory_utilization", 1.0),
    ({"prefix_budget_blocks": 0}, "prefix_budget_blocks", 0),  # no block for templates: they are not pinned
])
def test_a_cache_value_at_the_edge_of_its_range_is_taken(cache, key, value):
    cfg = config_from_dict({"model": {"path": "m"}, "cache": cache})
    assert getattr(cfg.engine.cache, key) == value


def test_a_home_relative_path_is_under_the_home_folder_not_the_config_folder(tmp_path, monkeypatch):
    home, conf = tmp_path / "home", tmp_path / "conf"
    monkeypatch.setenv("HOME", str(home))
    cfg = config_from_dict({"model": {"path": "~/models/m"}, "cache": {"snapshot_dir": "~/snaps"},
                            "server": {"state_file": "~/state.json"}}, base_dir=conf)
    assert cfg.engine.model.path == str(home / "models" / "m")
    assert cfg.engine.cache.snapshot_dir == str(home / "snaps")
    assert cfg.server.state_file == str(home / "state.json")


def test_model_load_errors(tmp_path, llama_dir):
    import json
    import shutil

    from prefix_service.errors import ModelLoadError
    from prefix_service.model.loader import load_model, load_tokenizer, read_arch
    import torch
    with pytest.raises(ModelLoadError, match="has no config.json"):
        read_arch(tmp_path)
    for text, match in (("{bad", "cannot be read as JSON"), ("[1]", "expected a JSON object"),
                        ('{"architectures": ["LlamaForCausalLM"]}', "the key .* is missing")):
        broken = tmp_path / "broken"
        broken.mkdir(exist_ok=True)
        (broken / "config.json").write_text(text)
        with pytest.raises(ModelLoadError, match=match):  # a traceback before
            read_arch(broken)
    bad = tmp_path / "gpt2"
    shutil.copytree(llama_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported architecture.*supported: LlamaForCausalLM, Mistral"):
        read_arch(bad)
    noweights = tmp_path / "noweights"
    shutil.copytree(llama_dir, noweights)
    for f in noweights.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_model(noweights, torch.float32, torch.device("cpu"), 64)
    notok = tmp_path / "notok"
    notok.mkdir()
    with pytest.raises(ModelLoadError, match="no tokenizer files"):
        load_tokenizer(notok)


def test_a_model_directory_that_is_not_there_is_named(tmp_path):
    from prefix_service.errors import ModelLoadError
    from prefix_service.model.loader import read_arch
    with pytest.raises(ModelLoadError, match=r"model directory \S*nowhere does not exist"):
        read_arch(tmp_path / "nowhere")


def test_a_config_asking_for_mlp_biases_is_refused_by_name(tmp_path, llama_dir):
    """The decoder's MLP has no bias: a checkpoint whose config says it has one is refused, not loaded
    without them."""
    from prefix_service.errors import ModelLoadError
    from prefix_service.model.loader import read_arch
    path = model_copy(llama_dir, tmp_path / "m", config=lambda cfg: {**cfg, "mlp_bias": True})
    with pytest.raises(ModelLoadError, match="mlp_bias=true is not supported"):
        read_arch(path)
    assert read_arch(model_copy(llama_dir, tmp_path / "n", config=lambda cfg: {**cfg, "mlp_bias": False}))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3"])
def test_a_config_without_rms_norm_eps_takes_transformers_default(arch, model_dirs, tmp_path):
    from transformers import AutoConfig

    from prefix_service.model.loader import read_arch
    path = model_copy(model_dirs[arch], tmp_path / "m",
                       config=lambda cfg: {k: v for k, v in cfg.items() if k != "rms_norm_eps"})
    assert read_arch(path).rms_norm_eps == AutoConfig.from_pretrained(str(path)).rms_norm_eps


def test_a_weight_missing_whole_or_of_the_wrong_shape_is_named(tmp_path, llama_dir):
    """A checkpoint without a weight the model needs, or with one of another shape (here the final
    norm, and the first layer's o_proj with a column cut off), is refused naming it."""
    import torch

    from prefix_service.errors import ModelLoadError
    from prefix_service.model.loader import load_model

    def without_norm(tensors):
        return {k: v for k, v in tensors.items() if k != "model.norm.weight"}

    def narrow_o_proj(tensors):
        name = "model.layers.0.self_attn.o_proj.weight"
        return {**tensors, name: tensors[name][:, :-1].contiguous()}
    with pytest.raises(ModelLoadError, match=r"missing weights norm\.weight$"):
        load_model(model_copy(llama_dir, tmp_path / "a", tensors=without_norm), torch.float32,
                   torch.device("cpu"), 64)
    with pytest.raises(ModelLoadError, match=r"weight layers\.0\.self_attn\.o_proj\.weight has shape \(64, 63\), "
                                             r"expected \(64, 64\)"):
        load_model(model_copy(llama_dir, tmp_path / "b", tensors=narrow_o_proj), torch.float32,
                   torch.device("cpu"), 64)


def test_dummy_load_format_runs_without_weight_files(tmp_path, tokenizer_dir, make_engine):
    """load_format: dummy serves a config-only directory with random weights (benchmarks)."""
    from helpers import run_ids
    from prefix_service import CacheConfig, Engine, EngineConfig, ModelConfig
    from prefix_service.synthetic import build_config_only
    model_dir = build_config_only(tmp_path / "m", tokenizer_dir, "qwen2", num_hidden_layers=3)
    assert not list(model_dir.glob("*.safetensors"))
    cfg = EngineConfig(ModelConfig(path=str(model_dir), device="cpu", load_format="dummy"),
                       CacheConfig(block_size=4, num_blocks=64))
    with Engine(cfg) as engine:
        assert engine.info.arch.num_layers == 3 and engine.info.arch.qkv_bias
        out = run_ids(engine, [5, 6, 7, 8], max_tokens=5)
        assert len(out) == 5 and out == run_ids(engine, [5, 6, 7, 8], max_tokens=5)
        engine.check_integrity()


def test_thread_nice_is_validated():
    from prefix_service.config import ModelConfig
    assert ModelConfig(path="m").thread_nice is None  # the device's default (engine/threads.py)
    assert config_from_dict({"model": {"path": "m", "thread_nice": 19}}).engine.model.thread_nice == 19
    for bad in (-1, 20, True, "5", 2.5):
        with pytest.raises(ConfigError, match=r"model.thread_nice: expected an integer in \[0, 19\]"):
            ModelConfig(path="m", thread_nice=bad)


def test_num_threads_is_validated_and_applied(make_engine, llama_dir):
    import torch
    from prefix_service import CacheConfig, Engine, EngineConfig, ModelConfig
    with pytest.raises(ConfigError, match="model.num_threads: expected an integer >= 1"):
        ModelConfig(path="m", num_threads=0)
    before = torch.get_num_threads()
    try:
        with Engine(EngineConfig(ModelConfig(path=str(llama_dir), device="cpu", num_threads=1),
                                 CacheConfig(num_blocks=16))) as engine:
            # applied on the engine's thread, where all of its torch work runs
            assert engine._run(lambda core: torch.get_num_threads()) == 1
    finally:
        torch.set_num_threads(before)


def test_http_api_settings():
    cfg = config_from_dict({"model": {"path": "m"}})
    assert cfg.server.http_address == "127.0.0.1:8000" and cfg.server.api_key_env == "PREFIX_SERVICE_API_KEY"
    assert cfg.engine.model.served_name is None
    off = config_from_dict({"model": {"path": "m", "served_name": "smol"}, "server": {"http_address": ""}})
    assert off.server.http_address is None and off.engine.model.served_name == "smol"
    assert config_from_dict({"model": {"path": "m"}, "server": {"http_address": None}}).server.http_address is None
