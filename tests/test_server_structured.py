"""Structured outputs over gRPC: SamplingParams.structured_output (each kind of its oneof), a
template's default output from the YAML config and from the admin API (listed, persisted, restored
at a restart), a request's own constraint or free text replacing it, and bad constraints refused
with INVALID_ARGUMENT naming the field, before anything is queued."""
from __future__ import annotations

import json
import re

import grpc
import pytest
from server_fixtures import DOCUMENT, Clients, collect
from test_server_admin import make_server  # noqa: F401 - the fixture: servers leak-checked and stopped

from prefix_service.config import ConfigError, TemplateSpec, config_from_dict
from prefix_service.proto import prefix_service_pb2 as pb
from prefix_service.sampling_params import StructuredOutput

LABELS = ("order", "refund", "shipping")
SCHEMA = {"type": "object", "properties": {"intent": {"enum": list(LABELS)}, "urgent": {"type": "boolean"}},
          "required": ["intent", "urgent"], "additionalProperties": False}


def request(prefix: str = "doc", structured: pb.StructuredOutput | None = None, **sampling) -> pb.GenerateRequest:
    sampling.setdefault("max_tokens", 40)
    return pb.GenerateRequest(prefix_name=prefix, prompt=" the order", sampling=pb.SamplingParams(
        structured_output=structured, **sampling))


def code_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        collect(call)
    return info.value.code(), info.value.details()


def test_each_kind_constrains_the_output(make_server):
    c = Clients(make_server().address)
    text, _, last = collect(c.generation.Generate(request(structured=pb.StructuredOutput(
        choice=pb.Choices(choices=LABELS)))))
    assert text in LABELS and last.finish_reason == pb.FINISH_REASON_STOP
    text, _, _ = collect(c.generation.Generate(request(structured=pb.StructuredOutput(regex=r"[0-9]{2}-[a-z]{3}"))))
    assert re.fullmatch(r"[0-9]{2}-[a-z]{3}", text)
    text, _, _ = collect(c.generation.Generate(request(structured=pb.StructuredOutput(
        json_schema=json.dumps(SCHEMA)), max_tokens=60)))
    record = json.loads(text)
    assert record["intent"] in LABELS and isinstance(record["urgent"], bool)
    text, _, _ = collect(c.generation.Generate(request(structured=pb.StructuredOutput(
        grammar='start: "yes" | "no" | "maybe"'))))
    assert text in ("yes", "no", "maybe")
    samples: dict[int, str] = {}
    for msg in c.generation.Generate(request(structured=pb.StructuredOutput(choice=pb.Choices(choices=LABELS)),
                                             n=3, temperature=1.5, seed=4)):
        samples[msg.index] = samples.get(msg.index, "") + msg.text
    assert sorted(samples) == [0, 1, 2] and all(s in LABELS for s in samples.values())


@pytest.mark.parametrize("structured, field", [
    (pb.StructuredOutput(regex="([a-"), "sampling.structured_output.regex"),
    (pb.StructuredOutput(json_schema="{not json"), "sampling.structured_output.json_schema"),
    (pb.StructuredOutput(grammar="start: ("), "sampling.structured_output.grammar"),
    (pb.StructuredOutput(choice=pb.Choices()), "sampling.structured_output.choice"),
    (pb.StructuredOutput(choice=pb.Choices(choices=["", " yes"])), "sampling.structured_output.choice"),
    (pb.StructuredOutput(regex=""), "sampling.structured_output.regex"),
    (pb.StructuredOutput(json_object=False), "sampling.structured_output.json_object"),
])
def test_a_bad_constraint_is_invalid_argument_naming_it(make_server, structured, field):
    st = make_server()
    code, details = code_of(Clients(st.address).generation.Generate(request(structured=structured)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(field), details
    assert st.engine.kv_stats()["waiting"] == 0


def test_a_template_default_output_from_yaml_and_the_admin_api(make_server, tmp_path):
    state = tmp_path / "state.json"
    choice = StructuredOutput("choice", choices=LABELS)
    st = make_server(state_file=state, prefixes=(TemplateSpec("doc", content=DOCUMENT),
                                                 TemplateSpec("intent", content=DOCUMENT, structured_output=choice)))
    c = Clients(st.address)
    text, _, _ = collect(c.generation.Generate(request("intent")))
    assert text in LABELS
    own, _, _ = collect(c.generation.Generate(request("intent", pb.StructuredOutput(regex="[0-9]{4}"))))
    assert re.fullmatch("[0-9]{4}", own)
    free = collect(c.generation.Generate(request("intent", pb.StructuredOutput(text=True), ignore_eos=True,
                                                 max_tokens=8)))
    assert free[:2] == collect(c.generation.Generate(request("doc", ignore_eos=True, max_tokens=8)))[:2]

    added = c.admin.AddPrefixTemplate(pb.AddPrefixTemplateRequest(
        name="record", content=DOCUMENT, structured_output=pb.StructuredOutput(json_schema=json.dumps(SCHEMA))))
    assert json.loads(added.structured_output.json_schema) == SCHEMA
    record = json.loads(collect(c.generation.Generate(request("record", max_tokens=60)))[0])
    assert record["intent"] in LABELS
    listed = {t.name: t for t in c.admin.ListPrefixTemplates(pb.ListPrefixTemplatesRequest()).templates}
    assert list(listed["intent"].structured_output.choice.choices) == list(LABELS)
    assert not listed["doc"].HasField("structured_output")
    saved = json.loads(state.read_text())["templates"]
    assert saved == [{"name": "record", "content": DOCUMENT, "structured_output": {"json_schema": json.dumps(SCHEMA)}}]

    # refused before anything is pinned or written: the regex does not compile; the empty ones (an
    # empty choice, an empty regex) the state file could not read back, which stopped the next start
    for broken, field in ((pb.StructuredOutput(regex="([a-"), "regex"),
                          (pb.StructuredOutput(choice=pb.Choices(choices=["", " yes"])), "choice"),
                          (pb.StructuredOutput(regex=""), "regex")):
        with pytest.raises(grpc.RpcError) as info:
            c.admin.AddPrefixTemplate(pb.AddPrefixTemplateRequest(name="broken", content=DOCUMENT,
                                                                  structured_output=broken))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith(f"structured_output.{field}")
        assert "broken" not in {t.name for t in c.admin.ListPrefixTemplates(pb.ListPrefixTemplatesRequest()).templates}
    assert json.loads(state.read_text())["templates"] == saved
    st.check_clean()
    st.stop()

    c2 = Clients(make_server(state_file=state).address)  # restored from the state file
    record = json.loads(collect(c2.generation.Generate(request("record", max_tokens=60)))[0])
    assert record["intent"] in LABELS


def test_yaml_structured_output(tmp_path):
    base = {"model": {"path": str(tmp_path)}}
    cfg = config_from_dict({**base, "prefixes": [
        {"name": "intent", "content": "x", "structured_output": {"choice": list(LABELS)}},
        {"name": "record", "content": "x", "structured_output": {"json_schema": SCHEMA}}]})
    assert cfg.prefixes[0].structured_output == StructuredOutput("choice", choices=LABELS)
    assert json.loads(cfg.prefixes[1].structured_output.spec) == SCHEMA
    for bad, needle in (({"choice": []}, "prefixes[intent].structured_output.choice"),
                        ({"regex": "a", "choice": ["a"]}, "prefixes[intent].structured_output"),
                        ({"yaml": "a"}, "one of json_schema")):
        with pytest.raises(ConfigError, match=re.escape(needle)):
            config_from_dict({**base, "prefixes": [{"name": "intent", "content": "x", "structured_output": bad}]})


def test_an_added_template_with_free_text_has_no_default_output(make_server, tmp_path):
    """`structured_output {text: true}` on an added template means none: the answer and the listing
    show none, and the state file records the template as one added without it."""
    state = tmp_path / "free.state.json"
    c = Clients(make_server(state_file=state).address)
    try:
        added = c.admin.AddPrefixTemplate(pb.AddPrefixTemplateRequest(
            name="free", content=DOCUMENT, structured_output=pb.StructuredOutput(text=True)))
        assert not added.HasField("structured_output")
        listed = {t.name: t for t in c.admin.ListPrefixTemplates(pb.ListPrefixTemplatesRequest()).templates}
        assert not listed["free"].HasField("structured_output")
    finally:
        c.close()
    saved = {t["name"]: t for t in json.loads(state.read_text())["templates"]}
    assert saved["free"] == {"name": "free", "content": DOCUMENT}
