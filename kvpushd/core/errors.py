"""One error tree for everything the daemon refuses on purpose.

Each error carries its message and, where known, the transfer and the peer it concerns. The rpc
layer maps each class to one gRPC status code and sends the rest as structured trailing metadata
(kvpushd/rpc/errors.py); the client turns both back into the same kind of error. Anything that is
not a KvpushdError is a bug and becomes INTERNAL with a logged traceback.

The kinds and the status each is sent as are one list, kvpushd_client.errors.KINDS, shared with the
client: every class here is named after a kind (its ``kind``) and answers its ``status``.
"""

from __future__ import annotations

from kvpushd_client.errors import KINDS


class KvpushdError(Exception):
    """Root of the errors that carry a meaning for the caller."""

    def __init__(self, message: str = "", *, transfer_id: str = "", peer: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.transfer_id = transfer_id
        self.peer = peer

    @property
    def kind(self) -> str:
        """The error's class name: what the caller matches on, never the message text."""
        return type(self).__name__

    @property
    def status(self) -> str:
        """The gRPC status name this kind is sent as (kvpushd_client.errors.KINDS); "" when none."""
        return KINDS.get(self.kind, "")


class InvalidArgument(KvpushdError):
    """The request is malformed: bad ids, ranges, sizes or lengths."""


class NotFound(KvpushdError):
    """The request names a worker, engine or transfer the daemon does not know."""


class AlreadyExists(KvpushdError):
    """The request would create something that exists with different contents."""


class FailedPrecondition(KvpushdError):
    """The request is well formed but the system is not in a state to accept it."""


class SessionUnknown(FailedPrecondition):
    """A peer call without a live session (the callee restarted, or never saw a handshake): handshake first."""


class IllegalTransition(FailedPrecondition):
    """An event that the rendezvous table does not allow in the record's state."""

    def __init__(self, state: str, event: str, message: str = "", *, transfer_id: str = "") -> None:
        super().__init__(message or f"event {event!r} is not allowed in state {state!r}", transfer_id=transfer_id)
        self.state = state
        self.event = event


class ResourceExhausted(KvpushdError):
    """A configured bound (pending transfers, message sizes) would be exceeded."""


class Unavailable(KvpushdError):
    """The daemon is draining, or a peer cannot be reached."""


class PeerUnreachable(Unavailable):
    """A remote daemon did not answer (connect failure, deadline)."""


class PeerRejected(KvpushdError):
    """A remote daemon answered a call of ours with an error status."""


class PermissionDenied(KvpushdError):
    """The caller may not do this (peer not allowed, incompatible protocol)."""
