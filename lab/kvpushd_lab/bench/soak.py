"""``soak``: many small requests through one pair of daemons with faults injected at random.

Two daemons (prefill node, decode node) and, in this process, the workers (``AsyncKVPushClient``, aioclient.py:
every worker on its WorkerService.Stream).
``--requests`` requests of one 4 KiB block each run ``--concurrency`` at a time; each gets a fault
with probability ``--fault-rate``, picked evenly from: an abort by the prefill engine, an abort by
the decode engine (each after a random delay of up to 2 ms, so they race the WRITE), a publish
whose registration never comes (the prefill daemon expires it after ``--timeout-s``) and a
registration whose publish never comes (the decode daemon expires it). The prefill daemon runs
with ``KVPUSHD_FAULTS`` (test-only, see kvpushd_lab/faults.py) so that a share
``--write-fault-rate`` of WRITEs fail (half refused at post, half completed in error without
their notification). Beside them a "churn" pair of workers runs batches of requests and has one
side (or both) detached mid-flight, then attaches afresh, and a rogue peer of the prefill daemon
tries to take registrations of the real decode daemon over, floods Registers (on its Channel stream)
and floods handshakes.

What must hold, and is reported: every side of every request ends with exactly one completion
(requests that never ended: 0; a detached worker's own requests end with its detach), and at the
end neither daemon holds a transfer or a block (from the status API). Also reported: outcomes by
code, throughput, and each daemon's RSS after the warm-up and at the end. Nothing here asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import random
import time
from pathlib import Path
from typing import Any

from kvpushd_client import Completion, CompletionKind, Region, Role

from .aioclient import AsyncKVPushClient, AsyncWorker
from .common import (
    POISON,
    BenchError,
    DaemonProc,
    KVMemory,
    Layout,
    Result,
    _ready,
    _spawn_daemon,
    progress,
)

FAULTS = ("abort_prefill", "abort_decode", "no_registration", "no_publish")
REGISTERS_PER_S = 300.0  # the prefill daemon's per-peer limit here: above the real decode daemon's rate
FLOOD = 2000  # Registers a flood sends, in one PeerBatch
CHURN_BATCH = 8


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=20_000, help="requests in all (default 20000)")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight on the main workers (default 32)")
    p.add_argument("--fault-rate", type=float, default=0.05,
                   help="share of requests given an abort or a missing side (default 0.05)")
    p.add_argument("--write-fault-rate", type=float, default=0.005,
                   help="share of WRITEs made to fail in the prefill daemon via KVPUSHD_FAULTS (default 0.005)")
    p.add_argument("--timeout-s", type=float, default=3.0,
                   help="the daemons' publish_timeout_s and expect_timeout_s (default 3)")
    p.add_argument("--churn-every-s", type=float, default=0.5,
                   help="seconds between worker detach/reattach cycles (0: no churn; default 0.5)")
    p.add_argument("--seed", type=int, default=1, help="seed of the fault draws (default 1)")
    p.add_argument("--attack-every-s", type=float, default=0.5,
                   help="seconds between peer attacks on the prefill daemon (0: none; default 0.5): a rogue peer "
                        "registering for transfers in flight, a Register flood, a handshake flood")


def rss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class _Router:
    """Hands each completion of one worker to the request waiting for its transfer id; counts the rest."""

    def __init__(self, w: AsyncWorker, stats: collections.Counter[str]) -> None:
        self.w = w
        self.stats = stats
        self.waiting: dict[str, asyncio.Future[Completion]] = {}
        self.ended: set[str] = set()
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        with contextlib.suppress(Exception):
            while True:
                c = await self.w.next_completion(None)
                if c is None:
                    continue
                f = self.waiting.pop(c.transfer_id, None)
                if f is not None and not f.done():
                    f.set_result(c)
                    self.ended.add(c.transfer_id)
                elif c.transfer_id in self.ended:
                    self.stats["duplicate_completions"] += 1
                else:
                    self.stats["unexpected_completions"] += 1

    def expect(self, tid: str) -> asyncio.Future[Completion]:
        f: asyncio.Future[Completion] = asyncio.get_running_loop().create_future()
        self.waiting[tid] = f
        return f

    def stop(self) -> None:
        self.task.cancel()


class Soak:
    def __init__(self, args: argparse.Namespace, p: DaemonProc, d: DaemonProc, lay: Layout,
                 src: KVMemory, dst: KVMemory) -> None:
        self.args = args
        self.p, self.d = p, d
        self.lay = lay
        self.src, self.dst = src, dst
        self.rng = random.Random(args.seed)
        self.tag = os.urandom(3).hex()
        self.issued = 0
        self.outcomes: collections.Counter[str] = collections.Counter()  # "side:OUTCOME"
        self.scenarios: collections.Counter[str] = collections.Counter()
        self.stats: collections.Counter[str] = collections.Counter()
        self.requests_ok = 0
        self.requests_failed = 0
        self.never_ended: list[str] = []
        self.rss_warm: dict[str, int] = {}
        self.t_warm = 0.0
        self.done_at_warm = 0
        self.bound_s = 4 * args.timeout_s + 30  # far beyond any deadline: a request this late never ends
        self.attacks: collections.Counter[str] = collections.Counter()
        self.inflight_tids: set[str] = set()  # main-lane transfers a rogue peer may try to take
        self.received: set[str] = set()  # transfers whose real decode worker finished receiving
        self.faulted: set[str] = set()  # transfers given a fault or detached on purpose (may not arrive)
        self.rogue_accepted: set[str] = set()  # transfers a rogue Register was accepted for

    def _next_id(self) -> tuple[int, str] | None:
        if self.issued >= self.args.requests:
            return None
        self.issued += 1
        return self.issued, f"soak-{self.tag}-{self.issued}"

    def _rss(self) -> dict[str, int]:
        return {"prefill": rss_kib(self.p.proc.pid), "decode": rss_kib(self.d.proc.pid)}

    async def one(self, pw: AsyncWorker, dw: AsyncWorker, pr: _Router, dr: _Router, engine: str, block: int,
                  tid: str, scenario: str, detached: dict[str, bool] | None = None) -> None:
        self.inflight_tids.add(tid)
        if scenario != "normal":
            self.faulted.add(tid)
        try:
            await self._one(pw, dw, pr, dr, engine, block, tid, scenario, detached)
        finally:
            self.inflight_tids.discard(tid)

    async def _one(self, pw: AsyncWorker, dw: AsyncWorker, pr: _Router, dr: _Router, engine: str, block: int,
                   tid: str, scenario: str, detached: dict[str, bool] | None = None) -> None:
        """Run one request to its end on both sides."""
        sides: dict[str, asyncio.Future[Completion]] = {}
        calls: list[tuple[str, Any]] = []
        if scenario != "no_registration":
            sides["decode"] = dr.expect(tid)
            calls.append(("decode", dw.expect(tid, [block], self.p.peer_address, engine, 1)))
        if scenario != "no_publish":
            sides["prefill"] = pr.expect(tid)
            calls.append(("prefill", pw.publish(tid, [block])))
        self.rng.shuffle(calls)
        results = await asyncio.gather(*(c for _, c in calls), return_exceptions=True)
        for (side, _), r in zip(calls, results, strict=True):
            if isinstance(r, Exception):  # refused (e.g. the worker was just detached): no completion
                sides.pop(side).cancel()
                self.outcomes[f"{side}:REFUSED"] += 1
        if scenario in ("abort_prefill", "abort_decode"):
            await asyncio.sleep(self.rng.random() * 0.002)
            w = pw if scenario == "abort_prefill" else dw
            with contextlib.suppress(Exception):
                await w.abort(tid)
        ok = True
        for side, fut in sides.items():
            try:
                c = await asyncio.wait_for(asyncio.shield(fut), self.bound_s)
            except TimeoutError:
                if detached and detached.get(side):
                    self.outcomes[f"{side}:DETACHED"] += 1  # its worker is gone: the detach ended it
                else:
                    self.never_ended.append(f"{tid} ({scenario}, {side})")
                ok = False
                continue
            except asyncio.CancelledError:
                self.outcomes[f"{side}:DETACHED"] += 1
                ok = False
                continue
            if c.kind is CompletionKind.FAILED:
                self.outcomes[f"{side}:{c.code}"] += 1
                ok = False
            else:
                self.outcomes[f"{side}:OK"] += 1
                if side == "decode":
                    self.received.add(tid)
        if ok and scenario == "normal":
            self.requests_ok += 1
        else:
            self.requests_failed += 1

    def pick(self) -> str:
        if self.rng.random() < self.args.fault_rate:
            return self.rng.choice(FAULTS)
        return "normal"

    async def main_lane(self, pw: AsyncWorker, dw: AsyncWorker, pr: _Router, dr: _Router, slot: int) -> None:
        while (nxt := self._next_id()) is not None:
            i, tid = nxt
            scenario = self.pick()
            self.scenarios[scenario] += 1
            await self.one(pw, dw, pr, dr, "soak-prefill", slot, tid, scenario)
            if not self.t_warm and i >= min(1000, self.args.requests // 10):
                self.t_warm = time.monotonic()
                self.done_at_warm = self.requests_ok + self.requests_failed
                self.rss_warm = self._rss()
            if i % 2000 == 0:
                progress(f"soak: {i}/{self.args.requests} issued, {len(self.never_ended)} never ended so far")

    async def churn_lane(self, pc: AsyncKVPushClient, dc: AsyncKVPushClient) -> None:
        """Batches of requests on a fresh worker pair; one side (or both) detached mid-flight."""
        base = self.args.concurrency
        region = [Region(0, 0, self.lay.num_blocks, self.lay.block_len)]
        while self.issued < self.args.requests:
            await asyncio.sleep(self.args.churn_every_s)
            pw = await pc.attach("soak-churn-prefill", Role.PRODUCER, 0, 1, [self.src.buf.memory], region,
                                 description="kvpushd bench soak churn")
            dw = await dc.attach("soak-churn-decode", Role.CONSUMER, 0, 1, [self.dst.buf.memory], region,
                                 description="kvpushd bench soak churn")
            pr, dr = _Router(pw, self.stats), _Router(dw, self.stats)
            victim = self.rng.choice(["prefill", "decode", "both"])
            detached = {"prefill": victim in ("prefill", "both"), "decode": victim in ("decode", "both")}
            tasks = []
            for k in range(CHURN_BATCH):
                nxt = self._next_id()
                if nxt is None:
                    break
                self.scenarios["churn"] += 1
                tasks.append(asyncio.create_task(self.one(pw, dw, pr, dr, "soak-churn-prefill", base + k, nxt[1],
                                                          "churn", detached)))
            await asyncio.sleep(self.rng.random() * 0.005)
            self.stats["churn_cycles"] += 1
            for side, w, r in (("prefill", pw, pr), ("decode", dw, dr)):
                if detached[side]:
                    await w.detach()
                    r.stop()
                    for fut in list(r.waiting.values()):
                        fut.cancel()  # ended by the detach: a gone worker gets no completion
            await asyncio.gather(*tasks)
            for side, w, r in (("prefill", pw, pr), ("decode", dw, dr)):
                if not detached[side]:
                    await w.detach()
                    r.stop()

    async def attack_lane(self) -> None:
        """A rogue peer of the prefill daemon: it registers its own (real) NIXL agent for transfers the
        real decode daemon registered (must be PERMISSION_DENIED), floods Registers (the rate limit
        refuses most), and floods handshakes from made-up addresses (status must stay bounded)."""
        import uuid

        import grpc
        from kvpushd_client.proto.v1 import peer_pb2, peer_pb2_grpc

        from kvpushd import PROTOCOL_VERSION
        from kvpushd.core import notif
        from kvpushd.runtime.identity import agent_prefix

        from ..refengine.inengine import _new_agent
        chan = grpc.aio.insecure_channel(self.p.peer_address)
        stub = peer_pb2_grpc.PeerServiceStub(chan)

        async def handshake(node: str, instance: str, address: str) -> tuple[tuple[str, str], ...]:
            r = await stub.Handshake(peer_pb2.HandshakeRequest(
                protocol_version=PROTOCOL_VERSION, compat_hash=notif.compat_hash(), node_id=node,
                peer_address=address, instance_id=instance), timeout=10)
            return (("kvpushd-session", r.session_token), ("kvpushd-instance", instance))

        rogue = uuid.uuid4().hex
        session = await handshake("rogue", rogue, "127.0.0.1:1")
        name = agent_prefix("rogue", rogue) + "thief"
        agent = _new_agent(name)  # a real NIXL agent, so its metadata passes every name check
        info = peer_pb2.AgentInfo(agent_name=name, agent_metadata=bytes(agent.get_agent_metadata()),
                                  memory_kind="DRAM", regions=[peer_pb2.RemoteRegion(
                                      base_addr=1 << 20, num_blocks=self.lay.num_blocks, block_len=self.lay.block_len,
                                      block_stride=self.lay.block_len)])
        rid = 1

        async def register(tids: list[str]) -> list[str]:
            """Registrations as one PeerBatch on a Channel stream of the rogue's session: per item its code."""
            nonlocal rid
            batch = peer_pb2.PeerBatch()
            for tid in tids:
                rid += 1
                batch.items.add(seq=rid, register=peer_pb2.RegisterRequest(
                    transfer_id=tid, registration_id=rid, producer_engine_id="soak-prefill", producer_tp_size=1,
                    consumer_engine_id="rogue", consumer_tp_rank=0, consumer_tp_size=1, consumer_agent=info,
                    block_ids=[0]))
            codes = {it.seq: "UNANSWERED" for it in batch.items}
            try:
                async for out in stub.Channel(iter([batch]), timeout=10, metadata=session):
                    codes.update((it.seq, it.result.code) for it in out.items)
            except grpc.aio.AioRpcError as e:
                return [e.code().name] * len(tids)
            return list(codes.values())

        try:
            while self.issued < self.args.requests:
                await asyncio.sleep(self.args.attack_every_s)
                kind = self.rng.choice(["takeover", "register_flood", "handshake_flood"])
                self.attacks[kind] += 1
                if kind == "takeover":  # transfers the real decode daemon has registered, not yet written
                    st = await AsyncKVPushClient(self.p.sock).status()
                    held = [t.transfer_id for t in st.transfers if t.side == "send"
                            and t.waiting_for == "prefill publish" and t.transfer_id.startswith("soak-")][:4]
                    for tid in held:
                        (code,) = await register([tid])
                        self.attacks[f"takeover:{code}"] += 1
                        if code == "OK":  # harmless only if that transfer had ended already
                            self.rogue_accepted.add(tid)
                elif kind == "register_flood":  # all in one batch: faster than the per-peer rate limit
                    for code in await register([f"rogue-flood-{self.tag}-{k}-{rid}" for k in range(FLOOD)]):
                        self.attacks[f"flood:{code}"] += 1
                else:
                    for k in range(100):
                        await handshake(f"flood-{k}", uuid.uuid4().hex, f"127.1.{k % 250}.{self.rng.randrange(250)}:7")
                    st = await AsyncKVPushClient(self.p.sock).status()
                    self.attacks["status_bytes_max"] = max(self.attacks["status_bytes_max"], st.ByteSize())
        finally:
            await chan.close()

    async def run(self) -> dict[str, Any]:
        pc, dc = AsyncKVPushClient(self.p.sock), AsyncKVPushClient(self.d.sock)
        region = [Region(0, 0, self.lay.num_blocks, self.lay.block_len)]
        pw = await pc.attach("soak-prefill", Role.PRODUCER, 0, 1, [self.src.buf.memory], region,
                             description="kvpushd bench soak")
        dw = await dc.attach("soak-decode", Role.CONSUMER, 0, 1, [self.dst.buf.memory], region,
                             description="kvpushd bench soak")
        pr, dr = _Router(pw, self.stats), _Router(dw, self.stats)
        t0 = time.monotonic()
        lanes = [self.main_lane(pw, dw, pr, dr, k) for k in range(self.args.concurrency)]
        if self.args.churn_every_s > 0:
            lanes.append(self.churn_lane(pc, dc))
        if getattr(self.args, "attack_every_s", 0) > 0:
            lanes.append(self.attack_lane())
        await asyncio.gather(*lanes)
        t1 = time.monotonic()
        # Whatever a daemon still holds now is a leak: every request has ended on both sides.
        held = await self._held(pc, dc)
        if held["prefill"]["transfers"] or held["decode"]["transfers"]:  # give notices in flight a moment
            await asyncio.sleep(self.args.timeout_s + 1.0)
            held = await self._held(pc, dc)
        rss_end = self._rss()
        counters = {}
        for name, c in (("prefill", pc), ("decode", dc)):
            st = await c.status()
            counters[name] = {"finished": st.counters.transfers_finished, "failed": st.counters.transfers_failed,
                              "writes_posted": st.counters.writes_posted}
        pr.stop()
        dr.stop()
        await pw.detach()
        await dw.detach()
        await pc.close()
        await dc.close()
        done_after_warm = self.requests_ok + self.requests_failed - self.done_at_warm
        return {"seconds": t1 - t0, "held": held, "rss_end": rss_end, "counters": counters,
                "measured_s": t1 - self.t_warm if self.t_warm else t1 - t0,
                "done_after_warm": done_after_warm if self.t_warm else self.requests_ok + self.requests_failed}

    async def _held(self, pc: AsyncKVPushClient, dc: AsyncKVPushClient) -> dict[str, dict[str, int]]:
        out = {}
        for name, c in (("prefill", pc), ("decode", dc)):
            st = await c.status()
            out[name] = {"transfers": len(st.transfers), "blocks": sum(t.num_blocks for t in st.transfers),
                         "worker_pending": sum(w.pending_transfers for w in st.workers)}
        return out


def run(args: argparse.Namespace, workdir: Path) -> Result:
    if args.requests < 1 or args.concurrency < 1 or not 0 <= args.fault_rate <= 1 \
            or not 0 <= args.write_fault_rate <= 0.5 or args.timeout_s <= 0:
        raise BenchError("need --requests >= 1, --concurrency >= 1, 0 <= --fault-rate <= 1, "
                         "0 <= --write-fault-rate <= 0.5, --timeout-s > 0")
    lay = Layout(layers=1, num_blocks=args.concurrency + CHURN_BATCH)  # requests use region 0 only
    src = KVMemory("kvpushd-bench-src", lay)
    dst = KVMemory("kvpushd-bench-dst", lay, fill=POISON)
    section = (f"[transfer]\npublish_timeout_s = {args.timeout_s!r}\nexpect_timeout_s = {args.timeout_s!r}\n"
               "heartbeat_interval_s = 0.5\npeer_timeout_s = 10.0\n")
    wf = args.write_fault_rate / 2
    faults = f"write_post={wf!r},write_complete={wf!r},seed={args.seed}" if args.write_fault_rate else ""
    old = os.environ.get("KVPUSHD_FAULTS")
    os.environ["KVPUSHD_FAULTS"] = faults
    try:
        # the rogue's Register flood meets the rate limit; the real decode daemon (~500/s here) does not
        ps = _spawn_daemon(workdir, "soak-pnode", "warning", section,
                           peer_api={"max_registers_per_s": REGISTERS_PER_S})
    finally:
        if old is None:
            os.environ.pop("KVPUSHD_FAULTS")
        else:
            os.environ["KVPUSHD_FAULTS"] = old
    ds = _spawn_daemon(workdir, "soak-dnode", "warning", section)
    progress(f"soak: {args.requests} requests, {args.concurrency} in flight, fault rate {args.fault_rate:g}, "
             f"write fault rate {args.write_fault_rate:g}, timeouts {args.timeout_s:g} s")
    p = d = None
    try:
        p = _ready(ps)
        d = _ready(ds)
        soak = Soak(args, p, d, lay, src, dst)
        out = asyncio.run(soak.run())
    finally:
        for x, s in ((d, ds), (p, ps)):
            if x is not None:
                x.shutdown()
            elif s.proc.poll() is None:
                s.proc.kill()
        src.close()
        dst.close()
    return _result(args, soak, out)


def _result(args: argparse.Namespace, s: Soak, out: dict[str, Any]) -> Result:
    held = out["held"]
    held_blocks = {k: v["blocks"] + v["worker_pending"] for k, v in held.items()}
    rate = out["done_after_warm"] / out["measured_s"] if out["measured_s"] > 0 else 0.0
    growth = {k: out["rss_end"][k] - s.rss_warm.get(k, 0) for k in out["rss_end"]}
    data: dict[str, Any] = {
        "requests": args.requests, "concurrency": args.concurrency, "fault_rate": args.fault_rate,
        "write_fault_rate": args.write_fault_rate, "timeout_s": args.timeout_s, "seed": args.seed,
        "finished": s.requests_ok, "failed": s.requests_failed, "never_ended": len(s.never_ended),
        "never_ended_examples": s.never_ended[:5],
        "scenarios": dict(s.scenarios), "outcomes": dict(sorted(s.outcomes.items())),
        "duplicate_completions": s.stats["duplicate_completions"],
        "unexpected_completions": s.stats["unexpected_completions"], "churn_cycles": s.stats["churn_cycles"],
        "held_at_end": held, "blocks_held_at_end": held_blocks,
        "rss_kib_warm": s.rss_warm, "rss_kib_end": out["rss_end"], "rss_growth_kib": growth,
        "seconds": round(out["seconds"], 2), "requests_per_s": round(rate, 1), "daemon_counters": out["counters"],
        "attacks": dict(sorted(s.attacks.items())),
        # a rogue Register accepted for a fault-free transfer whose real decode worker then did not receive it;
        # one accepted after the transfer ended (the status snapshot was a moment old) harms nobody
        "takeovers_accepted": len(s.rogue_accepted - s.received - s.faulted),
    }
    rows = [{"daemon": k, "rss_warm": s.rss_warm.get(k, 0) / 1024, "rss_end": out["rss_end"][k] / 1024,
             "growth": growth[k] / 1024, "transfers": held[k]["transfers"], "blocks": held_blocks[k]}
            for k in ("prefill", "decode")]
    cols = [("daemon", "daemon", "<"), ("rss_warm", "RSS warm MiB", ".1f"), ("rss_end", "RSS end MiB", ".1f"),
            ("growth", "growth MiB", "+.1f"), ("transfers", "pending at end", "d"), ("blocks", "blocks held", "d")]
    ok = not s.never_ended and not any(held_blocks.values()) and not s.stats["duplicate_completions"] \
        and not s.rogue_accepted - s.received - s.faulted
    lines = [
        f"requests: {args.requests} in {out['seconds']:.1f} s ({rate:,.0f}/s after warm-up): {s.requests_ok} "
        f"finished, {s.requests_failed} failed or faulted, {len(s.never_ended)} never ended (must be 0)",
        f"blocks held at end: prefill {held_blocks['prefill']}, decode {held_blocks['decode']} (must be 0); "
        f"duplicate completions {s.stats['duplicate_completions']} (must be 0); churn cycles "
        f"{s.stats['churn_cycles']}",
        "outcomes by side: " + ", ".join(f"{k} {v}" for k, v in sorted(s.outcomes.items())),
        "peer attacks: " + (", ".join(f"{k} {v}" for k, v in sorted(s.attacks.items())) or "none")
        + f" (takeovers accepted for transfers the real decode worker then lost: "
        f"{len(s.rogue_accepted - s.received - s.faulted)}, must be 0)",
        "invariants: " + ("held" if ok else "BROKEN"),
    ]
    method = [
        f"{args.concurrency} asyncio tasks each loop Expect + Publish (random order) of one 4 KiB block on one "
        f"worker pair; a share {args.fault_rate:g} of requests get a fault ({', '.join(FAULTS)}).",
        f"The prefill daemon runs with KVPUSHD_FAULTS write_post and write_complete at {args.write_fault_rate / 2:g} "
        "each (test-only fault injection in its transfer thread).",
        f"Every {args.churn_every_s:g} s a fresh worker pair runs {CHURN_BATCH} requests and has its prefill "
        "worker, decode worker or both detached a few ms after issuing them; the detached side's requests end "
        "with the detach (DETACHED), the other side's must end with a completion.",
        f"A side that has no completion {s.bound_s:g} s after its request was issued never ended. Blocks held: the "
        "sum of num_blocks over the status API's transfers plus workers' pending_transfers, after all requests "
        "ended. RSS from /proc/PID/status after the warm-up (1000 requests or a tenth) and at the end; throughput "
        "counts requests that ended after the warm-up.",
    ]
    return Result("soak", data, cols, rows, lines, method)
