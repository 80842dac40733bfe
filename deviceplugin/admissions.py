"""The kubelet's word on what it admitted: the ``allocated`` phase, corrected records, and the
clean-up of containers whose pods are gone.

A pod is admitted once the kubelet's pod-resources API names each of its GPU containers as holding
devices (the kubelet records them as Allocate returns), not when its container was matched: among
in-flight pods of one key the match is a guess, and a pod marked ``allocated`` before the kubelet
admitted it would let the extender bind another key beside it (docs/deviceplugin.md "The allocated
phase"). Without that API (its socket absent), the matched pods are taken at their word.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from deviceplugin.config import Config
from deviceplugin.kube import Kube, KubeUnavailableError
from deviceplugin.matching import PodView, pod_complete
from deviceplugin.phases import PhaseWriter
from deviceplugin.podcache import PodCache
from deviceplugin.podresources import Owners, PodResourcesError
from deviceplugin.resize import ContainerResizer
from deviceplugin.served import ServedContainers
from nodeagent.records import ServedRecord
from nodeagent.statedir import ContainerDir
from tessera.contract import Phase
from tessera.inflight import is_allocating

log = logging.getLogger(__name__)

# After an Allocate, the kubelet's pod-resources API is asked which pod it admitted: first after
# this pause, then after pauses doubling up to the last while it does not name the devices yet.
CONFIRM_FIRST_PAUSE = 0.05
CONFIRM_MAX_PAUSE = 1.0


class Admissions:
    def __init__(  # noqa: PLR0917 (the parts it reads)
        self,
        config: Config,
        kube: Kube,
        served: ServedContainers,
        resizes: ContainerResizer,
        phases: PhaseWriter,
        pod_resources: Callable[[], Owners | None],
        cache: PodCache | None = None,
    ) -> None:
        """``phases``: writes the ``allocated`` phase; whoever runs the agent runs its loop
        (``phases.run``), or drains it. ``pod_resources``: which container the kubelet gave each
        device set to (None: no pod-resources API). ``cache``: the pods on the node, read before
        the API (None: the API only)."""
        self._config = config
        self._kube = kube
        self._served = served
        self._resizes = resizes
        self.phases = phases
        self._pod_resources = pod_resources
        self._cache = cache
        self._wanted = threading.Event()

    def wake(self) -> None:
        """Containers were served: ask the kubelet soon."""
        self._wanted.set()

    def confirm(self) -> bool:
        """Write the ``allocated`` phase of the pods the kubelet admitted in full since the last
        call, and correct the records of the containers it served for another pod than the one
        matched; True while a container served has not been named by the kubelet yet (ask again)."""
        served = self._served
        try:
            owners = self._pod_resources()
        except PodResourcesError as e:
            log.warning("cannot ask which pods the kubelet admitted (asking again): %s", e)
            return True
        if owners is None:
            with served.lock:
                unconfirmed = served.unconfirmed()
                for where, _, _ in unconfirmed:
                    served.settle(where)
                guessed = {pod.uid: pod for _, pod, _ in unconfirmed}
                done = [p for p in guessed.values() if self._admitted(p, None)]
            self._submit_allocated(done)
            return False
        # Every pod on the node: one admitted may be running already.
        pods = self._cache.node_pods() if self._cache is not None else None
        if pods is None:
            try:
                pods = [p.view for p in self._kube.node_pods()]
            except KubeUnavailableError as e:
                log.warning("cannot read the pods the kubelet admitted (asking again): %s", e)
                return True
        known = {(p.namespace, p.name) for p in pods}
        deadline = time.monotonic() - self._config.inflight_timeout.total_seconds()
        with served.lock:
            seen: list[tuple[ContainerDir, ServedRecord]] = []
            admitted: set[tuple[str, str]] = set()
            for where, _, served_at in served.unconfirmed():
                record = served.record(where)
                owner = owners.get(frozenset(record.device_ids)) if record is not None else None
                if record is not None and owner is not None and (owner.namespace, owner.pod) in known:
                    seen.append((where, record))
                    admitted.add((owner.namespace, owner.pod))
                elif record is not None and served_at >= deadline:
                    continue  # not named yet (or its pod not seen yet): ask again
                # Named by the kubelet, removed by a clean-up, or not admitted within the timeout.
                served.settle(where)
            served.correct(seen, owners, pods)
            done = [p for p in pods if (p.namespace, p.name) in admitted and self._admitted(p, owners)]
            pending = bool(served.unconfirmed())
        self._submit_allocated(done)
        return pending

    def _admitted(self, pod: PodView, owners: Owners | None) -> bool:
        """Every GPU container of the pod has its record and (unless ``owners`` is None: no
        pod-resources API) holds devices for the kubelet, and its phase still says
        ``allocating``."""
        held = {(o.namespace, o.pod, o.container) for o in owners.values()} if owners is not None else None
        return (
            bool(pod.gpu_containers)
            and pod.request_error is None
            and is_allocating(pod.annotations.get(self._config.keys.allocation_phase))
            and (held is None or all((pod.namespace, pod.name, c.name) in held for c in pod.gpu_containers))
            and pod_complete(pod, self._served.served())
        )

    def _submit_allocated(self, pods: Sequence[PodView]) -> None:
        for pod in pods:
            if self.phases.submit(pod, Phase.ALLOCATED):
                log.info("pod %s: admitted by the kubelet, setting phase allocated", pod.ref)

    def run(self, stop: threading.Event) -> None:
        """After each Allocate, ask the kubelet which pods it admitted (:meth:`confirm`), again
        after growing pauses while it has not named every container served, until ``stop``."""
        pause = CONFIRM_FIRST_PAUSE
        while not stop.is_set():
            if not self._wanted.wait(timeout=1.0):
                continue
            stop.wait(pause)
            self._wanted.clear()
            try:
                pending = self.confirm()
            except Exception as e:  # the loop must outlive any one failure; the next round retries
                log.warning("confirming admissions failed (retrying): %s", e)
                pending = True
            if pending:
                pause = min(CONFIRM_MAX_PAUSE, pause * 2)
                self._wanted.set()
            else:
                pause = CONFIRM_FIRST_PAUSE

    def tidy(self) -> None:
        """Correct served records from the kubelet's pod-resources API, remove the state of
        containers whose pods are gone, ask again for the ``allocated`` phase of pods the kubelet
        admitted in full whose phase is still ``allocating`` (a write lost with a restart of the
        agent), and resize what the pod cache did not."""
        served = self._served
        served_before = served.served()
        views = [p.view for p in self._kube.node_pods()]
        asked = True
        try:
            owners = self._pod_resources()
        except PodResourcesError as e:
            log.warning("cannot ask the kubelet which pods hold which devices: %s", e)
            owners, asked = None, False
        with served.lock:
            if owners is not None:
                served.correct(list(served.records().items()), owners, views)
            # Pods served since the list began are alive though the list may not show them.
            live = {p.uid for p in views} | {uid for uid, _ in served.served() - served_before}
            removed = served.remove_except(live)
            done = [p for p in views if asked and self._admitted(p, owners)]
        self._resizes.forget_except(live)
        if removed:
            log.info("removed the state of %d container(s) whose pods are gone", len(removed))
        self._resizes.resize(views)
        self._submit_allocated(done)
