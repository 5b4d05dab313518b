"""The one way the lab and the tests start a daemon: ``python -m kvpushd serve`` as a real process.

Writes the config, starts the process (optionally inside a network namespace), waits until the worker
socket reports READY, and stops it with SIGTERM and a bounded wait. The daemon's stdout and stderr go
to ``<workdir>/<name>.log``.

    d = start(workdir, "pnode", settings={"transfer": {"publish_timeout_s": 20.0}})
    d.client.attach(...)           # a KVPushClient on its worker socket
    rc = d.stop()                  # SIGTERM, wait (kill and raise after the timeout), exit code

Several daemons start faster together: ``spawn`` each, then ``wait_ready`` each (each one spends
seconds importing NIXL).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvpushd_client import KVPushClient, KVPushError

from .backend import backend_env, with_backend
from .faults import with_site

if TYPE_CHECKING:
    from .netns import NetnsLab

Settings = Mapping[str, Mapping[str, object]]


class DaemonStartError(RuntimeError):
    """A daemon exited or did not become ready in time; the message ends with its log."""


def term_with_parent() -> None:
    """Linux: SIGTERM this process when its parent dies (a killed demo leaves no daemon or engine behind)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def daemon_config(name: str, sock: str, listen: str = "127.0.0.1:0", advertise_host: str = "127.0.0.1",
                  settings: Settings | None = None, extra: str = "") -> str:
    """The TOML config of one daemon: node id, worker socket, peer listen address, then ``settings``
    (section -> key -> value, merged into those sections) and ``extra`` (raw TOML, appended; without
    ``settings`` the section it follows is [peer_api], so bare keys there are peer_api keys, as the
    older tests' configs have it)."""
    sections: dict[str, dict[str, object]] = {
        "node": {"node_id": name, "advertise_host": advertise_host},
        "worker_api": {"socket": sock},
        "peer_api": {"listen": listen},
    }
    for section, values in (settings or {}).items():
        sections.setdefault(section, {}).update(values)
    # JSON strings, numbers and booleans are valid TOML values
    return "".join(f"[{sec}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in kv.items())
                   for sec, kv in sections.items()) + extra


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads), from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Daemon:
    """A started ``kvpushd serve`` process and a client on its worker socket."""

    name: str
    sock: str
    proc: subprocess.Popen[bytes]
    log: Path
    peer_address: str = ""
    metrics_address: str = ""
    config: Path | None = None
    _client: KVPushClient | None = field(default=None, repr=False)
    _start: Callable[[str], subprocess.Popen[bytes]] | None = field(default=None, repr=False)

    @property
    def client(self) -> KVPushClient:
        """A client on the worker socket, made on first use: a gRPC channel in this process before a
        later fork (``preexec_fn``) makes gRPC's fork handlers abort the child."""
        if self._client is None:
            self._client = KVPushClient(self.sock)
        return self._client

    @client.setter
    def client(self, c: KVPushClient) -> None:
        self._client = c

    @property
    def pid(self) -> int:
        return self.proc.pid

    def logs(self) -> str:
        return self.log.read_text(errors="replace")

    def check(self) -> None:
        """Raise DaemonStartError if the process has exited (say, it failed to start)."""
        if self.proc.poll() is not None:
            raise DaemonStartError(f"daemon {self.name} exited with code {self.proc.returncode}; the end of "
                                   f"{self.log}:\n{self.logs()[-3000:]}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        """Send ``sig`` and wait for the exit code; after ``timeout`` kill it and raise TimeoutExpired."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise

    def terminate(self) -> None:
        """Close the client and SIGTERM: the daemon drains and exits (see ``wait``)."""
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout_s: float = 30.0) -> int | None:
        """Wait for the exit; kill it after ``timeout_s``. Never raises."""
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5)
            return None

    def shutdown(self, timeout_s: float = 30.0) -> int | None:
        self.terminate()
        return self.wait(timeout_s)

    def restart(self) -> None:
        """Start the process again with the same config and environment (the log is appended to);
        call after it has exited, then ``wait_ready``."""
        assert self._start is not None and self.proc.poll() is not None, "restart a daemon that has exited"
        if self._client is not None:
            self._client.close()
            self._client = None
        self.proc = self._start("ab")

    def cpu_s(self) -> float:
        return cpu_seconds(self.proc.pid)

    def metrics(self) -> str:
        if not self.metrics_address:
            return ""
        with urllib.request.urlopen(f"http://{self.metrics_address}/metrics", timeout=5) as r:
            return str(r.read().decode())

    def log_records(self, event: str) -> list[dict[str, Any]]:
        """The daemon's JSON log lines whose ``event`` is ``event``."""
        out = []
        for line in self.logs().splitlines():
            if not line.startswith("{"):
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("event") == event:
                out.append(rec)
        return out


def spawn(workdir: Path | str, name: str, *, listen: str = "127.0.0.1:0", advertise_host: str | None = None,
          settings: Settings | None = None, extra_config: str = "", netns: tuple[NetnsLab, int] | None = None,
          env: Mapping[str, str] | None = None, python: str = sys.executable, die_with_parent: bool = False,
          cwd: str | Path | None = None, backend: str = "UCX") -> Daemon:
    """Write ``<workdir>/<name>.toml`` and start the daemon; it is not ready yet (``wait_ready``).

    ``backend``: the NIXL backend (``transfer.backends``); LIBFABRIC adds the environment its plugin needs
    (``kvpushd_lab.backend``: its libraries, the tcp provider, in a namespace its veth) or raises
    BackendUnavailable naming what is missing.

    ``netns=(lab, i)``: run it inside the lab's namespace i, peer API on that namespace's address
    (port 7700 unless ``listen`` names one there), callers allowed from the lab's /24 (``peer_api.allow``,
    unless ``settings`` names them) and UCX limited to TCP on its veth. ``python``: the
    interpreter that runs it (another venv's, say). ``die_with_parent``: it gets SIGTERM (SIGKILL in
    a namespace) when this process dies."""
    workdir = Path(workdir)
    sock = str(workdir / f"{name}.sock")
    run_env = with_site(os.environ if env is None else env)  # KVPUSHD_FAULTS: the fault-injecting agent (faults.py)
    if netns is not None:
        lab, i = netns
        if listen.startswith("127.0.0.1:"):
            listen = f"{lab.addrs[i]}:7700"
        run_env.setdefault("UCX_TLS", "tcp")
        run_env.setdefault("UCX_NET_DEVICES", lab.veth)
        # not loopback: protected mode would refuse the other namespaces; allow the lab's /24
        peer_api = dict((settings or {}).get("peer_api", {}))
        peer_api.setdefault("allow", [f"{lab.addrs[i].rpartition('.')[0]}.0/24"])
        settings = {**(settings or {}), "peer_api": peer_api}
    if backend != "UCX":
        run_env = backend_env(backend, run_env, iface=netns[0].veth if netns is not None else "")
        settings, extra_config = with_backend(settings, extra_config, backend)
    host = advertise_host if advertise_host is not None else listen.rpartition(":")[0]
    cfg = workdir / f"{name}.toml"
    cfg.write_text(daemon_config(name, sock, listen, host, settings, extra_config))
    log = workdir / f"{name}.log"
    argv = [python, "-m", "kvpushd", "serve", "--config", str(cfg)]

    def start_process(mode: str) -> subprocess.Popen[bytes]:
        with open(log, mode) as out:
            if netns is not None:
                return netns[0].popen(netns[1], argv, die_with_parent=die_with_parent, stdout=out,
                                      stderr=subprocess.STDOUT, env=run_env, cwd=cwd)
            return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=run_env, cwd=cwd,
                                    preexec_fn=term_with_parent if die_with_parent else None)

    proc = start_process("wb")
    return Daemon(name, sock, proc, log, config=cfg, _start=start_process)


def wait_ready(d: Daemon, timeout_s: float = 90.0) -> Daemon:
    """Wait until the daemon reports READY; fill in its peer and metrics addresses. On failure the
    process is killed and DaemonStartError carries the end of its log."""
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                d.client.wait_ready(min(1.0, max(0.1, deadline - time.monotonic())))
                break
            except KVPushError:
                if d.proc.poll() is not None or time.monotonic() > deadline:
                    raise
        st = d.client.status()
    except Exception:
        rc = d.proc.poll()
        d.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            d.proc.wait(10)
        d.client.close()
        raise DaemonStartError(f"daemon {d.name} did not start (exit {rc}):\n{d.logs()[-4000:]}") from None
    d.peer_address = st.peer_address
    d.metrics_address = st.metrics_address
    return d


def start(workdir: Path | str, name: str, *, timeout_s: float = 90.0, **kw: Any) -> Daemon:
    """``spawn`` and ``wait_ready``: a running daemon."""
    return wait_ready(spawn(workdir, name, **kw), timeout_s)


def start_all(workdir: Path | str, names: Sequence[str], *, timeout_s: float = 90.0,
              per_daemon: Mapping[str, Mapping[str, Any]] | None = None, **kw: Any) -> list[Daemon]:
    """Start several daemons at once, then wait for each; on a failure the others are killed."""
    spawned: list[Daemon] = []
    try:
        for n in names:
            spawned.append(spawn(workdir, n, **{**kw, **(per_daemon or {}).get(n, {})}))
        return [wait_ready(d, timeout_s) for d in spawned]
    except BaseException:
        for d in spawned:
            if d.proc.poll() is None:
                d.proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    d.proc.wait(10)
        raise


def stop_all(daemons: Sequence[Daemon], timeout_s: float = 30.0) -> dict[str, int | None]:
    """SIGTERM all at once (they drain in parallel), then wait for each: name -> exit code (None: killed)."""
    for d in daemons:
        d.terminate()
    return {d.name: d.wait(timeout_s) for d in daemons}
