"""The namespace helper moved into the package (kvpushd/netns.py, also used by ``kvpushd demo --hosts netns``)."""

from kvpushd.netns import PREFIX, VETH, NetnsLab, available, sweep_stale

__all__ = ["PREFIX", "VETH", "NetnsLab", "available", "sweep_stale"]
