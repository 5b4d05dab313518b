"""Import a worker's CUDA virtual memory (vLLM 0.34's extensible KV cache) from POSIX file descriptors.

The worker exports each physical chunk of its KV range (``kvpushd_client.vmm``) and sends the fds with
each chunk's offset, the device's UUID and granularity. The daemon imports every chunk
(``cuMemImportFromShareableHandle``), reserves one range as large as the worker's reservation
(``cuMemAddressReserve``), maps the chunks at their offsets in the same order (``cuMemMap``) and opens
them to its device (``cuMemSetAccess``); the range is then registered with NIXL as VRAM. Growth maps
more chunks into the same reservation; an address past what is mapped is refused, never written.

Status (2026-12-05): the plan and the refusals run on CPU against a stand-in driver
(tests/daemon/test_vmm_import.py); the driver calls wait for a GPU (``scripts/gpu_check.sh run``). Not yet
wired into the worker attach (a ``MemoryHandle`` kind in the proto and ``runtime/workers.py``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3


class VmmImportError(ValueError):
    """The chunks cannot be mapped as described, or an address lies past what is mapped."""


@dataclass(frozen=True)
class ChunkSpec:
    """One chunk as the worker described it: its offset in the range and its size (its fd travels apart)."""

    offset: int
    size: int


def check_chunks(chunks: Sequence[ChunkSpec], granularity: int, mapped: int, reserved: int) -> int:
    """The bytes mapped once ``chunks`` follow the ``mapped`` bytes already there: they must continue
    at ``mapped`` without a hole, be whole granules, and stay inside the reservation."""
    if granularity <= 0 or granularity & (granularity - 1):
        raise VmmImportError(f"granularity {granularity} is not a power of two")
    end = mapped
    for i, c in enumerate(chunks):
        if c.offset != end:
            raise VmmImportError(f"chunk {i} starts at offset {c.offset}, expected {end} (chunks must follow "
                                 "each other from the range's start)")
        if c.size <= 0 or c.size % granularity:
            raise VmmImportError(f"chunk {i} is {c.size} bytes, not whole granules of {granularity}")
        end += c.size
    if end > reserved:
        raise VmmImportError(f"chunks end at {end} bytes, past the reservation of {reserved}")
    return end


def check_within_mapped(mapped: int, what: str, start: int, length: int) -> None:
    """Refuse an access to ``[start, start+length)`` of the range past what is mapped."""
    if start < 0 or length < 0 or start + length > mapped:
        raise VmmImportError(f"{what} ({start}..{start + length}) lies past the mapped {mapped} bytes of this "
                             "worker's KV (vLLM committed more blocks than it handed over): refused, nothing "
                             "written")


class Driver(Protocol):
    def import_fd(self, fd: int) -> int: ...
    def reserve(self, size: int, granularity: int) -> int: ...
    def map(self, addr: int, size: int, handle: int) -> None: ...
    def set_access(self, addr: int, size: int, device: int) -> None: ...
    def unmap(self, addr: int, size: int) -> None: ...
    def release(self, handle: int) -> None: ...
    def free_reserved(self, addr: int, size: int) -> None: ...


@dataclass
class VmmMapping:
    """One worker's range as this daemon maps it: grows by chunks, unmaps in reverse at close."""

    driver: Driver
    device: int
    granularity: int
    reserved: int
    base: int = 0
    mapped: int = 0
    handles: list[tuple[int, int, int]] = field(default_factory=list)  # (offset, size, handle)

    @classmethod
    def open(cls, driver: Driver, device: int, granularity: int, reserved: int, chunks: Sequence[ChunkSpec],
             fds: Sequence[int]) -> VmmMapping:
        reserved = -(-reserved // granularity) * granularity
        m = cls(driver, device, granularity, reserved)
        check_chunks(chunks, granularity, 0, reserved)
        m.base = driver.reserve(reserved, granularity)
        try:
            m.extend(chunks, fds)
        except BaseException:
            m.close()
            raise
        return m

    def extend(self, chunks: Sequence[ChunkSpec], fds: Sequence[int]) -> None:
        """Map more chunks after those mapped (growth); the fds are the caller's, closed by it."""
        if len(chunks) != len(fds):
            raise VmmImportError(f"{len(chunks)} chunk(s) described, {len(fds)} descriptor(s) received")
        end = check_chunks(chunks, self.granularity, self.mapped, self.reserved)
        for c, fd in zip(chunks, fds, strict=True):
            h = self.driver.import_fd(fd)
            try:
                self.driver.map(self.base + c.offset, c.size, h)
            except BaseException:
                self.driver.release(h)
                raise
            self.handles.append((c.offset, c.size, h))
        self.driver.set_access(self.base + self.mapped, end - self.mapped, self.device)
        self.mapped = end

    def close(self) -> None:
        """Unmap and release every chunk, then the reservation (after NIXL deregistered the range)."""
        for off, size, h in reversed(self.handles):
            self.driver.unmap(self.base + off, size)
            self.driver.release(h)
        self.handles.clear()
        if self.base:
            self.driver.free_reserved(self.base, self.reserved)
        self.base = self.mapped = 0


class CudaDriver:
    """``Driver`` on libcuda.so.1 (ctypes); the caller has made a context current on the device."""

    def __init__(self, lib: ctypes.CDLL | None = None) -> None:
        self.lib = lib if lib is not None else ctypes.CDLL("libcuda.so.1")

    def _check(self, what: str, rc: int) -> None:
        if rc != 0:
            raise VmmImportError(f"{what} failed: CUresult {rc}")

    def import_fd(self, fd: int) -> int:
        h = ctypes.c_uint64()
        self._check("cuMemImportFromShareableHandle", self.lib.cuMemImportFromShareableHandle(
            ctypes.byref(h), ctypes.c_void_p(fd), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
        return h.value

    def reserve(self, size: int, granularity: int) -> int:
        p = ctypes.c_uint64()
        self._check("cuMemAddressReserve", self.lib.cuMemAddressReserve(
            ctypes.byref(p), ctypes.c_size_t(size), ctypes.c_size_t(granularity), ctypes.c_uint64(0),
            ctypes.c_ulonglong(0)))
        return p.value

    def map(self, addr: int, size: int, handle: int) -> None:
        self._check("cuMemMap", self.lib.cuMemMap(ctypes.c_uint64(addr), ctypes.c_size_t(size),
                                                  ctypes.c_size_t(0), ctypes.c_uint64(handle),
                                                  ctypes.c_ulonglong(0)))

    def set_access(self, addr: int, size: int, device: int) -> None:
        class _Desc(ctypes.Structure):  # CUmemAccessDesc
            _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int), ("flags", ctypes.c_int)]

        d = _Desc(CU_MEM_LOCATION_TYPE_DEVICE, device, CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        self._check("cuMemSetAccess", self.lib.cuMemSetAccess(ctypes.c_uint64(addr), ctypes.c_size_t(size),
                                                              ctypes.byref(d), ctypes.c_size_t(1)))

    def unmap(self, addr: int, size: int) -> None:
        self._check("cuMemUnmap", self.lib.cuMemUnmap(ctypes.c_uint64(addr), ctypes.c_size_t(size)))

    def release(self, handle: int) -> None:
        self._check("cuMemRelease", self.lib.cuMemRelease(ctypes.c_uint64(handle)))

    def free_reserved(self, addr: int, size: int) -> None:
        self._check("cuMemAddressFree", self.lib.cuMemAddressFree(ctypes.c_uint64(addr), ctypes.c_size_t(size)))


def close_fds(fds: Sequence[int]) -> None:
    """The imported chunks hold their own references: the received descriptors are closed at once."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
