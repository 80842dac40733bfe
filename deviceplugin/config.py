"""The node agent's settings, from flags with environment variables as defaults."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from hook.limits import MAX_SHORTFALL_WAIT_MS
from nodeagent.flags import (
    MetricsSettings,
    add_health_poll_flag,
    add_hook_library_flag,
    add_metrics_flags,
    add_node_flags,
    metrics_settings,
    node_keys,
)
from tessera.cliargs import (
    add_inflight_timeout,
    non_negative_int,
    positive_int,
    seconds,
)
from tessera.contract import (
    MAX_CORES,
    ContractError,
    ContractKeys,
    DeviceListStrategy,
    SharingMode,
    parse_sharing_mode,
)

DEFAULT_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")
DEFAULT_POD_RESOURCES_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
KUBELET_SOCKET = "kubelet.sock"
# What the agent does with a pod its driver's word shows over its memory quota (deviceplugin/driveruse.py).
OVER_QUOTA_STOP, OVER_QUOTA_REPORT = "stop", "report"
DEFAULT_MPS_CONTROL = "nvidia-cuda-mps-control"


@dataclass(frozen=True, slots=True)
class Config:
    node_name: str
    plugin_dir: Path
    split: int
    keys: ContractKeys
    # Host paths. The agent sees them at the same paths (the DaemonSet mounts them so).
    hook_library: Path
    state_dir: Path
    metrics: MetricsSettings
    kubeconfig: Path | None
    heartbeat_seconds: float
    health_poll_seconds: float
    inflight_timeout: timedelta
    pod_resources_socket: Path
    # Best-effort pods that borrow memory (docs/deviceplugin.md "Oversubscribed best-effort pods").
    usage_tick_seconds: float = 0.1
    oversubscription_margin_mib: int = 512
    shortfall_wait_seconds: float = 30.0
    eviction_grace_seconds: int = 5
    # The node's measured use is published at most this often, and sooner than a heartbeat only when
    # a GPU's use moved by this much.
    usage_publish_seconds: float = 5.0
    usage_change_mib: int = 256
    # A pod over its memory quota by NVML for this long is stopped (its processes on the GPU killed),
    # or only reported.
    over_quota_action: str = OVER_QUOTA_STOP
    over_quota_grace_seconds: float = 5.0
    # How a container's GPUs are named to the NVIDIA container toolkit (docs/install.md).
    device_list_strategy: DeviceListStrategy = DeviceListStrategy.ENVVAR
    # MPS mode (docs/deviceplugin.md "MPS mode"): the mode of a node without the sharing label, the
    # best-effort containers' share of each GPU's threads, and the MPS control program.
    sharing: SharingMode = SharingMode.TIMESLICE
    mps_best_effort_threads: int = 50
    mps_control: str = DEFAULT_MPS_CONTROL
    # How long the agent waits at start for the daemon (tessera-mps-control's) before it registers.
    mps_wait_seconds: float = 30.0

    @property
    def kubelet_socket(self) -> Path:
        return self.plugin_dir / KUBELET_SOCKET

    @property
    def endpoint(self) -> str:
        """The plugin's socket file name in the plugin dir."""
        return f"{self.keys.domain}-vgpu.sock"

    @property
    def plugin_socket(self) -> Path:
        return self.plugin_dir / self.endpoint


def add_sharing_flags(p: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """How the node's GPUs are shared without the node's label, and the MPS control program: the
    agent's and tessera-mps-control's, which must agree."""
    env = environ.get
    p.add_argument(
        "--sharing",
        type=sharing_mode_arg,
        default=env("TESSERA_SHARING", SharingMode.TIMESLICE.value),
        help="how the node's GPUs are shared when its Node has no <domain>/sharing label: timeslice "
        "(contexts of their own) or mps (clients of one MPS control daemon); the label, when set, "
        "decides (env TESSERA_SHARING, default %(default)s)",
    )
    p.add_argument(
        "--mps-control",
        default=env("TESSERA_MPS_CONTROL", DEFAULT_MPS_CONTROL),
        help="in MPS mode, the MPS control program that runs as the node's daemon (tessera-mps-control "
        "starts it; the agent checks that a process of this program runs; env TESSERA_MPS_CONTROL, "
        "default %(default)s)",
    )


def parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    env = environ.get
    p = argparse.ArgumentParser(
        prog="tessera-device-plugin",
        description="Tessera node agent: advertises GPU slices to the kubelet, publishes the node's GPU "
        "inventory, answers Allocate with the scheduler's choice and exports metrics.",
    )
    add_node_flags(p, environ)
    add_hook_library_flag(p, environ)
    add_sharing_flags(p, environ)
    p.add_argument(
        "--plugin-dir",
        type=Path,
        default=Path(env("TESSERA_PLUGIN_DIR", str(DEFAULT_PLUGIN_DIR))),
        help="kubelet device plugin dir (env TESSERA_PLUGIN_DIR)",
    )
    p.add_argument(
        "--split",
        type=positive_int,
        default=env("TESSERA_SPLIT", "10"),
        help="slices advertised per GPU (env TESSERA_SPLIT, default 10)",
    )
    add_metrics_flags(p, environ)
    p.add_argument(
        "--heartbeat-seconds",
        type=seconds,
        default=env("TESSERA_HEARTBEAT_SECONDS", "30"),
        help="how often the node annotations are refreshed (default 30)",
    )
    add_health_poll_flag(p, environ)
    add_inflight_timeout(p, environ)
    p.add_argument(
        "--pod-resources-socket",
        type=Path,
        default=Path(env("TESSERA_POD_RESOURCES_SOCKET", str(DEFAULT_POD_RESOURCES_SOCKET))),
        help="the kubelet's pod-resources socket, to confirm which pod each container belongs to "
        "(env TESSERA_POD_RESOURCES_SOCKET)",
    )
    p.add_argument(
        "--usage-tick-seconds",
        type=seconds,
        default=env("TESSERA_USAGE_TICK_SECONDS", "0.1"),
        help="how often the containers' memory use is read and the quotas of best-effort containers "
        "that borrow memory recomputed (env TESSERA_USAGE_TICK_SECONDS, default %(default)s)",
    )
    p.add_argument(
        "--oversubscription-margin-mib",
        type=non_negative_int,
        default=env("TESSERA_OVERSUBSCRIPTION_MARGIN_MIB", "512"),
        help="GPU memory left free by a best-effort container that borrows memory: its quota is at most "
        "the GPU's memory minus the others' use minus this (env TESSERA_OVERSUBSCRIPTION_MARGIN_MIB, "
        "default %(default)s)",
    )
    p.add_argument(
        "--shortfall-wait-seconds",
        type=seconds,
        default=env("TESSERA_SHORTFALL_WAIT_SECONDS", "30"),
        help="how long a guaranteed allocation the driver refuses for lack of memory waits for best-effort "
        "pods that borrow it to be evicted (env TESSERA_SHORTFALL_WAIT_SECONDS, default %(default)s; at "
        "most 600)",
    )
    p.add_argument(
        "--eviction-grace-seconds",
        type=non_negative_int,
        default=env("TESSERA_EVICTION_GRACE_SECONDS", "5"),
        help="grace period of a best-effort pod deleted to give memory back (env "
        "TESSERA_EVICTION_GRACE_SECONDS, default %(default)s; keep it well under the shortfall wait)",
    )
    p.add_argument(
        "--usage-publish-seconds",
        type=seconds,
        default=env("TESSERA_USAGE_PUBLISH_SECONDS", "5"),
        help="the node's measured GPU use is patched at most this often (env TESSERA_USAGE_PUBLISH_SECONDS, "
        "default %(default)s)",
    )
    p.add_argument(
        "--usage-change-mib",
        type=positive_int,
        default=env("TESSERA_USAGE_CHANGE_MIB", "256"),
        help="a GPU's measured use is patched before the next heartbeat only once it moved by this much "
        "(env TESSERA_USAGE_CHANGE_MIB, default %(default)s)",
    )
    p.add_argument(
        "--mps-best-effort-threads",
        type=_threads,
        default=env("TESSERA_MPS_BEST_EFFORT_THREADS", "50"),
        help="in MPS mode, the percent of each GPU's threads a best-effort container's kernels may use, "
        "1-100 (env TESSERA_MPS_BEST_EFFORT_THREADS, default %(default)s)",
    )
    p.add_argument(
        "--mps-wait-seconds",
        type=seconds,
        default=env("TESSERA_MPS_WAIT_SECONDS", "30"),
        help="in MPS mode, how long the agent waits at start for the node's MPS control daemon before "
        "it registers with the kubelet anyway (env TESSERA_MPS_WAIT_SECONDS, default %(default)s)",
    )
    p.add_argument(
        "--over-quota-action",
        choices=(OVER_QUOTA_STOP, OVER_QUOTA_REPORT),
        default=env("TESSERA_OVER_QUOTA_ACTION", OVER_QUOTA_STOP),
        help="a pod whose processes hold more of a GPU than its quotas allow, by NVML, for the grace "
        "period: stop its processes on that GPU (with an event), or only report it (env "
        "TESSERA_OVER_QUOTA_ACTION, default %(default)s)",
    )
    p.add_argument(
        "--over-quota-grace-seconds",
        type=seconds,
        default=env("TESSERA_OVER_QUOTA_GRACE_SECONDS", "5"),
        help="how long a pod may stay over its memory quota by NVML before it is stopped (env "
        "TESSERA_OVER_QUOTA_GRACE_SECONDS, default %(default)s)",
    )
    p.add_argument(
        "--device-list-strategy",
        type=DeviceListStrategy,
        choices=list(DeviceListStrategy),
        default=env("TESSERA_DEVICE_LIST_STRATEGY", DeviceListStrategy.ENVVAR.value),
        help="how a container's GPUs are named to the NVIDIA container toolkit: envvar "
        "(NVIDIA_VISIBLE_DEVICES) or volume-mounts (what a toolkit that ignores that variable from "
        "unprivileged containers honours; env TESSERA_DEVICE_LIST_STRATEGY, default %(default)s)",
    )
    return p


def sharing_mode_arg(text: str) -> SharingMode:
    try:
        return parse_sharing_mode(text, source="sharing mode")
    except ContractError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _threads(text: str) -> int:
    value = positive_int(text)
    if value > MAX_CORES:
        raise argparse.ArgumentTypeError(f"{text!r} is outside 1..{MAX_CORES}")
    return value


def parse_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> Config:
    """Settings from ``argv`` and ``environ``; exits with a message naming the flag on bad input."""
    environ = os.environ if environ is None else environ
    p = parser(environ)
    args = p.parse_args(argv)
    keys = node_keys(p, args)
    if args.shortfall_wait_seconds * 1000 > MAX_SHORTFALL_WAIT_MS:
        wait = args.shortfall_wait_seconds
        p.error(f"--shortfall-wait-seconds: {wait:g} is more than {MAX_SHORTFALL_WAIT_MS // 1000}")
    if args.eviction_grace_seconds >= args.shortfall_wait_seconds:
        p.error(
            f"--eviction-grace-seconds: {args.eviction_grace_seconds} must be less than "
            f"--shortfall-wait-seconds ({args.shortfall_wait_seconds:g}): an evicted pod's memory must "
            "come back before the wait ends"
        )
    return Config(
        node_name=args.node_name,
        plugin_dir=args.plugin_dir,
        split=args.split,
        keys=keys,
        hook_library=args.hook_library,
        state_dir=args.state_dir,
        metrics=metrics_settings(args),
        kubeconfig=args.kubeconfig,
        heartbeat_seconds=args.heartbeat_seconds,
        health_poll_seconds=args.health_poll_seconds,
        inflight_timeout=timedelta(seconds=args.inflight_timeout),
        pod_resources_socket=args.pod_resources_socket,
        usage_tick_seconds=args.usage_tick_seconds,
        oversubscription_margin_mib=args.oversubscription_margin_mib,
        shortfall_wait_seconds=args.shortfall_wait_seconds,
        eviction_grace_seconds=args.eviction_grace_seconds,
        usage_publish_seconds=args.usage_publish_seconds,
        usage_change_mib=args.usage_change_mib,
        over_quota_action=args.over_quota_action,
        over_quota_grace_seconds=args.over_quota_grace_seconds,
        device_list_strategy=args.device_list_strategy,
        sharing=args.sharing,
        mps_best_effort_threads=args.mps_best_effort_threads,
        mps_control=args.mps_control,
        mps_wait_seconds=args.mps_wait_seconds,
    )
