"""Best-effort pods that borrow GPU memory on a real node (chart-installed extender and
kube-scheduler, the node agent as a pod, the kubelet and containerd, the hook in the containers over
the fake driver): the extender places a best-effort pod against what the node agent measures, on a
GPU whose guaranteed pod requested nearly all memory but uses none; when the guaranteed pod takes
its memory back, the borrower is evicted with an event and the guaranteed pod's allocations up to its
quota all succeed."""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

import pytest
from kubernetes.stream import stream

from deviceplugin.usage import EVICTED_REASON
from sandbox import install
from tessera.contract import (
    KEYS,
    NodeGpuUsage,
    QosClass,
    parse_allocation,
    parse_gpu_usage,
    parse_time,
)
from tests.sandbox.conftest import Sandbox
from tests.waiting import wait_for

pytestmark = pytest.mark.sandbox

GRANT_MIB = 36864  # of the A100's 40960: the guaranteed pod's quota, and what the borrower borrows
BLOCK_MIB = 1024
IMAGE = "docker.io/local/vgpu-probe:tessera-0.1"
IDLE = "trap 'exit 0' TERM; while :; do sleep 3600 & wait $!; done"


@pytest.fixture(scope="module")
def sbx(shared_sandbox: Sandbox) -> Sandbox:
    return shared_sandbox


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


def _placed_and_measured(sbx: Sandbox, name: str) -> tuple[str, str]:
    """A guaranteed pod of GRANT_MIB on the A100, idle, Running, and a measurement of its node newer
    than its bind (the extender counts it at its full request until then): (node, GPU UUID)."""
    guaranteed = pod(
        name,
        IDLE,
        {KEYS.vgpu: "1", KEYS.vgpu_memory: str(GRANT_MIB), KEYS.vgpu_cores: "10"},
        annotations={KEYS.gpu_models: "A100"},
    )
    guaranteed["spec"]["schedulerName"] = "tessera-scheduler"
    sbx.core.create_namespaced_pod("default", guaranteed)
    sbx.wait_pod(name, "Running")
    annotations = sbx.core.read_namespaced_pod(name, "default").metadata.annotations
    placed = parse_allocation(annotations[KEYS.allocation])
    (grant,) = placed.containers[0].gpus
    measured_since(sbx, placed.node, parse_time(annotations[KEYS.bind_time], field="bind time"))
    return placed.node, grant.uuid


def measured_since(sbx: Sandbox, node: str, moment: datetime) -> NodeGpuUsage:
    """The node's first published measurement newer than ``moment``."""

    def newer() -> NodeGpuUsage | None:
        text = sbx.core.read_node(node).metadata.annotations.get(KEYS.node_gpu_usage)
        usage = None if text is None else parse_gpu_usage(text, node=node)
        return usage if usage is not None and parse_time(usage.time, field="usage time") > moment else None

    found = wait_for(newer, timeout=90, what=f"a measurement of {node} newer than {moment}")
    assert found is not None
    return found


def borrow(sbx: Sandbox, name: str, uuid: str) -> None:
    """A best-effort pod placed against measured use on GPU ``uuid``, holding its whole grant."""
    borrower = pod(
        name,
        f"trap 'exit 0' TERM; vgpu-probe {BLOCK_MIB} 3600",
        {KEYS.vgpu: "1", KEYS.vgpu_memory: str(GRANT_MIB)},
        annotations={KEYS.gpu_models: "A100", KEYS.qos: QosClass.BEST_EFFORT.value},
    )
    borrower["spec"]["schedulerName"] = "tessera-scheduler"
    sbx.core.create_namespaced_pod("default", borrower)
    sbx.wait_pod(name, "Running")
    borrowed = sbx.core.read_namespaced_pod(name, "default").metadata.annotations[KEYS.allocation]
    (borrowed_grant,) = parse_allocation(borrowed).containers[0].gpus
    assert (borrowed_grant.uuid, borrowed_grant.oversubscribed) == (uuid, True), borrowed
    log = sbx.logs(name, until="refused_with=", timeout=60)
    assert f"allocations_ok={GRANT_MIB // BLOCK_MIB}\n" in log, log


def test_a_forged_region_changes_no_published_use_and_evicts_nobody(sbx: Sandbox) -> None:
    """The guaranteed pod's process writes in its own accounting region that it holds 1,000,000 MiB
    and waits for 2048 MiB more (vgpu-escape forge), while the driver shows it holding one 256 MiB
    block and the GPU with nearly 4 GiB free: the node agent publishes what the driver says it
    holds, and the best-effort pod borrowing beside it stays (a wait the free memory covers is no
    shortage; believed, the region would have evicted it)."""
    node, uuid = _placed_and_measured(sbx, "forger")
    borrow(sbx, "bystander", uuid)
    try:
        out: str = stream(
            sbx.core.connect_get_namespaced_pod_exec,
            "forger",
            "default",
            command=[
                "/bin/sh",
                "-c",
                "vgpu-escape forge hold > /tmp/forge.log 2>&1 & sleep 2; cat /tmp/forge.log",
            ],
            stderr=True,
            stdin=False,
            stdout=True,
            tty=False,
        )
        assert "forge written 1" in out, out
        # Believed, the claim would be published (cut to the grant: 36864 MiB) within the agent's
        # 5 s between publications, and the borrower evicted within a check of the wait; what stands
        # after that is what the driver says the forger holds (a 256 MiB block and a context).
        time.sleep(12)
        text = sbx.core.read_node(node).metadata.annotations[KEYS.node_gpu_usage]
        (gpu,) = [g for g in parse_gpu_usage(text, node=node).gpus if g.uuid == uuid]
        assert 0 < gpu.guaranteed_used_mib < 2048, gpu
        events = sbx.core.list_namespaced_event(
            "default", field_selector="involvedObject.name=bystander"
        ).items
        assert not [e for e in events if e.reason == EVICTED_REASON], [(e.reason, e.message) for e in events]
        # The agent saw the claim and said it ignores it.
        (agent,) = install.agent_pods(sbx.api, node)
        agent_log = sbx.core.read_namespaced_pod_log(
            agent.metadata.name, install.NAMESPACE, container="agent"
        )
        assert "claims 1000000 MiB held and 2048 MiB waited for" in agent_log, agent_log[-3000:]
        assert sbx.core.read_namespaced_pod("bystander", "default").status.phase == "Running"
    finally:
        for name in ("forger", "bystander"):
            sbx.core.delete_namespaced_pod(name, "default", grace_period_seconds=0)
        wait_for(
            lambda: (
                not {p.metadata.name for p in sbx.core.list_namespaced_pod("default").items}
                & {"forger", "bystander"}
            ),
            timeout=60,
            what="the forger and the bystander gone",
        )


def test_a_guaranteed_pod_takes_back_what_a_best_effort_pod_borrowed(sbx: Sandbox) -> None:
    # By requests the A100 has 4 GiB left; against use (none) it has all 40 GiB less the margin:
    # the borrower gets its whole grant, and holds it.
    node, uuid = _placed_and_measured(sbx, "guaranteed")
    borrow(sbx, "borrower", uuid)

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
    assert evicted and f"GPU {uuid}" in evicted[0].message, [(e.reason, e.message) for e in events]
    wait_for(
        lambda: (
            not [p for p in sbx.core.list_namespaced_pod("default").items if p.metadata.name == "borrower"]
        ),
        timeout=60,
        what="the borrower to be deleted",
    )
    usage = parse_gpu_usage(sbx.core.read_node(node).metadata.annotations[KEYS.node_gpu_usage], node=node)
    assert uuid in {g.uuid for g in usage.gpus}
