"""Deadlines: a heap with lazy deletion, so tick() costs O(expired log n), not O(pending)."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator


class Deadlines:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, object]] = []
        self._seq = itertools.count()

    def add(self, when: float, key: object) -> None:
        heapq.heappush(self._heap, (when, next(self._seq), key))

    def pop_due(self, now: float) -> Iterator[tuple[float, object]]:
        while self._heap and self._heap[0][0] <= now:
            when, _, key = heapq.heappop(self._heap)
            yield when, key

    def next(self, valid: dict[object, float]) -> float | None:
        """Earliest deadline still valid (``valid[key] == when``); drops stale heap entries."""
        while self._heap:
            when, _, key = self._heap[0]
            if valid.get(key) == when:
                return when
            heapq.heappop(self._heap)
        return None
