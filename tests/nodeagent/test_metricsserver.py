"""The node agent's /metrics server: who may read it, and that no client can hold it."""

from __future__ import annotations

import contextlib
import gzip
import socket
import time
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Gauge

from nodeagent.metricsserver import MetricsServer, ServerLimits
from tessera.scrapeauth import ALLOWED, Access
from tests.scraping import get
from tests.waiting import wait_for

LIMITS = ServerLimits(idle_timeout=0.5, request_timeout=1.5, max_connections=2)


def authorize(header: str | None) -> Access:
    if header == "Bearer down":
        raise OSError("the API server is down")
    if header == "Bearer reader":
        return ALLOWED
    return Access(401 if header is None else 403, "no")


@pytest.fixture
def server() -> Iterator[MetricsServer]:
    registry = CollectorRegistry()
    Gauge("tessera_test_gauge", "A gauge.", registry=registry).set(7)
    started = MetricsServer("127.0.0.1", 0, registry, authorize, LIMITS)
    try:
        yield started
    finally:
        started.shutdown()


def url(server: MetricsServer, path: str = "/metrics") -> str:
    return f"http://127.0.0.1:{server.port}{path}"


def test_only_an_authorized_scrape_reads_and_a_review_that_cannot_be_made_is_503(
    server: MetricsServer,
) -> None:
    assert get(url(server), None)[0] == 401
    assert get(url(server), "tenant") == (403, "no\n")
    assert get(url(server), "down")[0] == 503
    status, body = get(url(server), "reader")
    assert status == 200 and "tessera_test_gauge 7.0" in body
    assert get(url(server, "/other"), "reader")[0] == 404
    request = urllib.request.Request(
        url(server), headers={"Authorization": "Bearer reader", "Accept-Encoding": "gzip"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:  # as Prometheus asks
        assert response.headers["Content-Encoding"] == "gzip"
        assert b"tessera_test_gauge 7.0" in gzip.decompress(response.read())


def _answers(server: MetricsServer) -> bool:
    try:
        return get(url(server), "reader")[0] == 200
    except ConnectionError:  # still full: closed unanswered (RemoteDisconnected, a reset)
        return False


def test_idle_and_slow_clients_are_cut_and_a_full_server_still_answers_after(server: MetricsServer) -> None:
    """Two idle connections fill it (max_connections 2); a third is closed unanswered; the idle ones
    are cut at the idle timeout, and one dripping its request a byte at a time, each within the idle
    timeout, at the request timeout."""
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(2)]
    time.sleep(0.1)
    third = socket.create_connection(("127.0.0.1", server.port))
    third.settimeout(5)
    assert third.recv(1) == b""  # closed, no answer
    for s in idle:
        s.settimeout(5)
        assert s.recv(1) == b""  # cut after idle_timeout
    wait_for(lambda: _answers(server), timeout=10, what="the cut connections' slots free")
    # The GET's slot is freed just after its answer: a drip closed sooner than the idle timeout found
    # the server still full, and tries again.
    for _ in range(10):
        drip = socket.create_connection(("127.0.0.1", server.port))  # blocking: MSG_DONTWAIT peeks
        idle.append(drip)
        started = time.monotonic()
        with pytest.raises(OSError):
            for byte in b"GET /metrics HTTP/1.1\r\nX-Slow: " + b"a" * 1000:
                drip.sendall(bytes([byte]))
                time.sleep(0.2)
                with contextlib.suppress(BlockingIOError):  # nothing to read: still open
                    if drip.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) == b"":
                        raise ConnectionResetError("closed")
        cut_after = time.monotonic() - started
        if cut_after >= LIMITS.idle_timeout:
            break
    # Cut at request_timeout: not at the idle timeout (each byte came in time), not after the 200 s.
    assert LIMITS.request_timeout - 0.2 < cut_after < 10
    for s in (*idle, third):
        s.close()
