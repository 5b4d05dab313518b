"""The daemon's gRPC services registered from their descriptors, with a stream's batch counted before
it is parsed.

A batch message (CommandBatch, PeerBatch) holds at most ``MAX_BATCH`` items, but its size limit
follows from the largest single item (one Expect of ``max_blocks_per_request`` block ids), so a
message of legal size can hold millions of empty items: parsed, they cost the event loop most of a
second and the daemon hundreds of MiB before any check could run. Its top-level fields are walked
here first, on the encoded bytes, and the walk stops at item ``MAX_BATCH + 1``: such a message is
never parsed, and its stream ends RESOURCE_EXHAUSTED (``Oversized``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import grpc
from google.protobuf.message import Message

MAX_BATCH = 4096  # items in one CommandBatch or PeerBatch
BATCHES = {"kvpushd.v1.CommandBatch": 2, "kvpushd.v1.PeerBatch": 1}  # message -> its items' field number


@dataclass(frozen=True, slots=True)
class Oversized:
    """What a batch message with more than ``MAX_BATCH`` items decodes to (it is never parsed)."""

    name: str
    nbytes: int

    def why(self) -> str:
        return f"a {self.name} of {self.nbytes} bytes holds more than {MAX_BATCH} items; at most {MAX_BATCH}"


def count_items(data: bytes, field: int, cap: int) -> int:
    """Top-level fields numbered ``field`` in an encoded message, counted up to ``cap + 1`` (the walk
    stops there). A malformed encoding stops the count where it breaks: the parser says why."""
    i, n, end = 0, 0, len(data)
    while i < end:
        tag, i = _varint(data, i)
        kind = tag & 7
        if kind == 2:
            length, i = _varint(data, i)
            i += length
        elif kind == 0:
            _, i = _varint(data, i)
        elif kind == 1:
            i += 8
        elif kind == 5:
            i += 4
        else:
            return n
        if tag >> 3 == field:
            n += 1
            if n > cap:
                return n
    return n


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    end = len(data)
    while i < end:
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7
        if shift > 63:
            break
    return value, end  # truncated or too long: the parser refuses it


def bounded(cls: type[Message]) -> Callable[[bytes], Message | Oversized]:
    """``cls.FromString``, for a batch message one that counts its items first."""
    field = BATCHES.get(cls.DESCRIPTOR.full_name)
    if field is None:
        return cls.FromString
    name = cls.DESCRIPTOR.name

    def parse(data: bytes) -> Message | Oversized:
        # an item takes 2 bytes at least (its tag and length): a shorter message cannot hold too many
        if len(data) > 2 * MAX_BATCH and count_items(data, field, MAX_BATCH) > MAX_BATCH:
            return Oversized(name, len(data))
        return cls.FromString(data)

    return parse


def add_service(server: Any, pb2: ModuleType, service: str, servicer: object) -> str:
    """Register ``servicer``'s methods of ``service`` (described in ``pb2``), as the generated
    ``add_*Servicer_to_server`` does, with batch messages decoded by ``bounded``; returns the
    service's full name (e.g. "kvpushd.v1.WorkerService")."""
    desc = pb2.DESCRIPTOR.services_by_name[service]
    handlers = {}
    for m in desc.methods:
        req, resp = getattr(pb2, m.input_type.name), getattr(pb2, m.output_type.name)
        make = {(False, False): grpc.unary_unary_rpc_method_handler,
                (False, True): grpc.unary_stream_rpc_method_handler,
                (True, False): grpc.stream_unary_rpc_method_handler,
                (True, True): grpc.stream_stream_rpc_method_handler}[(m.client_streaming, m.server_streaming)]
        handlers[m.name] = make(getattr(servicer, m.name), request_deserializer=bounded(req),
                                response_serializer=resp.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(desc.full_name, handlers),))
    server.add_registered_method_handlers(desc.full_name, handlers)
    return str(desc.full_name)
