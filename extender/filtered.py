"""Filtered pods: each pod's last filter answer, kept for the prioritize and the bind that follow."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from tessera.contract import JsonObject, PodRequest
from tessera.placement import NodeFit

# Filter results kept for the prioritize call that follows (by pod UID).
REMEMBERED_FILTERS = 256


@dataclass(frozen=True, slots=True)
class Filtered:
    """A pod's last filter answer: the names passed, their fits in the same order."""

    passed: list[str]
    kept: list[NodeFit]
    pod: JsonObject  # as the filter body had it: bind decides from it while it reads the pod
    request: PodRequest  # parsed from ``pod``; bind keeps that decision only if the API's copy asks the same


class FilteredPods:
    def __init__(self) -> None:
        self._filtered: OrderedDict[str, Filtered] = OrderedDict()

    def remember(self, uid: str, filtered: Filtered) -> None:
        self._filtered[uid] = filtered
        self._filtered.move_to_end(uid)
        if len(self._filtered) > REMEMBERED_FILTERS:
            self._filtered.popitem(last=False)

    def get(self, uid: str) -> Filtered | None:
        return self._filtered.get(uid)

    def forget(self, uid: str) -> None:
        self._filtered.pop(uid, None)
