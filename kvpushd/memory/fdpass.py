"""The fd socket: where a worker hands the daemon its host KV as a sealed memfd.

A unix datagram socket next to the worker socket (its path plus ".fd", the same permission bits).
A worker sends one datagram per memfd: 16 random bytes (the token) and the descriptor (SCM_RIGHTS);
its Attach then names the memory by that token (``MemfdHandle``). The kernel has queued the
datagram by the time ``sendmsg`` returns, so ``take`` reads the socket before it looks.

Bounded: at most ``MAX_PARKED`` descriptors wait for their Attach (a flood closes the oldest), each
for ``TTL_S``; a datagram of any other shape is dropped with every descriptor it carried.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import socket
import stat
import time
from collections.abc import Iterable

import structlog

from ..core.errors import FailedPrecondition, NotFound

TOKEN_BYTES = 16
MAX_MEMORY_HANDLES = 256  # what one Attach may name (vLLM: a memfd per layer's KV storage)
MAX_PARKED = 16 * MAX_MEMORY_HANDLES  # sixteen Attaches naming the most they may, sent at once
TTL_S = 30.0
_MAX_FDS = 4  # what one datagram may carry before the rest is cut (the kernel closes what it cuts)
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


def fd_socket_path(worker_socket: str) -> str:
    return f"{worker_socket}.fd"


class FdInbox:
    """Descriptors sent to the fd socket, by token, until an Attach takes them. Loop thread only.
    Bound by ``start`` (before the worker socket listens); until then nothing arrives."""

    def __init__(self, path: str, mode: int) -> None:
        self.path = path
        self.mode = mode
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        self._bound = False
        self._parked: collections.OrderedDict[bytes, tuple[int, float]] = collections.OrderedDict()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None  # the next expiry, while any descriptor waits
        self.dropped = 0  # datagrams of the wrong shape, and descriptors evicted or expired unused

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
            loop.add_reader(self._sock.fileno(), self.drain)

    def drain(self) -> None:
        """Park every descriptor the socket holds now."""
        while self._bound:
            try:
                msg, fds, flags, _ = socket.recv_fds(self._sock, TOKEN_BYTES + 1, _MAX_FDS, socket.MSG_CMSG_CLOEXEC)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:  # e.g. EMFILE: the kernel keeps nothing it could not hand over
                log.warning("fd socket read failed", error=e.strerror)
                break
            if len(msg) != TOKEN_BYTES or len(fds) != 1 or flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
                for fd in fds:
                    os.close(fd)
                self.dropped += 1
                continue
            self._park(msg, fds[0])
        self._expire(time.monotonic())

    def _park(self, token: bytes, fd: int) -> None:
        old = self._parked.pop(token, None)
        if old is not None:
            os.close(old[0])
        self._parked[token] = (fd, time.monotonic())
        while len(self._parked) > MAX_PARKED:
            _, (evicted, _t) = self._parked.popitem(last=False)
            os.close(evicted)
            self.dropped += 1
        self._arm()

    def _expire(self, now: float) -> None:
        while self._parked:
            token, (fd, t) = next(iter(self._parked.items()))
            if now - t < TTL_S:
                break
            del self._parked[token]
            os.close(fd)
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
            got = self._parked.pop(bytes(token), None)
            if got is not None:
                os.close(got[0])

    @property
    def parked(self) -> int:
        return len(self._parked)

    def take(self, token: bytes) -> int:
        """The descriptor sent under ``token``; the caller owns (closes) it."""
        self.drain()
        got = self._parked.pop(bytes(token), None)
        if got is None:
            raise NotFound(f"no descriptor arrived on {self.path} under this memfd token (sent to another "
                           f"daemon's socket, waited over {TTL_S:.0f} s for its Attach, or pushed out by "
                           f"{MAX_PARKED} sent after it)")
        return got[0]

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        if self._bound:  # ours to remove (an unbound one may be another daemon's)
            self._bound = False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        for fd, _t in self._parked.values():
            os.close(fd)
        self._parked.clear()
