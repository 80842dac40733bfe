"""A stand-in for the API server's calls the extender makes, and an extender over one node with one
GPU, for the verbs' tests (the real API server is in test_k8s.py)."""

from __future__ import annotations

import asyncio
import copy
from datetime import UTC, datetime, timedelta
from typing import Any

from extender.kube import ApiError
from extender.leader import LeaderLease
from extender.metrics import Metrics
from extender.service import Extender
from extender.state import ClusterState
from tessera.contract import KEYS, JsonObject
from tessera.placement import PlacementEngine, QosThresholds, SpeedProfiles
from tests.extender.helpers import gpu_pod, inventory, node_object

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


class FakeApi:
    """The two calls bind makes, with the API server's preconditions and its binding rule."""

    def __init__(self, pods: list[JsonObject]) -> None:
        self.pods = {p["metadata"]["name"]: p for p in pods}
        self.version = 100
        self.binds = 0
        self.fail_next_bind: ApiError | None = None
        # The next binding is stored, and its answer lost (the API server killed in between).
        self.lose_next_answer = False
        self.lease_holder = ""
        self.lease_error: ApiError | None = None
        self.events: list[tuple[str, str, str, bool]] = []  # (pod, reason, message, warning)

    def pod(self, name: str) -> JsonObject:
        if name not in self.pods:
            raise ApiError(404, f'pods "{name}" not found')
        return copy.deepcopy(self.pods[name])

    async def get_pod(self, namespace: str, name: str) -> JsonObject:
        return self.pod(name)

    async def get_lease(self, namespace: str, name: str) -> JsonObject:
        assert (namespace, name) == ("tessera-system", "tessera-scheduler")
        if self.lease_error is not None:
            raise self.lease_error
        return {"spec": {"holderIdentity": self.lease_holder}}

    async def list(self, path: str, field_selector: str = "") -> tuple[list[JsonObject], str]:
        """The pods bound to one node (bind's ``spec.nodeName=<node>``), as the API server lists them."""
        assert path == "/api/v1/pods" and field_selector.startswith("spec.nodeName="), (path, field_selector)
        node = field_selector.removeprefix("spec.nodeName=")
        return [copy.deepcopy(p) for p in self.pods.values() if p["spec"].get("nodeName") == node], str(
            self.version
        )

    async def create_event(self, pod: JsonObject, *, reason: str, message: str, warning: bool) -> None:
        self.events.append((pod["metadata"]["name"], reason, message, warning))

    def touch(self, name: str) -> None:
        self.version += 1
        self.pods[name]["metadata"]["resourceVersion"] = str(self.version)

    async def bind_pod(
        self,
        namespace: str,
        name: str,
        *,
        uid: str,
        resource_version: str,
        node: str,
        annotations: dict[str, str],
    ) -> None:
        self.binds += 1
        if self.fail_next_bind is not None:
            error, self.fail_next_bind = self.fail_next_bind, None
            raise error
        pod = self.pods[name]
        if pod["metadata"]["uid"] != uid or (
            resource_version and pod["metadata"]["resourceVersion"] != resource_version
        ):
            raise ApiError(409, "Precondition failed")
        if pod["spec"].get("nodeName"):
            raise ApiError(409, f'pod {name} is already assigned to node "{pod["spec"]["nodeName"]}"')
        pod["spec"]["nodeName"] = node
        pod["metadata"]["annotations"].update(annotations)
        self.touch(name)
        if self.lose_next_answer:
            self.lose_next_answer = False
            raise ApiError(0, f"POST {name}/binding: ServerDisconnectedError: Server disconnected")


def api_pod(name: str, **kwargs: Any) -> JsonObject:
    pod = gpu_pod(name, uid=f"uid-{name}", **kwargs)
    pod["metadata"]["resourceVersion"] = "1"
    return pod


def one_gpu_state() -> ClusterState:
    """Node "n" with one T4 (four slices), synced."""
    s = ClusterState(PlacementEngine(SpeedProfiles()), KEYS, heartbeat_timeout=timedelta(minutes=5))
    s.replace_nodes([node_object("n", inventory("n", "Tesla T4", 15360, count=1, split=4), NOW)], NOW)
    s.replace_pods([])
    return s


def extender(
    state: ClusterState,
    api: FakeApi,
    qos_thresholds: QosThresholds | None = None,
    leader: LeaderLease | None = None,
    inflight_wait: timedelta = timedelta(milliseconds=50),
) -> Extender:
    return Extender(
        state,
        api,  # type: ignore[arg-type]
        KEYS,
        Metrics(),
        inflight_timeout=timedelta(minutes=5),
        clock=lambda: NOW,
        inflight_wait=inflight_wait,
        qos_thresholds=qos_thresholds,
        leader=leader,
    )


def bind(ext: Extender, namespace: str, name: str, uid: str, node: str) -> str:
    return asyncio.run(ext.bind(namespace, name, uid, node))


def used(state: ClusterState) -> int:
    return state.engine.nodes["n"].gpus[0].used_memory_mib
