"""Publishing on the Node: the inventory (when it changed), the measured use (when worth it) and the
heartbeat; the same loop runs the clean-up every few seconds (docs/deviceplugin.md "API side")."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from deviceplugin.config import Config
from deviceplugin.inventory import Inventory
from deviceplugin.kube import Kube
from deviceplugin.oversubscription import usage_worth_publishing
from deviceplugin.usage import UsageChecks
from nodeagent.statedir import ContainerDir
from tessera.contract import GpuUsage, dump_gpu_usage, dump_inventory, format_time, now

log = logging.getLogger(__name__)

# How often served records are checked against the kubelet and dead containers' state removed.
TIDY_SECONDS = 5.0
# A GPU's utilisation published before the next heartbeat once it moved by this many points.
USAGE_CHANGE_PERCENT = 10


class Publisher:
    def __init__(
        self,
        config: Config,
        kube: Kube,
        inventory: Inventory,
        usage: UsageChecks,
        tidy: Callable[[], None],
    ) -> None:
        """``tidy``: the clean-up (:meth:`deviceplugin.admissions.Admissions.tidy`)."""
        self._config = config
        self._kube = kube
        self._inventory = inventory
        self._usage = usage
        self._tidy = tidy
        # What the last patch said; only the publisher's thread touches these.
        self._published_inventory: str | None = None
        self._published_usage: tuple[GpuUsage, ...] | None = None
        self._published_measured: frozenset[ContainerDir] = frozenset()
        self._usage_published_at = 0.0

    def publish(self, *, heartbeat: bool) -> bool:
        """Patch the node's inventory (when it changed) and heartbeat (when due); True if patched."""
        keys = self._config.keys
        if self._published_inventory is None:
            self._published_inventory = self._kube.node_annotations().get(keys.node_gpus)
        inventory = dump_inventory(self._inventory.inventory())
        patch = {}
        if inventory != self._published_inventory:
            patch[keys.node_gpus] = inventory
        usage, measured = self._usage.latest()
        if usage is not None and usage_worth_publishing(
            self._published_usage,
            usage.gpus,
            change_mib=self._config.usage_change_mib,
            change_percent=USAGE_CHANGE_PERCENT,
            since_published=time.monotonic() - self._usage_published_at,
            min_interval=self._config.usage_publish_seconds,
            max_interval=self._config.heartbeat_seconds,
            newly_measured=bool(measured - self._published_measured),
        ):
            patch[keys.node_gpu_usage] = dump_gpu_usage(usage)
        if heartbeat or patch:
            patch[keys.node_heartbeat] = format_time(now())
        if not patch:
            return False
        self._kube.annotate_node(patch)
        self._published_inventory = inventory
        if keys.node_gpu_usage in patch and usage is not None:
            self._published_usage = usage.gpus
            self._published_measured = measured
            self._usage_published_at = time.monotonic()
        return True

    def withdraw(self) -> None:
        """Remove the node's heartbeat: the extender places no more pods here (deviceplugin.handover)."""
        self._kube.annotate_node({self._config.keys.node_heartbeat: None})

    def run(self, stop: threading.Event) -> None:
        """Publish at once, on every health change, and every heartbeat interval, and tidy every
        :data:`TIDY_SECONDS`, until ``stop``."""
        next_heartbeat = next_tidy = 0.0
        version = -1
        last_error = ""
        while not stop.is_set():
            due = time.monotonic() >= next_heartbeat
            try:
                _, version = self._inventory.devices()
                self.publish(heartbeat=due)
                if due:
                    next_heartbeat = time.monotonic() + self._config.heartbeat_seconds
                if time.monotonic() >= next_tidy:
                    self._tidy()
                    next_tidy = time.monotonic() + TIDY_SECONDS
            except Exception as e:  # the API may be down for a while; keep trying, say so once
                if str(e) != last_error:
                    log.warning("node %s: API call failed (retrying): %s", self._config.node_name, e)
                    last_error = str(e)
                stop.wait(2.0)
                continue
            last_error = ""
            self._inventory.wait_for_change(
                version, timeout=max(0.0, min(1.0, next_heartbeat - time.monotonic()))
            )
