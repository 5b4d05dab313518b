"""VMM memory by file descriptor, as far as a CPU allows: the worker's chunk walk and export
(``kvpushd_client.vmm``), the daemon's import plan, growth and refusals (``kvpushd/memory/vmm.py``), with
stand-in drivers that keep the calls; the driver calls themselves run in ``scripts/gpu_check.sh run``."""

from __future__ import annotations

import ctypes
import os
import socket
from typing import Any

import pytest
from kvpushd_client.vmm import VmmError, export_range

from kvpushd.memory.vmm import (
    ChunkSpec,
    VmmImportError,
    VmmMapping,
    VmmSpec,
    check_chunks,
    check_growth,
    check_within_mapped,
    close_fds,
    open_vmm,
)

G = 2 << 20  # a 2 MiB granule


class FakeWorkerDriver:
    """A range of chunks at ``base``; each export hands out a fresh memfd standing in for the chunk."""

    def __init__(self, base: int, sizes: list[int]) -> None:
        self.maps: list[tuple[int, int]] = []
        a = base
        for s in sizes:
            self.maps.append((a, s))
            a += s
        self.exported: list[int] = []

    def mapping_at(self, addr: int) -> tuple[int, int]:
        for b, s in self.maps:
            if b <= addr < b + s:
                return b, s
        raise VmmError(f"nothing mapped at {addr:#x}")

    def export_fd(self, addr: int) -> int:
        fd = os.memfd_create("chunk")
        os.ftruncate(fd, 4096)
        os.pwrite(fd, addr.to_bytes(8, "little"), 0)
        self.exported.append(fd)
        return fd

    def granularity(self, device: int) -> int:
        return G

    def device_uuid(self, device: int) -> str:
        return "GPU-00000000-0000-0000-0000-000000000001"


class FakeDaemonDriver:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.next = 100

    def import_fd(self, fd: int) -> int:
        os.fstat(fd)  # a live descriptor
        self.next += 1
        self.calls.append(("import", self.next))
        return self.next

    def reserve(self, size: int, granularity: int) -> int:
        self.calls.append(("reserve", size))
        return 0x7F0000000000

    def map(self, addr: int, size: int, handle: int) -> None:
        self.calls.append(("map", addr - 0x7F0000000000, size, handle))

    def set_access(self, addr: int, size: int, device: int) -> None:
        self.calls.append(("access", addr - 0x7F0000000000, size, device))

    def unmap(self, addr: int, size: int) -> None:
        self.calls.append(("unmap", addr - 0x7F0000000000, size))

    def release(self, handle: int) -> None:
        self.calls.append(("release", handle))

    def free_reserved(self, addr: int, size: int) -> None:
        self.calls.append(("free", size))


def _send_recv(fds: list[int], payload: bytes) -> tuple[bytes, list[int]]:
    """One datagram with the fds in SCM_RIGHTS, as the worker sends to the daemon's fd socket."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    with a, b:
        socket.send_fds(a, [payload], fds)
        msg, got, _, _ = socket.recv_fds(b, 1 << 16, 64)
    return msg, got


def test_chunks_exported_sent_and_mapped_in_order() -> None:
    w = FakeWorkerDriver(0x1000_0000, [G, 2 * G, G])
    exp = export_range(w, 0x1000_0000, 4 * G, device=0)
    assert [(c.offset, c.size) for c in exp.chunks] == [(0, G), (G, 2 * G), (3 * G, G)]
    assert exp.granularity == G and exp.device_uuid.startswith("GPU-") and exp.size == 4 * G
    desc = ";".join(f"{c.offset}:{c.size}" for c in exp.chunks).encode()
    msg, fds = _send_recv([c.fd for c in exp.chunks], desc)
    exp.close()
    specs = [ChunkSpec(*map(int, part.split(":"))) for part in msg.decode().split(";")]
    # each received fd is the chunk it claims to be (the stand-in memfd holds the chunk's address)
    assert [int.from_bytes(os.pread(fd, 8, 0), "little") - 0x1000_0000 for fd in fds] == [s.offset for s in specs]
    d = FakeDaemonDriver()
    m = VmmMapping.open(d, device=3, granularity=G, reserved=8 * G, chunks=specs[:2], fds=fds[:2])
    assert m.mapped == [(0, 3 * G)] and m.mapped_bytes == 3 * G
    m.extend(specs[2:], fds[2:])  # growth: one more chunk into the same reservation
    assert m.mapped == [(0, 4 * G)] and m.pieces() == [(0x7F0000000000, 4 * G, 3)]
    for fd in fds:
        os.close(fd)
    assert [c for c in d.calls if c[0] in ("map", "access")] == [
        ("map", 0, G, 101), ("map", G, 2 * G, 102), ("access", 0, 3 * G, 3), ("map", 3 * G, G, 103),
        ("access", 3 * G, G, 3)]
    m.close()
    assert d.calls[-7:] == [("unmap", 3 * G, G), ("release", 103), ("unmap", G, 2 * G), ("release", 102),
                            ("unmap", 0, G), ("release", 101), ("free", 8 * G)]  # in reverse, then the range
    assert m.mapped == [] and m.addr == 0


def test_a_range_that_is_not_whole_chunks_is_refused_and_its_fds_closed() -> None:
    w = FakeWorkerDriver(0x1000_0000, [G, G])
    with pytest.raises(VmmError, match="not whole chunks"):
        export_range(w, 0x1000_0000 + 4096, G, device=0)
    with pytest.raises(VmmError, match="nothing mapped"):
        export_range(w, 0x1000_0000, 3 * G, device=0)
    for fd in w.exported:  # what was exported before the refusal is closed
        with pytest.raises(OSError):
            os.fstat(fd)


@pytest.mark.parametrize(("chunks", "mapped", "match"), [
    ([ChunkSpec(0, G + 4096)], [], "not whole granules"),
    ([ChunkSpec(4096, G)], [], "not whole granules"),
    ([ChunkSpec(2 * G, G), ChunkSpec(0, G)], [], "sorted by offset"),
    ([ChunkSpec(0, 2 * G), ChunkSpec(G, G)], [], "sorted by offset"),
    ([ChunkSpec(G, G)], [(0, 2 * G)], "overlaps memory already mapped"),
    ([ChunkSpec(2 * G, 8 * G)], [(0, 2 * G)], "past the reservation"),
])
def test_chunk_plans_refused(chunks: list[ChunkSpec], mapped: list[tuple[int, int]], match: str) -> None:
    with pytest.raises(VmmImportError, match=match):
        check_chunks(chunks, G, mapped, 8 * G)


def test_segments_with_holes_map_and_merge() -> None:
    """vLLM keeps one segment per layer in the range and commits a prefix of each: holes between."""
    assert check_chunks([ChunkSpec(0, G), ChunkSpec(4 * G, G)], G, [], 8 * G) == [(0, G), (4 * G, 5 * G)]
    assert check_chunks([ChunkSpec(G, G), ChunkSpec(5 * G, G)], G, [(0, G), (4 * G, 5 * G)], 8 * G) == [
        (0, 2 * G), (4 * G, 6 * G)]  # growth of both segments: each run stays one registration


def test_a_block_past_the_mapped_range_is_refused() -> None:
    check_within_mapped(4 * G, "block 7 of region 0", 3 * G, G)
    with pytest.raises(VmmImportError, match=r"past the mapped .* refused, nothing written"):
        check_within_mapped(4 * G, "block 8 of region 0", 4 * G, G)
    runs = [(0, G), (4 * G, 5 * G)]
    check_within_mapped(runs, "region 1", 4 * G, G)
    with pytest.raises(VmmImportError, match=r"region 1 .* past the mapped bytes .*0..2097152, 8388608..10485760"):
        check_within_mapped(runs, "region 1", 4 * G, G + 1)
    with pytest.raises(VmmImportError, match="past the mapped"):  # across a hole, even with both ends mapped
        check_within_mapped([(0, G), (2 * G, 3 * G)], "region 0", 0, 3 * G)


def test_a_failed_map_releases_what_was_imported() -> None:
    class Failing(FakeDaemonDriver):
        def map(self, addr: int, size: int, handle: int) -> None:
            if handle == 102:
                raise VmmImportError("cuMemMap failed: CUresult 1")
            super().map(addr, size, handle)

    d = Failing()
    fds = [os.memfd_create("c") for _ in range(2)]
    try:
        with pytest.raises(VmmImportError, match="cuMemMap"):
            VmmMapping.open(d, 0, G, 4 * G, [ChunkSpec(0, G), ChunkSpec(G, G)], fds)
    finally:
        for fd in fds:
            os.close(fd)
    assert ("release", 102) in d.calls and ("release", 101) in d.calls and d.calls[-1] == ("free", 4 * G)


class FakeLib:
    """A stand-in libcuda for ``open_vmm``: one device with UUID bytes 0x11..., memory as a bytearray per
    mapped chunk; the fds it imports are memfds whose first bytes stand for the chunk's contents."""

    UUID = "GPU-11111111-1111-1111-1111-111111111111"

    def __init__(self, init_rc: int = 0) -> None:
        self.init_rc = init_rc
        self.mem: dict[int, bytearray] = {}  # address -> chunk bytes
        self.calls: list[str] = []
        self.next = 0

    @staticmethod
    def _set(ref: Any, v: int) -> int:
        ref._obj.value = v
        return 0

    def cuInit(self, flags: int) -> int:
        return self.init_rc

    def cuGetErrorName(self, rc: int, ref: Any) -> int:
        return 0

    def cuDeviceGetCount(self, ref: Any) -> int:
        return self._set(ref, 1)

    def cuDeviceGet(self, ref: Any, i: int) -> int:
        return self._set(ref, i)

    def cuDeviceGetUuid(self, raw: Any, dev: Any) -> int:
        ctypes.memmove(raw, b"\x11" * 16, 16)
        return 0

    def cuDevicePrimaryCtxRetain(self, ref: Any, dev: Any) -> int:
        return self._set(ref, 0xC7)

    def cuCtxSetCurrent(self, ctx: Any) -> int:
        self.calls.append("current")
        return 0

    def cuMemImportFromShareableHandle(self, ref: Any, fd: Any, kind: int) -> int:
        self.calls.append("import")
        self.next += 1
        return self._set(ref, fd.value)  # the handle is the fd: map reads the chunk from it

    def cuMemAddressReserve(self, ref: Any, size: Any, align: Any, addr: Any, flags: Any) -> int:
        return self._set(ref, 0x7F0000000000)

    def cuMemMap(self, addr: Any, size: Any, off: Any, handle: Any, flags: Any) -> int:
        self.calls.append("map")
        self.mem[addr.value] = bytearray(os.pread(handle.value, size.value, 0).ljust(size.value, b"\0"))
        return 0

    def cuMemSetAccess(self, addr: Any, size: Any, desc: Any, n: Any) -> int:
        self.calls.append("access")
        return 0

    def _at(self, addr: int) -> tuple[bytearray, int]:
        for a, b in self.mem.items():
            if a <= addr < a + len(b):
                return b, addr - a
        raise AssertionError(f"nothing mapped at {addr:#x}")

    def cuMemcpyDtoH_v2(self, buf: Any, addr: Any, n: Any) -> int:
        b, off = self._at(addr.value)
        ctypes.memmove(buf, bytes(b[off:off + n.value]), n.value)
        return 0

    def cuMemcpyHtoD_v2(self, addr: Any, data: bytes, n: Any) -> int:
        b, off = self._at(addr.value)
        b[off:off + n.value] = data
        return 0

    def cuMemUnmap(self, addr: Any, size: Any) -> int:
        self.calls.append("unmap")
        del self.mem[addr.value]
        return 0

    def cuMemRelease(self, h: Any) -> int:
        self.calls.append("release")
        return 0

    def cuMemAddressFree(self, addr: Any, size: Any) -> int:
        self.calls.append("free")
        return 0


def _chunk_fds(contents: list[bytes]) -> list[int]:
    fds = []
    for c in contents:
        fd = os.memfd_create("chunk")
        os.write(fd, c)
        fds.append(fd)
    return fds


def _spec(sentinel: bytes = b"", restore: bytes = b"", uuid: str = FakeLib.UUID, offset: int = 8) -> VmmSpec:
    return VmmSpec(uuid, 4 * G, G, (ChunkSpec(0, G), ChunkSpec(2 * G, G)), (b"a" * 16, b"b" * 16), sentinel, offset,
                   restore)


def test_open_vmm_checks_the_sentinel_and_puts_the_bytes_back() -> None:
    lib = FakeLib()
    fds = _chunk_fds([b"\0" * 8 + b"SENTINEL" + b"tail", b"second"])
    try:
        m = open_vmm(_spec(b"SENTINEL", b"original"), fds, lib)  # type: ignore[arg-type]
        assert m.pieces() == [(0x7F0000000000, G, 0), (0x7F0000000000 + 2 * G, G, 0)] and m.mapped_bytes == 2 * G
        assert bytes(lib.mem[0x7F0000000000][:20]) == b"\0" * 8 + b"originaltail"  # the worker's bytes, back
        m.close()
        assert lib.calls[-7:] == ["current", "unmap", "release", "current", "unmap", "release", "free"]
        assert not lib.mem
    finally:
        close_fds(fds)


def test_open_vmm_refuses_a_wrong_sentinel_writes_nothing_and_unmaps() -> None:
    lib = FakeLib()
    fds = _chunk_fds([b"\0" * 8 + b"SOMETHING ELSE", b""])
    try:
        with pytest.raises(VmmImportError, match="does not hold the sentinel"):
            open_vmm(_spec(b"SENTINEL", b"original"), fds, lib)  # type: ignore[arg-type]
        assert not lib.mem and lib.calls.count("unmap") == 2 and lib.calls[-1] == "free"
    finally:
        close_fds(fds)


def test_open_vmm_without_a_usable_driver_or_gpu() -> None:
    from kvpushd.core.errors import FailedPrecondition, NotFound

    with pytest.raises(FailedPrecondition, match="cuInit fails"):
        open_vmm(_spec(), [], FakeLib(init_rc=100))  # type: ignore[arg-type]
    with pytest.raises(NotFound, match="no GPU with UUID"):
        open_vmm(_spec(uuid="GPU-22222222-2222-2222-2222-222222222222"), [], FakeLib())  # type: ignore[arg-type]


def test_a_growth_is_checked_whole_then_refused() -> None:
    from kvpushd.core.errors import FailedPrecondition
    from kvpushd.transfer.descs import RegionSpec

    d = FakeDaemonDriver()
    fds = [os.memfd_create("c")]
    try:
        m = VmmMapping.open(d, 0, G, 4 * G, [ChunkSpec(0, G)], fds)
    finally:
        close_fds(fds)
    m.gpu_uuid = FakeLib.UUID
    base = m.addr
    old = [RegionSpec(base, 16, G // 16, G // 16, 0)]

    def grow(chunks: list[ChunkSpec], regions: list[tuple[int, int, int, int, int, int]], uuid: str = FakeLib.UUID,
             engine: str = "e") -> None:
        spec = VmmSpec(uuid, 4 * G, G, tuple(chunks), tuple(bytes([i]) * 16 for i in range(len(chunks))))
        check_growth("w1", "e", engine, [m], old, [spec], regions)

    bl = G // 16
    with pytest.raises(FailedPrecondition, match="not built yet"):  # valid: one more chunk, 32 blocks
        grow([ChunkSpec(G, G)], [(0, 0, bl, bl, 32, 32 * bl)])
    with pytest.raises(VmmImportError, match="overlaps memory already mapped"):
        grow([ChunkSpec(0, G)], [(0, 0, bl, bl, 16, 16 * bl)])
    with pytest.raises(VmmImportError, match="num_blocks may only grow"):
        grow([ChunkSpec(G, G)], [(0, 0, bl, bl, 8, 8 * bl)])
    with pytest.raises(VmmImportError, match=r"region 0.s blocks .* past the mapped"):
        grow([ChunkSpec(2 * G, G)], [(0, 0, bl, bl, 32, 32 * bl)])  # a hole between: the region runs into it
    with pytest.raises(VmmImportError, match="must name the GPU, reservation and granularity"):
        grow([ChunkSpec(G, G)], [(0, 0, bl, bl, 32, 32 * bl)], uuid="GPU-2222")
    with pytest.raises(VmmImportError, match="is engine 'e'"):
        grow([ChunkSpec(G, G)], [(0, 0, bl, bl, 32, 32 * bl)], engine="other")
    m.close()


def test_segments_exported_and_named_in_the_attach_request() -> None:
    """vLLM's layout: one segment per layer with a committed prefix each; the Attach names every chunk."""
    from kvpushd_client import Attach, Region, Role, _convert
    from support.vmm import export_segments

    w = FakeWorkerDriver(0x1000_0000, [])
    w.maps = [(0x1000_0000, G), (0x1000_0000 + G, G), (0x1000_0000 + 4 * G, G)]  # segments at 0 and 4G
    mem = export_segments(w, 0x1000_0000, 8 * G, [(0, 2 * G), (4 * G, G), (6 * G, 0)], device=0)
    try:
        assert [(c.offset, c.size) for c in mem.chunks] == [(0, G), (G, G), (4 * G, G)] and mem.size == 3 * G
        regs = [Region(0, 0, 32, G // 16), Region(0, 4 * G, 16, G // 16)]
        with pytest.raises(ValueError, match="were not handed over"):
            _convert.attach_request(Attach("e", Role.CONSUMER, 0, 1, (mem,), tuple(regs)), {}, {0: [b"t" * 16]})
        req = _convert.attach_request(Attach("e", Role.CONSUMER, 0, 1, (mem,), tuple(regs)), {},
                                      {0: [bytes([i]) * 16 for i in range(3)]})
        h = req.memory[0].vmm
        assert (h.gpu_uuid, h.reserved, h.granularity) == (mem.gpu_uuid, 8 * G, G)
        assert [(c.token[0], c.offset, c.size) for c in h.chunks] == [(0, 0, G), (1, G, G), (2, 4 * G, G)]
        assert not h.sentinel
    finally:
        mem.close()


class _Storage:
    """What vmm_memory reads of a torch storage: vLLM 0.34 gives each layer of its extensible KV cache a
    storage over its segment's committed blocks (uint8_tensor_from_ptr over the segment)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.ptr, self.n = ptr, nbytes

    def data_ptr(self) -> int:
        return self.ptr

    def nbytes(self) -> int:
        return self.n


def test_a_segment_storage_goes_as_its_chunks_by_fd() -> None:
    """The connector's path for vLLM 0.34's extensible KV cache (``gpu_memory`` with EXPORTS_FD declared):
    a segment's storage, committed in three chunks, is one VmmMemory of three exported chunks, offsets from
    the storage's first byte; a storage that does not start a chunk is refused, naming the way out."""
    from kvpushd_client.cuda import CudaMemoryError
    from kvpushd_client.memory import vmm_memory

    w = FakeWorkerDriver(0x2000_0000, [G, G, 2 * G])
    m = vmm_memory(_Storage(0x2000_0000, 3 * G + 4096), 0, sentinel=False, drv=w)  # the last chunk partly used
    try:
        assert [(c.offset, c.size) for c in m.chunks] == [(0, G), (G, G), (2 * G, 2 * G)]
        assert (m.reserved, m.granularity, m.gpu_uuid) == (4 * G, G, w.device_uuid(0))
        assert [c.fd for c in m.chunks] == w.exported
    finally:
        m.close()
    for fd in w.exported:
        with pytest.raises(OSError):
            os.fstat(fd)
    with pytest.raises(CudaMemoryError, match=r"extensible KV cache.*could not be exported.*not whole chunks"):
        vmm_memory(_Storage(0x2000_0000 + 4096, G), 0, sentinel=False, drv=w)


def test_the_connector_setting_keeps_cuda_ipc_only_when_asked() -> None:
    from kvpushd_client.vllm.utils import Settings

    assert not Settings.from_extra_config({}).legacy_ipc  # auto: vLLM 0.34's extensible cache goes by fd
    assert Settings.from_extra_config({"kvpushd_kv_cache_access": "legacy_ipc"}).legacy_ipc
    with pytest.raises(ValueError, match="kvpushd_kv_cache_access must be one of auto, legacy_ipc"):
        Settings.from_extra_config({"kvpushd_kv_cache_access": "fd"})


def test_the_reconnecting_link_keeps_its_own_copies_of_the_chunk_descriptors(tmp_path: Any) -> None:
    """The vLLM connector's link re-attaches after a daemon restart with the chunks' descriptors it dup'ed
    at start: the caller closing its own (the worker does when vLLM releases the KV) cannot make the link
    send another file under a reused number; the link closes its copies when it is closed."""
    from kvpushd_client import Region, Role
    from kvpushd_client.reconnect import ReconnectingStreamWorker
    from support.vmm import export_segments

    w = FakeWorkerDriver(0x3000_0000, [G, G])
    mem = export_segments(w, 0x3000_0000, 2 * G, [(0, 2 * G)], device=0)
    link = ReconnectingStreamWorker(str(tmp_path / "none.sock"), {
        "engine_id": "e", "role": Role.CONSUMER, "tp_rank": 0, "tp_size": 1, "memory": [mem],
        "regions": [Region(0, 0, 64, G // 32)]})
    (own,) = link._record.memory
    assert [(c.offset, c.size) for c in own.chunks] == [(0, G), (G, G)]
    assert not {c.fd for c in own.chunks} & {c.fd for c in mem.chunks}
    mem.close()
    for c in own.chunks:  # the same chunks, still open
        assert int.from_bytes(os.pread(c.fd, 8, 0), "little") == 0x3000_0000 + c.offset
    link.close()
    for c in own.chunks:
        with pytest.raises(OSError):
            os.fstat(c.fd)


def _backend(name: str) -> Any:
    from kvpushd.transfer.backends import AgentBackend
    return AgentBackend(name, {}, "", "", "gpu0")


@pytest.mark.parametrize(("tls", "rdma"), [
    ("", True), ("rc,cuda_ipc,cuda_copy", True), ("rc_mlx5,sm", True), ("dc_mlx5", True), ("all", True),
    ("tcp,cuda_copy,cuda_ipc", False), ("sm,self", False), ("^tcp", True), ("^rc,dc,ud", False), ("^ib", False),
])
def test_which_ucx_transports_leave_gpudirect_rdma(tls: str, rdma: bool) -> None:
    from kvpushd.transfer.backends import ucx_rdma_allowed
    assert ucx_rdma_allowed(tls) is rdma


def test_the_attach_of_vmm_memory_says_which_path_it_gets_and_names_the_setting() -> None:
    """nixl#1754: UCX's cuda_ipc cannot share cuMemCreate memory; the daemon says so at attach, naming the
    connector setting that keeps CUDA IPC memory; over LIBFABRIC (FI_HMEM) it is only told."""
    from kvpushd.transfer.backends import vmm_transport_note
    level, note = vmm_transport_note("w1", [_backend("UCX")], {})
    assert level == "warning" and "same node" in note and "nixl#1754" in note
    assert '"kvpushd_kv_cache_access": "legacy_ipc"' in note
    level, note = vmm_transport_note("w1", [_backend("UCX")], {"UCX_TLS": "tcp,cuda_ipc,cuda_copy"})
    assert level == "warning" and "every WRITE of this worker" in note and "'tcp,cuda_ipc,cuda_copy'" in note
    level, note = vmm_transport_note("w1", [_backend("LIBFABRIC")], {"UCX_TLS": "tcp"})
    assert level == "info" and "FI_HMEM" in note
