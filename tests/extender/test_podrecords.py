"""Pod records: what a Pod object holds (bound, not finished, readable), its version, and a live
resize being written counted at the larger quotas."""

from __future__ import annotations

import logging

import pytest

from extender.podrecords import bound_record, parse_pod, resource_version, with_resize
from tessera.contract import KEYS, Allocation, ContainerAllocation, GpuGrant, Phase
from tests.extender.statecase import NOW, allocation, pod


def test_only_a_bound_unfinished_pod_with_a_readable_allocation_holds_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    held = parse_pod(pod("a", bound=True), KEYS)
    assert held is not None
    assert (held.uid, held.ref, held.allocation, held.phase, held.bind_time) == (
        "a",
        "ns/a",
        allocation(),
        "allocating",
        NOW,
    )
    assert parse_pod(pod("a", bound=False), KEYS) is None
    assert parse_pod(pod("a", bound=True, status="Succeeded"), KEYS) is None
    broken = pod("a", bound=True)
    broken["metadata"]["annotations"][KEYS.allocation] = "{"
    with caplog.at_level(logging.WARNING, logger="extender.podrecords"):
        assert parse_pod(broken, KEYS) is None
    assert caplog.records[0].getMessage().startswith("ignoring ")


def test_a_version_that_is_no_integer_is_none() -> None:
    assert resource_version({"resourceVersion": "42"}) == 42
    assert resource_version({"resourceVersion": "abc"}) is None
    assert resource_version({}) is None


def test_a_resize_being_written_counts_each_grant_at_the_larger_quota() -> None:
    current = allocation(memory=4096)  # 4096 MiB, 30 cores on GPU-n-0
    resized = Allocation(
        node="n",
        containers=(
            ContainerAllocation(
                name="main", gpus=(GpuGrant(uuid="GPU-n-0", memory_quota_mib=2048, cores=50),)
            ),
        ),
    )
    [grant] = with_resize(current, resized).containers[0].gpus
    assert (grant.memory_quota_mib, grant.cores) == (4096, 50)
    assert with_resize(current, None) is current
    elsewhere = resized.model_copy(update={"node": "m"})
    assert with_resize(current, elsewhere) is current


def test_a_pod_bound_here_is_recorded_allocating_with_what_preemption_weighs() -> None:
    leaving = pod("a", bound=True)
    leaving["metadata"]["deletionTimestamp"] = "2026-01-01T12:00:00Z"
    leaving["metadata"]["labels"] = {"app": "x"}
    record = bound_record(leaving, allocation(), NOW)
    assert (record.phase, record.bind_time, record.terminating, record.labels) == (
        Phase.ALLOCATING.value,
        NOW,
        True,
        (("app", "x"),),
    )
