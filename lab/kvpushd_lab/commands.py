"""The lab's subcommands of ``kvpushd``: ``demo`` and ``bench``.

Registered as the ``kvpushd.commands`` entry point ``lab`` (see lab/pyproject.toml); ``kvpushd`` calls
``register`` with its subparsers. Each subparser sets ``run_command(args, extra) -> int`` (and
``takes_extra=True`` when it parses the remaining arguments itself). Only argparse
work happens here: the demo and the benchmarks (torch, numpy) are imported when they run.
"""

from __future__ import annotations

import argparse
from typing import Any


def _run_demo(args: argparse.Namespace, extra: list[str]) -> int:
    from .demo import run_demo

    return run_demo(args)


def _run_bench(args: argparse.Namespace, extra: list[str]) -> int:
    from .bench import main as bench_main  # parses its own options

    return bench_main(extra + args.bench_args)


def register(sub: Any) -> None:
    """Add ``demo`` and ``bench`` to an ``argparse`` subparsers object."""
    from .demo.options import add_args

    d = sub.add_parser("demo", help="local prefill/decode demo: two daemons, reference engines, real NIXL WRITEs")
    add_args(d)
    d.set_defaults(run_command=_run_demo)
    b = sub.add_parser("bench", add_help=False, help="benchmarks: ceiling, critical-path, engine-cost, fleet, rate, "
                       "sweep (kvpushd bench --help)")
    b.add_argument("bench_args", nargs=argparse.REMAINDER)
    b.set_defaults(run_command=_run_bench, takes_extra=True)


def main(argv: list[str] | None = None) -> int:
    """``kvpushd-lab demo|bench ...``: the same commands without the daemon's CLI."""
    ap = argparse.ArgumentParser(prog="kvpushd-lab", description="kvpushd's demo and benchmarks")
    register(ap.add_subparsers(dest="cmd", required=True))
    args, extra = ap.parse_known_args(argv)
    if extra and not getattr(args, "takes_extra", False):
        ap.error(f"unrecognized arguments: {' '.join(extra)}")
    return int(args.run_command(args, extra))


if __name__ == "__main__":
    raise SystemExit(main())
