"""Scale-out: the service as a fleet of engine replicas on Ray Serve (docs/scale-out.md).

    placement.py   which replicas pin a template (rendezvous hashing; pure, no Ray)
    router.py      the Ray Serve request router: a template's requests go only to its holders
    replica.py     EngineReplica: one Engine per replica; pins what the controller assigns
    controller.py  FleetController: members, placement, admin fan-out, the fleet's state file
    client.py      FleetEngine / FleetRegistry: what the gRPC and HTTP front ends call
    launcher.py    FleetServer: PrefixServer with the engine replaced by the fleet; the HTTP ingress

Only placement.py imports without Ray (`pip install -e ".[ray]"`).
"""

import logging


def log_to_serve() -> None:
    """In a Ray Serve replica: write the service's log lines (the prefix_service loggers, INFO and
    up) where Ray Serve writes the replica's own, its file under the session's logs/serve/ folder."""
    ours, serve_logger = logging.getLogger("prefix_service"), logging.getLogger("ray.serve")
    if not serve_logger.handlers:
        return
    ours.setLevel(logging.INFO)
    for handler in serve_logger.handlers:
        if handler not in ours.handlers:
            ours.addHandler(handler)
    ours.propagate = False
