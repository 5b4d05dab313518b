"""Console scripts: ``kvpushd`` (serve, version; demo and bench from kvpushd-lab) and ``kvpushctl`` (inspection)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

from . import __version__


def _serve(args: argparse.Namespace) -> int:
    from . import config, log
    from .app import Daemon
    from .core.errors import KvpushdError
    from .memory.fdpass import raise_fd_limit

    try:
        overrides = {"worker_api.socket": args.socket, "peer_api.listen": args.listen, "node.node_id": args.node_id}
        cfg = config.load(args.config, {k: v for k, v in overrides.items() if v})
    except KvpushdError as e:
        print(f"kvpushd: {e}", file=sys.stderr)
        return 2
    log.setup(cfg.log.level, cfg.log.format)
    raise_fd_limit()
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


LAB_HINT = ("kvpushd {cmd}: the demo and the benchmarks live in the kvpushd-lab distribution, which is not "
            "installed: pip install -e ./lab (from a source checkout; `make demo` does it)")


def _command_registrars() -> list[Callable[[Any], None]]:
    """Functions that add subcommands (``demo``, ``bench``) from other distributions: the
    ``kvpushd.commands`` entry points of what is installed. kvpushd itself never imports the lab."""
    from importlib.metadata import entry_points

    found = []
    for ep in entry_points(group="kvpushd.commands"):
        try:
            found.append(ep.load())
        except ImportError:  # a stale entry point (its distribution removed): skip it
            continue
    return found


def _missing_lab(args: argparse.Namespace, extra: list[str]) -> int:
    print(LAB_HINT.format(cmd=args.cmd), file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="kvpushd", description="KV-cache push sidecar for disaggregated LLM serving")
    ap.add_argument("--version", action="version", version=f"kvpushd {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run the daemon")
    s.add_argument("--config", help="TOML config file (every key has a default)")
    s.add_argument("--socket", help="override worker_api.socket")
    s.add_argument("--listen", help="override peer_api.listen (host:port)")
    s.add_argument("--node-id", help="override node.node_id")
    s.set_defaults(run_command=lambda args, extra: _serve(args))
    first = next((a for a in argv if not a.startswith("-")), None)
    if first != "serve":  # `kvpushd serve` never looks for the lab
        for register in _command_registrars():
            register(sub)
    for cmd in ("demo", "bench"):
        if cmd not in sub.choices:
            m = sub.add_parser(cmd, add_help=False, help="needs kvpushd-lab (pip install -e ./lab)")
            m.add_argument("rest", nargs=argparse.REMAINDER)
            m.set_defaults(run_command=_missing_lab, takes_extra=True)
    args, extra = ap.parse_known_args(argv)
    if extra and not getattr(args, "takes_extra", False):
        ap.error(f"unrecognized arguments: {' '.join(extra)}")
    return int(args.run_command(args, extra))


def ctl_main(argv: list[str] | None = None) -> int:
    from .ctl import main as ctl

    return ctl(argv)
