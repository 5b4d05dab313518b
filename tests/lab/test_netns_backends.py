"""Two daemons in two network namespaces joined by one rate-limited veth pair, on each NIXL backend.

The KV bytes cross the veth (UCX over TCP on it; LIBFABRIC's tcp provider on it, ``FI_TCP_IFACE``) and are
checked bit for bit; then the decode daemon is SIGKILLed while a WRITE is on the wire (the link is slow
enough for that to be seen on its byte counters): the prefill worker's publish must end, FAILED with its
blocks, nothing may stay held, and the prefill daemon must move exact bytes to the decode daemon started
again on the same address. With two decode daemons, one killed while the same prefill worker WRITEs to
both, the other's WRITE completes with exact bytes. Skipped, saying why, without namespaces or without the
LIBFABRIC build.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from kvpushd_client import CompletionKind, Expect, Publish, Role
from kvpushd_lab import launch
from kvpushd_lab.netns import NetnsLab, available, sweep_stale
from support import KV, POISON, both_backends, make_kv, wait_for

pytestmark = pytest.mark.timeout(240)

RATE = "200mbit"  # 25 MB/s: a 24 MiB WRITE is on the wire for about a second
BLOCK = 256 << 10
REGIONS, BLOCKS = 4, 64
SETTINGS: dict[str, dict[str, object]] = {
    "transfer": {"publish_timeout_s": 30.0, "expect_timeout_s": 30.0, "heartbeat_interval_s": 0.2,
                 "peer_timeout_s": 2.0, "write_timeout_s": 20.0},
    "peer_api": {"connect_timeout_s": 2.0, "rpc_timeout_s": 3.0}}


def _shaped(hosts: int, link: str) -> Iterator[NetnsLab]:
    ok, why = available()
    if not ok:
        pytest.skip(f"multi-host tests need network namespaces: {why}")
    sweep_stale()
    with NetnsLab(hosts, link=link) as lab:
        yield lab.shape(RATE, burst="256kb")


@pytest.fixture
def lab() -> Iterator[NetnsLab]:
    yield from _shaped(2, "pair")


@pytest.fixture
def lab3() -> Iterator[NetnsLab]:
    """A prefill host and two decode hosts on a bridge, each host's link shaped."""
    yield from _shaped(3, "bridge")


def _kv(name: str, fill: str) -> KV:
    return make_kv(name, regions=REGIONS, num_blocks=BLOCKS, block_len=BLOCK, fill=fill)


@both_backends
def test_bytes_cross_the_veth_and_a_decode_daemon_killed_mid_write(lab: NetnsLab, workdir: Path,
                                                                    nixl_backend: str) -> None:
    p, d = launch.start_all(workdir, ["pnode", "dnode"], backend=nixl_backend, die_with_parent=True, timeout_s=120,
                            settings=SETTINGS, per_daemon={"pnode": {"netns": (lab, 0)}, "dnode": {"netns": (lab, 1)}})
    src, dst = _kv("kvpushd-test-ns-src", "random"), _kv("kvpushd-test-ns-dst", "poison")
    try:
        pw = p.client.attach("prefill", Role.PRODUCER, 0, 1, [src.buf.memory], src.region_list)
        dw = d.client.attach("decode", Role.CONSUMER, 0, 1, [dst.buf.memory], dst.region_list)
        rx0 = lab.link_stats(1)["rx_bytes"]
        dw.send(Expect("across", (1, 2), p.peer_address, "prefill", 1))
        pw.send(Publish("across", (3, 4)))
        c = dw.next_completion(30)
        assert c is not None and c.kind is CompletionKind.FINISHED_RECEIVING, c
        assert pw.next_completion(30).kind is CompletionKind.FINISHED_SENDING
        assert np.array_equal(dst.arr[:, [1, 2]], src.arr[:, [3, 4]])
        assert lab.link_stats(1)["rx_bytes"] - rx0 >= 2 * REGIONS * BLOCK  # the bytes crossed the veth

        # A WRITE of 24 blocks (24 MiB) on the wire, and the decode daemon SIGKILLed under it.
        big = list(range(8, 32))
        dw.send(Expect("doomed", tuple(big), p.peer_address, "prefill", 1))
        assert wait_for(lambda: any(t.state == "registered" for t in d.client.status().transfers))
        rx0 = lab.link_stats(1)["rx_bytes"]
        pw.send(Publish("doomed", tuple(big)))
        assert wait_for(lambda: lab.link_stats(1)["rx_bytes"] - rx0 > (2 << 20), timeout=20, interval=0.01)
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait(10)
        t0 = time.monotonic()
        c = pw.next_completion(60)
        waited = time.monotonic() - t0
        assert c is not None and c.kind is CompletionKind.FAILED and c.block_ids == tuple(big), c
        assert c.code in ("TRANSFER_ERROR", "PEER_UNREACHABLE"), c
        assert waited < 30, f"{nixl_backend}: {waited:.1f} s to end a WRITE whose peer died ({c.reason})"
        assert wait_for(lambda: not p.client.status().transfers, timeout=20)

        # The same decode node again (new process, new agent): exact bytes.
        dst.arr[:] = POISON
        d.restart()
        launch.wait_ready(d, 120)
        dw = d.client.attach("decode", Role.CONSUMER, 0, 1, [dst.buf.memory], dst.region_list)
        dw.send(Expect("after", (5, 6, 7), p.peer_address, "prefill", 1))
        pw.send(Publish("after", (40, 41, 42)))
        c = dw.next_completion(30)
        assert c is not None and c.kind is CompletionKind.FINISHED_RECEIVING, (c, p.logs()[-4000:])
        assert pw.next_completion(30).kind is CompletionKind.FINISHED_SENDING
        assert np.array_equal(dst.arr[:, [5, 6, 7]], src.arr[:, [40, 41, 42]])
        others = [b for b in range(BLOCKS) if b not in (5, 6, 7)]
        assert np.all(dst.arr[:, others] == POISON)
        assert p.proc.poll() is None
    finally:
        rcs = launch.stop_all([p, d])
        src.close()
        dst.close()
    assert rcs["pnode"] == 0, p.logs()[-3000:]


@both_backends
def test_a_decode_daemon_killed_mid_write_fails_only_its_own_write(lab3: NetnsLab, workdir: Path,
                                                                   nixl_backend: str) -> None:
    """One prefill worker (one NIXL agent) WRITEs to two decode daemons at once and one of them is
    SIGKILLed: only its WRITE fails. (LIBFABRIC reports a dead peer's cancelled operations as completions
    in error on the agent, with nothing that says whose; a check that read one failed the live peer's
    WRITE before the NIXL thread read them out by a notification poll first.)"""
    p, a, b = launch.start_all(workdir, ["pnode", "anode", "bnode"], backend=nixl_backend, die_with_parent=True,
                               timeout_s=120, settings=SETTINGS,
                               per_daemon={"pnode": {"netns": (lab3, 0)}, "anode": {"netns": (lab3, 1)},
                                           "bnode": {"netns": (lab3, 2)}})
    src, da, db = _kv("kvpushd-test-ns3-src", "random"), _kv("kvpushd-test-ns3-a", "poison"), \
        _kv("kvpushd-test-ns3-b", "poison")
    try:
        pw = p.client.attach("prefill", Role.PRODUCER, 0, 1, [src.buf.memory], src.region_list)
        aw = a.client.attach("decode-a", Role.CONSUMER, 0, 1, [da.buf.memory], da.region_list)
        bw = b.client.attach("decode-b", Role.CONSUMER, 0, 1, [db.buf.memory], db.region_list)
        big = list(range(8, 32))
        aw.send(Expect("to-a", tuple(big), p.peer_address, "prefill", 1))
        bw.send(Expect("to-b", tuple(big), p.peer_address, "prefill", 1))
        for d in (a, b):
            assert wait_for(lambda d=d: any(t.state == "registered" for t in d.client.status().transfers))
        rx0 = lab3.link_stats(1)["rx_bytes"]
        pw.send(Publish("to-b", tuple(big)))  # the live peer's WRITE first: its checks come first
        pw.send(Publish("to-a", tuple(big)))
        assert wait_for(lambda: lab3.link_stats(1)["rx_bytes"] - rx0 > (2 << 20), timeout=20, interval=0.01)
        a.proc.send_signal(signal.SIGKILL)
        a.proc.wait(10)
        ends = {}
        for _ in range(2):
            c = pw.next_completion(60)
            assert c is not None, ends
            ends[c.transfer_id] = c
        assert ends["to-a"].kind is CompletionKind.FAILED, ends
        assert ends["to-b"].kind is CompletionKind.FINISHED_SENDING, (ends["to-b"], p.logs()[-3000:])
        c = bw.next_completion(30)
        assert c is not None and c.kind is CompletionKind.FINISHED_RECEIVING, c
        assert np.array_equal(db.arr[:, big], src.arr[:, big])
        assert wait_for(lambda: not p.client.status().transfers, timeout=20)
        assert p.proc.poll() is None and b.proc.poll() is None
    finally:
        rcs = launch.stop_all([p, a, b])
        for kv in (src, da, db):
            kv.close()
    assert rcs["pnode"] == 0 and rcs["bnode"] == 0, p.logs()[-3000:]


def test_a_libfabric_daemon_on_a_link_without_carrier_says_so_and_the_lab_waits_for_the_link(lab: NetnsLab,
                                                                                              workdir: Path) -> None:
    """libfabric's tcp provider, told ``FI_TCP_IFACE`` of a link that is up but not RUNNING (its peer down,
    or the kernel's link watch not yet run after both came up), finds no address and NIXL reports only
    "fi_enable failed: Bad file descriptor". The daemon names the interface and why; the lab waits until
    every veth runs before it hands the namespaces out, so its daemons never start in that window."""
    from kvpushd_lab.backend import available as backend_available
    from kvpushd_lab.netns import wait_running

    if why := backend_available("LIBFABRIC"):
        pytest.skip(why)
    lab.run(0, ["ip", "link", "set", lab.veth, "down"])  # host 1's end: UP, NO-CARRIER
    with pytest.raises(RuntimeError, match="not running"):
        wait_running(lab.names[1], lab.veth, timeout_s=0.3)
    with pytest.raises(launch.DaemonStartError, match=r"FI_TCP_IFACE=kvp0: the interface is not running"):
        launch.start_all(workdir, ["dnode"], backend="LIBFABRIC", die_with_parent=True, timeout_s=60,
                         settings=SETTINGS, per_daemon={"dnode": {"netns": (lab, 1)}})
    lab.run(0, ["ip", "link", "set", lab.veth, "up"])
    wait_running(lab.names[1], lab.veth)
    (d,) = launch.start_all(workdir, ["dnode2"], backend="LIBFABRIC", die_with_parent=True, timeout_s=60,
                            settings=SETTINGS, per_daemon={"dnode2": {"netns": (lab, 1)}})
    assert d.stop() == 0
