"""Helpers every test directory shares (import as ``support``: pyproject puts tests/ on the path).

Daemons come from the lab's one launcher (``kvpushd_lab.launch``): real ``kvpushd serve`` processes on
unix sockets in a temporary directory and loopback TCP. ``DaemonFactory`` (support/daemons.py) starts
them for a test and stops them afterwards; the top conftest.py wraps it as the ``daemon_factory`` fixture.
``DaemonProc``, ``DaemonFactory`` and ``start_daemon`` load on first use: the vLLM venv, which runs
tests/vllm/ with this conftest, has the client but not the lab.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import pytest
from kvpushd_client import Region, Role, SealedBuffer

if TYPE_CHECKING:
    from .daemons import DaemonProc, scrape, value  # noqa: F401

POISON = 0xA5
# The backend-specific end-to-end tests run on each (conftest.py's ``nixl_backend`` fixture).
BACKENDS = ("UCX", "LIBFABRIC")
both_backends = pytest.mark.parametrize("nixl_backend", BACKENDS, indirect=True)
_DAEMONS = ("DaemonFactory", "DaemonProc", "scrape", "start_daemon", "value")


def __getattr__(name: str) -> object:
    if name in _DAEMONS:
        from . import daemons

        return getattr(daemons, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

@dataclass
class KV:
    """A worker's KV memory: ``regions`` regions of ``num_blocks`` blocks in one sealed memfd."""

    buf: SealedBuffer
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
        self.buf.close()


def make_kv(prefix: str, regions: int = 4, num_blocks: int = 64, block_len: int = 4096, fill: str = "random",
            seed: int = 0) -> KV:
    """In a sealed memfd, handed over by descriptor."""
    size = regions * num_blocks * block_len
    buf = SealedBuffer.create(prefix, size)
    kv = KV(buf, regions, num_blocks, block_len)
    if fill == "random":
        kv.arr[:] = np.random.default_rng(seed).integers(0, 256, kv.arr.shape, dtype=np.uint8)
    else:
        kv.arr[:] = POISON
    return kv


def attach_pair(p: DaemonProc, d: DaemonProc, src: KV, dst: KV, doorbell: bool = False) -> tuple[object, object]:
    """A prefill worker on ``p`` (with a doorbell: progressive push) and a decode worker on ``d``."""
    pw = p.client.attach("prefill", Role.PRODUCER, 0, 1, [src.buf.memory], src.region_list, doorbell=doorbell)
    dw = d.client.attach("decode", Role.CONSUMER, 0, 1, [dst.buf.memory], dst.region_list)
    return pw, dw


def layered_kv(prefix: str, regions: int, num_blocks: int, seed: int) -> tuple[KV, KV, np.ndarray]:
    """Source and destination KV, both poison (nothing computed yet), and the bytes prefill will compute."""
    src = make_kv(f"{prefix}-src", regions=regions, num_blocks=num_blocks, fill="poison")
    dst = make_kv(f"{prefix}-dst", regions=regions, num_blocks=num_blocks, fill="poison")
    return src, dst, np.random.default_rng(seed).integers(0, 256, src.arr.shape, dtype=np.uint8)


def rss(pid: int) -> int:
    """A process's resident set size in bytes (VmRSS)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


def wait_for(pred: Callable[[], object], timeout: float = 20.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return bool(pred())


def shm_names() -> set[str]:
    return set(os.listdir("/dev/shm"))
