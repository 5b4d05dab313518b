"""kvpushd bench handover: progressive push vs whole-request push, one request at a time.

A prefill "engine" computes the Qwen3-32B rank layout's 64 layers one after the other (the forward's
time per layer scales with the prompt: ``--forward-ms-per-1k``), writing each layer's K and V into its
source blocks when it gets to that layer. The decode side registers first (push mode, as vLLM's
proxy sends both legs at once). Modes:

- ``kvpushd-progressive``: the publish is declared before the forward (step, 64 layer groups) and
  the doorbell rings after each layer: the daemon writes each layer as soon as it is computed;
- ``kvpushd-whole``: the publish goes after the forward, as a connector that publishes once the
  request's KV is complete.

Per prompt length and mode: ``handover_ms`` (forward end -> decode worker told FINISHED_RECEIVING),
``forward_start_to_told_ms`` and ``ttft_ms`` (here: request start -> decode told; the decode engine's first
step comes on top, the same for both modes), each {p50, p99}. Every request's bytes are checked.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np
from kvpushd_client import CompletionKind, Role, StreamWorker

from .common import POISON, BenchError, KVMemory, Layout, Result, daemon_pair, dist, machine_load, progress

MODES = ("kvpushd-progressive", "kvpushd-whole")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[1024, 4096, 16384],
                   help="prompt lengths in tokens (default 1024 4096 16384)")
    p.add_argument("--requests", type=int, default=8, help="requests per prompt length and mode (default 8)")
    p.add_argument("--layers", type=int, default=64, help="layers (default 64: Qwen3-32B)")
    p.add_argument("--forward-ms-per-1k", type=float, default=60.0,
                   help="prefill forward time per 1,024 prompt tokens, all layers (default 60 ms)")


def _told(w: StreamWorker, tid: str, kind: CompletionKind, timeout_s: float = 120.0) -> float:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        c = w.next_completion(max(0.0, deadline - time.monotonic()))
        if c is None:
            break
        if c.transfer_id != tid:
            continue
        if c.kind is not kind:
            raise BenchError(f"transfer {tid}: {c.kind.name} {c.code} {c.reason}")
        return time.perf_counter()
    raise BenchError(f"transfer {tid}: no {kind.name} within {timeout_s:g} s")


def _one(mode: str, tid: str, pw: StreamWorker, dw: StreamWorker, peer: str, src: KVMemory, dst: KVMemory,
         want: np.ndarray, blocks: list[int], layers: int, layer_s: float) -> dict[str, float]:
    src.arr[:, blocks] = POISON  # not computed yet: a WRITE that went early lands this
    dst.arr[:, blocks] = 0
    dw.expect(tid, blocks, peer, "bench-prefill", 1)
    bell = pw.doorbell
    assert bell is not None
    t_start = time.perf_counter()
    seq = bell.step()
    if mode == "kvpushd-progressive":
        pw.publish_nowait(tid, blocks, step=seq, layers=layers)
        pw.step()
    per = src.layout.regions // layers
    for g in range(layers):
        end = time.perf_counter() + layer_s
        while time.perf_counter() < end:  # the forward of one layer (the engine is busy)
            time.sleep(min(0.0005, max(0.0, end - time.perf_counter())))
        src.arr[g * per:(g + 1) * per, blocks] = want[g * per:(g + 1) * per, blocks]
        bell.layer_done(g + 1)
    bell.seal()
    t_end = time.perf_counter()
    if mode == "kvpushd-whole":
        pw.publish_nowait(tid, blocks)
        pw.step()
    t_told = _told(dw, tid, CompletionKind.FINISHED_RECEIVING)
    _told(pw, tid, CompletionKind.FINISHED_SENDING)
    if not (dst.arr[:, blocks] == want[:, blocks]).all():
        raise BenchError(f"transfer {tid} ({mode}): decode blocks differ from the prefill KV")
    return {"handover": (t_told - t_end) * 1e3, "start_to_told": (t_told - t_start) * 1e3,
            "forward": (t_end - t_start) * 1e3}


def run(args: argparse.Namespace, workdir: Path) -> Result:
    lens = sorted(set(args.prompt_lens))
    if not lens or min(lens) < 16 or args.requests < 1:
        raise BenchError("--prompt-lens must be at least 16 and --requests at least 1")
    base = Layout(layers=args.layers)
    lay = Layout(layers=args.layers, num_blocks=base.blocks_for(max(lens)))
    progress(f"handover: {lay.regions} regions x {lay.num_blocks} blocks of {lay.block_len} B, lengths {lens}, "
             f"{args.requests} requests per cell, forward {args.forward_ms_per_1k:g} ms per 1k tokens")
    src = KVMemory("kvpushd-bench-src", lay, fill=POISON)
    dst = KVMemory("kvpushd-bench-dst", lay, fill=0)
    want = KVMemory("kvpushd-bench-want", lay, seed=1)
    rows: list[dict[str, Any]] = []
    load0 = machine_load()
    try:
        with daemon_pair(workdir) as (p, d):
            pw = p.client.attach("bench-prefill", Role.PRODUCER, 0, 1, [src.buf.memory], lay.region_list(),
                                 doorbell=True)
            dw = d.client.attach("bench-decode", Role.CONSUMER, 0, 1, [dst.buf.memory], lay.region_list())
            try:
                n = 0
                for tokens in lens:
                    blocks = list(range(lay.blocks_for(tokens)))
                    layer_s = args.forward_ms_per_1k * tokens / 1024 / 1e3 / args.layers
                    samples: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
                    for i in range(args.requests + 1):  # the first of each mode is an untimed warm-up
                        for mode in (MODES if i % 2 else MODES[::-1]):
                            n += 1
                            got = _one(mode, f"h{n}", pw, dw, p.peer_address, src, dst, want.arr, blocks,
                                       args.layers, layer_s)
                            if i:
                                samples[mode].append(got)
                    for mode in MODES:
                        s = samples[mode]
                        rows.append({"tokens": tokens, "mode": mode,
                                     "handover_ms": dist([x["handover"] for x in s], 2),
                                     "forward_start_to_told_ms": dist([x["start_to_told"] for x in s], 2),
                                     "ttft_ms": dist([x["start_to_told"] for x in s], 2),
                                     "forward_ms": dist([x["forward"] for x in s], 2)})
                    prog, whole = rows[-2], rows[-1]
                    progress(f"  {tokens} tokens: handover p50 progressive {prog['handover_ms']['p50']:.2f} ms, "
                             f"whole {whole['handover_ms']['p50']:.2f} ms")
            finally:
                pw.detach()
                dw.detach()
    finally:
        for m in (src, dst, want):
            m.close()
    ratios = []
    for tokens in lens:
        prog = next(r for r in rows if r["tokens"] == tokens and r["mode"] == MODES[0])
        whole = next(r for r in rows if r["tokens"] == tokens and r["mode"] == MODES[1])
        ratios.append({"tokens": tokens,
                       "handover_p50_progressive_over_whole": round(prog["handover_ms"]["p50"]
                                                                    / max(whole["handover_ms"]["p50"], 1e-9), 3),
                       "ttft_p50_progressive_over_whole": round(prog["ttft_ms"]["p50"]
                                                                / max(whole["ttft_ms"]["p50"], 1e-9), 3)})
    data = {"layout": lay.describe(), "forward_ms_per_1k": args.forward_ms_per_1k, "requests": args.requests,
            "rows": rows, "ratios": ratios, "load_before": load0, "load_after": machine_load()}
    cols = [("tokens", "tokens", "d"), ("mode", "mode", "s")]
    flat = [{"tokens": r["tokens"], "mode": r["mode"], "handover_p50": r["handover_ms"]["p50"],
             "handover_p99": r["handover_ms"]["p99"], "ttft_p50": r["ttft_ms"]["p50"]} for r in rows]
    cols += [("handover_p50", "handover p50 ms", ".2f"), ("handover_p99", "p99", ".2f"),
             ("ttft_p50", "start->told p50 ms", ".2f")]
    lines = [f"{x['tokens']} tokens: handover progressive/whole {x['handover_p50_progressive_over_whole']:.3f}, "
             f"start->told {x['ttft_p50_progressive_over_whole']:.3f}" for x in ratios]
    method = [
        f"{lay.layers} layers x K,V = {lay.regions} regions of {lay.block_len} B blocks (Qwen3-32B at TP8, one rank); "
        "two kvpushd daemons on this machine (UCX over shared memory), decode registered first.",
        "The prefill forward is simulated per layer (a timed wait, then the layer's K and V written into the "
        "source blocks, then the doorbell); source blocks hold POISON until their layer is computed, and every "
        "request's decode blocks are checked byte for byte.",
        "handover = forward end -> FINISHED_RECEIVING read by the decode worker; start->told = forward start -> "
        "the same; modes alternate, one warm-up per mode and length.",
    ]
    return Result("handover", data, cols, flat, lines, method, samples={"rows": rows})
