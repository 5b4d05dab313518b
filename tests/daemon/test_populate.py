"""Host KV populated into the daemon's page tables after attach (``worker_api.populate_host_kv``): only
the pages the worker touched, none allocated on the worker's behalf, stopped by close, and in a real
daemon the mapping of an attached worker's KV becomes resident without any transfer."""

from __future__ import annotations

import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from kvpushd_client import Role, SealedBuffer
from kvpushd_lab import launch
from support import DaemonFactory, make_kv, wait_for

from kvpushd.memory import shm
from kvpushd.memory.shm import POPULATE_CHUNK, ShmMapping


def _kernel_populates() -> bool:
    m = mmap.mmap(-1, mmap.PAGESIZE)
    try:
        m.madvise(23)  # MADV_POPULATE_WRITE, Linux 5.14
        return True
    except OSError:
        return False
    finally:
        m.close()


pytestmark = pytest.mark.skipif(not _kernel_populates(), reason="the kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")


def _rss(pid: int | str, name: str, addr: int | None = None) -> int:
    """Bytes of the memfd <name> (the mapping at ``addr`` only, if given) in the
    page tables of ``pid``."""
    total, inside = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for ln in f:
            head = ln.split(maxsplit=5)
            if head and "-" in head[0] and ":" not in head[0]:
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                path = head[5].strip() if len(head) == 6 else ""
                inside = path == f"/memfd:{name} (deleted)" and (addr is None or lo <= addr < hi)
            elif inside and head[0] == "Rss:":
                total += int(head[1]) * 1024
    return total


def test_populate_maps_what_the_worker_touched_and_allocates_nothing() -> None:
    size = 2 * POPULATE_CHUNK + 5 * mmap.PAGESIZE  # a partial last chunk
    buf = SealedBuffer.create("kvpushd-test-populate", size)
    try:
        touched = (0, 3 * mmap.PAGESIZE), (POPULATE_CHUNK - mmap.PAGESIZE, POPULATE_CHUNK + 2 * mmap.PAGESIZE), (
            size - 5 * mmap.PAGESIZE, size)  # runs inside a chunk, across a chunk's edge, at the end
        for a, b in touched:
            buf.mmap[a:b] = b"\x01" * (b - a)
        want = sum(b - a for a, b in touched)
        m = ShmMapping(os.dup(buf.fd), size, buf.name)
        assert _rss("self", buf.name, m.addr) == 0
        assert m.populate() == want
        assert _rss("self", buf.name, m.addr) == want
        blocks = os.fstat(buf.fd).st_blocks * 512
        assert blocks == want  # no page allocated that the worker did not touch
        m.close()
        assert m.populate() == 0  # closed: nothing to do, nothing touched
    finally:
        buf.close()


def test_close_while_populating_stops_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker detaching while its KV is being populated: close() waits for the chunk in hand only,
    and populate() takes no further chunk (no madvise on an unmapped range)."""
    size = 4 * POPULATE_CHUNK
    buf = SealedBuffer.create("kvpushd-test-populate-close", size)
    started, go = threading.Event(), threading.Event()
    real = shm.libc

    class SlowLibc:  # the first madvise waits until close() has begun
        mincore = real.mincore

        @staticmethod
        def madvise(addr: int, length: int, advice: int) -> int:
            started.set()
            assert go.wait(10)
            return int(real.madvise(addr, length, advice))

    monkeypatch.setattr(shm, "libc", SlowLibc)
    try:
        buf.mmap.write(bytes(size))  # every page touched
        m = ShmMapping(os.dup(buf.fd), size, buf.name)
        with ThreadPoolExecutor(2) as ex:
            fut = ex.submit(m.populate)
            assert started.wait(10)
            closer = ex.submit(m.close)
            assert wait_for(lambda: m._closing, timeout=10)
            assert not closer.done()  # it waits for the chunk in hand
            go.set()
            closer.result(timeout=10)
            assert fut.result(timeout=10) == POPULATE_CHUNK
    finally:
        buf.close()


def test_daemon_populates_an_attached_workers_host_kv(daemon_factory: DaemonFactory, workdir: Path) -> None:
    on = daemon_factory("pop-on")
    off = launch.start(workdir, "pop-off", settings={"worker_api": {"populate_host_kv": False}}, timeout_s=120)
    daemon_factory.started.append(off)  # stopped with the others
    kvs = [make_kv(f"kvpushd-test-pop{i}", regions=4, num_blocks=256, fill="random", seed=i) for i in range(2)]
    try:
        size = kvs[0].buf.size
        for d, kv in zip((on, off), kvs, strict=True):
            d.client.attach("prefill", Role.PRODUCER, 0, 1, [kv.buf.memory], kv.region_list)
        assert wait_for(lambda: _rss(on.proc.pid, kvs[0].buf.name) == size, timeout=30), \
            _rss(on.proc.pid, kvs[0].buf.name)
        assert "host KV populated" in on.logs()
        assert _rss(off.proc.pid, kvs[1].buf.name) == 0
    finally:
        for kv in kvs:
            kv.close()
