"""Fuzzed requests through the real stubs (hypothesis): random unicode (lone surrogates where the
client lets them through), huge and negative numbers, empty fields, unknown template names, and
raw bytes that are no message at all. The server never crashes, never answers INTERNAL or
UNKNOWN, and says INVALID_ARGUMENT / NOT_FOUND where they apply."""
from __future__ import annotations

import math
import re

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from server_fixtures import DOCUMENT, SYSTEM_PROMPT, Clients, ServerThread, collect, greedy_request, make_config

from prefix_service.config import TemplateSpec
from prefix_service.proto import prefix_service_pb2 as pb


KNOWN = ("doc", "sys")
CAP = 8  # scheduler.max_tokens_cap of the server under test
DEFAULT_MAX_TOKENS = 4
MAX_PROMPT_TOKENS = 64
VOCAB = 512
OK = "OK"
INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
FUZZ = settings(max_examples=120, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# every code point, surrogates included (the protobuf client refuses those: that is "where the
# client allows")
any_char = st.characters(exclude_categories=())
text = st.text(any_char, max_size=40)
names = st.one_of(st.sampled_from(["", *KNOWN, "doc\n", "DOC", "nope"]), text,
                  st.text("abcdef_.-", min_size=100, max_size=300))
u32 = st.one_of(st.integers(0, 12), st.integers(0, 2**32 - 1), st.integers(-2**40, 2**40))
i32 = st.one_of(st.integers(-3, 50), st.integers(-2**31, 2**31 - 1), st.integers(-2**40, 2**40))
floats = st.one_of(st.sampled_from([0.0, 0.0, 0.5, 1.0, 1.5, -0.0]), st.floats(allow_nan=True, allow_infinity=True))


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def mixed(draw, tame, wild):
    """Half the time every field of a group is tame (so valid requests get through), else each
    field is tame or wild by itself."""
    return draw(tame) if draw(st.booleans()) else draw(st.one_of(tame, wild))


@st.composite
def requests(draw) -> dict:
    tame = draw(st.booleans())
    pick = (lambda t, w: draw(t)) if tame else (lambda t, w: mixed(draw, t, w))
    fields = {
        "prefix_name": pick(st.sampled_from(["", *KNOWN]), names),
        "prompt": pick(st.text("the order price ", max_size=60), st.one_of(text, st.text("the row ", max_size=400))),
        "request_id": pick(st.sampled_from(["", "req-1"]), st.one_of(text, st.text("r", min_size=120, max_size=140))),
        "messages": [(pick(st.sampled_from(["user", "system"]), st.one_of(st.just(""), text)),
                      pick(st.text("the order ", max_size=30), text))
                     for _ in range(draw(st.integers(1, 3)) if draw(st.integers(0, 3)) == 0 else 0)],
    }
    sampling = {
        "max_tokens": pick(st.integers(0, CAP), u32),
        "temperature": pick(st.sampled_from([0.0, 0.7, 1.0]), floats),
        "top_p": pick(st.sampled_from([0.0, 0.9, 1.0]), floats),
        "top_k": pick(st.integers(0, 50), i32),
        "stop": pick(st.lists(st.text("xyz", min_size=1, max_size=3), max_size=2), st.lists(text, max_size=3)),
        "stop_token_ids": pick(st.lists(st.integers(1, VOCAB - 1), max_size=2), st.lists(u32, max_size=3)),
        "ignore_eos": draw(st.booleans()),
    }
    seed = draw(st.one_of(st.none(), st.integers(0, 2**64 - 1), st.integers(-2**70, 2**70)))
    if seed is not None:
        sampling["seed"] = seed
    fields["sampling"] = sampling
    return fields


def build(fields: dict) -> pb.GenerateRequest | None:
    """The proto, or None when the client library refuses the values (never sent)."""
    try:
        return pb.GenerateRequest(
            prefix_name=fields["prefix_name"], prompt=fields["prompt"], request_id=fields["request_id"],
            messages=[pb.ChatMessage(role=r, content=c) for r, c in fields["messages"]],
            sampling=pb.SamplingParams(**fields["sampling"]))
    except (ValueError, TypeError) as e:  # UnicodeEncodeError (a surrogate), an int out of range
        assert isinstance(e, (UnicodeEncodeError, ValueError, TypeError))
        return None


def sampling_ok(s: pb.SamplingParams) -> bool:
    """The server's rules (prefix_service.sampling_params), on the values as the proto carries them."""
    top_p = s.top_p if s.top_p != 0 else 1.0
    return ((s.max_tokens or DEFAULT_MAX_TOKENS) <= CAP
            and math.isfinite(s.temperature) and 0 <= s.temperature <= 100
            and math.isfinite(top_p) and 0 < top_p <= 1
            and s.top_k >= -1
            and len(s.stop) <= 16 and all(0 < len(x) <= 256 for x in s.stop)
            and all(t < VOCAB for t in s.stop_token_ids))


def expected(req: pb.GenerateRequest, tokenizer) -> set:
    """The outcomes the server may give, in the order it checks things."""
    if req.request_id and (len(req.request_id) > 128 or not req.request_id.isprintable()):
        return {INVALID}
    unknown = bool(req.prefix_name) and req.prefix_name not in KNOWN
    if req.messages:
        if req.prompt or any(not m.role for m in req.messages):
            return {INVALID}
        if unknown:
            return {NOT_FOUND}
        return {INVALID} if not sampling_ok(req.sampling) else {OK, INVALID}  # INVALID: prompt over the cap
    if not sampling_ok(req.sampling):
        return {INVALID}
    if unknown:
        return {NOT_FOUND}
    ids = tokenizer.encode(req.prompt, add_special_tokens=not req.prefix_name)
    if not ids and not req.prefix_name or len(ids) > MAX_PROMPT_TOKENS:
        return {INVALID}
    return {OK}


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    st_ = ServerThread(make_config(model_dir, prefixes=(TemplateSpec("doc", content=DOCUMENT),
                                                    TemplateSpec("sys", system_prompt=SYSTEM_PROMPT)),
                                   state_file=tmp_path_factory.mktemp("fuzz-state") / "state.json",
                                   max_tokens_cap=CAP, default_max_tokens=DEFAULT_MAX_TOKENS,
                                   max_prompt_tokens=MAX_PROMPT_TOKENS)).start()
    yield st_
    st_.stop()


@pytest.fixture(scope="module")
def clients(server):
    c = Clients(server.address)
    yield c
    c.close()


@pytest.fixture(autouse=True)
def _integrity(server):
    yield
    server.check_clean()


def outcome(call) -> tuple:
    try:
        return (OK, collect(call))
    except grpc.RpcError as e:
        return (e.code(), e.details())


@FUZZ
@given(fields=requests())
def test_fuzzed_generate(server, clients, fields):
    req = build(fields)
    if req is None:
        event("refused by the client")
        return
    allowed = expected(req, server.engine.tokenizer)
    got = outcome(clients.generation.Generate(req, timeout=30))
    event(f"{got[0]}")
    assert got[0] in allowed, (got, allowed, req)
    if got[0] == OK:
        _, _, last = got[1]
        assert last.finish_reason != pb.FINISH_REASON_UNSPECIFIED
        assert 0 < last.usage.completion_tokens <= CAP
    else:
        assert 0 < len(got[1]) <= 1000  # a message a person can act on, bounded


NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")


@st.composite
def templates(draw) -> tuple[str, str, str]:
    tame = draw(st.booleans())
    name = draw(st.sampled_from(["faq", "t.1", "A-b_c", *KNOWN]) if tame else names)
    content = draw(st.text("the order ", min_size=1, max_size=60) if tame else
                   st.one_of(st.just(""), text, st.text("the order ", max_size=3000)))
    system_prompt = "" if tame and draw(st.booleans()) else draw(st.one_of(st.just(""), text))
    return name, content, system_prompt


@FUZZ
@given(template=templates(), remove=names.filter(lambda n: n not in KNOWN))
def test_fuzzed_admin(server, clients, template, remove):
    name, content, system_prompt = template
    try:
        req = pb.AddPrefixTemplateRequest(name=name, content=content, system_prompt=system_prompt)
    except ValueError:
        event("refused by the client")
        return
    try:
        t = clients.admin.AddPrefixTemplate(req, timeout=30)
        code = OK
    except grpc.RpcError as e:
        code = e.code()
    event(str(code))
    valid = NAME_RE.fullmatch(name) is not None and bool(content) != bool(system_prompt)
    if not valid:
        assert code == INVALID
    elif name in KNOWN:
        assert code == grpc.StatusCode.ALREADY_EXISTS
    else:  # too long for the context (INVALID_ARGUMENT) or the prefix budget (RESOURCE_EXHAUSTED)
        assert code in (OK, INVALID, grpc.StatusCode.RESOURCE_EXHAUSTED), code
    if code == OK:
        assert t.name == name and t.num_tokens > 0
        clients.admin.RemovePrefixTemplate(pb.RemovePrefixTemplateRequest(name=name))
    try:
        remove_req = pb.RemovePrefixTemplateRequest(name=remove)
    except ValueError:
        return
    with pytest.raises(grpc.RpcError) as info:  # nothing but the YAML templates is left
        clients.admin.RemovePrefixTemplate(remove_req, timeout=30)
    assert info.value.code() == NOT_FOUND


@st.composite
def wire_bytes(draw) -> bytes:
    """Random bytes, or a valid request's bytes with a few of them overwritten or cut."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=200))
    data = bytearray(greedy_request(" the order", draw(st.sampled_from(["", "doc", "sys"])), max_tokens=3)
                     .SerializeToString())
    for _ in range(draw(st.integers(0, 2))):
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return bytes(data[:draw(st.integers(0, len(data)))] if draw(st.booleans()) else data)


@FUZZ
@given(data=wire_bytes())
def test_raw_bytes(server, clients, data):
    """Bytes straight onto the wire: whatever they parse to (or not), a status that fits."""
    call = clients.channel.unary_stream("/prefix_service.v1.Generation/Generate")
    try:
        list(call(data, timeout=30))
        code = OK
    except grpc.RpcError as e:
        code = e.code()
        if code == INVALID:
            assert e.details()
    event(str(code))
    assert code in (OK, INVALID, NOT_FOUND), code


def test_undecodable_request_is_invalid_argument(server, clients):
    call = clients.channel.unary_stream("/prefix_service.v1.Generation/Generate")
    with pytest.raises(grpc.RpcError) as info:
        list(call(b"\x12\x02\xc3\x28", timeout=10))  # prompt: invalid UTF-8
    assert info.value.code() == INVALID
    assert "not a valid prefix_service.v1.GenerateRequest" in info.value.details()


def test_still_serving_after_the_fuzz(server, clients):
    stub = health_pb2_grpc.HealthStub(clients.channel)
    assert stub.Check(health_pb2.HealthCheckRequest(service="")).status == health_pb2.HealthCheckResponse.SERVING
    last = collect(clients.generation.Generate(greedy_request(" the order", "doc", max_tokens=CAP)))[2]
    assert last.usage.completion_tokens == CAP
