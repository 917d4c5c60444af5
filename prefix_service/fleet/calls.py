"""Calls across the fleet: Ray's errors turned back into the service's own.

An exception raised in a replica or the controller reaches the caller wrapped (RayTaskError,
whose message carries the remote traceback): the caller gets the original exception back, so the
front ends map it to its status code as for a single process. A replica that died or is
unreachable becomes ReplicaUnavailable (gRPC UNAVAILABLE, HTTP 503).
"""
from __future__ import annotations

import asyncio
from typing import Any

from ray import exceptions as ray_errors
from ray.serve import exceptions as serve_errors

from prefix_service.server.status import ReplicaUnavailable


class TemplateNotHeld(ReplicaUnavailable):
    """A replica got a request on a template it does not hold (the placement moved it away after
    the caller read the routes): the caller sends it again with fresh routes."""

_GONE = (ray_errors.RayActorError, ray_errors.ActorUnavailableError, serve_errors.DeploymentUnavailableError,
         getattr(serve_errors, "ReplicaUnavailableError", ray_errors.RayActorError))


def unwrap(exc: BaseException, what: str = "a replica") -> BaseException:
    """The exception the caller should see for exc."""
    if isinstance(exc, ray_errors.RayTaskError) and isinstance(exc.cause, BaseException):
        return exc.cause
    if isinstance(exc, _GONE):
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return ReplicaUnavailable(f"{what} stopped before answering ({reason}); retry the call")
    return exc


async def call(response: Any, timeout_s: float, what: str) -> Any:
    """Await a DeploymentResponse; ReplicaUnavailable if it takes over timeout_s (the target is
    down and not coming back under that id), the remote exception if it raised."""
    try:
        return await asyncio.wait_for(response, timeout_s)
    except asyncio.TimeoutError:
        response.cancel()
        raise ReplicaUnavailable(f"{what} did not answer within {timeout_s:.0f} s") from None
    except Exception as e:  # noqa: BLE001 - re-raised as the service's own error
        raise unwrap(e, what) from None


def call_sync(response: Any, timeout_s: float, what: str) -> Any:
    """call() for a thread that is not an event loop (a front end's worker thread)."""
    try:
        return response.result(timeout_s=timeout_s)
    except TimeoutError:
        response.cancel()
        raise ReplicaUnavailable(f"{what} did not answer within {timeout_s:.0f} s") from None
    except Exception as e:  # noqa: BLE001
        raise unwrap(e, what) from None

