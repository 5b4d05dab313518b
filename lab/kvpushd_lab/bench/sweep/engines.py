"""The sweep's engine processes: one prefill and one decode reference engine per mode, each a child
process with its KV cache in shared memory, driven over a pipe by the sweep (``cells``)."""

from __future__ import annotations

import contextlib
import os
import queue
import resource
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from ..common import BenchError, dist
from ..procpair import ProcPair
from .shape import extra_regions, model_config


def config(spec: dict[str, Any]) -> Any:
    """The tiny model's config for the sweep's spec (its KV shape, layers and heads)."""
    return model_config(str(spec.get("kv_shape", "tiny")), int(spec["layers"]), int(spec["heads"]),
                        int(spec["max_positions"]))


def _engine_main(role: str, mode: str, spec: dict[str, Any], conn: Connection) -> None:
    from ...demo.engine_proc import run_engine_child

    run_engine_child(f"{mode} {role} engine", lambda: _engine_loop(role, mode, spec, conn), conn)


def _engine_loop(role: str, mode: str, spec: dict[str, Any], conn: Connection) -> None:
    """One engine: messages in ("add", rid, prompt, max_new, kv_params), ("first_token", rid, tok),
    ("finish",); out ("ready", static kv_params), ("first", rid, t_ns), ("out", rid, ok, tokens,
    error, kv_params, t_ns), ("stats", {...}), ("error", text)."""
    import torch

    from ...refengine import Engine, KVPushdHooks, PagedKV, TinyModel

    torch.set_num_threads(1)
    cfg = config(spec)
    model = TinyModel(cfg, int(spec["seed"]))
    extra = extra_regions(str(spec.get("kv_shape", "tiny")), cfg)
    kv = PagedKV.shared(cfg, int(spec["num_blocks"]), f"kvpushd-sweep-{mode}-{role}", extra_regions=extra)
    client = None
    hooks: Any = None
    inner: Any = None
    try:
        if mode.startswith("kvpushd"):
            from kvpushd_client import KVPushClient, Role

            client = KVPushClient(spec["sock"])
            client.wait_ready(120)
            hooks = KVPushdHooks.attach(client, f"sweep-{mode}-{role}",
                                        Role.PRODUCER if role == "prefill" else Role.CONSUMER,
                                        kv, description=f"kvpushd bench sweep {role} pid {os.getpid()}",
                                        transfer_mode="pull" if mode == "kvpushd-pull" else "push",
                                        progressive=mode == "kvpushd-push" and role == "prefill")
            host, _, port = hooks.peer_address.rpartition(":")
            static = {"remote_engine_id": hooks.engine_id, "remote_host": host, "remote_port": int(port),
                      "tp_size": 1}
        else:
            from ...refengine.inengine import InEnginePullHooks, InEnginePushHooks

            cls = InEnginePullHooks if mode == "inengine-pull" else InEnginePushHooks
            hooks = cls(kv, f"sweep-{mode}-{role}")
            static = hooks.kv_params
        inner = hooks
        if extra:  # the published shape: stamp (prefill) and check (decode) the regions the model does not use
            from .shape import StampedHooks

            hooks = StampedHooks(inner, kv)
        engine = Engine(model, kv, role, hooks, max_num_seqs=int(spec["max_num_seqs"]), max_prefills_per_step=1)
        conn.send(("ready", static if role == "prefill" else {}))
        first_seen: set[str] = set()
        steps_busy = 0
        decode_steps_ms: list[float] = []  # decode: each step with requests running
        while True:
            # Nothing unfinished: only a message can bring work, and poll() returns at once for one.
            # Requests waiting on KV: step every millisecond to read the connector's events.
            wait_s = 0.0 if engine.running or engine.waiting else 0.001 if engine.has_unfinished() else 0.05
            finishing = False
            while conn.poll(wait_s):
                wait_s = 0.0
                msg = conn.recv()
                try:
                    if msg[0] == "add":
                        engine.add_request(msg[1], msg[2], msg[3], msg[4])
                    elif msg[0] == "first_token":
                        engine.set_first_token(msg[1], msg[2])
                    elif msg[0] == "finish":
                        finishing = True
                except Exception as e:  # the sweep counts the request as failed
                    conn.send(("out", msg[1], False, [], f"{msg[0]}: {e}", {}, time.monotonic_ns()))
            if finishing:
                break
            t0, decoding = time.perf_counter_ns(), role == "decode" and bool(engine.running)
            outs = engine.step()
            t = time.monotonic_ns()
            if decoding:
                decode_steps_ms.append((time.perf_counter_ns() - t0) / 1e6)
            if engine.running or outs:
                steps_busy += 1
            if role == "decode":
                for r in engine.running:
                    if r.req_id not in first_seen and len(r.output) >= 2:
                        first_seen.add(r.req_id)
                        conn.send(("first", r.req_id, t))
            for o in outs:
                if role == "decode" and o.req_id not in first_seen:
                    conn.send(("first", o.req_id, t))
                first_seen.discard(o.req_id)
                conn.send(("out", o.req_id, o.ok, o.tokens, o.error, o.kv_params, t))
        conn.send(("stats", {"steps": engine.steps, "busy_steps": steps_busy, "unknown_events": engine.unknown_events,
                             "decode_step_ms": dist(decode_steps_ms, 3),
                             "minor_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt,
                             "send_failures": len(engine.send_failures),
                             "handshakes": int(getattr(inner, "handshakes", 0)),
                             **({"kv_check": hooks.stats} if extra else {})}))
    finally:
        if hooks is not None:
            with contextlib.suppress(Exception):
                hooks.close()
        kv.close()
        if client is not None:
            client.close()


class Engines(ProcPair):
    """The prefill and decode engine processes of one mode; a writer thread per engine."""

    def __init__(self, mode: str, spec: dict[str, Any], socks: dict[str, str]) -> None:
        def args_of(role: str, conn: Connection) -> tuple[Any, ...]:
            return role, mode, {**spec, "sock": socks.get(role, ""), "num_blocks": spec[f"{role}_blocks"]}, conn

        super().__init__(mode, _engine_main, args_of, lambda role: f"kvpushd-sweep-{role}")
        self.mode = mode
        self.outboxes: dict[str, queue.SimpleQueue[tuple[Any, ...] | None]] = {}
        self.stats: dict[str, dict[str, Any]] = {}
        for role, conn in self.conns.items():
            q: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
            self.outboxes[role] = q
            threading.Thread(target=self._writer, args=(conn, q), daemon=True).start()

    @staticmethod
    def _writer(conn: Connection, q: queue.SimpleQueue[tuple[Any, ...] | None]) -> None:
        while (m := q.get()) is not None:
            try:
                conn.send(m)
            except OSError:
                return

    def send(self, role: str, msg: tuple[Any, ...]) -> None:
        self.outboxes[role].put(msg)

    def taken(self, role: str, msg: tuple[Any, ...]) -> bool:
        if msg[0] == "stats":
            self.stats[role] = msg[1]
            return True
        return False

    def stop(self) -> None:
        for role in self.conns:
            self.send(role, ("finish",))
        deadline = time.monotonic() + 30
        while len(self.stats) < 2 and time.monotonic() < deadline:
            with contextlib.suppress(BenchError):
                for _ in self.recv(0.2):
                    pass
            if not any(p.is_alive() for p in self.procs.values()):
                break
        for q in self.outboxes.values():
            q.put(None)
        self.join(10)


