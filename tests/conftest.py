"""Shared fixtures: real daemons as real processes on unix sockets and loopback TCP."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from kvpushd_client import KVPushClient, Region, Role, SharedBuffer

POISON = 0xA5


@dataclass
class DaemonProc:
    name: str
    sock: str
    proc: subprocess.Popen[bytes]
    log: Path
    client: KVPushClient
    peer_address: str = ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise

    def logs(self) -> str:
        return self.log.read_text(errors="replace")


def start_daemon(workdir: Path, name: str, extra_config: str = "", listen: str = "127.0.0.1:0") -> DaemonProc:
    sock = str(workdir / f"{name}.sock")
    cfg = workdir / f"{name}.toml"
    cfg.write_text(
        f'[node]\nnode_id = "{name}"\nadvertise_host = "127.0.0.1"\n'
        f'[worker_api]\nsocket = "{sock}"\n'
        f'[peer_api]\nlisten = "{listen}"\n' + extra_config
    )
    log = workdir / f"{name}.log"
    proc = subprocess.Popen([sys.executable, "-m", "kvpushd", "serve", "--config", str(cfg)],
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115
    client = KVPushClient(sock)
    try:
        client.wait_ready(60)
    except Exception:
        proc.kill()
        raise RuntimeError(f"daemon {name} did not start:\n{log.read_text()}") from None
    d = DaemonProc(name, sock, proc, log, client)
    d.peer_address = client.status().peer_address
    return d


@pytest.fixture
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="kvpushd-test-") as d:
        yield Path(d)


@pytest.fixture
def daemon_pair(workdir: Path) -> Iterator[tuple[DaemonProc, DaemonProc]]:
    """A prefill-node daemon and a decode-node daemon."""
    p = start_daemon(workdir, "pnode", "[transfer]\npublish_timeout_s = 20.0\nexpect_timeout_s = 20.0\n")
    try:
        d = start_daemon(workdir, "dnode", "[transfer]\npublish_timeout_s = 20.0\nexpect_timeout_s = 20.0\n")
    except BaseException:
        p.stop()
        raise
    yield p, d
    for x in (p, d):
        x.client.close()
        rc = x.stop()
        assert rc == 0, f"daemon {x.name} exited {rc}:\n{x.logs()[-3000:]}"


@dataclass
class KV:
    """A worker's KV memory: ``regions`` regions of ``num_blocks`` blocks in one shm object."""

    buf: SharedBuffer
    regions: int
    num_blocks: int
    block_len: int
    arr: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.arr = np.frombuffer(self.buf.mmap, dtype=np.uint8).reshape(self.regions, self.num_blocks, self.block_len)

    @property
    def region_list(self) -> list[Region]:
        return [Region(0, i * self.num_blocks * self.block_len, self.num_blocks, self.block_len)
                for i in range(self.regions)]

    def close(self) -> None:
        del self.arr
        self.buf.close(unlink=True)


def make_kv(prefix: str, regions: int = 4, num_blocks: int = 64, block_len: int = 4096, fill: str = "random",
            seed: int = 0) -> KV:
    buf = SharedBuffer.create(prefix, regions * num_blocks * block_len)
    kv = KV(buf, regions, num_blocks, block_len)
    if fill == "random":
        kv.arr[:] = np.random.default_rng(seed).integers(0, 256, kv.arr.shape, dtype=np.uint8)
    else:
        kv.arr[:] = POISON
    return kv


@pytest.fixture
def kv_pair() -> Iterator[tuple[KV, KV]]:
    src = make_kv("kvpushd-test-src", fill="random")
    dst = make_kv("kvpushd-test-dst", fill="poison")
    yield src, dst
    src.close()
    dst.close()


def attach_pair(p: DaemonProc, d: DaemonProc, src: KV, dst: KV) -> tuple[object, object]:
    pw = p.client.attach("prefill", Role.PRODUCER, 0, 1, [src.buf.memory], src.region_list)
    dw = d.client.attach("decode", Role.CONSUMER, 0, 1, [dst.buf.memory], dst.region_list)
    return pw, dw


def wait_for(pred, timeout: float = 20.0, interval: float = 0.02) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return bool(pred())


def shm_names() -> set[str]:
    return set(os.listdir("/dev/shm"))
