"""The namespace helper moved into the package (kvpushd_lab/netns.py, also used by ``kvpushd demo --hosts netns``)."""

from kvpushd_lab.netns import PREFIX, VETH, NetnsLab, available, sweep_stale

__all__ = ["PREFIX", "VETH", "NetnsLab", "available", "sweep_stale"]
