"""YAML service config -> frozen, validated dataclasses (one per concern).

Every key is checked: an unknown key, a wrong type or an out-of-range value raises ConfigError
naming the key, the value and what is allowed. Relative paths resolve against the config file's
folder.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from prefix_service.errors import ConfigError, InvalidRequest
from prefix_service.sampling_params import StructuredOutput

DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = DTYPES  # cache.kv_cache_dtype; auto: the model's dtype
DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("auto", "torch", "cpu", "cuda")
QUANTIZATIONS = ("none", "int8")  # model.quantization (model/quantize.py)
LOAD_FORMATS = ("auto", "dummy")
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")  # used with fullmatch
_ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_ADDRESS_RE = re.compile(r"(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[A-Za-z0-9_.\-]+)):(?P<port>\d{1,5})")  # fullmatch
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1000, "KB": 1000, "KIB": 1024, "M": 1000**2, "MB": 1000**2,
          "MIB": 1024**2, "G": 1000**3, "GB": 1000**3, "GIB": 1024**3, "T": 1000**4,
          "TB": 1000**4, "TIB": 1024**4}


def parse_size_or_auto(value: Any, key: str) -> int | str:
    """parse_size, or "auto" as it is (cache.kv_cache_memory)."""
    return "auto" if value == "auto" else parse_size(value, key)


def parse_size(value: Any, key: str) -> int:
    """'2GiB', '512MB', 1048576 -> bytes."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a size like '2GiB' or a byte count, got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ConfigError(f"{key}: size must be positive, got {value}")
        return value
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m:
            unit = (m.group(2) or "").upper()
            if unit in _UNITS:
                n = int(float(m.group(1)) * _UNITS[unit])
                if n > 0:
                    return n
    raise ConfigError(f"{key}: expected a size like '2GiB', '512MiB' or a byte count, got {value!r}")


def validate_template_name(name: Any) -> str:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ConfigError(
            f"invalid prefix name {name!r}: use 1-128 characters from letters, digits, '_', '-', '.',"
            " starting with a letter or digit")
    return name


@dataclass(frozen=True)
class ModelConfig:
    path: str
    dtype: str = "auto"  # auto: the checkpoint's dtype on GPU; on CPU bfloat16 with AMX/AVX512-BF16, else float32
    device: str = "auto"  # auto: cuda when available, else cpu
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    # where and how the forward runs (prefix_service/backends/): auto is cuda on a GPU, cpu where the
    # native CPU kernels build and serve the model, torch otherwise
    backend: str = "auto"
    seed: int = 0  # seeds the generator of requests that give no seed
    load_format: str = "auto"  # auto: *.safetensors; dummy: random weights from config.json (benchmarks)
    num_threads: int | None = None  # torch intra-op threads of the engine's thread; None: torch's default
    # how far the engine's compute threads (its loop thread, the OpenMP workers it starts, the servers' executor)
    # sit below the process's nice value, so that the front ends' threads preempt them (engine/threads.py);
    # None: 10 on a CPU, 0 on a GPU
    thread_nice: int | None = None
    served_name: str | None = None  # the model's id in the HTTP API; None: the name of model.path's directory
    # cuda backend: decode steps of up to this many rows replay CUDA graphs captured at start
    # (backends/cuda/graphs.py; at most scheduler.max_num_seqs); 0: every step runs eagerly
    cuda_graph_max_batch: int = 256
    # cuda backend: each layer's norms, rotary embedding and SiLU as fused Triton kernels
    # (backends/cuda/layers.py); false: the model's reference layers
    cuda_fused_layers: bool = True
    # int8: each decoder layer's linear weights as int8 with a scale per output row (model/quantize.py),
    # which the cpu backend's kernels read (float32: every call; bf16: a decode step's); none: the checkpoint's
    quantization: str = "none"
    # true: no row's output depends on the other rows of its step, so a request's tokens and logprobs are
    # the same whatever runs beside it (one kernel per layer for every call size; the cpu backend only:
    # float32 anywhere, bfloat16 with AMX or AVX512-BF16); false: each call's kernel chosen for speed
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        _check_choice("model.load_format", self.load_format, LOAD_FORMATS)
        if self.num_threads is not None:
            _check_int("model.num_threads", self.num_threads, 1)
        if self.thread_nice is not None:
            _check_int("model.thread_nice", self.thread_nice, 0, 19)
        _check_choice("model.dtype", self.dtype, DTYPES)
        _check_choice("model.device", self.device, DEVICES)
        _check_choice("model.backend", self.backend, BACKENDS)
        _check_choice("model.quantization", self.quantization, QUANTIZATIONS)
        if not isinstance(self.path, str) or not self.path:
            raise ConfigError(f"model.path: expected a Hugging Face model directory, got {self.path!r}")
        if self.max_model_len is not None:
            _check_int("model.max_model_len", self.max_model_len, 1)
        _check_int("model.seed", self.seed, 0)
        _check_int("model.cuda_graph_max_batch", self.cuda_graph_max_batch, 0)
        if not isinstance(self.cuda_fused_layers, bool):
            raise ConfigError(f"model.cuda_fused_layers: expected true or false, got {self.cuda_fused_layers!r}")
        if not isinstance(self.batch_invariant, bool):
            raise ConfigError(f"model.batch_invariant: expected true or false, got {self.batch_invariant!r}")
        if self.served_name is not None and (not isinstance(self.served_name, str) or not self.served_name.strip()
                                             or not self.served_name.isprintable()):
            raise ConfigError(f"model.served_name: expected a model id like SmolLM2-135M-Instruct, "
                              f"got {self.served_name!r}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # bytes for K and V of all layers; "auto": on a GPU, what gpu_memory_utilization of its memory
    # leaves after the weights and a profiled forward (backends/kv_cache.py), on a CPU 1 GiB
    kv_cache_memory: int | str = "auto"
    gpu_memory_utilization: float = 0.9  # the share of the GPU's memory the engine may use, with kv_cache_memory auto
    # what the KV cache holds; auto: the model's dtype. bfloat16 under a float32 model halves the cache's
    # bytes (twice the blocks in kv_cache_memory, half the reads of a decode's attention); where a backend
    # cannot hold other than the model's dtype, the engine refuses it at start
    kv_cache_dtype: str = "auto"
    num_blocks: int | None = None  # overrides kv_cache_memory when set
    prefix_budget_blocks: int | None = None  # max blocks pinned by templates; default: half the cache
    enable_prefix: bool = True  # False: requests on a template prefill it like any prompt
    pack_prefix_kv: bool = True  # cpu backend: templates' K/V also held packed for its attention
    # pinned templates' K/V are saved here and loaded at the next pin instead of a prefill; None: the
    # server's default (a folder next to its state file; an Engine alone: off); "": off
    snapshot_dir: str | None = None

    def __post_init__(self) -> None:
        _check_int("cache.block_size", self.block_size, 1, 4096)
        _check_choice("cache.kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        if self.kv_cache_memory != "auto":
            _check_int("cache.kv_cache_memory", self.kv_cache_memory, 1)
        if (isinstance(self.gpu_memory_utilization, bool) or not isinstance(self.gpu_memory_utilization, (int, float))
                or not 0 < self.gpu_memory_utilization <= 1):
            raise ConfigError(f"cache.gpu_memory_utilization: expected a fraction in (0, 1], got "
                              f"{self.gpu_memory_utilization!r}")
        if self.num_blocks is not None:
            _check_int("cache.num_blocks", self.num_blocks, 2)  # the engine keeps one block unused
        if self.prefix_budget_blocks is not None:
            _check_int("cache.prefix_budget_blocks", self.prefix_budget_blocks, 0)
        if self.snapshot_dir is not None and not isinstance(self.snapshot_dir, str):
            raise ConfigError(f"cache.snapshot_dir: expected a folder (or \"\" for no snapshots), got "
                              f"{self.snapshot_dir!r}")
        for key in ("enable_prefix", "pack_prefix_kv"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"cache.{key}: expected true or false, got {getattr(self, key)!r}")


MAX_SPECULATIVE_TOKENS = 15  # draft tokens a sequence may have checked in one step


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # running sequences at once
    max_num_batched_tokens: int = 2048  # tokens per step (decodes + prefill chunks)
    max_queue: int = 1024  # waiting requests before new ones are refused
    default_max_tokens: int = 256  # when a request gives max_tokens 0 / None
    max_tokens_cap: int = 4096  # largest max_tokens a request may ask for
    max_prompt_tokens: int | None = None  # most tokens a request may add after its template; None: no cap
    # structured outputs' bounds, in llguidance's lexer fuel: a constraint whose compile needs more
    # is refused (about 50k a millisecond); a sequence whose mask needs more in one step ends with
    # an error (about 14k a millisecond), so no constraint can stall the batch
    grammar_compile_fuel: int = 1_000_000
    grammar_step_fuel: int = 200_000
    # a structured output's forced tokens (the one token its mask allows, position after position)
    # are appended at once, without a step each; the same tokens as without (README, "scheduler")
    jump_forward: bool = True
    # speculative decoding by prompt lookup (engine/speculation.py): a decoding sequence drafts up to
    # this many tokens, those that followed an earlier occurrence of its last n tokens (n from
    # speculative_max_ngram down to speculative_min_ngram), and one step checks them all; the same
    # tokens as without (README, "scheduler"). 0: off
    speculative_tokens: int = 0
    speculative_max_ngram: int = 4
    speculative_min_ngram: int = 2
    speculative_max_running: int = 8  # drafts only while at most this many sequences run
    speculative_step_tokens: int = 32  # the most draft tokens a step checks, shared evenly by the running sequences
    # a decode row's cost over a decode step's fixed cost, which decides how many draft tokens are
    # worth their rows (speculation.Drafter.worth); None: fitted to the engine's own decode steps
    speculative_row_cost: float | None = None

    def __post_init__(self) -> None:
        _check_int("scheduler.max_num_seqs", self.max_num_seqs, 1)
        _check_int("scheduler.max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("scheduler.max_queue", self.max_queue, 1)
        _check_int("scheduler.default_max_tokens", self.default_max_tokens, 1)
        _check_int("scheduler.max_tokens_cap", self.max_tokens_cap, 1)
        if self.max_prompt_tokens is not None:
            _check_int("scheduler.max_prompt_tokens", self.max_prompt_tokens, 1)
        _check_int("scheduler.grammar_compile_fuel", self.grammar_compile_fuel, 1)
        _check_int("scheduler.grammar_step_fuel", self.grammar_step_fuel, 1)
        if not isinstance(self.jump_forward, bool):
            raise ConfigError(f"scheduler.jump_forward: expected true or false, got {self.jump_forward!r}")
        _check_int("scheduler.speculative_tokens", self.speculative_tokens, 0, MAX_SPECULATIVE_TOKENS)
        _check_int("scheduler.speculative_min_ngram", self.speculative_min_ngram, 1)
        _check_int("scheduler.speculative_max_ngram", self.speculative_max_ngram, self.speculative_min_ngram)
        _check_int("scheduler.speculative_max_running", self.speculative_max_running, 1)
        _check_int("scheduler.speculative_step_tokens", self.speculative_step_tokens, 1)
        if self.speculative_row_cost is not None and (
                isinstance(self.speculative_row_cost, bool) or not isinstance(self.speculative_row_cost, (int, float))
                or not 0 <= self.speculative_row_cost <= 1):
            raise ConfigError(f"scheduler.speculative_row_cost: expected a number from 0 to 1 (a decode row's cost "
                              f"over a step's fixed cost), or null to measure it, got {self.speculative_row_cost!r}")


@dataclass(frozen=True)
class ServerConfig:
    """The gRPC server and the OpenAI-compatible HTTP API (prefix_service/server/)."""
    address: str = "127.0.0.1:50051"  # host:port to listen on; port 0 picks a free one
    http_address: str | None = "127.0.0.1:8000"  # the OpenAI-compatible HTTP API; "" or null: off
    api_key_env: str = "PREFIX_SERVICE_API_KEY"  # env var holding the HTTP API's key; unset or empty: no key
    admin_token_env: str = "PREFIX_SERVICE_ADMIN_TOKEN"  # env var holding the admin token
    state_file: str | None = None  # run-time templates persist here; default <config stem>.state.json
    grace_period_s: float = 10.0  # on SIGTERM/SIGINT: time in-flight requests get to finish
    enable_admin: bool = True  # serve the PrefixAdmin service
    enable_reflection: bool = True  # serve gRPC server reflection (for grpcurl and friends)
    admin_address: str | None = None  # serve PrefixAdmin here instead of on `address`
    metrics_address: str | None = None  # host:port of the Prometheus endpoint (/metrics); unset: off
    tls_cert_file: str | None = None  # PEM certificate chain: TLS on every address (with tls_key_file)
    tls_key_file: str | None = None  # PEM private key of tls_cert_file
    max_template_bytes: int = 1 << 20  # largest template text (UTF-8 bytes), from the config or the admin API

    def __post_init__(self) -> None:
        split_address(self.address)
        if self.http_address == "":
            object.__setattr__(self, "http_address", None)
        taken = {"address": self.address}  # each listening address, by key: none may repeat another
        for key in ("admin_address", "metrics_address", "http_address"):
            value = getattr(self, key)
            if value is not None:
                split_address(value, f"server.{key}")
                same = next((k for k, v in taken.items() if v == value), None)
                if same is not None and split_address(value)[1] != 0:
                    raise ConfigError(f"server.{key}: {value!r} is server.{same} itself; give another port "
                                      f"(or leave it unset)")
                taken[key] = value
        for key in ("tls_cert_file", "tls_key_file"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(f"server.{key}: expected a PEM file path, got {value!r}")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ConfigError("server.tls_cert_file and server.tls_key_file go together: give both (TLS on every "
                              "address) or neither (plaintext)")
        _check_int("server.max_template_bytes", self.max_template_bytes, 1)
        for key, example in (("admin_token_env", "PREFIX_SERVICE_ADMIN_TOKEN"), ("api_key_env", "PREFIX_SERVICE_API_KEY")):
            value = getattr(self, key)
            if not isinstance(value, str) or not _ENV_RE.match(value):
                raise ConfigError(f"server.{key}: expected an environment variable name like {example}, "
                                  f"got {value!r}")
        if self.state_file is not None and (not isinstance(self.state_file, str) or not self.state_file):
            raise ConfigError(f"server.state_file: expected a file path, got {self.state_file!r}")
        if isinstance(self.grace_period_s, bool) or not isinstance(self.grace_period_s, (int, float)) \
                or not 0 <= self.grace_period_s <= 3600:
            raise ConfigError(f"server.grace_period_s: expected seconds in [0, 3600], got {self.grace_period_s!r}")
        for key in ("enable_admin", "enable_reflection"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"server.{key}: expected true or false, got {getattr(self, key)!r}")

    @property
    def host(self) -> str:
        return split_address(self.address)[0]

    @property
    def port(self) -> int:
        return split_address(self.address)[1]

    @property
    def is_loopback(self) -> bool:
        """True if the address only accepts connections from this machine."""
        return is_loopback_host(self.host)

    @property
    def admin_bind_address(self) -> str:
        """Where PrefixAdmin is served: admin_address, else the main address."""
        return self.admin_address or self.address

    @property
    def admin_is_loopback(self) -> bool:
        return is_loopback_host(split_address(self.admin_bind_address)[0])

    @property
    def tls(self) -> bool:
        return self.tls_cert_file is not None


def is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def split_address(address: Any, key: str = "server.address") -> tuple[str, int]:
    """'127.0.0.1:50051' -> ('127.0.0.1', 50051); '[::1]:0' -> ('::1', 0)."""
    m = _ADDRESS_RE.fullmatch(address) if isinstance(address, str) else None
    if m is None or not 0 <= int(m.group("port")) <= 65535:
        raise ConfigError(f"{key}: expected host:port (e.g. 127.0.0.1:50051, 0.0.0.0:50051, "
                          f"[::1]:50051; port 0 picks a free one), got {address!r}")
    return m.group("v6") or m.group("host"), int(m.group("port"))


@dataclass(frozen=True)
class TemplateSpec:
    """A template from YAML: exactly one of content, file or system_prompt; structured_output:
    the default output of the requests on it that name none (StructuredOutput.from_dict's form,
    e.g. {choice: [billing, refund]})."""
    name: str
    content: str | None = None
    file: str | None = None
    system_prompt: str | None = None
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        validate_template_name(self.name)
        given = [k for k in ("content", "file", "system_prompt") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ConfigError(
                f"prefixes[{self.name}]: give exactly one of content, file or system_prompt (got {given or 'none'})")

    def read_text(self) -> str:
        if self.file is not None:
            try:
                return Path(self.file).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:  # a file that is not UTF-8 text too
                raise ConfigError(f"prefixes[{self.name}].file: cannot read {self.file}: {e}") from e
        return self.content if self.content is not None else self.system_prompt  # type: ignore[return-value]


@dataclass(frozen=True)
class RayConfig:
    """Scale-out on a Ray cluster (prefix_service/fleet/, docs/scale-out.md): engine replicas behind
    a template-aware router. The section's presence (or `serve --ray`) turns it on."""
    address: str | None = None  # the cluster to join ("auto", "ray://host:10001"); null: start a local one
    num_replicas: int = 2  # engine replicas (ignored when min_replicas/max_replicas ask for autoscaling)
    min_replicas: int | None = None  # autoscaling bounds: give both to let Ray Serve scale the replicas
    max_replicas: int | None = None
    target_ongoing_requests: int = 16  # autoscaling: requests in flight per replica Ray Serve aims at
    upscale_delay_s: float = 30.0  # autoscaling: how long the load must ask for more replicas before one starts
    downscale_delay_s: float = 600.0  # autoscaling: how long it must ask for fewer before one stops
    look_back_period_s: float = 30.0  # autoscaling: the window the load is averaged over (> 10 s)
    template_replication: int | None = None  # replicas that pin each template; null: every replica
    # a replica pinning a template it has no snapshot of gets its K/V from a replica holding it
    # (through Ray's object store) instead of prefilling it
    template_kv_from_peers: bool = True
    num_cpus_per_replica: float = 1.0  # the Ray CPU resource each replica reserves
    max_ongoing_requests: int = 256  # requests one replica accepts at once (the rest wait at the router)
    app_name: str = "prefix-service"  # the Ray Serve application

    def __post_init__(self) -> None:
        if self.address is not None and (not isinstance(self.address, str) or not self.address):
            raise ConfigError(f"ray.address: expected a Ray address like 'auto' or 'ray://head:10001', got "
                              f"{self.address!r}")
        _check_int("ray.num_replicas", self.num_replicas, 1)
        _check_int("ray.target_ongoing_requests", self.target_ongoing_requests, 1)
        _check_int("ray.max_ongoing_requests", self.max_ongoing_requests, 1)
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise ConfigError("ray.min_replicas and ray.max_replicas go together: give both (autoscaling) or "
                              "neither (ray.num_replicas fixed replicas)")
        if self.min_replicas is not None:
            _check_int("ray.min_replicas", self.min_replicas, 1)
            _check_int("ray.max_replicas", self.max_replicas, self.min_replicas)
        if self.template_replication is not None:
            _check_int("ray.template_replication", self.template_replication, 1)
        if not isinstance(self.template_kv_from_peers, bool):
            raise ConfigError(f"ray.template_kv_from_peers: expected true or false, got {self.template_kv_from_peers!r}")
        # Ray Serve wants the look-back window longer than its autoscaling metrics' interval, 10 s
        for key, bound in (("upscale_delay_s", ">= 0"), ("downscale_delay_s", ">= 0"), ("look_back_period_s", "> 10")):
            value = getattr(self, key)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not number or (value <= 10 if bound == "> 10" else value < 0):
                raise ConfigError(f"ray.{key}: expected a number of seconds {bound}, got {value!r}")
        if isinstance(self.num_cpus_per_replica, bool) or not isinstance(self.num_cpus_per_replica, (int, float)) \
                or self.num_cpus_per_replica < 0:
            raise ConfigError(f"ray.num_cpus_per_replica: expected a number >= 0, got {self.num_cpus_per_replica!r}")
        if not isinstance(self.app_name, str) or not _NAME_RE.fullmatch(self.app_name):
            raise ConfigError(f"ray.app_name: expected a name of letters, digits, '_', '.', '-', got "
                              f"{self.app_name!r}")

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None


@dataclass(frozen=True)
class EngineConfig:
    """What the engine needs: model, cache, scheduler."""
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)


@dataclass(frozen=True)
class ServiceConfig:
    engine: EngineConfig
    server: ServerConfig = field(default_factory=ServerConfig)
    prefixes: tuple[TemplateSpec, ...] = ()
    source: str | None = None  # the YAML file this came from
    ray: RayConfig | None = None  # set: serve as a fleet of replicas on Ray (prefix_service/fleet/)

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for p in self.prefixes:
            if p.name in seen:
                raise ConfigError(f"prefixes: the name {p.name!r} appears twice")
            seen.add(p.name)


def _check_choice(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(allowed)}")


def _check_int(key: str, value: Any, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ConfigError(f"{key}: expected an integer {bound}, got {value!r}")


def _build(cls: type, section: str, raw: Any, converters: Mapping[str, Any] | None = None) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{section}: expected a mapping, got {type(raw).__name__}")
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ConfigError(f"{section}: unknown key(s) {', '.join(map(str, unknown))}; known keys: {', '.join(known)}")
    kwargs = dict(raw)
    for key, conv in (converters or {}).items():
        if key in kwargs and kwargs[key] is not None:
            kwargs[key] = conv(kwargs[key], f"{section}.{key}")
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in kwargs
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{section}.{missing[0]}: required, and missing")
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{section}: {e}") from e


def config_from_dict(raw: Mapping[str, Any], base_dir: str | os.PathLike | None = None) -> ServiceConfig:
    """Validate a parsed YAML mapping. Relative paths resolve against base_dir."""
    if not isinstance(raw, Mapping):
        raise ConfigError("config: expected a mapping at the top level")
    top = ("model", "cache", "scheduler", "server", "prefixes", "ray")
    unknown = sorted(set(raw) - set(top))
    if unknown:
        raise ConfigError(f"config: unknown key(s) {', '.join(map(str, unknown))}; known keys: {', '.join(top)}")
    base = Path(base_dir) if base_dir is not None else Path.cwd()

    def resolve(value: Any, key: str) -> Any:
        if isinstance(value, str) and value and not os.path.isabs(os.path.expanduser(value)):
            return str((base / value).resolve())
        return os.path.expanduser(value) if isinstance(value, str) else value

    if "model" not in raw:
        raise ConfigError("config: the 'model' section (with model.path) is required")
    model = _build(ModelConfig, "model", raw.get("model"), {"path": resolve})
    cache = _build(CacheConfig, "cache", raw.get("cache"), {"kv_cache_memory": parse_size_or_auto, "snapshot_dir": resolve})
    scheduler = _build(SchedulerConfig, "scheduler", raw.get("scheduler"))
    server = _build(ServerConfig, "server", raw.get("server"),
                    {"state_file": resolve, "tls_cert_file": resolve, "tls_key_file": resolve,
                     "max_template_bytes": parse_size})
    prefixes_raw = raw.get("prefixes") or []
    if not isinstance(prefixes_raw, list):
        raise ConfigError("prefixes: expected a list of {name, content | file | system_prompt}")

    def inside_base(value: Any, key: str) -> Any:
        """A template file resolves against the config's folder and must stay inside it (symlinks
        followed), so a config cannot be pointed at arbitrary files of the machine."""
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{key}: expected a file path relative to the config file, got {value!r}")
        path = Path(resolve(value, key)).resolve()
        folder = base.resolve()
        if not path.is_relative_to(folder):
            raise ConfigError(f"{key}: {value!r} resolves to {path}, outside the config file's folder {folder}; "
                              f"template files must be in that folder or below it")
        return str(path)

    prefixes = []
    for i, p in enumerate(prefixes_raw):
        name = p.get("name") if isinstance(p, Mapping) else None
        prefixes.append(_build(TemplateSpec, f"prefixes[{name or i}]", p, {"file": inside_base,
                                                                           "structured_output": _structured_output}))
    ray = _build(RayConfig, "ray", raw["ray"]) if "ray" in raw else None
    return ServiceConfig(EngineConfig(model, cache, scheduler), server, tuple(prefixes), ray=ray)


def _structured_output(value: Any, key: str) -> StructuredOutput:
    try:
        return StructuredOutput.from_dict(value, param=key)
    except InvalidRequest as e:
        raise ConfigError(str(e)) from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load's loader, refusing a mapping that gives a key twice (PyYAML keeps the last
    value silently: a second `server:` section would drop the first one's settings)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)  # type: ignore[no-untyped-call]
            line = key_node.start_mark.line + 1
            if isinstance(key, (str, int, float, bool)) and key in seen and key != "<<":
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} is given twice (lines {seen[key]} and {line}); give it once",
                    key_node.start_mark)
            if isinstance(key, (str, int, float, bool)):
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_config(path: str | os.PathLike) -> ServiceConfig:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:  # a file that is not UTF-8 text too
        raise ConfigError(f"cannot read config file {path}: {e}") from e
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from e
    cfg = config_from_dict(raw or {}, base_dir=path.resolve().parent)
    return dataclasses.replace(cfg, source=str(path.resolve()))
