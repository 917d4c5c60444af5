"""Security: TLS on every address (generation, a separate admin address, metrics), the admin
address policy, template name and size limits, template files confined to the config's folder,
and the admin token (constant-time check, never logged, a warning when it would cross the
network in clear)."""
from __future__ import annotations

import http.client
import ssl
import urllib.request
from pathlib import Path

import grpc
import pytest

from server_fixtures import DOCUMENT, Clients, collect, greedy_request, self_signed_cert, started_servers

from prefix_service.config import TemplateSpec, ServerConfig, config_from_dict, load_config, validate_template_name
from prefix_service.errors import ConfigError
from prefix_service.proto import prefix_service_pb2 as pb
from prefix_service.server.auth import AdminAuth, check_admin_exposure
from prefix_service.server.status import PermissionDenied


TEMPLATES = (TemplateSpec("doc", content=DOCUMENT),)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="session")
def cert(tmp_path_factory) -> tuple[Path, Path]:
    return self_signed_cert(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def make_server(model_dir, tmp_path, monkeypatch):
    with started_servers(model_dir, tmp_path, monkeypatch, prefixes=TEMPLATES) as factory:
        yield factory


def add(c: Clients, name: str, content: str, metadata=()) -> pb.PrefixTemplate:
    return c.admin.AddPrefixTemplate(pb.AddPrefixTemplateRequest(name=name, content=content), metadata=metadata,
                                     timeout=30)


def code_of(fn, *args, **kwargs) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        fn(*args, **kwargs)
    return info.value.code()


# --- TLS -----------------------------------------------------------------------------------

def test_tls_on_generation_admin_and_metrics(make_server, cert):
    cert_file, key_file = cert
    st = make_server(tls_cert_file=str(cert_file), tls_key_file=str(key_file), token="t0ken",
                     admin_address="127.0.0.1:0", metrics_address="127.0.0.1:0")
    pem = cert_file.read_bytes()
    gen = Clients(st.address, root_certificates=pem)
    last = collect(gen.generation.Generate(greedy_request(" the", "doc", max_tokens=3)))[2]
    assert last.usage.completion_tokens == 3

    admin_port = st.server.admin_port
    assert admin_port not in (None, st.server.port)
    admin = Clients(f"127.0.0.1:{admin_port}", root_certificates=pem)
    assert add(admin, "faq", "the order price", metadata=(("authorization", "Bearer t0ken"),)).name == "faq"
    # the admin service is only on its own address, and each address says where the other service is
    with pytest.raises(grpc.RpcError) as info:
        add(gen, "x", "the", metadata=(("authorization", "Bearer t0ken"),))
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert f"served on server.admin_address (port {admin_port})" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        next(admin.generation.Generate(greedy_request(" the", max_tokens=1)))
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert f"served on server.address (port {st.server.port})" in info.value.details()

    # plaintext clients get nowhere
    plain = Clients(st.address)
    assert code_of(collect, plain.generation.Generate(greedy_request(" the", max_tokens=1), timeout=5)) == \
        grpc.StatusCode.UNAVAILABLE

    # metrics over HTTPS with the same certificate
    ctx = ssl.create_default_context(cadata=pem.decode())
    with urllib.request.urlopen(f"https://127.0.0.1:{st.server.metrics_port}/metrics", context=ctx,
                                timeout=10) as resp:
        assert b"prefix_service_requests_total" in resp.read()
    # plaintext HTTP against the TLS endpoint: the port answers (it is not refused), but no HTTP comes back
    with pytest.raises((http.client.BadStatusLine, ConnectionResetError)):
        urllib.request.urlopen(f"http://127.0.0.1:{st.server.metrics_port}/metrics", timeout=5).read()


def test_an_admin_call_with_the_admin_api_off_says_so(make_server):
    st = make_server(enable_admin=False)
    with pytest.raises(grpc.RpcError) as info:
        add(Clients(st.address), "x", "the")
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "off on this server (server.enable_admin: false)" in info.value.details()


def test_client_and_cli_speak_tls(make_server, cert, capsys):
    from prefix_service.cli import main
    from prefix_service.client import PrefixServiceClient
    cert_file, key_file = cert
    st = make_server(tls_cert_file=str(cert_file), tls_key_file=str(key_file))
    with PrefixServiceClient(st.address, tls_ca_file=str(cert_file)) as client:
        assert [t.name for t in client.list_templates()] == ["doc"]
        assert list(client.generate(" the", "doc", max_tokens=2))[-1].usage.completion_tokens == 2
    assert main(["generate", "--address", st.address, "--tls-ca", str(cert_file), "--prefix", "doc",
                 "--max-tokens", "2", " the"]) == 0
    assert "2 completion tokens" in capsys.readouterr().err
    assert main(["template", "list", "--address", st.address, "--tls-ca", str(cert_file)]) == 0
    assert "doc" in capsys.readouterr().out
    assert main(["prefix", "list", "--address", st.address, "--tls-ca", "/nonexistent/ca.pem"]) == 2


def test_bad_tls_files_stop_the_start(make_server, tmp_path, cert):
    cert_file, key_file = cert
    with pytest.raises(ConfigError, match="server.tls_cert_file: cannot read"):
        make_server(tls_cert_file=str(tmp_path / "missing.pem"), tls_key_file=str(key_file))
    other_cert, other_key = self_signed_cert(tmp_path / "other")
    with pytest.raises(ConfigError, match="not a PEM certificate chain and its private key"):
        make_server(tls_cert_file=str(cert_file), tls_key_file=str(other_key))  # a key of another cert
    with pytest.raises(ConfigError, match="go together"):
        ServerConfig(tls_cert_file=str(cert_file))


def test_tls_paths_resolve_against_the_config_folder(tmp_path):
    cfg = config_from_dict({"model": {"path": "m"}, "server": {"tls_cert_file": "tls/c.pem",
                                                               "tls_key_file": "tls/k.pem"}}, base_dir=tmp_path)
    assert (cfg.server.tls_cert_file, cfg.server.tls_key_file) == (str(tmp_path / "tls/c.pem"),
                                                                   str(tmp_path / "tls/k.pem"))


# --- where the admin service listens --------------------------------------------------------

def test_admin_address_policy():
    # a public generation address with admin kept on loopback needs no token
    check_admin_exposure(ServerConfig(address="0.0.0.0:50051", admin_address="127.0.0.1:50052"), None)
    with pytest.raises(ConfigError, match="server.admin_address 0.0.0.0:50052 accepts connections"):
        check_admin_exposure(ServerConfig(address="127.0.0.1:50051", admin_address="0.0.0.0:50052"), None)
    check_admin_exposure(ServerConfig(address="127.0.0.1:50051", admin_address="0.0.0.0:50052"), "tok")
    with pytest.raises(ConfigError, match="server.admin_address: .* is server.address itself"):
        ServerConfig(address="127.0.0.1:50051", admin_address="127.0.0.1:50051")
    with pytest.raises(ConfigError, match="server.metrics_address: expected host:port"):
        ServerConfig(metrics_address="9090")


def test_cleartext_token_off_loopback_is_warned_about(caplog):
    from prefix_service.server.auth import warn_cleartext_token
    warn_cleartext_token(ServerConfig(address="0.0.0.0:1"), "secret-token")
    assert "plaintext" in caplog.text and "secret-token" not in caplog.text
    caplog.clear()
    warn_cleartext_token(ServerConfig(address="0.0.0.0:1", tls_cert_file="c", tls_key_file="k"), "secret-token")
    warn_cleartext_token(ServerConfig(address="0.0.0.0:1", admin_address="127.0.0.1:2"), "secret-token")
    assert caplog.text == ""


# --- the token ------------------------------------------------------------------------------

def test_token_check_is_exact():
    auth = AdminAuth("s3cret")
    auth.check([("authorization", "Bearer s3cret")])
    for wrong in ("s3cre", "s3crett", "S3cret", "", "s3cret\x00", "sécret"):
        with pytest.raises(PermissionDenied) as info:
            auth.check([("authorization", f"Bearer {wrong}")] if wrong else [("authorization", "Bearer  ")])
        assert "s3cret" not in str(info.value)


def test_token_never_appears_in_logs_or_errors(make_server, caplog):
    caplog.set_level("DEBUG")
    st = make_server(token="do-not-log-me", metrics_address="127.0.0.1:0")
    c = Clients(st.address)
    add(c, "faq", "the order", metadata=(("authorization", "Bearer do-not-log-me"),))
    with pytest.raises(grpc.RpcError) as info:
        add(c, "faq2", "the order", metadata=(("authorization", "Bearer guess-0f-a-stranger"),))
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "guess-0f" not in info.value.details() and "do-not-log-me" not in info.value.details()
    text = caplog.text
    assert "do-not-log-me" not in text and "guess-0f-a-stranger" not in text
    with urllib.request.urlopen(f"http://127.0.0.1:{st.server.metrics_port}/metrics", timeout=10) as resp:
        assert b"do-not-log-me" not in resp.read()


def test_malformed_admin_request_from_a_stranger_is_unauthenticated(make_server):
    st = make_server(token="tok")
    call = Clients(st.address).channel.unary_unary("/prefix_service.v1.PrefixAdmin/AddPrefixTemplate")
    with pytest.raises(grpc.RpcError) as info:
        call(b"\xff\xff\xff", timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as info:
        call(b"\xff\xff\xff", metadata=(("authorization", "Bearer tok"),), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# --- template names, sizes and files ------------------------------------------------------

@pytest.mark.parametrize("name", ["a" * 129, "", "-lead", ".hidden", "sp ace", "tab\t", "doc\n", "naïve", "a/b",
                                  "../x", "東京", "emoji😀"])
def test_bad_template_names(name):
    with pytest.raises(ConfigError, match="invalid prefix name"):
        validate_template_name(name)


def test_good_template_names():
    for name in ("a", "A" * 128, "intent_classifier", "v1.2-beta", "0day"):
        assert validate_template_name(name) == name


def test_template_size_limit(make_server):
    st = make_server(max_template_bytes=100, prefixes=())
    c = Clients(st.address)
    with pytest.raises(grpc.RpcError) as info:
        add(c, "big", "é" * 51)  # 102 bytes in UTF-8
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "102 bytes" in info.value.details() and "server.max_template_bytes" in info.value.details()
    assert add(c, "small", "é" * 50).name == "small"
    with pytest.raises(grpc.RpcError) as info:
        c.admin.AddPrefixTemplate(pb.AddPrefixTemplateRequest(name="bot", system_prompt="x" * 101), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # a YAML template over the limit stops the start
    with pytest.raises(Exception, match="'doc' from the config failed to warm up.*max_template_bytes"):
        make_server(max_template_bytes=64)


def test_template_size_limit_config_key(tmp_path):
    cfg = config_from_dict({"model": {"path": "m"}, "server": {"max_template_bytes": "64KiB"}}, base_dir=tmp_path)
    assert cfg.server.max_template_bytes == 65536
    with pytest.raises(ConfigError, match="server.max_template_bytes"):
        config_from_dict({"model": {"path": "m"}, "server": {"max_template_bytes": 0}})


def test_template_files_stay_inside_the_config_folder(tmp_path):
    conf = tmp_path / "conf"
    (conf / "prompts").mkdir(parents=True)
    (conf / "prompts" / "ok.txt").write_text("the order")
    (tmp_path / "secret.txt").write_text("not a template")
    (conf / "prompts" / "link.txt").symlink_to(tmp_path / "secret.txt")

    def load(file: str):
        (conf / "svc.yaml").write_text(f"model: {{path: m}}\nprefixes:\n  - {{name: t, file: '{file}'}}\n")
        return load_config(conf / "svc.yaml")

    assert load("prompts/ok.txt").prefixes[0].read_text() == "the order"
    assert load(str(conf / "prompts" / "ok.txt")).prefixes[0].read_text() == "the order"  # absolute, inside
    for bad in ("../secret.txt", str(tmp_path / "secret.txt"), "prompts/../../secret.txt", "prompts/link.txt",
                "/etc/passwd"):
        with pytest.raises(ConfigError, match=r"prefixes\[t\]\.file: .*outside the config file's folder"):
            load(bad)
