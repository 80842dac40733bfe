"""PodDisruptionBudgets as kube-scheduler matches them against preemption victims."""

from __future__ import annotations

from typing import Any

import pytest

from extender.budgets import covering, parse_budget, parse_budgets


def budget(
    selector: Any, *, namespace: str = "ns", allowed: int = 0, disrupted: Any = None
) -> dict[str, Any]:
    status: dict[str, Any] = {"disruptionsAllowed": allowed}
    if disrupted is not None:
        status["disruptedPods"] = disrupted
    return {
        "metadata": {"name": "b", "namespace": namespace},
        "spec": {"selector": selector},
        "status": status,
    }


@pytest.mark.parametrize(
    ("selector", "labels", "covered"),
    [
        ({"matchLabels": {"app": "web"}}, {"app": "web", "tier": "x"}, True),
        ({"matchLabels": {"app": "web"}}, {"app": "db"}, False),
        (
            {"matchExpressions": [{"key": "app", "operator": "In", "values": ["web", "db"]}]},
            {"app": "db"},
            True,
        ),
        ({"matchExpressions": [{"key": "app", "operator": "In", "values": ["web"]}]}, {"tier": "x"}, False),
        ({"matchExpressions": [{"key": "app", "operator": "NotIn", "values": ["web"]}]}, {"tier": "x"}, True),
        (
            {"matchExpressions": [{"key": "app", "operator": "NotIn", "values": ["web"]}]},
            {"app": "web"},
            False,
        ),
        ({"matchExpressions": [{"key": "app", "operator": "Exists"}]}, {"app": ""}, True),
        ({"matchExpressions": [{"key": "app", "operator": "DoesNotExist"}]}, {"app": "web"}, False),
        (
            {"matchLabels": {"app": "web"}, "matchExpressions": [{"key": "tier", "operator": "Exists"}]},
            {"app": "web"},
            False,
        ),
        ({}, {"app": "web"}, False),  # an empty selector matches nothing, as in kube-scheduler
    ],
)
def test_selectors(selector: Any, labels: dict[str, str], covered: bool) -> None:
    parsed = parse_budget(budget(selector))
    assert parsed is not None
    assert parsed.covers("ns", "p", labels) is covered


def test_other_namespaces_unlabelled_pods_and_pods_disrupted_already_are_not_covered() -> None:
    parsed = parse_budget(budget({"matchLabels": {"app": "web"}}, disrupted={"gone": "2026-01-01T00:00:00Z"}))
    assert parsed is not None
    assert not parsed.covers("other", "p", {"app": "web"})
    assert not parsed.covers("ns", "p", {})
    assert not parsed.covers("ns", "gone", {"app": "web"})


@pytest.mark.parametrize(
    "selector",
    [
        None,
        "app=web",
        {"matchExpressions": [{"key": "app", "operator": "Like", "values": ["w"]}]},
        {"matchExpressions": [{"key": "app", "operator": "In"}]},
        {"matchExpressions": [{"key": "app", "operator": "Exists", "values": ["x"]}]},
        {"matchExpressions": "app"},
    ],
)
def test_a_budget_with_an_invalid_selector_covers_nothing(selector: Any) -> None:
    assert parse_budget(budget(selector)) is None


def test_covering_names_budgets_by_position_with_their_allowance() -> None:
    budgets = parse_budgets(
        [
            budget({"matchLabels": {"app": "web"}}, allowed=2),
            budget(None),
            budget({"matchLabels": {"tier": "x"}}),
        ]
    )
    assert [b.disruptions_allowed for b in budgets] == [2, 0]
    assert covering(budgets, "ns", "p", {"app": "web", "tier": "x"}) == (0, 1)
    assert covering(budgets, "ns", "p", {"tier": "x"}) == (1,)
