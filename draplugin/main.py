"""``tessera-dra``: the DRA driver. Discovers the GPUs through NVML, publishes them as the node's
ResourceSlice (republished, with device taints, as their health changes), registers with the kubelet,
serves NodePrepareResources / NodeUnprepareResources and the prepared claims' series on /metrics until
SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.registry import CollectorRegistry

from draplugin.driver import Driver
from draplugin.health import HealthPublisher
from draplugin.kube import TIMEOUT, PodApi, ResourceApi, SlicePublisher
from draplugin.metrics import ClaimCollector
from draplugin.server import serve_driver
from draplugin.slices import resource_slice
from nodeagent.flags import (
    MetricsSettings,
    add_health_poll_flag,
    add_hook_library_flag,
    add_metrics_flags,
    add_node_flags,
    metrics_settings,
    node_keys,
)
from nodeagent.health import HealthBook, health_threads
from nodeagent.kubeapi import load_api, post_review
from nodeagent.metricsserver import scrape_authorizer, serve_metrics
from nodeagent.nodelock import serve_holding_node
from nodeagent.nvml import discover_gpus, gpu_reader
from nodeagent.statedir import StateDir
from tessera.cliargs import add_qos_class_flags, add_speed_profiles, qos_thresholds, seconds
from tessera.contract import ContractError, ContractKeys
from tessera.placement.qos import QosThresholds
from tessera.placement.speed import SpeedProfiles

log = logging.getLogger("tessera-dra")

DEFAULT_KUBELET_DIR = Path("/var/lib/kubelet")
DEFAULT_CDI_DIR = Path("/var/run/cdi")


@dataclass(frozen=True, slots=True)
class Config:
    node_name: str
    keys: ContractKeys
    kubelet_dir: Path
    cdi_dir: Path
    hook_library: Path
    state_dir: Path
    kubeconfig: Path | None
    profiles: SpeedProfiles
    resync_seconds: float
    health_poll_seconds: float
    qos: QosThresholds
    metrics: MetricsSettings

    @property
    def dra_socket(self) -> Path:
        return self.kubelet_dir / "plugins" / self.keys.dra_driver / "dra.sock"

    @property
    def registration_socket(self) -> Path:
        return self.kubelet_dir / "plugins_registry" / f"{self.keys.dra_driver}-reg.sock"


def parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    env = environ.get
    p = argparse.ArgumentParser(
        prog="tessera-dra",
        description="Tessera DRA driver: GPUs as devices whose memory and compute several claims share, "
        "each claim's share enforced by the hook.",
    )
    add_node_flags(p, environ)
    add_hook_library_flag(p, environ)
    p.add_argument(
        "--kubelet-dir",
        type=Path,
        default=Path(env("TESSERA_KUBELET_DIR", str(DEFAULT_KUBELET_DIR))),
        help="the kubelet's root dir, holding plugins/ and plugins_registry/ (env TESSERA_KUBELET_DIR)",
    )
    p.add_argument(
        "--cdi-dir",
        type=Path,
        default=Path(env("TESSERA_CDI_DIR", str(DEFAULT_CDI_DIR))),
        help="where the container runtime reads CDI specs (env TESSERA_CDI_DIR, default /var/run/cdi)",
    )
    add_metrics_flags(p, environ)
    add_speed_profiles(p, environ)
    add_qos_class_flags(p)
    p.add_argument(
        "--resync-seconds",
        type=seconds,
        default=env("TESSERA_RESYNC_SECONDS", "30"),
        help="how often the ResourceSlice is checked and repaired (default 30)",
    )
    add_health_poll_flag(p, environ)
    return p


def parse_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> Config:
    """Settings from flags, environment variables as defaults; exits naming the flag on bad input."""
    p = parser(os.environ if environ is None else environ)
    args = p.parse_args(argv)
    keys = node_keys(p, args)
    profiles = SpeedProfiles()
    if args.speed_profiles is not None:
        try:
            profiles = SpeedProfiles.from_yaml(args.speed_profiles.read_text())
        except (OSError, ContractError) as e:
            p.error(f"--speed-profiles: {e}")
    try:
        qos = qos_thresholds(args)
    except ValueError as e:
        p.error(str(e))
    return Config(
        node_name=args.node_name,
        keys=keys,
        kubelet_dir=args.kubelet_dir,
        cdi_dir=args.cdi_dir,
        hook_library=args.hook_library,
        state_dir=args.state_dir,
        kubeconfig=args.kubeconfig,
        profiles=profiles,
        resync_seconds=args.resync_seconds,
        health_poll_seconds=args.health_poll_seconds,
        qos=qos,
        metrics=metrics_settings(args),
    )


def run(config: Config, stop: threading.Event) -> None:
    state = StateDir(config.state_dir)
    state.prepare()
    nvml, gpus = discover_gpus(1)
    book = HealthBook((g.uuid for g in gpus), config.health_poll_seconds)
    api = load_api(config.kubeconfig)
    resources = ResourceApi(api)
    driver = Driver(
        keys=config.keys,
        node=config.node_name,
        gpus=gpus,
        state=state,
        cdi_dir=config.cdi_dir,
        hook_library=config.hook_library,
        claims=resources,
        pods=PodApi(api, config.node_name),
        qos=config.qos,
    )
    publisher = SlicePublisher(
        resources,
        config.keys,
        lambda generation: resource_slice(
            config.node_name, gpus, config.profiles, generation, config.keys, health=book.state()
        ),
    )
    publishing = HealthPublisher(book, gpus, config.keys, publisher, driver.tell_pods_on)
    registry = CollectorRegistry()
    registry.register(
        ClaimCollector(
            config.node_name,
            gpus,
            state,
            health=book.state,
            reading=gpu_reader(nvml),
        )
    )
    metrics = config.metrics
    authorize = scrape_authorizer(lambda review: post_review(api, review, TIMEOUT))
    metrics_server = serve_metrics(
        metrics.address, metrics.port, registry, authorize if metrics.authorization else None
    )
    servers = serve_driver(driver, config.dra_socket, config.registration_socket)
    log.info(
        "serving %s on %s, registration on %s",
        config.keys.dra_driver,
        config.dra_socket,
        config.registration_socket,
    )
    threads = [
        threading.Thread(target=publishing.run, args=(stop, config.resync_seconds), name="slices"),
        *health_threads(nvml, book, stop),
    ]
    for thread in threads:
        thread.start()
    try:
        stop.wait()
    finally:
        stop.set()
        book.wake()
        for thread in threads:
            thread.join()
        servers.stop()
        metrics_server.shutdown()
        if nvml is not None:
            nvml.close()
        log.info("stopped")


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(argv)
    return serve_holding_node(config.state_dir, "DRA driver", lambda stop: run(config, stop))


if __name__ == "__main__":
    sys.exit(main())
