"""A batch of registrations on the peer stream that breaks: every registration in it ends once, within
its bound."""

from __future__ import annotations

import os
import signal

from kvpushd_client import CompletionKind, Role
from support import make_kv, start_daemon

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
            dw.expect_nowait(f"s{i}", [i], p.peer_address, "prefill", 1)
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
