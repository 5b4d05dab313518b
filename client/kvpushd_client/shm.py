"""Host KV memory the worker makes and hands to the daemon: a memfd sealed against shrinking
(``SealedBuffer``), handed over by descriptor on the daemon's fd socket (handover.py).

Nobody can truncate it, so no WRITE into or out of it can fault in the daemon, and it is freed with
its last descriptor and mapping, however the worker dies. (A /dev/shm object, which any process that
may open it can truncate, the daemon refuses.)
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import secrets

from .types import MemfdMemory

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def sealed_memfd(name: str, size: int) -> int:
    """A new memfd of ``size`` bytes (zeros), sealed so it can neither shrink nor grow: its descriptor."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


class SealedBuffer:
    """A sealed memfd, mapped read-write. ``close()`` unmaps it and closes the descriptor; the memory
    goes with the last mapping (the daemon's lasts until the worker detaches)."""

    def __init__(self, name: str, size: int, fd: int | None = None) -> None:
        self.name = name
        self.size = size
        self.fd = sealed_memfd(name, size) if fd is None else fd
        try:
            self.mmap = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise

    @classmethod
    def create(cls, prefix: str, size: int) -> SealedBuffer:
        return cls(f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}", size)

    @classmethod
    def open(cls, path: str, size: int) -> SealedBuffer:
        """Another process's memfd, by its ``path`` there (a tool or test of the same user)."""
        return cls(path, size, os.open(path, os.O_RDWR | os.O_CLOEXEC))

    @property
    def path(self) -> str:
        """A path by which other processes of this user may open it while this process lives."""
        return f"/proc/{os.getpid()}/fd/{self.fd}"

    @property
    def memory(self) -> MemfdMemory:
        return MemfdMemory(self.fd, self.size)

    def close(self) -> None:
        with contextlib.suppress(BufferError):  # views still exported: the map goes with the process
            self.mmap.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

