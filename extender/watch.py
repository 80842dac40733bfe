"""Keeps :class:`extender.state.ClusterState` in step with the API server: list, then watch, and
list again when the watch fails or the server says 410 Gone (history compacted).

After a failure (the API server unreachable or answering an error, an object that cannot be
applied) the next list waits a jittered exponential backoff (tenacity), which starts again from its
first step after each successful list; after 410 Gone it lists again at once.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Awaitable, Callable
from datetime import datetime

from tenacity import AsyncRetrying, RetryCallState

from extender.kube import PODS, ApiError, KubeApi
from extender.resizing import Resizer
from extender.state import ClusterState
from tessera.contract import JsonObject
from tessera.watching import HTTP_GONE, WATCH_SECONDS, relist_wait

log = logging.getLogger(__name__)

# Only bound pods hold GPUs (an allocation on an unbound pod holds nothing), so pods waiting to be
# scheduled are not watched: their creation and kube-scheduler's status updates are half the pod
# events of a busy cluster. A pod comes into the watch when it is bound. (The reservation of a
# pending pod deleted before its bind lapses after its TTL instead of at once.)
BOUND_PODS = "spec.nodeName!="


def settle_heap() -> None:
    """Collect once, then exempt every object alive now (the nodes and pods just listed, the
    placement engine's nodes) from the cyclic garbage collector's later full passes.

    At thousands of nodes those objects are over a million, and a full pass over them stops the
    extender for about 0.4 s; frozen, they are still freed by reference counting, and only the
    objects made since are scanned.
    """
    gc.collect()
    gc.freeze()


class _RelistError(Exception):
    """The watch cannot continue from its resourceVersion."""


class Watcher:
    """Lists and watches nodes and pods, and sweeps heartbeats and reservations, as tasks on the
    extender's event loop (the loop that answers kube-scheduler owns the state alone)."""

    def __init__(
        self,
        kube: KubeApi,
        state: ClusterState,
        *,
        clock: Callable[[], datetime],
        sweep_every: float = 1.0,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        resizer: Resizer | None = None,
    ) -> None:
        self.kube = kube
        self.state = state
        self.resizer = resizer  # shown every pod the watch shows (live resize requests)
        self.clock = clock
        self.sweep_every = sweep_every
        self.sleep = sleep  # the backoff's pauses
        self._settled = False
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        """Start the tasks on the running loop."""
        self._tasks = [
            asyncio.create_task(
                self._run("/api/v1/nodes", "", self._nodes, self._relist_nodes), name="watch-nodes"
            ),
            asyncio.create_task(
                self._run(PODS, BOUND_PODS, self._pods, self._relist_pods), name="watch-pods"
            ),
            asyncio.create_task(self._sweep(), name="heartbeats"),
        ]
        if self.resizer is not None:
            self.resizer.start()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self.resizer is not None:
            await self.resizer.stop()

    def _relist_nodes(self, items: list[JsonObject], _listed: int) -> None:
        self.state.replace_nodes(items, self.clock())

    def _nodes(self, kind: str, obj: JsonObject) -> None:
        if kind == "DELETED":
            self.state.delete_node(str(obj["metadata"]["name"]))
        else:
            self.state.upsert_node(obj, self.clock())

    def _relist_pods(self, items: list[JsonObject], listed: int) -> None:
        self.state.replace_pods(items, listed)
        if self.resizer is not None:
            for pod in items:
                self.resizer.pod_changed(pod)

    def _pods(self, kind: str, obj: JsonObject) -> None:
        uid = str(obj["metadata"]["uid"])
        if kind == "DELETED":
            self.state.delete_pod(uid)
            if self.resizer is not None:
                self.resizer.pod_deleted(uid)
        else:
            self.state.upsert_pod(obj)
            if self.resizer is not None:
                self.resizer.pod_changed(obj)

    async def _run(
        self,
        path: str,
        field_selector: str,
        apply: Callable[[str, JsonObject], None],
        relist: Callable[[list[JsonObject], int], None],
    ) -> None:
        """List, then watch from the list's version; again after the watch fails or expires.
        ``relist`` gets the items and the state's mark taken as the list was requested."""
        failed: Exception | None = None  # what ended the last watch, unless 410 Gone
        while True:
            # Each pass lists until a list succeeds, its backoff starting from the first step. Any
            # exception is retried: a bad object must not end the watch for good.
            async for attempt in AsyncRetrying(
                sleep=self.sleep,
                wait=relist_wait,
                before_sleep=lambda retry: _log_retry(path, retry),
            ):
                with attempt:
                    if failed is not None:
                        # The failed watch is this pass's first failure: the first pause, then a list.
                        error, failed = failed, None
                        raise error
                    listed = self.state.mark()
                    items, version = await self.kube.list(path, field_selector)
                    relist(items, listed)
            self._settle_once()
            try:
                while True:
                    version = await self._watch(path, field_selector, version, apply)
            except _RelistError:
                log.info("%s: watch expired, listing again", path)
            except Exception as e:
                failed = e

    def _settle_once(self) -> None:
        if self._settled or self.state.unsynced():
            return
        self._settled = True
        settle_heap()

    async def _watch(
        self,
        path: str,
        field_selector: str,
        version: str,
        apply: Callable[[str, JsonObject], None],
    ) -> str:
        try:
            async for event in self.kube.watch(path, version, WATCH_SECONDS, field_selector):
                kind = event.get("type", "")
                obj = event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == HTTP_GONE:
                        raise _RelistError
                    raise ApiError(int(obj.get("code") or 500), str(obj.get("message")))
                version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                if kind != "BOOKMARK":
                    apply(kind, obj)
        except ApiError as e:
            if e.status == HTTP_GONE:
                raise _RelistError from None
            raise
        return version

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_every)
            try:
                self.state.expire_reservations(self.clock())
                changed = self.state.sweep_heartbeats(self.clock())
            except Exception:  # the sweep must go on
                log.exception("sweep failed")
                continue
            if changed:
                log.info(
                    "heartbeat or measured-use standing changed on %d node(s): %s",
                    len(changed),
                    ", ".join(changed[:10]),
                )


def _log_retry(path: str, retry: RetryCallState) -> None:
    error = retry.outcome.exception() if retry.outcome is not None else None
    pause = retry.next_action.sleep if retry.next_action is not None else 0.0
    if isinstance(error, ApiError):
        log.warning("%s: %s; listing again in %.1f s", path, error, pause)
    else:  # not the API's answer: the traceback says where
        log.error("%s: watch failed; listing again in %.1f s", path, pause, exc_info=error)
