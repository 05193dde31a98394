"""Calibration data for GPTQ: the user's text files, or text sampled from the model itself.

Files: `.jsonl` (one JSON object per line with a "text" string), `.parquet` (a "text" column,
or the first string column; needs pyarrow), anything else is read as UTF-8 plain text.
Without files, the model writes its own calibration text from a few generic prompts
(deterministic: fixed seeds), so conversion needs no download.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from halfbyte.errors import HalfbyteError

MIN_TOKENS = 32  # fewer calibration tokens than this cannot say anything about a layer


class CalibrationError(HalfbyteError):
    """Calibration data is missing, empty, not text, or in an unreadable format."""


# Generic requests spanning prose, explanation, dialogue, lists and code, so that the sampled
# text exercises more than one register of the model.
SELF_PROMPTS: tuple[str, ...] = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how vaccines train the immune system, for a curious teenager.",
    "Describe the history of the printing press and why it mattered.",
    "Write a Python function that returns the prime numbers below n, and explain it.",
    "What are the pros and cons of working from home? Answer as a list.",
    "Write a polite email asking a landlord to repair a broken heater.",
    "Summarise the causes of the French Revolution in a few paragraphs.",
    "Give me a recipe for a vegetable soup, with steps.",
    "Explain the difference between weather and climate.",
    "Write a dialogue between a teacher and a student about fractions.",
    "Describe how a bill becomes a law in a parliamentary democracy.",
    "What should I pack for a week-long hiking trip in the mountains?",
    "Explain what a neural network is, using an analogy.",
    "Write a poem about the ocean at night.",
    "How do I make a budget for my monthly expenses?",
    "Describe the water cycle step by step.",
)


def _read_bytes(path: Path) -> bytes:
    if not path.is_file():
        raise CalibrationError(f"calibration file {path} does not exist")
    return path.read_bytes()


def _decode_text(path: Path, data: bytes) -> str:
    if b"\x00" in data:
        raise CalibrationError(f"calibration file {path} is binary, not text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise CalibrationError(f"calibration file {path} is not UTF-8 text") from None


def _read_jsonl(path: Path) -> list[str]:
    texts = []
    for lineno, line in enumerate(_decode_text(path, _read_bytes(path)).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            raise CalibrationError(f"{path}:{lineno} is not a JSON object") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise CalibrationError(f'{path}:{lineno} has no "text" string')
        texts.append(obj["text"])
    return texts


def _read_parquet(path: Path) -> list[str]:
    if not path.is_file():
        raise CalibrationError(f"calibration file {path} does not exist")
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise CalibrationError(f"reading {path.name} needs pyarrow (pip install pyarrow), or give .txt / .jsonl") from None
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises its own ArrowInvalid / OSError family
        raise CalibrationError(f"{path} is not a readable parquet file ({str(e).splitlines()[0]})") from None
    names = table.column_names
    column = "text" if "text" in names else next(
        (n for n in names if pa.types.is_string(table.schema.field(n).type) or pa.types.is_large_string(table.schema.field(n).type)),
        None,
    )
    if column is None:
        raise CalibrationError(f"{path} has no text column (columns: {', '.join(names) or 'none'})")
    return [t for t in table.column(column).to_pylist() if isinstance(t, str)]


def read_calibration_texts(paths: Sequence[str | Path]) -> list[str]:
    """Every document of every file, in order; a file that yields no text is an error."""
    texts: list[str] = []
    for p in paths:
        path = Path(p)
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            docs = _read_jsonl(path)
        elif suffix == ".parquet":
            docs = _read_parquet(path)
        else:
            docs = [_decode_text(path, _read_bytes(path))]
        docs = [d for d in docs if d.strip()]
        if not docs:
            raise CalibrationError(f"calibration file {path} holds no text")
        texts.extend(docs)
    return texts


def tokenize_texts(texts: Sequence[str], tokenizer: object) -> list[list[int]]:
    """One token list per document, without special tokens (windows cut across documents)."""
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]  # type: ignore[attr-defined]


def sample_model_tokens(
    model_dir: Path, num_prompts: int = len(SELF_PROMPTS), max_tokens: int = 512, seed: int = 0
) -> list[list[int]]:
    """Token ids (chat prompt + sampled answer) of the model answering generic prompts. Fixed
    seeds make the text the same on every run of the same model on the same machine."""
    from halfbyte.api import LLM
    from halfbyte.sampling_params import SamplingParams

    prompts = [SELF_PROMPTS[i % len(SELF_PROMPTS)] for i in range(num_prompts)]
    with LLM(model_dir, dtype="float32", device="cpu") as llm:
        params = [
            # min-p rather than top-p trims the noisy tail without a full vocabulary sort per step
            SamplingParams(max_tokens=max_tokens, temperature=0.8, min_p=0.05, seed=seed + i)
            for i in range(len(prompts))
        ]
        if llm.tokenizer.chat_template is not None:
            outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
        else:
            outs = llm.generate(list(prompts), params)
    return [o.prompt_token_ids + o.token_ids for o in outs]


def calibration_windows(
    docs: Sequence[Sequence[int]], seq_len: int, num_windows: int, separator: int | None = None
) -> list[list[int]]:
    """Concatenate the documents (with `separator` between them), cut the stream into windows
    of seq_len tokens and keep num_windows of them, evenly spaced. A stream shorter than one
    window gives a single shorter window."""
    stream: list[int] = []
    for doc in docs:
        if stream and separator is not None:
            stream.append(separator)
        stream.extend(doc)
    if len(stream) < MIN_TOKENS:
        raise CalibrationError(f"calibration text is only {len(stream)} tokens; give at least {MIN_TOKENS}")
    if len(stream) < seq_len:
        return [stream]
    total = len(stream) // seq_len
    if total <= num_windows:
        picks = list(range(total))
    else:
        picks = [i * total // num_windows for i in range(num_windows)]
    return [stream[i * seq_len : (i + 1) * seq_len] for i in picks]
