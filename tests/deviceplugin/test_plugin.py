"""The real ``tessera-device-plugin`` process on fake GPUs (real nvidia-ml-py on the fake NVML),
against the kubelet stand-in and the real API server."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest
from kubernetes import client
from prometheus_client.parser import text_string_to_metric_families

from deviceplugin.mps_daemon import MpsDaemon, mps_paths
from proto.deviceplugin.v1beta1 import api_pb2 as pb
from sandbox.kubelet_standin import KubeletStandIn
from tessera.contract import (
    CONTAINER_COORDINATION_DIR,
    CONTAINER_HOOK_LIBRARY,
    CONTAINER_LD_SO_PRELOAD,
    CONTAINER_LIMITS_DIR,
    CONTAINER_LIMITS_FILE,
    CONTAINER_STATE_DIR,
    COORDINATION_SLOT_BYTES,
    COORDINATION_SLOT_SUFFIX,
    HEALTHY,
    KEYS,
    UNHEALTHY,
    Allocation,
    ContainerAllocation,
    GpuGrant,
    Phase,
    dump_allocation,
    format_time,
    now,
    parse_inventory,
    parse_time,
)
from tests.deviceplugin.conftest import CUCLIENT, HOOK_LIBRARY, FakeGpus, PluginProcess
from tests.scraping import get, service_account_token
from tests.waiting import wait_for

pytestmark = pytest.mark.k8s

MIB = 2**20
Grants = list[tuple[str, int, int]]  # (GPU UUID, MiB, cores)


@dataclass
class Node:
    """A GPU node under test: its name, fake GPUs, kubelet stand-in, API client and a namespace."""

    name: str
    gpus: FakeGpus
    kubelet: KubeletStandIn
    core: client.CoreV1Api
    namespace: str
    start_plugin: Callable[..., PluginProcess]

    def start(self, *flags: str, devices: int = 40, state_dir: Path | None = None) -> PluginProcess:
        """The plugin started and registered, its full list received."""
        plugin = self.start_plugin(
            self.name, self.gpus.env(), f"--hook-library={HOOK_LIBRARY}", *flags, state_dir=state_dir
        )
        self.kubelet.wait_for(lambda k: bool(k.registrations and len(k.devices()) == devices))
        return plugin


@pytest.fixture
def node(  # noqa: PLR0917 (fixtures are injected by name)
    kubelet: KubeletStandIn,
    kube: client.ApiClient,
    namespace: str,
    gpu_node: str,
    fake_gpus: FakeGpus,
    start_plugin: Callable[..., PluginProcess],
) -> Node:
    return Node(gpu_node, fake_gpus, kubelet, client.CoreV1Api(kube), namespace, start_plugin)


def create_pod(
    core: client.CoreV1Api,
    namespace: str,
    name: str,
    node: str,
    containers: dict[str, Grants],
    *,
    annotations: dict[str, str | None] | None = None,
    gpu_counts: dict[str, int] | None = None,
    limits: dict[str, str] | None = None,
) -> Any:
    """A pod bound to ``node`` as the extender leaves it: allocation, phase ``allocating``, bind time.
    ``limits`` are added to each container's."""
    allocation = Allocation(
        node=node,
        containers=tuple(
            ContainerAllocation(
                name=c, gpus=tuple(GpuGrant(uuid=u, memory_quota_mib=m, cores=k) for u, m, k in g)
            )
            for c, g in containers.items()
        ),
    )
    written: dict[str, str | None] = {
        KEYS.allocation: dump_allocation(allocation),
        KEYS.allocation_phase: Phase.ALLOCATING.value,
        KEYS.bind_time: format_time(now()),
    }
    written.update(annotations or {})
    counts = gpu_counts or {c: len(g) for c, g in containers.items()}
    return core.create_namespaced_pod(
        namespace,
        {
            "metadata": {"name": name, "annotations": {k: v for k, v in written.items() if v is not None}},
            "spec": {
                "nodeName": node,
                "containers": [
                    {
                        "name": c,
                        "image": "app",
                        "resources": {"limits": {KEYS.vgpu: str(n), **(limits or {})}},
                    }
                    for c, n in counts.items()
                ],
            },
        },
    )


def phase_of(core: client.CoreV1Api, namespace: str, name: str) -> str | None:
    annotations = core.read_namespaced_pod(name, namespace).metadata.annotations or {}
    return annotations.get(KEYS.allocation_phase)


def node_inventory(core: client.CoreV1Api, node: str) -> str | None:
    annotations: dict[str, str] = core.read_node(node).metadata.annotations or {}
    return annotations.get(KEYS.node_gpus)


def scrape(plugin: PluginProcess) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    status, text = get(f"http://127.0.0.1:{plugin.metrics_port()}/metrics", plugin.reader_token)
    assert status == 200, (status, text)
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def limits_of(response: Any) -> dict[str, tuple[int, int]]:
    """GPU UUID -> (memory bytes, cores) from the limits file the response mounts."""
    (mount,) = [m for m in response.mounts if m.container_path == CONTAINER_LIMITS_DIR]
    limits = Path(mount.host_path) / Path(CONTAINER_LIMITS_FILE).relative_to(CONTAINER_LIMITS_DIR)
    found = re.findall(r"^device (\S+) memory (\d+) cores (\d+)$", limits.read_text(), re.M)
    return {u: (int(m), int(c)) for u, m, c in found}


# --------------------------------------------------------------------------------------------------


def test_registers_and_advertises_every_slice_and_the_inventory(node: Node) -> None:
    kubelet = node.kubelet
    gpu_node = node.name
    fake_gpus = node.gpus
    core = node.core
    plugin = node.start()
    registration = kubelet.current
    assert registration.request.version == "v1beta1"
    assert registration.request.resource_name == KEYS.vgpu
    assert "/" not in registration.request.endpoint
    assert (kubelet.plugin_dir / registration.request.endpoint).is_socket()
    assert registration.options.get_preferred_allocation_available
    assert not registration.options.pre_start_required

    devices = kubelet.devices()
    assert sorted(devices) == sorted(f"{u}::{n}" for u in fake_gpus.uuids for n in range(10))
    assert set(devices.values()) == {HEALTHY}
    # Each slice carries its GPU's NUMA node, for the kubelet's topology manager.
    stream = registration.stub.ListAndWatch(pb.Empty(), timeout=30)
    first_list = next(stream)
    stream.cancel()
    numa = {d.ID.split("::")[0]: [n.ID for n in d.topology.nodes] for d in first_list.devices}
    assert numa == {u: [i // 2] for i, u in enumerate(fake_gpus.uuids)}

    text = wait_for(lambda: node_inventory(core, gpu_node), what="inventory annotation")
    inventory = parse_inventory(text)
    assert [g.uuid for g in inventory] == fake_gpus.uuids
    first = inventory[0]
    assert (first.model, first.total_memory_mib, first.sm_count, first.compute_capability) == (
        "NVIDIA A100-SXM4-40GB",
        40960,
        108,
        "8.0",
    )
    assert [g.pci_bus_id for g in inventory] == [f"0000{s.pci_bus_id.upper()}" for s in fake_gpus.specs]
    assert [g.numa_node for g in inventory] == [0, 0, 1, 1]
    assert [g.nvlink_peers for g in inventory] == [(fake_gpus.uuids[i ^ 1],) for i in range(4)]
    assert {g.split for g in inventory} == {10}
    heartbeat = core.read_node(gpu_node).metadata.annotations[KEYS.node_heartbeat]
    assert abs((now() - parse_time(heartbeat, field="heartbeat")).total_seconds()) < 120
    assert scrape(plugin)["tessera_device_plugin_registered", frozenset()] == 1


def test_metrics_are_served_only_to_a_token_the_api_server_allows_get_on_metrics(
    node: Node, kube: client.ApiClient
) -> None:
    """Its series name every namespace's pods: a tenant's pod reaching the port reads nothing, with no
    token, a made-up one, or its own service account's; Prometheus's (bound to get /metrics) reads."""
    plugin = node.start()
    url = f"http://127.0.0.1:{plugin.metrics_port()}/metrics"
    status, body = get(url, None)
    assert status == 401 and "needs a bearer token" in body
    assert get(url, "made-up")[0] == 401
    tenant = service_account_token(kube, "tenant", reader=False, namespace=node.namespace)
    status, body = get(url, tenant)
    assert (status, body.strip()) == (
        403,
        f"system:serviceaccount:{node.namespace}:tenant may not get /metrics",
    )
    status, body = get(url, plugin.reader_token)
    assert status == 200 and "tessera_device_plugin_registered 1.0" in body


def test_xid_and_lost_gpus_turn_their_slices_unhealthy_until_they_recover(node: Node) -> None:
    kubelet = node.kubelet
    gpu_node = node.name
    fake_gpus = node.gpus
    core = node.core
    sick, other = fake_gpus.uuids[2], fake_gpus.uuids[3]

    def unhealthy() -> set[str]:
        return {d for d, h in kubelet.devices().items() if h != HEALTHY}

    plugin = node.start()
    wait_for(lambda: "watching XID events of 4 GPU(s)" in plugin.log(), what="XID watch")
    fake_gpus.inject_xid(3, 13)  # the application's fault: the GPU stays healthy
    fake_gpus.inject_xid(2, 79)  # fallen off the bus: critical
    kubelet.wait_for(lambda k: unhealthy() == {f"{sick}::{n}" for n in range(10)})
    assert {d for d, h in kubelet.devices().items() if d.startswith(other)} and not any(
        d.startswith(other) for d in unhealthy()
    )
    assert all(h == UNHEALTHY for d, h in kubelet.devices().items() if d.startswith(sick))
    wait_for(
        lambda: (
            [g.health for g in parse_inventory(node_inventory(core, gpu_node) or "[]")]
            == [HEALTHY, HEALTHY, UNHEALTHY, HEALTHY]
        ),
        what="inventory health",
    )

    # A vanished GPU turns unhealthy, and healthy again when it is back.
    fake_gpus.set_lost(0, True)
    kubelet.wait_for(lambda k: len(unhealthy()) == 20)
    fake_gpus.set_lost(0, False)
    kubelet.wait_for(lambda k: unhealthy() == {f"{sick}::{n}" for n in range(10)})
    # The XID-faulted GPU recovers once it was reset (gone and back).
    fake_gpus.set_lost(2, True)
    wait_for(lambda: f"GPU {sick}: gone, now Unhealthy" in plugin.log(), what="GPU 2 seen gone")
    fake_gpus.set_lost(2, False)
    kubelet.wait_for(lambda k: not unhealthy())
    assert len(kubelet.devices()) == 40


def test_kubelet_restart_leads_to_a_new_registration_within_5s(node: Node) -> None:
    kubelet = node.kubelet
    node.start()
    for _ in range(3):
        before = len(kubelet.registrations)
        old = kubelet.current
        restarted_at = kubelet.restart()  # deletes every socket, serves a new kubelet.sock
        kubelet.wait_for(lambda k: len(k.registrations) > before, timeout=5.0)  # noqa: B023
        assert kubelet.current.at - restarted_at < 5.0
        kubelet.wait_for(lambda k: len(k.devices()) == 40)
        kubelet.wait_for(lambda k: old.stream_ended)  # noqa: B023 (the old server was stopped)
    # The plugin's own socket deleted while the kubelet stays: a fresh server and registration.
    before = len(kubelet.registrations)
    (kubelet.plugin_dir / kubelet.current.request.endpoint).unlink()
    kubelet.wait_for(lambda k: len(k.registrations) > before, timeout=5.0)
    kubelet.wait_for(lambda k: len(k.devices()) == 40)


# A mount namespace for the "container", in a user namespace so that mounting needs no root.
NAMESPACES = ("unshare", "--user", "--map-root-user", "--mount", "--propagation", "private")


def start_in_container(response: Any, argv: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    """Starts ``argv`` as a container would see the Allocate answer: in a private mount namespace with
    the answer's mounts under /run (read-only where the answer says so), its environment, and the
    hook preloaded from the answer's host library path."""
    script = ["set -e", "mount -t tmpfs tessera-run /run"]
    for m in response.mounts:
        if not m.container_path.startswith("/var/run/"):
            continue
        target = "/run/" + m.container_path.removeprefix("/var/run/")
        make = (
            f"mkdir -p {target}"
            if Path(m.host_path).is_dir()
            else f"mkdir -p $(dirname {target}); touch {target}"
        )
        script += [make, f"mount --bind {m.host_path} {target}"]
        if m.read_only:
            script.append(f"mount -o remount,bind,ro {target}")
    (library,) = [m.host_path for m in response.mounts if m.container_path == CONTAINER_HOOK_LIBRARY]
    script.append(f'LD_PRELOAD={library} exec "$@"')
    return subprocess.Popen(
        [*NAMESPACES, "sh", "-c", "\n".join(script), "container", *argv],
        env={**env, **dict(response.envs)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def run_in_container(response: Any, argv: list[str], env: dict[str, str], timeout: float = 120) -> str:
    process = start_in_container(response, argv, env)
    try:
        out, err = process.communicate(timeout=timeout)
    finally:
        stop(process)
    assert process.returncode == 0, f"{argv} failed ({process.returncode}):\n{out}{err}"
    return out


def stop(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


def test_allocate_gives_exactly_the_annotated_gpu_and_quota_and_the_hook_enforces_it(node: Node) -> None:
    kubelet = node.kubelet
    gpu_node = node.name
    fake_gpus = node.gpus
    core = node.core
    namespace = node.namespace
    plugin = node.start()
    gpu_x = fake_gpus.uuids[2]
    pod = create_pod(core, namespace, "trainer", gpu_node, {"main": [(gpu_x, 4096, 30)]})

    assert kubelet.preferred(sorted(kubelet.devices()), [], 1)[0].startswith(f"{gpu_x}::")
    chosen, answer = kubelet.admit_container(1)
    (response,) = answer.container_responses
    assert chosen[0].startswith(f"{gpu_x}::")
    assert dict(response.envs) == {"NVIDIA_VISIBLE_DEVICES": gpu_x}
    assert limits_of(response) == {gpu_x: (4096 * MIB, 30)}
    mounts = {m.container_path: (m.host_path, m.read_only) for m in response.mounts}
    container_dir = plugin.state_dir / "containers" / pod.metadata.uid / "main"
    area = plugin.state_dir / "coordination" / gpu_x
    slot = area / "standard" / f"{pod.metadata.uid}_main"
    assert mounts == {
        CONTAINER_LIMITS_DIR: (str(container_dir / "limits.d"), True),
        CONTAINER_STATE_DIR: (str(container_dir / "state"), False),
        CONTAINER_HOOK_LIBRARY: (str(HOOK_LIBRARY), True),
        CONTAINER_LD_SO_PRELOAD: (str(plugin.state_dir / "ld.so.preload"), True),
        f"{CONTAINER_COORDINATION_DIR}/{gpu_x}": (str(area), True),
        f"{CONTAINER_COORDINATION_DIR}/{gpu_x}{COORDINATION_SLOT_SUFFIX}": (str(slot), False),
    }
    assert Path(mounts[CONTAINER_LD_SO_PRELOAD][0]).read_text().strip() == CONTAINER_HOOK_LIBRARY
    # Written right after the answer (docs/deviceplugin.md "Allocate from the pod cache").
    wait_for(lambda: phase_of(core, namespace, "trainer") == Phase.ALLOCATED, what="phase allocated")

    # The hook in the "container" reads the mounted limits: 4096 MiB on a 40 GiB GPU.
    out = run_in_container(
        response,
        [str(CUCLIENT), "info", "alloc", "mem", "1g", "4", "alloc", "mem", "1m", "1"],
        fake_gpus.env(),
    )
    assert f"total={4096 * MIB}" in out
    results = re.findall(r"^alloc kind=mem size=\d+ index=\d+ result=(\S+)$", out, re.M)
    assert results == ["CUDA_SUCCESS"] * 4 + ["CUDA_ERROR_OUT_OF_MEMORY"], out

    # Its launches are published in its own slot, through the one writable mount of it; the GPU's
    # coordination area, every other container's slot with it, is read-only to it.
    assert slot.read_bytes() == bytes(COORDINATION_SLOT_BYTES)
    run_in_container(response, [str(CUCLIENT), "launch", "sleep_us_1000", "1", "20", "sync"], fake_gpus.env())
    assert slot.read_bytes() != bytes(COORDINATION_SLOT_BYTES)
    refused = run_in_container(
        response,
        ["sh", "-c", f"touch {CONTAINER_COORDINATION_DIR}/{gpu_x}/standard/other 2>&1 || echo refused"],
        fake_gpus.env(),
    )
    assert refused.strip().endswith("refused"), refused

    # The agent's metrics: quotas from its record, GPU figures from NVML.
    model = "NVIDIA A100-SXM4-40GB"
    # dcgm-exporter's label names for the node, the GPU and its model (docs/observability.md).
    gpu_labels = frozenset({"Hostname": gpu_node, "UUID": gpu_x, "modelName": model}.items())
    labels = gpu_labels | frozenset(
        {"namespace": namespace, "pod": "trainer", "container": "main", "claim": ""}.items()
    )
    holder = start_in_container(response, [str(CUCLIENT), "alloc", "mem", "1g", "3", "hold"], fake_gpus.env())
    try:
        assert holder.stdout is not None
        while (line := holder.stdout.readline()) and line.strip() != "hold ready":
            assert "CUDA_SUCCESS" in line, line
        assert line.strip() == "hold ready", holder.stderr.read() if holder.stderr else ""
        metrics = scrape(plugin)
    finally:
        stop(holder)
    assert metrics["tessera_container_memory_used_bytes", labels] == 3 * 2**30
    assert metrics["tessera_container_memory_quota_bytes", labels] == 4096 * MIB
    assert metrics["tessera_container_compute_quota_ratio", labels] == 0.3
    assert metrics["tessera_gpu_memory_total_bytes", gpu_labels] == 40 * 2**30
    assert metrics["tessera_gpu_memory_capacity_bytes", gpu_labels] == 40 * 2**30
    assert metrics["tessera_gpu_healthy", gpu_labels] == 1
    # What is allocated on the GPU against its capacity: this container's quotas, one slice.
    assert metrics["tessera_gpu_memory_allocated_bytes", gpu_labels] == 4096 * MIB
    assert metrics["tessera_gpu_cores_allocated_ratio", gpu_labels] == 0.3
    assert metrics["tessera_gpu_slices_used", gpu_labels] == 1


def test_twenty_pods_bound_at_once_each_get_their_own_gpus_and_quotas(node: Node) -> None:
    kubelet = node.kubelet
    gpu_node = node.name
    fake_gpus = node.gpus
    core = node.core
    namespace = node.namespace
    """20 pods in flight on one node under the rule (per GPU count, one key across pods; one pod's
    containers may differ), admitted in a shuffled order, containers in spec order."""
    node.start("--split=20", devices=80)
    g = fake_gpus.uuids
    shapes: list[dict[str, Grants]] = (
        [{"main": [(g[0], 2048, 10)]}] * 6
        + [{"main": [(g[1], 1024, 5), (g[2], 1024, 5)]}] * 5
        + [{"x": [(g[0], 2048, 10)], "y": [(g[1], 512, 5), (g[2], 512, 5), (g[3], 512, 5)]}] * 4
        + [{"main": [(g[0], 256, 1), (g[1], 256, 1), (g[2], 256, 1), (g[3], 256, 1)]}] * 5
    )
    pods = {f"p{i:02d}": shape for i, shape in enumerate(shapes)}
    uids = {}
    for name, shape in pods.items():
        uids[name] = create_pod(core, namespace, name, gpu_node, shape).metadata.uid
    order = list(pods)
    random.Random(20).shuffle(order)
    dirs: set[str] = set()
    for name in order:
        for container, grants in pods[name].items():
            _, answer = kubelet.admit_container(len(grants))
            (response,) = answer.container_responses
            assert sorted(response.envs["NVIDIA_VISIBLE_DEVICES"].split(",")) == sorted(
                u for u, _, _ in grants
            )
            assert limits_of(response) == {u: (m * MIB, c) for u, m, c in grants}, (name, container)
            (state,) = [m.host_path for m in response.mounts if m.container_path == CONTAINER_STATE_DIR]
            dirs.add(state)
    assert len(dirs) == sum(len(shape) for shape in pods.values())  # every container its own state dir
    for name in pods:
        wait_for(lambda: phase_of(core, namespace, name) == Phase.ALLOCATED, what=f"{name} allocated")  # noqa: B023


def test_bad_input_is_refused_clearly_the_pod_fails_and_the_plugin_keeps_serving(node: Node) -> None:
    kubelet = node.kubelet
    gpu_node = node.name
    fake_gpus = node.gpus
    core = node.core
    namespace = node.namespace
    plugin = node.start()
    g = fake_gpus.uuids
    cases: list[tuple[str, dict[str, str | None], dict[str, int], str]] = [
        ("missing", {KEYS.allocation: None}, {}, f"annotation {KEYS.allocation} is missing"),
        ("malformed", {KEYS.allocation: "{not json"}, {}, "Invalid JSON"),
        ("elsewhere", {}, {}, "GPU GPU-00000000-0000-4000-8000-00000000dead is not on this node"),
        (
            "count",
            {},
            {"main": 2},
            f"container 'main' asks for 2 {KEYS.vgpu} but its allocation names 1 GPU(s)",
        ),
    ]
    for name, extra, gpu_counts, reason in cases:
        grants: Grants = [
            ("GPU-00000000-0000-4000-8000-00000000dead" if name == "elsewhere" else g[1], 1024, 10)
        ]
        create_pod(
            core, namespace, name, gpu_node, {"main": grants}, annotations=extra, gpu_counts=gpu_counts
        )
        gpu_count = gpu_counts.get("main", 1)
        with pytest.raises(grpc.RpcError) as refused:
            kubelet.admit_container(gpu_count)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        details = refused.value.details() or ""
        assert reason in details, details
        assert f"pod {namespace}/{name}" in details
        assert phase_of(core, namespace, name) == Phase.FAILED
        events = core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}").items
        assert [e.reason for e in events] == ["TesseraAllocateFailed"] and reason in events[0].message
    # Slice IDs the plugin never advertised.
    with pytest.raises(grpc.RpcError, match="is not of the form"):
        kubelet.allocate(["not-a-slice"])
    with pytest.raises(grpc.RpcError, match="a container gets at most one slice of each GPU"):
        kubelet.allocate([f"{g[0]}::1", f"{g[0]}::2"])
    # Still serving: a good pod is allocated.
    assert plugin.process.running
    create_pod(core, namespace, "good", gpu_node, {"main": [(g[3], 2048, 20)]})
    _, answer = kubelet.admit_container(1)
    assert limits_of(answer.container_responses[0]) == {g[3]: (2048 * MIB, 20)}
    wait_for(lambda: phase_of(core, namespace, "good") == Phase.ALLOCATED, what="phase allocated")
    assert json.loads(node_inventory(core, gpu_node) or "[]")
    assert "Traceback" not in plugin.log()
    # Every Allocate timed, the six refusals counted by their status.
    metrics = scrape(plugin)
    assert metrics["tessera_device_plugin_allocate_seconds_count", frozenset()] == 7
    refused = frozenset({"code": "FAILED_PRECONDITION"}.items())
    assert metrics["tessera_device_plugin_allocate_errors_total", refused] == 6


def test_a_pod_whose_request_the_contract_refuses_fails_with_the_contracts_reason(node: Node) -> None:
    """Bound without the extender (which would refuse it): the agent reads requests with the
    contract's parser, so the pod fails with the contract's reason and the plugin keeps serving."""
    kubelet, core, namespace, g = node.kubelet, node.core, node.namespace, node.gpus.uuids
    node.start()
    create_pod(
        core, namespace, "invalid", node.name, {"main": [(g[0], 1024, 10)]}, limits={KEYS.vgpu_cores: "0"}
    )
    with pytest.raises(grpc.RpcError) as refused:
        kubelet.admit_container(1)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    reason = f"pod {namespace}/invalid: its request is invalid: container 'main': {KEYS.vgpu_cores}: 0 is outside 1..100"
    assert reason in (refused.value.details() or "")
    assert phase_of(core, namespace, "invalid") == Phase.FAILED
    create_pod(core, namespace, "good", node.name, {"main": [(g[2], 2048, 20)]})
    _, answer = kubelet.admit_container(1)
    assert limits_of(answer.container_responses[0]) == {g[2]: (2048 * MIB, 20)}


def test_equal_key_pods_admitted_out_of_bind_order_end_up_under_their_own_names(node: Node) -> None:
    """Two pods with equal keys are indistinguishable at Allocate (both get the same answer); the
    agent's guess (oldest bind first) is corrected from the kubelet's pod-resources API, so metrics
    and clean-up follow the pod each container really belongs to."""
    kubelet, core, namespace, g = node.kubelet, node.core, node.namespace, node.gpus.uuids
    plugin = node.start(f"--pod-resources-socket={kubelet.pod_resources_socket}")
    grants: Grants = [(g[1], 4096, 30)]
    early = create_pod(
        core,
        namespace,
        "early",
        node.name,
        {"main": grants},
        annotations={KEYS.bind_time: format_time(now() - timedelta(seconds=60))},
    )
    late = create_pod(core, namespace, "late", node.name, {"main": grants})
    # The kubelet admits the later pod first: the agent serves it as the oldest in-flight container.
    _, late_answer = kubelet.admit_container(1, owner=(namespace, "late", "main"))
    (late_response,) = late_answer.container_responses
    assert limits_of(late_response) == {g[1]: (4096 * MIB, 30)}
    kubelet.admit_container(1, owner=(namespace, "early", "main"))
    late_state = next(m.host_path for m in late_response.mounts if m.container_path == CONTAINER_STATE_DIR)
    assert early.metadata.uid in late_state  # the guess

    holder = start_in_container(
        late_response, [str(CUCLIENT), "alloc", "mem", "1g", "1", "hold"], node.gpus.env()
    )
    try:
        assert holder.stdout is not None
        while (line := holder.stdout.readline()) and line.strip() != "hold ready":
            pass
        assert line.strip() == "hold ready"

        def used(pod: str) -> float | None:
            want = {
                "namespace": namespace,
                "pod": pod,
                "container": "main",
                "UUID": g[1],
                "Hostname": node.name,
            }
            found = [
                value
                for (name, labels), value in scrape(plugin).items()
                if name == "tessera_container_memory_used_bytes" and want.items() <= dict(labels).items()
            ]
            return found[0] if found else None

        wait_for(lambda: used("late") == 2**30 and used("early") == 0, what="metrics under the right pods")
    finally:
        stop(holder)

    # The early pod goes away: the state of its container goes, the late pod's (in the early-named dir) stays.
    core.delete_namespaced_pod("early", namespace, grace_period_seconds=0)
    containers = plugin.state_dir / "containers"
    wait_for(lambda: not (containers / late.metadata.uid).exists(), what="the early pod's state removed")
    assert Path(late_state).is_dir()
    record = json.loads((Path(late_state).parent / "allocation.json").read_text())
    assert (record["pod"], record["pod_uid"]) == ("late", late.metadata.uid)


def test_a_restart_of_the_agent_loses_nothing(node: Node) -> None:
    """Between the two containers of a pod the agent restarts: the first is not served again, the
    second gets its own GPUs and quotas, and the pod ends up allocated."""
    kubelet, core, namespace, g = node.kubelet, node.core, node.namespace, node.gpus.uuids
    first = node.start()
    create_pod(core, namespace, "two", node.name, {"a": [(g[0], 1024, 10)], "b": [(g[3], 8192, 60)]})
    _, answer = kubelet.admit_container(1)
    assert limits_of(answer.container_responses[0]) == {g[0]: (1024 * MIB, 10)}
    assert phase_of(core, namespace, "two") == Phase.ALLOCATING
    first.process.stop()
    kubelet.wait_for(lambda k: k.current.stream_ended)

    before = len(kubelet.registrations)
    node.start(state_dir=first.state_dir)
    kubelet.wait_for(lambda k: len(k.registrations) > before and len(k.devices()) == 40)
    _, answer = kubelet.admit_container(1)
    assert limits_of(answer.container_responses[0]) == {g[3]: (8192 * MIB, 60)}
    wait_for(lambda: phase_of(core, namespace, "two") == Phase.ALLOCATED, what="phase allocated")


def test_the_agent_in_mps_mode_starts_no_daemon_and_reports_the_one_that_runs(
    node: Node, control: Path, tmp_path: Path
) -> None:
    """The daemon is tessera-mps-control's (its own container): the agent in MPS mode registers after
    its wait without one, never starts or restarts it, and says whether it runs."""
    paths = mps_paths(tmp_path / "state")
    plugin = node.start(
        "--sharing=mps", f"--mps-control={control}", "--mps-wait-seconds=0.5", state_dir=tmp_path / "state"
    )
    running = ("tessera_device_plugin_mps_daemon_running", frozenset[tuple[str, str]]())
    assert scrape(plugin)[running] == 0
    assert "no MPS control daemon runs" in plugin.log()
    assert not paths.pid_file.exists() and not (paths.log / "control.log").exists()

    # tessera-mps-control starts it (here its MpsDaemon): the agent sees it.
    daemon = MpsDaemon(str(control), paths, node.gpus.uuids)
    daemon.ensure()
    pid = daemon.pid()
    assert pid is not None
    wait_for(lambda: scrape(plugin)[running] == 1, what="the daemon reported running")
    assert f"MPS control daemon {pid} runs" in plugin.log()

    # It dies: the agent says so and does not start it again.
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: scrape(plugin)[running] == 0, what="the daemon reported gone")
    time.sleep(2.5)  # more than two of the agent's checks
    assert daemon.pid() is None
    assert len((paths.log / "control.log").read_text().splitlines()) == 1
    assert plugin.process.running
