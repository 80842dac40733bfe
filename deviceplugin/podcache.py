"""The pods bound to this node, kept by a list and a watch of the API server (``spec.nodeName=<node>``).

Allocate and GetPreferredAllocation read it instead of listing the node's pods on every call. It may
lag behind the API server (a bind that just happened, a pod just deleted): the agent checks every
answer it takes from here against the API (docs/deviceplugin.md "Allocate from the pod cache").

One thread runs :meth:`PodCache.run`: list, then watch from the list's resourceVersion, renewing the
watch from the last version seen (bookmarks included); list again at once on 410 Gone (the version
is older than the API server keeps), and after any other failure after a jittered exponential
backoff: failed lists are retried by tenacity (as the extender's watch), starting again from its
first step after each successful list; consecutive failed watches lengthen the pause before the
next list the same way. The contents stay readable (and marked synced) while it reconnects.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kubernetes import client
from tenacity import RetryCallState, Retrying, retry_if_exception

from deviceplugin.kube import Kube, KubeUnavailableError, NodePod, node_pod, watch_events
from deviceplugin.matching import PodView
from tessera.watching import HTTP_GONE, WATCH_SECONDS, relist_pause, relist_wait

log = logging.getLogger(__name__)

# A watch that ends sooner than this without an event is counted as failed.
QUICK_END_SECONDS = 1.0


class GoneError(Exception):
    """The watch cannot continue from its resourceVersion (410 Gone): list again."""


class WatchError(Exception):
    """The watch ended with an error other than 410 Gone; the message says which."""


class PodCache:
    """The pods on this node by UID, as the last list and the watch events since left them."""

    def __init__(
        self,
        kube: Kube,
        sleep: Callable[[float], None] | None = None,
        on_pods: Callable[[Sequence[PodView]], object] | None = None,
    ) -> None:
        """``on_pods``: called with the pods of each list and each watch event, outside the lock
        (the container resizer)."""
        self._kube = kube
        self._lock = threading.Lock()
        self._pods: dict[str, NodePod] = {}
        self._synced = threading.Event()
        self._stop = threading.Event()
        self._response: Any = None
        self._sleep = sleep or self._pause
        self.resource_version = ""
        self._on_pods = on_pods
        self.lists = 0  # successful lists: the first, and one after each 410 Gone or failure
        self.events = 0  # watch events applied (bookmarks included)

    # ---------------------------------------------------------------------------------------------
    # What the agent reads

    @property
    def synced(self) -> bool:
        return self._synced.is_set()

    def wait_synced(self, timeout: float) -> bool:
        return self._synced.wait(timeout)

    def pending_pods(self) -> list[PodView] | None:
        """The pods the kubelet may still admit, as last seen; None before the first list."""
        if not self._synced.is_set():
            return None
        with self._lock:
            return [p.view for p in self._pods.values() if p.pending]

    def node_pods(self) -> list[PodView] | None:
        """Every pod on the node, as last seen (running ones too); None before the first list."""
        if not self._synced.is_set():
            return None
        with self._lock:
            return [p.view for p in self._pods.values()]

    def pod(self, uid: str) -> NodePod | None:
        with self._lock:
            return self._pods.get(uid)

    def uids(self) -> set[str]:
        with self._lock:
            return set(self._pods)

    # ---------------------------------------------------------------------------------------------
    # Keeping it

    def _pause(self, seconds: float) -> None:
        self._stop.wait(seconds)

    def relist(self) -> str:
        """Replace the contents by a fresh list; returns its resourceVersion."""
        items, version = self._kube.list_pods()
        pods = {}
        for item in items:
            pod = node_pod(item, self._kube.keys)
            pods[pod.view.uid] = pod
        with self._lock:
            self._pods = pods
            self.resource_version = version
            self.lists += 1
        self._synced.set()
        self._tell([p.view for p in pods.values()])
        return version

    def apply(self, event: dict[str, Any]) -> None:
        """One watch event (ADDED, MODIFIED, DELETED or BOOKMARK); raises :class:`GoneError` on 410 and
        :class:`WatchError` on any other ERROR event."""
        kind = event.get("type", "")
        obj = event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == HTTP_GONE:
                raise GoneError(str(obj.get("message") or "410 Gone"))
            raise WatchError(f"watch of the pods on node {self._kube.node}: {obj.get('message') or obj}")
        metadata = obj.get("metadata") or {}
        version = str(metadata.get("resourceVersion") or "")
        uid = str(metadata.get("uid") or "")
        changed = None
        with self._lock:
            self.events += 1
            if kind in {"ADDED", "MODIFIED"} and uid:
                changed = self._pods[uid] = node_pod(obj, self._kube.keys)
            elif kind == "DELETED" and uid:
                self._pods.pop(uid, None)
            if version:
                self.resource_version = version
        if changed is not None:
            self._tell([changed.view])

    def _tell(self, pods: Sequence[PodView]) -> None:
        if self._on_pods is None:
            return
        try:
            self._on_pods(pods)
        except Exception as e:  # the watch goes on; the agent's tidy-up tries again
            log.warning("following the pods on node %s failed: %s", self._kube.node, e)

    def watch(self, resource_version: str) -> str:
        """Watch from ``resource_version`` until the server ends the watch (or :meth:`interrupt`);
        returns the version to watch from next. Raises :class:`GoneError` on 410 Gone."""
        try:
            response = self._kube.watch_pods(resource_version, WATCH_SECONDS)
        except client.ApiException as e:
            if e.status == HTTP_GONE:
                raise GoneError(str(e.reason)) from None
            raise
        with self._lock:
            self._response = response
        try:
            if self._stop.is_set():
                return resource_version
            for event in watch_events(response):
                self.apply(event)
        finally:
            with self._lock:
                self._response = None
            response.close()  # one connection per watch request, renewed every few minutes
        return self.resource_version or resource_version

    def run(self, stop: threading.Event, resume_from: str | None = None) -> None:
        """List and watch until ``stop``. ``resume_from`` starts with a watch from that version
        instead of a list (the cache then holds what was put in it before).

        After a failed watch the pause before the next list grows with consecutive failures (0.5,
        1, 2, then 4 s, each plus 0-1 s), and starts again once a watch delivered an event; a watch
        the API server ends at once without an event counts as failed (no busy loop)."""
        self._stop = stop
        version = resume_from
        failures = 0
        last_error = ""
        while not stop.is_set():
            if version is None:
                try:
                    version = self._list_until_it_works(stop)
                except Exception:
                    if stop.is_set():
                        return
                    raise
                if version is None:
                    return
            events = self.events
            try:
                while not stop.is_set():
                    began = time.monotonic()
                    version = self.watch(version)
                    if self.events == events and time.monotonic() - began < QUICK_END_SECONDS:
                        raise WatchError("the API server ended the watch at once, without an event")
                    failures, last_error, events = 0, "", self.events
            except GoneError as e:
                log.info("pods on node %s: watch expired (%s), listing again", self._kube.node, e)
                version = None
            except Exception as e:
                if stop.is_set():
                    return
                failures = 1 if self.events != events else failures + 1
                pause = relist_pause(failures)
                if str(e) != last_error:
                    log.warning(
                        "pods on node %s: watch failed: %s; listing again in %.1f s",
                        self._kube.node,
                        e,
                        pause,
                    )
                    last_error = str(e)
                self._sleep(pause)
                version = None

    def _list_until_it_works(self, stop: threading.Event) -> str | None:
        for attempt in Retrying(
            sleep=self._sleep,
            wait=relist_wait,
            retry=retry_if_exception(lambda e: not stop.is_set()),
            before_sleep=self._log_retry,
            reraise=True,
        ):
            with attempt:
                if stop.is_set():
                    return None
                return self.relist()
        return None  # pragma: no cover (Retrying either returns or raises)

    def _log_retry(self, retry: RetryCallState) -> None:
        error = retry.outcome.exception() if retry.outcome is not None else None
        pause = retry.next_action.sleep if retry.next_action is not None else 0.0
        if isinstance(error, KubeUnavailableError):
            log.warning("%s; listing again in %.1f s", error, pause)
        else:
            log.error("pods on node %s: list failed; again in %.1f s", self._kube.node, pause, exc_info=error)

    def interrupt(self) -> None:
        """End a watch waiting for its next event (from another thread), so :meth:`run` sees ``stop``."""
        with self._lock:
            response = self._response
        if response is not None:
            response.shutdown()
