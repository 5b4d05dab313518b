"""Minimal, dependency-free ``sd_notify(3)`` client for running kvpushd under systemd.

kvpushd ships as a ``Type=notify`` unit (see ``systemd/kvpushd.service``). That
choice matters for correctness, not just for pretty ``systemctl status`` output:

* **READY=1 is sent exactly once, and only when the daemon can really serve.**
  systemd (and anything ordered ``After=kvpushd.service``, e.g. the engine
  workers) treats the unit as started the moment READY=1 arrives. kvpushd must
  therefore send it only after the worker unix socket and the peer TCP listener
  are bound *and* the NIXL agent / transfer backends are initialised. Sending it
  earlier would let workers connect to a daemon that cannot yet register memory
  or post transfers. A forking/simple unit cannot express this.

* **Watchdog pings come from the asyncio event loop itself.** With
  ``WatchdogSec=`` set, systemd exports ``WATCHDOG_USEC`` and kills + restarts
  the service (``Restart=on-failure``) if ``WATCHDOG=1`` does not arrive in
  time. The ping must be sent by a task running *on the event loop* (see
  :meth:`SdNotifier.run_watchdog`), never from a helper thread: a thread would
  keep pinging while the loop is wedged (a blocking call, a deadlocked NIXL
  progress call, a busy loop), which is exactly the failure the watchdog is
  there to catch. :meth:`SdNotifier.watchdog_interval` returns half the timeout,
  as recommended by ``sd_watchdog_enabled(3)``.

* **STOPPING=1** is sent when shutdown begins so systemd shows the daemon as
  "deactivating" while in-flight transfers drain (bounded by ``TimeoutStopSec=``).

* **Notification failures never take the daemon down.** Every send error is
  logged and reported as ``False``; nothing here raises. When ``NOTIFY_SOCKET``
  is unset (running in a shell, in tests, in a container without systemd) every
  call is a cheap no-op returning ``False``.

The wire protocol is tiny: one ``AF_UNIX``/``SOCK_DGRAM`` datagram per
notification, containing newline-separated ``KEY=VALUE`` assignments, sent to the
path in ``NOTIFY_SOCKET`` (a leading ``@`` denotes a Linux abstract socket, whose
name starts with a NUL byte). Only the main process may notify
(``NotifyAccess=main`` in the unit).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
from collections.abc import Mapping
from types import TracebackType
from typing import Self

import structlog

__all__ = ["SdNotifier"]

log = structlog.get_logger(__name__)

# Values may contain anything but a newline (it separates assignments in the
# datagram); newlines in values are replaced by a space rather than rejected so
# a STATUS built from an exception message cannot inject extra assignments.
_NEWLINE_TRANSLATION = str.maketrans({"\n": " ", "\r": " "})


def _parse_address(raw: str | None) -> bytes | None:
    """Turn a ``NOTIFY_SOCKET`` value into an ``AF_UNIX`` address, or ``None``.

    ``/path`` -> filesystem socket; ``@name`` -> abstract socket ``\\0name``.
    Anything else (empty, relative path, ``vsock:``) is unsupported here.
    """
    if not raw:
        return None
    if raw.startswith("@"):
        if len(raw) < 2:
            return None
        return b"\0" + os.fsencode(raw[1:])
    if raw.startswith("/"):
        return os.fsencode(raw)
    return None


class SdNotifier:
    """Send ``sd_notify`` messages to the service manager.

    Constructed from the environment (``os.environ`` unless ``env`` is given,
    which tests use). The ``NOTIFY_SOCKET`` address is resolved once, at
    construction; ``WATCHDOG_USEC``/``WATCHDOG_PID`` are read from the same
    mapping when :meth:`watchdog_interval` is called.

    A single ``SOCK_DGRAM`` socket is opened lazily on the first send and kept
    until :meth:`close` (idempotent; a later send simply reopens it). The socket
    is non-blocking so a stalled service manager can never block the event
    loop: a full receive queue is reported as a failed send instead.
    Thread-safe.
    """

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self._env: Mapping[str, str] = os.environ if env is None else env
        self._raw_address: str | None = self._env.get("NOTIFY_SOCKET") or None
        self._address: bytes | None = _parse_address(self._raw_address)
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        # Log the first failure loudly, repeats quietly until a send succeeds,
        # so a broken NOTIFY_SOCKET does not flood the journal every 15 s.
        self._failing = False
        if self._raw_address and self._address is None:
            log.warning(
                "sd_notify.unsupported_socket",
                notify_socket=self._raw_address,
                hint="expected /path or @abstract-name; notifications disabled",
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SdNotifier:
        """Alias for the constructor, for call sites that read better this way."""
        return cls(env)

    # ------------------------------------------------------------------ state

    @property
    def enabled(self) -> bool:
        """True when ``NOTIFY_SOCKET`` named a usable address."""
        return self._address is not None

    @property
    def address(self) -> str | None:
        """The ``NOTIFY_SOCKET`` value as given (``@name`` for abstract sockets)."""
        return self._raw_address if self._address is not None else None

    def close(self) -> None:
        """Close the notification socket. Safe to call any number of times."""
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # --------------------------------------------------------------- sending

    def send(self, msg: str) -> bool:
        """Send one raw notification datagram (``"KEY=VALUE\\n..."``).

        Returns True if the datagram was handed to the kernel, False if
        notifications are disabled or the send failed (the failure is logged,
        never raised).
        """
        address = self._address
        if address is None:
            return False
        if not msg:
            return False
        data = msg.encode("utf-8", "surrogateescape")
        try:
            with self._lock:
                if self._sock is None:
                    sock = socket.socket(
                        socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC
                    )
                    sock.setblocking(False)
                    self._sock = sock
                self._sock.sendto(data, socket.MSG_NOSIGNAL, address)
        # A notify failure must never crash the daemon: catch everything.
        except Exception as exc:
            log_fn = log.debug if self._failing else log.warning
            self._failing = True
            log_fn(
                "sd_notify.send_failed",
                notify_socket=self._raw_address,
                notification=msg.split("\n", 1)[0],
                error=repr(exc),
            )
            return False
        if self._failing:
            self._failing = False
            log.info("sd_notify.recovered", notify_socket=self._raw_address)
        return True

    def notify(self, **fields: str | float) -> bool:
        """Send ``KEY=VALUE`` assignments in one datagram, in argument order.

        ``notifier.notify(READY=1, STATUS="serving")`` sends
        ``"READY=1\\nSTATUS=serving"``. Keys are upper-cased; booleans become
        ``1``/``0``; newlines inside values are replaced by spaces.
        """
        if self._address is None or not fields:
            return False
        lines: list[str] = []
        for key, value in fields.items():
            text = ("1" if value else "0") if isinstance(value, bool) else str(value).translate(_NEWLINE_TRANSLATION)
            lines.append(f"{key.upper()}={text}")
        return self.send("\n".join(lines))

    def ready(self, status: str | None = None) -> bool:
        """Tell systemd start-up finished (sockets listening, NIXL initialised)."""
        if status is None:
            return self.notify(READY=1)
        return self.notify(READY=1, STATUS=status)

    def stopping(self) -> bool:
        """Tell systemd a graceful shutdown has begun."""
        return self.notify(STOPPING=1)

    def status(self, text: str) -> bool:
        """Set the free-form status line shown by ``systemctl status``."""
        return self.notify(STATUS=text)

    def watchdog(self) -> bool:
        """Send a watchdog keep-alive ping (``WATCHDOG=1``)."""
        return self.notify(WATCHDOG=1)

    def extend_timeout(self, seconds: float) -> bool:
        """Ask for ``seconds`` more of start/stop time (``EXTEND_TIMEOUT_USEC``).

        Useful when NIXL/UCX initialisation or draining is slow but progressing.
        """
        usec = max(0, int(seconds * 1_000_000))
        return self.notify(EXTEND_TIMEOUT_USEC=usec)

    # -------------------------------------------------------------- watchdog

    def watchdog_interval(self) -> float | None:
        """Recommended watchdog ping interval in seconds, or None if disabled.

        Mirrors ``sd_watchdog_enabled(3)``: reads ``WATCHDOG_USEC``; if
        ``WATCHDOG_PID`` is set it must equal ``os.getpid()`` (otherwise the
        watchdog is meant for another process, e.g. our parent, and this
        returns None). The result is half the timeout, so one late ping does
        not trigger a restart. Like libsystemd, this does not look at
        ``NOTIFY_SOCKET``; pings are no-ops anyway when it is unset.
        """
        raw_usec = self._env.get("WATCHDOG_USEC")
        if not raw_usec:
            return None
        raw_pid = self._env.get("WATCHDOG_PID")
        if raw_pid:
            try:
                pid = int(raw_pid)
            except ValueError:
                log.warning("sd_notify.bad_watchdog_pid", watchdog_pid=raw_pid)
                return None
            if pid != os.getpid():
                return None
        try:
            usec = int(raw_usec)
        except ValueError:
            log.warning("sd_notify.bad_watchdog_usec", watchdog_usec=raw_usec)
            return None
        if usec <= 0:
            return None
        return usec / 2 / 1_000_000

    async def run_watchdog(self, interval: float | None = None) -> None:
        """Ping the watchdog from the running event loop until cancelled.

        Start it with ``asyncio.create_task(notifier.run_watchdog())`` after
        :meth:`ready`. ``interval`` defaults to :meth:`watchdog_interval`; if the
        watchdog is disabled this returns immediately. Because the pings are
        produced by the loop itself, a blocked loop stops them and systemd
        restarts the daemon.
        """
        if interval is None:
            interval = self.watchdog_interval()
        if interval is None or interval <= 0:
            return
        while True:
            self.watchdog()
            await asyncio.sleep(interval)
