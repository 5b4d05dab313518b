"""Oversized junk on the peer port: every junk call gets a clear status, the prefill daemon's RSS stays
within 100 MiB of its baseline during and after the flood, and real transfers (NIXL WRITEs, bit-exact)
keep completing alongside it. Loopback only; a bounded number of calls."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
from kvpushd_client import CompletionKind, Expect, Publish
from support import attach_pair, rss, wait_for

# rounds of oversized junk: just under the peer port's former 64 MiB limit (then read whole: RSS rose by
# hundreds of MiB) and far over it; both over today's bound (8 MiB at the default max_blocks_per_request)
JUNK_MIB = [int(x) for x in os.environ.get("KVPUSHD_JUNK_MIB", "60,128,60,128,60,128").split(",")]
JUNK_CALLS = len(JUNK_MIB)                                         # rounds
JUNK_PARALLEL = 4                                                  # calls in flight at once per round
RSS_SLACK = 100 << 20
CLIENT_OPTS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


def junk(mib: int) -> bytes:
    return b"\xff" * (mib << 20)  # not even protobuf


def flood(address: str, codes: list[grpc.StatusCode], stop: threading.Event) -> None:
    """JUNK_CALLS rounds of JUNK_PARALLEL oversized Handshake calls (raw bytes: not even protobuf)."""
    with grpc.insecure_channel(address, options=CLIENT_OPTS) as ch:
        call = ch.unary_unary("/kvpushd.v1.PeerService/Handshake",
                              request_serializer=lambda b: b, response_deserializer=lambda b: b)

        def one(msg: bytes) -> grpc.StatusCode:
            try:
                call(msg, timeout=60)
            except grpc.RpcError as e:
                return e.code()  # type: ignore[no-any-return]
            return grpc.StatusCode.OK

        with ThreadPoolExecutor(JUNK_PARALLEL) as ex:
            for mib in JUNK_MIB:
                msg = junk(mib)
                codes.extend(ex.map(one, [msg] * JUNK_PARALLEL))
                del msg
    stop.set()


def transfer(p, d, pw, dw, src, dst, i: int) -> None:  # type: ignore[no-untyped-def]
    """One transfer of four blocks, checked byte for byte (fresh destination blocks each time)."""
    a = (4 * i) % 64
    dst.arr[:, a:a + 4] = 0xAB
    dw.send_nowait(Expect(f"legit-{i}", tuple(range(a, a + 4)), p.peer_address, "prefill", 1))
    pw.send_nowait(Publish(f"legit-{i}", tuple(range(a, a + 4))))
    assert dw.flush(30) and pw.flush(30)
    got: list = []
    assert wait_for(lambda: got.extend(dw.completions()) or got, 30), f"transfer {i} never ended"
    assert [c.kind for c in got] == [CompletionKind.FINISHED_RECEIVING], got
    sent: list = []
    assert wait_for(lambda: sent.extend(pw.completions()) or sent, 30)
    assert (dst.arr[:, a:a + 4] == src.arr[:, a:a + 4]).all(), f"transfer {i}: bytes differ"


def test_junk_flood_keeps_rss_and_transfers(daemon_pair, kv_pair) -> None:  # type: ignore[no-untyped-def]
    p, d = daemon_pair
    src, dst = kv_pair
    pw, dw = attach_pair(p, d, src, dst)
    for i in range(3):  # warm: the peer channel, the NIXL agents, the allocator
        transfer(p, d, pw, dw, src, dst, i)
    base = rss(p.pid)
    codes: list[grpc.StatusCode] = []
    stop = threading.Event()
    peak, done = base, 0
    t = threading.Thread(target=flood, args=(p.peer_address, codes, stop), daemon=True)
    t.start()
    while not stop.is_set():
        transfer(p, d, pw, dw, src, dst, 3 + done)
        done += 1
        peak = max(peak, rss(p.pid))
    t.join(120)
    after = [rss(p.pid)]
    for i in range(3):
        transfer(p, d, pw, dw, src, dst, 1000 + i)
        after.append(rss(p.pid))
    print(f"junk flood: {JUNK_CALLS}x{JUNK_PARALLEL} calls of {JUNK_MIB} MiB; rss base "
          f"{base >> 20} MiB, peak {peak >> 20} MiB, after {max(after) >> 20} MiB; {done} transfers during; "
          f"codes {sorted({c.name for c in codes})}")
    assert len(codes) == JUNK_CALLS * JUNK_PARALLEL
    assert set(codes) == {grpc.StatusCode.RESOURCE_EXHAUSTED}, codes  # refused for its size, not parsed
    assert done >= 1, "no transfer completed during the flood"
    assert peak - base < RSS_SLACK, f"RSS rose {(peak - base) >> 20} MiB during the flood"
    assert max(after) - base < RSS_SLACK, f"RSS {(max(after) - base) >> 20} MiB above baseline after the flood"
    assert p.proc.poll() is None
