"""One definition of each enum, with the wire's members and values: the daemon's core uses the client
library's (the rpc layer converts by value), and the client's shared types load without grpc."""

from __future__ import annotations

import enum
import json
import subprocess
import sys

import pytest
from kvpushd_client import types as client
from kvpushd_client.proto.v1 import common_pb2, worker_pb2

from kvpushd.core import layout
from kvpushd.core import types as core


def wire(enum_desc: object, prefix: str) -> dict[str, int]:
    return {v.name.removeprefix(prefix): v.number for v in enum_desc.values}  # type: ignore[attr-defined]


@pytest.mark.parametrize("shared, proto, prefix", [
    (client.FailureCode, common_pb2.FailureCode.DESCRIPTOR, "FAILURE_"),
    (client.Role, common_pb2.Role.DESCRIPTOR, "ROLE_"),
    (client.TransferMode, common_pb2.TransferMode.DESCRIPTOR, "TRANSFER_MODE_"),
    (client.CompletionKind, worker_pb2.Completion.Kind.DESCRIPTOR, "KIND_"),
    (client.KVLayout, common_pb2.KVLayout.DESCRIPTOR, "KV_LAYOUT_"),
])
def test_shared_enum_matches_proto(shared: type[enum.IntEnum], proto: object, prefix: str) -> None:
    got = {m.name: int(m) for m in shared}
    want = wire(proto, prefix)
    if "UNSPECIFIED" not in got:  # 0 is "not said" on the wire; these never carry it
        want.pop("UNSPECIFIED", None)
    assert got == want


def test_core_uses_the_shared_definitions() -> None:
    assert (core.FailureCode, core.Role, core.TransferMode, core.CompletionKind, core.Figures) == (
        client.FailureCode, client.Role, client.TransferMode, client.CompletionKind, client.TransferFigures)


def test_layout_values_match_proto() -> None:
    want = wire(common_pb2.KVLayout.DESCRIPTOR, "KV_LAYOUT_")
    assert (want["HND"], want["NHD"]) == (layout.HND, layout.NHD) == (client.KVLayout.HND, client.KVLayout.NHD)


CHECK = """
import json, pkgutil, sys, importlib
import kvpushd.core
for m in pkgutil.iter_modules(kvpushd.core.__path__):
    importlib.import_module("kvpushd.core." + m.name)
import kvpushd_client.errors, kvpushd_client.types
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules} & {"grpc", "asyncio", "nixl", "torch"})))
"""


def test_the_core_and_the_shared_types_import_no_grpc_asyncio_nixl_or_torch() -> None:
    r = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.splitlines()[-1]) == []
