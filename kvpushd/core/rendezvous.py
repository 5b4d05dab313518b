"""The push rendezvous, as two pure state machines.

SendSide lives on the prefill node: it matches each producer rank's "prefill done" (publish) with
the decode side's registrations (forwarded by the decode node's daemon), in either order; the
second arrival starts the WRITE of one *leg* (producer rank -> one registration).
RecvSide lives on the decode node: one record per Expect, counting one notification per producer
rank that writes to it.

Pull mode (per registration, ``Registration.mode``): when a pull registration meets its publish,
SendSide does not write; it offers the source blocks to the decode daemon (``SendOffer``), whose
RecvSide validates the offer against its registration and READs them (``StartRead``). The leg stays
in flight on the prefill side until the READ's notification arrives (``read_done``), the decode
daemon reports the READ failed (``SendReadFailed`` -> ``read_done(ok=False)``), is lost, or
``publish_timeout_s`` passes after the offer.

Nothing here performs I/O: every event returns a list of actions for the runtime to carry out
(``StartWrite``, ``Deliver``, ``SendRegister``, ``SendFailNotice``, ``SendWithdraw``), and time is
an argument. Each side reports its next deadline so the runtime knows when to call ``tick``.

Invariants (checked by the Hypothesis state machine in tests/test_core_stateful.py):
- every Publish and every Expect ends with exactly one terminal Completion to its worker, unless the
  worker itself is gone or replaced the Expect;
- a leg is written at most once;
- a publish is not reported finished or failed while one of its WRITEs may still be in flight, so
  the prefill worker never frees blocks that NIXL is still reading.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import secrets
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

from . import notif
from .errors import AlreadyExists, IllegalTransition, InvalidArgument, NotFound, PermissionDenied
from .layout import Shape, needs_plan, sizes_differ
from .topology import block_parts, check_tp_pair, consumer_targets, skips_replicated, writer_sources, writer_targets
from .types import Completion, CompletionKind, FailureCode, TransferMode

Part = tuple[int, int]  # (slices per block, which slice): (1, 0) is the whole block

# --------------------------------------------------------------------------------------------
# Actions


@dataclass(frozen=True, slots=True)
class Registration:
    """A decode worker's destination blocks for one transfer, as the prefill side sees it."""

    registration_id: int
    origin: str  # the decode daemon's peer key (where failure notices go)
    transfer_id: str
    producer_engine_id: str
    producer_tp_size: int
    consumer_agent: str
    consumer_rank: int
    consumer_tp_size: int
    block_ids: tuple[int, ...]
    mode: TransferMode = TransferMode.PUSH  # PULL: offer the source blocks instead of writing
    skip_tokens: int = 0    # the consumer holds the prompt's first tokens: block_ids start there
    by_tokens: bool = False  # blocks do not map one to one (block sizes differ, or skip_tokens): send all
    mla: bool = False       # every consumer region is replicated: one producer rank per consumer writes
    layouts: tuple[Shape, ...] = ()  # the consumer's regions (block size, layout, replication), if known

    def __post_init__(self) -> None:
        # What the regions say decides; the flags may also be set directly (tests, older peers).
        if self.layouts and all(r.replicated for r in self.layouts) and not self.mla:
            object.__setattr__(self, "mla", True)


@dataclass(frozen=True, slots=True)
class StartWrite:
    """Post a NIXL WRITE of ``src_blocks`` into the registration's blocks: the whole plan.

    The runtime carries it out as it stands: which slice of each block on either side (TP sizes),
    the notification, whether replicated regions are left to another rank, and whether the
    prepared one-descriptor-per-block lists serve (``planned`` False) or descriptors are planned
    per token run (block sizes differ, a prefix is skipped, layouts differ).
    """

    leg: LegKey
    producer_worker: str
    producer_rank: int
    producer_tp_size: int
    src_blocks: tuple[int, ...]
    registration: Registration
    notif: bytes = b""
    src_part: Part = (1, 0)
    dst_part: Part = (1, 0)
    skip_replicated: bool = False
    planned: bool = False
    waited_s: float = 0.0  # first arrival of publish or registration -> this, the second


@dataclass(frozen=True, slots=True)
class Deliver:
    """Hand a completion to a local worker."""

    worker_id: str
    completion: Completion


@dataclass(frozen=True, slots=True)
class SendFailNotice:
    """Prefill side -> decode daemon: this registration will not be written."""

    origin: str
    transfer_id: str
    registration_id: int
    code: FailureCode
    reason: str


@dataclass(frozen=True, slots=True)
class SendRegister:
    """Decode side -> prefill daemon: forward a registration."""

    producer_address: str
    registration_id: int
    worker_id: str
    transfer_id: str
    producer_engine_id: str
    producer_tp_size: int
    consumer_rank: int
    consumer_tp_size: int
    block_ids: tuple[int, ...]
    mode: TransferMode = TransferMode.PUSH
    skip_tokens: int = 0


@dataclass(frozen=True, slots=True)
class SendWithdraw:
    """Decode side -> prefill daemon: the registration is withdrawn (abort, timeout, worker gone)."""

    producer_address: str
    transfer_id: str
    registration_id: int
    code: FailureCode
    reason: str
    # The runtime reports the answer (or that none came) with RecvSide.withdraw_answered: the
    # prefill daemon answers only once no WRITE into the registration is in flight, so a FAILED
    # the core deferred until then lets the decode worker free its blocks after the last byte.


@dataclass(frozen=True, slots=True)
class SendOffer:
    """Pull mode, prefill side -> decode daemon: READ ``src_blocks`` into the registration's blocks.

    The leg counts as in flight (the prefill worker's blocks stay held) until the READ's
    notification arrives, the decode daemon reports the READ failed (``read_done``), its offer is
    refused, the decode daemon is lost, or ``publish_timeout_s`` passes.
    """

    leg: LegKey
    producer_worker: str
    producer_rank: int
    producer_tp_size: int
    src_blocks: tuple[int, ...]
    registration: Registration


@dataclass(frozen=True, slots=True, order=True)
class ReadKey:
    """Pull mode, decode side: one READ of a producer rank's blocks into one registration."""

    producer_address: str
    transfer_id: str
    registration_id: int
    producer_rank: int


@dataclass(frozen=True, slots=True)
class StartRead:
    """Pull mode, decode side: post a NIXL READ of an accepted offer (src: prefill, dst: ours)."""

    key: ReadKey
    worker_id: str
    producer_tp_size: int
    consumer_rank: int
    consumer_tp_size: int
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]
    producer_agent: str = ""  # the offer's prefill agent (loaded by the runtime before the offer event)
    notif: bytes = b""
    src_part: Part = (1, 0)
    dst_part: Part = (1, 0)


@dataclass(frozen=True, slots=True)
class SendReadFailed:
    """Pull mode, decode side -> prefill daemon: the READ of an accepted offer failed."""

    key: ReadKey
    reason: str


@dataclass(frozen=True, slots=True)
class Dropped:
    """A late or repeated event ignored on purpose (a WRITE settling after its transfer ended, a
    notice for a registration already gone): the runtime counts and logs it."""

    event: str
    transfer_id: str
    why: str


Action = (StartWrite | Deliver | SendFailNotice | SendRegister | SendWithdraw | SendOffer | StartRead
          | SendReadFailed | Dropped)


@dataclass(frozen=True, slots=True, order=True)
class LegKey:
    """One WRITE: a producer rank's blocks into one registration."""

    engine_id: str
    transfer_id: str
    producer_rank: int
    registration_id: int


# --------------------------------------------------------------------------------------------
# Deadlines: a heap with lazy deletion, so tick() costs O(expired log n), not O(pending).


class _Deadlines:
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


# --------------------------------------------------------------------------------------------
# Prefill side


class LegState(enum.Enum):
    POSTED = "posted"
    DONE = "done"


class Move(enum.Enum):
    """What an event does to a record, in the tables below."""

    APPLY = "apply"  # handled: the event's rule runs
    DROP = "drop"    # late or repeated, ignored on purpose (a Dropped action: counted and logged)


# The prefill side's leg (one producer rank's WRITE or offered READ into one registration), in
# the spirit of h11's _state.py: each (state, event) the table names is legal; None is a leg that
# is gone (its transfer ended: worker gone, shutdown, timeout). Anything else is IllegalTransition.
LEG_TABLE: dict[tuple[LegState | None, str], Move] = {
    (LegState.POSTED, "write_done"): Move.APPLY,  # -> DONE, or removed and the publish fails
    (LegState.DONE, "write_done"): Move.DROP,     # a second completion of the same leg
    (None, "write_done"): Move.DROP,              # the leg's transfer ended while it was in flight
}


def step(table: dict[tuple[Any, str], Move], state: Any, event: str, transfer_id: str = "") -> Move:
    """Look an event up in a side's table: a typed error naming state and event when illegal."""
    move = table.get((state, event))
    if move is None:
        name = state.value if isinstance(state, enum.Enum) else str(state)
        raise IllegalTransition(name, event, f"transfer {transfer_id[:256]!r}: event {event!r} is not allowed in "
                                             f"state {name!r}", transfer_id=transfer_id)
    return move


@dataclass(slots=True)
class _Publish:
    worker_id: str
    rank: int
    tp_size: int
    block_ids: tuple[int, ...]
    created: float
    deadline: float
    layouts: tuple[Shape, ...] = ()  # the producer's regions, if known
    legs: dict[int, LegState] = field(default_factory=dict)  # registration id -> state
    failure: tuple[FailureCode, str] | None = None  # set while posted legs settle

    def posted(self) -> bool:
        return any(s is LegState.POSTED for s in self.legs.values())


@dataclass(slots=True)
class _SendTransfer:
    engine_id: str
    transfer_id: str
    created: float
    publishes: dict[int, _Publish] = field(default_factory=dict)  # producer rank -> publish
    registrations: dict[int, Registration] = field(default_factory=dict)  # consumer rank -> reg
    # consumer rank -> id of its current registration; outlives the registration once consumed
    reg_ids: dict[int, int] = field(default_factory=dict)
    written: dict[int, set[int]] = field(default_factory=dict)  # reg id -> producer ranks done
    consumer_tp: int | None = None
    mla: bool = False  # from the registrations: replicated (MLA) regions, fewer writers


@dataclass(frozen=True, slots=True)
class SendView:
    """What the status API shows of one prefill-side transfer."""

    engine_id: str
    transfer_id: str
    age_s: float
    published_ranks: tuple[int, ...]
    registered_ranks: tuple[int, ...]
    legs_posted: int
    legs_done: int
    waiting_for: str
    workers: tuple[str, ...]
    num_blocks: int


class SendSide:
    """Prefill-node rendezvous: publishes x registrations -> legs."""

    def __init__(self, publish_timeout_s: float, registration_timeout_s: float) -> None:
        self.publish_timeout_s = publish_timeout_s
        self.registration_timeout_s = registration_timeout_s
        self._transfers: dict[tuple[str, str], _SendTransfer] = {}
        self._by_reg: dict[tuple[str, int], tuple[str, str]] = {}  # (origin, reg id) -> key
        self._deadlines = _Deadlines()
        self._valid: dict[object, float] = {}
        # Pull legs offered and not yet settled: (origin, reg id, producer rank) <-> leg
        self._pulls: dict[tuple[str, int, int], LegKey] = {}
        self._pull_of: dict[LegKey, tuple[str, int, int]] = {}

    # -- queries ------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._transfers)

    def next_deadline(self) -> float | None:
        return self._deadlines.next(self._valid)

    def origins(self) -> set[str]:
        """Decode daemons that hold registrations here, or owe us a READ (they must keep sending heartbeats)."""
        return {r.origin for t in self._transfers.values() for r in t.registrations.values()} | {
            pk[0] for pk in self._pulls}

    def pull_pending(self, origin: str, registration_id: int, producer_rank: int) -> bool:
        """Whether that pull leg is still offered (not confirmed, failed or given up on)."""
        return (origin, registration_id, producer_rank) in self._pulls

    def pulling(self) -> int:
        """Pull legs offered whose READ is not settled (the runtime polls READ notifications meanwhile)."""
        return len(self._pulls)

    def transfer_of(self, origin: str, registration_id: int) -> tuple[str, str] | None:
        """Key of the transfer a registration belongs to (None: unknown here)."""
        return self._by_reg.get((origin, registration_id))

    def writing_into(self, key: tuple[str, str], registration_id: int) -> bool:
        """A WRITE into this registration's blocks is still in flight (even after it was withdrawn)."""
        t = self._transfers.get(key)
        return t is not None and any(p.legs.get(registration_id) is LegState.POSTED for p in t.publishes.values())

    def agents_in_use(self, origin: str) -> set[str]:
        """Consumer agents that registrations from ``origin`` pending here refer to."""
        return {r.consumer_agent for t in self._transfers.values() for r in t.registrations.values()
                if r.origin == origin}

    def has_publish(self, engine_id: str, transfer_id: str, rank: int) -> bool:
        t = self._transfers.get((engine_id, transfer_id))
        return t is not None and rank in t.publishes

    def views(self, now: float) -> list[SendView]:
        out = []
        for t in self._transfers.values():
            legs = [s for p in t.publishes.values() for s in p.legs.values()]
            posted = sum(s is LegState.POSTED for s in legs)
            if not t.registrations:
                waiting = "decode registration"
            elif not t.publishes:
                waiting = "prefill publish"
            elif posted:
                waiting = f"{posted} WRITE(s)/READ(s) in flight"
            else:
                waiting = "matching ranks"
            out.append(
                SendView(
                    engine_id=t.engine_id,
                    transfer_id=t.transfer_id,
                    age_s=now - t.created,
                    published_ranks=tuple(sorted(t.publishes)),
                    registered_ranks=tuple(sorted(t.registrations)),
                    legs_posted=posted,
                    legs_done=sum(s is LegState.DONE for s in legs),
                    waiting_for=waiting,
                    workers=tuple(p.worker_id for p in t.publishes.values()),
                    num_blocks=max((len(p.block_ids) for p in t.publishes.values()), default=0),
                )
            )
        return out

    # -- events -------------------------------------------------------------------------------

    def publish(
        self,
        now: float,
        worker_id: str,
        engine_id: str,
        rank: int,
        tp_size: int,
        transfer_id: str,
        block_ids: Iterable[int],
        layouts: tuple[Shape, ...] = (),
    ) -> list[Action]:
        """A producer rank's source blocks are complete (``layouts``: its regions, if known)."""
        blocks = tuple(block_ids)
        if not transfer_id:
            raise InvalidArgument("transfer_id must not be empty")
        if not blocks:
            raise InvalidArgument(f"transfer {transfer_id!r}: block_ids must not be empty")
        key = (engine_id, transfer_id)
        t = self._transfers.get(key)
        if t is None:
            t = self._transfers[key] = _SendTransfer(engine_id, transfer_id, now)
        old = t.publishes.get(rank)
        if old is not None:
            if old.block_ids == blocks and old.worker_id == worker_id:
                return []  # a retried Publish: idempotent
            raise AlreadyExists(
                f"transfer {transfer_id!r} is already published by engine {engine_id!r} rank "
                f"{rank} with other blocks; abort it first"
            )
        deadline = now + self.publish_timeout_s
        t.publishes[rank] = _Publish(worker_id, rank, tp_size, blocks, now, deadline, layouts)
        self._arm(("pub", key, rank), deadline)
        return self._match(t, now)

    def register(self, now: float, reg: Registration) -> list[Action]:
        """The decode side's destination blocks for one consumer rank (forwarded by its daemon)."""
        check_tp_pair(reg.producer_tp_size, reg.consumer_tp_size)
        if not reg.block_ids:
            raise InvalidArgument(f"transfer {reg.transfer_id!r}: block_ids must not be empty")
        if (reg.origin, reg.registration_id) in self._by_reg:
            return []  # a retried Register: idempotent
        key = (reg.producer_engine_id, reg.transfer_id)
        t = self._transfers.get(key)
        if t is None:
            t = self._transfers[key] = _SendTransfer(reg.producer_engine_id, reg.transfer_id, now)
        if t.consumer_tp is not None and t.consumer_tp != reg.consumer_tp_size:
            raise InvalidArgument(
                f"transfer {reg.transfer_id!r}: consumer TP size {reg.consumer_tp_size} differs from "
                f"an earlier registration's {t.consumer_tp}"
            )
        actions: list[Action] = []
        old = t.registrations.get(reg.consumer_rank)
        if old is not None:
            # A re-submitted (e.g. preempted and re-allocated) decode request replaces its old
            # registration; writes already posted into the old blocks settle on their own.
            actions += self._drop_registration(t, old, None)
        t.consumer_tp = reg.consumer_tp_size
        t.mla = reg.mla
        t.registrations[reg.consumer_rank] = reg
        t.reg_ids[reg.consumer_rank] = reg.registration_id
        self._by_reg[(reg.origin, reg.registration_id)] = key
        deadline = now + self.registration_timeout_s
        self._arm(("reg", key, reg.consumer_rank), deadline)
        actions += self._match(t, now)
        return actions

    def write_done(self, leg: LegKey, ok: bool, reason: str = "") -> list[Action]:
        """The runtime reports that a WRITE (or, in pull mode, the decode side's READ) completed or failed."""
        pk = self._pull_of.pop(leg, None)
        if pk is not None:
            self._pulls.pop(pk, None)
            self._valid.pop(("pull", (pk[0], pk[1]), pk[2]), None)
        t = self._transfers.get((leg.engine_id, leg.transfer_id))
        pub = t.publishes.get(leg.producer_rank) if t is not None else None
        state = pub.legs.get(leg.registration_id) if pub is not None else None
        if step(LEG_TABLE, state, "write_done", leg.transfer_id) is Move.DROP:
            return [Dropped("write_done", leg.transfer_id, f"leg {leg.producer_rank}->{leg.registration_id} "
                            f"is {state.value if state else 'gone'}")]
        assert t is not None and pub is not None
        actions: list[Action] = []
        if ok:
            pub.legs[leg.registration_id] = LegState.DONE
            t.written.setdefault(leg.registration_id, set()).add(leg.producer_rank)
        else:
            del pub.legs[leg.registration_id]
            reg = self._reg_by_id(t, leg.registration_id)
            what = "READ by the decode daemon" if pk is not None else "WRITE"
            msg = f"{what} from producer rank {leg.producer_rank} failed: {reason}"
            if reg is not None:
                actions += self._drop_registration(t, reg, (FailureCode.TRANSFER_ERROR, msg))
            self._fail_publish(t, pub, FailureCode.TRANSFER_ERROR, msg)
        actions += self._settle(t)
        return actions

    def read_done(self, origin: str, registration_id: int, producer_rank: int, ok: bool,
                  reason: str = "") -> list[Action]:
        """Pull mode: the decode daemon ``origin`` READ a leg (its notification), or says the READ failed.

        Only a leg offered to that very daemon for that registration and rank is settled; anything
        else (late, duplicate, forged) is ignored.
        """
        leg = self._pulls.get((origin, registration_id, producer_rank))
        if leg is None:
            return [Dropped("read_done", "", f"no READ of registration {registration_id} rank {producer_rank} "
                            "offered to that daemon is pending")]
        return self.write_done(leg, ok, reason)

    def withdraw(self, origin: str, transfer_id: str, registration_id: int, code: FailureCode,
                 reason: str) -> list[Action]:
        """The decode side gave up on a registration (abort, timeout, worker gone)."""
        key = self._by_reg.get((origin, registration_id))
        reg = self._reg_by_id(self._transfers[key], registration_id) if key is not None else None
        if key is None or reg is None:
            return [Dropped("withdraw", transfer_id, f"registration {registration_id} already ended here")]
        t = self._transfers[key]
        # SUPERSEDED: the decode worker re-registers (new blocks); its publishes must not fail.
        fail = None if code is FailureCode.SUPERSEDED else (code, f"decode side: {reason}")
        return self._drop_registration(t, reg, None, fail_publishes=fail) + self._settle(t)

    def abort(self, worker_id: str, engine_id: str, transfer_id: str) -> tuple[bool, list[Action]]:
        """The prefill engine cancelled the request."""
        t = self._transfers.get((engine_id, transfer_id))
        pubs = [p for p in t.publishes.values() if p.worker_id == worker_id] if t else []
        if t is None or not pubs:
            return False, []
        actions: list[Action] = []
        for pub in pubs:
            actions += self._fail_targets(t, pub, FailureCode.ABORTED, "aborted by the prefill engine")
            self._fail_publish(t, pub, FailureCode.ABORTED, "aborted by the engine")
        return True, actions + self._settle(t)

    def worker_gone(self, worker_id: str) -> list[Action]:
        """A producer worker's session ended: its publishes die with it (no completion to deliver)."""
        actions: list[Action] = []
        for t in list(self._transfers.values()):
            for pub in [p for p in t.publishes.values() if p.worker_id == worker_id]:
                actions += self._fail_targets(t, pub, FailureCode.WORKER_GONE, "prefill worker is gone")
                self._fail_publish(t, pub, FailureCode.WORKER_GONE, "worker is gone")
            actions += self._settle(t)
        return [a for a in actions if not (isinstance(a, Deliver) and a.worker_id == worker_id)]

    def origin_lost(self, origin: str, reason: str) -> list[Action]:
        """A decode daemon is gone (restart or unreachable): its registrations are void."""
        actions: list[Action] = []
        for t in list(self._transfers.values()):
            for reg in [r for r in t.registrations.values() if r.origin == origin]:
                actions += self._drop_registration(
                    t, reg, None, fail_publishes=(FailureCode.PEER_UNREACHABLE, reason))
            actions += self._settle(t)
        # READs that daemon owed us will never be confirmed: the legs failed.
        for leg in [v for k, v in self._pulls.items() if k[0] == origin]:
            actions += self.write_done(leg, False, f"decode daemon lost before confirming the READ: {reason}")
        return actions

    def shutdown(self, reason: str) -> list[Action]:
        """The daemon is stopping: everything not yet written fails now; WRITEs in flight settle."""
        actions: list[Action] = []
        for t in list(self._transfers.values()):
            for pub in list(t.publishes.values()):
                actions += self._fail_targets(t, pub, FailureCode.SHUTDOWN, reason)
                self._fail_publish(t, pub, FailureCode.SHUTDOWN, reason)
            for reg in list(t.registrations.values()):
                actions += self._drop_registration(t, reg, (FailureCode.SHUTDOWN, reason))
            actions += self._settle(t)
        return actions

    def tick(self, now: float) -> list[Action]:
        """Expire publishes and registrations whose deadline passed without progress."""
        actions: list[Action] = []
        for when, key in self._deadlines.pop_due(now):
            if self._valid.get(key) != when:
                continue
            del self._valid[key]
            if cast(tuple[str, object, int], key)[0] == "pull":
                _, (porigin, prid), prank = cast(tuple[str, tuple[str, int], int], key)
                pleg = self._pulls.get((porigin, prid, prank))
                if pleg is not None:
                    actions += self.write_done(pleg, False, f"READ not confirmed within "
                                                            f"{self.publish_timeout_s:g}s of the offer")
                continue
            kind, tkey, rank = cast(tuple[str, tuple[str, str], int], key)
            t = self._transfers.get(tkey)
            if t is None:
                continue
            if kind == "pub":
                pub = t.publishes.get(rank)
                if pub is None or pub.failure is not None:
                    continue
                if self._progressing(t, pub) or self._leased(t, pub):
                    self._arm(key, now + self.publish_timeout_s)  # look again: a target may be dropped
                    continue
                msg = (f"no decode registration for transfer {t.transfer_id!r} within "
                       f"{self.publish_timeout_s:g}s of publish")
                actions += self._fail_targets(t, pub, FailureCode.TIMEOUT, msg)
                self._fail_publish(t, pub, FailureCode.TIMEOUT, msg)
            else:
                reg = t.registrations.get(rank)
                if reg is None:
                    continue
                if any(reg.registration_id in p.legs for p in t.publishes.values()):
                    self._arm(key, now + self.registration_timeout_s)  # look again: a source may not come
                    continue
                msg = (f"prefill engine {t.engine_id!r} did not publish transfer "
                       f"{t.transfer_id!r} within {self.registration_timeout_s:g}s")
                actions += self._drop_registration(t, reg, (FailureCode.TIMEOUT, msg))
            actions += self._settle(t)
        return actions

    # -- internals ----------------------------------------------------------------------------

    def _arm(self, key: object, when: float) -> None:
        self._valid[key] = when
        self._deadlines.add(when, key)

    @staticmethod
    def _reg_by_id(t: _SendTransfer, registration_id: int) -> Registration | None:
        for r in t.registrations.values():
            if r.registration_id == registration_id:
                return r
        return None

    @staticmethod
    def _leased(t: _SendTransfer, pub: _Publish) -> bool:
        """The publish's lease is held by the decode side: a WRITE from it is in flight, or a
        registration it wrote into still waits for other producer ranks. Registrations live only
        while their decode daemon's heartbeats arrive (silence for peer_timeout_s drops them), so
        the heartbeats renew the lease; expect_timeout_s on the decode side bounds it."""
        return pub.posted() or any(r.registration_id in pub.legs for r in t.registrations.values())

    def _progressing(self, t: _SendTransfer, pub: _Publish) -> bool:
        """A publish whose every target is registered has its WRITEs started: no expiry."""
        if t.consumer_tp is None:
            return False
        return all(c in t.reg_ids for c in writer_targets(pub.rank, pub.tp_size, t.consumer_tp, t.mla))

    def _match(self, t: _SendTransfer, now: float) -> list[Action]:
        """Start every leg whose publish and registration are both present."""
        actions: list[Action] = []
        for pub in list(t.publishes.values()):
            if pub.failure is not None:
                continue
            for reg in list(t.registrations.values()):
                if reg.registration_id in pub.legs or pub.rank in t.written.get(reg.registration_id, ()):
                    continue  # started by this publish, or written by an earlier publish of this rank
                if reg.consumer_rank not in writer_targets(pub.rank, pub.tp_size, reg.consumer_tp_size, reg.mla):
                    continue
                by_tokens = reg.by_tokens or reg.skip_tokens > 0 or sizes_differ(pub.layouts, reg.layouts)
                problem = self._mismatch(pub, reg, by_tokens)
                if problem:
                    actions += self._drop_registration(t, reg, (FailureCode.LAYOUT_MISMATCH, problem))
                    actions += self._fail_targets(t, pub, FailureCode.LAYOUT_MISMATCH, problem)
                    self._fail_publish(t, pub, FailureCode.LAYOUT_MISMATCH, problem)
                    break
                pub.legs[reg.registration_id] = LegState.POSTED
                # A partial prefix-cache hit on decode needs only the tail of the prompt's blocks.
                src = pub.block_ids if by_tokens else pub.block_ids[len(pub.block_ids) - len(reg.block_ids):]
                if reg.mode is TransferMode.PULL:
                    leg = LegKey(t.engine_id, t.transfer_id, pub.rank, reg.registration_id)
                    pk = (reg.origin, reg.registration_id, pub.rank)
                    self._pulls[pk] = leg
                    self._pull_of[leg] = pk
                    self._arm(("pull", (reg.origin, reg.registration_id), pub.rank), now + self.publish_timeout_s)
                    actions.append(SendOffer(leg, pub.worker_id, pub.rank, pub.tp_size, src, reg))
                    continue
                src_part, dst_part = block_parts(pub.rank, pub.tp_size, reg.consumer_rank, reg.consumer_tp_size)
                skip_rep = skips_replicated(pub.rank, pub.tp_size, reg.consumer_tp_size)
                actions.append(
                    StartWrite(
                        leg=LegKey(t.engine_id, t.transfer_id, pub.rank, reg.registration_id),
                        producer_worker=pub.worker_id,
                        producer_rank=pub.rank,
                        producer_tp_size=pub.tp_size,
                        src_blocks=src,
                        registration=reg,
                        notif=notif.encode(reg.registration_id, pub.rank),
                        src_part=src_part,
                        dst_part=dst_part,
                        skip_replicated=skip_rep,
                        planned=by_tokens or needs_plan(pub.layouts, reg.layouts, reg.skip_tokens, skip_rep,
                                                        src_part, dst_part),
                        waited_s=max(now - t.created, 0.0),
                    )
                )
        return actions + self._settle(t)

    @staticmethod
    def _mismatch(pub: _Publish, reg: Registration, by_tokens: bool) -> str:
        if reg.producer_tp_size != pub.tp_size:
            return (f"decode side expects producer TP size {reg.producer_tp_size}, "
                    f"prefill engine runs TP {pub.tp_size}")
        if len(reg.block_ids) > len(pub.block_ids) and not by_tokens:  # by tokens: checked when posting
            return (f"block lists of unequal length: decode expects {len(reg.block_ids)} blocks, "
                    f"prefill published {len(pub.block_ids)}")
        return ""

    def _fail_publish(self, t: _SendTransfer, pub: _Publish, code: FailureCode, reason: str) -> None:
        if pub.failure is None:
            pub.failure = (code, reason)

    def _fail_targets(self, t: _SendTransfer, pub: _Publish, code: FailureCode, reason: str) -> list[Action]:
        """Registrations this publish would have written are void: tell their decode daemons."""
        actions: list[Action] = []
        for reg in list(t.registrations.values()):
            if reg.consumer_rank in consumer_targets(pub.rank, pub.tp_size, reg.consumer_tp_size):
                actions += self._drop_registration(t, reg, (code, reason))
        return actions

    def _drop_registration(
        self,
        t: _SendTransfer,
        reg: Registration,
        notice: tuple[FailureCode, str] | None,
        fail_publishes: tuple[FailureCode, str] | None = None,
    ) -> list[Action]:
        actions: list[Action] = []
        self._consume(t, reg)
        if t.reg_ids.get(reg.consumer_rank) == reg.registration_id:
            del t.reg_ids[reg.consumer_rank]
        t.written.pop(reg.registration_id, None)
        if notice is not None:
            actions.append(SendFailNotice(reg.origin, t.transfer_id, reg.registration_id, *notice))
        if fail_publishes is not None:
            for pub in t.publishes.values():
                if reg.consumer_rank in consumer_targets(pub.rank, pub.tp_size, reg.consumer_tp_size):
                    self._fail_publish(t, pub, *fail_publishes)
        return actions

    def _settle(self, t: _SendTransfer) -> list[Action]:
        """Report publishes that are finished, or failed with nothing left in flight."""
        actions: list[Action] = []
        for rank, pub in list(t.publishes.items()):
            if pub.failure is not None:
                if pub.posted():
                    continue  # wait for in-flight WRITEs before the worker may free its blocks
                code, reason = pub.failure
                comp = Completion(CompletionKind.FAILED, t.transfer_id, code, reason, pub.block_ids)
            else:
                if t.consumer_tp is None or pub.posted():
                    continue  # a WRITE into a replaced registration may still read the blocks
                targets = writer_targets(pub.rank, pub.tp_size, t.consumer_tp, t.mla)
                if not all(
                    c in t.reg_ids and pub.rank in t.written.get(t.reg_ids[c], ())
                    for c in targets
                ):
                    continue
                comp = Completion(CompletionKind.FINISHED_SENDING, t.transfer_id)
            del t.publishes[rank]
            self._valid.pop(("pub", (t.engine_id, t.transfer_id), rank), None)
            actions.append(Deliver(pub.worker_id, comp))
        # A registration is consumed once every producer rank that writes to it has written.
        for reg in list(t.registrations.values()):
            sources = writer_sources(reg.consumer_rank, reg.producer_tp_size, reg.consumer_tp_size, reg.mla)
            if set(sources) <= t.written.get(reg.registration_id, set()):
                self._consume(t, reg)
        if not t.publishes and not t.registrations:
            del self._transfers[(t.engine_id, t.transfer_id)]
        return actions

    def _consume(self, t: _SendTransfer, reg: Registration) -> None:
        """Forget a registration's blocks (written, or dropped); its id stays in reg_ids."""
        if t.registrations.get(reg.consumer_rank) is reg:
            del t.registrations[reg.consumer_rank]
        self._valid.pop(("reg", (t.engine_id, t.transfer_id), reg.consumer_rank), None)
        self._by_reg.pop((reg.origin, reg.registration_id), None)


# --------------------------------------------------------------------------------------------
# Decode side


class RecvState(enum.Enum):
    REGISTERING = "registering"  # Register sent to the prefill daemon, no answer yet
    REGISTERED = "registered"    # the prefill daemon holds the registration; waiting for WRITEs


_PUSH, _PULL = TransferMode.PUSH, TransferMode.PULL
# The decode side's registration, by mode: (state, event) -> the state it moves to, or DROP. A
# WRITE may land (notified) before the answer to Register does; an offer may come before it too.
# A WRITE notification for a pull registration, or an offer for a push one, is not in the table.
RECV_TABLE: dict[tuple[TransferMode, RecvState, str], RecvState | Move] = {
    **{(_PUSH, st, "registered"): RecvState.REGISTERED for st in RecvState},
    **{(_PUSH, st, "notified"): st for st in RecvState},
    **{(_PULL, st, "registered"): RecvState.REGISTERED for st in RecvState},
    **{(_PULL, st, "offer"): RecvState.REGISTERED for st in RecvState},
    **{(_PULL, st, "notified"): Move.DROP for st in RecvState},
}


def recv_step(mode: TransferMode, state: RecvState, event: str, transfer_id: str) -> RecvState | Move:
    move = RECV_TABLE.get((mode, state, event))
    if move is None:
        raise IllegalTransition(f"{mode.name.lower()} {state.value}", event,
                                f"transfer {transfer_id[:256]!r}: event {event!r} is not allowed for a "
                                f"{mode.name.lower()}-mode registration in state {state.value!r}",
                                transfer_id=transfer_id)
    return move


@dataclass(slots=True)
class _Recv:
    worker_id: str
    transfer_id: str
    registration_id: int
    block_ids: tuple[int, ...]
    producer_address: str
    producer_engine_id: str
    expected: frozenset[int]
    created: float
    deadline: float
    state: RecvState = RecvState.REGISTERING
    landed: set[int] = field(default_factory=set)
    mode: TransferMode = TransferMode.PUSH
    producer_tp_size: int = 1
    consumer_rank: int = 0
    consumer_tp_size: int = 1
    reading: set[int] = field(default_factory=set)  # pull: producer ranks whose READ is posted


@dataclass(frozen=True, slots=True)
class RecvView:
    """What the status API shows of one decode-side transfer."""

    worker_id: str
    transfer_id: str
    registration_id: int
    state: str
    age_s: float
    waiting_for: str
    num_blocks: int
    producer_address: str
    mode: str = "push"


class RecvSide:
    """Decode-node rendezvous: one record per Expect, done when every producer rank has landed."""

    def __init__(self, expect_timeout_s: float, first_registration_id: int = 1, random_ids: bool = False) -> None:
        """``random_ids``: registration ids are random 63-bit numbers, not a sequence. The prefill
        daemon a registration goes to learns its id; a third party cannot guess it, so failure
        notices and offers that name it come from that daemon (the daemon itself checks the sender)."""
        self.expect_timeout_s = expect_timeout_s
        self._next_id = itertools.count(first_registration_id)
        self._random_ids = random_ids
        # FAILED completions deferred until the prefill daemon answers a withdrawal (no WRITE into
        # the blocks is in flight any more), by registration id; until then the (worker, transfer)
        # may not be Expected again.
        self._ending: dict[int, Deliver] = {}
        self._ending_keys: set[tuple[str, str]] = set()
        self._by_key: dict[tuple[str, str], _Recv] = {}
        self._by_reg: dict[int, _Recv] = {}
        self._deadlines = _Deadlines()
        self._valid: dict[object, float] = {}
        self.stray_notifications = 0

    def __len__(self) -> int:
        return len(self._by_reg)

    def next_deadline(self) -> float | None:
        return self._deadlines.next(self._valid)

    def withdraw_answered(self, registration_id: int) -> list[Action]:
        """The prefill daemon answered a SendWithdraw (or could not be reached): deliver the FAILED
        deferred until then; the transfer id may be Expected again."""
        d = self._ending.pop(registration_id, None)
        if d is None:
            return []
        self._ending_keys.discard((d.worker_id, d.completion.transfer_id))
        return [d]

    def deferred(self) -> set[int]:
        """Registrations whose FAILED waits for the answer to their withdrawal."""
        return set(self._ending)

    def _defer(self, r: _Recv, code: FailureCode, reason: str) -> None:
        self._ending[r.registration_id] = self._fail(r, code, reason)
        self._ending_keys.add((r.worker_id, r.transfer_id))

    def sent_to(self, registration_id: int) -> tuple[str, str] | None:
        """(transfer id, producer address) of a pending registration, or None."""
        r = self._by_reg.get(registration_id)
        return None if r is None else (r.transfer_id, r.producer_address)

    def producer_addresses(self) -> set[str]:
        """Prefill daemons that pending receives wait on (we send them heartbeats)."""
        return {r.producer_address for r in self._by_reg.values()}

    def get(self, registration_id: int) -> tuple[str, str] | None:
        r = self._by_reg.get(registration_id)
        return (r.worker_id, r.transfer_id) if r else None

    def views(self, now: float) -> list[RecvView]:
        out = []
        for r in self._by_reg.values():
            if r.state is RecvState.REGISTERING:
                waiting = f"prefill daemon {r.producer_address} to accept the registration"
            elif r.mode is TransferMode.PULL:
                offers = sorted(r.expected - r.landed - r.reading)
                waiting = ", ".join(([f"READ(s) of producer rank(s) {sorted(r.reading)}"] if r.reading else [])
                                    + ([f"offer(s) for producer rank(s) {offers}"] if offers else []))
            else:
                missing = sorted(r.expected - r.landed)
                waiting = f"WRITE notification(s) from producer rank(s) {missing}"
            out.append(RecvView(r.worker_id, r.transfer_id, r.registration_id, r.state.value,
                                now - r.created, waiting, len(r.block_ids), r.producer_address,
                                r.mode.name.lower()))
        return out

    def expect(
        self,
        now: float,
        worker_id: str,
        consumer_rank: int,
        consumer_tp_size: int,
        transfer_id: str,
        block_ids: Iterable[int],
        producer_address: str,
        producer_engine_id: str,
        producer_tp_size: int,
        mode: TransferMode = TransferMode.PUSH,
        skip_tokens: int = 0,
        mla: bool = False,
        layouts: tuple[Shape, ...] = (),
    ) -> list[Action]:
        """A decode worker allocated destination blocks: register them with the prefill side.

        ``skip_tokens``: the worker holds the prompt's first tokens already (``block_ids`` start
        there). ``mla`` (or ``layouts`` all replicated): fewer producer ranks write to it."""
        blocks = tuple(block_ids)
        mla = mla or (bool(layouts) and all(r.replicated for r in layouts))
        if not transfer_id:
            raise InvalidArgument("transfer_id must not be empty")
        if (worker_id, transfer_id) in self._ending_keys:
            raise AlreadyExists(f"transfer {transfer_id!r} is still ending on this worker (its withdrawal is "
                                "not answered yet, a WRITE may be landing): Expect it again after its FAILED")
        if not blocks:
            raise InvalidArgument(f"transfer {transfer_id!r}: block_ids must not be empty")
        if not producer_address:
            raise InvalidArgument(f"transfer {transfer_id!r}: producer_address must not be empty")
        check_tp_pair(producer_tp_size, consumer_tp_size)
        actions: list[Action] = []
        old = self._by_key.get((worker_id, transfer_id))
        if old is not None:
            if (old.block_ids, old.producer_address, old.producer_engine_id, old.mode) == (
                blocks, producer_address, producer_engine_id, mode):
                return []  # a retried Expect: idempotent
            # Re-submitted after preemption with new blocks: the new registration replaces the old.
            self._remove(old)
            actions.append(SendWithdraw(old.producer_address, transfer_id, old.registration_id,
                                        FailureCode.SUPERSEDED, "replaced by a newer Expect"))
        rid = next(self._next_id)
        if self._random_ids:
            rid = secrets.randbits(63) or 1
            while rid in self._by_reg:
                rid = secrets.randbits(63) or 1
        deadline = now + self.expect_timeout_s
        r = _Recv(worker_id, transfer_id, rid, blocks, producer_address, producer_engine_id,
                  frozenset(writer_sources(consumer_rank, producer_tp_size, consumer_tp_size, mla)),
                  now, deadline, mode=mode, producer_tp_size=producer_tp_size, consumer_rank=consumer_rank,
                  consumer_tp_size=consumer_tp_size)
        self._by_key[(worker_id, transfer_id)] = r
        self._by_reg[rid] = r
        self._valid[rid] = deadline
        self._deadlines.add(deadline, rid)
        actions.append(SendRegister(producer_address, rid, worker_id, transfer_id, producer_engine_id,
                                    producer_tp_size, consumer_rank, consumer_tp_size, blocks, mode, skip_tokens))
        return actions

    def registered(self, registration_id: int) -> list[Action]:
        """The prefill daemon accepted the registration."""
        r = self._by_reg.get(registration_id)
        if r is None:
            return [Dropped("registered", "", f"registration {registration_id} ended before its Register answer")]
        nxt = recv_step(r.mode, r.state, "registered", r.transfer_id)
        if isinstance(nxt, RecvState):
            r.state = nxt
        return []

    def notified(self, registration_id: int, producer_rank: int) -> list[Action]:
        """A WRITE's notification arrived: that producer rank's bytes have landed."""
        r = self._by_reg.get(registration_id)
        if r is None or producer_rank not in r.expected or \
                recv_step(r.mode, r.state, "notified", r.transfer_id) is Move.DROP:
            self.stray_notifications += 1
            return [Dropped("notified", r.transfer_id if r else "", f"no pending push registration "
                            f"{registration_id} expects producer rank {producer_rank}")]
        r.landed.add(producer_rank)
        if r.landed != r.expected:
            return []
        self._remove(r)
        return [Deliver(r.worker_id, Completion(CompletionKind.FINISHED_RECEIVING, r.transfer_id))]

    def producer_address_of(self, registration_id: int) -> str | None:
        """The prefill daemon a pending registration was sent to (offers must come from it)."""
        r = self._by_reg.get(registration_id)
        return None if r is None else r.producer_address

    def offer(self, registration_id: int, transfer_id: str, producer_rank: int,
              src_blocks: Iterable[int], producer_agent: str = "") -> list[Action]:
        """Pull mode: the prefill daemon offers a producer rank's source blocks; READ them.

        The runtime has checked that the caller is the daemon the registration was sent to. Here:
        the registration is pending, in pull mode, under this transfer id, expects this producer
        rank, and the offer covers exactly as many blocks as it registered. Only then is a READ
        started, always into this registration's own blocks. A repeated offer is ignored.
        """
        src = tuple(src_blocks)
        r = self._by_reg.get(registration_id)
        if r is None:
            raise NotFound(f"registration {registration_id} is not pending here (finished, failed or withdrawn)")
        if r.transfer_id != transfer_id:
            raise PermissionDenied(f"registration {registration_id} is not for transfer {transfer_id[:256]!r}")
        nxt = recv_step(r.mode, r.state, "offer", transfer_id)
        if producer_rank not in r.expected:
            raise InvalidArgument(f"transfer {transfer_id!r}: producer rank {producer_rank} does not feed this "
                                  f"registration (expects ranks {sorted(r.expected)})")
        if len(src) != len(r.block_ids):
            raise InvalidArgument(f"transfer {transfer_id!r}: offer of {len(src)} source blocks for "
                                  f"{len(r.block_ids)} destination blocks")
        if producer_rank in r.reading or producer_rank in r.landed:
            return [Dropped("offer", transfer_id, f"producer rank {producer_rank} was offered already")]
        r.reading.add(producer_rank)
        assert isinstance(nxt, RecvState)
        r.state = nxt
        key = ReadKey(r.producer_address, r.transfer_id, registration_id, producer_rank)
        src_part, dst_part = block_parts(producer_rank, r.producer_tp_size, r.consumer_rank, r.consumer_tp_size)
        return [StartRead(key, r.worker_id, r.producer_tp_size, r.consumer_rank, r.consumer_tp_size, src,
                          r.block_ids, producer_agent, notif.encode_read(registration_id, producer_rank),
                          src_part, dst_part)]

    def read_done(self, key: ReadKey, ok: bool, reason: str = "") -> list[Action]:
        """Pull mode: a READ completed (the rank has landed) or failed (the receive fails, prefill is told).

        A failed READ is reported to the prefill daemon even when the receive already ended (abort,
        timeout), since the prefill side holds its blocks until it hears how the READ ended.
        """
        r = self._by_reg.get(key.registration_id)
        mine = r is not None and key.producer_rank in r.reading
        if r is not None and mine:
            r.reading.discard(key.producer_rank)
        if ok:
            if r is None or not mine:
                return [Dropped("read_done", key.transfer_id, "the receive ended while its READ was in flight")]
            r.landed.add(key.producer_rank)
            if r.landed != r.expected:
                return []
            self._remove(r)
            return [Deliver(r.worker_id, Completion(CompletionKind.FINISHED_RECEIVING, r.transfer_id))]
        actions: list[Action] = [SendReadFailed(key, reason)]
        if r is not None and mine:
            self._remove(r)
            actions.append(self._fail(r, FailureCode.TRANSFER_ERROR,
                                      f"READ from producer rank {key.producer_rank} failed: {reason}"))
        return actions

    def failed(self, registration_id: int, code: FailureCode, reason: str) -> list[Action]:
        """The prefill side (or our Register call) failed this registration."""
        r = self._by_reg.get(registration_id)
        if r is None:
            return [Dropped("failed", "", f"registration {registration_id} already ended")]
        self._remove(r)
        return [self._fail(r, code, reason)]

    def abort(self, worker_id: str, transfer_id: str) -> tuple[bool, list[Action]]:
        r = self._by_key.get((worker_id, transfer_id))
        if r is None:
            return False, []
        self._remove(r)
        self._defer(r, FailureCode.ABORTED, "aborted by the decode engine")
        return True, [
            SendWithdraw(r.producer_address, transfer_id, r.registration_id, FailureCode.ABORTED,
                         "aborted by the decode engine"),
        ]

    def worker_gone(self, worker_id: str) -> list[Action]:
        actions: list[Action] = []
        for r in [r for r in self._by_reg.values() if r.worker_id == worker_id]:
            self._remove(r)
            actions.append(SendWithdraw(r.producer_address, r.transfer_id, r.registration_id,
                                        FailureCode.WORKER_GONE, "decode worker is gone"))
        return actions

    def shutdown(self, reason: str) -> list[Action]:
        """The daemon is stopping: every receive fails now, and its registration is withdrawn."""
        actions: list[Action] = []
        for r in list(self._by_reg.values()):
            self._remove(r)
            actions.append(self._fail(r, FailureCode.SHUTDOWN, reason))
            actions.append(SendWithdraw(r.producer_address, r.transfer_id, r.registration_id,
                                        FailureCode.SHUTDOWN, reason))
        return actions

    def producer_lost(self, producer_address: str, code: FailureCode, reason: str,
                      registered_only: bool = False) -> list[Action]:
        """The prefill daemon at this address died, restarted or became unreachable.

        After a restart only registrations the old instance had accepted are lost
        (``registered_only``); those still being registered go to the new instance.
        """
        actions: list[Action] = []
        for r in [r for r in self._by_reg.values() if r.producer_address == producer_address
                  and not (registered_only and r.state is RecvState.REGISTERING)]:
            self._remove(r)
            actions.append(self._fail(r, code, reason))
        return actions

    def tick(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for when, rid in self._deadlines.pop_due(now):
            if self._valid.get(rid) != when:
                continue
            r = self._by_reg[rid]  # type: ignore[index]
            self._remove(r)
            msg = (f"transfer {r.transfer_id!r} not received within {self.expect_timeout_s:g}s "
                   f"(landed ranks {sorted(r.landed)} of {sorted(r.expected)}, state {r.state.value})")
            self._defer(r, FailureCode.TIMEOUT, msg)
            actions.append(SendWithdraw(r.producer_address, r.transfer_id, r.registration_id,
                                        FailureCode.TIMEOUT, msg))
        return actions

    def _remove(self, r: _Recv) -> None:
        del self._by_reg[r.registration_id]
        del self._by_key[(r.worker_id, r.transfer_id)]
        self._valid.pop(r.registration_id, None)

    @staticmethod
    def _fail(r: _Recv, code: FailureCode, reason: str) -> Deliver:
        return Deliver(r.worker_id, Completion(CompletionKind.FAILED, r.transfer_id, code, reason, r.block_ids))
