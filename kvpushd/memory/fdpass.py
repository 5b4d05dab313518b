"""The fd socket: where a worker hands the daemon its host KV as a sealed memfd.

A unix datagram socket next to the worker socket (its path plus ".fd", the same permission bits).
A worker sends one datagram per memfd: 16 random bytes (the token) and the descriptor (SCM_RIGHTS);
its Attach then names the memory by that token (``MemfdHandle``). The kernel has queued the
datagram by the time ``sendmsg`` returns, so ``take`` reads the socket before it looks.

Bounded: at most ``MAX_PARKED`` descriptors wait for their Attach, each for ``TTL_S``; when that
many wait, a new arrival is refused (closed; the Attach naming its token hears RESOURCE_EXHAUSTED
and why), so descriptors parked before a flood are never pushed out by it. At most
``MAX_PER_SENDER`` of one sending process wait (its pid, which the kernel vouches for with
SO_PASSCRED; only CAP_SYS_ADMIN may name another): past that a process pushes out its own oldest,
never another's. A sender in another pid namespace (a pod, without hostPID) shows as pid 0 and only
the overall bound applies to it. A datagram of any other shape is dropped with every descriptor it
carried. A datagram of 17 bytes whose first is ``V`` (``VMM_TAG``) carries a chunk of CUDA virtual memory
exported as a POSIX fd (``cuMemExportToShareableHandle``; its Attach names it in a ``VmmHandle``): it is
parked only if it is a character device or an anonymous inode, what the NVIDIA driver hands out, and
counts against the same bounds; ``take`` hands it only to an Attach that names it as a chunk, and a
memfd only to one that names a memfd. Otherwise only shared memory is parked (a memfd or a /dev/shm
object, on tmpfs): anything else is refused on arrival and closed off the event loop, since closing
a socket set to linger, or a FUSE or NFS file, can wait on whoever holds its other end; hugetlbfs is
refused too (a hole punched in it faults SIGBUS in the daemon once the huge-page pool is empty). One wake-up takes
at most ``_MAX_PER_WAKE`` datagrams, so senders that keep the queue full cannot hold the loop.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import os
import queue
import socket
import stat
import struct
import threading
import time
from collections.abc import Iterable

import structlog

from ..core.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied, ResourceExhausted
from .shm import libc

TOKEN_BYTES = 16
VMM_TAG = b"V"  # the first byte of a datagram that carries a VMM chunk (then its token)
MEMFD, VMM = "memfd", "VMM chunk"  # what a parked descriptor was sent as
MAX_MEMORY_HANDLES = 256  # what one Attach may name (vLLM: a memfd per layer's KV storage)
MAX_PARKED = 16 * MAX_MEMORY_HANDLES  # sixteen Attaches naming the most they may, sent at once
MAX_PER_SENDER = 4 * MAX_MEMORY_HANDLES  # one process: an Attach and three retries of it
TTL_S = 30.0
_MAX_FDS = 4  # what one datagram may carry before the rest is cut (the kernel closes what it cuts)
_MAX_PER_WAKE = 256  # datagrams one wake-up of the loop takes; the reader fires again for the rest
_MAX_CLOSING = 256  # refused descriptors waiting for the closer thread before the socket is left unread
_MAX_REFUSED = 256  # tokens of refused descriptors remembered, for the Attach's message
TMPFS_MAGIC = 0x01021994  # shmem: memfds and /dev/shm objects
_CRED = struct.Struct("iII")  # struct ucred: pid, uid, gid
_CMSG_SPACE = socket.CMSG_SPACE(_MAX_FDS * 4) + socket.CMSG_SPACE(_CRED.size)
log = structlog.get_logger(__name__)


def raise_fd_limit() -> int:
    """Raise the soft limit on open files to the hard one, as Go's runtime does at start: a flood of
    the fd socket parks up to MAX_PARKED descriptors, and under the common soft limit of 1,024 that
    would leave the daemon none for its sockets and mappings. Returns the soft limit now."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            log.warning("could not raise the open-files limit", soft=soft, hard=hard, error=str(e))
    if soft != resource.RLIM_INFINITY and soft < 2 * MAX_PARKED:
        log.warning("open-files limit is low: the fd socket alone may hold this many descriptors; raise "
                    "LimitNOFILE (systemd) or the container's nofile limit", limit=soft, fd_socket_holds=MAX_PARKED)
    return soft


def not_shmem(fd: int) -> str:
    """Why ``fd`` is not a regular file of shared memory (tmpfs), or "" when it is."""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return "not a regular file"
        buf = ctypes.create_string_buffer(256)  # struct statfs; f_type comes first
        if libc.fstatfs(fd, buf) != 0:
            return f"fstatfs failed: {os.strerror(ctypes.get_errno())}"
    except OSError as e:
        return f"cannot be inspected: {e.strerror}"
    f_type = ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF
    return "" if f_type == TMPFS_MAGIC else f"a file on a file system of type {f_type:#x}, not shared memory (tmpfs)"


def not_vmm_chunk(fd: int) -> str:
    """Why ``fd`` cannot be a CUDA VMM chunk exported as a POSIX fd, or "" when it may be: the NVIDIA
    driver hands out a descriptor of its device (a character device) or an anonymous inode; a file,
    socket, pipe or directory is refused (closing a socket or a network file may wait on its peer)."""
    try:
        mode = os.fstat(fd).st_mode
    except OSError as e:
        return f"cannot be inspected: {e.strerror}"
    if stat.S_ISCHR(mode) or stat.S_IFMT(mode) == 0:
        return ""
    what = ("a regular file" if stat.S_ISREG(mode) else "a socket" if stat.S_ISSOCK(mode) else
            "a pipe" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else "a block device"
            if stat.S_ISBLK(mode) else f"of file type {stat.S_IFMT(mode):#o}")
    return (f"{what}, not a CUDA VMM chunk (a character device or anonymous inode from "
            "cuMemExportToShareableHandle)")


def fd_socket_path(worker_socket: str) -> str:
    return f"{worker_socket}.fd"


class FdInbox:
    """Descriptors sent to the fd socket, by token, until an Attach takes them. Loop thread only.
    Bound by ``start`` (before the worker socket listens); until then nothing arrives."""

    def __init__(self, path: str, mode: int) -> None:
        self.path = path
        self.mode = mode
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)  # each datagram says its sender's pid
        self._bound = False
        # token -> (descriptor, arrival, sender pid, kind), oldest first; and each sender's tokens, oldest first
        self._parked: collections.OrderedDict[bytes, tuple[int, float, int, str]] = collections.OrderedDict()
        self._by_sender: dict[int, collections.OrderedDict[bytes, None]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None  # the next expiry, while any descriptor waits
        # token -> why it was refused, and whether for room (RESOURCE_EXHAUSTED) or its kind
        self._refused: collections.OrderedDict[bytes, tuple[str, bool]] = collections.OrderedDict()
        self._closer: queue.SimpleQueue[int] | None = None  # refused descriptors, closed by a thread
        self._closing = 0  # of those, not closed yet
        self._reading = False  # the loop watches the socket
        self.dropped = 0  # datagrams of the wrong shape, and descriptors refused, evicted or expired unused

    def start(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """Bind the socket (replacing a stale one) and, with ``loop``, read it as datagrams arrive."""
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISSOCK(os.lstat(self.path).st_mode):
                raise FailedPrecondition(f"{self.path} exists and is not a socket")
            os.unlink(self.path)  # a stale socket from a previous run
        old = os.umask(0o177)  # born private, then opened up like the worker socket
        try:
            self._sock.bind(self.path)
        finally:
            os.umask(old)
        self._bound = True
        os.chmod(self.path, self.mode)
        if loop is not None:
            self._loop = loop
            self._read(True)

    def _read(self, on: bool) -> None:
        if self._loop is None or on == self._reading or not self._bound:
            return
        self._reading = on
        if on:
            self._loop.add_reader(self._sock.fileno(), self.drain)
        else:
            self._loop.remove_reader(self._sock.fileno())

    def drain(self) -> None:
        """Park the descriptors the socket holds now (at most ``_MAX_PER_WAKE`` datagrams)."""
        for _ in range(_MAX_PER_WAKE):
            if not self._bound or self._closing >= _MAX_CLOSING:
                break
            try:
                msg, anc, flags, _ = self._sock.recvmsg(TOKEN_BYTES + 2, _CMSG_SPACE, socket.MSG_CMSG_CLOEXEC)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:  # e.g. EMFILE: the kernel keeps nothing it could not hand over
                log.warning("fd socket read failed", error=e.strerror)
                break
            fds: list[int] = []
            pid = 0
            for level, kind, data in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.extend(memoryview(data)[: len(data) - len(data) % 4].cast("i"))
                elif level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(data) >= _CRED.size:
                    pid = _CRED.unpack_from(data)[0]
            sent_as = VMM if len(msg) == TOKEN_BYTES + 1 and msg[:1] == VMM_TAG else MEMFD
            if sent_as == VMM:
                msg = msg[1:]
            if len(msg) != TOKEN_BYTES or len(fds) != 1 or flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
                for fd in fds:
                    self._close_later(fd)
                self.dropped += 1
                continue
            if why := (not_vmm_chunk(fds[0]) if sent_as == VMM else not_shmem(fds[0])):
                self._refuse(msg, fds[0], why)
                continue
            self._park(msg, fds[0], pid, sent_as)
        if self._closing >= _MAX_CLOSING:
            self._read(False)  # until the closer catches up (_closed)
        self._expire(time.monotonic())

    def _refuse(self, token: bytes, fd: int, why: str, full: bool = False) -> None:
        self._refused.pop(token, None)
        self._refused[token] = (why, full)
        while len(self._refused) > _MAX_REFUSED:
            self._refused.popitem(last=False)
        self._close_later(fd)
        self.dropped += 1

    def _close_later(self, fd: int) -> None:
        """Close a descriptor that is not shared memory without waiting on the loop: a socket loses
        its linger and closes at once; anything else goes to the closer thread."""
        try:
            sock = socket.socket(fileno=fd) if stat.S_ISSOCK(os.fstat(fd).st_mode) else None
        except OSError:
            sock = None
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 0, 0))
            except OSError:
                sock.detach()  # the closer thread closes it
            else:
                with contextlib.suppress(OSError):
                    sock.close()
                return
        if self._loop is None:  # no loop to keep free (a test's inbox)
            os.close(fd)
            return
        if self._closer is None:
            self._closer = queue.SimpleQueue()
            threading.Thread(target=self._close_forever, args=(self._closer, self._loop), daemon=True,
                             name="kvpushd-fd-close").start()
        self._closing += 1
        self._closer.put(fd)

    def _close_forever(self, q: queue.SimpleQueue[int], loop: asyncio.AbstractEventLoop) -> None:
        while (fd := q.get()) >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
            with contextlib.suppress(RuntimeError):  # the loop closed: the daemon is stopping
                loop.call_soon_threadsafe(self._closed)

    def _closed(self) -> None:
        self._closing -= 1
        if self._closing < _MAX_CLOSING // 2:
            self._read(True)

    def _park(self, token: bytes, fd: int, pid: int = 0, kind: str = MEMFD) -> None:
        self._unpark(token, close=True)
        mine = self._by_sender.get(pid) if pid else None
        if len(self._parked) >= MAX_PARKED and not (mine and len(mine) >= MAX_PER_SENDER):
            self._refuse(token, fd, f"the fd socket already holds {MAX_PARKED} descriptors waiting for their "
                                    f"Attach (at most {TTL_S:.0f} s each); send it again later", full=True)
            return
        self._parked[token] = (fd, time.monotonic(), pid, kind)
        if pid:
            mine = self._by_sender.setdefault(pid, collections.OrderedDict())
            mine[token] = None
            if len(mine) > MAX_PER_SENDER:  # its own oldest: the total stays within MAX_PARKED
                self._unpark(next(iter(mine)), close=True)
                self.dropped += 1
        self._arm()

    def _unpark(self, token: bytes, close: bool = False, kind: str = "") -> int | None:
        """Take ``token``'s descriptor out of the books; closed with ``close``, else returned. With
        ``kind``, one sent as another kind is refused (and left parked)."""
        got = self._parked.get(token)
        if got is None:
            return None
        fd, _t, pid, sent_as = got
        if kind and sent_as != kind:
            raise InvalidArgument(f"the descriptor sent under this token came as a {sent_as}, and the Attach names "
                                  f"it as a {kind}")
        del self._parked[token]
        if (mine := self._by_sender.get(pid)) is not None:
            mine.pop(token, None)
            if not mine:
                del self._by_sender[pid]
        if close:
            os.close(fd)
            return None
        return fd

    def _expire(self, now: float) -> None:
        while self._parked:
            token, (_fd, t, _pid, _kind) = next(iter(self._parked.items()))
            if now - t < TTL_S:
                break
            self._unpark(token, close=True)
            self.dropped += 1

    def _arm(self) -> None:
        """A timer for the oldest descriptor's expiry (nothing else may come to look at the clock)."""
        if self._loop is None or self._timer is not None or not self._parked:
            return
        oldest = next(iter(self._parked.values()))[1]
        self._timer = self._loop.call_later(max(0.0, oldest + TTL_S - time.monotonic()), self._tick)

    def _tick(self) -> None:
        self._timer = None
        self._expire(time.monotonic())
        self._arm()

    def discard(self, tokens: Iterable[bytes]) -> None:
        """Close what was sent under ``tokens`` and not taken (an Attach refused, or gone, before it
        took them): a worker's whole KV is not held until the descriptor's expiry."""
        self.drain()
        for token in tokens:
            self._refused.pop(bytes(token), None)
            self._unpark(bytes(token), close=True)

    @property
    def parked(self) -> int:
        return len(self._parked)

    def take(self, token: bytes, kind: str = MEMFD) -> int:
        """The descriptor sent under ``token`` as ``kind``; the caller owns (closes) it."""
        self.drain()
        got = self._unpark(bytes(token), kind=kind)
        if got is None and (refused := self._refused.pop(bytes(token), None)) is not None:
            why, full = refused
            if full:
                raise ResourceExhausted(f"the descriptor sent under this memfd token was refused on arrival: {why}")
            hint = "" if kind == VMM else "; host KV and doorbell pages go as memfds (kvpushd_client.SealedBuffer)"
            raise PermissionDenied(f"the descriptor sent under this {kind} token was refused on arrival: {why}{hint}")
        if got is None:
            raise NotFound(f"no descriptor arrived on {self.path} under this {kind} token (sent to another "
                           f"daemon's socket, waited over {TTL_S:.0f} s for its Attach, or pushed out by "
                           f"{MAX_PER_SENDER} its sender sent after it)")
        return got

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._loop is not None and not self._loop.is_closed():
            self._read(False)
        if self._closer is not None:
            self._closer.put(-1)  # the thread ends after what it holds
            self._closer = None
        self._sock.close()
        if self._bound:  # ours to remove (an unbound one may be another daemon's)
            self._bound = False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        for fd, _t, _pid, _kind in self._parked.values():
            os.close(fd)
        self._parked.clear()
        self._by_sender.clear()
