"""HTTP-level abuse against the real extender process (loopback only, bounded in count and time):
bodies far larger than any real request, deep nesting, huge names, many stalled half-sent requests
and a flood of connections. Meanwhile it answers a real filter within kube-scheduler's budget, and
its memory stays under the chart's limit."""

from __future__ import annotations

import http.client
import json
import re
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
import yaml

from tests.extender.conftest import REPO, ExtenderServer
from tests.extender.helpers import gpu_pod

pytestmark = pytest.mark.k8s

# kube-scheduler's default extender httpTimeout is 5 s; a real filter must come back well within it.
BUDGET_S = 2.0
STALLED = 300  # connections left half-sent, more than --max-connections
MAX_CONNECTIONS = 200
UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}


def chart_memory_limit() -> int:
    """The extender container's memory limit in bytes, the chart's default (values.yaml)."""
    values = yaml.safe_load((REPO / "charts" / "tessera" / "values.yaml").read_text())
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi)", str(values["extender"]["resources"]["limits"]["memory"]))
    assert match, "no memory limit in charts/tessera/values.yaml extender.resources.limits"
    return int(match.group(1)) * UNITS[match.group(2)]


def rss_bytes(server: ExtenderServer) -> int:
    assert server.process is not None and server.process.popen is not None
    status = Path(f"/proc/{server.process.popen.pid}/status").read_text()
    kib = re.search(r"VmRSS:\s*(\d+) kB", status)
    assert kib
    return int(kib.group(1)) * 1024


def post(server: ExtenderServer, path: str, body: bytes, timeout: float = 30.0) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    try:
        connection.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read()
    except (ConnectionError, BrokenPipeError) as e:
        return 0, str(e).encode()
    finally:
        connection.close()


def real_filter(server: ExtenderServer, nodes: list[str]) -> float:
    """Seconds a real filter took; asserts it was answered."""
    body = json.dumps({"Pod": gpu_pod("real", memory=1024, uid="u-real"), "NodeNames": nodes}).encode()
    started = time.monotonic()
    status, answer = post(server, "/filter", body, timeout=10)
    elapsed = time.monotonic() - started
    assert status == 200, answer
    assert json.loads(answer)["NodeNames"], answer
    return elapsed


@contextmanager
def stalled_connections(port: int, count: int) -> Iterator[list[socket.socket]]:
    """``count`` connections, each having sent half a request's headers, closed at the end."""
    with ExitStack() as stack:
        sockets = []
        for i in range(count):
            s = stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=5))
            s.sendall(f"POST /filter HTTP/1.1\r\nHost: x\r\nX-Stall-{i}: ".encode())
            sockets.append(s)
        yield sockets


@pytest.fixture
def abused(start_extender: Callable[..., ExtenderServer], gpu_cluster: dict[str, str]) -> ExtenderServer:
    return start_extender(
        f"--max-connections={MAX_CONNECTIONS}",
        "--header-timeout=3",
        "--body-timeout=3",
        "--max-body-bytes=4194304",
        "--heartbeat-timeout=600",
    )


def test_abuse_leaves_the_extender_answering_within_budget_and_memory(
    abused: ExtenderServer, gpu_cluster: dict[str, str]
) -> None:
    nodes = sorted(gpu_cluster)
    limit = chart_memory_limit()
    assert real_filter(abused, nodes) < BUDGET_S

    # A body far larger than any real request: refused by its declared length, never read.
    huge_names = json.dumps({"Pod": gpu_pod("p"), "NodeNames": [f"n-{i}" for i in range(4_200_000)]})
    status, answer = post(abused, "/filter", huge_names.encode())
    assert status in (413, 0), answer  # 0: closed while the client was still sending
    del huge_names
    # Deeply nested JSON under the cap: 400 naming the problem.
    nested = b'{"Pod": {"metadata": {"name": "p"}, "spec": {"x": ' + b"[" * 100_000 + b"]" * 100_000
    status, answer = post(abused, "/filter", nested + b'}}, "NodeNames": ["a"]}')
    assert status == 400 and b"nests JSON too deeply" in answer, answer
    # A 50 MB pod name in a bind: refused before it reaches the API server or a log line.
    bind = {"PodName": "p" * 3_000_000, "PodNamespace": "default", "PodUID": "u", "Node": nodes[0]}
    status, answer = post(abused, "/bind", json.dumps(bind).encode())
    assert status == 400 and b"PodName: String should have at most 253 characters" in answer, answer
    assert len(answer) < 2000
    # Many names nobody knows, under the cap: rejected, not stored.
    unknown = {"Pod": gpu_pod("p2", memory=1024, uid="u2"), "NodeNames": [f"x{i}" for i in range(200_000)]}
    status, answer = post(abused, "/prioritize", json.dumps(unknown).encode())
    assert status == 200

    # Many stalled half-sent requests, more than the connection limit: a real filter still gets through.
    with stalled_connections(abused.port, STALLED):
        assert real_filter(abused, nodes) < BUDGET_S
        assert rss_bytes(abused) < limit
    # The stalled ones are closed by the header timeout, not kept.
    with stalled_connections(abused.port, 20) as sockets:
        time.sleep(4)
        closed = 0
        for s in sockets:
            s.settimeout(1)
            try:
                closed += s.recv(1) == b""
            except (ConnectionError, TimeoutError):
                closed += 1
        assert closed == len(sockets)

    assert real_filter(abused, nodes) < BUDGET_S
    assert rss_bytes(abused) < limit, f"RSS {rss_bytes(abused)} over the chart's limit {limit}"
    metrics = abused.metrics()
    assert 'tessera_extender_requests_total{code="413",verb="filter"}' in metrics
    assert abused.process is not None and abused.process.running
    # The extender's log holds no line of megabytes.
    log = abused.process.log_path.read_text(errors="replace")
    assert all(len(line) < 10_000 for line in log.splitlines())
