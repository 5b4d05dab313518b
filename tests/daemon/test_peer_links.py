"""Connection discipline between real daemons: one connection per peer daemon shared by every worker
on the node, pre-connect to configured peers, handshakes bounded per daemon, idle peers closed."""

from __future__ import annotations

import re
import socket

from kvpushd_client import CompletionKind, Expect, Publish, Role
from support import POISON, make_kv, start_daemon, wait_for

LONG = ('[transfer]\nexpect_timeout_s = 60.0\npublish_timeout_s = 60.0\n[metrics]\nlisten = "127.0.0.1:0"\n')


def _gauge(metrics: str, name: str, label: str) -> float:
    m = re.search(rf'^{name}\{{[a-z]+="{label}"\}} ([0-9.e+]+)$', metrics, re.M)
    assert m is not None, f"{name}{{{label}}} not in /metrics"
    return float(m.group(1))


def test_every_worker_on_a_node_shares_one_connection_to_a_peer(workdir) -> None:  # type: ignore[no-untyped-def]
    """Two decode engines (a worker each) on one node receive from one prefill daemon: it sees one
    peer with one handshake and one Channel stream, and the bytes are exact."""
    p = start_daemon(workdir, "pnode", LONG)
    d = start_daemon(workdir, "dnode", LONG)
    kvs = [make_kv(f"kvpushd-test-sh{i}", fill="random" if i == 0 else "poison", seed=i) for i in range(3)]
    try:
        pw = p.client.attach("prefill", Role.PRODUCER, 0, 1, [kvs[0].buf.memory], kvs[0].region_list)
        dws = [d.client.attach(f"decode-{r}", Role.CONSUMER, 0, 1, [kvs[1 + r].buf.memory], kvs[1 + r].region_list)
               for r in range(2)]
        for i in range(4):
            for r, dw in enumerate(dws):
                dw.send(Expect(f"s{i}-{r}", (i,), p.peer_address, "prefill", 1))
                pw.send(Publish(f"s{i}-{r}", (10 + i,)))
        for w, n in [(dws[0], 4), (dws[1], 4), (pw, 8)]:
            kinds = [w.next_completion(30) for _ in range(n)]
            assert all(c is not None and c.kind in (CompletionKind.FINISHED_RECEIVING,
                                                    CompletionKind.FINISHED_SENDING) for c in kinds), kinds
        for r in range(2):
            assert (kvs[1 + r].arr[:, :4] == kvs[0].arr[:, 10:14]).all()
            assert (kvs[1 + r].arr[:, 4:] == POISON).all()
        (inbound,) = [x for x in p.client.status().peers if x.direction == "inbound"]
        assert inbound.inbound_streams == 1 and inbound.node_id == "dnode", inbound
        (outbound,) = [x for x in d.client.status().peers if x.address == p.peer_address]
        assert outbound.streams_opened == 1 and outbound.state == "connected", outbound
        assert p.logs().count('"peer handshake"') == 1, "one handshake for both workers"
        assert _gauge(d.metrics(), "kvpushd_peers_connected", "outbound") == 1
        assert _gauge(p.metrics(), "kvpushd_peers_connected", "inbound") == 1
    finally:
        for x in (d, p):
            x.client.close()
            x.stop()
        for kv in kvs:
            kv.close()


def test_preconnect_and_idle_close(workdir) -> None:  # type: ignore[no-untyped-def]
    """A decode daemon pre-connects to its configured prefill daemon before any transfer (handshake
    and stream), keeps that one open past idle_close_s, and closes a peer it only used once."""
    p = start_daemon(workdir, "pnode", LONG)
    q = start_daemon(workdir, "qnode", LONG)
    d = start_daemon(workdir, "dnode", f'preconnect = ["{p.peer_address}"]\nidle_close_s = 1.0\n' + LONG)
    src, dst = make_kv("kvpushd-test-pcs"), make_kv("kvpushd-test-pcd", fill="poison")
    try:
        assert wait_for(lambda: any(x.inbound_streams == 1 for x in p.client.status().peers), 30), \
            p.client.status().peers
        assert "peer pre-connected" in d.logs()
        qw = q.client.attach("prefill", Role.PRODUCER, 0, 1, [src.buf.memory], src.region_list)
        dw = d.client.attach("decode", Role.CONSUMER, 0, 1, [dst.buf.memory], dst.region_list)
        dw.send(Expect("once", (1,), q.peer_address, "prefill", 1))
        qw.send(Publish("once", (2,)))
        assert dw.next_completion(30).kind is CompletionKind.FINISHED_RECEIVING
        assert qw.next_completion(30).kind is CompletionKind.FINISHED_SENDING

        def outbound() -> set[str]:
            return {x.address for x in d.client.status().peers if x.direction in ("outbound", "both")}

        assert q.peer_address in outbound()
        assert wait_for(lambda: outbound() == {p.peer_address}, 15), outbound()  # q closed, p kept
        assert _gauge(d.metrics(), "kvpushd_peers_connected", "outbound") == 1
    finally:
        for x in (d, q, p):
            x.client.close()
            x.stop()
        src.close()
        dst.close()


def test_handshakes_are_bounded_per_daemon(workdir) -> None:  # type: ignore[no-untyped-def]
    """Pre-connect to 4 peers that accept TCP and never answer: with max_concurrent_handshakes = 2,
    two handshakes are in flight and two wait their turn; the daemon serves meanwhile."""
    silent = []
    for _ in range(4):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen(8)  # connections complete in the kernel's backlog; nothing ever answers
        silent.append(s)
    addrs = ", ".join(f'"127.0.0.1:{s.getsockname()[1]}"' for s in silent)
    d = start_daemon(workdir, "dnode", f"preconnect = [{addrs}]\nmax_concurrent_handshakes = 2\n"
                     "connect_timeout_s = 30.0\n" + LONG)
    try:
        def gauges() -> tuple[float, float]:
            m = d.metrics()
            return (_gauge(m, "kvpushd_peer_handshakes", "in_flight"), _gauge(m, "kvpushd_peer_handshakes", "waiting"))

        assert wait_for(lambda: gauges() == (2, 2), 20), gauges()
        assert d.client.status().node_id == "dnode"
    finally:
        d.client.close()
        assert d.stop() == 0
        for s in silent:
            s.close()
