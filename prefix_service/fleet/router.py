"""TemplateRouter: the Ray Serve request router of the engine replicas.

A generation call says where it may go in a keyword argument, which the client (client.py) sets
from the controller's routes and the replica's generate accepts and ignores:

    holders=("<id>", ...)     only replicas among these, tried in this order (the front end puts
                              the one with the fewest of its calls in flight first)
    none                      any replica

Each eligible replica is a rank of its own: Ray Serve sends the call to the first whose queue is
not full (max_ongoing_requests; its probed and cached queue length), else the next. With no
eligible replica up (a holder restarting) the router answers nothing and Ray Serve retries with
backoff until one is, or the caller gives up.
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
    if holders is None:
        return list(candidates)
    by_id = {id_of(r): r for r in candidates}
    return [by_id[h] for h in holders if h in by_id]


class TemplateRouter(RequestRouter):
    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        kwargs = pending_request.kwargs if pending_request is not None else {}
        return [[r] for r in eligible(candidate_replicas, kwargs, replica_id)]
