"""A worker's doorbell, the daemon's side: a read-only view of the progress word (kvpushd_client.doorbell).

The engine thread stores ``step << 16 | layers`` into the first aligned 64-bit word of a shared
memory object it made; the NIXL thread reads it while it has declared work of that worker. The
daemon maps it read-only: nothing a worker writes there can make the daemon write anywhere, and
any value read is only compared with the steps the worker itself declared.

A consumer's page also has a completion ring (kvpushd_client.doorbell's layout): each finished
receive is written there as well as on the worker's stream, so the engine sees it in its own step.
The daemon writes it with ``pwrite`` at offsets of its own counting, never read from the page: a
worker that truncates or scribbles over its page can only lose its own hints (the stream still
delivers every completion), and cannot make the daemon fault.
"""

from __future__ import annotations

import mmap
import os
import stat

import numpy as np
import structlog
from kvpushd_client.doorbell import RING_BASE, RING_HEAD, RING_SLOTS, SIZE, ring_record

from ..core.errors import InvalidArgument, NotFound, PermissionDenied
from .shm import _NAME_RE, SHM_DIR

log = structlog.get_logger(__name__)

SEALED = 0xFFFF  # layers: the step is complete
WORD = 8


class Doorbell:
    def __init__(self, name: str, ring: bool = False) -> None:
        """``ring``: the worker receives; write its finished receives into the page's ring too."""
        if not _NAME_RE.match(name) or name.strip("/") in (".", ".."):
            raise InvalidArgument(f"invalid doorbell name {name[:256]!r}")
        self.name = name.lstrip("/")
        path = os.path.join(SHM_DIR, self.name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise NotFound(f"doorbell {name[:256]!r} does not exist ({path})") from None
        except PermissionError:
            raise PermissionDenied(f"doorbell {name[:256]!r}: the daemon may not open {path}") from None
        except OSError as e:
            raise InvalidArgument(f"doorbell {name[:256]!r} cannot be opened: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size < WORD:
                raise InvalidArgument(f"doorbell {name[:256]!r}: need a shared memory object of {WORD}+ bytes")
            self._mm: mmap.mmap | None = mmap.mmap(fd, WORD, mmap.MAP_SHARED, mmap.PROT_READ)
            self._ring_fd = _ring_fd(self.name, path) if ring and st.st_size >= SIZE else -1
        finally:
            os.close(fd)
        self._word = np.frombuffer(self._mm, dtype=np.uint64, count=1)  # one aligned 8-byte load per read
        self.posted = 0  # records written to the ring so far

    @property
    def has_ring(self) -> bool:
        return self._ring_fd >= 0

    def post(self, transfer_id: str) -> None:
        """Write that ``transfer_id`` finished receiving into the ring (nothing if it has none): the
        slot, then the record count. A failed write turns the ring off (the stream still delivers)."""
        if self._ring_fd < 0:
            return
        i = self.posted + 1
        try:
            os.pwrite(self._ring_fd, ring_record(i, transfer_id).to_bytes(8, "little"),
                      RING_BASE + 8 * ((i - 1) % RING_SLOTS))
            os.pwrite(self._ring_fd, i.to_bytes(8, "little"), RING_HEAD)
        except OSError as e:
            log.warning("completion ring off", doorbell=self.name, error=e.strerror)
            os.close(self._ring_fd)
            self._ring_fd = -1
            return
        self.posted = i

    def ready(self, step: int, layers: int) -> int:
        """How many of the ``layers`` groups of engine step ``step`` are complete (0 to ``layers``)."""
        if self._mm is None:
            return 0
        word = int(self._word[0])
        seq, done = word >> 16, word & 0xFFFF
        if seq > step or (seq == step and done == SEALED):
            return layers  # a later step began: this one is complete
        if seq < step:
            return 0  # a stale word (an earlier step): never read backwards
        return min(done, layers)

    def complete(self, step: int) -> bool:
        """Whether engine step ``step`` is complete (sealed, or a later step began)."""
        return self.ready(step, SEALED) == SEALED

    def close(self) -> None:
        if self._ring_fd >= 0:
            os.close(self._ring_fd)
            self._ring_fd = -1
        if self._mm is None:
            return
        del self._word
        self._mm.close()
        self._mm = None


def _ring_fd(name: str, path: str) -> int:
    try:
        return os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:  # not writable for this daemon: no ring, the stream delivers
        log.info("no completion ring", doorbell=name, error=e.strerror)
        return -1
