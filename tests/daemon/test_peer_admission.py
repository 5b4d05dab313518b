"""Admission on the peer server: calls the event loop has not taken up yet wait in gRPC up to
peer_api.max_pending_calls per method (beyond it they are refused CANCELLED at once), and for at most
peer_api.max_pending_s (older ones are dropped CANCELLED when the loop takes up the next call).

gRPC's own default drops such calls from 1,000 on at random (and from 3,000 on always), which is what a
fleet of thousands of decode daemons handshaking at once ran into. The server here is the daemon's peer
server options on a Handshake handler; its event loop is held busy while the calls arrive, so every one
of them waits in gRPC's queue (no timing: the test waits until the refusals came back)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from typing import Any

import grpc
import pytest
from kvpushd_client.proto.v1 import peer_pb2, peer_pb2_grpc

from kvpushd.app import peer_server_options
from kvpushd.config import PeerApiConfig

BOUND, CALLS = 200, 260


class _Hello(peer_pb2_grpc.PeerServiceServicer):
    async def Handshake(self, request: peer_pb2.HandshakeRequest, context: Any) -> peer_pb2.HandshakeResponse:
        return peer_pb2.HandshakeResponse(node_id="prefill", instance_id=request.instance_id)


def _serve(loop: asyncio.AbstractEventLoop, ready: threading.Event, port: list[int], stop: asyncio.Event,
           max_pending_s: int) -> None:
    async def main() -> None:
        cfg = PeerApiConfig(max_pending_calls=BOUND, max_pending_s=max_pending_s, max_streams_per_connection=1024)
        server = grpc.aio.server(options=peer_server_options(cfg))
        peer_pb2_grpc.add_PeerServiceServicer_to_server(_Hello(), server)
        port.append(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        ready.set()
        await stop.wait()
        await server.stop(None)

    asyncio.set_event_loop(loop)
    loop.run_until_complete(main())


@pytest.mark.parametrize("max_pending_s", [30, 1])
def test_pending_calls_queue_up_to_the_bounds_then_are_refused(max_pending_s: int) -> None:
    assert ("grpc.server.max_pending_requests", BOUND) in peer_server_options(PeerApiConfig(max_pending_calls=BOUND))
    loop, ready, port, stop = asyncio.new_event_loop(), threading.Event(), [], asyncio.Event()
    server = threading.Thread(target=_serve, args=(loop, ready, port, stop, max_pending_s), daemon=True)
    server.start()
    assert ready.wait(30)
    busy, release = threading.Event(), threading.Event()

    def hold() -> None:  # the daemon's loop, busy admitting others: no call is taken up meanwhile
        busy.set()
        release.wait(120)

    loop.call_soon_threadsafe(hold)
    assert busy.wait(30)
    channel = grpc.insecure_channel(f"127.0.0.1:{port[0]}")
    stub = peer_pb2_grpc.PeerServiceStub(channel)
    codes: Counter[grpc.StatusCode] = Counter()
    refused = threading.Semaphore(0)
    lock = threading.Lock()

    def done(f: grpc.Future) -> None:
        code = f.code()
        with lock:
            codes[code] += 1
        if code is grpc.StatusCode.CANCELLED:
            refused.release()

    try:
        calls = [stub.Handshake.future(peer_pb2.HandshakeRequest(instance_id=str(i)), timeout=120,
                                       wait_for_ready=True) for i in range(CALLS)]
        for f in calls:
            f.add_done_callback(done)
        # the calls beyond the bound come back refused while the loop is still held: BOUND + 1 wait in the
        # queue (gRPC checks its length before adding one), and one more went to the call the aio server
        # had requested ahead
        for _ in range(CALLS - BOUND - 2):
            assert refused.acquire(timeout=120), codes
        if max_pending_s == 1:
            threading.Event().wait(2.0)  # every queued call is now older than max_pending_s
        release.set()
        for f in calls:
            f.exception(timeout=120)
    finally:
        release.set()
        channel.close()
        loop.call_soon_threadsafe(stop.set)
        server.join(30)
    if max_pending_s == 30:
        assert codes[grpc.StatusCode.OK] == BOUND + 2, codes  # every call within the bound was answered
    else:  # only the call the server had requested ahead: the queued ones were dropped unanswered
        assert codes[grpc.StatusCode.OK] == 1, codes
    assert codes[grpc.StatusCode.OK] + codes[grpc.StatusCode.CANCELLED] == CALLS, codes


def test_handshake_asks_only_whether_that_peer_is_busy() -> None:
    """A handshake asks the send side about the calling instance only (not the set of every decode
    daemon with registrations here, which made a storm of N handshakes cost O(N) each)."""
    from kvpushd import PROTOCOL_VERSION
    from kvpushd.core import notif
    from kvpushd.core.errors import PermissionDenied
    from kvpushd.runtime.inbound import Inbound

    asked: list[str] = []

    def busy(instance: str) -> bool:
        asked.append(instance)
        return instance == "held"

    from kvpushd.runtime.inbound import Hello

    inbound = Inbound(lambda name: None)

    def hs(address: str, instance: str, token: str, busy):  # type: ignore[no-untyped-def]
        return inbound.handshake(Hello(PROTOCOL_VERSION, notif.compat_hash(), "decode-1", address, instance, token,
                                       host="10.0.0.9"), busy)
    token, _ = hs("10.0.0.1:7700", "held", "", busy)
    assert asked == []  # a new instance: nothing to ask
    assert hs("10.0.0.1:7700", "held", token, busy)[0] == token  # its own token
    with pytest.raises(PermissionDenied):  # without it, while transfers are pending: refused
        hs("10.0.0.1:7700", "held", "", busy)
    hs("10.0.0.2:7700", "idle", "", busy)
    with pytest.raises(PermissionDenied):  # idle but live: a claim without its token is refused
        hs("10.0.0.2:7700", "idle", "", busy)
    inbound.origins["idle"].stream_ended = time.monotonic()  # its stream ended, nothing heard since
    assert hs("10.0.0.2:7700", "idle", "", busy)[0]  # ended and idle: anew
    assert asked == ["held", "idle", "idle"]


def test_a_daemon_that_lost_its_handshake_answer_takes_its_unused_session_back() -> None:
    """A decode daemon whose Handshake was answered after its deadline has no token for the session the
    prefill daemon made, and handshakes again as the same instance. It gets a session once that one has
    gone a Handshake deadline (peer_api.connect_timeout_s) without its stream ever opening, if the
    handshake is of the same identity; before that, from another identity, or for a session that
    opened its stream, a tokenless claim is still refused (a live session's own is not lost)."""
    from kvpushd import PROTOCOL_VERSION
    from kvpushd.core import notif
    from kvpushd.core.errors import PermissionDenied
    from kvpushd.runtime.inbound import Hello, Inbound

    inbound = Inbound(lambda name: None, quiet_s=3600.0, answer_s=5.0)

    def hs(instance: str, host: str = "10.0.0.9") -> str:
        token, _ = inbound.handshake(Hello(PROTOCOL_VERSION, notif.compat_hash(), "decode-1", "10.0.0.9:7700",
                                           instance, host=host), lambda i: False)
        return token

    lost = hs("lost")
    with pytest.raises(PermissionDenied):  # within the deadline its answer may still be on the way
        hs("lost")
    inbound.origins["lost"].last_seen -= 6.0  # a Handshake deadline passed, no stream opened
    with pytest.raises(PermissionDenied):  # another identity claiming it: refused
        hs("lost", host="10.0.0.66")
    again = hs("lost")  # the same identity: the unused session is its own, taken back
    assert again and again != lost and inbound.origins["lost"].token == again

    hs("used")
    inbound.channel_counts("used", streams=1)  # its daemon got the answer: its stream is open
    inbound.origins["used"].last_seen -= 6.0
    with pytest.raises(PermissionDenied):
        hs("used")
    inbound.channel_counts("used", batches=1)
    inbound.channel_counts("used", streams=-1)  # its stream ended after use: ended() decides, as before
    inbound.origins["used"].last_seen = inbound.origins["used"].stream_ended + 1.0  # heard from since
    with pytest.raises(PermissionDenied):
        hs("used")


def test_sessions_and_agents_counted_as_they_come_and_go() -> None:
    """The indexes that spare a handshake or a Register a scan of every session or agent: a restarted
    daemon (same address, new instance) replaces its old session once that one ended (a live one it
    does not: a claimed address proves nothing); counts follow drops."""
    from kvpushd import PROTOCOL_VERSION
    from kvpushd.core import notif
    from kvpushd.runtime.inbound import AgentTable, Hello, Inbound, Origin
    from kvpushd.transfer.descs import RegionSpec, RemoteAgent

    inbound = Inbound(lambda name: None)

    def hs(instance: str):  # type: ignore[no-untyped-def]
        return inbound.handshake(Hello(PROTOCOL_VERSION, notif.compat_hash(), "decode-1", "10.0.0.1:7700",
                                       instance, host="10.0.0.1"), lambda i: False)
    hs("first")
    _, replaced = hs("beside")
    assert replaced == []  # "first" is live: the claim of its address replaces nothing
    inbound.drop(inbound.origins["beside"])
    inbound.origins["first"].stream_ended = time.monotonic()
    _, replaced = hs("second")
    assert [o.instance_id for o in replaced] == ["first"]
    inbound.drop(replaced[0])
    inbound.origins["second"].stream_ended = time.monotonic()
    _, replaced = hs("third")
    assert [o.instance_id for o in replaced] == ["second"]

    forgotten: list[str] = []
    table = AgentTable("consumer", 4, forgotten.append)
    owner = Origin("abcdef0123456789", "decode-1", "10.0.0.1:7700")

    def agent(k: int) -> RemoteAgent:
        from kvpushd.runtime.identity import agent_prefix

        name = agent_prefix(owner.node_id, owner.instance_id) + f"w{k}"
        md = b"nixlSerDes|Agent" + len(name).to_bytes(8, "little") + name.encode()
        return RemoteAgent(name, md, "DRAM", (RegionSpec(1 << 30, 16, 4096, 4096, 0),))

    for k in range(6):  # past the cap of 4: the least recently used half goes
        table.admit(owner, agent(k), set)
    assert table.count(owner.instance_id) == len(table) <= 4 and len(forgotten) == 6 - len(table)
    table.drop_owner(owner.instance_id)
    assert table.count(owner.instance_id) == len(table) == 0 and len(forgotten) == 6
