"""The reference model's shape: its sizes, heads and block size, and which KV heads each TP rank holds
(``kv_slice``: contiguous, as in vLLM). The model (model.py) and its paged KV cache (kv.py) share it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TinyConfig:
    vocab_size: int = 512
    num_layers: int = 4
    hidden_size: int = 128
    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 16
    intermediate_size: int = 256
    block_size: int = 16
    max_positions: int = 4096
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    dtype: torch.dtype = torch.float32
    attn_window: int = 0  # sliding-window attention over this many positions (Mistral-style); 0: full causal

    def __post_init__(self) -> None:
        if self.num_heads * self.head_dim != self.hidden_size:
            raise ValueError("num_heads * head_dim must equal hidden_size")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")

    @property
    def dtype_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def kv_heads_per_rank(self, tp_size: int) -> int:
        if tp_size <= 0 or self.num_kv_heads % tp_size:
            raise ValueError(f"tp_size {tp_size} must divide num_kv_heads {self.num_kv_heads}")
        return self.num_kv_heads // tp_size

    def kv_slice(self, tp_rank: int, tp_size: int) -> slice:
        """The KV heads TP rank ``tp_rank`` of ``tp_size`` holds (contiguous, as in vLLM)."""
        n = self.kv_heads_per_rank(tp_size)
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank {tp_rank} out of range for tp_size {tp_size}")
        return slice(tp_rank * n, (tp_rank + 1) * n)

    def q_slice(self, tp_rank: int, tp_size: int) -> slice:
        """The query heads that attend over ``kv_slice(tp_rank, tp_size)`` (GQA groups stay whole)."""
        s = self.kv_slice(tp_rank, tp_size)
        g = self.num_heads // self.num_kv_heads
        return slice(s.start * g, s.stop * g)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


def kv_slice(cfg: TinyConfig, tp_rank: int, tp_size: int) -> slice:
    """Module-level alias of ``TinyConfig.kv_slice``."""
    return cfg.kv_slice(tp_rank, tp_size)
