"""A tiny random Llama saved as a Hugging Face directory with the default model's tokenizer:
fast enough for CLI and error tests, real enough to load through every code path."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import transformers

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def make_tiny_model(out: Path, tokenizer_from: Path, max_position_embeddings: int = 256) -> Path:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, out / name)
    return out
