"""The container resizer: a live resize the extender decided reaches the served containers.

The extender writes a pod's new allocation on the pod; the pod cache tells every pod it sees (the
callback given to :class:`deviceplugin.podcache.PodCache`), and the clean-up every pod it lists
again (one missed while the agent was down, or a write that failed). A served container whose
allocation gives it other quotas on the same GPUs gets its limits file and record rewritten.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from deviceplugin.matching import PodView
from deviceplugin.served import ServedContainers
from tessera.contract import Allocation, ContractError, ContractKeys, parse_allocation

log = logging.getLogger(__name__)


class ContainerResizer:
    def __init__(
        self,
        keys: ContractKeys,
        served: ServedContainers,
        on_resized: Callable[[int], object] | None = None,
    ) -> None:
        """``on_resized``: told how many containers' limits files each resize rewrote (the
        exporter's counter)."""
        self._keys = keys
        self._served = served
        self._on_resized = on_resized
        # Guards the allocation annotations already resized to, by pod UID.
        self._lock = threading.Lock()
        self._resized: dict[str, str] = {}

    def resize(self, pods: Sequence[PodView]) -> int:
        """Rewrite the limits file (atomically: the hook in each of the container's processes
        follows it) and the record of every served container of ``pods`` whose allocation now gives
        it other quotas on the same GPUs: a live resize the extender decided. Returns how many."""
        with self._lock:
            changed: dict[str, Allocation] = {}
            texts: dict[str, str] = {}
            for pod in pods:
                text = pod.annotations.get(self._keys.allocation)
                if text is None or self._resized.get(pod.uid) == text:
                    continue
                texts[pod.uid] = text
                try:
                    changed[pod.uid] = parse_allocation(text, pod=pod.ref)
                except ContractError as e:
                    log.warning("%s", e)
            if not texts:
                return 0
            resized = self._served.resize(changed)
            self._resized.update(texts)  # once written: a failed write is tried again by the clean-up
        if resized and self._on_resized is not None:
            self._on_resized(resized)
        return resized

    def forget_except(self, live: set[str]) -> None:
        """Forget what was resized for pods (by UID) no longer on the node."""
        with self._lock:
            for uid in set(self._resized) - live:
                del self._resized[uid]
