"""``kvpushd demo``: the main job on built-in defaults, on one machine.

Two modes, both with a prefill-node daemon and a decode-node daemon as real processes:

``--mode engine`` (default): a prefill engine process and a decode engine process, each running the
reference engine (``kvpushd.refengine``: a tiny deterministic transformer with a paged KV cache in
vLLM's HND layout over shared memory) with ``KVPushdHooks`` attached through its own node's daemon,
one worker per TP rank. The orchestrator dispatches requests concurrently in both arrival orders
(decode first: decode registers its blocks before prefill runs; prefill first: decode gets the
request after prefill finished) and checks three things per request: the decode engine's tokens
equal a monolithic run of the same model (computed here), the KV the decode engine received is
byte for byte the KV the prefill engine computed (both sides snapshot the request's blocks, all
layers, heads gathered over the TP ranks: prefill when its blocks are complete, decode the moment
the transfer is reported finished, before it decodes), and nothing outside a request's blocks was
written on the decode side (free blocks hold poison; allocations check it, frees restore it).

``--mode bytes``: two stand-in workers move random bytes in the same kind of layout (layers x K/V x
blocks). Every destination block is checked byte for byte against its source; freed destination
blocks are re-poisoned, so at the end the whole decode memory must be poison again: any byte written
outside a request's blocks shows up as a mismatch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing as mp
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
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


ENGINE_DEFAULTS = {"requests": 16, "prompt_tokens": 256, "layers": 4}
BYTES_DEFAULTS = {"requests": 64, "prompt_tokens": 1024, "layers": 16}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=("engine", "bytes"), default="engine",
                   help="engine: prefill and decode reference engines (a tiny transformer), tokens checked "
                        "against a monolithic run; bytes: stand-in workers moving random bytes (default engine)")
    p.add_argument("--requests", type=int, help="number of requests (default 16; bytes mode 64)")
    p.add_argument("--prompt-tokens", type=int, help="tokens per prompt (default 256; bytes mode 1024)")
    p.add_argument("--max-new-tokens", type=int, default=16, help="tokens each request generates (default 16)")
    p.add_argument("--prefill-tp", type=int, default=1, help="prefill engine TP size (default 1)")
    p.add_argument("--decode-tp", type=int, default=1, help="decode engine TP size (default 1)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at once (default 8)")
    p.add_argument("--layers", type=int, help="model / KV layers (default 4; bytes mode 16)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    p.add_argument("--prefill-block-size", type=int, help="tokens per block on prefill (default --block-size)")
    p.add_argument("--decode-block-size", type=int, help="tokens per block on decode (default --block-size)")
    p.add_argument("--kv-heads", type=int, default=4, help="bytes mode only (the engine's model has 4)")
    p.add_argument("--head-dim", type=int, default=64, help="bytes mode only (the engine's model has 16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--transfer-mode", choices=("push", "pull"), default="push",
                   help="push: the prefill daemon WRITEs; pull: the decode daemon READs (default push)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--workdir", help="where sockets and logs go (default: a temporary directory)")
    p.add_argument("--hosts", choices=("local", "netns"), default="local",
                   help="local (default): both nodes on this host's loopback; netns: the prefill daemon and "
                        "engine in one network namespace, the decode daemon and engine in another, joined by a "
                        "veth pair, UCX over TCP on it (needs root and iproute2; engine mode)")


def _resolve(args: argparse.Namespace) -> str:
    """Fill in the mode's defaults; return an error message, or "" when the arguments are usable."""
    defaults = ENGINE_DEFAULTS if args.mode == "engine" else BYTES_DEFAULTS
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    pbs = args.prefill_block_size if args.prefill_block_size is not None else args.block_size
    dbs = args.decode_block_size if args.decode_block_size is not None else args.block_size
    if pbs != dbs and args.mode == "bytes":
        return (f"--mode bytes moves whole blocks of one size (prefill {pbs}, decode {dbs} tokens per block); "
                "use --mode engine for different block sizes")
    args.block_size = args.prefill_block_size = pbs
    args.decode_block_size = dbs
    for name in ("requests", "prompt_tokens", "max_new_tokens", "prefill_tp", "decode_tp", "concurrency",
                 "layers", "prefill_block_size", "decode_block_size", "kv_heads", "head_dim"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1"
    if args.mode == "bytes":
        if args.hosts != "local":
            return "--hosts netns runs the engine mode (--mode engine) only"
        if args.prefill_tp != 1 or args.decode_tp != 1:
            return "--mode bytes runs TP1 -> TP1 only; use --mode engine for --prefill-tp/--decode-tp"
        return ""
    from .core.errors import InvalidArgument
    from .core.topology import check_tp_pair

    kv_heads = 4  # TinyConfig.num_kv_heads: the engine's TP sizes must divide it
    for name, tp in (("prefill", args.prefill_tp), ("decode", args.decode_tp)):
        if kv_heads % tp:
            return f"--{name}-tp {tp}: the reference model has {kv_heads} KV heads; use a TP size dividing it"
    try:
        check_tp_pair(args.prefill_tp, args.decode_tp)
    except InvalidArgument as e:
        return str(e)
    if args.prompt_tokens + args.max_new_tokens > 4096:
        return "--prompt-tokens + --max-new-tokens must be at most 4096 (the reference model's positions)"
    return ""


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
                    w.expect(msg[1], msg[2], msg[3], "demo-prefill", 1,
                             transfer_mode=msg[4] if len(msg) > 4 else "push")
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
             "--node-id", name], stdout=logf, stderr=subprocess.STDOUT, preexec_fn=_term_with_parent))
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
            first: tuple[str, tuple[Any, ...]] = ("decode", ("expect", tid, d_blocks, p_addr,
                                                             getattr(a, "transfer_mode", "push")))
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
        for d in self.daemons:
            if d.poll() is None:
                d.send_signal(signal.SIGTERM)
        for d in self.daemons:
            try:
                d.wait(30)
            except subprocess.TimeoutExpired:
                d.kill()


# ---------------------------------------------------------------------------------------------
# Engine mode: engine processes


ENGINE_POISON = 0xFF  # as float32 a NaN: a decode step reading a never-written slot spoils its tokens


def _kv_bytes(caches: Any, block_ids: list[int], tokens: int) -> bytes:
    """Every layer's K and V of the first ``tokens`` tokens in ``block_ids``, heads gathered over the
    TP ranks, token by token ([heads, tokens, head dim]), as raw bytes.

    The same request gives the same bytes on a TP1, TP2, ... engine, with blocks of any size, when its
    KV is the same."""
    from .refengine.model import gather_blocks

    parts = []
    for layer in range(caches[0].cfg.num_layers):
        for t in gather_blocks(caches, layer, block_ids):  # [n, heads, block size, head dim]
            n, h, bs, d = t.shape
            parts.append(t.transpose(0, 1).reshape(h, n * bs, d)[:, :tokens].contiguous().numpy().tobytes())
    return b"".join(parts)


class _ObservedHooks:
    """``KVPushdHooks`` plus what the demo checks: the KV of each request, snapshotted on the prefill
    side once its blocks are complete (before they are published) and on the decode side the moment
    the transfer is reported finished (before the engine decodes into them)."""

    def __init__(self, inner: Any, caches: Any, conn: Connection, tokens: int) -> None:
        self.inner = inner
        self.caches = caches
        self.conn = conn
        self.tokens = tokens  # the tokens a transfer moves: min(prefill's, decode's prompt block capacity)
        self.blocks: dict[str, list[int]] = {}

    def on_prefill_done(self, req_id: str, block_ids: Any) -> dict[str, Any]:
        self.conn.send(("kv", req_id, _kv_bytes(self.caches, list(block_ids), self.tokens)))
        return dict(self.inner.on_prefill_done(req_id, block_ids))

    def on_blocks_allocated(self, req_id: str, block_ids: Any, kv_params: Any) -> None:
        self.inner.on_blocks_allocated(req_id, block_ids, kv_params)
        self.blocks[req_id] = list(block_ids)
        self.conn.send(("registered", req_id))

    def poll(self) -> Any:
        ev = self.inner.poll()
        for rid in ev.finished_recving:
            blocks = self.blocks.pop(rid, None)
            if blocks is not None:
                self.conn.send(("kv", rid, _kv_bytes(self.caches, blocks, self.tokens)))
        for rid in ev.failed:
            self.blocks.pop(rid, None)
        return ev


def _poison_allocator(caches: Any, num_blocks: int) -> Any:
    """The engine's FIFO free block queue, where free decode blocks hold poison: an allocation counts
    the bytes that are not poison (written while the block was free: outside any request), a free
    restores the poison."""
    from .refengine import BlockAllocator

    class PoisonAllocator(BlockAllocator):
        def __init__(self) -> None:
            super().__init__(num_blocks)
            self.views = [np.frombuffer(c.shm.mmap, dtype=np.uint8).reshape(-1, num_blocks, c.block_len)
                          for c in caches]
            for v in self.views:
                v[:] = ENGINE_POISON
            self.stray = 0

        def allocate(self, n: int) -> list[int] | None:
            ids = super().allocate(n)
            if ids:
                self.stray += sum(int(np.count_nonzero(v[:, ids, :] != ENGINE_POISON)) for v in self.views)
            return ids

        def free(self, block_ids: Any) -> None:
            ids = list(block_ids)
            for v in self.views:
                v[:, ids, :] = ENGINE_POISON
            super().free(ids)

        def not_poison(self) -> int:
            return sum(int(np.count_nonzero(v != ENGINE_POISON)) for v in self.views)

    return PoisonAllocator()


def _engine_main(role: str, sock: str, spec: dict[str, int], conn: Connection) -> None:
    def body() -> None:
        if spec.get("netns"):  # --hosts netns: this engine runs on its node's "host"
            from .netns import enter

            enter(str(spec["netns"]))
        if os.getppid() != spec["parent_pid"]:
            raise SystemExit("the demo has gone")
        _engine_loop(role, sock, spec, conn)

    run_engine_child(f"{role} engine", body, conn)


def run_engine_child(what: str, body: Callable[[], None], conn: Connection) -> None:
    """Run ``body`` as an engine child process (demo, bench sweep) and exit the process.

    SIGTERM and the parent's death end it (SystemExit: cleaned up, nothing to say); any other
    failure is printed and sent to the parent as ("error", text). It exits without the
    interpreter's teardown: everything is released by then (workers detached, shared memory
    unlinked), and teardown takes seconds with torch loaded on a busy machine."""
    code = 0
    signal.signal(signal.SIGTERM, _raise_exit)
    _term_with_parent()
    try:
        body()
    except SystemExit:
        code = 1
    except BaseException:
        import traceback

        code = 1
        traceback.print_exc()
        with contextlib.suppress(Exception):
            conn.send(("error", f"{what}: {traceback.format_exc()}"))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _engine_loop(role: str, sock: str, spec: dict[str, int], conn: Connection) -> None:
    """One engine process: the reference ``Engine`` with ``KVPushdHooks`` on this node's daemon.

    Messages in: ("add", rid, prompt, max_new_tokens, kv_params), ("first_token", rid, token),
    ("abort", rid), ("finish",). Out: ("ready", kv_params | {}), ("registered", rid), ("kv", rid, bytes),
    ("out", rid, ok, tokens, error, kv_params), ("stats", {...}), ("error", text)."""
    import torch
    from kvpushd_client import DaemonUnavailable, KVPushClient, Role

    from .refengine import Engine, KVPushdHooks, PagedKV, TinyConfig, TinyModel

    torch.set_num_threads(1)  # tiny ops; and every process computes with the same thread count
    cfg = TinyConfig(num_layers=spec["layers"], block_size=spec["block_size"])
    model = TinyModel(cfg, spec["seed"])
    tp, nb = spec["tp"], spec["num_blocks"]
    caches = [PagedKV.shared(cfg, nb, f"kvpushd-demo-{role}-r{r}", r, tp) for r in range(tp)]
    client = KVPushClient(sock)
    inner = None
    alloc = None
    try:
        deadline = time.monotonic() + 600
        while True:  # the daemon may still be starting; give up early if the demo does
            try:
                client.wait_ready(1.0)
                break
            except DaemonUnavailable:
                if conn.poll(0) or time.monotonic() > deadline:
                    raise
        inner = KVPushdHooks.attach(client, f"demo-{role}", Role.PRODUCER if role == "prefill" else Role.CONSUMER,
                                    caches, description=f"kvpushd demo {role} engine pid {os.getpid()}",
                                    transfer_mode="pull" if spec.get("pull") else "push")
        hooks = _ObservedHooks(inner, caches, conn, spec["verify_tokens"])
        engine = Engine(model, caches, role, hooks, max_num_seqs=spec["max_num_seqs"], max_prefills_per_step=4)
        if role == "decode":
            alloc = _poison_allocator(caches, nb)
            engine.allocator = alloc
            conn.send(("ready", {}))
        else:
            host, _, port = inner.peer_address.rpartition(":")
            conn.send(("ready", {"remote_engine_id": inner.engine_id, "remote_host": host,
                                 "remote_port": int(port), "tp_size": tp}))
        finishing = False
        while not (finishing and not engine.has_unfinished()):
            wait = 0.0 if engine.running else 0.002
            while conn.poll(wait):
                wait = 0.0
                msg = conn.recv()
                try:
                    if msg[0] == "add":
                        engine.add_request(msg[1], msg[2], msg[3], msg[4])
                    elif msg[0] == "first_token":
                        engine.set_first_token(msg[1], msg[2])
                    elif msg[0] == "abort":
                        inner.abort(msg[1])
                    elif msg[0] == "finish":
                        finishing = True
                except Exception as e:  # the demo counts the request as failed
                    conn.send(("out", msg[1], False, [], f"{msg[0]}: {e}", {}))
            for o in engine.step():
                conn.send(("out", o.req_id, o.ok, o.tokens, o.error, o.kv_params))
        conn.send(("stats", {
            "send_failures": dict(engine.send_failures), "unknown_events": engine.unknown_events,
            "unknown_completions": inner.unknown_completions, "free_blocks": engine.num_free_blocks,
            "num_blocks": nb, "stray_bytes": alloc.stray if alloc else 0,
            "not_poison_at_end": alloc.not_poison() if alloc else 0, "tokens_decoded": engine.tokens_decoded,
            "steps": engine.steps,
        }))
    finally:
        if inner is not None:
            inner.close()
        if alloc is not None:
            alloc.views = []  # numpy views pin the maps
        for c in caches:
            c.close()
        client.close()


# ---------------------------------------------------------------------------------------------
# Engine mode: orchestration


@dataclass
class _EReq:
    rid: str
    prompt: list[int]
    expected: list[int]
    order: str
    t0: float = 0.0
    t_done: float = 0.0
    finished: bool = False
    ok: bool = False
    tokens: list[int] = field(default_factory=list)
    error: str = ""
    kv: dict[str, bytes] = field(default_factory=dict)
    verified: bool = False


def _term_with_parent() -> None:
    """Linux: SIGTERM this process when its parent dies (a killed demo leaves no daemon or engine behind)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _raise_exit(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds: finally blocks stop daemons, detach, unlink shared memory


class _Daemons:
    def __init__(self, workdir: str, lab: Any = None) -> None:
        self.workdir = workdir
        self.procs: list[subprocess.Popen[bytes]] = []
        self.names: list[str] = []
        self.lab = lab  # --hosts netns: a NetnsLab, daemon i runs in its namespace i

    def start(self, name: str, host: int = 0) -> str:
        sock = os.path.join(self.workdir, f"{name}.sock")
        logf = open(os.path.join(self.workdir, f"{name}.log"), "wb")  # noqa: SIM115 - lives as long as the daemon
        listen = f"127.0.0.1:{_free_port()}" if self.lab is None else f"{self.lab.addrs[host]}:7700"
        argv = [sys.executable, "-m", "kvpushd", "serve", "--socket", sock, "--listen", listen, "--node-id", name]
        env = None
        if self.lab is not None:  # peer API on the namespace's address; UCX over TCP on its veth only
            argv = self.lab.argv(host, argv)
            env = dict(os.environ, UCX_TLS="tcp", UCX_NET_DEVICES=self.lab.veth)
        self.procs.append(subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                           preexec_fn=_term_with_parent))
        self.names.append(name)
        return sock

    def check(self) -> None:
        """Raise if a daemon has exited (say, it failed to start): the engines would wait for it in vain."""
        for name, d in zip(self.names, self.procs, strict=True):
            if d.poll() is not None:
                path = os.path.join(self.workdir, f"{name}.log")
                with open(path, errors="replace") as f:
                    tail = f.read()[-2000:]
                raise RuntimeError(f"daemon {name} exited with code {d.returncode}; the end of {path}:\n{tail}")

    def stop(self) -> None:
        for d in self.procs:
            if d.poll() is None:
                d.send_signal(signal.SIGTERM)
        for d in self.procs:
            try:
                d.wait(30)
            except subprocess.TimeoutExpired:
                d.kill()


class _EngineDemo:
    def __init__(self, args: argparse.Namespace, lab: Any = None) -> None:
        self.args = args
        self.t_start = time.perf_counter()
        self.rng = random.Random(args.seed)
        self.workdir = args.workdir or tempfile.mkdtemp(prefix="kvpushd-demo-")
        self.lab = lab
        self.placed: dict[str, bool] = {}
        self.daemons = _Daemons(self.workdir, lab)
        self.procs: dict[str, Any] = {}
        self.conns: dict[str, Connection] = {}
        self.outboxes: dict[str, queue.SimpleQueue[tuple[Any, ...] | None]] = {}

    def log(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    def send(self, role: str, msg: tuple[Any, ...]) -> None:
        """Queue a message for an engine. A thread per engine writes them: the main thread only reads,
        so an engine blocked writing a large KV snapshot never waits on a main thread blocked writing."""
        if role not in self.outboxes:
            q: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
            conn = self.conns[role]

            def writer() -> None:
                while (m := q.get()) is not None:
                    try:
                        conn.send(m)
                    except OSError:
                        return

            self.outboxes[role] = q
            threading.Thread(target=writer, name=f"kvpushd-demo-to-{role}", daemon=True).start()
        self.outboxes[role].put(msg)

    def _recv(self, role: str) -> tuple[Any, ...]:
        msg = self.conns[role].recv()
        if msg[0] == "error":
            raise RuntimeError(f"{msg[1]}\n(logs in {self.workdir})")
        return tuple(msg)

    def run(self) -> dict[str, Any]:
        a = self.args
        bs, dbs = a.prefill_block_size, a.decode_block_size
        blocks_prompt = -(-a.prompt_tokens // bs)
        blocks_total = -(-(a.prompt_tokens + a.max_new_tokens - 1) // dbs)
        # tokens each transfer moves: the prompt's blocks on both sides overlap this far
        moved_tokens = min(blocks_prompt * bs, -(-a.prompt_tokens // dbs) * dbs)
        self.log(f"kvpushd demo (engine mode): 2 daemons, prefill engine TP{a.prefill_tp} -> decode engine "
                 f"TP{a.decode_tp}, {a.requests} requests of {a.prompt_tokens} prompt tokens ({blocks_prompt} blocks "
                 f"x {2 * a.layers} regions) + {a.max_new_tokens} new tokens, {a.concurrency} in flight; "
                 f"logs in {self.workdir}")
        if self.lab is not None:
            self.log(f"hosts: network namespaces {self.lab.names[0]} (prefill, {self.lab.addrs[0]}) and "
                     f"{self.lab.names[1]} (decode, {self.lab.addrs[1]}), one veth pair; UCX_TLS=tcp")
        socks = {"prefill": self.daemons.start("prefill-node", 0), "decode": self.daemons.start("decode-node", 1)}
        # The daemons start first, on their own: on a small machine, engines importing torch next to
        # them only slow their start down (and a daemon gives its NIXL start a bounded time).
        from kvpushd_client import DaemonUnavailable, KVPushClient

        deadline = time.monotonic() + 600
        for sock in socks.values():
            with KVPushClient(sock) as probe:
                while True:
                    try:
                        probe.wait_ready(0.5)
                        break
                    except DaemonUnavailable:
                        self.daemons.check()
                        if time.monotonic() > deadline:
                            raise RuntimeError(f"daemons not ready after 600 s; see {self.workdir}") from None
        self.log("daemons ready")
        ctx = mp.get_context("spawn")
        specs = {
            "prefill": {"tp": a.prefill_tp, "num_blocks": blocks_prompt * (a.concurrency + 2), "max_num_seqs": 1},
            "decode": {"tp": a.decode_tp, "num_blocks": blocks_total * (a.concurrency + 2),
                       "max_num_seqs": a.concurrency},
        }
        for role in ("prefill", "decode"):
            spec = {**specs[role], "layers": a.layers, "block_size": bs if role == "prefill" else dbs,
                    "verify_tokens": moved_tokens, "seed": a.seed, "parent_pid": os.getpid(),
                    "pull": int(getattr(a, "transfer_mode", "push") == "pull"),
                    "netns": self.lab.names[0 if role == "prefill" else 1] if self.lab is not None else ""}
            mine, theirs = ctx.Pipe()
            pr = ctx.Process(target=_engine_main, args=(role, socks[role], spec, theirs), daemon=True,
                             name=f"kvpushd-demo-{role}-engine")
            pr.start()
            theirs.close()
            self.procs[role], self.conns[role] = pr, mine

        import torch

        from .refengine import TinyConfig, TinyModel, random_prompt

        torch.set_num_threads(1)  # as in the engines: the same thread count, the same numbers
        cfg = TinyConfig(num_layers=a.layers, block_size=bs)
        # arrival orders: half each (so both occur whenever there are two requests), in random order
        orders_drawn = ["decode_first"] * (a.requests // 2) + ["prefill_first"] * (a.requests - a.requests // 2)
        self.rng.shuffle(orders_drawn)
        reqs = [_EReq(f"demo-{i:05d}-{os.urandom(3).hex()}",
                      random_prompt(a.seed * 1_000_003 + i, a.prompt_tokens, cfg.vocab_size), [], orders_drawn[i])
                for i in range(a.requests)]
        by_id = {r.rid: r for r in reqs}
        ref_error: list[BaseException] = []

        def reference() -> None:
            """The monolithic run of every prompt, computed here while the engines start and run."""
            try:
                model = TinyModel(cfg, a.seed)
                for r in reqs:
                    r.expected = model.generate_monolithic(r.prompt, a.max_new_tokens)
                self.log(f"reference tokens computed for {a.requests} requests (monolithic, seed {a.seed})")
            except BaseException as e:
                ref_error.append(e)

        ref_thread = threading.Thread(target=reference, name="kvpushd-demo-reference", daemon=True)
        ref_thread.start()

        static: dict[str, Any] = {}
        starting = {"prefill", "decode"}
        deadline = time.monotonic() + 600
        while starting:
            for c in wait([self.conns[r] for r in starting], 0.5):
                role = "prefill" if c is self.conns["prefill"] else "decode"
                try:
                    msg = self._recv(role)
                except EOFError:
                    raise RuntimeError(f"{role} engine exited while starting; see {self.workdir}") from None
                if role == "prefill":
                    static = msg[1]
                starting.discard(role)
                self.log(f"{role} engine ready (TP{specs[role]['tp']}, {specs[role]['num_blocks']} blocks per rank)")
            self.daemons.check()
            for role in starting:
                if not self.procs[role].is_alive() and not self.conns[role].poll(0):
                    raise RuntimeError(f"{role} engine exited with code {self.procs[role].exitcode} while "
                                       f"starting; see {self.workdir}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"engines {sorted(starting)} not ready after 600 s; see {self.workdir}")
        self.log("engines attached to their daemons; dispatching")
        if self.lab is not None:  # checked while all four run: each in its node's namespace
            from .netns import same_netns

            self.placed = {f"{role}_{kind}": same_netns(pid, self.lab.names[i])
                           for i, role in enumerate(("prefill", "decode"))
                           for kind, pid in (("daemon", self.daemons.procs[i].pid), ("engine", self.procs[role].pid))}
            self.log(f"processes in their namespaces: {self.placed}")

        stats = {"completed": 0, "failed": 0, "bytes_verified": 0, "mismatched_bytes": 0}
        orders = {"decode_first": 0, "prefill_first": 0}
        kv_mismatched_requests = 0

        def verify(r: _EReq) -> None:
            nonlocal kv_mismatched_requests
            if r.verified or len(r.kv) < 2:
                return
            p, d = (np.frombuffer(r.kv[k], dtype=np.uint8) for k in ("prefill", "decode"))
            n = min(p.size, d.size)
            diff = int(np.count_nonzero(p[:n] != d[:n])) + abs(p.size - d.size)
            stats["bytes_verified"] += d.size
            stats["mismatched_bytes"] += diff
            kv_mismatched_requests += diff > 0
            r.verified = True
            r.kv.clear()

        in_flight = 0
        finished = 0

        def finish(r: _EReq, ok: bool, tokens: list[int], error: str) -> None:
            nonlocal in_flight, finished
            if r.finished:
                return
            r.finished, r.ok, r.tokens, r.error, r.t_done = True, ok, list(tokens), error, time.perf_counter()
            stats["completed" if ok else "failed"] += 1
            in_flight -= 1
            finished += 1
            if not ok:
                self.log(f"request {r.rid} ({r.order}) failed: {error}")

        def handle(role: str, msg: tuple[Any, ...]) -> None:
            kind = msg[0]
            if kind == "stats":
                end_stats[role] = msg[1]
                return
            r = by_id.get(msg[1])
            if r is None:
                return
            if kind == "kv":
                r.kv[role] = msg[2]
                verify(r)
            elif kind == "registered":  # decode first: its blocks are registered, now prefill may run
                if r.order == "decode_first":
                    self.send("prefill", ("add", r.rid, r.prompt, 1, None))
            elif kind == "out" and role == "prefill":
                ok, tokens, error, params = msg[2:]
                if not ok:
                    if r.order == "decode_first":
                        self.send("decode", ("abort", r.rid))
                    else:
                        finish(r, False, [], f"prefill: {error}")
                elif r.order == "decode_first":
                    self.send("decode", ("first_token", r.rid, tokens[0]))
                else:
                    self.send("decode", ("add", r.rid, r.prompt, a.max_new_tokens, params))
            elif kind == "out":
                finish(r, bool(msg[2]), msg[3], msg[4])

        def pump(timeout: float) -> None:
            for c in wait(list(self.conns.values()), timeout):
                role = "prefill" if c is self.conns["prefill"] else "decode"
                try:
                    msg = self._recv(role)
                except EOFError:
                    raise RuntimeError(f"{role} engine exited; see {self.workdir}") from None
                handle(role, msg)
            for role, pr in self.procs.items():
                if not pr.is_alive() and role not in end_stats and not self.conns[role].poll(0):
                    raise RuntimeError(f"{role} engine exited with code {pr.exitcode}; see {self.workdir}")
            self.daemons.check()

        end_stats: dict[str, dict[str, Any]] = {}
        t0 = time.perf_counter()
        last_progress = t0
        last_change = time.monotonic()
        nxt = 0
        while finished < a.requests:
            while in_flight < a.concurrency and nxt < a.requests:
                r = reqs[nxt]
                nxt += 1
                in_flight += 1
                orders[r.order] += 1
                r.t0 = time.perf_counter()
                if r.order == "decode_first":  # decode registers its blocks first; prefill follows
                    self.send("decode", ("add", r.rid, r.prompt, a.max_new_tokens, {"transfer_id": r.rid, **static}))
                else:  # prefill runs and publishes first; decode gets its kv_params afterwards
                    self.send("prefill", ("add", r.rid, r.prompt, 1, None))
            before = finished
            pump(0.5)
            now = time.perf_counter()
            if finished != before:
                last_change = time.monotonic()
            elif time.monotonic() - last_change > 180:
                for r in reqs:
                    if r.t0 and not r.finished:
                        finish(r, False, [], "no result within 180 s")
                break
            if now - last_progress >= 1.0:
                last_progress = now
                self.log(f"{finished}/{a.requests} done, {stats['failed']} failed")
        wall = time.perf_counter() - t0
        self.log(f"{finished}/{a.requests} done, {stats['failed']} failed, in {wall:.1f} s; draining the engines")
        for role in self.conns:
            self.send(role, ("finish",))
        deadline = time.monotonic() + 120
        while len(end_stats) < 2 and time.monotonic() < deadline:
            pump(0.5)
        for r in reqs:
            if r.ok and not r.verified:  # received, but a snapshot never came: cannot vouch for its KV
                self.log(f"request {r.rid}: KV not verified (have {sorted(r.kv)})")
        from .ctl import fetch

        p_status, d_status = fetch(socks["prefill"]), fetch(socks["decode"])
        self.log("engines drained; daemon counters read")
        hosts = self._hosts()
        for pr in self.procs.values():
            pr.join(30)
        rss = {name: _rss_kib(d.pid) for name, d in zip(("prefill", "decode"), self.daemons.procs, strict=True)}

        ref_thread.join()
        if ref_error:
            raise RuntimeError(f"computing the reference tokens failed: {ref_error[0]!r}") from ref_error[0]
        mismatched = [r for r in reqs if r.tokens != r.expected]
        for r in mismatched:
            if r.ok:
                self.log(f"request {r.rid} ({r.order}): tokens {r.tokens} != reference {r.expected}")
        dstats = end_stats.get("decode", {})
        pstats = end_stats.get("prefill", {})
        outside = int(dstats.get("stray_bytes", 0)) + int(dstats.get("not_poison_at_end", 0))
        stats["mismatched_bytes"] += outside
        lat = sorted(r.t_done - r.t0 for r in reqs if r.ok)

        def pct(q: float) -> float | None:
            return round(lat[min(len(lat) - 1, int(q * len(lat)))] * 1e3, 1) if lat else None

        return {
            "mode": "engine", "requests": a.requests, **stats,
            "tokens_match": not mismatched, "tokens_mismatched": len(mismatched),
            "bytes_moved": p_status.counters.bytes_written + d_status.counters.bytes_read,
            "transfer_mode": getattr(a, "transfer_mode", "push"),
            "reads_posted": d_status.counters.reads_posted, "writes_posted": p_status.counters.writes_posted,
            "bytes_outside_requests": outside, "kv_mismatched_requests": kv_mismatched_requests,
            "kv_unverified": sum(1 for r in reqs if r.ok and not r.verified),
            "arrival_orders": orders, "prefill_tp": a.prefill_tp, "decode_tp": a.decode_tp,
            "prompt_tokens": a.prompt_tokens, "max_new_tokens": a.max_new_tokens, "layers": a.layers,
            "block_size": bs, "blocks_per_request": blocks_prompt,
            "prefill_block_size": bs, "decode_block_size": dbs, "tokens_moved_per_request": moved_tokens,
            "tokens_generated": sum(len(r.tokens) for r in reqs), "wall_s": round(wall, 3),
            "request_latency_ms": {"p50": pct(0.5), "p99": pct(0.99)},
            "notifications_received": d_status.counters.notifications_received,
            "transfers_failed": {"prefill": p_status.counters.transfers_failed,
                                 "decode": d_status.counters.transfers_failed},
            "transfers_left": {"prefill": len(p_status.transfers), "decode": len(d_status.transfers)},
            "send_failures": len(pstats.get("send_failures", {})),
            "unknown_events": int(pstats.get("unknown_events", 0)) + int(dstats.get("unknown_events", 0)),
            "descriptors_requested": p_status.counters.descriptors_requested,
            "descriptors_posted": p_status.counters.descriptors_posted,
            "daemon_rss_kib": rss, "workdir": self.workdir, **hosts,
        }

    def _hosts(self) -> dict[str, Any]:
        """--hosts netns: where each daemon and engine ran, and the bytes that crossed the veth pair."""
        if self.lab is None:
            return {"hosts": "local"}
        lab = self.lab
        p_link, d_link = lab.link_stats(0), lab.link_stats(1)
        return {"hosts": "netns", "namespaces": {"prefill": lab.names[0], "decode": lab.names[1]},
                "addresses": {"prefill": lab.addrs[0], "decode": lab.addrs[1]}, "link": "veth pair",
                "ucx": {"UCX_TLS": "tcp", "UCX_NET_DEVICES": lab.veth}, "in_namespace": self.placed,
                "veth_bytes": {"prefill_tx": p_link["tx_bytes"], "decode_rx": d_link["rx_bytes"],
                               "decode_tx": d_link["tx_bytes"]}}

    def stop(self) -> None:
        for q in self.outboxes.values():
            q.put(None)
        for pr in self.procs.values():
            if pr.is_alive():
                pr.join(5)
            if pr.is_alive():
                pr.terminate()
                pr.join(10)
        self.log("engines exited; stopping the daemons")
        self.daemons.stop()
        self.log("daemons stopped")


def _engine_ok(out: dict[str, Any]) -> bool:
    if out.get("hosts") == "netns" and not all(out["in_namespace"].values()):
        return False
    return bool(out["failed"] == 0 and out["completed"] == out["requests"] and out["tokens_match"]
                and out["mismatched_bytes"] == 0 and out["kv_unverified"] == 0)


def _print_engine(out: dict[str, Any]) -> None:
    rows = [
        ("mode", f"engine: prefill TP{out['prefill_tp']} -> decode TP{out['decode_tp']}, {out['layers']} layers, "
                 f"{out['prefill_block_size']} -> {out['decode_block_size']} tokens per block"),
        ("requests", f"{out['requests']} ({out['prompt_tokens']} prompt tokens, {out['max_new_tokens']} new tokens); "
                     f"arrival orders {out['arrival_orders']}"),
        ("completed", f"{out['completed']}"),
        ("failed", f"{out['failed']}"),
        ("tokens", f"{'match' if out['tokens_match'] else 'MISMATCH'} the monolithic run "
                   f"({out['tokens_mismatched']} requests differ, {out['tokens_generated']} tokens generated)"),
        ("KV bytes moved", f"{out['bytes_moved']:,} (prefill daemon's bytes_written)"),
        ("KV bytes verified", f"{out['bytes_verified']:,}, mismatched {out['mismatched_bytes']:,} "
                              f"(outside requests {out['bytes_outside_requests']:,}, "
                              f"unverified requests {out['kv_unverified']})"),
        ("notifications", f"{out['notifications_received']} received by decode"),
        ("descriptors", f"{out['descriptors_requested']:,} requested -> {out['descriptors_posted']:,} posted"),
        ("latency", f"request dispatch -> decoded p50 {out['request_latency_ms']['p50']} ms, "
                    f"p99 {out['request_latency_ms']['p99']} ms; {out['wall_s']} s in all"),
    ]
    if out.get("hosts") == "netns":
        rows.append(("hosts", f"netns {out['namespaces']['prefill']} ({out['addresses']['prefill']}) -> "
                              f"{out['namespaces']['decode']} ({out['addresses']['decode']}) over a veth pair, "
                              f"UCX_TLS=tcp; {out['veth_bytes']['decode_rx']:,} bytes received on decode's veth; "
                              f"in their namespaces: {all(out['in_namespace'].values())}"))
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    print("OK" if _engine_ok(out) else "FAILED")


def run_demo(args: argparse.Namespace) -> int:
    err = _resolve(args)
    if err:
        print(f"kvpushd demo: {err}", file=sys.stderr)
        return 2
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_exit)  # a terminated demo still stops its daemons and engines
    if args.mode == "engine":
        lab = None
        if args.hosts == "netns":
            from .netns import NetnsLab, available, sweep_stale

            ok, why = available()
            if not ok:
                print(f"kvpushd demo: --hosts netns needs root and iproute2 to create network namespaces and a "
                      f"veth pair ({why}); run it as root, or use --hosts local", file=sys.stderr)
                return 2
            sweep_stale()
            lab = NetnsLab(2, link="pair").setup()
        edemo = _EngineDemo(args, lab)
        try:
            out = edemo.run()
        except RuntimeError as e:
            print(f"kvpushd demo: {e}", file=sys.stderr)
            return 1
        finally:
            edemo.stop()
            if lab is not None:
                lab.teardown()
        if args.json:
            print(json.dumps(out))
        else:
            _print_engine(out)
        return 0 if _engine_ok(out) else 1
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
