"""A worker's stream that ends badly (half-closed, then cancelled; reset; the process gone) releases
what the worker held, and what it leaves behind stops neither another worker's Detach nor the
daemon's drain. Real daemons, real NIXL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from kvpushd_client import Attach, Expect, KVPushClient, Publish, Role, _convert
from kvpushd_client.handover import hand_over
from kvpushd_client.proto.v1 import worker_pb2
from support import make_kv, wait_for
from support.bystander import Bystander


def _raw_attach(client, kv, engine: str, role: Role = Role.PRODUCER) -> tuple[str, bytes]:  # type: ignore[no-untyped-def]
    """An Attach with no stream opened for it (the test opens and ends the stream itself): the worker's
    id and token."""
    tokens = hand_over(client.socket_path, [kv.buf.memory], 10)
    req = _convert.attach_request(Attach(engine, role, 0, 1, [kv.buf.memory], kv.region_list), tokens)
    ans = client.stub.Attach(req, timeout=10)
    return ans.worker_id, ans.worker_token


def _half_close_then_cancel(client, worker: tuple[str, bytes], hold_s: float) -> None:  # type: ignore[no-untyped-def]
    """The worker's stream sends its first batch, half-closes, and is cancelled ``hold_s`` later."""
    wid, token = worker
    call = client.stub.Stream(iter([worker_pb2.CommandBatch(worker_id=wid, worker_token=token)]), timeout=30)
    if hold_s:
        time.sleep(hold_s)
    call.cancel()


def test_a_stream_ended_badly_mid_write_wedges_nothing(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """A prefill worker publishes, its WRITE is held in flight (the decode daemon SIGSTOPped), and its
    stream half-closes and is then cancelled: once the WRITE settles the worker is released (the daemon
    lists no worker), another worker's Detach answers at once, a transfer after it moves exact bytes,
    and SIGTERM drains within drain_timeout_s. (Before: the cancelled detach stayed in the transfer
    thread's drain list and every later Detach hung.)"""
    p, d = daemon_factory.pair(settings={"transfer": {"drain_timeout_s": 5}})
    # 32 MiB in one WRITE: large enough that it waits on the stopped decode daemon
    src = make_kv("kvp-end-src", regions=4, num_blocks=16, block_len=1 << 20)
    dst = make_kv("kvp-end-dst", regions=4, num_blocks=16, block_len=1 << 20, fill="poison")
    try:
        dw = d.client.attach("decode", Role.CONSUMER, 0, 1, [dst.buf.memory], dst.region_list)
        wid, token = _raw_attach(p.client, src, "prefill")
        dw.send(Expect("held", tuple(range(8)), p.peer_address, "prefill", 1))
        assert wait_for(lambda: any(t.side == "send" for t in p.client.status().transfers))
        d.proc.send_signal(signal.SIGSTOP)
        try:
            publish = worker_pb2.Command(seq=1, publish=worker_pb2.PublishRequest(
                transfer_id="held", block_ids=list(range(8, 16))))
            first = worker_pb2.CommandBatch(worker_id=wid, worker_token=token, commands=[publish])
            call = p.client.stub.Stream(iter([first]), timeout=30)
            time.sleep(0.5)  # published, WRITE posted, the stream half-closed: its session is ending
            call.cancel()
            time.sleep(0.5)
        finally:
            d.proc.send_signal(signal.SIGCONT)
        assert wait_for(lambda: not p.client.status().workers, timeout=30), \
            [w.worker_id for w in p.client.status().workers]
        c = dw.next_completion(30)
        assert c is not None and c.transfer_id == "held"
        # another prefill worker attaches: a transfer moves exact bytes, and its Detach answers
        other = make_kv("kvp-end-other", regions=4, num_blocks=16, block_len=1 << 20)
        try:
            pw = p.client.attach("prefill", Role.PRODUCER, 0, 1, [other.buf.memory], other.region_list)
            dw.send(Expect("beside", (1, 2), p.peer_address, "prefill", 1))
            pw.send(Publish("beside", (5, 6)))
            assert dw.next_completion(30).kind.name == "FINISHED_RECEIVING"
            assert pw.next_completion(30).kind.name == "FINISHED_SENDING"
            assert (dst.arr[:, [1, 2]] == other.arr[:, [5, 6]]).all()
            t0 = time.monotonic()
            pw.detach()
            assert time.monotonic() - t0 < 5
            assert wait_for(lambda: not p.client.status().workers)
        finally:
            other.close()
        dw.detach()
        # SIGTERM drains within its bound (5 s here) and exits 0
        t0 = time.monotonic()
        p.proc.send_signal(signal.SIGTERM)
        assert p.proc.wait(timeout=30) == 0, p.logs()[-3000:]
        assert time.monotonic() - t0 < 5 + 3, p.logs()[-3000:]
    finally:
        src.close()
        dst.close()


def test_many_streams_ended_badly_are_released(daemon_factory, kv_pair) -> None:  # type: ignore[no-untyped-def]
    """Twenty workers whose streams half-close and are then cancelled at varying moments: each is
    released (one whose stream ended before its session opened, when worker_api.session_grace_s
    passed), and meanwhile the daemon answers its status and a transfer beside them is exact."""
    p, d = daemon_factory.pair(settings={"worker_api": {"session_grace_s": 2.0}})
    src, dst = kv_pair
    pw = p.client.attach("prefill", Role.PRODUCER, 0, 1, [src.buf.memory], src.region_list)
    dw = d.client.attach("decode", Role.CONSUMER, 0, 1, [dst.buf.memory], dst.region_list)
    kvs = [make_kv(f"kvp-end-{i}", regions=2, num_blocks=8) for i in range(20)]
    try:
        with Bystander(p, pw, dw, src, dst, target=p) as b:
            for i, kv in enumerate(kvs):
                _half_close_then_cancel(p.client, _raw_attach(p.client, kv, f"ended-{i}"), (i % 5) * 0.002)
            assert wait_for(lambda: [w.worker_id for w in p.client.status().workers] == [pw.worker_id],
                            timeout=20), [w.worker_id for w in p.client.status().workers]
        print(b.line("20 worker streams half-closed then cancelled"))
        b.check()
    finally:
        for kv in kvs:
            kv.close()


@pytest.mark.parametrize("how", ["reset", "killed"])
def test_a_worker_gone_mid_stream_is_released(daemon_factory, kv_pair, how: str) -> None:  # type: ignore[no-untyped-def]
    """The stream reset by its channel closing, or the worker process SIGKILLed with its stream open:
    the worker is released, and the next worker of the same rank attaches and moves bytes."""
    p, d = daemon_factory.pair()
    src, dst = kv_pair
    if how == "reset":
        c = KVPushClient(p.sock)
        wid, token = _raw_attach(c, src, "prefill")
        call = c.stub.Stream(iter([worker_pb2.CommandBatch(worker_id=wid, worker_token=token)]), timeout=30)
        time.sleep(0.5)  # the daemon holds the session
        c.close()
        del call
    else:
        code = (
            "import sys, time\n"
            "from kvpushd_client import KVPushClient, Role\n"
            "from support import make_kv\n"
            "kv = make_kv('kvp-killed', regions=2, num_blocks=8)\n"
            f"w = KVPushClient({p.sock!r}).attach('prefill', Role.PRODUCER, 0, 1, [kv.buf.memory],"
            " kv.region_list)\n"
            "print('attached', flush=True)\n"
            "time.sleep(60)\n"
        )
        path = os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": path})
        assert proc.stdout is not None and proc.stdout.readline().strip() == "attached"
        time.sleep(0.5)
        proc.kill()
        proc.wait()
    assert wait_for(lambda: not p.client.status().workers, timeout=20)
    pw = p.client.attach("prefill", Role.PRODUCER, 0, 1, [src.buf.memory], src.region_list)
    dw = d.client.attach("decode", Role.CONSUMER, 0, 1, [dst.buf.memory], dst.region_list)
    dw.send(Expect("after", (3,), p.peer_address, "prefill", 1))
    pw.send(Publish("after", (7,)))
    assert dw.next_completion(20).kind.name == "FINISHED_RECEIVING"
    assert (dst.arr[:, 3] == src.arr[:, 7]).all()
    pw.detach()
    dw.detach()


def test_a_second_detach_waits_for_the_release(daemon_factory, kv_pair) -> None:  # type: ignore[no-untyped-def]
    """A second Detach of a worker being released by its stream's end is answered, not held."""
    p, _ = daemon_factory.pair()
    src, _ = kv_pair
    wid, token = _raw_attach(p.client, src, "prefill")
    _half_close_then_cancel(p.client, (wid, token), 0)
    try:
        p.client.stub.Detach(worker_pb2.DetachRequest(worker_id=wid, worker_token=token), timeout=5)
    except grpc.RpcError as e:
        assert e.code() is grpc.StatusCode.NOT_FOUND, e
    assert wait_for(lambda: not p.client.status().workers, timeout=10)
