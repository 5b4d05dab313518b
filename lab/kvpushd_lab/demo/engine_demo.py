"""``kvpushd demo`` engine mode, the orchestrator: daemons, engine processes, dispatch in both arrival
orders, and the checks (tokens, KV bytes, nothing written outside a request's blocks)."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import random
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import numpy as np

from .. import launch
from .bytes_mode import _rss_kib
from .engine_proc import _engine_main


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


class _EngineDemo:
    def __init__(self, args: argparse.Namespace, lab: Any = None) -> None:
        self.args = args
        self.t_start = time.perf_counter()
        self.rng = random.Random(args.seed)
        self.workdir = args.workdir or tempfile.mkdtemp(prefix="kvpushd-demo-")
        self.lab = lab
        self.placed: dict[str, bool] = {}
        self.daemons: list[launch.Daemon] = []
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

    def _check_daemons(self) -> None:
        """Raise if a daemon has exited (say, it failed to start): the engines would wait for it in vain."""
        for d in self.daemons:
            d.check()

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
                 f"NIXL backend {a.backend}; "
                 f"logs in {self.workdir}")
        if self.lab is not None:
            self.log(f"hosts: network namespaces {self.lab.names[0]} (prefill, {self.lab.addrs[0]}) and "
                     f"{self.lab.names[1]} (decode, {self.lab.addrs[1]}), one veth pair; "
                     f"{_env_text(self._link_env())}")
        for host, name in enumerate(("prefill-node", "decode-node")):
            # --hosts netns: peer API on the namespace's address, UCX over TCP on its veth only
            self.daemons.append(launch.spawn(self.workdir, name, die_with_parent=True, backend=a.backend,
                                             netns=(self.lab, host) if self.lab is not None else None))
        socks = {"prefill": self.daemons[0].sock, "decode": self.daemons[1].sock}
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
                        self._check_daemons()
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
                    "netns": self.lab.names[0 if role == "prefill" else 1] if self.lab is not None else "",
                    "log": os.path.join(str(self.workdir), f"{role}-engine.log")}
            mine, theirs = ctx.Pipe()
            pr = ctx.Process(target=_engine_main, args=(role, socks[role], spec, theirs), daemon=True,
                             name=f"kvpushd-demo-{role}-engine")
            pr.start()
            theirs.close()
            self.procs[role], self.conns[role] = pr, mine

        import torch

        from ..refengine import TinyConfig, TinyModel, random_prompt

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
            self._check_daemons()
            for role in starting:
                if not self.procs[role].is_alive() and not self.conns[role].poll(0):
                    raise RuntimeError(f"{role} engine exited with code {self.procs[role].exitcode} while "
                                       f"starting; see {self.workdir}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"engines {sorted(starting)} not ready after 600 s; see {self.workdir}")
        self.log("engines attached to their daemons; dispatching")
        if self.lab is not None:  # checked while all four run: each in its node's namespace
            from ..netns import same_netns

            self.placed = {f"{role}_{kind}": same_netns(pid, self.lab.names[i])
                           for i, role in enumerate(("prefill", "decode"))
                           for kind, pid in (("daemon", self.daemons[i].pid), ("engine", self.procs[role].pid))}
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

        closed: set[str] = set()  # engines that sent their final stats and then closed their pipe

        def pump(timeout: float) -> None:
            for c in wait([c for r, c in self.conns.items() if r not in closed], timeout):
                role = "prefill" if c is self.conns["prefill"] else "decode"
                try:
                    msg = self._recv(role)
                except EOFError:
                    if role in end_stats:  # drained: its stats came, then it exited as asked
                        closed.add(role)
                        continue
                    raise RuntimeError(f"{role} engine exited; see {role}-engine.log in {self.workdir}") from None
                handle(role, msg)
            for role, pr in self.procs.items():
                if not pr.is_alive() and role not in end_stats and not self.conns[role].poll(0):
                    raise RuntimeError(f"{role} engine exited with code {pr.exitcode}; see {self.workdir}")
            self._check_daemons()

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
        from kvpushd.ctl import fetch

        p_status, d_status = fetch(socks["prefill"]), fetch(socks["decode"])
        self.log("engines drained; daemon counters read")
        hosts = self._hosts()
        for pr in self.procs.values():
            pr.join(30)
        rss = {name: _rss_kib(d.pid) for name, d in zip(("prefill", "decode"), self.daemons, strict=True)}

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
            "daemon_rss_kib": rss, "workdir": self.workdir, "backend": self.args.backend, **hosts,
        }

    def _hosts(self) -> dict[str, Any]:
        """--hosts netns: where each daemon and engine ran, and the bytes that crossed the veth pair."""
        if self.lab is None:
            return {"hosts": "local"}
        lab = self.lab
        p_link, d_link = lab.link_stats(0), lab.link_stats(1)
        return {"hosts": "netns", "namespaces": {"prefill": lab.names[0], "decode": lab.names[1]},
                "addresses": {"prefill": lab.addrs[0], "decode": lab.addrs[1]}, "link": "veth pair",
                self._link_env_key(): self._link_env(), "in_namespace": self.placed,
                "veth_bytes": {"prefill_tx": p_link["tx_bytes"], "decode_rx": d_link["rx_bytes"],
                               "decode_tx": d_link["tx_bytes"]}}

    def _link_env_key(self) -> str:
        return "libfabric" if self.args.backend == "LIBFABRIC" else "ucx"

    def _link_env(self) -> dict[str, str]:
        """--hosts netns: the environment that keeps the daemons' NIXL backend on the veth pair."""
        veth = self.lab.veth if self.lab is not None else ""
        if self.args.backend == "LIBFABRIC":
            return {"FI_PROVIDER": "tcp", "FI_TCP_IFACE": veth}
        return {"UCX_TLS": "tcp", "UCX_NET_DEVICES": veth}

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
        launch.stop_all(self.daemons)
        self.log("daemons stopped")


def _env_text(env: dict[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in env.items())
