"""Writes the ``allocated`` phase of served pods to the API, after the kubelet has its answer.

The phase is not on Allocate's path: the kubelet needs the answer, the extender only the phase, and
a pod whose phase is written a little later only stays *in flight* a little longer for the
extender's rule (it holds other pods with another key back a little longer), which is safe; a pod
marked ``allocated`` before its answer would not be. The agent itself never reads the phase to tell
what it served: the served records in the state dir say that (nodeagent/statedir.py).

Each pod's write is independent of the others': a write that fails is tried again after a jittered
exponential backoff (0.5 s doubling to 8 s, plus up to 1 s) while the writes of other pods go ahead,
so no pod holds up another. One the API server refuses for good (400, 403 from an admission policy,
413, 422: a pod whose annotations, with the Binding's, leave no room for the phase under the API's
256 KiB) is not tried again: the pod gets a Warning event saying why, and stays ``allocating`` for
the extender until its in-flight timeout, which is safe (it is only held longer).
Nothing needs saving across a restart of the agent: the served records are the durable intent. A
pod whose phase is still ``allocating`` while every GPU container of it has a record is asked for
again (:meth:`deviceplugin.admissions.Admissions.tidy`, at start and every 5 s), so a write lost with a
restart is made by the next agent; a refused one is not asked again by the same agent.
"""

from __future__ import annotations

import heapq
import logging
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from kubernetes import client

from deviceplugin.kube import API_ERRORS, Kube, KubeUnavailableError
from deviceplugin.matching import PodView
from tessera.contract import Phase

log = logging.getLogger(__name__)

RETRY_FIRST = 0.5
RETRY_MAX = 8.0
RETRY_JITTER = 1.0
HTTP_NOT_FOUND = 404
# Refusals that the same write meets again however often it is tried.
REFUSED_FOR_GOOD = frozenset({400, 403, 413, 422})
REFUSED_REASON = "TesseraPhaseRefused"
REFUSED_KEPT = 4096  # pods whose write was refused, remembered so that the clean-up does not ask again


@dataclass(order=True)
class _Write:
    due: float
    seq: int
    pod: PodView = field(compare=False)
    phase: Phase = field(compare=False)
    attempt: int = field(default=0, compare=False)
    last_error: str = field(default="", compare=False)


class PhaseWriter:
    """The phase writes of served pods and the loop (:meth:`run`, one thread) that makes them, the
    one due first first."""

    def __init__(self, kube: Kube, clock: Callable[[], float] = time.monotonic) -> None:
        self._kube = kube
        self._changed = threading.Condition()
        self._due: list[_Write] = []  # a heap, by due time
        self._queued: set[str] = set()  # UIDs with a write due, or being written
        self._refused: OrderedDict[str, None] = OrderedDict()
        self._seq = 0
        self._clock = clock
        self.written = 0
        self.refused = 0

    def submit(self, pod: PodView, phase: Phase = Phase.ALLOCATED) -> bool:
        """Queue a write; False when one for that pod is queued or being made already, or the API
        server refused that pod's write for good."""
        with self._changed:
            if pod.uid in self._queued or pod.uid in self._refused:
                return False
            self._queued.add(pod.uid)
            self._seq += 1
            heapq.heappush(self._due, _Write(self._clock(), self._seq, pod, phase))
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
        """Make the writes as they fall due until ``stop``; a failed one is due again later."""
        while not stop.is_set():
            with self._changed:
                wait = self._due[0].due - self._clock() if self._due else 1.0
                if wait > 0:
                    self._changed.wait(timeout=min(wait, 1.0))
                    continue
                write = heapq.heappop(self._due)
            self._settle(write, self._attempt(write))

    def wake(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def drain(self) -> None:
        """Make every queued write now, in this thread, once each (no retries): for a caller without
        :meth:`run`."""
        while True:
            with self._changed:
                if not self._due:
                    return
                write = heapq.heappop(self._due)
            try:
                self._kube.set_phase(write.pod, write.phase)
            finally:
                with self._changed:
                    self._queued.discard(write.pod.uid)
                    self._changed.notify_all()

    def _settle(self, write: _Write, done: bool) -> None:
        with self._changed:
            if done:
                self._queued.discard(write.pod.uid)
            else:
                write.due = self._clock() + self._pause(write.attempt)
                heapq.heappush(self._due, write)
            self._changed.notify_all()

    def _attempt(self, write: _Write) -> bool:
        """One try of ``write``: True when it is done with (written, the pod gone, or refused for
        good), False to try again later."""
        pod, phase = write.pod, write.phase
        write.attempt += 1
        try:
            self._kube.set_phase(pod, phase)
        except client.ApiException as e:
            if self._gone(pod, e):
                log.info("pod %s: not setting phase %s: the pod is gone", pod.ref, phase.value)
                return True
            error = f"{e.status} {e.reason}: {(e.body or '')[:300]}"
            if e.status in REFUSED_FOR_GOOD:
                self._refuse(pod, phase, error)
                return True
        except API_ERRORS as e:
            error = str(e)
        else:
            self.written += 1
            if write.attempt > 1:
                log.info("pod %s: phase %s set after %d attempts", pod.ref, phase.value, write.attempt)
            return True
        if error != write.last_error:
            log.warning("pod %s: cannot set phase %s (retrying): %s", pod.ref, phase.value, error)
            write.last_error = error
        return False

    def _refuse(self, pod: PodView, phase: Phase, error: str) -> None:
        log.warning(
            "pod %s: the API server refuses phase %s; not trying again: %s", pod.ref, phase.value, error
        )
        self.refused += 1
        with self._changed:
            self._refused[pod.uid] = None
            while len(self._refused) > REFUSED_KEPT:
                self._refused.popitem(last=False)
        message = (
            f"Tessera cannot record allocation phase {phase.value} on this pod ({error[:200]}); the pod "
            "runs with its GPU shares, and the scheduler counts it as in flight until its timeout"
        )
        try:
            self._kube.warn(pod, REFUSED_REASON, message)
        except API_ERRORS as e:
            log.warning("pod %s: cannot record the refusal event: %s", pod.ref, e)

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
