"""A decode daemon that stalls (SIGSTOP) during a large WRITE: the prefill daemon declares it gone at
its liveness bound (transfer.peer_timeout_s, 10 s by default, seen within one heartbeat interval),
cancels the WRITE in flight, fails the publish and releases its blocks then, not at
transfer.write_timeout_s (60 s) or when the stall ends. Real daemons, real NIXL."""

from __future__ import annotations

import signal
import time

from kvpushd_client import CompletionKind, Expect, Publish, Role
from support import make_kv, wait_for
from support.bystander import Bystander

LIVENESS_BOUND_S = 15.0  # docs/security.md: peer_timeout_s (10 s) + heartbeat and housekeeping slack


def test_a_stalled_decode_daemon_releases_prefill_blocks_at_the_liveness_bound(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    p, d = daemon_factory.pair()
    other = daemon_factory("dnode2")  # a decode daemon that keeps answering: its transfer goes on meanwhile
    # 256 MiB in one WRITE (4 regions x 64 blocks of 1 MiB), as a long prompt's KV would be
    src = make_kv("kvp-stall-src", regions=4, num_blocks=64, block_len=1 << 20)
    dst = make_kv("kvp-stall-dst", regions=4, num_blocks=64, block_len=1 << 20, fill="poison")
    dst2 = make_kv("kvp-stall-dst2", regions=4, num_blocks=8, block_len=1 << 20, fill="poison")
    stopped = False
    try:
        pw = p.client.attach("prefill", Role.PRODUCER, 0, 1, [src.buf.memory], src.region_list)
        dw = d.client.attach("decode", Role.CONSUMER, 0, 1, [dst.buf.memory], dst.region_list)
        ow = other.client.attach("decode", Role.CONSUMER, 0, 1, [dst2.buf.memory], dst2.region_list)
        dw.send(Expect("stalled", tuple(range(64)), p.peer_address, "prefill", 1))
        assert wait_for(lambda: any(t.side == "send" for t in p.client.status().transfers))
        with Bystander(p, pw, ow, src, dst2, target=p, blocks=(5, 60)) as b:
            d.proc.send_signal(signal.SIGSTOP)
            stopped = True
            t0 = time.monotonic()
            pw.send(Publish("stalled", tuple(range(64))))
            c = pw.next_completion(60)
            took = time.monotonic() - t0
        print(b.line("a decode daemon stalled during a 256 MiB WRITE"))
        b.check()
        assert c is not None and c.transfer_id == "stalled", c
        print(f"stalled decode daemon: publish ended {c.kind.name} {c.code} after {took:.1f} s: {c.reason}")
        assert c.kind is CompletionKind.FAILED and c.code == "PEER_UNREACHABLE", c
        assert took < LIVENESS_BOUND_S, took
        assert wait_for(lambda: not p.client.status().transfers, timeout=5)  # its blocks are released
        d.proc.send_signal(signal.SIGCONT)
        stopped = False
        # the decode side learns it failed; then both sides move exact bytes again
        c = dw.next_completion(60)
        assert c is not None and c.transfer_id == "stalled" and c.kind is CompletionKind.FAILED, c
        dw.send(Expect("after", (1, 2), p.peer_address, "prefill", 1))
        pw.send(Publish("after", (3, 4)))
        assert dw.next_completion(60).kind is CompletionKind.FINISHED_RECEIVING
        assert pw.next_completion(60).kind is CompletionKind.FINISHED_SENDING
        assert (dst.arr[:, [1, 2]] == src.arr[:, [3, 4]]).all()
    finally:
        if stopped:
            d.proc.send_signal(signal.SIGCONT)
        src.close()
        dst.close()
        dst2.close()
