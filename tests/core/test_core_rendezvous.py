"""Table-driven tests of the pure rendezvous state machines (kvpushd/core/send.py, recv.py).

SendSide (prefill node) and RecvSide (decode node) are driven directly; time is an argument, so
every deadline is exact. Each scenario ends by checking that neither side holds state any more.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import pytest
from support.core import WorkerRef, receive_of

from kvpushd.core.actions import (
    Action,
    Deliver,
    Dropped,
    LegKey,
    Registration,
    SendFailNotice,
    SendRegister,
    SendWithdraw,
    StartWrite,
)
from kvpushd.core.errors import AlreadyExists, InvalidArgument, PermissionDenied
from kvpushd.core.recv import RecvSide
from kvpushd.core.send import SendSide
from kvpushd.core.topology import consumer_targets, producer_sources
from kvpushd.core.types import Completion, CompletionKind, Expect, FailureCode, Publish

T0 = 1000.0
PUB_TO = 30.0
REG_TO = 20.0
EXP_TO = 40.0
ENGINE = "prefill-engine"
ADDR = "prefill-node:7070"
ORIGIN = "decode-instance"
TID = "req-1"
SRC = (11, 12, 13)
DST = (21, 22, 23)

A = TypeVar("A")


def of(actions: Iterable[Action], cls: type[A]) -> list[A]:
    return [a for a in actions if isinstance(a, cls)]


def finished_sending(tid: str = TID) -> Completion:
    return Completion(CompletionKind.FINISHED_SENDING, tid)


def finished_receiving(tid: str = TID) -> Completion:
    return Completion(CompletionKind.FINISHED_RECEIVING, tid)


def pw(rank: int) -> str:
    return f"pw{rank}"


def dw(rank: int) -> str:
    return f"dw{rank}"


def new_send() -> SendSide:
    return SendSide(PUB_TO, REG_TO)


def new_recv(first_id: int = 1) -> RecvSide:
    return RecvSide(EXP_TO, first_registration_id=first_id)


def reg(rid: int, crank: int = 0, ctp: int = 1, ptp: int = 1, blocks: Sequence[int] = DST, tid: str = TID,
        origin: str = ORIGIN) -> Registration:
    return Registration(rid, origin, tid, ENGINE, ptp, f"agent-{crank}", crank, ctp, tuple(blocks))


def publish(s: SendSide, now: float = T0, rank: int = 0, tp: int = 1, blocks: Sequence[int] = SRC,
            tid: str = TID, worker: str | None = None) -> list[Action]:
    return s.publish(now, WorkerRef(worker or pw(rank), ENGINE, rank, tp), Publish(tid, blocks))


def expect(r: RecvSide, now: float = T0, rank: int = 0, tp: int = 1, ptp: int = 1, blocks: Sequence[int] = DST,
           tid: str = TID, worker: str | None = None, addr: str = ADDR) -> list[Action]:
    return r.expect(now, WorkerRef(worker or dw(rank), "", rank, tp), Expect(tid, blocks, addr, ENGINE, ptp))


def to_registration(a: SendRegister, origin: str = ORIGIN) -> Registration:
    return Registration(a.registration_id, origin, a.transfer_id, a.producer_engine_id, a.producer_tp_size,
                        f"agent-{a.worker_id}", a.consumer_rank, a.consumer_tp_size, a.block_ids)


def expand(actions: Sequence[Action], recv: RecvSide) -> list[Action]:
    """Actions with each withdrawal's deferred completion (``withdraw_answered``) after it."""
    out: list[Action] = []
    for a in actions:
        out.append(a)
        if isinstance(a, SendWithdraw):
            out += recv.withdraw_answered(a.registration_id)
    return out


def ignored(actions: Sequence[Action]) -> bool:
    """A late or repeated event: dropped on purpose (reported as Dropped), nothing else happens."""
    return bool(actions) and all(isinstance(a, Dropped) for a in actions)


def one(actions: Sequence[Action], cls: type[A]) -> A:
    assert len(actions) == 1, actions
    (a,) = actions
    assert isinstance(a, cls), a
    return a


def assert_empty(*sides: SendSide | RecvSide) -> None:
    for side in sides:
        assert len(side) == 0
        assert side.next_deadline() is None
        assert side.views(T0) == []


def failed(d: Deliver, code: FailureCode, blocks: Sequence[int]) -> None:
    assert d.completion.kind is CompletionKind.FAILED, d
    assert d.completion.code is code, d
    assert d.completion.block_ids == tuple(blocks)
    assert d.completion.reason


# --------------------------------------------------------------------------------------------
# An end-to-end harness: one prefill node and one decode node, messages routed synchronously.


@dataclass
class Net:
    ptp: int
    dtp: int
    send: SendSide = field(default_factory=new_send)
    recv: RecvSide = field(default_factory=new_recv)
    posted: dict[LegKey, StartWrite] = field(default_factory=dict)
    started: list[LegKey] = field(default_factory=list)
    delivered: list[Deliver] = field(default_factory=list)
    notices: list[SendFailNotice] = field(default_factory=list)
    withdraws: list[SendWithdraw] = field(default_factory=list)
    held: list[tuple[tuple[str, str] | None, int]] = field(default_factory=list)
    now: float = T0

    def run(self, actions: Iterable[Action]) -> None:
        for a in actions:
            if isinstance(a, StartWrite):
                assert a.leg not in self.started, f"leg {a.leg} written twice"
                self.started.append(a.leg)
                self.posted[a.leg] = a
            elif isinstance(a, Deliver):
                self.delivered.append(a)
            elif isinstance(a, SendRegister):
                self.run(self.send.register(self.now, to_registration(a)))
                self.recv.registered(a.registration_id)
            elif isinstance(a, SendFailNotice):
                self.notices.append(a)
                self.run(self.recv.failed(a.registration_id, a.code, a.reason))
            elif isinstance(a, SendWithdraw):
                self.withdraws.append(a)
                key = self.send.transfer_of(ORIGIN, a.registration_id)
                self.run(self.send.withdraw(ORIGIN, a.transfer_id, a.registration_id, a.code, a.reason))
                self.held.append((key, a.registration_id))  # answered once no WRITE into it is in flight
        for held in list(self.held):
            key, rid = held
            if key is None or not self.send.writing_into(key, rid):
                self.held.remove(held)
                self.run(self.recv.withdraw_answered(rid))

    def expect(self, rank: int, blocks: Sequence[int] = DST, tid: str = TID) -> None:
        self.run(expect(self.recv, self.now, rank, self.dtp, self.ptp, blocks, tid))

    def publish(self, rank: int, blocks: Sequence[int] = SRC, tid: str = TID) -> None:
        self.run(publish(self.send, self.now, rank, self.ptp, blocks, tid))

    def complete(self, leg: LegKey, ok: bool = True) -> None:
        w = self.posted.pop(leg)
        self.run(self.send.write_done(leg, ok, "" if ok else "injected failure"))
        if ok:  # the notification rides on the WRITE
            self.run(self.recv.notified(w.registration.registration_id, w.producer_rank))

    def take(self) -> list[Deliver]:
        out, self.delivered = self.delivered, []
        return out


TP_PAIRS = [(1, 1), (2, 2), (2, 1), (4, 1), (4, 2), (8, 2), (1, 2), (1, 4), (2, 4), (2, 8)]


@pytest.mark.parametrize("order", ["publish_first", "expect_first", "interleaved"])
@pytest.mark.parametrize(("ptp", "dtp"), TP_PAIRS)
def test_end_to_end_heterogeneous_tp(ptp: int, dtp: int, order: str) -> None:
    n = Net(ptp, dtp)
    steps: list[tuple[str, int]]
    pubs = [("publish", p) for p in range(ptp)]
    exps = [("expect", c) for c in range(dtp)]
    if order == "publish_first":
        steps = pubs + exps
    elif order == "expect_first":
        steps = exps + pubs
    else:
        rev = pubs[::-1]  # alternate, the last producer rank first
        steps = [s for i in range(max(ptp, dtp)) for s in (rev[i:i + 1] + exps[i:i + 1])]
    for kind, rank in steps:
        if kind == "publish":
            n.publish(rank)
        else:
            n.expect(rank)
    # one WRITE per (producer, consumer) edge, each started exactly once
    assert len(n.started) == len(set(n.started)) == max(ptp, dtp)
    assert {(k.producer_rank, n.posted[k].registration.consumer_rank) for k in n.started} == {
        (p, c) for p in range(ptp) for c in consumer_targets(p, ptp, dtp)}
    for w in n.posted.values():
        assert w.src_blocks == SRC
        assert w.registration.block_ids == DST
        assert w.producer_worker == pw(w.producer_rank)
        assert w.producer_tp_size == ptp
    assert n.take() == []
    assert n.send.next_deadline() is not None  # progressing publishes keep their (harmless) deadline

    legs_left = {p: len(consumer_targets(p, ptp, dtp)) for p in range(ptp)}
    lands_left = {c: len(producer_sources(c, ptp, dtp)) for c in range(dtp)}
    for leg in sorted(n.posted, key=lambda k: (-k.producer_rank, k.registration_id)):
        crank = n.posted[leg].registration.consumer_rank
        n.complete(leg)
        legs_left[leg.producer_rank] -= 1
        lands_left[crank] -= 1
        expected = []
        if legs_left[leg.producer_rank] == 0:
            expected.append(Deliver(pw(leg.producer_rank), finished_sending()))
        if lands_left[crank] == 0:
            expected.append(Deliver(dw(crank), finished_receiving()))
        assert n.take() == expected
    assert n.notices == [] and n.withdraws == []
    assert n.recv.stray_notifications == 0
    assert_empty(n.send, n.recv)


# --------------------------------------------------------------------------------------------
# SendSide: the basic rendezvous


@pytest.mark.parametrize("order", ["publish_first", "register_first"])
def test_both_arrival_orders_start_exactly_one_write(order: str) -> None:
    s = new_send()
    if order == "publish_first":
        assert publish(s, T0) == []
        actions = s.register(T0 + 1, reg(7))
    else:
        assert s.register(T0, reg(7)) == []
        actions = publish(s, T0 + 1)
    w = one(actions, StartWrite)
    assert w.leg == LegKey(ENGINE, TID, 0, 7)
    assert w.producer_worker == pw(0)
    assert (w.producer_rank, w.producer_tp_size) == (0, 1)
    assert w.src_blocks == SRC
    assert w.registration == reg(7)
    assert len(s) == 1
    # repeating either side's message changes nothing
    assert publish(s, T0 + 2) == []
    assert s.register(T0 + 2, reg(7)) == []
    assert s.write_done(w.leg, True) == [Deliver(pw(0), finished_sending())]
    assert_empty(s)
    # a late or duplicate report for the settled leg is ignored
    assert ignored(s.write_done(w.leg, True))
    assert ignored(s.write_done(w.leg, False, "late"))
    assert_empty(s)


def test_recv_side_counts_one_notification_per_producer_rank() -> None:
    r = new_recv(first_id=50)
    sr = one(expect(r, T0, rank=0, tp=1, ptp=2), SendRegister)
    assert sr == SendRegister(ADDR, 50, dw(0), TID, ENGINE, 2, 0, 1, DST)
    assert receive_of(r, 50) == (dw(0), TID)
    assert r.registered(50) == []
    assert r.notified(50, 0) == []
    assert r.notified(50, 0) == []  # a duplicate notification counts once
    assert ignored(r.notified(50, 7))  # not a producer rank of ours: stray
    assert r.stray_notifications == 1
    assert r.notified(50, 1) == [Deliver(dw(0), finished_receiving())]
    assert ignored(r.notified(50, 1))
    assert r.stray_notifications == 2
    assert receive_of(r, 50) is None
    assert_empty(r)


def test_one_publish_writes_two_registrations() -> None:
    """P tp1 -> D tp2: the producer's blocks go to both consumer ranks; finished after both legs."""
    s = new_send()
    assert publish(s, T0) == []
    w0 = one(s.register(T0, reg(1, crank=0, ctp=2)), StartWrite)
    assert s.write_done(w0.leg, True) == []  # consumer rank 1 not written yet
    assert len(s) == 1
    w1 = one(s.register(T0 + 1, reg(2, crank=1, ctp=2)), StartWrite)
    assert (w0.leg.registration_id, w1.leg.registration_id) == (1, 2)
    assert w0.src_blocks == w1.src_blocks == SRC
    assert s.write_done(w1.leg, True) == [Deliver(pw(0), finished_sending())]
    assert_empty(s)


@pytest.mark.parametrize("done_order", [(0, 1), (1, 0)])
def test_two_producers_write_one_registration(done_order: tuple[int, int]) -> None:
    """P tp2 -> D tp1: one registration receives two legs; each publish finishes on its own leg."""
    s = new_send()
    assert s.register(T0, reg(9, ptp=2)) == []
    legs = {}
    for p in (0, 1):
        legs[p] = one(publish(s, T0, rank=p, tp=2), StartWrite).leg
    assert legs[0] != legs[1]
    first, second = done_order
    assert s.write_done(legs[first], True) == [Deliver(pw(first), finished_sending())]
    assert len(s) == 1
    assert s.write_done(legs[second], True) == [Deliver(pw(second), finished_sending())]
    assert_empty(s)


# --------------------------------------------------------------------------------------------
# WRITE failures


def test_write_failure_fails_publish_and_notifies_origin() -> None:
    s = new_send()
    publish(s, T0)
    w = one(s.register(T0, reg(3)), StartWrite)
    actions = s.write_done(w.leg, False, "NIXL_ERR_BACKEND")
    notice = one(of(actions, SendFailNotice), SendFailNotice)
    assert (notice.origin, notice.transfer_id, notice.registration_id, notice.code) == (
        ORIGIN, TID, 3, FailureCode.TRANSFER_ERROR)
    assert "NIXL_ERR_BACKEND" in notice.reason
    d = one(of(actions, Deliver), Deliver)
    assert d.worker_id == pw(0)
    failed(d, FailureCode.TRANSFER_ERROR, SRC)
    assert len(actions) == 2
    assert_empty(s)


@pytest.mark.parametrize("second_ok", [True, False])
@pytest.mark.parametrize("first_failing", [0, 1])
def test_failed_not_delivered_while_another_leg_is_posted(first_failing: int, second_ok: bool) -> None:
    """P tp1 -> D tp2: one leg fails while the other is in flight; FAILED waits for it."""
    s = new_send()
    publish(s, T0)
    legs = [one(s.register(T0, reg(c + 1, crank=c, ctp=2)), StartWrite).leg for c in (0, 1)]
    assert legs == [LegKey(ENGINE, TID, 0, 1), LegKey(ENGINE, TID, 0, 2)]
    bad, other = legs[first_failing], legs[1 - first_failing]
    actions = s.write_done(bad, False, "boom")
    assert of(actions, Deliver) == []  # the other WRITE may still read the source blocks
    assert one(actions, SendFailNotice).registration_id == bad.registration_id
    actions = s.write_done(other, second_ok, "" if second_ok else "boom too")
    d = one(of(actions, Deliver), Deliver)
    failed(d, FailureCode.TRANSFER_ERROR, SRC)
    notices = of(actions, SendFailNotice)
    assert [n.registration_id for n in notices] == ([] if second_ok else [other.registration_id])
    assert_empty(s)


def test_failed_leg_of_co_writer_does_not_strand_the_other_publish() -> None:
    """P tp2 -> D tp1: rank 0's WRITE fails after both publishes' deadlines passed while they were
    progressing; rank 1's WRITE then succeeds into the now void registration. Rank 1's publish must
    still end (it used to be kept forever: no deadline left, no registration to finish on)."""
    s = new_send()
    publish(s, T0, rank=0, tp=2)
    publish(s, T0, rank=1, tp=2)
    w0, w1 = of(s.register(T0 + 1, reg(4, ptp=2)), StartWrite)
    assert s.tick(T0 + PUB_TO + REG_TO) == []  # every leg started: nothing expires
    actions = s.write_done(w0.leg, False, "boom")
    # the decode daemon hears of it only once rank 1's WRITE into the same blocks has settled
    assert of(actions, SendFailNotice) == []
    failed(one(of(actions, Deliver), Deliver), FailureCode.TRANSFER_ERROR, SRC)
    actions = s.write_done(w1.leg, True)
    assert one(of(actions, SendFailNotice), SendFailNotice).registration_id == 4
    assert len(s) == 1
    deadline = s.next_deadline()
    assert deadline is not None
    actions = s.tick(deadline)
    d = one(actions, Deliver)
    assert d.worker_id == pw(1)
    assert d.completion.kind is CompletionKind.FAILED
    assert_empty(s)


# --------------------------------------------------------------------------------------------
# Timeouts


def test_publish_timeout_without_registration() -> None:
    s = new_send()
    publish(s, T0)
    assert s.next_deadline() == T0 + PUB_TO
    assert s.tick(T0 + PUB_TO - 0.001) == []
    d = one(s.tick(T0 + PUB_TO), Deliver)
    assert d.worker_id == pw(0)
    failed(d, FailureCode.TIMEOUT, SRC)
    assert_empty(s)
    assert s.tick(T0 + 10 * PUB_TO) == []


def test_publish_timeout_fails_partial_targets_and_waits_for_posted_legs() -> None:
    """P tp1 -> D tp2 with only consumer rank 0 registered: the WRITE in flight to rank 0 holds the
    publish's lease past its deadline (rank 0 must not be told to free blocks a WRITE is landing in);
    once it is done, the publish expires for the missing rank 1 and fails with TIMEOUT."""
    s = new_send()
    publish(s, T0)
    w = one(s.register(T0 + 1, reg(1, crank=0, ctp=2)), StartWrite)
    assert s.tick(T0 + PUB_TO) == []
    assert s.write_done(w.leg, True) == []
    d = one(s.tick(T0 + 3 * PUB_TO), Deliver)
    failed(d, FailureCode.TIMEOUT, SRC)
    assert_empty(s)


def test_publish_timeout_after_one_target_was_written() -> None:
    s = new_send()
    publish(s, T0)
    w = one(s.register(T0, reg(1, crank=0, ctp=2)), StartWrite)
    assert s.write_done(w.leg, True) == []
    d = one(s.tick(T0 + PUB_TO), Deliver)  # consumer rank 1 never registered
    failed(d, FailureCode.TIMEOUT, SRC)
    assert_empty(s)


def test_registration_timeout() -> None:
    s = new_send()
    assert s.register(T0, reg(5)) == []
    assert s.next_deadline() == T0 + REG_TO
    assert s.tick(T0 + REG_TO - 0.5) == []
    notice = one(s.tick(T0 + REG_TO), SendFailNotice)
    assert notice == SendFailNotice(ORIGIN, TID, 5, FailureCode.TIMEOUT, notice.reason)
    assert_empty(s)


@pytest.mark.parametrize(("ptp", "dtp"), [(1, 1), (2, 1), (1, 2)])
def test_publish_with_all_legs_started_does_not_expire(ptp: int, dtp: int) -> None:
    s = new_send()
    for c in range(dtp):
        s.register(T0, reg(c + 1, crank=c, ctp=dtp, ptp=ptp))
    legs = [w.leg for p in range(ptp) for w in of(publish(s, T0, rank=p, tp=ptp), StartWrite)]
    assert len(legs) == max(ptp, dtp)
    for now in (T0 + PUB_TO, T0 + 10 * PUB_TO, T0 + 100 * PUB_TO):
        assert s.tick(now) == []
    done: list[Action] = []
    for leg in legs:
        done += s.write_done(leg, True)
    assert sorted(d.worker_id for d in of(done, Deliver)) == [pw(p) for p in range(ptp)]
    assert all(d.completion == finished_sending() for d in of(done, Deliver))
    assert len(done) == ptp
    assert_empty(s)


def test_registration_waiting_for_second_producer_still_expires() -> None:
    """P tp2 -> D tp1: rank 0 wrote (while the registration's deadline passed), rank 1 never
    publishes, and the decode side's withdraw got lost: the registration must still expire."""
    s = new_send()
    s.register(T0, reg(1, ptp=2))
    w = one(publish(s, T0 + 1, rank=0, tp=2), StartWrite)
    assert s.tick(T0 + REG_TO) == []  # a WRITE is in flight into it
    assert s.write_done(w.leg, True) == [Deliver(pw(0), finished_sending())]
    assert len(s) == 1
    deadline = s.next_deadline()
    assert deadline is not None
    notice = one(s.tick(deadline), SendFailNotice)
    assert (notice.registration_id, notice.code) == (1, FailureCode.TIMEOUT)
    assert_empty(s)


def test_expect_timeout() -> None:
    r = new_recv()
    sr = one(expect(r, T0, ptp=2), SendRegister)
    r.registered(sr.registration_id)
    r.notified(sr.registration_id, 1)
    assert r.next_deadline() == T0 + EXP_TO
    assert r.tick(T0 + EXP_TO - 1) == []
    actions = expand(r.tick(T0 + EXP_TO), r)
    assert len(actions) == 2
    d = one(of(actions, Deliver), Deliver)
    assert d.worker_id == dw(0)
    failed(d, FailureCode.TIMEOUT, DST)
    wd = one(of(actions, SendWithdraw), SendWithdraw)
    assert (wd.producer_address, wd.transfer_id, wd.registration_id, wd.code) == (
        ADDR, TID, sr.registration_id, FailureCode.TIMEOUT)
    assert_empty(r)
    assert ignored(r.notified(sr.registration_id, 0))  # late notification: stray
    assert r.stray_notifications == 1


def test_next_deadline_tracks_the_earliest_live_deadline() -> None:
    s = new_send()
    assert s.next_deadline() is None
    publish(s, T0, tid="a")  # T0 + 30
    s.register(T0 + 5, reg(1, tid="b"))  # T0 + 25
    s.register(T0 + 1, reg(2, tid="c"))  # T0 + 21
    assert s.next_deadline() == T0 + 1 + REG_TO
    s.withdraw(ORIGIN, "c", 2, FailureCode.ABORTED, "gone")
    assert s.next_deadline() == T0 + 5 + REG_TO
    assert one(publish(s, T0 + 6, tid="b"), StartWrite)  # "b" now progresses; its deadline remains
    found, _ = s.abort(pw(0), ENGINE, "a")
    assert found
    assert s.next_deadline() == T0 + 5 + REG_TO
    assert s.tick(T0 + 5 + REG_TO) == []
    nd = s.next_deadline()
    assert nd is None or nd > T0 + 5 + REG_TO
    s.write_done(LegKey(ENGINE, "b", 0, 1), True)
    assert_empty(s)

    r = new_recv()
    assert r.next_deadline() is None
    expect(r, T0, tid="x")
    expect(r, T0 + 2, tid="y")
    assert r.next_deadline() == T0 + EXP_TO
    r.abort(dw(0), "x")
    assert r.next_deadline() == T0 + 2 + EXP_TO
    expect(r, T0 + 3, tid="y", blocks=(1,))  # supersedes: a fresh deadline
    assert r.next_deadline() == T0 + 3 + EXP_TO
    assert r.tick(T0 + 2 + EXP_TO) == []  # the superseded record's deadline is stale
    assert len(r) == 1
    assert len(r.tick(T0 + 3 + EXP_TO)) == 1  # SendWithdraw, the FAILED riding on it
    assert_empty(r)


# --------------------------------------------------------------------------------------------
# Duplicates, re-submissions and replacements


def test_duplicate_publish_is_idempotent_and_other_blocks_conflict() -> None:
    s = new_send()
    assert publish(s, T0) == []
    assert publish(s, T0 + 1) == []
    with pytest.raises(AlreadyExists):
        publish(s, T0 + 1, blocks=(1, 2))
    with pytest.raises(AlreadyExists):
        publish(s, T0 + 1, worker="another-worker")
    w = one(s.register(T0 + 2, reg(1)), StartWrite)
    assert publish(s, T0 + 3) == []  # still idempotent while the WRITE is in flight
    assert s.write_done(w.leg, True) == [Deliver(pw(0), finished_sending())]
    assert_empty(s)


def test_republish_after_finishing_does_not_rewrite_a_leg() -> None:
    """P tp2 -> D tp1: rank 0 finished; its Publish is retried while the registration still waits
    for rank 1. The leg (rank 0 -> registration) must not be written a second time."""
    s = new_send()
    s.register(T0, reg(1, ptp=2))
    w0 = one(publish(s, T0, rank=0, tp=2), StartWrite)
    assert s.write_done(w0.leg, True) == [Deliver(pw(0), finished_sending())]
    again = publish(s, T0 + 1, rank=0, tp=2)
    assert of(again, StartWrite) == []
    assert again == [Deliver(pw(0), finished_sending())]  # its data already landed
    w1 = one(publish(s, T0 + 1, rank=1, tp=2), StartWrite)
    assert w1.leg == LegKey(ENGINE, TID, 1, 1)
    assert s.write_done(w1.leg, True) == [Deliver(pw(1), finished_sending())]
    assert_empty(s)


def test_duplicate_registration_is_idempotent() -> None:
    s = new_send()
    assert s.register(T0, reg(1)) == []
    assert s.register(T0 + 1, reg(1)) == []
    assert s.next_deadline() == T0 + REG_TO  # not re-armed by the retry
    w = one(publish(s, T0 + 2), StartWrite)
    assert s.register(T0 + 3, reg(1)) == []
    assert s.write_done(w.leg, True) == [Deliver(pw(0), finished_sending())]
    assert_empty(s)


def test_reexpect_same_blocks_is_idempotent() -> None:
    r = new_recv()
    sr = one(expect(r, T0), SendRegister)
    assert expect(r, T0 + 1) == []
    assert r.next_deadline() == T0 + EXP_TO
    assert r.notified(sr.registration_id, 0) == [Deliver(dw(0), finished_receiving())]
    assert_empty(r)


@pytest.mark.parametrize("change", ["blocks", "address", "engine"])
def test_reexpect_supersedes_the_old_registration(change: str) -> None:
    r = new_recv()
    old = one(expect(r, T0), SendRegister)
    if change == "blocks":
        actions = expect(r, T0 + 1, blocks=(31, 32))
    elif change == "address":
        actions = expect(r, T0 + 1, addr="other-prefill:7070")
    else:
        actions = r.expect(T0 + 1, WorkerRef(dw(0), "", 0, 1), Expect(TID, DST, ADDR, "other-engine", 1))
    assert len(actions) == 2
    wd, new = actions
    assert wd == SendWithdraw(ADDR, TID, old.registration_id, FailureCode.SUPERSEDED, wd.reason)
    assert isinstance(new, SendRegister)
    assert new.registration_id != old.registration_id
    assert len(r) == 1
    assert receive_of(r, old.registration_id) is None
    assert ignored(r.notified(old.registration_id, 0))  # the old registration's WRITE: stray
    assert r.stray_notifications == 1
    assert ignored(r.failed(old.registration_id, FailureCode.TRANSFER_ERROR, "late"))
    assert r.notified(new.registration_id, 0) == [Deliver(dw(0), finished_receiving())]
    assert_empty(r)


def test_reregistration_replaces_the_old_one() -> None:
    """The decode side re-registered consumer rank 0 (new id) while the WRITE into the old
    registration is in flight: one WRITE in flight per publish and consumer rank, so the new one is
    written once the old one settled (its daemon hears then that it was replaced), and the publish
    finishes only after both WRITEs."""
    s = new_send()
    publish(s, T0)
    old = one(s.register(T0, reg(1)), StartWrite)
    assert s.register(T0 + 1, reg(2, blocks=(41, 42, 43))) == []
    assert ignored(s.withdraw(ORIGIN, TID, 1, FailureCode.SUPERSEDED, "replaced"))  # late: no-op
    actions = s.write_done(old.leg, True)
    notice = one(of(actions, SendFailNotice), SendFailNotice)
    assert (notice.registration_id, notice.code) == (1, FailureCode.SUPERSEDED)
    new = one(of(actions, StartWrite), StartWrite)
    assert new.leg == LegKey(ENGINE, TID, 0, 2)
    assert new.registration.block_ids == (41, 42, 43)
    assert s.write_done(new.leg, True) == [Deliver(pw(0), finished_sending())]
    assert_empty(s)


def test_only_the_registering_daemon_may_replace_a_registration() -> None:
    """Another decode daemon that knows the transfer id cannot take over consumer rank 0."""
    s = new_send()
    publish(s, T0)
    w = one(s.register(T0, reg(1)), StartWrite)
    rogue = Registration(9, "rogue-instance", TID, ENGINE, 1, "rogue-agent", 0, 1, DST)
    with pytest.raises(PermissionDenied, match="another decode daemon"):
        s.register(T0 + 1, rogue)
    assert s.write_done(w.leg, True) == [Deliver(pw(0), finished_sending())]
    assert_empty(s)


def test_reregistration_before_publish_keeps_only_the_new_one() -> None:
    s = new_send()
    s.register(T0, reg(1))
    assert [(n.registration_id, n.code) for n in s.register(T0 + 1, reg(2))] == [(1, FailureCode.SUPERSEDED)]
    assert len(s) == 1
    assert s.next_deadline() == T0 + 1 + REG_TO
    w = one(publish(s, T0 + 2), StartWrite)
    assert w.leg.registration_id == 2
    assert s.write_done(w.leg, True) == [Deliver(pw(0), finished_sending())]
    assert_empty(s)


@pytest.mark.parametrize("withdraw_first", [True, False])
def test_reexpect_end_to_end_writes_the_new_registration(withdraw_first: bool) -> None:
    """A decode request re-submitted with new blocks while its first WRITE is in flight: whichever
    of the withdraw and the new register reaches the prefill node first, the new blocks are
    written, the decode worker finishes receiving and the prefill worker finishes sending."""
    n = Net(1, 1)
    n.publish(0)
    n.expect(0)
    (old_leg,) = n.posted
    sr_actions = expect(n.recv, T0 + 1, blocks=(51, 52))
    wd, sr = sr_actions
    assert isinstance(wd, SendWithdraw) and isinstance(sr, SendRegister)
    n.run([wd, sr] if withdraw_first else [sr, wd])
    assert [k for k in n.posted if k != old_leg] == []  # one WRITE in flight per publish and rank
    assert n.take() == []
    n.complete(old_leg)  # lands in the old blocks: a stray notification
    assert n.take() == []
    assert n.recv.stray_notifications == 1
    new_legs = [k for k in n.posted if k != old_leg]
    assert [k.registration_id for k in new_legs] == [sr.registration_id]
    n.complete(new_legs[0])
    assert sorted(n.take(), key=lambda d: d.worker_id) == [
        Deliver(dw(0), finished_receiving()), Deliver(pw(0), finished_sending())]
    assert_empty(n.send, n.recv)


# --------------------------------------------------------------------------------------------
# Aborts, workers and peers going away


@pytest.mark.parametrize("with_write", [False, True])
def test_abort_on_the_prefill_side(with_write: bool) -> None:
    s = new_send()
    publish(s, T0)
    assert s.abort("someone-else", ENGINE, TID) == (False, [])
    assert s.abort(pw(0), ENGINE, "other-transfer") == (False, [])
    assert s.abort(pw(0), "other-engine", TID) == (False, [])
    if with_write:
        w = one(s.register(T0, reg(1)), StartWrite)
        found, actions = s.abort(pw(0), ENGINE, TID)
        assert found and actions == []  # both FAILED and the notice wait for the WRITE in flight
        actions = s.write_done(w.leg, True)
        notice = one(of(actions, SendFailNotice), SendFailNotice)
        assert (notice.registration_id, notice.code) == (1, FailureCode.ABORTED)
    else:
        found, actions = s.abort(pw(0), ENGINE, TID)
        assert found
    failed(one(of(actions, Deliver), Deliver), FailureCode.ABORTED, SRC)
    assert_empty(s)
    assert s.abort(pw(0), ENGINE, TID) == (False, [])


def test_abort_on_the_prefill_side_voids_waiting_registrations() -> None:
    """P tp1 -> D tp2, only consumer rank 1 registered: abort tells its decode daemon."""
    s = new_send()
    publish(s, T0)
    w = one(s.register(T0, reg(8, crank=1, ctp=2)), StartWrite)
    found, actions = s.abort(pw(0), ENGINE, TID)
    assert found and actions == []  # told once no WRITE into its blocks is in flight
    actions = s.write_done(w.leg, False, "cancelled")
    assert one(of(actions, SendFailNotice), SendFailNotice).registration_id == 8
    failed(one(of(actions, Deliver), Deliver), FailureCode.ABORTED, SRC)
    assert_empty(s)


def test_abort_on_the_decode_side() -> None:
    r = new_recv()
    sr = one(expect(r, T0), SendRegister)
    assert r.abort(dw(0), "other") == (False, [])
    assert r.abort("other-worker", TID) == (False, [])
    found, actions = r.abort(dw(0), TID)
    assert found and len(actions) == 1
    (wd,) = actions
    # the FAILED is delivered only after the prefill daemon answered the withdrawal (it answers
    # once no WRITE into these blocks is in flight)
    assert wd == SendWithdraw(ADDR, TID, sr.registration_id, FailureCode.ABORTED, wd.reason)
    assert_empty(r)
    d = one(r.withdraw_answered(sr.registration_id), Deliver)
    assert d.worker_id == dw(0)
    failed(d, FailureCode.ABORTED, DST)
    assert r.abort(dw(0), TID) == (False, [])


@pytest.mark.parametrize("with_write", [False, True])
def test_decode_abort_end_to_end(with_write: bool) -> None:
    n = Net(1, 1)
    n.expect(0)
    if with_write:
        n.publish(0)
        (leg,) = n.posted
    found, actions = n.recv.abort(dw(0), TID)
    assert found
    n.run(actions)
    if with_write:
        # the withdrawal is answered only once the WRITE in flight settled: until then the decode
        # worker is not told (its blocks must not be freed under a landing WRITE)
        assert n.take() == []
        n.complete(leg)  # the WRITE lands as a stray
        pd, dd = n.take()
        assert pd.worker_id == pw(0)
        failed(pd, FailureCode.ABORTED, SRC)
        failed(dd, FailureCode.ABORTED, DST)
        assert n.recv.stray_notifications == 1
    else:
        (d,) = n.take()
        failed(d, FailureCode.ABORTED, DST)
    assert n.notices == []  # no notice goes back for a withdrawn registration
    assert_empty(n.send, n.recv)


def test_withdraw_of_unknown_registration_is_ignored() -> None:
    s = new_send()
    s.register(T0, reg(1))
    assert ignored(s.withdraw(ORIGIN, TID, 99, FailureCode.ABORTED, "x"))
    assert ignored(s.withdraw("other-origin", TID, 1, FailureCode.ABORTED, "x"))
    assert len(s) == 1
    assert s.withdraw(ORIGIN, TID, 1, FailureCode.ABORTED, "x") == []
    assert_empty(s)


@pytest.mark.parametrize("with_write", [False, True])
def test_prefill_worker_gone(with_write: bool) -> None:
    s = new_send()
    publish(s, T0)
    publish(s, T0, tid="other", worker="survivor")
    if with_write:
        w = one(s.register(T0, reg(1)), StartWrite)
    actions = s.worker_gone(pw(0))
    assert of(actions, Deliver) == []
    if with_write:
        assert actions == []  # the decode daemon is told once the WRITE in flight settled
        assert len(s) == 2  # the WRITE in flight keeps the publish until it settles
        done = s.write_done(w.leg, True)
        notice = one(of(done, SendFailNotice), SendFailNotice)
        assert (notice.registration_id, notice.code) == (1, FailureCode.WORKER_GONE)
        assert all(d.worker_id == pw(0) for d in of(done, Deliver))
    else:
        assert actions == []
    assert len(s) == 1
    assert s.has_publish(ENGINE, "other", 0)
    assert not s.has_publish(ENGINE, TID, 0)
    assert s.worker_gone(pw(0)) == []
    failed(one(s.abort("survivor", ENGINE, "other")[1], Deliver), FailureCode.ABORTED, SRC)
    assert_empty(s)


def test_decode_worker_gone() -> None:
    r = new_recv()
    a = one(expect(r, T0, worker="gone"), SendRegister)
    b = one(expect(r, T0, worker="gone", tid="t2"), SendRegister)
    expect(r, T0, worker="survivor")
    actions = r.worker_gone("gone")
    assert of(actions, Deliver) == []
    assert sorted((w.registration_id, w.code) for w in of(actions, SendWithdraw)) == [
        (a.registration_id, FailureCode.WORKER_GONE), (b.registration_id, FailureCode.WORKER_GONE)]
    assert len(actions) == 2
    assert len(r) == 1
    assert r.worker_gone("gone") == []
    assert len(expand(r.abort("survivor", TID)[1], r)) == 2
    assert_empty(r)


def test_origin_lost() -> None:
    s = new_send()
    publish(s, T0, tid="a")
    w = one(s.register(T0, reg(1, tid="a", origin="lost")), StartWrite)
    s.register(T0, reg(2, tid="b", origin="lost"))
    publish(s, T0, tid="c")
    wc = one(s.register(T0, reg(3, tid="c", origin="alive")), StartWrite)
    actions = s.origin_lost("lost", "decode daemon restarted")
    assert actions == []  # nothing to tell a lost origin; "a" waits for its WRITE
    assert len(s) == 2
    d = one(s.write_done(w.leg, True), Deliver)
    failed(d, FailureCode.PEER_UNREACHABLE, SRC)
    assert "restarted" in d.completion.reason
    assert s.write_done(wc.leg, True) == [Deliver(pw(0), Completion(CompletionKind.FINISHED_SENDING, "c"))]
    assert_empty(s)


def test_origin_lost_after_a_write_failure_keeps_the_first_cause() -> None:
    s = new_send()
    s.register(T0, reg(1, crank=0, ctp=2, origin="lost"))
    s.register(T0, reg(2, crank=1, ctp=2, origin="lost"))
    w0, w1 = of(publish(s, T0), StartWrite)
    s.write_done(w0.leg, False, "x")
    actions = s.origin_lost("lost", "unreachable")
    assert actions == []  # leg 1 still in flight
    failed(one(s.write_done(w1.leg, True), Deliver), FailureCode.TRANSFER_ERROR, SRC)  # first cause wins
    assert_empty(s)


def test_producer_lost() -> None:
    r = new_recv()
    expect(r, T0, tid="a")
    expect(r, T0, tid="b", rank=1, tp=2, worker="dwx")
    expect(r, T0, tid="c", addr="healthy:1")
    actions = r.producer_lost(ADDR, FailureCode.PEER_UNREACHABLE, "connection reset")
    assert of(actions, SendWithdraw) == []
    assert sorted((d.worker_id, d.completion.transfer_id) for d in of(actions, Deliver)) == [
        ("dw0", "a"), ("dwx", "b")]
    for d in of(actions, Deliver):
        failed(d, FailureCode.PEER_UNREACHABLE, DST)
    assert len(actions) == 2
    assert len(r) == 1
    assert r.producer_lost(ADDR, FailureCode.PEER_UNREACHABLE, "again") == []
    r.tick(T0 + EXP_TO)
    assert_empty(r)


def test_recv_failed_from_the_prefill_side() -> None:
    r = new_recv()
    sr = one(expect(r, T0), SendRegister)
    assert ignored(r.failed(sr.registration_id + 1, FailureCode.TIMEOUT, "unknown"))
    d = one(r.failed(sr.registration_id, FailureCode.PEER_REJECTED, "no such engine"), Deliver)
    failed(d, FailureCode.PEER_REJECTED, DST)
    assert ignored(r.failed(sr.registration_id, FailureCode.PEER_REJECTED, "twice"))
    assert_empty(r)


# --------------------------------------------------------------------------------------------
# Layouts


@pytest.mark.parametrize("order", ["publish_first", "register_first"])
@pytest.mark.parametrize(
    ("src", "dst", "written"),
    [
        ((1, 2, 3), (7, 8, 9), (1, 2, 3)),
        ((1, 2, 3, 4), (8, 9), (3, 4)),  # partial prefix hit on decode: only the tail is sent
        ((1, 2, 3, 4), (9,), (4,)),
    ],
)
def test_decode_needs_fewer_or_equal_blocks(src: tuple[int, ...], dst: tuple[int, ...], written: tuple[int, ...],
                                            order: str) -> None:
    s = new_send()
    if order == "publish_first":
        publish(s, T0, blocks=src)
        actions = s.register(T0, reg(1, blocks=dst))
    else:
        s.register(T0, reg(1, blocks=dst))
        actions = publish(s, T0, blocks=src)
    w = one(actions, StartWrite)
    assert w.src_blocks == written
    assert len(w.src_blocks) == len(w.registration.block_ids)
    assert s.write_done(w.leg, True) == [Deliver(pw(0), finished_sending())]
    assert_empty(s)


@pytest.mark.parametrize("order", ["publish_first", "register_first"])
@pytest.mark.parametrize(
    ("dst", "claimed_ptp", "what"),
    [
        ((5, 6, 7, 8), 1, "unequal length"),
        ((5, 6), 2, "producer TP size"),
    ],
)
def test_layout_mismatch_fails_both_sides(order: str, dst: tuple[int, ...], claimed_ptp: int, what: str) -> None:
    n = Net(1, 1)
    src = (1, 2, 3)
    if order == "publish_first":
        n.run(publish(n.send, T0, blocks=src))
    actions = expect(n.recv, T0, ptp=claimed_ptp, blocks=dst)
    n.run(actions)
    if order == "register_first":
        n.run(publish(n.send, T0, blocks=src))
    assert n.started == []
    notice = one(n.notices, SendFailNotice)
    assert notice.code is FailureCode.LAYOUT_MISMATCH and what in notice.reason
    by_worker = {d.worker_id: d for d in n.take()}
    assert set(by_worker) == {pw(0), dw(0)}
    failed(by_worker[pw(0)], FailureCode.LAYOUT_MISMATCH, src)
    failed(by_worker[dw(0)], FailureCode.LAYOUT_MISMATCH, dst)
    assert_empty(n.send, n.recv)


def test_layout_mismatch_with_a_posted_leg_waits_for_it() -> None:
    """P tp1 -> D tp2: consumer rank 0 is being written when consumer rank 1 turns out to expect
    more blocks than were published."""
    s = new_send()
    publish(s, T0, blocks=(1, 2))
    w = one(s.register(T0, reg(1, crank=0, ctp=2, blocks=(5, 6))), StartWrite)
    actions = s.register(T0, reg(2, crank=1, ctp=2, blocks=(5, 6, 7)))
    assert of(actions, Deliver) == [] and of(actions, StartWrite) == []
    assert [n.registration_id for n in of(actions, SendFailNotice)] == [2]  # 1: once its WRITE settled
    done = s.write_done(w.leg, True)
    assert [n.registration_id for n in of(done, SendFailNotice)] == [1]
    assert all(n.code is FailureCode.LAYOUT_MISMATCH for n in of(actions + done, SendFailNotice))
    failed(one(of(done, Deliver), Deliver), FailureCode.LAYOUT_MISMATCH, (1, 2))
    assert_empty(s)


# --------------------------------------------------------------------------------------------
# Invalid arguments: refused without leaving state behind


@pytest.mark.parametrize(
    ("tid", "blocks"),
    [("", SRC), (TID, ()), ("", ())],
)
def test_publish_rejects_invalid(tid: str, blocks: tuple[int, ...]) -> None:
    s = new_send()
    with pytest.raises(InvalidArgument):
        publish(s, T0, tid=tid, blocks=blocks)
    assert_empty(s)


BAD_TP_PAIRS = [(0, 1), (1, 0), (-2, 2), (2, -1), (3, 2), (2, 3), (4, 6), (6, 4)]


@pytest.mark.parametrize(
    ("blocks", "ptp", "ctp"),
    [((), 1, 1)] + [(DST, p, c) for p, c in BAD_TP_PAIRS],
)
def test_register_rejects_invalid(blocks: tuple[int, ...], ptp: int, ctp: int) -> None:
    s = new_send()
    with pytest.raises(InvalidArgument):
        s.register(T0, reg(1, ctp=ctp, ptp=ptp, blocks=blocks))
    assert_empty(s)


@pytest.mark.parametrize(
    ("tid", "blocks", "addr", "ptp", "ctp"),
    [("", DST, ADDR, 1, 1), (TID, (), ADDR, 1, 1), (TID, DST, "", 1, 1)]
    + [(TID, DST, ADDR, p, c) for p, c in BAD_TP_PAIRS],
)
def test_expect_rejects_invalid(tid: str, blocks: tuple[int, ...], addr: str, ptp: int, ctp: int) -> None:
    r = new_recv()
    with pytest.raises(InvalidArgument):
        r.expect(T0, WorkerRef(dw(0), "", 0, ctp), Expect(tid, blocks, addr, ENGINE, ptp))
    assert_empty(r)


def test_rejected_reexpect_keeps_the_old_record() -> None:
    r = new_recv()
    sr = one(expect(r, T0), SendRegister)
    with pytest.raises(InvalidArgument):
        expect(r, T0 + 1, blocks=())
    assert receive_of(r, sr.registration_id) == (dw(0), TID)
    r.abort(dw(0), TID)
    assert_empty(r)


def test_register_with_other_consumer_tp_is_refused_without_side_effects() -> None:
    """A registration whose consumer TP size contradicts an earlier one for the same transfer is
    refused; the earlier registration (same consumer rank) must survive the refusal."""
    s = new_send()
    s.register(T0, reg(1, crank=0, ctp=2))
    with pytest.raises(InvalidArgument):
        s.register(T0 + 1, reg(2, crank=0, ctp=1))
    assert len(s) == 1
    assert s.next_deadline() == T0 + REG_TO
    w = one(publish(s, T0 + 2), StartWrite)  # P tp1 -> D tp2: writes the surviving registration
    assert w.leg.registration_id == 1
    found, actions = s.abort(pw(0), ENGINE, TID)
    assert found and actions == []
    done = s.write_done(w.leg, True)
    assert one(of(done, SendFailNotice), SendFailNotice).registration_id == 1
    failed(one(of(done, Deliver), Deliver), FailureCode.ABORTED, SRC)
    assert_empty(s)


def test_rejected_register_never_leaves_an_empty_transfer() -> None:
    s = new_send()
    s.register(T0, reg(1, crank=0, ctp=2))
    with pytest.raises(InvalidArgument):
        s.register(T0 + 1, reg(2, crank=0, ctp=1))
    assert s.tick(T0 + 1000) != []
    assert_empty(s)


# --------------------------------------------------------------------------------------------
# Shutdown (drain): what was not yet written fails at once; WRITEs in flight settle first


def test_send_side_shutdown() -> None:
    s = new_send()
    publish(s, T0, tid="lonely")  # no registration yet: fails at once
    s.register(T0, reg(1, tid="waiting"))  # no publish yet: its decode daemon is told
    publish(s, T0, tid="busy")
    w = one(s.register(T0, reg(2, tid="busy")), StartWrite)  # a WRITE in flight
    actions = s.shutdown("daemon stopping")
    d = one(of(actions, Deliver), Deliver)
    assert (d.worker_id, d.completion.transfer_id) == (pw(0), "lonely")
    failed(d, FailureCode.SHUTDOWN, SRC)
    assert sorted((n.registration_id, n.code) for n in of(actions, SendFailNotice)) == [(1, FailureCode.SHUTDOWN)]
    assert of(actions, StartWrite) == []
    assert len(s) == 1  # "busy" waits for its WRITE, and so does its decode daemon's notice
    done = s.write_done(w.leg, True)
    assert [(n.registration_id, n.code) for n in of(done, SendFailNotice)] == [(2, FailureCode.SHUTDOWN)]
    d = one(of(done, Deliver), Deliver)
    assert d.completion.transfer_id == "busy"
    failed(d, FailureCode.SHUTDOWN, SRC)
    assert_empty(s)
    assert s.shutdown("again") == []


def test_recv_side_shutdown() -> None:
    r = new_recv()
    a = one(expect(r, T0, tid="a"), SendRegister)
    b = one(expect(r, T0, tid="b", ptp=2), SendRegister)
    r.notified(b.registration_id, 0)
    actions = r.shutdown("daemon stopping")
    assert sorted(d.completion.transfer_id for d in of(actions, Deliver)) == ["a", "b"]
    for d in of(actions, Deliver):
        failed(d, FailureCode.SHUTDOWN, DST)
    assert sorted((w.registration_id, w.code) for w in of(actions, SendWithdraw)) == [
        (a.registration_id, FailureCode.SHUTDOWN), (b.registration_id, FailureCode.SHUTDOWN)]
    assert len(actions) == 4
    assert_empty(r)
    assert r.shutdown("again") == []


# --------------------------------------------------------------------------------------------
# Which peers pending transfers depend on (heartbeats)


def test_peers_that_pending_transfers_depend_on() -> None:
    s = new_send()
    assert s.origins() == set()
    s.register(T0, reg(1, tid="a", origin="d1"))
    s.register(T0, reg(2, tid="b", origin="d2"))
    assert s.origins() == {"d1", "d2"} and s.holds("d1") and s.holds("d2") and not s.holds("d3")
    s.withdraw("d1", "a", 1, FailureCode.ABORTED, "x")
    assert s.origins() == {"d2"} and not s.holds("d1")
    w = one(publish(s, T0, tid="b"), StartWrite)
    s.write_done(w.leg, True)
    assert s.origins() == set() and not s.holds("d2")
    assert_empty(s)

    r = new_recv()
    assert r.producer_addresses() == set()
    expect(r, T0, tid="a", addr="p1")
    expect(r, T0, tid="b", addr="p2")
    assert r.producer_addresses() == {"p1", "p2"}
    r.abort(dw(0), "a")
    assert r.producer_addresses() == {"p2"}
    r.abort(dw(0), "b")
    assert_empty(r)


def test_producer_lost_after_a_restart_spares_registrations_in_progress() -> None:
    r = new_recv()
    accepted = one(expect(r, T0, tid="a"), SendRegister)
    r.registered(accepted.registration_id)
    pending = one(expect(r, T0, tid="b"), SendRegister)  # its Register goes to the new instance
    actions = r.producer_lost(ADDR, FailureCode.PEER_UNREACHABLE, "restarted", registered_only=True)
    d = one(actions, Deliver)
    assert d.completion.transfer_id == "a"
    failed(d, FailureCode.PEER_UNREACHABLE, DST)
    assert receive_of(r, pending.registration_id) == (dw(0), "b")
    assert r.notified(pending.registration_id, 0) == [Deliver(dw(0), finished_receiving("b"))]
    assert_empty(r)


# --------------------------------------------------------------------------------------------
# Pull mode: the prefill side offers instead of writing; the decode side READs what it registered.


def _pull_reg(rid: int, **kw: object) -> Registration:
    import dataclasses

    from kvpushd.core.types import TransferMode

    return dataclasses.replace(reg(rid, **kw), mode=TransferMode.PULL)  # type: ignore[arg-type]


@pytest.mark.parametrize("order", ["publish_first", "register_first"])
def test_pull_offers_instead_of_writing_and_finishes_on_the_read_notification(order: str) -> None:
    from kvpushd.core.actions import SendOffer

    s = new_send()
    if order == "publish_first":
        assert publish(s) == []
        acts = s.register(T0 + 1, _pull_reg(7))
    else:
        assert s.register(T0, _pull_reg(7)) == []
        acts = publish(s, T0 + 1)
    o = one(acts, SendOffer)
    assert o.src_blocks == SRC and o.registration.registration_id == 7 and o.producer_rank == 0
    assert s.pulling() == 1 and s.pull_pending(ORIGIN, 7, 0) and ORIGIN in s.origins() and s.holds(ORIGIN)
    assert ignored(s.read_done("another-decode-daemon", 7, 0, True))  # only the daemon offered to
    assert ignored(s.read_done(ORIGIN, 7, 1, True))  # not an offered rank
    assert s.read_done(ORIGIN, 7, 0, True) == [Deliver(pw(0), finished_sending())]
    assert s.pulling() == 0 and not s.pull_pending(ORIGIN, 7, 0)
    assert ignored(s.read_done(ORIGIN, 7, 0, True)) and ignored(s.read_done(ORIGIN, 7, 0, False, "late"))
    assert_empty(s)


def test_pull_failed_read_fails_the_publish_and_the_registration() -> None:
    s = new_send()
    publish(s)
    s.register(T0 + 1, _pull_reg(7))
    acts = s.read_done(ORIGIN, 7, 0, False, "READ completed in error")
    failed(one(of(acts, Deliver), Deliver), FailureCode.TRANSFER_ERROR, SRC)
    notice = one(of(acts, SendFailNotice), SendFailNotice)
    assert notice.registration_id == 7 and "READ" in notice.reason
    assert s.pulling() == 0
    assert_empty(s)


def test_pull_publish_waits_for_an_offered_read_after_a_withdrawal() -> None:
    """The decode side may still be READing the source blocks: the publish fails only once the READ settled."""
    s = new_send()
    publish(s)
    s.register(T0 + 1, _pull_reg(7))
    assert of(s.withdraw(ORIGIN, TID, 7, FailureCode.ABORTED, "aborted"), Deliver) == []
    assert s.pulling() == 1
    failed(one(s.read_done(ORIGIN, 7, 0, True), Deliver), FailureCode.ABORTED, SRC)
    assert_empty(s)


def test_pull_unconfirmed_read_expires_after_publish_timeout() -> None:
    s = new_send()
    publish(s)
    s.register(T0 + 1, _pull_reg(7))
    assert s.tick(T0 + 1 + PUB_TO - 0.1) == []  # the publish deadline re-arms: its target is registered
    acts = s.tick(T0 + 1 + PUB_TO)
    d = one(of(acts, Deliver), Deliver)
    failed(d, FailureCode.TRANSFER_ERROR, SRC)
    assert "not confirmed" in d.completion.reason
    assert s.pulling() == 0
    assert_empty(s)


def test_pull_lost_decode_daemon_settles_its_offered_legs() -> None:
    s = new_send()
    publish(s)
    s.register(T0 + 1, _pull_reg(7))
    acts = s.origin_lost(ORIGIN, "no heartbeat")
    failed(one(of(acts, Deliver), Deliver), FailureCode.PEER_UNREACHABLE, SRC)
    assert s.pulling() == 0 and ORIGIN not in s.origins() and not s.holds(ORIGIN)
    assert_empty(s)


def test_pull_hetero_tp_offers_one_leg_per_producer_rank() -> None:
    from kvpushd.core.actions import SendOffer

    s = new_send()
    s.register(T0, _pull_reg(7, ptp=2))
    o0 = one(publish(s, rank=0, tp=2), SendOffer)
    o1 = one(publish(s, rank=1, tp=2), SendOffer)
    assert (o0.producer_rank, o1.producer_rank) == (0, 1) and s.pulling() == 2
    assert s.read_done(ORIGIN, 7, 0, True) == [Deliver(pw(0), finished_sending())]
    assert s.read_done(ORIGIN, 7, 1, True) == [Deliver(pw(1), finished_sending())]
    assert_empty(s)


def _pull_recv(ptp: int = 1) -> tuple[RecvSide, int]:
    from kvpushd.core.types import TransferMode

    r = new_recv(first_id=50)
    sr = one(r.expect(T0, WorkerRef(dw(0), "", 0, 1),
                      Expect(TID, DST, ADDR, ENGINE, ptp, transfer_mode=TransferMode.PULL)), SendRegister)
    assert sr.mode is TransferMode.PULL
    return r, sr.registration_id


def test_recv_pull_offer_is_checked_against_the_registration() -> None:
    from kvpushd.core.actions import StartRead
    from kvpushd.core.errors import FailedPrecondition, NotFound, PermissionDenied

    r, rid = _pull_recv()
    with pytest.raises(NotFound):
        r.offer(rid + 1, TID, 0, SRC)
    with pytest.raises(PermissionDenied):
        r.offer(rid, "another-transfer", 0, SRC)
    with pytest.raises(InvalidArgument):
        r.offer(rid, TID, 1, SRC)  # producer rank 1 does not feed this registration
    with pytest.raises(InvalidArgument):
        r.offer(rid, TID, 0, SRC[:2])  # block count
    push = new_recv(first_id=90)
    expect(push)
    with pytest.raises(FailedPrecondition):
        push.offer(90, TID, 0, SRC)
    a = one(r.offer(rid, TID, 0, SRC), StartRead)
    assert a.dst_blocks == DST and a.src_blocks == SRC and a.worker_id == dw(0)  # always its own blocks
    assert (a.key.producer_address, a.key.registration_id, a.key.producer_rank) == (ADDR, rid, 0)
    assert ignored(r.offer(rid, TID, 0, SRC))  # a repeated offer starts no second READ
    assert r.sent_to(rid) == (TID, ADDR)
    assert r.read_done(a.key, True) == [Deliver(dw(0), finished_receiving())]
    assert ignored(r.read_done(a.key, True))
    assert_empty(r)


def test_recv_pull_failed_read_fails_the_receive_and_tells_the_prefill_side() -> None:
    from kvpushd.core.actions import SendReadFailed, StartRead

    r, rid = _pull_recv()
    a = one(r.offer(rid, TID, 0, SRC), StartRead)
    acts = r.read_done(a.key, False, "READ completed in error")
    failed(one(of(acts, Deliver), Deliver), FailureCode.TRANSFER_ERROR, DST)
    assert one(of(acts, SendReadFailed), SendReadFailed).key == a.key
    assert_empty(r)


def test_recv_pull_failed_read_after_abort_is_still_reported() -> None:
    from kvpushd.core.actions import SendReadFailed, StartRead

    r, rid = _pull_recv()
    a = one(r.offer(rid, TID, 0, SRC), StartRead)
    found, acts = r.abort(dw(0), TID)
    assert found and one(of(acts, SendWithdraw), SendWithdraw).registration_id == rid
    assert r.read_done(a.key, False, "late") == [SendReadFailed(a.key, "late")]  # prefill still holds blocks
    assert ignored(r.read_done(a.key, True))
    assert_empty(r)


def test_recv_pull_hetero_tp_waits_for_every_producer_rank() -> None:
    from kvpushd.core.actions import StartRead

    r, rid = _pull_recv(ptp=2)
    a0 = one(r.offer(rid, TID, 0, SRC), StartRead)
    a1 = one(r.offer(rid, TID, 1, SRC), StartRead)
    assert (a0.producer_tp_size, a0.consumer_tp_size) == (2, 1)
    assert r.read_done(a1.key, True) == []
    assert "READ" in r.views(T0)[0].waiting_for and r.views(T0)[0].mode == "pull"
    assert r.read_done(a0.key, True) == [Deliver(dw(0), finished_receiving())]
    assert_empty(r)


def test_a_register_delivered_again_after_its_registration_ended_starts_no_write() -> None:
    """A duplicate Register that arrives after its WRITE failed (the registration voided, the decode
    worker told FAILED, the publish failed): the registration is not held anew, so a later publish of
    the same transfer writes nothing into blocks the decode worker may have given to another request."""
    from support.core import WorkerRef, registration_state

    from kvpushd.core.actions import Deliver, Dropped, Registration, SendFailNotice, StartWrite
    from kvpushd.core.send import SendSide
    from kvpushd.core.types import CompletionKind, Publish, TransferMode

    send = SendSide(30.0, 30.0)
    w = WorkerRef("p0", "prefill", 0, 1)
    reg = Registration(100, "origin", "b", "prefill", 1, "agent", 0, 1, (7, 8), TransferMode.PUSH)
    send.publish(1.0, w, Publish("b", [1, 2]))
    (start,) = send.register(1.0, reg)
    assert isinstance(start, StartWrite)
    ended = send.write_done(start.leg, False, "boom")
    assert {type(a) for a in ended} == {SendFailNotice, Deliver}
    assert next(a for a in ended if isinstance(a, Deliver)).completion.kind is CompletionKind.FAILED
    (late,) = send.register(2.0, reg)  # the same Register, delivered again
    assert isinstance(late, Dropped) and late.event == "registered"
    assert send.publish(3.0, w, Publish("b", [1, 2])) == []  # waits for a registration of its own
    assert registration_state(send, "origin", 100) is None
