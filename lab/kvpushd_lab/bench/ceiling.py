"""``ceiling``: how close a request through the daemons comes to raw NIXL moving the same bytes.

Per request size, three timings, interleaved rep by rep (so drifting machine load hits all alike):

* ceiling: raw NIXL, one WRITE of the same bytes as one descriptor per region (128 descriptors for
  the Qwen3-32B rank layout), from an agent in this process to a target agent in a helper process;
  from ``make_prepped_xfer`` to the notification seen by the target;
* raw_blocks: raw NIXL with exactly the descriptors the daemon posts (one per region and block,
  prepared once, index arrays per request, NIXL merging adjacent ones), same start and end;
* daemon: two real daemons and two workers; the decode worker's Expect has reached the prefill
  daemon, then the prefill worker's Publish; from just before Publish to FINISHED_RECEIVING read by
  the decode worker from its stream.

The target process reads notifications every ``--poll-us``, and the daemons run with
``transfer.poll_interval_s`` set to the same (default: the daemon's default, 100 us), so the
baselines get the same progress policy as the decode daemon.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from kvpushd_client import CompletionKind, Expect, Publish, Role, StreamWorker

from ..backend import BACKENDS, available
from .common import (
    DEFAULT_POLL_US,
    POISON,
    BenchError,
    DaemonProc,
    KVMemory,
    Layout,
    Result,
    daemon_pair,
    median,
    met,
    progress,
    wait_registered,
)

TARGET_EFFICIENCY = 0.9
IntArray = npt.NDArray[np.int64]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384],
                   help="request sizes in tokens (default 1024 4096 16384)")
    p.add_argument("--fragmented", action="store_true",
                   help="blocks in random order on both sides (nothing to merge) instead of contiguous runs")
    p.add_argument("--repeat", type=int, default=5, help="timed repetitions per size and kind (default 5)")
    p.add_argument("--layers", type=int, default=64, help="layers (default 64: Qwen3-32B)")
    p.add_argument("--poll-us", type=float, default=DEFAULT_POLL_US,
                   help="the daemons' transfer.poll_interval_s and how often the raw target reads notifications, "
                        f"in us (default {DEFAULT_POLL_US:g}: the daemon's default)")
    p.add_argument("--backend", choices=BACKENDS, default="UCX",
                   help="NIXL backend of the daemons and of the raw agents (default UCX); LIBFABRIC needs "
                        "scripts/libfabric.sh's build and runs libfabric's tcp provider here")
    p.add_argument("--seed", type=int, default=0)


def _blocks(n: int, pool: int, fragmented: bool, rng: np.random.Generator) -> tuple[IntArray, IntArray]:
    if not fragmented:
        b = np.arange(n, dtype=np.int64)
        return b, b.copy()
    return (rng.permutation(pool)[:n].astype(np.int64), rng.permutation(pool)[:n].astype(np.int64))


def _completion(w: StreamWorker, tid: str, kind: CompletionKind, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        c = w.next_completion(max(0.0, deadline - time.monotonic()))
        if c is None:
            break
        if c.transfer_id != tid:
            continue
        if c.kind is not kind:
            raise BenchError(f"transfer {tid}: {c.kind.name} {c.code} {c.reason}")
        return
    raise BenchError(f"transfer {tid}: no {kind.name} within {timeout_s:g} s")


def _daemon_once(p: DaemonProc, pw: StreamWorker, dw: StreamWorker, tid: str, src: IntArray,
                 dst: IntArray) -> tuple[int, int, int]:
    """One request through the daemons: (ns from Publish to FINISHED_RECEIVING, descs requested, posted)."""
    dw.send(Expect(tid, tuple(dst.tolist()), p.peer_address, "bench-prefill", 1))
    wait_registered(p, tid)
    c0 = p.client.status().counters
    src_l = src.tolist()
    t0 = time.monotonic_ns()
    pw.send(Publish(tid, tuple(src_l)))
    _completion(dw, tid, CompletionKind.FINISHED_RECEIVING)
    t1 = time.monotonic_ns()
    _completion(pw, tid, CompletionKind.FINISHED_SENDING)
    c1 = p.client.status().counters
    return (t1 - t0, c1.descriptors_requested - c0.descriptors_requested,
            c1.descriptors_posted - c0.descriptors_posted)


def _declared_once(p: DaemonProc, pw: StreamWorker, dw: StreamWorker, tid: str, src: IntArray, dst: IntArray,
                   layers: int) -> int:
    """Progressive push's critical path: the publish declared for a doorbell step before the KV is
    there (as an engine declares it before its forward), then ns from the doorbell's seal (the last
    layer written: one store) to FINISHED_RECEIVING read by the decode worker."""
    bell = pw.doorbell
    assert bell is not None
    dw.send(Expect(tid, tuple(dst.tolist()), p.peer_address, "bench-prefill", 1))
    wait_registered(p, tid)
    pw.send(Publish(tid, tuple(src.tolist()), step=bell.step(), layers=layers))
    time.sleep(0.002)  # the forward's first layers: the daemon has staged the leg and watches the bell
    t0 = time.monotonic_ns()
    bell.seal()
    _completion(dw, tid, CompletionKind.FINISHED_RECEIVING)
    t1 = time.monotonic_ns()
    _completion(pw, tid, CompletionKind.FINISHED_SENDING)
    return t1 - t0


def run(args: argparse.Namespace, workdir: Path) -> Result:
    sizes = sorted(set(args.tokens))
    if not sizes or min(sizes) < 1 or args.repeat < 1:
        raise BenchError("--tokens must be positive and --repeat at least 1")
    if why := available(args.backend):
        raise BenchError(f"--backend {args.backend}: {why}")
    base = Layout(layers=args.layers)
    pool = base.blocks_for(max(sizes))
    lay = Layout(layers=args.layers, num_blocks=pool)
    rng = np.random.default_rng(args.seed)
    progress(f"ceiling: {lay.regions} regions x {pool} blocks of {lay.block_len} B "
             f"({lay.total_bytes / 2**20:.0f} MiB per side), sizes {sizes} tokens, "
             f"{'fragmented' if args.fragmented else 'contiguous'} blocks, {args.repeat} reps, NIXL {args.backend}")
    from .rawnixl import Initiator, Target, preload

    preload()

    src = KVMemory("kvpushd-bench-src", lay, seed=args.seed)
    dst = KVMemory("kvpushd-bench-dst", lay, fill=POISON)
    target: Target | None = None
    init: Initiator | None = None
    rows: list[dict[str, Any]] = []
    try:
        target = Target(dst, args.poll_us * 1e-6, backend=args.backend)
        # debug: the prefill daemon logs post_us and xfer_us per WRITE
        with daemon_pair(workdir, prefill_log_level="debug",
                         transfer={"poll_interval_s": args.poll_us * 1e-6}, backend=args.backend) as (p, d):
            init = Initiator(src, target)  # the target process started meanwhile
            pw = p.client.attach("bench-prefill", Role.PRODUCER, 0, 1, [src.buf.memory], lay.region_list(),
                                 description="kvpushd bench ceiling", doorbell=True)
            dw = d.client.attach("bench-decode", Role.CONSUMER, 0, 1, [dst.buf.memory], lay.region_list(),
                                 description="kvpushd bench ceiling")
            # Warm-up: connections, the remote descriptor list the prefill daemon prepares on first use.
            one = np.array([0], dtype=np.int64)
            _daemon_once(p, pw, dw, f"warm-{os.urandom(4).hex()}", one, one)
            li, ri = init.block_indices(one, one)
            init.write(init.local_blocks, li, init.remote_blocks, ri, b"warm-blocks")
            wl, wr = init.region_lists(1)
            idx = np.arange(lay.regions, dtype=np.int32)
            init.write(wl, idx, wr, idx, b"warm-regions")
            for tokens in sizes:
                rows.append(_size(args, p, pw, dw, init, src, dst, tokens, pool, rng))
            pw.detach()
            dw.detach()
    finally:
        if init is not None:
            init.close()
        if target is not None:
            target.close()
        src.close()
        dst.close()
    return _result(args, lay, rows)


def _size(args: argparse.Namespace, p: DaemonProc, pw: StreamWorker, dw: StreamWorker, init: Any, src: KVMemory,
          dst: KVMemory, tokens: int, pool: int, rng: np.random.Generator) -> dict[str, Any]:
    lay = src.layout
    n = lay.blocks_for(tokens)
    nbytes = lay.regions * n * lay.block_len
    sb, db = _blocks(n, pool, args.fragmented, rng)
    rl, rr = init.region_lists(n)
    ridx = np.arange(lay.regions, dtype=np.int32)
    bl, br = init.block_indices(sb, db)
    ceil_ns: list[int] = []
    blocks_ns: list[int] = []
    daemon_ns: list[int] = []
    declared_ns: list[int] = []
    tids: list[str] = []
    descs = (0, 0)
    progress(f"  {tokens} tokens: {n} blocks x {lay.regions} regions = {nbytes / 2**20:.0f} MiB")
    mismatched = -1
    kinds = ("ceiling", "blocks", "daemon", "declared")
    for rep in range(-1, args.repeat):  # rep -1 warms up this size (page tables, UCX caches), untimed
        tag = f"{tokens}-{rep}-{os.urandom(3).hex()}"
        tid = f"ceiling-{tag}"
        t: dict[str, int] = {}
        verify = rep == args.repeat - 1
        for kind in kinds[rep % 4:] + kinds[:rep % 4]:  # the order rotates from rep to rep
            if kind == "ceiling":
                t0, _, t1 = init.write(rl, ridx, rr, ridx, f"ceil-{tag}".encode())
                t[kind] = t1 - t0
            elif kind == "blocks":
                t0, _, t1 = init.write(init.local_blocks, bl, init.remote_blocks, br, f"blocks-{tag}".encode())
                t[kind] = t1 - t0
            else:
                if verify:  # the daemon's WRITE must put every byte there itself
                    dst.arr[:, db, :] = POISON
                if kind == "daemon":
                    t[kind], req, posted = _daemon_once(p, pw, dw, tid, sb, db)
                    descs = (req, posted)
                else:
                    t[kind] = _declared_once(p, pw, dw, f"{tid}-declared", sb, db, lay.layers)
                if verify:
                    mismatched = max(mismatched, int(np.count_nonzero(dst.arr[:, db, :] != src.arr[:, sb, :])))
        if rep < 0:
            continue
        ceil_ns.append(t["ceiling"])
        blocks_ns.append(t["blocks"])
        daemon_ns.append(t["daemon"])
        declared_ns.append(t["declared"])
        tids.append(tid)
        progress(f"    rep {rep}: ceiling {nbytes / t['ceiling']:.2f} GB/s, raw blocks "
                 f"{nbytes / t['blocks']:.2f} GB/s, daemon {nbytes / t['daemon']:.2f} GB/s, declared "
                 f"{nbytes / t['declared']:.2f} GB/s")
    if mismatched != 0:
        raise BenchError(f"{tokens} tokens: {mismatched} destination bytes differ from the source")
    writes = {r["transfer_id"]: r for r in p.log_records("write done") if r.get("transfer_id") in set(tids)}
    post_ms = [writes[t]["post_us"] / 1e3 for t in tids if t in writes]
    xfer_ms = [writes[t]["xfer_us"] / 1e3 for t in tids if t in writes]
    other_ms = [d / 1e6 - writes[t]["post_us"] / 1e3 - writes[t]["xfer_us"] / 1e3
                for t, d in zip(tids, daemon_ns, strict=True) if t in writes]
    ceiling_gbps = nbytes / median(ceil_ns)
    daemon_gbps = nbytes / median(daemon_ns)
    paired = [c / dmn for c, dmn in zip(ceil_ns, daemon_ns, strict=True)]
    return {
        "tokens": tokens, "blocks": n, "bytes": nbytes,
        "descriptors_requested": descs[0], "descriptors_posted": descs[1],
        "ceiling_descriptors": lay.regions,
        "ceiling_ms": round(median(ceil_ns) / 1e6, 2), "raw_blocks_ms": round(median(blocks_ns) / 1e6, 2),
        "daemon_ms": round(median(daemon_ns) / 1e6, 2),
        "daemon_write_ms": round(median(post_ms), 2), "daemon_write_done_ms": round(median(xfer_ms), 2),
        "daemon_other_ms": round(median(other_ms), 2),
        "ceiling_gbps": round(ceiling_gbps, 3), "raw_blocks_gbps": round(nbytes / median(blocks_ns), 3),
        "daemon_gbps": round(daemon_gbps, 3),
        "efficiency": round(daemon_gbps / ceiling_gbps, 3),
        "efficiency_paired": round(median(paired), 3),
        "efficiency_best": round(min(ceil_ns) / min(daemon_ns), 3),
        "ceiling_gbps_spread": [round(nbytes / max(ceil_ns), 3), round(nbytes / min(ceil_ns), 3)],
        "daemon_gbps_spread": [round(nbytes / max(daemon_ns), 3), round(nbytes / min(daemon_ns), 3)],
        "declared_ms": round(median(declared_ns) / 1e6, 2),
        "efficiency_declared": round(median(ceil_ns) / median(declared_ns), 3),
        "efficiency_declared_paired": round(median([c / x for c, x in zip(ceil_ns, declared_ns, strict=True)]), 3),
        "bytes_verified": nbytes,
    }


def _result(args: argparse.Namespace, lay: Layout, rows: list[dict[str, Any]]) -> Result:
    top = next((r for r in rows if r["tokens"] == 16384), rows[-1])
    data: dict[str, Any] = {
        "efficiency": top["efficiency"], "ceiling_gbps": top["ceiling_gbps"], "daemon_gbps": top["daemon_gbps"],
        "at_tokens": top["tokens"], "target_efficiency": TARGET_EFFICIENCY,
        "target_met": top["efficiency"] >= TARGET_EFFICIENCY,
        "backend": args.backend,
        "fragmented": bool(args.fragmented), "repeat": args.repeat, "poll_us": args.poll_us,
        "layout": lay.describe(), "rows": rows,
    }
    cols = [("tokens", "tokens", "d"), ("bytes", "bytes", ",d"), ("descriptors_requested", "descs", ",d"),
            ("descriptors_posted", "merged", ",d"), ("ceiling_ms", "ceil ms", ".1f"),
            ("daemon_ms", "daemon ms", ".1f"), ("daemon_write_ms", "of which WRITE", ".1f"),
            ("daemon_other_ms", "other", ".1f"), ("ceiling_gbps", "ceiling GB/s", ".3f"),
            ("raw_blocks_gbps", "raw-blocks GB/s", ".3f"), ("daemon_gbps", "daemon GB/s", ".3f"),
            ("efficiency", "efficiency", ".3f"), ("efficiency_paired", "eff paired", ".3f"),
            ("efficiency_best", "eff best", ".3f"), ("declared_ms", "declared ms", ".1f"),
            ("efficiency_declared", "eff declared", ".3f")]
    lines = [f"efficiency at {top['tokens']} tokens: {top['efficiency']:.3f} (daemon {top['daemon_gbps']:.3f} "
             f"GB/s / ceiling {top['ceiling_gbps']:.3f} GB/s)  target >= {TARGET_EFFICIENCY}: "
             f"{met(top['efficiency'], TARGET_EFFICIENCY, True)}"]
    method = [
        f"NIXL backend {args.backend} (daemons and raw agents).",
        f"Qwen3-32B per-rank layout: {lay.layers} layers x K,V = {lay.regions} regions, block of "
        f"{lay.block_tokens} tokens x {lay.kv_heads} KV head x {lay.head_dim} x {lay.dtype_bytes} B = "
        f"{lay.block_len} B; {'blocks in random order on both sides' if args.fragmented else 'contiguous blocks'}.",
        "ceiling: raw NIXL WRITE of the same bytes as one descriptor per region, agent in this process -> "
        "target agent in a helper process (shared memory), timed from make_prepped_xfer to the notification "
        "read by the target.",
        "raw-blocks: raw NIXL with the daemon's descriptors (one per region and block, prepared once, index "
        "arrays, NIXL merges adjacent ones), same timing.",
        "daemon: two kvpushd processes, two attached workers; Expect first and its registration reached the "
        "prefill daemon, then timed from Publish to FINISHED_RECEIVING read by the decode worker.",
        "declared (progressive push): the same, but the Publish is declared for a doorbell step before the "
        "timer starts, and the timer runs from the doorbell's seal (the last layer written) to "
        "FINISHED_RECEIVING; eff declared = ceiling time / declared time.",
        f"GB/s from the median of {args.repeat} reps; efficiency = daemon GB/s / ceiling GB/s; eff paired = "
        "median of per-rep ratios (each rep runs the three back to back, in an order that rotates); eff best = "
        "fastest ceiling rep time / fastest daemon rep time (load only adds time); one untimed warm-up rep per "
        "size; the last daemon rep of each size is verified byte for byte.",
        f"the raw target reads notifications every {args.poll_us:g} us, the daemons' transfer.poll_interval_s is "
        "the same.",
        "of which WRITE: the prefill daemon's own per-WRITE post_us (debug log): WRITE request reaching its NIXL "
        "thread -> transfer() returned, which on this UCX transport includes the copy; other = daemon ms - that - "
        "the time until the WRITE's completion was seen: Publish RPC, rendezvous, waking the NIXL thread, the "
        "notification's trip through the decode daemon to the worker.",
    ]
    return Result("ceiling", data, cols, rows, lines, method, samples={"rows": rows})
