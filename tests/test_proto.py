"""The committed stubs: regenerated from proto/prefix_service.proto they are byte-identical, they
import on old protobuf runtimes (no gencode version check above setup.cfg's floor), and the
contract names of docs/DESIGN (services, RPCs, fields) are all there."""
from __future__ import annotations

import configparser
import re
from pathlib import Path

import pytest

from prefix_service.proto import prefix_service_pb2 as pb
from prefix_service.proto.regenerate import GENERATED, PINNED_GRPCIO_TOOLS, generate

REPO = Path(__file__).resolve().parent.parent
PACKAGE_PROTO = REPO / "prefix_service" / "proto"


def _requirements(section: str, key: str) -> list[str]:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    return [line.strip() for line in cfg[section][key].splitlines() if line.strip()]


def test_pin_matches_setup_cfg():
    assert f"grpcio-tools=={PINNED_GRPCIO_TOOLS}" in _requirements("options.extras_require", "test")


def test_regenerated_stubs_match_the_committed_ones(tmp_path):
    from importlib.metadata import version
    installed = version("grpcio-tools")
    if installed != PINNED_GRPCIO_TOOLS:
        pytest.fail(f"grpcio-tools {installed} is installed; the stubs are generated with {PINNED_GRPCIO_TOOLS} "
                    f"(pip install -e '.[test]')")
    for path in generate(tmp_path):
        committed = PACKAGE_PROTO / path.name
        assert path.read_bytes() == committed.read_bytes(), (
            f"{committed.relative_to(REPO)} is stale: run python -m prefix_service.proto.regenerate")
    assert sorted(p.name for p in (tmp_path / "prefix_service" / "proto").iterdir()) == sorted(GENERATED)


def test_no_runtime_version_check_above_the_protobuf_floor():
    floor = next(r for r in _requirements("options", "install_requires") if r.startswith("protobuf"))
    floor_version = tuple(int(x) for x in re.search(r">=([\d.]+)", floor).group(1).split("."))
    src = (PACKAGE_PROTO / "prefix_service_pb2.py").read_text()
    m = re.search(r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+)", src)
    if m is not None:  # gencode from protoc >= 26 demands a runtime at least this new
        assert tuple(map(int, m.groups())) <= floor_version, f"gencode needs protobuf {m.groups()}, floor is {floor}"
    grpc_src = (PACKAGE_PROTO / "prefix_service_pb2_grpc.py").read_text()
    assert "GRPC_GENERATED_VERSION" not in grpc_src  # no grpcio floor hidden in the stubs
    assert "from prefix_service.proto import prefix_service_pb2" in grpc_src


def test_contract_names():
    services = {s.name: [m.name for m in s.methods] for s in pb.DESCRIPTOR.services_by_name.values()}
    assert pb.DESCRIPTOR.package == "prefix_service.v1"
    assert services == {"Generation": ["Generate", "Score", "GetServerInfo"],
                        "PrefixAdmin": ["AddPrefixTemplate", "RemovePrefixTemplate", "ListPrefixTemplates"]}
    gen = pb.DESCRIPTOR.services_by_name["Generation"].methods_by_name["Generate"]
    from google.protobuf import descriptor_pb2
    method = descriptor_pb2.MethodDescriptorProto()
    gen.CopyToProto(method)
    assert (method.output_type, method.server_streaming, method.client_streaming) == \
        (".prefix_service.v1.GenerateResponse", True, False)
    fields = {name: [f.name for f in msg.fields] for name, msg in pb.DESCRIPTOR.message_types_by_name.items()}
    expected = {
        "SamplingParams": ["max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos"],
        "GenerateRequest": ["prefix_name", "prompt", "sampling", "request_id", "messages"],
        "ChatMessage": ["role", "content"],
        "Usage": ["prompt_tokens", "prefix_tokens", "completion_tokens", "ttft_ms"],
        "GenerateResponse": ["text", "token_ids", "finish_reason", "usage", "request_id"],
        "AddPrefixTemplateRequest": ["name", "content", "system_prompt"],
        "PrefixTemplate": ["name", "num_tokens", "num_blocks", "requests_served"],
        "RemovePrefixTemplateRequest": ["name"],
        "RemovePrefixTemplateResponse": ["deferred"],
        "ListPrefixTemplatesRequest": [],
        "ListPrefixTemplatesResponse": ["templates"],
        "ScoreRequest": ["prefix_name", "prompt", "candidates", "request_id"],
        "CandidateScore": ["candidate", "logprob", "token_ids", "token_logprobs"],
        "ScoreResponse": ["candidates", "usage", "request_id"],
        "TokenLogprob": ["token_id", "logprob", "token", "top"],
        "GetServerInfoRequest": [],
        "ServerInfo": ["version", "model", "max_model_len", "engines"],
        "EngineDescription": ["replica", "model", "dtype", "kv_cache_dtype", "device", "backend",
                              "backend_description", "max_model_len", "block_size", "num_blocks", "quantization",
                              "batch_invariant", "cpu_isa", "cpu_march"],
    }
    for name, names in expected.items():
        assert fields[name][:len(names)] == names, name
    assert pb.SamplingParams.DESCRIPTOR.fields_by_name["seed"].has_presence
    assert pb.SamplingParams.DESCRIPTOR.fields_by_name["logprobs"].has_presence
    score = pb.DESCRIPTOR.services_by_name["Generation"].methods_by_name["Score"]
    assert (score.input_type.name, score.output_type.name) == ("ScoreRequest", "ScoreResponse")
    assert [v.name for v in pb.FinishReason.DESCRIPTOR.values] == [
        "FINISH_REASON_UNSPECIFIED", "FINISH_REASON_STOP", "FINISH_REASON_LENGTH", "FINISH_REASON_ABORT"]


def test_sampling_from_proto_keeps_an_explicit_seed_of_zero():
    from prefix_service.server.convert import sampling_from_proto
    assert sampling_from_proto(pb.SamplingParams(seed=0)).seed == 0  # seeded, reproducible
    assert sampling_from_proto(pb.SamplingParams()).seed is None  # unset: random
    assert sampling_from_proto(pb.SamplingParams(seed=7)).seed == 7


def test_template_to_proto_carries_the_default_output():
    from prefix_service.engine.template_pins import TemplateInfo
    from prefix_service.sampling_params import StructuredOutput
    from prefix_service.server.convert import template_to_proto
    info = TemplateInfo("bot", 9, 3, 2, 1, {"system_prompt": "be brief"},
                        structured=StructuredOutput("choice", choices=("yes", "no")), kv_source="snapshot")
    msg = template_to_proto(info, "admin", ["0", "1"])
    assert (msg.name, msg.num_tokens, msg.num_blocks, msg.requests_served, msg.active_requests) == ("bot", 9, 3, 2, 1)
    assert (msg.origin, msg.kind, msg.kv_source) == ("admin", "system_prompt", "snapshot")
    assert list(msg.replicas) == ["0", "1"]
    assert msg.HasField("structured_output") and list(msg.structured_output.choice.choices) == ["yes", "no"]
    plain = template_to_proto(TemplateInfo("doc", 9, 3, 0, 0, {"content": "x"}), "config")
    assert plain.kind == "content" and not plain.HasField("structured_output")


@pytest.mark.parametrize("kind, spec, choices", [
    ("json_schema", '{"type": "object"}', ()), ("json_object", "", ()), ("regex", "[a-z]+", ()),
    ("choice", "", ("order", "refund", "shipping")), ("grammar", 'start: "yes" | "no"', ()), ("text", "", ())])
def test_structured_output_survives_the_trip_to_proto_and_back_for_every_kind(kind, spec, choices):
    """A template's default output as ListPrefixTemplates shows it reads back as the same constraint
    (every choice, in order); an error about it names the field and its kind."""
    from prefix_service.sampling_params import StructuredOutput
    from prefix_service.server.convert import structured_from_proto, structured_to_proto
    original = StructuredOutput(kind, spec, choices)
    msg = structured_to_proto(original)
    assert msg.WhichOneof("kind") == kind
    back = structured_from_proto(msg, "structured_output")
    assert back == original and back.choices == choices
    assert back.param == f"structured_output.{kind}"
    assert structured_to_proto(None) is None
    assert structured_from_proto(pb.StructuredOutput(), "structured_output") is None  # no kind set


def test_chat_messages_from_proto_keep_their_order_and_an_empty_role_is_refused_by_its_index():
    from prefix_service.errors import InvalidRequest
    from prefix_service.server.convert import messages_from_proto
    msgs = [pb.ChatMessage(role="system", content="be brief"), pb.ChatMessage(role="user", content="hi")]
    assert messages_from_proto(msgs) == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    with pytest.raises(InvalidRequest, match=r"^messages\[2\]\.role is empty") as e:
        messages_from_proto(msgs + [pb.ChatMessage(role="", content="y")])
    assert e.value.param == "messages[2].role"
