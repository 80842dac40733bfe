"""``tessera-device-plugin``: composes the node agent's parts (:func:`compose`), wires NVML, the
kubelet's gRPC API, the Kubernetes API and /metrics around them, and runs until SIGTERM or SIGINT."""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prometheus_client.registry import CollectorRegistry

from deviceplugin.admissions import Admissions
from deviceplugin.allocation import Allocator
from deviceplugin.config import Config, parse_config
from deviceplugin.driverchecks import Driver, DriverChecks
from deviceplugin.driveruse import GpuHolders, gpu_holders
from deviceplugin.handover import hand_over
from deviceplugin.inventory import Inventory
from deviceplugin.kube import Kube
from deviceplugin.kubelet import run_registration
from deviceplugin.matching import PodView
from deviceplugin.metrics import AgentCollector, PluginMetrics, mps_daemon_gauge
from deviceplugin.mps_daemon import DaemonReport, mps_paths
from deviceplugin.phases import PhaseWriter
from deviceplugin.podcache import PodCache
from deviceplugin.podresources import Owners, container_devices
from deviceplugin.publisher import Publisher
from deviceplugin.resize import ContainerResizer
from deviceplugin.served import ServedContainers
from deviceplugin.sharing import node_sharing_mode
from deviceplugin.usage import UsageChecks
from hook._library import LIBRARY_ENV
from nodeagent.health import health_threads
from nodeagent.kubeapi import load_api
from nodeagent.metricsserver import scrape_authorizer, serve_metrics
from nodeagent.nodelock import serve_holding_node
from nodeagent.nvml import discover_gpus, gpu_reader
from nodeagent.statedir import StateDir
from tessera.contract import ContractKeys, GpuInfo, SharingMode
from tessera.inflight import is_allocating

log = logging.getLogger("tessera-device-plugin")


@dataclass(frozen=True, slots=True)
class NodeAgent:
    """The node agent's parts, each with one job (docs/deviceplugin.md "Architecture: the agent's
    parts")."""

    inventory: Inventory
    served: ServedContainers
    resizes: ContainerResizer
    cache: PodCache | None
    allocator: Allocator
    admissions: Admissions
    usage: UsageChecks
    publisher: Publisher


def compose(
    config: Config,
    gpus: tuple[GpuInfo, ...],
    kube: Kube,
    state: StateDir,
    *,
    pod_cache: Callable[[Callable[[Sequence[PodView]], object]], PodCache] | None = None,
    phases: PhaseWriter | None = None,
    pod_resources: Callable[[], Owners | None] | None = None,
    sharing: SharingMode | None = None,
    driver: Driver | None = None,
    on_resized: Callable[[int], object] | None = None,
    on_evicted: Callable[[], object] | None = None,
) -> NodeAgent:
    """Build the parts, each with what it needs. ``pod_cache``: makes the pods on the node from the
    callback it is to tell them to (None: the API only). ``phases``: writes the ``allocated`` phase;
    whoever runs the agent runs its loop (``phases.run``), or drains it. ``pod_resources``: which
    container the kubelet gave each device set to (default: its pod-resources API at the configured
    socket). ``sharing``: the node's mode (default ``--sharing``; the caller decides it from the
    Node's label, :func:`deviceplugin.sharing.node_sharing_mode`). ``driver``: NVML's word (default:
    none). ``on_resized``, ``on_evicted``: the exporter's counters."""
    inventory = Inventory(gpus, config.health_poll_seconds)
    served = ServedContainers(config, state, config.sharing if sharing is None else sharing)
    resizes = ContainerResizer(config.keys, served, on_resized)
    cache = pod_cache(resizes.resize) if pod_cache is not None else None
    admissions = Admissions(
        config,
        kube,
        served,
        resizes,
        phases if phases is not None else PhaseWriter(kube),
        pod_resources or (lambda: container_devices(config.pod_resources_socket, config.keys.vgpu)),
        cache,
    )
    driver = driver or Driver()
    driver_checks = DriverChecks(config, kube, driver, cache)
    usage = UsageChecks(config, gpus, kube, served, driver, driver_checks, on_evicted)

    def served_now() -> None:
        usage.wake()  # a best-effort container that borrows memory gets its quota now
        admissions.wake()

    allocator = Allocator(config, inventory.uuids, kube, served, cache=cache, on_served=served_now)
    publisher = Publisher(config, kube, inventory, usage, admissions.tidy)
    return NodeAgent(inventory, served, resizes, cache, allocator, admissions, usage, publisher)


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

    reading = gpu_reader(nvml)

    def utilization(uuid: str) -> int | None:
        read = reading(uuid)
        return None if read is None else round(read.utilization_ratio * 100)

    def driver_holders(uuid: str) -> GpuHolders | None:
        return gpu_holders(uuid) if nvml is not None else None

    def free_memory(uuid: str) -> int | None:
        read = reading(uuid)
        return None if read is None else max(0, read.memory_total_bytes - read.memory_used_bytes)

    registry = CollectorRegistry()
    plugin_metrics = PluginMetrics(registry)
    phases = PhaseWriter(kube)
    agent = compose(
        config,
        gpus,
        kube,
        state,
        pod_cache=lambda on_pods: PodCache(kube, on_pods=on_pods),
        phases=phases,
        sharing=sharing,
        driver=Driver(utilization=utilization, holders=driver_holders, free_memory=free_memory),
        on_resized=plugin_metrics.resizes_followed.inc,
        on_evicted=plugin_metrics.best_effort_evictions.inc,
    )
    cache = agent.cache
    assert cache is not None  # made above
    registry.register(
        AgentCollector(
            config.node_name,
            agent.inventory.inventory,
            reading,
            state,
            measured=agent.usage.measured_usage,
        )
    )
    if report is not None:
        running = mps_daemon_gauge(registry)
        running.set(0 if report.check() is None else 1)
        report.on_change = lambda pid: running.set(0 if pid is None else 1)
    metrics = config.metrics
    metrics_server = serve_metrics(
        metrics.address,
        metrics.port,
        registry,
        scrape_authorizer(kube.post_review) if metrics.authorization else None,
    )

    inventory = agent.inventory
    # The publisher starts once the kubelet has the agent registered (a heartbeat says pods may be
    # placed here, and the kubelet fails a pod it admits with no plugin to call) and ends at the
    # signal; the rest once the agent has handed over (deviceplugin.handover).
    registered = threading.Event()
    halt = threading.Event()
    publisher = threading.Thread(
        target=_publish_once_registered, args=(agent.publisher, registered, stop), name="publisher"
    )
    threads = [
        threading.Thread(target=cache.run, args=(halt,), name="pods"),
        threading.Thread(target=phases.run, args=(halt,), name="phases"),
        threading.Thread(
            target=run_registration,
            args=(inventory, agent.allocator, config, plugin_metrics, halt),
            kwargs={"registered": registered},
            name="kubelet",
        ),
        publisher,
        threading.Thread(target=agent.admissions.run, args=(halt,), name="admissions"),
        threading.Thread(target=agent.usage.run, args=(halt,), name="usage"),
    ]
    threads += health_threads(nvml, inventory, halt)
    if report is not None:
        threads.append(threading.Thread(target=report.watch, args=(halt,), name="mps"))
    for thread in threads:
        thread.start()
    try:
        stop.wait()
        inventory.wake()
        publisher.join()
        hand_over(agent.publisher.withdraw, lambda: _allocating(cache, config.keys))
    finally:
        stop.set()
        halt.set()
        inventory.wake()
        agent.usage.wake()
        cache.interrupt()
        phases.wake()
        for thread in threads:
            thread.join()
        metrics_server.shutdown()
        kube.close()
        if nvml is not None:
            nvml.close()
        log.info("stopped")


def _publish_once_registered(
    publisher: Publisher, registered: threading.Event, stop: threading.Event
) -> None:
    while not registered.wait(0.5):
        if stop.is_set():
            return
    publisher.run(stop)


def _allocating(cache: PodCache, keys: ContractKeys) -> int:
    """The pods bound here that the kubelet has not had Allocate for yet."""
    return sum(is_allocating(p.annotations.get(keys.allocation_phase)) for p in cache.pending_pods() or [])


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(argv)
    return serve_holding_node(config.state_dir, "device plugin", lambda stop: run(config, stop))


if __name__ == "__main__":
    sys.exit(main())
