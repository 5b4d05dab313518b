"""Tests for the systemd integration: the unit file, the default config and sd_notify.

The sd_notify tests bind a real AF_UNIX/SOCK_DGRAM socket (as systemd does) and
point NOTIFY_SOCKET at it, both as a filesystem path and as an abstract '@name'.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import shutil
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import textwrap
import tomllib
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

import kvpushd.systemd as sd
from kvpushd.systemd import SdNotifier

REPO_ROOT = Path(__file__).resolve().parents[2]
UNIT_FILE = REPO_ROOT / "systemd" / "kvpushd.service"
CONFIG_FILE = REPO_ROOT / "systemd" / "kvpushd.toml"
EXEC_START = "/usr/local/bin/kvpushd serve --config /etc/kvpushd/kvpushd.toml"


# --------------------------------------------------------------------------
# helpers


def _unit_directives(text: str) -> dict[str, list[str]]:
    """'Section.Key' -> values, in order (systemd allows repeated keys)."""
    out: dict[str, list[str]] = {}
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, sep, value = line.partition("=")
        assert sep, f"not a directive: {raw!r}"
        out.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return out


class Receiver:
    """The service-manager side of sd_notify: a bound AF_UNIX datagram socket."""

    def __init__(self, kind: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        # Ask the kernel to attach the sender's pid/uid/gid, as systemd does to
        # enforce NotifyAccess=main.
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self._tmpdir: tempfile.TemporaryDirectory[str] | None = None
        if kind == "path":
            # A short directory: AF_UNIX paths are limited to 108 bytes and
            # pytest's tmp_path can be longer than that.
            self._tmpdir = tempfile.TemporaryDirectory(prefix="kvsd-")
            path = os.path.join(self._tmpdir.name, "notify")
            self.sock.bind(path)
            self.env_value = path
        else:
            name = f"kvpushd-test-{os.getpid()}-{uuid.uuid4().hex}"
            self.sock.bind(b"\0" + name.encode())
            self.env_value = "@" + name
        self.sock.settimeout(10)

    def recv(self) -> str:
        return self.sock.recv(65536).decode()

    def recv_with_pid(self) -> tuple[str, int]:
        size = socket.CMSG_SPACE(struct.calcsize("3i"))
        data, ancdata, _flags, _addr = self.sock.recvmsg(65536, size)
        pid = -1
        for level, type_, cdata in ancdata:
            if level == socket.SOL_SOCKET and type_ == socket.SCM_CREDENTIALS:
                pid, _uid, _gid = struct.unpack("3i", cdata[: struct.calcsize("3i")])
        return data.decode(), pid

    def pending(self) -> bool:
        readable, _, _ = select.select([self.sock], [], [], 0)
        return bool(readable)

    def close(self) -> None:
        self.sock.close()
        if self._tmpdir is not None:
            self._tmpdir.cleanup()


@pytest.fixture(params=["path", "abstract"])
def receiver(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Receiver]:
    rx = Receiver(request.param)
    monkeypatch.setenv("NOTIFY_SOCKET", rx.env_value)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    try:
        yield rx
    finally:
        rx.close()


@pytest.fixture
def no_systemd_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        monkeypatch.delenv(var, raising=False)


# --------------------------------------------------------------------------
# unit file


def _verify(unit_text: str, tmp_path: Path) -> tuple[int, str]:
    """Run `systemd-analyze verify` on a copy of the unit, return (rc, output).

    verify checks that ExecStart='s binary exists and is executable, and
    /usr/local/bin/kvpushd is not installed on a test machine. So the copy's
    ExecStart binary is rewritten to an executable stub in tmp_path; every other
    line, including the arguments, is verified exactly as shipped.
    """
    stub = tmp_path / "kvpushd"
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(stub.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    assert f"ExecStart={EXEC_START}\n" in unit_text
    rewritten = unit_text.replace(
        "ExecStart=/usr/local/bin/kvpushd ", f"ExecStart={stub} ", 1
    )
    # verify derives the unit name from the file name, keep it.
    unit_copy = tmp_path / "kvpushd.service"
    unit_copy.write_text(rewritten)
    proc = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(unit_copy)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    output = proc.stdout + proc.stderr
    # On a booted host verify may also print notes about unrelated units; only
    # lines about our unit count.
    ours = "\n".join(line for line in output.splitlines() if "kvpushd" in line)
    return proc.returncode, ours


requires_systemd_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="systemd-analyze not installed (Debian: apt-get install -y systemd)",
)


@requires_systemd_analyze
def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    rc, ours = _verify(UNIT_FILE.read_text(), tmp_path)
    # verify exits 0 even for unknown keys and unparsable values (it only
    # prints "…, ignoring."), so "no message about our unit" is the real check.
    assert rc == 0, ours
    assert ours == "", ours


@requires_systemd_analyze
def test_verify_check_detects_bad_directives(tmp_path: Path) -> None:
    """Guard against the verify test passing vacuously."""
    broken = (
        UNIT_FILE.read_text().replace(
            "RestrictAddressFamilies=", "RestrictAddressFamilies=AF_NOPE ", 1
        )
        + "\n[Service]\nNoSuchDirective=yes\n"
    )
    _rc, ours = _verify(broken, tmp_path)
    assert "NoSuchDirective" in ours
    assert "address famil" in ours.lower()


def test_unit_contents() -> None:
    d = _unit_directives(UNIT_FILE.read_text())

    def one(key: str) -> str:
        values = d.get(key)
        assert values is not None, key
        assert len(values) == 1, (key, values)
        return values[0]

    assert one("Service.Type") == "notify"
    assert one("Service.NotifyAccess") == "main"
    assert one("Service.ExecStart") == EXEC_START
    assert one("Service.WatchdogSec") == "30"
    assert one("Service.Restart") == "on-failure"
    assert one("Service.RestartSec") == "2"
    assert one("Service.RuntimeDirectory") == "kvpushd"
    assert one("Service.RuntimeDirectoryMode") == "0750"
    assert one("Service.LimitMEMLOCK") == "infinity"
    assert one("Service.LimitNOFILE") == "1048576"
    assert one("Service.TimeoutStopSec") == "60"
    assert one("Service.KillSignal") == "SIGTERM"
    assert one("Service.NoNewPrivileges") == "yes"
    assert one("Service.ProtectSystem") == "strict"
    assert one("Service.ProtectHome") == "read-only"
    assert one("Service.PrivateTmp") == "yes"
    assert one("Service.ReadWritePaths").split() == ["/dev/shm", "/run/kvpushd"]
    families = one("Service.RestrictAddressFamilies").split()
    assert {"AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"} <= set(families)
    assert one("Install.WantedBy") == "multi-user.target"
    # Settings that would hide /dev/infiniband, /dev/nvidia* or /dev/shm
    # segments from the daemon (ProtectClock= implies a DeviceAllow= list).
    for forbidden in (
        "PrivateDevices",
        "DevicePolicy",
        "DeviceAllow",
        "ProtectClock",
        "RemoveIPC",
    ):
        assert f"Service.{forbidden}" not in d, forbidden
    # Recommended account is documented but left commented out.
    text = UNIT_FILE.read_text()
    assert "#User=kvpushd" in text
    assert "#Group=kvpushd" in text
    assert "Service.User" not in d


def test_default_config_keys_and_values() -> None:
    with CONFIG_FILE.open("rb") as f:
        cfg = tomllib.load(f)
    assert cfg == {
        "node": {"node_id": "", "advertise_host": ""},
        "worker_api": {"socket": "/run/kvpushd/worker.sock", "socket_mode": 0o660},
        "peer_api": {"listen": "0.0.0.0:7700"},
        "transfer": {
            "backends": ["UCX"],
            "publish_timeout_s": 120.0,
            "expect_timeout_s": 120.0,
        },
        "log": {"level": "info", "format": "auto"},
        "metrics": {"enabled": True, "listen": "127.0.0.1:9400"},
    }
    # The socket lives in the unit's RuntimeDirectory, which ReadWritePaths covers.
    d = _unit_directives(UNIT_FILE.read_text())
    runtime_dir = "/run/" + d["Service.RuntimeDirectory"][0]
    assert os.path.dirname(cfg["worker_api"]["socket"]) == runtime_dir
    assert "--config /etc/kvpushd/kvpushd.toml" in d["Service.ExecStart"][0]


# --------------------------------------------------------------------------
# sd_notify protocol


def test_notifications_arrive_in_order(receiver: Receiver) -> None:
    n = SdNotifier.from_env()
    assert n.ready(status="serving: worker.sock + :7700,\nNIXL UCX up") is True
    assert n.watchdog() is True
    assert n.stopping() is True
    assert n.ready() is True
    assert [receiver.recv() for _ in range(4)] == [
        "READY=1\nSTATUS=serving: worker.sock + :7700, NIXL UCX up",  # a newline cannot add an assignment
        "WATCHDOG=1",
        "STOPPING=1",
        "READY=1",
    ]
    n.close()
    n.close()  # idempotent
    assert not receiver.pending()


def test_send_after_close_reopens(receiver: Receiver) -> None:
    n = SdNotifier()
    assert n.watchdog() is True
    n.close()
    assert n.watchdog() is True
    assert receiver.recv() == "WATCHDOG=1"
    assert receiver.recv() == "WATCHDOG=1"
    n.close()


def test_full_receive_queue_does_not_block(receiver: Receiver) -> None:
    """systemd not reading must never block the event loop: send returns False."""
    n = SdNotifier()
    for _ in range(100_000):
        if not n.watchdog():
            break
    else:
        pytest.fail("receive queue never filled up")
    # After the manager reads, notifications flow again.
    receiver.recv()
    assert n.watchdog() is True
    n.close()


def test_watchdog_interval(monkeypatch: pytest.MonkeyPatch, receiver: Receiver) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "2000000")
    assert SdNotifier().watchdog_interval() == 1.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert SdNotifier().watchdog_interval() == 1.0
    # Inherited from a parent whose watchdog it is: not ours to ping.
    monkeypatch.setenv("WATCHDOG_PID", str(os.getppid()))
    assert SdNotifier().watchdog_interval() is None
    monkeypatch.setenv("WATCHDOG_PID", "not-a-pid")
    assert SdNotifier().watchdog_interval() is None
    monkeypatch.delenv("WATCHDOG_PID")
    for bad in ("0", "-5", "soon", ""):
        monkeypatch.setenv("WATCHDOG_USEC", bad)
        assert SdNotifier().watchdog_interval() is None
    monkeypatch.delenv("WATCHDOG_USEC")
    assert SdNotifier().watchdog_interval() is None
    # Explicit environment mappings work too.
    assert SdNotifier({"WATCHDOG_USEC": "30000000"}).watchdog_interval() == 15.0


def test_run_watchdog_pings_from_event_loop(receiver: Receiver) -> None:
    n = SdNotifier()

    async def main() -> None:
        task = asyncio.create_task(n.run_watchdog(interval=0.01))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    pings = 0
    while receiver.pending():
        assert receiver.recv() == "WATCHDOG=1"
        pings += 1
    assert pings >= 2
    n.close()


def test_run_watchdog_returns_when_disabled(receiver: Receiver) -> None:
    # WATCHDOG_USEC unset (fixture) -> nothing to do, returns at once.
    n = SdNotifier()
    asyncio.run(asyncio.wait_for(n.run_watchdog(), timeout=5))
    assert not receiver.pending()


def test_no_notify_socket_is_noop(no_systemd_env: None) -> None:
    n = SdNotifier()
    assert n.ready("x") is False
    assert n.ready() is False
    assert n.watchdog() is False
    assert n.stopping() is False
    assert n.watchdog_interval() is None
    assert n._sock is None  # no socket was ever opened
    n.close()
    n.close()


@pytest.mark.parametrize("value", ["", "relative/notify.sock", "@", "vsock:2:1234"])
def test_unusable_notify_socket_disables(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", value)
    n = SdNotifier()
    assert n.ready() is False
    assert n._sock is None


def test_missing_socket_path_returns_false(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "does-not-exist.sock"))
    n = SdNotifier()
    with structlog.testing.capture_logs() as logs:
        assert n.ready("up") is False
        assert n.watchdog() is False
        assert n.stopping() is False
    n.close()
    failures = [e for e in logs if e["event"] == "sd_notify.send_failed"]
    assert len(failures) == 3
    # Loud once, then quiet, so a broken socket does not flood the journal.
    assert [e["log_level"] for e in failures] == ["warning", "debug", "debug"]


def test_unbound_abstract_socket_returns_false(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", f"@kvpushd-test-unbound-{uuid.uuid4().hex}")
    n = SdNotifier()
    assert n.ready() is False
    n.close()


def test_manager_going_away_returns_false(receiver: Receiver) -> None:
    n = SdNotifier()
    assert n.ready() is True
    receiver.close()
    assert n.watchdog() is False
    n.close()


def test_module_exports() -> None:
    assert sd.__all__ == ["SdNotifier"]
    assert sd.__doc__ is not None
    assert "READY" in sd.__doc__
    assert "watchdog" in sd.__doc__


# --------------------------------------------------------------------------
# across processes


CHILD = textwrap.dedent(
    """
    import json, os, sys
    from kvpushd.systemd import SdNotifier

    n = SdNotifier()
    inherited = dict(os.environ, WATCHDOG_PID=str(os.getppid()))
    print(json.dumps({
        "pid": os.getpid(),
        "interval": n.watchdog_interval(),
        "interval_other_pid": SdNotifier(inherited).watchdog_interval(),
    }), flush=True)
    ok = [n.ready("child up"), n.watchdog(), n.stopping()]
    n.close()
    n.close()
    sys.exit(0 if all(ok) else 3)
    """
)


def test_child_process_notifies(receiver: Receiver) -> None:
    """A separate process (as systemd's main process would be) notifies us."""
    pkg_root = str(Path(sd.__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (pkg_root, env.get("PYTHONPATH")) if p
    )
    env["WATCHDOG_USEC"] = "4000000"
    env.pop("WATCHDOG_PID", None)
    assert env["NOTIFY_SOCKET"] == receiver.env_value
    proc = subprocess.run(
        [sys.executable, "-c", CHILD],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert info["interval"] == 2.0
    assert info["interval_other_pid"] is None
    messages = [receiver.recv_with_pid() for _ in range(3)]
    assert [m for m, _ in messages] == [
        "READY=1\nSTATUS=child up",
        "WATCHDOG=1",
        "STOPPING=1",
    ]
    # The kernel-attested sender is the child itself, which is what systemd
    # checks for NotifyAccess=main.
    assert {pid for _, pid in messages} == {info["pid"]}
