"""What every suite shares: daemons as subprocesses, KV layouts in shared memory, statistics, output.

Daemons run as real ``kvpushd serve`` processes on unix sockets in a temporary directory (the same
way the tests and the demo start them); workers attach through ``kvpushd_client`` from the bench
process. Every clock read across processes is ``time.monotonic_ns()`` (CLOCK_MONOTONIC, one clock
for every process on the machine), so timestamps taken in different processes compare directly.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from kvpushd_client import Region, SealedBuffer

from kvpushd.config import TransferConfig

from .. import launch

POISON = 0x5A
DEFAULT_POLL_US = TransferConfig().poll_interval_s * 1e6  # the daemons' transfer.poll_interval_s by default


class BenchError(Exception):
    """A benchmark could not run (a daemon did not start, a transfer failed, a missing package)."""


def progress(msg: str) -> None:
    """Progress goes to stderr, so stdout stays one table or one JSON object."""
    print(msg, file=sys.stderr, flush=True)


# -- layouts ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """Per-rank KV layout in vLLM's split form: ``layers`` x (K, V) regions of ``num_blocks`` blocks."""

    layers: int = 64
    kv_heads: int = 1  # per rank: Qwen3-32B has 8 KV heads, over TP8
    head_dim: int = 128
    dtype_bytes: int = 2  # bf16
    block_tokens: int = 16
    num_blocks: int = 1024

    @property
    def regions(self) -> int:
        return 2 * self.layers

    @property
    def block_len(self) -> int:
        return self.block_tokens * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def region_bytes(self) -> int:
        return self.num_blocks * self.block_len

    @property
    def total_bytes(self) -> int:
        return self.regions * self.region_bytes

    def blocks_for(self, tokens: int) -> int:
        return max(1, -(-tokens // self.block_tokens))

    def region_list(self) -> list[Region]:
        return [Region(0, i * self.region_bytes, self.num_blocks, self.block_len) for i in range(self.regions)]

    def describe(self) -> dict[str, int]:
        return {"layers": self.layers, "regions": self.regions, "kv_heads_per_rank": self.kv_heads,
                "head_dim": self.head_dim, "dtype_bytes": self.dtype_bytes, "block_tokens": self.block_tokens,
                "block_len": self.block_len, "num_blocks": self.num_blocks}


class KVMemory:
    """A worker's KV memory in a sealed memfd, viewed as (regions, blocks, block_len) bytes."""

    def __init__(self, prefix: str, layout: Layout, fill: int | None = None, seed: int = 0) -> None:
        self.layout = layout
        self.buf = SealedBuffer.create(prefix, layout.total_bytes)
        self.arr: npt.NDArray[np.uint8] = np.frombuffer(self.buf.mmap, dtype=np.uint8).reshape(
            layout.regions, layout.num_blocks, layout.block_len)
        if fill is None:  # random-ish bytes, cheaply: one random block repeated, salted per block and region;
            # never POISON, so a destination byte that still reads POISON was not written
            pattern = np.random.default_rng(seed).integers(1, 256, layout.block_len, dtype=np.uint8)
            pattern[pattern == POISON] = POISON + 1
            self.arr[:] = pattern
            self.arr[:, :, 0] = (np.arange(layout.num_blocks) % 89 + 1).astype(np.uint8)
            self.arr[:, 0, 1] = (np.arange(layout.regions) % 89 + 1).astype(np.uint8)
        else:
            self.arr[:] = fill  # touches every page, so no transfer pays for first-touch faults

    @property
    def name(self) -> str:
        """The path by which a child process opens it (SealedBuffer.open)."""
        return self.buf.path

    def close(self) -> None:
        del self.arr
        self.buf.close()


# -- daemons ---------------------------------------------------------------------------------------

DaemonProc = launch.Daemon  # started by the one launcher (kvpushd_lab.launch), as the tests and the demo do


def _settings(log_level: str) -> dict[str, dict[str, object]]:
    return {"log": {"level": log_level, "format": "json"}, "metrics": {"listen": "127.0.0.1:0"}}


def _ready(d: DaemonProc) -> DaemonProc:
    try:
        return launch.wait_ready(d, 90)
    except launch.DaemonStartError as e:
        raise BenchError(str(e)) from None


def _spawn_daemon(workdir: Path, name: str, log_level: str = "info", extra_config: str = "",
                  peer_api: dict[str, object] | None = None) -> DaemonProc:
    settings = _settings(log_level)
    if peer_api:
        settings["peer_api"] = dict(peer_api)
    return launch.spawn(workdir, name, settings=settings, extra_config=extra_config)


def start_daemon(workdir: Path, name: str, log_level: str = "info", extra_config: str = "") -> DaemonProc:
    return _ready(_spawn_daemon(workdir, name, log_level, extra_config))


@contextlib.contextmanager
def daemon_pair(workdir: Path, prefill_log_level: str = "info", transfer: dict[str, float] | None = None,
                backend: str = "UCX") -> Iterator[tuple[DaemonProc, DaemonProc]]:
    """A prefill-node daemon and a decode-node daemon, stopped (SIGTERM, drain) on exit.

    ``transfer``: settings of the daemons' [transfer] section (for example poll_interval_s);
    ``backend``: their NIXL backend (``kvpushd_lab.backend``).
    """
    section = {"publish_timeout_s": 60.0, "expect_timeout_s": 60.0,
               **{k: float(v) for k, v in (transfer or {}).items()}}
    # Both start at once: each spends seconds importing NIXL and torch.
    ps = launch.spawn(workdir, "bench-pnode", settings={**_settings(prefill_log_level), "transfer": section},
                      backend=backend)
    ds = launch.spawn(workdir, "bench-dnode", settings={**_settings("info"), "transfer": section}, backend=backend)
    try:
        p = _ready(ps)
    except BaseException:
        ds.proc.kill()
        raise
    try:
        d = _ready(ds)
    except BaseException:
        p.shutdown()
        raise
    try:
        yield p, d
    finally:
        launch.stop_all([d, p])


def wait_registered(p: DaemonProc, transfer_id: str, timeout_s: float = 10.0, interval_s: float = 0.01) -> None:
    """Wait until the prefill daemon holds the decode side's registration for ``transfer_id``.

    GetStatus costs the daemon ~0.5 ms of CPU (it describes every region of every worker), so
    it is asked rarely: the Register call between the daemons takes a few milliseconds.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(interval_s)
        if any(t.transfer_id == transfer_id and t.side == "send" for t in p.client.status().transfers):
            return
    raise BenchError(f"registration of {transfer_id!r} did not reach the prefill daemon in {timeout_s:g} s")


# -- processes and the machine ---------------------------------------------------------------------


def sched_ns(pid: int) -> tuple[int, int]:
    """(ns running on a CPU, ns runnable but waiting for one), summed over the process's threads.

    From /proc/PID/task/*/schedstat: the second figure is what machine load costs the process.
    """
    run = wait = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0, 0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                parts = f.read().split()
        except OSError:
            continue
        run += int(parts[0])
        wait += int(parts[1])
    return run, wait


def python_loop_ns(n: int = 200_000) -> float:
    """CPU ns per iteration of a trivial Python loop: how fast this CPU runs Python, load aside."""
    c0 = time.thread_time_ns()
    x = 0
    for i in range(n):
        x += i
    return round((time.thread_time_ns() - c0) / n, 1)


def machine_load() -> dict[str, Any]:
    """What else the machine was doing: load averages against the number of CPUs, and CPU speed."""
    one, five, fifteen = os.getloadavg()
    return {"loadavg_1m": round(one, 2), "loadavg_5m": round(five, 2), "loadavg_15m": round(fifteen, 2),
            "cpus": os.cpu_count() or 0, "python_loop_ns": python_loop_ns()}


def load_text(load: dict[str, Any]) -> str:
    return (f"machine load: {load['loadavg_1m']} / {load['loadavg_5m']} / {load['loadavg_15m']} (1/5/15 min) "
            f"on {load['cpus']} CPUs; CPU speed: {load['python_loop_ns']} ns of CPU per trivial Python loop "
            "iteration (to compare machines)")


# -- statistics ------------------------------------------------------------------------------------


def pct(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]); 0.0 for no values."""
    if not values:
        return 0.0
    s = sorted(values)
    return float(s[min(len(s) - 1, max(0, int(np.ceil(q * len(s))) - 1))])


def dist(values: Sequence[float], digits: int = 1) -> dict[str, float]:
    """p50, p99, mean, max and the count."""
    if not values:
        return {"p50": 0.0, "p99": 0.0, "mean": 0.0, "max": 0.0, "n": 0}
    return {"p50": round(pct(values, 0.5), digits), "p99": round(pct(values, 0.99), digits),
            "mean": round(float(np.mean(values)), digits), "max": round(float(max(values)), digits),
            "n": len(values)}


def met(value: float, target: float, higher_is_better: bool) -> str:
    ok = value >= target if higher_is_better else value <= target
    return "met" if ok else "MISSED"


def median(values: Sequence[float]) -> float:
    return float(np.median(values)) if len(values) else 0.0


# -- results ---------------------------------------------------------------------------------------


Column = tuple[str, str, str]  # (key in a row, header, format spec)


@dataclass
class Result:
    """One suite's figures: the JSON object, the table and the samples the plots draw."""

    suite: str
    data: dict[str, Any]
    columns: list[Column] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)  # headline figures with their targets
    method: list[str] = field(default_factory=list)  # how each figure was measured
    samples: dict[str, Any] = field(default_factory=dict)  # for plots only, not in the JSON

    def to_json(self) -> str:
        return json.dumps({"suite": self.suite, **self.data, "method": " ".join(self.method)})

    def table(self) -> str:
        out = [f"kvpushd bench {self.suite}"]
        if self.rows and self.columns:
            cells = [[format(r.get(k, ""), f) if r.get(k) is not None else "-" for k, _, f in self.columns]
                     for r in self.rows]
            header = [h for _, h, _ in self.columns]
            widths = [max(len(x) for x in col) for col in zip(header, *cells, strict=True)]
            out.append("  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)))
            out += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
            out.append("")
        out += self.lines
        if self.method:
            out.append("")
            out.append("method:")
            out += [f"  - {m}" for m in self.method]
        return "\n".join(out)


def timed(fn: Callable[[], Any]) -> int:
    """Nanoseconds one call takes."""
    t0 = time.perf_counter_ns()
    fn()
    return time.perf_counter_ns() - t0
