"""PlacementEngine caches, state building from annotations, apply/release, the in-flight rule."""

from __future__ import annotations

from tessera.contract import Allocation, ContainerAllocation, GpuGrant, Policy
from tessera.inflight import InflightKey, allocation_keys, inflight_conflict
from tessera.placement import (
    POLICIES,
    ClusterContext,
    Grant,
    NodeFit,
    NodeState,
    Placement,
    PlacementEngine,
    PodShape,
    Shortfall,
    SpeedProfiles,
    apply,
    build_node,
    choose,
    filter_node,
    fit_keeping_inflight_rule,
    placement_keys,
    placement_of,
    release,
    to_allocation,
)
from tessera.placement.engine import KEPT_ANSWER_NAMES, UNKNOWN_NODE
from tests.placement.helpers import gpus, node, shape


def engine_with(*names: str) -> PlacementEngine:
    engine = PlacementEngine(SpeedProfiles())
    for name in names:
        engine.set_node(node(name))
    return engine


def test_evaluate_reuses_outcomes_until_the_node_changes() -> None:
    engine = engine_with("a", "b")
    s = shape((1, 4096, 30))
    first = engine.evaluate(s)
    again = engine.evaluate(s)
    assert [f is g for f, g in zip(first.fits, again.fits, strict=True)] == [True, True]
    best = choose(again.fits)
    assert best is not None
    engine.commit(s, best)
    third = engine.evaluate(s)
    by_name = {f.name: f for f in third.fits}
    assert by_name[best.name] is not {f.name: f for f in again.fits}[best.name]
    assert by_name[best.name].node.gpus[0].used_memory_mib == 4096


def test_an_equal_node_keeps_its_cached_outcomes_and_a_changed_one_drops_them() -> None:
    engine = engine_with("a", "b")
    s = shape((1, 4096, 30))
    first = engine.evaluate(s)
    engine.set_node(node("a"))  # rebuilt, equal: nothing to recompute
    assert [f is g for f, g in zip(first.fits, engine.evaluate(s).fits, strict=True)] == [True, True]
    engine.set_node(node("a", memory_mib=8192))
    fits = engine.evaluate(s).fits
    assert [f is g for f, g in zip(first.fits, fits, strict=True)] == [False, True]
    assert fits[0].node.gpus[0].total_memory_mib == 8192


def test_evaluate_keeps_the_order_named_when_some_nodes_changed() -> None:
    names = [f"n{i}" for i in range(20)]
    engine = engine_with(*names)
    s = shape((1, 12288, None))
    engine.evaluate(s, names)
    # Two nodes change (one can no longer take the pod), one name is unknown, one is named twice.
    engine.set_node(node("n3", memory_mib=8192))
    engine.set_node(node("n7", count=2))
    asked = ["n9", "ghost", *names, "n7"]
    evaluation = engine.evaluate(s, asked)
    assert [f.name for f in evaluation.fits] == [n for n in asked if n not in ("ghost", "n3")]
    assert [r.node for r in evaluation.rejections] == ["ghost", "n3"]
    assert evaluation.rejections[1].shortfall == Shortfall.CAPACITY
    assert len(evaluation.fits[-1].node.gpus) == 2


def test_the_same_names_again_recompute_only_the_nodes_changed_since() -> None:
    names = [f"n{i}" for i in range(KEPT_ANSWER_NAMES)]
    engine = engine_with(*names)
    s = shape((1, 12288, None))
    first = engine.evaluate(s, names)
    engine.evaluate(s, ["n3"])  # a bind's question in between
    engine.set_node(node("n3", memory_mib=8192))  # can no longer take the pod
    engine.set_node(node("n5", count=2))
    engine.remove_node("n7")
    engine.set_node(node("extra"))  # not asked about
    again = engine.evaluate(s, list(names))  # equal names, another list
    assert [f.name for f in again.fits] == [n for n in names if n not in ("n3", "n7")]
    assert [(r.node, r.shortfall) for r in again.rejections] == [
        ("n3", Shortfall.CAPACITY),
        ("n7", Shortfall.NODE),
    ]
    unchanged = {f.name: f for f in first.fits}
    assert all(f is unchanged[f.name] for f in again.fits if f.name != "n5")
    assert len({f.name: f for f in again.fits}["n5"].node.gpus) == 2
    engine.set_node(node("n3"))  # back: the next request sees it fit again
    assert [f.name for f in engine.evaluate(s, names).fits] == [n for n in names if n != "n7"]
    twice = [*names, "n3"]  # a name asked twice is answered at both places
    engine.evaluate(s, twice)
    engine.set_node(node("n3", memory_mib=8192))
    assert [r.node for r in engine.evaluate(s, twice).rejections] == ["n3", "n7", "n3"]


def test_unknown_names_are_rejected_as_without_inventory() -> None:
    evaluation = engine_with("a").evaluate(shape((1, 1024, None)), ["a", "ghost"])
    assert [f.name for f in evaluation.fits] == ["a"]
    [rejection] = evaluation.rejections
    assert (rejection.node, rejection.reason, rejection.shortfall) == ("ghost", UNKNOWN_NODE, Shortfall.NODE)


def test_pod_policy_annotation_overrides_the_default() -> None:
    engine = engine_with("a")
    assert engine.policy_for(shape((1, 1024, None))).name == "binpack"
    assert engine.policy_for(shape((1, 1024, None), policy=Policy.SPREAD)).name == "spread"
    assert engine.policy_for(shape((1, 1024, None), policy=Policy.FRAGMENTATION)).name == "fragmentation"


def test_commit_records_the_shape_mix() -> None:
    engine = engine_with("a")
    s = shape((1, 1024, None))
    engine.commit(s, engine.evaluate(s).fits[0])
    assert engine.context.shape_mix.counts == {s: 1}
    assert engine.context.version == 1


def test_commit_without_a_fit_records_the_shape_only_and_a_fixed_mix_stays() -> None:
    engine = engine_with("a")
    s = shape((1, 1024, None))
    before = engine.nodes["a"]
    engine.commit(s)  # the extender: the node's state already counts the pod
    assert engine.nodes["a"] is before
    assert engine.context.shape_mix.counts == {s: 1}
    fixed = PlacementEngine(SpeedProfiles(), context=ClusterContext(learns=False))
    fixed.set_node(node("a"))
    fixed.commit(s, fixed.evaluate(s).fits[0])  # the simulator: a target workload known up front
    assert fixed.nodes["a"].gpus[0].used_memory_mib == 1024
    assert fixed.context.shape_mix.counts == {}
    assert fixed.context.version == 0


def test_the_policy_table_has_one_policy_per_contract_policy() -> None:
    assert set(POLICIES) == set(Policy)
    assert all(placement.name == policy.value for policy, placement in POLICIES.items())
    assert PlacementEngine(SpeedProfiles(), Policy.SPREAD).default_policy is POLICIES[Policy.SPREAD]
    own = POLICIES[Policy.BINPACK]
    s = shape((1, 1024, None), policy=Policy.FRAGMENTATION)
    # A policy object as the default (the simulator's baselines); a pod's annotation still wins.
    assert PlacementEngine(SpeedProfiles(), own).policy_for(s) is POLICIES[Policy.FRAGMENTATION]


def test_allocation_round_trip_and_build_node_from_annotations() -> None:
    n = node("n")
    engine = PlacementEngine(SpeedProfiles())
    engine.set_node(n)
    s = shape((2, 4096, 25), (1, 1024, None))
    fit = engine.evaluate(s).fits[0]
    allocation = to_allocation(n, fit.placement, ["main", "side"])
    assert allocation.node == "n"
    assert [c.name for c in allocation.containers] == ["main", "side"]
    assert placement_of(n, allocation) == fit.placement
    rebuilt = build_node("n", gpus("n"), [allocation])
    assert rebuilt == apply(n, fit.placement)
    assert release(rebuilt, fit.placement) == n


def test_build_node_ignores_grants_on_gpus_it_does_not_have() -> None:
    stray = Allocation(
        node="n",
        containers=(
            ContainerAllocation(name="c", gpus=(GpuGrant(uuid="GPU-gone", memory_quota_mib=1, cores=1),)),
        ),
    )
    assert build_node("n", gpus("n"), [stray]) == node("n")


def _alloc(node_name: str, *containers: tuple[tuple[str, int, int], ...]) -> Allocation:
    return Allocation(
        node=node_name,
        containers=tuple(
            ContainerAllocation(
                name=f"c{i}", gpus=tuple(GpuGrant(uuid=u, memory_quota_mib=m, cores=c) for u, m, c in grants)
            )
            for i, grants in enumerate(containers)
        ),
    )


def test_inflight_same_key_or_other_gpu_count_may_fly_together() -> None:
    mine = _alloc("n", (("G0", 4096, 30),))
    assert inflight_conflict(mine, {}) is None
    assert inflight_conflict(mine, {"ns/twin": _alloc("n", (("G0", 4096, 30),))}) is None
    assert inflight_conflict(mine, {"ns/pair": _alloc("n", (("G1", 4096, 30), ("G2", 4096, 30)))}) is None


def test_inflight_different_key_of_the_same_gpu_count_conflicts() -> None:
    mine = _alloc("n", (("G0", 4096, 30),))
    other = {"ns/other": _alloc("n", (("G1", 4096, 30),))}
    message = inflight_conflict(mine, other)
    assert message is not None
    assert message.startswith("pod ns/other is still being admitted on node n with a 1-GPU container on G1")
    # Same GPU, different quota: also a different key.
    assert inflight_conflict(mine, {"ns/q": _alloc("n", (("G0", 2048, 30),))}) is not None


def test_one_pods_own_containers_may_differ() -> None:
    mine = _alloc("n", (("G0", 4096, 30),), (("G1", 4096, 30),))
    assert inflight_conflict(mine, {}) is None
    assert inflight_conflict(mine, {"ns/o": _alloc("n", (("G0", 4096, 30),))}) is not None


def _fit_on(n: NodeState, s: PodShape) -> NodeFit:
    outcome = filter_node(n, s, SpeedProfiles(), POLICIES[Policy.BINPACK], ClusterContext())
    assert isinstance(outcome, NodeFit)
    return outcome


def test_a_replica_joins_the_inflight_key_instead_of_being_refused() -> None:
    n = node("n", count=2)
    s = shape((1, 4096, 25))
    # GPU 1 is partly used, so binpack prefers it; an in-flight replica sits on GPU 0.
    n = apply(n, Placement("n", ((Grant(1, 2048, 10),),)))
    inflight = {"ns/first": [InflightKey(1, ("GPU-n-0",), ((4096, 25, False),))]}
    fit = _fit_on(n, s)
    assert fit.placement.containers[0][0].gpu == 1
    kept = fit_keeping_inflight_rule(
        fit,
        s,
        profiles=SpeedProfiles(),
        policy=POLICIES[Policy.BINPACK],
        context=ClusterContext(),
        inflight=inflight,
    )
    assert isinstance(kept, NodeFit)
    assert kept.placement.containers[0][0].gpu == 0


def test_other_quotas_are_refused_with_the_reason() -> None:
    n = node("n", count=2)
    inflight = {"ns/first": [InflightKey(1, ("GPU-n-0",), ((4096, 25, False),))]}
    s = shape((1, 8192, 25))
    refused = fit_keeping_inflight_rule(
        _fit_on(n, s),
        s,
        profiles=SpeedProfiles(),
        policy=POLICIES[Policy.BINPACK],
        context=ClusterContext(),
        inflight=inflight,
    )
    assert isinstance(refused, str)
    assert refused.startswith(
        "pod ns/first is still being admitted on node n with a 1-GPU container on GPU-n-0"
    )


def test_placement_keys_match_the_allocation_keys() -> None:
    n = node("n")
    s = shape((2, 4096, 25), (1, 1024, None))
    fit = _fit_on(n, s)
    assert placement_keys(n, fit.placement) == allocation_keys(to_allocation(n, fit.placement, ["a", "b"]))
