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

Oversubscribed grants (best-effort pods placed against measured use, :mod:`.usage`) free a slice
when evicted and nothing else that placement by requests counts, so a pod preempts them only for a
slice. The measured use stays as measured until the next measurement: evictions never make room
against measured use (that room appears when the node agent measures again).

The in-flight rule is not a reason to evict: it holds for seconds, while the pod binds only once its
victims are gone, and bind checks the rule then.

The search tries sets by increasing size, GPU by GPU for a one-GPU pod (only pods sharing the GPU
it lands on can make room there, and only that GPU is checked), skipping sets that contain a
feasible set already found, sets whose preference cannot beat the best found, and (on one GPU)
sizes too small to free the memory, compute or slice needed even with the largest pods. It weighs
at most ``max_sets`` sets per node; when that runs out before any set is found, the answer is
kube-scheduler's own greedy one (all candidates out, then each put back, most important first,
while the pod still fits): always a feasible answer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from itertools import combinations

from tessera.placement.fit import eligible_gpus, filter_node, find_placement, gpu_takes
from tessera.placement.model import NodeFit, NodeState, Placement, PodShape, release_all
from tessera.placement.policies import ClusterContext, PlacementPolicy
from tessera.placement.speed import SpeedProfiles

# Sets of victims weighed per node at most (each a few microseconds, and a fit check for those that
# could beat the best so far): a GPU node holds tens of pods, and kube-scheduler asks about up to
# 100 candidate nodes in one preempt call, within its extender timeout.
MAX_SETS = 2000


@dataclass(frozen=True, slots=True)
class Victim:
    """A pod on the node that preemption may evict: its grants there as a placement, its priority,
    the disruption budgets covering it (indexes into the budgets' list) and when it was bound."""

    uid: str
    priority: int
    placement: Placement
    budgets: tuple[int, ...] = ()
    bound_at: datetime | None = None
    # When it was bound, as a number (unknown: the oldest); a field, as the search reads it per set.
    age_key: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "age_key", self.bound_at.timestamp() if self.bound_at is not None else float("-inf")
        )


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


Preference = tuple[int, int, int, int, float]


def preference(victims: Sequence[Victim], disruptions_allowed: Sequence[int]) -> Preference:
    """How much evicting ``victims`` costs, to compare feasible sets (smaller is better): budget
    violations, count, highest priority, sum of priorities, then the most recently bound oldest."""
    return (
        budget_violations(victims, disruptions_allowed),
        len(victims),
        max(v.priority for v in victims),
        sum(v.priority for v in victims),
        -min(v.age_key for v in victims),
    )


def _without(node: NodeState, victims: Iterable[Victim]) -> NodeState:
    return release_all(node, (victim.placement for victim in victims))


@dataclass(slots=True)
class _Search:
    node: NodeState
    shape: PodShape
    profiles: SpeedProfiles
    policy: PlacementPolicy
    context: ClusterContext
    sets_left: int

    def fits(self, victims: Iterable[Victim], gpu: int | None) -> bool:
        """Whether the pod fits once ``victims`` are gone: on the GPU at position ``gpu`` for a pod
        of one GPU (only that GPU's state is made anew), else anywhere on the node
        (:func:`filter_node`'s search, without the reason it does not)."""
        if gpu is not None:
            after = self.node.gpus[gpu]
            for g in (g for v in victims for g in v.placement.grants() if g.gpu == gpu):
                after = after.with_use(-g.memory_quota_mib, -g.cores, -1, g.oversubscribed)
            return gpu_takes(after, self.shape.containers[0])
        node = _without(self.node, victims)
        eligible = eligible_gpus(node, self.shape, self.profiles)
        return find_placement(node, self.shape, eligible, self.policy, self.context) is not None


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
    max_sets: int = MAX_SETS,
) -> Preemption | str:
    """The victims among ``candidates`` (pods on ``node`` holding GPU shares) whose eviction makes a
    pod of ``shape`` and ``priority`` fit, or why no eviction of lower-priority pods can.

    ``disruptions_allowed[i]`` is how many more pods budget i may lose (a PodDisruptionBudget's
    ``status.disruptionsAllowed``); each candidate names the budgets covering it.
    """
    search = _Search(node, shape, profiles, policy, context, max_sets)
    now = filter_node(node, shape, profiles, policy, context)
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
    everyone = filter_node(_without(node, lower), shape, profiles, policy, context)
    if not isinstance(everyone, NodeFit):
        return f"not even with all {len(lower)} lower-priority pods evicted: {everyone.reason}"
    best: tuple[Victim, ...] | None = None
    best_cost: Preference = (len(lower) + 1, 0, 0, 0, 0.0)  # worse than any set's: more violations than pods
    feasible: list[frozenset[str]] = []
    # Cheapest candidates first: the first feasible set of a size is then usually the best of it.
    for gpu, smallest, group in _groups(node, shape, usable, lower[::-1]):
        for size in range(smallest, len(group) + 1):
            if best_cost[0] == 0 and size > best_cost[1]:
                break  # no larger set beats a best without budget violations
            for chosen in combinations(group, size):
                search.sets_left -= 1
                if search.sets_left < 0:
                    break
                cost = preference(chosen, disruptions_allowed)
                if cost >= best_cost:
                    continue
                uids = frozenset(v.uid for v in chosen)
                if any(found <= uids for found in feasible):
                    continue  # contains a feasible set, which is cheaper
                if search.fits(chosen, gpu):
                    feasible.append(uids)
                    best, best_cost = chosen, cost
    if best is None:  # the search ran out before it found a set: kube-scheduler's way
        best = _greedy(search, usable, lower, disruptions_allowed)
    victims = tuple(sorted(best, key=importance))
    fit = filter_node(_without(node, victims), shape, profiles, policy, context)
    assert isinstance(fit, NodeFit), "a feasible set fits"
    return Preemption(victims, budget_violations(victims, disruptions_allowed), fit)


def _greedy(
    search: _Search, usable: set[int], lower: Sequence[Victim], disruptions_allowed: Sequence[int]
) -> tuple[Victim, ...]:
    """kube-scheduler's answer on its own view, in each group of :func:`_groups`: all of it evicted,
    then each put back, most important first, while the pod still fits; the best of the groups'.
    A feasible set none of whose members can be spared alone; a check per candidate, whatever the
    search has left."""
    answers = []
    for gpu, _, group in _groups(search.node, search.shape, usable, lower):
        if not search.fits(group, gpu):
            continue
        evicted = list(group)
        for victim in group:
            trial = [v for v in evicted if v is not victim]
            if trial and search.fits(trial, gpu):
                evicted = trial
        answers.append(tuple(evicted))
    # The node-wide group of a pod of several GPUs always fits: all of ``lower`` made room.
    return min(answers, key=lambda answer: preference(answer, disruptions_allowed))


def _fewest_on_gpu(node: NodeState, shape: PodShape, gpu: int, group: Sequence[Victim]) -> int:
    """The fewest pods of ``group`` whose eviction can make room for a one-GPU pod on GPU ``gpu``:
    the smallest count whose largest memories, largest compute shares and slices add up to what is
    missing (a bound: those largest need not be the same pods)."""
    state = node.gpus[gpu]
    container = shape.containers[0]
    # Oversubscribed grants hold no memory or compute that placement by requests counts.
    memory = sorted(
        (
            sum(g.memory_quota_mib for g in v.placement.grants() if g.gpu == gpu and not g.oversubscribed)
            for v in group
        ),
        reverse=True,
    )
    cores = sorted(
        (sum(g.cores for g in v.placement.grants() if g.gpu == gpu and not g.oversubscribed) for v in group),
        reverse=True,
    )
    missing_memory = container.memory_quota_on(state) - state.free_memory_mib
    missing_cores = container.cores_needed - state.free_cores
    missing_slices = 1 - state.free_slices
    freed_memory = freed_cores = 0
    for count in range(1, len(group) + 1):
        freed_memory += memory[count - 1]
        freed_cores += cores[count - 1]
        if freed_memory >= missing_memory and freed_cores >= missing_cores and count >= missing_slices:
            return count
    return len(group) + 1


def _groups(
    node: NodeState, shape: PodShape, usable: set[int], victims: Sequence[Victim]
) -> list[tuple[int | None, int, list[Victim]]]:
    """The candidates worth combining, as (the GPU they make room on, the fewest of them that can,
    them): for a pod of one GPU, those sharing each GPU it may use, the GPUs needing the fewest
    first (the pod lands on one, and a set that makes room for it with a pod not on that GPU is no
    smallest set); else all of them, anywhere on the node."""
    if shape.gpu_count != 1:
        return [(None, 1, list(victims))]
    groups: list[tuple[int | None, int, list[Victim]]] = []
    for gpu in sorted(usable):
        members = [v for v in victims if any(g.gpu == gpu for g in v.placement.grants())]
        fewest = _fewest_on_gpu(node, shape, gpu, members)
        if fewest <= len(members):
            groups.append((gpu, fewest, members))
    return sorted(groups, key=lambda group: group[1])
