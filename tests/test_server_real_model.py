"""End to end with the real default model (SmolLM2-135M-Instruct) behind the gRPC server.

Skipped when the model cannot be prepared here, unless PREFIX_SERVICE_REQUIRE_REAL_MODEL=1 (as
`make test` sets), which turns the skip into a failure. The templates are short so the test stays
quick on a CPU; the full default config is exercised by `make run`.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from server_fixtures import Clients, ServerThread, TOKEN_ENV, collect

from prefix_service import GenerateRequest, SamplingParams
from prefix_service.cli import main
from prefix_service.config import TemplateSpec, load_config
from prefix_service.proto import prefix_service_pb2 as pb

REPO = Path(__file__).resolve().parent.parent
SYSTEM = "You are a concise assistant. Answer in one short sentence."


@pytest.fixture(scope="module")
def real_model_dir() -> Path:
    required = os.environ.get("PREFIX_SERVICE_REQUIRE_REAL_MODEL") == "1"
    try:
        from prefix_service.prepare_model import prepare_default_model
        return prepare_default_model(progress=False)
    except Exception as e:  # noqa: BLE001 - any reason the model is not available here
        if required:
            pytest.fail(f"the real model is required (PREFIX_SERVICE_REQUIRE_REAL_MODEL=1) but: {e}")
        pytest.skip(f"real model not available: {e}")


def test_real_model_end_to_end(real_model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    cfg = load_config(REPO / "configs" / "default.yaml")
    intent_head = cfg.prefixes[0].read_text()[:1200]  # the task description and first labels
    cfg = dataclasses.replace(
        cfg,
        engine=dataclasses.replace(cfg.engine, model=dataclasses.replace(cfg.engine.model, path=str(real_model_dir)),
                                   cache=dataclasses.replace(cfg.engine.cache, kv_cache_memory=256 << 20)),
        server=dataclasses.replace(cfg.server, address="127.0.0.1:0", admin_token_env=TOKEN_ENV,
                                   state_file=str(tmp_path / "state.json")),
        prefixes=(TemplateSpec("intent_head", content=intent_head), TemplateSpec("assistant", system_prompt=SYSTEM)))
    st = ServerThread(cfg).start()
    try:
        c = Clients(st.address)
        # raw prompt on a content template: streamed == Engine.generate
        prompt = '\nMessage: "Where is my parcel? It has not arrived yet."\nIntent:'
        text, ids, last = collect(c.generation.Generate(pb.GenerateRequest(
            prefix_name="intent_head", prompt=prompt, sampling=pb.SamplingParams(max_tokens=6))))
        ref = st.engine.generate(GenerateRequest(prompt=prompt, prefix_name="intent_head",
                                                 sampling=SamplingParams(max_tokens=6)))[0]
        assert (text, ids) == (ref.text, ref.token_ids) and text.strip()
        assert last.usage.prefix_tokens == st.engine.get_template("intent_head").num_tokens > 200

        # chat on a system_prompt template == the same conversation sent whole, through the CLI
        assert main(["generate", "--address", st.address, "--chat", "--template", "assistant", "--max-tokens", "12",
                     "What is the capital of France?"]) == 0
        with_prefix = capsys.readouterr()
        assert main(["generate", "--address", st.address, "--chat", "--system", SYSTEM, "--max-tokens", "12",
                     "What is the capital of France?"]) == 0
        whole = capsys.readouterr()
        assert with_prefix.out == whole.out and "Paris" in whole.out
        assert "reused from the template" in with_prefix.err
        st.check_clean()
    finally:
        st.stop()
