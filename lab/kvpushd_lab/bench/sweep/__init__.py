"""``sweep``: TTFT and TPOT over a QPS x prompt-length grid with the reference engines.

Modes (``--modes``):

* ``kvpushd-push``: the engines use ``KVPushdHooks`` on two daemons; the router sends each request
  to both engines at once, decode Expects its blocks as soon as they are allocated, prefill declares
  its Publish before the forward (progressive push) and the prefill daemon WRITEs as the doorbell
  says, a layer group per model layer (with ``--kv-shape qwen3-32b-tp8`` each group carries its share
  of the extra regions, written as its layer is done);
* ``kvpushd-whole`` (not in the default list): ``kvpushd-push`` with the Publish sent once prefill
  is done, after the forward;
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

``--kv-shape`` (``shape``): ``tiny`` moves the tiny model's own KV; ``qwen3-32b-tp8`` moves, per
request, the KV of one TP8 rank of Qwen3-32B (128 regions, 32 KiB per token) around the tiny model's
compute, so descriptor counts and bytes are those of the published benchmark.

The package: ``engines`` (the engine processes), ``cells`` (arrivals, the router, per-cell figures),
``shape`` (KV shapes and their check), ``report`` (targets, table, plots).
"""

from __future__ import annotations

import argparse
import inspect
from pathlib import Path
from typing import Any

from ..common import BenchError, Result, progress
from .cells import Req, references, run_all
from .engines import config
from .report import DEFAULT_MODES, MODES, TARGET_RATIO, plot_sweep, result
from .shape import KV_SHAPES, describe

__all__ = ["MODES", "TARGET_RATIO", "add_args", "kvpushd_pull_available", "plot_sweep", "run"]


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
    p.add_argument("--modes", default=",".join(DEFAULT_MODES),
                   help=f"comma separated, of {', '.join(MODES)} (default {', '.join(DEFAULT_MODES)})")
    p.add_argument("--max-new-tokens", type=int, default=16, help="tokens each request generates (default 16)")
    p.add_argument("--layers", type=int, default=2, help="model layers (default 2)")
    p.add_argument("--kv-heads", type=int, default=1,
                   help="query and KV heads of the model (head_dim = 128 / heads; default 1: prefill of 1k "
                        "tokens costs tens of ms on a small CPU, attention is quadratic in the prompt); "
                        "--kv-shape tiny only")
    p.add_argument("--kv-shape", choices=KV_SHAPES, default="tiny",
                   help="KV each request moves: tiny (the model's own, default) or qwen3-32b-tp8 (one TP8 rank of "
                        "Qwen3-32B: 128 regions, 32 KiB per token, the tiny model computing)")
    p.add_argument("--kv-slots", type=int, default=0,
                   help="requests' worth of blocks (of the longest prompt) per engine; 0 (default): min(requests, "
                        "64) + 2 for tiny, what --kv-memory-gib allows for bigger shapes")
    p.add_argument("--kv-memory-gib", type=float, default=6.0,
                   help="shared memory all engines' KV caches may take together when --kv-slots is 0 (default 6)")
    p.add_argument("--warmup", type=int, default=2, help="untimed requests per mode and prompt length (default 2)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="decode engine's running batch at most (default 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cell-timeout", type=float, default=180.0,
                   help="seconds without progress before a cell's remaining requests count as failed (default 180)")


def kvpushd_pull_available() -> bool:
    """Whether the installed ``KVPushdHooks`` takes ``transfer_mode`` (kvpushd's pull mode)."""
    from ...refengine import KVPushdHooks

    try:
        return all("transfer_mode" in inspect.signature(f).parameters
                   for f in (KVPushdHooks.attach, KVPushdHooks.__init__))
    except (TypeError, ValueError):
        return False


def _slots(args: argparse.Namespace, shape: dict[str, Any], decode_blocks: int, engines: int) -> int:
    most = min(int(args.requests), 64) + 2
    if args.kv_slots > 0:
        return int(args.kv_slots)
    if shape["name"] == "tiny":
        return most
    per_request = decode_blocks * int(shape["regions"]) * int(shape["block_len"])
    return max(2, min(most, int(args.kv_memory_gib * 2**30 // (max(1, engines) * per_request))))


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
    if args.kv_shape != "tiny" and args.kv_heads != 1:
        raise BenchError(f"--kv-heads is for --kv-shape tiny (the {args.kv_shape} shape fixes the model's heads)")
    max_len = max(args.prompt_lens)
    spec: dict[str, Any] = {"layers": args.layers, "heads": args.kv_heads, "seed": args.seed,
                            "max_positions": max(4096, max_len + args.max_new_tokens),
                            "max_num_seqs": args.max_num_seqs, "kv_shape": args.kv_shape}
    cfg = config(spec)
    shape = describe(args.kv_shape, cfg)
    spec.update(vocab=cfg.vocab_size, kv=shape, regions=shape["regions"], block_len=shape["block_len"],
                block_tokens=shape["block_tokens"], cfg_heads=cfg.num_heads, cfg_kv_heads=cfg.num_kv_heads,
                cfg_head_dim=cfg.head_dim, cfg_hidden=cfg.hidden_size)
    status: dict[str, dict[str, Any]] = {}
    runnable = []
    for m in modes:
        if m == "kvpushd-pull" and not kvpushd_pull_available():
            status[m] = {"status": "unavailable: KVPushdHooks has no transfer_mode option yet (kvpushd pull mode "
                                   "not installed)"}
            progress(f"sweep: {m} unavailable (KVPushdHooks takes no transfer_mode)")
        else:
            runnable.append(m)
    decode_blocks = cfg.blocks_for(max_len + args.max_new_tokens - 1)
    slots = spec["slots"] = _slots(args, shape, decode_blocks, 2 * len(runnable))
    spec["prefill_blocks"] = cfg.blocks_for(max_len) * slots
    spec["decode_blocks"] = decode_blocks * slots
    per_req = shape["regions"] * shape["block_len"] * cfg.blocks_for(max_len)
    total = (spec["prefill_blocks"] + spec["decode_blocks"]) * shape["regions"] * shape["block_len"] * len(runnable)
    progress(f"sweep: modes {runnable}, prompt lengths {args.prompt_lens}, QPS {args.qps}, {args.requests} requests "
             f"per cell, {args.max_new_tokens} new tokens, model {args.layers} layers x {cfg.num_kv_heads} KV heads "
             f"x {cfg.head_dim}; KV shape {args.kv_shape}: {shape['regions']} regions, {per_req / 2**20:.1f} MiB per "
             f"{max_len}-token request; {slots} requests' worth of blocks per engine, {total / 2**30:.2f} GiB of "
             "shared memory in all")
    cells: list[dict[str, Any]] = []
    all_reqs: list[Req] = []
    if runnable:
        status.update(run_all(args, runnable, workdir, spec, cells, all_reqs))
    progress(f"sweep: computing monolithic reference tokens for {len({r.key for r in all_reqs})} prompts")
    refs = references(cfg, args.seed, all_reqs, args.max_new_tokens)
    for c in cells:
        mine = [r for r in all_reqs if r.rid.startswith(f"{c['mode']}-{c['prompt_len']}-{c['qps']:g}-")]
        mism = sum(1 for r in mine if not r.ok or r.tokens != refs[r.key])
        c["tokens_mismatched"] = mism
        c["tokens_match"] = mism == 0
    return result(args, modes, status, cells, spec)
