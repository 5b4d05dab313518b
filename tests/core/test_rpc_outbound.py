"""The messages the daemon's outbound peer client sends are built in rpc/outbound.py (no network)."""

from __future__ import annotations

from kvpushd.core.actions import SendRegister
from kvpushd.core.types import FailureCode, Role, TransferMode
from kvpushd.rpc import outbound as pb
from kvpushd.runtime.workers import Worker
from kvpushd.transfer.descs import RegionSpec

W = Worker("w1", "decode", Role.CONSUMER, 1, 2, 0, "agent-1", "DRAM", [],
           (RegionSpec(0x1000, 64, 4096, 4096, 0, block_tokens=16, num_heads=8),), "", 0.0, 64, metadata=b"md")
REG = SendRegister("p:1", 7, "w1", "tid", "prefill", 1, 1, 2, (3, 4), TransferMode.PULL, skip_tokens=16)


def test_register_carries_the_agent_metadata_only_when_asked() -> None:
    first = pb.register(REG, W, with_metadata=True, traceparent="00-tp")
    assert (first.transfer_id, first.registration_id, list(first.block_ids)) == ("tid", 7, [3, 4])
    assert first.skip_tokens == 16
    assert (first.consumer_engine_id, first.consumer_tp_rank, first.consumer_tp_size) == ("decode", 1, 2)
    assert first.transfer_mode == int(TransferMode.PULL) and first.traceparent == "00-tp"
    assert first.consumer_agent.agent_metadata == b"md" and len(first.consumer_agent.regions) == 1
    assert first.consumer_agent.regions[0].block_size_tokens == 16
    later = pb.register(REG, W, with_metadata=False)
    assert later.consumer_agent.agent_name == "agent-1" and not later.consumer_agent.agent_metadata
    assert not later.consumer_agent.regions


def test_items_and_notices() -> None:
    it = pb.item(5, "fail", pb.notice("tid", 7, FailureCode.TIMEOUT, "x" * 5000))
    assert it.seq == 5 and it.WhichOneof("item") == "fail"
    assert it.fail.code == int(FailureCode.TIMEOUT) and len(it.fail.reason) == 2000
    assert [i.seq for i in pb.batch([it, pb.item(6, "heartbeat", pb.heartbeat())]).items] == [5, 6]
