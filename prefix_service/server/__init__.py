"""The server: gRPC (package prefix_service.v1: Generation and PrefixAdmin, plus the standard
health and reflection services), the OpenAI-compatible HTTP API, and an optional Prometheus
endpoint.

    app.py         PrefixServer: start order, graceful stop, signals
    parts.py       what PrefixServer is built from: an engine provider and an HTTP front (one process's by default)
    interfaces.py  EngineClient, TemplateRegistryClient: what the server drives (one process or a fleet)
    runtime.py     what the servicers share: the engine client, the registry, ready, the worker pool
    requests.py    the request path both front ends share: RequestSpec -> engine request
    generation.py  Generate: convert, submit, stream, abort on cancel
    openai_api.py  /v1/models, /v1/completions, /v1/chat/completions, /health;  http.py  uvicorn
    admin.py       Add/Remove/ListPrefixTemplates behind auth.py
    templates.py   TemplateRegistry: templates on the engine + their origin + persistence
    store.py       the state file (atomic writes)
    warmup.py      pin every template before SERVING
    chat.py        chat messages through the model's chat template
    metrics.py     Prometheus series and the per-request log line;  tls.py  certificate and key
    wire.py        service registration; undecodable requests -> INVALID_ARGUMENT
    convert.py     proto <-> engine types;  status.py  exceptions -> gRPC codes, HTTP statuses

The names below load on first use, so that importing one module (e.g. the state file's store)
does not import the engine and torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["PrefixServer", "serve", "state_path"]

if TYPE_CHECKING:
    from prefix_service.server.app import PrefixServer, serve
    from prefix_service.server.store import state_path


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'prefix_service.server' has no attribute {name!r}")
    module = "prefix_service.server.store" if name == "state_path" else "prefix_service.server.app"
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
