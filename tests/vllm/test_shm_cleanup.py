"""Host KV the connector moved into shared memory is gone once its worker is gone, however it died.

A real process attaches the way the connector's worker side does (``describe_kv_caches`` with
``host_kv_to_shm``, then ``ReconnectingStreamWorker``) and is SIGKILLed (with torch's shm manager, should
one run: the connector no longer uses torch's file_system sharing); the daemon removes its /dev/shm
object. A restarted daemon still re-attaches the live worker by name,
and one started after worker and daemon both died removes what they left. Needs torch (the vLLM venvs
and the daemon venv have it); no vLLM.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import vllm_support as vs

pytest.importorskip("torch")

OWNED = "kvpushd-kv-"

WORKER = r"""
import sys, time, torch
import kvpushd_client
from kvpushd_client import Role
from kvpushd_client.vllm.layout import describe_kv_caches

sock, engine = sys.argv[1], sys.argv[2]
num_blocks = 8
buf = torch.zeros(2 * num_blocks * 4 * 16 * 32, dtype=torch.float32)  # private memory, like vLLM's CPU runner
kv = {f"layers.{i}": buf.view(2, num_blocks, 4, 16, 32)[i] for i in range(2)}
memory, regions = describe_kv_caches(kv, num_blocks, host_kv_to_shm=True)
link = kvpushd_client.ReconnectingStreamWorker(sock, {
    "engine_id": engine, "role": Role.PRODUCER, "tp_rank": 0, "tp_size": 1, "memory": memory, "regions": regions,
    "description": "shm test worker"}, reconnect_interval_s=0.2)
link.start(30)
kv["layers.0"].fill_(7.0)  # views stay valid after the move: the bytes land in the shm object
import mmap, os, numpy as np
with open("/dev/shm/" + memory[0].name, "r+b") as f:
    m = mmap.mmap(f.fileno(), 0)
assert float(np.frombuffer(m, dtype=np.float32)[regions[0].offset // 4]) == 7.0
print("READY", " ".join(m.name for m in memory), flush=True)
while True:
    time.sleep(1)
"""


@pytest.fixture
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="kvpushd-shm-") as d:
        yield Path(d)


def ours(before: set[str], procs: list[subprocess.Popen[str]]) -> set[str]:
    """What our workers added to /dev/shm (other tests on this machine add theirs meanwhile)."""
    mine = (OWNED, *(f"torch_{p.pid}_" for p in procs))
    return {n for n in set(os.listdir("/dev/shm")) - before if n.startswith(mine)}


def owned() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(OWNED)}


def start_worker(sock: str, engine: str) -> tuple[subprocess.Popen[str], str]:
    p = subprocess.Popen([sys.executable, "-c", WORKER, sock, engine], stdout=subprocess.PIPE, text=True,
                         start_new_session=True)
    line = p.stdout.readline() if p.stdout else ""
    if not line.startswith("READY "):
        p.kill()
        raise RuntimeError(f"worker did not start: {line!r}")
    names = line.split()[1:]
    assert len(names) == 1 and names[0].startswith(OWNED), names
    return p, names[0]


def shm_managers(pid: int) -> list[int]:
    """torch's shm manager processes of a worker (its children, in a session of their own)."""
    return [int(x) for x in subprocess.run(["pgrep", "-P", str(pid), "-f", "torch_shm_manager"],
                                           capture_output=True, text=True).stdout.split()]


def sigkill_group(p: subprocess.Popen[str]) -> None:
    """The worker and torch's shm manager."""
    managers = shm_managers(p.pid)
    os.killpg(p.pid, signal.SIGKILL)
    for pid in managers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    p.wait(30)


def attached(d: vs.Daemon, engine: str) -> bool:
    from kvpushd_client import KVPushClient

    with KVPushClient(d.sock, timeout_s=5.0) as c:
        return any(w.engine_id == engine for w in c.status().workers)


def test_sigkilled_worker_leaves_no_shm(workdir: Path) -> None:
    before = set(os.listdir("/dev/shm"))
    d = vs.spawn_daemon(workdir, "node")
    procs: list[subprocess.Popen[str]] = []
    try:
        d.wait_ready()
        w, name = start_worker(d.sock, "engine-kill")
        procs.append(w)
        assert name in owned() and attached(d, "engine-kill")
        managers = shm_managers(w.pid)
        sigkill_group(w)
        assert vs.wait_for(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in managers), 30)
        assert vs.wait_for(lambda: name not in owned(), 30), f"{name} still in /dev/shm:\n{d.logs()[-3000:]}"
        assert vs.wait_for(lambda: not attached(d, "engine-kill"), 30)
    finally:
        for p in procs:
            if p.poll() is None:
                sigkill_group(p)
        assert d.stop() == 0
    assert ours(before, procs) == set()


def test_restarted_daemon_reattaches_a_live_worker_then_cleans_up(workdir: Path) -> None:
    before = set(os.listdir("/dev/shm"))
    d = vs.spawn_daemon(workdir, "node")
    procs: list[subprocess.Popen[str]] = []
    try:
        d.wait_ready()
        w, name = start_worker(d.sock, "engine-restart")
        procs.append(w)
        d.kill()  # SIGKILL: no drain; the worker lives on and retries
        d.start()
        d.wait_ready()
        assert vs.wait_for(lambda: attached(d, "engine-restart"), 60), d.logs()[-3000:]
        assert name in owned()  # the restarted daemon's start did not take a live worker's memory
        # Both die at once: nobody is left to clean up ...
        d.kill()
        sigkill_group(w)
        assert name in owned()
        # ... until a daemon starts on this node again.
        d.start()
        d.wait_ready()
        assert name not in owned()
    finally:
        for p in procs:
            if p.poll() is None:
                sigkill_group(p)
        assert d.stop() == 0
    assert ours(before, procs) == set()
