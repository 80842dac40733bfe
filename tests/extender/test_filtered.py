"""Filtered pods: the last filter answer per pod, the oldest forgotten past REMEMBERED_FILTERS."""

from __future__ import annotations

from extender.filtered import REMEMBERED_FILTERS, Filtered, FilteredPods
from tessera.contract import KEYS, parse_pod_request
from tests.extender.helpers import gpu_pod


def answer(name: str) -> Filtered:
    pod = gpu_pod(name)
    return Filtered([], [], pod, parse_pod_request(pod, KEYS))


def test_the_last_answer_is_kept_and_the_oldest_forgotten() -> None:
    filtered = FilteredPods()
    for i in range(REMEMBERED_FILTERS):
        filtered.remember(f"u{i}", answer(f"p{i}"))
    latest = answer("again")
    filtered.remember("u0", latest)  # the oldest, filtered again: now the newest
    filtered.remember("new", answer("new"))
    assert filtered.get("u0") is latest
    assert filtered.get("u1") is None  # the oldest now
    filtered.forget("u0")
    assert filtered.get("u0") is None
