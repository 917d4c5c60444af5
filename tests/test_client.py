"""The Python client (prefix_service/client.py) against a real server on the tiny model: it sends the
admin token as `authorization: Bearer <token>`, and a seed of 0 is a seed (a reproducible sample),
not the absence of one."""
from __future__ import annotations

import grpc
import pytest

from server_fixtures import DOCUMENT, Clients, collect, started_servers

from prefix_service.client import PrefixServiceClient
from prefix_service.config import TemplateSpec
from prefix_service.proto import prefix_service_pb2 as pb


@pytest.fixture
def make_server(model_dir, tmp_path, monkeypatch):
    with started_servers(model_dir, tmp_path, monkeypatch, prefixes=(TemplateSpec("doc", content=DOCUMENT),)) as f:
        yield f


def test_client_sends_the_admin_token(make_server):
    st = make_server(token="s3cret-token")
    with PrefixServiceClient(st.address, token="s3cret-token") as client:
        added = client.add_template("faq", "the answer to every question is in the account page")
        assert (added.name, added.origin, added.kind) == ("faq", "admin", "content")
        assert [t.name for t in client.list_templates()] == ["doc", "faq"]
        assert not client.remove_template("faq").deferred
        assert [t.name for t in client.list_templates()] == ["doc"]
    with PrefixServiceClient(st.address) as anonymous, pytest.raises(grpc.RpcError) as info:
        anonymous.list_templates()
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_client_seed_zero_samples_as_seed_zero(make_server):
    st = make_server()
    raw = Clients(st.address)
    try:
        request = pb.GenerateRequest(prefix_name="doc", prompt=" the", sampling=pb.SamplingParams(
            max_tokens=16, temperature=1.0, ignore_eos=True, seed=0))
        _, want, _ = collect(raw.generation.Generate(request))
    finally:
        raw.close()
    with PrefixServiceClient(st.address) as client:
        for _ in range(2):
            _, got, last = collect(client.generate(" the", "doc", max_tokens=16, temperature=1.0, seed=0,
                                                   ignore_eos=True))
            assert got == want and last.usage.completion_tokens == 16


def test_a_client_asked_for_tls_does_not_fall_back_to_plaintext(make_server):
    """tls=True without a CA file is TLS checked against the system's roots: against a plaintext
    server the call fails (UNAVAILABLE), it is not sent in clear."""
    st = make_server()
    with PrefixServiceClient(st.address) as plain:
        assert plain.server_info(timeout=30).model
    with PrefixServiceClient(st.address, tls=True) as client, pytest.raises(grpc.RpcError) as info:
        client.server_info(timeout=30)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_client_structured_output_from_a_mapping_constrains_the_output(make_server):
    """structured_output={"choice": [...]} is the request's choice (the same message as a raw
    pb.StructuredOutput gives); a json_schema given as a dict is sent as its JSON text."""
    st = make_server()
    choices = [" yes", " no", " maybe later"]
    with PrefixServiceClient(st.address) as client:
        text, tokens, last = collect(client.generate(" the", "doc", max_tokens=12, temperature=1.0, seed=3,
                                                     structured_output={"choice": choices}))
        assert text in choices and last.finish_reason == pb.FINISH_REASON_STOP
        raw = pb.StructuredOutput(choice=pb.Choices(choices=choices))
        again = collect(client.generate(" the", "doc", max_tokens=12, temperature=1.0, seed=3, structured_output=raw))
        assert (again[0], again[1]) == (text, tokens)
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                  "additionalProperties": False}
        text, _, _ = collect(client.generate(" the", "doc", max_tokens=16, structured_output={"json_schema": schema}))
        assert text in ('{"ok":true}', '{"ok":false}')


@pytest.mark.parametrize("bad", [{"choices": ["a"]}, {"choice": "yes"}, {"regex": "a", "text": True}, ["choice"]])
def test_client_structured_output_refuses_what_is_not_one_kind(bad):
    with PrefixServiceClient("127.0.0.1:1") as client, pytest.raises(ValueError, match="structured_output"):
        next(client.generate(" the", "doc", structured_output=bad))
