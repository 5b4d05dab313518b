"""``kvpushd bench handover``'s engines: a prefill and a decode reference engine per connector kind,
each a child process (in its node's network namespace with ``--fabric veth:...``) driven over a pipe.

Kinds: ``kvpushd`` (``KVPushdHooks`` on the node's daemon, attached with a doorbell; the bench
switches progressive push on or off per request), ``inengine-push`` and ``inengine-pull`` (the
engine owns its NIXL agent: ``refengine.inengine``). ``Timed`` wraps the hooks and takes the
timestamps (``time.monotonic_ns``: one clock for every process on the machine, namespaces too)
and the request's blocks, which the bench digests on both sides once the request is over.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import time
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any

from .procpair import ProcPair
from .sweep.shape import model_config

LAYERS = 64  # Qwen3-32B: the published shape's 128 regions are exactly the tiny model's 64 x (K, V)


def config(max_positions: int, window: int) -> Any:
    """The reference model in the published shape (``--kv-shape qwen3-32b-tp8``), 64 layers."""
    return dataclasses.replace(model_config("qwen3-32b-tp8", LAYERS, 1, max_positions), attn_window=window)


class Timed:
    """Wraps an engine's hooks: forward start and end per prompt (prefill), when the engine read
    "finished receiving" / "finished sending", and the blocks of each request (for the byte check)."""

    def __init__(self, inner: Any, layers: int) -> None:
        self.inner = inner
        self.layers = layers
        self.times: dict[str, dict[str, int]] = {}
        self.blocks: dict[str, list[int]] = {}
        self.sent: dict[str, str] = {}  # prefill: transfers over (finished sending: "", failed: why)
        self._current = ""

    def on_prefill_start(self, req_id: str, block_ids: Sequence[int]) -> None:
        self.times[req_id] = {"forward_start": time.monotonic_ns()}  # before a progressive declaration
        self._current = req_id
        self.blocks[req_id] = list(block_ids)
        fn = getattr(self.inner, "on_prefill_start", None)
        if fn is not None:
            fn(req_id, block_ids)

    def on_layer_done(self, n: int) -> None:
        if n == self.layers and self._current in self.times:  # the last layer computed: all KV in the cache
            self.times[self._current]["forward_end"] = time.monotonic_ns()
        fn = getattr(self.inner, "on_layer_done", None)
        if fn is not None:
            fn(n)

    def on_prefill_done(self, req_id: str, block_ids: Sequence[int]) -> dict[str, Any]:
        self.times.setdefault(req_id, {})["forward_return"] = time.monotonic_ns()  # logits too
        return dict(self.inner.on_prefill_done(req_id, block_ids))

    def on_blocks_allocated(self, req_id: str, block_ids: Sequence[int], kv_params: Mapping[str, Any]) -> None:
        self.blocks[req_id] = list(block_ids)
        self.inner.on_blocks_allocated(req_id, block_ids, kv_params)

    def poll(self) -> Any:
        ev = self.inner.poll()
        t = time.monotonic_ns()
        for rid in ev.finished_recving:
            self.times.setdefault(rid, {})["told"] = t
        for rid in ev.finished_sending:
            self.sent[rid] = ""
        for rid, why in ev.failed.items():
            self.sent[rid] = why or "failed"
        return ev

    def end_step(self) -> None:
        fn = getattr(self.inner, "end_step", None)
        if fn is not None:
            fn()

    def abort(self, req_id: str) -> None:
        fn = getattr(self.inner, "abort", None)
        if fn is not None:
            fn(req_id)


def digest(kv: Any, blocks: Sequence[int]) -> str:
    """A digest of ``blocks`` in every region of the cache (all of a request's KV bytes)."""
    h = hashlib.blake2b(digest_size=16)
    runs: list[list[int]] = []
    for b in blocks:  # runs of adjacent blocks: one slice each
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1][1] += 1
        else:
            runs.append([b, 1])
    with memoryview(kv.shm.mmap) as mem:
        for off, _, block_len, stride in kv.region_layout():
            assert stride == block_len
            for start, n in runs:
                h.update(mem[off + start * stride:off + (start + n) * stride])
    return h.hexdigest()


def _engine_main(kind: str, role: str, spec: dict[str, Any], conn: Connection) -> None:
    from ..demo.engine_proc import run_engine_child

    def body() -> None:
        if spec.get("netns"):  # --fabric veth: this engine runs on its node's "host", over TCP on the veth
            from ..netns import enter_host

            if spec.get("backend", "UCX") == "LIBFABRIC":
                os.environ["FI_TCP_IFACE"] = str(spec["veth"])
            else:
                os.environ["UCX_TLS"] = "tcp"
                os.environ["UCX_NET_DEVICES"] = str(spec["veth"])
            enter_host(str(spec["netns"]))  # with its /sys: UCX finds the veth there
        _engine_loop(kind, role, spec, conn)

    run_engine_child(f"handover {kind} {role} engine", body, conn)


def _engine_loop(kind: str, role: str, spec: dict[str, Any], conn: Connection) -> None:
    """Messages in: ("add", rid, prompt, max_new, kv_params), ("first_token", rid, tok), ("progressive",
    bool), ("check", rid), ("finish",). Out: ("ready", kv_params), ("out", rid, ok, tokens, error,
    kv_params, t_ns), ("sent", rid, error), ("check", rid, digest, times)."""
    import torch

    from ..refengine import Engine, KVPushdHooks, PagedKV, TinyModel

    torch.set_num_threads(1)
    cfg = config(int(spec["max_positions"]), int(spec["window"]))
    model = TinyModel(cfg, int(spec["seed"]))
    kv = PagedKV.shared(cfg, int(spec["num_blocks"]), f"kvpushd-handover-{kind}-{role}")
    kv.fill_(0.0)  # touch every page now, not in a timed request
    client = None
    inner: Any = None
    try:
        if kind == "kvpushd":
            from kvpushd_client import KVPushClient, Role

            client = KVPushClient(str(spec["sock"]))
            client.wait_ready(120)
            inner = KVPushdHooks.attach(client, f"handover-{role}", Role.PRODUCER if role == "prefill"
                                        else Role.CONSUMER, kv, description=f"kvpushd bench handover {role}",
                                        progressive=role == "prefill")
            host, _, port = inner.peer_address.rpartition(":")
            static = {"remote_engine_id": inner.engine_id, "remote_host": host, "remote_port": int(port),
                      "tp_size": 1}
        else:
            from ..refengine.inengine import InEnginePullHooks, InEnginePushHooks

            cls = InEnginePullHooks if kind == "inengine-pull" else InEnginePushHooks
            inner = cls(kv, f"handover-{kind}-{role}", host=str(spec["host"]), backend=str(spec.get("backend", "UCX")))
            static = inner.kv_params
        hooks = Timed(inner, LAYERS)
        engine = Engine(model, kv, role, hooks, max_num_seqs=1, max_prefills_per_step=1)
        conn.send(("ready", static))
        while True:
            wait_s = 0.0 if engine.running or engine.waiting else 0.001 if engine.has_unfinished() else 0.02
            finishing = False
            while conn.poll(wait_s):
                wait_s = 0.0
                msg = conn.recv()
                if msg[0] == "add":
                    engine.add_request(msg[1], msg[2], msg[3], msg[4])
                elif msg[0] == "first_token":
                    hooks.times.setdefault(msg[1], {})["token"] = time.monotonic_ns()  # prefill's token relayed
                    engine.set_first_token(msg[1], msg[2])
                elif msg[0] == "progressive":
                    inner.progressive = bool(msg[1])
                elif msg[0] == "check":
                    rid = msg[1]
                    blocks = hooks.blocks.pop(rid, [])
                    conn.send(("check", rid, digest(kv, blocks) if blocks else "", hooks.times.pop(rid, {})))
                elif msg[0] == "finish":
                    finishing = True
            if finishing:
                break
            outs = engine.step()
            t = time.monotonic_ns()
            for o in outs:
                conn.send(("out", o.req_id, o.ok, o.tokens, o.error, o.kv_params, t))
            for rid, why in list(hooks.sent.items()):
                del hooks.sent[rid]
                conn.send(("sent", rid, why))
    finally:
        if inner is not None:
            with contextlib.suppress(Exception):
                inner.close()
        kv.close()
        if client is not None:
            client.close()


class EnginePair(ProcPair):
    """The prefill and the decode engine of one kind, as child processes."""

    def __init__(self, kind: str, spec: Mapping[str, Any], per_role: Mapping[str, Mapping[str, Any]]) -> None:
        super().__init__(kind, _engine_main, lambda role, conn: (kind, role, {**spec, **per_role[role]}, conn),
                         lambda role: f"kvpushd-handover-{kind}-{role}")

    def send(self, role: str, msg: tuple[Any, ...]) -> None:
        self.conns[role].send(msg)

    def stop(self) -> None:
        for role in self.conns:
            with contextlib.suppress(OSError):
                self.send(role, ("finish",))
        self.join(20)
