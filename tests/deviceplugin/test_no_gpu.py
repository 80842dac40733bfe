"""A node without NVML advertises nothing, says why in one line, and keeps serving."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

import pytest
from kubernetes import client

from sandbox.kubelet_standin import KubeletStandIn
from tessera.contract import KEYS
from tests.deviceplugin.conftest import PluginProcess

pytestmark = pytest.mark.k8s


def test_without_nvml_no_devices_one_log_line_and_no_crash(
    kubelet: KubeletStandIn,
    kube: client.ApiClient,
    gpu_node: str,
    start_plugin: Callable[..., PluginProcess],
) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "LD_PRELOAD")}
    plugin = start_plugin(gpu_node, env)
    kubelet.wait_for(lambda k: bool(k.registrations and k.registrations[-1].device_lists))
    assert kubelet.devices() == {}
    assert kubelet.current.request.resource_name == KEYS.vgpu
    assert kubelet.current.options.get_preferred_allocation_available

    core = client.CoreV1Api(kube)
    deadline = time.monotonic() + 30
    annotations: dict[str, str] = {}
    while time.monotonic() < deadline and KEYS.node_gpus not in annotations:
        annotations = core.read_node(gpu_node).metadata.annotations or {}
        time.sleep(0.2)
    assert json.loads(annotations[KEYS.node_gpus]) == []
    assert KEYS.node_heartbeat in annotations

    time.sleep(1.5)  # a crash loop would show by now
    assert plugin.process.running
    reasons = [line for line in plugin.log().splitlines() if "no GPUs advertised" in line]
    assert len(reasons) == 1, plugin.log()
    assert "NVML" in reasons[0]
