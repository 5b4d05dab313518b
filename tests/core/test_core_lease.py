"""The prefill-side publish lease (kvpushd/core/send.py SendSide.tick): a publish is held
while the decode side holds it (a WRITE from it in flight, or a registration it wrote into still
waiting for other producer ranks) and expires after publish_timeout_s otherwise."""

from __future__ import annotations

from support.core import WorkerRef

from kvpushd.core.actions import Deliver, Registration, SendFailNotice, StartWrite
from kvpushd.core.send import SendSide
from kvpushd.core.types import CompletionKind, FailureCode, Publish

T0 = 1000.0


def reg(rid: int, rank: int, tp: int, blocks: tuple[int, ...] = (1, 2)) -> Registration:
    return Registration(registration_id=rid, origin="decode", transfer_id="t", producer_engine_id="e",
                        producer_tp_size=1, consumer_agent="agent", consumer_rank=rank, consumer_tp_size=tp,
                        block_ids=blocks)


def test_write_in_flight_is_not_expired_even_with_a_target_missing() -> None:
    """Producer TP 1 -> consumer TP 2: rank 0 registered (its WRITE in flight), rank 1 never."""
    s = SendSide(publish_timeout_s=1.0, registration_timeout_s=100.0)
    s.publish(T0, WorkerRef("pw", "e", 0, 1), Publish("t", (5, 6)))
    writes = [a for a in s.register(T0 + 0.1, reg(7, 0, 2)) if isinstance(a, StartWrite)]
    assert len(writes) == 1
    for k in range(1, 6):  # well past publish_timeout_s: the WRITE holds the lease
        assert s.tick(T0 + 2.0 * k) == []
    assert len(s) == 1
    acts = s.write_done(writes[0].leg, True)
    assert acts == []  # rank 1 still not registered: the publish waits for it
    acts = s.tick(T0 + 20.0)  # nothing holds the lease any more: it expires, both sides told
    done = [a for a in acts if isinstance(a, Deliver)]
    assert len(done) == 1 and done[0].completion.kind is CompletionKind.FAILED
    assert done[0].completion.code is FailureCode.TIMEOUT and done[0].completion.block_ids == (5, 6)
    assert len(s) == 0


def test_unmatched_publish_expires_and_tells_the_registered_side() -> None:
    s = SendSide(publish_timeout_s=1.0, registration_timeout_s=100.0)
    s.publish(T0, WorkerRef("pw", "e", 0, 1), Publish("t", (5, 6)))
    assert s.tick(T0 + 0.5) == []
    acts = s.tick(T0 + 1.5)
    assert [a.completion.code for a in acts if isinstance(a, Deliver)] == [FailureCode.TIMEOUT]
    assert not [a for a in acts if isinstance(a, SendFailNotice)]  # nobody registered: nobody to tell
    assert len(s) == 0
