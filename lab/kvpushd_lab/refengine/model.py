"""A tiny deterministic transformer on the CPU, over a vLLM-shaped paged KV cache (kv.py).

Llama-style: RMSNorm, RoPE, grouped-query attention (8 query heads over 4 KV heads), SwiGLU MLP.
The weights come from ``torch.Generator().manual_seed(seed)``: nothing is downloaded, and every
process that builds ``TinyModel(cfg, seed)`` has the same model.

Exactness: every disaggregated request must produce the same tokens as a monolithic run, bit for
bit, not merely within a tolerance. Three choices make that hold by construction:

* float32 throughout (no rounding when K/V go into and come out of the cache);
* a decode step runs each request of the batch through the same ``[1, hidden]`` code path, so a
  request's numbers never depend on which other requests share its batch (batched GEMMs may pick
  different kernels for different batch sizes and differ in the last bit);
* tensor parallelism shards the *cache*, not the arithmetic: a TP rank's ``PagedKV`` holds only
  that rank's KV heads (``TinyConfig.kv_slice``), but the engine computes the full model once and
  scatters K/V to, and gathers them from, all of its rank caches. The gathered K/V are the same
  bytes whatever the TP size, so TP1 -> TP2 or TP2 -> TP1 disaggregation is exact too. (A real
  engine computes each rank's heads on its own GPU and all-reduces; that changes the summation
  order, which is exactly what an equality test must not depend on.)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .config import TinyConfig
from .kv import PagedKV, as_caches, gather_blocks, scatter_blocks


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


@dataclass
class _Layer:
    attn_norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor


DecodeItem = tuple[int, int, Sequence[int]]  # (last token, its position, the request's block ids)


class TinyModel:
    """The weights and the forward passes; the KV cache is passed in (one ``PagedKV`` or one per TP rank)."""

    def __init__(self, cfg: TinyConfig | None = None, seed: int = 0) -> None:
        self.cfg = cfg = cfg or TinyConfig()
        self.seed = seed
        g = torch.Generator().manual_seed(seed)

        def w(n_in: int, n_out: int) -> torch.Tensor:
            return (torch.randn(n_in, n_out, generator=g) / math.sqrt(n_in)).to(cfg.dtype)

        def norm() -> torch.Tensor:
            return (1.0 + 0.1 * torch.randn(cfg.hidden_size, generator=g)).to(cfg.dtype)

        h, kvd = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
        self.embed = torch.randn(cfg.vocab_size, h, generator=g).to(cfg.dtype)
        self.layers = [
            _Layer(norm(), w(h, h), w(h, kvd), w(h, kvd), w(h, h), norm(),
                   w(h, cfg.intermediate_size), w(h, cfg.intermediate_size), w(cfg.intermediate_size, h))
            for _ in range(cfg.num_layers)
        ]
        self.final_norm = norm()
        self.lm_head = w(h, cfg.vocab_size)
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
        ang = torch.outer(torch.arange(cfg.max_positions, dtype=torch.float64), inv)
        ang = torch.cat((ang, ang), dim=-1)
        self.cos = ang.cos().to(cfg.dtype)  # one table: prefill and decode read the same numbers
        self.sin = ang.sin().to(cfg.dtype)

    # --- building blocks --------------------------------------------------------------------

    def _qkv(self, layer: _Layer, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [T, hidden] at positions pos [T] -> q [heads, T, d], k and v [kv_heads, T, d] (after RoPE)."""
        c = self.cfg
        t = x.shape[0]
        h = _rms_norm(x, layer.attn_norm, c.rms_eps)
        q = (h @ layer.wq).view(t, c.num_heads, c.head_dim).transpose(0, 1)
        k = (h @ layer.wk).view(t, c.num_kv_heads, c.head_dim).transpose(0, 1)
        v = (h @ layer.wv).view(t, c.num_kv_heads, c.head_dim).transpose(0, 1)
        cos, sin = self.cos[pos], self.sin[pos]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return q.contiguous(), k.contiguous(), v.contiguous()

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        """q [heads, Tq, d] over k, v [kv_heads, Tk, d] -> [Tq, hidden]; causal: query i sees keys <= Tk-Tq+i."""
        c = self.cfg
        g = c.num_heads // c.num_kv_heads
        k = k.repeat_interleave(g, dim=0)
        v = v.repeat_interleave(g, dim=0)
        s = (q @ k.transpose(1, 2)) * (1.0 / math.sqrt(c.head_dim))
        if causal:
            tq, tk = q.shape[1], k.shape[1]
            mask = torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq)
            s = s.masked_fill(~mask, float("-inf"))
        o = torch.softmax(s, dim=-1) @ v
        return o.transpose(0, 1).reshape(q.shape[1], c.hidden_size)

    def _mlp(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        h = _rms_norm(x, layer.mlp_norm, self.cfg.rms_eps)
        return (torch.nn.functional.silu(h @ layer.w_gate) * (h @ layer.w_up)) @ layer.w_down

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(x, self.final_norm, self.cfg.rms_eps) @ self.lm_head

    # --- full-sequence forward (prefill, and the unpaged reference) --------------------------

    def _window_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention where query i sees keys i-W+1..i (``attn_window`` W), chunk by chunk of W
        queries: time and memory grow with the sequence, not with its square."""
        w, t = self.cfg.attn_window, q.shape[1]
        out = []
        for s in range(0, t, w):
            e = min(t, s + w)
            lo = max(0, s - w + 1)
            qi = torch.arange(s, e)[:, None]
            kj = torch.arange(lo, e)[None, :]
            o = self._attend_masked(q[:, s:e], k[:, lo:e], v[:, lo:e], (kj <= qi) & (kj > qi - w))
            out.append(o)
        return torch.cat(out, dim=0)

    def _attend_masked(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        g = c.num_heads // c.num_kv_heads
        k = k.repeat_interleave(g, dim=0)
        v = v.repeat_interleave(g, dim=0)
        s = ((q @ k.transpose(1, 2)) * (1.0 / math.sqrt(c.head_dim))).masked_fill(~mask, float("-inf"))
        o = torch.softmax(s, dim=-1) @ v
        return o.transpose(0, 1).reshape(q.shape[1], c.hidden_size)

    def _forward(self, tokens: Sequence[int], on_kv: Callable[[int, torch.Tensor, torch.Tensor], None],
                 on_attn: Callable[[int], None] | None = None, last_only: bool = False) -> torch.Tensor:
        """The causal forward over the whole sequence; ``on_kv(layer, k, v)`` as each layer's K and V
        ([kv_heads, T, d], after RoPE) are computed, ``on_attn(n)`` once the n-th layer's attention is
        done (where vLLM calls ``save_kv_layer``). Returns the logits [T, vocab], or with ``last_only``
        those of the last position [1, vocab] (a prefill samples only there, as vLLM's logits indices)."""
        if not tokens:
            raise ValueError("empty sequence")
        if len(tokens) > self.cfg.max_positions:
            raise ValueError(f"{len(tokens)} tokens exceed max_positions {self.cfg.max_positions}")
        window = 0 < self.cfg.attn_window < len(tokens)
        with torch.inference_mode():
            ids = torch.tensor(list(tokens), dtype=torch.long)
            x = self.embed[ids]
            pos = torch.arange(len(tokens))
            for li, layer in enumerate(self.layers):
                q, k, v = self._qkv(layer, x, pos)
                on_kv(li, k, v)
                a = self._window_attend(q, k, v) if window else self._attend(q, k, v, causal=True)
                if on_attn is not None:
                    on_attn(li + 1)
                x = x + a @ layer.wo
                x = x + self._mlp(layer, x)
            return self._logits(x[-1:] if last_only else x)

    def forward_full(self, tokens: Sequence[int]) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Plain causal attention over the whole sequence, no cache: logits [T, vocab] and per layer (K, V)."""
        kvs: list[tuple[torch.Tensor, torch.Tensor]] = []
        logits = self._forward(tokens, lambda _, k, v: kvs.append((k, v)))
        return logits, kvs

    def prefill(self, tokens: Sequence[int], block_ids: Sequence[int], kv: PagedKV | Sequence[PagedKV],
                on_layer: Callable[[int], None] | None = None) -> int:
        """Compute the prompt, writing each layer's K and V into ``block_ids`` as soon as that layer has
        computed them (before its attention, as an attention backend writes the cache); ``on_layer(n)``
        after the n-th layer's attention (progressive push rings its doorbell there). Returns the greedy
        next token."""
        caches = as_caches(kv)
        c = self.cfg
        n = c.blocks_for(len(tokens))
        if len(block_ids) < n:
            raise ValueError(f"{len(tokens)} tokens need {n} blocks, got {len(block_ids)}")
        pad = n * c.block_size - len(tokens)

        def write(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            # [kv_heads, T, d] -> [n, kv_heads, block_size, d]; the tail of the last block is zero
            kb, vb = (torch.nn.functional.pad(t, (0, 0, 0, pad)).view(c.num_kv_heads, n, c.block_size,
                                                                        c.head_dim).transpose(0, 1)
                      for t in (k, v))
            scatter_blocks(caches, layer, block_ids[:n], kb, vb)

        logits = self._forward(tokens, write, on_layer, last_only=True)
        return int(logits[-1].argmax())

    # --- paged decode -------------------------------------------------------------------------

    def decode_logits(self, token: int, position: int, block_ids: Sequence[int],
                      kv: PagedKV | Sequence[PagedKV]) -> torch.Tensor:
        """One token at ``position``: write its K/V into its block and slot, attend over the paged cache."""
        caches = as_caches(kv)
        c = self.cfg
        bs = c.block_size
        if not 0 <= position < c.max_positions:
            raise ValueError(f"position {position} out of range")
        nb = position // bs + 1
        if len(block_ids) < nb:
            raise ValueError(f"position {position} needs {nb} blocks, got {len(block_ids)}")
        first = 0  # the first key position attended to (its block's first position)
        if 0 < c.attn_window <= position:
            first = (position - c.attn_window + 1) // bs * bs
        blocks = list(block_ids[first // bs:nb])
        blk, slot = blocks[-1], position % bs
        with torch.inference_mode():
            x = self.embed[torch.tensor([token], dtype=torch.long)]
            pos = torch.tensor([position])
            for li, layer in enumerate(self.layers):
                q, k, v = self._qkv(layer, x, pos)  # k, v: [kv_heads, 1, d]
                for cache in caches:
                    cache.k[li][blk, :, slot] = k[cache.heads, 0]
                    cache.v[li][blk, :, slot] = v[cache.heads, 0]
                kc, vc = gather_blocks(caches, li, blocks)  # [nb, kv_heads, bs, d]
                kc = kc.transpose(0, 1).reshape(c.num_kv_heads, -1, c.head_dim)[:, :position + 1 - first]
                vc = vc.transpose(0, 1).reshape(c.num_kv_heads, -1, c.head_dim)[:, :position + 1 - first]
                if first or c.attn_window:  # the window: keys position-W+1..position
                    lo = max(0, position + 1 - c.attn_window - first) if c.attn_window else 0
                    kc, vc = kc[:, lo:], vc[:, lo:]
                kc, vc = kc.contiguous(), vc.contiguous()
                x = x + self._attend(q, kc, vc, causal=False) @ layer.wo
                x = x + self._mlp(layer, x)
            return self._logits(x)[0]

    def decode_step(self, batch: Sequence[DecodeItem], kv: PagedKV | Sequence[PagedKV]) -> list[int]:
        """One engine step over a batch of (last token, position, block ids): the greedy next token of each.

        Each request goes through the same [1, hidden] path (see the module doc: batch invariance)."""
        caches = as_caches(kv)
        return [int(self.decode_logits(t, p, b, caches).argmax()) for t, p, b in batch]

    # --- references -----------------------------------------------------------------------------

    def generate_monolithic(self, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
        """Prefill and decode in one process, on a private cache: the tokens a disaggregated run must match."""
        if max_new_tokens <= 0:
            return []
        c = self.cfg
        total = len(prompt) + max_new_tokens
        kv = PagedKV(c, c.blocks_for(total))
        blocks = list(range(kv.num_blocks))[::-1]  # any block ids will do; not 0..n in order on purpose
        out = [self.prefill(prompt, blocks, kv)]
        while len(out) < max_new_tokens:
            out += self.decode_step([(out[-1], len(prompt) + len(out) - 1, blocks)], kv)
        kv.close()
        return out

    def generate_unpaged(self, prompt: Sequence[int], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
        """Reference without any cache: re-run the full causal forward for every token (slow, for tests)."""
        seq = list(prompt)
        out: list[int] = []
        logits: list[torch.Tensor] = []
        while len(out) < max_new_tokens:
            last = self.forward_full(seq)[0][-1]
            logits.append(last)
            out.append(int(last.argmax()))
            seq.append(out[-1])
        return out, logits


def random_prompt(seed: int, length: int, vocab_size: int = 512) -> list[int]:
    """A reproducible prompt of ``length`` token ids."""
    g = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(0, vocab_size, (length,), generator=g)]
