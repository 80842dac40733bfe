"""The extender's verbs (filter, prioritize, preempt, bind) under generated requests, straight through its ASGI
application in-process: bodies from a generator that knows kube-scheduler's shapes (and puts the
wrong type anywhere), and byte-level mutations of a real kube-scheduler filter body. No input gets a
500, an internal failure in the Error field, or a hang; every 400 names what is wrong. Node
inventory annotations go through the cluster state the same way."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extender.app import ExtenderApp, create_app
from extender.kube import ApiError
from extender.metrics import Metrics
from extender.service import Extender
from extender.state import ClusterState
from tessera.contract import KEYS, JsonObject, format_time
from tessera.placement import PlacementEngine, SpeedProfiles
from tests.extender.helpers import bound_to, gpu_pod, inventory, node_object
from tests.fuzz.test_contract_fuzz import INVENTORY_TEXT, JSON, POD

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
NODES = ["t4", "v100", "a100"]
# One answer's budget: far under kube-scheduler's 5 s httpTimeout even on a busy CI machine.
ANSWER_S = 2.0


class ApiStandIn:
    """bind's calls: the pod named "p" exists (asking what gpu_pod asks), others do not; no node has
    pods bound."""

    async def list(self, path: str, field_selector: str = "") -> tuple[list[JsonObject], str]:
        return [], "1"

    async def get_pod(self, namespace: str, name: str) -> JsonObject:
        if name != "p":
            raise ApiError(404, f'pods "{name[:50]}" not found')
        pod = gpu_pod("p", uid="u1", namespace=namespace)
        pod["metadata"]["resourceVersion"] = "1"
        return pod

    async def bind_pod(self, namespace: str, name: str, **_: Any) -> None:
        raise ApiError(409, "Precondition failed")

    async def close(self) -> None:
        pass


def _bound(name: str, node: str, gpu: int, memory: int, priority: int) -> JsonObject:
    pod = bound_to(gpu_pod(name, memory=memory, cores=None, uid=f"uid-{name}"), node, gpu)
    pod["spec"]["priority"] = priority
    return pod


# Pods preempt can choose from: the A100's first GPU full of low-priority pods, one more elsewhere.
BOUND = [
    *(_bound(f"low{i}", "a100", 0, 10240, 0) for i in range(4)),
    _bound("high", "a100", 1, 20480, 1000),
    _bound("t4-low", "t4", 0, 8192, 0),
]
UIDS = [pod["metadata"]["uid"] for pod in BOUND]


@contextlib.contextmanager
def serving() -> Iterator[tuple[ExtenderApp, asyncio.AbstractEventLoop]]:
    """The extender's app over three nodes and the bound pods, with the loop that runs it."""
    state = ClusterState(
        PlacementEngine(SpeedProfiles.from_mapping({"models": {"T4": 0.4, "V100": 1.0, "A100": 2.0}})),
        KEYS,
        heartbeat_timeout=timedelta(seconds=60),
    )
    state.replace_nodes(
        [
            node_object("t4", inventory("t4", "Tesla T4", 15360), NOW),
            node_object("v100", inventory("v100", "Tesla V100-SXM2-16GB", 16384), NOW),
            node_object("a100", inventory("a100", "NVIDIA A100-SXM4-40GB", 40960), NOW),
        ],
        NOW,
    )
    state.replace_pods(BOUND)
    extender = Extender(
        state,
        ApiStandIn(),  # type: ignore[arg-type]
        KEYS,
        Metrics(),
        inflight_timeout=timedelta(minutes=5),
        clock=lambda: NOW,
        inflight_wait=timedelta(milliseconds=1),
        filter_keeps_best=False,
    )
    loop = asyncio.new_event_loop()
    try:
        yield create_app(extender), loop
    finally:
        loop.close()


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[ExtenderApp, asyncio.AbstractEventLoop]]:
    """One app for a module's fuzzers: what their binds place stays placed."""
    with serving() as app:
        yield app


def call(served: tuple[ExtenderApp, asyncio.AbstractEventLoop], path: str, body: bytes) -> tuple[int, bytes]:
    app, loop = served
    sent: list[dict[str, Any]] = []
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "path": path, "method": "POST", "headers": [], "query_string": b""}
    loop.run_until_complete(asyncio.wait_for(app(scope, receive, send), ANSWER_S))  # type: ignore[arg-type]
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    content = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, content


def check(path: str, status: int, content: bytes) -> None:
    verb = path.lstrip("/")
    assert status in (200, 400, 413), (status, content[:300])
    assert len(content) < 1_000_000
    if status == 400:
        text = content.decode()
        assert text.startswith(f"bad {verb} request: "), text
        # Names the field (or the body as a whole), then what is wrong.
        assert any(field in text for field in ("body", "Pod", "Node")), text
        for leak in ("Traceback", "AttributeError", "TypeError", "RecursionError", "KeyError"):
            assert leak not in text, text
        return
    if status == 413:
        return
    answer = json.loads(content)
    if verb == "prioritize":
        assert isinstance(answer, list)
        return
    assert isinstance(answer, dict)
    if verb == "preempt":  # ExtenderPreemptionResult has no error field; a failure is a 503 (above)
        assert isinstance(answer["NodeNameToMetaVictims"], dict), answer
        return
    # An unexpected exception inside is answered "tessera extender: <verb> failed: ...": a bug.
    assert f"{verb} failed" not in answer["Error"], answer["Error"]


NAMES = st.lists(st.sampled_from([*NODES, "unknown"]) | st.text(max_size=12), max_size=6)


def _node_list() -> st.SearchStrategy[Any]:
    node = st.fixed_dictionaries(
        {"metadata": st.fixed_dictionaries({"name": st.sampled_from(NODES) | st.text(max_size=8)}) | JSON}
    )
    return st.fixed_dictionaries({"items": st.lists(node | JSON, max_size=3) | st.none()}) | JSON


def _args() -> st.SearchStrategy[Any]:
    pod = POD.map(_with_name) | st.just(gpu_pod("p", uid="u1"))
    return (
        st.fixed_dictionaries(
            {"Pod": pod | JSON},
            optional={"NodeNames": NAMES | JSON, "Nodes": _node_list() | st.none()},
        )
        | JSON
    )


def _with_name(pod: Any) -> Any:
    """Most generated pods get a valid name, so that the generator gets past the wire's checks."""
    if isinstance(pod, dict):
        metadata = pod.get("metadata")
        if isinstance(metadata, dict):
            metadata.setdefault("name", "p")
            metadata.setdefault("uid", "u1")
        elif "metadata" not in pod:
            pod["metadata"] = {"name": "p", "uid": "u1"}
    return pod


BINDING = (
    st.fixed_dictionaries(
        {},
        optional={
            "PodName": st.sampled_from(["p", "q", ""]) | st.text(max_size=300) | JSON,
            "PodNamespace": st.sampled_from(["default"]) | st.text(max_size=70) | JSON,
            "PodUID": st.sampled_from(["u1", "u2"]) | st.text(max_size=130) | JSON,
            "Node": st.sampled_from([*NODES, "unknown"]) | st.text(max_size=260) | JSON,
        },
    )
    | JSON
)


def encode(value: Any) -> bytes:
    return json.dumps(value, allow_nan=True).encode("utf-8", "surrogatepass")


@given(st.sampled_from(["/filter", "/prioritize"]), _args())
def test_filter_and_prioritize(
    served: tuple[ExtenderApp, asyncio.AbstractEventLoop], path: str, args: Any
) -> None:
    check(path, *call(served, path, encode(args)))


def _victims() -> st.SearchStrategy[Any]:
    """NodeNameToMetaVictims (UIDs, as kube-scheduler sends them with nodeCacheCapable) or
    NodeNameToVictims (whole pods), mostly well formed, with wrong types anywhere."""
    uid = st.sampled_from([*UIDS, "no-such-uid"]) | st.text(max_size=40) | JSON
    meta = st.fixed_dictionaries(
        {},
        optional={
            "Pods": st.lists(st.fixed_dictionaries({"UID": uid}) | JSON, max_size=5) | st.none(),
            "NumPDBViolations": st.integers(-2, 5) | JSON,
        },
    )
    whole = st.fixed_dictionaries(
        {},
        optional={
            "Pods": st.lists(st.sampled_from(BOUND) | POD | JSON, max_size=3) | st.none(),
            "NumPDBViolations": st.integers(0, 3),
        },
    )
    node = st.sampled_from([*NODES, "unknown"]) | st.text(max_size=12)
    return st.one_of(
        st.fixed_dictionaries(
            {"NodeNameToMetaVictims": st.dictionaries(node, meta | st.none() | JSON, max_size=4)}
        ),
        st.fixed_dictionaries(
            {"NodeNameToVictims": st.dictionaries(node, whole | st.none() | JSON, max_size=3)}
        ),
        st.just({}),
        JSON,
    )


@given(st.one_of(st.just(gpu_pod("big", uid="u-big", memory=30720)), POD.map(_with_name), JSON), _victims())
def test_preempt(served: tuple[ExtenderApp, asyncio.AbstractEventLoop], pod: Any, victims: Any) -> None:
    body = {"Pod": pod, **victims} if isinstance(victims, dict) else victims
    status, content = call(served, "/preempt", encode(body))
    check("/preempt", status, content)
    if status == 200:  # only nodes kube-scheduler proposed, never more victims than it proposed
        proposed = victims.get("NodeNameToMetaVictims") or victims.get("NodeNameToVictims") or {}
        for node, chosen in json.loads(content)["NodeNameToMetaVictims"].items():
            assert node in proposed, (node, content)
            assert len(chosen["Pods"]) <= len((proposed[node] or {}).get("Pods") or []), (node, content)


@given(BINDING)
def test_bind(served: tuple[ExtenderApp, asyncio.AbstractEventLoop], args: Any) -> None:
    check("/bind", *call(served, "/bind", encode(args)))


def real_filter_body() -> bytes:
    """A filter body as kube-scheduler sends it in node-names mode (nodeCacheCapable): the whole Pod
    as the API server stores it, and the candidate names."""
    pod = gpu_pod("train-7f9c", uid="4b6f0d2e-1c3a-4e5b-9f00-2a7c1d9e8b11", memory=8192, cores=40)
    pod["metadata"].update(
        {
            "resourceVersion": "48213",
            "creationTimestamp": "2026-01-01T12:00:00Z",
            "labels": {"app": "train"},
            "annotations": {KEYS.gpu_models: "A100,V100", KEYS.policy: "spread"},
        }
    )
    container = pod["spec"]["containers"][0]
    container["resources"]["requests"] = dict(container["resources"]["limits"])
    container.update({"imagePullPolicy": "IfNotPresent", "terminationMessagePath": "/dev/termination-log"})
    pod["spec"].update({"restartPolicy": "Always", "dnsPolicy": "ClusterFirst", "priority": 0})
    pod["status"] = {"phase": "Pending", "qosClass": "BestEffort"}
    return json.dumps({"Pod": pod, "Nodes": None, "NodeNames": NODES}).encode()


REAL = real_filter_body()


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    body = bytearray(REAL)
    for _ in range(draw(st.integers(1, 8))):
        at = draw(st.integers(0, len(body)))
        kind = draw(st.sampled_from(["flip", "insert", "delete", "duplicate", "interesting"]))
        if kind == "flip" and at < len(body):
            body[at] = draw(st.integers(0, 255))
        elif kind == "insert":
            body[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif kind == "delete":
            del body[at : at + draw(st.integers(1, 16))]
        elif kind == "duplicate":
            end = min(len(body), at + draw(st.integers(1, 64)))
            body[at:at] = body[at:end] * draw(st.integers(1, 4))
        else:
            body[at:at] = draw(
                st.sampled_from(
                    [b"null", b"[]", b"{}", b'"\\ud800"', b"1e999", b"-0", b"NaN", b"[" * 2000, b'"']
                )
            )
    return bytes(body)


@given(st.sampled_from(["/filter", "/prioritize", "/preempt", "/bind"]), mutated())
def test_mutated_kube_scheduler_bodies(
    served: tuple[ExtenderApp, asyncio.AbstractEventLoop], path: str, body: bytes
) -> None:
    check(path, *call(served, path, body))


@given(st.lists(INVENTORY_TEXT, min_size=1, max_size=3), st.text(max_size=30) | st.just(format_time(NOW)))
def test_node_inventory_annotations(texts: list[str], heartbeat: str) -> None:
    """Whatever a node's annotations say, the state takes it (a broken node is unschedulable, with
    the reason) and filter still answers every node."""
    state = ClusterState(PlacementEngine(SpeedProfiles()), KEYS, heartbeat_timeout=timedelta(seconds=60))
    nodes = [
        {"metadata": {"name": f"n{i}", "annotations": {KEYS.node_gpus: text, KEYS.node_heartbeat: heartbeat}}}
        for i, text in enumerate(texts)
    ]
    nodes.append(node_object("good", inventory("good", "Tesla T4", 15360), NOW))
    state.replace_nodes(nodes, NOW)
    state.replace_pods([])
    extender = Extender(
        state,
        None,
        KEYS,
        Metrics(),
        inflight_timeout=timedelta(minutes=5),
        clock=lambda: NOW,
        filter_keeps_best=False,
    )
    names = [n["metadata"]["name"] for n in nodes]
    answer = extender.filter(gpu_pod("p", memory=1024, uid="u1"), names)
    assert "good" in answer.passed, answer
    assert set(answer.passed) | set(answer.failed) | set(answer.unresolvable) <= set(names)


def test_the_real_body_is_answered() -> None:
    """On an app of its own: the fuzzers' binds (their inputs change with each run's seed) may
    have filled the shared one's GPUs."""
    with serving() as fresh:
        status, content = call(fresh, "/filter", REAL)
    assert status == 200, content
    assert sorted(json.loads(content)["NodeNames"]) == ["a100", "v100"]  # the models it allows
