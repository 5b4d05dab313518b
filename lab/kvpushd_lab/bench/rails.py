"""``kvpushd bench rails``: does NIXL's LIBFABRIC backend make a rail per network interface and stripe
one WRITE across them, with libfabric's tcp provider?

Two network namespaces joined by N veth pairs (``netns.NetnsLab(2, link="pair", veths=N)``: ``kvp0``
.. ``kvp<N-1>``, each its own /24, each end shaped to ``--rate`` with ``tc tbf``). One raw NIXL agent
on LIBFABRIC in each namespace, no ``FI_TCP_IFACE`` (libfabric sees every interface), NIXL logging at
INFO; the initiator WRITEs ``--mib`` MiB into the target with a notification, the target checks every
byte. Reported per N: the tcp domains libfabric lists in the namespace (``fi_info``), what NIXL says
it discovered and how many rails it created, the bytes each veth carried, the WRITE's time and GB/s.
With striping, 2 and 4 rails would carry the bytes on every veth and move them 2 and 4 times as fast
as one.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..backend import available, backend_env, libfabric_ld_path
from ..netns import NetnsLab
from .common import BenchError, Result, progress

PATTERN_MOD = 251  # byte i of the source is i % 251: a shifted or short copy shows
_DISCOVERED = re.compile(r"Discovered (\d+) (\w+) devices")
_RAILS = re.compile(r"Created (\d+) rails using provider=(\w+)")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rails", type=int, nargs="+", default=[1, 2, 4], help="veth pairs between the two "
                   "namespaces, one run each (default 1 2 4)")
    p.add_argument("--rate", default="1gbit", help="tc tbf rate of each veth end (default 1gbit: far below "
                   "what one TCP stream moves here, so striping would show as speed)")
    p.add_argument("--mib", type=int, default=64, help="bytes of the one WRITE, in MiB (default 64)")
    p.add_argument("--iface", default="", help="set FI_TCP_IFACE to this interface (default: unset, so "
                   "libfabric sees every interface)")


# -- the two agents, each a process in its namespace -------------------------------------------------------

def _agent(name: str) -> Any:
    from ..backend import nixl_agent

    return nixl_agent(name, "LIBFABRIC")


def _child_target(d: Path, nbytes: int, timeout_s: float) -> None:
    import numpy as np

    buf = np.zeros(nbytes, dtype=np.uint8)
    agent = _agent("rails-target")
    reg = agent.register_memory([(buf.ctypes.data, nbytes, 0, "")], "DRAM")
    (d / "target.addr").write_text(str(buf.ctypes.data))
    (d / "target.md.tmp").write_bytes(bytes(agent.get_agent_metadata()))
    os.replace(d / "target.md.tmp", d / "target.md")
    deadline = time.monotonic() + timeout_s
    got = False
    while time.monotonic() < deadline and not got:
        for msgs in agent.get_new_notifs().values():
            got = got or b"rails-done" in [bytes(m) for m in msgs]
        time.sleep(0.001)
    want = (np.arange(nbytes, dtype=np.uint64) % PATTERN_MOD).astype(np.uint8)
    out = {"notified": got, "mismatched_bytes": int(np.count_nonzero(buf != want)) if got else None}
    (d / "target.json").write_text(json.dumps(out))
    agent.deregister_memory(reg)
    os._exit(0)


def _child_initiator(d: Path, nbytes: int, timeout_s: float) -> None:
    import numpy as np

    src = (np.arange(nbytes, dtype=np.uint64) % PATTERN_MOD).astype(np.uint8)
    agent = _agent("rails-initiator")
    reg = agent.register_memory([(src.ctypes.data, nbytes, 0, "")], "DRAM")
    deadline = time.monotonic() + timeout_s
    while not (d / "target.md").exists():
        if time.monotonic() > deadline:
            raise SystemExit("no target metadata")
        time.sleep(0.01)
    remote = agent.add_remote_agent((d / "target.md").read_bytes())
    remote = remote.decode() if isinstance(remote, bytes) else remote
    dst = int((d / "target.addr").read_text())
    local = agent.get_xfer_descs([(src.ctypes.data, nbytes, 0)], "DRAM")
    far = agent.get_xfer_descs([(dst, nbytes, 0)], "DRAM")
    h = None
    while h is None and time.monotonic() < deadline:  # the metadata exchange may still be under way
        try:
            h = agent.initialize_xfer("WRITE", local, far, remote, b"rails-done")
        except Exception:  # NIXL raises its own types; retried until the deadline
            time.sleep(0.05)
    out: dict[str, Any] = {"state": "NOT_POSTED"}
    if h is not None:
        t0 = time.monotonic()
        state = agent.transfer(h)
        while state == "PROC" and time.monotonic() < deadline:
            state = agent.check_xfer_state(h)
        out = {"state": str(state), "seconds": time.monotonic() - t0}
        if state != "PROC":
            agent.release_xfer_handle(h)
    (d / "initiator.json").write_text(json.dumps(out))
    agent.deregister_memory(reg)
    os._exit(0)


def _fi_info(ns: str, env: dict[str, str]) -> list[str]:
    """The tcp provider's domains (interfaces) libfabric lists inside ``ns``."""
    bins = [Path(d).parent / "bin" / "fi_info" for d in libfabric_ld_path().split(":") if d]
    fi = next((str(b) for b in bins if b.exists()), "")
    if not fi:
        return []
    p = subprocess.run(["ip", "netns", "exec", ns, fi, "-p", "tcp", "-t", "FI_EP_RDM"], capture_output=True,
                       text=True, env=env, timeout=30)
    return sorted(set(re.findall(r"domain:\s*(\S+)", p.stdout)))


def _read(path: Path, missing: dict[str, Any]) -> dict[str, Any]:
    """A child's JSON report, or ``missing`` when the child died before writing it."""
    out: dict[str, Any] = json.loads(path.read_text()) if path.exists() else missing
    return out


def _one(n: int, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    d = workdir / f"rails-{n}"
    d.mkdir(parents=True, exist_ok=True)
    nbytes = args.mib << 20
    pair = NetnsLab(2, link="pair", veths=n).setup()
    try:
        pair.shape(args.rate)
        env = backend_env("LIBFABRIC", {**os.environ, "NIXL_LOG_LEVEL": "INFO"}, iface=args.iface)
        if not args.iface:
            env.pop("FI_TCP_IFACE", None)
        domains = _fi_info(pair.names[0], env)
        before = {dev: pair.link_stats(0, dev)["tx_bytes"] for dev in pair.veths}
        procs = []
        for i, role in ((1, "target"), (0, "initiator")):
            log = open(d / f"{role}.log", "wb")  # noqa: SIM115 - closed with the process below
            argv = ["ip", "netns", "exec", pair.names[i], sys.executable, "-m", "kvpushd_lab.bench.rails",
                    "--child", role, str(d), str(nbytes)]
            procs.append((subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT), log))
        for p, log in procs:
            try:
                p.wait(timeout=180)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            log.close()
        after = {dev: pair.link_stats(0, dev)["tx_bytes"] for dev in pair.veths}
    finally:
        pair.teardown()
    logs = "".join((d / f"{r}.log").read_text(errors="replace") for r in ("initiator", "target"))
    disc = _DISCOVERED.findall(logs)
    rails = _RAILS.findall(logs)
    ini: dict[str, Any] = _read(d / "initiator.json", {"state": "CRASHED"})
    tgt: dict[str, Any] = _read(d / "target.json", {"notified": False})
    per = {k: after[k] - before[k] for k in after}
    secs = ini.get("seconds")
    return {"rails": n, "libfabric_tcp_domains": domains,
            "nixl_discovered": sorted({f"{c} {p}" for c, p in disc}),
            "nixl_rails_created": sorted({int(c) for c, _ in rails}),
            "state": ini.get("state"), "notified": tgt.get("notified"),
            "mismatched_bytes": tgt.get("mismatched_bytes"), "bytes": nbytes,
            "seconds": round(secs, 3) if secs else None,
            "gb_s": round(nbytes / secs / 1e9, 3) if secs and ini.get("state") == "DONE" else None,
            "tx_bytes_per_veth": per,
            "veths_carrying": sum(1 for v in per.values() if v > nbytes // 10)}


def run(args: argparse.Namespace, workdir: Path) -> Result:
    if why := available("LIBFABRIC"):
        raise BenchError(why)
    from ..netns import available as netns_available
    from ..netns import sweep_stale

    ok, why = netns_available()
    if not ok:
        raise BenchError(f"needs network namespaces (root, iproute2): {why}")
    sweep_stale()
    rows = []
    for n in args.rails:
        progress(f"rails: {n} veth pair(s) at {args.rate} each, one {args.mib} MiB WRITE on LIBFABRIC (tcp)")
        rows.append(_one(n, args, workdir))
    res = Result("rails", {"rate": args.rate, "mib": args.mib, "fi_tcp_iface": args.iface, "rows": rows})
    res.rows = [{**r, "domains": ",".join(r["libfabric_tcp_domains"]),
                 "created": ",".join(map(str, r["nixl_rails_created"])),
                 "per_veth": " ".join(f"{k}={v >> 20}MiB" for k, v in r["tx_bytes_per_veth"].items())}
                for r in rows]
    res.columns = [("rails", "veth pairs", "d"), ("domains", "libfabric tcp domains", "s"),
                   ("created", "NIXL rails", "s"), ("state", "WRITE", "s"), ("mismatched_bytes", "mismatched", "d"),
                   ("gb_s", "GB/s", ".3f"), ("per_veth", "sent per veth", "s")]
    res.method = [f"two network namespaces joined by N veth pairs, each end tc tbf {args.rate}; one raw NIXL "
                  f"agent on LIBFABRIC (FI_PROVIDER=tcp, FI_TCP_IFACE {args.iface or 'unset'}) in each, no "
                  f"progress thread; one WRITE of {args.mib} MiB (one descriptor) with a notification, every byte "
                  "checked at the target; NIXL's own INFO lines give the devices it discovered and the rails it "
                  "created; bytes per veth from the initiator namespace's tx counters."]
    return res


def _child_main(argv: list[str]) -> None:
    role, d, nbytes = argv[0], Path(argv[1]), int(argv[2])
    (_child_target if role == "target" else _child_initiator)(d, nbytes, 120.0)


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    _child_main(sys.argv[2:])
