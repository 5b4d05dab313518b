"""A Hypothesis state machine: one prefill node (SendSide) and one decode node (RecvSide) wired by
a simulated network that delivers, fails or drops messages and WRITEs in any order.

Checked, after every step:
- no leg (LegKey) is ever started twice, and no WRITE is started for a gone producer worker;
- each registration id receives at most one notification per producer rank;
- a worker never gets more terminal completions for a transfer than it issued Expects/Publishes,
  and a publish is never reported while one of its WRITEs is still posted;
- the decode side holds exactly the Expects that have neither ended nor been superseded.
At teardown (time far past every timeout, every message delivered, every WRITE completed): every
Expect and Publish ended with exactly one terminal completion (unless its worker went away or a
newer Expect replaced it), and both sides hold no state.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Literal

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvpushd.core.errors import AlreadyExists, InvalidArgument
from kvpushd.core.rendezvous import (
    Action,
    Deliver,
    LegKey,
    RecvSide,
    Registration,
    SendFailNotice,
    SendRegister,
    SendSide,
    SendWithdraw,
    StartWrite,
)
from kvpushd.core.types import CompletionKind, FailureCode

PUB_TO = 20.0
REG_TO = 30.0
EXP_TO = 25.0
ENGINE = "prefill-engine"
ADDR = "prefill:7070"
ORIGIN = "decode-instance"
TIDS = ["a", "b", "c"]
SRC_BLOCKS = [(1, 2), (3, 4), (1, 2, 3)]
DST_BLOCKS = [(7, 8), (9, 10), (7,), (5, 6, 7, 8)]  # the last one is longer than any publish

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


@dataclass
class Notif:
    registration_id: int
    rank: int


Msg = SendRegister | SendWithdraw | SendFailNotice | Notif


class PushPair(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.send = SendSide(PUB_TO, REG_TO)
        self.recv = RecvSide(EXP_TO, first_registration_id=100)
        self.now = 0.0
        self.ptp = self.dtp = 1
        self.net: list[Msg] = []
        self.posted: dict[LegKey, StartWrite] = {}
        self.leg_starts: Counter[LegKey] = Counter()
        self.notifs: Counter[tuple[int, int]] = Counter()
        self.ops: list[Op] = []
        self.issued: Counter[tuple[str, str]] = Counter()  # (worker, tid) -> Expects/Publishes
        self.terminal: Counter[tuple[str, str]] = Counter()  # (worker, tid) -> terminal completions
        self.gen = {"send": [0] * 8, "recv": [0] * 8}
        self.gone: set[str] = set()
        self.registration_ids: set[int] = set()

    # -- helpers --------------------------------------------------------------------------------

    def worker(self, side: Side, rank: int) -> str:
        return f"{'p' if side == 'send' else 'd'}{rank}.{self.gen[side][rank]}"

    def open_op(self, worker: str, tid: str) -> Op | None:
        for op in self.ops:
            if op.worker == worker and op.tid == tid and op.status == "open":
                return op
        return None

    def route(self, actions: list[Action]) -> None:
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
            elif isinstance(a, (SendRegister, SendWithdraw, SendFailNotice)):
                self.net.append(a)
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

    def pick(self, seq: list, i: int):  # type: ignore[no-untyped-def]
        return seq[i % len(seq)]

    def handle(self, m: Msg, lost: bool = False, reply_lost: bool = False) -> None:
        if isinstance(m, SendRegister):
            if not lost:
                reg = Registration(m.registration_id, ORIGIN, m.transfer_id, m.producer_engine_id,
                                   m.producer_tp_size, f"agent-{m.worker_id}", m.consumer_rank,
                                   m.consumer_tp_size, m.block_ids)
                try:
                    self.route(self.send.register(self.now, reg))
                except InvalidArgument as e:  # the runtime: PEER_REJECTED
                    self.route(self.recv.failed(m.registration_id, FailureCode.PEER_REJECTED, str(e)))
                    return
            if lost or reply_lost:  # the runtime: the Register RPC failed
                self.route(self.recv.failed(m.registration_id, FailureCode.PEER_UNREACHABLE, "rpc failed"))
            else:
                self.recv.registered(m.registration_id)
        elif isinstance(m, SendWithdraw):
            if not lost:
                self.route(self.send.withdraw(ORIGIN, m.transfer_id, m.registration_id, m.code, m.reason))
        elif isinstance(m, SendFailNotice):
            assert m.origin == ORIGIN
            if not lost:
                self.route(self.recv.failed(m.registration_id, m.code, m.reason))
        else:
            self.notifs[(m.registration_id, m.rank)] += 1
            assert self.notifs[(m.registration_id, m.rank)] == 1, f"second notification {m}"
            self.route(self.recv.notified(m.registration_id, m.rank))

    def complete(self, leg: LegKey, ok: bool) -> None:
        w = self.posted.pop(leg)
        if ok:
            self.net.append(Notif(w.registration.registration_id, w.producer_rank))
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

    @initialize(ptp=st.sampled_from([1, 2, 4]), dtp=st.sampled_from([1, 2, 4]))
    def topology(self, ptp: int, dtp: int) -> None:
        self.ptp, self.dtp = ptp, dtp

    @rule(rank=st.integers(0, 3), tid=st.sampled_from(TIDS), blocks=st.sampled_from(DST_BLOCKS),
          wrong_ptp=st.sampled_from([False, False, False, True]))
    def expect(self, rank: int, tid: str, blocks: tuple[int, ...], wrong_ptp: bool) -> None:
        rank %= self.dtp
        w = self.worker("recv", rank)
        claimed = self.ptp
        if wrong_ptp:
            claimed = {1: 2, 2: 4, 4: 1}[self.ptp]
        old = self.open_op(w, tid)
        actions = self.recv.expect(self.now, w, rank, self.dtp, tid, blocks, ADDR, ENGINE, claimed)
        if not actions:  # a retried Expect
            assert old is not None and old.blocks == blocks
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
        self.ops.append(Op("recv", w, tid, blocks, rank, sr.registration_id))
        self.issued[(w, tid)] += 1
        self.route(actions)

    @rule(rank=st.integers(0, 3), tid=st.sampled_from(TIDS), blocks=st.sampled_from(SRC_BLOCKS))
    def publish(self, rank: int, tid: str, blocks: tuple[int, ...]) -> None:
        rank %= self.ptp
        w = self.worker("send", rank)
        existed = self.send.has_publish(ENGINE, tid, rank)
        old = self.open_op(w, tid)
        try:
            actions = self.send.publish(self.now, w, ENGINE, rank, self.ptp, tid, blocks)
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

    @precondition(lambda self: any(op.side == "send" and op.status == "open" for op in self.ops))
    @rule(i=st.integers(0, 100))
    def duplicate_publish(self, i: int) -> None:
        op = self.pick([op for op in self.ops if op.side == "send" and op.status == "open"], i)
        assert self.send.has_publish(ENGINE, op.tid, op.rank)
        assert self.send.publish(self.now, op.worker, ENGINE, op.rank, self.ptp, op.tid, op.blocks) == []

    @precondition(lambda self: self.net)
    @rule(i=st.integers(0, 100))
    def deliver_message(self, i: int) -> None:
        self.handle(self.net.pop(i % len(self.net)))

    @precondition(lambda self: any(not isinstance(m, Notif) for m in self.net))
    @rule(i=st.integers(0, 100), reply_lost=st.booleans())
    def drop_message(self, i: int, reply_lost: bool) -> None:
        """Lose a control message (a WRITE's notification is never lost once the WRITE succeeded)."""
        msgs = [m for m in self.net if not isinstance(m, Notif)]
        m = self.pick(msgs, i)
        self.net.remove(m)
        self.handle(m, lost=not reply_lost, reply_lost=reply_lost)

    @precondition(lambda self: self.posted)
    @rule(i=st.integers(0, 100))
    def write_ok(self, i: int) -> None:
        self.complete(self.pick(sorted(self.posted), i), True)

    @precondition(lambda self: self.posted)
    @rule(i=st.integers(0, 100))
    def write_fails(self, i: int) -> None:
        self.complete(self.pick(sorted(self.posted), i), False)

    @rule(rank=st.integers(0, 3), tid=st.sampled_from(TIDS))
    def abort_send(self, rank: int, tid: str) -> None:
        rank %= self.ptp
        w = self.worker("send", rank)
        found, actions = self.send.abort(w, ENGINE, tid)
        if self.open_op(w, tid) is not None:
            assert found
        self.route(actions)

    @rule(rank=st.integers(0, 3), tid=st.sampled_from(TIDS))
    def abort_recv(self, rank: int, tid: str) -> None:
        rank %= self.dtp
        w = self.worker("recv", rank)
        op = self.open_op(w, tid)
        found, actions = self.recv.abort(w, tid)
        assert found == (op is not None)
        self.route(actions)
        assert op is None or op.status == "done"

    @rule(rank=st.integers(0, 3))
    def send_worker_gone(self, rank: int) -> None:
        rank %= self.ptp
        w = self.worker("send", rank)
        actions = self.send.worker_gone(w)
        assert not any(isinstance(a, Deliver) and a.worker_id == w for a in actions)
        self.go("send", rank)
        self.route(actions)

    @rule(rank=st.integers(0, 3))
    def recv_worker_gone(self, rank: int) -> None:
        rank %= self.dtp
        w = self.worker("recv", rank)
        actions = self.recv.worker_gone(w)
        assert not any(isinstance(a, Deliver) for a in actions)
        self.go("recv", rank)
        self.route(actions)

    @rule(dt=st.sampled_from([0.5, 3.0, 10.0, 21.0, 40.0]))
    def advance_time(self, dt: float) -> None:
        self.now += dt
        self.tick()

    # -- invariants -----------------------------------------------------------------------------

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
        open_expects = [op for op in self.ops if op.side == "recv" and op.status == "open"]
        assert len(self.recv) == len(open_expects)
        for op in open_expects:
            assert self.recv.get(op.registration_id) == (op.worker, op.tid)

    @invariant()
    def prefill_side_holds_every_open_publish(self) -> None:
        for op in self.ops:
            if op.side == "send" and op.status == "open":
                assert self.send.has_publish(ENGINE, op.tid, op.rank)

    # -- the end --------------------------------------------------------------------------------

    def teardown(self) -> None:
        for _ in range(100):
            while self.net:
                self.handle(self.net.pop(0))
            while self.posted:
                self.complete(min(self.posted), True)
            if self.net:
                continue
            deadlines = [d for d in (self.send.next_deadline(), self.recv.next_deadline()) if d is not None]
            if not deadlines:
                break
            self.now = max(self.now, min(deadlines))
            self.tick()
        assert not self.net and not self.posted
        assert len(self.send) == 0, [v for v in self.send.views(self.now)]
        assert len(self.recv) == 0, [v for v in self.recv.views(self.now)]
        for op in self.ops:
            assert op.status in ("done", "superseded", "gone"), op
        for key, n in self.terminal.items():
            assert n <= self.issued[key]


PushPair.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPushPair = PushPair.TestCase
