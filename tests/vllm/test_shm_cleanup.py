"""Host KV the connector moved into shared memory is gone once its worker is gone, however it died.

A real process attaches the way the connector's worker side does (``describe_kv_caches`` with
``host_kv_to_shm``, then ``ReconnectingStreamWorker``) and is SIGKILLed. The connector's host KV is a
sealed memfd handed to the daemon by descriptor: it has no name in /dev/shm to leave behind, and its
memory goes with the last mapping, the daemon's, which goes when the daemon detaches the dead
worker. A restarted daemon re-attaches the live worker: the worker hands the descriptor again.
Needs torch (the vLLM venvs and the daemon venv have it); no vLLM.
"""

from __future__ import annotations

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
from kvpushd_client.vllm.layout import describe_kv_caches, owned_memfd_names

sock, engine = sys.argv[1], sys.argv[2]
num_blocks = 8
buf = torch.zeros(2 * num_blocks * 4 * 16 * 32, dtype=torch.float32)  # private memory, like vLLM's CPU runner
kv = {f"layers.{i}": buf.view(2, num_blocks, 4, 16, 32)[i] for i in range(2)}
memory, regions, _ = describe_kv_caches(kv, num_blocks, host_kv_to_shm=True)
link = kvpushd_client.ReconnectingStreamWorker(sock, {
    "engine_id": engine, "role": Role.PRODUCER, "tp_rank": 0, "tp_size": 1, "memory": memory, "regions": regions,
    "description": "shm test worker"}, reconnect_interval_s=0.2)
link.start(30)
kv["layers.0"].fill_(7.0)  # views stay valid after the move: the bytes land in the memfd
import mmap, numpy as np
m = mmap.mmap(memory[0].fd, 0)
assert float(np.frombuffer(m, dtype=np.float32)[regions[0].offset // 4]) == 7.0
print("READY", " ".join(owned_memfd_names(memory)), flush=True)
while True:
    time.sleep(1)
"""


@pytest.fixture
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="kvpushd-shm-") as d:
        yield Path(d)


def maps(pid: int, name: str) -> bool:
    """Whether process ``pid`` maps the memfd ``name``."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return any(f"/memfd:{name} " in ln for ln in f)
    except FileNotFoundError:
        return False


def ours(before: set[str]) -> set[str]:
    return {n for n in set(os.listdir("/dev/shm")) - before if n.startswith(OWNED)}


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


def sigkill(p: subprocess.Popen[str]) -> None:
    os.killpg(p.pid, signal.SIGKILL)
    p.wait(30)


def attached(d: vs.Daemon, engine: str) -> bool:
    from kvpushd_client import KVPushClient

    with KVPushClient(d.sock, timeout_s=5.0) as c:
        return any(w.engine_id == engine for w in c.status().workers)


def test_sigkilled_workers_memory_goes_with_its_detach(workdir: Path) -> None:
    before = set(os.listdir("/dev/shm"))
    d = vs.spawn_daemon(workdir, "node")
    procs: list[subprocess.Popen[str]] = []
    try:
        d.wait_ready()
        w, name = start_worker(d.sock, "engine-kill")
        procs.append(w)
        assert attached(d, "engine-kill") and maps(d.proc.pid, name)  # the daemon maps what it was handed
        assert ours(before) == set()  # and there is no name for it in /dev/shm
        sigkill(w)
        assert vs.wait_for(lambda: not attached(d, "engine-kill"), 30)
        assert vs.wait_for(lambda: not maps(d.proc.pid, name), 30), d.logs()[-3000:]  # last mapping gone
    finally:
        for p in procs:
            if p.poll() is None:
                sigkill(p)
        assert d.stop() == 0
    assert ours(before) == set()


def test_restarted_daemon_reattaches_a_live_worker_with_its_memfd(workdir: Path) -> None:
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
        assert maps(d.proc.pid, name)  # the worker handed its descriptor to the new daemon
        d.kill()
        sigkill(w)
        d.start()
        d.wait_ready()
        assert not maps(d.proc.pid, name)
    finally:
        for p in procs:
            if p.poll() is None:
                sigkill(p)
        assert d.stop() == 0
    assert ours(before) == set()
