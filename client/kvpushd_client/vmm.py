"""CUDA virtual memory (``cuMemCreate`` chunks mapped into one range) exported as POSIX file descriptors.

vLLM 0.34's extensible KV cache is such a range; with ``EXPORTS_FD`` declared (vllm/access.py) vLLM creates
its chunks with ``CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR``, so each chunk can be exported
(``cuMemExportToShareableHandle``) and imported by the daemon (``kvpushd/memory/vmm.py``), which maps the
chunks at the same offsets in one range of its own. This module finds the chunks behind a device range
and exports them: ctypes on libcuda, no new dependency.

The chunks' fds go to the daemon's fd socket (``handover.hand_over_chunks``: one datagram per chunk,
the tag byte ``V``, a 16-byte token, the fd) and the Attach names them in a ``VmmHandle`` (``VmmMemory``; an
Attach with ``extends_worker_id`` adds chunks to a live worker: ``KVPushClient.extend``).

Status (2026-12-05): written and tested on CPU against a stand-in driver (the chunk walk, the plan) and
with real daemons (the fd protocol; tests/daemon/test_vmm_attach.py); not run on a GPU.
``scripts/gpu_check.sh run`` (tests/daemon/test_vmm_gpu.py) is where the driver calls get checked.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from .cuda import CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, CU_MEM_LOCATION_TYPE_DEVICE, CudaCalls, load_libcuda

CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0


class VmmError(RuntimeError):
    """A driver call refused, named with its CUresult."""


@dataclass(frozen=True)
class VmmChunk:
    """One physical allocation of the range: its offset in the range, its size, its exported fd."""

    offset: int
    size: int
    fd: int


@dataclass(frozen=True)
class VmmExport:
    """What the worker sends over the daemon's fd socket for one range (the fds in SCM_RIGHTS, in order)."""

    size: int               # the range's bytes the KV uses (mapped by the chunks, from offset 0)
    granularity: int        # the driver's allocation granularity on that device
    device_uuid: str        # the GPU, by UUID (ordinals differ between processes)
    chunks: tuple[VmmChunk, ...]

    def close(self) -> None:
        for c in self.chunks:
            with contextlib.suppress(OSError):
                os.close(c.fd)


@dataclass(frozen=True)
class VmmMemory:
    """One worker range of CUDA virtual memory for an Attach (``VmmHandle``): the chunks mapped in it so far,
    each with its exported fd (kept open by the caller for as long as it may attach; ``close()``).
    ``arm_sentinel``, where given, writes a fresh sentinel for every attach request and returns
    (sentinel, its offset in the range, the bytes that were there)."""

    gpu_uuid: str
    reserved: int
    granularity: int
    chunks: tuple[VmmChunk, ...]
    arm_sentinel: Callable[[], tuple[bytes, int, bytes]] | None = field(default=None, compare=False, repr=False)

    @property
    def size(self) -> int:
        return sum(c.size for c in self.chunks)

    def close(self) -> None:
        VmmExport(0, 0, "", self.chunks).close()


class Driver(Protocol):
    """The libcuda calls the export needs (``CudaDriver``; tests pass a stand-in)."""

    def mapping_at(self, addr: int) -> tuple[int, int]: ...          # (base, size) of the chunk mapped there
    def export_fd(self, addr: int) -> int: ...                        # the chunk mapped at addr, as an fd
    def granularity(self, device: int) -> int: ...
    def device_uuid(self, device: int) -> str: ...


def export_range(driver: Driver, base: int, size: int, device: int) -> VmmExport:
    """Walk ``[base, base+size)`` chunk by chunk and export each; refused where the range has a hole or a
    chunk starts before ``base`` (the daemon maps the chunks from offset 0 of its own range)."""
    if size <= 0:
        raise VmmError(f"a VMM range of {size} bytes")
    chunks: list[VmmChunk] = []
    addr = base
    try:
        while addr < base + size:
            cbase, csize = driver.mapping_at(addr)
            if cbase != addr or csize <= 0:
                raise VmmError(f"the KV range at {base:#x} is not whole chunks: at offset {addr - base} the "
                               f"mapping starts at {cbase:#x} ({csize} bytes)")
            chunks.append(VmmChunk(addr - base, csize, driver.export_fd(addr)))
            addr += csize
        return VmmExport(addr - base, driver.granularity(device), driver.device_uuid(device), tuple(chunks))
    except BaseException:
        VmmExport(0, 0, "", tuple(chunks)).close()
        raise


class CudaDriver(CudaCalls):
    """``Driver`` on libcuda.so.1 (ctypes). Each call checks its CUresult."""

    error = VmmError

    def __init__(self, lib: ctypes.CDLL | None = None) -> None:
        self.lib = lib if lib is not None else load_libcuda(who="exporting CUDA virtual memory")

    def mapping_at(self, addr: int) -> tuple[int, int]:
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self._check("cuMemGetAddressRange", self.lib.cuMemGetAddressRange_v2(
            ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(addr)))
        return base.value, size.value

    def export_fd(self, addr: int) -> int:
        handle = ctypes.c_uint64()
        self._check("cuMemRetainAllocationHandle", self.lib.cuMemRetainAllocationHandle(
            ctypes.byref(handle), ctypes.c_void_p(addr)))
        try:
            fd = ctypes.c_int(-1)
            self._check("cuMemExportToShareableHandle (was the chunk created with the POSIX-fd handle type? "
                        "vLLM does so under EXPORTS_FD)", self.lib.cuMemExportToShareableHandle(
                            ctypes.byref(fd), handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                            ctypes.c_ulonglong(0)))
            return fd.value
        finally:
            self.lib.cuMemRelease(handle)  # the retain's reference; vLLM keeps its own

    def granularity(self, device: int) -> int:
        class _Loc(ctypes.Structure):
            _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]

        class _Prop(ctypes.Structure):  # CUmemAllocationProp
            _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Loc),
                        ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", ctypes.c_ubyte * 8)]

        prop = _Prop(1, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, _Loc(CU_MEM_LOCATION_TYPE_DEVICE, device))
        g = ctypes.c_size_t()
        self._check("cuMemGetAllocationGranularity", self.lib.cuMemGetAllocationGranularity(
            ctypes.byref(g), ctypes.byref(prop), CU_MEM_ALLOC_GRANULARITY_MINIMUM))
        return g.value
