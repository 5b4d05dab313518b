"""kvpushd_client.calls.CallQueue with a stand-in worker (no daemon): order, cancel, refusals as
REFUSED completions with their blocks, an Abort after an unsure outcome, dropped Abort refusals."""

from __future__ import annotations

import threading
from typing import Any

from kvpushd_client import CompletionKind, DaemonUnavailable, KVPushError
from kvpushd_client.calls import Call, CallQueue, CallState, DirectTarget
from kvpushd_client.types import Completion


class FakeWorker:
    """Records calls; ``fail[(method, transfer_id)]`` is raised instead; ``gate`` holds every call."""

    def __init__(self) -> None:
        self.made: list[tuple[str, str, tuple[int, ...], dict[str, Any]]] = []
        self.fail: dict[tuple[str, str], Exception] = {}
        self.gate = threading.Event()
        self.gate.set()

    def _call(self, method: str, tid: str, blocks: tuple[int, ...] = (), **kw: Any) -> None:
        self.gate.wait()
        self.made.append((method, tid, tuple(blocks), kw))
        if (method, tid) in self.fail:
            raise self.fail[(method, tid)]

    def expect(self, tid: str, blocks: tuple[int, ...], **kw: Any) -> None:
        self._call("Expect", tid, blocks, **kw)

    def publish(self, tid: str, blocks: tuple[int, ...]) -> None:
        self._call("Publish", tid, blocks)

    def abort(self, tid: str) -> bool:
        self._call("Abort", tid)
        return True


def queue_for(w: FakeWorker) -> tuple[CallQueue, list[Completion]]:
    got: list[Completion] = []
    return CallQueue(DirectTarget(w, got.append), name="test-calls"), got  # type: ignore[arg-type]


def test_calls_in_order_and_refusals_become_failed_completions() -> None:
    w = FakeWorker()
    w.fail[("Expect", "bad")] = KVPushError("INVALID_ARGUMENT", "block 99 out of range")
    w.fail[("Publish", "boom")] = RuntimeError("client bug")
    w.fail[("Abort", "nope")] = KVPushError("NOT_FOUND", "unknown")
    q, got = queue_for(w)
    q.submit(Call("Expect", "bad", (1, 99), expect_args={"producer_address": "p:1"}))
    q.submit(Call("Publish", "ok", (3,)))
    q.submit(Call("Publish", "boom", (4, 5)))
    q.submit(Call("Abort", "nope"))
    assert q.flush(30)
    assert [(m, t) for m, t, _, _ in w.made] == [("Expect", "bad"), ("Publish", "ok"), ("Publish", "boom"),
                                                 ("Abort", "nope")]
    assert w.made[0][3] == {"producer_address": "p:1"}
    bad, boom = got  # the refused Abort leaves no completion
    assert (bad.kind, bad.transfer_id, bad.code, bad.block_ids) == (CompletionKind.FAILED, "bad", "REFUSED", (1, 99))
    assert bad.reason == "Expect refused by the daemon: INVALID_ARGUMENT: block 99 out of range"
    assert (boom.code, boom.block_ids) == ("REFUSED", (4, 5)) and "client bug" in boom.reason
    q.close(join_timeout_s=10)


def test_unsure_outcome_is_followed_by_an_abort() -> None:
    w = FakeWorker()
    w.fail[("Publish", "slow")] = KVPushError("DEADLINE_EXCEEDED", "deadline")
    w.fail[("Expect", "down")] = DaemonUnavailable("UNAVAILABLE", "gone")
    q, got = queue_for(w)
    q.submit(Call("Publish", "slow", (7,)))
    q.submit(Call("Expect", "down", (8,)))
    assert q.flush(30)
    # the daemon may have taken the publish: it is aborted on the same attachment; a clear refusal is not
    assert [(m, t) for m, t, _, _ in w.made] == [("Publish", "slow"), ("Abort", "slow"), ("Expect", "down")]
    assert [(c.transfer_id, c.code) for c in got] == [("slow", "REFUSED"), ("down", "REFUSED")]
    q.close(join_timeout_s=10)


def test_cancel_only_while_queued() -> None:
    w = FakeWorker()
    w.gate.clear()
    q, _ = queue_for(w)
    first = q.submit(Call("Publish", "first", (1,)))
    second = q.submit(Call("Publish", "second", (2,)))
    assert not q.flush(0.05)  # held at the gate
    assert q.cancel(second) and second.state is CallState.CANCELLED
    w.gate.set()
    assert q.flush(30)
    assert not q.cancel(first) and first.state is CallState.STARTED and first.epoch == 1
    assert [t for _, t, _, _ in w.made] == ["first"]
    q.close(join_timeout_s=10)
