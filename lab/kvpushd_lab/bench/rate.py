"""``rate``: rendezvous per second through one pair of daemons, with small requests.

One region of 4 KiB blocks; each request moves one block, ``--concurrency`` requests in flight.
``--calls stream`` (the default, what engines use): one worker Stream per side, driven like an engine
loop: every step queues an Expect and a Publish for each free slot and sends them as one message per
side, then takes the completions that came. ``--calls unary``: ``--concurrency`` asyncio tasks (the
``AsyncKVPushClient``) each loop: Expect on the decode worker and Publish on the prefill worker at
the same time (one unary call each), then wait for FINISHED_RECEIVING and FINISHED_SENDING. Completed requests are
counted over ``--seconds`` after a short warm-up; latency is from issuing Expect and Publish to the
later of the two completions. CPU time of each process over the window shows where the time goes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path
from typing import Any

from kvpushd_client import AsyncKVPushClient, AsyncWorker, Completion, CompletionKind, KVPushClient, Region, Role

from ..launch import cpu_seconds
from .common import POISON, BenchError, KVMemory, Layout, Result, daemon_pair, dist, met, progress

TARGET_PER_S = 5000.0
BUCKET_S = 0.1


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seconds", type=float, default=5.0, help="measured duration (default 5)")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds before counting starts (default 1)")
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight (default 64)")
    p.add_argument("--calls", choices=("stream", "unary"), default="stream",
                   help="stream: one worker Stream per side, a batch per step (default); unary: a call per request")


class _Router:
    """Reads one worker's completions and hands each to the task waiting for its transfer id."""

    def __init__(self, w: AsyncWorker) -> None:
        self.w = w
        self.waiting: dict[str, asyncio.Future[Completion]] = {}
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            c = await self.w.next_completion(None)
            if c is None:
                continue
            f = self.waiting.pop(c.transfer_id, None)
            if f is not None and not f.done():
                f.set_result(c)

    def expect(self, tid: str) -> asyncio.Future[Completion]:
        f: asyncio.Future[Completion] = asyncio.get_running_loop().create_future()
        self.waiting[tid] = f
        return f


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
            if getattr(args, "calls", "stream") == "stream":
                out = _drive_stream(args, p.sock, d.sock, p.peer_address, src, dst, lay, pids)
            else:
                out = asyncio.run(_drive(args, p.sock, d.sock, p.peer_address, src, dst, lay, pids))
    finally:
        src.close()
        dst.close()
    return _result(args, out)


async def _drive(args: argparse.Namespace, psock: str, dsock: str, paddr: str, src: KVMemory, dst: KVMemory,
                 lay: Layout, pids: dict[str, int]) -> dict[str, Any]:
    pc, dc = AsyncKVPushClient(psock), AsyncKVPushClient(dsock)
    region = [Region(0, 0, lay.num_blocks, lay.block_len)]
    pw = await pc.attach("bench-prefill", Role.PRODUCER, 0, 1, [src.buf.memory], region,
                         description="kvpushd bench rate")
    dw = await dc.attach("bench-decode", Role.CONSUMER, 0, 1, [dst.buf.memory], region,
                         description="kvpushd bench rate")
    prouter, drouter = _Router(pw), _Router(dw)
    loop = asyncio.get_running_loop()
    t_start = loop.time() + args.warmup
    t_end = t_start + args.seconds
    ends: list[float] = []
    lat_ms: list[float] = []
    failed: list[str] = []
    tag = os.urandom(3).hex()
    cpu0: dict[str, float] = {}

    async def worker(k: int) -> None:
        i = 0
        while loop.time() < t_end:
            tid = f"rate-{tag}-{k}-{i}"
            i += 1
            fr, fs = drouter.expect(tid), prouter.expect(tid)
            t0 = loop.time()
            try:
                await asyncio.gather(dw.expect(tid, [k], paddr, "bench-prefill", 1), pw.publish(tid, [k]))
                cr, cs = await asyncio.wait_for(asyncio.gather(fr, fs), 60)
            except Exception as e:  # counted, reported
                failed.append(f"{tid}: {e}")
                continue
            t1 = loop.time()
            if cr.kind is not CompletionKind.FINISHED_RECEIVING or cs.kind is not CompletionKind.FINISHED_SENDING:
                failed.append(f"{tid}: {cr.kind.name} {cr.reason} / {cs.kind.name} {cs.reason}")
                continue
            if t_start <= t1 < t_end:
                ends.append(t1 - t_start)
                lat_ms.append((t1 - t0) * 1e3)

    async def sample_cpu() -> None:
        await asyncio.sleep(max(0.0, t_start - loop.time()))
        cpu0.update({name: cpu_seconds(pid) for name, pid in pids.items()})

    cpu_task = loop.create_task(sample_cpu())
    await asyncio.gather(*(worker(k) for k in range(args.concurrency)))
    await cpu_task
    cpu = {name: round((cpu_seconds(pid) - cpu0.get(name, 0.0)) / args.seconds, 2) for name, pid in pids.items()}
    prouter.task.cancel()
    drouter.task.cancel()
    await pw.detach()
    await dw.detach()
    await pc.close()
    await dc.close()
    return {"ends": ends, "latency_ms": lat_ms, "failed": failed, "cpu_cores": cpu}


def _drive_stream(args: argparse.Namespace, psock: str, dsock: str, paddr: str, src: KVMemory, dst: KVMemory,
                  lay: Layout, pids: dict[str, int]) -> dict[str, Any]:
    """An engine-like loop on one worker Stream per side: refill free slots, one step per side, completions."""
    pc, dc = KVPushClient(psock), KVPushClient(dsock)
    region = [Region(0, 0, lay.num_blocks, lay.block_len)]
    pw = pc.attach_stream("bench-prefill", Role.PRODUCER, 0, 1, [src.buf.memory], region,
                          description="kvpushd bench rate")
    dw = dc.attach_stream("bench-decode", Role.CONSUMER, 0, 1, [dst.buf.memory], region,
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
            dw.expect_nowait(tid, [k], paddr, "bench-prefill", 1)
            pw.publish_nowait(tid, [k])
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
    calls = getattr(args, "calls", "stream")
    data["calls"] = calls
    how = (f"one worker Stream per side, an engine-like loop keeping {args.concurrency} requests in flight (every "
           "step queues an Expect and a Publish per free slot and sends one message per side)" if calls == "stream"
           else f"{args.concurrency} asyncio tasks on AsyncKVPushClient, each issuing Expect and Publish together "
           "(one unary call each)")
    method = [
        f"{how}, for a 1-block, 1-region (4 KiB) request, waiting for both completions; "
        f"requests completed in the {args.seconds:g} s after a {args.warmup:g} s warm-up are counted.",
        "CPU cores busy: user+system CPU time of each process over the window / its length (from /proc).",
    ]
    return Result("rate", data, cols, rows, lines, method,
                  {"timeline": buckets, "bucket_s": BUCKET_S, "latency_ms": out["latency_ms"]})
