"""``critical-path``: what the daemons add at the two ends of a transfer, in microseconds.

(a) prefill done -> WRITE posted, and (b) last byte landed -> decode worker told. Both are taken on
one clock (CLOCK_MONOTONIC via ``time.monotonic_ns``, shared by every process on the machine) by
watching the decode worker's memory itself: a helper process maps the destination shared memory
and looks at sentinel bytes every ``--watch-sleep-us``, at real-time priority where allowed (the
first byte of the request's first block and the last byte of its last block, in every region),
which the source never holds as the poison value. So:

* (a) = first destination byte changed - just before ``Publish`` in the prefill worker. A WRITE
  on this machine's UCX transport is carried out inside ``transfer()`` (the call returns when the
  bytes are there), so the first byte landing is when the WRITE is in flight; (a) overstates
  "posted" by the time to move the first bytes, a few microseconds.
* (b) = ``FINISHED_RECEIVING`` returned to the decode worker - every region's last byte changed.

Both workers are on a WorkerService.Stream, as the vLLM connector and the reference engine run; the
Publish is ``send_nowait(Publish(...))`` + ``step()``.

Requests go one at a time, Expect first (in push mode decode registers long before prefill ends),
so nothing queues. The prefill daemon runs at log level debug, and its per-WRITE ``post_us`` (WRITE
request reaching its NIXL thread -> ``transfer()`` returned) is reported too.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import multiprocessing as mp
import os
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
from kvpushd_client import CompletionKind, Expect, Publish, Role

from .ceiling import _completion
from .common import (
    DEFAULT_POLL_US,
    POISON,
    BenchError,
    KVMemory,
    Layout,
    Result,
    daemon_pair,
    dist,
    met,
    progress,
    sched_ns,
    wait_registered,
)

TARGET_P99_US = 1000.0


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--samples", type=int, default=300, help="timed requests (default 300)")
    p.add_argument("--tokens", type=int, default=16,
                   help="tokens per request (default 16: one block in each of the 128 regions)")
    p.add_argument("--layers", type=int, default=64, help="layers (default 64: Qwen3-32B)")
    p.add_argument("--watch-sleep-us", type=float, default=50.0,
                   help="the landing watcher sleeps this long between looks (default 50; 0 spins a CPU)")
    p.add_argument("--poll-us", type=float, default=0.0,
                   help="both daemons' transfer.poll_interval_s in us (default 0: the daemons' default)")
    p.add_argument("--poll-max-us", type=float, default=0.0,
                   help="both daemons' transfer.poll_max_interval_s in us (default 0: the daemons' default)")
    p.add_argument("--poll-hot-s", type=float, default=-1.0,
                   help="both daemons' transfer.poll_hot_s (default -1: the daemons' default)")
    p.add_argument("--gap-ms", type=float, default=0.0,
                   help="wait this long between the registration reaching the prefill daemon and the Publish "
                        "(push mode's usual case: decode registers while prefill computes; default 0)")
    p.add_argument("--seed", type=int, default=0)


def _fine_timer_slack() -> None:
    """Short sleeps take what they ask (Linux adds 50 us of timer slack by default)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(29, 1, 0, 0, 0)  # PR_SET_TIMERSLACK, 1 ns


def _watch_main(shm_name: str, size: int, first: list[int], last: list[int], sleep_us: float,
                conn: Connection) -> None:
    """Watch the sentinel bytes; report when the first one and when all last ones changed."""
    from kvpushd_client import SealedBuffer

    _fine_timer_slack()
    realtime = False
    try:  # on a loaded machine a late watcher would move landings later: run before anything else
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
        realtime = True
    except (OSError, AttributeError):
        with contextlib.suppress(OSError):
            os.nice(-10)
    conn.send(("ready", realtime))
    nap = sleep_us * 1e-6
    buf = SealedBuffer.open(shm_name, size)
    arr = np.frombuffer(buf.mmap, dtype=np.uint8)
    f = np.asarray(first, dtype=np.int64)
    la = np.asarray(last, dtype=np.int64)
    while True:
        cmd = conn.recv()
        if cmd == "stop":
            break
        conn.send("armed")
        deadline = time.monotonic_ns() + 10_000_000_000
        t_first = t_last = 0
        while time.monotonic_ns() < deadline:
            if (arr[f] != POISON).any():
                t_first = time.monotonic_ns()
                break
            if nap:
                time.sleep(nap)
        while t_first and time.monotonic_ns() < deadline:
            if (arr[la] != POISON).all():
                t_last = time.monotonic_ns()
                break
            if nap:
                time.sleep(nap)
        conn.send((t_first, t_last))
    del arr
    buf.close()


def run(args: argparse.Namespace, workdir: Path) -> Result:
    if args.samples < 1:
        raise BenchError("--samples must be at least 1")
    n = Layout().blocks_for(args.tokens)
    lay = Layout(layers=args.layers, num_blocks=max(n, 8))
    src = KVMemory("kvpushd-bench-src", lay, seed=args.seed)
    dst = KVMemory("kvpushd-bench-dst", lay, fill=POISON)
    blocks = list(range(n))
    first = [r * lay.region_bytes for r in range(lay.regions)]
    last = [r * lay.region_bytes + n * lay.block_len - 1 for r in range(lay.regions)]
    ctx = mp.get_context("spawn")
    conn, theirs = ctx.Pipe()
    watcher = ctx.Process(target=_watch_main, daemon=True,
                          args=(dst.name, lay.total_bytes, first, last, args.watch_sleep_us, theirs))
    watcher.start()
    try:
        if not conn.poll(60):
            raise EOFError
        realtime = bool(conn.recv()[1])
    except (EOFError, OSError):
        watcher.kill()
        src.close()
        dst.close()
        raise BenchError("the landing watcher did not start") from None
    progress(f"critical-path: {args.samples} requests of {n} block(s) x {lay.regions} regions "
             f"({n * lay.regions * lay.block_len} B), one at a time, Expect first")
    a_us: list[float] = []
    b_us: list[float] = []
    rpc_us: list[float] = []
    wire_us: list[float] = []
    post_us: list[float] = []
    queue_us: list[float] = []
    xfer_us: list[float] = []
    try:
        poll = getattr(args, "poll_us", 0.0)
        transfer = {"poll_interval_s": poll * 1e-6} if poll > 0 else {}
        if getattr(args, "poll_hot_s", -1.0) >= 0:
            transfer["poll_hot_s"] = args.poll_hot_s
        if getattr(args, "poll_max_us", 0.0) > 0:
            transfer["poll_max_interval_s"] = args.poll_max_us * 1e-6
        with daemon_pair(workdir, prefill_log_level="debug", transfer=transfer) as (p, d):
            how = "kvpushd bench critical-path"
            pw = p.client.attach("bench-prefill", Role.PRODUCER, 0, 1, [src.buf.memory], lay.region_list(),
                                 description=how)
            dw = d.client.attach("bench-decode", Role.CONSUMER, 0, 1, [dst.buf.memory], lay.region_list(),
                                 description=how)
            # (not the bench process: reading /proc is its own CPU time, inside the window)
            pids = {"prefill daemon": p.proc.pid, "decode daemon": d.proc.pid}
            run_us = dict.fromkeys(pids, 0.0)
            wait_us = dict.fromkeys(pids, 0.0)
            warm = 10
            tids: list[str] = []
            for i in range(warm + args.samples):
                tid = f"cp-{i}-{os.urandom(3).hex()}"
                dw.send(Expect(tid, tuple(blocks), p.peer_address, "bench-prefill", 1))
                wait_registered(p, tid)
                if getattr(args, "gap_ms", 0.0) > 0:
                    time.sleep(args.gap_ms / 1e3)
                conn.send("arm")
                if conn.recv() != "armed":
                    raise BenchError("sentinel watcher failed")
                s0 = {k: sched_ns(pid) for k, pid in pids.items()}
                t_pub = time.monotonic_ns()
                pw.send_nowait(Publish(tid, tuple(blocks)))  # an engine step: append, then one flush (no wait)
                pw.step()
                t_rpc = time.monotonic_ns()
                _completion(dw, tid, CompletionKind.FINISHED_RECEIVING, 30)
                t_told = time.monotonic_ns()
                if not conn.poll(15):
                    raise BenchError("sentinel watcher did not answer")
                t_first, t_last = conn.recv()
                _completion(pw, tid, CompletionKind.FINISHED_SENDING, 30)
                s1 = {k: sched_ns(pid) for k, pid in pids.items()}
                if not (t_first and t_last):
                    raise BenchError(f"{tid}: the destination bytes did not change")
                dst.arr[:, :n, :] = POISON
                if i < warm:
                    continue
                tids.append(tid)
                for k in pids:
                    run_us[k] += (s1[k][0] - s0[k][0]) / 1e3
                    wait_us[k] += (s1[k][1] - s0[k][1]) / 1e3
                a_us.append((t_first - t_pub) / 1e3)
                b_us.append((t_told - t_last) / 1e3)
                rpc_us.append((t_rpc - t_pub) / 1e3)
                wire_us.append((t_last - t_first) / 1e3)
                if (i - warm + 1) % 100 == 0:
                    progress(f"  {i - warm + 1}/{args.samples}")
            pw.detach()
            dw.detach()
            mine = set(tids)
            for rec in p.log_records("write done"):
                if rec.get("transfer_id") in mine:
                    post_us.append(float(rec["post_us"]))
                    queue_us.append(float(rec.get("queue_us", 0.0)))
                    xfer_us.append(float(rec["xfer_us"]))
    finally:
        with contextlib.suppress(OSError):
            conn.send("stop")
        watcher.join(10)
        if watcher.is_alive():
            watcher.kill()
        src.close()
        dst.close()
    sched = {k: {"cpu_us": round(run_us[k] / max(1, len(a_us)), 1),
                 "runqueue_wait_us": round(wait_us[k] / max(1, len(a_us)), 1)} for k in run_us}
    return _result(args, lay, n, a_us, b_us, rpc_us, wire_us, post_us, queue_us, xfer_us, sched, realtime)


def _result(args: argparse.Namespace, lay: Layout, n: int, a_us: list[float], b_us: list[float],
            rpc_us: list[float], wire_us: list[float], post_us: list[float], queue_us: list[float],
            xfer_us: list[float], sched: dict[str, dict[str, float]], realtime: bool) -> Result:
    a, b = dist(a_us), dist(b_us)
    data: dict[str, Any] = {
        "prefill_done_to_posted_us": a, "landed_to_told_us": b,
        "publish_rpc_us": dist(rpc_us), "first_to_last_byte_us": dist(wire_us),
        "daemon_post_us": dist(post_us), "daemon_queue_us": dist(queue_us), "daemon_xfer_us": dist(xfer_us),
        "target_p99_us": TARGET_P99_US,
        "target_met": {"prefill_done_to_posted": a["p99"] <= TARGET_P99_US,
                       "landed_to_told": b["p99"] <= TARGET_P99_US},
        "poll_interval_us": getattr(args, "poll_us", 0.0) or DEFAULT_POLL_US,
        "gap_ms": getattr(args, "gap_ms", 0.0), "poll_max_interval_us": getattr(args, "poll_max_us", 0.0) or 1000.0,
        "poll_hot_s": getattr(args, "poll_hot_s", -1.0),
        "samples": len(a_us), "blocks_per_region": n, "regions": lay.regions,
        "bytes_per_request": n * lay.regions * lay.block_len, "layout": lay.describe(),
        "per_request_sched_us": sched, "watcher_realtime": realtime,
        # the worker was told before the watcher saw the last byte: the watcher ran late
        "watcher_late_samples": sum(1 for x in b_us if x < 0),
    }
    rows = [
        {"figure": "(a) prefill done -> WRITE posted", **a, "target": f"p99 <= {TARGET_P99_US:.0f}: "
         f"{met(a['p99'], TARGET_P99_US, False)}"},
        {"figure": "(b) last byte landed -> decode told", **b, "target": f"p99 <= {TARGET_P99_US:.0f}: "
         f"{met(b['p99'], TARGET_P99_US, False)}"},
        {"figure": "Publish (engine's view: send_nowait(Publish) + step)", **dist(rpc_us), "target": ""},
        {"figure": "daemon post_us (queued -> posted)", **dist(post_us), "target": ""},
        {"figure": "  of which queue_us (queued -> NIXL thread took it)", **dist(queue_us), "target": ""},
        {"figure": "first -> last byte landed", **dist(wire_us), "target": ""},
    ]
    cols = [("figure", "figure (us)", "<"), ("p50", "p50", ".0f"), ("p99", "p99", ".0f"), ("mean", "mean", ".0f"),
            ("max", "max", ".0f"), ("n", "n", "d"), ("target", "target", "<")]
    lines = [f"(a) prefill done -> WRITE posted: p50 {a['p50']:.0f} us, p99 {a['p99']:.0f} us  "
             f"target p99 <= {TARGET_P99_US:.0f} us: {met(a['p99'], TARGET_P99_US, False)}",
             f"(b) last byte landed -> decode worker told: p50 {b['p50']:.0f} us, p99 {b['p99']:.0f} us  "
             f"target p99 <= {TARGET_P99_US:.0f} us: {met(b['p99'], TARGET_P99_US, False)}",
             "per request, from Publish to both completions: " + "; ".join(
                 f"{k} ran {v['cpu_us']:.0f} us, waited {v['runqueue_wait_us']:.0f} us for a CPU"
                 for k, v in sched.items())]
    method = [
        f"{len(a_us)} requests one at a time, {n} block(s) in each of {lay.regions} regions "
        f"({n * lay.regions * lay.block_len} B), Expect first and registered at the prefill daemon before Publish.",
        "one clock for all processes (time.monotonic_ns = CLOCK_MONOTONIC); a helper process maps the decode "
        "worker's shared memory and watches sentinel bytes (first byte of the first block and last byte of the "
        "last block of every region; the source never holds the poison value there).",
        "(a) = first sentinel changed - just before Publish in the prefill worker: the WRITE is in flight. On "
        "this machine's UCX transport the copy runs inside transfer(), so 'posted' (transfer() returned) would "
        "include the whole copy; (a) includes the Publish (a message on the worker's Stream), the daemon's "
        "event loop, its NIXL thread queue (daemon queue_us), index arrays and make_prepped_xfer, plus the first "
        "bytes' wire time.",
        "(b) = FINISHED_RECEIVING returned to the decode worker (next_completion) - all last sentinels changed: "
        "notification delivery, the decode daemon's NIXL poll (every transfer.poll_interval_s = "
        f"{getattr(args, 'poll_us', 0.0) or DEFAULT_POLL_US:g} us), its event loop, then the session stream and the "
        "client's reader thread.",
        "daemon post_us: the prefill daemon's own debug log per WRITE (request reaching its NIXL thread -> "
        "transfer() returned, so it includes the copy on this transport).",
        f"the watcher looks every {args.watch_sleep_us:g} us (timer slack 1 ns) while armed, "
        f"{'at real-time priority (SCHED_FIFO)' if realtime else 'at normal priority (no SCHED_FIFO here)'}, so "
        "landing times are late by up to that much plus a wake-up: (a) is overstated and (b) understated by that "
        f"amount; {sum(1 for x in b_us if x < 0)} samples had (b) < 0 (the watcher ran late).",
        "ran / waited for a CPU: /proc/PID/task/*/schedstat summed over each process's threads, per request: "
        "run-queue wait is what the machine's load added.",
    ]
    samples = {"publish_to_landed_us": a_us, "landed_to_told_us": b_us, "daemon_post_us": post_us}
    return Result("critical-path", data, cols, rows, lines, method, samples)
