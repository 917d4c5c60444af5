"""The server's config keys (ServerConfig) and configs/default.yaml."""
from __future__ import annotations

from pathlib import Path

import pytest

from prefix_service.config import ServerConfig, config_from_dict, load_config
from prefix_service.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent


def server_cfg(**server):
    return config_from_dict({"model": {"path": "/m"}, "server": server})


def test_unknown_server_key_names_the_known_ones():
    with pytest.raises(ConfigError) as info:
        server_cfg(adress="127.0.0.1:1")
    msg = str(info.value)
    assert "server: unknown key(s) adress" in msg
    for key in ("address", "admin_token_env", "state_file", "grace_period_s", "enable_admin", "enable_reflection"):
        assert key in msg


def test_unknown_top_level_key():
    with pytest.raises(ConfigError, match="known keys: model, cache, scheduler, server, prefixes"):
        config_from_dict({"model": {"path": "/m"}, "sever": {}})


@pytest.mark.parametrize("server, needle", [
    ({"address": "localhost"}, "server.address: expected host:port"),
    ({"address": "127.0.0.1:99999"}, "server.address"),
    ({"address": 50051}, "server.address"),
    ({"admin_token_env": "not a var"}, "server.admin_token_env"),
    ({"admin_token_env": ""}, "server.admin_token_env"),
    ({"state_file": ""}, "server.state_file"),
    ({"grace_period_s": -1}, "server.grace_period_s"),
    ({"grace_period_s": True}, "server.grace_period_s"),
    ({"grace_period_s": "10s"}, "server.grace_period_s"),
    ({"enable_admin": "yes"}, "server.enable_admin: expected true or false"),
    ({"enable_reflection": 1}, "server.enable_reflection"),
])
def test_bad_server_values(server, needle):
    with pytest.raises(ConfigError) as info:
        server_cfg(**server)
    assert needle in str(info.value)
    bad = list(server.values())[0]
    if bad != "":
        assert repr(bad) in str(info.value)  # names the value


@pytest.mark.parametrize("address, host, port, loopback", [
    ("127.0.0.1:50051", "127.0.0.1", 50051, True),
    ("127.9.9.9:1", "127.9.9.9", 1, True),
    ("localhost:0", "localhost", 0, True),
    ("[::1]:7", "::1", 7, True),
    ("0.0.0.0:50051", "0.0.0.0", 50051, False),
    ("[::]:50051", "::", 50051, False),
    ("my-host.internal:443", "my-host.internal", 443, False),
    ("[::1]:65535", "::1", 65535, True),  # the highest port
])
def test_address_parsing(address, host, port, loopback):
    cfg = ServerConfig(address=address)
    assert (cfg.host, cfg.port, cfg.is_loopback) == (host, port, loopback)


def test_the_highest_port_and_a_grace_period_of_zero_are_taken_and_just_past_them_is_not():
    cfg = server_cfg(address="0.0.0.0:65535", http_address="127.0.0.1:65534", grace_period_s=0)
    assert cfg.server.port == 65535 and cfg.server.grace_period_s == 0  # 0: in-flight requests end at once
    with pytest.raises(ConfigError, match="server.address: expected host:port"):
        server_cfg(address="0.0.0.0:65536")
    with pytest.raises(ConfigError, match=r"server.grace_period_s: expected seconds in \[0, 3600\], got 3601"):
        server_cfg(grace_period_s=3601)


def test_state_file_resolves_against_the_config_folder(tmp_path):
    cfg = config_from_dict({"model": {"path": "m"}, "server": {"state_file": "s/state.json"}}, base_dir=tmp_path)
    assert cfg.server.state_file == str(tmp_path / "s" / "state.json")


def test_default_yaml():
    cfg = load_config(REPO / "configs" / "default.yaml")
    assert Path(cfg.engine.model.path) == REPO / ".cache" / "models" / "SmolLM2-135M-Instruct"
    try:
        from prefix_service.prepare_model import CACHE_ENV, default_model_dir
    except ImportError:
        pass
    else:
        import os
        if not os.environ.get(CACHE_ENV):
            assert Path(cfg.engine.model.path) == default_model_dir()
    assert cfg.engine.model.dtype == "auto"
    assert [p.name for p in cfg.prefixes] == ["intent_classifier", "table_qa"]
    intent, table = (p.read_text() for p in cfg.prefixes)
    assert 3000 < len(intent) < 5000 and "Intent:" in intent
    assert len(table) > 4000 and table.count("\n| ") > 25
    assert cfg.server.address == "127.0.0.1:50051" and cfg.server.is_loopback


@pytest.mark.parametrize("text,key,lines", [
    ("model:\n  path: /m\nserver:\n  address: 127.0.0.1:1\nserver:\n  grace_period_s: 4\n", "server", (3, 5)),
    ("model:\n  path: /m\n  dtype: auto\n  dtype: float32\n", "dtype", (3, 4)),
    ("model:\n  path: /m\nprefixes:\n  - name: a\n    content: x\n    content: y\n", "content", (5, 6)),
])
def test_a_key_given_twice_is_a_config_error_naming_it(tmp_path, text, key, lines):
    """YAML keeps a repeated key's last value silently (a second `server:` section would drop the
    first one's settings): the config is refused, naming the key and both lines."""
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"the key '{key}' is given twice \(lines {lines[0]} and {lines[1]}\)"):
        load_config(path)
    path.write_text(text.replace(f"{key}:", f"{key}_other:", 1) if key != "server" else text.replace(
        "server:\n  grace_period_s", "server_unused:\n  grace_period_s"))
    with pytest.raises(ConfigError) as other:
        load_config(path)
    assert "given twice" not in str(other.value)  # given once, the config reads on (to the unknown key)
