"""Where each daemon's CPU goes during ``kvpushd bench rate``: per thread, per rendezvous.

    python scripts/cpu_split.py [--seconds 12] [--window 5] [--rounds 3] [--json]

Runs the bench (its two daemons, one worker stream per side), waits until the bench's warm-up is
over, then reads every thread of both daemons from /proc twice, ``--window`` seconds apart. A thread
is the event loop (the daemon's main thread), ``kvpushd-nixl`` (the NIXL thread, named for the
kernel), gRPC's own (``event_engine``, ``grpc_global_tim``, ``lifeguard``, ...), or other (the
default executor, UCX's). Per rendezvous: the thread's CPU in the window over the rendezvous the
bench completed per second times the window (the bench's rate, measured over its own window).
The figures are CPU time (user + system), so they hold on a loaded machine too; the load is printed.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HZ = os.sysconf("SC_CLK_TCK")
GRPC = ("event_engine", "grpc_global_tim", "lifeguard", "async", "grpc")


def threads(pid: int) -> dict[int, tuple[str, int]]:
    """tid -> (comm, user + system ticks) for every thread of ``pid`` (gone: empty)."""
    out = {}
    for t in glob.glob(f"/proc/{pid}/task/*"):
        try:
            comm = Path(f"{t}/comm").read_text().strip()
            fields = Path(f"{t}/stat").read_text().rsplit(")", 1)[1].split()
            out[int(t.rsplit("/", 1)[1])] = (comm, int(fields[11]) + int(fields[12]))
        except (OSError, ValueError, IndexError):
            continue
    return out


def kind(pid: int, tid: int, comm: str) -> str:
    if tid == pid:
        return "event loop"
    if comm == "kvpushd-nixl":
        return "nixl thread"
    if comm.startswith(GRPC):
        return "grpc"
    return "other"


def daemons() -> dict[str, int]:
    """The bench's daemons: their config's name (bench-pnode / bench-dnode) -> pid."""
    out = {}
    for c in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            argv = Path(c).read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in argv and b"--config" in argv and b"kvpushd" in b" ".join(argv):
            cfg = argv[argv.index(b"--config") + 1].decode()
            if "bench-" in cfg:
                out[os.path.basename(cfg).rsplit(".", 1)[0]] = int(c.split("/")[2])
    return out


def one_round(args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "kvpushd", "bench", "rate", "--json", "--seconds", str(args.seconds)]
    bench = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + 120
    pids: dict[str, int] = {}
    while len(pids) < 2 and time.monotonic() < deadline and bench.poll() is None:
        time.sleep(0.2)
        pids = daemons()
    time.sleep(args.settle)  # daemons start, the bench warms up
    before = {n: threads(p) for n, p in pids.items()}
    load = os.getloadavg()[0]
    t0 = time.monotonic()
    time.sleep(args.window)
    after = {n: threads(p) for n, p in pids.items()}
    window = time.monotonic() - t0
    out, _ = bench.communicate(timeout=600)
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if bench.returncode != 0 or not lines:
        raise SystemExit(f"bench rate exited {bench.returncode}")
    rate = json.loads(lines[-1])["rate_per_s"]
    res: dict[str, Any] = {"rate_per_s": rate, "window_s": round(window, 2), "load1": round(load, 2)}
    for name, pid in pids.items():
        split: dict[str, float] = {}
        for tid, (comm, ticks) in after[name].items():
            d = ticks - before[name].get(tid, (comm, 0))[1]
            split[kind(pid, tid, comm)] = split.get(kind(pid, tid, comm), 0.0) + d / HZ
        per = {k: round(v / (rate * window) * 1e6, 1) for k, v in sorted(split.items())}
        res[name] = {"cpu_us_per_rendezvous": per, "total_us": round(sum(per.values()), 1),
                     "share": {k: round(v / max(sum(split.values()), 1e-9), 3) for k, v in sorted(split.items())}}
    return res


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=12.0, help="the bench's measuring window")
    ap.add_argument("--settle", type=float, default=4.0, help="seconds after the daemons are up before reading")
    ap.add_argument("--window", type=float, default=5.0, help="seconds between the two readings")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rounds = [one_round(args) for _ in range(args.rounds)]
    if args.json:
        print(json.dumps({"rounds": rounds}))
        return 0
    for r in rounds:
        print(f"rate {r['rate_per_s']:.0f}/s, load {r['load1']}, window {r['window_s']} s")
        for name in sorted(k for k in r if k.startswith("bench-")):
            d = r[name]
            parts = ", ".join(f"{k} {v} us ({d['share'][k]:.0%})" for k, v in d["cpu_us_per_rendezvous"].items())
            print(f"  {name}: {d['total_us']} us per rendezvous: {parts}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
