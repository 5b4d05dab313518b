"""``kvpushd demo``: resolve the options, run one mode, print the table or the JSON object."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from typing import Any

from .bytes_mode import _Demo
from .engine_demo import _EngineDemo
from .engine_proc import _raise_exit
from .options import resolve


def _engine_ok(out: dict[str, Any]) -> bool:
    if out.get("hosts") == "netns" and not all(out["in_namespace"].values()):
        return False
    return bool(out["failed"] == 0 and out["completed"] == out["requests"] and out["tokens_match"]
                and out["mismatched_bytes"] == 0 and out["kv_unverified"] == 0)


def _print_engine(out: dict[str, Any]) -> None:
    rows = [
        ("mode", f"engine: prefill TP{out['prefill_tp']} -> decode TP{out['decode_tp']}, {out['layers']} layers, "
                 f"{out['prefill_block_size']} -> {out['decode_block_size']} tokens per block"),
        ("requests", f"{out['requests']} ({out['prompt_tokens']} prompt tokens, {out['max_new_tokens']} new tokens); "
                     f"arrival orders {out['arrival_orders']}"),
        ("completed", f"{out['completed']}"),
        ("failed", f"{out['failed']}"),
        ("tokens", f"{'match' if out['tokens_match'] else 'MISMATCH'} the monolithic run "
                   f"({out['tokens_mismatched']} requests differ, {out['tokens_generated']} tokens generated)"),
        ("KV bytes moved", f"{out['bytes_moved']:,} (prefill daemon's bytes_written)"),
        ("KV bytes verified", f"{out['bytes_verified']:,}, mismatched {out['mismatched_bytes']:,} "
                              f"(outside requests {out['bytes_outside_requests']:,}, "
                              f"unverified requests {out['kv_unverified']})"),
        ("backend", f"NIXL {out['backend']}"),
        ("notifications", f"{out['notifications_received']} received by decode"),
        ("descriptors", f"{out['descriptors_requested']:,} requested -> {out['descriptors_posted']:,} posted"),
        ("latency", f"request dispatch -> decoded p50 {out['request_latency_ms']['p50']} ms, "
                    f"p99 {out['request_latency_ms']['p99']} ms; {out['wall_s']} s in all"),
    ]
    if out.get("hosts") == "netns":
        rows.append(("hosts", f"netns {out['namespaces']['prefill']} ({out['addresses']['prefill']}) -> "
                              f"{out['namespaces']['decode']} ({out['addresses']['decode']}) over a veth pair, "
                              f"{'FI_PROVIDER' if 'libfabric' in out else 'UCX_TLS'}=tcp; "
                              f"{out['veth_bytes']['decode_rx']:,} bytes received on decode's veth; "
                              f"in their namespaces: {all(out['in_namespace'].values())}"))
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    print("OK" if _engine_ok(out) else "FAILED")


def run_demo(args: argparse.Namespace) -> int:
    err = resolve(args)
    if err:
        print(f"kvpushd demo: {err}", file=sys.stderr)
        return 2
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_exit)  # a terminated demo still stops its daemons and engines
    if args.mode == "engine":
        lab = None
        if args.hosts == "netns":
            from ..netns import NetnsLab, available, sweep_stale

            ok, why = available()
            if not ok:
                print(f"kvpushd demo: --hosts netns needs root and iproute2 to create network namespaces and a "
                      f"veth pair ({why}); run it as root, or use --hosts local", file=sys.stderr)
                return 2
            sweep_stale()
            lab = NetnsLab(2, link="pair").setup()
        edemo = _EngineDemo(args, lab)
        try:
            out = edemo.run()
        except RuntimeError as e:
            print(f"kvpushd demo: {e}", file=sys.stderr)
            return 1
        finally:
            edemo.stop()
            if lab is not None:
                lab.teardown()
        if args.json:
            print(json.dumps(out))
        else:
            _print_engine(out)
        return 0 if _engine_ok(out) else 1
    demo = _Demo(args)
    try:
        out = demo.run()
    finally:
        demo.stop()
    if args.json:
        print(json.dumps(out))
    else:
        print(f"requests {out['requests']}: completed {out['completed']}, failed {out['failed']}")
        print(f"bytes moved {out['bytes_moved']:,}  verified {out['bytes_verified']:,}  "
              f"mismatched {out['mismatched_bytes']:,} (outside requests {out['bytes_outside_requests']:,})")
        print(f"arrival orders {out['arrival_orders']}; {out['throughput_gbps']} GB/s over {out['wall_s']} s; "
              f"second arrival -> received p50 {out['second_arrival_to_received_ms']['p50']} ms, "
              f"p99 {out['second_arrival_to_received_ms']['p99']} ms")
        print(f"descriptors {out['descriptors_requested']:,} requested -> {out['descriptors_posted']:,} "
              "after merging adjacent blocks")
    ok = out["failed"] == 0 and out["mismatched_bytes"] == 0 and out["completed"] == out["requests"]
    return 0 if ok else 1
