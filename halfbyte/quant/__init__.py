"""The halfbyte quantized weight format (docs/format.md), round-to-nearest and GPTQ."""

from halfbyte.quant.gptq import HessianAccumulator, gptq_quantize
from halfbyte.quant.packing import SUPPORTED_BITS, pack, unpack
from halfbyte.quant.qtensor import ALLOWED_GROUP_SIZES, FORMAT_VERSION, QuantSlice, QuantWeight, concat_out
from halfbyte.quant.rtn import quantize_rtn

__all__ = [
    "ALLOWED_GROUP_SIZES",
    "FORMAT_VERSION",
    "SUPPORTED_BITS",
    "HessianAccumulator",
    "QuantSlice",
    "QuantWeight",
    "concat_out",
    "gptq_quantize",
    "pack",
    "quantize_rtn",
    "unpack",
]
