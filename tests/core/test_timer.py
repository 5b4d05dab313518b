"""Deadlines need no polling: the node arms one timer at the core's next deadline.

A fake loop records what the node schedules and a fake clock stands in for time.monotonic, so
the lease's expiry is shown without sleeping: the only callback ever scheduled is due exactly at
the publish lease's end (not a tick every few milliseconds), and firing it fails the publish.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable

import pytest
from support.core import WorkerRef

from kvpushd import config
from kvpushd.app import observe
from kvpushd.core.types import Completion, CompletionKind, FailureCode, Publish
from kvpushd.runtime import node as node_mod
from kvpushd.runtime.node import Node
from kvpushd.runtime.observe import Ended


class FakeClock:
    def __init__(self, t: float) -> None:
        self.t = t

    def monotonic(self) -> float:
        return self.t

    def time(self) -> float:
        return 1.7e9 + self.t

    def perf_counter(self) -> float:
        return self.t


class FakeLoop:
    """Records call_later; nothing runs until the test fires it. What call_soon schedules (the end of
    the turn) runs before the timers are looked at, as a loop runs its ready callbacks first."""

    def __init__(self) -> None:
        self.scheduled: list[tuple[float, Callable[[], None], asyncio.TimerHandle]] = []
        self.ready: list[Callable[[], None]] = []

    def call_soon(self, cb: Callable[[], None]) -> None:
        self.ready.append(cb)

    def call_later(self, delay: float, cb: Callable[[], None]) -> asyncio.TimerHandle:
        h = asyncio.TimerHandle(0.0, cb, (), asyncio.new_event_loop())
        self.scheduled.append((delay, cb, h))
        return h

    def live(self) -> list[tuple[float, Callable[[], None], asyncio.TimerHandle]]:
        while self.ready:
            self.ready.pop(0)()
        return [s for s in self.scheduled if not s[2].cancelled()]

    def fire(self) -> None:
        """The loop runs the one live timer (a fired handle is no longer scheduled)."""
        (entry,) = self.live()
        self.scheduled.remove(entry)
        entry[1]()


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    c = FakeClock(1000.0)
    monkeypatch.setattr(node_mod, "time", c)
    return c


def test_a_lease_expires_at_its_deadline_from_one_timer(clock: FakeClock) -> None:
    cfg = config.from_dict({"transfer": {"publish_timeout_s": 30.0}})
    n = Node(cfg)
    observe(n)
    ex = rv = n
    loop = FakeLoop()
    ex._loop = loop  # type: ignore[assignment]  # what start() sets, without the NIXL thread
    failures: list[Completion] = []
    n.obs.on(Ended, lambda r: failures.append(r.completion) if r.completion.kind is CompletionKind.FAILED else None)

    ex.run(rv.send.publish(clock.t, WorkerRef("w1", "prefill", 0, 1), Publish("req-1", [3, 4])))
    (delay, _, _), = loop.live()
    assert delay == pytest.approx(30.0, abs=0.01)  # one timer, at the lease's end: no polling tick

    # A second transfer with a later deadline arms nothing new; an earlier one re-arms.
    clock.t += 5
    ex.run(rv.send.publish(clock.t, WorkerRef("w1", "prefill", 0, 1), Publish("req-2", [5])))
    assert len(loop.live()) == 1

    clock.t = 1000.0 + 30.0 + 0.002
    loop.fire()
    assert [(e.transfer_id, e.code) for e in failures] == [("req-1", FailureCode.TIMEOUT)]
    (delay, _, _), = loop.live()  # re-armed for req-2, 35 s after the start
    assert clock.t + delay == pytest.approx(1035.0, abs=0.01)
    clock.t = 1035.01
    loop.fire()
    assert [e.transfer_id for e in failures] == ["req-1", "req-2"]
    assert loop.live() == [] and rv.send.next_deadline() is None


def test_early_fire_only_rearms(clock: FakeClock) -> None:
    """A timer that fires before the deadline (a coarse loop clock) changes nothing but re-arms."""
    n = Node(config.from_dict({"transfer": {"expect_timeout_s": 10.0}}))
    ex = rv = n
    loop = FakeLoop()
    ex._loop = loop  # type: ignore[assignment]
    ex.run(rv.send.publish(clock.t, WorkerRef("w1", "prefill", 0, 1), Publish("req-1", [1])))
    assert len(loop.live()) == 1
    clock.t += 1.0
    loop.fire()
    assert len(rv.send) == 1 and len(loop.live()) == 1


def test_no_periodic_deadline_tick_in_the_runtime() -> None:
    import kvpushd.runtime as rt

    src = inspect.getsource(node_mod) + inspect.getsource(rt)
    assert "tick_forever" not in src and ".tick(" in inspect.getsource(node_mod.Node._on_timer)
