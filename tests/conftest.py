"""Shared fixtures: real daemons as real processes on unix sockets and loopback TCP (helpers: tests/support)."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from support import KV, make_kv

if TYPE_CHECKING:  # the lab (kvpushd_lab.launch) is imported only where daemons start: the vLLM venv has none
    from support.daemons import DaemonFactory, DaemonProc


@pytest.fixture
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="kvpushd-test-") as d:
        yield Path(d)


@pytest.fixture
def nixl_backend(request: pytest.FixtureRequest) -> str:
    """The NIXL backend of the test's daemons: UCX, or each of ``support.BACKENDS`` for a test marked
    ``@both_backends`` (LIBFABRIC skips, naming what is missing, without scripts/libfabric.sh's build)."""
    backend = str(getattr(request, "param", "UCX"))
    if backend != "UCX":
        from kvpushd_lab.backend import available

        if why := available(backend):
            pytest.skip(why)
    return backend


@pytest.fixture
def daemon_factory(workdir: Path, nixl_backend: str) -> Iterator[DaemonFactory]:
    """``daemon_factory(name, extra_config="", listen=...)`` starts a daemon in ``workdir`` on
    ``nixl_backend``; ``daemon_factory.pair(config)`` two. Whatever still runs is stopped after the test."""
    from support.daemons import DaemonFactory

    f = DaemonFactory(workdir, nixl_backend)
    try:
        yield f
    finally:
        f.close()


@pytest.fixture
def daemon_pair(daemon_factory: DaemonFactory) -> Iterator[tuple[DaemonProc, DaemonProc]]:
    """A prefill-node daemon and a decode-node daemon; both must exit 0 on SIGTERM afterwards."""
    p, d = daemon_factory.pair("[transfer]\npublish_timeout_s = 20.0\nexpect_timeout_s = 20.0\n")
    yield p, d
    daemon_factory.close(check=(p, d))


@pytest.fixture
def group_pair(daemon_factory: DaemonFactory) -> Iterator[tuple[DaemonProc, DaemonProc]]:
    """``daemon_pair`` with each progressive layer group its own WRITE, however small
    (``transfer.progressive_min_write_bytes = 0``): the per-group behaviour the layered tests check."""
    p, d = daemon_factory.pair("[transfer]\npublish_timeout_s = 20.0\nexpect_timeout_s = 20.0\n"
                               "progressive_min_write_bytes = 0\n")
    yield p, d
    daemon_factory.close(check=(p, d))


@pytest.fixture
def kv_pair() -> Iterator[tuple[KV, KV]]:
    src = make_kv("kvpushd-test-src", fill="random")
    dst = make_kv("kvpushd-test-dst", fill="poison")
    yield src, dst
    src.close()
    dst.close()
