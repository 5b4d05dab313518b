"""Per-transfer figures the daemon hands back with each completion (bytes, descriptors, times).

The executor feeds in what the NIXL thread reports for each WRITE or READ and what the core says
of the rendezvous; ``_deliver`` takes the sum for (worker, transfer id) and attaches it to the
completion. Which side knows what: the daemon that posts the NIXL transfers (prefill in push mode,
decode in pull mode) knows descriptors, post and transfer seconds; the prefill daemon knows the
rendezvous wait; both know bytes (the receiver: its blocks' bytes) and Publish/Expect -> completion.
"""

from __future__ import annotations

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

    def settle(self, worker_id: str, c: Completion, expected_bytes: int, elapsed_s: float) -> Figures:
        """The figures for this completion (its transfer's entry is dropped).

        ``expected_bytes``: what the worker's blocks hold (the receiving side counts them as moved
        once every WRITE landed; a failed transfer reports only what this daemon moved itself)."""
        s = self._open.pop((worker_id, c.transfer_id), None) or _Sum()
        nbytes = s.nbytes
        if not nbytes and c.kind is CompletionKind.FINISHED_RECEIVING:
            nbytes = expected_bytes
        return Figures(nbytes, s.nixl_transfers, s.descriptors, s.post_s, s.transfer_s, s.rendezvous_wait_s,
                       elapsed_s)

    def __len__(self) -> int:
        return len(self._open)
