"""kvpushd bench handover: how soon decode has a prompt's KV, one request at a time, by connector.

The real reference engine does the work (``refengine``: the scheduler loop, the tiny model's forward
and its paged KV in shared memory, the connectors' hooks), one prefill and one decode engine per
connector kind, each its own process, on the published shape (``--kv-shape qwen3-32b-tp8``): a
64-layer model whose 64 x (K, V) are the Qwen3-32B TP8 rank's 128 regions of 4 KiB blocks, so a
16,384-token prompt moves 512 MiB in 131,072 block descriptors. The model attends over a sliding
window (``--window``, 128 tokens): full causal attention over 16k tokens takes minutes per forward
on a small CPU, the window makes the forward's time grow with the prompt (about 6 s at 16k here).
The prefill forward writes each layer's K and V into its blocks as soon as it has computed them.

Modes (``--modes``; all by default):

- ``kvpushd-progressive``: the publish is declared in the step that computes the prompt, before the
  forward (step, 64 layer groups); the worker's doorbell rings after each layer and the step is
  sealed after the forward: the daemon writes each layer as it is computed;
- ``kvpushd-whole``: the publish goes after the forward (as a connector that publishes once the
  request's KV is complete); same engines, progressive off for the request;
- ``inengine-push``: the engine's own NIXL agent, NixlPushConnector-style: decode registers its blocks
  over the side channel at allocation, prefill WRITEs everything after the forward;
- ``inengine-pull``: NixlConnector-style: decode gets the request after prefill and READs.

Push modes send the decode leg together with the prefill leg (vLLM's push proxy); pull sends it after
prefill answered. Per prompt length and mode: ``handover_ms`` (the prefill forward's end: the last
layer computed, every layer's KV in the cache -> the decode engine reads "finished receiving"; the
layers' hook runs after each layer's attention, where vLLM calls ``save_kv_layer``, so the last
MLP and the logits, ``forward_tail_ms``, come after it), ``forward_start_to_told_ms`` and
``ttft_ms`` (the request sent to the engines -> the decode engine's first decode step has produced
its token; every mode the same way), each {p50, p99}. ``ttft_after_forward_ms`` is TTFT less the
request's own forward: on a small shared machine the forward's time varies more from request to
request than the handover does. ``told_to_first_token_ms``: "finished receiving" read -> the first
token (the decode engine's first step); ``token_after_told_ms``: when prefill's first token, relayed
by the bench as a push proxy would, reached the decode engine, after (> 0) or before (< 0) the KV.
After every request both engines digest the
request's blocks in all 128 regions and the bench compares them. ``--fabric veth:10gbit`` runs each
node (daemon and engines) in its own network namespace, joined by a veth pair shaped with ``tc tbf``,
UCX over TCP on it. ``--backend LIBFABRIC``: the daemons and the in-engine agents run NIXL's LIBFABRIC
backend (libfabric's tcp provider here, on the veth with ``--fabric veth:...``; ``kvpushd_lab.backend``).
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path
from typing import Any

from ..backend import BACKENDS, available
from .common import BenchError, Result, dist, machine_load, progress
from .handover_engines import LAYERS, EnginePair
from .handover_fabric import Nodes

MODES = ("kvpushd-progressive", "kvpushd-whole", "inengine-push", "inengine-pull")
KIND = {"kvpushd-progressive": "kvpushd", "kvpushd-whole": "kvpushd", "inengine-push": "inengine-push",
        "inengine-pull": "inengine-pull"}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[1024, 4096, 16384],
                   help="prompt lengths in tokens, multiples of 16 (default 1024 4096 16384)")
    p.add_argument("--requests", type=int, default=8, help="requests per prompt length and mode (default 8)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="default: all four")
    p.add_argument("--fabric", default="loopback",
                   help="loopback (default: both nodes on this host, UCX picks shared memory) or veth:RATE "
                        "(e.g. veth:10gbit, veth:25gbit: two network namespaces, tc tbf on the veth pair, "
                        "UCX_TLS=tcp; needs root and iproute2)")
    p.add_argument("--backend", choices=BACKENDS, default="UCX",
                   help="NIXL backend of the daemons and of the in-engine agents (default UCX); LIBFABRIC needs "
                        "scripts/libfabric.sh's build and runs libfabric's tcp provider here")
    p.add_argument("--window", type=int, default=128, help="the model's attention window in tokens (default 128)")
    p.add_argument("--seed", type=int, default=0)


def _one(mode: str, pair: EnginePair, static: dict[str, Any], rid: str, prompt: list[int],
         timeout_s: float = 300.0) -> dict[str, float]:
    """One request through both engines, then the byte check; the timestamps in ms."""
    if KIND[mode] == "kvpushd":
        pair.send("prefill", ("progressive", mode == "kvpushd-progressive"))
    t0 = time.monotonic_ns()
    if mode != "inengine-pull":  # push: both legs at once, decode registers its blocks
        pair.send("decode", ("add", rid, prompt, 2, {"transfer_id": rid, **static}))
    pair.send("prefill", ("add", rid, prompt, 1, None))
    t_first = 0
    sent = False
    deadline = time.monotonic() + timeout_s
    while not (t_first and sent):
        if time.monotonic() > deadline:
            raise BenchError(f"{mode} {rid}: not done after {timeout_s:g} s")
        for role, msg in pair.recv(0.5):
            if msg[0] == "out" and msg[1] == rid:
                ok, tokens, err, params, t = msg[2:7]
                if not ok:
                    raise BenchError(f"{mode} {rid}: {role} engine: {err}")
                if role == "decode":
                    t_first = t
                elif mode == "inengine-pull":
                    pair.send("decode", ("add", rid, prompt, 2, params))
                else:
                    pair.send("decode", ("first_token", rid, tokens[0]))
            elif msg[0] == "sent" and msg[1] == rid:
                if msg[2]:
                    raise BenchError(f"{mode} {rid}: prefill engine: {msg[2]}")
                sent = True
    for role in ("prefill", "decode"):
        pair.send(role, ("check", rid))
    checks: dict[str, tuple[Any, ...]] = {}
    while len(checks) < 2:
        for role, msg in pair.recv(30.0):
            if msg[0] == "check" and msg[1] == rid:
                checks[role] = msg
    (p_digest, p_times), (d_digest, d_times) = checks["prefill"][2:4], checks["decode"][2:4]
    if not p_digest or p_digest != d_digest:
        raise BenchError(f"{mode} {rid}: the decode engine's blocks differ from the prefill engine's")
    told, end, start = d_times["told"], p_times["forward_end"], p_times["forward_start"]
    token = d_times.get("token", told)  # push: prefill's first token, relayed by the router
    return {"handover": (told - end) / 1e6, "start_to_told": (told - start) / 1e6, "ttft": (t_first - t0) / 1e6,
            "forward": (end - start) / 1e6, "tail": (p_times["forward_return"] - end) / 1e6,
            "told_to_first": (t_first - told) / 1e6, "token_after_told": (token - told) / 1e6}


def _ratio(rows: list[dict[str, Any]], tokens: int, a: str, b: str, key: str) -> float | None:
    ra = next((r for r in rows if r["tokens"] == tokens and r["mode"] == a), None)
    rb = next((r for r in rows if r["tokens"] == tokens and r["mode"] == b), None)
    if ra is None or rb is None:
        return None
    return round(float(ra[key]["p50"]) / max(float(rb[key]["p50"]), 1e-9), 3)


def run(args: argparse.Namespace, workdir: Path) -> Result:
    lens = sorted(set(args.prompt_lens))
    if not lens or min(lens) < 16 or any(n % 16 for n in lens) or args.requests < 1:
        raise BenchError("--prompt-lens must be multiples of 16 (at least 16), --requests at least 1")
    if args.fabric != "loopback" and not re.fullmatch(r"veth:\d+(\.\d+)?[kmg]bit", args.fabric):
        raise BenchError(f"--fabric {args.fabric!r}: loopback or veth:RATE (veth:10gbit, veth:25gbit)")
    if why := available(args.backend):
        raise BenchError(f"--backend {args.backend}: {why}")
    modes = [m for m in MODES if m in args.modes]
    kinds = sorted({KIND[m] for m in modes})
    from ..refengine import random_prompt
    from .handover_engines import config

    blocks = -(-max(lens) // 16) + 2
    cfg = config(max(lens) + 16, args.window)
    spec = {"max_positions": max(lens) + 16, "window": args.window, "seed": args.seed, "num_blocks": blocks}
    progress(f"handover: {', '.join(modes)}; {lens} tokens, {args.requests} requests per cell, NIXL {args.backend}, "
             f"fabric {args.fabric}, the reference engine ({LAYERS} layers, window {args.window}) in the "
             "qwen3-32b-tp8 shape")
    rows: list[dict[str, Any]] = []
    load0 = machine_load()
    checked = 0
    with Nodes(args.fabric, workdir, args.backend) as nodes:
        pairs: dict[str, EnginePair] = {}
        try:
            for kind in kinds:
                pairs[kind] = EnginePair(kind, spec, nodes.engine_specs())
            statics = {kind: pair.ready() for kind, pair in pairs.items()}
            progress("  engines ready")
            veth0 = nodes.link_bytes()
            n = 0
            for tokens in lens:
                samples: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
                for i in range(args.requests + 1):  # the first of each mode is an untimed warm-up
                    order = modes[i % len(modes):] + modes[:i % len(modes)]
                    for mode in order:
                        n += 1
                        prompt = random_prompt(args.seed * 1_000_003 + n, tokens, cfg.vocab_size)
                        got = _one(mode, pairs[KIND[mode]], statics[KIND[mode]], f"h{n}-{mode}", prompt)
                        checked += 1
                        if i:
                            samples[mode].append(got)
                for mode in modes:
                    s = samples[mode]
                    rows.append({"tokens": tokens, "mode": mode, "requests": len(s),
                                 "handover_ms": dist([x["handover"] for x in s], 2),
                                 "forward_start_to_told_ms": dist([x["start_to_told"] for x in s], 2),
                                 "ttft_ms": dist([x["ttft"] for x in s], 2),
                                 "ttft_after_forward_ms": dist([x["ttft"] - x["forward"] for x in s], 2),
                                 "forward_ms": dist([x["forward"] for x in s], 2),
                                 "forward_tail_ms": dist([x["tail"] for x in s], 2),
                                 "told_to_first_token_ms": dist([x["told_to_first"] for x in s], 2),
                                 "token_after_told_ms": dist([x["token_after_told"] for x in s], 2)})
                    progress(f"  {tokens:6d} tokens {mode:20s} handover p50 {rows[-1]['handover_ms']['p50']:9.2f} ms"
                             f"  TTFT p50 {rows[-1]['ttft_ms']['p50']:9.2f} ms")
            veth = nodes.link_bytes(veth0)
        finally:
            for pair in pairs.values():
                pair.stop()
    ratios = []
    for tokens in lens:
        x: dict[str, Any] = {"tokens": tokens}
        for other, tag in (("kvpushd-whole", "whole"), ("inengine-push", "inengine_push"),
                           ("inengine-pull", "inengine_pull")):
            for key, name in (("handover_ms", "handover"), ("ttft_ms", "ttft"),
                              ("ttft_after_forward_ms", "ttft_after_forward")):
                r = _ratio(rows, tokens, "kvpushd-progressive", other, key)
                if r is not None:
                    x[f"{name}_p50_progressive_over_{tag}"] = r
        ratios.append(x)
    data = {"fabric": args.fabric, "backend": args.backend,
            "engine": {"model": "refengine TinyModel", "layers": LAYERS, "window": args.window,
                       "kv_shape": "qwen3-32b-tp8", "regions": 2 * LAYERS, "block_len": 4096, "num_blocks": blocks},
            "requests": args.requests, "modes": modes, "rows": rows, "ratios": ratios,
            "requests_checked": checked, "veth_bytes": veth, "load_before": load0, "load_after": machine_load()}
    cols = [("tokens", "tokens", "d"), ("mode", "mode", "s"), ("handover_p50", "handover p50 ms", ".2f"),
            ("handover_p99", "p99", ".2f"), ("ttft_p50", "TTFT p50 ms", ".1f"), ("fwd_p50", "forward p50 ms", ".1f")]
    flat = [{"tokens": r["tokens"], "mode": r["mode"], "handover_p50": r["handover_ms"]["p50"],
             "handover_p99": r["handover_ms"]["p99"], "ttft_p50": r["ttft_ms"]["p50"],
             "fwd_p50": r["forward_ms"]["p50"]} for r in rows]
    lines = [f"{x['tokens']} tokens: " + ", ".join(f"{k} {v:.3f}" for k, v in x.items() if k != "tokens")
             for x in ratios]
    lines.append(f"{checked} requests, every one's blocks digested on both engines and equal")
    method = [
        f"The reference engine ({LAYERS} layers x K,V = the 128 regions of 4 KiB blocks of one Qwen3-32B TP8 rank, "
        f"attention window {args.window}), one prefill and one decode engine process per connector kind; "
        f"fabric {args.fabric}; NIXL {args.backend} in the daemons and the in-engine agents.",
        "One request at a time; modes alternate, one untimed warm-up per mode and length. handover = the prefill "
        "forward's end -> the decode engine reads finished receiving; TTFT = request sent -> the decode engine's "
        "first decode step produced its token.",
    ]
    return Result("handover", data, cols, flat, lines, method, samples={"rows": rows})
