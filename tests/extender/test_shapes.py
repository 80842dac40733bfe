"""Pod shapes: the class is in a pod's shape only with usage-aware placement; the class granted by
priority, lowered by the annotation, and a warning when the annotation asked for more."""

from __future__ import annotations

from extender.shapes import PodShapes, ref_of
from tessera.contract import KEYS, QosClass, parse_pod_request
from tessera.placement import QosThresholds, shape_of
from tests.extender.helpers import gpu_pod


def test_the_class_is_in_the_shape_only_with_usage_aware_placement() -> None:
    pod = gpu_pod("p", annotations={KEYS.qos: QosClass.BEST_EFFORT.value})
    request = parse_pod_request(pod, KEYS)
    assert PodShapes(False, QosThresholds()).shape(pod, request) == shape_of(request)
    assert PodShapes(True, QosThresholds()).shape(pod, request) == shape_of(request, QosClass.BEST_EFFORT)


def test_a_class_above_the_granted_one_is_lowered_and_said_so() -> None:
    shapes = PodShapes(False, QosThresholds())
    asking = gpu_pod("p", annotations={KEYS.qos: QosClass.LATENCY_CRITICAL.value})
    request = parse_pod_request(asking, KEYS)
    assert shapes.qos(asking, request) == QosClass.STANDARD
    assert shapes.lowered(asking, request)
    plain = gpu_pod("q")
    assert shapes.lowered(plain, parse_pod_request(plain, KEYS)) == ""


def test_the_ref_of_a_pod_object() -> None:
    assert ref_of(gpu_pod("p", namespace="team")) == "team/p"
