"""``peers``: what one prefill daemon pays per decode peer, with ``--peers`` of them connected at once.

One real prefill daemon (one producer worker attached) faces synthetic decode daemons from
``--generators`` load-generator processes (bench/peergen.py), on loopback only. Each peer has its
own identity (node id, instance id, peer address: the daemon keys sessions by instance id and
agents by node id), a Handshake, a Channel stream, one Register and heartbeats on the stream;
peers share gRPC connections, ``--per-connection`` each (below peer_api.max_streams_per_connection).

Figures: ``connect_all_s`` (the generators told to connect, from cold: no channel open -> every
peer registered), ``rss_per_peer_kib`` (the daemon's RSS after all connected minus before, per
peer), ``status_bytes`` / ``status_ms`` (GetStatus on the worker socket with every peer connected:
median of 3), ``cpu_per_heartbeat_round_ms`` (the daemon's CPU over one heartbeat from every peer,
median of ``--rounds``, idle CPU over the same time not subtracted; that is given as
``idle_cpu_ms_per_s``). The generators share the machine's CPUs with the daemon.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import select
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import IO, Any

import grpc
from kvpushd_client import KVPushClient, Region, Role
from kvpushd_client.proto.v1 import status_pb2, status_pb2_grpc

from kvpushd.config import PeerApiConfig

from .. import launch
from .common import BenchError, KVMemory, Layout, Result, progress, sched_ns
from .soak import rss_kib

ENGINE = "bench-prefill"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--peers", type=int, default=10000, help="synthetic decode peers (default 10000)")
    p.add_argument("--generators", type=int, default=4, help="load-generator processes (default 4)")
    p.add_argument("--per-connection", type=int, default=15,
                   help="peers sharing one gRPC connection (default 15; the daemon allows 16 streams)")
    p.add_argument("--rounds", type=int, default=3, help="heartbeat rounds measured (default 3)")
    p.add_argument("--regions", type=int, default=4, help="regions of each peer's agent (default 4)")
    p.add_argument("--blocks", type=int, default=16, help="blocks in each peer's registration (default 16)")
    p.add_argument("--metadata-bytes", type=int, default=2048, help="NIXL metadata size of each agent (default 2048)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds allowed for all to connect (default 600)")
    p.add_argument("--connect-rate", type=float, default=0.0,
                   help="peers that start connecting per second, all generators together (default 0: all at once, "
                        "as a fleet does when this daemon restarts)")


def _gen(spec: dict[str, Any], log: IO[str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "kvpushd_lab.bench.peergen", json.dumps(spec)], text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, bufsize=1)


def _ask(gens: list[subprocess.Popen[str]], line: str | None, timeout_s: float) -> list[dict[str, Any]]:
    """Send ``line`` to every generator (None: send nothing) and read one JSON line from each."""
    for g in gens:
        if line is not None:
            assert g.stdin is not None
            g.stdin.write(line + "\n")
            g.stdin.flush()
    out = []
    deadline = time.monotonic() + timeout_s
    for g in gens:
        assert g.stdout is not None
        # the generators bound their own calls; a dead one gives EOF, a stuck one the deadline
        ready, _, _ = select.select([g.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise BenchError(f"load generators did not answer {line!r} within {timeout_s:g}s")
        text = g.stdout.readline()
        if not text:
            raise BenchError(f"a load generator exited (rc {g.poll()}); see its log")
        out.append(json.loads(text))
    return out


def _status(sock: str) -> tuple[int, float, int, int]:
    """(GetStatus size in bytes, median ms of 3, peers it counts, transfers it counts)."""
    ch = grpc.insecure_channel(f"unix:{sock}", options=[("grpc.max_receive_message_length", 256 << 20)])
    stub = status_pb2_grpc.StatusServiceStub(ch)
    times, resp = [], None
    try:
        for _ in range(3):
            t0 = time.perf_counter()
            resp = stub.GetStatus(status_pb2.GetStatusRequest(), timeout=120)
            times.append((time.perf_counter() - t0) * 1e3)
    finally:
        ch.close()
    assert resp is not None
    # the answer lists at most 256 peers and 1000 transfers (rpc/status.py) and counts the rest
    return (resp.ByteSize(), statistics.median(times), len(resp.peers) + resp.peers_omitted,
            len(resp.transfers) + resp.transfers_omitted)


def hwm_kib(pid: int) -> int:
    """The process's peak RSS (VmHWM)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _cpu_ms(pid: int) -> float:
    return sched_ns(pid)[0] / 1e6


def run(args: argparse.Namespace, workdir: Path) -> Result:
    n, g = args.peers, max(1, min(args.generators, args.peers))
    if n < 1 or args.per_connection < 1 or args.rounds < 1:
        raise BenchError("--peers, --per-connection and --rounds must be at least 1")
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the daemon inherits it: a socket per connection
    conns = sum(-(-c // args.per_connection) for c in _split(n, g))
    if conns + 256 > hard:
        raise BenchError(f"{conns} connections need more file descriptors than the limit ({hard})")
    long = 3600.0  # nothing expires during the run: heartbeats come when the bench says
    settings: dict[str, dict[str, object]] = {
        "log": {"level": "warning", "format": "json"}, "metrics": {"enabled": False},
        "transfer": {"expect_timeout_s": long, "publish_timeout_s": long, "peer_timeout_s": long},
        # every synthetic peer connects from loopback: one host, so one identity for the per-peer bounds
        "peer_api": {"idle_close_s": long, "max_sessions_per_peer": args.peers + 16}}
    d = launch.spawn(workdir, "peers-pnode", settings=settings)
    kv = KVMemory("kvpushd-bench-peers", Layout(layers=1, num_blocks=64), fill=0)
    gens: list[subprocess.Popen[str]] = []
    logs: list[IO[str]] = []
    try:
        try:
            launch.wait_ready(d, 120)
        except launch.DaemonStartError as e:
            raise BenchError(str(e)) from None
        pid = d.proc.pid
        client = KVPushClient(d.sock)
        client.attach(ENGINE, Role.PRODUCER, 0, 1, [kv.buf.memory],
                      [Region(0, 0, kv.layout.num_blocks, kv.layout.block_len)], description="kvpushd bench peers")
        tag = os.urandom(3).hex()
        pa = PeerApiConfig()
        first = 0
        for k, count in enumerate(_split(n, g)):
            spec = {"target": d.peer_address, "first": first, "count": count, "per_connection": args.per_connection,
                    "tag": f"peers-{tag}", "engine_id": ENGINE, "regions": args.regions, "blocks": args.blocks,
                    "metadata_bytes": args.metadata_bytes, "deadline_s": args.timeout,
                    "connect_rate": args.connect_rate * count / n,
                    # a decode daemon's defaults: its handshake and item deadlines, its back-off after a failure
                    "connect_timeout_s": pa.connect_timeout_s, "rpc_timeout_s": pa.rpc_timeout_s,
                    "retry_s": pa.handshake_retry_s, "retry_max_s": pa.handshake_retry_max_s}
            logs.append(open(workdir / f"peergen-{k}.log", "w"))  # noqa: SIM115 (closed below)
            gens.append(_gen(spec, logs[-1]))
            first += count
        progress(f"peers: daemon ready (pid {pid}); starting {g} load generators")
        _ask(gens, None, 120)  # imported and ready: what follows is cold (no channel connected yet)
        time.sleep(1.0)
        rss0, cpu0 = rss_kib(pid), _cpu_ms(pid)
        progress(f"peers: {n} synthetic decode peers from {g} generators over {conns} connections")
        t0 = time.monotonic()
        done = _ask(gens, "connect", args.timeout + 60)
        connect_all_s = max(x["t_done"] for x in done) - t0
        connected = sum(x["connected"] for x in done)
        cpu_connect = _cpu_ms(pid) - cpu0
        progress(f"peers: {connected}/{n} connected and registered in {connect_all_s:.1f} s")
        time.sleep(2.0)
        rss1, peak = rss_kib(pid), hwm_kib(pid)
        c0, w0 = _cpu_ms(pid), time.monotonic()
        time.sleep(2.0)
        idle_ms_per_s = (_cpu_ms(pid) - c0) / (time.monotonic() - w0)
        status_bytes, status_ms, listed, sends = _status(d.sock)
        progress(f"peers: GetStatus {status_bytes} bytes in {status_ms:.1f} ms; {args.rounds} heartbeat rounds")
        rounds, walls, beats = [], [], []
        for _ in range(args.rounds):
            c = _cpu_ms(pid)
            got = _ask(gens, "beat", 300)
            rounds.append(_cpu_ms(pid) - c)
            walls.append(max(x["t_done"] for x in got) - min(x["t_start"] for x in got))
            beats.append(sum(x["beats_ok"] for x in got))
            time.sleep(0.5)
        _ask_quit(gens)
        client.close()
    finally:
        for p in gens:
            if p.poll() is None:
                p.kill()
            p.wait(10)
        for f in logs:
            f.close()
        launch.stop_all([d])
        kv.close()
    errors = sorted({e for x in done for e in x["errors"]})[:5]
    failures: Counter[str] = Counter()
    for x in done:
        failures.update(x["failures"])
    data = {
        "peers": n, "connected": connected, "transfers_in_status": sends, "peers_in_status": listed,
        "generators": g, "connections": conns, "per_connection": args.per_connection,
        "connect_all_s": round(connect_all_s, 2), "connect_retries": sum(x["retries"] for x in done),
        "daemon_cpu_connect_s": round(cpu_connect / 1e3, 2),
        "rss_before_mib": round(rss0 / 1024, 1), "rss_after_mib": round(rss1 / 1024, 1),
        "rss_peak_mib": round(peak / 1024, 1),  # the most while connecting: calls queued in gRPC included
        "rss_per_peer_kib": round((rss1 - rss0) / max(1, connected), 2),  # per peer connected
        "status_bytes": status_bytes, "status_ms": round(status_ms, 1),
        "cpu_per_heartbeat_round_ms": round(statistics.median(rounds), 1),
        "cpu_per_heartbeat_us": round(statistics.median(rounds) * 1e3 / max(1, min(beats)), 1),
        "heartbeat_round_wall_ms": round(statistics.median(walls) * 1e3, 1),
        "heartbeats_answered": min(beats), "idle_cpu_ms_per_s": round(idle_ms_per_s, 1),
        "per_peer": {"regions": args.regions, "blocks": args.blocks, "agent_metadata_bytes": args.metadata_bytes},
        "errors": errors, "failed_attempts": dict(failures.most_common(8)), "connect_rate": args.connect_rate,
    }
    if connected < n:
        progress(f"peers: {n - connected} peers did not connect: {errors}")
    lines = [f"{connected}/{n} peers connected and registered in {data['connect_all_s']} s over {conns} connections",
             f"RSS {data['rss_before_mib']} -> {data['rss_after_mib']} MiB: {data['rss_per_peer_kib']} KiB per peer",
             f"GetStatus with all connected: {status_bytes} bytes in {data['status_ms']} ms",
             f"one heartbeat round of all peers: {data['cpu_per_heartbeat_round_ms']} ms of daemon CPU "
             f"({data['cpu_per_heartbeat_us']} us per heartbeat), {data['heartbeat_round_wall_ms']} ms wall; "
             f"idle {data['idle_cpu_ms_per_s']} ms CPU per s"]
    method = ["One prefill daemon (logs at warning, metrics off, timeouts of an hour so nothing expires), one "
              "producer worker; synthetic decode peers in load-generator processes on loopback, each its own node "
              "id, instance id and peer address: Handshake, Channel stream, one Register of its own agent "
              "(metadata never loaded: no publish comes), heartbeats on the stream when told.",
              "connect_all_s: all generators told to connect (channels created but not connected; every peer at "
              "once unless connect_rate is set) until the last peer's Register was answered. Each peer uses a decode "
              "daemon's defaults: peer_api.connect_timeout_s for its Handshake, rpc_timeout_s for its Register, and "
              "after a failed attempt the back-off of kvpushd's peer link (handshake_retry_s doubled per failure "
              "up to handshake_retry_max_s, drawn at 50-100%), retried until --timeout; failed_attempts counts "
              "them by error.",
              "rss_peak_mib: the daemon's VmHWM after connecting (what the storm cost at its peak).",
              "RSS from /proc/PID/status; CPU from /proc/PID/task/*/schedstat; the generators share the CPUs."]
    return Result("peers", data, lines=lines, method=method)


def _ask_quit(gens: list[subprocess.Popen[str]]) -> None:
    for p in gens:
        if p.stdin is not None:
            p.stdin.write("quit\n")
            p.stdin.close()
    for p in gens:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()


def _split(n: int, parts: int) -> list[int]:
    return [n // parts + (1 if k < n % parts else 0) for k in range(parts)]
