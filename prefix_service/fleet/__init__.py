"""Scale-out: the service as a fleet of engine replicas on Ray Serve (docs/scale-out.md).

    placement.py   which replicas pin a template (rendezvous hashing; pure, no Ray)
    router.py      the Ray Serve request router: a template's requests go only to its holders
    replica.py     EngineReplica: one Engine per replica; pins what the controller assigns
    controller.py  FleetController: members, placement, admin fan-out, the fleet's state file
    client.py      FleetEngine / FleetRegistry: what the gRPC and HTTP front ends call
    launcher.py    fleet_server: PrefixServer with the fleet's parts (engine provider, HTTP front); the HTTP ingress

Only placement.py imports without Ray (`pip install -e ".[ray]"`).
"""

import logging
import os
import sys

# Ray Serve's throughput mode (docs/scale-out.md), with these changes: the handles' router runs on
# a loop of its own (the admin calls and the chat path wait on calls from worker threads, which a
# router on the caller's loop refuses); no direct ingress (with it a replica's stop waits out a
# drain and holds its port); log lines go to stderr (a local cluster's replicas log to the
# server's output) and to the replicas' files as they come, not held back in a buffer.
SERVE_ENV = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "1",
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0",
    "RAY_SERVE_LOG_TO_STDERR": "1",
    "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1",
}


def use_serve_env() -> dict[str, str]:
    """Set Ray Serve's settings for a fleet (SERVE_ENV) in this process's environment where the
    operator has not set them, and return the operator's values that differ from ours. Ray Serve
    reads them once, when it is imported, so this runs before `ray.serve` is (a RuntimeError
    otherwise, unless every one is set already); a local Ray cluster started after it inherits them."""
    unset = [k for k in SERVE_ENV if k not in os.environ]
    if unset and "ray.serve" in sys.modules:
        raise RuntimeError(f"Ray Serve was imported before the fleet's settings were set ({', '.join(unset)}): "
                           "call prefix_service.fleet.use_serve_env() before importing ray.serve")
    for key in unset:
        os.environ[key] = SERVE_ENV[key]
    return {k: os.environ[k] for k, v in SERVE_ENV.items() if os.environ[k] != v}


class AnsweredNotFailed(logging.Filter):
    """Ray Serve logs every exception a call raises as "Request failed." with its traceback, at
    ERROR. The service's answers to a caller (its error table, server/status.py: an unknown or
    existing template, an invalid request, a full queue or KV budget, a template not held here, a
    server stopping) are no failure of the replica: this makes them one INFO line without the
    traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.exc_info:
            return True
        from prefix_service.server.status import is_answer
        exc = record.exc_info[1]
        if exc is None:
            return True
        if is_answer(exc):
            record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
            record.msg, record.args = "request answered with %s: %s", (type(exc).__name__, exc)
            record.exc_info = record.exc_text = None
        return True


def log_to_serve() -> None:
    """In a Ray Serve replica: write the service's log lines (the prefix_service loggers, INFO and
    up) where Ray Serve writes the replica's own, its file under the session's logs/serve/ folder;
    the service's answers to callers are not logged as failed requests (AnsweredNotFailed)."""
    ours, serve_logger = logging.getLogger("prefix_service"), logging.getLogger("ray.serve")
    if not any(isinstance(f, AnsweredNotFailed) for f in serve_logger.filters):
        serve_logger.addFilter(AnsweredNotFailed())
    if not serve_logger.handlers:
        return
    ours.setLevel(logging.INFO)
    for handler in serve_logger.handlers:
        if handler not in ours.handlers:
            ours.addHandler(handler)
    ours.propagate = False
