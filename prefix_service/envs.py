"""The environment variables the service reads, in one table: what each takes, what applies where it
is unset, and what it is for (docs/operations.md, "Environment variables", lists the same table; a
test keeps the two and the code's reads in step).

Most are the cpu backend's kernel settings, for comparing kernels on one machine; a server never
needs them. Each is read where its choice is made (a model's build, a template's packing), through
`choice` or `count` here, which raise the caller's error class naming the variable, its value and
what it takes. `check` applies the same test to every one that is set before a server loads anything,
so a mistyped value stops `prefix-service serve` at once instead of after the model has loaded, or
at a template's pinning. What depends on the machine (a kernel this CPU lacks) is checked where the
value is used.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from prefix_service.errors import ConfigError


@dataclass(frozen=True)
class Variable:
    name: str
    # who reads it: "kernels" (a server's cpu backend: what it computes with), "cuda", "build" (where the kernels'
    # libraries are kept), "client", "server", "tools", "tests"
    scope: str
    default: str  # what applies where it is unset or empty
    meaning: str
    choices: tuple[str, ...] = ()  # the values it takes (empty: see `takes`)
    aliases: tuple[tuple[str, str], ...] = ()  # (an older name of a value, the value), still taken
    count: bool = False  # a count, 0 or more
    takes: str = ""  # what it takes, in words (for choices: instead of "one of" them)
    secret: bool = False  # never logged

    def what(self) -> str:
        """What the variable takes, as an error message ends: "one of a, b is needed"."""
        if self.count:
            return "a count of rows, 0 or more, is needed"
        if self.choices and not self.takes:
            return f"one of {', '.join(self.choices)} is needed"
        return f"{self.takes} is needed"


_KERNEL_NOTE = "to compare kernels on one machine"

VARIABLES: tuple[Variable, ...] = (
    # the cpu backend's kernels
    Variable("PREFIX_SERVICE_CPU_MARCH", "kernels", "native (this CPU)",
             "the compiler target (-march) the native kernels are built for, e.g. cooperlake to run the "
             "AVX512-BF16 code on a CPU that has it but hides it", takes="a target the C++ compiler knows"),
    Variable("PREFIX_SERVICE_CACHE_DIR", "build", "~/.cache/prefix_service",
             "where the native kernel libraries are built and kept, one file per source, flags and CPU",
             takes="a folder"),
    Variable("PREFIX_SERVICE_F32_LINEAR", "kernels",
             "inner_product above PREFIX_SERVICE_F32_NATIVE_ROWS rows on AVX2 where oneDNN loads, else native",
             f"what multiplies a float32 model's linear layers ({_KERNEL_NOTE}; measure: the crossover timed "
             "when the model is built)", choices=("native", "inner_product", "measure")),
    Variable("PREFIX_SERVICE_F32_NATIVE_ROWS", "kernels", "128",
             "with inner_product: the most rows a call runs on the native kernel", count=True),
    Variable("PREFIX_SERVICE_F32_PANELS", "kernels", "auto (bf16 where every value of a weight is a bf16 one)",
             f"how the native kernel holds a float32 weight ({_KERNEL_NOTE})", choices=("auto", "float32")),
    Variable("PREFIX_SERVICE_DECODE_PREFETCH", "kernels", "paced on an Intel CPU, task elsewhere",
             "how decode attention asks for each sequence's cache rows ahead of reading them; the output is the "
             "same either way", choices=("task", "paced")),
    Variable("PREFIX_SERVICE_BF16_LINEAR", "kernels",
             "measure where the CPU has AMX, else oneDNN's inner product (emulated without bf16 units)",
             f"what multiplies a bfloat16 model's linear layers ({_KERNEL_NOTE})",
             choices=("inner_product", "emulated", "brgemm", "measure")),
    Variable("PREFIX_SERVICE_BF16_BRGEMM_ROWS", "kernels", "0",
             "with the inner product: the most rows a call runs on brgemm instead", count=True),
    Variable("PREFIX_SERVICE_BF16_BRGEMM_COLUMNS", "kernels", "32",
             "brgemm's output columns per packed weight block (whole AMX tiles, at most four)",
             choices=("16", "32", "48", "64"), takes="16, 32, 48 or 64"),
    Variable("PREFIX_SERVICE_BF16_FEW_ROWS", "kernels", "all on an AMD Zen 4, else 1",
             "which calls of a bf16 linear run the AVX512-BF16 few-row kernel: those of up to 128 rows (1), "
             "none (0), or every call (all)", choices=("1", "0", "all"), takes="1, 0 or all"),
    Variable("PREFIX_SERVICE_BF16_TEMPLATE_ATTENTION", "kernels", "by the CPU (docs/architecture.md, cpu backend)",
             "how a bfloat16 model's rows attend over a pinned template's keys",
             choices=("native", "matrix", "measure"), aliases=(("brgemm", "matrix"),)),
    Variable("PREFIX_SERVICE_BF16_TEMPLATE_PRODUCTS", "kernels", "auto (AMX tiles, else dot products, else fallback)",
             "the most capable kernel the template attention's matrix products may use",
             choices=("auto", "dot", "fallback")),
    Variable("PREFIX_SERVICE_BF16_PROMPT_ATTENTION", "kernels", "by the CPU (docs/architecture.md, cpu backend)",
             "how a bfloat16 model's prompt of 128 tokens or more attends over its own keys",
             choices=("native", "dot", "measure")),
    # the cuda backend's extension (cuda_ops/build.py)
    Variable("PREFIX_SERVICE_CUDA_OPS_CACHE", "build", "~/.cache/prefix_service/cuda_ops",
             "where the CUDA extension is built and kept", takes="a folder"),
    Variable("PREFIX_SERVICE_DISABLE_CUDA_OPS", "cuda", "the kernels run where they build",
             "1 (anything but 0): never use the CUDA extension's kernels (the torch reference ops run)", takes="1"),
    # the server (the names are the config's defaults: server.admin_token_env, server.api_key_env)
    Variable("PREFIX_SERVICE_ADMIN_TOKEN", "server", "no token: the admin service must be on loopback",
             "the admin token the server checks and the CLI's template commands send (--token)",
             takes="a token", secret=True),
    Variable("PREFIX_SERVICE_API_KEY", "server", "no key: the HTTP API is open",
             "the HTTP API's key (Authorization: Bearer)", takes="a key", secret=True),
    # the command-line client
    Variable("PREFIX_SERVICE_ADDRESS", "client", "127.0.0.1:50051", "the server the CLI calls (--address)",
             takes="host:port"),
    Variable("PREFIX_SERVICE_TLS_CA", "client", "plain text, unless --tls",
             "a CA certificate the CLI trusts, connecting with TLS (--tls-ca)", takes="a PEM file"),
    # tools
    Variable("PREFIX_SERVICE_MODEL_CACHE", "tools", ".cache/models in a checkout, else ~/.cache/prefix_service/models",
             "where prepare-model writes the model directory", takes="a folder"),
    Variable("PREFIX_SERVICE_VLLM_PYTHON", "tools", ".venv-vllm/bin/python (make bench-peers)",
             "the interpreter of the environment vLLM is benchmarked in", takes="a file"),
    Variable("PREFIX_SERVICE_REQUIRE_REAL_MODEL", "tests", "such tests skip",
             "1: a test that needs the prepared SmolLM2 model fails where it is missing, instead of skipping",
             takes="1"),
)

BY_NAME: dict[str, Variable] = {v.name: v for v in VARIABLES}


def value(name: str) -> str | None:
    """The declared variable `name`'s value, stripped; None where it is unset or empty."""
    if name not in BY_NAME:
        raise KeyError(f"{name} is not a declared environment variable (prefix_service/envs.py)")
    raw = os.environ.get(name, "").strip()
    return raw or None


def _checked(var: Variable, raw: str, error: type[Exception]) -> str:
    chosen = dict(var.aliases).get(raw, raw)
    if var.count:
        try:
            ok = int(chosen) >= 0
        except ValueError:
            ok = False
    else:
        ok = not var.choices or chosen in var.choices
    if not ok:
        raise error(f"{var.name}={raw!r}: {var.what()}")
    return chosen


def choice(name: str, error: type[Exception] = ConfigError) -> str | None:
    """`name`'s value (an older name of a value as the value) where set, None where unset or empty;
    a value it does not take raises `error` naming the variable, the value and what it takes."""
    raw = value(name)
    return None if raw is None else _checked(BY_NAME[name], raw, error)


def count(name: str, default: int, error: type[Exception] = ConfigError) -> int:
    """`name`'s count where set, else `default`; anything but a whole number, 0 or more, raises `error`."""
    raw = value(name)
    return default if raw is None else int(_checked(BY_NAME[name], raw, error))


def check() -> None:
    """ConfigError for the first variable set to a value it does not take (a declared one with choices or
    a count); what a value asks of the machine is checked where it is used."""
    for var in VARIABLES:
        raw = value(var.name)
        if raw is not None:
            _checked(var, raw, ConfigError)


# what an engine computes with: a fleet's replicas run with the head's values (fleet/launcher.py)
ENGINE_SCOPES = ("kernels", "cuda")


def set_values(scopes: tuple[str, ...] = ("kernels",)) -> dict[str, str]:
    """The declared variables of `scopes` that are set, with their values (never a secret's)."""
    return {v.name: raw for v in VARIABLES
            if v.scope in scopes and not v.secret and (raw := value(v.name)) is not None}


def listed(values: dict[str, Any]) -> str:
    """Settings as the logs and reports write them: `NAME=value, NAME=value` ("" for none)."""
    return ", ".join(f"{k}={v}" for k, v in values.items())


def markdown_table() -> str:
    """The table docs/operations.md shows: one row a variable, in VARIABLES' order."""
    rows = ["| variable | read by | takes | unset | what it is for |", "| --- | --- | --- | --- | --- |"]
    for v in VARIABLES:
        takes = v.takes or (" or ".join(v.choices) if len(v.choices) == 2 else ", ".join(v.choices)) or \
            "a count, 0 or more"
        rows.append(f"| `{v.name}` | {v.scope} | {takes} | {v.default} | {v.meaning} |")
    return "\n".join(rows)
