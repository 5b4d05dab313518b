"""``fleet``: N prefill nodes x M decode nodes, each daemon in a network namespace of its own, under faults.

Every node is a network namespace on one bridge (kvpushd_lab.netns: a private /24 that exists only
inside the namespaces; UCX over TCP on the namespace's veth, peer API on its address), with its
daemon and its workers (this process, in the engine thread of ``fleet_load``: one
``ReconnectingStreamWorker`` per TP rank, bytes mode, TP 2 on the nodes ``--tp2`` names). Requests
go to random (prefill, decode) pairs, push and pull mixed. Under that load, one after the other,
each waited out until every pair carried a successful transfer again: SIGKILL of one decode node's
daemon and of one prefill node's daemon, each restarted at once; SIGSTOP of a prefill node's daemon
for longer than the peer timeout, then SIGCONT; and a restart storm: SIGTERM to every daemon, and
once they have exited every one started again within one second.

Reported: requests, finished, failed by code, requests that never ended (a request with a side
without an end ``--deadline-s`` after it was issued), blocks the daemons hold after the run (status
API: must be 0), the time from the storm until every pair carried a successful transfer issued
after it, and handshakes (the daemons log every new peer session; they expose no count of
handshakes in flight, so ``handshakes_in_flight_peak`` is null). Nothing here asserts.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import os
import random
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from .. import launch
from ..netns import NetnsLab, available, sweep_stale
from .common import BenchError, Result, progress
from .fleet_load import Fleet, Node, Worker

PORT = 7700


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill-nodes", type=int, default=3, help="prefill nodes (default 3)")
    p.add_argument("--decode-nodes", type=int, default=3, help="decode nodes (default 3)")
    p.add_argument("--tp2", default="p0,d1", help="nodes whose engine runs TP 2, e.g. p0,d1 (default p0,d1; "
                   "'' for none; the others run TP 1)")
    p.add_argument("--rate", type=float, default=20.0, help="requests per second (default 20)")
    p.add_argument("--concurrency", type=int, default=24, help="requests in flight at most (default 24)")
    p.add_argument("--max-blocks", type=int, default=4, help="blocks per request, 1 to this (default 4)")
    p.add_argument("--pull-share", type=float, default=0.5, help="share of requests in pull mode (default 0.5)")
    p.add_argument("--phase-s", type=float, default=8.0,
                   help="seconds of load before the first fault and after each recovery (default 8)")
    p.add_argument("--timeout-s", type=float, default=5.0,
                   help="the daemons' publish_timeout_s and expect_timeout_s (default 5)")
    p.add_argument("--peer-timeout-s", type=float, default=3.0, help="the daemons' peer_timeout_s (default 3)")
    p.add_argument("--deadline-s", type=float, default=60.0,
                   help="a request with a side not ended this long after it was issued never ended (default 60)")
    p.add_argument("--recovery-bound-s", type=float, default=150.0,
                   help="seconds to wait for every pair to carry a transfer again after a fault (default 150)")
    p.add_argument("--no-faults", action="store_true", help="load only: no kill, stop or storm")
    p.add_argument("--faults", default="kill-decode,kill-prefill,stop,storm",
                   help="faults in order, from kill-decode, kill-prefill, stop, storm (default all four)")
    p.add_argument("--seed", type=int, default=1, help="seed of the routing and the fault targets (default 1)")


def _settings(args: argparse.Namespace) -> dict[str, dict[str, object]]:
    return {"log": {"level": "info", "format": "json"}, "metrics": {"enabled": False},
            "transfer": {"publish_timeout_s": args.timeout_s, "expect_timeout_s": args.timeout_s,
                         "write_timeout_s": args.timeout_s, "peer_timeout_s": args.peer_timeout_s,
                         "heartbeat_interval_s": min(1.0, args.peer_timeout_s / 4), "drain_timeout_s": 3.0},
            "peer_api": {"connect_timeout_s": 2.0, "rpc_timeout_s": 3.0}}


def _ready(ds: list[launch.Daemon], timeout_s: float = 120.0) -> None:
    for d in ds:
        try:
            launch.wait_ready(d, timeout_s)
        except launch.DaemonStartError as e:
            raise BenchError(str(e)) from None


class Chaos:
    """The fault schedule, from the main thread (daemons started in a namespace die with the thread
    that started them)."""

    def __init__(self, args: argparse.Namespace, fleet: Fleet, daemons: dict[str, launch.Daemon]) -> None:
        self.args, self.fleet, self.daemons = args, fleet, daemons
        self.t0 = time.monotonic()
        self.faults: list[dict[str, Any]] = []
        self.restarts: collections.Counter[str] = collections.Counter()
        self.storm_wall = 0.0

    def at(self) -> float:
        return round(time.monotonic() - self.t0, 2)

    def recover(self, since: float) -> float | None:
        """Seconds from ``since`` until every pair carried a transfer issued at or after it (None: not
        within --recovery-bound-s)."""
        self.fleet.mark(since)
        deadline = since + self.args.recovery_bound_s
        while time.monotonic() < deadline:
            if self.fleet.error:
                raise BenchError(self.fleet.error)
            got = self.fleet.first_ok()
            if all(v is not None for v in got.values()):
                return round(max(v for v in got.values() if v is not None) - since, 2)
            time.sleep(0.05)
        return None

    def kill_restart(self, name: str) -> None:
        d = self.daemons[name]
        t = time.monotonic()
        progress(f"fleet: {self.at()} s: SIGKILL {name}, restarting it")
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait(10)
        d.restart()
        self.restarts[name] += 1
        _ready([d])
        ready = round(time.monotonic() - t, 2)
        rec = self.recover(t)
        self.faults.append({"fault": "sigkill+restart", "node": name, "at_s": round(t - self.t0, 2),
                            "ready_s": ready, "recovery_s": rec,
                            "recovery_after_ready_s": round(rec - ready, 2) if rec is not None else None})
        progress(f"fleet: {name} ready after {ready} s; every pair carried a transfer again after {rec} s")

    def stop_cont(self, name: str) -> None:
        d = self.daemons[name]
        stopped_s = self.args.peer_timeout_s + 2.0
        t = time.monotonic()
        progress(f"fleet: {self.at()} s: SIGSTOP {name} for {stopped_s:g} s "
                 f"(peer timeout {self.args.peer_timeout_s:g} s)")
        d.proc.send_signal(signal.SIGSTOP)
        time.sleep(stopped_s)
        d.proc.send_signal(signal.SIGCONT)
        t_cont = time.monotonic()
        rec = self.recover(t_cont)
        self.faults.append({"fault": "sigstop+sigcont", "node": name, "at_s": round(t - self.t0, 2),
                            "stopped_s": round(t_cont - t, 2), "recovery_s": rec})
        progress(f"fleet: SIGCONT {name}; every pair carried a transfer again after {rec} s")

    def storm(self) -> dict[str, Any]:
        ds = list(self.daemons.values())
        t = time.monotonic()
        self.storm_wall = time.time()
        progress(f"fleet: {self.at()} s: restart storm: SIGTERM to all {len(ds)} daemons")
        for d in ds:
            d.proc.send_signal(signal.SIGTERM)
        codes = {}
        for d in ds:
            try:
                codes[d.name] = d.proc.wait(max(1.0, t + 15 - time.monotonic()))
            except subprocess.TimeoutExpired:
                d.proc.kill()
                codes[d.name] = d.proc.wait(10)
        down = time.monotonic()
        for d in ds:
            d.restart()
            self.restarts[d.name] += 1
        up = time.monotonic()
        _ready(ds)
        ready = time.monotonic()
        rec = self.recover(t)
        out = {"signal": "SIGTERM", "exit_codes": codes, "down_s": round(down - t, 2),
               "restart_spread_s": round(up - down, 3), "ready_s": round(ready - t, 2), "recovery_s": rec,
               "recovery_after_ready_s": round(rec - (ready - t), 2) if rec is not None else None}
        self.faults.append({"fault": "restart storm", "node": "all", "at_s": round(t - self.t0, 2),
                            "ready_s": out["ready_s"], "recovery_s": rec})
        progress(f"fleet: storm: all exited after {out['down_s']} s, all restarted within "
                 f"{out['restart_spread_s']} s, all ready after {out['ready_s']} s; every pair carried a "
                 f"transfer again {rec} s after the SIGTERMs")
        return out


def _held(daemons: dict[str, launch.Daemon]) -> dict[str, dict[str, int]]:
    out = {}
    for name, d in daemons.items():
        st = d.client.status()
        out[name] = {"transfers": len(st.transfers) + st.transfers_omitted,
                     "blocks": sum(t.num_blocks for t in st.transfers),
                     "worker_pending": sum(w.pending_transfers for w in st.workers)}
    return out


def _handshakes(daemons: dict[str, launch.Daemon], storm_wall: float) -> dict[str, Any]:
    """New peer sessions the daemons logged ("peer handshake"): in all, since the storm, and the most in
    any one second over the fleet."""
    stamps = []
    for d in daemons.values():
        for rec in d.log_records("peer handshake"):
            with contextlib.suppress(KeyError, ValueError):
                stamps.append(datetime.datetime.fromisoformat(str(rec["timestamp"]).replace("Z", "+00:00"))
                              .timestamp())
    per_s = collections.Counter(int(s) for s in stamps)
    after = [s for s in stamps if storm_wall and s >= storm_wall]
    return {"total": len(stamps), "after_storm": len(after), "peak_per_s": max(per_s.values(), default=0)}


def _check(args: argparse.Namespace) -> tuple[set[str], list[str]]:
    n, m = args.prefill_nodes, args.decode_nodes
    if n < 1 or m < 1 or n + m > NetnsLab.MAX_HOSTS:
        raise BenchError(f"need 1 <= --prefill-nodes, --decode-nodes and their sum <= {NetnsLab.MAX_HOSTS}")
    if args.rate <= 0 or args.concurrency < 1 or args.max_blocks < 1 or not 0 <= args.pull_share <= 1:
        raise BenchError("need --rate > 0, --concurrency >= 1, --max-blocks >= 1, 0 <= --pull-share <= 1")
    tp2 = {x.strip() for x in args.tp2.split(",") if x.strip()}
    names = {f"p{i}" for i in range(n)} | {f"d{j}" for j in range(m)}
    if tp2 - names:
        raise BenchError(f"--tp2 names nodes that do not exist: {sorted(tp2 - names)}")
    faults = [] if args.no_faults else [f.strip() for f in args.faults.split(",") if f.strip()]
    bad = set(faults) - {"kill-decode", "kill-prefill", "stop", "storm"}
    if bad:
        raise BenchError(f"unknown faults {sorted(bad)}")
    ok, why = available()
    if not ok:
        raise BenchError(f"kvpushd bench fleet needs network namespaces (root and iproute2): {why}")
    return tp2, faults


def run(args: argparse.Namespace, workdir: Path) -> Result:
    tp2, faults = _check(args)
    n, m = args.prefill_nodes, args.decode_nodes
    sweep_stale()
    block_len, regions = 4096, 4
    num_blocks = args.concurrency * args.max_blocks + 8
    lab = NetnsLab(n + m).setup()
    daemons: dict[str, launch.Daemon] = {}
    fleet: Fleet | None = None
    try:
        roles = [("prefill", i, i) for i in range(n)] + [("decode", j, n + j) for j in range(m)]
        for role, i, host in roles:
            name = f"{role[0]}{i}"
            daemons[name] = launch.spawn(workdir, name, netns=(lab, host), listen=f"{lab.addrs[host]}:{PORT}",
                                         settings=_settings(args), die_with_parent=True)
        progress(f"fleet: {n} prefill x {m} decode nodes in network namespaces {lab.names[0]}.. on {lab.subnet}; "
                 f"starting {n + m} daemons (logs in {workdir})")
        t_start = time.monotonic()
        _ready(list(daemons.values()))
        started_s = time.monotonic() - t_start
        nodes = {}
        for role, i, host in roles:
            name = f"{role[0]}{i}"
            nodes[name] = Node(role, i, 2 if name in tp2 else 1, daemons[name].sock, f"{lab.addrs[host]}:{PORT}",
                               regions, num_blocks, block_len)
        tag = os.urandom(3).hex()
        fleet = Fleet([nodes[f"p{i}"] for i in range(n)], [nodes[f"d{j}"] for j in range(m)], rate=args.rate,
                      concurrency=args.concurrency, max_blocks=args.max_blocks, pull_share=args.pull_share,
                      deadline_s=args.deadline_s, seed=args.seed, tag=tag)
        for k, node in enumerate(nodes.values()):
            node.workers = [Worker(node, r, args.seed * 1000 + k * 10 + r) for r in range(node.tp)]
        fleet.attach_all()
        fleet.start()
        progress(f"fleet: all {n + m} daemons ready after {started_s:.1f} s; "
                 f"{sum(x.tp for x in nodes.values())} workers attached; load {args.rate:g} requests/s")
        chaos = Chaos(args, fleet, daemons)
        fleet.load(True)
        first = chaos.recover(time.monotonic())
        progress(f"fleet: every pair carried a transfer after {first} s")
        time.sleep(args.phase_s)
        storm: dict[str, Any] = {}
        pick = random.Random(args.seed)
        for f in faults:
            if f == "kill-decode":
                chaos.kill_restart(f"d{pick.randrange(m)}")
            elif f == "kill-prefill":
                chaos.kill_restart(f"p{pick.randrange(n)}")
            elif f == "stop":
                chaos.stop_cont(f"p{pick.randrange(n)}")
            else:
                storm = chaos.storm()
            time.sleep(args.phase_s)
        fleet.load(False)
        t_end = time.monotonic()
        progress(f"fleet: {chaos.at()} s: load stopped; waiting for the requests in flight to end")
        while not fleet.idle() and time.monotonic() < t_end + args.deadline_s + 1:
            time.sleep(0.1)
        held = _held(daemons)
        if any(h["transfers"] or h["worker_pending"] for h in held.values()):  # notices in flight: a moment
            time.sleep(args.timeout_s + args.peer_timeout_s + 1)
            held = _held(daemons)
        if fleet.error:
            raise BenchError(fleet.error)
        figures = fleet.figures()
        veth = {name: lab.link_stats(host) for name, (_, _, host) in zip(nodes, roles, strict=True)}
        hs = _handshakes(daemons, chaos.storm_wall)
        wall = time.monotonic() - chaos.t0
        return _result(args, figures, held, storm, chaos, hs, veth, nodes, started_s, first, wall)
    finally:
        if fleet is not None:
            fleet.stop()
        launch.stop_all(list(daemons.values()), 15)
        lab.teardown()


def _result(args: argparse.Namespace, fig: dict[str, Any], held: dict[str, dict[str, int]], storm: dict[str, Any],
            chaos: Chaos, hs: dict[str, Any], veth: dict[str, dict[str, int]], nodes: dict[str, Node],
            started_s: float, first: float | None, wall: float) -> Result:
    blocks = sum(h["blocks"] for h in held.values())
    data: dict[str, Any] = {
        "nodes": {"prefill": args.prefill_nodes, "decode": args.decode_nodes},
        "tp": {name: node.tp for name, node in nodes.items()},
        "requests": fig["requests"], "finished": fig["finished"], "failed": fig["failed"],
        "failed_by_code": fig["failed_by_code"], "never_ended": fig["never_ended"],
        "blocks_held_after": blocks,
        "transfers_pending_after": sum(h["transfers"] + h["worker_pending"] for h in held.values()),
        "storm_recovery_s": storm.get("recovery_s"),
        "handshakes_in_flight_peak": None,  # the daemons expose no count of handshakes in flight
        "handshakes": hs, "storm": storm, "faults": chaos.faults, "first_all_pairs_s": first,
        "daemons_started_s": round(started_s, 2), "restarts": dict(chaos.restarts),
        "held_after": held, "veth_bytes": {k: {"rx": v["rx_bytes"], "tx": v["tx_bytes"]} for k, v in veth.items()},
        **{k: fig[k] for k in ("transfer_modes", "outcomes_by_side", "mismatched_bytes", "bytes_verified",
                               "never_ended_examples", "unexpected_completions", "ended_after_deadline",
                               "attachments_lost", "deferred_no_blocks")},
        "rate": args.rate, "concurrency": args.concurrency, "timeout_s": args.timeout_s,
        "peer_timeout_s": args.peer_timeout_s, "deadline_s": args.deadline_s, "seed": args.seed,
        "seconds": round(wall, 1),
    }
    rows = [{"node": name, "role": node.role, "tp": node.tp, "restarts": chaos.restarts.get(name, 0),
             "rx": veth[name]["rx_bytes"] / 2**20, "tx": veth[name]["tx_bytes"] / 2**20,
             "transfers": held[name]["transfers"], "blocks": held[name]["blocks"]} for name, node in nodes.items()]
    cols = [("node", "node", "<"), ("role", "role", "<"), ("tp", "TP", "d"), ("restarts", "restarts", "d"),
            ("rx", "veth rx MiB", ".1f"), ("tx", "veth tx MiB", ".1f"), ("transfers", "pending after", "d"),
            ("blocks", "blocks held after", "d")]
    ok = fig["never_ended"] == 0 and blocks == 0 and fig["mismatched_bytes"] == 0
    lines = [
        f"requests: {fig['requests']}: {fig['finished']} finished, {fig['failed']} failed "
        f"({', '.join(f'{k} {v}' for k, v in fig['failed_by_code'].items()) or 'none'}), "
        f"{fig['never_ended']} never ended (must be 0); {fig['mismatched_bytes']} bytes differ of "
        f"{fig['bytes_verified']} verified (must be 0)",
        f"blocks held after the run: {blocks} (must be 0)",
        *(f"fault {f['fault']} on {f['node']} at {f['at_s']} s: every pair carried a transfer again after "
          f"{f['recovery_s']} s" for f in chaos.faults),
        f"storm recovery: {storm.get('recovery_s')} s; handshakes logged {hs['total']} ({hs['after_storm']} after the "
        f"storm, at most {hs['peak_per_s']} in one second); handshakes in flight: not exposed by the daemons",
        "invariants: " + ("held" if ok else "BROKEN"),
    ]
    method = [
        f"{args.prefill_nodes} prefill and {args.decode_nodes} decode nodes, each a network namespace on one bridge; "
        "each daemon's peer API listens on its namespace's address and UCX runs TCP on its veth, so every "
        "peer call and KV byte crosses the bridge. The workers (one ReconnectingStreamWorker per TP rank, "
        "KV in shared memory) run in the bench's engine thread and reach their daemon by its unix socket.",
        f"Requests at {args.rate:g}/s (at most {args.concurrency} in flight) of 1 to {args.max_blocks} blocks to a "
        f"random pair, pull with probability {args.pull_share:g}; each side's commands go out one engine tick "
        "apart, in random order.",
        "A side ends with its completion, REFUSED when its command found no attachment, or LOST with its "
        "attachment; a request finished when every side finished and its destination bytes equal its "
        f"source bytes. A request with a side not ended {args.deadline_s:g} s after it was issued never ended.",
        "Recovery: from the fault (the SIGTERMs for the storm, SIGCONT for the stop) until every pair finished a "
        "request issued at or after it. Blocks held: num_blocks over each daemon's status API transfers after "
        "every request ended. Handshakes: the daemons' \"peer handshake\" log records (new peer sessions, "
        "counted on the side called); handshakes_in_flight_peak is null: no daemon figure counts them.",
    ]
    return Result("fleet", data, cols, rows, lines, method)
