"""The /metrics server of either node agent (the device plugin, the DRA driver): a scrape must be
authorized (tessera.scrapeauth), and no client can hold the server: a connection gets
``idle_timeout`` between reads and ``request_timeout`` in all to send its request and take the
answer, and at most ``max_connections`` are served at once (more are closed at once, unanswered).

prometheus_client's own server has none of this (a thread per connection, held for as long as the
client likes): any pod on the node's network could read other namespaces' pods and use, or exhaust
the agent's threads.
"""

from __future__ import annotations

import contextlib
import gzip
import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from tessera.contract import JsonObject
from tessera.scrapeauth import METRICS_PATH, Access, AccessCache, Review, drive, review_scrape

log = logging.getLogger(__name__)

# Whether a scrape with this Authorization header (None: none) may read the metrics; raises when the
# API server cannot say (the scrape is answered 503).
Authorize = Callable[[str | None], Access]


def scrape_authorizer(post: Callable[[Review], JsonObject]) -> Authorize:
    """Scrapes reviewed by the API server with ``post`` (tessera.scrapeauth), answers kept a while
    per token."""
    scrapes = AccessCache()
    return lambda header: drive(review_scrape(header, scrapes), post)


@dataclass(frozen=True)
class ServerLimits:
    idle_timeout: float = 5.0
    request_timeout: float = 15.0
    max_connections: int = 16


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        registry: CollectorRegistry,
        authorize: Authorize | None,
        limits: ServerLimits,
    ) -> None:
        self.registry = registry
        self.authorize = authorize
        self.limits = limits
        self._slots = threading.BoundedSemaphore(limits.max_connections)
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # full: closed unanswered, the scraper retries
            return
        try:
            request.settimeout(self.limits.idle_timeout)
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client cut off or gone (timeouts, resets): no traceback on stderr, as socketserver would.
        log.debug("metrics connection from %s ended", client_address[0], exc_info=True)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        # The whole exchange is bounded: a client sending its headers a byte at a time, each within
        # the idle timeout, is cut off at the request timeout.
        deadline = threading.Timer(self.limits.request_timeout, _cut, (request,))
        deadline.start()
        try:
            super().process_request_thread(request, client_address)
        finally:
            deadline.cancel()
            self._slots.release()


def _cut(request: socket.socket) -> None:
    with contextlib.suppress(OSError):  # closed already
        request.shutdown(socket.SHUT_RDWR)


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        if self.path.split("?", 1)[0] != METRICS_PATH:
            self._answer(404, b"not found\n")
            return
        if self.server.authorize is not None:
            try:
                access = self.server.authorize(self.headers.get("Authorization"))
            except Exception as e:  # the API server down: nothing is decided, nothing shown
                log.warning("cannot review a scrape from %s: %s", self.client_address[0], e)
                self._answer(503, b"cannot review the scrape's token now\n")
                return
            if not access.allowed:
                self._answer(access.status, f"{access.reason}\n".encode())
                return
        encoder, content_type = choose_encoder(self.headers.get("Accept") or "")
        body = encoder(self.server.registry)
        # Prometheus asks for gzip: a busy node's answer shrinks about tenfold.
        if "gzip" in (self.headers.get("Accept-Encoding") or ""):
            self._answer(200, gzip.compress(body), content_type, encoding="gzip")
        else:
            self._answer(200, body, content_type)

    def _answer(
        self,
        status: int,
        body: bytes,
        content_type: str = "text/plain; charset=utf-8",
        encoding: str | None = None,
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        if encoding:
            self.send_header("Content-Encoding", encoding)
        self.send_header("Content-Length", str(len(body)))
        if status == 401:
            self.send_header("WWW-Authenticate", 'Bearer realm="tessera-metrics"')
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("metrics %s: " + format, self.client_address[0], *args)


class MetricsServer:
    """Serves ``registry`` at /metrics on ``address``:``port`` (0: any free port) in a thread."""

    def __init__(
        self,
        address: str,
        port: int,
        registry: CollectorRegistry,
        authorize: Authorize | None,
        limits: ServerLimits = ServerLimits(),
    ) -> None:
        self._server = _Server((address, port), registry, authorize, limits)
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def shutdown(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def serve_metrics(
    address: str, port: int, registry: CollectorRegistry, authorize: Authorize | None
) -> MetricsServer:
    """The agent's metrics server, started, and said where in the log."""
    server = MetricsServer(address, port, registry, authorize)
    log.info(
        "metrics on http://%s:%d/metrics (%s)",
        address,
        server.port,
        "scrapes authorized by the API server" if authorize else "open to anyone reaching the port",
    )
    return server
