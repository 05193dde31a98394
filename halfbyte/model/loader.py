"""Building a LlamaModel from a Hugging Face-style model directory."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.progress import Progress

from halfbyte.io.model_dir import read_json, resolve_model_dir
from halfbyte.io.safetensors_files import iter_tensors, safetensors_files
from halfbyte.io.tokenizer import Tokenizer
from halfbyte.model.config import ModelConfig
from halfbyte.model.llama import LlamaModel
from halfbyte.model.rope import RopeScaling
from halfbyte.model.weights import load_hf_weights


@dataclass
class LoadedModel:
    model_dir: Path
    config: ModelConfig
    tokenizer: Tokenizer
    model: LlamaModel


def load_model(
    model_dir: Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, show_progress: bool = False
) -> LlamaModel:
    files = safetensors_files(model_dir)
    tensors: Iterator[tuple[str, torch.Tensor]] = iter_tensors(files)
    quantization = read_json(model_dir / "config.json").get("quantization")
    if quantization is not None:
        from halfbyte.model.quantized_loading import load_quantized_model

        return load_quantized_model(cfg, quantization, tensors, dtype, device)
    model = LlamaModel(cfg, dtype, device)
    if show_progress:
        with Progress(transient=True) as progress:
            task = progress.add_task(f"loading {model_dir.name}", total=sum(1 for _ in model.parameters()))

            def tracked() -> Iterator[tuple[str, torch.Tensor]]:
                for item in tensors:
                    progress.advance(task)
                    yield item

            load_hf_weights(model, tracked())
    else:
        load_hf_weights(model, tensors)
    model.prepare_for_inference()
    return model.eval()


def resolve_loadable(model: str | Path | None, show_progress: bool = False) -> Path:
    """The directory to load for `model`: a halfbyte or dense HF directory as is; a GPTQ / AWQ
    checkpoint directory or a .gguf file imported once into the cache (quant/import_checkpoint.py)."""
    from halfbyte.quant.import_checkpoint import convert_if_foreign  # quant/ builds on model/: import late

    if model is not None:
        path = Path(model).expanduser()
        if path.is_file() and path.suffix.lower() == ".gguf":
            return convert_if_foreign(path, show_progress=show_progress)
    return convert_if_foreign(resolve_model_dir(model), show_progress=show_progress)


def is_quantized(model_dir: Path) -> bool:
    return "quantization" in read_json(model_dir / "config.json")


def load_pretrained(
    model: str | Path | None,
    dtype: torch.dtype,
    device: torch.device,
    rope_scaling: RopeScaling | str | None = None,
    show_progress: bool = False,
) -> LoadedModel:
    """Resolve a model name or path (None: the embedded default), read its config and tokenizer,
    load its weights. rope_scaling overrides the config's."""
    model_dir = resolve_loadable(model, show_progress)
    cfg = ModelConfig.from_hf(read_json(model_dir / "config.json"))
    if rope_scaling is not None:
        scaling = RopeScaling.parse(rope_scaling) if isinstance(rope_scaling, str) else rope_scaling
        cfg = cfg.with_rope_scaling(scaling)
    tokenizer = Tokenizer(model_dir)
    return LoadedModel(model_dir, cfg, tokenizer, load_model(model_dir, cfg, dtype, device, show_progress))
