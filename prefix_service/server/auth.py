"""Admin access: a bearer token from the environment, or loopback only.

With a token configured (the env var named by server.admin_token_env is set and not empty) each
PrefixAdmin call needs the metadata `authorization: Bearer <token>`: none -> UNAUTHENTICATED,
a wrong one -> PERMISSION_DENIED. Without a token the admin service must not be reachable from
other machines: the server refuses to start when server.address is not a loopback address
(127.0.0.0/8, ::1, localhost) unless server.enable_admin is false. The token is never logged.
"""
from __future__ import annotations

import hmac
import os
from typing import Iterable

from prefix_service.config import ServerConfig
from prefix_service.errors import ConfigError
from prefix_service.server.status import PermissionDenied, Unauthenticated

_SCHEME = "bearer "


def read_token(config: ServerConfig) -> str | None:
    token = os.environ.get(config.admin_token_env, "").strip()
    return token or None


def check_admin_exposure(config: ServerConfig, token: str | None) -> None:
    """Refuse an admin service open to the network without a token."""
    if config.enable_admin and token is None and not config.is_loopback:
        raise ConfigError(
            f"server.address {config.address} accepts connections from other machines, but no admin token is "
            f"set, so anyone could add or remove prefix templates. Set the environment variable "
            f"{config.admin_token_env} (server.admin_token_env) to a secret, bind server.address to "
            f"127.0.0.1, or set server.enable_admin: false")


class AdminAuth:
    def __init__(self, token: str | None) -> None:
        self._token = token.encode() if token else None

    @property
    def required(self) -> bool:
        return self._token is not None

    def check(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> None:
        """Raise Unauthenticated or PermissionDenied unless the metadata carries the token."""
        if self._token is None:
            return
        values = [v for k, v in (metadata or ()) if k.lower() == "authorization"]
        if not values:
            raise Unauthenticated("this admin call needs the metadata 'authorization: Bearer <token>' "
                                  "(the token the server reads from its admin token environment variable)")
        value = values[0] if isinstance(values[0], str) else values[0].decode("utf-8", "replace")
        if not value.lower().startswith(_SCHEME):
            raise Unauthenticated("the authorization metadata must read 'Bearer <token>'")
        given = value[len(_SCHEME):].strip().encode()
        if not hmac.compare_digest(given, self._token):
            raise PermissionDenied("the admin token is wrong")
