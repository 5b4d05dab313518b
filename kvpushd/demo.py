"""``kvpushd demo``: the main job on built-in defaults, on one machine.

Starts a prefill-node daemon and a decode-node daemon (real processes), a prefill worker and a
decode worker (real processes, using the client library) whose KV regions live in POSIX shared
memory in vLLM's layout (layers x K/V x blocks), then runs N requests with concurrent dispatch in
both arrival orders. Every destination block is checked byte for byte against its source; freed
destination blocks are re-poisoned, so at the end the whole decode memory must be poison again:
any byte written outside a request's blocks shows up as a mismatch.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

POISON = 0x5A


@dataclass(frozen=True)
class Layout:
    layers: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    num_blocks: int

    @property
    def block_len(self) -> int:
        return self.block_size * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def regions(self) -> int:
        return self.layers * 2  # K and V per layer (vLLM's split layout)

    @property
    def region_bytes(self) -> int:
        return self.num_blocks * self.block_len

    @property
    def total_bytes(self) -> int:
        return self.regions * self.region_bytes


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=64, help="number of requests (default 64)")
    p.add_argument("--prompt-tokens", type=int, default=1024, help="tokens per prompt (default 1024)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at once (default 8)")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--workdir", help="where sockets and logs go (default: a temporary directory)")


# ---------------------------------------------------------------------------------------------
# Worker processes


def _worker_main(role: str, sock: str, layout: Layout, seed: int, conn: Connection) -> None:
    """A stand-in engine worker: owns its KV memory, talks to its daemon via the client library."""
    from kvpushd_client import KVPushClient, Region, Role, SharedBuffer

    buf = SharedBuffer.create(f"kvpushd-demo-{role}", layout.total_bytes)
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
    conn.send(("ready", buf.name, w.peer_address))

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
            msg = conn.recv()
            try:
                if msg[0] == "expect":
                    w.expect(msg[1], msg[2], msg[3], "demo-prefill", 1)
                elif msg[0] == "publish":
                    w.publish(msg[1], msg[2])
                elif msg[0] == "stop":
                    break
            except Exception as e:  # report, the demo counts it as failed
                with lock:
                    conn.send(("done", msg[1], "FAILED", "RPC", str(e)))
    finally:
        w.detach()
        client.close()
        buf.close(unlink=True)


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
        self.daemons: list[subprocess.Popen[bytes]] = []
        self.reqs: dict[str, _Req] = {}
        self.lock = threading.Lock()

    def log(self, msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    def start_daemon(self, name: str) -> tuple[str, str]:
        sock = os.path.join(self.workdir, f"{name}.sock")
        port = _free_port()
        logf = open(os.path.join(self.workdir, f"{name}.log"), "wb")  # noqa: SIM115 - lives as long as the daemon
        self.daemons.append(subprocess.Popen(
            [sys.executable, "-m", "kvpushd", "serve", "--socket", sock, "--listen", f"127.0.0.1:{port}",
             "--node-id", name], stdout=logf, stderr=subprocess.STDOUT))
        return sock, f"127.0.0.1:{port}"

    def run(self) -> dict[str, Any]:
        from kvpushd_client import SharedBuffer

        a = self.args
        lay = self.layout
        p_sock, _ = self.start_daemon("prefill-node")
        d_sock, _ = self.start_daemon("decode-node")
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
        src_buf = SharedBuffer(info["prefill"][1], lay.total_bytes, create=False)
        dst_buf = SharedBuffer(info["decode"][1], lay.total_bytes, create=False)
        src = np.frombuffer(src_buf.mmap, dtype=np.uint8).reshape(lay.regions, lay.num_blocks, lay.block_len)
        dst = np.frombuffer(dst_buf.mmap, dtype=np.uint8).reshape(lay.regions, lay.num_blocks, lay.block_len)
        send_lock = threading.Lock()

        def send(role: str, msg: tuple[Any, ...]) -> None:
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
            first: tuple[str, tuple[Any, ...]] = ("decode", ("expect", tid, d_blocks, p_addr))
            second: tuple[str, tuple[Any, ...]] = ("prefill", ("publish", tid, s_blocks))
            if order == "publish_first":
                first, second = second, first
            send(*first)
            delay = self.rng.uniform(0, 0.003)

            def fire(r: _Req = r, second: tuple[str, tuple[Any, ...]] = second) -> None:
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
            send(role, ("stop",))
        for pr in procs:
            pr.join(30)
        src_buf.close(unlink=False)  # the workers unlink; views into the maps die with this process
        dst_buf.close(unlink=False)
        lat.sort()

        def pct(q: float) -> float | None:
            return round(lat[min(len(lat) - 1, int(q * len(lat)))] * 1e3, 3) if lat else None

        return {
            "requests": a.requests, **stats, "bytes_outside_requests": outside,
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
        for d in self.daemons:
            if d.poll() is None:
                d.send_signal(signal.SIGTERM)
        for d in self.daemons:
            try:
                d.wait(30)
            except subprocess.TimeoutExpired:
                d.kill()


def run_demo(args: argparse.Namespace) -> int:
    demo = _Demo(args)
    try:
        out = demo.run()
    finally:
        demo.stop()
    if args.json:
        print(json.dumps(out))
    else:
        print(f"requests {out['requests']}: completed {out['completed']}, failed {out['failed']}")
        print(f"bytes moved {out['bytes_moved']:,}  verified {out['bytes_verified']:,}  "
              f"mismatched {out['mismatched_bytes']:,} (outside requests {out['bytes_outside_requests']:,})")
        print(f"arrival orders {out['arrival_orders']}; {out['throughput_gbps']} GB/s over {out['wall_s']} s; "
              f"second arrival -> received p50 {out['second_arrival_to_received_ms']['p50']} ms, "
              f"p99 {out['second_arrival_to_received_ms']['p99']} ms")
        print(f"descriptors {out['descriptors_requested']:,} requested -> {out['descriptors_posted']:,} "
              "after merging adjacent blocks")
    ok = out["failed"] == 0 and out["mismatched_bytes"] == 0 and out["completed"] == out["requests"]
    return 0 if ok else 1
