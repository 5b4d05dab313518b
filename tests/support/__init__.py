"""Helpers every test directory shares (import as ``support``: pyproject puts tests/ on the path).

Daemons come from the lab's one launcher (``kvpushd_lab.launch``): real ``kvpushd serve`` processes on
unix sockets in a temporary directory and loopback TCP. ``DaemonFactory`` starts them for a test and
stops them afterwards; the top conftest.py wraps it as the ``daemon_factory`` fixture.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from kvpushd_client import Region, Role, SharedBuffer
from kvpushd_lab import launch

POISON = 0xA5

DaemonProc = launch.Daemon


def start_daemon(workdir: Path, name: str, extra_config: str = "", listen: str = "127.0.0.1:0") -> DaemonProc:
    """A ready daemon: node ``name``, worker socket ``<workdir>/<name>.sock``, ``extra_config`` (TOML) appended."""
    try:
        return launch.start(workdir, name, listen=listen, advertise_host="127.0.0.1", extra_config=extra_config,
                            timeout_s=60)
    except launch.DaemonStartError as e:
        raise RuntimeError(str(e)) from None


class DaemonFactory:
    """Starts daemons in one directory and stops whatever still runs at ``close`` (a stopped one with
    SIGSTOP is continued first): the one daemon factory of the tests."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.started: list[DaemonProc] = []

    def __call__(self, name: str, extra_config: str = "", listen: str = "127.0.0.1:0") -> DaemonProc:
        d = start_daemon(self.workdir, name, extra_config, listen)
        self.started.append(d)
        return d

    def pair(self, extra_config: str = "",
             names: tuple[str, str] = ("pnode", "dnode")) -> tuple[DaemonProc, DaemonProc]:
        """A prefill-node daemon and a decode-node daemon with the same settings."""
        return self(names[0], extra_config), self(names[1], extra_config)

    def close(self, check: Iterable[DaemonProc] = ()) -> None:
        """Close every client, SIGTERM every daemon still running and wait; each daemon in ``check``
        must have exited 0."""
        must = {id(x) for x in check}
        errors = []
        for x in self.started:
            x.client.close()
            if x.proc.poll() is None:
                x.proc.send_signal(signal.SIGCONT)
            try:
                rc = x.stop()
            except subprocess.TimeoutExpired:
                errors.append(f"daemon {x.name} did not stop within 30 s of SIGTERM (killed)")
                continue
            if id(x) in must and rc != 0:
                errors.append(f"daemon {x.name} exited {rc}:\n{x.logs()[-3000:]}")
        self.started.clear()
        assert not errors, "\n".join(errors)


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


def attach_pair(p: DaemonProc, d: DaemonProc, src: KV, dst: KV) -> tuple[object, object]:
    pw = p.client.attach("prefill", Role.PRODUCER, 0, 1, [src.buf.memory], src.region_list)
    dw = d.client.attach("decode", Role.CONSUMER, 0, 1, [dst.buf.memory], dst.region_list)
    return pw, dw


def wait_for(pred: Callable[[], object], timeout: float = 20.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return bool(pred())


def shm_names() -> set[str]:
    return set(os.listdir("/dev/shm"))
