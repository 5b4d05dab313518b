"""Progressive push in the NIXL thread: a leg written layer group by layer group as a doorbell goes.

A staged leg is declared before its prefill step computes the KV. Its descriptor indices are built
once, region-major (descs.plan_leg), so layer group g is the slice of regions
``[g * R/L, (g+1) * R/L)`` of every block. Whenever the producer worker's doorbell says more groups
of the step are complete, the groups not posted yet go out as one WRITE (groups that became ready
together, or while the thread was behind, merge into one), each WRITE with its own notification
naming its layers (core/notif.py): the decode daemon counts the rank complete only once every layer
was notified, so a partial KV is never taken for a complete one, whatever order the WRITEs land in.
Blocks complete when the publish was declared (``ready_blocks``: earlier chunks of a chunked prefill,
prefix-cache hits) are not a slice of that order: their indices are moved to the front once
(descs.ready_first) and go out at once as one WRITE of every layer, a notification unit of its own
before the layer groups (descs.Units), so the decode side counts layers + 1 units for such a leg.
A leg whose descriptors are planned per request (token mapping) is not sliced: it goes as one WRITE
once the step is complete. The leg reports one WriteResult when every WRITE of it has settled (or,
stopped by the core or stalled, when what was posted has): its blocks are never freed under a WRITE.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import structlog

from ..core import notif as notif_codec
from ..core.actions import LegKey, StartWrite
from .agents import Prepped
from .descs import Units, units
from .records import Inflight, Local, WriteResult

log = structlog.get_logger(__name__)
MakeXfer = Callable[[bytes, int, int], Any]  # (notification, first index, end index) -> transfer handle


@dataclass(slots=True)
class Staged:
    write: StartWrite  # the core's plan: the leg, its engine step, layer groups and ready blocks
    loc: Local
    remote: str
    make: MakeXfer
    plan: Units        # which indices each notification unit covers (ready blocks, layer groups)
    result: WriteResult  # the figures, reported once the leg settles
    t0: float
    sent: int = 0      # units posted (the ready blocks, then layer groups)
    inflight: int = 0  # WRITEs of it in flight
    stop: str = ""     # why no more groups are posted
    failed: str = ""   # the first WRITE of it that failed, why
    t_first: float = 0.0
    t_last: float = 0.0  # the last group posted, or the last WRITE settled
    batch: int = 1     # layer groups gathered into one WRITE (the ready blocks and the last group excepted)

    @property
    def key(self) -> LegKey:
        return self.write.leg

    def ready(self) -> int:
        """Units that may be posted by now: the ready blocks at once, a layer group as the doorbell says."""
        bell, step, layers = self.loc.bell, self.write.step, self.write.layers
        return self.plan.ready(bell.ready(step, layers) if bell is not None else layers, layers)

    def finished(self) -> bool:
        return (self.sent == self.plan.units or bool(self.stop)) and self.inflight == 0

    def outcome(self) -> WriteResult:
        ok = not self.stop and not self.failed
        now = time.perf_counter()
        return dataclasses.replace(
            self.result, ok=ok, reason="" if ok else (self.failed or self.stop), nbytes=self.result.nbytes if ok else 0,
            post_s=(self.t_first or now) - self.t0, xfer_s=(now - self.t_first) if self.t_first else 0.0)


class Stages:
    """The staged legs and watched steps of one NIXL thread (called on that thread only)."""

    def __init__(self, on_sealed: Callable[[list[tuple[str, int]]], object] | None, min_write_bytes: int = 0,
                 stall_s: float = 60.0, on_error: Callable[[Local, str], object] | None = None) -> None:
        self.legs: list[Staged] = []
        self.min_write_bytes = min_write_bytes  # a WRITE gathers layer groups until it has this many bytes
        self.stall_s = stall_s  # a leg with no new group within this long stops (the producer stalled)
        self.watched: list[tuple[Local, int]] = []  # (worker, step): report when that step is complete
        self._on_sealed = on_sealed
        self._on_error = on_error  # NIXL failed a post on this agent (the thread reads out its errors)

    def __bool__(self) -> bool:
        return bool(self.legs or self.watched)

    def add(self, write: StartWrite, loc: Local, remote: str, make: MakeXfer, result: WriteResult, t0: float) -> None:
        """A staged leg: the plan's source blocks, its first ``ready_blocks`` complete already."""
        prepped = make if isinstance(make, Prepped) else None  # None: planned per request, not sliceable
        blocks, ready, layers = len(write.src_blocks), write.ready_blocks, write.layers
        plan = units(prepped.indices if prepped else 0, blocks, layers, ready)
        if prepped is not None and plan.lead and plan.head < prepped.indices:
            prepped.ready_first(blocks, ready)
        per_group = result.nbytes // max(layers, 1)
        batch = -(-self.min_write_bytes // per_group) if per_group and self.min_write_bytes > 0 else 1
        self.legs.append(Staged(write, loc, remote, make, plan, result, t0,
                                batch=max(1, min(batch, layers))))

    def stop(self, why: str, leg: LegKey | None = None, worker_id: str | None = None,
             remotes: Collection[str] | None = None) -> None:
        for s in self.legs:
            if ((leg is None or s.key == leg) and (worker_id is None or s.loc.worker_id == worker_id)
                    and (remotes is None or s.remote in remotes) and not s.stop and s.sent < s.plan.units):
                s.stop = why
        if worker_id is not None:
            self.watched = [(loc, st) for loc, st in self.watched if loc.worker_id != worker_id]

    def settled(self, f: Inflight) -> None:
        """One WRITE of a staged leg ended (completed, failed or cancelled)."""
        s = f.stage
        assert isinstance(s, Staged)
        s.inflight -= 1
        s.t_last = time.perf_counter()
        if not f.result.ok and not s.failed:
            s.failed = f.result.reason
            s.stop = s.stop or "an earlier layer group's WRITE failed"

    def _post(self, s: Staged, lo: int, hi: int, msg: bytes, track: Callable[[Inflight], None]) -> bool:
        """Post one WRITE of a staged leg: descriptor indices ``lo`` to ``hi`` (0, 0: all of them)."""
        try:
            handle = s.make(msg, lo, hi)
            state = s.loc.agent.transfer(handle)
        except Exception as e:
            log.warning("posting a layer group WRITE failed", transfer_id=s.key.transfer_id, exc_info=True)
            s.stop = f"NIXL could not post the WRITE: {e}"
            if self._on_error is not None:
                self._on_error(s.loc, f"posting a layer group WRITE: {e}")
            return False
        if state == "ERR":
            handle.release()
            s.stop = "NIXL returned ERR when posting the WRITE"
            return False
        s.inflight += 1
        track(Inflight(handle, s.loc, s.result, time.perf_counter(), s.remote, stage=s))
        return True

    def advance(self, track: Callable[[Inflight], None]) -> tuple[bool, list[WriteResult]]:
        """Post every layer group that became ready; -> (anything happened, legs that settled)."""
        worked = False
        done: list[WriteResult] = []
        keep: list[Staged] = []
        now = time.perf_counter()
        for s in self.legs:
            if not s.stop and s.sent < s.plan.units:
                ready = s.ready()
                if ready > s.sent and (ready - s.sent >= s.batch or ready == s.plan.units or s.sent < s.plan.lead):
                    first, count = s.sent, ready - s.sent
                    msg = notif_codec.encode(s.key.registration_id, s.key.producer_rank, first, count, s.plan.units)
                    if self._post(s, s.plan.end(first), s.plan.end(ready), msg, track):
                        s.sent = ready
                        s.t_first = s.t_first or time.perf_counter()
                        s.t_last = time.perf_counter()
                    worked = True
                elif now - max(s.t_last, s.t0) > self.stall_s:
                    group = max(ready - s.plan.lead, 0) + 1  # the first not complete (ready ones may be gathering)
                    s.stop = (f"the producer's engine step {s.write.step} did not complete layer group {group} of "
                              f"{s.write.layers} within transfer.write_timeout_s = {self.stall_s:g}s")
            if s.finished():
                done.append(s.outcome())
                worked = True
            else:
                keep.append(s)
        self.legs = keep
        if self.watched:
            sealed = [(loc, st) for loc, st in self.watched if loc.bell is None or loc.bell.complete(st)]
            if sealed:
                self.watched = [w for w in self.watched if w not in sealed]
                if self._on_sealed is not None:
                    self._on_sealed([(loc.worker_id, st) for loc, st in sealed])
                worked = True
        return worked, done
