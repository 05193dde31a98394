"""halfbyte: fast inference of quantized Llama-family models."""

from halfbyte.api import LLM, EngineConfig, RequestOutput, RopeScaling, SamplingParams
from halfbyte.errors import HalfbyteError

__all__ = ["LLM", "EngineConfig", "HalfbyteError", "RequestOutput", "RopeScaling", "SamplingParams"]
__version__ = "0.1.0"
