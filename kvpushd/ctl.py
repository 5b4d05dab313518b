"""kvpushctl: what a daemon's status API says, as tables for a person or JSON for scripts.

``status`` (everything), ``peers``, ``transfers`` (in flight, and recent failures), ``watch``
(events as they happen; ``--json``: one object per line) and ``health`` (grpc.health.v1 on the
socket, for exec probes: Kubernetes' own gRPC probes reach TCP ports only, and the peer port may
require a client certificate). JSON follows protobuf's JSON mapping
with the .proto field names: enums are names, 64-bit integers are strings.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections.abc import Sequence
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message
from kvpushd_client.proto.v1 import common_pb2, status_pb2, status_pb2_grpc

from .config import default_socket_path

EVENT_KINDS = [n.removeprefix("EVENT_").lower() for n, v in status_pb2.EventKind.items() if v]


def health(socket: str, service: str = "", live: bool = False, timeout: float = 5.0) -> int:
    """0 when the daemon answers SERVING (``live``: when it answers at all, e.g. while it drains), else 1."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(f"unix:{socket}") as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    except grpc.RpcError as e:
        print(f"kvpushctl: no health answer at {socket}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
    print(name)
    return 0 if live or r.status == health_pb2.HealthCheckResponse.SERVING else 1


def fetch(socket: str, timeout: float = 5.0) -> status_pb2.NodeStatus:
    with grpc.insecure_channel(f"unix:{socket}") as ch:
        return status_pb2_grpc.StatusServiceStub(ch).GetStatus(status_pb2.GetStatusRequest(), timeout=timeout)


def _table(rows: list[list[Any]], header: list[str]) -> str:
    if not rows:
        return "  (none)"
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=False)]
    fmt = "  " + "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header).rstrip()] + [fmt.format(*map(str, r)).rstrip() for r in rows])


def _bytes(n: int) -> str:
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if x < 1024:
            return f"{x:.0f}{unit}" if unit == "B" else f"{x:.1f}{unit}"
        x /= 1024
    return f"{x:.1f}TiB"


def _age(s: float) -> str:
    if s < 1:
        return f"{s * 1000:.1f}ms"
    if s < 120:
        return f"{s:.1f}s"
    if s < 7200:
        return f"{s / 60:.0f}m"
    return f"{s / 3600:.1f}h"


def _regions(rs: Sequence[status_pb2.RegionSummary]) -> str:
    return " + ".join(f"{r.count}x{r.num_blocks}x{_bytes(r.block_len)}" for r in rs)


def _backends(w: status_pb2.WorkerStatus) -> str:
    """UCX[gpu0: device_list=mlx5_0 num_workers=2] -- the agent's backends, devices and parameters."""
    out = []
    for b in w.backends:
        params = " ".join(f"{k}={v}" for k, v in sorted(b.params.items()) if v)
        devs = f"devices {b.devices} ({b.devices_from})" if b.devices else ""
        out.append(f"{b.name}[{'; '.join(x for x in (b.device, devs, params) if x)}]")
    return " ".join(out) or "-"


def _peers_table(st: status_pb2.NodeStatus) -> str:
    return _table([[p.address, p.node_id, p.direction, p.state, p.channel_state or "-",
                    _age(p.last_contact_age_s) + " ago" if p.last_contact_unix else "never",
                    _bytes(p.bytes_sent), _bytes(p.bytes_received), p.transfers_finished, p.transfers_failed,
                    p.errors, _stream(p), p.last_error[:80]] for p in st.peers],
                  ["ADDRESS", "NODE", "DIRECTION", "STATE", "CHANNEL", "LAST CONTACT", "SENT", "RECEIVED", "OK",
                   "FAILED", "ERRORS", "STREAM", "LAST ERROR"])


def _stream(p: status_pb2.PeerStatus) -> str:
    """The peer Channel in a few characters: out <opened>/<batches>[+<pending>], in <open>/<batches>."""
    out = []
    if p.streams_opened:
        out.append(f"out {p.streams_opened}/{p.stream_batches_sent}"
                   + (f"+{p.stream_items_pending}" if p.stream_items_pending else ""))
    if p.inbound_streams or p.stream_batches_received:
        out.append(f"in {p.inbound_streams}/{p.stream_batches_received}")
    return " ".join(out) or "-"


def _transfers_table(st: status_pb2.NodeStatus) -> str:
    return _table([[t.transfer_id, t.engine_id, t.side, t.state, _age(t.age_s), t.num_blocks, t.peer or "-",
                    t.waiting_for] for t in st.transfers],
                  ["TRANSFER", "ENGINE", "SIDE", "STATE", "AGE", "BLOCKS", "PEER", "WAITING FOR"])


def _failures_table(st: status_pb2.NodeStatus, last: int = 10) -> str:
    return _table([[_age(f.age_s) + " ago", f.transfer_id, f.reason[:120]] for f in st.recent_failures[-last:]],
                  ["WHEN", "TRANSFER", "REASON"])


def render(st: status_pb2.NodeStatus) -> str:
    c = st.counters
    cfg = st.config
    out = [
        f"node {st.node_id}  kvpushd {st.version}  up {st.uptime_s:.0f}s  "
        f"{'DRAINING' if st.draining else 'serving'}  peer address {st.peer_address}",
        f"socket {st.worker_socket}  backends {','.join(st.backends)}  metrics {st.metrics_address or 'off'}",
        f"config publish_timeout {cfg.get('transfer.publish_timeout_s', '?')}s  expect_timeout "
        f"{cfg.get('transfer.expect_timeout_s', '?')}s  max_pending {cfg.get('transfer.max_pending', '?')}  "
        f"log {cfg.get('log.level', '?')}/{cfg.get('log.format', '?')}",
        f"transfers finished {c.transfers_finished}  failed {c.transfers_failed}  bytes written "
        f"{c.bytes_written}  WRITEs {c.writes_posted}  notifications {c.notifications_received} "
        f"(stray {c.stray_notifications})  descriptors {c.descriptors_requested} -> {c.descriptors_posted}  "
        f"watchers {st.watchers}",
        "", "workers:",
        _table([[w.worker_id, w.engine_id, common_pb2.Role.Name(w.role).removeprefix("ROLE_").lower(),
                 f"{w.tp_rank}/{w.tp_size}", w.pp_rank, w.memory_kind, _regions(w.regions) or w.num_regions,
                 _bytes(w.registered_bytes), w.pending_transfers, _age(w.attached_s), _backends(w)]
                for w in st.workers],
               ["WORKER", "ENGINE", "ROLE", "TP", "PP", "MEM", "REGIONS (n x blocks x len)", "BYTES", "PENDING",
                "ATTACHED", "BACKENDS"]),
        "", "peers:", _peers_table(st),
        "", "transfers in flight:", _transfers_table(st),
        "", "recent failures:", _failures_table(st),
    ]
    return "\n".join(out)


def as_dict(msg: Message) -> dict[str, Any]:
    return MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def render_event(ev: status_pb2.Event) -> str:
    kind = status_pb2.EventKind.Name(ev.kind).removeprefix("EVENT_").lower()
    parts = [datetime.datetime.fromtimestamp(ev.time_unix, datetime.UTC).isoformat(timespec="milliseconds"),
             f"{kind:<17}"]
    for label, value in (("transfer", ev.transfer_id), ("engine", ev.engine_id), ("worker", ev.worker_id),
                         ("side", ev.side), ("peer", ev.peer)):
        if value:
            parts.append(f"{label}={value}")
    if ev.num_blocks:
        parts.append(f"blocks={ev.num_blocks}")
    if ev.bytes:
        parts.append(f"bytes={_bytes(ev.bytes)}")
    if ev.kind in (status_pb2.EVENT_TRANSFER_FINISHED, status_pb2.EVENT_TRANSFER_FAILED):
        parts.append(f"after={_age(ev.duration_s)}")
    if ev.kind == status_pb2.EVENT_TRANSFER_FAILED:
        parts.append(common_pb2.FailureCode.Name(ev.code).removeprefix("FAILURE_"))
    if ev.detail:
        parts.append(f"({ev.detail})")
    if ev.dropped:
        parts.append(f"[{ev.dropped} dropped]")
    return "  ".join(parts)


def watch(socket: str, kinds: list[str], as_json: bool, count: int, timeout: float | None) -> int:
    req = status_pb2.WatchRequest(kinds=[status_pb2.EventKind.Value("EVENT_" + k.upper()) for k in kinds])
    seen = 0
    with grpc.insecure_channel(f"unix:{socket}") as ch:
        call = status_pb2_grpc.StatusServiceStub(ch).Watch(req, timeout=timeout)
        try:
            for ev in call:
                print(json.dumps(as_dict(ev)) if as_json else render_event(ev), flush=True)
                seen += 1
                if count and seen >= count:
                    call.cancel()
                    return 0
        except grpc.RpcError as e:
            if e.code() is not grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
            if count:
                print(f"kvpushctl: {seen} of {count} events within {timeout:g}s", file=sys.stderr)
                return 1
            return 0
    if count:
        print(f"kvpushctl: the daemon stopped after {seen} of {count} events", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvpushctl", description="inspect a kvpushd daemon")
    ap.add_argument("--socket", default=default_socket_path(), help="daemon's worker socket")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, text in (("status", "node, workers, peers, transfers in flight, recent failures, counters"),
                       ("peers", "other daemons: handshake state, last contact, bytes, errors"),
                       ("transfers", "transfers in flight (state, age, what each waits for) and recent failures")):
        s = sub.add_parser(name, help=text)
        s.add_argument("--json", action="store_true", help="one JSON object, for scripts")
    w = sub.add_parser("watch", help="events as they happen, until interrupted")
    w.add_argument("--json", action="store_true", help="one JSON object per line")
    w.add_argument("--count", type=int, default=0, help="stop after this many events (exit 1 if fewer came)")
    w.add_argument("--timeout", type=float, default=None, help="stop after this many seconds")
    w.add_argument("--kind", action="append", default=[], choices=EVENT_KINDS, help="only these kinds (repeat)")
    h = sub.add_parser("health", help="grpc.health.v1 status (exit 0 when SERVING): for readiness/liveness probes")
    h.add_argument("--service", default="", help="a service name (default: the daemon as a whole)")
    h.add_argument("--live", action="store_true", help="exit 0 for any answer (liveness: NOT_SERVING while starting or "
                   "draining is still alive)")
    h.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer")
    args = ap.parse_args(argv)
    if args.cmd == "health":
        return health(args.socket, args.service, args.live, args.timeout)
    try:
        if args.cmd == "watch":
            return watch(args.socket, args.kind, args.json, args.count, args.timeout)
        st = fetch(args.socket)
    except KeyboardInterrupt:
        return 130
    except grpc.RpcError as e:
        what = "cannot reach kvpushd" if e.code() is grpc.StatusCode.UNAVAILABLE else "kvpushd answered"
        print(f"kvpushctl: {what} at {args.socket}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    d = as_dict(st)
    if args.cmd == "status":
        print(json.dumps(d, indent=2) if args.json else render(st))
    elif args.cmd == "peers":
        print(json.dumps({"node_id": st.node_id, "peers": d["peers"]}, indent=2) if args.json else
              f"node {st.node_id}  peer address {st.peer_address}\n" + _peers_table(st))
    else:
        print(json.dumps({"node_id": st.node_id, "transfers": d["transfers"],
                          "recent_failures": d["recent_failures"]}, indent=2) if args.json else
              f"node {st.node_id}\ntransfers in flight:\n{_transfers_table(st)}\n\nrecent failures:\n"
              + _failures_table(st))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
