"""The GPU doorbell on a GPU: the progress word moves when the stream gets there, not when the engine
thread queues the ring, and a progressive push between two GPU workers carries only computed KV.

The "forward" is a kernel that keeps the GPU busy (torch.cuda._sleep) before each layer's KV write, so
the engine thread has queued every layer and rung every ring long before the GPU computes layer 1. The
daemon's own reader (kvpushd.memory.doorbell) must not see a layer before a CUDA event recorded right
after that layer's writes has completed; the host doorbell, rung the same way, claims every layer at
once (the control: why GPU KV needs this doorbell). End to end, a WRITE posted before its layer group
was computed would carry the poison the source held before, so the bytes checked at the end say none
went early.

Needs a CUDA GPU and a CUDA build of torch; skipped otherwise (scripts/gpu_check.sh runs these; the
same logic runs without a GPU against a stand-in driver in test_gpu_doorbell_cpu.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support import wait_for

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)"),
]

LAYERS = 4
LAYER_MS = 150  # GPU time per layer before its KV write
POISON = 0xA5


def _cycles_per_ms() -> float:
    """torch.cuda._sleep spins for a number of GPU clock cycles: how many make a millisecond here."""
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    torch.cuda._sleep(20_000_000)
    e.record()
    e.synchronize()
    return 20_000_000 / s.elapsed_time(e)


def _done_soon(ev: Any) -> bool:
    """The event has completed (a few ms of grace for the two writes to show: far below LAYER_MS)."""
    deadline = time.monotonic() + 0.02
    while not ev.query():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


@pytest.mark.parametrize("kind", ["auto", "stream_copy", "host"])
def test_the_word_moves_only_when_the_stream_gets_there(kind: str, record_property: Any) -> None:
    from kvpushd_client.doorbell import Doorbell
    from kvpushd_client.gpu_doorbell import GpuDoorbell, make_doorbell

    from kvpushd.memory.doorbell import Doorbell as Reader

    cyc = _cycles_per_ms()
    bell = (Doorbell() if kind == "host" else make_doorbell(kv_on_cuda=True) if kind == "auto"
            else GpuDoorbell(path=kind))
    record_property("path", getattr(bell, "path", "host store"))
    r = Reader(os.open(bell.proc_path, os.O_RDONLY | os.O_CLOEXEC), bell.name)
    kv = torch.zeros(LAYERS, 1 << 20, dtype=torch.float32, device="cuda")
    kv[0].fill_(0.0)  # every kernel used below loaded before the clock starts (lazy module loading)
    torch.cuda.Event().record()
    torch.cuda.synchronize()
    seen: list[int] = []  # the layer counts the reader showed, in order
    try:
        seq = bell.step()
        reached = []
        for layer in range(LAYERS):
            torch.cuda._sleep(int(cyc * LAYER_MS))  # the layer's compute
            kv[layer].fill_(layer + 1)  # its KV write
            ev = torch.cuda.Event()
            ev.record()  # the stream is past the layer's writes here
            reached.append(ev)
            bell.layer_done(layer + 1)
        first = r.ready(seq, LAYERS)
        assert not reached[0].query(), "the GPU finished layer 1 before the check: the delay is too short"
        if kind == "host":
            assert first == LAYERS  # the CPU's stores ran ahead of the GPU: every layer claimed, none computed
            return
        assert first == 0
        deadline = time.monotonic() + 30
        while True:
            n = r.ready(seq, LAYERS)  # the word first, then the events: a layer seen must have been reached
            for k in range(n):
                assert _done_soon(reached[k]), f"layer {k + 1} claimed before the stream got there"
            if not seen or seen[-1] != n:
                seen.append(n)
            if n == LAYERS:
                break
            assert time.monotonic() < deadline, seen
            time.sleep(0.002)
        assert len(seen) >= 3, seen  # it went layer by layer, as the GPU went
        bell.seal()
        nxt = bell.step()  # queued behind nothing: lands at once
        torch.cuda.synchronize()
        assert r.complete(seq) and r.ready(nxt, LAYERS) == 0
        assert torch.equal(kv[:, 0].cpu(), torch.arange(1, LAYERS + 1, dtype=torch.float32))
    finally:
        record_property("seen", seen)
        torch.cuda.synchronize()
        r.close()
        bell.close()


WORKER = r"""
import json, os, sys, time
import numpy as np, torch
from kvpushd_client import Expect, KVPushClient, Publish, Region, Role
from kvpushd_client.gpu_doorbell import make_doorbell
from kvpushd_client.memory import cuda_memory
a = json.loads(sys.argv[1])
R, NB, BL, L = a["R"], a["NB"], a["BL"], a["L"]
kv = torch.full((R * NB * BL,), 0xA5, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
c = KVPushClient(a["sock"])
regions = [Region(0, i * NB * BL, NB, BL) for i in range(R)]
out = {}
if a["role"] == "prefill":
    want = torch.randint(0, 256, (R, NB, BL), dtype=torch.uint8, device="cuda",
                         generator=torch.Generator(device="cuda").manual_seed(11))
    torch.cuda._sleep(1000); torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record(); torch.cuda._sleep(20_000_000); e.record(); e.synchronize()
    cyc = 20_000_000 / s.elapsed_time(e)
    bell = make_doorbell(kv_on_cuda=True)
    out["path"] = bell.path
    w = c.attach("prefill", Role.PRODUCER, 0, 1, [cuda_memory(kv)], regions, doorbell=bell)
    deadline = time.monotonic() + 120
    while not os.path.exists(a["go"]) and time.monotonic() < deadline:
        time.sleep(0.01)
    v = kv.view(R, NB, BL)
    per = R // L
    b0 = a["blocks"][0]
    v[0:per, b0].copy_(v[0:per, b0]); torch.cuda.synchronize()  # the copy kernel loaded before the clock starts
    seq = bell.step()
    w.send(Publish(a["tid"], tuple(a["blocks"]), step=seq, layers=L))  # declared before the forward
    t0 = time.monotonic()
    for g in range(L):
        torch.cuda._sleep(int(cyc * a["layer_ms"]))  # the layer group's compute
        for b in a["blocks"]:
            v[g * per:(g + 1) * per, b].copy_(want[g * per:(g + 1) * per, b])  # its KV
        bell.layer_done(g + 1)
    out["enqueue_s"] = time.monotonic() - t0
    bell.seal()
    done = w.next_completion(120)
    torch.cuda.synchronize()
    np.save(a["out"] + ".want.npy", want.cpu().numpy())
else:
    bell = None
    w = c.attach("decode", Role.CONSUMER, 0, 1, [cuda_memory(kv)], regions)
    w.send(Expect(a["tid"], tuple(a["blocks"]), a["peer"], "prefill", 1))
    done = w.next_completion(120)
torch.cuda.synchronize()
np.save(a["out"] + ".after.npy", kv.cpu().numpy())
out.update(kind=done.kind.name, reason=done.reason)
w.detach()
if bell is not None:
    bell.close()
print(json.dumps(out), flush=True)
"""


def test_gpu_progressive_push_carries_only_computed_layers(daemon_pair, tmp_path: Path,
                                                           record_property: Any) -> None:
    p, d = daemon_pair
    R, NB, BL = 8, 32, 8192
    src, dst = [3, 4, 9, 20], [10, 11, 0, 31]
    go = tmp_path / "go"
    base = {"R": R, "NB": NB, "BL": BL, "L": LAYERS, "tid": "gpu-bell", "layer_ms": 250, "go": str(go)}
    pw = {**base, "sock": p.sock, "role": "prefill", "blocks": src, "out": str(tmp_path / "prefill")}
    dw = {**base, "sock": d.sock, "role": "decode", "blocks": dst, "peer": p.peer_address,
          "out": str(tmp_path / "decode")}
    notifs0 = d.client.status().counters.notifications_received
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, json.dumps(w)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for w in (pw, dw)]
    try:
        # the decode side expects first, so each layer group goes as the prefill GPU computes it
        assert wait_for(lambda: bool(d.client.status().transfers), timeout=120)
        go.touch()
        outs = []
        for pr in procs:
            out, err = pr.communicate(timeout=180)
            assert pr.returncode == 0, err[-3000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for pr in procs:
            if pr.poll() is None:
                pr.kill()
    record_property("prefill", outs[0])
    assert outs[0]["kind"] == "FINISHED_SENDING", outs
    assert outs[1]["kind"] == "FINISHED_RECEIVING", outs
    # the engine thread queued every layer long before the GPU computed them (LAYERS x 250 ms)
    assert outs[0]["enqueue_s"] < 0.5, outs
    want = np.load(str(tmp_path / "prefill.want.npy"))
    after = np.load(str(tmp_path / "decode.after.npy")).reshape(R, NB, BL)
    assert np.array_equal(after[:, dst, :], want[:, src, :]), "a layer group went before the GPU computed it"
    others = [b for b in range(NB) if b not in dst]
    assert (after[:, others, :] == POISON).all(), "bytes outside the destination blocks changed"
    got = d.client.status().counters.notifications_received - notifs0
    record_property("notifications", got)
    assert 2 <= got <= LAYERS, got  # written group by group as the doorbell went, not once at the end
    assert wait_for(lambda: not p.client.status().transfers and not d.client.status().transfers)
