"""Pod changes: how many times a pod's counted allocation or phase changed, and the binds waiting
for the next change (the in-flight rule: docs/placement.md, "Bind")."""

from __future__ import annotations

import asyncio


class PodChanges:
    """How many times a pod's counted allocation or phase changed (what was decided before an await
    may be outdated after it), and the binds waiting for the next change (the in-flight rule)."""

    def __init__(self) -> None:
        self.count = 0
        self._waiting: set[asyncio.Event] = set()

    def changed(self) -> None:
        self.count += 1
        for waiting in self._waiting:
            waiting.set()

    async def wait(self, timeout: float) -> None:
        """Until the next change, or ``timeout`` seconds."""
        changed = asyncio.Event()
        self._waiting.add(changed)
        try:
            async with asyncio.timeout(timeout):
                await changed.wait()
        except TimeoutError:
            pass
        finally:
            self._waiting.discard(changed)
