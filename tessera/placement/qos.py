"""A pod's QoS class on a shared GPU, decided once by the extender and written into its allocation.

The rule (docs/placement.md, "QoS class of a pod"): a class is granted, not claimed. The pod's
priority (``spec.priority``, which the API server sets from the pod's PriorityClass, a cluster-scoped
object its owner cannot make) grants one: at or above ``latency_critical_priority`` latency-critical,
below ``best_effort_priority`` best-effort, standard in between. With the defaults a pod of a
PriorityClass valued 1,000,000 or more (the system classes, a "high-priority" class) is
latency-critical, one of a negative PriorityClass best-effort, and a pod without a PriorityClass
(priority 0) standard. The pod's ``<domain>/qos`` annotation may ask for a lower class, never a
higher one, unless its namespace is one the cluster admin lists in ``latency_critical_namespaces``,
whose pods may ask for any class.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tessera.contract import QosClass

# The reason of the Warning event on a pod that runs with a lower class than it asked for: the
# extender's at bind, the DRA driver's at prepare (its claim asked).
QOS_LOWERED_REASON = "QosClassLowered"

# The defaults of --qos-latency-critical-priority and --qos-best-effort-priority (tessera/cliargs.py).
LATENCY_CRITICAL_PRIORITY = 1_000_000
BEST_EFFORT_PRIORITY = 0


@dataclass(frozen=True, slots=True)
class QosThresholds:
    """Where a pod's priority puts it when it names no class: latency-critical at or above
    ``latency_critical_priority``, best-effort below ``best_effort_priority``."""

    latency_critical_priority: int = LATENCY_CRITICAL_PRIORITY
    best_effort_priority: int = BEST_EFFORT_PRIORITY
    # Namespaces whose pods may ask for any class by annotation, whatever their priority.
    latency_critical_namespaces: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        if self.best_effort_priority >= self.latency_critical_priority:
            raise ValueError(
                f"the best-effort priority ({self.best_effort_priority}) must be below the "
                f"latency-critical priority ({self.latency_critical_priority}), or no priority is standard"
            )


_RANK = {QosClass.BEST_EFFORT: 0, QosClass.STANDARD: 1, QosClass.LATENCY_CRITICAL: 2}


def granted_class(priority: int, namespace: str, thresholds: QosThresholds) -> QosClass:
    """The highest class the pod may have: its priority's, or any in a listed namespace."""
    if (
        priority >= thresholds.latency_critical_priority
        or namespace in thresholds.latency_critical_namespaces
    ):
        return QosClass.LATENCY_CRITICAL
    if priority < thresholds.best_effort_priority:
        return QosClass.BEST_EFFORT
    return QosClass.STANDARD


def qos_class(
    annotated: QosClass | None, priority: int, thresholds: QosThresholds, namespace: str = ""
) -> QosClass:
    """The pod's class: ``annotated`` (its annotation, parsed by the contract) when it asks for no
    more than the pod is granted, else what it is granted (in a listed namespace the annotation
    always holds; without one, the priority's class)."""
    priority_class = granted_class(priority, "", thresholds)
    if annotated is None:
        return priority_class
    ceiling = granted_class(priority, namespace, thresholds)
    return annotated if _RANK[annotated] <= _RANK[ceiling] else ceiling


def qos_lowered(annotated: QosClass | None, priority: int, thresholds: QosThresholds, namespace: str) -> str:
    """Why the pod does not get the class its annotation asks for ("" when it does): the event the
    extender records on it at bind (and the DRA driver at prepare, for the class a claim asks for)."""
    given = qos_class(annotated, priority, thresholds, namespace)
    if annotated is None or given == annotated:
        return ""
    return (
        f"asked for QoS class {annotated.value}, runs as {given.value}: priority {priority} grants at most "
        f"{given.value} (latency-critical from {thresholds.latency_critical_priority}, best-effort below "
        f"{thresholds.best_effort_priority}) and namespace {namespace} is not one whose pods may ask for more"
    )
