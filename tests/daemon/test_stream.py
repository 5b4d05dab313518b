"""WorkerService.Stream: one stream per worker session carrying batches of commands up and their
results plus the worker's completions down. Real daemons, real NIXL; every byte checked."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import grpc
import pytest
from kvpushd_client import CompletionKind, KVPushError, Role
from kvpushd_client.proto.v1 import worker_pb2, worker_pb2_grpc
from kvpushd_client.types import Abort, Expect, Publish
from support import wait_for


def _stream_pair(p, d, src, dst):  # type: ignore[no-untyped-def]
    pw = p.client.attach("prefill", Role.PRODUCER, 0, 1, [src.buf.memory], src.region_list)
    dw = d.client.attach("decode", Role.CONSUMER, 0, 1, [dst.buf.memory], dst.region_list)
    return pw, dw


def test_batched_steps_move_exact_bytes(daemon_pair, kv_pair) -> None:  # type: ignore[no-untyped-def]
    """Eight requests per engine step, one message per step on each side."""
    p, d = daemon_pair
    src, dst = kv_pair
    pw, dw = _stream_pair(p, d, src, dst)
    for i in range(8):
        dw.send_nowait(Expect(f"r{i}", (2 * i, 2 * i + 1), p.peer_address, "prefill", 1))
    assert dw.step() == 8
    assert dw.flush(20)
    assert wait_for(lambda: sum(t.side == "send" for t in p.client.status().transfers) == 8)
    for i in range(8):
        pw.send_nowait(Publish(f"r{i}", (40 + 2 * i, 41 + 2 * i)))
    assert pw.step() == 8
    got_d: list = []
    got_p: list = []
    while len(got_d) < 8:
        c = dw.next_completion(30)
        assert c is not None
        got_d.append(c)
    while len(got_p) < 8:
        c = pw.next_completion(30)
        assert c is not None
        got_p.append(c)
    assert {c.kind for c in got_d} == {CompletionKind.FINISHED_RECEIVING}
    assert {c.kind for c in got_p} == {CompletionKind.FINISHED_SENDING}
    for i in range(8):
        assert (dst.arr[:, [2 * i, 2 * i + 1]] == src.arr[:, [40 + 2 * i, 41 + 2 * i]]).all()
    pw.detach()
    dw.detach()
    assert wait_for(lambda: not p.client.status().workers and not d.client.status().workers)


def test_ordering_within_a_batch_and_one_bad_item_fails_alone(daemon_pair, kv_pair) -> None:  # type: ignore[no-untyped-def]
    p, d = daemon_pair
    src, dst = kv_pair
    pw, dw = _stream_pair(p, d, src, dst)
    # in order: expect then abort of the same transfer in one batch (the abort finds it); a bad
    # expect (block out of range) between two good ones fails alone
    dw.send_nowait(Expect("a", (1,), p.peer_address, "prefill", 1))
    dw.send_nowait(Abort("a"))
    dw.send_nowait(Expect("bad", (10_000,), p.peer_address, "prefill", 1))
    dw.send_nowait(Expect("good", (2,), p.peer_address, "prefill", 1))
    dw.step()
    assert dw.flush(20)
    seen = {}
    while len(seen) < 2:
        c = dw.next_completion(20)
        assert c is not None
        seen[c.transfer_id] = c
    assert seen["a"].kind is CompletionKind.FAILED and seen["a"].code == "ABORTED", seen["a"]
    assert seen["bad"].kind is CompletionKind.FAILED and seen["bad"].code == "REFUSED", seen["bad"]
    assert "INVALID_ARGUMENT" in seen["bad"].reason and seen["bad"].block_ids == (10_000,)
    assert not seen["bad"].unanswered  # the daemon answered: it refused the command
    pw.send_nowait(Publish("good", (9,)))
    pw.step()
    c = dw.next_completion(20)
    assert c is not None and (c.transfer_id, c.kind) == ("good", CompletionKind.FINISHED_RECEIVING), c
    assert (dst.arr[:, 2] == src.arr[:, 9]).all()
    # the blocking forms raise the typed error
    with pytest.raises(KVPushError) as ei:
        dw.send(Expect("bad2", (10_000,), p.peer_address, "prefill", 1))
    assert ei.value.kind == "InvalidArgument" and ei.value.code == "INVALID_ARGUMENT"
    assert dw.send(Abort("nothing-here")) is False


def test_first_batch_must_name_an_attached_worker(daemon_pair) -> None:  # type: ignore[no-untyped-def]
    p, _ = daemon_pair
    stub = worker_pb2_grpc.WorkerServiceStub(grpc.insecure_channel(f"unix:{p.sock}"))
    call = stub.Stream(iter([worker_pb2.CommandBatch(worker_id="nobody")]), timeout=10)
    with pytest.raises(grpc.RpcError) as ei:
        list(call)
    assert ei.value.code() is grpc.StatusCode.NOT_FOUND
    assert p.client.status().node_id == "pnode"


_DYING = """
import json, os, signal, sys
from kvpushd_client import Expect, KVPushClient, MemfdMemory, Region, Role
a = json.loads(sys.argv[1])
c = KVPushClient(a["sock"])
w = c.attach("decode", Role.CONSUMER, 0, 1, [MemfdMemory(a["fd"], a["size"])],
                    [Region(0, i * a["nb"] * a["bl"], a["nb"], a["bl"]) for i in range(a["regions"])])
for i in range(16):
    w.send_nowait(Expect(f"d{i}", (i,), a["peer"], "prefill", 1))
w.step()
w.flush(20)
os.kill(os.getpid(), signal.SIGKILL)  # mid-batch for the daemon: registrations pending, no goodbye
"""


def test_a_worker_that_dies_mid_batch_is_released(daemon_pair, kv_pair) -> None:  # type: ignore[no-untyped-def]
    p, d = daemon_pair
    src, dst = kv_pair
    p.client.attach("prefill", Role.PRODUCER, 0, 1, [src.buf.memory], src.region_list)
    args = {"sock": d.sock, "fd": dst.buf.fd, "size": dst.buf.size, "nb": dst.num_blocks, "bl": dst.block_len,
            "regions": dst.regions, "peer": p.peer_address}
    proc = subprocess.run([sys.executable, "-c", _DYING, json.dumps(args)], timeout=60, pass_fds=[dst.buf.fd])
    assert proc.returncode == -9
    # the decode daemon detaches it and withdraws its 16 registrations; the prefill daemon lets go
    assert wait_for(lambda: not [w for w in d.client.status().workers if w.engine_id == "decode"], 30)
    assert wait_for(lambda: not d.client.status().transfers and not p.client.status().transfers, 30)


def test_register_items_of_a_peer_batch_fail_alone(daemon_pair, kv_pair) -> None:  # type: ignore[no-untyped-def]
    """Registrations in one PeerBatch: good ones are accepted, a bad one (blocks out of range) is
    answered with its own status, the rest go on; without the session token the stream is refused."""
    from kvpushd_client.proto.v1 import peer_pb2
    from test_closed import _rogue_agent
    from test_peer_trust import session

    p, _ = daemon_pair
    src, _ = kv_pair
    p.client.attach("prefill", Role.PRODUCER, 0, 1, [src.buf.memory], src.region_list)
    me = session(p.peer_address, "rogue")
    name, md = _rogue_agent(me.instance_id)

    def reg(tid: str, rid: int, blocks: list[int], with_md: bool = False) -> tuple[str, peer_pb2.RegisterRequest]:
        return "register", peer_pb2.RegisterRequest(
            transfer_id=tid, registration_id=rid, producer_engine_id="prefill",
            producer_tp_size=1, consumer_engine_id="x", consumer_tp_rank=0, consumer_tp_size=1,
            consumer_agent=peer_pb2.AgentInfo(agent_name=name, agent_metadata=md if with_md else b"",
                                              memory_kind="DRAM", regions=[peer_pb2.RemoteRegion(
                                                  base_addr=1 << 20, num_blocks=64, block_len=4096,
                                                  block_stride=4096)] * 4),
            block_ids=blocks)

    batch = [reg("b1", 1, [1], with_md=True), reg("b2", 2, [99]), reg("b4", 4, [4])]
    results = me.batch(batch)
    assert [r.code for r in results] == ["OK", "INVALID_ARGUMENT", "OK"], results
    assert not results[0].need_metadata and not results[2].need_metadata
    assert results[1].kind == "InvalidArgument" and "out of range" in results[1].message
    assert sorted(t.transfer_id for t in p.client.status().transfers) == ["b1", "b4"]
    # without the session token the whole stream is refused
    with pytest.raises(grpc.RpcError) as ei:
        me.batch(batch, metadata=(("kvpushd-instance", me.instance_id),))
    assert ei.value.code() is grpc.StatusCode.FAILED_PRECONDITION


def test_commands_a_dead_stream_never_answered_end_refused_and_unanswered(daemon_factory, kv_pair) -> None:  # type: ignore[no-untyped-def]
    """The daemon is gone: what was sent and not answered, and what is sent after, ends REFUSED with
    ``unanswered`` set (the vLLM connector declines those: the daemon may never have seen them)."""
    _, dst = kv_pair
    d = daemon_factory("dnode")
    dw = d.client.attach("decode", Role.CONSUMER, 0, 1, [dst.buf.memory], dst.region_list)
    dw.send_nowait(Expect("sent", (1,), "127.0.0.1:1", "prefill", 1))
    dw.step()
    assert dw.flush(20)  # answered (OK): it waits for its WRITE
    d.proc.kill()
    d.proc.wait(30)
    assert wait_for(lambda: dw.session_error is not None, 30)
    dw.send_nowait(Expect("after", (2,), "127.0.0.1:1", "prefill", 1))
    dw.step()
    got = {}
    while len(got) < 1:
        c = dw.next_completion(10)
        assert c is not None, got
        got[c.transfer_id] = c
    c = got["after"]
    assert (c.kind, c.code, c.unanswered, c.block_ids) == (CompletionKind.FAILED, "REFUSED", True, (2,)), c


def test_a_burst_of_completions_larger_than_a_message_reaches_the_worker(workdir) -> None:  # type: ignore[no-untyped-def]
    """1,500 receives of 1,024 blocks fail in the same moment (their prefill daemon does not exist):
    ~4.6 MB of completions, more than one gRPC message may carry to a client that keeps gRPC's 4 MiB
    default. Each reaches the worker once, and the stream stays up."""
    from support import make_kv, start_daemon

    d = start_daemon(workdir, "dnode", "connect_timeout_s = 2.0\n")
    dst = make_kv("kvpushd-test-burst", regions=1, num_blocks=101_024, block_len=16, fill="poison")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    try:
        dw = d.client.attach("decode", Role.CONSUMER, 0, 1, [dst.buf.memory], dst.region_list)
        blocks = list(range(100_000, 101_024))  # 3-byte ids: ~3 KB per completion
        for i in range(1500):
            dw.send_nowait(Expect(f"b{i}", tuple(blocks), dead, "prefill", 1))
        assert dw.step() == 1500
        got = set()
        while len(got) < 1500:
            c = dw.next_completion(60)
            assert c is not None, len(got)
            assert (c.kind, c.code) == (CompletionKind.FAILED, "PEER_UNREACHABLE"), c
            assert c.transfer_id not in got
            got.add(c.transfer_id)
        assert dw.alive
        dw.send_nowait(Expect("after", (1,), dead, "prefill", 1))  # the same stream still carries commands
        dw.step()
        c = dw.next_completion(30)
        assert c is not None and c.transfer_id == "after"
    finally:
        d.client.close()
        d.stop()
        dst.close()


def test_a_step_of_more_commands_than_one_batch_holds_goes_as_several(daemon_pair, kv_pair) -> None:  # type: ignore[no-untyped-def]
    """5,000 commands in one engine step (the daemon refuses a CommandBatch of more than 4,096 unparsed):
    the client sends them as two batches, every one answered, the session intact."""
    p, d = daemon_pair
    src, dst = kv_pair
    pw, dw = _stream_pair(p, d, src, dst)
    for i in range(5000):
        dw.send_nowait(Abort(f"none-{i}"))
    assert dw.step() == 5000
    assert dw.flush(60) and dw.alive
    dw.send(Expect("after", (1,), p.peer_address, "prefill", 1))
    pw.send(Publish("after", (2,)))
    assert dw.next_completion(30).kind is CompletionKind.FINISHED_RECEIVING
    pw.detach()
    dw.detach()
