"""Daemons for tests: ``start_daemon`` and the one ``DaemonFactory``, over the lab's launcher."""

from __future__ import annotations

import signal
import subprocess
import urllib.request
from collections.abc import Iterable
from pathlib import Path

from kvpushd_lab import launch
from prometheus_client.parser import text_string_to_metric_families

DaemonProc = launch.Daemon


def start_daemon(workdir: Path, name: str, extra_config: str = "", listen: str = "127.0.0.1:0",
                 settings: launch.Settings | None = None, backend: str = "UCX") -> DaemonProc:
    """A ready daemon: node ``name``, worker socket ``<workdir>/<name>.sock``, ``settings`` (section ->
    key -> value), ``extra_config`` (TOML) appended, NIXL ``backend`` (its environment: kvpushd_lab.backend)."""
    try:
        return launch.start(workdir, name, listen=listen, advertise_host="127.0.0.1", extra_config=extra_config,
                            settings=settings, backend=backend,
                            timeout_s=120)  # a loaded machine: imports alone can take a minute
    except launch.DaemonStartError as e:
        raise RuntimeError(str(e)) from None


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(d: DaemonProc) -> Samples:
    """Every sample of the daemon's /metrics (it must listen: ``metrics.listen``), by name and labels."""
    addr = d.client.status().metrics_address
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(m: Samples, name: str, **labels: str) -> float:
    return m.get((name, frozenset(labels.items())), 0.0)


class DaemonFactory:
    """Starts daemons in one directory, all on NIXL ``backend``, and stops whatever still runs at
    ``close`` (a stopped one with SIGSTOP is continued first): the one daemon factory of the tests."""

    def __init__(self, workdir: Path, backend: str = "UCX") -> None:
        self.workdir = workdir
        self.backend = backend
        self.started: list[DaemonProc] = []

    def __call__(self, name: str, extra_config: str = "", listen: str = "127.0.0.1:0",
                 settings: launch.Settings | None = None) -> DaemonProc:
        d = start_daemon(self.workdir, name, extra_config, listen, settings, self.backend)
        self.started.append(d)
        return d

    def pair(self, extra_config: str = "", names: tuple[str, str] = ("pnode", "dnode"),
             settings: launch.Settings | None = None) -> tuple[DaemonProc, DaemonProc]:
        """A prefill-node daemon and a decode-node daemon with the same settings."""
        return self(names[0], extra_config, settings=settings), self(names[1], extra_config, settings=settings)

    def close(self, check: Iterable[DaemonProc] = ()) -> None:
        """Close every client, SIGTERM every daemon still running and wait; each daemon in ``check``
        must have exited 0."""
        must = {id(x) for x in check}
        errors = []
        for x in self.started:
            x.client.close()
            if x.proc.poll() is None:
                x.proc.send_signal(signal.SIGCONT)
            try:
                rc = x.stop()
            except subprocess.TimeoutExpired:
                errors.append(f"daemon {x.name} did not stop within 30 s of SIGTERM (killed)")
                continue
            if id(x) in must and rc != 0:
                errors.append(f"daemon {x.name} exited {rc}:\n{x.logs()[-3000:]}")
        self.started.clear()
        assert not errors, "\n".join(errors)
