"""A transfer's own books: one ``Ledger`` per Publish (prefill side) or Expect (decode side).

The core's record of the transfer holds it (``sendstate.Publish.ledger``, ``recv._Recv.ledger``) and
stamps it from the ``now`` the core is fed: taken (the Publish or Expect), met (prefill: the second
of publish and registration), posted (the first WRITE or READ handed out), written (the last one's
bytes landed, or its notification came). The runtime adds what only it sees: each NIXL WRITE or
READ result (summed here), the other daemon's address, the Register's call (decode, when tracing)
and done (the completion delivered). The completion's figures, the status, the metrics, Watch, the
vLLM stats and the trace spans read this record; nothing else keeps a per-transfer book of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .types import Figures


class Moved(Protocol):
    """What a NIXL WRITE or READ result tells the ledger (transfer.records.WriteResult / ReadResult)."""

    @property
    def ok(self) -> bool: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def descs_requested(self) -> int: ...
    @property
    def descs_posted(self) -> int: ...
    @property
    def post_s(self) -> float: ...
    @property
    def xfer_s(self) -> float: ...


@dataclass(slots=True, eq=False)
class Ledger:
    side: str  # "send" (a prefill worker's Publish) or "recv" (a decode worker's Expect)
    worker_id: str
    engine_id: str
    transfer_id: str
    num_blocks: int
    taken: float  # monotonic seconds, as the core was fed
    expected_bytes: int = 0  # recv: what the worker's blocks hold
    peer: str = ""  # the other node's daemon, host:port ("" until known)
    met: float = 0.0
    waited_s: float = 0.0  # prefill: the first of publish and registration -> the second
    posted: float = 0.0
    written: float = 0.0
    done: float = 0.0
    # NIXL WRITEs (or READs) this daemon posted for it that completed
    nixl_transfers: int = 0
    nbytes: int = 0
    descs_requested: int = 0
    descs_posted: int = 0
    post_s: float = 0.0  # summed over them
    transfer_s: float = 0.0  # the longest of them
    failed_writes: int = 0
    # W3C trace contexts: the worker command's (the engine request), and decode: the one this
    # transfer's span takes, chosen when its Register goes (which carries it); prefill: the one the
    # first registration met came with (the span's parent)
    traceparent: str = ""
    span_context: str = ""
    register_sent: float = 0.0  # decode, when tracing: the first Register went out
    registered: float = 0.0     # ... and was answered
    register_error: str = ""

    def meet(self, now: float, waited_s: float, span_parent: str = "") -> None:
        """Prefill: a leg starts (the first one stamps met and posted)."""
        if not self.met:
            self.met = self.posted = now
            self.span_context = span_parent
        self.waited_s = max(self.waited_s, waited_s)

    def moved(self, r: Moved, now: float) -> None:
        """One of its NIXL WRITEs or READs completed (``r.ok``) or failed."""
        if not r.ok:
            self.failed_writes += 1
            return
        self.nixl_transfers += 1
        self.nbytes += r.nbytes
        self.descs_requested += r.descs_requested
        self.descs_posted += r.descs_posted
        self.post_s += r.post_s
        self.transfer_s = max(self.transfer_s, r.xfer_s)
        self.written = max(self.written, now)

    @property
    def received_bytes(self) -> int:
        """Bytes to count as this transfer's: what its WRITEs moved, or (a receive) what its blocks hold."""
        return self.nbytes or (self.expected_bytes if self.side == "recv" else 0)

    @property
    def duration_s(self) -> float:
        return max(self.done - self.taken, 0.0) if self.done else 0.0

    def figures(self, finished_receiving: bool) -> Figures:
        """What the completion carries; a finished receive counts its blocks' bytes as moved."""
        nbytes = self.nbytes or (self.expected_bytes if finished_receiving else 0)
        return Figures(nbytes, self.nixl_transfers, self.descs_posted, self.post_s, self.transfer_s, self.waited_s,
                       self.duration_s)
