"""choose_victims: which lower-priority pods to evict on a node so that a pod fits on its GPUs."""

from __future__ import annotations

import random
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from itertools import chain, combinations

import pytest

from tessera.contract import Policy
from tessera.placement import (
    POLICIES,
    ClusterContext,
    Grant,
    NodeFit,
    NodeState,
    Placement,
    PodShape,
    Preemption,
    SpeedProfiles,
    Victim,
    apply,
    budget_violations,
    choose_victims,
    filter_node,
    release,
)
from tessera.placement.preemption import preference
from tests.placement.helpers import node, shape

PROFILES = SpeedProfiles()
BINPACK = POLICIES[Policy.BINPACK]
EPOCH = datetime(2026, 1, 1, tzinfo=UTC)


def place(
    n: NodeState, uid: str, priority: int, grants: Sequence[tuple[int, int, int]], **kw: object
) -> Victim:
    """A victim holding ``grants`` (GPU position, MiB, cores) on ``n`` (one container)."""
    placement = Placement(n.name, (tuple(Grant(*g) for g in grants),))
    return Victim(uid, priority, placement, **kw)  # type: ignore[arg-type]


def on(n: NodeState, victims: Sequence[Victim]) -> NodeState:
    for v in victims:
        n = apply(n, v.placement)
    return n


def choose(
    n: NodeState, s: PodShape, priority: int, victims: Sequence[Victim], allowed: Sequence[int] = ()
) -> Preemption | str:
    return choose_victims(
        on(n, victims),
        s,
        priority,
        victims,
        allowed,
        profiles=PROFILES,
        policy=BINPACK,
        context=ClusterContext(),
    )


def uids(answer: Preemption | str) -> list[str]:
    assert isinstance(answer, Preemption), answer
    return [v.uid for v in answer.victims]


def test_the_two_pods_on_the_gpu_that_frees_enough() -> None:
    """docs/placement.md's example: two 16 GiB GPUs full of priority-0 pods; a 12 GiB pod of priority
    1000 needs two of them gone, and only GPU 0's two 6 GiB pods free enough together."""
    n = node("n", count=2, memory_mib=16384, split=4)
    pods = [
        place(n, "a", 0, [(0, 6144, 0)]),
        place(n, "b", 0, [(0, 6144, 0)]),
        place(n, "c", 0, [(0, 2048, 0)]),
        place(n, "d", 0, [(0, 1024, 0)]),
        *(place(n, f"e{i}", 0, [(1, 4096, 0)]) for i in range(4)),
    ]
    answer = choose(n, shape((1, 12288, None)), 1000, pods)
    assert sorted(uids(answer)) == ["a", "b"]
    assert isinstance(answer, Preemption)
    assert answer.budget_violations == 0
    assert [g.gpu for g in answer.fit.placement.grants()] == [0]


def test_a_pod_that_fits_already_needs_no_victim() -> None:
    n = node("n", count=1)
    pods = [place(n, "a", 0, [(0, 4096, 0)])]
    answer = choose(n, shape((1, 4096, None)), 1000, pods)
    assert uids(answer) == []


def test_fewer_victims_before_lower_priority() -> None:
    n = node("n", count=2, memory_mib=16384)
    pods = [
        place(n, "big", 50, [(0, 12288, 0)]),
        place(n, "low-1", 0, [(1, 6144, 0)]),
        place(n, "low-2", 0, [(1, 6144, 0)]),
    ]
    assert uids(choose(n, shape((1, 12288, None)), 100, pods)) == ["big"]


def test_lower_priority_between_sets_of_one_size() -> None:
    n = node("n", count=2, memory_mib=16384)
    pods = [place(n, "mid", 50, [(0, 12288, 0)]), place(n, "low", 10, [(1, 12288, 0)])]
    assert uids(choose(n, shape((1, 8192, None)), 100, pods)) == ["low"]


def test_the_most_recently_bound_when_all_else_is_equal() -> None:
    n = node("n", count=2, memory_mib=16384)
    old = place(n, "old", 0, [(0, 12288, 0)], bound_at=EPOCH)
    new = place(n, "new", 0, [(1, 12288, 0)], bound_at=EPOCH + timedelta(hours=1))
    assert uids(choose(n, shape((1, 8192, None)), 100, [old, new])) == ["new"]


def test_never_a_pod_of_equal_or_higher_priority() -> None:
    n = node("n", count=1, memory_mib=16384)
    pods = [place(n, "peer", 100, [(0, 8192, 0)]), place(n, "boss", 200, [(0, 4096, 0)])]
    assert choose(n, shape((1, 12288, None)), 100, pods) == (
        "no pod of lower priority holds a share of a GPU the pod may use; "
        "no GPU with 12288 MiB free; largest free 4096 MiB"
    )


def test_no_eviction_can_make_room() -> None:
    n = node("n", count=1, memory_mib=16384)
    pods = [place(n, "keep", 1000, [(0, 8192, 0)]), place(n, "low", 0, [(0, 4096, 0)])]
    answer = choose(n, shape((1, 12288, None)), 500, pods)
    assert (
        answer
        == "not even with all 1 lower-priority pods evicted: no GPU with 12288 MiB free; largest free 8192 MiB"
    )


def test_a_node_the_pod_can_never_use_is_no_candidate() -> None:
    n = node("n", count=1, memory_mib=16384)
    pods = [place(n, "low", 0, [(0, 8192, 0)])]
    answer = choose(n, shape((1, 32768, None)), 500, pods)
    assert answer == "no GPU with 32768 MiB of memory; largest has 16384 MiB"


def test_pods_on_gpus_of_another_model_do_not_count() -> None:
    n = node("n", count=1, memory_mib=16384, model="Tesla T4")
    pods = [place(n, "low", 0, [(0, 8192, 0)])]
    answer = choose(n, shape((1, 4096, None), models=("A100",)), 500, pods)
    assert isinstance(answer, str) and "models A100" in answer


def test_compute_and_slices_count_too() -> None:
    n = node("n", count=1, memory_mib=16384, split=2)
    pods = [place(n, "cores", 0, [(0, 1024, 80)]), place(n, "slice", 0, [(0, 1024, 10)])]
    # 50% compute: only the 80% pod's eviction frees enough (and a slice with it).
    assert uids(choose(n, shape((1, 1024, 50)), 10, pods)) == ["cores"]
    # No compute asked: one slice is enough, the cheaper pod to lose is the one bound last.
    newer = [
        place(n, "cores", 0, [(0, 1024, 80)], bound_at=EPOCH),
        place(n, "slice", 0, [(0, 1024, 10)], bound_at=EPOCH + timedelta(minutes=1)),
    ]
    assert uids(choose(n, shape((1, 1024, None)), 10, newer)) == ["slice"]


def test_a_budget_is_kept_when_a_larger_set_keeps_it() -> None:
    """kube-scheduler's first preference: fewer PodDisruptionBudget violations, then fewer victims."""
    n = node("n", count=2, memory_mib=16384)
    pods = [
        place(n, "guarded", 0, [(0, 12288, 0)], budgets=(0,)),
        place(n, "x", 0, [(1, 6144, 0)]),
        place(n, "y", 0, [(1, 6144, 0)]),
    ]
    assert sorted(uids(choose(n, shape((1, 12288, None)), 100, pods, allowed=[0]))) == ["x", "y"]
    # With a disruption allowed, the one pod is enough and breaks nothing.
    answer = choose(n, shape((1, 12288, None)), 100, pods, allowed=[1])
    assert uids(answer) == ["guarded"]
    assert isinstance(answer, Preemption) and answer.budget_violations == 0


def test_when_every_set_breaks_a_budget_the_fewest_breaks_win() -> None:
    """kube-scheduler's greedy way (put back the most important first) would keep "big" and evict
    both small pods, two violations; evicting "big" alone breaks the budget once."""
    n = node("n", count=1, memory_mib=16384)
    pods = [
        place(n, "big", 5, [(0, 8192, 0)], budgets=(0,)),
        place(n, "small-1", 0, [(0, 4096, 0)], budgets=(0,)),
        place(n, "small-2", 0, [(0, 4096, 0)], budgets=(0,)),
    ]
    answer = choose(n, shape((1, 8192, None)), 100, pods, allowed=[0])
    assert uids(answer) == ["big"]
    assert isinstance(answer, Preemption) and answer.budget_violations == 1


def test_budget_violations_are_counted_as_kube_scheduler_counts_them() -> None:
    n = node("n", count=1)
    a = place(n, "a", 10, [(0, 1024, 0)], budgets=(0,))
    b = place(n, "b", 5, [(0, 1024, 0)], budgets=(0, 1))
    c = place(n, "c", 1, [(0, 1024, 0)], budgets=(1,))
    # Most important first: a takes budget 0's one disruption; b breaks budget 0; c then breaks 1
    # (b took its one).
    assert budget_violations([c, b, a], [1, 1]) == 2
    assert budget_violations([a, c], [1, 1]) == 0
    assert budget_violations([a, b, c], [0, 5]) == 2


def test_a_two_gpu_pod_frees_two_gpus() -> None:
    n = node("n", count=3, memory_mib=16384)
    pods = [
        place(n, "g0", 0, [(0, 12288, 0)]),
        place(n, "g1", 0, [(1, 12288, 0)]),
        place(n, "g2", 0, [(2, 8192, 0)]),
        place(n, "g2b", 0, [(2, 8192, 0)]),
    ]
    assert sorted(uids(choose(n, shape((2, 10240, None)), 100, pods))) == ["g0", "g1"]


def test_a_victim_spanning_two_gpus_frees_both() -> None:
    n = node("n", count=2, memory_mib=16384)
    pods = [place(n, "wide", 0, [(0, 12288, 0), (1, 12288, 0)]), place(n, "one", 0, [(1, 2048, 0)])]
    assert uids(choose(n, shape((2, 8192, None)), 100, pods)) == ["wide"]


def test_the_search_stays_within_its_budget_and_still_answers() -> None:
    n = node("n", count=1, memory_mib=65536, split=32)
    pods = [place(n, f"p{i:02d}", i % 3, [(0, 2048, 0)], budgets=(0,)) for i in range(32)]
    answer = choose_victims(
        on(n, pods),
        shape((1, 16384, None)),
        100,
        pods,
        [0],
        profiles=PROFILES,
        policy=BINPACK,
        context=ClusterContext(),
        max_sets=50,
    )
    assert isinstance(answer, Preemption)
    assert len(answer.victims) == 8  # 8 x 2 GiB: every set of 8 is as good as any by budgets and count
    assert all(v.priority == 0 for v in answer.victims)


@pytest.mark.parametrize("seed", range(100))
def test_out_of_sets_the_answer_is_kube_schedulers_greedy_one(seed: int) -> None:
    """With no set to weigh, the answer is still feasible, of lower priority, and none of its victims
    can be spared."""
    n, victims, wanted, priority, allowed = _random_case(random.Random(seed))
    answer = choose_victims(
        n, wanted, priority, victims, allowed, profiles=PROFILES, policy=BINPACK, context=ClusterContext(),
        max_sets=0,
    )  # fmt: skip
    if not isinstance(answer, Preemption) or not answer.victims:
        return
    assert all(v.priority < priority for v in answer.victims)
    assert _fits(n, wanted, answer.victims)
    for spared in answer.victims:
        assert not _fits(n, wanted, [v for v in answer.victims if v is not spared])


# --------------------------------------------------------------------------------------------------
# Randomized: the answer makes the pod fit, evicts only lower priorities, and no set is better.


def _random_case(rng: random.Random) -> tuple[NodeState, list[Victim], PodShape, int, list[int]]:
    base = node("n", count=rng.choice([1, 2, 3]), memory_mib=16384, split=rng.choice([2, 3, 4]))
    current = base
    victims: list[Victim] = []
    for i in range(rng.randint(1, 8)):
        count = 1 if rng.random() < 0.8 or len(base.gpus) == 1 else 2
        gpus = rng.sample(range(len(base.gpus)), count)
        memory = rng.choice([2048, 4096, 6144, 8192])
        cores = rng.choice([0, 0, 10, 30, 50])
        if not all(
            current.gpus[g].free_memory_mib >= memory
            and current.gpus[g].free_cores >= cores
            and current.gpus[g].free_slices >= 1
            for g in gpus
        ):
            continue
        budgets = tuple(b for b in (0, 1) if rng.random() < 0.4)
        victim = Victim(
            f"p{i}",
            rng.choice([0, 10, 100, 1000]),
            Placement("n", (tuple(Grant(g, memory, cores) for g in gpus),)),
            budgets,
            EPOCH + timedelta(minutes=rng.randint(0, 5)),
        )
        current = apply(current, victim.placement)
        victims.append(victim)
    wanted = shape(
        (
            1 if rng.random() < 0.8 or len(base.gpus) == 1 else 2,
            rng.choice([2048, 4096, 8192, 12288, 16384]),
            rng.choice([None, 20, 60]),
        )
    )
    return current, victims, wanted, rng.choice([10, 100, 500]), [rng.randint(0, 1), rng.randint(0, 2)]


def _fits(n: NodeState, s: PodShape, evicted: Sequence[Victim]) -> bool:
    for v in evicted:
        n = release(n, v.placement)
    return isinstance(filter_node(n, s, PROFILES, BINPACK, ClusterContext()), NodeFit)


@pytest.mark.parametrize("seed", range(600))
def test_randomized_answers_are_feasible_lower_priority_and_best(seed: int) -> None:
    rng = random.Random(seed)
    n, victims, wanted, priority, allowed = _random_case(rng)
    answer = choose_victims(
        n, wanted, priority, victims, allowed, profiles=PROFILES, policy=BINPACK, context=ClusterContext()
    )
    lower = [v for v in victims if v.priority < priority]
    subsets = list(chain.from_iterable(combinations(lower, k) for k in range(1, len(lower) + 1)))
    feasible = [s for s in subsets if _fits(n, wanted, s)]
    if _fits(n, wanted, ()):
        assert isinstance(answer, Preemption) and answer.victims == ()
        return
    if not feasible:
        assert isinstance(answer, str), answer
        return
    assert isinstance(answer, Preemption), answer
    assert answer.victims, "the pod does not fit without evictions"
    assert all(v.priority < priority for v in answer.victims), "a victim of equal or higher priority"
    assert _fits(n, wanted, answer.victims), "the pod does not fit once the victims are gone"
    assert answer.budget_violations == budget_violations(answer.victims, allowed)
    best = min(preference(s, allowed) for s in feasible)
    assert preference(answer.victims, allowed) == best
    fewest = min(len(s) for s in feasible if budget_violations(s, allowed) == best[0])
    assert len(answer.victims) == fewest, "not minimal in count among the sets breaking fewest budgets"
    assert [v.priority for v in answer.victims] == sorted((v.priority for v in answer.victims), reverse=True)
