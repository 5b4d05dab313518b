"""The core's enums are the wire's: same members, same values (the rpc layer converts by value)."""

from __future__ import annotations

import enum

import pytest
from kvpushd_client.proto.v1 import common_pb2, worker_pb2

from kvpushd.core import layout
from kvpushd.core.types import CompletionKind, FailureCode, Role, TransferMode


def wire(enum_desc: object, prefix: str) -> dict[str, int]:
    return {v.name.removeprefix(prefix): v.number for v in enum_desc.values}  # type: ignore[attr-defined]


@pytest.mark.parametrize("core, proto, prefix", [
    (FailureCode, common_pb2.FailureCode.DESCRIPTOR, "FAILURE_"),
    (Role, common_pb2.Role.DESCRIPTOR, "ROLE_"),
    (TransferMode, common_pb2.TransferMode.DESCRIPTOR, "TRANSFER_MODE_"),
    (CompletionKind, worker_pb2.Completion.Kind.DESCRIPTOR, "KIND_"),
])
def test_core_enum_matches_proto(core: type[enum.IntEnum], proto: object, prefix: str) -> None:
    got = {m.name: int(m) for m in core}
    want = wire(proto, prefix)
    want.pop("UNSPECIFIED", None) if "UNSPECIFIED" not in got else None
    assert got == want


def test_layout_values_match_proto() -> None:
    want = wire(common_pb2.KVLayout.DESCRIPTOR, "KV_LAYOUT_")
    assert (want["HND"], want["NHD"]) == (layout.HND, layout.NHD)
