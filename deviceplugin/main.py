"""``tessera-device-plugin``: wires NVML, the kubelet's gRPC API, the Kubernetes API and /metrics
around the agent, and runs until SIGTERM or SIGINT."""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Sequence

from prometheus_client.registry import CollectorRegistry

from deviceplugin.agent import Agent
from deviceplugin.config import Config, parse_config
from deviceplugin.driveruse import GpuHolders, gpu_holders
from deviceplugin.kube import Kube
from deviceplugin.kubelet import run_registration
from deviceplugin.metrics import AgentCollector, PluginMetrics, mps_daemon_gauge
from deviceplugin.metricsserver import Authorize, MetricsServer
from deviceplugin.mps_daemon import DaemonReport, mps_paths
from deviceplugin.phases import PhaseWriter
from deviceplugin.podcache import PodCache
from deviceplugin.sharing import node_sharing_mode
from hook._library import LIBRARY_ENV
from nodeagent.kubeapi import load_api
from nodeagent.nvml import GpuReading, discover_gpus
from nodeagent.process import serve_until_signalled
from nodeagent.statedir import StateDir
from tessera.contract import SharingMode
from tessera.scrapeauth import AccessCache, drive, review_scrape

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
    report = None
    if sharing == SharingMode.MPS and gpus:
        # The daemon is tessera-mps-control's, in a container of its own: the agent neither starts
        # nor restarts it, and only says whether it runs. Before the kubelet hears of the agent, a
        # while for it to come up (the two containers start together), so that containers are not
        # served before it runs; the agent serves them anyway once the wait is over.
        report = DaemonReport(config.mps_control, mps_paths(config.state_dir))
        report.wait(stop, config.mps_wait_seconds)
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
    if report is not None:
        running = mps_daemon_gauge(registry)
        running.set(0 if report.check() is None else 1)
        report.on_change = lambda pid: running.set(0 if pid is None else 1)
    agent.on_followed = plugin_metrics.resizes_followed.inc
    agent.on_evicted = plugin_metrics.best_effort_evictions.inc
    authorize = _scrape_authorizer(kube) if config.metrics_authorization else None
    metrics_server = MetricsServer(config.metrics_address, config.metrics_port, registry, authorize)
    log.info(
        "metrics on http://%s:%d/metrics (%s)",
        config.metrics_address,
        metrics_server.port,
        "scrapes authorized by the API server" if authorize else "open to anyone reaching the port",
    )

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
    if report is not None:
        threads.append(threading.Thread(target=report.watch, args=(stop,), name="mps"))
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
        kube.close()
        if nvml is not None:
            nvml.close()
        log.info("stopped")


def _scrape_authorizer(kube: Kube) -> Authorize:
    """Scrapes reviewed by the API server (tessera.scrapeauth), answers kept a while per token."""
    scrapes = AccessCache()
    return lambda header: drive(review_scrape(header, scrapes), kube.post_review)


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(argv)
    return serve_until_signalled(lambda stop: run(config, stop))


if __name__ == "__main__":
    sys.exit(main())
