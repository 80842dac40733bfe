"""``tessera-device-plugin``: wires NVML, the kubelet's gRPC API, the Kubernetes API and /metrics
around the agent, and runs until SIGTERM or SIGINT."""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from prometheus_client import start_http_server
from prometheus_client.registry import CollectorRegistry

from deviceplugin.agent import Agent
from deviceplugin.config import Config, parse_config
from deviceplugin.driveruse import GpuHolders, gpu_holders
from deviceplugin.kube import Kube, load_api
from deviceplugin.kubelet import run_registration
from deviceplugin.metrics import AgentCollector, PluginMetrics
from deviceplugin.mps_daemon import MpsDaemon, MpsPaths, mps_paths
from deviceplugin.nvml import GpuReading, discover_gpus
from deviceplugin.phases import PhaseWriter
from deviceplugin.podcache import PodCache
from deviceplugin.process import serve_until_signalled
from deviceplugin.sharing import node_sharing_mode
from deviceplugin.statedir import StateDir
from hook._library import LIBRARY_ENV
from tessera.contract import CONTAINER_MPS_SHM_DIR, SharingMode

log = logging.getLogger("tessera-device-plugin")


def run(config: Config, stop: threading.Event) -> None:
    # The hook's Python module finds libvgpu.so (to read accounting regions) through this variable.
    os.environ.setdefault(LIBRARY_ENV, str(config.hook_library))
    kube = Kube(load_api(config.kubeconfig), config.node_name, config.keys)
    state = StateDir(config.state_dir)
    state.prepare()
    nvml, gpus = discover_gpus(config.split)
    sharing = node_sharing_mode(kube.node_labels(), config.keys, config.node_name, config.sharing)
    log.info("node %s: GPUs shared by %s", config.node_name, sharing.value)
    daemon = None
    if sharing == SharingMode.MPS and gpus:
        # Before the kubelet hears of the agent: no container is served before its daemon runs.
        daemon = MpsDaemon(config.mps_control, mps_paths(config.state_dir), [g.uuid for g in gpus])
        daemon.ensure()
        _check_shm(daemon.paths)
    cache = PodCache(kube)
    phases = PhaseWriter(kube)
    agent = Agent(config, gpus, kube, state, cache=cache, phases=phases, sharing=sharing)

    def reading(uuid: str) -> GpuReading | None:
        return nvml.reading(uuid) if nvml is not None else None

    def utilization(uuid: str) -> int | None:
        read = reading(uuid)
        return None if read is None else round(read.utilization_ratio * 100)

    agent.utilization = utilization

    def driver_holders(uuid: str) -> GpuHolders | None:
        return gpu_holders(uuid) if nvml is not None else None

    def free_memory(uuid: str) -> int | None:
        read = reading(uuid)
        return None if read is None else max(0, read.memory_total_bytes - read.memory_used_bytes)

    agent.gpu_holders = driver_holders
    agent.free_memory = free_memory

    # Events go out on their own thread: a caller never waits for the API server.
    events = ThreadPoolExecutor(max_workers=1, thread_name_prefix="events")

    if daemon is not None:
        daemon.on_restart = lambda message: events.submit(agent.warn_mps_clients, message)

    registry = CollectorRegistry()
    registry.register(
        AgentCollector(
            config.node_name,
            agent.inventory,
            reading,
            state,
            measured=agent.measured_usage,
        )
    )
    plugin_metrics = PluginMetrics(registry)
    agent.on_followed = plugin_metrics.resizes_followed.inc
    agent.on_evicted = plugin_metrics.best_effort_evictions.inc
    metrics_server, _ = start_http_server(config.metrics_port, config.metrics_address, registry=registry)
    log.info("metrics on http://%s:%d/metrics", config.metrics_address, metrics_server.server_port)

    threads = [
        threading.Thread(target=cache.run, args=(stop,), name="pods"),
        threading.Thread(target=phases.run, args=(stop,), name="phases"),
        threading.Thread(target=run_registration, args=(agent, config, plugin_metrics, stop), name="kubelet"),
        threading.Thread(target=agent.run_publisher, args=(stop,), name="publisher"),
        threading.Thread(target=agent.run_confirmations, args=(stop,), name="admissions"),
        threading.Thread(target=agent.run_usage_checks, args=(stop,), name="usage"),
    ]
    if nvml is not None and gpus:
        threads.append(
            threading.Thread(
                target=nvml.watch_xids, args=(agent.gpu_uuids, agent.record_xid, stop), name="xid"
            )
        )
        threads.append(
            threading.Thread(target=agent.run_presence_checks, args=(nvml.present, stop), name="presence")
        )
    if daemon is not None:  # never stopped by the agent: its clients would end with it
        threads.append(threading.Thread(target=daemon.watch, args=(stop,), name="mps"))
    for thread in threads:
        thread.start()
    try:
        stop.wait()
    finally:
        stop.set()
        agent.wake_waiters()
        cache.interrupt()
        phases.wake()
        for thread in threads:
            thread.join()
        metrics_server.shutdown()
        events.shutdown(wait=False, cancel_futures=True)
        kube.close()
        if nvml is not None:
            nvml.close()
        log.info("stopped")


def _check_shm(paths: MpsPaths) -> None:
    """Say so when the daemon's /dev/shm is not the directory containers get as theirs (the chart
    mounts it so): the server and its clients would not share memory, and clients could not connect."""
    try:
        same = os.path.samefile(CONTAINER_MPS_SHM_DIR, paths.shm)
    except OSError:
        same = False
    if not same:
        log.warning(
            "MPS: %s is not %s, which containers get as their %s: mount %s at %s in the agent's "
            "container (the chart does), or MPS clients may not reach the server",
            CONTAINER_MPS_SHM_DIR,
            paths.shm,
            CONTAINER_MPS_SHM_DIR,
            paths.shm,
            CONTAINER_MPS_SHM_DIR,
        )


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(argv)
    return serve_until_signalled(lambda stop: run(config, stop))


if __name__ == "__main__":
    sys.exit(main())
