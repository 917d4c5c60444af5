"""The gRPC server (package prefix_service.v1): Generation and PrefixAdmin, plus the standard
health and reflection services.

    app.py         PrefixServer: start order, graceful stop, signals
    generation.py  Generate: convert, submit, stream, abort on cancel
    admin.py       Add/Remove/ListPrefixTemplates behind auth.py
    templates.py   TemplateRegistry: templates on the engine + their origin + persistence
    store.py       the state file (atomic writes)
    warmup.py      pin every template before SERVING
    chat.py        chat messages through the model's chat template
    convert.py     proto <-> engine types;  status.py  exceptions -> status codes
"""
from prefix_service.server.app import PrefixServer, serve, state_path

__all__ = ["PrefixServer", "serve", "state_path"]
