"""``sweep``: TTFT and TPOT over a QPS x prompt-length grid with the reference engines.

Modes (``--modes``):

* ``kvpushd-push``: the engines use ``KVPushdHooks`` on two daemons; the router sends each request
  to both engines at once, decode Expects its blocks as soon as they are allocated, prefill Publishes
  when prefill is done, the prefill daemon WRITEs;
* ``kvpushd-pull``: the same daemons with ``transfer_mode="pull"`` (shown "unavailable" while the
  installed ``KVPushdHooks`` has no such option); the router sends the request to decode only after
  prefill answered, with prefill's ``kv_params``;
* ``inengine-push``: ``InEnginePushHooks`` (NixlPushConnector): NIXL agents in the engine
  processes, decode registers its blocks with the prefill engine over a side channel at allocation,
  the prefill engine thread posts the WRITE;
* ``inengine-pull``: ``InEnginePullHooks`` (vLLM's NixlConnector): after prefill the decode engine
  thread handshakes (once), posts a READ, polls it, then notifies prefill to free.

Per mode one prefill engine process and one decode engine process (``kvpushd_lab.refengine``, the tiny
deterministic model, prefix caching off: there is none) serve every cell in turn; kvpushd modes also
start two daemons. Per prompt length a few warm-up requests go first (handshakes, first-touch);
then per QPS ``--requests`` distinct prompts arrive as a Poisson process. The same prompts and
arrival times are used for every mode. TTFT: arrival -> the end of the decode engine's first step
that emits tokens for the request (its first forward pass: it emits prefill's token and its own).
TPOT: the mean time between the decode engine's later tokens. Every clock is CLOCK_MONOTONIC
(``time.monotonic_ns``), shared by the processes. Every request's tokens are compared with a
monolithic run of the same model, computed after the timed runs.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import multiprocessing as mp
import os
import queue
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from .common import BenchError, DaemonProc, Result, daemon_pair, dist, progress

MODES = ("kvpushd-push", "kvpushd-pull", "inengine-push", "inengine-pull")
TARGET_RATIO = 0.5  # kvpushd-push TTFT p50 <= half of inengine-pull's, at the highest QPS


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt-lens", type=_ints, default=[256, 1024],
                   help="prompt lengths in tokens, comma separated (default 256,1024)")
    p.add_argument("--qps", type=_floats, default=[2.0, 4.0, 8.0],
                   help="request rates (Poisson arrivals), comma separated (default 2,4,8)")
    p.add_argument("--requests", type=int, default=30, help="requests per cell (default 30)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma separated, of {', '.join(MODES)} (default all)")
    p.add_argument("--max-new-tokens", type=int, default=16, help="tokens each request generates (default 16)")
    p.add_argument("--layers", type=int, default=2, help="model layers (default 2)")
    p.add_argument("--kv-heads", type=int, default=1,
                   help="query and KV heads of the model (head_dim = 128 / heads; default 1: prefill of 1k "
                        "tokens costs tens of ms on a small CPU, attention is quadratic in the prompt)")
    p.add_argument("--warmup", type=int, default=2, help="untimed requests per mode and prompt length (default 2)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="decode engine's running batch at most (default 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cell-timeout", type=float, default=180.0,
                   help="seconds without progress before a cell's remaining requests count as failed (default 180)")


def kvpushd_pull_available() -> bool:
    """Whether the installed ``KVPushdHooks`` takes ``transfer_mode`` (kvpushd's pull mode)."""
    from ..refengine import KVPushdHooks

    try:
        return all("transfer_mode" in inspect.signature(f).parameters
                   for f in (KVPushdHooks.attach, KVPushdHooks.__init__))
    except (TypeError, ValueError):
        return False


def _config(spec: dict[str, Any]) -> Any:
    from ..refengine import TinyConfig

    h = int(spec["heads"])
    return TinyConfig(num_layers=int(spec["layers"]), num_heads=h, num_kv_heads=h, head_dim=128 // h,
                      hidden_size=128, max_positions=int(spec["max_positions"]))


# ---------------------------------------------------------------------------------------------
# Engine processes


def _engine_main(role: str, mode: str, spec: dict[str, Any], conn: Connection) -> None:
    from ..demo.engine_proc import run_engine_child

    run_engine_child(f"{mode} {role} engine", lambda: _engine_loop(role, mode, spec, conn), conn)


def _engine_loop(role: str, mode: str, spec: dict[str, Any], conn: Connection) -> None:
    """One engine: messages in ("add", rid, prompt, max_new, kv_params), ("first_token", rid, tok),
    ("finish",); out ("ready", static kv_params), ("first", rid, t_ns), ("out", rid, ok, tokens,
    error, kv_params, t_ns), ("stats", {...}), ("error", text)."""
    import torch

    from ..refengine import Engine, KVPushdHooks, PagedKV, TinyModel

    torch.set_num_threads(1)
    cfg = _config(spec)
    model = TinyModel(cfg, int(spec["seed"]))
    kv = PagedKV.shared(cfg, int(spec["num_blocks"]), f"kvpushd-sweep-{mode}-{role}")
    client = None
    hooks: Any = None
    try:
        if mode.startswith("kvpushd"):
            from kvpushd_client import KVPushClient, Role

            client = KVPushClient(spec["sock"])
            client.wait_ready(120)
            kw = {"transfer_mode": "pull"} if mode == "kvpushd-pull" else {}
            hooks = KVPushdHooks.attach(client, f"sweep-{mode}-{role}",
                                        Role.PRODUCER if role == "prefill" else Role.CONSUMER,
                                        kv, description=f"kvpushd bench sweep {role} pid {os.getpid()}", **kw)
            host, _, port = hooks.peer_address.rpartition(":")
            static = {"remote_engine_id": hooks.engine_id, "remote_host": host, "remote_port": int(port),
                      "tp_size": 1}
        else:
            from ..refengine.inengine import InEnginePullHooks, InEnginePushHooks

            cls = InEnginePullHooks if mode == "inengine-pull" else InEnginePushHooks
            hooks = cls(kv, f"sweep-{mode}-{role}")
            static = hooks.kv_params
        engine = Engine(model, kv, role, hooks, max_num_seqs=int(spec["max_num_seqs"]), max_prefills_per_step=1)
        conn.send(("ready", static if role == "prefill" else {}))
        first_seen: set[str] = set()
        steps_busy = 0
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
            outs = engine.step()
            t = time.monotonic_ns()
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
                             "send_failures": len(engine.send_failures),
                             "handshakes": int(getattr(hooks, "handshakes", 0))}))
    finally:
        if hooks is not None:
            with contextlib.suppress(Exception):
                hooks.close()
        kv.close()
        if client is not None:
            client.close()


class _Engines:
    """The prefill and decode engine processes of one mode; a writer thread per engine."""

    def __init__(self, mode: str, spec: dict[str, Any], socks: dict[str, str]) -> None:
        ctx = mp.get_context("spawn")
        self.mode = mode
        self.procs: dict[str, Any] = {}
        self.conns: dict[str, Connection] = {}
        self.outboxes: dict[str, queue.SimpleQueue[tuple[Any, ...] | None]] = {}
        self.stats: dict[str, dict[str, Any]] = {}
        for role in ("prefill", "decode"):
            mine, theirs = ctx.Pipe()
            s = {**spec, "sock": socks.get(role, ""), "num_blocks": spec[f"{role}_blocks"]}
            pr = ctx.Process(target=_engine_main, args=(role, mode, s, theirs), daemon=True,
                             name=f"kvpushd-sweep-{role}")
            pr.start()
            theirs.close()
            self.procs[role], self.conns[role] = pr, mine
            q: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
            self.outboxes[role] = q
            threading.Thread(target=self._writer, args=(mine, q), daemon=True).start()

    @staticmethod
    def _writer(conn: Connection, q: queue.SimpleQueue[tuple[Any, ...] | None]) -> None:
        while (m := q.get()) is not None:
            try:
                conn.send(m)
            except OSError:
                return

    def send(self, role: str, msg: tuple[Any, ...]) -> None:
        self.outboxes[role].put(msg)

    def recv(self, timeout_s: float) -> Iterator[tuple[str, tuple[Any, ...]]]:
        for ready in wait(list(self.conns.values()), max(0.0, timeout_s)):
            role = "prefill" if ready is self.conns["prefill"] else "decode"
            try:
                msg = tuple(self.conns[role].recv())
            except EOFError:
                raise BenchError(f"{self.mode}: the {role} engine exited (code {self.procs[role].exitcode})") from None
            if msg[0] == "error":
                raise BenchError(str(msg[1]))
            if msg[0] == "stats":
                self.stats[role] = msg[1]
                continue
            yield role, msg

    def ready(self, timeout_s: float = 300.0) -> dict[str, Any]:
        static: dict[str, Any] = {}
        pending = {"prefill", "decode"}
        deadline = time.monotonic() + timeout_s
        while pending:
            if time.monotonic() > deadline:
                raise BenchError(f"{self.mode}: engines {sorted(pending)} not ready after {timeout_s:g} s")
            for role, msg in self.recv(0.5):
                if msg[0] == "ready":
                    pending.discard(role)
                    if role == "prefill":
                        static = dict(msg[1])
            for role in pending:
                if not self.procs[role].is_alive() and not self.conns[role].poll(0):
                    raise BenchError(f"{self.mode}: the {role} engine exited while starting")
        return static

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
        for pr in self.procs.values():
            pr.join(10)
            if pr.is_alive():
                pr.terminate()
                pr.join(10)


# ---------------------------------------------------------------------------------------------
# Cells


@dataclass
class _Req:
    rid: str
    key: tuple[int, float, int]  # (prompt length, qps, index): the same prompt in every mode
    prompt: list[int]
    t_arrival: int = 0
    t_first: int = 0
    t_done: int = 0
    done: bool = False
    ok: bool = False
    tokens: list[int] = field(default_factory=list)
    error: str = ""


def _prompts(args: argparse.Namespace, plen: int, qps: float, n: int, vocab: int) -> list[tuple[tuple[int, float, int],
                                                                                             list[int]]]:
    from ..refengine import random_prompt

    base = args.seed * 1_000_003 + plen * 7919 + int(qps * 1000) * 104_729
    return [((plen, qps, i), random_prompt(base + i, plen, vocab)) for i in range(n)]


def _arrivals(seed: int, plen: int, qps: float, n: int) -> list[float]:
    """Poisson arrivals: offsets in seconds from the cell's start (the same for every mode)."""
    rng = random.Random(f"{seed}-{plen}-{qps}")
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(qps)
    return out


def _run_requests(eng: _Engines, mode: str, static: dict[str, Any], reqs: list[_Req], offsets: list[float],
                  max_new: int, timeout_s: float) -> float:
    """Dispatch at the arrival offsets, collect until every request is done; returns the wall time."""
    push = mode.endswith("push")
    by_id = {r.rid: r for r in reqs}
    t0 = time.monotonic_ns() + 20_000_000
    for r, off in zip(reqs, offsets, strict=True):
        r.t_arrival = t0 + int(off * 1e9)
    nxt = done = 0
    last_change = time.monotonic()
    while done < len(reqs):
        now = time.monotonic_ns()
        while nxt < len(reqs) and reqs[nxt].t_arrival <= now:
            r = reqs[nxt]
            nxt += 1
            if push:  # the router sends to both at once: decode registers its blocks while prefill runs
                eng.send("decode", ("add", r.rid, r.prompt, max_new, {"transfer_id": r.rid, **static}))
            eng.send("prefill", ("add", r.rid, r.prompt, 1, None))
        until = (reqs[nxt].t_arrival - time.monotonic_ns()) / 1e9 if nxt < len(reqs) else 0.05
        for role, msg in eng.recv(min(0.05, until)):
            r = by_id.get(msg[1])  # type: ignore[assignment]
            if r is None or r.done:
                continue
            last_change = time.monotonic()
            if msg[0] == "first":
                r.t_first = r.t_first or int(msg[2])
            elif msg[0] == "out" and role == "prefill":
                ok, tokens, error, params = msg[2:6]
                if not ok:
                    r.done, r.error = True, f"prefill: {error}"
                    done += 1
                elif push:
                    eng.send("decode", ("first_token", r.rid, tokens[0]))
                else:  # the router relays prefill's kv_params (block ids, where from, first token)
                    eng.send("decode", ("add", r.rid, r.prompt, max_new, params))
            elif msg[0] == "out":
                r.done, r.ok, r.tokens, r.error, r.t_done = True, bool(msg[2]), list(msg[3]), str(msg[4]), int(msg[6])
                done += 1
        if time.monotonic() - last_change > timeout_s and nxt == len(reqs):
            for r in reqs:
                if not r.done:
                    r.done, r.error = True, f"no result within {timeout_s:g} s"
            break
    return (time.monotonic_ns() - t0) / 1e9


def _cell_figures(reqs: list[_Req], max_new: int) -> dict[str, Any]:
    ok = [r for r in reqs if r.ok]
    ttft = [(r.t_first - r.t_arrival) / 1e6 for r in ok if r.t_first]
    tpot = [(r.t_done - r.t_first) / 1e6 / (len(r.tokens) - 2) for r in ok if r.t_first and len(r.tokens) > 2]
    return {"ttft_ms": dist(ttft, 2), "tpot_ms": dist(tpot, 2), "completed": len(ok), "failed": len(reqs) - len(ok),
            "errors": sorted({r.error for r in reqs if r.error})[:3]}


def _run_all(args: argparse.Namespace, modes: list[str], workdir: Path, spec: dict[str, Any],
             cells: list[dict[str, Any]], all_reqs: list[_Req]) -> dict[str, dict[str, Any]]:
    """Every mode's engines (and one daemon pair for the kvpushd modes) run at once; cell by cell the
    modes take turns (in a rotating order), so the machine's load drifts over all modes alike."""
    t_start = time.monotonic()
    status: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as stack:
        socks: dict[str, str] = {}
        daemons: tuple[DaemonProc, DaemonProc] | None = None
        engines: dict[str, _Engines] = {}
        if any(m.startswith("kvpushd") for m in modes):
            daemons = stack.enter_context(daemon_pair(workdir))
            socks = {"prefill": daemons[0].sock, "decode": daemons[1].sock}
        for m in modes:
            engines[m] = _Engines(m, spec, socks if m.startswith("kvpushd") else {})
            stack.callback(engines[m].stop)
        statics = {m: e.ready() for m, e in engines.items()}
        progress(f"sweep: {len(engines)} engine pairs ready in {time.monotonic() - t_start:.1f} s")
        tag = os.urandom(2).hex()
        turn = 0
        for plen in args.prompt_lens:
            for m in modes:  # one at a time: handshakes, first touch of blocks
                for k, p in _prompts(args, plen, -1.0, args.warmup, spec["vocab"]):
                    r = _Req(f"{m}-warm-{plen}-{k[2]}-{tag}", k, p)
                    _run_requests(engines[m], m, statics[m], [r], [0.0], args.max_new_tokens, args.cell_timeout)
            for qps in args.qps:
                prompts = _prompts(args, plen, qps, args.requests, spec["vocab"])
                offsets = _arrivals(args.seed, plen, qps, args.requests)
                order = modes[turn % len(modes):] + modes[:turn % len(modes)]
                turn += 1
                for m in order:
                    reqs = [_Req(f"{m}-{plen}-{qps:g}-{i}-{tag}", k, p) for i, (k, p) in enumerate(prompts)]
                    load = os.getloadavg()[0]
                    wall = _run_requests(engines[m], m, statics[m], reqs, offsets, args.max_new_tokens,
                                         args.cell_timeout)
                    fig = _cell_figures(reqs, args.max_new_tokens)
                    cells.append({"mode": m, "prompt_len": plen, "qps": qps, "requests": len(reqs), **fig,
                                  "achieved_qps": round(len(reqs) / max(wall, 1e-9), 2), "wall_s": round(wall, 2),
                                  "loadavg_1m": round(load, 2)})
                    all_reqs.extend(reqs)
                    progress(f"  {m:14s} prompt {plen:5d} qps {qps:4g}: TTFT p50 {fig['ttft_ms']['p50']:8.1f} ms "
                             f"p99 {fig['ttft_ms']['p99']:8.1f} ms, TPOT p50 {fig['tpot_ms']['p50']:6.1f} ms, "
                             f"{fig['failed']} failed, {wall:.1f} s, load {load:.1f}")
                    time.sleep(0.3)  # let the engines go idle between cells
        for e in engines.values():
            e.stop()
        counters: dict[str, int] = {}
        if daemons is not None:
            with contextlib.suppress(Exception):
                c = daemons[0].client.status().counters
                counters = {"prefill_daemon_bytes_written": int(c.bytes_written)}
        for m, e in engines.items():
            status[m] = {"status": "ok", "engine_stats": e.stats,
                         **({"daemon_counters": counters} if m.startswith("kvpushd") else {})}
    progress(f"sweep: timed runs done in {time.monotonic() - t_start:.1f} s")
    return status


def _references(cfg: Any, seed: int, reqs: list[_Req], max_new: int) -> dict[tuple[int, float, int], list[int]]:
    import torch

    from ..refengine import TinyModel

    torch.set_num_threads(1)
    model = TinyModel(cfg, seed)
    out: dict[tuple[int, float, int], list[int]] = {}
    for r in reqs:
        if r.key not in out:
            out[r.key] = model.generate_monolithic(r.prompt, max_new)
    return out


def run(args: argparse.Namespace, workdir: Path) -> Result:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise BenchError(f"unknown mode(s) {bad}; choose from {', '.join(MODES)}")
    if args.requests < 1 or args.max_new_tokens < 3 or not args.prompt_lens or not args.qps:
        raise BenchError("need --requests >= 1, --max-new-tokens >= 3 (TPOT needs two intervals), prompt lengths "
                         "and rates")
    if any(q <= 0 for q in args.qps) or any(n < 1 for n in args.prompt_lens) or args.warmup < 0:
        raise BenchError("rates and prompt lengths must be positive")
    if 128 % args.kv_heads:
        raise BenchError("--kv-heads must divide 128")
    max_len = max(args.prompt_lens)
    spec: dict[str, Any] = {"layers": args.layers, "heads": args.kv_heads, "seed": args.seed,
                            "max_positions": max(4096, max_len + args.max_new_tokens),
                            "max_num_seqs": args.max_num_seqs}
    cfg = _config(spec)
    spec["vocab"] = cfg.vocab_size
    slots = min(args.requests, 64) + 2
    spec["prefill_blocks"] = cfg.blocks_for(max_len) * slots
    spec["decode_blocks"] = cfg.blocks_for(max_len + args.max_new_tokens - 1) * slots
    status: dict[str, dict[str, Any]] = {}
    runnable = []
    for m in modes:
        if m == "kvpushd-pull" and not kvpushd_pull_available():
            status[m] = {"status": "unavailable: KVPushdHooks has no transfer_mode option yet (kvpushd pull mode "
                                   "not installed)"}
            progress(f"sweep: {m} unavailable (KVPushdHooks takes no transfer_mode)")
        else:
            runnable.append(m)
    progress(f"sweep: modes {runnable}, prompt lengths {args.prompt_lens}, QPS {args.qps}, {args.requests} requests "
             f"per cell, {args.max_new_tokens} new tokens, model {args.layers} layers x {args.kv_heads} KV heads "
             f"(KV {2 * cfg.num_layers * _block_bytes(cfg) * cfg.blocks_for(max_len) / 2**20:.1f} MiB per "
             f"{max_len}-token request)")
    cells: list[dict[str, Any]] = []
    all_reqs: list[_Req] = []
    if runnable:
        status.update(_run_all(args, runnable, workdir, spec, cells, all_reqs))
    progress(f"sweep: computing monolithic reference tokens for {len({r.key for r in all_reqs})} prompts")
    refs = _references(cfg, args.seed, all_reqs, args.max_new_tokens)
    for c in cells:
        mine = [r for r in all_reqs if r.rid.startswith(f"{c['mode']}-{c['prompt_len']}-{c['qps']:g}-")]
        mism = sum(1 for r in mine if not r.ok or r.tokens != refs[r.key])
        c["tokens_mismatched"] = mism
        c["tokens_match"] = mism == 0
    return _result(args, modes, status, cells, spec)


def _block_bytes(cfg: Any) -> int:
    """Bytes of one block in one region (one layer's K or V)."""
    return int(cfg.num_kv_heads * cfg.block_size * cfg.head_dim * cfg.dtype_bytes)


def _result(args: argparse.Namespace, modes: list[str], status: dict[str, dict[str, Any]],
            cells: list[dict[str, Any]], spec: dict[str, Any]) -> Result:
    top = max(args.qps)
    ratios: dict[str, Any] = {}
    lines = []
    for plen in args.prompt_lens:
        def p50(mode: str, plen: int = plen) -> float | None:
            for c in cells:
                if c["mode"] == mode and c["prompt_len"] == plen and c["qps"] == top and c["ttft_ms"]["n"]:
                    return float(c["ttft_ms"]["p50"])
            return None

        push, pull = p50("kvpushd-push"), p50("inengine-pull")
        ratio = round(push / pull, 3) if push is not None and pull else None
        ratios[str(plen)] = {"qps": top, "kvpushd_push_ttft_p50_ms": push, "inengine_pull_ttft_p50_ms": pull,
                             "ratio": ratio, "target_met": ratio is not None and ratio <= TARGET_RATIO}
        others = ", ".join(f"{m} {v:.1f} ms" for m in MODES if (v := p50(m)) is not None)
        lines.append(f"prompt {plen}, QPS {top:g}: TTFT p50 kvpushd-push / inengine-pull = "
                     f"{'-' if ratio is None else f'{ratio:.2f}'}  target <= {TARGET_RATIO}: "
                     f"{'-' if ratio is None else ('met' if ratio <= TARGET_RATIO else 'MISSED')}  ({others})")
    for m in modes:
        if not status.get(m, {}).get("status", "").startswith("ok"):
            lines.append(f"{m}: {status.get(m, {}).get('status')}")
    all_match = all(c["tokens_match"] for c in cells) and bool(cells)
    lines.append(f"tokens match the monolithic run in every cell: {'yes' if all_match else 'NO'}")
    data: dict[str, Any] = {
        "modes": status, "cells": cells, "ratio_at_top_qps": ratios, "target_ratio": TARGET_RATIO,
        "target_met": bool(ratios) and all(r["target_met"] for r in ratios.values()),
        "tokens_match": all_match, "prompt_lens": args.prompt_lens, "qps": args.qps, "requests": args.requests,
        "max_new_tokens": args.max_new_tokens, "warmup": args.warmup,
        "model": {"layers": spec["layers"], "heads": spec["heads"], "kv_heads": spec["heads"],
                  "head_dim": 128 // spec["heads"], "hidden": 128, "block_size": 16},
    }
    rows = [{"mode": c["mode"], "prompt_len": c["prompt_len"], "qps": c["qps"],
             "ttft_p50": c["ttft_ms"]["p50"], "ttft_p99": c["ttft_ms"]["p99"], "tpot_p50": c["tpot_ms"]["p50"],
             "tpot_p99": c["tpot_ms"]["p99"], "failed": c["failed"], "match": "yes" if c["tokens_match"] else "NO",
             "achieved_qps": c["achieved_qps"]} for c in cells]
    cols = [("mode", "mode", "<"), ("prompt_len", "prompt", "d"), ("qps", "QPS", "g"),
            ("achieved_qps", "got QPS", ".2f"), ("ttft_p50", "TTFT p50 ms", ".1f"), ("ttft_p99", "TTFT p99 ms", ".1f"),
            ("tpot_p50", "TPOT p50 ms", ".2f"), ("tpot_p99", "TPOT p99 ms", ".2f"), ("failed", "failed", "d"),
            ("match", "tokens", "<")]
    method = [
        "per mode one prefill and one decode reference-engine process (tiny deterministic transformer, paged KV "
        f"in shared memory, {spec['layers']} layers, {spec['heads']} KV heads x head_dim {128 // spec['heads']}, "
        "16 tokens per block, no prefix cache) serve every cell; kvpushd modes add two daemons, in-engine modes "
        "own NIXL agents in the engine processes (UCX).",
        "push modes: the router sends each request to both engines at its arrival (decode registers blocks at "
        "allocation) and relays prefill's first token; pull modes: the router sends it to decode with prefill's "
        "kv_params once prefill answered (vLLM's proxy flow).",
        f"per prompt length {args.warmup} untimed warm-up requests, then per QPS {args.requests} distinct prompts "
        "with Poisson arrivals (the same prompts and arrival times for every mode).",
        "TTFT: arrival -> end of the decode engine step that first emits tokens for the request; TPOT: (last token "
        "- first emitted) / (tokens - 2), all CLOCK_MONOTONIC across processes. Percentiles nearest-rank.",
        "tokens: every request against a monolithic run of the same model (computed after the timed runs).",
    ]
    return Result("sweep", data, cols, rows, lines, method, {"cells": cells, "top_qps": top})


def plot_sweep(r: Result, outdir: Path) -> list[Path]:
    """Per prompt length: TTFT and TPOT (p50 solid, p99 dashed) against QPS, one line per mode."""
    import matplotlib.pyplot as plt

    cells = r.samples.get("cells", [])
    out = []
    for plen in sorted({c["prompt_len"] for c in cells}):
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
        for mode in MODES:
            cs = sorted((c for c in cells if c["mode"] == mode and c["prompt_len"] == plen), key=lambda c: c["qps"])
            if not cs:
                continue
            x = [c["qps"] for c in cs]
            for ax, key in ((a1, "ttft_ms"), (a2, "tpot_ms")):
                line = ax.plot(x, [c[key]["p50"] for c in cs], marker="o", label=f"{mode} p50")[0]
                ax.plot(x, [c[key]["p99"] for c in cs], marker="x", linestyle="--", color=line.get_color(),
                        label=f"{mode} p99")
        for ax, what in ((a1, "TTFT (ms)"), (a2, "TPOT (ms)")):
            ax.set_xlabel("QPS")
            ax.set_ylabel(what)
            ax.grid(alpha=0.3)
        a1.legend(fontsize=7)
        fig.suptitle(f"kvpushd bench sweep: prompt {plen} tokens, {r.data.get('max_new_tokens')} new tokens")
        fig.tight_layout()
        path = outdir / f"sweep_prompt{plen}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        out.append(path)
    return out
