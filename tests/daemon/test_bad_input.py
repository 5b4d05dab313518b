"""Bad input on every RPC gets a clear status code and message, and the daemon keeps serving."""

from __future__ import annotations

import functools
import threading

import grpc
import pytest
from kvpushd_client import Abort, CompletionKind, Expect, KVPushError, MemfdMemory, Publish, Region, Role, errors
from kvpushd_client.doorbell import Doorbell
from kvpushd_client.proto.v1 import common_pb2, worker_pb2
from support import attach_pair, make_kv, wait_for


def code_of(fn) -> tuple[str, str]:  # type: ignore[no-untyped-def]
    with pytest.raises(KVPushError) as ei:
        fn()
    return ei.value.code, ei.value.message


def attach_raw(c, handle: common_pb2.MemoryHandle) -> None:  # type: ignore[no-untyped-def]
    """An Attach of one memory handle as the wire has it (a kind this client library does not make)."""
    req = worker_pb2.AttachRequest(engine_id="e", role=common_pb2.ROLE_PRODUCER, tp_size=1, memory=[handle],
                                   regions=[common_pb2.Region(num_blocks=1, block_len=4096, block_stride=4096)])
    try:
        c.stub.Attach(req, timeout=10)
    except grpc.RpcError as e:
        raise errors.from_rpc_error(e) from None


def assert_still_serves(p, d, src, dst) -> None:  # type: ignore[no-untyped-def]
    pw, dw = attach_pair(p, d, src, dst) if not hasattr(src, "_w") else (src._w, dst._w)
    dw.send(Expect("health-check", (1, 2), p.peer_address, "prefill", 1))
    pw.send(Publish("health-check", (3, 4)))
    assert dw.next_completion(20).kind is CompletionKind.FINISHED_RECEIVING
    assert pw.next_completion(20).kind is CompletionKind.FINISHED_SENDING


def test_attach_errors(daemon_pair, kv_pair) -> None:  # type: ignore[no-untyped-def]
    p, d = daemon_pair
    src, dst = kv_pair
    c = p.client
    mem = [src.buf.memory]
    regs = src.region_list
    cases = [
        (lambda: c.attach("", Role.PRODUCER, 0, 1, mem, regs), "INVALID_ARGUMENT", "engine_id"),
        (lambda: c.attach("e", Role.PRODUCER, 2, 2, mem, regs), "INVALID_ARGUMENT", "tp_rank"),
        (lambda: c.attach("e", Role.PRODUCER, 0, 1, [], regs), "INVALID_ARGUMENT", "no memory"),
        (lambda: c.attach("e", Role.PRODUCER, 0, 1, mem, []), "INVALID_ARGUMENT", "regions"),
        (lambda: c.attach("e", Role.PRODUCER, 0, 1, mem, [Region(1, 0, 4, 4096)]), "INVALID_ARGUMENT",
         "memory_index"),
        (lambda: c.attach("e", Role.PRODUCER, 0, 1, mem, [Region(0, 0, 4, 4096, 1024)]), "INVALID_ARGUMENT",
         "block_stride"),
        # a region that does not fit its shared memory
        (lambda: c.attach("e", Role.PRODUCER, 0, 1, mem, [Region(0, src.buf.size - 4096, 2, 4096)]),
         "INVALID_ARGUMENT", "does not fit"),
        # declared size larger than the object
        (lambda: c.attach("e", Role.PRODUCER, 0, 1, [MemfdMemory(src.buf.fd, src.buf.size * 2)], regs),
         "INVALID_ARGUMENT", "holds"),
        # a /dev/shm name: refused (a worker could truncate it under a WRITE)
        (lambda: attach_raw(c, common_pb2.MemoryHandle(shm=common_pb2.ShmHandle(name="kvpushd-test-named",
                                                                                  size=4096))),
         "PERMISSION_DENIED", "by /dev/shm name"),
    ]
    for fn, code, words in cases:
        got, msg = code_of(fn)
        assert got == code, (got, msg)
        assert words in msg, msg
    assert list(c.status().workers) == []  # nothing half-attached is left behind
    # an unspecified role (raw protobuf, the client library cannot even express it)
    req = worker_pb2.AttachRequest(engine_id="e", role=common_pb2.ROLE_UNSPECIFIED, tp_size=1,
                                   memory=[common_pb2.MemoryHandle(cuda_ipc=common_pb2.CudaIpcHandle(gpu_uuid="g",
                                                                                                  size=4096))],
                                   regions=[common_pb2.Region(num_blocks=1, block_len=64, block_stride=64)])
    with pytest.raises(grpc.RpcError) as ei:
        c.stub.Attach(req, timeout=10)
    assert ei.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "role" in ei.value.details()
    # a memory handle with no kind set
    req = worker_pb2.AttachRequest(engine_id="e", role=common_pb2.ROLE_PRODUCER, tp_size=1,
                                   memory=[common_pb2.MemoryHandle()],
                                   regions=[common_pb2.Region(num_blocks=1, block_len=64, block_stride=64)])
    with pytest.raises(grpc.RpcError) as ei:
        c.stub.Attach(req, timeout=10)
    assert ei.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert_still_serves(p, d, src, dst)


def test_request_errors(daemon_pair, kv_pair) -> None:
    p, d = daemon_pair
    src, dst = kv_pair
    pw, dw = attach_pair(p, d, src, dst)
    pa = p.peer_address
    cases = [
        (lambda: dw.send(Expect("t", (src.num_blocks,), pa, "prefill", 1)), "INVALID_ARGUMENT", "out of range"),
        (lambda: pw.send(Publish("t", (10_000,))), "INVALID_ARGUMENT", "out of range"),
        (lambda: pw.send(Publish("t", ())), "INVALID_ARGUMENT", "empty"),
        (lambda: pw.send(Publish("", (1,))), "INVALID_ARGUMENT", "transfer_id"),
        (lambda: pw.send(Publish("t", (1, 1))), "INVALID_ARGUMENT", "duplicates"),
        (lambda: dw.send(Expect("t", (1,), "", "prefill", 1)), "INVALID_ARGUMENT", "producer_address"),
        (lambda: dw.send(Expect("t", (1,), pa, "prefill", 0)), "INVALID_ARGUMENT", "positive"),
        (lambda: pw.send(Expect("t", (1,), pa, "prefill", 1)), "FAILED_PRECONDITION", "cannot expect"),
        (lambda: dw.send(Publish("t", (1,))), "FAILED_PRECONDITION", "cannot publish"),
    ]
    for fn, code, words in cases:
        got, msg = code_of(fn)
        assert got == code, (got, msg)
        assert words in msg, msg
    # unknown worker ids, on the stream and on Detach
    first = worker_pb2.CommandBatch(worker_id="nope", commands=[worker_pb2.Command(
        seq=1, publish=worker_pb2.PublishRequest(transfer_id="t", block_ids=[1]))])
    with pytest.raises(grpc.RpcError) as ei:
        list(p.client.stub.Stream(iter([first]), timeout=10))
    assert ei.value.code() is grpc.StatusCode.NOT_FOUND
    # a second stream of an attached worker is refused (with its token: ALREADY_EXISTS; without it, as
    # any other process on the worker socket that read its id in the status: PERMISSION_DENIED); the
    # first goes on
    for token, code in ((pw.token, grpc.StatusCode.ALREADY_EXISTS), (b"", grpc.StatusCode.PERMISSION_DENIED),
                        (b"x" * 16, grpc.StatusCode.PERMISSION_DENIED)):
        raw = p.client.stub.Stream(iter([worker_pb2.CommandBatch(worker_id=pw.worker_id, worker_token=token)]),
                                   timeout=10)
        with pytest.raises(grpc.RpcError) as ei:
            list(raw)
        assert ei.value.code() is code and pw.alive, ei.value
    with pytest.raises(grpc.RpcError) as ei:
        p.client.stub.Detach(worker_pb2.DetachRequest(worker_id="nope"), timeout=10)
    assert ei.value.code() is grpc.StatusCode.NOT_FOUND
    # Detach by name alone, from another process's client: refused, the worker stays
    for token in (b"", b"x" * 16):
        with pytest.raises(grpc.RpcError) as ei:
            d.client.stub.Detach(worker_pb2.DetachRequest(worker_id=dw.worker_id, worker_token=token), timeout=10)
        assert ei.value.code() is grpc.StatusCode.PERMISSION_DENIED and "worker_token" in (ei.value.details() or "")
    assert dw.alive and [w.worker_id for w in d.client.status().workers] == [dw.worker_id]
    # a second attach of the same engine rank is refused while the first is attached
    got, msg = code_of(lambda: p.client.attach("prefill", Role.PRODUCER, 0, 1, [src.buf.memory], src.region_list))
    assert got == "ALREADY_EXISTS" and "already attached" in msg

    # a transfer id published twice with other blocks
    pw.send(Publish("twice", (1, 2)))
    pw.send(Publish("twice", (1, 2)))  # the same call again is idempotent
    got, msg = code_of(lambda: pw.send(Publish("twice", (3, 4))))
    assert got == "ALREADY_EXISTS" and "already published" in msg
    assert pw.send(Abort("twice")) is True
    c = pw.next_completion(10)
    assert c.kind is CompletionKind.FAILED and c.code == "ABORTED"

    # unknown producer engine: the decode request fails with the prefill daemon's reason
    dw.send(Expect("no-engine", (1,), pa, "no-such-engine", 1))
    c = dw.next_completion(20)
    assert c.kind is CompletionKind.FAILED and c.code == "PEER_REJECTED" and "no prefill engine" in c.reason
    assert c.block_ids == (1,)

    # unreachable producer daemon
    dw.send(Expect("nobody-home", (2,), "127.0.0.1:9", "prefill", 1))
    c = dw.next_completion(30)
    assert c.kind is CompletionKind.FAILED and c.code == "PEER_UNREACHABLE"

    # block lists of unequal length: decode wants more blocks than prefill published
    pw.send(Publish("short", (1, 2)))
    dw.send(Expect("short", (5, 6, 7), pa, "prefill", 1))
    cd, cp = dw.next_completion(20), pw.next_completion(20)
    for comp in (cd, cp):
        assert comp.kind is CompletionKind.FAILED and comp.code == "LAYOUT_MISMATCH", comp
        assert "unequal length" in comp.reason

    # and everything else still works, with nothing left pending
    dw.send(Expect("ok", (8, 9), pa, "prefill", 1))
    pw.send(Publish("ok", (10, 11)))
    assert dw.next_completion(20).kind is CompletionKind.FINISHED_RECEIVING
    assert pw.next_completion(20).kind is CompletionKind.FINISHED_SENDING
    assert wait_for(lambda: not p.client.status().transfers and not d.client.status().transfers)


def test_layout_mismatch_between_workers(daemon_pair) -> None:
    p, d = daemon_pair
    src = make_kv("kvpushd-test-src", regions=4, block_len=4096)
    dst = make_kv("kvpushd-test-dst", regions=4, block_len=2048, fill="poison")
    try:
        pw, dw = attach_pair(p, d, src, dst)
        dw.send(Expect("lm", (1,), p.peer_address, "prefill", 1))
        pw.send(Publish("lm", (2,)))
        cd, cp = dw.next_completion(20), pw.next_completion(20)
        assert cp.kind is CompletionKind.FAILED and "block_len" in cp.reason
        assert cd.kind is CompletionKind.FAILED and "block_len" in cd.reason
        assert (dst.arr == 0xA5).all()
    finally:
        src.close()
        dst.close()


def test_a_doorbell_page_rings_for_one_worker(daemon_pair, kv_pair) -> None:  # type: ignore[no-untyped-def]
    """Two workers on one page would read each other's progress (a prefill daemon writing layers not
    computed yet): an attach naming a page another live worker rings is refused, and the page is free
    again once it detaches."""
    p, d = daemon_pair
    src, dst = kv_pair
    for daemon, role, kv in ((p, Role.PRODUCER, src), (d, Role.CONSUMER, dst)):
        bell = Doorbell()
        attach = functools.partial(daemon.client.attach, "bell", role, tp_size=2, memory=[kv.buf.memory],
                                   regions=kv.region_list, doorbell=bell)
        try:
            first = attach(tp_rank=0)
            code, msg = code_of(lambda: attach(tp_rank=1))  # noqa: B023 (called here, in this turn)
            assert code == "FAILED_PRECONDITION", (code, msg)
            assert bell.name in msg and first.worker_id in msg
            first.detach()
            attach(tp_rank=1).detach()
        finally:
            bell.close()
    assert_still_serves(p, d, src, dst)


def test_concurrent_attaches_of_one_rank(daemon_pair, kv_pair) -> None:  # type: ignore[no-untyped-def]
    """Attaches of the same engine rank that overlap (each waits for its memory to be mapped and
    registered): one wins, the others get ALREADY_EXISTS."""
    p, _ = daemon_pair
    src, _ = kv_pair
    results: list[object] = []

    def attach() -> None:
        try:
            results.append(p.client.attach("twice", Role.PRODUCER, 0, 1, [src.buf.memory], src.region_list))
        except KVPushError as e:
            results.append(e.code)

    for _ in range(3):
        results.clear()
        threads = [threading.Thread(target=attach) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        won = [r for r in results if not isinstance(r, str)]
        assert len(won) == 1 and sorted(r for r in results if isinstance(r, str)) == ["ALREADY_EXISTS"] * 3, results
        won[0].detach()  # type: ignore[attr-defined]
