"""The prefill side of the rendezvous: publishes x registrations -> legs (see rendezvous.py)."""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import cast

from . import notif
from .actions import (
    Action,
    Deliver,
    Dropped,
    LegKey,
    Registration,
    SendFailNotice,
    SendOffer,
    StartWrite,
)
from .deadlines import Deadlines
from .errors import AlreadyExists, InvalidArgument, PermissionDenied
from .layout import Shape, needs_plan, sizes_differ
from .table import Move, step
from .topology import block_parts, check_tp_pair, consumer_targets, skips_replicated, writer_sources, writer_targets
from .types import Completion, CompletionKind, FailureCode, TransferMode

MAX_DECLINED = 65536  # transfers remembered as declined (the oldest are forgotten first)


class LegState(enum.Enum):
    POSTED = "posted"
    DONE = "done"


LEG_TABLE: dict[tuple[LegState | None, str], Move] = {
    (LegState.POSTED, "write_done"): Move.APPLY,  # -> DONE, or removed and the publish fails
    (LegState.DONE, "write_done"): Move.DROP,     # a second completion of the same leg
    (None, "write_done"): Move.DROP,              # the leg's transfer ended while it was in flight
}


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
    leg_ranks: dict[int, int] = field(default_factory=dict)  # registration id -> its consumer rank
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
    # consumer rank -> the decode daemon (origin) that registered it: only it may replace it
    rank_origin: dict[int, str] = field(default_factory=dict)
    # failure notices held until no WRITE into their registration is in flight (reg id -> notice):
    # a decode engine told FAILED frees its blocks, so it must not be told while bytes may land
    notices: dict[int, SendFailNotice] = field(default_factory=dict)


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
        self._deadlines = Deadlines()
        self._valid: dict[object, float] = {}
        # Pull legs offered and not yet settled: (origin, reg id, producer rank) <-> leg
        self._pulls: dict[tuple[str, int, int], LegKey] = {}
        self._pull_of: dict[LegKey, tuple[str, int, int]] = {}
        self._now = 0.0  # the latest time an event brought (for legs started by a completion)
        # per decode daemon: destination blocks and registrations it holds here (its quota)
        self._held: dict[str, int] = {}
        self._regs: dict[str, int] = {}
        # transfers a decode daemon declined: key -> (until, why); a publish of one fails at once
        self._declined: OrderedDict[tuple[str, str], tuple[float, str]] = OrderedDict()

    # -- queries ------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._transfers)

    def next_deadline(self) -> float | None:
        return self._deadlines.next(self._valid)

    def origins(self) -> set[str]:
        """Decode daemons that hold registrations here, or owe us a READ (they must keep sending heartbeats)."""
        return {r.origin for t in self._transfers.values() for r in t.registrations.values()} | {
            pk[0] for pk in self._pulls}

    def held_by(self, origin: str) -> tuple[int, int]:
        """(registrations, destination blocks) the decode daemon ``origin`` holds here."""
        return self._regs.get(origin, 0), self._held.get(origin, 0)

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
            why = self._was_declined(now, key)
            if why:
                return [Deliver(worker_id, Completion(CompletionKind.FAILED, transfer_id, FailureCode.ABORTED,
                                                      why, blocks))]
            t = self._transfers[key] = _SendTransfer(engine_id, transfer_id, now)
        old = t.publishes.get(rank)
        if old is not None:
            if old.block_ids == blocks and old.worker_id == worker_id:
                return []  # a retried Publish: idempotent
            raise AlreadyExists(
                f"transfer {transfer_id!r} is already published by engine {engine_id!r} rank "
                f"{rank} with other blocks; abort it first"
            )
        self._now = max(self._now, now)
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
        holder = t.rank_origin.get(reg.consumer_rank)
        if holder is not None and holder != reg.origin:
            raise PermissionDenied(f"transfer {reg.transfer_id[:256]!r}: consumer rank {reg.consumer_rank} is "
                                   "registered by another decode daemon; only that daemon may replace it",
                                   transfer_id=reg.transfer_id)
        self._now = max(self._now, now)
        actions: list[Action] = []
        old = t.registrations.get(reg.consumer_rank)
        if old is not None:
            # A re-submitted (e.g. preempted and re-allocated) decode request replaces its old
            # registration, and its daemon hears so; writes already posted into the old blocks
            # settle on their own (the new one is written once they have: one WRITE in flight
            # per publish and consumer rank).
            actions += self._drop_registration(t, old, (FailureCode.SUPERSEDED, "replaced by a newer registration"))
        t.rank_origin[reg.consumer_rank] = reg.origin
        self._held[reg.origin] = self._held.get(reg.origin, 0) + len(reg.block_ids)
        self._regs[reg.origin] = self._regs.get(reg.origin, 0) + 1
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
        actions += self._release_notices(t)
        # A WRITE held back for this rank (a replacement registration) may start now.
        actions += self._match(t, self._now)
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

    def decline(self, now: float, origin: str, engine_id: str, transfer_id: str, reason: str) -> list[Action]:
        """The decode daemon ``origin`` says it will never register this transfer (its worker's Expect
        failed before reaching it). Its publishes fail now (ABORTED: the consumer gave up), and one
        published later fails at once, for publish_timeout_s. Only ranks ``origin`` registered (or
        none) may be declined by it: another decode daemon's registration is not its to end."""
        if not transfer_id:
            raise InvalidArgument("transfer_id must not be empty")
        key = (engine_id, transfer_id)
        t = self._transfers.get(key)
        if t is not None and any(o != origin for o in t.rank_origin.values()):
            raise PermissionDenied(f"transfer {transfer_id[:256]!r} is registered by another decode daemon; "
                                   "only that daemon may end it", transfer_id=transfer_id)
        self._now = max(self._now, now)
        msg = f"the decode side declined transfer {transfer_id[:256]!r}: {reason[:1000]}"
        self._declined.pop(key, None)
        self._declined[key] = (now + self.publish_timeout_s, msg)
        while len(self._declined) > MAX_DECLINED:
            self._declined.popitem(last=False)
        if t is None:
            return []
        actions: list[Action] = []
        for reg in list(t.registrations.values()):
            actions += self._drop_registration(t, reg, (FailureCode.ABORTED, msg))
        for pub in t.publishes.values():
            self._fail_publish(t, pub, FailureCode.ABORTED, msg)
        return actions + self._settle(t)

    def _was_declined(self, now: float, key: tuple[str, str]) -> str:
        """Why this transfer was declined, while that is remembered ("" if it was not)."""
        while self._declined:  # forget what expired (oldest first: insertion order is expiry order)
            first = next(iter(self._declined))
            if self._declined[first][0] > now:
                break
            del self._declined[first]
        got = self._declined.get(key)
        return got[1] if got is not None else ""

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
            for rank in [k for k, o in t.rank_origin.items() if o == origin]:
                del t.rank_origin[rank]
            for rid in [k for k, n in t.notices.items() if n.origin == origin]:
                del t.notices[rid]  # nobody to tell
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

    def give_up(self, reason: str) -> list[Action]:
        """The daemon stops past its drain bound: every leg still in flight (a WRITE that was
        cancelled, a READ never confirmed) ends in failure, so every publish gets its completion."""
        actions: list[Action] = []
        for t in list(self._transfers.values()):
            for pub in list(t.publishes.values()):
                for rid in [r for r, st in pub.legs.items() if st is LegState.POSTED]:
                    actions += self.write_done(LegKey(t.engine_id, t.transfer_id, pub.rank, rid), False, reason)
        return actions

    def tick(self, now: float) -> list[Action]:
        """Expire publishes and registrations whose deadline passed without progress."""
        self._now = max(self._now, now)
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
                if any(pub.leg_ranks.get(rid) == reg.consumer_rank for rid, st in pub.legs.items()
                       if st is LegState.POSTED):
                    continue  # one WRITE in flight per publish and consumer rank: this one follows it
                by_tokens = reg.by_tokens or reg.skip_tokens > 0 or sizes_differ(pub.layouts, reg.layouts)
                problem = self._mismatch(pub, reg, by_tokens)
                if problem:
                    actions += self._drop_registration(t, reg, (FailureCode.LAYOUT_MISMATCH, problem))
                    actions += self._fail_targets(t, pub, FailureCode.LAYOUT_MISMATCH, problem)
                    self._fail_publish(t, pub, FailureCode.LAYOUT_MISMATCH, problem)
                    break
                pub.legs[reg.registration_id] = LegState.POSTED
                pub.leg_ranks[reg.registration_id] = reg.consumer_rank
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
            t.notices[reg.registration_id] = SendFailNotice(reg.origin, t.transfer_id, reg.registration_id, *notice)
            actions += self._release_notices(t)
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

    def _release_notices(self, t: _SendTransfer) -> list[Action]:
        """Failure notices whose registration has no WRITE in flight any more go out now."""
        ready = [rid for rid in t.notices
                 if not any(p.legs.get(rid) is LegState.POSTED for p in t.publishes.values())]
        return [t.notices.pop(rid) for rid in ready]

    def _consume(self, t: _SendTransfer, reg: Registration) -> None:
        """Forget a registration's blocks (written, or dropped); its id stays in reg_ids."""
        if t.registrations.get(reg.consumer_rank) is reg:
            del t.registrations[reg.consumer_rank]
            for table, n in ((self._held, len(reg.block_ids)), (self._regs, 1)):
                left = table.get(reg.origin, 0) - n
                if left > 0:
                    table[reg.origin] = left
                else:
                    table.pop(reg.origin, None)
        self._valid.pop(("reg", (t.engine_id, t.transfer_id), reg.consumer_rank), None)
        self._by_reg.pop((reg.origin, reg.registration_id), None)
