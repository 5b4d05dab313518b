"""Registration binding on the prefill side: a publish that names its decode node (``consumer``)
accepts registrations from that node only, before or after the publish; without a name the first
registration wins, as before."""

from __future__ import annotations

import pytest
from support.core import WorkerRef, publish_state, registration_state

from kvpushd.core.actions import Action, Deliver, Registration, SendFailNotice, StartWrite
from kvpushd.core.errors import InvalidArgument, PermissionDenied
from kvpushd.core.send import SendSide
from kvpushd.core.types import CompletionKind, FailureCode, Publish

T0 = 1000.0
ENGINE, TID = "prefill-engine", "req-1"
SRC, DST = (11, 12, 13), (21, 22, 23)
GOOD, BAD = "decode-a", "decode-b"


def reg(rid: int, node: str, crank: int = 0, ctp: int = 1, tls: tuple[str, ...] = ()) -> Registration:
    return Registration(rid, f"instance-{node}", TID, ENGINE, 1, f"agent-{node}", crank, ctp, DST, node_id=node,
                        tls_names=tls)


def writes(actions: list[Action]) -> list[StartWrite]:
    return [a for a in actions if isinstance(a, StartWrite)]


def publish(s: SendSide, consumer: str = GOOD, rank: int = 0, tp: int = 1, tls: str = "") -> list[Action]:
    return s.publish(T0, WorkerRef(f"pw{rank}", ENGINE, rank, tp),
                     Publish(TID, SRC, consumer_node_id=consumer, consumer_tls_name=tls))


def test_after_the_publish_another_node_is_refused_and_the_named_one_written() -> None:
    s = SendSide(30.0, 20.0)
    assert writes(publish(s)) == []
    with pytest.raises(PermissionDenied, match=r"bound to decode node 'decode-a'.*'decode-b'"):
        s.register(T0, reg(1, BAD))
    assert registration_state(s, "instance-decode-b", 1) is None  # the refusal left nothing behind
    (w,) = writes(s.register(T0, reg(2, GOOD)))
    assert w.leg.registration_id == 2
    done = s.write_done(w.leg, True)
    assert [a.completion.kind for a in done if isinstance(a, Deliver)] == [CompletionKind.FINISHED_SENDING]


def test_a_registration_held_before_the_publish_from_another_node_is_failed_back() -> None:
    s = SendSide(30.0, 20.0)
    assert s.register(T0, reg(1, BAD)) == []  # held: no binding known yet
    out = publish(s)
    assert writes(out) == []
    (notice,) = [a for a in out if isinstance(a, SendFailNotice)]
    assert notice.origin == "instance-decode-b" and notice.code is FailureCode.PEER_REJECTED
    assert "bound to decode node 'decode-a'" in notice.reason
    assert publish_state(s, ENGINE, TID, 0) is not None  # the publish still waits for the right one
    (w,) = writes(s.register(T0, reg(2, GOOD)))  # its consumer rank is free for the named node
    assert w.leg.registration_id == 2


def test_a_registration_held_before_the_publish_from_the_named_node_is_written() -> None:
    s = SendSide(30.0, 20.0)
    s.register(T0, reg(1, GOOD))
    out = publish(s)
    assert len(writes(out)) == 1 and not [a for a in out if isinstance(a, SendFailNotice)]


def test_without_a_name_the_first_registration_wins() -> None:
    s = SendSide(30.0, 20.0)
    publish(s, consumer="")
    assert len(writes(s.register(T0, reg(1, BAD)))) == 1
    with pytest.raises(PermissionDenied, match="registered by another decode daemon"):
        s.register(T0, reg(2, GOOD))


def test_every_rank_must_name_the_same_node() -> None:
    s = SendSide(30.0, 20.0)
    publish(s, rank=0, tp=2)
    with pytest.raises(InvalidArgument, match="names 'decode-b'"):
        publish(s, consumer=BAD, rank=1, tp=2)
    s2 = SendSide(30.0, 20.0)
    publish(s2, consumer="", rank=0, tp=2)
    with pytest.raises(InvalidArgument, match="published unbound"):
        publish(s2, rank=1, tp=2)
    publish(s, consumer="", rank=1, tp=2)  # a rank naming none keeps the binding
    with pytest.raises(PermissionDenied):
        s.register(T0, reg(3, BAD, crank=0, ctp=2))


def test_bound_by_tls_name_a_caller_claiming_the_node_id_is_refused() -> None:
    """A node id is what the caller says; a TLS name is what its certificate says."""
    s = SendSide(30.0, 20.0)
    publish(s, consumer="", tls="decode-a.example")
    with pytest.raises(PermissionDenied, match=r"TLS name 'decode-a.example'.*TLS names 'intruder'"):
        s.register(T0, reg(1, GOOD, tls=("intruder",)))  # claims node id decode-a
    assert len(writes(s.register(T0, reg(2, BAD, tls=("decode-a.example", "localhost"))))) == 1


def test_bound_by_both_each_must_match() -> None:
    s = SendSide(30.0, 20.0)
    publish(s, consumer=GOOD, tls="decode-a.example")
    for wrong in (reg(1, BAD, tls=("decode-a.example",)), reg(2, GOOD, tls=("other",))):
        with pytest.raises(PermissionDenied):
            s.register(T0, wrong)
    assert len(writes(s.register(T0, reg(3, GOOD, tls=("decode-a.example",))))) == 1
