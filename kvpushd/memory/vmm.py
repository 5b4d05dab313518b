"""Import a worker's CUDA virtual memory (vLLM 0.34's extensible KV cache) from POSIX file descriptors.

The worker exports each physical chunk of its KV range (``kvpushd_client.vmm``) and sends the fds to the
fd socket tagged as VMM chunks (``memory/fdpass.py``), then names them in its Attach (``VmmHandle``):
each chunk's offset in the range, the range's reserved size, the device's UUID and granularity. The
daemon imports every chunk (``cuMemImportFromShareableHandle``), reserves one range as large as the
worker's (``cuMemAddressReserve``), maps the chunks at their offsets (``cuMemMap``), opens them to its
device (``cuMemSetAccess``) and checks the sentinel the worker wrote, as for CUDA IPC; each run of
adjacent chunks is then registered with NIXL as VRAM. vLLM keeps one segment per layer in the range and
commits a prefix of each, so the mapped part may have holes: a region (and so every block it names)
must lie in mapped chunks, anything past them is refused, never written. Growth maps more chunks into
the same reservation.

Status (2026-12-05): the plan, the refusals and the fd protocol run on CPU (stand-in driver and libcuda in
tests/daemon/test_vmm_import.py; real daemons without CUDA in tests/daemon/test_vmm_attach.py); the
driver calls wait for a GPU (``scripts/gpu_check.sh run``, tests/daemon/test_vmm_gpu.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvpushd_client.cuda import CudaCalls, load_libcuda, uuid_hex

from ..core.errors import FailedPrecondition, InvalidArgument, NotFound
from .cuda import check_sentinel

CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
MAX_RESERVED = 1 << 46  # 64 TiB: more than any GPU's memory, so a bad size is refused before the driver
MAX_CHUNKS = 1024  # of one Attach: what the fd socket parks for one sender (fdpass.MAX_PER_SENDER)

Interval = tuple[int, int]  # (offset, end) in the range


# The chunks cannot be mapped as described, or an address lies past what is mapped: INVALID_ARGUMENT
# (one error tree, kvpushd_client.errors.KINDS: no class of its own).
VmmImportError = InvalidArgument


@dataclass(frozen=True)
class ChunkSpec:
    """One chunk as the worker described it: its offset in the range and its size (its fd travels apart)."""

    offset: int
    size: int


@dataclass(frozen=True)
class VmmSpec:
    """A ``VmmHandle`` as the daemon reads it; ``tokens[i]`` is what chunk i's fd came under."""

    gpu_uuid: str
    reserved: int
    granularity: int
    chunks: tuple[ChunkSpec, ...]
    tokens: tuple[bytes, ...]
    sentinel: bytes = b""
    sentinel_offset: int = 0
    sentinel_restore: bytes = b""


def merge(intervals: Sequence[Interval]) -> list[Interval]:
    """Sorted, with adjacent ones joined (one NIXL registration each)."""
    out: list[Interval] = []
    for a, b in sorted(intervals):
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def check_chunks(chunks: Sequence[ChunkSpec], granularity: int, mapped: Sequence[Interval],
                 reserved: int) -> list[Interval]:
    """The mapped intervals once ``chunks`` join those in ``mapped``: chunks sorted by offset, whole
    granules at whole-granule offsets, overlapping neither each other nor what is mapped, inside the
    reservation."""
    if granularity <= 0 or granularity & (granularity - 1):
        raise VmmImportError(f"granularity {granularity} is not a power of two")
    if not 0 < reserved <= MAX_RESERVED or reserved % granularity:
        raise VmmImportError(f"reserved size {reserved}: 1 to {MAX_RESERVED} bytes, whole granules of {granularity}")
    if len(chunks) > MAX_CHUNKS:
        raise VmmImportError(f"{len(chunks)} chunks in one handle; at most {MAX_CHUNKS}")
    prev = -1
    for i, c in enumerate(chunks):
        if c.size <= 0 or c.size % granularity or c.offset % granularity:
            raise VmmImportError(f"chunk {i} at offset {c.offset} of {c.size} bytes is not whole granules of "
                                 f"{granularity}")
        if c.offset < prev:
            raise VmmImportError(f"chunk {i} starts at offset {c.offset}, inside or before chunk {i - 1} (chunks "
                                 "go sorted by offset, none overlapping)")
        if c.offset + c.size > reserved:
            raise VmmImportError(f"chunk {i} ends at {c.offset + c.size} bytes, past the reservation of {reserved}")
        for a, b in mapped:
            if c.offset < b and a < c.offset + c.size:
                raise VmmImportError(f"chunk {i} ({c.offset}..{c.offset + c.size}) overlaps memory already mapped "
                                     f"({a}..{b})")
        prev = c.offset + c.size
    return merge([*mapped, *((c.offset, c.offset + c.size) for c in chunks)])


def check_within_mapped(mapped: Sequence[Interval] | int, what: str, start: int, length: int) -> None:
    """Refuse an access to ``[start, start+length)`` of the range that is not inside one mapped run of
    chunks (``mapped``: the intervals, or a byte count mapped from offset 0)."""
    runs = [(0, mapped)] if isinstance(mapped, int) else merge(mapped)
    if start >= 0 and length >= 0 and any(a <= start and start + length <= b for a, b in runs):
        return
    shown = ", ".join(f"{a}..{b}" for a, b in runs[:4]) + (" ..." if len(runs) > 4 else "")
    raise VmmImportError(f"{what} ({start}..{start + length}) lies past the mapped bytes of this worker's KV "
                         f"({shown or 'none'}; vLLM committed more blocks than it handed over): refused, nothing "
                         "written")


def check_spec(spec: VmmSpec) -> list[Interval]:
    """What can be refused before any driver call: the mapped intervals the handle describes."""
    if not spec.gpu_uuid or len(spec.gpu_uuid) > 128:
        raise VmmImportError("VMM handle: gpu_uuid must name the GPU (1-128 characters)")
    if not spec.chunks:
        raise VmmImportError("VMM handle: no chunks")
    mapped = check_chunks(spec.chunks, spec.granularity, [], spec.reserved)
    check_sentinel("VMM handle", spec.sentinel, spec.sentinel_restore)
    if spec.sentinel:
        check_within_mapped(mapped, "the sentinel", spec.sentinel_offset, len(spec.sentinel))
    return mapped


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
    """One worker's range as this daemon maps it: grows by chunks, unmaps in reverse at close.
    ``addr``/``size``: the whole reservation; ``pieces()``: what is mapped (and registered)."""

    driver: Driver
    device: int
    granularity: int
    reserved: int
    base: int = 0
    mapped: list[Interval] = field(default_factory=list)
    handles: list[tuple[int, int, int]] = field(default_factory=list)  # (offset, size, handle)
    mem_type: str = "VRAM"
    gpu_uuid: str = ""

    addr: int = field(init=False, default=0)  # as Mapping: the reservation (base, reserved, device)
    size: int = field(init=False, default=0)
    device_id: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.size, self.device_id = self.reserved, self.device

    @property
    def mapped_bytes(self) -> int:
        return sum(b - a for a, b in self.mapped)

    def pieces(self) -> list[tuple[int, int, int]]:
        """(address, size, device) of each run of adjacent mapped chunks: what NIXL registers."""
        return [(self.base + a, b - a, self.device) for a, b in self.mapped]

    @classmethod
    def open(cls, driver: Driver, device: int, granularity: int, reserved: int, chunks: Sequence[ChunkSpec],
             fds: Sequence[int]) -> VmmMapping:
        reserved = -(-reserved // granularity) * granularity
        m = cls(driver, device, granularity, reserved)
        check_chunks(chunks, granularity, [], reserved)
        m.base = m.addr = driver.reserve(reserved, granularity)
        try:
            m.extend(chunks, fds)
        except BaseException:
            m.close()
            raise
        return m

    def extend(self, chunks: Sequence[ChunkSpec], fds: Sequence[int]) -> None:
        """Map more chunks beside those mapped (growth); the fds are the caller's, closed by it."""
        if len(chunks) != len(fds):
            raise VmmImportError(f"{len(chunks)} chunk(s) described, {len(fds)} descriptor(s) received")
        after = check_chunks(chunks, self.granularity, self.mapped, self.reserved)
        for c, fd in zip(chunks, fds, strict=True):
            h = self.driver.import_fd(fd)
            try:
                self.driver.map(self.base + c.offset, c.size, h)
            except BaseException:
                self.driver.release(h)
                raise
            self.handles.append((c.offset, c.size, h))
        for a, b in merge([(c.offset, c.offset + c.size) for c in chunks]):
            self.driver.set_access(self.base + a, b - a, self.device)
        self.mapped = after

    def close(self) -> None:
        """Unmap and release every chunk, then the reservation (after NIXL deregistered the range)."""
        for off, size, h in reversed(self.handles):
            with contextlib.suppress(VmmImportError):
                self.driver.unmap(self.base + off, size)
            with contextlib.suppress(VmmImportError):
                self.driver.release(h)
        self.handles.clear()
        if self.base:
            with contextlib.suppress(VmmImportError):
                self.driver.free_reserved(self.base, self.reserved)
        self.base = self.addr = 0
        self.mapped = []


class CudaDriver(CudaCalls):
    """``Driver`` on libcuda.so.1 (ctypes); the caller has made a context current on the device."""

    error = VmmImportError

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self.ctx = 0  # made current again before the calls of a close, which may run on another thread

    def _current(self) -> None:
        if self.ctx:
            self._check("cuCtxSetCurrent", self.lib.cuCtxSetCurrent(ctypes.c_void_p(self.ctx)))

    def import_fd(self, fd: int) -> int:
        h = ctypes.c_uint64()
        self._check("cuMemImportFromShareableHandle (is the descriptor a chunk exported with the POSIX-fd handle "
                    "type?)", self.lib.cuMemImportFromShareableHandle(
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
        class _Desc(ctypes.Structure):  # CUmemAccessDesc: CUmemLocation {type, id}, flags
            _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int), ("flags", ctypes.c_int)]

        d = _Desc(CU_MEM_LOCATION_TYPE_DEVICE, device, CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        self._check("cuMemSetAccess", self.lib.cuMemSetAccess(ctypes.c_uint64(addr), ctypes.c_size_t(size),
                                                              ctypes.byref(d), ctypes.c_size_t(1)))

    def unmap(self, addr: int, size: int) -> None:
        self._current()
        self._check("cuMemUnmap", self.lib.cuMemUnmap(ctypes.c_uint64(addr), ctypes.c_size_t(size)))

    def release(self, handle: int) -> None:
        self._check("cuMemRelease", self.lib.cuMemRelease(ctypes.c_uint64(handle)))

    def free_reserved(self, addr: int, size: int) -> None:
        self._check("cuMemAddressFree", self.lib.cuMemAddressFree(ctypes.c_uint64(addr), ctypes.c_size_t(size)))

    def read(self, addr: int, n: int) -> bytes:
        buf = ctypes.create_string_buffer(n)
        self._check("cuMemcpyDtoH", self.lib.cuMemcpyDtoH_v2(buf, ctypes.c_uint64(addr), ctypes.c_size_t(n)))
        return buf.raw

    def write(self, addr: int, data: bytes) -> None:
        self._check("cuMemcpyHtoD", self.lib.cuMemcpyHtoD_v2(ctypes.c_uint64(addr), data, ctypes.c_size_t(len(data))))


_ctx_lock = threading.Lock()
_contexts: dict[int, int] = {}  # ordinal -> its primary context, retained for the daemon's life


def cuda_device(gpu_uuid: str, lib: ctypes.CDLL | None = None) -> tuple[CudaDriver, int]:
    """libcuda with the primary context of the GPU named by UUID current on this thread, and its ordinal.
    FAILED_PRECONDITION, naming what is missing, where there is no driver or no device; NOT_FOUND where
    no visible GPU has that UUID."""
    if lib is None:
        lib = load_libcuda(FailedPrecondition, "VMM memory (vLLM 0.34's extensible KV cache) in the daemon",
                           "; the chunks' descriptors were closed")
    if (rc := lib.cuInit(0)) != 0:
        raise FailedPrecondition(f"VMM memory handed to a daemon where cuInit fails (CUresult {rc}: no usable "
                                 "CUDA device or driver); the chunks' descriptors were closed")
    drv = CudaDriver(lib)
    n = ctypes.c_int()
    drv._check("cuDeviceGetCount", lib.cuDeviceGetCount(ctypes.byref(n)))
    want = uuid_hex(gpu_uuid)
    for i in range(n.value):
        if uuid_hex(drv.device_uuid(i)) != want:
            continue
        with _ctx_lock:
            ctx = _contexts.get(i)
            if ctx is None:
                dev, c = ctypes.c_int(), ctypes.c_void_p()
                drv._check("cuDeviceGet", lib.cuDeviceGet(ctypes.byref(dev), i))
                drv._check("cuDevicePrimaryCtxRetain", lib.cuDevicePrimaryCtxRetain(ctypes.byref(c), dev))
                ctx = _contexts[i] = c.value or 0
        drv.ctx = ctx
        drv._current()
        return drv, i
    raise NotFound(f"no GPU with UUID {gpu_uuid[:128]!r} is visible to the daemon ({n.value} visible)")


def open_vmm(spec: VmmSpec, fds: Sequence[int], lib: ctypes.CDLL | None = None) -> VmmMapping:
    """Import, reserve, map, open to the device, check the sentinel (then put the worker's bytes back).
    The fds are the caller's (closed by it: the imported chunks hold their own references)."""
    check_spec(spec)
    drv, ordinal = cuda_device(spec.gpu_uuid, lib)
    m = VmmMapping.open(drv, ordinal, spec.granularity, spec.reserved, spec.chunks, fds)
    m.gpu_uuid = spec.gpu_uuid
    try:
        if spec.sentinel:
            probe = drv.read(m.base + spec.sentinel_offset, len(spec.sentinel))
            if probe != spec.sentinel:
                raise VmmImportError("VMM mapping does not hold the sentinel the worker wrote (chunks out of order, "
                                     "or not the worker's); refusing to register it")
            if spec.sentinel_restore:
                drv.write(m.base + spec.sentinel_offset, spec.sentinel_restore)
    except BaseException:
        m.close()
        raise
    return m


def close_fds(fds: Sequence[int]) -> None:
    """The imported chunks hold their own references: the received descriptors are closed at once."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def check_regions_mapped(mapped: dict[int, list[Interval]], regions: Sequence[tuple[int, int, int]],
                         first: int = 0) -> None:
    """Each region ``(memory index, offset, span)`` on VMM memory (``mapped``: its intervals by memory
    index) lies inside one mapped run of chunks: no block it names is past what the worker handed over.
    ``first``: the index of the first region, for the message."""
    for i, (mi, off, span) in enumerate(regions, first):
        if mi in mapped:
            check_within_mapped(mapped[mi], f"region {i}'s blocks", off, span)


def check_described(memory: Sequence[object], regions: Sequence[tuple[int, int, int]]) -> None:
    """At Attach, before any fd is taken: each VmmSpec in ``memory`` (check_spec), and each region
    ``(memory index, offset, span)`` against the chunks its memory describes."""
    check_regions_mapped({i: check_spec(m) for i, m in enumerate(memory) if isinstance(m, VmmSpec)}, regions)


def check_growth(worker_id: str, engine_id: str, named_engine: str, mappings: Sequence[object], old: Sequence[object],
                 memory: Sequence[object], regions: Sequence[tuple[int, int, int, int, int, int]]) -> None:
    """A growth Attach (AttachRequest.extends_worker_id) for a worker of ``engine_id`` holding ``mappings``
    with regions ``old`` (transfer.descs.RegionSpec), checked whole: ``memory`` one VmmSpec per mapping (the
    same GPU, reservation and granularity; new chunks beside the mapped ones), ``regions`` the worker's
    again as (memory index, offset, block_len, block_stride, num_blocks, span), the same but for num_blocks,
    which may only grow, every block inside the grown mapping. Then refused, FAILED_PRECONDITION: mapping
    the chunks is written (VmmMapping.extend), registering memory for an agent the NIXL thread already
    holds (and telling peers the larger regions) is not; detach and attach with every chunk instead."""
    if named_engine and named_engine != engine_id:
        raise VmmImportError(f"worker {worker_id} is engine {engine_id!r}'s, not {named_engine[:128]!r}")
    if not all(isinstance(m, VmmMapping) for m in mappings):
        raise FailedPrecondition(f"worker {worker_id}'s memory is not CUDA virtual memory (VmmHandle): only that "
                                 "grows; attach again with the larger memory")
    if len(memory) != len(mappings) or len(regions) != len(old):
        raise VmmImportError(f"a growth names the worker's {len(mappings)} memories and {len(old)} regions again, "
                             f"got {len(memory)} and {len(regions)}")
    grown: dict[int, list[Interval]] = {}
    for i, (spec, m) in enumerate(zip(memory, mappings, strict=True)):
        if not isinstance(spec, VmmSpec) or not isinstance(m, VmmMapping):
            raise VmmImportError(f"memory {i}: a growth names VMM handles only")
        if uuid_hex(spec.gpu_uuid) != uuid_hex(m.gpu_uuid) or spec.granularity != m.granularity or \
                -(-spec.reserved // m.granularity) * m.granularity != m.reserved:
            raise VmmImportError("a growth handle must name the GPU, reservation and granularity of the memory "
                                 f"it grows ({m.gpu_uuid}, {m.reserved} bytes, granules of {m.granularity})")
        grown[i] = check_chunks(spec.chunks, m.granularity, m.mapped, m.reserved)  # new chunks only
    for i, ((mi, off, block_len, stride, num_blocks, _span), was) in enumerate(zip(regions, old, strict=True)):
        same = 0 <= mi < len(mappings) and (mappings[mi].addr + off, block_len, stride) == (  # type: ignore[attr-defined]
            was.addr, was.block_len, was.block_stride)  # type: ignore[attr-defined]
        if not same or num_blocks < was.num_blocks:  # type: ignore[attr-defined]
            raise VmmImportError(f"region {i}: a growth keeps each region's memory, offset, block_len and "
                                 "block_stride, and its num_blocks may only grow")
    check_regions_mapped(grown, [(mi, off, span) for mi, off, _bl, _st, _nb, span in regions])
    raise FailedPrecondition(f"worker {worker_id}: growing memory the NIXL thread has registered is not built yet "
                             "(the chunks check out); detach and attach again with every chunk")


def registrations(m: object) -> list[tuple[int, int, int]]:
    """(address, size, device) NIXL registers for a mapping: each run of mapped chunks of VMM memory,
    the whole mapping otherwise."""
    if isinstance(m, VmmMapping):
        return m.pieces()
    return [(m.addr, m.size, m.device_id)]  # type: ignore[attr-defined]
