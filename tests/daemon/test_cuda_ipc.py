"""GPU KV path: CUDA IPC handles named by GPU UUID, opened by the daemon and registered as VRAM.

Needs a CUDA GPU and a CUDA build of torch; skipped otherwise (this machine has none).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)"),
]

WORKER = r"""
import sys, time, torch
from kvpushd_client import Expect, KVPushClient, Publish, Region, Role
from kvpushd_client.memory import cuda_memory
sock, role, peer = sys.argv[1], sys.argv[2], sys.argv[3]
R, NB, BL = 4, 64, 4096
kv = torch.zeros(R * NB * BL, dtype=torch.uint8, device="cuda")
if role == "prefill":
    g = torch.Generator(device="cuda").manual_seed(1)
    kv.copy_(torch.randint(0, 256, kv.shape, dtype=torch.uint8, device="cuda", generator=g))
else:
    kv.fill_(0xA5)
torch.cuda.synchronize()
c = KVPushClient(sock)
w = c.attach(role, Role.PRODUCER if role == "prefill" else Role.CONSUMER, 0, 1, [cuda_memory(kv)],
             [Region(0, i * NB * BL, NB, BL) for i in range(R)])
print(w.peer_address, flush=True)
if role == "prefill":
    w.send(Publish("gpu-1", (1, 2, 3)))
else:
    w.send(Expect("gpu-1", (10, 11, 12), peer, "prefill", 1))
done = w.next_completion(60)
print(done.kind.name, done.reason, flush=True)
v = kv.view(R, NB, BL)
blocks = [1, 2, 3] if role == "prefill" else [10, 11, 12]
print(",".join(str(int(x)) for x in v[:, blocks, :].sum(dim=(1, 2)).tolist()), flush=True)
if role == "decode":
    others = [b for b in range(NB) if b not in blocks]
    print(bool((v[:, others, :] == 0xA5).all().item()), flush=True)
w.detach()
"""


def test_cuda_ipc_push_between_gpu_workers(daemon_pair) -> None:
    p, d = daemon_pair
    pp = subprocess.Popen([sys.executable, "-c", WORKER, p.sock, "prefill", ""], stdout=subprocess.PIPE, text=True)
    assert pp.stdout is not None
    peer = pp.stdout.readline().strip()
    dp = subprocess.Popen([sys.executable, "-c", WORKER, d.sock, "decode", peer], stdout=subprocess.PIPE, text=True)
    out_p, _ = pp.communicate(timeout=120)
    out_d, _ = dp.communicate(timeout=120)
    lp, ld = out_p.splitlines(), out_d.splitlines()[1:]
    assert lp[0].startswith("FINISHED_SENDING"), out_p
    assert ld[0].startswith("FINISHED_RECEIVING"), out_d
    assert lp[1] == ld[1], "destination blocks differ from the source blocks"
    assert ld[2] == "True", "bytes outside the destination blocks changed"
    st = d.client.status()
    assert not st.transfers
