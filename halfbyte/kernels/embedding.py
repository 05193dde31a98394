"""Token embedding lookup (the vocab-parallel variant will mask and all-reduce around this)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def embedding_ref(token_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """token_ids [T] -> [T, hidden]."""
    return F.embedding(token_ids, table)


def embedding(token_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return embedding_ref(token_ids, table)
