"""Rails: NIXL backend settings from config ([transfer] backend, backend_params, device_params).

A live daemon pair whose UCX backends are created with init parameters and limited to loopback
(``UCX_NET_DEVICES=lo``, TCP only) still moves real bytes, and ``kvpushctl status`` shows each
worker's backend, its parameters and devices. Bad settings stop the daemon at start with a message.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kvpushd_client import CompletionKind, Expect, Publish
from support import DaemonFactory, DaemonProc, attach_pair

from kvpushd.config import TransferConfig, backend_init_params
from kvpushd.core.errors import FailedPrecondition
from kvpushd.transfer.backends import agent_devices, iface_not_running, memory_device
from kvpushd.transfer.thread import TransferThread

RAILS = """[transfer]
backend = "UCX"
publish_timeout_s = 20.0
expect_timeout_s = 20.0
[transfer.backend_params]
num_workers = 2
ucx_error_handling_mode = "peer"
[transfer.device_params.host]
num_workers = "3"
[metrics]
enabled = false
"""


@pytest.fixture(scope="module")
def rail_pair() -> Iterator[tuple[DaemonProc, DaemonProc]]:
    mp = pytest.MonkeyPatch()
    mp.setenv("UCX_NET_DEVICES", "lo")  # inherited by the daemons: UCX over TCP on loopback only
    mp.setenv("UCX_TLS", "tcp")
    try:
        with tempfile.TemporaryDirectory(prefix="kvpushd-rails-") as tmp:
            factory = DaemonFactory(Path(tmp))
            try:
                p, d = factory.pair(RAILS)
                yield p, d
                factory.close(check=(p, d))  # both exit 0
            finally:
                factory.close()
    finally:
        mp.undo()


def ctl_json(sock: str, *args: str) -> Any:
    r = subprocess.run([sys.executable, "-m", "kvpushd.ctl", "--socket", sock, *args, "--json"],
                       capture_output=True, text=True, timeout=60, check=True)
    return json.loads(r.stdout)


def test_transfer_over_configured_rails_and_status_shows_them(rail_pair: tuple[DaemonProc, DaemonProc],
                                                              kv_pair: Any) -> None:
    p, d = rail_pair
    src, dst = kv_pair
    pw, dw = attach_pair(p, d, src, dst)
    try:
        dw.send(Expect("rails-1", (3, 4, 9), p.peer_address, "prefill", 1))
        pw.send(Publish("rails-1", (1, 2, 7)))
        c = dw.next_completion(30)
        assert c is not None and c.kind is CompletionKind.FINISHED_RECEIVING, c
        s = pw.next_completion(30)
        assert s is not None and s.kind is CompletionKind.FINISHED_SENDING, s
        for sb, db in ((1, 3), (2, 4), (7, 9)):
            assert np.array_equal(src.arr[:, sb], dst.arr[:, db])

        for daemon, engine in ((p, "prefill"), (d, "decode")):
            st = ctl_json(daemon.sock, "status")
            assert st["backends"] == ["UCX"]
            assert st["config"]["transfer.backend"] == "UCX"
            assert json.loads(st["config"]["transfer.backend_params"]) == {
                "num_workers": "2", "ucx_error_handling_mode": "peer"}
            (w,) = st["workers"]
            assert w["engine_id"] == engine
            (b,) = w["backends"]
            # device_params.host (shared-memory KV) overrides backend_params' num_workers
            assert b["name"] == "UCX" and b["device"] == "host"
            assert b["params"]["num_workers"] == "3" and b["params"]["ucx_error_handling_mode"] == "peer"
            assert (b["devices"], b["devices_from"]) == ("lo", "env UCX_NET_DEVICES")
            text = subprocess.run([sys.executable, "-m", "kvpushd.ctl", "--socket", daemon.sock, "status"],
                                  capture_output=True, text=True, timeout=60, check=True).stdout
            assert "BACKENDS" in text and "UCX[host; devices lo (env UCX_NET_DEVICES);" in text
            assert "num_workers=3" in text
    finally:
        pw.detach()
        dw.detach()


def _have_libfabric() -> bool:
    try:
        ctypes.CDLL("libfabric.so.1")
        return True
    except OSError:
        return False


@pytest.mark.parametrize("extra, words", [
    ('[transfer]\nbackend = "NOSUCHBACKEND"\n', "NIXL backend(s) ['NOSUCHBACKEND'] not available"),
    pytest.param('[transfer]\nbackend = "LIBFABRIC"\n', "NIXL lists a LIBFABRIC plugin but cannot load it",
                 marks=pytest.mark.skipif(_have_libfabric(), reason="libfabric is installed: LIBFABRIC may load")),
    ('[transfer.backend_params]\nucx_device = "lo"\n', "has no parameter(s) ['ucx_device']"),
    ('[transfer.backend_params]\nnum_workers = "many"\n', "does not start with {'num_workers': 'many'}"),
])
def test_bad_backend_settings_stop_the_daemon_at_start(tmp_path: Path, extra: str, words: str) -> None:
    cfg = tmp_path / "k.toml"
    cfg.write_text(f'[worker_api]\nsocket = "{tmp_path / "w.sock"}"\n[peer_api]\nlisten = "127.0.0.1:0"\n'
                   f'[metrics]\nenabled = false\n{extra}')
    r = subprocess.run([sys.executable, "-m", "kvpushd", "serve", "--config", str(cfg)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 1, r.stderr[-2000:]
    assert words in r.stderr, r.stderr[-2000:]


def test_probe_checks_each_device_hint() -> None:
    """A bad value in one device_params entry fails at start too, naming the entry."""
    loop = asyncio.new_event_loop()
    cfg = TransferConfig(backends=("UCX",), device_params={"gpu3": {"num_workers": "x"}})
    t = TransferThread(loop, cfg, TransferThread.Reports(lambda r: None, lambda n: None),
                       params_for=lambda b, dev: backend_init_params(cfg, b, dev))
    try:
        with pytest.raises(FailedPrecondition, match=r"transfer.device_params.gpu3"):
            t.start()
        assert t._book.init_params("UCX", "host") == {}
    finally:
        t.stop()
        loop.close()


def test_device_helpers() -> None:
    assert memory_device("DRAM", [(1, 2, 0)]) == "host"
    assert memory_device("VRAM", [(1, 2, 5)]) == "gpu5"
    assert agent_devices("UCX", {"device_list": "mlx5_0,mlx5_1"}) == ("mlx5_0,mlx5_1", "device_list")
    assert agent_devices("LIBFABRIC", {"num_threads": "4"}) == ("", "")


def test_the_posts_of_one_loop_turn_reach_the_nixl_thread_as_one_command_in_order() -> None:
    """One queue item (one wake-up of the NIXL thread) for all the WRITEs a turn of the loop posts, and a
    command queued after them (a StopWrite of the same leg) still runs after them."""
    ran: list[object] = []

    async def turn() -> TransferThread:
        t = TransferThread(asyncio.get_running_loop(), TransferConfig(backends=("UCX",)),
                           TransferThread.Reports(lambda r: None, lambda n: None))
        t._post = lambda plan, remote, t0: ran.append(plan)  # type: ignore[method-assign]
        t._stages.stop = lambda why, **kw: ran.append(("stop", why))  # type: ignore[method-assign]
        t.post("w1", "remote")  # type: ignore[arg-type]
        t.post("w2", "remote")  # type: ignore[arg-type]
        assert t._q.qsize() == 0  # nothing queued until the turn ends, or another command comes
        t.stop_write("leg", "aborted")  # type: ignore[arg-type]
        t.post("w3", "remote")  # type: ignore[arg-type]
        await asyncio.sleep(0)  # the turn's end sends what it posted since
        return t

    t = asyncio.run(turn())
    assert t._q.qsize() == 3
    while not t._q.empty():
        cmd = t._q.get_nowait()
        assert cmd is not None
        cmd()
    assert ran == ["w1", "w2", ("stop", "aborted"), "w3"]


def test_iface_not_running_names_a_missing_or_idle_fi_tcp_iface_and_nothing_else() -> None:
    """The hint a LIBFABRIC start failure carries: only where ``FI_TCP_IFACE`` names an interface that is
    absent here or not RUNNING (loopback, up, runs)."""
    assert iface_not_running({}) == ""
    assert iface_not_running({"FI_TCP_IFACE": "lo"}) == ""
    assert "no such interface" in iface_not_running({"FI_TCP_IFACE": "kvpnosuch9"})
