"""Usage-aware placement of best-effort pods in the extender: the nodes' measured use read into the
state (only with the flag), stale or unreadable measurements, grants placed since, the bind's
oversubscribed allocation and its metrics."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from extender.main import build_parser, main
from extender.service import Extender
from extender.state import ClusterState
from tessera.contract import (
    KEYS,
    GpuUsage,
    JsonObject,
    NodeGpuUsage,
    Phase,
    QosClass,
    dump_allocation,
    dump_gpu_usage,
    format_time,
    parse_allocation,
)
from tessera.placement import PlacementEngine, SpeedProfiles, UsageRule
from tests.extender.bindcase import FakeApi, api_pod, bind, extender
from tests.extender.helpers import bound_to, gpu_pod, inventory, node_object

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
RULE = UsageRule(margin_mib=1024, margin_percent=10, max_age=timedelta(seconds=30))
# One 40960 MiB GPU: a 4096 MiB margin (10%).
GPU = "GPU-n-0"


def usage_text(used_mib: int, at: datetime = NOW) -> str:
    return dump_gpu_usage(
        NodeGpuUsage(
            time=format_time(at),
            gpus=(
                GpuUsage(
                    uuid=GPU, memory_used_mib=used_mib, guaranteed_used_mib=used_mib, utilization_percent=40
                ),
            ),
        )
    )


def gpu_node(usage: str | None, heartbeat: datetime = NOW) -> dict[str, Any]:
    node = node_object("n", inventory("n", "NVIDIA A100-SXM4-40GB", 40960, count=1, split=4), heartbeat)
    if usage is not None:
        node["metadata"]["annotations"][KEYS.node_gpu_usage] = usage
    return node


def guaranteed(
    name: str = "big", memory: int = 36864, bind_time: datetime = NOW - timedelta(minutes=5)
) -> dict[str, Any]:
    pod = bound_to(gpu_pod(name, memory=memory, uid=name), "n", 0, format_time(bind_time))
    pod["status"] = {"phase": "Running"}
    return pod


def best_effort(name: str, memory: int) -> JsonObject:
    return gpu_pod(
        name, memory=memory, cores=20, uid=name, annotations={KEYS.qos: QosClass.BEST_EFFORT.value}
    )


def make_state(rule: UsageRule | None, usage: str | None, pods: list[dict[str, Any]]) -> ClusterState:
    state = ClusterState(PlacementEngine(SpeedProfiles()), KEYS, timedelta(seconds=600), usage_rule=rule)
    state.replace_nodes([gpu_node(usage)], NOW)
    state.replace_pods(pods)
    return state


def make_extender(state: ClusterState) -> Extender:
    return extender(state, FakeApi([]))


def measured(state: ClusterState) -> int | None:
    return state.engine.nodes["n"].gpus[0].measured_mib


def test_measured_use_is_read_only_with_the_flag() -> None:
    assert measured(make_state(None, usage_text(2048), [guaranteed()])) is None
    assert measured(make_state(RULE, usage_text(2048), [guaranteed()])) == 2048 + 4096


def test_a_best_effort_pod_fitting_only_by_measured_use_binds_oversubscribed() -> None:
    state = make_state(RULE, usage_text(2048), [guaranteed()])
    pod = api_pod("borrower", memory=8192, cores=20, annotations={KEYS.qos: QosClass.BEST_EFFORT.value})
    api = FakeApi([pod])
    ext = extender(state, api)
    assert ext.filter(api.pod("borrower"), ["n"]).passed == ["n"]
    assert bind(ext, "default", "borrower", "uid-borrower", "n") == ""
    allocation = parse_allocation(api.pods["borrower"]["metadata"]["annotations"][KEYS.allocation])
    assert allocation.qos == QosClass.BEST_EFFORT
    [grant] = allocation.containers[0].gpus
    assert (grant.uuid, grant.memory_quota_mib, grant.cores, grant.oversubscribed) == (GPU, 8192, 20, True)
    gpu = state.engine.nodes["n"].gpus[0]
    assert (gpu.used_memory_mib, gpu.borrowed_mib) == (36864, 8192)
    assert state.oversubscribed_gpus() == 1
    assert ext.metrics.oversubscribed_binds._value.get() == 1
    # A standard pod of the same shape is placed by requests only: refused.
    standard = api_pod("standard", memory=8192, cores=20)
    answer = ext.filter(standard, ["n"])
    assert answer.passed == []
    assert "measured use" not in answer.failed["n"]


def test_a_best_effort_pod_that_fits_by_requests_is_not_oversubscribed() -> None:
    state = make_state(RULE, usage_text(2048), [guaranteed(memory=8192)])
    pod = api_pod("small", memory=8192, cores=20, annotations={KEYS.qos: QosClass.BEST_EFFORT.value})
    api = FakeApi([pod])
    assert bind(extender(state, api), "default", "small", "uid-small", "n") == ""
    allocation = parse_allocation(api.pods["small"]["metadata"]["annotations"][KEYS.allocation])
    assert not allocation.containers[0].gpus[0].oversubscribed
    assert state.oversubscribed_gpus() == 0


def test_a_standard_pod_is_placed_by_requests_as_if_the_borrower_were_not_there() -> None:
    borrower = bound_to(best_effort("borrower", 8192), "n", 0)
    allocation = parse_allocation(borrower["metadata"]["annotations"][KEYS.allocation])
    oversubscribed = allocation.model_copy(
        update={
            "qos": QosClass.BEST_EFFORT,
            "containers": (
                allocation.containers[0].model_copy(
                    update={
                        "gpus": (
                            allocation.containers[0].gpus[0].model_copy(update={"oversubscribed": True}),
                        )
                    }
                ),
            ),
        }
    )
    borrower["metadata"]["annotations"][KEYS.allocation] = dump_allocation(oversubscribed)
    state = make_state(RULE, usage_text(2048), [guaranteed(), borrower])
    extender = make_extender(state)
    # By requests 4096 MiB are free, the borrowed 8192 MiB notwithstanding (a filter with one node
    # left reserves it: the larger pod is asked first).
    too_big = gpu_pod("too-big", memory=40960 - 36864 + 1, cores=10, uid="too-big")
    answer = extender.filter(too_big, ["n"])
    assert answer.passed == []
    assert "largest free 4096 MiB" in answer.failed["n"]
    standard = gpu_pod("late", memory=40960 - 36864, cores=10, uid="late")
    assert extender.filter(standard, ["n"]).passed == ["n"]


def test_a_stale_measurement_allows_nothing_and_the_sweep_notices() -> None:
    # The node agent's last heartbeat and measurement 20 s ago (max age 30 s).
    state = ClusterState(PlacementEngine(SpeedProfiles()), KEYS, timedelta(seconds=600), usage_rule=RULE)
    before = NOW - timedelta(seconds=20)
    state.replace_nodes([gpu_node(usage_text(2048, at=before), heartbeat=before)], NOW)
    state.replace_pods([guaranteed()])
    extender = make_extender(state)
    pod = best_effort("borrower", 8192)
    assert extender.filter(pod, ["n"]).passed == ["n"]
    assert state.sweep_heartbeats(NOW + timedelta(seconds=11)) == ["n"]
    assert measured(state) is None
    answer = extender.filter(best_effort("other", 8192), ["n"])
    assert answer.passed == []
    assert "no fresh measured use" in answer.failed["n"]


def test_an_old_measurement_holds_as_of_a_newer_heartbeat() -> None:
    """The node agent patches its measured use with a heartbeat whenever it changed at all: an old
    measurement beside a fresh heartbeat is unchanged since."""
    old = guaranteed(bind_time=NOW - timedelta(minutes=20))
    state = make_state(RULE, usage_text(2048, at=NOW - timedelta(minutes=10)), [old])
    assert measured(state) == 2048 + 4096
    # A pod bound after the measurement counts in full still: the heartbeat says nothing of it.
    newer = make_state(RULE, usage_text(2048, at=NOW - timedelta(minutes=10)), [old, guaranteed("new", 1024)])
    assert measured(newer) == 2048 + 4096 + 1024
    # The agent gone quiet: its heartbeat and measurement age together.
    assert state.sweep_heartbeats(NOW + timedelta(seconds=31)) == ["n"]
    assert measured(state) is None


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("not json", "annotation tessera.io/gpu-usage"),
        ('{"time": "2026-01-01T12:00:00Z", "gpus": [{"uuid": "GPU-n-0"}]}', "gpus.0.memory_used_mib"),
        ('{"time": "noon", "gpus": []}', "time: 'noon'"),
    ],
)
def test_an_unreadable_measurement_leaves_the_node_unmeasured_with_a_log_line(
    text: str, field: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="extender.nodebook"):
        state = make_state(RULE, text, [guaranteed()])
    assert measured(state) is None
    assert state.engine.nodes["n"].schedulable  # by requests, the node serves as ever
    [line] = [r.getMessage() for r in caplog.records]
    assert "node 'n'" in line and field in line
    # The same text again (the node updated for its heartbeat): no second line.
    with caplog.at_level(logging.WARNING, logger="extender.nodebook"):
        state.upsert_node(gpu_node(text), NOW + timedelta(seconds=5))
    assert len(caplog.records) == 1
    # Fixed: measured at once.
    state.upsert_node(gpu_node(usage_text(2048)), NOW)
    assert measured(state) == 2048 + 4096


def test_pods_in_flight_or_bound_since_the_measurement_count_in_full() -> None:
    newer = guaranteed("newer", memory=2048, bind_time=NOW)  # bound at the measurement's second
    older = guaranteed("older", memory=2048)
    in_flight = guaranteed("admitting", memory=1024)
    in_flight["metadata"]["annotations"][KEYS.allocation_phase] = Phase.ALLOCATING.value
    state = make_state(RULE, usage_text(3000), [newer, older, in_flight])
    assert measured(state) == 3000 + 4096 + 2048 + 1024


def test_the_flags_make_the_rule() -> None:
    args = build_parser().parse_args(
        [
            "--best-effort-oversubscription",
            "--best-effort-margin-mib=512",
            "--best-effort-margin-percent=5",
            "--best-effort-usage-max-age=20",
        ]
    )
    assert args.best_effort_oversubscription
    assert (args.best_effort_margin_mib, args.best_effort_margin_percent, args.best_effort_usage_max_age) == (
        512,
        5.0,
        20.0,
    )
    assert not build_parser().parse_args([]).best_effort_oversubscription


def test_without_the_flag_a_best_effort_pod_is_placed_and_told_by_requests_only() -> None:
    state = make_state(None, usage_text(2048), [guaranteed()])
    answer = make_extender(state).filter(best_effort("borrower", 8192), ["n"])
    assert answer.passed == []
    assert answer.failed["n"] == "no GPU with 8192 MiB free; largest free 4096 MiB"


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        (
            "--best-effort-margin-percent=150",
            "argument --best-effort-margin-percent: '150' is outside 0..100",
        ),
        ("--best-effort-margin-mib=-1", "argument --best-effort-margin-mib: '-1' must be at least 0"),
        (
            "--best-effort-usage-max-age=0",
            "argument --best-effort-usage-max-age: '0' must be more than 0 seconds",
        ),
    ],
)
def test_a_bad_margin_flag_is_refused_naming_it(
    flag: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--best-effort-oversubscription", flag])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
