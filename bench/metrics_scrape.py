"""Scrape cost of the node agent's /metrics: response time and size with 10 GPUs x 10 containers.

What one scrape of a busy node costs the agent: its real collector (deviceplugin.metrics) behind
prometheus_client's HTTP server, as deviceplugin/main.py serves it, over the fake GPU's NVML (one
reading per GPU and the driver's per-process list, each process's cgroup looked up), with one served
record and one live accounting region per container. Each region is written by a hooked process
(the fake GPU's cuclient holding 64 MiB on its GPU) and read through libvgpu.so at every scrape.

The scrapes run one after another from this machine (loopback HTTP); the figures are wall time per
scrape (p50, p99, max), the body's size (plain and gzipped, as Prometheus asks for it), and its
number of series.

    .venv/bin/python -m bench.metrics_scrape [--gpus 10] [--containers-per-gpu 10] [--scrapes 200]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import fakegpu
from nodeagent.records import ServedRecord
from nodeagent.statedir import REGION_NAME, StateDir
from tessera.contract import GpuGrant

NODE = "bench-node"


def start_holders(
    directory: Path, config: Path, state: StateDir, gpus: int, per_gpu: int
) -> list[subprocess.Popen[str]]:
    """One served record and one hooked process holding memory per container."""
    library = fakegpu.build_hook()
    specs = [fakegpu.example_gpu(i) for i in range(gpus)]
    holders: list[subprocess.Popen[str]] = []
    for i, spec in enumerate(specs):
        for j in range(per_gpu):
            uid = f"00000000-0000-0000-{i:04d}-{j:012d}"
            where = state.container(uid, "main")
            grant = GpuGrant(uuid=spec.uuid, memory_quota_mib=4096, cores=10)
            record = ServedRecord(
                namespace="bench", pod=f"pod-{i}-{j}", pod_uid=uid, container="main", gpus=(grant,)
            )
            state.write_record(where, record)
            where.state.mkdir(parents=True, exist_ok=True)
            env = fakegpu.client_env(config, directory / "fakegpu-state")
            env.update(
                LD_PRELOAD=str(library),
                TESSERA_REGION=str(where.state / REGION_NAME),
                TESSERA_MEMORY_LIMIT="4g",
                TESSERA_CORES="10",
            )
            holder = subprocess.Popen(
                [str(fakegpu.cuclient()), "--device", str(i), "alloc", "mem", "64m", "1", "hold"],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                start_new_session=True,
            )
            holders.append(holder)
    for holder in holders:
        assert holder.stdout is not None
        while (line := holder.stdout.readline()) and line.strip() != "hold ready":
            if "result=" in line and "CUDA_SUCCESS" not in line:
                raise RuntimeError(f"a holder's allocation failed: {line.strip()}")
        if line.strip() != "hold ready":
            raise RuntimeError(f"a holder exited before holding (status {holder.wait()})")
    return holders


def stop(holders: list[subprocess.Popen[str]]) -> None:
    for holder in holders:
        if holder.poll() is None:
            os.killpg(holder.pid, signal.SIGKILL)
    for holder in holders:
        holder.wait(timeout=30)


def measure(state_dir: Path, scrapes: int) -> dict[str, float]:
    """In a process whose NVML is the fake GPU's (started with its environment)."""
    from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415
    from prometheus_client.registry import CollectorRegistry  # noqa: PLC0415

    from deviceplugin.metrics import AgentCollector, PluginMetrics  # noqa: PLC0415
    from nodeagent.metricsserver import MetricsServer  # noqa: PLC0415
    from nodeagent.nvml import Nvml  # noqa: PLC0415

    nvml = Nvml()
    inventory = nvml.discover(split=10)
    registry = CollectorRegistry()
    registry.register(AgentCollector(NODE, lambda: inventory, nvml.reading, StateDir(state_dir)))
    PluginMetrics(registry)
    server = MetricsServer("127.0.0.1", 0, registry, authorize=None)  # the agent's server, unreviewed
    try:
        url = f"http://127.0.0.1:{server.port}/metrics"
        times, body = [], b""
        for _ in range(scrapes):
            started = time.perf_counter()
            with urllib.request.urlopen(url, timeout=30) as response:
                body = response.read()
            times.append(time.perf_counter() - started)
        # As Prometheus asks for it (it sends Accept-Encoding: gzip).
        request = urllib.request.Request(url, headers={"Accept-Encoding": "gzip"})
        with urllib.request.urlopen(request, timeout=30) as response:
            gzipped = len(response.read())
        text = body.decode()
        series = sum(len(f.samples) for f in text_string_to_metric_families(text))
        used = sum(
            s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == "tessera_container_memory_used_bytes"
        )
        times.sort()
        return {
            "gpus": len(inventory),
            "scrapes": scrapes,
            "p50_ms": statistics.median(times) * 1e3,
            "p99_ms": times[int(0.99 * (len(times) - 1))] * 1e3,
            "max_ms": times[-1] * 1e3,
            "bytes": len(body),
            "gzip_bytes": gzipped,
            "series": series,
            "container_memory_used_bytes_sum": used,
        }
    finally:
        server.shutdown()
        nvml.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gpus", type=int, default=10)
    parser.add_argument("--containers-per-gpu", type=int, default=10)
    parser.add_argument("--scrapes", type=int, default=200)
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)  # the child's state dir
    args = parser.parse_args()
    if args.measure is not None:
        print(json.dumps(measure(args.measure, args.scrapes)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        state = StateDir(directory / "state")
        state.prepare()
        fakegpu.build()
        config = fakegpu.write_config(
            directory / "gpus.conf", [fakegpu.example_gpu(i) for i in range(args.gpus)]
        )
        holders = start_holders(directory, config, state, args.gpus, args.containers_per_gpu)
        try:
            env = fakegpu.client_env(config, directory / "fakegpu-state")
            child = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "bench.metrics_scrape",
                    "--measure",
                    str(state.root),
                    "--scrapes",
                    str(args.scrapes),
                ],
                env=env,
                capture_output=True,
                text=True,
                check=False,
                timeout=600,
            )
        finally:
            stop(holders)
    if child.returncode != 0:
        raise SystemExit(f"measuring failed:\n{child.stderr}")
    result = json.loads(child.stdout)
    containers = args.gpus * args.containers_per_gpu
    print(
        f"node agent /metrics, {result['gpus']} GPUs x {args.containers_per_gpu} containers "
        f"({containers} live regions), {result['scrapes']} scrapes:\n"
        f"  time per scrape: p50 {result['p50_ms']:.1f} ms, p99 {result['p99_ms']:.1f} ms, "
        f"max {result['max_ms']:.1f} ms\n"
        f"  body: {result['bytes']} bytes ({result['gzip_bytes']} gzipped), {result['series']} series "
        f"(containers' memory in use summed: {result['container_memory_used_bytes_sum'] / 2**20:.0f} MiB)"
    )


if __name__ == "__main__":
    main()
