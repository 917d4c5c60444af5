"""The `prefix-service` command: generate and prefix admin in-process against a test server, serve
as a subprocess stopped by SIGTERM, help text and error exits."""
from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from server_fixtures import DOCUMENT, SYSTEM_PROMPT, TOKEN_ENV, ServerThread, make_config

from prefix_service import GenerateRequest, SamplingParams
from prefix_service.cli import main
from prefix_service.config import TemplateSpec

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    os.environ.pop(TOKEN_ENV, None)
    cfg = make_config(model_dir, prefixes=(TemplateSpec("doc", content=DOCUMENT),
                                           TemplateSpec("sys", system_prompt=SYSTEM_PROMPT)),
                      state_file=tmp_path_factory.mktemp("cli-state") / "state.json")
    st = ServerThread(cfg).start()
    yield st
    st.stop()


@pytest.fixture(autouse=True)
def _integrity(request):
    yield
    if "server" in request.fixturenames:
        request.getfixturevalue("server").check_clean()


def test_generate_streams_the_engines_output(server, capsys):
    assert main(["generate", "--address", server.address, "--template", "doc", "--max-tokens", "9", " the order"]) == 0
    out, err = capsys.readouterr()
    ref = server.engine.generate(GenerateRequest(prompt=" the order", prefix_name="doc",
                                                 sampling=SamplingParams(max_tokens=9)))[0]
    assert out == ref.text + "\n"
    prefix_len = server.engine.get_template("doc").num_tokens
    assert re.search(rf"\[(length|stop)\] prompt {ref.prompt_tokens} tokens \({prefix_len} reused from the template\), "
                     rf"{ref.completion_tokens} completion tokens, ttft \d+ ms", err), err


def test_generate_chat_with_system_message(server, capsys):
    assert main(["generate", "--address", server.address, "--chat", "--system", SYSTEM_PROMPT, "--max-tokens", "5",
                 "refund please"]) == 0
    via_system = capsys.readouterr().out
    assert main(["generate", "--address", server.address, "--chat", "--template", "sys", "--max-tokens", "5",
                 "refund please"]) == 0
    out, err = capsys.readouterr()
    assert out == via_system  # the pinned system prompt gives the same answer
    assert f"({server.engine.get_template('sys').num_tokens} reused" in err


def test_generate_reads_stdin(server, capsys, monkeypatch):
    import io
    monkeypatch.setattr(sys, "stdin", io.StringIO(" the order"))
    assert main(["generate", "--address", server.address, "--prefix", "doc", "--max-tokens", "4", "-"]) == 0  # the old name
    ref = server.engine.generate(GenerateRequest(prompt=" the order", prefix_name="doc",
                                                 sampling=SamplingParams(max_tokens=4)))[0]
    assert capsys.readouterr().out == ref.text + "\n"


def test_generate_errors_exit_1(server, capsys):
    assert main(["generate", "--address", server.address, "--template", "nope", "x"]) == 1
    assert "error: NOT_FOUND: no prefix template named 'nope'" in capsys.readouterr().err
    assert main(["generate", "--address", server.address, "--temperature", "-2", "x"]) == 1
    assert "error: INVALID_ARGUMENT" in capsys.readouterr().err


@pytest.mark.parametrize("flag,value", [("--max-tokens", "-1"), ("--max-tokens", str(2**32)), ("--seed", "-1"),
                                        ("--seed", str(2**64)), ("--top-k", "99999999999"), ("--top-k", "-2"),
                                        ("--max-tokens", "ten")])
def test_generate_numbers_a_request_cannot_hold_are_usage_errors(flag, value, capsys):
    """Refused by the parser (exit 2, one line naming the flag) before any request is built: the
    request's fields could not hold them, which was a traceback."""
    with pytest.raises(SystemExit) as info:
        main(["generate", "--address", "127.0.0.1:1", flag, value, "x"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: expected an integer" in err and "Traceback" not in err


def test_generate_without_a_server_says_so(capsys):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["generate", "--address", f"127.0.0.1:{port}", "--timeout", "3", "x"]) == 1
    err = capsys.readouterr().err
    assert "error: UNAVAILABLE" in err and "is a server running" in err


def test_prefix_add_list_remove(server, capsys, tmp_path):
    f = tmp_path / "faq.txt"
    f.write_text("the answer is in the account page")
    assert main(["template", "add", "faq", "--file", str(f), "--address", server.address]) == 0
    assert re.match(r"added faq: \d+ tokens, \d+ blocks pinned", capsys.readouterr().out)
    assert main(["template", "add", "bot", "--system-prompt", "be terse", "--address", server.address]) == 0
    assert main(["template", "add", "raw", "--content", "the weather", "--address", server.address]) == 0
    capsys.readouterr()
    assert main(["template", "list", "--address", server.address]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["NAME", "TOKENS", "BLOCKS", "SERVED", "ACTIVE", "ORIGIN", "KIND", "KV"]
    assert [row.split()[0] for row in table[1:]] == ["doc", "sys", "faq", "bot", "raw"]
    assert table[4].split()[-3:] == ["admin", "system_prompt", "prefill"]
    assert main(["template", "list", "--json", "--address", server.address]) == 0
    assert '"name": "doc"' in capsys.readouterr().out
    for name in ("faq", "bot", "raw"):
        assert main(["template", "remove", name, "--address", server.address]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "removed faq"
    assert main(["template", "remove", "faq", "--address", server.address]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err
    assert main(["template", "add", "x", "--file", str(tmp_path / "missing.txt"), "--address", server.address]) == 2


def test_info_shows_what_the_server_computes_with(server, capsys):
    (engine,) = server.engine.engine_infos().values()
    assert main(["info", "--address", server.address]) == 0
    out = capsys.readouterr().out
    assert f"at {server.address}: model {server.server.served_name}, max_model_len {engine.max_model_len}" in out
    assert f"engine: {engine.dtype} on {engine.device}" in out
    if engine.cpu_isa:  # the instruction set the CPU kernels use
        assert f"engine: {engine.dtype} on {engine.device}, {engine.cpu_isa}" in out
    assert f"KV cache {engine.kv_cache_dtype}, {engine.num_blocks} blocks of {engine.block_size}" in out
    assert f"backend {engine.backend_description}" in out
    assert main(["info", "--address", server.address, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"] == server.server.served_name and data["max_model_len"] == engine.max_model_len
    assert [(e["replica"], e["dtype"], e["num_blocks"], e["batch_invariant"]) for e in data["engines"]] == [
        ("", engine.dtype, engine.num_blocks, engine.batch_invariant)]


def test_info_without_a_server_says_how_to_start_one(capsys):
    assert main(["info", "--address", "127.0.0.1:1", "--timeout", "5"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: UNAVAILABLE") and "prefix-service serve --config FILE" in err


def test_text_that_is_not_utf8_is_a_usage_error(capsys):
    """Arguments (or stdin) holding bytes that are not UTF-8 reach Python as surrogates, which no
    request can carry: one error line naming the byte, exit 2, as for a template file."""
    assert main(["generate", "--address", "127.0.0.1:1", "caf\udce9"]) == 2
    assert "error: the text given is not UTF-8 (a byte b'\\xe9' at character 3)" in capsys.readouterr().err
    assert main(["template", "add", "t\udce9", "--content", "x", "--address", "127.0.0.1:1"]) == 2
    assert main(["template", "add", "t", "--content", "caf\udce9", "--address", "127.0.0.1:1"]) == 2


def test_template_commands_have_a_deadline(capsys):
    """A server that takes the connection and never answers (stopped, wedged): the call ends at its
    deadline, DEADLINE_EXCEEDED, instead of waiting forever."""
    import socket
    with socket.socket() as wedged:
        wedged.bind(("127.0.0.1", 0))
        wedged.listen()  # connections complete, nobody speaks
        address = f"127.0.0.1:{wedged.getsockname()[1]}"
        for command in (["list"], ["remove", "x"], ["add", "x", "--content", "y"]):
            start = time.monotonic()
            assert main(["template", *command, "--address", address, "--timeout", "1"]) == 1
            assert "DEADLINE_EXCEEDED" in capsys.readouterr().err and time.monotonic() - start < 30
    from prefix_service.cli import build_parser
    defaults = {c: build_parser().parse_args(["template", c, *(["x"] if c != "list" else []),
                                              *(["--content", "y"] if c == "add" else [])]).timeout
                for c in ("add", "list", "remove")}
    assert defaults == {"add": 600.0, "list": 30.0, "remove": 30.0}


def test_template_commands_send_the_token(model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(TOKEN_ENV, "cli-secret")
    st = ServerThread(make_config(model_dir, state_file=tmp_path / "s.json")).start()
    try:
        assert main(["template", "list", "--address", st.address]) == 1
        assert "UNAUTHENTICATED" in capsys.readouterr().err
        assert main(["prefix", "list", "--address", st.address, "--token", "wrong"]) == 1
        assert "PERMISSION_DENIED" in capsys.readouterr().err
        assert main(["prefix", "list", "--address", st.address, "--token", "cli-secret"]) == 0
        assert main(["prefix", "list", "--address", st.address, "--token", "cli-secret\n"]) == 0  # as the server reads
        with pytest.raises(SystemExit) as usage:  # a token no gRPC header can carry: a usage error, not INTERNAL
            main(["prefix", "list", "--address", st.address, "--token", "cli-sécret"])
        assert usage.value.code == 2 and "printable ASCII" in capsys.readouterr().err
        # the default token comes from PREFIX_SERVICE_ADMIN_TOKEN, read when the parser is built
        monkeypatch.setenv("PREFIX_SERVICE_ADMIN_TOKEN", "cli-secret")
        assert main(["prefix", "add", "t", "--content", "the weather", "--address", st.address]) == 0  # the old name
        st.check_clean()
    finally:
        st.stop()


def test_help_teaches(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for needle in ("examples:", "serve --config configs/default.yaml", "generate --template", "template add",
                   "template list", "template remove", "prepare-model", "PREFIX_SERVICE_ADMIN_TOKEN"):
        assert needle in out
    for sub in (["generate"], ["template", "add"], ["serve"]):
        with pytest.raises(SystemExit):
            main([*sub, "--help"])
        assert "usage: prefix-service" in capsys.readouterr().out


def test_prepare_model_is_dispatched(monkeypatch):
    seen = []
    import prefix_service.prepare_model as pm
    monkeypatch.setattr(pm, "main", lambda argv: seen.append(argv) or 0)
    assert main(["prepare-model", "--quiet", "--force"]) == 0
    assert seen == [["--quiet", "--force"]]


def test_prepare_model_an_output_it_cannot_make_is_one_error_line(tmp_path, capsys):
    import prefix_service.prepare_model as pm
    try:
        pm.find_gguf()
    except pm.ModelPrepareError as e:
        pytest.skip(f"no bundled model to prepare here: {e}")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    assert pm.main(["--output", str(blocker / "model"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error:") and "File exists" in err and "Traceback" not in err


def _ray_processes(tag: str) -> dict[int, str]:
    """Live processes of Ray's (its workers are titled ray::..., then GCS and raylet) whose environment
    holds `tag` (RAY_TEST_TAG=...: inherited from the server that started their cluster, so another
    test's cluster, running beside this one, is not counted): pid -> command."""
    pids = {}
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue
        if (state != "Z" and (cmdline.startswith(b"ray::") or b"/raylet" in cmdline or b"/gcs_server" in cmdline)
                and tag.encode() in environ):
            pids[int(entry.name)] = cmdline.replace(b"\0", b" ").decode(errors="replace")[:160]
    return pids


@pytest.mark.ray
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds Ray's processes through /proc")
def test_serve_ray_stopped_while_its_fleet_starts_exits_0_and_leaves_no_ray_process(model_dir, tmp_path):
    """SIGTERM while the local Ray cluster starts: no deployment is made, the cluster stops with the
    server, exit code 0 (start() and serve() each stop the server: the second stop is a no-op)."""
    pytest.importorskip("ray.serve", reason="the fleet needs ray[serve] (pip install -e '.[ray]')")
    cfg_file = tmp_path / "fleet.yaml"
    cfg_file.write_text(yaml.safe_dump({
        "model": {"path": str(model_dir), "device": "cpu"},
        "cache": {"block_size": 4, "num_blocks": 128},
        "server": {"address": "127.0.0.1:0", "http_address": "", "admin_token_env": TOKEN_ENV},
        "ray": {"num_replicas": 1, "app_name": "cli-sigterm"},
    }))
    tag = f"RAY_TEST_TAG={uuid.uuid4().hex}"  # marks this server's cluster (_ray_processes)
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV} | dict([tag.split("=", 1)])
    proc = subprocess.Popen([sys.executable, "-m", "prefix_service", "serve", "--config", str(cfg_file)],
                            stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if "listening on" in line:  # bound; the fleet is starting
                break
        assert any("listening on" in line for line in lines), "".join(lines)
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=120)[1]
        assert proc.returncode == 0, rest
        assert "Traceback" not in rest and "local Ray cluster stopped" in rest, rest
        assert "deploying" not in "".join(lines) + rest  # stopped before the deployment
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 10
    while _ray_processes(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not (left := _ray_processes(tag)), left


@pytest.mark.parametrize("setting, backend, says", [
    ("PREFIX_SERVICE_DECODE_PREFETCH=eager", "cpu", "PREFIX_SERVICE_DECODE_PREFETCH='eager': one of "),
    ("PREFIX_SERVICE_F32_PANELS=bf16", "cpu", "PREFIX_SERVICE_F32_PANELS='bf16': one of "),
    ("PREFIX_SERVICE_F32_NATIVE_ROWS=-2", "cpu", "PREFIX_SERVICE_F32_NATIVE_ROWS='-2': a count of rows"),
    ("PREFIX_SERVICE_CPU_MARCH=not-a-cpu", "auto", "PREFIX_SERVICE_CPU_MARCH=not-a-cpu: the compiler does not know"),
    ("PREFIX_SERVICE_BF16_TEMPLATE_PRODUCTS=amx", "cpu", "PREFIX_SERVICE_BF16_TEMPLATE_PRODUCTS='amx': one of ")])
def test_serve_refuses_a_kernel_setting_it_does_not_know_in_one_line(model_dir, tmp_path, setting, backend, says):
    """An environment variable that chooses how the cpu backend's kernels compute, set to a value it
    does not take, stops `serve` before it listens: exit 1 and an `error:` line naming the variable and
    what it takes, as for a bad config file, not a traceback. Every declared variable's value is checked
    before the config is read (prefix_service/envs.py), the last one's too, which a float32 model never
    reads: it used to serve. Each is checked again where it is read: the native library reads the first at
    load, the float32 linears the next two as they are packed: the rows on every machine, including
    those whose float32 linears are not split by rows. A target the compiler does not know stops it
    under `model.backend: auto` too, rather than leaving the native kernels out for the torch backend."""
    from prefix_service.backends.cpu import native
    if native.load()[1] is not None:
        pytest.skip(f"no native CPU kernels here to read the setting: {native.load()[1]}")
    name, value = setting.split("=")
    cfg_file = tmp_path / "svc.yaml"
    cfg_file.write_text(yaml.safe_dump({
        "model": {"path": str(model_dir), "device": "cpu", "backend": backend, "dtype": "float32"},
        "cache": {"block_size": 4, "num_blocks": 64},
        "server": {"address": "127.0.0.1:0", "http_address": "127.0.0.1:0"},
    }))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PREFIX_SERVICE_") or k == "PREFIX_SERVICE_CACHE_DIR"}
    proc = subprocess.run([sys.executable, "-m", "prefix_service", "serve", "--config", str(cfg_file)],
                          capture_output=True, text=True, env={**env, name: value}, cwd=tmp_path, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "SERVING on" not in proc.stderr, proc.stderr
    assert proc.stderr.rstrip().splitlines()[-1].startswith(f"error: {says}"), proc.stderr


def test_serve_subprocess_stops_on_sigterm(model_dir, tmp_path, capsys):
    (tmp_path / "doc.txt").write_text(DOCUMENT)
    cfg_file = tmp_path / "svc.yaml"
    cfg_file.write_text(yaml.safe_dump({
        "model": {"path": str(model_dir), "device": "cpu"},
        "cache": {"block_size": 4, "num_blocks": 128},
        "server": {"address": "127.0.0.1:0", "http_address": "127.0.0.1:0", "admin_token_env": TOKEN_ENV,
                   "grace_period_s": 5},
        "prefixes": [{"name": "doc", "file": "doc.txt"}],
    }))
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    proc = subprocess.Popen([sys.executable, "-m", "prefix_service", "serve", "--config", str(cfg_file)],
                            stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    lines = []
    try:
        deadline = time.monotonic() + 60
        port = None
        while port is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            m = re.search(r"SERVING on 127\.0\.0\.1:(\d+)", line)
            port = m and int(m.group(1))
        assert port, "".join(lines)
        assert any("prefix template 'doc' (config) pinned" in l and " ms" in l for l in lines)
        http_port = int(re.search(r"HTTP on port (\d+) \(OpenAI API, no API key\)", "".join(lines)).group(1))
        conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=30)
        conn.request("POST", "/v1/completions", body=json.dumps({"model": "doc", "prompt": " the", "max_tokens": 2,
                                                                "ignore_eos": True}))
        completion = json.loads(conn.getresponse().read())
        conn.close()
        assert completion["usage"]["completion_tokens"] == 2 and completion["usage"]["prompt_tokens_details"][
            "cached_tokens"] > 0
        assert main(["generate", "--address", f"127.0.0.1:{port}", "--template", "doc", "--max-tokens", "3", " the"]) == 0
        assert "reused from the template" in capsys.readouterr().err
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=30)[1]
        assert proc.returncode == 0, rest
        assert "SIGTERM: draining" in rest and "stopped" in rest
        frozen = re.search(r"start-up done: (\d+) objects moved out of the garbage collector's walks", rest)
        assert frozen and int(frozen.group(1)) > 10_000, rest  # torch, grpc, the tokenizer and the engine
        assert (tmp_path / "svc.state.json").exists() is False  # nothing added at run time, nothing written
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_template_add_from_a_file_that_is_not_utf8_text(tmp_path, capsys):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"caf\xe9 menu")
    assert main(["template", "add", "menu", "--file", str(bad), "--address", "127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert f"error: cannot read {bad}" in err and "Traceback" not in err


def test_generate_sends_each_sampling_flag_to_the_server(server, capsys):
    """--temperature, --top-p, --seed and --stop each reach the request: a seeded sample is the
    engine's sample for that seed, a top_p of 1e-6 leaves only the argmax however hot, and a stop
    string cuts the output before it."""
    def engine_text(**sampling):
        return server.engine.generate([GenerateRequest(prompt=" the order", prefix_name="doc", sampling=SamplingParams(
            max_tokens=12, **sampling))])[0]

    def cli(*flags):
        assert main(["generate", "--address", server.address, "--template", "doc", "--max-tokens", "12", *flags,
                     " the order"]) == 0, capsys.readouterr().err
        return capsys.readouterr()

    seeded = engine_text(temperature=1.5, seed=11)
    assert seeded.text != engine_text(temperature=1.5, seed=12).text  # the seed decides the sample
    assert cli("--temperature", "1.5", "--seed", "11").out == seeded.text + "\n"
    greedy_out = engine_text()
    assert cli("--temperature", "1.5", "--top-p", "1e-6").out == greedy_out.text + "\n"
    text = greedy_out.text
    stop = next(piece for piece in (text[i:i + 3] for i in range(1, len(text) - 2))
                if piece.strip() and text.count(piece) == 1)  # appears once, not at the start
    out, err = cli("--stop", stop)
    assert out == text[:text.index(stop)] + "\n" and err.startswith("[stop]")


def test_generate_takes_each_integer_flag_at_its_bounds():
    """The integer flags take the whole range a request holds: --max-tokens 0 (the server's default)
    to 2^32-1, --top-k -1 (no limit) to 2^31-1, --seed 0 to 2^64-1."""
    from prefix_service.cli import build_parser
    parse = build_parser().parse_args
    low = parse(["generate", "--max-tokens", "0", "--top-k", "-1", "--seed", "0", "x"])
    high = parse(["generate", "--max-tokens", str(2**32 - 1), "--top-k", str(2**31 - 1), "--seed", str(2**64 - 1), "x"])
    assert (low.max_tokens, low.top_k, low.seed) == (0, -1, 0)
    assert (high.max_tokens, high.top_k, high.seed) == (2**32 - 1, 2**31 - 1, 2**64 - 1)


@pytest.fixture
def served_configs(monkeypatch):
    """`serve` up to the point it would start: the config each run would serve, in order."""
    import prefix_service.server
    seen = []

    async def fake_serve(config, *make_server):
        seen.append((config, make_server))
    monkeypatch.setattr(prefix_service.server, "serve", fake_serve)
    return seen


def test_serve_flags_override_the_configs_addresses(model_dir, tmp_path, served_configs):
    """--address and --http-address replace the config's; --http-address '' turns the HTTP API off
    (an empty string is an override, not the flag's absence; the config holds None for off)."""
    cfg_file = tmp_path / "svc.yaml"
    cfg_file.write_text(yaml.safe_dump({"model": {"path": str(model_dir), "device": "cpu"},
                                        "server": {"address": "127.0.0.1:7001", "http_address": "127.0.0.1:7002"}}))
    assert main(["serve", "--config", str(cfg_file)]) == 0
    assert main(["serve", "--config", str(cfg_file), "--address", "127.0.0.1:7101", "--http-address", ""]) == 0
    assert main(["serve", "--config", str(cfg_file), "--http-address", "127.0.0.1:7102"]) == 0
    assert [(c.server.address, c.server.http_address, c.ray, extra) for c, extra in served_configs] == [
        ("127.0.0.1:7001", "127.0.0.1:7002", None, ()), ("127.0.0.1:7101", None, None, ()),
        ("127.0.0.1:7001", "127.0.0.1:7102", None, ())]


def test_serve_replicas_sets_a_fixed_fleet_size_over_the_configs_autoscaling(model_dir, tmp_path, served_configs,
                                                                             monkeypatch):
    """--replicas N serves a fleet of exactly N: the config's min_replicas and max_replicas (autoscaling)
    no longer apply."""
    import types
    import prefix_service.fleet
    launcher = types.ModuleType("prefix_service.fleet.launcher")
    launcher.fleet_server = object()
    monkeypatch.setitem(sys.modules, "prefix_service.fleet.launcher", launcher)
    monkeypatch.setattr(prefix_service.fleet, "use_serve_env", lambda: {})
    cfg_file = tmp_path / "svc.yaml"
    cfg_file.write_text(yaml.safe_dump({"model": {"path": str(model_dir), "device": "cpu"},
                                        "ray": {"min_replicas": 1, "max_replicas": 4}}))
    assert main(["serve", "--config", str(cfg_file), "--replicas", "3"]) == 0
    (config, extra), = served_configs
    assert (config.ray.num_replicas, config.ray.min_replicas, config.ray.max_replicas) == (3, None, None)
    assert extra == (launcher.fleet_server,)


def test_generate_system_without_chat_is_a_usage_error_before_any_call(capsys):
    """--system only means something with --chat: exit 2 with one line, no request sent (no server
    is asked, so none needs to be running)."""
    assert main(["generate", "--address", "127.0.0.1:1", "--system", "be terse", "hello"]) == 2
    assert capsys.readouterr().err == "error: --system needs --chat\n"


def test_the_address_defaults_to_the_environment_variable_for_every_client_command(monkeypatch):
    """PREFIX_SERVICE_ADDRESS, read when the parser is built, is the default --address of generate,
    info and the template commands; without it, 127.0.0.1:50051."""
    from prefix_service.cli import build_parser
    commands = (["generate", "x"], ["info"], ["template", "list"], ["template", "remove", "t"])
    monkeypatch.delenv("PREFIX_SERVICE_ADDRESS", raising=False)
    assert {build_parser().parse_args(c).address for c in commands} == {"127.0.0.1:50051"}
    monkeypatch.setenv("PREFIX_SERVICE_ADDRESS", "10.1.2.3:6000")
    assert {build_parser().parse_args(c).address for c in commands} == {"10.1.2.3:6000"}


def test_generate_structured_output_flags_reach_the_request(server, capsys, tmp_path):
    """--choice, --json-schema (inline or @FILE), --regex and --text each become the request's
    structured output: the answer is the engine's for that constraint; the server's own check names a
    bad one (exit 1), an unreadable @FILE is a usage error (exit 2), and two kinds at once are refused."""
    from prefix_service.sampling_params import StructuredOutput

    def engine_text(structured, template="doc"):
        request = GenerateRequest(prompt=" the order", prefix_name=template,
                                  sampling=SamplingParams(max_tokens=12, structured=structured))
        return server.engine.generate([request])[0].text

    def cli(*flags, template="doc", code=0):
        assert main(["generate", "--address", server.address, "--template", template, "--max-tokens", "12", *flags,
                     " the order"]) == code, capsys.readouterr().err
        return capsys.readouterr()

    choices = (" yes", " no", " maybe later")
    out = cli(*[a for c in choices for a in ("--choice", c)]).out
    assert out[:-1] in choices and out == engine_text(StructuredOutput("choice", choices=choices)) + "\n"
    schema = ('{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], '
              '"additionalProperties": false}')
    (tmp_path / "ok.json").write_text(schema)
    out = cli("--json-schema", f"@{tmp_path / 'ok.json'}").out
    assert out[:-1] in ('{"ok":true}', '{"ok":false}')
    assert out == engine_text(StructuredOutput("json_schema", schema)) + "\n"
    assert cli("--json-schema", schema).out == out
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}\n", cli("--regex", "[0-9]{3}-[a-z]{2}").out)

    server.engine.add_template("labelled", DOCUMENT, structured=StructuredOutput("choice", choices=(" a", " b")))
    try:
        assert cli(template="labelled").out[:-1] in (" a", " b")  # the template's own output
        free = engine_text(StructuredOutput("text"), template="labelled")
        assert free not in (" a", " b") and cli("--text", template="labelled").out == free + "\n"
    finally:
        server.engine.remove_template("labelled")

    assert "error: INVALID_ARGUMENT" in cli("--regex", "[0-9", code=1).err
    assert f"error: cannot read {tmp_path / 'none.json'}" in cli("--json-schema", f"@{tmp_path / 'none.json'}",
                                                                 code=2).err
    with pytest.raises(SystemExit) as info:
        main(["generate", "--address", server.address, "--choice", "a", "--regex", "b", "x"])
    assert info.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_generate_passes_ignore_eos_to_the_client(monkeypatch, capsys):
    from prefix_service import client as client_module
    calls = []

    def generate(self, prompt, template=None, **kwargs):
        calls.append(kwargs)
        return iter(())
    monkeypatch.setattr(client_module.PrefixServiceClient, "generate", generate)
    assert main(["generate", "--address", "127.0.0.1:1", "--ignore-eos", "x"]) == 0
    assert main(["generate", "--address", "127.0.0.1:1", "x"]) == 0
    assert [c["ignore_eos"] for c in calls] == [True, False] and calls[0]["structured_output"] is None
