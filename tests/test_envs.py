"""The environment variables' table (prefix_service/envs.py): every PREFIX_SERVICE_* variable the code
reads is declared there and documented in docs/operations.md; a value a variable does not take is
refused naming the variable, the value and what it takes, by the reader's error class; `serve` checks
every set one before it reads its config, and logs the kernel settings it was given."""
from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from prefix_service import envs
from prefix_service.cli import main
from prefix_service.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
# where the service's own code reads variables (the tests' own, PREFIX_SERVICE_TEST_*, are theirs)
CODE = ("prefix_service", "cuda_ops", "scripts")
NAME = re.compile(r"PREFIX_SERVICE_[A-Z0-9_]*[A-Z0-9](?![A-Z0-9_*])")  # not a family: PREFIX_SERVICE_BF16_*


@pytest.fixture(autouse=True)
def _no_settings(monkeypatch):
    for var in envs.VARIABLES:
        monkeypatch.delenv(var.name, raising=False)


def test_every_variable_the_code_names_is_declared():
    named: dict[str, str] = {}
    for top in CODE:
        for path in sorted((REPO / top).rglob("*.py")):
            for name in NAME.findall(path.read_text(encoding="utf-8")):
                named.setdefault(name, str(path.relative_to(REPO)))
    assert named, "no variable found: the scan reads nothing"
    undeclared = {name: where for name, where in named.items() if name not in envs.BY_NAME}
    assert not undeclared, f"read but not in prefix_service/envs.py: {undeclared}"
    unread = set(envs.BY_NAME) - set(named)
    assert not unread, f"declared but read nowhere: {unread}"
    assert len(envs.BY_NAME) == len(envs.VARIABLES), "a variable declared twice"


def test_the_operations_guide_shows_the_table():
    text = (REPO / "docs" / "operations.md").read_text(encoding="utf-8")
    assert envs.markdown_table() in text, "docs/operations.md's table differs from envs.markdown_table()"


def test_choice_takes_its_values_and_refuses_others(monkeypatch):
    name = "PREFIX_SERVICE_F32_LINEAR"
    assert envs.choice(name) is None
    monkeypatch.setenv(name, "  ")
    assert envs.choice(name) is None  # empty counts as unset
    monkeypatch.setenv(name, " inner_product ")
    assert envs.choice(name) == "inner_product"

    class ReaderError(Exception):
        pass
    monkeypatch.setenv(name, "bogus")
    with pytest.raises(ReaderError, match=r"^PREFIX_SERVICE_F32_LINEAR='bogus': one of native, inner_product, "
                                          r"measure is needed$"):
        envs.choice(name, ReaderError)
    with pytest.raises(ConfigError):
        envs.choice(name)


def test_an_older_name_of_a_value_is_taken_as_the_value(monkeypatch):
    monkeypatch.setenv("PREFIX_SERVICE_BF16_TEMPLATE_ATTENTION", "brgemm")
    assert envs.choice("PREFIX_SERVICE_BF16_TEMPLATE_ATTENTION") == "matrix"
    envs.check()


@pytest.mark.parametrize("raw, expected", [(None, 7), ("0", 0), ("96", 96), ("-2", None), ("8.5", None),
                                           ("many", None)])
def test_count_takes_whole_numbers_from_zero(monkeypatch, raw, expected):
    name = "PREFIX_SERVICE_F32_NATIVE_ROWS"
    if raw is not None:
        monkeypatch.setenv(name, raw)
    if expected is None:
        with pytest.raises(ConfigError, match=f"^{name}='{re.escape(raw)}': a count of rows, 0 or more, is needed$"):
            envs.count(name, 7)
    else:
        assert envs.count(name, 7) == expected


def test_an_undeclared_name_is_a_programming_error():
    with pytest.raises(KeyError, match="PREFIX_SERVICE_NOT_A_SETTING"):
        envs.value("PREFIX_SERVICE_NOT_A_SETTING")


def test_check_names_the_first_bad_value_and_leaves_free_form_ones(monkeypatch):
    envs.check()
    monkeypatch.setenv("PREFIX_SERVICE_CPU_MARCH", "anything")  # the compiler judges it, where it builds
    monkeypatch.setenv("PREFIX_SERVICE_ADDRESS", "not an address")
    envs.check()
    monkeypatch.setenv("PREFIX_SERVICE_BF16_FEW_ROWS", "yes")
    with pytest.raises(ConfigError, match=r"^PREFIX_SERVICE_BF16_FEW_ROWS='yes': 1, 0 or all is needed$"):
        envs.check()


@pytest.mark.parametrize("raw", ["-1", "lots"])
def test_check_refuses_a_count_that_is_not_a_whole_number(monkeypatch, raw):
    """A count has no choices to list: check tests it as count() will, so `serve` stops at once."""
    monkeypatch.setenv("PREFIX_SERVICE_BF16_BRGEMM_ROWS", raw)
    with pytest.raises(ConfigError, match=f"^PREFIX_SERVICE_BF16_BRGEMM_ROWS='{raw}': a count of rows, 0 or more"):
        envs.check()


def test_set_values_name_the_kernel_settings_and_never_a_secret(monkeypatch):
    monkeypatch.setenv("PREFIX_SERVICE_F32_PANELS", "float32")
    monkeypatch.setenv("PREFIX_SERVICE_DECODE_PREFETCH", "task")
    monkeypatch.setenv("PREFIX_SERVICE_ADDRESS", "127.0.0.1:1")
    monkeypatch.setenv("PREFIX_SERVICE_ADMIN_TOKEN", "s3cret")
    assert envs.set_values() == {"PREFIX_SERVICE_F32_PANELS": "float32", "PREFIX_SERVICE_DECODE_PREFETCH": "task"}
    assert "PREFIX_SERVICE_ADMIN_TOKEN" not in envs.set_values(("kernels", "server", "client"))
    assert envs.set_values(("client",)) == {"PREFIX_SERVICE_ADDRESS": "127.0.0.1:1"}


def test_the_kernel_modules_take_the_declared_values():
    from prefix_service.backends.cpu import linear, native, onednn
    assert set(onednn.KERNEL_CHOICES) == {*onednn.KERNELS, "measure"}
    assert set(onednn.TEMPLATE_PRODUCTS) == set(envs.BY_NAME[onednn.TEMPLATE_PRODUCTS_ENV].choices)
    assert set(native.DECODE_PREFETCHES) == set(envs.BY_NAME[native.DECODE_PREFETCH_ENV].choices)
    assert linear.FLOAT32_KERNELS == envs.BY_NAME[linear.FLOAT32_ENV].choices
    assert envs.BY_NAME[onednn.COLUMNS_ENV].choices == tuple(str(c) for c in range(16, 65, 16))


def test_serve_checks_the_settings_before_the_config_and_logs_them(monkeypatch, tmp_path, caplog, capsys):
    missing = tmp_path / "missing.yaml"
    monkeypatch.setenv("PREFIX_SERVICE_F32_PANELS", "float32")
    monkeypatch.setenv("PREFIX_SERVICE_API_KEY", "s3cret")
    with caplog.at_level(logging.INFO, logger="prefix_service.envs"):
        assert main(["serve", "--config", str(missing)]) == 1
    assert "kernel settings from the environment: PREFIX_SERVICE_F32_PANELS=float32" in caplog.text
    assert "s3cret" not in caplog.text
    assert "cannot read config file" in capsys.readouterr().err  # it went on to the config

    monkeypatch.setenv("PREFIX_SERVICE_F32_PANELS", "bf16")
    assert main(["serve", "--config", str(missing)]) == 1
    err = capsys.readouterr().err
    assert err.strip() == "error: PREFIX_SERVICE_F32_PANELS='bf16': one of auto, float32 is needed", err
