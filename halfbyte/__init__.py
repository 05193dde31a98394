"""halfbyte: fast inference of quantized Llama-family models."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from halfbyte.errors import HalfbyteError

if TYPE_CHECKING:
    from halfbyte.api import LLM, EngineConfig, RequestOutput, RopeScaling, SamplingParams
    from halfbyte.async_llm import AsyncLLM, StreamDelta

__all__ = [
    "LLM", "AsyncLLM", "StreamDelta", "EngineConfig", "HalfbyteError", "RequestOutput", "RopeScaling",
    "SamplingParams",
]
_ASYNC = ("AsyncLLM", "StreamDelta")
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Lazy: importing a kernel or the CLI's parser does not load the whole engine.
    if name in _ASYNC:
        from halfbyte import async_llm

        return getattr(async_llm, name)
    if name in __all__:
        from halfbyte import api

        return getattr(api, name)
    raise AttributeError(f"module 'halfbyte' has no attribute {name!r}")
