"""VMM memory by file descriptor, as far as a CPU allows: the worker's chunk walk and export
(``kvpushd_client.vmm``), the daemon's import plan, growth and refusals (``kvpushd/memory/vmm.py``), with
stand-in drivers that keep the calls; the driver calls themselves run in ``scripts/gpu_check.sh run``."""

from __future__ import annotations

import os
import socket
from typing import Any

import pytest
from kvpushd_client.vmm import VmmError, export_range

from kvpushd.memory.vmm import ChunkSpec, VmmImportError, VmmMapping, check_chunks, check_within_mapped

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
