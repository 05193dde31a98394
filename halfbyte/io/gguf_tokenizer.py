"""A `tokenizers` tokenizer built from a GGUF file's tokenizer metadata: byte-level BPE
(tokenizer.ggml.model "gpt2") or sentencepiece-style BPE ("llama")."""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from halfbyte.errors import CorruptFileError, UnsupportedModelError

# llama.cpp's token types (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Llama 3's split: digits in runs of up to three, letters with one leading non-letter.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp pre-tokenizer names (tokenizer.ggml.pre), grouped by the split they mean
_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact", "codeshell"}
_LLAMA3 = {"llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "pixtral"}
_GPT2 = {"default", "gpt-2", "gpt2"}


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte: printable Latin-1 bytes stand for themselves,
    the rest map to code points from 256 up, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _byte_level_pre_tokenizer(pre: str) -> Any:
    if pre in _DIGITS_THEN_GPT2:  # llama.cpp splits every digit first, then GPT-2's regex
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    if pre in _LLAMA3:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    if pre in _GPT2:  # llama.cpp's "default" is its own regex set; GPT-2's is what transformers uses too
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    supported = ", ".join(sorted(_DIGITS_THEN_GPT2 | _LLAMA3 | _GPT2))
    raise UnsupportedModelError(f"GGUF pre-tokenizer {pre!r} is not supported (supported: {supported})")


def _byte_level(tokens: list[str], types: list[int], meta: dict[str, Any]) -> Tokenizer:
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        # Some converters store plain tokens as raw text; BPE only reaches them in byte spelling.
        # Control and user-defined tokens stay raw: they are matched whole in the text.
        if not set(token) <= spelled and types[i] not in (CONTROL, USER_DEFINED):
            token = "".join(alphabet[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, i)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    if any(len(m) != 2 for m in merges):
        raise CorruptFileError("GGUF tokenizer.ggml.merges holds an entry that is not a pair")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _byte_level_pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "default")))
    tok.decoder = decoders.ByteLevel()
    return tok


def _merges_from_scores(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Sentencepiece BPE merges a pair into the piece with the best score; as BPE merges that is
    every split of a piece into two pieces of the vocabulary, ranked by the piece's score."""
    ids = {t: i for i, t in enumerate(tokens) if types[i] in (NORMAL, USER_DEFINED, UNUSED)}
    ranked: list[tuple[float, int, int, int, int, str, str]] = []
    for piece, i in ids.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                ranked.append((-scores[i], -len(left), -len(right), ids[left], ids[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _sentencepiece(tokens: list[str], types: list[int], meta: dict[str, Any]) -> Tokenizer:
    scores = [float(s) for s in meta.get("tokenizer.ggml.scores", [0.0] * len(tokens))]
    vocab = {t: i for i, t in enumerate(tokens)}
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None and 0 <= int(unk_id) < len(tokens) else None
    tok = Tokenizer(models.BPE(
        vocab=vocab, merges=_merges_from_scores(tokens, scores, types), unk_token=unk, fuse_unk=True, byte_fallback=True,
    ))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if prefix else "never", split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1, right=0)] if prefix else []))
    return tok


def _post_processor(tokens: list[str], meta: dict[str, Any], add_bos: bool) -> Any:
    """BOS/EOS added by the tokenizer itself when the file asks for them."""
    pieces: list[tuple[str, int]] = []
    single, pair = ["$A"], ["$A", "$B"]
    for key, wanted, at_start in (("bos", add_bos, True), ("eos", bool(meta.get("tokenizer.ggml.add_eos_token")), False)):
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        if not wanted or i is None or not 0 <= int(i) < len(tokens):
            continue
        pieces.append((tokens[int(i)], int(i)))
        single = [tokens[int(i)], *single] if at_start else [*single, tokens[int(i)]]
        pair = [tokens[int(i)], *pair] if at_start else [*pair, tokens[int(i)]]
    if not pieces:
        return None
    pair_spec = " ".join(f"{p}:1" if p == "$B" else p for p in pair)
    return processors.TemplateProcessing(single=" ".join(single), pair=pair_spec, special_tokens=pieces)


def add_bos_default(meta: dict[str, Any]) -> bool:
    """llama.cpp adds BOS for sentencepiece vocabularies that do not say otherwise."""
    return bool(meta.get("tokenizer.ggml.add_bos_token", meta.get("tokenizer.ggml.model") == "llama"))


def tokenizer_from_gguf(meta: dict[str, Any]) -> Tokenizer:
    """The tokenizer a GGUF describes, with its control tokens as special added tokens."""
    model = meta.get("tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise UnsupportedModelError(f"GGUF tokenizer model {model!r} is not supported (only 'gpt2' and 'llama')")
    tokens: list[str] = [str(t) for t in meta.get("tokenizer.ggml.tokens", [])]
    if not tokens:
        raise CorruptFileError("GGUF metadata has no tokenizer.ggml.tokens")
    types = [int(t) for t in meta.get("tokenizer.ggml.token_type", [NORMAL] * len(tokens))]
    if len(types) != len(tokens):
        raise CorruptFileError(f"GGUF has {len(tokens)} tokens but {len(types)} token types")
    tok = _byte_level(tokens, types, meta) if model == "gpt2" else _sentencepiece(tokens, types, meta)
    # Control tokens (<|im_start|>) are special: skipped when decoding with skip_special_tokens.
    # User-defined ones (<think>) are matched whole but are text, as llama.cpp treats them.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED])
    post = _post_processor(tokens, meta, add_bos_default(meta))
    if post is not None:
        tok.post_processor = post
    return tok
