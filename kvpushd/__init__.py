"""kvpushd: a per-node sidecar that moves KV cache from prefill to decode workers (push mode)."""

__version__ = "0.1.0"

# Bumped when the peer protocol or the notification format changes incompatibly.
PROTOCOL_VERSION = 5
