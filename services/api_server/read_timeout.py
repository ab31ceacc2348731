"""A bound on how long a client may take to send a request's head.

uvicorn times out only an idle kept-alive connection: one that connects and sends
nothing, or its headers a byte at a time, holds a socket and a file descriptor for ever,
outside every admission bound (``max_inflight`` counts requests, which these never become).
This protocol drops such a connection once its head is not whole ``read_timeout_s`` after
the connection (or, on a kept-alive one, the request's first byte). The body has the same
bound in the handler (a 408)."""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


def protocol_with_head_timeout(timeout_s: float) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol, with the head's deadline (``uvicorn.Config(http=...)``)."""

    class HeadTimeoutProtocol(HttpToolsProtocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._head_timer is None:      # a kept-alive connection's next request
                self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._head_timer = self.loop.call_later(timeout_s, self._head_late)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_late(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing():
                self.transport.close()

    return HeadTimeoutProtocol
