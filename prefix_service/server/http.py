"""HttpServer: uvicorn serving the OpenAI-compatible app on the server's own event loop.

The socket is bound here first (a taken port fails the start with a clear error, port 0 gives its
number back); uvicorn then runs as a task beside gRPC. Signals stay the PrefixServer's: uvicorn
installs no handlers of its own. Stop: no new connections, in-flight responses get the time it is
given, then their tasks are cancelled (which aborts their requests); UvicornHttpFront (parts.py)
has the API answer them before that.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import Any, Iterator

import uvicorn

from prefix_service.config import split_address

log = logging.getLogger("prefix_service.server")


class _Uvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # the PrefixServer handles SIGTERM/SIGINT
        yield


class HttpServer:
    def __init__(self, app: Any, address: str, *, certfile: str | None = None, keyfile: str | None = None) -> None:
        self.app = app
        self.address = address
        self.certfile, self.keyfile = certfile, keyfile
        self.port: int | None = None
        self._server: _Uvicorn | None = None
        self._task: asyncio.Task[None] | None = None
        self._sock: socket.socket | None = None

    def _bind(self) -> socket.socket:
        host, port = split_address(self.address, "server.http_address")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(2048)
            sock.setblocking(False)
        except OSError as e:
            sock.close()
            raise OSError(f"cannot listen on {self.address} (server.http_address): {e.strerror or e} (is another "
                          f"server using the port?)") from None
        return sock

    async def start(self, grace_s: float) -> int:
        self._sock = self._bind()
        self.port = self._sock.getsockname()[1]
        config = uvicorn.Config(self.app, lifespan="off", log_config=None, access_log=False,
                                ssl_certfile=self.certfile, ssl_keyfile=self.keyfile,
                                # uvicorn annotates whole seconds, it waits any float (unused-ignore: a
                                # uvicorn whose annotation is right)
                                timeout_graceful_shutdown=max(grace_s, 0.01),  # type: ignore[arg-type, unused-ignore]
                                server_header=False)
        self._server = _Uvicorn(config)
        self._task = asyncio.ensure_future(self._server.serve(sockets=[self._sock]))
        while not self._server.started:
            if self._task.done():  # startup failed; uvicorn exits its task instead of raising
                error = self._task.exception() if not self._task.cancelled() else None
                self._server = self._task = None
                self._sock.close()
                raise OSError(f"the HTTP server on {self.address} did not start ({error!r}); the log says why")
            await asyncio.sleep(0.01)
        return self.port

    async def stop(self, grace_s: float) -> None:
        """Refuse new connections; let in-flight responses run up to grace_s, then cancel them."""
        if self._server is None or self._task is None:
            if self._sock is not None:
                self._sock.close()
            return
        # as in start()
        self._server.config.timeout_graceful_shutdown = max(grace_s, 0.01)  # type: ignore[assignment, unused-ignore]
        self._server.should_exit = True
        try:
            await self._task
        except (Exception, SystemExit):  # noqa: BLE001 - stopping must go on
            log.exception("the HTTP server stopped with an error")
        self._server = self._task = None
