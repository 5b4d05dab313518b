"""The sweep's cells: prompts and Poisson arrivals, dispatch and collection (the router), figures."""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..common import DaemonProc, daemon_pair, dist, progress
from .engines import Engines


@dataclass
class Req:
    rid: str
    key: tuple[int, float, int]  # (prompt length, qps, index): the same prompt in every mode
    prompt: list[int]
    t_arrival: int = 0
    t_first: int = 0
    t_prefilled: int = 0  # the prefill engine's step that prefilled it (and published its KV) ended
    t_done: int = 0
    done: bool = False
    ok: bool = False
    tokens: list[int] = field(default_factory=list)
    error: str = ""


def prompts(args: argparse.Namespace, plen: int, qps: float, n: int, vocab: int) -> list[tuple[tuple[int, float, int],
                                                                                             list[int]]]:
    from ...refengine import random_prompt

    base = args.seed * 1_000_003 + plen * 7919 + int(qps * 1000) * 104_729
    return [((plen, qps, i), random_prompt(base + i, plen, vocab)) for i in range(n)]


def arrivals(seed: int, plen: int, qps: float, n: int) -> list[float]:
    """Poisson arrivals: offsets in seconds from the cell's start (the same for every mode)."""
    rng = random.Random(f"{seed}-{plen}-{qps}")
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(qps)
    return out


def run_requests(eng: Engines, mode: str, static: dict[str, Any], reqs: list[Req], offsets: list[float],
                  max_new: int, timeout_s: float) -> float:
    """Dispatch at the arrival offsets, collect until every request is done; returns the wall time."""
    push = mode.endswith(("push", "whole"))
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
                r.t_prefilled = int(msg[6])
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


def cell_figures(reqs: list[Req], max_new: int) -> dict[str, Any]:
    ok = [r for r in reqs if r.ok]
    ttft = [(r.t_first - r.t_arrival) / 1e6 for r in ok if r.t_first]
    tpot = [(r.t_done - r.t_first) / 1e6 / (len(r.tokens) - 2) for r in ok if r.t_first and len(r.tokens) > 2]
    split = [r for r in ok if r.t_first and r.t_prefilled]
    return {"ttft_ms": dist(ttft, 2), "tpot_ms": dist(tpot, 2),
            # TTFT in two: arrival -> end of the prefill step (queue, prefill, publish), then -> first token
            # (the KV's hand-over: the transfer, the notices, the decode engine's first step)
            "to_prefilled_ms": dist([(r.t_prefilled - r.t_arrival) / 1e6 for r in split], 2),
            "handover_ms": dist([(r.t_first - r.t_prefilled) / 1e6 for r in split], 2),
            "completed": len(ok), "failed": len(reqs) - len(ok),
            "errors": sorted({r.error for r in reqs if r.error})[:3]}


def run_all(args: argparse.Namespace, modes: list[str], workdir: Path, spec: dict[str, Any],
             cells: list[dict[str, Any]], all_reqs: list[Req]) -> dict[str, dict[str, Any]]:
    """Every mode's engines (and one daemon pair for the kvpushd modes) run at once; cell by cell the
    modes take turns (in a rotating order), so the machine's load drifts over all modes alike."""
    t_start = time.monotonic()
    status: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as stack:
        socks: dict[str, str] = {}
        daemons: tuple[DaemonProc, DaemonProc] | None = None
        engines: dict[str, Engines] = {}
        if any(m.startswith("kvpushd") for m in modes):
            daemons = stack.enter_context(daemon_pair(workdir))
            socks = {"prefill": daemons[0].sock, "decode": daemons[1].sock}
        for m in modes:
            engines[m] = Engines(m, spec, socks if m.startswith("kvpushd") else {})
            stack.callback(engines[m].stop)
        statics = {m: e.ready() for m, e in engines.items()}
        progress(f"sweep: {len(engines)} engine pairs ready in {time.monotonic() - t_start:.1f} s; pids: "
                 + ", ".join([*(f"{m} {r} engine {e.procs[r].pid}" for m, e in engines.items() for r in e.procs),
                              *([f"prefill daemon {daemons[0].proc.pid}", f"decode daemon {daemons[1].proc.pid}"]
                                if daemons is not None else [])]))
        tag = os.urandom(2).hex()
        turn = 0
        for plen in args.prompt_lens:
            for m in modes:  # one at a time: handshakes, first touch of blocks
                for k, p in prompts(args, plen, -1.0, args.warmup, spec["vocab"]):
                    r = Req(f"{m}-warm-{plen}-{k[2]}-{tag}", k, p)
                    run_requests(engines[m], m, statics[m], [r], [0.0], args.max_new_tokens, args.cell_timeout)
            for qps in args.qps:
                cell_prompts = prompts(args, plen, qps, args.requests, spec["vocab"])
                offsets = arrivals(args.seed, plen, qps, args.requests)
                order = modes[turn % len(modes):] + modes[:turn % len(modes)]
                turn += 1
                for m in order:
                    reqs = [Req(f"{m}-{plen}-{qps:g}-{i}-{tag}", k, p) for i, (k, p) in enumerate(cell_prompts)]
                    load = os.getloadavg()[0]
                    wall = run_requests(engines[m], m, statics[m], reqs, offsets, args.max_new_tokens,
                                         args.cell_timeout)
                    fig = cell_figures(reqs, args.max_new_tokens)
                    blocks = -(-plen // int(spec["block_tokens"]))
                    cells.append({"mode": m, "prompt_len": plen, "qps": qps, "requests": len(reqs), **fig,
                                  "kv_bytes_per_request": blocks * int(spec["regions"]) * int(spec["block_len"]),
                                  "descriptors_per_request": blocks * int(spec["regions"]),
                                  "achieved_qps": round(len(reqs) / max(wall, 1e-9), 2), "wall_s": round(wall, 2),
                                  "loadavg_1m": round(load, 2)})
                    all_reqs.extend(reqs)
                    progress(f"  {m:14s} prompt {plen:5d} qps {qps:4g}: TTFT p50 {fig['ttft_ms']['p50']:8.1f} ms "
                             f"p99 {fig['ttft_ms']['p99']:8.1f} ms (to prefilled {fig['to_prefilled_ms']['p50']:.1f}, "
                             f"hand-over {fig['handover_ms']['p50']:.1f}), TPOT p50 {fig['tpot_ms']['p50']:6.1f} ms, "
                             f"{fig['failed']} failed, {wall:.1f} s, load {load:.1f}")
                    time.sleep(0.3)  # let the engines go idle between cells
        for e in engines.values():
            e.stop()
        counters: dict[str, int] = {}
        if daemons is not None:
            with contextlib.suppress(Exception):
                c = daemons[0].client.status().counters
                counters = {"prefill_daemon_bytes_written": int(c.bytes_written),
                            "prefill_daemon_descriptors_requested": int(c.descriptors_requested),
                            "prefill_daemon_descriptors_posted": int(c.descriptors_posted)}
        for m, e in engines.items():
            status[m] = {"status": "ok", "engine_stats": e.stats,
                         **({"daemon_counters": counters} if m.startswith("kvpushd") else {})}
    progress(f"sweep: timed runs done in {time.monotonic() - t_start:.1f} s")
    return status


def references(cfg: Any, seed: int, reqs: list[Req], max_new: int) -> dict[tuple[int, float, int], list[int]]:
    import torch

    from ...refengine import TinyModel

    torch.set_num_threads(1)
    model = TinyModel(cfg, seed)
    out: dict[tuple[int, float, int], list[int]] = {}
    for r in reqs:
        if r.key not in out:
            out[r.key] = model.generate_monolithic(r.prompt, max_new)
    return out

