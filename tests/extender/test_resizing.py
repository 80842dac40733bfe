"""Live resize in the extender, against a stand-in API server whose writes reach the watch late:
resize requests and new pods, interleaved at random, never overcommit a GPU (neither in what the
extender counts nor in what the API server ends up holding), and a request whose pod changed under
it is decided again."""

from __future__ import annotations

import asyncio
import copy
import random
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from extender.kube import ApiError
from extender.metrics import Metrics
from extender.podrecords import PodAllocation
from extender.resizing import DRA_REFUSAL, Resizer
from extender.state import ClusterState
from tessera.contract import (
    KEYS,
    JsonObject,
    Phase,
    ResizeOutcome,
    dump_allocation,
    format_time,
    parse_allocation,
    parse_pod_request,
    parse_resize_status,
)
from tessera.placement import NodeFit, PlacementEngine, SpeedProfiles, shape_of, to_allocation
from tests.extender.helpers import gpu_pod, inventory, node_object

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
MEMORY = 8192


class StandInApi:
    """Pods by name; each write bumps the resourceVersion and queues the pod for the watch, which
    the test delivers when it likes. Writes check uid and resourceVersion as the API server does."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.pods: dict[str, JsonObject] = {}
        self.version = 0
        self.watch: list[JsonObject] = []
        self.events: list[tuple[str, str]] = []
        self.conflicts = 0

    def write(self, pod: JsonObject) -> None:
        self.version += 1
        pod["metadata"]["resourceVersion"] = str(self.version)
        self.pods[pod["metadata"]["name"]] = pod
        self.watch.append(copy.deepcopy(pod))

    def annotate(self, name: str, annotations: dict[str, str | None]) -> None:
        pod = copy.deepcopy(self.pods[name])
        for key, value in annotations.items():
            if value is None:
                pod["metadata"]["annotations"].pop(key, None)
            else:
                pod["metadata"]["annotations"][key] = value
        self.write(pod)

    async def _lag(self) -> None:
        for _ in range(self.rng.randint(0, 8)):
            await asyncio.sleep(0)

    async def get_pod(self, namespace: str, name: str) -> JsonObject:
        await self._lag()
        if name not in self.pods:
            raise ApiError(404, f"pods {name!r} not found")
        return copy.deepcopy(self.pods[name])

    async def list(self, path: str, field_selector: str = "") -> tuple[list[JsonObject], str]:
        """The namespace's ResourceQuotas a resize reads: none here (tests/extender/test_k8s_resize.py
        has one, on the real API server). Answered without a lag: the writes' interleaving is the
        test's subject."""
        assert path.endswith("/resourcequotas"), path
        return [], str(self.version)

    async def patch_pod_metadata(self, namespace: str, name: str, patch: JsonObject) -> None:
        await self._lag()
        metadata = self.pods[name]["metadata"]
        if patch["metadata"]["resourceVersion"] != metadata["resourceVersion"]:
            self.conflicts += 1
            raise ApiError(409, "the object has been modified")
        assert patch["metadata"]["uid"] == metadata["uid"]
        self.annotate(name, patch["metadata"]["annotations"])

    async def create_event(self, pod: JsonObject, *, reason: str, message: str, warning: bool) -> None:
        self.events.append((pod["metadata"]["name"], reason))


def overcommitted(used: dict[str, list[int]]) -> list[str]:
    return [uuid for uuid, (memory, cores) in used.items() if memory > MEMORY or cores > 100]


def held_by_the_api(api: StandInApi) -> dict[str, list[int]]:
    used: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for pod in api.pods.values():
        for container in parse_allocation(pod["metadata"]["annotations"][KEYS.allocation]).containers:
            for grant in container.gpus:
                used[grant.uuid][0] += grant.memory_quota_mib
                used[grant.uuid][1] += grant.cores
    return used


def counted_by_the_extender(state: ClusterState) -> dict[str, list[int]]:
    node = state.node("n")
    assert node is not None
    return {g.uuid: [g.used_memory_mib, g.used_cores] for g in node.gpus}


def setup(rng: random.Random) -> tuple[ClusterState, StandInApi, Resizer, Metrics]:
    state = ClusterState(PlacementEngine(SpeedProfiles()), KEYS, heartbeat_timeout=timedelta(minutes=5))
    state.replace_nodes([node_object("n", inventory("n", "Tesla T4", MEMORY, count=2, split=16), NOW)], NOW)
    state.replace_pods([])
    api = StandInApi(rng)
    metrics = Metrics()

    async def leads() -> str:
        return ""

    resizer = Resizer(state, api, KEYS, metrics, clock=lambda: NOW, leads=leads)  # type: ignore[arg-type]
    return state, api, resizer, metrics


def deliver(api: StandInApi, state: ClusterState, resizer: Resizer, count: int) -> None:
    """The watch shows the oldest ``count`` writes."""
    for pod in api.watch[:count]:
        state.upsert_pod(pod)
        resizer.pod_changed(pod)
    del api.watch[:count]


def bind(api: StandInApi, state: ClusterState, name: str, memory: int, cores: int) -> bool:
    """A new pod placed by the placement core as bind places it: counted at once, written, seen later."""
    pod: dict[str, Any] = gpu_pod(name, memory=memory, cores=cores, uid=f"uid-{name}")
    fits = state.evaluate(shape_of(parse_pod_request(pod)), ["n"]).fits
    if not fits:
        return False
    fit: NodeFit = fits[0]
    allocation = to_allocation(fit.node, fit.placement, ["main"])
    state.assume(
        PodAllocation(
            uid=f"uid-{name}",
            namespace="default",
            name=name,
            allocation=allocation,
            phase=Phase.ALLOCATED.value,
            bind_time=NOW,
        )
    )
    pod["spec"]["nodeName"] = "n"
    pod["metadata"]["annotations"].update(
        {
            KEYS.allocation: dump_allocation(allocation),
            KEYS.allocation_phase: Phase.ALLOCATED.value,
            KEYS.bind_time: format_time(NOW),
        }
    )
    api.write(pod)
    return True


def test_random_resizes_and_new_pods_never_overcommit_a_gpu() -> None:
    rng = random.Random(1616)

    async def run() -> tuple[StandInApi, Metrics]:
        state, api, resizer, metrics = setup(rng)
        resizer.start()
        try:
            for step in range(200):
                roll = rng.random()
                if roll < 0.35 or not api.pods:
                    bind(api, state, f"p{step}", rng.choice([512, 1024, 2048]), rng.randint(1, 30))
                elif roll < 0.85:
                    name = rng.choice(sorted(api.pods))
                    memory, cores = rng.choice([256, 1024, 2048, 4096]), rng.randint(1, 60)
                    api.annotate(name, {KEYS.resize: f"memory={memory},cores={cores}"})
                else:  # the tenant writes something else on a pod: a request in flight meets a conflict
                    api.annotate(rng.choice(sorted(api.pods)), {"team": str(step)})
                deliver(api, state, resizer, rng.randint(0, len(api.watch)))
                for _ in range(rng.randint(0, 4)):
                    await asyncio.sleep(0)
                assert not overcommitted(counted_by_the_extender(state)), step
                assert not overcommitted(held_by_the_api(api)), step
            while api.watch or any(KEYS.resize in p["metadata"]["annotations"] for p in api.pods.values()):
                deliver(api, state, resizer, len(api.watch))
                await asyncio.sleep(0)
                assert not overcommitted(held_by_the_api(api))
        finally:
            await resizer.stop()
        # Once the watch caught up, the extender counts exactly what the API server holds.
        assert counted_by_the_extender(state) == {
            u: held_by_the_api(api).get(u, [0, 0]) for u in counted_by_the_extender(state)
        }
        return api, metrics

    api, metrics = asyncio.run(run())
    outcomes = [
        parse_resize_status(p["metadata"]["annotations"][KEYS.resize_status]).outcome
        for p in api.pods.values()
        if KEYS.resize_status in p["metadata"]["annotations"]
    ]
    applied = metrics.resizes.labels("applied")._value.get()
    refused = metrics.resizes.labels("refused")._value.get()
    assert applied > 20 and refused > 20, (applied, refused)  # both paths were taken, many times
    assert ResizeOutcome.APPLIED in outcomes and ResizeOutcome.REFUSED in outcomes
    assert api.conflicts > 0  # requests whose pod changed under them were decided again


def placed(api: StandInApi, state: ClusterState, name: str, phase: Phase = Phase.ALLOCATED) -> None:
    assert bind(api, state, name, 1024, 10)
    api.annotate(name, {KEYS.allocation_phase: phase.value})


def answer_of(api: StandInApi, name: str) -> tuple[ResizeOutcome, str] | None:
    text = api.pods[name]["metadata"]["annotations"].get(KEYS.resize_status)
    if text is None:
        return None
    status = parse_resize_status(text)
    return status.outcome, status.message


async def settle(api: StandInApi, state: ClusterState, resizer: Resizer, rounds: int = 50) -> None:
    for _ in range(rounds):
        deliver(api, state, resizer, len(api.watch))
        await asyncio.sleep(0.001)


def test_a_request_on_a_pod_being_admitted_waits_until_its_containers_have_their_gpus() -> None:
    async def run() -> None:
        state, api, resizer, _ = setup(random.Random(1))
        resizer.start()
        try:
            placed(api, state, "p", Phase.ALLOCATING)
            api.annotate("p", {KEYS.resize: "memory=2048"})
            await settle(api, state, resizer)
            assert answer_of(api, "p") is None  # still allocating: not answered, not refused
            api.annotate("p", {KEYS.allocation_phase: Phase.ALLOCATED.value})  # the device plugin's write
            await settle(api, state, resizer)
            assert answer_of(api, "p") == (
                ResizeOutcome.APPLIED,
                "container main: GPU-n-0 2048 MiB 10% compute",
            )
        finally:
            await resizer.stop()

    asyncio.run(run())


def test_only_the_leader_answers_and_a_waiting_request_is_tried_again() -> None:
    async def run() -> None:
        state, api, _, metrics = setup(random.Random(2))
        leading = ["the scheduler beside it does not hold the lease"]

        async def leads() -> str:
            return leading[0]

        resizer = Resizer(state, api, KEYS, metrics, clock=lambda: NOW, leads=leads, retry_every=0.01)  # type: ignore[arg-type]
        resizer.start()
        try:
            placed(api, state, "p")
            api.annotate("p", {KEYS.resize: "cores=50"})
            await settle(api, state, resizer)
            assert answer_of(api, "p") is None
            leading[0] = ""
            await settle(api, state, resizer)
            assert answer_of(api, "p") == (
                ResizeOutcome.APPLIED,
                "container main: GPU-n-0 1024 MiB 50% compute",
            )
        finally:
            await resizer.stop()

    asyncio.run(run())


def test_a_refusal_writes_the_status_and_an_event_and_changes_nothing_else() -> None:
    async def run() -> None:
        state, api, resizer, metrics = setup(random.Random(3))
        resizer.start()
        try:
            placed(api, state, "p")
            allocation = api.pods["p"]["metadata"]["annotations"][KEYS.allocation]
            for text, message in (
                (
                    "memory=9000",
                    "GPU GPU-n-0 on node n: 7976 MiB more memory asked, 7168 MiB of 8192 MiB free",
                ),
                ("side:cores=5", "container 'side' has no GPU allocation (GPU containers: main)"),
                ("cores=0", f"annotation {KEYS.resize}: value: cores: 0 is outside 1..100"),
            ):
                api.annotate("p", {KEYS.resize: text})
                await settle(api, state, resizer)
                assert answer_of(api, "p") == (ResizeOutcome.REFUSED, message)
                assert KEYS.resize not in api.pods["p"]["metadata"]["annotations"]
            assert api.pods["p"]["metadata"]["annotations"][KEYS.allocation] == allocation
            assert api.events == [("p", "TesseraResizeRefused")] * 3
            assert metrics.resizes.labels("refused")._value.get() == 3
        finally:
            await resizer.stop()

    asyncio.run(run())


@pytest.mark.parametrize(
    ("field", "claims"),
    [
        ("spec", {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "share"}]}),
        # A whole-GPU pod (docs/dra.md, "Whole GPUs"): the claim is kube-scheduler's, named in its status.
        (
            "status",
            {
                "extendedResourceClaimStatus": {
                    "resourceClaimName": "claimed-extended-resources-x7k2p",
                    "requestMappings": [
                        {
                            "containerName": "main",
                            "resourceName": KEYS.whole_gpu,
                            "requestName": "container-0-request-0",
                        }
                    ],
                }
            },
        ),
    ],
)
def test_a_request_on_a_pod_served_by_dra_claims_is_refused_with_the_reason(
    field: str, claims: dict[str, Any]
) -> None:
    async def run() -> None:
        state, api, resizer, _ = setup(random.Random(4))
        resizer.start()
        try:
            pod: dict[str, Any] = gpu_pod("claimed", memory=1024, cores=10, uid="uid-claimed")
            pod["spec"]["nodeName"] = "n"
            pod.setdefault(field, {}).update(claims)
            pod["metadata"]["annotations"][KEYS.resize] = "memory=2048"
            api.write(pod)
            await settle(api, state, resizer)
            assert answer_of(api, "claimed") == (ResizeOutcome.REFUSED, DRA_REFUSAL)
            assert KEYS.resize not in api.pods["claimed"]["metadata"]["annotations"]
            assert KEYS.allocation not in api.pods["claimed"]["metadata"]["annotations"]
            assert api.events == [("claimed", "TesseraResizeRefused")]
        finally:
            await resizer.stop()

    asyncio.run(run())
