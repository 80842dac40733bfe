"""/preempt with kube-scheduler's exact JSON (ExtenderPreemptionArgs / ExtenderPreemptionResult),
without an API server: the state comes from Node and Pod objects handed to it, the budgets from a
stand-in for the one list preempt makes. The real kube-scheduler is in test_k8s_preemption.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient

from extender.app import create_app
from extender.kube import ApiError
from extender.metrics import Metrics
from extender.preempting import DISRUPTION_BUDGETS
from extender.service import Extender
from extender.state import ClusterState
from tessera.contract import KEYS, JsonObject
from tessera.placement import PlacementEngine, SpeedProfiles
from tests.extender.helpers import bound_to, gpu_pod, inventory, node_object

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


class FakeKube:
    """The list preempt makes (PodDisruptionBudgets), nothing else."""

    def __init__(self, budgets: list[JsonObject]) -> None:
        self.budgets = budgets
        self.lists: list[str] = []

    async def list(self, path: str, field_selector: str = "") -> tuple[list[JsonObject], str]:
        self.lists.append(path)
        return self.budgets, "1"

    async def close(self) -> None:
        pass


def bound_pod(name: str, gpu: int, memory: int, *, priority: int = 0, node: str = "n") -> JsonObject:
    """A pod bound on ``node`` with its allocation on GPU ``gpu`` (phase allocated)."""
    pod = bound_to(gpu_pod(name, memory=memory, cores=None, uid=f"uid-{name}"), node, gpu)
    pod["spec"]["priority"] = priority
    return pod


def full_node_pods() -> list[JsonObject]:
    """docs/placement.md's example: GPU 0 holds 6 + 6 + 2 + 1 GiB, GPU 1 four 4 GiB pods."""
    return [
        bound_pod("a", 0, 6144),
        bound_pod("b", 0, 6144),
        bound_pod("c", 0, 2048),
        bound_pod("d", 0, 1024),
        *(bound_pod(f"e{i}", 1, 4096) for i in range(4)),
    ]


def preemptor(memory: int = 12288, priority: int = 1000, **annotations: str) -> JsonObject:
    pod = gpu_pod("urgent", memory=memory, cores=None, uid="uid-urgent", annotations=annotations)
    pod["spec"]["priority"] = priority
    return pod


def meta(*uids: str, violations: int = 0) -> dict[str, Any]:
    return {"Pods": [{"UID": uid} for uid in uids], "NumPDBViolations": violations}


@pytest.fixture
def state() -> ClusterState:
    s = ClusterState(PlacementEngine(SpeedProfiles()), KEYS, heartbeat_timeout=timedelta(minutes=5))
    s.replace_nodes(
        [
            node_object("n", inventory("n", "Tesla V100-SXM2-16GB", 16384, count=2, split=4), NOW),
            node_object("m", inventory("m", "Tesla V100-SXM2-16GB", 16384, count=1, split=4), NOW),
        ],
        NOW,
    )
    return s


def extender_of(state: ClusterState, kube: FakeKube | None) -> Extender:
    return Extender(
        state,
        kube,  # type: ignore[arg-type]
        KEYS,
        Metrics(),
        inflight_timeout=timedelta(minutes=5),
        clock=lambda: NOW,
    )


def serve(
    state: ClusterState, pods: list[JsonObject], budgets: list[JsonObject] | None = None
) -> Iterator[TestClient]:
    state.replace_pods(pods)
    with TestClient(create_app(extender_of(state, FakeKube(budgets or [])))) as c:
        yield c


@pytest.fixture
def client(state: ClusterState) -> Iterator[TestClient]:
    yield from serve(state, full_node_pods())


def preempt(client: TestClient, pod: JsonObject, victims: dict[str, Any]) -> dict[str, Any]:
    response = client.post(
        "/preempt", json={"Pod": pod, "NodeNameToVictims": None, "NodeNameToMetaVictims": victims}
    )
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def test_the_two_pods_on_the_gpu_that_frees_enough(client: TestClient) -> None:
    # kube-scheduler counts slices: one pod out frees one, so it proposes one pod, the least important.
    answer = preempt(client, preemptor(), {"n": meta("uid-e3")})
    assert answer == {"NodeNameToMetaVictims": {"n": meta("uid-a", "uid-b")}}
    metrics = client.get("/metrics").text
    assert 'tessera_extender_preemption_nodes_total{result="victims"} 1.0' in metrics
    assert "tessera_extender_preemption_victims_total 2.0" in metrics


def test_victims_kube_scheduler_chose_off_the_gpus_are_kept(client: TestClient) -> None:
    """A pod kube-scheduler proposes that holds no GPU share (it needed its CPU or memory) stays in the
    answer, after the GPU victims, with its budget violations."""
    answer = preempt(client, preemptor(), {"n": meta("uid-e3", "uid-cpu-hog", violations=1)})
    assert answer == {"NodeNameToMetaVictims": {"n": meta("uid-a", "uid-b", "uid-cpu-hog", violations=1)}}


def test_a_node_where_no_eviction_makes_room_is_left_out(state: ClusterState) -> None:
    pods = [
        *full_node_pods(),
        bound_pod("keep", 0, 12288, priority=5000, node="m"),
        bound_pod("low", 0, 4096, node="m"),
    ]
    for c in serve(state, pods):
        answer = preempt(c, preemptor(), {"n": meta("uid-e3"), "m": meta("uid-low")})
        assert answer == {"NodeNameToMetaVictims": {"n": meta("uid-a", "uid-b")}}
        assert 'tessera_extender_preemption_nodes_total{result="removed"} 1.0' in c.get("/metrics").text


def test_only_lower_priorities_are_victims(state: ClusterState) -> None:
    pods = [
        bound_pod("a", 0, 6144, priority=1000),  # as important as the pod: never evicted
        bound_pod("b", 0, 6144),
        bound_pod("c", 0, 2048),
        bound_pod("d", 0, 1024),
        *(bound_pod(f"e{i}", 1, 4096) for i in range(4)),
    ]
    for c in serve(state, pods):
        answer = preempt(c, preemptor(), {"n": meta("uid-e3")})
        assert answer == {"NodeNameToMetaVictims": {"n": meta("uid-e1", "uid-e2", "uid-e3")}}


def test_a_pod_already_being_deleted_is_no_victim_and_still_counts(state: ClusterState) -> None:
    pods = full_node_pods()
    pods[0]["metadata"]["deletionTimestamp"] = "2026-01-01T11:59:00Z"  # a is terminating
    for c in serve(state, pods):
        answer = preempt(c, preemptor(), {"n": meta("uid-e3")})
        assert answer == {"NodeNameToMetaVictims": {"n": meta("uid-e1", "uid-e2", "uid-e3")}}


def test_a_pod_that_fits_on_a_gpu_keeps_kube_schedulers_victims(client: TestClient) -> None:
    """Then kube-scheduler chose its victims for what it alone judges (CPU, memory, pod count)."""
    answer = preempt(client, preemptor(), {"m": meta("uid-cpu-hog", violations=1)})  # m is empty
    assert answer == {"NodeNameToMetaVictims": {"m": meta("uid-cpu-hog", violations=1)}}


def test_whole_pods_from_a_scheduler_without_node_cache(client: TestClient) -> None:
    body = {
        "Pod": preemptor(),
        "NodeNameToVictims": {"n": {"Pods": [bound_pod("e3", 1, 4096)], "NumPDBViolations": 0}},
    }
    response = client.post("/preempt", json=body)
    assert response.json() == {"NodeNameToMetaVictims": {"n": meta("uid-a", "uid-b")}}


def test_a_budget_makes_a_larger_set_preferable(state: ClusterState) -> None:
    labelled = full_node_pods()
    for pod in labelled[:2]:  # a and b
        pod["metadata"]["labels"] = {"app": "cache"}
    budget = {
        "metadata": {"name": "cache", "namespace": "default"},
        "spec": {"selector": {"matchLabels": {"app": "cache"}}},
        "status": {"disruptionsAllowed": 0},
    }
    for c in serve(state, labelled, [budget]):
        # a and b would break the budget twice; three of GPU 1's pods (12 GiB) break none.
        answer = preempt(c, preemptor(), {"n": meta("uid-e3")})
        assert answer == {"NodeNameToMetaVictims": {"n": meta("uid-e1", "uid-e2", "uid-e3")}}
    budget["status"] = {"disruptionsAllowed": 1}
    for c in serve(state, labelled, [budget]):
        # One disruption allowed: a and b together break the budget once; three pods break none.
        assert preempt(c, preemptor(), {"n": meta("uid-e3")}) == {
            "NodeNameToMetaVictims": {"n": meta("uid-e1", "uid-e2", "uid-e3")}
        }
    budget["status"] = {"disruptionsAllowed": 2}
    for c in serve(state, labelled, [budget]):
        assert preempt(c, preemptor(), {"n": meta("uid-e3")}) == {
            "NodeNameToMetaVictims": {"n": meta("uid-a", "uid-b")}
        }


def test_an_invalid_class_gets_no_node(client: TestClient) -> None:
    assert preempt(client, preemptor(**{KEYS.qos: "urgent"}), {"n": meta("uid-e3")}) == {
        "NodeNameToMetaVictims": {}
    }


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"Pod": preemptor()}, "NodeNameToVictims and NodeNameToMetaVictims are both null"),
        (
            {"Pod": preemptor(), "NodeNameToMetaVictims": {"n": {"Pods": [{"UID": 5}]}}},
            "NodeNameToMetaVictims.n.Pods.0.UID: Input should be a valid string (got 5)",
        ),
        (
            {"Pod": preemptor(), "NodeNameToMetaVictims": {"n": {"Pods": [], "NumPDBViolations": -1}}},
            "NodeNameToMetaVictims.n.NumPDBViolations: Input should be greater than or equal to 0",
        ),
        ({"NodeNameToMetaVictims": {}}, "Pod: missing"),
        (
            {
                "Pod": {**preemptor(), "spec": {**preemptor()["spec"], "priority": "high"}},
                "NodeNameToMetaVictims": {},
            },
            "Pod: spec.priority: must be an integer, got a string",
        ),
    ],
)
def test_malformed_requests_get_400_naming_the_field(
    client: TestClient, body: dict[str, Any], message: str
) -> None:
    response = client.post("/preempt", content=json.dumps(body))
    assert response.status_code == 400
    assert message in response.text


def test_not_synced_is_an_http_error(state: ClusterState) -> None:
    """ExtenderPreemptionResult has no error field: kube-scheduler sees a failed call and retries."""
    extender = extender_of(
        ClusterState(PlacementEngine(SpeedProfiles()), KEYS, heartbeat_timeout=timedelta(minutes=5)), None
    )
    with TestClient(create_app(extender)) as c:
        response = c.post(
            "/preempt", json={"Pod": preemptor(), "NodeNameToMetaVictims": {"n": meta("uid-e3")}}
        )
        assert response.status_code == 503
        assert "caches not synced" in response.text


def test_budgets_are_read_once_per_call(state: ClusterState) -> None:
    state.replace_pods(full_node_pods())
    kube = FakeKube([])
    extender = extender_of(state, kube)
    with TestClient(create_app(extender)) as c:
        preempt(c, preemptor(), {"n": meta("uid-e3"), "m": meta("uid-x")})
    assert kube.lists == [DISRUPTION_BUDGETS]


class FailingKube(FakeKube):
    async def list(self, path: str, field_selector: str = "") -> tuple[list[JsonObject], str]:
        raise ApiError(403, 'poddisruptionbudgets.policy is forbidden: User "x" cannot list')


def test_budgets_that_cannot_be_read_fail_the_call(state: ClusterState) -> None:
    """Without them victims could break budgets kube-scheduler would keep: the call fails (503), and
    kube-scheduler tries the pod's preemption again on its next attempt."""
    state.replace_pods(full_node_pods())
    extender = extender_of(state, FailingKube([]))
    with TestClient(create_app(extender)) as c:
        response = c.post(
            "/preempt", json={"Pod": preemptor(), "NodeNameToMetaVictims": {"n": meta("uid-e3")}}
        )
        assert response.status_code == 503
        assert (
            "tessera extender: preempt failed: ApiError: HTTP 403: poddisruptionbudgets.policy is forbidden"
            in response.text
        )


def test_a_reservation_is_no_victim(state: ClusterState) -> None:
    """A pod reserved at filter is no pod kube-scheduler could evict: its share counts, it is never named."""
    state.replace_pods([bound_pod("low", 0, 4096, node="m")])
    extender = extender_of(state, FakeKube([]))
    reserved = gpu_pod("reserved", memory=8192, cores=None, uid="uid-reserved")
    assert extender.filter(reserved, ["m"]).passed == ["m"]  # reserved on m, 8 GiB
    assert state.reservation("uid-reserved") is not None
    with TestClient(create_app(extender)) as c:
        # 8 GiB asked: low's 4 GiB and the 4 GiB free are enough; the reservation stays untouched.
        assert preempt(c, preemptor(memory=8192), {"m": meta("uid-low")}) == {
            "NodeNameToMetaVictims": {"m": meta("uid-low")}
        }
        # 12 GiB: only evicting the reservation too would do: m is left out.
        assert preempt(c, preemptor(), {"m": meta("uid-low")}) == {"NodeNameToMetaVictims": {}}
