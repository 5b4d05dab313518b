"""VMM memory (vLLM 0.34's extensible KV cache) at Attach, with real daemons on a machine without CUDA:
the chunk fds travel on the fd socket tagged as such, are accounted like memfds, and every one is
closed again when the Attach fails (no libcuda here: FAILED_PRECONDITION naming it) or is refused as
malformed (INVALID_ARGUMENT, before any fd is taken); a region past the mapped chunks is refused; a
growth Attach (``extends_worker_id``) is checked. The daemon goes on after each. Stand-ins for chunk
fds: /dev/null (a character device, as the NVIDIA driver's exports are). The driver calls themselves:
tests/daemon/test_vmm_gpu.py, on a GPU."""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import time

import grpc
import pytest
from kvpushd_client import Attach, KVPushError, MemfdMemory, Region, Role, _convert
from kvpushd_client.handover import hand_over, hand_over_chunks
from kvpushd_client.proto.v1 import worker_pb2_grpc
from kvpushd_client.shm import sealed_memfd
from kvpushd_client.vmm import VmmChunk, VmmMemory
from support import scrape, value

from kvpushd.memory import fdpass

G = 2 << 20
UUID = "GPU-00000000-1111-2222-3333-444444444444"


def _has_libcuda() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def _open_fds(pid: int) -> int:
    """The daemon's open descriptors of the kind the chunks here are (/dev/null): sockets, pipes and
    epolls the daemon opens meanwhile for its own work do not count."""
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            n += os.readlink(f"/proc/{pid}/fd/{fd}") == "/dev/null"
    return n


def _chunks(offsets_sizes: list[tuple[int, int]]) -> tuple[VmmChunk, ...]:
    return tuple(VmmChunk(o, s, os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)) for o, s in offsets_sizes)


def _parked(d) -> float:  # type: ignore[no-untyped-def]
    return value(scrape(d), "kvpushd_fd_socket_parked")


def test_chunk_fds_arrive_are_accounted_and_closed_when_the_attach_fails_without_cuda(
        daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("dnode", settings={"metrics": {"listen": "127.0.0.1:0"}})
    base = _open_fds(d.proc.pid)
    mem = VmmMemory(UUID, 8 * G, G, _chunks([(0, G), (G, G), (4 * G, 2 * G)]))  # two segments, a hole between
    regs = [Region(0, 0, 16, G // 8), Region(0, 4 * G, 32, G // 16)]  # each in a mapped run
    try:
        tokens = hand_over_chunks(d.sock, [mem])
        assert len(tokens[0]) == 3
        deadline = time.monotonic() + 10
        while _parked(d) != 3 and time.monotonic() < deadline:  # parked: counted as memfds are
            time.sleep(0.05)
        assert _parked(d) == 3 and _open_fds(d.proc.pid) >= base + 3
        stub = worker_pb2_grpc.WorkerServiceStub(d.client.channel)
        req = _convert.attach_request(Attach("e", Role.CONSUMER, 0, 1, (mem,), tuple(regs)), {}, tokens)
        with pytest.raises(grpc.RpcError) as e:
            stub.Attach(req, timeout=30)
        if _has_libcuda():  # a GPU machine: the driver loads, and no GPU has this UUID
            assert e.value.code() == grpc.StatusCode.NOT_FOUND, e.value
        else:
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION, e.value
            assert "libcuda.so.1" in (e.value.details() or "") and "descriptors were closed" in e.value.details()
        assert _parked(d) == 0 and _open_fds(d.proc.pid) <= base  # every chunk fd closed again
        # the same through the client: sent, refused, closed
        with pytest.raises(KVPushError) as k:
            d.client.attach("e", Role.CONSUMER, 0, 1, [mem], regs)
        assert k.value.code in ("FAILED_PRECONDITION", "NOT_FOUND"), k.value
        assert _parked(d) == 0 and _open_fds(d.proc.pid) <= base
        _memfd_attaches(d)  # the daemon went on
    finally:
        mem.close()
    daemon_factory.close(check=(d,))


def _memfd_attaches(d) -> None:  # type: ignore[no-untyped-def]
    fd = sealed_memfd("vmm-after", 16 * 4096)
    try:
        d.client.attach("after", Role.CONSUMER, 0, 1, [MemfdMemory(fd, 16 * 4096)], [Region(0, 0, 16, 4096)]).detach()
    finally:
        os.close(fd)


def test_malformed_vmm_handles_are_refused_invalid_argument_and_leak_no_fd(
        daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("dnode", settings={"metrics": {"listen": "127.0.0.1:0"}})
    base = _open_fds(d.proc.pid)
    ok_regs = [Region(0, 0, 8, G // 8)]
    cases: list[tuple[VmmMemory, list[Region], str]] = [
        (VmmMemory(UUID, 8 * G, 3 * 4096, _chunks([(0, 3 * 4096)])), ok_regs, "not a power of two"),
        (VmmMemory(UUID, 0, G, _chunks([(0, G)])), ok_regs, "reserved size 0"),
        (VmmMemory(UUID, 8 * G, G, _chunks([(0, 2 * G), (G, G)])), ok_regs, "sorted by offset, none overlapping"),
        (VmmMemory(UUID, 4 * G, G, _chunks([(2 * G, 4 * G)])), ok_regs, "past the reservation"),
        (VmmMemory(UUID, 8 * G, G, _chunks([(0, G + 4096)])), ok_regs, "not whole granules"),
        (VmmMemory("", 8 * G, G, _chunks([(0, G)])), ok_regs, "gpu_uuid must name the GPU"),
        (VmmMemory(UUID, 8 * G, G, ()), ok_regs, "no chunks"),
        # blocks past what is mapped: region 0 runs one block past its chunk, region 1 over a hole
        (VmmMemory(UUID, 8 * G, G, _chunks([(0, G)])), [Region(0, 0, 9, G // 8)],
         "region 0's blocks (0..2359296) lies past the mapped bytes"),
        (VmmMemory(UUID, 8 * G, G, _chunks([(0, G), (2 * G, G)])), [Region(0, 0, 8, G // 8), Region(0, 0, 3, G)],
         "region 1's blocks (0..6291456) lies past the mapped bytes"),
    ]
    try:
        for mem, regs, words in cases:
            with pytest.raises(KVPushError) as e:
                d.client.attach("e", Role.CONSUMER, 0, 1, [mem], regs)
            assert e.value.code == "INVALID_ARGUMENT" and words in e.value.message, (words, e.value)
        assert _parked(d) == 0 and _open_fds(d.proc.pid) <= base
        stub = worker_pb2_grpc.WorkerServiceStub(d.client.channel)
        mem = VmmMemory(UUID, 8 * G, G, _chunks([(0, G)]))
        cases.append((mem, ok_regs, ""))
        req = _convert.attach_request(Attach("e", Role.CONSUMER, 0, 1, (mem,), tuple(ok_regs)), {}, {0: [b"short"]})
        with pytest.raises(grpc.RpcError) as r:
            stub.Attach(req, timeout=10)
        assert r.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "16 bytes" in (r.value.details() or "")
        # a memfd sent as a memfd and named as a chunk, and a memfd tagged as a chunk
        fd = sealed_memfd("vmm-memfd", G)
        try:
            as_memfd = hand_over(d.sock, [MemfdMemory(fd, G)])[0]
            req = _convert.attach_request(Attach("e", Role.CONSUMER, 0, 1, (mem,), tuple(ok_regs)), {}, {0: [as_memfd]})
            with pytest.raises(grpc.RpcError) as r:
                stub.Attach(req, timeout=10)
            assert r.value.code() == grpc.StatusCode.INVALID_ARGUMENT, r.value
            assert "came as a memfd, and the Attach names it as a VMM chunk" in (r.value.details() or "")
            tagged = hand_over_chunks(d.sock, [VmmMemory(UUID, 8 * G, G, (VmmChunk(0, G, fd),))])
            req = _convert.attach_request(Attach("e", Role.CONSUMER, 0, 1, (mem,), tuple(ok_regs)), {}, tagged)
            with pytest.raises(grpc.RpcError) as r:
                stub.Attach(req, timeout=10)
            assert r.value.code() == grpc.StatusCode.PERMISSION_DENIED, r.value
            assert "a regular file, not a CUDA VMM chunk" in (r.value.details() or "")
        finally:
            os.close(fd)
        assert _parked(d) == 0 and _open_fds(d.proc.pid) <= base
        _memfd_attaches(d)
    finally:
        for m, _r, _w in cases:
            m.close()
    daemon_factory.close(check=(d,))


def test_a_growth_attach_is_checked_and_its_fds_closed(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """``extends_worker_id``: an unknown worker, another's token, a worker without VMM memory: each
    refused, the new chunks' fds closed. (A VMM worker's growth needs a GPU: test_vmm_gpu.py.)"""
    d = daemon_factory("dnode", settings={"metrics": {"listen": "127.0.0.1:0"}})
    size = 16 * 4096
    fd = sealed_memfd("vmm-grow", size)
    grow = VmmMemory(UUID, 8 * G, G, _chunks([(G, G)]))
    try:
        w = d.client.attach("e", Role.CONSUMER, 0, 1, [MemfdMemory(fd, size)], [Region(0, 0, 16, 4096)])
        base = _open_fds(d.proc.pid)
        regs = [Region(0, 0, 16, 4096)]
        with pytest.raises(KVPushError) as e:
            d.client.extend(w, "e", Role.CONSUMER, 0, 1, [grow], regs)
        assert e.value.code == "FAILED_PRECONDITION" and "not CUDA virtual memory" in e.value.message, e.value
        token, w.token = w.token, b"x" * 16
        with pytest.raises(KVPushError) as e:
            d.client.extend(w, "e", Role.CONSUMER, 0, 1, [grow], regs)
        assert e.value.code == "PERMISSION_DENIED", e.value
        w.token, wid = token, w.worker_id
        w.worker_id = "w999-unknown"
        with pytest.raises(KVPushError) as e:
            d.client.extend(w, "e", Role.CONSUMER, 0, 1, [grow], regs)
        assert e.value.code == "NOT_FOUND", e.value
        w.worker_id = wid
        assert _parked(d) == 0 and _open_fds(d.proc.pid) <= base
        w.detach()
    finally:
        grow.close()
        os.close(fd)
    daemon_factory.close(check=(d,))


def test_the_inbox_bounds_chunks_as_memfds_and_refuses_files_tagged_as_chunks(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The inbox alone: chunks count against the per-sender bound and the TTL like memfds."""
    from kvpushd.core.errors import InvalidArgument, PermissionDenied

    monkeypatch.setattr(fdpass, "MAX_PER_SENDER", 2)
    inbox = fdpass.FdInbox(str(tmp_path / "w.sock.fd"), 0o600)
    inbox.start(None)
    null = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
    mfd = sealed_memfd("vmm-inbox", 4096)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.connect(inbox.path)
            for t in b"abc":
                socket.send_fds(s, [b"V" + bytes([t]) * 16], [null])
            socket.send_fds(s, [b"V" + b"m" * 16], [mfd])  # a file tagged as a chunk
            socket.send_fds(s, [b"V" + b"n" * 15], [null])  # 16 bytes with the tag: a malformed memfd datagram
        inbox.drain()
        assert inbox.parked == 2 and inbox.dropped == 3  # its own oldest went; the file and the short one refused
        with pytest.raises(InvalidArgument, match="came as a VMM chunk, and the Attach names it as a memfd"):
            inbox.take(b"b" * 16)
        os.close(inbox.take(b"b" * 16, fdpass.VMM))
        with pytest.raises(PermissionDenied, match="VMM chunk token was refused on arrival: a regular file"):
            inbox.take(b"m" * 16, fdpass.VMM)
        with pytest.raises(Exception, match=r"no descriptor arrived .* under this VMM chunk token"):
            inbox.take(b"a" * 16, fdpass.VMM)
        monkeypatch.setattr(fdpass, "TTL_S", 0.0)
        inbox.drain()
        assert inbox.parked == 0  # expired
    finally:
        inbox.close()
        os.close(null)
        os.close(mfd)
