"""A worker's completions as they arrive from its session (``Worker`` and ``StreamWorker`` share it)."""

from __future__ import annotations

import collections
import threading

from .types import Completion, KVPushError


class Inbox:
    """Completions delivered by a reader thread, taken by the engine without an RPC."""

    def __init__(self) -> None:
        self._queue: collections.deque[Completion] = collections.deque()
        self._cond = threading.Condition()
        self.session_error: KVPushError | None = None

    def completions(self) -> list[Completion]:
        """Everything delivered so far, without waiting (no RPC). Nothing delivered: no lock taken (the
        reader thread holds it while it takes a batch; the engine thread need not wait for that)."""
        if not self._queue:
            return []
        with self._cond:
            out = list(self._queue)
            self._queue.clear()
        return out

    def next_completion(self, timeout_s: float | None = None) -> Completion | None:
        """Wait for one completion (for tools and tests; engines use completions())."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._queue or self.session_error is not None, timeout_s):
                return None
            if self._queue:
                return self._queue.popleft()
            assert self.session_error is not None
            raise self.session_error
