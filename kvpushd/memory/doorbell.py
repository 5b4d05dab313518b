"""A worker's doorbell, the daemon's side: the progress word (kvpushd_client.doorbell), read.

The engine thread stores ``step << 16 | layers`` into the first aligned 64-bit word of a shared
memory object it made; the NIXL thread reads it while it has declared work of that worker. Nothing
a worker writes there can make the daemon write anywhere, and any value read is only compared with
the steps the worker itself declared.

The daemon reads the word with ``pread``, not through a mapping: the page is the worker's, and a
worker that truncates it would make a load through a mapping fault the whole daemon (SIGBUS); a
read past the end is just short. A ``pread`` is not one load, so a value is taken only when two reads
in a row agree (the engine's store is one aligned 8-byte store, so a read that tore across it is
followed by one that does not); an unchanged word costs one read.

A consumer's page also has a completion ring (kvpushd_client.doorbell's layout): each finished
receive is written there as well as on the worker's stream, so the engine sees it in its own step.
The daemon writes it with ``pwrite`` at offsets of its own counting, never read from the page: a
worker that truncates or scribbles over its page can only lose its own hints (the stream still
delivers every completion), and cannot make the daemon fault.
"""

from __future__ import annotations

import fcntl
import os
import stat

import structlog
from kvpushd_client.doorbell import RING_BASE, RING_HEAD, RING_SLOTS, SIZE, ring_record

from ..core.errors import InvalidArgument

log = structlog.get_logger(__name__)

SEALED = 0xFFFF  # layers: the step is complete
WORD = 8


class Doorbell:
    def __init__(self, fd: int, label: str, ring: bool = False) -> None:
        """The page open as ``fd`` (owned from here: closed if refused, and at ``close``). ``ring``: the
        worker receives; write its finished receives into the page's ring too (where ``fd`` is open for
        writing and the page holds a ring)."""
        self.name = label
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size < WORD:
                raise InvalidArgument(f"doorbell {label}: need a shared memory object of {WORD}+ bytes")
            if ring and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDWR:
                log.info("no completion ring", doorbell=label, error="the page is not open for writing")
                ring = False  # the stream delivers
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self.ident = (st.st_dev, st.st_ino)  # the page itself, whatever name or descriptor it came by
        self._ring = ring and st.st_size >= SIZE
        self._word = 0  # the last value two reads agreed on
        self.posted = 0  # records written to the ring so far

    @property
    def has_ring(self) -> bool:
        return self._ring

    def post(self, transfer_id: str) -> None:
        """Write that ``transfer_id`` finished receiving into the ring (nothing if it has none): the
        slot, then the record count. A failed write turns the ring off (the stream still delivers)."""
        if not self._ring:
            return
        i = self.posted + 1
        try:
            os.pwrite(self._fd, ring_record(i, transfer_id).to_bytes(8, "little"),
                      RING_BASE + 8 * ((i - 1) % RING_SLOTS))
            os.pwrite(self._fd, i.to_bytes(8, "little"), RING_HEAD)
        except OSError as e:
            log.warning("completion ring off", doorbell=self.name, error=e.strerror)
            self._ring = False
            return
        self.posted = i

    def word(self) -> int:
        """The progress word (0 when the page is too short to hold one, or closed)."""
        if self._fd < 0:
            return 0
        a = _read(self._fd)
        if a == self._word:
            return a
        for _ in range(3):
            b = _read(self._fd)
            if a == b:
                self._word = a
                return a
            a = b
        return self._word  # still changing: the last agreed value (the next poll reads again)

    def ready(self, step: int, layers: int) -> int:
        """How many of the ``layers`` groups of engine step ``step`` are complete (0 to ``layers``)."""
        word = self.word()
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
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            self._ring = False


def fd_label(fd: int) -> str:
    """What a descriptor's page is called, for messages and logs: a memfd's name, or its path."""
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"(descriptor {fd})"
    return target.removeprefix("/memfd:").removesuffix(" (deleted)")[:256]


def _read(fd: int) -> int:
    try:
        b = os.pread(fd, WORD, 0)
    except OSError:
        return 0
    return int.from_bytes(b, "little") if len(b) == WORD else 0
