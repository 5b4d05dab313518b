"""``python -m kvpushd_lab.bench.gpu_ceiling``: the GPU ceiling, VRAM -> VRAM on one GPU.

The Qwen3-32B TP8 rank shape (64 layers x K,V regions, blocks of 16 tokens x 1 KV head x 128 x bf16 =
4 KiB) at 4,096 and 16,384 tokens, three ways, interleaved rep by rep:

* daemon: two real daemons, a prefill and a decode worker tensor in this process handed over by CUDA
  IPC; from just before Publish to FINISHED_RECEIVING (the decode worker's Expect has reached the
  prefill daemon), as ``kvpushd bench ceiling`` does on host memory;
* raw_nixl: NIXL WRITE of exactly the descriptors the daemon posts (one per region and block, prepared
  once, index arrays per request), from an agent in this process on the source tensor to an agent in a
  helper process on the destination, opened by CUDA IPC as the daemon opens it; to the notification
  seen by the target;
* torch_copy: ``dst[:, dst_blocks] = src[:, src_blocks]`` on the device (gather/scatter of the same
  blocks), and ``torch_copy_flat``: one contiguous device copy of as many bytes.

GB/s count the bytes moved once (not read + written). The UCX transports come from UCX's own protocol
tables (``UCX_PROTO_INFO=y``) in the daemons' logs and the raw target's output. Without a GPU it says so
and exits 0. JSON to --json (and stdout).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from .common import POISON, Layout, daemon_pair, median, progress

TRANSPORTS = re.compile(r"\b(cuda_ipc|cuda_copy|gdr_copy|rc_mlx5|dc_mlx5|ud_mlx5|rc_verbs|ud_verbs|tcp|sysv|"
                        r"posix|cma|knem|xpmem|self|srd)\b")


def _transports(text: str) -> list[str]:
    return sorted({m.group(1) for line in text.splitlines() if "|" in line or "proto" in line.lower()
                   for m in TRANSPORTS.finditer(line)})


def _target_main(mem: Any, lay: Layout, conn: Connection) -> None:
    """Helper process: open the destination like the daemon does, register it, report notifications."""
    from kvpushd.memory.cuda import CudaIpcMapping

    from .rawnixl import _agent

    m = CudaIpcMapping(mem)  # made with sentinel=False: nothing to check
    agent = _agent(f"kvpushd-gpu-ceiling-target-{os.getpid()}")
    agent.register_memory([(m.addr, m.size, m.device_id, "")], "VRAM")
    conn.send((agent.get_agent_metadata(), m.addr, m.device_id))
    while True:
        msg = conn.recv()
        if msg is None:
            break
        deadline = time.monotonic() + 120
        seen = 0
        while not seen and time.monotonic() < deadline:
            for _, notifs in agent.get_new_notifs().items():
                if msg in notifs:
                    seen = time.monotonic_ns()
        conn.send(seen)


def _regions(base: int, lay: Layout, dev: int) -> list[Any]:
    from kvpushd.transfer.descs import RegionSpec

    return [RegionSpec(base + i * lay.region_bytes, lay.num_blocks, lay.block_len, lay.block_len, dev)
            for i in range(lay.regions)]


class RawNixl:
    """An initiator agent on the source tensor and a target process on the destination."""

    def __init__(self, src: Any, dst_mem: Any, lay: Layout) -> None:
        from kvpushd.transfer.descs import block_descs, region_bases

        from .rawnixl import _agent

        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_target_main, args=(dst_mem, lay, child), daemon=True)
        self._proc.start()
        meta, daddr, ddev = self._conn.recv()
        self.agent = _agent(f"kvpushd-gpu-ceiling-init-{os.getpid()}")
        dev = src.device.index
        self.agent.register_memory([(int(src.data_ptr()), src.nbytes, dev, "")], "VRAM")
        remote = self.agent.add_remote_agent(meta)
        remote = remote.decode() if isinstance(remote, bytes) else remote
        lr, rr = _regions(int(src.data_ptr()), lay, dev), _regions(daddr, lay, ddev)
        self.local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", block_descs(lr), "VRAM")
        self.remote = self.agent.prep_xfer_dlist(remote, block_descs(rr), "VRAM")
        self.lbases, self.rbases = region_bases(lr), region_bases(rr)

    def write(self, sblk: np.ndarray, dblk: np.ndarray, notif: bytes) -> int:
        from kvpushd.transfer.descs import leg_indices

        li, ri = leg_indices(self.lbases, sblk), leg_indices(self.rbases, dblk)
        self._conn.send(notif)
        t0 = time.monotonic_ns()
        h = self.agent.make_prepped_xfer("WRITE", self.local, li, self.remote, ri, notif)
        state = self.agent.transfer(h)
        while state == "PROC":
            state = self.agent.check_xfer_state(h)
        h.release()
        seen = int(self._conn.recv())
        if state != "DONE" or not seen:
            raise RuntimeError(f"raw NIXL WRITE ended in {state}, notification seen: {bool(seen)}")
        return seen - t0

    def close(self) -> None:
        self._conn.send(None)
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()


def _timed_copy(fn: Any) -> int:
    import torch

    torch.cuda.synchronize()
    t0 = time.monotonic_ns()
    fn()
    torch.cuda.synchronize()
    return time.monotonic_ns() - t0


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    import torch
    from kvpushd_client import Role
    from kvpushd_client.memory import cuda_memory

    from .ceiling import _blocks, _daemon_once

    sizes = sorted(set(args.tokens))
    lay = Layout(layers=args.layers, num_blocks=2 * Layout().blocks_for(max(sizes)))
    progress(f"gpu ceiling: {lay.regions} regions x {lay.num_blocks} blocks of {lay.block_len} B "
             f"({lay.total_bytes / 2**30:.2f} GiB per side) on {torch.cuda.get_device_name(0)}")
    g = torch.Generator(device="cuda").manual_seed(args.seed)
    src = torch.randint(0, 256, (lay.total_bytes,), dtype=torch.uint8, device="cuda", generator=g)
    dst = torch.full((lay.total_bytes,), POISON, dtype=torch.uint8, device="cuda")
    sv, dv = src.view(lay.regions, lay.num_blocks, lay.block_len), dst.view(lay.regions, lay.num_blocks,
                                                                             lay.block_len)
    torch.cuda.synchronize()
    rng = np.random.default_rng(args.seed)
    os.environ.setdefault("UCX_PROTO_INFO", "y")  # UCX prints which transports its protocols chose
    raw = RawNixl(src, cuda_memory(dst, sentinel=False), lay)
    rows: list[dict[str, Any]] = []
    try:
        with daemon_pair(workdir, transfer={"poll_interval_s": args.poll_us * 1e-6}) as (p, d):
            pw = p.client.attach("bench-prefill", Role.PRODUCER, 0, 1, [cuda_memory(src)], lay.region_list(),
                                 description="kvpushd gpu ceiling")
            dw = d.client.attach("bench-decode", Role.CONSUMER, 0, 1, [cuda_memory(dst)], lay.region_list(),
                                 description="kvpushd gpu ceiling")
            one = np.array([0], dtype=np.int64)
            _daemon_once(p, pw, dw, "warm-daemon", one, one)
            raw.write(one, one, b"warm-raw")
            for tokens in sizes:
                n = lay.blocks_for(tokens)
                nbytes = n * lay.regions * lay.block_len
                t: dict[str, list[int]] = {"daemon": [], "raw_nixl": [], "torch_copy": [], "torch_copy_flat": []}
                exact = True
                for rep in range(args.repeat):
                    sblk, dblk = _blocks(n, lay.num_blocks, args.fragmented, rng)
                    dst.fill_(POISON)
                    torch.cuda.synchronize()  # the fill is done before NIXL writes (another stream, another process)
                    ns, _, _ = _daemon_once(p, pw, dw, f"gpu-{tokens}-{rep}", sblk, dblk)
                    t["daemon"].append(ns)
                    si, di = torch.from_numpy(sblk).cuda(), torch.from_numpy(dblk).cuda()
                    exact &= bool(torch.equal(dv[:, di], sv[:, si]))
                    t["raw_nixl"].append(raw.write(sblk, dblk, f"raw-{tokens}-{rep}".encode()))
                    t["torch_copy"].append(_timed_copy(lambda si=si, di=di: dv.__setitem__((slice(None), di),
                                                                                          sv[:, si])))
                    t["torch_copy_flat"].append(_timed_copy(lambda nb=nbytes: dst[:nb].copy_(src[:nb])))
                med = {k: median(v) for k, v in t.items()}
                gbs = {k: round(nbytes / v, 2) for k, v in med.items()}  # bytes per ns = GB/s
                rows.append({"tokens": tokens, "blocks": n, "descriptors": n * lay.regions, "bytes": nbytes,
                             "median_ms": {k: round(v / 1e6, 3) for k, v in med.items()}, "gb_s": gbs,
                             "daemon_vs_raw_nixl": round(med["raw_nixl"] / med["daemon"], 3),
                             "daemon_vs_torch_copy": round(med["torch_copy"] / med["daemon"], 3),
                             "raw_nixl_vs_torch_copy": round(med["torch_copy"] / med["raw_nixl"], 3),
                             "bit_exact": exact})
                progress(f"  {tokens} tokens: {gbs}")
                if args.json:  # what is measured so far survives a timeout
                    args.json.write_text(json.dumps({"bench": "gpu_ceiling", "partial": True, "rows": rows}) + "\n")
            for w in (pw, dw):
                w.detach()
            logs = p.logs() + d.logs()
    finally:
        raw.close()
    return {"bench": "gpu_ceiling", "layout": lay.describe(), "fragmented": args.fragmented,
            "repeat": args.repeat, "gpu": torch.cuda.get_device_name(0), "rows": rows,
            "ucx_transports_daemons": _transports(logs), "ucx_tls": os.environ.get("UCX_TLS", "(UCX's choice)"),
            "command": "python -m kvpushd_lab.bench.gpu_ceiling " + " ".join(sys.argv[1:])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--fragmented", action="store_true", help="random blocks on both sides (nothing merges)")
    ap.add_argument("--poll-us", type=float, default=200.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="also write the JSON here")
    args = ap.parse_args(argv)
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if not has_gpu:
        out: dict[str, Any] = {"bench": "gpu_ceiling", "skipped": "no CUDA GPU visible: nothing measured"}
        print("gpu_ceiling: no CUDA GPU visible; skipped", file=sys.stderr)
    else:
        with tempfile.TemporaryDirectory(prefix="kvpushd-gpu-ceiling-") as wd:
            out = run(args, Path(wd))
    line = json.dumps(out)
    if args.json:
        args.json.write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
