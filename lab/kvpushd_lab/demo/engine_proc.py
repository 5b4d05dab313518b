"""``kvpushd demo`` engine mode, the engine processes: the reference engine with KVPushdHooks on its
node's daemon, observed so the orchestrator can check every request's KV."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from ..launch import term_with_parent

ENGINE_POISON = 0xFF  # as float32 a NaN: a decode step reading a never-written slot spoils its tokens


def _kv_bytes(caches: Any, block_ids: list[int], tokens: int) -> bytes:
    """Every layer's K and V of the first ``tokens`` tokens in ``block_ids``, heads gathered over the
    TP ranks, token by token ([heads, tokens, head dim]), as raw bytes.

    The same request gives the same bytes on a TP1, TP2, ... engine, with blocks of any size, when its
    KV is the same."""
    from ..refengine.kv import gather_blocks

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

    def end_step(self) -> None:
        self.inner.end_step()

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
    from ..refengine import BlockAllocator

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
        if spec.get("log"):  # its output goes to the demo's log folder, beside the daemons' logs
            log = os.open(str(spec["log"]), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(log, 1)
            os.dup2(log, 2)
            os.close(log)
        if spec.get("netns"):  # --hosts netns: this engine runs on its node's "host"
            from ..netns import enter

            enter(str(spec["netns"]))
        if os.getppid() != spec["parent_pid"]:
            raise SystemExit("the demo has gone")
        _engine_loop(role, sock, spec, conn)

    run_engine_child(f"{role} engine", body, conn)


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
MMAP_THRESHOLD = 32 << 20  # glibc's largest on 64-bit
TRIM_THRESHOLD = 1 << 30


def steady_malloc() -> bool:
    """Keep freed heap memory in the process (glibc): tensors of up to 32 MiB come from the heap, and
    the heap is not trimmed below 1 GiB of free space. Without it, a reference engine's decode step
    maps fresh pages for its large temporaries and unmaps them when they are freed. That costs ~1,000
    page faults a step at 4,096 tokens, and made decode steps 3-5x slower. Only engines that load UCX
    escaped it: UCX's memory hooks change these settings, so an engine with in-engine NIXL decoded
    faster than one on kvpushd. The same settings in every engine compare the transfers, not the
    allocator. False where there is no glibc."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
            libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    except (OSError, AttributeError):
        return False


def run_engine_child(what: str, body: Callable[[], None], conn: Connection) -> None:
    """Run ``body`` as an engine child process (demo, bench sweep, bench handover) and exit the process.
    The allocator is made steady first (``steady_malloc``).

    SIGTERM and the parent's death end it (SystemExit: cleaned up, nothing to say); any other
    failure is printed and sent to the parent as ("error", text). It exits without the
    interpreter's teardown: everything is released by then (workers detached, shared memory
    unlinked), and teardown takes seconds with torch loaded on a busy machine."""
    code = 0
    steady_malloc()
    signal.signal(signal.SIGTERM, _raise_exit)
    term_with_parent()
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

    from ..refengine import Engine, KVPushdHooks, PagedKV, TinyConfig, TinyModel

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




def _raise_exit(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds: finally blocks stop daemons, detach, unlink shared memory

