"""What one gRPC hop costs on this machine, by how long the stream was idle before the message.

The worker <-> daemon hops of ``kvpushd bench critical-path`` are a sync gRPC client (the client
library's StreamWorker: a sender feeding a request iterator, a reader thread) against a grpc.aio
server on uvloop (the daemon), over a unix socket. This script times exactly that, with no kvpushd
code: a bidi echo, one 16-byte message at a time, ``GAP`` ms of idle between messages;
``up`` = client put -> server handler has it, ``down`` = server yields the answer -> client reader
thread has it (CLOCK_MONOTONIC, one clock for both processes). The same for a pipe between two
processes, the floor of a cross-process wake-up here.

Run from the repository root: ``python scripts/bench_grpc_hop.py [GAP_MS ...]`` (default 0 1 2 5 10);
prints one JSON line per gap.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator

import grpc
import grpc.aio
import uvloop
from kvpushd_lab.bench.common import pct

MESSAGES = 300
WARMUP = 20


def _ident(b: bytes) -> bytes:
    return b


def _server(address: str) -> None:
    async def echo(it: AsyncIterator[bytes], ctx: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        async for m in it:
            yield m[:8] + time.monotonic_ns().to_bytes(8, "little")

    async def main() -> None:
        s = grpc.aio.server()
        s.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "e.E", {"S": grpc.stream_stream_rpc_method_handler(echo, _ident, _ident)}),))
        s.add_insecure_port(address)
        await s.start()
        await s.wait_for_termination()

    uvloop.install()
    asyncio.run(main())


def _pct(v: list[float]) -> dict[str, float]:
    return {f"p{round(q * 100)}": round(pct(v, q)) for q in (0.5, 0.9, 0.99)}


def grpc_hops(address: str, gap_s: float) -> dict[str, dict[str, float]]:
    with grpc.insecure_channel(address) as ch:
        call = ch.stream_stream("/e.E/S", request_serializer=_ident, response_deserializer=_ident)
        out: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        inbox: queue.SimpleQueue[tuple[bytes, int]] = queue.SimpleQueue()

        def requests() -> Iterator[bytes]:
            while (m := out.get()) is not None:
                yield m

        answers = call(requests())

        def reader() -> None:
            try:
                for r in answers:
                    inbox.put((r, time.monotonic_ns()))
            except grpc.RpcError:  # cancelled at the end
                pass

        threading.Thread(target=reader, daemon=True).start()
        up, down = [], []
        for i in range(MESSAGES + WARMUP):
            t0 = time.monotonic_ns()
            out.put(t0.to_bytes(8, "little"))
            r, t_read = inbox.get(timeout=10)
            t_srv = int.from_bytes(r[8:16], "little")
            if i >= WARMUP:
                up.append((t_srv - t0) / 1000)
                down.append((t_read - t_srv) / 1000)
            time.sleep(gap_s)
        out.put(None)
        answers.cancel()
    return {"up_us": _pct(up), "down_us": _pct(down)}


def pipe_wake(gap_s: float) -> dict[str, float]:
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(w1)
        while os.read(r1, 8):
            os.write(w2, time.monotonic_ns().to_bytes(8, "little"))
        os._exit(0)
    os.close(r1)
    lat = []
    for i in range(MESSAGES + WARMUP):
        t0 = time.monotonic_ns()
        os.write(w1, b"x" * 8)
        t1 = int.from_bytes(os.read(r2, 8), "little")
        if i >= WARMUP:
            lat.append((t1 - t0) / 1000)
        time.sleep(gap_s)
    os.close(w1)
    os.waitpid(pid, 0)
    return _pct(lat)


def main(argv: list[str]) -> int:
    gaps = [float(a) for a in argv] or [0.0, 1.0, 2.0, 5.0, 10.0]
    with tempfile.TemporaryDirectory() as tmp:
        address = f"unix://{tmp}/echo.sock"
        server = mp.get_context("spawn").Process(target=_server, args=(address,), daemon=True)
        server.start()
        try:
            grpc.channel_ready_future(grpc.insecure_channel(address)).result(timeout=30)
            for gap in gaps:
                row = {"gap_ms": gap, **grpc_hops(address, gap / 1000), "pipe_wake_us": pipe_wake(gap / 1000),
                       "loadavg_1m": round(os.getloadavg()[0], 2), "cpus": os.cpu_count(), "messages": MESSAGES}
                print(json.dumps(row), flush=True)
        finally:
            server.terminate()
            server.join(5)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
