"""SendSide.decline: a decode daemon says it will never register a transfer (its worker's Expect
never reached it). The publish fails at once; one that comes later fails at once while remembered."""

from __future__ import annotations

import pytest
from support.core import WorkerRef

from kvpushd.core import send
from kvpushd.core.actions import Deliver, Registration, SendFailNotice, StartWrite
from kvpushd.core.errors import PermissionDenied
from kvpushd.core.send import SendSide
from kvpushd.core.types import CompletionKind, FailureCode, Publish

T0 = 1000.0


def reg(rid: int, origin: str = "decode", rank: int = 0, tp: int = 1) -> Registration:
    return Registration(registration_id=rid, origin=origin, transfer_id="t", producer_engine_id="e",
                        producer_tp_size=1, consumer_agent="agent", consumer_rank=rank, consumer_tp_size=tp,
                        block_ids=(1, 2))


def failed(acts: list) -> list[Deliver]:  # type: ignore[type-arg]
    return [a for a in acts if isinstance(a, Deliver) and a.completion.kind is CompletionKind.FAILED]


def test_a_waiting_publish_fails_at_once_and_a_later_one_too() -> None:
    s = SendSide(publish_timeout_s=120.0, registration_timeout_s=100.0)
    assert s.publish(T0, WorkerRef("pw", "e", 0, 1), Publish("t", (5, 6))) == []
    (d,) = failed(s.decline(T0 + 1, "decode", "e", "t", "the decode daemon was down"))
    assert d.worker_id == "pw" and d.completion.code is FailureCode.ABORTED
    assert d.completion.block_ids == (5, 6) and "the decode daemon was down" in d.completion.reason
    assert len(s) == 0 and s.next_deadline() is None
    (d,) = failed(s.publish(T0 + 2, WorkerRef("pw", "e", 0, 1), Publish("t", (7,))))  # remembered: fails at once
    assert d.completion.block_ids == (7,) and len(s) == 0
    # another engine's transfer of the same id is not touched
    assert s.publish(T0 + 2, WorkerRef("pw2", "other", 0, 1), Publish("t", (8,))) == []
    assert len(s) == 1
    # forgotten after publish_timeout_s: the id may be used again
    assert s.publish(T0 + 130, WorkerRef("pw", "e", 0, 1), Publish("t", (9,))) == []
    assert len(s) == 2


def test_decline_before_the_publish_and_the_cap() -> None:
    s = SendSide(publish_timeout_s=120.0, registration_timeout_s=100.0)
    assert s.decline(T0, "decode", "e", "t", "why") == []
    assert failed(s.publish(T0 + 1, WorkerRef("pw", "e", 0, 1), Publish("t", (5,))))
    for i in range(send.MAX_DECLINED + 10):  # bounded whatever a peer sends
        s.decline(T0 + 2, "decode", "e", f"x{i}", "why")
    assert len(s._declined._by_key) == send.MAX_DECLINED


def test_only_the_registering_daemon_may_decline_and_its_registration_is_dropped() -> None:
    s = SendSide(publish_timeout_s=120.0, registration_timeout_s=100.0)
    s.register(T0, reg(7, origin="decode-a", rank=0, tp=2))
    with pytest.raises(PermissionDenied):
        s.decline(T0 + 1, "decode-b", "e", "t", "rogue")
    acts = s.decline(T0 + 1, "decode-a", "e", "t", "rank 1's Expect never reached its daemon")
    notices = [a for a in acts if isinstance(a, SendFailNotice)]
    assert [(n.origin, n.registration_id, n.code) for n in notices] == [("decode-a", 7, FailureCode.ABORTED)]
    assert len(s) == 0 and s.held_by("decode-a") == (0, 0)


def test_a_write_in_flight_settles_before_the_publish_fails() -> None:
    s = SendSide(publish_timeout_s=120.0, registration_timeout_s=100.0)
    s.publish(T0, WorkerRef("pw", "e", 0, 1), Publish("t", (5, 6)))
    (w,) = [a for a in s.register(T0, reg(7, tp=1)) if isinstance(a, StartWrite)]
    acts = s.decline(T0 + 1, "decode", "e", "t", "why")
    assert not failed(acts) and not [a for a in acts if isinstance(a, SendFailNotice)]  # bytes may land
    acts = s.write_done(w.leg, True)
    assert [a.completion.code for a in failed(acts)] == [FailureCode.ABORTED]
    assert [a.registration_id for a in acts if isinstance(a, SendFailNotice)] == [7]
