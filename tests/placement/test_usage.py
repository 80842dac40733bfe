"""Usage-aware placement of best-effort pods: the rule over measured use, and what guaranteed pods
keep (tessera.placement.usage, fit, score, preemption, resize, inflight)."""

from __future__ import annotations

import random
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from tessera.contract import (
    MAX_CORES,
    Allocation,
    ContainerAllocation,
    GpuGrant,
    GpuUsage,
    NodeGpuUsage,
    QosClass,
    format_time,
    parse_resize,
)
from tessera.inflight import inflight_conflict
from tessera.placement import (
    POLICIES,
    ClusterContext,
    NodeFit,
    NodeRejection,
    NodeState,
    PlacementEngine,
    PodShape,
    ResizeRefusal,
    Shortfall,
    SpeedProfiles,
    UsageRule,
    Victim,
    apply,
    build_node,
    choose,
    choose_victims,
    filter_node,
    placed_since,
    placement_of,
    release,
    resize,
    score_fits,
    to_allocation,
)
from tests.placement.helpers import gpus, shape

NOW = datetime(2026, 11, 26, 6, 0, tzinfo=UTC)
RULE = UsageRule(margin_mib=1024, margin_percent=10, max_age=timedelta(seconds=60))
BINPACK = POLICIES[next(iter(POLICIES))]


def best_effort(*containers: tuple[int, int | None, int | None]) -> PodShape:
    return replace(shape(*containers), qos=QosClass.BEST_EFFORT)


def grant_alloc(qos: QosClass, *grants: tuple[str, int, int, bool]) -> Allocation:
    return Allocation(
        node="n",
        containers=(
            ContainerAllocation(
                name="main",
                gpus=tuple(
                    GpuGrant(uuid=u, memory_quota_mib=m, cores=c, oversubscribed=o) for u, m, c, o in grants
                ),
            ),
        ),
        qos=qos,
    )


def usage(*used: tuple[str, int], at: datetime = NOW) -> NodeGpuUsage:
    return NodeGpuUsage(
        time=format_time(at),
        gpus=tuple(
            GpuUsage(uuid=u, memory_used_mib=m, guaranteed_used_mib=m, utilization_percent=50)
            for u, m in used
        ),
    )


def measured_node(
    allocations: list[Allocation],
    used: dict[str, int] | None,
    *,
    count: int = 1,
    split: int = 4,
    since: list[Allocation] | None = None,
) -> NodeState:
    inventory = gpus("n", count=count, split=split)
    bounds = None if used is None else RULE.bounds(inventory, usage(*used.items()))
    return build_node("n", inventory, allocations, measured=bounds, placed_since=since or [])


def outcome(node: NodeState, pod: PodShape) -> NodeFit | NodeRejection:
    return filter_node(node, pod, SpeedProfiles(), BINPACK, ClusterContext())


GUARANTEED_FULL = grant_alloc(QosClass.STANDARD, ("GPU-n-0", 16384, 50, False))


# --------------------------------------------------------------------------------------------------
# The margin and the staleness


def test_the_margin_is_the_larger_of_the_floor_and_the_percent() -> None:
    assert RULE.margin(8192) == 1024  # 10% = 819 < 1024
    assert RULE.margin(81920) == 8192
    assert UsageRule(margin_mib=0, margin_percent=0).margin(16384) == 0


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("margin_mib", {"margin_mib": -1}),
        ("margin_percent", {"margin_percent": 101}),
        ("max_age", {"max_age": timedelta(0)}),
    ],
)
def test_a_bad_rule_is_refused_naming_the_field(field: str, kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=field):
        UsageRule(**kwargs)  # type: ignore[arg-type]


def test_a_measurement_older_than_the_max_age_is_stale() -> None:
    assert RULE.fresh(NOW - timedelta(seconds=60), NOW)
    assert not RULE.fresh(NOW - timedelta(seconds=61), NOW)


def test_bounds_cover_only_the_gpus_measured() -> None:
    inventory = gpus("n", count=2)
    assert RULE.bounds(inventory, usage(("GPU-n-1", 2000), ("GPU-x", 5))) == {"GPU-n-1": 2000 + 1638}


def test_placed_since_means_in_flight_or_bound_at_or_after_the_measurement() -> None:
    assert placed_since(NOW, NOW - timedelta(seconds=1), in_flight=True)
    assert placed_since(NOW, NOW, in_flight=False)
    assert placed_since(NOW, None, in_flight=False)
    assert not placed_since(NOW, NOW - timedelta(seconds=1), in_flight=False)


# --------------------------------------------------------------------------------------------------
# The fit


def test_a_best_effort_pod_fits_against_measured_use_where_requests_are_full() -> None:
    node = measured_node([GUARANTEED_FULL], {"GPU-n-0": 4096})
    fit = outcome(node, best_effort((1, 4096, 20)))
    assert isinstance(fit, NodeFit)
    assert fit.oversubscribed
    [grant] = fit.placement.grants()
    assert (grant.memory_quota_mib, grant.cores, grant.oversubscribed) == (4096, 20, True)
    allocation = to_allocation(node, fit.placement, ["main"], QosClass.BEST_EFFORT)
    assert allocation.containers[0].gpus[0].oversubscribed
    assert placement_of(node, allocation) == fit.placement


def test_measured_use_plus_margin_plus_request_must_fit() -> None:
    # 16384 - (4096 + 1638 margin) = 10650 MiB of headroom.
    node = measured_node([GUARANTEED_FULL], {"GPU-n-0": 4096})
    assert isinstance(outcome(node, best_effort((1, 10650, None))), NodeFit)
    rejection = outcome(node, best_effort((1, 10651, None)))
    assert isinstance(rejection, NodeRejection)
    assert rejection.shortfall == Shortfall.MEMORY
    assert "largest headroom 10650 MiB" in rejection.reason


def test_guaranteed_pods_are_never_placed_against_measured_use() -> None:
    node = measured_node([GUARANTEED_FULL], {"GPU-n-0": 0})
    for qos in (QosClass.STANDARD, QosClass.LATENCY_CRITICAL):
        rejection = outcome(node, replace(shape((1, 1024, None)), qos=qos))
        assert isinstance(rejection, NodeRejection)
        assert "measured use" not in rejection.reason


def test_stale_or_missing_usage_allows_nothing_against_use() -> None:
    node = measured_node([GUARANTEED_FULL], None)
    rejection = outcome(node, best_effort((1, 1024, None)))
    assert isinstance(rejection, NodeRejection)
    assert "no fresh measured use" in rejection.reason


def test_grants_placed_since_the_measurement_count_in_full() -> None:
    # A pod bound after the measurement has not started using: its 8192 MiB count on top of 1024.
    newer = grant_alloc(QosClass.STANDARD, ("GPU-n-0", 8192, 0, False))
    older = grant_alloc(QosClass.STANDARD, ("GPU-n-0", 8192, 0, False))
    node = measured_node([older, newer], {"GPU-n-0": 1024}, since=[newer])
    assert node.gpus[0].measured_mib == 1024 + 1638 + 8192
    assert isinstance(outcome(node, best_effort((1, 16384 - 1024 - 1638 - 8192, None))), NodeFit)
    assert isinstance(outcome(node, best_effort((1, 16384 - 1024 - 1638 - 8192 + 1, None))), NodeRejection)


def test_a_placement_against_use_counts_in_full_for_the_next_one() -> None:
    node = measured_node([GUARANTEED_FULL], {"GPU-n-0": 0})
    first = outcome(node, best_effort((1, 8192, None)))
    assert isinstance(first, NodeFit)
    after = apply(node, first.placement)
    assert after.gpus[0].measured_mib == 1638 + 8192
    assert after.gpus[0].borrowed_mib == 8192
    assert after.gpus[0].used_memory_mib == 16384  # by requests, unchanged
    assert isinstance(outcome(after, best_effort((1, 8192, None))), NodeRejection)
    # Released, its memory stays counted until the next measurement (what it used is in it).
    assert release(after, first.placement).gpus[0].measured_mib == 1638 + 8192


def test_guaranteed_fit_ignores_oversubscribed_grants_but_not_their_slices() -> None:
    half = grant_alloc(QosClass.STANDARD, ("GPU-n-0", 8192, 50, False))
    borrowed = grant_alloc(QosClass.BEST_EFFORT, ("GPU-n-0", 8192, 50, True))
    node = measured_node([half, borrowed], {"GPU-n-0": 2048}, split=3)
    gpu = node.gpus[0]
    assert (gpu.used_memory_mib, gpu.used_cores, gpu.used_slices, gpu.borrowed_mib) == (8192, 50, 2, 8192)
    assert isinstance(outcome(node, shape((1, 8192, 50))), NodeFit)
    fit = outcome(node, shape((1, 4096, 50)))
    assert isinstance(fit, NodeFit)
    assert not fit.oversubscribed
    # The last slice taken: no pod fits for want of a slice, though 4096 MiB are free by requests.
    full = apply(node, fit.placement)
    rejection = outcome(full, shape((1, 1, None)))
    assert isinstance(rejection, NodeRejection)
    assert rejection.shortfall == Shortfall.SLICES


def test_by_requests_is_preferred_on_the_node() -> None:
    # GPU 0 full by requests (but idle), GPU 1 free: the pod goes to GPU 1, by requests.
    node = measured_node([GUARANTEED_FULL], {"GPU-n-0": 0, "GPU-n-1": 0}, count=2)
    fit = outcome(node, best_effort((1, 4096, None)))
    assert isinstance(fit, NodeFit)
    assert not fit.oversubscribed
    assert [g.gpu for g in fit.placement.grants()] == [1]


def test_a_node_fitting_by_requests_is_preferred_to_one_against_use() -> None:
    engine = PlacementEngine(SpeedProfiles())
    inventory_a = gpus("a", count=1)
    full_a = grant_alloc(QosClass.STANDARD, ("GPU-a-0", 16384, 0, False)).model_copy(update={"node": "a"})
    engine.set_node(
        build_node("a", inventory_a, [full_a], measured=RULE.bounds(inventory_a, usage(("GPU-a-0", 0))))
    )
    inventory_b = gpus("b", count=1)
    busy_b = grant_alloc(QosClass.STANDARD, ("GPU-b-0", 12288, 0, False)).model_copy(update={"node": "b"})
    engine.set_node(build_node("b", inventory_b, [busy_b]))
    evaluation = engine.evaluate(best_effort((1, 4096, None)))
    by_name = {f.name: f for f in evaluation.fits}
    assert by_name["a"].oversubscribed and not by_name["b"].oversubscribed
    scores = dict(zip([f.name for f in evaluation.fits], score_fits(evaluation.fits), strict=True))
    assert scores["a"] == 0 < scores["b"]
    chosen = choose(evaluation.fits)
    assert chosen is not None and chosen.name == "b"


def test_against_use_the_gpu_with_most_headroom_scores_highest() -> None:
    fits = []
    for name, used in (("a", 8000), ("b", 2000)):
        inventory = gpus(name, count=1)
        full = grant_alloc(QosClass.STANDARD, (f"GPU-{name}-0", 16384, 0, False)).model_copy(
            update={"node": name}
        )
        state = build_node(
            name, inventory, [full], measured=RULE.bounds(inventory, usage((f"GPU-{name}-0", used)))
        )
        fit = outcome(state, best_effort((1, 2048, None)))
        assert isinstance(fit, NodeFit)
        fits.append(fit)
    chosen = choose(fits)
    assert chosen is not None and chosen.name == "b"


# --------------------------------------------------------------------------------------------------
# Preemption, the in-flight rule, resize


def test_evicting_an_oversubscribed_pod_frees_a_slice_only() -> None:
    half = grant_alloc(QosClass.STANDARD, ("GPU-n-0", 8192, 0, False))
    borrowed = grant_alloc(QosClass.BEST_EFFORT, ("GPU-n-0", 8192, 0, True))
    node = measured_node([half, borrowed], {"GPU-n-0": 0}, split=2)
    victims = [
        Victim("guaranteed", 0, placement_of(node, half)),
        Victim("borrowing", -10, placement_of(node, borrowed)),
    ]
    kwargs = {"profiles": SpeedProfiles(), "policy": BINPACK, "context": ClusterContext()}
    # A slice is what the 8192 MiB pod lacks: the best-effort pod is the cheaper victim.
    slice_short = choose_victims(node, shape((1, 8192, None)), 100, victims, **kwargs)  # type: ignore[arg-type]
    assert not isinstance(slice_short, str)
    assert [v.uid for v in slice_short.victims] == ["borrowing"]
    # Memory is what a 12288 MiB pod lacks: evicting the best-effort pod frees none of it.
    memory_short = choose_victims(node, shape((1, 12288, None)), 100, victims, **kwargs)  # type: ignore[arg-type]
    assert not isinstance(memory_short, str)
    assert "guaranteed" in [v.uid for v in memory_short.victims]


def test_an_oversubscribed_grant_is_not_in_flight_with_an_equal_one_by_requests() -> None:
    borrowed = grant_alloc(QosClass.BEST_EFFORT, ("GPU-n-0", 4096, 0, True))
    promised = grant_alloc(QosClass.BEST_EFFORT, ("GPU-n-0", 4096, 0, False))
    assert inflight_conflict(promised, {"ns/borrowing": borrowed}) is not None
    assert inflight_conflict(borrowed, {"ns/other": borrowed}) is None


def test_resizing_an_oversubscribed_grant_stays_against_measured_use() -> None:
    borrowed = grant_alloc(QosClass.BEST_EFFORT, ("GPU-n-0", 4096, 10, True))
    node = measured_node([GUARANTEED_FULL, borrowed], {"GPU-n-0": 6000})
    headroom = 16384 - 6000 - 1638
    grown = resize(node, borrowed, parse_resize(f"memory={4096 + headroom},cores=80"))
    assert isinstance(grown, Allocation)
    assert grown.containers[0].gpus[0] == GpuGrant(
        uuid="GPU-n-0", memory_quota_mib=4096 + headroom, cores=80, oversubscribed=True
    )
    refused = resize(node, borrowed, parse_resize(f"memory={4096 + headroom + 1}"))
    assert isinstance(refused, ResizeRefusal)
    assert refused.shortfall == Shortfall.MEMORY
    assert f"{headroom} MiB left by measured use" in refused.reason
    unmeasured = measured_node([GUARANTEED_FULL, borrowed], None)
    refused = resize(unmeasured, borrowed, parse_resize("memory=5000"))
    assert isinstance(refused, ResizeRefusal) and "no fresh measured use" in refused.reason
    shrunk = resize(unmeasured, borrowed, parse_resize("memory=1024"))
    assert isinstance(shrunk, Allocation) and shrunk.containers[0].gpus[0].oversubscribed


# --------------------------------------------------------------------------------------------------
# The promise, under random load


@pytest.mark.parametrize("seed", range(20))
def test_randomized_guaranteed_requests_never_exceed_a_gpus_memory_or_compute(seed: int) -> None:
    """Pods of every class come and go while the measured use changes at random (any value, however
    wrong): on every GPU the grants by requests stay within its memory and compute, the slices
    within its split, and only best-effort pods hold oversubscribed grants."""
    rng = random.Random(seed)
    inventory = gpus("n", count=3, split=6, memory_mib=16384)
    engine = PlacementEngine(SpeedProfiles())
    placed: dict[int, Allocation] = {}
    measured_at: int | None = None
    oversubscribed_seen = 0

    def rebuild() -> None:
        allocations = list(placed.values())
        bounds = None
        since: list[Allocation] = []
        if measured_at is not None:
            bounds = RULE.bounds(inventory, usage(*((g.uuid, rng.randrange(0, 16385)) for g in inventory)))
            since = [a for step, a in placed.items() if step >= measured_at]
        engine.set_node(build_node("n", inventory, allocations, measured=bounds, placed_since=since))

    rebuild()
    for step in range(300):
        action = rng.random()
        if action < 0.15 and placed:
            del placed[rng.choice(list(placed))]
            rebuild()
        elif action < 0.25:
            measured_at = None if rng.random() < 0.2 else step  # a measurement, or one gone stale
            rebuild()
        else:
            qos = rng.choice(list(QosClass))
            containers = tuple(
                (
                    rng.choice([1, 1, 2]),
                    rng.choice([1024, 2048, 4096, 8192, None]),
                    rng.choice([None, 10, 30, 60]),
                )
                for _ in range(rng.choice([1, 1, 2]))
            )
            pod = replace(shape(*containers), qos=qos)
            best = choose(engine.evaluate(pod).fits)
            if best is None:
                continue
            allocation = to_allocation(
                best.node, best.placement, [f"c{i}" for i in range(len(containers))], qos
            )
            oversubscribed_seen += best.oversubscribed
            placed[step] = allocation
            engine.commit(pod, best)
        state = engine.nodes["n"]
        for gpu in state.gpus:
            promised = [
                g for a in placed.values() for c in a.containers for g in c.gpus if g.uuid == gpu.uuid
            ]
            assert sum(g.memory_quota_mib for g in promised if not g.oversubscribed) <= gpu.total_memory_mib
            assert sum(g.cores for g in promised if not g.oversubscribed) <= MAX_CORES
            assert len(promised) <= gpu.slices
        for allocation in placed.values():
            if any(g.oversubscribed for c in allocation.containers for g in c.gpus):
                assert allocation.qos == QosClass.BEST_EFFORT
    assert oversubscribed_seen > 0, "the load placed something against measured use"
