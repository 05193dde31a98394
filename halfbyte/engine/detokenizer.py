"""Incremental detokenisation: text deltas that are always valid UTF-8, and stop strings."""

from __future__ import annotations

from typing import Protocol


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Decodes a growing token list into text, emitting only complete characters.

    Byte-level BPE tokens can end inside a multi-byte character; decoding a short window of
    tokens (from prefix_offset) and emitting only what extends past read_offset, and nothing
    ending in U+FFFD, keeps every delta valid and the work per token O(1)."""

    def __init__(self, tokenizer: Decoder, prompt_ids: list[int], stop: list[str], skip_special_tokens: bool) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-6:])  # a little context: some tokenizers strip a leading space
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""  # all output text so far
        self._emitted = 0  # chars of self.text already handed out
        self.stop = stop
        self._holdback = max((len(s) for s in stop), default=1) - 1

    def add_token(self, token_id: int) -> str | None:
        """Append a token; returns the stop string if one now occurs in the text."""
        self._ids.append(token_id)
        prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
        full = self._tok.decode(self._ids[self._prefix_offset :], self._skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            old_len = len(self.text)
            self.text += new
            for s in self.stop:  # only a match that ends in the new text is new
                at = self.text.find(s, max(0, old_len - len(s) + 1))
                if at != -1:
                    self.text = self.text[:at]
                    return s
        return None

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out; while running, hold back a tail that could begin a stop string."""
        end = len(self.text) if finished else max(self._emitted, len(self.text) - self._holdback)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta
