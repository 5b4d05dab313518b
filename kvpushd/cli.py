"""Console scripts: ``kvpushd`` (serve, demo, version) and ``kvpushctl`` (inspection)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from . import __version__


def _serve(args: argparse.Namespace) -> int:
    from . import config, log
    from .app import Daemon
    from .core.errors import KvpushdError

    try:
        cfg = config.load(args.config)
        if args.socket or args.listen or args.node_id:
            cfg = dataclasses.replace(
                cfg,
                worker_api=dataclasses.replace(cfg.worker_api, socket=args.socket or cfg.worker_api.socket),
                peer_api=dataclasses.replace(cfg.peer_api, listen=args.listen or cfg.peer_api.listen),
                node=dataclasses.replace(cfg.node, node_id=args.node_id or cfg.node.node_id),
            )
            config.validate(cfg)
    except KvpushdError as e:
        print(f"kvpushd: {e}", file=sys.stderr)
        return 2
    log.setup(cfg.log.level, cfg.log.format)
    import uvloop

    # The event loop and the NIXL thread share the GIL; a waiting thread gets it back only after
    # the switch interval (5 ms by default), which would throttle transfer progress and add
    # milliseconds to every completion.
    sys.setswitchinterval(0.0002)
    try:
        uvloop.run(Daemon(cfg).run())
    except KvpushdError as e:
        print(f"kvpushd: {e}", file=sys.stderr)
        return 1
    # Everything is released by now (memory deregistered and unmapped, sockets removed, "stopped"
    # logged): skip the interpreter's teardown, whose final garbage collection over torch's object
    # graph (nixl imports torch) took seconds and delayed the exit that SIGTERM asked for.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvpushd", description="KV-cache push sidecar for disaggregated LLM serving")
    ap.add_argument("--version", action="version", version=f"kvpushd {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run the daemon")
    s.add_argument("--config", help="TOML config file (every key has a default)")
    s.add_argument("--socket", help="override worker_api.socket")
    s.add_argument("--listen", help="override peer_api.listen (host:port)")
    s.add_argument("--node-id", help="override node.node_id")
    d = sub.add_parser("demo", help="local prefill/decode demo: two daemons, reference engines, real NIXL WRITEs")
    from .demo import add_args

    add_args(d)
    b = sub.add_parser("bench", add_help=False, help="benchmarks: ceiling, critical-path, engine-cost, rate, sweep "
                       "(kvpushd bench --help)")
    b.add_argument("bench_args", nargs=argparse.REMAINDER)
    args, extra = ap.parse_known_args(argv)
    if args.cmd == "bench":  # kvpushd.bench parses its own options; imported only when used
        from .bench import main as bench_main

        return bench_main(extra + args.bench_args)
    if extra:
        ap.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.cmd == "serve":
        return _serve(args)
    from .demo import run_demo

    return run_demo(args)


def ctl_main(argv: list[str] | None = None) -> int:
    from .ctl import main as ctl

    return ctl(argv)
