"""The engines of ``kvpushd bench fleet``: every node's workers and the router, in one engine thread.

Each node has ``tp`` workers (one per TP rank), each a ``ReconnectingStreamWorker`` on its node's
daemon (the attachment the vLLM connector uses: re-made after a daemon restart), with its KV in
POSIX shared memory: ``regions`` regions of ``num_blocks`` blocks; a node's block is ``block_len``
bytes, a rank's is ``block_len / tp`` (its share of the KV heads, as in vLLM's HND layout). The
router sends each request to a random (prefill node, decode node) pair, push or pull at random:
every decode rank Expects, every prefill rank Publishes, one side first and the other a tick later.

A side ends with its completion, or as the connector ends it: a command refused while not
attached (REFUSED), or an attachment lost with the daemon (LOST). A decode side that ended so
declines the transfer once re-attached, as the connector does. A request finished when every side
finished; its destination bytes are then compared with its source bytes (over all ranks, the
node's logical blocks), and its destination blocks go back to poison when freed.
"""

from __future__ import annotations

import collections
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
from kvpushd_client import CompletionKind, Decline, Expect, Publish, Region, Role, SealedBuffer, TransferMode
from kvpushd_client.reconnect import Call, LinkEvent, ReconnectingStreamWorker

from .common import POISON

TICK_S = 0.002


@dataclass(eq=False)
class Side:
    req: Req
    kind: str  # "prefill" | "decode"
    rank: int
    call: Call | None = None
    ended: bool = False


@dataclass(eq=False)
class Req:
    tid: str
    p: int
    d: int
    mode: str
    src: list[int]
    dst: list[int]
    t0: float
    left: dict[str, int] = field(default_factory=dict)  # sides not yet ended, per kind
    ok: bool = True
    code: str = ""
    mismatched: int = 0


class Worker:
    """One TP rank of one node: its KV memory and its link to the node's daemon."""

    def __init__(self, node: Node, rank: int, seed: int) -> None:
        self.node, self.rank = node, rank
        blen = node.block_len // node.tp
        size = node.regions * node.num_blocks * blen
        self.buf = SealedBuffer.create(f"kvpushd-fleet-{node.name}-r{rank}", size)
        self.arr: npt.NDArray[np.uint8] = np.frombuffer(self.buf.mmap, dtype=np.uint8).reshape(
            node.regions, node.num_blocks, blen)
        if node.role == "prefill":
            vals = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
            self.arr[:] = vals.reshape(self.arr.shape)
        else:
            self.arr[:] = POISON
        regions = [Region(0, i * node.num_blocks * blen, node.num_blocks, blen) for i in range(node.regions)]
        self.link = ReconnectingStreamWorker(node.sock, dict(
            engine_id=node.engine_id, role=Role.PRODUCER if node.role == "prefill" else Role.CONSUMER,
            tp_rank=rank, tp_size=node.tp, memory=[self.buf.memory], regions=regions,
            description=f"kvpushd bench fleet {node.name} rank {rank}"), reconnect_interval_s=0.25)
        self.pending: dict[str, Side] = {}

    def close(self) -> None:
        self.link.close()
        del self.arr
        self.buf.close()


class Node:
    def __init__(self, role: str, index: int, tp: int, sock: str, address: str, regions: int, num_blocks: int,
                 block_len: int) -> None:
        self.role, self.index, self.tp = role, index, tp
        self.name = f"{role[0]}{index}"
        self.engine_id = f"fleet-{self.name}"
        self.sock, self.address = sock, address
        self.regions, self.num_blocks, self.block_len = regions, num_blocks, block_len
        self.free: collections.deque[int] = collections.deque(range(num_blocks))
        self.workers: list[Worker] = []

    def logical(self, blocks: list[int]) -> npt.NDArray[np.uint8]:
        """The node's blocks over all ranks: each rank's share of the heads, in rank order."""
        return np.concatenate([w.arr[:, blocks, :] for w in self.workers], axis=2)


class Fleet:
    """The engine thread: issues requests at ``rate`` per second (at most ``concurrency`` in flight)
    while ``loading``, steps and polls every worker, ends what the links report, and counts."""

    def __init__(self, prefill: list[Node], decode: list[Node], *, rate: float, concurrency: int,
                 max_blocks: int, pull_share: float, deadline_s: float, seed: int, tag: str) -> None:
        self.prefill, self.decode = prefill, decode
        self.nodes = prefill + decode
        self.rate, self.concurrency, self.max_blocks = rate, concurrency, max_blocks
        self.pull_share, self.deadline_s = pull_share, deadline_s
        self.rng = random.Random(seed)
        self.tag = tag
        self.lock = threading.Lock()
        self.loading = False
        self._stop = False
        self._thread: threading.Thread | None = None
        self.error = ""
        self._t_load = 0.0
        self._issued_at_load = 0
        self.inflight: dict[str, Req] = {}
        self.later: list[tuple[float, Req, str]] = []  # (due, request, kind of its second side)
        self.issued = self.finished = self.failed = self.never_ended = 0
        self.by_mode: collections.Counter[str] = collections.Counter()
        self.failed_by_code: collections.Counter[str] = collections.Counter()
        self.outcomes: collections.Counter[str] = collections.Counter()  # "side:CODE" per side that ended
        self.stats: collections.Counter[str] = collections.Counter()
        self.never_ended_examples: list[str] = []
        self.mismatched_bytes = 0
        self.bytes_verified = 0
        self.pairs = [(p.index, d.index) for p in prefill for d in decode]
        self._mark = 0.0
        self._first_ok: dict[tuple[int, int], float] = {}  # pair -> end of its first finish issued after the mark

    # -- life -------------------------------------------------------------------------------------

    def attach_all(self, timeout_s: float = 60.0) -> None:
        for n in self.nodes:
            for w in n.workers:
                w.link.start(timeout_s)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="fleet-engines", daemon=True)
        self._thread.start()

    def load(self, on: bool) -> None:
        with self.lock:
            self.loading = on
            self._t_load = time.monotonic()
            self._issued_at_load = self.issued

    def stop(self) -> None:
        self._stop = True
        if self._thread is not None:
            self._thread.join(10)
        for n in self.nodes:
            for w in n.workers:
                w.close()

    def idle(self) -> bool:
        with self.lock:
            return not self.inflight

    def mark(self, t: float) -> None:
        """From now on ``first_ok`` tells, per pair, when its first request issued at or after ``t`` finished."""
        with self.lock:
            self._mark = t
            self._first_ok = {}

    def first_ok(self) -> dict[tuple[int, int], float | None]:
        with self.lock:
            return {k: self._first_ok.get(k) for k in self.pairs}

    # -- the loop -------------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            self._run()
        except BaseException as e:  # the bench stops at the next check, saying why
            self.error = f"the engine thread failed: {type(e).__name__}: {e}"
            raise

    def _run(self) -> None:
        next_check = 0.0
        workers = [w for n in self.nodes for w in n.workers]
        while not self._stop:
            with self.lock:
                now = time.monotonic()
                if self.loading:
                    self._issue(now)
                self._second_sides(now)
                self.rng.shuffle(workers)
                for w in workers:
                    w.link.step()
                for w in workers:
                    for ev in w.link.poll():
                        self._event(w, ev)
                if now >= next_check:
                    next_check = now + 0.2
                    self._deadlines(now)
            time.sleep(TICK_S)

    def _issue(self, now: float) -> None:
        due = int((now - self._t_load) * self.rate) - (self.issued - self._issued_at_load)
        for _ in range(max(0, min(due, self.concurrency - len(self.inflight)))):
            p, d = self.rng.choice(self.prefill), self.rng.choice(self.decode)
            k = self.rng.randint(1, self.max_blocks)
            if len(p.free) < k or len(d.free) < k:
                self.stats["deferred_no_blocks"] += 1
                return
            self.issued += 1
            mode = "pull" if self.rng.random() < self.pull_share else "push"
            self.by_mode[mode] += 1
            r = Req(f"fleet-{self.tag}-{self.issued}", p.index, d.index, mode,
                    [p.free.popleft() for _ in range(k)], [d.free.popleft() for _ in range(k)], now,
                    left={"prefill": p.tp, "decode": d.tp})
            self.inflight[r.tid] = r
            first = self.rng.choice(("prefill", "decode"))
            self._send(r, first)
            self.later.append((now + self.rng.uniform(0, 0.004), r, "decode" if first == "prefill" else "prefill"))

    def _second_sides(self, now: float) -> None:
        keep = []
        for item in self.later:
            if item[0] <= now:
                self._send(item[1], item[2])
            else:
                keep.append(item)
        self.later = keep

    def _send(self, r: Req, kind: str) -> None:
        p = self.prefill[r.p]
        node = p if kind == "prefill" else self.decode[r.d]
        for w in node.workers:
            s = Side(r, kind, w.rank)
            w.pending[r.tid] = s
            if kind == "prefill":
                s.call = w.link.send_nowait(Publish(r.tid, tuple(r.src)), tag=s)
            else:
                s.call = w.link.send_nowait(Expect(r.tid, tuple(r.dst), p.address, p.engine_id, p.tp,
                                                   transfer_mode=TransferMode.parse(r.mode)), tag=s)

    # -- what the links report --------------------------------------------------------------------

    def _event(self, w: Worker, ev: LinkEvent) -> None:
        if ev.kind == "completion":
            c = ev.completion
            assert c is not None
            s = w.pending.get(c.transfer_id)
            if s is None or s.call is None or s.call.epoch != ev.epoch:
                self.stats["unexpected_completions"] += 1
                return
            ok = c.kind is not CompletionKind.FAILED
            self._end(w, s, ok, "" if ok else c.code or "FAILED", unreachable=c.unanswered)
        elif ev.kind == "lost":
            self.stats["attachments_lost"] += 1
            for s in [s for s in w.pending.values() if s.call is not None and s.call.epoch is not None
                      and ev.epoch is not None and s.call.epoch <= ev.epoch]:
                self._end(w, s, False, "LOST", unreachable=True)
        elif ev.kind == "refused":
            s = ev.call.tag if ev.call is not None else None
            if isinstance(s, Side) and s.call is ev.call:
                self._end(w, s, False, "REFUSED", unreachable=True)

    def _end(self, w: Worker, s: Side, ok: bool, code: str, unreachable: bool = False) -> None:
        if s.ended:
            return
        s.ended = True
        w.pending.pop(s.req.tid, None)
        r = s.req
        self.outcomes[f"{s.kind}:{code or 'OK'}"] += 1
        p = self.prefill[r.p]
        if not ok and unreachable and s.kind == "decode":  # as the connector: tell the prefill daemon
            w.link.decline_nowait(Decline(r.tid, p.address, p.engine_id, f"fleet bench: expect ended {code}"))
        if not ok and r.ok:
            r.ok, r.code = False, code
        if r.tid not in self.inflight:  # ended after its deadline: counted as never ended already
            self.stats["ended_after_deadline"] += 1
            return
        r.left[s.kind] -= 1
        if r.left[s.kind] == 0:
            self._free(r, s.kind)
        if r.left["prefill"] == 0 and r.left["decode"] == 0:
            del self.inflight[r.tid]
            if r.ok and not r.mismatched:
                self.finished += 1
                if r.t0 >= self._mark:
                    self._first_ok.setdefault((r.p, r.d), time.monotonic())
            else:
                self.failed += 1
                self.failed_by_code[r.code or "MISMATCH"] += 1

    def _free(self, r: Req, kind: str) -> None:
        if kind == "prefill":
            self.prefill[r.p].free.extend(r.src)
            return
        d = self.decode[r.d]
        if r.ok:  # every decode rank finished receiving: the bytes are there
            dst = d.logical(r.dst)
            r.mismatched = int(np.count_nonzero(dst != self.prefill[r.p].logical(r.src)))
            self.mismatched_bytes += r.mismatched
            self.bytes_verified += dst.size
        for w in d.workers:
            w.arr[:, r.dst, :] = POISON
        d.free.extend(r.dst)

    def _deadlines(self, now: float) -> None:
        for r in [r for r in self.inflight.values() if now - r.t0 > self.deadline_s]:
            del self.inflight[r.tid]  # its blocks stay out of the free lists: a daemon may still write
            self.never_ended += 1
            if len(self.never_ended_examples) < 5:
                self.never_ended_examples.append(f"{r.tid} p{r.p}->d{r.d} {r.mode} left {r.left}")

    def figures(self) -> dict[str, Any]:
        with self.lock:
            return {"requests": self.issued, "finished": self.finished, "failed": self.failed,
                    "never_ended": self.never_ended, "failed_by_code": dict(sorted(self.failed_by_code.items())),
                    "never_ended_examples": list(self.never_ended_examples),
                    "transfer_modes": dict(self.by_mode), "outcomes_by_side": dict(sorted(self.outcomes.items())),
                    "mismatched_bytes": self.mismatched_bytes, "bytes_verified": self.bytes_verified,
                    **{k: self.stats[k] for k in ("unexpected_completions", "ended_after_deadline",
                                                  "attachments_lost", "deferred_no_blocks")}}
