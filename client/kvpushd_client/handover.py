"""The daemon's fd socket, the worker's side: each descriptor of host KV (a sealed memfd), of a doorbell
page or of a CUDA VMM chunk goes as one datagram to the worker socket's path plus ".fd", under a fresh
random token the Attach then names (the daemon's side: kvpushd/memory/fdpass.py)."""

from __future__ import annotations

import errno
import secrets
import socket
from collections.abc import Sequence
from typing import Any

from .errors import DaemonUnavailable, InvalidArgument
from .types import MemfdMemory, Memory
from .vmm import VmmMemory

TOKEN_BYTES = 16


def hand_over(socket_path: str, memory: Sequence[Memory], timeout_s: float = 10.0) -> dict[int, bytes]:
    """Send the descriptor of every MemfdMemory in ``memory`` to the daemon's fd socket, each under a
    fresh random token; returns the tokens by index, for the Attach that follows."""
    targets = [(i, m) for i, m in enumerate(memory) if isinstance(m, MemfdMemory)]
    tokens = send_fds(socket_path, [(b"", m.fd, f"memory {i}", "its SealedBuffer or doorbell closed?")
                                    for i, m in targets], timeout_s)
    return {i: t for (i, _m), t in zip(targets, tokens, strict=True)}


def send_fds(socket_path: str, items: Sequence[tuple[bytes, int, str, str]], timeout_s: float) -> list[bytes]:
    """Send each ``(tag, fd, what, hint)`` to the daemon's fd socket (the worker socket's path plus ".fd")
    as one datagram, the tag and a fresh random token with the descriptor; returns the tokens in order
    (the daemon has the datagrams queued once this returns). ``what`` and ``hint`` name the descriptor
    in an error."""
    tokens: list[bytes] = []
    if not items:
        return tokens
    path = f"{socket_path}.fd"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        s.settimeout(timeout_s)  # a daemon whose queue is full and stays full
        for tag, fd, what, hint in items:
            token = secrets.token_bytes(TOKEN_BYTES)
            try:
                if not tokens:
                    s.connect(path)
                socket.send_fds(s, [tag + token], [fd])
            except OSError as e:
                if e.errno == errno.EBADF:  # the caller's, not the daemon's: retrying cannot help
                    raise InvalidArgument("INVALID_ARGUMENT", f"{what}: descriptor {fd} is not open ({hint})") from None
                raise DaemonUnavailable(
                    "UNAVAILABLE", f"cannot hand {what} to the daemon's fd socket {path}: {e.strerror or e}") from None
            tokens.append(token)
    return tokens


VMM_TAG = b"V"  # the fd socket's kind tag of a chunk (kvpushd/memory/fdpass.py)


def hand_over_chunks(socket_path: str, memory: Sequence[Any], timeout_s: float = 10.0) -> dict[int, list[bytes]]:
    """Send every chunk fd of each VmmMemory in ``memory`` to the daemon's fd socket, tagged as a VMM
    chunk, each under a fresh token (send_fds); returns the tokens by memory index, in chunk order,
    for the Attach that follows."""
    targets = [(i, m) for i, m in enumerate(memory) if isinstance(m, VmmMemory)]
    tokens = iter(send_fds(socket_path, [(VMM_TAG, c.fd, f"memory {i} chunk {j}", "its VmmMemory closed?")
                                         for i, m in targets for j, c in enumerate(m.chunks)], timeout_s))
    return {i: [next(tokens) for _c in m.chunks] for i, m in targets}
