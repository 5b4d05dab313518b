"""Host KV in sealed memfds, handed to the daemon by descriptor on its fd socket.

A named /dev/shm object could be truncated by its worker while a WRITE copies into it. Over UCX's TCP
transport the decode daemon does that copy itself, so it died of SIGBUS (exit -7), with every other
worker's transfers on the node: the daemon takes no /dev/shm name. A memfd sealed against shrinking
cannot be cut, and the daemon takes no other descriptor. Real daemons, real NIXL.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import resource
import socket
import subprocess
import sys
import time

import grpc
import pytest
from kvpushd_client import (
    Attach,
    CompletionKind,
    KVPushClient,
    KVPushError,
    MemfdMemory,
    Region,
    Role,
    _convert,
)
from kvpushd_client.handover import hand_over
from kvpushd_client.proto.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from kvpushd_client.shm import sealed_memfd
from kvpushd_client.types import Expect, Publish
from support import POISON, attach_pair, make_kv, scrape, value, wait_for

from kvpushd.memory import fdpass

TCP = "[transfer]\npublish_timeout_s = 10.0\nexpect_timeout_s = 10.0\nwrite_timeout_s = 3.0\n"


@pytest.fixture
def tcp(monkeypatch: pytest.MonkeyPatch) -> None:
    """UCX over TCP: the transport on which the receiving daemon copies into the worker's memory."""
    monkeypatch.setenv("UCX_TLS", "tcp")


def _move(pw, dw, p, tid: str, src_blocks: list[int], dst_blocks: list[int]):  # type: ignore[no-untyped-def]
    dw.send(Expect(tid, tuple(dst_blocks), p.peer_address, "prefill", 1))
    pw.send(Publish(tid, tuple(src_blocks)))
    c = dw.next_completion(30)
    assert pw.next_completion(30) is not None
    return c


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_a_sealed_memfd_cannot_be_cut(daemon_factory, tcp) -> None:  # type: ignore[no-untyped-def]
    p, d = daemon_factory.pair(TCP)
    src, dst = make_kv("mf-src"), make_kv("mf-dst", fill="poison")
    try:
        pw, dw = attach_pair(p, d, src, dst)
        with pytest.raises(PermissionError):  # F_SEAL_SHRINK: nobody may cut it, by any path
            os.truncate(f"/proc/self/fd/{dst.buf.fd}", 0)
        with pytest.raises(PermissionError):
            os.ftruncate(dst.buf.fd, 4096)
        with pytest.raises(PermissionError):  # nor take the seal off
            fcntl.fcntl(dst.buf.fd, fcntl.F_ADD_SEALS, 0)
        c = _move(pw, dw, p, "sealed", [1, 2, 60], [3, 4, 5])
        assert c is not None and c.kind is CompletionKind.FINISHED_RECEIVING, c
        assert (dst.arr[:, [3, 4, 5]] == src.arr[:, [1, 2, 60]]).all()
        assert (dst.arr[:, [0, 6]] == POISON).all()
        assert not [n for n in os.listdir("/dev/shm") if n.startswith("mf-dst")]  # no name anywhere
    finally:
        src.close()
        dst.close()
    daemon_factory.close(check=(p, d))


def test_what_the_daemon_refuses(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("dnode")
    c = d.client
    regs = [Region(0, 0, 16, 4096)]
    size = 16 * 4096
    shm_path = f"/dev/shm/mf-named-{os.getpid()}"
    shm_fd = os.open(shm_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    os.ftruncate(shm_fd, size)
    bare = os.memfd_create("mf-unsealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(bare, size)
    good = sealed_memfd("mf-good", size)
    ro = os.open(f"/proc/self/fd/{good}", os.O_RDONLY)
    base = _open_fds(d.proc.pid)
    try:
        cases = [
            ([MemfdMemory(bare, size)], "PERMISSION_DENIED", "not a memfd sealed against shrinking"),
            ([MemfdMemory(shm_fd, size)], "PERMISSION_DENIED", "not a memfd sealed against shrinking"),
            ([MemfdMemory(ro, size)], "PERMISSION_DENIED", "cannot be mapped for reading and writing"),
            ([MemfdMemory(good, size * 2)], "INVALID_ARGUMENT", "the worker declared"),
        ]
        for memory, code, words in cases:
            with pytest.raises(KVPushError) as e:
                c.attach("e", Role.CONSUMER, 0, 1, memory, regs)
            assert e.value.code == code and words in e.value.message, (memory, e.value)
        stub = worker_pb2_grpc.WorkerServiceStub(c.channel)
        req = _convert.attach_request(Attach("e", Role.CONSUMER, 0, 1, [], regs))  # a /dev/shm object by name
        req.memory.append(common_pb2.MemoryHandle(shm=common_pb2.ShmHandle(name=os.path.basename(shm_path), size=size)))
        with pytest.raises(grpc.RpcError) as r:
            stub.Attach(req, timeout=10)
        assert r.value.code() is grpc.StatusCode.PERMISSION_DENIED and "by /dev/shm name" in (r.value.details() or "")
        for token, code, words in [(b"\0" * 16, grpc.StatusCode.NOT_FOUND, "no descriptor arrived"),
                                   (b"short", grpc.StatusCode.INVALID_ARGUMENT, "16 bytes")]:
            req = _convert.attach_request(Attach("e", Role.CONSUMER, 0, 1, [], regs))
            req.memory.append(common_pb2.MemoryHandle(memfd=common_pb2.MemfdHandle(token=token, size=size)))
            with pytest.raises(grpc.RpcError) as r:
                stub.Attach(req, timeout=10)
            assert r.value.code() == code and words in (r.value.details() or ""), r.value
        assert _open_fds(d.proc.pid) <= base  # every descriptor it was handed is closed again
        # the daemon went on: the sealed memfd attaches
        w = c.attach("e", Role.CONSUMER, 0, 1, [MemfdMemory(good, size)], regs)
        w.detach()
    finally:
        for fd in (bare, good, ro, shm_fd):
            os.close(fd)
        os.unlink(shm_path)
    daemon_factory.close(check=(d,))


_FLOOD = """
import os, socket, sys
path, n = sys.argv[1], int(sys.argv[2])
first = int(sys.argv[3]) if len(sys.argv) > 3 else 0  # tokens first..first+n-1
fd = os.memfd_create("mf-flood", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
os.ftruncate(fd, 4096)
with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
    s.connect(path)
    s.send(b"x" * 16)  # no descriptor
    socket.send_fds(s, [b"short"], [fd])  # wrong token size
    socket.send_fds(s, [b"t" * 16], [fd, fd, fd])  # three descriptors
    socket.send_fds(s, [b"u" * 16], [fd] * 8)  # more than one datagram may carry
    for i in range(n):  # a flood of well-formed ones nobody attaches with
        socket.send_fds(s, [(first + i).to_bytes(16, "big")], [fd])
"""


def test_junk_and_floods_on_the_fd_socket_hold_no_descriptors_and_push_out_only_the_floods_own(
        daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """A worker's memfd waits for its Attach while another process floods the fd socket: the flood
    pushes out its own descriptors (at most MAX_PER_SENDER of one process wait), not the worker's."""
    d = daemon_factory("dnode", settings={"metrics": {"listen": "127.0.0.1:0"}})
    path = fdpass.fd_socket_path(d.sock)
    assert oct(os.stat(path).st_mode & 0o777) == oct(0o660)
    base = _open_fds(d.proc.pid)
    size = 16 * 4096
    fd = sealed_memfd("mf-victim", size)
    try:
        token = hand_over(d.sock, [MemfdMemory(fd, size)])[0]  # handed over, its Attach still to come
        flood = fdpass.MAX_PARKED + 64
        subprocess.run([sys.executable, "-c", _FLOOD, path, str(flood)], check=True, timeout=120)

        def fd_socket() -> tuple[float, float]:
            m = scrape(d)
            return value(m, "kvpushd_fd_socket_parked"), value(m, "kvpushd_fd_socket_dropped_total")

        assert wait_for(lambda: sum(fd_socket()) == 1 + 4 + flood, timeout=10)  # every datagram read
        # the worker that handed its memfd over before the flood attaches with it
        req = _convert.attach_request(Attach("e", Role.CONSUMER, 0, 1, [], [Region(0, 0, 16, 4096)]))
        req.memory.append(common_pb2.MemoryHandle(memfd=common_pb2.MemfdHandle(token=token, size=size)))
        stub = worker_pb2_grpc.WorkerServiceStub(d.client.channel)
        resp = stub.Attach(req, timeout=30)
        stub.Detach(worker_pb2.DetachRequest(worker_id=resp.worker_id, worker_token=resp.worker_token), timeout=30)
        # what was dropped (4 malformed, the flood's oldest) and what waits shows in the metrics
        assert fd_socket() == (fdpass.MAX_PER_SENDER, 4 + flood - fdpass.MAX_PER_SENDER)
        # held until their TTL (waited for: the scrape's HTTP connection and the detached worker's memory
        # close a moment after their answers, on the daemon's other threads)
        assert wait_for(lambda: base <= _open_fds(d.proc.pid) <= base + fdpass.MAX_PER_SENDER, timeout=10), (
            _open_fds(d.proc.pid), base)
        # and so does one attaching now
        kv = make_kv("mf-after", regions=1, num_blocks=16)
        try:
            w = d.client.attach("e", Role.CONSUMER, 0, 1, [kv.buf.memory], kv.region_list)
            w.detach()
        finally:
            kv.close()
        assert d.proc.poll() is None
    finally:
        os.close(fd)
    daemon_factory.close(check=(d,))
    assert not os.path.exists(path)  # removed at stop


def test_floods_from_many_processes_never_push_out_a_parked_memfd(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """Six processes send MAX_PER_SENDER memfds each (more than MAX_PARKED in all): the memfd a worker
    handed over before them is not pushed out (its Attach succeeds); once the socket is full a new
    arrival is refused and its Attach hears RESOURCE_EXHAUSTED, saying why; the daemon goes on."""
    d = daemon_factory("dnode", settings={"metrics": {"listen": "127.0.0.1:0"}})
    path = fdpass.fd_socket_path(d.sock)
    size = 16 * 4096
    fd = sealed_memfd("mf-victim", size)
    try:
        token = hand_over(d.sock, [MemfdMemory(fd, size)])[0]
        n = fdpass.MAX_PER_SENDER
        procs = [subprocess.Popen([sys.executable, "-c", _FLOOD, path, str(n), str(k * n)]) for k in range(6)]
        for p in procs:
            assert p.wait(timeout=120) == 0
        sent = 1 + 6 * (4 + fdpass.MAX_PER_SENDER)

        def fd_socket() -> tuple[float, float]:
            m = scrape(d)
            return value(m, "kvpushd_fd_socket_parked"), value(m, "kvpushd_fd_socket_dropped_total")

        assert wait_for(lambda: sum(fd_socket()) == sent, timeout=20), fd_socket()
        assert fd_socket()[0] == fdpass.MAX_PARKED
        stub = worker_pb2_grpc.WorkerServiceStub(d.client.channel)
        req = _convert.attach_request(Attach("e", Role.CONSUMER, 0, 1, [], [Region(0, 0, 16, 4096)]))
        req.memory.append(common_pb2.MemoryHandle(memfd=common_pb2.MemfdHandle(token=token, size=size)))
        resp = stub.Attach(req, timeout=30)  # the victim's memfd was kept
        stub.Detach(worker_pb2.DetachRequest(worker_id=resp.worker_id, worker_token=resp.worker_token), timeout=30)
        kv = make_kv("mf-late", regions=1, num_blocks=16)  # one slot freed by the Attach above, then full
        kv2 = make_kv("mf-later", regions=1, num_blocks=16)
        try:
            w = d.client.attach("e", Role.CONSUMER, 0, 1, [kv.buf.memory], kv.region_list)
            w.detach()
            fill = subprocess.run([sys.executable, "-c", _FLOOD, path, "1", str(7 * n)], timeout=60)
            assert fill.returncode == 0
            with pytest.raises(KVPushError) as ei:
                d.client.attach("e", Role.CONSUMER, 0, 1, [kv2.buf.memory], kv2.region_list)
            assert ei.value.code == "RESOURCE_EXHAUSTED" and "already holds" in ei.value.message, ei.value
        finally:
            kv.close()
            kv2.close()
        assert d.proc.poll() is None
    finally:
        os.close(fd)


def _inbox_sent(tmp_path, tokens: bytes) -> tuple[fdpass.FdInbox, int]:  # type: ignore[no-untyped-def]
    """An inbox alone (bound, read when taken from), and a memfd this process sent it under each of
    ``tokens`` (a byte each, repeated to 16); the caller closes both."""
    inbox = fdpass.FdInbox(str(tmp_path / "w.sock.fd"), 0o600)
    inbox.start(None)
    fd = sealed_memfd("mf-inbox", 4096)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.connect(inbox.path)
        for t in tokens:
            socket.send_fds(s, [bytes([t]) * 16], [fd])
    return inbox, fd


def test_inbox_expires_and_refuses_when_full(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The inbox alone: parked descriptors go after their TTL; past MAX_PARKED a new arrival is
    refused (RESOURCE_EXHAUSTED at its Attach), none that waits is pushed out."""
    from kvpushd.core.errors import ResourceExhausted

    monkeypatch.setattr(fdpass, "MAX_PARKED", 2)
    monkeypatch.setattr(fdpass, "MAX_PER_SENDER", 8)
    inbox, fd = _inbox_sent(tmp_path, b"abc")
    try:
        with pytest.raises(ResourceExhausted, match="already holds 2 descriptors"):
            inbox.take(b"c" * 16)  # refused: two wait already
        os.close(inbox.take(b"a" * 16))  # the first two were kept
        monkeypatch.setattr(fdpass, "TTL_S", 0.0)
        time.sleep(0.01)
        with pytest.raises(Exception, match="no descriptor arrived"):
            inbox.take(b"b" * 16)  # expired
        assert inbox.dropped == 2
    finally:
        inbox.close()
        os.close(fd)
    assert not os.path.exists(inbox.path)


def test_inbox_bounds_each_sending_process_and_not_senders_it_cannot_name(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The inbox alone: a datagram's sender is the pid the kernel gives (SO_PASSCRED); past
    MAX_PER_SENDER a sender's own oldest go. Senders in another pid namespace arrive as pid 0: only
    the overall bound holds them (one pid 0 is many pods' workers)."""
    monkeypatch.setattr(fdpass, "MAX_PER_SENDER", 2)
    inbox, fd = _inbox_sent(tmp_path, b"abc")
    try:
        inbox.drain()
        assert inbox.parked == 2 and inbox.dropped == 1  # this process's oldest went
        assert {pid for _fd, _t, pid, _kind in inbox._parked.values()} == {os.getpid()}
        for i in range(4):  # as if from other pid namespaces
            inbox._park(bytes([i]) * 16, os.dup(fd), 0)
        assert inbox.parked == 6 and inbox.dropped == 1
        os.close(inbox.take(b"c" * 16))
        with pytest.raises(Exception, match="pushed out by 2 its sender sent after it"):
            inbox.take(b"a" * 16)
    finally:
        inbox.close()
        os.close(fd)


def test_hand_over_to_a_daemon_without_an_fd_socket_says_so(tmp_path) -> None:
    fd = sealed_memfd("mf-nobody", 4096)
    try:
        with pytest.raises(KVPushError, match="fd socket"):
            hand_over(str(tmp_path / "none.sock"), [MemfdMemory(fd, 4096)])
    finally:
        os.close(fd)


def test_hand_over_of_a_closed_descriptor_is_the_callers_error(tmp_path) -> None:
    """Not UNAVAILABLE (which the vLLM connector retries for connect_timeout_s, saying no daemon
    answers): the descriptor is the caller's, and retrying cannot help."""
    from kvpushd_client.errors import InvalidArgument

    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as daemon:
        daemon.bind(str(tmp_path / "w.sock.fd"))
        for fd in (-1, 1 << 20):  # a closed Doorbell's; a number nothing has open
            with pytest.raises(InvalidArgument, match="is not open"):
                hand_over(str(tmp_path / "w.sock"), [MemfdMemory(fd, 4096)])


def test_an_attach_refused_early_holds_none_of_its_descriptors(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """Refused before its memory was looked at (a bad rank, a rank taken), an Attach still hands its
    descriptors back at once, doorbell page included: a worker that gives up then would otherwise
    leave its whole KV alive in the daemon until the inbox next looked at its clock."""
    from kvpushd_client.doorbell import Doorbell

    d = daemon_factory("dnode")
    regs = [Region(0, 0, 16, 4096)]
    good = sealed_memfd("mf-early", 16 * 4096)
    base = _open_fds(d.proc.pid)
    bell = Doorbell()
    try:
        mem = [MemfdMemory(good, 16 * 4096)]
        for rank, size in ((2, 2), (0, 1)):  # tp_rank >= tp_size; then the rank someone holds
            held = d.client.attach("e", Role.CONSUMER, 0, 1, mem, regs) if rank == 0 else None
            at_start = _open_fds(d.proc.pid)
            with pytest.raises(KVPushError):
                d.client.attach("e", Role.CONSUMER, rank, size, mem, regs, doorbell=bell)
            assert _open_fds(d.proc.pid) <= at_start, "the refused Attach's descriptors are still held"
            if held is not None:
                held.detach()
        assert wait_for(lambda: _open_fds(d.proc.pid) <= base, timeout=10)
    finally:
        bell.close()
        os.close(good)
    daemon_factory.close(check=(d,))


def test_an_attach_with_a_malformed_handle_after_good_ones_holds_none_of_them(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """A handle the daemon cannot even read (a token of the wrong length) after memfds it was handed:
    the Attach is refused before any memory is looked at, and the good ones are closed at once too."""
    d = daemon_factory("dnode")
    c = d.client
    regs = [Region(0, 0, 16, 4096)]
    fds = [sealed_memfd(f"mf-bad-{i}", 16 * 4096) for i in range(3)]
    base = _open_fds(d.proc.pid)
    try:
        tokens = hand_over(c.socket_path, [MemfdMemory(fd, 16 * 4096) for fd in fds])
        assert wait_for(lambda: _open_fds(d.proc.pid) >= base + 3, timeout=10)  # parked in the daemon
        req = _convert.attach_request(Attach("e", Role.CONSUMER, 0, 1, [], regs))
        for i in range(3):
            req.memory.append(common_pb2.MemoryHandle(memfd=common_pb2.MemfdHandle(token=tokens[i], size=16 * 4096)))
        req.memory.append(common_pb2.MemoryHandle(memfd=common_pb2.MemfdHandle(token=b"short", size=4096)))
        stub = worker_pb2_grpc.WorkerServiceStub(c.channel)
        with pytest.raises(grpc.RpcError) as r:
            stub.Attach(req, timeout=10)
        assert r.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "16 bytes" in (r.value.details() or "")
        assert _open_fds(d.proc.pid) <= base, "the refused Attach's good descriptors are still held"
        del req.memory[3]  # the same tokens again: they were closed, not kept for a retry
        with pytest.raises(grpc.RpcError) as r:
            stub.Attach(req, timeout=10)
        assert r.value.code() == grpc.StatusCode.NOT_FOUND, r.value
        w = c.attach("e", Role.CONSUMER, 0, 1, [MemfdMemory(fds[0], 16 * 4096)], regs)  # the daemon went on
        w.detach()
    finally:
        for fd in fds:
            os.close(fd)
    daemon_factory.close(check=(d,))


def test_parked_descriptors_expire_with_nothing_else_arriving(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A descriptor whose Attach never comes is closed after TTL_S by the loop's own timer."""
    import asyncio

    monkeypatch.setattr(fdpass, "TTL_S", 0.05)
    fd = sealed_memfd("mf-ttl", 4096)

    async def run() -> int:
        inbox = fdpass.FdInbox(str(tmp_path / "t.sock.fd"), 0o600)
        inbox.start(asyncio.get_running_loop())
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
                s.connect(inbox.path)
                socket.send_fds(s, [b"k" * 16], [fd])
            await asyncio.sleep(0.02)
            assert inbox.parked == 1
            await asyncio.sleep(0.3)  # nothing else arrives
            return inbox.parked
        finally:
            inbox.close()

    try:
        assert asyncio.run(run()) == 0
    finally:
        os.close(fd)


def test_an_attach_a_draining_daemon_refuses_hands_its_descriptors_back(tmp_path) -> None:
    """The servicer closes what an Attach handed over whatever refused it, a draining node included
    (unit test: a node that refuses every Attach, the real inbox and socket)."""
    import asyncio
    from types import SimpleNamespace

    from kvpushd.core.errors import Unavailable
    from kvpushd.rpc.worker import WorkerServicer

    fds = [sealed_memfd(f"mf-drain-{i}", 4096) for i in range(2)]
    sock = str(tmp_path / "w.sock")

    class Draining:
        workers = SimpleNamespace(fds=fdpass.FdInbox(f"{sock}.fd", 0o600))

        async def attach(self, *args: object) -> None:
            raise Unavailable("daemon dnode is shutting down")

    async def run() -> tuple[int, int]:
        node = Draining()
        inbox = node.workers.fds
        inbox.start(asyncio.get_running_loop())
        try:
            tokens = hand_over(sock, [MemfdMemory(fds[0], 4096)])
            req = _convert.attach_request(Attach("e", Role.CONSUMER, 0, 1, [], [Region(0, 0, 1, 4096)]))
            req.memory.append(common_pb2.MemoryHandle(memfd=common_pb2.MemfdHandle(token=tokens[0], size=4096)))
            req.doorbell_token = hand_over(sock, [MemfdMemory(fds[1], 4096)])[0]
            await asyncio.sleep(0.02)
            inbox.drain()
            before = inbox.parked
            with pytest.raises(Unavailable):
                await WorkerServicer.Attach.__wrapped__(WorkerServicer(node), req, None)  # type: ignore[attr-defined]
            return before, inbox.parked
        finally:
            inbox.close()

    try:
        assert asyncio.run(run()) == (2, 0)
    finally:
        for fd in fds:
            os.close(fd)


def test_a_daemon_started_under_a_low_open_files_limit_takes_a_flood_of_the_fd_socket(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """Started under a soft limit of 512 open files (a shell's or a container's default is often
    1,024), the daemon raises it to the hard limit: a thousand descriptors parked on its fd socket
    leave it room for new worker connections and their memory."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 4096:
        pytest.skip(f"the hard open-files limit here is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (512, hard))  # the daemon inherits it
    try:
        d = daemon_factory("dnode")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    with open(f"/proc/{d.proc.pid}/limits") as f:
        (line,) = [x for x in f if x.startswith("Max open files")]
    assert int(line.split()[3]) > 512, line
    fd = sealed_memfd("mf-flood", 16 * 4096)
    try:
        base = _open_fds(d.proc.pid)
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.settimeout(10)  # a daemon that cannot take them leaves the queue full
            s.connect(f"{d.sock}.fd")
            for i in range(1000):
                socket.send_fds(s, [b"%016d" % i], [fd])
        assert wait_for(lambda: _open_fds(d.proc.pid) >= base + 1000, timeout=20)
        c = KVPushClient(d.sock)  # a new connection, and memory to map
        try:
            w = c.attach("e", Role.CONSUMER, 0, 1, [MemfdMemory(fd, 16 * 4096)], [Region(0, 0, 16, 4096)])
            w.detach()
        finally:
            c.close()
    finally:
        os.close(fd)
    daemon_factory.close(check=(d,))


def _send(path: str, token: bytes, fd: int) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.connect(path)
        socket.send_fds(s, [token], [fd])


def test_the_fd_socket_parks_shared_memory_only(tmp_path) -> None:
    """A memfd or a /dev/shm object is parked; a file on disk, a socket and a hugetlbfs memfd are
    refused on arrival, and the Attach that names one hears why."""
    import asyncio

    from kvpushd.core.errors import PermissionDenied

    disk = os.open(tmp_path / "kv", os.O_RDWR | os.O_CREAT)
    os.ftruncate(disk, 4096)
    a, b = socket.socketpair()
    shm = os.open("/dev/shm/kvpushd-test-door", os.O_RDWR | os.O_CREAT)
    os.unlink("/dev/shm/kvpushd-test-door")
    sent = {"memfd": sealed_memfd("mf-door", 4096), "shm": shm, "disk": disk, "socket": a.fileno()}
    with contextlib.suppress(OSError):  # a kernel without hugetlbfs
        sent["hugetlbfs"] = os.memfd_create("mf-huge", os.MFD_HUGETLB | os.MFD_ALLOW_SEALING)

    async def run() -> dict[str, str]:
        inbox = fdpass.FdInbox(str(tmp_path / "t.sock.fd"), 0o600)
        inbox.start(asyncio.get_running_loop())
        out = {}
        try:
            for i, fd in enumerate(sent.values()):
                _send(inbox.path, b"%016d" % i, fd)
            await asyncio.sleep(0.05)
            for i, kind in enumerate(sent):
                try:
                    os.close(inbox.take(b"%016d" % i))
                    out[kind] = "parked"
                except PermissionDenied as e:
                    out[kind] = str(e)
        finally:
            inbox.close()
        return out

    try:
        got = asyncio.run(run())
    finally:
        for fd in sent.values():
            os.close(fd)
        b.close()
    assert got.pop("memfd") == "parked" and got.pop("shm") == "parked"
    assert "refused on arrival: a file on a file system of type" in got.pop("disk")
    assert "refused on arrival: not a regular file" in got.pop("socket")
    if "hugetlbfs" in got:
        assert "type 0x958458f6" in got.pop("hugetlbfs")
    assert not got


def test_a_lingering_socket_sent_as_a_doorbell_does_not_hold_the_daemon(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """A TCP socket set to linger 20 s with data its peer never reads, sent as a doorbell page:
    closing it waits the 20 s. Before, the daemon closed it on its event loop when the Attach refused
    the page, and stood still that long; now it is refused on arrival and closed without waiting."""
    import struct

    d = daemon_factory("dnode")
    listener = socket.create_server(("127.0.0.1", 0))
    s = socket.create_connection(listener.getsockname())
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 20))
    s.setblocking(False)
    with contextlib.suppress(BlockingIOError):
        while True:  # the peer is never accepted nor read: fill both buffers
            s.send(b"x" * 65536)
    fd = sealed_memfd("mf-linger", 16 * 4096)
    try:
        tokens = hand_over(d.sock, [MemfdMemory(fd, 16 * 4096)])
        _send(f"{d.sock}.fd", b"l" * 16, s.fileno())
        s.close()  # the daemon holds the last reference now
        req = _convert.attach_request(Attach("e", Role.CONSUMER, 0, 1, [], [Region(0, 0, 16, 4096)]))
        req.memory.append(common_pb2.MemoryHandle(memfd=common_pb2.MemfdHandle(token=tokens[0], size=16 * 4096)))
        req.doorbell_token = b"l" * 16
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as r:
            worker_pb2_grpc.WorkerServiceStub(d.client.channel).Attach(req, timeout=60)
        took = time.monotonic() - t0
        assert took < 5.0, f"the Attach took {took:.1f} s: the daemon waited on the socket's linger"
        assert r.value.code() == grpc.StatusCode.PERMISSION_DENIED, r.value
        d.client.status()  # the daemon went on
    finally:
        os.close(fd)
        listener.close()
    daemon_factory.close(check=(d,))


def test_one_wake_up_of_the_fd_socket_takes_a_bounded_number_of_datagrams(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fdpass, "_MAX_PER_WAKE", 3)
    fd = sealed_memfd("mf-wake", 4096)
    inbox = fdpass.FdInbox(str(tmp_path / "t.sock.fd"), 0o600)
    inbox.start(None)
    try:
        for i in range(8):
            _send(inbox.path, b"%016d" % i, fd)
        counts = []
        for _ in range(3):
            inbox.drain()
            counts.append(inbox.parked)
        assert counts == [3, 6, 8]
    finally:
        inbox.close()
        os.close(fd)


def test_an_attach_whose_caller_leaves_runs_to_its_end_and_holds_its_rank(tmp_path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller of an Attach goes (its deadline passed) while a thread maps its memory. Before, the
    Attach stopped there: what the thread mapped stayed mapped with no worker to own it (the worker's
    whole KV, for the daemon's life), and the rank was free again at once. Unit test of the workers'
    room (its NIXL thread a stand-in; the end-to-end path is the other tests')."""
    import asyncio

    from kvpushd import config, memory
    from kvpushd.core.errors import AlreadyExists
    from kvpushd.core.types import RegionLayout
    from kvpushd.core.types import Role as CoreRole
    from kvpushd.events import EventHub
    from kvpushd.runtime import workers as room
    from kvpushd.runtime.identity import Identity

    opened: list[object] = []

    def slow_open_all(*args: object) -> list[object]:
        time.sleep(0.3)
        out = memory.open_all(*args)  # type: ignore[arg-type]
        opened.extend(out)
        return out  # type: ignore[return-value]

    class NixlThread:
        async def attach(self, *args: object) -> bytes:
            return b"metadata"

    monkeypatch.setattr(room, "open_all", slow_open_all)
    sock = str(tmp_path / "w.sock")
    fd = sealed_memfd("mf-leave", 4 * 4096)
    region = [room.RegionArg(0, 0, RegionLayout(4, 4096, 4096, 0, 0, 0, False))]

    async def run() -> None:
        cfg = config.from_dict({"worker_api": {"socket": sock, "populate_host_kv": False}})
        ws = room.Workers(cfg, Identity("n", "127.0.0.1:1"), EventHub())
        ws.xfer = NixlThread()  # type: ignore[assignment]
        ws.fds.start(asyncio.get_running_loop())
        try:
            spec = [memory.MemfdSpec(hand_over(sock, [MemfdMemory(fd, 4 * 4096)])[0], 4 * 4096)]
            first = asyncio.ensure_future(ws.attach(room.Attach("e", CoreRole.CONSUMER, 0, 1, 0, spec, region)))
            await asyncio.sleep(0.1)  # the thread is mapping
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
            with pytest.raises(AlreadyExists):  # the rank is still the first Attach's
                await ws.attach(room.Attach("e", CoreRole.CONSUMER, 0, 1, 0, spec, region))
            for _ in range(50):
                if ws.by_id:
                    break
                await asyncio.sleep(0.02)
            (w,) = ws.by_id.values()  # finished: a worker, reaped if it never opens a session
            assert opened and all(m in w.mappings for m in opened)
            for m in w.mappings:
                m.close()
        finally:
            ws.fds.close()

    try:
        asyncio.run(run())
    finally:
        os.close(fd)


def test_workers_with_a_memfd_per_layer_attach_together(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """vLLM keeps a layer's KV in a storage of its own, so the connector hands over a memfd per layer:
    an 80-layer model's worker sends 80, and the TP ranks of a node send theirs at the same time."""
    import threading

    d = daemon_factory("dnode")
    layers, ranks, size = 80, 4, 4 * 4096
    fds = [[sealed_memfd(f"mf-l{r}-{i}", size) for i in range(layers)] for r in range(ranks)]
    got: list[object] = []

    def attach(r: int) -> None:
        try:
            got.append(d.client.attach("big", Role.CONSUMER, r, ranks, [MemfdMemory(fd, size) for fd in fds[r]],
                                       [Region(i, 0, 4, 4096) for i in range(layers)]))
        except KVPushError as e:
            got.append(e)

    try:
        threads = [threading.Thread(target=attach, args=(r,)) for r in range(ranks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not [g for g in got if isinstance(g, KVPushError)], got
        assert len(got) == ranks
        for w in got:
            w.detach()  # type: ignore[attr-defined]
    finally:
        for row in fds:
            for fd in row:
                os.close(fd)
    daemon_factory.close(check=(d,))


def _vm_size(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


def test_host_kv_the_daemon_has_no_address_space_for_is_resource_exhausted(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """A worker's KV the daemon cannot map (its RLIMIT_AS reached, or vm.max_map_count) is a resource
    the daemon lacks, not a permission the worker lacks: RESOURCE_EXHAUSTED, and the daemon goes on."""
    d = daemon_factory("dnode")
    big = 1 << 30  # sparse: the memfd holds no memory
    fd = sealed_memfd("mf-huge", big)
    regs = [Region(0, 0, 16, 4096)]
    limit = resource.prlimit(d.proc.pid, resource.RLIMIT_AS)
    try:
        resource.prlimit(d.proc.pid, resource.RLIMIT_AS, (_vm_size(d.proc.pid) + (512 << 20), limit[1]))
        with pytest.raises(KVPushError) as e:
            d.client.attach("e", Role.CONSUMER, 0, 1, [MemfdMemory(fd, big)], regs)
        assert e.value.code == "RESOURCE_EXHAUSTED" and "address space" in e.value.message, e.value
    finally:
        resource.prlimit(d.proc.pid, resource.RLIMIT_AS, limit)
    try:
        w = d.client.attach("e", Role.CONSUMER, 0, 1, [MemfdMemory(fd, big)], regs)  # room again
        w.detach()
    finally:
        os.close(fd)
    daemon_factory.close(check=(d,))
