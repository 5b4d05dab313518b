"""``rate``: rendezvous per second through one pair of daemons, with small requests.

One region of 4 KiB blocks; each request moves one block, ``--concurrency`` requests in flight.
One worker Stream per side, driven like an engine loop: every step queues an Expect and a Publish for
each free slot and sends them as one message per side, then takes the completions that came.
Completed requests are counted over ``--seconds`` after a short warm-up; latency is from issuing Expect
and Publish to the later of the two completions. CPU time of each process over the window shows where
the time goes.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from kvpushd_client import CompletionKind, Expect, KVPushClient, Publish, Region, Role

from ..launch import cpu_seconds
from .common import POISON, BenchError, KVMemory, Layout, Result, daemon_pair, dist, met, progress

TARGET_PER_S = 5000.0
BUCKET_S = 0.1


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seconds", type=float, default=5.0, help="measured duration (default 5)")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds before counting starts (default 1)")
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight (default 64)")


def run(args: argparse.Namespace, workdir: Path) -> Result:
    if args.seconds <= 0 or args.concurrency < 1:
        raise BenchError("--seconds must be positive and --concurrency at least 1")
    lay = Layout(layers=1, num_blocks=args.concurrency)  # 2 regions; requests use the first only
    src = KVMemory("kvpushd-bench-src", lay)
    dst = KVMemory("kvpushd-bench-dst", lay, fill=POISON)
    progress(f"rate: {args.concurrency} requests in flight, 1 block of {lay.block_len} B each, "
             f"{args.warmup:g} s warm-up + {args.seconds:g} s")
    try:
        with daemon_pair(workdir) as (p, d):
            pids = {"prefill daemon": p.proc.pid, "decode daemon": d.proc.pid, "bench client": os.getpid()}
            out = _drive_stream(args, p.sock, d.sock, p.peer_address, src, dst, lay, pids)
    finally:
        src.close()
        dst.close()
    return _result(args, out)


def _drive_stream(args: argparse.Namespace, psock: str, dsock: str, paddr: str, src: KVMemory, dst: KVMemory,
                  lay: Layout, pids: dict[str, int]) -> dict[str, Any]:
    """An engine-like loop on one worker Stream per side: refill free slots, one step per side, completions."""
    pc, dc = KVPushClient(psock), KVPushClient(dsock)
    region = [Region(0, 0, lay.num_blocks, lay.block_len)]
    pw = pc.attach("bench-prefill", Role.PRODUCER, 0, 1, [src.buf.memory], region,
                          description="kvpushd bench rate")
    dw = dc.attach("bench-decode", Role.CONSUMER, 0, 1, [dst.buf.memory], region,
                          description="kvpushd bench rate")
    tag = os.urandom(3).hex()
    free = list(range(args.concurrency))
    slots: dict[str, tuple[int, float, int]] = {}  # transfer id -> (slot, issued, sides done)
    ends: list[float] = []
    lat_ms: list[float] = []
    failed: list[str] = []
    t_start = time.monotonic() + args.warmup
    t_end = t_start + args.seconds
    cpu0: dict[str, float] = {}
    i = 0
    while (now := time.monotonic()) < t_end or slots:
        if not cpu0 and now >= t_start:
            cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
        while free and now < t_end:
            k = free.pop()
            tid = f"rate-{tag}-{i}"
            i += 1
            slots[tid] = (k, now, 0)
            dw.send_nowait(Expect(tid, (k,), paddr, "bench-prefill", 1))
            pw.send_nowait(Publish(tid, (k,)))
        dw.step()
        pw.step()
        got = dw.completions() + pw.completions()
        if not got:
            c = dw.next_completion(0.002)
            got = ([c] if c is not None else []) + pw.completions()
        for c in got:
            entry = slots.get(c.transfer_id)
            if entry is None:
                continue
            k, t0, n = entry
            if c.kind is CompletionKind.FAILED:
                failed.append(f"{c.transfer_id}: {c.code}: {c.reason}")
            if n == 0:
                slots[c.transfer_id] = (k, t0, 1)
                continue
            del slots[c.transfer_id]
            free.append(k)
            t1 = time.monotonic()
            if t_start <= t1 < t_end:
                ends.append(t1 - t_start)
                lat_ms.append((t1 - t0) * 1e3)
        if time.monotonic() > t_end + 60:
            failed.extend(f"{tid}: no completion 60 s after the window" for tid in slots)
            break
    cpu = {name: round((cpu_seconds(pid) - cpu0.get(name, 0.0)) / args.seconds, 2) for name, pid in pids.items()}
    pw.detach()
    dw.detach()
    pc.close()
    dc.close()
    return {"ends": ends, "latency_ms": lat_ms, "failed": failed, "cpu_cores": cpu}


def _result(args: argparse.Namespace, out: dict[str, Any]) -> Result:
    ends: list[float] = out["ends"]
    n = len(ends)
    rate = n / args.seconds
    lat = dist(out["latency_ms"], 3)
    buckets = [0] * max(1, round(args.seconds / BUCKET_S))
    for t in ends:
        buckets[min(len(buckets) - 1, int(t / BUCKET_S))] += 1
    cpu: dict[str, float] = out["cpu_cores"]
    per_k = {name: round(c / rate * 1e6, 1) if rate else 0.0 for name, c in cpu.items()}
    data: dict[str, Any] = {
        "rate_per_s": round(rate, 1), "completed": n, "failed": len(out["failed"]), "seconds": args.seconds,
        "concurrency": args.concurrency, "latency_ms": lat, "target_per_s": TARGET_PER_S,
        "target_met": rate >= TARGET_PER_S, "cpu_cores": cpu, "cpu_us_per_rendezvous": per_k,
        "failures": out["failed"][:5],
    }
    rows = [{"process": name, "cores": c, "us": per_k[name]} for name, c in cpu.items()]
    cols = [("process", "process", "<"), ("cores", "CPU cores busy", ".2f"), ("us", "CPU us per rendezvous", ".1f")]
    lines = [f"rendezvous per second: {rate:,.0f} ({n} completed in {args.seconds:g} s, {len(out['failed'])} "
             f"failed)  target >= {TARGET_PER_S:,.0f}: {met(rate, TARGET_PER_S, True)}",
             f"latency Expect+Publish -> both completions: p50 {lat['p50']:.2f} ms, p99 {lat['p99']:.2f} ms "
             f"(concurrency {args.concurrency})"]
    how = (f"one worker Stream per side, an engine-like loop keeping {args.concurrency} requests in flight (every "
           "step queues an Expect and a Publish per free slot and sends one message per side)")
    method = [
        f"{how}, for a 1-block, 1-region (4 KiB) request, waiting for both completions; "
        f"requests completed in the {args.seconds:g} s after a {args.warmup:g} s warm-up are counted.",
        "CPU cores busy: user+system CPU time of each process over the window / its length (from /proc).",
    ]
    return Result("rate", data, cols, rows, lines, method,
                  {"timeline": buckets, "bucket_s": BUCKET_S, "latency_ms": out["latency_ms"]})
