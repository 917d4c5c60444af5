"""The official `openai` client against the server `make run` starts: `prefix-service serve` on
configs/default.yaml (its templates, cache and scheduler) with the real default model, in a process
of its own, stopped with SIGTERM. Structured outputs through `chat.completions.parse` with a
pydantic model, `response_format` json_schema with logprobs and `n`, and the intent template's
default output (its labels).

Skipped when the real model cannot be prepared here, unless PREFIX_SERVICE_REQUIRE_REAL_MODEL=1
(as `make test` sets), which turns the skip into a failure.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator, Literal

import pytest
import yaml
from pydantic import BaseModel

REPO = Path(__file__).resolve().parent.parent
MODEL = "SmolLM2-135M-Instruct"
LABELS = [" order_status", " order_change", " cancel_order", " return_refund", " billing", " product_question",
          " damaged_item", " account", " warranty_repair", " feedback", " other"]


class Ticket(BaseModel):
    intent: Literal["billing", "shipping", "account", "other"]
    urgent: bool


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[str]:
    """make run's server: the default config with the prepared model, its own process."""
    required = os.environ.get("PREFIX_SERVICE_REQUIRE_REAL_MODEL") == "1"
    try:
        from prefix_service.prepare_model import prepare_default_model
        model = prepare_default_model(progress=False)
    except Exception as e:  # noqa: BLE001 - any reason the model is not available here
        if required:
            pytest.fail(f"the real model is required (PREFIX_SERVICE_REQUIRE_REAL_MODEL=1) but: {e}")
        pytest.skip(f"real model not available: {e}")
    root = tmp_path_factory.mktemp("make-run")
    shutil.copytree(REPO / "configs", root / "configs")  # the state file goes next to the config, here
    config = root / "configs" / "default.yaml"
    raw = yaml.safe_load(config.read_text())
    raw["model"]["path"] = str(model)
    config.write_text(yaml.safe_dump(raw))
    http = f"127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if k not in ("PREFIX_SERVICE_API_KEY", "PREFIX_SERVICE_ADMIN_TOKEN")}
    log = open(root / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "prefix_service.cli", "serve", "--config", str(config),
                             "--address", "127.0.0.1:0", "--http-address", http],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root)
    base = f"http://{http}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"the server exited ({proc.returncode}):\n{(root / 'server.log').read_text()}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"not healthy within 300 s:\n{(root / 'server.log').read_text()}")
            time.sleep(0.5)
        yield base + "/v1"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        log.close()
        assert code == 0, (root / "server.log").read_text()


@pytest.fixture
def client(server):
    import openai
    return openai.OpenAI(base_url=server, api_key="unused", max_retries=0, timeout=120)


def test_parse_with_a_pydantic_model(client):
    resp = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "I was charged twice for one order! Classify it."}],
        response_format=Ticket, max_tokens=40, temperature=0)
    choice = resp.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Ticket)
    assert Ticket.model_validate_json(choice.message.content) == choice.message.parsed


def test_json_schema_with_logprobs_and_n(client):
    schema = {**Ticket.model_json_schema(), "additionalProperties": False}  # as OpenAI's strict schemas are
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Where is my parcel? Classify it."}], max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "ticket", "schema": schema, "strict": True}},
        logprobs=True, top_logprobs=2, n=3, temperature=0.8, seed=5)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    for choice in resp.choices:
        ticket = Ticket.model_validate_json(choice.message.content)
        assert json.loads(choice.message.content) == ticket.model_dump()
        tokens = choice.logprobs.content
        assert "".join(t.token for t in tokens) == choice.message.content
        assert all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in tokens)
    assert resp.usage.completion_tokens == sum(len(c.logprobs.content) for c in resp.choices)


def test_the_intent_template_answers_one_of_its_labels(client):
    """configs/default.yaml gives intent_classifier its labels as its default output."""
    for message in ("I was charged twice", "My tent pole snapped, can you repair it?"):
        resp = client.completions.create(model="intent_classifier", prompt=f'Message: "{message}"\nIntent:',
                                         max_tokens=8, temperature=0)
        assert resp.choices[0].text in LABELS and resp.choices[0].finish_reason == "stop"
        assert resp.usage.prompt_tokens_details.cached_tokens > 900  # the template's tokens, reused
