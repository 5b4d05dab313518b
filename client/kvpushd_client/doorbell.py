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
host KV is (kvpushd_client.handover).

With GPU KV the engine thread runs ahead of the GPU, so a store from it could claim layers not computed
yet: there the word is written by the CUDA stream (kvpushd_client.gpu_doorbell.GpuDoorbell, same page,
same word); ``gpu_doorbell.make_doorbell(kv_on_cuda)`` picks the one that fits the KV.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets

SIZE = 4096          # one page; the word is at offset 0
SEALED = 0xFFFF      # layers: the step's forward is complete
MAX_LAYERS = SEALED - 1
PREFIX = "kvpushd-kv-bell-"


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
        self._ring(pack(self.seq, 0))
        return self.seq

    def layer_done(self, n: int) -> None:
        """``n`` layers of the current step have their KV written (call after the writes)."""
        if n > self.layers:
            self.layers = min(n, MAX_LAYERS)
            self._ring(pack(self.seq, self.layers))

    def seal(self) -> None:
        """The current step's forward is complete: every layer of it is written."""
        self.layers = SEALED
        self._ring(pack(self.seq, SEALED))

    def _ring(self, value: int) -> None:
        """Store the word (the GPU doorbell queues it on the CUDA stream instead)."""
        self._word.value = value

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
