"""Preemption that understands GPU shares: which lower-priority pods to evict on a node so a pod fits.

kube-scheduler preempts by its own view of a node (CPU, memory, the slice count ``<domain>/vgpu``);
it cannot see GPU memory or compute, which only Tessera decides. Its preempt call to the extender
names, per candidate node, the victims it chose; the extender answers, per node, the victims that
make the pod fit on the node's GPUs (docs/placement.md, "Preemption"). This module is that decision,
over plain data:

* the *candidates* are the node's pods holding GPU shares, with their priority, their grants and the
  disruption budgets (PodDisruptionBudgets) covering them; only those of lower priority than the
  pod may be evicted, as in kube-scheduler;
* a set of victims is *feasible* when the pod fits on the node once their shares are given back (by
  memory, compute, slices, model and speed: :func:`tessera.placement.fit.filter_node`);
* among feasible sets the answer is the best by, in order: fewest budget violations (counted as
  kube-scheduler counts them, :func:`budget_violations`), fewest victims, lowest highest victim
  priority, lowest sum of victim priorities, most recently bound oldest victim (less work lost):
  kube-scheduler's own order of preference between nodes, with the count moved up to second;
* when no eviction of lower-priority pods makes room, the answer is the reason.

The in-flight rule is not a reason to evict: it holds for seconds, while the pod binds only once its
victims are gone, and bind checks the rule then.

The search tries sets by increasing size, each pod's GPUs first for a one-GPU pod (only pods sharing
the GPU it lands on can make room there), skipping sets that contain a feasible set already found
and sets whose preference cannot beat the best found. It starts from kube-scheduler's own greedy
answer (all candidates out, then each put back, most important first, while the pod still fits),
so it always has a feasible answer, and tries at most ``max_checks`` fits (and ten times as many
sets) per node.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from itertools import combinations

from tessera.placement.fit import eligible_gpus, filter_node
from tessera.placement.model import NodeFit, NodeRejection, NodeState, Placement, PodShape, release
from tessera.placement.policies import ClusterContext, PlacementPolicy
from tessera.placement.speed import SpeedProfiles

# Fits tried per node at most: a GPU node holds tens of pods, and kube-scheduler asks about up to
# 100 candidate nodes in one preempt call, within its extender timeout.
MAX_CHECKS = 2000
# Sets weighed (by their preference alone, before any fit is tried) per fit allowed.
SETS_PER_CHECK = 10


@dataclass(frozen=True, slots=True)
class Victim:
    """A pod on the node that preemption may evict: its grants there as a placement, its priority,
    the disruption budgets covering it (indexes into the budgets' list) and when it was bound."""

    uid: str
    priority: int
    placement: Placement
    budgets: tuple[int, ...] = ()
    bound_at: datetime | None = None

    @property
    def age_key(self) -> float:
        """When it was bound, as a number (unknown: the oldest)."""
        return self.bound_at.timestamp() if self.bound_at is not None else float("-inf")


@dataclass(frozen=True, slots=True)
class Preemption:
    """The victims to evict on a node (most important first, as kube-scheduler lists them), how many
    of them break a disruption budget, and the pod's fit once they are gone (``victims`` empty: the
    pod fits already)."""

    victims: tuple[Victim, ...]
    budget_violations: int
    fit: NodeFit


def importance(victim: Victim) -> tuple[int, float, str]:
    """kube-scheduler's order of importance: higher priority first, then the longer bound (then the
    UID, so that equals are always taken in one order)."""
    return (-victim.priority, victim.age_key, victim.uid)


def budget_violations(victims: Iterable[Victim], disruptions_allowed: Sequence[int]) -> int:
    """How many of ``victims`` evicting all of them breaks a budget for, as kube-scheduler counts:
    going through them most important first, each victim takes one disruption from every budget
    covering it, and breaks a budget when one of them has none left."""
    left = list(disruptions_allowed)
    broken = 0
    for victim in sorted(victims, key=importance):
        violates = False
        for budget in victim.budgets:
            left[budget] -= 1
            violates |= left[budget] < 0
        broken += violates
    return broken


def _cost(victims: Sequence[Victim], disruptions_allowed: Sequence[int]) -> tuple[int, int, int, int, float]:
    """The preference between feasible sets, smaller is better (see the module's docstring)."""
    return (
        budget_violations(victims, disruptions_allowed),
        len(victims),
        max(v.priority for v in victims),
        sum(v.priority for v in victims),
        -min(v.age_key for v in victims),
    )


def _without(node: NodeState, victims: Iterable[Victim]) -> NodeState:
    for victim in victims:
        node = release(node, victim.placement)
    return node


@dataclass(slots=True)
class _Search:
    node: NodeState
    shape: PodShape
    profiles: SpeedProfiles
    policy: PlacementPolicy
    context: ClusterContext
    checks_left: int
    sets_left: int

    def fit(self, victims: Iterable[Victim]) -> NodeFit | NodeRejection:
        self.checks_left -= 1
        return filter_node(_without(self.node, victims), self.shape, self.profiles, self.policy, self.context)


def choose_victims(
    node: NodeState,
    shape: PodShape,
    priority: int,
    candidates: Sequence[Victim],
    disruptions_allowed: Sequence[int] = (),
    *,
    profiles: SpeedProfiles,
    policy: PlacementPolicy,
    context: ClusterContext,
    max_checks: int = MAX_CHECKS,
) -> Preemption | str:
    """The victims among ``candidates`` (pods on ``node`` holding GPU shares) whose eviction makes a
    pod of ``shape`` and ``priority`` fit, or why no eviction of lower-priority pods can.

    ``disruptions_allowed[i]`` is how many more pods budget i may lose (a PodDisruptionBudget's
    ``status.disruptionsAllowed``); each candidate names the budgets covering it.
    """
    search = _Search(node, shape, profiles, policy, context, max_checks, SETS_PER_CHECK * max_checks)
    now = search.fit(())
    if isinstance(now, NodeFit):
        return Preemption((), 0, now)
    if now.unresolvable:
        return now.reason
    usable = set(eligible_gpus(node, shape, profiles))
    lower = sorted(
        (
            v
            for v in candidates
            if v.priority < priority and any(g.gpu in usable for g in v.placement.grants())
        ),
        key=importance,
    )
    if not lower:
        return f"no pod of lower priority holds a share of a GPU the pod may use; {now.reason}"
    everyone = search.fit(lower)
    if not isinstance(everyone, NodeFit):
        return f"not even with all {len(lower)} lower-priority pods evicted: {everyone.reason}"
    best = _greedy(search, lower)
    best_cost = _cost(best, disruptions_allowed)
    feasible: list[frozenset[str]] = [frozenset(v.uid for v in best)]
    # Cheapest candidates first: the first feasible set of a size is then usually the best of it.
    cheapest_first = lower[::-1]
    for group in _groups(node, shape, usable, cheapest_first):
        for size in range(1, len(group) + 1):
            if best_cost[0] == 0 and size > best_cost[1]:
                break  # no larger set beats a best without budget violations
            for chosen in combinations(group, size):
                search.sets_left -= 1
                if search.checks_left <= 0 or search.sets_left <= 0:
                    break
                cost = _cost(chosen, disruptions_allowed)
                if cost >= best_cost:
                    continue
                uids = frozenset(v.uid for v in chosen)
                if any(found <= uids for found in feasible):
                    continue  # contains a feasible set, which is cheaper
                if isinstance(search.fit(chosen), NodeFit):
                    feasible.append(uids)
                    best, best_cost = chosen, cost
    victims = tuple(sorted(best, key=importance))
    fit = filter_node(_without(node, victims), shape, profiles, policy, context)
    assert isinstance(fit, NodeFit), "a feasible set fits"
    return Preemption(victims, best_cost[0], fit)


def _greedy(search: _Search, lower: Sequence[Victim]) -> tuple[Victim, ...]:
    """kube-scheduler's answer on its own view: all of ``lower`` evicted (the pod fits then), then
    each put back, most important first, while the pod still fits. A feasible set, none of whose
    members can be spared alone."""
    evicted = list(lower)
    for victim in lower:
        if search.checks_left <= 0:
            break
        trial = [v for v in evicted if v is not victim]
        if trial and isinstance(search.fit(trial), NodeFit):
            evicted = trial
    return tuple(evicted)


def _groups(
    node: NodeState, shape: PodShape, usable: set[int], victims: Sequence[Victim]
) -> list[list[Victim]]:
    """The candidates worth combining: for a pod of one GPU, those sharing each GPU it may use (it
    lands on one, and only pods there make room on it); else all of them."""
    if shape.gpu_count != 1:
        return [list(victims)]
    groups = []
    for gpu in sorted(usable):
        members = [v for v in victims if any(g.gpu == gpu for g in v.placement.grants())]
        if members:
            groups.append(members)
    return groups
