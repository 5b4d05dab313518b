"""Errors of daemon calls: one root (``KVPushError``), a subclass per kind of refusal, one converter.

A daemon attaches trailing metadata ``kvpushd-error`` to a refused call: a JSON object
``{"kind": "InvalidArgument", "code": "INVALID_ARGUMENT", "transfer_id": "...", "peer": "..."}``
(any field may be empty or missing; older daemons send none). ``from_rpc_error`` turns a
``grpc.RpcError`` (sync or aio) into the matching subclass, using the kind when the daemon named one
(the daemon's own error classes, kvpushd/core/errors.py) and the gRPC status code otherwise.
Pure: no I/O, no grpc import at run time.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import grpc

METADATA_KEY = "kvpushd-error"

# Every kind of refusal a daemon names, with the gRPC status it is sent as: the one list of kinds. The
# daemon's error classes (kvpushd/core/errors.py) and the client's below are named after them, with
# the same parents (tests/core/test_client_errors.py checks both trees and the daemon's status table
# against it). A kind that shares its parent's status refines it; PeerRejected travels only inside a
# peer's result ("": never a status of its own).
KINDS: dict[str, str] = {
    "InvalidArgument": "INVALID_ARGUMENT", "NotFound": "NOT_FOUND", "AlreadyExists": "ALREADY_EXISTS",
    "FailedPrecondition": "FAILED_PRECONDITION", "SessionUnknown": "FAILED_PRECONDITION",
    "IllegalTransition": "FAILED_PRECONDITION", "PeerRejected": "", "PermissionDenied": "PERMISSION_DENIED",
    "ResourceExhausted": "RESOURCE_EXHAUSTED", "Unavailable": "UNAVAILABLE", "PeerUnreachable": "UNAVAILABLE",
}


class KVPushError(Exception):
    """A daemon call failed.

    ``code``: the gRPC status name ("INVALID_ARGUMENT"); ``message``: the status details;
    ``kind``: the daemon's error class ("InvalidArgument"), or the one the status code maps to when
    the daemon did not say; ``transfer_id``/``peer``: what the daemon named, "" when it did not.
    """

    def __init__(self, code: str, message: str, *, kind: str = "", transfer_id: str = "", peer: str = "") -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.kind = kind
        self.transfer_id = transfer_id
        self.peer = peer


class InvalidArgument(KVPushError):
    """The request itself is wrong (block ids out of range, bad names, sizes)."""


class NotFound(KVPushError):
    """The worker or transfer is not known to the daemon (e.g. after a daemon restart)."""


class AlreadyExists(KVPushError):
    """The transfer id is in use on this worker (an earlier one is still being withdrawn)."""


class FailedPrecondition(KVPushError):
    """The call does not fit the state (wrong role, session not open, draining)."""


class SessionUnknown(FailedPrecondition):
    """A peer call without a live session (the callee restarted): handshake first."""


class IllegalTransition(FailedPrecondition):
    """The daemon's rendezvous table does not allow that event in the transfer's state."""


class PeerRejected(KVPushError):
    """The other node's daemon answered the daemon's call with an error."""


class PermissionDenied(KVPushError):
    """The caller may not do this."""


class ResourceExhausted(KVPushError):
    """A daemon limit was reached (workers, pending transfers, descriptors)."""


class Unavailable(KVPushError):
    """Something the call needs is not available now; retrying later may work."""


class PeerUnreachable(Unavailable):
    """The other node's daemon did not answer the daemon (connect failure, deadline)."""


class DaemonUnavailable(Unavailable):
    """The daemon cannot be reached (not running, restarting, wrong socket): status UNAVAILABLE or
    CANCELLED without the daemon's own reason. (A daemon that answers UNAVAILABLE itself, draining or
    unable to reach a peer, names its kind: ``Unavailable`` or ``PeerUnreachable``.)"""


_KINDS: dict[str, type[KVPushError]] = {kind: globals()[kind] for kind in KINDS}
# a status without a kind (an older daemon, a proxy): the first kind sent as it, which is the parent
_BY_STATUS: dict[str, type[KVPushError]] = {
    **{status: _KINDS[kind] for kind, status in reversed(KINDS.items()) if status},
    "OUT_OF_RANGE": InvalidArgument, "UNAUTHENTICATED": PermissionDenied,
}
_UNREACHABLE = frozenset({"UNAVAILABLE", "CANCELLED"})


def _error_metadata(e: Any) -> dict[str, str]:
    """The ``kvpushd-error`` trailing metadata as a dict of strings ({} when absent or malformed)."""
    try:
        items = e.trailing_metadata() or ()
    except Exception:  # an RpcError without metadata (e.g. one made by hand)
        return {}
    for item in items:
        key, value = (item.key, item.value) if hasattr(item, "key") else item
        if key != METADATA_KEY:
            continue
        try:
            obj = json.loads(value.decode() if isinstance(value, bytes) else value)
        except (ValueError, UnicodeDecodeError):
            return {}
        if not isinstance(obj, dict):
            return {}
        return {str(k): "" if v is None else str(v) for k, v in obj.items()}
    return {}


def from_rpc_error(e: grpc.RpcError) -> KVPushError:
    """The typed error for a failed call: the daemon's kind if it named a known one, else by status."""
    status = e.code() if hasattr(e, "code") else None
    details = e.details() if hasattr(e, "details") else str(e)
    meta = _error_metadata(e)
    code = getattr(status, "name", None) or meta.get("code") or "UNKNOWN"
    kind = meta.get("kind", "")
    cls: type[KVPushError]
    if kind in _KINDS:  # the daemon answered and said why
        cls = _KINDS[kind]
    elif code in _UNREACHABLE and not kind:  # no word from the daemon itself: it is not there
        cls = DaemonUnavailable
    else:
        cls = _BY_STATUS.get(code, Unavailable if code in _UNREACHABLE else KVPushError)
    if not kind and cls is not KVPushError:
        kind = (Unavailable if cls is DaemonUnavailable else cls).__name__
    return cls(code, details or "", kind=kind, transfer_id=meta.get("transfer_id", ""), peer=meta.get("peer", ""))


def error_of(code: str, message: str, kind: str = "", transfer_id: str = "", peer: str = "") -> KVPushError:
    """The typed error for a refusal that came as values (a Stream command's result), not as a status."""
    cls = _KINDS.get(kind) or _BY_STATUS.get(code, KVPushError)
    return cls(code, message, kind=kind or (cls.__name__ if cls is not KVPushError else ""), transfer_id=transfer_id,
               peer=peer)
