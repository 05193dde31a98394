"""Teacher-forced scoring: logits at every position of a token sequence, for parity checks and
perplexity / KL evaluation. Runs through the same paged-attention path as generation."""

from __future__ import annotations

import torch

from halfbyte.engine.kv_cache import PagePool
from halfbyte.kernels.attention import AttentionMetadata
from halfbyte.model.llama import LlamaModel


@torch.inference_mode()
def score_tokens(model: LlamaModel, token_ids: list[int], chunk: int | None = None, page_size: int = 16) -> torch.Tensor:
    """fp32 logits [len(token_ids), vocab]. `chunk` splits the prefill into pieces that attend
    to the cached earlier pieces (exercises chunked prefill); None runs it in one pass."""
    n = len(token_ids)
    pool = PagePool(model.cfg, -(-n // page_size), page_size, model.dtype, model.device)
    block_table = list(range(pool.num_pages))
    tables = torch.tensor([block_table], dtype=torch.int32, device=model.device)
    ids = torch.tensor(token_ids, dtype=torch.int64, device=model.device)
    step = chunk or n
    out = []
    for start in range(0, n, step):
        end = min(n, start + step)
        pos = torch.arange(start, end, device=model.device)
        meta = AttentionMetadata(query_start=[0, end - start], seq_lens=[end], block_tables=tables, slot_mapping=pos)
        hidden = model(ids[start:end], pos, pool.kv_caches, meta)
        out.append(model.compute_logits(hidden))
    return torch.cat(out)
