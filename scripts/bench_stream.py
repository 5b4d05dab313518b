"""Control-path cost of the worker API: one Stream message per engine step.

Two real daemons, real NIXL (4 KiB per request). Each round is one "engine step" of B requests on
each side: decode queues B Expects, prefill queues B Publishes; the round ends when all 2B
completions are back. Prints one JSON object per mode with rendezvous/s, the engine thread's time
per step (what queueing the step's calls costs the caller: appends plus step()) and daemon CPU per
rendezvous. (The unary worker calls it was once compared with are gone: protocol 5.)

    python scripts/bench_stream.py [--batch 8] [--rounds 200] [--profile DIR]

``--profile DIR``: py-spy samples both daemons during the timed rounds (collapsed stacks in
DIR/<mode>-<side>.txt) and the JSON gets each daemon's top functions by own time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
from kvpushd_client import Expect, Publish, Role
from pyspy_summary import top_self  # scripts/: run as python scripts/bench_stream.py
from support import make_kv, start_daemon  # tests/support: the test helpers (daemons via kvpushd_lab.launch)


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def spy(pid: int, out: Path) -> subprocess.Popen[bytes]:
    exe = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    return subprocess.Popen([exe, "record", "--format", "raw", "--rate", "250", "--threads", "--nonblocking",
                             "-o", str(out), "--pid", str(pid)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def run(mode: str, batch: int, rounds: int, profile: Path | None = None) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as d:
        cfg = "[transfer]\nexpect_timeout_s = 60.0\npublish_timeout_s = 60.0\n"
        p = start_daemon(Path(d), "pnode", cfg)
        dn = start_daemon(Path(d), "dnode", cfg)
        src, dst = make_kv("bench-stream-src", num_blocks=2 * batch), make_kv("bench-stream-dst", num_blocks=2 * batch)
        pw = p.client.attach("prefill", Role.PRODUCER, 0, 1, [src.buf.memory], src.region_list)
        dw = dn.client.attach("decode", Role.CONSUMER, 0, 1, [dst.buf.memory], dst.region_list)
        step_us: list[float] = []

        def step(w) -> None:  # type: ignore[no-untyped-def]
            w.step()

        def one_round(r: int) -> None:
            t0 = time.perf_counter()
            for i in range(batch):
                dw.send_nowait(Expect(f"r{r}-{i}", (i,), p.peer_address, "prefill", 1))
            step(dw)
            step_us.append((time.perf_counter() - t0) * 1e6)
            t0 = time.perf_counter()
            for i in range(batch):
                pw.send_nowait(Publish(f"r{r}-{i}", (i,)))
            step(pw)
            step_us.append((time.perf_counter() - t0) * 1e6)
            got = 0
            while got < 2 * batch:
                got += len(dw.completions()) + len(pw.completions())
                if got < 2 * batch:
                    time.sleep(0.0002)

        for r in range(10):  # warm-up
            one_round(-1 - r)
        step_us.clear()
        spies = [(side, spy(x.proc.pid, profile / f"{mode}-{side}.txt")) for side, x in (("prefill", p), ("decode", dn))
                 ] if profile is not None else []
        if spies:
            time.sleep(1.0)  # py-spy attaches
        c0 = (cpu_s(p.proc.pid), cpu_s(dn.proc.pid))
        t0 = time.monotonic()
        for r in range(rounds):
            one_round(r)
        wall = time.monotonic() - t0
        c1 = (cpu_s(p.proc.pid), cpu_s(dn.proc.pid))
        n = rounds * batch
        out = {"mode": mode, "batch": batch, "rounds": rounds, "rendezvous_per_s": round(n / wall, 1),
               "engine_step_us": {"p50": round(pct(step_us, 0.5), 1), "p99": round(pct(step_us, 0.99), 1)},
               "daemon_cpu_us_per_rendezvous": {"prefill": round((c1[0] - c0[0]) / n * 1e6, 1),
                                                "decode": round((c1[1] - c0[1]) / n * 1e6, 1)},
               "loadavg": os.getloadavg()[0]}
        for side, sp in spies:
            sp.send_signal(signal.SIGINT)
            sp.wait(30)
            assert profile is not None
            out[f"profile_{side}_self_pct"] = top_self(profile / f"{mode}-{side}.txt")
        for w in (pw, dw):
            w.detach()
        for x in (p, dn):
            x.client.close()
            x.stop()
        src.close()
        dst.close()
        return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--modes", default="stream,stream", help="runs, comma-separated (stream only)")
    ap.add_argument("--profile", type=Path, default=None, help="py-spy both daemons into this directory")
    a = ap.parse_args()
    if a.profile is not None:
        a.profile.mkdir(parents=True, exist_ok=True)
    for mode in a.modes.split(","):
        if mode != "stream":
            ap.error(f"--modes: {mode!r}: only stream is served (protocol 5)")
        print(json.dumps(run(mode, a.batch, a.rounds, a.profile)), flush=True)


if __name__ == "__main__":
    main()
