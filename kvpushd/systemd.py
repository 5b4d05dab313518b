"""``sd_notify(3)`` for the daemon's ``Type=notify`` unit (systemd/kvpushd.service), without libsystemd.

- READY=1 goes once, when the daemon can serve (sockets bound, NIXL up): units ordered after
  kvpushd (the engines) start only then.
- WATCHDOG=1 is sent by a task on the event loop (``run_watchdog``), never by a thread: a wedged
  loop must stop the pings, so that systemd restarts the daemon.
- STOPPING=1 when the drain begins.
- A failed notification is logged (loudly once, then quietly), never raised; without
  ``NOTIFY_SOCKET`` (a shell, tests, a container) every call is a no-op returning False.

The wire: one AF_UNIX datagram of ``KEY=VALUE`` lines to the path in ``NOTIFY_SOCKET`` (``@name``:
an abstract socket).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Mapping

import structlog

__all__ = ["SdNotifier"]

log = structlog.get_logger(__name__)


def _parse_address(raw: str | None) -> bytes | None:
    """``/path`` -> that socket; ``@name`` -> the abstract socket ``\\0name``; else None (unsupported)."""
    if raw and raw.startswith("@") and len(raw) > 1:
        return b"\0" + os.fsencode(raw[1:])
    if raw and raw.startswith("/"):
        return os.fsencode(raw)
    return None


class SdNotifier:
    """Notifications to the service manager, from the event loop."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self._env: Mapping[str, str] = os.environ if env is None else env
        self._raw = self._env.get("NOTIFY_SOCKET") or None
        self._address = _parse_address(self._raw)
        self._sock: socket.socket | None = None
        self._failing = False  # log the first failure loudly, repeats quietly until a send succeeds
        if self._raw and self._address is None:
            log.warning("sd_notify.unsupported_socket", notify_socket=self._raw,
                        hint="expected /path or @abstract-name; notifications disabled")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SdNotifier:
        return cls(env)

    def close(self) -> None:
        """Close the socket (a later notification reopens it). Idempotent."""
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()

    def _send(self, msg: str) -> bool:
        """One datagram; False when disabled or the send failed (a full queue too: never blocks)."""
        if self._address is None:
            return False
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.setblocking(False)
            self._sock.sendto(msg.encode("utf-8", "surrogateescape"), socket.MSG_NOSIGNAL, self._address)
        except Exception as exc:  # a notification must never take the daemon down
            (log.debug if self._failing else log.warning)(
                "sd_notify.send_failed", notify_socket=self._raw, notification=msg.split("\n", 1)[0],
                error=repr(exc))
            self._failing = True
            return False
        if self._failing:
            self._failing = False
            log.info("sd_notify.recovered", notify_socket=self._raw)
        return True

    def ready(self, status: str | None = None) -> bool:
        """Start-up finished; ``status`` is the line ``systemctl status`` shows (newlines become spaces)."""
        line = "" if status is None else "\nSTATUS=" + status.replace("\n", " ").replace("\r", " ")
        return self._send("READY=1" + line)

    def stopping(self) -> bool:
        return self._send("STOPPING=1")

    def watchdog(self) -> bool:
        return self._send("WATCHDOG=1")

    def watchdog_interval(self) -> float | None:
        """Half of ``WATCHDOG_USEC`` in seconds (as ``sd_watchdog_enabled(3)``), or None: unset, invalid,
        or meant for another process (``WATCHDOG_PID``)."""
        try:
            usec = int(self._env.get("WATCHDOG_USEC") or 0)
            pid = int(self._env.get("WATCHDOG_PID") or os.getpid())
        except ValueError:
            log.warning("sd_notify.bad_watchdog_env", watchdog_usec=self._env.get("WATCHDOG_USEC"),
                        watchdog_pid=self._env.get("WATCHDOG_PID"))
            return None
        if usec <= 0 or pid != os.getpid():
            return None
        return usec / 2 / 1_000_000

    async def run_watchdog(self, interval: float | None = None) -> None:
        """Ping from the running loop until cancelled; returns at once if the watchdog is off."""
        interval = self.watchdog_interval() if interval is None else interval
        if interval is None or interval <= 0:
            return
        while True:
            self.watchdog()
            await asyncio.sleep(interval)
