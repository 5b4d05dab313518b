"""Host KV memory: POSIX shared memory objects created by the worker, mapped by the daemon."""

from __future__ import annotations

import ctypes
import mmap
import os
import re

from ..core.errors import InvalidArgument, NotFound, PermissionDenied

SHM_DIR = "/dev/shm"
_NAME_RE = re.compile(r"^/?[A-Za-z0-9._@+-]{1,250}$")


class ShmMapping:
    """A read-write shared mapping of /dev/shm/<name>."""

    mem_type = "DRAM"
    device_id = 0

    def __init__(self, name: str, size: int) -> None:
        if not _NAME_RE.match(name) or name.strip("/") in (".", ".."):
            raise InvalidArgument(f"invalid shared memory name {name!r}")
        if size <= 0:
            raise InvalidArgument(f"shared memory {name!r}: size must be positive, got {size}")
        self.name = name.lstrip("/")
        path = os.path.join(SHM_DIR, self.name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise NotFound(f"shared memory {name!r} does not exist ({path})") from None
        except PermissionError:
            raise PermissionDenied(f"shared memory {name!r}: the daemon may not open {path}") from None
        except OSError as e:
            raise InvalidArgument(f"shared memory {name!r} cannot be opened: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            if st.st_size < size:
                raise InvalidArgument(
                    f"shared memory {name!r} holds {st.st_size} bytes, the worker declared {size}"
                )
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._buf: ctypes.Array[ctypes.c_ubyte] | None = (ctypes.c_ubyte * size).from_buffer(self._mm)
        self.addr = ctypes.addressof(self._buf)
        self.size = size

    def close(self) -> None:
        """Unmap. Safe to call twice; the caller has deregistered the memory from NIXL first."""
        if self._buf is None:
            return
        self._buf = None
        self._mm.close()
