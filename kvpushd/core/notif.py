"""The notification that rides on every WRITE: which registration, which producer rank, which layers.

Format ``kvp1:<registration id>:<producer rank>`` (ASCII): the rank's whole KV. Progressive push
writes a rank's KV layer group by layer group, each WRITE with its own notification
``kvp1:<registration id>:<producer rank>:<first layer>:<layers>:<of layers>``; the decode side
counts a rank complete once every layer of it was notified. A leg whose first blocks were complete
when it was declared (chunked prefill, prefix-cache hits) writes those, every layer of them, as one
more unit: unit 0 is that WRITE and units 1 to ``layers`` the layer groups of the other blocks, so its
notifications count ``layers + 1`` units and the rank is complete only once both kinds landed (the
decode side needs no more than the count: a unit is a unit). NIXL delivers a WRITE's notification
after that WRITE's data, on every backend, so each notification stands for its own bytes and no
order between the WRITEs of one rank is needed (with UCX a WRITE's local completion is not its
arrival: only its notification is). The registration id is chosen by the decode daemon, so a late
WRITE for a superseded or aborted registration cannot be mistaken for the current one.
"""

from __future__ import annotations

import hashlib

from .. import PROTOCOL_VERSION

PREFIX = b"kvp1:"


MAX_LAYERS = 4096  # layer groups one rank's KV may be written in
MAX_UNITS = MAX_LAYERS + 1  # notification units of one rank: its layer groups and its ready blocks


def encode(registration_id: int, producer_rank: int, first: int = 0, count: int = 1, total: int = 1) -> bytes:
    if total == 1:
        return b"%s%d:%d" % (PREFIX, registration_id, producer_rank)
    return b"%s%d:%d:%d:%d:%d" % (PREFIX, registration_id, producer_rank, first, count, total)


Notified = tuple[int, int, int, int, int]  # registration id, producer rank, first layer, layers, of layers


def decode(msg: bytes) -> Notified | None:
    """Parse a notification; None for anything that is not ours or is malformed."""
    if not msg.startswith(PREFIX):
        return None
    parts = msg[len(PREFIX):].split(b":")
    if len(parts) not in (2, 5) or not all(p.isdigit() and len(p) <= 20 for p in parts):
        return None
    if len(parts) == 2:
        return int(parts[0]), int(parts[1]), 0, 1, 1
    first, count, total = int(parts[2]), int(parts[3]), int(parts[4])
    if not (count >= 1 and first + count <= total <= MAX_UNITS):
        return None
    return int(parts[0]), int(parts[1]), first, count, total


READ_PREFIX = b"kvp1r:"


def encode_read(registration_id: int, producer_rank: int) -> bytes:
    """Pull mode: rides on the decode daemon's READ to the prefill agent ("this READ completed")."""
    return b"%s%d:%d" % (READ_PREFIX, registration_id, producer_rank)


def decode_read(msg: bytes) -> tuple[int, int] | None:
    """Parse a READ-completion notification; None for anything else (WRITE notifications included)."""
    if not msg.startswith(READ_PREFIX):
        return None
    got = decode(PREFIX + msg[len(READ_PREFIX):])
    return got[:2] if got is not None and got[4] == 1 else None


def compat_hash() -> str:
    """Two daemons interoperate only if this matches: protocol version and notification format."""
    h = hashlib.sha256(b"kvpushd|%d|%s|regions=block-major|layers" % (PROTOCOL_VERSION, PREFIX))
    return h.hexdigest()[:16]
