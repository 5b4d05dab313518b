"""POSIX shared memory for host KV, created by the worker and handed to the daemon by name."""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets

from .types import ShmMemory


class SharedBuffer:
    """/dev/shm/<name>, mapped read-write. The creator unlinks it when done (``close(unlink=True)``)."""

    def __init__(self, name: str, size: int, create: bool = True, mode: int = 0o660) -> None:
        self.name = name.lstrip("/")
        self.size = size
        path = f"/dev/shm/{self.name}"
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, mode)
        try:
            if create:
                os.ftruncate(fd, size)
            self.mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.created = create

    @classmethod
    def create(cls, prefix: str, size: int) -> SharedBuffer:
        return cls(f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}", size, create=True)

    @property
    def memory(self) -> ShmMemory:
        return ShmMemory(self.name, self.size)

    def close(self, unlink: bool | None = None) -> None:
        with contextlib.suppress(BufferError):  # views still exported: the map goes with the process
            self.mmap.close()
        if unlink if unlink is not None else self.created:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{self.name}")
