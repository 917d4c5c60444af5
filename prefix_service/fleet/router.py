"""TemplateRouter: the Ray Serve request router of the engine replicas.

A generation call says where it may go in a keyword argument, which the client (client.py) sets
from the controller's routes and the replica's generate accepts and ignores:

    holders=("<id>", ...)     only replicas among these, tried in this order (the front end puts
                              the one with the fewest of its calls in flight first)
    none                      any replica

Each eligible replica is a rank of its own: Ray Serve sends the call to the first whose queue is
not full (max_ongoing_requests; its probed and cached queue length), else the next. With no
eligible replica up (a holder restarting, or one Ray Serve has not told this process of yet) or
every one full, the router answers nothing and Ray Serve retries with backoff until one is, or
the caller gives up.

The backoff must be asked for: without it Ray Serve calls choose_replicas again at once, and
since choose_replicas never suspends, the retries never yield the router's event loop. That
loop is one per process, shared by every deployment handle in it (the controller's too) and the
one that applies Ray Serve's replica updates, so a single call waiting for a holder would stall
every call of the process, for good if the holder it waits for is one the update would add.
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
        if pending_request is None:
            return [[r] for r in candidate_replicas]
        pending_request.routing_context.should_backoff = True  # see the module docstring
        return [[r] for r in eligible(candidate_replicas, pending_request.kwargs, replica_id)]
