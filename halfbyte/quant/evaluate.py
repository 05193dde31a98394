"""Quality of a (quantized) model on held-out text: perplexity, and the KL divergence of its
next-token distributions from a reference model's, with top-1 agreement.

Text is tokenised without special tokens and cut into consecutive, non-overlapping windows of
`ctx` tokens (the first `windows` of them); each window is scored teacher-forced on its own
(halfbyte.engine.scoring.score_tokens, fp32 logits)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from rich.progress import Progress

from halfbyte.errors import HalfbyteError

if TYPE_CHECKING:
    from halfbyte.model.llama import LlamaModel

_ROWS = 256  # positions per log-softmax chunk: bounds the [rows, vocab] temporaries


class EvalTextError(HalfbyteError):
    """The evaluation text is missing, empty, not text, or too short."""


@dataclass
class PerplexityResult:
    perplexity: float
    mean_nll: float
    tokens: int  # predicted tokens
    windows: int


@dataclass
class KLResult:
    mean_kl: float  # mean over positions of KL(ref || model), nats
    top1_agreement: float  # fraction of positions where both argmaxes agree
    tokens: int
    windows: int


def read_eval_text(path: str | Path) -> str:
    p = Path(path)
    if not p.is_file():
        raise EvalTextError(f"text file {p} does not exist")
    data = p.read_bytes()
    if b"\x00" in data:
        raise EvalTextError(f"text file {p} is binary, not text")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise EvalTextError(f"text file {p} is not UTF-8 text") from None
    if not text.strip():
        raise EvalTextError(f"text file {p} is empty")
    return text


def eval_windows(token_ids: Sequence[int], ctx: int, windows: int | None = None) -> list[list[int]]:
    """Consecutive windows of ctx tokens (a shorter last one only if it is the only one)."""
    if ctx < 2:
        raise EvalTextError(f"--ctx must be at least 2, got {ctx}")
    if windows is not None and windows < 1:
        raise EvalTextError(f"--windows must be at least 1, got {windows}")
    ids = list(token_ids)
    if len(ids) < 2:
        raise EvalTextError(f"the text is only {len(ids)} tokens; need at least 2")
    out = [ids[i : i + ctx] for i in range(0, len(ids) - ctx + 1, ctx)] or [ids]
    return out[:windows] if windows is not None else out


def _progress(total: int, what: str, show: bool) -> tuple[Progress | None, object]:
    if not show:
        return None, None
    progress = Progress(transient=True)
    progress.start()
    return progress, progress.add_task(what, total=total)


def perplexity(model: LlamaModel, windows: list[list[int]], show_progress: bool = False) -> PerplexityResult:
    """exp(mean negative log-likelihood) of every token after the first of each window."""
    from halfbyte.engine.scoring import score_tokens

    nll_sum = 0.0
    count = 0
    progress, task = _progress(len(windows), "perplexity", show_progress)
    try:
        for ids in windows:
            logits = score_tokens(model, ids)  # [n, vocab] fp32
            targets = torch.tensor(ids[1:], dtype=torch.long)
            for r0 in range(0, len(ids) - 1, _ROWS):
                r1 = min(r0 + _ROWS, len(ids) - 1)
                logp = torch.log_softmax(logits[r0:r1].double(), dim=-1)
                nll_sum -= float(logp.gather(1, targets[r0:r1, None]).sum())
            count += len(ids) - 1
            if progress is not None:
                progress.advance(task)  # type: ignore[arg-type]
    finally:
        if progress is not None:
            progress.stop()
    mean = nll_sum / count
    return PerplexityResult(math.exp(mean), mean, count, len(windows))


def kl_divergence(
    model: LlamaModel, reference: LlamaModel, windows: list[list[int]], show_progress: bool = False
) -> KLResult:
    """KL(reference || model) of the next-token distributions at every position, and how often
    their top-1 tokens agree."""
    from halfbyte.engine.scoring import score_tokens

    kl_sum = 0.0
    agree = 0
    count = 0
    progress, task = _progress(len(windows), "KL divergence", show_progress)
    try:
        for ids in windows:
            q_logits = score_tokens(model, ids)
            r_logits = score_tokens(reference, ids)
            for r0 in range(0, len(ids), _ROWS):
                r1 = min(r0 + _ROWS, len(ids))
                logp_r = torch.log_softmax(r_logits[r0:r1].double(), dim=-1)
                logp_q = torch.log_softmax(q_logits[r0:r1].double(), dim=-1)
                kl_sum += float((logp_r.exp() * (logp_r - logp_q)).sum())
                agree += int((r_logits[r0:r1].argmax(-1) == q_logits[r0:r1].argmax(-1)).sum())
            count += len(ids)
            if progress is not None:
                progress.advance(task)  # type: ignore[arg-type]
    finally:
        if progress is not None:
            progress.stop()
    return KLResult(kl_sum / count, agree / count, count, len(windows))


def load_for_eval(model: str | Path) -> object:
    """A model loaded for scoring on the CPU in fp32 (quantized directories load quantized)."""
    import torch as _torch

    from halfbyte.model.loader import load_pretrained

    return load_pretrained(model, _torch.float32, _torch.device("cpu"))


def evaluate_perplexity(
    model: str | Path, text_file: str | Path, ctx: int = 1024, windows: int | None = None, show_progress: bool = False
) -> PerplexityResult:
    loaded = load_for_eval(model)
    ids = loaded.tokenizer.encode(read_eval_text(text_file), add_special_tokens=False)  # type: ignore[attr-defined]
    return perplexity(loaded.model, eval_windows(ids, ctx, windows), show_progress)  # type: ignore[attr-defined]


def evaluate_kl(
    model: str | Path,
    reference: str | Path,
    text_file: str | Path,
    ctx: int = 1024,
    windows: int | None = None,
    show_progress: bool = False,
) -> KLResult:
    q = load_for_eval(model)
    r = load_for_eval(reference)
    if q.config.vocab_size != r.config.vocab_size:  # type: ignore[attr-defined]
        raise EvalTextError(
            f"the models' vocabularies differ ({q.config.vocab_size} vs {r.config.vocab_size}); KL needs the same tokens"  # type: ignore[attr-defined]
        )
    ids = r.tokenizer.encode(read_eval_text(text_file), add_special_tokens=False)  # type: ignore[attr-defined]
    return kl_divergence(q.model, r.model, eval_windows(ids, ctx, windows), show_progress)  # type: ignore[attr-defined]
