"""glibc malloc settings for CPU engines (backends/hostmem.py): with them, an engine's long
prefills, with short ones between them, reuse the memory the last one freed without page faults,
whether its steps run on the calling thread or on the Engine's loop thread (which has a malloc
arena of its own), in every memory layout tried; an operator's environment is kept."""
import json
import os
import platform
import subprocess
import sys

import pytest

from prefix_service.backends import hostmem
from prefix_service.synthetic import VOCAB_SIZE, tiny_config

glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                           reason="glibc malloc only")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# an engine on a model with the default model's layer sizes (random weights): long prefills, short
# ones between them; the page faults of each request
PREFILLS = r"""
import json, random, resource, sys, time
from prefix_service.config import CacheConfig, EngineConfig, ModelConfig
from prefix_service.engine.core import EngineCore
from prefix_service.sampling_params import SamplingParams
core = EngineCore(EngineConfig(ModelConfig(path=sys.argv[1], load_format="dummy", device="cpu"),
                               CacheConfig(num_blocks=300)))
rng = random.Random(0)
def faults(n):
    core.add_request(f"r{n}-{time.perf_counter()}", [rng.randrange(400) for _ in range(n)], None,
                     SamplingParams(max_tokens=1, ignore_eos=True), lambda out: None)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    while core.has_work():
        core.step()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps([faults(n) for n in (1000, 1000, 100, 100, 1000, 100, 1000, 100, 1000, 1000)]))
"""

# the same through the Engine, whose loop thread runs the steps (and allocates from an arena of its own)
ENGINE_PREFILLS = r"""
import json, random, resource, sys
from prefix_service import Engine, GenerateRequest, SamplingParams
from prefix_service.config import CacheConfig, EngineConfig, ModelConfig
engine = Engine(EngineConfig(ModelConfig(path=sys.argv[1], load_format="dummy", device="cpu"),
                             CacheConfig(num_blocks=300)))
rng = random.Random(0)
def faults(n):
    req = GenerateRequest(prompt_token_ids=[rng.randrange(400) for _ in range(n)],
                          sampling=SamplingParams(max_tokens=1, ignore_eos=True))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    engine.generate([req])
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps([faults(n) for n in (1000, 1000, 100, 100, 1000, 100, 1000, 100, 1000, 1000)]))
engine.shutdown()
"""


def _run(code: str, *args: str) -> list[int]:
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env={k: v for k, v in os.environ.items() if k not in hostmem._ENV})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@glibc
@pytest.mark.parametrize("script", [PREFILLS, ENGINE_PREFILLS], ids=["core", "engine-thread"])
# the same script with 0, 1 and 100 more characters on its command line: where the process's
# allocations land shifts with everything allocated before, and with it whether a step's memory
# needs a heap of its own in the loop thread's arena (which glibc unmapped once free, by default)
@pytest.mark.parametrize("layout", ["", "\n", "#" * 100], ids=["layout0", "layout1", "layout100"])
def test_engine_prefills_take_no_page_faults_once_warm(tmp_path, tokenizer_dir, script, layout):
    import shutil
    cfg = tiny_config("llama", VOCAB_SIZE, hidden_size=576, intermediate_size=1536, num_hidden_layers=6,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048)
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(str(tmp_path))
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, tmp_path / f.name)
    faults = _run(script + layout, str(tmp_path))
    # a 1,000-token forward of these layers touches ~30,000 pages of activations; with glibc's
    # defaults the long prefills after short ones often fault on most of them again
    later = sorted(faults[i] for i in (4, 6, 8, 9))
    assert later[1] < 500, faults  # the median: none, bar an occasional growth of the heap


@glibc
@pytest.mark.parametrize("name", hostmem._ENV)
def test_operator_settings_are_kept(monkeypatch, name):
    for other in hostmem._ENV:
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setattr(hostmem, "_applied", None)
    monkeypatch.setenv(name, "glibc.malloc.top_pad=1000000" if name == "GLIBC_TUNABLES" else "1000000")
    assert hostmem.keep_freed_memory() == "malloc settings from the environment kept"
    monkeypatch.setattr(hostmem, "_applied", None)  # the next engine applies its own again
