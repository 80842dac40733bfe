"""uvicorn's HTTP protocol with the limits a server facing untrusted clients needs and uvicorn lacks.

uvicorn (httptools) waits forever for a request that is never finished, takes headers of any size,
and counts no connections but to answer 503 past ``limit_concurrency``, which would lock
kube-scheduler out as surely as the stalled connections do. Here:

* a request's headers must arrive within ``header_timeout`` of the connection (or of the start of
  the request on a kept-alive one), and its body within ``body_timeout`` of its headers: a stalled
  connection is closed;
* headers past ``max_header_bytes`` get 400 and the connection is closed;
* past ``max_connections``, a new connection closes the oldest one that has not yet been answered
  a request (a flood of connections that never send one), else the oldest idle one; connections
  that have been answered and are busy (kube-scheduler's kept-alive connection) are never closed.

The body's own size is capped by the application (:class:`extender.app.ExtenderApp`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from tessera.contract import MIB

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Limits:
    """The HTTP server's limits (``tessera-extender --help``; docs/placement.md, Limits)."""

    max_body_bytes: int = 4 * MIB
    max_buffered_bytes: int = 64 * MIB
    max_header_bytes: int = 64 * 2**10
    max_connections: int = 1000
    header_timeout: float = 10.0
    body_timeout: float = 10.0
    keep_alive_timeout: float = 5.0


def guarded_protocol(limits: Limits) -> type[HttpToolsProtocol]:
    """An HttpToolsProtocol class enforcing ``limits`` (one set of books per server)."""
    # Connections not yet answered a request, oldest first (a dict keeps insertion order).
    unproven: dict[GuardedProtocol, None] = {}

    class GuardedProtocol(HttpToolsProtocol):
        _timer: asyncio.TimerHandle | None = None
        _header_bytes = 0
        _in_headers = True
        _proven = False

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            unproven[self] = None
            self._arm(limits.header_timeout)
            if len(self.connections) > limits.max_connections:
                self._evict()

        def _evict(self) -> None:
            victim: GuardedProtocol = next((c for c in unproven if c is not self), self)
            if victim is self:
                idle = (c for c in self.connections if isinstance(c, GuardedProtocol) and c._idle())
                victim = next((c for c in idle if c is not self), self)
            log.debug("over %d connections: closing one", limits.max_connections)
            victim.transport.close()

        def _idle(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def connection_lost(self, exc: Exception | None) -> None:
            unproven.pop(self, None)
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._in_headers:
                self._header_bytes += len(data)
            super().data_received(data)
            # Still in the head after this chunk (a chunk can hold a head and a body): too long?
            if (
                self._in_headers
                and self._header_bytes > limits.max_header_bytes
                and not self.transport.is_closing()
            ):
                self._disarm()
                self.send_400_response(f"request headers over {limits.max_header_bytes} bytes")

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_headers = True
            if self._timer is None:
                self._arm(limits.header_timeout)

        def on_headers_complete(self) -> None:
            self._in_headers = False
            self._header_bytes = 0
            self._arm(limits.body_timeout)
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._disarm()
            super().on_message_complete()

        def on_response_complete(self) -> None:
            if not self._proven:
                self._proven = True
                unproven.pop(self, None)
            self._in_headers = True
            self._header_bytes = 0
            super().on_response_complete()

        def _arm(self, seconds: float) -> None:
            self._disarm()
            self._timer = self.loop.call_later(seconds, self._expired)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _expired(self) -> None:
            self._timer = None
            if not self.transport.is_closing():
                log.debug("closing a connection whose request did not arrive in time")
                self.transport.close()

    return GuardedProtocol


def uvicorn_options(limits: Limits) -> dict[str, Any]:
    """uvicorn.run/Config keywords applying ``limits``."""
    return {
        "http": guarded_protocol(limits),
        "timeout_keep_alive": limits.keep_alive_timeout,
        # 503 past this many connections or tasks would refuse kube-scheduler too: the protocol
        # closes stalled connections instead. A backstop far above max_connections only.
        "limit_concurrency": None,
    }
