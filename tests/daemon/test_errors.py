"""One converter each way: a daemon's refusal carries its kind, code and transfer id as trailing
metadata (``kvpushd-error``), the client turns it back into a typed error; an unexpected exception
is INTERNAL with a logged traceback, never UNKNOWN."""

from __future__ import annotations

import json

import grpc
import pytest
from kvpushd_client import Expect, KVPushError
from kvpushd_client.proto.v1 import worker_pb2, worker_pb2_grpc
from support import attach_pair

from kvpushd.core import errors as E
from kvpushd.rpc.errors import CODES, code_for


def test_every_error_kind_has_a_status_code() -> None:
    kinds = [c for c in vars(E).values() if isinstance(c, type) and issubclass(c, E.KvpushdError)]
    unmapped = {c.__name__ for c in kinds if c is not E.IllegalTransition and code_for(c("x")) is None}
    # the root and PeerRejected (a remote's answer, only ever raised client-side) have none: INTERNAL
    assert unmapped == {"KvpushdError", "PeerRejected"}
    assert code_for(E.SessionUnknown("x")) is grpc.StatusCode.FAILED_PRECONDITION
    assert code_for(E.IllegalTransition("s", "e")) is grpc.StatusCode.FAILED_PRECONDITION
    assert code_for(E.PeerUnreachable("x")) is grpc.StatusCode.UNAVAILABLE
    assert set(CODES.values()) >= {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED}


def test_a_refusal_carries_its_kind_and_transfer(daemon_pair, kv_pair) -> None:  # type: ignore[no-untyped-def]
    p, d = daemon_pair
    src, dst = kv_pair
    _, dw = attach_pair(p, d, src, dst)
    stub = worker_pb2_grpc.WorkerServiceStub(grpc.insecure_channel(f"unix:{d.sock}"))
    with pytest.raises(grpc.RpcError) as ei:  # a call: its status and trailing metadata
        stub.Detach(worker_pb2.DetachRequest(worker_id="nobody"), timeout=10)
    e = ei.value
    assert e.code() is grpc.StatusCode.NOT_FOUND
    meta = dict(e.trailing_metadata() or ())
    reason = json.loads(meta["kvpushd-error"])
    assert reason == {"kind": "NotFound", "code": "NOT_FOUND", "transfer_id": "", "peer": ""}
    # a command on the stream: its result carries code and kind, the client adds its transfer id
    with pytest.raises(KVPushError) as ki:
        dw.send(Expect("bad-blocks", (10_000,), p.peer_address, "prefill", 1))
    assert ki.value.kind == "InvalidArgument" and ki.value.transfer_id == "bad-blocks"
