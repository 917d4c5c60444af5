"""PrefixAdmin over gRPC: auth (none / wrong / right token), loopback policy, add/list/remove and
their status codes, persistence across restarts, and the state file's crash safety."""
from __future__ import annotations

import json
import os

import grpc
import pytest

from server_fixtures import (DOCUMENT, SYSTEM_PROMPT, TOKEN_ENV, Clients, ServerThread, collect, greedy_request,
                             make_config, slow_steps)

from prefix_service.config import TemplateSpec, ServerConfig
from prefix_service.errors import ConfigError
from prefix_service.proto import prefix_service_pb2 as pb
from prefix_service.server.auth import AdminAuth, check_admin_exposure
from prefix_service.server.status import PermissionDenied, Unauthenticated
from prefix_service.server.store import StateFileError, TemplateSource, TemplateStore

FAQ = "the answer to every question about refund and shipping is in the account page " * 3


@pytest.fixture
def make_server(model_dir, tmp_path, monkeypatch):
    """make_server(token=None, **config) -> a started ServerThread; leak-checked and stopped after."""
    started: list[ServerThread] = []

    def factory(token: str | None = None, **kwargs) -> ServerThread:
        if token is None:
            monkeypatch.delenv(TOKEN_ENV, raising=False)
        else:
            monkeypatch.setenv(TOKEN_ENV, token)
        kwargs.setdefault("prefixes", (TemplateSpec("doc", content=DOCUMENT),))
        kwargs.setdefault("state_file", tmp_path / "state.json")
        st = ServerThread(make_config(model_dir, **kwargs))
        started.append(st)
        return st.start()

    yield factory
    for st in started:
        if st.engine is not None:
            st.check_clean()
        st.stop()


def status(fn, *args, **kwargs) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        fn(*args, **kwargs)
    return info.value.code(), info.value.details()


def add(c: Clients, name: str, content: str = "", system_prompt: str = "", metadata=()):
    return c.admin.AddPrefixTemplate(pb.AddPrefixTemplateRequest(name=name, content=content,
                                                                 system_prompt=system_prompt), metadata=metadata)


def names(c: Clients, metadata=()) -> list[str]:
    return [t.name for t in c.admin.ListPrefixTemplates(pb.ListPrefixTemplatesRequest(), metadata=metadata).templates]


# --- auth ------------------------------------------------------------------------------------

def test_no_token_on_loopback_needs_no_metadata(make_server):
    c = Clients(make_server().address)
    t = add(c, "faq", FAQ)
    assert (t.name, t.origin, t.kind) == ("faq", "admin", "content") and t.num_tokens > 0
    assert names(c) == ["doc", "faq"]
    assert not c.admin.RemovePrefixTemplate(pb.RemovePrefixTemplateRequest(name="faq")).deferred
    assert names(c) == ["doc"]


def test_token_required(make_server):
    st = make_server(token="s3cret-token")
    c = Clients(st.address)
    list_call = lambda md: c.admin.ListPrefixTemplates(pb.ListPrefixTemplatesRequest(), metadata=md)  # noqa: E731
    code, details = status(list_call, ())
    assert code == grpc.StatusCode.UNAUTHENTICATED and "authorization: Bearer" in details
    assert status(list_call, (("authorization", "Bearer wrong"),))[0] == grpc.StatusCode.PERMISSION_DENIED
    assert status(list_call, (("authorization", "s3cret-token"),))[0] == grpc.StatusCode.UNAUTHENTICATED
    assert status(add, c, "faq", FAQ, metadata=(("authorization", "Bearer nope"),))[0] == \
        grpc.StatusCode.PERMISSION_DENIED
    good = (("authorization", "Bearer s3cret-token"),)
    assert add(c, "faq", FAQ, metadata=good).name == "faq"
    assert names(c, good) == ["doc", "faq"]
    assert status(c.admin.RemovePrefixTemplate, pb.RemovePrefixTemplateRequest(name="faq"))[0] == \
        grpc.StatusCode.UNAUTHENTICATED
    c.admin.RemovePrefixTemplate(pb.RemovePrefixTemplateRequest(name="faq"), metadata=good)
    # generation needs no token
    assert collect(c.generation.Generate(greedy_request(" the", "doc", max_tokens=3)))[2].usage.completion_tokens == 3


def test_auth_unit():
    auth = AdminAuth("tok")
    auth.check([("authorization", "Bearer tok")])
    auth.check([("Authorization", "bearer tok")])
    with pytest.raises(Unauthenticated):
        auth.check([])
    with pytest.raises(PermissionDenied):
        auth.check([("authorization", "Bearer tok2")])
    AdminAuth(None).check([])  # no token configured: open


def test_admin_without_token_refused_off_loopback(make_server):
    with pytest.raises(ConfigError, match="PREFIX_SERVICE_ADMIN_TOKEN"):
        check_admin_exposure(ServerConfig(address="0.0.0.0:50051"), None)
    check_admin_exposure(ServerConfig(address="0.0.0.0:50051"), "a-token")
    check_admin_exposure(ServerConfig(address="0.0.0.0:50051", enable_admin=False), None)
    check_admin_exposure(ServerConfig(address="[::1]:50051"), None)
    # the server refuses before it binds or loads anything
    with pytest.raises(ConfigError, match="accepts connections from other machines"):
        make_server(address="0.0.0.0:0")


def test_token_is_never_logged(make_server, caplog):
    caplog.set_level("DEBUG")
    st = make_server(token="do-not-log-me")
    c = Clients(st.address)
    add(c, "faq", FAQ, metadata=(("authorization", "Bearer do-not-log-me"),))
    status(names, c, (("authorization", "Bearer also-secret"),))
    assert "do-not-log-me" not in caplog.text and "also-secret" not in caplog.text


# --- add / remove / list ------------------------------------------------------------------------

def test_admin_status_codes(make_server):
    st = make_server(prefix_budget_blocks=60)
    c = Clients(st.address)
    assert status(add, c, "doc", FAQ)[0] == grpc.StatusCode.ALREADY_EXISTS
    assert status(add, c, "bad name!", FAQ)[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert status(add, c, "both", FAQ, SYSTEM_PROMPT)[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert status(add, c, "neither")[0] == grpc.StatusCode.INVALID_ARGUMENT
    code, details = status(add, c, "huge", "the table row " * 120)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "prefix_budget_blocks" in details
    code, details = status(c.admin.RemovePrefixTemplate, pb.RemovePrefixTemplateRequest(name="nope"))
    assert code == grpc.StatusCode.NOT_FOUND and "nope" in details
    assert names(c) == ["doc"]


def test_system_prompt_template_added_at_run_time(make_server):
    st = make_server()
    c = Clients(st.address)
    t = add(c, "bot", system_prompt=SYSTEM_PROMPT)
    assert t.kind == "system_prompt"
    tok = st.engine.tokenizer
    rendered = tok.apply_chat_template([{"role": "system", "content": SYSTEM_PROMPT}], tokenize=False)
    assert list(st.engine.get_template("bot").token_ids) == tok.encode(rendered, add_special_tokens=False)
    user = [pb.ChatMessage(role="user", content="refund please")]
    sampling = pb.SamplingParams(max_tokens=8, ignore_eos=True)
    a = collect(c.generation.Generate(pb.GenerateRequest(prefix_name="bot", messages=user, sampling=sampling)))
    b = collect(c.generation.Generate(pb.GenerateRequest(
        messages=[pb.ChatMessage(role="system", content=SYSTEM_PROMPT)] + user, sampling=sampling)))
    assert a[1] == b[1] and a[2].usage.prefix_tokens == t.num_tokens


def test_remove_while_in_use_is_deferred(make_server):
    st = make_server()
    c = Clients(st.address)
    add(c, "faq", FAQ)
    undo = slow_steps(st.engine, 0.01)
    call = c.generation.Generate(greedy_request(" the", "faq", max_tokens=30))
    next(call)
    listed = {t.name: t for t in c.admin.ListPrefixTemplates(pb.ListPrefixTemplatesRequest()).templates}
    assert listed["faq"].active_requests == 1 and listed["faq"].requests_served == 1
    assert c.admin.RemovePrefixTemplate(pb.RemovePrefixTemplateRequest(name="faq")).deferred
    assert names(c) == ["doc"]
    assert status(collect, c.generation.Generate(greedy_request(" the", "faq")))[0] == grpc.StatusCode.NOT_FOUND
    assert collect(call)[2].usage.completion_tokens == 30  # the running request finishes on the old blocks
    undo()
    st.check_clean()  # and then the template's blocks are freed


# --- persistence ----------------------------------------------------------------------------------

def test_templates_survive_a_restart(make_server, tmp_path):
    state = tmp_path / "state.json"
    st = make_server(state_file=state)
    c = Clients(st.address)
    add(c, "faq", FAQ)
    add(c, "bot", system_prompt=SYSTEM_PROMPT)
    add(c, "gone", "the weather")
    c.admin.RemovePrefixTemplate(pb.RemovePrefixTemplateRequest(name="gone"))
    before = collect(c.generation.Generate(greedy_request(" the", "faq", max_tokens=10)))
    chat = pb.GenerateRequest(prefix_name="bot", messages=[pb.ChatMessage(role="user", content="hi")],
                              sampling=pb.SamplingParams(max_tokens=6, ignore_eos=True))
    chat_before = collect(c.generation.Generate(chat))
    assert json.loads(state.read_text())["templates"] == [{"name": "faq", "content": FAQ},
                                                          {"name": "bot", "system_prompt": SYSTEM_PROMPT}]
    st.check_clean()
    st.stop()

    st2 = make_server(state_file=state)
    c2 = Clients(st2.address)
    listed = c2.admin.ListPrefixTemplates(pb.ListPrefixTemplatesRequest()).templates
    assert [(t.name, t.origin, t.kind) for t in listed] == [
        ("doc", "config", "content"), ("faq", "admin", "content"), ("bot", "admin", "system_prompt")]
    after = collect(c2.generation.Generate(greedy_request(" the", "faq", max_tokens=10)))
    assert after[:2] == before[:2] and after[2].usage.prefix_tokens == before[2].usage.prefix_tokens
    assert collect(c2.generation.Generate(chat))[:2] == chat_before[:2]
    c2.admin.RemovePrefixTemplate(pb.RemovePrefixTemplateRequest(name="faq"))
    st2.check_clean()
    st2.stop()

    st3 = make_server(state_file=state)
    assert names(Clients(st3.address)) == ["doc", "bot"]


def test_add_that_cannot_be_persisted_is_rolled_back(make_server, tmp_path, monkeypatch):
    """A template the state file cannot record is not added: the call fails, the engine unpins it
    (not listed, its name free), and the same add succeeds once the file can be written."""
    state = tmp_path / "state.json"
    st = make_server(state_file=state)
    c = Clients(st.address)
    pinned = st.engine.kv_stats()["pinned"]

    def disk_full(self, templates):
        raise OSError("no space left on device")

    with monkeypatch.context() as m:
        m.setattr(TemplateStore, "save", disk_full)
        code, details = status(add, c, "faq", FAQ)
    assert code == grpc.StatusCode.INTERNAL
    assert "'faq' was not added" in details and "no space left on device" in details
    assert names(c) == ["doc"]
    assert st.engine.kv_stats()["pinned"] == pinned  # its blocks were unpinned
    assert add(c, "faq", FAQ).name == "faq"
    assert names(c) == ["doc", "faq"]
    assert json.loads(state.read_text())["templates"] == [{"name": "faq", "content": FAQ}]


def test_default_state_file_is_next_to_the_config(tmp_path):
    from prefix_service.config import load_config
    from prefix_service.server import state_path
    cfg_file = tmp_path / "svc.yaml"
    cfg_file.write_text("model: {path: m}\n")
    assert state_path(load_config(cfg_file)) == tmp_path / "svc.state.json"
    cfg_file.write_text("model: {path: m}\nserver: {state_file: data/templates.json}\n")
    assert state_path(load_config(cfg_file)) == tmp_path / "data" / "templates.json"


def test_interrupted_write_leaves_the_old_state(tmp_path, monkeypatch):
    store = TemplateStore(tmp_path / "state.json")
    store.save([TemplateSource("a", content="x")])

    def crash(*args):
        raise OSError("simulated crash before the rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        store.save([TemplateSource("a", content="x"), TemplateSource("b", content="y")])
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]  # the failed write took its temp file away
    assert [t.name for t in store.load()] == ["a"]
    # a crash that left a torn temp file behind: ignored and cleaned up at load
    torn = tmp_path / ".state.json.tmp-abc123"
    torn.write_text('{"version": 1, "templates": [{"name": "b", "cont')
    assert [t.name for t in store.load()] == ["a"]
    assert not torn.exists()
    assert json.loads((tmp_path / "state.json").read_text())["templates"] == [{"name": "a", "content": "x"}]


def test_torn_temp_file_does_not_stop_a_restart(make_server, tmp_path):
    state = tmp_path / "state.json"
    st = make_server(state_file=state)
    add(Clients(st.address), "faq", FAQ)
    st.stop()
    (tmp_path / ".state.json.tmp-dead").write_bytes(b'{"version": 1, "templ')
    st2 = make_server(state_file=state)
    assert names(Clients(st2.address)) == ["doc", "faq"]


@pytest.mark.parametrize("text, needle", [
    ("{not json", "not valid JSON"),
    ('{"version": 7, "templates": []}', "version-1"),
    ('{"version": 1, "templates": [{"name": "a"}]}', "templates[0]"),
    ('{"version": 1, "templates": [{"name": "a", "content": "x", "system_prompt": "y"}]}', "templates[0]"),  # both
    ('{"version": 1, "templates": [{"name": "bad name", "content": "x"}]}', "invalid prefix name"),
    ('{"version": 1, "templates": [{"name": "x", "content": "a\xff"}]}', "utf-8"),  # not UTF-8: was a traceback
    ('[{"name": "a", "content": "x"}]', "version-1"),  # a list, not the object holding it
    ('{"version": 1}', "version-1"),
    ('{"version": 1, "templates": {"a": {"content": "x"}}}', "version-1"),
    ('{"version": 1, "templates": [5]}', "templates[0]"),
    ('{"version": 1, "templates": [{"name": "a", "content": 5}]}', "templates[0]"),
    ('{"version": 1, "templates": [{"name": "a", "content": "x", "structured_output": {"choice": []}}]}',
     "structured_output.choice"),
])
def test_corrupt_state_file_is_a_clear_error(tmp_path, text, needle):
    path = tmp_path / "state.json"
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(StateFileError, match="state") as info:
        TemplateStore(path).load()
    assert needle in str(info.value) and str(path) in str(info.value)


def test_the_first_save_makes_the_state_files_folder(tmp_path):
    """server.state_file in a folder that does not exist yet: loading finds no templates, and the
    first save makes the folder and writes the file the next load reads back."""
    store = TemplateStore(tmp_path / "data" / "svc" / "state.json")
    assert store.load() == []
    store.save([TemplateSource("a", content="x"), TemplateSource("b", system_prompt="y")])
    assert [(t.name, t.definition()) for t in store.load()] == [("a", {"content": "x"}), ("b", {"system_prompt": "y"})]


def test_state_template_that_no_longer_fits_is_skipped(make_server, tmp_path, caplog):
    state = tmp_path / "state.json"
    TemplateStore(state).save([TemplateSource("big", content="the table row " * 120),
                               TemplateSource("small", content="the weather")])
    st = make_server(state_file=state, prefix_budget_blocks=80)
    assert names(Clients(st.address)) == ["doc", "small"]
    assert "'big' from the state file was not restored" in caplog.text


def test_yaml_template_failure_stops_the_start(make_server):
    with pytest.raises(Exception, match="'doc' from the config failed to warm up"):
        make_server(prefix_budget_blocks=5)


@pytest.mark.parametrize("content, match", [(None, "cannot read"), (b"", "is empty"), (b"\xff\xfe", "cannot read"),
                                            (b"x" * 70, "has 70 bytes")])
def test_a_bad_template_file_stops_the_start_before_the_model_loads(make_server, tmp_path, monkeypatch,
                                                                   content, match):
    """Read first, so the mistake is reported in a moment, not after minutes of loading a large model."""
    from prefix_service.engine.api import Engine
    from prefix_service.errors import ConfigError

    def not_now(self, *args, **kwargs):
        raise AssertionError("the model was loaded before the template files were read")
    monkeypatch.setattr(Engine, "__init__", not_now)
    prompt = tmp_path / "prompt.txt"
    if content is not None:
        prompt.write_bytes(content)
    with pytest.raises(ConfigError, match=rf"prefixes\[faq\].file: .*{match}"):
        make_server(prefixes=(TemplateSpec("faq", file=str(prompt)),), max_template_bytes=64)
