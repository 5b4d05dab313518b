"""Host KV memory: memfds sealed against shrinking, created by the worker, mapped by the daemon."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import stat
import threading

import numpy as np
import structlog

from ..core.errors import InvalidArgument, PermissionDenied, ResourceExhausted

log = structlog.get_logger(__name__)

_MADV_POPULATE_WRITE = 23  # Linux 5.14: fault the range in for writing, without writing to it
_PAGE = mmap.PAGESIZE
POPULATE_CHUNK = 16 << 20  # what close() may wait for: ~4 ms of populating
libc = ctypes.CDLL(None, use_errno=True)  # ctypes drops the GIL around each call
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


class ShmMapping:
    """A read-write shared mapping of a sealed memfd the worker sent (memory/fdpass.py)."""

    mem_type = "DRAM"
    device_id = 0

    def __init__(self, fd: int, size: int, label: str) -> None:
        """Map ``fd`` and close it. It must be sealed against shrinking: a mapping past the end of its
        file faults (SIGBUS) in whichever process copies through it, and over UCX's TCP transport that
        is the daemon, writing a received WRITE."""
        self.name = label
        try:
            if size <= 0:
                raise InvalidArgument(f"{label}: size must be positive, got {size}")
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError:
                seals = 0  # a file that takes no seals (the fd socket parks only tmpfs: not expected)
            if not seals & fcntl.F_SEAL_SHRINK:
                raise PermissionDenied(
                    f"{label}: the descriptor is not a memfd sealed against shrinking (F_SEAL_SHRINK); "
                    "the worker could cut it under a WRITE")
            self._map(fd, size, label)
        finally:
            os.close(fd)

    def _map(self, fd: int, size: int, label: str) -> None:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidArgument(f"{label} is not a regular file")
        if st.st_size < size:
            raise InvalidArgument(f"{label} holds {st.st_size} bytes, the worker declared {size}")
        try:
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:  # EACCES: opened read-only; EPERM: sealed against writes
            if e.errno == errno.ENOMEM:  # the daemon's address space (RLIMIT_AS) or vm.max_map_count
                raise ResourceExhausted(f"{label} ({size} bytes) cannot be mapped: out of address space or "
                                        "memory maps in the daemon") from None
            raise PermissionDenied(f"{label} cannot be mapped for reading and writing: {e.strerror}") from None
        self._buf: ctypes.Array[ctypes.c_ubyte] | None = (ctypes.c_ubyte * size).from_buffer(self._mm)
        self.addr = ctypes.addressof(self._buf)
        self.size = size
        self._lock = threading.Lock()  # populate() works chunk by chunk under it; close() takes it
        self._closing = False  # set before close() waits for the lock: populate() takes no further chunk

    def populate(self) -> int:
        """Map into this process's page tables every page of the object that the worker has already
        touched (``mincore``), so the first WRITE from or into a block does not take a page fault per
        4 KiB page in the daemon (measured: a first 16 MiB WRITE 7.5-9.6 ms, then 3-4 ms). Pages the
        worker never touched stay unallocated: they would be charged to the daemon's memory cgroup.
        Runs off the loop, chunk by chunk; stops when the mapping is closed. Returns the bytes mapped
        (0 on a kernel without MADV_POPULATE_WRITE)."""
        mapped = 0
        vec = np.zeros(POPULATE_CHUNK // _PAGE, dtype=np.uint8)
        for off in range(0, self.size, POPULATE_CHUNK):
            n = min(POPULATE_CHUNK, self.size - off)
            if self._closing:
                break
            with self._lock:
                if self._buf is None:
                    break
                if libc.mincore(self.addr + off, n, vec.ctypes.data) != 0:
                    log.info("host KV not populated", shm=self.name, error=os.strerror(ctypes.get_errno()))
                    return mapped
                pages = -(-n // _PAGE)
                resident = np.concatenate(([0], vec[:pages] & 1, [0])).astype(np.int8)
                edges = np.flatnonzero(np.diff(resident))  # run starts and ends, alternating
                for a, b in zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True):
                    length = min(b * _PAGE, n) - a * _PAGE
                    if libc.madvise(self.addr + off + a * _PAGE, length, _MADV_POPULATE_WRITE) != 0:
                        log.info("host KV not populated", shm=self.name, error=os.strerror(ctypes.get_errno()))
                        return mapped
                    mapped += length
        return mapped

    def close(self) -> None:
        """Unmap. Safe to call twice; the caller has deregistered the memory from NIXL first. Waits for
        at most one chunk of a populate() in progress."""
        self._closing = True
        with self._lock:
            if self._buf is None:
                return
            self._buf = None
            self._mm.close()
