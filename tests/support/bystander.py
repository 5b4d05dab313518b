"""What a broken or hostile caller must not cost the daemon it calls, measured while it acts: GetStatus
answered every 20 ms (the slowest answer), the daemon's RSS (its peak and its level after), and a
legitimate transfer registered before the act and published after it, which must land exact bytes.

    with Bystander(p, pw, dw, src, dst, target=p) as b:
        ...  # the hostile caller's act
    b.check()
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from kvpushd_client import CompletionKind, Expect, Publish
from kvpushd_client.proto.v1 import status_pb2

from . import rss

if TYPE_CHECKING:
    from . import KV
    from .daemons import DaemonProc

STATUS_BOUND_S = 0.1  # GetStatus within 100 ms (the bound) ...
STATUS_SLACK_S = 0.4  # ... with room for a loaded test machine
RSS_BOUND = 150 << 20


class StatusProbe:
    """GetStatus every 20 ms in a thread while it runs, and the daemon's RSS at each: the slowest answer
    and the highest RSS."""

    def __init__(self, target: DaemonProc) -> None:
        self.target, self.worst, self.peak = target, 0.0, rss(target.pid)
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        stub = self.target.client.status_stub
        while not self._stop.is_set():
            t0 = time.perf_counter()
            stub.GetStatus(status_pb2.GetStatusRequest(), timeout=10)
            self.worst = max(self.worst, time.perf_counter() - t0)
            self.peak = max(self.peak, rss(self.target.pid))
            time.sleep(0.02)

    def __enter__(self) -> StatusProbe:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(15)


def transfer(p: DaemonProc, pw: Any, dw: Any, src: KV, dst: KV, tid: str, a: int, b: int) -> None:
    """Decode block ``a`` from prefill block ``b``, both legs at once: exact bytes."""
    dw.send(Expect(tid, (a,), p.peer_address, "prefill", 1))
    pw.send(Publish(tid, (b,)))
    assert dw.next_completion(30).kind is CompletionKind.FINISHED_RECEIVING
    assert pw.next_completion(30).kind is CompletionKind.FINISHED_SENDING
    assert (dst.arr[:, a] == src.arr[:, b]).all()


class Bystander:
    """A transfer from ``pw`` (on prefill daemon ``p``) to ``dw`` registered on entry, published on exit,
    while ``target``'s GetStatus and RSS are watched; ``check`` asserts the bounds, ``line`` says them."""

    def __init__(self, p: DaemonProc, pw: Any, dw: Any, src: KV, dst: KV, target: DaemonProc,
                 blocks: tuple[int, int] = (3, 4)) -> None:
        self.p, self.pw, self.dw, self.src, self.dst, self.target = p, pw, dw, src, dst, target
        self.a, self.b = blocks
        self.tid = f"beside-{self.a}-{self.b}"
        self.base = self.after = 0
        self.probe = StatusProbe(target)
        self.took = 0.0

    def __enter__(self) -> Bystander:
        self.dw.send(Expect(self.tid, (self.a,), self.p.peer_address, "prefill", 1))  # pending while the act runs
        self.base = rss(self.target.pid)
        self.probe.__enter__()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.took = time.perf_counter() - self._t0
        self.probe.__exit__()
        if exc[0] is not None:
            return
        self.pw.send(Publish(self.tid, (self.b,)))
        assert self.dw.next_completion(30).kind is CompletionKind.FINISHED_RECEIVING
        assert self.pw.next_completion(30).kind is CompletionKind.FINISHED_SENDING
        self.after = rss(self.target.pid)

    def line(self, what: str) -> str:
        return (f"{what}: act {self.took:.1f} s; GetStatus worst {self.probe.worst * 1e3:.1f} ms; RSS base "
                f"{self.base >> 20} MiB, peak +{(self.probe.peak - self.base) >> 20} MiB, "
                f"after +{(self.after - self.base) >> 20} MiB; transfer beside exact")

    def check(self) -> None:
        assert (self.dst.arr[:, self.a] == self.src.arr[:, self.b]).all(), "the transfer beside was not exact"
        assert self.probe.worst < STATUS_BOUND_S + STATUS_SLACK_S, self.probe.worst
        assert self.probe.peak - self.base < RSS_BOUND, (self.probe.peak - self.base) >> 20
        assert self.after - self.base < RSS_BOUND, (self.after - self.base) >> 20
