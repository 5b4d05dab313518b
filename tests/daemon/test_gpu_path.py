"""The GPU path end to end: KV in GPU memory of worker processes, two real daemons, NIXL VRAM -> VRAM.

Each worker is its own process with one CUDA tensor (as a vLLM worker), handed over by CUDA IPC
(kvpushd_client.memory.cuda_memory, sentinel included). After the transfer every worker dumps its
whole tensor, and the test compares bit for bit: the destination blocks equal the source blocks, and
every other byte still holds what it held (the sentinel's 16 bytes too). Memory from CUDA virtual
memory allocators (expandable segments, cuMemCreate as vLLM's cumem allocator makes it) is refused
with the setting to change, and the daemon goes on.

Needs a CUDA GPU and a CUDA build of torch; skipped otherwise (scripts/gpu_check.sh runs these).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)"),
]

POISON = 0xA5
R, NB, HALF = 4, 64, 2048

WORKER = r"""
import json, sys
import numpy as np, torch
from kvpushd_client import Expect, KVPushClient, Publish, Region, Role, TransferMode
from kvpushd_client.memory import cuda_memory
a = json.loads(sys.argv[1])
R, NB, BL = a["R"], a["NB"], a["BL"]
if a["fill"] == "poison":
    kv = torch.full((R * NB * BL,), 0xA5, dtype=torch.uint8, device="cuda")
else:
    g = torch.Generator(device="cuda").manual_seed(a["fill"])
    kv = torch.randint(0, 256, (R * NB * BL,), dtype=torch.uint8, device="cuda", generator=g)
torch.cuda.synchronize()
np.save(a["out"] + ".before.npy", kv.cpu().numpy())
c = KVPushClient(a["sock"])
prod = a["role"] == "prefill"
w = c.attach(a["role"], Role.PRODUCER if prod else Role.CONSUMER, a["rank"], a["tp"], [cuda_memory(kv)],
             [Region(0, i * NB * BL, NB, BL) for i in range(R)])
if prod:
    w.send(Publish(a["tid"], tuple(a["blocks"])))
else:
    w.send(Expect(a["tid"], tuple(a["blocks"]), a["peer"], "prefill", a["producers"],
                  transfer_mode=TransferMode.parse(a["mode"])))
done = w.next_completion(120)
torch.cuda.synchronize()
np.save(a["out"] + ".after.npy", kv.cpu().numpy())
print(json.dumps({"kind": done.kind.name, "reason": done.reason}), flush=True)
w.detach()
"""


def _run(workers: list[dict]) -> list[dict]:
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, json.dumps(w)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for w in workers]
    outs = []
    for pr in procs:
        out, err = pr.communicate(timeout=180)
        assert pr.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


def _arr(w: dict, when: str) -> np.ndarray:
    return np.load(w["out"] + f".{when}.npy").reshape(w["R"], w["NB"], w["BL"])


def _worker(tmp: Path, sock: str, role: str, rank: int, tp: int, bl: int, blocks: list[int], tid: str,
            peer: str = "", producers: int = 1, mode: str = "push") -> dict:
    return {"sock": sock, "role": role, "rank": rank, "tp": tp, "R": R, "NB": NB, "BL": bl, "blocks": blocks,
            "tid": tid, "peer": peer, "producers": producers, "mode": mode,
            "fill": "poison" if role == "decode" else 1 + rank, "out": str(tmp / f"{role}{rank}")}


def _untouched(w: dict) -> None:
    after, before = _arr(w, "after"), _arr(w, "before")
    others = [b for b in range(NB) if b not in w["blocks"]]
    assert np.array_equal(after[:, others, :], before[:, others, :]), f"{w['role']}{w['rank']}: other bytes changed"


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_gpu_to_gpu_bit_exact(daemon_pair, tmp_path: Path, mode: str) -> None:
    p, d = daemon_pair
    pw = _worker(tmp_path, p.sock, "prefill", 0, 1, 2 * HALF, [1, 2, 3, 40], f"gpu-{mode}")
    dw = _worker(tmp_path, d.sock, "decode", 0, 1, 2 * HALF, [10, 11, 12, 0], f"gpu-{mode}", p.peer_address,
                 mode=mode)
    outs = _run([pw, dw])
    assert outs[0]["kind"] == "FINISHED_SENDING", outs
    assert outs[1]["kind"] == "FINISHED_RECEIVING", outs
    assert np.array_equal(_arr(dw, "after")[:, dw["blocks"], :], _arr(pw, "before")[:, pw["blocks"], :])
    _untouched(dw)
    assert np.array_equal(_arr(pw, "after"), _arr(pw, "before")), "the source changed"
    st = d.client.status()
    assert not st.workers and not st.transfers


@pytest.mark.parametrize(("ptp", "dtp"), [(2, 1), (1, 2)])
def test_gpu_heterogeneous_tp(daemon_pair, tmp_path: Path, ptp: int, dtp: int) -> None:
    """Two worker processes on one side, one on the other, all on the one GPU (HND: heads split)."""
    p, d = daemon_pair
    tid = f"gpu-tp{ptp}{dtp}"
    src_blocks = [3, 4, 9]
    dst_blocks = [[20, 21, 5], [30, 0, 12]][:dtp]
    pws = [_worker(tmp_path, p.sock, "prefill", r, ptp, 2 * HALF // ptp, src_blocks, tid) for r in range(ptp)]
    dws = [_worker(tmp_path, d.sock, "decode", r, dtp, 2 * HALF // dtp, dst_blocks[r], tid, p.peer_address,
                   producers=1 if dtp > ptp else ptp) for r in range(dtp)]
    outs = _run([*pws, *dws])
    assert all(o["kind"] == "FINISHED_SENDING" for o in outs[:ptp]), outs
    assert all(o["kind"] == "FINISHED_RECEIVING" for o in outs[ptp:]), outs
    if ptp == 2:
        got = _arr(dws[0], "after")[:, dst_blocks[0], :]
        for r in range(2):
            assert np.array_equal(got[:, :, r * HALF:(r + 1) * HALF], _arr(pws[r], "before")[:, src_blocks, :])
    else:
        src = _arr(pws[0], "before")[:, src_blocks, :]
        for r in range(2):
            assert np.array_equal(_arr(dws[r], "after")[:, dst_blocks[r], :], src[:, :, r * HALF:(r + 1) * HALF])
    for w in dws:
        _untouched(w)


VMM_WORKER = r"""
import json, os, sys, torch
from kvpushd_client import KVPushClient, KVPushError, CudaMemory, Region, Role
from kvpushd_client.cuda import CudaMemoryError, driver, check_shareable
from kvpushd_client.memory import cuda_memory
out = {}
# expandable segments (this process runs with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)
kv = torch.zeros(64 << 20, dtype=torch.uint8, device="cuda")
try:
    cuda_memory(kv)
    out["expandable"] = "accepted"
except CudaMemoryError as e:
    out["expandable"] = str(e)
# what the daemon says to a handle torch made of it, had a client sent it anyway
try:
    dev, handle, size, off, *_ = kv.untyped_storage()._share_cuda_()
    mem = CudaMemory(str(torch.cuda.get_device_properties(dev).uuid), bytes(handle), int(size), int(off))
    KVPushClient(sys.argv[1]).attach("vmm", Role.PRODUCER, 0, 1, [mem], [Region(0, 0, 4, 4096)])
    out["daemon"] = "accepted"
except KVPushError as e:
    out["daemon"] = f"{e.code}: {e.message}"
except RuntimeError as e:
    out["daemon"] = f"torch cannot share it: {e}"
# cuMemCreate with no shareable handle type, as vLLM's cumem allocator does
import ctypes
lib = ctypes.CDLL("libcuda.so.1")
C = ctypes
class Loc(C.Structure): _fields_ = [("type", C.c_int), ("id", C.c_int)]
class Flags(C.Structure):
    _fields_ = [("compression", C.c_ubyte), ("rdma", C.c_ubyte), ("usage", C.c_ushort), ("reserved", C.c_ubyte * 4)]
class Prop(C.Structure):
    _fields_ = [("type", C.c_int), ("requestedHandleTypes", C.c_int), ("location", Loc),
                ("win32HandleMetaData", C.c_void_p), ("allocFlags", Flags)]
class Access(C.Structure): _fields_ = [("location", Loc), ("flags", C.c_int)]
prop = Prop(); prop.type = 1; prop.location = Loc(1, torch.cuda.current_device())  # PINNED, DEVICE; handles: NONE
gran = C.c_size_t(); assert lib.cuMemGetAllocationGranularity(C.byref(gran), C.byref(prop), 0) == 0
size = gran.value * 4
h = C.c_uint64(); ptr = C.c_uint64()
assert lib.cuMemCreate(C.byref(h), C.c_size_t(size), C.byref(prop), C.c_uint64(0)) == 0
assert lib.cuMemAddressReserve(C.byref(ptr), C.c_size_t(size), C.c_size_t(0), C.c_uint64(0), C.c_uint64(0)) == 0
assert lib.cuMemMap(ptr, C.c_size_t(size), C.c_size_t(0), h, C.c_uint64(0)) == 0
acc = Access(Loc(1, torch.cuda.current_device()), 3)
assert lib.cuMemSetAccess(ptr, C.c_size_t(size), C.byref(acc), C.c_size_t(1)) == 0
info = driver().pointer(ptr.value)
out["cumem_legacy_ipc"] = info.legacy_ipc_capable
allowed = C.c_uint64(0)  # CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES: what it could be exported as
out["cumem_allowed_rc"] = lib.cuPointerGetAttribute(C.byref(allowed), 14, ptr)
out["cumem_allowed_handle_types"] = allowed.value
fd = C.c_int(-1)  # the export kvpushd would need: a POSIX fd to pass over the unix socket
out["cumem_export_rc"] = lib.cuMemExportToShareableHandle(C.byref(fd), h, C.c_int(1), C.c_uint64(0))
try:
    check_shareable(info.legacy_ipc_capable, None, "cudaIpcGetMemHandle does not apply")
    out["cumem"] = "accepted"
except CudaMemoryError as e:
    out["cumem"] = str(e)
print(json.dumps(out), flush=True)
"""


def test_gpu_vmm_memory_refused_with_the_setting_to_change(daemon_pair) -> None:
    p, _ = daemon_pair
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    r = subprocess.run([sys.executable, "-c", VMM_WORKER, p.sock], capture_output=True, text=True, env=env,
                       timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert "expandable_segments" in out["expandable"], out
    assert out["daemon"] != "accepted", out
    assert "expandable_segments" in out["daemon"] or "torch cannot share" in out["daemon"], out
    assert out["cumem_legacy_ipc"] is False, out
    # why kvpushd refuses rather than exports: created with no shareable handle type, the driver refuses
    assert out["cumem_export_rc"] != 0 and out["cumem_allowed_handle_types"] == 0, out
    assert "--enable-sleep-mode" in out["cumem"], out
    assert not p.client.status().workers  # the daemon goes on, nothing attached


def test_gpu_caching_allocator_memory_is_ipc_capable() -> None:
    from kvpushd_client.cuda import driver

    drv = driver()
    assert drv is not None
    kv = torch.zeros(8 << 20, dtype=torch.uint8, device="cuda")
    info = drv.pointer(int(kv.data_ptr()))
    assert info.legacy_ipc_capable and info.device_ordinal == kv.device.index
    assert info.range_start <= kv.data_ptr() and kv.data_ptr() + kv.nbytes <= info.range_start + info.range_size
