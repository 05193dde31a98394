"""Incremental detokenisation: valid UTF-8 deltas that add up to the full decode; stop strings."""

from __future__ import annotations

from pathlib import Path

import pytest

from halfbyte.engine.detokenizer import IncrementalDetokenizer
from halfbyte.io.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Tokenizer:
    return Tokenizer(default_model_dir)


@pytest.mark.parametrize("text", ["Hello, world! Ünïcödé 漢字 and emoji 🦙🚀 done.", "  spaces\n\ttabs 12345"])
def test_deltas_concatenate_to_full_decode(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, [1, 2], stop=[], skip_special_tokens=True)
    deltas = []
    for t in ids:
        assert detok.add_token(t) is None
        d = detok.take_delta(finished=False)
        assert "\ufffd" not in d
        deltas.append(d)
    deltas.append(detok.take_delta(finished=True))
    assert "".join(deltas) == tokenizer.decode(ids)


def test_text_with_split_characters_exercises_the_holdback(tokenizer: Tokenizer) -> None:
    """The emoji/CJK text really has characters split across tokens (a lone token decodes to
    U+FFFD), so the test above checks what it claims to."""
    ids = tokenizer.encode("Hello, world! Ünïcödé 漢字 and emoji 🦙🚀 done.")
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)


def test_stop_string_truncates_and_is_never_streamed(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("The answer is 42. END of story")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["END"], skip_special_tokens=True)
    streamed = []
    hit = None
    for t in ids:
        hit = detok.add_token(t)
        streamed.append(detok.take_delta(finished=hit is not None))
        if hit:
            break
    assert hit == "END"
    assert "".join(streamed) == "The answer is 42. "
