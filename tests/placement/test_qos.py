"""qos_class: a pod's QoS class, granted by its priority (or its namespace), lowered by its annotation."""

from __future__ import annotations

import pytest

from tessera.contract import KEYS, ContractError, PodShapeError, QosClass, parse_preferences, pod_priority
from tessera.placement import QosThresholds, qos_class, qos_lowered

DEFAULT = QosThresholds()


@pytest.mark.parametrize(
    ("priority", "expected"),
    [
        (2_000_001_000, QosClass.LATENCY_CRITICAL),  # system-node-critical
        (1_000_000, QosClass.LATENCY_CRITICAL),
        (999_999, QosClass.STANDARD),
        (0, QosClass.STANDARD),  # no PriorityClass
        (-1, QosClass.BEST_EFFORT),
        (-1_000_000, QosClass.BEST_EFFORT),
    ],
)
def test_the_priority_decides_when_the_pod_names_no_class(priority: int, expected: QosClass) -> None:
    assert qos_class(None, priority, DEFAULT) == expected


def test_the_annotation_may_lower_the_class() -> None:
    assert qos_class(QosClass.BEST_EFFORT, 2_000_000_000, DEFAULT) == QosClass.BEST_EFFORT
    assert qos_class(QosClass.STANDARD, 1_000_000, DEFAULT) == QosClass.STANDARD
    assert qos_lowered(QosClass.BEST_EFFORT, 2_000_000_000, DEFAULT, "team-a") == ""


@pytest.mark.parametrize(
    ("asked", "priority", "given"),
    [
        (QosClass.LATENCY_CRITICAL, -5, QosClass.BEST_EFFORT),  # the scavenger that claimed the top
        (QosClass.STANDARD, -5, QosClass.BEST_EFFORT),
        (QosClass.LATENCY_CRITICAL, 0, QosClass.STANDARD),
        (QosClass.LATENCY_CRITICAL, 999_999, QosClass.STANDARD),
    ],
)
def test_the_annotation_cannot_raise_the_class(asked: QosClass, priority: int, given: QosClass) -> None:
    assert qos_class(asked, priority, DEFAULT, "team-a") == given
    why = qos_lowered(asked, priority, DEFAULT, "team-a")
    assert why.startswith(f"asked for QoS class {asked.value}, runs as {given.value}: priority {priority}")
    assert "namespace team-a is not one whose pods may ask for more" in why


def test_a_listed_namespace_may_ask_for_any_class() -> None:
    thresholds = QosThresholds(latency_critical_namespaces=frozenset({"inference"}))
    assert qos_class(QosClass.LATENCY_CRITICAL, -5, thresholds, "inference") == QosClass.LATENCY_CRITICAL
    assert qos_lowered(QosClass.LATENCY_CRITICAL, -5, thresholds, "inference") == ""
    assert qos_class(QosClass.LATENCY_CRITICAL, -5, thresholds, "team-a") == QosClass.BEST_EFFORT
    # Without an annotation the priority decides there too.
    assert qos_class(None, -5, thresholds, "inference") == QosClass.BEST_EFFORT


def test_thresholds_of_ones_own() -> None:
    thresholds = QosThresholds(latency_critical_priority=100, best_effort_priority=10)
    assert [qos_class(None, p, thresholds) for p in (100, 99, 10, 9)] == [
        QosClass.LATENCY_CRITICAL,
        QosClass.STANDARD,
        QosClass.STANDARD,
        QosClass.BEST_EFFORT,
    ]


def test_thresholds_leaving_no_standard_priority_are_refused() -> None:
    with pytest.raises(ValueError, match=r"best-effort priority \(100\) must be below the latency-critical"):
        QosThresholds(latency_critical_priority=100, best_effort_priority=100)


def test_an_invalid_class_names_the_value() -> None:
    with pytest.raises(
        ContractError, match=r"annotation tessera.io/qos: 'urgent' is not one of latency-critical"
    ):
        parse_preferences({KEYS.qos: "urgent"})


def test_the_pods_priority() -> None:
    assert pod_priority({"spec": {"priority": 1000}}) == 1000
    assert pod_priority({"spec": {}}) == 0
    assert pod_priority({}) == 0
    with pytest.raises(PodShapeError, match=r"spec\.priority: must be an integer, got a string"):
        pod_priority({"spec": {"priority": "high"}})
    with pytest.raises(PodShapeError, match=r"spec\.priority: must be an integer, got a boolean"):
        pod_priority({"spec": {"priority": True}})
