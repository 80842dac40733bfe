"""A pod's QoS class on a shared GPU, decided once by the extender and written into its allocation.

The rule (docs/placement.md, "QoS class of a pod"): the pod's ``<domain>/qos`` annotation when it has
one; otherwise its priority (``spec.priority``, which the API server sets from the pod's
PriorityClass) decides: at or above ``latency_critical_priority`` latency-critical, below
``best_effort_priority`` best-effort, standard in between. With the defaults a pod of a PriorityClass
valued 1,000,000 or more (the system classes, a "high-priority" class) is latency-critical, one of a
negative PriorityClass best-effort, and a pod without a PriorityClass (priority 0) standard.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.contract import QosClass

# The defaults of the extender's --qos-latency-critical-priority and --qos-best-effort-priority.
LATENCY_CRITICAL_PRIORITY = 1_000_000
BEST_EFFORT_PRIORITY = 0


@dataclass(frozen=True, slots=True)
class QosThresholds:
    """Where a pod's priority puts it when it names no class: latency-critical at or above
    ``latency_critical_priority``, best-effort below ``best_effort_priority``."""

    latency_critical_priority: int = LATENCY_CRITICAL_PRIORITY
    best_effort_priority: int = BEST_EFFORT_PRIORITY

    def __post_init__(self) -> None:
        if self.best_effort_priority >= self.latency_critical_priority:
            raise ValueError(
                f"the best-effort priority ({self.best_effort_priority}) must be below the "
                f"latency-critical priority ({self.latency_critical_priority}), or no priority is standard"
            )


def qos_class(annotated: QosClass | None, priority: int, thresholds: QosThresholds) -> QosClass:
    """The pod's class: ``annotated`` (its annotation, parsed by the contract) when it names one, else
    the class its ``priority`` falls in."""
    if annotated is not None:
        return annotated
    if priority >= thresholds.latency_critical_priority:
        return QosClass.LATENCY_CRITICAL
    if priority < thresholds.best_effort_priority:
        return QosClass.BEST_EFFORT
    return QosClass.STANDARD
