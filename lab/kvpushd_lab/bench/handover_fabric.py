"""``kvpushd bench handover --fabric``: the two nodes' daemons, and where their engines run.

``loopback``: both daemons on this host (peer API on 127.0.0.1, UCX picks its transports, shared
memory here). ``veth:RATE``: the prefill node and the decode node are two network namespaces joined
by one veth pair (``netns.NetnsLab(2, link="pair")``), each end shaped to RATE with ``tc qdisc ...
tbf``; each daemon runs in its namespace with UCX over TCP on the veth (``launch.spawn(netns=...)``)
and the engines enter the same namespace, so every KV byte, whichever connector moves it, and the
in-engine side channels cross the shaped link, and nothing else does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .. import launch
from .common import BenchError, progress

ROLES = ("prefill", "decode")


class Nodes:
    """Context manager: the daemons ready, the namespaces (if any) set up; torn down on exit."""

    def __init__(self, fabric: str, workdir: Path, backend: str = "UCX") -> None:
        self.fabric = fabric
        self.backend = backend  # the daemons' NIXL backend (the in-engine agents run the same)
        self.workdir = workdir
        self.rate = fabric.split(":", 1)[1] if fabric.startswith("veth:") else ""
        self.lab: Any = None
        self.daemons: list[launch.Daemon] = []

    def __enter__(self) -> Nodes:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> None:
        settings: dict[str, dict[str, object]] = {
            "log": {"level": "info", "format": "json"}, "metrics": {"listen": "127.0.0.1:0"},
            "transfer": {"publish_timeout_s": 120.0, "expect_timeout_s": 120.0}}
        if self.rate:
            from ..netns import NetnsLab, available, sweep_stale

            ok, why = available()
            if not ok:
                raise BenchError(f"--fabric {self.fabric} needs network namespaces (root, iproute2): {why}")
            sweep_stale()
            self.lab = NetnsLab(2, link="pair").setup()
            self.lab.shape(self.rate)  # both directions: each end shapes what it sends
            progress(f"  fabric: {self.lab.names[0]} ({self.lab.addrs[0]}) <-> {self.lab.names[1]} "
                     f"({self.lab.addrs[1]}), veth pair, tc tbf {self.rate}, "
                     f"{'FI_PROVIDER=tcp' if self.backend == 'LIBFABRIC' else 'UCX_TLS=tcp'}")
        for i, role in enumerate(ROLES):
            self.daemons.append(launch.spawn(self.workdir, f"handover-{role}-node", settings=settings,
                                             die_with_parent=True, backend=self.backend,
                                             netns=(self.lab, i) if self.lab is not None else None))
        for d in self.daemons:
            try:
                launch.wait_ready(d, 120)
            except launch.DaemonStartError as e:
                raise BenchError(str(e)) from None

    def engine_specs(self) -> dict[str, dict[str, Any]]:
        """Per role: the daemon's socket, and the namespace / address the engine runs on."""
        out = {}
        for i, role in enumerate(ROLES):
            lab = self.lab
            out[role] = {"sock": self.daemons[i].sock, "backend": self.backend,
                         "netns": lab.names[i] if lab is not None else "",
                         "veth": lab.veth if lab is not None else "",
                         "host": lab.addrs[i] if lab is not None else "127.0.0.1"}
        return out

    def link_bytes(self, before: dict[str, int] | None = None) -> dict[str, int] | None:
        """Bytes the decode node's veth received and sent (minus ``before``); None on loopback."""
        if self.lab is None:
            return None
        s = self.lab.link_stats(1)
        now = {"decode_rx_bytes": s["rx_bytes"], "decode_tx_bytes": s["tx_bytes"]}
        if before:
            now = {k: v - before.get(k, 0) for k, v in now.items()}
        return now

    def close(self) -> None:
        if self.daemons:
            launch.stop_all(self.daemons)
            self.daemons = []
        if self.lab is not None:
            self.lab.teardown()
            self.lab = None
