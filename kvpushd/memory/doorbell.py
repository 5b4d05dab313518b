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
"""

from __future__ import annotations

import os
import stat

from ..core.errors import InvalidArgument

SEALED = 0xFFFF  # layers: the step is complete
WORD = 8


class Doorbell:
    def __init__(self, fd: int, label: str) -> None:
        """The page open as ``fd`` (owned from here: closed if refused, and at ``close``)."""
        self.name = label
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size < WORD:
                raise InvalidArgument(f"doorbell {label}: need a shared memory object of {WORD}+ bytes")
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self.ident = (st.st_dev, st.st_ino)  # the page itself, whatever name or descriptor it came by
        self._word = 0  # the last value two reads agreed on

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
