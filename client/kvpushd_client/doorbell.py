"""A worker's doorbell: the progress of its engine steps, in one shared 64-bit word.

Progressive push declares a request's publish in the step that computes it, before the forward;
the doorbell then says how far that step has got, and the daemon's NIXL thread, which watches it
while it has declared work, writes each layer group as soon as it is complete. Ringing costs the
engine thread one aligned 64-bit store into shared memory: no syscall, no lock, no RPC.

The word is ``seq << 16 | layers``: the step's sequence number (from 1) and how many of its layers
have their KV written (``SEALED``: the whole step). One store updates both, so a reader never sees
a new step with an old step's layer count. Readers treat a later ``seq`` as "the step is complete"
(the engine runs one step at a time) and an earlier one as "nothing yet".

The record is a page of its own, a memfd named kvpushd-kv-bell-<pid>-<hex> (no file in /dev/shm:
it goes with its last mapping), handed to the daemon by descriptor on the fd socket at each attach, as
host KV is (kvpushd_client.shm.hand_over).

With GPU KV the engine thread runs ahead of the GPU, so a store from it could claim layers not computed
yet: there the word is written by the CUDA stream (kvpushd_client.gpu_doorbell.GpuDoorbell, same page,
same word); ``gpu_doorbell.make_doorbell(kv_on_cuda)`` picks the one that fits the KV.

A consumer's page carries the other direction: a completion ring the decode daemon writes, so a
finished receive reaches the engine with a load in its own step, not a gRPC message, a reader
thread and a wake-up later (``RingReader``). The ring is a hint that arrives first; the stream still
delivers every completion, and the worker reports each transfer once (kvpushd_client.stream).

Ring layout, after the progress word: the record count (64-bit, at ``RING_HEAD``) and ``RING_SLOTS``
64-bit slots from ``RING_BASE``. Record i (from 1) goes to slot ``(i - 1) % RING_SLOTS`` as
``(i & 0xFFFF) << 48 | ring_key(transfer id)``, then the count becomes i. A reader takes a slot only
when its tag is i's, so a slot not visible yet, or a reader a whole ring behind, is never misread: it
waits, or skips to the stream; a count at or below the reader's is ignored (``attach`` empties the
ring and makes a new reader). The daemon writes with ``pwrite`` (a worker that truncates its page
gets nothing wrong, and cannot make the daemon fault); the worker maps the page read-only for this.
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import secrets

SIZE = 4096          # one page; the word is at offset 0
SEALED = 0xFFFF      # layers: the step's forward is complete
MAX_LAYERS = SEALED - 1
PREFIX = "kvpushd-kv-bell-"
RING_HEAD = 64       # the completion ring's record count, on a cache line of its own
RING_BASE = 128      # its first slot
RING_SLOTS = (SIZE - RING_BASE) // 8
KEY_BITS = 48
_KEY_MASK = (1 << KEY_BITS) - 1


def ring_key(transfer_id: str) -> int:
    """A transfer's key in the completion ring: 48 bits of its id's BLAKE2b."""
    return int.from_bytes(hashlib.blake2b(transfer_id.encode(), digest_size=KEY_BITS // 8).digest(), "little")


def ring_record(i: int, transfer_id: str) -> int:
    """Slot value of record ``i`` (from 1)."""
    return ((i & 0xFFFF) << KEY_BITS) | ring_key(transfer_id)


def pack(seq: int, layers: int) -> int:
    return (seq << 16) | layers


def unpack(word: int) -> tuple[int, int]:
    return word >> 16, word & 0xFFFF


class Doorbell:
    """The writer's side (the engine thread). Not thread-safe: one engine thread rings it."""

    def __init__(self) -> None:
        self.name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        fd = os.memfd_create(self.name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, SIZE)
            self._mm: mmap.mmap | None = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd  # what attach hands the daemon
        self._word = ctypes.c_uint64.from_buffer(self._mm)  # an aligned 8-byte store per ring
        self.seq = 0
        self.layers = 0

    def step(self) -> int:
        """Begin the next engine step (before its forward); returns its sequence number."""
        self.seq += 1
        self.layers = 0
        self._word.value = pack(self.seq, 0)
        return self.seq

    def layer_done(self, n: int) -> None:
        """``n`` layers of the current step have their KV written (call after the writes)."""
        if n > self.layers:
            self.layers = min(n, MAX_LAYERS)
            self._word.value = pack(self.seq, self.layers)

    def seal(self) -> None:
        """The current step's forward is complete: every layer of it is written."""
        self.layers = SEALED
        self._word.value = pack(self.seq, SEALED)

    @property
    def proc_path(self) -> str:
        """A path by which other processes of this user may open the page while this process lives."""
        return f"/proc/{os.getpid()}/fd/{self.fd}"

    def close(self) -> None:
        """Unmap the record and close its descriptor (the daemon has detached the worker, or never saw
        it); the page goes with the last mapping."""
        if self._mm is None:
            return
        del self._word
        self._mm.close()
        self._mm = None
        os.close(self.fd)
        self.fd = -1


def reset_ring(fd: int) -> None:
    """Empty the completion ring of the page open as ``fd`` (before an attach: the new daemon counts from 0)."""
    os.pwrite(fd, bytes(SIZE - RING_HEAD), RING_HEAD)


class RingReader:
    """The worker's side of the completion ring (the page open as ``fd``, mapped read-only): the keys
    of finished receives, in order. One thread at a time (the caller locks)."""

    def __init__(self, fd: int) -> None:
        self._mm: mmap.mmap | None = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ)
        self._words = memoryview(self._mm).cast("Q")  # aligned 8-byte loads
        self._head = RING_HEAD // 8
        self._base = RING_BASE // 8
        self.last = 0  # records taken (or skipped) so far

    def ready(self) -> bool:
        """Whether records were written since the last ``take`` (one load)."""
        return self._mm is not None and int(self._words[self._head]) > self.last

    def take(self) -> list[int]:
        """Keys written since the last call. A record whose slot is not visible yet stays for the
        next call; records a whole ring old are skipped (the stream delivers them)."""
        if self._mm is None:
            return []
        w = self._words
        head = int(w[self._head])
        if head <= self.last:  # nothing new (a count below ours is a torn read or a scribble: no state kept)
            return []
        first = max(self.last, head - RING_SLOTS)
        out: list[int] = []
        for i in range(first + 1, head + 1):
            v = int(w[self._base + (i - 1) % RING_SLOTS])
            if v >> KEY_BITS != i & 0xFFFF:
                break
            out.append(v & _KEY_MASK)
            first = i
        self.last = first
        return out

    def close(self) -> None:
        if self._mm is not None:
            self._words.release()
            self._mm.close()
            self._mm = None
