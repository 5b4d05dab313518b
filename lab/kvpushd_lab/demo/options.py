"""``kvpushd demo`` options: the bytes-mode layout, per-mode defaults and the checks of a usable set."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from ..backend import BACKENDS, available

POISON = 0x5A


@dataclass(frozen=True)
class Layout:
    layers: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    num_blocks: int

    @property
    def block_len(self) -> int:
        return self.block_size * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def regions(self) -> int:
        return self.layers * 2  # K and V per layer (vLLM's split layout)

    @property
    def region_bytes(self) -> int:
        return self.num_blocks * self.block_len

    @property
    def total_bytes(self) -> int:
        return self.regions * self.region_bytes


ENGINE_DEFAULTS = {"requests": 16, "prompt_tokens": 256, "layers": 4}
BYTES_DEFAULTS = {"requests": 64, "prompt_tokens": 1024, "layers": 16}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=("engine", "bytes"), default="engine",
                   help="engine: prefill and decode reference engines (a tiny transformer), tokens checked "
                        "against a monolithic run; bytes: stand-in workers moving random bytes (default engine)")
    p.add_argument("--requests", type=int, help="number of requests (default 16; bytes mode 64)")
    p.add_argument("--prompt-tokens", type=int, help="tokens per prompt (default 256; bytes mode 1024)")
    p.add_argument("--max-new-tokens", type=int, default=16, help="tokens each request generates (default 16)")
    p.add_argument("--prefill-tp", type=int, default=1, help="prefill engine TP size (default 1)")
    p.add_argument("--decode-tp", type=int, default=1, help="decode engine TP size (default 1)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at once (default 8)")
    p.add_argument("--layers", type=int, help="model / KV layers (default 4; bytes mode 16)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    p.add_argument("--prefill-block-size", type=int, help="tokens per block on prefill (default --block-size)")
    p.add_argument("--decode-block-size", type=int, help="tokens per block on decode (default --block-size)")
    p.add_argument("--kv-heads", type=int, default=4, help="bytes mode only (the engine's model has 4)")
    p.add_argument("--head-dim", type=int, default=64, help="bytes mode only (the engine's model has 16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--transfer-mode", choices=("push", "pull"), default="push",
                   help="push: the prefill daemon WRITEs; pull: the decode daemon READs (default push)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--workdir", help="where sockets and logs go (default: a temporary directory)")
    p.add_argument("--backend", choices=BACKENDS, default="UCX",
                   help="the daemons' NIXL backend (default UCX); LIBFABRIC needs scripts/libfabric.sh's build "
                        "(docs/efa.md) and runs its tcp provider here; engine mode")
    p.add_argument("--hosts", choices=("local", "netns"), default="local",
                   help="local (default): both nodes on this host's loopback; netns: the prefill daemon and "
                        "engine in one network namespace, the decode daemon and engine in another, joined by a "
                        "veth pair, UCX over TCP on it (needs root and iproute2; engine mode)")


def resolve(args: argparse.Namespace) -> str:
    """Fill in the mode's defaults; return an error message, or "" when the arguments are usable."""
    defaults = ENGINE_DEFAULTS if args.mode == "engine" else BYTES_DEFAULTS
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    pbs = args.prefill_block_size if args.prefill_block_size is not None else args.block_size
    dbs = args.decode_block_size if args.decode_block_size is not None else args.block_size
    if pbs != dbs and args.mode == "bytes":
        return (f"--mode bytes moves whole blocks of one size (prefill {pbs}, decode {dbs} tokens per block); "
                "use --mode engine for different block sizes")
    args.block_size = args.prefill_block_size = pbs
    args.decode_block_size = dbs
    for name in ("requests", "prompt_tokens", "max_new_tokens", "prefill_tp", "decode_tp", "concurrency",
                 "layers", "prefill_block_size", "decode_block_size", "kv_heads", "head_dim"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1"
    if args.backend != "UCX":
        if args.mode == "bytes":
            return f"--backend {args.backend} runs the engine mode (--mode engine) only"
        if why := available(args.backend):
            return why
    if args.mode == "bytes":
        if args.hosts != "local":
            return "--hosts netns runs the engine mode (--mode engine) only"
        if args.prefill_tp != 1 or args.decode_tp != 1:
            return "--mode bytes runs TP1 -> TP1 only; use --mode engine for --prefill-tp/--decode-tp"
        return ""
    from kvpushd.core.errors import InvalidArgument
    from kvpushd.core.topology import check_tp_pair

    kv_heads = 4  # TinyConfig.num_kv_heads: the engine's TP sizes must divide it
    for name, tp in (("prefill", args.prefill_tp), ("decode", args.decode_tp)):
        if kv_heads % tp:
            return f"--{name}-tp {tp}: the reference model has {kv_heads} KV heads; use a TP size dividing it"
    try:
        check_tp_pair(args.prefill_tp, args.decode_tp)
    except InvalidArgument as e:
        return str(e)
    if args.prompt_tokens + args.max_new_tokens > 4096:
        return "--prompt-tokens + --max-new-tokens must be at most 4096 (the reference model's positions)"
    return ""


# ---------------------------------------------------------------------------------------------
