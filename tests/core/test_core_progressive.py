"""Progressive push in the core: declared publishes, staged legs, StopWrite, sealed steps, layered notifications."""

from __future__ import annotations

from dataclasses import replace

from support.core import WorkerRef
from test_core_rendezvous import (
    ENGINE,
    SRC,
    T0,
    TID,
    expect,
    ignored,
    new_recv,
    new_send,
    of,
    one,
    pw,
    reg,
)

from kvpushd.core.actions import Deliver, SendFailNotice, SendOffer, StartWrite, StopWrite
from kvpushd.core.types import CompletionKind, FailureCode, Publish, TransferMode

LAYERS = 4


def declare(s, step: int = 5, worker: str | None = None):  # type: ignore[no-untyped-def]
    return s.publish(T0, WorkerRef(worker or pw(0), ENGINE, 0, 1), Publish(TID, SRC, step=step, layers=LAYERS))


def test_a_declared_publish_starts_a_staged_push_leg_at_once() -> None:
    s = new_send()
    assert declare(s) == []
    w = one(s.register(T0, reg(7)), StartWrite)
    assert (w.step, w.layers) == (5, LAYERS)
    # the leg settles as any other: FINISHED_SENDING once its WRITEs have
    d = one(s.write_done(w.leg, True), Deliver)
    assert d.worker_id == pw(0) and d.completion.kind is CompletionKind.FINISHED_SENDING
    assert len(s) == 0


def test_a_sealed_publish_is_written_whole() -> None:
    s = new_send()
    declare(s)
    assert s.sealed(pw(0), 5) == []
    w = one(s.register(T0, reg(7)), StartWrite)
    assert (w.step, w.layers) == (0, 0)


def test_pull_legs_wait_for_the_step_to_be_sealed() -> None:
    s = new_send()
    declare(s)
    assert s.register(T0, replace(reg(7), mode=TransferMode.PULL)) == []
    assert s.sealed(pw(1), 5) == []  # another worker's step says nothing
    assert s.sealed(pw(0), 4) == []  # an earlier step neither
    one(s.sealed(pw(0), 6), SendOffer)  # a later one: step 5 is complete


def test_abort_mid_layers_stops_the_leg_and_fails_once_it_settles() -> None:
    s = new_send()
    declare(s)
    w = one(s.register(T0, reg(7)), StartWrite)
    found, actions = s.abort(pw(0), ENGINE, TID)
    assert found
    stop = one(of(actions, StopWrite), StopWrite)
    assert stop.leg == w.leg
    assert not of(actions, Deliver) and not of(actions, SendFailNotice)  # not while a WRITE may land
    after = s.write_done(w.leg, False, "stopped")
    d = one(of(after, Deliver), Deliver)
    assert d.completion.kind is CompletionKind.FAILED and d.completion.code is FailureCode.ABORTED
    one(of(after, SendFailNotice), SendFailNotice)  # the decode side hears once nothing is in flight
    assert len(s) == 0


def test_a_withdrawn_registration_stops_its_leg_once() -> None:
    s = new_send()
    declare(s)
    w = one(s.register(T0, reg(7)), StartWrite)
    actions = s.withdraw("decode-instance", TID, 7, FailureCode.ABORTED, "aborted")
    assert [a.leg for a in of(actions, StopWrite)] == [w.leg]
    assert not of(s.worker_gone(pw(0)), StopWrite)  # already stopped: not again
    d = one(s.write_done(w.leg, True), Deliver)  # the publish failed with its registration, once settled
    assert d.completion.kind is CompletionKind.FAILED


def test_recv_counts_a_rank_complete_only_when_every_layer_landed() -> None:
    r = new_recv(first_id=50)
    expect(r)
    assert r.registered(50) == []
    assert r.notified(50, 0, 2, 2, LAYERS) == []
    assert ignored(r.notified(50, 0, 3, 1, LAYERS))  # overlaps what landed: not counted twice
    assert ignored(r.notified(50, 0, 0, 1, 8))  # another layer count: stray
    assert r.stray_notifications == 2
    d = one(r.notified(50, 0, 0, 2, LAYERS), Deliver)
    assert d.completion.kind is CompletionKind.FINISHED_RECEIVING
