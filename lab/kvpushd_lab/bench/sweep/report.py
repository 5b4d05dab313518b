"""The sweep's result: the table, the headline figures against the issue's targets, the plots."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..common import Result

MODES = ("kvpushd-push", "kvpushd-pull", "inengine-push", "inengine-pull", "kvpushd-whole")
DEFAULT_MODES = MODES[:4]  # kvpushd-whole: kvpushd-push without progressive push, on request
TARGET_RATIO = 0.5  # kvpushd-push TTFT p50 <= half of inengine-pull's, at the highest QPS and longest prompt


def _verdict(ratio: float | None, target: float) -> str:
    return "-" if ratio is None else f"{ratio:.2f} ({'met' if ratio <= target else 'MISSED'})"


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def result(args: argparse.Namespace, modes: list[str], status: dict[str, dict[str, Any]],
           cells: list[dict[str, Any]], spec: dict[str, Any]) -> Result:
    top = max(args.qps)
    longest = max(args.prompt_lens)
    shape = spec["kv"]
    ratios: dict[str, Any] = {}
    lines = [f"KV shape {shape['name']}: {shape['regions']} regions, {shape['bytes_per_token']:,} B per token "
             f"({shape['block_len']:,} B blocks of {shape['block_tokens']} tokens; {shape['model_regions']} of the "
             "regions are the tiny model's)"]
    for plen in args.prompt_lens:
        def fig(mode: str, key: str, plen: int = plen) -> float | None:
            for c in cells:
                if c["mode"] == mode and c["prompt_len"] == plen and c["qps"] == top and c[key]["n"]:
                    return float(c[key]["p50"])
            return None

        push, pull, ipush = fig("kvpushd-push", "ttft_ms"), fig("inengine-pull", "ttft_ms"), fig("inengine-push",
                                                                                                  "ttft_ms")
        ratio = _ratio(push, pull)
        r_push = _ratio(push, ipush)
        r_tpot = _ratio(fig("kvpushd-push", "tpot_ms"), fig("inengine-push", "tpot_ms"))
        ratios[str(plen)] = {
            "qps": top, "kvpushd_push_ttft_p50_ms": push, "inengine_pull_ttft_p50_ms": pull,
            "inengine_push_ttft_p50_ms": ipush, "ratio": ratio,
            "target_met": ratio is not None and ratio <= TARGET_RATIO,
            "ttft_vs_inengine_push": r_push, "ttft_vs_inengine_push_met": r_push is not None and r_push <= 1.0,
            "tpot_vs_inengine_push": r_tpot, "tpot_vs_inengine_push_met": r_tpot is not None and r_tpot <= 1.0}
        others = ", ".join(f"{m} {v:.1f} ms" for m in MODES if (v := fig(m, "ttft_ms")) is not None)
        lines.append(f"prompt {plen}, QPS {top:g}: kvpushd-push / inengine-push TTFT p50 {_verdict(r_push, 1.0)}, "
                     f"TPOT p50 {_verdict(r_tpot, 1.0)}; kvpushd-push / inengine-pull TTFT p50 "
                     f"{_verdict(ratio, TARGET_RATIO)} (target <= {TARGET_RATIO})  ({others})")
    for m in modes:
        if not status.get(m, {}).get("status", "").startswith("ok"):
            lines.append(f"{m}: {status.get(m, {}).get('status')}")
    all_match = all(c["tokens_match"] for c in cells) and bool(cells)
    lines.append(f"tokens match the monolithic run in every cell: {'yes' if all_match else 'NO'}")
    checks = {m: s["engine_stats"]["decode"]["kv_check"] for m, s in status.items()
              if "kv_check" in s.get("engine_stats", {}).get("decode", {})}
    if checks:
        lines.append("extra regions checked on decode: " + ", ".join(
            f"{m} {c['checked_requests']} requests, {c['bytes_moved_checked'] / 2**30:.2f} GiB moved, "
            f"{c['mismatched_words']} of {c['checked_words']:,} words differ" for m, c in checks.items()))
    at_top = list(ratios.values())
    targets = {
        "ttft_vs_inengine_push_every_prompt": bool(at_top) and all(r["ttft_vs_inengine_push_met"] for r in at_top),
        "tpot_vs_inengine_push_every_prompt": bool(at_top) and all(r["tpot_vs_inengine_push_met"] for r in at_top),
        "vs_inengine_pull_at_longest": bool(ratios.get(str(longest), {}).get("target_met")),
    }
    data: dict[str, Any] = {
        "modes": status, "cells": cells, "ratio_at_top_qps": ratios, "target_ratio": TARGET_RATIO,
        "targets": targets, "target_met": all(targets.values()),
        "tokens_match": all_match, "kv_checked": checks, "prompt_lens": args.prompt_lens, "qps": args.qps,
        "requests": args.requests, "max_new_tokens": args.max_new_tokens, "warmup": args.warmup,
        "kv_shape": shape, "kv_slots": spec["slots"],
        "model": {"layers": spec["layers"], "heads": spec["cfg_heads"], "kv_heads": spec["cfg_kv_heads"],
                  "head_dim": spec["cfg_head_dim"], "hidden": spec["cfg_hidden"], "block_size": shape["block_tokens"]},
    }
    rows = [{"mode": c["mode"], "prompt_len": c["prompt_len"], "qps": c["qps"],
             "ttft_p50": c["ttft_ms"]["p50"], "ttft_p99": c["ttft_ms"]["p99"], "tpot_p50": c["tpot_ms"]["p50"],
             "pre_p50": c["to_prefilled_ms"]["p50"], "hand_p50": c["handover_ms"]["p50"],
             "tpot_p99": c["tpot_ms"]["p99"], "failed": c["failed"], "match": "yes" if c["tokens_match"] else "NO",
             "achieved_qps": c["achieved_qps"], "load": c["loadavg_1m"]} for c in cells]
    cols = [("mode", "mode", "<"), ("prompt_len", "prompt", "d"), ("qps", "QPS", "g"),
            ("achieved_qps", "got QPS", ".2f"), ("ttft_p50", "TTFT p50 ms", ".1f"), ("ttft_p99", "TTFT p99 ms", ".1f"),
            ("pre_p50", "prefilled p50", ".1f"), ("hand_p50", "hand-over p50", ".1f"),
            ("tpot_p50", "TPOT p50 ms", ".2f"), ("tpot_p99", "TPOT p99 ms", ".2f"), ("failed", "failed", "d"),
            ("match", "tokens", "<"), ("load", "load", ".1f")]
    method = [
        "per mode one prefill and one decode reference-engine process (tiny deterministic transformer, paged KV "
        f"in shared memory, {spec['layers']} layers, {spec['cfg_kv_heads']} KV heads x head_dim "
        f"{spec['cfg_head_dim']}, 16 tokens per block, no prefix cache) serve every cell; kvpushd modes add two "
        "daemons (the engines' sessions are worker Streams, one CommandBatch per engine step), in-engine modes "
        "own NIXL agents in the engine processes (UCX) and post, poll and notify on the engine thread.",
        f"KV shape {shape['name']}: each request moves {shape['regions']} regions x its prompt's blocks "
        f"({shape['bytes_per_token']:,} B per token, one descriptor per region and block before merging)"
        + ("; the regions beyond the model's are stamped on prefill (guard words at each block's head and tail, "
           "one sampled block whole) and compared on decode once the transfer is reported finished"
           if shape["extra_regions"] else "") + f"; each engine holds {spec['slots']} requests' worth of blocks of "
        "the longest prompt.",
        "push modes: the router sends each request to both engines at its arrival (decode registers blocks at "
        "allocation) and relays prefill's first token; pull modes: the router sends it to decode with prefill's "
        "kv_params once prefill answered (vLLM's proxy flow).",
        f"per prompt length {args.warmup} untimed warm-up requests, then per QPS {args.requests} distinct prompts "
        "with Poisson arrivals (the same prompts and arrival times for every mode, the modes' order rotating "
        "from cell to cell).",
        "TTFT: arrival -> end of the decode engine step that first emits tokens for the request; TPOT: (last token "
        "- first emitted) / (tokens - 2), all CLOCK_MONOTONIC across processes. Percentiles nearest-rank. TTFT "
        "in two: prefilled = arrival -> end of the prefill engine's step that prefilled the request (queueing, "
        "the forward pass, and what the hooks do in that step: kvpushd appends a publish and sends the step's "
        "batch; in-engine push posts its WRITE, which on this UCX transport copies on the engine thread); "
        "hand-over = that -> the first token (the transfer, the notices, the router's relay in pull modes, the "
        "decode engine's first step).",
        "tokens: every request against a monolithic run of the same model (computed after the timed runs).",
    ]
    return Result("sweep", data, cols, rows, lines, method, {"cells": cells, "top_qps": top, "shape": shape["name"]})


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
        fig.suptitle(f"kvpushd bench sweep --kv-shape {r.samples.get('shape', 'tiny')}: prompt {plen} tokens, "
                     f"{r.data.get('max_new_tokens')} new tokens")
        fig.tight_layout()
        shape = r.samples.get("shape", "tiny")
        path = outdir / (f"sweep_prompt{plen}.png" if shape == "tiny" else f"sweep-{shape}_prompt{plen}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        out.append(path)
    return out
