"""What a peer daemon's Channel items ask of us, one record each: rpc/convert.py makes it from the
protobuf once, the node checks it and hands on what the core needs (worker commands are the
client's records, kvpushd_client.types). Frozen msgspec Structs like those: one is built per item.
gc=False: they hold strings, numbers, enums, tuples and the peer's RemoteAgent, which refers to none
of them (no cycle)."""

from __future__ import annotations

import msgspec

from ..core.types import FailureCode, TransferMode
from ..transfer.descs import RemoteAgent


class Register(msgspec.Struct, frozen=True, gc=False):
    """A decode daemon's registration: one consumer rank's destination blocks for a transfer."""

    transfer_id: str
    registration_id: int
    producer_engine_id: str
    producer_tp_size: int
    consumer_engine_id: str
    consumer_rank: int
    consumer_tp_size: int
    agent: RemoteAgent  # the consumer's NIXL agent (its metadata only when we lack it)
    block_ids: tuple[int, ...]
    mode: TransferMode = TransferMode.PUSH
    skip_tokens: int = 0
    traceparent: str = ""


class Notice(msgspec.Struct, frozen=True, gc=False):
    """A Withdraw (decode daemon -> us) or a Fail (prefill daemon -> us) of one registration."""

    transfer_id: str
    registration_id: int
    code: FailureCode
    reason: str


class Offer(msgspec.Struct, frozen=True, gc=False):
    """Pull mode, to the decode daemon: a producer rank's source blocks, to READ."""

    transfer_id: str
    registration_id: int
    producer_rank: int
    agent: RemoteAgent
    block_ids: tuple[int, ...]


class ReadFailed(msgspec.Struct, frozen=True, gc=False):
    """Pull mode, to the prefill daemon: the READ of its offer failed."""

    registration_id: int
    producer_rank: int
    reason: str


class Declined(msgspec.Struct, frozen=True, gc=False):
    """A decode daemon will never register this transfer (its worker's Decline)."""

    transfer_id: str
    producer_engine_id: str
    consumer_engine_id: str
    reason: str
