"""VMM memory on a GPU (``scripts/gpu_check.sh run``), with libcuda, nixl and two real daemons only (no
torch, no vLLM): a worker process creates ``cuMemCreate`` chunks with the POSIX-fd handle type in ranges
it reserved (as vLLM 0.34's extensible KV cache does under ``EXPORTS_FD``), exports them
(``kvpushd_client.vmm``: ``cuMemGetAddressRange``, ``cuMemRetainAllocationHandle``,
``cuMemExportToShareableHandle``) and hands them to the daemons, which import, map, check the sentinel
and register them (``kvpushd/memory/vmm.py``). Then, every byte checked:

1. a push between the prefill range (attached to one daemon) and the decode range (the other), each
   one chunk: the destination blocks equal the source blocks, every other byte (the sentinel's too)
   unchanged;
2. a block past the prefill worker's mapped chunks is refused (INVALID_ARGUMENT), nothing written;
3. growth by one chunk: the decode range maps one more chunk; the growth Attach
   (``KVPushClient.extend``) is answered as the daemon answers it today (FAILED_PRECONDITION: the NIXL
   side of growth is not built), then detach and attach with both chunks, and a push into the new chunk;
4. unregister/restore (sleep and wake as vLLM 0.34 does it): detach, unmap and release the decode
   chunks, create and map new ones at the same addresses, attach again, push;
5. the vLLM connector's path (with torch): the decode range as a torch tensor goes through
   ``kvpushd_client.memory.gpu_memory`` with EXPORTS_FD declared: one VmmMemory of its two chunks, attached,
   a push into it.

The two workers live in one process (two ranges, two daemons): each daemon still imports the chunks
from another process. Skipped without libcuda and a CUDA device.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def _cuda_devices() -> int:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    n = ctypes.c_int()
    if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(n)) != 0:
        return 0
    return n.value


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_cuda_devices() == 0, reason="needs libcuda.so.1 and a CUDA GPU (none on this machine)"),
]

WORKER = r"""
import ctypes, dataclasses, json, sys
import numpy as np
from kvpushd_client import Expect, KVPushClient, KVPushError, Publish, Region, Role
from support.vmm import CudaDriver, export_segments, sentinel_arm

a = json.loads(sys.argv[1])
lib = ctypes.CDLL("libcuda.so.1")


def ck(what, rc):
    if rc:
        raise RuntimeError(f"{what}: CUresult {rc}")


ck("cuInit", lib.cuInit(0))
dev, ctx = ctypes.c_int(), ctypes.c_void_p()
ck("cuDeviceGet", lib.cuDeviceGet(ctypes.byref(dev), 0))
ck("cuDevicePrimaryCtxRetain", lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
ck("cuCtxSetCurrent", lib.cuCtxSetCurrent(ctx))
drv = CudaDriver(lib)
G = drv.granularity(0)
BL = 64 << 10
NB = G // BL  # blocks per chunk


class Loc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class Prop(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", Loc),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", ctypes.c_ubyte * 8)]


class Access(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", Loc), ("flags", ctypes.c_int)]


class Range:
    # a reserved range of 4 chunks, committed a chunk at a time (vLLM: one segment, block-outermost)
    def __init__(self):
        self.reserved, self.committed, self.handles = 4 * G, 0, []
        p, flags = ctypes.c_uint64(), ctypes.c_ulonglong(0)
        ck("cuMemAddressReserve", lib.cuMemAddressReserve(ctypes.byref(p), ctypes.c_size_t(self.reserved),
                                                          ctypes.c_size_t(G), ctypes.c_uint64(0), flags))
        self.base = p.value

    def grow(self, fill):
        h, at = ctypes.c_uint64(), self.base + self.committed
        prop = Prop(1, 1, Loc(1, 0))  # pinned, POSIX fd handle type, on device 0
        n = ctypes.c_size_t(G)
        ck("cuMemCreate", lib.cuMemCreate(ctypes.byref(h), n, ctypes.byref(prop), ctypes.c_ulonglong(0)))
        ck("cuMemMap", lib.cuMemMap(ctypes.c_uint64(at), n, ctypes.c_size_t(0), h, ctypes.c_ulonglong(0)))
        acc = Access(Loc(1, 0), 3)  # read-write for device 0
        ck("cuMemSetAccess", lib.cuMemSetAccess(ctypes.c_uint64(at), n, ctypes.byref(acc), ctypes.c_size_t(1)))
        self.handles.append(h)
        self.committed += G
        drv.write(at, fill)

    def release(self):  # what sleep mode does to the physical pages; the reservation stays
        for i, h in enumerate(self.handles):
            ck("cuMemUnmap", lib.cuMemUnmap(ctypes.c_uint64(self.base + i * G), ctypes.c_size_t(G)))
            ck("cuMemRelease", lib.cuMemRelease(h))
        self.handles, self.committed = [], 0

    def memory(self, start=0):
        m = export_segments(drv, self.base, self.reserved, [(start, self.committed - start)], 0)
        return dataclasses.replace(m, arm_sentinel=sentinel_arm(drv, self.base, start))  # at the first new chunk

    def blocks(self):
        return np.frombuffer(drv.read(self.base, self.committed), dtype=np.uint8).reshape(-1, BL)


out = {"granularity": G, "blocks_per_chunk": NB, "steps": []}
rng = np.random.default_rng(7)
P, D = Range(), Range()
P.grow(rng.integers(0, 256, G, dtype=np.uint8).tobytes())
D.grow(b"\xa5" * G)
pc, dc = KVPushClient(a["p_sock"]), KVPushClient(a["d_sock"])
src_before = P.blocks().copy()


def region(r):
    return [Region(0, 0, r.committed // BL, BL)]


pm = P.memory()
dm = D.memory()
out["chunks_exported"] = [len(pm.chunks), len(dm.chunks)]
pw = pc.attach("prefill", Role.PRODUCER, 0, 1, [pm], region(P))
dw = dc.attach("decode", Role.CONSUMER, 0, 1, [dm], region(D))


def push(tid, src, dst):
    before = D.blocks().copy()
    dw.send(Expect(tid, tuple(dst), a["peer"], "prefill", 1))
    pw.send(Publish(tid, tuple(src)))
    cd, cp = dw.next_completion(60), pw.next_completion(60)
    after = D.blocks()
    others = [b for b in range(after.shape[0]) if b not in dst]
    return {"tid": tid, "recv": cd.kind.name if cd else None, "send": cp.kind.name if cp else None,
            "reason": (cd.reason if cd else "") + (cp.reason if cp else ""),
            "bytes_ok": bool(np.array_equal(after[dst], src_before[src])),
            "others_ok": bool(np.array_equal(after[others], before[others])),
            "source_ok": bool(np.array_equal(P.blocks(), src_before))}


out["steps"].append(push("vmm-1", [3, 4, 7], [1, 2, 5]))
try:  # a block past the prefill worker's one chunk
    pw.send(Publish("vmm-past", (NB,)))
    out["past"] = {"code": "", "message": "accepted"}
except KVPushError as e:
    out["past"] = {"code": e.code, "message": e.message}
# growth by one chunk
D.grow(b"\xa5" * G)
try:
    dc.extend(dw, "decode", Role.CONSUMER, 0, 1, [D.memory(start=G)], region(D))
    out["extend"] = {"code": "", "message": "grown"}
except KVPushError as e:
    out["extend"] = {"code": e.code, "message": e.message}
if out["extend"]["code"]:  # today's way: detach, attach with every chunk
    dw.detach()
    dw = dc.attach("decode", Role.CONSUMER, 0, 1, [D.memory()], region(D))
out["steps"].append(push("vmm-grown", [0, 9], [NB + 1, NB + 3]))
# unregister / restore: new physical chunks at the same addresses
dw.detach()
D.release()
D.grow(b"\xa5" * G)
D.grow(b"\xa5" * G)
dw = dc.attach("decode", Role.CONSUMER, 0, 1, [D.memory()], region(D))
out["steps"].append(push("vmm-restored", [2, 30], [0, NB + 5]))
# the vLLM connector's path: the range as a torch tensor (vLLM 0.34 gives each layer a storage over its
# segment's committed blocks), kvpushd_client.memory.gpu_memory with EXPORTS_FD declared
try:
    import torch
    from kvpushd_client.memory import gpu_memory
    from kvpushd_client.vmm import VmmMemory
except ImportError as e:
    out["connector_path"] = f"skipped: {e}"
else:
    class Cai:
        __cuda_array_interface__ = {"shape": (D.committed,), "typestr": "|u1", "data": (D.base, False),
                                    "version": 3}

    t = torch.as_tensor(Cai(), device="cuda:0")
    m = gpu_memory(t, True)
    out["connector_path"] = {"vmm": isinstance(m, VmmMemory),
                             "chunks": [[c.offset, c.size] for c in getattr(m, "chunks", ())]}
    dw.detach()
    dw = dc.attach("decode", Role.CONSUMER, 0, 1, [m], region(D))
    out["steps"].append(push("vmm-connector", [5, 6], [3, NB + 7]))
    m.close()
dw.detach()
pw.detach()
print(json.dumps(out), flush=True)
"""


def test_vmm_chunks_by_fd_push_growth_and_restore(daemon_pair) -> None:  # type: ignore[no-untyped-def]
    p, d = daemon_pair
    r = subprocess.run([sys.executable, "-c", WORKER, json.dumps({"p_sock": p.sock, "d_sock": d.sock,
                                                                 "peer": p.peer_address})],
                       capture_output=True, text=True, timeout=240,  # tests/ on the path: support.vmm
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (
                           str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH"))))})
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    print(json.dumps(out))  # pytest.log keeps it (-rs); docs/gpu.md says what to expect
    assert out["chunks_exported"] == [1, 1]
    for step in out["steps"]:
        assert step["recv"] == "FINISHED_RECEIVING" and step["send"] == "FINISHED_SENDING", step
        assert step["bytes_ok"] and step["others_ok"] and step["source_ok"], step
    assert out["past"]["code"] == "INVALID_ARGUMENT" and "out of range" in out["past"]["message"], out["past"]
    assert out["extend"]["code"] in ("", "FAILED_PRECONDITION"), out["extend"]
    if not str(out["connector_path"]).startswith("skipped"):
        assert out["connector_path"] == {"vmm": True, "chunks": [[0, out["granularity"]],
                                                                 [out["granularity"], out["granularity"]]]}
    st = d.client.status()
    assert not st.workers and not st.transfers
