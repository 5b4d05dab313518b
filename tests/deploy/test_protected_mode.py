"""Closed by default (protected mode) with real daemons: loopback only, unless TLS, ``allow`` or ``insecure``.

A second caller address without root: the prefill daemon's peer API listens on 0.0.0.0, and callers
dial it at this machine's own non-loopback address (``hostname -I``); the kernel then uses that
address as the connection's source, so the daemon sees a non-loopback caller. Skipped where the host
has no such address.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import socket
import subprocess
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvpushd_client import Abort, CompletionKind, Expect, Publish
from kvpushd_client.proto.v1 import peer_pb2, peer_pb2_grpc
from support import POISON, attach_pair, start_daemon

from kvpushd.config import Config, PeerApiConfig, default_advertise_host, from_dict
from kvpushd.core.errors import InvalidArgument
from kvpushd.peer_security import AllowList, access_mode, peer_interceptors

pytestmark = pytest.mark.timeout(180)

FAST = "[transfer]\npublish_timeout_s = 30.0\nexpect_timeout_s = 30.0\n"
PEER_FAST = "connect_timeout_s = 3.0\nrpc_timeout_s = 5.0\n"


def host_ip() -> str:
    """A non-loopback IPv4 address of this machine that we can bind, or ""."""
    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=10).stdout.split()
    except (OSError, subprocess.SubprocessError):
        out = []
    for a in out:
        try:
            ip = ipaddress.ip_address(a)
        except ValueError:
            continue
        if ip.version == 4 and not ip.is_loopback:
            with socket.socket() as s:
                try:
                    s.bind((a, 0))
                except OSError:
                    continue
            return a
    return ""


@pytest.fixture(scope="module")
def ip() -> str:
    a = host_ip()
    if not a:
        pytest.skip("this host has no non-loopback IPv4 address to call from")
    return a


def start_p(workdir: Path, peer_api: str = ""):  # type: ignore[no-untyped-def]
    """A prefill daemon whose peer API listens on every address (0.0.0.0, ephemeral port)."""
    return start_daemon(workdir, "pnode", PEER_FAST + peer_api + FAST, listen="0.0.0.0:0")


def start_d(workdir: Path):  # type: ignore[no-untyped-def]
    return start_daemon(workdir, "dnode", PEER_FAST + FAST)


def port_of(p) -> int:  # type: ignore[no-untyped-def]
    return int(p.peer_address.rpartition(":")[2])


def log_lines(p) -> list[dict[str, object]]:  # type: ignore[no-untyped-def]
    out = []
    for line in p.logs().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def transfer(pw, dw, address: str, tid: str, dst_blocks: list[int], src_blocks: list[int]):  # type: ignore[no-untyped-def]
    dw.send(Expect(tid, tuple(dst_blocks), address, "prefill", 1))
    pw.send(Publish(tid, tuple(src_blocks)))
    c_d = dw.next_completion(40)
    c_p = pw.next_completion(40) if c_d is not None and c_d.kind is CompletionKind.FINISHED_RECEIVING else None
    return c_d, c_p


def stop(*daemons) -> None:  # type: ignore[no-untyped-def]
    for x in daemons:
        x.client.close()
        if x.proc.poll() is None:
            assert x.stop() == 0, x.logs()[-3000:]


def test_default_refuses_non_loopback_callers_and_says_how_to_open(workdir: Path, ip: str, kv_pair) -> None:  # type: ignore[no-untyped-def]
    src, dst = kv_pair
    p = start_p(workdir)
    d = start_d(workdir)
    try:
        addr = f"{ip}:{port_of(p)}"
        # a plain gRPC caller from the host's own non-loopback address: refused before the servicer runs
        with grpc.insecure_channel(addr) as ch:
            with pytest.raises(grpc.RpcError) as e:
                peer_pb2_grpc.PeerServiceStub(ch).Handshake(peer_pb2.HandshakeRequest(node_id="rogue"), timeout=10)
            assert e.value.code() is grpc.StatusCode.PERMISSION_DENIED, e.value
            msg = e.value.details()
            assert ip in msg and "protected mode" in msg, msg
            for hint in ("tls_cert", "allow_names", "allow = [", "insecure = true"):
                assert hint in msg, (hint, msg)
            # the health service stays open (probes)
            h = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert h.status == health_pb2.HealthCheckResponse.SERVING

        # a decode daemon that dials the non-loopback address: its Expect fails, nothing is written
        pw, dw = attach_pair(p, d, src, dst)
        c_d, _ = transfer(pw, dw, addr, "from-network", [1, 2], [10, 11])
        assert c_d is not None and c_d.kind is CompletionKind.FAILED and c_d.code == "PEER_REJECTED", c_d
        assert "PERMISSION_DENIED" in c_d.reason and "insecure = true" in c_d.reason, c_d.reason
        assert c_d.block_ids == (1, 2)
        assert np.all(dst.arr[:, [1, 2], :] == POISON)
        pw.send(Abort("from-network"))
        c = pw.next_completion(20)
        assert c is not None and c.kind is CompletionKind.FAILED, c

        # the same daemon on loopback: served (two daemons on one host keep working)
        c_d, c_p = transfer(pw, dw, f"127.0.0.1:{port_of(p)}", "from-loopback", [3, 4], [12, 13])
        assert c_d.kind is CompletionKind.FINISHED_RECEIVING, c_d
        assert c_p is not None and c_p.kind is CompletionKind.FINISHED_SENDING, c_p
        assert np.array_equal(dst.arr[:, [3, 4], :], src.arr[:, [12, 13], :])

        assert p.client.status().config["peer_api.insecure"] == "false"
        lines = log_lines(p)
        assert any(r.get("peer_access") == "loopback" and r.get("level") == "info" for r in lines), p.logs()[-2000:]
        assert any(r.get("event") == "peer call denied" for r in lines)
    finally:
        stop(p, d)


def test_insecure_admits_the_network_and_warns(workdir: Path, ip: str, kv_pair) -> None:  # type: ignore[no-untyped-def]
    src, dst = kv_pair
    p = start_p(workdir, "insecure = true\n")
    d = start_d(workdir)
    try:
        warned = [r for r in log_lines(p) if r.get("peer_access") == "insecure"]
        assert warned and warned[0]["level"] == "warning", p.logs()[-2000:]
        assert "insecure = true" in str(warned[0]["event"])
        pw, dw = attach_pair(p, d, src, dst)
        c_d, c_p = transfer(pw, dw, f"{ip}:{port_of(p)}", "open", [5, 6], [20, 21])
        assert c_d.kind is CompletionKind.FINISHED_RECEIVING, c_d
        assert c_p is not None and c_p.kind is CompletionKind.FINISHED_SENDING, c_p
        assert np.array_equal(dst.arr[:, [5, 6], :], src.arr[:, [20, 21], :])
    finally:
        stop(p, d)


def test_allowlist_replaces_the_loopback_rule(workdir: Path, ip: str, kv_pair) -> None:  # type: ignore[no-untyped-def]
    """allow = [the host's address]: that caller is served, and loopback (not listed) is not."""
    src, dst = kv_pair
    p = start_p(workdir, f'allow = ["{ip}/32"]\n')
    d = start_d(workdir)
    try:
        pw, dw = attach_pair(p, d, src, dst)
        c_d, c_p = transfer(pw, dw, f"{ip}:{port_of(p)}", "listed", [7], [30])
        assert c_d.kind is CompletionKind.FINISHED_RECEIVING, c_d
        assert c_p is not None and c_p.kind is CompletionKind.FINISHED_SENDING, c_p
        assert np.array_equal(dst.arr[:, [7], :], src.arr[:, [30], :])

        c_d, _ = transfer(pw, dw, f"127.0.0.1:{port_of(p)}", "loopback-unlisted", [8], [31])
        assert c_d is not None and c_d.kind is CompletionKind.FAILED and c_d.code == "PEER_REJECTED", c_d
        assert "not in peer_api.allow" in c_d.reason and "127.0.0.1" in c_d.reason, c_d.reason
        assert np.all(dst.arr[:, [8], :] == POISON)
        assert any(r.get("peer_access") == "allow" for r in log_lines(p))
    finally:
        stop(p, d)


# ---------------------------------------------------------------- rules and config, no daemon


def test_loopback_rule() -> None:
    a = AllowList(PeerApiConfig())
    assert a.loopback_only
    for ok in ("ipv4:127.0.0.1:5000", "ipv4:127.3.2.1:1", "ipv6:[::1]:5000", "ipv6:%5B::1%5D:5000",
               "ipv6:[::ffff:127.0.0.1]:1"):
        assert a.check(ok, {}) == "", ok
    for bad in ("ipv4:192.0.2.2:5000", "ipv6:[fd00::2]:1", "ipv6:[::ffff:10.0.0.1]:1", "unix:/tmp/x"):
        why = a.check(bad, {})
        assert "protected mode" in why and "insecure = true" in why and "allow_names" in why, (bad, why)
    # anything that opens the peer API lifts the loopback rule
    assert not AllowList(PeerApiConfig(allow=("10.0.0.0/8",))).loopback_only
    assert AllowList(PeerApiConfig(allow=("10.0.0.0/8",))).check("ipv4:10.1.1.1:1", {}) == ""


def test_access_modes_and_interceptors(tmp_path: Path) -> None:
    pem = tmp_path / "x.pem"
    pem.write_text("-----BEGIN CERTIFICATE-----\nx\n-----END CERTIFICATE-----\n")
    tls = {"tls_cert": str(pem), "tls_key": str(pem), "tls_ca": str(pem)}
    cases = [({}, "loopback", 1), ({"insecure": True}, "insecure", 0), ({"allow": ["10.0.0.0/8"]}, "allow", 1),
             (tls, "tls", 0), ({**tls, "allow_names": ["dnode"]}, "tls+allow_names", 1)]
    for peer_api, mode, n in cases:
        p = from_dict({"peer_api": peer_api}).peer_api
        assert access_mode(p) == mode, peer_api
        assert len(peer_interceptors(p)) == n, peer_api
        assert p.protected is (mode == "loopback")


def test_insecure_config() -> None:
    assert Config().peer_api.protected and not Config().peer_api.insecure
    assert from_dict({"peer_api": {"insecure": True}}).peer_api.insecure
    with pytest.raises(InvalidArgument, match="insecure must be a bool"):
        from_dict({"peer_api": {"insecure": "yes"}})
    with pytest.raises(InvalidArgument, match=r"peer_api\.allow is set .* remove insecure"):
        from_dict({"peer_api": {"insecure": True, "allow": ["10.0.0.0/8"]}})


def test_protected_daemon_advertises_loopback() -> None:
    """Only loopback callers are served, so a wildcard listen advertises 127.0.0.1; opened, the host's address."""
    assert Config().advertise_host == "127.0.0.1"
    assert from_dict({"peer_api": {"listen": "10.1.2.3:7700"}}).advertise_host == "10.1.2.3"
    opened = default_advertise_host()  # the first non-loopback IPv4 address, else 127.0.0.1
    assert from_dict({"peer_api": {"insecure": True}}).advertise_host == opened
    assert from_dict({"peer_api": {"allow": ["10.0.0.0/8"]}}).advertise_host == opened
    assert from_dict({"node": {"advertise_host": "h1"}}).advertise_host == "h1"
