"""The stream reader's completion conversion (it fills the frozen dataclasses through their slots):
the objects must be exactly the ones their __init__ makes."""

from __future__ import annotations

import pytest
from kvpushd_client import _convert
from kvpushd_client.proto.v1 import common_pb2, worker_pb2
from kvpushd_client.types import Completion, CompletionKind, TransferFigures


@pytest.mark.parametrize("kind", list(CompletionKind))
@pytest.mark.parametrize("code", [0, common_pb2.FAILURE_TIMEOUT, common_pb2.FAILURE_REFUSED, 9999])
def test_completion_equals_the_one_init_makes(kind: CompletionKind, code: int) -> None:
    msg = worker_pb2.Completion(kind=int(kind), transfer_id="t-1", code=code, reason="why", block_ids=[3, 1, 2],
                                bytes=4096, nixl_transfers=2, descriptors=7, post_seconds=0.5, transfer_seconds=0.25,
                                rendezvous_wait_seconds=0.125, elapsed_seconds=1.0)
    got = _convert.completion(worker_pb2.Completion.FromString(msg.SerializeToString()))
    name = {0: "", common_pb2.FAILURE_TIMEOUT: "TIMEOUT", common_pb2.FAILURE_REFUSED: "REFUSED",
            9999: "UNKNOWN_9999"}[code]  # a code from a newer daemon: named, not an error in the reader
    want = Completion(kind=kind, transfer_id="t-1", code=name, reason="why",
                      block_ids=(3, 1, 2), figures=TransferFigures(nbytes=4096, nixl_transfers=2, descriptors=7,
                                                                   post_s=0.5, transfer_s=0.25,
                                                                   rendezvous_wait_s=0.125, elapsed_s=1.0),
                      unanswered=False)
    assert got == want and hash(got) == hash(want) and repr(got) == repr(want)
    with pytest.raises(AttributeError):
        got.reason = "changed"  # type: ignore[misc]  # still frozen


def test_unknown_kind_raises_as_before() -> None:
    with pytest.raises(ValueError):
        _convert.completion(worker_pb2.Completion(kind=77, transfer_id="x"))
