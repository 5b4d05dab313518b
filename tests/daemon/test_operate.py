"""Operating a daemon: health and reflection for generic gRPC tools, kvpushctl, Watch, /metrics.

One daemon pair serves every test here but the SIGTERM one (starting daemons is most of the cost);
each test attaches its own workers and detaches them at its end, and compares counters before and
after rather than absolute values.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pool, message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from kvpushd_client import Abort, CompletionKind, Expect, Publish
from prometheus_client.parser import text_string_to_metric_families
from support import DaemonFactory, DaemonProc, attach_pair, scrape, start_daemon, value, wait_for

from kvpushd import config
from kvpushd.core.errors import InvalidArgument
from kvpushd.core.ledger import Ledger
from kvpushd.core.types import FailureCode
from kvpushd.events import EventHub, EventKind
from kvpushd.metrics import Metrics
from kvpushd.runtime.node import Node

CONFIG = ('[transfer]\npublish_timeout_s = 20.0\nexpect_timeout_s = 20.0\n'
          '[metrics]\nlisten = "127.0.0.1:0"\n')
BLOCK_BYTES = 4 * 4096  # kv_pair: 4 regions of 4 KiB blocks


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[DaemonProc, DaemonProc]]:
    with tempfile.TemporaryDirectory(prefix="kvpushd-op-") as tmp:
        factory = DaemonFactory(Path(tmp))
        try:
            p, d = factory.pair(CONFIG)
            yield p, d
            factory.close(check=(p, d))  # both exit 0
        finally:
            factory.close()


def ctl(sock: str, *args: str) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([sys.executable, "-m", "kvpushd.ctl", "--socket", sock, *args], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r


def ctl_json(sock: str, *args: str) -> Any:
    return json.loads(ctl(sock, *args, "--json").stdout)


def transfer(pw: Any, dw: Any, p: DaemonProc, tid: str, src: list[int], dst: list[int]) -> None:
    dw.send(Expect(tid, tuple(dst), p.peer_address, "prefill", 1))
    pw.send(Publish(tid, tuple(src)))
    c = dw.next_completion(20)
    assert c is not None and c.kind is CompletionKind.FINISHED_RECEIVING and c.transfer_id == tid
    s = pw.next_completion(20)
    assert s is not None and s.kind is CompletionKind.FINISHED_SENDING and s.transfer_id == tid


# -- health and reflection, as a tool that has no kvpushd stubs sees them -------------------------


def test_health_and_reflection_for_generic_clients(workdir: Path) -> None:
    solo = start_daemon(workdir, "solo", CONFIG)
    try:
        st = solo.client.status()
        assert st.metrics_address.startswith("127.0.0.1:") and not st.metrics_address.endswith(":0")
        local = grpc.insecure_channel(f"unix:{solo.sock}")
        peer = grpc.insecure_channel(solo.peer_address)
        health = health_pb2_grpc.HealthStub(local)
        peer_health = health_pb2_grpc.HealthStub(peer)
        serving = health_pb2.HealthCheckResponse.SERVING
        for stub, service in ((health, ""), (health, "kvpushd.v1.WorkerService"),
                              (health, "kvpushd.v1.StatusService"), (peer_health, ""),
                              (peer_health, "kvpushd.v1.PeerService")):
            assert stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status == serving
        with pytest.raises(grpc.RpcError) as e:
            health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
        assert e.value.code() is grpc.StatusCode.NOT_FOUND

        # Reflection: the service list, then a call built only from descriptors the server sent.
        refl = reflection_pb2_grpc.ServerReflectionStub(local)
        (resp,) = list(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                 timeout=10))
        names = {s.name for s in resp.list_services_response.service}
        assert {"kvpushd.v1.WorkerService", "kvpushd.v1.StatusService", "grpc.health.v1.Health",
                "grpc.reflection.v1alpha.ServerReflection"} <= names
        pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(local))
        method = pool.FindServiceByName("kvpushd.v1.StatusService").FindMethodByName("GetStatus")
        req_cls = message_factory.GetMessageClass(method.input_type)
        resp_cls = message_factory.GetMessageClass(method.output_type)
        get_status = local.unary_unary("/kvpushd.v1.StatusService/GetStatus",
                                       request_serializer=req_cls.SerializeToString,
                                       response_deserializer=resp_cls.FromString)
        generic = get_status(req_cls(), timeout=10)
        assert generic.node_id == "solo" and generic.metrics_address == st.metrics_address

        # SIGTERM: the local socket says NOT_SERVING while it drains (or is gone), so does the peer port.
        watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=60)
        assert next(watch).status == serving
        solo.proc.send_signal(signal.SIGTERM)
        seen = []
        try:
            for r in watch:
                seen.append(r.status)
                if r.status != serving:
                    break
        except grpc.RpcError as err:
            assert err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), err
        assert not seen or seen[-1] == health_pb2.HealthCheckResponse.NOT_SERVING, seen

        def peer_not_serving() -> bool:
            try:
                r = peer_health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            except grpc.RpcError as err:
                return err.code() is grpc.StatusCode.UNAVAILABLE
            return r.status == health_pb2.HealthCheckResponse.NOT_SERVING

        assert wait_for(peer_not_serving)
        assert solo.proc.wait(60) == 0
        local.close()
        peer.close()
    finally:
        solo.client.close()
        solo.stop()


# -- kvpushctl --json while a transfer is pending -------------------------------------------------


def test_kvpushctl_json_during_a_transfer(pair: tuple[DaemonProc, DaemonProc], kv_pair: Any) -> None:
    p, d = pair
    src, dst = kv_pair
    pw, dw = attach_pair(p, d, src, dst)
    try:
        transfer(pw, dw, p, "op-done", [1, 2], [3, 4])
        dw.send(Expect("op-pending", (5, 6, 7), p.peer_address, "prefill", 1))  # no publish: stays pending
        assert wait_for(lambda: any(t.transfer_id == "op-pending" for t in p.client.status().transfers))

        st = ctl_json(d.sock, "status")
        assert st["node_id"] == "dnode" and not st["draining"]
        assert st["metrics_address"].startswith("127.0.0.1:")
        assert st["config"]["transfer.expect_timeout_s"] == "20.0"
        assert st["config"]["metrics.listen"] == "127.0.0.1:0"
        (w,) = st["workers"]
        assert w["engine_id"] == "decode" and w["pending_transfers"] == 1
        assert w["regions"] == [{"first_index": 0, "count": 4, "num_blocks": 64, "block_len": "4096",
                                 "block_stride": "4096", "device_id": 0, "bytes": str(4 * 64 * 4096)}]

        tr = ctl_json(d.sock, "transfers")
        (t,) = tr["transfers"]
        assert (t["transfer_id"], t["side"], t["engine_id"], t["peer"], t["num_blocks"]) == (
            "op-pending", "recv", "decode", p.peer_address, 3)
        assert t["waiting_for"] and t["age_s"] >= 0
        tp = ctl_json(p.sock, "transfers")
        (t,) = tp["transfers"]
        assert (t["transfer_id"], t["side"], t["engine_id"]) == ("op-pending", "send", "prefill")
        assert t["waiting_for"] == "prefill publish"

        dp = ctl_json(d.sock, "peers")["peers"]
        (to_p,) = [x for x in dp if x["address"] == p.peer_address]
        assert to_p["node_id"] == "pnode" and to_p["direction"] in ("outbound", "both")
        assert to_p["state"] == "connected" and to_p["last_contact_unix"] > 0
        assert int(to_p["bytes_received"]) >= 2 * BLOCK_BYTES and int(to_p["transfers_finished"]) >= 1
        pp = ctl_json(p.sock, "peers")["peers"]
        (to_d,) = [x for x in pp if x["address"] == d.peer_address]
        assert to_d["node_id"] == "dnode" and to_d["direction"] in ("inbound", "both")
        assert int(to_d["bytes_sent"]) >= 2 * BLOCK_BYTES and to_d["last_contact_unix"] > 0

        assert dw.send(Abort("op-pending"))
        c = dw.next_completion(20)
        assert c is not None and c.kind is CompletionKind.FAILED and c.transfer_id == "op-pending"
        tr = ctl_json(d.sock, "transfers")
        assert tr["transfers"] == []
        assert any(f["transfer_id"] == "op-pending" and f["reason"].startswith("ABORTED")
                   for f in tr["recent_failures"])

        # The same, for a person.
        assert p.peer_address in ctl(d.sock, "peers").stdout
        assert "op-pending" in ctl(d.sock, "transfers").stdout  # now under recent failures
        assert "workers:" in ctl(d.sock, "status").stdout
    finally:
        pw.detach()
        dw.detach()


# -- kvpushctl watch --------------------------------------------------------------------------------


def test_watch_sees_attach_and_transfer_events(pair: tuple[DaemonProc, DaemonProc], kv_pair: Any) -> None:
    p, d = pair
    src, dst = kv_pair
    cmd = [sys.executable, "-m", "kvpushd.ctl", "--socket", d.sock, "watch", "--json", "--count", "3",
           "--timeout", "120", "--kind", "worker_attached", "--kind", "transfer_started",
           "--kind", "transfer_finished"]
    watcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_for(lambda: d.client.status().watchers >= 1 or watcher.poll() is not None, timeout=60)
        pw, dw = attach_pair(p, d, src, dst)
        try:
            transfer(pw, dw, p, "op-watched", [8, 9, 10, 11], [20, 21, 22, 23])
            out, err = watcher.communicate(timeout=60)
        finally:
            pw.detach()
            dw.detach()
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait()
    assert watcher.returncode == 0, err
    events = [json.loads(line) for line in out.splitlines()]
    assert [e["kind"] for e in events] == ["EVENT_WORKER_ATTACHED", "EVENT_TRANSFER_STARTED",
                                           "EVENT_TRANSFER_FINISHED"]
    attached, started, finished = events
    assert attached["engine_id"] == "decode" and attached["worker_id"] == dw.worker_id
    for e in (started, finished):
        assert (e["transfer_id"], e["engine_id"], e["side"], e["peer"]) == (
            "op-watched", "decode", "recv", p.peer_address)
    assert finished["bytes"] == str(4 * BLOCK_BYTES) and finished["num_blocks"] == 4
    assert int(started["seq"]) < int(finished["seq"]) and finished["dropped"] == "0"


# -- /metrics ---------------------------------------------------------------------------------------


def test_metrics_over_http(pair: tuple[DaemonProc, DaemonProc], kv_pair: Any) -> None:
    p, d = pair
    src, dst = kv_pair
    p0, d0 = scrape(p), scrape(d)
    pw, dw = attach_pair(p, d, src, dst)
    try:
        n = 3
        for i in range(n):  # runs of 4 adjacent blocks: one descriptor per region after merging
            transfer(pw, dw, p, f"op-metrics-{i}", list(range(4 * i, 4 * i + 4)), list(range(32 + 4 * i, 36 + 4 * i)))
        dw.send(Expect("op-metrics-pending", (60, 61), p.peer_address, "prefill", 1))
        assert wait_for(lambda: value(scrape(p), "kvpushd_pending_transfers", side="send") == 1)
        m = scrape(d)
        assert value(m, "kvpushd_pending_transfers", side="recv") == 1
        assert value(m, "kvpushd_held_blocks", side="recv") == 2
        pw.send(Publish("op-metrics-pending", (50, 51)))
        assert dw.next_completion(20).kind is CompletionKind.FINISHED_RECEIVING
        assert pw.next_completion(20).kind is CompletionKind.FINISHED_SENDING
        dw.send(Expect("op-metrics-aborted", (62,), p.peer_address, "prefill", 1))
        assert dw.send(Abort("op-metrics-aborted"))
        assert dw.next_completion(20).kind is CompletionKind.FAILED

        def settled(x: DaemonProc) -> bool:
            m = scrape(x)
            return all(value(m, name, side=side) == 0 for name in ("kvpushd_pending_transfers", "kvpushd_held_blocks")
                       for side in ("send", "recv"))

        assert wait_for(lambda: settled(p) and settled(d))
        p1, d1 = scrape(p), scrape(d)
    finally:
        pw.detach()
        dw.detach()

    def delta(before: dict[Any, float], after: dict[Any, float], name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    moved = (n * 4 + 2) * BLOCK_BYTES
    assert delta(p0, p1, "kvpushd_bytes_total", direction="sent", peer=d.peer_address) == moved
    assert delta(d0, d1, "kvpushd_bytes_total", direction="received", peer=p.peer_address) == moved
    assert delta(p0, p1, "kvpushd_transfers_total", side="send", outcome="finished", code="NONE") == n + 1
    assert delta(d0, d1, "kvpushd_transfers_total", side="recv", outcome="finished", code="NONE") == n + 1
    assert delta(d0, d1, "kvpushd_transfers_total", side="recv", outcome="failed", code="ABORTED") == 1
    assert delta(p0, p1, "kvpushd_writes_total", outcome="ok") == n + 1
    requested = delta(p0, p1, "kvpushd_descriptors_total", stage="requested")
    posted = delta(p0, p1, "kvpushd_descriptors_total", stage="posted")
    assert requested == (n * 4 + 2) * 4 and posted == (n + 1) * 4  # 4 regions, one run per transfer
    for hist in ("kvpushd_rendezvous_wait_seconds", "kvpushd_write_post_seconds", "kvpushd_write_seconds"):
        assert delta(p0, p1, hist + "_count") == n + 1, hist
    assert delta(d0, d1, "kvpushd_transfer_duration_seconds_count", side="recv") == n + 2
    assert delta(d0, d1, "kvpushd_notifications_total") == n + 1
    assert value(p1, "kvpushd_info", version="0.1.0", node_id="pnode", instance_id=p.client.status().instance_id) == 1


def test_startup_objects_are_frozen_and_process_metrics_are_exported(pair: tuple[DaemonProc, DaemonProc]) -> None:
    """A full garbage collection walks every tracked object with the loop stopped: the daemon freezes
    what start-up made (nixl, torch, gRPC: ~180k objects; a full collection of them took 205 ms in
    ``kvpushd bench rate``), and says so; the usual process and GC series are there too."""
    for d in pair:
        m = scrape(d)
        assert value(m, "kvpushd_gc_frozen_objects") > 50_000
        assert value(m, "process_cpu_seconds_total") > 0
        assert value(m, "process_open_fds") > 0
        assert ("python_gc_collections_total", frozenset({("generation", "2")})) in m


# -- the event hub on its own -----------------------------------------------------------------------


async def test_slow_subscriber_loses_oldest_events_and_never_blocks() -> None:
    hub = EventHub()
    slow = hub.subscribe(queue_size=2)
    only_failed = hub.subscribe([EventKind.TRANSFER_FAILED])
    books = [Ledger("recv", "w1", "e", f"t{i}", 3, 10.0) for i in range(5)]
    for led in books:
        hub.transfer(EventKind.TRANSFER_STARTED, led)
    assert slow.dropped == 3 and hub.dropped == 3
    got = [await slow.get() for _ in range(2)]
    assert [e.transfer_id for e in got if e] == ["t3", "t4"]
    books[0].done = 12.5
    hub.transfer(EventKind.TRANSFER_FAILED, books[0], FailureCode.TIMEOUT, "late")
    end = await only_failed.get()
    assert end is not None and (end.transfer_id, end.side, end.engine_id, end.num_blocks, end.duration_s) == (
        "t0", "recv", "e", 3, 2.5)
    hub.close()  # the daemon stops: every stream ends, after what is still queued
    rest = []
    while (e := await asyncio.wait_for(slow.get(), 1)) is not None:
        rest.append(e)
    assert len(rest) == 1 and await asyncio.wait_for(only_failed.get(), 1) is None
    assert hub.subscribers == 0


# -- the [metrics] section --------------------------------------------------------------------------


@pytest.mark.parametrize("data, words", [
    ({"metrics": {"listen": "9400"}}, "host:port"),
    ({"metrics": {"enabled": "yes"}}, "metrics.enabled must be a bool"),
    ({"metrics": {"port": 9400}}, "unknown key metrics.port"),
])
def test_bad_metrics_config(data: dict[str, Any], words: str) -> None:
    with pytest.raises(InvalidArgument, match=words):
        config.from_dict(data)


def test_metrics_endpoint_disabled_or_port_taken_leaves_the_daemon_running() -> None:
    off = config.from_dict({"metrics": {"enabled": False}})
    m = Metrics(Node(off).view)
    m.serve(off.metrics)
    assert m.address == ""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        cfg = config.from_dict({"metrics": {"listen": f"127.0.0.1:{taken.getsockname()[1]}"}})
        m = Metrics(Node(cfg).view)
        m.serve(cfg.metrics)
        assert m.address == ""
    cfg = config.from_dict({"metrics": {"listen": "127.0.0.1:0"}})
    m = Metrics(Node(cfg).view)
    m.serve(cfg.metrics)
    try:
        with urllib.request.urlopen(f"http://{m.address}/metrics", timeout=10) as r:
            names = {f.name for f in text_string_to_metric_families(r.read().decode())}
        assert {"kvpushd_pending_transfers", "kvpushd_held_blocks", "kvpushd_transfers", "kvpushd_bytes",
                "kvpushd_rendezvous_wait_seconds", "kvpushd_descriptors"} <= names
    finally:
        m.stop()
