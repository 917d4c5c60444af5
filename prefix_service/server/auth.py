"""Bearer tokens from the environment: the admin token (gRPC PrefixAdmin) and the API key (the
HTTP API's generation and model routes), both optional.

Admin access: a bearer token from the environment, or loopback only.

With a token configured (the env var named by server.admin_token_env is set and not empty) each
PrefixAdmin call needs the metadata `authorization: Bearer <token>`: none -> UNAUTHENTICATED,
a wrong one -> PERMISSION_DENIED; the comparison takes the same time wherever the first wrong
byte is (hmac.compare_digest). Without a token the admin service must not be reachable from
other machines: the server refuses to start when the admin address (server.admin_address, else
server.address) is not a loopback address (127.0.0.0/8, ::1, localhost) unless
server.enable_admin is false. The token is never logged, nor echoed in an error message.

The API key (the env var named by server.api_key_env) guards the HTTP API the same way: header
`Authorization: Bearer <key>`, missing or wrong -> 401. Without one the HTTP API is open.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
from typing import Iterable

from prefix_service.config import ServerConfig
from prefix_service.errors import ConfigError
from prefix_service.server.status import PermissionDenied, Unauthenticated

log = logging.getLogger("prefix_service.server")

_SCHEME = "bearer "


def _read_secret(env_var: str) -> str | None:
    value = os.environ.get(env_var, "").strip()
    return value or None


def read_token(config: ServerConfig) -> str | None:
    return _read_secret(config.admin_token_env)


def read_api_key(config: ServerConfig) -> str | None:
    return _read_secret(config.api_key_env)


def check_admin_exposure(config: ServerConfig, token: str | None) -> None:
    """Refuse an admin service open to the network without a token."""
    if config.enable_admin and token is None and not config.admin_is_loopback:
        where = "server.admin_address" if config.admin_address else "server.address"
        raise ConfigError(
            f"{where} {config.admin_bind_address} accepts connections from other machines, but no admin token "
            f"is set, so anyone could add or remove prefix templates. Set the environment variable "
            f"{config.admin_token_env} (server.admin_token_env) to a secret, bind {where} to 127.0.0.1 "
            f"(server.admin_address can keep the admin service on loopback while server.address is public), "
            f"or set server.enable_admin: false")


def warn_cleartext_token(config: ServerConfig, token: str | None) -> None:
    """A token sent without TLS to another machine can be read on the way."""
    if config.enable_admin and token is not None and not config.tls and not config.admin_is_loopback:
        log.warning("the admin service on %s takes a bearer token over plaintext gRPC; anyone on the network path "
                    "can read it: set server.tls_cert_file and server.tls_key_file, or serve admin on loopback "
                    "(server.admin_address)", config.admin_bind_address)


class BearerAuth:
    """Checks `authorization: Bearer <token>` among a call's metadata or headers (names in any case)."""

    def __init__(self, token: str | None, *, carrier: str, missing: str, wrong: str) -> None:
        self._token = token.encode() if token else None
        self._digest = hashlib.sha256(self._token).digest() if self._token else b""
        self._carrier, self._missing, self._wrong = carrier, missing, wrong

    def check(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> None:
        """Raise Unauthenticated or PermissionDenied unless the metadata carries the token."""
        if self._token is None:
            return
        values = [v for k, v in (metadata or ()) if k.lower() == "authorization"]
        if not values:
            raise Unauthenticated(self._missing)
        value = values[0] if isinstance(values[0], str) else values[0].decode("utf-8", "replace")
        if not value.lower().startswith(_SCHEME):
            raise Unauthenticated(f"the authorization {self._carrier} must read 'Bearer <token>'")
        given = value[len(_SCHEME):].strip().encode("utf-8", "surrogatepass")
        # digests of equal length: the time taken tells neither where the first wrong byte is nor
        # how long the token is
        if not hmac.compare_digest(hashlib.sha256(given).digest(), self._digest):
            raise PermissionDenied(self._wrong)


def AdminAuth(token: str | None) -> BearerAuth:  # noqa: N802 - reads as the class it returns
    return BearerAuth(token, carrier="metadata",
                      missing="this admin call needs the metadata 'authorization: Bearer <token>' (the token the "
                              "server reads from its admin token environment variable)",
                      wrong="the admin token is wrong")


def ApiKeyAuth(key: str | None) -> BearerAuth:  # noqa: N802
    return BearerAuth(key, carrier="header",
                      missing="this server needs an API key: send the header 'Authorization: Bearer <key>' "
                              "(the openai client: api_key=...)",
                      wrong="the API key is wrong")
