"""A batch of registrations on the peer stream that breaks: every registration in it ends once, within
its bound; a burst larger than the message size goes out in several batches."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

from kvpushd_client import CompletionKind, Expect, Role
from kvpushd_client.proto.v1 import peer_pb2
from support import make_kv, start_daemon

from kvpushd.config import DEFAULT_MAX_MESSAGE_BYTES
from kvpushd.core.errors import PeerUnreachable, ResourceExhausted
from kvpushd.runtime.channel import PeerChannel

CFG = "[transfer]\nexpect_timeout_s = 60.0\npublish_timeout_s = 60.0\n"


def test_a_batch_to_a_stalled_prefill_daemon_fails_each_registration_once(workdir) -> None:  # type: ignore[no-untyped-def]
    p = start_daemon(workdir, "pnode", CFG)
    d = start_daemon(workdir, "dnode", "connect_timeout_s = 2.0\nrpc_timeout_s = 2.0\n" + CFG)
    src, dst = make_kv("kvpushd-test-bsrc"), make_kv("kvpushd-test-bdst", fill="poison")
    stopped = False
    try:
        p.client.attach("prefill", Role.PRODUCER, 0, 1, [src.buf.memory], src.region_list)
        dw = d.client.attach("decode", Role.CONSUMER, 0, 1, [dst.buf.memory], dst.region_list)
        os.kill(p.proc.pid, signal.SIGSTOP)  # it stops answering: the batch's call cannot complete
        stopped = True
        for i in range(8):
            dw.send_nowait(Expect(f"s{i}", (i,), p.peer_address, "prefill", 1))
        dw.step()
        got = []
        while len(got) < 8:
            c = dw.next_completion(60)
            assert c is not None, got
            got.append(c)
        assert sorted(c.transfer_id for c in got) == [f"s{i}" for i in range(8)]  # each once
        assert {(c.kind, c.code) for c in got} == {(CompletionKind.FAILED, "PEER_UNREACHABLE")}, got
        assert all(c.block_ids == (int(c.transfer_id[1:]),) for c in got)
        assert dw.next_completion(1) is None
        assert not d.client.status().transfers
    finally:
        if stopped:
            os.kill(p.proc.pid, signal.SIGCONT)
        for x in (p, d):
            x.client.close()
            x.stop()
        src.close()
        dst.close()


class _RecordingCall:
    """A Channel call that takes every write and never answers (the writer's side alone)."""

    def __init__(self) -> None:
        self.sizes: list[tuple[int, int]] = []  # (items, encoded bytes) per PeerBatch written

    async def write(self, msg: Any) -> None:
        self.sizes.append((len(msg.items), msg.ByteSize()))

    async def read(self) -> Any:
        await asyncio.Event().wait()

    def cancel(self) -> None:
        pass


def test_a_burst_of_large_registrations_is_split_below_the_message_size() -> None:
    """3,000 registrations of 1,024 blocks queued in one loop turn (a 16k-token request each, ~12 MB in
    all) go out in PeerBatches of at most max_message_bytes; one item larger than that fails alone."""

    async def main() -> tuple[list[tuple[int, int]], BaseException | None]:
        call = _RecordingCall()
        ch = PeerChannel("peer:1", call, max_items=10_000, stall_s=5.0,
                         on_broken=lambda why: PeerUnreachable(str(why)), max_bytes=DEFAULT_MAX_MESSAGE_BYTES)
        blocks = list(range(100_000, 101_024))  # 3-byte varints
        futs = [ch.submit("register", peer_pb2.RegisterRequest(transfer_id=f"t{i}", registration_id=i,
                                                                block_ids=blocks)) for i in range(3000)]
        huge = ch.submit("register", peer_pb2.RegisterRequest(transfer_id="huge",
                                                              block_ids=range(3_000_000, 6_000_000)))
        for _ in range(50):
            await asyncio.sleep(0)
        await ch.aclose()
        for f in futs:
            f.cancel()
        return call.sizes, huge.exception()

    sizes, err = asyncio.run(main())
    assert sum(n for n, _ in sizes) == 3000
    assert len(sizes) >= 2 and sum(b for _, b in sizes) > DEFAULT_MAX_MESSAGE_BYTES
    assert all(b <= DEFAULT_MAX_MESSAGE_BYTES for _, b in sizes), sizes
    assert isinstance(err, ResourceExhausted) and "max_message_bytes" in str(err)
