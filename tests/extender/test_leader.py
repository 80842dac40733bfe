"""Leadership: this extender's kube-scheduler leads while it holds the Lease; no Lease, it leads alone."""

from __future__ import annotations

import asyncio

from extender.kube import ApiError
from extender.leader import LeaderLease, Leadership
from tests.extender.bindcase import FakeApi

LEASE = LeaderLease("tessera-system", "tessera-scheduler", "sched-a")


def leads(api: FakeApi | None, leader: LeaderLease | None) -> str:
    return asyncio.run(Leadership(api, leader).leads())  # type: ignore[arg-type]


def test_without_a_lease_it_leads_and_reads_nothing() -> None:
    assert leads(None, None) == ""


def test_it_leads_while_its_scheduler_pod_holds_the_lease() -> None:
    api = FakeApi([])
    api.lease_holder = "sched-a_0c4f2d"  # kube-scheduler's identity: <hostname>_<uuid>
    assert leads(api, LEASE) == ""
    api.lease_holder = "sched-ab_0c4f2d"  # another pod whose name begins alike
    assert leads(api, LEASE) == (
        "this extender's scheduler (sched-a) does not hold the lease tessera-system/tessera-scheduler "
        "(held by sched-ab_0c4f2d); the leader binds"
    )


def test_a_lease_that_cannot_be_read_is_said_so() -> None:
    api = FakeApi([])
    api.lease_error = ApiError(503, "unavailable")
    assert (
        leads(api, LEASE) == "cannot read the lease tessera-system/tessera-scheduler: HTTP 503: unavailable"
    )
