"""One load-generator process of ``kvpushd bench peers``: synthetic decode daemons facing one prefill daemon.

Each synthetic peer has a node identity of its own (node id, instance id, peer address), and does
what a decode daemon does: a Handshake, a Channel stream opened with its session, one Register
(its own NIXL agent, by name and metadata, never loaded: no publish comes), then a heartbeat on the
stream whenever the coordinator says ``beat``. Peers share gRPC channels, ``per_connection`` each
(below the daemon's peer_api.max_streams_per_connection), every channel its own TCP connection.

Driven over stdin/stdout by one line each: ``connect`` -> a JSON line with what connected and when
(time.monotonic(), the one clock of every process here); ``beat`` -> one heartbeat per peer, a JSON
line when all were answered; ``quit``. Run as ``python -m kvpushd_lab.bench.peergen SPEC_JSON``.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import grpc
from kvpushd_client.proto.v1 import common_pb2, peer_pb2, peer_pb2_grpc

from kvpushd import PROTOCOL_VERSION
from kvpushd.core import notif
from kvpushd.core.peerlink import backoff_s
from kvpushd.runtime.identity import agent_prefix

MD_PREFIX = b"nixlSerDes|Agent"  # the form of NIXL agent metadata the daemon checks the name in


@dataclass
class Peer:
    index: int
    node_id: str
    instance_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    call: Any = None  # its Channel stream
    seq: int = 0
    tries: int = 0
    error: str = ""

    @property
    def address(self) -> str:
        i = self.index  # a loopback address of its own, on which nothing listens
        return f"127.{1 + i // 65536}.{(i // 256) % 256}.{i % 256}:9"


def agent(p: Peer, spec: dict[str, Any]) -> peer_pb2.AgentInfo:
    name = agent_prefix(p.node_id, p.instance_id) + "decode-0"
    raw = name.encode()
    md = MD_PREFIX + len(raw).to_bytes(8, "little") + raw
    md += bytes(max(0, spec["metadata_bytes"] - len(md)))
    regions = [peer_pb2.RemoteRegion(base_addr=(1 << 30) + k * (64 << 20), num_blocks=max(64, spec["blocks"]),
                                     block_len=4096, block_stride=4096) for k in range(spec["regions"])]
    return peer_pb2.AgentInfo(agent_name=name, agent_metadata=md, memory_kind="DRAM", regions=regions)


class Generator:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        first, count = spec["first"], spec["count"]
        self.peers = [Peer(i, f"synth-{i}") for i in range(first, first + count)]
        per = spec["per_connection"]
        opts = [("grpc.use_local_subchannel_pool", 1),  # its own connection, not one shared with equal channels
                ("grpc.max_receive_message_length", 16 << 20), ("grpc.keepalive_time_ms", 60_000)]
        self.channels = [grpc.aio.insecure_channel(spec["target"], options=[*opts, ("kvpushd.bench.conn", k)])
                         for k in range(-(-count // per))]
        self.stubs: list[Any] = [peer_pb2_grpc.PeerServiceStub(c) for c in self.channels]  # aio: untyped stubs
        self.failures: Counter[str] = Counter()  # failed attempts by what they failed with

    def stub(self, p: Peer) -> Any:
        return self.stubs[(p.index - self.spec["first"]) // self.spec["per_connection"]]

    async def item(self, p: Peer, kind: str, msg: Any) -> peer_pb2.PeerResult:
        p.seq += 1
        it = peer_pb2.PeerItem(seq=p.seq)
        getattr(it, kind).CopyFrom(msg)
        await p.call.write(peer_pb2.PeerBatch(items=[it]))
        batch = await asyncio.wait_for(p.call.read(), self.spec["rpc_timeout_s"])
        if batch is grpc.aio.EOF:
            raise RuntimeError(f"stream ended: {await p.call.code()}")
        (res,) = batch.items
        out: peer_pb2.PeerResult = res.result
        return out

    async def connect_one(self, p: Peer, start_at: float, deadline: float) -> bool:
        """Handshake, stream, Register, from ``start_at`` on; after a failure it waits the back-off a
        decode daemon's peer link waits (core.peerlink.backoff_s: handshake_retry_s doubled per failure in
        a row up to handshake_retry_max_s, drawn at 50-100%) and tries again, until ``deadline``."""
        s = self.spec
        await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        while time.monotonic() < deadline:
            p.tries += 1
            stage = "handshake"
            try:
                hello = await self.stub(p).Handshake(peer_pb2.HandshakeRequest(
                    protocol_version=PROTOCOL_VERSION, compat_hash=notif.compat_hash(), node_id=p.node_id,
                    peer_address=p.address, instance_id=p.instance_id), timeout=s["connect_timeout_s"],
                    wait_for_ready=True)
                md = (("kvpushd-session", hello.session_token), ("kvpushd-instance", p.instance_id))
                stage = "register"
                p.call = self.stub(p).Channel(metadata=md)
                reg = peer_pb2.RegisterRequest(
                    transfer_id=f"{s['tag']}-{p.index}", registration_id=1, producer_engine_id=s["engine_id"],
                    producer_tp_size=1, consumer_engine_id="decode", consumer_tp_rank=0, consumer_tp_size=1,
                    consumer_agent=agent(p, s), block_ids=list(range(s["blocks"])),
                    transfer_mode=common_pb2.TRANSFER_MODE_PUSH)
                r = await self.item(p, "register", reg)
                if r.code == "OK" and not r.need_metadata:
                    return True
                p.error = f"register: {r.code}: {r.message[:200]}"
            except (grpc.aio.AioRpcError, RuntimeError, TimeoutError) as e:
                p.error = f"{stage}: " + (f"{e.code().name}: {e.details()}" if isinstance(e, grpc.aio.AioRpcError)
                                          else repr(e))[:300]
            self.failures[p.error[:120]] += 1
            if p.call is not None:
                p.call.cancel()
                p.call = None
            await asyncio.sleep(backoff_s(p.tries, random.random(), s["retry_s"], s["retry_max_s"]))
        return False

    async def beat_one(self, p: Peer) -> bool:
        if p.call is None:
            return False
        try:
            r = await self.item(p, "heartbeat", peer_pb2.HeartbeatRequest())
        except (grpc.aio.AioRpcError, RuntimeError, TimeoutError) as e:
            p.error = str(e)[:300]
            return False
        return r.code == "OK" and r.heartbeat.knows_caller

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        say({"ready": True})
        while True:
            line = (await loop.run_in_executor(None, sys.stdin.readline)).strip()
            if line == "connect":
                t0, rate = time.monotonic(), self.spec["connect_rate"]  # peers started per second; 0: all at once
                deadline = t0 + self.spec["deadline_s"]
                ok = await asyncio.gather(*(self.connect_one(p, t0 + (k / rate if rate > 0 else 0.0), deadline)
                                            for k, p in enumerate(self.peers)))
                errors = sorted({p.error for p, good in zip(self.peers, ok, strict=True) if not good})
                say({"connected": sum(ok), "failed": len(ok) - sum(ok), "t_done": time.monotonic(),
                     "retries": sum(p.tries - 1 for p in self.peers), "errors": errors[:5],
                     "failures": dict(self.failures)})
            elif line == "beat":
                t0 = time.monotonic()
                ok = await asyncio.gather(*(self.beat_one(p) for p in self.peers))
                say({"beats_ok": sum(ok), "t_start": t0, "t_done": time.monotonic()})
            else:
                break
        for p in self.peers:
            if p.call is not None:
                p.call.cancel()
        await asyncio.gather(*(c.close(grace=None) for c in self.channels))


def say(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


def main() -> None:
    import resource

    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    spec = json.loads(sys.argv[1])
    asyncio.run(_run(spec))


async def _run(spec: dict[str, Any]) -> None:
    await Generator(spec).serve()


if __name__ == "__main__":
    main()
