"""PodDisruptionBudgets as preemption weighs them, read the way kube-scheduler reads them.

kube-scheduler counts a victim as breaking a budget when the budget is in the victim's namespace,
its selector (not empty) matches the victim's labels, the victim is not among the budget's
``status.disruptedPods`` already, and the budget has no ``status.disruptionsAllowed`` left
(:func:`tessera.placement.budget_violations` does the counting). Here: the budgets from the API's
JSON, and which of them cover a pod.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tessera.contract import JsonObject


@dataclass(frozen=True, slots=True)
class Budget:
    """One PodDisruptionBudget: where it applies, and how many more pods it may lose."""

    namespace: str
    match_labels: tuple[tuple[str, str], ...]
    match_expressions: tuple[tuple[str, str, frozenset[str]], ...]  # (key, operator, values)
    disruptions_allowed: int
    disrupted: frozenset[str]  # names of pods already being evicted: not counted again

    def covers(self, namespace: str, name: str, labels: Mapping[str, str]) -> bool:
        if namespace != self.namespace or not labels or name in self.disrupted:
            return False
        if not self.match_labels and not self.match_expressions:
            return False  # an empty selector matches nothing here, as in kube-scheduler
        if any(labels.get(key) != value for key, value in self.match_labels):
            return False
        return all(
            _matches(labels, key, operator, values) for key, operator, values in self.match_expressions
        )


_OPERATORS = frozenset({"In", "NotIn", "Exists", "DoesNotExist"})


def _matches(labels: Mapping[str, str], key: str, operator: str, values: frozenset[str]) -> bool:
    if operator == "In":
        return key in labels and labels[key] in values
    if operator == "NotIn":
        return key not in labels or labels[key] not in values
    if operator == "Exists":
        return key in labels
    return key not in labels  # DoesNotExist


def parse_budget(item: JsonObject) -> Budget | None:
    """A budget from the API's JSON; None for one whose selector is invalid (kube-scheduler lets
    such a budget match nothing)."""
    metadata = item.get("metadata") or {}
    spec = item.get("spec") or {}
    status = item.get("status") or {}
    selector = spec.get("selector")
    if not isinstance(selector, Mapping):
        return None
    labels = selector.get("matchLabels") or {}
    expressions = selector.get("matchExpressions") or []
    if not isinstance(labels, Mapping) or not isinstance(expressions, list):
        return None
    parsed_expressions = []
    for expression in expressions:
        parsed = _expression(expression)
        if parsed is None:
            return None
        parsed_expressions.append(parsed)
    allowed = status.get("disruptionsAllowed") or 0
    disrupted = status.get("disruptedPods") or {}
    return Budget(
        namespace=str(metadata.get("namespace", "")),
        match_labels=tuple((str(k), str(v)) for k, v in labels.items()),
        match_expressions=tuple(parsed_expressions),
        disruptions_allowed=allowed if isinstance(allowed, int) else 0,
        disrupted=frozenset(disrupted) if isinstance(disrupted, Mapping) else frozenset(),
    )


def _expression(expression: Any) -> tuple[str, str, frozenset[str]] | None:
    if not isinstance(expression, Mapping):
        return None
    key, operator, values = expression.get("key"), expression.get("operator"), expression.get("values") or []
    if not isinstance(key, str) or operator not in _OPERATORS or not isinstance(values, list):
        return None
    if (operator in ("In", "NotIn")) != bool(values):
        return None  # In and NotIn need values, Exists and DoesNotExist take none
    return key, str(operator), frozenset(str(v) for v in values)


def parse_budgets(items: Iterable[JsonObject]) -> list[Budget]:
    return [budget for budget in map(parse_budget, items) if budget is not None]


def covering(
    budgets: Sequence[Budget], namespace: str, name: str, labels: Mapping[str, str]
) -> tuple[int, ...]:
    """The indexes of the budgets covering the pod."""
    return tuple(i for i, budget in enumerate(budgets) if budget.covers(namespace, name, labels))
