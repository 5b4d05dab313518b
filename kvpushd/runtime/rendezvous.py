"""The owner of the rendezvous: the core's two sides, one object.

The node (node.py), the one driver, puts every event in here (a worker's or a peer's command, WRITEs
done, notifications, peer answers, the timer) and carries out the actions that come out. Nothing
here does I/O or reads a clock but the one the caller hands in.
"""

from __future__ import annotations

from ..config import Config
from ..core.errors import ResourceExhausted
from ..core.rendezvous import Action, RecvSide, SendSide


class Rendezvous:
    def __init__(self, cfg: Config) -> None:
        t = cfg.transfer
        self.max_pending = t.max_pending
        self.send = SendSide(t.publish_timeout_s, t.expect_timeout_s)
        # Registration ids are random (63 bits): they do not collide with stale notifications addressed
        # to a previous instance, and only the prefill daemon a registration went to knows its id.
        self.recv = RecvSide(t.expect_timeout_s, random_ids=True)

    def __len__(self) -> int:
        return len(self.send) + len(self.recv)

    def bounded(self) -> None:
        """Refuse a new transfer past ``transfer.max_pending``."""
        if len(self) >= self.max_pending:
            raise ResourceExhausted(f"more than {self.max_pending} transfers pending")

    def next_deadline(self) -> float | None:
        due = [d for d in (self.send.next_deadline(), self.recv.next_deadline()) if d is not None]
        return min(due, default=None)

    def held_blocks(self) -> dict[str, int]:
        """Blocks of local workers that pending transfers cover, by side."""
        return {"send": self.send.held_blocks(), "recv": self.recv.held_blocks()}

    def tick(self, now: float) -> list[Action]:
        return self.send.tick(now) + self.recv.tick(now)

    def abort(self, worker_id: str, engine_id: str, transfer_id: str) -> tuple[bool, list[Action]]:
        found_r, acts_r = self.recv.abort(worker_id, transfer_id)
        found_s, acts_s = self.send.abort(worker_id, engine_id, transfer_id)
        return found_r or found_s, acts_r + acts_s

    def worker_gone(self, worker_id: str) -> list[Action]:
        return self.send.worker_gone(worker_id) + self.recv.worker_gone(worker_id)

    def shutdown(self, why: str) -> list[Action]:
        return self.send.shutdown(why) + self.recv.shutdown(why)
