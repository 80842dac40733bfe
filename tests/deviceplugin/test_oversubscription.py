"""The pure rules of best-effort containers that borrow GPU memory: their quota is what the others
leave, never below what they hold; guaranteed containers' waits evict them newest first; the measured
use is published on real change only."""

from __future__ import annotations

import dataclasses

import pytest

from deviceplugin.oversubscription import (
    Holder,
    driver_checked,
    measured_use,
    plan_gpu,
    usage_worth_publishing,
)
from tessera.contract import MIB, GpuUsage, QosClass

GPU = 16384 * MIB
MARGIN = 512 * MIB


def holder(
    key: str,
    qos: QosClass,
    *,
    grant: int,
    used: int = 0,
    waiting: int = 0,
    oversubscribed: bool = False,
    served_at: float = 0.0,
) -> Holder[str]:
    return Holder(
        key=key,
        pod=f"uid-{key}",
        qos=qos,
        grant_bytes=grant * MIB,
        oversubscribed=oversubscribed,
        used_bytes=used * MIB,
        waiting_bytes=waiting * MIB,
        served_at=served_at,
    )


def guaranteed(key: str, grant: int, used: int = 0, waiting: int = 0) -> Holder[str]:
    return holder(key, QosClass.STANDARD, grant=grant, used=used, waiting=waiting)


def borrower(key: str, grant: int, used: int = 0, served_at: float = 0.0) -> Holder[str]:
    return holder(key, QosClass.BEST_EFFORT, grant=grant, used=used, oversubscribed=True, served_at=served_at)


def test_a_borrowers_quota_is_what_the_others_leave_less_the_margin() -> None:
    plan = plan_gpu(GPU, [guaranteed("g", 12288, used=4096), borrower("b", 16384)], MARGIN, frozenset())
    assert plan.quotas == {"b": (16384 - 4096 - 512) * MIB}
    assert plan.oversubscribed
    assert plan.evict == () and plan.shortfall_bytes == 0


def test_a_borrowers_quota_never_exceeds_its_grant() -> None:
    plan = plan_gpu(GPU, [guaranteed("g", 12288, used=1024), borrower("b", 4096)], MARGIN, frozenset())
    assert plan.quotas == {"b": 4096 * MIB}


def test_shrinking_never_goes_below_what_the_borrower_holds() -> None:
    # The guaranteed container grew to 12 GiB while the borrower holds 6 GiB: its quota is what it
    # holds (new allocations refused), nothing is taken from it.
    plan = plan_gpu(
        GPU, [guaranteed("g", 16384, used=12288), borrower("b", 8192, used=6144)], MARGIN, frozenset()
    )
    assert plan.quotas == {"b": 6144 * MIB}


def test_a_borrower_with_nothing_left_gets_one_byte() -> None:
    plan = plan_gpu(GPU, [guaranteed("g", 16384, used=16000), borrower("b", 8192)], MARGIN, frozenset())
    assert plan.quotas == {"b": 1}


def test_best_effort_placed_by_requests_and_guaranteed_containers_keep_their_grants() -> None:
    placed = holder("p", QosClass.BEST_EFFORT, grant=2048, used=1024)
    plan = plan_gpu(GPU, [guaranteed("g", 8192, used=8000), placed], MARGIN, frozenset())
    assert plan.quotas == {} and not plan.oversubscribed
    # A guaranteed container that waits beside no borrower evicts nothing: nobody borrows.
    plan = plan_gpu(GPU, [guaranteed("g", 8192, used=8000, waiting=100), placed], MARGIN, frozenset())
    assert plan.evict == ()


def test_a_wait_evicts_borrowers_newest_first_until_what_they_hold_covers_it() -> None:
    holders = [
        guaranteed("g", 16384, used=8192, waiting=3000),
        borrower("old", 4096, used=3072, served_at=1.0),
        borrower("mid", 4096, used=2048, served_at=2.0),
        borrower("new", 4096, used=2048, served_at=3.0),
        borrower("idle", 4096, used=0, served_at=4.0),  # holds nothing: evicting it frees nothing
    ]
    plan = plan_gpu(GPU, holders, MARGIN, frozenset(), free_bytes=0)
    assert plan.shortfall_bytes == 3000 * MIB
    assert plan.evict == ("new", "mid")


def test_evictions_under_way_count_as_memory_coming_back() -> None:
    holders = [
        guaranteed("g", 16384, used=8192, waiting=3000),
        borrower("old", 4096, used=3072, served_at=1.0),
        borrower("new", 4096, used=2048, served_at=3.0),
    ]
    plan = plan_gpu(GPU, holders, MARGIN, frozenset({"new"}), free_bytes=0)
    assert plan.shortfall_bytes == 952 * MIB
    assert plan.evict == ("old",)
    assert plan_gpu(GPU, holders, MARGIN, frozenset({"new", "old"}), free_bytes=0).evict == ()


def test_a_wait_evicts_only_what_the_driver_confirms_is_missing() -> None:
    """A guaranteed container's region says it waits for 4096 MiB (it could write that itself): with
    the GPU's free memory by the driver covering it, nobody is evicted; short by 1000 MiB, borrowers
    holding 1000 MiB are; with NVML unable to say, nobody."""
    holders = [
        guaranteed("g", 16384, used=4096, waiting=4096),
        borrower("old", 4096, used=1024, served_at=1.0),
        borrower("new", 4096, used=1024, served_at=2.0),
    ]
    assert plan_gpu(GPU, holders, MARGIN, frozenset(), free_bytes=8192 * MIB).evict == ()
    short = plan_gpu(GPU, holders, MARGIN, frozenset(), free_bytes=3096 * MIB)
    assert (short.shortfall_bytes, short.evict) == (1000 * MIB, ("new",))
    assert plan_gpu(GPU, holders, MARGIN, frozenset(), free_bytes=None).evict == ()


def test_measured_use_is_the_drivers_not_the_regions() -> None:
    """A region forged to say 1,000,000 MiB on a 16 GiB GPU counts its grant at most, and with NVML's
    word its pod's actual holding; a zeroed region whose pod NVML shows holding 2 GiB counts 2 GiB."""
    forged = guaranteed("forged", 4096, used=1_000_000, waiting=1_000_000)
    zeroed = guaranteed("zeroed", 4096, used=0)
    honest = guaranteed("honest", 4096, used=1024)
    cut = driver_checked([forged, zeroed, honest], None)
    assert [(h.used_bytes // MIB, h.waiting_bytes // MIB) for h in cut] == [(4096, 4096), (0, 0), (1024, 0)]
    by_driver = {"uid-forged": 300 * MIB, "uid-zeroed": 2048 * MIB, "uid-honest": 1024 * MIB}
    checked = driver_checked([forged, zeroed, honest], by_driver)
    assert [h.used_bytes // MIB for h in checked] == [300, 2048, 1024]
    assert measured_use("GPU-0", checked, 0).guaranteed_used_mib == 300 + 2048 + 1024
    # It may wait for no more than its grant leaves beside what the driver says it holds: what an
    # allocation within its quota could be refused, and so take back anyway.
    assert [h.waiting_bytes // MIB for h in checked] == [4096 - 300, 0, 0]
    zeroed_waiting = dataclasses.replace(zeroed, waiting_bytes=4096 * MIB)
    assert driver_checked([zeroed_waiting], by_driver)[0].waiting_bytes == (4096 - 2048) * MIB


def test_a_pods_containers_share_what_the_driver_says_the_pod_holds() -> None:
    first = dataclasses.replace(holder("a", QosClass.STANDARD, grant=4096, used=3000), pod="uid-pod")
    second = dataclasses.replace(holder("b", QosClass.STANDARD, grant=4096, used=1000), pod="uid-pod")
    checked = driver_checked([first, second], {"uid-pod": 2000 * MIB})
    assert [h.used_bytes // MIB for h in checked] == [1500, 500]
    # Both zeroed: shared by their grants.
    zeroed = [dataclasses.replace(h, used_bytes=0) for h in (first, second)]
    assert [h.used_bytes // MIB for h in driver_checked(zeroed, {"uid-pod": 2000 * MIB})] == [1000, 1000]


def test_measured_use_rounds_up_and_splits_the_guaranteed_part() -> None:
    holders = [guaranteed("g", 8192, used=100), borrower("b", 4096, used=50), guaranteed("h", 10)]
    use = measured_use("GPU-0", [*holders, holder("x", QosClass.LATENCY_CRITICAL, grant=1, used=0)], 140)
    assert use == GpuUsage(
        uuid="GPU-0", memory_used_mib=150, guaranteed_used_mib=100, utilization_percent=100
    )
    one_byte = Holder("k", "uid-k", QosClass.STANDARD, MIB, False, 1, 0, 0.0)
    assert measured_use("GPU-0", [one_byte], 5).memory_used_mib == 1


def use(mib: int, guaranteed_mib: int = 0, percent: int = 0, uuid: str = "GPU-0") -> GpuUsage:
    return GpuUsage(
        uuid=uuid, memory_used_mib=mib, guaranteed_used_mib=guaranteed_mib, utilization_percent=percent
    )


@pytest.mark.parametrize(
    ("before", "after", "since", "publish"),
    [
        (None, [use(0)], 0.0, True),  # never published
        ([use(100)], [use(100)], 1000.0, False),  # nothing changed
        ([use(100)], [use(1000)], 1.0, False),  # too soon after the last patch
        ([use(100)], [use(356)], 6.0, True),  # moved by the threshold
        ([use(100)], [use(355)], 6.0, False),  # moved by less
        ([use(100, 0)], [use(100, 0, 10)], 6.0, True),  # utilisation moved by 10 points
        ([use(100)], [use(101)], 60.0, True),  # a heartbeat's time passed: any change
        ([use(100)], [use(100), use(0, uuid="GPU-1")], 6.0, True),  # a GPU more
    ],
)
def test_the_measured_use_is_published_on_real_change_and_never_too_often(
    before: list[GpuUsage] | None, after: list[GpuUsage], since: float, publish: bool
) -> None:
    worth = usage_worth_publishing(
        before,
        after,
        change_mib=256,
        change_percent=10,
        since_published=since,
        min_interval=5.0,
        max_interval=30.0,
    )
    assert worth == publish


@pytest.mark.parametrize(("since", "publish"), [(6.0, True), (1.0, False)])
def test_a_measurement_of_newly_served_containers_is_published_though_nothing_moved(
    since: float, publish: bool
) -> None:
    """A new container that uses nothing yet changes no number, but the extender counts its pod at
    the full request until a measurement newer than its bind."""
    worth = usage_worth_publishing(
        [use(100)],
        [use(100)],
        change_mib=256,
        change_percent=10,
        since_published=since,
        min_interval=5.0,
        max_interval=30.0,
        newly_measured=True,
    )
    assert worth == publish
