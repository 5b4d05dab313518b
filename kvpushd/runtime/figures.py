"""Per-transfer figures the daemon hands back with each completion (bytes, descriptors, times).

Fed from the observation stream (runtime/sinks.py: transfers started, the rendezvous met, each
WRITE or READ the NIXL thread reports); the executor's delivery takes the sum for (worker,
transfer id) and attaches it to the completion. Which side knows what: the daemon that posts the
NIXL transfers (prefill in push mode, decode in pull mode) knows descriptors, post and transfer
seconds; the prefill daemon knows the rendezvous wait; both know bytes (the receiver: its blocks'
bytes) and Publish/Expect -> completion.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from ..core.types import Completion, CompletionKind, Figures

Key = tuple[str, str]  # (worker id, transfer id)


@dataclass(slots=True)
class _Sum:
    nbytes: int = 0
    nixl_transfers: int = 0
    descriptors: int = 0
    post_s: float = 0.0
    transfer_s: float = 0.0
    rendezvous_wait_s: float = 0.0
    side: str = ""
    expected_bytes: int = 0  # what the receiving worker's blocks hold
    started: float = 0.0  # monotonic: the Publish or Expect (kept when it is repeated)


class FigureBook:
    """Figures of transfers not delivered yet, bounded (a transfer that never completes is dropped)."""

    def __init__(self, cap: int = 200_000) -> None:
        self._open: dict[Key, _Sum] = {}
        self._cap = cap

    def _get(self, key: Key) -> _Sum:
        s = self._open.get(key)
        if s is None:
            if len(self._open) >= self._cap:
                del self._open[next(iter(self._open))]
            s = self._open[key] = _Sum()
        return s

    def started(self, worker_id: str, transfer_id: str, side: str, expected_bytes: int) -> None:
        s = self._get((worker_id, transfer_id))
        s.side, s.expected_bytes, s.started = side, expected_bytes, s.started or time.monotonic()

    def waited(self, worker_id: str, transfer_id: str, seconds: float) -> None:
        s = self._get((worker_id, transfer_id))
        s.rendezvous_wait_s = max(s.rendezvous_wait_s, seconds)

    def moved(self, worker_id: str, transfer_id: str, nbytes: int, descriptors: int, post_s: float,
              transfer_s: float) -> None:
        s = self._get((worker_id, transfer_id))
        s.nixl_transfers += 1
        s.nbytes += nbytes
        s.descriptors += descriptors
        s.post_s += post_s
        s.transfer_s = max(s.transfer_s, transfer_s)

    def forget_worker(self, worker_id: str) -> None:
        for k in [k for k in self._open if k[0] == worker_id]:
            del self._open[k]

    def settle(self, worker_id: str, c: Completion) -> tuple[Completion, str]:
        """The completion with its figures, and the transfer's side (its entry is dropped).

        The receiving side counts its blocks' bytes as moved once every WRITE landed; a failed
        transfer reports only what this daemon moved itself."""
        s = self._open.pop((worker_id, c.transfer_id), None) or _Sum()
        nbytes = s.nbytes
        if not nbytes and c.kind is CompletionKind.FINISHED_RECEIVING:
            nbytes = s.expected_bytes
        elapsed = time.monotonic() - s.started if s.started else 0.0
        f = Figures(nbytes, s.nixl_transfers, s.descriptors, s.post_s, s.transfer_s, s.rendezvous_wait_s, elapsed)
        return dataclasses.replace(c, figures=f), s.side
