"""An engine loop shaped like vLLM's (v1 scheduler), for the tiny reference model.

One ``Engine`` owns a model, its paged KV cache (one ``PagedKV`` per TP rank), a FIFO block allocator
and a scheduler with a waiting queue and a running batch. ``step()`` does one scheduler iteration:

* it first polls the KV connector hooks (``KVHooks.poll``), as vLLM's scheduler reads
  ``KVConnectorOutput.finished_sending / finished_recving`` after each model step, and once the
  step is scheduled calls the hooks' ``end_step()`` if they have one (the step's batch goes out);
* role ``prefill``: each waiting request gets blocks for its prompt, is prefilled, and returns at once
  with its first token and the ``kv_params`` decode needs (vLLM's prefill answers with
  ``max_tokens=1`` and ``kv_transfer_params``). Its blocks are *held* -- ``on_prefill_done`` tells
  the connector they are complete -- until the connector reports "finished sending" (or failed);
  only then do they go back to the free queue;
* role ``decode``: each waiting request gets blocks for its prompt, the connector is told at once
  (``on_blocks_allocated``: push mode registers destination blocks before prefill has even run) and
  the request waits (``WAITING_FOR_REMOTE_KVS``) until the connector reports "finished receiving".
  It then joins the running batch, starting from the first token prefill sampled (in ``kv_params``
  as ``first_token``, or given later with ``set_first_token``);
* role ``both``: a monolithic engine, prefill then decode locally, no connector;
* then the running batch decodes one token per request (``TinyModel.decode_step``).

Block accounting: a request gets its prompt blocks only when every block it will ever need fits next
to what the requests already holding blocks will still take, so a running request never stalls for
a block and nothing is preempted (vLLM would preempt and recompute; recomputation here would break
bit-exactness against the monolithic run). The running batch holds at most ``max_num_seqs``.
"""

from __future__ import annotations

import collections
import enum
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from .kv import PagedKV, as_caches
from .model import TinyModel


class EngineRole(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"


class Status(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    READY = "ready"  # KV present and first token known, waiting for room in the running batch
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"


class KVEvents(NamedTuple):
    """What a connector reports in one poll (unpacks as a 3-tuple)."""

    finished_sending: set[str]
    finished_recving: set[str]
    failed: dict[str, str]  # request id -> reason


class KVHooks(Protocol):
    """Where a KV connector acts. kvpushd-backed: ``KVPushdHooks``; in process: ``LocalKVNetwork``."""

    def on_prefill_done(self, req_id: str, block_ids: Sequence[int]) -> dict[str, Any]:
        """Prefill side: the request's KV is complete in ``block_ids`` (held until finished sending).

        Returns the kv_params a decode engine needs to receive it (transfer id, where from)."""
        ...

    def on_blocks_allocated(self, req_id: str, block_ids: Sequence[int], kv_params: Mapping[str, Any]) -> None:
        """Decode side: ``block_ids`` are allocated for the request's prompt; receive its KV into them."""
        ...

    def poll(self) -> KVEvents:
        """Non-blocking: transfers finished or failed since the last poll, by request id."""
        ...


# Optional on hooks: ``end_step()``, called once per engine step after scheduling (the step's
# publishes, expects and aborts are all known then) and before the model's decode pass: a connector
# that batches its calls sends the step's batch there (``KVPushdHooks``: one CommandBatch per step).
# Prefill side, also optional: ``on_prefill_start(req_id, block_ids)`` just before a prompt's forward
# (where progressive push declares the publish) and ``on_layer_done(n)`` once the forward has written
# its first n layers' K and V (where it rings the doorbell); ``on_prefill_done`` follows the forward.


class BlockAllocator:
    """vLLM's free block queue, without prefix caching: allocate from the front, free to the back."""

    def __init__(self, num_blocks: int, order: Sequence[int] | None = None) -> None:
        self.num_blocks = num_blocks
        init = list(range(num_blocks)) if order is None else list(order)
        if sorted(init) != list(range(num_blocks)):
            raise ValueError("order must be a permutation of range(num_blocks)")
        self._free: collections.deque[int] = collections.deque(init)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        return [self._free.popleft() for _ in range(n)]

    def free(self, block_ids: Sequence[int]) -> None:
        self._free.extend(block_ids)


@dataclass
class Request:
    req_id: str
    prompt: list[int]
    max_new_tokens: int
    kv_params: dict[str, Any] = field(default_factory=dict)
    status: Status = Status.WAITING
    block_ids: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    first_token: int | None = None
    kv_ready: bool = False
    error: str = ""

    @property
    def last_position(self) -> int:
        """Position of ``output[-1]``, the token the next decode step feeds in."""
        return len(self.prompt) + len(self.output) - 1


@dataclass(frozen=True)
class RequestOutput:
    req_id: str
    tokens: list[int]            # prefill: [first token]; decode / both: all generated tokens
    ok: bool = True
    error: str = ""
    kv_params: dict[str, Any] = field(default_factory=dict)  # prefill: what the decode engine needs


class Engine:
    """A vLLM-like engine loop over ``TinyModel`` with a paged cache and optional KV connector hooks."""

    def __init__(self, model: TinyModel, kv: PagedKV | Sequence[PagedKV], role: EngineRole | str,
                 hooks: KVHooks | None = None, max_num_seqs: int = 16, max_prefills_per_step: int = 4,
                 block_order: Sequence[int] | None = None) -> None:
        self.model = model
        self.caches = as_caches(kv)
        self.role = EngineRole(role)
        if self.role is not EngineRole.BOTH and hooks is None:
            raise ValueError(f"a {self.role} engine needs KV hooks")
        self.hooks = hooks
        self.max_num_seqs = max_num_seqs
        self.max_prefills_per_step = max_prefills_per_step
        self.allocator = BlockAllocator(self.caches[0].num_blocks, block_order)  # initial free queue order
        self.requests: dict[str, Request] = {}
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.held: dict[str, list[int]] = {}       # prefill: blocks awaiting "finished sending"
        self.send_failures: dict[str, str] = {}    # prefill: transfers that failed after the output went out
        self.unknown_events = 0
        self.steps = 0
        self.tokens_decoded = 0

    # --- requests --------------------------------------------------------------------------

    def add_request(self, req_id: str, prompt: Sequence[int], max_new_tokens: int = 1,
                    kv_params: Mapping[str, Any] | None = None) -> None:
        """Queue a request. Decode role: ``kv_params`` from the prefill side (``first_token`` optional)."""
        cfg = self.model.cfg
        if req_id in self.requests or req_id in self.held:
            raise ValueError(f"request {req_id!r} already exists")
        if not prompt or max_new_tokens < 1:
            raise ValueError("need a non-empty prompt and max_new_tokens >= 1")
        if self.role is EngineRole.PREFILL:
            max_new_tokens = 1
        if len(prompt) + max_new_tokens > cfg.max_positions:
            raise ValueError(f"prompt + max_new_tokens exceed max_positions {cfg.max_positions}")
        if self._blocks_needed(len(prompt), max_new_tokens) > self.allocator.num_blocks:
            raise ValueError(f"request {req_id!r} needs more blocks than the cache has")
        if any(not 0 <= t < cfg.vocab_size for t in prompt):
            raise ValueError("token id out of range")
        r = Request(req_id, list(prompt), max_new_tokens, dict(kv_params or {}))
        if "first_token" in r.kv_params:
            r.first_token = int(r.kv_params["first_token"])
        self.requests[req_id] = r
        self.waiting.append(r)

    def set_first_token(self, req_id: str, token: int) -> bool:
        """Decode role: the token prefill sampled, when it was not in ``kv_params`` at add time.

        False when the request is gone already (its transfer failed and it was finished)."""
        r = self.requests.get(req_id)
        if r is None:
            return False
        r.first_token = int(token)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests or self.held)

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    def _blocks_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        # the last generated token is never fed back, so its K/V is never written
        return self.model.cfg.blocks_for(prompt_len + max_new_tokens - 1)

    def _reserved(self) -> int:
        """Blocks that requests already holding blocks will still take (so none of them ever stalls)."""
        return sum(self._blocks_needed(len(r.prompt), r.max_new_tokens) - len(r.block_ids)
                   for r in self.requests.values() if r.block_ids)

    def _finish(self, r: Request, error: str = "") -> RequestOutput:
        self.allocator.free(r.block_ids)
        r.block_ids = []
        r.status = Status.FAILED if error else Status.FINISHED
        r.error = error
        self.requests.pop(r.req_id, None)
        return RequestOutput(r.req_id, list(r.output), not error, error)

    # --- the loop --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One scheduler iteration; returns the requests that finished (or failed) in it."""
        self.steps += 1
        outputs = self._poll()
        if self.role is EngineRole.PREFILL:
            outputs += self._schedule_prefills()
        elif self.role is EngineRole.DECODE:
            self._schedule_remote()
        else:
            outputs += self._schedule_local()
        end_step = getattr(self.hooks, "end_step", None)
        if end_step is not None:
            end_step()
        outputs += self._admit()
        outputs += self._decode()
        return outputs

    def run(self, timeout_s: float = 60.0, idle_sleep_s: float = 0.001) -> list[RequestOutput]:
        """Step until nothing is left (including blocks held for sending); all outputs in order."""
        deadline = time.monotonic() + timeout_s
        outputs: list[RequestOutput] = []
        while self.has_unfinished():
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine still has {len(self.requests)} requests and {len(self.held)} "
                                   f"held transfers after {timeout_s} s")
            before = self.tokens_decoded
            out = self.step()
            outputs += out
            if not out and self.tokens_decoded == before:
                time.sleep(idle_sleep_s)
        return outputs

    def _poll(self) -> list[RequestOutput]:
        if self.hooks is None:
            return []
        sending, recving, failed = self.hooks.poll()
        outputs: list[RequestOutput] = []
        for rid in sending:
            blocks = self.held.pop(rid, None)
            if blocks is None:
                self.unknown_events += 1
            else:
                self.allocator.free(blocks)
        for rid in recving:
            r = self.requests.get(rid)
            if r is None or r.status is not Status.WAITING_FOR_REMOTE_KVS:
                self.unknown_events += 1
            else:
                r.kv_ready = True
        for rid, reason in failed.items():
            if rid in self.held:
                self.allocator.free(self.held.pop(rid))
                self.send_failures[rid] = reason
                continue
            r = self.requests.get(rid)
            if r is None or r.status is not Status.WAITING_FOR_REMOTE_KVS:
                self.unknown_events += 1
                continue
            outputs.append(self._finish(r, f"KV transfer failed: {reason}"))
        for r in list(self.requests.values()):
            if r.status is Status.WAITING_FOR_REMOTE_KVS and r.kv_ready and r.first_token is not None:
                r.status = Status.READY
        return outputs

    def _take_waiting(self, limit: int) -> list[Request]:
        """Head-of-line FIFO: allocate prompt blocks while the request's whole need fits next to the
        reservations of the requests already holding blocks."""
        taken: list[Request] = []
        while self.waiting and len(taken) < limit:
            r = self.waiting[0]
            if self.allocator.num_free - self._reserved() < self._blocks_needed(len(r.prompt), r.max_new_tokens):
                break
            blocks = self.allocator.allocate(self.model.cfg.blocks_for(len(r.prompt)))
            assert blocks is not None
            r.block_ids = blocks
            self.waiting.popleft()
            taken.append(r)
        return taken

    def _schedule_prefills(self) -> list[RequestOutput]:
        assert self.hooks is not None
        outputs = []
        start = getattr(self.hooks, "on_prefill_start", None)
        on_layer = getattr(self.hooks, "on_layer_done", None)
        for r in self._take_waiting(self.max_prefills_per_step):
            tok = -1
            try:
                if start is not None:  # progressive push: the publish is declared before the forward
                    start(r.req_id, r.block_ids)
                tok = self.model.prefill(r.prompt, r.block_ids, self.caches, on_layer)
                r.output = [tok]
                params = dict(self.hooks.on_prefill_done(r.req_id, r.block_ids))
            except Exception as e:  # the connector refused: nothing will be sent, free at once
                abort = getattr(self.hooks, "abort", None)
                if start is not None and abort is not None:
                    abort(r.req_id)  # a publish declared before the forward must not go on
                self.requests.pop(r.req_id, None)
                self.allocator.free(r.block_ids)
                outputs.append(RequestOutput(r.req_id, [tok] if tok >= 0 else [], False, f"publish failed: {e}"))
                continue
            params["first_token"] = tok
            self.held[r.req_id] = r.block_ids
            r.block_ids = []
            r.status = Status.FINISHED
            self.requests.pop(r.req_id)
            outputs.append(RequestOutput(r.req_id, [tok], kv_params=params))
        return outputs

    def _schedule_remote(self) -> None:
        assert self.hooks is not None
        for r in self._take_waiting(len(self.waiting)):
            r.status = Status.WAITING_FOR_REMOTE_KVS
            try:
                self.hooks.on_blocks_allocated(r.req_id, r.block_ids, r.kv_params)
            except Exception as e:
                r.status = Status.FAILED
                r.error = f"expect failed: {e}"

    def _schedule_local(self) -> list[RequestOutput]:
        for r in self._take_waiting(self.max_prefills_per_step):
            r.first_token = self.model.prefill(r.prompt, r.block_ids, self.caches)
            r.status = Status.READY
        return []

    def _admit(self) -> list[RequestOutput]:
        """READY requests join the running batch, FIFO by arrival, while it has seats (their blocks
        are already reserved); requests whose KV could not be received are finished as failed."""
        outputs = []
        full = False
        for r in list(self.requests.values()):
            if r.status is Status.FAILED:
                outputs.append(self._finish(r, r.error))
            elif r.status is Status.READY and not full:
                assert r.first_token is not None
                if r.max_new_tokens == 1:
                    r.output = [r.first_token]
                    outputs.append(self._finish(r))
                elif len(self.running) >= self.max_num_seqs:
                    full = True  # FIFO: later requests do not overtake this one
                else:
                    r.output = [r.first_token]
                    r.status = Status.RUNNING
                    self.running.append(r)
        return outputs

    def _decode(self) -> list[RequestOutput]:
        if not self.running:
            return []
        bs = self.model.cfg.block_size
        for r in self.running:
            if r.last_position // bs >= len(r.block_ids):
                more = self.allocator.allocate(1)
                assert more is not None, "reserved at admission"
                r.block_ids += more
        batch = [(r.output[-1], r.last_position, r.block_ids) for r in self.running]
        toks = self.model.decode_step(batch, self.caches)
        self.tokens_decoded += len(toks)
        outputs = []
        still = []
        for r, t in zip(self.running, toks, strict=True):
            r.output.append(t)
            if len(r.output) >= r.max_new_tokens:
                outputs.append(self._finish(r))
            else:
                still.append(r)
        self.running = still
        return outputs
