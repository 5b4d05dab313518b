"""``kvpushd demo --mode bytes``: stand-in workers moving random bytes, every block checked."""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import random
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
from kvpushd_client.types import Command, Expect, Publish, TransferMode

from .. import launch
from .options import POISON, Layout


def _worker_main(role: str, sock: str, layout: Layout, seed: int, conn: Connection) -> None:
    """A stand-in engine worker: owns its KV memory, talks to its daemon via the client library."""
    from kvpushd_client import KVPushClient, Region, Role, SealedBuffer

    buf = SealedBuffer.create(f"kvpushd-demo-{role}", layout.total_bytes)
    arr = np.frombuffer(buf.mmap, dtype=np.uint8)
    if role == "prefill":
        arr[:] = np.random.default_rng(seed).integers(0, 256, arr.size, dtype=np.uint8)
    else:
        arr[:] = POISON
    del arr
    client = KVPushClient(sock)
    client.wait_ready()
    regions = [Region(0, i * layout.region_bytes, layout.num_blocks, layout.block_len) for i in range(layout.regions)]
    w = client.attach(f"demo-{role}", Role.PRODUCER if role == "prefill" else Role.CONSUMER, 0, 1,
                      [buf.memory], regions, description=f"kvpushd demo {role} pid {os.getpid()}")
    lock = threading.Lock()
    conn.send(("ready", buf.path, w.peer_address))

    def pump() -> None:
        while True:
            try:
                c = w.next_completion(1.0)
            except Exception:
                return
            if c is not None:
                with lock:
                    conn.send(("done", c.transfer_id, c.kind.name, c.code, c.reason))

    threading.Thread(target=pump, daemon=True).start()
    try:
        while True:
            msg = conn.recv()  # an Expect or Publish record, or "stop"
            if msg == "stop":
                break
            try:
                w.send(msg)
            except Exception as e:  # report, the demo counts it as failed
                with lock:
                    conn.send(("done", msg.transfer_id, "FAILED", "RPC", str(e)))
    finally:
        w.detach()
        client.close()
        buf.close()


# ---------------------------------------------------------------------------------------------
# Orchestration


def _rss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


@dataclass
class _Req:
    tid: str
    src: list[int]
    dst: list[int]
    order: str
    t_second: float = 0.0
    t_recv: float = 0.0
    sent: str = ""
    recv: str = ""
    reason: str = ""
    done: threading.Event = field(default_factory=threading.Event)


class _Demo:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        bpr = max(1, math.ceil(args.prompt_tokens / args.block_size))
        self.bpr = bpr
        self.layout = Layout(args.layers, args.block_size, args.kv_heads, args.head_dim, 2,
                             num_blocks=bpr * (args.concurrency + 2))
        self.workdir = args.workdir or tempfile.mkdtemp(prefix="kvpushd-demo-")
        self.daemons: list[launch.Daemon] = []
        self.reqs: dict[str, _Req] = {}
        self.lock = threading.Lock()

    def log(self, msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    def start_daemon(self, name: str) -> str:
        """Start a daemon (not waited for: the workers wait for it); its worker socket."""
        self.daemons.append(launch.spawn(self.workdir, name, die_with_parent=True))
        return self.daemons[-1].sock

    def run(self) -> dict[str, Any]:
        from kvpushd_client import SealedBuffer

        a = self.args
        lay = self.layout
        p_sock = self.start_daemon("prefill-node")
        d_sock = self.start_daemon("decode-node")
        self.log(f"kvpushd demo: 2 daemons, 2 workers, {lay.regions} regions x {lay.num_blocks} blocks of "
                 f"{lay.block_len} B; {a.requests} requests of {a.prompt_tokens} tokens ({self.bpr} blocks, "
                 f"{self.bpr * lay.block_len * lay.regions / 2**20:.1f} MiB each); logs in {self.workdir}")
        ctx = mp.get_context("spawn")
        conns: dict[str, Connection] = {}
        procs = []
        for role, sock in (("prefill", p_sock), ("decode", d_sock)):
            mine, theirs = ctx.Pipe()
            pr = ctx.Process(target=_worker_main, args=(role, sock, lay, a.seed, theirs), daemon=True)
            pr.start()
            procs.append(pr)
            conns[role] = mine
        info = {}
        for role, c in conns.items():
            if not c.poll(120):
                raise RuntimeError(f"{role} worker did not start; see {self.workdir}")
            msg = c.recv()
            info[role] = msg
        p_addr = info["prefill"][2]
        src_buf = SealedBuffer.open(info["prefill"][1], lay.total_bytes)
        dst_buf = SealedBuffer.open(info["decode"][1], lay.total_bytes)
        src = np.frombuffer(src_buf.mmap, dtype=np.uint8).reshape(lay.regions, lay.num_blocks, lay.block_len)
        dst = np.frombuffer(dst_buf.mmap, dtype=np.uint8).reshape(lay.regions, lay.num_blocks, lay.block_len)
        send_lock = threading.Lock()

        def send(role: str, msg: Command | str) -> None:
            with send_lock:
                conns[role].send(msg)

        for role in conns:
            threading.Thread(target=self._collect, args=(role, conns[role]), daemon=True).start()

        # FIFO free lists, like vLLM's free block queue: runs of adjacent blocks are common but
        # not guaranteed once requests finish out of order.
        free_src = list(range(lay.num_blocks))
        free_dst = list(range(lay.num_blocks))
        slots = threading.Semaphore(a.concurrency)
        stats = {"completed": 0, "failed": 0, "bytes_moved": 0, "bytes_verified": 0, "mismatched_bytes": 0}
        orders = {"expect_first": 0, "publish_first": 0}
        lat: list[float] = []
        t0 = time.perf_counter()
        last_progress = 0.0
        finished = 0
        pending: list[_Req] = []

        def settle(r: _Req) -> None:
            nonlocal finished
            src_i = np.asarray(r.src)
            dst_i = np.asarray(r.dst)
            if r.sent == "FINISHED_SENDING" and r.recv == "FINISHED_RECEIVING":
                diff = int(np.count_nonzero(dst[:, dst_i, :] != src[:, src_i, :]))
                stats["mismatched_bytes"] += diff
                stats["bytes_verified"] += dst[:, dst_i, :].size
                stats["bytes_moved"] += dst[:, dst_i, :].size
                stats["completed" if diff == 0 else "failed"] += 1
                lat.append(r.t_recv - r.t_second)
            else:
                stats["failed"] += 1
                self.log(f"request {r.tid} failed: send={r.sent} recv={r.recv} {r.reason}")
            dst[:, dst_i, :] = POISON  # freed blocks go back to poison: stray writes become visible
            free_dst.extend(r.dst)
            free_src.extend(r.src)
            finished += 1
            slots.release()

        rss_warm: list[int] = []
        for i in range(a.requests):
            if i == max(1, a.requests // 10):
                rss_warm = [_rss_kib(d.pid) for d in self.daemons]
            while not slots.acquire(timeout=0.05):
                pending = self._reap(pending, settle)
            pending = self._reap(pending, settle)
            tid = f"demo-{i:06d}-{os.urandom(3).hex()}"
            s_blocks = [free_src.pop(0) for _ in range(self.bpr)]
            d_blocks = [free_dst.pop(0) for _ in range(self.bpr)]
            order = self.rng.choice(("expect_first", "publish_first"))
            orders[order] += 1
            r = _Req(tid, s_blocks, d_blocks, order)
            with self.lock:
                self.reqs[tid] = r
            pending.append(r)
            mode = TransferMode.parse(getattr(a, "transfer_mode", "push"))
            first: tuple[str, Command] = ("decode", Expect(tid, tuple(d_blocks), p_addr, "demo-prefill", 1,
                                                           transfer_mode=mode))
            second: tuple[str, Command] = ("prefill", Publish(tid, tuple(s_blocks)))
            if order == "publish_first":
                first, second = second, first
            send(*first)
            delay = self.rng.uniform(0, 0.003)

            def fire(r: _Req = r, second: tuple[str, Command] = second) -> None:
                r.t_second = time.perf_counter()
                send(*second)

            threading.Timer(delay, fire).start()
            now = time.perf_counter()
            if (not a.json or sys.stderr.isatty()) and now - last_progress > 0.5:
                last_progress = now
                self.log(f"  {finished}/{a.requests} done, {stats['failed']} failed, "
                         f"{stats['bytes_moved'] / 1e9:.2f} GB moved")
        deadline = time.monotonic() + 120
        while pending and time.monotonic() < deadline:
            pending = self._reap(pending, settle)
            time.sleep(0.005)
        for r in pending:
            r.reason = "no completion within 120 s"
            settle(r)
        wall = time.perf_counter() - t0
        outside = int(np.count_nonzero(dst != POISON))  # everything was freed: all must be poison
        stats["mismatched_bytes"] += outside
        rss_end = [_rss_kib(d.pid) for d in self.daemons]
        from kvpushd.ctl import fetch

        p_status = fetch(p_sock)
        for role in conns:
            send(role, "stop")
        for pr in procs:
            pr.join(30)
        src_buf.close()  # views into the maps die with this process
        dst_buf.close()
        lat.sort()

        def pct(q: float) -> float | None:
            return round(lat[min(len(lat) - 1, int(q * len(lat)))] * 1e3, 3) if lat else None

        return {
            "mode": "bytes", "transfer_mode": getattr(a, "transfer_mode", "push"), "requests": a.requests, **stats,
            "bytes_outside_requests": outside,
            "arrival_orders": orders, "prompt_tokens": a.prompt_tokens, "blocks_per_request": self.bpr,
            "regions": lay.regions, "block_len": lay.block_len, "wall_s": round(wall, 3),
            "throughput_gbps": round(stats["bytes_moved"] / wall / 1e9, 3) if wall else 0.0,
            "second_arrival_to_received_ms": {"p50": pct(0.5), "p99": pct(0.99)},
            "descriptors_requested": p_status.counters.descriptors_requested,
            "descriptors_posted": p_status.counters.descriptors_posted,
            # The daemons' memory must not grow with the number of requests served.
            "daemon_rss_kib": {name: {"after_warmup": w, "end": e}
                               for name, w, e in zip(("prefill", "decode"), rss_warm or rss_end, rss_end,
                                                     strict=True)},
            "workdir": self.workdir,
        }

    def _reap(self, pending: list[_Req], settle: Any) -> list[_Req]:
        keep = []
        for r in pending:
            if r.sent and r.recv:
                settle(r)
            else:
                keep.append(r)
        return keep

    def _collect(self, role: str, conn: Connection) -> None:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return
            if msg[0] != "done":
                continue
            _, tid, kind, code, reason = msg
            with self.lock:
                r = self.reqs.get(tid)
            if r is None:
                continue
            if kind == "FAILED":
                r.reason += f" [{role}: {code} {reason}]"
            if role == "prefill":
                r.sent = kind
            else:
                r.t_recv = time.perf_counter()
                r.recv = kind

    def stop(self) -> None:
        launch.stop_all(self.daemons)
