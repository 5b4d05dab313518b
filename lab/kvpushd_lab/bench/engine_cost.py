"""``engine-cost``: time the engine's own thread spends on KV transfers per step.

kvpushd: per step a decode engine sends one Expect per new request and reads completions, a
prefill engine sends one Publish per finished request and reads completions (``completions()``:
no RPC, what the worker stream delivered). Both are timed in the calling thread with
``time.perf_counter_ns`` around exactly those calls. Clients (``--calls``, several in one run, rounds
alternating): ``stream`` (``*_nowait`` append, ``step()`` hands the step's batch to the stream's
sender, one CommandBatch per step), ``blocking`` (the call-and-wait forms: one round trip on the
stream each, on the engine thread). Every 8th
step times each call on its own and is left out of the step figures (the timers would add to them).
The CPU the client's other threads take per step: the process's CPU time minus the engine thread's
over the client's rounds (gRPC's threads included), and for the stream the sender's and reader's own
``time.thread_time_ns``.

In-engine baseline (what vLLM's NIXL connectors do): a NIXL agent in the engine process with
prepared descriptor lists; per request the engine builds the index arrays, calls
``make_prepped_xfer`` and ``transfer``, and per step polls every WRITE in flight with
``check_xfer_state``. The destination agent lives in a helper process that reads notifications
every 200 us.

Steps run at a fixed period (``--step-ms``), alternating rounds of kvpushd steps and baseline
steps so that the machine's load hits both alike.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
from kvpushd_client import Completion, CompletionKind, Expect, Publish, Role, StreamWorker

from .common import POISON, BenchError, DaemonProc, KVMemory, Layout, Result, daemon_pair, dist, met, progress

TARGET_P99_US = 50.0
IN_FLIGHT_STEPS = 8  # a request's blocks are reused this many steps later
SAMPLE_EVERY = 8  # every 8th step times each call alone (and is not in the step figures)
CLIENTS = ("stream", "blocking")
STEP_KEYS = ("prefill_step_us", "decode_step_us", "publish_us", "expect_us", "completions_us",
             "prefill_cpu_us", "decode_cpu_us", "client_threads_cpu_us", "sender_cpu_us", "reader_cpu_us")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=int, default=8, help="requests per engine step (default 8)")
    p.add_argument("--steps", type=int, default=400, help="timed steps per side (default 400)")
    p.add_argument("--step-ms", type=float, default=20.0, help="engine step period (default 20 ms)")
    p.add_argument("--tokens", type=int, default=16,
                   help="tokens per request (default 16: 1 block x 128 regions = 128 descriptors, 512 KiB; "
                        "the copies compete with the engine for this machine's CPUs, so keep them small)")
    p.add_argument("--rounds", type=int, default=4, help="alternations of kvpushd and baseline steps (default 4)")
    p.add_argument("--layers", type=int, default=64, help="layers (default 64: Qwen3-32B)")
    p.add_argument("--calls", default="stream",
                   help="clients, comma-separated, alternating in each round (default stream): stream "
                        "(*_nowait append, step() once per step: one CommandBatch); blocking "
                        "(expect/publish: one round trip on the stream each, on the engine thread)")
    p.add_argument("--pin", action="store_true",
                   help="this process (the engine thread and the client's threads) on CPU 0, both daemons and "
                        "the baseline's NIXL target process on the other CPUs: the engine with a core of its "
                        "own, as on a GPU node, so the step times show the client's cost without the "
                        "daemons' copies competing for the same core")


class _Tally:
    def __init__(self) -> None:
        self.done: dict[str, int] = {}
        self.failed: list[Completion] = []

    def add(self, cs: list[Completion]) -> None:
        for c in cs:
            if c.kind is CompletionKind.FAILED:
                self.failed.append(c)
            self.done[c.transfer_id] = self.done.get(c.transfer_id, 0) + 1


def _pin(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` (threads it starts later inherit it; one that just ended is skipped)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(tid), cpus)


def _sleep_until(t_ns: int) -> None:
    d = t_ns - time.perf_counter_ns()
    if d > 0:
        time.sleep(d / 1e9)


def run(args: argparse.Namespace, workdir: Path) -> Result:
    if args.batch < 1 or args.steps < 1 or args.rounds < 1:
        raise BenchError("--batch, --steps and --rounds must be at least 1")
    modes = [m.strip() for m in str(args.calls).split(",") if m.strip()]
    if not modes or any(m not in CLIENTS for m in modes) or len(set(modes)) != len(modes):
        raise BenchError(f"--calls: one or more of {', '.join(CLIENTS)}, each once; got {args.calls!r}")
    n = Layout().blocks_for(args.tokens)
    slots = args.batch * IN_FLIGHT_STEPS
    lay = Layout(layers=args.layers, num_blocks=n * slots)
    progress(f"engine-cost: batch {args.batch}, {args.steps} steps per side every {args.step_ms:g} ms, requests "
             f"of {n} blocks x {lay.regions} regions ({n * lay.regions * lay.block_len / 2**20:.1f} MiB); "
             f"memory {lay.total_bytes / 2**20:.0f} MiB per side")
    from .rawnixl import Initiator, Target, preload

    preload()

    src = KVMemory("kvpushd-bench-src", lay)
    dst = KVMemory("kvpushd-bench-dst", lay, fill=POISON)
    target: Target | None = None
    init: Initiator | None = None
    s: dict[str, list[float]] = {k: [] for k in (
        "inengine_cpu_us",
        "inengine_step_us", "inengine_prep_us", "inengine_post_us", "inengine_poll_us", "inengine_nopost_us")}
    for m in modes:
        s.update({f"{m}/{k}": [] for k in STEP_KEYS})
    counts = {"kvpushd_requests": 0, "kvpushd_failed": 0, "inengine_requests": 0}
    try:
        target = Target(dst, 0.0002)
        with daemon_pair(workdir) as (p, d):
            init = Initiator(src, target)  # the target process started meanwhile
            if getattr(args, "pin", False):
                cpus = sorted(os.sched_getaffinity(0))
                if len(cpus) < 2:
                    raise BenchError("--pin needs at least 2 CPUs")
                for pid in (p.proc.pid, d.proc.pid, target.pid):
                    _pin(pid, set(cpus[1:]))
                _pin(os.getpid(), {cpus[0]})
                progress(f"  pinned: this process to CPU {cpus[0]}, the daemons and the NIXL target to {cpus[1:]}")
            pairs: dict[str, tuple[StreamWorker, StreamWorker]] = {}
            for m in modes:  # one prefill and one decode worker per client, on the same memory
                pw = p.client.attach(f"bench-prefill-{m}", Role.PRODUCER, 0, 1, [src.buf.memory], lay.region_list(),
                                     description="kvpushd bench engine-cost")
                dw = d.client.attach(f"bench-decode-{m}", Role.CONSUMER, 0, 1, [dst.buf.memory], lay.region_list(),
                                     description="kvpushd bench engine-cost")
                pairs[m] = (pw, dw)
            per_round = max(1, args.steps // args.rounds)
            seq = 0
            for rnd in range(args.rounds):
                steps = per_round if rnd < args.rounds - 1 else args.steps - per_round * (args.rounds - 1)
                if steps <= 0:
                    continue
                for m in modes:
                    seq = _kvpushd_steps(args, m, p, *pairs[m], n, slots, steps, seq, s, counts, warm=rnd == 0)
                target.busy(True)  # like a decode daemon while it expects WRITEs
                _inengine_steps(args, init, n, slots, steps, s, counts, warm=rnd == 0)
                target.busy(False)
                progress(f"  round {rnd + 1}/{args.rounds}: " + ", ".join(
                    f"{m} step p99 {max(_p99(s[f'{m}/prefill_step_us']), _p99(s[f'{m}/decode_step_us'])):.0f} us"
                    for m in modes) + f", in-engine step p99 {_p99(s['inengine_step_us']):.0f} us")
            for pw, dw in pairs.values():
                pw.detach()
                dw.detach()
    finally:
        if init is not None:
            init.close()
        if target is not None:
            target.close()
        src.close()
        dst.close()
    return _result(args, modes, lay, n, s, counts)


def _thread_cpu(*ws: StreamWorker) -> tuple[int, int]:
    """CPU ns so far of the stream workers' sender and reader threads."""
    return sum(w.sender_cpu_ns for w in ws), sum(w.reader_cpu_ns for w in ws)


def _p99(values: list[float]) -> float:
    return float(np.percentile(values, 99)) if values else 0.0


def _kvpushd_steps(args: argparse.Namespace, mode: str, p: DaemonProc, pw: StreamWorker,
                   dw: StreamWorker, n: int, slots: int, steps: int, seq: int, s: dict[str, list[float]],
                   counts: dict[str, int], warm: bool) -> int:
    tally = _Tally()
    tag = os.urandom(3).hex()
    queued = mode != "blocking"
    prod = f"bench-prefill-{mode}"
    k = f"{mode}/"
    period = int(args.step_ms * 1e6)
    prev: list[tuple[str, list[int]]] = []
    warm_steps = 5 if warm else 0
    issued = 0
    cpu0 = time.process_time_ns() - time.thread_time_ns()  # every thread of this process but this one
    threads0 = _thread_cpu(pw, dw)
    t_next = time.perf_counter_ns()
    for step in range(warm_steps + steps + 1):
        _sleep_until(t_next)
        t_next += period
        last = step == warm_steps + steps
        batch = [] if last else [(f"ec-{tag}-{seq + i}", list(range(((seq + i) % slots) * n,
                                                                     ((seq + i) % slots + 1) * n)))
                                 for i in range(args.batch)]
        seq += len(batch)
        timed = step >= warm_steps
        sample = timed and step % SAMPLE_EVERY == SAMPLE_EVERY - 1  # time each call, not the step
        # The decode engine's step: an Expect per newly scheduled request, then read completions.
        c0 = time.thread_time_ns()
        t0 = time.perf_counter_ns()
        for tid, blocks in batch:
            if sample:
                t = time.perf_counter_ns()
            if queued:
                dw.send_nowait(Expect(tid, tuple(blocks), p.peer_address, prod, 1))
            else:
                dw.send(Expect(tid, tuple(blocks), p.peer_address, prod, 1))
            if sample:
                s[k + "expect_us"].append((time.perf_counter_ns() - t) / 1e3)
        if queued:
            dw.step()
        dc = dw.completions()
        t1 = time.perf_counter_ns()
        c1 = time.thread_time_ns()
        # The prefill engine's step: a Publish per request whose prefill finished, then read completions.
        for tid, blocks in prev:
            if sample:
                t = time.perf_counter_ns()
            if queued:
                pw.send_nowait(Publish(tid, tuple(blocks)))
            else:
                pw.send(Publish(tid, tuple(blocks)))
            if sample:
                s[k + "publish_us"].append((time.perf_counter_ns() - t) / 1e3)
        if queued:
            pw.step()
        t2 = time.perf_counter_ns()
        pc = pw.completions()
        t3 = time.perf_counter_ns()
        c3 = time.thread_time_ns()
        tally.add(dc)
        tally.add(pc)
        issued += len(prev)
        if timed and batch and not sample:
            s[k + "decode_step_us"].append((t1 - t0) / 1e3)
            s[k + "decode_cpu_us"].append((c1 - c0) / 1e3)
            s[k + "completions_us"].append((t3 - t2) / 1e3)
        if timed and prev and not sample:
            s[k + "prefill_step_us"].append((t3 - t1) / 1e3)
            s[k + "prefill_cpu_us"].append((c3 - c1) / 1e3)
        prev = batch
    n_steps = warm_steps + steps + 1
    s[k + "client_threads_cpu_us"].append((time.process_time_ns() - time.thread_time_ns() - cpu0) / 1e3 / n_steps)
    if queued:
        threads1 = _thread_cpu(pw, dw)
        s[k + "sender_cpu_us"].append((threads1[0] - threads0[0]) / 1e3 / n_steps)
        s[k + "reader_cpu_us"].append((threads1[1] - threads0[1]) / 1e3 / n_steps)
    deadline = time.monotonic() + 120
    while sum(tally.done.values()) < 2 * issued and time.monotonic() < deadline:
        time.sleep(0.01)
        tally.add(dw.completions())
        tally.add(pw.completions())
    missing = 2 * issued - sum(tally.done.values())
    if missing > 0 or tally.failed:
        why = tally.failed[0].reason if tally.failed else ""
        raise BenchError(f"kvpushd: {len(tally.failed)} transfers failed, {max(missing, 0)} completions "
                         f"missing {why}")
    counts["kvpushd_requests"] += issued
    return seq


def _inengine_steps(args: argparse.Namespace, init: Any, n: int, slots: int, steps: int,
                    s: dict[str, list[float]], counts: dict[str, int], warm: bool) -> None:
    period = int(args.step_ms * 1e6)
    inflight: list[Any] = []
    warm_steps = 5 if warm else 0
    seq = 0
    tag = os.urandom(3).hex()
    t_next = time.perf_counter_ns()
    for step in range(warm_steps + steps):
        _sleep_until(t_next)
        t_next += period
        reqs = [list(range(((seq + i) % slots) * n, ((seq + i) % slots + 1) * n)) for i in range(args.batch)]
        prep = post = 0
        c0 = time.thread_time_ns()
        t0 = time.perf_counter_ns()
        for i, blocks in enumerate(reqs):
            ta = time.perf_counter_ns()
            b = np.asarray(blocks, dtype=np.int64)
            lidx, ridx = init.block_indices(b, b)
            h = init.agent.make_prepped_xfer("WRITE", init.local_blocks, lidx, init.remote_blocks, ridx,
                                             f"ie-{tag}-{seq + i}".encode())
            tb = time.perf_counter_ns()
            state = init.agent.transfer(h)
            tc = time.perf_counter_ns()
            if state == "ERR":
                raise BenchError("in-engine baseline: NIXL returned ERR posting a WRITE")
            inflight.append(h)
            prep += tb - ta
            post += tc - tb
        t1 = time.perf_counter_ns()
        keep = []
        for h in inflight:
            st = init.agent.check_xfer_state(h)
            if st == "PROC":
                keep.append(h)
            elif st == "DONE":
                h.release()
            else:
                raise BenchError("in-engine baseline: a WRITE ended in error")
        inflight = keep
        t2 = time.perf_counter_ns()
        c2 = time.thread_time_ns()
        seq += len(reqs)
        if step >= warm_steps:
            s["inengine_step_us"].append((t2 - t0) / 1e3)
            s["inengine_cpu_us"].append((c2 - c0) / 1e3)
            s["inengine_prep_us"].append(prep / 1e3)
            s["inengine_post_us"].append(post / 1e3)
            s["inengine_poll_us"].append((t2 - t1) / 1e3)
            s["inengine_nopost_us"].append((t2 - t0 - post) / 1e3)
            counts["inengine_requests"] += len(reqs)
    deadline = time.monotonic() + 120
    while inflight and time.monotonic() < deadline:
        time.sleep(0.001)
        keep = []
        for h in inflight:
            if init.agent.check_xfer_state(h) == "PROC":
                keep.append(h)
            else:
                h.release()
        inflight = keep


def _client(s: dict[str, list[float]], m: str) -> dict[str, Any]:
    k = f"{m}/"
    return {"prefill_step_us": dist(s[k + "prefill_step_us"]), "decode_step_us": dist(s[k + "decode_step_us"]),
            "prefill_step_cpu_us": dist(s[k + "prefill_cpu_us"]), "decode_step_cpu_us": dist(s[k + "decode_cpu_us"]),
            "publish_call_us": dist(s[k + "publish_us"]), "expect_call_us": dist(s[k + "expect_us"]),
            "completions_us": dist(s[k + "completions_us"], 2),
            # per step (one prefill and one decode step), mean over each round
            "client_threads_cpu_us_per_step": dist(s[k + "client_threads_cpu_us"]),
            **({"stream_sender_cpu_us_per_step": dist(s[k + "sender_cpu_us"]),
                "stream_reader_cpu_us_per_step": dist(s[k + "reader_cpu_us"])} if m == "stream" else {})}


def _result(args: argparse.Namespace, modes: list[str], lay: Layout, n: int, s: dict[str, list[float]],
            counts: dict[str, int]) -> Result:
    clients = {m: _client(s, m) for m in modes}
    ie = dist(s["inengine_step_us"])
    worst = {m: max(c["prefill_step_us"]["p99"], c["decode_step_us"]["p99"]) for m, c in clients.items()}
    first = modes[0]
    data: dict[str, Any] = {
        "kvpushd": clients[first], "clients": clients,
        "in_engine": {"step_us": ie, "step_cpu_us": dist(s["inengine_cpu_us"]), "prep_us": dist(s["inengine_prep_us"]),
                      "transfer_us": dist(s["inengine_post_us"]), "poll_us": dist(s["inengine_poll_us"]),
                      "step_without_transfer_us": dist(s["inengine_nopost_us"])},
        "calls": ",".join(modes), "engine_step_us_p99": worst[first],
        "engine_step_us_p99_by_client": worst, "target_p99_us": TARGET_P99_US,
        "target_met": worst[first] <= TARGET_P99_US,
        "batch": args.batch, "pinned": bool(getattr(args, "pin", False)),
        "steps": clients[first]["prefill_step_us"]["n"],
        "step_ms": args.step_ms, "sample_every": SAMPLE_EVERY,
        "blocks_per_request": n, "descriptors_per_request": n * lay.regions,
        "bytes_per_request": n * lay.regions * lay.block_len, **counts,
    }
    rows = []
    for m, c in clients.items():
        rows += [
            {"what": f"kvpushd {m}: prefill engine: Publish x B{' + step()' if m == 'stream' else ''} "
                     "+ completions()", **c["prefill_step_us"]},
            {"what": "  its CPU time (thread_time)", **c["prefill_step_cpu_us"]},
            {"what": f"kvpushd {m}: decode engine: Expect x B{' + step()' if m == 'stream' else ''} "
                     "+ completions()", **c["decode_step_us"]},
            {"what": "  its CPU time (thread_time)", **c["decode_step_cpu_us"]},
            {"what": "  one Publish call", **c["publish_call_us"]},
            {"what": "  one Expect call", **c["expect_call_us"]},
            {"what": "  completions() read", **c["completions_us"]},
            {"what": "  client's other threads, CPU per step (mean per round)", **c["client_threads_cpu_us_per_step"]},
        ]
        if m == "stream":
            rows += [{"what": "    of which the stream's sender thread", **c["stream_sender_cpu_us_per_step"]},
                     {"what": "    and its reader thread", **c["stream_reader_cpu_us_per_step"]}]
    rows += [
        {"what": "NIXL in the engine: prep + transfer() + poll", **ie},
        {"what": "  its CPU time (thread_time)", **dist(s["inengine_cpu_us"])},
        {"what": "  index arrays + make_prepped_xfer, x B", **dist(s["inengine_prep_us"])},
        {"what": "  transfer(), x B (copies here)", **dist(s["inengine_post_us"])},
        {"what": "  check_xfer_state on all in flight", **dist(s["inengine_poll_us"])},
        {"what": "  step without transfer()", **dist(s["inengine_nopost_us"])},
    ]
    cols = [("what", f"per step, batch of {args.batch} (us)", "<"), ("p50", "p50", ".1f"), ("p99", "p99", ".1f"),
            ("mean", "mean", ".1f"), ("max", "max", ".0f"), ("n", "n", "d")]
    lines = [f"kvpushd {m}: engine-thread transfer work per step p99: prefill {c['prefill_step_us']['p99']:.0f} us, "
             f"decode {c['decode_step_us']['p99']:.0f} us  target <= {TARGET_P99_US:.0f} us: "
             f"{met(worst[m], TARGET_P99_US, False)}; client threads {c['client_threads_cpu_us_per_step']['p50']:.0f} "
             "us CPU per step" for m, c in clients.items()]
    lines.append(f"in-engine NIXL per step p99: {ie['p99']:.0f} us (without transfer(): "
                 f"{dist(s['inengine_nopost_us'])['p99']:.0f} us)")
    method = [
        f"batch of {args.batch} requests per step, one step every {args.step_ms:g} ms, {n} blocks x {lay.regions} "
        f"regions per request ({n * lay.regions} descriptors before merging, {n * lay.regions * lay.block_len} B).",
        "kvpushd: perf_counter_ns around the engine thread's calls only: Expect per request (+ step() on the "
        "stream) + completions() (decode), Publish per request (+ step()) + completions() (prefill); publishes "
        "are for the previous step's requests, whose Expects have reached the daemons. Transfers run in the "
        f"daemons meanwhile. Every {SAMPLE_EVERY}th step times each call alone instead and is left out of the "
        "step figures. Clients: " + "; ".join({
            "stream": "stream: *_nowait append to the step's batch, step() hands it to the stream's sender "
                      "thread (one CommandBatch per step)",
            "blocking": "blocking: one round trip on the stream each, on the engine thread"}[m] for m in modes) + ".",
        "client's other threads: process CPU time minus the engine thread's over each client round, per step "
        "(one prefill and one decode step), gRPC's own threads included; for the stream also the sender's and "
        "reader's own thread_time.",
        "in-engine: a NIXL agent in this process with prepared lists (as vLLM's NixlConnector): index arrays + "
        "make_prepped_xfer + transfer() per request, check_xfer_state on every WRITE in flight per step; no NIXL "
        "progress thread (it would spin a core). On this machine's UCX transport transfer() copies the bytes "
        "before returning, so its time is the copy; with RDMA or NVLink it returns at once: compare kvpushd "
        "with 'step without transfer()' too.",
        f"rounds of each client's steps and baseline steps alternate ({args.rounds} rounds) so load drift hits all.",
        "CPU time: time.thread_time_ns of the engine thread over the same calls; wall minus CPU is waiting: for "
        "the daemon's answer, or for a CPU on a loaded machine.",
    ]
    return Result("engine-cost", data, cols, rows, lines, method, s)
