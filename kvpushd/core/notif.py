"""The notification that rides on every WRITE: which registration, which producer rank.

Format ``kvp1:<registration id>:<producer rank>`` (ASCII). The registration id is chosen by the
decode daemon, so a late WRITE for a superseded or aborted registration cannot be mistaken for the
current one.
"""

from __future__ import annotations

import hashlib

from .. import PROTOCOL_VERSION

PREFIX = b"kvp1:"


def encode(registration_id: int, producer_rank: int) -> bytes:
    return b"%s%d:%d" % (PREFIX, registration_id, producer_rank)


def decode(msg: bytes) -> tuple[int, int] | None:
    """Parse a notification; None for anything that is not ours or is malformed."""
    if not msg.startswith(PREFIX):
        return None
    parts = msg[len(PREFIX):].split(b":")
    if len(parts) != 2 or not all(p.isdigit() and len(p) <= 20 for p in parts):
        return None
    return int(parts[0]), int(parts[1])


READ_PREFIX = b"kvp1r:"


def encode_read(registration_id: int, producer_rank: int) -> bytes:
    """Pull mode: rides on the decode daemon's READ to the prefill agent ("this READ completed")."""
    return b"%s%d:%d" % (READ_PREFIX, registration_id, producer_rank)


def decode_read(msg: bytes) -> tuple[int, int] | None:
    """Parse a READ-completion notification; None for anything else (WRITE notifications included)."""
    if not msg.startswith(READ_PREFIX):
        return None
    return decode(PREFIX + msg[len(READ_PREFIX):])


def compat_hash() -> str:
    """Two daemons interoperate only if this matches: protocol version and notification format."""
    h = hashlib.sha256(b"kvpushd|%d|%s|regions=block-major" % (PROTOCOL_VERSION, PREFIX))
    return h.hexdigest()[:16]
