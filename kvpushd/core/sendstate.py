"""The prefill side's records, their transition tables and deadline keys (the rules: send.py).

Three kinds of record, each with its table (core/table.py; anything a table does not name is an
IllegalTransition):

- a *publish*: one producer rank's source blocks for a transfer. WAITING until every consumer rank
  it writes to has been written (``written``: it ends, FINISHED_SENDING), or FAILING from its first
  failure on (the cause stands) until none of its legs is in flight any more (``settled``: FAILED).
- a *registration*: one consumer rank's destination blocks (forwarded by its decode daemon). HELD
  until every producer rank that writes to it has written, or it is withdrawn, replaced, expires,
  is voided by a failure, or its decode daemon is lost.
- a *leg*: one publish's WRITE (or, in pull mode, offered READ) into one registration. POSTED,
  then DONE, or gone when it failed. ``start`` on a leg that exists is illegal: a leg is written
  at most once.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import msgspec

from .actions import Registration, SendFailNotice
from .errors import InvalidArgument
from .layout import Shape
from .ledger import Ledger
from .table import Move, State
from .topology import writer_targets
from .types import FailureCode

GONE, DROP, STAY = Move.GONE, Move.DROP, Move.STAY


class LegState(State):
    POSTED = "posted"
    DONE = "done"


class PubState(State):
    WAITING = "waiting"  # for its registrations, or for its WRITEs
    FAILING = "failing"  # failed; reported once no leg of it is in flight


class RegState(State):
    HELD = "held"  # its blocks wait here for the producer ranks that write to them


# Why a publish fails (each moves WAITING -> FAILING; a later one leaves the first cause):
# aborted, its worker gone, its lease expired, one of its legs failed, its layout does not fit a
# registration, a registration it writes into was withdrawn or its decode daemon lost, the decode
# side declined the transfer, the daemon stopping.
PUB_FAILURES = ("abort", "worker_gone", "timeout", "leg_failed", "mismatch", "target_failed", "decline",
                "shutdown")
# How a held registration ends early: withdrawn by its decode side, replaced by a newer one of its
# consumer rank, expired, voided (a publish that writes it failed, or a WRITE into it failed), its
# layout does not fit a publish, declined, its decode daemon lost, the daemon stopping, or (held
# before the publish came) a publish bound the transfer to another decode daemon.
REG_ENDS = ("withdraw", "replaced", "timeout", "void", "mismatch", "decline", "origin_lost", "shutdown",
            "unbound")

LEG_TABLE: dict[tuple[LegState | None, str], LegState | Move] = {
    (None, "start"): LegState.POSTED,
    (LegState.POSTED, "write_done"): LegState.DONE,
    (LegState.POSTED, "write_failed"): GONE,  # the publish fails, the registration is voided
    (LegState.DONE, "write_done"): DROP,      # a second completion of the same leg
    (LegState.DONE, "write_failed"): DROP,
    (None, "write_done"): DROP,               # the leg's transfer ended while it was in flight
    (None, "write_failed"): DROP,
}

PUB_TABLE: dict[tuple[PubState | None, str], PubState | Move] = {
    (None, "publish"): PubState.WAITING,
    (PubState.WAITING, "publish"): STAY,  # a retry (other blocks: AlreadyExists)
    (PubState.FAILING, "publish"): STAY,
    (PubState.WAITING, "written"): GONE,  # FINISHED_SENDING
    (PubState.FAILING, "settled"): GONE,  # FAILED, nothing of it in flight any more
    **{(PubState.WAITING, e): PubState.FAILING for e in PUB_FAILURES},
    # a failing publish is not matched again, so no layout of it is checked any more
    **{(PubState.FAILING, e): STAY for e in PUB_FAILURES if e != "mismatch"},
}

REG_TABLE: dict[tuple[RegState | None, str], RegState | Move] = {
    (None, "register"): RegState.HELD,
    (RegState.HELD, "register"): STAY,  # a retried Register of the same registration
    (RegState.HELD, "written"): GONE,   # every producer rank that writes to it has
    (None, "withdraw"): DROP,           # it ended here already
    **{(RegState.HELD, e): GONE for e in REG_ENDS},
}


# Deadline keys (core/deadlines.py): one live deadline per key.


class PublishLease(msgspec.Struct, frozen=True, gc=False):
    """A publish's lease (publish_timeout_s, renewed while the decode side holds it)."""

    engine_id: str
    transfer_id: str
    rank: int


class RegistrationLease(msgspec.Struct, frozen=True, gc=False):
    """A registration's wait for its publish (registration_timeout_s)."""

    engine_id: str
    transfer_id: str
    consumer_rank: int


class PullLease(msgspec.Struct, frozen=True, gc=False):
    """An offered READ's wait for its confirmation (publish_timeout_s)."""

    origin: str
    registration_id: int
    producer_rank: int


SendDeadline = PublishLease | RegistrationLease | PullLease


@dataclass(frozen=True, slots=True)
class Binding:
    """The decode daemon a transfer is bound to, by node id and/or TLS name (empty: unbound)."""

    node_id: str = ""
    tls_name: str = ""

    def __bool__(self) -> bool:
        return bool(self.node_id or self.tls_name)

    def __str__(self) -> str:
        return " with ".join(x for x in (repr(self.node_id[:256]) if self.node_id else "",
                                          f"TLS name {self.tls_name[:256]!r}" if self.tls_name else "") if x)

    def admits(self, reg: Registration) -> bool:
        return ((not self.node_id or reg.node_id == self.node_id)
                and (not self.tls_name or self.tls_name in reg.tls_names))


@dataclass(slots=True)
class Publish:
    worker_id: str
    rank: int
    tp_size: int
    block_ids: tuple[int, ...]
    layouts: tuple[Shape, ...] = ()  # the producer's regions, if known
    legs: dict[int, LegState] = field(default_factory=dict)  # registration id -> state
    leg_ranks: dict[int, int] = field(default_factory=dict)  # registration id -> its consumer rank
    state: PubState = PubState.WAITING
    failure: tuple[FailureCode, str] | None = None  # the first cause, while posted legs settle
    # progressive push: declared before engine step ``step`` computes it, in ``layers`` groups;
    # ready once the worker's doorbell says that step is complete (pull legs wait for that)
    step: int = 0
    layers: int = 0
    ready: bool = True
    ready_blocks: int = 0  # the first that many blocks are complete already (earlier chunks, prefix hits)
    staged: set[int] = field(default_factory=set)  # registration ids whose leg is written by layer groups
    ledger: Ledger | None = None  # its books (set by SendSide.publish)

    def posted(self) -> bool:
        return any(s is LegState.POSTED for s in self.legs.values())


@dataclass(slots=True)
class SendTransfer:
    engine_id: str
    transfer_id: str
    created: float
    publishes: dict[int, Publish] = field(default_factory=dict)  # producer rank -> publish
    registrations: dict[int, Registration] = field(default_factory=dict)  # consumer rank -> reg
    # consumer rank -> id of its current registration; outlives the registration once consumed
    reg_ids: dict[int, int] = field(default_factory=dict)
    written: dict[int, set[int]] = field(default_factory=dict)  # reg id -> producer ranks done
    consumer_tp: int | None = None
    mla: bool = False  # from the registrations: replicated (MLA) regions, fewer writers
    # consumer rank -> the decode daemon (origin) that registered it: only it may replace it
    rank_origin: dict[int, str] = field(default_factory=dict)
    # the decode daemon a publish bound the transfer to: only its registrations are accepted
    # (unbound: the first registration wins)
    consumer: Binding = field(default_factory=lambda: Binding())
    # failure notices held until no WRITE into their registration is in flight (reg id -> notice):
    # a decode engine told FAILED frees its blocks, so it must not be told while bytes may land
    notices: dict[int, SendFailNotice] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, str]:
        return self.engine_id, self.transfer_id

    def reg_by_id(self, registration_id: int) -> Registration | None:
        for r in self.registrations.values():
            if r.registration_id == registration_id:
                return r
        return None

    def leased(self, pub: Publish) -> bool:
        """The publish's lease is held by the decode side: a WRITE from it is in flight, or a
        registration it wrote into still waits for other producer ranks. Registrations live only
        while their decode daemon's heartbeats arrive (silence for peer_timeout_s drops them), so
        the heartbeats renew the lease; expect_timeout_s on the decode side bounds it."""
        return pub.posted() or any(r.registration_id in pub.legs for r in self.registrations.values())

    def progressing(self, pub: Publish) -> bool:
        """A publish whose every target is registered has its WRITEs started: no expiry."""
        if self.consumer_tp is None:
            return False
        return all(c in self.reg_ids for c in writer_targets(pub.rank, pub.tp_size, self.consumer_tp, self.mla))

    def check_binding(self, consumer: Binding) -> None:
        """Every rank's publish names the same decode node (or none, keeping an earlier one's)."""
        if consumer and self.consumer and consumer != self.consumer:
            raise InvalidArgument(f"transfer {self.transfer_id[:256]!r} is bound to decode node "
                                  f"{self.consumer} by another publish; this one names {consumer}")
        if consumer and not self.consumer and self.publishes:
            raise InvalidArgument(f"transfer {self.transfer_id[:256]!r} is already published unbound by another "
                                  "rank; every rank's publish must name the same decode node")

    def bind(self, consumer: Binding) -> list[Registration]:
        """Bind to the decode node ``consumer``; the registrations held from other nodes (they came
        before the publish), to be failed back. Their consumer ranks are free for the named node."""
        self.consumer = consumer
        wrong = [r for r in self.registrations.values() if not consumer.admits(r)]
        for r in wrong:
            self.rank_origin.pop(r.consumer_rank, None)
        if len(wrong) == len(self.registrations) and not self.written:
            self.consumer_tp = None  # what a refused registration said binds nothing
        return wrong

    def refusal(self, reg: Registration) -> str:
        names = f" (TLS names {', '.join(repr(n[:256]) for n in reg.tls_names[:8])})" if self.consumer.tls_name else ""
        return (f"transfer {self.transfer_id[:256]!r} is bound to decode node {self.consumer}; "
                f"a registration from node {reg.node_id[:256]!r}{names} is not accepted")

    def release_notices(self) -> list[SendFailNotice]:
        """Failure notices whose registration has no WRITE in flight any more go out now."""
        ready = [rid for rid in self.notices
                 if not any(p.legs.get(rid) is LegState.POSTED for p in self.publishes.values())]
        return [self.notices.pop(rid) for rid in ready]


class Declined:
    """Transfers a decode daemon declined, remembered for a while (a publish of one fails at once)."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._by_key: OrderedDict[tuple[str, str], tuple[float, str]] = OrderedDict()  # key -> (until, why)

    def remember(self, key: tuple[str, str], until: float, why: str) -> None:
        self._by_key.pop(key, None)
        self._by_key[key] = (until, why)
        while len(self._by_key) > self._limit:  # the oldest are forgotten first
            self._by_key.popitem(last=False)

    def why(self, now: float, key: tuple[str, str]) -> str:
        """Why this transfer was declined, while that is remembered ("" if it was not)."""
        while self._by_key:  # forget what expired (oldest first: insertion order is expiry order)
            first = next(iter(self._by_key))
            if self._by_key[first][0] > now:
                break
            del self._by_key[first]
        got = self._by_key.get(key)
        return got[1] if got is not None else ""


@dataclass(frozen=True, slots=True)
class SendView:
    """What the status API shows of one prefill-side transfer."""

    engine_id: str
    transfer_id: str
    age_s: float
    published_ranks: tuple[int, ...]
    registered_ranks: tuple[int, ...]
    legs_posted: int
    waiting_for: str
    workers: tuple[str, ...]
    num_blocks: int
    peer: str = ""  # the decode daemon it writes to, once known


def view_of(t: SendTransfer, now: float) -> SendView:
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
    return SendView(t.engine_id, t.transfer_id, now - t.created, tuple(sorted(t.publishes)),
                    tuple(sorted(t.registrations)), posted, waiting,
                    tuple(p.worker_id for p in t.publishes.values()),
                    max((len(p.block_ids) for p in t.publishes.values()), default=0),
                    next((p.ledger.peer for p in t.publishes.values() if p.ledger and p.ledger.peer), ""))
