"""Pod shapes: a pod's shape for placement and its QoS class, as this extender decides them."""

from __future__ import annotations

from tessera.contract import JsonObject, PodRequest, QosClass, pod_priority, pod_ref
from tessera.placement import PodShape, QosThresholds, qos_class, qos_lowered, shape_of


def namespace_of(pod: JsonObject) -> str:
    return str((pod.get("metadata") or {}).get("namespace") or "")


def ref_of(pod: JsonObject) -> str:
    """The pod ref of a Pod object."""
    metadata = pod.get("metadata") or {}
    return pod_ref(str(metadata.get("namespace", "")), str(metadata.get("name", "")))


class PodShapes:
    def __init__(self, usage_aware: bool, qos_thresholds: QosThresholds) -> None:
        """``usage_aware``: best-effort pods may be placed against measured use
        (``--best-effort-oversubscription``). ``qos_thresholds``: a pod's QoS class, when its
        annotation names none, from its priority (docs/placement.md)."""
        self.usage_aware = usage_aware
        self.qos_thresholds = qos_thresholds

    def shape(self, pod: JsonObject, request: PodRequest) -> PodShape:
        """The pod's shape for placement. With usage-aware placement on it carries the pod's class,
        and a best-effort pod may be placed against measured use; off, every shape is standard's
        (the class changes nothing else in placement), so rejections say nothing of measured use and
        shapes of all classes share their cached outcomes."""
        if not self.usage_aware:
            return shape_of(request)
        return shape_of(request, self.qos(pod, request))

    def qos(self, pod: JsonObject, request: PodRequest) -> QosClass:
        """The pod's QoS class, written into its allocation: granted by its priority (or its
        namespace), lowered by its annotation (tessera.placement.qos)."""
        return qos_class(request.preferences.qos, pod_priority(pod), self.qos_thresholds, namespace_of(pod))

    def lowered(self, pod: JsonObject, request: PodRequest) -> str:
        """Why the pod runs with a lower class than its annotation asked for; "" when it does not."""
        return qos_lowered(request.preferences.qos, pod_priority(pod), self.qos_thresholds, namespace_of(pod))
