"""In-process stand-in for two kvpushd daemons, for tests of the engines without any daemon.

``LocalKVNetwork`` plays both daemons: prefill engines publish, decode engines expect, whichever
arrives second copies the blocks (every layer's K and V, heads regathered when the TP sizes differ)
from the prefill engine's caches into the decode engine's caches, and both sides see the completion
on their next ``poll()`` -- the same rendezvous kvpushd runs, with a memory copy for the NIXL WRITE.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .engine import KVEvents
from .kv import PagedKV, as_caches, copy_blocks


@dataclass
class _Side:
    caches: list[PagedKV]
    sending: set[str] = field(default_factory=set)
    recving: set[str] = field(default_factory=set)
    failed: dict[str, str] = field(default_factory=dict)

    def poll(self) -> KVEvents:
        ev = KVEvents(self.sending, self.recving, self.failed)
        self.sending, self.recving, self.failed = set(), set(), {}
        return ev


class LocalProducerHooks:
    def __init__(self, net: LocalKVNetwork, engine_id: str, side: _Side) -> None:
        self.net = net
        self.engine_id = engine_id
        self.side = side

    def on_prefill_done(self, req_id: str, block_ids: Sequence[int]) -> dict[str, Any]:
        self.net.publish(self.engine_id, req_id, list(block_ids))
        return {"transfer_id": req_id, "remote_engine_id": self.engine_id, "remote_host": "local",
                "remote_port": 0, "tp_size": len(self.side.caches)}

    def on_blocks_allocated(self, req_id: str, block_ids: Sequence[int], kv_params: Mapping[str, Any]) -> None:
        raise RuntimeError("a producer does not receive")

    def poll(self) -> KVEvents:
        return self.side.poll()


class LocalConsumerHooks:
    def __init__(self, net: LocalKVNetwork, side: _Side) -> None:
        self.net = net
        self.side = side

    def on_prefill_done(self, req_id: str, block_ids: Sequence[int]) -> dict[str, Any]:
        raise RuntimeError("a consumer does not send")

    def on_blocks_allocated(self, req_id: str, block_ids: Sequence[int], kv_params: Mapping[str, Any]) -> None:
        tid = str(kv_params.get("transfer_id") or req_id)
        self.net.expect(self.side, req_id, tid, str(kv_params["remote_engine_id"]), list(block_ids))

    def poll(self) -> KVEvents:
        return self.side.poll()


class LocalKVNetwork:
    """Producers by engine id; a transfer is matched by transfer id (the prefill request id).

    ``fail`` names transfer ids to fail on both sides instead of copying (to test failure paths)."""

    def __init__(self, fail: Sequence[str] = ()) -> None:
        self.producers: dict[str, _Side] = {}
        self.published: dict[tuple[str, str], list[int]] = {}
        self.expected: dict[tuple[str, str], tuple[_Side, str, list[int]]] = {}
        self.fail = set(fail)
        self.copies = 0

    def producer(self, engine_id: str, kv: PagedKV | Sequence[PagedKV]) -> LocalProducerHooks:
        side = _Side(as_caches(kv))
        self.producers[engine_id] = side
        return LocalProducerHooks(self, engine_id, side)

    def consumer(self, kv: PagedKV | Sequence[PagedKV]) -> LocalConsumerHooks:
        return LocalConsumerHooks(self, _Side(as_caches(kv)))

    def publish(self, engine_id: str, tid: str, blocks: list[int]) -> None:
        self.published[(engine_id, tid)] = blocks
        self._match((engine_id, tid))

    def expect(self, side: _Side, req_id: str, tid: str, engine_id: str, blocks: list[int]) -> None:
        if engine_id not in self.producers:
            side.failed[req_id] = f"unknown producer {engine_id!r}"
            return
        self.expected[(engine_id, tid)] = (side, req_id, blocks)
        self._match((engine_id, tid))

    def _match(self, key: tuple[str, str]) -> None:
        if key not in self.published or key not in self.expected:
            return
        src_blocks = self.published.pop(key)
        dst_side, dst_req, dst_blocks = self.expected.pop(key)
        engine_id, tid = key
        src_side = self.producers[engine_id]
        reason = ""
        if tid in self.fail:
            reason = "injected failure"
        elif len(src_blocks) != len(dst_blocks):
            reason = f"block counts differ ({len(src_blocks)} published, {len(dst_blocks)} expected)"
        if reason:
            src_side.failed[tid] = reason
            dst_side.failed[dst_req] = reason
            return
        copy_blocks(src_side.caches, src_blocks, dst_side.caches, dst_blocks)
        self.copies += 1
        src_side.sending.add(tid)
        dst_side.recving.add(dst_req)
