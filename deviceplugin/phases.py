"""Writes the ``allocated`` phase of served pods to the API, after the kubelet has its answer.

The phase is not on Allocate's path: the kubelet needs the answer, the extender only the phase, and
a pod whose phase is written a little later only stays *in flight* a little longer for the
extender's rule (it holds other pods with another key back a little longer), which is safe; a pod
marked ``allocated`` before its answer would not be. The agent itself never reads the phase to tell
what it served: the served records in the state dir say that (deviceplugin/statedir.py).

Writes go out in the order they were asked for, one at a time, each retried after a jittered
exponential backoff (0.5 s doubling to 8 s, plus up to 1 s) until it lands or the pod is gone.
Nothing needs saving across a restart of the agent: the served records are the durable intent. A
pod whose phase is still ``allocating`` while every GPU container of it has a record is asked for
again (:meth:`deviceplugin.agent.Agent.tidy_state`, at start and every 5 s), so a write lost with a
restart is made by the next agent.
"""

from __future__ import annotations

import logging
import random
import threading
from collections import deque
from collections.abc import Callable

from kubernetes import client

from deviceplugin.kube import API_ERRORS, Kube, KubeUnavailableError
from deviceplugin.matching import PodView
from tessera.contract import Phase

log = logging.getLogger(__name__)

RETRY_FIRST = 0.5
RETRY_MAX = 8.0
RETRY_JITTER = 1.0
HTTP_NOT_FOUND = 404


class PhaseWriter:
    """A queue of phase writes and the loop (:meth:`run`, one thread) that makes them."""

    def __init__(self, kube: Kube, sleep: Callable[[float], object] | None = None) -> None:
        self._kube = kube
        self._changed = threading.Condition()
        self._queue: deque[tuple[PodView, Phase]] = deque()
        self._queued: set[str] = set()  # UIDs in the queue, or being written
        self._sleep = sleep  # the backoff's pauses; default: waiting on the stop event
        self.written = 0

    def submit(self, pod: PodView, phase: Phase = Phase.ALLOCATED) -> bool:
        """Queue a write; False when one for that pod is queued or being made already."""
        with self._changed:
            if pod.uid in self._queued:
                return False
            self._queued.add(pod.uid)
            self._queue.append((pod, phase))
            self._changed.notify_all()
            return True

    def pending(self) -> int:
        """Writes queued or being made."""
        with self._changed:
            return len(self._queued)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every queued write was made (or dropped); False after ``timeout``."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._queued, timeout=timeout)

    def run(self, stop: threading.Event) -> None:
        """Make the queued writes in order until ``stop``."""
        while not stop.is_set():
            with self._changed:
                self._changed.wait_for(lambda: bool(self._queue) or stop.is_set(), timeout=1.0)
                if not self._queue:
                    continue
                pod, phase = self._queue[0]
            self._write(pod, phase, stop)
            with self._changed:
                self._queue.popleft()
                self._queued.discard(pod.uid)
                self._changed.notify_all()

    def wake(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def drain(self) -> None:
        """Make every queued write now, in this thread (no retries): for a caller without :meth:`run`."""
        while True:
            with self._changed:
                if not self._queue:
                    return
                pod, phase = self._queue.popleft()
            try:
                self._kube.set_phase(pod, phase)
            finally:
                with self._changed:
                    self._queued.discard(pod.uid)
                    self._changed.notify_all()

    def _write(self, pod: PodView, phase: Phase, stop: threading.Event) -> None:
        """One write, retried until it lands, the pod is gone, or ``stop`` (then the next agent
        writes it: see the module's doc)."""
        attempt = 0
        last_error = ""
        while not stop.is_set():
            attempt += 1
            try:
                self._kube.set_phase(pod, phase)
            except client.ApiException as e:
                if self._gone(pod, e):
                    log.info("pod %s: not setting phase %s: the pod is gone", pod.ref, phase.value)
                    return
                error = f"{e.status} {e.reason}: {(e.body or '')[:300]}"
            except API_ERRORS as e:
                error = str(e)
            else:
                self.written += 1
                if attempt > 1:
                    log.info("pod %s: phase %s set after %d attempts", pod.ref, phase.value, attempt)
                return
            if error != last_error:
                log.warning("pod %s: cannot set phase %s (retrying): %s", pod.ref, phase.value, error)
                last_error = error
            (self._sleep or stop.wait)(self._pause(attempt))

    def _gone(self, pod: PodView, error: client.ApiException) -> bool:
        """The pod is gone (404), or replaced by a pod of the same name with another UID (the UID in
        the patch cannot change, so the API server refuses it, as it refuses a write an admission
        policy denies: asked again to tell them apart)."""
        if error.status == HTTP_NOT_FOUND:
            return True
        try:
            current = self._kube.read_pod(pod.namespace, pod.name)
        except KubeUnavailableError:
            return False
        return current is None or current.view.uid != pod.uid

    @staticmethod
    def _pause(attempt: int) -> float:
        """The pause after failed attempt number ``attempt``: 0.5, 1, 2, 4, then 8 s, each plus 0-1 s."""
        return min(RETRY_MAX, RETRY_FIRST * 2.0 ** (attempt - 1)) + random.uniform(0, RETRY_JITTER)
