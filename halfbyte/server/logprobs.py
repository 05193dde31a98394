"""Log-probabilities in OpenAI's two shapes, from the engine's per-token {token id: logprob} maps
(the sampled token and the top-N; StreamDelta.extra["logprobs"] when the request asked)."""

from __future__ import annotations

from typing import Any

from halfbyte.io.tokenizer import Tokenizer


class LogprobFormatter:
    def __init__(self, tokenizer: Tokenizer, top_n: int) -> None:
        self.tokenizer = tokenizer
        self.top_n = top_n

    def _piece(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _top(self, sampled: int, lps: dict[int, float]) -> list[tuple[int, float]]:
        ranked = sorted(lps.items(), key=lambda kv: -kv[1])
        return ranked[: self.top_n] if self.top_n else []

    def chat(self, token_ids: list[int], logprobs: list[dict[int, float]]) -> dict[str, Any]:
        """{"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]} (chat completions)."""
        content = []
        for tok, lps in zip(token_ids, logprobs, strict=True):
            piece = self._piece(tok)
            content.append({
                "token": piece, "logprob": lps.get(tok, float("-inf")), "bytes": list(piece.encode()),
                "top_logprobs": [
                    {"token": (p := self._piece(t)), "logprob": lp, "bytes": list(p.encode())}
                    for t, lp in self._top(tok, lps)
                ],
            })
        return {"content": content}

    def completion(self, token_ids: list[int], logprobs: list[dict[int, float]], offset: int) -> dict[str, Any]:
        """{tokens, token_logprobs, top_logprobs, text_offset} (legacy completions); offset: the
        text length before these tokens."""
        tokens, token_lps, tops, offsets = [], [], [], []
        for tok, lps in zip(token_ids, logprobs, strict=True):
            piece = self._piece(tok)
            tokens.append(piece)
            token_lps.append(lps.get(tok, float("-inf")))
            tops.append({self._piece(t): lp for t, lp in self._top(tok, lps)})
            offsets.append(offset)
            offset += len(piece)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}
