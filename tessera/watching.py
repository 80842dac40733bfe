"""What the extender's and the node agent's list-and-watch loops share, so that both treat the API
server alike: how long one watch request lasts, the code of an expired version, and the pause before
listing again after failures.

The pause is 0.5, 1, 2, then 4 s at most after consecutive failures, each plus a random 0-1 s, so that
the nodes' and pods' watches, several extenders and every node's agent do not retry in step.
"""

from __future__ import annotations

import random

from tenacity import RetryCallState

# How long one watch request lasts before it is renewed from the last version seen (seconds).
WATCH_SECONDS = 240
# A watch or list from a version the API server no longer has: list again at once.
HTTP_GONE = 410

RETRY_FIRST = 0.5
RETRY_MAX = 4.0
RETRY_JITTER = 1.0


def relist_pause(failures: int) -> float:
    """Seconds to wait before listing again after ``failures`` (>= 1) consecutive failures."""
    return min(RETRY_MAX, RETRY_FIRST * 2.0 ** (failures - 1)) + random.uniform(0, RETRY_JITTER)


def relist_wait(retry_state: RetryCallState) -> float:
    """:func:`relist_pause` as tenacity's ``wait``: the attempt that failed is the failure count."""
    return relist_pause(retry_state.attempt_number)
