"""kvpushctl: what a daemon's status API says, as tables or JSON."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from kvpushd_client.proto.v1 import common_pb2, status_pb2, status_pb2_grpc

from .config import default_socket_path


def fetch(socket: str, timeout: float = 5.0) -> status_pb2.NodeStatus:
    with grpc.insecure_channel(f"unix:{socket}") as ch:
        return status_pb2_grpc.StatusServiceStub(ch).GetStatus(status_pb2.GetStatusRequest(), timeout=timeout)


def _table(rows: list[list[Any]], header: list[str]) -> str:
    if not rows:
        return "  (none)"
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=False)]
    fmt = "  " + "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header)] + [fmt.format(*map(str, r)) for r in rows])


def render(st: status_pb2.NodeStatus) -> str:
    c = st.counters
    out = [
        f"node {st.node_id}  kvpushd {st.version}  up {st.uptime_s:.0f}s  peer address {st.peer_address}",
        f"socket {st.worker_socket}  backends {','.join(st.backends)}",
        f"transfers finished {c.transfers_finished}  failed {c.transfers_failed}  bytes written "
        f"{c.bytes_written}  WRITEs {c.writes_posted}  notifications {c.notifications_received} "
        f"(stray {c.stray_notifications})  descriptors {c.descriptors_requested} -> {c.descriptors_posted}",
        "", "workers:",
        _table([[w.worker_id, w.engine_id, common_pb2.Role.Name(w.role).removeprefix("ROLE_").lower(),
                 f"{w.tp_rank}/{w.tp_size}", w.pp_rank, w.memory_kind, w.num_regions, w.registered_bytes,
                 f"{w.attached_s:.0f}s"] for w in st.workers],
               ["WORKER", "ENGINE", "ROLE", "TP", "PP", "MEM", "REGIONS", "BYTES", "ATTACHED"]),
        "", "peers:",
        _table([[p.address, p.node_id, p.state, p.last_error] for p in st.peers],
               ["ADDRESS", "NODE", "STATE", "LAST ERROR"]),
        "", "transfers in flight:",
        _table([[t.transfer_id, t.side, t.state, f"{t.age_s:.3f}s", t.num_blocks, t.waiting_for]
                for t in st.transfers], ["TRANSFER", "SIDE", "STATE", "AGE", "BLOCKS", "WAITING FOR"]),
    ]
    return "\n".join(out)


def as_dict(st: status_pb2.NodeStatus) -> dict[str, Any]:
    return MessageToDict(st, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvpushctl", description="inspect a kvpushd daemon")
    ap.add_argument("--socket", default=default_socket_path(), help="daemon's worker socket")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("status", help="node, workers, peers, transfers in flight")
    s.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        st = fetch(args.socket)
    except grpc.RpcError as e:
        print(f"kvpushctl: cannot reach kvpushd at {args.socket}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    print(json.dumps(as_dict(st), indent=2) if args.json else render(st))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
