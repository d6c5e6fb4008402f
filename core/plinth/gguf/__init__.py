"""GGUF files: a direct reader (memory-mapped, zero-copy) and numpy dequantizers."""

from .constants import Arch, BLOCK_SIZES, GGMLType, ValueType
from .quants import dequantize, dequantize_rows
from .reader import GGUFError, GGUFFile, TensorInfo
from .split import SplitGGUF, open_gguf

__all__ = ["Arch", "BLOCK_SIZES", "GGMLType", "GGUFError", "GGUFFile", "SplitGGUF", "TensorInfo", "ValueType",
           "dequantize", "dequantize_rows", "open_gguf"]
