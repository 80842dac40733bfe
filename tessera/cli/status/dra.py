"""The DRA path in `tessera status`: nodes whose GPUs the DRA driver publishes (its ResourceSlices)
and the claims allocated shares of them (ResourceClaims), as the API server sends them."""

from __future__ import annotations

import re
from collections.abc import Iterable

from tessera.cli.status.report import ClaimOnGpu, GpuStatus, Json, NodeStatus, Status
from tessera.contract import (
    DRA_CORES_CAPACITY,
    DRA_MEMORY_CAPACITY,
    ContractError,
    ContractKeys,
    parse_integer_quantity,
    pod_ref,
)

# The driver names each device after its GPU's index (draplugin/slices.py device_name).
_DEVICE_INDEX = re.compile(r"-(\d+)$")


def _string(attributes: Json, name: str) -> str:
    value = attributes.get(name)
    return str(value.get("string") or "") if isinstance(value, dict) else ""


def _gpu(device: Json, position: int, where: str) -> GpuStatus:
    """One device of the driver's slice; a :class:`ContractError` naming the field when unreadable."""
    name = str(device.get("name") or "")
    attributes = device.get("attributes") or {}
    capacity = (device.get("capacity") or {}).get(DRA_MEMORY_CAPACITY) or {}
    index = _DEVICE_INDEX.search(name)
    taints = device.get("taints") or []
    effects = sorted({str(t.get("effect")) for t in taints if isinstance(t, dict)})
    return GpuStatus(
        uuid=_string(attributes, "uuid") or name,
        index=int(index.group(1)) if index else position,
        model=_string(attributes, "productName"),
        health="Healthy" if not taints else f"Tainted ({', '.join(effects)})",
        memory_bytes=parse_integer_quantity(
            capacity.get("value", 0), field=f"{where}.capacity.{DRA_MEMORY_CAPACITY}.value"
        ),
        slices_total=0,
    )


def add_dra(report: Status, slices: Iterable[Json], claims: Iterable[Json], keys: ContractKeys) -> None:
    """Adds the DRA driver's nodes and GPUs (its ``slices``) and each claim's share of them
    (``claims``) to ``report``; what cannot be read is one of its problems."""
    nodes = {node.name: node for node in report.nodes}
    devices: dict[tuple[str, str], GpuStatus] = {}
    for found in sorted(slices, key=lambda s: str((s.get("metadata") or {}).get("name"))):
        spec = found.get("spec") or {}
        if spec.get("driver") != keys.dra_driver:
            continue
        node_name = str(spec.get("nodeName") or "")
        pool = str((spec.get("pool") or {}).get("name") or node_name)
        node = nodes.get(node_name)
        if node is None:
            node = nodes[node_name] = NodeStatus(name=node_name, heartbeat_age_seconds=None, dra=True)
            report.nodes.append(node)
        slice_name = (found.get("metadata") or {}).get("name")
        for n, device in enumerate(spec.get("devices") or []):
            try:
                gpu = _gpu(device, n, f"ResourceSlice {slice_name}: spec.devices[{n}]")
            except ContractError as e:
                report.problems.append(str(e))
                continue
            devices[pool, str(device.get("name"))] = gpu
            node.gpus.append(gpu)
        node.gpus.sort(key=lambda g: g.index)
    report.nodes.sort(key=lambda n: n.name)
    for claim in sorted(claims, key=lambda c: (c["metadata"].get("namespace", ""), c["metadata"]["name"])):
        _add_claim(report, claim, devices, keys)


def _add_claim(
    report: Status, claim: Json, devices: dict[tuple[str, str], GpuStatus], keys: ContractKeys
) -> None:
    """The claim's share of each GPU it was allocated, on that GPU."""
    namespace, name = str(claim["metadata"].get("namespace", "")), str(claim["metadata"]["name"])
    status = claim.get("status") or {}
    results = ((status.get("allocation") or {}).get("devices") or {}).get("results") or []
    pods = [str(r.get("name")) for r in status.get("reservedFor") or [] if r.get("resource") == "pods"]
    ref = f"claim {pod_ref(namespace, name)}"
    shares: dict[str, ClaimOnGpu] = {}
    for n, result in enumerate(results):
        if result.get("driver") != keys.dra_driver:
            continue
        gpu = devices.get((str(result.get("pool")), str(result.get("device"))))
        if gpu is None:
            report.problems.append(
                f"{ref}: allocated device {result.get('pool')}/{result.get('device')}, which no "
                f"ResourceSlice of {keys.dra_driver} lists"
            )
            continue
        # Without consumedCapacity (consumable capacity off) a claim consumes the request policy's
        # defaults, which the driver publishes: the whole memory and no compute quota.
        consumed = result.get("consumedCapacity") or {}
        where = f"{ref}: status.allocation.devices.results[{n}].consumedCapacity"
        try:
            memory = parse_integer_quantity(
                consumed.get(DRA_MEMORY_CAPACITY, gpu.memory_bytes), field=f"{where}.{DRA_MEMORY_CAPACITY}"
            )
            cores = parse_integer_quantity(
                consumed.get(DRA_CORES_CAPACITY, 0), field=f"{where}.{DRA_CORES_CAPACITY}"
            )
        except ContractError as e:
            report.problems.append(str(e))
            continue
        share = shares.get(gpu.uuid)
        if share is None:
            share = shares[gpu.uuid] = ClaimOnGpu(namespace, name, pods, 0, 0)
            gpu.claims.append(share)
            gpu.slices_used += 1
        share.memory_bytes += memory
        share.cores_percent += cores
        gpu.memory_allocated_bytes += memory
        gpu.cores_allocated_percent += cores
