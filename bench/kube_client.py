"""CPU per Kubernetes API operation of the extender: its own client (``extender.kube.KubeApi``:
aiohttp + orjson, plain dicts) against ``kubernetes_asyncio`` on the same event loop (uvloop, as the
extender runs), against the real etcd + kube-apiserver of ``sandbox.controlplane``.

Operations, as the extender makes them:

* bind: one POST of a Binding carrying the allocation annotations (the API server copies them onto
  the pod with the node name), 8 in flight;
* get pod: one GET of a bound pod with the extender's annotations, 8 in flight;
* list nodes: every node (pages of 500) of a fleet of 8-GPU nodes with the inventory annotation,
  3 times per round;
* watch events: node heartbeat changes and bound-pod annotation changes, made by a separate
  process (its CPU is not counted), read and decoded until all have arrived.

kubernetes_asyncio is measured four ways: typed models (as documented); models turned back into
the API's camelCase dicts (``sanitize_for_serialization``), the shape the extender parses (for
watches ``raw_object``, which the library keeps beside the model); ``_preload_content=False`` with
the body decoded by orjson (the library as a request builder only); and the same with its aiohttp
session's ``trust_env`` turned off (a private attribute), to show what that setting costs.

CPU is this process's CPU time (``time.process_time``: user + system, all threads) over the
operations, divided by their number, after a garbage collection (untimed); the API server's own CPU
is not in it. Variants take turns going first within each round; the table shows the median over
rounds and the range.

    .venv/bin/python -m bench.kube_client [--nodes 1000 5000] [--rounds 5] [--ops 200] [--events 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson
import uvloop
from kubernetes import client as sync_client
from kubernetes import config as sync_config
from kubernetes_asyncio import client as aclient
from kubernetes_asyncio import config as aconfig
from kubernetes_asyncio import watch as awatch

from bench.fleet import make_nodes, node_name, pod_body
from extender.kube import KubeApi, load_configuration
from sandbox.controlplane import ControlPlane
from tessera.contract import KEYS, format_time, now

NAMESPACE = "bench"
IN_FLIGHT = 8
LISTS = 3  # per round and variant
TAG = "bench.tessera.io/tag"
VARIANTS = (
    "own",
    "k8s_asyncio models",
    "k8s_asyncio models->dicts",
    "k8s_asyncio raw+orjson",
    "k8s_asyncio raw+orjson, trust_env off",
)
WATCH_READ = 1 << 16


# --------------------------------------------------------------------------------------------------
# Set-up (untimed): nodes and pods, with the sync official client from threads.


def bind_annotations(node: str) -> dict[str, str]:
    allocation = {
        "node": node,
        "containers": [
            {"name": "main", "gpus": [{"uuid": f"GPU-{node}-3", "memory_mib": 4096, "cores": 20}]}
        ],
    }
    return {
        KEYS.allocation: json.dumps(allocation, separators=(",", ":")),
        KEYS.allocation_phase: "allocating",
        KEYS.bind_time: format_time(now()),
    }


def sync_core(kubeconfig: Path) -> Any:
    return sync_client.CoreV1Api(sync_config.new_client_from_config(config_file=str(kubeconfig)))


def make_pods(core: Any, names: list[str], node: str | None = None) -> None:
    def make(name: str) -> None:
        body = pod_body(name)
        if node is not None:
            body["spec"]["nodeName"] = node
            body["metadata"]["annotations"] = bind_annotations(node)
        core.create_namespaced_pod(NAMESPACE, body)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(make, names))


# --------------------------------------------------------------------------------------------------
# The changes a watch sees, made by another process so that its CPU is not counted.


def patcher(kubeconfig: str) -> None:
    """Read "nodes|pods COUNT NAMES TAG" lines; patch the tag annotation of COUNT objects (cycling
    over NAMES, comma-separated), then answer "done"."""
    core = sync_core(Path(kubeconfig))
    pool = ThreadPoolExecutor(8)
    for line in sys.stdin:
        kind, count, names_csv, tag = line.split()
        names = names_csv.split(",")

        def patch(i: int, kind: str = kind, names: list[str] = names, tag: str = tag) -> None:
            body = {"metadata": {"annotations": {TAG: f"{tag}-{i}"}}}
            if kind == "nodes":
                core.patch_node(names[i % len(names)], body)
            else:
                core.patch_namespaced_pod(names[i % len(names)], NAMESPACE, body)

        list(pool.map(patch, range(int(count))))
        print("done", flush=True)


class Patcher:
    def __init__(self, kubeconfig: Path) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bench.kube_client", "--patcher", str(kubeconfig)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def send(self, kind: str, count: int, names: list[str], tag: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(f"{kind} {count} {','.join(names)} {tag}\n")
        self.process.stdin.flush()

    def wait(self) -> None:
        assert self.process.stdout is not None
        assert self.process.stdout.readline().strip() == "done"

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=30)


# --------------------------------------------------------------------------------------------------
# The clients, each as four operations on dicts (or models).


def binding(namespace: str, name: str, uid: str, node: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {"name": name, "namespace": namespace, "uid": uid, "annotations": bind_annotations(node)},
        "target": {"apiVersion": "v1", "kind": "Node", "name": node},
    }


def split_lines(pending: bytes, chunk: bytes) -> tuple[list[bytes], bytes]:
    *lines, rest = (pending + chunk).split(b"\n")
    return lines, rest


class Own:
    def __init__(self, kube: KubeApi) -> None:
        self.kube = kube

    async def bind(self, name: str, uid: str, node: str) -> None:
        metadata = binding(NAMESPACE, name, uid, node)["metadata"]
        await self.kube.bind_pod(
            NAMESPACE, name, uid=uid, resource_version="", node=node, annotations=metadata["annotations"]
        )

    async def get_pod(self, name: str) -> Any:
        return await self.kube.get_pod(NAMESPACE, name)

    async def list_nodes(self) -> int:
        items, _ = await self.kube.list("/api/v1/nodes")
        return len(items)

    async def watch(self, kind: str, version: str, tag: str, count: int, lines: list[bytes] | None) -> None:
        path, selector = ("/api/v1/nodes", "") if kind == "nodes" else ("/api/v1/pods", "spec.nodeName!=")
        seen = 0
        async for event in self.kube.watch(path, version, 60, selector):
            annotations = event["object"]["metadata"].get("annotations") or {}
            if annotations.get(TAG, "").startswith(tag + "-"):
                seen += 1
                if seen == count:
                    return


class Asyncio:
    """kubernetes_asyncio: ``mode`` is "models", "dicts" (models turned into camelCase dicts) or
    "raw" (``_preload_content=False`` and orjson)."""

    def __init__(self, api: Any, mode: str) -> None:
        self.api = api
        self.core = aclient.CoreV1Api(api)
        self.mode = mode

    async def bind(self, name: str, uid: str, node: str) -> None:
        body = binding(NAMESPACE, name, uid, node)
        if self.mode == "raw":
            response = await self.core.create_namespaced_pod_binding(
                name, NAMESPACE, body, _preload_content=False
            )
            data = await response.read()
            assert 200 <= response.status < 300, data
            orjson.loads(data)
            return
        model = aclient.V1Binding(
            metadata=aclient.V1ObjectMeta(**body["metadata"]),
            target=aclient.V1ObjectReference(api_version="v1", kind="Node", name=node),
        )
        # The API server answers a Binding with a Status, which the generated V1Binding model
        # refuses ("target must not be None") after the write succeeded: a known bug of the
        # generated clients, paid here as a user of the models would pay it.
        with contextlib.suppress(ValueError):
            await self.core.create_namespaced_pod_binding(name, NAMESPACE, model)

    async def get_pod(self, name: str) -> Any:
        if self.mode == "raw":
            response = await self.core.read_namespaced_pod(name, NAMESPACE, _preload_content=False)
            data = await response.read()
            assert 200 <= response.status < 300, data
            return orjson.loads(data)
        pod = await self.core.read_namespaced_pod(name, NAMESPACE)
        return self.api.sanitize_for_serialization(pod) if self.mode == "dicts" else pod

    async def list_nodes(self) -> int:
        items: list[Any] = []
        token = ""
        while True:
            if self.mode == "raw":
                response = await self.core.list_node(limit=500, _continue=token, _preload_content=False)
                data = await response.read()
                assert 200 <= response.status < 300, data
                page = orjson.loads(data)
                items.extend(page.get("items") or [])
                token = page.get("metadata", {}).get("continue") or ""
            else:
                result = await self.core.list_node(limit=500, _continue=token)
                if self.mode == "dicts":
                    items.extend(self.api.sanitize_for_serialization(n) for n in result.items)
                else:
                    items.extend(result.items)
                token = result.metadata._continue or ""
            if not token:
                return len(items)

    async def watch(self, kind: str, version: str, tag: str, count: int, lines: list[bytes] | None) -> None:
        func = self.core.list_node if kind == "nodes" else self.core.list_pod_for_all_namespaces
        selector = {} if kind == "nodes" else {"field_selector": "spec.nodeName!="}
        seen = 0
        if self.mode == "raw":
            response = await func(
                watch=True,
                resource_version=version,
                allow_watch_bookmarks=True,
                timeout_seconds=60,
                _preload_content=False,
                **selector,
            )
            async with response:
                pending = b""
                while chunk := await response.content.read(WATCH_READ):
                    got, pending = split_lines(pending, chunk)
                    for line in got:
                        if not line.strip():
                            continue
                        if lines is not None:
                            lines.append(line)
                        event = orjson.loads(line)
                        annotations = event["object"]["metadata"].get("annotations") or {}
                        if annotations.get(TAG, "").startswith(tag + "-"):
                            seen += 1
                            if seen == count:
                                return
            return
        # Models and "dicts" alike: the library decodes every event into a model and keeps the
        # decoded JSON beside it as raw_object (the dict the extender would use).
        w = awatch.Watch()
        try:
            async for event in w.stream(
                func, resource_version=version, allow_watch_bookmarks=True, timeout_seconds=60, **selector
            ):
                if self.mode == "dicts":
                    annotations = event["raw_object"]["metadata"].get("annotations") or {}
                else:
                    annotations = event["object"].metadata.annotations or {}
                if annotations.get(TAG, "").startswith(tag + "-"):
                    seen += 1
                    if seen == count:
                        return
        finally:
            await w.close()


# --------------------------------------------------------------------------------------------------


def turn(round_: int) -> tuple[str, ...]:
    """The variants in this round's order: each goes first in turn."""
    first = round_ % len(VARIANTS)
    return VARIANTS[first:] + VARIANTS[:first]


async def cpu_of(work: Callable[[], Awaitable[None]]) -> float:
    # The garbage of earlier measurements (the models variants make much) is not this one's: a
    # collection over it would land in whichever measurement comes next.
    gc.collect()
    started = time.process_time()
    await work()
    return time.process_time() - started


async def in_flight(calls: list[Callable[[], Awaitable[Any]]], limit: int = IN_FLIGHT) -> None:
    gate = asyncio.Semaphore(limit)

    async def one(call: Callable[[], Awaitable[Any]]) -> None:
        async with gate:
            await call()

    await asyncio.gather(*(one(c) for c in calls))


async def current_version(kube: KubeApi, path: str) -> str:
    page = await kube._call("GET", path, query=[("limit", "1")])
    return str(page["metadata"]["resourceVersion"])


async def measure(args: argparse.Namespace, kubeconfig: Path, core: Any, patch: Patcher) -> None:
    kube = KubeApi(load_configuration(kubeconfig))
    configuration = aclient.Configuration()
    await aconfig.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
    api = aclient.ApiClient(configuration)
    # The library's session trusts the environment (hard-coded): aiohttp then looks up ~/.netrc and
    # the proxy variables in a worker thread on every request. Turned off here (a private attribute)
    # only to show what that costs.
    quiet = aclient.ApiClient(configuration)
    quiet.rest_client.pool_manager._trust_env = False
    clients: dict[str, Own | Asyncio] = {
        "own": Own(kube),
        "k8s_asyncio models": Asyncio(api, "models"),
        "k8s_asyncio models->dicts": Asyncio(api, "dicts"),
        "k8s_asyncio raw+orjson": Asyncio(api, "raw"),
        "k8s_asyncio raw+orjson, trust_env off": Asyncio(quiet, "raw"),
    }
    # per (operation, variant): CPU ms per operation, one value per round
    results: dict[tuple[str, str], list[float]] = {}

    def record(op: str, variant: str, seconds: float, count: int) -> None:
        results.setdefault((op, variant), []).append(seconds * 1000 / count)

    bound = [f"watched-{i}" for i in range(200)]
    await asyncio.to_thread(make_pods, core, bound, "bench-0000")
    for c in clients.values():  # connections opened, token read, lazy imports done: not timed
        await in_flight([lambda c=c: c.get_pod("watched-0")] * IN_FLIGHT)
        await c.list_nodes()
    lines: dict[str, list[bytes]] = {"nodes": [], "pods": []}
    fleet = 0
    for nodes in sorted(args.nodes):
        await asyncio.to_thread(make_nodes, core, range(fleet, nodes))
        fleet = nodes
        print(f"{fleet} nodes", flush=True)
        for round_ in range(args.rounds):
            order = turn(round_)
            for variant in order:
                c = clients[variant]
                record(f"list {nodes} nodes", variant, await cpu_of(lambda c=c: lists(c, LISTS)), LISTS)
    node_names = [node_name(i) for i in range(min(fleet, args.events))]
    for round_ in range(args.rounds):
        for v, variant in enumerate(turn(round_)):
            c = clients[variant]
            names = [f"bind-{round_}-{v}-{i}" for i in range(args.ops)]
            await asyncio.to_thread(make_pods, core, names)
            uids = {
                p.metadata.name: p.metadata.uid
                for p in (await asyncio.to_thread(core.list_namespaced_pod, NAMESPACE)).items
            }
            binds = [functools.partial(c.bind, n, uids[n], node_name(i % fleet)) for i, n in enumerate(names)]
            record("bind", variant, await cpu_of(lambda binds=binds: in_flight(binds)), len(binds))
            gets = [lambda n=n, c=c: c.get_pod(n) for n in names]
            record("get pod", variant, await cpu_of(lambda gets=gets: in_flight(gets)), len(gets))
            for kind, path, targets in (
                ("nodes", "/api/v1/nodes", node_names),
                ("pods", "/api/v1/pods", bound),
            ):
                version = await current_version(kube, path)
                tag = f"r{round_}v{v}{kind}"
                patch.send(kind, args.events, targets, tag)
                capture = lines[kind] if variant == "k8s_asyncio raw+orjson" and round_ == 0 else None
                seconds = await cpu_of(
                    lambda c=c, kind=kind, version=version, tag=tag, capture=capture: c.watch(
                        kind, version, tag, args.events, capture
                    )
                )
                patch.wait()
                record(f"watch: {kind[:-1]} event", variant, seconds, args.events)
            print(f"round {round_ + 1}, {variant}: done", flush=True)
    await kube.close()
    await api.close()
    await quiet.close()
    report(results, args)
    await decode_only(lines, args.rounds)


async def lists(c: Own | Asyncio, count: int) -> None:
    for _ in range(count):
        await c.list_nodes()


def report(results: dict[tuple[str, str], list[float]], args: argparse.Namespace) -> None:
    ops = list(dict.fromkeys(op for op, _ in results))
    print(
        f"\nCPU ms per operation in this process, median of {args.rounds} rounds "
        f"(min-max in brackets); ratio = variant / own\n"
    )
    print("| operation | " + " | ".join(VARIANTS) + " |")
    print("|---|" + "---:|" * len(VARIANTS))
    for op in ops:
        own = statistics.median(results[(op, "own")])
        cells = []
        for variant in VARIANTS:
            values = results[(op, variant)]
            median = statistics.median(values)
            ratio = "" if variant == "own" else f", x{median / own:.1f}"
            cells.append(f"{median:.3f} ({min(values):.3f}-{max(values):.3f}{ratio})")
        print(f"| {op} | " + " | ".join(cells) + " |")


async def decode_only(lines: dict[str, list[bytes]], rounds: int) -> None:
    """Decoding alone, from watch lines the API server sent: orjson (own client, raw) against the
    library's ``Watch.unmarshal_event`` (json, then a model)."""
    w = awatch.Watch()
    print("\nDecoding one watch line alone, CPU us (median of rounds)\n")
    print("| event | lines | orjson.loads | Watch.unmarshal_event (model + raw_object) | ratio |")
    print("|---|---:|---:|---:|---:|")
    for kind, model in (("nodes", "V1Node"), ("pods", "V1Pod")):
        got = lines[kind]
        if not got:
            continue
        fast, slow = [], []
        for _ in range(rounds):
            started = time.process_time()
            for line in got:
                orjson.loads(line)
            fast.append((time.process_time() - started) * 1e6 / len(got))
            started = time.process_time()
            for line in got:
                w.unmarshal_event(line.decode(), model)
            slow.append((time.process_time() - started) * 1e6 / len(got))
        f, s = statistics.median(fast), statistics.median(slow)
        print(f"| {kind[:-1]} | {len(got)} | {f:.1f} | {s:.1f} | x{s / f:.0f} |")
    await w.close()


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--patcher":
        patcher(sys.argv[2])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1000, 5000])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ops", type=int, default=200, help="binds and gets per round and variant")
    parser.add_argument("--events", type=int, default=1000, help="watch events per round, kind and variant")
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory(prefix="tessera-bench-") as work,
        ControlPlane(work_dir=Path(work)) as plane,
    ):
        core = sync_core(plane.kubeconfig)
        core.create_namespace({"metadata": {"name": NAMESPACE}})
        patch = Patcher(plane.kubeconfig)
        try:
            uvloop.run(measure(args, plane.kubeconfig, core, patch))
        finally:
            patch.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
