"""A `tokenizers` tokenizer built from GGUF tokenizer metadata (byte-level BPE, "gpt2" model)."""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from halfbyte.errors import UnsupportedModelError

CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types that are special tokens
# llama.cpp's pre-tokenizer names -> the split applied before byte-level BPE
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer(pre: str) -> Any:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact", "codeshell"):  # digits one by one, then GPT-2's split
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("llama-bpe", "llama3", "smaug-bpe"):
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    if pre in ("default", "gpt-2", "gpt2", ""):
        return byte_level
    raise UnsupportedModelError(f"GGUF pre-tokenizer {pre!r} is not supported (supported: smollm, llama-bpe, gpt-2)")


def tokenizer_from_gguf(meta: dict[str, Any]) -> Tokenizer:
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise UnsupportedModelError(f"GGUF tokenizer model {model!r} is not supported (only byte-level BPE 'gpt2')")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "default")))
    tok.decoder = decoders.ByteLevel()
    types = list(meta.get("tokenizer.ggml.token_type", []))
    special = [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED)]
    tok.add_special_tokens(special)
    return tok
