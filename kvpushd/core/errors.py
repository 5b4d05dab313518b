"""One error root for everything the daemon refuses on purpose.

The rpc layer maps each subclass to one gRPC status code (kvpushd/rpc/errors.py); anything that is
not a KvpushdError is a bug and becomes INTERNAL with a logged traceback.
"""

from __future__ import annotations


class KvpushdError(Exception):
    """Root of the errors that carry a meaning for the caller."""


class InvalidArgument(KvpushdError):
    """The request is malformed: bad ids, ranges, sizes or lengths."""


class NotFound(KvpushdError):
    """The request names a worker, engine or transfer the daemon does not know."""


class AlreadyExists(KvpushdError):
    """The request would create something that exists with different contents."""


class FailedPrecondition(KvpushdError):
    """The request is well formed but the system is not in a state to accept it."""


class ResourceExhausted(KvpushdError):
    """A configured bound (pending transfers, message sizes) would be exceeded."""


class Unavailable(KvpushdError):
    """The daemon is draining, or a peer cannot be reached."""


class PermissionDenied(KvpushdError):
    """The caller may not do this (peer not allowed, incompatible protocol)."""
