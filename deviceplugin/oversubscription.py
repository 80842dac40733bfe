"""Pure logic: a GPU's measured use, and the memory of best-effort containers that borrow it.

A best-effort container whose grant on a GPU is ``oversubscribed`` (the extender placed it against
the GPU's measured use, not requests) holds memory that guaranteed (standard, latency-critical)
containers were promised and do not use yet. Its memory quota at any moment is what the others leave
(:func:`plan_gpu`): ``min(grant, GPU memory - the others' use - margin)``, never below what it
already holds (shrinking frees nothing: its new allocations are refused until use falls). When a
guaranteed container still cannot get memory within its quota (the hook publishes the bytes its
allocations wait for), oversubscribed best-effort containers on the GPU are evicted, newest first,
until what they hold covers the wait. The agent applies the plan (:mod:`deviceplugin.usage`).

A container's region is its own to write: what it says it holds or waits for is a claim. Measured
use comes from the driver (:func:`driver_checked`): each claim is cut to the container's grant, and
where NVML attributes memory to the pod, the pod's containers together hold what NVML says, whatever
their regions claim; a wait evicts only what NVML confirms is missing (the GPU's free memory by the
driver falls short of it), never on a container's word alone.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Generic, TypeVar

from tessera.contract import MIB, GpuUsage, QosClass

Key = TypeVar("Key", bound=Hashable)


@dataclass(frozen=True, slots=True)
class Holder(Generic[Key]):
    """One container's share of one GPU, as its grant and its accounting region say."""

    key: Key
    pod: str  # the pod's UID: NVML attributes memory to pods (by the processes' cgroups)
    qos: QosClass
    grant_bytes: int
    oversubscribed: bool
    used_bytes: int
    # Of used_bytes, what its allocations wait for: the driver had no memory for them.
    waiting_bytes: int
    # When it was served (seconds, any clock common to the GPU's holders): evictions go newest first.
    served_at: float

    @property
    def guaranteed(self) -> bool:
        return self.qos != QosClass.BEST_EFFORT


@dataclass(frozen=True, slots=True)
class GpuPlan(Generic[Key]):
    # The memory quota of each oversubscribed best-effort container now, in bytes.
    quotas: dict[Key, int]
    # Best-effort containers borrow the GPU's memory: guaranteed containers wait for it when short.
    oversubscribed: bool
    # Bytes guaranteed containers wait for that the evictions under way do not cover yet.
    shortfall_bytes: int
    # Best-effort containers to evict now, newest first.
    evict: tuple[Key, ...]


def driver_checked(holders: Sequence[Holder[Key]], by_pod: Mapping[str, int] | None) -> list[Holder[Key]]:
    """``holders`` with what they hold and wait for as far as the driver bears them out: each cut
    to the container's grant; with ``by_pod`` (bytes per pod UID by NVML on this GPU; None when NVML
    cannot say), each pod's containers hold together exactly what NVML says, shared in proportion to
    their (cut) claims, or to their grants when they all claim nothing, and wait for no more than
    their grants leave beside that: what an allocation within the quota could be refused."""
    cut = [
        replace(
            h,
            used_bytes=max(0, min(h.used_bytes, h.grant_bytes)),
            waiting_bytes=max(0, min(h.waiting_bytes, h.grant_bytes)),
        )
        for h in holders
    ]
    if by_pod is None:
        return cut
    pods: dict[str, list[Holder[Key]]] = {}
    for h in cut:
        pods.setdefault(h.pod, []).append(h)
    checked: list[Holder[Key]] = []
    for pod, members in pods.items():
        truth = by_pod.get(pod, 0)
        claimed = sum(h.used_bytes for h in members)
        weights = [h.used_bytes for h in members] if claimed else [h.grant_bytes for h in members]
        total_weight = sum(weights) or 1
        shares = [truth * w // total_weight for w in weights]
        shares[0] += truth - sum(shares)  # what integer division left over
        checked.extend(
            replace(h, used_bytes=share, waiting_bytes=min(h.waiting_bytes, max(0, h.grant_bytes - share)))
            for h, share in zip(members, shares, strict=True)
        )
    return checked


def plan_gpu(
    total_bytes: int,
    holders: Sequence[Holder[Key]],
    margin_bytes: int,
    evicting: frozenset[Key],
    free_bytes: int | None = None,
) -> GpuPlan[Key]:
    """The quotas and evictions of one GPU of ``total_bytes``; ``evicting``: containers whose
    eviction is under way (what they hold counts as coming back); ``free_bytes``: the GPU's free
    memory by the driver (None: unknown, and nothing is evicted: a wait alone is a container's word).
    The smallest quota is one byte (a limits file's memory is positive), which refuses every
    allocation."""
    used = sum(h.used_bytes for h in holders)
    quotas = {
        h.key: max(min(h.grant_bytes, total_bytes - (used - h.used_bytes) - margin_bytes), h.used_bytes, 1)
        for h in holders
        if h.oversubscribed and not h.guaranteed
    }
    waiting = sum(h.waiting_bytes for h in holders if h.guaranteed)
    # Only what the GPU lacks by the driver is missing: a wait the free memory covers is no shortage.
    confirmed = 0 if free_bytes is None else max(0, waiting - free_bytes)
    coming_back = sum(h.used_bytes for h in holders if h.key in evicting)
    shortfall = max(0, confirmed - coming_back)
    evict: list[Key] = []
    candidates = sorted(
        (h for h in holders if h.key in quotas and h.key not in evicting and h.used_bytes > 0),
        key=lambda h: h.served_at,
        reverse=True,
    )
    left = shortfall
    for h in candidates:
        if left <= 0:
            break
        evict.append(h.key)
        left -= h.used_bytes
    return GpuPlan(quotas=quotas, oversubscribed=bool(quotas), shortfall_bytes=shortfall, evict=tuple(evict))


def measured_use(uuid: str, holders: Sequence[Holder[Key]], utilization_percent: int) -> GpuUsage:
    """What the node annotation says of one GPU (MiB rounded up: never less than is used)."""
    return GpuUsage(
        uuid=uuid,
        memory_used_mib=_mib(sum(h.used_bytes for h in holders)),
        guaranteed_used_mib=_mib(sum(h.used_bytes for h in holders if h.guaranteed)),
        utilization_percent=max(0, min(100, utilization_percent)),
    )


def _mib(n: int) -> int:
    return -(-n // MIB)


def usage_worth_publishing(
    published: Sequence[GpuUsage] | None,
    measured: Sequence[GpuUsage],
    *,
    change_mib: int,
    change_percent: int,
    since_published: float,
    min_interval: float,
    max_interval: float,
    newly_measured: bool = False,
) -> bool:
    """Whether to patch the node with ``measured``: never sooner than ``min_interval`` seconds after
    the last patch; then when it measures containers the last patch did not (the extender counts a
    pod at its full request until a measurement newer than its bind), when some GPU's use moved by
    ``change_mib`` or its utilisation by ``change_percent``, or anything changed and
    ``max_interval`` has passed."""
    if published is None:
        return True
    if since_published < min_interval:
        return False
    if newly_measured:
        return True
    if tuple(published) == tuple(measured):
        return False
    if since_published >= max_interval:
        return True
    before = {g.uuid: g for g in published}
    for now in measured:
        old = before.get(now.uuid)
        if (
            old is None
            or abs(now.memory_used_mib - old.memory_used_mib) >= change_mib
            or abs(now.guaranteed_used_mib - old.guaranteed_used_mib) >= change_mib
            or abs(now.utilization_percent - old.utilization_percent) >= change_percent
        ):
            return True
    return len(before) != len(measured)
