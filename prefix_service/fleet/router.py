"""TemplateRouter: the Ray Serve request router of the engine replicas.

A generation call says where it may go in a keyword argument, which the client (client.py) sets
from the controller's routes and the replica's generate accepts and ignores:

    holders=("<id>", ...)     only replicas among these (a request on a template: its holders)
    none                      any replica

Among the eligible replicas Ray Serve's own selection picks the least loaded (the replica's queue
length, probed and cached by the router). With no eligible replica up (a holder restarting) the
router answers nothing and Ray Serve retries with backoff until one is, or the caller gives up.
"""
from __future__ import annotations

from typing import Any, Callable, List, Mapping, Optional, Sequence, TypeVar

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

R = TypeVar("R")


def replica_id(replica: RunningReplica) -> str:
    return replica.replica_id.unique_id


def eligible(candidates: Sequence[R], kwargs: Mapping[str, Any], id_of: Callable[[R], str]) -> list[R]:
    """The candidates a call with these keyword arguments may run on (see the module docstring)."""
    holders = kwargs.get("holders")
    if holders is not None:
        wanted = set(holders)
        return [r for r in candidates if id_of(r) in wanted]
    return list(candidates)


class TemplateRouter(RequestRouter):
    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        kwargs = pending_request.kwargs if pending_request is not None else {}
        chosen = eligible(candidate_replicas, kwargs, replica_id)
        return [chosen] if chosen else []
