"""Load for real vLLM engines: the same prompts and Poisson arrival times for every configuration,
streamed completions timed on the client side, and the arithmetic on them (standard library only).

TTFT: a request's scheduled arrival -> the first streamed chunk that carries text. TPOT: (last token's
chunk - first token's chunk) / (tokens - 1). Percentiles are nearest-rank, as in the other suites.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import http.client
import json
import math
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .model import MODEL_NAME, prompt_text


@dataclass(frozen=True)
class Cell:
    """One point of the grid: requests of ``prompt_len`` tokens arriving at ``qps`` (Poisson)."""

    qps: float
    prompt_len: int

    @property
    def key(self) -> str:
        return f"qps{self.qps:g}_p{self.prompt_len}"


def grid(qps: list[float], prompt_lens: list[int]) -> list[Cell]:
    """Prompt length outer, QPS inner: each length's light load before its heavy one."""
    return [Cell(q, p) for p in prompt_lens for q in qps]


def arrivals(seed: int, cell: Cell, n: int) -> list[float]:
    """Poisson arrivals: offsets in seconds from the cell's start; a function of (seed, cell, n) only."""
    rng = random.Random(f"vllm-bench-{seed}-{cell.prompt_len}-{cell.qps:g}")
    t, out = 0.0, []
    for _ in range(n):
        out.append(round(t, 6))
        t += rng.expovariate(cell.qps)
    return out


def prompts(seed: int, prompt_len: int, n: int) -> list[str]:
    """The cell's prompts: the same for each QPS of one length (the monolithic run answers each once)."""
    return [prompt_text(prompt_len, seed=seed * 1_000_003 + prompt_len * 7919 + i) for i in range(n)]


def schedule_digest(plan: list[tuple[Cell, list[float], list[str]]]) -> str:
    """A short hash of every cell's arrival offsets and prompts (equal across configurations)."""
    h = hashlib.sha256()
    for cell, offs, ps in plan:
        h.update(json.dumps([cell.key, offs, ps]).encode())
    return h.hexdigest()[:16]


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]); 0.0 for no values."""
    if not values:
        return 0.0
    s = sorted(values)
    return float(s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))])


@dataclass
class Outcome:
    index: int
    t_sched: float  # monotonic seconds
    t_first: float = 0.0
    t_last: float = 0.0
    tokens: int = 0
    text: str = ""
    error: str = ""

    @property
    def ttft_ms(self) -> float:
        return (self.t_first - self.t_sched) * 1e3

    @property
    def tpot_ms(self) -> float | None:
        return (self.t_last - self.t_first) * 1e3 / (self.tokens - 1) if self.tokens > 1 else None


def stream_completion(port: int, prompt: str, max_tokens: int, timeout_s: float, o: Outcome) -> Outcome:
    """POST a streamed greedy completion to 127.0.0.1:port and time its chunks into ``o``."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            o.error = f"HTTP {r.status}: {r.read().decode(errors='replace')[:300]}"
            return o
        parts: list[str] = []
        while True:
            line = r.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            msg = json.loads(data)
            if "error" in msg:
                o.error = f"stream error: {str(msg['error'])[:300]}"
                return o
            choices = msg.get("choices") or []
            text = choices[0].get("text", "") if choices else ""
            if text:
                now = time.monotonic()
                o.t_first = o.t_first or now
                o.t_last = now
                o.tokens += 1
                parts.append(text)
        o.text = "".join(parts)
        if o.tokens == 0:
            o.error = "no token streamed"
    except (OSError, http.client.HTTPException, ValueError) as e:
        o.error = f"{type(e).__name__}: {e}"[:300]
    finally:
        conn.close()
    return o


def run_cell(port: int, prompt_list: list[str], offsets: list[float], max_tokens: int, timeout_s: float,
             stop: threading.Event | None = None) -> tuple[list[Outcome], float]:
    """Send each prompt at its offset (one thread each), wait for all; returns outcomes and wall seconds."""
    t0 = time.monotonic() + 0.05
    futs = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(prompt_list))) as pool:
        for i, (p, off) in enumerate(zip(prompt_list, offsets, strict=True)):
            delay = t0 + off - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            if stop is not None and stop.is_set():
                break
            futs.append(pool.submit(stream_completion, port, p, max_tokens, timeout_s, Outcome(i, t0 + off)))
        outs = [f.result() for f in futs]
    return outs, time.monotonic() - t0


def summarize(outs: list[Outcome], digits: int = 1) -> dict[str, Any]:
    ok = [o for o in outs if not o.error]
    ttft = [o.ttft_ms for o in ok]
    tpot = [t for t in (o.tpot_ms for o in ok) if t is not None]
    errors = sorted({o.error for o in outs if o.error})
    return {"completed": len(ok), "failed": len(outs) - len(ok),
            "ttft_ms": {"p50": round(pct(ttft, 0.5), digits), "p99": round(pct(ttft, 0.99), digits),
                        "n": len(ttft)},
            "tpot_ms": {"p50": round(pct(tpot, 0.5), digits + 1), "p99": round(pct(tpot, 0.99), digits + 1),
                        "n": len(tpot)},
            **({"errors": errors[:3]} if errors else {})}


@dataclass
class TokensCheck:
    """Decode text vs the monolithic server's, per prompt (the tokenizer is word-level: text is tokens)."""

    expected: dict[str, str] = field(default_factory=dict)

    def check(self, prompt_list: list[str], outs: list[Outcome]) -> bool | None:
        if not self.expected:
            return None
        done = [(prompt_list[o.index], o.text) for o in outs if not o.error]
        return bool(done) and all(self.expected.get(p) == t for p, t in done)
