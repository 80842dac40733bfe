"""Polling for a condition in tests, with a failure that says what was awaited."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(
    predicate: Callable[[], T], timeout: float = 60.0, what: str = "condition", interval: float = 0.2
) -> T:
    """The first truthy value of ``predicate()``; AssertionError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)
