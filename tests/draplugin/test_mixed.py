"""A mixed cluster on real nodes (`tessera sandbox up --mode mixed --nodes 3`; docs/dra.md, "One mode
per node"): the chart with ``mode=mixed`` on Kubernetes 1.37 and containerd 2, the last node labelled
for the DRA driver before the chart is installed, the device plugin with tessera-scheduler and the
extender on the two others. Each kind of pod goes to its kind of node and is held to its share there,
and no node ever runs both agents."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from sandbox import cluster, install
from sandbox.cluster import node_has_gpus, node_slice_devices
from sandbox.controlplane import DRA_K8S_VERSION
from sandbox.fakenode import PRESETS
from tessera.contract import KEYS
from tests.draplugin.conftest import GROUP, VERSION, Cluster
from tests.draplugin.test_node import EXAMPLE, probe_report, probe_view
from tests.sandbox.conftest import HostView, Sandbox, differences, running_sandbox

pytestmark = pytest.mark.sandbox

NODES = 3
AGENTS = {"dra": "tessera-dra", "deviceplugin": "tessera-device-plugin"}
# The DRA node's one GPU (sandbox.nodelife.DEFAULT_GPUS for the third node).
A100 = PRESETS["a100"]


@pytest.fixture(scope="module")
def mixed(request: pytest.FixtureRequest) -> Iterator[tuple[Sandbox, HostView]]:
    with running_sandbox("mixed", request.session, mode="mixed", nodes=NODES) as running:
        yield running


@pytest.fixture
def sbx(mixed: tuple[Sandbox, HostView]) -> Sandbox:
    return mixed[0]


@pytest.fixture
def view(sbx: Sandbox) -> Iterator[Cluster]:
    with probe_view(sbx) as found:
        yield found


def dra_node(sbx: Sandbox) -> str:
    return sbx.state.nodes[-1].name


def plugin_nodes(sbx: Sandbox) -> list[str]:
    return [sbx.state.node, *(n.name for n in sbx.state.nodes[:-1])]


def node_of(view: Cluster, pod: str) -> str:
    return str(view.core.read_namespaced_pod(pod, view.namespace).spec.node_name)


def test_each_node_runs_the_agent_of_its_mode_and_no_other(sbx: Sandbox) -> None:
    """The DRA node runs tessera-dra alone and publishes a ResourceSlice but no slices of
    tessera.io/vgpu; every other node runs the device plugin alone, with slices and no
    ResourceSlice; both on the DRA path's Kubernetes."""
    assert sbx.state.mode == "mixed"
    agents: dict[str, set[str]] = {}
    for pod in sbx.core.list_namespaced_pod(install.NAMESPACE, label_selector=install.AGENT_SELECTOR).items:
        agents.setdefault(pod.spec.node_name, set()).add(pod.metadata.labels["app.kubernetes.io/name"])
    wanted = {dra_node(sbx): {AGENTS["dra"]}, **{n: {AGENTS["deviceplugin"]} for n in plugin_nodes(sbx)}}
    assert agents == wanted
    assert sbx.core.read_node(dra_node(sbx)).metadata.labels[KEYS.node_mode] == "dra"
    assert node_slice_devices(sbx.api, dra_node(sbx)) > 0
    assert not node_has_gpus(sbx.api, dra_node(sbx))
    for node in plugin_nodes(sbx):
        assert node_has_gpus(sbx.api, node)
        assert node_slice_devices(sbx.api, node) == 0
        assert KEYS.node_mode not in (sbx.core.read_node(node).metadata.labels or {})
    versions = {n.status.node_info.kubelet_version for n in sbx.core.list_node().items}
    assert versions == {DRA_K8S_VERSION}


def test_a_vgpu_pod_lands_on_a_device_plugin_node_held_to_its_quota(sbx: Sandbox, view: Cluster) -> None:
    """Placed by tessera-scheduler (the chart's pinned kube-scheduler image) with the extender,
    against the 1.37 API server; the hook inside holds the 1024 MiB quota."""
    share = {KEYS.vgpu: "1", KEYS.vgpu_memory: "1024", KEYS.vgpu_cores: "30"}
    view.create_plain_pod("vgpu", share, scheduler="tessera-scheduler")
    report = probe_report(view, "vgpu")
    assert node_of(view, "vgpu") in plugin_nodes(sbx)
    assert report["total_mib"] == "1024"
    assert report["refused_with"] == "2"  # out of memory past the quota
    annotations = view.core.read_namespaced_pod("vgpu", view.namespace).metadata.annotations
    assert KEYS.allocation in annotations


def test_a_claim_pod_of_the_example_lands_on_the_dra_node_held_to_its_share(
    sbx: Sandbox, view: Cluster
) -> None:
    """deploy/examples/dra-shared-gpu.yaml: its template's claim (4 GiB of an A100) is allocated on
    the DRA node's slice by the cluster's kube-scheduler; the hook inside holds 4096 MiB."""
    template, pod = yaml.safe_load_all(EXAMPLE.read_text())
    view.objects.create_namespaced_custom_object(
        GROUP, VERSION, view.namespace, "resourceclaimtemplates", template
    )
    view.core.create_namespaced_pod(view.namespace, pod)
    name = pod["metadata"]["name"]
    report = probe_report(view, name)
    assert node_of(view, name) == dra_node(sbx)
    assert (report["device"], report["total_mib"]) == (A100.model, "4096")
    assert report["refused_with"] == "2"


def test_a_whole_gpu_pod_lands_on_the_dra_node(sbx: Sandbox, view: Cluster) -> None:
    """tessera.io/whole-gpu (KEP-5004, no claim): the cluster's kube-scheduler makes its claim on
    the DRA node; device plugin nodes have neither the resource nor a slice."""
    view.create_plain_pod("whole", {KEYS.whole_gpu: "1"}, scheduler="default-scheduler")
    report = probe_report(view, "whole")
    assert node_of(view, "whole") == dra_node(sbx)
    assert (report["device"], report["total_mib"]) == (A100.model, str(A100.total_memory_mib))
    status: Any = view.core.read_namespaced_pod("whole", view.namespace).status
    assert status.extended_resource_claim_status.resource_claim_name


def test_down_leaves_nothing(mixed: tuple[Sandbox, HostView]) -> None:
    sandbox, before = mixed
    assert cluster.down(sandbox.root, report=lambda _: None) == []
    assert differences(before, sandbox.root) == []
