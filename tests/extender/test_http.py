"""The extender's HTTP interface with kube-scheduler's exact JSON, without a Kubernetes API server:
state comes from Node objects handed to the state directly."""

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
from extender.service import Extender
from extender.state import ClusterState
from tessera.contract import KEYS, JsonObject
from tessera.placement import PlacementEngine, SpeedProfiles
from tessera.placement.engine import UNKNOWN_NODE
from tessera.scrapeauth import TOKEN_REVIEWS, AccessCache, Review
from tests.extender.bindcase import extender
from tests.extender.helpers import gpu_pod, inventory, node_object

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


@pytest.fixture
def state() -> ClusterState:
    engine = PlacementEngine(SpeedProfiles.from_mapping({"models": {"T4": 0.4, "V100": 1.0, "A100": 2.0}}))
    return ClusterState(engine, KEYS, heartbeat_timeout=timedelta(seconds=60))


def serve(state: ClusterState, *, filter_keeps_best: bool) -> Iterator[TestClient]:
    nodes = [
        node_object("t4", inventory("t4", "Tesla T4", 15360), NOW),
        node_object("v100", inventory("v100", "Tesla V100-SXM2-16GB", 16384), NOW),
        node_object("a100", inventory("a100", "NVIDIA A100-SXM4-40GB", 40960), NOW),
        node_object("stale", inventory("stale", "Tesla T4", 15360), NOW - timedelta(seconds=300)),
        node_object("cpu-only", None, None),
    ]
    state.replace_nodes(nodes, NOW)
    state.replace_pods([])
    extender = Extender(
        state,
        None,
        KEYS,
        Metrics(),
        inflight_timeout=timedelta(minutes=5),
        clock=lambda: NOW,
        filter_keeps_best=filter_keeps_best,
    )
    with TestClient(create_app(extender)) as c:
        yield c


@pytest.fixture
def client(state: ClusterState) -> Iterator[TestClient]:
    """Filter answers every node that fits, for kube-scheduler to call prioritize on."""
    yield from serve(state, filter_keeps_best=False)


@pytest.fixture
def best_client(state: ClusterState) -> Iterator[TestClient]:
    """Filter answers only the top-scored nodes (the extender's default)."""
    yield from serve(state, filter_keeps_best=True)


def args(
    pod: dict[str, Any], names: list[str] | None = None, nodes: list[Any] | None = None
) -> dict[str, Any]:
    return {"Pod": pod, "Nodes": None if nodes is None else {"items": nodes}, "NodeNames": names}


ALL = ["t4", "v100", "a100", "stale", "cpu-only"]


def test_filter_node_names_mode_answers_pascal_case(client: TestClient) -> None:
    pod = gpu_pod("p", memory=16000, uid="u1")
    response = client.post("/filter", json=args(pod, ALL))
    assert response.status_code == 200
    body = response.json()
    assert body == {
        "Nodes": None,
        "NodeNames": ["v100", "a100"],
        # kube-scheduler drops the other nodes' reasons when some node passes: none are made.
        "FailedNodes": None,
        "FailedAndUnresolvableNodes": None,
        "Error": "",
    }


def test_a_pod_that_fits_nowhere_gets_every_nodes_reason(client: TestClient) -> None:
    pod = gpu_pod("p", memory=16000, uid="u1")
    body = client.post("/filter", json=args(pod, ["t4", "stale", "cpu-only"])).json()
    assert body["NodeNames"] == []
    assert body["FailedNodes"] is None
    unresolvable = body["FailedAndUnresolvableNodes"]
    assert unresolvable["t4"] == "no GPU with 16000 MiB of memory; largest has 15360 MiB"
    assert unresolvable["stale"] == "Tessera device plugin heartbeat is 300 s old (timeout 60 s)"
    assert unresolvable["cpu-only"] == UNKNOWN_NODE


def test_filter_keeping_the_best_answers_the_top_scored_nodes_only(
    best_client: TestClient,
) -> None:
    # binpack: 16,000 MiB nearly fills a V100 and leaves most of an A100.
    body = best_client.post("/filter", json=args(gpu_pod("p", memory=16000, uid="u1"), ALL)).json()
    assert body["NodeNames"] == ["v100"]
    # a100 fits: not a failure, just not the best; the others' reasons are not needed.
    assert body["FailedNodes"] is None
    assert body["FailedAndUnresolvableNodes"] is None


def test_filter_keeping_the_best_answers_every_tie(best_client: TestClient, state: ClusterState) -> None:
    state.upsert_node(node_object("v100-b", inventory("v100-b", "Tesla V100-SXM2-16GB", 16384), NOW), NOW)
    body = best_client.post(
        "/filter", json=args(gpu_pod("p", memory=16000), ["v100", "a100", "v100-b"])
    ).json()
    assert body["NodeNames"] == ["v100", "v100-b"]  # kube-scheduler's own scores choose


def in_flight(state: ClusterState, uid: str, node: str, gpu: int, memory: int) -> None:
    """A pod bound to ``node`` that its device plugin has not served yet."""
    grants = [{"uuid": f"GPU-{node}-{gpu}", "memory_mib": memory, "cores": 30}]
    allocation = {"node": node, "containers": [{"name": "main", "gpus": grants}]}
    pod = gpu_pod(uid, memory=memory, uid=uid)
    pod["spec"]["nodeName"] = node
    pod["metadata"]["annotations"] |= {
        KEYS.allocation: json.dumps(allocation),
        KEYS.allocation_phase: "allocating",
        KEYS.bind_time: "2026-01-01T12:00:00Z",
    }
    pod["status"] = {"phase": "Pending"}
    state.upsert_pod(pod)


def test_filter_keeping_the_best_passes_over_a_node_the_inflight_rule_refuses(
    best_client: TestClient, state: ClusterState
) -> None:
    # A 4,096 MiB pod in flight on the V100's GPU 0: binpack's best for another 4,096 MiB is that GPU
    # (the same key: allowed). A 5,000 MiB pod there would be a different 1-GPU key: the rule refuses
    # the V100 for now, and the next best node is answered instead.
    in_flight(state, "first", "v100", 0, 4096)
    joining = best_client.post("/filter", json=args(gpu_pod("p", memory=4096, uid="u1"), ALL)).json()
    assert joining["NodeNames"] == ["v100"]
    body = best_client.post("/filter", json=args(gpu_pod("q", memory=5000, uid="u2"), ALL)).json()
    assert body["NodeNames"] == ["t4", "a100"]  # the next score down, a tie
    # (p, reserved by its filter as the only node, is in flight there too.)
    assert "is still being admitted on node v100 with a 1-GPU container" in body["FailedNodes"]["v100"]


def test_filter_with_full_node_objects_returns_node_objects(client: TestClient) -> None:
    nodes = [{"metadata": {"name": n, "labels": {"x": "y"}}} for n in ("t4", "a100")]
    body = client.post("/filter", json=args(gpu_pod("p", memory=16000), nodes=nodes)).json()
    assert body["NodeNames"] is None
    assert body["Nodes"]["items"] == [nodes[1]]


def test_model_and_speed_constraints(client: TestClient) -> None:
    pod = gpu_pod("p", annotations={KEYS.gpu_models: "V100,A100", KEYS.min_speed: "1.5"})
    assert client.post("/filter", json=args(pod, ["t4", "v100", "a100"])).json()["NodeNames"] == ["a100"]
    body = client.post("/filter", json=args(pod, ["t4", "v100"])).json()
    assert body["NodeNames"] == []
    assert body["FailedAndUnresolvableNodes"]["t4"] == (
        "no such healthy GPU (models V100, A100); node has Tesla T4 x4"
    )
    assert body["FailedAndUnresolvableNodes"]["v100"] == (
        "no GPU with speed >= 1.5; node has Tesla V100-SXM2-16GB 1"
    )


def test_invalid_pod_is_unschedulable_everywhere_with_the_reason(client: TestClient) -> None:
    pod = gpu_pod("p", annotations={KEYS.min_speed: "fast"})
    body = client.post("/filter", json=args(pod, ["t4", "v100"])).json()
    assert body["NodeNames"] == []
    assert body["FailedAndUnresolvableNodes"] == dict.fromkeys(
        ["t4", "v100"], f"pod default/p: annotation {KEYS.min_speed}: 'fast' is not a number"
    )


def test_pod_without_gpu_requests_passes_every_node(client: TestClient) -> None:
    pod = {"metadata": {"name": "plain"}, "spec": {"containers": [{"name": "c"}]}}
    assert client.post("/filter", json=args(pod, ALL)).json()["NodeNames"] == ALL


def test_prioritize_scores_every_node_0_to_10(client: TestClient) -> None:
    pod = gpu_pod("p", uid="u2")
    names = client.post("/filter", json=args(pod, ALL)).json()["NodeNames"]
    response = client.post("/prioritize", json=args(pod, names))
    assert response.status_code == 200
    scores = response.json()
    assert [s["Host"] for s in scores] == names
    assert all(set(s) == {"Host", "Score"} and 0 <= s["Score"] <= 10 for s in scores)
    # binpack: 4 GiB fills the smaller GPUs more.
    by_host = {s["Host"]: s["Score"] for s in scores}
    assert by_host["t4"] >= by_host["a100"]


def test_prioritize_without_a_preceding_filter_evaluates_afresh(client: TestClient) -> None:
    pod = gpu_pod("p", annotations={KEYS.workload: "x"})
    scores = client.post("/prioritize", json=args(pod, ["a100", "cpu-only"])).json()
    assert scores == [{"Host": "a100", "Score": 2}, {"Host": "cpu-only", "Score": 0}]


BAD_REQUESTS: list[tuple[str, bytes, str]] = [
    ("/filter", b"", "bad filter request: request body is empty; expected a JSON object"),
    (
        "/filter",
        b"{nope",
        "bad filter request: request body is not JSON: Expecting property name enclosed in",
    ),
    ("/filter", b"[1]", "bad filter request: request body must be a JSON object (ExtenderArgs), got list"),
    ("/filter", b'{"NodeNames": ["a"]}', "bad filter request: Pod: missing"),
    (
        "/filter",
        b'{"Pod": null, "NodeNames": ["a"]}',
        "bad filter request: Pod: Input should be a valid dictionary",
    ),
    ("/filter", b'{"Pod": {"spec": {}}, "NodeNames": ["a"]}', "bad filter request: Pod.metadata: missing"),
    (
        "/filter",
        b'{"Pod": {"metadata": {"name": ""}, "spec": {}}, "NodeNames": ["a"]}',
        'bad filter request: Pod.metadata.name: String should have at least 1 character (got "")',
    ),
    (
        "/filter",
        b'{"Pod": {"metadata": {"name": "p"}}, "NodeNames": ["a"]}',
        "bad filter request: Pod.spec: missing",
    ),
    (
        "/filter",
        b'{"Pod": {"metadata": {"name": "p", "annotations": {"a": 1}}, "spec": {}}, "NodeNames": []}',
        "bad filter request: Pod.metadata.annotations.a: Input should be a valid string (got 1)",
    ),
    (
        "/filter",
        b'{"Pod": {"metadata": {"name": "p"}, "spec": {}}, "NodeNames": "n1"}',
        'bad filter request: NodeNames: Input should be a valid list (got "n1")',
    ),
    (
        "/filter",
        b'{"Pod": {"metadata": {"name": "p"}, "spec": {}}, "NodeNames": ["n1", 5]}',
        "bad filter request: NodeNames.1: Input should be a valid string (got 5)",
    ),
    (
        "/filter",
        b'{"Pod": {"metadata": {"name": "p"}, "spec": {}}, "Nodes": null, "NodeNames": null}',
        "bad filter request: NodeNames and Nodes are both null; one of them must list the candidate nodes",
    ),
    (
        "/filter",
        b'{"Pod": {"metadata": {"name": "p"}, "spec": {}}, "Nodes": {"items": [{"spec": {}}]}}',
        "bad filter request: Nodes.items.0.metadata: missing",
    ),
    (
        "/prioritize",
        b"null",
        "bad prioritize request: request body must be a JSON object (ExtenderArgs), got NoneType",
    ),
    (
        "/prioritize",
        b'{"Pod": {"metadata": {"name": "p"}, "spec": {}}, "NodeNames": [null]}',
        "bad prioritize request: NodeNames.0: Input should be a valid string (got null)",
    ),
    ("/bind", b"{}", "bad bind request: PodName: missing; PodNamespace: missing; Node: missing"),
    (
        "/bind",
        b'{"PodName": "p", "PodNamespace": "default", "PodUID": "u", "Node": ""}',
        'bad bind request: Node: String should have at least 1 character (got "")',
    ),
    (
        "/bind",
        b'{"PodName": 7, "PodNamespace": "default", "PodUID": "u", "Node": "n"}',
        "bad bind request: PodName: Input should be a valid string (got 7)",
    ),
    ("/bind", b'"p"', "bad bind request: request body must be a JSON object (ExtenderBindingArgs), got str"),
]


@pytest.mark.parametrize(("path", "body", "message"), BAD_REQUESTS, ids=[m for _, _, m in BAD_REQUESTS])
def test_bad_requests_get_400_naming_the_problem(
    client: TestClient, path: str, body: bytes, message: str
) -> None:
    response = client.post(path, content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    assert response.text.startswith(message), response.text
    assert "Traceback" not in response.text


def test_health_readiness_and_metrics(state: ClusterState) -> None:
    extender = Extender(
        state, None, KEYS, Metrics(), inflight_timeout=timedelta(minutes=5), clock=lambda: NOW
    )
    with TestClient(create_app(extender)) as c:
        assert c.get("/healthz").text == "ok\n"
        not_ready = c.get("/readyz")
        assert (not_ready.status_code, not_ready.text) == (503, "caches not synced: nodes, pods\n")
        state.replace_nodes([node_object("v100", inventory("v100", "Tesla V100-SXM2-16GB", 16384), NOW)], NOW)
        state.replace_pods([])
        assert c.get("/readyz").status_code == 200
        c.post("/filter", json=args(gpu_pod("p", memory=99999), ["v100"]))
        c.post("/filter", content=b"nope")
        text = c.get("/metrics").text
    assert 'tessera_extender_request_seconds_count{verb="filter"} 2.0' in text
    assert 'tessera_extender_requests_total{code="400",verb="filter"} 1.0' in text
    assert 'tessera_extender_node_rejections_total{reason="capacity"} 1.0' in text
    assert 'tessera_extender_pods_filtered_total{result="infeasible"} 1.0' in text
    assert "tessera_extender_nodes 1.0" in text


class ReviewingApi:
    """The API server's side of a scrape's reviews: tokens -> users, and who may get /metrics."""

    def __init__(self) -> None:
        self.users = {
            "prometheus-token": "system:serviceaccount:monitoring:prometheus",
            "tenant-token": "tenant",
        }
        self.readers = {"system:serviceaccount:monitoring:prometheus"}
        self.posts = 0
        self.down = False

    async def post_review(self, review: Review) -> JsonObject:
        self.posts += 1
        if self.down:
            raise ApiError(503, "etcd is down")
        if review.path == TOKEN_REVIEWS:
            user = self.users.get(review.body["spec"]["token"])
            return {"status": {"authenticated": True, "user": {"username": user}} if user else {}}
        assert review.body["spec"]["nonResourceAttributes"] == {"path": "/metrics", "verb": "get"}
        return {"status": {"allowed": review.body["spec"]["user"] in self.readers}}

    async def close(self) -> None:
        pass


def test_metrics_are_served_only_to_a_token_the_api_server_allows(state: ClusterState) -> None:
    api = ReviewingApi()
    with TestClient(create_app(extender(state, api), scrapes=AccessCache())) as c:  # type: ignore[arg-type]
        assert c.get("/metrics").status_code == 401
        assert c.get("/metrics", headers={"Authorization": "Bearer made-up"}).status_code == 401
        refused = c.get("/metrics", headers={"Authorization": "Bearer tenant-token"})
        assert (refused.status_code, refused.text) == (403, "tenant may not get /metrics\n")
        allowed = c.get("/metrics", headers={"Authorization": "Bearer prometheus-token"})
        assert allowed.status_code == 200 and "tessera_extender_nodes" in allowed.text
        posts = api.posts
        assert c.get("/metrics", headers={"Authorization": "Bearer prometheus-token"}).status_code == 200
        assert api.posts == posts  # the answer is kept a while
        api.down = True
        assert c.get("/metrics", headers={"Authorization": "Bearer other"}).status_code == 503
        assert c.get("/healthz").status_code == 200  # probes need no token


def test_internal_failure_is_an_error_field_not_a_traceback(client: TestClient, state: ClusterState) -> None:
    def broken(*_: object) -> None:
        raise RuntimeError("engine exploded")

    state.engine.evaluate = broken  # type: ignore[method-assign, assignment]
    response = client.post("/filter", json=args(gpu_pod("p"), ["t4"]))
    assert response.status_code == 200
    assert (
        json.loads(response.text)["Error"] == "tessera extender: filter failed: RuntimeError: engine exploded"
    )


def test_verbs_take_only_post_and_the_rest_is_fastapi(client: TestClient) -> None:
    response = client.get("/filter")
    assert (response.status_code, response.headers["allow"]) == (405, "POST")
    assert client.get("/healthz").text == "ok\n"
    assert client.post("/nothing-here", json={}).status_code == 404


def test_every_policy_answers_through_the_extender(client: TestClient) -> None:
    for policy in ("binpack", "spread", "fragmentation"):
        pod = gpu_pod(f"p-{policy}", uid=f"u-{policy}", annotations={KEYS.policy: policy})
        names = client.post("/filter", json=args(pod, ["t4", "v100", "a100"])).json()["NodeNames"]
        assert names == ["t4", "v100", "a100"]
        scores = client.post("/prioritize", json=args(pod, names)).json()
        assert [s["Host"] for s in scores] == names
        assert all(0 <= s["Score"] <= 10 for s in scores)


def test_every_verb_refuses_until_the_caches_are_synced(state: ClusterState) -> None:
    """A restarted extender must not decide before it has listed the pods that hold capacity."""
    extender = Extender(
        state, None, KEYS, Metrics(), inflight_timeout=timedelta(minutes=5), clock=lambda: NOW
    )
    state.replace_nodes([node_object("v100", inventory("v100", "Tesla V100-SXM2-16GB", 16384), NOW)], NOW)
    with TestClient(create_app(extender)) as c:
        pod = gpu_pod("p", memory=1024, uid="u1")
        filtered = c.post("/filter", json=args(pod, ["v100"])).json()
        assert filtered["Error"] == "tessera extender is starting: caches not synced (pods)"
        assert not filtered["NodeNames"]
        assert c.post("/prioritize", json=args(pod, ["v100"])).json() == []
        binding = {"PodName": "p", "PodNamespace": "default", "PodUID": "u1", "Node": "v100"}
        assert c.post("/bind", json=binding).json() == {
            "Error": "tessera extender is starting: caches not synced (pods)"
        }
        state.replace_pods([])
        assert c.post("/filter", json=args(pod, ["v100"])).json()["NodeNames"] == ["v100"]
