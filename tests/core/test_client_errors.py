"""kvpushd_client.errors.from_rpc_error: a failed call's status and ``kvpushd-error`` trailing
metadata -> the typed error (a pure function, tested with hand-made RpcErrors)."""

from __future__ import annotations

import json
from typing import Any

import grpc
import pytest
from kvpushd_client import DaemonUnavailable, KVPushError, types
from kvpushd_client import errors as E


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode | None, details: str = "", metadata: Any = ()) -> None:
        self._code, self._details, self._metadata = code, details, metadata

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> Any:
        return self._metadata


def meta(**fields: Any) -> tuple[tuple[str, str], ...]:
    return (("other-key", "x"), (E.METADATA_KEY, json.dumps(fields)))


@pytest.mark.parametrize(("status", "cls", "kind"), [
    (grpc.StatusCode.INVALID_ARGUMENT, E.InvalidArgument, "InvalidArgument"),
    (grpc.StatusCode.NOT_FOUND, E.NotFound, "NotFound"),
    (grpc.StatusCode.ALREADY_EXISTS, E.AlreadyExists, "AlreadyExists"),
    (grpc.StatusCode.FAILED_PRECONDITION, E.FailedPrecondition, "FailedPrecondition"),
    (grpc.StatusCode.PERMISSION_DENIED, E.PermissionDenied, "PermissionDenied"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, E.ResourceExhausted, "ResourceExhausted"),
    (grpc.StatusCode.UNAVAILABLE, DaemonUnavailable, "Unavailable"),
    (grpc.StatusCode.CANCELLED, DaemonUnavailable, "Unavailable"),
    (grpc.StatusCode.INTERNAL, KVPushError, ""),
    (grpc.StatusCode.DEADLINE_EXCEEDED, KVPushError, ""),
])
def test_without_metadata_the_status_code_decides(status: grpc.StatusCode, cls: type[KVPushError],
                                                  kind: str) -> None:
    """Older daemons send no metadata: the class and kind follow the status code."""
    err = E.from_rpc_error(FakeRpcError(status, "why"))
    assert type(err) is cls
    assert (err.code, err.message, err.kind, err.transfer_id, err.peer) == (status.name, "why", kind, "", "")
    assert str(err) == f"{status.name}: why"


def test_metadata_names_kind_transfer_and_peer() -> None:
    err = E.from_rpc_error(FakeRpcError(grpc.StatusCode.ALREADY_EXISTS, "in use",
                                        meta(kind="AlreadyExists", code="ALREADY_EXISTS", transfer_id="t-1",
                                             peer="10.0.0.2:7700")))
    assert isinstance(err, E.AlreadyExists) and isinstance(err, KVPushError)
    assert (err.code, err.kind, err.transfer_id, err.peer) == ("ALREADY_EXISTS", "AlreadyExists", "t-1",
                                                               "10.0.0.2:7700")


def test_kind_wins_over_status_and_unknown_kind_falls_back() -> None:
    err = E.from_rpc_error(FakeRpcError(grpc.StatusCode.UNKNOWN, "x", meta(kind="FailedPrecondition")))
    assert type(err) is E.FailedPrecondition and err.code == "UNKNOWN"
    err = E.from_rpc_error(FakeRpcError(grpc.StatusCode.NOT_FOUND, "x", meta(kind="SomethingNew", peer="")))
    assert type(err) is E.NotFound and err.kind == "SomethingNew"
    # UNAVAILABLE from the daemon itself (draining, a peer it cannot reach) is no unreachable daemon
    err = E.from_rpc_error(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "draining", meta(kind="Unavailable")))
    assert type(err) is E.Unavailable and not isinstance(err, DaemonUnavailable) and err.kind == "Unavailable"
    err = E.from_rpc_error(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "peer down", meta(kind="PeerUnreachable",
                                                                                     peer="10.0.0.9:7700")))
    assert type(err) is E.PeerUnreachable and isinstance(err, E.Unavailable) and err.peer == "10.0.0.9:7700"
    assert not isinstance(err, DaemonUnavailable)
    err = E.from_rpc_error(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "x", meta(kind="SomethingNew")))
    assert type(err) is E.Unavailable
    # the daemon's subclasses of FailedPrecondition stay FailedPrecondition for older callers
    err = E.from_rpc_error(FakeRpcError(grpc.StatusCode.FAILED_PRECONDITION, "x", meta(kind="SessionUnknown")))
    assert type(err) is E.SessionUnknown and isinstance(err, E.FailedPrecondition)


@pytest.mark.parametrize("metadata", [
    None,
    ((E.METADATA_KEY, "not json"),),
    ((E.METADATA_KEY, "[1, 2]"),),
    ((E.METADATA_KEY, json.dumps({"kind": "NotFound", "transfer_id": None}).encode()),),
])
def test_missing_or_odd_metadata(metadata: Any) -> None:
    err = E.from_rpc_error(FakeRpcError(grpc.StatusCode.NOT_FOUND, "gone", metadata))
    assert type(err) is E.NotFound and err.code == "NOT_FOUND" and err.transfer_id == ""


def test_metadatum_objects_and_missing_status() -> None:
    class Metadatum:
        def __init__(self, key: str, value: str) -> None:
            self.key, self.value = key, value

    err = E.from_rpc_error(FakeRpcError(None, "", [Metadatum(E.METADATA_KEY, json.dumps(
        {"kind": "InvalidArgument", "code": "INVALID_ARGUMENT", "transfer_id": "t"}))]))
    assert type(err) is E.InvalidArgument and err.code == "INVALID_ARGUMENT" and err.transfer_id == "t"
    err = E.from_rpc_error(FakeRpcError(None))
    assert type(err) is KVPushError and err.code == "UNKNOWN"


def test_old_names_still_work() -> None:
    assert types.KVPushError is KVPushError and types.DaemonUnavailable is DaemonUnavailable
    err = KVPushError("NOT_FOUND", "m")
    assert (err.code, err.message, err.kind, err.transfer_id, err.peer) == ("NOT_FOUND", "m", "", "", "")


def _tree(root: type[Exception]) -> dict[str, str]:
    """Every subclass of ``root`` by name -> its parent's name ("" for root's children)."""
    out: dict[str, str] = {}
    todo = [root]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            out[sub.__name__] = "" if cls is root else cls.__name__
            todo.append(sub)
    return out


def test_one_list_of_kinds_serves_daemon_and_client() -> None:
    """kvpushd_client.errors.KINDS names every kind: the daemon's classes and the client's are those kinds,
    with the same parents, and the status each is sent as is the one the daemon's rpc layer uses."""
    from kvpushd.core import errors as D
    from kvpushd.rpc.errors import code_for

    daemon = _tree(D.KvpushdError)
    client = _tree(KVPushError)
    assert set(daemon) == set(E.KINDS)
    assert client.pop("DaemonUnavailable") == "Unavailable"  # the client's own: no daemon answered
    assert client == daemon
    for kind, status in E.KINDS.items():
        cls = getattr(D, kind)
        exc = cls.__new__(cls)  # code_for and status look at the class only
        code = code_for(exc)
        assert (code.name if code else "", exc.status) == (status, status), kind
        if status:  # what the client makes of that status alone, when no kind comes with it
            assert issubclass(getattr(E, kind), E._BY_STATUS[status]), kind
