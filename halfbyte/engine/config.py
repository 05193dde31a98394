"""EngineConfig: how the engine runs a model (device, dtype, memory), validated at the edge."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from halfbyte.errors import InvalidParameterError

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise InvalidParameterError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidParameterError("device 'cuda' was asked for but no CUDA device is available")
    if dev.type not in ("cpu", "cuda"):
        raise InvalidParameterError(f"device must be 'cpu' or 'cuda', got {device!r}")
    return dev


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, quantized: bool = False) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise InvalidParameterError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
        return dtype
    if dtype == "auto":
        # fp32 on the CPU: the reference path, and bf16 matmuls are slow on most CPUs. On CUDA,
        # quantized models run fp16 activations (the fp16x2 4-bit kernels; exllamav2 does the
        # same), dense ones bf16
        if device.type != "cuda":
            return torch.float32
        return torch.float16 if quantized else torch.bfloat16
    if dtype not in _DTYPES:
        raise InvalidParameterError(f"dtype must be one of auto, float32, bfloat16, float16; got {dtype!r}")
    return _DTYPES[dtype]


@dataclass
class EngineConfig:
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    # KV-cache size: an explicit token budget wins; else on CUDA the pages fill
    # gpu_memory_utilization of the GPU's memory (after weights and activation headroom);
    # else (CPU) max_model_len tokens. At least 16 pages either way.
    kv_cache_tokens: int | None = None
    gpu_memory_utilization: float = 0.9
    page_size: int = 16
    max_num_seqs: int = 64
    max_batch_tokens: int = 8192  # tokens per step: decodes + prefill chunks
    enable_prefix_caching: bool = True
    # launch the next decode step before reading this one's tokens (engine/launched_step.py);
    # None: on CUDA without tensor parallelism
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        for name in ("max_model_len", "kv_cache_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise InvalidParameterError(f"{name} must be a positive integer, got {value!r}")
        if self.page_size not in (8, 16, 32, 64, 128, 256):
            raise InvalidParameterError(f"page_size must be a power of two in 8..256, got {self.page_size!r}")
        if self.max_num_seqs < 1:
            raise InvalidParameterError(f"max_num_seqs must be >= 1, got {self.max_num_seqs!r}")
        if not isinstance(self.gpu_memory_utilization, (int, float)) or not 0 < self.gpu_memory_utilization <= 1:
            raise InvalidParameterError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.max_batch_tokens < 1:
            raise InvalidParameterError(f"max_batch_tokens must be >= 1, got {self.max_batch_tokens!r}")
