"""Deadlines: a heap with lazy deletion, so tick() costs O(expired log n), not O(pending).

Keys are typed (each side names its own frozen key classes); a key has at most one live deadline:
arming it again replaces the old one, and disarming it makes its heap entry stale.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class Deadlines(Generic[K]):
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, K]] = []
        self._seq = itertools.count()
        self._live: dict[K, float] = {}

    def arm(self, key: K, when: float) -> None:
        self._live[key] = when
        heapq.heappush(self._heap, (when, next(self._seq), key))

    def disarm(self, key: K) -> None:
        self._live.pop(key, None)

    def pop_due(self, now: float) -> Iterator[K]:
        """Keys whose live deadline is at or before ``now``, earliest first (each disarmed as it comes)."""
        while self._heap and self._heap[0][0] <= now:
            when, _, key = heapq.heappop(self._heap)
            if self._live.get(key) == when:
                del self._live[key]
                yield key

    def next(self) -> float | None:
        """Earliest live deadline; drops stale heap entries on the way."""
        while self._heap:
            when, _, key = self._heap[0]
            if self._live.get(key) == when:
                return when
            heapq.heappop(self._heap)
        return None
