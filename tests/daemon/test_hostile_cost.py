"""What a hostile caller costs the daemon it calls, each act on its own (the items of docs/security.md's
"What a broken or hostile caller costs"): while it acts, the daemon answers GetStatus within 100 ms,
its RSS stays within +150 MiB, and a transfer registered before the act and published after it lands
exact bytes. Real daemons, real NIXL. ``-s`` prints the figures."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import grpc
import pytest
from kvpushd_client import Role
from kvpushd_client.proto.v1 import common_pb2, peer_pb2, peer_pb2_grpc, worker_pb2, worker_pb2_grpc
from support import make_kv, wait_for
from support.bystander import Bystander
from support.peer import PeerSession

from kvpushd import PROTOCOL_VERSION
from kvpushd.core import notif
from kvpushd.memory import fdpass
from kvpushd.runtime.identity import agent_prefix

BIG = 1 << 18  # block ids in one Register: worker_api.max_blocks_per_request's default
QUOTA = 1 << 21  # peer_api.max_blocks_per_peer's default
SETTINGS = {"transfer": {"publish_timeout_s": 60.0, "expect_timeout_s": 60.0, "peer_timeout_s": 3.0}}


@pytest.fixture
def pair(daemon_factory, kv_pair):  # type: ignore[no-untyped-def]
    p, d = daemon_factory.pair(settings=SETTINGS)  # type: ignore[arg-type]
    src, dst = kv_pair
    pw = p.client.attach("prefill", Role.PRODUCER, 0, 1, [src.buf.memory], src.region_list)
    dw = d.client.attach("decode", Role.CONSUMER, 0, 1, [dst.buf.memory], dst.region_list)
    return p, d, pw, dw, src, dst


def _register(s: PeerSession, tid: str, reg: int, n: int) -> peer_pb2.PeerResult:
    """A registration of ``n`` destination blocks in a made-up decode agent (never loaded: no publish comes)."""
    name = agent_prefix("hostile", s.instance_id) + "decode-0"
    md = b"nixlSerDes|Agent" + len(name).to_bytes(8, "little") + name.encode()
    agent = peer_pb2.AgentInfo(agent_name=name, agent_metadata=md, memory_kind="DRAM", regions=[
        peer_pb2.RemoteRegion(base_addr=1 << 30, num_blocks=BIG, block_len=4096, block_stride=4096)])
    return s.call("register", peer_pb2.RegisterRequest(
        transfer_id=tid, registration_id=reg, producer_engine_id="prefill", producer_tp_size=1,
        consumer_engine_id="decode", consumer_tp_rank=0, consumer_tp_size=1, consumer_agent=agent,
        block_ids=range(n), transfer_mode=common_pb2.TRANSFER_MODE_PUSH))


def test_one_identity_filling_its_block_quota(pair) -> None:  # type: ignore[no-untyped-def]
    """Item 3: one host registers destination blocks up to peer_api.max_blocks_per_peer (2 Mi) over
    two sessions, in Registers of the most ids one may carry, then asks for more on both: refused, and
    released once its sessions end."""
    p, _d, pw, dw, src, dst = pair
    hello = (PROTOCOL_VERSION, notif.compat_hash())
    with Bystander(p, pw, dw, src, dst, target=p) as b:
        s1, s2 = (PeerSession(p.peer_address, *hello, node_id="hostile") for _ in range(2))
        for k in range(QUOTA // BIG):  # 8 Registers of the most block ids one may carry, 4 on each session
            s = (s1, s2)[k % 2]
            assert _register(s, f"q{k}", k + 1, BIG - 64 * (k == 7)).code == "OK"  # the transfer beside holds 1
        for s in (s1, s2):
            r = _register(s, f"over-{s.instance_id}", 99, BIG)
            assert r.code == "RESOURCE_EXHAUSTED" and "max_blocks_per_peer" in r.message, r
        (ident,) = p.client.status().peer_identities
        assert ident.blocks == QUOTA - 64 + 1 and ident.sessions == 3, ident  # d's session and the two
        s1.close()
        s2.close()
    print(b.line("block quota filled by one host (2 Mi blocks, 2 sessions)"))
    b.check()
    # unheard for peer_timeout_s (3 s here), the two sessions go and their blocks with them
    assert wait_for(lambda: p.client.status().peer_identities[0].blocks == 0, timeout=20)


def test_handshakes_claiming_the_decode_daemon(pair) -> None:  # type: ignore[no-untyped-def]
    """Item 4: 200 handshakes claim the decode daemon's address under new instance ids, 50 its instance id
    without its token: the claims get sessions of their own (the spare ones go) or PERMISSION_DENIED."""
    p, d, pw, dw, src, dst = pair
    stub = peer_pb2_grpc.PeerServiceStub(grpc.insecure_channel(p.peer_address))
    d_instance = d.client.status().instance_id

    def hello(instance: str) -> peer_pb2.HandshakeResponse:
        return stub.Handshake(peer_pb2.HandshakeRequest(  # type: ignore[no-any-return]
            protocol_version=PROTOCOL_VERSION, compat_hash=notif.compat_hash(), node_id="dnode",
            peer_address=d.peer_address, instance_id=instance), timeout=10)

    with Bystander(p, pw, dw, src, dst, target=p) as b:
        for _ in range(200):
            assert hello(uuid.uuid4().hex).session_token
        for _ in range(50):
            with pytest.raises(grpc.RpcError) as ei:
                hello(d_instance)
            assert ei.value.code() is grpc.StatusCode.PERMISSION_DENIED
        (ident,) = p.client.status().peer_identities
        assert ident.sessions <= 16, ident
    print(b.line("250 handshakes claiming the decode daemon"))
    b.check()


_FLOOD = """
import os, socket, sys
path, n, first = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
for i in range(first, first + n):
    fd = os.memfd_create("flood", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 4096)
    s.sendmsg([i.to_bytes(16, "little")], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fd.to_bytes(4, "little"))], 0, path)
    os.close(fd)
"""


def test_processes_flooding_the_fd_socket(pair) -> None:  # type: ignore[no-untyped-def]
    """Item 5: six processes send 1,024 memfds each to the prefill daemon's fd socket (more than the
    4,096 it parks): a worker attaching after them is refused RESOURCE_EXHAUSTED, the daemon goes on."""
    p, _d, pw, dw, src, dst = pair
    path = fdpass.fd_socket_path(p.sock)
    n = fdpass.MAX_PER_SENDER
    with Bystander(p, pw, dw, src, dst, target=p) as b:
        procs = [subprocess.Popen([sys.executable, "-c", _FLOOD, path, str(n), str(k * n)]) for k in range(6)]
        for proc in procs:
            assert proc.wait(timeout=120) == 0
        kv = make_kv("hostile-late", regions=1, num_blocks=16)
        try:
            assert wait_for(lambda: len(os.listdir(f"/proc/{p.pid}/fd")) > fdpass.MAX_PARKED, timeout=20)
            with pytest.raises(Exception, match=r"RESOURCE_EXHAUSTED|already holds"):
                p.client.attach("late", Role.PRODUCER, 0, 1, [kv.buf.memory], kv.region_list)
        finally:
            kv.close()
    print(b.line(f"6 processes x {n} memfds on the fd socket"))
    b.check()


def test_another_process_detaching_a_worker_by_its_id(pair) -> None:  # type: ignore[no-untyped-def]
    """Item 6: another process on the worker socket sends Detach for the prefill worker by its id (the
    status lists it) 100 times and opens its session: PERMISSION_DENIED each time; the worker goes on."""
    p, _d, pw, dw, src, dst = pair
    worker_id = pw.worker_id
    ch = grpc.insecure_channel(f"unix:{p.sock}")
    stub = worker_pb2_grpc.WorkerServiceStub(ch)
    with Bystander(p, pw, dw, src, dst, target=p) as b:
        for token in (b"", bytes(16)) * 50:
            with pytest.raises(grpc.RpcError) as ei:
                stub.Detach(worker_pb2.DetachRequest(worker_id=worker_id, worker_token=token), timeout=10)
            assert ei.value.code() is grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.RpcError) as ei:
            list(stub.Stream(iter([worker_pb2.CommandBatch(worker_id=worker_id)]), timeout=10))
        assert ei.value.code() is grpc.StatusCode.PERMISSION_DENIED
        assert any(w.worker_id == worker_id for w in p.client.status().workers)
    ch.close()
    print(b.line("100 Detach and a Stream for another worker's id"))
    b.check()
