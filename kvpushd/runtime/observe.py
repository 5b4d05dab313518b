"""What the runtime reports as it goes, for whoever records it (the Prometheus metrics, in app.py).

A protocol, so the runtime imports nothing above it: the composition root hands it an observer.
"""

from __future__ import annotations

from typing import Protocol

from ..transfer.records import WriteResult


class Observer(Protocol):
    def rendezvous_waited(self, seconds: float) -> None:
        """Prefill side: first arrival of publish or registration -> the second (the WRITE starts)."""

    def write_done(self, r: WriteResult, peer: str) -> None:
        """A WRITE completed or failed (``peer``: the decode daemon's address, "" if unknown)."""

    def dropped(self, event: str) -> None:
        """The core dropped a late or repeated event on purpose."""


class NullObserver:
    def rendezvous_waited(self, seconds: float) -> None:
        pass

    def write_done(self, r: WriteResult, peer: str) -> None:
        pass

    def dropped(self, event: str) -> None:
        pass
