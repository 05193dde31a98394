"""Building a LlamaModel from a Hugging Face-style model directory."""

from __future__ import annotations

from pathlib import Path

import torch
from rich.progress import Progress

from halfbyte.io.safetensors_files import iter_tensors, safetensors_files
from halfbyte.model.config import ModelConfig
from halfbyte.model.llama import LlamaModel
from halfbyte.model.weights import load_hf_weights


def load_model(
    model_dir: Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, show_progress: bool = False
) -> LlamaModel:
    files = safetensors_files(model_dir)
    model = LlamaModel(cfg, dtype, device)
    tensors = iter_tensors(files)
    if show_progress:
        total = sum(1 for _ in model.parameters())
        with Progress(transient=True) as progress:
            task = progress.add_task(f"loading {model_dir.name}", total=total)

            def tracked():  # type: ignore[no-untyped-def]
                for item in tensors:
                    progress.advance(task)
                    yield item

            load_hf_weights(model, tracked())
    else:
        load_hf_weights(model, tensors)
    model.prepare_for_inference()
    return model.eval()
