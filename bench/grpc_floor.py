"""The floor under the device plugin's latency: a unary gRPC call that does nothing.

A Python gRPC server (a thread pool, as ``tessera-device-plugin``) echoes a 600-byte message over a
unix socket to a Python client; ``--calls`` calls one at a time, then the same number 20 at once (in
batches of 20 from 20 threads, as ``bench/deviceplugin_latency.py --concurrency 20`` admits pods).
Reported: p50 / p99 in ms and the CPU time per call of the server process and of the client (from
``/proc/<pid>/stat`` and ``getrusage``). An admission is two such calls (GetPreferredAllocation and
Allocate) plus the agent's own work, so on a machine with few cores this bounds what 20 admissions at
once can reach.

    .venv/bin/python -m bench.grpc_floor [--calls 400] [--threads 32]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc

METHOD = "/bench.Floor/Echo"
PAYLOAD = b"x" * 600
BATCH = 20


def serve(socket: str, threads: int) -> None:
    handler = grpc.method_handlers_generic_handler(
        "bench.Floor", {"Echo": grpc.unary_unary_rpc_method_handler(lambda request, context: request)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads))
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"unix://{socket}")
    server.start()
    server.wait_for_termination()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(
    echo: grpc.UnaryUnaryMultiCallable[bytes, bytes], server_pid: int, calls: int, concurrency: int
) -> str:
    latencies: list[float] = []
    lock = threading.Lock()

    def call(_: int) -> None:
        start = time.perf_counter()
        echo(PAYLOAD, timeout=30)
        with lock:
            latencies.append((time.perf_counter() - start) * 1000)

    server_before, client_before = cpu_seconds(server_pid), own_cpu_seconds()
    with futures.ThreadPoolExecutor(max_workers=concurrency) as pool:
        for _ in range(calls // BATCH):
            list(pool.map(call, range(BATCH)))
    server_ms = (cpu_seconds(server_pid) - server_before) * 1000 / len(latencies)
    client_ms = (own_cpu_seconds() - client_before) * 1000 / len(latencies)
    ordered = sorted(latencies)
    p99 = ordered[round(0.99 * (len(ordered) - 1))]
    return (
        f"| {concurrency} | {len(ordered)} | {statistics.median(ordered):.2f} | {p99:.2f} | "
        f"{server_ms:.2f} | {client_ms:.2f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=400, help="calls per mode, a multiple of 20")
    parser.add_argument("--threads", type=int, default=32, help="the server's thread pool")
    parser.add_argument("--serve", help=argparse.SUPPRESS)  # the server process's socket
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.threads)
        return
    with tempfile.TemporaryDirectory(prefix="grpc-floor-") as work:
        socket = f"{work}/floor.sock"
        server = subprocess.Popen(
            [sys.executable, "-m", "bench.grpc_floor", f"--serve={socket}", f"--threads={args.threads}"]
        )
        try:
            with grpc.insecure_channel(f"unix://{socket}") as channel:
                grpc.channel_ready_future(channel).result(timeout=30)
                echo: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(
                    METHOD, request_serializer=None, response_deserializer=None
                )
                for _ in range(100):  # warm up
                    echo(PAYLOAD, timeout=30)
                print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
                print(
                    "| at once | calls | p50 ms | p99 ms | server CPU ms per call | client CPU ms per call |"
                )
                print("|---|---|---|---|---|---|")
                for concurrency in (1, BATCH):
                    print(measure(echo, server.pid, args.calls, concurrency))
        finally:
            server.terminate()
            server.wait(timeout=30)


if __name__ == "__main__":
    main()
