"""A Hypothesis state machine: one prefill node (SendSide) and one decode node (RecvSide) wired by
a simulated network that delivers, fails or drops messages and WRITEs in any order.

Checked, after every step:
- no leg (LegKey) is ever started twice, and no WRITE is started for a gone producer worker;
- each registration id receives at most one notification per producer rank;
- a worker never gets more terminal completions for a transfer than it issued Expects/Publishes,
  and a publish is never reported while one of its WRITEs is still posted;
- the decode side holds exactly the Expects that have neither ended nor been superseded.
At teardown (time first runs far past every timeout with everything still in flight, then every
message is delivered and every WRITE completed): every Expect and Publish ended with exactly one
terminal completion (unless its worker went away or a newer Expect replaced it), and both sides
hold no state.

Pull mode rides along: some Expects are pull registrations, whose legs the prefill side offers
(SendOffer) instead of writing; the decode side READs them (StartRead), and the READ's notification
(or its failure) settles the prefill side's leg. Offers are lost or refused too, READs complete or
fail in any order, and every event goes through the sides' transition tables: an IllegalTransition
anywhere fails the run, and an offer for a push registration must be one that changes nothing.

Topologies: P tp1/2/4 -> D tp1/2/4 (divisible pairs). Transfer ids come from a small pool, so
retries, conflicting re-publishes and re-submitted Expects (new blocks: supersede) all happen; some
Expects claim the wrong producer TP size or more blocks than were published (layout mismatch).
Rare events (aborts, workers going away, a lost connection or a restarted decode daemon) are
bounded per example so that transfers also get through. KVPUSHD_STATEFUL_EXAMPLES=N searches deeper.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from dataclasses import dataclass
from typing import Literal

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from support.core import WorkerRef, deferred, receive_of

from kvpushd.core.actions import (
    Action,
    Deliver,
    Dropped,
    LegKey,
    ReadKey,
    Registration,
    SendFailNotice,
    SendOffer,
    SendReadFailed,
    SendRegister,
    SendWithdraw,
    StartRead,
    StartWrite,
)
from kvpushd.core.errors import AlreadyExists, IllegalTransition, InvalidArgument, KvpushdError, PermissionDenied
from kvpushd.core.recv import RecvSide
from kvpushd.core.send import SendSide
from kvpushd.core.types import CompletionKind, Expect, FailureCode, Publish, TransferMode

PUB_TO = 30.0
REG_TO = 25.0
EXP_TO = 37.0
ENGINE = "prefill-engine"
ADDR = "prefill:7070"
TIDS = ["a", "b"]
SRC_BLOCKS = [(1, 2), (3, 4), (1, 2, 3)]
DST_BLOCKS = [(7, 8), (9, 10), (7,), (8, 9), (5, 6, 7, 8)]  # the last one is longer than any publish

Side = Literal["send", "recv"]


@dataclass
class Op:
    """One Publish or Expect the model issued, and how it ended."""

    side: Side
    worker: str
    tid: str
    blocks: tuple[int, ...]
    rank: int
    registration_id: int = 0  # Expects only
    status: str = "open"  # open, done, superseded, gone
    mode: TransferMode = TransferMode.PUSH


@dataclass
class Notif:
    """A WRITE's notification, on its way to the decode daemon of ``epoch``."""

    registration_id: int
    rank: int
    epoch: int


@dataclass
class FromDecode:
    """A decode daemon's message to the prefill daemon, sent by the daemon of ``epoch``."""

    msg: SendRegister | SendWithdraw
    epoch: int


@dataclass
class Offer:
    """Pull mode: the prefill daemon's offer, on its way to the decode daemon of ``epoch``."""

    offer: SendOffer
    epoch: int


@dataclass
class ReadMsg:
    """Pull mode: the decode daemon of ``epoch`` READ a leg (its notification reaches the prefill
    daemon's agent) or says the READ failed."""

    key: ReadKey
    ok: bool
    epoch: int


@dataclass
class Answer:
    """The prefill daemon's answer to a Register (``failure`` None: accepted), to the decode daemon of ``epoch``."""

    registration_id: int
    failure: FailureCode | None
    epoch: int


Msg = FromDecode | SendFailNotice | Notif | Offer | ReadMsg | Answer


class PushPair(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.send = SendSide(PUB_TO, REG_TO)
        self.recv = RecvSide(EXP_TO, first_registration_id=100)
        self.now = 0.0
        self.ptp = self.dtp = 1
        self.net: list[Msg] = []
        self.posted: dict[LegKey, StartWrite] = {}
        self.completed: list[LegKey] = []  # legs whose WRITE completion was reported
        self.reads: dict[ReadKey, tuple[StartRead, int]] = {}  # READs posted on the decode side, by epoch
        self.leg_starts: Counter[LegKey] = Counter()
        self.notifs: Counter[tuple[int, int]] = Counter()
        self.ops: list[Op] = []
        self.issued: Counter[tuple[str, str]] = Counter()  # (worker, tid) -> Expects/Publishes
        self.terminal: Counter[tuple[str, str]] = Counter()  # (worker, tid) -> terminal completions
        self.gen = {"send": [0] * 8, "recv": [0] * 8}
        self.gone: set[str] = set()
        self.registration_ids: set[int] = set()
        self.epoch = 0  # the decode daemon's incarnation (its instance id is the prefill side's origin)
        self.disruptions: Counter[str] = Counter()  # rare events, bounded so that transfers get through
        # decode completions that ride on a withdrawal, held until no WRITE into it is in flight
        self.held: list[tuple[tuple[str, str], int]] = []
        self.then_done: set[int] = set()

    @property
    def origin(self) -> str:
        return f"decode-{self.epoch}"

    # -- helpers --------------------------------------------------------------------------------

    def worker(self, side: Side, rank: int) -> str:
        return f"{'p' if side == 'send' else 'd'}{rank}.{self.gen[side][rank]}"

    def open_op(self, worker: str, tid: str) -> Op | None:
        for op in self.ops:
            if op.worker == worker and op.tid == tid and op.status == "open":
                return op
        return None

    def riding(self) -> set[int]:
        """Registrations whose decode completion rides on a withdrawal not yet answered."""
        return deferred(self.recv)

    def release_held(self) -> None:
        for held in list(self.held):
            key, rid = held
            if not self.send.writing_into(key, rid):
                self.held.remove(held)
                self._route(self.recv.withdraw_answered(rid))

    def route(self, actions: list[Action]) -> None:
        self._route(actions)
        self.release_held()

    def _route(self, actions: list[Action]) -> None:
        for a in actions:
            if isinstance(a, StartWrite):
                assert a.producer_worker not in self.gone, f"WRITE started for gone worker: {a}"
                assert a.registration.registration_id in self.registration_ids
                assert len(a.src_blocks) == len(a.registration.block_ids)
                self.leg_starts[a.leg] += 1
                assert self.leg_starts[a.leg] == 1, f"leg {a.leg} started twice"
                self.posted[a.leg] = a
            elif isinstance(a, Deliver):
                self.deliver(a)
            elif isinstance(a, (SendRegister, SendWithdraw)):
                self.net.append(FromDecode(a, self.epoch))
            elif isinstance(a, SendFailNotice):
                self.net.append(a)
            elif isinstance(a, SendOffer):
                assert a.producer_worker not in self.gone, f"offer for gone worker: {a}"
                assert a.registration.mode is TransferMode.PULL
                self.leg_starts[a.leg] += 1
                assert self.leg_starts[a.leg] == 1, f"leg {a.leg} offered twice"
                self.net.append(Offer(a, int(a.registration.origin.removeprefix("decode-"))))
            elif isinstance(a, StartRead):
                assert a.key not in self.reads and a.dst_blocks == self.op_of(a.key.registration_id).blocks
                self.reads[a.key] = (a, self.epoch)
            elif isinstance(a, SendReadFailed):
                self.net.append(ReadMsg(a.key, False, self.epoch))
            elif isinstance(a, Dropped):
                self.disruptions["dropped " + a.event] += 0  # late events are legal; nothing to do
            else:  # pragma: no cover
                raise AssertionError(f"unknown action {a!r}")

    def deliver(self, d: Deliver) -> None:
        c = d.completion
        key = (d.worker_id, c.transfer_id)
        if d.worker_id in self.gone:
            return  # the runtime drops completions for a gone worker
        side: Side = "send" if d.worker_id.startswith("p") else "recv"
        if c.kind is CompletionKind.FINISHED_SENDING:
            assert side == "send"
        elif c.kind is CompletionKind.FINISHED_RECEIVING:
            assert side == "recv"
        self.terminal[key] += 1
        op = self.open_op(*key)
        assert op is not None, f"completion without an open Expect/Publish: {d}"
        if c.kind is CompletionKind.FAILED:
            assert c.block_ids == op.blocks, (c, op)
        if side == "send":
            for w in self.posted.values():
                assert not (w.producer_worker == d.worker_id and w.leg.transfer_id == c.transfer_id), (
                    f"publish reported while its WRITE {w.leg} is still posted: {d}")
        op.status = "done"

    def controls(self) -> list[Msg]:
        return [m for m in self.net if not isinstance(m, Notif) and not (isinstance(m, ReadMsg) and m.ok)]

    def op_of(self, registration_id: int) -> Op:
        return next(op for op in self.ops if op.side == "recv" and op.registration_id == registration_id)

    def pick(self, seq: list, i: int):  # type: ignore[no-untyped-def]
        return seq[i % len(seq)]

    def handle(self, msg: Msg, lost: bool = False, reply_lost: bool = False) -> None:
        if isinstance(msg, FromDecode) and msg.epoch != self.epoch:
            return  # from a decode daemon that restarted since: its origin is unknown now
        m = msg.msg if isinstance(msg, FromDecode) else msg
        if isinstance(m, SendRegister):
            if not lost:
                reg = Registration(m.registration_id, self.origin, m.transfer_id, m.producer_engine_id,
                                   m.producer_tp_size, f"agent-{m.worker_id}", m.consumer_rank,
                                   m.consumer_tp_size, m.block_ids, m.mode)
                try:
                    self.route(self.send.register(self.now, reg))
                except InvalidArgument:  # the runtime: PEER_REJECTED
                    self.net.append(Answer(m.registration_id, FailureCode.PEER_REJECTED, self.epoch))
                    return
            # the answer travels back: WRITEs (and offers) into the registration may land before it
            self.net.append(Answer(m.registration_id, FailureCode.PEER_UNREACHABLE if lost or reply_lost else None,
                                   self.epoch))
        elif isinstance(m, Answer):
            if m.epoch != self.epoch:
                return
            if lost or m.failure is not None:  # the runtime: the Register RPC failed, or was refused
                self.route(self.recv.failed(m.registration_id, m.failure or FailureCode.PEER_UNREACHABLE, "rpc"))
            else:
                self.route(self.recv.registered(m.registration_id))
        elif isinstance(m, SendWithdraw):
            key = self.send.transfer_of(self.origin, m.registration_id)
            if not lost:
                self.route(self.send.withdraw(self.origin, m.transfer_id, m.registration_id, m.code, m.reason))
            if m.registration_id not in self.then_done:  # a retried RPC answers once
                self.then_done.add(m.registration_id)
                if lost or key is None:  # the runtime: the RPC failed or nothing was there: answered now
                    self._route(self.recv.withdraw_answered(m.registration_id))
                else:  # the runtime answers once no WRITE into the registration is in flight
                    self.held.append((key, m.registration_id))
                    self.release_held()
        elif isinstance(m, SendFailNotice):
            assert m.origin.startswith("decode-")
            if not lost and m.origin == self.origin:
                self.route(self.recv.failed(m.registration_id, m.code, m.reason))
        elif isinstance(m, Notif):
            self.notifs[(m.registration_id, m.rank)] += 1
            assert self.notifs[(m.registration_id, m.rank)] == 1, f"second notification {m}"
            if m.epoch == self.epoch:
                self.route(self.recv.notified(m.registration_id, m.rank))
        elif isinstance(m, Offer):
            o = m.offer
            rid, rank = o.registration.registration_id, o.producer_rank
            origin = f"decode-{m.epoch}"
            if lost:
                return  # the leg stays offered until the READ is confirmed or publish_timeout_s passes
            if m.epoch != self.epoch:  # that decode daemon restarted: nobody knows the registration
                self.route(self.send.read_done(origin, rid, rank, False, "offer refused: NOT_FOUND"))
                return
            try:
                self.route(self.recv.offer(rid, o.leg.transfer_id, rank, o.src_blocks))
            except IllegalTransition as e:  # pragma: no cover - a pull registration's offer is legal
                raise AssertionError(f"offer for a pull registration refused as illegal: {e}") from e
            except KvpushdError as e:  # the runtime: PEER_REJECTED, no READ started
                self.route(self.send.read_done(origin, rid, rank, False, f"offer refused: {e}"))
        elif isinstance(m, ReadMsg) and not lost:
            self.route(self.send.read_done(f"decode-{m.epoch}", m.key.registration_id, m.key.producer_rank,
                                           m.ok, "" if m.ok else "READ failed"))

    def complete_read(self, key: ReadKey, ok: bool) -> None:
        _, epoch = self.reads.pop(key)
        if epoch != self.epoch:
            return  # its decode daemon restarted: its agent, and the READ, are gone
        if ok:  # the READ's notification reaches the prefill daemon's agent
            self.notifs[(-key.registration_id, key.producer_rank)] += 1
            assert self.notifs[(-key.registration_id, key.producer_rank)] == 1, f"second READ of {key}"
            self.net.append(ReadMsg(key, True, epoch))
        self.route(self.recv.read_done(key, ok, "" if ok else "injected READ failure"))

    def complete(self, leg: LegKey, ok: bool) -> None:
        w = self.posted.pop(leg)
        self.completed.append(leg)
        if ok:
            epoch = int(w.registration.origin.removeprefix("decode-"))
            self.net.append(Notif(w.registration.registration_id, w.producer_rank, epoch))
        self.route(self.send.write_done(leg, ok, "" if ok else "injected WRITE failure"))

    def tick(self) -> None:
        self.route(self.send.tick(self.now) + self.recv.tick(self.now))
        for side in (self.send, self.recv):
            nd = side.next_deadline()
            assert nd is None or nd > self.now, "a due deadline survived tick()"

    def go(self, side: Side, rank: int) -> None:
        w = self.worker(side, rank)
        self.gone.add(w)
        for op in self.ops:
            if op.worker == w and op.status == "open":
                op.status = "gone"
        self.gen[side][rank] += 1

    # -- rules --------------------------------------------------------------------------------

    @initialize(tp=st.sampled_from([(1, 1), (2, 1), (1, 2), (2, 2), (4, 2), (2, 4)]))
    def topology(self, tp: tuple[int, int]) -> None:
        self.ptp, self.dtp = tp

    @rule(rank=st.integers(0, 3), tid=st.sampled_from(TIDS), blocks=st.sampled_from(DST_BLOCKS),
          wrong_ptp=st.sampled_from([False] * 7 + [True]), deliver_now=st.booleans(),
          pull=st.sampled_from([False, False, True]))
    def expect(self, rank: int, tid: str, blocks: tuple[int, ...], wrong_ptp: bool, deliver_now: bool,
               pull: bool) -> None:
        """A decode worker allocated blocks (again, for a re-submitted request: new blocks), to be
        written (push) or read (pull)."""
        mode = TransferMode.PULL if pull else TransferMode.PUSH
        rank %= self.dtp
        w = self.worker("recv", rank)
        claimed = {1: 2, 2: 4, 4: 1}[self.ptp] if wrong_ptp else self.ptp
        old = self.open_op(w, tid)
        if old is not None and old.registration_id in self.riding():
            with pytest.raises(AlreadyExists):  # still ending: the engine waits for its FAILED
                self.recv.expect(self.now, WorkerRef(w, "", rank, self.dtp),
                                 Expect(tid, blocks, ADDR, ENGINE, claimed, transfer_mode=mode))
            return
        actions = self.recv.expect(self.now, WorkerRef(w, "", rank, self.dtp),
                                   Expect(tid, blocks, ADDR, ENGINE, claimed, transfer_mode=mode))
        if not actions:  # a retried Expect
            assert old is not None and old.blocks == blocks and old.mode is mode
            return
        sr = actions[-1]
        assert isinstance(sr, SendRegister)
        if old is not None:
            assert actions[0] == SendWithdraw(ADDR, tid, old.registration_id, FailureCode.SUPERSEDED,
                                              "replaced by a newer Expect")
            old.status = "superseded"
        else:
            assert len(actions) == 1
        assert sr.registration_id not in self.registration_ids
        self.registration_ids.add(sr.registration_id)
        self.ops.append(Op("recv", w, tid, blocks, rank, sr.registration_id, mode=mode))
        self.issued[(w, tid)] += 1
        self.route(actions)
        if deliver_now:  # the Register reaches the prefill daemon before anything else happens
            msg = self.net.pop()
            assert isinstance(msg, FromDecode) and msg.msg == sr
            self.handle(msg)

    @rule(rank=st.integers(0, 3), tid=st.sampled_from(TIDS), blocks=st.sampled_from(SRC_BLOCKS))
    def publish(self, rank: int, tid: str, blocks: tuple[int, ...]) -> None:
        """A prefill worker's blocks are complete (a retry, or a conflicting one, if it published)."""
        rank %= self.ptp
        w = self.worker("send", rank)
        existed = self.send.has_publish(ENGINE, tid, rank)
        old = self.open_op(w, tid)
        try:
            actions = self.send.publish(self.now, WorkerRef(w, ENGINE, rank, self.ptp), Publish(tid, blocks))
        except AlreadyExists:
            assert existed
            assert old is None or old.blocks != blocks
            return
        if existed:  # a retried Publish
            assert old is not None and old.blocks == blocks
            assert actions == []
            return
        assert old is None
        self.ops.append(Op("send", w, tid, blocks, rank))
        self.issued[(w, tid)] += 1
        self.route(actions)

    @precondition(lambda self: self.disruptions["duplicate_publish"] < 3
                  and any(op.side == "send" and op.status == "open" for op in self.ops))
    @rule(i=st.integers(0, 100))
    def duplicate_publish(self, i: int) -> None:
        """A Publish retried while the first is pending: no actions."""
        self.disruptions["duplicate_publish"] += 1
        op = self.pick([op for op in self.ops if op.side == "send" and op.status == "open"], i)
        assert self.send.has_publish(ENGINE, op.tid, op.rank)
        assert self.send.publish(self.now, WorkerRef(op.worker, ENGINE, op.rank, self.ptp),
                                 Publish(op.tid, op.blocks)) == []

    @precondition(lambda self: self.net or self.posted or self.reads)
    @rule()
    def make_progress(self) -> None:
        """The network at its most orderly: the oldest message arrives, else the oldest WRITE (or READ) completes."""
        if self.net:
            self.handle(self.net.pop(0))
        elif self.posted:
            self.complete(min(self.posted), True)
        else:
            self.complete_read(min(self.reads), True)

    @precondition(lambda self: self.net)
    @rule(i=st.integers(0, 100))
    def deliver_message(self, i: int) -> None:
        self.handle(self.net.pop(i % len(self.net)))

    @precondition(lambda self: self.net)
    @rule()
    def deliver_newest(self) -> None:
        """The newest message overtakes the others (a WRITE's notification before the Register's answer)."""
        self.handle(self.net.pop())

    @precondition(lambda self: any(self.controls()))
    @rule(i=st.integers(0, 100), how=st.sampled_from(["lost", "reply_lost", "twice"]))
    def misdeliver_message(self, i: int, how: str) -> None:
        """Lose a control message (a Register: the request or only its reply; an offer; a failed
        READ's report), or deliver one twice (a retried RPC). A successful WRITE's or READ's
        notification is never lost."""
        m = self.pick(self.controls(), i)
        if how == "twice":
            self.handle(m)  # and it stays in flight for another delivery
            return
        self.net.remove(m)
        self.handle(m, lost=how != "reply_lost", reply_lost=how == "reply_lost")

    @precondition(lambda self: self.posted)
    @rule(i=st.integers(0, 100))
    def write_ok(self, i: int) -> None:
        self.complete(self.pick(sorted(self.posted), i), True)

    @precondition(lambda self: self.posted)
    @rule(i=st.integers(0, 100))
    def write_fails(self, i: int) -> None:
        self.complete(self.pick(sorted(self.posted), i), False)

    @precondition(lambda self: self.reads)
    @rule(i=st.integers(0, 100), ok=st.sampled_from([True, True, False]))
    def read_completes(self, i: int, ok: bool) -> None:
        """Pull mode: a READ the decode daemon posted completes, or fails."""
        self.complete_read(self.pick(sorted(self.reads), i), ok)

    @precondition(lambda self: any(op.side == "recv" and op.status == "open" and op.mode is TransferMode.PUSH
                                   for op in self.ops))
    @rule(i=st.integers(0, 100))
    def offer_for_a_push_registration(self, i: int) -> None:
        """A peer offers blocks for a push registration: IllegalTransition, and nothing changes."""
        op = self.pick([op for op in self.ops if op.side == "recv" and op.status == "open"
                        and op.mode is TransferMode.PUSH], i)
        if receive_of(self.recv, op.registration_id) is None:
            return  # ended on the decode side already (its FAILED rides on a withdrawal)
        before = self.recv.views(self.now)
        with pytest.raises(IllegalTransition) as ei:
            self.recv.offer(op.registration_id, op.tid, 0, op.blocks)
        assert ei.value.event == "offer" and ei.value.state.startswith("push ")
        assert self.recv.views(self.now) == before

    @precondition(lambda self: self.completed and self.disruptions["reported_again"] < 3)
    @rule(i=st.integers(0, 100), ok=st.booleans())
    def completion_reported_again(self, i: int, ok: bool) -> None:
        """A WRITE's completion reported a second time: the leg is done or gone, so it is dropped."""
        self.disruptions["reported_again"] += 1
        acts = self.send.write_done(self.pick(self.completed, i), ok, "again")
        assert acts and all(isinstance(a, Dropped) for a in acts), acts

    @precondition(lambda self: self.disruptions["decline"] < 2)
    @rule(tid=st.sampled_from(TIDS))
    def decline(self, tid: str) -> None:
        """The decode daemon declines a transfer (an Expect of it failed before reaching the prefill
        daemon): its publishes fail now, and a later one at once, for publish_timeout_s."""
        self.disruptions["decline"] += 1
        with contextlib.suppress(PermissionDenied):  # another decode daemon's registration holds it
            self.route(self.send.decline(self.now, self.origin, ENGINE, tid, "declined"))

    @precondition(lambda self: self.disruptions["stray"] < 3
                  and any(op.side == "recv" and op.mode is TransferMode.PULL for op in self.ops))
    @rule(i=st.integers(0, 100))
    def stray_notification(self, i: int) -> None:
        """A WRITE notification names a pull registration (live or ended): dropped, nothing lands."""
        self.disruptions["stray"] += 1
        op = self.pick([op for op in self.ops if op.side == "recv" and op.mode is TransferMode.PULL], i)
        acts = self.recv.notified(op.registration_id, 0)
        assert acts and all(isinstance(a, Dropped) for a in acts), acts

    @precondition(lambda self: self.disruptions["shutdown"] < 1)
    @rule(side=st.sampled_from(["send", "recv"]))
    def shutdown(self, side: Side) -> None:
        """A daemon begins to stop: everything it holds fails now (WRITEs in flight settle)."""
        self.disruptions["shutdown"] += 1
        self.route(self.send.shutdown("stopping") if side == "send" else self.recv.shutdown("stopping"))
        if side == "recv":
            assert len(self.recv) == 0

    @precondition(lambda self: self.disruptions["abort"] < 3)
    @rule(side=st.sampled_from(["send", "recv"]), rank=st.integers(0, 3), tid=st.sampled_from(TIDS))
    def abort(self, side: Side, rank: int, tid: str) -> None:
        """The engine cancels a request, on either side."""
        self.disruptions["abort"] += 1
        if side == "send":
            rank %= self.ptp
            w = self.worker("send", rank)
            had = self.open_op(w, tid)
            found, actions = self.send.abort(w, ENGINE, tid)
            if had is not None:
                assert found
        else:
            rank %= self.dtp
            w = self.worker("recv", rank)
            had = self.open_op(w, tid)
            if had is not None and had.registration_id in self.riding():
                had = None  # already ended on the decode side; its FAILED is on its way
            found, actions = self.recv.abort(w, tid)
            assert found == (had is not None)
        self.route(actions)
        if side == "recv":
            assert had is None or had.status == "done" or had.registration_id in self.riding()

    @precondition(lambda self: self.disruptions["worker_gone"] < 2)
    @rule(side=st.sampled_from(["send", "recv"]), rank=st.integers(0, 3))
    def worker_gone(self, side: Side, rank: int) -> None:
        """A worker's session ends, on either side; a new worker (new id) takes its TP rank."""
        self.disruptions["worker_gone"] += 1
        rank %= self.ptp if side == "send" else self.dtp
        w = self.worker(side, rank)
        actions = self.send.worker_gone(w) if side == "send" else self.recv.worker_gone(w)
        assert not any(isinstance(a, Deliver) and a.worker_id == w for a in actions)
        if side == "recv":
            assert not any(isinstance(a, Deliver) for a in actions)
        self.go(side, rank)
        self.route(actions)

    @precondition(lambda self: self.disruptions["peer_lost"] < 1)
    @rule(what=st.sampled_from(["connection_to_prefill", "decode_daemon_restart"]))
    def peer_lost(self, what: str) -> None:
        """The decode daemon's connection to the prefill daemon breaks (its pending Expects fail), or
        the decode daemon restarts as a new instance (its workers and records are gone, and the
        prefill daemon learns it through origin_lost)."""
        self.disruptions["peer_lost"] += 1
        if what == "connection_to_prefill":
            actions = self.recv.producer_lost(ADDR, FailureCode.PEER_UNREACHABLE, "connection reset")
            assert all(isinstance(a, Deliver) and a.completion.code is FailureCode.PEER_UNREACHABLE
                       for a in actions)
            self.route(actions)
            assert len(self.recv) == 0
            return
        old = self.origin
        for rank in range(self.dtp):
            self.go("recv", rank)
        self.epoch += 1
        self.recv = RecvSide(EXP_TO, first_registration_id=100 + 10_000 * self.epoch)
        actions = self.send.origin_lost(old, "decode daemon restarted")
        assert not any(isinstance(a, SendFailNotice) for a in actions)
        self.route(actions)

    @rule(dt=st.sampled_from([0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 60.0]))  # 60: a stall past every timeout
    def advance_time(self, dt: float) -> None:
        self.now += dt
        self.tick()

    # -- invariants -----------------------------------------------------------------------------

    @invariant()
    def holds_answers_as_origins(self) -> None:  # the handshake's O(1) question, against the whole set
        busy = self.send.origins()
        assert all(self.send.holds(o) for o in busy) and not self.send.holds("nobody")
        assert self.send.holds(self.origin) == (self.origin in busy)

    @invariant()
    def legs_started_at_most_once(self) -> None:
        assert all(n == 1 for n in self.leg_starts.values())

    @invariant()
    def one_notification_per_registration_and_rank(self) -> None:
        assert all(n == 1 for n in self.notifs.values())

    @invariant()
    def completions_bounded_by_requests(self) -> None:
        for key, n in self.terminal.items():
            assert n <= self.issued[key], key
        for op in self.ops:
            if op.status == "done":
                assert self.terminal[(op.worker, op.tid)] >= 1

    @invariant()
    def decode_side_holds_exactly_the_open_expects(self) -> None:
        # an Expect that ended on the decode side (abort, timeout) is still open until the FAILED
        # riding on its withdrawal is delivered: the withdrawal in flight, or held for a WRITE
        riding = self.riding()
        open_expects = [op for op in self.ops if op.side == "recv" and op.status == "open"
                        and op.registration_id not in riding]
        assert len(self.recv) == len(open_expects)
        for op in open_expects:
            assert receive_of(self.recv, op.registration_id) == (op.worker, op.tid)

    @invariant()
    def prefill_side_holds_every_open_publish(self) -> None:
        for op in self.ops:
            if op.side == "send" and op.status == "open":
                assert self.send.has_publish(ENGINE, op.tid, op.rank)

    # -- the end --------------------------------------------------------------------------------

    def teardown(self) -> None:
        # Time first runs far past every timeout while messages and WRITEs are still in flight (what
        # is progressing must survive that, and must still end once its progress stops); then
        # everything is delivered and completed, with time following the deadlines that remain.
        self.now += 10 * max(PUB_TO, REG_TO, EXP_TO)
        self.tick()
        for _ in range(100):
            while self.net:
                self.handle(self.net.pop(0))
            while self.posted:
                self.complete(min(self.posted), True)
            while self.reads:
                self.complete_read(min(self.reads), True)
            if self.net:
                continue
            deadlines = [d for d in (self.send.next_deadline(), self.recv.next_deadline()) if d is not None]
            if not deadlines:
                break
            self.now = max(self.now, min(deadlines))
            self.tick()
        assert not self.net and not self.posted and not self.held and not self.reads
        assert len(self.send) == 0, [v for v in self.send.views(self.now)]
        assert len(self.recv) == 0, [v for v in self.recv.views(self.now)]
        for op in self.ops:
            assert op.status in ("done", "superseded", "gone"), op
        for key, n in self.terminal.items():
            assert n <= self.issued[key]


# KVPUSHD_STATEFUL_EXAMPLES=5000 for a deeper (slower) search.
PushPair.TestCase.settings = settings(
    max_examples=int(os.environ.get("KVPUSHD_STATEFUL_EXAMPLES", "200")),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPushPair = PushPair.TestCase
