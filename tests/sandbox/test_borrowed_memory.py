"""Best-effort pods that borrow GPU memory on a real node (chart-installed extender and
kube-scheduler, the node agent as a pod, the kubelet and containerd, the hook in the containers over
the fake driver): the extender places a best-effort pod against what the node agent measures, on a
GPU whose guaranteed pod requested nearly all memory but uses none; when the guaranteed pod takes
its memory back, the borrower is evicted with an event and the guaranteed pod's allocations up to its
quota all succeed."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes.stream import stream

from deviceplugin.agent import EVICTED_REASON
from tessera.contract import (
    KEYS,
    QosClass,
    parse_allocation,
    parse_gpu_usage,
    parse_time,
)
from tests.sandbox.conftest import HostView, Sandbox, running_sandbox
from tests.waiting import wait_for

pytestmark = pytest.mark.sandbox

GRANT_MIB = 36864  # of the A100's 40960: the guaranteed pod's quota, and what the borrower borrows
BLOCK_MIB = 1024
IMAGE = "docker.io/local/vgpu-probe:tessera-0.1"
IDLE = "trap 'exit 0' TERM; while :; do sleep 3600 & wait $!; done"


@pytest.fixture(scope="module")
def sbx() -> Iterator[Sandbox]:
    running: tuple[Sandbox, HostView]
    with running_sandbox("borrow", values=("extender.bestEffortOversubscription.enabled=true",)) as running:
        yield running[0]


def pod(name: str, command: str, resources: dict[str, str], **metadata: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, **metadata},
        "spec": {
            "terminationGracePeriodSeconds": 2,
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "probe",
                    "image": IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["/bin/sh", "-c", command],
                    "resources": {"limits": resources},
                }
            ],
        },
    }


def test_a_guaranteed_pod_takes_back_what_a_best_effort_pod_borrowed(sbx: Sandbox) -> None:
    guaranteed = pod(
        "guaranteed",
        IDLE,
        {KEYS.vgpu: "1", KEYS.vgpu_memory: str(GRANT_MIB), KEYS.vgpu_cores: "10"},
        annotations={KEYS.gpu_models: "A100"},
    )
    guaranteed["spec"]["schedulerName"] = "tessera-scheduler"
    sbx.core.create_namespaced_pod("default", guaranteed)
    sbx.wait_pod("guaranteed", "Running")
    annotations = sbx.core.read_namespaced_pod("guaranteed", "default").metadata.annotations
    placed = parse_allocation(annotations[KEYS.allocation])
    (grant,) = placed.containers[0].gpus

    # The extender counts the guaranteed pod at its full request until a measurement newer than
    # its bind: the node agent publishes one once it has served the pod.
    bound = parse_time(annotations[KEYS.bind_time], field="bind time")

    def measured_since_bind() -> bool:
        text = sbx.core.read_node(placed.node).metadata.annotations.get(KEYS.node_gpu_usage)
        return text is not None and parse_time(parse_gpu_usage(text).time, field="usage time") > bound

    wait_for(measured_since_bind, timeout=60, what="a measurement of the node newer than the bind")

    # By requests the A100 has 4 GiB left; against use (none) it has all 40 GiB less the margin.
    borrower = pod(
        "borrower",
        f"trap 'exit 0' TERM; vgpu-probe {BLOCK_MIB} 3600",
        {KEYS.vgpu: "1", KEYS.vgpu_memory: str(GRANT_MIB)},
        annotations={KEYS.gpu_models: "A100", KEYS.qos: QosClass.BEST_EFFORT.value},
    )
    borrower["spec"]["schedulerName"] = "tessera-scheduler"
    sbx.core.create_namespaced_pod("default", borrower)
    sbx.wait_pod("borrower", "Running")
    borrowed = sbx.core.read_namespaced_pod("borrower", "default").metadata.annotations[KEYS.allocation]
    (borrowed_grant,) = parse_allocation(borrowed).containers[0].gpus
    assert (borrowed_grant.uuid, borrowed_grant.memory_mib, borrowed_grant.oversubscribed) == (
        grant.uuid,
        GRANT_MIB,
        True,
    ), borrowed
    # Nothing used by the guaranteed pod: the borrower gets its whole grant (the GPU less the margin
    # is more), and holds it.
    log = sbx.logs("borrower", until="refused_with=", timeout=60)
    assert f"allocations_ok={GRANT_MIB // BLOCK_MIB}\n" in log, log

    # The guaranteed pod now takes its whole quota: the driver runs out after the 4 GiB the borrower
    # left, its allocation waits, the node agent evicts the borrower, and every block comes.
    out: str = stream(
        sbx.core.connect_get_namespaced_pod_exec,
        "guaranteed",
        "default",
        command=["vgpu-probe", str(BLOCK_MIB)],
        stderr=True,
        stdin=False,
        stdout=True,
        tty=False,
        _request_timeout=180,
    )
    facts = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    assert facts.get("allocations_ok") == str(GRANT_MIB // BLOCK_MIB), out

    events = sbx.core.list_namespaced_event("default", field_selector="involvedObject.name=borrower").items
    evicted = [e for e in events if e.reason == EVICTED_REASON]
    assert evicted and f"GPU {grant.uuid}" in evicted[0].message, [(e.reason, e.message) for e in events]
    wait_for(
        lambda: (
            not [p for p in sbx.core.list_namespaced_pod("default").items if p.metadata.name == "borrower"]
        ),
        timeout=60,
        what="the borrower to be deleted",
    )
    node = sbx.core.read_node(placed.node)
    usage = parse_gpu_usage(node.metadata.annotations[KEYS.node_gpu_usage], node=placed.node)
    assert grant.uuid in {g.uuid for g in usage.gpus}
