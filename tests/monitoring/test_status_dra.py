"""`tessera status` on the DRA path, from API objects as the API server sends them: the driver's
ResourceSlices give a node's GPUs, ResourceClaims their shares; the driver's metrics their use. The
real API server and driver: tests/draplugin/test_cluster.py."""

from __future__ import annotations

import io
from typing import Any

import pytest
from kubernetes import client
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from nodeagent.containermetrics import CONTAINER_LABELS
from tessera.cli.status.dra import add_dra
from tessera.cli.status.gather import StatusError, dra_items
from tessera.cli.status.metrics import add_metrics
from tessera.cli.status.report import Status
from tessera.cli.status.table import render_table
from tessera.contract import KEYS

GIB = 2**30
NODE = "dra-node"


def device(index: int, uuid: str, model: str, memory: int, **extra: Any) -> dict[str, Any]:
    return {
        "name": f"gpu-{index}",
        "attributes": {"uuid": {"string": uuid}, "productName": {"string": model}},
        "capacity": {"memory": {"value": str(memory)}, "cores": {"value": "100"}},
        **extra,
    }


SLICE = {
    "metadata": {"name": f"{NODE}-{KEYS.dra_driver}"},
    "spec": {
        "driver": KEYS.dra_driver,
        "nodeName": NODE,
        "pool": {"name": NODE},
        "devices": [
            device(1, "GPU-t4", "Tesla T4", 15 * GIB, taints=[{"key": "k", "effect": "NoSchedule"}]),
            device(0, "GPU-a100", "NVIDIA A100-SXM4-40GB", 40 * GIB),
        ],
    },
}
OTHER_DRIVER = {"metadata": {"name": "nics"}, "spec": {"driver": "nic.example.com", "nodeName": NODE}}


def claim(name: str, results: list[dict[str, Any]], pods: tuple[str, ...] = ("job",)) -> dict[str, Any]:
    return {
        "metadata": {"namespace": "ml", "name": name},
        "status": {
            "allocation": {"devices": {"results": results}},
            "reservedFor": [{"resource": "pods", "name": p, "uid": f"uid-{p}"} for p in pods],
        },
    }


def result(
    device_name: str, consumed: dict[str, str] | None = None, driver: str = KEYS.dra_driver
) -> dict[str, Any]:
    found: dict[str, Any] = {"request": "gpu", "driver": driver, "pool": NODE, "device": device_name}
    if consumed is not None:
        found["consumedCapacity"] = consumed
    return found


def test_a_dra_nodes_gpus_and_their_claims() -> None:
    report = Status(nodes=[], pending=[])
    claims = [
        claim(
            "train", [result("gpu-0", {"memory": "2Gi", "cores": "30"}), result("gpu-0", {"memory": "1Gi"})]
        ),
        # No consumedCapacity (consumable capacity off): the whole GPU's memory, no compute quota.
        claim("whole", [result("gpu-1"), result("eth0", driver="nic.example.com")], pods=("a", "b")),
        claim("lost", [result("gpu-7", {"memory": "1Gi"})]),
        claim("bad", [result("gpu-0", {"memory": "lots"})]),
        {"metadata": {"namespace": "ml", "name": "pending"}},  # not allocated yet
    ]
    add_dra(report, [OTHER_DRIVER, SLICE], claims, KEYS)
    [node] = report.nodes
    assert (node.name, node.dra, node.heartbeat_age_seconds) == (NODE, True, None)
    a100, t4 = node.gpus
    assert (a100.index, a100.uuid, a100.model, a100.health, a100.memory_bytes) == (
        0,
        "GPU-a100",
        "NVIDIA A100-SXM4-40GB",
        "Healthy",
        40 * GIB,
    )
    assert t4.health == "Tainted (NoSchedule)"
    # Two requests of one claim on one GPU add up.
    [train] = a100.claims
    assert (train.claim, train.pods, train.memory_bytes, train.cores_percent) == (
        "train",
        ["job"],
        3 * GIB,
        30,
    )
    assert (a100.memory_allocated_bytes, a100.cores_allocated_percent, a100.slices_used) == (3 * GIB, 30, 1)
    [whole] = t4.claims
    assert (whole.memory_bytes, whole.cores_percent, whole.pods) == (15 * GIB, 0, ["a", "b"])
    # Claims in name order.
    assert report.problems == [
        "claim ml/bad: status.allocation.devices.results[0].consumedCapacity.memory: 'lots' is not a quantity",
        f"claim ml/lost: allocated device {NODE}/gpu-7, which no ResourceSlice of {KEYS.dra_driver} lists",
    ]


class _DriverMetrics(Collector):
    def collect(self) -> Any:
        used = GaugeMetricFamily("tessera_container_memory_used_bytes", "", labels=CONTAINER_LABELS)
        used.add_metric(("ml", "job", "main", "train", NODE, "GPU-a100", "A100"), GIB)
        # A device plugin container's series (no claim) never counts for a claim.
        used.add_metric(("ml", "job", "main", "", NODE, "GPU-a100", "A100"), 7 * GIB)
        yield used


def test_a_claims_use_comes_from_its_series_and_the_table_shows_it() -> None:
    report = Status(nodes=[], pending=[])
    add_dra(report, [SLICE], [claim("train", [result("gpu-0", {"memory": "2Gi", "cores": "30"})])], KEYS)
    registry = CollectorRegistry()
    registry.register(_DriverMetrics())
    [node] = report.nodes
    add_metrics(node, generate_latest(registry).decode())
    assert node.gpus[0].claims[0].memory_used_bytes == GIB
    out = io.StringIO()
    render_table(report, out, colour=False)
    lines = out.getvalue().splitlines()
    assert any(line.startswith(NODE) and "DRA driver" in line for line in lines), lines
    assert any("GPU-a100" in line and "1 claims" in line and "2.0 / 40.0" in line for line in lines), lines
    assert any("claim ml/train (job)" in line and "1.0 GiB used" in line for line in lines), lines


class _Refusing:
    """The client's custom objects API, answering every list with ``status``."""

    def __init__(self, status: int) -> None:
        self.status = status

    def list_cluster_custom_object(self, *args: object, **kwargs: object) -> object:
        raise client.ApiException(status=self.status, reason="Refused")


def test_a_cluster_without_dra_or_a_user_who_may_not_list_it_still_gets_a_report() -> None:
    problems: list[str] = []
    assert dra_items(_Refusing(404), "resourceslices", "https://api", problems) == []
    assert problems == []
    assert dra_items(_Refusing(403), "resourceslices", "https://api", problems) == []
    assert problems == ["cannot list resourceslices: HTTP 403 Refused; DRA claims not shown"]
    with pytest.raises(StatusError, match="listing resourceclaims from https://api: HTTP 500 Refused"):
        dra_items(_Refusing(500), "resourceclaims", "https://api", problems)
