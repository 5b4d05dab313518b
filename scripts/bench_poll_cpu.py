"""CPU of two kvpushd daemons: idle, with one Expect waiting (the decode daemon polling NIXL) during
its first ``transfer.poll_hot_s`` (the short period) and after it (backed off), with a new Expect
every 100 ms (a decode node in use: always hot), and with a progressive publish declared and met whose
prefill step is still computing (the prefill daemon's NIXL thread watching the worker's doorbell).

Run from the repository root: ``python scripts/bench_poll_cpu.py [POLL_HOT_S [POLL_INTERVAL_S]]``; prints one JSON
object.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
from kvpushd_client import Expect, Publish, Role
from support import make_kv, start_daemon  # tests/support: the test helpers (daemons via kvpushd_lab.launch)

from kvpushd.config import TransferConfig


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percent(pids: list[int], seconds: float, every_100ms: Callable[[], None] | None = None) -> list[float]:
    """CPU of each process over ``seconds``, sleeping, or calling ``every_100ms`` that often meanwhile."""
    before = [cpu_s(p) for p in pids]
    t0 = time.monotonic()
    if every_100ms is None:
        time.sleep(seconds)
    else:
        while time.monotonic() < t0 + seconds:
            every_100ms()
            time.sleep(0.1)
    dt = time.monotonic() - t0
    return [round(100 * (cpu_s(p) - b) / dt, 2) for p, b in zip(pids, before, strict=True)]


def main() -> None:
    hot = float(sys.argv[1]) if len(sys.argv) > 1 else 2.0
    interval = float(sys.argv[2]) if len(sys.argv) > 2 else TransferConfig().poll_interval_s  # the default
    with tempfile.TemporaryDirectory() as d:
        cfg = (f"[transfer]\nexpect_timeout_s = 300.0\npublish_timeout_s = 300.0\npoll_hot_s = {hot}\n"
               f"poll_interval_s = {interval}\n")
        p = start_daemon(Path(d), "pnode", cfg)
        dn = start_daemon(Path(d), "dnode", cfg)
        src, dst = make_kv("poll-cpu-src"), make_kv("poll-cpu-dst", fill="poison")
        try:
            pw = p.client.attach("prefill", Role.PRODUCER, 0, 1, [src.buf.memory], src.region_list, doorbell=True)
            dw = dn.client.attach("decode", Role.CONSUMER, 0, 1, [dst.buf.memory], dst.region_list)
            time.sleep(2)
            idle = percent([p.proc.pid, dn.proc.pid], 10)
            dw.send(Expect("wait", (1,), p.peer_address, "prefill", 1))  # the prefill never publishes it
            hot_window = percent([p.proc.pid, dn.proc.pid], hot) if hot >= 0.5 else [0.0, 0.0]
            time.sleep(1)
            waiting = percent([p.proc.pid, dn.proc.pid], 10)
            n = itertools.count(1)
            # a decode node in use: a new Expect every 100 ms
            busy = percent([p.proc.pid, dn.proc.pid], 10, lambda: dw.send(Expect(
                f"more-{(i := next(n))}", (2 + i % 60,), p.peer_address, "prefill", 1)))
            # a long forward: the publish is declared and its registration there, no layer rung yet
            assert pw.doorbell is not None
            dw.send_nowait(Expect("bell", (62,), p.peer_address, "prefill", 1))
            dw.step()
            pw.send(Publish("bell", (62,), step=pw.doorbell.step(), layers=4))
            time.sleep(1)
            bell = percent([p.proc.pid, dn.proc.pid], 10)
            pw.doorbell.seal()
            print(json.dumps({"poll_hot_s": hot, "poll_interval_s": interval,
                              "idle_cpu_pct": {"prefill": idle[0], "decode": idle[1]},
                              "declared_watching_doorbell_cpu_pct": {"prefill": bell[0], "decode": bell[1]},
                              "one_expect_hot_window_cpu_pct": {"prefill": hot_window[0], "decode": hot_window[1]},
                              "one_expect_waiting_cpu_pct": {"prefill": waiting[0], "decode": waiting[1]},
                              "new_expect_every_100ms_cpu_pct": {"prefill": busy[0], "decode": busy[1]},
                              "loadavg": os.getloadavg()[0]}))
        finally:
            for x in (p, dn):
                x.client.close()
                x.stop()
            src.close()
            dst.close()


if __name__ == "__main__":
    main()
