"""Who this daemon is, and how daemons name their NIXL agents (a peer may only register its own)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from .. import __version__

_MD_PREFIX = b"nixlSerDes|Agent"


@dataclass(slots=True)
class Identity:
    node_id: str
    peer_address: str  # host:port other daemons reach us at (the port is known once bound)
    instance_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    started: float = field(default_factory=time.monotonic)
    version: str = __version__
    metrics_address: str = ""  # host:port of /metrics once serving


def agent_prefix(node_id: str, instance_id: str) -> str:
    """How the NIXL agents of the daemon (node_id, instance_id) are named: a peer may only register its own."""
    return f"kvpushd.{node_id}.{instance_id[:8]}."


def metadata_agent_name(md: bytes) -> str | None:
    """The agent name inside NIXL agent metadata (``nixlSerDes|Agent`` + u64 length + name).

    Checked before the metadata is loaded, so a peer cannot load metadata under a name it did
    not register (which would replace another agent's). None when the bytes are not in that form.
    """
    if not md.startswith(_MD_PREFIX) or len(md) < len(_MD_PREFIX) + 8:
        return None
    n = int.from_bytes(md[len(_MD_PREFIX):len(_MD_PREFIX) + 8], "little")
    start = len(_MD_PREFIX) + 8
    if n > 4096 or start + n > len(md):
        return None
    try:
        return md[start:start + n].decode()
    except UnicodeDecodeError:
        return None
